//! What the simulated workers and clients share of talking to the dispatcher: a connection of
//! their own carrying a token the size of a projected ServiceAccount token, the pipelines'
//! names, and how an answer is taken (retry, register again, or give up).

use std::sync::LazyLock;
use std::time::Duration;

use stoker_api::proto::PipelineRef;
use stoker_api::proto::dispatcher_client::DispatcherClient;
use tonic::metadata::{Ascii, MetadataValue};
use tonic::service::Interceptor;
use tonic::service::interceptor::InterceptedService;
use tonic::transport::{Channel, Endpoint};
use tonic::{Code, Status};

/// As the real worker and client wait before calling again an unreachable dispatcher.
pub const RETRY: Duration = Duration::from_millis(250);

/// The job every simulated client reads.
pub const JOB: &str = "train";

/// A bearer token as long as a projected ServiceAccount token (about 1 KB): the dispatcher
/// here lets every caller in, but it still receives and decodes the header.
static TOKEN: LazyLock<MetadataValue<Ascii>> = LazyLock::new(|| {
    let token: String = (0..980).map(|i| char::from(b'a' + (i % 26) as u8)).collect();
    format!("Bearer {token}").parse().expect("ASCII")
});

#[derive(Clone)]
pub struct Token;

impl Interceptor for Token {
    fn call(&mut self, mut request: tonic::Request<()>) -> Result<tonic::Request<()>, Status> {
        request.metadata_mut().insert(stoker_api::proto::AUTHORIZATION, TOKEN.clone());
        Ok(request)
    }
}

pub type Rpc = DispatcherClient<InterceptedService<Channel, Token>>;

/// A connection of its own to the dispatcher at `url` (made at the first call), as each real
/// worker and client has.
pub fn connect(url: &str) -> anyhow::Result<Rpc> {
    let channel = Endpoint::from_shared(url.to_string())?.connect_timeout(Duration::from_secs(5)).connect_lazy();
    Ok(DispatcherClient::with_interceptor(channel, Token))
}

/// Where in `period` member `index`'s timer first fires: real workers and clients start at
/// different moments, so their heartbeats and windows spread over the second; started
/// together here, they would all fire in one burst and queue behind each other.
pub fn phase(index: usize, period: Duration) -> Duration {
    // The golden ratio's fraction spreads any number of members evenly.
    period.mul_f64((index as f64 * 0.618_033_988_749_895).fract())
}

/// Pipeline `i` of the load.
pub fn pipeline(i: usize) -> PipelineRef {
    PipelineRef { namespace: "bench".into(), name: format!("p{i}") }
}

/// What to do about a failed call.
pub enum Failed {
    /// The dispatcher forgot the caller (it restarted): register again.
    Forgotten,
    /// Unreachable, starting, or not leading: call again after `RETRY`.
    Retry,
    /// A refusal no retry fixes.
    Fatal(Status),
}

pub fn failed(s: Status) -> Failed {
    match s.code() {
        Code::NotFound => Failed::Forgotten,
        Code::Unavailable | Code::Unknown | Code::Cancelled | Code::DeadlineExceeded => Failed::Retry,
        _ => Failed::Fatal(s),
    }
}
