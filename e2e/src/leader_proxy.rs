//! Stands in for the dispatcher Service on the local provider: accepts TCP connections on one
//! address and forwards each to whichever operator's dispatcher port accepts it. Only the
//! leader listens on its dispatcher port, so this routes to the leader as the Service does
//! with the label the leader puts on its pod.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::net::{TcpListener, TcpStream};

pub struct LeaderProxy {
    addr: SocketAddr,
    task: tokio::task::JoinHandle<()>,
}

impl LeaderProxy {
    /// Listens on a free loopback port; `targets` are the operators' dispatcher addresses and
    /// may change while it runs.
    pub async fn start(targets: Arc<Mutex<Vec<SocketAddr>>>) -> anyhow::Result<LeaderProxy> {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let task = tokio::spawn(async move {
            while let Ok((inbound, _)) = listener.accept().await {
                let targets = targets.lock().unwrap().clone();
                tokio::spawn(async move {
                    let Some(mut outbound) = connect_any(&targets).await else { return };
                    let mut inbound = inbound;
                    let _ = inbound.set_nodelay(true);
                    let _ = outbound.set_nodelay(true);
                    let _ = tokio::io::copy_bidirectional(&mut inbound, &mut outbound).await;
                });
            }
        });
        Ok(LeaderProxy { addr, task })
    }

    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }
}

impl Drop for LeaderProxy {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// The first target that accepts; None (the caller's connection is closed, and it retries)
/// when no operator leads right now.
async fn connect_any(targets: &[SocketAddr]) -> Option<TcpStream> {
    for target in targets {
        if let Ok(Ok(stream)) = tokio::time::timeout(Duration::from_millis(300), TcpStream::connect(target)).await {
            return Some(stream);
        }
    }
    None
}
