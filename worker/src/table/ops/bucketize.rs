use std::sync::Arc;

use arrow_array::{Array, ArrayRef, Int64Array};

use crate::table::column::{self, ColumnResult};

/// Each value's bucket as int64: how many of the (strictly increasing) `boundaries` are at or
/// below it, as `numpy.digitize(x, boundaries)` gives; NaN goes past the last.
pub fn bucketize(column: &ArrayRef, boundaries: &[f64]) -> ColumnResult<ArrayRef> {
    column::per_item(column, |items| {
        let values =
            column::numbers(items).ok_or_else(|| format!("is {}; bucketize takes numbers", column::describe(items)))?;
        let buckets = values.into_iter().map(|x| boundaries.partition_point(|b| *b <= x || x.is_nan()) as i64);
        Ok(Arc::new(Int64Array::new(buckets.collect(), items.nulls().cloned())) as ArrayRef)
    })
}
