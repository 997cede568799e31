//! Record-format parsers against independently produced inputs, corruption and arbitrary bytes.

mod example;
mod jsonl;
mod props;
mod tar;
mod tfrecord;

use bytes::Bytes;
use stoker_worker::element::{Element, Field};
use stoker_worker::formats::{Corrupt, CorruptReason};

pub fn el(fields: &[(&str, Field)]) -> Element {
    fields.iter().map(|(k, v)| (k.to_string(), v.clone())).collect()
}

pub fn bytes(b: &[u8]) -> Field {
    Field::Bytes(Bytes::copy_from_slice(b))
}

/// Reasons of the corrupt items, `None` for good ones, to compare whole outcomes at once.
pub fn outcome(items: &[Result<Element, Corrupt>]) -> Vec<Option<CorruptReason>> {
    items.iter().map(|i| i.as_ref().err().map(|c| c.reason)).collect()
}

/// Whether `inner` is a view into `outer`'s memory, i.e. was sliced rather than copied.
pub fn within(outer: &[u8], inner: &[u8]) -> bool {
    let range = outer.as_ptr_range();
    inner.is_empty() || (range.start <= inner.as_ptr() && inner.as_ptr_range().end <= range.end)
}
