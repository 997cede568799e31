//! Polling with a deadline instead of sleeping and hoping.

use std::fmt::Display;
use std::future::Future;
use std::time::{Duration, Instant};

/// What one look at the condition found.
#[derive(Debug)]
pub enum Check<T> {
    /// The condition holds; `wait_for` returns the value.
    Done(T),
    /// Not yet; the text describes what was observed (it ends up in the timeout error).
    NotYet(String),
    /// It never will (e.g. a process died, a pipeline turned Invalid): stop waiting and fail
    /// with this reason.
    Abort(String),
}

impl<T> Check<T> {
    pub fn not_yet(observed: impl Display) -> Self {
        Check::NotYet(observed.to_string())
    }
}

/// Polls `check` until it returns [`Check::Done`], or fails after `timeout` saying what it
/// waited for (`what`) and the last observed state. An `Err` from `check` counts as an
/// observation (the object may not exist yet) and polling goes on.
pub async fn wait_for<T, F, Fut>(timeout: Duration, what: impl Display, mut check: F) -> anyhow::Result<T>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = anyhow::Result<Check<T>>>,
{
    let start = Instant::now();
    let mut interval = Duration::from_millis(100);
    let mut last = String::from("(not checked yet)");
    let mut polls = 0u32;
    loop {
        polls += 1;
        let remaining = timeout.saturating_sub(start.elapsed());
        match tokio::time::timeout(remaining.max(Duration::from_millis(100)), check()).await {
            Ok(Ok(Check::Done(value))) => return Ok(value),
            Ok(Ok(Check::NotYet(observed))) => last = observed,
            Ok(Ok(Check::Abort(reason))) => {
                anyhow::bail!("gave up waiting for {what} after {:.1?}: {reason}", start.elapsed())
            }
            Ok(Err(e)) => last = format!("error: {e:#}"),
            Err(_) => last = format!("the check itself did not finish in time (before that: {last})"),
        }
        if start.elapsed() >= timeout {
            anyhow::bail!(
                "timed out after {:.1?} waiting for {what} ({polls} checks); last observed: {last}",
                start.elapsed()
            );
        }
        let remaining = timeout.saturating_sub(start.elapsed());
        tokio::time::sleep(interval.min(remaining)).await;
        interval = (interval * 3 / 2).min(Duration::from_secs(1));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn returns_the_value_or_says_what_it_saw() {
        let mut n = 0;
        let v = wait_for(Duration::from_secs(5), "n to reach 3", || {
            n += 1;
            let n = n;
            async move { Ok(if n >= 3 { Check::Done(n) } else { Check::not_yet(format!("n = {n}")) }) }
        })
        .await
        .unwrap();
        assert_eq!(v, 3);

        let err = wait_for(Duration::from_millis(300), "never", || async { Ok(Check::<()>::not_yet("still no")) })
            .await
            .unwrap_err()
            .to_string();
        assert!(err.contains("waiting for never") && err.contains("last observed: still no"), "{err}");
    }
}
