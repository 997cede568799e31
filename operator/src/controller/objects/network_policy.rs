//! The workers' NetworkPolicy (with `--network-policy`): only pods of the pipeline's own
//! namespace and of the operator's namespace may reach the workers' data port. Tokens already
//! decide who may read; this keeps everyone else from even connecting, where the cluster's
//! network plugin enforces NetworkPolicy.

use std::collections::BTreeMap;

use k8s_openapi::api::networking::v1::{
    NetworkPolicy, NetworkPolicyIngressRule, NetworkPolicyPeer, NetworkPolicyPort, NetworkPolicySpec,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector;
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use stoker_api::DataPipeline;

use super::{Identity, workers_name};

/// The label every namespace carries with its own name (Kubernetes 1.21 and later).
const NAMESPACE_NAME_LABEL: &str = "kubernetes.io/metadata.name";

pub(super) fn build(dp: &DataPipeline, identity: &Identity, operator_namespace: &str) -> NetworkPolicy {
    let same_namespace = NetworkPolicyPeer {
        // A pod selector without a namespace selector means this namespace's pods.
        pod_selector: Some(LabelSelector::default()),
        ..Default::default()
    };
    let operator = NetworkPolicyPeer {
        namespace_selector: Some(LabelSelector {
            match_labels: Some(BTreeMap::from([(NAMESPACE_NAME_LABEL.to_string(), operator_namespace.to_string())])),
            match_expressions: None,
        }),
        ..Default::default()
    };
    NetworkPolicy {
        metadata: identity.meta(&workers_name(dp)),
        spec: Some(NetworkPolicySpec {
            pod_selector: Some(LabelSelector {
                match_labels: Some(identity.selector.clone()),
                match_expressions: None,
            }),
            policy_types: Some(vec!["Ingress".into()]),
            ingress: Some(vec![NetworkPolicyIngressRule {
                from: Some(vec![same_namespace, operator]),
                ports: Some(vec![NetworkPolicyPort {
                    port: Some(IntOrString::String("data".into())),
                    protocol: Some("TCP".into()),
                    end_port: None,
                }]),
            }]),
            egress: None,
        }),
    }
}
