//! Fuzzing the dispatcher's gRPC server with bytes that are not what a method expects: random
//! bytes, valid requests cut short or with a bit flipped, a valid request of another method,
//! and broken framing (a length prefix that lies, a compressed flag with no encoding, two
//! messages for a unary call, none at all, an unknown method), each on a real loopback server
//! (`dispatcher::serve`). Each is answered with a status (tonic answers INTERNAL for what it
//! cannot decode, OUT_OF_RANGE for too large) or, for bytes that happen to be a valid request,
//! an answer; never a dropped connection or UNKNOWN; and the server then still registers a
//! worker.

mod fuzz_support;
mod fuzz_support_dispatcher;

use std::net::SocketAddr;
use std::time::Duration;

use bytes::Bytes;
use fuzz_support::{Counting, Raw, acceptable, frame, framed};
use fuzz_support_dispatcher::{Op, Seen, ops, request};
use proptest::prelude::*;
use proptest::sample::Index;
use proptest::test_runner::{Config, FileFailurePersistence, TestRunner};
use prost::Message;
use stoker_api::proto;
use stoker_operator::dispatcher::{self, Dispatcher, Timeouts};

#[global_allocator]
static ALLOCATOR: Counting = Counting;

/// Inputs per run by default.
const CASES: u32 = 1500;

const METHODS: [&str; 9] = [
    "/stoker.v1alpha1.Dispatcher/RegisterWorker",
    "/stoker.v1alpha1.Dispatcher/WorkerHeartbeat",
    "/stoker.v1alpha1.Dispatcher/NextSplit",
    "/stoker.v1alpha1.Dispatcher/ReturnSplits",
    "/stoker.v1alpha1.Dispatcher/RegisterClient",
    "/stoker.v1alpha1.Dispatcher/WatchWorkers",
    "/stoker.v1alpha1.Dispatcher/ReportWindow",
    "/stoker.v1alpha1.Dispatcher/Acknowledge",
    "/stoker.v1alpha1.Dispatcher/AuthorizeReader",
];

/// What goes on the wire.
#[derive(Clone, Debug)]
enum Wire {
    Random {
        method: usize,
        bytes: Vec<u8>,
    },
    Truncated {
        op: Op,
        cut: Index,
    },
    Flipped {
        op: Op,
        at: Index,
        bit: u8,
    },
    /// A valid request of one method sent to another.
    OtherType {
        op: Op,
        method: usize,
    },
    /// A frame whose length prefix is `len` whatever the payload.
    LyingLength {
        op: Op,
        len: u32,
    },
    /// A frame with this flag byte (1: compressed, with no encoding named).
    Flag {
        op: Op,
        flag: u8,
    },
    TwoMessages {
        op: Op,
    },
    NoMessage {
        method: usize,
    },
    UnknownMethod {
        op: Op,
    },
}

fn method() -> impl Strategy<Value = usize> {
    0..METHODS.len()
}

fn wire() -> impl Strategy<Value = Wire> {
    let len = prop_oneof![0..64u32, Just(u32::MAX), Just((4 << 20) + 1), any::<u32>()];
    prop_oneof![
        3 => (method(), proptest::collection::vec(any::<u8>(), 0..200)).prop_map(|(method, bytes)| Wire::Random { method, bytes }),
        3 => (ops(), any::<Index>()).prop_map(|(op, cut)| Wire::Truncated { op, cut }),
        2 => (ops(), any::<Index>(), 0..8u8).prop_map(|(op, at, bit)| Wire::Flipped { op, at, bit }),
        2 => (ops(), method()).prop_map(|(op, method)| Wire::OtherType { op, method }),
        1 => (ops(), len).prop_map(|(op, len)| Wire::LyingLength { op, len }),
        1 => (ops(), prop_oneof![Just(1u8), 2..=255u8]).prop_map(|(op, flag)| Wire::Flag { op, flag }),
        1 => ops().prop_map(|op| Wire::TwoMessages { op }),
        1 => method().prop_map(|method| Wire::NoMessage { method }),
        1 => ops().prop_map(|op| Wire::UnknownMethod { op }),
    ]
}

/// The op's valid request (names from an empty history), and its method.
fn valid(op: &Op) -> (&'static str, Vec<u8>) {
    // The clock is not a request: a heartbeat stands in.
    request(op, &Seen::default()).unwrap_or((METHODS[1], proto::WorkerHeartbeatRequest::default().encode_to_vec()))
}

/// The method and body a wire input sends.
fn body(input: &Wire) -> (String, Bytes) {
    match input {
        Wire::Random { method, bytes } => (METHODS[*method].into(), frame(bytes)),
        Wire::Truncated { op, cut } => {
            let (path, bytes) = valid(op);
            let cut = cut.index(bytes.len() + 1);
            (path.into(), frame(&bytes[..cut]))
        }
        Wire::Flipped { op, at, bit } => {
            let (path, mut bytes) = valid(op);
            if !bytes.is_empty() {
                let i = at.index(bytes.len());
                bytes[i] ^= 1 << bit;
            }
            (path.into(), frame(&bytes))
        }
        Wire::OtherType { op, method } => (METHODS[*method].into(), frame(&valid(op).1)),
        Wire::LyingLength { op, len } => {
            let (path, bytes) = valid(op);
            (path.into(), framed(0, *len, &bytes))
        }
        Wire::Flag { op, flag } => {
            let (path, bytes) = valid(op);
            (path.into(), framed(*flag, bytes.len() as u32, &bytes))
        }
        Wire::TwoMessages { op } => {
            let (path, bytes) = valid(op);
            (path.into(), [frame(&bytes), frame(&bytes)].concat().into())
        }
        Wire::NoMessage { method } => (METHODS[*method].into(), Bytes::new()),
        Wire::UnknownMethod { op } => ("/stoker.v1alpha1.Dispatcher/Nope".into(), frame(&valid(op).1)),
    }
}

fn config() -> Config {
    Config {
        cases: fuzz_support::cases(CASES),
        failure_persistence: Some(Box::new(FileFailurePersistence::Off)),
        ..Config::default()
    }
}

/// A dispatcher served on a free loopback port, until the runtime is dropped.
fn serve(runtime: &tokio::runtime::Runtime) -> SocketAddr {
    runtime.block_on(async {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("a free port");
        let addr = listener.local_addr().expect("its address");
        let d = Dispatcher::new(Timeouts::default(), Duration::from_secs(5));
        tokio::spawn(dispatcher::serve(listener, d, None, std::future::pending()));
        addr
    })
}

/// A registration that must succeed: the server still serves.
fn registration() -> Bytes {
    let r = proto::RegisterWorkerRequest {
        pipeline: Some(proto::PipelineRef { namespace: "ns".into(), name: "alive".into() }),
        address: "10.1.1.1:7000".into(),
        splits: 3,
        ..Default::default()
    };
    frame(&r.encode_to_vec())
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build().expect("a runtime")
}

#[test]
fn bytes_that_are_not_the_request_get_a_status_and_the_server_goes_on() {
    let _serial = fuzz_support::serial();
    let runtime = runtime();
    let addr = serve(&runtime);
    let raw = std::sync::Mutex::new(runtime.block_on(Raw::connect(addr)));
    // Deep value trees: see fuzz_dispatcher.rs.
    let result = std::thread::scope(|scope| {
        let run = std::thread::Builder::new().stack_size(64 << 20).spawn_scoped(scope, || {
            TestRunner::new(config())
                .run(&wire(), |input| {
                    let (path, body) = body(&input);
                    let mut raw = raw.lock().expect("not poisoned");
                    let answer = runtime.block_on(raw.call(&path, body)).map_err(TestCaseError::fail)?;
                    prop_assert!(acceptable(&answer), "answered {answer:?}");
                    let alive = runtime.block_on(raw.call(METHODS[0], registration())).map_err(TestCaseError::fail)?;
                    prop_assert_eq!(alive.code, 0, "a valid registration afterwards: {:?}", alive);
                    Ok(())
                })
                .map_err(|e| e.to_string())
        });
        run.expect("a thread").join().expect("the runner does not panic")
    });
    if let Err(e) = result {
        panic!("{e}");
    }
}

#[test]
fn a_message_over_the_limit_is_out_of_range_and_a_huge_length_prefix_reserves_nothing() {
    let _serial = fuzz_support::serial();
    let runtime = runtime();
    let addr = serve(&runtime);
    let mut raw = runtime.block_on(Raw::connect(addr));
    // One byte over tonic's 4 MiB default: a valid RegisterWorker padded in an unknown field.
    let mut big = proto::RegisterWorkerRequest::default().encode_to_vec();
    big.extend(std::iter::repeat_n(0u8, (4 << 20) + 1));
    let answer = runtime.block_on(raw.call(METHODS[0], frame(&big))).expect("an answer");
    assert_eq!(answer.code, tonic::Code::OutOfRange as i32, "{answer:?}");

    fuzz_support::reset_peak();
    let before = fuzz_support::live();
    let answer = runtime.block_on(raw.call(METHODS[0], framed(0, u32::MAX, b"\x0a\x00"))).expect("an answer");
    assert_eq!(answer.code, tonic::Code::OutOfRange as i32, "{answer:?}");
    let peak = fuzz_support::peak().saturating_sub(before);
    assert!(peak < 1 << 20, "a length prefix of 4 GiB made the server take {peak} bytes");

    let alive = runtime.block_on(raw.call(METHODS[0], registration())).expect("an answer");
    assert_eq!(alive.code, 0, "{alive:?}");
}
