//! The fleet's part of the ledger in PostgreSQL ([`Book`]): each node's
//! count of each tenant's runs, so a tenant's `maxRuns` holds across the
//! fleet, and the idempotency keys of every node's creates.
//!
//! A create that raises a tenant's count is admitted in one transaction
//! that locks the tenant's row, sums the other live nodes' counts and
//! writes this node's new one, so two nodes never both take the last run
//! of a quota. Everything that only lowers a count (a run ends or sleeps)
//! and every freed key is written behind, latest first, kept while the
//! database is away: a count that is late to fall refuses a create too
//! many, never admits one too many.

use std::collections::{HashMap, HashSet};
use std::time::Duration;

use async_trait::async_trait;
use runbox_core::fleet::unavailable;
use runbox_core::ledger::Shared;
use runbox_core::store::Idempotency;
use runbox_core::CoreError;
use runbox_types::ErrorCode;
use sqlx::postgres::PgPool;
use sqlx::Row;
use tokio::sync::mpsc;
use ulid::Ulid;

/// How long a key whose run the catalog does not list stays taken: the
/// run's node writes the catalog a moment after the key.
pub(crate) const KEY_GRACE_SECS: f64 = 30.0;

/// What the writer is told.
enum Change {
    /// This node's counts as of a sequence number.
    Counts(HashMap<String, usize>, u64),
    /// A run no longer answers for its key.
    Free(Ulid),
}

/// This node's side of the fleet's ledger.
pub(crate) struct Book {
    pool: PgPool,
    node: String,
    /// Nodes unseen for this long count nothing.
    gone_after: Duration,
    changes: mpsc::UnboundedSender<Change>,
}

impl Book {
    /// Starts the writer of node `node`.
    pub(crate) fn start(pool: PgPool, node: String, target: String, gone_after: Duration) -> Book {
        let (changes, rx) = mpsc::unbounded_channel();
        tokio::spawn(write_behind(pool.clone(), node.clone(), target, rx));
        Book {
            pool,
            node,
            gone_after,
            changes,
        }
    }
}

/// A node's count of a tenant's runs, written unless a newer one is there.
async fn set_count(
    tx: &mut sqlx::Transaction<'_, sqlx::Postgres>,
    tenant: &str,
    node: &str,
    runs: usize,
    seq: u64,
) -> Result<(), sqlx::Error> {
    sqlx::query(
        "INSERT INTO runbox_tenant_runs (tenant, node, runs, seq) VALUES ($1, $2, $3, $4) \
         ON CONFLICT (tenant, node) DO UPDATE SET runs = EXCLUDED.runs, seq = EXCLUDED.seq \
         WHERE runbox_tenant_runs.seq < EXCLUDED.seq",
    )
    .bind(tenant)
    .bind(node)
    .bind(i32::try_from(runs).unwrap_or(i32::MAX))
    .bind(i64::try_from(seq).unwrap_or(i64::MAX))
    .execute(&mut **tx)
    .await
    .map(drop)
}

#[async_trait]
impl Shared for Book {
    async fn admit(
        &self,
        tenant: &str,
        max_runs: u32,
        count: usize,
        seq: u64,
    ) -> Result<(), CoreError> {
        let mut tx = self.pool.begin().await.map_err(unavailable)?;
        // The tenant's row is the lock every admission of its runs (and its
        // removal) takes.
        let exists = sqlx::query("SELECT 1 FROM runbox_tenants WHERE name = $1 FOR UPDATE")
            .bind(tenant)
            .fetch_optional(&mut *tx)
            .await
            .map_err(unavailable)?;
        if exists.is_none() {
            return Err(CoreError::invalid(
                ErrorCode::Unauthorized,
                format!("tenant {tenant:?} was deleted"),
            ));
        }
        if max_runs > 0 {
            let others: i64 = sqlx::query_scalar(
                "SELECT coalesce(sum(t.runs), 0)::bigint FROM runbox_tenant_runs t \
                 JOIN runbox_nodes n ON n.id = t.node \
                 WHERE t.tenant = $1 AND t.node <> $2 AND n.left_at IS NULL \
                 AND now() - n.heartbeat < make_interval(secs => $3)",
            )
            .bind(tenant)
            .bind(&self.node)
            .bind(self.gone_after.as_secs_f64())
            .fetch_one(&mut *tx)
            .await
            .map_err(unavailable)?;
            if usize::try_from(others).unwrap_or(0) + count > max_runs as usize {
                return Err(CoreError::TenantQuota {
                    tenant: tenant.to_owned(),
                    max: max_runs,
                });
            }
        }
        set_count(&mut tx, tenant, &self.node, count, seq)
            .await
            .map_err(unavailable)?;
        tx.commit().await.map_err(unavailable)
    }

    fn counted(&self, counts: HashMap<String, usize>, seq: u64) {
        let _ = self.changes.send(Change::Counts(counts, seq));
    }

    async fn take_key(&self, key: &Idempotency, run: Ulid) -> Result<Option<Ulid>, CoreError> {
        let tenant = key.tenant.as_deref().unwrap_or("");
        // Taken unless another run holds it; a key whose run the catalog
        // no longer lists (and that is not a moment old) is taken over.
        let taken = sqlx::query(
            "INSERT INTO runbox_keys (tenant, key, request, run, node) VALUES ($1, $2, $3, $4, $5) \
             ON CONFLICT (tenant, key) DO UPDATE SET request = EXCLUDED.request, \
             run = EXCLUDED.run, node = EXCLUDED.node, taken_at = now() \
             WHERE runbox_keys.taken_at < now() - make_interval(secs => $6) \
             AND NOT EXISTS (SELECT 1 FROM runbox_runs r \
                             WHERE r.id = runbox_keys.run AND r.status <> 'gone') \
             RETURNING run",
        )
        .bind(tenant)
        .bind(&key.key)
        .bind(&key.request)
        .bind(run.to_string())
        .bind(&self.node)
        .bind(KEY_GRACE_SECS)
        .fetch_optional(&self.pool)
        .await
        .map_err(unavailable)?;
        if taken.is_some() {
            return Ok(None);
        }
        let row =
            sqlx::query("SELECT request, run FROM runbox_keys WHERE tenant = $1 AND key = $2")
                .bind(tenant)
                .bind(&key.key)
                .fetch_optional(&self.pool)
                .await
                .map_err(unavailable)?;
        let Some(row) = row else {
            // Freed between the two statements: the create goes on, and a
            // repeat of it finds this run on its node.
            return Ok(None);
        };
        let request: String = row.get("request");
        let earlier: String = row.get("run");
        let Ok(earlier) = earlier.parse::<Ulid>() else {
            return Ok(None);
        };
        if request != key.request {
            return Err(CoreError::Conflict {
                code: ErrorCode::IdempotencyKeyReused,
                message: format!(
                    "this Idempotency-Key was used for a different create (run {earlier}); \
                     use a new key for a new request"
                ),
            });
        }
        Ok(Some(earlier))
    }

    fn free_key(&self, run: Ulid) {
        let _ = self.changes.send(Change::Free(run));
    }
}

/// The writer: the latest counts and every freed key, written in order;
/// on a failure it waits and tries again with what it has. (Keys whose
/// runs are gone from the catalog, a node that died holding them, are the
/// catalog sweep's.)
async fn write_behind(
    pool: PgPool,
    node: String,
    target: String,
    mut rx: mpsc::UnboundedReceiver<Change>,
) {
    let mut counts: Option<(HashMap<String, usize>, u64)> = None;
    let mut freed: HashSet<Ulid> = HashSet::new();
    let mut down = false;
    loop {
        if counts.is_none() && freed.is_empty() {
            match rx.recv().await {
                Some(change) => take(change, &mut counts, &mut freed),
                None => return,
            }
        }
        while let Ok(change) = rx.try_recv() {
            take(change, &mut counts, &mut freed);
        }
        match write(&pool, &node, &mut counts, &mut freed).await {
            Ok(()) if down => {
                down = false;
                tracing::info!(database = %target, "the fleet's ledger is written again");
            }
            Ok(()) => {}
            Err(e) => {
                if !down {
                    down = true;
                    tracing::warn!(database = %target, error = %e, "the fleet's ledger cannot be written; this node's counts wait");
                }
                tokio::time::sleep(Duration::from_secs(1)).await;
            }
        }
    }
}

fn take(
    change: Change,
    counts: &mut Option<(HashMap<String, usize>, u64)>,
    freed: &mut HashSet<Ulid>,
) {
    match change {
        Change::Counts(now, seq) => {
            if counts.as_ref().is_none_or(|(_, had)| *had < seq) {
                *counts = Some((now, seq));
            }
        }
        Change::Free(run) => {
            freed.insert(run);
        }
    }
}

/// Writes what waits; what was written leaves `counts` and `freed`.
async fn write(
    pool: &PgPool,
    node: &str,
    counts: &mut Option<(HashMap<String, usize>, u64)>,
    freed: &mut HashSet<Ulid>,
) -> Result<(), sqlx::Error> {
    if let Some((now, seq)) = counts.as_ref() {
        let mut tx = pool.begin().await?;
        let named: Vec<&str> = now.keys().map(String::as_str).collect();
        // Tenants the node no longer counts: none (the row keeps its
        // sequence number, so an older write cannot bring a count back).
        sqlx::query(
            "UPDATE runbox_tenant_runs SET runs = 0, seq = $2 \
             WHERE node = $1 AND seq < $2 AND NOT (tenant = ANY($3))",
        )
        .bind(node)
        .bind(i64::try_from(*seq).unwrap_or(i64::MAX))
        .bind(&named)
        .execute(&mut *tx)
        .await?;
        for (tenant, runs) in now {
            set_count(&mut tx, tenant, node, *runs, *seq).await?;
        }
        tx.commit().await?;
        *counts = None;
    }
    if !freed.is_empty() {
        let runs: Vec<String> = freed.iter().map(Ulid::to_string).collect();
        sqlx::query("DELETE FROM runbox_keys WHERE run = ANY($1)")
            .bind(&runs)
            .execute(pool)
            .await?;
        freed.clear();
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_the_newest_counts_are_kept_and_every_freed_key() {
        let mut counts = None;
        let mut freed = HashSet::new();
        take(
            Change::Counts(HashMap::from([("a".into(), 2)]), 5),
            &mut counts,
            &mut freed,
        );
        take(
            Change::Counts(HashMap::from([("a".into(), 1)]), 4),
            &mut counts,
            &mut freed,
        );
        assert_eq!(counts.as_ref().map(|c| c.1), Some(5));
        let (one, two) = (Ulid::new(), Ulid::new());
        take(Change::Free(one), &mut counts, &mut freed);
        take(Change::Free(two), &mut counts, &mut freed);
        assert_eq!(freed.len(), 2);
    }
}
