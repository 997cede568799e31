//! A share group simulated: workers that make one split in `cost` ticks, jobs that read
//! `speed` splits a tick from whichever of their tails holds one, each tail holding at most
//! `window` splits. Checked: every job gets every split of each of its epochs once; the
//! fastest job reads at its own speed, as alone; the others are not starved; and the group's
//! productions against what one job alone would have cost.

use std::collections::{BTreeMap, BTreeSet, VecDeque};

use super::*;
use crate::autocache::plan::Directive;
use crate::dispatcher::ledger::Reporter;

const ONE: Reporter = Reporter::Client { rank: 0, consumers: 1 };

struct SimJob {
    name: JobName,
    job: Job,
    speed: f64,
    joins: u64,
    leaves: Option<u64>,
    credit: f64,
    /// Per worker: (epoch, split) made for it and not read yet.
    tails: Vec<VecDeque<(u64, u64)>>,
    read: BTreeMap<u64, BTreeSet<u64>>,
    /// Ticks it could have read a split but none was there.
    waited: f64,
    finished_epochs: u64,
}

struct Sim {
    plan: Plan,
    window: usize,
    cost: u64,
    /// Per worker: the production under way and when it is done.
    workers: Vec<Option<(u64, Production)>>,
    jobs: Vec<SimJob>,
    counts: ShareCounts,
    tick: u64,
    start: Instant,
}

impl Sim {
    fn new(splits: u64, workers: usize, cost: u64, window: usize) -> Sim {
        Sim {
            plan: Plan { splits, order: Some(7) },
            window,
            cost,
            workers: vec![None; workers],
            jobs: Vec::new(),
            counts: ShareCounts::default(),
            tick: 0,
            start: Instant::now(),
        }
    }

    fn job(&mut self, name: &str, speed: f64, joins: u64, leaves: Option<u64>) {
        self.jobs.push(SimJob {
            name: name.into(),
            job: Job::starting(0, &self.plan),
            speed,
            joins,
            leaves,
            credit: 0.0,
            tails: vec![VecDeque::new(); self.workers.len()],
            read: BTreeMap::new(),
            waited: 0.0,
            finished_epochs: 0,
        });
    }

    fn live(job: &SimJob, tick: u64) -> bool {
        tick >= job.joins && job.leaves.is_none_or(|l| tick < l)
    }

    /// Runs `ticks` more ticks.
    fn run(&mut self, ticks: u64) {
        for tick in self.tick..self.tick + ticks {
            self.tick = tick + 1;
            let t = t0(self.start, tick);
            // Productions done reach their members' tails.
            for w in 0..self.workers.len() {
                if self.workers[w].as_ref().is_some_and(|(done, _)| *done <= tick) {
                    let (_, production) = self.workers[w].take().unwrap();
                    for (name, a) in production.members {
                        let Assignment::Split { epoch, split, .. } = a else { unreachable!() };
                        let job = self.jobs.iter_mut().find(|j| j.name == name).unwrap();
                        if Self::live(job, tick) {
                            job.tails[w].push_back((epoch, split));
                        }
                    }
                }
            }
            // Idle workers ask.
            for w in 0..self.workers.len() {
                if self.workers[w].is_some() {
                    continue;
                }
                let tails: Vec<Tail> = self
                    .jobs
                    .iter()
                    .filter(|j| Self::live(j, tick))
                    .map(|j| Tail {
                        job: j.name.clone(),
                        epochs: vec![j.job.epoch(), j.job.epoch() + 1],
                        backlog: j.tails[w].len() as u64,
                        room: j.tails[w].len() < self.window,
                    })
                    .collect();
                // The producers that ask: of the jobs with room here, the fastest first (its
                // consumers drain it soonest), then the emptiest.
                let mut askers: Vec<(f64, u64, JobName)> = tails
                    .iter()
                    .filter(|t| t.room)
                    .map(|t| {
                        let job = &self.jobs.iter().find(|j| j.name == t.job).unwrap().job;
                        (job.read_rate(t0(self.start, tick)), t.backlog, t.job.clone())
                    })
                    .collect();
                askers.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)));
                let mut jobs: Vec<(&JobName, &mut Job)> = self.jobs.iter_mut().map(|j| (&j.name, &mut j.job)).collect();
                let worker: WorkerId = format!("w{w}").into();
                let made = askers.iter().find_map(|(_, _, leader)| {
                    let to = HandOut { worker: &worker, directive: &Directive::Compute, echo: 0, now: t };
                    hand_out(&mut jobs, &tails, leader, &self.plan, to, &mut self.counts)
                });
                self.workers[w] = made.map(|p| (tick + self.cost, p));
            }
            // Jobs read.
            for job in self.jobs.iter_mut().filter(|j| Self::live(j, tick)) {
                job.credit += job.speed;
                while job.credit >= 1.0 {
                    let Some(w) =
                        (0..job.tails.len()).max_by_key(|&w| job.tails[w].len()).filter(|&w| !job.tails[w].is_empty())
                    else {
                        // Its trainer waits: the time it could have used is lost.
                        job.waited += 1.0;
                        job.credit = 1.0 - job.speed;
                        break;
                    };
                    let (epoch, split) = job.tails[w].pop_front().unwrap();
                    assert!(
                        job.read.entry(epoch).or_default().insert(split),
                        "{}: split {split} of epoch {epoch} twice",
                        job.name
                    );
                    job.credit -= 1.0;
                    if job.job.complete(&[(epoch, split)], ONE, &self.plan, t).is_some() {
                        job.finished_epochs += 1;
                    }
                }
            }
        }
    }

    fn job_named(&self, name: &str) -> &SimJob {
        self.jobs.iter().find(|j| j.name.as_str() == name).unwrap()
    }

    /// Each epoch a job finished, it read whole.
    fn check_every_finished_epoch_whole(&self) {
        for job in &self.jobs {
            for epoch in 0..job.finished_epochs {
                assert_eq!(job.read[&epoch].len() as u64, self.plan.splits, "{}: epoch {epoch}", job.name);
            }
        }
    }
}

/// The time of `tick`: a tick is 100 ms.
fn t0(start: Instant, tick: u64) -> Instant {
    start + std::time::Duration::from_millis(100 * tick)
}

fn read(job: &SimJob) -> u64 {
    job.read.values().map(|s| s.len() as u64).sum()
}

/// The sweep of the issue: two trainers at full speed, one at 0.7 and one at 0.4.
fn sweep(sim: &mut Sim) {
    sim.job("fast", 1.0, 0, None);
    sim.job("fast-too", 1.0, 0, None);
    sim.job("slower", 0.7, 0, None);
    sim.job("slowest", 0.4, 0, None);
}

/// Productions and reads of the fastest job alone on `workers`.
fn alone(splits: u64, workers: usize, window: usize, ticks: u64) -> (u64, u64) {
    let mut alone = Sim::new(splits, workers, 3, window);
    alone.job("fast", 1.0, 0, None);
    alone.run(ticks);
    (alone.counts.productions, read(alone.job_named("fast")))
}

/// The sweep run for `TICKS` on `workers` with `window`, every finished epoch checked whole,
/// beside the productions and reads of the fastest job alone.
fn swept(workers: usize, window: usize) -> (Sim, u64, u64) {
    let mut sim = Sim::new(SPLITS, workers, 3, window);
    sweep(&mut sim);
    sim.run(TICKS);
    sim.check_every_finished_epoch_whole();
    let (productions, reads) = alone(SPLITS, workers, window, TICKS);
    (sim, productions, reads)
}

// Workers make a split in 3 ticks: 3 of them make 1 split a tick, what the fastest job reads.
const SPLITS: u64 = 60;
const TICKS: u64 = 1200;

#[test]
fn jobs_at_their_own_speeds_each_read_every_split_once_from_one_production() {
    // Room for the slower jobs to be served too (the autoscaler adds workers while they wait).
    let (sim, productions_alone, fast_alone) = swept(4, 4);
    let reads: Vec<u64> = sim.jobs.iter().map(read).collect();
    let unshared: u64 = reads.iter().sum();
    let counts = &sim.counts;
    eprintln!("one job alone: {productions_alone} productions; the sweep: {counts:?}, reads {reads:?}");
    assert!(
        reads[0] >= fast_alone && reads[1] >= fast_alone,
        "the fastest jobs read as alone: {reads:?} vs {fast_alone}"
    );
    for job in &sim.jobs {
        let r = read(job) as f64;
        assert!(r >= 0.95 * job.speed * TICKS as f64, "{} read {r} of {} it could", job.name, job.speed * TICKS as f64);
    }
    // Unshared, each read split is a production: 3.1x one job's.
    assert!(
        counts.productions as f64 <= 1.5 * productions_alone as f64,
        "{} productions for the four jobs (unshared: {unshared}); one job alone: {productions_alone}",
        counts.productions
    );
    assert!(counts.missed.values().sum::<u64>() > 0, "the slower jobs missed some and got them again");
}

#[test]
fn with_only_what_the_fastest_needs_it_reads_as_alone_and_the_others_take_what_passes() {
    let (sim, productions_alone, fast_alone) = swept(3, 2);
    let reads: Vec<u64> = sim.jobs.iter().map(read).collect();
    assert!(reads[0] >= fast_alone && reads[1] >= fast_alone, "{reads:?} vs {fast_alone} alone");
    assert_eq!(sim.counts.productions, productions_alone, "no production beyond the fastest job's");
    // The slower two wait (what the autoscaler sees), yet read more than a third of their fill.
    for job in &sim.jobs[2..] {
        assert!(job.waited > 0.0);
        assert!(read(job) as f64 >= 0.6 * job.speed * TICKS as f64, "{}: {}", job.name, read(job));
    }
}

#[test]
fn a_job_joining_mid_epoch_takes_the_production_where_it_is() {
    let (workers, window) = (4, 4);
    let mut sim = Sim::new(SPLITS, workers, 3, window);
    sim.job("first", 1.0, 0, None);
    sim.job("joins", 1.0, 330, None);
    sim.run(TICKS);
    sim.check_every_finished_epoch_whole();
    let (first, joins) = (read(sim.job_named("first")), read(sim.job_named("joins")));
    assert!(sim.job_named("joins").finished_epochs >= 10, "{joins}");
    assert!(joins as f64 >= 0.95 * (TICKS - 330) as f64, "the joining job reads at its speed: {joins}");
    assert!(
        (sim.counts.productions as f64) < 1.1 * first as f64,
        "{} productions for {first} + {joins} reads: shared from the start",
        sim.counts.productions
    );
}

#[test]
fn a_job_that_stops_reading_holds_nobody_back_and_then_gets_its_epoch() {
    let (workers, window) = (4, 4);
    let mut sim = Sim::new(SPLITS, workers, 3, window);
    sim.job("steady", 1.0, 0, None);
    sim.job("pauses", 1.0, 0, None);
    sim.run(200);
    let pauses = sim.jobs.iter().position(|j| j.name.as_str() == "pauses").unwrap();
    sim.jobs[pauses].speed = 0.0;
    sim.run(600);
    let (steady, held) = (read(sim.job_named("steady")), read(sim.job_named("pauses")));
    assert!(steady >= 790, "the other job read on: {steady} of 800");
    // What it holds is its window on each worker, no more.
    let holds: usize = sim.jobs[pauses].tails.iter().map(VecDeque::len).sum();
    assert!(holds <= workers * window + workers, "{holds}");
    sim.jobs[pauses].speed = 1.0;
    sim.run(400);
    sim.check_every_finished_epoch_whole();
    // Back, it reads what passes and leads with the workers' spare third: 352 of 400 when
    // written (the autoscaler adds workers while it waits).
    let after = read(sim.job_named("pauses")) - held;
    assert!(after >= 340, "it reads near its speed again: {after} in 400 ticks; {:?}", sim.counts);
    assert!(sim.job_named("pauses").finished_epochs > held / SPLITS, "and finishes the epoch it paused in");
    assert!(sim.counts.missed[&JobName::from("pauses")] > 0, "what went by while it paused is counted");
}

#[test]
fn a_job_that_leaves_frees_its_place() {
    let (workers, window) = (4, 4);
    let mut sim = Sim::new(SPLITS, workers, 3, window);
    sim.job("stays", 1.0, 0, None);
    sim.job("leaves", 1.0, 0, Some(300));
    sim.run(TICKS);
    sim.check_every_finished_epoch_whole();
    let before = sim.counts.deliveries();
    sim.run(100);
    assert!(sim.counts.deliveries() - before <= 100 + (workers * 2) as u64, "only the job that stayed is served");
    assert!(read(sim.job_named("stays")) >= 1290);
}
