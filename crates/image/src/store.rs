//! The content-addressed layer store and the image records that point into it.
//!
//! Layout under the store's root:
//!
//! ```text
//! layers/<hex>/        one unpacked layer (an overlayfs lower dir), named by
//!                      its diff_id: the sha256 of the uncompressed tar
//! layers/<hex>.json    the layer's metadata, written last: a layer directory
//!                      without it is an interrupted unpack, never used
//! blobs/<hex>          a blob digest (as distributed: gzip, zstd or plain)
//!                      -> the diff_id of the layer it unpacked to
//! images/<name>.json   an image: its config and its ordered layer digests
//! tmp/                 work in progress; emptied at open
//! layers/local-<id>.json  a *local layer*'s metadata (see below)
//! ```
//!
//! A **local layer** (key `local:<id>`, a ULID) is a directory kept outside
//! this store, under the local root its owner names
//! ([`Store::set_local_root`]): `<local root>/<id>/upper`, an overlayfs
//! upper directory used as a lower one (whiteouts and opaque directories
//! as overlayfs wrote them). A run snapshot becomes one without writing a
//! tar: the run store snapshots the run's disk in constant time and the
//! store records it. It has no digest until something needs one; its
//! metadata, written once the directory is in place, is the commit point,
//! and [`Store::gc`] hands unused ones back to their owner to delete.
//!
//! Layers are keyed by diff_id, so the same content compressed differently
//! (a registry's gzip and a `docker save` tar, or two compressors) is
//! unpacked and stored once; the blob index lets a pull or import skip a
//! blob it has seen. Where the image config lists `rootfs.diff_ids`, each
//! layer's is checked against what its blob unpacked to. Stores written
//! before diff_id keying hold layers under their blob digest (their
//! metadata has no `diffId`); those keep working under that name.
//!
//! Every layer is unpacked once and shared read-only by every image and run
//! that uses it. Adding a layer unpacks into `tmp/`, verifies the blob's
//! digest, and renames the result into place; when two imports race for the
//! same layer, the loser's rename fails harmlessly and its copy is dropped.
//! A crash at any point leaves only `tmp/` entries and metadata-less layer
//! directories, both of which `open` removes.
//!
//! Not here: how blobs arrive (see `layout` and `pull`), and anything about
//! runs. The caller keeps images that runs use from being removed.

use std::fs;
use std::io::{self, Read};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use crate::layout::{hex, StagedImage};
use crate::unpack::{self, UnpackLimits};

/// Why a store operation failed.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// A digest is not `sha256:<64 lowercase hex>`.
    #[error("{0:?} is not a sha256 digest")]
    BadDigest(String),
    /// A layer blob is malformed in a way the unpacker does not see.
    #[error("layer {digest}: {why}")]
    BadLayer {
        /// The layer blob.
        digest: String,
        /// What is wrong.
        why: String,
    },
    /// A layer unpacked to other content than the image config says.
    #[error("layer {blob} unpacks to {actual}, but the image config says {expected}")]
    DiffIdMismatch {
        /// The layer blob.
        blob: String,
        /// The diff_id in the image config.
        expected: String,
        /// What the blob's uncompressed tar hashes to.
        actual: String,
    },
    /// A blob's bytes do not hash to its digest.
    #[error("layer {expected} hashes to {actual}")]
    DigestMismatch {
        /// The digest the blob was announced with.
        expected: String,
        /// What its bytes hash to.
        actual: String,
    },
    /// The layer archive was refused by the unpacker.
    #[error("layer {digest} was refused")]
    Unpack {
        /// The layer.
        digest: String,
        /// The rule it broke.
        #[source]
        source: unpack::UnpackError,
    },
    /// No image of that name.
    #[error("no image named {0:?}")]
    NoImage(String),
    /// An image of that name exists already.
    #[error("an image named {0:?} already exists")]
    Exists(String),
    /// A record on disk does not parse.
    #[error("{path} is corrupt: {message}")]
    Corrupt {
        /// The file.
        path: PathBuf,
        /// The parse error.
        message: String,
    },
    /// File system trouble.
    #[error("{context}")]
    Io {
        /// What was being done.
        context: String,
        /// The cause.
        #[source]
        source: io::Error,
    },
}

fn io_err(context: impl Into<String>) -> impl FnOnce(io::Error) -> StoreError {
    let context = context.into();
    move |source| StoreError::Io { context, source }
}

/// Metadata of one stored layer.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct LayerRecord {
    /// The layer's key in the store and in image records: its diff_id, or
    /// for a layer stored before diff_id keying, its blob's digest.
    pub digest: String,
    /// `sha256:<hex>` of the uncompressed tar, when known.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub diff_id: Option<String>,
    /// Bytes of file data unpacked.
    pub unpacked_bytes: u64,
    /// Entries unpacked.
    pub entries: u64,
}

/// One stored image.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ImageRecord {
    /// Its name in this store.
    pub name: String,
    /// Where it came from (`oci-layout`, `docker-save`, `rootfs`, or a registry reference).
    pub source: String,
    /// The image config (OCI image configuration JSON).
    pub config: serde_json::Value,
    /// Layer digests, base first.
    pub layers: Vec<String>,
    /// Unpacked bytes of all its layers.
    pub size_bytes: u64,
    /// Import time, seconds since the Unix epoch.
    pub created_unix: i64,
    /// The tenant whose snapshot or checkpoint it is; None: shared.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tenant: Option<String>,
    /// Its labels (a snapshot's).
    #[serde(default, skip_serializing_if = "std::collections::BTreeMap::is_empty")]
    pub labels: std::collections::BTreeMap<String, String>,
}

/// The layer and image store.
#[derive(Debug)]
pub struct Store {
    root: PathBuf,
    limits: UnpackLimits,
    tmp_seq: AtomicU64,
    /// Where local layers live, once their owner said.
    local_root: std::sync::OnceLock<PathBuf>,
}

/// The prefix of a local layer's key.
pub const LOCAL_PREFIX: &str = "local:";

/// The id of local layer key `key` (`local:<ULID>`), checked; None for any
/// other key.
pub fn local_id(key: &str) -> Option<&str> {
    let id = key.strip_prefix(LOCAL_PREFIX)?;
    // A ULID in Crockford base32, as `ulid` writes it.
    (id.len() == 26
        && id
            .bytes()
            .all(|b| b.is_ascii_digit() || (b.is_ascii_uppercase() && !b"ILOU".contains(&b))))
    .then_some(id)
}

/// The hex part of a sha256 digest, checked.
pub fn digest_hex(digest: &str) -> Result<&str, StoreError> {
    digest
        .strip_prefix("sha256:")
        .filter(|h| {
            h.len() == 64
                && h.bytes()
                    .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
        })
        .ok_or_else(|| StoreError::BadDigest(digest.to_owned()))
}

impl Store {
    /// Opens the store at `root`, creating it, and clears leftovers of
    /// interrupted work.
    pub fn open(root: PathBuf, limits: UnpackLimits) -> Result<Store, StoreError> {
        for dir in ["layers", "blobs", "images", "tmp"] {
            fs::create_dir_all(root.join(dir))
                .map_err(io_err(format!("creating {}", root.join(dir).display())))?;
        }
        let tmp = root.join("tmp");
        for entry in fs::read_dir(&tmp).map_err(io_err("reading tmp"))?.flatten() {
            let _ = remove_any(&entry.path());
        }
        // A layer directory without its metadata was never finished.
        for entry in fs::read_dir(root.join("layers"))
            .map_err(io_err("reading layers"))?
            .flatten()
        {
            let path = entry.path();
            if path.is_dir() && !path.with_extension("json").exists() {
                tracing::info!(path = %path.display(), "removing an unfinished layer");
                let _ = remove_any(&path);
            }
        }
        Ok(Store {
            root,
            limits,
            tmp_seq: AtomicU64::new(0),
            local_root: std::sync::OnceLock::new(),
        })
    }

    /// Says where local layers live (once; a second call changes nothing
    /// and answers false).
    pub fn set_local_root(&self, dir: PathBuf) -> bool {
        self.local_root.set(dir).is_ok()
    }

    /// Where local layer `id` lives (the directory holding its `upper`).
    pub fn local_layer_path(&self, id: &str) -> Result<PathBuf, StoreError> {
        let root = self.local_root.get().ok_or_else(|| {
            io_err(format!("finding local layer {id}"))(io::Error::new(
                io::ErrorKind::Unsupported,
                "this store has no local layers",
            ))
        })?;
        Ok(root.join(id))
    }

    /// Records local layer `id` (its directory in place under the local
    /// root) with its size: the commit point that makes it count. Blocking.
    pub fn add_local_layer(
        &self,
        id: &str,
        unpacked_bytes: u64,
        entries: u64,
    ) -> Result<LayerRecord, StoreError> {
        let key = format!("{LOCAL_PREFIX}{id}");
        if local_id(&key).is_none() {
            return Err(StoreError::BadDigest(key));
        }
        let dir = self.layer_dir(&key)?;
        if !dir.is_dir() {
            return Err(io_err(format!("recording local layer {id}"))(
                io::Error::new(
                    io::ErrorKind::NotFound,
                    format!("{} is missing", dir.display()),
                ),
            ));
        }
        let record = LayerRecord {
            digest: key.clone(),
            diff_id: None,
            unpacked_bytes,
            entries,
        };
        let meta = self.meta_path(&key)?;
        let bytes = serde_json::to_vec_pretty(&record).map_err(|e| corrupt(&meta, e))?;
        write_atomic(&meta, &bytes)?;
        Ok(record)
    }

    /// Writes local layer `key` to `out` as an OCI layer tar (overlayfs'
    /// whiteouts and opaque directories as `.wh.` entries) and returns its
    /// diff_id, the sha256 of that tar. The first call records the diff_id
    /// in the layer's metadata, so the digest is computed once; the tar is
    /// made only when something needs it (an export, a checkpoint). A
    /// layer's content never changes, so every call writes the same bytes.
    /// Blocking.
    pub fn write_local_layer(&self, key: &str, out: impl io::Write) -> Result<String, StoreError> {
        if local_id(key).is_none() {
            return Err(StoreError::BadDigest(key.to_owned()));
        }
        let mut record = self.layer_record(key)?.ok_or_else(|| {
            io_err(format!("reading layer {key}"))(io::Error::new(
                io::ErrorKind::NotFound,
                "the layer is not stored",
            ))
        })?;
        let mut hashing = HashingWriter {
            inner: out,
            hasher: Sha256::new(),
        };
        crate::capture::upper_to_tar(&self.layer_dir(key)?, &[], &mut hashing)
            .map_err(io_err(format!("writing layer {key} as a tar")))?;
        let diff_id = format!("sha256:{}", hex(&hashing.hasher.finalize()));
        match &record.diff_id {
            Some(known) if *known != diff_id => {
                return Err(StoreError::DiffIdMismatch {
                    blob: key.to_owned(),
                    expected: known.clone(),
                    actual: diff_id,
                })
            }
            Some(_) => {}
            None => {
                record.diff_id = Some(diff_id.clone());
                let meta = self.meta_path(key)?;
                let bytes = serde_json::to_vec_pretty(&record).map_err(|e| corrupt(&meta, e))?;
                write_atomic(&meta, &bytes)?;
            }
        }
        Ok(diff_id)
    }

    /// The diff_id of local layer `key`: recorded, or computed once by
    /// [`Store::write_local_layer`] into nothing. Blocking.
    pub fn local_diff_id(&self, key: &str) -> Result<String, StoreError> {
        match self.layer_record(key)?.and_then(|r| r.diff_id) {
            Some(known) => Ok(known),
            None => self.write_local_layer(key, io::sink()),
        }
    }

    /// The ids of every recorded local layer.
    pub fn local_layers(&self) -> Result<Vec<String>, StoreError> {
        let mut ids: Vec<String> = fs::read_dir(self.root.join("layers"))
            .map_err(io_err("reading layers"))?
            .flatten()
            .filter_map(|e| {
                let name = e.file_name().to_str()?.to_owned();
                let id = name.strip_prefix("local-")?.strip_suffix(".json")?;
                local_id(&format!("{LOCAL_PREFIX}{id}")).map(str::to_owned)
            })
            .collect();
        ids.sort();
        Ok(ids)
    }

    /// Where layer `key`'s metadata is.
    fn meta_path(&self, key: &str) -> Result<PathBuf, StoreError> {
        match local_id(key) {
            Some(id) => Ok(self.root.join("layers").join(format!("local-{id}.json"))),
            None => Ok(self.layer_dir(key)?.with_extension("json")),
        }
    }

    /// A fresh directory under `tmp/`.
    fn tmp_dir(&self) -> Result<PathBuf, StoreError> {
        let n = self.tmp_seq.fetch_add(1, Ordering::Relaxed);
        let dir = self
            .root
            .join("tmp")
            .join(format!("{}-{n}", std::process::id()));
        fs::create_dir(&dir).map_err(io_err(format!("creating {}", dir.display())))?;
        Ok(dir)
    }

    /// The unpacked directory of layer `digest` (for a local layer, its
    /// upper directory under the local root).
    pub fn layer_dir(&self, digest: &str) -> Result<PathBuf, StoreError> {
        if let Some(id) = local_id(digest) {
            return Ok(self.local_layer_path(id)?.join("upper"));
        }
        Ok(self.root.join("layers").join(digest_hex(digest)?))
    }

    /// Whether a layer is stored (finished) under key `digest`, or a blob
    /// with digest `digest` was stored (as the layer it unpacked to).
    pub fn has_layer(&self, digest: &str) -> bool {
        self.layer_key(digest).is_some()
    }

    /// The key of the stored layer that `digest` names: itself when a layer
    /// is stored under it (a diff_id, or a blob digest from before diff_id
    /// keying), else the layer a blob with that digest unpacked to.
    pub fn layer_key(&self, digest: &str) -> Option<String> {
        let finished = |key: &str| self.meta_path(key).is_ok_and(|m| m.is_file());
        if finished(digest) {
            return Some(digest.to_owned());
        }
        if local_id(digest).is_some() {
            return None;
        }
        let key = fs::read_to_string(self.blob_path(digest).ok()?).ok()?;
        let key = key.trim();
        (digest_hex(key).is_ok() && finished(key)).then(|| key.to_owned())
    }

    fn blob_path(&self, digest: &str) -> Result<PathBuf, StoreError> {
        Ok(self.root.join("blobs").join(digest_hex(digest)?))
    }

    /// Stores a layer from its blob (gzip, zstd or plain tar), verifying that
    /// the blob's bytes hash to `digest`; see [`Store::add_layer_checked`].
    pub fn add_layer(&self, digest: &str, blob: impl Read) -> Result<LayerRecord, StoreError> {
        self.add_layer_checked(digest, None, blob)
    }

    /// Stores a layer from its blob (gzip, zstd or plain tar), verifying that
    /// the blob's bytes hash to `digest` and, when the image config names
    /// one, that its uncompressed tar hashes to `diff_id`. The layer is
    /// stored under its diff_id. A blob seen before, or a `diff_id` already
    /// stored, is not read. Blocking.
    pub fn add_layer_checked(
        &self,
        digest: &str,
        diff_id: Option<&str>,
        blob: impl Read,
    ) -> Result<LayerRecord, StoreError> {
        digest_hex(digest)?;
        if let Some(id) = diff_id {
            digest_hex(id)?;
        }
        for known in [Some(digest), diff_id].into_iter().flatten() {
            if let Some(key) = self.layer_key(known) {
                if let Some(existing) = self.layer_record(&key)? {
                    self.index_blob(digest, &key)?;
                    return Ok(existing);
                }
            }
        }
        let work = self.tmp_dir()?;
        let result = self.unpack_verified(digest, diff_id, blob, &work.join("layer"));
        let record = match result {
            Ok(record) => record,
            Err(e) => {
                let _ = remove_any(&work);
                return Err(e);
            }
        };
        let key = record.digest.clone();
        if let Some(existing) = self.layer_record(&key)? {
            // The same content came before in another blob: keep that copy.
            let _ = remove_any(&work);
            self.index_blob(digest, &key)?;
            return Ok(existing);
        }
        let dest = self.layer_dir(&key)?;
        // Rename the directory first, then write the metadata that makes it
        // count; a racing import of the same layer loses the rename and
        // uses the winner's copy.
        match fs::rename(work.join("layer"), &dest) {
            Ok(()) => {}
            Err(_) if dest.is_dir() => {}
            Err(e) => {
                let _ = remove_any(&work);
                return Err(io_err(format!("installing layer {key}"))(e));
            }
        }
        let _ = remove_any(&work);
        let meta = serde_json::to_vec_pretty(&record).map_err(|e| corrupt(&dest, e))?;
        write_atomic(&dest.with_extension("json"), &meta)?;
        self.index_blob(digest, &key)?;
        Ok(record)
    }

    /// Notes that blob `digest` unpacks to layer `key`.
    fn index_blob(&self, digest: &str, key: &str) -> Result<(), StoreError> {
        if digest == key {
            return Ok(());
        }
        write_atomic(&self.blob_path(digest)?, key.as_bytes())
    }

    fn unpack_verified(
        &self,
        digest: &str,
        diff_id: Option<&str>,
        blob: impl Read,
        dir: &Path,
    ) -> Result<LayerRecord, StoreError> {
        fs::create_dir(dir).map_err(io_err(format!("creating {}", dir.display())))?;
        let (stats, actual_diff_id) = unpack_checked(digest, diff_id, blob, dir, &self.limits)?;
        Ok(LayerRecord {
            digest: actual_diff_id.clone(),
            diff_id: Some(actual_diff_id),
            unpacked_bytes: stats.bytes,
            entries: stats.entries,
        })
    }

    /// Unpacked bytes of stored layer `digest`.
    pub fn layer_size(&self, digest: &str) -> Result<u64, StoreError> {
        match self.layer_record(digest)? {
            Some(record) => Ok(record.unpacked_bytes),
            None => Err(io_err(format!("reading layer {digest}"))(io::Error::new(
                io::ErrorKind::NotFound,
                "the layer is not stored",
            ))),
        }
    }

    fn layer_record(&self, digest: &str) -> Result<Option<LayerRecord>, StoreError> {
        let path = self.meta_path(digest)?;
        match fs::read(&path) {
            Ok(bytes) => serde_json::from_slice(&bytes)
                .map(Some)
                .map_err(|e| corrupt(&path, e)),
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(io_err(format!("reading {}", path.display()))(e)),
        }
    }

    /// Stores every layer of a staged image and records it as `name`.
    /// Blocking.
    pub fn import_staged(
        &self,
        name: &str,
        staged: &StagedImage,
        source: &str,
    ) -> Result<ImageRecord, StoreError> {
        if self.image_path(name).exists() {
            return Err(StoreError::Exists(name.to_owned()));
        }
        let config: serde_json::Value =
            serde_json::from_slice(&staged.config).map_err(|e| corrupt(Path::new("config"), e))?;
        let diff_ids = config_diff_ids(&config, staged.layers.len());
        let mut size = 0;
        let mut layers = Vec::with_capacity(staged.layers.len());
        for (i, layer) in staged.layers.iter().enumerate() {
            let blob = fs::File::open(&layer.path)
                .map_err(io_err(format!("opening {}", layer.path.display())))?;
            let expected = diff_ids.as_ref().map(|ids| ids[i].as_str());
            let record = self.add_layer_checked(&layer.digest, expected, blob)?;
            size += record.unpacked_bytes;
            layers.push(record.digest);
        }
        self.put_image(ImageRecord {
            name: name.to_owned(),
            source: source.to_owned(),
            config,
            layers,
            size_bytes: size,
            created_unix: now_unix(),
            tenant: None,
            labels: Default::default(),
        })
    }

    /// Records an image whose layers are all stored. Fails if the name is taken.
    pub fn put_image(&self, record: ImageRecord) -> Result<ImageRecord, StoreError> {
        self.write_image(record, false)
    }

    /// Records an image whose layers are all stored, replacing an image of
    /// that name if there is one (a re-pull of a moved tag).
    pub fn replace_image(&self, record: ImageRecord) -> Result<ImageRecord, StoreError> {
        self.write_image(record, true)
    }

    /// Writes an image record under a temporary name, then moves it into
    /// place: hard-linked when the name must be new (link(2) fails if it
    /// exists, so two imports of one name cannot both win), renamed over the
    /// old record with `replace` (a reader sees one or the other, whole).
    fn write_image(&self, record: ImageRecord, replace: bool) -> Result<ImageRecord, StoreError> {
        for digest in &record.layers {
            if !self.has_layer(digest) {
                return Err(io_err(format!("recording image {}", record.name))(
                    io::Error::new(
                        io::ErrorKind::NotFound,
                        format!("layer {digest} is not stored"),
                    ),
                ));
            }
        }
        let path = self.image_path(&record.name);
        let bytes = serde_json::to_vec_pretty(&record).map_err(|e| corrupt(&path, e))?;
        let tmp = self.tmp_dir()?.join("image.json");
        fs::write(&tmp, bytes).map_err(io_err(format!("writing {}", tmp.display())))?;
        let placed = if replace {
            fs::rename(&tmp, &path)
        } else {
            fs::hard_link(&tmp, &path)
        };
        let _ = remove_any(tmp.parent().unwrap_or(&tmp));
        match placed {
            Ok(()) => Ok(record),
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {
                Err(StoreError::Exists(record.name))
            }
            Err(e) => Err(io_err(format!("writing {}", path.display()))(e)),
        }
    }

    fn image_path(&self, name: &str) -> PathBuf {
        self.root.join("images").join(format!("{name}.json"))
    }

    /// Image `name`.
    pub fn image(&self, name: &str) -> Result<ImageRecord, StoreError> {
        let path = self.image_path(name);
        match fs::read(&path) {
            Ok(bytes) => serde_json::from_slice(&bytes).map_err(|e| corrupt(&path, e)),
            Err(e) if e.kind() == io::ErrorKind::NotFound => {
                Err(StoreError::NoImage(name.to_owned()))
            }
            Err(e) => Err(io_err(format!("reading {}", path.display()))(e)),
        }
    }

    /// Every image, by name.
    pub fn images(&self) -> Result<Vec<ImageRecord>, StoreError> {
        let mut names: Vec<String> = fs::read_dir(self.root.join("images"))
            .map_err(io_err("reading images"))?
            .flatten()
            .filter_map(|e| {
                e.file_name()
                    .to_str()?
                    .strip_suffix(".json")
                    .map(str::to_owned)
            })
            .collect();
        names.sort();
        names.iter().map(|n| self.image(n)).collect()
    }

    /// The unpacked layer directories of image `name`, base first.
    pub fn image_layer_dirs(&self, name: &str) -> Result<Vec<PathBuf>, StoreError> {
        self.image(name)?
            .layers
            .iter()
            .map(|d| self.layer_dir(d))
            .collect()
    }

    /// Forgets image `name`; its layers stay until [`Store::gc`].
    pub fn remove_image(&self, name: &str) -> Result<(), StoreError> {
        match fs::remove_file(self.image_path(name)) {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == io::ErrorKind::NotFound => {
                Err(StoreError::NoImage(name.to_owned()))
            }
            Err(e) => Err(io_err(format!("removing image {name}"))(e)),
        }
    }

    /// Removes every layer no image references, except those in `keep`
    /// (layers a run still mounts although its image was removed). Returns
    /// the digests removed. Local layers are forgotten (their metadata
    /// first) and handed to `remove_local` with their id, to delete where
    /// they live; one it fails to delete is an orphan its owner sweeps
    /// later. Blocking.
    pub fn gc(
        &self,
        keep: &[String],
        remove_local: &mut dyn FnMut(&str) -> io::Result<()>,
    ) -> Result<Vec<String>, StoreError> {
        let mut used: std::collections::HashSet<String> = keep.iter().cloned().collect();
        for image in self.images()? {
            used.extend(image.layers);
        }
        let mut removed = Vec::new();
        for entry in fs::read_dir(self.root.join("layers"))
            .map_err(io_err("reading layers"))?
            .flatten()
        {
            let Some(stem) = entry
                .file_name()
                .to_str()
                .and_then(|n| n.strip_suffix(".json"))
                .map(str::to_owned)
            else {
                continue;
            };
            if let Some(id) = stem.strip_prefix("local-") {
                let key = format!("{LOCAL_PREFIX}{id}");
                if used.contains(&key) || local_id(&key).is_none() {
                    continue;
                }
                fs::remove_file(entry.path()).map_err(io_err(format!("removing layer {key}")))?;
                if let Err(e) = remove_local(id) {
                    tracing::warn!(layer = %key, error = %e, "could not delete a local layer; it is swept later");
                }
                removed.push(key);
                continue;
            }
            let digest = format!("sha256:{stem}");
            if used.contains(&digest) {
                continue;
            }
            let dir = self.layer_dir(&digest)?;
            // Metadata first: without it the directory no longer counts.
            fs::remove_file(dir.with_extension("json"))
                .map_err(io_err(format!("removing layer {digest}")))?;
            remove_any(&dir).map_err(io_err(format!("removing layer {digest}")))?;
            removed.push(digest);
        }
        // Blob index entries whose layer is gone.
        for entry in fs::read_dir(self.root.join("blobs"))
            .map_err(io_err("reading blobs"))?
            .flatten()
        {
            let Some(hex) = entry.file_name().to_str().map(str::to_owned) else {
                continue;
            };
            if self.layer_key(&format!("sha256:{hex}")).is_none() {
                let _ = fs::remove_file(entry.path());
            }
        }
        Ok(removed)
    }
}

/// The most uncompressed bytes a layer may carry after its tar end marker
/// (tar writers pad to their record size, 10 KiB for GNU tar).
const MAX_TRAILER: u64 = 1 << 20;

/// The config's `rootfs.diff_ids` when it lists one well-formed digest per
/// layer; None otherwise (some hand-made images leave it empty; those
/// layers are stored under what they unpack to, unchecked).
pub fn config_diff_ids(config: &serde_json::Value, layers: usize) -> Option<Vec<String>> {
    let ids: Vec<String> = config
        .get("rootfs")?
        .get("diff_ids")?
        .as_array()?
        .iter()
        .map(|v| v.as_str().map(str::to_owned))
        .collect::<Option<_>>()?;
    (ids.len() == layers && ids.iter().all(|id| digest_hex(id).is_ok())).then_some(ids)
}

/// Hashes what passes through it to `inner`.
struct HashingWriter<W> {
    inner: W,
    hasher: Sha256,
}

impl<W: io::Write> io::Write for HashingWriter<W> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        let n = self.inner.write(buf)?;
        self.hasher.update(&buf[..n]);
        Ok(n)
    }

    fn flush(&mut self) -> io::Result<()> {
        self.inner.flush()
    }
}

/// Unpacks layer blob `blob` (compressed or not) into `dir`, an existing
/// empty directory, checking that the blob hashes to `digest` and, given
/// one, that its uncompressed tar hashes to `diff_id`: what was unpacked,
/// and the tar's digest. On error `dir` is left half-filled. Blocking.
pub fn unpack_checked(
    digest: &str,
    diff_id: Option<&str>,
    blob: impl Read,
    dir: &Path,
    limits: &UnpackLimits,
) -> Result<(unpack::UnpackStats, String), StoreError> {
    let mut hashing = HashingReader {
        inner: blob,
        hasher: Sha256::new(),
    };
    let (stats, actual_diff_id) = {
        let reader = unpack::decompressed(&mut hashing)
            .map_err(io_err(format!("reading layer {digest}")))?;
        let mut tar = HashingReader {
            inner: reader,
            hasher: Sha256::new(),
        };
        let stats =
            unpack::unpack_layer(&mut tar, dir, limits).map_err(|source| StoreError::Unpack {
                digest: digest.to_owned(),
                source,
            })?;
        // The diff_id covers the whole uncompressed stream, the zero
        // blocks after the tar's end marker included; bounded, so a
        // small blob cannot make us inflate and hash gigabytes of it.
        let trailer = io::copy(&mut (&mut tar).take(MAX_TRAILER + 1), &mut io::sink())
            .map_err(io_err(format!("reading layer {digest}")))?;
        if trailer > MAX_TRAILER {
            return Err(StoreError::BadLayer {
                digest: digest.to_owned(),
                why: format!("more than {MAX_TRAILER} bytes follow the archive's end"),
            });
        }
        (stats, format!("sha256:{}", hex(&tar.hasher.finalize())))
    };
    // The tar end marker may come before the end of the blob (padding,
    // compression trailer): hash everything that is left.
    io::copy(&mut hashing, &mut io::sink()).map_err(io_err(format!("reading layer {digest}")))?;
    let actual = format!("sha256:{}", hex(&hashing.hasher.finalize()));
    if actual != digest {
        return Err(StoreError::DigestMismatch {
            expected: digest.to_owned(),
            actual,
        });
    }
    if let Some(expected) = diff_id {
        if expected != actual_diff_id {
            return Err(StoreError::DiffIdMismatch {
                blob: digest.to_owned(),
                expected: expected.to_owned(),
                actual: actual_diff_id,
            });
        }
    }
    Ok((stats, actual_diff_id))
}

struct HashingReader<R> {
    inner: R,
    hasher: Sha256,
}

impl<R: Read> Read for HashingReader<R> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let n = self.inner.read(buf)?;
        self.hasher.update(&buf[..n]);
        Ok(n)
    }
}

fn corrupt(path: &Path, e: impl std::fmt::Display) -> StoreError {
    StoreError::Corrupt {
        path: path.to_path_buf(),
        message: e.to_string(),
    }
}

fn write_atomic(path: &Path, bytes: &[u8]) -> Result<(), StoreError> {
    let tmp = path.with_extension("json.tmp");
    fs::write(&tmp, bytes).map_err(io_err(format!("writing {}", tmp.display())))?;
    fs::rename(&tmp, path).map_err(io_err(format!("writing {}", path.display())))
}

fn remove_any(path: &Path) -> io::Result<()> {
    match fs::symlink_metadata(path) {
        Ok(m) if m.is_dir() => fs::remove_dir_all(path),
        Ok(_) => fs::remove_file(path),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(e),
    }
}

fn now_unix() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs() as i64)
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::layout::StagedLayer;

    fn layer_tar(files: &[(&str, &[u8])]) -> Vec<u8> {
        let mut b = tar::Builder::new(Vec::new());
        for (path, data) in files {
            let mut h = tar::Header::new_gnu();
            h.set_size(data.len() as u64);
            h.set_mode(0o644);
            h.set_uid(0);
            h.set_gid(0);
            h.set_mtime(0);
            h.set_entry_type(tar::EntryType::Regular);
            b.append_data(&mut h, path, *data).unwrap();
        }
        b.into_inner().unwrap()
    }

    fn digest(bytes: &[u8]) -> String {
        format!("sha256:{}", hex(&Sha256::digest(bytes)))
    }

    fn store(dir: &Path) -> Store {
        Store::open(dir.to_path_buf(), UnpackLimits::default()).unwrap()
    }

    fn gzip(bytes: &[u8]) -> Vec<u8> {
        use std::io::Write;
        let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
        gz.write_all(bytes).unwrap();
        gz.finish().unwrap()
    }

    fn layer_dirs(dir: &Path) -> usize {
        fs::read_dir(dir.join("layers"))
            .unwrap()
            .filter(|e| e.as_ref().unwrap().path().is_dir())
            .count()
    }

    #[test]
    fn the_same_content_compressed_differently_is_stored_once() {
        let dir = tempfile::tempdir().unwrap();
        let store = store(dir.path());
        let tar = layer_tar(&[("etc/hello", b"hi")]);
        let gz = gzip(&tar);
        let (plain, zipped) = (digest(&tar), digest(&gz));
        assert_ne!(plain, zipped);
        // The gzip blob first: stored under the tar's digest, its diff_id.
        let first = store.add_layer(&zipped, gz.as_slice()).unwrap();
        assert_eq!(first.digest, plain);
        assert_eq!(first.diff_id.as_deref(), Some(plain.as_str()));
        assert!(store.has_layer(&zipped) && store.has_layer(&plain));
        assert_eq!(store.layer_key(&zipped).as_deref(), Some(plain.as_str()));
        // The plain blob is the same layer: nothing new unpacked.
        let second = store.add_layer(&plain, tar.as_slice()).unwrap();
        assert_eq!(second, first);
        assert_eq!(layer_dirs(dir.path()), 1);
        // A blob seen before is not even read.
        let third = store.add_layer(&zipped, &b"not read"[..]).unwrap();
        assert_eq!(third, first);
        // Known by diff_id (a pull that has the config): not read either.
        let other = digest(b"another compression");
        let fourth = store
            .add_layer_checked(&other, Some(&plain), &b"not read"[..])
            .unwrap();
        assert_eq!(fourth.digest, plain);
        assert_eq!(store.layer_key(&other).as_deref(), Some(plain.as_str()));
        // Once no image uses it, the layer and its blob names go.
        store.gc(&[], &mut |_| Ok(())).unwrap();
        assert!(!store.has_layer(&plain) && !store.has_layer(&zipped));
        assert_eq!(fs::read_dir(dir.path().join("blobs")).unwrap().count(), 0);
    }

    #[test]
    fn a_layer_that_unpacks_to_another_diff_id_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let store = store(dir.path());
        let tar = layer_tar(&[("etc/hello", b"hi")]);
        let claimed = digest(b"something else");
        let err = store
            .add_layer_checked(&digest(&tar), Some(&claimed), tar.as_slice())
            .unwrap_err();
        assert!(matches!(err, StoreError::DiffIdMismatch { .. }), "{err}");
        assert!(!store.has_layer(&digest(&tar)));
        assert_eq!(layer_dirs(dir.path()), 0);
    }

    #[test]
    fn a_blob_inflating_far_past_its_archive_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let store = store(dir.path());
        let mut tar = layer_tar(&[("etc/hello", b"hi")]);
        tar.extend(std::iter::repeat_n(0u8, 4 << 20));
        let gz = gzip(&tar);
        let err = store.add_layer(&digest(&gz), gz.as_slice()).unwrap_err();
        assert!(matches!(err, StoreError::BadLayer { .. }), "{err}");
        assert_eq!(layer_dirs(dir.path()), 0);
    }

    #[test]
    fn config_diff_ids_are_used_only_when_complete_and_well_formed() {
        let id = format!("sha256:{}", "a".repeat(64));
        let config = |ids: serde_json::Value| serde_json::json!({"rootfs": {"diff_ids": ids}});
        assert_eq!(
            config_diff_ids(&config(serde_json::json!([id])), 1),
            Some(vec![id.clone()])
        );
        assert_eq!(config_diff_ids(&config(serde_json::json!([id])), 2), None);
        assert_eq!(
            config_diff_ids(&config(serde_json::json!(["../x"])), 1),
            None
        );
        assert_eq!(config_diff_ids(&serde_json::json!({}), 0), None);
    }

    #[test]
    fn layers_are_stored_once_and_verified() {
        let dir = tempfile::tempdir().unwrap();
        let store = store(dir.path());
        let tar = layer_tar(&[("etc/hello", b"hi")]);
        let d = digest(&tar);
        let record = store.add_layer(&d, tar.as_slice()).unwrap();
        assert_eq!(record.unpacked_bytes, 2);
        assert!(store.has_layer(&d));
        assert_eq!(
            fs::read(store.layer_dir(&d).unwrap().join("etc/hello")).unwrap(),
            b"hi"
        );
        // A second add does not read the blob at all.
        store.add_layer(&d, io::empty()).unwrap();
        // A blob that does not match its digest leaves nothing behind.
        let other = layer_tar(&[("x", b"x")]);
        let wrong = digest(b"something else");
        assert!(matches!(
            store.add_layer(&wrong, other.as_slice()),
            Err(StoreError::DigestMismatch { .. })
        ));
        assert!(!store.has_layer(&wrong));
        assert_eq!(fs::read_dir(dir.path().join("tmp")).unwrap().count(), 0);
        assert!(matches!(
            store.add_layer("md5:abc", other.as_slice()),
            Err(StoreError::BadDigest(_))
        ));
    }

    #[test]
    fn images_share_layers_and_gc_keeps_what_is_used() {
        let dir = tempfile::tempdir().unwrap();
        let store = store(dir.path());
        let base = layer_tar(&[("base", b"b")]);
        let top = layer_tar(&[("top", b"t")]);
        let blobs = tempfile::tempdir().unwrap();
        let staged = |layers: &[&Vec<u8>]| StagedImage {
            config: br#"{"config":{"Env":["A=1"]}}"#.to_vec(),
            layers: layers
                .iter()
                .map(|bytes| {
                    let d = digest(bytes);
                    let path = blobs.path().join(&d[7..]);
                    fs::write(&path, bytes).unwrap();
                    StagedLayer { digest: d, path }
                })
                .collect(),
            format: "oci-layout",
        };
        let one = store
            .import_staged("one", &staged(&[&base]), "oci-layout")
            .unwrap();
        let two = store
            .import_staged("two", &staged(&[&base, &top]), "oci-layout")
            .unwrap();
        assert_eq!(one.layers[0], two.layers[0]);
        assert_eq!(store.image_layer_dirs("two").unwrap().len(), 2);
        assert!(matches!(
            store.import_staged("one", &staged(&[&base]), "x"),
            Err(StoreError::Exists(_))
        ));
        assert_eq!(store.images().unwrap().len(), 2);
        store.remove_image("two").unwrap();
        // The top layer is kept while a run still uses it, then collected.
        assert!(store
            .gc(&[digest(&top)], &mut |_| Ok(()))
            .unwrap()
            .is_empty());
        assert_eq!(store.gc(&[], &mut |_| Ok(())).unwrap(), vec![digest(&top)]);
        assert!(store.has_layer(&digest(&base)));
        store.remove_image("one").unwrap();
        assert_eq!(store.gc(&[], &mut |_| Ok(())).unwrap(), vec![digest(&base)]);
        assert!(matches!(store.image("one"), Err(StoreError::NoImage(_))));
    }

    #[test]
    fn local_layers_count_once_recorded_and_go_back_to_their_owner() {
        let dir = tempfile::tempdir().unwrap();
        let store = store(dir.path());
        let id = "01JABCDEFGHJKMNPQRSTVWXYZ0";
        let key = format!("local:{id}");
        // Without a local root there are no local layers.
        assert!(store.layer_dir(&key).is_err());
        let local = dir.path().join("local");
        assert!(store.set_local_root(local.clone()));
        assert!(!store.set_local_root(dir.path().to_path_buf()));
        assert_eq!(store.layer_dir(&key).unwrap(), local.join(id).join("upper"));
        // Not there, or there but unrecorded: not a layer.
        assert!(store.add_local_layer(id, 5, 1).is_err());
        std::fs::create_dir_all(local.join(id).join("upper")).unwrap();
        std::fs::write(local.join(id).join("upper/f"), b"hello").unwrap();
        assert!(!store.has_layer(&key));
        let record = store.add_local_layer(id, 5, 1).unwrap();
        assert_eq!(
            (record.digest.as_str(), record.diff_id.as_ref()),
            (key.as_str(), None)
        );
        assert!(store.has_layer(&key));
        assert_eq!(store.layer_size(&key).unwrap(), 5);
        assert_eq!(store.local_layers().unwrap(), vec![id.to_owned()]);
        // An image on top of a stored layer and the local one.
        let base = layer_tar(&[("etc/os", b"base")]);
        let base_key = store
            .add_layer(&digest(&base), std::io::Cursor::new(base.clone()))
            .unwrap()
            .digest;
        store
            .put_image(ImageRecord {
                name: "snap".into(),
                source: "snapshot".into(),
                config: serde_json::json!({}),
                layers: vec![base_key.clone(), key.clone()],
                size_bytes: 0,
                created_unix: 0,
                tenant: None,
                labels: Default::default(),
            })
            .unwrap();
        let dirs = store.image_layer_dirs("snap").unwrap();
        assert_eq!(dirs[1], local.join(id).join("upper"));
        let mut handed = Vec::new();
        let mut remove = |id: &str| {
            handed.push(id.to_owned());
            Ok(())
        };
        assert!(store.gc(&[], &mut remove).unwrap().is_empty());
        // Unused: forgotten first, then handed back to be deleted.
        store.remove_image("snap").unwrap();
        let mut removed = store.gc(&[], &mut remove).unwrap();
        removed.sort();
        let mut want = vec![base_key.clone(), key.clone()];
        want.sort();
        assert_eq!(removed, want);
        assert_eq!(handed, vec![id.to_owned()]);
        assert!(!store.has_layer(&key));
        assert!(store.local_layers().unwrap().is_empty());
        // Keys that are not ULIDs are never local layers.
        assert!(store.write_local_layer(&base_key, io::sink()).is_err());
        for bad in [
            "local:",
            "local:../x",
            "local:01jabcdefghjkmnpqrstvwxyz0",
            "local:01JABCDEFGHJKMNPQRSTVWXYZI",
        ] {
            assert_eq!(local_id(bad), None, "{bad}");
        }
    }

    #[test]
    fn a_local_layer_becomes_a_tar_on_demand_with_its_digest_computed_once() {
        let dir = tempfile::tempdir().unwrap();
        let store = store(dir.path());
        let local = dir.path().join("local");
        store.set_local_root(local.clone());
        let id = "01JABCDEFGHJKMNPQRSTVWXYZ1";
        let key = format!("local:{id}");
        let upper = local.join(id).join("upper");
        std::fs::create_dir_all(upper.join("work")).unwrap();
        std::fs::write(upper.join("work/a.txt"), b"alpha").unwrap();
        store.add_local_layer(id, 5, 2).unwrap();
        let mut tar = Vec::new();
        let diff_id = store.write_local_layer(&key, &mut tar).unwrap();
        assert_eq!(diff_id, digest(&tar));
        // Recorded once; the same again without writing anything.
        assert_eq!(store.local_diff_id(&key).unwrap(), diff_id);
        let mut again = Vec::new();
        assert_eq!(store.write_local_layer(&key, &mut again).unwrap(), diff_id);
        assert_eq!(again, tar);
        // The tar is a layer like any other: stored, it unpacks to the same.
        let stored = store
            .add_layer(&diff_id, std::io::Cursor::new(tar))
            .unwrap();
        assert_eq!(stored.digest, diff_id);
        let unpacked = store.layer_dir(&diff_id).unwrap();
        assert_eq!(
            std::fs::read(unpacked.join("work/a.txt")).unwrap(),
            b"alpha"
        );
    }

    #[test]
    fn open_clears_unfinished_work() {
        let dir = tempfile::tempdir().unwrap();
        drop(store(dir.path()));
        let half = dir.path().join("layers").join("a".repeat(64));
        fs::create_dir_all(&half).unwrap();
        fs::create_dir_all(dir.path().join("tmp/leftover")).unwrap();
        drop(store(dir.path()));
        assert!(!half.exists());
        assert!(!dir.path().join("tmp/leftover").exists());
    }
}
