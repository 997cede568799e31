//! How the client reaches the dispatcher and workers: plaintext, or TLS verifying their
//! certificates against the client's CA (`ClientOptions::tls_ca`, else `STOKER_CA_FILE`).
//! Workers are dialled by IP but verified against the name the dispatcher's worker list gives
//! (their Service's), since their certificates cannot name pod IPs known in advance.

use std::path::PathBuf;

use stoker_api::tls::{Scheme, ca_file, read_pem, scheme, with_scheme};
use tonic::transport::{Certificate, ClientTlsConfig};

use crate::error::Error;
use crate::options::ClientOptions;

/// How to dial a worker.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum WorkerTls {
    /// A fixed list of workers: the address's scheme and the client's CA decide, and the
    /// certificate must be for the address's host.
    ByAddress,
    /// Listed by the dispatcher: TLS, verifying the certificate against this name.
    Verify(String),
    /// Listed by the dispatcher, whose workers serve plaintext.
    Plaintext,
}

impl WorkerTls {
    /// From a worker list's `tls_server_name`.
    pub(crate) fn listed(name: &str) -> WorkerTls {
        if name.is_empty() { WorkerTls::Plaintext } else { WorkerTls::Verify(name.to_string()) }
    }
}

/// The client's CA, read from its file.
struct Ca {
    path: PathBuf,
    certificate: Certificate,
}

fn ca(options: &ClientOptions) -> Result<Option<Ca>, Error> {
    let Some(path) = ca_file(options.tls_ca.as_deref()) else { return Ok(None) };
    let pem = read_pem(&path, "CA file").map_err(|e| Error::InvalidOptions(e.to_string()))?;
    if !String::from_utf8_lossy(&pem).contains("-----BEGIN CERTIFICATE-----") {
        return Err(Error::InvalidOptions(format!("the CA file {} holds no PEM certificate", path.display())));
    }
    Ok(Some(Ca { path, certificate: Certificate::from_pem(pem) }))
}

fn config(ca: Ca) -> ClientTlsConfig {
    ClientTlsConfig::new().ca_certificate(ca.certificate)
}

/// The dispatcher's URL with its scheme, and TLS settings when it is reached over TLS.
pub(crate) fn dispatcher(url: &str, options: &ClientOptions) -> Result<(String, Option<ClientTlsConfig>), Error> {
    by_url(url, options, options.tls_server_name.as_deref())
}

/// `url` with its scheme and, over TLS, verified against `name` (default: the URL's host).
fn by_url(url: &str, options: &ClientOptions, name: Option<&str>) -> Result<(String, Option<ClientTlsConfig>), Error> {
    let ca = ca(options)?;
    let scheme = scheme(url, ca.is_some(), options.tls_ca.is_some()).map_err(Error::InvalidOptions)?;
    let tls = match scheme {
        Scheme::Tls => ca.map(config).map(|c| match name {
            Some(name) => c.domain_name(name),
            None => c,
        }),
        Scheme::Plaintext => None,
    };
    Ok((with_scheme(url, &scheme), tls))
}

/// A worker's URI and TLS settings.
pub(crate) fn worker(
    address: &str,
    options: &ClientOptions,
    how: &WorkerTls,
) -> Result<(String, Option<ClientTlsConfig>), Error> {
    match how {
        // A fixed worker is verified against its own address, never the dispatcher's name.
        WorkerTls::ByAddress => by_url(address, options, None),
        WorkerTls::Plaintext => Ok((with_scheme(address, &Scheme::Plaintext), None)),
        WorkerTls::Verify(name) => {
            let ca = ca(options)?.ok_or_else(|| Error::Tls {
                peer: address.to_string(),
                problem: format!(
                    "the pipeline's workers serve TLS (certificates for {name}) but the client has no CA: set \
                     tls_ca or {}",
                    stoker_api::tls::CA_FILE_ENV
                ),
            })?;
            tracing::trace!(ca = %ca.path.display(), %name, "verifying a worker");
            Ok((with_scheme(address, &Scheme::Tls), Some(config(ca).domain_name(name.clone()))))
        }
    }
}

/// Whether TLS failed in `error`, and how, for an `Error::Tls` instead of a bare transport
/// error. Also a plaintext call answered by a TLS server: its first bytes (a TLS alert record)
/// read as an HTTP/2 frame header announce a frame far over the limit, FRAME_SIZE_ERROR before
/// any frame was exchanged; said as a likely TLS server rather than "h2 protocol error".
pub(crate) fn failure(peer: &str, error: &(dyn std::error::Error + 'static)) -> Option<Error> {
    if let Some(problem) = stoker_api::tls::tls_failure(error) {
        return Some(Error::Tls { peer: peer.to_string(), problem });
    }
    let plaintext = peer.starts_with("http://") || !peer.contains("://");
    let mut next = Some(error);
    while let Some(e) = next {
        if plaintext && format!("{e:?}").contains("FRAME_SIZE_ERROR") {
            return Some(Error::Tls {
                peer: peer.to_string(),
                problem: format!(
                    "it does not answer plaintext HTTP/2 and probably serves TLS: use https:// and give the client \
                     its CA (tls_ca or {}) ({e})",
                    stoker_api::tls::CA_FILE_ENV
                ),
            });
        }
        next = e.source();
    }
    None
}
