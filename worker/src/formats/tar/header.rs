//! Tar headers (POSIX ustar, GNU, pax): walks the archive's 512-byte blocks and yields its
//! regular files. GNU long names (`L`) and pax `path`/`size` records apply to the next member,
//! because that is how writers store names over 100 bytes and members over 8 GiB.

use bytes::Bytes;

use crate::formats::{Corrupt, CorruptReason};

const BLOCK: usize = 512;

/// A regular file in the archive.
pub(super) struct Entry {
    /// Offset of the file's own header.
    pub offset: usize,
    pub name: String,
    pub data: Bytes,
}

pub(super) struct Entries {
    data: Bytes,
    pos: usize,
    shard: String,
    done: bool,
}

/// Overrides from extension headers, applying to the next member.
#[derive(Default)]
struct Next {
    name: Option<String>,
    size: Option<u64>,
}

impl Entries {
    pub(super) fn new(data: Bytes, shard: &str) -> Self {
        Entries { data, pos: 0, shard: shard.to_owned(), done: false }
    }

    pub(super) fn shard(&self) -> &str {
        &self.shard
    }

    fn stop(&mut self, at: usize, reason: CorruptReason, detail: String) -> Option<Result<Entry, Corrupt>> {
        self.done = true;
        Some(Err(Corrupt::new(&self.shard, at, reason, detail)))
    }
}

impl Iterator for Entries {
    type Item = Result<Entry, Corrupt>;

    fn next(&mut self) -> Option<Self::Item> {
        let mut next = Next::default();
        while !self.done {
            // pos passes the end when a member's padding is cut off; report where the data ends.
            let at = self.pos.min(self.data.len());
            let left = self.data.len() - at;
            if left == 0 {
                return self.stop(at, CorruptReason::TruncatedTar, "no end-of-archive marker".into());
            }
            if left < BLOCK {
                return self.stop(
                    at,
                    CorruptReason::TruncatedTar,
                    format!("{left} bytes left, a header needs {BLOCK}"),
                );
            }
            let header = self.data.slice(at..at + BLOCK);
            // The first zero block ends the archive; the second one writers add is not required.
            if header.iter().all(|&b| b == 0) {
                self.done = true;
                return None;
            }
            if let Err(detail) = checksum(&header) {
                return self.stop(at, CorruptReason::BadTarChecksum, detail);
            }
            let size = match next.size.take().map_or_else(|| number(&header[124..136]), Ok) {
                Ok(size) => size,
                Err(detail) => return self.stop(at, CorruptReason::BadTarHeader, format!("size: {detail}")),
            };
            let start = at + BLOCK;
            let left = self.data.len() - start;
            if size > left as u64 {
                return self.stop(at, CorruptReason::TruncatedTar, format!("member of {size} bytes, {left} left"));
            }
            let size = size as usize;
            let content = self.data.slice(start..start + size);
            self.pos = start + size.div_ceil(BLOCK) * BLOCK;
            match header[156] {
                b'0' | 0 | b'7' => {
                    let name = match next.name.take().map_or_else(|| name(&header), Ok) {
                        Ok(name) => name,
                        Err(detail) => return self.stop(at, CorruptReason::BadTarHeader, detail),
                    };
                    return Some(Ok(Entry { offset: at, name, data: content }));
                }
                b'L' => match utf8(until_nul(&content)) {
                    Ok(name) => next.name = Some(name),
                    Err(detail) => return self.stop(at, CorruptReason::BadTarHeader, detail),
                },
                b'x' => {
                    if let Err(detail) = pax(&content, &mut next) {
                        return self.stop(at, CorruptReason::BadTarHeader, detail);
                    }
                }
                // A long link name belongs to a link, never to the file we want; keep waiting.
                b'K' => {}
                // Directories, links, devices, global pax headers: nothing to read, and any
                // pending long name was theirs.
                _ => next = Next::default(),
            }
        }
        None
    }
}

/// Accepts the unsigned sum POSIX specifies and the signed one some old writers used, both
/// taken with the checksum field itself read as spaces.
fn checksum(header: &[u8]) -> Result<(), String> {
    let stored = number(&header[148..156]).map_err(|e| format!("checksum field: {e}"))?;
    let field = 148..156;
    let (mut unsigned, mut signed) = (0u64, 0i64);
    for (i, &b) in header.iter().enumerate() {
        let b = if field.contains(&i) { b' ' } else { b };
        unsigned += u64::from(b);
        signed += i64::from(b as i8);
    }
    if stored == unsigned || i64::try_from(stored).is_ok_and(|s| s == signed) {
        Ok(())
    } else {
        Err(format!("header checksum {stored} does not match computed {unsigned}"))
    }
}

/// A numeric field: octal ASCII padded with spaces or NULs, or GNU base-256 for large values.
fn number(field: &[u8]) -> Result<u64, String> {
    if field.first().is_some_and(|&b| b & 0x80 != 0) {
        if field[0] == 0xff {
            return Err("negative base-256 number".into());
        }
        let mut value = u64::from(field[0] & 0x7f);
        for &b in &field[1..] {
            value = value.checked_mul(256).ok_or("base-256 number overflows")? | u64::from(b);
        }
        return Ok(value);
    }
    let digits = field.iter().skip_while(|&&b| b == b' ').take_while(|&&b| b != 0 && b != b' ');
    let mut value = 0u64;
    for &b in digits {
        if !(b'0'..=b'7').contains(&b) {
            return Err(format!("{:?} is not octal", String::from_utf8_lossy(field)));
        }
        value = value * 8 + u64::from(b - b'0');
    }
    Ok(value)
}

fn name(header: &[u8]) -> Result<String, String> {
    let name = utf8(until_nul(&header[0..100]))?;
    // Only POSIX ustar has a prefix field; GNU headers keep other data there.
    let prefix = if &header[257..263] == b"ustar\0" { utf8(until_nul(&header[345..500]))? } else { String::new() };
    Ok(if prefix.is_empty() { name } else { format!("{prefix}/{name}") })
}

/// Pax records are `"<len> <key>=<value>\n"`, `<len>` counting the whole record.
fn pax(mut records: &[u8], next: &mut Next) -> Result<(), String> {
    while !records.is_empty() {
        let space = records.iter().position(|&b| b == b' ').ok_or("pax record without a length")?;
        let len: usize = std::str::from_utf8(&records[..space])
            .ok()
            .and_then(|s| s.parse().ok())
            .ok_or("pax record length is not a number")?;
        if len <= space + 1 || len > records.len() || records[len - 1] != b'\n' {
            return Err(format!("pax record length {len} is inconsistent"));
        }
        let record = &records[space + 1..len - 1];
        let eq = record.iter().position(|&b| b == b'=').ok_or("pax record without '='")?;
        let (key, value) = (&record[..eq], &record[eq + 1..]);
        match key {
            b"path" => next.name = Some(utf8(value)?),
            b"size" => {
                let size = std::str::from_utf8(value).ok().and_then(|s| s.parse().ok());
                next.size = Some(size.ok_or("pax size is not a number")?);
            }
            _ => {}
        }
        records = &records[len..];
    }
    Ok(())
}

fn until_nul(field: &[u8]) -> &[u8] {
    field.iter().position(|&b| b == 0).map_or(field, |end| &field[..end])
}

fn utf8(bytes: &[u8]) -> Result<String, String> {
    String::from_utf8(bytes.to_vec()).map_err(|_| format!("name {:?} is not UTF-8", String::from_utf8_lossy(bytes)))
}
