//! Forks: new runs whose filesystems equal a parent's at one instant.
//!
//! The parent is captured once (frozen, its writable layer snapshotted in
//! constant time, thawed: see [`crate::lane::Sandbox::capture`]); each child is
//! an ordinary create whose writable layer starts as a writable snapshot of
//! that capture (`SandboxSpec::seed`), over the parent's image layers. No
//! data is copied: parent and children share blocks until one of them
//! writes, and never see each other's later writes.
//!
//! Running processes are not carried over: this kernel cannot checkpoint
//! processes (CRIU does not work here), so each child starts fresh, with
//! its own agent, on the forked filesystem.

use std::sync::Arc;

use runbox_types::{ErrorCode, ForkRequest, ForkResponse, Run, RunStatus};
use time::OffsetDateTime;
use ulid::Ulid;

use super::actor::Access;
use super::Manager;
use crate::error::CoreError;
use crate::lane::SandboxSpec;
use crate::store::RunRecord;
use crate::validate;

impl Manager {
    /// Forks run `id` into `req.count` new runs (see the module doc). All
    /// or nothing: if any child cannot be made, the others are destroyed
    /// and the error is the answer.
    ///
    /// Cancellation: the fork runs in a task of its own; a client that hangs
    /// up does not stop it (the children are listed like any run).
    pub async fn fork(
        self: &Arc<Self>,
        id: Ulid,
        req: ForkRequest,
    ) -> Result<ForkResponse, CoreError> {
        let started = std::time::Instant::now();
        let forked = self.fork_checked(id, req).await;
        self.context.report(|t| {
            t.started(
                crate::telemetry::Start::Fork,
                crate::telemetry::Outcome::of(&forked),
                started.elapsed(),
            )
        });
        forked
    }

    async fn fork_checked(
        self: &Arc<Self>,
        id: Ulid,
        req: ForkRequest,
    ) -> Result<ForkResponse, CoreError> {
        let max = self.config().max_fork_count;
        if req.count == 0 || req.count > max {
            return Err(CoreError::invalid(
                ErrorCode::BadRequest,
                format!(
                    "count must be 1 to {max} (--max-fork-count), got {}",
                    req.count
                ),
            ));
        }
        let ttl = validate::ttl(
            req.ttl_sec,
            self.config().default_ttl,
            self.config().max_ttl,
        )?;
        let parent = (*self.admit(id, Access::Open).await?.record).clone();
        let count = req.count;
        // Checked early, before the capture; the reservation checks again.
        let tally = self.context.ledger.tally();
        if tally.counted + count > self.config().max_runs {
            return Err(CoreError::Capacity(self.config().max_runs));
        }
        let owner = self.context.owner_of(parent.tenant.as_deref());
        if let Some(tenant) = owner.tenant() {
            owner.check_quota(tally.of(tenant), count)?;
        }
        let manager = self.clone();
        let point = req.point;
        tokio::spawn(async move { manager.fork_children(parent, point, count, ttl).await })
            .await
            .map_err(|e| CoreError::Store(format!("fork task failed: {e}")))?
    }

    async fn fork_children(
        self: Arc<Self>,
        parent: RunRecord,
        point: Option<Ulid>,
        count: usize,
        ttl: std::time::Duration,
    ) -> Result<ForkResponse, CoreError> {
        // Forks share the background budget with refills and teardowns.
        let share = count.min(self.budget_size) as u32;
        let _budget = self
            .budget
            .acquire_many(share)
            .await
            .map_err(|_| CoreError::Store("the background budget is closed".into()))?;
        // A history point is used as it is: nothing to freeze or copy.
        let capture = match point {
            Some(point) => self.point_capture(parent.id, point).await?,
            None => self.capture(parent.id, "forked").await?,
        };
        let seed = capture
            .upper
            .parent()
            .map(|p| p.to_path_buf())
            .ok_or_else(|| CoreError::Store("a capture without a directory".into()))?;
        // The layers are read and the children registered under the image
        // lock, so garbage collection sees them (as it does every create).
        let image_guard = self.image_lock.lock().await;
        let images = self.images.clone();
        let layers = parent.layers.clone();
        let image_layers = tokio::task::spawn_blocking(move || images.layer_dirs(&layers))
            .await
            .map_err(|e| CoreError::Store(format!("image lookup task failed: {e}")))??;
        let trust_pem = self.context.proxy_trust(parent.network);
        // The parent's warm generation, pinned until the children are in
        // the ledger (their entries hold it from then on).
        let (warm_mount, _warm_pin) = match &parent.warm {
            Some(volume) => {
                let (mount, pin) = self.warm_for_fork(volume)?;
                (Some(mount), pin)
            }
            None => (None, None),
        };
        let mut children = Vec::with_capacity(count);
        {
            let now = OffsetDateTime::now_utc();
            for _ in 0..count {
                let id = Ulid::new();
                let record = RunRecord {
                    id,
                    created_at: now,
                    expires_at: now + ttl,
                    status: RunStatus::Creating,
                    runtime: String::new(),
                    agent_socket: Default::default(),
                    lease: Default::default(),
                    idempotency: None,
                    failure: None,
                    pool: None,
                    restarts: 0,
                    restarted_at: None,
                    archived_at: None,
                    archive_error: None,
                    expired: false,
                    // A fork starts from its parent's files, never its
                    // volumes (a writer's volume has one holder).
                    volumes: Vec::new(),
                    proxy_ca: trust_pem.is_some(),
                    moved: false,
                    recovered: None,
                    restore_from: None,
                    ..parent.clone()
                };
                let spec = SandboxSpec {
                    id,
                    image_layers: image_layers.clone(),
                    limits: record.limits,
                    network: record.network,
                    trust_pem: trust_pem.clone(),
                    seed: Some(seed.clone()),
                    warm: warm_mount.clone(),
                    volumes: Vec::new(),
                };
                children.push((record, spec));
            }
        }
        // The children are reserved together, and their owners spawned
        // right after.
        let owner = self.context.owner_of(parent.tenant.as_deref());
        let ask = crate::ledger::Ask {
            owner: &owner,
            key: None,
            volumes: &[],
            dataset_ready: &crate::ledger::no_datasets,
            runs: count,
            max_runs: self.config().max_runs,
        };
        let entries = children
            .iter()
            .map(|(record, _)| {
                (
                    record.id,
                    super::entry(record, &super::phase::Phase::Creating),
                )
            })
            .collect();
        // Without a key there is no earlier create to answer with.
        self.context.ledger.reserve(ask, entries).await?;
        let answers: Vec<_> = children
            .into_iter()
            .map(|(record, spec)| self.spawn_creating(record, spec))
            .collect();
        drop(image_guard);
        let mut runs: Vec<Run> = Vec::with_capacity(count);
        let mut failure = None;
        // This task is never dropped mid-way, so every answer is taken.
        for (answer, delivered) in answers {
            let answer = answer.await;
            let _ = delivered.send(());
            match answer {
                Ok(Ok(run)) => runs.push(run),
                Ok(Err(e)) => failure = failure.or(Some(e)),
                Err(_) => {
                    failure = failure.or(Some(CoreError::Agent(
                        "a child's owner ended without an answer".into(),
                    )))
                }
            }
        }
        // Every child has its own copy now.
        drop(capture);
        if let Some(e) = failure {
            for run in &runs {
                let _ = self.delete(run.id).await;
            }
            return Err(e);
        }
        tracing::info!(parent = %parent.id, children = runs.len(), "run forked");
        Ok(ForkResponse {
            runs,
            volumes_excluded: parent.volumes.iter().map(|v| v.name.clone()).collect(),
        })
    }
}
