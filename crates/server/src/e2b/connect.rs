//! The Connect protocol's JSON codec, server side: unary calls
//! (`application/json`), server streams and client streams
//! (`application/connect+json`, length-prefixed envelopes), errors, and the
//! `Connect-Timeout-Ms` deadline.
//!
//! Written here rather than taken from a crate: the Rust Connect servers
//! (connectrpc-axum, axum-connect, connectrpc) generate their handlers from
//! `.proto` files through prost and protoc at build time and speak protobuf
//! JSON through pbjson, while the two E2B SDKs only ever send JSON with
//! compression off. The codec they need is the envelope framing and the
//! error mapping below, under 300 lines, and the messages are plain serde
//! types (see `envd::wire`) checked like every other request body.

use std::time::Duration;

use axum::body::Body;
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use bytes::{Buf, BufMut, Bytes, BytesMut};
use futures::stream::{BoxStream, Stream, StreamExt};
use runbox_core::CoreError;
use runbox_types::ErrorCode;
use serde::de::DeserializeOwned;
use serde::Serialize;

/// The largest message accepted in either direction (a client's envelope
/// may not claim more).
pub const MAX_MESSAGE_BYTES: usize = 4 << 20;

/// Envelope flag: the message is compressed (never accepted).
const FLAG_COMPRESSED: u8 = 0x01;
/// Envelope flag: the end-of-stream message.
const FLAG_END_STREAM: u8 = 0x02;

/// A Connect error code.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Code {
    Canceled,
    InvalidArgument,
    DeadlineExceeded,
    NotFound,
    AlreadyExists,
    PermissionDenied,
    ResourceExhausted,
    FailedPrecondition,
    Unimplemented,
    Internal,
    Unavailable,
    Unauthenticated,
}

impl Code {
    /// The code's name on the wire.
    pub fn as_str(self) -> &'static str {
        match self {
            Code::Canceled => "canceled",
            Code::InvalidArgument => "invalid_argument",
            Code::DeadlineExceeded => "deadline_exceeded",
            Code::NotFound => "not_found",
            Code::AlreadyExists => "already_exists",
            Code::PermissionDenied => "permission_denied",
            Code::ResourceExhausted => "resource_exhausted",
            Code::FailedPrecondition => "failed_precondition",
            Code::Unimplemented => "unimplemented",
            Code::Internal => "internal",
            Code::Unavailable => "unavailable",
            Code::Unauthenticated => "unauthenticated",
        }
    }

    /// The HTTP status of a unary error with this code.
    fn status(self) -> StatusCode {
        match self {
            Code::Canceled => StatusCode::from_u16(499).expect("499 is a status"),
            Code::InvalidArgument | Code::FailedPrecondition => StatusCode::BAD_REQUEST,
            Code::DeadlineExceeded => StatusCode::GATEWAY_TIMEOUT,
            Code::NotFound => StatusCode::NOT_FOUND,
            Code::AlreadyExists => StatusCode::CONFLICT,
            Code::PermissionDenied => StatusCode::FORBIDDEN,
            Code::ResourceExhausted => StatusCode::TOO_MANY_REQUESTS,
            Code::Unimplemented => StatusCode::NOT_IMPLEMENTED,
            Code::Internal => StatusCode::INTERNAL_SERVER_ERROR,
            Code::Unavailable => StatusCode::SERVICE_UNAVAILABLE,
            Code::Unauthenticated => StatusCode::UNAUTHORIZED,
        }
    }
}

/// An error answered to a Connect call.
#[derive(Debug, Clone)]
pub struct RpcError {
    pub code: Code,
    pub message: String,
    /// Break the stream's connection instead of answering: what a client of
    /// envd sees when the sandbox under a stream is killed (the machine,
    /// and envd with it, is gone), and what the SDKs take, after asking
    /// whether the sandbox still runs, as "the sandbox was killed".
    pub sever: bool,
}

impl RpcError {
    pub fn new(code: Code, message: impl Into<String>) -> Self {
        Self {
            code,
            message: message.into(),
            sever: false,
        }
    }

    /// An error that ends a stream by breaking it (see [`RpcError::sever`]).
    pub fn severed(message: impl Into<String>) -> Self {
        Self {
            sever: true,
            ..Self::new(Code::Unavailable, message)
        }
    }

    pub fn invalid(message: impl Into<String>) -> Self {
        Self::new(Code::InvalidArgument, message)
    }

    fn body(&self) -> serde_json::Value {
        serde_json::json!({ "code": self.code.as_str(), "message": self.message })
    }
}

impl From<CoreError> for RpcError {
    fn from(e: CoreError) -> Self {
        let api = crate::ApiError::from(e);
        let code = match api.code() {
            ErrorCode::RunNotFound
            | ErrorCode::NotFound
            | ErrorCode::FileNotFound
            | ErrorCode::ProcessNotFound => Code::NotFound,
            ErrorCode::FileExists => Code::AlreadyExists,
            ErrorCode::Unauthorized => Code::Unauthenticated,
            ErrorCode::Capacity => Code::ResourceExhausted,
            // envd forgets a process once it ends.
            ErrorCode::ProcessEnded => Code::NotFound,
            // The path is refused, whatever the reason it leaves the run.
            ErrorCode::PathEscape => Code::InvalidArgument,
            ErrorCode::StdinClosed | ErrorCode::AgentTooOld => Code::FailedPrecondition,
            code => match code.status() {
                400 | 413 | 422 => Code::InvalidArgument,
                403 | 423 => Code::PermissionDenied,
                409 => Code::FailedPrecondition,
                429 => Code::ResourceExhausted,
                501 => Code::Unimplemented,
                503 => Code::Unavailable,
                504 => Code::DeadlineExceeded,
                _ => Code::Internal,
            },
        };
        RpcError::new(code, format!("{} ({})", api.message(), api.code().as_str()))
    }
}

impl IntoResponse for RpcError {
    /// The unary form: the code's status and a JSON body.
    fn into_response(self) -> Response {
        (self.code.status(), axum::Json(self.body())).into_response()
    }
}

/// How a call's messages are framed, from its `Content-Type`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Framing {
    /// `application/json`: one message, no envelope.
    Unary,
    /// `application/connect+json`: enveloped messages.
    Streaming,
}

/// Reads the framing of a call, refusing protobuf and compression, which
/// this server does not speak.
pub fn framing(headers: &HeaderMap) -> Result<Framing, RpcError> {
    let content_type = headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .map(|v| {
            v.split(';')
                .next()
                .unwrap_or("")
                .trim()
                .to_ascii_lowercase()
        })
        .unwrap_or_default();
    let framing = match content_type.as_str() {
        "application/json" => Framing::Unary,
        "application/connect+json" => Framing::Streaming,
        other => {
            return Err(RpcError::new(
                Code::Unimplemented,
                format!(
                    "content type {other:?} is not served; send JSON (application/json, or application/connect+json for streams)"
                ),
            ))
        }
    };
    for name in ["content-encoding", "connect-content-encoding"] {
        if let Some(v) = headers.get(name) {
            if !v.as_bytes().eq_ignore_ascii_case(b"identity") {
                return Err(RpcError::new(
                    Code::Unimplemented,
                    format!("{name} is not served; send the messages uncompressed"),
                ));
            }
        }
    }
    Ok(framing)
}

/// The call's deadline from `Connect-Timeout-Ms`, if it set one.
pub fn deadline(headers: &HeaderMap) -> Result<Option<Duration>, RpcError> {
    let Some(value) = headers.get("connect-timeout-ms") else {
        return Ok(None);
    };
    value
        .to_str()
        .ok()
        .filter(|v| !v.is_empty() && v.len() <= 10)
        .and_then(|v| v.parse::<u64>().ok())
        .map(|ms| Some(Duration::from_millis(ms)))
        .ok_or_else(|| RpcError::invalid("Connect-Timeout-Ms must be a number of milliseconds"))
}

/// A call's framing and deadline, from its headers.
pub fn call(headers: &HeaderMap) -> Result<(Framing, Option<Duration>), RpcError> {
    Ok((framing(headers)?, deadline(headers)?))
}

/// The body of a unary call, refused past [`MAX_MESSAGE_BYTES`].
pub async fn unary_body(body: Body) -> Result<Bytes, RpcError> {
    axum::body::to_bytes(body, MAX_MESSAGE_BYTES)
        .await
        .map_err(|_| {
            RpcError::new(
                Code::ResourceExhausted,
                format!("a message may be at most {MAX_MESSAGE_BYTES} bytes"),
            )
        })
}

/// Decodes one JSON message.
pub fn decode<T: DeserializeOwned>(bytes: &[u8]) -> Result<T, RpcError> {
    // An empty body is the empty message.
    let bytes = if bytes.iter().all(u8::is_ascii_whitespace) {
        b"{}".as_slice()
    } else {
        bytes
    };
    serde_json::from_slice(bytes)
        .map_err(|e| RpcError::invalid(format!("the request message is not valid: {e}")))
}

/// The unary answer of a call.
pub fn unary_response<T: Serialize>(result: Result<T, RpcError>) -> Response {
    match result {
        Ok(message) => axum::Json(message).into_response(),
        Err(e) => e.into_response(),
    }
}

fn envelope(flags: u8, message: &[u8]) -> Bytes {
    let mut out = BytesMut::with_capacity(5 + message.len());
    out.put_u8(flags);
    // Messages are bounded far below 4 GiB.
    out.put_u32(message.len() as u32);
    out.put_slice(message);
    out.freeze()
}

/// A streaming answer: every message of `messages` enveloped, then the
/// end-of-stream message carrying the error that ended it, if one did.
/// Always `200`: a stream's errors travel in its end message.
pub fn stream_response<T: Serialize + Send + 'static>(
    messages: BoxStream<'static, Result<T, RpcError>>,
) -> Response {
    let body = futures::stream::unfold(Some(messages), |state| async move {
        let mut messages = state?;
        match messages.next().await {
            Some(Ok(message)) => {
                let json = serde_json::to_vec(&message).unwrap_or_else(|_| b"{}".to_vec());
                Some((Ok::<_, std::io::Error>(envelope(0, &json)), Some(messages)))
            }
            // An error body ends the response early: hyper resets the
            // HTTP/2 stream, or closes an HTTP/1.1 connection before the
            // last chunk.
            Some(Err(e)) if e.sever => Some((Err(std::io::Error::other(e.message)), None)),
            Some(Err(e)) => {
                let end = serde_json::json!({ "error": e.body() });
                Some((
                    Ok(envelope(FLAG_END_STREAM, end.to_string().as_bytes())),
                    None,
                ))
            }
            None => Some((Ok(envelope(FLAG_END_STREAM, b"{}")), None)),
        }
    });
    let mut response = Response::new(Body::from_stream(body));
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/connect+json"),
    );
    response
}

/// The messages of an enveloped request body, decoded as they arrive. A
/// malformed envelope ends the stream with an error.
pub fn request_messages<T: DeserializeOwned + Send + 'static>(
    body: Body,
) -> impl Stream<Item = Result<T, RpcError>> + Send + 'static {
    let chunks = body.into_data_stream();
    futures::stream::unfold(Some((chunks, BytesMut::new())), |state| async move {
        let (mut chunks, mut buf) = state?;
        loop {
            if buf.len() >= 5 {
                let flags = buf[0];
                let len = u32::from_be_bytes([buf[1], buf[2], buf[3], buf[4]]) as usize;
                if flags & FLAG_COMPRESSED != 0 {
                    let e =
                        RpcError::new(Code::Unimplemented, "compressed messages are not served");
                    return Some((Err(e), None));
                }
                if len > MAX_MESSAGE_BYTES {
                    let e = RpcError::new(
                        Code::ResourceExhausted,
                        format!("a message may be at most {MAX_MESSAGE_BYTES} bytes"),
                    );
                    return Some((Err(e), None));
                }
                if buf.len() >= 5 + len {
                    buf.advance(5);
                    let message = buf.split_to(len);
                    if flags & FLAG_END_STREAM != 0 {
                        return None;
                    }
                    let item = decode::<T>(&message);
                    let next = item.is_ok().then_some((chunks, buf));
                    return Some((item, next));
                }
            }
            match chunks.next().await {
                // Bounded: a message's length is checked once its
                // prefix is in, so at most one message and a chunk wait.
                Some(Ok(chunk)) => buf.extend_from_slice(&chunk),
                Some(Err(e)) => {
                    let e = RpcError::new(Code::Canceled, format!("the request broke off: {e}"));
                    return Some((Err(e), None));
                }
                None if buf.is_empty() => return None,
                None => {
                    let e = RpcError::invalid("the request ended inside a message");
                    return Some((Err(e), None));
                }
            }
        }
    })
}

/// The one message of a server-streaming call's request body.
pub async fn single_message<T: DeserializeOwned + Send + 'static>(
    body: Body,
) -> Result<T, RpcError> {
    let mut messages = std::pin::pin!(request_messages::<T>(body));
    match messages.next().await {
        Some(message) => message,
        None => Err(RpcError::invalid("the stream carried no request message")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn envelopes_round_trip_across_chunk_boundaries() {
        let mut wire = Vec::new();
        wire.extend_from_slice(&envelope(0, br#"{"a":1}"#));
        wire.extend_from_slice(&envelope(0, br#"{"a":2}"#));
        wire.extend_from_slice(&envelope(FLAG_END_STREAM, b"{}"));
        // One byte at a time: every split point is exercised.
        let chunks: Vec<Result<Bytes, std::io::Error>> = wire
            .iter()
            .map(|b| Ok(Bytes::copy_from_slice(&[*b])))
            .collect();
        let body = Body::from_stream(futures::stream::iter(chunks));
        let got: Vec<serde_json::Value> =
            request_messages(body).map(|m| m.unwrap()).collect().await;
        assert_eq!(
            got,
            vec![serde_json::json!({"a":1}), serde_json::json!({"a":2})]
        );
    }

    #[tokio::test]
    async fn hostile_envelopes_are_refused() {
        let mut huge = vec![0u8];
        huge.extend_from_slice(&(u32::MAX).to_be_bytes());
        let body = Body::from(huge);
        let first = Box::pin(request_messages::<serde_json::Value>(body))
            .next()
            .await
            .unwrap();
        assert_eq!(first.unwrap_err().code, Code::ResourceExhausted);

        let compressed = envelope(FLAG_COMPRESSED, b"xx").to_vec();
        let first = Box::pin(request_messages::<serde_json::Value>(Body::from(
            compressed,
        )))
        .next()
        .await
        .unwrap();
        assert_eq!(first.unwrap_err().code, Code::Unimplemented);

        let cut = envelope(0, br#"{"a":1}"#)[..6].to_vec();
        let first = Box::pin(request_messages::<serde_json::Value>(Body::from(cut)))
            .next()
            .await
            .unwrap();
        assert_eq!(first.unwrap_err().code, Code::InvalidArgument);

        let bad_json = envelope(0, b"{nope").to_vec();
        let first = Box::pin(request_messages::<serde_json::Value>(Body::from(bad_json)))
            .next()
            .await
            .unwrap();
        assert_eq!(first.unwrap_err().code, Code::InvalidArgument);
    }

    #[test]
    fn only_uncompressed_json_is_served() {
        let mut h = HeaderMap::new();
        h.insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/proto"),
        );
        assert_eq!(framing(&h).unwrap_err().code, Code::Unimplemented);
        h.insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/json; charset=utf-8"),
        );
        assert_eq!(framing(&h).unwrap(), Framing::Unary);
        h.insert("connect-content-encoding", HeaderValue::from_static("gzip"));
        assert_eq!(framing(&h).unwrap_err().code, Code::Unimplemented);
        let mut h = HeaderMap::new();
        h.insert("connect-timeout-ms", HeaderValue::from_static("soon"));
        assert!(deadline(&h).is_err());
        h.insert("connect-timeout-ms", HeaderValue::from_static("1500"));
        assert_eq!(deadline(&h).unwrap(), Some(Duration::from_millis(1500)));
    }
}
