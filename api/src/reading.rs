//! How a consumer reads its job, one type from the wire to the policies: the job's consumers
//! share its batches first come, first served, or each is one rank of a fixed number that get
//! equal counts every epoch (in coordinated mode, batch k of every rank from the same round).
//! On the wire it is `consumers`, `consumer_index` and `coordinated` (StreamRequest,
//! RegisterClientRequest); [`Reading::from_wire`] is the one place those are checked.

use crate::proto::MAX_CONSUMERS;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Reading {
    /// The job's consumers share its batches (wire: 0 or 1 consumers, any index).
    Shared,
    /// Rank `rank` of `ranks` (2 or more); `coordinated`: batch k of every rank comes from the
    /// same round of the same worker.
    Ranked { rank: u32, ranks: u32, coordinated: bool },
}

/// What every consumer of a job declares alike: how many ranks read it (1: shared) and whether
/// in coordinated mode.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct JobShape {
    pub ranks: u32,
    pub coordinated: bool,
}

impl std::fmt::Display for JobShape {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mode = if self.coordinated { "coordinated" } else { "not coordinated" };
        write!(f, "{} consumer(s), {mode}", self.ranks)
    }
}

impl Reading {
    /// From the wire's fields; the error says what to fix.
    pub fn from_wire(consumers: u32, consumer_index: u32, coordinated: bool) -> Result<Reading, String> {
        if consumers > MAX_CONSUMERS {
            return Err(format!("consumers {consumers} is above the limit of {MAX_CONSUMERS}"));
        }
        if consumers <= 1 {
            if coordinated {
                return Err("coordinated mode lines up the batches of a job's ranks: set consumers (2 or more)".into());
            }
            return Ok(Reading::Shared);
        }
        if consumer_index >= consumers {
            return Err(format!(
                "consumer_index {consumer_index} is not a rank of a job of {consumers} consumers (0..{consumers})"
            ));
        }
        Ok(Reading::Ranked { rank: consumer_index, ranks: consumers, coordinated })
    }

    /// This consumer's rank: 0 when the job is shared.
    pub fn rank(self) -> u32 {
        match self {
            Reading::Shared => 0,
            Reading::Ranked { rank, .. } => rank,
        }
    }

    pub fn is_ranked(self) -> bool {
        matches!(self, Reading::Ranked { .. })
    }

    /// What every consumer of the job must declare the same.
    pub fn shape(self) -> JobShape {
        match self {
            Reading::Shared => JobShape { ranks: 1, coordinated: false },
            Reading::Ranked { ranks, coordinated, .. } => JobShape { ranks, coordinated },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_wire_fields_make_one_reading_or_say_what_is_wrong() {
        assert_eq!(Reading::from_wire(0, 7, false), Ok(Reading::Shared), "any index of a shared job");
        assert_eq!(Reading::from_wire(1, 0, false), Ok(Reading::Shared));
        assert_eq!(Reading::from_wire(4, 3, true), Ok(Reading::Ranked { rank: 3, ranks: 4, coordinated: true }));
        assert!(Reading::from_wire(4, 4, false).unwrap_err().contains("not a rank of a job of 4"));
        assert!(Reading::from_wire(1, 0, true).unwrap_err().contains("set consumers (2 or more)"));
        assert!(Reading::from_wire(MAX_CONSUMERS + 1, 0, false).unwrap_err().contains("above the limit"));
        let shape = Reading::from_wire(2, 1, false).unwrap().shape();
        assert_eq!(shape.to_string(), "2 consumer(s), not coordinated");
        assert_eq!(Reading::Shared.shape(), JobShape { ranks: 1, coordinated: false });
    }
}
