//! `stoker local`'s workers die with it, however it dies: killed outright (SIGKILL, no code of
//! it runs) or asked to stop (SIGTERM). Each case starts `stoker local` with two workers, kills
//! it, and waits (polling /proc, with a timeout) until none of its workers is left. Needs the
//! built binaries (`cargo build --workspace --bins`): `stoker` starts `stoker-worker` from its
//! own directory.
//!
//! The last case is the reason for the spawner thread: a worker's parent-death signal fires
//! when the *thread* that forked it exits, so a worker started from a short-lived thread was
//! killed with that thread (and tokio's threads come and go).

use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use stoker_api::WorkerPipeline;
use stoker_local::workers::{LocalWorkerConfig, LocalWorkers, worker_binary};
use stoker_operator::autoscaling::Scaler as _;
use stoker_operator::key::PipelineKey;

/// A process as /proc shows it: its parent, state and start time (which tells it apart from a
/// later process given the same id).
#[derive(Debug, Clone, PartialEq)]
struct Proc {
    pid: u32,
    comm: String,
    state: char,
    ppid: u32,
    start: u64,
}

fn proc_stat(pid: u32) -> Option<Proc> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // `pid (comm) state ppid ...`: comm may hold spaces and parentheses, so split at the last ')'.
    let (head, tail) = stat.rsplit_once(')')?;
    let comm = head.split_once('(')?.1.to_string();
    let fields: Vec<&str> = tail.split_whitespace().collect();
    // After comm: state is field 3 of stat(5), ppid 4, starttime 22.
    Some(Proc {
        pid,
        comm,
        state: fields.first()?.chars().next()?,
        ppid: fields.get(1)?.parse().ok()?,
        start: fields.get(19)?.parse().ok()?,
    })
}

fn all_procs() -> Vec<Proc> {
    let Ok(dir) = std::fs::read_dir("/proc") else { return Vec::new() };
    dir.filter_map(|e| e.ok()?.file_name().to_str()?.parse().ok()).filter_map(proc_stat).collect()
}

/// Still running: present, the same process (start time), and not a zombie waiting for a
/// reaper (a zombie has exited and holds no memory or sockets).
fn alive(p: &Proc) -> bool {
    proc_stat(p.pid).is_some_and(|now| now.start == p.start && now.state != 'Z' && now.state != 'X')
}

/// Polls `check` every 50 ms until it returns Some, or fails the test after `timeout`.
fn wait_for<T>(timeout: Duration, what: &str, mut check: impl FnMut() -> Option<T>) -> T {
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(t) = check() {
            return t;
        }
        assert!(Instant::now() < deadline, "timed out after {timeout:?} waiting for {what}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Kills the process if the test fails before it has.
struct Guard(Child);

impl Drop for Guard {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Starts `stoker local` on a small jsonl pipeline with two workers (mode Fixed) and returns it
/// with its worker processes, once both run.
fn start(dir: &Path) -> (Guard, Vec<Proc>) {
    let data = dir.join("data");
    std::fs::create_dir_all(&data).unwrap();
    for shard in 0..4 {
        let lines: String = (0..50).map(|i| format!("{{\"x\": {}}}\n", shard * 50 + i)).collect();
        std::fs::write(data.join(format!("{shard}.jsonl")), lines).unwrap();
    }
    let manifest = dir.join("pipeline.yaml");
    std::fs::write(
        &manifest,
        format!(
            "apiVersion: stoker.dev/v1alpha1\nkind: DataPipeline\nmetadata: {{name: orphans}}\nspec:\n  \
             source: {{uri: 'file://{}/', format: jsonl}}\n  batchSize: 4\n  \
             workers: {{min: 1, max: 4}}\n  autoscaling: {{mode: Fixed, replicas: 2}}\n",
            data.display()
        ),
    )
    .unwrap();
    let child = Command::new(env!("CARGO_BIN_EXE_stoker"))
        .args(["local", "-f", manifest.to_str().unwrap(), "--listen", "127.0.0.1:0", "--seconds", "600"])
        .env("STOKER_CACHE", dir.join("cache"))
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("starting stoker local (build the binaries first: cargo build --workspace --bins)");
    let parent = child.id();
    let guard = Guard(child);
    let workers = wait_for(Duration::from_secs(30), "stoker local to start two workers", || {
        let workers: Vec<Proc> =
            all_procs().into_iter().filter(|p| p.ppid == parent && p.comm == "stoker-worker").collect();
        (workers.len() == 2).then_some(workers)
    });
    (guard, workers)
}

/// Kills `stoker local` with `signal` and waits until none of its workers is alive.
fn workers_die_with_parent(signal: i32) {
    let dir = tempfile::tempdir().unwrap();
    let (mut parent, workers) = start(dir.path());
    // SAFETY: kill(2) on the child this test started and has not reaped.
    assert_eq!(unsafe { libc::kill(parent.0.id() as i32, signal) }, 0);
    let status = wait_for(Duration::from_secs(30), "stoker local to exit", || parent.0.try_wait().unwrap());
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let left: Vec<&Proc> = workers.iter().filter(|w| alive(w)).collect();
        if left.is_empty() {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "workers still running 20 s after signal {signal} to their parent: {left:?}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    // After SIGTERM the parent stopped its workers itself and exited cleanly.
    if signal == libc::SIGTERM {
        assert!(status.success(), "stoker local exited with {status}");
    }
}

#[test]
fn workers_die_when_stoker_local_is_killed() {
    workers_die_with_parent(libc::SIGKILL);
}

#[test]
fn workers_stop_when_stoker_local_is_terminated() {
    workers_die_with_parent(libc::SIGTERM);
}

#[test]
fn a_worker_outlives_the_thread_that_started_it_but_not_its_owner() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("0.jsonl"), "{\"x\": 1}\n").unwrap();
    let spec = stoker_api::from_yaml(&format!(
        "source: {{uri: 'file://{}/', format: jsonl}}\nbatchSize: 1\n",
        dir.path().display()
    ))
    .unwrap();
    let workers = Arc::new(LocalWorkers::new(LocalWorkerConfig {
        binary: worker_binary(),
        // Nothing listens there: the worker keeps trying to register, so it stays up.
        dispatcher_url: "http://127.0.0.1:1".into(),
        threads: 1,
        memory_budget: 16 << 20,
        max_batch_rate: None,
        log_dir: Some(dir.path().to_path_buf()),
        cache_dir: None,
        tls: None,
    }));
    workers.add(WorkerPipeline::new("ns", "thread", &spec), None, None);
    let key = PipelineKey::new("ns", "thread");
    let scaling = workers.clone();
    let scaled_key = key.clone();
    std::thread::spawn(move || {
        let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        runtime.block_on(scaling.scale(&scaled_key, 1)).unwrap();
    })
    .join()
    .unwrap();
    let pid = workers.pids(&key)[0];
    let worker = proc_stat(pid).expect("the worker started");
    // A signal tied to the exited thread arrives at once; watch the worker for a second.
    let until = Instant::now() + Duration::from_secs(1);
    while Instant::now() < until {
        assert!(alive(&worker), "the worker died with the thread that started it: {:?}", proc_stat(pid));
        std::thread::sleep(Duration::from_millis(50));
    }
    drop(workers);
    assert!(!alive(&worker), "dropping the workers kills and reaps them: {:?}", proc_stat(pid));
}
