use std::sync::Arc;

use arrow_array::cast::AsArray;
use arrow_array::types::{Float32Type, Float64Type};
use arrow_array::{Array, ArrayRef, Float32Array, Float64Array, Int64Array};
use arrow_schema::DataType;

use crate::table::column::{self, ColumnResult};

/// Values bounded to [min, max]: floats keep their type, integers become int64 (as they reach
/// the batch anyway) and take the bounds rounded inwards.
pub fn clip(column: &ArrayRef, min: Option<f64>, max: Option<f64>) -> ColumnResult<ArrayRef> {
    let (lo, hi) = (min.unwrap_or(f64::NEG_INFINITY), max.unwrap_or(f64::INFINITY));
    column::per_item(column, |items| {
        let nulls = items.nulls().cloned();
        Ok(match items.data_type() {
            DataType::Float32 => {
                let values = items.as_primitive::<Float32Type>().values().iter();
                Arc::new(Float32Array::new(values.map(|v| v.clamp(lo as f32, hi as f32)).collect(), nulls)) as ArrayRef
            }
            DataType::Float64 => {
                let values = items.as_primitive::<Float64Type>().values().iter();
                Arc::new(Float64Array::new(values.map(|v| v.clamp(lo, hi)).collect(), nulls)) as ArrayRef
            }
            // Bounded as the unsigned values they are; above 2^63 they wrap in the int64 batch.
            DataType::UInt64 => {
                let values = items.as_primitive::<arrow_array::types::UInt64Type>().values().iter();
                let (lo, hi) = (lo.max(0.0).ceil() as u64, hi.floor() as u64);
                Arc::new(Int64Array::new(values.map(|v| (*v).clamp(lo, hi.max(lo)) as i64).collect(), nulls))
                    as ArrayRef
            }
            _ => {
                let values = column::integers(items)
                    .ok_or_else(|| format!("is {}; clip takes numbers", column::describe(items)))?;
                // Saturating: a bound beyond int64 is no bound.
                let (lo, hi) = (lo.ceil() as i64, hi.floor() as i64);
                Arc::new(Int64Array::new(values.into_iter().map(|v| v.clamp(lo, hi)).collect(), nulls)) as ArrayRef
            }
        })
    })
}
