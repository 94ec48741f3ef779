//! The WriteFile and ReadFile RPCs: moving whole files in and out of the
//! work directory, in bounded memory.
//!
//! Every path goes through `confine` first; this module only ever opens
//! files through the handles it returns, so nothing here can leave the work
//! directory.
//!
//! Writing, step by step:
//!
//! 1. Check the header's path, open the work directory, and resolve or
//!    create each missing parent one component at a time (each step
//!    resolved beneath the work directory again, so a symlink planted along
//!    the way is judged by the kernel).
//! 2. Create `.runbox-upload-<random>` next to the target with `O_EXCL`,
//!    and write each data chunk to it as it arrives.
//! 3. On `commit`, rename it over the target. `rename` replaces a symlink
//!    at the final name rather than following it, so the target name cannot
//!    redirect the write.
//!
//! Cancellation rule: if the call ends in any other way — stream ended
//! without commit, a stream error, or the handler future being dropped
//! because the client went away — [`TempFile`]'s `Drop` unlinks the
//! temporary file, so nothing is written.
//!
//! Reading opens the file beneath the work directory, checks it is a
//! regular file, and streams exactly the size it had when opened.

use std::fs::File;
use std::hash::{BuildHasher, Hasher};
use std::os::fd::OwnedFd;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use runbox_agent_proto::pb::{
    read_file_chunk, write_file_chunk, ReadFileChunk, ReadFileHeader, WriteFileChunk,
    WriteFileHeader,
};
use runbox_agent_proto::CHUNK_SIZE;
use rustix::fs::{AtFlags, FileType, Mode, OFlags};
use rustix::io::Errno;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Status, Streaming};

use crate::confine::{open_beneath, FileError, RelPath, Root, WorkDir};

/// Chunks buffered per ReadFile call before reading pauses until the client
/// catches up.
const READ_CAPACITY: usize = 4;

/// Mode of directories created for missing parents (before the umask).
const DIR_MODE: u32 = 0o755;

/// Mode of a written file when the header gives none.
const DEFAULT_FILE_MODE: u32 = 0o644;

/// Prefix of temporary upload files; the random suffix follows.
const TEMP_PREFIX: &str = runbox_agent_proto::UPLOAD_TEMP_PREFIX;

/// Attempts at finding an unused temporary name; only a sandbox that
/// pre-creates names on purpose can make more than one necessary.
const TEMP_ATTEMPTS: usize = 16;

/// The response stream of one ReadFile call.
pub type ReadStream = ReceiverStream<Result<ReadFileChunk, Status>>;

/// Runs one WriteFile call and returns the number of bytes written.
///
/// Cancellation: dropping this future at any await removes the temporary
/// file (see [`TempFile`]) and leaves the target untouched.
pub async fn write_file(
    work: Arc<WorkDir>,
    file_system: Arc<WorkDir>,
    mut input: Streaming<WriteFileChunk>,
) -> Result<u64, Status> {
    let header = match input.message().await? {
        Some(WriteFileChunk {
            kind: Some(write_file_chunk::Kind::Header(header)),
        }) => header,
        _ => {
            return Err(FileError::InvalidRequest(
                "the first write message must be a header with the path",
            )
            .into())
        }
    };
    let work = if header.root { file_system } else { work };
    let rel = work.parse(&header.path)?;

    let (temp, file) = {
        let rel = rel.clone();
        blocking(move || create_temp(&work, &rel, &header)).await??
    };
    let mut file = tokio::fs::File::from_std(file);
    let write_error = |source| FileError::Io {
        op: "write",
        path: rel.original().to_owned(),
        source,
    };

    let mut written: u64 = 0;
    loop {
        match input.message().await? {
            Some(WriteFileChunk {
                kind: Some(write_file_chunk::Kind::Data(data)),
            }) => {
                // Each chunk goes straight to disk: memory stays bounded by
                // the message size limit, whatever the file size.
                file.write_all(&data).await.map_err(write_error)?;
                written += data.len() as u64;
            }
            Some(WriteFileChunk {
                kind: Some(write_file_chunk::Kind::Commit(_)),
            }) => break,
            Some(WriteFileChunk {
                kind: Some(write_file_chunk::Kind::Header(_)),
            }) => {
                return Err(FileError::InvalidRequest("a write carries exactly one header").into())
            }
            // An empty message carries nothing; skip it.
            Some(WriteFileChunk { kind: None }) => {}
            None => {
                return Err(FileError::InvalidRequest(
                    "the stream ended before commit; nothing was written",
                )
                .into())
            }
        }
    }
    // tokio's File finishes writes in the background; flush waits for the
    // last one, and surfaces its error, before the rename publishes it.
    file.flush().await.map_err(write_error)?;
    drop(file);
    blocking(move || temp.commit(&rel)).await??;
    Ok(written)
}

/// Runs one ReadFile call: opens the file and returns the stream that a
/// background task fills.
///
/// Errors found before the first byte (bad path, missing file, not a
/// regular file) fail the call itself; a file that shrinks while being read
/// ends the stream with `data_loss`.
pub async fn read_file(work: Arc<WorkDir>, path: String) -> Result<ReadStream, Status> {
    let rel = work.parse(&path)?;
    let (file, size, mode) = {
        let rel = rel.clone();
        blocking(move || open_for_read(&work, &rel)).await??
    };
    let (tx, rx) = mpsc::channel(READ_CAPACITY);
    if size == 0 {
        // Files of /proc and /sys say they hold nothing and have content
        // all the same: read what is there (bounded), and say that size.
        let contents = {
            let rel = rel.clone();
            blocking(move || read_unsized(file, &rel)).await??
        };
        let size = contents.len() as u64;
        tokio::spawn(send_file(
            std::io::Cursor::new(contents),
            size,
            mode,
            rel,
            tx,
        ));
    } else {
        tokio::spawn(send_file(
            tokio::fs::File::from_std(file),
            size,
            mode,
            rel,
            tx,
        ));
    }
    Ok(ReceiverStream::new(rx))
}

/// The most a file that reports no size is read for (pseudo-files of
/// /proc and /sys are a few KiB).
const MAX_UNSIZED: u64 = 1 << 20;

/// Reads a file whose size says 0 to its end, up to [`MAX_UNSIZED`].
fn read_unsized(file: File, rel: &RelPath) -> Result<Vec<u8>, FileError> {
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

/// Opens `rel` for reading and returns it with its size and permission bits.
fn open_for_read(work: &WorkDir, rel: &RelPath) -> Result<(File, u64, u32), FileError> {
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

/// Streams the header and exactly `size` bytes of `file` into `tx`.
async fn send_file(
    mut file: impl tokio::io::AsyncRead + Unpin,
    size: u64,
    mode: u32,
    rel: RelPath,
    tx: mpsc::Sender<Result<ReadFileChunk, Status>>,
) {
    let header = ReadFileChunk {
        kind: Some(read_file_chunk::Kind::Header(ReadFileHeader { size, mode })),
    };
    if tx.send(Ok(header)).await.is_err() {
        return;
    }
    let mut remaining = size;
    let mut buf = vec![0u8; CHUNK_SIZE];
    while remaining > 0 {
        // Stop at the size announced in the header even if the file grew.
        let want = buf
            .len()
            .min(usize::try_from(remaining).unwrap_or(usize::MAX));
        let message = match file.read(&mut buf[..want]).await {
            Ok(0) => Err(FileError::Shrank {
                path: rel.original().to_owned(),
            }
            .into()),
            Ok(n) => {
                remaining -= n as u64;
                Ok(ReadFileChunk {
                    kind: Some(read_file_chunk::Kind::Data(buf[..n].to_vec())),
                })
            }
            Err(source) => Err(FileError::Io {
                op: "read",
                path: rel.original().to_owned(),
                source,
            }
            .into()),
        };
        let failed = message.is_err();
        // A send error means the client went away: stop reading.
        if tx.send(message).await.is_err() || failed {
            return;
        }
    }
}

/// A temporary upload file that is removed unless committed.
#[derive(Debug)]
struct TempFile {
    /// The directory that holds both the temporary file and the target.
    parent: OwnedFd,
    name: String,
    committed: bool,
}

impl TempFile {
    /// Renames the temporary file over the target name.
    fn commit(mut self, rel: &RelPath) -> Result<(), FileError> {
        rustix::fs::renameat(&self.parent, &self.name, &self.parent, rel.file_name()).map_err(
            |errno| match errno {
                // The target became a directory after the early check.
                Errno::ISDIR | Errno::NOTEMPTY | Errno::EXIST => FileError::NotAFile {
                    path: rel.original().to_owned(),
                    what: "a directory",
                },
                other => FileError::from_errno(other, "rename into", rel.original()),
            },
        )?;
        self.committed = true;
        Ok(())
    }
}

impl Drop for TempFile {
    fn drop(&mut self) {
        if !self.committed {
            // Best effort: if this fails the file stays hidden under its
            // dot-name and holds no committed data.
            let _ = rustix::fs::unlinkat(&self.parent, &self.name, AtFlags::empty());
        }
    }
}

/// Resolves the target's parent (creating what is missing), checks the
/// target is not a directory, and creates the temporary file beside it.
fn create_temp(
    work: &WorkDir,
    rel: &RelPath,
    header: &WriteFileHeader,
) -> Result<(TempFile, File), FileError> {
    // Resolved before anything is made: an unknown owner changes nothing.
    let owner = match header.user.as_str() {
        "" => None,
        spec => Some(crate::user::resolve(spec).map_err(FileError::BadUser)?),
    };
    crate::xattrs::check(&header.xattrs)?;
    let root = work.open()?;
    let parent = open_parent(&root, rel, owner.as_ref())?;

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
    let mode = match header.mode & 0o777 {
        0 => DEFAULT_FILE_MODE,
        mode => mode,
    };
    for _ in 0..TEMP_ATTEMPTS {
        let name = format!("{TEMP_PREFIX}{:016x}", random_u64());
        // O_EXCL with O_CREAT never follows a symlink at the name, and the
        // parent handle is already confined, so this cannot leave the work
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
            name,
            committed: false,
        };
        // The header's mode is applied exactly: the agent's umask is an
        // accident of how it was started and must not change the result.
        if let Some(owner) = &owner {
            rustix::fs::fchown(
                &fd,
                Some(rustix::process::Uid::from_raw(owner.uid)),
                Some(rustix::process::Gid::from_raw(owner.gid)),
            )
            .map_err(|errno| FileError::from_errno(errno, "set the owner of", rel.original()))?;
        }
        // After the chown, which clears set-id bits (none are set anyway).
        rustix::fs::fchmod(&fd, Mode::from_raw_mode(mode))
            .map_err(|errno| FileError::from_errno(errno, "set the mode of", rel.original()))?;
        crate::xattrs::set(&fd, &header.xattrs).map_err(|errno| {
            FileError::from_errno(errno, "set the extended attributes of", rel.original())
        })?;
        return Ok((temp, File::from(fd)));
    }
    Err(FileError::Io {
        op: "find a free temporary name for",
        path: rel.original().to_owned(),
        source: Errno::EXIST.into(),
    })
}

/// Opens the directory that will hold `rel`, creating missing parents.
///
/// Each parent is resolved from the work directory as a whole prefix, not
/// from the previous component: that way a symlink among the parents is
/// followed when it stays inside the work directory (`RESOLVE_BENEATH`
/// judges the full path), and refused when it leaves it.
pub(crate) fn open_parent(
    root: &Root,
    rel: &RelPath,
    owner: Option<&crate::user::Identity>,
) -> Result<OwnedFd, FileError> {
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
pub(crate) fn chown_made(fd: &OwnedFd, owner: Option<&crate::user::Identity>) -> Result<(), Errno> {
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

/// Runs blocking file-system work off the async workers: a slow or hostile
/// mount inside the work directory must not stall every other call.
pub(crate) async fn blocking<T: Send + 'static>(
    work: impl FnOnce() -> T + Send + 'static,
) -> Result<T, Status> {
    tokio::task::spawn_blocking(work).await.map_err(|err| {
        Status::from(FileError::Internal(format!(
            "the file operation did not finish: {err}"
        )))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn temp_names_differ() {
        let a = random_u64();
        let b = random_u64();
        assert_ne!(a, b);
    }
}
