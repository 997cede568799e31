//! Marks the pod of the leading process with [`LABEL`], which the chart's dispatcher Service
//! selects: the Service routes to the leader while every healthy replica reports Ready.
//!
//! Readiness alone cannot do both. With only the leader Ready, a Deployment of two replicas
//! never finishes rolling out, so `helm install --wait` and `kubectl rollout status` never
//! return (found on real pods, Helm 4).
//!
//! A pod can carry a stale mark: its leader process exited and restarted as a standby in the
//! same pod, or hangs. So a process clears its own pod's mark before it reports Ready, and a
//! new leader clears the mark from every other pod of its release before it marks its own.
//! The leader checks its mark every few seconds and marks again if it is gone: a former
//! leader's `mark` still in flight when it stepped down clears the new leader's.

use std::collections::BTreeMap;

use anyhow::Context as _;
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, ListParams, Patch, PatchParams};
use tracing::info;

/// The label, `"true"` on the leader's pod and absent elsewhere.
pub const LABEL: &str = "stoker.dev/leader";

/// Labels of this pod that scope "the other replicas" to its own release.
const RELEASE_LABELS: [&str; 2] = ["app.kubernetes.io/name", "app.kubernetes.io/instance"];

pub struct LeaderPod {
    api: Api<Pod>,
    name: String,
}

impl LeaderPod {
    pub fn new(client: kube::Client, namespace: &str, name: String) -> Self {
        LeaderPod { api: Api::namespaced(client, namespace), name }
    }

    /// Removes the mark from this process's own pod (a standby, or a leader starting over).
    pub async fn clear_own(&self) -> anyhow::Result<()> {
        self.set(&self.name, None).await
    }

    /// Whether this pod carries the mark.
    pub async fn is_marked(&self) -> anyhow::Result<bool> {
        let own = self.api.get(&self.name).await.with_context(|| format!("reading this pod ({})", self.name))?;
        Ok(own.metadata.labels.is_some_and(|l| l.get(LABEL).is_some_and(|v| v == "true")))
    }

    /// Marks this pod as the leader's, after clearing the mark from the release's other pods.
    pub async fn mark(&self) -> anyhow::Result<()> {
        let own = self.api.get(&self.name).await.with_context(|| format!("reading this pod ({})", self.name))?;
        let labels = own.metadata.labels.unwrap_or_default();
        let selector = std::iter::once(format!("{LABEL}=true"))
            .chain(RELEASE_LABELS.iter().filter_map(|k| labels.get(*k).map(|v| format!("{k}={v}"))))
            .collect::<Vec<_>>()
            .join(",");
        let marked = self.api.list(&ListParams::default().labels(&selector)).await.context("listing marked pods")?;
        for pod in marked.items {
            let name = pod.metadata.name.unwrap_or_default();
            if name != self.name {
                info!(pod = %name, "clearing a former leader's mark");
                self.set(&name, None).await?;
            }
        }
        self.set(&self.name, Some("true")).await?;
        info!(pod = %self.name, label = LABEL, "marked this pod as the leader's");
        Ok(())
    }

    async fn set(&self, pod: &str, value: Option<&str>) -> anyhow::Result<()> {
        let labels: BTreeMap<&str, Option<&str>> = [(LABEL, value)].into();
        let patch = serde_json::json!({ "metadata": { "labels": labels } });
        match self.api.patch(pod, &PatchParams::default(), &Patch::Merge(&patch)).await {
            Ok(_) => Ok(()),
            // A pod already gone carries no mark.
            Err(kube::Error::Api(e)) if e.code == 404 && value.is_none() => Ok(()),
            Err(e) => Err(e).with_context(|| {
                format!("setting label {LABEL} on pod {pod} (the operator needs get, list and patch on pods)")
            }),
        }
    }
}
