//! Exactly once through connection faults, with real processes: two `stoker-worker`s under a
//! dispatcher, 4000-record JSONL epochs, read three epochs at a time while every 1.5 s every
//! TCP connection to the workers is reset (`ss -K`, as a proxy, a conntrack flush or a flaky
//! link does), and every third time those to the dispatcher too. Every process stays up.
//! Every epoch reaches the job exactly once, no error reaches the training loop, ranks keep
//! equal counts, and the run takes at most 1.5x one without faults. (Before, a reset lost the
//! batches on their way in the connection: an epoch came 120-160 rows short, silently.)

mod support;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use stoker_operator::autoscaling::Scaler;

const FILES: i64 = 4;
const LINES: i64 = 1000;
const EPOCHS: u64 = 3;
const EVERY: Duration = Duration::from_millis(1500);

/// The port of an address such as `127.0.0.1:4000` or `http://127.0.0.1:4000`.
fn port(address: &str) -> u16 {
    let address = address.split('#').next().unwrap();
    address.rsplit(':').next().unwrap().trim_end_matches('/').parse().unwrap()
}

/// Resets every established TCP connection from or to one of `ports` (both ends' sockets:
/// each side sees the connection broken, as after a reset on the way); how many it closed.
fn reset(ports: &[u16]) -> usize {
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

/// Resets connections every [`EVERY`] until `stop`: those to the workers each time, those to
/// the dispatcher every third time. Returns the sockets closed.
fn resetting(s: &support::Dispatched, stop: Arc<AtomicBool>) -> std::thread::JoinHandle<usize> {
    let dispatcher = s.dispatcher.clone();
    let (key, dispatcher_port) = (s.key.clone(), port(&s.url));
    std::thread::spawn(move || {
        let (mut closed, mut round) = (0, 0);
        while !stop.load(Ordering::Relaxed) {
            std::thread::sleep(EVERY);
            round += 1;
            let mut ports: Vec<u16> =
                dispatcher.with_state(|st| st.worker_addresses(&key)).iter().map(|a| port(a)).collect();
            if round % 3 == 0 {
                ports.push(dispatcher_port);
            }
            closed += reset(&ports);
        }
        closed
    })
}

/// Reads [`EPOCHS`] epochs with `ranks` consumers (0: one client, the job shared) while the
/// connections are reset or not; what each consumer got, the time, and the sockets closed.
async fn read(ranks: u32, faults: bool) -> (Vec<Vec<support::Got>>, Duration, usize) {
    let data = tempfile::tempdir().unwrap();
    // 40 batches a second per worker and job: an epoch lasts about 5 s, several resets.
    let s =
        support::dispatched(support::padded_records(data.path(), FILES, LINES), Duration::from_secs(10), Some(40.0))
            .await;
    s.workers.scale(&s.key, 2).await.unwrap();
    let stop = Arc::new(AtomicBool::new(false));
    let resetter = faults.then(|| resetting(&s, stop.clone()));
    let started = Instant::now();
    let consumers: Vec<_> = (0..ranks.max(1))
        .map(|r| {
            let options = support::rank("resets", ranks, r);
            tokio::spawn(support::consume(s.url.clone(), options, EPOCHS, LINES, Arc::new(AtomicUsize::new(0))))
        })
        .collect();
    let mut got = Vec::new();
    for consumer in consumers {
        got.push(consumer.await.expect("a consumer failed"));
    }
    let took = started.elapsed();
    stop.store(true, Ordering::Relaxed);
    eprintln!("the dispatcher's view: {:?}", s.dispatcher.with_state(|st| st.jobs(&s.key)));
    let closed = resetter.map(|r| r.join().unwrap()).unwrap_or(0);
    (got, took, closed)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_reset_every_second_and_a_half_lose_and_repeat_nothing() {
    let (_, calm, _) = read(0, false).await;
    let (got, took, closed) = read(0, true).await;
    eprintln!(
        "three epochs: {:.1} s without faults, {:.1} s with {closed} sockets reset ({:.2}x)",
        calm.as_secs_f64(),
        took.as_secs_f64(),
        took.as_secs_f64() / calm.as_secs_f64()
    );
    assert!(closed >= 6, "the resets closed {closed} sockets: the faults did not happen");
    assert!(took.as_secs_f64() <= 1.5 * calm.as_secs_f64(), "{took:?} with faults, {calm:?} without");
    let all = (FILES * LINES) as usize;
    for (epoch, seen) in support::counts(&[&got[0]]).iter().enumerate() {
        let repeats: u32 = seen.values().map(|n| n - 1).sum();
        assert_eq!((seen.len(), repeats), (all, 0), "epoch {epoch}: every record, none twice");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ranks_keep_equal_counts_and_every_record_once_through_resets() {
    let (got, took, closed) = read(2, true).await;
    eprintln!("two ranks, three epochs: {:.1} s with {closed} sockets reset", took.as_secs_f64());
    assert!(closed >= 6, "the resets closed {closed} sockets: the faults did not happen");
    let all = (FILES * LINES) as usize;
    for (epoch, seen) in support::counts(&[&got[0], &got[1]]).iter().enumerate() {
        let (a, b) = (&got[0][epoch], &got[1][epoch]);
        assert_eq!(a.batches, b.batches, "epoch {epoch}: both ranks the same number of batches");
        assert!(seen.values().all(|&n| n == 1), "epoch {epoch}: a record reached the job twice");
        let dropped = (a.dropped_rows + b.dropped_rows) as usize;
        assert_eq!(seen.len() + dropped, all, "epoch {epoch}: every record reached a rank or was dropped");
    }
}
