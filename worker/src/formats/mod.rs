//! Record formats: pure functions from a shard's bytes to elements.
//!
//! Every parser yields `Result<Element, Corrupt>` items and never panics, whatever the input.
//! A corrupt record is reported as an item rather than ending the iterator with an error, so
//! the caller decides per its `onError` policy whether to count and skip or to fail; parsers
//! resynchronise after a bad record only where the format makes that safe.

use std::fmt;

pub mod example;
pub mod image_folder;
pub mod jsonl;
pub mod parquet;
mod protowire;
pub mod tar;
pub mod tfrecord;

/// A record that could not be read, with where it was found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Corrupt {
    pub shard: String,
    /// Byte offset in the shard of the record (TFRecord frame, JSONL line, tar header).
    pub offset: u64,
    pub reason: CorruptReason,
    pub detail: String,
}

impl Corrupt {
    pub(crate) fn new(shard: &str, offset: usize, reason: CorruptReason, detail: impl Into<String>) -> Self {
        Corrupt { shard: shard.to_owned(), offset: offset as u64, reason, detail: detail.into() }
    }
}

impl fmt::Display for Corrupt {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} at {}+{}: {}", self.reason.as_str(), self.shard, self.offset, self.detail)
    }
}

impl std::error::Error for Corrupt {}

/// Why a record was rejected. Each variant is a metrics label, so keep the set small and stable.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum CorruptReason {
    /// The shard ends inside a TFRecord length or its CRC.
    TruncatedLength,
    /// The length's CRC does not match: the length cannot be trusted, so the shard stops.
    BadLengthCrc,
    /// The shard ends inside a TFRecord's data or data CRC.
    TruncatedData,
    /// The data's CRC does not match; the frame was sound, so the next record is still read.
    BadDataCrc,
    /// The record is not a well-formed tf.train.Example.
    BadExample,
    /// A JSONL line is not valid JSON.
    BadJson,
    /// A JSONL line is valid JSON that has no element representation (nested object, ...).
    UnsupportedJson,
    /// The tar archive ends inside a header or member, or lacks its end-of-archive marker.
    TruncatedTar,
    /// A tar header's checksum does not match.
    BadTarChecksum,
    /// A tar header has a malformed field (size, name, pax record).
    BadTarHeader,
    /// A WebDataset sample has the same field twice, so which one is meant is unknown.
    DuplicateTarField,
    /// A Parquet split's row groups cannot be decoded (a corrupt page or footer, or a file
    /// that is not Parquet): the split's rows are skipped together.
    BadParquet,
}

impl CorruptReason {
    /// Every reason, so metrics can be registered at zero before anything goes wrong.
    pub const ALL: [CorruptReason; 12] = [
        CorruptReason::TruncatedLength,
        CorruptReason::BadLengthCrc,
        CorruptReason::TruncatedData,
        CorruptReason::BadDataCrc,
        CorruptReason::BadExample,
        CorruptReason::BadJson,
        CorruptReason::UnsupportedJson,
        CorruptReason::TruncatedTar,
        CorruptReason::BadTarChecksum,
        CorruptReason::BadTarHeader,
        CorruptReason::DuplicateTarField,
        CorruptReason::BadParquet,
    ];

    /// Stable snake_case name used as a metrics label and in logs.
    pub fn as_str(self) -> &'static str {
        match self {
            CorruptReason::TruncatedLength => "truncated_length",
            CorruptReason::BadLengthCrc => "bad_length_crc",
            CorruptReason::TruncatedData => "truncated_data",
            CorruptReason::BadDataCrc => "bad_data_crc",
            CorruptReason::BadExample => "bad_example",
            CorruptReason::BadJson => "bad_json",
            CorruptReason::UnsupportedJson => "unsupported_json",
            CorruptReason::TruncatedTar => "truncated_tar",
            CorruptReason::BadTarChecksum => "bad_tar_checksum",
            CorruptReason::BadTarHeader => "bad_tar_header",
            CorruptReason::DuplicateTarField => "duplicate_tar_field",
            CorruptReason::BadParquet => "bad_parquet",
        }
    }
}

impl fmt::Display for CorruptReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

#[cfg(test)]
mod tests {
    use super::CorruptReason;

    #[test]
    fn reason_names_are_distinct_snake_case() {
        let mut names: Vec<&str> = CorruptReason::ALL.iter().map(|r| r.as_str()).collect();
        assert!(names.iter().all(|n| n.chars().all(|c| c.is_ascii_lowercase() || c == '_')));
        names.sort_unstable();
        names.dedup();
        assert_eq!(names.len(), CorruptReason::ALL.len());
    }
}
