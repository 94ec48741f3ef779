//! Confinement of file operations to the work directory.
//!
//! Owns three things, in the order a file request meets them:
//!
//! 1. The path grammar the file RPCs accept ([`RelPath::parse`]): checked
//!    before anything touches the disk, so malformed requests never reach a
//!    system call.
//! 2. Opening the work directory itself ([`WorkDir::open`]) with
//!    `RESOLVE_NO_SYMLINKS`, once per request, so a run that replaced the
//!    work directory (or any of its ancestors) with a symlink is refused
//!    instead of redirected.
//! 3. Resolving request paths beneath that directory ([`open_beneath`]) with
//!    `openat2(RESOLVE_BENEATH | RESOLVE_NO_MAGICLINKS)`: the kernel, not this
//!    code, decides whether a symlink or `..` planted by the sandbox leads
//!    outside, which closes the check-then-use races a userspace walk has.
//!
//! It also owns [`FileError`], the error every file operation reports, and
//! its mapping to a gRPC status carrying the `runbox-kind` metadata entry;
//! [`ops`] holds the operations themselves (stat, list, mkdir, move,
//! remove, and the halves of reading and writing a file that touch the
//! disk), [`xattrs`] the user metadata kept with files.
//!
//! Two users: the agent, confining a run's file RPCs to its `/work` (or its
//! root), and the daemon, confining a volume's file API to the volume's
//! directory on the host. Neither owns the streaming of file bodies, nor
//! exec's working directory, which is deliberately not confined: a command
//! may go anywhere inside the run.

use std::io;
use std::os::fd::{AsFd, OwnedFd};
use std::path::{Path, PathBuf};

use rustix::fs::{Mode, OFlags, ResolveFlags};
use rustix::io::Errno;
use tonic::metadata::MetadataValue;
use tonic::{Code, Status};

pub mod ops;
pub mod xattrs;

/// Longest request path accepted, in bytes (Linux's `PATH_MAX`).
pub const MAX_PATH_BYTES: usize = 4096;

/// Longest single path component accepted, in bytes (Linux's `NAME_MAX`).
pub const MAX_COMPONENT_BYTES: usize = 255;

/// Name of the metadata entry that carries an error's [`FileError::kind`].
pub const KIND_METADATA_KEY: &str = "runbox-kind";

/// How often a resolution that the kernel aborted because of a concurrent
/// rename (`EAGAIN`) is retried before giving up.
const RESOLVE_RETRIES: usize = 16;

/// Why a file operation failed. Every variant maps to one `runbox-kind`
/// value and one gRPC code; messages never include file contents.
#[derive(Debug, thiserror::Error)]
pub enum FileError {
    /// The request path breaks the grammar of [`RelPath::parse`].
    #[error("invalid path {path:?}: {reason}")]
    InvalidPath {
        /// The path as the client sent it.
        path: String,
        /// What is wrong with it, phrased as what to fix.
        reason: &'static str,
    },
    /// The request stream itself is malformed (for example no header first).
    #[error("invalid request: {0}")]
    InvalidRequest(&'static str),
    /// Resolution left the work directory through a symlink or `..` (or,
    /// in the run's root, through a magic link).
    #[error("path {path:?} leads outside the directory file operations are confined to, through a symlink, '..' or a /proc link; use a path that stays inside it")]
    Escape {
        /// The path as the client sent it.
        path: String,
    },
    /// The work directory cannot be opened as a plain directory.
    #[error("cannot open the work directory {path:?} as a real directory (it must exist and must not be or pass through a symlink)")]
    WorkDir {
        /// The configured work directory.
        path: PathBuf,
        /// What `openat2` reported.
        #[source]
        source: Errno,
    },
    /// The path (or one of its parents) does not exist.
    #[error("{path:?} does not exist")]
    NotFound {
        /// The path as the client sent it.
        path: String,
    },
    /// The path names something other than a regular file.
    #[error("{path:?} is {what}, not a regular file")]
    NotAFile {
        /// The path as the client sent it.
        path: String,
        /// What it is instead, with an article ("a directory").
        what: &'static str,
    },
    /// A parent of the target exists but is not a directory (or the target
    /// itself, where it must be one: `path` is then `target`).
    #[error("{}", not_a_directory(path, target))]
    NotADirectory {
        /// The offending parent, relative to the work directory.
        path: String,
        /// The path as the client sent it.
        target: String,
    },
    /// The kernel refused access.
    #[error("permission denied for {path:?}")]
    Denied {
        /// The path as the client sent it.
        path: String,
    },
    /// A regular file became shorter while it was being read.
    #[error("{path:?} shrank while it was being read; read it again")]
    Shrank {
        /// The path as the client sent it.
        path: String,
    },
    /// The owner named for a written file does not exist in the run.
    #[error("{0}")]
    BadUser(String),
    /// A move would replace an existing destination without `overwrite`.
    #[error("{path:?} already exists; remove it first or move with overwrite")]
    Exists {
        /// The destination as the client sent it.
        path: String,
    },
    /// A directory to remove (or to replace by a move) is not empty.
    #[error("directory {path:?} is not empty; remove it with recursive")]
    NotEmpty {
        /// The path as the client sent it.
        path: String,
    },
    /// A failure of the agent itself rather than of the file system.
    #[error("internal error: {0}")]
    Internal(String),
    /// Any other failure.
    #[error("cannot {op} {path:?}")]
    Io {
        /// What was being done, as a verb phrase ("write", "open").
        op: &'static str,
        /// The path as the client sent it.
        path: String,
        /// The underlying error.
        #[source]
        source: io::Error,
    },
}

/// The message of [`FileError::NotADirectory`]: a path is never named as
/// its own parent.
fn not_a_directory(path: &str, target: &str) -> String {
    if path.is_empty() {
        format!("a parent of {target:?} is a file, not a directory")
    } else if path == target {
        format!("{path:?} is not a directory")
    } else {
        format!("{path:?} is not a directory, so it cannot hold {target:?}")
    }
}

impl FileError {
    /// Classifies an errno from a system call on `path`.
    ///
    /// `EXDEV` and `ELOOP` come from `RESOLVE_BENEATH` / `RESOLVE_NO_MAGICLINKS`
    /// refusing a symlink or `..` that leaves the work directory, so both mean
    /// an escape attempt rather than an ordinary I/O problem.
    pub fn from_errno(errno: Errno, op: &'static str, path: &str) -> Self {
        let path = path.to_owned();
        match errno {
            Errno::XDEV | Errno::LOOP => Self::Escape { path },
            Errno::NOENT => Self::NotFound { path },
            // A parent is a file (which one the kernel does not say): the
            // same answer as the calls that find out which.
            Errno::NOTDIR => Self::NotADirectory {
                path: String::new(),
                target: path,
            },
            Errno::ISDIR => Self::NotAFile {
                path,
                what: "a directory",
            },
            // Opening a socket fails with ENXIO.
            Errno::NXIO => Self::NotAFile {
                path,
                what: "a socket or device",
            },
            Errno::ACCESS | Errno::PERM | Errno::ROFS | Errno::TXTBSY => Self::Denied { path },
            Errno::NAMETOOLONG => Self::InvalidPath {
                path,
                reason: "it is too long for the kernel; shorten it",
            },
            other => Self::Io {
                op,
                path,
                source: other.into(),
            },
        }
    }

    /// The `runbox-kind` value clients branch on.
    pub fn kind(&self) -> &'static str {
        match self {
            Self::InvalidPath { .. } | Self::InvalidRequest(_) => "invalid_path",
            Self::Escape { .. } => "escape",
            Self::WorkDir { source, .. } => match *source {
                Errno::LOOP | Errno::XDEV => "escape",
                Errno::NOENT => "not_found",
                Errno::NOTDIR => "not_a_file",
                Errno::ACCESS | Errno::PERM => "denied",
                _ => "io",
            },
            Self::NotFound { .. } => "not_found",
            Self::NotAFile { .. } | Self::NotADirectory { .. } => "not_a_file",
            Self::Denied { .. } => "denied",
            Self::Exists { .. } => "exists",
            Self::BadUser(_) => "bad_user",
            Self::NotEmpty { .. } => "not_empty",
            Self::Shrank { .. } | Self::Internal(_) | Self::Io { .. } => "io",
        }
    }

    /// The gRPC code that goes with [`Self::kind`].
    pub fn code(&self) -> Code {
        match self {
            // A truncated read is the one `io` failure with a more precise code.
            Self::Shrank { .. } => Code::DataLoss,
            _ => match self.kind() {
                "invalid_path" | "bad_user" => Code::InvalidArgument,
                "escape" | "denied" => Code::PermissionDenied,
                "not_found" => Code::NotFound,
                "not_a_file" | "not_empty" => Code::FailedPrecondition,
                "exists" => Code::AlreadyExists,
                _ => Code::Internal,
            },
        }
    }
}

impl From<FileError> for Status {
    fn from(err: FileError) -> Self {
        // This is the edge where the error leaves the agent, so the whole
        // source chain goes into the one message the client sees.
        let mut message = err.to_string();
        let mut source = std::error::Error::source(&err);
        while let Some(cause) = source {
            message.push_str(": ");
            message.push_str(&cause.to_string());
            source = cause.source();
        }
        let mut status = Status::new(err.code(), message);
        status
            .metadata_mut()
            .insert(KIND_METADATA_KEY, MetadataValue::from_static(err.kind()));
        status
    }
}

/// A request path that passed the grammar check: relative, free of `..`,
/// and reduced to its normal components.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RelPath {
    original: String,
    components: Vec<String>,
}

impl RelPath {
    /// Checks `path` against the grammar, without touching the disk.
    ///
    /// Accepted: non-empty, relative, no NUL, no `..` component, at most
    /// [`MAX_PATH_BYTES`] bytes with components of at most
    /// [`MAX_COMPONENT_BYTES`]. `.` components and repeated slashes are
    /// dropped. A path that reduces to nothing (".") names the work
    /// directory itself and is refused, as no file operation applies to it.
    pub fn parse(path: &str) -> Result<Self, FileError> {
        Self::parse_in(path, false)
    }

    /// [`RelPath::parse`], or with `absolute` the same grammar for a path
    /// that starts with `/` (a path in the run's root filesystem); the
    /// components are relative to that root either way.
    fn parse_in(path: &str, absolute: bool) -> Result<Self, FileError> {
        let invalid = |reason| FileError::InvalidPath {
            path: path.to_owned(),
            reason,
        };
        if path.is_empty() {
            return Err(invalid(
                "it is empty; name a file inside the work directory",
            ));
        }
        if path.contains('\0') {
            return Err(invalid("it contains a NUL byte"));
        }
        if path.len() > MAX_PATH_BYTES {
            return Err(invalid("it is longer than 4096 bytes"));
        }
        let relative = match (absolute, path.strip_prefix('/')) {
            (false, None) => path,
            (true, Some(rest)) => rest,
            (false, Some(_)) => {
                return Err(invalid(
                    "it is absolute; give it relative to the work directory",
                ))
            }
            (true, None) => return Err(invalid("it is relative; give it absolute, from /")),
        };
        let mut components = Vec::new();
        for component in relative.split('/') {
            match component {
                "" | "." => {}
                ".." => return Err(invalid("it contains a '..' component")),
                c if c.len() > MAX_COMPONENT_BYTES => {
                    return Err(invalid("one of its components is longer than 255 bytes"))
                }
                c => components.push(c.to_owned()),
            }
        }
        if components.is_empty() {
            return Err(invalid(if absolute {
                "it names the root directory itself; name a file inside it"
            } else {
                "it names the work directory itself; name a file inside it"
            }));
        }
        Ok(Self {
            original: path.to_owned(),
            components,
        })
    }

    /// [`RelPath::parse_in`], except that a path naming the base itself
    /// (empty, `.`; with `absolute`, `/`) is None: stat and list take it.
    fn parse_or_root_in(path: &str, absolute: bool) -> Result<Option<Self>, FileError> {
        let names_base = path.split('/').all(|c| c.is_empty() || c == ".")
            && !path.contains('\0')
            && (!absolute || path.starts_with('/'));
        if names_base {
            return Ok(None);
        }
        Self::parse_in(path, absolute).map(Some)
    }

    /// The path exactly as the client sent it, for error messages.
    pub fn original(&self) -> &str {
        &self.original
    }

    /// The normalized path ("a/b/c"), suitable for `openat2` beneath the
    /// work directory.
    pub fn normalized(&self) -> String {
        self.components.join("/")
    }

    /// The components before the last one, outermost first.
    pub fn parents(&self) -> &[String] {
        &self.components[..self.components.len() - 1]
    }

    /// The last component: the name of the file itself.
    pub fn file_name(&self) -> &str {
        // `parse` guarantees at least one component.
        &self.components[self.components.len() - 1]
    }
}

/// The directory file operations are confined to: the work directory, or
/// (protocol 4's `root`) the run's root filesystem.
#[derive(Debug, Clone)]
pub struct WorkDir {
    path: PathBuf,
    /// How request paths resolve below it.
    resolve: ResolveFlags,
    /// Requests name paths absolute (from `/`) rather than relative.
    absolute: bool,
}

/// An opened [`WorkDir`] for one operation: the handle every path of the
/// operation is resolved from, with the rules to resolve them by.
#[derive(Debug)]
pub struct Root {
    fd: OwnedFd,
    resolve: ResolveFlags,
}

impl AsFd for Root {
    fn as_fd(&self) -> std::os::fd::BorrowedFd<'_> {
        self.fd.as_fd()
    }
}

impl WorkDir {
    /// Wraps an absolute path; nothing is opened until [`Self::open`].
    /// Request paths are relative to it and may not leave it
    /// (`RESOLVE_BENEATH`): an absolute symlink inside it is refused.
    pub fn new(path: PathBuf) -> Self {
        Self {
            path,
            resolve: ResolveFlags::BENEATH | ResolveFlags::NO_MAGICLINKS,
            absolute: false,
        }
    }

    /// `path` as a root filesystem: request paths are absolute, and resolve
    /// as if `path` were `/` (`RESOLVE_IN_ROOT`), so an absolute symlink
    /// means what it means to the run's commands and `..` stops at the top.
    /// The agent uses it on `/`, its own root, which is the run's.
    pub fn file_system(path: PathBuf) -> Self {
        Self {
            path,
            resolve: ResolveFlags::IN_ROOT | ResolveFlags::NO_MAGICLINKS,
            absolute: true,
        }
    }

    /// Checks a request path for this directory ([`RelPath::parse`], or its
    /// absolute form for a root filesystem).
    pub fn parse(&self, path: &str) -> Result<RelPath, FileError> {
        RelPath::parse_in(path, self.absolute)
    }

    /// [`WorkDir::parse`], with None for the directory itself.
    pub fn parse_or_root(&self, path: &str) -> Result<Option<RelPath>, FileError> {
        RelPath::parse_or_root_in(path, self.absolute)
    }

    /// The configured path (also the default working directory of commands).
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Opens the work directory for one operation, as an `O_PATH` handle.
    ///
    /// Resolution follows no symlink at all: the sandbox can replace the
    /// work directory between requests, and opening it afresh each time
    /// with `RESOLVE_NO_SYMLINKS` makes such a swap fail loudly instead of
    /// quietly redirecting the daemon's reads and writes.
    pub fn open(&self) -> Result<Root, FileError> {
        let fd = retry_resolve(|| {
            rustix::fs::openat2(
                rustix::fs::CWD,
                &self.path,
                OFlags::PATH | OFlags::DIRECTORY | OFlags::CLOEXEC,
                Mode::empty(),
                ResolveFlags::NO_SYMLINKS | ResolveFlags::NO_MAGICLINKS,
            )
        })
        .map_err(|source| FileError::WorkDir {
            path: self.path.clone(),
            source,
        })?;
        Ok(Root {
            fd,
            resolve: self.resolve,
        })
    }
}

/// Opens `rel` relative to `root` without ever leaving it.
///
/// Below a work directory, symlinks are followed only while they stay
/// beneath it; absolute symlinks, `..` that climbs out, and `/proc` magic
/// links fail with `EXDEV` or `ELOOP`. Below a root filesystem, absolute
/// symlinks and `..` resolve within it and magic links fail. `O_CLOEXEC` is
/// always added so no command inherits the fd.
pub fn open_beneath(root: &Root, rel: &str, flags: OFlags, mode: Mode) -> Result<OwnedFd, Errno> {
    let dir = root.fd.as_fd();
    retry_resolve(|| rustix::fs::openat2(dir, rel, flags | OFlags::CLOEXEC, mode, root.resolve))
}

/// Runs an `openat2` call again when the kernel aborted it because of a
/// concurrent rename (`EAGAIN`, which `RESOLVE_BENEATH` reports instead of
/// risking a wrong answer) or a signal (`EINTR`).
fn retry_resolve(mut open: impl FnMut() -> Result<OwnedFd, Errno>) -> Result<OwnedFd, Errno> {
    let mut attempts = 0;
    loop {
        match open() {
            Err(Errno::AGAIN | Errno::INTR) if attempts < RESOLVE_RETRIES => attempts += 1,
            other => return other,
        }
    }
}

#[cfg(test)]
mod tests {

    #[test]
    fn a_path_is_never_named_as_its_own_parent() {
        let own = FileError::NotADirectory {
            path: "hello.txt".into(),
            target: "hello.txt".into(),
        };
        assert_eq!(own.to_string(), "\"hello.txt\" is not a directory");
        let parent = FileError::NotADirectory {
            path: "hello.txt".into(),
            target: "hello.txt/x".into(),
        };
        assert!(parent.to_string().contains("cannot hold \"hello.txt/x\""));
        let unknown = FileError::from_errno(Errno::NOTDIR, "read", "hello.txt/x");
        assert_eq!(unknown.kind(), "not_a_file");
        assert_eq!(
            unknown.to_string(),
            "a parent of \"hello.txt/x\" is a file, not a directory"
        );
    }
    use super::*;

    #[test]
    fn a_root_filesystem_takes_absolute_paths_only() {
        let fs = WorkDir::file_system(PathBuf::from("/"));
        assert_eq!(fs.parse("/etc//./hosts").unwrap().normalized(), "etc/hosts");
        assert_eq!(fs.parse("/etc/hosts").unwrap().original(), "/etc/hosts");
        assert!(fs.parse_or_root("/").unwrap().is_none());
        assert!(fs.parse_or_root("/./").unwrap().is_none());
        for bad in ["etc/hosts", "", "/", "/a/../b", "/a\0b"] {
            assert!(
                matches!(fs.parse(bad), Err(FileError::InvalidPath { .. })),
                "{bad:?} should be refused"
            );
        }
        // A relative path is not the root: it is refused, not listed.
        assert!(fs.parse_or_root("etc").is_err());
        assert!(fs.parse_or_root("").is_err());
        let work = WorkDir::new(PathBuf::from("/work"));
        assert!(work.parse("/etc/hosts").is_err());
    }

    #[test]
    fn a_root_filesystem_resolves_absolute_symlinks_inside_itself() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir(dir.path().join("etc")).unwrap();
        std::fs::write(dir.path().join("etc/real"), b"inside").unwrap();
        // Absolute, as images have them (/etc/localtime -> /usr/share/...).
        std::os::unix::fs::symlink("/etc/real", dir.path().join("link")).unwrap();
        std::os::unix::fs::symlink("../../../etc/real", dir.path().join("climb")).unwrap();

        let fs = WorkDir::file_system(dir.path().to_owned());
        let root = fs.open().unwrap();
        for name in ["link", "climb"] {
            let fd = open_beneath(&root, name, OFlags::RDONLY, Mode::empty()).unwrap();
            let mut text = String::new();
            std::io::Read::read_to_string(&mut std::fs::File::from(fd), &mut text).unwrap();
            assert_eq!(text, "inside", "{name} must resolve within the root");
        }

        // The same tree as a work directory refuses both.
        let work = WorkDir::new(dir.path().to_owned()).open().unwrap();
        for name in ["link", "climb"] {
            assert_eq!(
                open_beneath(&work, name, OFlags::RDONLY, Mode::empty()).unwrap_err(),
                Errno::XDEV
            );
        }
    }

    fn reason(path: &str) -> &'static str {
        match RelPath::parse(path) {
            Err(FileError::InvalidPath { reason, .. }) => reason,
            other => panic!("{path:?} should be invalid, got {other:?}"),
        }
    }

    #[test]
    fn accepts_and_normalizes_relative_paths() {
        let p = RelPath::parse("a//./b/c.txt").unwrap();
        assert_eq!(p.normalized(), "a/b/c.txt");
        assert_eq!(p.parents(), ["a", "b"]);
        assert_eq!(p.file_name(), "c.txt");
        assert_eq!(p.original(), "a//./b/c.txt");

        let p = RelPath::parse("./file/").unwrap();
        assert_eq!(p.normalized(), "file");
        assert!(p.parents().is_empty());
        // Names that merely start with dots are ordinary names.
        assert_eq!(RelPath::parse("..a/...").unwrap().normalized(), "..a/...");
    }

    #[test]
    fn refuses_bad_paths() {
        assert!(reason("").contains("empty"));
        assert!(reason("/etc/passwd").contains("absolute"));
        assert!(reason("a\0b").contains("NUL"));
        assert!(reason("..").contains(".."));
        assert!(reason("a/../b").contains(".."));
        assert!(reason("a/..").contains(".."));
        assert!(reason(".").contains("work directory itself"));
        assert!(reason("./").contains("work directory itself"));
    }

    #[test]
    fn enforces_length_limits() {
        let longest_name = "x".repeat(MAX_COMPONENT_BYTES);
        assert!(RelPath::parse(&longest_name).is_ok());
        assert!(reason(&format!("{longest_name}x")).contains("255"));

        let at_limit = "a/".repeat(MAX_PATH_BYTES / 2);
        assert_eq!(at_limit.len(), MAX_PATH_BYTES);
        assert!(RelPath::parse(&at_limit).is_ok());
        assert!(reason(&format!("{at_limit}a")).contains("4096"));
    }

    #[test]
    fn errors_map_to_kinds_and_codes() {
        let cases = [
            (Errno::XDEV, "escape", Code::PermissionDenied),
            (Errno::LOOP, "escape", Code::PermissionDenied),
            (Errno::NOENT, "not_found", Code::NotFound),
            (Errno::ISDIR, "not_a_file", Code::FailedPrecondition),
            (Errno::ACCESS, "denied", Code::PermissionDenied),
            (Errno::IO, "io", Code::Internal),
        ];
        for (errno, kind, code) in cases {
            let err = FileError::from_errno(errno, "open", "x");
            assert_eq!(err.kind(), kind, "{errno:?}");
            let status = Status::from(err);
            assert_eq!(status.code(), code, "{errno:?}");
            assert_eq!(status.metadata().get(KIND_METADATA_KEY).unwrap(), kind);
        }
        let shrank = Status::from(FileError::Shrank { path: "x".into() });
        assert_eq!(shrank.code(), Code::DataLoss);
        assert_eq!(shrank.metadata().get(KIND_METADATA_KEY).unwrap(), "io");
    }

    #[test]
    fn io_status_message_includes_the_cause() {
        let status = Status::from(FileError::from_errno(Errno::IO, "write", "f"));
        assert!(status.message().starts_with("cannot write \"f\": "));
        assert!(status.message().len() > "cannot write \"f\": ".len());
    }
}
