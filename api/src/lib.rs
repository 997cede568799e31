//! Types shared by every Stoker component. Nothing here talks to a cluster: the worker and the
//! clients depend on this crate without pulling in a Kubernetes client.

pub mod bounds;
pub mod children;
pub mod chunk;
mod features;
pub mod fingerprint;
mod ids;
pub mod order;
mod profile;
pub mod proto;
pub mod ranks;
mod reading;
mod spec;
mod status;
mod tensor;
pub mod tls;
pub mod token;
mod transform;
mod validate;
pub mod verdicts;
pub mod window;
mod yaml;

pub use features::*;
pub use ids::{ClientId, JobName, ShareName, WorkerId};
pub use profile::*;
pub use reading::{JobShape, Reading};
pub use spec::*;
pub use status::*;
pub use tensor::{
    Batch, ECHO_COPY_SHIFT, Layout, MAX_ECHO_SPLIT_ELEMENTS, Payload, ShapeMismatch, Stacked, Tensor, echo_copy,
    echo_position, row, row_origin,
};
pub use transform::*;
pub use validate::{ValidationError, invalid_message, validate};
pub use yaml::{ManifestError, from_yaml, from_yaml_checked, parse_manifest, parse_manifest_unvalidated, to_yaml};

/// API group of every Stoker resource.
pub const GROUP: &str = "stoker.dev";
