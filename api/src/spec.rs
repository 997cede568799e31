//! The DataPipeline resource (stoker.dev/v1alpha1): what a user applies.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{Affinity, EnvVar, ResourceRequirements, Toleration, Volume, VolumeMount};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use kube::CustomResource;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::{DataPipelineStatus, Transform};

/// A preprocessing pipeline run as an autoscaled service: workers read `source`, apply
/// `transforms` in order, shuffle, batch, and stream batches to training clients.
#[derive(CustomResource, Deserialize, Serialize, Clone, Debug, PartialEq, JsonSchema)]
#[kube(
    group = "stoker.dev",
    version = "v1alpha1",
    kind = "DataPipeline",
    plural = "datapipelines",
    singular = "datapipeline",
    shortname = "dp",
    category = "stoker",
    namespaced,
    status = "DataPipelineStatus",
    printcolumn = r#"{"name":"Workers","type":"string","jsonPath":".status.workers.summary","description":"Ready/desired worker pods"}"#,
    printcolumn = r#"{"name":"Batch time","type":"string","jsonPath":".status.batchTimeMs","description":"Mean client batch time (ms) of the last window"}"#,
    printcolumn = r#"{"name":"Cache","type":"string","jsonPath":".status.cache.decision"}"#,
    printcolumn = r#"{"name":"Dominant op","type":"string","jsonPath":".status.profile.dominant.op","priority":1,"description":"The op taking the largest share of the workers' time (kubectl get -o wide)"}"#,
    printcolumn = r#"{"name":"Phase","type":"string","jsonPath":".status.phase"}"#,
    printcolumn = r#"{"name":"Age","type":"date","jsonPath":".metadata.creationTimestamp"}"#
)]
#[serde(rename_all = "camelCase")]
pub struct DataPipelineSpec {
    /// What the workers run.
    #[serde(flatten)]
    pub data_plane: DataPlaneSpec,
    #[serde(default)]
    pub workers: Workers,
    #[serde(default)]
    pub autoscaling: Autoscaling,
    #[serde(default)]
    pub cache: Cache,
}

/// The data-plane part of a DataPipeline's spec: where the data is, what is done to each
/// element, and how elements become batches. Workers receive exactly this (in
/// [`WorkerPipeline`]); the scaling and volume knobs beside it are left out, so changing them
/// does not restart workers. Flattened, so manifests and the workers' JSON keep these fields at
/// the top of the spec.
#[derive(Deserialize, Serialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct DataPlaneSpec {
    pub source: Source,
    /// Ordered transforms; each item has exactly one key naming the op.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub transforms: Vec<Transform>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub shuffle: Option<Shuffle>,
    /// Elements per batch. At most 65536: every batch's header names each row's origin (about
    /// 8 bytes a row), and a header must fit in one message.
    #[schemars(range(min = 1, max = 65536))]
    pub batch_size: u32,
    /// Drop the last batch of an epoch when it has fewer than batchSize elements.
    #[serde(default)]
    pub drop_remainder: bool,
    /// Elements whose tensors differ in shape are padded to the batch's largest shape with this
    /// value; without it such a batch is an error.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pad_value: Option<f64>,
    /// Fields delivered as jagged tensors: each row's list as it is, values plus offsets (a
    /// sparse id list of each row), instead of padded to the batch's longest. Lists of
    /// numbers only (one dimension each).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 1024))]
    pub jagged: Vec<String>,
    /// Seed of every random op and of the shuffle: runs with the same seed see the same data.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub seed: Option<u64>,
    /// What a worker does with a corrupt record: count and skip it, or fail the split.
    #[serde(default)]
    pub on_error: OnError,
}

#[derive(Deserialize, Serialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct Source {
    /// Where the data lives: file:///path, s3://bucket/prefix, gs://bucket/prefix, az://container/prefix.
    /// Leave it out when `mix` names the sources.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub uri: String,
    /// The format of every source.
    pub format: SourceFormat,
    /// Secret in the pipeline's namespace whose keys become the workers' environment
    /// (for example AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub credentials_secret: Option<String>,
    /// Several sources read together, each epoch taking from each a share of its bytes in
    /// proportion to its weight (e.g. web 0.7, code 0.2, books 0.1); instead of `uri`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = crate::bounds::MAX_MIXED_SOURCES))]
    pub mix: Vec<MixedSource>,
    /// Parquet only: the columns to read; the others are never fetched. Every column when
    /// left out.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = crate::bounds::MAX_COLUMNS))]
    pub columns: Vec<String>,
}

/// One source of a mix.
#[derive(Deserialize, Serialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct MixedSource {
    #[schemars(length(min = 1))]
    pub uri: String,
    /// Relative share of each epoch's bytes; weights need not sum to 1.
    #[schemars(range(min = 0.000001))]
    pub weight: f64,
}

impl Source {
    /// One source read whole.
    pub fn single(uri: impl Into<String>, format: SourceFormat) -> Source {
        Source { uri: uri.into(), format, credentials_secret: None, mix: Vec::new(), columns: Vec::new() }
    }

    /// Every source with its weight: the mix, or `uri` alone with weight 1.
    pub fn weighted(&self) -> Vec<MixedSource> {
        if self.mix.is_empty() { vec![MixedSource { uri: self.uri.clone(), weight: 1.0 }] } else { self.mix.clone() }
    }

    /// Each mixed source's weight over the sum of the weights, in spec order.
    pub fn weight_shares(&self) -> Vec<f64> {
        let total: f64 = self.mix.iter().map(|m| m.weight).sum();
        self.mix.iter().map(|m| m.weight / total).collect()
    }

    /// The sources' URIs, for logs and messages.
    pub fn describe(&self) -> String {
        self.weighted().iter().map(|m| m.uri.as_str()).collect::<Vec<_>>().join(", ")
    }
}

#[derive(Deserialize, Serialize, Clone, Copy, Debug, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub enum SourceFormat {
    /// `<root>/<label>/<file>.jpg|png`; labels are indices of the sorted folder names.
    ImageFolder,
    /// WebDataset tar shards: files grouped into samples by key, fields by extension.
    Webdataset,
    /// TFRecord files of tf.train.Example records.
    Tfrecord,
    /// One JSON object per line.
    Jsonl,
    /// Parquet files, read by row groups: each column a field, only the `columns` named.
    Parquet,
}

#[derive(Deserialize, Serialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct Shuffle {
    /// Elements held in the shuffle buffer (at most 16777216); larger mixes better and costs
    /// memory. A worker stops growing the buffer at half its memory budget and says so in its log.
    #[schemars(range(min = 1, max = crate::bounds::MAX_SHUFFLE_BUFFER))]
    pub buffer_size: u32,
    /// Overrides spec.seed for the shuffle only.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub seed: Option<u64>,
}

#[derive(Deserialize, Serialize, Clone, Copy, Debug, Default, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub enum OnError {
    #[default]
    Skip,
    Fail,
}

/// The worker pods: how many, and how they are scheduled.
#[derive(Deserialize, Serialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct Workers {
    /// Fewest workers, kept even when no client is attached.
    #[serde(default = "default_min_workers")]
    #[schemars(range(min = 0, max = 10000))]
    pub min: i32,
    /// Most workers the autoscaler may give this pipeline.
    #[serde(default = "default_max_workers")]
    #[schemars(range(min = 1, max = 10000))]
    pub max: i32,
    /// Worker image; the operator's default worker image when unset.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub image: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resources: Option<ResourceRequirements>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub node_selector: Option<BTreeMap<String, String>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tolerations: Option<Vec<Toleration>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub affinity: Option<Affinity>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub env: Option<Vec<EnvVar>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub service_account_name: Option<String>,
    /// Volumes for the worker pods, e.g. the claim a `file://` source reads from.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub volumes: Option<Vec<Volume>>,
    /// Where the worker container mounts `volumes`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub volume_mounts: Option<Vec<VolumeMount>>,
}

fn default_min_workers() -> i32 {
    1
}
fn default_max_workers() -> i32 {
    8
}

impl Default for Workers {
    fn default() -> Self {
        Workers {
            min: default_min_workers(),
            max: default_max_workers(),
            image: None,
            resources: None,
            node_selector: None,
            tolerations: None,
            affinity: None,
            env: None,
            service_account_name: None,
            volumes: None,
            volume_mounts: None,
        }
    }
}

#[derive(Deserialize, Serialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct Autoscaling {
    #[serde(default)]
    pub mode: AutoscalingMode,
    /// Worker count for mode Fixed (required there, refused for BatchTime).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0, max = 10000))]
    pub replicas: Option<i32>,
    #[serde(default)]
    pub policy: AutoscalingPolicy,
}

#[derive(Deserialize, Serialize, Clone, Copy, Debug, Default, PartialEq, Eq, JsonSchema)]
pub enum AutoscalingMode {
    /// Add workers while clients' batch time improves, stop when it no longer does.
    #[default]
    BatchTime,
    /// Exactly `replicas` workers.
    Fixed,
}

/// Knobs of the batch-time autoscaler; the defaults suit most training jobs.
#[derive(Deserialize, Serialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct AutoscalingPolicy {
    /// Length of one observation window of client batch times.
    #[serde(default = "default_window_seconds")]
    #[schemars(range(min = 1, max = 3600))]
    pub window_seconds: u32,
    /// Windows ignored after start and after each rescale (warm-up).
    #[serde(default = "default_warmup_windows")]
    #[schemars(range(min = 0, max = 100))]
    pub warmup_windows: u32,
    /// Relative batch-time improvement that justifies more workers (0.07 = 7%).
    #[serde(default = "default_improvement_threshold")]
    #[schemars(range(min = 0.0, max = 1.0))]
    pub improvement_threshold: f64,
    /// Relative change of batch time after convergence that re-opens scaling (1.5 = 50%).
    #[serde(default = "default_reopen_factor")]
    #[schemars(range(min = 1.0, max = 100.0))]
    pub reopen_factor: f64,
    /// Workers are multiplied by this while clients mostly wait for data.
    #[serde(default = "default_growth_factor")]
    #[schemars(range(min = 1.0, max = 16.0))]
    pub growth_factor: f64,
    /// With no client attached this long, the pipeline scales down to workers.min.
    #[serde(default = "default_idle_after_seconds")]
    #[schemars(range(min = 0, max = 86400))]
    pub idle_after_seconds: u32,
}

fn default_window_seconds() -> u32 {
    10
}
fn default_warmup_windows() -> u32 {
    1
}
fn default_improvement_threshold() -> f64 {
    0.07
}
fn default_reopen_factor() -> f64 {
    1.5
}
fn default_growth_factor() -> f64 {
    2.0
}
fn default_idle_after_seconds() -> u32 {
    120
}

impl Default for AutoscalingPolicy {
    fn default() -> Self {
        AutoscalingPolicy {
            window_seconds: default_window_seconds(),
            warmup_windows: default_warmup_windows(),
            improvement_threshold: default_improvement_threshold(),
            reopen_factor: default_reopen_factor(),
            growth_factor: default_growth_factor(),
            idle_after_seconds: default_idle_after_seconds(),
        }
    }
}

/// The scratch volume every worker pod gets, as (name, mount path); `spec.workers.volumes` and
/// `volumeMounts` may not reuse either.
pub const WORKER_TMP_VOLUME: (&str, &str) = ("tmp", "/tmp");
/// The namespace's cache volume in a caching pipeline's worker pods, as (name, mount path).
pub const WORKER_CACHE_VOLUME: (&str, &str) = ("cache", "/cache");
/// The worker's projected ServiceAccount token (Stoker's audience), as (name, mount path),
/// when the operator runs with authentication.
pub const WORKER_TOKEN_VOLUME: (&str, &str) = ("stoker-token", crate::token::DEFAULT_TOKEN_DIR);

/// Caching at `autocache` hints on the namespace's shared `stoker-cache` volume.
#[derive(Deserialize, Serialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct Cache {
    #[serde(default)]
    pub mode: CacheMode,
    /// Size of the namespace's cache volume when Stoker creates it; 100Gi when unset.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub volume_size: Option<Quantity>,
    /// Storage class of the cache volume; the cluster default when unset.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub storage_class_name: Option<String>,
    #[serde(default)]
    pub access_mode: CacheAccessMode,
}

impl Cache {
    pub const DEFAULT_VOLUME_SIZE: &str = "100Gi";

    pub fn volume_size(&self) -> Quantity {
        self.volume_size.clone().unwrap_or_else(|| Quantity(Self::DEFAULT_VOLUME_SIZE.into()))
    }

    /// What the cache may hold on a volume of the size this pipeline asks for.
    pub fn cap_bytes(&self) -> Option<u64> {
        Self::cap_for(&self.volume_size())
    }

    /// What the cache may hold on a volume of `size`: 90% of it (the rest is room for entries
    /// being written), in bytes; `None` for a size this cannot read.
    pub fn cap_for(size: &Quantity) -> Option<u64> {
        let size = size.0.as_str();
        let digits = size.find(|c: char| !(c.is_ascii_digit() || c == '.')).unwrap_or(size.len());
        let (number, suffix) = size.split_at(digits);
        let unit: f64 = match suffix {
            "" => 1.0,
            "k" => 1e3,
            "M" => 1e6,
            "G" => 1e9,
            "T" => 1e12,
            "Ki" => 1024.0,
            "Mi" => 1024.0 * 1024.0,
            "Gi" => 1024.0 * 1024.0 * 1024.0,
            "Ti" => 1024.0 * 1024.0 * 1024.0 * 1024.0,
            _ => return None,
        };
        let bytes = number.parse::<f64>().ok()? * unit;
        Some((bytes * 0.9) as u64)
    }
}

#[derive(Deserialize, Serialize, Clone, Copy, Debug, Default, PartialEq, Eq, JsonSchema)]
pub enum CacheMode {
    /// Never cache (the default: caching provisions a volume). Not called `Off`, which YAML 1.1
    /// parsers such as kubectl's read as the boolean false.
    #[default]
    Never,
    /// Cache at the hint that measurements say minimises epoch time, or nowhere.
    Auto,
    /// Cache at the last hint regardless of measurements.
    Always,
}

#[derive(Deserialize, Serialize, Clone, Copy, Debug, Default, PartialEq, Eq, JsonSchema)]
pub enum CacheAccessMode {
    /// Workers on any node share the volume (needs an RWX-capable storage class).
    #[default]
    ReadWriteMany,
    /// One node mounts the volume; enough for single-node clusters such as kind.
    ReadWriteOnce,
}

impl CacheAccessMode {
    pub fn as_str(self) -> &'static str {
        match self {
            CacheAccessMode::ReadWriteMany => "ReadWriteMany",
            CacheAccessMode::ReadWriteOnce => "ReadWriteOnce",
        }
    }
}

impl DataPlaneSpec {
    /// The seed of everything `shuffle` orders (the shuffle buffer, the listing cut into
    /// splits, the splits of each epoch, the elements of each split); None without `shuffle`,
    /// when everything keeps the listing's order.
    pub fn shuffle_seed(&self) -> Option<u64> {
        self.shuffle.as_ref().map(|s| s.seed.or(self.seed).unwrap_or(0))
    }

    /// The `maxFactor` of an automatic `echo`, whose factor the operator sets.
    pub fn automatic_echo(&self) -> Option<u32> {
        self.echo().and_then(|(_, e)| e.max_factor)
    }

    /// The `echo` op and its index in `transforms`, if the pipeline echoes.
    pub fn echo(&self) -> Option<(usize, &crate::Echo)> {
        self.transforms.iter().enumerate().find_map(|(i, t)| match t {
            crate::Transform::Echo(e) => Some((i, e)),
            _ => None,
        })
    }
}

/// A pipeline as the operator hands it to workers (env STOKER_PIPELINE, JSON): its identity,
/// its data plane, and whether it may use the cache volume.
#[derive(Deserialize, Serialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct WorkerPipeline {
    pub namespace: String,
    pub name: String,
    #[serde(flatten)]
    pub data_plane: DataPlaneSpec,
    #[serde(default)]
    pub cache_mode: CacheMode,
}

impl WorkerPipeline {
    pub fn new(namespace: &str, name: &str, spec: &DataPipelineSpec) -> Self {
        WorkerPipeline {
            namespace: namespace.into(),
            name: name.into(),
            data_plane: spec.data_plane.clone(),
            cache_mode: spec.cache.mode,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn workers_receive_the_data_plane_fields_at_the_top_level_in_their_order() {
        let spec: DataPipelineSpec = crate::from_yaml(
            "source: {uri: 's3://b/', format: jsonl}\nbatchSize: 4\nseed: 7\nworkers: {min: 1, max: 2}\n\
             transforms: [{decodeImage: {channels: 3}}]\ncache: {mode: Auto}\n",
        )
        .unwrap();
        let text = serde_json::to_string(&WorkerPipeline::new("ns", "p", &spec)).unwrap();
        // The same JSON as before the data plane had its own type: a changed STOKER_PIPELINE
        // would restart every worker on an operator upgrade.
        let top = ["namespace", "name", "source", "transforms", "batchSize", "dropRemainder", "seed", "onError"];
        let at: Vec<usize> =
            top.iter().chain(&["cacheMode"]).map(|k| text.find(&format!("\"{k}\":")).unwrap()).collect();
        assert!(at.is_sorted(), "keys out of order in {text}");
        let json: serde_json::Value = serde_json::from_str(&text).unwrap();
        assert_eq!((json["seed"].as_u64(), json["cacheMode"].as_str()), (Some(7), Some("Auto")));
        let back: WorkerPipeline = serde_json::from_value(json).unwrap();
        assert_eq!(back.data_plane, spec.data_plane);
    }
}
