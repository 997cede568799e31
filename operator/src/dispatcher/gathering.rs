//! A job that waits for its clients' states before any of it goes out, and then goes on from
//! what they have. Two things make one:
//!
//! - **Rejoin.** A restarted dispatcher (or a new leader) knows nothing of a job its clients
//!   are in the middle of. Each client rejoins with what it has received of the job's
//!   unfinished epochs: the splits whose completion it got, and the rows of the others. Once
//!   every client has (every rank; for a shared job as many as were last listed), or the client
//!   timeout passes (a client died with the dispatcher), the job goes on without those rows.
//! - **Resume.** Every rank of a job registers with the state it saved at the same step: the
//!   rows its training loop had yielded. The job goes on as a new run without them, once every
//!   rank's state is in (there is no giving up: a rank missing would break equal counts).
//!
//! Nothing goes out before: a split handed out early could repeat rows a late state holds.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Instant;

use stoker_api::{ClientId, JobName};

use super::ledger::Held;

/// What a job's clients have, gathered.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Gathered {
    /// The job's open epoch: the newest any client knew (an epoch finished is finished).
    pub epoch: u64,
    /// Rows they have of splits not known done.
    pub rows: Vec<Held>,
    /// (epoch, split) -> the ranks (0 for a shared job's clients) that have its completion.
    pub completed: BTreeMap<(u64, u64), BTreeSet<u32>>,
    /// It went on without some client's state (the client timeout passed).
    pub incomplete: bool,
}

impl Gathered {
    /// A client's state (see `Gathering::add`).
    pub fn add(&mut self, epoch: u64, rows: Vec<Held>, completed: &[(u64, u64)], rank: u32) {
        self.epoch = self.epoch.max(epoch);
        self.rows.extend(rows);
        for &split in completed {
            self.completed.entry(split).or_default().insert(rank);
        }
    }
}

/// Who gave a state: a job read by ranks needs one per rank (a rank's client may register
/// again under another id); a shared job one per client.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Contributor {
    Rank(u32),
    Client(ClientId),
}

/// One job's gathering.
#[derive(Debug)]
pub struct Gathering {
    /// A resume's step: (job as named, epoch, batches yielded). None for a rejoin.
    pub step: Option<(JobName, u64, u64)>,
    /// How many states make the job whole.
    expected: u32,
    /// A rejoin goes on without the missing states then.
    deadline: Option<Instant>,
    /// Who gave a state: a rank, or a shared job's client.
    from: BTreeSet<Contributor>,
    gathered: Gathered,
}

impl Gathering {
    /// Waits for every rank of a job resumed from the checkpoint `step`.
    pub fn resume(step: (JobName, u64, u64), consumers: u32) -> Self {
        let gathered = Gathered { epoch: step.1, ..Gathered::default() };
        Gathering { step: Some(step), expected: consumers.max(1), deadline: None, from: BTreeSet::new(), gathered }
    }

    /// Waits for `expected` clients of a job that was under way, until `deadline`.
    pub fn rejoin(expected: u32, deadline: Instant) -> Self {
        Gathering {
            step: None,
            expected: expected.max(1),
            deadline: Some(deadline),
            from: BTreeSet::new(),
            gathered: Gathered::default(),
        }
    }

    /// A client's state: `who` it is (its rank, or a shared job's client id), the open epoch it
    /// knew, the rows it has and the splits whose completion it has (as `rank`). A shared job's
    /// clients may know of more clients than the first to rejoin did.
    pub fn add(
        &mut self,
        who: Contributor,
        expected: u32,
        epoch: u64,
        rows: Vec<Held>,
        completed: &[(u64, u64)],
        rank: u32,
    ) {
        self.expected = self.expected.max(expected);
        self.from.insert(who);
        self.gathered.add(epoch, rows, completed, rank);
    }

    /// Whether the job can go on: every state is in, or a rejoin waited long enough.
    pub fn ready(&self, now: Instant) -> bool {
        self.from.len() as u32 >= self.expected || self.deadline.is_some_and(|d| now >= d)
    }

    /// What was gathered (the gathering is spent: its phase ends here).
    pub fn finish(&mut self) -> Gathered {
        let incomplete = (self.from.len() as u32) < self.expected;
        Gathered { incomplete, ..std::mem::take(&mut self.gathered) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn held(epoch: u64, split: u64, positions: &[u32]) -> Held {
        Held { epoch, split, positions: positions.to_vec() }
    }

    #[test]
    fn a_rejoin_is_ready_once_every_client_is_in_or_the_deadline_passed() {
        let t = Instant::now();
        let mut g = Gathering::rejoin(1, t + Duration::from_secs(30));
        g.add(Contributor::Client("c-1".into()), 2, 4, vec![held(4, 1, &[0])], &[(4, 2)], 0);
        assert!(!g.ready(t), "the client said the job had two");
        g.add(Contributor::Client("c-1".into()), 2, 4, vec![], &[], 0);
        assert!(!g.ready(t), "the same client twice is one");
        assert!(g.ready(t + Duration::from_secs(30)));
        g.add(Contributor::Client("c-2".into()), 2, 5, vec![held(5, 0, &[3])], &[(4, 2)], 0);
        assert!(g.ready(t));
        let done = g.finish();
        assert_eq!(done.epoch, 5, "the newest open epoch any client knew");
        assert_eq!(done.rows.len(), 2);
        assert_eq!(done.completed[&(4, 2)], BTreeSet::from([0]));
        assert!(!done.incomplete);
    }

    #[test]
    fn a_resume_waits_for_every_rank_and_never_gives_up() {
        let t = Instant::now();
        let mut g = Gathering::resume(("j".into(), 2, 10), 2);
        g.add(Contributor::Rank(0), 2, 2, vec![held(2, 0, &[1])], &[], 0);
        assert!(!g.ready(t + Duration::from_secs(3600)));
        g.add(Contributor::Rank(1), 2, 2, vec![], &[], 1);
        assert!(g.ready(t));
        assert_eq!(g.finish().epoch, 2);
    }
}
