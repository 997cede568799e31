//! Batches through shared memory from a worker on the same host (the worker's side is
//! worker/src/stream/shared.rs): the stream request names this process's shared-memory
//! directory; a worker whose own directory that is writes each batch's payload to a file there
//! and sends its name. The client maps the file read-only (no copy) and renames it
//! `<name>.held`, then `<name>.free` once the last tensor over the mapping is dropped, when
//! the worker may write a later batch into it; a file the worker does not reuse is removed at
//! once, its memory freed with the mapping.

use std::os::unix::fs::{MetadataExt as _, OpenOptionsExt as _};
use std::path::{Path, PathBuf};

use bytes::Bytes;
use stoker_api::proto;

/// The directory a client maps batches from, unless told another.
pub const DIRECTORY: &str = "/dev/shm";

/// What every worker's file is named from; nothing else is opened.
const PREFIX: &str = "stoker-";

/// `dir` as a worker compares it with its own (`StreamRequest.shared_memory`), or None where
/// there is no such directory.
pub fn identity(dir: &Path) -> Option<proto::SharedMemory> {
    let meta = std::fs::metadata(dir).ok().filter(|m| m.is_dir())?;
    let boot_id = std::fs::read_to_string("/proc/sys/kernel/random/boot_id").ok()?.trim().to_string();
    // SAFETY: geteuid has no preconditions.
    let uid = unsafe { libc::geteuid() };
    Some(proto::SharedMemory { boot_id, device: meta.dev(), inode: meta.ino(), uid })
}

/// Why a batch's file could not be taken.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TakeError {
    /// Not a name a worker gives its files: never opened.
    #[error("{0:?} is not a worker's shared-memory file")]
    NotAWorkersFile(String),
    /// The worker removed it (its stream broke and ended before the client took the file).
    /// Not received: a resumed stream sends the batch again.
    #[error("the batch's shared-memory file {0:?} is gone")]
    Gone(String),
    #[error("the batch's shared-memory file {file:?}: {problem}")]
    Unreadable { file: String, problem: String },
}

/// The worker's file `name` in `dir`, mapped read-only, as `size` bytes. Without `reuse` the
/// file is removed at once; with it, renamed `.held`, and `.free` when the returned bytes and
/// every slice of them are dropped.
pub fn take(dir: &Path, name: &str, size: usize, reuse: bool) -> Result<Bytes, TakeError> {
    if !name.starts_with(PREFIX) || name.contains('/') {
        return Err(TakeError::NotAWorkersFile(name.to_string()));
    }
    let path = dir.join(name);
    let unreadable = |e: std::io::Error| TakeError::Unreadable { file: name.to_string(), problem: e.to_string() };
    let file = match std::fs::OpenOptions::new().read(true).custom_flags(libc::O_NOFOLLOW).open(&path) {
        Ok(file) => file,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Err(TakeError::Gone(name.to_string())),
        Err(e) => return Err(unreadable(e)),
    };
    // Renamed or removed at once: the worker learns it may write the next batch, and the
    // mapping keeps the memory until the tensors over it are gone.
    let held = path.with_file_name(format!("{name}.held"));
    let moved = if reuse { std::fs::rename(&path, &held) } else { std::fs::remove_file(&path) };
    match moved {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Err(TakeError::Gone(name.to_string())),
        Err(e) => return Err(unreadable(e)),
    }
    let mapped = (|| {
        let have = file.metadata().map_err(unreadable)?.len();
        if have < size as u64 {
            return Err(TakeError::Unreadable {
                file: name.to_string(),
                problem: format!("it holds {have} bytes, the batch {size}"),
            });
        }
        if size == 0 {
            return Ok(None);
        }
        // SAFETY: the worker never writes a file again until it is renamed `.free`, which
        // happens only once the mapping is dropped (`Held::drop`); a removed file is never
        // written again.
        unsafe { memmap2::MmapOptions::new().len(size).map(&file) }.map(Some).map_err(unreadable)
    })();
    let give_back = reuse.then_some(held);
    match mapped {
        Ok(Some(map)) => Ok(Bytes::from_owner(Held { map, give_back, taker: std::process::id() })),
        Ok(None) => {
            Held::give_back(give_back.as_deref(), std::process::id());
            Ok(Bytes::new())
        }
        Err(e) => {
            if let Some(held) = &give_back {
                let _ = std::fs::remove_file(held);
            }
            Err(e)
        }
    }
}

/// A mapped batch file, given back to its worker when dropped.
struct Held {
    map: memmap2::Mmap,
    /// `<name>.held`, renamed `.free` on drop; None: the file was removed when taken.
    give_back: Option<PathBuf>,
    /// The process that took it: a forked child dropping its copy does not give it back.
    taker: u32,
}

impl Held {
    fn give_back(held: Option<&Path>, taker: u32) {
        let Some(held) = held else { return };
        if std::process::id() != taker {
            return;
        }
        // Fails when the worker's stream ended and removed it: nothing to give back then.
        let _ = std::fs::rename(held, held.with_extension("free"));
    }
}

impl AsRef<[u8]> for Held {
    fn as_ref(&self) -> &[u8] {
        &self.map
    }
}

impl Drop for Held {
    fn drop(&mut self) {
        Held::give_back(self.give_back.as_deref(), self.taker);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_reused_file_is_held_while_mapped_and_free_once_dropped() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("stoker-1-a-0"), b"hello").unwrap();
        let bytes = take(dir.path(), "stoker-1-a-0", 5, true).unwrap();
        let slice = bytes.slice(1..3);
        drop(bytes);
        assert!(dir.path().join("stoker-1-a-0.held").exists(), "a slice still reads it");
        assert_eq!(&slice[..], b"el");
        drop(slice);
        assert!(dir.path().join("stoker-1-a-0.free").exists());
    }

    #[test]
    fn a_file_not_reused_is_removed_when_taken_and_one_gone_says_so() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("stoker-1-a-1"), b"abc").unwrap();
        assert_eq!(&take(dir.path(), "stoker-1-a-1", 3, false).unwrap()[..], b"abc");
        assert!(std::fs::read_dir(dir.path()).unwrap().next().is_none());
        assert_eq!(take(dir.path(), "stoker-1-a-1", 3, false), Err(TakeError::Gone("stoker-1-a-1".into())));
    }

    #[test]
    fn other_files_and_short_ones_are_refused() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("passwd"), b"x").unwrap();
        assert!(matches!(take(dir.path(), "passwd", 1, false), Err(TakeError::NotAWorkersFile(_))));
        assert!(matches!(take(dir.path(), "stoker-../passwd", 1, false), Err(TakeError::NotAWorkersFile(_))));
        std::fs::write(dir.path().join("stoker-1-a-2"), b"x").unwrap();
        assert!(matches!(take(dir.path(), "stoker-1-a-2", 2, true), Err(TakeError::Unreadable { .. })));
        let left: Vec<_> = std::fs::read_dir(dir.path()).unwrap().map(|e| e.unwrap().file_name()).collect();
        assert_eq!(left, ["passwd"], "the held file is removed");
    }
}
