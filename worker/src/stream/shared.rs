//! Batches for a consumer on the same host, through shared memory: each batch's payload is
//! written to a file of the shared-memory directory (`/dev/shm`), and the stream carries only
//! the batch's header and the file's name. The consumer maps the file (no copy), renames it
//! `<name>.held`, and `<name>.free` once it no longer reads from it; the worker then writes a
//! later batch into that file. Over gRPC a batch is copied into messages, through the
//! kernel's socket buffers and out into the consumer's buffer; here it is written once, and
//! into memory that is already the file's: a new file per batch cost the kernel as much again
//! in allocating, zeroing and freeing its pages as the copy itself.
//!
//! Only a consumer that names this very directory (the same kernel boot, device and inode) and
//! runs as this worker's user gets it: the files are created new, readable by their owner
//! alone, under names nobody can guess, and one given back is written again only as a plain
//! file. A stream keeps at most [`WAITING`] files waiting to be taken and tracks at most
//! [`HELD_AT_MOST`] held ones; the files of a stream (not taken, held or free) are removed
//! when it ends, and files of workers that died by the next worker to start on the directory.

use std::collections::VecDeque;
use std::io::Write as _;
use std::os::unix::fs::{MetadataExt as _, OpenOptionsExt as _};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use futures::{Stream, StreamExt as _, stream};
use stoker_api::chunk::chunk_batch;
use stoker_api::proto::{self, BatchChunk};
use stoker_api::{Batch, Stacked};
use tonic::Status;

use super::{Batches, Outgoing, Pulled};

/// Files of one stream waiting for its consumer at most: one being taken while the next is
/// written. They are outside the worker's memory budget, as the socket buffers of a gRPC
/// stream are.
pub const WAITING: usize = 2;

/// What every file of a worker is named from: `stoker-<pid>-<random>-<n>`.
const PREFIX: &str = "stoker-";

/// What a consumer renames a file it mapped to, and then one it is done with.
const HELD: &str = ".held";
const FREE: &str = ".free";

/// Files of one stream taken by its consumer and not yet given back, at most: beyond, the
/// oldest is removed rather than waited for (a consumer keeping many batches, or one that
/// removes files as an older client does). Its memory goes when the consumer unmaps it.
const HELD_AT_MOST: usize = 8;

/// A shared-memory directory this worker writes batches to.
pub struct SharedMemory {
    dir: PathBuf,
    /// The directory as a consumer names it (StreamRequest.shared_memory).
    identity: proto::SharedMemory,
    /// `stoker-<pid>-<random>-`: this process's files.
    prefix: String,
    next: AtomicU64,
}

impl SharedMemory {
    /// `dir` (e.g. `/dev/shm`) for this worker, after removing the files of workers that died.
    pub fn open(dir: &Path) -> std::io::Result<SharedMemory> {
        let meta = std::fs::metadata(dir)?;
        if !meta.is_dir() {
            return Err(std::io::Error::new(std::io::ErrorKind::NotADirectory, format!("{}", dir.display())));
        }
        let boot_id = std::fs::read_to_string("/proc/sys/kernel/random/boot_id")?.trim().to_string();
        // SAFETY: geteuid has no preconditions.
        let uid = unsafe { libc::geteuid() };
        let identity = proto::SharedMemory { boot_id, device: meta.dev(), inode: meta.ino(), uid };
        let prefix = format!("{PREFIX}{}-{:016x}-", std::process::id(), rand::random::<u64>());
        let shared = SharedMemory { dir: dir.to_path_buf(), identity, prefix, next: AtomicU64::new(0) };
        shared.remove_stale();
        Ok(shared)
    }

    /// Whether a consumer that says it maps files from `theirs` can take this worker's.
    pub fn serves(&self, theirs: &proto::SharedMemory) -> bool {
        *theirs == self.identity
    }

    /// The files this worker wrote that are still there (`stoker-<pid>-…` of this process).
    pub fn remove_all(&self) {
        for (path, _) in self.files() {
            if path.file_name().and_then(|n| n.to_str()).is_some_and(|n| n.starts_with(&self.prefix)) {
                let _ = std::fs::remove_file(path);
            }
        }
    }

    /// Removes the files of workers that are gone: a process that no longer runs, or one with
    /// this process's id but another random part (a process before it).
    fn remove_stale(&self) {
        let own = std::process::id();
        for (path, pid) in self.files() {
            let ours = path.file_name().and_then(|n| n.to_str()).is_some_and(|n| n.starts_with(&self.prefix));
            if !ours && (pid == own || !runs(pid)) {
                tracing::info!(file = %path.display(), "removing a shared-memory batch of a worker that is gone");
                let _ = std::fs::remove_file(path);
            }
        }
    }

    /// This user's `stoker-<pid>-…` files in the directory, with the pid in their names.
    fn files(&self) -> Vec<(PathBuf, u32)> {
        let Ok(entries) = std::fs::read_dir(&self.dir) else { return Vec::new() };
        entries
            .flatten()
            .filter_map(|entry| {
                let name = entry.file_name().into_string().ok()?;
                let pid = name.strip_prefix(PREFIX)?.split('-').next()?.parse().ok()?;
                let meta = entry.metadata().ok()?;
                (meta.is_file() && meta.uid() == self.identity.uid).then(|| (entry.path(), pid))
            })
            .collect()
    }

    /// The name the next file gets.
    fn next_name(&self) -> String {
        format!("{}{}", self.prefix, self.next.fetch_add(1, Ordering::Relaxed))
    }

    /// Writes `batch`'s payload to the file `name`: one given back by the consumer (`reused`),
    /// its pages already there, else a new one.
    fn write(&self, batch: &Batch<Stacked>, name: &str, reused: bool) -> std::io::Result<()> {
        let path = self.dir.join(name);
        let written = (|| {
            let mut options = std::fs::OpenOptions::new();
            if reused {
                // Ours, renamed from `.free` just now: never through a link someone put there.
                options.write(true).custom_flags(libc::O_NOFOLLOW);
            } else {
                options.write(true).create_new(true).mode(0o600);
            }
            let mut file = options.open(&path)?;
            // The payload is the tensors' bytes in header order, as in the chunks: written
            // from the rows' own buffers, a batch of them at a time.
            let parts: Vec<std::io::IoSlice> = batch
                .tensors
                .values()
                .flat_map(|t| &t.parts)
                .filter(|p| !p.is_empty())
                .map(|p| std::io::IoSlice::new(p))
                .collect();
            let size: usize = parts.iter().map(|p| p.len()).sum();
            write_all_vectored(&mut file, parts)?;
            if reused {
                // An earlier, larger batch's tail goes.
                file.set_len(size as u64)?;
            }
            Ok(())
        })();
        if let Err(e) = written {
            let _ = std::fs::remove_file(&path);
            return Err(e);
        }
        Ok(())
    }
}

/// Whether a process with this id runs (perhaps as another user).
fn runs(pid: u32) -> bool {
    let Ok(pid) = libc::pid_t::try_from(pid) else { return false };
    // SAFETY: signal 0 only checks that the process exists.
    let sent = unsafe { libc::kill(pid, 0) };
    sent == 0 || std::io::Error::last_os_error().raw_os_error() == Some(libc::EPERM)
}

/// Writes every byte of `parts` (none of them empty) with as few calls as the kernel allows.
fn write_all_vectored(file: &mut std::fs::File, mut parts: Vec<std::io::IoSlice>) -> std::io::Result<()> {
    let mut slices = parts.as_mut_slice();
    while !slices.is_empty() {
        match file.write_vectored(slices) {
            Ok(0) => return Err(std::io::ErrorKind::WriteZero.into()),
            Ok(n) => std::io::IoSlice::advance_slices(&mut slices, n),
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// One stream's files: those its consumer has not taken yet and those it holds, oldest first;
/// all removed when the stream is dropped.
struct Files {
    shared: Arc<SharedMemory>,
    waiting: VecDeque<String>,
    held: VecDeque<String>,
}

impl Files {
    /// Waits until fewer than `n` files wait: the consumer renames (or removes) each as it
    /// takes it.
    async fn below(&mut self, n: usize) {
        let mut pause = Duration::from_micros(100);
        loop {
            while let Some(oldest) = self.waiting.front() {
                if std::fs::symlink_metadata(self.shared.dir.join(oldest)).is_ok() {
                    break;
                }
                let taken = self.waiting.pop_front().expect("a front");
                self.held.push_back(taken);
            }
            while self.held.len() > HELD_AT_MOST {
                let oldest = self.held.pop_front().expect("more than none");
                self.remove(&oldest);
            }
            if self.waiting.len() < n {
                return;
            }
            tokio::time::sleep(pause).await;
            pause = (pause * 2).min(Duration::from_millis(5));
        }
    }

    /// A file the consumer gave back, renamed to a new name for the next batch (the consumer
    /// knows each name once), or None.
    fn reuse(&mut self) -> Option<String> {
        let name = self.shared.next_name();
        let i = self.held.iter().position(|held| {
            std::fs::rename(self.shared.dir.join(format!("{held}{FREE}")), self.shared.dir.join(&name)).is_ok()
        })?;
        self.held.remove(i);
        Some(name)
    }

    /// `name` under every name it may have.
    fn remove(&self, name: &str) {
        for suffix in ["", HELD, FREE] {
            let _ = std::fs::remove_file(self.shared.dir.join(format!("{name}{suffix}")));
        }
    }
}

impl Drop for Files {
    fn drop(&mut self) {
        for name in self.waiting.iter().chain(&self.held) {
            self.remove(name);
        }
    }
}

/// The chunks of a batch stream for a consumer on the same host: a batch in a file of
/// `shared` and a chunk naming it; a batch that cannot be written there (the directory is
/// full) goes out in chunks of `limit` bytes instead. A header too large for one message fails
/// the stream as it would over gRPC. A resumable stream's `pulled` counts each batch whole as
/// its message goes.
pub fn shared_chunks(
    batches: Batches,
    shared: Arc<SharedMemory>,
    limit: usize,
    pulled: Option<Pulled>,
) -> impl Stream<Item = Result<BatchChunk, Status>> + Send {
    let files = Files { shared, waiting: VecDeque::new(), held: VecDeque::new() };
    stream::unfold((batches, files), move |(mut batches, mut files)| {
        let pulled = pulled.clone();
        async move {
            files.below(WAITING).await;
            let batch = match batches.next().await {
                // A resumable stream holds the batch's place in the budget itself (`Resumed`).
                Some(Ok(Outgoing { batch, unsent: _ })) => batch,
                Some(Err(status)) => return Some((vec![Err(status)], (batches, files))),
                None => {
                    // The consumer still has to take the last files: ending the stream now would
                    // remove them.
                    files.below(1).await;
                    return None;
                }
            };
            // The header goes in one message either way: one too large for it fails here.
            let chunked = match chunk_batch(&batch, limit) {
                Ok(chunked) => chunked,
                Err(e) => return Some((vec![Err(Status::resource_exhausted(e.to_string()))], (batches, files))),
            };
            let (name, reused) = match files.reuse() {
                Some(name) => (name, true),
                None => (files.shared.next_name(), false),
            };
            let shared = files.shared.clone();
            if let Some(pulled) = &pulled {
                pulled.pulled(super::resume::size(&batch));
            }
            // The batch goes with the write: its bytes (and budget share) are the file's now, or
            // the chunks' if the write failed.
            let (name, written) = tokio::task::spawn_blocking(move || {
                let written = shared.write(&batch, &name, reused);
                (name, written)
            })
            .await
            .expect("writing a batch does not panic");
            let chunks = match written {
                Ok(()) => {
                    files.waiting.push_back(name.clone());
                    vec![Ok(BatchChunk {
                        header: chunked.into_header(),
                        pieces: Vec::new(),
                        last: true,
                        shared_file: name,
                        reuse_shared_file: true,
                    })]
                }
                Err(e) => {
                    tracing::warn!(error = %e, "a batch could not go through shared memory; sending it in messages");
                    chunked.map(Ok).collect()
                }
            };
            Some((chunks, (batches, files)))
        }
    })
    .flat_map(stream::iter)
}

#[cfg(test)]
mod tests {
    use bytes::Bytes;
    use stoker_api::{DType, Tensor};

    use super::*;

    fn batch(n: u8) -> Batch<Stacked> {
        let mut tensors = std::collections::BTreeMap::new();
        // Tensor a in two parts, as a stacked batch's rows are.
        let a = Stacked::dense(DType::Uint8, vec![3], vec![Bytes::from(vec![n; 2]), Bytes::from(vec![n])]);
        tensors.insert("a".to_string(), a);
        tensors
            .insert("b".to_string(), Tensor::new(DType::Int32, vec![1], Bytes::from(vec![n + 1; 4])).unwrap().into());
        Batch { tensors, sequence: u64::from(n), ..Batch::default() }
    }

    fn batches(n: u8) -> Batches {
        stream::iter((0..n).map(|i| Ok(batch(i).into()))).boxed()
    }

    #[tokio::test]
    async fn a_batch_is_its_payload_in_a_file_only_its_user_reads() {
        let dir = tempfile::tempdir().unwrap();
        let shared = Arc::new(SharedMemory::open(dir.path()).unwrap());
        let mut chunks = Box::pin(shared_chunks(batches(1), shared.clone(), 1 << 20, None));
        let chunk = chunks.next().await.unwrap().unwrap();
        assert!(chunk.last && chunk.pieces.is_empty());
        assert_eq!(chunk.header.unwrap().sequence, 0);
        let path = dir.path().join(&chunk.shared_file);
        assert_eq!(std::fs::read(&path).unwrap(), [0, 0, 0, 1, 1, 1, 1], "tensor a, then b");
        assert_eq!(std::fs::metadata(&path).unwrap().mode() & 0o777, 0o600);
        // The consumer takes it; the stream ends.
        std::fs::remove_file(&path).unwrap();
        assert!(chunks.next().await.is_none());
    }

    #[tokio::test]
    async fn a_stream_waits_while_two_files_wait_and_removes_what_was_not_taken() {
        let dir = tempfile::tempdir().unwrap();
        let shared = Arc::new(SharedMemory::open(dir.path()).unwrap());
        let mut chunks = Box::pin(shared_chunks(batches(5), shared, 1 << 20, None));
        let first = chunks.next().await.unwrap().unwrap().shared_file;
        let second = chunks.next().await.unwrap().unwrap().shared_file;
        let third = tokio::time::timeout(Duration::from_millis(200), chunks.next()).await;
        assert!(third.is_err(), "no third file while two wait");
        std::fs::remove_file(dir.path().join(&first)).unwrap();
        let third = tokio::time::timeout(Duration::from_secs(10), chunks.next()).await.unwrap().unwrap().unwrap();
        assert_eq!(third.header.unwrap().sequence, 2);
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 2);
        // The consumer went away: the stream is dropped with two files waiting.
        drop(chunks);
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0, "{second} and the third removed");
    }

    /// What a consumer does with a file it took: `.held` while it reads, `.free` after.
    fn take(dir: &Path, name: &str) {
        std::fs::rename(dir.join(name), dir.join(format!("{name}{HELD}"))).unwrap();
    }

    fn give_back(dir: &Path, name: &str) {
        std::fs::rename(dir.join(format!("{name}{HELD}")), dir.join(format!("{name}{FREE}"))).unwrap();
    }

    #[tokio::test]
    async fn a_file_given_back_holds_a_later_batch_and_one_held_is_never_written() {
        let dir = tempfile::tempdir().unwrap();
        let shared = Arc::new(SharedMemory::open(dir.path()).unwrap());
        let mut chunks = Box::pin(shared_chunks(batches(4), shared, 1 << 20, None));
        let first = chunks.next().await.unwrap().unwrap();
        assert!(first.reuse_shared_file);
        let first = first.shared_file;
        let inode = std::fs::metadata(dir.path().join(&first)).unwrap().ino();
        take(dir.path(), &first);
        // Held: the next batch goes to a new file, and the held one keeps batch 0.
        let second = chunks.next().await.unwrap().unwrap().shared_file;
        assert_ne!(std::fs::metadata(dir.path().join(&second)).unwrap().ino(), inode);
        take(dir.path(), &second);
        give_back(dir.path(), &first);
        let third = chunks.next().await.unwrap().unwrap();
        assert_eq!(third.header.unwrap().sequence, 2);
        let path = dir.path().join(&third.shared_file);
        assert_ne!(third.shared_file, first, "a new name: the consumer knows each once");
        assert_eq!(std::fs::metadata(&path).unwrap().ino(), inode, "batch 2 in batch 0's file");
        assert_eq!(std::fs::read(&path).unwrap(), [2, 2, 2, 3, 3, 3, 3]);
        assert_eq!(std::fs::read(dir.path().join(format!("{second}{HELD}"))).unwrap(), [1, 1, 1, 2, 2, 2, 2]);
        // The consumer goes away holding batch 1, batch 2 not taken: every file goes.
        drop(chunks);
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);
    }

    #[tokio::test]
    async fn a_file_given_back_is_cut_to_a_smaller_batch_and_a_link_is_not_followed() {
        let dir = tempfile::tempdir().unwrap();
        let shared = Arc::new(SharedMemory::open(dir.path()).unwrap());
        let big = Batch {
            tensors: [("a".to_string(), Tensor::new(DType::Uint8, vec![64], Bytes::from(vec![9; 64])).unwrap().into())]
                .into(),
            ..Batch::default()
        };
        let batches = stream::iter([Ok(big.into()), Ok(batch(5).into()), Ok(batch(6).into())]).boxed();
        let mut chunks = Box::pin(shared_chunks(batches, shared, 1 << 20, None));
        let first = chunks.next().await.unwrap().unwrap().shared_file;
        take(dir.path(), &first);
        give_back(dir.path(), &first);
        let second = chunks.next().await.unwrap().unwrap().shared_file;
        assert_eq!(std::fs::read(dir.path().join(&second)).unwrap(), [5, 5, 5, 6, 6, 6, 6], "no tail of the 64 bytes");
        // A link where the free file should be is refused: the batch goes in messages.
        take(dir.path(), &second);
        let target = dir.path().join("elsewhere");
        std::fs::write(&target, b"mine").unwrap();
        std::fs::remove_file(dir.path().join(format!("{second}{HELD}"))).unwrap();
        std::os::unix::fs::symlink(&target, dir.path().join(format!("{second}{FREE}"))).unwrap();
        let third = chunks.next().await.unwrap().unwrap();
        assert!(third.shared_file.is_empty() && third.last);
        assert_eq!(std::fs::read(&target).unwrap(), b"mine");
    }

    #[tokio::test]
    async fn a_batch_that_cannot_be_written_goes_in_messages() {
        let dir = tempfile::tempdir().unwrap();
        let shared = Arc::new(SharedMemory::open(dir.path()).unwrap());
        // The directory is gone: every write fails.
        drop(dir);
        let chunks: Vec<_> = shared_chunks(batches(2), shared, 1 << 20, None).collect().await;
        assert_eq!(chunks.len(), 2);
        for chunk in chunks {
            let chunk = chunk.unwrap();
            assert!(chunk.shared_file.is_empty() && chunk.last);
            assert_eq!(chunk.pieces.iter().map(Bytes::len).sum::<usize>(), 7);
        }
    }

    #[test]
    fn only_the_same_directory_and_user_are_served() {
        let (a, b) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
        let shared = SharedMemory::open(a.path()).unwrap();
        let same = SharedMemory::open(a.path()).unwrap().identity;
        assert!(shared.serves(&same));
        assert!(!shared.serves(&SharedMemory::open(b.path()).unwrap().identity), "another directory");
        assert!(!shared.serves(&proto::SharedMemory { uid: same.uid + 1, ..same.clone() }), "another user");
        assert!(!shared.serves(&proto::SharedMemory { boot_id: "another host".into(), ..same }));
    }

    #[test]
    fn files_of_workers_that_are_gone_are_removed_and_no_others() {
        let dir = tempfile::tempdir().unwrap();
        // A process id no process has (above the kernel's pid_max).
        let gone = dir.path().join("stoker-99999999-00-0");
        let alive = dir.path().join(format!("stoker-{}-00-0", std::os::unix::process::parent_id()));
        let other = dir.path().join("something-else");
        for path in [&gone, &alive, &other] {
            std::fs::write(path, b"x").unwrap();
        }
        let shared = SharedMemory::open(dir.path()).unwrap();
        assert!(!gone.exists() && alive.exists() && other.exists());
        let mine = dir.path().join(format!("{}7", shared.prefix));
        std::fs::write(&mine, b"x").unwrap();
        shared.remove_all();
        assert!(!mine.exists() && alive.exists() && other.exists());
    }
}
