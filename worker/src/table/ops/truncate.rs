use std::sync::Arc;

use arrow_array::cast::AsArray;
use arrow_array::{Array, ArrayRef, GenericListArray, OffsetSizeTrait};
use arrow_buffer::{OffsetBuffer, ScalarBuffer};
use arrow_schema::DataType;
use stoker_api::Keep;

use crate::table::column::{self, ColumnResult};

/// Each list cut to its first (or last) `length` items.
pub fn truncate(column: &ArrayRef, length: usize, keep: Keep) -> ColumnResult<ArrayRef> {
    match column.data_type() {
        DataType::List(_) => Ok(Arc::new(cut(column.as_list::<i32>(), length, keep))),
        DataType::LargeList(_) => Ok(Arc::new(cut(column.as_list::<i64>(), length, keep))),
        _ => Err(format!("is {}; truncate takes lists", column::describe(column))),
    }
}

fn cut<O: OffsetSizeTrait>(list: &GenericListArray<O>, length: usize, keep: Keep) -> GenericListArray<O> {
    let (values, offsets) = column::list_values(list);
    // The kept items of every row, in order, gathered into one take.
    let mut indices = Vec::with_capacity(values.len().min(list.len() * length));
    let mut cut_offsets = Vec::with_capacity(offsets.len());
    cut_offsets.push(O::usize_as(0));
    for row in offsets.windows(2) {
        let (start, end) = (row[0].as_usize(), row[1].as_usize());
        let kept = match keep {
            Keep::First => start..end.min(start + length),
            Keep::Last => end.saturating_sub(length).max(start)..end,
        };
        indices.extend(kept.map(|i| i as u64));
        cut_offsets.push(O::usize_as(indices.len()));
    }
    let at = arrow_array::UInt64Array::from(indices);
    let values = arrow_select::take::take(values.as_ref(), &at, None).expect("indices within the values");
    column::list_of(values, OffsetBuffer::new(ScalarBuffer::from(cut_offsets)), list.nulls().cloned())
}
