use std::sync::Arc;

use arrow_array::{Array, ArrayRef, Int64Array};
use arrow_buffer::NullBuffer;

use crate::table::column::{self, ColumnResult, xxh64};

/// `xxh64(h1 ‖ h2 ‖ ...) % buckets` per row as int64, `hi` the xxh64 of the i-th column's
/// value (as `hashBucket` hashes it) in 8 little-endian bytes; null where any column is.
/// Scalar columns only.
pub fn cross(columns: &[&ArrayRef], buckets: u64) -> ColumnResult<ArrayRef> {
    let rows = columns.first().map_or(0, |c| c.len());
    let mut hashed = Vec::with_capacity(columns.len());
    for c in columns {
        if matches!(c.data_type(), arrow_schema::DataType::List(_) | arrow_schema::DataType::LargeList(_)) {
            return Err(format!("is {}; cross takes scalar columns", column::describe(c)));
        }
        hashed.push(column::hashes(&column::plain(c))?);
    }
    let buckets = column::Buckets::new(buckets);
    let mut joined = vec![0u8; 8 * columns.len()];
    let crossed = (0..rows).map(|row| {
        for (i, h) in hashed.iter().enumerate() {
            joined[8 * i..8 * i + 8].copy_from_slice(&h[row].to_le_bytes());
        }
        buckets.of(xxh64(&joined)) as i64
    });
    let values: Vec<i64> = crossed.collect();
    let nulls =
        columns.iter().fold(None::<NullBuffer>, |acc, c| NullBuffer::union(acc.as_ref(), c.logical_nulls().as_ref()));
    Ok(Arc::new(Int64Array::new(values.into(), nulls)))
}
