//! The client's side of the dispatcher's RPCs: registering as a consumer of a job (again, under
//! the same id and telling it what the client has, when a restarted dispatcher forgot it:
//! rejoining), watching the worker list, reporting batch-time windows and acknowledging what
//! arrived.

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::time::Duration;

use stoker_api::proto::dispatcher_client::DispatcherClient;
use stoker_api::proto::{self, PipelineRef};
use tonic::transport::{Channel, Endpoint};
use tonic::{Code, Status};

use crate::delivery::{Acknowledgement, Delivery, SplitId};
use crate::error::Error;
use crate::options::ClientOptions;
use crate::stats::WindowStats;
use stoker_api::ranks::Received;

pub(crate) const RETRY: Duration = Duration::from_millis(250);

pub(crate) struct Registration {
    url: String,
    client: DispatcherClient<Channel>,
    request: proto::RegisterClientRequest,
    token: stoker_api::token::TokenSource,
    /// How often to report a batch-time window.
    pub(crate) window: Duration,
    /// The dispatcher registered with (RegisterClientResponse.incarnation).
    incarnation: u64,
    /// What a rejoin tells a restarted dispatcher; set once the client streams.
    pub(crate) had: Option<Rejoining>,
}

/// Where a rejoin finds what the client has of its job.
pub(crate) struct Rejoining {
    pub delivery: Delivery,
    /// The job's open epoch and clients, as the dispatcher last said.
    pub open_epoch: Arc<AtomicU64>,
    pub clients: Arc<AtomicU32>,
}

impl Registration {
    /// Registers, retrying an unreachable dispatcher for the options' connect timeout.
    pub(crate) async fn register(url: &str, options: &ClientOptions) -> Result<Registration, Error> {
        let dispatcher = |status: Status| Error::Dispatcher { url: url.to_string(), status: Box::new(status) };
        let (target, tls) = crate::tls::dispatcher(url, options)?;
        let mut endpoint = Endpoint::from_shared(target)
            .map_err(|e| Error::InvalidOptions(format!("dispatcher url {url:?}: {e}")))?
            .connect_timeout(options.connect_timeout);
        if let Some(tls) = tls {
            endpoint =
                endpoint.tls_config(tls).map_err(|e| Error::InvalidOptions(format!("TLS settings for {url}: {e}")))?;
        }
        let channel = endpoint.connect_lazy();
        let mut link = Registration {
            url: url.to_string(),
            client: DispatcherClient::new(channel),
            request: proto::RegisterClientRequest {
                pipeline: Some(PipelineRef { namespace: options.namespace.clone(), name: options.pipeline.clone() }),
                job: options.job.clone(),
                consumer_index: options.consumer_index,
                consumers: options.consumers,
                coordinated: options.coordinated,
                client_id: String::new(),
                resume: options.resume.clone(),
                rejoin: None,
                share: options.share.clone().unwrap_or_default(),
            },
            token: options.token_source(),
            window: Duration::from_secs(10),
            incarnation: 0,
            had: None,
        };
        let deadline = tokio::time::Instant::now() + options.connect_timeout;
        loop {
            match link.try_register().await {
                Ok(()) => return Ok(link),
                // A certificate that does not verify will not start verifying: say so now.
                Err(s) if crate::tls::failure(url, &s).is_some() => {
                    return Err(crate::tls::failure(url, &s).expect("checked above"));
                }
                Err(s) if retryable(&s) && tokio::time::Instant::now() < deadline => tokio::time::sleep(RETRY).await,
                Err(s) => return Err(dispatcher(s)),
            }
        }
    }

    /// The client's token source, shared with its worker streams (one file read a minute).
    pub(crate) fn token(&self) -> &stoker_api::token::TokenSource {
        &self.token
    }

    fn request<T>(&self, message: T) -> tonic::Request<T> {
        let mut request = tonic::Request::new(message);
        self.token.attach(&mut request);
        request
    }

    async fn try_register(&mut self) -> Result<(), Status> {
        let response = self.client.register_client(self.request(self.request.clone())).await?.into_inner();
        if response.window_ms > 0 {
            self.window = Duration::from_millis(u64::from(response.window_ms));
        }
        tracing::info!(dispatcher = %self.url, client = %response.client_id, job = %response.job, rejoined = self.request.rejoin.is_some(), "registered with the dispatcher");
        self.request.client_id = response.client_id;
        // A resumed job streams as its run; again registering, it is that run's client.
        if !response.job.is_empty() {
            self.request.job = response.job;
        }
        self.request.resume = None;
        self.request.rejoin = None;
        self.incarnation = response.incarnation;
        Ok(())
    }

    /// The dispatcher answered NOT_FOUND: the client went silent too long and was forgotten
    /// (register again), or the dispatcher restarted (rejoin).
    async fn forgotten(&mut self, s: &Status) -> Result<(), Status> {
        let answered = s.metadata().get(proto::INCARNATION).and_then(|v| v.to_str().ok()?.parse::<u64>().ok());
        if answered.is_some_and(|a| self.left(a)) {
            // A dispatcher this client has left answered before it went: the next call
            // reaches the one it rejoined.
            return Ok(());
        }
        if answered == Some(self.incarnation) && self.request.rejoin.is_none() {
            self.try_register().await
        } else {
            self.rejoin(None).await
        }
    }

    /// The dispatcher forgot this client, or `seen` (a worker list's) is not the one it
    /// registered with: it restarted. Registers again, telling the new one what the client has
    /// of the job (refusing batches of the old one from this moment), so the job goes on
    /// without repeating any of it. Nothing to do if this already happened.
    pub(crate) async fn rejoin(&mut self, seen: Option<u64>) -> Result<(), Status> {
        // A list of a dispatcher this client left says nothing new (see `left`).
        if seen.is_some_and(|s| s == 0 || s == self.incarnation || self.left(s)) {
            return Ok(());
        }
        tracing::debug!(dispatcher = %self.url, ?seen, registered = self.incarnation, "rejoining");
        if self.request.rejoin.is_none()
            && let Some(had) = &self.had
        {
            let open_epoch = had.open_epoch.load(Ordering::Relaxed);
            let what = had.delivery.rejoin(self.incarnation, open_epoch);
            tracing::info!(dispatcher = %self.url, open_epoch, completed = what.completed.len(), "the dispatcher restarted: rejoining with what this client has");
            self.request.rejoin = Some(proto::Rejoin {
                incarnation: self.incarnation,
                open_epoch,
                clients: had.clients.load(Ordering::Relaxed),
                completed: what.completed.iter().map(|&(epoch, split)| proto::SplitRef { epoch, split }).collect(),
                received: what
                    .received
                    .into_iter()
                    .map(|h| proto::HeldRows { epoch: h.split.0, split: h.split.1, positions: h.positions })
                    .collect(),
            });
        }
        // Kept until it is taken: a failed attempt sends the same again.
        self.try_register().await
    }

    /// Whether this client rejoined another dispatcher after `incarnation`. What such a one
    /// said (a list or an answer still on the way when it went) is stale: taken for news of a
    /// restart, it made the client rejoin the dispatcher it had just rejoined, refusing that
    /// one's batches from then on.
    fn left(&self, incarnation: u64) -> bool {
        self.had.as_ref().is_some_and(|had| had.delivery.retired(incarnation))
    }

    /// The job to stream and watch as: the job, or the run a resumed job goes on as.
    pub(crate) fn job(&self) -> &str {
        &self.request.job
    }

    pub(crate) async fn report(&mut self, stats: WindowStats, workers: usize) -> Result<(), Status> {
        let report = proto::ReportWindowRequest {
            client_id: self.request.client_id.clone(),
            batches: stats.batches,
            median_seconds: stats.median.as_secs_f64(),
            mean_seconds: if stats.batches > 0 {
                stats.total_batch_time.as_secs_f64() / stats.batches as f64
            } else {
                0.0
            },
            p90_seconds: stats.p90.as_secs_f64(),
            wait_fraction: stats.wait_fraction,
            workers: workers as u32,
        };
        match self.client.report_window(self.request(report.clone())).await {
            Err(s) if s.code() == Code::NotFound => {
                self.forgotten(&s).await?;
                let report = proto::ReportWindowRequest { client_id: self.request.client_id.clone(), ..report };
                self.client.report_window(self.request(report)).await.map(drop)
            }
            other => other.map(drop),
        }
    }

    /// Acknowledges completions, list `version` with the rows held from workers that left it,
    /// and what this rank `received` of its recent epochs; returns the job's open epoch.
    /// `leaving`: the client is closing, having `discarded` batches or not.
    pub(crate) async fn acknowledge(
        &mut self,
        ack: &Acknowledgement,
        version: u64,
        received: &[(u64, Received)],
        leaving: Option<bool>,
    ) -> Result<u64, Status> {
        let splits = |s: &[SplitId]| s.iter().map(|&(epoch, split)| proto::SplitRef { epoch, split }).collect();
        let ack = proto::AcknowledgeRequest {
            leaving: leaving.is_some(),
            discarded: leaving.unwrap_or(false),
            client_id: self.request.client_id.clone(),
            completed: splits(&ack.completed),
            completed_again: splits(&ack.completed_again),
            list_version: version,
            held: ack
                .held
                .iter()
                .map(|h| proto::HeldRows { epoch: h.split.0, split: h.split.1, positions: h.positions.clone() })
                .collect(),
            received: received.iter().map(|(epoch, r)| r.to_proto(*epoch)).collect(),
        };
        let response = match self.client.acknowledge(self.request(ack.clone())).await {
            Err(s) if s.code() == Code::NotFound => {
                // A rejoin tells a new dispatcher the completions and rows; the one that only
                // forgot this client has them.
                self.forgotten(&s).await?;
                let ack = proto::AcknowledgeRequest {
                    client_id: self.request.client_id.clone(),
                    completed: Vec::new(),
                    completed_again: Vec::new(),
                    held: Vec::new(),
                    ..ack
                };
                self.client.acknowledge(self.request(ack)).await
            }
            other => other,
        };
        Ok(response?.into_inner().epoch)
    }

    pub(crate) async fn watch(&mut self) -> Result<tonic::Streaming<proto::WorkerList>, Status> {
        let request =
            proto::WatchWorkersRequest { pipeline: self.request.pipeline.clone(), job: self.request.job.clone() };
        Ok(self.client.watch_workers(self.request(request)).await?.into_inner())
    }

    /// The watch, and its first list (so the client knows the job's open epoch before it
    /// reads), retrying an unreachable dispatcher until `deadline`.
    pub(crate) async fn first_list(
        &mut self,
        deadline: tokio::time::Instant,
    ) -> Result<(tonic::Streaming<proto::WorkerList>, proto::WorkerList), Status> {
        loop {
            let attempt = async {
                let mut watch = self.watch().await?;
                match watch.message().await? {
                    Some(list) => Ok((watch, list)),
                    None => Err(Status::unavailable("the worker list ended before its first message")),
                }
            };
            match attempt.await {
                Ok(first) => return Ok(first),
                Err(s) if retryable(&s) && tokio::time::Instant::now() < deadline => tokio::time::sleep(RETRY).await,
                Err(s) => return Err(s),
            }
        }
    }

    pub(crate) fn url(&self) -> &str {
        &self.url
    }
}

/// Worth retrying: the dispatcher is starting, moving or briefly unreachable.
pub(crate) fn retryable(s: &Status) -> bool {
    matches!(s.code(), Code::Unavailable | Code::Unknown | Code::Cancelled | Code::DeadlineExceeded | Code::NotFound)
}
