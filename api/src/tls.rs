//! Transport security shared by every component: where certificates come from (flags and
//! environment), and how to tell a TLS failure from any other connection error, so that a
//! client that cannot verify a peer says so rather than "transport error".

use std::error::Error as StdError;
use std::path::{Path, PathBuf};

/// A PEM bundle of the CA certificates a client trusts (the dispatcher's and the workers'
/// certificates must chain to one of them). Clients read it when given no CA explicitly.
pub const CA_FILE_ENV: &str = "STOKER_CA_FILE";
/// A server's certificate chain and key (PEM): the dispatcher's and the workers'.
pub const CERT_FILE_ENV: &str = "STOKER_TLS_CERT_FILE";
pub const KEY_FILE_ENV: &str = "STOKER_TLS_KEY_FILE";

/// Where the operator mounts a worker's certificate (`tls.crt`, `tls.key`) and the CA bundle
/// it verifies the dispatcher with (`ca.crt`).
pub const WORKER_TLS_DIR: &str = "/var/run/secrets/stoker.dev/tls";
/// The worker pods' TLS volume, as (name, mount path).
pub const WORKER_TLS_VOLUME: (&str, &str) = ("stoker-tls", WORKER_TLS_DIR);

#[derive(Debug, thiserror::Error)]
#[error("reading the {what} {path}: {source}")]
pub struct ReadError {
    pub what: String,
    pub path: PathBuf,
    #[source]
    pub source: std::io::Error,
}

/// Reads a PEM file, naming what it is for in the error.
pub fn read_pem(path: &Path, what: &str) -> Result<Vec<u8>, ReadError> {
    std::fs::read(path).map_err(|source| ReadError { what: what.into(), path: path.into(), source })
}

/// The CA file a client uses: the one given, else the one `STOKER_CA_FILE` names (if set).
pub fn ca_file(explicit: Option<&Path>) -> Option<PathBuf> {
    explicit
        .map(Path::to_path_buf)
        .or_else(|| std::env::var_os(CA_FILE_ENV).filter(|p| !p.is_empty()).map(PathBuf::from))
}

/// How to reach a server, from its URL and whether the caller has a CA.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Scheme {
    Plaintext,
    Tls,
}

/// `https://` means TLS (a CA is then required), `http://` plaintext; without a scheme, TLS
/// exactly when the caller has a CA. A CA given explicitly (not from the environment) with an
/// `http://` URL is a contradiction, refused rather than silently ignored.
pub fn scheme(url: &str, has_ca: bool, ca_explicit: bool) -> Result<Scheme, String> {
    if url.starts_with("https://") {
        return if has_ca {
            Ok(Scheme::Tls)
        } else {
            Err(format!("{url} asks for TLS but no CA was given (the client's CA option, or {CA_FILE_ENV})"))
        };
    }
    if url.starts_with("http://") {
        return if ca_explicit {
            Err(format!("{url} asks for plaintext but a CA was given: use https:// (or no scheme) for TLS"))
        } else {
            Ok(Scheme::Plaintext)
        };
    }
    Ok(if has_ca { Scheme::Tls } else { Scheme::Plaintext })
}

/// `url` with the scheme `scheme` calls for (tonic decides TLS by the URI's scheme).
pub fn with_scheme(url: &str, scheme: &Scheme) -> String {
    let rest = url.split_once("://").map_or(url, |(_, rest)| rest);
    match scheme {
        Scheme::Tls => format!("https://{rest}"),
        Scheme::Plaintext => format!("http://{rest}"),
    }
}

/// What went wrong in TLS, if anything in `error`'s chain is a TLS error: the peer's
/// certificate not verifying (unknown CA, wrong name, expired), the peer not speaking TLS, or
/// an alert from it.
pub fn tls_failure(error: &(dyn StdError + 'static)) -> Option<String> {
    let mut next = Some(error);
    while let Some(e) = next {
        if let Some(rustls) = e.downcast_ref::<rustls::Error>() {
            return Some(describe(rustls));
        }
        if let Some(io) = e.downcast_ref::<std::io::Error>()
            && let Some(rustls) = io.get_ref().and_then(|inner| inner.downcast_ref::<rustls::Error>())
        {
            return Some(describe(rustls));
        }
        next = e.source();
    }
    None
}

fn describe(e: &rustls::Error) -> String {
    use rustls::{CertificateError, Error};
    match e {
        Error::InvalidCertificate(CertificateError::UnknownIssuer) => {
            "the server's certificate is not signed by a CA this client trusts (wrong or missing CA file?)".into()
        }
        Error::InvalidCertificate(
            CertificateError::NotValidForName | CertificateError::NotValidForNameContext { .. },
        ) => format!("the server's certificate is not for the name this client expects ({e})"),
        Error::InvalidCertificate(CertificateError::Expired | CertificateError::ExpiredContext { .. }) => {
            format!("the server's certificate has expired ({e})")
        }
        Error::InvalidMessage(_) | Error::InappropriateMessage { .. } => {
            format!("the server does not speak TLS (is it serving plaintext? use http:// or no CA) ({e})")
        }
        other => other.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_scheme_decides_and_a_ca_alone_means_tls() {
        assert_eq!(scheme("https://d:1", true, false), Ok(Scheme::Tls));
        assert!(scheme("https://d:1", false, false).unwrap_err().contains("no CA"));
        assert_eq!(scheme("http://d:1", true, false), Ok(Scheme::Plaintext), "an environment CA does not upgrade http");
        assert!(scheme("http://d:1", true, true).unwrap_err().contains("plaintext"));
        assert_eq!(scheme("d:1", true, false), Ok(Scheme::Tls));
        assert_eq!(scheme("d:1", false, false), Ok(Scheme::Plaintext));
        assert_eq!(with_scheme("d:1", &Scheme::Tls), "https://d:1");
        assert_eq!(with_scheme("http://d:1", &Scheme::Tls), "https://d:1");
        assert_eq!(with_scheme("https://d:1", &Scheme::Plaintext), "http://d:1");
    }

    #[test]
    fn a_tls_error_is_found_inside_an_io_error() {
        let inner = rustls::Error::InvalidCertificate(rustls::CertificateError::UnknownIssuer);
        let io = std::io::Error::new(std::io::ErrorKind::InvalidData, inner);
        let said = tls_failure(&io).unwrap();
        assert!(said.contains("not signed by a CA this client trusts"), "{said}");
        assert_eq!(tls_failure(&std::io::Error::other("refused")), None);
    }
}
