use arrow_array::ArrayRef;

use crate::table::column::ColumnResult;

/// `(x - mean) / std` as float32, computed in f64.
pub fn standardize(column: &ArrayRef, mean: f64, std: f64) -> ColumnResult<ArrayRef> {
    super::to_float32(column, |x| ((x - mean) / std) as f32)
}
