//! Who is calling. Every RPC carries the caller's ServiceAccount token; verifying it
//! (TokenReview, namespace checks) comes later, behind this trait, without touching the service.

use std::future::Future;

use stoker_api::proto;
use tonic::Status;
use tonic::metadata::MetadataMap;

/// The authenticated caller as the service sees it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Caller {
    /// The bearer token presented, if any.
    pub token: Option<String>,
}

pub trait Authenticator: Send + Sync + 'static {
    /// Accepts the caller (possibly after asking the API server) or refuses with a status,
    /// normally `Unauthenticated` or `PermissionDenied`.
    fn authenticate(&self, metadata: &MetadataMap) -> impl Future<Output = Result<Caller, Status>> + Send;
}

/// Accepts everyone, keeping the token for whatever comes after. The default until token
/// verification lands.
#[derive(Debug, Clone, Copy, Default)]
pub struct AllowAll;

impl Authenticator for AllowAll {
    async fn authenticate(&self, metadata: &MetadataMap) -> Result<Caller, Status> {
        Ok(Caller { token: proto::request_token(metadata).map(str::to_owned) })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn allow_all_accepts_with_and_without_a_token() {
        let mut md = MetadataMap::new();
        assert_eq!(AllowAll.authenticate(&md).await.unwrap(), Caller { token: None });
        md.insert(proto::AUTHORIZATION, proto::bearer("sa-token").parse().unwrap());
        assert_eq!(AllowAll.authenticate(&md).await.unwrap().token.as_deref(), Some("sa-token"));
    }
}
