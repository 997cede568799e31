//! Who is calling. Every stream request carries the caller's ServiceAccount token; a worker
//! under the operator asks the dispatcher whether its owner may read the pipeline
//! (`dispatched::readers`); standalone and local workers let everyone in.

use std::future::Future;

use stoker_api::proto;
use tonic::Status;
use tonic::metadata::MetadataMap;

/// The authenticated caller as the service sees it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Caller {
    /// The bearer token presented, if any.
    pub token: Option<String>,
    /// Who the token belongs to, when it was checked.
    pub username: Option<String>,
}

pub trait Authenticator: Send + Sync + 'static {
    /// Accepts the caller as a reader of the pipeline `namespace/name` or refuses with a
    /// status, normally `Unauthenticated` or `PermissionDenied`.
    fn authenticate(
        &self,
        metadata: &MetadataMap,
        namespace: &str,
        name: &str,
    ) -> impl Future<Output = Result<Caller, Status>> + Send;
}

/// Accepts everyone, keeping the token: standalone workers and `stoker local`.
#[derive(Debug, Clone, Copy, Default)]
pub struct AllowAll;

impl Authenticator for AllowAll {
    async fn authenticate(&self, metadata: &MetadataMap, _namespace: &str, _name: &str) -> Result<Caller, Status> {
        Ok(Caller { token: proto::request_token(metadata).map(str::to_owned), username: None })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn allow_all_accepts_with_and_without_a_token() {
        let mut md = MetadataMap::new();
        assert_eq!(AllowAll.authenticate(&md, "a", "p").await.unwrap(), Caller::default());
        md.insert(proto::AUTHORIZATION, proto::bearer("sa-token").parse().unwrap());
        assert_eq!(AllowAll.authenticate(&md, "a", "p").await.unwrap().token.as_deref(), Some("sa-token"));
    }
}
