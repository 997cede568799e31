//! The reassembler as a pure unit: round trips through the worker's chunker, and every broken
//! chunk sequence is a typed protocol error, never a panic.

use std::collections::BTreeMap;

use bytes::Bytes;
use stoker_api::chunk::{chunk_batch, header};
use stoker_api::proto::{BatchChunk, BatchHeader, Dtype, TensorMeta};
use stoker_api::{Batch, DType, Tensor};
use stoker_client::ProtocolError;
use stoker_client::reassemble::Reassembler;

const LIMIT: u64 = 1 << 40;

fn tensor(dtype: DType, shape: Vec<usize>, seed: u8) -> Tensor {
    let n = shape.iter().product::<usize>() * dtype.size();
    let data: Vec<u8> = (0..n).map(|i| (i as u8).wrapping_mul(7).wrapping_add(seed)).collect();
    Tensor::new(dtype, shape, Bytes::from(data)).unwrap()
}

fn sample() -> Batch {
    let mut tensors = BTreeMap::new();
    tensors.insert("image".to_string(), tensor(DType::Float16, vec![4, 50, 60, 3], 1));
    tensors.insert("label".to_string(), tensor(DType::Int64, vec![4], 2));
    tensors.insert("mask".to_string(), tensor(DType::Uint8, vec![0, 3], 3));
    Batch {
        tensors,
        epoch: 2,
        split: 9,
        sequence: 4,
        completes: vec![8, 9],
        rows: vec![9 << 32 | 1, 8 << 32],
        incarnation: 3,
        round: Some(stoker_api::proto::RoundRef { worker: "w-2".into(), index: 6 }),
        stream_seq: 12,
        echo: true,
    }
}

fn feed(r: &mut Reassembler, chunks: impl IntoIterator<Item = BatchChunk>) -> Result<Vec<Batch>, ProtocolError> {
    let mut out = Vec::new();
    for c in chunks {
        out.extend(r.push(c)?);
    }
    Ok(out)
}

#[test]
fn chunked_batches_come_back_identical() {
    let b = sample();
    for limit in [65_536usize, 70_001, 4 << 20] {
        let mut r = Reassembler::new(LIMIT);
        let chunks: Vec<_> = chunk_batch(&b, limit).unwrap().collect();
        let got = feed(&mut r, chunks.clone()).unwrap();
        assert_eq!(got, vec![b.clone()], "limit {limit}");
        assert!(r.finish().is_ok());
        // Two batches back to back on one stream.
        let got = feed(&mut r, chunks.iter().cloned().chain(chunks.clone())).unwrap();
        assert_eq!(got.len(), 2);
    }
}

#[test]
fn a_batch_of_completions_only_is_one_chunk_and_comes_back() {
    let marker = Batch::completions(3, vec![5, 7]);
    let chunks: Vec<_> = chunk_batch(&marker, 65_536).unwrap().collect();
    assert_eq!(chunks.len(), 1);
    assert!(chunks[0].last && chunks[0].pieces.is_empty());
    let got = feed(&mut Reassembler::new(LIMIT), chunks).unwrap();
    assert_eq!(got, vec![marker]);
    assert!(got[0].is_completions() && !sample().is_completions());
}

#[test]
fn a_tensor_in_one_piece_keeps_the_received_buffer() {
    let b = sample();
    let chunks: Vec<_> = chunk_batch(&b, 4 << 20).unwrap().collect();
    assert_eq!(chunks.len(), 1);
    let image_piece = chunks[0].pieces[0].as_ptr();
    let got = Reassembler::new(LIMIT).push(chunks[0].clone()).unwrap().unwrap();
    assert_eq!(got.tensors["image"].data.as_ptr(), image_piece);
}

#[test]
fn pieces_may_cross_tensor_boundaries() {
    let b = sample();
    let payload: Vec<u8> = b.tensors.values().flat_map(|t| t.data.to_vec()).collect();
    let payload = Bytes::from(payload);
    // Odd-sized pieces, spread over three chunks, ignoring where tensors start.
    let cut = |a: usize, z: usize| payload.slice(a..z);
    let n = payload.len();
    let chunks = vec![
        BatchChunk { header: Some(header(&b)), pieces: vec![cut(0, 1), cut(1, 1000)], ..Default::default() },
        BatchChunk { header: None, pieces: vec![cut(1000, n - 3)], ..Default::default() },
        BatchChunk { header: None, pieces: vec![cut(n - 3, n)], last: true, ..Default::default() },
    ];
    assert_eq!(feed(&mut Reassembler::new(LIMIT), chunks).unwrap(), vec![b]);
}

fn one_tensor_header(dtype: i32, shape: Vec<u64>, byte_length: u64) -> BatchHeader {
    BatchHeader {
        epoch: 0,
        split: 0,
        sequence: 0,
        tensors: vec![TensorMeta { name: "x".into(), dtype, shape, byte_length, layout: 0 }],
        completes: vec![],
        rows: vec![],
        incarnation: 0,
        round: None,
        stream_seq: 0,
        echo: false,
    }
}

fn first(h: BatchHeader, pieces: Vec<&'static [u8]>, last: bool) -> BatchChunk {
    BatchChunk {
        header: Some(h),
        pieces: pieces.into_iter().map(Bytes::from_static).collect(),
        last,
        ..Default::default()
    }
}

fn more(pieces: Vec<&'static [u8]>, last: bool) -> BatchChunk {
    BatchChunk {
        header: None,
        pieces: pieces.into_iter().map(Bytes::from_static).collect(),
        last,
        ..Default::default()
    }
}

fn u8_header(n: u64) -> BatchHeader {
    one_tensor_header(Dtype::Uint8 as i32, vec![n], n)
}

#[test]
fn broken_sequences_are_protocol_errors() {
    use ProtocolError::*;
    let cases: Vec<(&str, Vec<BatchChunk>, ProtocolError)> = vec![
        ("no header", vec![more(vec![b"abc"], true)], MissingHeader),
        (
            "second header",
            vec![first(u8_header(4), vec![b"ab"], false), first(u8_header(4), vec![], true)],
            UnexpectedHeader,
        ),
        ("short", vec![first(u8_header(4), vec![b"abc"], true)], Truncated { received: 3, declared: 4 }),
        ("long", vec![first(u8_header(4), vec![b"abcde"], true)], ExcessPayload { declared: 4 }),
        (
            "long later",
            vec![first(u8_header(4), vec![b"ab"], false), more(vec![b"cd", b"e"], true)],
            ExcessPayload { declared: 4 },
        ),
        (
            "unknown dtype",
            vec![first(one_tensor_header(99, vec![1], 1), vec![b"a"], true)],
            UnknownDtype { tensor: "x".into(), dtype: 99 },
        ),
        (
            "unspecified dtype",
            vec![first(one_tensor_header(0, vec![1], 1), vec![b"a"], true)],
            UnknownDtype { tensor: "x".into(), dtype: 0 },
        ),
        (
            "shape vs length",
            vec![first(one_tensor_header(Dtype::Float32 as i32, vec![2], 7), vec![], true)],
            ShapeMismatch { tensor: "x".into(), shape: vec![2], byte_length: 7 },
        ),
        (
            "overflowing shape",
            vec![first(one_tensor_header(Dtype::Float64 as i32, vec![u64::MAX, 4], 0), vec![], true)],
            ShapeMismatch { tensor: "x".into(), shape: vec![u64::MAX, 4], byte_length: 0 },
        ),
        (
            "too large",
            vec![first(u8_header(1 << 50), vec![], false)],
            BatchTooLarge { declared: 1 << 50, limit: LIMIT },
        ),
    ];
    for (name, chunks, expected) in cases {
        let mut r = Reassembler::new(LIMIT);
        assert_eq!(feed(&mut r, chunks), Err(expected), "{name}");
        // The reassembler is reset, not left half-way.
        assert!(!r.in_batch(), "{name}");
    }
}

#[test]
fn duplicate_tensor_names_are_refused() {
    let mut h = u8_header(1);
    h.tensors.push(h.tensors[0].clone());
    let err = Reassembler::new(LIMIT).push(first(h, vec![b"ab"], true)).unwrap_err();
    assert_eq!(err, ProtocolError::DuplicateTensor { tensor: "x".into() });
}

#[test]
fn a_stream_ending_mid_batch_is_an_error() {
    let mut r = Reassembler::new(LIMIT);
    assert!(r.push(first(u8_header(4), vec![b"ab"], false)).unwrap().is_none());
    assert_eq!(r.finish(), Err(ProtocolError::EndedMidBatch));
}

#[test]
fn a_complete_payload_may_end_with_an_empty_last_chunk() {
    let mut r = Reassembler::new(LIMIT);
    let got = feed(&mut r, vec![first(u8_header(2), vec![b"ab"], false), more(vec![], true)]).unwrap();
    assert_eq!(got[0].tensors["x"].data, Bytes::from_static(b"ab"));
}

#[test]
fn a_batch_without_tensors_round_trips() {
    let b = Batch { epoch: 1, ..Batch::default() };
    let chunks: Vec<_> = chunk_batch(&b, 65_536).unwrap().collect();
    assert_eq!(feed(&mut Reassembler::new(LIMIT), chunks).unwrap(), vec![b]);
}

#[test]
fn a_batch_in_shared_memory_is_refused_since_this_client_never_asks_for_one() {
    let chunk = BatchChunk {
        header: Some(header(&sample())),
        last: true,
        shared_file: "stoker-1-0-0".into(),
        ..Default::default()
    };
    assert_eq!(Reassembler::new(LIMIT).push(chunk).unwrap_err(), ProtocolError::UnaskedSharedMemory);
}

#[test]
fn jagged_tensors_come_back_with_their_layout_and_bad_offsets_are_refused() {
    let values: Vec<u8> = (0..5000i64).flat_map(|v| v.to_le_bytes()).collect();
    let ids = Tensor::jagged(DType::Int64, &[0, 1200, 1200, 5000], &values).unwrap();
    let mut b = sample();
    b.tensors.insert("ids".to_string(), ids.clone());
    for limit in [65_536usize, 4 << 20] {
        let chunks: Vec<_> = chunk_batch(&b, limit).unwrap().collect();
        let got = feed(&mut Reassembler::new(LIMIT), chunks).unwrap();
        assert_eq!(got[0].tensors["ids"], ids, "limit {limit}");
        assert_eq!(got[0].tensors["ids"].layout, stoker_api::Layout::Jagged);
    }
    // Offsets that run past the values: refused once the tensor has arrived.
    let mut bad = ids.data.to_vec();
    bad[24..32].copy_from_slice(&5001i64.to_le_bytes());
    let mut h = one_tensor_header(Dtype::Int64 as i32, vec![3], bad.len() as u64);
    h.tensors[0].layout = stoker_api::proto::Layout::Jagged as i32;
    let chunk =
        BatchChunk { header: Some(h.clone()), pieces: vec![Bytes::from(bad)], last: true, ..Default::default() };
    assert!(matches!(feed(&mut Reassembler::new(LIMIT), [chunk]), Err(ProtocolError::ShapeMismatch { .. })));
    // Fewer bytes than the offsets: refused from the header alone.
    h.tensors[0].byte_length = 31;
    let chunk = first(h.clone(), vec![], false);
    assert!(matches!(feed(&mut Reassembler::new(LIMIT), [chunk]), Err(ProtocolError::ShapeMismatch { .. })));
    // A layout this client does not know.
    h.tensors[0].layout = 7;
    let chunk = first(h, vec![], false);
    assert!(matches!(feed(&mut Reassembler::new(LIMIT), [chunk]), Err(ProtocolError::UnknownLayout { layout: 7, .. })));
}
