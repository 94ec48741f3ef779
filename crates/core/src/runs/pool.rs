//! The warm pools' half of the manager: making members, warming them up,
//! handing them out at create time, replacing stale ones, the pool set and
//! the node's drain switch. The bookkeeping is [`crate::pools`].
//!
//! A member is an ordinary run with its own owner, made in the background
//! under the shared budget, with its record marked as an idle member of
//! its pool: hidden from the API and not counted against `--max-runs`. A
//! create whose image, network and size tier match a pool takes a ready
//! member in one step of the ledger's (the capacity check and the
//! idempotency key lookup are the same as for a cold create) and its owner
//! applies the create's environment, TTL, egress entries, secrets and
//! labels; from then on it is the create's run and never returns to a pool.

use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::StreamExt;
use runbox_types::{
    Env, ErrorCode, ExecRequest, ExitReason, Info, NetworkTier, PoolList, PoolSet, Run, RunStatus,
};
use time::OffsetDateTime;
use ulid::Ulid;

use super::actor::{Claim, Command};
use super::phase::Phase;
use super::{error_chain, lock, Manager};
use crate::error::CoreError;
use crate::lane::SandboxSpec;
use crate::ledger::{Ask, Claimed, Standing};
use crate::pools::{Membership, PoolConfig, PoolKey};
use crate::store::RunRecord;
use crate::validate;

/// How often the controller looks at the pools without being woken.
const TICK: Duration = Duration::from_secs(1);

/// How often it checks that members still run their image's current
/// layers (a re-import or re-pull replaces them).
const FRESHNESS: Duration = Duration::from_secs(5);

/// How long a warmup command may run.
const WARMUP_TIMEOUT_SECS: u64 = 120;

/// The most of a refill error kept for `GET /v1/pools`.
const MAX_ERROR: usize = 1024;

/// How long a refill waits for the creates being built to finish before
/// it makes its member beside them (see `refill`).
const REFILL_YIELD: Duration = Duration::from_secs(2);

/// How long after a claim refills wait, for the claimed run's first
/// commands (see `refill`).
const CLAIM_QUIET: Duration = Duration::from_millis(50);

impl Manager {
    /// Checks a pool set against this server: image names, networks it can
    /// give, tiers within its maxima.
    fn check_pools(&self, set: &PoolSet) -> Result<Vec<PoolConfig>, CoreError> {
        crate::pools::configs(set, |key| {
            validate::image_name(&key.image).map_err(|e| e.to_string())?;
            self.lane
                .capabilities()
                .network(key.network)
                .map_err(|why| {
                    format!(
                        "network {} is not available here: {why}",
                        key.network.as_str()
                    )
                })?;
            if key.network == NetworkTier::Allowlist && self.config().egress.is_none() {
                return Err("network allowlist needs the egress proxy, which is off".into());
            }
            validate::create_limits(
                Some(key.size),
                None,
                &self.config().default_limits,
                &self.config().max_limits,
            )
            .map(|_| ())
            .map_err(|e| e.to_string())
        })
        .map_err(|message| CoreError::invalid(ErrorCode::BadPools, message))
    }

    /// Applies the configured pools and starts the controller.
    pub(crate) fn start_pools(self: &Arc<Self>) -> Result<(), CoreError> {
        let configs = self.check_pools(&self.config().pools)?;
        if !configs.is_empty() {
            tracing::info!(pools = configs.len(), "warm pools configured");
        }
        lock(&self.pools).set(configs);
        self.spawn_pool_controller();
        Ok(())
    }

    /// Serves a create from pool `key` if it has a ready member: None when
    /// there is no such pool or it is empty (the caller creates cold).
    pub(crate) async fn claim_from_pool(
        self: &Arc<Self>,
        key: &PoolKey,
        claim: Claim,
        owner: &crate::tenants::Owner,
    ) -> Result<Option<Run>, CoreError> {
        loop {
            // No such pool: the cold create that follows finds an earlier
            // create's run as well.
            if !lock(&self.pools).has(key) {
                return Ok(None);
            }
            // The key lookup, the checks, and taking a member off the pool
            // and for this create are one step of the ledger's; the pool
            // offers its ready members one by one.
            let ask = Ask {
                owner,
                key: claim.idempotency.as_ref(),
                volumes: &claim.volumes,
                dataset_ready: &|mount| self.dataset_ready(mount),
                runs: 1,
                max_runs: self.config().max_runs,
            };
            let pools = self.pools.clone();
            let mut next = || lock(&pools).take(key, Instant::now());
            let taken = self.context.ledger.claim(ask, &mut next).await?;
            if matches!(taken, Claimed::Member(_)) {
                *lock(&self.last_claim) = Some(tokio::time::Instant::now());
            }
            self.pool_wake.notify_one();
            let member = match taken {
                Claimed::Earlier(earlier) => return self.answer_repeat(earlier).await.map(Some),
                Claimed::Empty => return Ok(None),
                Claimed::Member(id) => match self.registry().get(&id).cloned() {
                    Some(member) => member,
                    // Destroyed since (its owner left the ledger last).
                    None => continue,
                },
            };
            let asked = member
                .ask(|reply| Command::Claim {
                    claim: Box::new(claim.clone()),
                    reply,
                })
                .await;
            match asked {
                Ok(()) => {
                    tracing::info!(run = %member.id, pool = %key, "run served from a warm pool");
                    return Ok(Some(self.view(&member)));
                }
                Err(e) => {
                    // It died or could not start serving: it goes, and the
                    // next member (or a cold create) serves this create.
                    tracing::warn!(run = %member.id, pool = %key, error = %error_chain(&e), "a pool member could not be handed out");
                    lock(&self.pools).unclaimed(key);
                    self.stop_member(member.id);
                    if !claim.volumes.is_empty() {
                        // Mounting into a member failed; a cold create
                        // mounts at start instead of costing more members.
                        return Ok(None);
                    }
                }
            }
        }
    }

    /// Makes one member of pool `config` and warms it up; its id once it
    /// is ready to join.
    async fn make_member(self: &Arc<Self>, config: &PoolConfig) -> Result<Ulid, CoreError> {
        let key = &config.key;
        let limits = validate::create_limits(
            Some(key.size),
            None,
            &self.config().default_limits,
            &self.config().max_limits,
        )?;
        if limits.disk_mb.is_some() {
            if let Err(why) = self.lane.capabilities().disk_limit.check() {
                return Err(CoreError::invalid(
                    ErrorCode::DiskLimitUnsupported,
                    format!("this server cannot limit a run's disk: {why}"),
                ));
            }
        }
        let image_guard = self.image_lock.lock().await;
        let (layers, image_layers, image_config) = {
            let images = self.images.clone();
            let name = key.image.clone();
            tokio::task::spawn_blocking(move || images.for_run(&name))
                .await
                .map_err(|e| CoreError::Store(format!("image lookup task failed: {e}")))??
        };
        let id = Ulid::new();
        let now = OffsetDateTime::now_utc();
        let record = RunRecord {
            id,
            image: key.image.clone(),
            network: key.network,
            limits,
            env: Env::default(),
            created_at: now,
            // Idle members live until claimed; a day-old one is remade.
            expires_at: now + self.config().max_ttl,
            status: RunStatus::Creating,
            runtime: String::new(),
            agent_socket: Default::default(),
            image_config,
            layers,
            lease: Default::default(),
            egress: Default::default(),
            idempotency: None,
            failure: None,
            warm: None,
            size: Some(key.size),
            labels: Default::default(),
            public_ports: false,
            auto_resume: true,
            on_expire: Default::default(),
            ttl_sec: 0,
            expired: false,
            pool: Some(Membership {
                key: key.clone(),
                claimed: false,
            }),
            idle: Default::default(),
            history: None,
            restarts: 0,
            restarted_at: None,
            archived_at: None,
            archive_error: None,
            tenant: None,
            allow_privilege_escalation: false,
            volumes: Vec::new(),
            proxy_ca: self.context.proxy_trust(key.network).is_some(),
            moved: false,
            on_node_loss: self.config().on_node_loss,
            recovered: None,
            restore_from: None,
        };
        let spec = SandboxSpec {
            id,
            image_layers,
            limits,
            network: key.network,
            trust_pem: self.context.proxy_trust(key.network),
            seed: None,
            warm: None,
            volumes: Vec::new(),
        };
        // Counted against nothing until a create takes it.
        self.context
            .ledger
            .enter(id, super::entry(&record, &Phase::Creating));
        let (answer, delivered) = self.spawn_creating(record, spec);
        drop(image_guard);
        let made = answer
            .await
            .map_err(|_| CoreError::Agent("the member's owner ended without an answer".into()));
        let _ = delivered.send(());
        made??;
        if let Some(argv) = &config.warmup {
            if let Err(e) = self.warm_up(id, argv).await {
                self.stop_member(id);
                return Err(e);
            }
        }
        Ok(id)
    }

    /// Runs the pool's warmup command in member `id`; an error unless it
    /// exits 0 within [`WARMUP_TIMEOUT_SECS`].
    async fn warm_up(&self, id: Ulid, argv: &[String]) -> Result<(), CoreError> {
        let handle = self
            .registry()
            .get(&id)
            .cloned()
            .ok_or(CoreError::RunNotFound(id))?;
        let req = ExecRequest {
            cmd: argv.to_vec(),
            timeout_sec: Some(WARMUP_TIMEOUT_SECS),
            ..Default::default()
        };
        let mut events = Box::pin(self.exec_handle(handle, req).await?);
        let mut stderr = Vec::new();
        while let Some(event) = events.next().await {
            match event {
                super::ExecEvent::Stderr(chunk) => {
                    stderr.extend_from_slice(&chunk);
                    if stderr.len() > MAX_ERROR {
                        stderr.drain(..stderr.len() - MAX_ERROR);
                    }
                }
                super::ExecEvent::Exit(exit) if exit.exit_code == 0 => return Ok(()),
                super::ExecEvent::Exit(exit) => {
                    return Err(CoreError::Agent(format!(
                        "warmup {argv:?} exited with {} ({:?}): {}",
                        exit.exit_code,
                        exit.reason,
                        String::from_utf8_lossy(&stderr).trim()
                    )))
                }
                _ => {}
            }
        }
        Err(CoreError::Agent(format!(
            "warmup {argv:?} ended without an exit status"
        )))
    }

    /// Destroys an idle member in the background.
    fn stop_member(self: &Arc<Self>, id: Ulid) {
        let Some(handle) = self.registry().get(&id).cloned() else {
            return;
        };
        tokio::spawn(async move {
            let _ = handle
                .ask(|reply| Command::Stop {
                    reason: ExitReason::RunDeleted,
                    reply,
                    halted: false,
                })
                .await;
        });
    }

    /// Makes one member for `config` under the budget and reports back.
    /// Callers come first: while a create is being built, or within
    /// [`CLAIM_QUIET`] of a claim (when the claimed run's first commands
    /// come), a refill waits (up to [`REFILL_YIELD`]), since a member
    /// made beside them takes the CPUs they are waiting for (a burst
    /// bigger than a pool is served cold, and its refills can follow it).
    async fn refill(self: Arc<Self>, config: PoolConfig) {
        let started = Instant::now();
        let yield_until = tokio::time::Instant::now() + REFILL_YIELD;
        let busy = || {
            let claimed = *lock(&self.last_claim);
            self.context.ledger.tally().creating > 0
                || claimed.is_some_and(|at| at.elapsed() < CLAIM_QUIET)
        };
        while busy() && tokio::time::Instant::now() < yield_until {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        let made = match self.budget.clone().acquire_owned().await {
            Ok(_permit) => self.make_member(&config).await,
            Err(_) => Err(CoreError::Store("the background budget is closed".into())),
        };
        match made {
            Ok(id) => {
                let surplus = lock(&self.pools).ready(&config.key, id, started.elapsed());
                if surplus {
                    self.stop_member(id);
                } else {
                    tracing::debug!(run = %id, pool = %config.key, elapsed_ms = started.elapsed().as_millis() as u64, "pool member ready");
                }
            }
            Err(e) => {
                let mut why = error_chain(&e);
                if why.len() > MAX_ERROR {
                    let mut cut = MAX_ERROR;
                    while !why.is_char_boundary(cut) {
                        cut -= 1;
                    }
                    why.truncate(cut);
                }
                tracing::warn!(pool = %config.key, error = %why, "refilling a warm pool failed");
                lock(&self.pools).failed(&config.key, why, Instant::now());
            }
        }
        self.pool_wake.notify_one();
    }

    /// Takes out of the pools, and destroys, ready members that no longer
    /// run their image's current layers, whose image is gone, or that are
    /// not running any more.
    async fn replace_stale_members(self: &Arc<Self>) {
        let configs = lock(&self.pools).configs();
        for config in configs {
            let images = self.images.clone();
            let name = config.key.image.clone();
            let current = tokio::task::spawn_blocking(move || images.for_run(&name))
                .await
                .ok()
                .and_then(|found| found.ok())
                .map(|(layers, _, _)| layers);
            let ready = lock(&self.pools).ready_members(&config.key);
            let stale: Vec<Ulid> = ready
                .into_iter()
                .filter(|id| match self.context.ledger.member(*id) {
                    Some((standing, layers)) => {
                        standing != Standing::Pooled || current.as_ref() != Some(&layers)
                    }
                    None => true,
                })
                .collect();
            if !stale.is_empty() {
                tracing::info!(pool = %config.key, members = stale.len(), "replacing pool members whose image changed or that died");
                let mut pools = lock(&self.pools);
                for id in &stale {
                    pools.remove(*id);
                }
                drop(pools);
                for id in stale {
                    self.stop_member(id);
                }
            }
        }
    }

    /// One pass of the controller: what the plan says, started.
    fn run_plan(self: &Arc<Self>) {
        let plan = lock(&self.pools).plan(Instant::now());
        for id in plan.destroy {
            self.stop_member(id);
        }
        for (config, n) in plan.refill {
            for _ in 0..n {
                tokio::spawn(self.clone().refill(config.clone()));
            }
        }
    }

    /// The controller: woken by claims, refills and changes, and every
    /// [`TICK`]; holds the manager weakly and ends with it.
    fn spawn_pool_controller(self: &Arc<Self>) {
        let weak = Arc::downgrade(self);
        let wake = self.pool_wake.clone();
        tokio::spawn(async move {
            let mut checked = Instant::now();
            loop {
                {
                    let Some(manager) = weak.upgrade() else {
                        return;
                    };
                    if checked.elapsed() >= FRESHNESS {
                        manager.replace_stale_members().await;
                        checked = Instant::now();
                    }
                    manager.run_plan();
                }
                tokio::select! {
                    () = wake.notified() => {}
                    () = tokio::time::sleep(TICK) => {}
                }
            }
        });
    }

    /// `GET /v1/pools`.
    pub fn pools(&self) -> PoolList {
        let pools = lock(&self.pools);
        PoolList {
            pools: pools.status(),
            draining: pools.draining(),
            migrated: None,
        }
    }

    /// `PUT /v1/pools`: checks the set, persists it (when the server has a
    /// pools file), then applies it; pools left out drain.
    pub async fn set_pools(&self, set: PoolSet) -> Result<PoolList, CoreError> {
        let configs = self.check_pools(&set)?;
        if let Some(cell) = self.cell_pools.get() {
            // The cell's, stored for every node of it (this one applies it
            // at once; the others when they hear of it).
            let canonical = PoolSet {
                pools: configs.iter().map(PoolConfig::to_spec).collect(),
            };
            cell.store(&canonical).await?;
        } else if let Some(path) = self.config().pools_file.clone() {
            let canonical = PoolSet {
                pools: configs.iter().map(PoolConfig::to_spec).collect(),
            };
            tokio::task::spawn_blocking(move || crate::durable::write_json(&path, &canonical))
                .await
                .map_err(|e| CoreError::Store(format!("pools file task failed: {e}")))?
                .map_err(CoreError::io("writing the pools file"))?;
        }
        tracing::info!(pools = configs.len(), "warm pools replaced");
        lock(&self.pools).set(configs);
        self.pool_wake.notify_one();
        Ok(self.pools())
    }

    /// Applies a set another node of this node's cell stored (checked as a
    /// PUT's is; one this node cannot take is logged and left).
    pub fn apply_cell_pools(&self, set: PoolSet) {
        match self.check_pools(&set) {
            Ok(configs) => {
                tracing::info!(
                    pools = configs.len(),
                    "warm pools replaced by the cell's set"
                );
                lock(&self.pools).set(configs);
                self.pool_wake.notify_one();
            }
            Err(e) => {
                tracing::warn!(error = %e, "this node cannot take its cell's pool set; it keeps its pools");
            }
        }
    }

    /// From now on `PUT /v1/pools` stores the set as the node's cell's.
    pub fn set_cell_pools(&self, cell: Arc<dyn crate::fleet::SharedPools>) {
        let _ = self.cell_pools.set(cell);
    }

    /// `POST /v1/drain` (true) and `DELETE /v1/drain` (false).
    pub fn set_draining(&self, draining: bool) -> PoolList {
        lock(&self.pools).set_draining(draining);
        tracing::info!(draining, "node drain switched");
        self.pool_wake.notify_one();
        self.pools()
    }

    /// `GET /v1/info`.
    pub fn info(&self) -> Info {
        let (live, creating) = {
            let tally = self.context.ledger.tally();
            (tally.counted, tally.creating)
        };
        let pools = lock(&self.pools);
        Info {
            server: self.config().server_id.clone(),
            version: env!("CARGO_PKG_VERSION").to_owned(),
            runtime: self.lane.name(),
            capacity: runbox_types::Capacity {
                max: self.config().max_runs,
                live,
                creating,
                pooled: pools.idle(),
            },
            pools: pools.status(),
            draining: pools.draining(),
            storage: self.lane.storage(),
            userns: match self.lane.capabilities().user_namespaces {
                crate::lane::Support::Yes => "private",
                crate::lane::Support::No(_) => "off",
            }
            .to_owned(),
            catalog: Some(self.catalog()),
        }
    }

    /// The capability catalog of `GET /v1/info`: every value read from
    /// what this daemon was started with and what its lane can do.
    fn catalog(&self) -> runbox_types::Catalog {
        use runbox_types::{
            Catalog, EgressCatalog, LaneCatalog, LimitsCatalog, PersistenceCatalog, SizeCatalog,
            SizeTier,
        };
        let config = self.config();
        let caps = self.lane.capabilities();
        let egress = config
            .egress
            .as_ref()
            .filter(|_| caps.network(NetworkTier::Allowlist).is_ok());
        let networks: Vec<NetworkTier> =
            [NetworkTier::None, NetworkTier::Allowlist, NetworkTier::Open]
                .into_iter()
                .filter(|tier| caps.network(*tier).is_ok())
                .filter(|tier| *tier != NetworkTier::Allowlist || egress.is_some())
                .collect();
        let word = |yes: bool, what: &str, or: &str| if yes { what } else { or }.to_owned();
        let userns = word(caps.user_namespaces.yes(), "private", "off");
        Catalog {
            egress_control: word(egress.is_some(), "hosts-and-cidrs", "none"),
            secret_brokering: word(
                egress.is_some() && config.sealer.is_some(),
                "native",
                "none",
            ),
            networks,
            egress: EgressCatalog {
                rules: egress.is_some(),
                live_update: egress.is_some(),
                max_entries: crate::egress::MAX_RUN_ENTRIES as u32,
                max_secrets: crate::egress::MAX_RUN_SECRETS as u32,
                declared_secrets: egress.map(|e| e.secret_names()).unwrap_or_default(),
                default_list: egress.is_some_and(|e| e.default_list()),
                socks5: egress.is_some(),
                classes: egress.map(|e| e.class_names()).unwrap_or_default(),
                upstream_proxies: egress.is_some_and(|e| e.takes_upstreams())
                    && config.sealer.is_some(),
            },
            persistence: PersistenceCatalog {
                resume: word(
                    caps.suspend.yes() || caps.hibernate.yes(),
                    "same-sandbox",
                    "none",
                ),
                capture: word(caps.capture.yes(), "filesystem", "none"),
                clone: caps.capture.yes(),
                capture_source: "preserved".to_owned(),
                retention: word(
                    config.checkpoint_ttl.is_some(),
                    "provider-managed",
                    "caller-managed",
                ),
                restore_mount: "new-resource".to_owned(),
            },
            lanes: vec![LaneCatalog {
                name: self.lane.name(),
                isolation: "container".to_owned(),
                userns,
            }],
            sizes: SizeTier::ALL
                .iter()
                .map(|size| {
                    let fitted = crate::validate::create_limits(
                        Some(*size),
                        None,
                        &config.default_limits,
                        &config.max_limits,
                    );
                    let tier = size.limits();
                    SizeCatalog {
                        size: *size,
                        limits: runbox_types::Limits {
                            disk_mb: config.default_limits.disk_mb.and(tier.disk_mb),
                            ..tier
                        },
                        available: fitted.is_ok(),
                    }
                })
                .collect(),
            limits: LimitsCatalog {
                max_runs: config.max_runs,
                max_ttl_sec: config.max_ttl.as_secs(),
                max: config.max_limits,
                defaults: config.default_limits,
                max_fork_count: config.max_fork_count,
                max_upload_bytes: config.max_upload_bytes,
            },
        }
    }
}
