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

#[derive(Default)]
pub struct Loaded {
    pub python: Option<PythonPool>,
    /// By op index, with the op's truncation set.
    pub tokenizers: BTreeMap<usize, Tokenizer>,
}

impl Loaded {
    /// The tokenizers `transforms` name by URI, read from their stores, by op index.
    pub async fn fetch(transforms: &[Transform]) -> Result<BTreeMap<usize, Bytes>, String> {
        let mut fetched = BTreeMap::new();
        for (index, t) in transforms.iter().enumerate() {
            if let Transform::Tokenize(op) = t
                && op.tokenizer.contains("://")
            {
                let bytes = DataSource::object(&op.tokenizer, stoker_api::bounds::MAX_TOKENIZER_BYTES)
                    .await
                    .map_err(|e| format!("transforms[{index}].tokenize: reading the tokenizer: {e}"))?;
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
        let python = PythonOps::of(transforms).map(PythonPool::start).transpose()?;
        Ok(Loaded { python, tokenizers })
    }
}
