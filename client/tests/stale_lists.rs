//! A worker list from a dispatcher the client has already left behind (sent before it went,
//! still buffered on the way when the client rejoined the new one) is stale news, not a
//! second restart. Taken for one, each such list made the client rejoin the dispatcher it had
//! just rejoined, retiring it: from then on every batch of the new dispatcher was refused,
//! and a rank of the `dispatcher_restart` test waited for good (on a loaded machine, where
//! lists pile up unread). A hand-played dispatcher on loopback sends exactly that order.
//! It also refuses a rejoin once: the client sends the same rejoin again, the rows it got from
//! a hand-played worker included (the Rust twin of a test of the Python client's own protocol
//! code, deleted with it).

use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use futures::Stream;
use stoker_api::proto::batch_stream_server::{BatchStream, BatchStreamServer};
use stoker_api::proto::dispatcher_server::{Dispatcher, DispatcherServer};
use stoker_api::proto::*;
use stoker_client::{Client, ClientOptions};
use tokio::net::TcpListener;
use tokio::sync::mpsc;
use tonic::transport::server::TcpIncoming;
use tonic::{Request, Response, Status};

type Lists = Pin<Box<dyn Stream<Item = Result<WorkerList, Status>> + Send>>;

/// Plays a dispatcher that "restarts" when the test says: its incarnation moves from 1 to 2.
#[derive(Default)]
struct Played {
    incarnation: AtomicU64,
    /// Each RegisterClient's `rejoin` (None: a first registration).
    registrations: Mutex<Vec<Option<Rejoin>>>,
    /// Rejoins still to refuse as if the dispatcher were not up yet.
    refuse_rejoins: AtomicU64,
    /// A client rejoined the current incarnation (until then its acknowledgements are
    /// answered NOT_FOUND, as a restarted dispatcher answers them).
    rejoined: std::sync::atomic::AtomicBool,
    /// The first watch's lists come from the test; later watches get the newest list.
    first_watch: Mutex<Option<mpsc::UnboundedReceiver<WorkerList>>>,
    watches: AtomicU64,
}

fn list(incarnation: u64) -> WorkerList {
    WorkerList { incarnation, version: incarnation, ..WorkerList::default() }
}

/// The service over the state the test reads.
struct Service(Arc<Played>);

#[tonic::async_trait]
impl Dispatcher for Service {
    type WatchWorkersStream = Lists;

    async fn register_client(
        &self,
        request: Request<RegisterClientRequest>,
    ) -> Result<Response<RegisterClientResponse>, Status> {
        let r = request.into_inner();
        let rejoining = r.rejoin.is_some();
        self.0.registrations.lock().unwrap().push(r.rejoin);
        if rejoining
            && self.0.refuse_rejoins.fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1)).is_ok()
        {
            return Err(Status::unavailable("starting"));
        }
        self.0.rejoined.store(rejoining, Ordering::SeqCst);
        let incarnation = self.0.incarnation.load(Ordering::SeqCst);
        Ok(Response::new(RegisterClientResponse { client_id: "c-1".into(), window_ms: 0, job: r.job, incarnation }))
    }

    async fn watch_workers(&self, _: Request<WatchWorkersRequest>) -> Result<Response<Lists>, Status> {
        self.0.watches.fetch_add(1, Ordering::SeqCst);
        if let Some(rx) = self.0.first_watch.lock().unwrap().take() {
            let lists = futures::stream::unfold(rx, |mut rx| async move { Some((Ok(rx.recv().await?), rx)) });
            return Ok(Response::new(Box::pin(lists)));
        }
        let newest = list(self.0.incarnation.load(Ordering::SeqCst));
        Ok(Response::new(Box::pin(futures::StreamExt::chain(
            futures::stream::iter([Ok(newest)]),
            futures::stream::pending(),
        ))))
    }

    async fn acknowledge(&self, _: Request<AcknowledgeRequest>) -> Result<Response<AcknowledgeResponse>, Status> {
        let incarnation = self.0.incarnation.load(Ordering::SeqCst);
        if incarnation > 1 && !self.0.rejoined.load(Ordering::SeqCst) {
            let mut metadata = tonic::metadata::MetadataMap::new();
            metadata.insert(INCARNATION, incarnation.into());
            return Err(Status::with_metadata(tonic::Code::NotFound, "unknown client", metadata));
        }
        Ok(Response::new(AcknowledgeResponse { epoch: 0 }))
    }

    async fn report_window(&self, _: Request<ReportWindowRequest>) -> Result<Response<ReportWindowResponse>, Status> {
        Ok(Response::new(ReportWindowResponse {}))
    }

    async fn register_worker(
        &self,
        _: Request<RegisterWorkerRequest>,
    ) -> Result<Response<RegisterWorkerResponse>, Status> {
        Err(Status::unimplemented("not played"))
    }

    async fn worker_heartbeat(
        &self,
        _: Request<WorkerHeartbeatRequest>,
    ) -> Result<Response<WorkerHeartbeatResponse>, Status> {
        Err(Status::unimplemented("not played"))
    }

    async fn next_split(&self, _: Request<NextSplitRequest>) -> Result<Response<NextSplitResponse>, Status> {
        Err(Status::unimplemented("not played"))
    }

    async fn return_splits(&self, _: Request<ReturnSplitsRequest>) -> Result<Response<ReturnSplitsResponse>, Status> {
        Err(Status::unimplemented("not played"))
    }

    async fn authorize_reader(
        &self,
        _: Request<AuthorizeReaderRequest>,
    ) -> Result<Response<AuthorizeReaderResponse>, Status> {
        Err(Status::unimplemented("not played"))
    }
}

async fn until(what: &str, mut done: impl FnMut() -> bool) {
    tokio::time::timeout(Duration::from_secs(10), async {
        while !done() {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    })
    .await
    .unwrap_or_else(|_| panic!("{what} within 10 s"));
}

/// A worker that sends one batch of epoch 0 (rows 0 and 1 of split 3, made under dispatcher
/// 1, the split not complete), then holds the stream open.
struct OneBatch;

#[tonic::async_trait]
impl BatchStream for OneBatch {
    type StreamStream = Pin<Box<dyn Stream<Item = Result<BatchChunk, Status>> + Send>>;

    async fn stream(&self, _: Request<StreamRequest>) -> Result<Response<Self::StreamStream>, Status> {
        let meta =
            TensorMeta { name: "x".into(), dtype: Dtype::Uint8 as i32, shape: vec![2], byte_length: 2, layout: 0 };
        let header = BatchHeader {
            tensors: vec![meta],
            rows: vec![stoker_api::row(3, 0), stoker_api::row(3, 1)],
            incarnation: 1,
            ..BatchHeader::default()
        };
        let chunk = BatchChunk {
            header: Some(header),
            pieces: vec![Bytes::from_static(b"ab")],
            last: true,
            ..Default::default()
        };
        Ok(Response::new(Box::pin(futures::StreamExt::chain(
            futures::stream::iter([Ok(chunk)]),
            futures::stream::pending(),
        ))))
    }
}

/// A client registered with the played dispatcher (incarnation 1), and the sender of the
/// lists on its first watch.
async fn registered() -> (Arc<Played>, mpsc::UnboundedSender<WorkerList>, Client) {
    let played = Arc::new(Played { incarnation: AtomicU64::new(1), ..Played::default() });
    let (lists, rx) = mpsc::unbounded_channel();
    *played.first_watch.lock().unwrap() = Some(rx);
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let svc = DispatcherServer::new(Service(played.clone()));
    tokio::spawn(tonic::transport::Server::builder().add_service(svc).serve_with_incoming(TcpIncoming::from(listener)));
    lists.send(list(1)).unwrap();
    let client = Client::from_dispatcher(&url, ClientOptions::new("ns", "p")).await.unwrap();
    (played, lists, client)
}

#[tokio::test]
async fn lists_of_a_dispatcher_the_client_left_make_no_second_rejoin() {
    let (played, lists, _client) = registered().await;
    assert_eq!(*played.registrations.lock().unwrap(), [None]);

    // The restart: the client hears of it from a list, and rejoins once, retiring 1.
    played.incarnation.store(2, Ordering::SeqCst);
    lists.send(list(2)).unwrap();
    until("the rejoin", || played.registrations.lock().unwrap().len() == 2).await;
    // Then lists the old dispatcher had sent before it went.
    for _ in 0..3 {
        lists.send(list(1)).unwrap();
    }
    until("a new watch after the stale list", || played.watches.load(Ordering::SeqCst) == 2).await;
    let rejoined: Vec<Option<u64>> =
        played.registrations.lock().unwrap().iter().map(|r| r.as_ref().map(|r| r.incarnation)).collect();
    assert_eq!(rejoined, [None, Some(1)], "one rejoin, retiring the old dispatcher; the new one never retired");
}

#[tokio::test]
async fn a_rejoin_that_failed_is_sent_again_as_it_was() {
    let (played, lists, mut client) = registered().await;
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let worker = listener.local_addr().unwrap().to_string();
    let svc = BatchStreamServer::new(OneBatch);
    tokio::spawn(tonic::transport::Server::builder().add_service(svc).serve_with_incoming(TcpIncoming::from(listener)));
    lists.send(WorkerList { addresses: vec![worker], workers: vec!["w-1".into()], ..list(1) }).unwrap();
    let batch = tokio::time::timeout(Duration::from_secs(10), client.next_in_epoch()).await.unwrap().unwrap().unwrap();
    assert_eq!(batch.rows.len(), 2);

    // The restart, heard of from a list; the first rejoin is refused, the acknowledgement
    // after it answered NOT_FOUND by the new dispatcher, which makes the client rejoin again.
    played.refuse_rejoins.store(1, Ordering::SeqCst);
    played.incarnation.store(2, Ordering::SeqCst);
    lists.send(list(2)).unwrap();
    until("the rejoin sent again", || played.registrations.lock().unwrap().len() == 3).await;
    let registrations = played.registrations.lock().unwrap().clone();
    let (refused, again) = (&registrations[1], &registrations[2]);
    let refused = refused.as_ref().expect("a rejoin");
    assert_eq!(refused.incarnation, 1, "retiring the old dispatcher");
    let received: Vec<(u64, u64, Vec<u32>)> =
        refused.received.iter().map(|h| (h.epoch, h.split, h.positions.clone())).collect();
    assert_eq!(received, [(0, 3, vec![0, 1])], "the rows the worker sent");
    assert_eq!(again.as_ref(), Some(refused), "the refused rejoin sent again as it was, its rows too");
}
