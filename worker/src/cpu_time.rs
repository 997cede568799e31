//! The process's CPU time: what a sample run or a benchmark cost, across all its threads.

/// This process's user and system CPU time so far, in seconds.
pub fn process_cpu() -> f64 {
    // SAFETY: getrusage writes the zeroed struct it is given.
    let usage = unsafe {
        let mut usage: libc::rusage = std::mem::zeroed();
        libc::getrusage(libc::RUSAGE_SELF, &mut usage);
        usage
    };
    let seconds = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 / 1e6;
    seconds(usage.ru_utime) + seconds(usage.ru_stime)
}
