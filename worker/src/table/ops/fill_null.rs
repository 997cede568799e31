use std::sync::Arc;

use arrow_array::builder::{BinaryBuilder, StringBuilder};
use arrow_array::cast::AsArray;
use arrow_array::types::{Float32Type, Float64Type};
use arrow_array::{Array, ArrayRef, Float32Array, Float64Array, Int64Array, new_empty_array};
use arrow_buffer::{OffsetBuffer, ScalarBuffer};
use arrow_schema::DataType;

use crate::table::column::{self, ColumnResult};

/// Nulls replaced: a numeric item's by `value`, a string's by `text`; a null list becomes an
/// empty one. Integers become int64 (as they reach the batch anyway).
pub fn fill_null(column: &ArrayRef, value: Option<f64>, text: Option<&str>) -> ColumnResult<ArrayRef> {
    let column = match column.data_type() {
        DataType::List(_) => empty_lists(column),
        _ => column.clone(),
    };
    column::per_item(&column, |items| fill(items, value, text))
}

fn fill(items: &ArrayRef, value: Option<f64>, text: Option<&str>) -> ColumnResult<ArrayRef> {
    let missing = |what: &str| format!("is {}; give fillNull a {what} for it", column::describe(items));
    let is_null = |i: usize| items.is_null(i);
    Ok(match items.data_type() {
        DataType::Float32 => {
            let Some(v) = value else { return Err(missing("value")) };
            let values = items.as_primitive::<Float32Type>().values().iter().enumerate();
            Arc::new(Float32Array::from_iter_values(values.map(|(i, x)| if is_null(i) { v as f32 } else { *x })))
        }
        DataType::Float64 => {
            let Some(v) = value else { return Err(missing("value")) };
            let values = items.as_primitive::<Float64Type>().values().iter().enumerate();
            Arc::new(Float64Array::from_iter_values(values.map(|(i, x)| if is_null(i) { v } else { *x })))
        }
        DataType::Utf8 | DataType::LargeUtf8 | DataType::Utf8View => {
            let Some(t) = text else { return Err(missing("text")) };
            let strings = column::byte_strings(items).expect("a string column");
            let mut out = StringBuilder::with_capacity(items.len(), 0);
            for (i, s) in strings.into_iter().enumerate() {
                out.append_value(if is_null(i) { t } else { std::str::from_utf8(s).expect("a string column's UTF-8") });
            }
            Arc::new(out.finish())
        }
        DataType::Binary | DataType::LargeBinary | DataType::BinaryView => {
            let Some(t) = text else { return Err(missing("text")) };
            let strings = column::byte_strings(items).expect("a binary column");
            let mut out = BinaryBuilder::with_capacity(items.len(), 0);
            for (i, s) in strings.into_iter().enumerate() {
                out.append_value(if is_null(i) { t.as_bytes() } else { s });
            }
            Arc::new(out.finish())
        }
        _ => {
            let values = column::integers(items).ok_or_else(|| missing("value or text"))?;
            let Some(v) = value else { return Err(missing("value")) };
            let filled = values.into_iter().enumerate().map(|(i, x)| if is_null(i) { v as i64 } else { x });
            Arc::new(Int64Array::from_iter_values(filled))
        }
    })
}

/// A list column whose null rows are empty lists.
fn empty_lists(column: &ArrayRef) -> ArrayRef {
    let list = column.as_list::<i32>();
    if list.null_count() == 0 {
        return column.clone();
    }
    let (values, offsets) = column::list_values(list);
    // A null row's offsets may span items; keep only the valid rows' items.
    let mut indices = Vec::new();
    let mut kept = vec![0i32];
    for (row, w) in offsets.windows(2).enumerate() {
        if list.is_valid(row) {
            indices.extend(w[0] as u32..w[1] as u32);
        }
        kept.push(indices.len() as i32);
    }
    let values = if values.is_empty() {
        new_empty_array(values.data_type())
    } else {
        arrow_select::take::take(values.as_ref(), &arrow_array::UInt32Array::from(indices), None).expect("in range")
    };
    Arc::new(column::list_of(values, OffsetBuffer::new(ScalarBuffer::from(kept)), None))
}
