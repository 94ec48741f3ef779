//! Operations addressed to one run, as values.
//!
//! Every call the API makes on one run whose question and answer are
//! values (not byte streams) is a [`RunRequest`], answered with a
//! [`RunReply`] by whoever owns the run: the [`crate::Manager`] of this
//! node ([`RunOwner`]), or, in a fleet, the node that owns it, reached with
//! the request serialised. The typed calls of [`crate::RunService`] build
//! the request and read the reply, so a surface calls `service.pause(id)`
//! and an owner implements one function. Calls that carry bytes (exec
//! output, file bodies, sessions, port connections) are methods of their
//! own, since what they move is a stream.

use async_trait::async_trait;
use runbox_types::{
    Checkpoint, CheckpointRequest, ExecRequest, FileInfo, FileList, ForkRequest, ForkResponse,
    FsQuery, HistoryDiff, HistoryDiffQuery, HistoryList, Lease, LeaseReleaseRequest,
    LeaseRenewRequest, LeaseRequest, MakeDirRequest, MoveRequest, Preview, PreviewRequest, Process,
    ProcessList, RemoveReply, RemoveRequest, RollbackRequest, Run, SignalRequest, Snapshot,
    SnapshotRequest, UpdateEgressRequest, WarmCommit, WarmCommitRequest, WarmStatus,
};
use serde::{Deserialize, Serialize};
use ulid::Ulid;

use crate::error::CoreError;
use crate::runs::Scope;
use crate::service::LeaseCredential;

/// An operation on one run (the run is named beside it).
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "camelCase", rename_all_fields = "camelCase")]
pub enum RunRequest {
    /// The run as the API shows it.
    Get,
    /// Destroy it; answered once nothing of it is left.
    Delete,
    /// Destroy it; answered once its processes are gone, the rest of the
    /// teardown following (see [`crate::runs::Manager::kill`]).
    Kill,
    /// Freeze its processes.
    Pause,
    /// Let a paused run go on; wake a hibernated one.
    Resume,
    /// Stop it down to its disk.
    Hibernate,
    /// Send its disk to the checkpoint store.
    Archive,
    /// Boot a hibernated or failed run again; resume a paused one.
    Wake,
    /// Expire it `ttl_sec` from now.
    Renew { ttl_sec: u64 },
    /// Change its egress policy.
    UpdateEgress { req: UpdateEgressRequest },
    /// Take its writable lease.
    AcquireLease { req: LeaseRequest },
    /// Extend its lease.
    RenewLease { req: LeaseRenewRequest },
    /// Give its lease back.
    ReleaseLease { req: LeaseReleaseRequest },
    /// Make new runs from its filesystem.
    Fork { req: ForkRequest },
    /// Make an image of its filesystem.
    Snapshot { req: SnapshotRequest },
    /// Send it to the checkpoint store and keep it.
    Checkpoint { req: CheckpointRequest },
    /// Publish its warm volume as its repository's template.
    WarmCommit { req: WarmCommitRequest },
    /// Its warm volume as it is now.
    WarmStatus,
    /// Describe a path (None: the scope's base).
    StatPath { scope: Scope, path: Option<String> },
    /// List a directory.
    ListPath { scope: Scope, query: FsQuery },
    /// Make a directory and its parents.
    MakeDir {
        scope: Scope,
        req: MakeDirRequest,
        user: Option<String>,
    },
    /// Rename a path.
    MovePath { scope: Scope, req: MoveRequest },
    /// Remove a path.
    RemovePath { scope: Scope, req: RemoveRequest },
    /// Start a background process.
    StartProcess { req: ExecRequest },
    /// Its processes.
    Processes,
    /// Wait up to `limit_ms` for a process to end.
    WaitProcess { process: String, limit_ms: u64 },
    /// Signal a process's group.
    SignalProcess { process: String, req: SignalRequest },
    /// Write to a process's stdin (and close it).
    SendInput {
        process: String,
        credential: LeaseCredential,
        data: Vec<u8>,
        close: bool,
    },
    /// Set a process's terminal size.
    ResizeProcess {
        process: String,
        rows: u32,
        cols: u32,
    },
    /// Mint a preview URL for a port.
    MintPreview { req: PreviewRequest },
    /// Its history points.
    History,
    /// What one of its history points changed.
    HistoryDiff {
        point: Ulid,
        query: HistoryDiffQuery,
    },
    /// Return its files to a history point.
    Rollback { req: RollbackRequest },
}

impl RunRequest {
    /// The operation's name, for logs and metrics.
    pub fn name(&self) -> &'static str {
        match self {
            RunRequest::Get => "get",
            RunRequest::Delete => "delete",
            RunRequest::Kill => "kill",
            RunRequest::Pause => "pause",
            RunRequest::Resume => "resume",
            RunRequest::Hibernate => "hibernate",
            RunRequest::Archive => "archive",
            RunRequest::Wake => "wake",
            RunRequest::Renew { .. } => "renew",
            RunRequest::UpdateEgress { .. } => "updateEgress",
            RunRequest::AcquireLease { .. } => "acquireLease",
            RunRequest::RenewLease { .. } => "renewLease",
            RunRequest::ReleaseLease { .. } => "releaseLease",
            RunRequest::Fork { .. } => "fork",
            RunRequest::Snapshot { .. } => "snapshot",
            RunRequest::Checkpoint { .. } => "checkpoint",
            RunRequest::WarmCommit { .. } => "warmCommit",
            RunRequest::WarmStatus => "warmStatus",
            RunRequest::StatPath { .. } => "statPath",
            RunRequest::ListPath { .. } => "listPath",
            RunRequest::MakeDir { .. } => "makeDir",
            RunRequest::MovePath { .. } => "movePath",
            RunRequest::RemovePath { .. } => "removePath",
            RunRequest::StartProcess { .. } => "startProcess",
            RunRequest::Processes => "processes",
            RunRequest::WaitProcess { .. } => "waitProcess",
            RunRequest::SignalProcess { .. } => "signalProcess",
            RunRequest::SendInput { .. } => "sendInput",
            RunRequest::ResizeProcess { .. } => "resizeProcess",
            RunRequest::MintPreview { .. } => "mintPreview",
            RunRequest::History => "history",
            RunRequest::HistoryDiff { .. } => "historyDiff",
            RunRequest::Rollback { .. } => "rollback",
        }
    }
}

/// The answer to a [`RunRequest`].
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(tag = "reply", content = "value", rename_all = "camelCase")]
pub enum RunReply {
    /// Done; nothing to say.
    Done,
    Run(Box<Run>),
    Lease(Lease),
    Fork(ForkResponse),
    Snapshot(Snapshot),
    Checkpoint(Checkpoint),
    WarmCommit(WarmCommit),
    WarmStatus(WarmStatus),
    FileInfo(FileInfo),
    FileList(FileList),
    Removed(RemoveReply),
    Process(Box<Process>),
    Processes(ProcessList),
    Preview(Preview),
    History(HistoryList),
    HistoryDiff(Box<HistoryDiff>),
}

/// A value a [`RunReply`] carries, taken out of it.
pub trait FromReply: Sized {
    /// The value, or an error when the reply carries another kind (an
    /// owner that answered the wrong question: a bug, never the client's).
    fn from_reply(reply: RunReply) -> Result<Self, CoreError>;
}

fn mismatch(reply: &RunReply) -> CoreError {
    CoreError::Store(format!(
        "a run's owner answered with {reply:?} where another kind of reply was due"
    ))
}

macro_rules! from_reply {
    ($($ty:ty => $variant:ident $(($wrap:ident))?),* $(,)?) => {$(
        impl FromReply for $ty {
            fn from_reply(reply: RunReply) -> Result<Self, CoreError> {
                match reply {
                    RunReply::$variant(value) => Ok(from_reply!(@unwrap value $($wrap)?)),
                    other => Err(mismatch(&other)),
                }
            }
        }
    )*};
    (@unwrap $value:ident Box) => { *$value };
    (@unwrap $value:ident) => { $value };
}

from_reply! {
    Run => Run(Box),
    Lease => Lease,
    ForkResponse => Fork,
    Snapshot => Snapshot,
    Checkpoint => Checkpoint,
    WarmCommit => WarmCommit,
    WarmStatus => WarmStatus,
    FileInfo => FileInfo,
    FileList => FileList,
    RemoveReply => Removed,
    Process => Process(Box),
    ProcessList => Processes,
    Preview => Preview,
    HistoryList => History,
    HistoryDiff => HistoryDiff(Box),
}

impl FromReply for () {
    fn from_reply(reply: RunReply) -> Result<(), CoreError> {
        match reply {
            RunReply::Done => Ok(()),
            other => Err(mismatch(&other)),
        }
    }
}

/// Whoever answers the requests addressed to the runs it owns. Object
/// safe: a node holds its owners as `dyn RunOwner`, this node's manager
/// among them.
#[async_trait]
pub trait RunOwner: Send + Sync {
    /// Answers `req` for run `id`.
    async fn call(&self, id: Ulid, req: RunRequest) -> Result<RunReply, CoreError>;
}

/// Waits for `call` and takes the answer's value out.
pub async fn ask<T: FromReply>(
    call: impl std::future::Future<Output = Result<RunReply, CoreError>>,
) -> Result<T, CoreError> {
    T::from_reply(call.await?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requests_and_replies_travel_as_json_and_come_back_the_same() {
        let requests = vec![
            RunRequest::Pause,
            RunRequest::Renew { ttl_sec: 60 },
            RunRequest::StatPath {
                scope: Scope::Root,
                path: Some("/etc".into()),
            },
            RunRequest::SendInput {
                process: "7".into(),
                credential: Some(("alice".into(), 3)),
                data: b"hi\n".to_vec(),
                close: true,
            },
            RunRequest::WaitProcess {
                process: "job".into(),
                limit_ms: 1500,
            },
        ];
        for req in requests {
            let json = serde_json::to_value(&req).unwrap();
            assert_eq!(json["op"], req.name(), "{json}");
            let back: RunRequest = serde_json::from_value(json.clone()).unwrap();
            assert_eq!(serde_json::to_value(&back).unwrap(), json);
        }
        let json = serde_json::to_value(RunReply::Done).unwrap();
        let back: RunReply = serde_json::from_value(json).unwrap();
        assert!(<()>::from_reply(back).is_ok());
    }

    #[test]
    fn a_reply_of_the_wrong_kind_is_an_error_not_a_panic() {
        let err = Run::from_reply(RunReply::Done).unwrap_err();
        assert_eq!(err.code(), runbox_types::ErrorCode::Internal);
    }
}
