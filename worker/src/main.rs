//! `stoker-worker`: loads the pipeline it is given (from the operator's STOKER_PIPELINE or a
//! DataPipeline manifest) and checks it. The pipeline engine and the batch stream build on this.

use std::path::PathBuf;

use anyhow::{Context, bail};
use clap::Parser;
use stoker_api::{DataPipeline, WorkerPipeline};

#[derive(Parser)]
#[command(version, about = "Stoker worker")]
struct Args {
    /// A DataPipeline manifest; without it the pipeline comes from STOKER_PIPELINE.
    #[arg(long)]
    pipeline: Option<PathBuf>,
}

fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt().with_writer(std::io::stderr).init();
    let args = Args::parse();
    let pipeline = load(&args)?;
    tracing::info!(
        pipeline = %format!("{}/{}", pipeline.namespace, pipeline.name),
        source = %pipeline.source.uri,
        ops = ?pipeline.transforms.iter().map(|t| t.name()).collect::<Vec<_>>(),
        batch_size = pipeline.batch_size,
        "pipeline loaded"
    );
    Ok(())
}

fn load(args: &Args) -> anyhow::Result<WorkerPipeline> {
    let pipeline = match &args.pipeline {
        Some(path) => {
            let text = std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
            let (dp, unknown) = stoker_api::from_yaml_checked::<DataPipeline>(&text)
                .with_context(|| format!("parsing {}", path.display()))?;
            if !unknown.is_empty() {
                bail!("{}: unknown field(s) {}", path.display(), unknown.join(", "));
            }
            let name = dp.metadata.name.clone().unwrap_or_default();
            let namespace = dp.metadata.namespace.clone().unwrap_or_else(|| "default".into());
            if let Err(errors) = stoker_api::validate(&dp.spec) {
                bail!("{} is invalid: {}", path.display(), errors.iter().map(ToString::to_string).collect::<Vec<_>>().join("; "));
            }
            WorkerPipeline::new(&namespace, &name, &dp.spec)
        }
        None => {
            let json = std::env::var("STOKER_PIPELINE").context("no --pipeline given and STOKER_PIPELINE is not set")?;
            serde_json::from_str(&json).context("parsing STOKER_PIPELINE")?
        }
    };
    Ok(pipeline)
}
