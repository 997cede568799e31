//! How the dispatcher gathers its clients' states into a job (see `gathering`): the ranks
//! resuming a job from a checkpoint, and the clients rejoining a job a restart interrupted.

use std::collections::BTreeSet;
use std::time::Instant;

use stoker_api::{ClientId, JobName};

use super::{DispatchError, DispatcherState, Rejoin, Resume};
use crate::dispatcher::gathering::{Contributor, Gathering};
use crate::dispatcher::ledger::{Held, Reporter};
use crate::dispatcher::pipeline::{JobEntry, Phase};
use crate::key::PipelineKey;

impl DispatcherState {
    /// The run a consumer resuming `job` from its saved state joins: the run gathering the
    /// states saved at the same step (same epoch and batches: every rank has yielded as many),
    /// or a new one. A run is a job of its own, named apart, so no batch made for the job
    /// before (still in a worker's queues) reaches it. Once every rank's state is in, the run
    /// produces the epoch without the rows any of them had yielded. A merged state (every
    /// rank's saved state as one) resumes the job read by any number of ranks: each new rank
    /// brings it under its own rank, and the run waits for all of them.
    pub(super) fn resume(
        &mut self,
        pipeline: &PipelineKey,
        job: &JobName,
        consumer_index: u32,
        consumers: u32,
        resume: Resume,
    ) -> Result<JobName, DispatchError> {
        let mismatch = if resume.job != *job {
            Some(format!("it is of job {:?}, not {:?}", resume.job.as_str(), job.as_str()))
        } else if resume.merged {
            None
        } else if resume.consumers.max(1) != consumers.max(1) {
            Some(format!(
                "it is of a job of {} consumer(s), not {} (merge every rank's state into one to resume with another \
                 number of ranks)",
                resume.consumers, consumers
            ))
        } else if consumers > 1 && resume.consumer_index != consumer_index {
            Some(format!("it is rank {}'s, not rank {consumer_index}'s", resume.consumer_index))
        } else {
            None
        };
        if let Some(why) = mismatch {
            return Err(DispatchError::Invalid(format!("cannot resume from this state: {why}")));
        }
        let step = (job.clone(), resume.epoch, resume.batches);
        let existing = self.pipelines.get(pipeline).and_then(|p| {
            p.jobs.iter().find(|(_, e)| matches!(&e.phase, Phase::Gathering { gathering, .. } if gathering.step.as_ref() == Some(&step)))
        });
        let run = match existing {
            Some((run, _)) => run.clone(),
            None => self.members.run_of(job),
        };
        let p = self.pipelines.entry(pipeline.clone()).or_default();
        let epoch = resume.epoch;
        // The share group comes with the registration (set by the caller).
        let entry = p.jobs.entry(run.clone()).or_insert_with(|| JobEntry {
            ranks: None,
            share: None,
            phase: Phase::Gathering { start: epoch, gathering: Gathering::resume(step, consumers) },
        });
        if let Phase::Gathering { gathering, .. } = &mut entry.phase {
            gathering.add(Contributor::Rank(consumer_index), consumers, epoch, resume.yielded, &[], consumer_index);
        }
        self.gathered(pipeline, &run, Instant::now());
        Ok(run)
    }

    /// A client `id` of `job` rejoining after this dispatcher restarted. The first starts the
    /// job's gathering; once every client is in (or the client timeout passed) the job goes on
    /// without what they have. One rejoining a job already under way again (it was late, or
    /// it lost this dispatcher for a while) adds what it has as an acknowledgement would.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn rejoin(
        &mut self,
        pipeline: &PipelineKey,
        job: &JobName,
        id: &ClientId,
        rank: u32,
        consumers: u32,
        rejoin: Rejoin,
        now: Instant,
    ) {
        let Rejoin { open_epoch, clients, completed, received, .. } = rejoin;
        let deadline = now + self.timeouts.client;
        let p = self.pipelines.entry(pipeline.clone()).or_default();
        let plan = p.ledger_plan();
        let ranked = consumers > 1;
        let (who, expected) =
            if ranked { (Contributor::Rank(rank), consumers) } else { (Contributor::Client(id.clone()), clients) };
        let rank = if ranked { rank } else { 0 };
        let entry = p.jobs.entry(job.clone()).or_insert(JobEntry::declared(open_epoch));
        match &mut entry.phase {
            Phase::Running(state) => {
                tracing::info!(%pipeline, %job, client = %id, "a client rejoined a job under way: what it has is acknowledged");
                state.acknowledge(id, 0, &received, now);
                let by = Reporter::Client { rank, consumers: consumers.max(1) };
                state.complete(&completed, by, &plan, now);
                return;
            }
            Phase::Gathered(gathered) => {
                // Late, but before anything went out (the plan is not known yet): as if in time.
                gathered.add(open_epoch, received, &completed, rank);
                return;
            }
            Phase::Gathering { start, gathering } => {
                *start = (*start).max(open_epoch);
                gathering.add(who, expected, open_epoch, received, &completed, rank);
            }
            Phase::Declared { start } => {
                tracing::info!(%pipeline, %job, expected, "a client rejoined a job this dispatcher does not know: waiting for the others");
                let mut gathering = Gathering::rejoin(expected, deadline);
                gathering.add(who, expected, open_epoch, received, &completed, rank);
                entry.phase = Phase::Gathering { start: (*start).max(open_epoch), gathering };
            }
        }
        self.gathered(pipeline, job, now);
    }

    /// Moves `job`'s gathering on if it is ready (and starts the job if the plan is known);
    /// true if it did.
    fn gathered(&mut self, pipeline: &PipelineKey, job: &JobName, now: Instant) -> bool {
        let Some(p) = self.pipelines.get_mut(pipeline) else { return false };
        let Some(entry) = p.jobs.get_mut(job) else { return false };
        if let Phase::Gathering { gathering, .. } = &mut entry.phase
            && gathering.ready(now)
        {
            let gathered = gathering.finish();
            let rows: usize = gathered.rows.iter().map(|h: &Held| h.positions.len()).sum();
            if gathered.incomplete {
                tracing::warn!(%pipeline, %job, epoch = gathered.epoch, rows, completed = gathered.completed.len(), "a client did not rejoin within the client timeout: the job goes on without it, and rows it had may repeat");
            } else {
                tracing::info!(%pipeline, %job, epoch = gathered.epoch, rows, completed = gathered.completed.len(), "every client's state is in: the job goes on without what they have");
            }
            entry.phase = Phase::Gathered(gathered);
            p.start_gathered();
            return true;
        }
        false
    }

    /// Gatherings that waited out the client timeout go on without the missing; returns the
    /// pipelines whose clients must hear of it.
    pub(super) fn gathered_late(&mut self, now: Instant) -> BTreeSet<PipelineKey> {
        let waiting: Vec<(PipelineKey, JobName)> = self
            .pipelines
            .iter()
            .flat_map(|(key, p)| {
                let gathering = p.jobs.iter().filter(|(_, e)| matches!(e.phase, Phase::Gathering { .. }));
                gathering.map(move |(job, _)| (key.clone(), job.clone()))
            })
            .collect();
        waiting.into_iter().filter(|(pipeline, job)| self.gathered(pipeline, job, now)).map(|(p, _)| p).collect()
    }
}
