//! Feature ops against a reference computed with numpy, pyarrow and xxhash on the same data.
//! tests/features_reference.py writes, with pyarrow, Parquet files of 4,000 rows (integers of
//! every width, floats with NaN and infinities, plain, dictionary-encoded and large strings,
//! binary, lists with null lists and null items; several row groups in two files of different
//! codecs) and, from docs/transforms.md alone, what each op gives on every row, keyed by the
//! rows' `id`. Each test runs pipelines over those files through the engine, shuffled, and
//! checks that every row arrives once and every value of it is the reference's (floats exactly:
//! the docs promise f64 arithmetic rounded once to float32). A null an op lets through is filled
//! after it, so the fill shows where the nulls went. Needs STOKER_PYTHON naming a Python with
//! numpy, pyarrow and xxhash (`make venv` makes one).

use std::collections::BTreeSet;
use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;
use std::sync::atomic::Ordering;

use serde_json::{Map, Value};
use stoker_api::{Batch, DType, Tensor, WorkerPipeline};
use stoker_worker::engine::EngineError;

/// What the pipelines pad a batch's shorter lists with (text: empty strings).
const PAD: i64 = -1;

/// Most mismatches told of one reference column; the rest are counted.
const SHOWN: usize = 5;

/// The files and the reference outputs features_reference.py wrote.
struct Reference {
    dir: PathBuf,
    rows: usize,
    /// The ids in the files' order (rows are written shuffled, so an id is not a position).
    file_order: Vec<i64>,
    /// Each input column's values by id, as text, for the messages.
    inputs: Map<String, Value>,
    /// "op.column": {kind, input, values by id}.
    expected: Map<String, Value>,
}

/// The reference, made once per run of this test binary.
fn reference() -> &'static Reference {
    static REFERENCE: OnceLock<Reference> = OnceLock::new();
    REFERENCE.get_or_init(|| {
        let python = std::env::var("STOKER_PYTHON").unwrap_or_else(|_| {
            panic!(
                "STOKER_PYTHON is unset: it names the Python that computes these tests' reference, with numpy, \
                 pyarrow and xxhash (`make venv` makes one; then STOKER_PYTHON=~/.cache/stoker/venv/bin/python)"
            )
        });
        let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("features_numpy");
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/features_reference.py");
        let output = std::process::Command::new(&python)
            .arg(&script)
            .arg(&dir)
            .output()
            .unwrap_or_else(|e| panic!("running {python} (STOKER_PYTHON; `make venv` makes one): {e}"));
        assert!(
            output.status.success(),
            "{python} {} failed ({}); `make venv` installs numpy, pyarrow and xxhash:\n{}",
            script.display(),
            output.status,
            String::from_utf8_lossy(&output.stderr)
        );
        let mut json: Value = serde_json::from_slice(&std::fs::read(dir.join("expected.json")).unwrap()).unwrap();
        let mut take = |key: &str| json[key].take();
        let rows = take("rows").as_u64().unwrap() as usize;
        let file_order = take("file_order").as_array().unwrap().iter().map(|v| v.as_i64().unwrap()).collect();
        let Value::Object(inputs) = take("inputs") else { panic!("no inputs") };
        let Value::Object(expected) = take("expected") else { panic!("no expected") };
        Reference { dir, rows, file_order, inputs, expected }
    })
}

fn pipeline(transforms: &str) -> WorkerPipeline {
    let manifest = format!(
        "source: {{uri: 'file://{}/data/', format: parquet}}\nbatchSize: 300\nseed: 5\n\
         shuffle: {{bufferSize: 1500}}\npadValue: {PAD}\ntransforms:\n{transforms}",
        reference().dir.display()
    );
    crate::engine_support::pipeline("features-numpy", &manifest)
}

/// One epoch of the pipeline's batches; every row counted once by the engine.
async fn epoch(transforms: &str) -> Result<Vec<Batch>, EngineError> {
    let (batches, engine) = crate::engine_support::epoch(pipeline(transforms)).await?;
    assert_eq!(engine.stats.elements.load(Ordering::Relaxed), reference().rows as u64, "{transforms}");
    Ok(batches)
}

/// One value of a tensor or of the reference. Floats compare as values, NaN equal to NaN.
#[derive(Clone)]
enum Item {
    Int(i64),
    F32(f32),
    F64(f64),
    Text(Vec<u8>),
}

impl PartialEq for Item {
    fn eq(&self, other: &Item) -> bool {
        match (self, other) {
            (Item::Int(a), Item::Int(b)) => a == b,
            (Item::F32(a), Item::F32(b)) => a == b || (a.is_nan() && b.is_nan()),
            (Item::F64(a), Item::F64(b)) => a == b || (a.is_nan() && b.is_nan()),
            (Item::Text(a), Item::Text(b)) => a == b,
            _ => false,
        }
    }
}

impl fmt::Debug for Item {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Item::Int(v) => write!(f, "{v}"),
            Item::F32(v) => write!(f, "{v:?}f32"),
            Item::F64(v) => write!(f, "{v:?}"),
            Item::Text(v) => write!(f, "{:?}", String::from_utf8_lossy(v)),
        }
    }
}

/// A tensor's values in row-major order.
fn items(tensor: &Tensor) -> Vec<Item> {
    match tensor.dtype {
        DType::Int64 => tensor.data.chunks(8).map(|c| Item::Int(i64::from_le_bytes(c.try_into().unwrap()))).collect(),
        DType::Float32 => tensor.data.chunks(4).map(|c| Item::F32(f32::from_le_bytes(c.try_into().unwrap()))).collect(),
        DType::Float64 => tensor.data.chunks(8).map(|c| Item::F64(f64::from_le_bytes(c.try_into().unwrap()))).collect(),
        DType::Bytes => tensor.string_values().map(|s| Item::Text(s.to_vec())).collect(),
        other => panic!("a {other:?} tensor; the columnar path gives int64, float32, float64 and bytes"),
    }
}

/// A reference column: what the batch's tensor must be like, and each row's items.
struct Expected<'a> {
    dtype: DType,
    /// Lists are [rows, longest] padded with PAD ("" for text); vectors [rows, n].
    list: bool,
    pad: Option<Item>,
    input: &'a str,
    values: &'a [Value],
}

impl Expected<'_> {
    fn of(key: &str) -> Expected<'static> {
        let entry = &reference().expected.get(key).unwrap_or_else(|| panic!("the reference has no {key:?}"));
        let (dtype, list, pad) = match entry["kind"].as_str().unwrap() {
            "i64" => (DType::Int64, false, None),
            "f32" => (DType::Float32, false, None),
            "f64" => (DType::Float64, false, None),
            "bytes" => (DType::Bytes, false, None),
            "list_i64" => (DType::Int64, true, Some(Item::Int(PAD))),
            "list_bytes" => (DType::Bytes, true, Some(Item::Text(Vec::new()))),
            "vec_f32" => (DType::Float32, true, None),
            other => panic!("unknown kind {other}"),
        };
        let input = entry["input"].as_str().unwrap();
        Expected { dtype, list, pad, input, values: entry["values"].as_array().unwrap() }
    }

    fn item(&self, v: &Value) -> Item {
        match self.dtype {
            DType::Int64 => Item::Int(v.as_i64().unwrap()),
            DType::Float32 => Item::F32(f32::from_bits(v.as_u64().unwrap() as u32)),
            DType::Float64 => Item::F64(f64::from_bits(v.as_u64().unwrap())),
            _ => Item::Text(hex(v.as_str().unwrap())),
        }
    }

    /// Row `id`'s items, padded to `width` when a list.
    fn row(&self, id: usize, width: usize) -> Vec<Item> {
        let value = &self.values[id];
        if !self.list {
            return vec![self.item(value)];
        }
        let mut row: Vec<Item> = value.as_array().unwrap().iter().map(|v| self.item(v)).collect();
        if let Some(pad) = &self.pad {
            while row.len() < width {
                row.push(pad.clone());
            }
        }
        row
    }

    /// The inputs of row `id`, as text.
    fn inputs(&self, id: usize) -> String {
        let inputs = &reference().inputs;
        let text = |name: &str| inputs[name][id].as_str().unwrap().to_string();
        self.input.split(',').map(|name| format!("{name} = {}", text(name))).collect::<Vec<_>>().join(", ")
    }
}

fn hex(s: &str) -> Vec<u8> {
    (0..s.len()).step_by(2).map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap()).collect()
}

/// Checks the batches of one epoch: every row once, in an order not the files', and each
/// (batch field, reference key) of every row. Returns what differs.
fn compare(transforms: &str, batches: &[Batch], columns: &[(&str, &str)]) -> Vec<String> {
    let reference = reference();
    let mut problems = Vec::new();
    let mut seen = vec![0u32; reference.rows];
    let mut arrived = Vec::with_capacity(reference.rows);
    let mut wrong = vec![0usize; columns.len()];
    for batch in batches {
        let ids: Vec<usize> = (items(&batch.tensors["id"]).into_iter())
            .map(|i| match i {
                Item::Int(id) => id as usize,
                other => panic!("id {other:?}"),
            })
            .collect();
        ids.iter().for_each(|&id| seen[id] += 1);
        arrived.extend(ids.iter().map(|&id| id as i64));
        let fields: BTreeSet<&str> = batch.tensors.keys().map(String::as_str).collect();
        let named: BTreeSet<&str> = columns.iter().map(|(field, _)| *field).chain(["id"]).collect();
        if fields != named {
            problems.push(format!("the batch's fields are {fields:?}; expected {named:?}"));
            continue;
        }
        for (c, (field, key)) in columns.iter().enumerate() {
            let expected = Expected::of(key);
            let tensor = &batch.tensors[*field];
            let shape_ok = match expected.list {
                false => tensor.shape == [ids.len()],
                true => tensor.shape.len() == 2 && tensor.shape[0] == ids.len(),
            };
            if tensor.dtype != expected.dtype || !shape_ok {
                problems.push(format!(
                    "{key}: the batch's {field:?} is {:?} {:?}; expected {:?} of {} rows{}",
                    tensor.dtype,
                    tensor.shape,
                    expected.dtype,
                    ids.len(),
                    if expected.list { " by n" } else { "" }
                ));
                continue;
            }
            let width = if expected.list { tensor.shape[1] } else { 1 };
            let got = items(tensor);
            for (row, &id) in ids.iter().enumerate() {
                let (want, got) = (expected.row(id, width), &got[row * width..(row + 1) * width]);
                if want != got {
                    wrong[c] += 1;
                    if wrong[c] <= SHOWN {
                        let (want, got): (&dyn fmt::Debug, &dyn fmt::Debug) = match expected.list {
                            false => (&want[0], &got[0]),
                            true => (&want, &got),
                        };
                        problems.push(format!(
                            "{key}: row id {id} ({}): expected {want:?}, got {got:?}",
                            expected.inputs(id)
                        ));
                    }
                }
            }
        }
    }
    for (c, (_, key)) in columns.iter().enumerate() {
        if wrong[c] > SHOWN {
            problems.push(format!("{key}: {} rows differ in all", wrong[c]));
        }
    }
    let twice: Vec<usize> = (0..reference.rows).filter(|&id| seen[id] > 1).take(5).collect();
    let missing: Vec<usize> = (0..reference.rows).filter(|&id| seen[id] == 0).take(5).collect();
    if !twice.is_empty() || !missing.is_empty() {
        problems.push(format!("rows more than once: {twice:?}...; rows missing: {missing:?}..."));
    }
    if arrived == reference.file_order {
        problems.push("the rows arrived in the files' order: not shuffled".into());
    }
    if !problems.is_empty() {
        problems.insert(0, format!("the pipeline\n{}\ngives", indent(transforms)));
    }
    problems
}

fn indent(transforms: &str) -> String {
    transforms.lines().map(|l| format!("      {l}")).collect::<Vec<_>>().join("\n")
}

/// Runs `transforms` (then selecting `id` and the columns' fields) and compares each (batch
/// field, reference key); an engine error is a problem too.
async fn check(transforms: &str, columns: &[(&str, &str)]) -> Vec<String> {
    let mut fields: Vec<&str> = columns.iter().map(|(field, _)| *field).collect();
    fields.dedup();
    let transforms = format!("{transforms}- selectFields: {{fields: [id, {}]}}\n", fields.join(", "));
    match epoch(&transforms).await {
        Ok(batches) => compare(&transforms, &batches, columns),
        Err(e) => vec![format!("the pipeline\n{}\nfails: {e}", indent(&transforms))],
    }
}

fn assert_none(problems: Vec<String>) {
    assert!(problems.is_empty(), "{} disagreements with the reference:\n{}", problems.len(), problems.join("\n"));
}

/// (field, "op.field") for each field.
fn keyed<'a>(op: &str, fields: &[&'a str]) -> Vec<(&'a str, String)> {
    fields.iter().map(|f| (*f, format!("{op}.{f}"))).collect()
}

fn pairs<'a>(keyed: &'a [(&'a str, String)]) -> Vec<(&'a str, &'a str)> {
    keyed.iter().map(|(f, k)| (*f, k.as_str())).collect()
}

/// The op over `fields`, then the nulls it let through filled with -1 (text: "(missing)").
async fn op_then_fill(op: &str, transforms: &str, fields: &[&str], texts: &[&str]) -> Vec<String> {
    let mut all = transforms.to_string();
    let numbers: Vec<&str> = fields.iter().copied().filter(|f| !texts.contains(f)).collect();
    if !numbers.is_empty() {
        all += &format!("- fillNull: {{fields: [{}], value: -1}}\n", numbers.join(", "));
    }
    if !texts.is_empty() {
        all += &format!("- fillNull: {{fields: [{}], text: '(missing)'}}\n", texts.join(", "));
    }
    let keyed = keyed(op, fields);
    check(&all, &pairs(&keyed)).await
}

#[tokio::test(flavor = "multi_thread")]
async fn fill_null_gives_numbers_the_value_text_the_text_and_null_lists_no_items() {
    let numbers = ["i8", "i16", "i32", "i64", "u32", "u64", "f32", "f64", "flag", "lst", "lstn"];
    let texts = ["s", "sd", "sl", "b", "tags"];
    let transforms = format!(
        "- fillNull: {{fields: [{}], value: -1.5}}\n- fillNull: {{fields: [{}], text: '(missing)'}}\n",
        numbers.join(", "),
        texts.join(", ")
    );
    let keyed = keyed("fill", &[&numbers[..], &texts[..]].concat());
    assert_none(check(&transforms, &pairs(&keyed)).await);
}

#[tokio::test(flavor = "multi_thread")]
async fn log1p_standardize_and_clip_compute_in_f64_as_numpy_does() {
    let mut problems = Vec::new();
    let fields = ["i8", "i16", "i32", "i64", "u32", "f32", "f64", "flag"];
    let log1p = format!("- log1p: {{fields: [{}]}}\n", fields.join(", "));
    problems.extend(op_then_fill("log1p", &log1p, &fields, &[]).await);
    let fields = ["i16", "i32", "i64", "u32", "f32", "f64"];
    let standardize = format!("- standardize: {{fields: [{}], mean: 3.25, std: 1.7}}\n", fields.join(", "));
    problems.extend(op_then_fill("standardize", &standardize, &fields, &[]).await);
    // min only, on integers (rounded inwards to -5) and floats; both; max only.
    let clip = "- clip: {fields: [i32, f32], min: -5.5}\n\
                - clip: {fields: [i8, i64, f64], min: -100.25, max: 1000.75}\n\
                - clip: {fields: [u32], max: 3000000000.5}\n";
    problems.extend(op_then_fill("clip", clip, &["i32", "f32", "i8", "i64", "f64", "u32"], &[]).await);
    assert_none(problems);
}

#[tokio::test(flavor = "multi_thread")]
async fn bucketize_is_numpy_digitize_at_the_boundaries_and_for_nan() {
    let fields = ["i8", "i32", "i64", "u32", "f32", "f64", "lst"];
    let transforms = "- bucketize: {fields: [i8, i32, i64, u32, f32, f64], boundaries: [-10, -1, 0, 0.5, 2, 3.25, 100, 10000]}\n\
                      - bucketize: {fields: [lst], boundaries: [0, 10, 1000]}\n";
    assert_none(op_then_fill("bucketize", transforms, &fields, &[]).await);
}

#[tokio::test(flavor = "multi_thread")]
async fn hash_bucket_is_xxh64_of_bytes_and_of_integers_as_little_endian_int64() {
    let fields = ["s", "sd", "sl", "b", "flag", "tags", "i8", "i16", "i32", "i64", "u32", "u64", "lst", "lstn"];
    let transforms = "- hashBucket: {fields: [s, sd, sl, b, flag, tags], buckets: 1000003}\n\
                      - hashBucket: {fields: [i8, i16, i32, i64, u32, u64, lst], buckets: 97}\n\
                      - hashBucket: {fields: [lstn], buckets: 1099511627776}\n";
    assert_none(op_then_fill("hash", transforms, &fields, &[]).await);
}

#[tokio::test(flavor = "multi_thread")]
async fn vocabulary_gives_the_first_matching_line_else_the_oov_id() {
    let dir = reference().dir.display();
    let fields = ["s", "sd", "sl", "b", "tags", "i8", "i32", "i64", "u32", "lst"];
    let transforms = format!(
        "- vocabulary: {{fields: [s, sd, sl, b, tags], path: {dir}/vocab_strings.txt, oovId: 1000}}\n\
         - vocabulary: {{fields: [i8, i32, i64, u32, lst], path: {dir}/vocab_ints.txt}}\n"
    );
    assert_none(op_then_fill("vocabulary", &transforms, &fields, &[]).await);
}

#[tokio::test(flavor = "multi_thread")]
async fn truncate_keeps_the_first_or_the_last_items() {
    let transforms = "- truncate: {fields: [lst], length: 3, keep: first}\n\
                      - truncate: {fields: [lstn], length: 4, keep: last}\n\
                      - truncate: {fields: [tags], length: 2}\n";
    assert_none(op_then_fill("truncate", transforms, &["lst", "lstn", "tags"], &["tags"]).await);
}

#[tokio::test(flavor = "multi_thread")]
async fn cross_hashes_the_fields_hashes_and_keeps_the_fields() {
    let transforms = "- cross: {fields: [s, i32], buckets: 1000, output: s_x_i32}\n\
                      - cross: {fields: [sd, u64, b, flag], buckets: 2147483648, output: x4}\n\
                      - cross: {fields: [i64, sl], buckets: 1000003, output: i64_x_sl}\n\
                      - fillNull: {fields: [s_x_i32, x4, i64_x_sl], value: -1}\n\
                      - fillNull: {fields: [s], text: '(missing)'}\n\
                      - fillNull: {fields: [i32], value: -1.5}\n";
    let columns = [
        ("s_x_i32", "cross.s_x_i32"),
        ("x4", "cross.x4"),
        ("i64_x_sl", "cross.i64_x_sl"),
        ("s", "fill.s"),
        ("i32", "fill.i32"),
    ];
    assert_none(check(transforms, &columns).await);
}

#[tokio::test(flavor = "multi_thread")]
async fn concat_makes_float32_vectors_of_the_fields_in_order() {
    let transforms = "- fillNull: {fields: [f64, i16, u32, f32, i8], value: 0}\n\
                      - log1p: {fields: [f64]}\n\
                      - concat: {fields: [f64, i16, u32, f32, i8], output: dense}\n";
    assert_none(check(transforms, &[("dense", "concat.dense")]).await);
}

/// uint64 values above 2^63 are numbers like any other to the numeric ops (only hashing, and
/// an int64 tensor, wrap them, as the docs say).
#[tokio::test(flavor = "multi_thread")]
async fn unsigned_64_bit_values_keep_their_magnitude_in_numeric_ops() {
    let dir = reference().dir.display();
    let mut problems = Vec::new();
    let ops = [
        ("log1p", "- log1p: {fields: [u64]}\n".to_string()),
        ("standardize", "- standardize: {fields: [u64], mean: 1.0e+19, std: 1.0e+18}\n".to_string()),
        ("clip", "- clip: {fields: [u64], min: 10, max: 1000}\n".to_string()),
        ("bucketize", "- bucketize: {fields: [u64], boundaries: [10, 9223372036854775808.0, 1.8e+19]}\n".to_string()),
        ("vocabulary", format!("- vocabulary: {{fields: [u64], path: {dir}/vocab_ints.txt}}\n")),
    ];
    for (op, transforms) in &ops {
        problems.extend(op_then_fill(op, transforms, &["u64"], &[]).await);
    }
    let concat = "- fillNull: {fields: [u64], value: 0}\n- concat: {fields: [u64], output: dense}\n";
    problems.extend(check(concat, &[("dense", "concat.u64")]).await);
    assert_none(problems);
}

/// large_list columns (pyarrow's, with 64-bit offsets) are lists like any other: `big` has
/// null lists, `bigf` none (so truncate and hashBucket are checked without a fillNull).
#[tokio::test(flavor = "multi_thread")]
async fn large_lists_are_lists() {
    let mut problems = Vec::new();
    problems.extend(check("- fillNull: {fields: [big], value: -1.5}\n", &[("big", "fill.big")]).await);
    let truncate = "- truncate: {fields: [bigf], length: 2, keep: last}\n";
    problems.extend(check(truncate, &[("bigf", "truncate.bigf")]).await);
    let hash = "- hashBucket: {fields: [bigf], buckets: 97}\n";
    problems.extend(check(hash, &[("bigf", "hash.bigf")]).await);
    assert_none(problems);
}
