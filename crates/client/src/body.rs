//! Streaming bodies: what [`crate::Client::put_file`] and
//! [`crate::Client::import_image`] send, and what
//! [`crate::Client::get_file`] returns.
//!
//! Nothing here holds a whole file in memory: uploads pull from a reader or a
//! stream as the connection drains, downloads are written chunk by chunk.

use bytes::Bytes;
use futures::{Stream, TryStream, TryStreamExt as _};
use tokio::io::{AsyncRead, AsyncWrite, AsyncWriteExt as _};
use tokio_util::io::ReaderStream;

use crate::{BoxError, ClientError};

/// Read size for reader-backed uploads; large enough to keep syscalls and
/// HTTP frames few, small enough not to matter for memory.
const READ_CHUNK: usize = 64 * 1024;

/// A request body for an upload, with its length when known.
///
/// With a length the request carries `Content-Length`, which lets the server
/// refuse an oversized upload before any byte is sent; without one it is sent
/// chunked.
pub struct UploadBody {
    pub(crate) body: reqwest::Body,
    pub(crate) len: Option<u64>,
}

impl std::fmt::Debug for UploadBody {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("UploadBody")
            .field("len", &self.len)
            .finish_non_exhaustive()
    }
}

impl UploadBody {
    /// Streams everything `reader` yields. `len`, when given, must be exactly
    /// the number of bytes the reader will produce, or the request fails.
    pub fn from_reader<R>(reader: R, len: Option<u64>) -> Self
    where
        R: AsyncRead + Send + 'static,
    {
        Self::from_stream(ReaderStream::with_capacity(reader, READ_CHUNK), len)
    }

    /// Streams the chunks of `stream`; an error item aborts the request.
    /// `len`, when given, must be the exact total.
    pub fn from_stream<S>(stream: S, len: Option<u64>) -> Self
    where
        S: TryStream + Send + 'static,
        S::Error: Into<BoxError>,
        Bytes: From<S::Ok>,
    {
        UploadBody {
            body: reqwest::Body::wrap_stream(stream),
            len,
        }
    }

    /// Streams an open file, with its current size as the length.
    ///
    /// Only a regular file's size is trusted; a pipe or a device is sent
    /// without a length.
    pub async fn from_file(file: tokio::fs::File) -> std::io::Result<Self> {
        let meta = file.metadata().await?;
        let len = meta.is_file().then_some(meta.len());
        Ok(Self::from_reader(file, len))
    }

    /// The body's length, when known.
    pub fn content_length(&self) -> Option<u64> {
        self.len
    }
}

impl From<Bytes> for UploadBody {
    fn from(bytes: Bytes) -> Self {
        UploadBody {
            len: Some(bytes.len() as u64),
            body: reqwest::Body::from(bytes),
        }
    }
}

impl From<Vec<u8>> for UploadBody {
    fn from(bytes: Vec<u8>) -> Self {
        Bytes::from(bytes).into()
    }
}

impl From<&'static [u8]> for UploadBody {
    fn from(bytes: &'static [u8]) -> Self {
        Bytes::from_static(bytes).into()
    }
}

/// A file being downloaded from a run; the body is read only as it is
/// consumed.
#[derive(Debug)]
pub struct FileDownload {
    response: reqwest::Response,
}

impl FileDownload {
    pub(crate) fn new(response: reqwest::Response) -> Self {
        FileDownload { response }
    }

    /// The file's size as the server announced it.
    pub fn content_length(&self) -> Option<u64> {
        self.response.content_length()
    }

    /// The body as a stream of chunks.
    pub fn into_stream(self) -> impl Stream<Item = Result<Bytes, ClientError>> + Send {
        self.response.bytes_stream().map_err(ClientError::Http)
    }

    /// Writes the whole body into `dst` and flushes it; returns the number of
    /// bytes written.
    ///
    /// A body shorter than its announced length is an error (the HTTP layer
    /// checks it), so a complete copy is a complete file. On error `dst` holds
    /// a prefix of the file: write to a temporary file and rename it when the
    /// copy succeeds if that matters.
    pub async fn copy_to<W>(mut self, dst: &mut W) -> Result<u64, ClientError>
    where
        W: AsyncWrite + Unpin + ?Sized,
    {
        let mut written = 0u64;
        while let Some(chunk) = self.response.chunk().await? {
            dst.write_all(&chunk).await.map_err(ClientError::Write)?;
            written += chunk.len() as u64;
        }
        dst.flush().await.map_err(ClientError::Write)?;
        Ok(written)
    }

    /// Reads the whole body into memory. Meant for small files and tests.
    pub async fn bytes(self) -> Result<Bytes, ClientError> {
        Ok(self.response.bytes().await?)
    }
}
