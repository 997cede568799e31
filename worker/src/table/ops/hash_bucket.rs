use std::sync::Arc;

use arrow_array::{Array, ArrayRef, Int64Array};

use crate::table::column::{self, ColumnResult};

/// `xxh64(value) % buckets` as int64 (`column::hashes` says what is hashed).
pub fn hash_bucket(column: &ArrayRef, buckets: u64) -> ColumnResult<ArrayRef> {
    column::per_item(column, |items| {
        let hashed = column::hashes(items)?.into_iter().map(|h| (h % buckets) as i64);
        Ok(Arc::new(Int64Array::new(hashed.collect(), items.nulls().cloned())) as ArrayRef)
    })
}
