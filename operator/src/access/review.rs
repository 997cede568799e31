//! The API server's answers, the only I/O of access checks: whose a token is (TokenReview),
//! whether an identity may read a pipeline (SubjectAccessReview), and which ServiceAccount a
//! pipeline's worker pods run as (the DataPipeline itself).

use k8s_openapi::api::authentication::v1::{TokenReview, TokenReviewSpec};
use k8s_openapi::api::authorization::v1::{ResourceAttributes, SubjectAccessReview, SubjectAccessReviewSpec};
use kube::api::{Api, PostParams};
use stoker_api::DataPipeline;

use super::{Identity, STREAM_SUBRESOURCE};
use crate::key::PipelineKey;

/// The reviews access checks need; `Err` means the API server could not answer (the caller
/// fails closed and does not remember it).
#[tonic::async_trait]
pub trait Reviewer: Send + Sync + 'static {
    /// Whose `token` is, for `audience`: `Ok(Err(why))` when the API server does not accept it.
    async fn token(&self, token: &str, audience: &str) -> Result<Result<Identity, String>, String>;
    /// Whether `who` may `get` `datapipelines/stream` of the pipeline, and the reason given.
    async fn may_read(&self, who: &Identity, pipeline: &PipelineKey) -> Result<(bool, String), String>;
    /// The ServiceAccount of the pipeline's worker pods; `None` when there is no such pipeline.
    async fn worker_account(&self, pipeline: &PipelineKey) -> Result<Option<String>, String>;
}

/// Asks the Kubernetes API server.
#[derive(Clone)]
pub struct KubeReviewer {
    client: kube::Client,
}

impl KubeReviewer {
    pub fn new(client: kube::Client) -> Self {
        KubeReviewer { client }
    }
}

#[tonic::async_trait]
impl Reviewer for KubeReviewer {
    async fn token(&self, token: &str, audience: &str) -> Result<Result<Identity, String>, String> {
        let review = TokenReview {
            spec: TokenReviewSpec { token: token.to_string(), audiences: Some(vec![audience.to_string()]) },
            ..Default::default()
        };
        let answer = Api::<TokenReview>::all(self.client.clone())
            .create(&PostParams::default(), &review)
            .await
            .map_err(|e| format!("TokenReview failed: {e}"))?;
        let status = answer.status.unwrap_or_default();
        if status.authenticated != Some(true) {
            let why = status.error.filter(|e| !e.is_empty()).unwrap_or_else(|| "invalid or expired token".into());
            return Ok(Err(why));
        }
        // Asked for one audience, the API server answers with the ones the token has of it.
        if !status.audiences.unwrap_or_default().iter().any(|a| a == audience) {
            return Ok(Err(format!("the token is not for audience {audience:?}")));
        }
        let user = status.user.unwrap_or_default();
        Ok(Ok(Identity {
            username: user.username.unwrap_or_default(),
            uid: user.uid.unwrap_or_default(),
            groups: user.groups.unwrap_or_default(),
            extra: user.extra.unwrap_or_default(),
        }))
    }

    async fn may_read(&self, who: &Identity, pipeline: &PipelineKey) -> Result<(bool, String), String> {
        let review = SubjectAccessReview {
            spec: SubjectAccessReviewSpec {
                user: Some(who.username.clone()),
                uid: (!who.uid.is_empty()).then(|| who.uid.clone()),
                groups: Some(who.groups.clone()),
                extra: (!who.extra.is_empty()).then(|| who.extra.clone()),
                resource_attributes: Some(ResourceAttributes {
                    group: Some(stoker_api::GROUP.into()),
                    resource: Some("datapipelines".into()),
                    subresource: Some(STREAM_SUBRESOURCE.into()),
                    verb: Some("get".into()),
                    namespace: Some(pipeline.namespace.clone()),
                    name: Some(pipeline.name.clone()),
                    ..Default::default()
                }),
                ..Default::default()
            },
            ..Default::default()
        };
        let answer = Api::<SubjectAccessReview>::all(self.client.clone())
            .create(&PostParams::default(), &review)
            .await
            .map_err(|e| format!("SubjectAccessReview failed: {e}"))?;
        let status = answer.status.unwrap_or_default();
        let reason = status.reason.unwrap_or_default();
        match status.evaluation_error.filter(|e| !e.is_empty()) {
            // An authorizer that could not decide has not allowed.
            Some(e) if !status.allowed => Ok((false, format!("{reason} ({e})"))),
            _ => Ok((status.allowed && status.denied != Some(true), reason)),
        }
    }

    async fn worker_account(&self, pipeline: &PipelineKey) -> Result<Option<String>, String> {
        let api: Api<DataPipeline> = Api::namespaced(self.client.clone(), &pipeline.namespace);
        match api.get_opt(&pipeline.name).await {
            Ok(dp) => Ok(dp.map(|dp| dp.spec.workers.service_account_name.unwrap_or_else(|| "default".into()))),
            Err(e) => Err(format!("reading DataPipeline {pipeline}: {e}")),
        }
    }
}
