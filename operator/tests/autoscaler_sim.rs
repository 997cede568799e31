//! The autoscaler policies in simulation: deterministic, no processes. A model of N workers
//! each making r batches/s and a trainer needing c s/batch (optimum ceil(1/(r c))), with noise,
//! periodic stalls and speed changes; and tenants sharing a budget.

use stoker_api::AutoscalingPolicy;
use stoker_operator::autoscaling::budget::{self, Model, Wish};
use stoker_operator::autoscaling::policy::{self, Limits};
use stoker_operator::autoscaling::sim::{self, SimConfig, Trainer};

fn config() -> SimConfig {
    SimConfig::default()
}

fn bound(opt: u32) -> usize {
    (f64::from(opt)).log2().ceil() as usize + 3
}

#[test]
fn ours_finds_every_optimum_in_log_decisions() {
    let c = config();
    let policy = AutoscalingPolicy::default();
    let mut failures = Vec::new();
    for s in sim::scenarios() {
        let opt = sim::optimum(&s.trainer, &c);
        let run = sim::run(policy::ours(c.limits, &policy, 1).as_mut(), &s.trainer, &c, 1);
        let ok = run.final_workers.abs_diff(opt) <= 1
            && run.decisions.len() <= bound(opt)
            && run.most_workers <= c.limits.max;
        if !ok {
            failures.push(format!(
                "{}: optimum {opt}, ended at {} after {} decisions {:?}",
                s.name,
                run.final_workers,
                run.decisions.len(),
                run.decisions
            ));
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

#[test]
fn the_optimum_is_the_analytic_one_without_stalls() {
    for opt in 1..=32 {
        assert_eq!(sim::optimum(&Trainer::with_optimum(opt, 0.030), &config()), opt);
    }
}

#[test]
fn every_optimum_from_1_to_32_steady_and_noisy() {
    let c = config();
    let policy = AutoscalingPolicy::default();
    for opt in 1..=32 {
        for noise in [0.0, 0.1] {
            let trainer = Trainer { noise, seed: u64::from(opt) * 7, ..Trainer::with_optimum(opt, 0.030) };
            let run = sim::run(policy::ours(c.limits, &policy, 1).as_mut(), &trainer, &c, 1);
            assert!(
                run.final_workers.abs_diff(opt) <= 1,
                "optimum {opt}, noise {noise}: ended at {} ({:?})",
                run.final_workers,
                run.decisions
            );
            assert!(
                run.decisions.len() <= bound(opt),
                "optimum {opt}, noise {noise}: {} decisions {:?}",
                run.decisions.len(),
                run.decisions
            );
        }
    }
}

#[test]
fn cachew_is_a_faithful_baseline_one_worker_per_decision() {
    let c = config();
    let policy = AutoscalingPolicy::default();
    for opt in [1, 2, 4, 8] {
        let run = sim::run(policy::cachew(c.limits, &policy, 1).as_mut(), &Trainer::with_optimum(opt, 0.030), &c, 1);
        assert!(run.final_workers.abs_diff(opt) <= 1, "optimum {opt}: Cachew ended at {}", run.final_workers);
        assert!(
            run.decisions.windows(2).all(|d| d[0].2.abs_diff(d[1].2) == 1),
            "one worker per step: {:?}",
            run.decisions
        );
        assert!(run.decisions.len() + 1 >= opt as usize, "about opt decisions: {:?}", run.decisions);
    }
}

#[test]
fn max_is_never_exceeded() {
    let c = SimConfig { limits: Limits { min: 1, max: 5 }, ..config() };
    let policy = AutoscalingPolicy::default();
    let run = sim::run(policy::ours(c.limits, &policy, 1).as_mut(), &Trainer::with_optimum(16, 0.030), &c, 1);
    assert!(run.most_workers <= 5, "{:?}", run.decisions);
    assert_eq!(run.final_workers, 5, "held at max while still data-bound");
}

#[test]
fn reconverges_when_the_trainer_gets_faster_or_slower() {
    let c = SimConfig { windows: 200, ..config() };
    let policy = AutoscalingPolicy::default();
    for (factor, after) in [(0.5, 8), (2.0, 4)] {
        // Optimum 8 at first; after window 60 the trainer computes `factor` times as long.
        let trainer = Trainer { speed_change: Some((60, factor)), ..Trainer::with_optimum(8, 0.030) };
        let run = sim::run(policy::ours(c.limits, &policy, 1).as_mut(), &trainer, &c, 1);
        let before: Vec<_> = run.decisions.iter().filter(|d| d.0 < 60).collect();
        assert!(before.last().is_some_and(|d| d.2.abs_diff(8) <= 1), "first converged near 8: {:?}", run.decisions);
        let want = if factor < 1.0 { 16 } else { after };
        assert!(
            run.final_workers.abs_diff(want) <= 1,
            "x{factor}: ended at {}, want {want}: {:?}",
            run.final_workers,
            run.decisions
        );
    }
}

#[test]
fn idle_goes_to_min_and_comes_back() {
    let c = config();
    let policy = AutoscalingPolicy::default();
    let mut p = policy::ours(Limits { min: 2, max: 32 }, &policy, 2);
    let trainer = Trainer::with_optimum(8, 0.030);
    let mut world = sim::World::new(trainer, 2);
    for _ in 0..30 {
        let w = world.window(c.window_seconds, c.prefetch);
        if let policy::Decision::Scale { to, .. } = p.observe(&w) {
            world.workers = to;
        }
    }
    let converged = world.workers;
    assert!(converged.abs_diff(8) <= 1);
    assert_eq!(
        p.idle(),
        policy::Decision::Scale {
            to: 2,
            reason: format!("no client attached: scaling to min 2 (will return to {converged})")
        }
    );
    assert_eq!(p.idle(), policy::Decision::Hold, "idle once");
    world.workers = 2;
    let w = world.window(c.window_seconds, c.prefetch);
    assert!(matches!(p.observe(&w), policy::Decision::Scale { to, .. } if to == converged), "back to where it was");
}

/// Brute force: the allocation maximising the sum of log speedups, by enumeration.
fn best_total(models: &[Model], mins: &[u32], wants: &[u32], budget: u32) -> f64 {
    fn go(i: usize, left: u32, models: &[Model], mins: &[u32], wants: &[u32]) -> f64 {
        if i == models.len() {
            return 0.0;
        }
        let mut best = f64::MIN;
        for n in mins[i]..=wants[i].min(mins[i] + left) {
            let value = (models[i].batch_time(mins[i]) / models[i].batch_time(n)).ln();
            best = best.max(value + go(i + 1, left - (n - mins[i]), models, mins, wants));
        }
        best
    }
    go(0, budget - mins.iter().sum::<u32>(), models, mins, wants)
}

#[test]
fn tenants_over_a_budget_get_the_best_total_and_stay_put() {
    let c = config();
    for (optima, mins, budget) in
        [(vec![6u32, 10], vec![1u32, 2], 10u32), (vec![4, 8, 3, 12, 6], vec![1, 1, 2, 1, 3], 16)]
    {
        let trainers: Vec<Trainer> = optima.iter().map(|&o| Trainer::with_optimum(o, 0.030)).collect();
        let history = sim::multi_tenant(&trainers, &mins, budget, 80, &c);
        let last = history.last().unwrap();
        assert!(history.iter().all(|h| h.iter().sum::<u32>() <= budget), "over budget: {history:?}");
        assert!(history.iter().all(|h| h.iter().zip(&mins).all(|(n, m)| n >= m)), "below a min: {history:?}");
        assert!(
            history[history.len() - 20..].iter().all(|h| h == last),
            "oscillates: {:?}",
            &history[history.len() - 20..]
        );
        // The final split maximises the total log speedup for the tenants' models.
        // Each tenant's true model: compute 30 ms, data 30 ms * optimum worker-seconds per batch.
        let models: Vec<Model> =
            optima.iter().map(|&o| Model { compute_s: 0.030, data_s: 0.030 * f64::from(o) }).collect();
        let total: f64 =
            models.iter().zip(&mins).zip(last).map(|((m, &lo), &n)| (m.batch_time(lo) / m.batch_time(n)).ln()).sum();
        let best = best_total(&models, &mins, &optima, budget);
        assert!(total >= best - 1e-6, "{optima:?} over {budget}: got {last:?} worth {total:.3}, best {best:.3}");
        assert_eq!(last.iter().sum::<u32>(), budget, "the whole budget is used: {last:?}");
    }
}

#[test]
fn the_budget_share_is_greedy_on_log_speedup() {
    let w = |workers, median_s, wait_fraction| stoker_api::window::Window {
        workers,
        batches: 100,
        median_s,
        p90_s: median_s,
        mean_s: median_s,
        wait_fraction,
    };
    // a: data-bound at 1 worker (100 ms, 70% waiting): needs ~4. b: barely data-bound.
    let wishes = vec![
        Wish {
            key: "a".into(),
            namespace: "a".into(),
            min: 1,
            wants: 8,
            current: 1,
            model: Some(Model::from_window(&w(1, 0.100, 0.7))),
        },
        Wish {
            key: "b".into(),
            namespace: "b".into(),
            min: 1,
            wants: 8,
            current: 1,
            model: Some(Model::from_window(&w(1, 0.100, 0.1))),
        },
    ];
    let grants = budget::share(wishes, Some(4));
    assert_eq!((grants["a"].granted, grants["b"].granted), (3, 1), "{grants:?}");
    assert!(grants["a"].held_back > 0 && grants["b"].held_back > 0);
}
