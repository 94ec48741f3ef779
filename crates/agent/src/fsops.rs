//! Stat, ListDir, MakeDir, Move and Remove: file-system operations below the
//! work directory (or the run's root), confined exactly as the file RPCs
//! are. The operations are `runbox_confine::ops`; this module checks the
//! requests, resolves owners in the run's user database, and runs them off
//! the async workers.

use std::sync::Arc;

use runbox_agent_proto::pb::{
    FileInfo, ListDirReply, ListDirRequest, MakeDirRequest, MoveRequest, RemoveReply,
    RemoveRequest, StatRequest,
};
use runbox_confine::ops;
use tonic::Status;

use crate::confine::{FileError, WorkDir};
use crate::files::blocking;

/// Runs one Stat call.
pub async fn stat(work: Arc<WorkDir>, req: StatRequest) -> Result<FileInfo, Status> {
    let rel = work.parse_or_root(&req.path)?;
    Ok(blocking(move || ops::stat(&work, rel.as_ref(), &req.xattr_prefix)).await??)
}

/// Runs one ListDir call.
pub async fn list_dir(work: Arc<WorkDir>, req: ListDirRequest) -> Result<ListDirReply, Status> {
    let rel = work.parse_or_root(&req.path)?;
    Ok(blocking(move || {
        ops::list_dir(
            &work,
            rel.as_ref(),
            req.depth,
            req.limit as usize,
            &req.xattr_prefix,
        )
    })
    .await??)
}

/// Runs one MakeDir call: the directory and its missing parents.
pub async fn make_dir(work: Arc<WorkDir>, req: MakeDirRequest) -> Result<FileInfo, Status> {
    let rel = work.parse(&req.path)?;
    Ok(blocking(move || -> Result<FileInfo, FileError> {
        // Resolved before anything is made: an unknown owner changes nothing.
        let owner = crate::user::owner(&req.user)?;
        ops::make_dir(&work, &rel, req.mode, owner)
    })
    .await??)
}

/// Runs one Move call.
pub async fn move_path(work: Arc<WorkDir>, req: MoveRequest) -> Result<FileInfo, Status> {
    let from = work.parse(&req.from)?;
    let to = work.parse(&req.to)?;
    Ok(
        blocking(move || ops::move_path(&work, &from, &to, req.overwrite, &req.xattr_prefix))
            .await??,
    )
}

/// Runs one Remove call.
pub async fn remove(work: Arc<WorkDir>, req: RemoveRequest) -> Result<RemoveReply, Status> {
    let rel = work.parse(&req.path)?;
    let removed = blocking(move || ops::remove(&work, &rel, req.recursive)).await??;
    Ok(RemoveReply { removed })
}
