//! Transport security through a real API server: the operator serves the dispatcher over TLS
//! and, from the CA it is given, issues each pipeline's workers a certificate for their
//! Service (a Secret in the pipeline's namespace, mounted into the worker pods), so a training
//! client that trusts the CA reads every element over TLS, and one that does not, or that
//! speaks plaintext, is refused.
//!
//! Local provider: the operator runs with the TLS flags and the harness's kubelet mounts the
//! Secret. Real pods: the chart's own TLS (`tls.enabled`, a self-signed CA the chart makes) is
//! turned on with `helm upgrade`, the client trusts the CA the chart publishes and, dialling
//! the dispatcher by its cluster IP, verifies it as its Service's name (`tls_server_name`);
//! the chart's TLS is turned off again afterwards.

use std::collections::BTreeMap;
use std::time::Duration;

use anyhow::{Context as _, ensure};
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{ConfigMap, Secret, Service};
use kube::api::{Api, ListParams};
use stoker_client::{Client, ClientOptions};
use stoker_e2e::k8s::{delete_namespace, fresh_namespace, ids_pipeline, wait_until_made};
use stoker_e2e::tools::workspace_root;
use stoker_e2e::{Cluster, OPERATOR_NAMESPACE, OperatorOptions, RELEASE};
use stoker_operator::tls::Ca;

const NAME: &str = "private";
const ROWS: i64 = 200;

/// A CA, and the dispatcher's certificate from it for this machine's loopback, as files.
struct Pki {
    ca_cert: std::path::PathBuf,
    ca_key: std::path::PathBuf,
    cert: std::path::PathBuf,
    key: std::path::PathBuf,
}

fn pki(dir: &std::path::Path, name: &str) -> anyhow::Result<Pki> {
    std::fs::create_dir_all(dir)?;
    let valid = Duration::from_secs(24 * 3600);
    let (ca, ca_key_pem) = Ca::generate(&format!("e2e {name} CA"), valid)?;
    let issued = ca.issue(&["127.0.0.1".into(), "localhost".into()], valid)?;
    let pki = Pki {
        ca_cert: dir.join(format!("{name}-ca.crt")),
        ca_key: dir.join(format!("{name}-ca.key")),
        cert: dir.join(format!("{name}-dispatcher.crt")),
        key: dir.join(format!("{name}-dispatcher.key")),
    };
    std::fs::write(&pki.ca_cert, ca.cert_pem())?;
    std::fs::write(&pki.ca_key, ca_key_pem)?;
    std::fs::write(&pki.cert, &issued.cert_pem)?;
    std::fs::write(&pki.key, &issued.key_pem)?;
    Ok(pki)
}

pub async fn tls_end_to_end(cluster: &dyn Cluster) -> anyhow::Result<()> {
    let dir = cluster.workdir().join("tls");
    let theirs = pki(&dir, "theirs")?;
    if cluster.provider().real_pods() {
        return chart_tls(cluster, &dir, &theirs).await;
    }
    let ours = pki(&dir, "ours")?;
    let flag = |name: &str, path: &std::path::Path| format!("--{name}={}", path.display());
    // Running operators keep their flags: stop them, and start them again with TLS.
    cluster.operator_stop().await?;
    cluster
        .operator_start(
            OperatorOptions::default()
                .arg(flag("tls-cert-file", &ours.cert))
                .arg(flag("tls-key-file", &ours.key))
                .arg(flag("tls-ca-cert-file", &ours.ca_cert))
                .arg(flag("tls-ca-key-file", &ours.ca_key)),
        )
        .await?;
    let result = scenario(cluster, &ours.ca_cert, &theirs.ca_cert, None).await;
    // The scenarios after this one run with a plaintext operator.
    cluster.operator_stop().await?;
    cluster.operator_start(OperatorOptions::default()).await?;
    result
}

/// The chart's TLS on real pods: `helm upgrade --set tls.enabled=true` rolls the operator onto
/// the chart's self-signed CA; clients trust the CA from the `<release>-ca` ConfigMap.
async fn chart_tls(cluster: &dyn Cluster, dir: &std::path::Path, theirs: &Pki) -> anyhow::Result<()> {
    let result = async {
        helm_tls(cluster, true).await?;
        let client = cluster.client();
        let services = Api::<Service>::namespaced(client.clone(), OPERATOR_NAMESPACE);
        let selector = format!("app.kubernetes.io/instance={RELEASE},app.kubernetes.io/component=dispatcher");
        let listed = services.list(&ListParams::default().labels(&selector)).await?;
        let service = listed.items.first().and_then(|s| s.metadata.name.clone()).context("the dispatcher Service")?;
        let maps = Api::<ConfigMap>::namespaced(client.clone(), OPERATOR_NAMESPACE);
        let published = maps.get(&format!("{RELEASE}-ca")).await?.data.unwrap_or_default();
        let ca = dir.join("chart-ca.crt");
        std::fs::write(&ca, published.get("ca.crt").context("ca.crt in the chart's CA ConfigMap")?)?;
        let name = format!("{service}.{OPERATOR_NAMESPACE}.svc");
        scenario(cluster, &ca, &theirs.ca_cert, Some(name.clone())).await?;
        eprintln!("  the chart's TLS: an epoch over TLS from its self-signed CA, the dispatcher verified as {name}");
        anyhow::Ok(())
    }
    .await;
    // The scenarios after this one run with a plaintext operator.
    let off = helm_tls(cluster, false).await;
    result.and(off)
}

/// Turns the chart's TLS on or off and waits for the rolled operator to lead again.
async fn helm_tls(cluster: &dyn Cluster, on: bool) -> anyhow::Result<()> {
    let chart = workspace_root().join("charts/stoker").display().to_string();
    let value = format!("tls.enabled={on}");
    let args = ["upgrade", RELEASE, &chart, "-n", OPERATOR_NAMESPACE, "--reuse-values", "--set", &value];
    let mut args = args.to_vec();
    // Earlier scenarios edit the release's objects as other tools would (the tenancy scenario
    // replaces the ClusterRole's rules, the harness scales the Deployment), so Helm's
    // server-side apply finds those fields owned by other managers: take them back.
    args.extend(["--force-conflicts", "--wait", "--timeout", "5m"]);
    cluster.helm(&args).await.with_context(|| format!("helm upgrade --set {value}"))?;
    cluster.chart_operator()?.wait(None).await?;
    super::operator::leader(cluster, None).await.with_context(|| format!("a leader after {value}"))?;
    Ok(())
}

/// A pipeline read over TLS by a client trusting `ca` (verifying the dispatcher as
/// `server_name` when given), and refused to one trusting `other_ca` or speaking plaintext.
async fn scenario(
    cluster: &dyn Cluster,
    ca: &std::path::Path,
    other_ca: &std::path::Path,
    server_name: Option<String>,
) -> anyhow::Result<()> {
    let client = cluster.client();
    let ns = fresh_namespace(&client, "e2e-tls").await?;
    let kubelet = cluster.run_workers(&ns)?;
    ids_pipeline(cluster, &ns, NAME, ROWS).await?;

    // The operator issued the workers a certificate for their Service, from the CA, and the
    // pods mount it.
    let secrets = Api::<Secret>::namespaced(client.clone(), &ns);
    let secret = wait_until_made(&secrets, &format!("{NAME}-workers-tls"), Duration::from_secs(60)).await?;
    let data = secret.data.unwrap_or_default();
    let ca_in_secret = data.get("ca.crt").map(|b| String::from_utf8_lossy(&b.0).into_owned()).unwrap_or_default();
    ensure!(ca_in_secret.contains(std::fs::read_to_string(ca)?.trim()), "the workers trust the CA: {ca_in_secret}");
    ensure!(data.contains_key("tls.crt") && data.contains_key("tls.key"), "a certificate and key: {:?}", data.keys());
    // The Secret is applied before the Deployment: wait for that too.
    let deployments = Api::<Deployment>::namespaced(client.clone(), &ns);
    let deployment = wait_until_made(&deployments, &format!("{NAME}-workers"), Duration::from_secs(60)).await?;
    let pod = deployment.spec.template.spec.context("a pod template")?;
    ensure!(
        pod.volumes
            .iter()
            .flatten()
            .any(|v| v.secret.as_ref().and_then(|s| s.secret_name.as_deref()) == Some(&format!("{NAME}-workers-tls"))),
        "the worker pods mount the certificate"
    );

    // A trainer trusting our CA reads a whole epoch, every element once, over TLS.
    let url = cluster.dispatcher_url()?;
    let https = url.replacen("http://", "https://", 1);
    let mut options: ClientOptions = stoker_e2e::tenants::reader_options(&client, &ns, NAME).await?;
    options.tls_ca = Some(ca.to_path_buf());
    options.tls_server_name = server_name;
    let mut trainer = Client::from_dispatcher(&https, options.clone()).await.context("the trainer over TLS")?;
    let mut ids: BTreeMap<i64, u32> = BTreeMap::new();
    tokio::time::timeout(Duration::from_secs(90), async {
        while ids.len() < ROWS as usize {
            let batch = trainer.next().await.context("the stream ended")??;
            if batch.epoch == 0 {
                for c in batch.tensors["id"].data.chunks(8) {
                    *ids.entry(i64::from_le_bytes(c.try_into()?)).or_default() += 1;
                }
            }
        }
        anyhow::Ok(())
    })
    .await
    .context("epoch 0 within 90 s over TLS")??;
    ensure!(ids.values().all(|n| *n == 1) && ids.len() == ROWS as usize, "every element once: {ids:?}");
    drop(trainer);

    // Refused: a client trusting another CA, and one speaking plaintext.
    let mut stranger = options.clone();
    stranger.tls_ca = Some(other_ca.to_path_buf());
    match Client::from_dispatcher(&https, stranger).await {
        Err(e) => ensure!(format!("{e}").to_lowercase().contains("certificate"), "another CA: {e}"),
        Ok(_) => anyhow::bail!("a client trusting another CA connected"),
    }
    let mut plaintext = options;
    plaintext.tls_ca = None;
    ensure!(Client::from_dispatcher(&url, plaintext).await.is_err(), "a plaintext client connected");

    drop(kubelet);
    delete_namespace(&client, &ns, Duration::from_secs(120)).await
}
