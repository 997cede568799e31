//! `stoker local --tls`: a throwaway CA made at startup, a certificate for the dispatcher
//! (localhost and the listening address) and one for the pipeline's workers (for the name the
//! dispatcher tells clients, as in a cluster), written to a directory; clients trust its
//! `ca.crt`.

use std::net::IpAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::Context as _;
use stoker_operator::controller::objects::worker_tls;
use stoker_operator::key::PipelineKey;
use stoker_operator::tls::{Ca, Issued};

/// Long enough for any local run; the CA is made anew at every start anyway.
const VALIDITY: Duration = Duration::from_secs(30 * 24 * 3600);

/// A worker's certificate, key and the CA it verifies the dispatcher with, as files.
#[derive(Clone, Debug)]
pub struct WorkerTlsFiles {
    pub cert: PathBuf,
    pub key: PathBuf,
    pub ca: PathBuf,
}

pub struct LocalTls {
    /// What clients trust.
    pub ca_file: PathBuf,
    pub dispatcher: tonic::transport::ServerTlsConfig,
    pub workers: WorkerTlsFiles,
}

/// Makes the CA and certificates under `dir`: `ca.crt`, `dispatcher.{crt,key}`, `workers.{crt,key}`.
pub fn generate(dir: &Path, listen: IpAddr, pipeline: &PipelineKey) -> anyhow::Result<LocalTls> {
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let (ca, _key) = Ca::generate("stoker local CA", VALIDITY)?;
    let ca_file = dir.join("ca.crt");
    write(&ca_file, ca.cert_pem(), 0o644)?;
    let mut names = vec!["localhost".to_string(), "127.0.0.1".to_string(), "::1".to_string()];
    if !listen.is_unspecified() && !listen.is_loopback() {
        names.push(listen.to_string());
    }
    let (cert, key) = save(dir, "dispatcher", &ca.issue(&names, VALIDITY)?)?;
    let dispatcher = stoker_operator::tls::server_config(&cert, &key)?;
    let (cert, key) = save(dir, "workers", &ca.issue(&[worker_tls::server_name(pipeline)], VALIDITY)?)?;
    Ok(LocalTls { ca_file: ca_file.clone(), dispatcher, workers: WorkerTlsFiles { cert, key, ca: ca_file } })
}

fn save(dir: &Path, name: &str, issued: &Issued) -> anyhow::Result<(PathBuf, PathBuf)> {
    let (cert, key) = (dir.join(format!("{name}.crt")), dir.join(format!("{name}.key")));
    write(&cert, &issued.cert_pem, 0o644)?;
    write(&key, &issued.key_pem, 0o600)?;
    Ok((cert, key))
}

fn write(path: &Path, text: &str, mode: u32) -> anyhow::Result<()> {
    use std::io::Write as _;
    use std::os::unix::fs::OpenOptionsExt as _;
    use std::os::unix::fs::PermissionsExt as _;
    let mut file = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(mode)
        .open(path)
        .with_context(|| format!("writing {}", path.display()))?;
    // An existing file keeps its mode on open: a key must not stay readable by others.
    file.set_permissions(std::fs::Permissions::from_mode(mode))?;
    file.write_all(text.as_bytes()).with_context(|| format!("writing {}", path.display()))
}
