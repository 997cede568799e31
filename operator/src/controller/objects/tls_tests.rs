//! The worker certificate Secret and what TLS changes in the workers' pods.

use std::time::Duration;

use k8s_openapi::api::core::v1::Secret;
use k8s_openapi::jiff::{SignedDuration, Timestamp};
use rustls::pki_types::CertificateDer;
use rustls::pki_types::pem::PemObject;
use stoker_api::DataPipeline;
use x509_parser::prelude::*;

use super::worker_tls::{self, EXPIRES_ANNOTATION, POD_CERTIFICATE_ANNOTATION, RENEW_BEFORE, reissue};
use super::*;
use crate::key::PipelineKey;
use crate::tls::Ca;

fn pipeline(name: &str) -> DataPipeline {
    let spec = stoker_api::from_yaml("source: {uri: 's3://b/train/', format: imageFolder}\nbatchSize: 8\n").unwrap();
    let mut dp = DataPipeline::new(name, spec);
    dp.metadata.namespace = Some("team-a".into());
    dp.metadata.uid = Some("uid-1".into());
    dp
}

fn ca() -> Ca {
    Ca::generate("test CA", Duration::from_secs(10 * 365 * 24 * 3600)).unwrap().0
}

fn secret_for(dp: &DataPipeline, ca: &Ca, valid_for: Duration) -> Secret {
    let issued = ca.issue(&worker_tls::certificate_names(dp), valid_for).unwrap();
    worker_certificate(dp, &issued, ca.cert_pem(), ca.fingerprint())
}

fn data<'a>(secret: &'a Secret, key: &str) -> &'a [u8] {
    &secret.data.as_ref().unwrap()[key].0
}

#[test]
fn the_certificate_is_for_the_workers_service_and_owned_by_the_pipeline() {
    let (dp, ca) = (pipeline("imagenet"), ca());
    let secret = secret_for(&dp, &ca, worker_tls::VALIDITY);
    assert_eq!(secret.metadata.name.as_deref(), Some("imagenet-workers-tls"));
    assert_eq!(secret.metadata.namespace.as_deref(), Some("team-a"));
    assert_eq!(secret.type_.as_deref(), Some("kubernetes.io/tls"));
    let owner = &secret.metadata.owner_references.as_ref().unwrap()[0];
    assert_eq!((owner.kind.as_str(), owner.name.as_str(), owner.controller), ("DataPipeline", "imagenet", Some(true)));
    assert_eq!(data(&secret, "ca.crt"), ca.cert_pem().as_bytes());
    assert!(String::from_utf8_lossy(data(&secret, "tls.key")).starts_with("-----BEGIN PRIVATE KEY-----"));

    let leaf = CertificateDer::pem_slice_iter(data(&secret, "tls.crt")).next().unwrap().unwrap();
    let (_, leaf) = X509Certificate::from_der(&leaf).unwrap();
    let san = leaf.subject_alternative_name().unwrap().unwrap().value;
    let names: Vec<String> = san.general_names.iter().map(|n| n.to_string()).collect();
    assert_eq!(names, ["DNSName(imagenet-workers.team-a.svc)", "DNSName(imagenet-workers.team-a.svc.cluster.local)"]);
    // The name the dispatcher tells clients is the one in the certificate.
    assert_eq!(worker_tls::server_name(&PipelineKey::of(&dp)), "imagenet-workers.team-a.svc");
    let expires: Timestamp = secret.metadata.annotations.as_ref().unwrap()[EXPIRES_ANNOTATION].parse().unwrap();
    assert_eq!(expires.as_second(), leaf.validity().not_after.timestamp());
    let days = (leaf.validity().not_after.timestamp() - Timestamp::now().as_second()) / 86_400;
    assert!((364..=365).contains(&days), "valid for a year, not {days} days");
}

#[test]
fn a_long_pipeline_name_gets_the_same_hashed_service_name_as_its_service() {
    let dp = pipeline(&format!("{}.train", "a".repeat(240)));
    let o = build(&dp, &WorkerDefaults { tls: true, ..defaults() }, 1, None, None);
    let service = o.service.metadata.name.unwrap();
    assert_eq!(worker_tls::server_name(&PipelineKey::of(&dp)), format!("{service}.team-a.svc"));
    assert!(worker_tls::secret_name(&dp).len() <= 63);
}

#[test]
fn a_valid_certificate_is_kept_and_a_missing_foreign_or_expiring_one_is_issued_again() {
    let (dp, ca) = (pipeline("p"), ca());
    let now = Timestamp::now();
    let good = secret_for(&dp, &ca, worker_tls::VALIDITY);
    assert_eq!(reissue(Some(&good), ca.fingerprint(), now), None, "kept while valid");
    assert_eq!(reissue(None, ca.fingerprint(), now), Some("missing"));
    let other = self::ca();
    assert_eq!(reissue(Some(&good), other.fingerprint(), now), Some("issued by another CA"));
    // Within the renewal margin of its expiry.
    let later = now + SignedDuration::from_secs((worker_tls::VALIDITY - RENEW_BEFORE).as_secs() as i64 + 3600);
    assert_eq!(reissue(Some(&good), ca.fingerprint(), later), Some("expiring"));
    let short = secret_for(&dp, &ca, RENEW_BEFORE / 2);
    assert_eq!(reissue(Some(&short), ca.fingerprint(), now), Some("expiring"));
    let mut emptied = good.clone();
    emptied.data.as_mut().unwrap().remove("tls.key");
    assert_eq!(reissue(Some(&emptied), ca.fingerprint(), now), Some("incomplete"));
}

fn defaults() -> WorkerDefaults {
    WorkerDefaults {
        image: "stoker-worker:test".into(),
        dispatcher_url: "https://d:50051".into(),
        token_audience: None,
        tls: true,
        network_policy: None,
    }
}

#[test]
fn tls_workers_mount_their_certificate_and_restart_on_a_new_one() {
    let (dp, ca) = (pipeline("p"), ca());
    let secret = secret_for(&dp, &ca, worker_tls::VALIDITY);
    let digest = worker_tls::certificate_digest(&secret).unwrap();
    let o = build(&dp, &defaults(), 1, None, Some(&digest));
    let template = &o.deployment.spec.template;
    let annotations = template.metadata.as_ref().unwrap().annotations.as_ref().unwrap();
    assert_eq!(annotations[POD_CERTIFICATE_ANNOTATION], digest);
    let pod = template.spec.as_ref().unwrap();
    let volume = pod.volumes.iter().flatten().find(|v| v.name == "stoker-tls").unwrap();
    assert_eq!(volume.secret.as_ref().unwrap().secret_name.as_deref(), Some("p-workers-tls"));
    let env =
        |name: &str| pod.containers[0].env.iter().flatten().find(|e| e.name == name).and_then(|e| e.value.clone());
    assert_eq!(env("STOKER_TLS_CERT_FILE").as_deref(), Some("/var/run/secrets/stoker.dev/tls/tls.crt"));
    assert_eq!(env("STOKER_TLS_KEY_FILE").as_deref(), Some("/var/run/secrets/stoker.dev/tls/tls.key"));
    assert_eq!(env("STOKER_CA_FILE").as_deref(), Some("/var/run/secrets/stoker.dev/tls/ca.crt"));
    assert_eq!(env("STOKER_DISPATCHER").as_deref(), Some("https://d:50051"));

    let renewed = secret_for(&dp, &ca, worker_tls::VALIDITY);
    let digest2 = worker_tls::certificate_digest(&renewed).unwrap();
    assert_ne!(digest, digest2, "a new certificate, a new pod template");

    let plain = build(&dp, &WorkerDefaults { tls: false, ..defaults() }, 1, None, Some(&digest));
    let pod = plain.deployment.spec.template;
    assert!(pod.metadata.unwrap().annotations.is_none());
    let pod = pod.spec.unwrap();
    assert!(pod.volumes.iter().flatten().all(|v| v.name != "stoker-tls"));
    assert!(pod.containers[0].env.iter().flatten().all(|e| e.name != "STOKER_TLS_CERT_FILE"));
}
