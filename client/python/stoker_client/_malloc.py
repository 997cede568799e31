"""glibc's malloc thresholds for the process that reads batches, set once by the first Client.

By default glibc mmaps every allocation from 128 KiB (a threshold it raises as such blocks are
freed) and gives free memory at the top of a heap back to the OS once it exceeds twice that.
A consumer allocates and frees a batch's worth of message buffers (grpc's, then the Python
bytes) for every batch, so the memory went back to the OS and was page-faulted and zeroed in
again each time: 8160 page faults for every 32 MiB allocated and freed in 4 MiB blocks, and
2.76-2.99 GB/s instead of 3.65-3.87 GB/s into one consumer (docs/performance.md). The worker
sets the same thresholds for itself and its Python processes.

A user's own `MALLOC_MMAP_THRESHOLD_` or `MALLOC_TRIM_THRESHOLD_` (read by glibc at start) wins,
and `STOKER_TUNE_MALLOC=0` leaves malloc as it is. Elsewhere than glibc nothing is done."""

import ctypes
import os
import platform
import threading

# Allocations from this size are mmapped (glibc's largest allowed threshold).
MMAP_THRESHOLD = 32 << 20
# Free memory at the top of a heap beyond this goes back to the OS.
TRIM_THRESHOLD = 64 << 20

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
_lock = threading.Lock()
_decided = None


def wanted() -> bool:
    """Whether this process's malloc should be tuned."""
    if os.environ.get("STOKER_TUNE_MALLOC", "1") == "0":
        return False
    if "MALLOC_MMAP_THRESHOLD_" in os.environ or "MALLOC_TRIM_THRESHOLD_" in os.environ:
        return False
    return platform.libc_ver()[0] == "glibc"


def tune() -> bool:
    """Sets the thresholds, the first time it is called in a process where `wanted()`;
    returns whether they are set."""
    global _decided
    with _lock:
        if _decided is None:
            _decided = False
            if wanted():
                libc = ctypes.CDLL(None)
                _decided = (
                    libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1
                    and libc.mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1
                )
        return _decided
