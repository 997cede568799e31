//! Who may stream from a worker under the operator: the worker asks the dispatcher, which
//! reviews the client's token with the API server (TokenReview, then SubjectAccessReview of
//! `get` on `datapipelines/stream`), so worker pods need no API-server rights of their own.
//! Answers are kept as long as the dispatcher says (bounded in count), per token and pipeline:
//! a stream costs one question, a reconnecting client none. A failed question (the dispatcher
//! unreachable, or refusing this worker itself) is no verdict: the client is told to retry.

use std::sync::Mutex;
use std::time::{Duration, Instant};

use stoker_api::proto::{self, PipelineRef};
use stoker_api::verdicts::{Verdicts, token_key};
use tonic::metadata::MetadataMap;
use tonic::{Code, Status};

use super::link::DispatcherRpc;
use crate::stream::{Authenticator, Caller};

/// Longest wait for the dispatcher's answer before the stream is refused as UNAVAILABLE.
const DEADLINE: Duration = Duration::from_secs(10);
const CAPACITY: usize = 4096;

/// (token digest, namespace, pipeline).
type Key = ([u8; 32], String, String);
/// The reader's username, or the refusal to repeat.
type Verdict = Result<String, (Code, String)>;

pub struct DispatcherReaders {
    client: DispatcherRpc,
    verdicts: Mutex<Verdicts<Key, Verdict>>,
}

impl DispatcherReaders {
    pub fn new(client: DispatcherRpc) -> Self {
        DispatcherReaders { client, verdicts: Mutex::new(Verdicts::new(CAPACITY)) }
    }
}

impl Authenticator for DispatcherReaders {
    async fn authenticate(&self, metadata: &MetadataMap, namespace: &str, name: &str) -> Result<Caller, Status> {
        let Some(token) = proto::request_token(metadata) else {
            return Err(Status::unauthenticated(
                "no ServiceAccount token: send `authorization: Bearer <token>` with a token of Stoker's audience \
                 (mount a projected serviceAccountToken volume, see docs/security.md)",
            ));
        };
        let caller = |username: String| Caller { token: Some(token.to_string()), username: Some(username) };
        let key = (token_key(token), namespace.to_string(), name.to_string());
        if let Some(verdict) = self.verdicts.lock().unwrap().get(&key, Instant::now()) {
            return verdict.map(caller).map_err(|(code, message)| Status::new(code, message));
        }
        let request = proto::AuthorizeReaderRequest {
            pipeline: Some(PipelineRef { namespace: namespace.into(), name: name.into() }),
            token: token.to_string(),
        };
        let answer = tokio::time::timeout(DEADLINE, self.client.clone().authorize_reader(request)).await;
        let verdict = match answer {
            Ok(Ok(response)) => {
                let response = response.into_inner();
                let ttl = Duration::from_millis(u64::from(response.valid_for_ms));
                match response.refused {
                    None => (Ok(response.username), ttl),
                    Some(r) => {
                        let code = if r.unauthenticated { Code::Unauthenticated } else { Code::PermissionDenied };
                        (Err((code, r.message)), ttl)
                    }
                }
            }
            // The call itself failed, this worker's own token refused included: the reader
            // was not judged, so its client is told to retry, not that it was refused.
            Ok(Err(s)) => {
                if matches!(s.code(), Code::Unauthenticated | Code::PermissionDenied) {
                    tracing::warn!(status = %s, "the dispatcher refused this worker's question about a reader");
                }
                return Err(Status::unavailable(format!(
                    "cannot check this reader with the dispatcher now ({}); retry",
                    s.message()
                )));
            }
            Err(_) => {
                return Err(Status::unavailable(format!(
                    "the dispatcher did not answer within {DEADLINE:?} whether this reader may read; retry"
                )));
            }
        };
        let (verdict, ttl) = verdict;
        self.verdicts.lock().unwrap().insert(key, verdict.clone(), ttl, Instant::now());
        if let Err((_, message)) = &verdict {
            tracing::warn!(pipeline = %format!("{namespace}/{name}"), reason = %message, "stream refused");
        }
        verdict.map(caller).map_err(|(code, message)| Status::new(code, message))
    }
}
