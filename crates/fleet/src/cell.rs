//! A cell's warm-pool set in PostgreSQL ([`CellPools`]): the set `PUT
//! /v1/pools` applies belongs to the cell a node was started in
//! (`--cell`), so a PUT on any node of the cell sets every node's pools
//! (each node keeps each pool's targets itself, as with its own
//! `pools.json`). A change is stored with a generation that only grows and
//! announced on the `runbox_pools` channel; every node of the cell applies
//! it when it hears of it, and checks every few seconds in case it missed
//! one.

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use runbox_core::fleet::{unavailable, SharedPools};
use runbox_core::CoreError;
use runbox_types::PoolSet;
use sqlx::postgres::{PgListener, PgPool};

/// The channel changes are announced on.
const CHANNEL: &str = "runbox_pools";

/// How often a node looks at its cell's set whatever it heard.
const CHECK_EVERY: Duration = Duration::from_secs(5);

/// One cell's pool set.
pub struct CellPools {
    pool: PgPool,
    cell: String,
}

impl CellPools {
    pub(crate) fn new(pool: PgPool, cell: String) -> Arc<CellPools> {
        Arc::new(CellPools { pool, cell })
    }

    /// The cell's set and its generation, if one was ever applied.
    async fn load(&self) -> Result<Option<(PoolSet, i64)>, sqlx::Error> {
        let row: Option<(sqlx::types::Json<PoolSet>, i64)> =
            sqlx::query_as("SELECT pools, generation FROM runbox_pool_sets WHERE cell = $1")
                .bind(&self.cell)
                .fetch_optional(&self.pool)
                .await?;
        Ok(row.map(|(set, generation)| (set.0, generation)))
    }

    /// The cell's set now, to apply at start (None: the cell has none yet,
    /// and the node's own set stands).
    pub async fn current(&self) -> Result<Option<PoolSet>, CoreError> {
        Ok(self.load().await.map_err(unavailable)?.map(|(set, _)| set))
    }

    /// Applies the cell's set with `apply` whenever it changes (heard of,
    /// or seen at a check), from the generation `seen` on; ends when the
    /// set is dropped.
    pub fn follow(self: &Arc<Self>, apply: Arc<dyn Fn(PoolSet) + Send + Sync>) {
        let weak = Arc::downgrade(self);
        let pool = self.pool.clone();
        tokio::spawn(async move {
            let mut seen: Option<i64> = None;
            let mut listener: Option<PgListener> = None;
            loop {
                let Some(cell) = weak.upgrade() else {
                    return;
                };
                if listener.is_none() {
                    if let Ok(mut l) = PgListener::connect_with(&pool).await {
                        if l.listen(CHANNEL).await.is_ok() {
                            listener = Some(l);
                        }
                    }
                }
                match cell.load().await {
                    Ok(Some((set, generation))) if seen != Some(generation) => {
                        // The first look only notes where the cell is: the
                        // set was applied at start.
                        if seen.is_some() {
                            tracing::info!(cell = %cell.cell, pools = set.pools.len(), "the cell's warm pools changed");
                            apply(set);
                        }
                        seen = Some(generation);
                    }
                    Ok(None) if seen.is_none() => seen = Some(0),
                    Ok(_) => {}
                    Err(e) => {
                        tracing::debug!(error = %e, "the cell's pool set waits for the database")
                    }
                }
                drop(cell);
                let heard = match listener.as_mut() {
                    Some(l) => tokio::select! {
                        heard = l.recv() => heard.is_ok(),
                        () = tokio::time::sleep(CHECK_EVERY) => true,
                    },
                    None => {
                        tokio::time::sleep(CHECK_EVERY).await;
                        true
                    }
                };
                if !heard {
                    listener = None;
                }
            }
        });
    }
}

#[async_trait]
impl SharedPools for CellPools {
    async fn store(&self, set: &PoolSet) -> Result<(), CoreError> {
        let mut tx = self.pool.begin().await.map_err(unavailable)?;
        sqlx::query(
            "INSERT INTO runbox_pool_sets (cell, pools, generation) VALUES ($1, $2, 1) \
             ON CONFLICT (cell) DO UPDATE SET pools = EXCLUDED.pools, \
             generation = runbox_pool_sets.generation + 1, updated_at = now()",
        )
        .bind(&self.cell)
        .bind(sqlx::types::Json(set))
        .execute(&mut *tx)
        .await
        .map_err(unavailable)?;
        sqlx::query("SELECT pg_notify($1, $2)")
            .bind(CHANNEL)
            .bind(&self.cell)
            .execute(&mut *tx)
            .await
            .map_err(unavailable)?;
        tx.commit().await.map_err(unavailable)
    }
}
