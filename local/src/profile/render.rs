//! The plan as `stoker profile` prints it.

use std::fmt::Write as _;

use stoker_api::SampleProfile;
use stoker_operator::autocache::Choice;

use super::plan::{CacheWhatIf, Plan};

pub fn text(name: &str, sample: &SampleProfile, plan: &Plan) -> String {
    let mut out = String::new();
    let threads = if plan.threads == 1 { "1 thread".to_string() } else { format!("{} threads", plan.threads) };
    let cores = |n: u32| if n == 1 { "1 core".to_string() } else { format!("{n} cores") };
    let _ = writeln!(
        out,
        "Profiled {name} on {} records ({} of {} splits) as one worker of {threads}: {:.0} elements/s on {:.2} cores;\n\
         held to {}, {:.0} elements/s a worker (the rate planned with).\n",
        sample.records,
        sample.splits_sampled,
        sample.splits,
        plan.unheld_rate,
        plan.cores_used,
        cores(plan.threads),
        plan.rate_per_worker
    );
    let _ = writeln!(out, "  #  op                    time  µs/element  bytes out/element  out/in");
    for (op, bytes) in plan.profile.ops.iter().zip(&plan.bytes_per_element) {
        let _ = writeln!(
            out,
            "{:>3}  {:<20} {:>5.0}%  {:>10}  {:>17}  {:>6}",
            op.index,
            op.op,
            op.share * (1.0 - plan.outside_ops_share) * 100.0,
            op.micros_per_element.map_or("-".into(), |m| format!("{m}")),
            bytes.map_or("-".into(), size),
            op.out_per_in.map_or("-".into(), |r| format!("{r:.2}")),
        );
    }
    let _ = writeln!(
        out,
        "     {:<20} {:>5.0}%  (waiting for reads, parsing, shuffling, batching)",
        "outside the ops",
        plan.outside_ops_share * 100.0,
    );
    let _ = writeln!(
        out,
        "Read {} a record ({}/s); batches {} a row; an epoch is about {:.0} rows.",
        size(plan.read_bytes_per_record),
        size(plan.read_bytes_per_second),
        size(plan.batch_bytes_per_row),
        plan.epoch_rows
    );
    if let Some(d) = &plan.profile.dominant {
        let _ = writeln!(out, "Dominant op: {d}.");
    }
    if let (Some(target), Some(w)) = (plan.target_rate, plan.workers) {
        let _ = writeln!(
            out,
            "\nTarget {target:.0} elements/s: {} worker(s) of {threads} ({:.0} elements/s predicted).",
            w.needed, w.predicted_rate
        );
        if let Some(max) = w.capped_at {
            let _ = writeln!(
                out,
                "  spec.workers.max is {max}: at most {:.0} elements/s; raise it, or make a worker faster (below).",
                f64::from(max) * plan.rate_per_worker
            );
        }
    }
    if let Some(step) = &plan.step {
        let _ = writeln!(
            out,
            "\nWhat if: the training step is {:.1} ms with infinite preprocessing (a batch of {} each step).",
            step.compute_ms, step.batch_size
        );
        let _ = writeln!(out, "  workers  elements/s  step ms  waiting for data");
        for at in &step.at {
            let label = match (at.workers == step.now, at.workers == step.needed) {
                (true, true) => "  (now; the target's)",
                (true, false) => "  (now)",
                (false, true) => "  (the target's)",
                (false, false) => "",
            };
            let _ = writeln!(
                out,
                "  {:>7}  {:>10.0}  {:>7.1}  {:>15.0}%{label}",
                at.workers,
                at.rate,
                at.step_ms,
                at.stall * 100.0
            );
        }
    }
    match &plan.cache {
        Some(cache) if cache.hints.is_empty() => {
            let _ = writeln!(out, "\nAutocache: nothing to decide, the pipeline has no `autocache` hint.");
        }
        Some(cache) => cache_verdict(&mut out, cache),
        None => {}
    }
    if !plan.advice.is_empty() {
        let _ = writeln!(out);
        for line in &plan.advice {
            let _ = writeln!(out, "- {line}");
        }
    }
    out
}

fn cache_verdict(out: &mut String, cache: &CacheWhatIf) {
    let d = &cache.decision;
    let verdict = match d.choice {
        Choice::Compute => "compute".to_string(),
        Choice::Put { at } => format!("cache at transforms[{at}]"),
    };
    let _ = writeln!(out, "\nAutocache at {} worker(s), cache volume probed: {verdict}: {}.", cache.workers, d.reason);
    for h in &cache.hints {
        let _ = writeln!(
            out,
            "  at transforms[{}]: {} an element, {} an epoch; reading it skips {:.0}% of the ops' time.",
            h.at,
            size(h.bytes_per_element),
            size(h.epoch_bytes),
            h.saves_share * 100.0
        );
    }
}

/// Bytes with a unit.
fn size(bytes: f64) -> String {
    match bytes {
        b if b >= 1e9 => format!("{:.1} GB", b / 1e9),
        b if b >= 1e6 => format!("{:.1} MB", b / 1e6),
        b if b >= 1e3 => format!("{:.1} kB", b / 1e3),
        b => format!("{b:.0} B"),
    }
}
