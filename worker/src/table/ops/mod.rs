//! The feature ops, one per file, each a pure function from columns to columns, vectorised
//! over a column's values. Nulls pass through every op but `fillNull` (and make `concat` and
//! the batch fail), so a pipeline states how it fills them.

mod bucketize;
mod clip;
mod concat;
mod cross;
mod fill_null;
mod filter;
mod hash_bucket;
mod log1p;
mod standardize;
mod truncate;
mod vocabulary;

pub use bucketize::bucketize;
pub use clip::clip;
pub use concat::concat;
pub use cross::cross;
pub use fill_null::fill_null;
pub use filter::keeps;
pub use hash_bucket::hash_bucket;
pub use log1p::log1p;
pub use standardize::standardize;
pub use truncate::truncate;
pub use vocabulary::Vocabulary;

use std::sync::Arc;

use arrow_array::{ArrayRef, Float32Array};

use super::column::{self, ColumnResult};

/// A float32 column of `f` of each numeric item, nulls kept.
pub(crate) fn to_float32(column: &ArrayRef, f: impl Fn(f64) -> f32) -> ColumnResult<ArrayRef> {
    column::per_item(column, |items| {
        let values =
            column::numbers(items).ok_or_else(|| format!("is {}; this op takes numbers", column::describe(items)))?;
        Ok(Arc::new(Float32Array::new(values.into_iter().map(&f).collect(), items.nulls().cloned())) as ArrayRef)
    })
}
