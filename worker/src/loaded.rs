//! What some ops need loaded once per worker, before the first element: the Python processes
//! of `python` ops and the tokenizers of `tokenize` ops. Loading fails the pipeline at once,
//! with the reason, rather than every element.

use std::collections::BTreeMap;

use bytes::Bytes;
use stoker_api::Transform;
use tokenizers::Tokenizer;
use tokenizers::utils::truncation::TruncationParams;

use crate::python::{PythonOps, PythonPool};
use crate::source::DataSource;
use crate::table::ops::Vocabulary;

#[derive(Default)]
pub struct Loaded {
    pub python: Option<PythonPool>,
    /// By op index, with the op's truncation set.
    pub tokenizers: BTreeMap<usize, Tokenizer>,
    /// The files of `vocabulary` ops, by op index.
    pub vocabularies: BTreeMap<usize, Vocabulary>,
}

impl Loaded {
    /// The files `transforms` name by URI (tokenizers, vocabularies), read from their stores,
    /// by op index.
    pub async fn fetch(transforms: &[Transform]) -> Result<BTreeMap<usize, Bytes>, String> {
        let mut fetched = BTreeMap::new();
        for (index, t) in transforms.iter().enumerate() {
            let (uri, limit) = match t {
                Transform::Tokenize(op) => (&op.tokenizer, stoker_api::bounds::MAX_TOKENIZER_BYTES),
                Transform::Vocabulary(op) => (&op.path, stoker_api::bounds::MAX_VOCABULARY_BYTES),
                _ => continue,
            };
            if uri.contains("://") {
                let bytes = DataSource::object(uri, limit)
                    .await
                    .map_err(|e| format!("transforms[{index}].{}: reading {uri}: {e}", t.name()))?;
                fetched.insert(index, bytes);
            }
        }
        Ok(fetched)
    }

    /// Loads what `transforms` need, the tokenizers named by URI from `fetched` (blocking: run
    /// it off the async threads).
    pub fn load(transforms: &[Transform], fetched: &BTreeMap<usize, Bytes>) -> Result<Loaded, String> {
        let mut tokenizers = BTreeMap::new();
        for (index, t) in transforms.iter().enumerate() {
            if let Transform::Tokenize(op) = t {
                let at = format!("transforms[{index}].tokenize");
                let loaded = match fetched.get(&index) {
                    Some(bytes) => Tokenizer::from_bytes(bytes),
                    None => Tokenizer::from_file(&op.tokenizer),
                };
                let mut tokenizer = loaded.map_err(|e| format!("{at}: loading the tokenizer {}: {e}", op.tokenizer))?;
                if let Some(max_length) = op.max_length {
                    let params = TruncationParams { max_length: max_length as usize, ..Default::default() };
                    tokenizer.with_truncation(Some(params)).map_err(|e| format!("{at}: truncation: {e}"))?;
                }
                tokenizers.insert(index, tokenizer);
            }
        }
        let mut vocabularies = BTreeMap::new();
        for (index, t) in transforms.iter().enumerate() {
            if let Transform::Vocabulary(op) = t {
                let file = match fetched.get(&index) {
                    Some(bytes) => bytes.to_vec(),
                    None => read_bounded(&op.path, stoker_api::bounds::MAX_VOCABULARY_BYTES)
                        .map_err(|e| format!("transforms[{index}].vocabulary: reading {}: {e}", op.path))?,
                };
                vocabularies.insert(index, Vocabulary::new(&file, op.oov_id));
            }
        }
        let python = PythonOps::of(transforms).map(PythonPool::start).transpose()?;
        Ok(Loaded { python, tokenizers, vocabularies })
    }
}

/// A file of at most `limit` bytes.
fn read_bounded(path: &str, limit: u64) -> std::io::Result<Vec<u8>> {
    let size = std::fs::metadata(path)?.len();
    if size > limit {
        return Err(std::io::Error::other(format!("{size} bytes, above the limit of {limit}")));
    }
    std::fs::read(path)
}
