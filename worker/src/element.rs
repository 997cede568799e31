//! The element model shared by every record format: a record is a map of named fields.

use std::collections::BTreeMap;

use bytes::Bytes;

/// One record. A `BTreeMap` so that field order, and everything derived from it (batch layout,
/// encodings), is deterministic.
pub type Element = BTreeMap<String, Field>;

/// A field's value. Text is `Bytes` holding UTF-8: transforms treat it as opaque payload and
/// keeping one variant avoids a second copy-free path.
#[derive(Debug, Clone, PartialEq)]
pub enum Field {
    Bytes(Bytes),
    BytesList(Vec<Bytes>),
    Int64(Vec<i64>),
    Float32(Vec<f32>),
    Float64(Vec<f64>),
    /// What transforms make: a decoded image, a normalized array.
    Tensor(stoker_api::Tensor),
}

impl Field {
    /// The single payload of a `Bytes` field, or the only entry of a one-item list.
    pub fn as_bytes(&self) -> Option<&Bytes> {
        match self {
            Field::Bytes(b) => Some(b),
            Field::BytesList(list) if list.len() == 1 => list.first(),
            _ => None,
        }
    }

    /// How many values the field holds (1 for `Bytes`).
    pub fn len(&self) -> usize {
        match self {
            Field::Bytes(_) => 1,
            Field::BytesList(v) => v.len(),
            Field::Int64(v) => v.len(),
            Field::Float32(v) => v.len(),
            Field::Float64(v) => v.len(),
            Field::Tensor(t) => t.len(),
        }
    }

    /// The variant's name, for error messages.
    pub fn kind(&self) -> &'static str {
        match self {
            Field::Bytes(_) => "bytes",
            Field::BytesList(_) => "a list of byte strings",
            Field::Int64(_) => "int64",
            Field::Float32(_) => "float32",
            Field::Float64(_) => "float64",
            Field::Tensor(_) => "a tensor",
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}
