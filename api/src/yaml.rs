//! YAML in the Kubernetes style. serde_yaml 0.9 writes and expects enum variants as YAML tags
//! (`!decodeImage`), while Kubernetes manifests spell them as one-key maps; going through a
//! JSON value gives the manifest form in both directions.

use serde::Serialize;
use serde::de::DeserializeOwned;
use serde_json::Value;

use crate::{DataPipeline, ValidationError, invalid_message, validate};

/// Why a DataPipeline manifest cannot be used as written. Callers that explain manifests
/// tell the schema's refusal apart from the operator's.
#[derive(Debug, thiserror::Error)]
pub enum ManifestError {
    /// Not YAML, or not a DataPipeline the CRD schema accepts.
    #[error("not a DataPipeline the API server would accept")]
    Schema(#[source] serde_yaml::Error),
    /// Fields the API server would prune silently, as paths: a typo would become a default.
    #[error("unknown field(s) {}: the API server would drop them silently; check the spelling against docs/reference.md", .0.join(", "))]
    UnknownFields(Vec<String>),
    /// The schema accepts it, the operator would mark it Invalid.
    #[error("Invalid: {}", invalid_message(.0))]
    Invalid(Vec<ValidationError>),
}

/// A manifest read offline as the API server and then the operator would: parsed, with unknown
/// fields refused, and validated.
pub fn parse_manifest(text: &str) -> Result<DataPipeline, ManifestError> {
    let dp = parse_manifest_unvalidated(text)?;
    validate(&dp.spec).map_err(ManifestError::Invalid)?;
    Ok(dp)
}

/// [`parse_manifest`] without the operator's validation: what the API server would store.
pub fn parse_manifest_unvalidated(text: &str) -> Result<DataPipeline, ManifestError> {
    let (dp, unknown) = from_yaml_checked::<DataPipeline>(text).map_err(ManifestError::Schema)?;
    if !unknown.is_empty() {
        return Err(ManifestError::UnknownFields(unknown));
    }
    Ok(dp)
}

pub fn from_yaml<T: DeserializeOwned>(text: &str) -> Result<T, serde_yaml::Error> {
    let value: Value = serde_yaml::from_str(text)?;
    serde_json::from_value(value).map_err(<serde_yaml::Error as serde::de::Error>::custom)
}

/// Like [`from_yaml`], and also lists the fields of `text` that `T` does not know, as paths
/// (`spec.workers.mni`). The API server prunes such fields silently, so a typo would quietly
/// become a default; offline checks report them instead.
pub fn from_yaml_checked<T: DeserializeOwned + Serialize>(text: &str) -> Result<(T, Vec<String>), serde_yaml::Error> {
    let input: Value = serde_yaml::from_str(text)?;
    let parsed: T = serde_json::from_value(input.clone()).map_err(<serde_yaml::Error as serde::de::Error>::custom)?;
    let known = serde_json::to_value(&parsed).map_err(<serde_yaml::Error as serde::de::Error>::custom)?;
    let mut unknown = Vec::new();
    collect_unknown(&input, &known, "", &mut unknown);
    Ok((parsed, unknown))
}

pub fn to_yaml<T: Serialize>(value: &T) -> Result<String, serde_yaml::Error> {
    let value = serde_json::to_value(value).map_err(<serde_yaml::Error as serde::ser::Error>::custom)?;
    serde_yaml::to_string(&value)
}

fn collect_unknown(input: &Value, known: &Value, path: &str, out: &mut Vec<String>) {
    match (input, known) {
        (Value::Object(i), Value::Object(k)) => {
            for (key, value) in i {
                let child = if path.is_empty() { key.clone() } else { format!("{path}.{key}") };
                match k.get(key) {
                    Some(kv) => collect_unknown(value, kv, &child, out),
                    // An explicit null of an optional field is not a typo.
                    None if !value.is_null() => out.push(child),
                    None => {}
                }
            }
        }
        (Value::Array(i), Value::Array(k)) => {
            for (n, (iv, kv)) in i.iter().zip(k).enumerate() {
                collect_unknown(iv, kv, &format!("{path}[{n}]"), out);
            }
        }
        _ => {}
    }
}

#[cfg(test)]
mod tests {
    use crate::DataPipeline;

    #[test]
    fn typos_are_listed_with_their_paths() {
        let text = "apiVersion: stoker.dev/v1alpha1\nkind: DataPipeline\nmetadata: {name: p, labelz: {}}\n\
                    spec:\n  source: {uri: 'file:///d', format: jsonl}\n  batchSize: 4\n  workers: {mni: 2}\n  \
                    transforms:\n  - randomFlip: {horizontl: true}\n";
        let (_, unknown) = super::from_yaml_checked::<DataPipeline>(text).unwrap();
        assert_eq!(unknown, ["metadata.labelz", "spec.transforms[0].randomFlip.horizontl", "spec.workers.mni"]);
    }

    #[test]
    fn a_manifest_is_refused_for_its_first_kind_of_problem() {
        use super::{ManifestError, parse_manifest};
        let head = "apiVersion: stoker.dev/v1alpha1\nkind: DataPipeline\nmetadata: {name: p}\nspec:\n  ";
        let with = |spec: &str| parse_manifest(&format!("{head}{spec}"));
        assert!(with("source: {uri: 'file:///d', format: jsonl}\n  batchSize: 4\n").is_ok());
        assert!(matches!(
            with("source: {uri: 'file:///d', format: jsonl}\n  batchSize: four\n"),
            Err(ManifestError::Schema(_))
        ));
        let typo = with("source: {uri: 'file:///d', format: jsonl}\n  batchSize: 4\n  shufle: {}\n").unwrap_err();
        assert!(matches!(&typo, ManifestError::UnknownFields(f) if f == &["spec.shufle"]), "{typo}");
        let invalid = with("source: {uri: 'ftp://d', format: jsonl}\n  batchSize: 4\n").unwrap_err();
        assert!(invalid.to_string().starts_with("Invalid: spec.source.uri"), "{invalid}");
    }

    #[test]
    fn a_clean_manifest_has_no_unknown_fields() {
        let text = "apiVersion: stoker.dev/v1alpha1\nkind: DataPipeline\nmetadata: {name: p}\n\
                    spec:\n  source: {uri: 'file:///d', format: jsonl}\n  batchSize: 4\n  shuffle: {bufferSize: 8}\n";
        let (_, unknown) = super::from_yaml_checked::<DataPipeline>(text).unwrap();
        assert!(unknown.is_empty(), "{unknown:?}");
    }
}
