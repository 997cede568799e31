//! What the ranks of a job and the dispatcher tell each other so every rank yields the same
//! number of batches per epoch (`AcknowledgeRequest.received`, `WorkerList.quotas`), and in
//! coordinated mode the same round at the same step: one type for each, from the client's
//! count to the dispatcher's quota.

use std::collections::BTreeMap;

use crate::WorkerId;
use crate::proto::{self, RoundOrder, RoundRef};

/// What a rank has received of an epoch.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Received {
    /// Batches with tensors.
    pub batches: u64,
    /// Every stream of the epoch ended: `batches` is final.
    pub ended: bool,
    /// Rows received beyond the epoch's final quota and dropped.
    pub dropped_rows: u64,
    /// Coordinated mode: by worker id, its rounds received without a gap from round 0.
    pub rounds: BTreeMap<WorkerId, u64>,
    /// Coordinated mode: rounds of the epoch's order yielded.
    pub position: u64,
}

/// Batches of an epoch every rank may yield; `complete` once it is the epoch's final count.
/// In coordinated mode, the order the rounds go out in (absent: the epoch is not coordinated).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Quota {
    pub batches: u64,
    pub complete: bool,
    pub order: Option<RoundOrder>,
}

impl Received {
    pub fn to_proto(&self, epoch: u64) -> proto::RankProgress {
        proto::RankProgress {
            epoch,
            batches: self.batches,
            ended: self.ended,
            dropped_rows: self.dropped_rows,
            rounds: self.rounds.iter().map(|(w, &n)| (w.to_string(), n)).collect(),
            position: self.position,
        }
    }

    /// (epoch, what was received).
    pub fn from_proto(p: &proto::RankProgress) -> (u64, Received) {
        let received = Received {
            batches: p.batches,
            ended: p.ended,
            dropped_rows: p.dropped_rows,
            rounds: p.rounds.iter().map(|(w, &n)| (WorkerId::new(w.as_str()), n)).collect(),
            position: p.position,
        };
        (p.epoch, received)
    }
}

impl Quota {
    pub fn to_proto(&self, epoch: u64) -> proto::EpochQuota {
        proto::EpochQuota { epoch, batches: self.batches, complete: self.complete, order: self.order.clone() }
    }

    /// (epoch, quota).
    pub fn from_proto(q: &proto::EpochQuota) -> (u64, Quota) {
        (q.epoch, Quota { batches: q.batches, complete: q.complete, order: q.order.clone() })
    }
}

impl RoundOrder {
    /// The round at `position` of the epoch's order, if the order has reached it.
    pub fn at(&self, position: u64) -> Option<&RoundRef> {
        let offset = position.checked_sub(self.base)?;
        self.rounds.get(usize::try_from(offset).ok()?)
    }
}
