//! The chart's Grafana dashboard against a real Prometheus: Debian's `prometheus`, started here
//! on loopback with a scrape configuration naming the leading operator and the pipeline's
//! workers, while a trainer reads an autoscaled, cached pipeline with a corrupt record and a
//! trainer without a token is refused. Every query of every panel, with the dashboard's
//! variables set to that pipeline, must return data.

use std::time::Duration;

use anyhow::{Context as _, ensure};
use kube::api::{Api, ListParams, Patch, PatchParams};
use stoker_api::DataPipeline;
use stoker_client::{Client, ClientOptions};
use stoker_e2e::k8s::{delete_namespace, fresh_namespace};
use stoker_e2e::prometheus::Prometheus;
use stoker_e2e::tenants::reader_options;
use stoker_e2e::{Check, Cluster, OperatorOptions, dashboard, wait_for};

const NAME: &str = "watched";
/// The dashboard's `$__rate_interval` at a 1 s scrape interval.
const RATE_INTERVAL: &str = "20s";

pub async fn dashboard_queries_have_data(cluster: &dyn Cluster) -> anyhow::Result<()> {
    let Some(url) = super::dispatcher_or_skip(cluster, "dashboard_queries_have_data") else { return Ok(()) };
    cluster.operator_start(OperatorOptions::default()).await?;
    let client = cluster.client();
    let ns = fresh_namespace(&client, "e2e-dashboard").await?;
    let kubelet = cluster.run_workers(&ns)?;

    // Records with one corrupt line per shard, skipped and counted.
    let data = cluster.workdir().join(format!("{ns}-data"));
    std::fs::create_dir_all(&data)?;
    for shard in 0..6 {
        let mut lines: String =
            (0..100).map(|i| format!("{{\"id\": {}, \"x\": [1.5, 2.5]}}\n", shard * 1000 + i)).collect();
        lines.push_str("{not json\n");
        std::fs::write(data.join(format!("{shard}.jsonl")), lines)?;
    }
    let seen_as = cluster.worker_data(&data);
    let yaml = format!(
        "apiVersion: stoker.dev/v1alpha1\nkind: DataPipeline\nmetadata: {{name: {NAME}}}\nspec:\n  \
         source: {{uri: 'file://{}/', format: jsonl}}\n  \
         transforms: [{{selectFields: {{fields: [id, x]}}}}, {{autocache: {{}}}}, {{cast: {{field: x, dtype: float16}}}}]\n  \
         batchSize: 20\n  onError: skip\n  autoscaling: {{mode: BatchTime}}\n  \
         workers: {{min: 1, max: 2, {}}}\n  cache: {{mode: Always}}\n",
        seen_as.path, seen_as.fields
    );
    let dp: DataPipeline = stoker_api::from_yaml(&yaml)?;
    let pipelines = Api::<DataPipeline>::namespaced(client.clone(), &ns);
    pipelines.patch(NAME, &PatchParams::apply("e2e").force(), &Patch::Apply(&dp)).await?;

    // A trainer reading on, as long as the scenario runs.
    let options = reader_options(&client, &ns, NAME).await?;
    let reader = {
        let url = url.clone();
        tokio::spawn(async move {
            let mut trainer = Client::from_dispatcher(&url, options).await?;
            while let Some(batch) = trainer.next().await {
                batch?;
            }
            Ok::<_, stoker_client::Error>(())
        })
    };
    // One without a token, refused.
    let refused = Client::from_dispatcher(&url, ClientOptions::new(&ns, NAME)).await;
    ensure!(refused.is_err(), "a trainer without a token was let in");

    let prometheus = Prometheus::start(&cluster.workdir().join(format!("{ns}-prometheus")), &["operator", "workers"])
        .await
        .context("starting Prometheus (`make tools` installs Debian's prometheus)")?;
    let queries = dashboard::queries()?;
    let total = queries.len();
    // The queries without data yet: each round asks only these again.
    let waiting = tokio::sync::Mutex::new(queries);
    let result = wait_for(Duration::from_secs(180), "every dashboard query to return data", || {
        let (prometheus, waiting, kubelet, ns) = (&prometheus, &waiting, &kubelet, &ns);
        async move {
            let mut waiting = waiting.lock().await;
            // The leader and the workers now (workers come and go as the autoscaler decides).
            if let Some(leader) = cluster.operator_leader().await? {
                prometheus.set_targets("operator", &[cluster.operator_metrics_addr(&leader).await?])?;
            }
            prometheus.set_targets("workers", &worker_metrics(cluster, kubelet.as_ref(), ns).await?)?;
            let mut still = Vec::new();
            for q in waiting.drain(..) {
                let promql = dashboard::for_pipeline(&q.expr, ns, NAME, RATE_INTERVAL);
                if prometheus.query(&promql).await?.is_empty() {
                    still.push(q);
                }
            }
            *waiting = still;
            Ok(if waiting.is_empty() {
                Check::Done(())
            } else {
                let names: Vec<String> = waiting.iter().map(|q| format!("{:?}: {}", q.panel, q.expr)).collect();
                Check::not_yet(format!(
                    "{} of {total} queries without data:\n{}\ntargets: {:?}",
                    waiting.len(),
                    names.join("\n"),
                    prometheus.targets().await.unwrap_or_default()
                ))
            })
        }
    })
    .await;
    reader.abort();
    result?;
    println!("  {total} dashboard queries answered with data by a real Prometheus");
    drop(kubelet);
    delete_namespace(&client, &ns, Duration::from_secs(60)).await
}

/// The metrics endpoints of the namespace's workers: the harness's processes, or the pods'
/// addresses on the port the operator names.
async fn worker_metrics(
    cluster: &dyn Cluster,
    kubelet: Option<&stoker_e2e::kubelet::ProcessKubelet>,
    ns: &str,
) -> anyhow::Result<Vec<std::net::SocketAddr>> {
    if let Some(kubelet) = kubelet {
        return Ok(kubelet.metrics_addrs());
    }
    let pods: Api<k8s_openapi::api::core::v1::Pod> = Api::namespaced(cluster.client(), ns);
    let list = pods.list(&ListParams::default().labels("app.kubernetes.io/component=worker")).await?;
    Ok(list
        .items
        .into_iter()
        .filter_map(|p| p.status?.pod_ip?.parse().ok())
        .map(|ip| std::net::SocketAddr::new(ip, stoker_operator::controller::objects::METRICS_PORT as u16))
        .collect())
}
