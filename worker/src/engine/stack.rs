//! Batching: elements' tensors stacked along a new first axis, one tensor per field.
//! Elements of different shapes are padded to the batch's largest shape with the pipeline's
//! `padValue`, or refused when it declares none. Fields the pipeline lists as `jagged` keep
//! each row's list as it is, after their offsets ([`Layout::Jagged`]).
//!
//! Stacking joins nothing it need not: a batch's tensor keeps its rows' buffers as they are
//! ([`Stacked`]), and the stream's messages or a shared-memory file take them one after
//! another. Joining 600 KB rows copied memory long out of cache: 8-14% of the ResNet
//! preprocessing benchmark's throughput. Small values (labels) are joined, so that a batch
//! keeps no large buffer alive for a few bytes of it; padded rows and text are joined whole.

use std::collections::{BTreeMap, BTreeSet};

use bytes::{Bytes, BytesMut};
use stoker_api::{Batch, DType, Layout, Stacked, Tensor};

use crate::table::TableRow;

#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum BatchError {
    #[error("field {field:?} is null in some rows of the batch; fill it (fillNull) or filter those rows out")]
    Null { field: String },
    #[error("field {field:?} is {first} in some rows and {other} in others")]
    ColumnTypes { field: String, first: String, other: String },
    #[error("field {field:?} is {data_type}, which a batch cannot hold")]
    ColumnType { field: String, data_type: String },
    #[error("field {field:?} is missing from some elements of the batch")]
    MissingField { field: String },
    #[error("field {field:?} mixes dtypes {first:?} and {other:?}")]
    DTypeMismatch { field: String, first: DType, other: DType },
    #[error("field {field:?} has shapes {first:?} and {other:?}; set spec.padValue to pad to the largest")]
    ShapeMismatch { field: String, first: Vec<usize>, other: Vec<usize> },
    #[error("field {field:?} has ranks {first} and {other}; padding needs equal ranks")]
    RankMismatch { field: String, first: usize, other: usize },
    #[error(
        "field {field:?} is in spec.jagged but is {what}; jagged fields are lists of numbers (one dimension a row)"
    )]
    NotJagged { field: String, what: String },
}

/// How the rows' tensors of a field become the batch's when their shapes differ.
#[derive(Debug, Clone, Default)]
pub struct Shaping {
    /// `padValue`: tensors padded to the largest shape with it; refused without.
    pub pad: Option<f64>,
    /// `jagged`: fields whose rows' lists are kept as they are.
    pub jagged: BTreeSet<String>,
}

impl Shaping {
    pub fn of(spec: &stoker_api::DataPlaneSpec) -> Shaping {
        Shaping { pad: spec.pad_value, jagged: spec.jagged.iter().cloned().collect() }
    }
}

/// An element's fields, each already a tensor.
pub type Fields = BTreeMap<String, Tensor>;

/// One element as the batcher sees it: its fields, or a row of a table (the columnar path).
#[derive(Debug, Clone)]
pub enum Row {
    Fields(Fields),
    Table(TableRow),
}

impl Row {
    /// The bytes of the row's data: a table row's share of its table.
    pub fn bytes(&self) -> usize {
        match self {
            Row::Fields(fields) => fields.values().map(|t| t.data.len()).sum(),
            Row::Table(row) => row.share,
        }
    }

    /// What a buffered row costs in memory: its data plus the allocations around it. The data
    /// bytes alone would let a buffer of millions of tiny rows (jsonl labels) hold gigabytes
    /// of map nodes. A row of fields is a BTreeMap whose first node holds 11 entries (about
    /// 1 KB), and each field adds its name, shape and shared-bytes header (about 128 bytes); a
    /// table row is a reference.
    pub fn cost(&self) -> usize {
        match self {
            Row::Fields(fields) => 1024 + fields.values().map(|t| t.data.len() + 128).sum::<usize>(),
            Row::Table(row) => 32 + row.share,
        }
    }

    /// The row's fields: a table row's gathered alone (a batch that mixes both kinds), its
    /// lists dense (a jagged field is made of them with the element path's).
    fn into_fields(self, pad: Option<f64>) -> Result<Fields, BatchError> {
        match self {
            Row::Fields(fields) => Ok(fields),
            Row::Table(row) => {
                let batched = crate::table::batch::stack(&[&row], &Shaping { pad, jagged: BTreeSet::new() })?;
                let one = |t: Stacked| {
                    let t = t.join();
                    Tensor::new(t.dtype, t.shape[1..].to_vec(), t.data).expect("one row of the batch")
                };
                Ok(batched.into_iter().map(|(name, t)| (name, one(t))).collect())
            }
        }
    }
}

/// Stacks the rows into a batch, taking each row's data as it is copied so the rows' memory
/// is freed while the batch's fills (a batch never costs twice its size). `rows` is left
/// empty, also on error. Table rows are gathered column at a time (`table::batch`).
pub fn make_batch(
    rows: &mut Vec<Row>,
    shaping: &Shaping,
    epoch: u64,
    split: u64,
    sequence: u64,
) -> Result<Batch<Stacked>, BatchError> {
    let tables: Option<Vec<&TableRow>> = (rows.iter())
        .map(|row| match row {
            Row::Table(row) => Some(row),
            Row::Fields(_) => None,
        })
        .collect();
    let tensors = match tables {
        Some(tables) if !tables.is_empty() => {
            let tensors = crate::table::batch::stack(&tables, shaping);
            rows.clear();
            tensors?
        }
        _ => {
            let mut fields = (rows.drain(..)).map(|row| row.into_fields(shaping.pad)).collect::<Result<Vec<_>, _>>()?;
            stack_fields(&mut fields, shaping)?
        }
    };
    Ok(Batch { tensors, epoch, split, sequence, ..Default::default() })
}

/// Stacks the rows' fields, taking each tensor out of its row as it is copied so the rows'
/// memory is freed while the batch's fills.
fn stack_fields(rows: &mut [Fields], shaping: &Shaping) -> Result<BTreeMap<String, Stacked>, BatchError> {
    let mut tensors = BTreeMap::new();
    if let Some(first) = rows.first() {
        let fields: Vec<String> = first.keys().cloned().collect();
        if let Some(extra) = rows.iter().flat_map(|r| r.keys()).find(|k| !first.contains_key(*k)) {
            return Err(BatchError::MissingField { field: extra.clone() });
        }
        for field in fields {
            let stacked = if shaping.jagged.contains(&field) {
                stack_jagged(&field, rows)
            } else {
                stack(&field, rows, shaping.pad)
            };
            match stacked {
                Ok(t) => tensors.insert(field, t),
                Err(e) => {
                    rows.iter_mut().for_each(Fields::clear);
                    return Err(e);
                }
            };
        }
    }
    Ok(tensors)
}

/// Rows' values smaller than this are copied into one buffer instead of kept as parts.
const OWN_PART: usize = 16 << 10;

fn stack(field: &str, rows: &mut [Fields], pad: Option<f64>) -> Result<Stacked, BatchError> {
    let column: Vec<&Tensor> = rows
        .iter()
        .map(|r| r.get(field).ok_or_else(|| BatchError::MissingField { field: field.into() }))
        .collect::<Result<_, _>>()?;
    let first = column[0];
    let mut shape = first.shape.clone();
    for t in &column {
        if t.dtype != first.dtype {
            return Err(BatchError::DTypeMismatch { field: field.into(), first: first.dtype, other: t.dtype });
        }
        if t.shape.len() != shape.len() {
            return Err(BatchError::RankMismatch { field: field.into(), first: shape.len(), other: t.shape.len() });
        }
        if t.shape != first.shape && pad.is_none() {
            return Err(BatchError::ShapeMismatch {
                field: field.into(),
                first: first.shape.clone(),
                other: t.shape.clone(),
            });
        }
        for (m, d) in shape.iter_mut().zip(&t.shape) {
            *m = (*m).max(*d);
        }
    }
    let dtype = first.dtype;
    let padded = column.iter().any(|t| t.shape != shape);
    let mut batched = vec![rows.len()];
    batched.extend(shape.iter().copied());
    if dtype == DType::Bytes {
        return Ok(stack_strings(field, rows, shape)?.into());
    }
    if padded {
        let item_bytes = shape.iter().product::<usize>() * dtype.size();
        let mut data = BytesMut::with_capacity(item_bytes * rows.len());
        let fill = pad_bytes(dtype, pad.unwrap_or(0.0));
        for row in rows.iter_mut() {
            let t = row.remove(field).expect("checked above");
            pad_into(&mut data, &t, &shape, &fill);
        }
        return Ok(Tensor::new(dtype, batched, data.freeze()).expect("stacked length matches the shape").into());
    }
    Ok(Stacked::dense(dtype, batched, take_parts(field, rows, Vec::new())))
}

/// Each row's bytes of `field` after `parts`, taken out of the rows: large ones as they are,
/// runs of small ones joined.
fn take_parts(field: &str, rows: &mut [Fields], mut parts: Vec<Bytes>) -> Vec<Bytes> {
    let mut small = BytesMut::new();
    for row in rows.iter_mut() {
        let t = row.remove(field).expect("checked by the caller");
        if t.data.len() < OWN_PART {
            small.extend_from_slice(&t.data);
            continue;
        }
        if !small.is_empty() {
            parts.push(small.split().freeze());
        }
        parts.push(t.data);
    }
    if !small.is_empty() {
        parts.push(small.freeze());
    }
    parts
}

/// A `jagged` field: the offsets of the rows' lists, then each row's values as they are.
fn stack_jagged(field: &str, rows: &mut [Fields]) -> Result<Stacked, BatchError> {
    let mut offsets = Vec::with_capacity(8 * (rows.len() + 1));
    offsets.extend_from_slice(&0i64.to_le_bytes());
    let (mut end, mut dtype) = (0i64, None);
    for row in rows.iter() {
        let t = row.get(field).ok_or_else(|| BatchError::MissingField { field: field.into() })?;
        let first = *dtype.get_or_insert(t.dtype);
        if t.dtype != first {
            return Err(BatchError::DTypeMismatch { field: field.into(), first, other: t.dtype });
        }
        // A scalar is a list of one: record formats make a one-item list a scalar (a JSON
        // `[7]`, a TFRecord feature of one value).
        if t.shape.len() > 1 || !t.dtype.is_fixed() {
            let what = format!("a {} tensor of shape {:?}", t.dtype.numpy_name(), t.shape);
            return Err(BatchError::NotJagged { field: field.into(), what });
        }
        end += t.len() as i64;
        offsets.extend_from_slice(&end.to_le_bytes());
    }
    let parts = take_parts(field, rows, vec![Bytes::from(offsets)]);
    let dtype = dtype.expect("a batch has rows");
    Ok(Stacked { dtype, shape: vec![rows.len()], parts, layout: Layout::Jagged })
}

/// Text: every row's strings in order, each row's list padded at its end with empty strings
/// to the longest (padding of higher ranks is refused).
fn stack_strings(field: &str, rows: &mut [Fields], shape: Vec<usize>) -> Result<Tensor, BatchError> {
    let per_row = shape.iter().product::<usize>();
    if shape.len() > 1
        && let Some(other) = rows.iter().map(|r| &r[field].shape).find(|s| **s != shape)
    {
        return Err(BatchError::ShapeMismatch { field: field.into(), first: shape.clone(), other: other.clone() });
    }
    let mut tensors = Vec::with_capacity(rows.len());
    for row in rows.iter_mut() {
        tensors.push(row.remove(field).expect("checked by the caller"));
    }
    let mut strings: Vec<&[u8]> = Vec::with_capacity(per_row * tensors.len());
    for t in &tensors {
        let before = strings.len();
        strings.extend(t.string_values());
        strings.resize(before + per_row, b"");
    }
    let mut batched = vec![tensors.len()];
    batched.extend(shape);
    Ok(Tensor::strings(batched, &strings).expect("the strings' layout"))
}

/// Copies `t` into a block of `shape` (every dim >= t's), filling the rest with `fill`.
fn pad_into(out: &mut BytesMut, t: &Tensor, shape: &[usize], fill: &[u8]) {
    let size = t.dtype.size();
    let total = shape.iter().product::<usize>();
    let start = out.len();
    for _ in 0..total {
        out.extend_from_slice(fill);
    }
    if t.is_empty() {
        return;
    }
    // Copy row by row: the innermost dimension is contiguous in both layouts.
    let inner = *t.shape.last().unwrap_or(&1);
    let rows = t.len() / inner.max(1);
    let rank = t.shape.len();
    for row in 0..rows {
        // Multi-index of this row in t, then its offset in the padded block.
        let (mut rest, mut offset, mut stride) = (row, 0usize, shape.last().copied().unwrap_or(1));
        for d in (0..rank.saturating_sub(1)).rev() {
            let i = rest % t.shape[d];
            rest /= t.shape[d];
            offset += i * stride;
            stride *= shape[d];
        }
        let src = &t.data[row * inner * size..(row + 1) * inner * size];
        let dst = start + offset * size;
        out[dst..dst + src.len()].copy_from_slice(src);
    }
}

fn pad_bytes(dtype: DType, value: f64) -> Vec<u8> {
    match dtype {
        DType::Uint8 => vec![value.clamp(0.0, 255.0) as u8],
        DType::Int32 => (value as i32).to_le_bytes().to_vec(),
        DType::Int64 => (value as i64).to_le_bytes().to_vec(),
        DType::Float16 => half::f16::from_f64(value).to_le_bytes().to_vec(),
        DType::Float32 => (value as f32).to_le_bytes().to_vec(),
        DType::Float64 => value.to_le_bytes().to_vec(),
        DType::Bytes => Vec::new(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use bytes::Bytes;

    fn i32s(shape: Vec<usize>, values: &[i32]) -> Tensor {
        Tensor::new(DType::Int32, shape, Bytes::from(values.iter().flat_map(|v| v.to_le_bytes()).collect::<Vec<_>>()))
            .unwrap()
    }

    fn values(t: &Tensor) -> Vec<i32> {
        t.data.chunks(4).map(|c| i32::from_le_bytes(c.try_into().unwrap())).collect()
    }

    fn pad(value: f64) -> Shaping {
        Shaping { pad: Some(value), ..Shaping::default() }
    }

    fn row(fields: &[(&str, Tensor)]) -> Row {
        Row::Fields(fields.iter().map(|(k, v)| (k.to_string(), v.clone())).collect())
    }

    #[test]
    fn same_shapes_stack_along_a_new_axis() {
        let mut rows = vec![
            row(&[("x", i32s(vec![2], &[1, 2])), ("y", i32s(vec![], &[7]))]),
            row(&[("x", i32s(vec![2], &[3, 4])), ("y", i32s(vec![], &[8]))]),
        ];
        let b = make_batch(&mut rows, &Shaping::default(), 1, 2, 3).unwrap();
        assert_eq!((b.epoch, b.split, b.sequence), (1, 2, 3));
        assert_eq!(b.tensors["x"].shape, [2, 2]);
        assert_eq!(values(&b.tensors["x"].join()), [1, 2, 3, 4]);
        assert_eq!(b.tensors["y"].shape, [2]);
        assert_eq!(values(&b.tensors["y"].join()), [7, 8]);
    }

    #[test]
    fn large_rows_are_kept_as_they_are_and_small_ones_joined() {
        let big = |v: u8| Tensor::new(DType::Uint8, vec![OWN_PART], Bytes::from(vec![v; OWN_PART])).unwrap();
        let label = |v: i32| i32s(vec![], &[v]);
        let (a, b) = (big(1), big(2));
        let mut rows = vec![row(&[("x", a.clone()), ("y", label(7))]), row(&[("x", b.clone()), ("y", label(8))])];
        let batch = make_batch(&mut rows, &Shaping::default(), 0, 0, 0).unwrap();
        let x = &batch.tensors["x"];
        assert_eq!(x.parts.len(), 2);
        assert_eq!(x.parts[0].as_ptr(), a.data.as_ptr(), "the row's own buffer, not a copy");
        assert_eq!(x.join().data.len(), 2 * OWN_PART);
        assert_eq!(batch.tensors["y"].parts.len(), 1, "labels joined");
        assert_eq!(values(&batch.tensors["y"].join()), [7, 8]);
    }

    #[test]
    fn variable_shapes_pad_to_the_largest_with_the_declared_value() {
        let mut rows = vec![row(&[("x", i32s(vec![1, 2], &[1, 2]))]), row(&[("x", i32s(vec![2, 1], &[3, 4]))])];
        let b = make_batch(&mut rows, &pad(-1.0), 0, 0, 0).unwrap();
        assert_eq!(b.tensors["x"].shape, [2, 2, 2]);
        assert_eq!(values(&b.tensors["x"].join()), [1, 2, -1, -1, 3, -1, 4, -1]);
    }

    #[test]
    fn mismatches_are_clear_errors() {
        let a = row(&[("x", i32s(vec![2], &[1, 2]))]);
        let b = row(&[("x", i32s(vec![3], &[1, 2, 3]))]);
        let e = make_batch(&mut vec![a.clone(), b], &Shaping::default(), 0, 0, 0).unwrap_err();
        assert!(e.to_string().contains("set spec.padValue"), "{e}");
        let c = row(&[("y", i32s(vec![2], &[1, 2]))]);
        assert!(matches!(
            make_batch(&mut vec![a.clone(), c], &Shaping::default(), 0, 0, 0),
            Err(BatchError::MissingField { .. })
        ));
        let f = row(&[("x", Tensor::new(DType::Uint8, vec![2], Bytes::from_static(&[1, 2])).unwrap())]);
        assert!(matches!(
            make_batch(&mut vec![a, f], &Shaping::default(), 0, 0, 0),
            Err(BatchError::DTypeMismatch { .. })
        ));
    }

    #[test]
    fn text_stacks_as_text_and_lists_pad_with_empty_strings() {
        let s = |shape: Vec<usize>, v: &[&str]| Tensor::strings(shape, v).unwrap();
        let mut rows = vec![row(&[("t", s(vec![], &["ab"]))]), row(&[("t", s(vec![], &[""]))])];
        let b = make_batch(&mut rows, &Shaping::default(), 0, 0, 0).unwrap();
        assert_eq!(b.tensors["t"].shape, [2]);
        assert_eq!(b.tensors["t"].join().string_values().collect::<Vec<_>>(), [&b"ab"[..], b""]);
        let mut rows = vec![row(&[("t", s(vec![1], &["x"]))]), row(&[("t", s(vec![3], &["a", "b", "c"]))])];
        let b = make_batch(&mut rows, &pad(0.0), 0, 0, 0).unwrap();
        assert_eq!(b.tensors["t"].shape, [2, 3]);
        assert_eq!(b.tensors["t"].join().string_values().collect::<Vec<_>>(), [&b"x"[..], b"", b"", b"a", b"b", b"c"]);
        let mut rows = vec![row(&[("t", s(vec![1, 2], &["a", "b"]))]), row(&[("t", s(vec![2, 1], &["c", "d"]))])];
        assert!(matches!(make_batch(&mut rows, &pad(0.0), 0, 0, 0), Err(BatchError::ShapeMismatch { .. })));
    }

    #[test]
    fn jagged_fields_keep_each_rows_list_after_their_offsets() {
        let shaping = Shaping { pad: Some(0.0), jagged: ["ids".to_string()].into() };
        let big: Vec<i32> = (0..OWN_PART as i32).collect();
        let mut rows = vec![
            row(&[("ids", i32s(vec![2], &[1, 2])), ("x", i32s(vec![1], &[5]))]),
            row(&[("ids", i32s(vec![0], &[])), ("x", i32s(vec![2], &[6, 7]))]),
            row(&[("ids", i32s(vec![big.len()], &big)), ("x", i32s(vec![1], &[8]))]),
        ];
        let b = make_batch(&mut rows, &shaping, 0, 0, 0).unwrap();
        let ids = &b.tensors["ids"];
        assert_eq!((ids.layout, ids.shape.clone(), ids.dtype), (Layout::Jagged, vec![3], DType::Int32));
        assert_eq!(ids.parts.len(), 3, "offsets, the small rows joined, the large row as it is");
        let joined = Tensor::with_layout(ids.dtype, ids.layout, ids.shape.clone(), ids.join().data).unwrap();
        let (offsets, got) = joined.jagged_parts().unwrap();
        let offsets: Vec<i64> = offsets.chunks(8).map(|c| i64::from_le_bytes(c.try_into().unwrap())).collect();
        assert_eq!(offsets, [0, 2, 2, 2 + big.len() as i64]);
        let got: Vec<i32> = got.chunks(4).map(|c| i32::from_le_bytes(c.try_into().unwrap())).collect();
        assert_eq!(got, [&[1, 2][..], &big].concat());
        // A field not listed is padded as before.
        assert_eq!((b.tensors["x"].layout, b.tensors["x"].shape.clone()), (Layout::Dense, vec![3, 2]));

        // Only lists of numbers are jagged.
        for (what, t) in [
            ("a int32 tensor of shape [1, 2]", i32s(vec![1, 2], &[1, 2])),
            ("a bytes tensor of shape [1]", Tensor::strings(vec![1], &["a"]).unwrap()),
        ] {
            let e = make_batch(&mut vec![row(&[("ids", t)])], &shaping, 0, 0, 0).unwrap_err();
            assert!(e.to_string().contains(what) && e.to_string().contains("spec.jagged"), "{e}");
        }
        // A scalar is a list of one.
        let mut rows = vec![row(&[("ids", i32s(vec![], &[4]))]), row(&[("ids", i32s(vec![2], &[5, 6]))])];
        let ids = make_batch(&mut rows, &shaping, 0, 0, 0).unwrap().tensors.remove("ids").unwrap().join();
        assert_eq!(ids.data.len(), 8 * 3 + 4 * 3);
        assert_eq!(values(&Tensor::new(DType::Int32, vec![3], ids.data.slice(24..)).unwrap()), [4, 5, 6]);
        let mixed = vec![
            row(&[("ids", i32s(vec![1], &[1]))]),
            row(&[("ids", Tensor::jagged(DType::Int64, &[0], &[]).unwrap())]),
        ];
        assert!(matches!(make_batch(&mut mixed.clone(), &shaping, 0, 0, 0), Err(BatchError::DTypeMismatch { .. })));
    }

    #[test]
    fn float16_padding_encodes_the_value() {
        assert_eq!(pad_bytes(DType::Float16, 1.0), half::f16::from_f32(1.0).to_le_bytes());
        assert_eq!(pad_bytes(DType::Uint8, 300.0), [255]);
    }
}
