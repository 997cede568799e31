//! Certificates: the CA the operator signs each pipeline's worker certificate with (rcgen, ring
//! backend), and the dispatcher's TLS server settings. `stoker local --tls` and the tests make
//! a throwaway CA here too, so every certificate Stoker issues is made one way.

use std::path::Path;
use std::time::Duration;

use anyhow::{Context as _, bail};
use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair, KeyUsagePurpose,
};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use sha2::{Digest, Sha256};
use time::OffsetDateTime;
use tonic::transport::{Identity, ServerTlsConfig};

/// Clocks of nodes differ a little: a certificate is valid from slightly before it was made.
const BACKDATE: Duration = Duration::from_secs(300);

/// A CA that signs certificates: its key, and its certificate chain as PEM (appended to every
/// certificate it issues, so a client that trusts only the root still verifies an
/// intermediate's certificates).
pub struct Ca {
    issuer: Issuer<'static, KeyPair>,
    chain_pem: String,
    fingerprint: String,
}

/// A certificate and its key, as PEM, and when it stops being valid.
#[derive(Clone, Debug)]
pub struct Issued {
    /// The certificate followed by the issuing CA's chain.
    pub cert_pem: String,
    pub key_pem: String,
    pub not_after: OffsetDateTime,
}

impl std::fmt::Debug for Ca {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Ca").field("fingerprint", &self.fingerprint).finish_non_exhaustive()
    }
}

impl Ca {
    /// The CA of `--tls-ca-cert-file` and `--tls-ca-key-file`.
    pub fn load(cert_file: &Path, key_file: &Path) -> anyhow::Result<Ca> {
        let read = |path: &Path, what: &str| -> anyhow::Result<String> {
            let bytes = stoker_api::tls::read_pem(path, what)?;
            String::from_utf8(bytes).with_context(|| format!("{} is not PEM text", path.display()))
        };
        let (cert, key) = (read(cert_file, "CA certificate")?, read(key_file, "CA key")?);
        Ca::from_pem(&cert, &key)
            .with_context(|| format!("loading the CA from {} and {}", cert_file.display(), key_file.display()))
    }

    /// A CA from its certificate chain (the CA's own certificate first) and key, as PEM. The
    /// key may be PKCS#8 or PKCS#1 RSA (what Helm's `genCA` makes).
    pub fn from_pem(cert_pem: &str, key_pem: &str) -> anyhow::Result<Ca> {
        let der = PrivateKeyDer::from_pem_slice(key_pem.as_bytes()).context("no private key in the CA key PEM")?;
        // rcgen's ring backend reads PKCS#8 only: wrap a PKCS#1 RSA key, which is lossless.
        let pkcs8 = match der {
            PrivateKeyDer::Pkcs8(k) => k.secret_pkcs8_der().to_vec(),
            PrivateKeyDer::Pkcs1(k) => rsa_pkcs1_to_pkcs8(k.secret_pkcs1_der()),
            PrivateKeyDer::Sec1(_) => bail!(
                "the CA key is a SEC1 EC key; give it as PKCS#8 (`openssl pkcs8 -topk8 -nocrypt`, or cert-manager's \
                 privateKey.encoding: PKCS8)"
            ),
            _ => bail!("the CA key is of an unknown kind"),
        };
        let key = KeyPair::try_from(pkcs8.as_slice()).context("the CA key is not a key rcgen can sign with")?;
        let first = CertificateDer::pem_slice_iter(cert_pem.as_bytes())
            .next()
            .context("no certificate in the CA certificate PEM")?
            .context("parsing the CA certificate PEM")?;
        let issuer = Issuer::from_ca_cert_der(&first, key).context("reading the CA certificate")?;
        Ok(Ca { issuer, chain_pem: normalized(cert_pem), fingerprint: fingerprint(&first) })
    }

    /// A new self-signed CA valid for `valid_for`, and its key as PEM (for `stoker local --tls`
    /// and tests).
    pub fn generate(common_name: &str, valid_for: Duration) -> anyhow::Result<(Ca, String)> {
        let mut params = CertificateParams::default();
        params.distinguished_name = rcgen::DistinguishedName::new();
        params.distinguished_name.push(DnType::CommonName, common_name);
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
        let now = OffsetDateTime::now_utc();
        params.not_before = now - BACKDATE;
        params.not_after = now + valid_for;
        let key = KeyPair::generate()?;
        let cert = params.self_signed(&key)?;
        let key_pem = key.serialize_pem();
        let fingerprint = fingerprint(cert.der());
        Ok((Ca { issuer: Issuer::new(params, key), chain_pem: cert.pem(), fingerprint }, key_pem))
    }

    /// The CA's certificate chain (what clients trust, for a root CA).
    pub fn cert_pem(&self) -> &str {
        &self.chain_pem
    }

    /// Names this CA (a digest of its certificate): a certificate issued by another one is
    /// issued again.
    pub fn fingerprint(&self) -> &str {
        &self.fingerprint
    }

    /// A server certificate for `names` (DNS names or IP addresses), valid from now for
    /// `valid_for`, with a new key.
    pub fn issue(&self, names: &[String], valid_for: Duration) -> anyhow::Result<Issued> {
        let mut params = CertificateParams::new(names.to_vec()).context("a certificate name is invalid")?;
        params.distinguished_name = rcgen::DistinguishedName::new();
        params.distinguished_name.push(DnType::CommonName, names.first().cloned().unwrap_or_default());
        params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
        params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
        params.use_authority_key_identifier_extension = true;
        let now = OffsetDateTime::now_utc();
        params.not_before = now - BACKDATE;
        params.not_after = now + valid_for;
        let key = KeyPair::generate()?;
        let cert = params.signed_by(&key, &self.issuer).context("signing the certificate")?;
        Ok(Issued {
            cert_pem: format!("{}{}", cert.pem(), self.chain_pem),
            key_pem: key.serialize_pem(),
            not_after: params.not_after,
        })
    }
}

/// The TLS settings of a server whose certificate chain and key are in these files.
pub fn server_config(cert_file: &Path, key_file: &Path) -> anyhow::Result<ServerTlsConfig> {
    install_ring();
    let cert = stoker_api::tls::read_pem(cert_file, "TLS certificate")?;
    let key = stoker_api::tls::read_pem(key_file, "TLS key")?;
    // Checked here, so a bad file fails at startup with its name, not at the first handshake.
    CertificateDer::pem_slice_iter(&cert)
        .next()
        .with_context(|| format!("no certificate in {}", cert_file.display()))?
        .with_context(|| format!("parsing {}", cert_file.display()))?;
    PrivateKeyDer::from_pem_slice(&key).with_context(|| format!("no private key in {}", key_file.display()))?;
    Ok(ServerTlsConfig::new().identity(Identity::from_pem(cert, key)))
}

/// tonic's TLS server takes rustls's process-wide provider, and with both ring and aws-lc-rs
/// compiled in (object_store brings the latter) rustls cannot choose: choose ring, as every
/// Stoker binary does. A no-op when one is installed already.
pub fn install_ring() {
    let _ = rustls::crypto::ring::default_provider().install_default();
}

fn fingerprint(der: &CertificateDer<'_>) -> String {
    Sha256::digest(der.as_ref())[..8].iter().map(|b| format!("{b:02x}")).collect()
}

/// PEM text ending in exactly one newline, so chains concatenate cleanly.
fn normalized(pem: &str) -> String {
    format!("{}\n", pem.trim_end())
}

/// PKCS#8 PrivateKeyInfo around a PKCS#1 RSAPrivateKey (RFC 5208): version 0, the
/// rsaEncryption algorithm with NULL parameters, and the key as an octet string.
fn rsa_pkcs1_to_pkcs8(pkcs1: &[u8]) -> Vec<u8> {
    const VERSION: &[u8] = &[0x02, 0x01, 0x00];
    // SEQUENCE { OID 1.2.840.113549.1.1.1, NULL }
    const RSA_ALGORITHM: &[u8] =
        &[0x30, 0x0d, 0x06, 0x09, 0x2a, 0x86, 0x48, 0x86, 0xf7, 0x0d, 0x01, 0x01, 0x01, 0x05, 0x00];
    let key = der(0x04, pkcs1);
    der(0x30, &[VERSION, RSA_ALGORITHM, &key].concat())
}

/// A DER TLV with a definite length.
fn der(tag: u8, content: &[u8]) -> Vec<u8> {
    let mut out = vec![tag];
    let len = content.len();
    if len < 0x80 {
        out.push(len as u8);
    } else {
        let bytes: Vec<u8> = len.to_be_bytes().into_iter().skip_while(|b| *b == 0).collect();
        out.push(0x80 | bytes.len() as u8);
        out.extend(bytes);
    }
    out.extend_from_slice(content);
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use x509_parser::prelude::*;

    const YEAR: Duration = Duration::from_secs(365 * 24 * 3600);

    #[test]
    fn an_issued_certificate_names_its_hosts_and_chains_to_the_ca() {
        let (ca, _) = Ca::generate("test CA", YEAR).unwrap();
        let names = vec!["p-workers.team-a.svc".to_string(), "127.0.0.1".to_string()];
        let issued = ca.issue(&names, Duration::from_secs(3600)).unwrap();
        let certs: Vec<_> = CertificateDer::pem_slice_iter(issued.cert_pem.as_bytes()).map(Result::unwrap).collect();
        assert_eq!(certs.len(), 2, "the leaf and the CA");
        let (_, leaf) = X509Certificate::from_der(&certs[0]).unwrap();
        let (_, root) = X509Certificate::from_der(&certs[1]).unwrap();
        assert_eq!(leaf.issuer(), root.subject());
        assert!(leaf.verify_signature(Some(root.public_key())).is_ok());
        let san = leaf.subject_alternative_name().unwrap().unwrap().value;
        let dns: Vec<String> = san.general_names.iter().map(|n| n.to_string()).collect();
        assert_eq!(dns, ["DNSName(p-workers.team-a.svc)", "IPAddress(7f:00:00:01)"], "127.0.0.1 as an IP SAN");
        let lifetime = leaf.validity().not_after.timestamp() - leaf.validity().not_before.timestamp();
        assert_eq!(lifetime, 3600 + BACKDATE.as_secs() as i64);
        assert_eq!(leaf.validity().not_after.timestamp(), issued.not_after.unix_timestamp());
        assert!(!leaf.is_ca());
    }

    #[test]
    fn a_ca_is_loaded_from_pem_with_a_pkcs1_rsa_key_too() {
        let (ca, key_pem) = Ca::generate("ca", YEAR).unwrap();
        let again = Ca::from_pem(ca.cert_pem(), &key_pem).unwrap();
        assert_eq!(again.fingerprint(), ca.fingerprint());
        assert!(again.issue(&["x.y.svc".into()], YEAR).is_ok());

        // Helm's genCA makes an RSA CA with its key in PKCS#1 ("RSA PRIVATE KEY"): this fixture
        // is the chart's selfSigned CA (`helm template --set tls.enabled=true`).
        let (cert, key) = (include_str!("../testdata/rsa-ca.crt"), include_str!("../testdata/rsa-ca.key"));
        assert!(key.starts_with("-----BEGIN RSA PRIVATE KEY-----"));
        let rsa = Ca::from_pem(cert, key).unwrap();
        let issued = rsa.issue(&["x.y.svc".into()], YEAR).unwrap();
        let leaf = CertificateDer::pem_slice_iter(issued.cert_pem.as_bytes()).next().unwrap().unwrap();
        let root = CertificateDer::from_pem_slice(cert.as_bytes()).unwrap();
        let ((_, leaf), (_, root)) =
            (X509Certificate::from_der(&leaf).unwrap(), X509Certificate::from_der(&root).unwrap());
        assert!(leaf.verify_signature(Some(root.public_key())).is_ok(), "signed with the RSA key");
        assert_eq!(der(0x04, &[0u8; 300])[..4], [0x04, 0x82, 0x01, 0x2c], "long-form lengths");
    }

    #[test]
    fn a_missing_or_bad_file_is_named() {
        let e = Ca::load(Path::new("/nonexistent/ca.crt"), Path::new("/nonexistent/ca.key")).unwrap_err();
        assert!(format!("{e:#}").contains("/nonexistent/ca.crt"), "{e:#}");
        let e = Ca::from_pem("not pem", "not pem").unwrap_err();
        assert!(format!("{e:#}").contains("no private key"), "{e:#}");
    }
}
