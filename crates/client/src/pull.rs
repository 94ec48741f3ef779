//! The pull event stream (`POST /v1/images/pull`).

use std::pin::Pin;

use bytes::Bytes;
use futures::Stream;
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
    crate::sse::decode(
        body,
        |event| match event.name() {
            pull_sse::PROGRESS => Some(event.json().map(PullUpdate::Progress)),
            pull_sse::DONE => Some(event.json().map(PullUpdate::Done)),
            pull_sse::ERROR => Some(event.json::<ErrorDetail>().and_then(|detail| {
                Err(ClientError::Api {
                    status: runbox_types::ErrorCode::parse(&detail.code).map_or(0, |c| c.status()),
                    code: detail.code,
                    message: detail.message,
                })
            })),
            _ => None,
        },
        |item| !matches!(item, Ok(PullUpdate::Progress(_))),
    )
}

#[cfg(test)]
mod tests {
    use futures::StreamExt as _;

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
