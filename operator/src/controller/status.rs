//! The status step's pure half: what the status should say, given what reconcile found.

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use stoker_api::{
    AutoscalerStatus, AutoscalingMode, CacheDecision, CacheMode, CacheStatus, DataPipelineSpec, DataPipelineStatus,
    DataWaitStatus, DeliveryStatus, JobStatus, MixStatus, Phase, ProfileStatus, ValidationError, WorkersReport,
    WorkersStatus, condition, invalid_message,
};

use crate::autoscaling::ScalingRecord;
use crate::autoscaling::policy::PolicyState;

/// What the reconcile of one generation came to.
#[derive(Clone, Debug, PartialEq)]
pub enum Outcome {
    /// The spec cannot run; nothing was applied.
    Invalid(Vec<ValidationError>),
    /// Objects are applied; `ready` of `desired` workers are ready.
    Applied { desired: i32, ready: i32 },
    /// Applying failed; the message says why.
    Failed(String),
}

/// What the operator knows about a pipeline beyond its object: the autoscaler's record and the
/// dispatcher's cache plan, delivery counters and consumers' waits (None: nothing yet, e.g. a
/// new leader).
#[derive(Clone, Copy, Default)]
pub struct Observed<'a> {
    pub scaling: Option<&'a ScalingRecord>,
    pub cache: Option<&'a CacheStatus>,
    pub delivery: Option<&'a DeliveryStatus>,
    /// How long its consumers waited for data (None: no window reported to this leader yet).
    pub data_wait: Option<&'a DataWaitStatus>,
    /// The workers' warnings and mix shares (None: no worker has reported to this leader yet).
    pub workers: Option<&'a WorkersReport>,
    /// The jobs with live clients (None: this leader's dispatcher does not know the pipeline yet).
    pub jobs: Option<&'a [JobStatus]>,
}

pub fn next(
    spec: &DataPipelineSpec,
    generation: Option<i64>,
    previous: Option<&DataPipelineStatus>,
    outcome: &Outcome,
    observed: &Observed,
    now: &Time,
) -> DataPipelineStatus {
    let Observed { scaling, cache, delivery, data_wait, workers: report, jobs } = *observed;
    let previous = previous.cloned().unwrap_or_default();
    let (phase, ready, progressing, degraded) = match outcome {
        Outcome::Invalid(errors) => {
            let msg = invalid_message(errors);
            (
                Phase::Invalid,
                cond(condition::READY, false, "InvalidSpec", &msg),
                cond(
                    condition::PROGRESSING,
                    false,
                    "InvalidSpec",
                    "Fix the spec; until then nothing new is applied and workers of an earlier valid spec keep running",
                ),
                cond(condition::DEGRADED, false, "InvalidSpec", "The spec was refused before anything ran"),
            )
        }
        Outcome::Failed(msg) => (
            Phase::Degraded,
            cond(condition::READY, false, "ApplyFailed", msg),
            cond(condition::PROGRESSING, true, "Retrying", "Retrying with backoff"),
            cond(condition::DEGRADED, true, "ApplyFailed", msg),
        ),
        Outcome::Applied { desired, ready } => {
            let all_ready = ready >= desired;
            let summary = format!("{ready}/{desired} workers ready");
            let running = match scaling {
                Some(r) if r.attached && r.converged => Phase::Converged,
                Some(r) if r.attached => Phase::Scaling,
                _ => Phase::Idle,
            };
            (
                if all_ready { running } else { Phase::Pending },
                if all_ready {
                    cond(condition::READY, true, "WorkersReady", &summary)
                } else {
                    cond(condition::READY, false, "WorkersNotReady", &summary)
                },
                if all_ready {
                    cond(condition::PROGRESSING, false, "Stable", &summary)
                } else {
                    cond(condition::PROGRESSING, true, "WorkersStarting", &summary)
                },
                cond(condition::DEGRADED, false, "AsExpected", "Objects are applied"),
            )
        }
    };

    let workers = match outcome {
        Outcome::Applied { desired, ready } => Some(WorkersStatus::new(*desired, *ready)),
        _ => previous.workers.clone(),
    };
    let conditions = [ready, progressing, degraded]
        .into_iter()
        .map(|c| keep_transition_time(c, &previous.conditions, generation, now))
        .collect();

    DataPipelineStatus {
        phase: Some(phase),
        workers,
        batch_time_ms: scaling.and_then(|r| r.batch_time_ms).or(previous.batch_time_ms),
        autoscaler: Some(match (spec.autoscaling.mode, scaling) {
            // A fixed count has nothing to search for.
            (AutoscalingMode::Fixed, _) => AutoscalerStatus { converged: true, ..Default::default() },
            (AutoscalingMode::BatchTime, Some(r)) => AutoscalerStatus {
                converged: r.converged,
                state: r.state.map(|s| s.name().to_string()),
                held_back_by_budget: r.held_back,
                retry: r.retry.clone(),
                echo: r.echo.clone(),
                history: r.history.clone(),
            },
            // A new leader has decided nothing yet: keep what the last one recorded. The very
            // first status says what the autoscaler's first round will (no client yet), so
            // that round does not write again.
            (AutoscalingMode::BatchTime, None) => previous.autoscaler.unwrap_or_else(|| AutoscalerStatus {
                state: Some(PolicyState::Idle.name().into()),
                ..Default::default()
            }),
        }),
        cache: Some(match (spec.cache.mode, cache, previous.cache) {
            (CacheMode::Never, _, _) => CacheStatus { decision: CacheDecision::Compute, ..Default::default() },
            (_, Some(plan), _) => plan.clone(),
            // No worker has registered with this leader yet: keep what the last one showed.
            (_, None, Some(cache)) if cache.decision != CacheDecision::Compute || cache.at.is_some() => cache,
            _ => CacheStatus::default(),
        }),
        // A new leader's dispatcher has counted nothing yet: keep what the last one showed.
        delivery: delivery.cloned().or(previous.delivery),
        data_wait: data_wait.cloned().or(previous.data_wait),
        jobs: jobs.map_or(previous.jobs, <[JobStatus]>::to_vec),
        // Likewise: a new leader keeps the last warnings and shares until a worker reports.
        warnings: report.map_or(previous.warnings, |w| w.warnings.clone()),
        mix: mix(spec, report, &previous.mix),
        profile: profile(spec, report, previous.profile),
        conditions,
        observed_generation: generation,
    }
}

/// Each mixed source's normalised weight beside its realised share: the workers' if they
/// counted any element, else the last status's.
fn mix(spec: &DataPipelineSpec, workers: Option<&WorkersReport>, previous: &[MixStatus]) -> Vec<MixStatus> {
    let sources = &spec.data_plane.source.mix;
    let weights = spec.data_plane.source.weight_shares();
    let shares = workers.map(|w| w.source_shares.as_slice()).filter(|s| s.len() == sources.len());
    sources
        .iter()
        .enumerate()
        .map(|(i, m)| MixStatus {
            uri: m.uri.clone(),
            weight: (weights[i] * 1000.0).round() / 1000.0,
            realised: match shares {
                Some(shares) => Some(shares[i]),
                None => previous.iter().find(|p| p.uri == m.uri).and_then(|p| p.realised),
            },
        })
        .collect()
}

/// The workers' profile once they ran an op; until then (a new leader, workers restarting) the
/// last status's.
fn profile(
    spec: &DataPipelineSpec,
    workers: Option<&WorkersReport>,
    previous: Option<ProfileStatus>,
) -> Option<ProfileStatus> {
    let transforms = &spec.data_plane.transforms;
    match workers.filter(|w| w.ops.iter().any(|op| op.seconds > 0.0)) {
        Some(w) => {
            let dominant = previous.as_ref().and_then(|p| p.dominant.as_ref());
            Some(ProfileStatus::of(transforms, &w.ops, dominant))
        }
        None => previous.filter(|_| !transforms.is_empty()),
    }
}

/// The event's note when the profile names another op dominant than before (or one for the
/// first time).
pub fn dominant_changed(before: Option<&ProfileStatus>, now: Option<&ProfileStatus>) -> Option<String> {
    let now = now?;
    let dominant = now.dominant.as_ref()?;
    let was = before.and_then(|b| b.dominant.as_ref());
    if was == Some(dominant) {
        return None;
    }
    let share = now.dominant_share().unwrap_or_default();
    let cost = now.ops.get(dominant.index as usize).and_then(|o| o.micros_per_element);
    let cost = cost.map(|us| format!(", {us} us per element")).unwrap_or_default();
    Some(match was {
        Some(was) => format!("{dominant} now takes {:.0}% of the workers' time{cost} (before: {was})", share * 100.0),
        None => format!("{dominant} takes {:.0}% of the workers' time{cost}", share * 100.0),
    })
}

fn cond(type_: &str, status: bool, reason: &str, message: &str) -> Condition {
    Condition {
        type_: type_.into(),
        status: if status { "True" } else { "False" }.into(),
        reason: reason.into(),
        message: message.into(),
        last_transition_time: Time(Default::default()),
        observed_generation: None,
    }
}

/// lastTransitionTime moves only when the condition's status flips.
fn keep_transition_time(mut c: Condition, previous: &[Condition], generation: Option<i64>, now: &Time) -> Condition {
    c.observed_generation = generation;
    c.last_transition_time = match previous.iter().find(|p| p.type_ == c.type_) {
        Some(p) if p.status == c.status => p.last_transition_time.clone(),
        _ => now.clone(),
    };
    c
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::jiff::Timestamp;

    fn spec(extra: &str) -> DataPipelineSpec {
        stoker_api::from_yaml(&format!("source: {{uri: 'file:///d', format: jsonl}}\nbatchSize: 4\n{extra}")).unwrap()
    }

    fn at(secs: i64) -> Time {
        Time(Timestamp::from_second(secs).unwrap())
    }

    fn get<'a>(s: &'a DataPipelineStatus, t: &str) -> &'a Condition {
        s.conditions.iter().find(|c| c.type_ == t).unwrap()
    }

    #[test]
    fn pending_until_workers_are_ready_then_idle() {
        let s = spec("");
        let pending =
            next(&s, Some(1), None, &Outcome::Applied { desired: 2, ready: 1 }, &Observed::default(), &at(10));
        assert_eq!(pending.phase, Some(Phase::Pending));
        assert_eq!(pending.workers.as_ref().unwrap().summary, "1/2");
        assert_eq!(get(&pending, condition::READY).status, "False");
        assert_eq!(get(&pending, condition::PROGRESSING).status, "True");
        let idle = next(
            &s,
            Some(1),
            Some(&pending),
            &Outcome::Applied { desired: 2, ready: 2 },
            &Observed::default(),
            &at(20),
        );
        assert_eq!(idle.phase, Some(Phase::Idle));
        assert_eq!(get(&idle, condition::READY).reason, "WorkersReady");
        assert_eq!(get(&idle, condition::READY).last_transition_time, at(20));
        assert_eq!(get(&idle, condition::DEGRADED).last_transition_time, at(10), "unchanged condition keeps its time");
        assert_eq!(idle.observed_generation, Some(1));
    }

    #[test]
    fn same_input_gives_identical_status() {
        let s = spec("");
        let first = next(&s, Some(3), None, &Outcome::Applied { desired: 1, ready: 0 }, &Observed::default(), &at(1));
        let again =
            next(&s, Some(3), Some(&first), &Outcome::Applied { desired: 1, ready: 0 }, &Observed::default(), &at(99));
        assert_eq!(first, again, "a resync must not produce a status write");
    }

    #[test]
    fn invalid_lists_every_problem() {
        let errors = vec![
            ValidationError { field: "spec.workers".into(), message: "min (5) is greater than max (2)".into() },
            ValidationError { field: "spec.source.uri".into(), message: "unknown scheme".into() },
        ];
        let st = next(&spec(""), Some(2), None, &Outcome::Invalid(errors), &Observed::default(), &at(1));
        assert_eq!(st.phase, Some(Phase::Invalid));
        let ready = get(&st, condition::READY);
        assert_eq!(ready.reason, "InvalidSpec");
        assert_eq!(ready.message, "spec.workers: min (5) is greater than max (2); spec.source.uri: unknown scheme");
    }

    #[test]
    fn apply_failure_is_degraded_and_keeps_worker_counts() {
        let s = spec("");
        let ok = next(&s, Some(1), None, &Outcome::Applied { desired: 1, ready: 1 }, &Observed::default(), &at(1));
        let failed =
            next(&s, Some(2), Some(&ok), &Outcome::Failed("quota exceeded".into()), &Observed::default(), &at(2));
        assert_eq!(failed.phase, Some(Phase::Degraded));
        assert_eq!(get(&failed, condition::DEGRADED).message, "quota exceeded");
        assert_eq!(failed.workers, ok.workers);
    }

    #[test]
    fn cache_decision_reflects_the_mode() {
        let off = next(&spec(""), None, None, &Outcome::Applied { desired: 1, ready: 0 }, &Observed::default(), &at(1));
        assert_eq!(off.cache.unwrap().decision, CacheDecision::Compute);
        let auto = next(
            &spec("cache: {mode: Auto}\n"),
            None,
            None,
            &Outcome::Applied { desired: 1, ready: 0 },
            &Observed::default(),
            &at(1),
        );
        assert_eq!(auto.cache.unwrap().decision, CacheDecision::Undecided);
    }

    #[test]
    fn fixed_mode_is_converged_batch_time_is_not() {
        let fixed = spec("autoscaling: {mode: Fixed, replicas: 1}\n");
        let st = next(&fixed, None, None, &Outcome::Applied { desired: 1, ready: 0 }, &Observed::default(), &at(1));
        assert!(st.autoscaler.unwrap().converged);
        let st = next(&spec(""), None, None, &Outcome::Applied { desired: 1, ready: 0 }, &Observed::default(), &at(1));
        assert!(!st.autoscaler.unwrap().converged);
    }

    #[test]
    fn the_autoscalers_first_round_writes_no_new_status() {
        // A restart or a start must not cost a second write when no client is attached yet.
        let s = spec("");
        let first = next(&s, Some(1), None, &Outcome::Applied { desired: 1, ready: 0 }, &Observed::default(), &at(1));
        let idle = ScalingRecord { workers: 1, state: Some(PolicyState::Idle), ..Default::default() };
        let after_round = next(
            &s,
            Some(1),
            Some(&first),
            &Outcome::Applied { desired: 1, ready: 0 },
            &Observed { scaling: Some(&idle), ..Observed::default() },
            &at(2),
        );
        assert_eq!(first, after_round);
    }

    #[test]
    fn warnings_come_from_the_workers_and_survive_a_new_leader() {
        let s = spec("");
        let applied = Outcome::Applied { desired: 1, ready: 1 };
        let capped = vec!["shuffle buffer capped at 29 elements".to_string()];
        let report = WorkersReport { warnings: capped.clone(), ..WorkersReport::default() };
        let observed = Observed { workers: Some(&report), ..Observed::default() };
        let warned = next(&s, Some(1), None, &applied, &observed, &at(1));
        assert_eq!(warned.warnings, capped);
        // A new leader whose dispatcher has heard from no worker yet keeps them.
        let new_leader = next(&s, Some(1), Some(&warned), &applied, &Observed::default(), &at(2));
        assert_eq!(new_leader.warnings, capped);
        // Workers that report none clear them.
        let none = WorkersReport::default();
        let cleared = Observed { workers: Some(&none), ..Observed::default() };
        assert!(next(&s, Some(1), Some(&warned), &applied, &cleared, &at(3)).warnings.is_empty());
    }

    #[test]
    fn the_consumers_wait_for_data_is_shown_and_survives_a_new_leader() {
        let s = spec("");
        let applied = Outcome::Applied { desired: 1, ready: 1 };
        let wait = DataWaitStatus { fraction: 0.25, waiting_seconds: 3.0, total_seconds: 12.0 };
        let observed = Observed { data_wait: Some(&wait), ..Observed::default() };
        let shown = next(&s, Some(1), None, &applied, &observed, &at(1));
        assert_eq!(shown.data_wait.as_ref(), Some(&wait));
        let yaml = serde_json::to_value(&shown).unwrap();
        assert_eq!(yaml["dataWait"]["waitingSeconds"], 3.0, "{yaml}");
        // A new leader that has had no window yet keeps the last figures.
        let new_leader = next(&s, Some(1), Some(&shown), &applied, &Observed::default(), &at(2));
        assert_eq!(new_leader.data_wait, Some(wait));
    }

    #[test]
    fn the_jobs_reading_are_listed_and_a_job_that_left_is_not() {
        let s = spec("");
        let applied = Outcome::Applied { desired: 1, ready: 1 };
        let job = |name: &str| JobStatus {
            name: name.into(),
            share: Some("sweep".into()),
            consumers: 2,
            ..JobStatus::default()
        };
        let two = [job("trial-0"), job("trial-1")];
        let shown = next(&s, Some(1), None, &applied, &Observed { jobs: Some(&two), ..Observed::default() }, &at(1));
        let yaml = serde_json::to_value(&shown).unwrap();
        assert_eq!(yaml["jobs"][1]["name"], "trial-1", "{yaml}");
        assert_eq!(yaml["jobs"][1]["share"], "sweep", "{yaml}");
        // A new leader's dispatcher that does not know the pipeline yet keeps the list...
        let new_leader = next(&s, Some(1), Some(&shown), &applied, &Observed::default(), &at(2));
        assert_eq!(new_leader.jobs, two);
        // ... and one that does shows what reads now.
        let one = [job("trial-1")];
        let later =
            next(&s, Some(1), Some(&shown), &applied, &Observed { jobs: Some(&one), ..Observed::default() }, &at(3));
        assert_eq!(later.jobs, one);
    }

    #[test]
    fn a_mix_reports_each_sources_weight_beside_its_realised_share() {
        let mut s = spec("");
        s.data_plane.source = stoker_api::from_yaml::<DataPipelineSpec>(
            "source:\n  format: jsonl\n  mix: [{uri: 's3://c/web/', weight: 7}, {uri: 's3://c/code/', weight: 3}]\nbatchSize: 1\n",
        )
        .unwrap()
        .data_plane
        .source;
        let applied = Outcome::Applied { desired: 1, ready: 1 };
        let before = next(&s, Some(1), None, &applied, &Observed::default(), &at(1));
        let weights: Vec<(f64, Option<f64>)> = before.mix.iter().map(|m| (m.weight, m.realised)).collect();
        assert_eq!(weights, [(0.7, None), (0.3, None)], "weights normalised; nothing realised yet");
        let report = WorkersReport { source_shares: vec![0.688, 0.312], ..WorkersReport::default() };
        let counted =
            next(&s, Some(1), None, &applied, &Observed { workers: Some(&report), ..Observed::default() }, &at(2));
        assert_eq!(counted.mix[0].uri, "s3://c/web/");
        assert_eq!(counted.mix.iter().map(|m| m.realised).collect::<Vec<_>>(), [Some(0.688), Some(0.312)]);
        // A new leader that has heard from no worker keeps the shares.
        let new_leader = next(&s, Some(1), Some(&counted), &applied, &Observed::default(), &at(3));
        assert_eq!(new_leader.mix, counted.mix);
        assert!(
            next(&spec(""), Some(1), None, &applied, &Observed::default(), &at(1)).mix.is_empty(),
            "no mix, no entries"
        );
    }

    #[test]
    fn the_profile_follows_the_workers_and_an_event_names_a_new_dominant_op() {
        let s = spec("transforms:\n- cast: {field: a, dtype: float32}\n- filter: {field: a, op: ge, value: '0'}\n");
        let applied = Outcome::Applied { desired: 1, ready: 1 };
        let report = |cast: f64, filter: f64| WorkersReport {
            ops: vec![
                stoker_api::OpTotals { seconds: cast, elements_in: 1000, elements_out: 1000 },
                stoker_api::OpTotals { seconds: filter, elements_in: 1000, elements_out: 250 },
            ],
            ..WorkersReport::default()
        };
        fn observed(r: &WorkersReport) -> Observed<'_> {
            Observed { workers: Some(r), ..Observed::default() }
        }
        let first = next(&s, Some(1), None, &applied, &observed(&report(3.0, 1.0)), &at(1));
        let profile = first.profile.as_ref().unwrap();
        assert_eq!(profile.ops.iter().map(|o| o.share).collect::<Vec<_>>(), [0.75, 0.25]);
        assert_eq!(profile.ops[1].out_per_in, Some(0.25));
        assert_eq!(
            dominant_changed(None, first.profile.as_ref()).as_deref(),
            Some("transforms[0].cast takes 75% of the workers' time, 3000 us per element")
        );
        // Shares move, the dominant op stays: no event.
        let second = next(&s, Some(1), Some(&first), &applied, &observed(&report(3.0, 2.0)), &at(2));
        assert_eq!(dominant_changed(first.profile.as_ref(), second.profile.as_ref()), None);
        // The filter overtakes it by more than the margin.
        let third = next(&s, Some(1), Some(&second), &applied, &observed(&report(3.0, 4.0)), &at(3));
        let note = dominant_changed(second.profile.as_ref(), third.profile.as_ref()).unwrap();
        assert!(note.starts_with("transforms[1].filter now takes 57%"), "{note}");
        assert!(note.ends_with("(before: transforms[0].cast)"), "{note}");
        // A new leader, or workers that restarted and ran nothing yet, keep the last profile.
        let kept = next(&s, Some(1), Some(&third), &applied, &observed(&report(0.0, 0.0)), &at(4));
        assert_eq!(kept.profile, third.profile);
        assert_eq!(next(&s, Some(1), Some(&third), &applied, &Observed::default(), &at(4)).profile, third.profile);
    }
}
