//! Files generated from the Rust types must match them; `make generate` refreshes them.

use std::path::Path;

use kube::CustomResourceExt;
use stoker_api::DataPipeline;

fn assert_file_is(path: &str, expected: &str) {
    let full = Path::new(env!("CARGO_MANIFEST_DIR")).join("..").join(path);
    let actual = std::fs::read_to_string(&full).unwrap_or_else(|e| panic!("reading {}: {e}", full.display()));
    assert!(actual == expected, "{path} is out of date with the DataPipeline types: run `make generate`");
}

#[test]
fn crd_files_match_the_types() {
    let crd = stoker_api::to_yaml(&DataPipeline::crd()).unwrap();
    assert_file_is("crds/datapipelines.stoker.dev.yaml", &crd);
    assert_file_is("charts/stoker/files/crds/datapipelines.stoker.dev.yaml", &crd);
}

/// `kubectl apply -f crds/` (client-side) stores the whole object in an annotation, and the API
/// server refuses annotations over 256 KiB: the embedded Kubernetes schemas (affinity, volumes)
/// must leave room for that.
#[test]
fn the_crd_fits_kubectls_last_applied_annotation() {
    let json = serde_json::to_string(&DataPipeline::crd()).unwrap();
    assert!(
        json.len() < 256 * 1024 * 9 / 10,
        "the CRD is {} bytes of JSON; kubectl apply fails at 256 KiB",
        json.len()
    );
}
