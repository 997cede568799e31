//! Small Kubernetes helpers shared by scenarios.

use std::time::Duration;

use anyhow::Context as _;
use k8s_openapi::api::authorization::v1::{ResourceAttributes, SubjectAccessReview, SubjectAccessReviewSpec};
use k8s_openapi::api::core::v1::Namespace;
use kube::api::{Api, DeleteParams, ObjectMeta, PostParams};
use kube::{Client, Resource};
use serde_json::Value;

use crate::wait::{Check, wait_for};

/// Creates a namespace `<prefix>-<random>` and returns its name.
pub async fn fresh_namespace(client: &Client, prefix: &str) -> anyhow::Result<String> {
    let name = format!("{prefix}-{}", crate::tools::random_hex(3));
    let ns =
        Namespace { metadata: ObjectMeta { name: Some(name.clone()), ..Default::default() }, ..Default::default() };
    Api::<Namespace>::all(client.clone())
        .create(&PostParams::default(), &ns)
        .await
        .with_context(|| format!("creating namespace {name}"))?;
    Ok(name)
}

/// Deletes a namespace and waits until the namespace controller has removed it.
pub async fn delete_namespace(client: &Client, name: &str, timeout: Duration) -> anyhow::Result<()> {
    let api = Api::<Namespace>::all(client.clone());
    match api.delete(name, &DeleteParams::default()).await {
        Ok(_) => {}
        Err(kube::Error::Api(e)) if e.code == 404 => return Ok(()),
        Err(e) => return Err(e).context(format!("deleting namespace {name}")),
    }
    wait_until_gone(&api, name, timeout).await
}

/// Waits until `api.get(name)` answers 404.
pub async fn wait_until_gone<K>(api: &Api<K>, name: &str, timeout: Duration) -> anyhow::Result<()>
where
    K: Resource + Clone + serde::de::DeserializeOwned + std::fmt::Debug,
    K::DynamicType: Default,
{
    let kind = K::kind(&K::DynamicType::default()).to_string();
    let kind = kind.as_str();
    wait_for(timeout, format!("{kind} {name} to be deleted"), || async move {
        Ok(match api.get_opt(name).await? {
            None => Check::Done(()),
            Some(obj) => {
                let meta = obj.meta();
                Check::not_yet(format!(
                    "{kind} {name} still exists (deletionTimestamp: {:?}, finalizers: {:?})",
                    meta.deletion_timestamp.as_ref().map(|t| t.0.to_string()),
                    meta.finalizers
                ))
            }
        })
    })
    .await
}

/// Waits until object `name` exists (made by the operator) and returns it.
pub async fn wait_until_made<K>(api: &Api<K>, name: &str, timeout: Duration) -> anyhow::Result<K>
where
    K: Resource + Clone + serde::de::DeserializeOwned + std::fmt::Debug,
    K::DynamicType: Default,
{
    let kind = K::kind(&K::DynamicType::default()).to_string();
    wait_for(timeout, format!("{kind} {name} to be made"), || async move {
        Ok(match api.get_opt(name).await? {
            Some(obj) => Check::Done(obj),
            None => Check::not_yet("not yet"),
        })
    })
    .await
}

/// Applies DataPipeline `namespace/name`: one fixed worker reading a JSONL file of `rows`
/// records `{"id": i}` (written here), in batches of 10.
pub async fn ids_pipeline(cluster: &dyn crate::Cluster, namespace: &str, name: &str, rows: i64) -> anyhow::Result<()> {
    let data = cluster.workdir().join(format!("{namespace}-data"));
    std::fs::create_dir_all(&data)?;
    let lines: String = (0..rows).map(|i| format!("{{\"id\": {i}}}\n")).collect();
    std::fs::write(data.join("00.jsonl"), lines)?;
    let seen_as = cluster.worker_data(&data);
    let manifest = format!(
        "apiVersion: stoker.dev/v1alpha1\nkind: DataPipeline\nmetadata: {{name: {name}}}\nspec:\n  \
         source: {{uri: 'file://{}/', format: jsonl}}\n  batchSize: 10\n  \
         autoscaling: {{mode: Fixed, replicas: 1}}\n  workers: {{{}}}\n",
        seen_as.path, seen_as.fields
    );
    let dp: stoker_api::DataPipeline = serde_yaml::from_str(&manifest)?;
    Api::<stoker_api::DataPipeline>::namespaced(cluster.client(), namespace)
        .patch(name, &kube::api::PatchParams::apply("e2e").force(), &kube::api::Patch::Apply(&dp))
        .await?;
    Ok(())
}

/// Whether the RBAC authorizer lets ServiceAccount `namespace/name` do `verb` on `resource`
/// (`"deployments.apps"`, `"datapipelines.stoker.dev/status"`, `"pods"`) in `in_namespace`
/// (`None`: cluster-wide), asked through a SubjectAccessReview.
pub async fn service_account_can(
    client: &Client,
    (namespace, name): (&str, &str),
    verb: &str,
    resource: &str,
    in_namespace: Option<&str>,
) -> anyhow::Result<bool> {
    let (resource, subresource) = match resource.split_once('/') {
        Some((r, s)) => (r, Some(s.to_string())),
        None => (resource, None),
    };
    let (resource, group) = match resource.split_once('.') {
        Some((r, g)) => (r, g),
        None => (resource, ""),
    };
    let review = SubjectAccessReview {
        metadata: ObjectMeta::default(),
        spec: SubjectAccessReviewSpec {
            user: Some(format!("system:serviceaccount:{namespace}:{name}")),
            groups: Some(vec![
                "system:serviceaccounts".into(),
                format!("system:serviceaccounts:{namespace}"),
                "system:authenticated".into(),
            ]),
            resource_attributes: Some(ResourceAttributes {
                verb: Some(verb.into()),
                group: Some(group.into()),
                resource: Some(resource.into()),
                subresource,
                namespace: in_namespace.map(Into::into),
                ..Default::default()
            }),
            ..Default::default()
        },
        status: None,
    };
    let answer = Api::<SubjectAccessReview>::all(client.clone())
        .create(&PostParams::default(), &review)
        .await
        .context("creating a SubjectAccessReview")?;
    Ok(answer.status.is_some_and(|s| s.allowed))
}

/// Splits a multi-document YAML stream into JSON values, skipping empty documents.
pub fn yaml_documents(text: &str) -> anyhow::Result<Vec<Value>> {
    use serde::Deserialize as _;
    let mut docs = Vec::new();
    for doc in serde_yaml::Deserializer::from_str(text) {
        let value = Value::deserialize(doc).context("parsing a YAML document")?;
        if !value.is_null() {
            docs.push(value);
        }
    }
    Ok(docs)
}

/// The name of the one Deployment (the operator's) in the Helm release `stoker`.
pub async fn release_deployment(cluster: &dyn crate::Cluster) -> anyhow::Result<String> {
    let manifest = cluster.helm(&["get", "manifest", crate::RELEASE, "-n", crate::OPERATOR_NAMESPACE]).await?;
    let names: Vec<String> = yaml_documents(&manifest)?
        .iter()
        .filter(|o| o["kind"] == "Deployment")
        .filter_map(|o| o["metadata"]["name"].as_str().map(String::from))
        .collect();
    match names.as_slice() {
        [one] => Ok(one.clone()),
        _ => anyhow::bail!("expected one Deployment in the Helm release {}, found {names:?}", crate::RELEASE),
    }
}

/// Deletes one running pod of Deployment `deployment` with no grace period; returns its name.
/// The pod leaves the API at once, but its processes still get SIGTERM (and SIGKILL 2 s later,
/// the kubelet's shortest grace); for a crash, see `Cluster::crash_pod`.
pub async fn delete_one_pod(client: &kube::Client, namespace: &str, deployment: &str) -> anyhow::Result<String> {
    let name = running_pod(client, namespace, deployment, &[]).await?;
    Api::<k8s_openapi::api::core::v1::Pod>::namespaced(client.clone(), namespace)
        .delete(&name, &DeleteParams::default().grace_period(0))
        .await?;
    Ok(name)
}

/// A running pod of Deployment `deployment`, other than those in `except`.
pub async fn running_pod(
    client: &kube::Client,
    namespace: &str,
    deployment: &str,
    except: &[String],
) -> anyhow::Result<String> {
    use k8s_openapi::api::apps::v1::Deployment;
    use k8s_openapi::api::core::v1::Pod;
    use kube::api::ListParams;
    let deploy = Api::<Deployment>::namespaced(client.clone(), namespace).get(deployment).await?;
    let labels = deploy.spec.selector.match_labels.unwrap_or_default();
    let selector = labels.iter().map(|(k, v)| format!("{k}={v}")).collect::<Vec<_>>().join(",");
    let pods = Api::<Pod>::namespaced(client.clone(), namespace);
    let list = pods.list(&ListParams::default().labels(&selector)).await?;
    let running = list.items.iter().find(|p| {
        p.metadata.deletion_timestamp.is_none()
            && p.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Running")
            && p.metadata.name.as_ref().is_some_and(|n| !except.contains(n))
    });
    running.and_then(|p| p.metadata.name.clone()).with_context(|| format!("no running pod of {namespace}/{deployment}"))
}

/// `None` when the texts are equal, else where they first differ (for "generated file is stale"
/// messages).
pub fn first_difference(expected: &str, actual: &str) -> Option<String> {
    if expected == actual {
        return None;
    }
    if expected.is_empty() {
        return Some("the expected text is missing or empty".into());
    }
    let (e, a): (Vec<&str>, Vec<&str>) = (expected.lines().collect(), actual.lines().collect());
    for i in 0..e.len().max(a.len()) {
        let (x, y) = (e.get(i), a.get(i));
        if x != y {
            return Some(format!(
                "first difference at line {}: expected {:?}, got {:?}",
                i + 1,
                x.copied().unwrap_or("<end of file>"),
                y.copied().unwrap_or("<end of file>")
            ));
        }
    }
    Some("they differ in line endings or a trailing newline".into())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn first_difference_points_at_the_line() {
        assert_eq!(first_difference("a\nb\n", "a\nb\n"), None);
        let d = first_difference("a\nb\n", "a\nc\n").unwrap();
        assert!(d.contains("line 2") && d.contains("\"b\"") && d.contains("\"c\""), "{d}");
        assert!(first_difference("a\n", "a\nb\n").unwrap().contains("<end of file>"));
        assert!(first_difference("a\n", "a").unwrap().contains("trailing newline"));
        assert!(first_difference("", "a").unwrap().contains("missing"));
    }

    #[test]
    fn yaml_documents_skips_empty_ones() {
        let docs = yaml_documents("---\n# only a comment\n---\nkind: A\n---\nkind: B\n").unwrap();
        assert_eq!(docs.iter().map(|d| d["kind"].as_str().unwrap()).collect::<Vec<_>>(), ["A", "B"]);
    }
}
