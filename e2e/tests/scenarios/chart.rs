//! The Helm chart: lints, installs, creates what the operator needs with least privilege and
//! hardened pods, and matches the rendered bundle in manifests/install.yaml; upgrades roll the
//! operator, and uninstalling it keeps the CRD, the pipelines and the cache claims.

use std::time::Duration;

use anyhow::{Context as _, bail, ensure};
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{PersistentVolumeClaim, Pod, SecurityContext, Service, ServiceAccount};
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::api::{Api, ListParams};
use serde_json::Value;
use stoker_e2e::k8s::{delete_namespace, first_difference, fresh_namespace, service_account_can, yaml_documents};
use stoker_e2e::tools::workspace_root;
use stoker_e2e::{CRD_NAME, Check, Cluster, OPERATOR_NAMESPACE, OperatorOptions, RELEASE, wait_for};

const TIMEOUT: Duration = Duration::from_secs(60);

pub async fn chart_installs(cluster: &dyn Cluster) -> anyhow::Result<()> {
    let root = workspace_root();
    let chart = root.join("charts/stoker");
    ensure!(
        chart.join("Chart.yaml").exists(),
        "{} does not exist: the Helm chart is missing",
        chart.join("Chart.yaml").display()
    );
    let chart_arg = chart.display().to_string();

    cluster.helm(&["lint", &chart_arg]).await.context("helm lint charts/stoker")?;

    // The rendered bundle is generated from the chart and must be up to date.
    let rendered = cluster
        .helm(&["template", RELEASE, &chart_arg, "--namespace", OPERATOR_NAMESPACE])
        .await
        .context("helm template")?;
    let bundle_path = root.join("manifests/install.yaml");
    let bundle = std::fs::read_to_string(&bundle_path).unwrap_or_default();
    if let Some(diff) = first_difference(&bundle, &rendered) {
        bail!(
            "manifests/install.yaml is stale: it differs from what `helm template {RELEASE} charts/stoker --namespace \
             {OPERATOR_NAMESPACE}` renders now (install.yaml vs. the render: {diff}); run `make generate`"
        );
    }

    // Install (the kind provider already did, with its e2e image tags).
    if cluster.chart_preinstalled() {
        cluster.helm(&["status", RELEASE, "-n", OPERATOR_NAMESPACE]).await.context("helm status")?;
    } else {
        cluster
            .helm(&["install", RELEASE, &chart_arg, "-n", OPERATOR_NAMESPACE, "--create-namespace", "--wait=false"])
            .await
            .context("helm install")?;
    }
    let client = cluster.client();

    // The CRD is established.
    let crds: Api<CustomResourceDefinition> = Api::all(client.clone());
    wait_for(TIMEOUT, format!("CRD {CRD_NAME} to be Established"), || async {
        let crd = crds.get(CRD_NAME).await?;
        let conditions = crd.status.and_then(|s| s.conditions).unwrap_or_default();
        Ok(if conditions.iter().any(|c| c.type_ == "Established" && c.status == "True") {
            Check::Done(())
        } else {
            Check::not_yet(format!(
                "conditions {:?}",
                conditions.iter().map(|c| (&c.type_, &c.status)).collect::<Vec<_>>()
            ))
        })
    })
    .await?;

    // What the release consists of.
    let manifest = cluster.helm(&["get", "manifest", RELEASE, "-n", OPERATOR_NAMESPACE]).await?;
    let objects = yaml_documents(&manifest)?;
    let has = |kind: &str| objects.iter().filter(|o| o["kind"] == kind).count();
    for kind in [
        "CustomResourceDefinition",
        "Deployment",
        "ServiceAccount",
        "ClusterRole",
        "ClusterRoleBinding",
        "Role",
        "RoleBinding",
    ] {
        ensure!(has(kind) >= 1, "the release has no {kind}; it has: {:?}", kinds(&objects));
    }
    let role_has_leases = objects.iter().filter(|o| o["kind"] == "Role").any(|role| {
        role["rules"].as_array().into_iter().flatten().any(|rule| {
            rule["apiGroups"].as_array().is_some_and(|g| g.iter().any(|g| g == "coordination.k8s.io"))
                && rule["resources"].as_array().is_some_and(|r| r.iter().any(|r| r == "leases"))
        })
    });
    ensure!(role_has_leases, "no Role of the release grants access to coordination.k8s.io leases");

    // The objects exist in the cluster.
    let services: Api<Service> = Api::namespaced(client.clone(), OPERATOR_NAMESPACE);
    for name in ["stoker-dispatcher", "stoker-metrics"] {
        services.get(name).await.with_context(|| format!("Service {OPERATOR_NAMESPACE}/{name}"))?;
    }
    let deployments: Vec<&str> =
        objects.iter().filter(|o| o["kind"] == "Deployment").filter_map(|o| o["metadata"]["name"].as_str()).collect();
    ensure!(deployments.len() == 1, "the release should have one Deployment (the operator), has {deployments:?}");
    let deployment = Api::<Deployment>::namespaced(client.clone(), OPERATOR_NAMESPACE)
        .get(deployments[0])
        .await
        .with_context(|| format!("Deployment {OPERATOR_NAMESPACE}/{}", deployments[0]))?;
    ensure!(
        deployment.spec.replicas == Some(2),
        "the operator Deployment should run 2 replicas (one leads, one stands by), has {:?}",
        deployment.spec.replicas
    );
    let pod_spec = deployment.spec.template.spec.clone().context("the operator Deployment has no pod spec")?;
    let sa_name = pod_spec.service_account_name.clone().context("the operator pods name no serviceAccountName")?;
    Api::<ServiceAccount>::namespaced(client.clone(), OPERATOR_NAMESPACE)
        .get(&sa_name)
        .await
        .with_context(|| format!("ServiceAccount {OPERATOR_NAMESPACE}/{sa_name}"))?;

    // Hardened pods: non-root, read-only root filesystem, for every container.
    let pod_nonroot = pod_spec.security_context.as_ref().and_then(|s| s.run_as_non_root);
    let containers = pod_spec.containers.iter().chain(pod_spec.init_containers.iter().flatten());
    for c in containers {
        let sc = c.security_context.clone().unwrap_or_else(SecurityContext::default);
        let non_root = sc.run_as_non_root.or(pod_nonroot);
        ensure!(
            non_root == Some(true),
            "container {} of the operator pod must run with runAsNonRoot: true (pod or container)",
            c.name
        );
        let uid = sc.run_as_user.or(pod_spec.security_context.as_ref().and_then(|s| s.run_as_user));
        ensure!(uid != Some(0), "container {} of the operator pod runs as uid 0", c.name);
        ensure!(
            sc.read_only_root_filesystem == Some(true),
            "container {} of the operator pod must set readOnlyRootFilesystem: true",
            c.name
        );
    }

    // Least privilege, asked of the RBAC authorizer for the operator's ServiceAccount.
    let sa = (OPERATOR_NAMESPACE, sa_name.as_str());
    let must = [
        ("list", "datapipelines.stoker.dev", None),
        ("watch", "datapipelines.stoker.dev", None),
        ("patch", "datapipelines.stoker.dev/status", Some("team-a")),
        ("patch", "deployments.apps", Some("team-a")),
        ("patch", "services", Some("team-a")),
        ("create", "persistentvolumeclaims", Some("team-a")),
        ("get", "leases.coordination.k8s.io", Some(OPERATOR_NAMESPACE)),
        ("create", "leases.coordination.k8s.io", Some(OPERATOR_NAMESPACE)),
        ("update", "leases.coordination.k8s.io", Some(OPERATOR_NAMESPACE)),
        // The leader labels its own pod, which the dispatcher Service selects.
        ("patch", "pods", Some(OPERATOR_NAMESPACE)),
        // The dispatcher's access checks (docs/security.md).
        ("create", "tokenreviews.authentication.k8s.io", None),
        ("create", "subjectaccessreviews.authorization.k8s.io", None),
    ];
    let must_not = [
        ("update", "leases.coordination.k8s.io", Some("kube-system")),
        ("create", "clusterrolebindings.rbac.authorization.k8s.io", None),
        ("delete", "nodes", None),
        ("delete", "namespaces", None),
        ("patch", "pods", Some("team-a")),
    ];
    let mut problems = Vec::new();
    for (verb, resource, ns) in must {
        if !service_account_can(&client, sa, verb, resource, ns).await? {
            problems.push(format!("cannot {verb} {resource} in {}", ns.unwrap_or("all namespaces")));
        }
    }
    for (verb, resource, ns) in must_not {
        if service_account_can(&client, sa, verb, resource, ns).await? {
            problems.push(format!("can {verb} {resource} in {} but should not", ns.unwrap_or("all namespaces")));
        }
    }
    let events_core = service_account_can(&client, sa, "create", "events", Some("team-a")).await?;
    let events_new = service_account_can(&client, sa, "create", "events.events.k8s.io", Some("team-a")).await?;
    if !events_core && !events_new {
        problems.push("cannot create events (neither core nor events.k8s.io) in team-a".into());
    }
    ensure!(problems.is_empty(), "RBAC of ServiceAccount {OPERATOR_NAMESPACE}/{sa_name}:\n  {}", problems.join("\n  "));

    // The consumer role is aggregated into `edit`: whoever may edit a namespace may read its
    // pipelines (the controller manager's aggregation controller fills `edit` in).
    let roles = Api::<k8s_openapi::api::rbac::v1::ClusterRole>::all(client.clone());
    wait_for(Duration::from_secs(60), "ClusterRole edit to include get on datapipelines/stream", || {
        let roles = roles.clone();
        async move {
            let edit = roles.get("edit").await?;
            let has = edit.rules.iter().flatten().any(|r| {
                r.resources.iter().flatten().any(|res| res == "datapipelines/stream")
                    && r.verbs.iter().any(|v| v == "get")
            });
            Ok(if has { Check::Done(()) } else { Check::not_yet("not aggregated yet") })
        }
    })
    .await?;

    // The pod template is admissible: the Deployment's pods get created (and, on kind, run).
    let selector = deployment
        .spec
        .selector
        .match_labels
        .clone()
        .unwrap_or_default()
        .iter()
        .map(|(k, v)| format!("{k}={v}"))
        .collect::<Vec<_>>()
        .join(",");
    let pods: Api<Pod> = Api::namespaced(client.clone(), OPERATOR_NAMESPACE);
    let provider = cluster.provider();
    // On real pods both are Ready, the standby too: otherwise a rollout (and `helm --wait`)
    // never finishes.
    let what =
        if provider.real_pods() { "the 2 operator pods to be Ready" } else { "the 2 operator pods to be created" };
    wait_for(Duration::from_secs(120), what, || async {
        let list = pods.list(&ListParams::default().labels(&selector)).await?;
        let ready = |p: &Pod| {
            p.status
                .iter()
                .flat_map(|s| s.conditions.iter().flatten())
                .any(|c| c.type_ == "Ready" && c.status == "True")
        };
        let phases: Vec<String> = list
            .items
            .iter()
            .map(|p| {
                let phase = p.status.as_ref().and_then(|s| s.phase.clone()).unwrap_or_default();
                if ready(p) { format!("{phase} Ready") } else { phase }
            })
            .collect();
        let enough =
            if provider.real_pods() { list.items.iter().filter(|p| ready(p)).count() == 2 } else { phases.len() == 2 };
        Ok(if enough { Check::Done(()) } else { Check::not_yet(format!("pods: {phases:?}")) })
    })
    .await?;
    Ok(())
}

fn kinds(objects: &[Value]) -> Vec<String> {
    objects
        .iter()
        .map(|o| format!("{}/{}", o["kind"].as_str().unwrap_or("?"), o["metadata"]["name"].as_str().unwrap_or("?")))
        .collect()
}

/// `helm upgrade` rolls the operator and it goes on reconciling; `helm uninstall` removes the
/// operator but leaves the CRD, the DataPipelines and the namespaces' cache claims (the data a
/// user would lose is never the chart's to delete). The chart is installed again at the end.
/// Runs last: the reinstalled dispatcher Service gets a new cluster IP.
pub async fn chart_upgrade_and_uninstall(cluster: &dyn Cluster) -> anyhow::Result<()> {
    let real = cluster.provider().real_pods();
    let chart = workspace_root().join("charts/stoker").display().to_string();
    cluster.operator_start(OperatorOptions::default().replicas(2)).await?;
    let client = cluster.client();
    let ns = fresh_namespace(&client, "e2e-chart-life").await?;
    let kubelet = cluster.run_workers(&ns)?;
    let data = cluster.workdir().join(format!("{ns}-data"));
    std::fs::create_dir_all(&data)?;
    std::fs::write(data.join("0.jsonl"), (0..100).map(|i| format!("{{\"id\": {i}}}\n")).collect::<String>())?;
    let seen_as = cluster.worker_data(&data);
    let pipeline = |replicas: u32| {
        format!(
            "apiVersion: stoker.dev/v1alpha1\nkind: DataPipeline\nmetadata: {{name: {LIFE}}}\nspec:\n  \
             source: {{uri: 'file://{}/', format: jsonl}}\n  transforms: [{{selectFields: {{fields: [id]}}}}, {{autocache: {{}}}}]\n  batchSize: 10\n  \
             autoscaling: {{mode: Fixed, replicas: {replicas}}}\n  cache: {{mode: Always}}\n  workers: {{{}}}\n",
            seen_as.path, seen_as.fields
        )
    };
    cluster.kubectl_stdin(&["apply", "-n", &ns, "-f", "-"], &pipeline(1)).await?;
    let deployments: Api<Deployment> = Api::namespaced(client.clone(), &ns);
    let claims: Api<PersistentVolumeClaim> = Api::namespaced(client.clone(), &ns);
    wait_for(TIMEOUT, "the pipeline's workers Deployment and the namespace's cache claim", || async {
        let workers = deployments.get_opt(&format!("{LIFE}-workers")).await?;
        let claim = claims.get_opt("stoker-cache").await?;
        Ok(if workers.is_some() && claim.is_some() {
            Check::Done(())
        } else {
            let dp = Api::<stoker_api::DataPipeline>::namespaced(client.clone(), &ns).get(LIFE).await?;
            Check::not_yet(format!(
                "workers Deployment {}, cache claim {}, pipeline status {:?}",
                workers.is_some(),
                claim.is_some(),
                dp.status
            ))
        })
    })
    .await?;

    // Upgrade with a changed value: the operator pods roll and the new ones reconcile.
    let pods: Api<Pod> = Api::namespaced(client.clone(), OPERATOR_NAMESPACE);
    let operator_pods = || async {
        let selector = cluster.chart_operator()?.selector().await?;
        let list = pods.list(&ListParams::default().labels(&selector)).await?;
        // Not those still terminating: `helm --wait` returns once the new ones are Ready.
        let live = list.items.into_iter().filter(|p| p.metadata.deletion_timestamp.is_none());
        anyhow::Ok(live.filter_map(|p| p.metadata.name).collect::<Vec<_>>())
    };
    let before = if real { operator_pods().await? } else { Vec::new() };
    let wait = if real { ["--wait", "--timeout", "5m"].as_slice() } else { ["--wait=false"].as_slice() };
    let mut args =
        vec!["upgrade", RELEASE, &chart, "-n", OPERATOR_NAMESPACE, "--reuse-values", "--set", "logLevel=debug"];
    args.extend(wait);
    cluster.helm(&args).await.context("helm upgrade")?;
    let deployment = stoker_e2e::k8s::release_deployment(cluster).await?;
    let operator = Api::<Deployment>::namespaced(client.clone(), OPERATOR_NAMESPACE).get(&deployment).await?;
    let container = operator.spec.template.spec.map(|s| s.containers).unwrap_or_default();
    let args = container.first().and_then(|c| c.args.clone()).unwrap_or_default();
    ensure!(args.windows(2).any(|w| w == ["--log-level", "debug"]), "the upgrade reached the operator: {args:?}");
    if real {
        cluster.chart_operator()?.wait(None).await?;
        let after = operator_pods().await?;
        ensure!(after.iter().all(|p| !before.contains(p)), "the upgrade rolled every pod: {before:?} -> {after:?}");
        super::operator::leader(cluster, None).await.context("a leader after the upgrade")?;
    }
    cluster.kubectl_stdin(&["apply", "-n", &ns, "-f", "-"], &pipeline(2)).await?;
    wait_for(TIMEOUT, "the upgraded operator to scale the workers to 2", || async {
        let workers = deployments.get(&format!("{LIFE}-workers")).await?;
        let replicas = workers.spec.replicas;
        Ok(if replicas == Some(2) { Check::Done(()) } else { Check::not_yet(format!("replicas {replicas:?}")) })
    })
    .await?;

    // Uninstall: the operator goes; the CRD, the pipeline and the cache claim stay.
    cluster.helm(&["uninstall", RELEASE, "-n", OPERATOR_NAMESPACE]).await.context("helm uninstall")?;
    let operators: Api<Deployment> = Api::namespaced(client.clone(), OPERATOR_NAMESPACE);
    stoker_e2e::k8s::wait_until_gone(&operators, &deployment, Duration::from_secs(120)).await?;
    if real {
        wait_for(Duration::from_secs(120), "the operator pods to go", || async {
            let left = pods.list(&ListParams::default().labels("app.kubernetes.io/name=stoker")).await?.items.len();
            Ok(if left == 0 { Check::Done(()) } else { Check::not_yet(format!("{left} operator pods")) })
        })
        .await?;
    }
    Api::<CustomResourceDefinition>::all(client.clone()).get(CRD_NAME).await.context("the CRD after uninstall")?;
    Api::<stoker_api::DataPipeline>::namespaced(client.clone(), &ns)
        .get(LIFE)
        .await
        .context("the DataPipeline after uninstall")?;
    let claim = claims.get("stoker-cache").await.context("the cache claim after uninstall")?;
    ensure!(claim.metadata.deletion_timestamp.is_none(), "the cache claim is being deleted");

    // Install again: it adopts the CRD it left behind and leads again.
    if real {
        stoker_e2e::in_cluster::install_chart(cluster, &[], true).await.context("installing the chart again")?;
        super::operator::leader(cluster, None).await?;
    } else {
        let args = ["install", RELEASE, &chart, "-n", OPERATOR_NAMESPACE, "--wait=false"];
        cluster.helm(&args).await.context("installing the chart again")?;
    }
    drop(kubelet);
    // Real pods terminate gracefully first, and the namespace controller backs off between
    // attempts while they do: a namespace with workers took over 120 s to go in CI.
    let bound = if real { Duration::from_secs(300) } else { Duration::from_secs(120) };
    delete_namespace(&client, &ns, bound).await
}

/// The pipeline of [`chart_upgrade_and_uninstall`].
const LIFE: &str = "outlives-the-chart";
