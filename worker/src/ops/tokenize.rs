//! tokenize: UTF-8 text to int32 token ids with a loaded Hugging Face tokenizer.

use stoker_api::{DType, Tensor};
use tokenizers::Tokenizer;

use super::OpError;

pub fn tokenize(tokenizer: &Tokenizer, text: &[u8], add_special_tokens: bool) -> Result<Tensor, OpError> {
    let text = std::str::from_utf8(text).map_err(|e| OpError::InvalidText(e.to_string()))?;
    let encoding = tokenizer.encode(text, add_special_tokens).map_err(|e| OpError::InvalidText(e.to_string()))?;
    let ids = encoding.get_ids();
    let mut data = Vec::with_capacity(4 * ids.len());
    for id in ids {
        // Vocabularies are far below 2^31 entries.
        data.extend_from_slice(&(*id as i32).to_le_bytes());
    }
    Ok(Tensor::new(DType::Int32, vec![ids.len()], data.into()).expect("4 bytes per id"))
}
