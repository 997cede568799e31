//! What the dispatcher's thread costs: its CPU time (the kernel's per-thread run time), its
//! heap (allocations made and freed on that thread, counted by `Counting` when the binary
//! installs it), the process's resident memory, and pinning a thread to one core.

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use anyhow::Context as _;

/// The calling thread's id, as /proc/self/task names it.
pub fn thread_id() -> i32 {
    // SAFETY: gettid has no preconditions.
    unsafe { libc::gettid() }
}

/// Time thread `tid` of this process has spent on a CPU: the first field of its schedstat, in
/// nanoseconds (the scheduler's own accounting, finer than utime's clock ticks).
pub fn thread_cpu(tid: i32) -> anyhow::Result<Duration> {
    let path = format!("/proc/self/task/{tid}/schedstat");
    let text = std::fs::read_to_string(&path).with_context(|| format!("reading {path}"))?;
    let ns: u64 = text
        .split_whitespace()
        .next()
        .and_then(|f| f.parse().ok())
        .with_context(|| format!("{path} does not start with a number: {text:?}"))?;
    Ok(Duration::from_nanos(ns))
}

/// Clock ticks a second in /proc's counters (USER_HZ).
fn ticks() -> f64 {
    // SAFETY: sysconf has no preconditions.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    if hz > 0 { hz as f64 } else { 100.0 }
}

/// CPU time every process of the machine has used (all CPUs' non-idle time in /proc/stat).
pub fn machine_busy() -> anyhow::Result<Duration> {
    let stat = std::fs::read_to_string("/proc/stat").context("reading /proc/stat")?;
    let line = stat.lines().next().context("an empty /proc/stat")?;
    let fields: Vec<u64> = line.split_whitespace().skip(1).filter_map(|f| f.parse().ok()).collect();
    anyhow::ensure!(fields.len() >= 8, "/proc/stat's cpu line is short: {line:?}");
    // user nice system idle iowait irq softirq steal: all but idle and iowait.
    let busy: u64 = fields[..8].iter().enumerate().filter(|(i, _)| *i != 3 && *i != 4).map(|(_, v)| v).sum();
    Ok(Duration::from_secs_f64(busy as f64 / ticks()))
}

/// CPU time this process has used (user and system, every thread).
pub fn process_cpu() -> anyhow::Result<Duration> {
    let stat = std::fs::read_to_string("/proc/self/stat").context("reading /proc/self/stat")?;
    // The fields after the command's closing parenthesis; utime and stime are the 12th and 13th.
    let after = stat.rsplit_once(')').context("no command in /proc/self/stat")?.1;
    let fields: Vec<&str> = after.split_whitespace().collect();
    let tick = |i: usize| fields.get(i).and_then(|f| f.parse::<u64>().ok()).context("a short /proc/self/stat");
    Ok(Duration::from_secs_f64((tick(11)? + tick(12)?) as f64 / ticks()))
}

/// The process's resident memory (VmRSS), in bytes.
pub fn rss_bytes() -> anyhow::Result<u64> {
    let status = std::fs::read_to_string("/proc/self/status").context("reading /proc/self/status")?;
    let kb: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .context("no VmRSS in /proc/self/status")?;
    Ok(kb * 1024)
}

/// Confines the calling thread to `cpu`; false (and a log line) when the machine refuses, e.g.
/// a CPU this process may not use.
pub fn pin(cpu: usize) -> bool {
    // SAFETY: the set is zeroed, then filled by the libc macro; 0 means the calling thread.
    let done = unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_SET(cpu, &mut set);
        libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set) == 0
    };
    if !done {
        tracing::warn!(cpu, error = %std::io::Error::last_os_error(), "could not pin a thread to its core");
    }
    done
}

/// CPUs this process may run on.
pub fn cpus() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

thread_local! {
    /// Whether this thread's allocations are counted (the dispatcher's thread).
    static COUNTED: Cell<bool> = const { Cell::new(false) };
}

static ALLOCATIONS: AtomicU64 = AtomicU64::new(0);
static ALLOCATED: AtomicU64 = AtomicU64::new(0);
static FREED: AtomicU64 = AtomicU64::new(0);

/// Counts the allocations of the thread that asked (`count_this_thread`): how many, and the
/// bytes allocated and freed there. Only the dispatcher's thread asks, and what it allocates
/// it frees itself (requests are decoded and answers encoded on it), so allocated less freed is
/// the dispatcher's heap. Install with `#[global_allocator]`; without it every count is 0.
///
/// One thread at a time counts (a restarted dispatcher's thread starts after the old one
/// ended), so the counters are bumped with a plain load and store: a locked add on every
/// allocation cost the dispatcher a few percent of its time.
pub struct Counting;

fn add(counter: &AtomicU64, n: u64) {
    counter.store(counter.load(Ordering::Relaxed) + n, Ordering::Relaxed);
}

fn counted() -> bool {
    // A thread being torn down has no thread-locals left: not counted.
    COUNTED.try_with(Cell::get).unwrap_or(false)
}

// SAFETY: every call forwards to the system allocator with the caller's layout and pointer;
// the counters are only bookkeeping.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // SAFETY: the caller's layout, as GlobalAlloc::alloc requires it.
        let p = unsafe { System.alloc(layout) };
        if !p.is_null() && counted() {
            add(&ALLOCATIONS, 1);
            add(&ALLOCATED, layout.size() as u64);
        }
        p
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        // SAFETY: the caller's layout, as GlobalAlloc::alloc_zeroed requires it.
        let p = unsafe { System.alloc_zeroed(layout) };
        if !p.is_null() && counted() {
            add(&ALLOCATIONS, 1);
            add(&ALLOCATED, layout.size() as u64);
        }
        p
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: a pointer this allocator (the system's) gave for this layout.
        unsafe { System.dealloc(ptr, layout) };
        if counted() {
            add(&FREED, layout.size() as u64);
        }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        // SAFETY: a pointer this allocator (the system's) gave for this layout.
        let p = unsafe { System.realloc(ptr, layout, new_size) };
        if !p.is_null() && counted() {
            add(&ALLOCATIONS, 1);
            add(&ALLOCATED, new_size as u64);
            add(&FREED, layout.size() as u64);
        }
        p
    }
}

/// Counts the calling thread's allocations from now on.
pub fn count_this_thread() {
    COUNTED.with(|c| c.set(true));
}

/// The counted threads' allocations so far.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Heap {
    pub allocations: u64,
    pub allocated: u64,
    pub freed: u64,
}

impl Heap {
    pub fn now() -> Heap {
        Heap {
            allocations: ALLOCATIONS.load(Ordering::Relaxed),
            allocated: ALLOCATED.load(Ordering::Relaxed),
            freed: FREED.load(Ordering::Relaxed),
        }
    }

    /// Bytes held: allocated less freed (signed: a stretch may free what an earlier one held).
    pub fn held(&self) -> i64 {
        self.allocated as i64 - self.freed as i64
    }

    /// What happened between `earlier` and this.
    pub fn since(&self, earlier: &Heap) -> Heap {
        Heap {
            allocations: self.allocations - earlier.allocations,
            allocated: self.allocated - earlier.allocated,
            freed: self.freed - earlier.freed,
        }
    }
}
