//! The exec event stream: decoding `POST /v1/runs/{id}/exec`'s server-sent
//! events into [`ExecEvent`]s.
//!
//! The wire format (see `runbox_types::sse`):
//!
//! 1. `started` once, `{"pid":N}`;
//! 2. any number of `stdout` / `stderr`, each the base64 of a raw chunk;
//! 3. `exit` exactly once and last, an `ExitEvent` as JSON.
//!
//! The decoder works on any stream of byte chunks, so it is tested without a
//! server. It stops reading at `exit`, and turns an end of stream before
//! `exit` into [`ClientError::StreamEnded`]: a caller must never mistake a
//! broken connection for a command that finished.

use std::pin::Pin;
use std::task::{Context, Poll};

use base64::Engine as _;
use bytes::Bytes;
use eventsource_stream::{EventStreamError, Eventsource as _};
use futures::{Stream, StreamExt as _};
use runbox_types::{sse, ExitEvent, StartedEvent};

use crate::ClientError;

/// One event of an exec stream.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ExecEvent {
    /// The command started; always the first event.
    Started(StartedEvent),
    /// A chunk of the command's standard output, as raw bytes.
    Stdout(Bytes),
    /// A chunk of the command's standard error, as raw bytes.
    Stderr(Bytes),
    /// A reader attached to a process fell behind; this many output chunks
    /// were skipped for it.
    Lost(u64),
    /// The command ended; always the last event.
    Exit(ExitEvent),
}

/// The events of one exec, in order, ending with [`ExecEvent::Exit`] or an
/// error.
///
/// Dropping the stream closes the connection; what the server then does with
/// the command is the server's policy, not the client's.
pub struct ExecStream {
    inner: Pin<Box<dyn Stream<Item = Result<ExecEvent, ClientError>> + Send>>,
}

impl std::fmt::Debug for ExecStream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ExecStream").finish_non_exhaustive()
    }
}

impl Stream for ExecStream {
    type Item = Result<ExecEvent, ClientError>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        self.inner.as_mut().poll_next(cx)
    }
}

/// Everything an exec produced, gathered in memory by
/// [`ExecStream::collect_output`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ExecOutput {
    /// The pid from the `started` event, if one came.
    pub pid: Option<u32>,
    /// All standard output.
    pub stdout: Vec<u8>,
    /// All standard error.
    pub stderr: Vec<u8>,
    /// How the command ended.
    pub exit: ExitEvent,
}

impl ExecStream {
    /// Wraps a stream of events (the WebSocket session's).
    pub(crate) fn from_stream(
        inner: impl Stream<Item = Result<ExecEvent, ClientError>> + Send + 'static,
    ) -> Self {
        Self {
            inner: Box::pin(inner),
        }
    }

    /// Reads the whole stream into memory. Meant for short commands and
    /// tests; stream the events instead when the output may be large.
    pub async fn collect_output(mut self) -> Result<ExecOutput, ClientError> {
        let mut pid = None;
        let mut stdout = Vec::new();
        let mut stderr = Vec::new();
        while let Some(event) = self.next().await {
            match event? {
                ExecEvent::Started(started) => pid = Some(started.pid),
                ExecEvent::Stdout(chunk) => stdout.extend_from_slice(&chunk),
                ExecEvent::Stderr(chunk) => stderr.extend_from_slice(&chunk),
                ExecEvent::Lost(_) => {}
                ExecEvent::Exit(exit) => {
                    return Ok(ExecOutput {
                        pid,
                        stdout,
                        stderr,
                        exit,
                    })
                }
            }
        }
        // The decoder yields `StreamEnded` before ending without an exit, so
        // this is only reached if that contract is broken.
        Err(ClientError::StreamEnded)
    }
}

/// Decodes an exec response body (a stream of byte chunks, split anywhere)
/// into exec events.
///
/// Events with names this client does not know are skipped, so that a newer
/// server may add some. Nothing is read after `exit`.
pub fn decode_exec_events<S>(body: S) -> ExecStream
where
    S: Stream<Item = Result<Bytes, ClientError>> + Send + 'static,
{
    struct State<E> {
        events: Pin<Box<E>>,
        done: bool,
    }

    let state = State {
        events: Box::pin(body.eventsource()),
        done: false,
    };
    let events = futures::stream::unfold(state, |mut state| async move {
        if state.done {
            return None;
        }
        loop {
            let item = match state.events.next().await {
                None => Err(ClientError::StreamEnded),
                Some(Err(err)) => Err(stream_error(err)),
                Some(Ok(event)) => match decode_event(&event.event, &event.data) {
                    Ok(Some(decoded)) => Ok(decoded),
                    Ok(None) => continue,
                    Err(err) => Err(err),
                },
            };
            // Anything after an exit or an error is not trusted: stop there.
            state.done = !matches!(
                item,
                Ok(ExecEvent::Started(_)
                    | ExecEvent::Stdout(_)
                    | ExecEvent::Stderr(_)
                    | ExecEvent::Lost(_))
            );
            return Some((item, state));
        }
    });
    ExecStream {
        inner: Box::pin(events),
    }
}

/// Decodes one server-sent event; `Ok(None)` for an event name this client
/// does not know.
pub fn decode_event(name: &str, data: &str) -> Result<Option<ExecEvent>, ClientError> {
    let malformed =
        |source: Box<dyn std::error::Error + Send + Sync>| ClientError::MalformedEvent {
            event: name.to_owned(),
            source,
        };
    let event = match name {
        sse::STARTED => {
            ExecEvent::Started(serde_json::from_str(data).map_err(|e| malformed(e.into()))?)
        }
        sse::STDOUT => ExecEvent::Stdout(decode_chunk(data).map_err(|e| malformed(e.into()))?),
        sse::STDERR => ExecEvent::Stderr(decode_chunk(data).map_err(|e| malformed(e.into()))?),
        sse::EXIT => ExecEvent::Exit(serde_json::from_str(data).map_err(|e| malformed(e.into()))?),
        sse::LOST => {
            let lost: runbox_types::LostEvent =
                serde_json::from_str(data).map_err(|e| malformed(e.into()))?;
            ExecEvent::Lost(lost.chunks)
        }
        _ => return Ok(None),
    };
    Ok(Some(event))
}

fn decode_chunk(data: &str) -> Result<Bytes, base64::DecodeError> {
    let engine = &base64::engine::general_purpose::STANDARD;
    // A server may fold a long payload over several `data:` lines, which the
    // SSE parser joins with newlines; base64 itself never contains them.
    if data.contains('\n') {
        let joined: String = data.split('\n').collect();
        return engine.decode(joined).map(Bytes::from);
    }
    engine.decode(data).map(Bytes::from)
}

fn stream_error(err: EventStreamError<ClientError>) -> ClientError {
    match err {
        EventStreamError::Transport(err) => err,
        EventStreamError::Utf8(err) => ClientError::MalformedStream(err.to_string()),
        EventStreamError::Parser(err) => ClientError::MalformedStream(err.to_string()),
    }
}

#[cfg(test)]
mod tests {
    use runbox_types::ExitReason;

    use super::*;

    /// Feeds `text` to the decoder in chunks of `size` bytes, so that events,
    /// lines and base64 are split at every possible place.
    fn decode_in_chunks(text: &str, size: usize) -> Vec<Result<ExecEvent, ClientError>> {
        let chunks: Vec<Result<Bytes, ClientError>> = text
            .as_bytes()
            .chunks(size)
            .map(|chunk| Ok(Bytes::copy_from_slice(chunk)))
            .collect();
        futures::executor::block_on(decode_exec_events(futures::stream::iter(chunks)).collect())
    }

    const GOOD: &str = "event: started\ndata: {\"pid\":42}\n\n\
        : keep-alive comment\n\n\
        event: stdout\ndata: aGVsbG8K\n\n\
        event: progress\ndata: {\"percent\":50}\n\n\
        event: stderr\ndata: /wA=\n\n\
        event: exit\ndata: {\"exitCode\":3,\"timedOut\":false,\"reason\":\"exited\"}\n\n";

    fn expected_good() -> Vec<ExecEvent> {
        vec![
            ExecEvent::Started(StartedEvent { pid: 42 }),
            ExecEvent::Stdout(Bytes::from_static(b"hello\n")),
            ExecEvent::Stderr(Bytes::from_static(&[0xff, 0x00])),
            ExecEvent::Exit(ExitEvent {
                point: None,
                exit_code: 3,
                timed_out: false,
                signal: None,
                reason: ExitReason::Exited,
            }),
        ]
    }

    #[test]
    fn a_whole_stream_decodes_however_it_is_split() {
        for size in [1, 2, 3, 7, 64, GOOD.len()] {
            let events: Vec<ExecEvent> = decode_in_chunks(GOOD, size)
                .into_iter()
                .map(|event| event.unwrap())
                .collect();
            assert_eq!(events, expected_good(), "chunk size {size}");
        }
    }

    #[test]
    fn nothing_is_read_after_exit() {
        let text = format!("{GOOD}event: stdout\ndata: aGVsbG8K\n\n");
        let events = decode_in_chunks(&text, 5);
        assert_eq!(events.len(), 4);
        assert!(matches!(events[3], Ok(ExecEvent::Exit(_))));
    }

    #[test]
    fn a_stream_without_exit_is_an_error() {
        let text = "event: started\ndata: {\"pid\":1}\n\nevent: stdout\ndata: aGk=\n\n";
        let events = decode_in_chunks(text, 4);
        assert_eq!(events.len(), 3);
        assert!(matches!(events[2], Err(ClientError::StreamEnded)));
    }

    #[test]
    fn a_transport_error_ends_the_stream() {
        let chunks = vec![
            Ok(Bytes::from_static(b"event: started\ndata: {\"pid\":1}\n\n")),
            Err(ClientError::MalformedStream("boom".into())),
            Ok(Bytes::from_static(b"event: stdout\ndata: aGk=\n\n")),
        ];
        let events: Vec<_> = futures::executor::block_on(
            decode_exec_events(futures::stream::iter(chunks)).collect(),
        );
        assert_eq!(events.len(), 2);
        assert!(matches!(&events[1], Err(ClientError::MalformedStream(m)) if m == "boom"));
    }

    #[test]
    fn bad_payloads_are_reported_with_their_event() {
        let err = decode_event("stdout", "not base64!").unwrap_err();
        assert_eq!(
            err.to_string(),
            "malformed \"stdout\" event in the exec stream"
        );
        assert!(decode_event("exit", "{\"exitCode\":\"x\"}").is_err());
        assert!(decode_event("started", "").is_err());
    }

    #[test]
    fn folded_base64_and_empty_chunks_decode() {
        assert_eq!(
            decode_event("stdout", "aGVs\nbG8K").unwrap(),
            Some(ExecEvent::Stdout(Bytes::from_static(b"hello\n")))
        );
        assert_eq!(
            decode_event("stderr", "").unwrap(),
            Some(ExecEvent::Stderr(Bytes::new()))
        );
        assert_eq!(decode_event("message", "x").unwrap(), None);
    }

    #[test]
    fn collect_output_gathers_everything() {
        let chunks = vec![Ok(Bytes::from_static(GOOD.as_bytes()))];
        let output = futures::executor::block_on(
            decode_exec_events(futures::stream::iter(chunks)).collect_output(),
        )
        .unwrap();
        assert_eq!(output.pid, Some(42));
        assert_eq!(output.stdout, b"hello\n");
        assert_eq!(output.stderr, [0xff, 0x00]);
        assert_eq!(output.exit.exit_code, 3);
    }
}
