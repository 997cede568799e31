//! Connection faults for the real-process tests: every established TCP connection to a
//! pipeline's workers reset (`ss -K`, as a proxy, a conntrack flush or a flaky link does) at a
//! steady pace, and every third time those to the dispatcher too. Needs root.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use stoker_operator::dispatcher::{Dispatcher, JobSummary};
use stoker_operator::key::PipelineKey;

/// How often [`resetting`] resets the connections.
pub const EVERY: Duration = Duration::from_millis(1500);

/// The port of an address such as `127.0.0.1:4000` or `http://127.0.0.1:4000`.
pub fn port(address: &str) -> u16 {
    let address = address.split('#').next().unwrap();
    address.rsplit(':').next().unwrap().trim_end_matches('/').parse().unwrap()
}

/// Resets every established TCP connection from or to one of `ports` (both ends' sockets:
/// each side sees the connection broken, as after a reset on the way); how many it closed.
pub fn reset(ports: &[u16]) -> usize {
    let filter = ports.iter().map(|p| format!("sport = :{p} or dport = :{p}")).collect::<Vec<_>>().join(" or ");
    let out = std::process::Command::new("ss")
        .args(["-K", "-t", "-n", "state", "established"])
        .arg(format!("( {filter} )"))
        .output()
        .expect("running ss (iproute2)");
    assert!(out.status.success(), "ss -K: {}", String::from_utf8_lossy(&out.stderr));
    // A header line, then one line per socket closed.
    String::from_utf8_lossy(&out.stdout).lines().skip(1).filter(|l| !l.trim().is_empty()).count()
}

/// The ports of the pipeline's two workers, once both have registered.
pub async fn worker_ports(dispatcher: &Dispatcher, key: &PipelineKey) -> Vec<u16> {
    tokio::time::timeout(Duration::from_secs(30), async {
        loop {
            let addresses = dispatcher.with_state(|st| st.worker_addresses(key));
            if addresses.len() == 2 {
                return addresses.iter().map(|a| port(a)).collect();
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await
    .expect("two workers registered within 30 s")
}

/// Resets connections every [`EVERY`] until `stop`: those to the workers each time, those to
/// the dispatcher every third time. Returns the sockets closed.
pub fn resetting(workers: Vec<u16>, dispatcher: u16, stop: Arc<AtomicBool>) -> std::thread::JoinHandle<usize> {
    std::thread::spawn(move || {
        let (mut closed, mut round) = (0, 0);
        while !stop.load(Ordering::Relaxed) {
            std::thread::sleep(EVERY);
            round += 1;
            let mut ports = workers.clone();
            if round % 3 == 0 {
                ports.push(dispatcher);
            }
            closed += reset(&ports);
        }
        closed
    })
}

/// No split was completed twice, though acknowledgements whose answers the resets lost were
/// sent again.
pub fn no_repeats(jobs: &[JobSummary]) {
    for job in jobs {
        assert_eq!(job.repeats, 0, "{job:?}");
    }
}
