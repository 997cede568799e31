//! Named tensors and batches: what workers produce and clients receive. Data is raw
//! little-endian bytes in `bytes::Bytes`, so slicing, sending and receiving never copy it.

use std::collections::BTreeMap;

use bytes::Bytes;

use crate::DType;

impl DType {
    /// Bytes per element of a fixed-width type; 0 for [`DType::Bytes`], whose elements have
    /// their own lengths (callers that size buffers check [`DType::is_fixed`] first).
    pub fn size(self) -> usize {
        match self {
            DType::Uint8 => 1,
            DType::Float16 => 2,
            DType::Int32 | DType::Float32 => 4,
            DType::Int64 | DType::Float64 => 8,
            DType::Bytes => 0,
        }
    }

    /// Whether every element has the same width ([`DType::size`]): all but `Bytes`.
    pub fn is_fixed(self) -> bool {
        self != DType::Bytes
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
            DType::Bytes => "bytes",
        }
    }

    /// The type of a numpy name ([`DType::numpy_name`]'s inverse).
    pub fn from_numpy_name(name: &str) -> Option<DType> {
        [DType::Uint8, DType::Int32, DType::Int64, DType::Float16, DType::Float32, DType::Float64, DType::Bytes]
            .into_iter()
            .find(|d| d.numpy_name() == name)
    }
}

/// How a tensor's bytes are laid out.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum Layout {
    /// Row-major: every row of the batch has the same shape.
    #[default]
    Dense,
    /// One list per row, each of its own length (a sparse id list): the shape is `[rows]`,
    /// and the bytes are `rows + 1` little-endian int64 offsets into the values (the first 0,
    /// non-decreasing, the last the number of values), then the values, of a fixed-width
    /// dtype. torchrec's `KeyedJaggedTensor` and `torch.nested` take values with these
    /// offsets (or their differences, the lengths) as they are.
    Jagged,
}

#[derive(Clone, Debug, PartialEq)]
pub struct Tensor {
    pub dtype: DType,
    pub shape: Vec<usize>,
    /// Row-major, little-endian; exactly `len() * dtype.size()` bytes. For [`DType::Bytes`]:
    /// `len() + 1` little-endian u64 offsets into the strings that follow them (the first 0,
    /// non-decreasing, the last the strings' total length), then the strings concatenated.
    /// For [`Layout::Jagged`], the offsets and the values.
    pub data: Bytes,
    pub layout: Layout,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("a {layout:?} {dtype:?} tensor of shape {shape:?} needs {expected} bytes, got {actual}")]
pub struct ShapeMismatch {
    pub dtype: DType,
    pub layout: Layout,
    pub shape: Vec<usize>,
    /// `usize::MAX` where no length could fit: offsets that are not a layout, a jagged tensor
    /// of text or of a rank other than 1.
    pub expected: usize,
    pub actual: usize,
}

impl Tensor {
    /// A [`Layout::Dense`] tensor, its length checked against its shape and type.
    pub fn new(dtype: DType, shape: Vec<usize>, data: Bytes) -> Result<Self, ShapeMismatch> {
        Tensor::with_layout(dtype, Layout::Dense, shape, data)
    }

    /// A tensor of any layout, its bytes checked against it (the offsets too).
    pub fn with_layout(dtype: DType, layout: Layout, shape: Vec<usize>, data: Bytes) -> Result<Self, ShapeMismatch> {
        let count = shape.iter().try_fold(1usize, |n, d| n.checked_mul(*d));
        let expected = match (layout, dtype, count) {
            (_, _, None) => None,
            (Layout::Dense, DType::Bytes, Some(n)) => offsets_layout_len(n, &data, 1),
            (Layout::Dense, _, Some(n)) => n.checked_mul(dtype.size()),
            (Layout::Jagged, DType::Bytes, _) => None,
            (Layout::Jagged, _, Some(n)) if shape.len() == 1 => offsets_layout_len(n, &data, dtype.size()),
            (Layout::Jagged, _, Some(_)) => None,
        };
        if expected != Some(data.len()) {
            let expected = expected.unwrap_or(usize::MAX);
            return Err(ShapeMismatch { dtype, layout, shape, expected, actual: data.len() });
        }
        Ok(Tensor { dtype, shape, data, layout })
    }

    /// A [`Layout::Jagged`] tensor of `offsets.len() - 1` lists, the values of list i being
    /// `values[offsets[i]..offsets[i + 1]]` (in elements of `dtype`).
    pub fn jagged(dtype: DType, offsets: &[i64], values: &[u8]) -> Result<Self, ShapeMismatch> {
        let mut data = Vec::with_capacity(8 * offsets.len() + values.len());
        offsets.iter().for_each(|o| data.extend_from_slice(&o.to_le_bytes()));
        data.extend_from_slice(values);
        Tensor::with_layout(dtype, Layout::Jagged, vec![offsets.len().saturating_sub(1)], Bytes::from(data))
    }

    /// A jagged tensor's offsets (`rows + 1` little-endian int64) and values, as slices of
    /// its bytes; None for a dense one.
    pub fn jagged_parts(&self) -> Option<(Bytes, Bytes)> {
        let head = 8 * (self.len() + 1);
        (self.layout == Layout::Jagged).then(|| (self.data.slice(..head), self.data.slice(head..)))
    }

    /// A [`DType::Bytes`] tensor of `shape` holding `strings` in row-major order.
    pub fn strings<S: AsRef<[u8]>>(shape: Vec<usize>, strings: &[S]) -> Result<Self, ShapeMismatch> {
        let total: usize = strings.iter().map(|s| s.as_ref().len()).sum();
        let mut data = Vec::with_capacity(8 * (strings.len() + 1) + total);
        let mut offset = 0u64;
        data.extend_from_slice(&offset.to_le_bytes());
        for s in strings {
            offset += s.as_ref().len() as u64;
            data.extend_from_slice(&offset.to_le_bytes());
        }
        for s in strings {
            data.extend_from_slice(s.as_ref());
        }
        Tensor::new(DType::Bytes, shape, Bytes::from(data))
    }

    /// The strings of a [`DType::Bytes`] tensor in row-major order (empty for other types).
    pub fn string_values(&self) -> impl Iterator<Item = &[u8]> {
        let n = if self.dtype == DType::Bytes { self.len() } else { 0 };
        let payload = 8 * (n + 1);
        let offset = move |i: usize| {
            u64::from_le_bytes(self.data[8 * i..8 * i + 8].try_into().expect("8 bytes")) as usize + payload
        };
        (0..n).map(move |i| &self.data[offset(i)..offset(i + 1)])
    }

    /// Number of elements (of a jagged tensor: of lists).
    pub fn len(&self) -> usize {
        self.shape.iter().product()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// The data length of `n` strings in the [`DType::Bytes`] layout (`unit` 1), or of `n` lists
/// of `unit`-byte values in the [`Layout::Jagged`] one, if `data` holds that layout: `n + 1`
/// offsets from 0, non-decreasing, the last the count of bytes or values that follow them.
fn offsets_layout_len(n: usize, data: &[u8], unit: usize) -> Option<usize> {
    let header = n.checked_add(1)?.checked_mul(8)?;
    let offsets = data.get(..header)?;
    let mut last = 0u64;
    for (i, chunk) in offsets.chunks_exact(8).enumerate() {
        let o = u64::from_le_bytes(chunk.try_into().expect("8 bytes"));
        if (i == 0 && o != 0) || o < last {
            return None;
        }
        last = o;
    }
    header.checked_add(usize::try_from(last).ok()?.checked_mul(unit)?)
}

/// A batch's tensor as a worker holds it until it is sent: its rows' buffers one after another,
/// never joined into one (the stream's messages, or a shared-memory file, take the pieces as
/// they are). Together the parts are the tensor's bytes as [`Tensor::data`] would hold them.
#[derive(Clone, Debug, PartialEq)]
pub struct Stacked {
    pub dtype: DType,
    pub shape: Vec<usize>,
    pub parts: Vec<Bytes>,
    pub layout: Layout,
}

impl Stacked {
    /// The tensor in one buffer (a copy, unless it has one part).
    pub fn join(&self) -> Tensor {
        let data = match self.parts.as_slice() {
            [one] => one.clone(),
            parts => Bytes::from(parts.concat()),
        };
        Tensor { dtype: self.dtype, shape: self.shape.clone(), data, layout: self.layout }
    }

    /// A [`Layout::Dense`] tensor of these parts.
    pub fn dense(dtype: DType, shape: Vec<usize>, parts: Vec<Bytes>) -> Stacked {
        Stacked { dtype, shape, parts, layout: Layout::Dense }
    }
}

impl From<Tensor> for Stacked {
    fn from(t: Tensor) -> Stacked {
        Stacked { dtype: t.dtype, shape: t.shape, parts: vec![t.data], layout: t.layout }
    }
}

/// What a batch's tensors are made of: [`Tensor`] (one buffer, what clients get) or
/// [`Stacked`] (a worker's, its rows' buffers).
pub trait Payload {
    fn dtype(&self) -> DType;
    fn layout(&self) -> Layout;
    fn shape(&self) -> &[usize];
    /// The bytes, in order, in one or more buffers.
    fn parts(&self) -> &[Bytes];
    fn byte_len(&self) -> usize {
        self.parts().iter().map(Bytes::len).sum()
    }
}

impl Payload for Tensor {
    fn dtype(&self) -> DType {
        self.dtype
    }
    fn layout(&self) -> Layout {
        self.layout
    }
    fn shape(&self) -> &[usize] {
        &self.shape
    }
    fn parts(&self) -> &[Bytes] {
        std::slice::from_ref(&self.data)
    }
}

impl Payload for Stacked {
    fn dtype(&self) -> DType {
        self.dtype
    }
    fn layout(&self) -> Layout {
        self.layout
    }
    fn shape(&self) -> &[usize] {
        &self.shape
    }
    fn parts(&self) -> &[Bytes] {
        &self.parts
    }
}

/// A batch of named tensors, with where it came from so clients can account for what they got.
/// A worker's batches hold [`Stacked`] tensors, a client's [`Tensor`]s.
#[derive(Clone, Debug, PartialEq)]
pub struct Batch<T = Tensor> {
    pub tensors: BTreeMap<String, T>,
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
    /// On a resumable stream: the batch's number in it, from 1 (0: not numbered).
    pub stream_seq: u64,
    /// The pipeline echoes: each row's position carries its echo copy ([`echo_copy`]).
    pub echo: bool,
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

/// Where a pipeline echoes, a row's position is its copy number above this bit and the
/// element's position in its split below it: each copy is a row of its own to the exactly-once
/// bookkeeping (skips, acknowledgements, resume states), and copy 0 keeps the position the
/// element has without echo.
pub const ECHO_COPY_SHIFT: u32 = 24;

/// The most elements a split of an echoing pipeline may hold: their positions fit below
/// [`ECHO_COPY_SHIFT`].
pub const MAX_ECHO_SPLIT_ELEMENTS: u64 = 1 << ECHO_COPY_SHIFT;

/// The position of copy `copy` of the element at `position` in its split.
pub fn echo_position(position: u64, copy: u32) -> u64 {
    (u64::from(copy) << ECHO_COPY_SHIFT) | position
}

/// The copy number and the element's position that an echoing pipeline's row position says.
pub fn echo_copy(position: u32) -> (u32, u32) {
    (position >> ECHO_COPY_SHIFT, position & ((1 << ECHO_COPY_SHIFT) - 1))
}

impl<T> Default for Batch<T> {
    fn default() -> Self {
        Batch {
            tensors: BTreeMap::new(),
            epoch: 0,
            split: 0,
            sequence: 0,
            completes: Vec::new(),
            rows: Vec::new(),
            incarnation: 0,
            round: None,
            stream_seq: 0,
            echo: false,
        }
    }
}

impl<T: Payload> Batch<T> {
    /// A batch with no tensors that only completes `splits`: what a worker sends when splits
    /// complete with no batch left to carry them. Clients report it and never yield it.
    pub fn completions(epoch: u64, splits: Vec<u64>) -> Self {
        Batch { epoch, completes: splits, ..Batch::default() }
    }

    /// Each row's echo copy ([`echo_copy`]) in row order: 0 for an element's first row, and
    /// for every row of a pipeline that does not echo.
    pub fn echo_copies(&self) -> impl Iterator<Item = u32> + '_ {
        self.rows.iter().map(|&r| if self.echo { echo_copy(row_origin(r).1).0 } else { 0 })
    }

    /// Whether this is a [`Batch::completions`]: no data, only splits to report.
    pub fn is_completions(&self) -> bool {
        self.tensors.is_empty()
    }

    /// Total tensor payload in bytes.
    pub fn payload_bytes(&self) -> usize {
        self.tensors.values().map(Payload::byte_len).sum()
    }
}

impl Batch<Stacked> {
    /// The batch with each tensor in one buffer (copies of those in more than one part).
    pub fn join(&self) -> Batch {
        Batch {
            tensors: self.tensors.iter().map(|(name, t)| (name.clone(), t.join())).collect(),
            epoch: self.epoch,
            split: self.split,
            sequence: self.sequence,
            completes: self.completes.clone(),
            rows: self.rows.clone(),
            incarnation: self.incarnation,
            round: self.round.clone(),
            stream_seq: self.stream_seq,
            echo: self.echo,
        }
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

    #[test]
    fn strings_round_trip_and_a_bad_layout_is_refused() {
        let t = Tensor::strings(vec![3], &["héllo", "", "wörld"]).unwrap();
        assert_eq!(t.string_values().collect::<Vec<_>>(), ["héllo".as_bytes(), b"", "wörld".as_bytes()]);
        assert_eq!(t.data.len(), 8 * 4 + 12);
        // Taken apart and put together again.
        assert_eq!(Tensor::new(DType::Bytes, vec![3], t.data.clone()).unwrap(), t);
        assert!(Tensor::new(DType::Bytes, vec![4], t.data.clone()).is_err(), "fewer offsets than strings");
        let mut bad = t.data.to_vec();
        bad[8..16].copy_from_slice(&100u64.to_le_bytes());
        assert!(Tensor::new(DType::Bytes, vec![3], Bytes::from(bad)).is_err(), "offsets past the end");
        let mut decreasing = t.data.to_vec();
        decreasing[16..24].copy_from_slice(&0u64.to_le_bytes());
        assert!(Tensor::new(DType::Bytes, vec![3], Bytes::from(decreasing)).is_err());
        assert!(Tensor::new(DType::Bytes, vec![usize::MAX, 2], Bytes::new()).is_err(), "no overflow");
        let scalar = Tensor::strings(vec![], &["one"]).unwrap();
        assert_eq!(scalar.string_values().collect::<Vec<_>>(), [b"one"]);
    }

    #[test]
    fn jagged_tensors_check_their_offsets_against_their_values() {
        let values: Vec<u8> = [7i64, 8, 9].iter().flat_map(|v| v.to_le_bytes()).collect();
        let t = Tensor::jagged(DType::Int64, &[0, 2, 2, 3], &values).unwrap();
        assert_eq!((t.shape.clone(), t.layout, t.data.len()), (vec![3], Layout::Jagged, 8 * 4 + 24));
        let (offsets, got) = t.jagged_parts().unwrap();
        assert_eq!((offsets.len(), got.as_ref()), (32, values.as_slice()));
        assert_eq!(Tensor::with_layout(DType::Int64, Layout::Jagged, vec![3], t.data.clone()).unwrap(), t);
        // Four int32 values are as many bytes as two int64 ones: the unit counts.
        assert!(Tensor::with_layout(DType::Int32, Layout::Jagged, vec![3], t.data.clone()).is_err());
        assert!(Tensor::jagged(DType::Int64, &[0, 2, 1, 3], &values).is_err(), "decreasing");
        assert!(Tensor::jagged(DType::Int64, &[1, 2, 2, 3], &values).is_err(), "not from 0");
        assert!(Tensor::jagged(DType::Int64, &[0, 2, 2, 4], &values).is_err(), "past the values");
        assert!(Tensor::jagged(DType::Bytes, &[0, 1], b"x").is_err(), "text is not jagged");
        let two_d = Tensor::with_layout(DType::Int64, Layout::Jagged, vec![3, 1], t.data.clone()).unwrap_err();
        assert_eq!(two_d.expected, usize::MAX);
        assert!(Tensor::new(DType::Int64, vec![3], t.data.clone()).is_err(), "dense by default");
        let empty = Tensor::jagged(DType::Float32, &[0], &[]).unwrap();
        assert_eq!((empty.shape.clone(), empty.data.len()), (vec![0], 8));
    }
}
