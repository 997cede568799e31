//! Who may call the dispatcher, the Kubernetes way. Every call carries a ServiceAccount token
//! with Stoker's audience; the API server says whose it is (TokenReview) and whether that
//! identity may read a pipeline (SubjectAccessReview of `get` on the virtual subresource
//! `datapipelines/stream`, as `pods/exec` works). A worker must be the ServiceAccount of its
//! pipeline's pods, in the pipeline's namespace. Read in this order:
//!
//! 1. this file: the identities, what a call needs ([`Need`]), the refusals ([`Refusal`]);
//! 2. [`checked`]: the policy, with bounded caches of verdicts and a deadline on every review;
//! 3. [`review`]: the API server's reviews (the only I/O);
//! 4. [`denials`]: refusals tallied per pipeline, for metrics and Events.

pub mod checked;
pub mod denials;
pub mod review;

use std::collections::BTreeMap;

use tonic::Status;

use crate::key::PipelineKey;

pub use checked::Checked;
pub use denials::Denials;
pub use review::KubeReviewer;

/// The subresource whose `get` lets a caller read a pipeline's batches and report its batch
/// times.
pub const STREAM_SUBRESOURCE: &str = "stream";

/// A caller as the API server knows it (TokenReview's `status.user`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Identity {
    pub username: String,
    pub uid: String,
    pub groups: Vec<String>,
    pub extra: BTreeMap<String, Vec<String>>,
}

impl Identity {
    /// The identity of callers when access is open (`stoker local`, `--authentication=none`).
    pub fn anonymous() -> Self {
        Identity { username: "system:anonymous".into(), ..Default::default() }
    }

    /// The username of a ServiceAccount.
    pub fn service_account(namespace: &str, name: &str) -> String {
        format!("system:serviceaccount:{namespace}:{name}")
    }
}

/// What a call needs besides a valid token.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Need<'a> {
    /// Nothing more: a call naming an id the dispatcher does not know (it answers NOT_FOUND,
    /// which tells a stranger nothing).
    Token,
    /// Read the pipeline's batches and report its batch times: `get` on `datapipelines/stream`.
    Read(&'a PipelineKey),
    /// Work for the pipeline: be the ServiceAccount of its worker pods.
    Work(&'a PipelineKey),
}

/// Why a call is refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Refusal {
    #[error(
        "no ServiceAccount token: send `authorization: Bearer <token>` with a token of audience {audience:?} (mount a projected serviceAccountToken volume, see docs/security.md)"
    )]
    NoToken { audience: String },
    #[error("the token was not accepted: {0}")]
    BadToken(String),
    /// A valid identity without the right; `who` is its username.
    #[error("{why}")]
    Denied { who: String, why: String },
    #[error("cannot check the caller now ({0}); retry")]
    Unavailable(String),
}

impl Refusal {
    pub fn to_status(&self) -> Status {
        match self {
            Refusal::NoToken { .. } | Refusal::BadToken(_) => Status::unauthenticated(self.to_string()),
            Refusal::Denied { .. } => Status::permission_denied(self.to_string()),
            Refusal::Unavailable(_) => Status::unavailable(self.to_string()),
        }
    }

    /// The metrics label of the refusal.
    /// Who was refused, when the token said.
    pub fn caller(&self) -> Option<&str> {
        match self {
            Refusal::Denied { who, .. } => Some(who),
            _ => None,
        }
    }

    pub fn kind(&self) -> &'static str {
        match self {
            Refusal::NoToken { .. } | Refusal::BadToken(_) => "unauthenticated",
            Refusal::Denied { .. } => "permission_denied",
            Refusal::Unavailable(_) => "unavailable",
        }
    }
}

/// Decides whether a call may proceed.
#[tonic::async_trait]
pub trait Access: Send + Sync + 'static {
    async fn check(&self, token: Option<&str>, need: Need<'_>) -> Result<Identity, Refusal>;
}

/// Lets every call through: `stoker local`, where there is no API server to ask, and clusters
/// run with `--authentication=none`.
#[derive(Debug, Clone, Copy, Default)]
pub struct Open;

#[tonic::async_trait]
impl Access for Open {
    async fn check(&self, _token: Option<&str>, _need: Need<'_>) -> Result<Identity, Refusal> {
        Ok(Identity::anonymous())
    }
}
