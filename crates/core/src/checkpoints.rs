//! The checkpoint store: runs' disks and settings kept in a directory or an
//! S3-compatible bucket, so that a run can be brought back on any node that
//! can have its image, after this node's copy is gone.
//!
//! Every write is a new *generation* of a checkpoint, laid out under the
//! store's prefix as
//!
//! ```text
//! data/<id>/<generation>/layer-<n>.tar.zst   layers, zstd-compressed OCI layer tars
//! data/<id>/<generation>/record.json         what the run was (CheckpointRecord)
//! commits/<id>/<generation>.json             the commit point, written last
//! layers/<hex>.tar.zst                       a layer checkpoints share, by its blob's digest
//! layers/<hex>.refs/<id>-<generation>        a generation that uses it
//! ```
//!
//! The layers below a run's disk that a registry cannot give back (an
//! imported image's, a snapshot's) are stored once per store and shared by
//! every checkpoint that needs them (a checkpoint of a run made from the
//! same image uploads only its disk). A generation marks each shared layer
//! it uses before it uses it; the sweep removes a shared layer once no
//! committed generation marks it, and its marks of generations that are
//! gone.
//!
//! Only a generation with a commit object exists for readers: a crash (or a
//! store outage) before the commit leaves data objects no listing shows,
//! which the sweep removes once the newest of them is an hour old and no
//! upload of this daemon is still writing them. The commit names the
//! record's digest and the record every layer's, so a corrupted, truncated
//! or swapped object is refused when it is read, never booted.
//!
//! The store is reached through `object_store` (the directory store and the
//! S3 client with its request signing, credential chain and retries); this
//! module only decides what goes where.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::io::{self, Write};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use futures::StreamExt;
use object_store::path::Path as ObjectPath;
use object_store::{ObjectStore, ObjectStoreExt, PutPayload, WriteMultipart};
use runbox_types::ErrorCode;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use time::OffsetDateTime;
use ulid::Ulid;

use crate::error::CoreError;

/// The version of the record and commit formats this daemon writes (2:
/// layers may be shared between checkpoints).
pub const FORMAT_VERSION: u32 = 2;

/// How old an uncommitted generation must be before the sweep removes it.
pub const ORPHAN_AGE: Duration = Duration::from_secs(60 * 60);

/// How long a generation stays readable after a newer one superseded it
/// (counted from the newer one's commit), so a restore that began from it
/// (on another node of a fleet sharing the bucket) finishes.
pub const SUPERSEDED_GRACE: Duration = Duration::from_secs(60 * 60);

/// The label that marks a checkpoint as an archived run's disk: its life is
/// the run's, so the TTL sweep leaves it alone.
pub const ARCHIVE_LABEL: &str = "runbox.archive";

/// How long a `503 checkpoint_store_unavailable` asks a client to wait.
pub const RETRY_AFTER: Duration = Duration::from_secs(10);

/// The zstd level layers are compressed at: fast, and about as small as
/// gzip's default.
const ZSTD_LEVEL: i32 = 3;

/// Bytes handed from the tar writer to the uploader at a time.
const CHUNK: usize = 1 << 20;

/// Size of one part of a multipart upload.
const PART: usize = 16 << 20;

/// Parts uploaded at once.
const PARTS_IN_FLIGHT: usize = 4;

/// The largest record or commit object read back.
const MAX_RECORD_BYTES: u64 = 4 << 20;

/// One layer as stored.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct StoredLayer {
    /// Its object's name within the generation (`layer-<n>.tar.zst`).
    pub object: String,
    /// `sha256:` of the object's bytes (the compressed blob).
    pub digest: String,
    /// `sha256:` of the uncompressed tar.
    pub diff_id: String,
    /// The object's size in bytes.
    pub size: u64,
    /// The uncompressed tar's size in bytes.
    pub tar_bytes: u64,
    /// The layer's key on the node that wrote it, for a layer below the
    /// run's disk: a node that still has it uses it instead of a download.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub key: Option<String>,
    /// Stored once for every checkpoint that uses it (`layers/<object>`),
    /// not in the generation's data.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub shared: bool,
}

/// Everything needed to bring a checkpointed run back.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct CheckpointRecord {
    /// [`FORMAT_VERSION`] when written.
    pub version: u32,
    /// The checkpoint.
    pub id: Ulid,
    /// The generation this record belongs to.
    pub generation: u64,
    /// The run it was taken from.
    pub run: Ulid,
    /// That run's image name.
    pub image: String,
    /// A registry reference the `base` layers can be pulled from again;
    /// None when they were not pulled (imported, or made on a node).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pull: Option<String>,
    /// Layer keys (diff_ids) below the stored layers that the restoring node
    /// must have or pull from `pull`; base first.
    pub base: Vec<String>,
    /// The stored layers, above `base`, the run's disk last.
    pub layers: Vec<StoredLayer>,
    /// The image's OCI config document.
    pub config: serde_json::Value,
    /// The run's settings, as a create would give them (`image` empty).
    pub settings: runbox_types::CreateRunRequest,
}

/// The commit object of one generation: what a listing shows, and the
/// record's digest.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Commit {
    /// [`FORMAT_VERSION`] when written.
    pub version: u32,
    /// The generation it commits.
    pub generation: u64,
    /// The checkpoint as the API shows it (`expiresAt` left empty: it
    /// follows the reading daemon's TTL).
    pub checkpoint: runbox_types::Checkpoint,
    /// `sha256:` of `record.json`.
    pub record_digest: String,
    /// Its size in bytes.
    pub record_bytes: u64,
}

/// What one sweep removed.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Swept {
    /// Checkpoints past their TTL.
    pub expired: usize,
    /// Uncommitted or superseded generations.
    pub orphans: usize,
    /// Shared layers no generation uses any more.
    pub shared: usize,
}

/// A checkpoint store.
pub struct CheckpointStore {
    objects: Arc<dyn ObjectStore>,
    /// The prefix every key is under (empty for a directory store).
    root: ObjectPath,
    /// Where it is, for messages: a directory or `s3://bucket/prefix`.
    location: String,
    /// Generations this daemon is writing (`<id>/<generation>`): never
    /// orphans, however old their first objects are.
    writing: Mutex<HashSet<String>>,
    /// A directory store's directory.
    local: Option<std::path::PathBuf>,
    /// The shared form of this node's layers uploaded or hashed so far, by
    /// layer key: a later checkpoint that needs one only checks that the
    /// store still has it.
    shared: Mutex<HashMap<String, StoredLayer>>,
}

impl std::fmt::Debug for CheckpointStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CheckpointStore")
            .field("location", &self.location)
            .finish_non_exhaustive()
    }
}

impl CheckpointStore {
    /// Opens the store `location` names: `s3://bucket[/prefix]` (see
    /// [`s3_builder`] for where its endpoint and credentials come from), or
    /// an absolute directory, created if missing. Nothing is sent to a
    /// bucket until the store is used.
    pub fn open(location: &str) -> Result<CheckpointStore, CoreError> {
        if location.starts_with("s3://") {
            let (builder, prefix) = s3_builder(location, &|k| std::env::var(k).ok())
                .map_err(|why| CoreError::invalid(ErrorCode::BadRequest, why))?;
            let s3 = builder.build().map_err(|e| {
                CoreError::invalid(
                    ErrorCode::BadRequest,
                    format!("checkpoint store {location}: {e}"),
                )
            })?;
            return Ok(CheckpointStore::new(Arc::new(s3), &prefix, location));
        }
        let dir = std::path::Path::new(location);
        if !dir.is_absolute() {
            return Err(CoreError::invalid(
                ErrorCode::BadRequest,
                format!(
                    "checkpoint store {location:?}: give an absolute directory or s3://bucket/prefix"
                ),
            ));
        }
        std::fs::create_dir_all(dir).map_err(CoreError::io(format!(
            "creating checkpoint store {location}"
        )))?;
        let local = object_store::local::LocalFileSystem::new_with_prefix(dir)
            .map_err(|e| CoreError::Store(format!("checkpoint store {location}: {e}")))?
            .with_automatic_cleanup(true);
        let mut store = CheckpointStore::new(Arc::new(local), "", location);
        store.local = Some(dir.to_path_buf());
        Ok(store)
    }

    fn new(objects: Arc<dyn ObjectStore>, prefix: &str, location: &str) -> CheckpointStore {
        CheckpointStore {
            objects,
            root: ObjectPath::from(prefix),
            location: location.to_owned(),
            writing: Mutex::new(HashSet::new()),
            local: None,
            shared: Mutex::new(HashMap::new()),
        }
    }

    /// Where the store is: a directory or `s3://bucket/prefix`.
    pub fn location(&self) -> &str {
        &self.location
    }

    fn commits_of(&self, id: Ulid) -> ObjectPath {
        self.root.clone().join("commits").join(id.to_string())
    }

    fn data_of(&self, id: Ulid, generation: u64) -> ObjectPath {
        self.root
            .clone()
            .join("data")
            .join(id.to_string())
            .join(generation_name(generation))
    }

    /// Where shared layer object `object` (`<hex>.tar.zst`) is.
    fn shared_of(&self, object: &str) -> ObjectPath {
        self.root.clone().join("layers").join(object)
    }

    /// Where the marks of the generations that use shared layer `object`
    /// are.
    fn refs_of(&self, object: &str) -> ObjectPath {
        self.root
            .clone()
            .join("layers")
            .join(format!("{}.refs", object.trim_end_matches(".tar.zst")))
    }

    fn unavailable(&self, doing: &str) -> impl FnOnce(object_store::Error) -> CoreError + '_ {
        let doing = doing.to_owned();
        move |e| CoreError::Conflict {
            code: ErrorCode::CheckpointStoreUnavailable,
            message: format!(
                "the checkpoint store ({}) failed while {doing}: {}",
                self.location,
                error_text(&e)
            ),
        }
    }

    /// Starts generation `generation` of checkpoint `id`: until it is
    /// committed or dropped, the sweep leaves its objects alone.
    pub fn begin(&self, id: Ulid, generation: u64) -> Upload<'_> {
        let key = format!("{id}/{}", generation_name(generation));
        lock(&self.writing).insert(key.clone());
        Upload {
            store: self,
            id,
            generation,
            key,
            layers: Vec::new(),
        }
    }

    /// Every committed checkpoint (its newest generation), oldest first.
    pub async fn list(&self) -> Result<Vec<Commit>, CoreError> {
        let prefix = self.root.clone().join("commits");
        let metas: Vec<object_store::ObjectMeta> = self
            .objects
            .list(Some(&prefix))
            .collect::<Vec<_>>()
            .await
            .into_iter()
            .collect::<Result<_, _>>()
            .map_err(self.unavailable("listing checkpoints"))?;
        let mut newest: BTreeMap<Ulid, (u64, ObjectPath)> = BTreeMap::new();
        for meta in metas {
            let Some((id, generation)) = parse_commit_path(&prefix, &meta.location) else {
                continue;
            };
            let entry = newest.entry(id).or_insert((0, meta.location.clone()));
            if generation >= entry.0 {
                *entry = (generation, meta.location);
            }
        }
        let mut commits = Vec::with_capacity(newest.len());
        for (id, (generation, path)) in newest {
            match self.read_commit(&path, id, generation).await {
                Ok(commit) => commits.push(commit),
                // Deleted since the listing.
                Err(CoreError::Invalid {
                    code: ErrorCode::CheckpointNotFound,
                    ..
                }) => {}
                Err(e) => return Err(e),
            }
        }
        commits.sort_by_key(|c| (c.checkpoint.created_at, c.checkpoint.id));
        Ok(commits)
    }

    /// The newest committed generation of checkpoint `id`.
    pub async fn get(&self, id: Ulid) -> Result<Commit, CoreError> {
        let generations = self.committed(id).await?;
        let Some((generation, path)) = generations.into_iter().next_back() else {
            return Err(not_found(id));
        };
        self.read_commit(&path, id, generation).await
    }

    /// The generation after the newest committed one of `id` (1 for a new
    /// checkpoint).
    pub async fn next_generation(&self, id: Ulid) -> Result<u64, CoreError> {
        Ok(self
            .committed(id)
            .await?
            .keys()
            .next_back()
            .map_or(1, |g| g + 1))
    }

    /// Whether checkpoint `id` has a committed generation.
    pub async fn exists(&self, id: Ulid) -> Result<bool, CoreError> {
        Ok(!self.committed(id).await?.is_empty())
    }

    /// The committed generations of `id`, oldest first.
    async fn committed(&self, id: Ulid) -> Result<BTreeMap<u64, ObjectPath>, CoreError> {
        let prefix = self.root.clone().join("commits");
        let metas: Vec<object_store::ObjectMeta> = self
            .objects
            .list(Some(&self.commits_of(id)))
            .collect::<Vec<_>>()
            .await
            .into_iter()
            .collect::<Result<_, _>>()
            .map_err(self.unavailable("reading a checkpoint"))?;
        Ok(metas
            .into_iter()
            .filter_map(|m| {
                let (found, generation) = parse_commit_path(&prefix, &m.location)?;
                (found == id).then_some((generation, m.location))
            })
            .collect())
    }

    async fn read_commit(
        &self,
        path: &ObjectPath,
        id: Ulid,
        generation: u64,
    ) -> Result<Commit, CoreError> {
        let bytes = match self.read_small(path, "reading a checkpoint").await {
            Ok(bytes) => bytes,
            Err(None) => return Err(not_found(id)),
            Err(Some(e)) => return Err(e),
        };
        let commit: Commit = serde_json::from_slice(&bytes)
            .map_err(|e| corrupt(id, format!("its commit object does not parse: {e}")))?;
        if commit.version > FORMAT_VERSION {
            return Err(corrupt(
                id,
                format!(
                    "it was written in format {} and this daemon reads up to {FORMAT_VERSION}",
                    commit.version
                ),
            ));
        }
        if commit.checkpoint.id != id || commit.generation != generation {
            return Err(corrupt(id, "its commit object names another checkpoint"));
        }
        Ok(commit)
    }

    /// Reads a small object whole; `Err(None)` when it does not exist.
    async fn read_small(&self, path: &ObjectPath, doing: &str) -> Result<Bytes, Option<CoreError>> {
        let got = match self.objects.get(path).await {
            Ok(got) => got,
            Err(object_store::Error::NotFound { .. }) => return Err(None),
            Err(e) => return Err(Some(self.unavailable(doing)(e))),
        };
        if got.meta.size > MAX_RECORD_BYTES {
            return Err(Some(CoreError::invalid(
                ErrorCode::CheckpointCorrupt,
                format!(
                    "object {path} is {} bytes, more than a record may be",
                    got.meta.size
                ),
            )));
        }
        got.bytes()
            .await
            .map_err(|e| Some(self.unavailable(doing)(e)))
    }

    /// The record `commit` commits, checked against its digest.
    pub async fn record(&self, commit: &Commit) -> Result<CheckpointRecord, CoreError> {
        let id = commit.checkpoint.id;
        let path = self.data_of(id, commit.generation).join("record.json");
        let bytes = match self.read_small(&path, "reading a checkpoint").await {
            Ok(bytes) => bytes,
            Err(None) => return Err(corrupt(id, "its record object is missing")),
            Err(Some(e)) => return Err(e),
        };
        let digest = sha256_of(&bytes);
        if digest != commit.record_digest || bytes.len() as u64 != commit.record_bytes {
            return Err(corrupt(
                id,
                format!(
                    "its record is {} bytes with digest {digest}; the commit recorded {} bytes with {}",
                    bytes.len(),
                    commit.record_bytes,
                    commit.record_digest
                ),
            ));
        }
        let record: CheckpointRecord = serde_json::from_slice(&bytes)
            .map_err(|e| corrupt(id, format!("its record does not parse: {e}")))?;
        if record.id != id || record.generation != commit.generation {
            return Err(corrupt(id, "its record names another checkpoint"));
        }
        for layer in &record.layers {
            let valid = match layer.shared {
                true => shared_object_name(&layer.digest).as_deref() == Some(layer.object.as_str()),
                false => valid_object_name(&layer.object),
            };
            if !valid {
                return Err(corrupt(
                    id,
                    format!("its record names object {:?}", layer.object),
                ));
            }
        }
        Ok(record)
    }

    /// Streams stored layer `layer` of `record` into `sink`, at most its
    /// recorded size; the sink verifies the digests.
    pub async fn read_layer(
        &self,
        record: &CheckpointRecord,
        layer: &StoredLayer,
        sink: impl FnMut(&[u8]) -> io::Result<()>,
    ) -> Result<(), CoreError> {
        self.read_stored(record.id, record.generation, layer, sink)
            .await
    }

    /// Writes `bytes` as object `name` beside the layers of generation
    /// `generation` of `id`, which is never committed: for what passes
    /// between nodes (a volume on its way to another node), not what is
    /// kept. No listing shows it; the sweep removes it with the
    /// generation's other objects once the newest is [`ORPHAN_AGE`] old,
    /// if [`CheckpointStore::discard`] did not first.
    pub async fn put_note(
        &self,
        id: Ulid,
        generation: u64,
        name: &str,
        bytes: Vec<u8>,
    ) -> Result<(), CoreError> {
        let path = self.data_of(id, generation).join(name);
        self.objects
            .put(&path, PutPayload::from(bytes))
            .await
            .map(|_| ())
            .map_err(self.unavailable("writing to the checkpoint store"))
    }

    /// Object `name` [`CheckpointStore::put_note`] wrote; None when there
    /// is none.
    pub async fn read_note(
        &self,
        id: Ulid,
        generation: u64,
        name: &str,
    ) -> Result<Option<Bytes>, CoreError> {
        let path = self.data_of(id, generation).join(name);
        match self
            .read_small(&path, "reading from the checkpoint store")
            .await
        {
            Ok(bytes) => Ok(Some(bytes)),
            Err(None) => Ok(None),
            Err(Some(e)) => Err(e),
        }
    }

    /// Removes every object of uncommitted generation `generation` of
    /// `id` (what is left is the sweep's).
    pub async fn discard(&self, id: Ulid, generation: u64) -> Result<(), CoreError> {
        self.remove_data(id, generation).await
    }

    /// Streams layer `layer` of generation `generation` of `id` into
    /// `sink`, at most its recorded size; the sink verifies the digests.
    pub async fn read_stored(
        &self,
        id: Ulid,
        generation: u64,
        layer: &StoredLayer,
        mut sink: impl FnMut(&[u8]) -> io::Result<()>,
    ) -> Result<(), CoreError> {
        let path = match layer.shared {
            true => self.shared_of(&layer.object),
            false => self.data_of(id, generation).join(layer.object.as_str()),
        };
        if let Some(dir) = &self.local {
            return read_local_layer(&dir.join(path.as_ref()), id, layer, sink);
        }
        let doing = "downloading a checkpoint layer";
        let got = match self.objects.get(&path).await {
            Ok(got) => got,
            Err(object_store::Error::NotFound { .. }) => {
                return Err(corrupt(
                    id,
                    format!("its layer {} is missing", layer.object),
                ))
            }
            Err(e) => return Err(self.unavailable(doing)(e)),
        };
        if got.meta.size != layer.size {
            return Err(corrupt(
                id,
                format!(
                    "its layer {} is {} bytes; the record says {}",
                    layer.object, got.meta.size, layer.size
                ),
            ));
        }
        let mut stream = got.into_stream();
        let mut seen = 0u64;
        // A directory store streams small reads; the sink gets them in
        // pieces of about [`CHUNK`], as it would from a bucket.
        let mut pending: Vec<u8> = Vec::with_capacity(CHUNK);
        let mut flush = |pending: &mut Vec<u8>| {
            let sent = sink(pending)
                .map_err(|e| corrupt(id, format!("its layer {} was refused: {e}", layer.object)));
            pending.clear();
            sent
        };
        while let Some(chunk) = stream.next().await {
            let chunk = chunk.map_err(self.unavailable(doing))?;
            seen += chunk.len() as u64;
            if seen > layer.size {
                return Err(corrupt(
                    id,
                    format!("its layer {} is longer than recorded", layer.object),
                ));
            }
            pending.extend_from_slice(&chunk);
            if pending.len() >= CHUNK {
                flush(&mut pending)?;
            }
        }
        if !pending.is_empty() {
            flush(&mut pending)?;
        }
        Ok(())
    }

    /// Removes every generation of checkpoint `id`: the commits first, so
    /// that it stops existing at once, then the data (what a failure leaves
    /// is an orphan for the sweep).
    pub async fn delete(&self, id: Ulid) -> Result<(), CoreError> {
        let generations = self.committed(id).await?;
        if generations.is_empty() {
            return Err(not_found(id));
        }
        for path in generations.values() {
            self.remove(path).await?;
        }
        for generation in generations.keys() {
            self.remove_data(id, *generation).await?;
        }
        Ok(())
    }

    async fn remove(&self, path: &ObjectPath) -> Result<(), CoreError> {
        match self.objects.delete(path).await {
            Ok(()) | Err(object_store::Error::NotFound { .. }) => Ok(()),
            Err(e) => Err(self.unavailable("deleting a checkpoint")(e)),
        }
    }

    async fn remove_data(&self, id: Ulid, generation: u64) -> Result<(), CoreError> {
        let prefix = self.data_of(id, generation);
        let metas: Vec<object_store::ObjectMeta> = self
            .objects
            .list(Some(&prefix))
            .collect::<Vec<_>>()
            .await
            .into_iter()
            .collect::<Result<_, _>>()
            .map_err(self.unavailable("deleting a checkpoint"))?;
        for meta in metas {
            self.remove(&meta.location).await?;
        }
        Ok(())
    }

    /// Removes checkpoints older than `ttl` (when given), generations a
    /// newer one superseded more than [`SUPERSEDED_GRACE`] ago, and
    /// uncommitted data older than [`ORPHAN_AGE`] that this daemon is not
    /// writing.
    pub async fn sweep(
        &self,
        now: OffsetDateTime,
        ttl: Option<Duration>,
    ) -> Result<Swept, CoreError> {
        let mut swept = Swept::default();
        let commits_prefix = self.root.clone().join("commits");
        let metas: Vec<object_store::ObjectMeta> = self
            .objects
            .list(Some(&commits_prefix))
            .collect::<Vec<_>>()
            .await
            .into_iter()
            .collect::<Result<_, _>>()
            .map_err(self.unavailable("sweeping checkpoints"))?;
        // Each generation's commit object and when it was written.
        let mut committed: HashMap<Ulid, BTreeMap<u64, (ObjectPath, OffsetDateTime)>> =
            HashMap::new();
        for meta in metas {
            if let Some((id, generation)) = parse_commit_path(&commits_prefix, &meta.location) {
                let written = OffsetDateTime::from_unix_timestamp(meta.last_modified.timestamp())
                    .unwrap_or(OffsetDateTime::UNIX_EPOCH);
                committed
                    .entry(id)
                    .or_default()
                    .insert(generation, (meta.location, written));
            }
        }
        let mut live: HashSet<(Ulid, u64)> = HashSet::new();
        for (id, generations) in &committed {
            let Some((&newest, (path, _))) = generations.iter().next_back() else {
                continue;
            };
            if let Some(ttl) = ttl {
                match self.read_commit(path, *id, newest).await {
                    Ok(commit)
                        if commit.checkpoint.created_at + ttl <= now
                            && !commit.checkpoint.labels.contains_key(ARCHIVE_LABEL) =>
                    {
                        tracing::info!(checkpoint = %id, "checkpoint past its TTL removed");
                        self.delete(*id).await?;
                        swept.expired += 1;
                        continue;
                    }
                    Ok(_) => {}
                    Err(e) if e.code() == ErrorCode::CheckpointCorrupt => {
                        tracing::warn!(checkpoint = %id, error = %e, "unreadable commit object left in place");
                    }
                    Err(e) => return Err(e),
                }
            }
            for (&generation, (path, _)) in generations.iter() {
                // When the next generation superseded this one.
                let superseded_at = generations
                    .range(generation + 1..)
                    .next()
                    .map(|(_, (_, written))| *written);
                match superseded_at {
                    Some(at) if at + SUPERSEDED_GRACE <= now => {
                        // Its data goes with the data sweep below.
                        self.remove(path).await?;
                    }
                    // The newest, or superseded a moment ago: kept whole.
                    _ => {
                        live.insert((*id, generation));
                    }
                }
            }
        }
        let data_prefix = self.root.clone().join("data");
        let metas: Vec<object_store::ObjectMeta> = self
            .objects
            .list(Some(&data_prefix))
            .collect::<Vec<_>>()
            .await
            .into_iter()
            .collect::<Result<_, _>>()
            .map_err(self.unavailable("sweeping checkpoints"))?;
        let mut orphans: BTreeMap<(Ulid, u64), (OffsetDateTime, Vec<ObjectPath>)> = BTreeMap::new();
        for meta in metas {
            let Some((id, generation)) = parse_data_path(&data_prefix, &meta.location) else {
                continue;
            };
            if live.contains(&(id, generation)) {
                continue;
            }
            let modified = OffsetDateTime::from_unix_timestamp(meta.last_modified.timestamp())
                .unwrap_or(OffsetDateTime::UNIX_EPOCH);
            let entry = orphans
                .entry((id, generation))
                .or_insert((OffsetDateTime::UNIX_EPOCH, Vec::new()));
            entry.0 = entry.0.max(modified);
            entry.1.push(meta.location);
        }
        let writing = lock(&self.writing).clone();
        for ((id, generation), (newest, paths)) in orphans {
            let superseded = committed
                .get(&id)
                .is_some_and(|g| g.keys().any(|&other| other > generation));
            if writing.contains(&format!("{id}/{}", generation_name(generation))) {
                continue;
            }
            if !superseded && newest + ORPHAN_AGE > now {
                continue;
            }
            for path in paths {
                self.remove(&path).await?;
            }
            tracing::info!(checkpoint = %id, generation, "uncommitted checkpoint data removed");
            swept.orphans += 1;
        }
        swept.shared = self.sweep_shared(now, &live, &writing).await?;
        if let Some(dir) = &self.local {
            let (data, cutoff) = (dir.join("data"), now - ORPHAN_AGE);
            swept.orphans +=
                tokio::task::spawn_blocking(move || sweep_staging(&data, cutoff, &writing))
                    .await
                    .map_err(|e| CoreError::Store(format!("checkpoint sweep task failed: {e}")))?;
        }
        Ok(swept)
    }
}

impl CheckpointStore {
    /// Uploads what `produce` writes (an uncompressed layer tar, made on a
    /// blocking thread) to `path`, compressed, hashed and sent in parts as
    /// it is made; nothing is spooled to disk. The blob's digest and size,
    /// and the tar's.
    async fn upload(
        &self,
        path: &ObjectPath,
        produce: impl FnOnce(&mut dyn Write) -> io::Result<()> + Send + 'static,
    ) -> Result<(String, u64, String, u64), CoreError> {
        let (tx, mut rx) = tokio::sync::mpsc::channel::<Bytes>(PARTS_IN_FLIGHT);
        let producer = tokio::task::spawn_blocking(move || {
            let sink = ChunkWriter {
                tx,
                buf: Vec::with_capacity(CHUNK),
            };
            compress(sink, produce, |sink| sink.send_rest())
        });
        let doing = "uploading a checkpoint layer";
        let sent = async {
            let upload = self
                .objects
                .put_multipart(path)
                .await
                .map_err(self.unavailable(doing))?;
            let mut writer = WriteMultipart::new_with_chunk_size(upload, PART);
            while let Some(chunk) = rx.recv().await {
                if let Err(e) = writer.wait_for_capacity(PARTS_IN_FLIGHT).await {
                    let _ = writer.abort().await;
                    return Err(self.unavailable(doing)(e));
                }
                writer.put(chunk);
            }
            Ok(writer)
        }
        .await;
        // Whatever happened above, the producer stops at its next write.
        drop(rx);
        let produced = producer
            .await
            .map_err(|e| CoreError::Store(format!("checkpoint layer task failed: {e}")))?;
        let writer = sent?;
        let done = match produced {
            Ok(done) => done,
            Err(e) => {
                let _ = writer.abort().await;
                return Err(CoreError::io("writing the run's disk as a layer")(e));
            }
        };
        writer.finish().await.map_err(self.unavailable(doing))?;
        Ok(done)
    }

    /// What [`CheckpointStore::upload`] would store of `produce`'s tar:
    /// its digests and sizes, nothing sent.
    async fn hash(
        &self,
        produce: impl FnOnce(&mut dyn Write) -> io::Result<()> + Send + 'static,
    ) -> Result<(String, u64, String, u64), CoreError> {
        tokio::task::spawn_blocking(move || compress(io::sink(), produce, |_| Ok(())))
            .await
            .map_err(|e| CoreError::Store(format!("checkpoint layer task failed: {e}")))?
            .map_err(CoreError::io("reading a layer"))
    }

    /// Whether the store has shared layer `layer`, whole.
    async fn has_shared(&self, layer: &StoredLayer) -> Result<bool, CoreError> {
        match self.objects.head(&self.shared_of(&layer.object)).await {
            Ok(meta) => Ok(meta.size == layer.size),
            Err(object_store::Error::NotFound { .. }) => Ok(false),
            Err(e) => Err(self.unavailable("looking for a shared checkpoint layer")(e)),
        }
    }
}

/// Compresses the tar `produce` writes into `sink` (zstd), hashing both:
/// the blob's digest and size, and the tar's. `finish` flushes the sink.
fn compress<W: Write>(
    sink: W,
    produce: impl FnOnce(&mut dyn Write) -> io::Result<()>,
    finish: impl FnOnce(&mut W) -> io::Result<()>,
) -> io::Result<(String, u64, String, u64)> {
    let blob = HashingWriter::new(sink);
    let mut encoder = zstd::stream::Encoder::new(blob, ZSTD_LEVEL)?;
    let mut tar = HashingWriter::new(&mut encoder);
    produce(&mut tar)?;
    let (diff_id, tar_bytes) = (tar.digest(), tar.count);
    let mut blob = encoder.finish()?;
    finish(&mut blob.inner)?;
    Ok((blob.digest(), blob.count, diff_id, tar_bytes))
}

impl CheckpointStore {
    /// Removes the marks of generations that are gone (neither `live` nor
    /// being written nor made in the last [`ORPHAN_AGE`]), then every
    /// shared layer older than that left without marks: how many layers.
    async fn sweep_shared(
        &self,
        now: OffsetDateTime,
        live: &HashSet<(Ulid, u64)>,
        writing: &HashSet<String>,
    ) -> Result<usize, CoreError> {
        let prefix = self.root.clone().join("layers");
        let doing = "sweeping shared checkpoint layers";
        let metas: Vec<object_store::ObjectMeta> = self
            .objects
            .list(Some(&prefix))
            .collect::<Vec<_>>()
            .await
            .into_iter()
            .collect::<Result<_, _>>()
            .map_err(self.unavailable(doing))?;
        let modified = |meta: &object_store::ObjectMeta| {
            OffsetDateTime::from_unix_timestamp(meta.last_modified.timestamp())
                .unwrap_or(OffsetDateTime::UNIX_EPOCH)
        };
        let kept = |meta: &object_store::ObjectMeta| -> bool {
            let Some((id, generation)) = parse_mark(&prefix, &meta.location) else {
                return false;
            };
            live.contains(&(id, generation))
                || writing.contains(&format!("{id}/{}", generation_name(generation)))
                || modified(meta) + ORPHAN_AGE > now
        };
        let mut blobs = Vec::new();
        let mut marked: HashSet<String> = HashSet::new();
        for meta in &metas {
            let Some(mut parts) = meta.location.prefix_match(&prefix) else {
                continue;
            };
            let Some(first) = parts.next() else { continue };
            let first = first.as_ref().to_owned();
            match first.strip_suffix(".refs") {
                Some(hex) if kept(meta) => {
                    marked.insert(format!("{hex}.tar.zst"));
                }
                Some(_) => self.remove(&meta.location).await?,
                None if first.ends_with(".tar.zst") && parts.next().is_none() => {
                    blobs.push((first, modified(meta)));
                }
                None => {}
            }
        }
        let mut removed = 0;
        for (object, written) in blobs {
            if marked.contains(&object) || written + ORPHAN_AGE > now {
                continue;
            }
            // Looked at again just before it goes: a generation that marked
            // it since the listing keeps it.
            let marks: Vec<object_store::ObjectMeta> = self
                .objects
                .list(Some(&self.refs_of(&object)))
                .collect::<Vec<_>>()
                .await
                .into_iter()
                .collect::<Result<_, _>>()
                .map_err(self.unavailable(doing))?;
            if marks.iter().any(kept) {
                continue;
            }
            self.remove(&self.shared_of(&object)).await?;
            tracing::info!(layer = %object, "shared checkpoint layer no checkpoint uses removed");
            removed += 1;
        }
        Ok(removed)
    }
}

/// `<layers>/<hex>.refs/<id>-<generation>` → (id, generation).
fn parse_mark(prefix: &ObjectPath, path: &ObjectPath) -> Option<(Ulid, u64)> {
    let mut parts = path.prefix_match(prefix)?;
    parts.next()?.as_ref().strip_suffix(".refs")?;
    let (id, generation) = parts
        .next()?
        .as_ref()
        .split_once('-')
        .map(|(a, b)| (a.to_owned(), b.to_owned()))?;
    parts
        .next()
        .is_none()
        .then_some(())
        .and_then(|()| Some((id.parse().ok()?, generation.parse().ok()?)))
}

/// One generation being written; see [`CheckpointStore::begin`].
pub struct Upload<'a> {
    store: &'a CheckpointStore,
    id: Ulid,
    generation: u64,
    key: String,
    layers: Vec<StoredLayer>,
}

impl Drop for Upload<'_> {
    fn drop(&mut self) {
        lock(&self.store.writing).remove(&self.key);
    }
}

impl Upload<'_> {
    /// Uploads the next layer: `produce` writes an uncompressed OCI layer
    /// tar (on a blocking thread), which is compressed, hashed and sent
    /// in parts as it is made; nothing is spooled to disk.
    pub async fn put_layer(
        &mut self,
        produce: impl FnOnce(&mut dyn Write) -> io::Result<()> + Send + 'static,
    ) -> Result<StoredLayer, CoreError> {
        let object = format!("layer-{}.tar.zst", self.layers.len());
        let path = self
            .store
            .data_of(self.id, self.generation)
            .join(object.as_str());
        let (digest, size, diff_id, tar_bytes) = self.store.upload(&path, produce).await?;
        let layer = StoredLayer {
            object,
            digest,
            diff_id,
            size,
            tar_bytes,
            key: None,
            shared: false,
        };
        self.layers.push(layer.clone());
        Ok(layer)
    }

    /// Adds this node's layer `key` (one below the run's disk) as a layer
    /// the store's checkpoints share: uploaded only when the store does not
    /// have it yet. `produce` writes its tar, the same bytes every time
    /// for the same layer (it is hashed first, the first time this daemon
    /// needs it, to find its name).
    pub async fn put_shared_layer(
        &mut self,
        key: &str,
        produce: impl Fn(&mut dyn Write) -> io::Result<()> + Send + Sync + Clone + 'static,
    ) -> Result<StoredLayer, CoreError> {
        let store = self.store;
        let known = lock(&store.shared).get(key).cloned();
        let layer = match known {
            Some(layer) => layer,
            None => {
                let (digest, size, diff_id, tar_bytes) = store.hash(produce.clone()).await?;
                let object = shared_object_name(&digest)
                    .ok_or_else(|| CoreError::Store(format!("a layer digest {digest:?}")))?;
                StoredLayer {
                    object,
                    digest,
                    diff_id,
                    size,
                    tar_bytes,
                    key: Some(key.to_owned()),
                    shared: true,
                }
            }
        };
        // Marked before it is looked for: the sweep keeps a layer a
        // generation marks, committed or being written.
        self.mark(&layer).await?;
        if !store.has_shared(&layer).await? {
            // Written under a name of its own, and put in place only when
            // its bytes are the ones its name says.
            let staged = store
                .root
                .clone()
                .join("layers")
                .join(format!("staged-{}.tar.zst", Ulid::new()));
            let (digest, ..) = store.upload(&staged, produce).await?;
            if digest != layer.digest {
                lock(&store.shared).remove(key);
                let _ = store.objects.delete(&staged).await;
                return Err(CoreError::Store(format!(
                    "layer {key} wrote other bytes on a second reading ({digest}, not {})",
                    layer.digest
                )));
            }
            let doing = "storing a shared checkpoint layer";
            let placed = store
                .objects
                .copy(&staged, &store.shared_of(&layer.object))
                .await
                .map_err(store.unavailable(doing));
            let _ = store.objects.delete(&staged).await;
            placed?;
        }
        lock(&store.shared).insert(key.to_owned(), layer.clone());
        self.layers.push(layer.clone());
        Ok(layer)
    }

    /// Marks shared layer `layer` as used by this generation.
    async fn mark(&self, layer: &StoredLayer) -> Result<(), CoreError> {
        let store = self.store;
        let mark = store.refs_of(&layer.object).join(format!(
            "{}-{}",
            self.id,
            generation_name(self.generation)
        ));
        store
            .objects
            .put(&mark, PutPayload::from_static(b""))
            .await
            .map(|_| ())
            .map_err(store.unavailable("marking a shared checkpoint layer"))
    }

    /// The layers uploaded so far, in order.
    pub fn layers(&self) -> &[StoredLayer] {
        &self.layers
    }

    /// Leaves the last layer uploaded out of the record (an empty one: the
    /// same empty layer twice in a stack is a stack overlayfs refuses to
    /// mount); its object goes with the generation.
    pub fn forget_last(&mut self) {
        self.layers.pop();
    }

    /// Writes the record, then the commit object that makes the generation
    /// exist, then removes the generations before it.
    pub async fn commit(
        self,
        record: &CheckpointRecord,
        mut checkpoint: runbox_types::Checkpoint,
    ) -> Result<Commit, CoreError> {
        let store = self.store;
        // A shared layer this generation found in the store before a sweep
        // that had not seen its mark removed it: refused, not committed
        // without it.
        for layer in self.layers.iter().filter(|l| l.shared) {
            // Marked again first: a sweep on another node drops marks of
            // uncommitted generations an hour old (a long upload).
            self.mark(layer).await?;
            if !store.has_shared(layer).await? {
                lock(&store.shared).retain(|_, known| known.object != layer.object);
                return Err(CoreError::Conflict {
                    code: ErrorCode::CheckpointStoreUnavailable,
                    message: format!(
                        "shared layer {} left the checkpoint store while the checkpoint was written; try again",
                        layer.object
                    ),
                });
            }
        }
        let record_bytes = serde_json::to_vec_pretty(record)
            .map_err(|e| CoreError::Store(format!("encoding a checkpoint record: {e}")))?;
        let data = store.data_of(self.id, self.generation);
        checkpoint.stored_bytes =
            self.layers.iter().map(|l| l.size).sum::<u64>() + record_bytes.len() as u64;
        checkpoint.expires_at = None;
        let commit = Commit {
            version: FORMAT_VERSION,
            generation: self.generation,
            checkpoint,
            record_digest: sha256_of(&record_bytes),
            record_bytes: record_bytes.len() as u64,
        };
        let doing = "committing a checkpoint";
        store
            .objects
            .put(&data.join("record.json"), PutPayload::from(record_bytes))
            .await
            .map_err(store.unavailable(doing))?;
        let commit_bytes = serde_json::to_vec_pretty(&commit)
            .map_err(|e| CoreError::Store(format!("encoding a checkpoint commit: {e}")))?;
        let path = store
            .commits_of(self.id)
            .join(format!("{}.json", generation_name(self.generation)).as_str());
        store
            .objects
            .put(&path, PutPayload::from(commit_bytes))
            .await
            .map_err(store.unavailable(doing))?;
        // Older generations stay readable for SUPERSEDED_GRACE (a restore
        // from one may be under way on another node sharing the store);
        // the sweep removes them after that.
        Ok(commit)
    }

    /// Removes what this generation uploaded (a failed checkpoint); what
    /// cannot be removed now is left to the sweep.
    pub async fn abandon(self) {
        let _ = self.store.remove_data(self.id, self.generation).await;
    }
}

/// Reads `s3://bucket[/prefix]` and the AWS environment (`env`) into a
/// client builder and the key prefix.
///
/// Credentials and region come from the standard AWS variables and
/// credential chain as `object_store` reads them (`AWS_ACCESS_KEY_ID`,
/// `AWS_SECRET_ACCESS_KEY`, `AWS_SESSION_TOKEN`, `AWS_REGION` or
/// `AWS_DEFAULT_REGION`, web identity, container and instance
/// credentials), never from runbox's own flags. The endpoint is
/// `AWS_ENDPOINT_URL_S3` or `AWS_ENDPOINT_URL` (AWS itself when neither is
/// set); one that is an IP address or has a port gets path-style requests,
/// any other virtual-hosted ones, and plain `http://` is accepted only for
/// a loopback endpoint.
pub fn s3_builder(
    location: &str,
    env: &dyn Fn(&str) -> Option<String>,
) -> Result<(object_store::aws::AmazonS3Builder, String), String> {
    use object_store::aws::{AmazonS3Builder, AmazonS3ConfigKey};
    let rest = location
        .strip_prefix("s3://")
        .ok_or_else(|| format!("checkpoint store {location:?}: not an s3:// URL"))?;
    let (bucket, prefix) = rest.split_once('/').unwrap_or((rest, ""));
    let bucket_ok = (3..=63).contains(&bucket.len())
        && bucket
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'.')
        && !bucket.starts_with(['-', '.'])
        && !bucket.ends_with(['-', '.']);
    if !bucket_ok {
        return Err(format!(
            "checkpoint store {location:?}: {bucket:?} is not a bucket name (3-63 lowercase letters, digits, '-' and '.')"
        ));
    }
    let prefix = prefix.trim_matches('/');
    if prefix
        .split('/')
        .any(|p| p.is_empty() && !prefix.is_empty())
        || prefix.split('/').any(|p| p == "." || p == "..")
        || prefix.chars().any(|c| c.is_control())
    {
        return Err(format!(
            "checkpoint store {location:?}: the prefix must be plain path segments"
        ));
    }
    let mut builder = AmazonS3Builder::new().with_bucket_name(bucket);
    // The credential chain's own variables, as object_store names them.
    for (var, key) in [
        ("AWS_ACCESS_KEY_ID", AmazonS3ConfigKey::AccessKeyId),
        ("AWS_SECRET_ACCESS_KEY", AmazonS3ConfigKey::SecretAccessKey),
        ("AWS_SESSION_TOKEN", AmazonS3ConfigKey::Token),
        ("AWS_DEFAULT_REGION", AmazonS3ConfigKey::DefaultRegion),
        ("AWS_REGION", AmazonS3ConfigKey::Region),
        (
            "AWS_WEB_IDENTITY_TOKEN_FILE",
            AmazonS3ConfigKey::WebIdentityTokenFile,
        ),
        ("AWS_ROLE_ARN", AmazonS3ConfigKey::RoleArn),
        ("AWS_ROLE_SESSION_NAME", AmazonS3ConfigKey::RoleSessionName),
        (
            "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI",
            AmazonS3ConfigKey::ContainerCredentialsRelativeUri,
        ),
    ] {
        if let Some(value) = env(var).filter(|v| !v.is_empty()) {
            builder = builder.with_config(key, value);
        }
    }
    let endpoint = env("AWS_ENDPOINT_URL_S3")
        .filter(|v| !v.is_empty())
        .or_else(|| env("AWS_ENDPOINT_URL").filter(|v| !v.is_empty()));
    match endpoint {
        None => {
            builder = builder.with_virtual_hosted_style_request(true);
        }
        Some(endpoint) => {
            let url = url::Url::parse(&endpoint)
                .map_err(|e| format!("AWS_ENDPOINT_URL {endpoint:?} is not a URL: {e}"))?;
            let host = url
                .host()
                .ok_or_else(|| format!("AWS_ENDPOINT_URL {endpoint:?} has no host"))?;
            if !matches!(url.path(), "" | "/")
                || url.query().is_some()
                || !url.username().is_empty()
            {
                return Err(format!(
                    "AWS_ENDPOINT_URL {endpoint:?}: give only scheme, host and port"
                ));
            }
            let loopback = match &host {
                url::Host::Ipv4(ip) => ip.is_loopback(),
                url::Host::Ipv6(ip) => ip.is_loopback(),
                url::Host::Domain(name) => *name == "localhost",
            };
            match url.scheme() {
                "https" => {}
                "http" if loopback => builder = builder.with_allow_http(true),
                "http" => {
                    return Err(format!(
                        "AWS_ENDPOINT_URL {endpoint:?}: plain http is accepted only for a loopback endpoint; use https"
                    ))
                }
                other => {
                    return Err(format!(
                        "AWS_ENDPOINT_URL {endpoint:?}: scheme {other:?} is neither http nor https"
                    ))
                }
            }
            let by_address = !matches!(host, url::Host::Domain(_)) || url.port().is_some();
            let base = endpoint.trim_end_matches('/');
            builder = if by_address || loopback {
                builder
                    .with_endpoint(base)
                    .with_virtual_hosted_style_request(false)
            } else {
                // Virtual-hosted: the bucket is part of the host name.
                builder
                    .with_endpoint(format!("{}://{bucket}.{host}", url.scheme()))
                    .with_virtual_hosted_style_request(true)
            };
        }
    }
    if env("AWS_REGION").is_none() && env("AWS_DEFAULT_REGION").is_none() {
        builder = builder.with_region("us-east-1");
    }
    // A store that is down answers within seconds, so a create or an
    // archive can say so (and be retried) instead of hanging for minutes.
    let allow_http = builder
        .get_config_value(&AmazonS3ConfigKey::Client(
            object_store::ClientConfigKey::AllowHttp,
        ))
        .is_some_and(|v| v == "true");
    builder = builder
        .with_retry(object_store::RetryConfig {
            backoff: object_store::BackoffConfig {
                init_backoff: Duration::from_millis(200),
                max_backoff: Duration::from_secs(5),
                base: 2.0,
            },
            max_retries: 5,
            retry_timeout: Duration::from_secs(20),
        })
        .with_client_options(
            object_store::ClientOptions::new()
                .with_connect_timeout(Duration::from_secs(5))
                .with_timeout(Duration::from_secs(300))
                .with_allow_http(allow_http),
        );
    Ok((builder, prefix.to_owned()))
}

/// [`CheckpointStore::read_layer`] from a directory store: the file read in
/// pieces of [`CHUNK`] on this thread (the caller's sink blocks anyway).
/// `object_store`'s local reader streams 8 KiB at a time, each on a
/// blocking task of its own, which made a restore from a directory slower
/// than one from a bucket on loopback.
fn read_local_layer(
    file: &std::path::Path,
    id: Ulid,
    layer: &StoredLayer,
    mut sink: impl FnMut(&[u8]) -> io::Result<()>,
) -> Result<(), CoreError> {
    use std::io::Read;
    let mut read = || -> Result<(), CoreError> {
        let mut f = match std::fs::File::open(file) {
            Ok(f) => f,
            Err(e) if e.kind() == io::ErrorKind::NotFound => {
                return Err(corrupt(
                    id,
                    format!("its layer {} is missing", layer.object),
                ))
            }
            Err(e) => return Err(CoreError::io(format!("reading {}", file.display()))(e)),
        };
        let size = f
            .metadata()
            .map_err(CoreError::io(format!("reading {}", file.display())))?
            .len();
        if size != layer.size {
            return Err(corrupt(
                id,
                format!(
                    "its layer {} is {size} bytes; the record says {}",
                    layer.object, layer.size
                ),
            ));
        }
        let mut buf = vec![0u8; CHUNK];
        loop {
            let n = match f.read(&mut buf) {
                Ok(0) => return Ok(()),
                Ok(n) => n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(CoreError::io(format!("reading {}", file.display()))(e)),
            };
            sink(&buf[..n])
                .map_err(|e| corrupt(id, format!("its layer {} was refused: {e}", layer.object)))?;
        }
    };
    match tokio::runtime::Handle::try_current() {
        Ok(h) if h.runtime_flavor() == tokio::runtime::RuntimeFlavor::MultiThread => {
            tokio::task::block_in_place(read)
        }
        _ => read(),
    }
}

/// What an interrupted upload leaves in a directory store and no listing
/// shows: staging files of unfinished multipart uploads (`<object>#<n>`)
/// and empty directories, older than `cutoff` and not being written.
/// Returns how many generations it emptied. Blocking.
fn sweep_staging(
    data: &std::path::Path,
    cutoff: OffsetDateTime,
    writing: &HashSet<String>,
) -> usize {
    let old = |meta: &std::fs::Metadata| {
        meta.modified()
            .map(OffsetDateTime::from)
            .is_ok_and(|m| m < cutoff)
    };
    let mut emptied = 0;
    let Ok(ids) = std::fs::read_dir(data) else {
        return 0;
    };
    for id in ids.flatten() {
        let id_settled = id.metadata().is_ok_and(|m| old(&m));
        let Ok(generations) = std::fs::read_dir(id.path()) else {
            continue;
        };
        for generation in generations.flatten() {
            let key = format!(
                "{}/{}",
                id.file_name().to_string_lossy(),
                generation.file_name().to_string_lossy()
            );
            if writing.contains(&key) {
                continue;
            }
            // A directory made just now is an upload starting.
            let settled = generation.metadata().is_ok_and(|m| old(&m));
            let mut removed = false;
            for file in std::fs::read_dir(generation.path())
                .into_iter()
                .flatten()
                .flatten()
            {
                let staged = file.file_name().to_string_lossy().contains('#');
                if staged && file.metadata().is_ok_and(|m| old(&m)) {
                    removed |= std::fs::remove_file(file.path()).is_ok();
                }
            }
            // Only empty directories go.
            if settled && std::fs::remove_dir(generation.path()).is_ok() && removed {
                emptied += 1;
            }
        }
        if id_settled {
            let _ = std::fs::remove_dir(id.path());
        }
    }
    emptied
}

fn generation_name(generation: u64) -> String {
    format!("{generation:020}")
}

/// `<commits>/<id>/<generation>.json` → (id, generation).
fn parse_commit_path(prefix: &ObjectPath, path: &ObjectPath) -> Option<(Ulid, u64)> {
    let mut parts = path.prefix_match(prefix)?;
    let id = parts.next()?.as_ref().parse::<Ulid>().ok()?;
    let file = parts.next()?;
    let generation = file.as_ref().strip_suffix(".json")?.parse::<u64>().ok()?;
    parts.next().is_none().then_some((id, generation))
}

/// `<data>/<id>/<generation>/<object>` → (id, generation).
fn parse_data_path(prefix: &ObjectPath, path: &ObjectPath) -> Option<(Ulid, u64)> {
    let mut parts = path.prefix_match(prefix)?;
    let id = parts.next()?.as_ref().parse::<Ulid>().ok()?;
    let generation = parts.next()?.as_ref().parse::<u64>().ok()?;
    Some((id, generation))
}

/// The object name of a shared layer whose blob has `digest`.
fn shared_object_name(digest: &str) -> Option<String> {
    let hex = digest.strip_prefix("sha256:")?;
    (hex.len() == 64
        && hex
            .bytes()
            .all(|b| b.is_ascii_hexdigit() && !b.is_ascii_uppercase()))
    .then(|| format!("{hex}.tar.zst"))
}

/// A layer object's name as this daemon writes them.
fn valid_object_name(name: &str) -> bool {
    name.strip_prefix("layer-")
        .and_then(|n| n.strip_suffix(".tar.zst"))
        .is_some_and(|n| !n.is_empty() && n.len() <= 4 && n.bytes().all(|b| b.is_ascii_digit()))
}

pub(crate) fn not_found(id: Ulid) -> CoreError {
    CoreError::invalid(
        ErrorCode::CheckpointNotFound,
        format!("no checkpoint with id {id} in the checkpoint store"),
    )
}

fn corrupt(id: Ulid, why: impl std::fmt::Display) -> CoreError {
    CoreError::invalid(
        ErrorCode::CheckpointCorrupt,
        format!("checkpoint {id} is damaged and was not used: {why}"),
    )
}

/// An `object_store` error with its causes, which say what the store
/// answered.
fn error_text(e: &object_store::Error) -> String {
    let mut text = e.to_string();
    let mut source = std::error::Error::source(e);
    while let Some(s) = source {
        let more = s.to_string();
        if !text.contains(&more) {
            text.push_str(": ");
            text.push_str(&more);
        }
        source = s.source();
    }
    text
}

fn sha256_of(bytes: &[u8]) -> String {
    format!("sha256:{}", hex(&Sha256::digest(bytes)))
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// A writer that hashes and counts what passes through it.
struct HashingWriter<W> {
    inner: W,
    hasher: Sha256,
    count: u64,
}

impl<W> HashingWriter<W> {
    fn new(inner: W) -> Self {
        HashingWriter {
            inner,
            hasher: Sha256::new(),
            count: 0,
        }
    }

    fn digest(&self) -> String {
        format!("sha256:{}", hex(&self.hasher.clone().finalize()))
    }
}

impl<W: Write> Write for HashingWriter<W> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        let n = self.inner.write(buf)?;
        self.hasher.update(&buf[..n]);
        self.count += n as u64;
        Ok(n)
    }
    fn flush(&mut self) -> io::Result<()> {
        self.inner.flush()
    }
}

/// Hands what is written to the uploader in [`CHUNK`]-sized pieces; a
/// write fails once the uploader has stopped.
struct ChunkWriter {
    tx: tokio::sync::mpsc::Sender<Bytes>,
    buf: Vec<u8>,
}

impl ChunkWriter {
    fn send(&mut self) -> io::Result<()> {
        let chunk = Bytes::from(std::mem::replace(&mut self.buf, Vec::with_capacity(CHUNK)));
        self.tx
            .blocking_send(chunk)
            .map_err(|_| io::Error::new(io::ErrorKind::BrokenPipe, "the upload stopped"))
    }

    fn send_rest(&mut self) -> io::Result<()> {
        if self.buf.is_empty() {
            return Ok(());
        }
        self.send()
    }
}

impl Write for ChunkWriter {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        let room = CHUNK - self.buf.len();
        let n = buf.len().min(room);
        self.buf.extend_from_slice(&buf[..n]);
        if self.buf.len() == CHUNK {
            self.send()?;
        }
        Ok(n)
    }
    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use object_store::aws::AmazonS3ConfigKey;

    fn env(vars: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let map: HashMap<String, String> = vars
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        move |k| map.get(k).cloned()
    }

    fn endpoint_of(b: &object_store::aws::AmazonS3Builder) -> (Option<String>, bool, bool) {
        (
            b.get_config_value(&AmazonS3ConfigKey::Endpoint),
            b.get_config_value(&AmazonS3ConfigKey::VirtualHostedStyleRequest)
                .is_some_and(|v| v == "true"),
            b.get_config_value(&AmazonS3ConfigKey::Client(
                object_store::ClientConfigKey::AllowHttp,
            ))
            .is_some_and(|v| v == "true"),
        )
    }

    #[test]
    fn endpoints_pick_their_addressing_style() {
        let (b, prefix) = s3_builder(
            "s3://runbox/ckpt/node-1/",
            &env(&[("AWS_ENDPOINT_URL", "http://127.0.0.1:9000")]),
        )
        .unwrap();
        assert_eq!(prefix, "ckpt/node-1");
        assert_eq!(
            endpoint_of(&b),
            (Some("http://127.0.0.1:9000".into()), false, true)
        );
        // An address or a port: path-style; https, so no plain http.
        let (b, _) = s3_builder(
            "s3://runbox",
            &env(&[("AWS_ENDPOINT_URL", "https://store.example:8443")]),
        )
        .unwrap();
        assert_eq!(
            endpoint_of(&b),
            (Some("https://store.example:8443".into()), false, false)
        );
        // A plain host name: virtual-hosted, the bucket in the host.
        let (b, _) = s3_builder(
            "s3://runbox",
            &env(&[("AWS_ENDPOINT_URL", "https://s3.example.com")]),
        )
        .unwrap();
        assert_eq!(
            endpoint_of(&b),
            (Some("https://runbox.s3.example.com".into()), true, false)
        );
        // The S3-specific variable wins.
        let (b, _) = s3_builder(
            "s3://runbox",
            &env(&[
                ("AWS_ENDPOINT_URL", "https://other.example"),
                ("AWS_ENDPOINT_URL_S3", "http://[::1]:9000"),
            ]),
        )
        .unwrap();
        assert_eq!(endpoint_of(&b).0.as_deref(), Some("http://[::1]:9000"));
        // AWS itself.
        let (b, _) = s3_builder("s3://runbox", &env(&[])).unwrap();
        assert_eq!(endpoint_of(&b), (None, true, false));
    }

    #[test]
    fn bad_locations_and_endpoints_are_refused() {
        for (location, vars) in [
            ("s3://", vec![]),
            ("s3://Upper", vec![]),
            ("s3://ab", vec![]),
            ("s3://bucket/a/../b", vec![]),
            ("s3://bucket/a//b", vec![]),
            (
                "s3://bucket",
                vec![("AWS_ENDPOINT_URL", "http://10.0.0.5:9000")],
            ),
            (
                "s3://bucket",
                vec![("AWS_ENDPOINT_URL", "http://store.example")],
            ),
            ("s3://bucket", vec![("AWS_ENDPOINT_URL", "ftp://127.0.0.1")]),
            (
                "s3://bucket",
                vec![("AWS_ENDPOINT_URL", "https://h.example/path")],
            ),
            ("s3://bucket", vec![("AWS_ENDPOINT_URL", "not a url")]),
        ] {
            assert!(
                s3_builder(location, &env(&vars)).is_err(),
                "{location} {vars:?} was accepted"
            );
        }
    }

    #[test]
    fn paths_parse_back() {
        let root = ObjectPath::from("pre/fix");
        let id = Ulid::new();
        let commits = root.clone().join("commits");
        let path = commits
            .clone()
            .join(id.to_string())
            .join(format!("{}.json", generation_name(7)).as_str());
        assert_eq!(parse_commit_path(&commits, &path), Some((id, 7)));
        let data = root.clone().join("data");
        let path = data
            .clone()
            .join(id.to_string())
            .join(generation_name(3))
            .join("layer-0.tar.zst");
        assert_eq!(parse_data_path(&data, &path), Some((id, 3)));
        assert_eq!(parse_commit_path(&commits, &root.join("x")), None);
        assert!(valid_object_name("layer-12.tar.zst"));
        assert!(!valid_object_name("../record.json"));
        assert!(!valid_object_name("layer-.tar.zst"));
    }

    /// A generation's record and the summary its commit shows, for tests.
    fn described(
        id: Ulid,
        generation: u64,
        layers: Vec<StoredLayer>,
        disk_bytes: u64,
    ) -> (CheckpointRecord, runbox_types::Checkpoint) {
        let record = CheckpointRecord {
            version: FORMAT_VERSION,
            id,
            generation,
            run: Ulid::new(),
            image: "base".into(),
            pull: None,
            base: vec![],
            layers,
            config: serde_json::json!({}),
            settings: Default::default(),
        };
        let summary = runbox_types::Checkpoint {
            id,
            run: record.run,
            image: "base".into(),
            created_at: OffsetDateTime::now_utc(),
            expires_at: None,
            stored_bytes: 0,
            disk_bytes,
            labels: Default::default(),
            server: "test".into(),
            tenant: None,
            volumes_excluded: Vec::new(),
            secrets_excluded: Vec::new(),
        };
        (record, summary)
    }

    /// A generation a newer one superseded stays whole (commit and data)
    /// for [`SUPERSEDED_GRACE`] after the newer one's commit, then goes;
    /// the newest is what readers see throughout.
    #[tokio::test(flavor = "multi_thread")]
    async fn a_superseded_generation_stays_readable_for_its_grace() {
        let dir = tempfile::tempdir().unwrap();
        let store = CheckpointStore::open(dir.path().to_str().unwrap()).unwrap();
        let id = Ulid::new();
        for generation in [1, 2] {
            let mut upload = store.begin(id, generation);
            let layer = upload
                .put_layer(move |out| out.write_all(&[generation as u8; 1000]))
                .await
                .unwrap();
            let (record, summary) =
                described(id, generation, upload.layers().to_vec(), layer.tar_bytes);
            upload.commit(&record, summary).await.unwrap();
        }
        let first = dir.path().join(format!("data/{id}/{}", generation_name(1)));
        let first_commit = dir
            .path()
            .join(format!("commits/{id}/{}.json", generation_name(1)));
        assert!(first.exists() && first_commit.exists());
        assert_eq!(store.get(id).await.unwrap().generation, 2);
        // Within the grace: nothing goes.
        let soon = OffsetDateTime::now_utc() + SUPERSEDED_GRACE - Duration::from_secs(60);
        assert_eq!(store.sweep(soon, None).await.unwrap(), Swept::default());
        assert!(first.exists() && first_commit.exists());
        assert_eq!(store.get(id).await.unwrap().generation, 2);
        // Past it: the superseded generation goes, the newest stays.
        let later = OffsetDateTime::now_utc() + SUPERSEDED_GRACE + Duration::from_secs(60);
        store.sweep(later, None).await.unwrap();
        assert!(!first.exists() && !first_commit.exists());
        assert!(dir
            .path()
            .join(format!("data/{id}/{}", generation_name(2)))
            .exists());
        assert_eq!(store.get(id).await.unwrap().generation, 2);
        assert_eq!(store.list().await.unwrap().len(), 1);
    }

    /// A layer below the disk is stored once for every checkpoint that
    /// needs it (the second one neither hashes nor uploads it again), reads
    /// back through each, and goes with the sweep once no checkpoint uses
    /// it.
    #[tokio::test(flavor = "multi_thread")]
    async fn checkpoints_share_a_base_layer_until_neither_uses_it() {
        let dir = tempfile::tempdir().unwrap();
        let store = CheckpointStore::open(dir.path().to_str().unwrap()).unwrap();
        let base = |out: &mut dyn Write| out.write_all(&[7u8; 50_000]);
        let (a, b) = (Ulid::new(), Ulid::new());
        let mut objects = Vec::new();
        for (n, id) in [a, b].into_iter().enumerate() {
            let mut upload = store.begin(id, 1);
            let shared = match n {
                0 => upload.put_shared_layer("sha256:base", base).await.unwrap(),
                // Known already: its tar is not read again.
                _ => upload
                    .put_shared_layer("sha256:base", |_: &mut dyn Write| {
                        Err(io::Error::other("read again"))
                    })
                    .await
                    .unwrap(),
            };
            assert!(shared.shared && shared.key.as_deref() == Some("sha256:base"));
            objects.push(shared.object.clone());
            let disk = upload
                .put_layer(move |out| out.write_all(&[n as u8; 1000]))
                .await
                .unwrap();
            let (record, summary) = described(id, 1, upload.layers().to_vec(), disk.tar_bytes);
            upload.commit(&record, summary).await.unwrap();
        }
        assert_eq!(objects[0], objects[1]);
        let blob = dir.path().join("layers").join(&objects[0]);
        assert!(blob.exists());
        // Each generation's own data holds its disk alone.
        for id in [a, b] {
            let own =
                std::fs::read_dir(dir.path().join(format!("data/{id}/{}", generation_name(1))))
                    .unwrap()
                    .count();
            assert_eq!(own, 2, "a disk layer and a record");
            let record = store.record(&store.get(id).await.unwrap()).await.unwrap();
            let mut read = Vec::new();
            store
                .read_layer(&record, &record.layers[0], |chunk| {
                    read.extend_from_slice(chunk);
                    Ok(())
                })
                .await
                .unwrap();
            let mut tar = Vec::new();
            std::io::Read::read_to_end(
                &mut zstd::stream::read::Decoder::new(&read[..]).unwrap(),
                &mut tar,
            )
            .unwrap();
            assert_eq!(tar, [7u8; 50_000]);
        }
        let later = OffsetDateTime::now_utc() + ORPHAN_AGE + Duration::from_secs(60);
        assert_eq!(store.sweep(later, None).await.unwrap().shared, 0);
        store.delete(a).await.unwrap();
        assert_eq!(store.sweep(later, None).await.unwrap().shared, 0);
        assert!(blob.exists(), "b still uses it");
        store.delete(b).await.unwrap();
        assert_eq!(store.sweep(later, None).await.unwrap().shared, 1);
        assert!(!blob.exists());
        // Its marks went with it.
        let left = std::fs::read_dir(dir.path().join("layers"))
            .into_iter()
            .flatten()
            .flatten()
            .filter(|e| std::fs::read_dir(e.path()).map_or(true, |mut d| d.next().is_some()))
            .count();
        assert_eq!(left, 0);
        // A record naming a shared object that is not its digest's is refused.
        assert_eq!(shared_object_name("sha256:AB"), None);
    }

    /// A checkpoint written to a directory store reads back whole; a
    /// changed byte in a layer or in the record is refused; an uncommitted
    /// generation is invisible, and the sweep removes it once it is old.
    #[tokio::test(flavor = "multi_thread")]
    async fn directory_store_round_trip_and_refusals() {
        let dir = tempfile::tempdir().unwrap();
        let store = CheckpointStore::open(dir.path().to_str().unwrap()).unwrap();
        let id = Ulid::new();
        let mut upload = store.begin(id, 1);
        let payload: Vec<u8> = (0..3_000_000u32).map(|i| (i % 251) as u8).collect();
        let written = payload.clone();
        let layer = upload
            .put_layer(move |out| out.write_all(&written))
            .await
            .unwrap();
        assert_eq!(layer.tar_bytes, payload.len() as u64);
        assert_eq!(layer.diff_id, sha256_of(&payload));
        let (record, summary) = described(id, 1, upload.layers().to_vec(), layer.tar_bytes);
        // Not committed yet: nothing to see.
        assert!(store.list().await.unwrap().is_empty());
        let commit = upload.commit(&record, summary).await.unwrap();
        assert_eq!(store.list().await.unwrap(), vec![commit.clone()]);
        let read = store.record(&store.get(id).await.unwrap()).await.unwrap();
        assert_eq!(
            serde_json::to_value(&read).unwrap(),
            serde_json::to_value(&record).unwrap()
        );
        let mut back = Vec::new();
        store
            .read_layer(&read, &read.layers[0], |chunk| {
                back.extend_from_slice(chunk);
                Ok(())
            })
            .await
            .unwrap();
        let mut unpacked = Vec::new();
        zstd::stream::copy_decode(&back[..], &mut unpacked).unwrap();
        assert_eq!(unpacked, payload);
        assert_eq!(sha256_of(&back), read.layers[0].digest);

        // A changed record is refused.
        let record_path = dir
            .path()
            .join(format!("data/{id}/{}/record.json", generation_name(1)));
        let original = std::fs::read(&record_path).unwrap();
        let mut tampered = original.clone();
        let at = tampered.iter().position(|&b| b == b'b').unwrap();
        tampered[at] = b'c';
        std::fs::write(&record_path, &tampered).unwrap();
        let e = store.record(&commit).await.unwrap_err();
        assert_eq!(e.code(), ErrorCode::CheckpointCorrupt, "{e}");
        std::fs::write(&record_path, &original).unwrap();
        // A truncated layer is refused before a byte reaches the sink.
        let layer_path = record_path.with_file_name("layer-0.tar.zst");
        std::fs::write(&layer_path, &back[..back.len() / 2]).unwrap();
        let e = store
            .read_layer(&read, &read.layers[0], |_| panic!("read a truncated layer"))
            .await
            .unwrap_err();
        assert_eq!(e.code(), ErrorCode::CheckpointCorrupt, "{e}");

        // An uncommitted generation: invisible, kept while young or being
        // written, removed once old.
        let other = Ulid::new();
        let mut upload = store.begin(other, 1);
        upload.put_layer(|out| out.write_all(b"x")).await.unwrap();
        assert_eq!(store.list().await.unwrap().len(), 1);
        let later = OffsetDateTime::now_utc() + ORPHAN_AGE + Duration::from_secs(60);
        assert_eq!(store.sweep(later, None).await.unwrap(), Swept::default());
        drop(upload);
        let now = OffsetDateTime::now_utc();
        assert_eq!(store.sweep(now, None).await.unwrap(), Swept::default());
        assert_eq!(
            store.sweep(later, None).await.unwrap(),
            Swept {
                expired: 0,
                orphans: 1,
                shared: 0
            }
        );
        assert!(!dir.path().join(format!("data/{other}")).exists());
        // The TTL sweep removes the committed one.
        assert_eq!(
            store
                .sweep(later, Some(Duration::from_secs(3600)))
                .await
                .unwrap(),
            Swept {
                expired: 1,
                orphans: 0,
                shared: 0
            }
        );
        assert!(store.list().await.unwrap().is_empty());
        assert_eq!(
            store.delete(id).await.unwrap_err().code(),
            ErrorCode::CheckpointNotFound
        );
    }
}
