"""Batches through shared memory from a worker on the same host (the worker's side is
worker/src/stream/shared.rs): the stream request names this process's shared-memory directory
(host, directory, user); a worker whose own directory that is writes each batch's payload to a
file there and sends its name; the client maps the file read-only (no copy) and removes it, so
its memory is freed once the batch's arrays are gone."""

import mmap
import os
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


def take(name: str, size: int, directory: str = DIRECTORY) -> mmap.mmap:
    """The worker's file `name`, mapped read-only and removed; it must hold `size` bytes."""
    if not name.startswith(PREFIX) or "/" in name or name in (".", ".."):
        raise ValueError(f"{name!r} is not a worker's shared-memory file")
    path = os.path.join(directory, name)
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        # Removed at once: the mapping keeps the memory until the arrays over it are gone, and
        # the worker learns it may write the next batch.
        os.unlink(path)
        have = os.fstat(fd).st_size
        if have < size:
            raise ValueError(f"{name!r} holds {have} bytes, the batch {size}")
        if size == 0:
            return mmap.mmap(-1, 1)
        return mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
    finally:
        os.close(fd)
