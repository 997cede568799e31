//! The `stoker` command line as a user runs it.

use std::path::Path;
use std::process::Command;

fn stoker(args: &[&str]) -> (bool, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_stoker")).args(args).env("RUST_BACKTRACE", "0").output().unwrap();
    (out.status.success(), format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr)))
}

fn samples() -> std::path::PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../manifests/samples")
}

#[test]
fn check_accepts_the_valid_samples() {
    let files: Vec<String> = [
        "image-classification.yaml",
        "image-python-augment.yaml",
        "llm-pretraining.yaml",
        "llm-pretraining-parquet.yaml",
        "dlrm-criteo.yaml",
        "sweep.yaml",
        "text-jsonl.yaml",
        "webdataset-fixed.yaml",
    ]
    .iter()
    .map(|f| samples().join(f).display().to_string())
    .collect();
    let args: Vec<&str> = std::iter::once("check").chain(files.iter().map(String::as_str)).collect();
    let (ok, out) = stoker(&args);
    assert!(ok, "{out}");
    assert_eq!(out.matches(" is valid").count(), files.len(), "{out}");
}

#[test]
fn check_refuses_every_invalid_sample_and_typos() {
    let dir = samples().join("invalid");
    for entry in std::fs::read_dir(&dir).unwrap() {
        let path = entry.unwrap().path();
        let (ok, out) = stoker(&["check", path.to_str().unwrap()]);
        assert!(!ok, "{} should be refused: {out}", path.display());
    }
    let typo = std::env::temp_dir().join(format!("stoker-typo-{}.yaml", std::process::id()));
    std::fs::write(
        &typo,
        "apiVersion: stoker.dev/v1alpha1\nkind: DataPipeline\nmetadata: {name: t}\nspec:\n  \
         source: {uri: 's3://b/x', format: jsonl}\n  batchSize: 4\n  shufle: {bufferSize: 8}\n",
    )
    .unwrap();
    let (ok, out) = stoker(&["check", typo.to_str().unwrap()]);
    std::fs::remove_file(&typo).ok();
    assert!(!ok && out.contains("unknown field(s) spec.shufle"), "{out}");
}

#[test]
fn explain_walks_through_every_sample() {
    let (ok, out) = stoker(&["explain"]);
    assert!(ok, "{out}");
    let valid = std::fs::read_dir(samples())
        .unwrap()
        .filter(|e| e.as_ref().unwrap().path().extension().is_some_and(|x| x == "yaml"))
        .count();
    assert_eq!(out.matches("✓ ").count(), valid, "{out}");
    assert_eq!(out.matches("✗ ").count(), std::fs::read_dir(samples().join("invalid")).unwrap().count(), "{out}");
    assert!(out.contains("Deployment imagenet-train-workers  replicas 1"), "{out}");
}
