//! The daemon-to-agent protocol: generated gRPC types (`pb`) and a client
//! constructor with the limits the daemon applies to every agent.
//!
//! Everything an agent says is untrusted: it runs inside the sandbox, where
//! the workload can replace or impersonate it. The client therefore caps the
//! size of every decoded message and bounds connection set-up; callers bound
//! the total time and bytes of each call.
//!
//! This crate does not own sockets or lifecycles: the isolation lane decides
//! where the agent listens, and `runbox-core` decides when to call it.

use std::path::PathBuf;
use std::time::Duration;

use hyper_util::rt::TokioIo;
use tokio::net::UnixStream;
use tonic::transport::{Channel, Endpoint};

/// Generated protobuf messages and the gRPC client and server for the agent.
#[allow(missing_docs, clippy::all)]
pub mod pb {
    tonic::include_proto!("runbox.agent.v1");
}

/// The protocol revision this build speaks; see `proto/agent.proto`.
pub const PROTOCOL: u32 = 8;

/// The oldest revision the daemon works with: runs started by an older
/// build keep working after an upgrade, and the RPCs added since answer
/// `unimplemented` there.
pub const MIN_PROTOCOL: u32 = 1;

/// The name prefix of the temporary file a WriteFile fills beside its
/// target before renaming it into place.
pub const UPLOAD_TEMP_PREFIX: &str = ".runbox-upload-";

/// Largest message either side accepts. Data chunks are far smaller
/// ([`CHUNK_SIZE`]); this only bounds what a hostile peer can make us buffer.
pub const MAX_MESSAGE_BYTES: usize = 1 << 20;

/// Size of the data chunks both sides send for output and file contents.
pub const CHUNK_SIZE: usize = 64 * 1024;

/// How long connection set-up to an agent socket may take.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

/// A client for one agent.
pub type AgentClient = pb::agent_client::AgentClient<Channel>;

/// Builds a client that connects lazily to the agent socket at `socket`, and
/// reconnects on its own after a broken connection.
///
/// The path is the host-side socket the daemon created; it is never a path the
/// sandbox can write to, so no symlink tricks apply to it.
pub fn connect_unix(socket: PathBuf) -> AgentClient {
    // The URI is required by the HTTP/2 layer but never resolved: the
    // connector below ignores it and dials the Unix socket.
    let endpoint = Endpoint::from_static("http://runbox-agent.invalid")
        .connect_timeout(CONNECT_TIMEOUT)
        .http2_keep_alive_interval(Duration::from_secs(30))
        .keep_alive_timeout(Duration::from_secs(20));
    let channel = endpoint.connect_with_connector_lazy(tower::service_fn(move |_| {
        let socket = socket.clone();
        async move { Ok::<_, std::io::Error>(TokioIo::new(UnixStream::connect(socket).await?)) }
    }));
    pb::agent_client::AgentClient::new(channel)
        .max_decoding_message_size(MAX_MESSAGE_BYTES)
        .max_encoding_message_size(MAX_MESSAGE_BYTES)
}
