//! The wire protocol (api/proto/stoker/v1alpha1): generated messages and the BatchStream
//! service, plus what both ends must agree on beyond the messages — message size limits, the
//! authorization metadata, and the mapping to the shared tensor types.

#[allow(clippy::all)]
mod generated {
    include!(concat!(env!("OUT_DIR"), "/stoker.v1alpha1.rs"));
}

pub use generated::*;

/// Message limit when a client asks for none: tonic's default decoding limit.
pub const DEFAULT_MAX_MESSAGE_BYTES: usize = 4 << 20;
/// Smallest message limit a server accepts. Below it the per-chunk overhead (header with tensor
/// names and shapes) would dominate, and a limit of a few bytes is a client bug, not a choice.
pub const MIN_MAX_MESSAGE_BYTES: usize = 64 << 10;
/// Largest message limit a server accepts: bigger messages only add latency and memory spikes.
pub const MAX_MAX_MESSAGE_BYTES: usize = 256 << 20;

/// More ranks than any job runs: each is a queue on every worker and a count at the dispatcher.
pub const MAX_CONSUMERS: u32 = 65_536;

/// The metadata entry carrying the caller's ServiceAccount token on every RPC.
pub const AUTHORIZATION: &str = "authorization";

/// Metadata of the dispatcher's NOT_FOUND answers: its incarnation (decimal). A client that
/// finds its own there was only forgotten (it went silent for too long) and registers again;
/// any other means the dispatcher restarted, and the client rejoins.
pub const INCARNATION: &str = "stoker-incarnation";

/// The `authorization` value for a token.
pub fn bearer(token: &str) -> String {
    format!("Bearer {token}")
}

/// The token in an `authorization` value, if it is a bearer token.
pub fn bearer_token(value: &str) -> Option<&str> {
    let (scheme, token) = value.split_once(' ')?;
    let token = token.trim();
    (scheme.eq_ignore_ascii_case("bearer") && !token.is_empty()).then_some(token)
}

/// The bearer token of a request's metadata, if any.
pub fn request_token(metadata: &tonic::metadata::MetadataMap) -> Option<&str> {
    bearer_token(metadata.get(AUTHORIZATION)?.to_str().ok()?)
}

/// The effective message limit of a request (0 means the default).
pub fn effective_max_message_bytes(requested: u64) -> u64 {
    if requested == 0 { DEFAULT_MAX_MESSAGE_BYTES as u64 } else { requested }
}

impl HintBytes {
    /// Adds `more` to the totals of the same hint in `totals` (appended if it has none): how
    /// a worker sums its splits and the dispatcher its workers.
    pub fn add_into(totals: &mut Vec<HintBytes>, more: &HintBytes) {
        match totals.iter_mut().find(|t| t.at == more.at) {
            // Saturating: the dispatcher sums what workers report.
            Some(t) => {
                (t.elements, t.bytes) = (t.elements.saturating_add(more.elements), t.bytes.saturating_add(more.bytes))
            }
            None => totals.push(*more),
        }
    }
}

impl From<crate::DType> for Dtype {
    fn from(d: crate::DType) -> Self {
        match d {
            crate::DType::Uint8 => Dtype::Uint8,
            crate::DType::Int32 => Dtype::Int32,
            crate::DType::Int64 => Dtype::Int64,
            crate::DType::Float16 => Dtype::Float16,
            crate::DType::Float32 => Dtype::Float32,
            crate::DType::Float64 => Dtype::Float64,
            crate::DType::Bytes => Dtype::Bytes,
        }
    }
}

impl From<crate::Layout> for Layout {
    fn from(l: crate::Layout) -> Self {
        match l {
            crate::Layout::Dense => Layout::Dense,
            crate::Layout::Jagged => Layout::Jagged,
        }
    }
}

impl From<Layout> for crate::Layout {
    fn from(l: Layout) -> Self {
        match l {
            Layout::Dense => crate::Layout::Dense,
            Layout::Jagged => crate::Layout::Jagged,
        }
    }
}

impl From<crate::CacheMode> for CacheMode {
    fn from(mode: crate::CacheMode) -> Self {
        match mode {
            crate::CacheMode::Never => CacheMode::Never,
            crate::CacheMode::Auto => CacheMode::Auto,
            crate::CacheMode::Always => CacheMode::Always,
        }
    }
}

impl From<CacheMode> for crate::CacheMode {
    /// Unspecified is Never, the spec's default.
    fn from(mode: CacheMode) -> Self {
        match mode {
            CacheMode::Unspecified | CacheMode::Never => crate::CacheMode::Never,
            CacheMode::Auto => crate::CacheMode::Auto,
            CacheMode::Always => crate::CacheMode::Always,
        }
    }
}

impl Dtype {
    /// The shared type, or None for `DTYPE_UNSPECIFIED`.
    pub fn to_api(self) -> Option<crate::DType> {
        Some(match self {
            Dtype::Unspecified => return None,
            Dtype::Uint8 => crate::DType::Uint8,
            Dtype::Int32 => crate::DType::Int32,
            Dtype::Int64 => crate::DType::Int64,
            Dtype::Float16 => crate::DType::Float16,
            Dtype::Float32 => crate::DType::Float32,
            Dtype::Float64 => crate::DType::Float64,
            Dtype::Bytes => crate::DType::Bytes,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bearer_tokens_round_trip() {
        assert_eq!(bearer_token(&bearer("abc.def")), Some("abc.def"));
        assert_eq!(bearer_token("bearer xyz"), Some("xyz"));
        assert_eq!(bearer_token("Basic xyz"), None);
        assert_eq!(bearer_token("Bearer "), None);
        assert_eq!(bearer_token("Bearer"), None);
    }

    #[test]
    fn request_token_reads_the_metadata() {
        let mut md = tonic::metadata::MetadataMap::new();
        assert_eq!(request_token(&md), None);
        md.insert(AUTHORIZATION, bearer("t0k").parse().unwrap());
        assert_eq!(request_token(&md), Some("t0k"));
    }

    #[test]
    fn every_dtype_maps_both_ways() {
        use crate::DType as D;
        for d in [D::Uint8, D::Int32, D::Int64, D::Float16, D::Float32, D::Float64] {
            assert_eq!(Dtype::from(d).to_api(), Some(d));
        }
        assert_eq!(Dtype::Unspecified.to_api(), None);
    }

    #[test]
    fn zero_means_the_default_limit() {
        assert_eq!(effective_max_message_bytes(0), DEFAULT_MAX_MESSAGE_BYTES as u64);
        assert_eq!(effective_max_message_bytes(70_000), 70_000);
    }

    #[test]
    fn totals_add_up_per_hint() {
        let mut totals = Vec::new();
        for (at, elements, bytes) in [(1, 2, 20), (3, 1, 5), (1, 3, 30)] {
            HintBytes::add_into(&mut totals, &HintBytes { at, elements, bytes });
        }
        assert_eq!(
            totals,
            vec![HintBytes { at: 1, elements: 5, bytes: 50 }, HintBytes { at: 3, elements: 1, bytes: 5 }]
        );
    }
}
