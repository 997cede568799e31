//! The worker's malloc settings: glibc's allocator, never mmapping (so batches too come from
//! the heap and their memory is reused for the next ones), with fixed thresholds, and
//! returning free memory beyond 64 MiB at the top of a heap to the OS.
//!
//! By default glibc mmaps anything from 128 KiB (a threshold it raises as such buffers are
//! freed, up to 32 MiB) and returns free heap tops beyond twice that, so the worker's
//! few-hundred-KB image buffers, and always its tens-of-MB batches, went back to the OS and
//! were page-faulted (and zeroed) in again: about a tenth of the worker's CPU time in
//! `stoker-worker bench preprocess`. mimalloc, used before, avoided that but kept freed
//! memory: under a slow client a worker with a 256 MiB budget grew past 3 GB (`stoker-worker
//! bench memory`). With these settings the worker is faster than with either and stays within
//! its budget plus 200 MB (docs/performance.md).

/// Free memory at the top of a heap beyond this goes back to the OS.
pub const TRIM_THRESHOLD: usize = 64 << 20;

/// Allocations from this size are mmapped; in the worker, never (`M_MMAP_MAX` 0).
pub const MMAP_THRESHOLD: usize = 32 << 20;

/// Applies the settings to every allocation after it; call at startup.
pub fn tune() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        unsafe extern "C" {
            fn mallopt(param: i32, value: i32) -> i32;
        }
        const M_TRIM_THRESHOLD: i32 = -1;
        const M_MMAP_THRESHOLD: i32 = -3;
        const M_MMAP_MAX: i32 = -4;
        // SAFETY: mallopt only changes glibc's tunables. A fixed threshold also turns off
        // glibc's dynamic adjustment; no mmapped chunks means large requests grow the heap
        // (the main one, for sizes a thread's 64 MiB heap cannot hold).
        unsafe {
            mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD as i32);
            mallopt(M_MMAP_MAX, 0);
            mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD as i32);
        }
    }
}
