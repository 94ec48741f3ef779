//! The pull event stream (`POST /v1/images/pull`).

use std::pin::Pin;

use bytes::Bytes;
use eventsource_stream::Eventsource as _;
use futures::{Stream, StreamExt as _};
use runbox_types::{pull_sse, ErrorDetail, Image, PullEvent};

use crate::ClientError;

/// One item of a pull stream.
#[derive(Clone, Debug, PartialEq)]
pub enum PullUpdate {
    /// Progress of the pull.
    Progress(PullEvent),
    /// The pull finished; always the last item on success.
    Done(Image),
}

/// The items of one pull; a failed pull ends with an error item.
pub type PullStream = Pin<Box<dyn Stream<Item = Result<PullUpdate, ClientError>> + Send>>;

/// Decodes a pull response body into [`PullUpdate`]s. Unknown event names
/// are skipped; nothing is read after `done` or `error`.
pub fn decode_pull_events<S>(body: S) -> PullStream
where
    S: Stream<Item = Result<Bytes, ClientError>> + Send + 'static,
{
    let events = Box::pin(body.eventsource());
    Box::pin(futures::stream::unfold(
        (events, false),
        |(mut events, done)| async move {
            if done {
                return None;
            }
            loop {
                let item = match events.next().await {
                    None => Err(ClientError::StreamEnded),
                    Some(Err(e)) => Err(ClientError::MalformedStream(e.to_string())),
                    Some(Ok(event)) => {
                        let malformed = |e: serde_json::Error| ClientError::MalformedEvent {
                            event: event.event.clone(),
                            source: e.into(),
                        };
                        match event.event.as_str() {
                            pull_sse::PROGRESS => serde_json::from_str(&event.data)
                                .map(PullUpdate::Progress)
                                .map_err(malformed),
                            pull_sse::DONE => serde_json::from_str(&event.data)
                                .map(PullUpdate::Done)
                                .map_err(malformed),
                            pull_sse::ERROR => {
                                match serde_json::from_str::<ErrorDetail>(&event.data) {
                                    Ok(detail) => Err(ClientError::Api {
                                        status: runbox_types::ErrorCode::parse(&detail.code)
                                            .map_or(0, |c| c.status()),
                                        code: detail.code,
                                        message: detail.message,
                                    }),
                                    Err(e) => Err(malformed(e)),
                                }
                            }
                            _ => continue,
                        }
                    }
                };
                let done = !matches!(item, Ok(PullUpdate::Progress(_)));
                return Some((item, (events, done)));
            }
        },
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn decodes_progress_then_done_or_error() {
        let body = "event: progress\ndata: {\"kind\":\"layerSkipped\",\"digest\":\"sha256:ab\"}\n\n\
                    event: error\ndata: {\"code\":\"remote_not_found\",\"message\":\"no such tag\"}\n\n\
                    event: progress\ndata: ignored\n\n";
        let stream =
            decode_pull_events(futures::stream::once(async move { Ok(Bytes::from(body)) }));
        let items: Vec<_> = stream.collect().await;
        assert_eq!(items.len(), 2);
        assert!(matches!(
            &items[0],
            Ok(PullUpdate::Progress(PullEvent::LayerSkipped { .. }))
        ));
        match &items[1] {
            Err(ClientError::Api { code, .. }) => assert_eq!(code, "remote_not_found"),
            other => panic!("{other:?}"),
        }
    }
}
