//! What some ops need loaded once per worker, before the first element: the Python processes
//! of `python` ops and the tokenizers of `tokenize` ops. Loading fails the pipeline at once,
//! with the reason, rather than every element.

use std::collections::BTreeMap;

use stoker_api::Transform;
use tokenizers::Tokenizer;
use tokenizers::utils::truncation::TruncationParams;

use crate::python::{PythonOps, PythonPool};

#[derive(Default)]
pub struct Loaded {
    pub python: Option<PythonPool>,
    /// By op index, with the op's truncation set.
    pub tokenizers: BTreeMap<usize, Tokenizer>,
}

impl Loaded {
    /// Loads what `transforms` need (blocking: run it off the async threads).
    pub fn load(transforms: &[Transform]) -> Result<Loaded, String> {
        let mut tokenizers = BTreeMap::new();
        for (index, t) in transforms.iter().enumerate() {
            if let Transform::Tokenize(op) = t {
                let at = format!("transforms[{index}].tokenize");
                let mut tokenizer = Tokenizer::from_file(&op.tokenizer)
                    .map_err(|e| format!("{at}: loading the tokenizer {}: {e}", op.tokenizer))?;
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
