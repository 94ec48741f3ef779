//! A server-sent event stream decoded into typed items, shared by the
//! pull and build streams.

use std::pin::Pin;

use bytes::Bytes;
use eventsource_stream::Eventsource as _;
use futures::{Stream, StreamExt as _};

use crate::ClientError;

/// A boxed stream of decoded items.
pub(crate) type Items<T> = Pin<Box<dyn Stream<Item = Result<T, ClientError>> + Send>>;

/// Decodes `body` event by event with `decode` (None skips an event it
/// does not know). The
/// stream ends after the first item `last` says is the last one; a body
/// that ends before it is [`ClientError::StreamEnded`].
pub(crate) fn decode<T, S>(
    body: S,
    decode: fn(&Event) -> Option<Result<T, ClientError>>,
    last: fn(&Result<T, ClientError>) -> bool,
) -> Items<T>
where
    T: Send + 'static,
    S: Stream<Item = Result<Bytes, ClientError>> + Send + 'static,
{
    let events = Box::pin(body.eventsource());
    Box::pin(futures::stream::unfold(
        (events, false),
        move |(mut events, done)| async move {
            if done {
                return None;
            }
            loop {
                let item = match events.next().await {
                    None => Err(ClientError::StreamEnded),
                    Some(Err(e)) => Err(ClientError::MalformedStream(e.to_string())),
                    Some(Ok(event)) => match decode(&Event(event)) {
                        Some(item) => item,
                        None => continue,
                    },
                };
                let done = last(&item);
                return Some((item, (events, done)));
            }
        },
    ))
}

/// One event.
pub(crate) struct Event(eventsource_stream::Event);

impl Event {
    /// The event's name.
    pub(crate) fn name(&self) -> &str {
        &self.0.event
    }

    /// The data as a `T`, or [`ClientError::MalformedEvent`].
    pub(crate) fn json<T: serde::de::DeserializeOwned>(&self) -> Result<T, ClientError> {
        serde_json::from_str(&self.0.data).map_err(|e| ClientError::MalformedEvent {
            event: self.0.event.clone(),
            source: e.into(),
        })
    }
}
