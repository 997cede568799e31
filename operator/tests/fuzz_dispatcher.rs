//! Fuzzing the dispatcher's handlers with sequences of well-formed but hostile calls: every RPC
//! in any order, with ids seen earlier, ids never handed out, empty and overlong strings,
//! u64::MAX epochs and splits, ranks out of range, rejoin and resume states that lie, repeated
//! fields of hundreds of thousands of entries. The handlers are called directly (no transport;
//! `fuzz_dispatcher_wire.rs` sends raw bytes over one). After every call:
//!
//! - it returned (no panic, so no poisoned mutex: the next call would fail if it were);
//! - its status is one the call may give (never UNKNOWN or INTERNAL), and the one a small
//!   model of who is registered predicts where the model knows (an invalid field is
//!   INVALID_ARGUMENT, an id never registered NOT_FOUND with the dispatcher's incarnation, a
//!   live one's heartbeat OK);
//! - the dispatcher tracks exactly the workers and clients the model says are registered;
//! - the call's peak memory and what the dispatcher keeps stay bounded.
//!
//! At the end of each sequence a fresh worker and client still get a split.

mod fuzz_support;
mod fuzz_support_dispatcher;

use fuzz_support::Counting;
use fuzz_support_dispatcher::{Harness, ops};
use proptest::test_runner::{Config, FileFailurePersistence, TestCaseError, TestRunner};

#[global_allocator]
static ALLOCATOR: Counting = Counting;

/// Sequences per run by default (each of up to 40 calls: about 7000 calls).
const CASES: u32 = 350;

fn config() -> Config {
    Config {
        cases: fuzz_support::cases(CASES),
        // A failing case is shrunk and printed; the minimal sequence becomes a unit test.
        failure_persistence: Some(Box::new(FileFailurePersistence::Off)),
        max_shrink_iters: 2000,
        ..Config::default()
    }
}

#[test]
fn any_sequence_of_calls_gets_a_status_and_leaves_the_dispatcher_bounded_and_answering() {
    // The strategies' value trees nest deep: a debug build needs more than a test thread's
    // 2 MiB of stack to generate and shrink them.
    let run = std::thread::Builder::new()
        .stack_size(64 << 20)
        .spawn(|| {
            let mut runner = TestRunner::new(config());
            runner
                .run(&proptest::collection::vec(ops(), 1..40), |calls| {
                    let mut harness = Harness::new();
                    for (i, op) in calls.iter().enumerate() {
                        if let Err(failure) = harness.call(op) {
                            return Err(TestCaseError::fail(format!("call {i} of {}: {op:?}: {failure}", calls.len())));
                        }
                    }
                    harness.still_answers().map_err(TestCaseError::fail)
                })
                .map_err(|e| e.to_string())
        })
        .expect("a thread");
    if let Err(e) = run.join().expect("the runner does not panic") {
        panic!("{e}");
    }
}
