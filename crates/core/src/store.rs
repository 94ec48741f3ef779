//! Persistent run records, so runs survive a daemon restart or `kill -9`.
//!
//! One embedded redb database, `<state-dir>/runbox.db`, with one table from
//! run id to the record as JSON. JSON keeps the format readable with standard
//! tools and lets fields be added without a migration. Every write commits
//! durably before the call returns.

use std::path::{Path, PathBuf};
use std::sync::Arc;

pub use redb::Durability;
use redb::{Database, ReadableDatabase, ReadableTable, TableDefinition};
use runbox_types::{Env, Limits, NetworkTier, Run, RunStatus};
use serde::{Deserialize, Serialize};
use time::OffsetDateTime;
use ulid::Ulid;

use crate::error::CoreError;

const RUNS: TableDefinition<&str, &[u8]> = TableDefinition::new("runs");

/// Everything runbox remembers about a run.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct RunRecord {
    /// The run's id.
    pub id: Ulid,
    /// Image name.
    pub image: String,
    /// Network tier.
    pub network: NetworkTier,
    /// Limits in force.
    pub limits: Limits,
    /// The run's environment (values are secrets: never logged).
    pub env: Env,
    /// Creation time.
    #[serde(with = "time::serde::rfc3339")]
    pub created_at: OffsetDateTime,
    /// Expiry time.
    #[serde(with = "time::serde::rfc3339")]
    pub expires_at: OffsetDateTime,
    /// Lifecycle status.
    pub status: RunStatus,
    /// The runtime isolating it (empty until created).
    pub runtime: String,
    /// Host path of the agent socket (empty until created).
    pub agent_socket: PathBuf,
    /// The honoured parts of the image's config, fixed at creation.
    #[serde(default)]
    pub image_config: crate::images::ImageConfig,
    /// The image's layer digests when the run was made (base first): what
    /// its root mounts, kept from garbage collection while the run lives,
    /// even if the image is replaced by a newer pull. Empty in records from
    /// before this was kept.
    #[serde(default)]
    pub layers: Vec<String>,
    /// The writable lease and the last generation issued.
    #[serde(default)]
    pub lease: crate::lease::LeaseBook,
    /// The run's own allowlist entries and secret names.
    #[serde(default)]
    pub egress: crate::egress::RunEgressRequest,
    /// The `Idempotency-Key` it was created with, and a digest of the
    /// request, so a retry of the same create finds this run.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub idempotency: Option<Idempotency>,
    /// Why the run failed, once it has (status `Failed`); for a run whose
    /// teardown keeps failing, the last teardown error.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub failure: Option<String>,
    /// The run's warm volume: its repository, path, and the template
    /// generation it mounts (kept from eviction while the run lives).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub warm: Option<crate::warm::WarmVolume>,
    /// The size tier it was created with, if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub size: Option<runbox_types::SizeTier>,
    /// Its labels.
    #[serde(default, skip_serializing_if = "std::collections::BTreeMap::is_empty")]
    pub labels: std::collections::BTreeMap<String, String>,
    /// Its ports are served by host without a token (`publicPorts`).
    #[serde(default)]
    pub public_ports: bool,
    /// A call that reaches it while paused resumes it (`autoResume`).
    #[serde(default = "resume_by_default")]
    pub auto_resume: bool,
    /// What happens at its TTL (`onExpire`).
    #[serde(default)]
    pub on_expire: runbox_types::OnExpire,
    /// The TTL it was created with, in seconds: what a resume after an
    /// expiry gives it again. 0 for records from before it was kept.
    #[serde(default)]
    pub ttl_sec: u64,
    /// Paused at its TTL (`onExpire: pause`): `expires_at` is now the end
    /// of its retention, and a resume gives it a fresh TTL.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub expired: bool,
    /// The warm pool it was made for, and whether a create has claimed it;
    /// None for runs made by a create.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pool: Option<crate::pools::Membership>,
    /// When it pauses or hibernates for want of use (the server's defaults
    /// filled in at create; zero is off).
    #[serde(default)]
    pub idle: runbox_types::IdlePolicy,
    /// Its history settings (None: it keeps no history).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub history: Option<runbox_types::HistorySettings>,
    /// How many times the restart policy booted it again.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub restarts: u32,
    /// When the restart policy last booted it again.
    #[serde(
        default,
        with = "time::serde::rfc3339::option",
        skip_serializing_if = "Option::is_none"
    )]
    pub restarted_at: Option<OffsetDateTime>,
    /// When its disk went to the checkpoint store (status `archived`).
    #[serde(
        default,
        with = "time::serde::rfc3339::option",
        skip_serializing_if = "Option::is_none"
    )]
    pub archived_at: Option<OffsetDateTime>,
    /// Why its last archive failed (it stays hibernated meanwhile).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub archive_error: Option<String>,
    /// The tenant that made it; None: the operator.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tenant: Option<String>,
    /// Its commands may gain privileges through setuid programs
    /// (`allowPrivilegeEscalation`); false: each runs with no_new_privs.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub allow_privilege_escalation: bool,
    /// The named volumes it mounts: its hold on them, kept as long as the
    /// run exists (hibernated and archived too).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub volumes: Vec<crate::volumes::RunVolumeRecord>,
    /// Its current sandbox trusts the node's interception CA (it was made
    /// or booted on the `allowlist` tier), so secrets may be given to it
    /// while it runs.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub proxy_ca: bool,
    /// It came to this node by a move and has not been restored here yet:
    /// its restore keeps its TTL (a wake of an archived run gives a fresh
    /// one).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub moved: bool,
    /// What becomes of it when its node of a fleet is declared gone.
    #[serde(default)]
    pub on_node_loss: runbox_types::OnNodeLoss,
    /// It came back on another node after its node was lost: from what.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub recovered: Option<runbox_types::Recovered>,
    /// Its next restore reads this checkpoint (one of its own, taken
    /// before its node was lost) instead of its archive.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub restore_from: Option<Ulid>,
}

fn is_zero(n: &u32) -> bool {
    *n == 0
}

/// Records written before `autoResume` existed resume on traffic.
fn resume_by_default() -> bool {
    true
}

impl RunRecord {
    /// A pool member no create has claimed yet: hidden from the API and
    /// not counted against `--max-runs`.
    pub fn is_idle_member(&self) -> bool {
        self.pool.as_ref().is_some_and(|m| !m.claimed)
    }
}

/// A create's idempotency key and what it asked for.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Idempotency {
    /// The key the client sent.
    pub key: String,
    /// sha256 of the request body as the server parsed it (the body holds
    /// the run's environment, so only a digest is kept).
    pub request: String,
    /// The tenant that sent it: keys are the tenant's own, so another
    /// tenant's create with the same key never finds this run.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tenant: Option<String>,
}

impl RunRecord {
    /// The API view of the record.
    pub fn to_run(&self, server: &str) -> Run {
        Run {
            id: self.id,
            server: server.to_owned(),
            server_origin: None,
            image: self.image.clone(),
            network: self.network,
            limits: self.limits,
            runtime: self.runtime.clone(),
            created_at: self.created_at,
            expires_at: self.expires_at,
            status: self.status,
            lease: self.lease.active(OffsetDateTime::now_utc()).cloned(),
            lease_generation: (self.lease.generation > 0).then_some(self.lease.generation),
            egress_allow: self.egress.allow.clone(),
            egress_defaults: self.egress.no_defaults.then_some(false),
            egress_socks5: self.egress.socks5.then_some(true),
            egress_upstream: self.egress.upstream.as_ref().map(|u| u.display.clone()),
            secrets: self.egress.secret_names(),
            egress: None,
            failure: (self.status == RunStatus::Failed)
                .then(|| self.failure.clone())
                .flatten(),
            disk_used_bytes: None,
            warm: self.warm.as_ref().map(|w| w.to_api()),
            size: self.size,
            labels: self.labels.clone(),
            pooled: self.pool.as_ref().is_some_and(|m| m.claimed),
            public_ports: self.public_ports,
            auto_resume: self.auto_resume,
            on_expire: self.on_expire,
            on_node_loss: self.on_node_loss,
            recovered: self.recovered.clone(),
            idle: self.idle,
            history: self.history,
            restarts: self.restarts,
            allow_privilege_escalation: self.allow_privilege_escalation,
            volumes: self.volumes.iter().map(|v| v.to_api()).collect(),
            restarted_at: self.restarted_at,
            archived_at: self.archived_at,
            archive_error: self.archive_error.clone(),
            tenant: self.tenant.clone(),
            token: None,
        }
    }
}

/// The run record store. Cheap to clone.
#[derive(Clone)]
pub struct Store {
    db: Arc<Database>,
}

fn store_err(e: impl std::fmt::Display) -> CoreError {
    CoreError::Store(e.to_string())
}

impl Store {
    /// Opens (or creates) the database at `path`.
    pub fn open(path: &Path) -> Result<Store, CoreError> {
        let db = Database::create(path).map_err(store_err)?;
        // Make sure the table exists so that readers never see "no table".
        let tx = db.begin_write().map_err(store_err)?;
        tx.open_table(RUNS).map_err(store_err)?;
        tx.commit().map_err(store_err)?;
        Ok(Store { db: Arc::new(db) })
    }

    /// The database, for the other record kinds kept beside runs.
    pub(crate) fn db(&self) -> &Database {
        &self.db
    }

    /// Inserts or replaces a record, durably.
    pub fn put(&self, record: &RunRecord) -> Result<(), CoreError> {
        self.put_with(record, Durability::Immediate)
    }

    /// Inserts or replaces a record; with [`Durability::None`] the commit
    /// is visible at once but reaches the disk only with the next durable
    /// commit (a crash before that forgets it).
    pub fn put_with(&self, record: &RunRecord, durability: Durability) -> Result<(), CoreError> {
        let key = record.id.to_string();
        let value = serde_json::to_vec(record).map_err(store_err)?;
        let mut tx = self.db.begin_write().map_err(store_err)?;
        tx.set_durability(durability).map_err(store_err)?;
        {
            let mut table = tx.open_table(RUNS).map_err(store_err)?;
            table
                .insert(key.as_str(), value.as_slice())
                .map_err(store_err)?;
        }
        tx.commit().map_err(store_err)
    }

    /// Removes a record; no error if it is absent.
    pub fn delete(&self, id: Ulid) -> Result<(), CoreError> {
        let key = id.to_string();
        let tx = self.db.begin_write().map_err(store_err)?;
        {
            let mut table = tx.open_table(RUNS).map_err(store_err)?;
            table.remove(key.as_str()).map_err(store_err)?;
        }
        tx.commit().map_err(store_err)
    }

    /// [`Store::put`] on a blocking thread, so an fsync never holds up an
    /// async worker.
    ///
    /// Cancellation: the commit runs to the end even if this future is
    /// dropped; the caller only stops waiting for it.
    pub async fn put_async(&self, record: RunRecord) -> Result<(), CoreError> {
        self.put_async_with(record, Durability::Immediate).await
    }

    /// Makes every earlier commit durable (an empty durable commit), in
    /// the background; errors are logged.
    pub fn flush_in_background(&self) {
        let store = self.clone();
        tokio::task::spawn_blocking(move || {
            let flushed = (|| -> Result<(), CoreError> {
                let mut tx = store.db.begin_write().map_err(store_err)?;
                tx.set_durability(Durability::Immediate)
                    .map_err(store_err)?;
                tx.commit().map_err(store_err)
            })();
            if let Err(e) = flushed {
                tracing::warn!(error = %e, "could not flush the run store");
            }
        });
    }

    /// [`Store::put_with`] on a blocking thread; cancellation as
    /// [`Store::put_async`].
    pub async fn put_async_with(
        &self,
        record: RunRecord,
        durability: Durability,
    ) -> Result<(), CoreError> {
        let store = self.clone();
        tokio::task::spawn_blocking(move || store.put_with(&record, durability))
            .await
            .map_err(|e| CoreError::Store(format!("store task failed: {e}")))?
    }

    /// [`Store::delete`] on a blocking thread; cancellation as
    /// [`Store::put_async`].
    pub async fn delete_async(&self, id: Ulid) -> Result<(), CoreError> {
        let store = self.clone();
        tokio::task::spawn_blocking(move || store.delete(id))
            .await
            .map_err(|e| CoreError::Store(format!("store task failed: {e}")))?
    }

    /// Every record, ordered by id. A record that no longer parses is
    /// skipped with a warning rather than taking the whole daemon down.
    pub fn list(&self) -> Result<Vec<RunRecord>, CoreError> {
        let tx = self.db.begin_read().map_err(store_err)?;
        let table = tx.open_table(RUNS).map_err(store_err)?;
        let mut out = Vec::new();
        for entry in table.iter().map_err(store_err)? {
            let (key, value) = entry.map_err(store_err)?;
            match serde_json::from_slice::<RunRecord>(value.value()) {
                Ok(record) => out.push(record),
                Err(e) => {
                    tracing::warn!(run = key.value(), error = %e, "skipping unreadable run record")
                }
            }
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    pub(super) fn sample() -> RunRecord {
        record()
    }

    fn record() -> RunRecord {
        let now = OffsetDateTime::now_utc();
        RunRecord {
            id: Ulid::new(),
            image: "base".into(),
            network: NetworkTier::None,
            limits: Limits {
                cpus: 1.0,
                memory_mb: 1024,
                pids: 256,
                disk_mb: Some(64),
            },
            env: Env::default(),
            created_at: now,
            expires_at: now,
            status: RunStatus::Creating,
            runtime: String::new(),
            agent_socket: PathBuf::new(),
            image_config: Default::default(),
            layers: vec!["sha256:00".into()],
            lease: Default::default(),
            egress: Default::default(),
            idempotency: None,
            failure: None,
            warm: None,
            size: None,
            labels: Default::default(),
            public_ports: false,
            auto_resume: true,
            on_expire: Default::default(),
            ttl_sec: 0,
            expired: false,
            pool: None,
            idle: Default::default(),
            history: None,
            restarts: 0,
            restarted_at: None,
            archived_at: None,
            archive_error: None,
            tenant: None,
            allow_privilege_escalation: false,
            volumes: Vec::new(),
            proxy_ca: false,
            moved: false,
            on_node_loss: Default::default(),
            recovered: None,
            restore_from: None,
        }
    }

    #[test]
    fn put_list_delete_survive_reopen() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("db");
        let (a, b) = (record(), record());
        {
            let store = Store::open(&path).unwrap();
            store.put(&a).unwrap();
            store.put(&b).unwrap();
            store.delete(a.id).unwrap();
            store.delete(Ulid::new()).unwrap();
        }
        let store = Store::open(&path).unwrap();
        let ids: Vec<Ulid> = store.list().unwrap().iter().map(|r| r.id).collect();
        assert_eq!(ids, vec![b.id]);
    }
}

#[cfg(test)]
mod flush_tests {
    use super::*;

    #[tokio::test]
    async fn a_flush_makes_earlier_commits_durable() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("db");
        let store = Store::open(&path).unwrap();
        let mut record = tests::sample();
        store.put(&record).unwrap();
        record.image = "after".into();
        store.put_with(&record, Durability::None).unwrap();
        store.flush_in_background();
        // The flush runs on a blocking thread; the copy is what a crash
        // would leave once it is done.
        let copy = dir.path().join("copy");
        let mut seen = Vec::new();
        for _ in 0..100 {
            tokio::time::sleep(std::time::Duration::from_millis(20)).await;
            std::fs::copy(&path, &copy).unwrap();
            seen = Store::open(&copy)
                .unwrap()
                .list()
                .unwrap()
                .into_iter()
                .map(|r| r.image)
                .collect();
            if seen == ["after"] {
                return;
            }
        }
        panic!("the flushed commit is not on disk: {seen:?}");
    }
}
