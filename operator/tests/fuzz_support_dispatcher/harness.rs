//! Runs calls against an in-process dispatcher and checks each answer (see
//! `fuzz_dispatcher.rs` for what is checked).

use super::*;

/// Memory one call may take at its peak beyond what was live before it: a few copies of a
/// 4 MiB message's contents, nowhere near what a field like `splits` could ask for.
const CALL_PEAK: usize = 64 << 20;
/// What a sequence may leave behind beyond the empty dispatcher, per byte of the requests it
/// sent (positions kept in sets, a watch channel per pipeline named), plus a little.
const KEPT_PER_BYTE_SENT: usize = 8;
const KEPT_BASE: usize = 4 << 20;

/// How far past every timeout `Op::Expire` moves the clock.
const LATER: Duration = Duration::from_secs(3600);

pub struct Harness {
    runtime: tokio::runtime::Runtime,
    dispatcher: Arc<Dispatcher>,
    service: DispatcherService,
    incarnation: u64,
    pub seen: Seen,
    baseline: usize,
    sent: usize,
}

/// What an OK answer told.
enum Answer {
    Worker(String),
    Client { id: String, job: String, incarnation: u64 },
    Next(proto::NextSplitResponse),
    Listed(Option<Result<proto::WorkerList, Status>>),
    Reader(String),
    Empty,
}

impl Harness {
    pub fn new() -> Harness {
        let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("a runtime");
        let dispatcher = Dispatcher::new(Timeouts::default(), Duration::from_secs(5));
        let incarnation = dispatcher.with_state(|s| s.incarnation());
        let service = dispatcher.clone().into_service();
        let baseline = fuzz_support::live();
        Harness { runtime, dispatcher, service, incarnation, seen: Seen::default(), baseline, sent: 0 }
    }

    /// Makes one call and checks its answer and the dispatcher afterwards.
    pub fn call(&mut self, op: &Op) -> Result<(), String> {
        let Some(request) = filled(op, &self.seen) else {
            let dispatcher = &self.dispatcher;
            std::panic::catch_unwind(AssertUnwindSafe(|| {
                dispatcher.with_state(|s| s.expire(Instant::now() + LATER));
            }))
            .map_err(|p| format!("expiry panicked: {}", panic_message(&p)))?;
            self.seen.workers.clear();
            self.seen.clients.clear();
            return self.check_members();
        };
        self.sent += request_len(&request);
        let expected = self.expect(&request);
        self.forget_replaced(&request);
        let before = fuzz_support::live();
        fuzz_support::reset_peak();
        let (runtime, service) = (&self.runtime, &self.service);
        let answer = std::panic::catch_unwind(AssertUnwindSafe(|| runtime.block_on(dispatch(service, &request))))
            .map_err(|p| format!("the handler panicked: {}", panic_message(&p)))?;
        let peak = fuzz_support::peak().saturating_sub(before);
        if peak > CALL_PEAK {
            return Err(format!("the call took {peak} bytes at its peak"));
        }
        let code = answer.as_ref().map_or_else(Status::code, |_| Code::Ok);
        if !expected.contains(&code) {
            let message = answer.as_ref().err().map(|s| s.message().to_string()).unwrap_or_default();
            return Err(format!("answered {code:?} ({message}), expected one of {expected:?}"));
        }
        match answer {
            Ok(answer) => self.record(&request, answer)?,
            Err(status) if status.code() == Code::NotFound => {
                let told = status.metadata().get(proto::INCARNATION).and_then(|v| v.to_str().ok());
                if told != Some(&self.incarnation.to_string()) {
                    return Err(format!("NOT_FOUND without this dispatcher's incarnation: {told:?}"));
                }
            }
            Err(_) => {}
        }
        self.check_members()?;
        let kept = fuzz_support::live().saturating_sub(self.baseline);
        if kept > KEPT_BASE + KEPT_PER_BYTE_SENT * self.sent {
            return Err(format!("the dispatcher keeps {kept} bytes after {} bytes of requests", self.sent));
        }
        Ok(())
    }

    /// The codes the call may answer with, from the request and who is registered.
    fn expect(&self, request: &Filled) -> Vec<Code> {
        use Code::*;
        let live_worker = |id: &str| if self.seen.workers.contains_key(id) { vec![Ok] } else { vec![NotFound] };
        let live_client = |id: &str| if self.seen.clients.contains_key(id) { vec![Ok] } else { vec![NotFound] };
        match request {
            Filled::RegisterWorker(r) if !registrable(r) => vec![InvalidArgument],
            Filled::RegisterWorker(_) => vec![Ok, FailedPrecondition],
            Filled::Heartbeat(r) => live_worker(&r.worker_id),
            Filled::NextSplit(r) if r.job.is_empty() => vec![InvalidArgument],
            Filled::NextSplit(r) => live_worker(&r.worker_id),
            Filled::ReturnSplits(r) => live_worker(&r.worker_id),
            Filled::RegisterClient(r) => {
                let invalid = !ours(&r.pipeline)
                    || r.job.is_empty()
                    || r.client_id.len() > MAX_ID_BYTES
                    || r.consumers > proto::MAX_CONSUMERS
                    || (r.consumers > 1 && r.consumer_index >= r.consumers)
                    || (r.coordinated && r.consumers < 2);
                // Valid on its own, it may still differ from the job's other clients.
                if invalid { vec![InvalidArgument] } else { vec![Ok, InvalidArgument] }
            }
            Filled::WatchWorkers(r) if !ours(&r.pipeline) => vec![InvalidArgument],
            Filled::WatchWorkers(_) => vec![Ok],
            Filled::ReportWindow(r) => {
                let valid = |x: f64| x.is_finite() && x >= 0.0;
                if [r.median_seconds, r.p90_seconds, r.mean_seconds, r.wait_fraction].into_iter().all(valid) {
                    live_client(&r.client_id)
                } else {
                    vec![InvalidArgument]
                }
            }
            Filled::Acknowledge(r) => live_client(&r.client_id),
            // Access is open here: any pipeline's reader is let in, a missing pipeline is not.
            Filled::AuthorizeReader(r) if !ours(&r.pipeline) => vec![InvalidArgument],
            Filled::AuthorizeReader(_) => vec![Ok],
        }
    }

    /// A valid registration takes over its address from any other worker, whatever its plan.
    fn forget_replaced(&mut self, request: &Filled) {
        if let Filled::RegisterWorker(r) = request
            && registrable(r)
        {
            self.seen.workers.retain(|id, address| *address != r.address || *id == r.worker_id);
        }
    }

    fn record(&mut self, request: &Filled, answer: Answer) -> Result<(), String> {
        match (request, answer) {
            (Filled::RegisterWorker(r), Answer::Worker(id)) => {
                if !r.worker_id.is_empty() && id != r.worker_id {
                    return Err(format!("asked to keep id {:?}, got {id:?}", r.worker_id));
                }
                self.seen.workers.insert(id.clone(), r.address.clone());
                self.seen.ever.push(id);
            }
            (Filled::RegisterClient(r), Answer::Client { id, job, incarnation }) => {
                if !r.client_id.is_empty() && id != r.client_id {
                    return Err(format!("asked to keep id {:?}, got {id:?}", r.client_id));
                }
                if incarnation != self.incarnation {
                    return Err(format!("registered with incarnation {incarnation}, not {}", self.incarnation));
                }
                if r.resume.is_none() && job != r.job {
                    return Err(format!("registered for job {:?} as {job:?} without resuming", r.job));
                }
                if job != r.job {
                    self.seen.runs.push(job);
                }
                self.seen.clients.insert(id.clone(), ());
                self.seen.ever.push(id);
            }
            (Filled::NextSplit(r), Answer::Next(next)) => {
                let epoch = match next.next {
                    Some(Next::Split(s)) => {
                        if !next.skip.windows(2).all(|w| w[0] < w[1]) {
                            return Err(format!("skip positions not sorted and distinct: {:?}", next.skip));
                        }
                        s.epoch
                    }
                    Some(Next::Draining(d)) => d.epoch,
                    Some(Next::Finished(f)) => f.epoch,
                    None => return Err("NextSplit answered nothing".into()),
                };
                if epoch != r.epoch {
                    return Err(format!("asked for epoch {}, answered about {epoch}", r.epoch));
                }
            }
            (Filled::WatchWorkers(_), Answer::Listed(first)) => match first {
                Some(Ok(list)) if list.incarnation == self.incarnation => {}
                other => return Err(format!("a watch's first list is not there at once: {other:?}")),
            },
            (Filled::Acknowledge(r), Answer::Empty) if r.leaving => {
                self.seen.clients.remove(&r.client_id);
            }
            (Filled::AuthorizeReader(_), Answer::Reader(who)) if who == "system:anonymous" => {}
            (_, Answer::Empty) => {}
            _ => return Err("an answer of the wrong kind".into()),
        }
        Ok(())
    }

    /// The dispatcher holds exactly the workers and clients the model does (and its mutex is
    /// not poisoned: this would panic).
    fn check_members(&mut self) -> Result<(), String> {
        let (workers, clients) = std::panic::catch_unwind(AssertUnwindSafe(|| {
            self.dispatcher.with_state(|s| {
                let workers: usize =
                    PIPELINES.iter().map(|(ns, name)| s.worker_progress(&PipelineKey::new(*ns, *name)).len()).sum();
                let clients: usize = s.take_windows().iter().map(|w| w.consumers).sum();
                (workers, clients)
            })
        }))
        .map_err(|p| format!("the state cannot be read: {}", panic_message(&p)))?;
        if (workers, clients) != (self.seen.workers.len(), self.seen.clients.len()) {
            return Err(format!(
                "the dispatcher tracks {workers} workers and {clients} clients, the model {} and {}",
                self.seen.workers.len(),
                self.seen.clients.len()
            ));
        }
        Ok(())
    }

    /// A new worker and client of a new pipeline still get going.
    pub fn still_answers(&mut self) -> Result<(), String> {
        let pipeline = Some(proto::PipelineRef { namespace: "after".into(), name: "fuzz".into() });
        let worker = proto::RegisterWorkerRequest {
            pipeline: pipeline.clone(),
            address: "10.9.9.9:7000".into(),
            threads: 1,
            splits: 2,
            plan_digest: "d".into(),
            ..Default::default()
        };
        let client = proto::RegisterClientRequest { pipeline, job: "fresh".into(), ..Default::default() };
        let service = &self.service;
        let next = std::panic::catch_unwind(AssertUnwindSafe(|| {
            self.runtime.block_on(async {
                let worker_id = service.register_worker(Request::new(worker)).await?.into_inner().worker_id;
                service.register_client(Request::new(client)).await?;
                let next = proto::NextSplitRequest { worker_id, job: "fresh".into(), ..Default::default() };
                Ok::<_, Status>(service.next_split(Request::new(next)).await?.into_inner().next)
            })
        }))
        .map_err(|p| format!("a fresh pipeline's calls panicked: {}", panic_message(&p)))?;
        match next {
            Ok(Some(Next::Split(proto::SplitRef { epoch: 0, split: 0 }))) => Ok(()),
            other => Err(format!("a fresh worker of a fresh pipeline got {other:?}, not split 0 of epoch 0")),
        }
    }
}

/// A worker registration the dispatcher must accept or refuse only for its plan.
fn registrable(r: &proto::RegisterWorkerRequest) -> bool {
    ours(&r.pipeline)
        && !r.address.is_empty()
        && (1..=MAX_SPLITS).contains(&r.splits)
        && r.worker_id.len() <= MAX_ID_BYTES
        && proto::CacheMode::try_from(r.cache_mode).is_ok()
}

async fn dispatch(service: &DispatcherService, request: &Filled) -> Result<Answer, Status> {
    Ok(match request {
        Filled::RegisterWorker(r) => {
            Answer::Worker(service.register_worker(Request::new(r.clone())).await?.into_inner().worker_id)
        }
        Filled::Heartbeat(r) => {
            service.worker_heartbeat(Request::new(r.clone())).await?;
            Answer::Empty
        }
        Filled::NextSplit(r) => Answer::Next(service.next_split(Request::new(r.clone())).await?.into_inner()),
        Filled::ReturnSplits(r) => {
            service.return_splits(Request::new(r.clone())).await?;
            Answer::Empty
        }
        Filled::RegisterClient(r) => {
            let a = service.register_client(Request::new(r.clone())).await?.into_inner();
            Answer::Client { id: a.client_id, job: a.job, incarnation: a.incarnation }
        }
        Filled::WatchWorkers(r) => {
            let mut lists = service.watch_workers(Request::new(r.clone())).await?.into_inner();
            // The current list is there at once; nothing else is waited for.
            Answer::Listed(lists.next().now_or_never().flatten())
        }
        Filled::ReportWindow(r) => {
            service.report_window(Request::new(r.clone())).await?;
            Answer::Empty
        }
        Filled::Acknowledge(r) => {
            service.acknowledge(Request::new(r.clone())).await?;
            Answer::Empty
        }
        Filled::AuthorizeReader(r) => {
            Answer::Reader(service.authorize_reader(Request::new(r.clone())).await?.into_inner().username)
        }
    })
}

fn request_len(request: &Filled) -> usize {
    use prost::Message;
    match request {
        Filled::RegisterWorker(r) => r.encoded_len(),
        Filled::Heartbeat(r) => r.encoded_len(),
        Filled::NextSplit(r) => r.encoded_len(),
        Filled::ReturnSplits(r) => r.encoded_len(),
        Filled::RegisterClient(r) => r.encoded_len(),
        Filled::WatchWorkers(r) => r.encoded_len(),
        Filled::ReportWindow(r) => r.encoded_len(),
        Filled::Acknowledge(r) => r.encoded_len(),
        Filled::AuthorizeReader(r) => r.encoded_len(),
    }
}

pub fn panic_message(p: &Box<dyn std::any::Any + Send>) -> String {
    p.downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| p.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "(not a string)".into())
}
