//! The ledger: the facts that span runs.
//!
//! A run's owner ([`crate::runs::actor`]) holds everything about its own
//! run. What no single run owns is here: how many runs take capacity, how
//! many each tenant has against its `maxRuns`, which run answers for an
//! idempotency key, which runs (and file-API writers) hold each volume,
//! which layers and warm generations runs mount, and which pool member a
//! create has taken. A create reserves all of it in one step
//! ([`Ledger::reserve`]); a run's owner reports each transition
//! ([`Ledger::report`]) and its end ([`Ledger::release`]). The ledger never
//! looks at a run's published state: it knows what it was told.
//!
//! [`LocalLedger`] keeps the facts in memory for one node (they are
//! rebuilt at start from the run records, as each run is adopted again).
//! On a node of a fleet it also tells the fleet's [`Shared`] book what
//! spans nodes: how many runs of each tenant it counts (so a tenant's
//! `maxRuns` holds across the fleet) and the idempotency keys its creates
//! took (so a repeat sent to another node finds the run).
//! The steps that decide (a reservation, a claim, a wake's slot, a volume
//! writer) are `async`, so that a ledger shared by several nodes can take
//! them in a database transaction; the reports and reads are not.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};

use async_trait::async_trait;
use runbox_types::{ErrorCode, VolumeHolder, VolumeMode};
use ulid::Ulid;

use crate::error::CoreError;
use crate::store::Idempotency;
use crate::tenants::{Owner, TenantStore};
use crate::volumes::{RunVolumeRecord, Volumes};

/// Where a run stands, as far as the facts spanning runs go.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Standing {
    /// Its sandbox is being built.
    Creating,
    /// Up (running or paused), or failed and kept.
    Live,
    /// Hibernated or archived: only its disk is held.
    Asleep,
    /// A pool member parked, waiting for a create.
    Pooled,
    /// Being destroyed, or destroyed.
    Ending,
}

impl Standing {
    /// Whether the API shows a run standing so.
    pub fn visible(self) -> bool {
        matches!(self, Standing::Creating | Standing::Live | Standing::Asleep)
    }
}

/// What the ledger knows of one run, as its owner last reported it.
#[derive(Clone, Debug)]
pub struct Entry {
    /// Where it stands.
    pub standing: Standing,
    /// The tenant its record is stamped with.
    pub tenant: Option<String>,
    /// The idempotency key it was created with.
    pub key: Option<Idempotency>,
    /// A pool member that no create has claimed (by its record).
    pub idle_member: bool,
    /// The image it was made from.
    pub image: String,
    /// The layers it mounts.
    pub layers: Vec<String>,
    /// The volumes it mounts.
    pub volumes: Vec<RunVolumeRecord>,
    /// The warm generation it mounts.
    pub warm: Option<Ulid>,
}

/// What a create (or a fork, or a pool claim) asks the ledger for.
pub struct Ask<'a> {
    /// Whose runs they are: the tenant and its policy.
    pub owner: &'a Owner,
    /// The create's idempotency key.
    pub key: Option<&'a Idempotency>,
    /// The volumes the runs mount.
    pub volumes: &'a [RunVolumeRecord],
    /// Whether a dataset mount can be served now (the operator's catalog
    /// says), asked once its holds admit it.
    pub dataset_ready: &'a (dyn Fn(&RunVolumeRecord) -> Result<(), CoreError> + Sync),
    /// How many runs.
    pub runs: usize,
    /// The node's `--max-runs`.
    pub max_runs: usize,
}

/// The answer to a reservation.
#[derive(Debug, PartialEq, Eq)]
pub enum Reserved {
    /// The runs are on the ledger, counted from now.
    Entered,
    /// An earlier create with the same key and request made this run.
    Earlier(Ulid),
}

/// The answer to a pool claim.
#[derive(Debug, PartialEq, Eq)]
pub enum Claimed {
    /// This member is the create's run from now on.
    Member(Ulid),
    /// An earlier create with the same key and request made this run.
    Earlier(Ulid),
    /// No member offered was still free to take.
    Empty,
}

/// How many runs count against capacity, in all and by tenant.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Tally {
    /// Runs counted against `--max-runs`.
    pub counted: usize,
    /// Of those, runs being created.
    pub creating: usize,
    /// Runs counted against each tenant's `maxRuns`.
    pub by_tenant: HashMap<String, usize>,
}

impl Tally {
    /// Runs counted against `tenant`'s `maxRuns`.
    pub fn of(&self, tenant: &str) -> usize {
        self.by_tenant.get(tenant).copied().unwrap_or(0)
    }
}

/// The facts that span runs (see the module's documentation).
#[async_trait]
pub trait Ledger: Send + Sync {
    /// One step: answers with the run an earlier create made when
    /// `ask.key` names one (a conflict when that create asked for
    /// something else); else checks capacity, the tenant (that it exists,
    /// its quota) and the volumes' holds, and enters `runs`.
    async fn reserve(&self, ask: Ask<'_>, runs: Vec<(Ulid, Entry)>) -> Result<Reserved, CoreError>;

    /// A create served from a pool: the checks of [`Ledger::reserve`] for
    /// one run, then the first member `next` offers that is still parked
    /// and untaken is taken for `ask` (its tenant, key and volumes).
    async fn claim(
        &self,
        ask: Ask<'_>,
        next: &mut (dyn FnMut() -> Option<Ulid> + Send),
    ) -> Result<Claimed, CoreError>;

    /// Counts asleep run `id` against capacity while it is woken (429
    /// when there is no room); [`Ledger::end_wake`] ends that.
    async fn wake(&self, id: Ulid, max_runs: usize) -> Result<(), CoreError>;

    /// The wake of run `id` is over (it runs, and counts so, or it sleeps
    /// again).
    fn end_wake(&self, id: Ulid);

    /// One more call writing volume `volume` (`name` for messages) through
    /// the file API; refused while a run mounts it. [`Ledger::end_write`]
    /// ends it.
    async fn write_volume(&self, volume: Ulid, name: &str) -> Result<(), CoreError>;

    /// A file-API write of `volume` ended.
    fn end_write(&self, volume: Ulid);

    /// Removes volume `volume` (`name` for messages) with `remove`, once
    /// nothing holds it; in one step with the holds, so no run mounts it
    /// meanwhile.
    async fn retire_volume(
        &self,
        volume: Ulid,
        name: &str,
        remove: &mut (dyn FnMut() -> Result<(), CoreError> + Send),
    ) -> Result<(), CoreError>;

    /// Removes tenant `name` with `remove` once it has no runs left, in any
    /// phase; in one step with the reservations, so none of its creates
    /// slips in between.
    fn retire_tenant(
        &self,
        name: &str,
        remove: &mut dyn FnMut() -> Result<(), CoreError>,
    ) -> Result<(), CoreError>;

    /// Enters a run without the checks: one found at start, or a pool
    /// member (which counts against nothing until it is claimed).
    fn enter(&self, id: Ulid, entry: Entry);

    /// Run `id`'s owner reports where it stands now.
    fn report(&self, id: Ulid, entry: Entry);

    /// A claimed member could not take its create's volumes: it holds
    /// none of them.
    fn forgo_volumes(&self, id: Ulid);

    /// Run `id` is destroyed: it leaves the ledger; what it held then.
    fn release(&self, id: Ulid) -> Option<Entry>;

    /// Run `id` moved to another node: its idempotency key is that node's
    /// to answer for now, so its end here does not free it.
    fn keep_key(&self, id: Ulid);

    /// How many runs count against capacity, in all and by tenant.
    fn tally(&self) -> Tally;

    /// Whether run `id` is a pool member no create has taken (hidden from
    /// the API); false for runs not on the ledger.
    fn idle(&self, id: Ulid) -> bool;

    /// Whether no visible run holds `tenant`'s key `key`.
    fn key_is_free(&self, key: &str, tenant: Option<&str>) -> bool;

    /// Every volume runs mount, with the runs that mount it and how.
    fn holders(&self) -> HashMap<Ulid, Vec<VolumeHolder>>;

    /// The layers runs mount, in any phase, sorted.
    fn layers_in_use(&self) -> Vec<String>;

    /// Whether a run other than an idle pool member was made from image
    /// `name`.
    fn image_in_use(&self, name: &str) -> bool;

    /// Whether the runs that use image `name` are all being torn down
    /// (and there is one): they let go of it in a moment.
    fn image_ending(&self, name: &str) -> bool;

    /// The warm generations runs mount, in any phase.
    fn warm_in_use(&self) -> HashSet<Ulid>;

    /// Where parked member `id` stands and the layers it mounts.
    fn member(&self, id: Ulid) -> Option<(Standing, Vec<String>)>;

    /// From now on this node's ledger is part of the fleet's: `shared` is
    /// told every count (starting with all of them) and asked too.
    fn share(&self, shared: Arc<dyn Shared>);
}

/// The part of the ledger the nodes of a fleet share (kept by
/// `runbox-fleet` in PostgreSQL).
///
/// Each node tells how many runs of each tenant it counts, every change
/// with a sequence number that only grows, so a late write never replaces
/// a newer one; a create of a tenant's is admitted against the sum over
/// the fleet's nodes in one transaction with the node's new count, so two
/// nodes never both take the last run of a quota.
#[async_trait]
pub trait Shared: Send + Sync {
    /// This node counts `count` runs of `tenant` from now (as of `seq`),
    /// more than before: refused with the tenant's quota error when the
    /// fleet's count would pass `max_runs` (0: no limit), as deleted when
    /// the fleet has no such tenant; `503 cluster_unavailable` without the
    /// database.
    async fn admit(
        &self,
        tenant: &str,
        max_runs: u32,
        count: usize,
        seq: u64,
    ) -> Result<(), CoreError>;

    /// This node's counts of every tenant's runs are `counts` as of `seq`
    /// (tenants not named: none). Never waits: written behind.
    fn counted(&self, counts: HashMap<String, usize>, seq: u64);

    /// Takes idempotency key `key` for run `run` across the fleet: the run
    /// an earlier create of any node made with it, or a conflict when that
    /// create asked for something else.
    async fn take_key(&self, key: &Idempotency, run: Ulid) -> Result<Option<Ulid>, CoreError>;

    /// Run `run` no longer answers for its key (written behind).
    fn free_key(&self, run: Ulid);
}

/// What a create that took a pool member brings to it: held from the
/// moment it is taken, before its owner has applied the claim.
#[derive(Clone, Debug)]
struct Taken {
    key: Option<Idempotency>,
    tenant: Option<String>,
    volumes: Vec<RunVolumeRecord>,
}

/// One run on a [`LocalLedger`].
#[derive(Clone, Debug)]
struct Line {
    entry: Entry,
    taken: Option<Taken>,
    waking: bool,
}

impl Line {
    /// A pool member no create has taken: hidden, counted against nothing.
    fn idle(&self) -> bool {
        self.taken.is_none() && self.entry.idle_member
    }

    /// Whether it counts against `--max-runs` and its tenant's quota:
    /// every run but idle pool members, asleep runs (which hold only their
    /// disk) not being woken, and runs being torn down (whose processes
    /// are the first thing a teardown ends, and which a delete may answer
    /// for before the rest of it).
    fn counts(&self) -> bool {
        !self.idle()
            && match self.entry.standing {
                Standing::Asleep => self.waking,
                Standing::Ending => false,
                _ => true,
            }
    }

    /// The tenant it counts against: the claiming create's once a create
    /// took this member, else its record's.
    fn tenant(&self) -> Option<&str> {
        match &self.taken {
            Some(taken) => taken.tenant.as_deref(),
            None => self.entry.tenant.as_deref(),
        }
    }

    /// The volumes it holds: a member a create took holds the create's
    /// from then on, before its record says so.
    fn volumes(&self) -> &[RunVolumeRecord] {
        match (&self.taken, self.entry.volumes.is_empty()) {
            (Some(taken), true) => &taken.volumes,
            _ => &self.entry.volumes,
        }
    }
}

/// The ledger of one node, in memory.
pub struct LocalLedger {
    lines: Mutex<Book>,
    tenants: Arc<dyn TenantStore>,
    volumes: Arc<Volumes>,
    /// The fleet's book, on a node of a fleet.
    shared: OnceLock<Arc<dyn Shared>>,
}

#[derive(Default)]
struct Book {
    runs: HashMap<Ulid, Line>,
    /// Volumes being written through the file API, and by how many calls.
    writers: HashMap<Ulid, usize>,
    /// Tenants being removed: their runs are refused meanwhile (the
    /// removal may wait for a database, and the book is not held for it).
    retiring: std::collections::HashSet<String>,
    /// The counts by tenant the fleet was last told, and the sequence
    /// number they were told with (microseconds since the epoch at start,
    /// then one more per change, so a restarted node's are newer).
    told: HashMap<String, usize>,
    seq: u64,
}

impl Book {
    /// The counts by tenant and their sequence number when they changed
    /// since the fleet was last told.
    fn news(&mut self) -> Option<(HashMap<String, usize>, u64)> {
        let now = self.tally().by_tenant;
        if now == self.told {
            return None;
        }
        self.told = now.clone();
        self.seq += 1;
        Some((now, self.seq))
    }

    fn tally(&self) -> Tally {
        let mut tally = Tally::default();
        for line in self.runs.values().filter(|l| l.counts()) {
            tally.counted += 1;
            if line.entry.standing == Standing::Creating {
                tally.creating += 1;
            }
            if let Some(tenant) = line.tenant() {
                *tally.by_tenant.entry(tenant.to_owned()).or_insert(0) += 1;
            }
        }
        tally
    }

    fn holders(&self) -> HashMap<Ulid, Vec<VolumeHolder>> {
        let mut out: HashMap<Ulid, Vec<VolumeHolder>> = HashMap::new();
        for (id, line) in &self.runs {
            for mount in line.volumes() {
                out.entry(mount.id).or_default().push(VolumeHolder {
                    run: *id,
                    mode: mount.mode,
                });
            }
        }
        for held in out.values_mut() {
            held.sort_by_key(|h| h.run);
        }
        out
    }

    /// The run created with `wanted`'s key: None when there is none, a
    /// conflict when the key came with another request.
    fn find_key(&self, wanted: &Idempotency) -> Result<Option<Ulid>, CoreError> {
        let mut ids: Vec<&Ulid> = self.runs.keys().collect();
        // The first in id order, whatever the map's.
        ids.sort();
        for id in ids {
            let line = &self.runs[id];
            let claim_key = line.taken.as_ref().and_then(|t| t.key.as_ref());
            let Some(earlier) = line.entry.key.as_ref().or(claim_key) else {
                continue;
            };
            // A run being removed no longer answers for its key; a member a
            // create took does while its claim is applied.
            let taken = line.entry.standing == Standing::Pooled && claim_key.is_some();
            if earlier.key != wanted.key
                || earlier.tenant != wanted.tenant
                || !(line.entry.standing.visible() || taken)
            {
                continue;
            }
            if earlier.request != wanted.request {
                return Err(CoreError::Conflict {
                    code: ErrorCode::IdempotencyKeyReused,
                    message: format!(
                        "this Idempotency-Key was used for a different create (run {id}); \
                         use a new key for a new request"
                    ),
                });
            }
            return Ok(Some(*id));
        }
        Ok(None)
    }
}

impl LocalLedger {
    /// An empty ledger; `tenants` and `volumes` say which tenants and
    /// volumes exist.
    pub(crate) fn new(tenants: Arc<dyn TenantStore>, volumes: Arc<Volumes>) -> LocalLedger {
        let start = time::OffsetDateTime::now_utc().unix_timestamp_nanos() / 1000;
        LocalLedger {
            lines: Mutex::new(Book {
                seq: u64::try_from(start).unwrap_or(0),
                ..Book::default()
            }),
            tenants,
            volumes,
            shared: OnceLock::new(),
        }
    }

    fn start_sharing(&self, shared: Arc<dyn Shared>) {
        if self.shared.set(shared.clone()).is_err() {
            return;
        }
        let mut book = self.book();
        book.seq += 1;
        book.told = book.tally().by_tenant;
        shared.counted(book.told.clone(), book.seq);
    }

    /// Tells the fleet the counts when they changed.
    fn tell(&self, book: &mut Book) {
        if let Some(shared) = self.shared.get() {
            if let Some((counts, seq)) = book.news() {
                shared.counted(counts, seq);
            }
        }
    }

    /// Takes runs `ids` off the book again (a reservation the fleet
    /// refused).
    fn undo(&self, ids: &[Ulid]) {
        let mut book = self.book();
        for id in ids {
            book.runs.remove(id);
        }
        self.tell(&mut book);
    }

    /// The fleet's part of a reservation the book has entered (`run` the
    /// first of its runs): the key across the fleet, then the tenant's
    /// count. None: admitted; an earlier run: the key's.
    async fn admit_shared(&self, ask: &Ask<'_>, run: Ulid) -> Result<Option<Ulid>, CoreError> {
        let Some(shared) = self.shared.get() else {
            return Ok(None);
        };
        if let Some(key) = ask.key {
            if let Some(earlier) = shared.take_key(key, run).await? {
                return Ok(Some(earlier));
            }
        }
        let Some(tenant) = ask.owner.tenant() else {
            return Ok(None);
        };
        let (count, seq) = self.told(tenant);
        if let Err(e) = shared.admit(tenant, ask.owner.max_runs(), count, seq).await {
            if ask.key.is_some() {
                shared.free_key(run);
            }
            return Err(e);
        }
        Ok(None)
    }

    /// `tenant`'s count as the fleet is told it now, with its sequence
    /// number.
    fn told(&self, tenant: &str) -> (usize, u64) {
        let mut book = self.book();
        self.tell(&mut book);
        (book.told.get(tenant).copied().unwrap_or(0), book.seq)
    }

    /// Frees run `line`'s key across the fleet, if it took one.
    fn free_key(&self, id: Ulid, line: &Line) {
        let keyed =
            line.entry.key.is_some() || line.taken.as_ref().is_some_and(|t| t.key.is_some());
        if let (true, Some(shared)) = (keyed, self.shared.get()) {
            shared.free_key(id);
        }
    }

    /// Every critical section is a few map operations that leave the book
    /// consistent even if a panic stopped them.
    fn book(&self) -> MutexGuard<'_, Book> {
        self.lines.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The checks of a reservation, under the book's lock: the key first
    /// (a repeat is answered whatever else changed), then capacity, the
    /// tenant and the volumes.
    fn admit(&self, book: &Book, ask: &Ask<'_>) -> Result<Option<Ulid>, CoreError> {
        if let Some(wanted) = ask.key {
            if let Some(earlier) = book.find_key(wanted)? {
                return Ok(Some(earlier));
            }
        }
        let tally = book.tally();
        if tally.counted + ask.runs > ask.max_runs {
            return Err(CoreError::Capacity(ask.max_runs));
        }
        if let Some(tenant) = ask.owner.tenant() {
            if self.tenants.get(tenant).is_none() || book.retiring.contains(tenant) {
                return Err(CoreError::invalid(
                    ErrorCode::Unauthorized,
                    format!("tenant {tenant:?} was deleted"),
                ));
            }
            ask.owner.check_quota(tally.of(tenant), ask.runs)?;
        }
        self.admit_volumes(book, ask)?;
        Ok(None)
    }

    /// Refuses mounts of volumes that are gone or held in a way the mounts
    /// exclude: one writer (a run or a file-API write), or any number of
    /// readers.
    fn admit_volumes(&self, book: &Book, ask: &Ask<'_>) -> Result<(), CoreError> {
        let mounts = ask.volumes;
        if mounts.is_empty() {
            return Ok(());
        }
        let held = book.holders();
        for mount in mounts {
            if !mount.dataset && !self.volumes.exists(mount.id) {
                return Err(crate::runs::volume_not_found(&mount.name));
            }
            if let Some(moving) = self.volumes.moving(mount.id) {
                return Err(in_motion(&mount.name, &moving));
            }
            if book.writers.contains_key(&mount.id) {
                return Err(being_written(&mount.name));
            }
            let conflict = held
                .get(&mount.id)
                .into_iter()
                .flatten()
                .find(|h| mount.mode == VolumeMode::Rw || h.mode == VolumeMode::Rw);
            if let Some(holder) = conflict {
                let why = match mount.mode {
                    VolumeMode::Rw => "a writer needs it to itself",
                    VolumeMode::Ro => "readers wait until the writer is gone",
                };
                return Err(CoreError::invalid(
                    ErrorCode::VolumeBusy,
                    format!(
                        "volume {:?} is mounted {} by run {}; {why}",
                        mount.name,
                        holder.mode.as_str(),
                        holder.run
                    ),
                ));
            }
            if mount.dataset {
                (ask.dataset_ready)(mount)?;
            }
        }
        Ok(())
    }
}

/// A [`Ask::dataset_ready`] for asks without datasets.
pub fn no_datasets(_: &RunVolumeRecord) -> Result<(), CoreError> {
    Ok(())
}

/// A use of a volume refused while it moves between nodes.
pub(crate) fn in_motion(name: &str, moving: &crate::volumes::VolumeMoving) -> CoreError {
    CoreError::invalid(
        ErrorCode::VolumeBusy,
        format!(
            "volume {name:?} is moving to node {}; retry when the move ends (through any node)",
            moving.to
        ),
    )
}

/// A mount refused while the volume is written through its file API.
pub(crate) fn being_written(name: &str) -> CoreError {
    CoreError::invalid(
        ErrorCode::VolumeBusy,
        format!(
            "volume {name:?} is being written through its file API; retry when that write ends"
        ),
    )
}

#[async_trait]
impl Ledger for LocalLedger {
    async fn reserve(&self, ask: Ask<'_>, runs: Vec<(Ulid, Entry)>) -> Result<Reserved, CoreError> {
        let ids: Vec<Ulid> = runs.iter().map(|(id, _)| *id).collect();
        {
            let mut book = self.book();
            if let Some(earlier) = self.admit(&book, &ask)? {
                return Ok(Reserved::Earlier(earlier));
            }
            for (id, entry) in runs {
                book.runs.insert(
                    id,
                    Line {
                        entry,
                        taken: None,
                        waking: false,
                    },
                );
            }
        }
        let Some(first) = ids.first() else {
            return Ok(Reserved::Entered);
        };
        match self.admit_shared(&ask, *first).await {
            Ok(None) => Ok(Reserved::Entered),
            Ok(Some(earlier)) => {
                self.undo(&ids);
                Ok(Reserved::Earlier(earlier))
            }
            Err(e) => {
                self.undo(&ids);
                Err(e)
            }
        }
    }

    async fn claim(
        &self,
        ask: Ask<'_>,
        next: &mut (dyn FnMut() -> Option<Ulid> + Send),
    ) -> Result<Claimed, CoreError> {
        let taken = {
            let mut book = self.book();
            if let Some(earlier) = self.admit(&book, &ask)? {
                return Ok(Claimed::Earlier(earlier));
            }
            let mut taken = None;
            while let Some(id) = next() {
                let Some(line) = book.runs.get_mut(&id) else {
                    continue;
                };
                if line.entry.standing != Standing::Pooled || line.taken.is_some() {
                    continue;
                }
                line.taken = Some(Taken {
                    key: ask.key.cloned(),
                    tenant: ask.owner.tenant().map(str::to_owned),
                    volumes: ask.volumes.to_vec(),
                });
                taken = Some(id);
                break;
            }
            taken
        };
        let Some(id) = taken else {
            return Ok(Claimed::Empty);
        };
        let shared = self.admit_shared(&ask, id).await;
        if !matches!(shared, Ok(None)) {
            // The member goes back to the pool, untaken.
            let mut book = self.book();
            if let Some(line) = book.runs.get_mut(&id) {
                line.taken = None;
            }
            self.tell(&mut book);
        }
        match shared? {
            None => Ok(Claimed::Member(id)),
            Some(earlier) => Ok(Claimed::Earlier(earlier)),
        }
    }

    async fn wake(&self, id: Ulid, max_runs: usize) -> Result<(), CoreError> {
        let owner = {
            let mut book = self.book();
            let tally = book.tally();
            if tally.counted >= max_runs {
                return Err(CoreError::Capacity(max_runs));
            }
            let Some(line) = book.runs.get_mut(&id) else {
                return Err(CoreError::RunNotFound(id));
            };
            // A tenant since deleted has no policy left, so no quota.
            let owner = Owner(line.tenant().and_then(|t| self.tenants.get(t)));
            if let Some(tenant) = owner.tenant() {
                owner.check_quota(tally.of(tenant), 1)?;
            }
            line.waking = true;
            owner
        };
        let (Some(shared), Some(tenant)) = (self.shared.get(), owner.tenant()) else {
            return Ok(());
        };
        let (count, seq) = self.told(tenant);
        if let Err(e) = shared.admit(tenant, owner.max_runs(), count, seq).await {
            self.end_wake(id);
            return Err(e);
        }
        Ok(())
    }

    fn end_wake(&self, id: Ulid) {
        let mut book = self.book();
        if let Some(line) = book.runs.get_mut(&id) {
            line.waking = false;
        }
        self.tell(&mut book);
    }

    async fn write_volume(&self, volume: Ulid, name: &str) -> Result<(), CoreError> {
        let mut book = self.book();
        // Under the book, as a move's start is: one of them sees the other.
        if let Some(moving) = self.volumes.moving(volume) {
            return Err(in_motion(name, &moving));
        }
        if let Some(holder) = book.holders().remove(&volume).unwrap_or_default().first() {
            let how = match holder.mode {
                VolumeMode::Rw => "a writer has it to itself",
                VolumeMode::Ro => "its readers are promised it does not change",
            };
            return Err(CoreError::invalid(
                ErrorCode::VolumeBusy,
                format!(
                    "volume {name:?} is mounted {} by run {}, and {how}; write it when no run mounts it (reads go on meanwhile)",
                    holder.mode.as_str(),
                    holder.run
                ),
            ));
        }
        *book.writers.entry(volume).or_default() += 1;
        Ok(())
    }

    fn end_write(&self, volume: Ulid) {
        let mut book = self.book();
        if let Some(n) = book.writers.get_mut(&volume) {
            *n -= 1;
            if *n == 0 {
                book.writers.remove(&volume);
            }
        }
    }

    async fn retire_volume(
        &self,
        volume: Ulid,
        name: &str,
        remove: &mut (dyn FnMut() -> Result<(), CoreError> + Send),
    ) -> Result<(), CoreError> {
        let book = self.book();
        if let Some(holder) = book.holders().remove(&volume).unwrap_or_default().first() {
            return Err(CoreError::invalid(
                ErrorCode::VolumeBusy,
                format!(
                    "volume {name:?} is mounted ({}) by run {}; delete that run first",
                    holder.mode.as_str(),
                    holder.run
                ),
            ));
        }
        if book.writers.contains_key(&volume) {
            return Err(being_written(name));
        }
        if let Some(moving) = self.volumes.moving(volume) {
            return Err(in_motion(name, &moving));
        }
        remove()
    }

    fn retire_tenant(
        &self,
        name: &str,
        remove: &mut dyn FnMut() -> Result<(), CoreError>,
    ) -> Result<(), CoreError> {
        {
            let mut book = self.book();
            let runs = book
                .runs
                .values()
                .filter(|l| !l.idle() && l.tenant() == Some(name))
                .count();
            if runs > 0 {
                return Err(CoreError::Conflict {
                    code: ErrorCode::TenantHasRuns,
                    message: format!(
                        "tenant {name:?} still has {runs} runs; delete them first (rotating its token shuts it out at once)"
                    ),
                });
            }
            // From here no run of its is reserved; the book is let go
            // while the removal runs.
            book.retiring.insert(name.to_owned());
        }
        let removed = remove();
        self.book().retiring.remove(name);
        removed
    }

    fn enter(&self, id: Ulid, entry: Entry) {
        let mut book = self.book();
        book.runs.insert(
            id,
            Line {
                entry,
                taken: None,
                waking: false,
            },
        );
        self.tell(&mut book);
    }

    fn report(&self, id: Ulid, entry: Entry) {
        let mut book = self.book();
        let Some(line) = book.runs.get_mut(&id) else {
            return;
        };
        let ending = entry.standing == Standing::Ending && line.entry.standing != Standing::Ending;
        line.entry = entry;
        // A run being removed no longer answers for its key.
        if ending {
            let line = line.clone();
            self.free_key(id, &line);
        }
        self.tell(&mut book);
    }

    fn forgo_volumes(&self, id: Ulid) {
        if let Some(taken) = self.book().runs.get_mut(&id).and_then(|l| l.taken.as_mut()) {
            taken.volumes.clear();
        }
    }

    fn release(&self, id: Ulid) -> Option<Entry> {
        let mut book = self.book();
        let line = book.runs.remove(&id)?;
        self.free_key(id, &line);
        self.tell(&mut book);
        Some(line.entry)
    }

    fn keep_key(&self, id: Ulid) {
        if let Some(line) = self.book().runs.get_mut(&id) {
            line.entry.key = None;
            if let Some(taken) = line.taken.as_mut() {
                taken.key = None;
            }
        }
    }

    fn tally(&self) -> Tally {
        self.book().tally()
    }

    fn idle(&self, id: Ulid) -> bool {
        self.book().runs.get(&id).is_some_and(Line::idle)
    }

    fn key_is_free(&self, key: &str, tenant: Option<&str>) -> bool {
        self.book().runs.values().all(|line| {
            !line.entry.standing.visible()
                || line
                    .entry
                    .key
                    .as_ref()
                    .is_none_or(|k| k.key != key || k.tenant.as_deref() != tenant)
        })
    }

    fn holders(&self) -> HashMap<Ulid, Vec<VolumeHolder>> {
        self.book().holders()
    }

    fn layers_in_use(&self) -> Vec<String> {
        let mut layers: Vec<String> = self
            .book()
            .runs
            .values()
            .flat_map(|l| l.entry.layers.clone())
            .collect();
        layers.sort();
        layers.dedup();
        layers
    }

    fn image_in_use(&self, name: &str) -> bool {
        // Idle pool members do not hold their image: once it is gone, the
        // pool controller replaces them (their layers stay until then).
        self.book()
            .runs
            .values()
            .any(|l| !l.idle() && l.entry.image == name)
    }

    fn image_ending(&self, name: &str) -> bool {
        let book = self.book();
        let mut users = book
            .runs
            .values()
            .filter(|l| !l.idle() && l.entry.image == name)
            .peekable();
        users.peek().is_some() && users.all(|l| l.entry.standing == Standing::Ending)
    }

    fn warm_in_use(&self) -> HashSet<Ulid> {
        self.book()
            .runs
            .values()
            .filter_map(|l| l.entry.warm)
            .collect()
    }

    fn share(&self, shared: Arc<dyn Shared>) {
        self.start_sharing(shared);
    }

    fn member(&self, id: Ulid) -> Option<(Standing, Vec<String>)> {
        self.book()
            .runs
            .get(&id)
            .map(|l| (l.entry.standing, l.entry.layers.clone()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tenants::FileTenants;
    use crate::volumes::{VolumeRecord, VolumeStore};
    use runbox_types::CreateTenantRequest;

    /// Volume records in memory.
    #[derive(Default)]
    struct Shelf(Mutex<Vec<VolumeRecord>>);

    impl VolumeStore for Shelf {
        fn list(&self) -> Result<Vec<VolumeRecord>, CoreError> {
            Ok(self.0.lock().unwrap().clone())
        }
        fn put(&self, record: &VolumeRecord) -> Result<(), CoreError> {
            let mut all = self.0.lock().unwrap();
            all.retain(|v| v.id != record.id);
            all.push(record.clone());
            Ok(())
        }
        fn delete(&self, id: Ulid) -> Result<(), CoreError> {
            self.0.lock().unwrap().retain(|v| v.id != id);
            Ok(())
        }
    }

    struct Fixture {
        ledger: LocalLedger,
        tenants: Arc<dyn TenantStore>,
        volumes: Arc<Volumes>,
        _dir: tempfile::TempDir,
    }

    fn fixture() -> Fixture {
        let dir = tempfile::tempdir().unwrap();
        let tenants: Arc<dyn TenantStore> =
            Arc::new(FileTenants::open(dir.path().join("tenants.json")).unwrap());
        let volumes = Arc::new(Volumes::open(Arc::new(Shelf::default())).unwrap());
        Fixture {
            ledger: LocalLedger::new(tenants.clone(), volumes.clone()),
            tenants,
            volumes,
            _dir: dir,
        }
    }

    impl Fixture {
        fn tenant(&self, name: &str, max_runs: u32) -> Owner {
            let (entry, _) = self
                .tenants
                .create(CreateTenantRequest {
                    name: name.into(),
                    max_runs,
                    ..Default::default()
                })
                .unwrap();
            Owner(Some(entry))
        }

        fn volume(&self, name: &str) -> Ulid {
            let record = VolumeRecord {
                moving: None,
                id: Ulid::new(),
                name: name.into(),
                tenant: None,
                size_mb: 16,
                created_at: time::OffsetDateTime::now_utc(),
                labels: Default::default(),
            };
            self.volumes.add(record.clone()).unwrap().unwrap();
            record.id
        }

        async fn create(
            &self,
            owner: &Owner,
            key: Option<&Idempotency>,
            volumes: &[RunVolumeRecord],
            max_runs: usize,
        ) -> Result<(Ulid, Reserved), CoreError> {
            let id = Ulid::new();
            let ask = Ask {
                owner,
                key,
                volumes,
                dataset_ready: &no_datasets,
                runs: 1,
                max_runs,
            };
            let mut entry = entry(Standing::Creating);
            entry.tenant = owner.tenant().map(str::to_owned);
            entry.key = key.cloned();
            entry.volumes = volumes.to_vec();
            let reserved = self.ledger.reserve(ask, vec![(id, entry)]).await?;
            Ok((id, reserved))
        }
    }

    fn entry(standing: Standing) -> Entry {
        Entry {
            standing,
            tenant: None,
            key: None,
            idle_member: false,
            image: "base".into(),
            layers: vec!["l1".into()],
            volumes: Vec::new(),
            warm: None,
        }
    }

    fn key(key: &str, request: &str, tenant: Option<&str>) -> Idempotency {
        Idempotency {
            key: key.into(),
            request: request.into(),
            tenant: tenant.map(str::to_owned),
        }
    }

    fn mount(id: Ulid, mode: VolumeMode) -> RunVolumeRecord {
        RunVolumeRecord {
            id,
            name: "data".into(),
            path: "/volumes/data".into(),
            mode,
            dataset: false,
        }
    }

    #[tokio::test]
    async fn capacity_counts_every_run_but_sleepers_and_comes_back_on_release() {
        let f = fixture();
        let operator = Owner(None);
        let (a, _) = f.create(&operator, None, &[], 2).await.unwrap();
        let (b, _) = f.create(&operator, None, &[], 2).await.unwrap();
        let full = f.create(&operator, None, &[], 2).await.unwrap_err();
        assert!(matches!(full, CoreError::Capacity(2)), "{full:?}");
        // Asleep, a run holds only its disk; a wake counts it again.
        f.ledger.report(a, entry(Standing::Asleep));
        assert_eq!(f.ledger.tally().counted, 1);
        let (c, _) = f.create(&operator, None, &[], 2).await.unwrap();
        let refused = f.ledger.wake(a, 2).await.unwrap_err();
        assert!(matches!(refused, CoreError::Capacity(2)), "{refused:?}");
        // Being torn down, its processes ended first, it takes no slot.
        f.ledger.report(c, entry(Standing::Ending));
        assert_eq!(f.ledger.tally().counted, 1);
        assert!(f.ledger.release(c).is_some());
        f.ledger.wake(a, 2).await.unwrap();
        assert_eq!(f.ledger.tally().counted, 2);
        f.ledger.end_wake(a);
        assert_eq!(f.ledger.tally().counted, 1);
        assert!(f.ledger.release(b).is_some());
        assert_eq!(f.ledger.tally().counted, 0);
        assert!(f.ledger.release(b).is_none());
    }

    #[tokio::test]
    async fn a_tenant_is_held_to_its_quota_and_a_deleted_one_to_nothing() {
        let f = fixture();
        let acme = f.tenant("acme", 1);
        let (run, _) = f.create(&acme, None, &[], 10).await.unwrap();
        assert_eq!(f.ledger.tally().of("acme"), 1);
        let over = f.create(&acme, None, &[], 10).await.unwrap_err();
        assert!(
            matches!(over, CoreError::TenantQuota { max: 1, .. }),
            "{over:?}"
        );
        // Not while it has runs; then in the same step as the check.
        let busy = f
            .ledger
            .retire_tenant("acme", &mut || f.tenants.delete("acme"))
            .unwrap_err();
        assert_eq!(busy.code(), ErrorCode::TenantHasRuns);
        f.ledger.release(run);
        // The book is not held while the removal runs (a database may be
        // waited for): the ledger answers meanwhile, and the tenant's
        // creates are refused.
        f.ledger
            .retire_tenant("acme", &mut || {
                assert_eq!(f.ledger.tally().counted, 0);
                let during = futures::executor::block_on(f.create(&acme, None, &[], 10));
                assert_eq!(during.unwrap_err().code(), ErrorCode::Unauthorized);
                f.tenants.delete("acme")
            })
            .unwrap();
        let gone = f.create(&acme, None, &[], 10).await.unwrap_err();
        assert_eq!(gone.code(), ErrorCode::Unauthorized);
    }

    #[tokio::test]
    async fn a_key_answers_with_its_run_while_the_run_is_shown() {
        let f = fixture();
        let operator = Owner(None);
        let first = key("k", "r1", None);
        let (run, reserved) = f.create(&operator, Some(&first), &[], 1).await.unwrap();
        assert_eq!(reserved, Reserved::Entered);
        // A repeat is answered even at capacity; another request is not.
        let (_, again) = f.create(&operator, Some(&first), &[], 1).await.unwrap();
        assert_eq!(again, Reserved::Earlier(run));
        let other = f
            .create(&operator, Some(&key("k", "r2", None)), &[], 1)
            .await
            .unwrap_err();
        assert_eq!(other.code(), ErrorCode::IdempotencyKeyReused);
        // Another tenant's key is another key.
        let acme = f.tenant("acme", 0);
        let theirs = key("k", "r1", Some("acme"));
        let (_, entered) = f.create(&acme, Some(&theirs), &[], 2).await.unwrap();
        assert_eq!(entered, Reserved::Entered);
        assert!(!f.ledger.key_is_free("k", None));
        // A run being deleted no longer answers for it.
        let mut ending = entry(Standing::Ending);
        ending.key = Some(first.clone());
        f.ledger.report(run, ending);
        assert!(f.ledger.key_is_free("k", None));
        f.ledger.release(run);
        let (_, fresh) = f.create(&operator, Some(&first), &[], 2).await.unwrap();
        assert_eq!(fresh, Reserved::Entered);
    }

    #[tokio::test]
    async fn an_image_only_runs_being_torn_down_use_is_ending() {
        let f = fixture();
        let operator = Owner(None);
        assert!(!f.ledger.image_ending("base"), "no run uses it");
        let (a, _) = f.create(&operator, None, &[], 3).await.unwrap();
        let (b, _) = f.create(&operator, None, &[], 3).await.unwrap();
        f.ledger.report(a, entry(Standing::Ending));
        assert!(!f.ledger.image_ending("base"), "b still runs from it");
        f.ledger.report(b, entry(Standing::Ending));
        assert!(f.ledger.image_ending("base"));
        assert!(f.ledger.image_in_use("base"));
        f.ledger.release(a);
        f.ledger.release(b);
        assert!(!f.ledger.image_ending("base") && !f.ledger.image_in_use("base"));
    }

    #[tokio::test]
    async fn a_claim_takes_one_parked_member_and_counts_it_for_the_create() {
        let f = fixture();
        let acme = f.tenant("acme", 0);
        let member = |standing| Entry {
            idle_member: true,
            ..entry(standing)
        };
        let (making, parked, taken) = (Ulid::new(), Ulid::new(), Ulid::new());
        f.ledger.enter(making, member(Standing::Creating));
        f.ledger.enter(parked, member(Standing::Pooled));
        f.ledger.enter(taken, member(Standing::Pooled));
        assert_eq!(f.ledger.tally().counted, 0);
        assert!(f.ledger.idle(parked));
        assert!(!f.ledger.image_in_use("base"));
        let wanted = key("k", "r", Some("acme"));
        let ask = |key| Ask {
            owner: &acme,
            key,
            volumes: &[],
            dataset_ready: &no_datasets,
            runs: 1,
            max_runs: 10,
        };
        // The pool offers a member still being made, then a parked one.
        let mut offers = vec![parked, making, Ulid::new()];
        let mut next = || offers.pop();
        let claimed = f.ledger.claim(ask(Some(&wanted)), &mut next).await.unwrap();
        assert_eq!(claimed, Claimed::Member(parked));
        assert!(!f.ledger.idle(parked));
        assert_eq!(f.ledger.tally().of("acme"), 1);
        assert!(f.ledger.image_in_use("base"));
        // Its key answers for it before its owner applied the claim.
        let mut none = || None;
        let repeat = f.ledger.claim(ask(Some(&wanted)), &mut none).await.unwrap();
        assert_eq!(repeat, Claimed::Earlier(parked));
        // Taken once only.
        let mut again = vec![parked];
        let mut next = || again.pop();
        assert_eq!(
            f.ledger.claim(ask(None), &mut next).await.unwrap(),
            Claimed::Empty
        );
        let mut next = || Some(taken);
        assert_eq!(
            f.ledger.claim(ask(None), &mut next).await.unwrap(),
            Claimed::Member(taken)
        );
        assert_eq!(f.ledger.tally().of("acme"), 2);
    }

    #[tokio::test]
    async fn volume_holds_admit_one_writer_or_many_readers() {
        let f = fixture();
        let operator = Owner(None);
        let data = f.volume("data");
        let (reader, _) = f
            .create(&operator, None, &[mount(data, VolumeMode::Ro)], 10)
            .await
            .unwrap();
        f.create(&operator, None, &[mount(data, VolumeMode::Ro)], 10)
            .await
            .unwrap();
        let writer = f
            .create(&operator, None, &[mount(data, VolumeMode::Rw)], 10)
            .await
            .unwrap_err();
        assert_eq!(writer.code(), ErrorCode::VolumeBusy);
        assert_eq!(f.ledger.holders()[&data].len(), 2);
        // A file-API write waits for the readers, a delete too.
        let write = f.ledger.write_volume(data, "data").await.unwrap_err();
        assert_eq!(write.code(), ErrorCode::VolumeBusy);
        let remove = f.volumes.clone();
        let delete = f
            .ledger
            .retire_volume(data, "data", &mut || remove.remove(data))
            .await
            .unwrap_err();
        assert_eq!(delete.code(), ErrorCode::VolumeBusy);
        assert!(f.volumes.exists(data));
        let _ = reader;
        for id in f.ledger.holders()[&data]
            .iter()
            .map(|h| h.run)
            .collect::<Vec<_>>()
        {
            f.ledger.release(id);
        }
        // A write excludes mounts until it ends.
        f.ledger.write_volume(data, "data").await.unwrap();
        let mounted = f
            .create(&operator, None, &[mount(data, VolumeMode::Ro)], 10)
            .await
            .unwrap_err();
        assert!(mounted.to_string().contains("file API"), "{mounted}");
        f.ledger.end_write(data);
        f.ledger
            .retire_volume(data, "data", &mut || remove.remove(data))
            .await
            .unwrap();
        let gone = f
            .create(&operator, None, &[mount(data, VolumeMode::Ro)], 10)
            .await
            .unwrap_err();
        assert_eq!(gone.code(), ErrorCode::VolumeNotFound);
    }

    /// A fleet's book in memory: admits up to `room` runs of a tenant over
    /// all it was told, answers keys from its map.
    #[derive(Default)]
    struct FleetBook {
        room: usize,
        told: Mutex<Vec<(HashMap<String, usize>, u64)>>,
        keys: Mutex<HashMap<String, Ulid>>,
        freed: Mutex<Vec<Ulid>>,
    }

    #[async_trait]
    impl Shared for FleetBook {
        async fn admit(
            &self,
            tenant: &str,
            max: u32,
            count: usize,
            _: u64,
        ) -> Result<(), CoreError> {
            match count > self.room {
                true => Err(CoreError::TenantQuota {
                    tenant: tenant.into(),
                    max,
                }),
                false => Ok(()),
            }
        }
        fn counted(&self, counts: HashMap<String, usize>, seq: u64) {
            self.told.lock().unwrap().push((counts, seq));
        }
        async fn take_key(&self, key: &Idempotency, run: Ulid) -> Result<Option<Ulid>, CoreError> {
            let mut keys = self.keys.lock().unwrap();
            match keys.get(&key.key) {
                Some(earlier) => Ok(Some(*earlier)),
                None => {
                    keys.insert(key.key.clone(), run);
                    Ok(None)
                }
            }
        }
        fn free_key(&self, run: Ulid) {
            self.freed.lock().unwrap().push(run);
        }
    }

    #[tokio::test]
    async fn the_fleets_refusal_or_earlier_run_takes_the_reservation_back() {
        let f = fixture();
        let acme = f.tenant("acme", 5);
        let fleet = Arc::new(FleetBook {
            room: 1,
            ..Default::default()
        });
        f.ledger.share(fleet.clone());
        let (first, _) = f.create(&acme, None, &[], 10).await.unwrap();
        // The fleet refuses the second: the book is as before it.
        let err = f.create(&acme, None, &[], 10).await.unwrap_err();
        assert_eq!(err.code(), ErrorCode::TenantQuota);
        assert_eq!(f.ledger.tally().of("acme"), 1);
        // A key another node took answers with that node's run.
        let elsewhere = Ulid::new();
        fleet.keys.lock().unwrap().insert("k".into(), elsewhere);
        let key = Idempotency {
            key: "k".into(),
            request: "r".into(),
            tenant: None,
        };
        let (_, reserved) = f.create(&Owner::root(), Some(&key), &[], 10).await.unwrap();
        assert_eq!(reserved, Reserved::Earlier(elsewhere));
        assert_eq!(f.ledger.tally().counted, 1);
        // Every change was told, newest last, and the release frees keys.
        f.ledger.release(first);
        let told = fleet.told.lock().unwrap().clone();
        assert!(told.windows(2).all(|w| w[0].1 < w[1].1), "{told:?}");
        assert_eq!(told.last().map(|t| t.0.get("acme").copied()), Some(None));
        let fresh = Idempotency {
            key: "fresh".into(),
            ..key
        };
        let (keyed, _) = f
            .create(&Owner::root(), Some(&fresh), &[], 10)
            .await
            .unwrap();
        f.ledger.release(keyed);
        assert_eq!(*fleet.freed.lock().unwrap(), vec![keyed]);
    }
}
