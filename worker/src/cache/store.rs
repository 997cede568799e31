//! The cache volume: one directory per entry, named by the fingerprint's hex digest.
//!
//! ```text
//! <root>/<hex>/splits/<split>.chunk          a split's records, renamed into place when written
//! <root>/<hex>/splits/<split>.chunk.tmp-<w>  being written by holder <w>
//! <root>/<hex>/manifest.json                 written once every split is in place
//! <root>/<hex>/complete                      the marker: only now may anyone read the entry
//! <root>/<hex>/last-used                     its mtime is when a reader last opened the entry
//! <root>/<hex>/leases/{reader,writer}-<w>    their mtimes say who uses the entry
//! <root>/<hex>.corrupt-<nanos>/              an entry dropped for corruption, removed on eviction
//! ```
//!
//! Everything that makes a file visible is a rename, so a process killed at any point leaves
//! either the old state or the new one, plus tmp files nobody reads.

use std::fs::{self, File, OpenOptions};
use std::io::{self, Read, Write};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use serde::{Deserialize, Serialize};

use super::chunk::MAGIC;

const COMPLETE: &str = "complete";
const MANIFEST: &str = "manifest.json";
const LAST_USED: &str = "last-used";
const CORRUPT: &str = ".corrupt-";
const PROBE_BLOCK: usize = 1 << 20;

/// The cache volume's root directory.
#[derive(Clone, Debug)]
pub struct CacheDir {
    root: PathBuf,
}

/// One fingerprint's directory, which may not exist yet.
#[derive(Clone, Debug)]
pub struct Entry {
    fingerprint: String,
    dir: PathBuf,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LeaseKind {
    Reader,
    Writer,
}

impl LeaseKind {
    fn name(self) -> &'static str {
        match self {
            LeaseKind::Reader => "reader",
            LeaseKind::Writer => "writer",
        }
    }
}

/// What a complete entry holds, written when its last split is in place.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Manifest {
    pub fingerprint: String,
    pub format_version: u32,
    pub splits: u64,
    pub bytes: u64,
    /// Bytes of each split's chunk file, by split id.
    pub split_bytes: Vec<u64>,
    pub created_unix: u64,
    /// The hint's index in the pipeline's transforms.
    pub at: u32,
}

/// The volume's sequential throughput as measured by `CacheDir::probe`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Throughput {
    pub write_bytes_per_second: f64,
    pub read_bytes_per_second: f64,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Evicted {
    pub fingerprint: String,
    pub bytes: u64,
    pub reason: &'static str,
}

impl CacheDir {
    pub fn open(root: &Path) -> io::Result<CacheDir> {
        fs::create_dir_all(root).map_err(|e| annotate(e, "creating the cache directory", root))?;
        Ok(CacheDir { root: root.to_path_buf() })
    }

    pub fn entry(&self, fingerprint: &str) -> Entry {
        let hex = fingerprint.strip_prefix("sha256:").unwrap_or(fingerprint);
        Entry { fingerprint: fingerprint.to_string(), dir: self.root.join(hex) }
    }

    /// Removes corrupt entries, incomplete ones abandoned for `incomplete_ttl`, then complete
    /// ones, least recently used first, while the volume holds more than `cap_bytes`. An entry
    /// with a lease younger than `lease_ttl` is in use and never removed.
    pub fn evict(
        &self,
        cap_bytes: u64,
        now: SystemTime,
        lease_ttl: Duration,
        incomplete_ttl: Duration,
    ) -> io::Result<Vec<Evicted>> {
        let mut evicted = Vec::new();
        let mut total = 0;
        let mut complete = Vec::new();
        for item in fs::read_dir(&self.root)? {
            let item = item?;
            let name = item.file_name().to_string_lossy().into_owned();
            if !item.file_type()?.is_dir() {
                continue;
            }
            if let Some((hex, _)) = name.split_once(CORRUPT) {
                let bytes = tree_bytes(&item.path());
                remove_tree(&item.path())?;
                evicted.push(Evicted { fingerprint: format!("sha256:{hex}"), bytes, reason: "corrupt" });
                continue;
            }
            let entry = self.entry(&format!("sha256:{name}"));
            let bytes = tree_bytes(&entry.dir);
            let in_use = entry.leased_since(now.checked_sub(lease_ttl).unwrap_or(UNIX_EPOCH));
            if entry.is_complete() {
                total += bytes;
                if !in_use {
                    complete.push((entry.last_used().unwrap_or(UNIX_EPOCH), entry, bytes));
                }
            } else if !in_use && newest_mtime(&entry.dir).is_some_and(|t| t + incomplete_ttl < now) {
                remove_tree(&entry.dir)?;
                evicted.push(Evicted { fingerprint: entry.fingerprint, bytes, reason: "incomplete and abandoned" });
            } else {
                total += bytes;
            }
        }
        complete.sort_by_key(|(used, ..)| *used);
        for (_, entry, bytes) in complete {
            if total <= cap_bytes {
                break;
            }
            // Readers check the marker first: renaming it away makes the removal atomic to them.
            entry.hide()?;
            total -= bytes;
            evicted.push(Evicted { fingerprint: entry.fingerprint, bytes, reason: "least recently used over the cap" });
        }
        Ok(evicted)
    }

    /// Writes `bytes` of incompressible data in 1 MiB writes and fsyncs it, drops it from the
    /// page cache, and reads it back: the volume's real sequential throughput.
    pub fn probe(&self, bytes: usize) -> io::Result<Throughput> {
        let path = self.root.join(format!(".probe-{}-{}", std::process::id(), nanos()));
        let result = probe_file(&path, bytes.max(PROBE_BLOCK));
        let _ = fs::remove_file(&path);
        result.map_err(|e| annotate(e, "probing the cache volume", &path))
    }
}

fn probe_file(path: &Path, bytes: usize) -> io::Result<Throughput> {
    let mut block = vec![0u8; PROBE_BLOCK];
    let mut state = 0x9E37_79B9_7F4A_7C15u64 ^ nanos() as u64;
    for word in block.chunks_exact_mut(8) {
        // xorshift: incompressible, so a compressing filesystem cannot flatter the figure
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        word.copy_from_slice(&state.to_le_bytes());
    }
    let blocks = bytes.div_ceil(PROBE_BLOCK);
    let started = Instant::now();
    let mut file = File::create(path)?;
    for i in 0..blocks {
        block[0..8].copy_from_slice(&(i as u64).to_le_bytes());
        file.write_all(&block)?;
    }
    file.sync_all()?;
    let write = started.elapsed();
    drop_page_cache(&file);
    drop(file);
    let started = Instant::now();
    let mut file = File::open(path)?;
    let mut read = 0;
    loop {
        match file.read(&mut block)? {
            0 => break,
            n => read += n,
        }
    }
    let read_time = started.elapsed();
    let total = (blocks * PROBE_BLOCK) as f64;
    if read != blocks * PROBE_BLOCK {
        return Err(io::Error::other(format!("read back {read} of {total} bytes")));
    }
    Ok(Throughput {
        write_bytes_per_second: total / write.as_secs_f64().max(1e-9),
        read_bytes_per_second: total / read_time.as_secs_f64().max(1e-9),
    })
}

#[cfg(unix)]
fn drop_page_cache(file: &File) {
    use std::os::fd::AsRawFd;
    // Best effort: where the kernel keeps the pages anyway the read figure is optimistic.
    // SAFETY: posix_fadvise on a descriptor the File owns; it only advises the kernel.
    unsafe { libc::posix_fadvise(file.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) };
}

#[cfg(not(unix))]
fn drop_page_cache(_: &File) {}

impl Entry {
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    pub fn is_complete(&self) -> bool {
        self.dir.join(COMPLETE).is_file()
    }

    pub fn has_split(&self, split: u64) -> bool {
        self.split_path(split).is_file()
    }

    /// Starts the split's chunk file; it is visible only after `SplitWriter::finish`.
    pub fn write_split(&self, split: u64, holder: &str) -> io::Result<SplitWriter> {
        let splits = self.dir.join("splits");
        fs::create_dir_all(&splits).map_err(|e| annotate(e, "creating the entry", &splits))?;
        let path = self.split_path(split);
        let tmp = splits.join(format!("{split}.chunk.tmp-{holder}"));
        let mut file =
            io::BufWriter::with_capacity(1 << 20, File::create(&tmp).map_err(|e| annotate(e, "creating", &tmp))?);
        file.write_all(MAGIC)?;
        Ok(SplitWriter { file: Some(file), tmp, path, records: 0 })
    }

    /// Completes the entry if all of `splits` are in place: the manifest, then the marker,
    /// each by a rename. Returns whether the entry is complete.
    pub fn try_complete(&self, splits: u64, at: u32, format_version: u32) -> io::Result<bool> {
        if self.is_complete() {
            return Ok(true);
        }
        let mut split_bytes = Vec::with_capacity(splits as usize);
        for split in 0..splits {
            match fs::metadata(self.split_path(split)) {
                Ok(m) => split_bytes.push(m.len()),
                Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(false),
                Err(e) => return Err(e),
            }
        }
        let manifest = Manifest {
            fingerprint: self.fingerprint.clone(),
            format_version,
            splits,
            bytes: split_bytes.iter().sum(),
            split_bytes,
            created_unix: SystemTime::now().duration_since(UNIX_EPOCH).unwrap_or_default().as_secs(),
            at,
        };
        let json = serde_json::to_vec_pretty(&manifest).expect("a manifest serializes");
        self.publish(MANIFEST, &json)?;
        self.publish(COMPLETE, b"")?;
        // Tmp files left by killed writers are of no use any more.
        if let Ok(items) = fs::read_dir(self.dir.join("splits")) {
            for item in items.flatten() {
                if item.file_name().to_string_lossy().contains(".tmp-") {
                    let _ = fs::remove_file(item.path());
                }
            }
        }
        Ok(true)
    }

    /// The manifest of a complete entry; `None` while it is not complete.
    pub fn manifest(&self) -> io::Result<Option<Manifest>> {
        if !self.is_complete() {
            return Ok(None);
        }
        let path = self.dir.join(MANIFEST);
        let json = fs::read(&path).map_err(|e| annotate(e, "reading", &path))?;
        let manifest = serde_json::from_slice(&json)
            .map_err(|e| io::Error::new(io::ErrorKind::InvalidData, format!("{}: {e}", path.display())))?;
        Ok(Some(manifest))
    }

    /// A split's chunk file of a complete entry, whole.
    pub fn read_split(&self, split: u64) -> io::Result<Bytes> {
        if !self.is_complete() {
            return Err(io::Error::new(
                io::ErrorKind::NotFound,
                format!("cache entry {} is not complete", self.dir.display()),
            ));
        }
        let path = self.split_path(split);
        Ok(Bytes::from(fs::read(&path).map_err(|e| annotate(e, "reading", &path))?))
    }

    pub fn touch_used(&self, now: SystemTime) -> io::Result<()> {
        touch(&self.dir.join(LAST_USED), now)
    }

    /// When a reader last opened the entry, or else when it was completed.
    pub fn last_used(&self) -> Option<SystemTime> {
        [LAST_USED, COMPLETE].iter().find_map(|name| fs::metadata(self.dir.join(name)).and_then(|m| m.modified()).ok())
    }

    /// Marks the entry in use by `holder` until the lease's TTL passes without renewal.
    pub fn lease(&self, kind: LeaseKind, holder: &str, now: SystemTime) -> io::Result<()> {
        let leases = self.dir.join("leases");
        fs::create_dir_all(&leases)?;
        touch(&leases.join(format!("{}-{holder}", kind.name())), now)
    }

    /// Takes the entry away from every reader: the marker goes first, then the directory is
    /// renamed aside for the next eviction to remove.
    pub fn drop_corrupt(&self) -> io::Result<()> {
        match fs::remove_file(self.dir.join(COMPLETE)) {
            Err(e) if e.kind() != io::ErrorKind::NotFound => return Err(e),
            _ => {}
        }
        let mut aside = self.dir.clone().into_os_string();
        aside.push(format!("{CORRUPT}{}", nanos()));
        match fs::rename(&self.dir, aside) {
            Err(e) if e.kind() != io::ErrorKind::NotFound => Err(e),
            _ => Ok(()),
        }
    }

    /// Evicts the entry's chunk files from the page cache, so that the next read comes from
    /// the volume (for benchmarks; best effort).
    pub fn drop_from_page_cache(&self) {
        for item in fs::read_dir(self.dir.join("splits")).into_iter().flatten().flatten() {
            if let Ok(file) = File::open(item.path()) {
                drop_page_cache(&file);
            }
        }
    }

    fn split_path(&self, split: u64) -> PathBuf {
        self.dir.join("splits").join(format!("{split}.chunk"))
    }

    /// Writes `name` whole by a rename, so a reader sees all of it or nothing.
    fn publish(&self, name: &str, contents: &[u8]) -> io::Result<()> {
        let tmp = self.dir.join(format!("{name}.tmp-{}-{}", std::process::id(), nanos()));
        let mut file = File::create(&tmp).map_err(|e| annotate(e, "creating", &tmp))?;
        file.write_all(contents)?;
        file.sync_all()?;
        fs::rename(&tmp, self.dir.join(name))?;
        sync_dir(&self.dir)
    }

    fn leased_since(&self, since: SystemTime) -> bool {
        let Ok(leases) = fs::read_dir(self.dir.join("leases")) else { return false };
        leases.flatten().any(|l| l.metadata().and_then(|m| m.modified()).is_ok_and(|t| t > since))
    }

    /// Removes a complete entry so that no reader can open it half-removed.
    fn hide(&self) -> io::Result<()> {
        fs::remove_file(self.dir.join(COMPLETE))?;
        remove_tree(&self.dir)
    }
}

/// One split's chunk file being written. Dropped unfinished, it removes its tmp file.
pub struct SplitWriter {
    file: Option<io::BufWriter<File>>,
    tmp: PathBuf,
    path: PathBuf,
    records: u64,
}

impl SplitWriter {
    pub fn append(&mut self, encoded: &[u8]) -> io::Result<()> {
        self.file.as_mut().expect("an unfinished writer has its file").write_all(encoded)
    }

    /// Counts records appended (for the log line at `finish`).
    pub fn records(&mut self, n: u64) {
        self.records += n;
    }

    /// Flushes, fsyncs and renames the chunk into place; returns its size in bytes.
    pub fn finish(mut self) -> io::Result<u64> {
        let file = self.file.take().expect("finish runs once");
        let file = file.into_inner().map_err(|e| e.into_error())?;
        file.sync_all()?;
        let bytes = file.metadata()?.len();
        fs::rename(&self.tmp, &self.path).map_err(|e| annotate(e, "renaming into place", &self.path))?;
        tracing::debug!(chunk = %self.path.display(), records = self.records, bytes, "cache chunk written");
        Ok(bytes)
    }
}

impl Drop for SplitWriter {
    fn drop(&mut self) {
        if self.file.is_some() {
            let _ = fs::remove_file(&self.tmp);
        }
    }
}

fn touch(path: &Path, at: SystemTime) -> io::Result<()> {
    let file = OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(path)
        .map_err(|e| annotate(e, "touching", path))?;
    file.set_modified(at)
}

fn sync_dir(dir: &Path) -> io::Result<()> {
    // A rename is durable once its directory is synced; some filesystems refuse to open one.
    match File::open(dir) {
        Ok(d) => d.sync_all().or(Ok(())),
        Err(_) => Ok(()),
    }
}

fn remove_tree(path: &Path) -> io::Result<()> {
    match fs::remove_dir_all(path) {
        Err(e) if e.kind() != io::ErrorKind::NotFound => Err(annotate(e, "removing", path)),
        _ => Ok(()),
    }
}

fn tree_bytes(path: &Path) -> u64 {
    walk(path).map(|m| m.len()).sum()
}

fn newest_mtime(path: &Path) -> Option<SystemTime> {
    let own = fs::metadata(path).and_then(|m| m.modified()).ok();
    walk(path).filter_map(|m| m.modified().ok()).chain(own).max()
}

/// The metadata of every file under `path`.
fn walk(path: &Path) -> Box<dyn Iterator<Item = fs::Metadata>> {
    let Ok(items) = fs::read_dir(path) else { return Box::new(std::iter::empty()) };
    Box::new(items.flatten().flat_map(|item| match item.metadata() {
        Ok(m) if m.is_dir() => walk(&item.path()),
        Ok(m) => Box::new(std::iter::once(m)),
        Err(_) => Box::new(std::iter::empty()),
    }))
}

fn nanos() -> u128 {
    SystemTime::now().duration_since(UNIX_EPOCH).unwrap_or_default().as_nanos()
}

fn annotate(e: io::Error, doing: &str, path: &Path) -> io::Error {
    io::Error::new(e.kind(), format!("{doing} {}: {e}", path.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    const FP: &str = "sha256:00aa";
    const TTL: Duration = Duration::from_secs(60);
    const INCOMPLETE: Duration = Duration::from_secs(600);

    fn write(entry: &Entry, split: u64, payload: &[u8]) {
        let mut w = entry.write_split(split, "w1").unwrap();
        w.append(payload).unwrap();
        w.records(1);
        w.finish().unwrap();
    }

    /// A complete entry of `bytes` in one split, last used at `used`.
    fn complete(dir: &CacheDir, fp: &str, bytes: usize, used: SystemTime) -> Entry {
        let entry = dir.entry(fp);
        write(&entry, 0, &vec![7; bytes]);
        assert!(entry.try_complete(1, 2, 1).unwrap());
        entry.touch_used(used).unwrap();
        entry
    }

    #[test]
    fn an_entry_completes_only_when_every_split_is_in_place() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = CacheDir::open(tmp.path()).unwrap();
        let entry = dir.entry(FP);
        assert_eq!(entry.dir(), tmp.path().join("00aa"));
        write(&entry, 1, b"one");
        assert!(!entry.try_complete(2, 3, 1).unwrap());
        assert!(!entry.is_complete());
        assert!(entry.read_split(1).is_err(), "an incomplete entry is never read");
        assert_eq!(entry.manifest().unwrap(), None);
        write(&entry, 0, b"zero!");
        assert!(entry.try_complete(2, 3, 1).unwrap());
        let m = entry.manifest().unwrap().unwrap();
        assert_eq!((m.splits, m.at, m.format_version, m.fingerprint.as_str()), (2, 3, 1, FP));
        assert_eq!(m.split_bytes, vec![8 + 5, 8 + 3]);
        assert_eq!(&entry.read_split(0).unwrap()[..], b"STKCHNK1zero!");
    }

    #[test]
    fn a_tmp_file_left_by_a_killed_writer_never_counts() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = CacheDir::open(tmp.path()).unwrap();
        let entry = dir.entry(FP);
        let mut killed = entry.write_split(0, "dead").unwrap();
        killed.append(b"half").unwrap();
        std::mem::forget(killed); // a SIGKILL runs no destructor
        assert!(!entry.has_split(0));
        assert!(!entry.try_complete(1, 0, 1).unwrap());
        // Another worker writes the split: the entry completes and the tmp file is gone.
        write(&entry, 0, b"whole");
        assert!(entry.try_complete(1, 0, 1).unwrap());
        let names: Vec<_> = fs::read_dir(entry.dir().join("splits")).unwrap().map(|i| i.unwrap().file_name()).collect();
        assert_eq!(names, vec!["0.chunk"]);
        // A writer dropped unfinished (an error) cleans up after itself.
        let dropped = dir.entry("sha256:bb").write_split(0, "w").unwrap();
        drop(dropped);
        assert_eq!(fs::read_dir(tmp.path().join("bb/splits")).unwrap().count(), 0);
    }

    #[test]
    fn eviction_removes_the_least_recently_used_until_under_the_cap() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = CacheDir::open(tmp.path()).unwrap();
        let now = SystemTime::now();
        let old = complete(&dir, "sha256:01", 1000, now - Duration::from_secs(300));
        let older = complete(&dir, "sha256:02", 1000, now - Duration::from_secs(400));
        let recent = complete(&dir, "sha256:03", 1000, now - Duration::from_secs(100));
        let evicted = dir.evict(2500, now, TTL, INCOMPLETE).unwrap();
        assert_eq!(evicted.iter().map(|e| e.fingerprint.as_str()).collect::<Vec<_>>(), vec!["sha256:02"]);
        assert!(!older.dir().exists() && old.is_complete() && recent.is_complete());
        assert!(dir.evict(2500, now, TTL, INCOMPLETE).unwrap().is_empty(), "under the cap nothing goes");
    }

    #[test]
    fn an_entry_in_use_survives_eviction_even_over_the_cap() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = CacheDir::open(tmp.path()).unwrap();
        let now = SystemTime::now();
        let read = complete(&dir, "sha256:01", 1000, now - Duration::from_secs(500));
        let idle = complete(&dir, "sha256:02", 1000, now - Duration::from_secs(100));
        read.lease(LeaseKind::Reader, "w1", now - Duration::from_secs(10)).unwrap();
        let evicted = dir.evict(0, now, TTL, INCOMPLETE).unwrap();
        assert_eq!(evicted.len(), 1);
        assert_eq!(evicted[0].fingerprint, "sha256:02");
        assert!(read.is_complete() && !idle.dir().exists());
        // A lease not renewed for the TTL is a dead holder's.
        assert_eq!(dir.evict(0, now + TTL, TTL, INCOMPLETE).unwrap().len(), 1);
        assert!(!read.dir().exists());
    }

    #[test]
    fn abandoned_incomplete_and_corrupt_entries_are_removed() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = CacheDir::open(tmp.path()).unwrap();
        let now = SystemTime::now();
        let abandoned = dir.entry("sha256:0a");
        write(&abandoned, 0, b"x");
        let writing = dir.entry("sha256:0b");
        write(&writing, 0, b"x");
        writing.lease(LeaseKind::Writer, "w2", now + INCOMPLETE).unwrap();
        let corrupt = complete(&dir, "sha256:0c", 10, now);
        corrupt.drop_corrupt().unwrap();
        assert!(!corrupt.dir().exists() && !corrupt.is_complete());
        assert!(dir.evict(u64::MAX, now, TTL, INCOMPLETE).unwrap().iter().all(|e| e.reason == "corrupt"));
        let later = now + INCOMPLETE + Duration::from_secs(1);
        let evicted = dir.evict(u64::MAX, later, TTL, INCOMPLETE).unwrap();
        assert_eq!(evicted.iter().map(|e| e.fingerprint.as_str()).collect::<Vec<_>>(), vec!["sha256:0a"]);
        assert!(writing.dir().exists(), "an entry with a live writer stays");
        assert_eq!(fs::read_dir(tmp.path()).unwrap().count(), 1);
    }

    #[test]
    fn the_probe_measures_positive_throughput_and_leaves_nothing() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = CacheDir::open(tmp.path()).unwrap();
        let t = dir.probe(4 << 20).unwrap();
        assert!(t.write_bytes_per_second > 0.0 && t.read_bytes_per_second > 0.0, "{t:?}");
        assert_eq!(fs::read_dir(tmp.path()).unwrap().count(), 0);
    }
}
