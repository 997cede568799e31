//! A batch of table rows into tensors, column at a time: each column's rows gathered from
//! their tables in the batch's order (`interleave`), then laid out as one tensor. Numbers
//! keep the element path's types (integers and booleans int64, floats as they are), strings
//! and binary are text (`bytes`), a `concat` vector is [batch, n], and lists are [batch,
//! length], padded to the longest with `padValue` (empty strings for text) or refused
//! without one when their lengths differ, unless the pipeline lists them as `jagged`: then
//! their offsets and their values as they are ([`Layout::Jagged`]).

use std::collections::BTreeMap;
use std::sync::Arc;

use arrow_array::cast::AsArray;
use arrow_array::types::{Float32Type, Float64Type, Int64Type};
use arrow_array::{Array, ArrayRef};
use arrow_schema::DataType;
use bytes::Bytes;
use stoker_api::{DType, Layout, Stacked, Tensor};

use super::TableRow;
use super::column;
use crate::engine::{BatchError, Shaping};

/// The batch's tensors of `rows`, by field.
pub fn stack(rows: &[&TableRow], shaping: &Shaping) -> Result<BTreeMap<String, Stacked>, BatchError> {
    let Some(first) = rows.first() else { return Ok(BTreeMap::new()) };
    // Each table once, and each row as (table, row in it).
    let mut tables: Vec<&Arc<super::Table>> = Vec::new();
    let mut at = Vec::with_capacity(rows.len());
    for row in rows {
        let t = match tables.iter().position(|t| Arc::ptr_eq(t, &row.table)) {
            Some(t) => t,
            None => {
                tables.push(&row.table);
                tables.len() - 1
            }
        };
        at.push((t, row.index as usize));
    }
    if let Some(extra) = tables.iter().flat_map(|t| t.columns.keys()).find(|k| !first.table.columns.contains_key(*k)) {
        return Err(BatchError::MissingField { field: extra.clone() });
    }
    // Consecutive rows of a table (an unshuffled batch, whose rows come from one table or
    // from the pieces the ops split it into) are copied as one run per column: a gather row
    // by row was most of the batcher thread's time on DLRM's 27 columns.
    let runs = runs(&at);
    let long_runs = runs.len() * RUN_ROWS <= at.len();
    let mut tensors = BTreeMap::new();
    for field in first.table.columns.keys() {
        let parts: Vec<ArrayRef> = (tables.iter())
            .map(|t| t.columns.get(field).cloned().ok_or_else(|| BatchError::MissingField { field: field.clone() }))
            .collect::<Result<_, _>>()?;
        let parts = column::same_type(parts).map_err(|(first, other)| BatchError::ColumnTypes {
            field: field.clone(),
            first: first.to_string(),
            other: other.to_string(),
        })?;
        let parts: Vec<&dyn Array> = parts.iter().map(|p| p.as_ref()).collect();
        let gathered = column::plain(&gather(&parts, &at, long_runs.then_some(&runs)));
        let tensor = match shaping.jagged.contains(field) {
            true => jagged(field, &gathered)?,
            false => tensor(field, &gathered, shaping.pad)?.into(),
        };
        tensors.insert(field.clone(), tensor);
    }
    Ok(tensors)
}

/// Rows per run, on average, from which a batch is copied run by run rather than gathered row
/// by row.
const RUN_ROWS: usize = 8;

/// The batch's rows (table, row) as runs of consecutive rows of one table: (table, first row,
/// rows).
fn runs(at: &[(usize, usize)]) -> Vec<(usize, usize, usize)> {
    let mut runs: Vec<(usize, usize, usize)> = Vec::new();
    for &(table, row) in at {
        match runs.last_mut() {
            Some((t, start, len)) if *t == table && *start + *len == row => *len += 1,
            _ => runs.push((table, row, 1)),
        }
    }
    runs
}

/// The rows `at` (table, row) of `parts` (one column of each table), in buffers of the batch's
/// own, also when its rows are a run of one table (no shuffle): a slice would keep the whole
/// table alive for as long as the batch waits for its client, and the budget counts only the
/// batch's bytes. Copied run by run where `runs` are given, except runs of several dictionary
/// columns: a copy would join their dictionaries whole, where a gather joins what it takes.
fn gather(parts: &[&dyn Array], at: &[(usize, usize)], runs: Option<&Vec<(usize, usize, usize)>>) -> ArrayRef {
    let dictionaries = parts.len() > 1 && matches!(parts[0].data_type(), DataType::Dictionary(..));
    match runs {
        Some(runs) if !dictionaries => copy_runs(parts, runs, at.len()),
        _ => arrow_select::interleave::interleave(parts, at).expect("rows within their tables"),
    }
}

/// `runs` of `parts` (one column of each table) copied, in order, into buffers of their own.
fn copy_runs(parts: &[&dyn Array], runs: &[(usize, usize, usize)], rows: usize) -> ArrayRef {
    let data: Vec<arrow_data::ArrayData> = parts.iter().map(|p| p.to_data()).collect();
    let mut copy = arrow_data::transform::MutableArrayData::new(data.iter().collect(), false, rows);
    for &(table, start, len) in runs {
        copy.try_extend(table, start, start + len).expect("runs within their tables, of a batch's size");
    }
    arrow_array::make_array(copy.freeze())
}

/// One column of the batch as a tensor whose first dimension is the rows.
fn tensor(field: &str, column: &ArrayRef, pad: Option<f64>) -> Result<Tensor, BatchError> {
    if column.logical_null_count() > 0 {
        return Err(BatchError::Null { field: field.into() });
    }
    let rows = column.len();
    match column.data_type() {
        DataType::FixedSizeList(_, width) => {
            let list = column.as_fixed_size_list();
            let values = column::plain(&list.values().slice(list.offset() * *width as usize, rows * *width as usize));
            let flat = flat(field, &values, vec![rows * *width as usize])?;
            Ok(Tensor::new(flat.dtype, vec![rows, *width as usize], flat.data).expect("rows × width values"))
        }
        DataType::List(_) => lists(field, column.as_list::<i32>(), pad),
        DataType::LargeList(_) => lists(field, column.as_list::<i64>(), pad),
        _ => flat(field, column, vec![rows]),
    }
}

/// A column of lists as a jagged tensor: their offsets, then their values, each row's list
/// as it is.
fn jagged(field: &str, column: &ArrayRef) -> Result<Stacked, BatchError> {
    if column.logical_null_count() > 0 {
        return Err(BatchError::Null { field: field.into() });
    }
    let (values, offsets): (ArrayRef, Vec<i64>) = match column.data_type() {
        DataType::List(_) => {
            let (values, offsets) = column::list_values(column.as_list::<i32>());
            (values, offsets.iter().map(|o| i64::from(*o)).collect())
        }
        DataType::LargeList(_) => {
            let (values, offsets) = column::list_values(column.as_list::<i64>());
            (values, offsets.to_vec())
        }
        DataType::FixedSizeList(_, width) => {
            let list = column.as_fixed_size_list();
            let width = *width as usize;
            let values = list.values().slice(list.offset() * width, list.len() * width);
            (values, (0..=list.len()).map(|i| (i * width) as i64).collect())
        }
        other => return Err(BatchError::NotJagged { field: field.into(), what: format!("a column of {other}") }),
    };
    if values.logical_null_count() > 0 {
        return Err(BatchError::Null { field: field.into() });
    }
    let values = column::plain(&values);
    if column::byte_strings(&values).is_some() {
        let what = format!("a column of {}", column.data_type());
        return Err(BatchError::NotJagged { field: field.into(), what });
    }
    let flat = flat(field, &values, vec![values.len()])?;
    let offsets = Bytes::from(offsets.iter().flat_map(|o| o.to_le_bytes()).collect::<Vec<u8>>());
    Ok(Stacked {
        dtype: flat.dtype,
        shape: vec![column.len()],
        parts: vec![offsets, flat.data],
        layout: Layout::Jagged,
    })
}

/// A column of scalars (or a list's values) as a tensor of `shape`.
fn flat(field: &str, column: &ArrayRef, shape: Vec<usize>) -> Result<Tensor, BatchError> {
    let tensor = match column.data_type() {
        DataType::Float32 => Tensor::new(
            DType::Float32,
            shape,
            Bytes::from_owner(column.as_primitive::<Float32Type>().values().inner().clone()),
        ),
        DataType::Float64 => Tensor::new(
            DType::Float64,
            shape,
            Bytes::from_owner(column.as_primitive::<Float64Type>().values().inner().clone()),
        ),
        DataType::Int64 => Tensor::new(
            DType::Int64,
            shape,
            Bytes::from_owner(column.as_primitive::<Int64Type>().values().inner().clone()),
        ),
        _ => {
            if let Some(strings) = column::byte_strings(column) {
                return Ok(Tensor::strings(shape, &strings).expect("one string per item"));
            }
            let values = column::integers(column).ok_or_else(|| BatchError::ColumnType {
                field: field.into(),
                data_type: column.data_type().to_string(),
            })?;
            Tensor::new(DType::Int64, shape, Bytes::from_owner(arrow_buffer::Buffer::from_vec(values)))
        }
    };
    Ok(tensor.expect("the values fill the shape"))
}

/// Lists as [rows, length]: as they are when every row is as long, else padded to the
/// longest with `pad`.
fn lists<O: arrow_array::OffsetSizeTrait>(
    field: &str,
    list: &arrow_array::GenericListArray<O>,
    pad: Option<f64>,
) -> Result<Tensor, BatchError> {
    let (values, offsets) = column::list_values(list);
    if values.logical_null_count() > 0 {
        return Err(BatchError::Null { field: field.into() });
    }
    let lengths: Vec<usize> = offsets.windows(2).map(|w| (w[1] - w[0]).as_usize()).collect();
    let longest = lengths.iter().copied().max().unwrap_or(0);
    let rows = lengths.len();
    if lengths.iter().all(|l| *l == longest) {
        return flat(field, &column::plain(&values), vec![rows, longest]);
    }
    let Some(pad) = pad else {
        let (first, other) = (lengths[0], *lengths.iter().find(|l| **l != lengths[0]).expect("lengths differ"));
        return Err(BatchError::ShapeMismatch { field: field.into(), first: vec![first], other: vec![other] });
    };
    // The items of each row, then the padding: one index per slot, None for padding.
    let mut slots = Vec::with_capacity(rows * longest);
    for (row, length) in lengths.iter().enumerate() {
        let start = offsets[row].as_usize();
        slots.extend((start..start + length).map(|i| Some(i as u32)));
        slots.extend(std::iter::repeat_n(None, longest - length));
    }
    let taken = arrow_select::take::take(values.as_ref(), &arrow_array::UInt32Array::from(slots), None)
        .expect("indices within the values");
    let taken = column::plain(&taken);
    let shape = vec![rows, longest];
    if let Some(strings) = column::byte_strings(&taken) {
        return Ok(Tensor::strings(shape, &strings).expect("one string per slot"));
    }
    let padded = taken.nulls().cloned();
    let is_pad = |i: usize| padded.as_ref().is_some_and(|n| n.is_null(i));
    let data: Vec<u8> = match taken.data_type() {
        DataType::Float32 => (taken.as_primitive::<Float32Type>().values().iter().enumerate())
            .flat_map(|(i, v)| if is_pad(i) { pad as f32 } else { *v }.to_le_bytes())
            .collect(),
        DataType::Float64 => (taken.as_primitive::<Float64Type>().values().iter().enumerate())
            .flat_map(|(i, v)| if is_pad(i) { pad } else { *v }.to_le_bytes())
            .collect(),
        _ => {
            let values = column::integers(&taken).ok_or_else(|| BatchError::ColumnType {
                field: field.into(),
                data_type: taken.data_type().to_string(),
            })?;
            values.iter().enumerate().flat_map(|(i, v)| if is_pad(i) { pad as i64 } else { *v }.to_le_bytes()).collect()
        }
    };
    let dtype = match taken.data_type() {
        DataType::Float32 => DType::Float32,
        DataType::Float64 => DType::Float64,
        _ => DType::Int64,
    };
    Ok(Tensor::new(dtype, shape, Bytes::from(data)).expect("rows × longest values"))
}

#[cfg(test)]
mod tests {
    use arrow_array::builder::{FixedSizeListBuilder, Int32Builder, ListBuilder, StringBuilder};

    use super::*;
    use crate::table::Table;

    fn rows(columns: Vec<(&str, ArrayRef)>) -> Vec<TableRow> {
        let len = columns[0].1.len();
        let columns = columns.into_iter().map(|(n, c)| (n.to_string(), c)).collect();
        let table = Table { positions: (0..len as u64).collect(), columns, ..Table::default() };
        table.into_rows().into_iter().map(|(_, row)| row).collect()
    }

    fn jagged_ids() -> Shaping {
        Shaping { pad: None, jagged: ["ids".to_string()].into() }
    }

    fn offsets_and_values(t: &Stacked) -> (Vec<i64>, Vec<i32>) {
        let t = Tensor::with_layout(t.dtype, t.layout, t.shape.clone(), t.join().data).unwrap();
        let (offsets, values) = t.jagged_parts().unwrap();
        let offsets = offsets.chunks(8).map(|c| i64::from_le_bytes(c.try_into().unwrap())).collect();
        // Integers are int64 in the batch.
        let values = values.chunks(8).map(|c| i64::from_le_bytes(c.try_into().unwrap()) as i32).collect();
        (offsets, values)
    }

    #[test]
    fn list_columns_in_jagged_keep_each_rows_list_in_the_batchs_order() {
        let mut ids = ListBuilder::new(Int32Builder::new());
        for list in [&[1, 2, 3][..], &[], &[4], &[5, 6]] {
            ids.values().append_slice(list);
            ids.append(true);
        }
        let rows = rows(vec![("ids", Arc::new(ids.finish()))]);
        // Shuffled: the batch takes rows 3, 0, 1.
        let batch = stack(&[&rows[3], &rows[0], &rows[1]], &jagged_ids()).unwrap();
        let t = &batch["ids"];
        assert_eq!((t.layout, t.shape.clone(), t.dtype), (Layout::Jagged, vec![3], DType::Int64));
        assert_eq!(offsets_and_values(t), (vec![0, 2, 5, 5], vec![5, 6, 1, 2, 3]));
        // Without `jagged` the same rows need a padValue.
        assert!(matches!(stack(&[&rows[3], &rows[0]], &Shaping::default()), Err(BatchError::ShapeMismatch { .. })));
    }

    #[test]
    fn fixed_size_lists_are_jagged_too_and_text_or_scalars_are_refused() {
        let mut fixed = FixedSizeListBuilder::new(Int32Builder::new(), 2);
        for pair in [[1, 2], [3, 4]] {
            fixed.values().append_slice(&pair);
            fixed.append(true);
        }
        let rows_fixed = rows(vec![("ids", Arc::new(fixed.finish()))]);
        let t = &stack(&[&rows_fixed[1], &rows_fixed[0]], &jagged_ids()).unwrap()["ids"];
        assert_eq!(offsets_and_values(t), (vec![0, 2, 4], vec![3, 4, 1, 2]));

        let mut text = ListBuilder::new(StringBuilder::new());
        text.values().append_value("a");
        text.append(true);
        let rows_text = rows(vec![("ids", Arc::new(text.finish()))]);
        let e = stack(&[&rows_text[0]], &jagged_ids()).unwrap_err();
        assert!(e.to_string().contains("spec.jagged"), "{e}");
        let scalars = rows(vec![("ids", Arc::new(arrow_array::Int64Array::from(vec![1, 2])))]);
        let e = stack(&[&scalars[0]], &jagged_ids()).unwrap_err();
        assert!(e.to_string().contains("a column of Int64"), "{e}");

        let mut nulls = ListBuilder::new(Int32Builder::new());
        nulls.append_null();
        let rows_null = rows(vec![("ids", Arc::new(nulls.finish()))]);
        assert!(matches!(stack(&[&rows_null[0]], &jagged_ids()), Err(BatchError::Null { .. })));
    }

    /// An unshuffled batch (consecutive rows of one table) is copied as a run; the same rows
    /// from two tables are gathered row by row: both make the same tensors, for every kind of
    /// column a table holds.
    #[test]
    fn a_run_of_consecutive_rows_makes_the_tensors_a_gather_makes() {
        use arrow_array::builder::{Float32Builder, StringDictionaryBuilder};
        let columns = || -> Vec<(&str, ArrayRef)> {
            let mut padded = ListBuilder::new(Int32Builder::new());
            let mut jag = ListBuilder::new(Int32Builder::new());
            let mut fixed = FixedSizeListBuilder::new(Float32Builder::new(), 2);
            let mut keyed = StringDictionaryBuilder::<arrow_array::types::Int32Type>::new();
            for i in 0..10 {
                padded.values().append_slice(&(0..i % 3).collect::<Vec<_>>());
                padded.append(true);
                jag.values().append_slice(&(i..2 * i).collect::<Vec<_>>());
                jag.append(true);
                fixed.values().append_slice(&[i as f32, -(i as f32)]);
                fixed.append(true);
                keyed.append_value(["x", "y"][i as usize % 2]);
            }
            vec![
                ("padded", Arc::new(padded.finish())),
                ("jag", Arc::new(jag.finish())),
                ("fixed", Arc::new(fixed.finish())),
                ("keyed", Arc::new(keyed.finish())),
                ("text", Arc::new(arrow_array::StringArray::from_iter_values((0..10).map(|i| format!("t{i}"))))),
                ("int", Arc::new(arrow_array::Int32Array::from_iter_values(0..10))),
                ("real", Arc::new(arrow_array::Float64Array::from_iter_values((0..10).map(f64::from)))),
            ]
        };
        let (a, b) = (rows(columns()), rows(columns()));
        let shaping = Shaping { pad: Some(-1.0), jagged: ["jag".to_string()].into() };
        let run = stack(&a[3..8].iter().collect::<Vec<_>>(), &shaping).unwrap();
        let gathered = stack(&[&a[3], &a[4], &b[5], &b[6], &b[7]], &shaping).unwrap();
        assert_eq!(run.keys().collect::<Vec<_>>(), gathered.keys().collect::<Vec<_>>());
        for (field, t) in &run {
            let (t, g) = (t.join(), gathered[field].join());
            assert_eq!((t.dtype, &t.shape, t.layout, &t.data), (g.dtype, &g.shape, g.layout, &g.data), "{field}");
        }
        let ints =
            run["int"].join().data.chunks(8).map(|c| i64::from_le_bytes(c.try_into().unwrap())).collect::<Vec<_>>();
        assert_eq!(ints, [3, 4, 5, 6, 7], "the run's own rows");
    }

    #[test]
    fn runs_of_several_tables_copied_are_the_rows_a_gather_takes() {
        use arrow_array::builder::{Float32Builder, StringDictionaryBuilder};
        // Two pieces of a table, as the ops split one: each column's values differ by piece.
        let piece = |p: i32| -> Vec<ArrayRef> {
            let mut list = ListBuilder::new(Int32Builder::new());
            let mut fixed = FixedSizeListBuilder::new(Float32Builder::new(), 2);
            let mut keyed = StringDictionaryBuilder::<arrow_array::types::Int32Type>::new();
            for i in 0..12 {
                list.values().append_slice(&(p..p + i % 4).collect::<Vec<_>>());
                list.append(i % 5 != 0);
                fixed.values().append_slice(&[(p + i) as f32, -(i as f32)]);
                fixed.append(true);
                keyed.append_value(format!("{p}-{}", i % 3));
            }
            vec![
                Arc::new(list.finish()),
                Arc::new(fixed.finish()),
                Arc::new(keyed.finish()),
                Arc::new(arrow_array::StringArray::from_iter(
                    (0..12).map(|i| (i % 4 != 0).then(|| format!("{p}:{i}"))),
                )),
                Arc::new(arrow_array::Int64Array::from_iter(
                    (0..12).map(|i| (i % 3 != 0).then_some(p as i64 * 100 + i)),
                )),
            ]
        };
        let (a, b) = (piece(1), piece(2));
        // Three runs: the end of the first piece, the second, the first's start.
        let at: Vec<(usize, usize)> =
            (7..12).map(|r| (0, r)).chain((0..12).map(|r| (1, r))).chain((0..4).map(|r| (0, r))).collect();
        let runs = runs(&at);
        assert_eq!(runs, [(0, 7, 5), (1, 0, 12), (0, 0, 4)]);
        for (a, b) in a.iter().zip(&b) {
            let parts = [a.as_ref(), b.as_ref()];
            let copied = gather(&parts, &at, Some(&runs));
            let gathered = gather(&parts, &at, None);
            assert_eq!(copied.to_data(), gathered.to_data(), "{}", a.data_type());
        }
    }

    #[test]
    fn rows_of_a_dictionary_table_and_a_plain_one_make_one_text_tensor() {
        let mut keyed = arrow_array::builder::StringDictionaryBuilder::<arrow_array::types::Int32Type>::new();
        ["b", "a", "b"].into_iter().for_each(|v| keyed.append_value(v));
        let keyed = rows(vec![("c", Arc::new(keyed.finish()))]);
        let plain = rows(vec![("c", Arc::new(arrow_array::StringArray::from(vec!["x", "y"])))]);
        let batch = stack(&[&keyed[2], &plain[1], &keyed[1]], &Shaping::default()).unwrap();
        let t = batch["c"].join();
        assert_eq!(t.string_values().collect::<Vec<_>>(), [&b"b"[..], b"y", b"a"]);
        // Types that differ beyond a dictionary are still refused, naming the field.
        let ints = rows(vec![("c", Arc::new(arrow_array::Int64Array::from(vec![1])))]);
        assert!(matches!(stack(&[&keyed[0], &ints[0]], &Shaping::default()), Err(BatchError::ColumnTypes { .. })));
    }
}
