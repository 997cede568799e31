//! `WatchWorkers`: a list whose workers did not change since the last on the stream carries
//! none (each epoch's end would otherwise send every client the whole list).

use std::time::Duration;

use futures::StreamExt as _;
use stoker_api::proto::dispatcher_server::Dispatcher as _;
use tonic::Request;

use super::*;

fn pipeline() -> Option<proto::PipelineRef> {
    Some(proto::PipelineRef { namespace: "ns".into(), name: "p".into() })
}

async fn register_worker(service: &DispatcherService, address: &str) {
    let worker = proto::RegisterWorkerRequest {
        pipeline: pipeline(),
        address: address.into(),
        threads: 1,
        splits: 4,
        plan_digest: "d".into(),
        ..Default::default()
    };
    service.register_worker(Request::new(worker)).await.unwrap();
}

async fn next(lists: &mut WorkerListStream) -> proto::WorkerList {
    let message = tokio::time::timeout(Duration::from_secs(5), lists.next()).await;
    message.expect("a list within 5 s").expect("the stream is open").unwrap()
}

#[tokio::test]
async fn a_list_with_the_workers_of_the_last_one_carries_none() {
    let service = Dispatcher::new(Timeouts::default(), Duration::from_secs(5)).into_service();
    register_worker(&service, "10.0.0.1:7000").await;
    let watch = proto::WatchWorkersRequest { pipeline: pipeline(), job: "j".into() };
    let mut lists = service.watch_workers(Request::new(watch.clone())).await.unwrap().into_inner();
    let first = next(&mut lists).await;
    assert_eq!((first.addresses, first.same_workers), (vec!["10.0.0.1:7000".to_string()], false));

    // A client of the job joins: the job's clients changed, its workers did not.
    let client = proto::RegisterClientRequest { pipeline: pipeline(), job: "j".into(), ..Default::default() };
    service.register_client(Request::new(client)).await.unwrap();
    let same = next(&mut lists).await;
    assert!(same.same_workers && same.addresses.is_empty() && same.workers.is_empty(), "{same:?}");
    assert_eq!((same.clients, same.version), (1, first.version));

    // Another worker: the whole list again.
    register_worker(&service, "10.0.0.2:7000").await;
    let changed = next(&mut lists).await;
    assert!(!changed.same_workers && changed.version > first.version, "{changed:?}");
    assert_eq!(changed.addresses, ["10.0.0.1:7000", "10.0.0.2:7000"]);
    assert_eq!(changed.workers.len(), 2);

    // A new stream starts with the whole list, whatever others were sent.
    let mut again = service.watch_workers(Request::new(watch)).await.unwrap().into_inner();
    let whole = next(&mut again).await;
    assert!(!whole.same_workers && whole.addresses.len() == 2, "{whole:?}");
}
