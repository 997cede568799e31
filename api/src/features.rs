//! Feature ops: the transforms of tabular and recommendation-model features (DLRM's
//! preprocessing and its kin). They run column at a time over a Parquet source's record
//! batches (see docs/transforms.md, "Feature ops"); each is deterministic, and each named
//! field is changed in place unless the op has an `output`.

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// Replaces nulls: in numeric columns with `value` (cast to the column's type, which it
/// keeps), in string columns with `text`. A null list becomes an empty list.
#[derive(Deserialize, Serialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct FillNull {
    #[schemars(length(min = 1))]
    pub fields: Vec<String>,
    /// What a null of a numeric column becomes (cast to the column's type: toward zero,
    /// saturating).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub value: Option<f64>,
    /// What a null of a string or binary column becomes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub text: Option<String>,
}

/// `ln(1 + max(x, 0))` as float32: DLRM's transform of its dense counts, negative values
/// (Criteo's -1 and -2) clamped to 0 first; NaN stays NaN.
#[derive(Deserialize, Serialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct Log1p {
    #[schemars(length(min = 1))]
    pub fields: Vec<String>,
}

/// Bounds numeric values to [min, max], keeping the column's type (integer columns take the
/// bounds rounded inwards).
#[derive(Deserialize, Serialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct Clip {
    #[schemars(length(min = 1))]
    pub fields: Vec<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub min: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max: Option<f64>,
}

/// `(x - mean) / std` as float32, with the mean and standard deviation given (computed over
/// the training set beforehand, as the model's serving side will use them).
#[derive(Deserialize, Serialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct Standardize {
    #[schemars(length(min = 1))]
    pub fields: Vec<String>,
    pub mean: f64,
    pub std: f64,
}

/// The bucket of each value as int64: the number of `boundaries` less than or equal to it, so
/// with boundaries [b0, b1, ...] a value below b0 is 0, one in [b0, b1) is 1, and so on
/// (`numpy.digitize(x, boundaries)`).
#[derive(Deserialize, Serialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct Bucketize {
    #[schemars(length(min = 1))]
    pub fields: Vec<String>,
    /// Strictly increasing.
    #[schemars(length(min = 1))]
    pub boundaries: Vec<f64>,
}

/// `xxh64(value) % buckets` as int64, xxh64 being XXH64 with seed 0 of the value's bytes: a
/// string's or binary's bytes as they are, an integer's (or boolean's) value as 8 bytes of a
/// little-endian int64. Part of the contract: the same value gives the same bucket in every
/// version. Lists hash element by element.
#[derive(Deserialize, Serialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct HashBucket {
    #[schemars(length(min = 1))]
    pub fields: Vec<String>,
    #[schemars(range(min = 1))]
    pub buckets: u64,
}

/// Strings or integers to ids from a file of one entry per line: an entry's id is its line's
/// index from 0 (the first of duplicates counts). Lists map element by element.
#[derive(Deserialize, Serialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct Vocabulary {
    #[schemars(length(min = 1))]
    pub fields: Vec<String>,
    /// Path of the file in the workers, or the URI of an object in a store the sources could
    /// be (read with spec.source's credentials once per worker).
    #[schemars(length(min = 1, max = 4096))]
    pub path: String,
    /// The id of a value the file lacks; unset, the number of entries (one past the last id).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub oov_id: Option<i64>,
}

/// Keeps the first (or last) `length` items of each list.
#[derive(Deserialize, Serialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct Truncate {
    #[schemars(length(min = 1))]
    pub fields: Vec<String>,
    #[schemars(range(min = 1))]
    pub length: u32,
    #[serde(default)]
    pub keep: Keep,
}

/// Which end of a list `truncate` keeps.
#[derive(Deserialize, Serialize, Clone, Copy, Debug, Default, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub enum Keep {
    #[default]
    First,
    Last,
}

/// A feature cross: `xxh64(h1 ‖ h2 ‖ ...) % buckets` into `output` as int64, where `hi` is
/// the xxh64 of the row's value of the i-th field (as `hashBucket` hashes it) written as 8
/// little-endian bytes. A null in any field makes the cross null. The fields are kept.
#[derive(Deserialize, Serialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct Cross {
    #[schemars(length(min = 2))]
    pub fields: Vec<String>,
    #[schemars(range(min = 1))]
    pub buckets: u64,
    #[schemars(length(min = 1))]
    pub output: String,
}

/// Numeric scalar fields, in the order named, into one float32 vector per row in `output`
/// (DLRM's dense features); the fields are removed. A null is an error: `fillNull` first.
#[derive(Deserialize, Serialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct Concat {
    #[schemars(length(min = 1))]
    pub fields: Vec<String>,
    #[schemars(length(min = 1))]
    pub output: String,
}

/// Most `boundaries` of a `bucketize`: each value is found among them by binary search, and a
/// model has no use for more buckets of one number than this.
pub const MAX_BOUNDARIES: usize = 65_536;

/// Checks a feature op of `spec` (at `at`, like `spec.transforms[3].log1p`), calling `err`
/// for every problem.
pub(crate) fn validate(
    spec: &crate::DataPipelineSpec,
    op: &crate::Transform,
    at: &str,
    err: &mut impl FnMut(&str, String),
) {
    use crate::Transform;
    let plane = &spec.data_plane;
    if plane.source.format != crate::SourceFormat::Parquet {
        err(
            at,
            format!(
                "feature ops run column at a time over a Parquet source (format: parquet); this source is {:?}",
                plane.source.format
            ),
        );
    }
    if let Some((j, other)) = plane.transforms.iter().enumerate().find(|(_, t)| !t.is_columnar()) {
        err(
            at,
            format!(
                "feature ops run in pipelines of feature ops, filter, selectFields and renameFields only; \
                 spec.transforms[{j}].{} is none of those",
                other.name()
            ),
        );
    }
    let fields = op.feature_fields();
    let inputs = match op {
        Transform::Cross(_) | Transform::Concat(_) => &fields[..fields.len() - 1],
        _ => &fields[..],
    };
    for (i, name) in inputs.iter().enumerate() {
        if name.is_empty() {
            err(&format!("{at}.fields[{i}]"), "is empty; name a field".into());
        } else if inputs[..i].contains(name) {
            err(&format!("{at}.fields[{i}]"), format!("{name:?} is named twice; name it once"));
        }
    }
    let finite = |name: &str, value: f64, err: &mut dyn FnMut(&str, String)| {
        if !value.is_finite() {
            err(&format!("{at}.{name}"), format!("{value} is not a finite number"));
        }
    };
    match op {
        Transform::FillNull(f) => {
            if f.value.is_none() && f.text.is_none() {
                err(at, "give value (for numeric fields), text (for string fields) or both".into());
            }
            if let Some(v) = f.value {
                finite("value", v, err);
            }
        }
        Transform::Clip(c) => {
            c.min.into_iter().for_each(|v| finite("min", v, err));
            c.max.into_iter().for_each(|v| finite("max", v, err));
            match (c.min, c.max) {
                (None, None) => err(at, "give min, max or both".into()),
                (Some(lo), Some(hi)) if lo > hi => err(at, format!("min {lo} is above max {hi}")),
                _ => {}
            }
        }
        Transform::Standardize(s) => {
            finite("mean", s.mean, err);
            if !(s.std.is_finite() && s.std > 0.0) {
                err(&format!("{at}.std"), format!("{} must be a finite number above 0", s.std));
            }
        }
        Transform::Bucketize(b) => {
            if b.boundaries.is_empty() || b.boundaries.len() > MAX_BOUNDARIES {
                err(&format!("{at}.boundaries"), format!("give 1 to {MAX_BOUNDARIES} boundaries"));
            } else if !b.boundaries.iter().all(|v| v.is_finite()) {
                err(&format!("{at}.boundaries"), "every boundary must be a finite number".into());
            } else if let Some(i) = b.boundaries.windows(2).position(|w| w[0] >= w[1]) {
                err(
                    &format!("{at}.boundaries"),
                    format!(
                        "must increase strictly; [{}] is {} and [{}] {}",
                        i,
                        b.boundaries[i],
                        i + 1,
                        b.boundaries[i + 1]
                    ),
                );
            }
        }
        Transform::HashBucket(HashBucket { buckets, .. }) | Transform::Cross(Cross { buckets, .. })
            if *buckets == 0 =>
        {
            err(&format!("{at}.buckets"), "must be at least 1".into())
        }
        Transform::Vocabulary(v) => {
            if v.path.contains("://") {
                crate::validate::validate_uri(&format!("{at}.path"), &v.path, err);
            } else if !v.path.starts_with('/') {
                err(
                    &format!("{at}.path"),
                    "must be an absolute path in the workers (where the file is mounted) or an object's URI".into(),
                );
            }
            if v.oov_id.is_some_and(|id| id < 0) {
                err(&format!("{at}.oovId"), "must be 0 or more".into());
            }
        }
        Transform::Truncate(t) if t.length == 0 => err(&format!("{at}.length"), "must be at least 1".into()),
        Transform::Cross(c) if c.fields.len() < 2 => err(&format!("{at}.fields"), "cross at least two fields".into()),
        Transform::Cross(Cross { output, .. }) | Transform::Concat(Concat { output, .. }) if output.is_empty() => {
            err(&format!("{at}.output"), "is empty; name the field to write".into())
        }
        _ => {}
    }
}

impl crate::DataPlaneSpec {
    /// The columns a Parquet source reads: `source.columns` when given, else those the ops
    /// need, found walking back from the last op, when a `selectFields` (or `pack`) bounds
    /// what reaches the batch. None: every column.
    pub fn columns_read(&self) -> Option<Vec<String>> {
        use crate::Transform;
        if !self.source.columns.is_empty() {
            return Some(self.source.columns.clone());
        }
        let mut needed: Option<std::collections::BTreeSet<&str>> = None;
        for op in self.transforms.iter().rev() {
            match (op, needed.as_mut()) {
                (Transform::SelectFields(s), _) => needed = Some(s.fields.iter().map(String::as_str).collect()),
                (Transform::Pack(p), _) => needed = Some([p.field.as_str()].into()),
                (_, None) => {}
                (Transform::RenameFields(r), Some(n)) => {
                    for (from, to) in &r.mapping {
                        if n.remove(to.as_str()) {
                            n.insert(from);
                        }
                    }
                }
                (Transform::Filter(f), Some(n)) => {
                    n.insert(&f.field);
                }
                (Transform::Tokenize(t), Some(n)) => {
                    n.remove(t.output.as_str());
                    n.insert(&t.field);
                }
                (Transform::Cross(_) | Transform::Concat(_), Some(n)) => {
                    let fields = op.feature_fields();
                    let (output, inputs) = fields.split_last().expect("an output");
                    n.remove(output);
                    n.extend(inputs);
                }
                (feature, Some(n)) if feature.is_feature() => n.extend(feature.feature_fields()),
                (Transform::Autocache(_) | Transform::Echo(_), Some(_)) => {}
                // What any other op reads is not known here (a python op's code is opaque).
                (_, Some(_)) => needed = None,
            }
        }
        needed.map(|n| n.into_iter().map(str::to_string).collect())
    }
}

#[cfg(test)]
mod tests {
    use crate::{DataPipelineSpec, from_yaml, validate};

    fn spec(source: &str, transforms: &str) -> DataPipelineSpec {
        from_yaml(&format!("source: {{uri: 's3://b/t/', format: {source}}}\nbatchSize: 8\ntransforms:\n{transforms}"))
            .unwrap()
    }

    fn errors(source: &str, transforms: &str) -> Vec<(String, String)> {
        match validate(&spec(source, transforms)) {
            Ok(()) => Vec::new(),
            Err(e) => e.into_iter().map(|e| (e.field, e.message)).collect(),
        }
    }

    #[test]
    fn feature_ops_need_a_parquet_source_and_a_columnar_pipeline() {
        assert_eq!(errors("parquet", "- log1p: {fields: [a]}\n- filter: {field: a, op: gt, value: '0'}"), []);
        let e = errors("jsonl", "- log1p: {fields: [a]}");
        assert!(e[0].1.contains("over a Parquet source"), "{e:?}");
        let e = errors("parquet", "- log1p: {fields: [a]}\n- cast: {field: a, dtype: float16}");
        assert!(e[0].0 == "spec.transforms[0].log1p" && e[0].1.contains("spec.transforms[1].cast is none"), "{e:?}");
    }

    #[test]
    fn parameters_that_cannot_work_are_refused_naming_them() {
        let cases = [
            ("- fillNull: {fields: [a]}", "spec.transforms[0].fillNull", "give value"),
            ("- fillNull: {fields: [a, a], value: 0}", "spec.transforms[0].fillNull.fields[1]", "named twice"),
            ("- clip: {fields: [a], min: 2, max: 1}", "spec.transforms[0].clip", "above max"),
            ("- standardize: {fields: [a], mean: 0, std: 0}", "spec.transforms[0].standardize.std", "above 0"),
            ("- bucketize: {fields: [a], boundaries: [1, 1]}", "spec.transforms[0].bucketize.boundaries", "strictly"),
            ("- vocabulary: {fields: [a], path: vocab.txt}", "spec.transforms[0].vocabulary.path", "absolute"),
            ("- vocabulary: {fields: [a], path: /v, oovId: -1}", "spec.transforms[0].vocabulary.oovId", "0 or more"),
            ("- cross: {fields: [a, b], buckets: 5, output: ''}", "spec.transforms[0].cross.output", "is empty"),
        ];
        for (transforms, field, message) in cases {
            let e = errors("parquet", transforms);
            assert!(e.iter().any(|(f, m)| f == field && m.contains(message)), "{transforms}: {e:?}");
        }
    }

    #[test]
    fn the_columns_read_follow_the_ops_back_from_a_select() {
        let read = |t: &str| spec("parquet", t).data_plane.columns_read();
        assert_eq!(read("- log1p: {fields: [a]}"), None, "every column reaches the batch");
        let t = "- filter: {field: f, op: gt, value: '1'}\n- concat: {fields: [a, b], output: d}\n\
                 - renameFields: {mapping: {c: e}}\n- selectFields: {fields: [d, e]}";
        assert_eq!(read(t), Some(vec!["a".into(), "b".into(), "c".into(), "f".into()]));
        let t = "- python: {module: m, function: f}\n- selectFields: {fields: [a]}";
        assert_eq!(spec("parquet", t).data_plane.columns_read(), None, "python reads what it likes");
    }
}
