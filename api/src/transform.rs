//! The ops a pipeline applies to each element, in order. Each item of `spec.transforms` is a
//! one-key object naming its op, so the schema rejects items with zero or two keys.

use std::collections::BTreeMap;

use crate::features::{Bucketize, Clip, Concat, Cross, FillNull, HashBucket, Log1p, Standardize, Truncate, Vocabulary};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

#[derive(Deserialize, Serialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub enum Transform {
    DecodeImage(DecodeImage),
    Resize(Resize),
    CenterCrop(CenterCrop),
    RandomResizedCrop(RandomResizedCrop),
    RandomFlip(RandomFlip),
    Normalize(Normalize),
    Cast(Cast),
    SelectFields(SelectFields),
    RenameFields(RenameFields),
    Filter(Filter),
    /// A user's Python function, run in Python processes beside the worker's Rust ops.
    Python(Python),
    /// Text to token ids with a Hugging Face tokenizer.
    Tokenize(Tokenize),
    /// Token sequences packed into rows of a fixed length (the last op).
    Pack(Pack),
    /// A place where caching is allowed; the operator decides whether to cache there.
    Autocache(Autocache),
    /// Data echoing: each element as the ops before it made it, `factor` times.
    Echo(Echo),
    // Feature ops (`features.rs`), column at a time over a Parquet source.
    FillNull(FillNull),
    Log1p(Log1p),
    Clip(Clip),
    Standardize(Standardize),
    Bucketize(Bucketize),
    HashBucket(HashBucket),
    Vocabulary(Vocabulary),
    Truncate(Truncate),
    Cross(Cross),
    Concat(Concat),
}

impl Transform {
    /// The op's name as written in a spec.
    pub fn name(&self) -> &'static str {
        match self {
            Transform::DecodeImage(_) => "decodeImage",
            Transform::Resize(_) => "resize",
            Transform::CenterCrop(_) => "centerCrop",
            Transform::RandomResizedCrop(_) => "randomResizedCrop",
            Transform::RandomFlip(_) => "randomFlip",
            Transform::Normalize(_) => "normalize",
            Transform::Cast(_) => "cast",
            Transform::SelectFields(_) => "selectFields",
            Transform::RenameFields(_) => "renameFields",
            Transform::Filter(_) => "filter",
            Transform::Python(_) => "python",
            Transform::Tokenize(_) => "tokenize",
            Transform::Pack(_) => "pack",
            Transform::Autocache(_) => "autocache",
            Transform::Echo(_) => "echo",
            Transform::FillNull(_) => "fillNull",
            Transform::Log1p(_) => "log1p",
            Transform::Clip(_) => "clip",
            Transform::Standardize(_) => "standardize",
            Transform::Bucketize(_) => "bucketize",
            Transform::HashBucket(_) => "hashBucket",
            Transform::Vocabulary(_) => "vocabulary",
            Transform::Truncate(_) => "truncate",
            Transform::Cross(_) => "cross",
            Transform::Concat(_) => "concat",
        }
    }

    /// Random ops give different output every epoch, so nothing after them may be cached. A
    /// `python` op is random unless it declares itself deterministic: its code is opaque.
    /// A feature op: run column at a time over a Parquet source's record batches.
    pub fn is_feature(&self) -> bool {
        matches!(
            self,
            Transform::FillNull(_)
                | Transform::Log1p(_)
                | Transform::Clip(_)
                | Transform::Standardize(_)
                | Transform::Bucketize(_)
                | Transform::HashBucket(_)
                | Transform::Vocabulary(_)
                | Transform::Truncate(_)
                | Transform::Cross(_)
                | Transform::Concat(_)
        )
    }

    /// The fields a feature op reads and writes (its `output` last); none for other ops.
    pub fn feature_fields(&self) -> Vec<&str> {
        let (fields, output) = match self {
            Transform::FillNull(op) => (&op.fields, None),
            Transform::Log1p(op) => (&op.fields, None),
            Transform::Clip(op) => (&op.fields, None),
            Transform::Standardize(op) => (&op.fields, None),
            Transform::Bucketize(op) => (&op.fields, None),
            Transform::HashBucket(op) => (&op.fields, None),
            Transform::Vocabulary(op) => (&op.fields, None),
            Transform::Truncate(op) => (&op.fields, None),
            Transform::Cross(op) => (&op.fields, Some(&op.output)),
            Transform::Concat(op) => (&op.fields, Some(&op.output)),
            _ => return Vec::new(),
        };
        fields.iter().chain(output).map(String::as_str).collect()
    }

    /// An op the columnar path runs: the feature ops, and the row and field ops it shares with
    /// the element path.
    pub fn is_columnar(&self) -> bool {
        self.is_feature()
            || matches!(self, Transform::Filter(_) | Transform::SelectFields(_) | Transform::RenameFields(_))
    }

    pub fn is_random(&self) -> bool {
        match self {
            Transform::RandomResizedCrop(_) | Transform::RandomFlip(_) => true,
            Transform::Python(p) => !p.deterministic,
            _ => false,
        }
    }
}

fn image_field() -> String {
    "image".into()
}

#[derive(Deserialize, Serialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct DecodeImage {
    /// Output channels: 1 (grey), 3 (RGB) or 4 (RGBA).
    #[serde(default = "three")]
    #[schemars(range(min = 1, max = 4))]
    pub channels: u8,
    #[serde(default = "image_field")]
    pub field: String,
}

fn three() -> u8 {
    3
}

/// Bilinear resize to an exact `size` or so that the shorter side is `shorterSide`.
#[derive(Deserialize, Serialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct Resize {
    /// [height, width], each at most 8192 px.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(inner(range(min = 1, max = crate::bounds::MAX_IMAGE_SIDE)))]
    pub size: Option<[u32; 2]>,
    /// At most 8192 px; the longer side follows the image's aspect ratio and is refused per
    /// element above 8192 px.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = crate::bounds::MAX_IMAGE_SIDE))]
    pub shorter_side: Option<u32>,
    #[serde(default = "image_field")]
    pub field: String,
}

#[derive(Deserialize, Serialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct CenterCrop {
    /// [height, width], each at most 8192 px.
    #[schemars(inner(range(min = 1, max = crate::bounds::MAX_IMAGE_SIDE)))]
    pub size: [u32; 2],
    #[serde(default = "image_field")]
    pub field: String,
}

/// torchvision's RandomResizedCrop: a random area fraction in `scale` and aspect ratio in
/// `ratio`, resized to `size`; falls back to a center crop after 10 failed draws.
#[derive(Deserialize, Serialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct RandomResizedCrop {
    /// [height, width], each at most 8192 px.
    #[schemars(inner(range(min = 1, max = crate::bounds::MAX_IMAGE_SIDE)))]
    pub size: [u32; 2],
    #[serde(default = "default_scale")]
    pub scale: [f64; 2],
    #[serde(default = "default_ratio")]
    pub ratio: [f64; 2],
    #[serde(default = "image_field")]
    pub field: String,
}

fn default_scale() -> [f64; 2] {
    [0.08, 1.0]
}
fn default_ratio() -> [f64; 2] {
    [3.0 / 4.0, 4.0 / 3.0]
}

/// Flips with probability 0.5 along each enabled axis.
#[derive(Deserialize, Serialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct RandomFlip {
    #[serde(default = "yes")]
    pub horizontal: bool,
    #[serde(default)]
    pub vertical: bool,
    #[serde(default = "image_field")]
    pub field: String,
}

fn yes() -> bool {
    true
}

/// (x / 255 - mean) / std per channel.
#[derive(Deserialize, Serialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct Normalize {
    #[schemars(length(min = 1, max = 4))]
    pub mean: Vec<f64>,
    #[schemars(length(min = 1, max = 4))]
    pub std: Vec<f64>,
    #[serde(default = "float32")]
    pub dtype: DType,
    #[serde(default = "image_field")]
    pub field: String,
}

fn float32() -> DType {
    DType::Float32
}

#[derive(Deserialize, Serialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct Cast {
    pub field: String,
    pub dtype: DType,
}

#[derive(Deserialize, Serialize, Clone, Copy, Debug, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub enum DType {
    Uint8,
    Int32,
    Int64,
    Float16,
    Float32,
    Float64,
    /// Byte strings (text), each of its own length: `cast` a text field to it to keep it text
    /// in the batch (see [`crate::Tensor`] for the layout).
    Bytes,
}

/// Keeps only these fields of each element.
#[derive(Deserialize, Serialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct SelectFields {
    #[schemars(length(min = 1))]
    pub fields: Vec<String>,
}

/// Renames fields: {from: to}.
#[derive(Deserialize, Serialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct RenameFields {
    pub mapping: BTreeMap<String, String>,
}

/// Keeps elements whose `field` compares true against `value` (numerically when both parse
/// as numbers, else as strings).
#[derive(Deserialize, Serialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct Filter {
    pub field: String,
    pub op: FilterOp,
    pub value: String,
}

#[derive(Deserialize, Serialize, Clone, Copy, Debug, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub enum FilterOp {
    Eq,
    Ne,
    Lt,
    Le,
    Gt,
    Ge,
}

#[derive(Deserialize, Serialize, Clone, Debug, Default, PartialEq, JsonSchema)]
pub struct Autocache {}

/// Data echoing (Choi et al., "Faster Neural Network Training with Data Echoing"): the ops
/// before it run once per element, the ops after it once per copy, each copy with random draws
/// of its own, so echoing before augmentation gives differently augmented copies. Each element
/// becomes `factor` rows. A row's position says which copy it is ([`crate::echo_copy`]): copy
/// 0 is the element as without echo. Exactly one of `factor` (fixed) and `maxFactor`
/// (automatic).
#[derive(Deserialize, Serialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct Echo {
    /// A fixed echo: rows per element, from 1 (no echo) to 255.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 255))]
    pub factor: Option<u32>,
    /// An automatic echo: the operator sets the factor, from 1 up to this (2 to 255), raising
    /// it while the autoscaler is held by `workers.max`, the cluster-wide budget or the
    /// namespace's cap and the clients still wait for data, lowering it when workers can be
    /// added or the waiting stops.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 2, max = 255))]
    pub max_factor: Option<u32>,
}

impl Echo {
    /// A fixed echo of `factor`.
    pub fn fixed(factor: u32) -> Self {
        Echo { factor: Some(factor), max_factor: None }
    }

    /// The factor of a split for which the dispatcher names none: the fixed one, or 1 (an
    /// automatic echo starts without repeats).
    pub fn initial(&self) -> u32 {
        self.factor.unwrap_or(1)
    }

    /// The largest factor any split may get.
    pub fn most(&self) -> u32 {
        self.max_factor.or(self.factor).unwrap_or(1)
    }
}

/// `module.function(element, rng)`: takes an element (a dict of numpy arrays, and `bytes` for
/// byte fields) and a `numpy.random.Generator` seeded from (seed, epoch, element, op), and
/// returns an element (a dict) or `None` to drop it; with `batch`, lists of both, a list back. It runs in a pool of Python processes
/// (one per worker thread) that exchange arrays with the worker through shared memory.
#[derive(Deserialize, Serialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct Python {
    /// The module to import, e.g. `augment` or `mypkg.transforms`.
    #[schemars(length(min = 1, max = 253))]
    pub module: String,
    /// The function in `module`.
    #[schemars(length(min = 1, max = 253))]
    pub function: String,
    /// A directory put first on the module search path, e.g. where a ConfigMap holding the
    /// code is mounted (`spec.workers.volumes` and `volumeMounts`); without it the module
    /// comes from the worker image's Python path.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub path: Option<String>,
    /// The function's output depends only on its input element (it ignores `rng` and keeps
    /// no state), so an autocache hint may follow it. Unset, the op counts as random.
    #[serde(default)]
    pub deterministic: bool,
    /// Seconds one call may take; a call past it has its process replaced and its element
    /// counted as failed (spec.onError).
    #[serde(default = "python_timeout")]
    #[schemars(range(min = 1, max = 3600))]
    pub timeout_seconds: u32,
    /// Resident memory (MiB) a Python process may reach; above it the process is replaced
    /// and the element it was working on counted as failed (spec.onError).
    #[serde(default = "python_memory")]
    #[schemars(range(min = 64, max = 65536))]
    pub memory_limit_mib: u32,
    /// Elements per call (the batched form): the function gets a list of elements and a list
    /// of their generators and returns a list as long, an element or None for each. Unset: one
    /// element per call. Which elements share a call is not fixed, so the function must treat
    /// each on its own (with its own generator) for runs to repeat.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = crate::bounds::MAX_PYTHON_BATCH))]
    pub batch: Option<u32>,
    /// How the function's image arrays (every numeric field of three dimensions, [height,
    /// width, channels]) lie in memory; the values and the indexing are the same either way.
    #[serde(default)]
    pub layout: ArrayLayout,
}

/// The memory order of a `python` op's image arrays.
#[derive(Deserialize, Serialize, Clone, Copy, Debug, Default, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub enum ArrayLayout {
    /// Pixel after pixel, a pixel's channels side by side (numpy's C order): what OpenCV and
    /// PIL expect.
    #[default]
    Interleaved,
    /// Channel after channel, each contiguous, the array still indexed [height, width,
    /// channels] (by its strides): what torchvision's `decode_jpeg` followed by `permute(1, 2,
    /// 0)` gives. Per-channel numpy code (`image[..., 0]`) then reads contiguous memory, about
    /// twice as fast; code that needs interleaved pixels pays a copy
    /// (`numpy.ascontiguousarray`).
    Planar,
}

impl Python {
    /// Elements per call when the op is batched.
    pub fn batched(&self) -> Option<usize> {
        self.batch.map(|n| n.clamp(1, crate::bounds::MAX_PYTHON_BATCH) as usize)
    }
}

/// Text to token ids with a Hugging Face tokenizer (`tokenizer.json`, any model the `tokenizers`
/// library loads: BPE, WordPiece, Unigram, with their normalizers, pre-tokenizers and
/// post-processors), run by the Rust `tokenizers` library on every worker thread. Output: an
/// int32 vector.
#[derive(Deserialize, Serialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct Tokenize {
    /// Path of the `tokenizer.json` in the workers (a volume or ConfigMap mounted through
    /// `spec.workers.volumes`, or a file of the worker image), or the URI of an object in a
    /// store the sources could be (`s3://bucket/tokenizer.json`, read with spec.source's
    /// credentials once per worker).
    #[schemars(length(min = 1, max = 4096))]
    pub tokenizer: String,
    /// The text: bytes holding UTF-8, or a `bytes` tensor of one string.
    #[serde(default = "text_field")]
    pub field: String,
    /// Where the ids go; the text field is kept (drop it with `selectFields`).
    #[serde(default = "ids_field")]
    pub output: String,
    /// Add the special tokens the tokenizer's post-processor defines (BOS, EOS, CLS, ...), as
    /// `Tokenizer.encode(text, add_special_tokens=True)` does.
    #[serde(default = "yes")]
    pub add_special_tokens: bool,
    /// Keep at most this many tokens, cut at the end, special tokens included (the library's
    /// truncation); unset, texts are not cut.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1))]
    pub max_length: Option<u32>,
}

/// Packs each split's token sequences, in the split's order, into rows of exactly `length`
/// tokens: documents are concatenated (each followed by `separator` when set), a document
/// longer than what is left of a row continues in the next, and the split's last row is filled
/// with `padId`. Each row carries `segment_ids` (1, 2, ... for the documents in the row, 0 for
/// padding) and `position_ids` (each token's position within its document's part in the row,
/// from 0), what attention masking between packed documents needs. Every other field is
/// dropped. Deterministic: the same split gives the same rows.
#[derive(Deserialize, Serialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct Pack {
    /// Tokens per row.
    #[schemars(range(min = 1, max = 1048576))]
    pub length: u32,
    /// The token ids to pack (an int32 or int64 vector, e.g. `tokenize`'s output).
    #[serde(default = "ids_field")]
    pub field: String,
    /// A token id put after each document (an end-of-document token), unless the document
    /// already ends with it; unset, documents are joined as they are.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub separator: Option<i32>,
    /// The id filling the end of a split's last row.
    #[serde(default)]
    pub pad_id: i32,
}

fn text_field() -> String {
    "text".into()
}
fn ids_field() -> String {
    "input_ids".into()
}

fn python_timeout() -> u32 {
    60
}
fn python_memory() -> u32 {
    2048
}
