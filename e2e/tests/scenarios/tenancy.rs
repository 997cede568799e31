//! Tenancy: every call to the dispatcher and to workers carries a ServiceAccount token with
//! Stoker's audience (made here with the TokenRequest API, as the kubelet makes a pod's);
//! reading a pipeline needs `get` on `datapipelines/stream` in its namespace; only the
//! pipeline's own ServiceAccount may work for it. Two tenants, A (owns the pipeline) and B.

use std::time::Duration;

use anyhow::{Context as _, ensure};
use k8s_openapi::api::core::v1::Event;
use k8s_openapi::api::networking::v1::NetworkPolicy;
use k8s_openapi::api::rbac::v1::ClusterRole;
use kube::api::{Api, ListParams, PostParams};
use stoker_api::proto::batch_stream_client::BatchStreamClient;
use stoker_api::proto::dispatcher_client::DispatcherClient;
use stoker_api::proto::{self, PipelineRef};
use stoker_e2e::k8s::{delete_namespace, fresh_namespace, ids_pipeline, wait_until_made};
use stoker_e2e::tenants::{grant_reader, reader_token, token};
use stoker_e2e::{Check, Cluster, OperatorOptions, wait_for};
use tonic::transport::Channel;
use tonic::{Code, Status};

const NAME: &str = "shared";
const AUDIENCE: &str = stoker_api::token::DEFAULT_AUDIENCE;

fn with_token<T>(message: T, token: Option<&str>) -> tonic::Request<T> {
    let mut request = tonic::Request::new(message);
    if let Some(token) = token {
        request.metadata_mut().insert(proto::AUTHORIZATION, proto::bearer(token).parse().unwrap());
    }
    request
}

fn register_client(ns: &str) -> proto::RegisterClientRequest {
    proto::RegisterClientRequest {
        pipeline: Some(PipelineRef { namespace: ns.into(), name: NAME.into() }),
        job: "tenancy".into(),
        ..Default::default()
    }
}

fn expect_code<T: std::fmt::Debug>(
    what: &str,
    result: Result<T, Status>,
    code: Code,
    says: &str,
) -> anyhow::Result<()> {
    match result {
        Err(s) if s.code() == code && s.message().contains(says) => Ok(()),
        other => anyhow::bail!("{what}: expected {code:?} saying {says:?}, got {other:?}"),
    }
}

pub async fn tenancy_tokens_and_permissions(cluster: &dyn Cluster) -> anyhow::Result<()> {
    let Some(url) = super::dispatcher_or_skip(cluster, "tenancy_tokens_and_permissions") else { return Ok(()) };
    // The harness runs the operator with a NetworkPolicy per pipeline (chart:
    // networkPolicy.enabled) on both providers.
    cluster.operator_start(OperatorOptions::default()).await?;
    let client = cluster.client();
    let a = fresh_namespace(&client, "e2e-tenant-a").await?;
    let b = fresh_namespace(&client, "e2e-tenant-b").await?;
    let kubelet = cluster.run_workers(&a)?;
    ids_pipeline(cluster, &a, NAME, 200).await?;

    // The workers' NetworkPolicy admits only A's pods and the operator's namespace.
    let policies = Api::<NetworkPolicy>::namespaced(client.clone(), &a);
    let policy = wait_until_made(&policies, &format!("{NAME}-workers"), Duration::from_secs(60)).await?;
    let rules = serde_json::to_string(&policy.spec)?;
    ensure!(rules.contains(stoker_e2e::OPERATOR_NAMESPACE) && rules.contains("Ingress"), "{rules}");

    let channel = Channel::from_shared(url.clone())?.connect_lazy();
    let dispatcher = DispatcherClient::new(channel);
    let owner = reader_token(&client, &a).await?;
    let outsider = token(&client, &b, "trainer", AUDIENCE).await?;

    // The pipeline's own reader gets in (retrying while its worker starts and registers).
    let workers = wait_for(Duration::from_secs(120), "A's trainer to see A's worker", || {
        let (mut d, owner, a) = (dispatcher.clone(), owner.clone(), a.clone());
        async move {
            let request = proto::WatchWorkersRequest {
                pipeline: Some(PipelineRef { namespace: a.clone(), name: NAME.into() }),
                job: "tenancy".into(),
            };
            let mut lists = match d.watch_workers(with_token(request, Some(&owner))).await {
                Ok(lists) => lists.into_inner(),
                Err(s) => return Ok(Check::not_yet(format!("{s}"))),
            };
            let list = tokio::time::timeout(Duration::from_secs(5), lists.message()).await;
            Ok(match list {
                Ok(Ok(Some(list))) if !list.addresses.is_empty() => Check::Done(list.addresses),
                other => Check::not_yet(format!("{other:?}")),
            })
        }
    })
    .await?;

    // No token, a token that is not one, a token for another audience: UNAUTHENTICATED.
    let mut d = dispatcher.clone();
    expect_code(
        "no token",
        d.register_client(with_token(register_client(&a), None)).await,
        Code::Unauthenticated,
        "no ServiceAccount token",
    )?;
    expect_code(
        "a forged token",
        d.register_client(with_token(register_client(&a), Some("not-a-token"))).await,
        Code::Unauthenticated,
        "not accepted",
    )?;
    let other_audience = token(&client, &a, "trainer", "https://kubernetes.default.svc.cluster.local").await?;
    expect_code(
        "a token for the API server's audience",
        d.register_client(with_token(register_client(&a), Some(&other_audience))).await,
        Code::Unauthenticated,
        "not accepted",
    )?;

    // Tenant B may not read A's pipeline, from the dispatcher or from the worker directly.
    expect_code(
        "B registering for A's pipeline",
        d.register_client(with_token(register_client(&a), Some(&outsider))).await,
        Code::PermissionDenied,
        "datapipelines/stream",
    )?;
    let worker = format!("http://{}", workers[0]);
    let mut stream = BatchStreamClient::new(Channel::from_shared(worker.clone())?.connect_lazy());
    let stream_request = || proto::StreamRequest {
        pipeline: Some(PipelineRef { namespace: a.clone(), name: NAME.into() }),
        job: "tenancy".into(),
        epoch: Some(0),
        ..Default::default()
    };
    expect_code(
        "a stream without a token",
        stream.stream(with_token(stream_request(), None)).await.map(drop),
        Code::Unauthenticated,
        "no ServiceAccount token",
    )?;
    expect_code(
        "B streaming from A's worker",
        stream.stream(with_token(stream_request(), Some(&outsider))).await.map(drop),
        Code::PermissionDenied,
        "datapipelines/stream",
    )?;

    // Batch-time reports under a registered client's id from an unauthorised caller are
    // refused: they never reach the autoscaler.
    let registered = d.register_client(with_token(register_client(&a), Some(&owner))).await?.into_inner();
    let report = proto::ReportWindowRequest { client_id: registered.client_id.clone(), ..Default::default() };
    expect_code(
        "B reporting batch times for A's client",
        d.report_window(with_token(report.clone(), Some(&outsider))).await,
        Code::PermissionDenied,
        "datapipelines/stream",
    )?;
    d.report_window(with_token(report, Some(&owner))).await.context("the owner's report")?;

    // Workers: only A's pipeline ServiceAccount (default) may work for it.
    let fake = proto::RegisterWorkerRequest {
        pipeline: Some(PipelineRef { namespace: a.clone(), name: NAME.into() }),
        address: "127.0.0.1:9".into(),
        threads: 1,
        splits: 1,
        ..Default::default()
    };
    let b_worker = token(&client, &b, "default", AUDIENCE).await?;
    expect_code(
        "B's worker registering for A's pipeline",
        d.register_worker(with_token(fake.clone(), Some(&b_worker))).await,
        Code::PermissionDenied,
        "its workers run as",
    )?;
    let a_other = token(&client, &a, "builder", AUDIENCE).await?;
    expect_code(
        "a worker of A under another ServiceAccount",
        d.register_worker(with_token(fake, Some(&a_other))).await,
        Code::PermissionDenied,
        "its workers run as",
    )?;
    // The refused worker's batches can never reach a client: it is not in the list.
    let request = proto::WatchWorkersRequest {
        pipeline: Some(PipelineRef { namespace: a.clone(), name: NAME.into() }),
        job: "tenancy".into(),
    };
    let list = d.watch_workers(with_token(request, Some(&owner))).await?.into_inner().message().await?;
    let addresses = list.map(|l| l.addresses).unwrap_or_default();
    ensure!(!addresses.iter().any(|a| a.ends_with(":9")), "a refused worker is listed: {addresses:?}");

    // A RoleBinding to the consumer role in A lets B in, at the dispatcher and the worker.
    grant_reader(&client, &a, (&b, "trainer")).await?;
    wait_for(Duration::from_secs(60), "B to be let in after the RoleBinding", || {
        let (mut d, mut stream, request, outsider) =
            (dispatcher.clone(), stream.clone(), register_client(&a), outsider.clone());
        let stream_request = stream_request();
        async move {
            let registered = d.register_client(with_token(request, Some(&outsider))).await;
            let streamed = stream.stream(with_token(stream_request, Some(&outsider))).await;
            Ok(match (registered, streamed) {
                (Ok(_), Ok(_)) => Check::Done(()),
                (r, s) => Check::not_yet(format!("dispatcher {:?}, worker {:?}", r.err(), s.err())),
            })
        }
    })
    .await?;

    // The refusals show on A's pipeline as a Warning Event naming B.
    let events = Api::<Event>::namespaced(client.clone(), &a);
    wait_for(Duration::from_secs(90), "an AccessRefused Event on A's pipeline", || {
        let (events, b) = (events.clone(), b.clone());
        async move {
            let list = events.list(&ListParams::default()).await?;
            let refused: Vec<String> = list
                .items
                .iter()
                .filter(|e| e.reason.as_deref() == Some("AccessRefused"))
                .filter_map(|e| e.message.clone())
                .collect();
            let by_b = format!("by system:serviceaccount:{b}:trainer");
            Ok(if refused.iter().any(|m| m.contains(&by_b)) {
                Check::Done(())
            } else {
                Check::not_yet(format!("{refused:?}"))
            })
        }
    })
    .await?;

    api_server_refusals_fail_closed(cluster, &dispatcher, &a).await?;

    drop(kubelet);
    let started = std::time::Instant::now();
    delete_namespace(&client, &a, Duration::from_secs(120)).await?;
    delete_namespace(&client, &b, Duration::from_secs(120)).await?;
    println!("  both tenants' namespaces deleted in {:.1} s", started.elapsed().as_secs_f64());
    Ok(())
}

/// The API server refusing the operator's TokenReviews (its RBAC taken away): calls fail closed
/// with UNAVAILABLE naming the cause, and succeed again once the right is back. Only where the
/// operator runs as the chart's ServiceAccount (real pods); the local provider's operators are
/// cluster admins, so there the unit test `access::checked` (a failing and a hanging API
/// server) stands in.
async fn api_server_refusals_fail_closed(
    cluster: &dyn Cluster,
    dispatcher: &DispatcherClient<Channel>,
    a: &str,
) -> anyhow::Result<()> {
    if !cluster.provider().real_pods() {
        println!("  API-server refusal: needs the chart's RBAC (real pods); unit-tested in access::checked here");
        return Ok(());
    }
    let client = cluster.client();
    let roles = Api::<ClusterRole>::all(client.clone());
    let name = stoker_e2e::RELEASE;
    let original = roles.get(name).await?;
    let mut reduced = original.clone();
    reduced.metadata.managed_fields = None;
    for rules in reduced.rules.iter_mut() {
        rules.retain(|r| !r.resources.iter().flatten().any(|res| res == "tokenreviews"));
    }
    roles.replace(name, &PostParams::default(), &reduced).await?;
    // A fresh token each time: a token reviewed before is answered from the cache.
    let refused = wait_for(Duration::from_secs(60), "a call to fail closed without TokenReview rights", || {
        let (client, mut d, a) = (client.clone(), dispatcher.clone(), a.to_string());
        async move {
            grant_reader(&client, &a, (&a, "late")).await?;
            let fresh = token(&client, &a, "late", AUDIENCE).await?;
            Ok(match d.register_client(with_token(register_client(&a), Some(&fresh))).await {
                Err(s) if s.code() == Code::Unavailable => Check::Done(s.message().to_string()),
                other => Check::not_yet(format!("{other:?}")),
            })
        }
    })
    .await;
    let mut restored = roles.get(name).await?;
    restored.rules = original.rules.clone();
    roles.replace(name, &PostParams::default(), &restored).await?;
    let refused = refused?;
    ensure!(refused.contains("TokenReview"), "the refusal names its cause: {refused}");
    println!("  API server refusing TokenReviews: {refused}");
    let started = std::time::Instant::now();
    wait_for(Duration::from_secs(60), "calls to succeed again with the right restored", || {
        let (client, mut d, a) = (client.clone(), dispatcher.clone(), a.to_string());
        async move {
            let fresh = token(&client, &a, "late", AUDIENCE).await?;
            Ok(match d.register_client(with_token(register_client(&a), Some(&fresh))).await {
                Ok(_) => Check::Done(()),
                Err(s) => Check::not_yet(format!("{s}")),
            })
        }
    })
    .await?;
    println!("  calls succeed again {:.1} s after the right is restored", started.elapsed().as_secs_f64());
    Ok(())
}
