//! Connections a handler can end with a reset.
//!
//! When a sandbox is killed under an E2B process stream, envd's clients see
//! the connection break, because envd and its machine are gone; the SDKs
//! then ask whether the sandbox still runs and report it killed. An error
//! in a response body makes hyper reset an HTTP/2 stream, which the SDKs
//! read as that break; over HTTP/1.1 hyper closes the connection cleanly
//! after a truncated chunk, which they read as a protocol error instead. So
//! every connection of the API listener carries a [`Severable`] flag, and a
//! connection whose flag is armed is closed with a TCP reset (`SO_LINGER`
//! zero), exactly what a vanished peer looks like.

use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use axum::extract::connect_info::Connected;
use axum::serve::{IncomingStream, Listener};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};

/// The API listener: TCP connections with `TCP_NODELAY` and a reset flag.
pub struct SeverableListener(pub TcpListener);

impl Listener for SeverableListener {
    type Io = SeverableStream;
    type Addr = std::net::SocketAddr;

    async fn accept(&mut self) -> (Self::Io, Self::Addr) {
        let (tcp, addr) = Listener::accept(&mut self.0).await;
        // Small writes (an exec's last events, short JSON answers) must
        // leave at once: with Nagle's algorithm on, they wait out the
        // peer's delayed ACK and a 3 ms exec takes 45 ms.
        if let Err(e) = tcp.set_nodelay(true) {
            tracing::warn!(error = %e, "could not set TCP_NODELAY");
        }
        let stream = SeverableStream {
            tcp,
            reset: Arc::new(AtomicBool::new(false)),
        };
        (stream, addr)
    }

    fn local_addr(&self) -> std::io::Result<Self::Addr> {
        self.0.local_addr()
    }
}

/// A connection that closes with a reset once its flag is armed.
pub struct SeverableStream {
    tcp: TcpStream,
    reset: Arc<AtomicBool>,
}

impl Drop for SeverableStream {
    fn drop(&mut self) {
        if self.reset.load(Ordering::Acquire) {
            // A zero linger does not block the close (tokio's deprecation
            // is about non-zero ones): the kernel drops what is queued and
            // sends RST.
            #[allow(deprecated)]
            if let Err(e) = self.tcp.set_linger(Some(Duration::ZERO)) {
                tracing::debug!(error = %e, "could not arm a connection reset");
            }
        }
    }
}

impl AsyncRead for SeverableStream {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.tcp).poll_read(cx, buf)
    }
}

impl AsyncWrite for SeverableStream {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.tcp).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.tcp).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.tcp.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.tcp).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        // Armed, the close must be the reset: no orderly FIN first.
        if self.reset.load(Ordering::Acquire) {
            return Poll::Ready(Ok(()));
        }
        Pin::new(&mut self.tcp).poll_shutdown(cx)
    }
}

/// A request's handle on its connection's reset flag (as `ConnectInfo`),
/// with the peer's address.
#[derive(Clone, Debug)]
pub struct Severable(Arc<AtomicBool>, pub std::net::SocketAddr);

/// What a handler takes to break its connection: present for HTTP/1.x
/// requests of the API listener. An HTTP/2 connection is shared by other
/// streams and needs no help: a body error resets just its stream.
pub type Sever = Option<axum::Extension<axum::extract::ConnectInfo<Severable>>>;

/// The flag to arm, if breaking `version`'s connection is this layer's job.
pub fn severable(sever: Sever, version: axum::http::Version) -> Option<Severable> {
    let axum::Extension(axum::extract::ConnectInfo(flag)) = sever?;
    (version < axum::http::Version::HTTP_2).then_some(flag)
}

/// The peer of a request served by the API listener, if it was.
pub fn peer(request: &axum::extract::Request) -> Option<std::net::SocketAddr> {
    request
        .extensions()
        .get::<axum::extract::ConnectInfo<Severable>>()
        .map(|info| info.0 .1)
}

impl Severable {
    /// Makes the connection end with a reset when it closes.
    pub fn arm(&self) {
        self.0.store(true, Ordering::Release);
    }
}

impl Connected<IncomingStream<'_, SeverableListener>> for Severable {
    fn connect_info(stream: IncomingStream<'_, SeverableListener>) -> Self {
        Severable(Arc::clone(&stream.io().reset), *stream.remote_addr())
    }
}

/// Marks an answer given before its request's body was read to the end with
/// `Connection: close`.
///
/// A handler may refuse a request from its head alone (an image name that
/// exists, a bad token) and leave the body unread. hyper then closes the
/// connection after the answer, but the answer itself still reads as
/// keep-alive, so a client that finished writing the body returns the
/// connection to its pool and its next request there fails with a broken
/// pipe. Saying `close` in the answer lets every client know the connection
/// ends. HTTP/2 needs none of this: an unread stream is reset alone.
pub async fn close_unread(
    request: axum::extract::Request,
    next: axum::middleware::Next,
) -> axum::response::Response {
    use axum::http::{header, HeaderValue, Version};
    if request.version() >= Version::HTTP_2 {
        return next.run(request).await;
    }
    let (parts, body) = request.into_parts();
    let read = Arc::new(AtomicBool::new(http_body::Body::is_end_stream(&body)));
    let body = axum::body::Body::new(ReadToEnd {
        inner: body,
        read: Arc::clone(&read),
    });
    let mut response = next
        .run(axum::extract::Request::from_parts(parts, body))
        .await;
    let switching = response.status() == axum::http::StatusCode::SWITCHING_PROTOCOLS;
    if !switching && !read.load(Ordering::Acquire) {
        response
            .headers_mut()
            .insert(header::CONNECTION, HeaderValue::from_static("close"));
    }
    response
}

/// A request body that notes when it has been read to its end.
struct ReadToEnd {
    inner: axum::body::Body,
    read: Arc<AtomicBool>,
}

impl http_body::Body for ReadToEnd {
    type Data = bytes::Bytes;
    type Error = axum::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<Self::Data>, Self::Error>>> {
        let polled = Pin::new(&mut self.inner).poll_frame(cx);
        if let Poll::Ready(None) = polled {
            self.read.store(true, Ordering::Release);
        } else if let Poll::Ready(Some(Ok(_))) = polled {
            if self.inner.is_end_stream() {
                self.read.store(true, Ordering::Release);
            }
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.inner.size_hint()
    }
}
