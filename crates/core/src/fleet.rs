//! What this node knows of the fleet it belongs to, when it belongs to
//! one: [`Fleet`], implemented over PostgreSQL by the `runbox-fleet`
//! crate. A node without a cluster has none, and answers for itself.

use async_trait::async_trait;
use runbox_types::ClusterNode;

use crate::error::CoreError;

/// The fleet's shared view of its nodes.
#[async_trait]
pub trait Fleet: Send + Sync {
    /// Every node the cluster database lists, with where each stands by
    /// the database's clock; `503 cluster_unavailable` while the database
    /// cannot be reached.
    async fn nodes(&self) -> Result<Vec<ClusterNode>, CoreError>;
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
