//! A pipeline's profile: where its workers' time goes, op by op. The operator writes it into
//! `status.profile` from the live workers' per-op tallies (their heartbeats), and `stoker
//! profile` prints it from a run on the local machine; both compute it here.

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::Transform;

/// A challenger must take this much more of the workers' time than the op named dominant
/// before it is named instead, so two ops of about equal cost do not swap at every heartbeat.
pub const DOMINANT_MARGIN: f64 = 0.05;

/// Until some op was given this many elements the shares are too young to name a dominant op.
pub const DOMINANT_MIN_ELEMENTS: u64 = 1000;

/// What one op did, summed over workers: its thread time and the elements into and out of it.
#[derive(Deserialize, Serialize, Clone, Copy, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct OpTotals {
    pub seconds: f64,
    pub elements_in: u64,
    pub elements_out: u64,
}

impl OpTotals {
    /// Adds `other` into `into` index by index, growing `into` to fit.
    pub fn add_into(into: &mut Vec<OpTotals>, other: &[OpTotals]) {
        if into.len() < other.len() {
            into.resize(other.len(), OpTotals::default());
        }
        for (total, t) in into.iter_mut().zip(other) {
            total.seconds += t.seconds;
            // Saturating: the counts are the workers' word.
            total.elements_in = total.elements_in.saturating_add(t.elements_in);
            total.elements_out = total.elements_out.saturating_add(t.elements_out);
        }
    }
}

#[derive(Deserialize, Serialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ProfileStatus {
    /// Thread seconds the live workers spent in the ops since they started (rounded to 0.1 s).
    pub worker_seconds: f64,
    /// The op taking the largest share of the workers' time; another op replaces it only when
    /// its share is larger by 0.05. Absent until an op was given 1000 elements.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dominant: Option<DominantOp>,
    /// Each transform, in spec order.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub ops: Vec<OpProfile>,
}

#[derive(Deserialize, Serialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct DominantOp {
    /// Its index in spec.transforms.
    pub index: u32,
    pub op: String,
}

#[derive(Deserialize, Serialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct OpProfile {
    /// Its index in spec.transforms.
    pub index: u32,
    pub op: String,
    /// Its thread time over all the ops' (0 to 1, rounded to 0.01). Ops folded into the one
    /// before them (a randomFlip or normalize written by the randomResizedCrop's resize) count
    /// in that op.
    pub share: f64,
    /// Thread microseconds per element it was given (two significant digits); absent until it
    /// was given one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub micros_per_element: Option<f64>,
    /// Elements it passed on per element it was given (rounded to 0.01): below 1 after a filter
    /// or failures, the factor after `echo`, packed rows per text after `pack`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub out_per_in: Option<f64>,
}

/// What `stoker-worker profile` measured running a pipeline on a sample of its data, on this
/// machine, as one worker of `threads` threads (its JSON output, which `stoker profile` reads).
#[derive(Deserialize, Serialize, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct SampleProfile {
    pub threads: u32,
    /// Splits in an epoch, and those the timed run produced.
    pub splits: u64,
    pub splits_sampled: u64,
    /// Records read and rows batched by the timed run (rows differ after a filter, `echo` or
    /// `pack`), in `wall_seconds` from its first read to its last batch.
    pub records: u64,
    pub rows: u64,
    pub wall_seconds: f64,
    /// The worker process's CPU time in the timed run, all its threads (reading, parsing and
    /// batching run beside the transform threads).
    pub cpu_seconds: f64,
    /// Bytes read from the source.
    pub read_bytes: u64,
    /// Bytes of the batches' tensors.
    pub batch_bytes: u64,
    /// Records and elements skipped as corrupt or failed (`onError: skip`).
    pub skipped: u64,
    /// What the worker warns about running the pipeline (a shuffle buffer capped by the
    /// memory budget, ...), as its status would show it.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub warnings: Vec<String>,
    /// Each transform, in spec order.
    pub ops: Vec<SampledOp>,
    /// The cache volume's sequential throughput, when a directory was given to probe.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cache_volume: Option<VolumeThroughput>,
    /// For a `decodeImage` followed by a `randomResizedCrop`: the two on the sample's JPEGs as
    /// they are and rewritten with restart markers.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub restart_markers: Option<RestartMarkersWhatIf>,
}

#[derive(Deserialize, Serialize, Clone, Copy, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct SampledOp {
    #[serde(flatten)]
    pub totals: OpTotals,
    /// Mean bytes of an element leaving the op, measured on a part of the sample run op by op:
    /// its encoded size on the row path, its columns' Arrow bytes on the columnar path; absent
    /// at a batched `python` op and `echo`, which run on whole chunks.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bytes_per_element: Option<f64>,
}

#[derive(Deserialize, Serialize, Clone, Copy, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct VolumeThroughput {
    pub write_bytes_per_second: f64,
    pub read_bytes_per_second: f64,
}

#[derive(Deserialize, Serialize, Clone, Copy, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct RestartMarkersWhatIf {
    /// The index of the `decodeImage`.
    pub decode_index: u32,
    /// JPEGs timed, one thread, the best of the rounds for each side.
    pub images: u32,
    pub micros_as_they_are: f64,
    pub micros_with_markers: f64,
}

impl ProfileStatus {
    /// The profile of `transforms` from their totals (in the same order); `previous` names the
    /// dominant op until another takes [`DOMINANT_MARGIN`] more.
    pub fn of(transforms: &[Transform], totals: &[OpTotals], previous: Option<&DominantOp>) -> ProfileStatus {
        let total = |i: usize| totals.get(i).copied().unwrap_or_default();
        let seconds: f64 = (0..transforms.len()).map(|i| total(i).seconds.max(0.0)).sum();
        let share = |i: usize| if seconds > 0.0 { total(i).seconds.max(0.0) / seconds } else { 0.0 };
        let ops: Vec<OpProfile> = transforms
            .iter()
            .enumerate()
            .map(|(i, t)| {
                let tally = total(i);
                let given = (tally.elements_in > 0).then_some(tally.elements_in as f64);
                OpProfile {
                    index: i as u32,
                    op: t.name().into(),
                    share: round_to(share(i), 0.01),
                    micros_per_element: given.map(|n| significant(tally.seconds.max(0.0) * 1e6 / n, 2)),
                    out_per_in: given.map(|n| round_to(tally.elements_out as f64 / n, 0.01)),
                }
            })
            .collect();
        let given = (0..transforms.len()).map(|i| total(i).elements_in).max().unwrap_or(0);
        let dominant = (seconds > 0.0 && given >= DOMINANT_MIN_ELEMENTS).then(|| {
            let top = (0..transforms.len()).max_by(|&a, &b| share(a).total_cmp(&share(b)))?;
            let kept = previous
                .filter(|p| (p.index as usize) < transforms.len() && transforms[p.index as usize].name() == p.op)
                .filter(|p| share(top) - share(p.index as usize) < DOMINANT_MARGIN);
            Some(kept.cloned().unwrap_or_else(|| DominantOp { index: top as u32, op: transforms[top].name().into() }))
        });
        ProfileStatus { worker_seconds: round_to(seconds, 0.1), dominant: dominant.flatten(), ops }
    }

    /// The dominant op's share, for messages.
    pub fn dominant_share(&self) -> Option<f64> {
        let d = self.dominant.as_ref()?;
        self.ops.get(d.index as usize).map(|o| o.share)
    }
}

impl std::fmt::Display for DominantOp {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "transforms[{}].{}", self.index, self.op)
    }
}

/// `x` to a multiple of `step` (0.1, 0.01, ...), as the decimal a reader expects: dividing by
/// an integer rounds to the double nearest it.
fn round_to(x: f64, step: f64) -> f64 {
    let per = (1.0 / step).round();
    (x * per).round() / per
}

/// `x` to `digits` significant digits.
fn significant(x: f64, digits: i32) -> f64 {
    if x <= 0.0 || !x.is_finite() {
        return 0.0;
    }
    let scale = 10f64.powi(digits - 1 - x.log10().floor() as i32);
    (x * scale).round() / scale
}

#[cfg(test)]
mod tests {
    use super::*;

    fn transforms() -> Vec<Transform> {
        crate::from_yaml(
            "- decodeImage: {channels: 3}\n- randomResizedCrop: {size: [224, 224]}\n\
             - filter: {field: label, op: ge, value: '0'}",
        )
        .unwrap()
    }

    fn totals(seconds: [f64; 3]) -> Vec<OpTotals> {
        vec![
            OpTotals { seconds: seconds[0], elements_in: 1000, elements_out: 998 },
            OpTotals { seconds: seconds[1], elements_in: 998, elements_out: 998 },
            OpTotals { seconds: seconds[2], elements_in: 998, elements_out: 499 },
        ]
    }

    #[test]
    fn shares_costs_and_selectivity_per_op() {
        let p = ProfileStatus::of(&transforms(), &totals([6.0, 3.5, 0.5]), None);
        assert_eq!(p.worker_seconds, 10.0);
        let shares: Vec<f64> = p.ops.iter().map(|o| o.share).collect();
        assert_eq!(shares, [0.6, 0.35, 0.05]);
        assert_eq!(p.ops[0].micros_per_element, Some(6000.0));
        // 3.5 s over 998 elements: 3507 us, to two digits.
        assert_eq!(p.ops[1].micros_per_element, Some(3500.0));
        assert_eq!(p.ops[2].out_per_in, Some(0.5));
        assert_eq!(p.ops[0].out_per_in, Some(1.0));
        assert_eq!(p.dominant, Some(DominantOp { index: 0, op: "decodeImage".into() }));
        assert_eq!(p.dominant_share(), Some(0.6));
    }

    #[test]
    fn the_dominant_op_changes_only_by_a_margin() {
        let before = Some(DominantOp { index: 0, op: "decodeImage".into() });
        // The crop overtakes the decode by 0.04: not enough.
        let p = ProfileStatus::of(&transforms(), &totals([4.8, 5.2, 0.0]), before.as_ref());
        assert_eq!(p.dominant, before);
        // By 0.1: named.
        let p = ProfileStatus::of(&transforms(), &totals([4.5, 5.5, 0.0]), before.as_ref());
        assert_eq!(p.dominant, Some(DominantOp { index: 1, op: "randomResizedCrop".into() }));
        // A previous dominant that is no longer the op at its index (the spec changed) is
        // dropped at once.
        let stale = DominantOp { index: 2, op: "resize".into() };
        let p = ProfileStatus::of(&transforms(), &totals([4.8, 5.2, 0.0]), Some(&stale));
        assert_eq!(p.dominant.unwrap().index, 1);
    }

    #[test]
    fn nothing_is_named_before_a_thousand_elements_or_for_ops_never_given_one() {
        let mut young = totals([0.5, 0.3, 0.1]);
        young.iter_mut().for_each(|t| t.elements_in = 999);
        let p = ProfileStatus::of(&transforms(), &young, None);
        assert_eq!(p.dominant, None);
        assert_eq!(p.ops[0].share, 0.56, "shares are shown all the same");
        let p = ProfileStatus::of(&transforms(), &[], None);
        assert_eq!(p.ops.len(), 3);
        assert!(p.ops.iter().all(|o| o.share == 0.0 && o.micros_per_element.is_none()));
    }
}
