//! Where a pipeline's data lives. Every scheme goes through object_store (file://, s3://,
//! gs://, az://); listing the URI's prefix gives the shards, which the dispatcher later hands
//! out as splits.

use std::sync::Arc;

use bytes::Bytes;
use futures::TryStreamExt;
use object_store::path::Path;
use object_store::{ObjectStore, ObjectStoreExt};
use url::Url;

use crate::source_reads::SourceReads;

/// One object under the source prefix.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Shard {
    /// Path inside the store (for file://, the absolute path without the leading slash).
    pub path: String,
    pub size: u64,
    /// ETag, else modification time: what changes when the object does (cache fingerprints).
    pub version: String,
}

/// Source errors callers branch on: a missing source or a permission problem is the user's to
/// fix and goes to the DataPipeline's status; others may be transient.
#[derive(Debug, thiserror::Error)]
pub enum SourceError {
    #[error("{uri} is not a valid source URI: {detail}")]
    InvalidUri { uri: String, detail: String },
    #[error("{uri} does not exist or holds no objects")]
    NotFound { uri: String },
    #[error("not allowed to read {uri} (check spec.source.credentialsSecret): {detail}")]
    PermissionDenied { uri: String, detail: String },
    #[error("reading {uri}: {source}")]
    Store { uri: String, source: object_store::Error },
    #[error("{uri} is {size} bytes, more than the {most} a worker reads whole")]
    TooLarge { uri: String, size: u64, most: u64 },
}

#[derive(Clone)]
pub struct DataSource {
    store: Arc<dyn ObjectStore>,
    prefix: Path,
    uri: String,
    reads: Arc<SourceReads>,
}

/// Environment variables the cloud builders understand (AWS_*, GOOGLE_*, AZURE_*), so the
/// credentials Secret mounted as env and endpoint overrides (AWS_ENDPOINT_URL for S3-compatible
/// stores) apply without Stoker-specific names.
fn store_options() -> Vec<(String, String)> {
    std::env::vars().filter(|(k, _)| ["AWS_", "GOOGLE_", "AZURE_"].iter().any(|p| k.starts_with(p))).collect()
}

impl DataSource {
    pub fn open(uri: &str) -> Result<Self, SourceError> {
        let invalid = |detail: String| SourceError::InvalidUri { uri: uri.to_string(), detail };
        let url = Url::parse(uri).map_err(|e| invalid(e.to_string()))?;
        let (store, prefix) =
            object_store::parse_url_opts(&url, store_options()).map_err(|e| invalid(e.to_string()))?;
        Ok(DataSource { store: Arc::from(store), prefix, uri: uri.to_string(), reads: Arc::default() })
    }

    pub fn uri(&self) -> &str {
        &self.uri
    }

    /// What was read from it so far.
    pub fn reads(&self) -> &Arc<SourceReads> {
        &self.reads
    }

    /// Every object under the prefix, sorted by path so every worker sees the same order.
    pub async fn list(&self) -> Result<Vec<Shard>, SourceError> {
        let mut shards: Vec<Shard> = self
            .store
            .list(Some(&self.prefix))
            .map_ok(|meta| Shard {
                path: meta.location.to_string(),
                size: meta.size,
                version: meta.e_tag.clone().unwrap_or_else(|| meta.last_modified.to_rfc3339()),
            })
            .try_collect()
            .await
            .map_err(|e| self.error(e))?;
        if shards.is_empty() {
            return Err(SourceError::NotFound { uri: self.uri.clone() });
        }
        shards.sort_by(|a, b| a.path.cmp(&b.path));
        Ok(shards)
    }

    /// The whole object. Shards are read whole: records are parsed from one buffer without copies.
    pub async fn read(&self, shard: &Shard) -> Result<Bytes, SourceError> {
        let started = std::time::Instant::now();
        let path = Path::from(shard.path.as_str());
        let object = self.store.get(&path).await.map_err(|e| self.error(e))?;
        let bytes = object.bytes().await.map_err(|e| self.error(e))?;
        self.reads.add(bytes.len() as u64, started.elapsed());
        Ok(bytes)
    }

    /// A Parquet file of the source, read by ranges.
    pub fn parquet(&self, shard: &Shard) -> crate::formats::parquet::ParquetFile {
        crate::formats::parquet::ParquetFile::new(self.store.clone(), Path::from(shard.path.as_str()), shard.size)
            .counting(self.reads.clone())
    }

    /// One whole object named by its URI (a tokenizer in a bucket), refused when larger than
    /// `most` bytes.
    pub async fn object(uri: &str, most: u64) -> Result<Bytes, SourceError> {
        let source = DataSource::open(uri)?;
        let meta = source.store.head(&source.prefix).await.map_err(|e| source.error(e))?;
        if meta.size > most {
            return Err(SourceError::TooLarge { uri: uri.to_string(), size: meta.size, most });
        }
        let shard = Shard { path: source.prefix.to_string(), size: meta.size, version: String::new() };
        source.read(&shard).await
    }

    /// The part of a shard's path below the source prefix (`label/file.jpg`).
    pub fn relative<'a>(&self, shard: &'a Shard) -> &'a str {
        let prefix = self.prefix.as_ref();
        shard.path.strip_prefix(prefix).map_or(shard.path.as_str(), |rest| rest.trim_start_matches('/'))
    }

    fn error(&self, e: object_store::Error) -> SourceError {
        let uri = self.uri.clone();
        match e {
            object_store::Error::NotFound { .. } => SourceError::NotFound { uri },
            object_store::Error::PermissionDenied { source, .. }
            | object_store::Error::Unauthenticated { source, .. } => {
                SourceError::PermissionDenied { uri, detail: source.to_string() }
            }
            source => SourceError::Store { uri, source },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn lists_sorted_and_reads_local_files() {
        let dir = tempfile::tempdir().unwrap();
        for (name, body) in [("b/2.jpg", "two"), ("a/1.jpg", "one"), ("a/0.jpg", "zero")] {
            let p = dir.path().join(name);
            std::fs::create_dir_all(p.parent().unwrap()).unwrap();
            std::fs::write(p, body).unwrap();
        }
        let source = DataSource::open(&format!("file://{}/", dir.path().display())).unwrap();
        let shards = source.list().await.unwrap();
        let names: Vec<_> = shards.iter().map(|s| source.relative(s)).collect();
        assert_eq!(names, ["a/0.jpg", "a/1.jpg", "b/2.jpg"]);
        assert_eq!(shards[2].size, 3);
        assert_eq!(source.read(&shards[1]).await.unwrap(), Bytes::from_static(b"one"));
    }

    #[tokio::test]
    async fn a_missing_source_is_a_clear_not_found() {
        let source = DataSource::open("file:///nonexistent/stoker/data/").unwrap();
        let err = source.list().await.unwrap_err();
        assert!(matches!(err, SourceError::NotFound { .. }), "{err:?}");
        assert!(err.to_string().contains("does not exist"), "{err}");
    }

    #[tokio::test]
    async fn a_single_object_is_read_whole_within_its_bound() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("tokenizer.json"), "{}").unwrap();
        let uri = format!("file://{}/tokenizer.json", dir.path().display());
        assert_eq!(DataSource::object(&uri, 2).await.unwrap(), Bytes::from_static(b"{}"));
        let err = DataSource::object(&uri, 1).await.unwrap_err();
        assert!(err.to_string().contains("is 2 bytes, more than the 1"), "{err}");
        let missing = DataSource::object(&format!("file://{}/none.json", dir.path().display()), 9).await.unwrap_err();
        assert!(matches!(missing, SourceError::NotFound { .. }), "{missing:?}");
    }

    #[test]
    fn bad_uris_are_refused() {
        assert!(matches!(DataSource::open("not a uri"), Err(SourceError::InvalidUri { .. })));
        assert!(matches!(DataSource::open("ftp://host/x"), Err(SourceError::InvalidUri { .. })));
    }
}
