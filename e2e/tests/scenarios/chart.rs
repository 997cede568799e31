//! The Helm chart: lints, installs, creates what the operator needs with least privilege and
//! hardened pods, and matches the rendered bundle in manifests/install.yaml.

use std::time::Duration;

use anyhow::{Context as _, bail, ensure};
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{Pod, SecurityContext, Service, ServiceAccount};
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::api::{Api, ListParams};
use serde_json::Value;
use stoker_e2e::k8s::{first_difference, service_account_can, yaml_documents};
use stoker_e2e::tools::workspace_root;
use stoker_e2e::{CRD_NAME, Check, Cluster, OPERATOR_NAMESPACE, RELEASE, wait_for};

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
    ];
    let must_not = [
        ("update", "leases.coordination.k8s.io", Some("kube-system")),
        ("create", "clusterrolebindings.rbac.authorization.k8s.io", None),
        ("delete", "nodes", None),
        ("delete", "namespaces", None),
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
    wait_for(Duration::from_secs(120), "the 2 operator pods to be created", || async {
        let list = pods.list(&ListParams::default().labels(&selector)).await?;
        let phases: Vec<String> =
            list.items.iter().map(|p| p.status.as_ref().and_then(|s| s.phase.clone()).unwrap_or_default()).collect();
        let enough = if provider.real_pods() {
            phases.iter().filter(|p| *p == "Running").count() == 2
        } else {
            phases.len() == 2
        };
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
