//! A share group through the driver (docs/reuse.md): every job of the group reads every split
//! of one production, so each job sees all of the group's workers, at its own speed. Each job
//! has its own policy and the pipeline runs the most any of them wants, so the group is sized
//! for the job that gains from the most workers: its fastest.

use std::collections::BTreeMap;
use std::time::Duration;

use stoker_api::{AutoscalingPolicy, JobName};

use super::world::World;
use super::{SimConfig, Trainer};
use crate::autoscaling::budget::Caps;
use crate::autoscaling::driver::{Driver, Scaled};
use crate::dispatcher::JobWindows;
use crate::key::PipelineKey;

/// What a group's run measured.
#[derive(Debug, Default)]
pub struct GroupRun {
    /// The group's workers after each round.
    pub workers: Vec<u32>,
    /// Per job: seconds its trainer waited for data, and seconds in all.
    pub waited: Vec<f64>,
    pub seconds: Vec<f64>,
    /// What each job's policy wanted after the last round.
    pub wants: BTreeMap<JobName, u32>,
}

impl GroupRun {
    /// The fraction of job `i`'s time spent waiting.
    pub fn wait_fraction(&self, i: usize) -> f64 {
        self.waited[i] / self.seconds[i]
    }
}

/// `rounds` scaling rounds of the group `trainers` (job `trial-i` reads with trainer `i`),
/// starting at the minimum.
pub fn group_rounds(trainers: &[Trainer], config: &SimConfig, rounds: u32) -> GroupRun {
    let key = PipelineKey::new("sweep", "input");
    let policy = AutoscalingPolicy { window_seconds: config.window_seconds as u32, ..AutoscalingPolicy::default() };
    let mut scaled =
        Scaled { key: key.clone(), min: config.limits.min, max: config.limits.max, policy, workers: 1, echo: None };
    scaled.workers = config.limits.min.max(1);
    let mut worlds: Vec<World> = trainers.iter().map(|t| World::new(t.clone(), scaled.workers)).collect();
    let mut driver = Driver::default();
    let mut run =
        GroupRun { waited: vec![0.0; trainers.len()], seconds: vec![0.0; trainers.len()], ..GroupRun::default() };
    let mut records = BTreeMap::new();
    for _ in 0..rounds {
        let windows = worlds
            .iter_mut()
            .enumerate()
            .map(|(i, world)| {
                world.workers = scaled.workers;
                let measured = world.measure(config.window_seconds, config.prefetch, u64::MAX);
                run.waited[i] += measured.waited;
                run.seconds[i] += measured.seconds;
                JobWindows {
                    pipeline: key.clone(),
                    job: format!("trial-{i}").into(),
                    consumers: 1,
                    windows: vec![measured.window],
                }
            })
            .collect();
        let elapsed = Duration::from_secs_f64(config.window_seconds);
        let (_, next) = driver.round(elapsed, "t", windows, std::slice::from_ref(&scaled), Caps::default(), &records);
        records = next;
        scaled.workers = records[&key].workers;
        run.workers.push(scaled.workers);
    }
    run.wants = records.get(&key).map(|r| r.job_wants.clone()).unwrap_or_default();
    run
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_group_is_sized_for_its_fastest_job_which_waits_no_more_than_alone() {
        let config = SimConfig::default();
        let fastest = Trainer::with_optimum(6, 0.1);
        // The sweep: trainers at 1x, 1x, 0.7x and 0.4x the fastest's speed.
        let slower = |speed: f64| Trainer { compute: fastest.compute / speed, seed: 7, ..fastest.clone() };
        let trainers = [fastest.clone(), fastest.clone(), slower(0.7), slower(0.4)];
        let rounds = 60;
        let alone = group_rounds(&trainers[..1], &config, rounds);
        let group = group_rounds(&trainers, &config, rounds);
        let last = |run: &GroupRun| *run.workers.last().unwrap();
        assert_eq!(last(&alone), last(&group), "alone {:?}\ngroup {:?}", alone.workers, group.workers);
        assert!(last(&group) >= fastest.analytic_optimum(), "{:?}", group.workers);
        assert!(
            group.wait_fraction(0) <= alone.wait_fraction(0) + 1e-9,
            "the fastest waits no more than alone: {} vs {}",
            group.wait_fraction(0),
            alone.wait_fraction(0)
        );
        let wants: Vec<u32> = group.wants.values().copied().collect();
        assert_eq!(wants[0], last(&group), "{:?}", group.wants);
        assert!(wants[3] < wants[0], "the slowest wants fewer: {:?}", group.wants);
        println!(
            "alone: {:?}, wait {:.3}\ngroup: {:?}, waits {:.3} {:.3} {:.3} {:.3}, wants {:?}",
            alone.workers,
            alone.wait_fraction(0),
            group.workers,
            group.wait_fraction(0),
            group.wait_fraction(1),
            group.wait_fraction(2),
            group.wait_fraction(3),
            group.wants
        );
    }
}
