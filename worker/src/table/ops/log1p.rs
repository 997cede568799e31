use arrow_array::ArrayRef;

use crate::table::column::ColumnResult;

/// `ln(1 + max(x, 0))` as float32, computed in f64.
pub fn log1p(column: &ArrayRef) -> ColumnResult<ArrayRef> {
    super::to_float32(column, |x| x.max(0.0).ln_1p() as f32)
}
