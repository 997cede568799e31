//! The generated CRD carries the validation the API server can do by itself, and nothing a
//! 1.20 API server lacks.

use kube::CustomResourceExt;
use serde_json::Value;
use stoker_api::DataPipeline;

fn crd() -> Value {
    serde_json::to_value(DataPipeline::crd()).unwrap()
}

fn spec_schema(crd: &Value) -> &Value {
    &crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
}

#[test]
fn names_scope_columns_and_status_subresource() {
    let crd = crd();
    assert_eq!(crd["metadata"]["name"], "datapipelines.stoker.dev");
    assert_eq!(crd["spec"]["scope"], "Namespaced");
    assert_eq!(crd["spec"]["names"]["shortNames"], serde_json::json!(["dp"]));
    let version = &crd["spec"]["versions"][0];
    assert_eq!(version["name"], "v1alpha1");
    assert!(version["subresources"]["status"].is_object());
    let columns: Vec<&str> =
        version["additionalPrinterColumns"].as_array().unwrap().iter().map(|c| c["name"].as_str().unwrap()).collect();
    assert_eq!(columns, ["Workers", "Batch time", "Cache", "Dominant op", "Phase", "Age"]);
    // The dominant op only with `kubectl get -o wide`.
    let wide: Vec<&str> = (version["additionalPrinterColumns"].as_array().unwrap().iter())
        .filter(|c| c["priority"] == 1)
        .map(|c| c["name"].as_str().unwrap())
        .collect();
    assert_eq!(wide, ["Dominant op"]);
}

#[test]
fn ranges_enums_and_required_fields_are_in_the_schema() {
    let crd = crd();
    let spec = spec_schema(&crd);
    let required: Vec<&str> = spec["required"].as_array().unwrap().iter().map(|v| v.as_str().unwrap()).collect();
    assert!(required.contains(&"source") && required.contains(&"batchSize"), "{required:?}");
    assert_eq!(spec["properties"]["batchSize"]["minimum"], 1.0);
    assert_eq!(spec["properties"]["workers"]["properties"]["min"]["minimum"], 0.0);
    assert_eq!(spec["properties"]["workers"]["properties"]["max"]["minimum"], 1.0);
    assert_eq!(
        spec["properties"]["cache"]["properties"]["mode"]["enum"],
        serde_json::json!(["Never", "Auto", "Always"])
    );
    assert_eq!(
        spec["properties"]["autoscaling"]["properties"]["mode"]["enum"],
        serde_json::json!(["BatchTime", "Fixed"])
    );
    assert_eq!(
        spec["properties"]["source"]["properties"]["format"]["enum"],
        serde_json::json!(["imageFolder", "webdataset", "tfrecord", "jsonl", "parquet"])
    );
}

#[test]
fn each_transform_item_must_have_exactly_one_known_key() {
    let crd = crd();
    let items = &spec_schema(&crd)["properties"]["transforms"]["items"];
    let one_of = items["oneOf"].as_array().expect("transforms items are a oneOf");
    let keys: Vec<&str> = one_of.iter().map(|b| b["required"][0].as_str().unwrap()).collect();
    assert_eq!(keys.len(), 25);
    for op in ["autocache", "randomResizedCrop", "python", "tokenize", "pack", "echo", "hashBucket", "concat"] {
        assert!(keys.contains(&op), "{op} in {keys:?}");
    }
    for key in keys {
        assert!(items["properties"][key].is_object(), "{key} has a schema");
    }
}

#[test]
fn no_features_a_1_20_api_server_lacks() {
    let text = serde_json::to_string(&crd()).unwrap();
    assert!(!text.contains("x-kubernetes-validations"), "CEL rules need Kubernetes 1.25+");
    assert!(!text.contains("selectableFields"), "selectable fields need Kubernetes 1.30+");
}
