//! The workers' headless Service: one DNS record per ready worker pod, on the data port.

use k8s_openapi::api::core::v1::{Service, ServicePort, ServiceSpec};
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use stoker_api::DataPipeline;

use super::{DATA_PORT, Identity, workers_name};

pub(super) fn build(dp: &DataPipeline, identity: &Identity) -> Service {
    Service {
        metadata: identity.meta(&workers_name(dp)),
        spec: Some(ServiceSpec {
            cluster_ip: Some("None".into()),
            selector: Some(identity.selector.clone()),
            ports: Some(vec![ServicePort {
                name: Some("data".into()),
                port: DATA_PORT,
                target_port: Some(IntOrString::String("data".into())),
                protocol: Some("TCP".into()),
                ..Default::default()
            }]),
            ..Default::default()
        }),
        status: None,
    }
}
