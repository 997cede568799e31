//! `stoker-worker add-restart-markers`: a JPEG corpus rewritten once, without loss, so that a
//! crop's window decodes from the segments around it alone (ops/jpeg/segments.rs). The
//! pixels stay the same; every reader (PIL, torchvision, tf.data) still reads the files.
//! JPEG files (by their first bytes, whatever their names), the JPEG members of tar shards
//! (WebDataset) and the JPEG values of TFRecord shards' Examples (a file is TFRecord when its
//! first record's length CRC checks out) are rewritten; everything else is copied as it is.

use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};

use anyhow::Context;
use bytes::Bytes;
use rayon::prelude::*;

use crate::formats::{example, tfrecord};

/// The widest segment between two markers, in pixels, unless told otherwise.
pub const SEGMENT_PX: usize = 32;
use crate::ops::{add_restart_markers, is_jpeg};

/// What a rewrite did.
#[derive(Debug, Default)]
pub struct Report {
    /// JPEGs rewritten with restart markers (files and tar members).
    pub rewritten: u64,
    /// Files and tar members left as they were: not JPEGs, or JPEGs libjpeg refused (the
    /// first refusal is named).
    pub copied: u64,
    pub first_refusal: Option<String>,
    pub bytes_in: u64,
    pub bytes_out: u64,
}

/// The running totals, shared by the threads.
#[derive(Default)]
struct Totals {
    rewritten: AtomicU64,
    copied: AtomicU64,
    first_refusal: Mutex<Option<String>>,
}

impl Totals {
    /// `bytes` with restart markers if they are a JPEG libjpeg reads, else `None`.
    fn rewrite(&self, bytes: &[u8], segment_px: usize, name: impl FnOnce() -> String) -> Option<Vec<u8>> {
        let rewritten = if is_jpeg(bytes) {
            add_restart_markers(bytes, segment_px).map_err(|e| self.refuse(format!("{}: {e}", name())))
        } else {
            Err(())
        };
        let counter = if rewritten.is_ok() { &self.rewritten } else { &self.copied };
        counter.fetch_add(1, Ordering::Relaxed);
        rewritten.ok().map(|(jpeg, _)| jpeg)
    }

    /// A shard's totals added in, once the whole shard was rewritten.
    fn absorb(&self, shard: Totals) {
        self.rewritten.fetch_add(shard.rewritten.into_inner(), Ordering::Relaxed);
        self.copied.fetch_add(shard.copied.into_inner(), Ordering::Relaxed);
        if let Some(refusal) = shard.first_refusal.into_inner().unwrap() {
            self.refuse(refusal);
        }
    }

    fn refuse(&self, refusal: String) {
        self.first_refusal.lock().unwrap().get_or_insert(refusal);
    }
}

/// A shard format whose JPEGs are rewritten inside it.
type Shard = fn(&[u8], usize, &Totals) -> anyhow::Result<Vec<u8>>;

/// How `file` holds JPEGs: as a shard of another format, or itself.
fn shard_format(file: &Path, bytes: &[u8]) -> Option<Shard> {
    if file.extension().is_some_and(|e| e.eq_ignore_ascii_case("tar")) {
        return Some(rewrite_tar);
    }
    let header = bytes.get(..12)?;
    let crc = u32::from_le_bytes(header[8..].try_into().expect("4 bytes"));
    (tfrecord::masked_crc(&header[..8]) == crc).then_some(rewrite_tfrecord as Shard)
}

/// Rewrites every JPEG under `input` into the same path under `output` (which may be
/// `input`: each file is replaced whole), segments at most `segment_px` wide; other files are
/// copied unless `output` is `input`.
pub fn rewrite_tree(input: &Path, output: &Path, segment_px: usize) -> anyhow::Result<Report> {
    let mut files = Vec::new();
    walk(input, &mut files)?;
    files.sort();
    let totals = Totals::default();
    let (bytes_in, bytes_out) = (AtomicU64::new(0), AtomicU64::new(0));
    files.par_iter().try_for_each(|file| -> anyhow::Result<()> {
        let target = output.join(file.strip_prefix(input).expect("walked from input"));
        let bytes = std::fs::read(file).with_context(|| format!("reading {}", file.display()))?;
        let out = match shard_format(file, &bytes) {
            // A damaged shard is left as it is, as a damaged JPEG is.
            Some(rewrite) => {
                let shard = Totals::default();
                match rewrite(&bytes, segment_px, &shard) {
                    Ok(out) => {
                        totals.absorb(shard);
                        Some(out)
                    }
                    Err(e) => {
                        totals.refuse(format!("{}: {e:#}", file.display()));
                        totals.copied.fetch_add(1, Ordering::Relaxed);
                        None
                    }
                }
            }
            None => totals.rewrite(&bytes, segment_px, || file.display().to_string()),
        };
        let read = bytes.len() as u64;
        let out = match out {
            Some(out) => out,
            None if output == input => return Ok(()),
            None => bytes,
        };
        bytes_in.fetch_add(read, Ordering::Relaxed);
        bytes_out.fetch_add(out.len() as u64, Ordering::Relaxed);
        if let Some(dir) = target.parent() {
            std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
        }
        // Written beside the target and renamed over it, so an interrupted rewrite in place
        // leaves every file whole; named after the whole file name, so that `k.jpg` and
        // `k.cls`, rewritten at once, never share one.
        let mut partial = target.clone().into_os_string();
        partial.push(".stoker-partial");
        let partial = PathBuf::from(partial);
        std::fs::write(&partial, &out).with_context(|| format!("writing {}", partial.display()))?;
        std::fs::rename(&partial, &target).with_context(|| format!("renaming onto {}", target.display()))
    })?;
    Ok(Report {
        rewritten: totals.rewritten.into_inner(),
        copied: totals.copied.into_inner(),
        first_refusal: totals.first_refusal.into_inner().unwrap(),
        bytes_in: bytes_in.into_inner(),
        bytes_out: bytes_out.into_inner(),
    })
}

/// A tar shard with its JPEG members rewritten, in the same order with the same headers
/// (but their sizes).
fn rewrite_tar(bytes: &[u8], segment_px: usize, totals: &Totals) -> anyhow::Result<Vec<u8>> {
    let mut archive = tar::Archive::new(bytes);
    let mut out = tar::Builder::new(Vec::with_capacity(bytes.len() + bytes.len() / 16));
    for entry in archive.entries()? {
        let mut entry = entry?;
        let path = entry.path()?.into_owned();
        let mut data = Vec::with_capacity(entry.size() as usize);
        std::io::Read::read_to_end(&mut entry, &mut data)?;
        let mut header = entry.header().clone();
        if header.entry_type().is_file()
            && let Some(jpeg) = totals.rewrite(&data, segment_px, || path.display().to_string())
        {
            data = jpeg;
        }
        header.set_size(data.len() as u64);
        out.append_data(&mut header, &path, data.as_slice())?;
    }
    Ok(out.into_inner()?)
}

/// A TFRecord shard with the JPEG values of its Examples rewritten, record by record.
fn rewrite_tfrecord(bytes: &[u8], segment_px: usize, totals: &Totals) -> anyhow::Result<Vec<u8>> {
    let mut out = Vec::with_capacity(bytes.len() + bytes.len() / 16);
    for (n, record) in tfrecord::records(Bytes::copy_from_slice(bytes), "").enumerate() {
        let record = record.map_err(|c| anyhow::anyhow!("record {n}: {}", c.detail))?;
        let name = || format!("record {n}");
        let example = example::rewrite_bytes(record, &mut |value| totals.rewrite(value, segment_px, name))
            .map_err(|e| anyhow::anyhow!("record {n} is not an Example: {e}"))?;
        tfrecord::write_record(&mut out, &example);
    }
    Ok(out)
}

fn walk(dir: &Path, files: &mut Vec<PathBuf>) -> anyhow::Result<()> {
    for entry in std::fs::read_dir(dir).with_context(|| format!("listing {}", dir.display()))? {
        let entry = entry?;
        let path = entry.path();
        if entry.file_type()?.is_dir() {
            walk(&path, files)?;
        } else {
            files.push(path);
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use jpeg_encoder::{ColorType, SamplingFactor};

    use std::collections::BTreeMap;

    use super::*;
    use crate::element::{Element, Field};
    use crate::ops::{decode_image, jpeg};

    #[test]
    fn a_tree_is_rewritten_with_the_same_pixels_and_other_files_copied() {
        let input = tempfile::tempdir().unwrap();
        let output = tempfile::tempdir().unwrap();
        let original = jpeg(120, 90, ColorType::Rgb, SamplingFactor::F_2_2, true);
        std::fs::create_dir(input.path().join("cat")).unwrap();
        std::fs::write(input.path().join("cat/a.jpg"), &original).unwrap();
        std::fs::write(input.path().join("cat/broken.JPEG"), b"\xFF\xD8\xFF\xE0 cut").unwrap();
        std::fs::write(input.path().join("labels.txt"), b"cat\n").unwrap();
        let mut shard = tar::Builder::new(Vec::new());
        for (name, data) in [("s0.jpg", &original[..]), ("s0.cls", b"3"), ("s1.jpeg", &original[..])] {
            let mut header = tar::Header::new_gnu();
            header.set_size(data.len() as u64);
            header.set_mode(0o644);
            shard.append_data(&mut header, name, data).unwrap();
        }
        std::fs::write(input.path().join("shard-000.tar"), shard.into_inner().unwrap()).unwrap();
        // TFRecord, named as TensorFlow's ImageNet script names its shards: two Examples.
        let examples: Vec<Element> = vec![
            [("image/encoded", Field::Bytes(original.clone().into())), ("image/class/label", Field::Int64(vec![7]))]
                .into(),
            [("image/encoded", Field::Bytes(Bytes::from_static(b"not a JPEG")))].into(),
        ]
        .into_iter()
        .map(|e: BTreeMap<&str, Field>| e.into_iter().map(|(k, v)| (k.to_string(), v)).collect())
        .collect();
        let mut records = Vec::new();
        examples.iter().for_each(|e| tfrecord::write_record(&mut records, &example::encode(e)));
        std::fs::write(input.path().join("train-00000-of-00002"), &records).unwrap();
        // The second shard's last record is cut short: the shard is left as it is.
        let cut = &records[..records.len() - 3];
        std::fs::write(input.path().join("train-00001-of-00002"), cut).unwrap();
        let report = rewrite_tree(input.path(), output.path(), 32).unwrap();
        // The folder's JPEG, the tar's two and the TFRecord's one; the text, the broken JPEG,
        // the label member, the Example's other value and the cut TFRecord shard.
        assert_eq!((report.rewritten, report.copied), (4, 5));
        let refusal = report.first_refusal.as_deref().unwrap();
        assert!(refusal.contains("broken.JPEG") || refusal.contains("train-00001-of-00002"), "{report:?}");
        let rewritten = std::fs::read(output.path().join("cat/a.jpg")).unwrap();
        assert!(rewritten.windows(2).any(|w| w == [0xFF, 0xDD]), "a restart interval");
        assert!(decode_image(&rewritten, 3).unwrap() == decode_image(&original, 3).unwrap());
        assert_eq!(std::fs::read(output.path().join("labels.txt")).unwrap(), b"cat\n");
        assert_eq!(std::fs::read(output.path().join("cat/broken.JPEG")).unwrap(), b"\xFF\xD8\xFF\xE0 cut");
        let shard = std::fs::read(output.path().join("shard-000.tar")).unwrap();
        let members: Vec<(String, Vec<u8>)> = tar::Archive::new(&shard[..])
            .entries()
            .unwrap()
            .map(|e| {
                let mut e = e.unwrap();
                let mut data = Vec::new();
                std::io::Read::read_to_end(&mut e, &mut data).unwrap();
                (e.path().unwrap().display().to_string(), data)
            })
            .collect();
        let names: Vec<&str> = members.iter().map(|m| m.0.as_str()).collect();
        assert_eq!(names, ["s0.jpg", "s0.cls", "s1.jpeg"]);
        assert_eq!((&members[0].1, &members[1].1[..], &members[2].1), (&rewritten, &b"3"[..], &rewritten));
        let records = std::fs::read(output.path().join("train-00000-of-00002")).unwrap();
        let decoded: Vec<Element> =
            tfrecord::read(Bytes::from(records), "shard").collect::<Result<_, _>>().expect("a valid TFRecord shard");
        assert_eq!(decoded[0]["image/encoded"], Field::Bytes(rewritten.clone().into()));
        assert_eq!(decoded[0]["image/class/label"], Field::Int64(vec![7]));
        assert_eq!(decoded[1], examples[1]);
        assert_eq!(std::fs::read(output.path().join("train-00001-of-00002")).unwrap(), cut);
        // In place: the JPEG replaced, nothing else touched, nothing partial left.
        let report = rewrite_tree(input.path(), input.path(), 32).unwrap();
        assert_eq!((report.rewritten, report.copied), (4, 5));
        assert_eq!(std::fs::read(input.path().join("cat/a.jpg")).unwrap(), rewritten);
        let mut left = Vec::new();
        walk(input.path(), &mut left).unwrap();
        assert_eq!(left.len(), 6, "{left:?}");
    }
}
