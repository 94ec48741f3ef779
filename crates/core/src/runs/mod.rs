//! The runs of this node and their lifecycle: create, list, renew, delete
//! and leases.
//!
//! Each run has one owner, a task ([`actor`]) holding its record, lease fence
//! and [`phase::Phase`]; the [`Manager`] keeps the registry of their handles
//! and turns API calls into typed commands. The jobs are split by module:
//!
//! * [`phase`]: the lifecycle state machine, pure;
//! * [`actor`]: the per-run owner that drives it;
//! * [`reconcile`]: start-up, when every stored record gets an owner again;
//! * [`reaper`]: expiry and the teardown budget and retry policy;
//! * [`relay`]: exec and files, through each run's agent;
//! * `crate::catalog`: the image half of the API.
//!
//! Invariants (checked by the tests in [`phase`] and the end-to-end suite):
//! * a run is in exactly one phase, held by its owner only;
//! * capacity used = runs on the ledger ([`crate::ledger`]) but idle pool
//!   members and sleepers; a run leaves the registry and the ledger only
//!   once its sandbox is destroyed;
//! * a run that is stopping or gone never answers an operation again.
//!
//! Persistence: a record is written as `Creating` before any resource exists,
//! so a crash at any point leaves something reconciliation can find.

pub mod actor;
mod answer;
mod checkpoint;
mod context;
mod egress_policy;
mod fork;
mod fs;
mod history;
mod moves;
pub mod phase;
mod pool;
mod ports;
mod process;
pub mod reaper;
mod reconcile;
pub mod relay;
mod usage;
mod volume_files;
mod volume_moves;
mod volumes;
mod warm;

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use crate::telemetry::{Outcome, Start, Telemetry};
use arc_swap::ArcSwap;
use runbox_agent_proto::pb;
use runbox_agent_proto::AgentClient;
use runbox_types::{
    CreateRunRequest, ErrorCode, ExitReason, LeaseReleaseRequest, LeaseRenewRequest, LeaseRequest,
    Run,
};
use time::OffsetDateTime;
use tokio::sync::Semaphore;
use ulid::Ulid;

use self::actor::{Command, Creation, LeaseOp, RunActor, RunHandle};
use self::phase::Phase;
use crate::config::Config;
use crate::egress;
use crate::error::CoreError;
use crate::images::ImageStore;
use crate::lane::{Lane, SandboxSpec};
use crate::lease::Lease;
use crate::store::{Idempotency, RunRecord, Store};
use crate::validate;

pub(crate) use self::context::{door_refused, RunContext};
pub use self::fs::{Scope, WriteOptions, MAX_LIST_DEPTH, MAX_LIST_ENTRIES};
pub use self::history::{DEFAULT_DIFF_PATHS, MAX_DIFF_PATHS};
pub use self::ports::RunConnection;
pub use self::process::{Session, SessionInput, SessionWriter, MAX_WAIT};
pub use self::relay::{ExecEvent, FileDownload};
pub use self::usage::{UsageSample, KEEP as USAGE_KEEP, SAMPLE_EVERY as USAGE_SAMPLE_EVERY};
pub use self::volume_files::{VolumeFiles, VolumeKey, VolumeWrite};
pub use self::volume_moves::VolumeDeparture;
pub(crate) use self::volumes::not_found as volume_not_found;

/// Locks a mutex, recovering from poisoning: every critical section here is
/// a few map operations that leave the data consistent even if a panic
/// stopped them, so a panic elsewhere must not wedge the registry.
fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// The run manager. Cheap to share (`Arc<Manager>`).
pub struct Manager {
    /// The settings, swapped whole by [`Manager::reconfigure`].
    pub(crate) config: Arc<ArcSwap<Config>>,
    /// This node's id ([`Config::server_id`]), fixed at start.
    pub(crate) server_id: String,
    pub(crate) lane: Arc<dyn Lane>,
    pub(crate) store: Store,
    pub(crate) images: ImageStore,
    /// Every run with a sandbox on this node, in any phase, by id: where
    /// its owner is reached. Only map operations happen under this lock;
    /// what spans runs is the ledger's ([`RunContext::ledger`]).
    registry: Arc<Mutex<HashMap<Ulid, Arc<RunHandle>>>>,
    /// Serialises "image is in use" checks with run creation. Async: the
    /// image lookups it covers run on blocking threads.
    pub(crate) image_lock: tokio::sync::Mutex<()>,
    /// The one budget of lane work in the background: refills, forks
    /// and teardowns (see [`reaper`]).
    pub(crate) budget: Arc<Semaphore>,
    /// The warm pools' bookkeeping (see [`crate::pools`]); taken under the
    /// ledger's lock (a claim takes members off it there), never the other
    /// way, and never with the registry's.
    pub(crate) pools: Arc<Mutex<crate::pools::Pools>>,
    /// Wakes the pool controller (a claim, a refill done, a new set).
    pub(crate) pool_wake: Arc<tokio::sync::Notify>,
    /// When a create last took a pool member (refills give way to the
    /// claimed run's first commands, see `refill`).
    pub(crate) last_claim: Mutex<Option<tokio::time::Instant>>,
    /// Where `PUT /v1/pools` stores the set on a node of a cell.
    pub(crate) cell_pools: std::sync::OnceLock<Arc<dyn crate::fleet::SharedPools>>,
    /// The size of `budget`.
    pub(crate) budget_size: usize,
    /// The warm repo cache, when it is on.
    pub(crate) warm: Option<Arc<crate::warm::WarmCache>>,
    /// What each run's owner is given (the same store, lane, settings,
    /// budget and registry).
    pub(crate) context: Arc<RunContext>,
    /// The named volumes on record.
    pub(crate) volumes: Arc<crate::volumes::Volumes>,
    /// Serialises volume creates and deletes.
    pub(crate) volume_lock: tokio::sync::Mutex<()>,
    /// Volumes whose moves a call of this daemon is making now.
    pub(crate) volume_moves: std::sync::Mutex<std::collections::HashSet<Ulid>>,
    /// When this manager started.
    pub(crate) started_at: OffsetDateTime,
    /// Image builds (see [`crate::builds`]), once opened at start.
    pub(crate) builds: std::sync::OnceLock<Arc<crate::builds::Builds>>,
}

impl Manager {
    /// The settings as they are now (see [`Manager::reconfigure`]).
    pub fn config(&self) -> Arc<Config> {
        self.config.load_full()
    }

    /// Where timings and counts go from now on (see [`crate::telemetry`]);
    /// only the first sink given is kept.
    pub fn set_telemetry(&self, sink: Arc<dyn Telemetry>) {
        let _ = self.context.telemetry.set(sink);
    }

    /// The fleet this node belongs to from now on (see [`crate::fleet`]);
    /// only the first one given is kept.
    pub fn set_fleet(&self, fleet: Arc<dyn crate::fleet::Fleet>) {
        if self.context.fleet.set(fleet.clone()).is_ok() {
            // What this node holds now; from here on each run's owner
            // reports its changes.
            fleet.resync_runs(&|| self.published());
            self.context.ledger.share(fleet.ledger());
        }
    }

    /// The fleet this node belongs to.
    pub(crate) fn fleet(&self) -> Option<&Arc<dyn crate::fleet::Fleet>> {
        self.context.fleet.get()
    }

    /// The node of the fleet a create of `req` is best made on, when it is
    /// another. A create that names what only this node has (a warm
    /// template, a checkpoint in a store of its own) stays here.
    pub async fn place(
        &self,
        req: &runbox_types::CreateRunRequest,
        owner: &crate::tenants::Owner,
        here_full: bool,
    ) -> Result<Option<crate::fleet::Located>, CoreError> {
        let Some(fleet) = self.fleet() else {
            return Ok(None);
        };
        if req.warm.is_some() {
            return Ok(None);
        }
        // A checkpoint in a bucket other nodes share may be made on any
        // of them (it carries its layers; no image is needed). Whether the
        // bucket holds it is not asked again here: a node sharing the
        // bucket answers for a missing one as this node would.
        if req.checkpoint.is_some() {
            let Some(store) = self
                .config()
                .checkpoints
                .as_ref()
                .map(|s| s.location().to_owned())
                .filter(|l| l.starts_with("s3://"))
            else {
                return Ok(None);
            };
            let want = crate::fleet::Want {
                images: Vec::new(),
                pullable: true,
                tenant: owner.tenant().map(str::to_owned),
                here: self.config().server_id.clone(),
                here_full,
                here_has: (false, false),
                volumes: Vec::new(),
                here_has_volumes: true,
                checkpoint_store: Some(store),
                needs: self.needs(req),
                here_can: self.can(req),
            };
            return bounded(fleet.place(&want)).await;
        }
        // Volumes and datasets are a node's: the create goes where they all
        // are (this node when it holds them).
        let volumes: Vec<String> = req
            .volumes
            .iter()
            .flatten()
            .map(|m| format!("{}/{}", owner.tenant().unwrap_or(""), m.name))
            .collect();
        let here_has_volumes = req.volumes.iter().flatten().all(|m| {
            self.volumes.find(owner.tenant(), &m.name).is_some()
                || self
                    .config()
                    .datasets
                    .iter()
                    .any(|d| d.name == m.name && d.admits(owner.tenant()))
        });
        let mut images = vec![req.image.clone()];
        let reference = runbox_image::pull::normalise(&req.image).ok();
        images.extend(reference.clone());
        // Only what cannot be a local name is pulled on demand (as at
        // create): a bare word goes only where it is stored.
        let reference_like = req.image.contains([':', '/', '@']);
        let stored = {
            let images = self.images.clone();
            let wanted = req.image.clone();
            tokio::task::spawn_blocking(move || images.resolve(&wanted).ok().flatten())
                .await
                .ok()
                .flatten()
        };
        let pooled = stored.as_ref().is_some_and(|name| {
            self.pools()
                .pools
                .iter()
                .any(|p| &p.image == name && p.ready > 0)
        });
        let want = crate::fleet::Want {
            images,
            pullable: reference_like
                && reference.is_some()
                && req.pull != Some(runbox_types::PullPolicy::Never),
            tenant: owner.tenant().map(str::to_owned),
            here: self.config().server_id.clone(),
            here_full,
            here_has: (stored.is_some(), pooled),
            volumes,
            here_has_volumes,
            checkpoint_store: None,
            needs: self.needs(req),
            here_can: self.can(req),
        };
        let placed = bounded(fleet.place(&want)).await?;
        if placed.is_none() && !want.here_has_volumes {
            if let Some(e) = unplaceable(fleet.as_ref(), &want).await {
                return Err(e);
            }
        }
        Ok(placed)
    }

    /// What a create of `req` needs a node's lane to do, by capability
    /// name: its network tier when that is not `none`.
    fn needs(&self, req: &runbox_types::CreateRunRequest) -> Vec<String> {
        req.network.map(moves::needs).unwrap_or_default()
    }

    /// Whether this node's lane can make a create of `req`.
    fn can(&self, req: &runbox_types::CreateRunRequest) -> bool {
        let here = self.capabilities();
        self.needs(req).iter().all(|need| here.contains(need))
    }

    /// What this node's lane can do, by name ([`crate::lane::Capabilities::names`]).
    pub fn capabilities(&self) -> Vec<String> {
        self.lane.capabilities().names()
    }

    /// The volumes this node holds and the datasets it serves, as the
    /// fleet's placement matches a create's mounts against them:
    /// `tenant/name` (`/name` for the operator's), and a dataset as
    /// `*/name` when any tenant may mount it, else once for the operator
    /// and once for each tenant it admits.
    pub fn volumes_held(&self) -> Vec<String> {
        let mut held: Vec<String> = self
            .volumes
            .all()
            .iter()
            .map(|v| format!("{}/{}", v.tenant.as_deref().unwrap_or(""), v.name))
            .collect();
        for dataset in &self.config().datasets {
            if dataset.tenants.is_empty() {
                held.push(format!("*/{}", dataset.name));
            } else {
                held.push(format!("/{}", dataset.name));
                held.extend(
                    dataset
                        .tenants
                        .iter()
                        .map(|t| format!("{t}/{}", dataset.name)),
                );
            }
        }
        held.sort();
        held.dedup();
        held
    }

    /// Every run of the fleet (this node's alone without one), by id: this
    /// node's as they are now, the others' as the catalog has them.
    pub async fn list_fleet(&self) -> Result<Vec<Run>, CoreError> {
        let mut runs = self.list();
        let Some(fleet) = self.fleet() else {
            return Ok(runs);
        };
        let here: std::collections::HashSet<Ulid> = runs.iter().map(|r| r.id).collect();
        let server = self.config().server_id.clone();
        runs.extend(
            fleet
                .runs()
                .await?
                .into_iter()
                .filter(|r| !here.contains(&r.id) && r.server != server),
        );
        runs.sort_by_key(|r| r.id);
        Ok(runs)
    }

    /// Replaces the settings with what `update` makes of them, all at once:
    /// every request after it reads the new ones, none sees half of them.
    /// What is read only at start (the lane, the stores, the pools' budget)
    /// does not change; the caller says which settings those are.
    pub fn reconfigure(&self, update: impl Fn(&Config) -> Config) {
        self.config.rcu(|current| update(current));
    }

    /// Builds a manager and reconciles stored runs with what is alive: live
    /// runs are re-adopted, everything else is destroyed.
    pub async fn start(
        config: Config,
        lane: Arc<dyn Lane>,
        store: Store,
        images: ImageStore,
        tenants: Arc<dyn crate::tenants::TenantStore>,
        usage: Arc<dyn crate::accounting::UsageSink>,
    ) -> Result<Arc<Manager>, CoreError> {
        let cpus = std::thread::available_parallelism().map_or(2, |n| n.get());
        let budget = match config.refill_concurrency {
            0 => reaper::budget_for(cpus),
            n => n,
        };
        let warm = match config.warm_cache.clone() {
            Some(c) => Some(Arc::new(
                tokio::task::spawn_blocking(move || {
                    crate::warm::WarmCache::open(&c.root, c.max_bytes)
                })
                .await
                .map_err(|e| CoreError::Store(format!("warm cache task failed: {e}")))??,
            )),
            None => None,
        };
        let decay = config.pool_decay;
        let volume_store: Arc<dyn crate::volumes::VolumeStore> = Arc::new(store.clone());
        let volumes = Arc::new(
            tokio::task::spawn_blocking(move || crate::volumes::Volumes::open(volume_store))
                .await
                .map_err(|e| CoreError::Store(format!("volume store task failed: {e}")))??,
        );
        let context = Arc::new(RunContext {
            config: Arc::new(ArcSwap::from_pointee(config)),
            lane,
            store,
            budget: Arc::new(Semaphore::new(budget)),
            teardown_gate: Arc::new(Semaphore::new(reaper::teardown_share(budget))),
            registry: Arc::new(Mutex::new(HashMap::new())),
            ledger: Arc::new(crate::ledger::LocalLedger::new(
                tenants.clone(),
                volumes.clone(),
            )),
            pools: Arc::new(Mutex::new(crate::pools::Pools::new(decay))),
            images: images.clone(),
            warm: warm.clone(),
            restore_lock: tokio::sync::Mutex::new(()),
            adopt_lock: tokio::sync::Mutex::new(()),
            ended: Mutex::new(std::collections::VecDeque::new()),
            tenants,
            usage,
            fleet: std::sync::OnceLock::new(),
            telemetry: std::sync::OnceLock::new(),
        });
        let manager = Arc::new(Manager {
            config: context.config.clone(),
            server_id: context.config().server_id.clone(),
            lane: context.lane.clone(),
            store: context.store.clone(),
            images,
            registry: context.registry.clone(),
            image_lock: tokio::sync::Mutex::new(()),
            budget: context.budget.clone(),
            pools: context.pools.clone(),
            pool_wake: Arc::new(tokio::sync::Notify::new()),
            last_claim: Mutex::new(None),
            cell_pools: std::sync::OnceLock::new(),
            budget_size: budget,
            warm,
            context,
            volumes,
            volume_lock: tokio::sync::Mutex::new(()),
            volume_moves: Default::default(),
            started_at: OffsetDateTime::now_utc(),
            builds: std::sync::OnceLock::new(),
        });
        // Local layers (snapshots kept where the lane keeps runs) are found
        // where the lane says, before any run mounts one.
        if let Some(root) = manager.lane.layer_root() {
            manager.images.store().set_local_root(root);
        }
        manager.reconcile().await?;
        // After reconcile: the runs of builds a previous daemon ran are
        // among the runs it found.
        manager.open_builds().await?;
        // After reconcile: the runs it re-adopted hold their generations.
        manager.spawn_warm_tick();
        manager.spawn_usage_sampler();
        manager.spawn_checkpoint_sweep();
        manager.start_pools()?;
        // Layers nothing references any more: a snapshot or import a crash
        // cut short after its layer was stored, before its image record.
        manager.collect_garbage().await?;
        // Local layers made by a daemon that died before recording them.
        let recorded: std::collections::HashSet<String> = manager
            .images
            .store()
            .local_layers()
            .map_err(|e| CoreError::Store(e.to_string()))?
            .into_iter()
            .collect();
        let swept = manager.lane.sweep_layers(&recorded);
        if !swept.is_empty() {
            tracing::info!(
                layers = swept.len(),
                "removed local layers no image recorded"
            );
        }
        // Volumes made by a daemon that died before recording them.
        let swept = manager.lane.sweep_volumes(&manager.volumes.ids());
        if !swept.is_empty() {
            tracing::info!(volumes = swept.len(), "removed volumes no record names");
        }
        // Datasets: mounted again for the runs that hold them, unmounted
        // where no run does.
        crate::datasets::check_catalog(
            &manager.config().datasets,
            &manager
                .context
                .tenants
                .list()
                .iter()
                .map(|t| t.name.clone())
                .collect::<Vec<_>>(),
        )
        .map_err(|e| CoreError::invalid(ErrorCode::ConfigInvalid, e))?;
        let restoring = manager.clone();
        tokio::task::spawn_blocking(move || restoring.restore_datasets())
            .await
            .map_err(|e| CoreError::Store(format!("restoring datasets failed: {e}")))?;
        Ok(manager)
    }

    /// The lane's name.
    pub fn lane_name(&self) -> String {
        self.lane.name()
    }

    fn registry(&self) -> MutexGuard<'_, HashMap<Ulid, Arc<RunHandle>>> {
        lock(&self.registry)
    }

    /// Creates a run and waits until its agent answers.
    ///
    /// Cancellation: the run is built by its own task. If this future is
    /// dropped before the run is up (the client hung up), that task notices
    /// nobody waits for the answer and destroys the run; nothing is left
    /// behind and the capacity slot comes back.
    ///
    /// With an idempotency key, a create that repeats an earlier one (same
    /// key, same request) answers with the run that one made, waiting for
    /// it if it is still being created, instead of making another: a client
    /// whose answer was lost retries safely. The same key with a different
    /// request is refused. Keys are remembered as long as their run exists.
    pub async fn create(
        self: &Arc<Self>,
        req: CreateRunRequest,
        idempotency_key: Option<String>,
        owner: crate::tenants::Owner,
    ) -> Result<Run, CoreError> {
        let started = std::time::Instant::now();
        let created = self.create_keyed(req, idempotency_key, owner).await;
        let how = match &created {
            Ok(run) if run.pooled => Start::Claim,
            _ => Start::Cold,
        };
        self.context
            .report(|t| t.started(how, Outcome::of(&created), started.elapsed()));
        created
    }

    async fn create_keyed(
        self: &Arc<Self>,
        mut req: CreateRunRequest,
        idempotency_key: Option<String>,
        owner: crate::tenants::Owner,
    ) -> Result<Run, CoreError> {
        // An earlier create with the key whose run did not make it (its
        // client hung up, so it was destroyed) no longer answers for the
        // key: this one then makes the run. Bounded, in case creates with
        // the key keep failing.
        let mut attempts = 3;
        loop {
            attempts -= 1;
            let again = (idempotency_key.is_some() && attempts > 0).then(|| req.clone());
            match self
                .create_once(req, idempotency_key.clone(), owner.clone())
                .await
            {
                Err(CoreError::Conflict {
                    code: ErrorCode::IdempotencyKeyReused,
                    ..
                }) if again.is_some()
                    && self.key_is_free(idempotency_key.as_deref(), owner.tenant()) => {}
                other => return other,
            }
            req = again.expect("checked above");
        }
    }

    /// Whether no visible run holds `tenant`'s idempotency key `key`.
    fn key_is_free(&self, key: Option<&str>, tenant: Option<&str>) -> bool {
        key.is_some_and(|key| self.context.ledger.key_is_free(key, tenant))
    }

    async fn create_once(
        self: &Arc<Self>,
        req: CreateRunRequest,
        idempotency_key: Option<String>,
        owner: crate::tenants::Owner,
    ) -> Result<Run, CoreError> {
        let idempotency = match idempotency_key {
            Some(key) => Some(Idempotency {
                request: request_digest(&req, self.config().sealer.as_deref())?,
                key: validate::idempotency_key(key)?,
                tenant: owner.tenant().map(str::to_owned),
            }),
            None => None,
        };
        if lock(&self.pools).draining() {
            return Err(CoreError::Draining);
        }
        // Checked and digested as the caller sent it; a retry with the
        // same key finds the run this create makes.
        let req = self.from_checkpoint(req, &owner).await?;
        if req.image.is_empty() {
            return Err(CoreError::invalid(
                ErrorCode::BadRequest,
                "give image (a stored image or a registry reference) or checkpoint",
            ));
        }
        let env = req.env.unwrap_or_default();
        validate::env(&env)?;
        let labels = req.labels.clone().unwrap_or_default();
        validate::labels(&labels)?;
        let limits = validate::create_limits(
            req.size,
            req.limits.as_ref(),
            &self.config().default_limits,
            &self.config().max_limits,
        )?;
        let ttl = validate::ttl(
            req.ttl_sec,
            self.config().default_ttl,
            self.config().max_ttl,
        )?;
        let idle = validate::idle(req.idle, self.config().idle)?;
        self.check_sleep(idle, req.on_expire)?;
        let history = self.check_history(req.history)?;
        if limits.disk_mb.is_some() {
            if let Err(why) = self.lane.capabilities().disk_limit.check() {
                return Err(CoreError::invalid(
                    ErrorCode::DiskLimitUnsupported,
                    format!("this server cannot limit a run's disk: {why}"),
                ));
            }
        }
        let allow_privilege_escalation = req.allow_privilege_escalation.unwrap_or(false);
        if allow_privilege_escalation {
            if let Err(why) = self.lane.capabilities().user_namespaces.check() {
                return Err(CoreError::invalid(
                    ErrorCode::EscalationUnsupported,
                    format!(
                        "allowPrivilegeEscalation needs runs with a user namespace of their own, \
                         and this server's have none ({why}); leave it out (or set it to false, \
                         over a checkpoint's), or have the operator start runbox with --userns on"
                    ),
                ));
            }
        }
        let network = req.network.unwrap_or_default();
        owner.check_shape(network, req.size, req.limits.is_some())?;
        if let Err(why) = self.lane.capabilities().network(network) {
            return Err(CoreError::invalid(
                ErrorCode::NetworkUnsupported,
                format!(
                    "network {:?} is not available on this server ({why}); use another tier",
                    network.as_str()
                ),
            ));
        }
        let mut egress = egress::check_request(
            self.config().egress.as_deref(),
            self.config().sealer.as_deref(),
            network,
            egress::EgressAsk {
                allow: req.egress_allow.as_deref(),
                defaults: req.egress_defaults,
                secrets: req.secrets.as_deref(),
                socks5: req.egress_socks5,
                upstream: req.egress_upstream.as_ref(),
            },
        )?;
        egress.class = owner.egress_class().map(str::to_owned);
        let warm = req.warm.as_ref().map(|w| self.check_warm(w)).transpose()?;
        let run_volumes = self.check_volume_mounts(
            req.volumes.as_deref(),
            owner.tenant(),
            warm.as_ref().map(|(_, path)| path.as_str()),
        )?;
        let id = Ulid::new();
        self.check_image_for(&owner, &req.image).await?;
        let image = self
            .image_for_run(&req.image, req.pull.unwrap_or_default())
            .await?;
        // A tier, no free-form limits and no warm volume: a pool may serve
        // it (volumes are mounted into the member it takes).
        if let (Some(size), None) = (req.size, &warm) {
            let key = crate::pools::PoolKey {
                image: image.clone(),
                network,
                size,
            };
            let claim = actor::Claim {
                tenant: owner.tenant().map(str::to_owned),
                env: env.clone(),
                ttl,
                egress: egress.clone(),
                labels: labels.clone(),
                public_ports: req.public_ports.unwrap_or(false),
                auto_resume: req.auto_resume.unwrap_or(true),
                on_expire: req.on_expire.unwrap_or_default(),
                on_node_loss: req.on_node_loss.unwrap_or(self.config().on_node_loss),
                idle,
                history,
                idempotency: idempotency.clone(),
                allow_privilege_escalation,
                volumes: run_volumes.clone(),
            };
            if let Some(served) = self.claim_from_pool(&key, claim, &owner).await? {
                return Ok(served);
            }
        }
        // Holding the image lock until the run is on the ledger means a
        // concurrent image delete either sees this run or runs first.
        let image_guard = self.image_lock.lock().await;
        let (layers, image_layers, image_config) = {
            let images = self.images.clone();
            let name = image.clone();
            tokio::task::spawn_blocking(move || images.for_run(&name))
                .await
                .map_err(|e| CoreError::Store(format!("image lookup task failed: {e}")))??
        };
        // Pinned until the run is on the ledger; its entry holds the
        // generation from then on.
        let (warm, warm_mount, _warm_pin) = match warm {
            Some((repo, path)) => {
                let (volume, mount, pin) = self.warm_for_create(repo, path, owner.tenant());
                (Some(volume), Some(mount), pin)
            }
            None => (None, None, None),
        };
        let now = OffsetDateTime::now_utc();
        let record = RunRecord {
            id,
            image,
            network,
            limits,
            env,
            created_at: now,
            expires_at: now + ttl,
            status: runbox_types::RunStatus::Creating,
            runtime: String::new(),
            agent_socket: Default::default(),
            image_config,
            layers,
            lease: Default::default(),
            egress,
            idempotency: idempotency.clone(),
            failure: None,
            warm,
            size: req.size,
            labels,
            public_ports: req.public_ports.unwrap_or(false),
            auto_resume: req.auto_resume.unwrap_or(true),
            on_expire: req.on_expire.unwrap_or_default(),
            ttl_sec: ttl.as_secs(),
            expired: false,
            pool: None,
            idle,
            history,
            restarts: 0,
            restarted_at: None,
            archived_at: None,
            archive_error: None,
            tenant: owner.tenant().map(str::to_owned),
            allow_privilege_escalation,
            volumes: run_volumes.clone(),
            proxy_ca: false,
            moved: false,
            on_node_loss: req.on_node_loss.unwrap_or(self.config().on_node_loss),
            recovered: None,
            restore_from: None,
        };
        let trust_pem = self.context.proxy_trust(record.network);
        let record = RunRecord {
            proxy_ca: trust_pem.is_some(),
            ..record
        };
        let spec = SandboxSpec {
            id,
            image_layers,
            limits: record.limits,
            network: record.network,
            trust_pem,
            seed: None,
            warm: warm_mount,
            volumes: volumes::binds(&run_volumes, &self.config().datasets),
        };
        // The key lookup, the capacity and quota checks, the volume holds
        // and the entry are one step of the ledger's; the owner is spawned
        // right after it, before anything can be dropped.
        let ask = crate::ledger::Ask {
            owner: &owner,
            key: idempotency.as_ref(),
            volumes: &run_volumes,
            dataset_ready: &|mount| self.dataset_ready(mount),
            runs: 1,
            max_runs: self.config().max_runs,
        };
        let entry = entry(&record, &Phase::Creating);
        let reserved = self.context.ledger.reserve(ask, vec![(id, entry)]).await?;
        let (answer, delivered) = match reserved {
            crate::ledger::Reserved::Entered => self.spawn_creating(record, spec),
            crate::ledger::Reserved::Earlier(earlier) => {
                drop(image_guard);
                return self.answer_repeat(earlier).await;
            }
        };
        drop(image_guard);
        let run = answer
            .await
            .map_err(|_| CoreError::Agent("the run's owner ended without an answer".into()))?;
        // On a node of a fleet the catalog has the run before the caller
        // has its id, so the next call finds it through any node (the
        // write behind would come a moment later). Best effort: without
        // the database the run is still made, and written when it is back.
        if let (Ok(made), Some(fleet)) = (&run, self.fleet()) {
            let published = crate::fleet::Published {
                run: made.clone(),
                record: self
                    .handle(made.id)
                    .ok()
                    .and_then(|h| self.context.seal_record(&h.snapshot().record)),
            };
            let now = tokio::time::timeout(
                std::time::Duration::from_secs(1),
                fleet.record_run_now(&published),
            );
            if !matches!(now.await, Ok(Ok(()))) {
                tracing::info!(run = %made.id, "the run catalog is written later");
            }
        }
        // Held: from here the answer is the caller's (no await follows).
        let _ = delivered.send(());
        run
    }

    /// A create's history settings (see [`validate::history`]): asked of
    /// a server that cannot keep points, refused saying why; the server's
    /// default is dropped there instead.
    fn check_history(
        &self,
        req: Option<runbox_types::HistorySettings>,
    ) -> Result<Option<runbox_types::HistorySettings>, CoreError> {
        let asked = req.is_some_and(|h| h.keep > 0);
        let history =
            validate::history(req, self.config().history_keep, self.config().max_history)?;
        match self.lane.capabilities().capture.check() {
            Ok(()) => Ok(history),
            Err(why) if asked => Err(CoreError::invalid(
                ErrorCode::BadHistory,
                format!("this server cannot keep a run's history: {why}"),
            )),
            Err(_) => Ok(None),
        }
    }

    /// Refuses an idle policy or `onExpire` that needs what the lane
    /// cannot do (pausing, hibernating), saying why.
    fn check_sleep(
        &self,
        idle: runbox_types::IdlePolicy,
        on_expire: Option<runbox_types::OnExpire>,
    ) -> Result<(), CoreError> {
        let caps = self.lane.capabilities();
        if idle.pause_after_sec.is_some() || on_expire == Some(runbox_types::OnExpire::Pause) {
            if let Err(why) = caps.suspend.check() {
                return Err(CoreError::invalid(
                    ErrorCode::PauseUnsupported,
                    format!("this server cannot pause runs: {why}"),
                ));
            }
        }
        let archive = on_expire == Some(runbox_types::OnExpire::Archive);
        if archive && self.config().checkpoints.is_none() {
            return Err(CoreError::invalid(
                ErrorCode::BadRequest,
                "onExpire \"archive\" needs a checkpoint store (--checkpoint-store)",
            ));
        }
        if idle.hibernate_after_sec.is_some()
            || on_expire == Some(runbox_types::OnExpire::Hibernate)
            || archive
        {
            if let Err(why) = caps.hibernate.check() {
                return Err(CoreError::invalid(
                    ErrorCode::HibernateUnsupported,
                    format!("this server cannot hibernate runs: {why}"),
                ));
            }
        }
        Ok(())
    }

    /// `result` of an agent call on run `id`, except that an agent failure
    /// a concurrent pause, hibernate or stop explains (the run left
    /// `running` under the call) is `409 run_not_running`, as a call that
    /// came a moment later would be told, not the agent's failure.
    pub async fn settled<T>(&self, id: Ulid, result: Result<T, CoreError>) -> Result<T, CoreError> {
        let err = match result {
            Err(err @ CoreError::Agent(_)) => err,
            other => return other,
        };
        let Some(handle) = self.registry().get(&id).cloned() else {
            return Err(CoreError::RunNotFound(id));
        };
        match handle.left_running(Duration::from_secs(2)).await.phase {
            Phase::Running => Err(err),
            _ => Err(CoreError::RunNotRunning(
                id,
                "put to sleep or stopped during the call",
            )),
        }
    }

    /// Captures run `id`'s filesystem for `what` (a snapshot, a fork); a
    /// lane or storage that cannot is a 400 saying why.
    ///
    /// The capture is admitted as an open operation, so the run may be
    /// put to sleep or deleted under it: a capture that fails while its
    /// run's owner takes it down (the run leaves `running` within a
    /// moment) says so (409, or 404 when it is gone), and one that fails
    /// on a run still running is tried once more.
    pub(crate) async fn capture(
        &self,
        id: Ulid,
        what: &str,
    ) -> Result<crate::lane::Capture, CoreError> {
        let mut retried = false;
        loop {
            let failed = match self.lane.sandbox(id).capture().await {
                Ok(capture) => return Ok(capture),
                Err(crate::lane::LaneError::Unsupported(why)) => {
                    return Err(CoreError::invalid(
                        ErrorCode::BadRequest,
                        format!("run {id} cannot be {what}: {why}"),
                    ))
                }
                Err(other) => other,
            };
            let Some(handle) = self.registry().get(&id).cloned() else {
                return Err(CoreError::RunNotFound(id));
            };
            let phase = handle.left_running(Duration::from_secs(2)).await.phase;
            match phase {
                Phase::Running if !retried => retried = true,
                Phase::Running => return Err(CoreError::Lane(failed)),
                _ => {
                    return Err(CoreError::RunNotRunning(
                        id,
                        "put to sleep or stopped while it was being captured",
                    ))
                }
            }
        }
    }

    /// Registers a new run in phase `creating` and spawns its owner to
    /// build it; returns the answer and the sender the creator signals once
    /// it holds the answer ([`Creation::delivered`]). The run is on the
    /// ledger already.
    fn spawn_creating(
        self: &Arc<Self>,
        record: RunRecord,
        spec: SandboxSpec,
    ) -> (
        tokio::sync::oneshot::Receiver<Result<Run, CoreError>>,
        tokio::sync::oneshot::Sender<()>,
    ) {
        let (reply, answer) = tokio::sync::oneshot::channel();
        let (delivered, delivery) = tokio::sync::oneshot::channel();
        let id = record.id;
        let actor = RunActor::new(self.context.clone(), record, Phase::Creating);
        self.registry().insert(id, actor.handle().clone());
        actor.spawn_create(Creation {
            spec,
            reply,
            delivered: delivery,
        });
        (answer, delivered)
    }

    /// The answer to a repeated create: earlier run `id` once it is made.
    async fn answer_repeat(&self, id: Ulid) -> Result<Run, CoreError> {
        let Some(earlier) = self.entered_handle(id).await else {
            return self.answer_repeat_elsewhere(id).await;
        };
        earlier.settled().await;
        // A pool member taken by the earlier create: once it is applied.
        let snapshot = earlier.claimed().await;
        match snapshot.phase {
            Phase::Running | Phase::Failed(_) => Ok(self.view(&earlier)),
            // The earlier create failed or its run is being deleted.
            _ => Err(gone_with_key(id)),
        }
    }

    /// The answer to a repeated create whose earlier run another node of
    /// the fleet made: that run as the catalog has it, once its node has
    /// written it there (a moment after it took the key).
    async fn answer_repeat_elsewhere(&self, id: Ulid) -> Result<Run, CoreError> {
        let Some(fleet) = self.fleet() else {
            return Err(gone_with_key(id));
        };
        // As a repeat on the same node waits for the earlier create to
        // settle, so does this one (bounded: a create answers well within).
        let started = std::time::Instant::now();
        let mut seen = false;
        while started.elapsed() < std::time::Duration::from_secs(60) {
            match fleet.run(id).await? {
                Some(run) if run.status != runbox_types::RunStatus::Creating => return Ok(run),
                Some(_) => seen = true,
                None if seen || started.elapsed() > std::time::Duration::from_secs(3) => break,
                None => {}
            }
            tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        }
        Err(gone_with_key(id))
    }

    /// The handle of run `id`, which the ledger has: a run entered a
    /// moment ago is in the registry as soon as its creator goes on, so it
    /// is waited for while the ledger still has it. None once it is gone.
    async fn entered_handle(&self, id: Ulid) -> Option<Arc<RunHandle>> {
        // Bounded: nothing but map insertions lies between the two.
        for _ in 0..10_000 {
            if let Some(handle) = self.registry().get(&id).cloned() {
                return Some(handle);
            }
            self.context.ledger.member(id)?;
            tokio::task::yield_now().await;
        }
        None
    }

    /// Capacity in use: every run on the ledger, in any phase but gone
    /// (runs still being created or torn down included), idle pool members
    /// excepted.
    pub fn capacity_used(&self) -> usize {
        self.context.ledger.tally().counted
    }

    /// Live runs counted against each tenant's `maxRuns`.
    pub fn tenant_runs(&self) -> HashMap<String, usize> {
        self.context.ledger.tally().by_tenant
    }

    /// Removes tenant `name` when it has no runs left in any phase; in one
    /// step of the ledger's, so no create of its slips in between.
    pub fn delete_tenant(&self, name: &str) -> Result<(), CoreError> {
        let tenants = self.context.tenants.clone();
        self.context
            .ledger
            .retire_tenant(name, &mut || tenants.delete(name))
    }

    /// Every run the API shows, ordered by id.
    pub fn list(&self) -> Vec<Run> {
        let handles: Vec<Arc<RunHandle>> = self.registry().values().cloned().collect();
        let ledger = &self.context.ledger;
        let mut runs: Vec<Run> = handles
            .iter()
            .filter(|h| !ledger.idle(h.id) && h.snapshot().phase.visible())
            .map(|h| self.view(h))
            .collect();
        runs.sort_by_key(|r| r.id);
        runs
    }

    /// Every run the API shows, ordered by id, as the catalog keeps them.
    fn published(&self) -> Vec<crate::fleet::Published> {
        let handles: Vec<Arc<RunHandle>> = self.registry().values().cloned().collect();
        let ledger = &self.context.ledger;
        let mut runs: Vec<crate::fleet::Published> = handles
            .iter()
            .filter(|h| !ledger.idle(h.id) && h.snapshot().phase.visible())
            .map(|h| crate::fleet::Published {
                run: self.view(h),
                record: self.context.seal_record(&h.snapshot().record),
            })
            .collect();
        runs.sort_by_key(|r| r.run.id);
        runs
    }

    /// One run.
    pub fn get(&self, id: Ulid) -> Result<Run, CoreError> {
        Ok(self.view(&*self.handle(id)?))
    }

    /// The honoured parts of run `id`'s image config, as recorded at create.
    pub fn image_config(&self, id: Ulid) -> Result<crate::images::ImageConfig, CoreError> {
        Ok(self.handle(id)?.snapshot().record.image_config.clone())
    }

    /// What run `id` uses now, where its lane measures it. An
    /// observation of the published phase, not an operation: it is not
    /// admitted by the run's owner.
    pub fn usage(&self, id: Ulid) -> Result<Option<crate::lane::Usage>, CoreError> {
        match self.handle(id)?.snapshot().phase {
            Phase::Running | Phase::Paused => Ok(self.lane.sandbox(id).usage()),
            // Nothing runs: nothing is used.
            Phase::Hibernated => Ok(None),
            Phase::Failed(why) => Err(CoreError::RunFailed(id, why)),
            _ => Err(CoreError::RunNotRunning(id, "still being created")),
        }
    }

    /// The API view of a run: its record plus live counters.
    pub(crate) fn view(&self, handle: &RunHandle) -> Run {
        self.context.view(handle)
    }

    /// The handle of a run the API shows.
    pub(crate) fn handle(&self, id: Ulid) -> Result<Arc<RunHandle>, CoreError> {
        let handle = self
            .registry()
            .get(&id)
            .cloned()
            .ok_or(CoreError::RunNotFound(id))?;
        if self.context.ledger.idle(id) || !handle.snapshot().phase.visible() {
            return Err(CoreError::RunNotFound(id));
        }
        Ok(handle)
    }

    /// Sets a run's expiry to now + `ttl_sec` (capped by the server maximum).
    pub async fn renew(&self, id: Ulid, ttl_sec: u64) -> Result<Run, CoreError> {
        let ttl = validate::ttl(
            Some(ttl_sec),
            self.config().default_ttl,
            self.config().max_ttl,
        )?;
        let handle = self.handle(id)?;
        handle.ask(|reply| Command::Renew { ttl, reply }).await?;
        Ok(self.view(&handle))
    }

    /// Pauses a run: its processes stop where they are, its memory, open
    /// files and connections kept; it uses no CPU until the next call that
    /// reaches it, or [`Manager::resume`]. Pausing a paused run does
    /// nothing.
    pub async fn pause(&self, id: Ulid) -> Result<Run, CoreError> {
        let handle = self.handle(id)?;
        handle.ask(|reply| Command::Pause { reply }).await?;
        Ok(self.view(&handle))
    }

    /// Resumes a paused run; a running one is left as it is.
    pub async fn resume(&self, id: Ulid) -> Result<Run, CoreError> {
        let handle = self.handle(id)?;
        handle.ask(|reply| Command::Resume { reply }).await?;
        Ok(self.view(&handle))
    }

    /// Hibernates a run: its processes and memory go, and with them its
    /// CPU, memory, network namespace, proxy and capacity slot; its disk,
    /// record, lease and preview tokens stay. The next call that reaches
    /// it, or [`Manager::wake`], boots it again on that disk. Hibernating
    /// a hibernated run does nothing.
    pub async fn hibernate(&self, id: Ulid) -> Result<Run, CoreError> {
        let handle = self.handle(id)?;
        handle.ask(|reply| Command::Hibernate { reply }).await?;
        Ok(self.view(&handle))
    }

    /// Archives a run: its disk goes to the checkpoint store and nothing of
    /// it stays on the node but its record (a running or paused run is
    /// hibernated first). The next call that reaches it restores it.
    pub async fn archive(&self, id: Ulid) -> Result<Run, CoreError> {
        let handle = self.handle(id)?;
        handle.ask(|reply| Command::Archive { reply }).await?;
        Ok(self.view(&handle))
    }

    /// Wakes a run: boots a hibernated or failed one again on its disk
    /// (a failed one's restart budget starts over), resumes a paused one;
    /// a running one is left as it is.
    pub async fn wake(&self, id: Ulid) -> Result<Run, CoreError> {
        let handle = self.handle(id)?;
        handle.ask(|reply| Command::Wake { reply }).await?;
        Ok(self.view(&handle))
    }

    /// Destroys a run. Answers once the sandbox is gone, or once the first
    /// attempt failed (the run's owner then retries with backoff).
    ///
    /// Cancellation: the teardown is the run owner's; dropping this future
    /// only stops waiting for it.
    pub async fn delete(&self, id: Ulid) -> Result<(), CoreError> {
        self.destroy(id, false).await
    }

    /// Destroys a run like [`Manager::delete`], but answers as soon as
    /// the run's record durably says it is being destroyed (no call finds
    /// it from then on, and a crash finishes the job at the next start)
    /// and its processes are gone; the rest of the teardown (mounts,
    /// namespace, cgroups, disk) follows. A run that mounts volumes is
    /// answered for only once they are free, as a delete is. E2B's kill.
    pub async fn kill(&self, id: Ulid) -> Result<(), CoreError> {
        self.destroy(id, true).await
    }

    /// Asks run `id`'s owner to destroy it; answered once its processes
    /// are gone (`halted`) or once nothing of it is left.
    async fn destroy(&self, id: Ulid, halted: bool) -> Result<(), CoreError> {
        let handle = self.handle(id)?;
        handle
            .ask(|reply| Command::Stop {
                reason: ExitReason::RunDeleted,
                reply,
                halted,
            })
            .await
    }

    /// The layers the runs on the ledger mount (their image's layers as
    /// they were when each run was created).
    pub(crate) fn layers_in_use(&self) -> Vec<String> {
        self.context.ledger.layers_in_use()
    }

    /// Whether any run but an idle pool member, in any phase, uses image
    /// `name`.
    pub(crate) fn image_in_use(&self, name: &str) -> bool {
        self.context.ledger.image_in_use(name)
    }

    /// Grants the run's writable lease to `req.owner` (see [`crate::lease`]).
    pub async fn acquire_lease(&self, id: Ulid, req: LeaseRequest) -> Result<Lease, CoreError> {
        validate::owner(&req.owner)?;
        let ttl = validate::lease_ttl(req.ttl_sec)?;
        let owner = req.owner.clone();
        let lease = self
            .lease(id, LeaseOp::Acquire { owner, ttl })
            .await?
            .ok_or_else(|| CoreError::Store("a lease grant returned no lease".into()))?;
        tracing::info!(run = %id, holder = %lease.holder, generation = lease.generation, "lease granted");
        Ok(lease)
    }

    /// Extends the active lease named by `req.owner` and `req.generation`.
    pub async fn renew_lease(&self, id: Ulid, req: LeaseRenewRequest) -> Result<Lease, CoreError> {
        validate::owner(&req.owner)?;
        let ttl = validate::lease_ttl(req.ttl_sec)?;
        let op = LeaseOp::Renew {
            owner: req.owner,
            generation: req.generation,
            ttl,
        };
        self.lease(id, op)
            .await?
            .ok_or_else(|| CoreError::Store("a lease renewal returned no lease".into()))
    }

    /// Releases the lease named by `req.owner` and `req.generation`.
    pub async fn release_lease(&self, id: Ulid, req: LeaseReleaseRequest) -> Result<(), CoreError> {
        validate::owner(&req.owner)?;
        let op = LeaseOp::Release {
            owner: req.owner.clone(),
            generation: req.generation,
        };
        self.lease(id, op).await?;
        tracing::info!(run = %id, holder = %req.owner, generation = req.generation, "lease released");
        Ok(())
    }

    async fn lease(&self, id: Ulid, op: LeaseOp) -> Result<Option<Lease>, CoreError> {
        let handle = self.handle(id)?;
        handle.ask(|reply| Command::Lease { op, reply }).await
    }
}

/// A repeat of a create whose run is gone.
/// A placement, bounded: it is a preference, so a database slow to answer
/// (or away) leaves the create on this node instead of holding it up.
/// Why a create that mounts volumes this node does not hold cannot go to
/// the node that holds them (`want` found none that can take it): None
/// when no node holds them (the create then says the volume is not found).
async fn unplaceable(
    fleet: &dyn crate::fleet::Fleet,
    want: &crate::fleet::Want,
) -> Option<CoreError> {
    let holders = fleet.volume_nodes(&want.volumes).await.ok()?;
    let (node, why) = holders
        .into_iter()
        .find_map(|(node, why)| why.map(|w| (node, w)))?;
    let names: Vec<&str> = want
        .volumes
        .iter()
        .map(|v| v.split_once('/').map_or(v.as_str(), |(_, name)| name))
        .collect();
    let code = match why.as_str() {
        "it is full" => ErrorCode::Capacity,
        "it is draining" => ErrorCode::Draining,
        _ => ErrorCode::NodeUnavailable,
    };
    Some(CoreError::Conflict {
        code,
        message: format!(
            "the run mounts volume(s) {}, which are on node {node}, and {why}; \
             retry later, or move the volume to another node (POST /v1/volumes/{{name}}/move)",
            names.join(", ")
        ),
    })
}

async fn bounded(
    place: impl std::future::Future<Output = Result<Option<crate::fleet::Located>, CoreError>>,
) -> Result<Option<crate::fleet::Located>, CoreError> {
    match tokio::time::timeout(std::time::Duration::from_millis(500), place).await {
        Ok(placed) => placed,
        Err(_) => Err(crate::fleet::unavailable(
            "placement took longer than 500 ms",
        )),
    }
}

fn gone_with_key(id: Ulid) -> CoreError {
    CoreError::Conflict {
        code: ErrorCode::IdempotencyKeyReused,
        message: format!(
            "the run created with this Idempotency-Key ({id}) is gone; retry with a new key"
        ),
    }
}

/// What the ledger is told of a run whose record is `record`, in `phase`.
pub(crate) fn entry(record: &RunRecord, phase: &Phase) -> crate::ledger::Entry {
    use crate::ledger::Standing;
    crate::ledger::Entry {
        standing: match phase {
            Phase::Creating => Standing::Creating,
            Phase::Running | Phase::Paused | Phase::Failed(_) => Standing::Live,
            Phase::Hibernated | Phase::Archived => Standing::Asleep,
            Phase::Pooled => Standing::Pooled,
            Phase::Stopping(_) | Phase::Gone => Standing::Ending,
        },
        tenant: record.tenant.clone(),
        key: record.idempotency.clone(),
        idle_member: record.is_idle_member(),
        image: record.image.clone(),
        layers: record.layers.clone(),
        volumes: record.volumes.clone(),
        warm: record.warm.as_ref().and_then(|w| w.generation),
    }
}

/// sha256 of a create request as parsed (so formatting does not matter).
///
/// The values of brought secrets are digested as their keyed fingerprints:
/// a plain hash of a short token in the record could be searched for the
/// token.
fn request_digest(
    req: &CreateRunRequest,
    sealer: Option<&dyn crate::sealed::Sealer>,
) -> Result<String, CoreError> {
    use sha2::Digest;
    let mut req = req.clone();
    for secret in req.secrets.iter_mut().flatten() {
        if let runbox_types::SecretRequest::Brought(brought) = secret {
            let print = sealer.map_or_else(String::new, |s| {
                s.fingerprint(brought.value.expose().as_bytes())
            });
            brought.value = runbox_types::SecretValue::new(print);
        }
    }
    let bytes = serde_json::to_vec(&req).map_err(|e| CoreError::Store(e.to_string()))?;
    let digest = sha2::Sha256::digest(&bytes);
    Ok(digest.iter().map(|b| format!("{b:02x}")).collect())
}

/// Calls `Hello` until the agent answers or `limit` passes; returns the
/// protocol revision it speaks.
pub(crate) async fn wait_ready(mut agent: AgentClient, limit: Duration) -> Result<u32, String> {
    let deadline = tokio::time::Instant::now() + limit;
    let mut delay = Duration::from_millis(2);
    loop {
        let attempt =
            tokio::time::timeout(Duration::from_secs(2), agent.hello(pb::HelloRequest {})).await;
        let error = match attempt {
            Ok(Ok(reply)) => {
                let reply = reply.into_inner();
                if reply.protocol < runbox_agent_proto::MIN_PROTOCOL {
                    return Err(format!(
                        "agent speaks protocol {}, need {}",
                        reply.protocol,
                        runbox_agent_proto::MIN_PROTOCOL
                    ));
                }
                return Ok(reply.protocol);
            }
            Ok(Err(status)) => relay::bounded(status.message()),
            Err(_) => "no answer within 2s".to_owned(),
        };
        if tokio::time::Instant::now() + delay > deadline {
            return Err(error);
        }
        tokio::time::sleep(delay).await;
        delay = (delay * 2).min(Duration::from_millis(100));
    }
}

/// Formats an error with its whole source chain, for logs.
pub fn error_chain(e: &(dyn std::error::Error + 'static)) -> String {
    let mut out = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        out.push_str(": ");
        out.push_str(&s.to_string());
        source = s.source();
    }
    out
}

/// Keys of a map, for logs that must not show values.
pub fn names(env: &BTreeMap<String, String>) -> Vec<&str> {
    env.keys().map(String::as_str).collect()
}
