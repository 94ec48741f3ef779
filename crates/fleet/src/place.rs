//! Placement: the node a create is best made on.
//!
//! Best of a few: the database hands back a handful of nodes that can take
//! a run (heard from lately, not cordoned, below their capacity), those
//! with a ready pool member for the image first, then those that store
//! it, the rest in random order, plus the node that received the create;
//! of those the best is the one with a ready member, then the image, then
//! the most room (in quarters of its capacity, rounded up, so small
//! differences tie),
//! then the fewest of the tenant's runs. A tie keeps the create on the
//! node that received it, so a fleet with room everywhere sends nothing
//! on.

use runbox_core::fleet::{unavailable, Located, Want};
use runbox_core::CoreError;
use sqlx::postgres::PgPool;
use sqlx::Row;

/// How many nodes besides the receiving one are weighed.
pub(crate) const CHOICES: i64 = 8;

/// A node that could take the create, as its row says.
#[derive(Clone, Debug)]
pub(crate) struct Candidate {
    pub(crate) node: String,
    pub(crate) advertise: String,
    pub(crate) capacity: i32,
    pub(crate) runs: i32,
    pub(crate) has_image: bool,
    pub(crate) has_pool: bool,
    pub(crate) has_volumes: bool,
    /// Its lane can make what the create asks for.
    pub(crate) can: bool,
    pub(crate) tenant_runs: i32,
    pub(crate) silent_sec: f64,
}

impl Candidate {
    /// How good a home it is (greater is better); None: it cannot take
    /// the create.
    fn score(&self, want: &Want) -> Option<(bool, bool, i64, i32)> {
        let free = self.capacity - self.runs;
        if free <= 0 || (!self.has_image && !want.pullable) || !self.has_volumes || !self.can {
            return None;
        }
        // Rounded up: a node whose least-filled quarter still has room
        // ties with an empty one.
        let capacity = i64::from(self.capacity.max(1));
        let quarters = (i64::from(free) * 4 + capacity - 1) / capacity;
        Some((self.has_pool, self.has_image, quarters, -self.tenant_runs))
    }
}

/// The best of `candidates` for `want`, the receiving node winning ties
/// (and left out when `want.here_full`).
pub(crate) fn choose(candidates: &[Candidate], want: &Want) -> Option<Candidate> {
    let best = |want: &Want| {
        candidates
            .iter()
            .filter(|c| !(want.here_full && c.node == want.here))
            .filter_map(|c| c.score(want).map(|score| (score, c.node == want.here, c)))
            .max_by(|a, b| (a.0, a.1).cmp(&(b.0, b.1)))
            .map(|(_, _, c)| c.clone())
    };
    best(want).or_else(|| {
        // No row says it stores the image, and it cannot be pulled: rows
        // are as of each node's last heartbeat, so an image made since (a
        // snapshot a moment ago) is looked for on the others with room;
        // the node asked knows it has not got it.
        let elsewhere = Want {
            pullable: true,
            here_full: true,
            ..want.clone()
        };
        best(&elsewhere).filter(|_| !want.pullable)
    })
}

/// Reads the candidates for `want` and chooses; None keeps the create on
/// the receiving node.
pub(crate) async fn place(
    pool: &PgPool,
    want: &Want,
    fresh_sec: f64,
) -> Result<Option<Located>, CoreError> {
    let rows = sqlx::query(
        "WITH live AS ( \
           SELECT n.id, n.advertise, n.capacity, n.runs, \
                  n.images && $1::text[] AS has_image, n.pooled && $1::text[] AS has_pool, \
                  NOT EXISTS (SELECT 1 FROM unnest($6::text[]) AS m(own) \
                              WHERE NOT (m.own = ANY(n.volumes) \
                                         OR '*' || substr(m.own, strpos(m.own, '/')) = ANY(n.volumes))) \
                    AS has_volumes, \
                  n.capabilities @> $8::text[] AS can, \
                  coalesce(t.runs, 0) AS tenant_runs, \
                  EXTRACT(EPOCH FROM now() - n.heartbeat)::float8 AS silent \
           FROM runbox_nodes n \
           LEFT JOIN runbox_tenant_runs t ON t.node = n.id AND t.tenant = $2 \
           WHERE n.left_at IS NULL AND NOT n.draining AND n.runs < n.capacity \
             AND n.heartbeat > now() - make_interval(secs => $3) \
             AND ($7::text IS NULL OR n.checkpoint_store = $7) \
         ) \
         (SELECT * FROM live WHERE id <> $4 \
          ORDER BY has_volumes AND can DESC, has_pool DESC, has_image DESC, random() LIMIT $5) \
         UNION ALL (SELECT * FROM live WHERE id = $4)",
    )
    .bind(&want.images)
    .bind(want.tenant.as_deref().unwrap_or(""))
    .bind(fresh_sec)
    .bind(&want.here)
    .bind(CHOICES)
    .bind(&want.volumes)
    .bind(&want.checkpoint_store)
    .bind(&want.needs)
    .fetch_all(pool)
    .await
    .map_err(unavailable)?;
    let mut candidates: Vec<Candidate> = rows
        .iter()
        .map(|row| Candidate {
            node: row.get("id"),
            advertise: row.get("advertise"),
            capacity: row.get("capacity"),
            runs: row.get("runs"),
            has_image: row.get("has_image"),
            has_pool: row.get("has_pool"),
            has_volumes: row.get("has_volumes"),
            can: row.get("can"),
            tenant_runs: row.get("tenant_runs"),
            silent_sec: row.get("silent"),
        })
        .collect();
    // The receiving node knows what it stores now; its row, only what it
    // had at its last heartbeat.
    for here in candidates.iter_mut().filter(|c| c.node == want.here) {
        here.has_image |= want.here_has.0;
        here.has_pool |= want.here_has.1;
        here.has_volumes = want.here_has_volumes;
        here.can = want.here_can;
    }
    Ok(choose(&candidates, want)
        .filter(|c| c.node != want.here)
        .map(|c| Located {
            node: c.node,
            advertise: c.advertise,
            tenant: want.tenant.clone(),
            gone: false,
            silent_sec: c.silent_sec.max(0.0),
            archived: false,
            lost: false,
            portable: false,
        }))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn node(name: &str, capacity: i32, runs: i32) -> Candidate {
        Candidate {
            node: name.into(),
            advertise: format!("{name}:7439"),
            capacity,
            runs,
            has_image: true,
            has_pool: false,
            has_volumes: true,
            can: true,
            tenant_runs: 0,
            silent_sec: 0.0,
        }
    }

    fn want() -> Want {
        Want {
            images: vec!["base".into()],
            pullable: false,
            tenant: None,
            here: "n1".into(),
            here_full: false,
            here_has: (true, false),
            volumes: Vec::new(),
            here_has_volumes: true,
            checkpoint_store: None,
            needs: Vec::new(),
            here_can: true,
        }
    }

    #[test]
    fn ties_stay_on_the_receiving_node_and_room_moves_creates() {
        let want = want();
        // Both three quarters free or more: a tie, kept here.
        let nodes = [node("n1", 100, 20), node("n2", 100, 0)];
        assert_eq!(choose(&nodes, &want).unwrap().node, "n1");
        // Here is nearly full: the emptier node wins.
        let nodes = [node("n1", 100, 90), node("n2", 100, 10)];
        assert_eq!(choose(&nodes, &want).unwrap().node, "n2");
        // Full here: never here.
        let full = Want {
            here_full: true,
            ..want.clone()
        };
        let nodes = [node("n1", 100, 0), node("n2", 100, 99)];
        assert_eq!(choose(&nodes, &full).unwrap().node, "n2");
        assert!(choose(&[node("n1", 4, 0)], &full).is_none());
    }

    #[test]
    fn a_create_goes_only_where_the_lane_can_make_it() {
        let mut without = node("n1", 100, 0);
        without.can = false;
        let nodes = [without, node("n2", 100, 90)];
        assert_eq!(choose(&nodes, &want()).unwrap().node, "n2");
        let mut alone = node("n1", 100, 0);
        alone.can = false;
        assert!(choose(&[alone], &want()).is_none());
    }

    #[test]
    fn a_create_that_mounts_volumes_goes_only_where_they_are() {
        let want = Want {
            volumes: vec!["data".into()],
            ..want()
        };
        let mut without = node("n1", 100, 0);
        without.has_volumes = false;
        let nodes = [without.clone(), node("n2", 100, 90)];
        assert_eq!(choose(&nodes, &want).unwrap().node, "n2");
        assert!(choose(&[without], &want).is_none());
    }

    #[test]
    fn a_ready_pool_then_the_image_then_the_tenants_spread_decide() {
        let want = want();
        let mut pooled = node("n3", 100, 80);
        pooled.has_pool = true;
        let nodes = [node("n1", 100, 0), node("n2", 100, 0), pooled];
        assert_eq!(choose(&nodes, &want).unwrap().node, "n3");
        // A node without the image cannot take a create that cannot pull.
        let mut bare = node("n2", 100, 0);
        bare.has_image = false;
        let nodes = [node("n1", 100, 99), bare.clone()];
        assert_eq!(choose(&nodes, &want).unwrap().node, "n1");
        // Unless no node says it stores it (rows lag behind): then another
        // node with room is asked, never the one that knows it has not.
        let mut lacking = node("n1", 100, 0);
        lacking.has_image = false;
        let nodes = [lacking.clone(), bare.clone()];
        assert_eq!(choose(&nodes, &want).unwrap().node, "n2");
        assert!(choose(&[lacking], &want).is_none());
        // One that can pull goes where the image is first, room equal.
        let pull = Want {
            pullable: true,
            ..want.clone()
        };
        let nodes = [bare, node("n4", 100, 0)];
        assert_eq!(choose(&nodes, &pull).unwrap().node, "n4");
        // The tenant's runs spread out.
        let mut crowded = node("n1", 100, 0);
        crowded.tenant_runs = 5;
        let nodes = [crowded, node("n2", 100, 0)];
        assert_eq!(choose(&nodes, &want).unwrap().node, "n2");
    }
}
