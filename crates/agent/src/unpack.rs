//! The Unpack RPC (protocol 8): a tar archive the daemon streams in,
//! written entry by entry into a directory of the run's root filesystem.
//! Image builds use it for a Dockerfile's COPY.
//!
//! Owns what an archive may put where, and who owns what it writes. It does
//! not make archives (the daemon's builder does), nor confine paths itself:
//! every lookup goes through `runbox_confine` from a descriptor on the
//! run's `/`, as the file RPCs with `root` do.
//!
//! One call, step by step:
//!
//! 1. The header: `dest` is checked as any root-scoped path, and the user
//!    is resolved in the run's account files before anything is made.
//! 2. A blocking thread makes `dest` (mkdir -p; what it makes belongs to
//!    the user) and reads the archive from the data chunks as they arrive
//!    ([`ChunkReader`]): a few chunks are buffered, never the archive.
//! 3. Each entry's name is checked (relative, no `..`) and its type
//!    (files, directories, symlinks, hard links; never devices or fifos).
//!    Its parents resolve with `openat2(RESOLVE_IN_ROOT)`: a symlink that
//!    was in the run before resolves as the run's commands see it (`/bin`
//!    on a merged-/usr image), and none leads out of the run. A symlink
//!    this archive wrote is never followed: a later entry below it is
//!    refused. Files go through a temporary file renamed over the name
//!    (so a symlink there is replaced, not written through).
//! 4. Directories get their modification times last, once nothing more is
//!    written into them.
//! 5. After `commit` the rest of the stream (the zero blocks that pad an
//!    archive) is read and dropped, and the counts are the answer.
//!
//! Cancellation rule: an Unpack is not all-or-nothing. If the call ends
//! without `commit` (the stream ends or breaks, or the handler future is
//! dropped because the daemon went away), the thread's reader reports a
//! broken stream, the entry being written fails, and the entries before it
//! stay. The build that asked throws the whole run away.

use std::collections::HashMap;
use std::io::{self, Read};
use std::os::fd::OwnedFd;
use std::os::unix::ffi::OsStrExt;
use std::path::Path;
use std::sync::Arc;

use runbox_agent_proto::pb::{unpack_chunk, UnpackChunk, UnpackHeader, UnpackReply};
use runbox_confine::ops::{self, NewFile, Owner};
use runbox_confine::{open_beneath, RelPath, Root};
use rustix::fs::{AtFlags, FileType, Mode, OFlags, Timespec, Timestamps};
use rustix::io::Errno;
use tokio::sync::mpsc;
use tonic::{Status, Streaming};

use crate::confine::{FileError, WorkDir};

/// Chunks buffered between the call and the thread writing entries.
const CHUNKS_BUFFERED: usize = 4;

/// The owner of what an unpack writes when its header names no user.
const ROOT: Owner = Owner { uid: 0, gid: 0 };

/// Runs one Unpack call: checks the header, hands the archive to a
/// blocking thread chunk by chunk, and answers what it wrote.
///
/// Cancellation: dropping this future drops the channel to the thread,
/// which then stops at the entry it is writing (see the module's rule).
pub async fn unpack(
    file_system: Arc<WorkDir>,
    mut input: Streaming<UnpackChunk>,
) -> Result<UnpackReply, Status> {
    let UnpackHeader { dest, user, mode } = match input.message().await? {
        Some(UnpackChunk {
            kind: Some(unpack_chunk::Kind::Header(header)),
        }) => header,
        _ => {
            return Err(FileError::InvalidRequest(
                "the first unpack message must be a header with the destination",
            )
            .into())
        }
    };
    let dest = file_system.parse_or_root(&dest)?;
    if mode & !0o7777 != 0 {
        return Err(FileError::InvalidRequest(
            "mode has bits beyond the permission, set-id and sticky bits",
        )
        .into());
    }
    let (tx, rx) = mpsc::channel(CHUNKS_BUFFERED);
    let reader = ChunkReader::new(rx);
    let writer = tokio::task::spawn_blocking(move || {
        unpack_archive(&file_system, dest.as_ref(), &user, mode, reader)
    });
    let fed = feed(&mut input, &tx).await;
    drop(tx);
    let written = writer.await.map_err(|err| {
        Status::from(FileError::Internal(format!(
            "the unpack did not finish: {err}"
        )))
    })?;
    // When the stream failed on the call's side, that is the reason; the
    // thread's error (a broken-off archive) is only its echo.
    fed?;
    Ok(written?)
}

/// Forwards the archive's chunks to the writing thread until `commit`.
/// Returns early, without error, when the thread stopped: its own error
/// says why.
async fn feed(input: &mut Streaming<UnpackChunk>, tx: &mpsc::Sender<Piece>) -> Result<(), Status> {
    loop {
        let message = tokio::select! {
            // The thread refused an entry: answer now rather than at the
            // next chunk, which may be slow to come.
            () = tx.closed() => return Ok(()),
            message = input.message() => message?,
        };
        match message {
            Some(UnpackChunk {
                kind: Some(unpack_chunk::Kind::Data(data)),
            }) => {
                if tx.send(Piece::Data(data)).await.is_err() {
                    return Ok(());
                }
            }
            Some(UnpackChunk {
                kind: Some(unpack_chunk::Kind::Commit(_)),
            }) => {
                let _ = tx.send(Piece::End).await;
                return Ok(());
            }
            Some(UnpackChunk {
                kind: Some(unpack_chunk::Kind::Header(_)),
            }) => {
                return Err(
                    FileError::InvalidRequest("an unpack carries exactly one header").into(),
                )
            }
            // An empty message carries nothing; skip it.
            Some(UnpackChunk { kind: None }) => {}
            None => {
                return Err(FileError::InvalidRequest(
                    "the stream ended before commit; the entries that arrived were written",
                )
                .into())
            }
        }
    }
}

/// What the call hands the writing thread.
enum Piece {
    /// The next bytes of the archive.
    Data(Vec<u8>),
    /// `commit`: the archive is complete.
    End,
}

/// The archive as a [`Read`] over the chunks the call receives; a read
/// blocks the thread until the next chunk arrives. The end of the archive
/// is `commit`; a channel closed before it is a broken stream, an error.
struct ChunkReader {
    rx: mpsc::Receiver<Piece>,
    chunk: Vec<u8>,
    /// How much of `chunk` was read.
    at: usize,
    ended: bool,
}

impl ChunkReader {
    fn new(rx: mpsc::Receiver<Piece>) -> Self {
        Self {
            rx,
            chunk: Vec::new(),
            at: 0,
            ended: false,
        }
    }
}

impl Read for ChunkReader {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        loop {
            if self.at < self.chunk.len() {
                let n = buf.len().min(self.chunk.len() - self.at);
                buf[..n].copy_from_slice(&self.chunk[self.at..self.at + n]);
                self.at += n;
                return Ok(n);
            }
            if self.ended || buf.is_empty() {
                return Ok(0);
            }
            match self.rx.blocking_recv() {
                Some(Piece::Data(data)) => {
                    self.chunk = data;
                    self.at = 0;
                }
                Some(Piece::End) => self.ended = true,
                None => {
                    return Err(io::Error::new(
                        io::ErrorKind::UnexpectedEof,
                        "the archive stream broke off before commit",
                    ))
                }
            }
        }
    }
}

/// What an archive entry is, for what it becomes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    File,
    Dir,
    Symlink,
    HardLink,
    /// Metadata for the whole archive (a PAX global header): nothing to
    /// write.
    Skip,
}

/// The kind of an entry of `entry_type`; `Err` says why it is refused.
fn kind_of(entry_type: tar::EntryType) -> Result<Kind, &'static str> {
    use tar::EntryType as T;
    match entry_type {
        // A GNU sparse file reads back whole; a contiguous file is an
        // ordinary one everywhere but on a few old Unixes.
        T::Regular | T::Continuous | T::GNUSparse => Ok(Kind::File),
        T::Directory => Ok(Kind::Dir),
        T::Symlink => Ok(Kind::Symlink),
        T::Link => Ok(Kind::HardLink),
        T::XGlobalHeader => Ok(Kind::Skip),
        T::Char | T::Block | T::Fifo => {
            Err("it is a device or a fifo, which an unpack never creates")
        }
        _ => Err("its entry type is not one an unpack writes"),
    }
}

/// The components of an archive name below the destination (none: the
/// destination itself, as `./`); `Err` says why the name is refused.
/// Names are only ever relative: an absolute one is refused, not rebased.
fn entry_components(name: &str) -> Result<Vec<&str>, &'static str> {
    if name.starts_with('/') {
        return Err("it is absolute; the names in an archive are relative to its destination");
    }
    let mut parts = Vec::new();
    for part in name.split('/') {
        match part {
            "" | "." => {}
            ".." => return Err("it contains a '..' component"),
            part => parts.push(part),
        }
    }
    Ok(parts)
}

/// The permission bits an entry of `kind` gets: the header's when it sets
/// any, else the archive's (set-id and sticky bits included, as `tar -p`
/// keeps them). None for a symlink, whose bits mean nothing on Linux, and
/// a hard link, which shares an earlier entry's.
fn mode_for(kind: Kind, archive: u32, header: u32) -> Option<u32> {
    match kind {
        Kind::File | Kind::Dir if header != 0 => Some(header & 0o7777),
        Kind::File | Kind::Dir => Some(archive & 0o7777),
        Kind::Symlink | Kind::HardLink | Kind::Skip => None,
    }
}

/// Access and modification time both `mtime` (seconds), as `tar` sets them.
fn times(mtime: u64) -> Timestamps {
    let at = Timespec {
        tv_sec: i64::try_from(mtime).unwrap_or(i64::MAX),
        tv_nsec: 0,
    };
    Timestamps {
        last_access: at,
        last_modification: at,
    }
}

/// Unpacks the archive `reader` yields below `dest` of `work` (None: its
/// root itself), owned by `user` (empty: root) and with `mode` (0: the
/// archive's). Blocks; returns once the reader ended at `commit`.
fn unpack_archive(
    work: &WorkDir,
    dest: Option<&RelPath>,
    user: &str,
    mode: u32,
    reader: impl Read,
) -> Result<UnpackReply, FileError> {
    // Resolved before anything is made: an unknown owner changes nothing.
    let owner = crate::user::owner(user)?.unwrap_or(ROOT);
    let root = work.open()?;
    let shown = dest.map_or("/", RelPath::original).to_owned();
    if let Some(dest) = dest {
        make_dest(work, &root, dest, owner)?;
    }
    let mut unpacker = Unpacker {
        work,
        root,
        dest: dest.map(RelPath::normalized).unwrap_or_default(),
        owner,
        mode,
        written: HashMap::new(),
        dir_times: Vec::new(),
        reply: UnpackReply::default(),
    };
    let read_error = |source| FileError::Io {
        op: "read the archive for",
        path: shown.clone(),
        source,
    };
    let mut archive = tar::Archive::new(reader);
    for entry in archive.entries().map_err(read_error)? {
        unpacker.entry(entry.map_err(read_error)?)?;
    }
    unpacker.finish()?;
    // After the archive's end come only the zero blocks that pad it: read
    // them, and anything else, up to `commit`, so that success means the
    // whole stream arrived.
    io::copy(&mut archive.into_inner(), &mut io::sink()).map_err(read_error)?;
    Ok(unpacker.reply)
}

/// Makes `dest` and its missing parents, owned by `owner`. An existing
/// directory is fine, and so is a symlink to one (`/bin` on a merged-/usr
/// image), followed as the run's commands would.
fn make_dest(work: &WorkDir, root: &Root, dest: &RelPath, owner: Owner) -> Result<(), FileError> {
    match ops::make_dir(work, dest, 0, Some(owner)) {
        Err(err @ FileError::NotADirectory { .. }) if !resolves_to_dir(root, dest) => Err(err),
        Ok(_) | Err(FileError::NotADirectory { .. }) => Ok(()),
        Err(err) => Err(err),
    }
}

/// Whether `rel` resolves, symlinks followed within the root, to a
/// directory.
fn resolves_to_dir(root: &Root, rel: &RelPath) -> bool {
    open_beneath(
        root,
        &rel.normalized(),
        OFlags::PATH | OFlags::DIRECTORY,
        Mode::empty(),
    )
    .is_ok()
}

/// One unpack in progress: where it writes, and what it wrote so far.
struct Unpacker<'a> {
    work: &'a WorkDir,
    root: Root,
    /// The destination relative to the root ("" for the root itself).
    dest: String,
    owner: Owner,
    /// The header's mode (0: the archive's).
    mode: u32,
    /// What this archive last put at each name (relative to the
    /// destination): its symlinks are never followed, and hard links only
    /// go to its files.
    written: HashMap<String, Kind>,
    /// Directories and their modification times, set at the end.
    dir_times: Vec<(RelPath, u64)>,
    reply: UnpackReply,
}

impl Unpacker<'_> {
    /// Writes one entry.
    fn entry<R: Read>(&mut self, mut entry: tar::Entry<'_, R>) -> Result<(), FileError> {
        let name = entry.path_bytes();
        let shown = String::from_utf8_lossy(&name).into_owned();
        let refuse = |reason| FileError::InvalidPath {
            path: shown.clone(),
            reason,
        };
        let name = String::from_utf8(name.into_owned()).map_err(|_| refuse("it is not UTF-8"))?;
        let header_error = |source| FileError::Io {
            op: "read the archive header of",
            path: shown.clone(),
            source,
        };
        let kind = kind_of(entry.header().entry_type()).map_err(refuse)?;
        if kind == Kind::Skip {
            return Ok(());
        }
        let parts = entry_components(&name).map_err(refuse)?;
        if parts.is_empty() {
            // The destination itself, made (or found) from the header.
            return Ok(());
        }
        // A directory merges into what is at its name, so it may not be a
        // symlink of this archive either.
        let through = if kind == Kind::Dir {
            parts.len()
        } else {
            parts.len() - 1
        };
        if (1..=through).any(|n| self.written.get(&parts[..n].join("/")) == Some(&Kind::Symlink)) {
            return Err(refuse(
                "it is at or below a symlink the same archive wrote, which an unpack never follows",
            ));
        }
        let key = parts.join("/");
        let rel = self.rel(&key)?;
        let mode = mode_for(
            kind,
            entry.header().mode().map_err(header_error)?,
            self.mode,
        );
        let mtime = entry.header().mtime().map_err(header_error)?;
        let link = || -> Result<Vec<u8>, FileError> {
            entry
                .link_name_bytes()
                .map(|target| target.into_owned())
                .filter(|target| !target.is_empty())
                .ok_or_else(|| refuse("it is a link without a target"))
        };
        let written = match kind {
            Kind::File => {
                let size = entry.size();
                let bytes = self.file(&rel, &mut entry, size, mode.unwrap_or(0), mtime)?;
                self.reply.bytes += bytes;
                Kind::File
            }
            Kind::Dir => {
                self.dir(&rel, mode.unwrap_or(0), mtime)?;
                Kind::Dir
            }
            Kind::Symlink => {
                let target = link()?;
                self.symlink(&rel, &target, mtime)?;
                Kind::Symlink
            }
            Kind::HardLink => {
                let target = String::from_utf8(link()?)
                    .map_err(|_| refuse("it links to a name that is not UTF-8"))?;
                let target = entry_components(&target).map_err(refuse)?.join("/");
                if self.written.get(&target) != Some(&Kind::File) {
                    return Err(refuse(
                        "it is a hard link to a name that no earlier file of the archive has",
                    ));
                }
                if target != key {
                    self.hard_link(&self.rel(&target)?, &rel)?;
                }
                Kind::File
            }
            Kind::Skip => unreachable!("skipped above"),
        };
        self.written.insert(key, written);
        self.reply.entries += 1;
        Ok(())
    }

    /// The path of `key` (a name below the destination) in the root.
    fn rel(&self, key: &str) -> Result<RelPath, FileError> {
        let path = if self.dest.is_empty() {
            format!("/{key}")
        } else {
            format!("/{}/{key}", self.dest)
        };
        self.work.parse(&path)
    }

    /// Writes a file entry of `size` bytes: a temporary file beside the
    /// name, renamed over whatever is there (but a directory). The bytes
    /// written.
    fn file(
        &self,
        rel: &RelPath,
        contents: &mut impl Read,
        size: u64,
        mode: u32,
        mtime: u64,
    ) -> Result<u64, FileError> {
        let original = rel.original();
        let new = NewFile {
            mode: 0o600,
            owner: Some(self.owner),
            xattrs: None,
        };
        let (temp, mut file) = ops::create_temp(self.work, rel, new)?;
        let bytes = io::copy(contents, &mut file).map_err(|source| FileError::Io {
            op: "write",
            path: original.to_owned(),
            source,
        })?;
        if bytes != size {
            // The archive ended inside the file (an entry's reader ends
            // quietly at the archive's end): the temporary file goes.
            return Err(FileError::Io {
                op: "write",
                path: original.to_owned(),
                source: io::Error::new(
                    io::ErrorKind::UnexpectedEof,
                    format!("the archive ends after {bytes} of its {size} bytes"),
                ),
            });
        }
        // Exactly the entry's bits (the umask plays no part), after the
        // chown, which would clear set-id bits.
        rustix::fs::fchmod(&file, Mode::from_raw_mode(mode))
            .map_err(|e| FileError::from_errno(e, "set the mode of", original))?;
        rustix::fs::futimens(&file, &times(mtime))
            .map_err(|e| FileError::from_errno(e, "set the times of", original))?;
        drop(file);
        temp.commit(rel, true)?;
        Ok(bytes)
    }

    /// Writes a directory entry: made when missing, merged into when there.
    /// Either way it gets the owner and mode; its time comes at the end.
    fn dir(&mut self, rel: &RelPath, mode: u32, mtime: u64) -> Result<(), FileError> {
        let original = rel.original();
        let parent = ops::open_parent(&self.root, rel, Some(self.owner))?;
        let name = rel.file_name();
        // Owner-only until the chown and chmod below.
        match rustix::fs::mkdirat(&parent, name, Mode::from_raw_mode(0o700)) {
            Ok(()) | Err(Errno::EXIST) => {}
            Err(e) => return Err(FileError::from_errno(e, "create", original)),
        }
        let flags = OFlags::RDONLY | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC;
        let dir = match rustix::fs::openat(&parent, name, flags, Mode::empty()) {
            Ok(dir) => dir,
            // A symlink the run had to a directory is merged into, as its
            // commands would see it; it and its target keep their owner
            // and mode.
            Err(Errno::LOOP | Errno::NOTDIR) if resolves_to_dir(&self.root, rel) => return Ok(()),
            Err(Errno::LOOP | Errno::NOTDIR) => {
                return Err(FileError::NotADirectory {
                    path: original.to_owned(),
                    target: original.to_owned(),
                })
            }
            Err(e) => return Err(FileError::from_errno(e, "open", original)),
        };
        rustix::fs::fchown(
            &dir,
            Some(rustix::process::Uid::from_raw(self.owner.uid)),
            Some(rustix::process::Gid::from_raw(self.owner.gid)),
        )
        .map_err(|e| FileError::from_errno(e, "set the owner of", original))?;
        rustix::fs::fchmod(&dir, Mode::from_raw_mode(mode))
            .map_err(|e| FileError::from_errno(e, "set the mode of", original))?;
        self.dir_times.push((rel.clone(), mtime));
        Ok(())
    }

    /// Writes a symlink entry as the link itself, replacing what is at its
    /// name (but a directory).
    fn symlink(&self, rel: &RelPath, target: &[u8], mtime: u64) -> Result<(), FileError> {
        let original = rel.original();
        let parent = ops::open_parent(&self.root, rel, Some(self.owner))?;
        let name = rel.file_name();
        let target = Path::new(std::ffi::OsStr::from_bytes(target));
        let made = match rustix::fs::symlinkat(target, &parent, name) {
            Err(Errno::EXIST) => {
                clear(&parent, rel)?;
                rustix::fs::symlinkat(target, &parent, name)
            }
            other => other,
        };
        made.map_err(|e| FileError::from_errno(e, "create the symlink", original))?;
        rustix::fs::chownat(
            &parent,
            name,
            Some(rustix::process::Uid::from_raw(self.owner.uid)),
            Some(rustix::process::Gid::from_raw(self.owner.gid)),
            AtFlags::SYMLINK_NOFOLLOW,
        )
        .map_err(|e| FileError::from_errno(e, "set the owner of", original))?;
        rustix::fs::utimensat(&parent, name, &times(mtime), AtFlags::SYMLINK_NOFOLLOW)
            .map_err(|e| FileError::from_errno(e, "set the times of", original))
    }

    /// Writes a hard link entry: `rel` becomes another name of the file at
    /// `target`, which this archive wrote earlier.
    fn hard_link(&self, target: &RelPath, rel: &RelPath) -> Result<(), FileError> {
        let original = rel.original();
        let from = ops::open_parent(&self.root, target, Some(self.owner))?;
        let to = ops::open_parent(&self.root, rel, Some(self.owner))?;
        // No AT_SYMLINK_FOLLOW: the link is to the name's own inode.
        let link = || {
            rustix::fs::linkat(
                &from,
                target.file_name(),
                &to,
                rel.file_name(),
                AtFlags::empty(),
            )
        };
        let made = match link() {
            Err(Errno::EXIST) => {
                clear(&to, rel)?;
                link()
            }
            other => other,
        };
        made.map_err(|e| FileError::from_errno(e, "create the hard link", original))
    }

    /// Sets the directories' modification times, now that nothing more is
    /// written into them.
    fn finish(&mut self) -> Result<(), FileError> {
        for (rel, mtime) in self.dir_times.drain(..) {
            let flags = OFlags::RDONLY | OFlags::DIRECTORY | OFlags::NOFOLLOW;
            let set = open_beneath(&self.root, &rel.normalized(), flags, Mode::empty())
                .and_then(|dir| rustix::fs::futimens(&dir, &times(mtime)));
            set.map_err(|e| FileError::from_errno(e, "set the times of", rel.original()))?;
        }
        Ok(())
    }
}

/// Removes what is at `rel` in `parent` so that a symlink or hard link can
/// take its name: anything but a directory, which only a directory entry
/// may be at.
fn clear(parent: &OwnedFd, rel: &RelPath) -> Result<(), FileError> {
    let name = rel.file_name();
    let stat = rustix::fs::statat(parent, name, AtFlags::SYMLINK_NOFOLLOW)
        .map_err(|e| FileError::from_errno(e, "inspect", rel.original()))?;
    if FileType::from_raw_mode(stat.st_mode) == FileType::Directory {
        return Err(FileError::NotAFile {
            path: rel.original().to_owned(),
            what: "a directory",
        });
    }
    rustix::fs::unlinkat(parent, name, AtFlags::empty())
        .map_err(|e| FileError::from_errno(e, "replace", rel.original()))
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::MetadataExt;
    use std::path::PathBuf;

    use super::*;

    #[test]
    fn names_are_relative_and_never_climb() {
        assert_eq!(entry_components("a/./b//c").unwrap(), ["a", "b", "c"]);
        assert_eq!(entry_components("./dir/").unwrap(), ["dir"]);
        assert!(entry_components("./").unwrap().is_empty());
        assert!(entry_components(".").unwrap().is_empty());
        // Names that merely start with dots are ordinary names.
        assert_eq!(entry_components("..a/...").unwrap(), ["..a", "..."]);
        assert!(entry_components("/etc/passwd")
            .unwrap_err()
            .contains("absolute"));
        for climbing in ["..", "../x", "a/../../x", "a/.."] {
            assert!(
                entry_components(climbing).unwrap_err().contains(".."),
                "{climbing:?}"
            );
        }
    }

    #[test]
    fn only_files_directories_and_links_are_written() {
        use tar::EntryType as T;
        assert_eq!(kind_of(T::Regular), Ok(Kind::File));
        assert_eq!(kind_of(T::new(b'\0')), Ok(Kind::File));
        assert_eq!(kind_of(T::GNUSparse), Ok(Kind::File));
        assert_eq!(kind_of(T::Directory), Ok(Kind::Dir));
        assert_eq!(kind_of(T::Symlink), Ok(Kind::Symlink));
        assert_eq!(kind_of(T::Link), Ok(Kind::HardLink));
        assert_eq!(kind_of(T::XGlobalHeader), Ok(Kind::Skip));
        for refused in [T::Char, T::Block, T::Fifo, T::new(b'Z')] {
            assert!(kind_of(refused).is_err(), "{refused:?}");
        }
    }

    #[test]
    fn the_header_mode_wins_on_files_and_directories_only() {
        assert_eq!(mode_for(Kind::File, 0o104755, 0), Some(0o4755));
        assert_eq!(mode_for(Kind::Dir, 0o40750, 0), Some(0o750));
        assert_eq!(mode_for(Kind::File, 0o644, 0o600), Some(0o600));
        assert_eq!(mode_for(Kind::Dir, 0o755, 0o2770), Some(0o2770));
        assert_eq!(mode_for(Kind::Symlink, 0o777, 0o600), None);
        assert_eq!(mode_for(Kind::HardLink, 0o644, 0o600), None);
    }

    #[test]
    fn a_reader_ends_at_commit_and_fails_on_a_broken_stream() {
        let (tx, rx) = mpsc::channel(4);
        tx.try_send(Piece::Data(b"ab".to_vec())).unwrap();
        tx.try_send(Piece::Data(Vec::new())).unwrap();
        tx.try_send(Piece::Data(b"c".to_vec())).unwrap();
        tx.try_send(Piece::End).unwrap();
        let mut text = String::new();
        ChunkReader::new(rx).read_to_string(&mut text).unwrap();
        assert_eq!(text, "abc");

        let (tx, rx) = mpsc::channel(4);
        tx.try_send(Piece::Data(b"ab".to_vec())).unwrap();
        drop(tx);
        let broken = ChunkReader::new(rx).read_to_end(&mut Vec::new());
        assert_eq!(broken.unwrap_err().kind(), io::ErrorKind::UnexpectedEof);
    }

    /// An archive being made for a test.
    struct Archive(tar::Builder<Vec<u8>>);

    impl Archive {
        fn new() -> Self {
            Self(tar::Builder::new(Vec::new()))
        }

        fn header(kind: tar::EntryType, mode: u32, mtime: u64) -> tar::Header {
            let mut header = tar::Header::new_gnu();
            header.set_entry_type(kind);
            header.set_mode(mode);
            header.set_mtime(mtime);
            // Owners in the archive are ignored; make that visible.
            header.set_uid(4321);
            header.set_gid(4321);
            header.set_size(0);
            header
        }

        fn dir(mut self, name: &str, mode: u32, mtime: u64) -> Self {
            let mut header = Self::header(tar::EntryType::Directory, mode, mtime);
            self.0.append_data(&mut header, name, io::empty()).unwrap();
            self
        }

        fn file(mut self, name: &str, mode: u32, mtime: u64, contents: &[u8]) -> Self {
            let mut header = Self::header(tar::EntryType::Regular, mode, mtime);
            header.set_size(contents.len() as u64);
            self.0.append_data(&mut header, name, contents).unwrap();
            self
        }

        fn link(mut self, kind: tar::EntryType, name: &str, target: &str) -> Self {
            let mut header = Self::header(kind, 0o777, 1_000);
            self.0.append_link(&mut header, name, target).unwrap();
            self
        }

        /// An entry whose name is written as is, bypassing the checks of
        /// the `tar` crate's builder.
        fn raw(mut self, kind: tar::EntryType, name: &str) -> Self {
            let mut header = Self::header(kind, 0o644, 1_000);
            header.as_old_mut().name[..name.len()].copy_from_slice(name.as_bytes());
            header.set_cksum();
            self.0.append(&header, io::empty()).unwrap();
            self
        }

        fn bytes(self) -> Vec<u8> {
            self.0.into_inner().unwrap()
        }
    }

    /// Unpacks `archive` into `dest` of a root filesystem at `root`.
    fn unpack_into(
        root: &Path,
        dest: &str,
        user: &str,
        mode: u32,
        archive: &[u8],
    ) -> Result<UnpackReply, FileError> {
        let work = WorkDir::file_system(root.to_owned());
        let dest = work.parse_or_root(dest)?;
        unpack_archive(&work, dest.as_ref(), user, mode, archive)
    }

    fn meta(path: PathBuf) -> std::fs::Metadata {
        std::fs::symlink_metadata(&path).unwrap_or_else(|e| panic!("{path:?}: {e}"))
    }

    #[test]
    fn a_tree_is_written_with_the_owner_modes_and_times() {
        let root = tempfile::tempdir().unwrap();
        let archive = Archive::new()
            .dir("app/", 0o750, 1_000_000)
            .file("app/run.sh", 0o4755, 2_000_000, b"#!/bin/sh\n")
            .file("app/deep/data.txt", 0o640, 3_000_000, b"data")
            .link(tar::EntryType::Symlink, "app/current", "/etc/passwd")
            .link(tar::EntryType::Link, "app/again.sh", "app/run.sh")
            .bytes();
        let reply = unpack_into(root.path(), "/opt/x", "1000:1001", 0, &archive).unwrap();
        assert_eq!((reply.entries, reply.bytes), (5, 14));

        let app = root.path().join("opt/x/app");
        // What the call made (the destination and its parents, the
        // directory the archive implies) belongs to the user too.
        for made in ["opt", "opt/x", "opt/x/app/deep"] {
            let m = meta(root.path().join(made));
            assert_eq!((m.uid(), m.gid()), (1000, 1001), "{made}");
        }
        let m = meta(app.clone());
        assert_eq!((m.uid(), m.gid(), m.mode() & 0o7777), (1000, 1001, 0o750));
        assert_eq!(m.mtime(), 1_000_000, "set after its entries were written");
        let m = meta(app.join("run.sh"));
        assert_eq!((m.uid(), m.gid(), m.mode() & 0o7777), (1000, 1001, 0o4755));
        assert_eq!((m.mtime(), m.nlink()), (2_000_000, 2));
        assert_eq!(std::fs::read(app.join("again.sh")).unwrap(), b"#!/bin/sh\n");
        assert_eq!(meta(app.join("deep/data.txt")).mode() & 0o7777, 0o640);
        let m = meta(app.join("current"));
        assert!(m.file_type().is_symlink());
        assert_eq!((m.uid(), m.gid(), m.mtime()), (1000, 1001, 1_000));
        assert_eq!(
            std::fs::read_link(app.join("current")).unwrap(),
            Path::new("/etc/passwd")
        );
    }

    #[test]
    fn the_header_mode_and_the_default_owner_apply_to_every_entry() {
        let root = tempfile::tempdir().unwrap();
        let archive = Archive::new()
            .dir("d", 0o755, 1)
            .file("d/f", 0o644, 1, b"x")
            .link(tar::EntryType::Symlink, "d/l", "f")
            .bytes();
        unpack_into(root.path(), "/", "", 0o700, &archive).unwrap();
        let d = root.path().join("d");
        for (path, mode) in [(d.clone(), 0o700), (d.join("f"), 0o700)] {
            let m = meta(path.clone());
            assert_eq!(
                (m.uid(), m.gid(), m.mode() & 0o7777),
                (0, 0, mode),
                "{path:?}"
            );
        }
        assert!(meta(d.join("l")).file_type().is_symlink());
    }

    #[test]
    fn files_are_replaced_and_directories_merged_into() {
        let root = tempfile::tempdir().unwrap();
        let dest = root.path().join("dest");
        std::fs::create_dir_all(dest.join("keep")).unwrap();
        std::fs::write(dest.join("keep/old"), b"old").unwrap();
        std::fs::write(dest.join("file"), b"old").unwrap();
        std::os::unix::fs::symlink("/elsewhere", dest.join("was-link")).unwrap();
        let archive = Archive::new()
            .dir("keep", 0o755, 1)
            .file("keep/new", 0o644, 1, b"new")
            .file("file", 0o644, 1, b"new")
            .file("was-link", 0o644, 1, b"new")
            .bytes();
        unpack_into(root.path(), "/dest", "", 0, &archive).unwrap();
        assert_eq!(std::fs::read(dest.join("keep/old")).unwrap(), b"old");
        assert_eq!(std::fs::read(dest.join("keep/new")).unwrap(), b"new");
        assert_eq!(std::fs::read(dest.join("file")).unwrap(), b"new");
        // The symlink was replaced, not written through.
        assert!(meta(dest.join("was-link")).file_type().is_file());
    }

    #[test]
    fn a_symlink_the_run_had_is_followed_within_the_root() {
        // A merged-/usr image: /bin is a symlink to usr/bin.
        let root = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(root.path().join("usr/bin")).unwrap();
        std::os::unix::fs::symlink("usr/bin", root.path().join("bin")).unwrap();
        let archive = Archive::new()
            .dir("bin", 0o700, 1)
            .file("bin/tool", 0o755, 1, b"tool")
            .bytes();
        unpack_into(root.path(), "/", "", 0, &archive).unwrap();
        assert_eq!(
            std::fs::read(root.path().join("usr/bin/tool")).unwrap(),
            b"tool"
        );
        assert!(meta(root.path().join("bin")).file_type().is_symlink());
        // The directory behind the link keeps its mode.
        assert_ne!(meta(root.path().join("usr/bin")).mode() & 0o7777, 0o700);
        // And as the destination itself.
        let archive = Archive::new().file("other", 0o755, 1, b"o").bytes();
        unpack_into(root.path(), "/bin", "", 0, &archive).unwrap();
        assert!(root.path().join("usr/bin/other").is_file());
    }

    #[test]
    fn bad_entries_are_refused() {
        use tar::EntryType as T;
        let cases = [
            (Archive::new().raw(T::Regular, "/etc/passwd"), "absolute"),
            (Archive::new().raw(T::Regular, "a/../../x"), ".."),
            (Archive::new().raw(T::Fifo, "fifo"), "fifo"),
            (Archive::new().raw(T::Char, "null"), "device"),
            // Below a symlink of the same archive, whether it leads out of
            // the destination or not.
            (
                Archive::new()
                    .link(T::Symlink, "l", "/etc")
                    .file("l/passwd", 0o644, 1, b"x"),
                "symlink",
            ),
            (
                Archive::new()
                    .dir("d", 0o755, 1)
                    .link(T::Symlink, "l", "d")
                    .dir("l", 0o755, 1),
                "symlink",
            ),
            // A hard link to a name the archive did not write before.
            (Archive::new().link(T::Link, "h", "etc/passwd"), "hard link"),
            (
                Archive::new()
                    .link(T::Link, "h", "later")
                    .file("later", 0o644, 1, b"x"),
                "hard link",
            ),
        ];
        for (archive, says) in cases {
            let root = tempfile::tempdir().unwrap();
            std::fs::create_dir(root.path().join("etc")).unwrap();
            let err = unpack_into(root.path(), "/dest", "", 0, &archive.bytes()).unwrap_err();
            assert!(
                matches!(err, FileError::InvalidPath { .. }),
                "{says}: {err}"
            );
            assert!(err.to_string().contains(says), "{says}: {err}");
            assert!(!root.path().join("etc/passwd").exists(), "{says}");
            assert!(!root.path().join("x").exists(), "{says}");
        }
    }

    #[test]
    fn the_destination_must_be_an_absolute_directory() {
        let root = tempfile::tempdir().unwrap();
        std::fs::write(root.path().join("file"), b"").unwrap();
        let archive = Archive::new().file("a", 0o644, 1, b"a").bytes();
        let err = unpack_into(root.path(), "/file", "", 0, &archive).unwrap_err();
        assert!(matches!(err, FileError::NotADirectory { .. }), "{err}");
        for bad in ["relative", "/a/../b", ""] {
            let err = unpack_into(root.path(), bad, "", 0, &archive).unwrap_err();
            assert!(
                matches!(err, FileError::InvalidPath { .. }),
                "{bad:?}: {err}"
            );
        }
        let err = unpack_into(root.path(), "/dest", "no-such-user", 0, &archive).unwrap_err();
        assert!(matches!(err, FileError::BadUser(_)), "{err}");
        assert!(
            !root.path().join("dest").exists(),
            "nothing made for an unknown user"
        );
    }

    #[test]
    fn a_broken_stream_keeps_what_was_written_and_fails() {
        let root = tempfile::tempdir().unwrap();
        let archive = Archive::new()
            .file("first", 0o644, 1, b"first")
            .file("second", 0o644, 1, &[7; 4096])
            .bytes();
        // Cut inside the second file's contents.
        let cut = &archive[..512 + 512 + 512 + 100];
        let err = unpack_into(root.path(), "/", "", 0, cut).unwrap_err();
        assert!(matches!(err, FileError::Io { .. }), "{err}");
        assert_eq!(std::fs::read(root.path().join("first")).unwrap(), b"first");
        assert!(
            !root.path().join("second").exists(),
            "a cut file never appears"
        );
    }
}
