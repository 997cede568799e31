use std::sync::Arc;

use arrow_array::cast::AsArray;
use arrow_array::{Array, ArrayRef, FixedSizeListArray, Float32Array};
use arrow_schema::{DataType, Field};

use crate::table::column::{self, ColumnResult};

/// Numeric scalar columns side by side, one float32 vector per row.
pub fn concat(columns: &[(&str, &ArrayRef)]) -> Result<ArrayRef, (String, String)> {
    let rows = columns.first().map_or(0, |(_, c)| c.len());
    let width = columns.len();
    let mut values = vec![0f32; rows * width];
    for (j, (name, c)) in columns.iter().enumerate() {
        let fail = |message: String| (name.to_string(), message);
        if c.logical_null_count() > 0 {
            return Err(fail("has nulls; fill them (fillNull) before concat".into()));
        }
        let mut put = |row: usize, x: f32| values[row * width + j] = x;
        // float32 (what log1p, standardize and clip make) as it is; any other type through f64.
        match c.as_primitive_opt::<arrow_array::types::Float32Type>() {
            Some(floats) => floats.values().iter().enumerate().for_each(|(row, x)| put(row, *x)),
            None => column_numbers(c).map_err(fail)?.into_iter().enumerate().for_each(|(row, x)| put(row, x as f32)),
        }
    }
    let item = Arc::new(Field::new_list_field(DataType::Float32, false));
    let values = Arc::new(Float32Array::from(values));
    Ok(Arc::new(FixedSizeListArray::new(item, width as i32, values, None)))
}

fn column_numbers(c: &ArrayRef) -> ColumnResult<Vec<f64>> {
    column::numbers(&column::plain(c))
        .ok_or_else(|| format!("is {}; concat takes numeric scalars", column::describe(c)))
}
