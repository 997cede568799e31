//! Checks the schema cannot express. Every message names the field and says what to change.

use std::fmt;

use crate::{
    AutoscalingMode, CacheMode, DataPipelineSpec, Source, Transform, WORKER_CACHE_VOLUME, WORKER_TMP_VOLUME,
    WORKER_TOKEN_VOLUME, Workers,
};

/// Source schemes the workers can read through object_store.
pub const SOURCE_SCHEMES: &[&str] = &["file", "s3", "gs", "az", "abfs", "abfss"];

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub struct ValidationError {
    /// Path of the offending field, e.g. `spec.workers.min`.
    pub field: String,
    pub message: String,
}

impl fmt::Display for ValidationError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.field, self.message)
    }
}

/// The message users see for an invalid spec: every problem, one per clause.
pub fn invalid_message(errors: &[ValidationError]) -> String {
    errors.iter().map(ToString::to_string).collect::<Vec<_>>().join("; ")
}

/// User volumes go beside the operator's: their names and mount paths must not collide, and a
/// mount must name a volume, or the Deployment would be refused on every apply.
fn validate_volumes(w: &Workers, err: &mut impl FnMut(&str, String)) {
    let ours = [WORKER_TMP_VOLUME, WORKER_CACHE_VOLUME, WORKER_TOKEN_VOLUME, crate::tls::WORKER_TLS_VOLUME];
    let volumes = w.volumes.as_deref().unwrap_or_default();
    for (i, v) in volumes.iter().enumerate() {
        let field = format!("spec.workers.volumes[{i}].name");
        if ours.iter().any(|(name, _)| *name == v.name) {
            err(&field, format!("{:?} is the name of a volume the operator adds; choose another", v.name));
        } else if volumes[..i].iter().any(|u| u.name == v.name) {
            err(&field, format!("{:?} is used by an earlier volume; names must be unique", v.name));
        }
    }
    for (i, m) in w.volume_mounts.iter().flatten().enumerate() {
        if !volumes.iter().any(|v| v.name == m.name) {
            err(
                &format!("spec.workers.volumeMounts[{i}].name"),
                format!("no volume named {:?} in spec.workers.volumes", m.name),
            );
        }
        let path = m.mount_path.trim_end_matches('/');
        if let Some((_, taken)) = ours.iter().find(|(_, p)| path == *p || path.starts_with(&format!("{p}/"))) {
            err(
                &format!("spec.workers.volumeMounts[{i}].mountPath"),
                format!(
                    "{:?} is at or under {taken}, where the operator mounts its own volume; mount elsewhere",
                    m.mount_path
                ),
            );
        }
    }
}

/// A source URI's scheme must be one object_store reads, and it must name a bucket or path.
pub(crate) fn validate_uri(field: &str, uri: &str, err: &mut impl FnMut(&str, String)) {
    match uri.split_once("://") {
        Some((scheme, rest)) if SOURCE_SCHEMES.contains(&scheme) => {
            if rest.trim_matches('/').is_empty() {
                err(field, format!("{uri:?} names no bucket or path"));
            }
        }
        Some((scheme, _)) => err(
            field,
            format!(
                "unknown scheme {scheme:?}; use one of {}",
                SOURCE_SCHEMES.iter().map(|s| format!("{s}://")).collect::<Vec<_>>().join(", ")
            ),
        ),
        None => err(field, format!("{uri:?} has no scheme; write e.g. s3://bucket/prefix or file:///data")),
    }
}

/// One source in `uri`, or a mix of distinct sources with positive weights.
fn validate_sources(source: &Source, err: &mut impl FnMut(&str, String)) {
    match (source.uri.is_empty(), source.mix.is_empty()) {
        (false, true) => validate_uri("spec.source.uri", &source.uri, err),
        (true, true) => err("spec.source.uri", "is empty; name the data, or several sources in spec.source.mix".into()),
        (false, false) => err("spec.source", "has both uri and mix; put every source in mix, or use uri alone".into()),
        (true, false) => {
            if source.mix.len() > crate::bounds::MAX_MIXED_SOURCES {
                err(
                    "spec.source.mix",
                    format!(
                        "names {} sources; at most {} may be mixed",
                        source.mix.len(),
                        crate::bounds::MAX_MIXED_SOURCES
                    ),
                );
            }
            for (i, m) in source.mix.iter().enumerate() {
                validate_uri(&format!("spec.source.mix[{i}].uri"), &m.uri, err);
                if !(m.weight.is_finite() && m.weight > 0.0) {
                    err(&format!("spec.source.mix[{i}].weight"), format!("{} is not a positive number", m.weight));
                }
                if source.mix[..i].iter().any(|earlier| earlier.uri == m.uri) {
                    err(&format!("spec.source.mix[{i}].uri"), format!("{:?} is mixed twice; list it once", m.uri));
                }
            }
        }
    }
    if !source.columns.is_empty() && source.format != crate::SourceFormat::Parquet {
        err("spec.source.columns", format!("only a parquet source has columns; this one is {:?}", source.format));
    }
    for (i, column) in source.columns.iter().enumerate() {
        if column.is_empty() {
            err(&format!("spec.source.columns[{i}]"), "is empty; name a column of the files".into());
        } else if source.columns[..i].contains(column) {
            err(&format!("spec.source.columns[{i}]"), format!("{column:?} is named twice; list it once"));
        }
    }
}

/// All problems of a spec at once, so a user fixes them in one round.
/// The largest batch: a batch's header lists each row's origin and must fit in one message.
pub const MAX_BATCH_SIZE: u32 = 65536;

pub fn validate(spec: &DataPipelineSpec) -> Result<(), Vec<ValidationError>> {
    let mut errors = Vec::new();
    let mut err = |field: &str, message: String| {
        errors.push(ValidationError { field: field.to_string(), message });
    };

    validate_sources(&spec.data_plane.source, &mut err);

    // Also enforced by the CRD schema; checked here for pipelines that never pass an API server
    // (standalone workers, `stoker check`).
    if !(1..=MAX_BATCH_SIZE).contains(&spec.data_plane.batch_size) {
        err("spec.batchSize", format!("must be between 1 and {MAX_BATCH_SIZE}"));
    }
    if spec.data_plane.shuffle.as_ref().is_some_and(|s| s.buffer_size == 0) {
        err("spec.shuffle.bufferSize", "must be at least 1".into());
    }
    let mut jagged = std::collections::BTreeSet::new();
    for (i, field) in spec.data_plane.jagged.iter().enumerate() {
        if field.is_empty() {
            err(&format!("spec.jagged[{i}]"), "is empty; name a list field of the batch".into());
        } else if !jagged.insert(field) {
            err(&format!("spec.jagged[{i}]"), format!("{field:?} is named twice"));
        }
    }
    let w = &spec.workers;
    if w.min < 0 || w.max < 1 {
        err("spec.workers", format!("need min >= 0 and max >= 1, got min {} and max {}", w.min, w.max));
    }
    if w.min > w.max {
        err("spec.workers", format!("min ({}) is greater than max ({}); set min <= max", w.min, w.max));
    }

    validate_volumes(w, &mut err);

    match (spec.autoscaling.mode, spec.autoscaling.replicas) {
        (AutoscalingMode::Fixed, None) => err("spec.autoscaling.replicas", "mode Fixed needs replicas".into()),
        (AutoscalingMode::Fixed, Some(r)) if r < w.min || r > w.max => {
            err("spec.autoscaling.replicas", format!("{r} is outside spec.workers [min {}, max {}]", w.min, w.max))
        }
        (AutoscalingMode::BatchTime, Some(_)) => {
            err("spec.autoscaling.replicas", "replicas applies only to mode Fixed; remove it or set mode: Fixed".into())
        }
        _ => {}
    }

    let mut first_random: Option<(usize, &str)> = None;
    let mut echo_at: Option<usize> = None;
    let mut hints = 0;
    for (i, t) in spec.data_plane.transforms.iter().enumerate() {
        let field = format!("spec.transforms[{i}].{}", t.name());
        match t {
            Transform::Autocache(_) => {
                hints += 1;
                if spec.data_plane.source.mix.len() > 1 {
                    err(
                        &field,
                        "cannot be used with spec.source.mix yet: the cache keeps a split's elements \
                         by split, and each epoch of a mix reads other splits of its sources. Remove the hint"
                            .into(),
                    );
                }
                if let Some(j) = echo_at {
                    err(
                        &field,
                        format!(
                            "comes after echo at spec.transforms[{j}]; a cache there would hold \
                             every copy. Move the hint before spec.transforms[{j}]"
                        ),
                    );
                }
                if let Some((j, name)) = first_random {
                    err(
                        &field,
                        format!(
                            "comes after the random op {name} at spec.transforms[{j}]; a cache there \
                             would replay one augmentation every epoch. Move the hint before spec.transforms[{j}]"
                        ),
                    );
                }
            }
            Transform::DecodeImage(d) if ![1, 3, 4].contains(&d.channels) => {
                err(&field, format!("channels must be 1, 3 or 4, not {}", d.channels))
            }
            Transform::Resize(r) => match (r.size, r.shorter_side) {
                (Some(_), Some(_)) | (None, None) => err(&field, "set exactly one of size and shorterSide".into()),
                (Some(s), _) if s.contains(&0) => err(&field, "size must be positive".into()),
                _ => {}
            },
            Transform::CenterCrop(c) if c.size.contains(&0) => err(&field, "size must be positive".into()),
            Transform::RandomResizedCrop(c) => {
                if c.size.contains(&0) {
                    err(&field, "size must be positive".into());
                }
                let [lo, hi] = c.scale;
                if !(0.0 < lo && lo <= hi && hi <= 1.0) {
                    err(&field, format!("scale [{lo}, {hi}] must satisfy 0 < low <= high <= 1"));
                }
                let [lo, hi] = c.ratio;
                if !(0.0 < lo && lo <= hi) {
                    err(&field, format!("ratio [{lo}, {hi}] must satisfy 0 < low <= high"));
                }
            }
            Transform::Normalize(n) => {
                if n.mean.len() != n.std.len() {
                    err(
                        &field,
                        format!("mean has {} values and std {}; give one per channel", n.mean.len(), n.std.len()),
                    );
                }
                if n.std.iter().any(|s| *s <= 0.0) {
                    err(&field, "every std value must be > 0".into());
                }
                if n.dtype == crate::DType::Bytes {
                    err(&field, "dtype bytes is text; normalize outputs numbers (float32, float16, ...)".into());
                }
            }
            Transform::Python(p) => {
                let dotted = |name: &str| {
                    !name.is_empty()
                        && name.split('.').all(|part| {
                            part.chars().next().is_some_and(|c| c.is_alphabetic() || c == '_')
                                && part.chars().all(|c| c.is_alphanumeric() || c == '_')
                        })
                };
                if !dotted(&p.module) {
                    err(
                        &field,
                        format!("module {:?} is not a Python module name (like `augment` or `pkg.mod`)", p.module),
                    );
                }
                if !dotted(&p.function) || p.function.contains('.') {
                    err(&field, format!("function {:?} is not a Python identifier", p.function));
                }
                if p.path.as_deref().is_some_and(|path| !path.starts_with('/')) {
                    err(&field, "path must be absolute (where the code is mounted in the workers)".into());
                }
                if p.batch.is_some_and(|n| !(1..=crate::bounds::MAX_PYTHON_BATCH).contains(&n)) {
                    err(&field, format!("batch must be 1 to {}", crate::bounds::MAX_PYTHON_BATCH));
                }
                if !(1..=3600).contains(&p.timeout_seconds) {
                    err(&field, format!("timeoutSeconds {} is outside 1..=3600", p.timeout_seconds));
                }
                if !(64..=65536).contains(&p.memory_limit_mib) {
                    err(&field, format!("memoryLimitMib {} is outside 64..=65536", p.memory_limit_mib));
                }
            }
            Transform::Tokenize(t) => {
                if t.tokenizer.contains("://") {
                    validate_uri(&format!("{field}.tokenizer"), &t.tokenizer, &mut err);
                } else if !t.tokenizer.starts_with('/') {
                    err(
                        &field,
                        "tokenizer must be an absolute path in the workers (where the tokenizer.json is mounted) \
                         or an object's URI (s3://bucket/tokenizer.json)"
                            .into(),
                    );
                }
                if t.max_length == Some(0) {
                    err(&field, "maxLength must be at least 1".into());
                }
            }
            Transform::Pack(p) => {
                if i + 1 != spec.data_plane.transforms.len() {
                    err(&field, "pack must be the last transform: it makes rows out of whole splits".into());
                }
                if !(1..=1 << 20).contains(&p.length) {
                    err(&field, format!("length {} is outside 1..=1048576", p.length));
                }
            }
            Transform::Echo(e) => {
                if let Some(j) = echo_at {
                    err(
                        &field,
                        format!(
                            "a second echo (the first is spec.transforms[{j}]); use one, with their factors multiplied"
                        ),
                    );
                }
                echo_at = Some(i);
                match (e.factor, e.max_factor) {
                    (Some(f), None) if !(1..=255).contains(&f) => err(&field, format!("factor {f} is outside 1..=255")),
                    (None, Some(m)) if !(2..=255).contains(&m) => {
                        err(&field, format!("maxFactor {m} is outside 2..=255"))
                    }
                    (Some(_), Some(_)) => err(
                        &field,
                        "give factor (a fixed echo) or maxFactor (the operator sets the factor), not both".into(),
                    ),
                    (None, None) => {
                        err(&field, "give factor (a fixed echo) or maxFactor (the operator sets the factor)".into())
                    }
                    _ => {}
                }
            }
            Transform::RenameFields(r) if r.mapping.is_empty() => {
                err(&field, "mapping is empty; name at least one field to rename".into())
            }
            feature if feature.is_feature() => crate::features::validate(spec, feature, &field, &mut err),
            _ => {}
        }
        if t.is_random() && first_random.is_none() {
            first_random = Some((i, t.name()));
        }
    }

    crate::bounds::check(&spec.data_plane, &mut err);

    if spec.cache.mode == CacheMode::Always && hints == 0 {
        err(
            "spec.cache.mode",
            "Always caches at the last autocache hint, and spec.transforms has none; add `- autocache: {}`".into(),
        );
    }

    if errors.is_empty() { Ok(()) } else { Err(errors) }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(yaml: &str) -> DataPipelineSpec {
        crate::from_yaml(yaml).expect("test spec parses")
    }

    const BASE: &str = "source: {uri: 's3://bucket/train/', format: imageFolder}\nbatchSize: 32\n";

    fn errors(extra: &str) -> Vec<ValidationError> {
        validate(&spec(&format!("{BASE}{extra}"))).expect_err("spec should be invalid")
    }

    #[test]
    fn minimal_spec_is_valid_and_defaulted() {
        let s = spec(BASE);
        assert_eq!(validate(&s), Ok(()));
        assert_eq!((s.workers.min, s.workers.max), (1, 8));
        assert_eq!(s.autoscaling.mode, AutoscalingMode::BatchTime);
        assert_eq!(s.cache.mode, CacheMode::Never);
    }

    #[test]
    fn worker_volumes_must_not_collide_with_the_operators() {
        let data = "workers:\n  volumes: [{name: data, persistentVolumeClaim: {claimName: corpus, readOnly: true}}]\n  \
                    volumeMounts: [{name: data, mountPath: /data, readOnly: true}]\n";
        assert_eq!(validate(&spec(&format!("{BASE}{data}"))), Ok(()));
        let e = errors(
            "workers:\n  volumes: [{name: tmp, emptyDir: {}}, {name: d, emptyDir: {}}, {name: d, emptyDir: {}}]\n  \
             volumeMounts: [{name: data, mountPath: /data}, {name: d, mountPath: /cache/sub/}, {name: d, mountPath: /tmpfiles}]\n",
        );
        let fields: Vec<&str> = e.iter().map(|e| e.field.as_str()).collect();
        assert_eq!(
            fields,
            [
                "spec.workers.volumes[0].name",
                "spec.workers.volumes[2].name",
                "spec.workers.volumeMounts[0].name",
                "spec.workers.volumeMounts[1].mountPath"
            ],
            "{e:?}"
        );
        assert!(e[0].message.contains("the operator adds") && e[3].message.contains("under /cache"), "{e:?}");
    }

    #[test]
    fn jagged_fields_are_named_once_each() {
        assert_eq!(validate(&spec(&format!("{BASE}jagged: [ids, tags]\n"))), Ok(()));
        let e = errors("jagged: [ids, '', ids]\n");
        let fields: Vec<&str> = e.iter().map(|e| e.field.as_str()).collect();
        assert_eq!(fields, ["spec.jagged[1]", "spec.jagged[2]"], "{e:?}");
        assert!(e[1].message.contains("\"ids\" is named twice"), "{e:?}");
    }

    #[test]
    fn min_above_max_is_refused() {
        let e = errors("workers: {min: 5, max: 2}\n");
        assert_eq!(e[0].field, "spec.workers");
        assert!(e[0].message.contains("min (5) is greater than max (2)"), "{e:?}");
    }

    #[test]
    fn a_mix_needs_distinct_valid_sources_with_positive_weights() {
        let mix = |entries: &str| spec(&format!("source:\n  format: jsonl\n  mix: [{entries}]\nbatchSize: 8\n"));
        let good = mix("{uri: 's3://c/web/', weight: 0.7}, {uri: 's3://c/code/', weight: 0.3}");
        assert_eq!(validate(&good), Ok(()));
        let e = validate(&mix(
            "{uri: 's3://c/web/', weight: 0}, {uri: 'ftp://x/y', weight: 1}, {uri: 's3://c/web/', weight: 1}",
        ))
        .unwrap_err();
        let fields: Vec<&str> = e.iter().map(|e| e.field.as_str()).collect();
        assert_eq!(fields, ["spec.source.mix[0].weight", "spec.source.mix[1].uri", "spec.source.mix[2].uri"], "{e:?}");
        assert!(e[2].message.contains("mixed twice"), "{e:?}");
        let both = spec(
            "source: {uri: 's3://c/web/', format: jsonl, mix: [{uri: 's3://c/code/', weight: 1}]}\nbatchSize: 8\n",
        );
        assert!(validate(&both).unwrap_err()[0].message.contains("both uri and mix"));
        let neither = spec("source: {format: jsonl}\nbatchSize: 8\n");
        assert!(validate(&neither).unwrap_err()[0].message.contains("spec.source.mix"));
        let cached = spec(
            "source:\n  format: jsonl\n  mix: [{uri: 's3://c/a/', weight: 1}, {uri: 's3://c/b/', weight: 1}]\n\
             batchSize: 8\ntransforms: [{autocache: {}}]\n",
        );
        let e = validate(&cached).unwrap_err();
        assert!(e[0].field == "spec.transforms[0].autocache" && e[0].message.contains("spec.source.mix"), "{e:?}");
        assert_eq!(good.data_plane.source.describe(), "s3://c/web/, s3://c/code/");
    }

    #[test]
    fn columns_belong_to_parquet_sources_each_named_once() {
        let good = spec("source: {uri: 's3://c/t/', format: parquet, columns: [a, b]}\nbatchSize: 1\n");
        assert!(validate(&good).is_ok());
        let jsonl = spec("source: {uri: 's3://c/t/', format: jsonl, columns: [a]}\nbatchSize: 1\n");
        let e = validate(&jsonl).unwrap_err();
        assert!(e[0].field == "spec.source.columns" && e[0].message.contains("only a parquet source"), "{e:?}");
        let twice = spec("source: {uri: 's3://c/t/', format: parquet, columns: [a, '', a]}\nbatchSize: 1\n");
        let e = validate(&twice).unwrap_err();
        assert_eq!(
            e.iter().map(|e| e.field.as_str()).collect::<Vec<_>>(),
            ["spec.source.columns[1]", "spec.source.columns[2]"]
        );
    }

    #[test]
    fn unknown_scheme_names_the_known_ones() {
        let s = spec("source: {uri: 'ftp://host/x', format: jsonl}\nbatchSize: 1\n");
        let e = validate(&s).unwrap_err();
        assert!(e[0].message.contains("unknown scheme \"ftp\""), "{e:?}");
        assert!(e[0].message.contains("s3://"), "{e:?}");
    }

    #[test]
    fn uri_without_scheme_or_path_is_refused() {
        let s = spec("source: {uri: '/data/train', format: jsonl}\nbatchSize: 1\n");
        assert!(validate(&s).unwrap_err()[0].message.contains("no scheme"));
        let s = spec("source: {uri: 's3://', format: jsonl}\nbatchSize: 1\n");
        assert!(validate(&s).unwrap_err()[0].message.contains("no bucket"));
    }

    #[test]
    fn autocache_after_random_op_is_refused_before_is_fine() {
        let ok = "transforms:\n- decodeImage: {}\n- autocache: {}\n- randomFlip: {}\n";
        assert_eq!(validate(&spec(&format!("{BASE}{ok}"))), Ok(()));
        let e = errors("transforms:\n- decodeImage: {}\n- randomFlip: {}\n- autocache: {}\n");
        assert_eq!(e.len(), 1);
        assert_eq!(e[0].field, "spec.transforms[2].autocache");
        assert!(e[0].message.contains("random op randomFlip at spec.transforms[1]"), "{e:?}");
    }

    #[test]
    fn echo_takes_one_place_a_factor_in_range_and_no_hint_after_it() {
        let ok = "transforms:\n- decodeImage: {}\n- autocache: {}\n- echo: {factor: 3}\n- randomFlip: {}\n";
        assert_eq!(validate(&spec(&format!("{BASE}{ok}"))), Ok(()));
        let e = errors("transforms:\n- echo: {factor: 0}\n- autocache: {}\n- echo: {factor: 2}\n");
        let text = format!("{e:?}");
        for part in ["factor 0 is outside 1..=255", "comes after echo at spec.transforms[0]", "a second echo"] {
            assert!(text.contains(part), "{part:?} not in {text}");
        }
        assert_eq!(e.len(), 3, "{e:?}");
        let auto = "transforms:\n- decodeImage: {}\n- echo: {maxFactor: 4}\n";
        assert_eq!(validate(&spec(&format!("{BASE}{auto}"))), Ok(()));
        for (echo, says) in [
            ("{maxFactor: 1}", "maxFactor 1 is outside 2..=255"),
            ("{factor: 2, maxFactor: 4}", "not both"),
            ("{}", "give factor"),
        ] {
            let e = errors(&format!("transforms:\n- echo: {echo}\n"));
            assert!(e.len() == 1 && e[0].message.contains(says), "{echo}: {e:?}");
        }
    }

    #[test]
    fn a_python_op_is_random_unless_declared_deterministic() {
        let det = "transforms:\n- python: {module: aug, function: f, deterministic: true}\n- autocache: {}\n";
        assert_eq!(validate(&spec(&format!("{BASE}{det}"))), Ok(()));
        let e = errors("transforms:\n- python: {module: aug, function: f}\n- autocache: {}\n");
        assert_eq!(e.len(), 1, "{e:?}");
        assert!(e[0].message.contains("random op python at spec.transforms[0]"), "{e:?}");
    }

    #[test]
    fn python_names_paths_and_limits_are_checked() {
        let e = errors(
            "transforms:\n- python: {module: 'my-mod', function: 'a.b', path: rel/dir, timeoutSeconds: 0, memoryLimitMib: 1, batch: 0}\n",
        );
        let text = format!("{e:?}");
        for part in [
            "not a Python module name",
            "not a Python identifier",
            "path must be absolute",
            "timeoutSeconds 0",
            "memoryLimitMib 1",
            "batch must be 1 to 4096",
        ] {
            assert!(text.contains(part), "{part:?} not in {text}");
        }
        let ok = "transforms:\n- python: {module: pkg.aug_2, function: _f, path: /etc/code, batch: 64}\n";
        assert_eq!(validate(&spec(&format!("{BASE}{ok}"))), Ok(()));
    }

    #[test]
    fn a_tokenizer_is_an_absolute_path_or_an_objects_uri() {
        for ok in ["/models/t.json", "s3://models/llama/tokenizer.json", "file:///data/tokenizer.json"] {
            let spec = spec(&format!("{BASE}transforms:\n- tokenize: {{tokenizer: '{ok}'}}\n"));
            assert_eq!(validate(&spec), Ok(()), "{ok}");
        }
        let e = errors("transforms:\n- tokenize: {tokenizer: models/t.json}\n");
        assert!(e[0].message.contains("absolute path") && e[0].message.contains("URI"), "{e:?}");
        let e = errors("transforms:\n- tokenize: {tokenizer: 'ftp://host/t.json'}\n");
        assert_eq!(e[0].field, "spec.transforms[0].tokenize.tokenizer", "{e:?}");
    }

    #[test]
    fn pack_comes_last() {
        let ok = "transforms:\n- tokenize: {tokenizer: /t.json}\n- pack: {length: 2048, separator: 2}\n";
        assert_eq!(validate(&spec(&format!("{BASE}{ok}"))), Ok(()));
        let e = errors("transforms:\n- pack: {length: 8}\n- autocache: {}\n");
        assert!(e[0].message.contains("pack must be the last transform"), "{e:?}");
    }

    #[test]
    fn fixed_needs_replicas_within_bounds() {
        assert!(errors("autoscaling: {mode: Fixed}\n")[0].message.contains("needs replicas"));
        assert!(errors("autoscaling: {mode: Fixed, replicas: 9}\n")[0].message.contains("outside"));
        assert!(errors("autoscaling: {replicas: 2}\n")[0].message.contains("only to mode Fixed"));
        let ok = format!("{BASE}autoscaling: {{mode: Fixed, replicas: 3}}\n");
        assert_eq!(validate(&spec(&ok)), Ok(()));
    }

    #[test]
    fn op_parameters_are_checked() {
        let e = errors(
            "transforms:\n- resize: {}\n- normalize: {mean: [0.5, 0.5], std: [0.1]}\n- randomResizedCrop: {size: [224, 224], scale: [0.9, 0.1]}\n- decodeImage: {channels: 2}\n",
        );
        let fields: Vec<_> = e.iter().map(|e| e.field.as_str()).collect();
        assert_eq!(
            fields,
            [
                "spec.transforms[0].resize",
                "spec.transforms[1].normalize",
                "spec.transforms[2].randomResizedCrop",
                "spec.transforms[3].decodeImage"
            ]
        );
    }

    #[test]
    fn schema_ranges_are_checked_without_an_api_server() {
        let huge = spec("source: {uri: 'file:///d', format: jsonl}\nbatchSize: 65537\n");
        assert_eq!(validate(&huge).unwrap_err()[0].field, "spec.batchSize");
        let s = spec("source: {uri: 'file:///d', format: jsonl}\nbatchSize: 0\nshuffle: {bufferSize: 0}\n");
        let fields: Vec<_> = validate(&s).unwrap_err().into_iter().map(|e| e.field).collect();
        assert_eq!(fields, ["spec.batchSize", "spec.shuffle.bufferSize"]);
    }

    #[test]
    fn cache_always_needs_a_hint() {
        let e = errors("cache: {mode: Always}\n");
        assert_eq!(e[0].field, "spec.cache.mode");
    }

    #[test]
    fn transform_items_are_one_key_objects() {
        let s = spec(&format!("{BASE}transforms:\n- autocache: {{}}\n- randomFlip: {{vertical: true}}\n"));
        assert_eq!(s.data_plane.transforms[0], Transform::Autocache(Default::default()));
        let Transform::RandomFlip(f) = &s.data_plane.transforms[1] else { panic!("randomFlip") };
        assert!(f.horizontal && f.vertical && f.field == "image");
        let two_keys = format!("{BASE}transforms:\n- {{autocache: {{}}, randomFlip: {{}}}}\n");
        assert!(crate::from_yaml::<DataPipelineSpec>(&two_keys).is_err());
    }
}
