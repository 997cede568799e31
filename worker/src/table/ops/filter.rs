use arrow_array::{Array, ArrayRef};
use stoker_api::FilterOp;

use crate::apply::holds;
use crate::table::column::{self, ColumnResult};

/// Which rows a `filter` keeps, by the element path's rule: a number against a target that
/// parses as one numerically (never otherwise), a string or binary value against the target's
/// bytes. None for a null (the element path's missing field).
pub fn keeps(column: &ArrayRef, op: FilterOp, target: &str) -> ColumnResult<Vec<Option<bool>>> {
    let column = column::plain(column);
    let valid = |i: usize| column.is_valid(i);
    if let Some(strings) = column::byte_strings(&column) {
        let kept =
            strings.into_iter().enumerate().map(|(i, s)| valid(i).then(|| holds(Some(s.cmp(target.as_bytes())), op)));
        return Ok(kept.collect());
    }
    let numbers = column::numbers(&column)
        .ok_or_else(|| format!("is {}; filter takes numbers and strings", column::describe(&column)))?;
    let target = target.parse::<f64>().ok();
    let kept = numbers
        .into_iter()
        .enumerate()
        .map(|(i, x)| valid(i).then(|| holds(target.and_then(|t| x.partial_cmp(&t)), op)));
    Ok(kept.collect())
}
