//! Stat, ListDir, MakeDir, Move and Remove: file-system operations below the
//! work directory, confined exactly as the file RPCs are.
//!
//! Every path is checked by [`RelPath`] and every lookup goes through
//! [`open_beneath`] (`openat2` with `RESOLVE_BENEATH`), so a symlink or `..`
//! that leaves the work directory is refused by the kernel. Below a resolved
//! directory, names are used relative to its descriptor and never followed:
//! a symlink is described, listed, renamed or removed as the link itself,
//! and a listing never enters one.

use std::os::fd::{AsFd, OwnedFd};

use runbox_agent_proto::pb::{
    FileInfo, FileKind, ListDirReply, ListDirRequest, MakeDirRequest, MoveRequest, RemoveReply,
    RemoveRequest, StatRequest,
};
use rustix::fs::{AtFlags, FileType, Mode, OFlags, RenameFlags};
use rustix::io::Errno;
use tonic::Status;

use crate::confine::{open_beneath, FileError, RelPath, Root, WorkDir};
use crate::files::{blocking, open_parent};

/// The most entries one listing returns.
pub const MAX_ENTRIES: usize = 10_000;

/// The deepest a listing goes.
pub const MAX_DEPTH: u32 = 16;

/// Mode of directories MakeDir creates when the request gives none.
const DIR_MODE: u32 = 0o755;

/// Describes the entry `name` of `dir` (not following a symlink).
fn info_at(
    dir: impl AsFd,
    name: &str,
    path: String,
    xattr_prefix: &str,
) -> Result<FileInfo, Errno> {
    let st = rustix::fs::statat(&dir, name, AtFlags::SYMLINK_NOFOLLOW)?;
    let file_type = FileType::from_raw_mode(st.st_mode);
    let xattrs = crate::xattrs::read(&dir, name, file_type, xattr_prefix)?;
    let symlink_target = if file_type == FileType::Symlink {
        rustix::fs::readlinkat(&dir, name, Vec::new())?
            .to_string_lossy()
            .into_owned()
    } else {
        String::new()
    };
    Ok(FileInfo {
        path,
        kind: kind_of(file_type) as i32,
        size: st.st_size as u64,
        mode: st.st_mode & 0o7777,
        uid: st.st_uid,
        gid: st.st_gid,
        modified_unix_ms: st.st_mtime * 1000 + (st.st_mtime_nsec / 1_000_000) as i64,
        symlink_target,
        xattrs,
    })
}

fn kind_of(file_type: FileType) -> FileKind {
    match file_type {
        FileType::RegularFile => FileKind::Regular,
        FileType::Directory => FileKind::Directory,
        FileType::Symlink => FileKind::Symlink,
        _ => FileKind::Other,
    }
}

/// The directory holding `rel` (its parents must exist).
fn parent_dir(root: &Root, rel: &RelPath) -> Result<OwnedFd, FileError> {
    let parents = rel.parents().join("/");
    let at = if parents.is_empty() { "." } else { &parents };
    open_beneath(root, at, OFlags::PATH | OFlags::DIRECTORY, Mode::empty()).map_err(|errno| {
        match errno {
            Errno::NOTDIR => FileError::NotADirectory {
                path: parents.clone(),
                target: rel.original().to_owned(),
            },
            other => FileError::from_errno(other, "open the directory of", rel.original()),
        }
    })
}

/// Runs one Stat call.
pub async fn stat(work: std::sync::Arc<WorkDir>, req: StatRequest) -> Result<FileInfo, Status> {
    let rel = work.parse_or_root(&req.path)?;
    Ok(blocking(move || -> Result<FileInfo, FileError> {
        let root = work.open()?;
        match &rel {
            None => info_at(&root, ".", String::new(), &req.xattr_prefix)
                .map_err(|e| FileError::from_errno(e, "stat", ".")),
            Some(rel) => {
                let dir = parent_dir(&root, rel)?;
                info_at(&dir, rel.file_name(), rel.normalized(), &req.xattr_prefix)
                    .map_err(|e| FileError::from_errno(e, "stat", rel.original()))
            }
        }
    })
    .await??)
}

/// Runs one ListDir call.
pub async fn list_dir(
    work: std::sync::Arc<WorkDir>,
    req: ListDirRequest,
) -> Result<ListDirReply, Status> {
    let rel = work.parse_or_root(&req.path)?;
    let depth = req.depth.clamp(1, MAX_DEPTH);
    let limit = match req.limit {
        0 => MAX_ENTRIES,
        n => (n as usize).min(MAX_ENTRIES),
    };
    Ok(blocking(move || -> Result<ListDirReply, FileError> {
        let root = work.open()?;
        let (path, prefix) = match &rel {
            None => (".".to_owned(), String::new()),
            Some(rel) => (rel.normalized(), rel.normalized()),
        };
        let original = rel.as_ref().map_or(".", |r| r.original()).to_owned();
        let dir = open_beneath(
            &root,
            &path,
            OFlags::RDONLY | OFlags::DIRECTORY,
            Mode::empty(),
        )
        .map_err(|errno| match errno {
            Errno::NOTDIR => FileError::NotADirectory {
                path: original.clone(),
                target: original.clone(),
            },
            other => FileError::from_errno(other, "list", &original),
        })?;
        let mut reply = ListDirReply::default();
        walk(&dir, &prefix, depth, limit, &req.xattr_prefix, &mut reply)
            .map_err(|e| FileError::from_errno(e, "list", &original))?;
        reply.entries.sort_by(|a, b| a.path.cmp(&b.path));
        Ok(reply)
    })
    .await??)
}

/// Lists `dir` (whose path is `prefix`) into `reply`, `depth` levels down.
fn walk(
    dir: &OwnedFd,
    prefix: &str,
    depth: u32,
    limit: usize,
    xattr_prefix: &str,
    reply: &mut ListDirReply,
) -> Result<(), Errno> {
    let mut names = Vec::new();
    for entry in rustix::fs::Dir::read_from(dir)? {
        let entry = entry?;
        let name = entry.file_name().to_string_lossy().into_owned();
        if name != "." && name != ".." {
            names.push(name);
        }
    }
    names.sort();
    for name in names {
        if reply.entries.len() >= limit {
            reply.truncated = true;
            return Ok(());
        }
        let path = if prefix.is_empty() {
            name.clone()
        } else {
            format!("{prefix}/{name}")
        };
        let info = match info_at(dir, &name, path.clone(), xattr_prefix) {
            Ok(info) => info,
            // Removed since the directory was read.
            Err(Errno::NOENT) => continue,
            Err(e) => return Err(e),
        };
        let is_dir = info.kind == FileKind::Directory as i32;
        reply.entries.push(info);
        if is_dir && depth > 1 {
            // NOFOLLOW: a directory swapped for a symlink since the stat is
            // refused, not entered.
            match rustix::fs::openat(
                dir,
                name.as_str(),
                OFlags::RDONLY | OFlags::DIRECTORY | OFlags::NOFOLLOW,
                Mode::empty(),
            ) {
                Ok(sub) => walk(&sub, &path, depth - 1, limit, xattr_prefix, reply)?,
                Err(Errno::NOENT | Errno::LOOP | Errno::NOTDIR | Errno::ACCESS) => {}
                Err(e) => return Err(e),
            }
        }
    }
    Ok(())
}

/// Runs one MakeDir call: the directory and its missing parents.
pub async fn make_dir(
    work: std::sync::Arc<WorkDir>,
    req: MakeDirRequest,
) -> Result<FileInfo, Status> {
    let rel = work.parse(&req.path)?;
    let mode = match req.mode & 0o7777 {
        0 => DIR_MODE,
        m => m,
    };
    Ok(blocking(move || -> Result<FileInfo, FileError> {
        // Resolved before anything is made: an unknown owner changes nothing.
        let owner = match req.user.as_str() {
            "" => None,
            spec => Some(crate::user::resolve(spec).map_err(FileError::BadUser)?),
        };
        let root = work.open()?;
        let dir = open_parent(&root, &rel, owner.as_ref())?;
        match rustix::fs::mkdirat(&dir, rel.file_name(), Mode::from_raw_mode(mode)) {
            Ok(()) => {
                let made = rustix::fs::openat(
                    &dir,
                    rel.file_name(),
                    OFlags::PATH | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC,
                    Mode::empty(),
                )
                .and_then(|made| crate::files::chown_made(&made, owner.as_ref()));
                made.map_err(|e| FileError::from_errno(e, "set the owner of", rel.original()))?;
            }
            Err(Errno::EXIST) => {}
            Err(e) => return Err(FileError::from_errno(e, "create", rel.original())),
        }
        let info = info_at(&dir, rel.file_name(), rel.normalized(), "")
            .map_err(|e| FileError::from_errno(e, "create", rel.original()))?;
        if info.kind != FileKind::Directory as i32 {
            return Err(FileError::NotADirectory {
                path: rel.normalized(),
                target: rel.original().to_owned(),
            });
        }
        Ok(info)
    })
    .await??)
}

/// Runs one Move call.
pub async fn move_path(
    work: std::sync::Arc<WorkDir>,
    req: MoveRequest,
) -> Result<FileInfo, Status> {
    let from = work.parse(&req.from)?;
    let to = work.parse(&req.to)?;
    Ok(blocking(move || -> Result<FileInfo, FileError> {
        let root = work.open()?;
        let from_dir = parent_dir(&root, &from)?;
        let to_dir = parent_dir(&root, &to)?;
        let flags = if req.overwrite {
            RenameFlags::empty()
        } else {
            RenameFlags::NOREPLACE
        };
        rustix::fs::renameat_with(&from_dir, from.file_name(), &to_dir, to.file_name(), flags)
            .map_err(|e| match e {
                Errno::EXIST => FileError::Exists {
                    path: to.original().to_owned(),
                },
                Errno::NOTEMPTY => FileError::NotEmpty {
                    path: to.original().to_owned(),
                },
                // Into itself, or a directory over a file (and back).
                Errno::INVAL | Errno::ISDIR | Errno::NOTDIR => FileError::InvalidPath {
                    path: to.original().to_owned(),
                    reason: "it cannot replace what is there (a directory into itself, or a directory and a file)",
                },
                other => FileError::from_errno(other, "move", from.original()),
            })?;
        info_at(&to_dir, to.file_name(), to.normalized(), &req.xattr_prefix)
            .map_err(|e| FileError::from_errno(e, "move", to.original()))
    })
    .await??)
}

/// Runs one Remove call.
pub async fn remove(
    work: std::sync::Arc<WorkDir>,
    req: RemoveRequest,
) -> Result<RemoveReply, Status> {
    let rel = work.parse(&req.path)?;
    Ok(blocking(move || -> Result<RemoveReply, FileError> {
        let root = work.open()?;
        let dir = parent_dir(&root, &rel)?;
        let name = rel.file_name();
        let st = rustix::fs::statat(&dir, name, AtFlags::SYMLINK_NOFOLLOW)
            .map_err(|e| FileError::from_errno(e, "remove", rel.original()))?;
        let removed = if FileType::from_raw_mode(st.st_mode) == FileType::Directory {
            let mut removed = 0;
            if req.recursive {
                let sub = rustix::fs::openat(
                    &dir,
                    name,
                    OFlags::RDONLY | OFlags::DIRECTORY | OFlags::NOFOLLOW,
                    Mode::empty(),
                )
                .map_err(|e| FileError::from_errno(e, "remove", rel.original()))?;
                removed += empty_dir(&sub)
                    .map_err(|e| FileError::from_errno(e, "remove", rel.original()))?;
            }
            rustix::fs::unlinkat(&dir, name, AtFlags::REMOVEDIR).map_err(|e| match e {
                Errno::NOTEMPTY | Errno::EXIST => FileError::NotEmpty {
                    path: rel.original().to_owned(),
                },
                other => FileError::from_errno(other, "remove", rel.original()),
            })?;
            removed + 1
        } else {
            rustix::fs::unlinkat(&dir, name, AtFlags::empty())
                .map_err(|e| FileError::from_errno(e, "remove", rel.original()))?;
            1
        };
        Ok(RemoveReply { removed })
    })
    .await??)
}

/// Removes everything in `dir`, never following a symlink; the count.
fn empty_dir(dir: &OwnedFd) -> Result<u64, Errno> {
    let mut removed = 0;
    let mut names = Vec::new();
    for entry in rustix::fs::Dir::read_from(dir)? {
        let entry = entry?;
        let name = entry.file_name().to_string_lossy().into_owned();
        if name != "." && name != ".." {
            names.push((name, entry.file_type()));
        }
    }
    for (name, file_type) in names {
        let is_dir = match file_type {
            FileType::Directory => true,
            FileType::Unknown => rustix::fs::statat(dir, name.as_str(), AtFlags::SYMLINK_NOFOLLOW)
                .map(|st| FileType::from_raw_mode(st.st_mode) == FileType::Directory)?,
            _ => false,
        };
        if is_dir {
            match rustix::fs::openat(
                dir,
                name.as_str(),
                OFlags::RDONLY | OFlags::DIRECTORY | OFlags::NOFOLLOW,
                Mode::empty(),
            ) {
                Ok(sub) => removed += empty_dir(&sub)?,
                Err(Errno::NOENT) => continue,
                Err(e) => return Err(e),
            }
            match rustix::fs::unlinkat(dir, name.as_str(), AtFlags::REMOVEDIR) {
                Ok(()) | Err(Errno::NOENT) => removed += 1,
                Err(e) => return Err(e),
            }
        } else {
            match rustix::fs::unlinkat(dir, name.as_str(), AtFlags::empty()) {
                Ok(()) | Err(Errno::NOENT) => removed += 1,
                Err(e) => return Err(e),
            }
        }
    }
    Ok(removed)
}
