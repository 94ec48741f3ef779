//! Volumes that move between nodes: one row per volume in
//! `runbox_volume_moves`, its latest move. The node a volume leaves starts
//! the move; the move ends in one compare-and-set from `moving`, to
//! `arrived` by the node it goes to (once that node holds it whole) or to
//! `back` by either node when it did not get there. The first write wins,
//! and both nodes act on what the row says then.

use runbox_core::fleet::{unavailable, VolumeMove};
use runbox_core::CoreError;
use sqlx::postgres::PgPool;
use sqlx::Row;
use ulid::Ulid;

fn state_name(state: VolumeMove) -> &'static str {
    match state {
        VolumeMove::Moving => "moving",
        VolumeMove::Arrived => "arrived",
        VolumeMove::Back => "back",
    }
}

/// Starts move `id` of volume `volume` from node `from` to node `to`:
/// false when another move of it is under way.
pub(crate) async fn begin(
    pool: &PgPool,
    volume: Ulid,
    id: Ulid,
    from: &str,
    to: &str,
) -> Result<bool, CoreError> {
    let started = sqlx::query(
        "INSERT INTO runbox_volume_moves (volume, move_id, from_node, to_node, state) \
         VALUES ($1, $2, $3, $4, 'moving') \
         ON CONFLICT (volume) DO UPDATE SET move_id = EXCLUDED.move_id, \
           from_node = EXCLUDED.from_node, to_node = EXCLUDED.to_node, state = 'moving', \
           started_at = now(), settled_at = NULL \
         WHERE runbox_volume_moves.state <> 'moving' \
         RETURNING 1",
    )
    .bind(volume.to_string())
    .bind(id.to_string())
    .bind(from)
    .bind(to)
    .fetch_optional(pool)
    .await
    .map_err(unavailable)?;
    Ok(started.is_some())
}

/// Ends move `id` of volume `volume` as `end` (`arrived` only by node
/// `node`, the one it goes to), if nothing ended it before: how it ended.
/// A move the database never heard of did not happen (`back`).
pub(crate) async fn end(
    pool: &PgPool,
    volume: Ulid,
    id: Ulid,
    end: VolumeMove,
    node: &str,
) -> Result<VolumeMove, CoreError> {
    let row = sqlx::query(
        "WITH ended AS ( \
           UPDATE runbox_volume_moves SET state = $3, settled_at = now() \
           WHERE volume = $1 AND move_id = $2 AND state = 'moving' \
             AND ($3 <> 'arrived' OR to_node = $4) \
           RETURNING state) \
         SELECT state FROM ended \
         UNION ALL \
         SELECT state FROM runbox_volume_moves WHERE volume = $1 AND move_id = $2 \
           AND NOT EXISTS (SELECT 1 FROM ended)",
    )
    .bind(volume.to_string())
    .bind(id.to_string())
    .bind(state_name(end))
    .bind(node)
    .fetch_optional(pool)
    .await
    .map_err(unavailable)?;
    Ok(match row.map(|r| r.get::<String, _>("state")).as_deref() {
        Some("arrived") => VolumeMove::Arrived,
        Some("moving") => VolumeMove::Moving,
        _ => VolumeMove::Back,
    })
}

/// The live nodes whose rows list any of `volumes` (`tenant/name`), each
/// with why it cannot take a create now (None: it can), heard from in the
/// last `fresh_sec`.
pub(crate) async fn holders(
    pool: &PgPool,
    volumes: &[String],
    fresh_sec: f64,
) -> Result<Vec<(String, Option<String>)>, CoreError> {
    let rows = sqlx::query(
        "SELECT id, draining, runs >= capacity AS full, \
                heartbeat <= now() - make_interval(secs => $2) AS silent \
         FROM runbox_nodes \
         WHERE left_at IS NULL AND volumes && $1::text[] ORDER BY id",
    )
    .bind(volumes)
    .bind(fresh_sec)
    .fetch_all(pool)
    .await
    .map_err(unavailable)?;
    Ok(rows
        .iter()
        .map(|row| {
            let why = if row.get::<bool, _>("silent") {
                Some("it has not been heard from lately")
            } else if row.get::<bool, _>("draining") {
                Some("it is draining")
            } else if row.get::<bool, _>("full") {
                Some("it is full")
            } else {
                None
            };
            (row.get("id"), why.map(str::to_owned))
        })
        .collect())
}
