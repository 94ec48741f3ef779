//! The fleet as `GET /v1/cluster` shows it.

use serde::{Deserialize, Serialize};
use time::OffsetDateTime;

/// Where a node stands, by its row in the cluster database.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "lowercase")]
pub enum NodeState {
    /// Heard from lately; takes runs.
    Active,
    /// Heard from lately; cordoned (`POST /v1/drain`), takes no new runs.
    Draining,
    /// Not heard from for longer than the suspect time: maybe gone.
    Suspect,
    /// Not heard from for longer than the gone time, or left cleanly.
    Gone,
}

impl NodeState {
    /// The state's name.
    pub fn as_str(self) -> &'static str {
        match self {
            NodeState::Active => "active",
            NodeState::Draining => "draining",
            NodeState::Suspect => "suspect",
            NodeState::Gone => "gone",
        }
    }
}

/// One node of the fleet.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase")]
pub struct ClusterNode {
    /// Its id (`--node-id`; a single node's is its server id).
    pub id: String,
    /// Where the other nodes reach it (`--advertise`, host:port); none for
    /// a node without a cluster.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub advertise: Option<String>,
    /// Where clients may reach it directly (`--client-advertise`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub client_origin: Option<String>,
    /// The runbox version it runs.
    pub version: String,
    /// Its runtime lane.
    pub lane: String,
    /// What that lane can do on its host, by name: `allowlist`, `open`,
    /// `diskLimit`, `warmVolumes`, `capture`, `exitWatch`, `dial`,
    /// `suspend`, `hibernate`, `layers`, `userNamespaces` (as of its last
    /// heartbeat on a node of a fleet; empty until the first).
    #[serde(default)]
    pub capabilities: Vec<String>,
    /// Its checkpoint store when that is a bucket (`s3://bucket/prefix`),
    /// which nodes may share: runs move only between nodes that share one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub checkpoint_store: Option<String>,
    /// Where it stands.
    pub state: NodeState,
    /// Its `--max-runs`.
    pub capacity: u32,
    /// Runs it counts against that, as of its last heartbeat.
    pub runs: u32,
    /// Ready warm pool members, as of its last heartbeat.
    pub pools_ready: u32,
    /// Seconds since its last heartbeat, by the database's clock.
    pub last_seen_sec: f64,
    /// When it joined (this incarnation).
    #[serde(with = "time::serde::rfc3339")]
    pub started_at: OffsetDateTime,
    /// Whether it is the node that answered.
    #[serde(default)]
    pub local: bool,
}

/// `GET /v1/cluster`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase")]
pub struct ClusterStatus {
    /// Every node, by id; nodes gone are listed until they are cleaned up.
    pub nodes: Vec<ClusterNode>,
}
