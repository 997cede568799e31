//! Runs a pipeline's transforms on one element: picks each op's field, calls the kernel in
//! `ops`, and seeds random ops per (seed, epoch, element, op) so a run repeats exactly
//! whichever worker or thread processes the element.

use std::time::Instant;

use bytes::Bytes;
use stoker_api::{DType, FilterOp, Tensor, Transform};

use crate::element::{Element, Field};
use crate::loaded::Loaded;
use crate::op_tally::OpTally;
use crate::ops::{self, OpError};

/// Where an element sits in the run, for its random ops.
#[derive(Clone, Copy, Debug)]
pub struct ElementKey {
    pub seed: u64,
    pub epoch: u64,
    pub element: u64,
}

#[derive(Debug, thiserror::Error)]
pub enum ElementError {
    #[error("transforms[{index}].{op}: {source}")]
    Op { index: usize, op: &'static str, source: OpError },
    #[error("transforms[{index}].{op}: the element has no field {field:?}")]
    MissingField { index: usize, op: &'static str, field: String },
    #[error("transforms[{index}].{op}: field {field:?} is {have}, expected {want}")]
    FieldType { index: usize, op: &'static str, field: String, have: &'static str, want: &'static str },
    #[error("transforms[{index}].python {function}: {failure}")]
    Python { index: usize, function: String, failure: crate::python::Failure },
}

impl ElementError {
    /// A stable label for metrics.
    pub fn reason(&self) -> &'static str {
        match self {
            ElementError::Op { source, .. } => source.reason(),
            ElementError::MissingField { .. } => "missing_field",
            ElementError::FieldType { .. } => "field_type",
            ElementError::Python { failure, .. } => failure.reason(),
        }
    }

    /// Whether no element can succeed after this one (no Python process starts): the engine
    /// stops whatever spec.onError says.
    pub fn is_fatal(&self) -> bool {
        matches!(self, ElementError::Python { failure: crate::python::Failure::Start(_), .. })
    }
}

/// A pipeline's transforms and what its ops loaded.
#[derive(Clone, Copy)]
pub struct Transforms<'a> {
    pub list: &'a [Transform],
    pub loaded: &'a Loaded,
}

/// Applies the transforms in `range` (all of them, or those before or after an autocache
/// hint) in order; `Ok(None)` when a filter drops the element. `tally[i]` accumulates the
/// time spent in transform `i` and the elements into and out of it. Indices, and so the random streams of random ops, are those of
/// the whole pipeline.
pub fn apply_range(
    transforms: Transforms<'_>,
    range: std::ops::Range<usize>,
    mut element: Element,
    key: ElementKey,
    tally: &mut [OpTally],
) -> Result<Option<Element>, ElementError> {
    // Ops already applied with a decodeImage before them (a randomResizedCrop, and a
    // randomFlip and normalize folded into it) are skipped up to here.
    let mut applied_to = 0;
    for (index, transform) in transforms.list.iter().enumerate().take(range.end).skip(range.start) {
        if index < applied_to {
            continue;
        }
        // The engine tallies pack on the split's rows (engine::transform::Packing).
        if !matches!(transform, Transform::Pack(_)) {
            tally[index].elements_in += 1;
        }
        let started = Instant::now();
        let op = transform.name();
        let fail = |source| ElementError::Op { index, op, source };
        let rng = || ops::element_rng(key.seed, key.epoch, key.element, index as u64);
        match transform {
            Transform::DecodeImage(d) => {
                let bytes = take_bytes(&mut element, &d.field, index, op)?;
                let image = match transforms.list.get(index + 1) {
                    // Decoding only the crop's window; each step is timed and blamed as its op.
                    Some(next @ Transform::RandomResizedCrop(c)) if c.field == d.field && index + 1 < range.end => {
                        let crop_fail = |source| ElementError::Op { index: index + 1, op: next.name(), source };
                        let mut crop_rng = ops::element_rng(key.seed, key.epoch, key.element, index as u64 + 1);
                        let decoded = ops::decode_for_crop(&bytes, d.channels, c, &mut crop_rng)
                            .map_err(|e| if e.is_decoding() { fail(e) } else { crop_fail(e) })?;
                        let resizing = Instant::now();
                        tally[index].time += resizing - started;
                        tally[index].elements_out += 1;
                        tally[index + 1].elements_in += 1;
                        let (finish, after) =
                            finishing(transforms.list, index + 2, range.end, &d.field, key, &decoded)?;
                        applied_to = after;
                        let image = ops::resize_crop(&decoded, c, &finish).map_err(crop_fail)?;
                        // The folded ops' time is the crop's: they are part of its writing.
                        tally[index + 1].time += resizing.elapsed();
                        tally[index + 1].elements_out += 1;
                        tally[index + 2..after].iter_mut().for_each(|t| t.passed(1));
                        element.insert(d.field.clone(), Field::Tensor(image));
                        continue;
                    }
                    _ => ops::decode_image(&bytes, d.channels).map_err(fail)?,
                };
                element.insert(d.field.clone(), Field::Tensor(image));
            }
            Transform::Resize(r) => map_tensor(&mut element, &r.field, index, op, |t| ops::resize(t, r).map_err(fail))?,
            Transform::CenterCrop(c) => {
                map_tensor(&mut element, &c.field, index, op, |t| ops::center_crop(t, c).map_err(fail))?
            }
            Transform::RandomResizedCrop(c) => map_tensor(&mut element, &c.field, index, op, |t| {
                ops::random_resized_crop(t, c, &mut rng()).map_err(fail)
            })?,
            Transform::RandomFlip(f) => {
                map_tensor(&mut element, &f.field, index, op, |t| ops::random_flip(t, f, &mut rng()).map_err(fail))?
            }
            Transform::Normalize(n) => {
                map_tensor(&mut element, &n.field, index, op, |t| ops::normalize(t, n).map_err(fail))?
            }
            Transform::Cast(c) => {
                let field = element.remove(&c.field).ok_or_else(|| missing(index, op, &c.field))?;
                let cast = match (field, c.dtype) {
                    // One text value stays one string (not a vector of its bytes).
                    (Field::Bytes(text), DType::Bytes) => {
                        Tensor::strings(vec![], &[text]).expect("one string's layout")
                    }
                    (field, dtype) => ops::cast(&to_tensor(field), dtype).map_err(fail)?,
                };
                element.insert(c.field.clone(), Field::Tensor(cast));
            }
            Transform::SelectFields(s) => {
                if let Some(absent) = s.fields.iter().find(|f| !element.contains_key(*f)) {
                    return Err(missing(index, op, absent));
                }
                element.retain(|k, _| s.fields.contains(k));
            }
            Transform::RenameFields(r) => {
                for (from, to) in &r.mapping {
                    let value = element.remove(from).ok_or_else(|| missing(index, op, from))?;
                    element.insert(to.clone(), value);
                }
            }
            Transform::Filter(f) => {
                let value = element.get(&f.field).ok_or_else(|| missing(index, op, &f.field))?;
                if !keeps(value, f.op, &f.value) {
                    tally[index].time += started.elapsed();
                    return Ok(None);
                }
            }
            Transform::Python(p) => {
                let pool = transforms.loaded.python.as_ref().expect("loaded for a pipeline with python ops");
                let function = || format!("{}.{}", p.module, p.function);
                debug_assert!(p.batched().is_none(), "engine::stages calls batched ops on groups");
                match pool.call(index, key, std::mem::take(&mut element)) {
                    Ok(Some(out)) => element = out,
                    Ok(None) => {
                        tally[index].time += started.elapsed();
                        return Ok(None);
                    }
                    Err(failure) => return Err(ElementError::Python { index, function: function(), failure }),
                }
            }
            Transform::Tokenize(t) => {
                let text = match element.get(&t.field) {
                    Some(Field::Tensor(s)) if s.dtype == DType::Bytes && s.shape.is_empty() => {
                        s.string_values().next().map(|text| s.data.slice_ref(text))
                    }
                    Some(field) => field.as_bytes().cloned(),
                    None => return Err(missing(index, op, &t.field)),
                };
                let text = text.ok_or_else(|| ElementError::FieldType {
                    index,
                    op,
                    field: t.field.clone(),
                    have: element[&t.field].kind(),
                    want: "text (bytes or one string)",
                })?;
                let tokenizer = &transforms.loaded.tokenizers[&index];
                let ids = ops::tokenize(tokenizer, &text, t.add_special_tokens).map_err(fail)?;
                element.insert(t.output.clone(), Field::Tensor(ids));
            }
            // Packing takes the split's rows together: the engine does it after the others.
            // The engine does these on whole chunks and splits (stages.rs, transform.rs).
            Transform::Pack(_) | Transform::Autocache(_) | Transform::Echo(_) => {}
            feature => unreachable!("{} runs on the columnar path only (validate)", feature.name()),
        }
        tally[index].time += started.elapsed();
        if !matches!(transform, Transform::Pack(_)) {
            tally[index].elements_out += 1;
        }
    }
    Ok(Some(element))
}

/// The randomFlip and normalize on `field` right after a decoded crop (from `from`, in that
/// order, each optional, before `end`), to be done as the crop's output is written, and the
/// index after the last one folded.
fn finishing(
    list: &[Transform],
    from: usize,
    end: usize,
    field: &str,
    key: ElementKey,
    decoded: &ops::ForCrop,
) -> Result<(ops::Finish, usize), ElementError> {
    let mut at = from;
    let mut flips = ops::Flips::default();
    if let Some(Transform::RandomFlip(f)) = list.get(at).filter(|_| at < end)
        && f.field == field
    {
        flips = ops::flips(f, &mut ops::element_rng(key.seed, key.epoch, key.element, at as u64));
        at += 1;
    }
    let mut tables = None;
    if let Some(t @ Transform::Normalize(n)) = list.get(at).filter(|_| at < end)
        && n.field == field
    {
        tables = ops::Tables::new(n, decoded.channels()).map_err(|source| ElementError::Op {
            index: at,
            op: t.name(),
            source,
        })?;
        at += 1;
    }
    Ok((ops::Finish { flips, normalize: tables }, at))
}

fn missing(index: usize, op: &'static str, field: &str) -> ElementError {
    ElementError::MissingField { index, op, field: field.to_string() }
}

fn take_bytes(element: &mut Element, field: &str, index: usize, op: &'static str) -> Result<Bytes, ElementError> {
    match element.remove(field) {
        Some(Field::Bytes(b)) => Ok(b),
        Some(Field::BytesList(mut list)) if list.len() == 1 => Ok(list.remove(0)),
        Some(other) => {
            Err(ElementError::FieldType { index, op, field: field.into(), have: other.kind(), want: "bytes" })
        }
        None => Err(missing(index, op, field)),
    }
}

fn map_tensor(
    element: &mut Element,
    field: &str,
    index: usize,
    op: &'static str,
    f: impl FnOnce(&Tensor) -> Result<Tensor, ElementError>,
) -> Result<(), ElementError> {
    match element.get(field) {
        Some(Field::Tensor(t)) => {
            let out = f(t)?;
            element.insert(field.to_string(), Field::Tensor(out));
            Ok(())
        }
        Some(other) => Err(ElementError::FieldType {
            index,
            op,
            field: field.into(),
            have: other.kind(),
            want: "an image tensor (decodeImage first)",
        }),
        None => Err(missing(index, op, field)),
    }
}

/// A field as a tensor for batching: numeric lists of one value become scalars, longer lists
/// vectors, bytes a uint8 vector (`cast` it to `bytes` to keep it text), lists of byte strings
/// a vector of strings.
pub fn to_tensor(field: Field) -> Tensor {
    fn from_values<T: Copy>(dtype: DType, values: &[T], le: impl Fn(T) -> Vec<u8>) -> Tensor {
        let shape = if values.len() == 1 { vec![] } else { vec![values.len()] };
        let data: Vec<u8> = values.iter().flat_map(|v| le(*v)).collect();
        Tensor::new(dtype, shape, Bytes::from(data)).expect("length matches")
    }
    match field {
        Field::Tensor(t) => t,
        Field::Bytes(b) => Tensor::new(DType::Uint8, vec![b.len()], b).expect("length matches"),
        Field::Int64(v) => from_values(DType::Int64, &v, |x| x.to_le_bytes().to_vec()),
        Field::Float32(v) => from_values(DType::Float32, &v, |x| x.to_le_bytes().to_vec()),
        Field::Float64(v) => from_values(DType::Float64, &v, |x| x.to_le_bytes().to_vec()),
        Field::BytesList(list) => Tensor::strings(vec![list.len()], &list).expect("the strings' layout"),
    }
}

/// Numeric comparison when both sides are numbers, else comparison of the text.
fn keeps(value: &Field, op: FilterOp, target: &str) -> bool {
    let ordering = match (value, target.parse::<f64>()) {
        (Field::Int64(v), Ok(t)) if v.len() == 1 => (v[0] as f64).partial_cmp(&t),
        (Field::Float32(v), Ok(t)) if v.len() == 1 => (v[0] as f64).partial_cmp(&t),
        (Field::Float64(v), Ok(t)) if v.len() == 1 => v[0].partial_cmp(&t),
        (field, _) => field.as_bytes().map(|b| b.as_ref().cmp(target.as_bytes())),
    };
    holds(ordering, op)
}

/// Whether a value ordered `ordering` against a filter's target passes `op` (never when the
/// two do not compare: NaN, a number against text).
pub(crate) fn holds(ordering: Option<std::cmp::Ordering>, op: FilterOp) -> bool {
    use std::cmp::Ordering;
    let Some(ordering) = ordering else { return false };
    match op {
        FilterOp::Eq => ordering == Ordering::Equal,
        FilterOp::Ne => ordering != Ordering::Equal,
        FilterOp::Lt => ordering == Ordering::Less,
        FilterOp::Le => ordering != Ordering::Greater,
        FilterOp::Gt => ordering == Ordering::Greater,
        FilterOp::Ge => ordering != Ordering::Less,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn element(fields: &[(&str, Field)]) -> Element {
        fields.iter().map(|(k, v)| (k.to_string(), v.clone())).collect()
    }

    fn transforms(yaml: &str) -> Vec<Transform> {
        stoker_api::from_yaml(yaml).unwrap()
    }

    fn run(ts: &[Transform], el: Element) -> Result<Option<Element>, ElementError> {
        let mut tally = OpTally::for_ops(ts.len());
        let loaded = Loaded::default();
        let transforms = Transforms { list: ts, loaded: &loaded };
        apply_range(transforms, 0..ts.len(), el, ElementKey { seed: 1, epoch: 0, element: 0 }, &mut tally)
    }

    #[test]
    fn filter_compares_numbers_numerically_and_text_as_text() {
        let ts = transforms("- filter: {field: n, op: ge, value: '10'}");
        assert!(run(&ts, element(&[("n", Field::Int64(vec![10]))])).unwrap().is_some());
        assert!(run(&ts, element(&[("n", Field::Int64(vec![9]))])).unwrap().is_none(), "9 < 10 numerically");
        let ts = transforms("- filter: {field: lang, op: eq, value: en}");
        assert!(run(&ts, element(&[("lang", Field::Bytes(Bytes::from_static(b"en")))])).unwrap().is_some());
        assert!(run(&ts, element(&[("lang", Field::Bytes(Bytes::from_static(b"de")))])).unwrap().is_none());
    }

    #[test]
    fn each_op_counts_the_elements_into_and_out_of_it() {
        let ts = transforms(
            "- filter: {field: n, op: ge, value: '10'}\n- selectFields: {fields: [m]}\n- cast: {field: n, dtype: float32}",
        );
        let loaded = Loaded::default();
        let list = Transforms { list: &ts, loaded: &loaded };
        let mut tally = OpTally::for_ops(ts.len());
        for n in [3, 10, 11, 12] {
            // 3 is filtered out; 10 and 11 lack `m`, so selectFields fails; 12 has it, and
            // then the cast fails, its field gone.
            let mut el = element(&[("n", Field::Int64(vec![n]))]);
            if n == 12 {
                el.insert("m".into(), Field::Int64(vec![1]));
            }
            let _ = apply_range(list, 0..ts.len(), el, ElementKey { seed: 1, epoch: 0, element: n as u64 }, &mut tally);
        }
        let counts: Vec<_> = tally.iter().map(|t| (t.elements_in, t.elements_out)).collect();
        assert_eq!(counts, [(4, 3), (3, 1), (1, 0)]);
    }

    #[test]
    fn select_and_rename_name_the_missing_field() {
        let el = element(&[("a", Field::Int64(vec![1])), ("b", Field::Int64(vec![2]))]);
        let out = run(&transforms("- selectFields: {fields: [b]}\n- renameFields: {mapping: {b: c}}"), el.clone())
            .unwrap()
            .unwrap();
        assert_eq!(out.keys().collect::<Vec<_>>(), ["c"]);
        let err = run(&transforms("- selectFields: {fields: [zz]}"), el.clone()).unwrap_err();
        assert_eq!(err.to_string(), "transforms[0].selectFields: the element has no field \"zz\"");
        assert_eq!(err.reason(), "missing_field");
    }

    #[test]
    fn image_ops_need_a_decoded_image() {
        let el = element(&[("image", Field::Bytes(Bytes::from_static(b"not a jpeg")))]);
        let err = run(&transforms("- resize: {shorterSide: 8}"), el.clone()).unwrap_err();
        assert!(err.to_string().contains("decodeImage first"), "{err}");
        let err = run(&transforms("- decodeImage: {}"), el).unwrap_err();
        assert_eq!(err.reason(), "corrupt_image", "{err}");
    }

    #[test]
    fn cast_and_batching_forms() {
        let el = element(&[("x", Field::Float64(vec![1.5, 2.5]))]);
        let out = run(&transforms("- cast: {field: x, dtype: float32}"), el).unwrap().unwrap();
        let Field::Tensor(t) = &out["x"] else { panic!("cast makes a tensor") };
        assert_eq!((t.dtype, t.shape.clone()), (DType::Float32, vec![2]));
        assert_eq!(to_tensor(Field::Int64(vec![7])).shape, Vec::<usize>::new(), "one value is a scalar");
        assert_eq!(to_tensor(Field::Bytes(Bytes::from_static(b"abc"))).shape, [3]);
        let list = to_tensor(Field::BytesList(vec![Bytes::from_static(b"ab"), Bytes::from_static(b"c")]));
        assert_eq!((list.dtype, list.shape.clone()), (DType::Bytes, vec![2]));
        assert_eq!(list.string_values().collect::<Vec<_>>(), [&b"ab"[..], b"c"]);
        let el = element(&[("t", Field::Bytes(Bytes::from_static(b"text")))]);
        let out = run(&transforms("- cast: {field: t, dtype: bytes}"), el).unwrap().unwrap();
        let Field::Tensor(t) = &out["t"] else { panic!("cast makes a tensor") };
        assert_eq!((t.dtype, t.shape.clone()), (DType::Bytes, vec![]), "one string");
        let el = element(&[("t", Field::Int64(vec![1]))]);
        let e = run(&transforms("- cast: {field: t, dtype: bytes}"), el).unwrap_err();
        assert!(e.to_string().contains("text and numbers do not convert"), "{e}");
    }

    #[test]
    fn a_flip_and_a_normalize_after_a_decoded_crop_are_folded_into_it_with_the_same_result() {
        use jpeg_encoder::{ColorType, SamplingFactor};
        let rgb = ops::jpeg(123, 77, ColorType::Rgb, SamplingFactor::R_4_2_0, false);
        let grey = ops::jpeg(90, 60, ColorType::Luma, SamplingFactor::R_4_4_4, true);
        for (jpeg, channels, mean, std) in
            [(rgb, 3, "[0.485, 0.456, 0.406]", "[0.229, 0.224, 0.225]"), (grey, 1, "[0.5]", "[0.25]")]
        {
            for (flip, dtype) in [
                ("horizontal: true, vertical: true", "float32"),
                ("horizontal: true", "float16"),
                ("vertical: true", "uint8"),
            ] {
                let ts = transforms(&format!(
                    "- decodeImage: {{channels: {channels}}}\n- randomResizedCrop: {{size: [24, 20]}}\n\
                     - randomFlip: {{{flip}}}\n- normalize: {{mean: {mean}, std: {std}, dtype: {dtype}}}"
                ));
                let loaded = Loaded::default();
                let transforms = Transforms { list: &ts, loaded: &loaded };
                let mut tally = OpTally::for_ops(ts.len());
                let mut flipped = 0;
                for element in 0..40 {
                    let key = ElementKey { seed: 3, epoch: 1, element };
                    let el = element_of(&jpeg);
                    let mut folded_tally = OpTally::for_ops(ts.len());
                    let folded = apply_range(transforms, 0..4, el.clone(), key, &mut folded_tally).unwrap().unwrap();
                    // Folded: the flip and the normalize ran as part of the crop, which has
                    // their time; each op still counts the element in and out.
                    assert_eq!(
                        folded_tally[2..].iter().map(|t| t.time).collect::<Vec<_>>(),
                        [std::time::Duration::ZERO; 2]
                    );
                    assert!(folded_tally[1].time > std::time::Duration::ZERO);
                    assert!(folded_tally.iter().all(|t| (t.elements_in, t.elements_out) == (1, 1)), "{folded_tally:?}");
                    // Ranges that end after each op keep it from being folded into the one before.
                    let mut one_by_one = el;
                    for range in [0..2, 2..3, 3..4] {
                        one_by_one = apply_range(transforms, range, one_by_one, key, &mut tally).unwrap().unwrap();
                    }
                    let cropped = apply_range(transforms, 0..2, element_of(&jpeg), key, &mut tally).unwrap().unwrap();
                    let flipped_only =
                        apply_range(transforms, 2..3, cropped.clone(), key, &mut tally).unwrap().unwrap();
                    flipped += usize::from(flipped_only["image"] != cropped["image"]);
                    assert_eq!(
                        folded["image"], one_by_one["image"],
                        "{channels} channels, {flip}, {dtype}, element {element}"
                    );
                }
                assert!((8..=36).contains(&flipped), "{flipped} of 40 flipped ({flip})");
            }
        }
        // A normalize that cannot apply is still blamed on itself.
        let ts = transforms(
            "- decodeImage: {}\n- randomResizedCrop: {size: [8, 8]}\n- normalize: {mean: [0.5], std: [0.5]}",
        );
        let rgb = ops::jpeg(40, 30, ColorType::Rgb, SamplingFactor::R_4_4_4, false);
        let err = run(&ts, element_of(&rgb)).unwrap_err();
        assert_eq!(err.to_string(), "transforms[2].normalize: expected 3 channel values, got 1");
    }

    fn element_of(jpeg: &[u8]) -> Element {
        element(&[("image", Field::Bytes(Bytes::copy_from_slice(jpeg)))])
    }
}
