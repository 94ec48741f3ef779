//! Work one node of the fleet does at a time, under a lease in the
//! database (`runbox_singletons`): the sweep of a shared checkpoint
//! bucket, and the catalog's clean-up.
//!
//! A node takes a lease when it is free or past its time, and keeps it by
//! taking it again before it runs out; every change of holder raises the
//! lease's fencing number. Times are the database's.

use std::time::Duration;

use runbox_core::fleet::unavailable;
use runbox_core::CoreError;
use sqlx::postgres::PgPool;

/// How often the catalog's clean-up runs (on one node).
const CATALOG_SWEEP_EVERY: Duration = Duration::from_secs(600);

/// How long a destroyed run's row stays in the catalog: long enough for a
/// node that was away to hear of the end of its runs.
const TOMBSTONE_SECS: f64 = 3600.0;

/// How long a change of a run's owner is remembered after its row is gone.
const MOVES_SECS: f64 = 30.0 * 86400.0;

use crate::book::KEY_GRACE_SECS;

/// Takes (or keeps) lease `work` for node `node` for `hold`: its fencing
/// number, or None while another node holds it.
pub(crate) async fn take(
    pool: &PgPool,
    node: &str,
    work: &str,
    hold: Duration,
) -> Result<Option<u64>, CoreError> {
    let fence: Option<i64> = sqlx::query_scalar(
        "INSERT INTO runbox_singletons (name, holder, fence, until) \
         VALUES ($1, $2, 1, now() + make_interval(secs => $3)) \
         ON CONFLICT (name) DO UPDATE SET \
           fence = CASE WHEN runbox_singletons.holder = EXCLUDED.holder \
                   THEN runbox_singletons.fence ELSE runbox_singletons.fence + 1 END, \
           holder = EXCLUDED.holder, until = EXCLUDED.until \
         WHERE runbox_singletons.holder = EXCLUDED.holder OR runbox_singletons.until < now() \
         RETURNING fence",
    )
    .bind(work)
    .bind(node)
    .bind(hold.as_secs_f64())
    .fetch_optional(pool)
    .await
    .map_err(unavailable)?;
    Ok(fence.and_then(|f| u64::try_from(f).ok()))
}

/// Every [`CATALOG_SWEEP_EVERY`], on the node that holds the lease:
/// destroyed runs' rows older than [`TOMBSTONE_SECS`] leave the catalog,
/// and idempotency keys whose runs it no longer lists are freed.
pub(crate) fn spawn_catalog_sweep(pool: PgPool, node: String) {
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(CATALOG_SWEEP_EVERY);
        loop {
            tick.tick().await;
            if pool.is_closed() {
                return;
            }
            let hold = CATALOG_SWEEP_EVERY + CATALOG_SWEEP_EVERY / 2;
            match take(&pool, &node, "catalog sweep", hold).await {
                Ok(Some(fence)) => match sweep_catalog(&pool).await {
                    Ok((rows, keys)) if rows + keys > 0 => {
                        tracing::info!(fence, rows, keys, "the run catalog was swept");
                    }
                    Ok(_) => {}
                    Err(e) => tracing::debug!(error = %e, "the catalog sweep waits"),
                },
                Ok(None) => {}
                Err(e) => tracing::debug!(error = %e, "the catalog sweep waits"),
            }
        }
    });
}

/// One sweep: how many rows and keys went.
async fn sweep_catalog(pool: &PgPool) -> Result<(u64, u64), sqlx::Error> {
    let rows = sqlx::query(
        "DELETE FROM runbox_runs WHERE status = 'gone' \
         AND updated_at < now() - make_interval(secs => $1)",
    )
    .bind(TOMBSTONE_SECS)
    .execute(pool)
    .await?
    .rows_affected();
    // A node away for longer than this finds its moved runs by their rows
    // or, once those are gone, not at all: it adopts nothing it no longer
    // has a record of anyway (see the catalog's fencing).
    sqlx::query("DELETE FROM runbox_moves WHERE at < now() - make_interval(secs => $1)")
        .bind(MOVES_SECS)
        .execute(pool)
        .await?;
    let keys = sqlx::query(
        "DELETE FROM runbox_keys k WHERE k.taken_at < now() - make_interval(secs => $1) \
         AND NOT EXISTS (SELECT 1 FROM runbox_runs r WHERE r.id = k.run AND r.status <> 'gone')",
    )
    .bind(KEY_GRACE_SECS)
    .execute(pool)
    .await?
    .rows_affected();
    Ok((rows, keys))
}
