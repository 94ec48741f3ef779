//! What a run's owner is given: [`RunContext`].

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use arc_swap::ArcSwap;
use runbox_types::{ErrorCode, NetworkTier, Run};
use tokio::sync::Semaphore;
use ulid::Ulid;

use super::actor::RunHandle;
use super::{lock, volumes, warm};
use crate::config::Config;
use crate::error::CoreError;
use crate::images::ImageStore;
use crate::lane::{EgressDoor, Lane, SandboxSpec};
use crate::store::{RunRecord, Store};
use crate::telemetry::Telemetry;

/// What a run's owner needs from the daemon, and all it gets: the store,
/// the lane, the settings, the background budget, the ledger it reports
/// its transitions to, and the registry it leaves once its run is
/// destroyed. An owner never calls back into the [`Manager`].
pub(crate) struct RunContext {
    pub(super) config: Arc<ArcSwap<Config>>,
    pub lane: Arc<dyn Lane>,
    pub store: Store,
    pub budget: Arc<Semaphore>,
    pub teardown_gate: Arc<Semaphore>,
    pub(super) registry: Arc<Mutex<HashMap<Ulid, Arc<RunHandle>>>>,
    /// The facts that span runs: capacity, quotas, keys, holds.
    pub(crate) ledger: Arc<dyn crate::ledger::Ledger>,
    pub(super) pools: Arc<Mutex<crate::pools::Pools>>,
    /// Where a booting run's image layers are found.
    pub(super) images: ImageStore,
    /// Where a booting run's warm template is found.
    pub(super) warm: Option<Arc<crate::warm::WarmCache>>,
    /// Serialises restores from the checkpoint store, so that creates from
    /// one checkpoint download it once.
    pub(crate) restore_lock: tokio::sync::Mutex<()>,
    /// Serialises takeovers of runs from the fleet's catalog, so one run
    /// is made here once.
    pub(crate) adopt_lock: tokio::sync::Mutex<()>,
    /// Runs this node destroyed lately, newest last (see
    /// [`RunContext::ended_here`]).
    pub(crate) ended: Mutex<std::collections::VecDeque<Ulid>>,
    /// The tenant set: whose policy a wake or a fork counts against.
    pub(crate) tenants: Arc<dyn crate::tenants::TenantStore>,
    /// Where usage events go.
    pub(crate) usage: Arc<dyn crate::accounting::UsageSink>,
    /// The fleet this node belongs to, once the daemon has joined one:
    /// each published run goes to its catalog.
    pub(super) fleet: std::sync::OnceLock<Arc<dyn crate::fleet::Fleet>>,
    /// Where timings and counts go, once the server has given a sink.
    pub(super) telemetry: std::sync::OnceLock<Arc<dyn Telemetry>>,
}

/// A hibernated run's capacity slot while it is being woken; the run
/// counts as a running one once it runs, so the slot goes when dropped.
pub(crate) struct Slot(Arc<dyn crate::ledger::Ledger>, Ulid);

impl Drop for Slot {
    fn drop(&mut self) {
        self.0.end_wake(self.1);
    }
}

impl RunContext {
    /// The settings as they are now. A reload may swap them between two
    /// calls, so read once what must agree.
    pub(crate) fn config(&self) -> arc_swap::Guard<Arc<Config>> {
        self.config.load()
    }

    /// Reports to the telemetry sink, if there is one.
    pub(crate) fn report(&self, f: impl FnOnce(&dyn Telemetry)) {
        if let Some(sink) = self.telemetry.get() {
            f(sink.as_ref());
        }
    }

    /// Takes a capacity slot for waking hibernated run `id`, or refuses
    /// with 429 when there is none.
    pub(crate) async fn take_slot(&self, id: Ulid) -> Result<Slot, CoreError> {
        self.ledger.wake(id, self.config().max_runs).await?;
        Ok(Slot(self.ledger.clone(), id))
    }

    /// The owner a run stamped with `tenant` counts against: a tenant
    /// since deleted has no policy left, so no quota.
    pub(crate) fn owner_of(&self, tenant: Option<&str>) -> crate::tenants::Owner {
        crate::tenants::Owner(tenant.and_then(|t| self.tenants.get(t)))
    }

    /// What the lane needs to boot run `record` again on its disk: what
    /// its create asked for, from its record (the layers it mounts, the
    /// warm generation it holds), and the pin that keeps that generation
    /// while the boot runs.
    pub(crate) async fn boot_spec(
        &self,
        record: &RunRecord,
    ) -> Result<(SandboxSpec, Option<crate::warm::Pin>), CoreError> {
        let images = self.images.clone();
        let layers = record.layers.clone();
        let image_layers = tokio::task::spawn_blocking(move || images.layer_dirs(&layers))
            .await
            .map_err(|e| CoreError::Store(format!("image lookup task failed: {e}")))??;
        let (warm, pin) = match &record.warm {
            Some(volume) => {
                let (mount, pin) = warm::pinned_mount(self.warm.as_ref(), volume)?;
                (Some(mount), pin)
            }
            None => (None, None),
        };
        let trust_pem = self.proxy_trust(record.network);
        let spec = SandboxSpec {
            id: record.id,
            image_layers,
            limits: record.limits,
            network: record.network,
            trust_pem,
            seed: None,
            warm,
            volumes: volumes::binds(&record.volumes, &self.config().datasets),
        };
        Ok((spec, pin))
    }

    /// Removes a destroyed run from the registry and the ledger; called
    /// by its owner last.
    pub(super) fn forget(&self, id: Ulid) {
        lock(&self.registry).remove(&id);
        if let Some(gone) = self.ledger.release(id) {
            let catalog = &self.config().datasets;
            volumes::release_datasets(&self.lane, catalog, id, &gone.volumes);
        }
        lock(&self.pools).remove(id);
    }

    /// Remembers that this node destroyed run `id`.
    pub(super) fn remember_ended(&self, id: Ulid) {
        let mut ended = lock(&self.ended);
        if ended.len() >= ENDED_REMEMBERED {
            ended.pop_front();
        }
        ended.push_back(id);
    }

    /// Whether this node destroyed run `id` lately: a takeover never makes
    /// it again from a catalog row its end has not reached yet.
    pub(super) fn ended_here(&self, id: Ulid) -> bool {
        lock(&self.ended).contains(&id)
    }

    /// Tells the fleet's catalog (when there is one) where run `record`
    /// stands now: its view while the API shows it, gone once it stops.
    pub(crate) fn catalog(&self, record: &RunRecord, phase: &super::phase::Phase) {
        let Some(fleet) = self.fleet.get() else {
            return;
        };
        if record.is_idle_member() || self.ledger.idle(record.id) {
            return;
        }
        if phase.visible() {
            fleet.record_run(record.id, Some(self.published(record)));
        } else if !matches!(phase, super::phase::Phase::Pooled) {
            fleet.record_run(record.id, None);
        }
    }

    /// Run `record` as the catalog keeps it: its view, and the record
    /// itself sealed, so another node can make the run again from it.
    pub(crate) fn published(&self, record: &RunRecord) -> crate::fleet::Published {
        crate::fleet::Published {
            run: record.to_run(&self.config().server_id),
            record: self.seal_record(record),
        }
    }

    /// `record` as JSON sealed under the node's sealing key (the fleet's,
    /// on a node of one), bound to the run's id; None without a key.
    pub(crate) fn seal_record(&self, record: &RunRecord) -> Option<String> {
        let sealer = self.config().sealer.clone()?;
        let json = serde_json::to_vec(record).ok()?;
        match sealer.seal(&record_context(record.id), &json) {
            Ok(sealed) => Some(sealed),
            Err(e) => {
                tracing::warn!(run = %record.id, error = %e, "could not seal the run's record for the catalog");
                None
            }
        }
    }

    /// Run `id`'s record from its `sealed` form (see
    /// [`Context::seal_record`]).
    pub(crate) fn open_record(&self, id: Ulid, sealed: &str) -> Result<RunRecord, CoreError> {
        let sealer = self.config().sealer.clone().ok_or_else(|| {
            CoreError::Store("this node has no sealing key to open a run's record with".into())
        })?;
        let json = sealer.open(&record_context(id), sealed).map_err(|e| {
            CoreError::Store(format!(
                "run {id}'s record in the catalog cannot be opened: {e}"
            ))
        })?;
        let record: RunRecord = serde_json::from_slice(&json).map_err(|e| {
            CoreError::Store(format!("run {id}'s record in the catalog is not one: {e}"))
        })?;
        if record.id != id {
            return Err(CoreError::Store(format!(
                "the catalog's record of run {id} is of run {}",
                record.id
            )));
        }
        Ok(record)
    }

    /// The API view of a run: its record plus live counters.
    pub(crate) fn view(&self, handle: &RunHandle) -> Run {
        let config = self.config();
        let mut run = handle.snapshot().record.to_run(&config.server_id);
        run.server_origin = config.client_origin.clone();
        run.egress = handle.egress().map(|meter| meter.stats());
        run.disk_used_bytes = self.lane.sandbox(run.id).disk_used();
        run
    }

    /// The interception CA a sandbox on `network` trusts: every
    /// `allowlist` run's, so that secrets given at create, by a pool claim
    /// or by a later `PATCH .../egress` are usable; other tiers have no
    /// proxy to trust.
    pub(crate) fn proxy_trust(&self, network: NetworkTier) -> Option<String> {
        match &self.config().egress {
            Some(config) if network == NetworkTier::Allowlist => Some(config.ca_pem()),
            _ => None,
        }
    }

    /// Serves an `allowlist` run's proxy on a listener its sandbox binds in
    /// the run's network namespace. Other tiers: nothing.
    pub(crate) async fn start_egress(
        &self,
        handle: &RunHandle,
        record: &RunRecord,
        stop: tokio_util::sync::CancellationToken,
    ) -> Result<(), CoreError> {
        if record.network != NetworkTier::Allowlist {
            return Ok(());
        }
        let config = self.config().egress.clone().ok_or_else(|| {
            CoreError::invalid(
                ErrorCode::NetworkUnsupported,
                "this server has no egress proxy; use network \"none\"",
            )
        })?;
        let sandbox = self.lane.sandbox(record.id);
        let sandbox = &sandbox;
        let bind = |door| async move {
            sandbox
                .egress_listener(door)
                .await
                .map_err(|e| door_refused(door, e))
        };
        let http = bind(EgressDoor::Http).await?;
        let socks5 = match record.egress.socks5 {
            true => Some(bind(EgressDoor::Socks5).await?),
            false => None,
        };
        // Each connection's bytes become a usage event of the run's tenant
        // (the tenant a claim stamped: a pool member's proxy starts at its
        // claim).
        let on_close: Option<crate::egress::ConnectionBytes> =
            self.config().egress_usage_bytes.then(|| {
                let usage = self.usage.clone();
                let (id, tenant, size) = (record.id, record.tenant.clone(), record.size);
                Arc::new(move |bytes: u64| {
                    let mut event = crate::accounting::UsageEvent::now(
                        crate::accounting::UsageKind::Egress,
                        id,
                        tenant.clone(),
                    );
                    event.size = size;
                    event.egress_bytes = Some(bytes);
                    usage.record(event);
                }) as crate::egress::ConnectionBytes
            });
        let brought = record
            .egress
            .open_brought(record.id, self.config().sealer.as_deref());
        let upstream = record
            .egress
            .open_upstream(record.id, self.config().sealer.as_deref());
        // Its own token, so a change of tier can stop it alone.
        let meter = config
            .start(
                record.id,
                &record.egress,
                brought,
                upstream,
                crate::egress::EgressListeners { http, socks5 },
                stop.child_token(),
                on_close,
            )
            .map_err(|e| {
                CoreError::Lane(crate::lane::LaneError::Failed(format!(
                    "starting the run's egress proxy: {e}"
                )))
            })?;
        *handle.egress.lock().unwrap_or_else(|p| p.into_inner()) = Some(meter);
        Ok(())
    }
}

/// Why a door of a run's proxy could not be bound: a 409 naming the
/// address when a process of the run holds it already.
pub(crate) fn door_refused(door: EgressDoor, e: crate::lane::LaneError) -> CoreError {
    match e {
        crate::lane::LaneError::Io { source, .. }
            if source.kind() == std::io::ErrorKind::AddrInUse =>
        {
            CoreError::invalid(
                ErrorCode::PortInUse,
                format!(
                    "a process of the run listens on {} already, where runbox's {} would; \
                     stop it and ask again",
                    door.addr(),
                    match door {
                        EgressDoor::Http => "egress proxy",
                        EgressDoor::Socks5 => "SOCKS5 door",
                    }
                ),
            )
        }
        e => e.into(),
    }
}

/// How many runs this node destroyed lately it remembers.
const ENDED_REMEMBERED: usize = 4096;

/// What a run's sealed record is bound to: it opens as that run's only.
fn record_context(id: Ulid) -> String {
    format!("runbox run record {id}")
}
