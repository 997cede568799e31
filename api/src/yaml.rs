//! YAML in the Kubernetes style. serde_yaml 0.9 writes and expects enum variants as YAML tags
//! (`!decodeImage`), while Kubernetes manifests spell them as one-key maps; going through a
//! JSON value gives the manifest form in both directions.

use serde::Serialize;
use serde::de::DeserializeOwned;

pub fn from_yaml<T: DeserializeOwned>(text: &str) -> Result<T, serde_yaml::Error> {
    let value: serde_json::Value = serde_yaml::from_str(text)?;
    serde_json::from_value(value).map_err(<serde_yaml::Error as serde::de::Error>::custom)
}

pub fn to_yaml<T: Serialize>(value: &T) -> Result<String, serde_yaml::Error> {
    let value = serde_json::to_value(value).map_err(<serde_yaml::Error as serde::ser::Error>::custom)?;
    serde_yaml::to_string(&value)
}
