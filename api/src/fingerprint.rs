//! Cache fingerprints: which materialised data a pipeline prefix may reuse.
//!
//! SHA-256 over a canonical encoding of the source (URI, format, the columns a Parquet source
//! reads, and every shard's name, size and version: ETag or mtime), how the listing was ordered before it was cut into splits (an
//! entry holds its data per split), and the transforms up to an `autocache` hint with all
//! their parameters, plus the cache format version. Nothing after the hint and nothing about the
//! pipeline's name enters it, so two pipelines with the same prefix share a cache.

use sha2::{Digest, Sha256};

use crate::{SourceFormat, Transform};

/// Bumped whenever the chunk file format changes, so old entries are never read.
pub const CACHE_FORMAT_VERSION: u32 = 1;

/// One object of the source listing.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ShardVersion {
    pub name: String,
    pub size: u64,
    /// ETag, or modification time, whatever the store offers.
    pub version: String,
}

/// The fingerprint of the data at hint `at` (an index into `transforms`, which must be an
/// `autocache` item): `sha256:<hex>`. `split_order` is the seed the listing was ordered by
/// before it was cut into splits (None: the listing's own order).
pub fn fingerprint(
    uri: &str,
    format: SourceFormat,
    columns: &[String],
    shards: &[ShardVersion],
    split_order: Option<u64>,
    transforms: &[Transform],
    at: usize,
) -> String {
    let mut h = Sha256::new();
    let mut field = |bytes: &[u8]| {
        // Length-prefixed, so no two different inputs encode the same.
        h.update((bytes.len() as u64).to_le_bytes());
        h.update(bytes);
    };
    field(&CACHE_FORMAT_VERSION.to_le_bytes());
    field(uri.trim_end_matches('/').as_bytes());
    field(serde_json::to_string(&format).expect("a format serializes").as_bytes());
    // Only when named, so entries of every other source keep their fingerprints.
    if !columns.is_empty() {
        field(b"columns");
        field(&(columns.len() as u64).to_le_bytes());
        for c in columns {
            field(c.as_bytes());
        }
    }
    let mut sorted: Vec<&ShardVersion> = shards.iter().collect();
    sorted.sort_by(|a, b| a.name.cmp(&b.name));
    field(&(sorted.len() as u64).to_le_bytes());
    for s in sorted {
        field(s.name.as_bytes());
        field(&s.size.to_le_bytes());
        field(s.version.as_bytes());
    }
    // Only when set, so entries made in listing order keep their fingerprints.
    if let Some(seed) = split_order {
        field(b"split-order");
        field(&seed.to_le_bytes());
    }
    let prefix = &transforms[..at.min(transforms.len())];
    field(&(prefix.len() as u64).to_le_bytes());
    for t in prefix {
        // serde_json writes struct fields in declaration order: canonical for our types.
        field(serde_json::to_string(t).expect("a transform serializes").as_bytes());
    }
    let digest = h.finalize();
    let hex: String = digest.iter().map(|b| format!("{b:02x}")).collect();
    format!("sha256:{hex}")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn transforms(yaml: &str) -> Vec<Transform> {
        crate::from_yaml(yaml).unwrap()
    }

    fn shards() -> Vec<ShardVersion> {
        vec![
            ShardVersion { name: "a.tfrecord".into(), size: 10, version: "e1".into() },
            ShardVersion { name: "b.tfrecord".into(), size: 20, version: "e2".into() },
        ]
    }

    #[test]
    fn the_same_prefix_shares_a_fingerprint_whatever_follows() {
        let one = transforms("- decodeImage: {channels: 3}\n- autocache: {}\n- randomFlip: {horizontal: true}\n");
        let two =
            transforms("- decodeImage: {channels: 3}\n- autocache: {}\n- randomResizedCrop: {size: [224, 224]}\n");
        let uri = "s3://b/train/";
        assert_eq!(
            fingerprint(uri, SourceFormat::Tfrecord, &[], &shards(), None, &one, 1),
            fingerprint(uri, SourceFormat::Tfrecord, &[], &shards(), None, &two, 1)
        );
        let mut reversed = shards();
        reversed.reverse();
        assert_eq!(
            fingerprint(uri, SourceFormat::Tfrecord, &[], &shards(), None, &one, 1),
            fingerprint("s3://b/train", SourceFormat::Tfrecord, &[], &reversed, None, &one, 1),
            "listing order and a trailing slash do not matter"
        );
    }

    #[test]
    fn anything_that_changes_the_data_changes_it() {
        let t = transforms("- decodeImage: {channels: 3}\n- autocache: {}\n");
        let base = fingerprint("s3://b/x", SourceFormat::Tfrecord, &[], &shards(), None, &t, 1);
        let other_params = transforms("- decodeImage: {channels: 1}\n- autocache: {}\n");
        let mut changed_file = shards();
        changed_file[1].version = "e3".into();
        for other in [
            fingerprint("s3://b/y", SourceFormat::Tfrecord, &[], &shards(), None, &t, 1),
            fingerprint("s3://b/x", SourceFormat::Webdataset, &[], &shards(), None, &t, 1),
            fingerprint("s3://b/x", SourceFormat::Tfrecord, &["a".to_string()], &shards(), None, &t, 1),
            fingerprint("s3://b/x", SourceFormat::Tfrecord, &[], &changed_file, None, &t, 1),
            fingerprint("s3://b/x", SourceFormat::Tfrecord, &[], &shards()[..1], None, &t, 1),
            fingerprint("s3://b/x", SourceFormat::Tfrecord, &[], &shards(), None, &other_params, 1),
            fingerprint("s3://b/x", SourceFormat::Tfrecord, &[], &shards(), None, &t, 0),
            // Splits cut from the listing in another order hold other data per split.
            fingerprint("s3://b/x", SourceFormat::Tfrecord, &[], &shards(), Some(0), &t, 1),
            fingerprint("s3://b/x", SourceFormat::Tfrecord, &[], &shards(), Some(1), &t, 1),
        ] {
            assert_ne!(base, other);
        }
        assert!(base.starts_with("sha256:") && base.len() == 7 + 64);
    }
}
