use std::sync::Arc;

use arrow_array::cast::AsArray;
use arrow_array::types::{Float32Type, Float64Type};
use arrow_array::{
    Array, ArrayRef, BinaryArray, Float32Array, Float64Array, GenericListArray, OffsetSizeTrait, StringArray,
    new_empty_array,
};
use arrow_buffer::{OffsetBuffer, ScalarBuffer};
use arrow_schema::DataType;

use crate::table::column::{self, ColumnResult};

/// Nulls replaced: a numeric item's by `value`, a string's by `text`; a null list becomes an
/// empty one (a dictionary column is unpacked: `table::dictionary::fill_text` keeps one). Integers become int64 (as they reach the batch anyway).
pub fn fill_null(column: &ArrayRef, value: Option<f64>, text: Option<&str>) -> ColumnResult<ArrayRef> {
    let column = match column.data_type() {
        DataType::List(_) => empty_lists(column.as_list::<i32>()),
        DataType::LargeList(_) => empty_lists(column.as_list::<i64>()),
        // Unpacked: a dictionary's values hold no nulls to fill, its keys do.
        DataType::Dictionary(_, _) => column::plain(column),
        _ => column.clone(),
    };
    column::per_item(&column, |items| fill(items, value, text))
}

fn fill(items: &ArrayRef, value: Option<f64>, text: Option<&str>) -> ColumnResult<ArrayRef> {
    let takes = |t: &DataType| t.is_numeric() || matches!(t, DataType::Boolean) || column::is_bytes(t);
    if items.null_count() == 0 && takes(items.data_type()) {
        return Ok(items.clone());
    }
    let missing = |what: &str| format!("is {}; give fillNull a {what} for it", column::describe(items));
    let is_null = |i: usize| items.is_null(i);
    // The slots to fill: at least one (the early return above), so the column has nulls.
    let nulls = || items.nulls().expect("a column with nulls has a null buffer");
    Ok(match items.data_type() {
        DataType::Float32 => {
            let Some(v) = value else { return Err(missing("value")) };
            let values = items.as_primitive::<Float32Type>().values();
            Arc::new(Float32Array::from(column::fill_slots(values, nulls(), v as f32)))
        }
        DataType::Float64 => {
            let Some(v) = value else { return Err(missing("value")) };
            let values = items.as_primitive::<Float64Type>().values();
            Arc::new(Float64Array::from(column::fill_slots(values, nulls(), v)))
        }
        DataType::Utf8 | DataType::LargeUtf8 | DataType::Binary | DataType::LargeBinary
            if text == Some("") && nulls_are_empty(items) =>
        {
            // Each null's slot is already the empty string: the nulls need only be forgotten.
            match items.data_type() {
                DataType::Utf8 => without_nulls(items.as_string::<i32>()),
                DataType::LargeUtf8 => without_nulls(items.as_string::<i64>()),
                DataType::Binary => without_nulls(items.as_binary::<i32>()),
                _ => without_nulls(items.as_binary::<i64>()),
            }
        }
        DataType::Utf8 | DataType::LargeUtf8 | DataType::Utf8View => {
            let Some(t) = text else { return Err(missing("text")) };
            let (offsets, values) = filled(items, t.as_bytes());
            // Valid UTF-8: the column's strings and `text` (checked once over the buffer).
            Arc::new(StringArray::try_new(offsets, values, None).map_err(|e| e.to_string())?)
        }
        DataType::Binary | DataType::LargeBinary | DataType::BinaryView => {
            let Some(t) = text else { return Err(missing("text")) };
            let (offsets, values) = filled(items, t.as_bytes());
            Arc::new(BinaryArray::new(offsets, values, None))
        }
        DataType::Boolean => {
            let Some(v) = value else { return Err(missing("value")) };
            let filled = (0..items.len()).map(|i| if is_null(i) { v != 0.0 } else { items.as_boolean().value(i) });
            Arc::new(arrow_array::BooleanArray::from_iter(filled.map(Some)))
        }
        _ => {
            let Some(v) = value else { return Err(missing("value or text")) };
            // The column's own type, the value cast to it as Rust casts (toward zero,
            // saturating): unsigned 64-bit values keep their magnitude for the ops after.
            macro_rules! same_type {
                ($($variant:ident => $t:ty),*) => {
                    match items.data_type() {
                        $(DataType::$variant => {
                            let values = items.as_primitive::<$t>().values();
                            let fill = v as <$t as arrow_array::ArrowPrimitiveType>::Native;
                            let filled = column::fill_slots(values, nulls(), fill);
                            Arc::new(arrow_array::PrimitiveArray::<$t>::new(filled.into(), None)) as ArrayRef
                        })*
                        _ => return Err(missing("value or text")),
                    }
                };
            }
            use arrow_array::types::*;
            same_type!(Int8 => Int8Type, Int16 => Int16Type, Int32 => Int32Type, Int64 => Int64Type,
                UInt8 => UInt8Type, UInt16 => UInt16Type, UInt32 => UInt32Type, UInt64 => UInt64Type)
        }
    })
}

/// The same strings without their validity (its buffers shared).
fn without_nulls<T: arrow_array::types::ByteArrayType>(array: &arrow_array::GenericByteArray<T>) -> ArrayRef {
    Arc::new(arrow_array::GenericByteArray::<T>::new(array.offsets().clone(), array.values().clone(), None))
}

/// Whether every null of a string or binary column holds no bytes (as writers leave them).
fn nulls_are_empty(items: &ArrayRef) -> bool {
    let (mut row, mut empty) = (0, true);
    column::for_each_bytes(items, |v| {
        empty &= v.is_empty() || items.is_valid(row);
        row += 1;
    });
    empty
}

/// The offsets and bytes of a string or binary column with every null replaced by `text`.
fn filled(items: &ArrayRef, text: &[u8]) -> (OffsetBuffer<i32>, arrow_buffer::Buffer) {
    let mut offsets = Vec::with_capacity(items.len() + 1);
    let mut values = Vec::with_capacity(items.len() * (text.len() + 8));
    offsets.push(0i32);
    let mut row = 0;
    column::for_each_bytes(items, |v| {
        values.extend_from_slice(if items.is_null(row) { text } else { v });
        offsets.push(values.len() as i32);
        row += 1;
    });
    (OffsetBuffer::new(ScalarBuffer::from(offsets)), arrow_buffer::Buffer::from_vec(values))
}

/// A list column whose null rows are empty lists.
fn empty_lists<O: OffsetSizeTrait>(list: &GenericListArray<O>) -> ArrayRef {
    if list.null_count() == 0 {
        return Arc::new(list.clone());
    }
    let (values, offsets) = column::list_values(list);
    // A null row's offsets may span items; keep only the valid rows' items.
    let mut indices = Vec::new();
    let mut kept = vec![O::usize_as(0)];
    for (row, w) in offsets.windows(2).enumerate() {
        if list.is_valid(row) {
            indices.extend(w[0].as_usize() as u64..w[1].as_usize() as u64);
        }
        kept.push(O::usize_as(indices.len()));
    }
    let values = if values.is_empty() {
        new_empty_array(values.data_type())
    } else {
        arrow_select::take::take(values.as_ref(), &arrow_array::UInt64Array::from(indices), None).expect("in range")
    };
    Arc::new(column::list_of(values, OffsetBuffer::new(ScalarBuffer::from(kept)), None))
}
