//! Reaching ports inside a run: preview URLs (signed, expiring, served by
//! the preview listener) and raw connections for port forwarding. Both
//! connect from inside the run's network namespace through the lane,
//! so they work for every network tier, `none` included.

use std::time::Duration;

use runbox_types::{ErrorCode, Preview, PreviewRequest};
use time::OffsetDateTime;
use ulid::Ulid;

use super::actor::{Access, Busy};
use super::Manager;
use crate::error::CoreError;
use crate::lane::LaneError;
use crate::preview::{Grant, TokenError};

/// A preview URL's lifetime when the request names none.
pub const DEFAULT_PREVIEW_TTL: Duration = Duration::from_secs(3600);

/// The longest a preview URL may work.
pub const MAX_PREVIEW_TTL: Duration = Duration::from_secs(7 * 24 * 3600);

fn port_of(port: u32) -> Result<u16, CoreError> {
    u16::try_from(port).ok().filter(|&p| p != 0).ok_or_else(|| {
        CoreError::invalid(
            ErrorCode::BadPort,
            format!("port must be 1-65535, not {port}"),
        )
    })
}

impl Manager {
    /// Mints a preview URL for `req.port` of run `id`.
    pub async fn mint_preview(&self, id: Ulid, req: PreviewRequest) -> Result<Preview, CoreError> {
        let Some(preview) = &self.config().preview else {
            return Err(CoreError::invalid(
                ErrorCode::PreviewDisabled,
                "this server has no preview listener; start it with --preview-listen ADDR",
            ));
        };
        let port = port_of(req.port)?;
        let ttl = match req.ttl_sec {
            None => DEFAULT_PREVIEW_TTL,
            Some(secs) if (1..=MAX_PREVIEW_TTL.as_secs()).contains(&secs) => {
                Duration::from_secs(secs)
            }
            Some(secs) => {
                return Err(CoreError::invalid(
                    ErrorCode::BadTtl,
                    format!("ttlSec must be 1-{}, not {secs}", MAX_PREVIEW_TTL.as_secs()),
                ))
            }
        };
        self.admit(id, Access::Open).await?;
        let expires_at = OffsetDateTime::now_utc() + ttl;
        let token = preview.key.mint(Grant {
            run: id,
            port,
            expires: expires_at.unix_timestamp(),
        });
        Ok(Preview {
            url: format!("{}/p/{token}/", preview.base_url),
            token,
            run: id,
            port,
            // Whole seconds, as the token holds them.
            expires_at: OffsetDateTime::from_unix_timestamp(expires_at.unix_timestamp())
                .unwrap_or(expires_at),
        })
    }

    /// Checks a preview token.
    pub fn verify_preview(&self, token: &str) -> Result<Grant, CoreError> {
        let Some(preview) = &self.config().preview else {
            return Err(CoreError::invalid(
                ErrorCode::PreviewDisabled,
                "this server has no preview listener",
            ));
        };
        preview
            .key
            .verify(token, OffsetDateTime::now_utc().unix_timestamp())
            .map_err(|e| {
                let code = match e {
                    TokenError::Invalid => ErrorCode::PreviewDenied,
                    TokenError::Expired => ErrorCode::PreviewExpired,
                };
                CoreError::invalid(code, e.to_string())
            })
    }

    /// [`Manager::dial`] for a port-forward: a write, admitted under the
    /// lease. The tunnel is not counted in flight (it may stay open for
    /// hours and must not hold a lease acquire off).
    pub async fn open_port(
        &self,
        id: Ulid,
        port: u32,
        credential: Option<(String, u64)>,
    ) -> Result<RunConnection, CoreError> {
        let port = port_of(port)?;
        let admission = self.admit(id, Access::Fenced(credential)).await?;
        drop(admission.in_flight);
        Ok(RunConnection {
            stream: self.connect(id, port).await?,
            _busy: admission.busy,
        })
    }

    /// A connection to `port` on run `id`'s loopback (a preview request).
    pub async fn dial(&self, id: Ulid, port: u32) -> Result<RunConnection, CoreError> {
        let port = port_of(port)?;
        let admission = self.admit(id, Access::Open).await?;
        Ok(RunConnection {
            stream: self.connect(id, port).await?,
            _busy: admission.busy,
        })
    }

    /// Connects to `port` on the loopback of run `id`, admitted already.
    async fn connect(&self, id: Ulid, port: u16) -> Result<tokio::net::TcpStream, CoreError> {
        let stream = self
            .lane
            .sandbox(id)
            .dial(port)
            .await
            .map_err(|e| match e {
                LaneError::Io { source, .. }
                    if matches!(
                        source.kind(),
                        std::io::ErrorKind::ConnectionRefused | std::io::ErrorKind::TimedOut
                    ) =>
                {
                    CoreError::invalid(
                        ErrorCode::PortUnreachable,
                        format!(
                            "nothing accepts connections on port {port} in run {id} \
                         (a server must listen on 0.0.0.0, 127.0.0.1 or ::1 there)"
                        ),
                    )
                }
                other => CoreError::Lane(other),
            })?;
        stream
            .set_nonblocking(true)
            .and_then(|()| tokio::net::TcpStream::from_std(stream))
            .map_err(CoreError::io("registering a connection into a run"))
    }
}

/// A TCP connection into a run; the run does not count as idle while it
/// is open.
pub struct RunConnection {
    stream: tokio::net::TcpStream,
    _busy: Busy,
}

impl RunConnection {
    /// The connection itself.
    pub fn stream(&self) -> &tokio::net::TcpStream {
        &self.stream
    }
}

impl tokio::io::AsyncRead for RunConnection {
    fn poll_read(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.stream).poll_read(cx, buf)
    }
}

impl tokio::io::AsyncWrite for RunConnection {
    fn poll_write(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &[u8],
    ) -> std::task::Poll<std::io::Result<usize>> {
        std::pin::Pin::new(&mut self.stream).poll_write(cx, buf)
    }

    fn poll_flush(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.stream).poll_flush(cx)
    }

    fn poll_shutdown(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.stream).poll_shutdown(cx)
    }

    fn poll_write_vectored(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> std::task::Poll<std::io::Result<usize>> {
        std::pin::Pin::new(&mut self.stream).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.stream.is_write_vectored()
    }
}
