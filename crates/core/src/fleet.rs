//! What this node knows of the fleet it belongs to, when it belongs to
//! one: [`Fleet`], implemented over PostgreSQL by the `runbox-fleet`
//! crate. A node without a cluster has none, and answers for itself.

use async_trait::async_trait;
use runbox_types::{ClusterNode, Run};
use ulid::Ulid;

use crate::error::CoreError;

/// The fleet's shared view of its nodes and runs.
#[async_trait]
pub trait Fleet: Send + Sync {
    /// Every node the cluster database lists, with where each stands by
    /// the database's clock; `503 cluster_unavailable` while the database
    /// cannot be reached.
    async fn nodes(&self) -> Result<Vec<ClusterNode>, CoreError>;

    /// Run `id` of this node as its owner published it now (`None`: it is
    /// gone), for the fleet's run catalog. Never waits: the catalog is
    /// written behind, latest first, and kept trying while the database is
    /// away.
    fn record_run(&self, id: Ulid, run: Option<Run>);

    /// This node's runs are `runs`, and no others (at start, so the
    /// catalog forgets what this node destroyed while it was down).
    fn resync_runs(&self, runs: Vec<Run>);

    /// Every run of the fleet the catalog lists, by id: each as its owner
    /// last published it.
    async fn runs(&self) -> Result<Vec<Run>, CoreError>;
}

/// The cluster database cannot be reached (or refused): a 503 with
/// `Retry-After` that says what to look at. `why` must not carry a
/// password (drivers' messages do not).
pub fn unavailable(why: impl std::fmt::Display) -> CoreError {
    CoreError::Conflict {
        code: runbox_types::ErrorCode::ClusterUnavailable,
        message: format!("the cluster database cannot be reached ({why}); retry shortly"),
    }
}
