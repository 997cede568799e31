//! The model's measurements, the baselines in it, and Stoker's goals against them.

use super::compare::{self, Contest, FAST_ENOUGH, SAME_COST};
use super::contenders::Contender;
use super::drive::Until;
use super::*;
use super::{scenarios, tenants};

fn config() -> SimConfig {
    SimConfig::default()
}

/// `steps` of `trainer` under `contender`, fixed pools sized at the trainer's optimum.
fn train(contender: Contender, trainer: &Trainer, steps: u64) -> Run {
    let c = config();
    contender.train(trainer, &c, optimum(trainer, &c), steps)
}

#[test]
fn selection_finds_the_kth_smallest() {
    // A deterministic shuffle with repeated values, every k against a sort.
    let values: Vec<f64> = (0..101u64).map(|i| ((i * 37) % 101 / 3) as f64).collect();
    let mut sorted = values.clone();
    sorted.sort_by(f64::total_cmp);
    for (k, want) in sorted.iter().enumerate() {
        assert_eq!(world::select(&mut values.clone(), k), *want, "k = {k}");
    }
    assert_eq!(world::select(&mut [2.5], 0), 2.5);
}

#[test]
fn utilisation_and_the_queue_follow_the_bottleneck() {
    let prefetch = config().prefetch;
    let trainer = Trainer::with_optimum(8, 0.030);
    // Too few workers: they never rest, nothing is ready when the trainer asks, it waits.
    let mut world = World::new(trainer.clone(), 4);
    world.measure(60.0, prefetch, u64::MAX);
    let short = world.measure(60.0, prefetch, u64::MAX);
    assert!((short.utilisation - 1.0).abs() < 1e-6, "{short:?}");
    assert!(short.ready < 0.01 && (short.window.wait_fraction - 0.5).abs() < 0.01, "{short:?}");
    // Twice the optimum: the queue stays full, the workers idle half the time, no waiting.
    let mut world = World::new(trainer, 16);
    world.measure(60.0, prefetch, u64::MAX);
    let spare = world.measure(60.0, prefetch, u64::MAX);
    assert!((spare.utilisation - 0.5).abs() < 0.01, "{spare:?}");
    assert!(spare.ready > prefetch - 1.0 && spare.waited == 0.0, "{spare:?}");
    // A run stops at its step count exactly, and accounts for every worker-second.
    let run = train(Contender::Fixed { times: 2 }, &Trainer::with_optimum(8, 0.030), 5000);
    assert_eq!(run.batches, 5000);
    assert!((run.worker_seconds - 16.0 * run.seconds).abs() < 1e-6 * run.worker_seconds);
}

#[test]
fn hpa_settles_a_quarter_above_the_optimum() {
    // Above the optimum the workers are busy optimum / n of the time, so the 80% target asks
    // for optimum / 0.8 workers: the headroom HPA keeps, and pays for, by design.
    for opt in [4, 8, 12, 16] {
        let trainer = Trainer::with_optimum(opt, 0.030);
        let run = train(Contender::Hpa, &trainer, 60_000);
        let headroom = (f64::from(opt) / 0.8).ceil() as u32;
        assert!(run.final_workers.abs_diff(headroom) <= 1, "optimum {opt}: HPA ended at {}", run.final_workers);
        assert!(run.final_workers > opt);
    }
}

#[test]
fn keda_on_the_queue_cannot_ask_beyond_the_buffer() {
    // One worker per missing batch: an empty 8-batch buffer asks for 8, however many the
    // trainer needs; at optimum 16 training takes about twice as long.
    let c = config();
    let trainer = Trainer::with_optimum(16, 0.030);
    let run = train(Contender::Keda { per_worker: 1.0 }, &trainer, 60_000);
    assert_eq!(run.most_workers, c.prefetch as u32, "{:?}", run.decisions);
    let best = train(Contender::Max, &trainer, 60_000);
    assert!(run.seconds > 1.9 * best.seconds, "{} s against {} s", run.seconds, best.seconds);
    // Below the cap it overshoots and drops back whenever the buffer fills: it keeps deciding.
    let run = train(Contender::Keda { per_worker: 1.0 }, &Trainer::with_optimum(4, 0.030), 60_000);
    assert!(run.decisions.len() >= 6, "{:?}", run.decisions);
}

/// What failed of Stoker's goals in one contest, if anything, with the figures.
fn goals_missed(contest: &Contest) -> Option<String> {
    let v = contest.verdict();
    if v.fast() && v.cheapest() {
        return None;
    }
    let figures: Vec<String> = contest
        .runs
        .iter()
        .map(|(c, run)| format!("{} {:.3}x time, {:.0} worker-s", c.name(), contest.slowdown(run), run.worker_seconds))
        .collect();
    Some(format!("{}: {v:?}\n    {}", contest.scenario.name, figures.join("\n    ")))
}

/// Scenarios where a goal is missed, documented in docs/autoscaling.md with the reason, and
/// by how much ours may cost more than the cheapest policy within 5% of the best there.
///
/// At optimum 8 with noise, KEDA at one worker per missing prefetch batch can never ask for
/// more than 8 workers (the buffer's capacity), which happens to be this optimum: it reaches
/// 8 within 30 s (ours needs 90 s: three judged steps), dips to 7 for one sync now and then,
/// and ends 1.2 worker-seconds in 28,811 (0.004%) cheaper.
///
/// With a neighbour holding the node's cores all along, ours re-tries growth while its
/// clients wait (after 1, 2, then every 4 minutes): every re-try is a warm-up and two windows
/// at twice the workers, 11% more worker-seconds than Cachew's rule, which never re-tries.
///
/// With every worker 2x slower for the first 10 minutes, ours grows to the 32 workers that
/// keeps the trainer fed then, and keeps them once the workers are fast again: nothing in
/// the clients' batch times says the extra 16 idle (HPA, reading the workers' CPU, sheds them:
/// 34% fewer worker-seconds at the same training time).
const KNOWN_MISSES: [(&str, f64); 3] = [
    ("optimum 8, 10% noise", 1e-4),
    ("optimum 8, a neighbour holds all but four workers' cores all along", 0.12),
    ("optimum 16, workers 2x slower for the first 10 min", 0.35),
];

#[test]
fn stoker_trains_within_5_percent_of_the_best_and_cheapest_of_those_that_do() {
    let contests = compare::contests(&config());
    let missed: Vec<String> = contests
        .iter()
        .filter(|c| {
            // A known miss must stay within what the documentation says.
            KNOWN_MISSES.iter().find(|m| m.0 == c.scenario.name).is_none_or(|&(_, by)| {
                let v = c.verdict();
                !(v.fast() && v.cost_over_cheapest <= 1.0 + by)
            })
        })
        .filter_map(goals_missed)
        .collect();
    assert!(missed.is_empty(), "{}", missed.join("\n"));
    // The goal is not vacuous: in every scenario at least three baselines train more than 5%
    // slower than the best or cost more than ours.
    for contest in &contests {
        let ours = contest.run(Contender::Ours).worker_seconds;
        let beaten = contest.runs.iter().filter(|(c, run)| {
            *c != Contender::Ours && (contest.slowdown(run) > FAST_ENOUGH || run.worker_seconds > ours * 1.001)
        });
        assert!(beaten.count() >= 3, "{}: fewer than three baselines lose", contest.scenario.name);
    }
}

#[test]
fn tenants_finish_soonest_over_a_shared_budget_at_no_more_cost() {
    let outcomes = tenants::tenants_contest(&config());
    let (ours, best_mean) = ours_finish_within_5_percent_of_the_soonest(&outcomes);
    for other in outcomes.iter().filter(|o| o.mean_seconds <= FAST_ENOUGH * best_mean) {
        assert!(
            ours.worker_seconds <= other.worker_seconds * (1.0 + SAME_COST),
            "{} costs less: {outcomes:#?}",
            other.name
        );
    }
    // Within quotas a finished tenant's workers stay idle: the last job takes far longer.
    assert!(outcomes[1..].iter().all(|o| o.last_seconds > 1.5 * ours.last_seconds), "{outcomes:#?}");
}

#[test]
fn tenants_never_exceed_the_budget_or_their_quota() {
    let c = config();
    let trainers: Vec<Trainer> = tenants::TENANT_OPTIMA.iter().map(|&o| Trainer::with_optimum(o, 0.030)).collect();
    let mins = tenants::TENANT_MINS;
    let budget = tenants::Sharing::Budget(tenants::TENANT_BUDGET);
    let shared = tenants::share_rounds(&trainers, &mins, Contender::Ours, &budget, &[Until::Batches(20_000); 5], &c);
    for counts in &shared.history {
        assert!(counts.iter().sum::<u32>() <= tenants::TENANT_BUDGET, "{counts:?}");
    }
    // A finished tenant's workers went to the others: the budget was used after it was done.
    let first_done = shared.history.iter().position(|h| h.contains(&0)).expect("a tenant finishes first");
    assert_eq!(shared.history[first_done + 1].iter().sum::<u32>(), tenants::TENANT_BUDGET);
    let quotas = tenants::Sharing::even_quotas(tenants::TENANT_BUDGET, &mins);
    let tenants::Sharing::Quotas(q) = &quotas else { unreachable!() };
    assert_eq!(q.iter().sum::<u32>(), tenants::TENANT_BUDGET);
    let shared = tenants::share_rounds(&trainers, &mins, Contender::Hpa, &quotas, &[Until::Batches(20_000); 5], &c);
    for counts in &shared.history {
        assert!(counts.iter().zip(q).all(|(n, q)| n <= q), "{counts:?} over {q:?}");
    }
}

#[test]
fn contention_that_passes_leaves_no_convergence_behind() {
    // Each scenario slows the workers for a stretch while the search runs: a step measured
    // then does not help, and the search converges low with its clients waiting. Once the
    // stretch is over ours must not stay below the optimum, and trains within 5% of the best.
    // (Workers slowed all along, it rightly stays where more workers do not help.)
    let c = config();
    let mut failures = Vec::new();
    for scenario in scenarios::contention_scenarios() {
        let contest = compare::contest(&scenario, &c);
        let ours = contest.run(Contender::Ours);
        let lasts = scenario.trainer.contention.is_some_and(|c| c.until_s.is_infinite());
        let below = !lasts && ours.final_workers + 1 < contest.optimum;
        if contest.slowdown(ours) > FAST_ENOUGH || below {
            failures.push(format!(
                "{}: {:.3}x the best time, ended at {} (optimum {}): {:?}",
                scenario.name,
                contest.slowdown(ours),
                ours.final_workers,
                contest.optimum,
                ours.decisions
            ));
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

#[test]
fn a_job_grows_again_once_its_neighbour_on_the_node_is_done() {
    ours_finish_within_5_percent_of_the_soonest(&tenants::shared_node_contest(&config()));
}

/// Asserts that ours (the first outcome) finishes the tenants' jobs, on average and the last
/// one, within 5% of the soonest way of sharing; ours, and the soonest mean.
fn ours_finish_within_5_percent_of_the_soonest(
    outcomes: &[tenants::TenantsOutcome],
) -> (&tenants::TenantsOutcome, f64) {
    let ours = &outcomes[0];
    assert!(ours.name.starts_with("ours"));
    let best_mean = outcomes.iter().map(|o| o.mean_seconds).fold(f64::MAX, f64::min);
    let best_last = outcomes.iter().map(|o| o.last_seconds).fold(f64::MAX, f64::min);
    assert!(ours.mean_seconds <= FAST_ENOUGH * best_mean, "{outcomes:#?}");
    assert!(ours.last_seconds <= FAST_ENOUGH * best_last, "{outcomes:#?}");
    (ours, best_mean)
}

#[test]
fn an_outage_during_the_search_does_not_leave_workers_idle() {
    // The e2e scenario's case: 2 s windows, an operator restart or a leader change while the
    // search runs, the trainer waiting a second or so for the new dispatcher (and the default
    // 10 s windows with a lease's worth of waiting). Whatever window it falls in, the search
    // ends within one of the optimum, as without it. Judging the mean of a stalled window and
    // a normal one, the next step overshot: 104 of these 5400 runs ended 2 or 3 above
    // (optimum 5: 2 -> 4 -> 7; the e2e scenario ended at 7 once in CI), and a count too high is
    // never noticed afterwards, since the clients no longer wait.
    let mut failures = Vec::new();
    for (window, outages) in [(2u32, [0.5, 1.0, 1.5]), (10, [2.5, 5.0, 14.0])] {
        let c = SimConfig { window_seconds: f64::from(window), windows: 60, ..config() };
        let policy = stoker_api::AutoscalingPolicy { window_seconds: window, ..Default::default() };
        for opt in [3, 5, 8] {
            for seconds in outages {
                for step in 0..200 {
                    let at = f64::from(step) * f64::from(window) / 20.0;
                    let trainer = Trainer { outage: Some((at, seconds)), ..Trainer::with_optimum(opt, 0.010) };
                    let run = run(crate::autoscaling::policy::ours(c.limits, &policy, 1).as_mut(), &trainer, &c, 1);
                    if run.final_workers > opt + 1 || run.final_workers + 1 < opt {
                        failures.push(format!(
                            "{window} s windows, optimum {opt}, {seconds} s outage at {at:.1} s: ended at {} {:?}",
                            run.final_workers, run.decisions
                        ));
                    }
                }
            }
        }
    }
    assert!(failures.is_empty(), "{} runs failed:\n{}", failures.len(), failures.join("\n"));
}
