//! Start-up reconciliation: every stored record gets an owner again.
//!
//! 1. Each record is judged, many at once (at most [`CONCURRENCY`] probing
//!    the runtime and the agents together):
//!    * `running`, not expired, sandbox alive and agent answering: re-adopted
//!      as running, its egress proxy and init watch restarted;
//!    * `paused`: re-adopted frozen, as it was;
//!    * `hibernated` (or being hibernated when the daemon died): kept
//!      hibernated, whatever is left of its sandbox but its disk stopped;
//!    * `running` or `paused` whose sandbox is gone or whose agent is
//!      silent: the restart policy applies (`cold` boots it again on its
//!      disk; `none` marks it failed);
//!    * `failed` and not expired: kept as failed until its TTL, so the
//!      caller still sees why it died;
//!    * past its TTL with `onExpire: pause | hibernate` not applied yet:
//!      adopted, and its owner applies it at once;
//!    * anything else (a crash mid-create or mid-teardown, a dead sandbox,
//!      an expired run): given an owner that destroys it at once, under the
//!      shared teardown budget, retrying with backoff if that fails.
//! 2. Once every doomed run's first teardown attempt is over, the lane
//!    sweeps whatever it made that no record claims (a crash between its
//!    first step and the record).

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use runbox_types::{ExitReason, RunStatus};
use time::OffsetDateTime;

use super::actor::{Adopted, RunActor};
use super::phase::Phase;
use super::{error_chain, wait_ready, Manager};
use crate::error::CoreError;
use crate::store::RunRecord;

/// How many stored runs are judged at once.
const CONCURRENCY: usize = 16;

/// How long a surviving agent gets to answer after a restart.
const READOPT_TIMEOUT: Duration = Duration::from_secs(3);

impl Manager {
    pub(super) async fn reconcile(self: &Arc<Self>) -> Result<(), CoreError> {
        let records = self.store.list()?;
        let records = self.fill_in_layers(records).await?;
        // Records from before `proxy_ca` was kept: their sandboxes trusted
        // the interception CA when they had secrets or were allowlist pool
        // members, as the rule was then.
        let records: Vec<RunRecord> = records
            .into_iter()
            .map(|mut record| {
                record.proxy_ca |= record.network == runbox_types::NetworkTier::Allowlist
                    && (record.egress.has_secrets() || record.pool.is_some());
                record
            })
            .collect();
        let keep: HashSet<_> = records.iter().map(|r| r.id).collect();
        let verdicts: Vec<(RunRecord, Adopted)> = futures::stream::iter(records)
            .map(|record| async move {
                let verdict = self.judge(&record).await;
                (record, verdict)
            })
            .buffer_unordered(CONCURRENCY)
            .collect()
            .await;
        let mut waiters = Vec::new();
        for (record, adopted) in verdicts {
            let id = record.id;
            let phase = match &adopted {
                Adopted::Running(..) => {
                    tracing::info!(run = %id, "re-adopted a live run");
                    Phase::Running
                }
                Adopted::Paused(_) => {
                    tracing::info!(run = %id, "re-adopted a paused run");
                    Phase::Paused
                }
                Adopted::Failed => {
                    tracing::info!(run = %id, "kept a failed run until its TTL");
                    Phase::Failed(record.failure.clone().unwrap_or_default())
                }
                Adopted::Hibernated => {
                    tracing::info!(run = %id, "kept a hibernated run");
                    Phase::Hibernated
                }
                Adopted::Archived => {
                    tracing::info!(run = %id, "kept an archived run");
                    Phase::Archived
                }
                Adopted::Dead(why) => {
                    tracing::info!(run = %id, reason = %why, "a run's sandbox did not survive; applying the restart policy");
                    match record.status {
                        RunStatus::Paused => Phase::Paused,
                        _ => Phase::Running,
                    }
                }
                Adopted::Doomed(_) => {
                    tracing::info!(run = %id, status = ?record.status, "cleaning up a run that did not survive");
                    // The owner stops it first thing; any phase that can
                    // stop will do, so take the one the record names.
                    match record.status {
                        RunStatus::Creating => Phase::Creating,
                        RunStatus::Failed => {
                            Phase::Failed(record.failure.clone().unwrap_or_default())
                        }
                        RunStatus::Running | RunStatus::Stopping | RunStatus::Lost => {
                            Phase::Running
                        }
                        RunStatus::Paused => Phase::Paused,
                        RunStatus::Hibernated => Phase::Hibernated,
                        RunStatus::Archived => Phase::Archived,
                    }
                }
            };
            // On the ledger as it stands, without the checks: it exists.
            self.context.ledger.enter(id, super::entry(&record, &phase));
            let actor = RunActor::new(self.context.clone(), record, phase);
            self.registry().insert(id, actor.handle().clone());
            waiters.push(actor.spawn_adopted(adopted));
        }
        for waiter in waiters {
            let _ = waiter.await;
        }
        match self.lane.sweep(&keep).await {
            Ok(swept) if !swept.is_empty() => {
                tracing::info!(count = swept.len(), "removed leftover sandboxes")
            }
            Ok(_) => {}
            Err(e) => {
                tracing::error!(error = %error_chain(&e), "sweeping leftover sandboxes failed")
            }
        }
        Ok(())
    }

    /// What becomes of a stored run.
    /// Records from before runs kept their layer digests get their image's
    /// current layers (images could not be replaced then, so these are the
    /// ones the run mounts), stored durably before anything can replace
    /// the image and collect them.
    async fn fill_in_layers(&self, records: Vec<RunRecord>) -> Result<Vec<RunRecord>, CoreError> {
        let (images, store) = (self.images.clone(), self.store.clone());
        tokio::task::spawn_blocking(move || {
            let mut out = Vec::with_capacity(records.len());
            for mut record in records {
                if record.layers.is_empty() {
                    if let Ok((layers, _, _)) = images.for_run(&record.image) {
                        record.layers = layers;
                        store.put(&record)?;
                    }
                }
                out.push(record);
            }
            Ok(out)
        })
        .await
        .map_err(|e| CoreError::Store(format!("reconcile task failed: {e}")))?
    }

    async fn judge(&self, record: &RunRecord) -> Adopted {
        let id = record.id;
        // A run whose TTL passed meanwhile with `onExpire: pause |
        // hibernate` still to apply is adopted; its owner applies it.
        let sleeps_at_expiry =
            record.on_expire != runbox_types::OnExpire::Delete && !record.expired;
        if record.expires_at <= OffsetDateTime::now_utc()
            && !(sleeps_at_expiry
                && matches!(
                    record.status,
                    RunStatus::Running
                        | RunStatus::Paused
                        | RunStatus::Hibernated
                        | RunStatus::Archived
                ))
        {
            return Adopted::Doomed(ExitReason::RunExpired);
        }
        // A claim is stored without waiting for the disk, so a member whose
        // record says idle may have been handed out just before the crash:
        // it is destroyed, never handed out a second time. Pools refill.
        if record.is_idle_member() {
            tracing::info!(run = %id, "destroying an idle pool member of the last daemon; its pool refills");
            return Adopted::Doomed(ExitReason::RunDeleted);
        }
        let paused = match record.status {
            RunStatus::Failed => return Adopted::Failed,
            RunStatus::Hibernated => return Adopted::Hibernated,
            RunStatus::Archived => return Adopted::Archived,
            RunStatus::Running => false,
            RunStatus::Paused => true,
            // A node never stores a run as lost (only the fleet's
            // catalog says so); such a record is ended.
            RunStatus::Creating | RunStatus::Stopping | RunStatus::Lost => {
                return Adopted::Doomed(ExitReason::RunDeleted)
            }
        };
        let Ok(Some(sandbox)) = self.lane.adopt(id, paused).await else {
            return Adopted::Dead("the run's sandbox did not survive the daemon's restart".into());
        };
        let agent = sandbox.agent().client();
        if paused {
            // Frozen again if the last daemon died while resuming it: it is
            // as its record says. Its agent cannot answer until it resumes.
            match sandbox.suspend().await {
                Ok(()) => return Adopted::Paused(agent),
                Err(e) => {
                    tracing::warn!(run = %id, error = %e, "could not keep the run paused; it runs");
                    if let Err(e) = sandbox.resume().await {
                        tracing::warn!(run = %id, error = %e, "could not thaw the run");
                    }
                }
            }
        }
        match wait_ready(agent.clone(), READOPT_TIMEOUT).await {
            Ok(protocol) => Adopted::Running(agent, protocol),
            Err(e) => {
                tracing::warn!(run = %id, error = %e, "run's agent does not answer after the restart");
                Adopted::Dead(format!(
                    "the run's agent did not answer after the daemon's restart: {e}"
                ))
            }
        }
    }
}
