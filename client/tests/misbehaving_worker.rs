//! The client against a hand-played worker on loopback: broken chunk sequences surface as
//! protocol errors through `next()`, the token travels in metadata, and setup errors are typed.

use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use futures::Stream;
use stoker_api::proto::batch_stream_server::{BatchStream, BatchStreamServer};
use stoker_api::proto::{BatchChunk, BatchHeader, Dtype, StreamRequest, TensorMeta};
use stoker_client::{Client, ClientOptions, Error, ProtocolError};
use tokio::net::TcpListener;
use tonic::transport::server::TcpIncoming;
use tonic::{Request, Response, Status};

/// The authorization value and request the worker received.
type Seen = Arc<Mutex<Option<(Option<String>, StreamRequest)>>>;

/// Replays fixed chunks and remembers what the client sent.
struct Scripted {
    chunks: Vec<BatchChunk>,
    seen: Seen,
}

#[tonic::async_trait]
impl BatchStream for Scripted {
    type StreamStream = Pin<Box<dyn Stream<Item = Result<BatchChunk, Status>> + Send>>;

    async fn stream(&self, request: Request<StreamRequest>) -> Result<Response<Self::StreamStream>, Status> {
        let auth = request.metadata().get("authorization").map(|v| v.to_str().unwrap().to_string());
        *self.seen.lock().unwrap() = Some((auth, request.into_inner()));
        Ok(Response::new(Box::pin(futures::stream::iter(self.chunks.clone().into_iter().map(Ok)))))
    }
}

async fn scripted(chunks: Vec<BatchChunk>) -> (SocketAddr, Seen) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let seen = Seen::default();
    let svc = BatchStreamServer::new(Scripted { chunks, seen: seen.clone() });
    tokio::spawn(tonic::transport::Server::builder().add_service(svc).serve_with_incoming(TcpIncoming::from(listener)));
    (addr, seen)
}

fn header(n: u64) -> Option<BatchHeader> {
    let meta = TensorMeta { name: "x".into(), dtype: Dtype::Uint8 as i32, shape: vec![n], byte_length: n, layout: 0 };
    Some(BatchHeader {
        epoch: 1,
        split: 2,
        sequence: 3,
        tensors: vec![meta],
        completes: vec![],
        rows: vec![],
        incarnation: 0,
        round: None,
        stream_seq: 0,
        echo: false,
    })
}

fn chunk(header: Option<BatchHeader>, data: &'static [u8], last: bool) -> BatchChunk {
    BatchChunk { header, pieces: vec![Bytes::from_static(data)], last, ..Default::default() }
}

fn options() -> ClientOptions {
    ClientOptions::new("team-a", "p")
}

async fn connect(addr: SocketAddr, options: ClientOptions) -> Client {
    Client::connect(vec![addr.to_string()], options).await.unwrap()
}

#[tokio::test]
async fn a_good_batch_then_a_headerless_chunk() {
    let (addr, _) = scripted(vec![chunk(header(3), b"abc", true), chunk(None, b"zz", true)]).await;
    let mut client = connect(addr, options()).await;
    let batch = client.next().await.unwrap().unwrap();
    assert_eq!((batch.epoch, batch.split, batch.sequence), (1, 2, 3));
    assert_eq!(batch.tensors["x"].data, Bytes::from_static(b"abc"));
    match client.next().await {
        Some(Err(Error::Protocol { source: ProtocolError::MissingHeader, worker })) => {
            assert_eq!(worker, addr.to_string())
        }
        other => panic!("expected a protocol error, got {other:?}"),
    }
    assert!(client.next().await.is_none());
}

#[tokio::test]
async fn a_stream_ending_inside_a_batch() {
    let (addr, _) = scripted(vec![chunk(header(6), b"abc", false)]).await;
    let mut client = connect(addr, options()).await;
    assert!(matches!(client.next().await, Some(Err(Error::Protocol { source: ProtocolError::EndedMidBatch, .. }))));
}

#[tokio::test]
async fn a_length_mismatch() {
    let (addr, _) = scripted(vec![chunk(header(6), b"abc", true)]).await;
    let mut client = connect(addr, options()).await;
    let err = client.next().await.unwrap().unwrap_err();
    assert!(
        matches!(err, Error::Protocol { source: ProtocolError::Truncated { received: 3, declared: 6 }, .. }),
        "{err}"
    );
}

#[tokio::test]
async fn the_token_and_request_fields_reach_the_worker() {
    let (addr, seen) = scripted(vec![]).await;
    let mut opts = options();
    opts.token = Some("sa.jwt.token".into());
    opts.job = "resnet".into();
    opts.consumer_index = 2;
    opts.start_epoch = Some(5);
    let mut client = connect(addr, opts).await;
    assert!(client.next().await.is_none());
    let (auth, req) = seen.lock().unwrap().clone().unwrap();
    assert_eq!(auth.as_deref(), Some("Bearer sa.jwt.token"));
    let pipeline = req.pipeline.unwrap();
    assert_eq!((pipeline.namespace.as_str(), pipeline.name.as_str()), ("team-a", "p"));
    assert_eq!((req.job.as_str(), req.consumer_index, req.start_epoch), ("resnet", 2, Some(5)));
    assert_eq!(req.max_message_bytes, 4 << 20);
}

#[tokio::test]
async fn no_token_means_no_authorization_entry() {
    let (addr, seen) = scripted(vec![]).await;
    let mut client = connect(addr, options()).await;
    assert!(client.next().await.is_none());
    assert_eq!(seen.lock().unwrap().clone().unwrap().0, None);
}

#[tokio::test]
async fn setup_errors_are_typed() {
    assert!(matches!(Client::connect(vec![], options()).await, Err(Error::NoWorkers)));
    let mut o = options();
    o.prefetch = 0;
    assert!(matches!(Client::connect(vec!["127.0.0.1:1".into()], o).await, Err(Error::InvalidOptions(_))));
    let mut o = options();
    o.max_message_bytes = 10;
    assert!(matches!(Client::connect(vec!["127.0.0.1:1".into()], o).await, Err(Error::InvalidOptions(_))));
    // A port nobody listens on: bind one, then free it.
    let addr = TcpListener::bind("127.0.0.1:0").await.unwrap().local_addr().unwrap();
    let err = Client::connect(vec![addr.to_string()], options()).await.err().unwrap();
    assert!(matches!(err, Error::Connect { .. }), "{err}");
}
