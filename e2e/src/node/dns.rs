//! Cluster DNS for the kubelet provider, which has no CoreDNS: answers `A` queries for Service
//! names (`<service>.<namespace>.svc.cluster.local`, what a pod's search path makes of
//! `<service>.<namespace>.svc` or `<service>`) with the Service's ClusterIP, from a watch of the
//! cluster's Services. Every other name is NXDOMAIN: nothing is forwarded, so no pod's lookup
//! leaves the machine. Pods use it through the kubelet's `--cluster-dns`, unchanged.

use std::collections::HashMap;
use std::net::{Ipv4Addr, SocketAddr};
use std::sync::{Arc, RwLock};

use anyhow::Context as _;
use futures::StreamExt as _;
use hickory_proto::op::{Message, MessageType, OpCode, ResponseCode};
use hickory_proto::rr::{RData, Record, RecordType, rdata::A};
use k8s_openapi::api::core::v1::Service;
use kube::api::Api;
use kube::runtime::WatchStreamExt as _;
use kube::runtime::watcher::{self, Event};

/// The cluster domain the kubelet gives pods (`--cluster-domain`).
pub const CLUSTER_DOMAIN: &str = "cluster.local";
/// How long a pod may cache an answer: short, Services come and go between scenarios.
const TTL: u32 = 5;

/// Fully qualified Service name (lower case, with the root dot) -> ClusterIP.
type Names = Arc<RwLock<HashMap<String, Ipv4Addr>>>;

/// Serves until dropped.
pub struct ServiceDns {
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

impl Drop for ServiceDns {
    fn drop(&mut self) {
        for task in &self.tasks {
            task.abort();
        }
    }
}

impl ServiceDns {
    /// Answers on UDP `addr` (port 53 of the node's address, for `--cluster-dns`).
    pub async fn start(client: kube::Client, addr: SocketAddr) -> anyhow::Result<Self> {
        let socket = tokio::net::UdpSocket::bind(addr).await.with_context(|| format!("binding DNS on {addr}"))?;
        let names: Names = Arc::default();
        let watch = tokio::spawn(follow_services(Api::all(client), names.clone()));
        let serve = tokio::spawn(serve(socket, names));
        Ok(ServiceDns { tasks: vec![watch, serve] })
    }
}

fn service_name(service: &Service) -> Option<(String, Ipv4Addr)> {
    let (name, namespace) = (service.metadata.name.as_ref()?, service.metadata.namespace.as_ref()?);
    let ip = service.spec.as_ref()?.cluster_ip.as_ref()?.parse().ok()?;
    Some((format!("{name}.{namespace}.svc.{CLUSTER_DOMAIN}.").to_lowercase(), ip))
}

async fn follow_services(api: Api<Service>, names: Names) {
    let mut events = watcher::watcher(api, watcher::Config::default()).default_backoff().boxed();
    // A (re)listing builds the names anew, then replaces them whole.
    let mut relisted: Option<HashMap<String, Ipv4Addr>> = None;
    while let Some(event) = events.next().await {
        match event {
            Ok(Event::Init) => relisted = Some(HashMap::new()),
            Ok(Event::InitApply(s)) => {
                if let (Some(listing), Some((name, ip))) = (relisted.as_mut(), service_name(&s)) {
                    listing.insert(name, ip);
                }
            }
            Ok(Event::InitDone) => {
                if let Some(listing) = relisted.take() {
                    *names.write().unwrap() = listing;
                }
            }
            Ok(Event::Apply(s)) => {
                if let Some((name, ip)) = service_name(&s) {
                    names.write().unwrap().insert(name, ip);
                }
            }
            Ok(Event::Delete(s)) => {
                if let Some((name, _)) = service_name(&s) {
                    names.write().unwrap().remove(&name);
                }
            }
            // The watcher retries by itself.
            Err(e) => eprintln!("[e2e dns] watching Services: {e}"),
        }
    }
}

async fn serve(socket: tokio::net::UdpSocket, names: Names) {
    let mut buf = vec![0u8; 4096];
    loop {
        let Ok((len, peer)) = socket.recv_from(&mut buf).await else { continue };
        let Some(answer) = answer(&buf[..len], &names.read().unwrap()) else { continue };
        let _ = socket.send_to(&answer, peer).await;
    }
}

/// The response to one query message; None for what is not a query (nothing to answer).
fn answer(query: &[u8], names: &HashMap<String, Ipv4Addr>) -> Option<Vec<u8>> {
    let query = Message::from_vec(query).ok()?;
    if query.message_type() != MessageType::Query {
        return None;
    }
    let mut response = Message::new();
    response
        .set_id(query.id())
        .set_message_type(MessageType::Response)
        .set_op_code(query.op_code())
        .set_authoritative(true)
        .set_recursion_desired(query.recursion_desired());
    response.add_queries(query.queries().to_vec());
    let Some(question) = query.queries().first().filter(|_| query.op_code() == OpCode::Query) else {
        response.set_response_code(ResponseCode::NotImp);
        return response.to_vec().ok();
    };
    let name = question.name().to_lowercase().to_ascii();
    match names.get(&name) {
        Some(&ip) if question.query_type() == RecordType::A => {
            response.add_answer(Record::from_rdata(question.name().clone(), TTL, RData::A(A(ip))));
        }
        // The name exists, with no record of that type (AAAA: the cluster is IPv4 only).
        Some(_) => {}
        None => {
            response.set_response_code(ResponseCode::NXDomain);
        }
    }
    response.to_vec().ok()
}

#[cfg(test)]
mod tests {
    use hickory_proto::op::Query;
    use hickory_proto::rr::Name;

    use super::*;

    fn ask(name: &str, kind: RecordType) -> Message {
        let mut q = Message::new();
        q.set_id(7).set_message_type(MessageType::Query).set_op_code(OpCode::Query).set_recursion_desired(true);
        q.add_query(Query::query(Name::from_ascii(name).unwrap(), kind));
        let names = HashMap::from([("api.stoker-system.svc.cluster.local.".to_string(), Ipv4Addr::new(10, 96, 0, 9))]);
        Message::from_vec(&answer(&q.to_vec().unwrap(), &names).unwrap()).unwrap()
    }

    #[test]
    fn a_service_name_resolves_to_its_cluster_ip_and_nothing_else_does() {
        let r = ask("API.stoker-system.svc.cluster.local.", RecordType::A);
        assert_eq!((r.id(), r.response_code()), (7, ResponseCode::NoError));
        assert_eq!(r.answers()[0].data(), &RData::A(A(Ipv4Addr::new(10, 96, 0, 9))));
        let r = ask("api.stoker-system.svc.cluster.local.", RecordType::AAAA);
        assert_eq!((r.response_code(), r.answers().len()), (ResponseCode::NoError, 0), "IPv4 only");
        let r = ask("example.com.", RecordType::A);
        assert_eq!(r.response_code(), ResponseCode::NXDomain, "nothing is forwarded");
    }
}
