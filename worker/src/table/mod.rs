//! The columnar path: a Parquet split's rows as Arrow columns, run through the feature ops
//! column at a time (`ops`, `apply`) and gathered into batch tensors (`batch`) without ever
//! becoming one element per row. The engine takes it when the source is Parquet and every op
//! is columnar (`Transform::is_columnar`); rows of a table go through the shuffle buffer and
//! the batcher as references into it (`TableRow`), with their provenance, like any other.

pub mod apply;
pub mod batch;
pub mod column;
pub mod dictionary;
pub mod ops;

use std::collections::BTreeMap;
use std::sync::Arc;

use arrow_array::{Array, ArrayRef, RecordBatch, UInt32Array};

/// Rows of a split in columns, each row with its position in the split.
#[derive(Debug, Clone, Default)]
pub struct Table {
    pub positions: Vec<u64>,
    pub columns: BTreeMap<String, ArrayRef>,
    /// What the ops made of its dictionaries, shared with its slices and the tables taken
    /// from it.
    pub memo: Arc<dictionary::Memo>,
}

impl Table {
    /// The record batches of a split read, rows numbered from 0 in read order. Batches of
    /// different schemas (files of one source that differ) are an error naming the column;
    /// a column read as a dictionary from one file and plain from another is joined plain.
    pub fn from_batches(batches: &[RecordBatch]) -> Result<Table, String> {
        let Some(first) = batches.first() else { return Ok(Table::default()) };
        let schema = first.schema();
        let mut columns = BTreeMap::new();
        for (index, field) in schema.fields().iter().enumerate() {
            let parts: Vec<ArrayRef> = batches.iter().map(|b| b.column(index).clone()).collect();
            let parts = column::same_type(parts).map_err(|(_, other)| {
                format!(
                    "column {:?} is {} in one file and {other} in another of the split",
                    field.name(),
                    field.data_type()
                )
            })?;
            let parts: Vec<&dyn Array> = parts.iter().map(|p| p.as_ref()).collect();
            let joined = arrow_select::concat::concat(&parts).map_err(|e| format!("column {:?}: {e}", field.name()))?;
            columns.insert(field.name().clone(), joined);
        }
        let rows: usize = batches.iter().map(RecordBatch::num_rows).sum();
        Ok(Table { positions: (0..rows as u64).collect(), columns, memo: dictionary::Memo::new(rows) })
    }

    pub fn len(&self) -> usize {
        self.positions.len()
    }

    pub fn is_empty(&self) -> bool {
        self.positions.is_empty()
    }

    /// The rows at `indices`, in that order (a shuffle, or the rows a filter keeps).
    pub fn take(&self, indices: &[u32]) -> Table {
        let at = UInt32Array::from(indices.to_vec());
        let columns = (self.columns.iter())
            .map(|(name, c)| (name.clone(), arrow_select::take::take(c.as_ref(), &at, None).expect("indices in range")))
            .collect();
        let positions = indices.iter().map(|&i| self.positions[i as usize]).collect();
        Table { positions, columns, memo: self.memo.clone() }
    }

    /// `len` rows from `offset`, sharing this table's buffers.
    pub fn slice(&self, offset: usize, len: usize) -> Table {
        Table {
            positions: self.positions[offset..offset + len].to_vec(),
            columns: self.columns.iter().map(|(name, c)| (name.clone(), c.slice(offset, len))).collect(),
            memo: self.memo.clone(),
        }
    }

    /// Bytes the table's columns hold (its buffers, slices counting what they keep alive).
    pub fn bytes(&self) -> usize {
        self.columns.values().map(|c| c.get_array_memory_size()).sum()
    }

    /// Its rows as the batcher takes them: each a reference into the table.
    pub fn into_rows(self) -> Vec<(u64, TableRow)> {
        let positions = self.positions.clone();
        let table = Arc::new(self);
        let share = table.bytes() / table.len().max(1);
        positions
            .into_iter()
            .enumerate()
            .map(|(i, position)| (position, TableRow { table: table.clone(), index: i as u32, share }))
            .collect()
    }
}

/// A row of a table, as the shuffle buffer and the batcher hold it.
#[derive(Debug, Clone)]
pub struct TableRow {
    pub table: Arc<Table>,
    pub index: u32,
    /// The row's share of the table's bytes, what its budget reservation counts.
    pub share: usize,
}

#[cfg(test)]
mod tests {
    use arrow_array::builder::StringDictionaryBuilder;
    use arrow_array::cast::AsArray;
    use arrow_array::types::Int32Type;
    use arrow_array::{Int64Array, StringArray};

    use super::*;

    #[test]
    fn a_split_of_a_dictionary_file_and_a_plain_one_is_joined_plain() {
        let mut keyed = StringDictionaryBuilder::<Int32Type>::new();
        keyed.append_value("a");
        keyed.append_null();
        let keyed = RecordBatch::try_from_iter([("c", Arc::new(keyed.finish()) as ArrayRef)]).unwrap();
        let plain = RecordBatch::try_from_iter([("c", Arc::new(StringArray::from(vec!["b"])) as ArrayRef)]).unwrap();
        let table = Table::from_batches(&[keyed.clone(), plain]).unwrap();
        let c = table.columns["c"].as_string::<i32>();
        assert_eq!(c.iter().collect::<Vec<_>>(), [Some("a"), None, Some("b")]);
        assert_eq!(table.positions, [0, 1, 2]);
        // Only dictionary against plain is joined: other differences name the column.
        let ints = RecordBatch::try_from_iter([("c", Arc::new(Int64Array::from(vec![1])) as ArrayRef)]).unwrap();
        let e = Table::from_batches(&[keyed, ints]).unwrap_err();
        assert!(e.contains("column \"c\""), "{e}");
    }
}
