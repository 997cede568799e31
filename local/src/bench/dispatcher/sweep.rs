//! `--sweep`: the same load at sizes from 10 to 2000 workers and consumers and 1 to 200
//! pipelines, a markdown row as each ends. Each size runs in a process of its own (this
//! program again, with `--row`): in one process a run's closed connections and freed heap
//! lingered into the next one's figures.

use std::io::Write;
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::Context as _;

use super::{Load, report, usage};

/// Other processes may use this much of a core before a size is run: the run needs both.
const QUIET: f64 = 0.1;
/// How long to wait for that before running anyway (the row's last column tells).
const QUIET_PATIENCE: Duration = Duration::from_secs(600);

/// (workers, consumers, pipelines): each size alone in one pipeline, then spread over many,
/// and workers and consumers apart.
pub const POINTS: &[(usize, usize, usize)] = &[
    (10, 10, 1),
    (100, 100, 1),
    (100, 100, 10),
    (500, 500, 1),
    (500, 500, 50),
    (1000, 1000, 1),
    (1000, 1000, 10),
    (1000, 1000, 100),
    (2000, 10, 1),
    (10, 2000, 1),
    (2000, 2000, 1),
    (2000, 2000, 200),
];

/// The arguments of `stoker bench dispatcher` that run `load` and print its row.
pub fn row_args(load: &Load) -> Vec<String> {
    let mut args: Vec<String> = ["bench", "dispatcher", "--row"].map(String::from).into();
    for (flag, value) in [
        ("--workers", load.workers as u64),
        ("--consumers", load.consumers as u64),
        ("--pipelines", load.pipelines as u64),
        ("--seconds", load.duration.as_secs()),
        ("--split-ms", load.split_time.as_millis() as u64),
        ("--splits", load.splits),
    ] {
        args.extend([flag.to_string(), value.to_string()]);
    }
    if load.leader_change {
        args.push("--leader-change".into());
    }
    args
}

/// Runs `base` at every point, each in a process of its own, writing the table to `out` as it
/// goes.
pub fn sweep(base: &Load, out: &mut impl Write) -> anyhow::Result<()> {
    let program = std::env::current_exe().context("finding this program to run each size")?;
    writeln!(out, "{}", report::TABLE_HEADER)?;
    for &(workers, consumers, pipelines) in POINTS {
        let load = Load { workers, consumers, pipelines, ..base.clone() };
        wait_for_quiet()?;
        let ran = Command::new(&program)
            .args(row_args(&load))
            .output()
            .with_context(|| format!("running {}", program.display()))?;
        anyhow::ensure!(
            ran.status.success(),
            "{workers} workers, {consumers} consumers, {pipelines} pipelines: {}",
            String::from_utf8_lossy(&ran.stderr)
        );
        out.write_all(&ran.stdout)?;
        out.flush()?;
    }
    Ok(())
}

/// Waits until the machine's other processes have used less than `QUIET` of a core over a
/// second (this process idles meanwhile), or `QUIET_PATIENCE` passed.
fn wait_for_quiet() -> anyhow::Result<()> {
    let deadline = Instant::now() + QUIET_PATIENCE;
    loop {
        let before = usage::machine_busy()?.saturating_sub(usage::process_cpu()?);
        std::thread::sleep(Duration::from_secs(1));
        let busy = usage::machine_busy()?.saturating_sub(usage::process_cpu()?).saturating_sub(before);
        if busy.as_secs_f64() < QUIET || Instant::now() >= deadline {
            if busy.as_secs_f64() >= QUIET {
                tracing::warn!(cores = busy.as_secs_f64(), "the machine is not quiet; running anyway");
            }
            return Ok(());
        }
    }
}
