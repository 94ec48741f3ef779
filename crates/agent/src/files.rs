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
//! 2. Create an unnamed file (`O_TMPFILE`) in the target's directory (where
//!    the filesystem cannot, `.runbox-upload-<random>` with `O_EXCL`), and
//!    write each data chunk to it as it arrives.
//! 3. On `commit`, link it under a temporary name and at once rename that
//!    over the target (watchers see one rename, as before). `rename`
//!    replaces a symlink at the final name rather than following it, so the
//!    target name cannot redirect the write.
//!
//! Cancellation rule: if the call ends in any other way — stream ended
//! without commit, a stream error, or the handler future being dropped
//! because the client went away — [`TempFile`]'s `Drop` lets the unnamed
//! file go (or unlinks the named one), so nothing is written.
//!
//! Reading opens the file beneath the work directory, checks it is a
//! regular file, and streams exactly the size it had when opened.

use std::sync::Arc;

use runbox_agent_proto::pb::{
    read_file_chunk, write_file_chunk, ReadFileChunk, ReadFileHeader, WriteFileChunk,
};
use runbox_agent_proto::CHUNK_SIZE;
use runbox_confine::ops::{self, NewFile};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Status, Streaming};

use crate::confine::{FileError, RelPath, WorkDir};

/// Chunks buffered per ReadFile call before reading pauses until the client
/// catches up.
const READ_CAPACITY: usize = 4;

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
        blocking(move || -> Result<_, FileError> {
            // Resolved before anything is made: an unknown owner changes
            // nothing.
            let owner = crate::user::owner(&header.user)?;
            crate::xattrs::check(&header.xattrs)?;
            let new = NewFile {
                mode: header.mode,
                owner,
                xattrs: Some(&header.xattrs),
            };
            ops::create_temp(&work, &rel, new)
        })
        .await??
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
    blocking(move || temp.commit(&rel, true)).await??;
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
        blocking(move || ops::open_for_read(&work, &rel)).await??
    };
    let (tx, rx) = mpsc::channel(READ_CAPACITY);
    if size == 0 {
        // Files of /proc and /sys say they hold nothing and have content
        // all the same: read what is there (bounded), and say that size.
        let contents = {
            let rel = rel.clone();
            blocking(move || ops::read_unsized(file, &rel)).await??
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
