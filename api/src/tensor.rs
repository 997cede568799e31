//! Named tensors and batches: what workers produce and clients receive. Data is raw
//! little-endian bytes in `bytes::Bytes`, so slicing, sending and receiving never copy it.

use std::collections::BTreeMap;

use bytes::Bytes;

use crate::DType;

impl DType {
    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            DType::Uint8 => 1,
            DType::Float16 => 2,
            DType::Int32 | DType::Float32 => 4,
            DType::Int64 | DType::Float64 => 8,
        }
    }

    /// The numpy name of the type (`uint8`, `float16`, ...).
    pub fn numpy_name(self) -> &'static str {
        match self {
            DType::Uint8 => "uint8",
            DType::Int32 => "int32",
            DType::Int64 => "int64",
            DType::Float16 => "float16",
            DType::Float32 => "float32",
            DType::Float64 => "float64",
        }
    }

    /// The type of a numpy name ([`DType::numpy_name`]'s inverse).
    pub fn from_numpy_name(name: &str) -> Option<DType> {
        [DType::Uint8, DType::Int32, DType::Int64, DType::Float16, DType::Float32, DType::Float64]
            .into_iter()
            .find(|d| d.numpy_name() == name)
    }
}

#[derive(Clone, Debug, PartialEq)]
pub struct Tensor {
    pub dtype: DType,
    pub shape: Vec<usize>,
    /// Row-major, little-endian; exactly `len() * dtype.size()` bytes.
    pub data: Bytes,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("a {dtype:?} tensor of shape {shape:?} needs {expected} bytes, got {actual}")]
pub struct ShapeMismatch {
    pub dtype: DType,
    pub shape: Vec<usize>,
    pub expected: usize,
    pub actual: usize,
}

impl Tensor {
    pub fn new(dtype: DType, shape: Vec<usize>, data: Bytes) -> Result<Self, ShapeMismatch> {
        let expected = shape.iter().product::<usize>() * dtype.size();
        if data.len() != expected {
            return Err(ShapeMismatch { dtype, shape, expected, actual: data.len() });
        }
        Ok(Tensor { dtype, shape, data })
    }

    /// Number of elements.
    pub fn len(&self) -> usize {
        self.shape.iter().product()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// A batch of named tensors, with where it came from so clients can account for what they got.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Batch {
    pub tensors: BTreeMap<String, Tensor>,
    pub epoch: u64,
    /// The split (shard or range) the batch was made from.
    pub split: u64,
    /// Position of the batch in its split's output.
    pub sequence: u64,
    /// Splits whose last element is in this batch, or was dropped before it (under the
    /// dispatcher).
    pub completes: Vec<u64>,
    /// Where each row came from, in row order: `split << 32 | position` (see [`row`]).
    pub rows: Vec<u64>,
    /// Under the dispatcher, the dispatcher start that handed out the splits of its rows
    /// (0: a standalone worker); a client that rejoined a restarted dispatcher drops batches of
    /// the one before.
    pub incarnation: u64,
    /// A job read by ranks in coordinated mode: the worker's round the batch was dealt in.
    pub round: Option<crate::proto::RoundRef>,
}

/// A row's provenance: its split and its position in the split's source order. Positions are
/// the same whenever a split is produced, whatever the shuffle did, so a split produced again
/// can skip what was delivered and a client can check what it got.
pub fn row(split: u64, position: u64) -> u64 {
    (split << 32) | position
}

/// The split and position of a row's provenance.
pub fn row_origin(row: u64) -> (u64, u32) {
    (row >> 32, row as u32)
}

impl Batch {
    /// A batch with no tensors that only completes `splits`: what a worker sends when splits
    /// complete with no batch left to carry them. Clients report it and never yield it.
    pub fn completions(epoch: u64, splits: Vec<u64>) -> Batch {
        Batch { epoch, completes: splits, ..Batch::default() }
    }

    /// Whether this is a [`Batch::completions`]: no data, only splits to report.
    pub fn is_completions(&self) -> bool {
        self.tensors.is_empty()
    }

    /// Total tensor payload in bytes.
    pub fn payload_bytes(&self) -> usize {
        self.tensors.values().map(|t| t.data.len()).sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tensor_checks_its_byte_length() {
        let t = Tensor::new(DType::Float16, vec![2, 3], Bytes::from(vec![0u8; 12])).unwrap();
        assert_eq!(t.len(), 6);
        let e = Tensor::new(DType::Float32, vec![2, 3], Bytes::from(vec![0u8; 12])).unwrap_err();
        assert_eq!((e.expected, e.actual), (24, 12));
    }
}
