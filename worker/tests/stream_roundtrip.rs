//! The batch stream end to end on loopback: worker server, Rust client, real gRPC.

use std::sync::{Arc, Mutex};

use crate::stream_support::{connect, images, options, start, start_with};
use stoker_api::DType;
use stoker_api::proto::batch_stream_client::BatchStreamClient;
use stoker_api::proto::{PipelineRef, StreamRequest};
use stoker_client::{CompressionEncoding, Error};
use stoker_worker::stream::{
    BatchSource, Batches, Caller, ServerOptions, StreamService, Subscription, SyntheticSource,
};
use tonic::metadata::MetadataMap;
use tonic::{Code, Status};

#[tokio::test]
async fn batches_arrive_exactly() {
    let source = SyntheticSource::new(vec![
        ("image".into(), DType::Float16, vec![2, 8, 8, 3]),
        ("label".into(), DType::Int64, vec![2]),
        ("weight".into(), DType::Float32, vec![2, 1]),
    ])
    .batches(25);
    let worker = start(source.clone()).await;
    let mut opts = options();
    opts.start_epoch = Some(3);
    let mut client = connect(&[&worker], opts).await;
    for i in 0..25 {
        let got = client.next().await.unwrap().unwrap();
        // Numbered from 1: the stream is resumable.
        assert_eq!(got, stoker_api::Batch { stream_seq: i + 1, ..source.batch(3, i).join() }, "batch {i}");
        assert_eq!((got.epoch, got.split, got.sequence), (3, i / 10, i % 10));
    }
    assert!(client.next().await.is_none());
    // Each batch's time closes at the following call, the final (empty) one included.
    assert_eq!(client.window().batches, 25);
}

/// Streams `source`'s first two batches with a 4 MiB limit and checks them byte for byte.
async fn two_batches_intact(source: SyntheticSource, compression: Option<CompressionEncoding>) {
    let source = source.batches(2);
    let mut service = StreamService::new(source.clone());
    if let Some(encoding) = compression {
        service = service.with_compression(encoding);
    }
    let worker = start_with(service, ServerOptions::default()).await;
    let mut opts = options();
    opts.max_message_bytes = 4 << 20;
    opts.compression = compression;
    let mut client = connect(&[&worker], opts).await;
    for i in 0..2 {
        let got = client.next().await.unwrap().unwrap();
        let want = stoker_api::Batch { stream_seq: i + 1, ..source.batch(0, i).join() };
        assert_eq!(got.payload_bytes(), want.payload_bytes());
        assert!(got == want, "batch {i} differs");
    }
    assert!(client.next().await.is_none());
}

#[tokio::test]
async fn a_40_mb_batch_streams_through_a_4_mib_limit() {
    let source = SyntheticSource::new(vec![
        ("big".into(), DType::Uint8, vec![40_000_000]),
        ("label".into(), DType::Int32, vec![7]),
    ]);
    two_batches_intact(source, None).await;
}

#[tokio::test]
async fn a_batch_of_exactly_the_limit_and_an_empty_tensor() {
    let source = SyntheticSource::new(vec![
        ("empty".into(), DType::Float32, vec![0, 5]),
        ("exact".into(), DType::Float32, vec![1 << 20]),
    ]);
    two_batches_intact(source, None).await;
}

#[tokio::test]
async fn compressed_streams_round_trip() {
    for encoding in [CompressionEncoding::Gzip, CompressionEncoding::Zstd] {
        two_batches_intact(images(4, 700), Some(encoding)).await;
    }
}

#[tokio::test]
async fn one_client_reads_from_two_workers() {
    let a = start(SyntheticSource::new(vec![("x".into(), DType::Uint8, vec![4])]).batches(20)).await;
    let b = start(SyntheticSource::new(vec![("x".into(), DType::Uint8, vec![5])]).batches(30)).await;
    let mut opts = options();
    opts.prefetch = 3;
    let mut client = connect(&[&a, &b], opts).await;
    let (mut from_a, mut from_b) = (0, 0);
    while let Some(batch) = client.next().await {
        match batch.unwrap().tensors["x"].shape[0] {
            4 => from_a += 1,
            5 => from_b += 1,
            other => panic!("unexpected shape {other}"),
        }
    }
    assert_eq!((from_a, from_b), (20, 30));
}

fn request(namespace: &str, name: &str, job: &str, max_message_bytes: u64) -> StreamRequest {
    StreamRequest {
        pipeline: Some(PipelineRef { namespace: namespace.into(), name: name.into() }),
        job: job.into(),
        consumer_index: 0,
        consumers: 0,
        start_epoch: None,
        max_message_bytes,
        epoch: None,
        coordinated: false,
        shared_memory: None,
        resume: None,
    }
}

#[tokio::test]
async fn malformed_requests_are_invalid_arguments() {
    let worker = start(images(1, 4)).await;
    let channel = tonic::transport::Endpoint::from_shared(format!("http://{}", worker.addr)).unwrap();
    let mut raw = BatchStreamClient::new(channel.connect().await.unwrap());
    let no_pipeline = StreamRequest { pipeline: None, ..request("a", "b", "j", 0) };
    let cases = [
        ("no pipeline", no_pipeline),
        ("empty namespace", request("", "b", "j", 0)),
        ("empty name", request("a", "", "j", 0)),
        ("empty job", request("a", "b", "", 0)),
        ("10-byte messages", request("a", "b", "j", 10)),
        ("1 TiB messages", request("a", "b", "j", 1 << 40)),
        ("huge name", request("a", &"n".repeat(300), "j", 0)),
    ];
    for (what, req) in cases {
        let status = raw.stream(req).await.err().unwrap_or_else(|| panic!("{what} was accepted"));
        assert_eq!(status.code(), Code::InvalidArgument, "{what}: {status:?}");
    }
    // The server is still serving after all that.
    let ok = raw.stream(request("a", "b", "j", 0)).await.unwrap().into_inner().message().await.unwrap();
    assert!(ok.unwrap().header.is_some());
}

#[tokio::test]
async fn a_header_too_large_for_the_limit_is_a_status_not_a_hang() {
    let tensors = (0..4000).map(|i| (format!("a-long-tensor-name-number-{i}"), DType::Uint8, vec![1])).collect();
    let worker = start(SyntheticSource::new(tensors)).await;
    let mut opts = options();
    opts.max_message_bytes = 64 << 10;
    let mut client = connect(&[&worker], opts).await;
    let err = client.next().await.unwrap().unwrap_err();
    assert_eq!(err.code(), Some(Code::ResourceExhausted), "{err}");
}

/// Refuses callers without a token; records who subscribed.
struct RequireToken;

impl stoker_worker::stream::Authenticator for RequireToken {
    async fn authenticate(&self, metadata: &MetadataMap, namespace: &str, name: &str) -> Result<Caller, Status> {
        assert_eq!((namespace, name), ("team-a", "imagenet"), "asked about the requested pipeline");
        match stoker_api::proto::request_token(metadata) {
            Some(token) => Ok(Caller { token: Some(token.to_string()), username: Some("reader".into()) }),
            None => Err(Status::unauthenticated("a ServiceAccount token is required")),
        }
    }
}

#[derive(Clone, Default)]
struct Recording(Arc<Mutex<Vec<Subscription>>>);

impl BatchSource for Recording {
    fn subscribe(&self, subscription: &Subscription) -> Result<Batches, Status> {
        self.0.lock().unwrap().push(subscription.clone());
        Ok(Box::pin(futures::stream::empty()))
    }
}

#[tokio::test]
async fn the_authenticator_sees_the_token_and_can_refuse() {
    let recording = Recording::default();
    let worker =
        start_with(StreamService::new(recording.clone()).with_authenticator(RequireToken), ServerOptions::default())
            .await;
    let err = stoker_client::Client::connect(vec![worker.addr.to_string()], options()).await.err().unwrap();
    assert!(matches!(&err, Error::Status { status, .. } if status.code() == Code::Unauthenticated), "{err}");
    assert!(recording.0.lock().unwrap().is_empty());

    let mut opts = options();
    opts.token = Some("sa-token".into());
    opts.job = "train".into();
    opts.consumer_index = 1;
    opts.consumers = 2;
    let mut client = connect(&[&worker], opts).await;
    assert!(client.next().await.is_none());
    let subs = recording.0.lock().unwrap().clone();
    assert_eq!(
        subs,
        vec![Subscription {
            namespace: "team-a".into(),
            pipeline: "imagenet".into(),
            job: "train".into(),
            reading: stoker_api::Reading::Ranked { rank: 1, ranks: 2, coordinated: false },
            start_epoch: None,
            epoch: None,
            caller: Caller { token: Some("sa-token".into()), username: Some("reader".into()) },
        }]
    );
}

#[tokio::test]
async fn the_default_authenticator_allows_anonymous_callers() {
    let recording = Recording::default();
    let worker = start_with(StreamService::new(recording.clone()), ServerOptions::default()).await;
    let mut client = connect(&[&worker], options()).await;
    assert!(client.next().await.is_none());
    assert_eq!(recording.0.lock().unwrap()[0].caller, Caller::default());
}
