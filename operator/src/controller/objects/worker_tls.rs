//! The pipeline's worker certificate: a `kubernetes.io/tls` Secret `<pipeline>-workers-tls`
//! owned by the pipeline, with the certificate for the workers Service's name (what clients
//! verify, dialling each worker by its IP), its key, and the CA bundle workers verify the
//! dispatcher with. Issued again only when missing, issued by another CA, or expiring: not on
//! every reconcile, which would restart every worker each time.

use std::collections::BTreeMap;
use std::time::Duration;

use k8s_openapi::ByteString;
use k8s_openapi::api::core::v1::Secret;
use k8s_openapi::jiff::Timestamp;
use kube::ResourceExt;
use sha2::{Digest, Sha256};
use stoker_api::DataPipeline;

use super::{Identity, workers_name};
use crate::key::PipelineKey;
use crate::names;
use crate::tls::Issued;

/// How long a worker certificate is valid.
pub const VALIDITY: Duration = Duration::from_secs(365 * 24 * 3600);
/// A certificate with less than this left is issued again (its workers then restart).
pub const RENEW_BEFORE: Duration = Duration::from_secs(30 * 24 * 3600);
/// The CA that issued the Secret's certificate (a digest of its certificate).
pub const ISSUER_ANNOTATION: &str = "stoker.dev/issuer";
/// When the Secret's certificate expires (RFC 3339).
pub const EXPIRES_ANNOTATION: &str = "stoker.dev/certificate-expires";
/// On the worker pod template: a digest of the certificate, so a new one rolls the workers
/// (a worker reads its certificate once, at start).
pub const POD_CERTIFICATE_ANNOTATION: &str = "stoker.dev/tls-certificate";

pub fn secret_name(dp: &DataPipeline) -> String {
    names::child(&dp.name_any(), "-workers-tls")
}

/// The name the pipeline's worker certificates are for: its workers Service in its namespace.
pub fn server_name(pipeline: &PipelineKey) -> String {
    format!("{}.{}.svc", names::child(&pipeline.name, "-workers"), pipeline.namespace)
}

/// Why the Secret found (if any) must be issued again, or None when it is good.
pub fn reissue(existing: Option<&Secret>, issuer: &str, now: Timestamp) -> Option<&'static str> {
    let Some(secret) = existing else { return Some("missing") };
    let annotations = secret.annotations();
    let has = |key: &str| secret.data.as_ref().is_some_and(|d| d.get(key).is_some_and(|v| !v.0.is_empty()));
    if !(has("tls.crt") && has("tls.key") && has("ca.crt")) {
        return Some("incomplete");
    }
    if annotations.get(ISSUER_ANNOTATION).map(String::as_str) != Some(issuer) {
        return Some("issued by another CA");
    }
    let expires = annotations.get(EXPIRES_ANNOTATION).and_then(|t| t.parse::<Timestamp>().ok());
    let renew_from = expires.and_then(|e| e.checked_sub(jiff_span(RENEW_BEFORE)).ok());
    match renew_from {
        Some(from) if now < from => None,
        Some(_) => Some("expiring"),
        None => Some("no readable expiry"),
    }
}

/// A digest of the Secret's certificate, for the pod template annotation.
pub fn certificate_digest(secret: &Secret) -> Option<String> {
    let cert = secret.data.as_ref()?.get("tls.crt")?;
    Some(Sha256::digest(&cert.0)[..8].iter().map(|b| format!("{b:02x}")).collect())
}

pub(super) fn build(dp: &DataPipeline, identity: &Identity, issued: &Issued, ca_bundle: &str, issuer: &str) -> Secret {
    let mut meta = identity.meta(&secret_name(dp));
    let expires = Timestamp::from_second(issued.not_after.unix_timestamp()).unwrap_or(Timestamp::MAX);
    meta.annotations = Some(BTreeMap::from([
        (ISSUER_ANNOTATION.to_string(), issuer.to_string()),
        (EXPIRES_ANNOTATION.to_string(), expires.to_string()),
    ]));
    let bytes = |s: &str| ByteString(s.as_bytes().to_vec());
    Secret {
        metadata: meta,
        type_: Some("kubernetes.io/tls".into()),
        data: Some(BTreeMap::from([
            ("tls.crt".to_string(), bytes(&issued.cert_pem)),
            ("tls.key".to_string(), bytes(&issued.key_pem)),
            ("ca.crt".to_string(), bytes(ca_bundle)),
        ])),
        ..Default::default()
    }
}

/// Names of the Service the certificate is for, besides the workers' own (not needed by
/// clients, which verify the `.svc` name, but handy for tools that use the full name).
pub fn certificate_names(dp: &DataPipeline) -> Vec<String> {
    let key = PipelineKey::of(dp);
    let service = server_name(&key);
    debug_assert!(service.starts_with(&workers_name(dp)));
    vec![service.clone(), format!("{service}.cluster.local")]
}

fn jiff_span(d: Duration) -> k8s_openapi::jiff::SignedDuration {
    k8s_openapi::jiff::SignedDuration::from_secs(d.as_secs() as i64)
}
