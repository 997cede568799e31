//! A slow client must stop the worker: the source may run ahead of what the trainer consumed
//! only by what the bounded buffers hold (client prefetch, the HTTP/2 window, one batch in
//! each stage), never by an unbounded producer.

use std::time::Duration;

use crate::stream_support::{connect, options, start};
use stoker_api::DType;
use stoker_worker::stream::SyntheticSource;

const BATCH_BYTES: usize = 1 << 20;
const PREFETCH: usize = 4;
const WINDOW: u32 = 2 << 20;

#[tokio::test]
async fn a_slow_client_holds_the_source_back() {
    let source = SyntheticSource::new(vec![("x".into(), DType::Uint8, vec![BATCH_BYTES])]);
    let worker = start(source.clone()).await;
    let mut opts = options();
    opts.prefetch = PREFETCH;
    opts.stream_window_bytes = WINDOW;
    let mut client = connect(&[&worker], opts).await;

    let mut consumed = 0u64;
    for _ in 0..5 {
        client.next().await.unwrap().unwrap();
        consumed += 1;
        tokio::time::sleep(Duration::from_millis(40)).await;
    }
    // Give an unbounded producer every chance to show itself.
    tokio::time::sleep(Duration::from_millis(400)).await;
    let ahead = source.produced() - consumed;
    // Prefetch queue + the batch the client's reader holds + the flow-control window's worth
    // + the batch the server is encoding + the one it pulled next.
    let bound = PREFETCH as u64 + 1 + (WINDOW as u64).div_ceil(BATCH_BYTES as u64) + 2;
    assert!(ahead <= bound, "source ran {ahead} batches ahead of the client (bound {bound})");
    // And it stays there while the client keeps sleeping.
    let before = source.produced();
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(source.produced(), before, "the source kept producing for a stalled client");

    // Reading resumes the flow.
    for _ in 0..20 {
        client.next().await.unwrap().unwrap();
    }
    assert!(source.produced() >= consumed + 20);
    eprintln!("ran ahead by {ahead} batches (bound {bound})");
}
