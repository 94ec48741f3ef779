//! Layer unpacking: one image layer archive into a directory that overlayfs
//! can use as a lower layer, refusing anything that could write outside it.
//!
//! Owns: picking a decompressor ([`decompressed`]), reading the tar stream
//! (parsed by the `tar` crate, whose own unpack functions are deliberately
//! not used), the refusal rules below, and every filesystem write a layer
//! causes, all of them made beneath the destination (see `fs`).
//! Does not own: fetching layers or checking their digests, where layers
//! live, mounting, or atomicity — the caller unpacks into a fresh temporary
//! directory, renames it into place on success and removes it on error.
//!
//! # Steps, for each tar entry
//! 1. Count it against [`UnpackLimits::max_entries`] and its size against
//!    [`UnpackLimits::max_bytes`].
//! 2. Normalise its name: drop `.` and empty components (so a leading `./`
//!    goes); refuse absolute names, `..`, NUL and over-long names. An empty
//!    result is the layer root, which only has its mode applied.
//! 3. Whiteouts (`.wh.NAME`, `.wh..wh..opq`) become overlayfs whiteouts:
//!    a character device 0:0 at `NAME`, or `trusted.overlay.opaque=y` on the
//!    directory.
//! 4. Open the parent directory beneath the destination with `openat2`
//!    (`RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS`),
//!    creating missing parents 0755 one component at a time. A symlink
//!    anywhere on the way — one made by an earlier entry included — is
//!    refused.
//! 5. Create the last component with an `*at()` call that does not follow
//!    symlinks, then apply owner, mode and mtime through fds.
//! 6. After the last entry, set directory mtimes (later entries would have
//!    bumped them).
//!
//! # Refusals
//! Each is an [`UnpackError`] variant naming the entry; [`UnpackError::rule`]
//! gives its stable short name: `absolute_path`, `parent_dir`, `nul_byte`,
//! `path_too_long`, `symlink_parent`, `hardlink_outside`, `too_large`,
//! `too_many_entries`, `bad_whiteout`, plus `corrupt` and `io`.
//!
//! # Choices
//! * **Later entries replace earlier ones**, as tar does. A directory entry
//!   over an existing directory keeps it (and its contents) and applies the
//!   new metadata; any other collision removes what was there first — a
//!   directory with everything in it, as containerd does — so the result
//!   never depends on whether a name was first a file or a directory.
//! * **Whiteouts only delete lower layers** (OCI image spec): a whiteout
//!   for a name this layer already created leaves that entry alone, except
//!   that a directory becomes opaque, since its lower namesake is deleted.
//!   A directory created over an earlier whiteout — by a directory entry
//!   or as the missing parent of a later entry — is opaque for the same
//!   reason. `.wh..wh.*` names other than the opaque marker are AUFS
//!   bookkeeping and are skipped.
//! * **Device nodes are neutralised: skipped.** Every run gets its own
//!   minimal `/dev`, so an image never needs to bring its own. They are
//!   counted in [`UnpackStats::skipped`] and logged at debug. FIFOs are
//!   made: a FIFO is a name that reaches nothing outside the run.
//! * **Setuid and setgid bits are kept.** Runs have `no_new_privileges`, which
//!   makes them inert, and stripping them would change what images see.
//! * **Extended attributes (PAX `SCHILY.xattr.*`): only `user.*` ones are
//!   applied** (at most [`MAX_XATTRS`] per entry, on files and directories),
//!   so what a run set on its files comes back from a checkpoint; file
//!   capabilities, ACLs and SELinux labels are not restored: a run's
//!   capabilities come from its config, never from files in an image.
//! * Owners are applied as the raw uid/gid numbers in the header. Times have
//!   second precision (PAX sub-second mtimes are dropped). GNU sparse files
//!   are written out in full and count at their full size.
//! * Memory stays bounded on hostile input: file data is streamed, never
//!   buffered, and the extension headers the `tar` crate buffers whole (PAX,
//!   GNU long names) may total at most 1 MiB plus twice `max_path_bytes`
//!   per entry (see `budget`).
//!
//! # Requirements
//! Linux 5.6 or later (`openat2`) and root: `CAP_CHOWN`, `CAP_FOWNER`,
//! `CAP_MKNOD` for whiteouts and `CAP_SYS_ADMIN` for `trusted.*` xattrs.

mod budget;
mod fs;
mod name;

use std::fs::File;
use std::io::{self, Read, Write};
use std::os::fd::{AsFd, OwnedFd};
use std::path::Path;
use std::rc::Rc;

use rustix::fs::{Mode, OFlags};
use rustix::io::Errno;
use tar::EntryType;

use budget::{Budget, Budgeted};
use fs::{Meta, Replaced};
use name::{EntryName, NameError, Whiteout};

/// Caps on what one layer may contain. A layer over any of them is refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct UnpackLimits {
    /// Largest total of entry sizes (file data, as the headers state it).
    pub max_bytes: u64,
    /// Most entries of any kind, whiteouts and skipped ones included.
    pub max_entries: u64,
    /// Longest entry name, hard-link target or symlink target, in bytes.
    pub max_path_bytes: usize,
}

impl Default for UnpackLimits {
    /// 32 GiB, a million entries, and Linux's `PATH_MAX` (4096) per name.
    fn default() -> Self {
        Self {
            max_bytes: 32 << 30,
            max_entries: 1_000_000,
            max_path_bytes: 4096,
        }
    }
}

/// What one call to [`unpack_layer`] did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct UnpackStats {
    /// Total of entry sizes read, the figure held to `max_bytes`.
    pub bytes: u64,
    /// Entries read, of every kind.
    pub entries: u64,
    /// Whiteouts and opaque-directory markers applied.
    pub whiteouts: u64,
    /// Entries deliberately not unpacked: device nodes, PAX global headers
    /// and AUFS `.wh..wh.*` bookkeeping.
    pub skipped: u64,
}

/// Why a layer was refused or could not be unpacked.
///
/// `path` is the entry's name as the archive spells it (lossily decoded
/// and cut to 256 characters), or a `(…)` placeholder when the archive
/// broke before a name could be read.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum UnpackError {
    /// The entry name starts with `/`.
    #[error("entry {path:?} has an absolute path")]
    AbsolutePath {
        /// The entry's name.
        path: String,
    },
    /// The entry name has a `..` component.
    #[error("entry {path:?} has a `..` component")]
    ParentDir {
        /// The entry's name.
        path: String,
    },
    /// The entry name or its link target holds a NUL byte.
    #[error("entry {path:?} has a NUL byte in its name or link target")]
    NulByte {
        /// The entry's name.
        path: String,
    },
    /// The entry name or its link target is over `max_path_bytes`.
    #[error("entry {path:?} has a name or link target of {len} bytes, over the limit of {limit}")]
    PathTooLong {
        /// The entry's name (cut short).
        path: String,
        /// The length found.
        len: usize,
        /// The limit in force.
        limit: usize,
    },
    /// The entry would be written through a symlink (or out of the
    /// destination): some parent component is a symlink.
    #[error("entry {path:?} would be written through a symbolic link")]
    SymlinkParent {
        /// The entry's name.
        path: String,
    },
    /// A hard link whose target is not an earlier non-directory entry of
    /// this layer, reached beneath the destination without symlinks.
    #[error("hard link {path:?} -> {target:?} does not name an earlier file of this layer")]
    HardlinkOutside {
        /// The link's name.
        path: String,
        /// The target as the archive spells it.
        target: String,
    },
    /// The entry takes the layer over `max_bytes`, or the extension
    /// headers before an entry are over their budget.
    #[error("entry {path:?} takes the layer over its limit of {limit} bytes")]
    TooLarge {
        /// The entry's name.
        path: String,
        /// The limit in force.
        limit: u64,
    },
    /// The entry takes the layer over `max_entries`.
    #[error("entry {path:?} takes the layer over its limit of {limit} entries")]
    TooManyEntries {
        /// The entry's name.
        path: String,
        /// The limit in force.
        limit: u64,
    },
    /// A whiteout that names nothing: `.wh.` followed by nothing, `.` or
    /// `..`.
    #[error("whiteout {path:?} names no file")]
    BadWhiteout {
        /// The whiteout entry's name.
        path: String,
    },
    /// The stream is not a well-formed tar archive (or its compression is
    /// broken), or an entry is of a kind that has no place in a layer.
    #[error("corrupt layer archive at {path:?}")]
    Corrupt {
        /// The entry's name.
        path: String,
        /// What was wrong.
        #[source]
        source: io::Error,
    },
    /// A filesystem call or a read from the source failed.
    #[error("i/o error unpacking {path:?}")]
    Io {
        /// The entry's name, or the destination.
        path: String,
        /// The failure.
        #[source]
        source: io::Error,
    },
}

impl UnpackError {
    /// A stable short name for the rule that refused the layer, for API
    /// error codes and metrics.
    pub fn rule(&self) -> &'static str {
        match self {
            Self::AbsolutePath { .. } => "absolute_path",
            Self::ParentDir { .. } => "parent_dir",
            Self::NulByte { .. } => "nul_byte",
            Self::PathTooLong { .. } => "path_too_long",
            Self::SymlinkParent { .. } => "symlink_parent",
            Self::HardlinkOutside { .. } => "hardlink_outside",
            Self::TooLarge { .. } => "too_large",
            Self::TooManyEntries { .. } => "too_many_entries",
            Self::BadWhiteout { .. } => "bad_whiteout",
            Self::Corrupt { .. } => "corrupt",
            Self::Io { .. } => "io",
        }
    }

    /// The entry (or destination) the error is about.
    pub fn path(&self) -> &str {
        match self {
            Self::AbsolutePath { path }
            | Self::ParentDir { path }
            | Self::NulByte { path }
            | Self::PathTooLong { path, .. }
            | Self::SymlinkParent { path }
            | Self::HardlinkOutside { path, .. }
            | Self::TooLarge { path, .. }
            | Self::TooManyEntries { path, .. }
            | Self::BadWhiteout { path }
            | Self::Corrupt { path, .. }
            | Self::Io { path, .. } => path,
        }
    }
}

/// Wraps `reader` in a decompressor chosen by magic bytes: gzip (`1f 8b`),
/// zstd (`28 b5 2f fd`), or none (plain tar).
///
/// Reads at most four bytes before returning; they are replayed to the
/// decompressor. Concatenated gzip members and zstd frames are read as one
/// stream. zstd's decoder refuses frames whose window is over 128 MiB, which
/// bounds its memory.
pub fn decompressed<'a>(reader: impl Read + 'a) -> io::Result<Box<dyn Read + 'a>> {
    let mut reader = reader;
    let mut magic = [0u8; 4];
    let mut filled = 0;
    while filled < magic.len() {
        match reader.read(&mut magic[filled..]) {
            Ok(0) => break,
            Ok(n) => filled += n,
            Err(err) if err.kind() == io::ErrorKind::Interrupted => {}
            Err(err) => return Err(err),
        }
    }
    let seen = &magic[..filled];
    let kind = if seen.starts_with(&[0x1f, 0x8b]) {
        Compression::Gzip
    } else if seen == [0x28, 0xb5, 0x2f, 0xfd] {
        Compression::Zstd
    } else {
        Compression::None
    };
    let replayed = io::Cursor::new(magic).take(filled as u64).chain(reader);
    Ok(match kind {
        Compression::Gzip => Box::new(flate2::read::MultiGzDecoder::new(replayed)),
        Compression::Zstd => Box::new(zstd::stream::read::Decoder::new(replayed)?),
        Compression::None => Box::new(replayed),
    })
}

/// The layer compressions [`decompressed`] recognises.
enum Compression {
    Gzip,
    Zstd,
    None,
}

/// Unpacks ONE layer (an uncompressed tar stream) into `dest`, an existing
/// empty directory, as an overlayfs lower layer. Blocking.
///
/// Nothing is ever written outside `dest`. On error `dest` is left
/// half-filled: the caller removes it. See the module docs for the rules.
///
/// Reading stops at the archive's end-of-archive block, so bytes after it
/// (the second zero block, padding, a compressed stream's trailer) may be
/// left unread: a caller that hashes the stream to check a digest should
/// pass `&mut reader` and read the rest itself afterwards.
pub fn unpack_layer(
    reader: impl Read,
    dest: &Path,
    limits: &UnpackLimits,
) -> Result<UnpackStats, UnpackError> {
    let dest_io = |source: io::Error| UnpackError::Io {
        path: dest.display().to_string(),
        source,
    };
    let root = rustix::fs::open(
        dest,
        OFlags::RDONLY | OFlags::DIRECTORY | OFlags::CLOEXEC,
        Mode::empty(),
    )
    .map_err(|errno| dest_io(errno.into()))?;
    // The hard-link rule ("an earlier entry of this layer") holds only if
    // everything beneath `dest` came from this layer.
    if !fs::is_empty_dir(root.as_fd()).map_err(|errno| dest_io(errno.into()))? {
        return Err(dest_io(io::Error::new(
            io::ErrorKind::InvalidInput,
            "destination directory is not empty",
        )));
    }

    let budget = Rc::new(Budget::default());
    let header_budget = extension_budget(limits);
    let mut archive = tar::Archive::new(Budgeted::new(reader, Rc::clone(&budget)));
    let mut unpacker = Unpacker {
        root,
        limits,
        stats: UnpackStats::default(),
        dir_times: Vec::new(),
        dir_times_bytes: 0,
        buf: vec![0; COPY_BUF_BYTES],
    };
    let mut entries = archive
        .entries()
        .map_err(|err| unpacker.read_error(&budget, header_budget, next_entry_path(0), err))?;
    loop {
        budget.allow(header_budget);
        let entry = match entries.next() {
            None => break,
            Some(Ok(entry)) => entry,
            Some(Err(err)) => {
                let path = next_entry_path(unpacker.stats.entries);
                return Err(unpacker.read_error(&budget, header_budget, path, err));
            }
        };
        budget.allow(entry.size());
        unpacker.entry(entry, &budget)?;
    }
    unpacker.finish()
}

/// How many bytes of headers, long names and padding may come before one
/// entry's data: far more than real layers use, little enough to hold.
fn extension_budget(limits: &UnpackLimits) -> u64 {
    let names = u64::try_from(limits.max_path_bytes)
        .unwrap_or(u64::MAX)
        .saturating_mul(2);
    (1u64 << 20).saturating_add(names)
}

/// The placeholder path for errors met before an entry's name is known.
fn next_entry_path(entries_so_far: u64) -> String {
    format!("(entry #{})", entries_so_far + 1)
}

/// Size of the buffer file data is streamed through.
const COPY_BUF_BYTES: usize = 128 * 1024;

/// The most `user.*` extended attributes applied to one entry.
pub const MAX_XATTRS: usize = 64;

/// At most this many bytes of directory names are remembered to set their
/// mtimes at the end; past it, mtimes are set at once (and may then be
/// bumped by later entries) so memory stays bounded.
const DIR_TIMES_MAX_BYTES: usize = 64 << 20;

/// The state of one [`unpack_layer`] call.
struct Unpacker<'l> {
    /// The destination directory; every write is made beneath it.
    root: OwnedFd,
    limits: &'l UnpackLimits,
    stats: UnpackStats,
    /// Directories whose mtime is set after the last entry.
    dir_times: Vec<(EntryName, Meta)>,
    dir_times_bytes: usize,
    buf: Vec<u8>,
}

impl Unpacker<'_> {
    /// Unpacks one entry and reads it to its end.
    fn entry<R: Read>(
        &mut self,
        mut entry: tar::Entry<'_, R>,
        budget: &Budget,
    ) -> Result<(), UnpackError> {
        let raw = entry.path_bytes().into_owned();
        let path = name::shown(&raw);

        self.stats.entries += 1;
        if self.stats.entries > self.limits.max_entries {
            return Err(UnpackError::TooManyEntries {
                path,
                limit: self.limits.max_entries,
            });
        }
        let size = entry.size();
        self.stats.bytes = match self.stats.bytes.checked_add(size) {
            Some(total) if total <= self.limits.max_bytes => total,
            _ => {
                return Err(UnpackError::TooLarge {
                    path,
                    limit: self.limits.max_bytes,
                })
            }
        };

        let name = name::normalise(&raw, self.limits.max_path_bytes)
            .map_err(|err| self.name_error(err, &path))?;
        let mut kind = entry.header().entry_type();
        // Pre-POSIX archives mark directories only by a trailing slash on
        // a NUL type byte (which the `tar` crate folds into Regular, so
        // the raw byte is read).
        if entry.header().as_old().linkflag[0] == 0 && raw.ends_with(b"/") {
            kind = EntryType::Directory;
        }

        if name.is_root() {
            if !kind.is_dir() {
                return Err(corrupt(path, "the layer root can only be a directory"));
            }
            let meta = header_meta(entry.header()).map_err(|err| corrupt(path.clone(), err))?;
            fs::set_mode(self.root.as_fd(), meta.mode).map_err(|errno| io_error(&path, errno))?;
            return self.drain(&mut entry, &path, budget);
        }

        match name::whiteout(name.file_name()) {
            Whiteout::No => {}
            Whiteout::Bad => return Err(UnpackError::BadWhiteout { path }),
            Whiteout::Opaque => {
                let dir = self.parent(&name, &path)?;
                fs::set_opaque(dir.as_fd()).map_err(|errno| io_error(&path, errno))?;
                self.stats.whiteouts += 1;
                return self.drain(&mut entry, &path, budget);
            }
            Whiteout::Delete(deleted) => {
                let dir = self.parent(&name, &path)?;
                fs::make_whiteout(dir.as_fd(), deleted).map_err(|errno| io_error(&path, errno))?;
                self.stats.whiteouts += 1;
                return self.drain(&mut entry, &path, budget);
            }
            Whiteout::AufsMeta => {
                tracing::debug!(path, "skipping AUFS whiteout bookkeeping entry");
                self.stats.skipped += 1;
                return self.drain(&mut entry, &path, budget);
            }
        }

        match kind {
            EntryType::Regular | EntryType::Continuous | EntryType::GNUSparse => {
                self.file(&mut entry, &name, &path, budget)?;
            }
            EntryType::Directory => self.dir(&mut entry, &name, &path)?,
            EntryType::Symlink => self.symlink(&entry, &name, &path)?,
            EntryType::Link => self.hard_link(&entry, &name, &path)?,
            EntryType::Fifo => {
                let meta = header_meta(entry.header()).map_err(|err| corrupt(path.clone(), err))?;
                let parent = self.parent(&name, &path)?;
                fs::make_fifo(parent.as_fd(), name.file_name(), &meta)
                    .map_err(|errno| io_error(&path, errno))?;
            }
            EntryType::Char | EntryType::Block => {
                // Neutralised: runs get their own minimal /dev.
                tracing::debug!(path, kind = ?kind, "skipping device node");
                self.stats.skipped += 1;
            }
            EntryType::XGlobalHeader => {
                // Global PAX defaults (usually just an mtime or a comment);
                // nothing we apply depends on them.
                tracing::debug!(path, "ignoring PAX global header");
                self.stats.skipped += 1;
            }
            other => {
                let byte = other.as_byte();
                return Err(corrupt(
                    path,
                    format!("unsupported entry type {:?}", char::from(byte)),
                ));
            }
        }
        self.drain(&mut entry, &path, budget)
    }

    /// A regular file: streamed from the archive into a new file.
    fn file<R: Read>(
        &mut self,
        entry: &mut tar::Entry<'_, R>,
        name: &EntryName,
        path: &str,
        budget: &Budget,
    ) -> Result<(), UnpackError> {
        let meta = header_meta(entry.header()).map_err(|err| corrupt(path.to_owned(), err))?;
        let size = entry.size();
        let dir = self.parent(name, path)?;
        let fd = fs::create_file(dir.as_fd(), name.file_name())
            .map_err(|errno| io_error(path, errno))?;
        let mut file = File::from(fd);
        let mut copied = 0u64;
        loop {
            let n = match entry.read(&mut self.buf) {
                Ok(0) => break,
                Ok(n) => n,
                Err(err) if err.kind() == io::ErrorKind::Interrupted => continue,
                Err(err) => {
                    return Err(self.read_error(budget, size, path.to_owned(), err));
                }
            };
            file.write_all(&self.buf[..n])
                .map_err(|source| UnpackError::Io {
                    path: path.to_owned(),
                    source,
                })?;
            copied += n as u64;
        }
        if copied != size {
            return Err(corrupt(
                path.to_owned(),
                format!("archive ends after {copied} of the entry's {size} bytes"),
            ));
        }
        self.xattrs(entry, file.as_fd(), path)?;
        fs::set_owner_mode(file.as_fd(), &meta).map_err(|errno| io_error(path, errno))?;
        fs::set_mtime(file.as_fd(), &meta).map_err(|errno| io_error(path, errno))
    }

    /// Applies the entry's `user.*` extended attributes (see the module
    /// doc) to the file or directory open at `fd`.
    fn xattrs<R: Read>(
        &mut self,
        entry: &mut tar::Entry<'_, R>,
        fd: std::os::fd::BorrowedFd<'_>,
        path: &str,
    ) -> Result<(), UnpackError> {
        let Some(extensions) = entry
            .pax_extensions()
            .map_err(|err| corrupt(path.to_owned(), err))?
        else {
            return Ok(());
        };
        let mut applied = 0;
        for extension in extensions {
            let extension = extension.map_err(|err| corrupt(path.to_owned(), err))?;
            let Ok(key) = extension.key() else {
                continue;
            };
            let Some(name) = key.strip_prefix("SCHILY.xattr.") else {
                continue;
            };
            if !name.starts_with("user.") || name.len() > 255 || name.contains('\0') {
                continue;
            }
            applied += 1;
            if applied > MAX_XATTRS {
                return Err(corrupt(
                    path.to_owned(),
                    format!("more than {MAX_XATTRS} extended attributes"),
                ));
            }
            fs::set_xattr(fd, name, extension.value_bytes())
                .map_err(|errno| io_error(path, errno))?;
        }
        Ok(())
    }

    /// A directory: created, or kept if one is there, then its metadata.
    fn dir<R: Read>(
        &mut self,
        entry: &mut tar::Entry<'_, R>,
        name: &EntryName,
        path: &str,
    ) -> Result<(), UnpackError> {
        let meta = header_meta(entry.header()).map_err(|err| corrupt(path.to_owned(), err))?;
        let parent = self.parent(name, path)?;
        let (dir, replaced) = fs::make_dir(parent.as_fd(), name.file_name())
            .map_err(|errno| io_error(path, errno))?;
        if replaced == Replaced::Whiteout {
            // The lower namesake was deleted by this layer, so nothing of it
            // may show through the new directory.
            fs::set_opaque(dir.as_fd()).map_err(|errno| io_error(path, errno))?;
        }
        self.xattrs(entry, dir.as_fd(), path)?;
        fs::set_owner_mode(dir.as_fd(), &meta).map_err(|errno| io_error(path, errno))?;
        let name_bytes = name.as_bytes().len();
        if self.dir_times_bytes + name_bytes <= DIR_TIMES_MAX_BYTES {
            self.dir_times_bytes += name_bytes;
            self.dir_times.push((name.clone(), meta));
        } else {
            fs::set_mtime(dir.as_fd(), &meta).map_err(|errno| io_error(path, errno))?;
        }
        Ok(())
    }

    /// A symlink: its target text is stored as is, never resolved by us.
    fn symlink<R: Read>(
        &mut self,
        entry: &tar::Entry<'_, R>,
        name: &EntryName,
        path: &str,
    ) -> Result<(), UnpackError> {
        let meta = header_meta(entry.header()).map_err(|err| corrupt(path.to_owned(), err))?;
        let target = self.link_target(entry, path)?;
        let parent = self.parent(name, path)?;
        fs::make_symlink(parent.as_fd(), name.file_name(), &target)
            .map_err(|errno| io_error(path, errno))?;
        fs::set_symlink_meta(parent.as_fd(), name.file_name(), &meta)
            .map_err(|errno| io_error(path, errno))
    }

    /// A hard link to an earlier non-directory entry of this layer.
    fn hard_link<R: Read>(
        &mut self,
        entry: &tar::Entry<'_, R>,
        name: &EntryName,
        path: &str,
    ) -> Result<(), UnpackError> {
        let raw_target = self.link_target(entry, path)?;
        let outside = || UnpackError::HardlinkOutside {
            path: path.to_owned(),
            target: name::shown(&raw_target),
        };
        let target = match name::normalise(&raw_target, self.limits.max_path_bytes) {
            Ok(target) if !target.is_root() => target,
            // Length and NUL were checked by link_target.
            _ => return Err(outside()),
        };
        // The target's directory is reached like any parent: beneath the
        // destination, through no symlink. A missing one means the target is
        // not an earlier entry.
        let target_dir =
            fs::open_dir(self.root.as_fd(), target.parent()).map_err(|errno| match errno {
                Errno::NOENT | Errno::NOTDIR | Errno::LOOP | Errno::XDEV => outside(),
                errno => io_error(path, errno),
            })?;
        match fs::lstat(target_dir.as_fd(), target.file_name()) {
            Ok(Some(stat)) if !fs::is_dir(&stat) => {}
            Ok(_) => return Err(outside()),
            Err(errno) => return Err(io_error(path, errno)),
        }
        if target == *name {
            // A link to itself: the file is already there.
            return Ok(());
        }
        let parent = self.parent(name, path)?;
        fs::make_hard_link(
            target_dir.as_fd(),
            target.file_name(),
            parent.as_fd(),
            name.file_name(),
        )
        .map_err(|errno| match errno {
            // The target lived inside what this entry replaced.
            Errno::NOENT => outside(),
            errno => io_error(path, errno),
        })
    }

    /// The link target of a symlink or hard-link entry, checked for the
    /// rules every stored name obeys: present, no NUL, not over the limit.
    fn link_target<R: Read>(
        &self,
        entry: &tar::Entry<'_, R>,
        path: &str,
    ) -> Result<Vec<u8>, UnpackError> {
        let target = match entry.link_name_bytes() {
            Some(target) if !target.is_empty() => target.into_owned(),
            _ => return Err(corrupt(path.to_owned(), "link entry without a target")),
        };
        if target.len() > self.limits.max_path_bytes {
            return Err(UnpackError::PathTooLong {
                path: path.to_owned(),
                len: target.len(),
                limit: self.limits.max_path_bytes,
            });
        }
        if target.contains(&0) {
            return Err(UnpackError::NulByte {
                path: path.to_owned(),
            });
        }
        Ok(target)
    }

    /// Opens (creating as needed) the directory an entry goes into.
    fn parent(&self, name: &EntryName, path: &str) -> Result<OwnedFd, UnpackError> {
        fs::open_or_create_dir(self.root.as_fd(), name.parent()).map_err(|errno| match errno {
            // ELOOP: a symlink on the way; EXDEV: the walk tried to leave
            // the destination (it cannot, as names have no `..`).
            Errno::LOOP | Errno::XDEV => UnpackError::SymlinkParent {
                path: path.to_owned(),
            },
            errno => io_error(path, errno),
        })
    }

    /// Reads whatever is left of an entry's data, so the archive's next
    /// header is where the `tar` crate expects it.
    fn drain<R: Read>(
        &mut self,
        entry: &mut tar::Entry<'_, R>,
        path: &str,
        budget: &Budget,
    ) -> Result<(), UnpackError> {
        let size = entry.size();
        io::copy(entry, &mut io::sink())
            .map(drop)
            .map_err(|err| self.read_error(budget, size, path.to_owned(), err))
    }

    /// Maps a failure to read the archive to the right refusal.
    fn read_error(&self, budget: &Budget, limit: u64, path: String, err: io::Error) -> UnpackError {
        if budget.exceeded() {
            return UnpackError::TooLarge { path, limit };
        }
        match err.kind() {
            // What the tar parser and the decompressors report for bad
            // input; anything else is the source failing.
            io::ErrorKind::Other
            | io::ErrorKind::InvalidData
            | io::ErrorKind::InvalidInput
            | io::ErrorKind::UnexpectedEof => UnpackError::Corrupt { path, source: err },
            _ => UnpackError::Io { path, source: err },
        }
    }

    /// Maps a name refusal to its rule.
    fn name_error(&self, err: NameError, path: &str) -> UnpackError {
        let path = path.to_owned();
        match err {
            NameError::Absolute => UnpackError::AbsolutePath { path },
            NameError::ParentDir => UnpackError::ParentDir { path },
            NameError::Nul => UnpackError::NulByte { path },
            NameError::TooLong(len) => UnpackError::PathTooLong {
                path,
                len,
                limit: self.limits.max_path_bytes,
            },
        }
    }

    /// Sets the directory mtimes held back until every entry was written.
    fn finish(self) -> Result<UnpackStats, UnpackError> {
        for (name, meta) in &self.dir_times {
            // A later entry may have replaced the directory (even with a
            // symlink); then there is nothing to set, and open_dir refuses
            // to follow the symlink.
            match fs::open_dir(self.root.as_fd(), name.as_bytes()) {
                Ok(dir) => fs::set_mtime(dir.as_fd(), meta)
                    .map_err(|errno| io_error(&name::shown(name.as_bytes()), errno))?,
                Err(errno) => {
                    tracing::debug!(path = %name::shown(name.as_bytes()), %errno,
                        "directory gone before its mtime was set");
                }
            }
        }
        Ok(self.stats)
    }
}

/// Reads owner, mode and mtime from a header, refusing values no file can
/// have.
fn header_meta(header: &tar::Header) -> io::Result<Meta> {
    let id = |value: u64, what: &str| {
        u32::try_from(value)
            .ok()
            // chown(2) reads (u32)-1 as "leave unchanged".
            .filter(|&id| id != u32::MAX)
            .ok_or_else(|| {
                io::Error::new(
                    io::ErrorKind::InvalidData,
                    format!("{what} {value} is out of range"),
                )
            })
    };
    Ok(Meta {
        uid: id(header.uid()?, "uid")?,
        gid: id(header.gid()?, "gid")?,
        mode: header.mode()? & 0o7777,
        mtime: i64::try_from(header.mtime()?).unwrap_or(i64::MAX),
    })
}

/// A `Corrupt` error for `path`.
fn corrupt(path: String, why: impl Into<Box<dyn std::error::Error + Send + Sync>>) -> UnpackError {
    UnpackError::Corrupt {
        path,
        source: io::Error::new(io::ErrorKind::InvalidData, why),
    }
}

/// An `Io` error for `path` from a failed syscall.
fn io_error(path: &str, errno: Errno) -> UnpackError {
    UnpackError::Io {
        path: path.to_owned(),
        source: errno.into(),
    }
}
