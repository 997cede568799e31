//! Self-contained SVG figures of the simulation: worker counts over time, and cost against
//! training time.

use std::fmt::Write as _;

use super::compare::Contest;
use super::contenders::Contender;
use super::drive::{Run, Until};
use super::scenarios::{Scenario, optimum};
use super::{SimConfig, Trainer};

/// A colour per contender, the same in every figure.
fn colour(c: Contender) -> &'static str {
    match c {
        Contender::Ours => "#1f77b4",
        Contender::Cachew => "#d62728",
        Contender::Hpa => "#2ca02c",
        Contender::Keda { per_worker } if per_worker >= 1.0 => "#ff7f0e",
        Contender::Keda { .. } => "#8c564b",
        Contender::Fixed { times: 1 } => "#7f7f7f",
        Contender::Fixed { .. } => "#bcbd22",
        Contender::Max => "#000000",
    }
}

/// Pixels per legend line.
const LEGEND_LINE: f64 = 16.0;

/// A frame with axes over the ranges given, the marks drawn into it, a legend below it.
struct Chart {
    width: f64,
    height: f64,
    pad: f64,
    x_range: (f64, f64),
    y_range: (f64, f64),
    body: String,
    legend: usize,
}

impl Chart {
    fn new(title: &str, x_range: (f64, f64), y_range: (f64, f64), x_label: &str, y_label: &str) -> Chart {
        let (width, height, pad) = (760.0, 420.0, 50.0);
        let mut chart = Chart { width, height, pad, x_range, y_range, body: String::new(), legend: 0 };
        let (x0, y0, x1, y1) = (pad, height - pad, width - pad, pad);
        let _ = write!(
            chart.body,
            "<rect width='100%' height='100%' fill='white'/>\n\
             <text x='{pad}' y='20' font-size='14'>{title}</text>\n\
             <line x1='{x0}' y1='{y0}' x2='{x1}' y2='{y0}' stroke='black'/>\n\
             <line x1='{x0}' y1='{y0}' x2='{x0}' y2='{y1}' stroke='black'/>\n\
             <text x='{x0}' y='{:.1}'>{}</text><text x='{:.1}' y='{:.1}' text-anchor='end'>{} {x_label}</text>\n\
             <text x='{:.1}' y='{:.1}' text-anchor='end'>{}</text><text x='{:.1}' y='{:.1}' text-anchor='end'>{}</text>\n\
             <text x='12' y='{:.1}' transform='rotate(-90 12 {:.1})' text-anchor='middle'>{y_label}</text>\n",
            y0 + 16.0,
            number(x_range.0),
            x1,
            y0 + 16.0,
            number(x_range.1),
            x0 - 4.0,
            y0,
            number(y_range.0),
            x0 - 4.0,
            y1 + 10.0,
            number(y_range.1),
            height / 2.0,
            height / 2.0,
        );
        chart
    }

    /// Inside the frame; values beyond it are drawn at its edge.
    fn x(&self, v: f64) -> f64 {
        let (lo, hi) = self.x_range;
        self.pad + (self.width - 2.0 * self.pad) * ((v - lo) / (hi - lo)).clamp(0.0, 1.0)
    }

    fn y(&self, v: f64) -> f64 {
        let (lo, hi) = self.y_range;
        self.height - self.pad - (self.height - 2.0 * self.pad) * ((v - lo) / (hi - lo)).clamp(0.0, 1.0)
    }

    /// A count that holds between samples: `points` are (end of a period, value during it).
    fn steps(&mut self, start: f64, points: &[(f64, f64)], colour: &str, dashed: bool) {
        let mut d = format!("M{:.1},{:.1}", self.x(self.x_range.0), self.y(start));
        let mut prev = self.x_range.0;
        for &(t, v) in points {
            let _ = write!(d, " L{:.1},{:.1} L{:.1},{:.1}", self.x(prev), self.y(v), self.x(t), self.y(v));
            prev = t;
            if t >= self.x_range.1 {
                break;
            }
        }
        let dash = if dashed { " stroke-dasharray='6 4'" } else { "" };
        let _ = writeln!(self.body, "<path d='{d}' fill='none' stroke='{colour}' stroke-width='2'{dash}/>");
    }

    fn horizontal(&mut self, v: f64, label: &str) {
        let (y, x0, x1) = (self.y(v), self.pad, self.width - self.pad);
        let _ = writeln!(
            self.body,
            "<line x1='{x0}' y1='{y:.1}' x2='{x1}' y2='{y:.1}' stroke='#999' stroke-dasharray='4 4'/>\
             <text x='{:.1}' y='{:.1}' fill='#666' text-anchor='end'>{label}</text>",
            x1,
            y - 4.0
        );
    }

    fn dot(&mut self, x: f64, y: f64, colour: &str, title: &str) {
        let _ = writeln!(
            self.body,
            "<circle cx='{:.1}' cy='{:.1}' r='4' fill='{colour}' fill-opacity='0.7'><title>{title}</title></circle>",
            self.x(x),
            self.y(y)
        );
    }

    /// The next legend line, below the frame (out of the lines' way).
    fn legend(&mut self, colour: &str, text: &str) {
        let y = self.height + 4.0 + LEGEND_LINE * self.legend as f64;
        let _ = writeln!(self.body, "<text x='{:.1}' y='{y:.1}' fill='{colour}'>{text}</text>", self.pad);
        self.legend += 1;
    }

    fn finish(self) -> String {
        let height = self.height + LEGEND_LINE * self.legend as f64 + 8.0;
        format!(
            "<svg xmlns='http://www.w3.org/2000/svg' width='{}' height='{height}' font-family='sans-serif' font-size='12'>\n{}</svg>\n",
            self.width, self.body
        )
    }
}

/// An axis label: whole numbers and large ones without decimals, others with two.
fn number(v: f64) -> String {
    if v.fract() == 0.0 || v.abs() >= 10.0 { format!("{v:.0}") } else { format!("{v:.2}") }
}

fn worker_steps(run: &Run) -> Vec<(f64, f64)> {
    run.trace.iter().map(|&(t, n, _)| (t, f64::from(n))).collect()
}

/// Our policy and Cachew's rule on one trainer (over `config.windows` windows): workers over
/// time until both have settled.
pub fn convergence_svg(trainer: &Trainer, config: &SimConfig) -> String {
    let runs: Vec<(Contender, Run)> = [Contender::Ours, Contender::Cachew]
        .into_iter()
        .map(|c| (c, c.simulate(trainer, config, 1, Until::Windows(config.windows))))
        .collect();
    let settled = runs.iter().map(|r| r.1.time_to_converge()).fold(0.0, f64::max);
    let most = runs.iter().map(|r| r.1.most_workers).max().unwrap_or(1).max(trainer.analytic_optimum());
    let opt = f64::from(trainer.analytic_optimum());
    let title = format!(
        "Workers over time: optimum {opt}, trainer {:.0} ms/batch, worker {:.1} batches/s",
        trainer.compute * 1e3,
        trainer.rate
    );
    let mut chart = Chart::new(&title, (0.0, (settled * 1.4).max(60.0)), (0.0, f64::from(most + 1)), "s", "workers");
    chart.horizontal(opt, "optimum");
    for (c, run) in &runs {
        chart.steps(1.0, &worker_steps(run), colour(*c), false);
        let text =
            format!("{}: {} decisions, converged at {:.0} s", c.name(), run.decisions.len(), run.time_to_converge());
        chart.legend(colour(*c), &text);
    }
    chart.finish()
}

/// Every contender on one scenario: workers over the first `seconds` of training, with each
/// one's training time and cost for the whole run in the legend.
pub fn workers_svg(scenario: &Scenario, config: &SimConfig, seconds: f64) -> String {
    let contest = super::compare::contest(scenario, config);
    let opt = optimum(&scenario.trainer, config);
    let most = contest.runs.iter().map(|r| r.1.most_workers).max().unwrap_or(1);
    let title = format!("Workers over time, {} (the first {:.0} min of the run)", scenario.name, seconds / 60.0);
    let mut chart = Chart::new(&title, (0.0, seconds), (0.0, f64::from(most + 1)), "s", "workers");
    chart.horizontal(f64::from(opt), "optimum");
    for (c, run) in &contest.runs {
        let start = f64::from(c.start(config.limits, opt));
        chart.steps(start, &worker_steps(run), colour(*c), matches!(c, Contender::Fixed { .. }));
        let text = format!(
            "{}: time {:.3}x best, cost {:.2}x hand-sized",
            c.name(),
            contest.slowdown(run),
            contest.relative_cost(run)
        );
        chart.legend(colour(*c), &text);
    }
    chart.finish()
}

/// Each contender on each scenario: training time over the best achievable against cost over
/// the pool hand-sized at the optimum. Points beyond the frame sit on its edge.
/// `frame`: the largest time ratio, and the cost ratios shown.
pub fn cost_svg(contests: &[Contest], config: &SimConfig, frame: (f64, f64, f64)) -> String {
    let title = "Each policy on each scenario: cost against training time (beyond the frame: on its edge)";
    let mut chart =
        Chart::new(title, (1.0, frame.0), (frame.1, frame.2), "x the best time", "x the hand-sized pool's cost");
    chart.horizontal(1.0, "the pool hand-sized at the optimum");
    let fast = chart.x(super::compare::FAST_ENOUGH);
    let (top, bottom) = (chart.y(frame.2), chart.y(frame.1));
    let _ = writeln!(
        chart.body,
        "<line x1='{fast:.1}' y1='{top:.1}' x2='{fast:.1}' y2='{bottom:.1}' stroke='#999' stroke-dasharray='4 4'/>\
         <text x='{:.1}' y='{:.1}' fill='#666'>5% slower</text>",
        fast + 4.0,
        top + 12.0
    );
    for c in Contender::all(config) {
        for contest in contests {
            let run = contest.run(c);
            let title = format!("{}: {}", c.name(), contest.scenario.name);
            chart.dot(contest.slowdown(run), contest.relative_cost(run), colour(c), &title);
        }
        chart.legend(colour(c), &c.name());
    }
    chart.finish()
}
