//! The access policy over the API server's reviews: a token must name an identity for Stoker's
//! audience, a reader must be allowed `get` on `datapipelines/stream`, a worker must be its
//! pipeline's ServiceAccount. Verdicts are kept briefly in bounded caches, so a burst of calls
//! costs one review; an API server that fails or does not answer in time refuses the call
//! (fail closed) and is asked again on the next.

use std::sync::Mutex;
use std::time::{Duration, Instant};

use stoker_api::verdicts::{Verdicts, token_key};

use super::review::Reviewer;
use super::{Access, Identity, Need, Refusal};
use crate::key::PipelineKey;

/// How long verdicts are kept, and how long a review may take.
#[derive(Debug, Clone)]
pub struct Lifetimes {
    /// A valid token's identity. A revoked token (its ServiceAccount or pod deleted) is
    /// accepted this much longer at most.
    pub identity: Duration,
    /// An invalid token: short, so a token that just became valid is soon accepted.
    pub bad_token: Duration,
    /// A permission granted. A RoleBinding removed takes this long at most to bite.
    pub allowed: Duration,
    /// A permission refused: short, so a RoleBinding just made is soon honoured.
    pub denied: Duration,
    /// A pipeline's worker ServiceAccount.
    pub account: Duration,
    /// Longest wait for one review before the call is refused as UNAVAILABLE.
    pub deadline: Duration,
    /// Entries per cache.
    pub capacity: usize,
}

impl Default for Lifetimes {
    fn default() -> Self {
        Lifetimes {
            identity: Duration::from_secs(60),
            bad_token: Duration::from_secs(10),
            allowed: Duration::from_secs(60),
            denied: Duration::from_secs(5),
            account: Duration::from_secs(30),
            deadline: Duration::from_secs(5),
            capacity: 10_000,
        }
    }
}

/// (username, uid, pipeline): whose read permission on which pipeline.
type ReadKey = (String, String, PipelineKey);

/// [`Access`] by the API server's reviews, cached.
pub struct Checked<R> {
    reviewer: R,
    audience: String,
    lifetimes: Lifetimes,
    tokens: Mutex<Verdicts<[u8; 32], Result<Identity, String>>>,
    reads: Mutex<Verdicts<ReadKey, (bool, String)>>,
    accounts: Mutex<Verdicts<PipelineKey, Option<String>>>,
}

impl<R: Reviewer> Checked<R> {
    pub fn new(reviewer: R, audience: impl Into<String>, lifetimes: Lifetimes) -> Self {
        let capacity = lifetimes.capacity;
        Checked {
            reviewer,
            audience: audience.into(),
            lifetimes,
            tokens: Mutex::new(Verdicts::new(capacity)),
            reads: Mutex::new(Verdicts::new(capacity)),
            accounts: Mutex::new(Verdicts::new(capacity)),
        }
    }

    /// Runs one review within the deadline.
    async fn ask<T>(&self, what: &str, review: impl Future<Output = Result<T, String>>) -> Result<T, Refusal> {
        match tokio::time::timeout(self.lifetimes.deadline, review).await {
            Ok(Ok(answer)) => Ok(answer),
            Ok(Err(e)) => Err(Refusal::Unavailable(e)),
            Err(_) => Err(Refusal::Unavailable(format!(
                "the API server did not answer the {what} within {:?}",
                self.lifetimes.deadline
            ))),
        }
    }

    async fn identity(&self, token: &str) -> Result<Identity, Refusal> {
        let key = token_key(token);
        let cached = self.tokens.lock().unwrap().get(&key, Instant::now());
        let verdict = match cached {
            Some(verdict) => verdict,
            None => {
                let verdict = self.ask("TokenReview", self.reviewer.token(token, &self.audience)).await?;
                let ttl = if verdict.is_ok() { self.lifetimes.identity } else { self.lifetimes.bad_token };
                self.tokens.lock().unwrap().insert(key, verdict.clone(), ttl, Instant::now());
                verdict
            }
        };
        verdict.map_err(Refusal::BadToken)
    }

    async fn may_read(&self, who: &Identity, pipeline: &PipelineKey) -> Result<(bool, String), Refusal> {
        let key = (who.username.clone(), who.uid.clone(), pipeline.clone());
        if let Some(verdict) = self.reads.lock().unwrap().get(&key, Instant::now()) {
            return Ok(verdict);
        }
        let verdict = self.ask("SubjectAccessReview", self.reviewer.may_read(who, pipeline)).await?;
        let ttl = if verdict.0 { self.lifetimes.allowed } else { self.lifetimes.denied };
        self.reads.lock().unwrap().insert(key, verdict.clone(), ttl, Instant::now());
        Ok(verdict)
    }

    async fn worker_account(&self, pipeline: &PipelineKey) -> Result<Option<String>, Refusal> {
        if let Some(account) = self.accounts.lock().unwrap().get(pipeline, Instant::now()) {
            return Ok(account);
        }
        let account = self.ask("DataPipeline read", self.reviewer.worker_account(pipeline)).await?;
        self.accounts.lock().unwrap().insert(pipeline.clone(), account.clone(), self.lifetimes.account, Instant::now());
        Ok(account)
    }
}

#[tonic::async_trait]
impl<R: Reviewer> Access for Checked<R> {
    async fn check(&self, token: Option<&str>, need: Need<'_>) -> Result<Identity, Refusal> {
        let Some(token) = token.filter(|t| !t.is_empty()) else {
            return Err(Refusal::NoToken { audience: self.audience.clone() });
        };
        let who = self.identity(token).await?;
        match need {
            Need::Token => Ok(who),
            Need::Read(pipeline) => {
                let (allowed, reason) = self.may_read(&who, pipeline).await?;
                if allowed {
                    return Ok(who);
                }
                let reason = if reason.is_empty() { String::new() } else { format!(" ({reason})") };
                Err(Refusal::Denied {
                    who: who.username.clone(),
                    why: format!(
                        "{} may not read pipeline {pipeline}: it needs `get` on `datapipelines/stream` in namespace {} \
                     (bind the stoker consumer ClusterRole with a RoleBinding, see docs/security.md){reason}",
                        who.username, pipeline.namespace
                    ),
                })
            }
            Need::Work(pipeline) => match self.worker_account(pipeline).await? {
                None => Err(Refusal::Denied {
                    who: who.username.clone(),
                    why: format!("there is no DataPipeline {pipeline} to work for"),
                }),
                Some(account) => {
                    let expected = Identity::service_account(&pipeline.namespace, &account);
                    if who.username == expected {
                        Ok(who)
                    } else {
                        Err(Refusal::Denied {
                            why: format!(
                                "{} may not work for pipeline {pipeline}: its workers run as {expected}",
                                who.username
                            ),
                            who: who.username,
                        })
                    }
                }
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

    use super::*;

    /// An API server with two ServiceAccount tokens: `reader-b` (namespace b, allowed to read
    /// a/train once `granted`) and `worker-a` (a/default, pipeline a/train's worker account).
    #[derive(Clone, Default)]
    struct FakeApi {
        calls: Arc<AtomicUsize>,
        down: Arc<AtomicBool>,
        hang: Arc<AtomicBool>,
        granted: Arc<AtomicBool>,
    }

    #[tonic::async_trait]
    impl Reviewer for FakeApi {
        async fn token(&self, token: &str, audience: &str) -> Result<Result<Identity, String>, String> {
            self.answer().await?;
            let user = |name: &str| Identity { username: name.into(), extra: BTreeMap::new(), ..Default::default() };
            Ok(match (token, audience) {
                ("reader-b", "stoker.dev") => Ok(user("system:serviceaccount:b:reader")),
                ("worker-a", "stoker.dev") => Ok(user("system:serviceaccount:a:default")),
                (_, "stoker.dev") => Err("invalid bearer token".into()),
                _ => Err("token audiences is invalid".into()),
            })
        }
        async fn may_read(&self, who: &Identity, pipeline: &PipelineKey) -> Result<(bool, String), String> {
            self.answer().await?;
            let allowed = self.granted.load(Ordering::SeqCst)
                && who.username == "system:serviceaccount:b:reader"
                && pipeline.namespace == "a";
            Ok((allowed, String::new()))
        }
        async fn worker_account(&self, pipeline: &PipelineKey) -> Result<Option<String>, String> {
            self.answer().await?;
            Ok((pipeline == &PipelineKey::new("a", "train")).then(|| "default".to_string()))
        }
    }

    impl FakeApi {
        async fn answer(&self) -> Result<(), String> {
            self.calls.fetch_add(1, Ordering::SeqCst);
            if self.hang.load(Ordering::SeqCst) {
                std::future::pending::<()>().await;
            }
            if self.down.load(Ordering::SeqCst) { Err("connection refused".into()) } else { Ok(()) }
        }
    }

    fn checked(api: &FakeApi) -> Checked<FakeApi> {
        let lifetimes =
            Lifetimes { deadline: Duration::from_millis(200), denied: Duration::ZERO, ..Default::default() };
        Checked::new(api.clone(), "stoker.dev", lifetimes)
    }

    #[tokio::test]
    async fn missing_and_invalid_tokens_are_unauthenticated_with_a_reason() {
        let api = FakeApi::default();
        let access = checked(&api);
        let pipeline = PipelineKey::new("a", "train");
        let no = access.check(None, Need::Read(&pipeline)).await.unwrap_err();
        assert!(matches!(no, Refusal::NoToken { .. }), "{no}");
        assert!(no.to_string().contains("stoker.dev"), "says which audience: {no}");
        assert_eq!(no.to_status().code(), tonic::Code::Unauthenticated);
        let bad = access.check(Some("forged"), Need::Token).await.unwrap_err();
        assert_eq!(bad, Refusal::BadToken("invalid bearer token".into()));
        assert_eq!(bad.to_status().code(), tonic::Code::Unauthenticated);
    }

    #[tokio::test]
    async fn a_reader_needs_the_stream_permission_and_gets_it_as_soon_as_it_is_granted() {
        let api = FakeApi::default();
        let access = checked(&api);
        let pipeline = PipelineKey::new("a", "train");
        let denied = access.check(Some("reader-b"), Need::Read(&pipeline)).await.unwrap_err();
        assert_eq!(denied.to_status().code(), tonic::Code::PermissionDenied);
        assert!(denied.to_string().contains("datapipelines/stream"), "{denied}");
        api.granted.store(true, Ordering::SeqCst);
        let who = access.check(Some("reader-b"), Need::Read(&pipeline)).await.unwrap();
        assert_eq!(who.username, "system:serviceaccount:b:reader");
        // Cached: a second call asks the API server nothing.
        let calls = api.calls.load(Ordering::SeqCst);
        access.check(Some("reader-b"), Need::Read(&pipeline)).await.unwrap();
        assert_eq!(api.calls.load(Ordering::SeqCst), calls);
        // Another namespace's pipeline is another question.
        let other = PipelineKey::new("c", "train");
        assert!(matches!(access.check(Some("reader-b"), Need::Read(&other)).await, Err(Refusal::Denied { .. })));
    }

    #[tokio::test]
    async fn only_the_pipelines_own_service_account_may_work_for_it() {
        let api = FakeApi::default();
        let access = checked(&api);
        let train = PipelineKey::new("a", "train");
        assert_eq!(
            access.check(Some("worker-a"), Need::Work(&train)).await.unwrap().username,
            "system:serviceaccount:a:default"
        );
        let as_other = access.check(Some("reader-b"), Need::Work(&train)).await.unwrap_err();
        assert!(as_other.to_string().contains("its workers run as system:serviceaccount:a:default"), "{as_other}");
        let elsewhere = access.check(Some("worker-a"), Need::Work(&PipelineKey::new("b", "train"))).await;
        assert!(matches!(elsewhere, Err(Refusal::Denied { why, .. }) if why.contains("no DataPipeline b/train")));
    }

    #[tokio::test]
    async fn an_api_server_that_fails_or_hangs_refuses_the_call_and_is_asked_again_later() {
        let api = FakeApi::default();
        let access = checked(&api);
        api.down.store(true, Ordering::SeqCst);
        let down = access.check(Some("worker-a"), Need::Token).await.unwrap_err();
        assert!(matches!(&down, Refusal::Unavailable(m) if m.contains("connection refused")), "{down}");
        assert_eq!(down.to_status().code(), tonic::Code::Unavailable);
        api.down.store(false, Ordering::SeqCst);
        api.hang.store(true, Ordering::SeqCst);
        let hung = access.check(Some("worker-a"), Need::Token).await.unwrap_err();
        assert!(matches!(&hung, Refusal::Unavailable(m) if m.contains("did not answer")), "{hung}");
        // Nothing was remembered from the failures: it recovers on the next call.
        api.hang.store(false, Ordering::SeqCst);
        assert!(access.check(Some("worker-a"), Need::Token).await.is_ok());
    }
}
