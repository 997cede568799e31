//! What the ranks of a job and the dispatcher tell each other so every rank yields the same
//! number of batches per epoch (`AcknowledgeRequest.received`, `WorkerList.quotas`): one type
//! for each, from the client's count to the dispatcher's quota.

use crate::proto;

/// What a rank has received of an epoch.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Received {
    /// Batches with tensors.
    pub batches: u64,
    /// Every stream of the epoch ended: `batches` is final.
    pub ended: bool,
    /// Rows received beyond the epoch's final quota and dropped.
    pub dropped_rows: u64,
}

/// Batches of an epoch every rank may yield; `complete` once it is the epoch's final count.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Quota {
    pub batches: u64,
    pub complete: bool,
}

impl Received {
    pub fn to_proto(self, epoch: u64) -> proto::RankProgress {
        proto::RankProgress { epoch, batches: self.batches, ended: self.ended, dropped_rows: self.dropped_rows }
    }

    /// (epoch, what was received).
    pub fn from_proto(p: &proto::RankProgress) -> (u64, Received) {
        (p.epoch, Received { batches: p.batches, ended: p.ended, dropped_rows: p.dropped_rows })
    }
}

impl Quota {
    pub fn to_proto(self, epoch: u64) -> proto::EpochQuota {
        proto::EpochQuota { epoch, batches: self.batches, complete: self.complete }
    }

    /// (epoch, quota).
    pub fn from_proto(q: &proto::EpochQuota) -> (u64, Quota) {
        (q.epoch, Quota { batches: q.batches, complete: q.complete })
    }
}
