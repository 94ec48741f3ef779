//! Runs that change nodes in a fleet.
//!
//! A run's row in the fleet's catalog names its owner, and only the owner
//! writes the row. A run changes owner in one compare-and-set on that
//! row: handed to another node by its owner once it is archived (a move),
//! or taken over by another node when it is archived and its owner is
//! gone or does not answer. The new owner makes the run from the record
//! the row carries (sealed under the fleet's key) and restores it, when it
//! is next called, from the archive in the checkpoint bucket both nodes
//! use. An old owner that finds one of its runs is another node's ends its
//! own copy (fencing): at start before it serves, every [`FENCE_EVERY`],
//! and whenever it is about to restore one.

use std::sync::Arc;
use std::time::Duration;

use runbox_types::{ErrorCode, NetworkTier, Run, RunStatus};
use ulid::Ulid;

use super::actor::{Adopted, Command, RunActor};
use super::phase::Phase;
use super::{error_chain, lock, Manager};
use crate::error::CoreError;
use crate::fleet::{Located, Takeover, Want};

/// How often a node of a fleet looks for its runs that other nodes hold.
const FENCE_EVERY: Duration = Duration::from_secs(10);

/// How often the node that holds the fleet's node-loss lease decides on
/// the runs of nodes that are gone.
const NODE_LOSS_EVERY: Duration = Duration::from_secs(5);

/// How many such runs one round decides on.
const NODE_LOSS_BATCH: usize = 200;

/// Run `id` cannot move, for `why`.
pub(crate) fn not_movable(id: Ulid, why: &str) -> CoreError {
    CoreError::Conflict {
        code: ErrorCode::NotMovable,
        message: format!("run {id} cannot move: {why}"),
    }
}

/// What a node's lane must do for a run on `network`, by capability name.
pub(super) fn needs(network: NetworkTier) -> Vec<String> {
    match network {
        NetworkTier::Allowlist => vec!["allowlist".to_owned()],
        NetworkTier::Open => vec!["open".to_owned()],
        _ => Vec::new(),
    }
}

/// What a move asks of the node it goes to.
pub(super) struct Destination<'a> {
    /// The node the caller named, if any.
    pub(super) to: Option<String>,
    /// The checkpoint bucket it must share.
    pub(super) bucket: String,
    /// What its lane must do, by capability name.
    pub(super) needs: Vec<String>,
    /// The images it would best have.
    pub(super) images: Vec<String>,
    /// Whose it is.
    pub(super) tenant: Option<String>,
    /// What moves, for messages (`run <id>`).
    pub(super) what: &'a str,
    /// The refusal for a reason.
    pub(super) refuse: &'a (dyn Fn(&str) -> CoreError + Sync),
}

impl Manager {
    /// This node's checkpoint store when it is a bucket other nodes may
    /// share.
    pub(super) fn shared_bucket(&self) -> Option<String> {
        self.config()
            .checkpoints
            .as_ref()
            .map(|s| s.location().to_owned())
            .filter(|l| l.starts_with("s3://"))
    }

    /// Makes run `id` this node's from the fleet's catalog when it may
    /// (see [`crate::fleet::Fleet::take_run`]): handed to this node by a
    /// move, or asleep on a node that is gone (or did not answer, `how`).
    /// The run is made archived; the call that brought it here restores
    /// it. Whether this node holds the run now.
    pub async fn adopt(self: &Arc<Self>, id: Ulid, how: Takeover) -> Result<bool, CoreError> {
        let Some(fleet) = self.fleet().cloned() else {
            return Ok(false);
        };
        let _one = self.context.adopt_lock.lock().await;
        if self.registry().contains_key(&id) {
            return Ok(true);
        }
        if self.context.ended_here(id) {
            return Ok(false);
        }
        let Some(sealed) = fleet.take_run(id, how).await? else {
            return Ok(false);
        };
        let mut record = self.context.open_record(id, &sealed)?;
        // What was the other node's own: its sandbox, its layer keys, its
        // pool. The run's files are in its archive.
        record.status = RunStatus::Archived;
        record.runtime.clear();
        record.agent_socket = Default::default();
        record.layers.clear();
        record.warm = None;
        record.pool = None;
        record.proxy_ca = false;
        record.failure = None;
        record.archive_error = None;
        record
            .archived_at
            .get_or_insert_with(time::OffsetDateTime::now_utc);
        if !record.volumes.is_empty() {
            let names: Vec<&str> = record.volumes.iter().map(|v| v.name.as_str()).collect();
            tracing::warn!(run = %id, volumes = ?names, "a run taken over from another node comes back without the volumes it mounted there");
            record.volumes.clear();
        }
        self.store.put_async(record.clone()).await?;
        self.context
            .ledger
            .enter(id, super::entry(&record, &Phase::Archived));
        let actor = RunActor::new(self.context.clone(), record.clone(), Phase::Archived);
        self.registry().insert(id, actor.handle().clone());
        let _ = actor.spawn_adopted(Adopted::Archived).await;
        self.context.catalog(&record, &Phase::Archived);
        tracing::info!(run = %id, "run made here from the fleet's catalog (moved or taken over)");
        Ok(true)
    }

    /// Ends this node's copies of runs the fleet's catalog says another
    /// node holds now; how many.
    pub async fn fence(&self) -> Result<usize, CoreError> {
        let Some(fleet) = self.fleet().cloned() else {
            return Ok(0);
        };
        let ids: Vec<Ulid> = self.registry().keys().copied().collect();
        let superseded = fleet.superseded_runs(&ids).await?;
        for id in &superseded {
            let handle = self.registry().get(id).cloned();
            if let Some(handle) = handle {
                tracing::warn!(run = %id, "another node holds this run now; ending this node's copy");
                if let Err(e) = handle.ask(|reply| Command::Relinquish { reply }).await {
                    tracing::warn!(run = %id, error = %error_chain(&e), "could not end this node's copy of a run another node holds");
                }
            }
        }
        Ok(superseded.len())
    }

    /// Refuses a state directory whose runs the fleet's catalog has as
    /// another node's that they never moved from this one to: it was that
    /// node's (started here with another `--node-id`), and serving its runs
    /// under this id would fight that node's rows.
    pub async fn check_ownership(&self) -> Result<(), CoreError> {
        let Some(fleet) = self.fleet().cloned() else {
            return Ok(());
        };
        let ids: Vec<Ulid> = self.registry().keys().copied().collect();
        let strangers = fleet.stranger_runs(&ids).await?;
        let Some((id, node)) = strangers.first() else {
            return Ok(());
        };
        Err(CoreError::invalid(
            ErrorCode::BadRequest,
            format!(
                "this state directory holds {} run(s) the fleet's catalog has as node {node:?}'s                  (run {id}, among others): start this node with --node-id {node}",
                strangers.len()
            ),
        ))
    }

    /// Fences every [`FENCE_EVERY`] (see [`Manager::fence`]).
    pub fn spawn_fence(self: &Arc<Self>) {
        let manager = Arc::downgrade(self);
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(FENCE_EVERY);
            tick.tick().await;
            loop {
                tick.tick().await;
                let Some(manager) = manager.upgrade() else {
                    return;
                };
                if let Err(e) = manager.fence().await {
                    tracing::debug!(error = %error_chain(&e), "could not look for runs other nodes hold");
                }
            }
        });
    }

    /// Moves run `id` to node `to` (the best node that can take it when
    /// None): archived here, handed over in the catalog, this node's copy
    /// ended. The node it went to, and whether it was awake (that node
    /// boots it then); the caller tells that node.
    pub async fn move_run(
        self: &Arc<Self>,
        id: Ulid,
        to: Option<String>,
    ) -> Result<(Located, bool), CoreError> {
        let Some(fleet) = self.fleet().cloned() else {
            return Err(not_movable(id, "this node is not part of a fleet"));
        };
        let Some(bucket) = self.shared_bucket() else {
            return Err(not_movable(
                id,
                "its node's checkpoint store is not a bucket other nodes can share \
                 (--checkpoint-store s3://...)",
            ));
        };
        let handle = self.handle(id)?;
        let record = handle.snapshot().record.clone();
        if !record.volumes.is_empty() {
            let names: Vec<&str> = record.volumes.iter().map(|v| v.name.as_str()).collect();
            return Err(not_movable(
                id,
                &format!(
                    "it mounts volume(s) {}, which stay on this node; delete it and create it \
                     on the other node, or move the volumes first",
                    names.join(", ")
                ),
            ));
        }
        if self.config().sealer.is_none() {
            return Err(not_movable(
                id,
                "this node has no sealing key for the run's record",
            ));
        }
        let target = self
            .destination(
                &fleet,
                Destination {
                    to,
                    bucket,
                    needs: needs(record.network),
                    images: vec![record.image.clone()],
                    tenant: record.tenant.clone(),
                    what: &format!("run {id}"),
                    refuse: &|why| not_movable(id, why),
                },
            )
            .await?;
        let to = target.node.clone();
        let awake = handle.ask(|reply| Command::MoveOut { to, reply }).await?;
        Ok((target, awake))
    }

    /// The node a move goes to: `dest.to` when that node can take it, else
    /// the node placement picks among those that share the bucket.
    pub(super) async fn destination(
        &self,
        fleet: &Arc<dyn crate::fleet::Fleet>,
        dest: Destination<'_>,
    ) -> Result<Located, CoreError> {
        let here = self.config().server_id.clone();
        let refuse = dest.refuse;
        match dest.to {
            Some(node) if node == here => Err(CoreError::invalid(
                ErrorCode::BadRequest,
                format!("{} is on node {node} already", dest.what),
            )),
            Some(node) => {
                let nodes = fleet.nodes().await?;
                let Some(found) = nodes.into_iter().find(|n| n.id == node) else {
                    return Err(refuse(&format!(
                        "the fleet has no node {node:?} (GET /v1/cluster lists them)"
                    )));
                };
                let bucket = &dest.bucket;
                let lacks: Vec<&String> = dest
                    .needs
                    .iter()
                    .filter(|n| !found.capabilities.contains(n))
                    .collect();
                let why = if found.state != runbox_types::NodeState::Active {
                    Some(format!("node {node} is {:?}", found.state).to_lowercase())
                } else if found.checkpoint_store.as_deref() != Some(bucket.as_str()) {
                    Some(format!(
                        "node {node} does not use this node's checkpoint bucket {bucket}"
                    ))
                } else if !lacks.is_empty() {
                    Some(format!(
                        "node {node} cannot do what it needs ({})",
                        lacks
                            .iter()
                            .map(|s| s.as_str())
                            .collect::<Vec<_>>()
                            .join(", ")
                    ))
                } else if found.runs >= found.capacity {
                    Some(format!("node {node} is full ({} runs)", found.runs))
                } else {
                    None
                };
                if let Some(why) = why {
                    return Err(refuse(&why));
                }
                Ok(Located {
                    advertise: found.advertise.unwrap_or_default(),
                    node: found.id,
                    tenant: dest.tenant,
                    gone: false,
                    silent_sec: found.last_seen_sec,
                    archived: false,
                    lost: false,
                    portable: true,
                })
            }
            None => {
                let want = Want {
                    images: dest.images,
                    pullable: true,
                    tenant: dest.tenant,
                    here,
                    here_full: true,
                    here_has: (false, false),
                    volumes: Vec::new(),
                    here_has_volumes: true,
                    checkpoint_store: Some(dest.bucket),
                    needs: dest.needs,
                    here_can: false,
                };
                fleet.place(&want).await?.ok_or_else(|| {
                    refuse(
                        "no other node of the fleet can take it now (none heard from shares \
                         this node's checkpoint bucket, can do what it needs and has room)",
                    )
                })
            }
        }
    }

    /// The node an asleep run of a node that is gone is best restored on,
    /// when it is another than this one (None: this one).
    pub async fn place_asleep(&self, run: &Run) -> Result<Option<Located>, CoreError> {
        let (Some(fleet), Some(bucket)) = (self.fleet(), self.shared_bucket()) else {
            return Ok(None);
        };
        let here_full = self.context.ledger.tally().counted >= self.config().max_runs
            || lock(&self.context.pools).draining();
        let want = Want {
            images: vec![run.image.clone()],
            pullable: true,
            tenant: run.tenant.clone(),
            here: self.config().server_id.clone(),
            here_full,
            here_has: (
                self.images.resolve(&run.image).ok().flatten().is_some(),
                false,
            ),
            volumes: Vec::new(),
            here_has_volumes: true,
            checkpoint_store: Some(bucket),
            needs: needs(run.network),
            here_can: needs(run.network)
                .iter()
                .all(|n| self.capabilities().contains(n)),
        };
        fleet.place(&want).await
    }

    /// Moves archived run `id` of this node, about to be woken, to the
    /// node placement picks when this node has no room for it now (full,
    /// or cordoned): that node (the call goes there). None: it wakes here
    /// (room here, not archived or not in a bucket another node shares,
    /// or no other node can take it). Nothing of an archived run is on
    /// this node but its record, so the move is a hand-off in the catalog.
    pub async fn relocate_asleep(self: &Arc<Self>, id: Ulid) -> Result<Option<Located>, CoreError> {
        if self.fleet().is_none() || self.shared_bucket().is_none() {
            return Ok(None);
        }
        let handle = self.handle(id)?;
        if handle.snapshot().record.status != RunStatus::Archived {
            return Ok(None);
        }
        let full = self.context.ledger.tally().counted >= self.config().max_runs
            || lock(&self.context.pools).draining();
        if !full {
            return Ok(None);
        }
        let run = self.view(&handle);
        let best = match self.place_asleep(&run).await {
            Ok(Some(best)) => best,
            Ok(None) => return Ok(None),
            Err(e) => {
                tracing::warn!(run = %id, error = %error_chain(&e), "no placement for an archived run this node has no room to wake");
                return Ok(None);
            }
        };
        match self.move_run(id, Some(best.node)).await {
            Ok((target, _)) => {
                tracing::info!(run = %id, node = %target.node, "archived run moved to wake where there is room");
                Ok(Some(target))
            }
            // A run that mounts volumes, a target that filled up in the
            // meantime, the database or the bucket away: it wakes here if
            // it can, or says why not (a copy that did move answers
            // run_moved).
            Err(e) => {
                tracing::warn!(run = %id, error = %error_chain(&e), "an archived run this node has no room to wake did not move");
                Ok(None)
            }
        }
    }

    /// See [`crate::RunService::locate`].
    pub async fn locate(
        self: &Arc<Self>,
        id: Ulid,
        relayed: bool,
    ) -> Result<Option<Located>, CoreError> {
        let Some(fleet) = self.fleet().cloned() else {
            return Ok(None);
        };
        let Some(at) = fleet.locate(id).await? else {
            return Ok(None);
        };
        if at.node == self.config().server_id {
            // Handed here by a move: made here from the catalog.
            self.adopt(id, Takeover::Gone).await?;
            return Ok(None);
        }
        if !(at.archived && at.portable) {
            return Ok(Some(at));
        }
        // Nothing of an archived run is on its node: it never waits for a
        // node that is gone or does not answer.
        let how = if at.gone {
            Takeover::Gone
        } else if !answers(&at.advertise).await {
            Takeover::Unreachable
        } else {
            return Ok(Some(at));
        };
        if !relayed {
            if let Some(run) = fleet.run(id).await? {
                if let Some(best) = self.place_asleep(&run).await? {
                    return Ok(Some(Located {
                        tenant: at.tenant.clone(),
                        ..best
                    }));
                }
            }
        }
        match self.adopt(id, how).await? {
            true => Ok(None),
            false => Ok(Some(at)),
        }
    }
}

/// Whether a node's API at `advertise` takes a connection within a second.
async fn answers(advertise: &str) -> bool {
    matches!(
        tokio::time::timeout(
            Duration::from_secs(1),
            tokio::net::TcpStream::connect(advertise)
        )
        .await,
        Ok(Ok(_))
    )
}

impl Manager {
    /// Every [`NODE_LOSS_EVERY`], on the node that holds the fleet's lease
    /// on it: decides on the runs of nodes that are gone
    /// ([`Manager::settle_orphans`]).
    pub fn spawn_node_loss(self: &Arc<Self>) {
        let manager = Arc::downgrade(self);
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(NODE_LOSS_EVERY);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tick.tick().await;
                let Some(manager) = manager.upgrade() else {
                    return;
                };
                let Some(fleet) = manager.fleet().cloned() else {
                    return;
                };
                match fleet.singleton("node loss", NODE_LOSS_EVERY * 3).await {
                    Ok(Some(_)) => {}
                    Ok(None) => continue,
                    Err(e) => {
                        tracing::debug!(error = %error_chain(&e), "could not take the fleet's node-loss lease");
                        continue;
                    }
                }
                match manager.settle_orphans().await {
                    Ok(0) => {}
                    Ok(n) => tracing::info!(runs = n, "decided on runs of nodes that are gone"),
                    Err(e) => {
                        tracing::warn!(error = %error_chain(&e), "could not decide on the runs of nodes that are gone")
                    }
                }
            }
        });
    }

    /// Decides on each run of a node that is gone, by its `onNodeLoss`:
    /// `restore` makes it an archived run that comes back from its latest
    /// checkpoint in the bucket the nodes share (on the node its next call
    /// reaches, as any archived run of a gone node), `lost` (or nothing to
    /// come back from) marks it lost with the reason. Archived runs need
    /// nothing: they wake anywhere. How many were decided.
    pub(crate) async fn settle_orphans(&self) -> Result<usize, CoreError> {
        let Some(fleet) = self.fleet().cloned() else {
            return Ok(0);
        };
        let orphans = fleet.orphans(NODE_LOSS_BATCH).await?;
        if orphans.is_empty() {
            return Ok(0);
        }
        let bucket = self.shared_bucket();
        let shares = |orphan: &crate::fleet::Orphan| {
            bucket.is_some() && orphan.store.as_deref() == bucket.as_deref()
        };
        let checkpoints = match orphans.iter().any(shares) {
            true => self
                .checkpoint_store()?
                .list()
                .await?
                .into_iter()
                .map(|commit| commit.checkpoint)
                .collect(),
            false => Vec::new(),
        };
        let mut settled = 0;
        for orphan in &orphans {
            let record = orphan
                .record
                .as_deref()
                .map(|sealed| self.context.open_record(orphan.id, sealed));
            let record = match record {
                Some(Ok(record)) => Some(record),
                Some(Err(e)) => {
                    tracing::warn!(run = %orphan.id, error = %error_chain(&e), "a run of a node that is gone has a record this node cannot open");
                    None
                }
                None => None,
            };
            let latest = checkpoints
                .iter()
                .filter(|c| c.run == orphan.id && shares(orphan))
                .max_by_key(|c| c.created_at);
            let (run, sealed) =
                match (record, latest) {
                    (Some(record), Some(checkpoint))
                        if record.on_node_loss == runbox_types::OnNodeLoss::Restore =>
                    {
                        let mut record = record;
                        let state_at = checkpoint.created_at;
                        record.status = RunStatus::Archived;
                        record.restore_from = Some(checkpoint.id);
                        record.archived_at = Some(time::OffsetDateTime::now_utc());
                        record.failure = None;
                        record.recovered = Some(runbox_types::Recovered {
                            node: orphan.node.clone(),
                            checkpoint: checkpoint.id,
                            state_at,
                            lost: format!(
                                "its processes and memory, and what it wrote after checkpoint {} \
                             was taken at {}",
                                checkpoint.id,
                                state_at
                                    .format(&time::format_description::well_known::Rfc3339)
                                    .unwrap_or_default()
                            ),
                        });
                        let Some(sealed) = self.context.seal_record(&record) else {
                            continue;
                        };
                        let mut run = record.to_run(&orphan.node);
                        run.lease_generation = orphan.run.lease_generation;
                        (run, Some(sealed))
                    }
                    (record, latest) => {
                        let why = match (&record, latest) {
                        (None, _) => "the fleet's catalog has no record of it to bring it back from"
                            .to_owned(),
                        (Some(r), _) if r.on_node_loss == runbox_types::OnNodeLoss::Lost => {
                            "its onNodeLoss is lost".to_owned()
                        }
                        _ => "it had no checkpoint in the bucket the nodes share to come back from"
                            .to_owned(),
                    };
                        let mut run = orphan.run.clone();
                        run.status = RunStatus::Lost;
                        run.failure = Some(format!(
                            "run {} was lost with node {}, which is gone: {why}; delete it",
                            orphan.id, orphan.node
                        ));
                        (run, None)
                    }
                };
            if fleet.settle_orphan(orphan, &run, sealed.as_deref()).await? {
                tracing::info!(run = %orphan.id, node = %orphan.node, status = ?run.status, "decided on a run of a node that is gone");
                settled += 1;
            }
        }
        Ok(settled)
    }

    /// Run `id` as the fleet's catalog has it (another node's, or lost).
    pub async fn catalog_run(&self, id: Ulid) -> Result<Run, CoreError> {
        let Some(fleet) = self.fleet() else {
            return Err(CoreError::RunNotFound(id));
        };
        fleet.run(id).await?.ok_or(CoreError::RunNotFound(id))
    }

    /// Deletes run `id`, lost with its node: its row in the catalog ends.
    pub async fn end_lost(&self, id: Ulid) -> Result<(), CoreError> {
        let Some(fleet) = self.fleet() else {
            return Err(CoreError::RunNotFound(id));
        };
        match fleet.end_lost_run(id).await? {
            true => {
                tracing::info!(run = %id, "a lost run was deleted");
                Ok(())
            }
            false => Err(CoreError::RunNotFound(id)),
        }
    }
}
