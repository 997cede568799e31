//! WebDataset tar shards: consecutive members sharing a key form one sample.
//!
//! `dir/key.ext` has key `dir/key` (up to the first dot of the base name) and field `ext`
//! (everything after it, so `a.seg.png` gives field `seg.png`); a sample ends when the key
//! changes. Members whose base name has no dot, or starts with one, carry no field and are
//! skipped, as are non-regular entries. Field payloads are slices of the shard, not copies.
//!
//! Tar has no sync marker, so after a bad header, a truncation or a missing end-of-archive
//! marker the shard stops; the sample being gathered then is dropped too, since it may be
//! missing fields. A sample with a repeated field is reported and dropped, and reading goes on.

use bytes::Bytes;

use super::{Corrupt, CorruptReason};
use crate::element::{Element, Field};

mod header;

use header::Entries;

/// The shard's samples, each with a `__key__` field plus one field per member.
pub fn read(data: Bytes, shard: &str) -> impl Iterator<Item = Result<Element, Corrupt>> + use<> {
    Samples { entries: Entries::new(data, shard), pending: None, done: false }
}

/// Splits a member name into (key, field name), `None` when it names no field.
pub fn split_name(name: &str) -> Option<(&str, &str)> {
    let base_start = name.rfind('/').map_or(0, |i| i + 1);
    let dot = base_start + name[base_start..].find('.')?;
    let (key, ext) = (&name[..dot], &name[dot + 1..]);
    (dot > base_start && !ext.is_empty()).then_some((key, ext))
}

struct Pending {
    key: String,
    element: Element,
    duplicate: Option<Corrupt>,
}

impl Pending {
    fn finish(self) -> Result<Element, Corrupt> {
        match self.duplicate {
            Some(corrupt) => Err(corrupt),
            None => Ok(self.element),
        }
    }
}

struct Samples {
    entries: Entries,
    pending: Option<Pending>,
    done: bool,
}

impl Iterator for Samples {
    type Item = Result<Element, Corrupt>;

    fn next(&mut self) -> Option<Self::Item> {
        if self.done {
            return None;
        }
        loop {
            let entry = match self.entries.next() {
                None => {
                    self.done = true;
                    return self.pending.take().map(Pending::finish);
                }
                Some(Err(corrupt)) => {
                    self.done = true;
                    self.pending = None;
                    return Some(Err(corrupt));
                }
                Some(Ok(entry)) => entry,
            };
            let Some((key, ext)) = split_name(&entry.name) else { continue };
            let finished = match &self.pending {
                Some(p) if p.key == key => None,
                _ => {
                    let mut element = Element::new();
                    element.insert("__key__".to_owned(), Field::Bytes(Bytes::copy_from_slice(key.as_bytes())));
                    self.pending.replace(Pending { key: key.to_owned(), element, duplicate: None })
                }
            };
            if let Some(p) = &mut self.pending {
                if p.element.contains_key(ext) {
                    let detail = format!("sample {key:?} has field {ext:?} twice");
                    let corrupt =
                        Corrupt::new(self.entries.shard(), entry.offset, CorruptReason::DuplicateTarField, detail);
                    p.duplicate.get_or_insert(corrupt);
                } else {
                    p.element.insert(ext.to_owned(), Field::Bytes(entry.data));
                }
            }
            if let Some(done) = finished {
                return Some(done.finish());
            }
        }
    }
}
