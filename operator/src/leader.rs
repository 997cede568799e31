//! Leader election on a coordination.k8s.io/v1 Lease: one operator process reconciles and serves
//! the dispatcher; the others wait, report not-ready, and take over when the lease expires.
//!
//! Expiry is judged by this process's own clock from the moment it last saw the lease record
//! change, not from the timestamps inside it, so clock skew between nodes cannot make two
//! leaders.

use std::time::{Duration, Instant};

use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta};
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, PostParams};
use tokio::sync::watch;
use tracing::{info, warn};

#[derive(Clone, Debug)]
pub struct LeaseConfig {
    pub namespace: String,
    pub name: String,
    pub identity: String,
    pub lease_duration: Duration,
    pub renew_every: Duration,
}

pub struct LeaderElector {
    api: Api<Lease>,
    config: LeaseConfig,
    /// The record last seen (holder, renew time) and when we saw it change.
    observed: Option<(Option<String>, Option<MicroTime>, Instant)>,
    /// When this process last wrote the lease as its holder.
    last_renewed: Option<Instant>,
}

impl LeaderElector {
    pub fn new(client: kube::Client, config: LeaseConfig) -> Self {
        LeaderElector { api: Api::namespaced(client, &config.namespace), config, observed: None, last_renewed: None }
    }

    /// Tries to acquire or renew until `shutdown` fires; publishes leadership on `tx`. On
    /// shutdown a leader releases the lease so a standby takes over at once.
    pub async fn run(mut self, tx: watch::Sender<bool>, mut shutdown: watch::Receiver<bool>) {
        loop {
            // A hung request must not keep a leader leading past its lease: give up on a renewal
            // well before a standby could see the lease expire.
            let renew_deadline = self.config.lease_duration * 2 / 3;
            let attempt = tokio::time::timeout(renew_deadline, self.try_acquire_or_renew()).await;
            let leading = match attempt {
                Ok(Ok(leading)) => leading,
                failed => {
                    let error = match failed {
                        Ok(Err(e)) => e.to_string(),
                        _ => format!("no answer within {renew_deadline:?}"),
                    };
                    warn!(%error, "lease update failed");
                    // Keep leading only while our last renewal is recent enough that no standby
                    // can have taken over.
                    *tx.borrow() && self.last_renewed.is_some_and(|t| t.elapsed() < renew_deadline)
                }
            };
            if leading != *tx.borrow() {
                info!(identity = %self.config.identity, leading, "leadership changed");
            }
            tx.send_replace(leading);
            tokio::select! {
                _ = tokio::time::sleep(self.config.renew_every) => {}
                _ = shutdown.wait_for(|stop| *stop) => break,
            }
        }
        if *tx.borrow() {
            if let Err(e) = self.release().await {
                warn!(error = %e, "could not release the lease");
            }
            tx.send_replace(false);
        }
    }

    async fn try_acquire_or_renew(&mut self) -> Result<bool, kube::Error> {
        let now = MicroTime(Timestamp::now());
        let me = &self.config.identity;
        let Some(mut lease) = self.api.get_opt(&self.config.name).await? else {
            let lease = Lease {
                metadata: ObjectMeta { name: Some(self.config.name.clone()), ..Default::default() },
                spec: Some(self.spec(None, now.clone(), 0)),
            };
            return match self.api.create(&PostParams::default(), &lease).await {
                Ok(_) => {
                    self.observed = Some((Some(me.clone()), Some(now), Instant::now()));
                    self.last_renewed = Some(Instant::now());
                    Ok(true)
                }
                Err(kube::Error::Api(e)) if e.code == 409 => Ok(false),
                Err(e) => Err(e),
            };
        };
        let spec = lease.spec.clone().unwrap_or_default();
        let holder = spec.holder_identity.clone().filter(|h| !h.is_empty());
        let record = (holder.clone(), spec.renew_time.clone());
        let changed = self.observed.as_ref().is_none_or(|(h, r, _)| (h, r) != (&record.0, &record.1));
        if changed {
            self.observed = Some((record.0.clone(), record.1.clone(), Instant::now()));
        }
        let seen_at = self.observed.as_ref().map(|o| o.2).unwrap_or_else(Instant::now);
        let duration =
            spec.lease_duration_seconds.map_or(self.config.lease_duration, |s| Duration::from_secs(s.max(1) as u64));
        let held_by_me = holder.as_deref() == Some(me.as_str());
        let expired = holder.is_none() || seen_at.elapsed() >= duration;
        if !held_by_me && !expired {
            return Ok(false);
        }
        let transitions = spec.lease_transitions.unwrap_or(0) + i32::from(!held_by_me);
        let acquired = if held_by_me { spec.acquire_time } else { None };
        lease.spec = Some(self.spec(acquired, now.clone(), transitions));
        // replace carries the resourceVersion we read: of two contenders exactly one wins.
        match self.api.replace(&self.config.name, &PostParams::default(), &lease).await {
            Ok(_) => {
                self.observed = Some((Some(me.clone()), Some(now), Instant::now()));
                self.last_renewed = Some(Instant::now());
                Ok(true)
            }
            Err(kube::Error::Api(e)) if e.code == 409 => Ok(false),
            Err(e) => Err(e),
        }
    }

    fn spec(&self, acquire_time: Option<MicroTime>, now: MicroTime, transitions: i32) -> LeaseSpec {
        LeaseSpec {
            holder_identity: Some(self.config.identity.clone()),
            lease_duration_seconds: Some(self.config.lease_duration.as_secs() as i32),
            acquire_time: Some(acquire_time.unwrap_or_else(|| now.clone())),
            renew_time: Some(now),
            lease_transitions: Some(transitions),
            ..Default::default()
        }
    }

    async fn release(&self) -> Result<(), kube::Error> {
        let Some(mut lease) = self.api.get_opt(&self.config.name).await? else { return Ok(()) };
        let Some(spec) = lease.spec.as_mut() else { return Ok(()) };
        if spec.holder_identity.as_deref() != Some(self.config.identity.as_str()) {
            return Ok(());
        }
        spec.holder_identity = None;
        spec.lease_duration_seconds = Some(1);
        self.api.replace(&self.config.name, &PostParams::default(), &lease).await?;
        info!(identity = %self.config.identity, "released the lease");
        Ok(())
    }
}
