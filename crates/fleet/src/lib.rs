//! runbox's fleet state on PostgreSQL.
//!
//! A node started with `--cluster-db` joins the fleet whose state lives in
//! that database: it brings the schema up to date (versioned migrations,
//! under PostgreSQL's advisory lock, so nodes starting at once take turns),
//! checks that it holds the fleet's cluster key, keeps a row of its own
//! with a heartbeat stamped by the database's clock, and reads the others'
//! rows to say where each stands ([`Cluster`], which is core's
//! [`runbox_core::fleet::Fleet`]). No node trusts another's clock, and
//! there is no consensus of our own: the database is the one place.

use std::borrow::Cow;
use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use hmac::{Hmac, Mac};
use runbox_core::fleet::{unavailable, Located, Orphan, Published, Takeover};
use runbox_core::CoreError;
use runbox_types::{ClusterNode, NodeState};
use sha2::Sha256;
use sqlx::migrate::{Migration, MigrationSource, MigrationType, Migrator};
use sqlx::postgres::{PgConnectOptions, PgPool, PgPoolOptions};
use sqlx::Row;

mod book;
mod catalog;
mod cell;
mod place;
mod singleton;
mod tenants;
#[cfg(feature = "testing")]
pub mod testing;
mod volume_moves;

pub use cell::CellPools;
pub use runbox_core::fleet::{Fleet, VolumeMove};
pub use tenants::PgTenants;

/// The schema, in order. Each file is applied once, in its own
/// transaction, and never changed after it shipped (its checksum is kept).
const MIGRATIONS: &[(i64, &str, &str)] = &[
    (
        1,
        "membership",
        include_str!("../migrations/0001_membership.sql"),
    ),
    (2, "tenants", include_str!("../migrations/0002_tenants.sql")),
    (3, "runs", include_str!("../migrations/0003_runs.sql")),
    (4, "ledger", include_str!("../migrations/0004_ledger.sql")),
    (
        5,
        "placement",
        include_str!("../migrations/0005_placement.sql"),
    ),
    (
        6,
        "singletons",
        include_str!("../migrations/0006_singletons.sql"),
    ),
    (7, "shared", include_str!("../migrations/0007_shared.sql")),
    (
        8,
        "pool sets",
        include_str!("../migrations/0008_pool_sets.sql"),
    ),
    (
        9,
        "node volumes",
        include_str!("../migrations/0009_node_volumes.sql"),
    ),
    (
        10,
        "node facts",
        include_str!("../migrations/0010_node_facts.sql"),
    ),
    (11, "moves", include_str!("../migrations/0011_moves.sql")),
    (
        12,
        "volume moves",
        include_str!("../migrations/0012_volume_moves.sql"),
    ),
];

/// The schema files built into the binary, as sqlx's migrator takes them.
/// (Its `migrate!` macro does the same at compile time through a
/// procedural macro; this keeps that macro and its build out of the
/// daemon.)
#[derive(Debug)]
struct Embedded;

impl MigrationSource<'static> for Embedded {
    fn resolve(
        self,
    ) -> futures::future::BoxFuture<'static, Result<Vec<Migration>, sqlx::error::BoxDynError>> {
        Box::pin(async {
            Ok(MIGRATIONS
                .iter()
                .map(|(version, description, sql)| {
                    Migration::new(
                        *version,
                        Cow::Borrowed(*description),
                        MigrationType::Simple,
                        Cow::Borrowed(*sql),
                        false,
                    )
                })
                .collect())
        })
    }
}

/// How long a query waits for a connection: while the database cannot be
/// reached, what needs it is refused after this (a 503), not held.
const ACQUIRE_TIMEOUT: Duration = Duration::from_secs(3);

/// How a node joins the fleet.
#[derive(Clone)]
pub struct Options {
    /// The database, as `postgres://user@host:port/database` (a password
    /// in it is taken, but [`Options::password`] is the better place).
    pub url: String,
    /// The database password, from the environment or a file.
    pub password: Option<String>,
    /// This node's id.
    pub node: String,
    /// Where the other nodes reach this one (host:port).
    pub advertise: String,
    /// Where clients may reach this node directly (an origin URL).
    pub client_advertise: Option<String>,
    /// The cluster key every node of the fleet is given.
    pub key: Vec<u8>,
    /// How often the node stamps its heartbeat.
    pub heartbeat: Duration,
    /// A node not heard from for this long is suspect.
    pub suspect_after: Duration,
    /// A node not heard from for this long is gone.
    pub gone_after: Duration,
}

impl std::fmt::Debug for Options {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Neither the password nor the key, whatever logs this.
        f.debug_struct("Options")
            .field("node", &self.node)
            .field("advertise", &self.advertise)
            .field("client_advertise", &self.client_advertise)
            .finish_non_exhaustive()
    }
}

/// What a node tells the fleet about itself when it joins.
#[derive(Clone, Debug)]
pub struct Facts {
    /// The runbox version.
    pub version: String,
    /// Its runtime lane.
    pub lane: String,
    /// Its `--max-runs`.
    pub capacity: u32,
}

/// How full a node is, stamped with each heartbeat.
#[derive(Clone, Debug, Default)]
pub struct Load {
    /// Runs counted against its capacity.
    pub runs: u32,
    /// Ready warm pool members.
    pub pools_ready: u32,
    /// Whether it is cordoned.
    pub draining: bool,
    /// The images it stores: local names and the references they came
    /// from.
    pub images: Vec<String>,
    /// The images its warm pools have ready members of.
    pub pooled: Vec<String>,
    /// The volumes it holds and the datasets it serves, each as
    /// `tenant/name` (`/name`: the operator's; `*/name`: a dataset any
    /// tenant may mount).
    pub volumes: Vec<String>,
    /// Its checkpoint store when that is a bucket (`s3://bucket/prefix`),
    /// which other nodes may share.
    pub checkpoint_store: Option<String>,
    /// What its lane can do, by name.
    pub capabilities: Vec<String>,
}

/// Why a node could not join.
#[derive(Debug, thiserror::Error)]
pub enum JoinError {
    /// The URL is not one the driver reads.
    #[error("--cluster-db is not a PostgreSQL URL (postgres://user@host:port/database): {0}")]
    BadUrl(String),
    /// The database could not be reached or refused the login.
    #[error("cannot reach the cluster database at {target}: {why}")]
    Unreachable {
        /// host:port/database.
        target: String,
        /// The driver's reason.
        why: String,
    },
    /// The schema could not be brought up to date.
    #[error("the cluster database's schema could not be brought up to date: {0}")]
    Migrate(String),
    /// Another cluster key made this fleet.
    #[error(
        "this node's cluster key is not the fleet's: the nodes already in the database were \
         given another; give every node the same key (RUNBOX_CLUSTER_KEY or --cluster-key-file)"
    )]
    KeyMismatch,
    /// A live node has this id.
    #[error(
        "node id {id:?} belongs to a live node at {advertise} (heard from {seen_sec:.1}s ago); \
         give this node another --node-id, or stop that one first"
    )]
    IdInUse {
        /// The id.
        id: String,
        /// Where that node is.
        advertise: String,
        /// How long ago it was heard from.
        seen_sec: f64,
    },
    /// A tenant of the node is not the fleet's.
    #[error("{0}")]
    Tenant(String),
    /// A query failed while joining.
    #[error("the cluster database failed while this node joined: {0}")]
    Query(String),
}

/// This node's membership of the fleet.
pub struct Cluster {
    pool: PgPool,
    options: Options,
    /// This start of the node: a restart is a new incarnation of it.
    incarnation: String,
    target: String,
    /// This node's side of the run catalog.
    catalog: catalog::Catalog,
    /// This node's side of the fleet's ledger.
    book: Arc<book::Book>,
    /// The key node-to-node proofs are made with.
    proof_key: Vec<u8>,
}

/// A secret the nodes of a fleet share, derived from the cluster key for
/// one `purpose` (the root token, the preview key, the sealing key), as
/// 64 hexadecimal characters: every node derives the same, and none can be
/// worked back to the key or to another purpose's.
pub fn shared_secret(key: &[u8], purpose: &str) -> String {
    mac_hex(key, &[b"runbox fleet secret v1\0", purpose.as_bytes()])
}

/// HMAC-SHA256 under `key` of `parts` in order, as hexadecimal.
fn mac_hex(key: &[u8], parts: &[&[u8]]) -> String {
    let mut mac = Hmac::<Sha256>::new_from_slice(key).expect("HMAC takes keys of any length");
    for part in parts {
        mac.update(part);
    }
    mac.finalize()
        .into_bytes()
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// How long a node's proof of a request holds: clocks of the nodes may
/// differ by this much (the proof is a request's, sent at once).
const PROOF_LIFETIME_SECS: u64 = 60;

/// The MAC of a request `what` that node `node` sends at `at`.
fn proof_mac(key: &[u8], node: &str, at: i64, what: &str) -> String {
    let at = at.to_string();
    mac_hex(
        key,
        &[
            node.as_bytes(),
            b"\0",
            at.as_bytes(),
            b"\0",
            what.as_bytes(),
        ],
    )
}

/// What the key check stored in the database is: a keyed hash of a fixed
/// text, which shows whether two nodes hold the same key and nothing of
/// the key.
fn key_check(key: &[u8]) -> String {
    mac_hex(key, &[b"runbox cluster key check v1"])
}

impl Cluster {
    /// Joins the fleet: connects, brings the schema up to date, checks the
    /// key and takes this node's row. Nothing is written before the key
    /// has been checked but the schema.
    pub async fn join(options: Options, facts: Facts) -> Result<Arc<Cluster>, JoinError> {
        let mut connect = PgConnectOptions::from_str(&options.url)
            .map_err(|e| JoinError::BadUrl(e.to_string()))?;
        if let Some(password) = &options.password {
            connect = connect.password(password);
        }
        connect = connect
            .application_name(&format!("runbox {}", options.node))
            // No query holds a connection for long: a database that
            // stops answering is an error within this, not a hang.
            .options([("statement_timeout", "5000")]);
        let target = format!(
            "{}:{}/{}",
            connect.get_host(),
            connect.get_port(),
            connect.get_database().unwrap_or("")
        );
        let pool = PgPoolOptions::new()
            .max_connections(8)
            .acquire_timeout(ACQUIRE_TIMEOUT)
            .connect_with(connect)
            .await
            .map_err(|e| JoinError::Unreachable {
                target: target.clone(),
                why: e.to_string(),
            })?;
        let mut migrator = Migrator::new(Embedded)
            .await
            .map_err(|e| JoinError::Migrate(e.to_string()))?;
        // A newer node may have brought the schema further: an older one
        // still joins (migrations only add), so a fleet upgrades node by
        // node.
        migrator.set_ignore_missing(true);
        migrator
            .run(&pool)
            .await
            .map_err(|e| JoinError::Migrate(e.to_string()))?;
        let check = key_check(&options.key);
        sqlx::query("INSERT INTO runbox_cluster (key_check) VALUES ($1) ON CONFLICT DO NOTHING")
            .bind(&check)
            .execute(&pool)
            .await
            .map_err(query)?;
        let fleet: String = sqlx::query_scalar("SELECT key_check FROM runbox_cluster")
            .fetch_one(&pool)
            .await
            .map_err(query)?;
        if fleet != check {
            return Err(JoinError::KeyMismatch);
        }
        let incarnation = ulid::Ulid::new().to_string();
        // The row is this node's unless a live node with another address
        // holds it; a restart at the same address takes it over at once.
        let mut tx = pool.begin().await.map_err(query)?;
        let held = sqlx::query(
            "SELECT advertise, EXTRACT(EPOCH FROM now() - heartbeat)::float8 AS silent, \
             left_at IS NOT NULL AS left FROM runbox_nodes WHERE id = $1 FOR UPDATE",
        )
        .bind(&options.node)
        .fetch_optional(&mut *tx)
        .await
        .map_err(query)?;
        if let Some(row) = held {
            let advertise: String = row.get("advertise");
            let silent: f64 = row.get("silent");
            let left: bool = row.get("left");
            if !left
                && advertise != options.advertise
                && silent < options.suspect_after.as_secs_f64()
            {
                return Err(JoinError::IdInUse {
                    id: options.node.clone(),
                    advertise,
                    seen_sec: silent,
                });
            }
        }
        sqlx::query(
            "INSERT INTO runbox_nodes (id, advertise, client_origin, version, lane, incarnation, capacity) \
             VALUES ($1, $2, $3, $4, $5, $6, $7) \
             ON CONFLICT (id) DO UPDATE SET advertise = $2, client_origin = $3, version = $4, \
             lane = $5, incarnation = $6, capacity = $7, runs = 0, pools_ready = 0, \
             draining = false, left_at = NULL, started_at = now(), heartbeat = now()",
        )
        .bind(&options.node)
        .bind(&options.advertise)
        .bind(&options.client_advertise)
        .bind(&facts.version)
        .bind(&facts.lane)
        .bind(&incarnation)
        .bind(i32::try_from(facts.capacity).unwrap_or(i32::MAX))
        .execute(&mut *tx)
        .await
        .map_err(query)?;
        tx.commit().await.map_err(query)?;
        tracing::info!(node = %options.node, advertise = %options.advertise, database = %target, "joined the cluster");
        let catalog = catalog::Catalog::start(pool.clone(), options.node.clone(), target.clone());
        let proof_key = shared_secret(&options.key, "node-proof").into_bytes();
        let book = Arc::new(book::Book::start(
            pool.clone(),
            options.node.clone(),
            target.clone(),
            options.gone_after,
        ));
        singleton::spawn_catalog_sweep(pool.clone(), options.node.clone());
        Ok(Arc::new(Cluster {
            pool,
            options,
            incarnation,
            target,
            catalog,
            book,
            proof_key,
        }))
    }

    /// Makes the egress interception CA in `dir` (`ca.pem`, `ca.key`, as
    /// `runbox_proxy` keeps them; made there already) the fleet's: the
    /// first node to join stores its pair, sealed with `sealer`; a node
    /// whose pair differs takes the fleet's, moving its own to
    /// `<dir>.joined`. So a run's trust of the CA holds whichever node's
    /// proxy intercepts for it.
    pub async fn share_authority(
        &self,
        dir: &std::path::Path,
        sealer: &dyn runbox_core::sealed::Sealer,
    ) -> Result<(), JoinError> {
        const NAME: &str = "interception-ca";
        let read = |file: &str| {
            std::fs::read_to_string(dir.join(file))
                .map_err(|e| JoinError::Query(format!("reading {}: {e}", dir.join(file).display())))
        };
        let local = serde_json::json!({ "cert": read("ca.pem")?, "key": read("ca.key")? });
        let sealed = sealer
            .seal(NAME, local.to_string().as_bytes())
            .map_err(JoinError::Query)?;
        sqlx::query(
            "INSERT INTO runbox_shared (name, sealed) VALUES ($1, $2) ON CONFLICT DO NOTHING",
        )
        .bind(NAME)
        .bind(&sealed)
        .execute(&self.pool)
        .await
        .map_err(query)?;
        let stored: String = sqlx::query_scalar("SELECT sealed FROM runbox_shared WHERE name = $1")
            .bind(NAME)
            .fetch_one(&self.pool)
            .await
            .map_err(query)?;
        let opened = sealer.open(NAME, &stored).map_err(|e| {
            JoinError::Query(format!(
                "the fleet's interception CA cannot be opened with this node's cluster key: {e}"
            ))
        })?;
        let fleet: serde_json::Value = serde_json::from_slice(&opened).map_err(|e| {
            JoinError::Query(format!("the fleet's interception CA is malformed: {e}"))
        })?;
        if fleet == local {
            return Ok(());
        }
        let (Some(cert), Some(key)) = (fleet["cert"].as_str(), fleet["key"].as_str()) else {
            return Err(JoinError::Query(
                "the fleet's interception CA is malformed".into(),
            ));
        };
        let aside = dir.with_extension("joined");
        let write = || -> std::io::Result<()> {
            use std::io::Write as _;
            use std::os::unix::fs::OpenOptionsExt as _;
            let _ = std::fs::remove_dir_all(&aside);
            std::fs::create_dir_all(&aside)?;
            for file in ["ca.pem", "ca.key"] {
                std::fs::copy(dir.join(file), aside.join(file))?;
            }
            // The key first and the certificate last, as the proxy writes
            // them: a pair is whole once its certificate is there.
            std::fs::remove_file(dir.join("ca.pem"))?;
            let mut out = std::fs::OpenOptions::new()
                .write(true)
                .create(true)
                .truncate(true)
                .mode(0o600)
                .open(dir.join("ca.key"))?;
            out.write_all(key.as_bytes())?;
            out.sync_all()?;
            std::fs::write(dir.join("ca.pem"), cert)
        };
        write().map_err(|e| {
            JoinError::Query(format!(
                "taking the fleet's interception CA into {}: {e}",
                dir.display()
            ))
        })?;
        tracing::info!(dir = %dir.display(), aside = %aside.display(), "this node's interception CA is the fleet's now; its own is kept aside");
        Ok(())
    }

    /// Cell `cell`'s warm-pool set ([`CellPools`]).
    pub fn cell_pools(&self, cell: &str) -> Arc<CellPools> {
        CellPools::new(self.pool.clone(), cell.to_owned())
    }

    /// The database as logs name it: host:port/database, no password.
    pub fn target(&self) -> &str {
        &self.target
    }

    /// The fleet's tenant set ([`PgTenants`]), loaded, and kept fresh from
    /// now on; the tenants of `local` (the node's own set from before it
    /// joined) that the fleet does not have are added first.
    pub async fn tenants(
        self: &Arc<Self>,
        local: &[Arc<runbox_core::tenants::TenantEntry>],
    ) -> Result<Arc<PgTenants>, JoinError> {
        PgTenants::open(
            self.pool.clone(),
            self.target.clone(),
            self.options.node.clone(),
            local,
        )
        .await
        .map_err(|e| match e {
            tenants::Refused::Query(e) => query(e),
            conflict => JoinError::Tenant(conflict.to_string()),
        })
    }

    /// Stamps this node's heartbeat and load every [`Options::heartbeat`]
    /// until the cluster is dropped; `load` says how full the node is.
    /// A database that cannot be reached is logged once per outage; the
    /// node goes on serving its own runs meanwhile.
    pub fn spawn_heartbeat(self: &Arc<Self>, load: Arc<dyn Fn() -> Load + Send + Sync>) {
        let weak = Arc::downgrade(self);
        let every = self.options.heartbeat;
        tokio::spawn(async move {
            let mut down = false;
            let mut first = true;
            loop {
                // The first beat at once: placement reads what it says.
                if !std::mem::take(&mut first) {
                    tokio::time::sleep(every).await;
                }
                let Some(cluster) = weak.upgrade() else {
                    return;
                };
                match cluster.beat(load()).await {
                    Ok(()) if down => {
                        down = false;
                        tracing::info!(database = %cluster.target, "the cluster database answers again");
                    }
                    Ok(()) => {}
                    Err(e) if !down => {
                        down = true;
                        tracing::warn!(database = %cluster.target, error = %e, "the cluster database cannot be reached; this node goes on serving its runs");
                    }
                    Err(_) => {}
                }
            }
        });
    }

    /// One heartbeat: the row's stamp (the database's clock) and load. A
    /// row another incarnation has taken over is left alone.
    async fn beat(&self, load: Load) -> Result<(), sqlx::Error> {
        sqlx::query(
            "UPDATE runbox_nodes SET heartbeat = now(), runs = $3, pools_ready = $4, draining = $5, \
             images = $6, pooled = $7, volumes = $8, checkpoint_store = $9, capabilities = $10 \
             WHERE id = $1 AND incarnation = $2",
        )
        .bind(&self.options.node)
        .bind(&self.incarnation)
        .bind(i32::try_from(load.runs).unwrap_or(i32::MAX))
        .bind(i32::try_from(load.pools_ready).unwrap_or(i32::MAX))
        .bind(load.draining)
        .bind(&load.images)
        .bind(&load.pooled)
        .bind(&load.volumes)
        .bind(&load.checkpoint_store)
        .bind(&load.capabilities)
        .execute(&self.pool)
        .await
        .map(|_| ())
    }

    /// Leaves the fleet cleanly: the row says so at once (the others see
    /// the node gone without waiting for its heartbeat to age).
    pub async fn leave(&self) {
        let left = sqlx::query(
            "UPDATE runbox_nodes SET left_at = now() WHERE id = $1 AND incarnation = $2",
        )
        .bind(&self.options.node)
        .bind(&self.incarnation)
        .execute(&self.pool)
        .await;
        if let Err(e) = left {
            tracing::warn!(database = %self.target, error = %e, "could not record this node's leaving; the others will see it gone once its heartbeat ages");
        }
        self.pool.close().await;
    }
}

fn query(e: sqlx::Error) -> JoinError {
    JoinError::Query(e.to_string())
}

#[async_trait]
impl Fleet for Cluster {
    fn record_run(&self, id: ulid::Ulid, run: Option<Published>) {
        self.catalog.record(id, run);
    }

    async fn record_run_now(&self, run: &Published) -> Result<(), CoreError> {
        self.catalog.record_now(&self.options.node, run).await
    }

    fn resync_runs(&self, list: &dyn Fn() -> Vec<Published>) {
        self.catalog.resync(list);
    }

    async fn hold_run(&self, id: ulid::Ulid) -> Result<Option<String>, CoreError> {
        self.catalog.hold(&self.options.node, id).await
    }

    async fn take_run(&self, id: ulid::Ulid, how: Takeover) -> Result<Option<String>, CoreError> {
        self.catalog
            .take(&self.options.node, id, how, self.options.gone_after)
            .await
    }

    async fn hand_off_run(
        &self,
        id: ulid::Ulid,
        to: &str,
        record: &str,
    ) -> Result<bool, CoreError> {
        self.catalog
            .hand_off(&self.options.node, id, to, record)
            .await
    }

    async fn superseded_runs(&self, ids: &[ulid::Ulid]) -> Result<Vec<ulid::Ulid>, CoreError> {
        self.catalog.superseded(&self.options.node, ids).await
    }

    async fn stranger_runs(
        &self,
        ids: &[ulid::Ulid],
    ) -> Result<Vec<(ulid::Ulid, String)>, CoreError> {
        self.catalog.strangers(&self.options.node, ids).await
    }

    async fn orphans(&self, limit: usize) -> Result<Vec<Orphan>, CoreError> {
        let limit = i64::try_from(limit).unwrap_or(i64::MAX);
        self.catalog.orphans(self.options.gone_after, limit).await
    }

    async fn settle_orphan(
        &self,
        orphan: &Orphan,
        run: &runbox_types::Run,
        record: Option<&str>,
    ) -> Result<bool, CoreError> {
        self.catalog.settle(orphan, run, record).await
    }

    async fn end_lost_run(&self, id: ulid::Ulid) -> Result<bool, CoreError> {
        self.catalog.end_lost(id).await
    }

    async fn begin_volume_move(
        &self,
        volume: ulid::Ulid,
        id: ulid::Ulid,
        to: &str,
    ) -> Result<bool, CoreError> {
        volume_moves::begin(&self.pool, volume, id, &self.options.node, to).await
    }

    async fn end_volume_move(
        &self,
        volume: ulid::Ulid,
        id: ulid::Ulid,
        end: VolumeMove,
    ) -> Result<VolumeMove, CoreError> {
        volume_moves::end(&self.pool, volume, id, end, &self.options.node).await
    }

    async fn volume_nodes(
        &self,
        volumes: &[String],
    ) -> Result<Vec<(String, Option<String>)>, CoreError> {
        volume_moves::holders(
            &self.pool,
            volumes,
            self.options.suspect_after.as_secs_f64(),
        )
        .await
    }

    async fn runs(&self) -> Result<Vec<runbox_types::Run>, CoreError> {
        self.catalog.runs().await
    }

    async fn run(&self, id: ulid::Ulid) -> Result<Option<runbox_types::Run>, CoreError> {
        self.catalog.run(id).await
    }

    fn ledger(&self) -> Arc<dyn runbox_core::ledger::Shared> {
        self.book.clone()
    }

    async fn place(&self, want: &runbox_core::fleet::Want) -> Result<Option<Located>, CoreError> {
        place::place(&self.pool, want, self.options.suspect_after.as_secs_f64()).await
    }

    async fn singleton(&self, work: &str, hold: Duration) -> Result<Option<u64>, CoreError> {
        singleton::take(&self.pool, &self.options.node, work, hold).await
    }

    async fn locate(&self, id: ulid::Ulid) -> Result<Option<Located>, CoreError> {
        let row = sqlx::query(
            "SELECT r.node, r.tenant, r.status, n.advertise, n.left_at IS NOT NULL AS left, \
             EXTRACT(EPOCH FROM now() - n.heartbeat)::float8 AS silent, \
             (r.record IS NOT NULL AND n.checkpoint_store LIKE 's3://%' AND n.checkpoint_store = \
               (SELECT checkpoint_store FROM runbox_nodes WHERE id = $2)) AS portable \
             FROM runbox_runs r JOIN runbox_nodes n ON n.id = r.node \
             WHERE r.id = $1 AND r.status <> 'gone'",
        )
        .bind(id.to_string())
        .bind(&self.options.node)
        .fetch_optional(&self.pool)
        .await
        .map_err(unavailable)?;
        Ok(row.map(|row| {
            let silent: f64 = row.get("silent");
            let gone =
                row.get::<bool, _>("left") || silent >= self.options.gone_after.as_secs_f64();
            let status: String = row.get("status");
            Located {
                node: row.get("node"),
                advertise: row.get("advertise"),
                tenant: row.get("tenant"),
                gone,
                silent_sec: silent.max(0.0),
                archived: status == "archived" || (status == "restoring" && gone),
                lost: status == "lost",
                portable: row
                    .try_get::<Option<bool>, _>("portable")
                    .ok()
                    .flatten()
                    .unwrap_or(false),
            }
        }))
    }

    fn prove(&self, what: &str) -> String {
        let now = time::OffsetDateTime::now_utc().unix_timestamp();
        format!(
            "{} {now} {}",
            self.options.node,
            proof_mac(&self.proof_key, &self.options.node, now, what)
        )
    }

    fn proven(&self, what: &str, proof: &str) -> bool {
        let mut parts = proof.splitn(3, ' ');
        let (Some(node), Some(at), Some(mac)) = (parts.next(), parts.next(), parts.next()) else {
            return false;
        };
        let Ok(at) = at.parse::<i64>() else {
            return false;
        };
        let now = time::OffsetDateTime::now_utc().unix_timestamp();
        if now.abs_diff(at) > PROOF_LIFETIME_SECS {
            return false;
        }
        let expected = proof_mac(&self.proof_key, node, at, what);
        // Compared in constant time.
        expected.len() == mac.len()
            && expected
                .bytes()
                .zip(mac.bytes())
                .fold(0u8, |acc, (a, b)| acc | (a ^ b))
                == 0
    }

    async fn nodes(&self) -> Result<Vec<ClusterNode>, CoreError> {
        let rows = sqlx::query(
            "SELECT id, advertise, client_origin, version, lane, capabilities, checkpoint_store, \
             capacity, runs, pools_ready, draining, left_at IS NOT NULL AS left, started_at, \
             EXTRACT(EPOCH FROM now() - heartbeat)::float8 AS silent \
             FROM runbox_nodes ORDER BY id",
        )
        .fetch_all(&self.pool)
        .await
        .map_err(unavailable)?;
        let suspect = self.options.suspect_after.as_secs_f64();
        let gone = self.options.gone_after.as_secs_f64();
        Ok(rows
            .iter()
            .map(|row| {
                let silent: f64 = row.get("silent");
                let state = if row.get::<bool, _>("left") || silent >= gone {
                    NodeState::Gone
                } else if silent >= suspect {
                    NodeState::Suspect
                } else if row.get::<bool, _>("draining") {
                    NodeState::Draining
                } else {
                    NodeState::Active
                };
                let count = |name: &str| u32::try_from(row.get::<i32, _>(name)).unwrap_or(0);
                ClusterNode {
                    id: row.get("id"),
                    advertise: Some(row.get("advertise")),
                    client_origin: row.get("client_origin"),
                    version: row.get("version"),
                    lane: row.get("lane"),
                    capabilities: row.get("capabilities"),
                    checkpoint_store: row.get("checkpoint_store"),
                    state,
                    capacity: count("capacity"),
                    runs: count("runs"),
                    pools_ready: count("pools_ready"),
                    last_seen_sec: silent.max(0.0),
                    started_at: row.get("started_at"),
                    local: false,
                }
            })
            .collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_key_check_tells_keys_apart_and_shows_nothing_of_them() {
        let a = key_check(b"first key");
        assert_eq!(a, key_check(b"first key"));
        assert_ne!(a, key_check(b"second key"));
        assert_eq!(a.len(), 64);
        assert!(!a.contains("first"));
    }

    #[test]
    fn shared_secrets_differ_by_purpose_and_key_and_not_by_node() {
        let root = shared_secret(b"k1", "root-token");
        assert_eq!(root, shared_secret(b"k1", "root-token"));
        assert_ne!(root, shared_secret(b"k1", "preview-key"));
        assert_ne!(root, shared_secret(b"k2", "root-token"));
        assert_ne!(root, key_check(b"k1"));
        assert_eq!(root.len(), 64);
    }

    #[test]
    fn options_never_print_the_password_or_the_key() {
        let options = Options {
            url: "postgres://runbox:hunter2@db:5432/runbox".into(),
            password: Some("hunter2".into()),
            node: "n1".into(),
            advertise: "10.0.0.1:8080".into(),
            client_advertise: None,
            key: b"secret-key".to_vec(),
            heartbeat: Duration::from_secs(2),
            suspect_after: Duration::from_secs(10),
            gone_after: Duration::from_secs(60),
        };
        let shown = format!("{options:?}");
        assert!(
            !shown.contains("hunter2") && !shown.contains("secret-key"),
            "{shown}"
        );
    }

    #[test]
    fn migrations_are_numbered_in_order_from_one() {
        for (i, (version, _, sql)) in MIGRATIONS.iter().enumerate() {
            assert_eq!(*version, i as i64 + 1);
            assert!(!sql.trim().is_empty());
        }
        // Every file in migrations/ is built in, none forgotten.
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("migrations");
        let files = std::fs::read_dir(dir)
            .unwrap()
            .filter(|e| e.as_ref().unwrap().path().extension() == Some("sql".as_ref()))
            .count();
        assert_eq!(files, MIGRATIONS.len());
    }
}
