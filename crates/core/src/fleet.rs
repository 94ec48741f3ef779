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
    /// away. Only the run's owner (the node the catalog names) writes its
    /// row: a node whose run moved away writes nothing more of it.
    fn record_run(&self, id: Ulid, run: Option<Published>);

    /// Writes run `id` of this node to the catalog now, as `run` (a
    /// create's answer), so that any node finds it as soon as the caller
    /// learns its id.
    async fn record_run_now(&self, run: &Published) -> Result<(), CoreError>;

    /// This node's runs are what `list` answers, and no others (at start,
    /// so the catalog forgets what this node destroyed while it was down);
    /// `list` is called after the resync's generation is taken, so a
    /// report made meanwhile is never older than the list.
    fn resync_runs(&self, list: &dyn Fn() -> Vec<Published>);

    /// Run `id` of this node is about to be restored here: the catalog
    /// says so first (so no other node takes it over meanwhile). The node
    /// that holds it instead when it moved away from this one.
    async fn hold_run(&self, id: Ulid) -> Result<Option<String>, CoreError>;

    /// Takes run `id` over for this node when `how` allows it (the run is
    /// asleep, its disk in a bucket this node shares, and its node gone or
    /// not answering), or finds it handed to this node: its sealed record.
    /// None when it is not this node's to take.
    async fn take_run(&self, id: Ulid, how: Takeover) -> Result<Option<String>, CoreError>;

    /// Hands archived run `id` of this node to node `to`, with its sealed
    /// `record`: false when it is not this node's (any more).
    async fn hand_off_run(&self, id: Ulid, to: &str, record: &str) -> Result<bool, CoreError>;

    /// Of `ids` (runs this node holds), those that moved to another node
    /// (or were ended by the fleet while this node was gone).
    async fn superseded_runs(&self, ids: &[Ulid]) -> Result<Vec<Ulid>, CoreError>;

    /// Of `ids` (runs this node holds), those the catalog has as another
    /// node's that never were this node's (this state directory was
    /// another node's), with that node.
    async fn stranger_runs(&self, ids: &[Ulid]) -> Result<Vec<(Ulid, String)>, CoreError>;

    /// Runs of nodes gone (by their heartbeat) that were awake or asleep
    /// there, not archived, lost or gone: at most `limit`.
    async fn orphans(&self, limit: usize) -> Result<Vec<Orphan>, CoreError>;

    /// Writes what the node-loss policy decided for `orphan` (its new
    /// view, and its new sealed record when it comes back from a
    /// checkpoint), if its row is as it was read.
    async fn settle_orphan(
        &self,
        orphan: &Orphan,
        run: &Run,
        record: Option<&str>,
    ) -> Result<bool, CoreError>;

    /// Ends lost run `id` (its delete); false when it is not lost.
    async fn end_lost_run(&self, id: Ulid) -> Result<bool, CoreError>;

    /// Starts move `id` of volume `volume` from this node to node `to`:
    /// false when another move of it is under way.
    async fn begin_volume_move(&self, volume: Ulid, id: Ulid, to: &str) -> Result<bool, CoreError>;

    /// Ends move `id` of volume `volume` as `end` unless it ended already
    /// (`Arrived` only by the node it goes to): how it ended, which both
    /// nodes act on.
    async fn end_volume_move(
        &self,
        volume: Ulid,
        id: Ulid,
        end: VolumeMove,
    ) -> Result<VolumeMove, CoreError>;

    /// The nodes that hold any of `volumes` (as [`Want::volumes`] names
    /// them), each with why it cannot take a create now (None: it can).
    async fn volume_nodes(
        &self,
        volumes: &[String],
    ) -> Result<Vec<(String, Option<String>)>, CoreError>;

    /// Every run of the fleet the catalog lists, by id: each as its owner
    /// last published it.
    async fn runs(&self) -> Result<Vec<Run>, CoreError>;

    /// Run `id` as the catalog has it, when another node holds it.
    async fn run(&self, id: Ulid) -> Result<Option<Run>, CoreError>;

    /// The fleet's part of the ledger ([`crate::ledger::Shared`]).
    fn ledger(&self) -> std::sync::Arc<dyn crate::ledger::Shared>;

    /// The node a create of `want` is best made on (see `runbox-fleet`'s
    /// placement); None keeps it on this node.
    async fn place(&self, want: &Want) -> Result<Option<Located>, CoreError>;

    /// Takes (or keeps) the fleet's lease on `work` for `hold`, if no
    /// other node holds it: its fencing number, which grows with every
    /// change of holder. None: another node does the work now.
    async fn singleton(
        &self,
        work: &str,
        hold: std::time::Duration,
    ) -> Result<Option<u64>, CoreError>;

    /// Where run `id` is when another node holds it (None: no node does,
    /// or this one).
    async fn locate(&self, id: Ulid) -> Result<Option<Located>, CoreError>;

    /// This node's proof that it sends `what` (a request line), for the
    /// node it sends it to.
    fn prove(&self, what: &str) -> String;

    /// Whether `proof` is a node of the fleet's proof of `what`, made in
    /// the last minute.
    fn proven(&self, what: &str, proof: &str) -> bool;
}

/// The warm-pool set a node's cell shares (`--cell`): `PUT /v1/pools`
/// stores it here instead of in the node's `pools.json`, and every node of
/// the cell applies it.
#[async_trait]
pub trait SharedPools: Send + Sync {
    /// Stores `set` as the cell's (every node of the cell hears of it).
    async fn store(&self, set: &runbox_types::PoolSet) -> Result<(), CoreError>;
}

/// A run as its owner publishes it to the catalog: its API view, and its
/// whole record sealed under the fleet's sealing key (None without one), so
/// another node can make it again.
#[derive(Clone, Debug)]
pub struct Published {
    /// What lists and answers from the catalog show.
    pub run: Run,
    /// [`crate::store::RunRecord`] as JSON, sealed.
    pub record: Option<String>,
}

/// A run of a node that is gone, as the catalog has it: what the
/// node-loss policy decides on.
#[derive(Clone, Debug)]
pub struct Orphan {
    /// The run.
    pub id: Ulid,
    /// Its node (gone).
    pub node: String,
    /// Its row's generation when read: a decision is written only if the
    /// row is still so.
    pub generation: i64,
    /// Its view.
    pub run: Run,
    /// Its sealed record, if the catalog has one.
    pub record: Option<String>,
    /// Its node's checkpoint store (a bucket, when it is one).
    pub store: Option<String>,
}

/// Where a volume's move stands in the fleet's database.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum VolumeMove {
    /// Under way.
    Moving,
    /// The node it went to holds it.
    Arrived,
    /// It did not get there: the node it left keeps it.
    Back,
}

/// When a node may take over an asleep run another node owns.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Takeover {
    /// Its node is gone (left, or not heard from for the gone time).
    Gone,
    /// Its node did not answer a request sent to it just now.
    Unreachable,
}

impl Takeover {
    /// The reason a move records.
    pub fn reason(self) -> &'static str {
        match self {
            Takeover::Gone => "node gone",
            Takeover::Unreachable => "node unreachable",
        }
    }
}

/// What placement weighs of a create.
#[derive(Clone, Debug, PartialEq)]
pub struct Want {
    /// The names its image goes by: as the create wrote it, and as a
    /// normalised reference when it is one.
    pub images: Vec<String>,
    /// Whether a node without the image may pull it.
    pub pullable: bool,
    /// Whose run it is.
    pub tenant: Option<String>,
    /// The node that received the create.
    pub here: String,
    /// Whether that node is full (so never it).
    pub here_full: bool,
    /// Whether that node stores the image and has a ready pool member of
    /// it now (its row says what it had at its last heartbeat).
    pub here_has: (bool, bool),
    /// The volumes and datasets the create mounts, each as
    /// `tenant/name` (`/name` for the operator's; see
    /// [`crate::runs::Manager::volumes_held`]): only a node that holds
    /// them all can take it.
    pub volumes: Vec<String>,
    /// The bucket the checkpoint the create starts from is in: only a node
    /// whose checkpoint store is that bucket can take it.
    pub checkpoint_store: Option<String>,
    /// What the create needs a node's lane to do, by capability name
    /// ([`crate::lane::Capabilities::names`]: its network tier, for one):
    /// only a node whose lane can do all of it can take it.
    pub needs: Vec<String>,
    /// Whether the node asked can, now.
    pub here_can: bool,
    /// Whether the node asked holds them all now.
    pub here_has_volumes: bool,
}

/// Where a run another node holds is.
#[derive(Clone, Debug, PartialEq)]
pub struct Located {
    /// The node.
    pub node: String,
    /// Where the nodes reach it (host:port).
    pub advertise: String,
    /// The tenant the run is stamped with.
    pub tenant: Option<String>,
    /// Whether the node is gone (unseen for the gone time, or left).
    pub gone: bool,
    /// Seconds since the node was last heard from.
    pub silent_sec: f64,
    /// Whether the run is asleep with its disk in the checkpoint store
    /// (archived, or being restored by a node that is gone).
    pub archived: bool,
    /// Whether the run was lost with its node (only a delete works).
    pub lost: bool,
    /// Whether this node could make the run from the catalog: its record
    /// is there and its node's checkpoint store is a bucket this node
    /// uses too.
    pub portable: bool,
}

/// The run's node is gone: a 503 that names it.
pub fn node_gone(id: Ulid, at: &Located) -> CoreError {
    CoreError::Conflict {
        code: runbox_types::ErrorCode::NodeUnavailable,
        message: format!(
            "run {id} is on node {} ({}), which has not been heard from for {:.0}s; \
             the run answers again when that node is back",
            at.node, at.advertise, at.silent_sec
        ),
    }
}

/// A call that waited for run `id` while it moved to another node: a 503
/// the same call, sent again, gets past (any node sends it on to the run's
/// new node).
pub fn moved(id: Ulid) -> CoreError {
    CoreError::Conflict {
        code: runbox_types::ErrorCode::RunMoved,
        message: format!(
            "run {id} moved to another node of the fleet while this call waited for it; send it again"
        ),
    }
}

/// A node without a cluster as `GET /v1/cluster` lists it: `info` of it,
/// up since `started_at`.
pub fn lone_node(
    info: runbox_types::Info,
    capabilities: Vec<String>,
    started_at: time::OffsetDateTime,
) -> ClusterNode {
    let count = |n: usize| u32::try_from(n).unwrap_or(u32::MAX);
    ClusterNode {
        id: info.server,
        advertise: None,
        client_origin: None,
        version: info.version,
        lane: info.runtime,
        capabilities,
        checkpoint_store: None,
        state: match info.draining {
            true => runbox_types::NodeState::Draining,
            false => runbox_types::NodeState::Active,
        },
        capacity: count(info.capacity.max),
        runs: count(info.capacity.live),
        pools_ready: count(info.capacity.pooled),
        last_seen_sec: 0.0,
        started_at,
        local: true,
    }
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
