//! `stoker`: the user's command line. `check` validates DataPipeline files offline; `demo` shows
//! what the operator makes of the sample pipelines, without a cluster.

use std::path::{Path, PathBuf};

use anyhow::{Context, bail};
use clap::{Parser, Subcommand};
use kube::ResourceExt;
use stoker_api::DataPipeline;
use stoker_operator::objects::{self, WorkerDefaults};
use stoker_operator::status::invalid_message;

#[derive(Parser)]
#[command(version, about = "Stoker: preprocessing pipelines as an autoscaled service")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Validate DataPipeline manifests the way the operator does; exits non-zero on any problem.
    Check {
        #[arg(required = true)]
        files: Vec<PathBuf>,
    },
    /// Walk through the sample pipelines: what the operator accepts, refuses, and creates.
    Demo {
        #[arg(long, default_value = concat!(env!("CARGO_MANIFEST_DIR"), "/../manifests/samples"))]
        samples: PathBuf,
        /// Print the generated objects in full.
        #[arg(long)]
        yaml: bool,
    },
}

fn main() -> anyhow::Result<()> {
    match Cli::parse().command {
        Command::Check { files } => {
            let mut bad = 0;
            for file in &files {
                match load(file).and_then(|dp| check(&dp).map(|()| dp)) {
                    Ok(dp) => println!("{}: {} is valid", file.display(), dp.name_any()),
                    Err(e) => {
                        bad += 1;
                        println!("{}: {e:#}", file.display());
                    }
                }
            }
            if bad > 0 {
                bail!("{bad} of {} file(s) invalid", files.len());
            }
            Ok(())
        }
        Command::Demo { samples, yaml } => demo(&samples, yaml),
    }
}

fn load(path: &Path) -> anyhow::Result<DataPipeline> {
    let text = std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    let (dp, unknown) = stoker_api::from_yaml_checked::<DataPipeline>(&text)
        .context("not a DataPipeline the API server would accept")?;
    if !unknown.is_empty() {
        bail!(
            "unknown field(s) {}: the API server would drop them silently; check the spelling against docs/reference.md",
            unknown.join(", ")
        );
    }
    Ok(dp)
}

fn check(dp: &DataPipeline) -> anyhow::Result<()> {
    stoker_api::validate(&dp.spec).map_err(|errors| anyhow::anyhow!("Invalid: {}", invalid_message(&errors)))
}

fn demo(samples: &Path, yaml: bool) -> anyhow::Result<()> {
    let samples = &samples.canonicalize().with_context(|| format!("finding {}", samples.display()))?;
    let mut files: Vec<PathBuf> = std::fs::read_dir(samples)
        .with_context(|| format!("reading samples from {}", samples.display()))?
        .chain(std::fs::read_dir(samples.join("invalid")).into_iter().flatten())
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "yaml"))
        .collect();
    files.sort_by_key(|p| (p.parent() != Some(samples), p.clone()));
    let defaults = WorkerDefaults {
        image: concat!("ghcr.io/stoker-dev/stoker-worker:", env!("CARGO_PKG_VERSION")).into(),
        dispatcher_url: "http://stoker-dispatcher.stoker-system.svc:50051".into(),
    };
    println!("Stoker demo: what the operator makes of each sample in {}\n", samples.display());
    println!("(Only the control plane's view for now: worker processes, batch streaming and the");
    println!(" autoscaler arrive with the data plane and `stoker local`.)\n");
    for file in files {
        let name = file.strip_prefix(samples).unwrap_or(&file).display().to_string();
        let mut dp = match load(&file) {
            Ok(dp) => dp,
            Err(e) => {
                println!("✗ {name}\n    refused by the CRD schema: {}\n", e.root_cause());
                continue;
            }
        };
        if let Err(e) = check(&dp) {
            println!("✗ {name}\n    {e}\n");
            continue;
        }
        dp.metadata.namespace.get_or_insert_with(|| "default".into());
        dp.metadata.uid = Some("demo".into());
        let replicas = objects::initial_replicas(&dp.spec);
        let built = objects::build(&dp, &defaults, replicas);
        println!("✓ {name}: DataPipeline {}", dp.name_any());
        println!(
            "    Deployment {}  replicas {replicas} (workers {}..{}, {:?})",
            built.deployment.metadata.name.as_deref().unwrap_or_default(),
            dp.spec.workers.min,
            dp.spec.workers.max,
            dp.spec.autoscaling.mode
        );
        println!("    Service    {}  headless, port {}", built.service.metadata.name.as_deref().unwrap_or_default(), objects::DATA_PORT);
        match built.cache_pvc {
            Some(_) => println!("    PVC        {}  shared by the namespace (cache mode {:?})", objects::CACHE_PVC, dp.spec.cache.mode),
            None => println!("    no cache volume (cache mode {:?})", dp.spec.cache.mode),
        }
        if yaml {
            for doc in [stoker_api::to_yaml(&built.deployment)?, stoker_api::to_yaml(&built.service)?] {
                println!("---\n{doc}");
            }
            if let Some(pvc) = &built.cache_pvc {
                println!("---\n{}", stoker_api::to_yaml(pvc)?);
            }
        }
        println!();
    }
    println!("Next: install the operator (docs/install.md) and `kubectl apply -f manifests/samples/`.");
    Ok(())
}
