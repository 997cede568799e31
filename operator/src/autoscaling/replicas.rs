//! How many workers a pipeline runs: the count its spec fixes, or the autoscaler's decision,
//! within the spec's bounds. The controller applies it, the scaling loop starts from it.

use stoker_api::{AutoscalingMode, DataPipeline, DataPipelineSpec};

/// Worker count to run before the autoscaler has an opinion.
pub fn initial_replicas(spec: &DataPipelineSpec) -> i32 {
    match spec.autoscaling.mode {
        AutoscalingMode::Fixed => spec.autoscaling.replicas.unwrap_or(spec.workers.min),
        AutoscalingMode::BatchTime => spec.workers.min,
    }
}

/// Worker count to run now: Fixed runs `replicas`; BatchTime runs what the autoscaler decided,
/// else what the status last recorded (a new leader continues where the old one was), else
/// min. Always within [min, max], so a spec change of the bounds takes effect at once.
pub fn desired_replicas(spec: &DataPipelineSpec, recorded: Option<i32>, decided: Option<u32>) -> i32 {
    match spec.autoscaling.mode {
        AutoscalingMode::Fixed => initial_replicas(spec),
        AutoscalingMode::BatchTime => {
            let want = decided.map(|n| n.min(i32::MAX as u32) as i32).or(recorded).unwrap_or(spec.workers.min);
            want.clamp(spec.workers.min, spec.workers.max.max(spec.workers.min))
        }
    }
}

/// `desired_replicas` of a pipeline as the API server has it (its status records the last
/// count applied).
pub fn replicas_of(dp: &DataPipeline, decided: Option<u32>) -> i32 {
    let recorded = dp.status.as_ref().and_then(|s| s.workers.as_ref()).map(|w| w.desired);
    desired_replicas(&dp.spec, recorded, decided)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(yaml: &str) -> DataPipelineSpec {
        stoker_api::from_yaml(&format!("source: {{uri: 's3://b/train/', format: imageFolder}}\nbatchSize: 8\n{yaml}"))
            .unwrap()
    }

    #[test]
    fn desired_replicas_follow_the_autoscaler_within_bounds() {
        let p = spec("workers: {min: 2, max: 6}\n");
        assert_eq!(desired_replicas(&p, None, None), 2, "min before anything is known");
        assert_eq!(desired_replicas(&p, Some(4), None), 4, "a new leader keeps the recorded count");
        assert_eq!(desired_replicas(&p, Some(4), Some(5)), 5, "the decision wins");
        assert_eq!(desired_replicas(&p, None, Some(50)), 6, "capped at max");
        assert_eq!(desired_replicas(&p, Some(1), None), 2, "raised to min");
        let fixed = spec("autoscaling: {mode: Fixed, replicas: 3}\nworkers: {min: 1, max: 4}\n");
        assert_eq!(desired_replicas(&fixed, Some(1), Some(4)), 3, "Fixed ignores the autoscaler");
    }

    #[test]
    fn initial_replicas_follow_the_mode() {
        assert_eq!(initial_replicas(&spec("workers: {min: 2, max: 4}\n")), 2);
        let fixed = spec("autoscaling: {mode: Fixed, replicas: 3}\nworkers: {min: 1, max: 4}\n");
        assert_eq!(initial_replicas(&fixed), 3);
    }
}
