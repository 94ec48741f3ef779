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
/// false when another move of it is under way. A move of it from `from`
/// still `moving` is one that node gave up before it told the node it
/// went to (the volume is marked moving on its node until its move ends,
/// so a new one starts only after): it ends as `back` first.
pub(crate) async fn begin(
    pool: &PgPool,
    volume: Ulid,
    id: Ulid,
    from: &str,
    to: &str,
) -> Result<bool, CoreError> {
    let mut tx = pool.begin().await.map_err(unavailable)?;
    sqlx::query(
        "UPDATE runbox_volume_moves SET state = 'back', settled_at = now() \
         WHERE volume = $1 AND state = 'moving' AND from_node = $2",
    )
    .bind(volume.to_string())
    .bind(from)
    .execute(&mut *tx)
    .await
    .map_err(unavailable)?;
    let started = sqlx::query(
        "INSERT INTO runbox_volume_moves (move_id, volume, from_node, to_node, state) \
         VALUES ($1, $2, $3, $4, 'moving') ON CONFLICT DO NOTHING RETURNING 1",
    )
    .bind(id.to_string())
    .bind(volume.to_string())
    .bind(from)
    .bind(to)
    .fetch_optional(&mut *tx)
    .await
    .map_err(unavailable)?;
    tx.commit().await.map_err(unavailable)?;
    Ok(started.is_some())
}

/// Ends move `id` of volume `volume` as `end` (`arrived` only by node
/// `node`, the one it goes to), if nothing ended it before: how it ended.
/// A move the database never heard of did not happen (`back`). The row is
/// locked while it is read and written, so two nodes ending one move at
/// once both read how the first ended it.
pub(crate) async fn end(
    pool: &PgPool,
    volume: Ulid,
    id: Ulid,
    end: VolumeMove,
    node: &str,
) -> Result<VolumeMove, CoreError> {
    let mut tx = pool.begin().await.map_err(unavailable)?;
    let row = sqlx::query(
        "SELECT state, to_node FROM runbox_volume_moves \
         WHERE move_id = $1 AND volume = $2 FOR UPDATE",
    )
    .bind(id.to_string())
    .bind(volume.to_string())
    .fetch_optional(&mut *tx)
    .await
    .map_err(unavailable)?;
    let Some(row) = row else {
        return Ok(VolumeMove::Back);
    };
    let (state, to): (String, String) = (row.get("state"), row.get("to_node"));
    let may = state == "moving" && (end != VolumeMove::Arrived || to == node);
    let state = if may {
        sqlx::query(
            "UPDATE runbox_volume_moves SET state = $2, settled_at = now() WHERE move_id = $1",
        )
        .bind(id.to_string())
        .bind(state_name(end))
        .execute(&mut *tx)
        .await
        .map_err(unavailable)?;
        state_name(end).to_owned()
    } else {
        state
    };
    tx.commit().await.map_err(unavailable)?;
    Ok(match state.as_str() {
        "arrived" => VolumeMove::Arrived,
        "moving" => VolumeMove::Moving,
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
