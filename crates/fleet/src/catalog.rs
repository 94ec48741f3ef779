//! The fleet's run catalog: where every run is and how it stood when its
//! owner last published it, written behind by each node for its own runs.
//!
//! A run's owner reports every transition without waiting
//! ([`Catalog::record`]); a writer task keeps the latest report of each run
//! and writes them, each with a generation that only grows (so a late or
//! repeated write never replaces a newer one), and keeps them while the
//! database is away, writing them once it is back.

use std::collections::HashMap;
use std::sync::atomic::{AtomicI64, Ordering};
use std::time::Duration;

use runbox_core::fleet::{unavailable, Orphan, Published, Takeover};
use runbox_core::CoreError;
use runbox_types::Run;
use sqlx::postgres::PgPool;
use sqlx::Row;
use tokio::sync::mpsc;
use ulid::Ulid;

/// What the writer is told.
enum Change {
    /// Run `id` stands so now (None: it is gone).
    Run(Ulid, i64, Option<Box<Published>>),
    /// This node's runs are these and no others.
    Resync(i64, Vec<Published>),
}

/// This node's side of the catalog.
pub(crate) struct Catalog {
    changes: mpsc::UnboundedSender<Change>,
    /// The next generation: microseconds since the epoch at start, then one
    /// more per report, so a restarted node's reports are newer than its
    /// last incarnation's.
    generation: AtomicI64,
    pool: PgPool,
}

impl Catalog {
    /// Starts the writer for node `node`.
    pub(crate) fn start(pool: PgPool, node: String, target: String) -> Catalog {
        let (changes, rx) = mpsc::unbounded_channel();
        let start = time::OffsetDateTime::now_utc().unix_timestamp_nanos() / 1000;
        tokio::spawn(write_behind(pool.clone(), node, target, rx));
        Catalog {
            changes,
            generation: AtomicI64::new(i64::try_from(start).unwrap_or(i64::MAX / 2)),
            pool,
        }
    }

    fn next(&self) -> i64 {
        self.generation.fetch_add(1, Ordering::SeqCst)
    }

    /// Reports from here on are newer than generation `seen` (a row this
    /// node takes over was written by another node's counter).
    fn pass(&self, seen: i64) {
        self.generation
            .fetch_max(seen.saturating_add(1), Ordering::SeqCst);
    }

    /// Run `id` stands as `run` now (None: gone).
    pub(crate) fn record(&self, id: Ulid, run: Option<Published>) {
        let _ = self
            .changes
            .send(Change::Run(id, self.next(), run.map(Box::new)));
    }

    /// Writes `run` now, newer than every report made before.
    pub(crate) async fn record_now(&self, node: &str, run: &Published) -> Result<(), CoreError> {
        let generation = self.next();
        // One statement, so one round trip on the create's path.
        upsert(&self.pool, node, generation, run)
            .await
            .map_err(unavailable)
    }

    /// This node's runs are what `list` answers (called after the
    /// generation is taken).
    pub(crate) fn resync(&self, list: &dyn Fn() -> Vec<Published>) {
        let generation = self.next();
        let _ = self.changes.send(Change::Resync(generation, list()));
    }

    /// Run `id` as the catalog lists it, if it does.
    pub(crate) async fn run(&self, id: Ulid) -> Result<Option<Run>, CoreError> {
        let row = sqlx::query(
            "SELECT run, lease_generation FROM runbox_runs WHERE id = $1 AND status <> 'gone'",
        )
        .bind(id.to_string())
        .fetch_optional(&self.pool)
        .await
        .map_err(unavailable)?;
        row.as_ref().map(listed).transpose()
    }

    /// Every run the catalog lists, by id.
    pub(crate) async fn runs(&self) -> Result<Vec<Run>, CoreError> {
        let rows = sqlx::query(
            "SELECT run, lease_generation FROM runbox_runs WHERE status <> 'gone' ORDER BY id",
        )
        .fetch_all(&self.pool)
        .await
        .map_err(unavailable)?;
        rows.iter().map(listed).collect()
    }
}

impl Catalog {
    /// Run `id` is about to get its disk back on node `node` (a restore):
    /// the row says `restoring`, with a newer generation, while it is still
    /// this node's, so no other node takes it over meanwhile. The node
    /// that holds it now when it is another's (the run moved away while
    /// this node was not looking); None when it is this node's or the
    /// catalog does not list it.
    pub(crate) async fn hold(&self, node: &str, id: Ulid) -> Result<Option<String>, CoreError> {
        let generation = self.next();
        let held = sqlx::query(
            "UPDATE runbox_runs SET status = 'restoring', generation = $3, updated_at = now() \
             WHERE id = $1 AND node = $2 RETURNING 1",
        )
        .bind(id.to_string())
        .bind(node)
        .bind(generation)
        .fetch_optional(&self.pool)
        .await
        .map_err(unavailable)?;
        if held.is_some() {
            return Ok(None);
        }
        let owner: Option<String> =
            sqlx::query_scalar("SELECT node FROM runbox_runs WHERE id = $1")
                .bind(id.to_string())
                .fetch_optional(&self.pool)
                .await
                .map_err(unavailable)?;
        Ok(owner.filter(|owner| owner != node))
    }

    /// Takes run `id` for node `node` when the rules allow (see
    /// [`Takeover`]): its sealed record, or None when the run is not this
    /// node's to take. One transaction, the row locked: of two nodes taking
    /// it at once one gets it.
    pub(crate) async fn take(
        &self,
        node: &str,
        id: Ulid,
        how: Takeover,
        gone_after: Duration,
    ) -> Result<Option<String>, CoreError> {
        let mut tx = self.pool.begin().await.map_err(unavailable)?;
        let row = sqlx::query(
            "SELECT r.node, r.status, r.generation, r.record, \
             (n.left_at IS NOT NULL OR now() - n.heartbeat >= make_interval(secs => $3)) AS gone, \
             (n.checkpoint_store LIKE 's3://%' AND n.checkpoint_store = \
               (SELECT checkpoint_store FROM runbox_nodes WHERE id = $2)) AS shared \
             FROM runbox_runs r LEFT JOIN runbox_nodes n ON n.id = r.node \
             WHERE r.id = $1 FOR UPDATE OF r",
        )
        .bind(id.to_string())
        .bind(node)
        .bind(gone_after.as_secs_f64())
        .fetch_optional(&mut *tx)
        .await
        .map_err(unavailable)?;
        let Some(row) = row else {
            return Ok(None);
        };
        let owner: String = row.get("node");
        let status: String = row.get("status");
        let generation: i64 = row.get("generation");
        let record: Option<String> = row.get("record");
        let gone: bool = row
            .try_get::<Option<bool>, _>("gone")
            .ok()
            .flatten()
            .unwrap_or(true);
        let shared: bool = row
            .try_get::<Option<bool>, _>("shared")
            .ok()
            .flatten()
            .unwrap_or(false);
        let Some(record) = record else {
            return Ok(None);
        };
        self.pass(generation);
        if owner == node {
            // Handed to this node (a move leaves it archived): it makes the
            // run from its record. A row of this node's in any other state
            // is a run this node ended or never had: nothing to make.
            return Ok((status == "archived").then_some(record));
        }
        let asleep = status == "archived" || (status == "restoring" && gone);
        let allowed = match how {
            Takeover::Gone => gone,
            Takeover::Unreachable => true,
        };
        if !(asleep && shared && allowed) {
            return Ok(None);
        }
        let generation = self.next();
        sqlx::query(
            "UPDATE runbox_runs SET node = $2, generation = $3, status = 'archived', \
             run = jsonb_set(run, '{server}', to_jsonb($2::text)), updated_at = now() WHERE id = $1",
        )
        .bind(id.to_string())
        .bind(node)
        .bind(generation)
        .execute(&mut *tx)
        .await
        .map_err(unavailable)?;
        moved(&mut *tx, id, &owner, node, how.reason()).await?;
        tx.commit().await.map_err(unavailable)?;
        Ok(Some(record))
    }

    /// Hands archived run `id` of node `from` to node `to`, with its sealed
    /// `record`: false when the row is not `from`'s (any more).
    pub(crate) async fn hand_off(
        &self,
        from: &str,
        id: Ulid,
        to: &str,
        record: &str,
    ) -> Result<bool, CoreError> {
        let generation = self.next();
        let mut tx = self.pool.begin().await.map_err(unavailable)?;
        let handed = sqlx::query(
            "UPDATE runbox_runs SET node = $3, generation = $4, status = 'archived', record = $5, \
             run = jsonb_set(run, '{server}', to_jsonb($3::text)), updated_at = now() \
             WHERE id = $1 AND node = $2 RETURNING 1",
        )
        .bind(id.to_string())
        .bind(from)
        .bind(to)
        .bind(generation)
        .bind(record)
        .fetch_optional(&mut *tx)
        .await
        .map_err(unavailable)?;
        if handed.is_none() {
            return Ok(false);
        }
        moved(&mut *tx, id, from, to, "move").await?;
        tx.commit().await.map_err(unavailable)?;
        Ok(true)
    }

    /// Of `ids` (runs node `node` holds), those another node holds now:
    /// the row names another node, or (the row cleaned up) the last move
    /// of the run took it elsewhere.
    pub(crate) async fn superseded(
        &self,
        node: &str,
        ids: &[Ulid],
    ) -> Result<Vec<Ulid>, CoreError> {
        if ids.is_empty() {
            return Ok(Vec::new());
        }
        let ids: Vec<String> = ids.iter().map(Ulid::to_string).collect();
        // Another node's now only by a change of owner away from this
        // node (or a delete of it, lost, while this node was gone): a row
        // that never was this node's is not fenced here (see
        // `strangers`).
        let rows: Vec<String> = sqlx::query_scalar(
            "SELECT r.id FROM runbox_runs r WHERE r.id = ANY($1) AND r.node <> $2 \
             AND (r.node = '-' OR EXISTS (SELECT 1 FROM runbox_moves m \
                                          WHERE m.run = r.id AND m.from_node = $2)) \
             UNION \
             SELECT m.run FROM (SELECT DISTINCT ON (run) run, to_node FROM runbox_moves \
                                WHERE run = ANY($1) ORDER BY run, seq DESC) m \
             WHERE m.to_node <> $2 AND NOT EXISTS (SELECT 1 FROM runbox_runs r WHERE r.id = m.run)",
        )
        .bind(&ids)
        .bind(node)
        .fetch_all(&self.pool)
        .await
        .map_err(unavailable)?;
        Ok(rows.iter().filter_map(|id| id.parse().ok()).collect())
    }
}

impl Catalog {
    /// Of `ids` (runs node `node` holds), those the catalog has as another
    /// node's that never were this node's: the state directory is another
    /// node's (started with another `--node-id`). Each with its node.
    pub(crate) async fn strangers(
        &self,
        node: &str,
        ids: &[Ulid],
    ) -> Result<Vec<(Ulid, String)>, CoreError> {
        if ids.is_empty() {
            return Ok(Vec::new());
        }
        let ids: Vec<String> = ids.iter().map(Ulid::to_string).collect();
        let rows = sqlx::query(
            "SELECT r.id, r.node FROM runbox_runs r WHERE r.id = ANY($1) AND r.node <> $2 \
             AND r.node <> '-' AND r.status <> 'gone' \
             AND NOT EXISTS (SELECT 1 FROM runbox_moves m WHERE m.run = r.id AND m.from_node = $2)",
        )
        .bind(&ids)
        .bind(node)
        .fetch_all(&self.pool)
        .await
        .map_err(unavailable)?;
        Ok(rows
            .iter()
            .filter_map(|row| {
                let id: String = row.get("id");
                Some((id.parse().ok()?, row.get("node")))
            })
            .collect())
    }

    /// The runs of nodes not heard from for `gone_after` that were awake
    /// or asleep on their node (not archived: those wake anywhere; not
    /// lost or gone), at most `limit`.
    pub(crate) async fn orphans(
        &self,
        gone_after: Duration,
        limit: i64,
    ) -> Result<Vec<Orphan>, CoreError> {
        let rows = sqlx::query(
            "SELECT r.id, r.node, r.generation, r.run, r.lease_generation, r.record, \
             n.checkpoint_store \
             FROM runbox_runs r JOIN runbox_nodes n ON n.id = r.node \
             WHERE r.status IN ('creating', 'running', 'paused', 'hibernated', 'failed', 'stopping') \
             AND now() - n.heartbeat >= make_interval(secs => $1) \
             ORDER BY r.id LIMIT $2",
        )
        .bind(gone_after.as_secs_f64())
        .bind(limit)
        .fetch_all(&self.pool)
        .await
        .map_err(unavailable)?;
        rows.iter()
            .map(|row| {
                let id: String = row.get("id");
                Ok(Orphan {
                    id: id
                        .parse()
                        .map_err(|e| unavailable(format!("a run id {id:?}: {e}")))?,
                    node: row.get("node"),
                    generation: row.get("generation"),
                    run: listed(row)?,
                    record: row.get("record"),
                    store: row.get("checkpoint_store"),
                })
            })
            .collect()
    }

    /// Writes what the node-loss policy decided for `orphan`: its new view
    /// (`lost`, or `archived` to come back from a checkpoint) and, for the
    /// latter, its new sealed record; only if the row is as it was read.
    pub(crate) async fn settle(
        &self,
        orphan: &Orphan,
        run: &Run,
        record: Option<&str>,
    ) -> Result<bool, CoreError> {
        let status = serde_json::to_value(run.status)
            .ok()
            .and_then(|v| v.as_str().map(str::to_owned))
            .unwrap_or_default();
        let settled = sqlx::query(
            "UPDATE runbox_runs SET status = $4, run = $5, record = COALESCE($6, record), \
             generation = generation + 1, updated_at = now() \
             WHERE id = $1 AND node = $2 AND generation = $3 RETURNING 1",
        )
        .bind(orphan.id.to_string())
        .bind(&orphan.node)
        .bind(orphan.generation)
        .bind(status)
        .bind(sqlx::types::Json(run))
        .bind(record)
        .fetch_optional(&self.pool)
        .await
        .map_err(unavailable)?;
        Ok(settled.is_some())
    }

    /// Ends lost run `id` (a delete of it): its row is a tombstone no node
    /// owns, so a node that comes back with a copy ends that copy, and its
    /// idempotency key is freed. False when it is not lost (any more).
    pub(crate) async fn end_lost(&self, id: Ulid) -> Result<bool, CoreError> {
        let mut tx = self.pool.begin().await.map_err(unavailable)?;
        let ended = sqlx::query(
            "UPDATE runbox_runs SET status = 'gone', node = '-', record = NULL, \
             generation = generation + 1, updated_at = now() \
             WHERE id = $1 AND status = 'lost' RETURNING 1",
        )
        .bind(id.to_string())
        .fetch_optional(&mut *tx)
        .await
        .map_err(unavailable)?;
        if ended.is_none() {
            return Ok(false);
        }
        sqlx::query("DELETE FROM runbox_keys WHERE run = $1")
            .bind(id.to_string())
            .execute(&mut *tx)
            .await
            .map_err(unavailable)?;
        tx.commit().await.map_err(unavailable)?;
        Ok(true)
    }
}

/// Keeps the change of run `id`'s owner from `from` to `to`.
async fn moved(
    db: impl sqlx::PgExecutor<'_>,
    id: Ulid,
    from: &str,
    to: &str,
    reason: &str,
) -> Result<(), CoreError> {
    sqlx::query(
        "INSERT INTO runbox_moves (run, from_node, to_node, reason) VALUES ($1, $2, $3, $4)",
    )
    .bind(id.to_string())
    .bind(from)
    .bind(to)
    .bind(reason)
    .execute(db)
    .await
    .map_err(unavailable)
    .map(drop)
}

/// A catalog row's run, with the highest lease generation ever published
/// for it.
fn listed(row: &sqlx::postgres::PgRow) -> Result<Run, CoreError> {
    let sqlx::types::Json(mut run): sqlx::types::Json<Run> =
        row.try_get("run").map_err(unavailable)?;
    let highest: i64 = row.try_get("lease_generation").map_err(unavailable)?;
    let highest = u64::try_from(highest).unwrap_or(0);
    if highest > run.lease_generation.unwrap_or(0) {
        run.lease_generation = Some(highest);
    }
    Ok(run)
}

/// The writer: takes every change waiting, keeps the latest of each run,
/// writes them; on a failure waits and tries again with what it has (and
/// whatever came meanwhile).
async fn write_behind(
    pool: PgPool,
    node: String,
    target: String,
    mut rx: mpsc::UnboundedReceiver<Change>,
) {
    let mut pending: HashMap<Ulid, (i64, Option<Box<Published>>)> = HashMap::new();
    let mut resync: Option<(i64, Vec<Published>)> = None;
    let mut down = false;
    loop {
        if pending.is_empty() && resync.is_none() {
            match rx.recv().await {
                Some(change) => take(change, &mut pending, &mut resync),
                None => return,
            }
        }
        while let Ok(change) = rx.try_recv() {
            take(change, &mut pending, &mut resync);
        }
        let written = write(&pool, &node, &mut pending, &mut resync).await;
        match written {
            Ok(()) if down => {
                down = false;
                tracing::info!(database = %target, "the run catalog is written again");
            }
            Ok(()) => {}
            Err(e) => {
                if !down {
                    down = true;
                    tracing::warn!(database = %target, error = %e, "the run catalog cannot be written; this node's changes wait");
                }
                tokio::time::sleep(Duration::from_secs(1)).await;
            }
        }
    }
}

fn take(
    change: Change,
    pending: &mut HashMap<Ulid, (i64, Option<Box<Published>>)>,
    resync: &mut Option<(i64, Vec<Published>)>,
) {
    match change {
        Change::Run(id, generation, run) => {
            pending.insert(id, (generation, run));
        }
        Change::Resync(generation, runs) => {
            *resync = Some((generation, runs));
        }
    }
}

/// Writes what waits; what was written leaves `pending` (and `resync`).
async fn write(
    pool: &PgPool,
    node: &str,
    pending: &mut HashMap<Ulid, (i64, Option<Box<Published>>)>,
    resync: &mut Option<(i64, Vec<Published>)>,
) -> Result<(), sqlx::Error> {
    if let Some((generation, runs)) = resync.as_ref() {
        match resync_rows(pool, node, *generation, runs).await {
            Ok(()) => {}
            Err(sqlx::Error::Database(e)) => {
                tracing::warn!(error = %e, "the run catalog refused this node's resync; its runs are written as they change");
            }
            Err(e) => return Err(e),
        }
        *resync = None;
    }
    let ids: Vec<Ulid> = pending.keys().copied().collect();
    for id in ids {
        let (generation, run) = &pending[&id];
        let written = match run {
            Some(run) => upsert(pool, node, *generation, run).await,
            // Only the owner ends a row: a node whose run moved away
            // ends its own copy, never the run.
            None => sqlx::query(
                "UPDATE runbox_runs SET status = 'gone', generation = $2, record = NULL, \
                 updated_at = now() WHERE id = $1 AND generation < $2 AND node = $3",
            )
            .bind(id.to_string())
            .bind(generation)
            .bind(node)
            .execute(pool)
            .await
            .map(drop),
        };
        match written {
            Ok(()) => {}
            // The database refused this row itself (not the connection):
            // it is dropped, so it never holds up the others.
            Err(sqlx::Error::Database(e)) => {
                tracing::warn!(run = %id, error = %e, "the run catalog refused this run's row; it is left out");
            }
            Err(e) => return Err(e),
        }
        pending.remove(&id);
    }
    Ok(())
}

/// This node's runs are `runs`: the others it had in the catalog are
/// gone (but for runs the fleet brought back from a checkpoint after this
/// node was lost, which wait for a node to restore them), these are
/// written; one transaction.
async fn resync_rows(
    pool: &PgPool,
    node: &str,
    generation: i64,
    runs: &[Published],
) -> Result<(), sqlx::Error> {
    let mut tx = pool.begin().await?;
    let ids: Vec<String> = runs.iter().map(|r| r.run.id.to_string()).collect();
    sqlx::query(
        "UPDATE runbox_runs SET status = 'gone', generation = $3, record = NULL, updated_at = now() \
         WHERE node = $1 AND status <> 'gone' AND NOT (id = ANY($2)) AND generation < $3 \
         AND NOT (status = 'archived' AND run ? 'recovered')",
    )
    .bind(node)
    .bind(&ids)
    .bind(generation)
    .execute(&mut *tx)
    .await?;
    for run in runs {
        upsert(&mut *tx, node, generation, run).await?;
    }
    tx.commit().await
}

/// Writes `published` as node `node`'s, if the row is that node's (or
/// new) and older.
async fn upsert(
    db: impl sqlx::PgExecutor<'_>,
    node: &str,
    generation: i64,
    published: &Published,
) -> Result<(), sqlx::Error> {
    let run = &published.run;
    let status = serde_json::to_value(run.status)
        .ok()
        .and_then(|v| v.as_str().map(str::to_owned))
        .unwrap_or_default();
    sqlx::query(
        "INSERT INTO runbox_runs (id, node, tenant, generation, status, run, lease_generation, record) \
         VALUES ($1, $2, $3, $4, $5, $6, $7, $8) \
         ON CONFLICT (id) DO UPDATE SET tenant = EXCLUDED.tenant, \
         generation = EXCLUDED.generation, status = EXCLUDED.status, run = EXCLUDED.run, \
         lease_generation = GREATEST(runbox_runs.lease_generation, EXCLUDED.lease_generation), \
         record = EXCLUDED.record, updated_at = now() \
         WHERE runbox_runs.generation < EXCLUDED.generation AND runbox_runs.node = EXCLUDED.node",
    )
    .bind(run.id.to_string())
    .bind(node)
    .bind(&run.tenant)
    .bind(generation)
    .bind(status)
    .bind(sqlx::types::Json(run))
    .bind(i64::try_from(run.lease_generation.unwrap_or(0)).unwrap_or(i64::MAX))
    .bind(&published.record)
    .execute(db)
    .await
    .map(drop)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_latest_report_of_a_run_is_the_one_kept() {
        let mut pending = HashMap::new();
        let mut resync = None;
        let id = Ulid::new();
        take(Change::Run(id, 1, None), &mut pending, &mut resync);
        take(Change::Run(id, 2, None), &mut pending, &mut resync);
        assert_eq!(pending[&id].0, 2);
        take(Change::Resync(3, Vec::new()), &mut pending, &mut resync);
        assert_eq!(resync.as_ref().map(|r| r.0), Some(3));
    }
}
