//! Interactive sessions over WebSocket: a new command with its input open
//! (a terminal, or stdin streamed as it comes), or an attach to a process
//! started earlier. The frames are `runbox_types::ws`.
//!
//! A [`Session`] is its events (an [`ExecStream`], as for `exec`) and a
//! [`SessionWriter`]. One task owns the socket's sending half, so writers
//! can be cloned and used from anywhere; dropping every writer and the
//! events closes the socket.

use bytes::Bytes;
use futures::{SinkExt as _, StreamExt as _};
use runbox_types::ws::{ClientFrame, ServerFrame, STDERR, STDOUT};
use runbox_types::{ExecRequest, SignalSpec, StartedEvent};
use tokio::sync::mpsc;
use tokio_tungstenite::tungstenite::client::IntoClientRequest as _;
use tokio_tungstenite::tungstenite::http::HeaderValue;
use tokio_tungstenite::tungstenite::Message;

use crate::{ClientError, ExecEvent, ExecStream};

/// Frames queued for sending before writers wait.
const OUTGOING: usize = 32;

/// The largest message taken from the server.
const MAX_MESSAGE: usize = 2 << 20;

/// An interactive session.
pub struct Session {
    /// The command's pid inside the run.
    pub pid: u32,
    /// Output and exit, as for `exec`; the `started` event comes first.
    pub events: ExecStream,
    /// Where input goes.
    pub writer: SessionWriter,
}

impl std::fmt::Debug for Session {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Session")
            .field("pid", &self.pid)
            .finish_non_exhaustive()
    }
}

/// The input side of a [`Session`]; cheap to clone.
#[derive(Clone, Debug)]
pub struct SessionWriter {
    tx: mpsc::Sender<Message>,
}

impl SessionWriter {
    async fn send(&self, message: Message) -> Result<(), ClientError> {
        self.tx
            .send(message)
            .await
            .map_err(|_| ClientError::WebSocket("the session is closed".into()))
    }

    async fn control(&self, frame: &ClientFrame) -> Result<(), ClientError> {
        let text = serde_json::to_string(frame).map_err(ClientError::Decode)?;
        self.send(Message::Text(text.into())).await
    }

    /// Bytes for the command's stdin (or terminal).
    pub async fn stdin(&self, data: impl Into<Bytes>) -> Result<(), ClientError> {
        self.send(Message::Binary(data.into())).await
    }

    /// Closes stdin; on a terminal, sends its end-of-file character.
    pub async fn eof(&self) -> Result<(), ClientError> {
        self.control(&ClientFrame::Eof).await
    }

    /// Sends a signal to the command's process group.
    pub async fn signal(&self, signal: SignalSpec) -> Result<(), ClientError> {
        if signal.number().is_none() {
            return Err(ClientError::WebSocket(format!(
                "{signal:?} is not a Linux signal"
            )));
        }
        self.control(&ClientFrame::Signal { signal }).await
    }

    /// Tells the terminal its new size (each side clamped to 1-10000).
    pub async fn resize(&self, rows: u32, cols: u32) -> Result<(), ClientError> {
        let clamp = |v: u32| v.clamp(1, 10_000);
        self.control(&ClientFrame::Resize {
            rows: clamp(rows),
            cols: clamp(cols),
        })
        .await
    }
}

/// `ws://` for the client's `http://` base.
fn ws_url(base: &str, path: &str) -> String {
    let rest = base.strip_prefix("http").unwrap_or(base);
    format!("ws{rest}{path}")
}

/// Opens a WebSocket to `path` with the bearer token.
pub(crate) async fn connect(
    base: &str,
    token: Option<&str>,
    path: &str,
) -> Result<
    tokio_tungstenite::WebSocketStream<tokio_tungstenite::MaybeTlsStream<tokio::net::TcpStream>>,
    ClientError,
> {
    use tokio_tungstenite::tungstenite::Error as WsError;
    let mut request = ws_url(base, path)
        .into_client_request()
        .map_err(|e| ClientError::WebSocket(e.to_string()))?;
    if let Some(token) = token {
        let value = HeaderValue::from_str(&format!("Bearer {token}"))
            .map_err(|_| ClientError::WebSocket("the token is not a valid header value".into()))?;
        request.headers_mut().insert("authorization", value);
    }
    let config = tokio_tungstenite::tungstenite::protocol::WebSocketConfig::default()
        .max_message_size(Some(MAX_MESSAGE));
    // Nagle's algorithm would hold keystrokes back for the peer's delayed ACK.
    match tokio_tungstenite::connect_async_with_config(request, Some(config), true).await {
        Ok((socket, _)) => Ok(socket),
        // Refused before the upgrade: the body is the API's error.
        Err(WsError::Http(response)) => {
            let status = response.status();
            let body = response.body().clone().unwrap_or_default();
            Err(crate::error::api_error(
                status.as_u16(),
                status.canonical_reason(),
                &body,
            ))
        }
        Err(e) => Err(ClientError::WebSocket(e.to_string())),
    }
}

/// Turns an open socket into a session: waits for `started` (or the
/// server's error), then splits it into events and a writer.
pub(crate) async fn open(
    socket: tokio_tungstenite::WebSocketStream<
        tokio_tungstenite::MaybeTlsStream<tokio::net::TcpStream>,
    >,
    start: Option<&ExecRequest>,
) -> Result<Session, ClientError> {
    let (mut sink, mut stream) = socket.split();
    if let Some(req) = start {
        let frame = serde_json::to_string(&ClientFrame::Start(Box::new(req.clone())))
            .map_err(ClientError::Decode)?;
        sink.send(Message::Text(frame.into()))
            .await
            .map_err(|e| ClientError::WebSocket(e.to_string()))?;
    }
    let pid = loop {
        match stream.next().await {
            Some(Ok(Message::Text(text))) => match decode(text.as_str())? {
                Decoded::Frame(ServerFrame::Started { pid }) => break pid,
                Decoded::Frame(ServerFrame::Error {
                    status,
                    code,
                    message,
                }) => {
                    return Err(ClientError::Api {
                        status,
                        code,
                        message,
                    })
                }
                _ => {
                    return Err(ClientError::MalformedStream(
                        "the session did not begin with started".into(),
                    ))
                }
            },
            Some(Ok(Message::Ping(_) | Message::Pong(_))) => continue,
            Some(Ok(_)) | None => return Err(ClientError::StreamEnded),
            Some(Err(e)) => return Err(ClientError::WebSocket(e.to_string())),
        }
    };
    let (tx, mut rx) = mpsc::channel::<Message>(OUTGOING);
    tokio::spawn(async move {
        while let Some(message) = rx.recv().await {
            if sink.send(message).await.is_err() {
                return;
            }
        }
        // Every writer is gone: say goodbye.
        let _ = sink.close().await;
    });
    let events =
        futures::stream::once(async move { Ok(ExecEvent::Started(StartedEvent { pid })) }).chain(
            futures::stream::unfold((stream, false), |(mut stream, done)| async move {
                if done {
                    return None;
                }
                loop {
                    let item = match stream.next().await {
                        Some(Ok(Message::Binary(data))) => match data.first() {
                            Some(&STDOUT) => Ok(ExecEvent::Stdout(data.slice(1..))),
                            Some(&STDERR) => Ok(ExecEvent::Stderr(data.slice(1..))),
                            // A stream this client does not know: skip it.
                            _ => continue,
                        },
                        Some(Ok(Message::Text(text))) => match decode(text.as_str()) {
                            Ok(Decoded::Frame(ServerFrame::Lost { chunks })) => {
                                Ok(ExecEvent::Lost(chunks))
                            }
                            Ok(Decoded::Frame(ServerFrame::Exit(exit))) => {
                                Ok(ExecEvent::Exit(exit))
                            }
                            // A frame of ours was refused and the session goes
                            // on. The writer checks what the server would
                            // refuse, so this is a server newer than its rules.
                            Ok(Decoded::Frame(ServerFrame::Error { .. })) => continue,
                            Ok(_) => continue,
                            Err(e) => Err(e),
                        },
                        Some(Ok(Message::Ping(_) | Message::Pong(_) | Message::Frame(_))) => {
                            continue
                        }
                        Some(Ok(Message::Close(_))) | None => Err(ClientError::StreamEnded),
                        Some(Err(e)) => Err(ClientError::WebSocket(e.to_string())),
                    };
                    let done = !matches!(
                        item,
                        Ok(ExecEvent::Stdout(_) | ExecEvent::Stderr(_) | ExecEvent::Lost(_))
                    );
                    return Some((item, (stream, done)));
                }
            }),
        );
    Ok(Session {
        pid,
        events: ExecStream::from_stream(events),
        writer: SessionWriter { tx },
    })
}

enum Decoded {
    Frame(ServerFrame),
    /// A frame type this client does not know.
    Unknown,
}

fn decode(text: &str) -> Result<Decoded, ClientError> {
    match serde_json::from_str::<ServerFrame>(text) {
        Ok(frame) => Ok(Decoded::Frame(frame)),
        Err(e) => {
            // Newer servers may add frame types; anything else is broken.
            let value: serde_json::Value =
                serde_json::from_str(text).map_err(ClientError::Decode)?;
            if value.get("type").and_then(|t| t.as_str()).is_some() && e.is_data() {
                Ok(Decoded::Unknown)
            } else {
                Err(ClientError::Decode(e))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_websocket_url_follows_the_base() {
        assert_eq!(
            ws_url("http://127.0.0.1:7439", "/v1/runs/x/exec/ws"),
            "ws://127.0.0.1:7439/v1/runs/x/exec/ws"
        );
        assert_eq!(
            ws_url("http://host/prefix", "/v1/x"),
            "ws://host/prefix/v1/x"
        );
    }

    #[test]
    fn unknown_frame_types_are_skipped_and_garbage_is_not() {
        assert!(matches!(
            decode(r#"{"type":"newThing","x":1}"#),
            Ok(Decoded::Unknown)
        ));
        assert!(matches!(
            decode(r#"{"type":"started","pid":3}"#),
            Ok(Decoded::Frame(ServerFrame::Started { pid: 3 }))
        ));
        assert!(decode("not json").is_err());
    }
}
