//! The one function that answers a [`RunRequest`] for a run of this node.

use std::sync::Arc;
use std::time::Duration;

use ulid::Ulid;

use super::Manager;
use crate::error::CoreError;
use crate::request::{RunOwner, RunReply, RunRequest};

impl Manager {
    /// Answers `req` for run `id`, as the typed methods of this manager
    /// do; file-system calls whose agent call fails as the run leaves
    /// `running` are told so ([`Manager::settled`]).
    pub async fn answer(
        self: &Arc<Self>,
        id: Ulid,
        req: RunRequest,
    ) -> Result<RunReply, CoreError> {
        use RunReply as A;
        use RunRequest as Q;
        let run = |run| A::Run(Box::new(run));
        Ok(match req {
            Q::Get => run(self.get(id)?),
            Q::Delete => {
                self.delete(id).await?;
                A::Done
            }
            Q::Kill => {
                self.kill(id).await?;
                A::Done
            }
            Q::Pause => run(self.pause(id).await?),
            Q::Resume => run(self.resume(id).await?),
            Q::Hibernate => run(self.hibernate(id).await?),
            Q::Archive => run(self.archive(id).await?),
            Q::Wake => run(self.wake(id).await?),
            Q::Renew { ttl_sec } => run(self.renew(id, ttl_sec).await?),
            Q::UpdateEgress { req } => run(self.update_egress(id, req).await?),
            Q::AcquireLease { req } => A::Lease(self.acquire_lease(id, req).await?),
            Q::RenewLease { req } => A::Lease(self.renew_lease(id, req).await?),
            Q::ReleaseLease { req } => {
                self.release_lease(id, req).await?;
                A::Done
            }
            Q::Fork { req } => A::Fork(self.fork(id, req).await?),
            Q::Snapshot { req } => A::Snapshot(self.snapshot(id, req).await?),
            Q::Checkpoint { req } => A::Checkpoint(self.checkpoint(id, req).await?),
            Q::WarmCommit { req } => A::WarmCommit(self.warm_commit(id, req).await?),
            Q::WarmStatus => A::WarmStatus(self.warm_status(id).await?),
            Q::StatPath { scope, path } => {
                let info = self.stat_path(id, scope, path.as_deref()).await;
                A::FileInfo(self.settled(id, info).await?)
            }
            Q::ListPath { scope, query } => {
                let list = self
                    .list_path(id, scope, query.path.as_deref(), query.depth, query.limit)
                    .await;
                A::FileList(self.settled(id, list).await?)
            }
            Q::MakeDir { scope, req, user } => {
                let made = self.make_dir(id, scope, req, user).await;
                A::FileInfo(self.settled(id, made).await?)
            }
            Q::MovePath { scope, req } => {
                let moved = self.move_path(id, scope, req).await;
                A::FileInfo(self.settled(id, moved).await?)
            }
            Q::RemovePath { scope, req } => {
                let removed = self.remove_path(id, scope, req).await;
                A::Removed(self.settled(id, removed).await?)
            }
            Q::StartProcess { req } => A::Process(Box::new(self.start_process(id, req).await?)),
            Q::Processes => A::Processes(self.processes(id).await?),
            Q::WaitProcess { process, limit_ms } => {
                let limit = Duration::from_millis(limit_ms);
                A::Process(Box::new(self.wait_process(id, &process, limit).await?))
            }
            Q::SignalProcess { process, req } => {
                A::Process(Box::new(self.signal_process(id, &process, req).await?))
            }
            Q::SendInput {
                process,
                credential,
                data,
                close,
            } => {
                let data = bytes::Bytes::from(data);
                let process = self
                    .send_input(id, &process, credential, data, close)
                    .await?;
                A::Process(Box::new(process))
            }
            Q::ResizeProcess {
                process,
                rows,
                cols,
            } => {
                self.resize_process(id, &process, rows, cols).await?;
                A::Done
            }
            Q::MintPreview { req } => A::Preview(self.mint_preview(id, req).await?),
            Q::History => A::History(self.history(id).await?),
            Q::HistoryDiff { point, query } => A::HistoryDiff(Box::new(
                self.history_diff(
                    id,
                    point,
                    query.against,
                    query.patch.unwrap_or(false),
                    query.limit.unwrap_or(super::history::DEFAULT_DIFF_PATHS),
                )
                .await?,
            )),
            Q::Rollback { req } => {
                let credential = crate::validate::credential(req.owner.as_deref(), req.generation)?;
                run(self.rollback(id, req.point, credential).await?)
            }
        })
    }
}

#[async_trait::async_trait]
impl RunOwner for Arc<Manager> {
    async fn call(&self, id: Ulid, req: RunRequest) -> Result<RunReply, CoreError> {
        self.answer(id, req).await
    }
}
