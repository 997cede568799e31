//! The namespace's cache claim: made by the first pipeline that caches, shared by every
//! pipeline of the namespace, owned by none, never updated. What a later pipeline asks for
//! differently is said, not applied.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{PersistentVolumeClaim, PersistentVolumeClaimSpec, VolumeResourceRequirements};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use stoker_api::{Cache, DataPipelineSpec};

use super::{CACHE_PVC, MANAGED_BY};

pub(super) fn build(spec: &DataPipelineSpec, namespace: &str) -> PersistentVolumeClaim {
    PersistentVolumeClaim {
        metadata: ObjectMeta {
            name: Some(CACHE_PVC.into()),
            namespace: Some(namespace.to_string()),
            labels: Some(BTreeMap::from([
                ("app.kubernetes.io/name".to_string(), "stoker-cache".to_string()),
                ("app.kubernetes.io/managed-by".to_string(), MANAGED_BY.to_string()),
            ])),
            ..Default::default()
        },
        spec: Some(PersistentVolumeClaimSpec {
            access_modes: Some(vec![spec.cache.access_mode.as_str().into()]),
            storage_class_name: spec.cache.storage_class_name.clone(),
            resources: Some(VolumeResourceRequirements {
                requests: Some(BTreeMap::from([("storage".to_string(), spec.cache.volume_size())])),
                limits: None,
            }),
            ..Default::default()
        }),
        status: None,
    }
}

/// The size a claim asked for. Not a bound claim's capacity: that appears later and would
/// change the workers' env, restarting them, for a difference a provisioner's rounding makes.
pub fn claim_size(claim: &PersistentVolumeClaim) -> Option<Quantity> {
    claim.spec.as_ref()?.resources.as_ref()?.requests.as_ref()?.get("storage").cloned()
}

/// What the claim this pipeline would make (`wanted`) asks for that the existing one lacks,
/// for the user to see.
pub fn claim_differences(wanted: &PersistentVolumeClaim, have: &PersistentVolumeClaim) -> Vec<String> {
    let (want_spec, have_spec) = (wanted.spec.clone().unwrap_or_default(), have.spec.clone().unwrap_or_default());
    let mut differences = Vec::new();
    if let (Some(want), Some(size)) = (claim_size(wanted), claim_size(have))
        && Cache::cap_for(&want) != Cache::cap_for(&size)
    {
        differences.push(format!("volumeSize {} (the claim has {})", want.0, size.0));
    }
    if want_spec.storage_class_name.is_some() && want_spec.storage_class_name != have_spec.storage_class_name {
        let class = |c: &Option<String>| c.clone().unwrap_or_else(|| "the default".into());
        differences.push(format!(
            "storageClassName {} (the claim has {})",
            class(&want_spec.storage_class_name),
            class(&have_spec.storage_class_name)
        ));
    }
    if want_spec.access_modes != have_spec.access_modes {
        let modes = |m: &Option<Vec<String>>| m.clone().unwrap_or_default().join(",");
        differences.push(format!(
            "accessMode {} (the claim has {})",
            modes(&want_spec.access_modes),
            modes(&have_spec.access_modes)
        ));
    }
    differences
}
