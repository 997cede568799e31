//! Fuzzing the worker's data plane, BatchStream.Stream: requests with every field at its
//! edges (empty and 254-byte names, message limits around the allowed range and u64::MAX,
//! ranks out of range, coordinated without ranks), called on the service directly; and bytes
//! that are not a StreamRequest (random, cut short, a bit flipped, another message type,
//! broken framing) sent over a loopback server. Every request gets INVALID_ARGUMENT exactly
//! when it is invalid, a valid one gets its batches in chunks within its message limit, no
//! call takes memory out of proportion, and the server goes on streaming afterwards.

#[path = "../../operator/tests/fuzz_support/mod.rs"]
mod fuzz_support;
mod stream_support;

use bytes::Bytes;
use futures::StreamExt;
use fuzz_support::{Counting, Raw, acceptable, frame, framed};
use proptest::prelude::*;
use proptest::sample::Index;
use proptest::test_runner::{Config, FileFailurePersistence, TestRunner};
use prost::Message;
use stoker_api::DType;
use stoker_api::proto::batch_stream_server::BatchStream;
use stoker_api::proto::{self, PipelineRef, StreamRequest, StreamResume};
use stoker_worker::stream::{ServerOptions, StreamService, SyntheticSource};
use tonic::{Code, Request};

#[global_allocator]
static ALLOCATOR: Counting = Counting;

/// Requests per run by default, for each of the two targets.
const CASES: u32 = 1500;
const STREAM: &str = "/stoker.v1alpha1.BatchStream/Stream";
/// Batches each valid stream carries: two, each cut into chunks at small limits.
const BATCHES: u64 = 2;

fn source() -> SyntheticSource {
    SyntheticSource::new(vec![
        ("image".into(), DType::Uint8, vec![2, 96, 96, 3]),
        ("label".into(), DType::Int64, vec![2]),
    ])
    .batches(BATCHES)
}

fn config() -> Config {
    Config {
        cases: fuzz_support::cases(CASES),
        failure_persistence: Some(Box::new(FileFailurePersistence::Off)),
        ..Config::default()
    }
}

fn name() -> impl Strategy<Value = String> {
    prop_oneof![
        1 => Just(String::new()),
        6 => Just("a".to_string()),
        1 => Just("n".repeat(253)),
        1 => Just("n".repeat(254)),
        1 => "\\PC{0,12}",
    ]
}

fn count() -> impl Strategy<Value = u32> {
    prop_oneof![6 => 0..4u32, 1 => Just(u32::MAX), 1 => Just(proto::MAX_CONSUMERS), 1 => Just(proto::MAX_CONSUMERS + 1)]
}

fn num() -> impl Strategy<Value = u64> {
    prop_oneof![4 => 0..4u64, 1 => Just(u64::MAX), 1 => any::<u64>()]
}

fn limit() -> impl Strategy<Value = u64> {
    let (min, max) = (proto::MIN_MAX_MESSAGE_BYTES as u64, proto::MAX_MAX_MESSAGE_BYTES as u64);
    prop_oneof![
        Just(0),
        Just(1),
        Just(min - 1),
        Just(min),
        Just(min + 1),
        Just(proto::DEFAULT_MAX_MESSAGE_BYTES as u64),
        Just(max),
        Just(max + 1),
        Just(u64::MAX),
        min..max,
        any::<u64>(),
    ]
}

fn stream_request() -> impl Strategy<Value = StreamRequest> {
    let pipeline = proptest::option::weighted(0.9, (name(), name()))
        .prop_map(|p| p.map(|(namespace, name)| PipelineRef { namespace, name }));
    (
        pipeline,
        name(),
        count(),
        proptest::option::of(num()),
        limit(),
        proptest::option::of(num()),
        count(),
        any::<bool>(),
        proptest::option::of((num(), num(), num())),
    )
        .prop_map(
            |(pipeline, job, consumer_index, start_epoch, max_message_bytes, epoch, consumers, coordinated, resume)| {
                StreamRequest {
                    pipeline,
                    job,
                    consumer_index,
                    start_epoch,
                    max_message_bytes,
                    epoch,
                    consumers,
                    coordinated,
                    shared_memory: None,
                    resume: resume.map(|(stream, received, window_bytes)| StreamResume {
                        stream,
                        received,
                        window_bytes,
                    }),
                }
            },
        )
}

/// Whether the worker must accept the request, from the protocol's rules written out again.
fn valid(r: &StreamRequest) -> bool {
    let named = |s: &str| !s.is_empty() && s.len() <= 253;
    let limit = if r.max_message_bytes == 0 { proto::DEFAULT_MAX_MESSAGE_BYTES as u64 } else { r.max_message_bytes };
    r.pipeline.as_ref().is_some_and(|p| named(&p.namespace) && named(&p.name))
        && named(&r.job)
        && (proto::MIN_MAX_MESSAGE_BYTES as u64..=proto::MAX_MAX_MESSAGE_BYTES as u64).contains(&limit)
        && r.consumers <= proto::MAX_CONSUMERS
        && (r.consumers <= 1 || r.consumer_index < r.consumers)
        && (!r.coordinated || r.consumers >= 2)
        && r.resume.as_ref().is_none_or(|resume| resume.stream != 0)
}

/// Whether a valid request asks to resume a stream: none is known to a new service.
fn resumes_unknown(r: &StreamRequest) -> bool {
    r.resume.as_ref().is_some_and(|resume| resume.received > 0)
}

#[test]
fn every_request_is_refused_exactly_when_invalid_and_a_valid_one_streams_within_its_limit() {
    let _serial = fuzz_support::serial();
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("a runtime");
    let tensor_bytes = 2 * 96 * 96 * 3 + 2 * 8;
    let result = TestRunner::new(config()).run(&stream_request(), |request| {
        let expect_ok = valid(&request);
        // A new service each time: no stream of an earlier case is known to it.
        let service = StreamService::new(source());
        let limit = if request.max_message_bytes == 0 { 4 << 20 } else { request.max_message_bytes as usize };
        let before = fuzz_support::live();
        fuzz_support::reset_peak();
        let answer = runtime.block_on(async {
            let chunks = service.stream(Request::new(request.clone())).await?.into_inner();
            Ok::<_, tonic::Status>(chunks.collect::<Vec<_>>().await)
        });
        // Two small batches: nothing near a message limit of up to 256 MiB is allocated.
        let peak = fuzz_support::peak().saturating_sub(before);
        prop_assert!(peak < 8 << 20, "the call took {} bytes at its peak", peak);
        match answer {
            Ok(chunks) => {
                prop_assert!(expect_ok, "an invalid request was accepted");
                prop_assert!(!resumes_unknown(&request), "a stream it never served was resumed");
                let mut batches = 0;
                let mut payload = 0;
                for chunk in chunks {
                    let chunk = chunk.map_err(|s| TestCaseError::fail(format!("a chunk failed: {s:?}")))?;
                    prop_assert!(
                        chunk.encoded_len() <= limit,
                        "a chunk of {} bytes over {}",
                        chunk.encoded_len(),
                        limit
                    );
                    payload += chunk.pieces.iter().map(Bytes::len).sum::<usize>();
                    batches += usize::from(chunk.last);
                }
                prop_assert_eq!(batches as u64, BATCHES);
                prop_assert_eq!(payload, BATCHES as usize * tensor_bytes);
            }
            Err(status) if expect_ok && resumes_unknown(&request) => {
                prop_assert_eq!(status.code(), Code::NotFound, "{:?}", status);
            }
            Err(status) => {
                prop_assert_eq!(status.code(), Code::InvalidArgument, "{:?}", status);
                prop_assert!(!expect_ok, "a valid request was refused: {:?}", status);
            }
        }
        Ok(())
    });
    if let Err(e) = result {
        panic!("{e}");
    }
}

/// What goes on the wire instead of a StreamRequest.
#[derive(Clone, Debug)]
enum Wire {
    Random(Vec<u8>),
    Truncated(StreamRequest, Index),
    Flipped(StreamRequest, Index, u8),
    /// A valid message of another type: a chunk, a dispatcher's request or list.
    OtherType(usize),
    LyingLength(StreamRequest, u32),
    Flag(StreamRequest, u8),
    TwoMessages(StreamRequest),
    NoMessage,
    UnknownMethod(StreamRequest),
}

fn other_types() -> [Vec<u8>; 3] {
    let chunk = proto::BatchChunk { pieces: vec![Bytes::from_static(&[7; 100])], last: true, ..Default::default() };
    let register = proto::RegisterWorkerRequest {
        pipeline: Some(PipelineRef { namespace: "a".into(), name: "b".into() }),
        address: "x:1".into(),
        splits: 9,
        ..Default::default()
    };
    let list = proto::WorkerList { addresses: vec!["a:1".into()], version: 3, ..Default::default() };
    [chunk.encode_to_vec(), register.encode_to_vec(), list.encode_to_vec()]
}

fn wire() -> impl Strategy<Value = Wire> {
    let len = prop_oneof![0..64u32, Just(u32::MAX), Just((4 << 20) + 1), any::<u32>()];
    prop_oneof![
        3 => proptest::collection::vec(any::<u8>(), 0..200).prop_map(Wire::Random),
        3 => (stream_request(), any::<Index>()).prop_map(|(r, i)| Wire::Truncated(r, i)),
        2 => (stream_request(), any::<Index>(), 0..8u8).prop_map(|(r, i, b)| Wire::Flipped(r, i, b)),
        2 => (0..3usize).prop_map(Wire::OtherType),
        1 => (stream_request(), len).prop_map(|(r, l)| Wire::LyingLength(r, l)),
        1 => (stream_request(), 1..=255u8).prop_map(|(r, f)| Wire::Flag(r, f)),
        1 => stream_request().prop_map(Wire::TwoMessages),
        1 => Just(Wire::NoMessage),
        1 => stream_request().prop_map(Wire::UnknownMethod),
    ]
}

fn body(input: &Wire) -> (&'static str, Bytes) {
    match input {
        Wire::Random(bytes) => (STREAM, frame(bytes)),
        Wire::Truncated(r, cut) => {
            let bytes = r.encode_to_vec();
            (STREAM, frame(&bytes[..cut.index(bytes.len() + 1)]))
        }
        Wire::Flipped(r, at, bit) => {
            let mut bytes = r.encode_to_vec();
            if !bytes.is_empty() {
                let i = at.index(bytes.len());
                bytes[i] ^= 1 << bit;
            }
            (STREAM, frame(&bytes))
        }
        Wire::OtherType(i) => (STREAM, frame(&other_types()[*i])),
        Wire::LyingLength(r, len) => (STREAM, framed(0, *len, &r.encode_to_vec())),
        Wire::Flag(r, flag) => {
            let bytes = r.encode_to_vec();
            (STREAM, framed(*flag, bytes.len() as u32, &bytes))
        }
        Wire::TwoMessages(r) => (STREAM, [frame(&r.encode_to_vec()), frame(&r.encode_to_vec())].concat().into()),
        Wire::NoMessage => (STREAM, Bytes::new()),
        Wire::UnknownMethod(r) => ("/stoker.v1alpha1.BatchStream/Nope", frame(&r.encode_to_vec())),
    }
}

#[test]
fn bytes_that_are_not_a_stream_request_get_a_status_and_the_worker_streams_on() {
    let _serial = fuzz_support::serial();
    let runtime =
        tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build().expect("a runtime");
    let worker = runtime.block_on(stream_support::start_with(StreamService::new(source()), ServerOptions::default()));
    let raw = std::sync::Mutex::new(runtime.block_on(Raw::connect(worker.addr)));
    let valid = StreamRequest {
        pipeline: Some(PipelineRef { namespace: "a".into(), name: "b".into() }),
        job: "j".into(),
        ..Default::default()
    };
    let result = TestRunner::new(config()).run(&wire(), |input| {
        let (path, body) = body(&input);
        let mut raw = raw.lock().expect("not poisoned");
        let answer = runtime.block_on(raw.call(path, body)).map_err(TestCaseError::fail)?;
        prop_assert!(acceptable(&answer), "answered {:?}", answer);
        let alive = runtime.block_on(raw.call(STREAM, frame(&valid.encode_to_vec()))).map_err(TestCaseError::fail)?;
        prop_assert!(alive.code == 0 && alive.data > 0, "a valid stream afterwards: {:?}", alive);
        Ok(())
    });
    if let Err(e) = result {
        panic!("{e}");
    }
}
