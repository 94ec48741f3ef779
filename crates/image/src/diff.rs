//! What changed between two states of a run's root: each state is a
//! writable overlay layer (an `upper` directory as overlayfs leaves it,
//! whiteouts and opaque directories included) over the image's read-only
//! layers. Only paths either upper holds can differ (plus, below a
//! directory one side removed or replaced, what the other side had there),
//! so the cost follows what the run wrote, not the size of its image.
//!
//! Owners are reported as the run saw them: a layer stored with a user
//! namespace's host ids (`id_base`) is shifted back.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::fs;
use std::io::{self, Read};
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::path::{Path, PathBuf};

/// The xattr that marks a directory opaque for overlayfs.
const OPAQUE_XATTR: &str = "trusted.overlay.opaque";

/// How many ids a run's user namespace maps (its range's size).
const RANGE: u32 = 65_536;

/// The uid and gid a file owned outside a run's range shows as in it.
const OVERFLOW_ID: u32 = 65_534;

/// One state of a run's root.
#[derive(Clone, Debug)]
pub struct Side<'a> {
    /// The writable layer (None: nothing written yet, the image as it is).
    pub upper: Option<&'a Path>,
    /// The image's layers, base first.
    pub lowers: &'a [PathBuf],
    /// The first host id the upper's files are stored with (0: as the
    /// run saw them).
    pub id_base: u32,
}

/// What kind of file an entry is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    /// A regular file.
    File,
    /// A directory.
    Dir,
    /// A symbolic link.
    Symlink,
    /// A character device.
    CharDevice,
    /// A block device.
    BlockDevice,
    /// A named pipe.
    Fifo,
    /// A Unix socket.
    Socket,
}

impl Kind {
    /// Its name in the API.
    pub fn name(self) -> &'static str {
        match self {
            Kind::File => "file",
            Kind::Dir => "dir",
            Kind::Symlink => "symlink",
            Kind::CharDevice => "charDevice",
            Kind::BlockDevice => "blockDevice",
            Kind::Fifo => "fifo",
            Kind::Socket => "socket",
        }
    }
}

/// A path's entry on one side.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Entry {
    /// Its kind.
    pub kind: Kind,
    /// Permission bits, with setuid, setgid and sticky.
    pub mode: u32,
    /// Owner, as the run sees it.
    pub uid: u32,
    /// Group, as the run sees it.
    pub gid: u32,
    /// Bytes (a file's length, a link's target length; 0 for a
    /// directory).
    pub size: u64,
    /// A symbolic link's target.
    pub target: Option<String>,
    /// Where it is stored on the host (to read a file's contents).
    pub host_path: PathBuf,
    /// Change markers that say nothing to a caller but tell two copies
    /// of one file apart: (inode, mtime, ctime) within an upper layer.
    marks: (u64, i64, i64, i64, i64, u64),
}

/// How a path changed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Change {
    /// It exists after and not before.
    Added,
    /// It exists on both sides and differs.
    Modified,
    /// It existed before and does not after.
    Removed,
}

impl Change {
    /// Its name in the API.
    pub fn name(self) -> &'static str {
        match self {
            Change::Added => "added",
            Change::Modified => "modified",
            Change::Removed => "removed",
        }
    }
}

/// One changed path.
#[derive(Clone, Debug)]
pub struct Changed {
    /// Absolute, as the run sees it.
    pub path: String,
    /// How.
    pub change: Change,
    /// Its entry before (None when added).
    pub before: Option<Entry>,
    /// Its entry after (None when removed).
    pub after: Option<Entry>,
}

/// Counts of a diff.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Summary {
    /// Paths added.
    pub added: u64,
    /// Paths modified.
    pub modified: u64,
    /// Paths removed.
    pub removed: u64,
    /// Bytes of the files added or modified, as they are after.
    pub bytes: u64,
}

impl Summary {
    /// The counts of `changes`.
    pub fn of(changes: &[Changed]) -> Summary {
        let mut summary = Summary::default();
        for c in changes {
            match c.change {
                Change::Added => summary.added += 1,
                Change::Modified => summary.modified += 1,
                Change::Removed => summary.removed += 1,
            }
            if let Some(after) = c.after.as_ref().filter(|a| a.kind == Kind::File) {
                summary.bytes += after.size;
            }
        }
        summary
    }
}

/// What a [`diff`] found: the changed paths in path order, at most the
/// limit asked for, and whether more were left out.
#[derive(Clone, Debug, Default)]
pub struct Diff {
    /// The changes.
    pub changes: Vec<Changed>,
    /// More changes than the limit were found.
    pub truncated: bool,
}

/// The most paths a [`diff`] looks at (both writable layers' entries,
/// and what removed directories held): a run can make millions of empty
/// files within its disk limit, and the daemon must not hold them all.
pub const MAX_WALK: usize = 500_000;

/// The error a [`diff`] of more than [`MAX_WALK`] paths ends with.
#[derive(Debug, thiserror::Error)]
#[error("more than {MAX_WALK} paths to compare")]
pub struct TooManyPaths;

/// Whether `e` is a [`TooManyPaths`].
pub fn too_many(e: &io::Error) -> bool {
    e.get_ref().is_some_and(|inner| inner.is::<TooManyPaths>())
}

/// The paths whose entries differ between `before` and `after`, in path
/// order, at most `limit` of them. Paths below any of `skip` (relative,
/// e.g. `.runbox`) are not the run's own and are left out.
pub fn diff(before: &Side, after: &Side, skip: &[&str], limit: usize) -> io::Result<Diff> {
    let mut before = Resolver::new(before);
    let mut after = Resolver::new(after);
    let mut candidates = BTreeSet::new();
    for side in [&before, &after] {
        if let Some(upper) = side.side.upper {
            walk_upper(upper, Path::new(""), &mut candidates)?;
        }
    }
    let mut looked = candidates.len();
    let skipped = |rel: &Path| skip.iter().any(|s| rel.starts_with(s));
    let mut out = Diff::default();
    let mut queue: Vec<PathBuf> = candidates.into_iter().rev().collect();
    let mut seen = BTreeSet::new();
    let mut found: BTreeMap<PathBuf, Changed> = BTreeMap::new();
    while let Some(rel) = queue.pop() {
        if rel.as_os_str().is_empty() || skipped(&rel) || !seen.insert(rel.clone()) {
            continue;
        }
        let old = before.lookup(&rel)?;
        let new = after.lookup(&rel)?;
        // A directory on one side only, or made opaque on either (what
        // the image had there is hidden): what it held changed too.
        let is_dir = |e: &Option<Entry>| e.as_ref().is_some_and(|e| e.kind == Kind::Dir);
        let opaque =
            is_dir(&old) && is_dir(&new) && (before.opaque(&rel)? || after.opaque(&rel)?);
        for (side, entry, other) in [(&mut before, &old, &new), (&mut after, &new, &old)] {
            if is_dir(entry) && (!is_dir(other) || opaque) {
                for name in side.children(&rel)? {
                    looked += 1;
                    if looked > MAX_WALK {
                        return Err(io::Error::other(TooManyPaths));
                    }
                    queue.push(rel.join(name));
                }
            }
        }
        let change = match (&old, &new) {
            (None, None) => continue,
            (None, Some(_)) => Change::Added,
            (Some(_), None) => Change::Removed,
            (Some(a), Some(b)) if a.differs(b) => Change::Modified,
            _ => continue,
        };
        found.insert(
            rel.clone(),
            Changed {
                path: format!("/{}", rel.display()),
                change,
                before: old,
                after: new,
            },
        );
    }
    out.truncated = found.len() > limit;
    out.changes = found.into_values().take(limit).collect();
    Ok(out)
}

impl Entry {
    fn differs(&self, other: &Entry) -> bool {
        (self.kind, self.mode, self.uid, self.gid, self.size, &self.target)
            != (
                other.kind,
                other.mode,
                other.uid,
                other.gid,
                other.size,
                &other.target,
            )
            // Directories differ by what they hold, which is listed apart.
            || (self.kind != Kind::Dir && self.marks != other.marks)
    }
}

/// Every path an upper layer holds (whiteouts included), relative.
fn walk_upper(root: &Path, rel: &Path, out: &mut BTreeSet<PathBuf>) -> io::Result<()> {
    let dir = root.join(rel);
    let entries = match fs::read_dir(&dir) {
        Ok(entries) => entries,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(e),
    };
    for entry in entries {
        let entry = entry?;
        let path = rel.join(entry.file_name());
        let is_dir = entry.file_type()?.is_dir();
        if out.len() >= MAX_WALK {
            return Err(io::Error::other(TooManyPaths));
        }
        out.insert(path.clone());
        if is_dir {
            walk_upper(root, &path, out)?;
        }
    }
    Ok(())
}

/// What a directory path is in one layer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum DirState {
    /// Not there: look below.
    Missing,
    /// A directory; opaque ones hide the layers below.
    Dir { opaque: bool },
    /// Something that hides the layers below (a whiteout, a file).
    Hides,
}

/// Looks paths up in one side's layer stack, overlayfs' way.
struct Resolver<'a> {
    side: &'a Side<'a>,
    /// Top first: the upper (with its id base), then the lowers.
    layers: Vec<(&'a Path, u32)>,
    dirs: HashMap<(usize, PathBuf), DirState>,
}

impl<'a> Resolver<'a> {
    fn new(side: &'a Side<'a>) -> Resolver<'a> {
        let mut layers = Vec::new();
        if let Some(upper) = side.upper {
            layers.push((upper, side.id_base));
        }
        layers.extend(side.lowers.iter().rev().map(|l| (l.as_path(), 0)));
        Resolver {
            side,
            layers,
            dirs: HashMap::new(),
        }
    }

    fn dir_state(&mut self, layer: usize, rel: &Path) -> io::Result<DirState> {
        if let Some(state) = self.dirs.get(&(layer, rel.to_path_buf())) {
            return Ok(*state);
        }
        let path = self.layers[layer].0.join(rel);
        let state = match fs::symlink_metadata(&path) {
            Ok(meta) if meta.is_dir() => DirState::Dir {
                opaque: is_opaque(&path),
            },
            Ok(_) => DirState::Hides,
            Err(e) if e.kind() == io::ErrorKind::NotFound => DirState::Missing,
            Err(e) => return Err(e),
        };
        self.dirs.insert((layer, rel.to_path_buf()), state);
        Ok(state)
    }

    /// Whether `rel`'s parents let layer `layer` show it, and whether
    /// they hide the layers below it.
    fn reachable(&mut self, layer: usize, rel: &Path) -> io::Result<(bool, bool)> {
        let mut stop = false;
        for parent in rel.ancestors().skip(1) {
            if parent.as_os_str().is_empty() {
                break;
            }
            match self.dir_state(layer, parent)? {
                DirState::Missing => return Ok((false, stop)),
                DirState::Hides => return Ok((false, true)),
                DirState::Dir { opaque } => stop |= opaque,
            }
        }
        Ok((true, stop))
    }

    /// Whether `rel` is an opaque directory in this side's upper.
    fn opaque(&mut self, rel: &Path) -> io::Result<bool> {
        if self.side.upper.is_none() {
            return Ok(false);
        }
        Ok(self.dir_state(0, rel)? == DirState::Dir { opaque: true })
    }

    /// `rel`'s entry on this side, if it has one.
    fn lookup(&mut self, rel: &Path) -> io::Result<Option<Entry>> {
        for layer in 0..self.layers.len() {
            let (reachable, stop) = self.reachable(layer, rel)?;
            if reachable {
                let (root, base) = self.layers[layer];
                let path = root.join(rel);
                match fs::symlink_metadata(&path) {
                    Ok(meta) if is_whiteout(&meta) => return Ok(None),
                    Ok(meta) => return Ok(Some(entry(path, &meta, base)?)),
                    Err(e) if e.kind() == io::ErrorKind::NotFound => {}
                    Err(e) => return Err(e),
                }
            }
            if stop {
                return Ok(None);
            }
        }
        Ok(None)
    }

    /// The names a directory holds on this side, merged over its layers.
    fn children(&mut self, rel: &Path) -> io::Result<BTreeSet<std::ffi::OsString>> {
        let mut names = BTreeSet::new();
        let mut hidden = BTreeSet::new();
        for layer in 0..self.layers.len() {
            let (reachable, stop) = self.reachable(layer, rel)?;
            let mut stop_here = stop;
            if reachable {
                match self.dir_state(layer, rel)? {
                    DirState::Dir { opaque } => {
                        let dir = self.layers[layer].0.join(rel);
                        for entry in fs::read_dir(&dir)? {
                            let entry = entry?;
                            let name = entry.file_name();
                            if hidden.contains(&name) || names.contains(&name) {
                                continue;
                            }
                            if is_whiteout(&entry.metadata()?) {
                                hidden.insert(name);
                            } else {
                                names.insert(name);
                            }
                        }
                        stop_here |= opaque;
                    }
                    DirState::Hides => stop_here = true,
                    DirState::Missing => {}
                }
            }
            if stop_here {
                break;
            }
        }
        Ok(names)
    }
}

fn is_whiteout(meta: &fs::Metadata) -> bool {
    meta.file_type().is_char_device() && meta.rdev() == 0
}

fn is_opaque(dir: &Path) -> bool {
    matches!(xattr_value(dir, OPAQUE_XATTR), Some(v) if v == b"y")
}

/// An extended attribute of `path` (not following a link), if set.
fn xattr_value(path: &Path, name: &str) -> Option<Vec<u8>> {
    let mut buf = vec![0u8; 16];
    let n = rustix::fs::lgetxattr(path, name, &mut buf).ok()?;
    buf.truncate(n);
    Some(buf)
}

fn entry(path: PathBuf, meta: &fs::Metadata, base: u32) -> io::Result<Entry> {
    let ft = meta.file_type();
    let kind = if ft.is_dir() {
        Kind::Dir
    } else if ft.is_symlink() {
        Kind::Symlink
    } else if ft.is_char_device() {
        Kind::CharDevice
    } else if ft.is_block_device() {
        Kind::BlockDevice
    } else if ft.is_fifo() {
        Kind::Fifo
    } else if ft.is_socket() {
        Kind::Socket
    } else {
        Kind::File
    };
    let target = match kind {
        Kind::Symlink => Some(fs::read_link(&path)?.to_string_lossy().into_owned()),
        _ => None,
    };
    let shift = |id: u32| match base {
        0 => id,
        base if (base..base.saturating_add(RANGE)).contains(&id) => id - base,
        _ => OVERFLOW_ID,
    };
    Ok(Entry {
        kind,
        mode: meta.mode() & 0o7777,
        uid: shift(meta.uid()),
        gid: shift(meta.gid()),
        // A directory's size is the storage's business (what it holds is
        // listed path by path).
        size: if kind == Kind::Dir { 0 } else { meta.len() },
        target,
        marks: (
            meta.ino(),
            meta.mtime(),
            meta.mtime_nsec(),
            meta.ctime(),
            meta.ctime_nsec(),
            meta.nlink(),
        ),
        host_path: path,
    })
}

/// The most bytes of one file a patch reads.
pub const PATCH_FILE_MAX: u64 = 1 << 20;

/// A file's text for a patch: None when it is binary (a NUL byte, or not
/// UTF-8) or larger than [`PATCH_FILE_MAX`] or `budget`. Opened without
/// following a link or blocking on a FIFO, and read only if it is still
/// a regular file (a layer is read-only, but never trusted).
fn patch_text(entry: Option<&Entry>, budget: u64) -> io::Result<Option<String>> {
    use std::os::unix::fs::OpenOptionsExt;
    let Some(entry) = entry else {
        return Ok(Some(String::new()));
    };
    let max = PATCH_FILE_MAX.min(budget);
    if entry.kind != Kind::File || entry.size > max {
        return Ok(None);
    }
    let file = fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK)
        .open(&entry.host_path)?;
    if !file.metadata()?.is_file() {
        return Ok(None);
    }
    let mut bytes = Vec::new();
    file.take(max + 1).read_to_end(&mut bytes)?;
    if bytes.len() as u64 > max {
        return Ok(None);
    }
    if bytes.contains(&0) {
        return Ok(None);
    }
    Ok(String::from_utf8(bytes).ok())
}

/// What a change's patch is.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Patch {
    /// A unified diff of the file's text.
    Text(String),
    /// The file is binary, too large or not a file on one side.
    Binary,
}

/// How long one file's diff may take before `similar` settles for a
/// coarser one.
const PATCH_TIME: std::time::Duration = std::time::Duration::from_millis(200);

/// A unified diff of a changed regular file (from `a/<path>` to
/// `b/<path>`, 3 lines of context), reading at most `budget` bytes of
/// each side; None for what is not a file on either side.
pub fn patch(change: &Changed, budget: u64) -> io::Result<Option<Patch>> {
    let is_file = |e: &Option<Entry>| e.as_ref().is_some_and(|e| e.kind == Kind::File);
    if !is_file(&change.before) && !is_file(&change.after) {
        return Ok(None);
    }
    let old = patch_text(
        change.before.as_ref().filter(|e| e.kind == Kind::File),
        budget,
    )?;
    let new = patch_text(
        change.after.as_ref().filter(|e| e.kind == Kind::File),
        budget,
    )?;
    let (Some(old), Some(new)) = (old, new) else {
        return Ok(Some(Patch::Binary));
    };
    let path = change.path.trim_start_matches('/');
    let text = similar::TextDiff::configure()
        .timeout(PATCH_TIME)
        .diff_lines(&old, &new)
        .unified_diff()
        .context_radius(3)
        .header(&format!("a/{path}"), &format!("b/{path}"))
        .to_string();
    Ok(Some(Patch::Text(text)))
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::{symlink, PermissionsExt};

    use super::*;

    fn whiteout(path: &Path) {
        rustix::fs::mknodat(
            rustix::fs::CWD,
            path,
            rustix::fs::FileType::CharacterDevice,
            rustix::fs::Mode::empty(),
            0,
        )
        .unwrap();
    }

    fn paths(diff: &Diff) -> Vec<(String, &'static str)> {
        diff.changes
            .iter()
            .map(|c| (c.path.clone(), c.change.name()))
            .collect()
    }

    #[test]
    fn changes_are_found_over_the_image_layers() {
        let dir = tempfile::tempdir().unwrap();
        let lower = dir.path().join("lower");
        fs::create_dir_all(lower.join("etc/conf.d")).unwrap();
        fs::write(lower.join("etc/hosts"), "a\n").unwrap();
        fs::write(lower.join("etc/conf.d/x"), "x").unwrap();
        fs::write(lower.join("etc/conf.d/y"), "y").unwrap();
        fs::create_dir_all(lower.join("opt/keep")).unwrap();
        fs::write(lower.join("opt/keep/old"), "o").unwrap();
        let lowers = [lower];
        // Before: one file written.
        let one = dir.path().join("one");
        fs::create_dir_all(one.join("work")).unwrap();
        fs::write(one.join("work/a.txt"), "hello\n").unwrap();
        // After: a.txt edited, hosts replaced, conf.d removed, opt/keep
        // made opaque with a new file, a symlink.
        let two = dir.path().join("two");
        fs::create_dir_all(two.join("work")).unwrap();
        fs::write(two.join("work/a.txt"), "hello\nworld\n").unwrap();
        fs::create_dir_all(two.join("etc")).unwrap();
        fs::write(two.join("etc/hosts"), "b\n").unwrap();
        fs::set_permissions(two.join("etc/hosts"), fs::Permissions::from_mode(0o600)).unwrap();
        whiteout(&two.join("etc/conf.d"));
        fs::create_dir_all(two.join("opt/keep")).unwrap();
        rustix::fs::setxattr(
            two.join("opt/keep").as_path(),
            OPAQUE_XATTR,
            b"y",
            rustix::fs::XattrFlags::empty(),
        )
        .unwrap();
        fs::write(two.join("opt/keep/new"), "n").unwrap();
        symlink("a.txt", two.join("work/link")).unwrap();
        fs::create_dir_all(two.join(".runbox")).unwrap();
        let before = Side {
            upper: Some(&one),
            lowers: &lowers,
            id_base: 0,
        };
        let after = Side {
            upper: Some(&two),
            lowers: &lowers,
            id_base: 0,
        };
        let d = diff(&before, &after, &[".runbox"], 100).unwrap();
        assert_eq!(
            paths(&d),
            [
                ("/etc/conf.d".to_owned(), "removed"),
                ("/etc/conf.d/x".to_owned(), "removed"),
                ("/etc/conf.d/y".to_owned(), "removed"),
                ("/etc/hosts".to_owned(), "modified"),
                ("/opt/keep/new".to_owned(), "added"),
                ("/opt/keep/old".to_owned(), "removed"),
                ("/work/a.txt".to_owned(), "modified"),
                ("/work/link".to_owned(), "added"),
            ]
        );
        let hosts = &d.changes[3];
        assert_ne!(hosts.before.as_ref().unwrap().mode, 0o600);
        assert_eq!(hosts.after.as_ref().unwrap().mode, 0o600);
        let link = d.changes[7].after.as_ref().unwrap();
        assert_eq!(
            (link.kind, link.target.as_deref()),
            (Kind::Symlink, Some("a.txt"))
        );
        let Some(Patch::Text(text)) = patch(&d.changes[6], u64::MAX).unwrap() else {
            panic!("a text patch")
        };
        assert!(text.contains("+world"), "{text}");
        assert!(text.contains("--- a/work/a.txt"), "{text}");
        // Nothing between a side and itself; the limit is kept.
        assert!(diff(&after, &after, &[], 100).unwrap().changes.is_empty());
        let cut = diff(&before, &after, &[".runbox"], 2).unwrap();
        assert_eq!((cut.changes.len(), cut.truncated), (2, true));
        // Against the image alone: what the upper added.
        let image = Side {
            upper: None,
            lowers: &lowers,
            id_base: 0,
        };
        let first = diff(&image, &before, &[], 100).unwrap();
        assert_eq!(
            paths(&first),
            [
                ("/work".to_owned(), "added"),
                ("/work/a.txt".to_owned(), "added")
            ]
        );
        assert_eq!(Summary::of(&first.changes).bytes, 6);
    }

    #[test]
    fn owners_are_shown_as_the_run_saw_them_and_binaries_named() {
        let dir = tempfile::tempdir().unwrap();
        let upper = dir.path().join("upper");
        fs::create_dir(&upper).unwrap();
        fs::write(upper.join("bin"), [0u8, 1, 2]).unwrap();
        std::os::unix::fs::lchown(upper.join("bin"), Some(200_000 + 1000), Some(200_000 + 5))
            .unwrap();
        let lowers: [PathBuf; 0] = [];
        let image = Side {
            upper: None,
            lowers: &lowers,
            id_base: 200_000,
        };
        let after = Side {
            upper: Some(&upper),
            lowers: &lowers,
            id_base: 200_000,
        };
        let d = diff(&image, &after, &[], 10).unwrap();
        let bin = d.changes[0].after.as_ref().unwrap();
        assert_eq!((bin.uid, bin.gid), (1000, 5));
        assert_eq!(patch(&d.changes[0], u64::MAX).unwrap(), Some(Patch::Binary));
    }
}
