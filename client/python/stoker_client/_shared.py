"""Batches through shared memory from a worker on the same host (the worker's side is
worker/src/stream/shared.rs): the stream request names this process's shared-memory directory
(host, directory, user); a worker whose own directory that is writes each batch's payload to a
file there and sends its name; the client maps the file read-only (no copy). A worker that
reuses its files (BatchChunk.reuse_shared_file) gets each back once the batch's arrays are
gone: the file is renamed `<name>.held` when mapped and `<name>.free` then; otherwise it is
removed at once, and its memory freed with the arrays."""

import mmap
import os
import weakref
from typing import NamedTuple, Optional

DIRECTORY = "/dev/shm"
# What every worker's file is named from; nothing else is opened.
PREFIX = "stoker-"


class Identity(NamedTuple):
    """StreamRequest.shared_memory: a directory as both sides can compare it."""
    boot_id: str
    device: int
    inode: int
    uid: int


def identity(directory: str = DIRECTORY) -> Optional[Identity]:
    """This process's shared-memory directory, or None where there is none."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot_id = f.read().strip()
        st = os.stat(directory)
    except OSError:
        return None
    return Identity(boot_id, st.st_dev, st.st_ino, os.geteuid())


def take(name: str, size: int, directory: str = DIRECTORY, reuse: bool = False) -> mmap.mmap:
    """The worker's file `name`, mapped read-only; it must hold `size` bytes. Without `reuse`
    the file is removed; with it, renamed `.held`, and `.free` once the mapping is gone (every
    array over it released), when the worker may write a later batch into it."""
    if not name.startswith(PREFIX) or "/" in name or name in (".", ".."):
        raise ValueError(f"{name!r} is not a worker's shared-memory file")
    path = os.path.join(directory, name)
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        # Renamed or removed at once: the worker learns it may write the next batch, and the
        # mapping keeps the memory until the arrays over it are gone.
        if reuse:
            os.rename(path, path + ".held")
        else:
            os.unlink(path)
        have = os.fstat(fd).st_size
        if have < size:
            raise ValueError(f"{name!r} holds {have} bytes, the batch {size}")
        mapped = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ) if size else mmap.mmap(-1, 1)
    except BaseException:
        if reuse:
            _remove(path + ".held")
        raise
    finally:
        os.close(fd)
    if reuse:
        # Runs when the mmap is deallocated, which only the last array over it can let happen.
        weakref.finalize(mapped, _give_back, path, os.getpid()).atexit = False
    return mapped


def _give_back(path: str, taker: int) -> None:
    # A process forked while the batch was held has the mapping too, but only the one that
    # took the file knows when nothing reads it any more.
    if os.getpid() != taker:
        return
    try:
        os.rename(path + ".held", path + ".free")
    except OSError:
        pass  # the worker's stream ended and removed it


def _remove(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass
