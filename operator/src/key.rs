//! A DataPipeline's identity, by namespace and name: what the dispatcher, the autoscaler, the
//! controller and local mode all key their state by.

use kube::ResourceExt;
use stoker_api::DataPipeline;

#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct PipelineKey {
    pub namespace: String,
    pub name: String,
}

impl PipelineKey {
    pub fn new(namespace: impl Into<String>, name: impl Into<String>) -> Self {
        PipelineKey { namespace: namespace.into(), name: name.into() }
    }

    pub fn of(dp: &DataPipeline) -> Self {
        PipelineKey { namespace: dp.namespace().unwrap_or_default(), name: dp.name_any() }
    }
}

impl std::fmt::Display for PipelineKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.namespace, self.name)
    }
}
