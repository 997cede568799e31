//! One pipeline's part of the dispatcher's state: the plan its workers agree on, its workers as
//! last listed, and its jobs, each one entry that goes through a life:
//!
//! ```text
//! Declared ──(a worker asks for a split)──────────────────────────────▶ Running
//!     │                                                                   ▲
//!     └─(a client rejoins a restarted dispatcher, or resumes)─▶ Gathering ─(every state in)─▶ Gathered ─(plan known)─┘
//! ```
//!
//! Nothing of a job goes out before it runs, and how its clients read it (shared, or by ranks
//! with their counts) goes with it through every phase.

use std::collections::BTreeMap;
use std::sync::Arc;

use stoker_api::{JobName, ShareName, WorkerId};

use super::gathering::{Gathered, Gathering};
use super::ledger::{Job, Plan, Reporter};
use super::ranks::Ranks;
use super::share::Share;

#[derive(Default)]
pub(super) struct Pipeline {
    /// (splits, digest) every worker of the pipeline must agree on; set by the first worker.
    pub plan: Option<(u64, String)>,
    /// The seed of each epoch's hand-out order (None: plan order), from the newest worker.
    pub shuffle_seed: Option<u64>,
    pub jobs: BTreeMap<JobName, JobEntry>,
    /// The live workers (address, id) as last published, and a version that grows when they
    /// change (clients acknowledge it after dropping the workers that left). Shared with the
    /// listings: one is made on every acknowledgement, and copying a thousand workers' names
    /// each time was most of what an acknowledgement cost.
    pub listed: Arc<Vec<(String, WorkerId)>>,
    pub version: u64,
    /// The echo factor the operator set for the pipeline's automatic `echo` (0: none set),
    /// handed out with each split not handed out before in its epoch.
    pub echo: u32,
    /// The share groups of its jobs (see `share`).
    pub shares: BTreeMap<ShareName, Share>,
}

/// A job: how its clients read it, and where it is in its life.
pub(super) struct JobEntry {
    /// A job read by ranks: what each received of its recent epochs (None: shared).
    pub ranks: Option<Ranks>,
    /// The share group its clients named: it takes its splits from the group's productions.
    pub share: Option<ShareName>,
    pub phase: Phase,
}

pub(super) enum Phase {
    /// Its clients registered; it starts at `start` when a worker first asks for a split. Its
    /// workers ask for the epoch after it too (reading ahead), and whichever comes first must
    /// not decide where a resumed job starts.
    Declared { start: u64 },
    /// Waiting for its clients' states (rejoined after a restart, or resumed): nothing goes
    /// out before. `start` is the newest open epoch a client knew.
    Gathering { start: u64, gathering: Gathering },
    /// Its clients' states are in; it runs as soon as the plan is known (it comes with the
    /// first worker).
    Gathered(Gathered),
    /// Handing out splits (boxed: the other phases are a few words).
    Running(Box<Job>),
}

impl JobEntry {
    pub fn declared(start: u64) -> Self {
        JobEntry { ranks: None, share: None, phase: Phase::Declared { start } }
    }

    /// The epoch its clients are told is open.
    pub fn epoch(&self) -> u64 {
        match &self.phase {
            Phase::Declared { start } | Phase::Gathering { start, .. } => *start,
            Phase::Gathered(gathered) => gathered.epoch,
            Phase::Running(job) => job.epoch(),
        }
    }

    pub fn consumers(&self) -> u32 {
        self.ranks.as_ref().map_or(1, Ranks::consumers)
    }

    /// The job if it runs.
    pub fn running(&mut self) -> Option<&mut Job> {
        match &mut self.phase {
            Phase::Running(job) => Some(job),
            _ => None,
        }
    }

    /// Starts the job unless it waits for its clients' states; the job if it runs.
    pub fn start(&mut self, plan: &Plan) -> Option<&mut Job> {
        let consumers = self.consumers();
        match &self.phase {
            Phase::Declared { start } => self.phase = Phase::Running(Box::new(Job::starting(*start, plan))),
            Phase::Gathered(gathered) => self.phase = Phase::Running(Box::new(Job::rebuilt(gathered, plan, consumers))),
            Phase::Gathering { .. } | Phase::Running(_) => {}
        }
        self.running()
    }

    /// Who a client of the job at `rank` reports completions as.
    pub fn reporter(&self, rank: u32) -> Reporter {
        Reporter::Client { rank, consumers: self.consumers() }
    }
}

impl Pipeline {
    pub fn ledger_plan(&self) -> Plan {
        Plan { splits: self.plan.as_ref().map_or(0, |(n, _)| *n), order: self.shuffle_seed }
    }

    /// Starts the jobs whose clients' states are in, as soon as the plan is known too, rather
    /// than when a worker first asks for a split: until a job runs, its clients are told the
    /// epoch they were reading is still open, and every worker may be waiting for them to
    /// read on (its queue of the next epoch full), not asking. A restart near an epoch's end
    /// stalled the job for good that way.
    pub fn start_gathered(&mut self) {
        if self.plan.is_none() {
            return;
        }
        let plan = self.ledger_plan();
        for entry in self.jobs.values_mut().filter(|e| matches!(e.phase, Phase::Gathered(_))) {
            entry.start(&plan);
        }
    }

    /// The job if it runs.
    pub fn running(&mut self, job: &JobName) -> Option<&mut Job> {
        self.jobs.get_mut(job).and_then(JobEntry::running)
    }

    /// Every running job.
    pub fn running_jobs(&mut self) -> impl Iterator<Item = &mut Job> {
        self.jobs.values_mut().filter_map(JobEntry::running)
    }
}

/// The jobs of share group `share` among `jobs` that have clients (`live`), each started
/// unless it waits for its clients' states: a production is for every one of them. A job
/// whose clients all left takes no part (a finished or crashed trial frees its share).
pub(super) fn share_members<'a>(
    jobs: &'a mut BTreeMap<JobName, JobEntry>,
    share: &ShareName,
    live: &std::collections::BTreeSet<JobName>,
    plan: &Plan,
) -> Vec<(&'a JobName, &'a mut Job)> {
    jobs.iter_mut()
        .filter(|(name, e)| e.share.as_ref() == Some(share) && live.contains(*name))
        .filter_map(|(name, e)| Some((name, e.start(plan)?)))
        .collect()
}
