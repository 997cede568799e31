//! The caller's credential on every RPC: a Kubernetes ServiceAccount token with Stoker's
//! audience, sent as `authorization: Bearer <token>`. Pods get it as a projected token file
//! that the kubelet rotates, so a file source reads it again every minute.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tonic::metadata::MetadataValue;

use crate::proto;

/// The audience of Stoker tokens unless the operator is told another.
pub const DEFAULT_AUDIENCE: &str = "stoker.dev";
/// Where the operator mounts workers' projected token, and where clients look by default.
pub const DEFAULT_TOKEN_DIR: &str = "/var/run/secrets/stoker.dev/serviceaccount";
pub const DEFAULT_TOKEN_FILE: &str = "/var/run/secrets/stoker.dev/serviceaccount/token";
/// A token file path, overriding the default (the operator sets it in worker pods).
pub const TOKEN_FILE_ENV: &str = "STOKER_TOKEN_FILE";

/// How long a token read from a file is used before reading the file again. The kubelet
/// rewrites a projected token at 80% of its lifetime (at least ten minutes), so a minute-old
/// copy is always still valid.
const REREAD_AFTER: Duration = Duration::from_secs(60);

/// Where the token comes from. Cheap to clone; clones share the file cache.
#[derive(Clone, Debug, Default)]
pub enum TokenSource {
    /// No token: for `stoker local` and clusters that run without authentication.
    #[default]
    None,
    /// A token given explicitly.
    Static(String),
    /// A token file, read again every minute.
    File(Arc<TokenFile>),
}

#[derive(Debug)]
pub struct TokenFile {
    path: PathBuf,
    read: Mutex<Option<(Instant, String)>>,
}

impl TokenSource {
    pub fn file(path: impl Into<PathBuf>) -> Self {
        TokenSource::File(Arc::new(TokenFile { path: path.into(), read: Mutex::new(None) }))
    }

    /// `explicit` if given; else the file `STOKER_TOKEN_FILE` names; else the default projected
    /// token file if it exists; else none (the server then says that a token is missing).
    pub fn discover(explicit: Option<String>) -> Self {
        if let Some(token) = explicit.filter(|t| !t.is_empty()) {
            return TokenSource::Static(token);
        }
        if let Some(path) = std::env::var_os(TOKEN_FILE_ENV).filter(|p| !p.is_empty()) {
            return TokenSource::file(path);
        }
        if Path::new(DEFAULT_TOKEN_FILE).exists() { TokenSource::file(DEFAULT_TOKEN_FILE) } else { TokenSource::None }
    }

    /// The token to send now; a file that cannot be read gives none (and the server a clear
    /// UNAUTHENTICATED) rather than failing the caller here.
    pub fn current(&self) -> Option<String> {
        match self {
            TokenSource::None => None,
            TokenSource::Static(token) => Some(token.clone()),
            TokenSource::File(file) => file.current(),
        }
    }

    /// Puts the token (if any) into a request's metadata.
    pub fn attach<T>(&self, request: &mut tonic::Request<T>) {
        if let Some(value) = self.current().and_then(|t| MetadataValue::try_from(proto::bearer(&t)).ok()) {
            request.metadata_mut().insert(proto::AUTHORIZATION, value);
        }
    }
}

impl TokenFile {
    fn current(&self) -> Option<String> {
        let mut read = self.read.lock().unwrap();
        if let Some((at, token)) = read.as_ref()
            && at.elapsed() < REREAD_AFTER
        {
            return Some(token.clone());
        }
        match std::fs::read_to_string(&self.path) {
            Ok(token) => {
                let token = token.trim().to_string();
                *read = Some((Instant::now(), token.clone()));
                Some(token)
            }
            Err(e) => {
                // Keep a token read before: the kubelet swaps the file by symlink, and a
                // failed read in between must not make the next call anonymous.
                tracing::warn!(path = %self.path.display(), error = %e, "cannot read the ServiceAccount token file");
                read.as_ref().map(|(_, t)| t.clone())
            }
        }
    }
}

/// Adds the token to every call of a tonic client (`Client::with_interceptor`).
impl tonic::service::Interceptor for TokenSource {
    fn call(&mut self, mut request: tonic::Request<()>) -> Result<tonic::Request<()>, tonic::Status> {
        self.attach(&mut request);
        Ok(request)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_explicit_token_wins_and_a_file_is_read_and_kept() {
        assert_eq!(TokenSource::discover(Some("abc".into())).current().as_deref(), Some("abc"));
        let dir = std::env::temp_dir().join(format!("stoker-token-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("token");
        std::fs::write(&path, "tok-1\n").unwrap();
        let source = TokenSource::file(&path);
        assert_eq!(source.current().as_deref(), Some("tok-1"));
        // Gone for a moment (the kubelet's swap): the last token read is still sent.
        std::fs::remove_file(&path).unwrap();
        assert_eq!(source.current().as_deref(), Some("tok-1"));
        let mut request = tonic::Request::new(());
        source.attach(&mut request);
        assert_eq!(proto::request_token(request.metadata()), Some("tok-1"));
        // A source that never read its file sends nothing.
        assert_eq!(TokenSource::file(dir.join("missing")).current(), None);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
