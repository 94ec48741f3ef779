//! Stat, list, mkdir, move and remove in a run's `/work`, through its
//! agent (which confines them: see the agent's `fsops`). Reads are not
//! fenced by the lease; the three writes are, like file uploads.
//!
//! What the agent answers is untrusted: paths and symlink targets are
//! bounded, and a listing is cut at the documented maximum.

use std::collections::{BTreeMap, HashMap};
use std::time::Duration;

use runbox_agent_proto::pb;
use runbox_types::{
    FileInfo, FileKind, FileList, MakeDirRequest, MoveRequest, RemoveReply, RemoveRequest,
};
use time::OffsetDateTime;
use ulid::Ulid;

use super::actor::Access;
use super::relay::{bounded, file_error, Admission, AgentFeature};
use super::Manager;
use crate::error::CoreError;
use crate::validate;

/// How long one stat, list, mkdir or move may take.
const FS_CALL_TIMEOUT: Duration = Duration::from_secs(30);

/// How long a (recursive) remove may take.
const REMOVE_TIMEOUT: Duration = Duration::from_secs(300);

/// The most entries a listing returns.
pub const MAX_LIST_ENTRIES: u32 = 10_000;

/// The deepest a listing goes.
pub const MAX_LIST_DEPTH: u32 = 16;

/// The longest path or symlink target taken from an agent.
const MAX_AGENT_PATH: usize = 4096;

/// Where a file operation's paths are.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Scope {
    /// Relative to the run's `/work`: the runbox API.
    #[default]
    Work,
    /// Absolute in the run's root filesystem, resolved as the run's commands
    /// see it: the E2B-compatible surface. Needs an agent of protocol 4.
    Root,
}

/// How a file is written, beyond its path and body.
#[derive(Clone, Debug, Default)]
pub struct WriteOptions {
    /// Who owns the file and the directories the write makes; None: the
    /// run's own user.
    pub user: Option<String>,
    /// The lease credential (owner, generation), when the run is leased.
    pub credential: Option<(String, u64)>,
    /// The body's declared length, checked against the upload limit
    /// before a byte is read.
    pub content_length: Option<u64>,
    /// Metadata stored with the file, by key (see
    /// [`Scope::metadata_xattrs`]); the file's old metadata goes with an
    /// overwrite.
    pub metadata: BTreeMap<String, String>,
}

/// The extended attribute namespace of file metadata in [`Scope::Root`]:
/// E2B's, so metadata set from inside a sandbox (`setfattr -n
/// user.e2b.author`) shows too.
const METADATA_XATTR_PREFIX: &str = "user.e2b.";

/// The most metadata keys on one file.
pub const MAX_METADATA: usize = 64;

/// Who owns what a file call makes: the user the call names, else the
/// image's `User` (the identity commands run as); empty is root.
pub(super) fn owner(record: &crate::store::RunRecord, user: Option<String>) -> String {
    user.unwrap_or_else(|| record.image_config.user.clone().unwrap_or_default())
}

impl Scope {
    /// The extended attribute prefix file metadata is kept under; empty
    /// where the scope keeps none.
    pub(super) fn metadata_prefix(self) -> &'static str {
        match self {
            Scope::Work => "",
            Scope::Root => METADATA_XATTR_PREFIX,
        }
    }

    /// Metadata to store with a written file, checked, as the agent's
    /// extended attributes. Keys are lowercased (HTTP header names, which
    /// is how E2B's SDKs send them, are case-insensitive), and must be
    /// HTTP token characters; values printable ASCII, at most 1024 bytes.
    /// Only [`Scope::Root`] keeps metadata.
    pub(super) fn metadata_xattrs(
        self,
        metadata: BTreeMap<String, String>,
    ) -> Result<HashMap<String, String>, CoreError> {
        if metadata.is_empty() {
            return Ok(HashMap::new());
        }
        let bad =
            |message: String| CoreError::invalid(runbox_types::ErrorCode::BadRequest, message);
        if self == Scope::Work {
            return Err(bad("files under /work keep no metadata".into()));
        }
        if metadata.len() > MAX_METADATA {
            return Err(bad(format!(
                "a file takes at most {MAX_METADATA} metadata keys"
            )));
        }
        let token = |c: char| c.is_ascii_alphanumeric() || "!#$%&'*+-.^_`|~".contains(c);
        let mut out = HashMap::with_capacity(metadata.len());
        for (key, value) in metadata {
            if key.is_empty() || key.len() > 200 || !key.chars().all(token) {
                return Err(bad(format!(
                    "metadata key {:?} must be 1-200 HTTP token characters (letters, digits, !#$%&'*+-.^_`|~)",
                    key.chars().take(40).collect::<String>()
                )));
            }
            if value.len() > 1024 || !value.chars().all(|c| c == ' ' || c.is_ascii_graphic()) {
                return Err(bad(format!(
                    "the value of metadata key {key:?} must be printable ASCII, at most 1024 bytes"
                )));
            }
            out.insert(
                format!("{}{}", self.metadata_prefix(), key.to_ascii_lowercase()),
                value,
            );
        }
        Ok(out)
    }

    /// `path` checked and normalised as the agent takes it; with `base_ok`,
    /// None (or a path that reduces to nothing) names the base itself.
    pub(super) fn agent_path(self, path: Option<&str>, base_ok: bool) -> Result<String, CoreError> {
        match (self, path) {
            (Scope::Work, None) if base_ok => Ok(String::new()),
            (Scope::Root, None) if base_ok => Ok("/".to_owned()),
            (Scope::Work, Some(p))
                if base_ok
                    && p.split('/').all(|c| c.is_empty() || c == ".")
                    && !p.contains('\0') =>
            {
                Ok(String::new())
            }
            (Scope::Work, Some(p)) => validate::work_path(p),
            (Scope::Root, Some(p)) => validate::root_path(p, base_ok),
            (_, None) => Err(CoreError::invalid(
                runbox_types::ErrorCode::BadPath,
                "file path is missing",
            )),
        }
    }

    /// A path given to the agent, absolute as the run sees it (what a
    /// history point names).
    pub(super) fn absolute(self, agent_path: &str) -> String {
        match self {
            Scope::Work => format!("/work/{agent_path}"),
            Scope::Root => format!("/{}", agent_path.trim_start_matches('/')),
        }
    }

    /// A path the agent answered (relative to the base) as the API shows it.
    pub(super) fn shown(self, rel: String) -> String {
        match self {
            Scope::Work => rel,
            Scope::Root => format!("/{rel}"),
        }
    }

    /// Whether the agent call carries `root`.
    pub(super) fn root(self) -> bool {
        self == Scope::Root
    }
}

impl Scope {
    /// Refuses [`Scope::Root`] on a run whose agent (speaking `protocol`)
    /// predates it.
    pub(super) fn check(self, protocol: u32) -> Result<(), CoreError> {
        match self {
            Scope::Root => AgentFeature::RootScope.check(protocol),
            Scope::Work => Ok(()),
        }
    }
}

/// Refuses metadata on a run whose agent (speaking `protocol`) would drop
/// it unseen.
pub(super) fn check_metadata(
    protocol: u32,
    xattrs: &HashMap<String, String>,
) -> Result<(), CoreError> {
    if xattrs.is_empty() {
        return Ok(());
    }
    AgentFeature::Metadata.check(protocol)
}

/// An agent's description, checked, with its path as `scope` shows it.
pub(super) fn info(scope: Scope, raw: pb::FileInfo) -> Result<FileInfo, CoreError> {
    if raw.path.len() > MAX_AGENT_PATH || raw.symlink_target.len() > MAX_AGENT_PATH {
        return Err(CoreError::Agent(
            "the agent sent a path longer than 4096 bytes".into(),
        ));
    }
    let kind = match pb::FileKind::try_from(raw.kind) {
        Ok(pb::FileKind::Regular) => FileKind::File,
        Ok(pb::FileKind::Directory) => FileKind::Directory,
        Ok(pb::FileKind::Symlink) => FileKind::Symlink,
        _ => FileKind::Other,
    };
    let modified_at =
        OffsetDateTime::from_unix_timestamp_nanos(i128::from(raw.modified_unix_ms) * 1_000_000)
            .unwrap_or(OffsetDateTime::UNIX_EPOCH);
    let prefix = scope.metadata_prefix();
    let metadata = raw
        .xattrs
        .into_iter()
        .filter(|_| !prefix.is_empty())
        .filter_map(|(name, value)| Some((name.strip_prefix(prefix)?.to_owned(), value)))
        .take(MAX_METADATA)
        .collect();
    Ok(FileInfo {
        path: scope.shown(raw.path),
        kind,
        size: raw.size,
        mode: raw.mode & 0o7777,
        uid: raw.uid,
        gid: raw.gid,
        modified_at,
        target: (kind == FileKind::Symlink).then_some(raw.symlink_target),
        metadata,
    })
}

/// A listing's depth (default 1) and limit (default the maximum), checked.
pub(super) fn list_bounds(depth: Option<u32>, limit: Option<u32>) -> Result<(u32, u32), CoreError> {
    let depth = depth.unwrap_or(1);
    if !(1..=MAX_LIST_DEPTH).contains(&depth) {
        return Err(CoreError::invalid(
            runbox_types::ErrorCode::BadRequest,
            format!("depth must be 1 to {MAX_LIST_DEPTH}"),
        ));
    }
    let limit = limit.unwrap_or(MAX_LIST_ENTRIES);
    if !(1..=MAX_LIST_ENTRIES).contains(&limit) {
        return Err(CoreError::invalid(
            runbox_types::ErrorCode::BadRequest,
            format!("limit must be 1 to {MAX_LIST_ENTRIES}"),
        ));
    }
    Ok((depth, limit))
}

/// An agent call's status as an API error; an agent that predates the
/// call says so.
fn fs_error(status: tonic::Status) -> CoreError {
    if status.code() == tonic::Code::Unimplemented {
        return CoreError::Agent(format!(
            "this run's agent predates this file operation ({}); create the run again",
            bounded(status.message())
        ));
    }
    file_error(status)
}

async fn timed<T>(
    limit: Duration,
    call: impl std::future::Future<Output = Result<tonic::Response<T>, tonic::Status>>,
) -> Result<T, CoreError> {
    tokio::time::timeout(limit, call)
        .await
        .map_err(|_| {
            CoreError::Agent("the agent did not answer the file operation in time".into())
        })?
        .map(tonic::Response::into_inner)
        .map_err(fs_error)
}

impl Manager {
    /// Changes below `path` (None: `/work`), as they happen, until the
    /// returned stream is dropped (which cancels the agent's watch) or the
    /// run ends. The first event is `ready`.
    pub async fn watch_path(
        &self,
        id: Ulid,
        scope: Scope,
        path: Option<&str>,
        recursive: bool,
    ) -> Result<impl futures::Stream<Item = runbox_types::WatchEvent> + Send + 'static, CoreError>
    {
        use futures::StreamExt;
        let path = scope.agent_path(path, true)?;
        let Admission {
            handle,
            mut agent,
            protocol,
            ..
        } = self.admit(id, Access::Open).await?;
        scope.check(protocol)?;
        let events = timed(
            FS_CALL_TIMEOUT,
            agent.watch(pb::WatchRequest {
                path,
                recursive,
                root: scope.root(),
            }),
        )
        .await?;
        let ended = handle.ended.clone();
        let stream = events
            .take_until(async move { ended.cancelled().await })
            .filter_map(move |item| async move {
                let raw = item.ok()?;
                if raw.path.len() > MAX_AGENT_PATH || raw.from.len() > MAX_AGENT_PATH {
                    return None;
                }
                let kind = match pb::WatchKind::try_from(raw.kind).ok()? {
                    pb::WatchKind::Ready => runbox_types::WatchKind::Ready,
                    pb::WatchKind::Created => runbox_types::WatchKind::Created,
                    pb::WatchKind::Written => runbox_types::WatchKind::Written,
                    pb::WatchKind::Removed => runbox_types::WatchKind::Removed,
                    pb::WatchKind::Renamed => runbox_types::WatchKind::Renamed,
                    pb::WatchKind::Overflow => runbox_types::WatchKind::Overflow,
                    pb::WatchKind::Unspecified => return None,
                };
                Some(runbox_types::WatchEvent {
                    kind,
                    path: scope.shown(raw.path),
                    from: (kind == runbox_types::WatchKind::Renamed).then(|| scope.shown(raw.from)),
                    is_dir: raw.is_dir,
                })
            });
        Ok(stream)
    }

    /// Describes `path` (None: `/work` itself) without following a symlink.
    pub async fn stat_path(
        &self,
        id: Ulid,
        scope: Scope,
        path: Option<&str>,
    ) -> Result<FileInfo, CoreError> {
        let path = scope.agent_path(path, true)?;
        let Admission {
            mut agent,
            protocol,
            ..
        } = self.admit(id, Access::Open).await?;
        scope.check(protocol)?;
        let call = agent.stat(pb::StatRequest {
            path,
            root: scope.root(),
            xattr_prefix: scope.metadata_prefix().to_owned(),
        });
        info(scope, timed(FS_CALL_TIMEOUT, call).await?)
    }

    /// Lists `path` (None: `/work`), `depth` levels down, at most `limit`
    /// entries.
    pub async fn list_path(
        &self,
        id: Ulid,
        scope: Scope,
        path: Option<&str>,
        depth: Option<u32>,
        limit: Option<u32>,
    ) -> Result<FileList, CoreError> {
        let path = scope.agent_path(path, true)?;
        let (depth, limit) = list_bounds(depth, limit)?;
        let Admission {
            mut agent,
            protocol,
            ..
        } = self.admit(id, Access::Open).await?;
        scope.check(protocol)?;
        let reply = timed(
            FS_CALL_TIMEOUT,
            agent.list_dir(pb::ListDirRequest {
                path,
                depth,
                limit,
                root: scope.root(),
                xattr_prefix: scope.metadata_prefix().to_owned(),
            }),
        )
        .await?;
        let truncated = reply.truncated || reply.entries.len() > limit as usize;
        let entries = reply
            .entries
            .into_iter()
            .take(limit as usize)
            .map(|raw| info(scope, raw))
            .collect::<Result<Vec<_>, _>>()?;
        Ok(FileList { entries, truncated })
    }

    /// Makes a directory and its missing parents (fenced by the lease).
    pub async fn make_dir(
        &self,
        id: Ulid,
        scope: Scope,
        req: MakeDirRequest,
        user: Option<String>,
    ) -> Result<FileInfo, CoreError> {
        let path = scope.agent_path(Some(&req.path), false)?;
        let mode = req.mode.unwrap_or(0o755);
        if mode > 0o7777 {
            return Err(CoreError::invalid(
                runbox_types::ErrorCode::BadRequest,
                "mode must be permission bits, at most 0o7777 (4095)",
            ));
        }
        let credential = validate::credential(req.owner.as_deref(), req.generation)?;
        let user = user.map(validate::user).transpose()?;
        let Admission {
            handle,
            mut agent,
            protocol,
            record,
            in_flight: _in_flight,
            ..
        } = self.admit(id, Access::Fenced(credential)).await?;
        scope.check(protocol)?;
        let recorder = self.recorder(&handle, &record).await;
        let user = owner(&record, user);
        let cause = super::history::file_cause("mkdir", &scope.absolute(&path));
        let call = agent.make_dir(pb::MakeDirRequest {
            path,
            mode,
            root: scope.root(),
            user,
        });
        let made = info(scope, timed(FS_CALL_TIMEOUT, call).await?)?;
        super::history::after(recorder, cause).await;
        Ok(made)
    }

    /// Renames a path (fenced by the lease).
    pub async fn move_path(
        &self,
        id: Ulid,
        scope: Scope,
        req: MoveRequest,
    ) -> Result<FileInfo, CoreError> {
        let from = scope.agent_path(Some(&req.from), false)?;
        let to = scope.agent_path(Some(&req.to), false)?;
        let credential = validate::credential(req.owner.as_deref(), req.generation)?;
        let Admission {
            handle,
            mut agent,
            protocol,
            record,
            in_flight: _in_flight,
            ..
        } = self.admit(id, Access::Fenced(credential)).await?;
        scope.check(protocol)?;
        let recorder = self.recorder(&handle, &record).await;
        let cause = super::history::file_cause("move", &scope.absolute(&to));
        let call = agent.r#move(pb::MoveRequest {
            from,
            to,
            overwrite: req.overwrite.unwrap_or(false),
            root: scope.root(),
            xattr_prefix: scope.metadata_prefix().to_owned(),
        });
        let moved = info(scope, timed(FS_CALL_TIMEOUT, call).await?)?;
        super::history::after(recorder, cause).await;
        Ok(moved)
    }

    /// Removes a path (fenced by the lease).
    pub async fn remove_path(
        &self,
        id: Ulid,
        scope: Scope,
        req: RemoveRequest,
    ) -> Result<RemoveReply, CoreError> {
        let path = scope.agent_path(Some(&req.path), false)?;
        let credential = validate::credential(req.owner.as_deref(), req.generation)?;
        let Admission {
            handle,
            mut agent,
            protocol,
            record,
            in_flight: _in_flight,
            ..
        } = self.admit(id, Access::Fenced(credential)).await?;
        scope.check(protocol)?;
        let recorder = self.recorder(&handle, &record).await;
        let cause = super::history::file_cause("remove", &scope.absolute(&path));
        let call = agent.remove(pb::RemoveRequest {
            path,
            recursive: req.recursive.unwrap_or(false),
            root: scope.root(),
        });
        let reply = timed(REMOVE_TIMEOUT, call).await?;
        if reply.removed > 0 {
            super::history::after(recorder, cause).await;
        }
        Ok(RemoveReply {
            removed: reply.removed,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn metadata_is_checked_and_kept_under_e2bs_prefix() {
        let one = |k: &str, v: &str| BTreeMap::from([(k.to_owned(), v.to_owned())]);
        let kept = Scope::Root.metadata_xattrs(one("Author", "mish")).unwrap();
        assert_eq!(
            kept.get("user.e2b.author").map(String::as_str),
            Some("mish")
        );
        assert!(Scope::Root
            .metadata_xattrs(BTreeMap::new())
            .unwrap()
            .is_empty());
        for (k, v) in [
            ("bad key", "v"),
            ("", "v"),
            ("k", "caf\u{e9}"),
            ("k", "line\nbreak"),
        ] {
            assert!(
                Scope::Root.metadata_xattrs(one(k, v)).is_err(),
                "{k:?}={v:?}"
            );
        }
        assert!(Scope::Root
            .metadata_xattrs(one(&"k".repeat(201), "v"))
            .is_err());
        assert!(Scope::Root
            .metadata_xattrs(one("k", &"v".repeat(1025)))
            .is_err());
        let many: BTreeMap<_, _> = (0..=MAX_METADATA)
            .map(|i| (format!("k{i}"), String::new()))
            .collect();
        assert!(Scope::Root.metadata_xattrs(many).is_err());
        // Files under /work keep none: refused, not dropped.
        assert!(Scope::Work.metadata_xattrs(one("k", "v")).is_err());
    }
}
