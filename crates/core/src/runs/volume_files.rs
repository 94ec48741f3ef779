//! File operations on a volume without a run: seeding a dataset before
//! the runs that read it, collecting what a run left after it is gone.
//!
//! The daemon works on the volume's directory on the host, confined the
//! way the agent confines a run's `/work` (`runbox_confine`: the kernel
//! resolves every path beneath the volume, so a symlink a run planted
//! cannot lead the daemon, which is root on the host, anywhere else).
//! Paths are from the volume's top (`data/a.csv` and `/data/a.csv` are the
//! same file) and are shown as `/data/a.csv`.
//!
//! Reads go on whoever holds the volume. A write is a writer like a run
//! mounting it `rw`: it is refused while any run holds the volume, and a
//! run asking to mount it is refused while a write is under way (both
//! decided by the ledger, in one step each). Files are stored with the ids runs
//! see; what the API makes is owned by the run's root unless the call
//! names other ids.

use std::sync::Arc;

use bytes::Bytes;
use futures::{Stream, StreamExt};
use runbox_agent_proto::pb;
use runbox_confine::ops::{self, NewFile, Owner};
use runbox_confine::{FileError, RelPath, WorkDir};
use runbox_types::{ErrorCode, FileInfo, FileList, RemoveReply};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use ulid::Ulid;

use super::fs::{info, list_bounds, Scope};
use super::relay::{file_code, FileDownload};
use super::Manager;
use crate::error::CoreError;

/// Chunk size of a volume file read.
const READ_CHUNK: usize = 256 * 1024;

/// One call writing a volume; the volume is free of it when this drops
/// (whether the call finished, failed or its client went away).
struct WriteGuard {
    ledger: Arc<dyn crate::ledger::Ledger>,
    id: Ulid,
}

impl std::fmt::Debug for WriteGuard {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WriteGuard").field("id", &self.id).finish()
    }
}

impl Drop for WriteGuard {
    fn drop(&mut self) {
        self.ledger.end_write(self.id);
    }
}

/// Which volume a file call is for.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum VolumeKey {
    /// By name, among the caller's.
    Name(String),
    /// By id (E2B's surface names volumes so).
    Id(Ulid),
}

/// How a file is written into a volume.
#[derive(Clone, Copy, Debug, Default)]
pub struct VolumeWrite {
    /// Permission bits (0o777 at most; None: 0o644).
    pub mode: Option<u32>,
    /// Owner ids (user, group) of the file and the directories the write
    /// makes, as runs see them; None: root.
    pub owner: Option<(u32, u32)>,
    /// Replace an existing file (false: `409 file_exists`).
    pub replace: bool,
    /// The body's declared length, checked before a byte is read.
    pub content_length: Option<u64>,
}

/// A volume's files, reached for one call (see the module doc).
#[derive(Debug)]
pub struct VolumeFiles {
    work: Arc<WorkDir>,
    name: String,
    max_upload: u64,
    /// Held by calls that write.
    writing: Option<WriteGuard>,
}

/// A volume file call's failure as the API says it: a full volume is
/// `507 volume_full`, the rest as the run file API says them.
fn volume_error(name: &str, err: FileError) -> CoreError {
    if let FileError::Io { source, .. } = &err {
        if full(source) {
            return full_error(name);
        }
    }
    match file_code(err.kind()) {
        Some(code) => CoreError::invalid(code, err.to_string()),
        None => {
            let context = err.to_string();
            let source = match err {
                FileError::Io { source, .. } => source,
                other => std::io::Error::other(other.to_string()),
            };
            CoreError::Io { context, source }
        }
    }
}

fn full(e: &std::io::Error) -> bool {
    matches!(
        rustix::io::Errno::from_io_error(e),
        Some(rustix::io::Errno::DQUOT | rustix::io::Errno::NOSPC)
    )
}

fn full_error(name: &str) -> CoreError {
    CoreError::invalid(
        ErrorCode::VolumeFull,
        format!(
            "volume {name:?} is full (its sizeMb); remove files from it, or clone it into a larger one"
        ),
    )
}

/// Runs blocking file work off the async workers.
async fn blocking<T: Send + 'static>(
    work: impl FnOnce() -> Result<T, CoreError> + Send + 'static,
) -> Result<T, CoreError> {
    tokio::task::spawn_blocking(work)
        .await
        .map_err(|e| CoreError::Io {
            context: "a volume file operation did not finish".into(),
            source: std::io::Error::other(e.to_string()),
        })?
}

impl Manager {
    /// The caller's volume `key` names, for file operations; with `write`,
    /// the call is a writer (refused while a run holds the volume, and
    /// holding off runs that would mount it until the result is dropped).
    /// By name the volume is looked up among `tenant`'s (None: the
    /// operator's); by id a tenant reaches its own, the operator any.
    pub async fn volume_files(
        &self,
        key: &VolumeKey,
        tenant: Option<&str>,
        write: bool,
    ) -> Result<VolumeFiles, CoreError> {
        let record = match key {
            VolumeKey::Name(name) => {
                crate::volumes::check_name(name)?;
                self.volumes.find(tenant, name)
            }
            VolumeKey::Id(id) => self
                .volumes
                .get(*id)
                .filter(|v| tenant.is_none() || v.tenant.as_deref() == tenant),
        };
        let record = record.ok_or_else(|| match key {
            VolumeKey::Name(name) => super::volumes::not_found(name),
            VolumeKey::Id(id) => {
                CoreError::invalid(ErrorCode::VolumeNotFound, format!("no volume with id {id}"))
            }
        })?;
        let name = record.name.as_str();
        let dir = self.lane.volume_dir(record.id).ok_or_else(|| {
            CoreError::invalid(
                ErrorCode::VolumesUnsupported,
                "this server's runs keep volumes where the daemon cannot reach their files; use a run that mounts the volume",
            )
        })?;
        let writing = if write {
            self.context.ledger.write_volume(record.id, name).await?;
            Some(WriteGuard {
                ledger: self.context.ledger.clone(),
                id: record.id,
            })
        } else {
            None
        };
        Ok(VolumeFiles {
            work: Arc::new(WorkDir::new(dir)),
            name: record.name,
            max_upload: self.config().max_upload_bytes,
            writing,
        })
    }
}

impl VolumeFiles {
    /// A path from the volume's top (a leading `/` or not); None: the top.
    fn parse(&self, path: &str) -> Result<Option<RelPath>, CoreError> {
        let relative = path.trim_start_matches('/');
        if relative.is_empty() {
            return Ok(None);
        }
        self.work
            .parse_or_root(relative)
            .map_err(|e| volume_error(&self.name, e))
    }

    /// A path that must name something inside the volume (not its top).
    fn parse_inside(&self, path: &str) -> Result<RelPath, CoreError> {
        self.parse(path)?.ok_or_else(|| {
            CoreError::invalid(
                ErrorCode::BadPath,
                format!("{path:?} names the volume's top directory; name a file inside it"),
            )
        })
    }

    /// Refuses a write through a handle taken for reading (a programming
    /// error of the caller, never the client's).
    fn writable(&self) -> Result<(), CoreError> {
        match self.writing {
            Some(_) => Ok(()),
            None => Err(CoreError::Io {
                context: "a volume write through a handle taken for reading".into(),
                source: std::io::Error::other("not writable"),
            }),
        }
    }

    /// Runs `op` on the volume's directory off the async workers.
    async fn run<T: Send + 'static>(
        &self,
        op: impl FnOnce(&WorkDir) -> Result<T, FileError> + Send + 'static,
    ) -> Result<T, CoreError> {
        let work = self.work.clone();
        let name = self.name.clone();
        blocking(move || op(&work).map_err(|e| volume_error(&name, e))).await
    }

    /// Describes `path` (the top: `/`) without following a symlink.
    pub async fn stat(&self, path: &str) -> Result<FileInfo, CoreError> {
        let rel = self.parse(path)?;
        let raw = self.run(move |w| ops::stat(w, rel.as_ref(), "")).await?;
        shown(raw)
    }

    /// Lists `path`, `depth` levels down, at most `limit` entries.
    pub async fn list(
        &self,
        path: &str,
        depth: Option<u32>,
        limit: Option<u32>,
    ) -> Result<FileList, CoreError> {
        let (depth, limit) = list_bounds(depth, limit)?;
        let rel = self.parse(path)?;
        let reply = self
            .run(move |w| ops::list_dir(w, rel.as_ref(), depth, limit as usize, ""))
            .await?;
        let entries = reply
            .entries
            .into_iter()
            .map(shown)
            .collect::<Result<Vec<_>, _>>()?;
        Ok(FileList {
            entries,
            truncated: reply.truncated,
        })
    }

    /// Makes directory `path` and its missing parents.
    pub async fn make_dir(
        &self,
        path: &str,
        mode: Option<u32>,
        owner: Option<(u32, u32)>,
    ) -> Result<FileInfo, CoreError> {
        self.writable()?;
        let mode = check_mode(mode, 0o7777)?;
        let rel = self.parse_inside(path)?;
        let raw = self
            .run(move |w| ops::make_dir(w, &rel, mode, owner.map(to_owner)))
            .await?;
        shown(raw)
    }

    /// Renames `from` to `to` (replacing what is there only with
    /// `overwrite`).
    pub async fn move_path(
        &self,
        from: &str,
        to: &str,
        overwrite: bool,
    ) -> Result<FileInfo, CoreError> {
        self.writable()?;
        let from = self.parse_inside(from)?;
        let to = self.parse_inside(to)?;
        let raw = self
            .run(move |w| ops::move_path(w, &from, &to, overwrite, ""))
            .await?;
        shown(raw)
    }

    /// Changes the owner (ids as runs see them) and/or the permission bits
    /// (at most 0o7777) of `path` (the top: `/`), a file or a directory.
    pub async fn set_attrs(
        &self,
        path: &str,
        owner: Option<(u32, u32)>,
        mode: Option<u32>,
    ) -> Result<FileInfo, CoreError> {
        self.writable()?;
        if let Some(m) = mode {
            check_mode(Some(m), 0o7777)?;
        }
        let rel = self.parse(path)?;
        let raw = self
            .run(move |w| ops::set_attrs(w, rel.as_ref(), owner.map(to_owner), mode))
            .await?;
        shown(raw)
    }

    /// Removes `path` (a directory with what it holds only if `recursive`).
    pub async fn remove(&self, path: &str, recursive: bool) -> Result<RemoveReply, CoreError> {
        self.writable()?;
        let rel = self.parse_inside(path)?;
        let removed = self.run(move |w| ops::remove(w, &rel, recursive)).await?;
        Ok(RemoveReply { removed })
    }

    /// Writes `body` to `path` (making missing parents): into a temporary
    /// file beside it, flushed to disk, then renamed over it, so a reader
    /// or a crash sees the old file or the whole new one. A body that
    /// breaks off, a full volume, or a client that goes away leaves the
    /// old file as it was.
    pub async fn write<S, E>(
        &self,
        path: &str,
        options: VolumeWrite,
        body: S,
    ) -> Result<FileInfo, CoreError>
    where
        S: Stream<Item = Result<Bytes, E>> + Send,
        E: std::fmt::Display,
    {
        self.writable()?;
        let mode = check_mode(options.mode, 0o777)?;
        let rel = self.parse_inside(path)?;
        let too_large = || {
            CoreError::invalid(
                ErrorCode::TooLarge,
                format!(
                    "a file upload takes at most {} bytes (--max-upload-bytes)",
                    self.max_upload
                ),
            )
        };
        if options.content_length.is_some_and(|n| n > self.max_upload) {
            return Err(too_large());
        }
        let owner = options.owner.map(to_owner);
        let (temp, file) = {
            let rel = rel.clone();
            let new = move |w: &WorkDir| {
                let new = NewFile {
                    mode,
                    owner,
                    xattrs: None,
                };
                ops::create_temp(w, &rel, new)
            };
            self.run(new).await?
        };
        let mut file = tokio::fs::File::from_std(file);
        let name = self.name.clone();
        let write_error = |e: std::io::Error| {
            if full(&e) {
                full_error(&name)
            } else {
                CoreError::io(format!("writing {path:?} into volume {name:?}"))(e)
            }
        };
        let mut written: u64 = 0;
        let mut body = std::pin::pin!(body);
        while let Some(chunk) = body.next().await {
            let chunk = chunk.map_err(|e| {
                CoreError::invalid(
                    ErrorCode::BadRequest,
                    format!("the upload broke off ({e}); nothing was written"),
                )
            })?;
            written += chunk.len() as u64;
            if written > self.max_upload {
                return Err(too_large());
            }
            file.write_all(&chunk).await.map_err(write_error)?;
        }
        if let Some(declared) = options.content_length {
            if declared != written {
                return Err(CoreError::invalid(
                    ErrorCode::BadRequest,
                    format!("the body held {written} bytes, not the {declared} its Content-Length declared; nothing was written"),
                ));
            }
        }
        // On disk before the rename publishes it: a volume's data is meant
        // to outlive a crash of the host.
        file.flush().await.map_err(write_error)?;
        file.sync_all().await.map_err(write_error)?;
        drop(file);
        let replace = options.replace;
        let raw = self
            .run(move |w| {
                temp.commit(&rel, replace)?;
                ops::stat(w, Some(&rel), "")
            })
            .await?;
        shown(raw)
    }

    /// Opens `path` for reading: its size and a stream of exactly that many
    /// bytes (or an error, when the file shrinks meanwhile).
    pub async fn read(&self, path: &str) -> Result<FileDownload, CoreError> {
        let rel = self.parse_inside(path)?;
        let shown_path = path.to_owned();
        let (file, size, _mode) = self.run(move |w| ops::open_for_read(w, &rel)).await?;
        let file = tokio::fs::File::from_std(file);
        let body = futures::stream::try_unfold(
            (file, size, shown_path),
            |(mut file, remaining, path)| async move {
                if remaining == 0 {
                    return Ok(None);
                }
                let want = remaining.min(READ_CHUNK as u64) as usize;
                let mut buf = vec![0u8; want];
                let n = file
                    .read(&mut buf)
                    .await
                    .map_err(CoreError::io(format!("reading {path:?}")))?;
                if n == 0 {
                    return Err(CoreError::invalid(
                        ErrorCode::BadRequest,
                        format!("{path:?} shrank while it was being read; read it again"),
                    ));
                }
                buf.truncate(n);
                Ok(Some((Bytes::from(buf), (file, remaining - n as u64, path))))
            },
        );
        Ok(FileDownload {
            size,
            body: Box::pin(body),
        })
    }
}

/// Checks permission bits against `max` (0o777 for files, 0o7777 for
/// directories); None is 0 (the default mode).
fn check_mode(mode: Option<u32>, max: u32) -> Result<u32, CoreError> {
    match mode {
        None => Ok(0),
        Some(m) if m <= max => Ok(m),
        Some(_) => Err(CoreError::invalid(
            ErrorCode::BadRequest,
            format!("mode must be permission bits, at most {max:#o} ({max})"),
        )),
    }
}

fn to_owner((uid, gid): (u32, u32)) -> Owner {
    Owner { uid, gid }
}

/// A description as the API shows it: from the volume's top, as `/a/b`
/// (the root scope's form), without metadata.
fn shown(raw: pb::FileInfo) -> Result<FileInfo, CoreError> {
    info(Scope::Root, raw)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_full_volume_is_its_own_error() {
        let err = volume_error(
            "data",
            FileError::from_errno(rustix::io::Errno::DQUOT, "write", "x"),
        );
        assert_eq!(err.code(), ErrorCode::VolumeFull);
        let err = volume_error(
            "data",
            FileError::from_errno(rustix::io::Errno::NOENT, "read", "x"),
        );
        assert_eq!(err.code(), ErrorCode::FileNotFound);
    }

    #[test]
    fn modes_are_permission_bits() {
        assert_eq!(check_mode(None, 0o777).unwrap(), 0);
        assert_eq!(check_mode(Some(0o640), 0o777).unwrap(), 0o640);
        assert!(check_mode(Some(0o4755), 0o777).is_err());
        assert!(check_mode(Some(0o4755), 0o7777).is_ok());
    }
}
