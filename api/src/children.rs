//! Child processes that die with this one, however it ends: each runs in its own process
//! group (so it can be stopped whole) with `PR_SET_PDEATHSIG(SIGKILL)`. That signal fires when
//! the *thread* that forked the child exits, not the process, and tokio's threads come and go,
//! so every child is forked by one dedicated thread that lives as long as the process; and a
//! child whose parent died before the prctl took effect exits at once (the `getppid` check).
//! `stoker local`'s workers, the e2e harness's processes and a worker's Python processes start
//! here.

use std::os::unix::process::CommandExt as _;
use std::process::{Child, Command};
use std::sync::mpsc;
use std::sync::{Mutex, OnceLock};

type SpawnJob = (Command, mpsc::Sender<std::io::Result<Child>>);

fn spawner() -> &'static Mutex<mpsc::Sender<SpawnJob>> {
    static SPAWNER: OnceLock<Mutex<mpsc::Sender<SpawnJob>>> = OnceLock::new();
    SPAWNER.get_or_init(|| {
        let (tx, rx) = mpsc::channel::<SpawnJob>();
        std::thread::Builder::new()
            .name("stoker-spawner".into())
            .spawn(move || {
                for (mut command, reply) in rx {
                    let _ = reply.send(command.spawn());
                }
            })
            .expect("starting the spawner thread");
        Mutex::new(tx)
    })
}

/// Starts `command` in its own process group, tied to this process's life.
pub fn spawn_tied(mut command: Command) -> std::io::Result<Child> {
    command.process_group(0);
    let parent = std::process::id() as libc::pid_t;
    // SAFETY: only async-signal-safe calls (prctl, getppid, _exit) between fork and exec.
    unsafe {
        command.pre_exec(move || {
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL as libc::c_ulong, 0, 0, 0) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            // The parent may have died before prctl took effect: nobody would signal us.
            if libc::getppid() != parent {
                libc::_exit(1);
            }
            Ok(())
        });
    }
    let (tx, rx) = mpsc::channel();
    spawner().lock().unwrap_or_else(|e| e.into_inner()).send((command, tx)).expect("the spawner thread lives");
    rx.recv().expect("the spawner thread replies")
}
