//! `cargo run -p stoker-e2e --bin local-cluster [-- --dir DIR]`
//!
//! Starts the e2e suite's local control plane (etcd, kube-apiserver, kube-controller-manager on
//! loopback; no kubelet), prints `export KUBECONFIG=...`, and keeps it up until Ctrl-C or
//! SIGTERM. With `--dir`, everything lives in DIR (kept afterwards; wiped at start), so the
//! kubeconfig path stays the same across restarts.

use std::path::PathBuf;
use std::time::Duration;

use stoker_e2e::local::{LocalControlPlane, LocalOptions};
use tokio::signal::unix::{SignalKind, signal};

fn usage() -> ! {
    eprintln!("usage: local-cluster [--dir DIR]");
    std::process::exit(2);
}

fn main() {
    stoker_e2e::cluster::install_tls_provider();
    let runtime = tokio::runtime::Runtime::new().expect("building the tokio runtime");
    if let Err(e) = runtime.block_on(run()) {
        eprintln!("local-cluster: {e:#}");
        drop(runtime);
        std::process::exit(1);
    }
}

async fn run() -> anyhow::Result<()> {
    let mut opts = LocalOptions::default();
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        match arg.as_str() {
            "--dir" => {
                let dir = PathBuf::from(args.next().unwrap_or_else(|| usage()));
                if dir.exists() {
                    std::fs::remove_dir_all(&dir)?;
                }
                opts.dir = Some(dir);
            }
            "-h" | "--help" => usage(),
            _ => usage(),
        }
    }
    let mut term = signal(SignalKind::terminate())?;
    let mut int = signal(SignalKind::interrupt())?;

    eprintln!("starting etcd, kube-apiserver and kube-controller-manager ...");
    let cluster = tokio::select! {
        c = LocalControlPlane::start_with(opts) => c?,
        _ = term.recv() => return Ok(()),
        _ = int.recv() => return Ok(()),
    };
    let kubeconfig = stoker_e2e::Cluster::kubeconfig(&cluster).display().to_string();
    eprintln!("control plane up at {} (files and logs in {})", cluster.server(), cluster.dir().display());
    eprintln!("no kubelet: pods stay Pending. Ctrl-C or SIGTERM stops everything.");
    println!("export KUBECONFIG={kubeconfig}");

    let result = loop {
        tokio::select! {
            _ = term.recv() => break Ok(()),
            _ = int.recv() => break Ok(()),
            _ = tokio::time::sleep(Duration::from_secs(1)) => {
                if let Err(e) = cluster.check_alive() {
                    break Err(e);
                }
            }
        }
    };
    eprintln!("stopping the control plane ...");
    stoker_e2e::Cluster::shutdown(&cluster).await;
    drop(cluster);
    result
}
