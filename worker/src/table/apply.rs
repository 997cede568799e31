//! Runs a pipeline's ops on a table, op by op, each over whole columns: the columnar twin of
//! `crate::apply` (which runs them element by element).

use std::time::Instant;

use arrow_array::ArrayRef;
use stoker_api::proto::HintBytes;
use stoker_api::{OnError, Transform};

use super::ops;
use super::{Table, dictionary};
use crate::loaded::Loaded;
use crate::op_tally::OpTally;

#[derive(Debug, thiserror::Error)]
pub enum TableError {
    #[error("transforms[{index}].{op}: field {field:?} {message}")]
    Column { index: usize, op: &'static str, field: String, message: String },
    #[error("transforms[{index}].{op}: the rows have no field {field:?} (their columns: {have})")]
    MissingField { index: usize, op: &'static str, field: String, have: String },
    #[error("transforms[{index}].filter: {rows} rows have a null {field:?} (onError: fail; fillNull it first)")]
    NullFilter { index: usize, field: String, rows: u64 },
}

impl TableError {
    /// A stable label for metrics.
    pub fn reason(&self) -> &'static str {
        match self {
            TableError::Column { .. } => "field_type",
            TableError::MissingField { .. } | TableError::NullFilter { .. } => "missing_field",
        }
    }
}

/// What the ops left of a table.
#[derive(Debug)]
pub struct Applied {
    pub table: Table,
    /// Rows a filter dropped.
    pub filtered: u64,
    /// Rows dropped for a null where a filter compares (onError: skip).
    pub skipped_null: u64,
}

/// Applies `transforms` (all columnar) to `table` in order; `tally[i]` accumulates op i's
/// time and rows in and out, and `sizes` (when measuring, `stoker-worker profile`) the rows
/// and bytes of the columns after it.
pub fn apply(
    transforms: &[Transform],
    loaded: &Loaded,
    on_error: OnError,
    mut table: Table,
    tally: &mut [OpTally],
    mut sizes: Option<&mut Vec<HintBytes>>,
) -> Result<Applied, TableError> {
    let (mut filtered, mut skipped_null) = (0, 0);
    for (index, transform) in transforms.iter().enumerate() {
        let started = Instant::now();
        let rows_in = table.len() as u64;
        let op = transform.name();
        let missing = |table: &Table, field: &str| TableError::MissingField {
            index,
            op,
            field: field.to_string(),
            have: table.columns.keys().cloned().collect::<Vec<_>>().join(", "),
        };
        let fail = |field: &str, message: String| TableError::Column { index, op, field: field.to_string(), message };
        // Replaces each of `fields` by `f` of it; with `by_item` (an op that works item by
        // item), a dictionary column's by `f` of its distinct values.
        let memo = table.memo.clone();
        let each =
            |table: &mut Table, fields: &[String], by_item: bool, f: &dyn Fn(&ArrayRef) -> Result<ArrayRef, String>| {
                for field in fields {
                    let column = table.columns.get(field).ok_or_else(|| missing(table, field))?;
                    let by_value = by_item.then(|| dictionary::per_value(&memo, index, column, f)).flatten();
                    let changed = by_value.unwrap_or_else(|| f(column)).map_err(|m| fail(field, m))?;
                    table.columns.insert(field.clone(), changed);
                }
                Ok::<_, TableError>(())
            };
        match transform {
            Transform::FillNull(f) => each(&mut table, &f.fields, false, &|c| {
                let kept = f.text.as_deref().and_then(|text| dictionary::fill_text(&memo, index, c, text));
                kept.map_or_else(|| ops::fill_null(c, f.value, f.text.as_deref()), Ok)
            })?,
            Transform::Log1p(l) => each(&mut table, &l.fields, true, &ops::log1p)?,
            Transform::Clip(c) => each(&mut table, &c.fields, true, &|col| ops::clip(col, c.min, c.max))?,
            Transform::Standardize(s) => each(&mut table, &s.fields, true, &|c| ops::standardize(c, s.mean, s.std))?,
            Transform::Bucketize(b) => each(&mut table, &b.fields, true, &|c| ops::bucketize(c, &b.boundaries))?,
            Transform::HashBucket(h) => each(&mut table, &h.fields, true, &|c| ops::hash_bucket(c, h.buckets))?,
            Transform::Vocabulary(v) => {
                let vocabulary = loaded.vocabularies.get(&index).expect("loaded for a pipeline with vocabulary ops");
                each(&mut table, &v.fields, true, &|c| vocabulary.ids(c))?
            }
            Transform::Truncate(t) => {
                each(&mut table, &t.fields, false, &|c| ops::truncate(c, t.length as usize, t.keep))?
            }
            Transform::Cross(c) => {
                let columns = (c.fields.iter())
                    .map(|f| table.columns.get(f).ok_or_else(|| missing(&table, f)))
                    .collect::<Result<Vec<_>, _>>()?;
                let crossed = ops::cross(&columns, c.buckets).map_err(|m| fail(&c.fields.join(", "), m))?;
                table.columns.insert(c.output.clone(), crossed);
            }
            Transform::Concat(c) => {
                let columns = (c.fields.iter())
                    .map(|f| Ok((f.as_str(), table.columns.get(f).ok_or_else(|| missing(&table, f))?)))
                    .collect::<Result<Vec<_>, _>>()?;
                let joined = ops::concat(&columns).map_err(|(field, m)| fail(&field, m))?;
                c.fields.iter().for_each(|f| drop(table.columns.remove(f)));
                table.columns.insert(c.output.clone(), joined);
            }
            Transform::Filter(f) => {
                let column = table.columns.get(&f.field).ok_or_else(|| missing(&table, &f.field))?;
                let keeps = ops::keeps(column, f.op, &f.value).map_err(|m| fail(&f.field, m))?;
                let nulls = keeps.iter().filter(|k| k.is_none()).count() as u64;
                if nulls > 0 && on_error == OnError::Fail {
                    return Err(TableError::NullFilter { index, field: f.field.clone(), rows: nulls });
                }
                let kept: Vec<u32> =
                    (keeps.iter().enumerate()).filter_map(|(i, k)| (*k == Some(true)).then_some(i as u32)).collect();
                if kept.len() < table.len() {
                    skipped_null += nulls;
                    filtered += (table.len() - kept.len()) as u64 - nulls;
                    table = table.take(&kept);
                }
            }
            Transform::SelectFields(s) => {
                if let Some(absent) = s.fields.iter().find(|f| !table.columns.contains_key(*f)) {
                    return Err(missing(&table, absent));
                }
                table.columns.retain(|name, _| s.fields.contains(name));
            }
            Transform::RenameFields(r) => {
                for (from, to) in &r.mapping {
                    let column = table.columns.remove(from).ok_or_else(|| missing(&table, from))?;
                    table.columns.insert(to.clone(), column);
                }
            }
            other => unreachable!("{} is not a columnar op (Transform::is_columnar)", other.name()),
        }
        tally[index].time += started.elapsed();
        tally[index].elements_in += rows_in;
        tally[index].elements_out += table.len() as u64;
        if let Some(sizes) = sizes.as_deref_mut() {
            // A piece's columns are slices of its chunk's: only the slices' bytes count.
            let bytes = table.columns.values().map(|c| c.to_data().get_slice_memory_size().unwrap_or(0) as u64).sum();
            HintBytes::add_into(sizes, &HintBytes { at: index as u32, elements: table.len() as u64, bytes });
        }
    }
    // The rows outlive the ops: they need not keep the dictionaries' results alive.
    table.memo = Default::default();
    Ok(Applied { table, filtered, skipped_null })
}
