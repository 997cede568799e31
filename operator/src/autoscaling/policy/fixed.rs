//! A fixed, hand-sized pool: the count a user picks and leaves (`autoscaling.mode: Fixed`).
//! Nothing to decide; in comparisons it is sized at the measured optimum (the best a user who
//! profiled the job by hand can do) and at a multiple of it (a user who sized for safety).

use stoker_api::window::Window;

use super::{Decision, Policy, PolicyState};

pub struct Fixed;

impl Policy for Fixed {
    fn observe(&mut self, _window: &Window) -> Decision {
        Decision::Hold
    }

    fn idle(&mut self) -> Decision {
        Decision::Hold
    }

    fn state(&self) -> PolicyState {
        PolicyState::Converged
    }
}
