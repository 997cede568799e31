use std::collections::HashMap;
use std::sync::Arc;

use arrow_array::{Array, ArrayRef, Int64Array};

use crate::table::column::{self, ColumnResult};

/// A `vocabulary` op's file, loaded: each line's id (its index from 0, the first of
/// duplicates), looked up by the line's bytes or, for integer columns, its integer value.
#[derive(Debug, Default)]
pub struct Vocabulary {
    strings: HashMap<Vec<u8>, i64>,
    integers: HashMap<i128, i64>,
    oov: i64,
}

impl Vocabulary {
    /// The entries of `file` (lines, a trailing `\r` dropped); `oov` the id of anything else,
    /// by default the number of entries.
    pub fn new(file: &[u8], oov: Option<i64>) -> Vocabulary {
        let mut vocabulary = Vocabulary::default();
        let file = file.strip_suffix(b"\n").unwrap_or(file);
        for (id, line) in file.split(|b| *b == b'\n').enumerate() {
            let line = line.strip_suffix(b"\r").unwrap_or(line);
            vocabulary.strings.entry(line.to_vec()).or_insert(id as i64);
            if let Some(n) = std::str::from_utf8(line).ok().and_then(|s| s.trim().parse::<i128>().ok()) {
                vocabulary.integers.entry(n).or_insert(id as i64);
            }
        }
        let entries = if file.is_empty() { 0 } else { file.split(|b| *b == b'\n').count() as i64 };
        vocabulary.oov = oov.unwrap_or(entries);
        vocabulary
    }

    /// Each item's id as int64, nulls kept.
    pub fn ids(&self, column: &ArrayRef) -> ColumnResult<ArrayRef> {
        column::per_item(column, |items| {
            let ids: Vec<i64> = if let Some(strings) = column::byte_strings(items) {
                strings.into_iter().map(|s| *self.strings.get(s).unwrap_or(&self.oov)).collect()
            } else if let Some(values) = column::wide_integers(items).filter(|_| !column::is_float(items)) {
                values.into_iter().map(|v| *self.integers.get(&v).unwrap_or(&self.oov)).collect()
            } else {
                return Err(format!("is {}; vocabulary takes strings, binary and integers", column::describe(items)));
            };
            Ok(Arc::new(Int64Array::new(ids.into(), items.nulls().cloned())) as ArrayRef)
        })
    }
}
