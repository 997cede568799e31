//! Long-running child processes (etcd, kube-apiserver, the operator, ...) that never outlive the
//! harness.
//!
//! Each child runs in its own process group with its output in a log file. Teardown is by
//! process id: SIGTERM to the group, SIGKILL after a grace period; [`ManagedProcess`] does it on
//! drop, so a panicking test still cleans up. Children start through
//! `stoker_api::children` (`PR_SET_PDEATHSIG(SIGKILL)`), so even a harness killed with SIGKILL
//! leaves nothing running.

use std::fs::File;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use anyhow::Context as _;

/// How long a process gets between SIGTERM and SIGKILL.
pub const DEFAULT_GRACE: Duration = Duration::from_secs(10);

/// A child process in its own process group, logging to a file, terminated on drop.
pub struct ManagedProcess {
    name: String,
    child: Child,
    log: PathBuf,
    exited: Option<ExitStatus>,
    reaped: bool,
    grace: Duration,
}

impl ManagedProcess {
    /// Starts `program args` with `envs` added to the environment; stdout and stderr go to `log`
    /// (appended, so a restarted process keeps its predecessor's lines).
    pub fn spawn(
        name: impl Into<String>,
        program: &Path,
        args: &[String],
        envs: &[(String, String)],
        log: &Path,
    ) -> anyhow::Result<Self> {
        let name = name.into();
        let file = File::options()
            .create(true)
            .append(true)
            .open(log)
            .with_context(|| format!("opening the log file {}", log.display()))?;
        let mut cmd = Command::new(program);
        cmd.args(args)
            .envs(envs.iter().map(|(k, v)| (k, v)))
            .stdin(Stdio::null())
            .stdout(file.try_clone()?)
            .stderr(file);
        let child = stoker_api::children::spawn_tied(cmd)
            .with_context(|| format!("starting {name} ({})", program.display()))?;
        Ok(ManagedProcess { name, child, log: log.to_path_buf(), exited: None, reaped: false, grace: DEFAULT_GRACE })
    }

    pub fn with_grace(mut self, grace: Duration) -> Self {
        self.grace = grace;
        self
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    pub fn log_path(&self) -> &Path {
        &self.log
    }

    /// The exit status once the process has exited; `None` while it runs. The process is not
    /// reaped here (only on teardown), so its id and group id cannot be reused meanwhile and
    /// signalling the group stays safe.
    pub fn exit_status(&mut self) -> Option<ExitStatus> {
        use std::os::unix::process::ExitStatusExt as _;
        if self.exited.is_some() {
            return self.exited;
        }
        // SAFETY: waitid on our own child with WNOWAIT only observes; zeroed siginfo is valid.
        unsafe {
            let mut info: libc::siginfo_t = std::mem::zeroed();
            let rc =
                libc::waitid(libc::P_PID, self.child.id(), &mut info, libc::WEXITED | libc::WNOHANG | libc::WNOWAIT);
            if rc != 0 || info.si_pid() == 0 {
                return None;
            }
            let status = info.si_status();
            self.exited = Some(match info.si_code {
                libc::CLD_EXITED => ExitStatus::from_raw((status & 0xff) << 8),
                _ => ExitStatus::from_raw(status & 0x7f),
            });
        }
        self.exited
    }

    pub fn is_running(&mut self) -> bool {
        self.exit_status().is_none()
    }

    /// The last `lines` lines of the log.
    pub fn log_tail(&self, lines: usize) -> String {
        crate::tools::tail(&self.log, lines)
    }

    /// An error if the process has exited, with its status and the tail of its log.
    pub fn check_running(&mut self) -> anyhow::Result<()> {
        match self.exit_status() {
            None => Ok(()),
            Some(status) => anyhow::bail!(
                "{} exited ({status}); last lines of {}:\n{}",
                self.name,
                self.log.display(),
                self.log_tail(40)
            ),
        }
    }

    fn signal_group(&self, signal: libc::c_int) {
        let pgid = self.child.id() as libc::pid_t;
        // SAFETY: plain syscall; the group id is our child's pid (process_group(0)).
        unsafe {
            libc::kill(-pgid, signal);
        }
    }

    /// Sends SIGKILL to the process group at once and reaps the process.
    pub fn kill(&mut self) {
        if !self.reaped {
            self.signal_group(libc::SIGKILL);
            self.reap();
        }
    }

    fn reap(&mut self) {
        if let Ok(status) = self.child.wait() {
            self.exited = Some(status);
        }
        self.reaped = true;
    }

    /// SIGTERM to the group, then SIGKILL after the grace period; blocks until reaped.
    pub fn terminate(&mut self) {
        if self.reaped {
            return;
        }
        if self.exit_status().is_none() {
            self.signal_group(libc::SIGTERM);
            let deadline = Instant::now() + self.grace;
            while self.exit_status().is_none() && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(50));
            }
        }
        // Also ends anything the process left behind in its group.
        self.kill();
    }

    /// Like [`terminate`](Self::terminate), without blocking the async runtime.
    pub async fn terminate_async(&mut self) {
        if self.reaped {
            return;
        }
        if self.exit_status().is_none() {
            self.signal_group(libc::SIGTERM);
            let deadline = Instant::now() + self.grace;
            while self.exit_status().is_none() && Instant::now() < deadline {
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
        self.kill();
    }
}

impl Drop for ManagedProcess {
    fn drop(&mut self) {
        self.terminate();
    }
}
