//! The fleet's tenant set in PostgreSQL: [`PgTenants`].
//!
//! Every node keeps a copy of the set in memory, so authenticating a
//! request never waits for the database; a change is written in a
//! transaction that also announces it on the `runbox_tenants` channel, and
//! every node reloads its copy when it hears of one (and every
//! [`RELOAD_EVERY`] in case a notification was missed while its listening
//! connection was down). The node that made a change has it at once; the
//! others within moments.

use std::sync::{Arc, RwLock};
use std::time::Duration;

use runbox_core::error::CoreError;
use runbox_core::fleet::unavailable;
use runbox_core::tenants::{
    exists, not_found, too_many, TenantEntry, TenantIndex, TenantStore, MAX_TENANTS,
};
use runbox_types::{CreateTenantRequest, UpdateTenantRequest};
use sqlx::postgres::{PgListener, PgPool};
use sqlx::Row;

/// The channel changes are announced on.
const CHANNEL: &str = "runbox_tenants";

/// How often a node reloads the set whatever it heard.
const RELOAD_EVERY: Duration = Duration::from_secs(5);

/// Why the tenant set could not be opened.
#[derive(Debug, thiserror::Error)]
pub enum Refused {
    /// A query failed.
    #[error("{0}")]
    Query(#[from] sqlx::Error),
    /// A tenant of this node is not the fleet's tenant of that name.
    #[error(
        "this node's tenant {0:?} is not the fleet's tenant of that name (another token, or the \
         token is another tenant's); runs are stamped by name, so rename or delete one of them \
         before this node joins"
    )]
    Conflict(String),
}

/// The fleet's tenants, shared by every node through the database.
pub struct PgTenants {
    pool: PgPool,
    target: String,
    /// This node: its own runs of a tenant are the ledger's to check.
    node: String,
    copy: RwLock<TenantIndex>,
}

impl PgTenants {
    /// Loads the set (after adding the entries of `local` the fleet does
    /// not have yet) and follows its changes. A local tenant whose name the
    /// fleet gives another token is refused: runs are stamped by name, so
    /// the fleet's tenant would get this node's runs.
    pub(crate) async fn open(
        pool: PgPool,
        target: String,
        node: String,
        local: &[Arc<TenantEntry>],
    ) -> Result<Arc<PgTenants>, Refused> {
        for entry in local {
            let added = sqlx::query(
                "INSERT INTO runbox_tenants (name, token_sha256, entry) VALUES ($1, $2, $3) \
                 ON CONFLICT DO NOTHING",
            )
            .bind(&entry.name)
            .bind(&entry.token_sha256)
            .bind(sqlx::types::Json(&**entry))
            .execute(&pool)
            .await?;
            if added.rows_affected() == 1 {
                tracing::info!(tenant = %entry.name, "this node's tenant joined the fleet's set");
                continue;
            }
            let fleet: Option<String> =
                sqlx::query_scalar("SELECT token_sha256 FROM runbox_tenants WHERE name = $1")
                    .bind(&entry.name)
                    .fetch_optional(&pool)
                    .await?;
            if fleet.as_deref() != Some(entry.token_sha256.as_str()) {
                return Err(Refused::Conflict(entry.name.clone()));
            }
        }
        let tenants = Arc::new(PgTenants {
            pool,
            target,
            node,
            copy: RwLock::new(TenantIndex::default()),
        });
        tenants.reload().await?;
        tenants.follow();
        Ok(tenants)
    }

    /// Reads the whole set into the node's copy.
    async fn reload(&self) -> Result<(), sqlx::Error> {
        let rows = sqlx::query("SELECT entry FROM runbox_tenants")
            .fetch_all(&self.pool)
            .await?;
        let mut entries = Vec::with_capacity(rows.len());
        for row in rows {
            let sqlx::types::Json(entry): sqlx::types::Json<TenantEntry> = row.try_get("entry")?;
            entries.push(entry);
        }
        *self.copy.write().unwrap_or_else(|p| p.into_inner()) = TenantIndex::of(entries);
        Ok(())
    }

    /// Reloads the copy on every announced change, and every
    /// [`RELOAD_EVERY`]; ends when the set is dropped.
    fn follow(self: &Arc<Self>) {
        let weak = Arc::downgrade(self);
        let pool = self.pool.clone();
        tokio::spawn(async move {
            let mut down = false;
            loop {
                let mut listener = match PgListener::connect_with(&pool).await {
                    Ok(listener) => listener,
                    Err(e) => {
                        if !down {
                            tracing::warn!(error = %e, "cannot listen for tenant changes; retrying");
                            down = true;
                        }
                        tokio::time::sleep(Duration::from_secs(1)).await;
                        if weak.strong_count() == 0 {
                            return;
                        }
                        continue;
                    }
                };
                if let Err(e) = listener.listen(CHANNEL).await {
                    tracing::warn!(error = %e, "cannot listen for tenant changes; retrying");
                    tokio::time::sleep(Duration::from_secs(1)).await;
                    continue;
                }
                down = false;
                loop {
                    // Reloaded first, so what changed before the listening
                    // began is in the copy too.
                    let Some(tenants) = weak.upgrade() else {
                        return;
                    };
                    if let Err(e) = tenants.reload().await {
                        tracing::warn!(database = %tenants.target, error = %e, "could not reload the tenant set; the copy in memory serves meanwhile");
                    }
                    drop(tenants);
                    let heard = tokio::select! {
                        heard = listener.recv() => heard.map(|_| ()),
                        () = tokio::time::sleep(RELOAD_EVERY) => Ok(()),
                    };
                    if heard.is_err() {
                        // The connection went; listen again.
                        break;
                    }
                }
            }
        });
    }

    /// Runs a change on the database from the synchronous [`TenantStore`]
    /// interface: the calling worker thread waits for it (tenant changes
    /// are rare, and the operator's; requests are authenticated from the
    /// copy, never from here).
    fn wait<T>(
        &self,
        change: impl std::future::Future<Output = Result<T, CoreError>>,
    ) -> Result<T, CoreError> {
        let handle = tokio::runtime::Handle::try_current()
            .map_err(|_| CoreError::Store("a tenant change outside the daemon's runtime".into()))?;
        tokio::task::block_in_place(|| handle.block_on(change))
    }

    fn copy(&self) -> std::sync::RwLockReadGuard<'_, TenantIndex> {
        self.copy.read().unwrap_or_else(|p| p.into_inner())
    }

    fn keep(&self, entry: &Arc<TenantEntry>) {
        self.copy
            .write()
            .unwrap_or_else(|p| p.into_inner())
            .insert(entry.clone());
    }

    /// Replaces tenant `name`'s entry with what `change` makes of it, in
    /// one transaction with the announcement.
    async fn replace<T>(
        &self,
        name: &str,
        change: impl FnOnce(&TenantEntry) -> Result<(TenantEntry, T), CoreError>,
    ) -> Result<(Arc<TenantEntry>, T), CoreError> {
        let mut tx = self.pool.begin().await.map_err(unavailable)?;
        let row = sqlx::query("SELECT entry FROM runbox_tenants WHERE name = $1 FOR UPDATE")
            .bind(name)
            .fetch_optional(&mut *tx)
            .await
            .map_err(unavailable)?
            .ok_or_else(|| not_found(name))?;
        let sqlx::types::Json(old): sqlx::types::Json<TenantEntry> =
            row.try_get("entry").map_err(unavailable)?;
        let (entry, extra) = change(&old)?;
        sqlx::query(
            "UPDATE runbox_tenants SET token_sha256 = $2, entry = $3, updated_at = now() \
             WHERE name = $1",
        )
        .bind(name)
        .bind(&entry.token_sha256)
        .bind(sqlx::types::Json(&entry))
        .execute(&mut *tx)
        .await
        .map_err(unavailable)?;
        announce(&mut tx, name).await?;
        tx.commit().await.map_err(unavailable)?;
        let entry = Arc::new(entry);
        self.keep(&entry);
        Ok((entry, extra))
    }
}

/// Announces a change of tenant `name` when `tx` commits.
async fn announce(
    tx: &mut sqlx::Transaction<'_, sqlx::Postgres>,
    name: &str,
) -> Result<(), CoreError> {
    sqlx::query("SELECT pg_notify($1, $2)")
        .bind(CHANNEL)
        .bind(name)
        .execute(&mut **tx)
        .await
        .map(drop)
        .map_err(unavailable)
}

impl TenantStore for PgTenants {
    fn authenticate(&self, token: &str) -> Option<Arc<TenantEntry>> {
        self.copy().authenticate(token)
    }

    fn get(&self, name: &str) -> Option<Arc<TenantEntry>> {
        self.copy().by_name.get(name).cloned()
    }

    fn list(&self) -> Vec<Arc<TenantEntry>> {
        self.copy().by_name.values().cloned().collect()
    }

    fn create(&self, req: CreateTenantRequest) -> Result<(Arc<TenantEntry>, String), CoreError> {
        let (entry, token) = TenantEntry::make(req)?;
        self.wait(async {
            let mut tx = self.pool.begin().await.map_err(unavailable)?;
            // Serialises creates, so the count below is the set's.
            sqlx::query("LOCK TABLE runbox_tenants IN SHARE ROW EXCLUSIVE MODE")
                .execute(&mut *tx)
                .await
                .map_err(unavailable)?;
            let count: i64 = sqlx::query_scalar("SELECT count(*) FROM runbox_tenants")
                .fetch_one(&mut *tx)
                .await
                .map_err(unavailable)?;
            if count >= MAX_TENANTS as i64 {
                return Err(too_many());
            }
            let added = sqlx::query(
                "INSERT INTO runbox_tenants (name, token_sha256, entry) VALUES ($1, $2, $3) \
                 ON CONFLICT DO NOTHING",
            )
            .bind(&entry.name)
            .bind(&entry.token_sha256)
            .bind(sqlx::types::Json(&entry))
            .execute(&mut *tx)
            .await
            .map_err(unavailable)?;
            if added.rows_affected() == 0 {
                return Err(exists(&entry.name));
            }
            announce(&mut tx, &entry.name).await?;
            tx.commit().await.map_err(unavailable)?;
            Ok(())
        })?;
        let entry = Arc::new(entry);
        self.keep(&entry);
        Ok((entry, token))
    }

    fn update(&self, name: &str, req: UpdateTenantRequest) -> Result<Arc<TenantEntry>, CoreError> {
        self.wait(self.replace(name, |old| Ok((old.updated(req)?, ()))))
            .map(|(entry, ())| entry)
    }

    fn rotate(&self, name: &str) -> Result<(Arc<TenantEntry>, String), CoreError> {
        self.wait(self.replace(name, |old| old.rotated()))
    }

    fn delete(&self, name: &str) -> Result<(), CoreError> {
        self.wait(async {
            let mut tx = self.pool.begin().await.map_err(unavailable)?;
            // The row's lock keeps every node's creates of the tenant out
            // while its runs elsewhere are counted.
            sqlx::query("SELECT 1 FROM runbox_tenants WHERE name = $1 FOR UPDATE")
                .bind(name)
                .execute(&mut *tx)
                .await
                .map_err(unavailable)?;
            let elsewhere: Option<(String, i64)> = sqlx::query_as(
                "SELECT node, sum(n)::bigint FROM ( \
                   SELECT node, runs::bigint AS n FROM runbox_tenant_runs \
                   WHERE tenant = $1 AND node <> $2 AND runs > 0 \
                   UNION ALL \
                   SELECT node, count(*) FROM runbox_runs \
                   WHERE tenant = $1 AND node <> $2 AND status <> 'gone' GROUP BY node \
                 ) held GROUP BY node ORDER BY node LIMIT 1",
            )
            .bind(name)
            .bind(&self.node)
            .fetch_optional(&mut *tx)
            .await
            .map_err(unavailable)?;
            if let Some((node, _)) = elsewhere {
                return Err(CoreError::Conflict {
                    code: runbox_types::ErrorCode::TenantHasRuns,
                    message: format!(
                        "tenant {name:?} still has runs on node {node}; delete them first \
                         (rotating its token shuts it out at once)"
                    ),
                });
            }
            sqlx::query("DELETE FROM runbox_tenant_runs WHERE tenant = $1")
                .bind(name)
                .execute(&mut *tx)
                .await
                .map_err(unavailable)?;
            let gone = sqlx::query("DELETE FROM runbox_tenants WHERE name = $1")
                .bind(name)
                .execute(&mut *tx)
                .await
                .map_err(unavailable)?;
            if gone.rows_affected() == 0 {
                return Err(not_found(name));
            }
            announce(&mut tx, name).await?;
            tx.commit().await.map_err(unavailable)
        })?;
        let _ = self
            .copy
            .write()
            .unwrap_or_else(|p| p.into_inner())
            .remove(name);
        Ok(())
    }
}
