//! Every policy on every scenario for the same number of steps: training time, cost
//! (worker-seconds), accelerator time lost waiting for data, decisions, time to converge; and
//! Stoker's goals: within 5% of the best achievable training time, and the lowest cost among
//! the policies that are.

use std::fmt::Write as _;

use super::SimConfig;
use super::contenders::Contender;
use super::drive::Run;
use super::scenarios::{Scenario, comparison_scenarios, optimum};

/// How much slower than the best achievable a policy may train and still count as fast.
pub const FAST_ENOUGH: f64 = 1.05;
/// Costs this close (relatively) are equal: sums of the same worker-seconds in another order
/// differ in the last bits (runs that never idle a worker cost exactly steps / rate).
pub const SAME_COST: f64 = 1e-9;

/// One scenario's runs.
pub struct Contest {
    pub scenario: Scenario,
    pub optimum: u32,
    pub steps: u64,
    /// The fastest training: `max` workers from the start.
    pub best: Run,
    pub runs: Vec<(Contender, Run)>,
}

/// Runs every contender of [`Contender::all`] on `scenario`.
pub fn contest(scenario: &Scenario, config: &SimConfig) -> Contest {
    let optimum = optimum(&scenario.trainer, config);
    let steps = scenario.steps();
    let train = |c: Contender| c.train(&scenario.trainer, config, optimum, steps);
    Contest {
        scenario: scenario.clone(),
        optimum,
        steps,
        best: train(Contender::Max),
        runs: Contender::all(config).into_iter().map(|c| (c, train(c))).collect(),
    }
}

/// Stoker's goals in one scenario.
#[derive(Clone, Debug, PartialEq)]
pub struct Verdict {
    /// Ours' training time over the best achievable.
    pub slowdown: f64,
    /// Ours' cost over the lowest cost of the policies within [`FAST_ENOUGH`] (ours among
    /// them when it is).
    pub cost_over_cheapest: f64,
    /// That cheapest policy.
    pub cheapest: Contender,
}

impl Verdict {
    pub fn fast(&self) -> bool {
        self.slowdown <= FAST_ENOUGH
    }

    pub fn cheapest(&self) -> bool {
        self.fast() && self.cost_over_cheapest <= 1.0 + SAME_COST
    }
}

impl Contest {
    pub fn run(&self, contender: Contender) -> &Run {
        &self.runs.iter().find(|r| r.0 == contender).expect("every contender ran").1
    }

    /// The fastest training any run achieved (the `max` pool, unless noise says otherwise).
    pub fn best_seconds(&self) -> f64 {
        self.runs.iter().map(|r| r.1.seconds).fold(self.best.seconds, f64::min)
    }

    /// Training time over the best achievable.
    pub fn slowdown(&self, run: &Run) -> f64 {
        run.seconds / self.best_seconds()
    }

    /// Worker-seconds over those of the pool hand-sized at the optimum.
    pub fn relative_cost(&self, run: &Run) -> f64 {
        run.worker_seconds / self.run(Contender::Fixed { times: 1 }).worker_seconds
    }

    pub fn verdict(&self) -> Verdict {
        let ours = self.run(Contender::Ours);
        let (cheapest, cost) = self
            .runs
            .iter()
            .filter(|r| self.slowdown(&r.1) <= FAST_ENOUGH)
            .map(|r| (r.0, r.1.worker_seconds))
            .min_by(|a, b| a.1.total_cmp(&b.1))
            // Nobody fast: the max pool is, by definition.
            .unwrap_or((Contender::Max, self.best.worker_seconds));
        Verdict { slowdown: self.slowdown(ours), cost_over_cheapest: ours.worker_seconds / cost, cheapest }
    }
}

/// Runs every scenario of [`comparison_scenarios`].
pub fn contests(config: &SimConfig) -> Vec<Contest> {
    comparison_scenarios().iter().map(|s| contest(s, config)).collect()
}

/// The scenarios whose every figure the detailed table shows.
const DETAILED: [&str; 6] = [
    "optimum 4",
    "optimum 12, 10% noise",
    "optimum 32",
    "optimum 24, 1 s stall every 4th batch",
    "optimum 8 -> 16: trainer 2x faster a third in",
    "optimum 16 -> 8: trainer 2x slower a third in",
];

/// Markdown: one row per scenario, each policy's training time over the best achievable and
/// cost over the hand-sized pool's, and with `goals` whether Stoker's goals hold (they are
/// for the simulation's hour-long runs, where "best" is a run at max workers).
pub fn summary_table(contests: &[Contest], config: &SimConfig, goals: bool) -> String {
    let contenders = Contender::all(config);
    let mut out = String::from("| scenario | optimum | best time |");
    for c in &contenders {
        let _ = write!(out, " {} |", c.name());
    }
    out.push_str(if goals { " goals: fast, cheapest |\n| --- | --- | --- |" } else { "\n| --- | --- | --- |" });
    out.push_str(&" --- |".repeat(contenders.len() + usize::from(goals)));
    out.push('\n');
    for contest in contests {
        let _ = write!(
            out,
            "| {} | {} | {:.1} min |",
            contest.scenario.name,
            contest.optimum,
            contest.best_seconds() / 60.0
        );
        for &c in &contenders {
            let run = contest.run(c);
            let _ = write!(out, " {:.2} / {:.2} |", contest.slowdown(run), contest.relative_cost(run));
        }
        if !goals {
            out.push('\n');
            continue;
        }
        let v = contest.verdict();
        let fast = if v.fast() { "yes" } else { "**no**" };
        let cheapest = if v.cheapest() {
            "yes".to_string()
        } else {
            format!("**no**: {} costs {:.3}% less", v.cheapest.name(), (1.0 - 1.0 / v.cost_over_cheapest) * 100.0)
        };
        let _ = writeln!(out, " {fast} ({:.3}), {cheapest} |", v.slowdown);
    }
    out
}

/// Markdown: every figure of every policy, for the [`DETAILED`] scenarios or all.
pub fn detail_table(contests: &[Contest], all: bool) -> String {
    let mut out = String::from(
        "| scenario | policy | training time | worker-hours | waiting for data | decisions | last rescale | final workers |\n\
         | --- | --- | --- | --- | --- | --- | --- | --- |\n",
    );
    for contest in contests.iter().filter(|c| all || DETAILED.contains(&c.scenario.name.as_str())) {
        for (c, run) in &contest.runs {
            let last = match run.decisions.last() {
                Some(d) => format!("{:.0} s", d.1),
                None => "-".into(),
            };
            let _ = writeln!(
                out,
                "| {} | {} | {:.1} min | {:.2} | {:.0} s ({:.1}%) | {} | {last} | {} |",
                contest.scenario.name,
                c.name(),
                run.seconds / 60.0,
                run.worker_seconds / 3600.0,
                run.waited,
                run.waited / run.seconds * 100.0,
                run.decisions.len(),
                run.final_workers
            );
        }
    }
    out
}

/// The whole comparison of `contests`, as `stoker bench autoscaler` prints it; `all`: every
/// figure of every scenario, not only of some.
pub fn report(contests: &[Contest], config: &SimConfig, all: bool) -> String {
    let mut out =
        String::from("Training time over the best achievable / cost over the pool hand-sized at the optimum:\n\n");
    out.push_str(&summary_table(contests, config, true));
    out.push_str(if all { "\nEvery figure:\n\n" } else { "\nEvery figure, for some of the scenarios:\n\n" });
    out.push_str(&detail_table(contests, all));
    out.push_str("\nTenants over a budget:\n\n");
    out.push_str(&super::tenants::tenants_table(&super::tenants::tenants_contest(config)));
    out.push_str("\nTwo jobs on one node, the second finishing first:\n\n");
    out.push_str(&super::tenants::shared_node_table(&super::tenants::shared_node_contest(config)));
    out
}
