//! Filesystem writes confined beneath the layer's destination directory.
//!
//! This is the only code in the unpacker that touches the disk, and it holds
//! one invariant: nothing is created, changed or removed outside `dest`,
//! whatever the archive says and whatever earlier entries left behind.
//!
//! 1. Directories are reached only with `openat2(RESOLVE_BENEATH |
//!    RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS)` from a directory fd, so
//!    a walk that meets any symlink fails with `ELOOP` and one that would
//!    climb out fails with `EXDEV`. Names reaching here never contain `..`
//!    anyway; the kernel check is what makes that belt-and-braces.
//! 2. The last component is then handled with an `*at()` call on that fd
//!    with a single-component name, and each of those calls is one that does
//!    not follow a symlink in the last position (`mkdirat`, `mknodat`,
//!    `symlinkat`, `linkat` without `AT_SYMLINK_FOLLOW`, `unlinkat`,
//!    `openat(O_CREAT | O_EXCL | O_NOFOLLOW)`, `*at(AT_SYMLINK_NOFOLLOW)`).
//! 3. Modes are only ever set through an fd we opened ourselves (`fchmod`),
//!    because `fchmodat` cannot refuse to follow a symlink on Linux.
//!
//! It does not know about tar, limits or error reporting: it returns raw
//! `Errno`s and the caller (the parent module) maps them to rules.

use std::os::fd::{AsFd, BorrowedFd, OwnedFd};

use rustix::fs::{
    fchmod, fchown, fsetxattr, futimens, linkat, makedev, mkdirat, mknodat, openat, openat2,
    statat, symlinkat, unlinkat, AtFlags, Dir, FileType, Gid, Mode, OFlags, ResolveFlags, Stat,
    Timespec, Timestamps, Uid, XattrFlags,
};
use rustix::io::Errno;

/// How every directory walk resolves its path: never leave the start
/// directory, never follow any kind of symlink.
const RESOLVE: ResolveFlags = ResolveFlags::BENEATH
    .union(ResolveFlags::NO_SYMLINKS)
    .union(ResolveFlags::NO_MAGICLINKS);

/// Flags for opening a directory we only hold as an anchor for `*at()` calls.
///
/// Deliberately without `O_NOFOLLOW`: with it, a symlink in the last
/// position is not resolved but opened as itself, and `O_DIRECTORY` then
/// fails with `ENOTDIR`, hiding the symlink. Without it,
/// `RESOLVE_NO_SYMLINKS` refuses that symlink with `ELOOP` like any other.
const DIR_FLAGS: OFlags = OFlags::RDONLY
    .union(OFlags::DIRECTORY)
    .union(OFlags::CLOEXEC);

/// How often a walk is retried when the kernel answers `EAGAIN` (it does so
/// for `RESOLVE_BENEATH` walks that race a rename, and asks for a retry).
const EAGAIN_RETRIES: usize = 16;

/// The xattr that marks a directory opaque for overlayfs.
const OPAQUE_XATTR: &str = "trusted.overlay.opaque";

/// Opens the directory at relative `path` (empty for `dir` itself) beneath
/// `dir`, failing with `ELOOP` on any symlink along the way, the last
/// component included.
pub(crate) fn open_dir(dir: BorrowedFd<'_>, path: &[u8]) -> Result<OwnedFd, Errno> {
    let path: &[u8] = if path.is_empty() { b"." } else { path };
    let mut tries = 0;
    loop {
        match openat2(dir, path, DIR_FLAGS, Mode::empty(), RESOLVE) {
            Err(Errno::AGAIN | Errno::INTR) if tries < EAGAIN_RETRIES => tries += 1,
            other => return other,
        }
    }
}

/// Like [`open_dir`], but creates missing components as root-owned 0755
/// directories, one component at a time and each beneath the previous one.
///
/// A whiteout in the way (`.wh.a` earlier, now `a/b` with no `a/` entry)
/// is replaced by such a directory, opaque for the reason [`make_dir`]
/// gives. Any other non-directory in the way fails with `ENOTDIR`.
pub(crate) fn open_or_create_dir(root: BorrowedFd<'_>, path: &[u8]) -> Result<OwnedFd, Errno> {
    // The common case, an existing parent, costs one syscall.
    match open_dir(root, path) {
        Err(Errno::NOENT | Errno::NOTDIR) => {}
        other => return other,
    }
    let mut current = open_dir(root, b"")?;
    for component in path.split(|&b| b == b'/') {
        current = match open_dir(current.as_fd(), component) {
            Ok(fd) => fd,
            Err(Errno::NOENT) => implicit_dir(current.as_fd(), component)?,
            Err(Errno::NOTDIR) => match lstat(current.as_fd(), component)? {
                Some(stat) if is_whiteout(&stat) => {
                    unlinkat(&current, component, AtFlags::empty())?;
                    let fd = implicit_dir(current.as_fd(), component)?;
                    set_opaque(fd.as_fd())?;
                    fd
                }
                _ => return Err(Errno::NOTDIR),
            },
            Err(err) => return Err(err),
        };
    }
    Ok(current)
}

/// Creates (if still absent) and opens a parent directory no entry named.
fn implicit_dir(dir: BorrowedFd<'_>, name: &[u8]) -> Result<OwnedFd, Errno> {
    let created = match mkdirat(dir, name, Mode::from_raw_mode(0o755)) {
        Ok(()) => true,
        Err(Errno::EXIST) => false,
        Err(err) => return Err(err),
    };
    let fd = open_dir(dir, name)?;
    if created {
        // mkdirat applied the process umask; the layer wants 0755.
        fchmod(&fd, Mode::from_raw_mode(0o755))?;
    }
    Ok(fd)
}

/// Stats `name` in `dir` without following a symlink; `None` if absent.
pub(crate) fn lstat(dir: BorrowedFd<'_>, name: &[u8]) -> Result<Option<Stat>, Errno> {
    match statat(dir, name, AtFlags::SYMLINK_NOFOLLOW) {
        Ok(stat) => Ok(Some(stat)),
        Err(Errno::NOENT) => Ok(None),
        Err(err) => Err(err),
    }
}

/// Whether `stat` describes a directory.
pub(crate) fn is_dir(stat: &Stat) -> bool {
    FileType::from_raw_mode(stat.st_mode) == FileType::Directory
}

/// Whether `stat` describes an overlayfs whiteout (character device 0:0).
pub(crate) fn is_whiteout(stat: &Stat) -> bool {
    FileType::from_raw_mode(stat.st_mode) == FileType::CharacterDevice && stat.st_rdev == 0
}

/// Makes room for a new non-directory entry `name` in `dir`: whatever is
/// there goes, a directory with everything in it (later entries replace
/// earlier ones, as tar does).
pub(crate) fn make_room(dir: BorrowedFd<'_>, name: &[u8]) -> Result<(), Errno> {
    match unlinkat(dir, name, AtFlags::empty()) {
        Ok(()) | Err(Errno::NOENT) => Ok(()),
        // Linux answers EISDIR for unlink(2) on a directory.
        Err(Errno::ISDIR) => remove_tree(dir, name),
        Err(err) => Err(err),
    }
}

/// Removes the directory `name` in `dir` and everything below it.
///
/// Each level is opened with [`open_dir`], so a symlink met on the way is
/// unlinked as a name and never entered. Recursion depth is bounded by the
/// depth the archive could create, which the path-length limit bounds; each
/// level holds one fd open.
fn remove_tree(dir: BorrowedFd<'_>, name: &[u8]) -> Result<(), Errno> {
    let fd = open_dir(dir, name)?;
    // Collect first, delete after: readdir while unlinking may skip names.
    let mut children = Vec::new();
    for entry in Dir::read_from(&fd)? {
        let entry = entry?;
        let child = entry.file_name().to_bytes();
        if child != b"." && child != b".." {
            children.push(child.to_vec());
        }
    }
    for child in children {
        match unlinkat(&fd, child.as_slice(), AtFlags::empty()) {
            Ok(()) | Err(Errno::NOENT) => {}
            Err(Errno::ISDIR) => remove_tree(fd.as_fd(), &child)?,
            Err(err) => return Err(err),
        }
    }
    drop(fd);
    unlinkat(dir, name, AtFlags::REMOVEDIR)
}

/// What [`make_dir`] found at the name before it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Replaced {
    /// Nothing, or an existing directory that was kept (merged into).
    Nothing,
    /// An overlayfs whiteout, now replaced by the directory.
    Whiteout,
    /// Some other non-directory, now replaced.
    Other,
}

/// Creates directory `name` in `dir` (or keeps an existing one) and opens it.
/// A non-directory already at that name is replaced.
pub(crate) fn make_dir(dir: BorrowedFd<'_>, name: &[u8]) -> Result<(OwnedFd, Replaced), Errno> {
    // 0700 until the caller applies the entry's own mode through the fd.
    let private = Mode::from_raw_mode(0o700);
    let replaced = match mkdirat(dir, name, private) {
        Ok(()) => Replaced::Nothing,
        Err(Errno::EXIST) => match lstat(dir, name)? {
            Some(stat) if is_dir(&stat) => Replaced::Nothing,
            existing => {
                let was_whiteout = existing.as_ref().is_some_and(is_whiteout);
                make_room(dir, name)?;
                mkdirat(dir, name, private)?;
                if was_whiteout {
                    Replaced::Whiteout
                } else {
                    Replaced::Other
                }
            }
        },
        Err(err) => return Err(err),
    };
    Ok((open_dir(dir, name)?, replaced))
}

/// Creates a new, empty regular file `name` in `dir`, replacing whatever was
/// there, and opens it for writing.
pub(crate) fn create_file(dir: BorrowedFd<'_>, name: &[u8]) -> Result<OwnedFd, Errno> {
    make_room(dir, name)?;
    // O_EXCL makes the kernel refuse any existing name, a symlink planted
    // between the unlink and here included; O_NOFOLLOW says so twice.
    let flags = OFlags::WRONLY | OFlags::CREATE | OFlags::EXCL | OFlags::NOFOLLOW | OFlags::CLOEXEC;
    openat(dir, name, flags, Mode::from_raw_mode(0o600))
}

/// Creates symlink `name` in `dir` pointing at `target`, stored verbatim,
/// replacing whatever was there.
pub(crate) fn make_symlink(dir: BorrowedFd<'_>, name: &[u8], target: &[u8]) -> Result<(), Errno> {
    make_room(dir, name)?;
    symlinkat(target, dir, name)
}

/// Hard-links `name` in `dir` to the existing `target_name` in `target_dir`,
/// replacing whatever was at `name`. A symlink target is linked as itself,
/// never followed.
pub(crate) fn make_hard_link(
    target_dir: BorrowedFd<'_>,
    target_name: &[u8],
    dir: BorrowedFd<'_>,
    name: &[u8],
) -> Result<(), Errno> {
    make_room(dir, name)?;
    linkat(target_dir, target_name, dir, name, AtFlags::empty())
}

/// Creates the overlayfs whiteout for `name` in `dir`.
///
/// The OCI spec says a whiteout only deletes things in *lower* layers; an
/// entry of this layer with the same name survives it. So: if nothing is
/// there, a character device 0:0 is made; if this layer already has a
/// directory there, that directory is marked opaque (its lower namesake is
/// deleted, its own contents stay); any other existing entry already hides
/// its lower namesake and is left alone.
pub(crate) fn make_whiteout(dir: BorrowedFd<'_>, name: &[u8]) -> Result<(), Errno> {
    match lstat(dir, name)? {
        None => mknodat(
            dir,
            name,
            FileType::CharacterDevice,
            Mode::empty(),
            makedev(0, 0),
        ),
        Some(stat) if is_dir(&stat) => set_opaque(open_dir(dir, name)?.as_fd()),
        Some(_) => Ok(()),
    }
}

/// Creates a FIFO at `name` in `dir` (replacing whatever was there) with
/// `meta`'s owner, mode and time. A FIFO is a name, not a device: it
/// reaches nothing outside the run that opens it.
pub(crate) fn make_fifo(dir: BorrowedFd<'_>, name: &[u8], meta: &Meta) -> Result<(), Errno> {
    make_room(dir, name)?;
    mknodat(dir, name, FileType::Fifo, Mode::empty(), 0)?;
    rustix::fs::chownat(
        dir,
        name,
        Some(Uid::from_raw(meta.uid)),
        Some(Gid::from_raw(meta.gid)),
        AtFlags::SYMLINK_NOFOLLOW,
    )?;
    rustix::fs::chmodat(dir, name, Mode::from_raw_mode(meta.mode), AtFlags::empty())?;
    rustix::fs::utimensat(dir, name, &meta.timestamps(), AtFlags::SYMLINK_NOFOLLOW)
}

/// Sets extended attribute `name` of the file or directory open at `fd`.
pub(crate) fn set_xattr(fd: BorrowedFd<'_>, name: &str, value: &[u8]) -> Result<(), Errno> {
    fsetxattr(fd, name, value, XattrFlags::empty())
}

/// Marks the directory open at `dir` opaque for overlayfs.
pub(crate) fn set_opaque(dir: BorrowedFd<'_>) -> Result<(), Errno> {
    fsetxattr(dir, OPAQUE_XATTR, b"y", XattrFlags::empty())
}

/// Ownership, permission bits and modification time from a tar header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Meta {
    /// Owner; never `u32::MAX`, which chown reads as "leave unchanged".
    pub(crate) uid: u32,
    /// Group; never `u32::MAX`.
    pub(crate) gid: u32,
    /// Permission bits including setuid, setgid and sticky (`& 0o7777`).
    pub(crate) mode: u32,
    /// Seconds since the epoch.
    pub(crate) mtime: i64,
}

impl Meta {
    fn timestamps(&self) -> Timestamps {
        let at = Timespec {
            tv_sec: self.mtime,
            tv_nsec: 0,
        };
        Timestamps {
            last_access: at,
            last_modification: at,
        }
    }
}

/// Applies owner and mode to the file or directory open at `fd`.
///
/// Owner first: chown clears setuid and setgid, so the mode must come after.
pub(crate) fn set_owner_mode(fd: BorrowedFd<'_>, meta: &Meta) -> Result<(), Errno> {
    fchown(
        fd,
        Some(Uid::from_raw(meta.uid)),
        Some(Gid::from_raw(meta.gid)),
    )?;
    fchmod(fd, Mode::from_raw_mode(meta.mode))
}

/// Sets the modification (and access) time of the file open at `fd`.
pub(crate) fn set_mtime(fd: BorrowedFd<'_>, meta: &Meta) -> Result<(), Errno> {
    futimens(fd, &meta.timestamps())
}

/// Applies owner and times to the symlink `name` in `dir` itself. A
/// symlink's own mode means nothing on Linux, so none is set.
pub(crate) fn set_symlink_meta(dir: BorrowedFd<'_>, name: &[u8], meta: &Meta) -> Result<(), Errno> {
    rustix::fs::chownat(
        dir,
        name,
        Some(Uid::from_raw(meta.uid)),
        Some(Gid::from_raw(meta.gid)),
        AtFlags::SYMLINK_NOFOLLOW,
    )?;
    rustix::fs::utimensat(dir, name, &meta.timestamps(), AtFlags::SYMLINK_NOFOLLOW)
}

/// Sets the permission bits (only) of the directory open at `fd`.
pub(crate) fn set_mode(fd: BorrowedFd<'_>, mode: u32) -> Result<(), Errno> {
    fchmod(fd, Mode::from_raw_mode(mode))
}

/// Whether the directory open at `fd` has no entries.
pub(crate) fn is_empty_dir(fd: BorrowedFd<'_>) -> Result<bool, Errno> {
    for entry in Dir::read_from(fd)? {
        let name = entry?.file_name().to_bytes().to_vec();
        if name != b"." && name != b".." {
            return Ok(false);
        }
    }
    Ok(true)
}
