//! Tenants as the tests see them: ServiceAccounts in namespaces, tokens for them made with the
//! TokenRequest API (as the kubelet makes a pod's projected token), and the consumer role that
//! lets a tenant read a pipeline.

use k8s_openapi::api::authentication::v1::{TokenRequest, TokenRequestSpec};
use k8s_openapi::api::core::v1::ServiceAccount;
use k8s_openapi::api::rbac::v1::{ClusterRole, PolicyRule, RoleBinding, RoleRef, Subject};
use kube::Client;
use kube::api::{Api, ObjectMeta, PostParams};
use stoker_api::token::DEFAULT_AUDIENCE;

/// The chart's consumer ClusterRole (`<release>-consumer`): `get` on `datapipelines/stream`.
pub const CONSUMER_ROLE: &str = "stoker-consumer";

/// Creates `object` unless it exists (409 is success: tests share objects, and the chart may
/// have made it).
async fn create_if_absent<K>(api: &Api<K>, object: &K) -> anyhow::Result<()>
where
    K: kube::Resource + Clone + serde::de::DeserializeOwned + serde::Serialize + std::fmt::Debug,
{
    match api.create(&PostParams::default(), object).await {
        Ok(_) => Ok(()),
        Err(kube::Error::Api(e)) if e.code == 409 => Ok(()),
        Err(e) => Err(e.into()),
    }
}

/// The consumer ClusterRole, as the chart makes it; the local provider installs no chart.
pub async fn ensure_consumer_role(client: &Client) -> anyhow::Result<()> {
    let role = ClusterRole {
        metadata: ObjectMeta { name: Some(CONSUMER_ROLE.into()), ..Default::default() },
        rules: Some(vec![PolicyRule {
            api_groups: Some(vec![stoker_api::GROUP.into()]),
            resources: Some(vec!["datapipelines/stream".into()]),
            verbs: vec!["get".into()],
            ..Default::default()
        }]),
        ..Default::default()
    };
    create_if_absent(&Api::<ClusterRole>::all(client.clone()), &role).await
}

/// A ServiceAccount `namespace/name` (made if absent).
pub async fn service_account(client: &Client, namespace: &str, name: &str) -> anyhow::Result<()> {
    let sa =
        ServiceAccount { metadata: ObjectMeta { name: Some(name.into()), ..Default::default() }, ..Default::default() };
    create_if_absent(&Api::<ServiceAccount>::namespaced(client.clone(), namespace), &sa).await
}

/// A token of ServiceAccount `namespace/name` for `audience`, valid for an hour.
pub async fn token(client: &Client, namespace: &str, name: &str, audience: &str) -> anyhow::Result<String> {
    service_account(client, namespace, name).await?;
    let request = TokenRequest {
        spec: Some(TokenRequestSpec {
            audiences: Some(vec![audience.into()]),
            expiration_seconds: Some(3600),
            ..Default::default()
        }),
        ..Default::default()
    };
    let api = Api::<ServiceAccount>::namespaced(client.clone(), namespace);
    let answer = api.create_token_request(name, &PostParams::default(), &request).await?;
    Ok(answer.status.and_then(|s| s.token).unwrap_or_default())
}

/// Binds the consumer role to ServiceAccount `sa_namespace/sa` in `namespace`.
pub async fn grant_reader(client: &Client, namespace: &str, (sa_namespace, sa): (&str, &str)) -> anyhow::Result<()> {
    ensure_consumer_role(client).await?;
    let binding = RoleBinding {
        metadata: ObjectMeta { name: Some(format!("read-{sa_namespace}-{sa}")), ..Default::default() },
        role_ref: RoleRef {
            api_group: Some("rbac.authorization.k8s.io".into()),
            kind: "ClusterRole".into(),
            name: CONSUMER_ROLE.into(),
        },
        subjects: Some(vec![Subject {
            kind: "ServiceAccount".into(),
            name: sa.into(),
            namespace: Some(sa_namespace.into()),
            ..Default::default()
        }]),
    };
    create_if_absent(&Api::<RoleBinding>::namespaced(client.clone(), namespace), &binding).await
}

/// A token for a trainer allowed to read the pipelines of `namespace`: ServiceAccount
/// `trainer` of that namespace, bound to the consumer role there. What every scenario's
/// training client sends.
pub async fn reader_token(client: &Client, namespace: &str) -> anyhow::Result<String> {
    grant_reader(client, namespace, (namespace, "trainer")).await?;
    token(client, namespace, "trainer", DEFAULT_AUDIENCE).await
}

/// Client options of a trainer allowed to read `namespace/pipeline`.
pub async fn reader_options(
    client: &Client,
    namespace: &str,
    pipeline: &str,
) -> anyhow::Result<stoker_client::ClientOptions> {
    let mut options = stoker_client::ClientOptions::new(namespace, pipeline);
    options.token = Some(reader_token(client, namespace).await?);
    Ok(options)
}
