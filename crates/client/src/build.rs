//! The build event stream (`GET /v1/builds/{id}/events`).

use std::pin::Pin;

use bytes::Bytes;
use futures::Stream;
use runbox_types::{build_sse, Build, BuildLog, BuildStep};

use crate::ClientError;

/// One item of a build's event stream.
#[derive(Clone, Debug, PartialEq)]
pub enum BuildUpdate {
    /// A step's status changed.
    Step(BuildStep),
    /// A line of output.
    Log(BuildLog),
    /// The build ended (ready, failed or cancelled); always the last item.
    Done(Box<Build>),
}

/// The items of one build's events.
pub type BuildStream = Pin<Box<dyn Stream<Item = Result<BuildUpdate, ClientError>> + Send>>;

/// Decodes an events response body into [`BuildUpdate`]s. Unknown event
/// names are skipped; nothing is read after `done`.
pub fn decode_build_events<S>(body: S) -> BuildStream
where
    S: Stream<Item = Result<Bytes, ClientError>> + Send + 'static,
{
    crate::sse::decode(
        body,
        |event| match event.name() {
            build_sse::STEP => Some(event.json().map(BuildUpdate::Step)),
            build_sse::LOG => Some(event.json().map(BuildUpdate::Log)),
            build_sse::DONE => Some(event.json().map(|b| BuildUpdate::Done(Box::new(b)))),
            _ => None,
        },
        |item| !matches!(item, Ok(BuildUpdate::Step(_) | BuildUpdate::Log(_))),
    )
}

#[cfg(test)]
mod tests {
    use futures::StreamExt as _;

    use super::*;

    #[tokio::test]
    async fn decodes_steps_logs_then_done() {
        let body = concat!(
            "event: step\ndata: {\"index\":1,\"line\":2,\"text\":\"RUN true\",\"status\":\"running\"}\n\n",
            "event: log\ndata: {\"offset\":0,\"step\":1,\"stream\":\"stdout\",\"text\":\"hi\",\"time\":\"2026-01-01T00:00:00Z\"}\n\n",
            "event: unknown\ndata: {}\n\n",
            "event: done\ndata: {\"id\":\"01HZZZZZZZZZZZZZZZZZZZZZZZ\",\"name\":\"x\",\"status\":\"ready\",\"from\":\"base\",\"steps\":[],\"createdAt\":\"2026-01-01T00:00:00Z\",\"server\":\"n\"}\n\n",
            "event: log\ndata: {}\n\n",
        );
        let stream = futures::stream::iter(vec![Ok(Bytes::from(body))]);
        let items: Vec<_> = decode_build_events(stream).collect().await;
        assert_eq!(items.len(), 3, "{items:?}");
        assert!(matches!(&items[0], Ok(BuildUpdate::Step(s)) if s.index == 1));
        assert!(matches!(&items[1], Ok(BuildUpdate::Log(l)) if l.text == "hi"));
        assert!(matches!(&items[2], Ok(BuildUpdate::Done(b)) if b.name == "x"));
    }

    #[tokio::test]
    async fn a_stream_cut_before_done_is_an_error() {
        let body =
            "event: log\ndata: {\"offset\":0,\"step\":0,\"stream\":\"build\",\"text\":\"x\",\"time\":\"2026-01-01T00:00:00Z\"}\n\n";
        let stream = futures::stream::iter(vec![Ok(Bytes::from(body))]);
        let items: Vec<_> = decode_build_events(stream).collect().await;
        assert!(matches!(items.last(), Some(Err(ClientError::StreamEnded))));
    }
}
