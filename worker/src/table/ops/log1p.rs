use std::sync::{Arc, LazyLock};

use arrow_array::cast::AsArray;
use arrow_array::types::{Int32Type, Int64Type};
use arrow_array::{Array, ArrayRef, Float32Array};

use crate::table::column::{self, ColumnResult};

/// `ln(1 + x)` of the small counts most values are, as float32: the same numbers computed
/// once (a log costs more than the table's lookup).
static SMALL: LazyLock<Vec<f32>> = LazyLock::new(|| (0..4096).map(|x| f64::from(x).ln_1p() as f32).collect());

/// `ln(1 + max(x, 0))` as float32, computed in f64; NaN stays NaN (as numpy's maximum
/// keeps it: Rust's `max` would make it 0).
pub fn log1p(column: &ArrayRef) -> ColumnResult<ArrayRef> {
    let exact = |x: f64| if x.is_nan() { f32::NAN } else { x.max(0.0).ln_1p() as f32 };
    column::per_item(column, |items| {
        if column::is_float(items) || items.data_type() == &arrow_schema::DataType::UInt64 {
            return super::to_float32(items, exact);
        }
        let small = &*SMALL;
        let log = |x: i64| match usize::try_from(x.max(0)) {
            Ok(i) if i < small.len() => small[i],
            _ => exact(x as f64),
        };
        // int32 and int64 (what counts are) read in place; other integers widened first.
        let logs: Vec<f32> = if let Some(ints) = items.as_primitive_opt::<Int32Type>() {
            ints.values().iter().map(|x| log(i64::from(*x))).collect()
        } else if let Some(ints) = items.as_primitive_opt::<Int64Type>() {
            ints.values().iter().map(|x| log(*x)).collect()
        } else {
            let values = column::integers(items)
                .ok_or_else(|| format!("is {}; this op takes numbers", column::describe(items)))?;
            values.into_iter().map(log).collect()
        };
        Ok(Arc::new(Float32Array::new(logs.into(), items.nulls().cloned())) as ArrayRef)
    })
}
