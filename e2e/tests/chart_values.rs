//! The chart's values change the rendered objects as documented (no cluster needed, only helm).

use serde_json::Value;
use stoker_e2e::tools::{Cmd, tool, workspace_root};

async fn render(values: &[&str]) -> anyhow::Result<Vec<Value>> {
    let mut cmd = Cmd::new(tool("helm")?).current_dir(workspace_root()).args([
        "template",
        "stoker",
        "charts/stoker",
        "--namespace",
        "stoker-system",
    ]);
    for v in values {
        cmd = cmd.args(["--set", v]);
    }
    let text = cmd.stdout().await?;
    Ok(text
        .split("\n---")
        .filter_map(|doc| serde_yaml::from_str::<Value>(doc).ok())
        .filter(|v| v.is_object())
        .collect())
}

fn find<'a>(objects: &'a [Value], kind: &str) -> Option<&'a Value> {
    objects.iter().find(|o| o["kind"] == kind)
}

fn operator_args(objects: &[Value]) -> Vec<String> {
    let deployment = find(objects, "Deployment").expect("the operator Deployment");
    deployment["spec"]["template"]["spec"]["containers"][0]["args"]
        .as_array()
        .unwrap()
        .iter()
        .map(|a| a.as_str().unwrap().to_string())
        .collect()
}

#[tokio::test]
async fn defaults_run_two_elected_replicas_with_the_crd_kept() {
    let objects = render(&[]).await.unwrap();
    let deployment = find(&objects, "Deployment").unwrap();
    assert_eq!(deployment["spec"]["replicas"], 2);
    let args = operator_args(&objects);
    assert!(!args.contains(&"--leader-election=false".to_string()), "{args:?}");
    // The leader labels its pod, and the dispatcher Service routes by that label.
    assert!(args.contains(&"--mark-leader-pod=true".to_string()), "{args:?}");
    let dispatcher = objects
        .iter()
        .find(|o| o["kind"] == "Service" && o["metadata"]["name"] == "stoker-dispatcher")
        .expect("the dispatcher Service");
    assert_eq!(dispatcher["spec"]["selector"]["stoker.dev/leader"], "true");
    let crd = find(&objects, "CustomResourceDefinition").expect("the chart installs the CRD");
    assert_eq!(crd["metadata"]["annotations"]["helm.sh/resource-policy"], "keep");
    assert!(find(&objects, "ServiceMonitor").is_none());
    assert!(find(&objects, "PodMonitor").is_none());
    assert!(named(&objects, "ConfigMap", "stoker-dashboard").is_none(), "the dashboard is off by default");
}

#[tokio::test]
async fn values_reach_the_operator() {
    let objects = render(&[
        "leaderElection.enabled=false",
        "workerBudget=40",
        "namespaceWorkerCap=8",
        "logLevel=debug",
        "images.worker.repository=registry.example/worker",
        "images.worker.tag=v9",
        "serviceMonitor.enabled=true",
        "podMonitor.enabled=true",
        "dashboard.enabled=true",
        "dashboard.namespace=monitoring",
        "crds.install=false",
    ])
    .await
    .unwrap();
    assert_eq!(find(&objects, "Deployment").unwrap()["spec"]["replicas"], 1);
    let args = operator_args(&objects).join(" ");
    for expected in [
        "--leader-election=false",
        "--worker-budget 40",
        "--log-level debug",
        "--worker-image registry.example/worker:v9",
    ] {
        assert!(args.contains(expected), "{expected:?} in {args}");
    }
    let env = &find(&objects, "Deployment").unwrap()["spec"]["template"]["spec"]["containers"][0]["env"];
    let cap = env.as_array().unwrap().iter().find(|e| e["name"] == "STOKER_NAMESPACE_WORKER_CAP");
    assert_eq!(cap.map(|e| &e["value"]), Some(&Value::from("8")), "{env}");
    let operator = find(&objects, "ServiceMonitor").expect("a ServiceMonitor");
    // The workers' PodMonitor selects the pods the operator labels, on the port it names.
    let workers = find(&objects, "PodMonitor").expect("a PodMonitor");
    assert_eq!(workers["spec"]["selector"]["matchLabels"]["app.kubernetes.io/name"], "stoker-worker");
    assert_eq!(workers["spec"]["podMetricsEndpoints"][0]["port"], "metrics");
    // Both keep the series' own namespace label (the pipeline's), which the dashboard selects on.
    assert_eq!(operator["spec"]["endpoints"][0]["honorLabels"], true);
    assert_eq!(workers["spec"]["podMetricsEndpoints"][0]["honorLabels"], true);
    // The dashboard, for Grafana's sidecar, where it looks, holding the file as it is.
    let dashboard = named(&objects, "ConfigMap", "stoker-dashboard").expect("the dashboard ConfigMap");
    assert_eq!(dashboard["metadata"]["namespace"], "monitoring");
    assert_eq!(dashboard["metadata"]["labels"]["grafana_dashboard"], "1");
    let json: Value = serde_json::from_str(dashboard["data"]["stoker-pipelines.json"].as_str().unwrap()).unwrap();
    let file = std::fs::read_to_string(workspace_root().join("charts/stoker/files/dashboards/stoker-pipelines.json"));
    assert_eq!(json, serde_json::from_str::<Value>(&file.unwrap()).unwrap());
    assert!(find(&objects, "CustomResourceDefinition").is_none());
}

#[tokio::test]
async fn the_values_schema_refuses_bad_values() {
    for bad in ["logFormat=xml", "workerBudget=-1", "namespaceWorkerCap=-1", "replicaCount=0"] {
        let err = render(&[bad]).await.expect_err(bad);
        assert!(format!("{err:#}").contains("values don't meet the specifications of the schema"), "{bad}: {err:#}");
    }
}

fn named<'a>(objects: &'a [Value], kind: &str, name: &str) -> Option<&'a Value> {
    objects.iter().find(|o| o["kind"] == kind && o["metadata"]["name"] == name)
}

#[tokio::test]
async fn tls_self_signed_makes_a_ca_and_a_dispatcher_certificate_the_operator_mounts() {
    let off = render(&[]).await.unwrap();
    assert!(named(&off, "Secret", "stoker-ca-key").is_none(), "off by default");
    assert!(!operator_args(&off).iter().any(|a| a.starts_with("--tls")));

    let objects = render(&["tls.enabled=true"]).await.unwrap();
    let args = operator_args(&objects);
    for flag in ["--tls-cert-file=", "--tls-key-file=", "--tls-ca-cert-file=", "--tls-ca-key-file="] {
        assert!(args.iter().any(|a| a.starts_with(flag)), "{flag} in {args:?}");
    }
    assert!(args.contains(&"https://stoker-dispatcher.stoker-system.svc:50051".to_string()), "{args:?}");
    let ca = named(&objects, "Secret", "stoker-ca-key").expect("the CA, key included, for the operator only");
    let dispatcher = named(&objects, "Secret", "stoker-dispatcher-tls").expect("the dispatcher's certificate");
    assert_eq!(ca["data"]["tls.crt"], dispatcher["data"]["ca.crt"], "issued by that CA");
    let published = named(&objects, "ConfigMap", "stoker-ca").expect("the CA for clients");
    assert!(published["data"]["ca.crt"].as_str().unwrap().contains("BEGIN CERTIFICATE"));
    assert!(!published["data"].to_string().contains("PRIVATE KEY"), "no key where clients copy from");
    let pod = &find(&objects, "Deployment").unwrap()["spec"]["template"]["spec"];
    let secrets: Vec<&str> =
        pod["volumes"].as_array().unwrap().iter().filter_map(|v| v["secret"]["secretName"].as_str()).collect();
    assert_eq!(secrets, ["stoker-dispatcher-tls", "stoker-ca-key"]);
    let role = named(&objects, "ClusterRole", "stoker").unwrap().to_string();
    assert!(role.contains("\"secrets\""), "the operator writes worker certificates: {role}");
}

#[tokio::test]
async fn tls_cert_manager_asks_the_issuer_for_both_certificates() {
    let objects = render(&[
        "tls.enabled=true",
        "tls.mode=certManager",
        "tls.issuerRef.name=corp",
        "tls.issuerRef.kind=ClusterIssuer",
    ])
    .await
    .unwrap();
    let dispatcher = named(&objects, "Certificate", "stoker-dispatcher").expect("the dispatcher's Certificate");
    assert_eq!(dispatcher["spec"]["secretName"], "stoker-dispatcher-tls");
    assert_eq!(dispatcher["spec"]["issuerRef"]["name"], "corp");
    assert!(dispatcher["spec"]["dnsNames"].to_string().contains("stoker-dispatcher.stoker-system.svc"));
    let ca = named(&objects, "Certificate", "stoker-workers-ca").expect("a CA for workers");
    assert_eq!(
        (ca["spec"]["isCA"].as_bool(), ca["spec"]["privateKey"]["encoding"].as_str()),
        (Some(true), Some("PKCS8"))
    );
    assert!(named(&objects, "Secret", "stoker-ca-key").is_none(), "cert-manager writes it");
    let args = operator_args(&objects);
    assert!(args.contains(&"--tls-ca-bundle-file=/etc/stoker/tls/dispatcher/ca.crt".to_string()), "{args:?}");
    assert!(render(&["tls.enabled=true", "tls.mode=certManager"]).await.is_err(), "an issuer is required");
}

#[tokio::test]
async fn auth_and_network_policy_values_reach_the_operator_and_its_rights() {
    let rules = |objects: &[Value]| {
        named(objects, "ClusterRole", "stoker").expect("the operator's ClusterRole")["rules"].to_string()
    };
    let defaults = render(&[]).await.unwrap();
    let args = operator_args(&defaults).join(" ");
    assert!(args.contains("--authentication \"kubernetes\"") || args.contains("--authentication kubernetes"), "{args}");
    assert!(!args.contains("--network-policy"), "{args}");
    assert!(rules(&defaults).contains("tokenreviews") && rules(&defaults).contains("subjectaccessreviews"));
    assert!(!rules(&defaults).contains("networkpolicies"));
    let consumer = named(&defaults, "ClusterRole", "stoker-consumer").expect("the consumer role");
    assert_eq!(consumer["metadata"]["labels"]["rbac.authorization.k8s.io/aggregate-to-edit"], "true");
    assert!(consumer["rules"].to_string().contains("datapipelines/stream"));

    let changed =
        render(&["auth.mode=none", "networkPolicy.enabled=true", "auth.consumerRole.create=false"]).await.unwrap();
    let args = operator_args(&changed).join(" ");
    assert!(args.contains("none") && args.contains("--network-policy=true"), "{args}");
    assert!(!rules(&changed).contains("tokenreviews"), "no review rights without authentication");
    assert!(rules(&changed).contains("networkpolicies"));
    assert!(named(&changed, "ClusterRole", "stoker-consumer").is_none());
    assert!(render(&["auth.mode=maybe"]).await.is_err(), "the schema refuses unknown modes");

    // `helm upgrade --reuse-values` from a release made before these keys existed: the chart
    // renders with the defaults instead of failing on a missing key.
    let old = ["auth=null", "tls=null", "networkPolicy=null", "namespaceWorkerCap=null"];
    let upgraded = render(&old).await.unwrap();
    let args = operator_args(&upgraded).join(" ");
    assert!(args.contains("kubernetes") && args.contains("stoker.dev") && !args.contains("--tls"), "{args}");
    assert!(rules(&upgraded).contains("tokenreviews"));
    assert!(named(&upgraded, "ClusterRole", "stoker-consumer").is_some());
}
