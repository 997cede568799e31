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
    assert!(find(&objects, "ServiceMonitor").is_some());
    assert!(find(&objects, "CustomResourceDefinition").is_none());
}

#[tokio::test]
async fn the_values_schema_refuses_bad_values() {
    for bad in ["logFormat=xml", "workerBudget=-1", "namespaceWorkerCap=-1", "replicaCount=0"] {
        let err = render(&[bad]).await.expect_err(bad);
        assert!(format!("{err:#}").contains("values don't meet the specifications of the schema"), "{bad}: {err:#}");
    }
}
