//! The file operations themselves, below a [`WorkDir`]: stat, list, mkdir,
//! move, remove, and the disk halves of writing a file (a temporary file
//! beside the target, renamed over it) and of reading one.
//!
//! Every path is checked by [`RelPath`] and every lookup goes through
//! [`open_beneath`] (`openat2` with `RESOLVE_BENEATH`), so a symlink or `..`
//! that leaves the directory is refused by the kernel. Below a resolved
//! directory, names are used relative to its descriptor and never followed:
//! a symlink is described, listed, renamed or removed as the link itself,
//! and a listing never enters one.
//!
//! All of it blocks: callers run it off their async workers.

use std::collections::HashMap;
use std::fs::File;
use std::hash::{BuildHasher, Hasher};
use std::os::fd::{AsFd, OwnedFd};
use std::sync::atomic::{AtomicU64, Ordering};

use runbox_agent_proto::pb::{FileInfo, FileKind, ListDirReply};
use rustix::fs::{AtFlags, FileType, Mode, OFlags, RenameFlags};
use rustix::io::Errno;

use crate::{open_beneath, FileError, RelPath, Root, WorkDir};

/// The most entries one listing returns.
pub const MAX_ENTRIES: usize = 10_000;

/// The deepest a listing goes.
pub const MAX_DEPTH: u32 = 16;

/// Mode of directories made when the caller gives none, and of missing
/// parents (before the umask).
pub const DIR_MODE: u32 = 0o755;

/// Mode of a written file when the caller gives none.
pub const DEFAULT_FILE_MODE: u32 = 0o644;

/// Prefix of temporary upload files; the random suffix follows.
const TEMP_PREFIX: &str = runbox_agent_proto::UPLOAD_TEMP_PREFIX;

/// Attempts at finding an unused temporary name; only a writer that
/// pre-creates names on purpose can make more than one necessary.
const TEMP_ATTEMPTS: usize = 16;

/// The most a file that reports no size is read for (pseudo-files of
/// /proc and /sys are a few KiB).
pub const MAX_UNSIZED: u64 = 1 << 20;

/// Who owns what an operation makes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Owner {
    /// The numeric user id.
    pub uid: u32,
    /// The numeric group id.
    pub gid: u32,
}

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

/// Describes `rel` (None: the directory itself) without following a
/// symlink, with the extended attributes under `xattr_prefix`.
pub fn stat(
    work: &WorkDir,
    rel: Option<&RelPath>,
    xattr_prefix: &str,
) -> Result<FileInfo, FileError> {
    let root = work.open()?;
    match rel {
        None => info_at(&root, ".", String::new(), xattr_prefix)
            .map_err(|e| FileError::from_errno(e, "stat", ".")),
        Some(rel) => {
            let dir = parent_dir(&root, rel)?;
            info_at(&dir, rel.file_name(), rel.normalized(), xattr_prefix)
                .map_err(|e| FileError::from_errno(e, "stat", rel.original()))
        }
    }
}

/// Lists `rel` (None: the directory itself) `depth` levels down (clamped
/// to 1..=[`MAX_DEPTH`]), at most `limit` entries (0 or more than
/// [`MAX_ENTRIES`]: that maximum), sorted by path.
pub fn list_dir(
    work: &WorkDir,
    rel: Option<&RelPath>,
    depth: u32,
    limit: usize,
    xattr_prefix: &str,
) -> Result<ListDirReply, FileError> {
    let depth = depth.clamp(1, MAX_DEPTH);
    let limit = match limit {
        0 => MAX_ENTRIES,
        n => n.min(MAX_ENTRIES),
    };
    let root = work.open()?;
    let (path, prefix) = match rel {
        None => (".".to_owned(), String::new()),
        Some(rel) => (rel.normalized(), rel.normalized()),
    };
    let original = rel.map_or(".", |r| r.original()).to_owned();
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
    walk(&dir, &prefix, depth, limit, xattr_prefix, &mut reply)
        .map_err(|e| FileError::from_errno(e, "list", &original))?;
    reply.entries.sort_by(|a, b| a.path.cmp(&b.path));
    Ok(reply)
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

/// Makes the directory `rel` and its missing parents (mode 0: [`DIR_MODE`]);
/// what this call makes goes to `owner`. An existing directory is fine.
pub fn make_dir(
    work: &WorkDir,
    rel: &RelPath,
    mode: u32,
    owner: Option<Owner>,
) -> Result<FileInfo, FileError> {
    let mode = match mode & 0o7777 {
        0 => DIR_MODE,
        m => m,
    };
    let root = work.open()?;
    let dir = open_parent(&root, rel, owner)?;
    match rustix::fs::mkdirat(&dir, rel.file_name(), Mode::from_raw_mode(mode)) {
        Ok(()) => {
            let made = rustix::fs::openat(
                &dir,
                rel.file_name(),
                OFlags::PATH | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC,
                Mode::empty(),
            )
            .and_then(|made| chown_made(&made, owner));
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
}

/// Renames `from` to `to`; without `overwrite` an existing `to` is refused.
pub fn move_path(
    work: &WorkDir,
    from: &RelPath,
    to: &RelPath,
    overwrite: bool,
    xattr_prefix: &str,
) -> Result<FileInfo, FileError> {
    let root = work.open()?;
    let from_dir = parent_dir(&root, from)?;
    let to_dir = parent_dir(&root, to)?;
    let flags = if overwrite {
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
    info_at(&to_dir, to.file_name(), to.normalized(), xattr_prefix)
        .map_err(|e| FileError::from_errno(e, "move", to.original()))
}

/// Changes the owner and/or permission bits of `rel`, a regular file or a
/// directory (a symlink is refused, never followed: `NotAFile`).
pub fn set_attrs(
    work: &WorkDir,
    rel: Option<&RelPath>,
    owner: Option<Owner>,
    mode: Option<u32>,
) -> Result<FileInfo, FileError> {
    let root = work.open()?;
    let (path, original) = match rel {
        None => (".".to_owned(), "."),
        Some(rel) => (rel.normalized(), rel.original()),
    };
    // O_NONBLOCK and O_NOCTTY as for reads; O_NOFOLLOW so a symlink at the
    // name is refused (ELOOP) rather than changed through.
    let fd = open_beneath(
        &root,
        &path,
        OFlags::RDONLY | OFlags::NONBLOCK | OFlags::NOCTTY | OFlags::NOFOLLOW,
        Mode::empty(),
    )
    .map_err(|errno| match errno {
        Errno::LOOP => FileError::NotAFile {
            path: original.to_owned(),
            what: "a symlink",
        },
        other => FileError::from_errno(other, "open", original),
    })?;
    let stat =
        rustix::fs::fstat(&fd).map_err(|errno| FileError::from_errno(errno, "stat", original))?;
    let file_type = FileType::from_raw_mode(stat.st_mode);
    if !matches!(file_type, FileType::RegularFile | FileType::Directory) {
        return Err(FileError::NotAFile {
            path: original.to_owned(),
            what: describe(file_type),
        });
    }
    if let Some(owner) = owner {
        rustix::fs::fchown(
            &fd,
            Some(rustix::process::Uid::from_raw(owner.uid)),
            Some(rustix::process::Gid::from_raw(owner.gid)),
        )
        .map_err(|errno| FileError::from_errno(errno, "set the owner of", original))?;
    }
    if let Some(mode) = mode {
        // After the chown, which clears set-id bits.
        rustix::fs::fchmod(&fd, Mode::from_raw_mode(mode & 0o7777))
            .map_err(|errno| FileError::from_errno(errno, "set the mode of", original))?;
    }
    match rel {
        None => info_at(&root, ".", String::new(), ""),
        Some(rel) => {
            let dir = parent_dir(&root, rel)?;
            info_at(&dir, rel.file_name(), rel.normalized(), "")
        }
    }
    .map_err(|e| FileError::from_errno(e, "stat", original))
}

/// Removes `rel` (a directory with what it holds only if `recursive`);
/// how many entries went.
pub fn remove(work: &WorkDir, rel: &RelPath, recursive: bool) -> Result<u64, FileError> {
    let root = work.open()?;
    let dir = parent_dir(&root, rel)?;
    let name = rel.file_name();
    let st = rustix::fs::statat(&dir, name, AtFlags::SYMLINK_NOFOLLOW)
        .map_err(|e| FileError::from_errno(e, "remove", rel.original()))?;
    if FileType::from_raw_mode(st.st_mode) != FileType::Directory {
        rustix::fs::unlinkat(&dir, name, AtFlags::empty())
            .map_err(|e| FileError::from_errno(e, "remove", rel.original()))?;
        return Ok(1);
    }
    let mut removed = 0;
    if recursive {
        let sub = rustix::fs::openat(
            &dir,
            name,
            OFlags::RDONLY | OFlags::DIRECTORY | OFlags::NOFOLLOW,
            Mode::empty(),
        )
        .map_err(|e| FileError::from_errno(e, "remove", rel.original()))?;
        removed +=
            empty_dir(&sub).map_err(|e| FileError::from_errno(e, "remove", rel.original()))?;
    }
    rustix::fs::unlinkat(&dir, name, AtFlags::REMOVEDIR).map_err(|e| match e {
        Errno::NOTEMPTY | Errno::EXIST => FileError::NotEmpty {
            path: rel.original().to_owned(),
        },
        other => FileError::from_errno(other, "remove", rel.original()),
    })?;
    Ok(removed + 1)
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

/// Opens `rel` for reading and returns it with its size and permission bits.
pub fn open_for_read(work: &WorkDir, rel: &RelPath) -> Result<(File, u64, u32), FileError> {
    let root = work.open()?;
    // O_NONBLOCK: opening a FIFO for reading would otherwise wait for a
    // writer, letting the sandbox hang the call; it has no effect on the
    // regular files that are actually read. O_NOCTTY: a terminal device
    // must not become our controlling terminal.
    let fd = open_beneath(
        &root,
        &rel.normalized(),
        OFlags::RDONLY | OFlags::NONBLOCK | OFlags::NOCTTY,
        Mode::empty(),
    )
    .map_err(|errno| FileError::from_errno(errno, "open", rel.original()))?;
    let stat = rustix::fs::fstat(&fd)
        .map_err(|errno| FileError::from_errno(errno, "stat", rel.original()))?;
    let file_type = FileType::from_raw_mode(stat.st_mode);
    if file_type != FileType::RegularFile {
        return Err(FileError::NotAFile {
            path: rel.original().to_owned(),
            what: describe(file_type),
        });
    }
    // st_size of a regular file is never negative.
    Ok((File::from(fd), stat.st_size as u64, stat.st_mode & 0o7777))
}

/// Reads a file whose size says 0 to its end, up to [`MAX_UNSIZED`].
pub fn read_unsized(file: File, rel: &RelPath) -> Result<Vec<u8>, FileError> {
    use std::io::Read as _;
    let mut contents = Vec::new();
    file.take(MAX_UNSIZED + 1)
        .read_to_end(&mut contents)
        .map_err(|source| FileError::Io {
            op: "read",
            path: rel.original().to_owned(),
            source,
        })?;
    if contents.len() as u64 > MAX_UNSIZED {
        return Err(FileError::Io {
            op: "read",
            path: rel.original().to_owned(),
            source: std::io::Error::other(format!(
                "it reports no size and holds more than {MAX_UNSIZED} bytes"
            )),
        });
    }
    Ok(contents)
}

/// A temporary upload file that leaves nothing behind unless committed.
///
/// Where the filesystem can, it has no name at all (`O_TMPFILE`): a writer
/// that dies mid-write (the daemon killed during a volume upload, say)
/// leaves only an unlinked inode, which the kernel frees, and never a
/// `.runbox-upload-...` entry that listings, quotas and clones would see.
/// [`TempFile::commit`] links it under such a name and at once renames it
/// into place. Elsewhere (a filesystem
/// without `O_TMPFILE`, or no `/proc` to link through) it is a dot-named
/// file beside the target that `Drop` unlinks.
#[derive(Debug)]
pub struct TempFile {
    /// The directory that holds both the temporary file and the target.
    parent: OwnedFd,
    temp: Temp,
    committed: bool,
}

#[derive(Debug)]
enum Temp {
    /// An `O_TMPFILE` inode, by a descriptor of its own.
    Unnamed(OwnedFd),
    /// A file named in `parent`.
    Named(String),
}

impl TempFile {
    /// Puts the temporary file at the target name; with `replace` false
    /// an existing target is refused (`Exists`) and left alone.
    pub fn commit(mut self, rel: &RelPath, replace: bool) -> Result<(), FileError> {
        let named = match &self.temp {
            Temp::Named(name) => name.clone(),
            Temp::Unnamed(fd) => {
                // Linked through /proc (`AT_EMPTY_PATH` needs a
                // capability a run's agent may not have).
                let path = format!("/proc/self/fd/{}", std::os::fd::AsRawFd::as_raw_fd(fd));
                let link = |name: &str| {
                    rustix::fs::linkat(
                        rustix::fs::CWD,
                        path.as_str(),
                        &self.parent,
                        name,
                        AtFlags::SYMLINK_FOLLOW,
                    )
                };
                // The file gets a name of its own for as long as the rename
                // into place takes (two system calls, once every byte is
                // written), so the target appears as every upload's always
                // has: renamed into place whole, which watchers (and E2B's
                // envd clients) see as one event.
                let name = (0..TEMP_ATTEMPTS)
                    .map(|_| format!("{TEMP_PREFIX}{:016x}", random_u64()))
                    .find_map(|name| match link(&name) {
                        Ok(()) => Some(Ok(name)),
                        Err(Errno::EXIST) => None,
                        Err(errno) => Some(Err(errno)),
                    })
                    .unwrap_or(Err(Errno::EXIST))
                    .map_err(|e| FileError::from_errno(e, "link into", rel.original()))?;
                self.temp = Temp::Named(name.clone());
                name
            }
        };
        let flags = if replace {
            RenameFlags::empty()
        } else {
            RenameFlags::NOREPLACE
        };
        rustix::fs::renameat_with(
            &self.parent,
            named.as_str(),
            &self.parent,
            rel.file_name(),
            flags,
        )
        .map_err(|errno| commit_error(errno, rel, replace))?;
        self.committed = true;
        Ok(())
    }
}

/// What a failed link or rename onto the target means for the caller.
fn commit_error(errno: Errno, rel: &RelPath, replace: bool) -> FileError {
    match errno {
        Errno::EXIST if !replace => FileError::Exists {
            path: rel.original().to_owned(),
        },
        // The target became a directory after the early check.
        Errno::ISDIR | Errno::NOTEMPTY | Errno::EXIST => FileError::NotAFile {
            path: rel.original().to_owned(),
            what: "a directory",
        },
        other => FileError::from_errno(other, "rename into", rel.original()),
    }
}

impl Drop for TempFile {
    fn drop(&mut self) {
        if let (false, Temp::Named(name)) = (self.committed, &self.temp) {
            // Best effort: if this fails the file stays hidden under its
            // dot-name and holds no committed data. An unnamed one needs
            // nothing: closing its last descriptor frees it.
            let _ = rustix::fs::unlinkat(&self.parent, name.as_str(), AtFlags::empty());
        }
    }
}

/// An unnamed file in `parent` (`O_TMPFILE`), where the filesystem makes
/// one and `/proc` is there to link it through; None where not.
fn unnamed_temp(parent: &OwnedFd) -> Option<OwnedFd> {
    if !std::path::Path::new("/proc/self/fd").is_dir() {
        return None;
    }
    // Without O_EXCL: a committed file may be linked into place.
    rustix::fs::openat(
        parent,
        ".",
        OFlags::WRONLY | OFlags::TMPFILE | OFlags::CLOEXEC,
        Mode::from_raw_mode(0o600),
    )
    .ok()
}

/// How a file is written, beyond its path and contents.
#[derive(Clone, Copy, Debug, Default)]
pub struct NewFile<'a> {
    /// Permission bits (only 0o777 are honoured; 0: [`DEFAULT_FILE_MODE`]).
    pub mode: u32,
    /// Who owns the file and the parents the write makes; None: the caller.
    pub owner: Option<Owner>,
    /// Extended attributes set on the file (checked by the caller with
    /// [`crate::xattrs::check`]).
    pub xattrs: Option<&'a HashMap<String, String>>,
}

/// Resolves the target's parent (creating what is missing), checks the
/// target is not a directory, and creates the temporary file beside it.
pub fn create_temp(
    work: &WorkDir,
    rel: &RelPath,
    new: NewFile<'_>,
) -> Result<(TempFile, File), FileError> {
    let root = work.open()?;
    let parent = open_parent(&root, rel, new.owner)?;

    // Fail early, before any data is sent, when the target is a directory.
    // The rename would refuse it too; this only gives a faster answer.
    match rustix::fs::statat(&parent, rel.file_name(), AtFlags::SYMLINK_NOFOLLOW) {
        Ok(stat) if FileType::from_raw_mode(stat.st_mode) == FileType::Directory => {
            return Err(FileError::NotAFile {
                path: rel.original().to_owned(),
                what: "a directory",
            })
        }
        Ok(_) | Err(Errno::NOENT) => {}
        Err(errno) => return Err(FileError::from_errno(errno, "inspect", rel.original())),
    }

    // Only permission bits: setuid, setgid and sticky are never honoured.
    let mode = match new.mode & 0o777 {
        0 => DEFAULT_FILE_MODE,
        mode => mode,
    };
    if let Some(fd) = unnamed_temp(&parent) {
        let keep = rustix::io::fcntl_dupfd_cloexec(&fd, 0)
            .map_err(|errno| FileError::from_errno(errno, "create a file for", rel.original()))?;
        let temp = TempFile {
            parent,
            temp: Temp::Unnamed(keep),
            committed: false,
        };
        prepare_temp(&fd, rel, new, mode)?;
        return Ok((temp, File::from(fd)));
    }
    for _ in 0..TEMP_ATTEMPTS {
        let name = format!("{TEMP_PREFIX}{:016x}", random_u64());
        // O_EXCL with O_CREAT never follows a symlink at the name, and the
        // parent handle is already confined, so this cannot leave the
        // directory. Created owner-only; the final mode is set below.
        let created = rustix::fs::openat(
            &parent,
            name.as_str(),
            OFlags::WRONLY | OFlags::CREATE | OFlags::EXCL | OFlags::NOFOLLOW | OFlags::CLOEXEC,
            Mode::from_raw_mode(0o600),
        );
        let fd = match created {
            Ok(fd) => fd,
            Err(Errno::EXIST) => continue,
            Err(errno) => {
                return Err(FileError::from_errno(
                    errno,
                    "create a file for",
                    rel.original(),
                ))
            }
        };
        let temp = TempFile {
            parent,
            temp: Temp::Named(name),
            committed: false,
        };
        prepare_temp(&fd, rel, new, mode)?;
        return Ok((temp, File::from(fd)));
    }
    Err(FileError::Io {
        op: "find a free temporary name for",
        path: rel.original().to_owned(),
        source: Errno::EXIST.into(),
    })
}

/// Gives a new temporary file its owner, exact mode and extended
/// attributes.
fn prepare_temp(fd: &OwnedFd, rel: &RelPath, new: NewFile<'_>, mode: u32) -> Result<(), FileError> {
    // The mode is applied exactly: the process's umask is an accident of
    // how it was started and must not change the result.
    if let Some(owner) = new.owner {
        rustix::fs::fchown(
            fd,
            Some(rustix::process::Uid::from_raw(owner.uid)),
            Some(rustix::process::Gid::from_raw(owner.gid)),
        )
        .map_err(|errno| FileError::from_errno(errno, "set the owner of", rel.original()))?;
    }
    // After the chown, which clears set-id bits (none are set anyway).
    rustix::fs::fchmod(fd, Mode::from_raw_mode(mode))
        .map_err(|errno| FileError::from_errno(errno, "set the mode of", rel.original()))?;
    if let Some(xattrs) = new.xattrs {
        crate::xattrs::set(fd, xattrs).map_err(|errno| {
            FileError::from_errno(errno, "set the extended attributes of", rel.original())
        })?;
    }
    Ok(())
}

/// Opens the directory that will hold `rel`, creating missing parents.
///
/// Each parent is resolved from the root as a whole prefix, not from the
/// previous component: that way a symlink among the parents is followed
/// when it stays inside (`RESOLVE_BENEATH` judges the full path), and
/// refused when it leaves.
pub fn open_parent(root: &Root, rel: &RelPath, owner: Option<Owner>) -> Result<OwnedFd, FileError> {
    let open_dir =
        |path: &str| open_beneath(root, path, OFlags::PATH | OFlags::DIRECTORY, Mode::empty());
    let mut dir = open_dir(".").map_err(|errno| FileError::from_errno(errno, "open", "."))?;
    let mut prefix = String::new();
    for component in rel.parents() {
        if !prefix.is_empty() {
            prefix.push('/');
        }
        prefix.push_str(component);
        let opened = match open_dir(&prefix) {
            Err(Errno::NOENT) => {
                // Created through the confined parent handle, so the new
                // directory is inside whatever happens concurrently. EEXIST
                // means something appeared meanwhile: the open below judges
                // what it is.
                match rustix::fs::mkdirat(&dir, component.as_str(), Mode::from_raw_mode(DIR_MODE)) {
                    Ok(()) => open_dir(&prefix).and_then(|made| {
                        // Only what this call made changes owner.
                        chown_made(&made, owner)?;
                        Ok(made)
                    }),
                    Err(Errno::EXIST) => open_dir(&prefix),
                    Err(errno) => Err(errno),
                }
            }
            other => other,
        };
        dir = opened.map_err(|errno| match errno {
            Errno::NOTDIR => FileError::NotADirectory {
                path: prefix.clone(),
                target: rel.original().to_owned(),
            },
            other => {
                FileError::from_errno(other, "create the parent directories of", rel.original())
            }
        })?;
    }
    Ok(dir)
}

/// Gives a directory this call created to `owner` (nothing without one).
/// `fd` may be an `O_PATH` handle: `fchownat(AT_EMPTY_PATH)` changes the
/// directory it names, wherever it has moved since.
fn chown_made(fd: &OwnedFd, owner: Option<Owner>) -> Result<(), Errno> {
    let Some(owner) = owner else {
        return Ok(());
    };
    rustix::fs::chownat(
        fd,
        "",
        Some(rustix::process::Uid::from_raw(owner.uid)),
        Some(rustix::process::Gid::from_raw(owner.gid)),
        AtFlags::EMPTY_PATH,
    )
}

/// Describes a non-regular file type for error messages.
fn describe(file_type: FileType) -> &'static str {
    match file_type {
        FileType::Directory => "a directory",
        FileType::Symlink => "a symlink",
        FileType::Fifo => "a fifo",
        FileType::Socket => "a socket",
        FileType::CharacterDevice | FileType::BlockDevice => "a device",
        _ => "not a regular file",
    }
}

/// A random number for temporary names. Unpredictability is not a security
/// property here (`O_EXCL` is), it only avoids collisions, so std's
/// randomly keyed hasher is a good enough source and saves a dependency.
fn random_u64() -> u64 {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let mut hasher = std::collections::hash_map::RandomState::new().build_hasher();
    hasher.write_u64(COUNTER.fetch_add(1, Ordering::Relaxed));
    hasher.finish()
}

#[cfg(test)]
mod tests {
    use std::io::Write as _;

    use super::*;

    #[test]
    fn temp_names_differ() {
        let a = random_u64();
        let b = random_u64();
        assert_ne!(a, b);
    }

    /// The names in `dir`, sorted.
    fn names(dir: &std::path::Path) -> Vec<String> {
        let mut names: Vec<String> = std::fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        names.sort();
        names
    }

    #[test]
    fn a_write_has_no_name_until_it_is_committed() {
        let dir = tempfile::tempdir().unwrap();
        let work = WorkDir::new(dir.path().to_owned());
        let rel = work.parse("a.txt").unwrap();
        let (temp, mut file) = create_temp(&work, &rel, NewFile::default()).unwrap();
        file.write_all(b"first").unwrap();
        // Mid-write, nothing is listed (a writer killed now leaves nothing).
        assert_eq!(names(dir.path()), Vec::<String>::new());
        temp.commit(&rel, false).unwrap();
        assert_eq!(names(dir.path()), ["a.txt"]);
        assert_eq!(std::fs::read(dir.path().join("a.txt")).unwrap(), b"first");
        let meta = std::fs::metadata(dir.path().join("a.txt")).unwrap();
        assert_eq!(
            std::os::unix::fs::PermissionsExt::mode(&meta.permissions()) & 0o777,
            DEFAULT_FILE_MODE
        );

        // Replacing: the old contents until the commit, the new after, and
        // no other name left.
        let (temp, mut file) = create_temp(&work, &rel, NewFile::default()).unwrap();
        file.write_all(b"second").unwrap();
        assert_eq!(std::fs::read(dir.path().join("a.txt")).unwrap(), b"first");
        temp.commit(&rel, true).unwrap();
        assert_eq!(std::fs::read(dir.path().join("a.txt")).unwrap(), b"second");
        assert_eq!(names(dir.path()), ["a.txt"]);

        // Without replace an existing target is refused and kept.
        let (temp, mut file) = create_temp(&work, &rel, NewFile::default()).unwrap();
        file.write_all(b"third").unwrap();
        let refused = temp.commit(&rel, false).unwrap_err();
        assert!(matches!(refused, FileError::Exists { .. }), "{refused}");
        assert_eq!(std::fs::read(dir.path().join("a.txt")).unwrap(), b"second");
        assert_eq!(names(dir.path()), ["a.txt"]);

        // Dropped uncommitted: nothing.
        let other = work.parse("b.txt").unwrap();
        let (temp, mut file) = create_temp(&work, &other, NewFile::default()).unwrap();
        file.write_all(b"never").unwrap();
        drop((temp, file));
        assert_eq!(names(dir.path()), ["a.txt"]);

        // A directory at the target is refused either way.
        std::fs::create_dir(dir.path().join("d")).unwrap();
        let d = work.parse("d/x").unwrap();
        let (temp, _) = create_temp(&work, &d, NewFile::default()).unwrap();
        std::fs::remove_dir(dir.path().join("d")).ok();
        drop(temp);
        let d = work.parse("d").unwrap();
        std::fs::create_dir_all(dir.path().join("d")).unwrap();
        assert!(create_temp(&work, &d, NewFile::default()).is_err());
    }
}
