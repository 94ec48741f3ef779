//! envd's messages in the protobuf JSON mapping the SDKs speak: camelCase
//! names (the proto names are accepted too), `oneof` members as fields of
//! their message, `bytes` as base64, 64-bit integers as strings, enums by
//! name. Unknown fields are ignored, as protobuf JSON parsers may.

use std::collections::BTreeMap;

use base64::Engine;
use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// `bytes` fields: base64 (standard or URL-safe, padded or not).
pub mod b64 {
    use super::*;

    pub fn serialize<S: Serializer>(bytes: &[u8], s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&base64::engine::general_purpose::STANDARD.encode(bytes))
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<u8>, D::Error> {
        let text = String::deserialize(d)?;
        let trimmed = text.trim_end_matches('=');
        base64::engine::general_purpose::STANDARD_NO_PAD
            .decode(trimmed)
            .or_else(|_| base64::engine::general_purpose::URL_SAFE_NO_PAD.decode(trimmed))
            .map_err(|_| serde::de::Error::custom("a bytes field is not base64"))
    }
}

/// A 32-bit unsigned field, given as a number or a string.
fn u32_lenient<'de, D: Deserializer<'de>>(d: D) -> Result<u32, D::Error> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum N {
        Num(u32),
        Text(String),
    }
    match N::deserialize(d)? {
        N::Num(n) => Ok(n),
        N::Text(t) => t
            .parse()
            .map_err(|_| serde::de::Error::custom("expected an unsigned 32-bit number")),
    }
}

fn opt_u32_lenient<'de, D: Deserializer<'de>>(d: D) -> Result<Option<u32>, D::Error> {
    u32_lenient(d).map(Some)
}

/// `process.ProcessSelector`.
#[derive(Clone, Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
pub enum Selector {
    Pid(#[serde(deserialize_with = "u32_lenient")] u32),
    Tag(String),
}

impl Selector {
    /// How runbox names the process (a pid, or a tag, which is never all
    /// digits).
    pub fn reference(&self) -> String {
        match self {
            Selector::Pid(pid) => pid.to_string(),
            Selector::Tag(tag) => tag.clone(),
        }
    }
}

/// `process.ProcessConfig`.
#[derive(Clone, Debug, Default, Deserialize, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct ProcessConfig {
    #[serde(default)]
    pub cmd: String,
    #[serde(default)]
    pub args: Vec<String>,
    #[serde(default)]
    pub envs: BTreeMap<String, String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cwd: Option<String>,
}

#[derive(Clone, Copy, Debug, Deserialize)]
pub struct PtySize {
    #[serde(default, deserialize_with = "u32_lenient")]
    pub cols: u32,
    #[serde(default, deserialize_with = "u32_lenient")]
    pub rows: u32,
}

#[derive(Clone, Debug, Deserialize)]
pub struct Pty {
    pub size: Option<PtySize>,
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct StartRequest {
    pub process: Option<ProcessConfig>,
    pub pty: Option<Pty>,
    pub tag: Option<String>,
    pub stdin: Option<bool>,
}

#[derive(Debug, Deserialize)]
pub struct ConnectRequest {
    pub process: Option<Selector>,
}

#[derive(Debug, Deserialize)]
pub struct UpdateRequest {
    pub process: Option<Selector>,
    pub pty: Option<Pty>,
}

/// `process.ProcessInput`.
#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
pub enum Input {
    Stdin(#[serde(with = "b64")] Vec<u8>),
    Pty(#[serde(with = "b64")] Vec<u8>),
}

impl Input {
    pub fn into_bytes(self) -> Vec<u8> {
        match self {
            Input::Stdin(b) | Input::Pty(b) => b,
        }
    }
}

#[derive(Debug, Deserialize)]
pub struct SendInputRequest {
    pub process: Option<Selector>,
    pub input: Option<Input>,
}

#[derive(Debug, Deserialize)]
pub struct StreamInputStart {
    pub process: Option<Selector>,
}

#[derive(Debug, Deserialize)]
pub struct StreamInputData {
    pub input: Option<Input>,
}

/// `process.StreamInputRequest`: its `event` oneof.
#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
pub enum StreamInputRequest {
    Start(StreamInputStart),
    Data(StreamInputData),
    Keepalive(serde::de::IgnoredAny),
}

/// `process.Signal`, by name or number.
#[derive(Debug)]
pub struct Signal(pub i32);

impl<'de> Deserialize<'de> for Signal {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum S {
            Num(i32),
            Name(String),
        }
        match S::deserialize(d)? {
            S::Num(n) => Ok(Signal(n)),
            S::Name(name) => match name.as_str() {
                "SIGNAL_SIGKILL" => Ok(Signal(9)),
                "SIGNAL_SIGTERM" => Ok(Signal(15)),
                other => Err(serde::de::Error::custom(format!(
                    "signal {other:?} is not SIGNAL_SIGKILL or SIGNAL_SIGTERM"
                ))),
            },
        }
    }
}

#[derive(Debug, Deserialize)]
pub struct SendSignalRequest {
    pub process: Option<Selector>,
    pub signal: Option<Signal>,
}

#[derive(Debug, Deserialize)]
pub struct CloseStdinRequest {
    pub process: Option<Selector>,
}

/// `process.ProcessEvent`: its `event` oneof.
#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub enum ProcessEvent {
    Start { pid: u32 },
    Data(DataEvent),
    End(EndEvent),
    Keepalive {},
}

#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub enum DataEvent {
    Stdout(#[serde(with = "b64")] Vec<u8>),
    Stderr(#[serde(with = "b64")] Vec<u8>),
    Pty(#[serde(with = "b64")] Vec<u8>),
}

#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct EndEvent {
    pub exit_code: i32,
    pub exited: bool,
    pub status: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

/// `StartResponse` and `ConnectResponse` alike.
#[derive(Debug, Serialize)]
pub struct EventResponse {
    pub event: ProcessEvent,
}

#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct ProcessInfo {
    pub config: ProcessConfig,
    pub pid: u32,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tag: Option<String>,
}

#[derive(Debug, Serialize)]
pub struct ListResponse {
    pub processes: Vec<ProcessInfo>,
}

/// An empty message.
#[derive(Debug, Default, Serialize, Deserialize)]
pub struct Empty {}

// --- filesystem ---

#[derive(Debug, Deserialize)]
pub struct PathRequest {
    #[serde(default)]
    pub path: String,
}

#[derive(Debug, Deserialize)]
pub struct ListDirRequest {
    #[serde(default)]
    pub path: String,
    #[serde(default, deserialize_with = "opt_u32_lenient")]
    pub depth: Option<u32>,
}

#[derive(Debug, Deserialize)]
pub struct MoveRequest {
    #[serde(default)]
    pub source: String,
    #[serde(default)]
    pub destination: String,
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct WatchRequest {
    #[serde(default)]
    pub path: String,
    #[serde(default)]
    pub recursive: bool,
    #[serde(default, alias = "include_entry")]
    pub include_entry: bool,
    // envd 0.6.4's `allowNetworkMounts` (watch a directory on a network
    // mount) is taken and needs nothing: a run's mounts are all local.
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct WatcherRequest {
    #[serde(default, alias = "watcher_id")]
    pub watcher_id: String,
}

/// `filesystem.EntryInfo`.
#[derive(Clone, Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct EntryInfo {
    pub name: String,
    #[serde(rename = "type")]
    pub kind: &'static str,
    pub path: String,
    /// int64: a string in protobuf JSON.
    pub size: String,
    pub mode: u32,
    pub permissions: String,
    pub owner: String,
    pub group: String,
    pub modified_time: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub symlink_target: Option<String>,
    pub is_symlink: bool,
    /// envd 0.6.2: the file's metadata (`user.e2b.` extended attributes).
    #[serde(skip_serializing_if = "std::collections::BTreeMap::is_empty")]
    pub metadata: std::collections::BTreeMap<String, String>,
}

#[derive(Debug, Serialize)]
pub struct EntryResponse {
    pub entry: EntryInfo,
}

#[derive(Debug, Serialize)]
pub struct ListDirResponse {
    pub entries: Vec<EntryInfo>,
}

#[derive(Clone, Debug, Serialize)]
pub struct FilesystemEvent {
    pub name: String,
    #[serde(rename = "type")]
    pub kind: &'static str,
    /// envd 0.6.3: what the path is after the event, when the watch asked
    /// for entries and the path is still there.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub entry: Option<Box<EntryInfo>>,
}

/// `filesystem.WatchDirResponse`: its `event` oneof.
#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub enum WatchEvent {
    Start {},
    Filesystem(FilesystemEvent),
    Keepalive {},
}

#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct CreateWatcherResponse {
    pub watcher_id: String,
}

#[derive(Debug, Serialize)]
pub struct WatcherEvents {
    pub events: Vec<FilesystemEvent>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn messages_decode_as_the_sdks_encode_them() {
        let start: StartRequest = serde_json::from_str(
            r#"{"process":{"cmd":"/bin/bash","args":["-l","-c","echo hi"],"envs":{"A":"1"}},"stdin":false,"pty":{"size":{"cols":80,"rows":"24"}}}"#,
        )
        .unwrap();
        assert_eq!(start.process.unwrap().args[2], "echo hi");
        assert_eq!(start.pty.unwrap().size.unwrap().rows, 24);
        let input: SendInputRequest =
            serde_json::from_str(r#"{"process":{"pid":"7"},"input":{"stdin":"aGk="}}"#).unwrap();
        assert_eq!(input.process.unwrap().reference(), "7");
        assert_eq!(input.input.unwrap().into_bytes(), b"hi");
        let sig: SendSignalRequest =
            serde_json::from_str(r#"{"process":{"tag":"web"},"signal":"SIGNAL_SIGKILL"}"#).unwrap();
        assert_eq!(sig.signal.unwrap().0, 9);
        assert!(
            serde_json::from_str::<SendSignalRequest>(r#"{"signal":"SIGNAL_SIGSTOP"}"#).is_err()
        );
        assert!(serde_json::from_str::<SendInputRequest>(r#"{"input":{"stdin":"%%"}}"#).is_err());
        let ev: StreamInputRequest = serde_json::from_str(r#"{"keepalive":{}}"#).unwrap();
        assert!(matches!(ev, StreamInputRequest::Keepalive(_)));
    }

    #[test]
    fn events_encode_as_protobuf_json() {
        let ev = EventResponse {
            event: ProcessEvent::Data(DataEvent::Stdout(b"hi\n".to_vec())),
        };
        assert_eq!(
            serde_json::to_string(&ev).unwrap(),
            r#"{"event":{"data":{"stdout":"aGkK"}}}"#
        );
        let ev = EventResponse {
            event: ProcessEvent::Start { pid: 3 },
        };
        assert_eq!(
            serde_json::to_string(&ev).unwrap(),
            r#"{"event":{"start":{"pid":3}}}"#
        );
        let w = WatchEvent::Start {};
        assert_eq!(serde_json::to_string(&w).unwrap(), r#"{"start":{}}"#);
    }
}
