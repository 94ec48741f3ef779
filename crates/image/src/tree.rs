//! Flattens a stack of overlay layers into one plain directory tree: what
//! overlayfs would show for them, written out as ordinary files.
//!
//! The warm repo cache publishes a run's volume this way: the template the
//! run booted from (a plain tree) plus the run's captured upper directory
//! (whiteouts, opaque directories) become the next template, a plain tree
//! again, so templates never grow into chains of layers.
//!
//! File data is cloned (`FICLONE`) when source and destination share a
//! filesystem that can (btrfs, XFS), so a copy costs metadata only; it is
//! copied otherwise. Mode, owner, times and extended attributes are kept,
//! except overlayfs' own (`trusted.overlay.*`), which mean nothing in a
//! plain tree. Hard links inside the tree stay hard links. Device nodes
//! and sockets are left out (a volume has no use for them; the count is
//! returned).
//!
//! Written by hand because the merge is overlayfs' rules (whiteouts, opaque
//! directories, a directory hiding a file below it), which no copying crate
//! knows. The sources must be trees nobody writes any more (a frozen
//! capture, a published template): a symlink is never followed, and every
//! directory entered was checked to be a directory.

use std::collections::{BTreeMap, HashMap};
use std::ffi::{OsStr, OsString};
use std::fs;
use std::io;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::PermissionsExt;
use std::os::unix::fs::{DirBuilderExt, FileTypeExt, MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

/// The xattr that marks a directory opaque for overlayfs.
const OPAQUE_XATTR: &str = "trusted.overlay.opaque";

/// What [`flatten`] wrote.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TreeStats {
    /// Regular files (each hard link counted once).
    pub files: u64,
    /// Directories, the root included.
    pub dirs: u64,
    /// Symlinks and FIFOs.
    pub others: u64,
    /// Bytes of regular-file data.
    pub bytes: u64,
    /// Device nodes and sockets left out.
    pub skipped: u64,
}

/// Writes to `dest` (which must not exist; its parent must) the merged
/// tree of `layers`, topmost first, as overlayfs merges them: a whiteout in
/// a layer hides the name below it, an opaque directory hides the
/// directories below it, and a non-directory hides everything below it.
/// Every layer must be a directory; the lowest is read as a plain tree.
///
/// On error `dest` may be partly written; the caller removes it.
pub fn flatten(layers: &[&Path], dest: &Path) -> io::Result<TreeStats> {
    if layers.is_empty() {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            "nothing to flatten",
        ));
    }
    for layer in layers {
        if !fs::symlink_metadata(layer)?.is_dir() {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("{} is not a directory", layer.display()),
            ));
        }
    }
    let mut flat = Flatten {
        links: HashMap::new(),
        stats: TreeStats::default(),
    };
    let sources: Vec<PathBuf> = layers.iter().map(|p| p.to_path_buf()).collect();
    flat.dir(&sources, dest)?;
    Ok(flat.stats)
}

struct Flatten {
    /// Regular files with several links already written: (dev, ino) of the
    /// source -> the copy.
    links: HashMap<(u64, u64), PathBuf>,
    stats: TreeStats,
}

/// What the topmost layer that has a name says about it.
enum Winner {
    /// Hidden by a whiteout.
    Gone,
    /// A directory, merged from these layers' directories (topmost first).
    Dir(Vec<PathBuf>),
    /// Anything else, taken from this layer.
    Entry(PathBuf),
}

impl Flatten {
    /// Makes `dest` from the directories `sources` (topmost first, each
    /// already known to be a directory that shows through).
    fn dir(&mut self, sources: &[PathBuf], dest: &Path) -> io::Result<()> {
        let top = fs::symlink_metadata(&sources[0])?;
        fs::DirBuilder::new().mode(0o700).create(dest)?;
        self.stats.dirs += 1;
        // Which layers' directories show through: down to the first opaque one.
        let visible = match sources.iter().position(|s| is_opaque(s)) {
            Some(i) => &sources[..=i],
            None => sources,
        };
        let mut names: BTreeMap<OsString, Winner> = BTreeMap::new();
        for (depth, source) in visible.iter().enumerate() {
            for entry in fs::read_dir(source)? {
                let entry = entry?;
                let name = entry.file_name();
                if names.contains_key(&name) {
                    continue;
                }
                let path = entry.path();
                let meta = fs::symlink_metadata(&path)?;
                let winner = if is_whiteout(&meta) {
                    Winner::Gone
                } else if meta.is_dir() {
                    // This directory and the same-named ones below it, until
                    // one is opaque or a layer has something else there.
                    let mut dirs = vec![path.clone()];
                    if !is_opaque(&path) {
                        for lower in &visible[depth + 1..] {
                            let below = lower.join(&name);
                            match fs::symlink_metadata(&below) {
                                Ok(m) if m.is_dir() => {
                                    let opaque = is_opaque(&below);
                                    dirs.push(below);
                                    if opaque {
                                        break;
                                    }
                                }
                                Ok(_) => break,
                                Err(e) if e.kind() == io::ErrorKind::NotFound => {}
                                Err(e) => return Err(e),
                            }
                        }
                    }
                    Winner::Dir(dirs)
                } else {
                    Winner::Entry(path)
                };
                names.insert(name, winner);
            }
        }
        for (name, winner) in names {
            let to = dest.join(&name);
            match winner {
                Winner::Gone => {}
                Winner::Dir(dirs) => self.dir(&dirs, &to)?,
                Winner::Entry(from) => self.entry(&from, &to)?,
            }
        }
        // Last: writing the entries changed the directory's times.
        std::os::unix::fs::lchown(dest, Some(top.uid()), Some(top.gid()))?;
        fs::set_permissions(dest, fs::Permissions::from_mode(top.mode() & 0o7777))?;
        copy_xattrs(&sources[0], dest)?;
        set_times(dest, &top)
    }

    /// Copies one non-directory.
    fn entry(&mut self, from: &Path, to: &Path) -> io::Result<()> {
        let meta = fs::symlink_metadata(from)?;
        let kind = meta.file_type();
        if kind.is_file() {
            let key = (meta.dev(), meta.ino());
            if meta.nlink() > 1 {
                if let Some(first) = self.links.get(&key) {
                    return fs::hard_link(first, to);
                }
            }
            copy_file(from, to, &meta)?;
            if meta.nlink() > 1 {
                self.links.insert(key, to.to_owned());
            }
            self.stats.files += 1;
            self.stats.bytes += meta.len();
        } else if kind.is_symlink() {
            std::os::unix::fs::symlink(fs::read_link(from)?, to)?;
            std::os::unix::fs::lchown(to, Some(meta.uid()), Some(meta.gid()))?;
            set_times(to, &meta)?;
            self.stats.others += 1;
        } else if kind.is_fifo() {
            rustix::fs::mknodat(
                rustix::fs::CWD,
                to,
                rustix::fs::FileType::Fifo,
                rustix::fs::Mode::from_raw_mode(meta.mode() & 0o777),
                0,
            )?;
            std::os::unix::fs::lchown(to, Some(meta.uid()), Some(meta.gid()))?;
            fs::set_permissions(to, fs::Permissions::from_mode(meta.mode() & 0o7777))?;
            set_times(to, &meta)?;
            self.stats.others += 1;
        } else {
            self.stats.skipped += 1;
        }
        Ok(())
    }
}

/// Copies a regular file's data (cloned where the filesystem can), then its
/// owner, mode (after the owner: chown clears set-id bits), xattrs and times.
fn copy_file(from: &Path, to: &Path, meta: &fs::Metadata) -> io::Result<()> {
    let src = fs::OpenOptions::new()
        .read(true)
        .custom_flags(rustix::fs::OFlags::NOFOLLOW.bits() as i32)
        .open(from)?;
    let dst = fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(to)?;
    if meta.len() > 0 && rustix::fs::ioctl_ficlone(&dst, &src).is_err() {
        // Not the same filesystem, or one without clones: copy the bytes
        // (copy_file_range, in the kernel).
        io::copy(&mut &src, &mut &dst)?;
    }
    std::os::unix::fs::fchown(&dst, Some(meta.uid()), Some(meta.gid()))?;
    dst.set_permissions(fs::Permissions::from_mode(meta.mode() & 0o7777))?;
    copy_xattrs(from, to)?;
    dst.set_times(
        fs::FileTimes::new()
            .set_accessed(meta.accessed()?)
            .set_modified(meta.modified()?),
    )
}

/// Sets a path's access and modification times from `meta`, never
/// following a symlink.
fn set_times(path: &Path, meta: &fs::Metadata) -> io::Result<()> {
    let ts = |sec: i64, nsec: i64| rustix::fs::Timespec {
        tv_sec: sec,
        tv_nsec: nsec as _,
    };
    let times = rustix::fs::Timestamps {
        last_access: ts(meta.atime(), meta.atime_nsec()),
        last_modification: ts(meta.mtime(), meta.mtime_nsec()),
    };
    rustix::fs::utimensat(
        rustix::fs::CWD,
        path,
        &times,
        rustix::fs::AtFlags::SYMLINK_NOFOLLOW,
    )?;
    Ok(())
}

/// Copies extended attributes but overlayfs' own. Filesystems without
/// xattrs at either end are not an error.
fn copy_xattrs(from: &Path, to: &Path) -> io::Result<()> {
    let mut names = vec![0u8; 4096];
    let len = loop {
        match rustix::fs::llistxattr(from, &mut names[..]) {
            Ok(n) => break n,
            Err(rustix::io::Errno::RANGE) if names.len() < 1 << 20 => {
                names.resize(names.len() * 4, 0)
            }
            Err(rustix::io::Errno::NOTSUP) => return Ok(()),
            Err(e) => return Err(e.into()),
        }
    };
    for name in names[..len].split(|b| *b == 0).filter(|n| !n.is_empty()) {
        if name.starts_with(b"trusted.overlay.") {
            continue;
        }
        let name = OsStr::from_bytes(name);
        let mut value = vec![0u8; 4096];
        let n = loop {
            match rustix::fs::lgetxattr(from, name, &mut value[..]) {
                Ok(n) => break n,
                Err(rustix::io::Errno::RANGE) if value.len() < 1 << 20 => {
                    value.resize(value.len() * 4, 0)
                }
                Err(rustix::io::Errno::NODATA) => break usize::MAX,
                Err(e) => return Err(e.into()),
            }
        };
        if n == usize::MAX {
            continue;
        }
        match rustix::fs::lsetxattr(to, name, &value[..n], rustix::fs::XattrFlags::empty()) {
            Ok(()) | Err(rustix::io::Errno::NOTSUP) => {}
            Err(e) => return Err(e.into()),
        }
    }
    Ok(())
}

/// An overlayfs whiteout: a character device 0:0.
fn is_whiteout(meta: &fs::Metadata) -> bool {
    meta.file_type().is_char_device() && meta.rdev() == 0
}

fn is_opaque(dir: &Path) -> bool {
    let mut value = [0u8; 8];
    matches!(
        rustix::fs::lgetxattr(dir, OPAQUE_XATTR, &mut value),
        Ok(n) if value[..n] == *b"y"
    )
}

/// Ids in one user namespace range (what [`shift_owners`] moves).
pub const ID_RANGE: u32 = 65536;

/// Moves the owners of everything under `root` (itself included) from one
/// user namespace range to another: an id in `[from, from + ID_RANGE)`
/// becomes the same offset from `to`; ids outside it are left alone.
/// Symlinks themselves, never what they name; set-id bits survive. Costs
/// one `lchown` per entry in the range.
pub fn shift_owners(root: &Path, from: u32, to: u32) -> io::Result<()> {
    let shift = |id: u32| -> Option<u32> {
        id.checked_sub(from)
            .filter(|offset| *offset < ID_RANGE)
            .map(|offset| to + offset)
    };
    let mut stack = vec![root.to_path_buf()];
    while let Some(path) = stack.pop() {
        let meta = fs::symlink_metadata(&path)?;
        let (uid, gid) = (shift(meta.uid()), shift(meta.gid()));
        if uid.is_some() || gid.is_some() {
            let mode = meta.mode();
            std::os::unix::fs::lchown(&path, uid, gid)?;
            // chown clears set-id bits on regular files; put them back.
            if meta.is_file() && mode & 0o6000 != 0 {
                fs::set_permissions(&path, fs::Permissions::from_mode(mode & 0o7777))?;
            }
        }
        if meta.is_dir() {
            for entry in fs::read_dir(&path)? {
                stack.push(entry?.path());
            }
        }
    }
    Ok(())
}

/// Removes a tree [`flatten`] wrote (or began to); nothing to do when it
/// is gone.
pub fn remove_tree(path: &Path) -> io::Result<()> {
    match fs::remove_dir_all(path) {
        Err(e) if e.kind() != io::ErrorKind::NotFound => Err(e),
        _ => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn owners_move_between_ranges_and_keep_set_id_bits() {
        let tmp = tempfile::tempdir().unwrap();
        let root = tmp.path().join("r");
        fs::create_dir(&root).unwrap();
        let suid = root.join("suid");
        fs::write(&suid, "x").unwrap();
        std::os::unix::fs::lchown(&suid, Some(200_000), Some(200_005)).unwrap();
        fs::set_permissions(&suid, fs::Permissions::from_mode(0o4755)).unwrap();
        let outside = root.join("outside");
        fs::write(&outside, "y").unwrap();
        std::os::unix::fs::lchown(&outside, Some(1000), Some(1000)).unwrap();
        std::os::unix::fs::symlink("suid", root.join("link")).unwrap();
        std::os::unix::fs::lchown(root.join("link"), Some(200_001), Some(200_001)).unwrap();
        std::os::unix::fs::lchown(&root, Some(200_000), Some(200_000)).unwrap();
        shift_owners(&root, 200_000, 0).unwrap();
        let owner = |p: &Path| {
            let m = fs::symlink_metadata(p).unwrap();
            (m.uid(), m.gid())
        };
        assert_eq!(owner(&root), (0, 0));
        assert_eq!(owner(&suid), (0, 5));
        assert_eq!(fs::metadata(&suid).unwrap().mode() & 0o7777, 0o4755);
        assert_eq!(owner(&outside), (1000, 1000));
        assert_eq!(owner(&root.join("link")), (1, 1));
    }
    use std::fs::File;

    fn whiteout(at: &Path) {
        rustix::fs::mknodat(
            rustix::fs::CWD,
            at,
            rustix::fs::FileType::CharacterDevice,
            rustix::fs::Mode::empty(),
            0,
        )
        .unwrap();
    }

    fn opaque(at: &Path) {
        rustix::fs::setxattr(at, OPAQUE_XATTR, b"y", rustix::fs::XattrFlags::empty()).unwrap();
    }

    /// Every path below `root` with what it is: `d`, `l -> target`, or the
    /// file's content.
    fn listing(root: &Path) -> Vec<String> {
        fn walk(root: &Path, dir: &Path, out: &mut Vec<String>) {
            let mut entries: Vec<_> = fs::read_dir(dir).unwrap().map(|e| e.unwrap()).collect();
            entries.sort_by_key(|e| e.file_name());
            for e in entries {
                let path = e.path();
                let rel = path.strip_prefix(root).unwrap().display().to_string();
                let meta = fs::symlink_metadata(&path).unwrap();
                if meta.is_dir() {
                    out.push(format!("{rel}/"));
                    walk(root, &path, out);
                } else if meta.file_type().is_symlink() {
                    out.push(format!(
                        "{rel} -> {}",
                        fs::read_link(&path).unwrap().display()
                    ));
                } else {
                    out.push(format!("{rel} = {}", fs::read_to_string(&path).unwrap()));
                }
            }
        }
        let mut out = Vec::new();
        walk(root, root, &mut out);
        out
    }

    #[test]
    fn layers_merge_as_overlayfs_shows_them() {
        let tmp = tempfile::tempdir().unwrap();
        let (lower, upper) = (tmp.path().join("lower"), tmp.path().join("upper"));
        for d in ["keep", "gone", "opaque/old", "replaced", "node_modules/a"] {
            fs::create_dir_all(lower.join(d)).unwrap();
        }
        fs::write(lower.join("keep/same.txt"), "lower").unwrap();
        fs::write(lower.join("keep/changed.txt"), "lower").unwrap();
        fs::write(lower.join("gone/x"), "x").unwrap();
        fs::write(lower.join("opaque/old/y"), "y").unwrap();
        fs::write(lower.join("replaced/z"), "z").unwrap();
        fs::write(lower.join("node_modules/a/index.js"), "a").unwrap();
        fs::write(lower.join("file-then-dir"), "f").unwrap();
        std::os::unix::fs::symlink("keep/same.txt", lower.join("link")).unwrap();

        for d in ["keep", "opaque", "file-then-dir"] {
            fs::create_dir_all(upper.join(d)).unwrap();
        }
        fs::write(upper.join("keep/changed.txt"), "upper").unwrap();
        fs::write(upper.join("keep/new.txt"), "new").unwrap();
        whiteout(&upper.join("gone"));
        opaque(&upper.join("opaque"));
        fs::write(upper.join("opaque/fresh"), "fresh").unwrap();
        fs::write(upper.join("replaced"), "now a file").unwrap();
        fs::write(upper.join("file-then-dir/inside"), "i").unwrap();

        let dest = tmp.path().join("flat");
        let stats = flatten(&[&upper, &lower], &dest).unwrap();
        assert_eq!(
            listing(&dest),
            [
                "file-then-dir/",
                "file-then-dir/inside = i",
                "keep/",
                "keep/changed.txt = upper",
                "keep/new.txt = new",
                "keep/same.txt = lower",
                "link -> keep/same.txt",
                "node_modules/",
                "node_modules/a/",
                "node_modules/a/index.js = a",
                "opaque/",
                "opaque/fresh = fresh",
                "replaced = now a file",
            ]
        );
        assert_eq!(stats.files, 7);
        assert_eq!(stats.others, 1);
        // No overlay marker survives into the plain tree.
        assert!(!is_opaque(&dest.join("opaque")));
    }

    #[test]
    fn metadata_and_hard_links_are_kept() {
        let tmp = tempfile::tempdir().unwrap();
        let src = tmp.path().join("src");
        fs::create_dir(&src).unwrap();
        fs::write(src.join("a"), "data").unwrap();
        fs::hard_link(src.join("a"), src.join("b")).unwrap();
        fs::set_permissions(src.join("a"), fs::Permissions::from_mode(0o751)).unwrap();
        std::os::unix::fs::lchown(src.join("a"), Some(1234), Some(4321)).unwrap();
        let old = std::time::UNIX_EPOCH + std::time::Duration::from_secs(1_000_000);
        File::options()
            .write(true)
            .open(src.join("a"))
            .unwrap()
            .set_modified(old)
            .unwrap();
        fs::set_permissions(&src, fs::Permissions::from_mode(0o710)).unwrap();
        let dest = tmp.path().join("flat");
        let stats = flatten(&[&src], &dest).unwrap();
        assert_eq!((stats.files, stats.bytes), (1, 4));
        let a = fs::metadata(dest.join("a")).unwrap();
        let b = fs::metadata(dest.join("b")).unwrap();
        assert_eq!(a.ino(), b.ino());
        assert_eq!(a.mode() & 0o7777, 0o751);
        assert_eq!((a.uid(), a.gid()), (1234, 4321));
        assert_eq!(a.modified().unwrap(), old);
        assert_eq!(fs::metadata(&dest).unwrap().mode() & 0o7777, 0o710);
    }

    #[test]
    fn the_destination_must_be_new_and_layers_directories() {
        let tmp = tempfile::tempdir().unwrap();
        let file = tmp.path().join("file");
        fs::write(&file, "").unwrap();
        assert!(flatten(&[&file], &tmp.path().join("x")).is_err());
        assert!(flatten(&[], &tmp.path().join("x")).is_err());
        assert!(flatten(&[tmp.path()], tmp.path()).is_err());
    }
}
