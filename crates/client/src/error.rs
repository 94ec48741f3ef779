//! The client's one error type, and the parsing of the API's error bodies.
//!
//! Every failure the SDK can report is a [`ClientError`]: the server said no
//! ([`ClientError::Api`]), the request never got an answer
//! ([`ClientError::Http`]), or the answer was not what the contract promises.

use runbox_types::{ErrorBody, ErrorCode};

/// A boxed error, as carried by streams whose source error type is erased.
pub type BoxError = Box<dyn std::error::Error + Send + Sync + 'static>;

/// Everything that can go wrong when talking to a runbox daemon.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ClientError {
    /// The base URL given to [`crate::Client::new`] cannot be parsed.
    #[error("invalid base url {url:?}")]
    InvalidUrl {
        /// The URL as given.
        url: String,
        /// Why it does not parse.
        #[source]
        source: url::ParseError,
    },
    /// The base URL parses but cannot be used (wrong scheme, a query, ...).
    #[error("unusable base url {url:?}: {reason}")]
    UnusableUrl {
        /// The URL as given.
        url: String,
        /// What is wrong with it.
        reason: &'static str,
    },
    /// A run id, image name or file path cannot be put in a URL faithfully.
    #[error("invalid {what} {value:?}: {reason}")]
    InvalidPath {
        /// What the value is (`file path`, `run id`, `image name`).
        what: &'static str,
        /// The value as given.
        value: String,
        /// Why it is refused.
        reason: &'static str,
    },
    /// The server answered with an error.
    #[error("{message} ({code})")]
    Api {
        /// HTTP status.
        status: u16,
        /// The API's machine code (see [`ErrorCode`]), or `http_<status>`
        /// when the body was not a runbox error body.
        code: String,
        /// The human message, or the raw body text.
        message: String,
    },
    /// The request could not be sent or its response could not be read.
    #[error(transparent)]
    Http(#[from] reqwest::Error),
    /// A response body is not the JSON the contract promises.
    #[error("could not decode the server's response")]
    Decode(#[source] serde_json::Error),
    /// An event of the exec stream does not decode.
    #[error("malformed {event:?} event in the exec stream")]
    MalformedEvent {
        /// The event's name.
        event: String,
        /// Why it does not decode.
        #[source]
        source: BoxError,
    },
    /// The exec stream is not a valid server-sent event stream.
    #[error("malformed exec event stream: {0}")]
    MalformedStream(String),
    /// The exec stream ended before its `exit` event: the connection broke or
    /// the server went away, and the command's fate is unknown.
    #[error("exec stream ended without an exit event")]
    StreamEnded,
    /// A WebSocket session could not be opened, or broke.
    #[error("websocket: {0}")]
    WebSocket(String),
    /// Writing a downloaded file to its destination failed.
    #[error("could not write the downloaded data")]
    Write(#[source] std::io::Error),
}

impl ClientError {
    /// The API error code, when the server answered with a code this client
    /// knows.
    pub fn code(&self) -> Option<ErrorCode> {
        match self {
            ClientError::Api { code, .. } => ErrorCode::parse(code),
            _ => None,
        }
    }

    /// The HTTP status of an API error.
    pub fn status(&self) -> Option<u16> {
        match self {
            ClientError::Api { status, .. } => Some(*status),
            ClientError::Http(err) => err.status().map(|s| s.as_u16()),
            _ => None,
        }
    }

    /// True when the daemon could not be reached at all (nothing listening,
    /// connection refused, connect timeout).
    pub fn is_connect(&self) -> bool {
        matches!(self, ClientError::Http(err) if err.is_connect())
    }
}

/// The most of an error body worth showing; a proxy's HTML page is noise.
const MAX_RAW_MESSAGE: usize = 512;

/// Turns a non-2xx response body into [`ClientError::Api`].
///
/// A runbox error body gives its code and message; anything else (a reverse
/// proxy's page, an empty body) is kept as text under the code `http_<status>`
/// so that the user still sees what came back.
pub(crate) fn api_error(status: u16, reason: Option<&str>, body: &[u8]) -> ClientError {
    if let Ok(ErrorBody { error }) = serde_json::from_slice::<ErrorBody>(body) {
        return ClientError::Api {
            status,
            code: error.code,
            message: error.message,
        };
    }
    let text = String::from_utf8_lossy(body);
    let text = text.trim();
    let message = if text.is_empty() {
        match reason {
            Some(reason) => format!("http status {status} {}", reason.to_lowercase()),
            None => format!("http status {status}"),
        }
    } else if text.len() > MAX_RAW_MESSAGE {
        let mut end = MAX_RAW_MESSAGE;
        while !text.is_char_boundary(end) {
            end -= 1;
        }
        format!("{}...", &text[..end])
    } else {
        text.to_owned()
    };
    ClientError::Api {
        status,
        code: format!("http_{status}"),
        message,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn runbox_error_bodies_give_code_and_message() {
        let body = br#"{"error":{"code":"run_not_found","message":"no run 01H"}}"#;
        let err = api_error(404, Some("Not Found"), body);
        assert_eq!(err.code(), Some(ErrorCode::RunNotFound));
        assert_eq!(err.status(), Some(404));
        assert_eq!(err.to_string(), "no run 01H (run_not_found)");
    }

    #[test]
    fn unknown_codes_are_kept_as_text() {
        let body = br#"{"error":{"code":"brand_new","message":"later"}}"#;
        let err = api_error(400, None, body);
        assert_eq!(err.code(), None);
        assert_eq!(err.to_string(), "later (brand_new)");
    }

    #[test]
    fn other_bodies_fall_back_to_raw_text() {
        let err = api_error(502, Some("Bad Gateway"), b"  upstream is down\n");
        assert_eq!(err.to_string(), "upstream is down (http_502)");
        let err = api_error(502, Some("Bad Gateway"), b"");
        assert_eq!(err.to_string(), "http status 502 bad gateway (http_502)");
    }

    #[test]
    fn long_raw_bodies_are_cut_on_a_char_boundary() {
        let body = "é".repeat(MAX_RAW_MESSAGE);
        let ClientError::Api { message, .. } = api_error(500, None, body.as_bytes()) else {
            panic!("not an api error");
        };
        assert!(message.len() <= MAX_RAW_MESSAGE + 3);
        assert!(message.ends_with("..."));
    }
}
