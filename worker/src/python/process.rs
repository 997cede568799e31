//! One Python process of the pool: started with the runtime's source, the shared memory file
//! as fd 3 and pipes for the messages; a call waits for the reply while watching the clock
//! and the process's resident memory, and a process that overstays either is killed.
//!
//! The calling thread reads the reply itself (polling the pipe): a reader thread in between
//! was one more wakeup per element, and on a busy machine the scheduler kept that thread
//! waiting 0.9 ms on average (`perf sched latency`) while the element waited for it.

use std::io::{Read, Write};
use std::os::fd::AsRawFd as _;
use std::os::unix::process::CommandExt as _;
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::time::{Duration, Instant};

use super::exchange::{Reply, Shared};
use super::{Failure, PythonOps};

/// The runtime, built into the worker so the two sides always speak the same protocol.
const RUNTIME: &str = include_str!("runtime.py");

/// The shared memory file's first size; it grows with the largest element.
const INITIAL_SHARED: usize = 4 << 20;

/// How often a waiting call looks at the clock and the process's memory.
const WATCH: Duration = Duration::from_millis(20);

/// How long the runtime may take to import the user's modules.
const START_TIMEOUT: Duration = Duration::from_secs(120);

/// Replies describe fields; their data is in the shared memory.
const MAX_REPLY: usize = 16 << 20;

pub struct PythonProcess {
    child: Child,
    requests: ChildStdin,
    replies: Replies,
    shared: Shared,
}

/// The process's stdout, read without blocking: bytes of a reply not yet whole.
struct Replies {
    stdout: ChildStdout,
    pending: Vec<u8>,
}

/// What waiting for a reply gave.
enum Wait {
    Reply(Reply),
    /// Nothing yet within the wait.
    Nothing,
    /// No reply will come: why.
    Gone(String),
}

impl Replies {
    fn new(stdout: ChildStdout) -> std::io::Result<Replies> {
        let fd = stdout.as_raw_fd();
        // SAFETY: fcntl on a file descriptor this process owns.
        let flags = unsafe { libc::fcntl(fd, libc::F_GETFL) };
        // SAFETY: the same descriptor; only its status flags change.
        let set = flags >= 0 && unsafe { libc::fcntl(fd, libc::F_SETFL, flags | libc::O_NONBLOCK) } >= 0;
        if !set {
            return Err(std::io::Error::last_os_error());
        }
        Ok(Replies { stdout, pending: Vec::new() })
    }

    /// The next reply, waiting up to `wait` for its bytes to arrive.
    fn next(&mut self, wait: Duration) -> Wait {
        let deadline = Instant::now() + wait;
        loop {
            match self.whole() {
                Ok(Some(reply)) => return Wait::Reply(reply),
                Ok(None) => {}
                Err(e) => return Wait::Gone(e),
            }
            let mut buffer = [0u8; 8192];
            match self.stdout.read(&mut buffer) {
                Ok(0) => return Wait::Gone("its output ended".into()),
                Ok(n) => {
                    self.pending.extend_from_slice(&buffer[..n]);
                    continue;
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(e) => return Wait::Gone(format!("reading its output failed: {e}")),
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Wait::Nothing;
            }
            let mut poll = libc::pollfd { fd: self.stdout.as_raw_fd(), events: libc::POLLIN, revents: 0 };
            let millis = left.as_millis().clamp(1, i32::MAX as u128) as libc::c_int;
            // SAFETY: one valid pollfd for the duration of the call. Readiness (or hang-up) is
            // read back by the read above.
            unsafe { libc::poll(&mut poll, 1, millis) };
        }
    }

    /// A whole reply from the pending bytes, if they hold one (a 4-byte length, then JSON).
    fn whole(&mut self) -> Result<Option<Reply>, String> {
        let Some(header) = self.pending.first_chunk::<4>() else { return Ok(None) };
        let length = u32::from_le_bytes(*header) as usize;
        if length > MAX_REPLY {
            return Err(format!("a reply of {length} bytes (the runtime's replies are small)"));
        }
        if self.pending.len() < 4 + length {
            return Ok(None);
        }
        let reply =
            serde_json::from_slice(&self.pending[4..4 + length]).map_err(|e| format!("an unreadable reply: {e}"));
        self.pending.drain(..4 + length);
        reply.map(Some)
    }
}

impl PythonProcess {
    /// Starts a process and waits until it has imported every op's module; an import that
    /// fails is the error (with the Python traceback's last lines).
    pub fn start(ops: &PythonOps) -> Result<PythonProcess, String> {
        let shared = Shared::new(INITIAL_SHARED).map_err(|e| format!("creating the shared memory: {e}"))?;
        let mut command = Command::new(&ops.python);
        command.arg("-c").arg(RUNTIME);
        for path in &ops.paths {
            command.arg("--path").arg(path);
        }
        for op in &ops.ops {
            command.arg("--op").arg(format!("{}={}:{}", op.index, op.spec.module, op.spec.function));
        }
        command.stdin(Stdio::piped()).stdout(Stdio::piped()).stderr(Stdio::inherit());
        for (name, value) in malloc_settings(ops) {
            if std::env::var_os(name).is_none() {
                command.env(name, value.to_string());
            }
        }
        let fd = shared.fd();
        // SAFETY: dup2 is async-signal-safe; it gives the child the memory file as fd 3
        // (without close-on-exec, which dup2 clears).
        unsafe {
            command.pre_exec(move || {
                if libc::dup2(fd, 3) < 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        let mut child = stoker_api::children::spawn_tied(command)
            .map_err(|e| format!("starting {} (set STOKER_PYTHON to a Python with numpy): {e}", ops.python))?;
        let requests = child.stdin.take().expect("stdin is piped");
        let stdout = child.stdout.take().expect("stdout is piped");
        let replies = Replies::new(stdout).map_err(|e| format!("reading the process's output: {e}"))?;
        let mut process = PythonProcess { child, requests, replies, shared };
        match process.replies.next(START_TIMEOUT) {
            Wait::Reply(Reply::Ready) => Ok(process),
            Wait::Reply(Reply::Fatal { error }) => Err(error),
            Wait::Reply(other) => Err(format!("the Python runtime said {other:?} before it was ready")),
            Wait::Gone(e) => Err(format!("{} exited before it was ready ({e}); its stderr is in this log", ops.python)),
            Wait::Nothing => {
                process.kill();
                Err(format!("{} did not import the modules within {START_TIMEOUT:?}", ops.python))
            }
        }
    }

    pub fn shared(&mut self) -> &mut Shared {
        &mut self.shared
    }

    /// Sends `request` and waits for the reply, at most `timeout`, while the process stays
    /// under `memory_limit` bytes resident. A [`Failure`] other than an exception leaves the
    /// process killed: the pool drops it.
    pub fn call(
        &mut self,
        request: &impl serde::Serialize,
        timeout: Duration,
        memory_limit: u64,
    ) -> Result<Reply, Failure> {
        let body = serde_json::to_vec(request).expect("a request serializes");
        let frame = [&(body.len() as u32).to_le_bytes()[..], &body].concat();
        if let Err(e) = self.requests.write_all(&frame).and_then(|()| self.requests.flush()) {
            return Err(self.died(format!("writing to it failed: {e}")));
        }
        let deadline = Instant::now() + timeout;
        loop {
            match self.replies.next(WATCH) {
                Wait::Reply(reply) => {
                    if let Reply::Ok { size, .. } = &reply {
                        self.shared
                            .ensure(*size)
                            .map_err(|e| Failure::BadOutput(format!("mapping its output: {e}")))?;
                    }
                    return Ok(reply);
                }
                Wait::Gone(e) => return Err(self.died(e)),
                Wait::Nothing => {}
            }
            if Instant::now() >= deadline {
                self.kill();
                return Err(Failure::Timeout(timeout));
            }
            if let Some(resident) = self.resident_bytes().filter(|r| *r > memory_limit) {
                self.kill();
                return Err(Failure::Memory { resident, limit: memory_limit });
            }
        }
    }

    /// Resident memory from /proc (None once the process is gone).
    fn resident_bytes(&self) -> Option<u64> {
        let statm = std::fs::read_to_string(format!("/proc/{}/statm", self.child.id())).ok()?;
        let pages: u64 = statm.split_whitespace().nth(1)?.parse().ok()?;
        // SAFETY: sysconf has no preconditions.
        let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) }.max(4096) as u64;
        Some(pages * page)
    }

    fn died(&mut self, why: String) -> Failure {
        self.kill();
        let status = self.child.wait().map(|s| s.to_string()).unwrap_or_else(|e| e.to_string());
        Failure::Died(format!("{why}; {status}"))
    }

    fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for PythonProcess {
    fn drop(&mut self) {
        self.kill();
    }
}

/// glibc's tunables for the Python processes, as environment variables (a user's own win):
/// the worker's settings (`crate::alloc`), with the free heap top kept within a quarter of the
/// smallest memory limit so that it cannot get a process replaced. By default glibc mmaps
/// numpy's temporaries of a few hundred KB, unmaps them on free and page-faults them in again
/// on the next call: with `color_jitter` on 224 x 224 images that cost a quarter of the
/// processes' time (docs/performance.md).
fn malloc_settings(ops: &PythonOps) -> [(&'static str, usize); 2] {
    let smallest = ops.ops.iter().map(|op| (op.spec.memory_limit_mib as usize) << 20).min().unwrap_or(usize::MAX);
    [
        ("MALLOC_MMAP_THRESHOLD_", crate::alloc::MMAP_THRESHOLD),
        ("MALLOC_TRIM_THRESHOLD_", (smallest / 4).min(crate::alloc::TRIM_THRESHOLD)),
    ]
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ops(limits: &[u32]) -> PythonOps {
        let transforms: Vec<stoker_api::Transform> = limits
            .iter()
            .map(|mib| {
                let json = format!(r#"{{"python": {{"module": "m", "function": "f", "memoryLimitMib": {mib}}}}}"#);
                serde_json::from_str(&json).unwrap()
            })
            .collect();
        PythonOps::of(&transforms).unwrap()
    }

    #[test]
    fn python_processes_keep_their_heap_within_a_quarter_of_the_smallest_limit() {
        let settings = |limits: &[u32]| malloc_settings(&ops(limits)).map(|(_, v)| v >> 20);
        assert_eq!(settings(&[2048]), [32, 64], "the worker's own settings");
        assert_eq!(settings(&[2048, 64]), [32, 16], "a quarter of 64 MiB: the free heap cannot get it killed");
        assert_eq!(malloc_settings(&ops(&[128]))[0].0, "MALLOC_MMAP_THRESHOLD_");
    }
}
