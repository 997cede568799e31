//! `AuthorizeReader`: the reader's verdict is the answer's content, and an error status is
//! only ever about the question (the asking worker refused, the API server unavailable), so a
//! worker never passes a refusal of its own on to a client as final.

use std::time::Duration;

use stoker_api::proto::dispatcher_server::Dispatcher as _;
use tonic::{Code, Request};

use super::*;

/// Tokens named for what they are: "worker" works for every pipeline, "reader" reads it,
/// "outsider" is valid and may not, "forged" is not accepted, "down" finds the API server
/// unavailable.
struct Tokens;

#[tonic::async_trait]
impl Access for Tokens {
    async fn check(&self, token: Option<&str>, need: Need<'_>) -> Result<Identity, Refusal> {
        let who = |name: &str| Identity { username: format!("system:serviceaccount:ns:{name}"), ..Identity::default() };
        let denied = |name: &str| Refusal::Denied { who: who(name).username, why: format!("{need:?} is not allowed") };
        match (token, need) {
            (None, _) => Err(Refusal::NoToken { audience: "stoker.dev".into() }),
            (Some("worker"), Need::Work(_)) => Ok(who("worker")),
            (Some("reader"), Need::Read(_)) => Ok(who("reader")),
            (Some("forged"), _) => Err(Refusal::BadToken("signature invalid".into())),
            (Some("down"), _) => Err(Refusal::Unavailable("TokenReview timed out".into())),
            (Some(other), _) => Err(denied(other)),
        }
    }
}

async fn ask(asker: &str, reader: &str) -> Result<proto::AuthorizeReaderResponse, Status> {
    let d = Dispatcher::guarded(Timeouts::default(), Duration::from_secs(5), Arc::new(Tokens));
    let mut request = Request::new(proto::AuthorizeReaderRequest {
        pipeline: Some(proto::PipelineRef { namespace: "ns".into(), name: "p".into() }),
        token: reader.into(),
    });
    request.metadata_mut().insert("authorization", format!("Bearer {asker}").parse().unwrap());
    d.into_service().authorize_reader(request).await.map(Response::into_inner)
}

#[tokio::test]
async fn a_reader_allowed_or_refused_is_an_answer() {
    let allowed = ask("worker", "reader").await.unwrap();
    assert_eq!(
        (allowed.username.as_str(), allowed.refused, allowed.valid_for_ms),
        ("system:serviceaccount:ns:reader", None, 30_000)
    );

    let outsider = ask("worker", "outsider").await.unwrap();
    let refused = outsider.refused.expect("refused");
    assert!(!refused.unauthenticated && refused.message.contains("not allowed"), "{refused:?}");
    assert_eq!(outsider.valid_for_ms, 5_000, "a refusal is kept briefly");

    let forged = ask("worker", "forged").await.unwrap().refused.expect("refused");
    assert!(forged.unauthenticated && forged.message.contains("signature invalid"), "{forged:?}");
}

#[tokio::test]
async fn a_question_that_cannot_be_answered_is_an_error() {
    let stranger = ask("outsider", "reader").await.unwrap_err();
    assert_eq!(stranger.code(), Code::PermissionDenied, "only the pipeline's workers may ask");
    let down = ask("worker", "down").await.unwrap_err();
    assert_eq!(down.code(), Code::Unavailable, "no verdict while the API server is away: {down:?}");
}
