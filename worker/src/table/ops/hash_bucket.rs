use std::sync::Arc;

use arrow_array::{Array, ArrayRef, Int64Array};

use crate::table::column::{self, ColumnResult};

/// `xxh64(value) % buckets` as int64 (`column::hashes` says what is hashed).
pub fn hash_bucket(column: &ArrayRef, buckets: u64) -> ColumnResult<ArrayRef> {
    let buckets = column::Buckets::new(buckets);
    column::per_item(column, |items| {
        let buckets = column::hashes_into(items, |h| buckets.of(h) as i64)?;
        Ok(Arc::new(Int64Array::new(buckets.into(), items.nulls().cloned())) as ArrayRef)
    })
}
