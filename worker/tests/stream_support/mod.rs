//! Loopback workers for the stream tests: a server on a free port that stops when dropped.

#![allow(dead_code)] // each test file uses a different part

use std::net::SocketAddr;

use stoker_api::DType;
use stoker_client::{Client, ClientOptions};
use stoker_worker::stream::{Authenticator, BatchSource, ServerOptions, StreamService, SyntheticSource, serve_on};
use tokio::net::TcpListener;
use tokio::sync::oneshot;

pub struct Worker {
    pub addr: SocketAddr,
    stop: Option<oneshot::Sender<()>>,
}

impl Drop for Worker {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
    }
}

pub async fn start_with<S: BatchSource, A: Authenticator>(
    service: StreamService<S, A>,
    options: ServerOptions,
) -> Worker {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (stop, stopped) = oneshot::channel();
    tokio::spawn(async move {
        serve_on(listener, service, &options, async {
            let _ = stopped.await;
        })
        .await
        .unwrap();
    });
    Worker { addr, stop: Some(stop) }
}

pub async fn start(source: SyntheticSource) -> Worker {
    start_with(StreamService::new(source), ServerOptions::default()).await
}

pub fn options() -> ClientOptions {
    ClientOptions::new("team-a", "imagenet")
}

pub async fn connect(workers: &[&Worker], options: ClientOptions) -> Client {
    Client::connect(workers.iter().map(|w| w.addr.to_string()).collect(), options).await.unwrap()
}

/// An image-like batch: `n` HWC uint8 images and their labels.
pub fn images(n: usize, side: usize) -> SyntheticSource {
    SyntheticSource::new(vec![
        ("image".into(), DType::Uint8, vec![n, side, side, 3]),
        ("label".into(), DType::Int64, vec![n]),
    ])
}
