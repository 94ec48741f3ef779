//! Images as the API sees them, over the content-addressed layer store of
//! `runbox-image`.
//!
//! An import arrives as one archive in one of three shapes, told apart by
//! what it contains:
//!
//! * an OCI image layout (`oci-layout` + `index.json` + `blobs/`), as written
//!   by `skopeo copy ... oci-archive:` or `docker save` since Docker 25;
//! * a classic `docker save` tarball (`manifest.json` + `<id>/layer.tar`);
//! * anything else is taken as a plain root filesystem: one layer.
//!
//! The body is first spooled to a file under the store (bounded, hashed on
//! the way), because the format is only known once the whole archive has
//! been seen; the spool is removed whatever happens. Layers are then unpacked
//! by the store's hardened unpacker, so a hostile archive is refused with the
//! rule it broke and leaves nothing behind.

use std::fs::File;
use std::io::{self, Read, Seek, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, RwLock};

use runbox_image::layout::{self, LayoutError, Platform};
use runbox_image::store::{ImageRecord, Store, StoreError};
use runbox_image::unpack::UnpackLimits;
use runbox_types::{Env, ErrorCode, Image};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use time::OffsetDateTime;

use crate::error::CoreError;
use crate::validate;

/// Most entries one layer may hold.
pub const MAX_ENTRIES: u64 = 1_000_000;

/// The parts of an image's config that runbox honours.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ImageConfig {
    /// `Env`, as variables for every command (before the run's and the exec's).
    #[serde(default)]
    pub env: Env,
    /// `WorkingDir`: the default directory of commands, instead of /work.
    #[serde(default)]
    pub working_dir: Option<String>,
    /// `Entrypoint`: with `cmd`, what an exec without a command runs.
    #[serde(default)]
    pub entrypoint: Vec<String>,
    /// `Cmd`.
    #[serde(default)]
    pub cmd: Vec<String>,
    /// `User`: who commands run as (unless an exec names another) and who
    /// owns uploaded files (see docs/api.md).
    #[serde(default)]
    pub user: Option<String>,
}

impl ImageConfig {
    /// Reads the honoured fields out of an OCI image config document. Fields
    /// that are malformed are ignored with a warning rather than failing the
    /// import: a config is the image author's, not the caller's.
    pub fn from_oci(config: &serde_json::Value) -> ImageConfig {
        let c = &config["config"];
        let strings = |v: &serde_json::Value| -> Vec<String> {
            v.as_array()
                .map(|a| {
                    a.iter()
                        .filter_map(|s| s.as_str().map(str::to_owned))
                        .collect()
                })
                .unwrap_or_default()
        };
        let mut env = std::collections::BTreeMap::new();
        for pair in strings(&c["Env"]) {
            if let Some((k, v)) = pair.split_once('=') {
                env.insert(k.to_owned(), v.to_owned());
            }
        }
        let env = Env(env);
        let env = match validate::env(&env) {
            Ok(()) => env,
            Err(e) => {
                tracing::warn!(error = %e, "ignoring the image's Env");
                Env::default()
            }
        };
        let nonempty =
            |v: &serde_json::Value| v.as_str().filter(|s| !s.is_empty()).map(str::to_owned);
        ImageConfig {
            env,
            working_dir: nonempty(&c["WorkingDir"]),
            entrypoint: strings(&c["Entrypoint"]),
            cmd: strings(&c["Cmd"]),
            user: nonempty(&c["User"]),
        }
    }
}

impl ImageConfig {
    /// The honoured fields as an OCI image config document (for an image
    /// made from a run whose own image is gone).
    pub fn to_oci(&self) -> serde_json::Value {
        let env: Vec<String> = self.env.0.iter().map(|(k, v)| format!("{k}={v}")).collect();
        let mut config = serde_json::json!({ "Env": env });
        if let Some(dir) = &self.working_dir {
            config["WorkingDir"] = dir.clone().into();
        }
        if !self.entrypoint.is_empty() {
            config["Entrypoint"] = self.entrypoint.clone().into();
        }
        if !self.cmd.is_empty() {
            config["Cmd"] = self.cmd.clone().into();
        }
        if let Some(user) = &self.user {
            config["User"] = user.clone().into();
        }
        serde_json::json!({ "config": config })
    }
}

/// What a snapshot image is made of, besides the run's captured layer.
#[derive(Clone, Debug)]
pub struct SnapshotBase {
    /// The run's image name.
    pub parent: String,
    /// The run's layers (its image's as they were at its creation).
    pub layers: Vec<String>,
    /// The OCI config document the snapshot keeps.
    pub config: serde_json::Value,
    /// The run it is taken from.
    pub run: ulid::Ulid,
    /// The run's tenant, whose image the snapshot is.
    pub tenant: Option<String>,
    /// The snapshot's labels.
    pub labels: std::collections::BTreeMap<String, String>,
    /// Where the image says it came from; None: `snapshot:<run>:<parent>`
    /// (an image a build keeps says `build…:` instead, and so stays out of
    /// the snapshot lists).
    pub source: Option<String>,
}

/// The image directory.
#[derive(Clone, Debug)]
pub struct ImageStore {
    store: Arc<Store>,
    spool: PathBuf,
    /// Imports hold it shared, garbage collection exclusively: a layer an
    /// import has stored but not yet recorded must not be collected.
    gc_lock: Arc<RwLock<()>>,
    /// Pulls in progress: they hold layers not yet referenced by an image.
    pulls: Arc<AtomicUsize>,
}

impl ImageStore {
    /// Opens the store at `dir`, clearing interrupted work.
    pub fn open(dir: PathBuf, max_bytes: u64) -> Result<ImageStore, CoreError> {
        let limits = UnpackLimits {
            max_bytes,
            max_entries: MAX_ENTRIES,
            ..UnpackLimits::default()
        };
        let store = Store::open(dir.clone(), limits).map_err(store_error)?;
        let spool = dir.join("spool");
        let _ = std::fs::remove_dir_all(&spool);
        std::fs::create_dir_all(&spool).map_err(CoreError::io("creating the image spool"))?;
        Ok(ImageStore {
            store: Arc::new(store),
            spool,
            gc_lock: Arc::new(RwLock::new(())),
            pulls: Arc::new(AtomicUsize::new(0)),
        })
    }

    /// The layer store, for pulls.
    pub fn store(&self) -> &Arc<Store> {
        &self.store
    }

    fn record(&self, name: &str) -> Result<ImageRecord, CoreError> {
        validate::image_name(name)?;
        self.store.image(name).map_err(store_error)
    }

    /// The layer directories of image `name`, base first.
    pub fn layers(&self, name: &str) -> Result<Vec<PathBuf>, CoreError> {
        validate::image_name(name)?;
        self.store.image_layer_dirs(name).map_err(store_error)
    }

    /// What a run of image `name` is built from, read from one record: its
    /// layer digests and their directories (base first), and the honoured
    /// parts of its config. Blocking.
    pub fn for_run(
        &self,
        name: &str,
    ) -> Result<(Vec<String>, Vec<PathBuf>, ImageConfig), CoreError> {
        let record = self.record(name)?;
        let dirs = record
            .layers
            .iter()
            .map(|d| self.store.layer_dir(d))
            .collect::<Result<Vec<_>, _>>()
            .map_err(store_error)?;
        Ok((record.layers, dirs, ImageConfig::from_oci(&record.config)))
    }

    /// The honoured parts of image `name`'s config.
    pub fn config(&self, name: &str) -> Result<ImageConfig, CoreError> {
        Ok(ImageConfig::from_oci(&self.record(name)?.config))
    }

    /// Image `name` as the API shows it; `with_config` adds the config document.
    pub fn get(&self, name: &str, server: &str, with_config: bool) -> Result<Image, CoreError> {
        Ok(to_image(self.record(name)?, server, with_config))
    }

    /// The local name of the stored image that `wanted` names: a local name
    /// of a stored image, else an image reference that a stored (pulled)
    /// image came from, compared in normalised form (`busybox` and
    /// `docker.io/library/busybox:latest` are one). `Ok(None)` when nothing
    /// stored matches; an error when `wanted` is neither a valid name nor a
    /// valid reference. Blocking.
    pub fn resolve(&self, wanted: &str) -> Result<Option<String>, CoreError> {
        let as_name = validate::image_name(wanted);
        if as_name.is_ok() && self.store.image(wanted).is_ok() {
            return Ok(Some(wanted.to_owned()));
        }
        let normalised = match runbox_image::pull::normalise(wanted) {
            Ok(n) => n,
            Err(e) => {
                // Neither: say both what a name must look like and why it
                // is no reference either.
                return Err(match as_name {
                    Ok(()) => pull_error(e),
                    Err(name_error) => CoreError::invalid(
                        ErrorCode::BadImageName,
                        format!("{name_error}; nor is it an image reference: {e}"),
                    ),
                });
            }
        };
        Ok(self
            .store
            .images()
            .map_err(store_error)?
            .into_iter()
            .find(|r| r.source == normalised)
            .map(|r| r.name))
    }

    /// Every image, ordered by name, but a build's cached steps (see
    /// [`crate::builds`]), which are the builder's own.
    pub fn list(&self, server: &str) -> Result<Vec<Image>, CoreError> {
        Ok(self
            .store
            .images()
            .map_err(store_error)?
            .into_iter()
            .filter(|r| !r.source.starts_with(crate::builds::CACHE_SOURCE_PREFIX))
            .map(|r| to_image(r, server, false))
            .collect())
    }

    /// Forgets image `name` (its layers stay until
    /// [`ImageStore::collect_garbage`]). The caller checks that no run uses it.
    pub fn forget(&self, name: &str) -> Result<(), CoreError> {
        validate::image_name(name)?;
        self.store.remove_image(name).map_err(store_error)?;
        tracing::info!(image = name, "image removed");
        Ok(())
    }

    /// Removes every layer no image references and `keep` (the layers live
    /// runs mount) does not name. Waits for imports in progress, whose
    /// layers are not referenced until they finish. Blocking.
    pub fn collect_garbage(
        &self,
        keep: &[String],
        remove_local: &mut dyn FnMut(&str) -> std::io::Result<()>,
    ) -> Result<(), CoreError> {
        let _exclusive = self.gc_lock.write().unwrap_or_else(|p| p.into_inner());
        if self.pulls.load(Ordering::SeqCst) > 0 {
            // A pull holds layers it has not recorded yet; the next
            // collection (the next image delete) gets them if unused.
            tracing::info!("a pull is in progress; garbage collection skipped");
            return Ok(());
        }
        let removed = self.store.gc(keep, remove_local).map_err(store_error)?;
        if !removed.is_empty() {
            tracing::info!(layers = removed.len(), "removed unused layers");
        }
        Ok(())
    }

    /// Holds off garbage collection while a pull stores layers it has not
    /// yet recorded in an image.
    pub fn import_guard(&self) -> ImportGuard {
        // Taken under the collection lock, so a collection already running
        // finishes first and a later one sees the count.
        let _shared = self.gc_lock.read().unwrap_or_else(|p| p.into_inner());
        self.pulls.fetch_add(1, Ordering::SeqCst);
        ImportGuard {
            pulls: self.pulls.clone(),
        }
    }

    /// Records a pulled image whose layers are all in the store. With
    /// `replace`, an image of that name is replaced (its old layers stay for
    /// the runs that mount them, until garbage collection); the second value
    /// says whether anything changed.
    pub fn record_pulled(
        &self,
        name: &str,
        pulled: &runbox_image::pull::PulledImage,
        server: &str,
        replace: bool,
    ) -> Result<(Image, bool), CoreError> {
        let config = serde_json::from_slice(&pulled.config).map_err(|e| {
            CoreError::invalid(
                ErrorCode::RegistryError,
                format!("the image config is not JSON: {e}"),
            )
        })?;
        let mut size = 0;
        let mut layers = Vec::with_capacity(pulled.layers.len());
        for layer in &pulled.layers {
            // The key the layer is stored under: its diff_id (a skipped blob
            // may have been stored from another compression of it).
            let key = layer
                .diff_id
                .as_deref()
                .and_then(|id| self.store.layer_key(id))
                .or_else(|| self.store.layer_key(&layer.digest))
                .ok_or_else(|| {
                    CoreError::Store(format!("pulled layer {} is not stored", layer.digest))
                })?;
            size += self.store.layer_size(&key).map_err(store_error)?;
            layers.push(key);
        }
        if replace {
            if let Ok(old) = self.store.image(name) {
                if old.source == pulled.reference && old.layers == layers && old.config == config {
                    return Ok((to_image(old, server, false), false));
                }
            }
        }
        let record = ImageRecord {
            name: name.to_owned(),
            source: pulled.reference.clone(),
            config,
            layers,
            size_bytes: size,
            created_unix: OffsetDateTime::now_utc().unix_timestamp(),
            tenant: None,
            labels: Default::default(),
        };
        let record = if replace {
            self.store.replace_image(record)
        } else {
            self.store.put_image(record)
        }
        .map_err(store_error)?;
        Ok((to_image(record, server, false), true))
    }

    /// The directories of layers `keys`, in order. Blocking.
    pub fn layer_dirs(&self, keys: &[String]) -> Result<Vec<PathBuf>, CoreError> {
        keys.iter()
            .map(|k| self.store.layer_dir(k).map_err(store_error))
            .collect()
    }

    /// The OCI config document of image `name` if its layers are still
    /// `layers` (the image was not replaced since), else None.
    pub fn config_if_layers(&self, name: &str, layers: &[String]) -> Option<serde_json::Value> {
        let record = self.store.image(name).ok()?;
        (record.layers == layers).then_some(record.config)
    }

    /// Records image `name` made of `base` plus local layer `layer` (a
    /// capture the lane kept, [`crate::lane::Lane::keep_layer`]), and
    /// returns it with the layer's key and bytes. The layer's record comes
    /// before the image's: a crash in between leaves an unreferenced layer
    /// for garbage collection, never an image that looks whole and is not.
    /// Blocking.
    pub fn record_local_snapshot(
        &self,
        name: &str,
        base: &SnapshotBase,
        layer: ulid::Ulid,
        size: crate::lane::LayerSize,
        server: &str,
    ) -> Result<(Image, String, u64), CoreError> {
        validate::image_name(name)?;
        if self.store.image(name).is_ok() {
            return Err(exists(name));
        }
        // Held so that collection cannot take the layer between its record
        // and the image's.
        let _shared = self.gc_lock.read().unwrap_or_else(|p| p.into_inner());
        let record = self
            .store
            .add_local_layer(&layer.to_string(), size.bytes, size.entries)
            .map_err(store_error)?;
        let image = self.put_snapshot_image(name, base, &record.digest)?;
        tracing::info!(image = name, run = %base.run, layer = %record.digest, bytes = size.bytes, "snapshot recorded");
        Ok((to_image(image, server, false), record.digest, size.bytes))
    }

    /// Where stored image `name` came from (`rootfs`, `oci-layout`,
    /// `docker-save`, `snapshot:…`, or the registry reference it was pulled
    /// from); None when there is no such image.
    pub fn source(&self, name: &str) -> Option<String> {
        self.record(name).ok().map(|r| r.source)
    }

    /// Writes stored layer `key` to `out` as an OCI layer tar and returns
    /// its diff_id (for a layer stored from a registry, the tar is written
    /// from the unpacked layer, so its diff_id is its own). Blocking.
    pub fn write_layer(&self, key: &str, out: &mut dyn Write) -> Result<(), CoreError> {
        if runbox_image::store::local_id(key).is_some() {
            self.store
                .write_local_layer(key, out)
                .map_err(store_error)?;
            return Ok(());
        }
        let dir = self.store.layer_dir(key).map_err(store_error)?;
        runbox_image::capture::upper_to_tar(&dir, &[], out)
            .map_err(CoreError::io(format!("writing layer {key} as a tar")))?;
        Ok(())
    }

    /// Whether every layer of `keys` is stored.
    pub fn has_layers(&self, keys: &[String]) -> bool {
        keys.iter().all(|k| self.store.has_layer(k))
    }

    /// Records image `name` of stored layers `layers` (base first) with
    /// OCI config `config`, from `source`; an image of that name with the
    /// same layers is taken as it is. Blocking.
    pub fn record_restored(
        &self,
        name: &str,
        source: &str,
        layers: Vec<String>,
        config: &serde_json::Value,
        tenant: Option<String>,
    ) -> Result<(), CoreError> {
        validate::image_name(name)?;
        if let Ok(existing) = self.store.image(name) {
            if existing.layers == layers {
                return Ok(());
            }
            return Err(exists(name));
        }
        self.put_layered_image(
            name,
            source.to_owned(),
            layers,
            config,
            tenant,
            Default::default(),
        )?;
        Ok(())
    }

    /// Where image builds keep their records and contexts.
    pub fn builds_dir(&self) -> PathBuf {
        self.spool.with_file_name("builds")
    }

    /// Records image `name` a build made: stored layers `layers` (base
    /// first) with OCI config `config`, replacing an image of that name
    /// (runs of the old one keep its layers). Blocking.
    pub fn record_built(
        &self,
        name: &str,
        source: String,
        layers: Vec<String>,
        config: &serde_json::Value,
        tenant: Option<String>,
        labels: std::collections::BTreeMap<String, String>,
    ) -> Result<Image, CoreError> {
        validate::image_name(name)?;
        let _shared = self.gc_lock.read().unwrap_or_else(|p| p.into_inner());
        // Checked again as it is replaced: another caller may have made an
        // image of that name while the build ran.
        if let Ok(existing) = self.store.image(name) {
            let theirs = tenant.is_some() && existing.tenant != tenant;
            if theirs
                || existing
                    .source
                    .starts_with(crate::builds::CACHE_SOURCE_PREFIX)
            {
                return Err(exists(name));
            }
        }
        let record = self.layered_record(name, source, layers, config, tenant, labels)?;
        let record = self.store.replace_image(record).map_err(store_error)?;
        tracing::info!(image = name, source = %record.source, layers = record.layers.len(), "built image recorded");
        Ok(to_image(record, "", false))
    }

    /// Records image `name` of stored layers `layers` (base first), with
    /// `config` (its `rootfs` set to them) and `source`.
    fn put_layered_image(
        &self,
        name: &str,
        source: String,
        layers: Vec<String>,
        config: &serde_json::Value,
        tenant: Option<String>,
        labels: std::collections::BTreeMap<String, String>,
    ) -> Result<ImageRecord, CoreError> {
        let record = self.layered_record(name, source, layers, config, tenant, labels)?;
        self.store.put_image(record).map_err(store_error)
    }

    /// The record of image `name` of stored layers `layers`, with `config`
    /// (its `rootfs` set to them).
    fn layered_record(
        &self,
        name: &str,
        source: String,
        layers: Vec<String>,
        config: &serde_json::Value,
        tenant: Option<String>,
        labels: std::collections::BTreeMap<String, String>,
    ) -> Result<ImageRecord, CoreError> {
        let mut size = 0;
        for key in &layers {
            size += self.store.layer_size(key).map_err(store_error)?;
        }
        let mut config = config.clone();
        if let Some(object) = config.as_object_mut() {
            object.insert(
                "rootfs".into(),
                serde_json::json!({"type": "layers", "diff_ids": layers}),
            );
        }
        Ok(ImageRecord {
            name: name.to_owned(),
            source,
            config,
            layers,
            size_bytes: size,
            created_unix: OffsetDateTime::now_utc().unix_timestamp(),
            tenant,
            labels,
        })
    }

    /// Records image `name` of `base`'s layers and `layer` on top.
    fn put_snapshot_image(
        &self,
        name: &str,
        base: &SnapshotBase,
        layer: &str,
    ) -> Result<ImageRecord, CoreError> {
        let mut layers = base.layers.clone();
        layers.push(layer.to_owned());
        let source = base
            .source
            .clone()
            .unwrap_or_else(|| format!("snapshot:{}:{}", base.run, base.parent));
        self.put_layered_image(
            name,
            source,
            layers,
            &base.config,
            base.tenant.clone(),
            base.labels.clone(),
        )
    }

    /// Records image `name` made of `base` plus one layer captured from a
    /// run's upper directory `upper` (entries at `skip` left out; `graft`,
    /// the run's warm volume, written at its path) written as a tar, and
    /// returns it with the new layer's key and unpacked bytes. The layer is
    /// stored (written, verified, renamed into place) before the image
    /// record, which is written last: a crash in between leaves an
    /// unreferenced layer for garbage collection, never an image that looks
    /// whole and is not. Blocking.
    pub fn record_snapshot(
        &self,
        name: &str,
        base: &SnapshotBase,
        upper: &Path,
        skip: &[String],
        graft: Option<runbox_image::capture::Graft>,
        server: &str,
    ) -> Result<(Image, String, u64), CoreError> {
        validate::image_name(name)?;
        if self.store.image(name).is_ok() {
            return Err(exists(name));
        }
        let _shared = self.gc_lock.read().unwrap_or_else(|p| p.into_inner());
        let work = tempfile::Builder::new()
            .prefix("snapshot-")
            .tempdir_in(&self.spool)
            .map_err(CoreError::io("creating a snapshot directory"))?;
        let spooled = work.path().join("layer.tar");
        let digest = {
            let file =
                File::create(&spooled).map_err(CoreError::io("creating the snapshot spool"))?;
            let mut hashing = HashingWriter {
                inner: io::BufWriter::new(file),
                hasher: Sha256::new(),
            };
            let skip: Vec<&str> = skip.iter().map(String::as_str).collect();
            runbox_image::capture::upper_to_tar_with(upper, &skip, graft, &mut hashing)
                .map_err(CoreError::io("reading the run's captured layer"))?;
            hashing
                .inner
                .into_inner()
                .map_err(|e| CoreError::io("writing the snapshot spool")(e.into_error()))?
                .sync_all()
                .map_err(CoreError::io("writing the snapshot spool"))?;
            format!("sha256:{}", hex_of(&hashing.hasher.finalize()))
        };
        let blob = File::open(&spooled).map_err(CoreError::io("reopening the snapshot spool"))?;
        let layer = self.store.add_layer(&digest, blob).map_err(store_error)?;
        let record = self.put_snapshot_image(name, base, &layer.digest)?;
        tracing::info!(image = name, run = %base.run, layer = %layer.digest, bytes = layer.unpacked_bytes, "snapshot recorded");
        Ok((
            to_image(record, server, false),
            layer.digest,
            layer.unpacked_bytes,
        ))
    }

    /// Imports an archive (see the module doc) as image `name`. Blocking.
    pub fn import(
        &self,
        name: &str,
        reader: impl Read,
        max_bytes: u64,
        server: &str,
    ) -> Result<Image, CoreError> {
        validate::new_image_name(name)?;
        if self.store.image(name).is_ok() {
            return Err(exists(name));
        }
        let _shared = self.gc_lock.read().unwrap_or_else(|p| p.into_inner());
        let work = tempfile::Builder::new()
            .prefix("import-")
            .tempdir_in(&self.spool)
            .map_err(CoreError::io("creating an import directory"))?;
        let spooled = work.path().join("archive");
        let digest = spool(reader, &spooled, max_bytes)?;
        let record = match detect(&spooled)? {
            Shape::Rootfs => {
                let blob = File::open(&spooled).map_err(CoreError::io("reopening the archive"))?;
                let layer = self.store.add_layer(&digest, blob).map_err(store_error)?;
                let digest = layer.digest.clone();
                self.store
                    .put_image(ImageRecord {
                        name: name.to_owned(),
                        source: "rootfs".to_owned(),
                        config: serde_json::json!({
                            "config": {},
                            "rootfs": {"type": "layers", "diff_ids": [digest]},
                        }),
                        layers: vec![digest],
                        size_bytes: layer.unpacked_bytes,
                        created_unix: OffsetDateTime::now_utc().unix_timestamp(),
                        tenant: None,
                        labels: Default::default(),
                    })
                    .map_err(store_error)?
            }
            Shape::ImageArchive => {
                let stage = work.path().join("stage");
                std::fs::create_dir(&stage)
                    .map_err(CoreError::io("creating the staging directory"))?;
                let archive =
                    File::open(&spooled).map_err(CoreError::io("reopening the archive"))?;
                let archive =
                    runbox_image::unpack::decompressed(archive).map_err(bad_archive_io)?;
                layout::stage_archive(archive, &stage, max_bytes).map_err(layout_error)?;
                // The spool is no longer needed; free its space before unpacking.
                let _ = std::fs::remove_file(&spooled);
                let staged =
                    layout::read_staged(&stage, &Platform::host()).map_err(layout_error)?;
                self.store
                    .import_staged(name, &staged, staged.format)
                    .map_err(store_error)?
            }
        };
        Ok(to_image(record, server, false))
    }
}

/// Marks a pull in progress while it lives; see [`ImageStore::import_guard`].
pub struct ImportGuard {
    pulls: Arc<AtomicUsize>,
}

impl Drop for ImportGuard {
    fn drop(&mut self) {
        self.pulls.fetch_sub(1, Ordering::SeqCst);
    }
}

/// Maps a pull failure onto the API's codes.
pub fn pull_error(e: runbox_image::pull::PullError) -> CoreError {
    use runbox_image::pull::PullError as P;
    let code = match &e {
        P::BadReference { .. } => ErrorCode::BadReference,
        P::InsecureRegistry { .. } | P::RegistryNotHttps { .. } => ErrorCode::InsecureRegistry,
        P::AuthFailed { .. } => ErrorCode::RegistryAuthFailed,
        P::NotFound { .. } => ErrorCode::RemoteNotFound,
        P::NoMatchingPlatform { .. } => ErrorCode::NoMatchingPlatform,
        P::Sink { .. } => ErrorCode::BadArchive,
        _ => ErrorCode::RegistryError,
    };
    let mut message = e.to_string();
    let mut source = std::error::Error::source(&e);
    while let Some(s) = source {
        message.push_str(": ");
        message.push_str(&s.to_string());
        source = s.source();
    }
    CoreError::invalid(code, message)
}

/// What an archive holds.
enum Shape {
    /// An OCI layout or a `docker save` tarball.
    ImageArchive,
    /// A root filesystem.
    Rootfs,
}

/// A writer that hashes what passes through it.
pub(crate) struct HashingWriter<W> {
    pub(crate) inner: W,
    pub(crate) hasher: Sha256,
}

impl<W: Write> Write for HashingWriter<W> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        let n = self.inner.write(buf)?;
        self.hasher.update(&buf[..n]);
        Ok(n)
    }
    fn flush(&mut self) -> io::Result<()> {
        self.inner.flush()
    }
}

fn hex_of(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// Copies an uploaded body into `out`, at most `max` bytes (past that,
/// `too_large`'s error), and returns the byte count and the body's
/// sha256 in hex. A read error is the upload breaking off (a 400 naming
/// `what`).
pub(crate) fn copy_hashed(
    mut reader: impl Read,
    out: impl Write,
    max: u64,
    what: &str,
    too_large: impl FnOnce() -> CoreError,
) -> Result<(u64, String), CoreError> {
    let mut out = HashingWriter {
        inner: io::BufWriter::new(out),
        hasher: Sha256::new(),
    };
    let mut buf = vec![0u8; 256 * 1024];
    let mut total = 0u64;
    loop {
        let n = match reader.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => {
                return Err(CoreError::invalid(
                    ErrorCode::BadRequest,
                    format!("the {what} broke off: {e}"),
                ))
            }
        };
        total += n as u64;
        if total > max {
            return Err(too_large());
        }
        out.write_all(&buf[..n])
            .map_err(CoreError::io("writing the upload spool"))?;
    }
    out.flush()
        .map_err(CoreError::io("writing the upload spool"))?;
    Ok((total, hex_of(&out.hasher.finalize())))
}

/// Copies `reader` to `path`, at most `max` bytes, and returns its sha256.
fn spool(reader: impl Read, path: &Path, max: u64) -> Result<String, CoreError> {
    let file = File::create(path).map_err(CoreError::io("creating the import spool"))?;
    let (total, hex) = copy_hashed(reader, file, max, "upload", || {
        CoreError::invalid(
            ErrorCode::TooLarge,
            format!("the archive is larger than this server's image maximum of {max} bytes"),
        )
    })?;
    if total == 0 {
        return Err(CoreError::invalid(
            ErrorCode::BadArchive,
            "the archive is empty",
        ));
    }
    Ok(format!("sha256:{hex}"))
}

/// Tells an image archive from a root filesystem by its top-level names.
fn detect(path: &Path) -> Result<Shape, CoreError> {
    let mut file = File::open(path).map_err(CoreError::io("reopening the archive"))?;
    file.rewind()
        .map_err(CoreError::io("reopening the archive"))?;
    let reader = runbox_image::unpack::decompressed(file).map_err(bad_archive_io)?;
    let mut archive = tar::Archive::new(reader);
    let (mut index, mut layout, mut docker) = (false, false, false);
    for entry in archive.entries().map_err(bad_archive_io)? {
        let entry = entry.map_err(bad_archive_io)?;
        let name = entry.path().map_err(bad_archive_io)?;
        match name.to_str().map(|n| n.trim_start_matches("./")) {
            Some("index.json") => index = true,
            Some("oci-layout") => layout = true,
            Some("manifest.json") => docker = true,
            _ => {}
        }
    }
    Ok(if (index && layout) || docker {
        Shape::ImageArchive
    } else {
        Shape::Rootfs
    })
}

fn to_image(record: ImageRecord, server: &str, with_config: bool) -> Image {
    Image {
        name: record.name,
        server: server.to_owned(),
        size_bytes: record.size_bytes,
        created_at: OffsetDateTime::from_unix_timestamp(record.created_unix)
            .unwrap_or(OffsetDateTime::UNIX_EPOCH),
        source: record.source,
        layers: record.layers,
        config: with_config.then_some(record.config),
        tenant: record.tenant,
        labels: record.labels,
        pull: None,
    }
}

fn exists(name: &str) -> CoreError {
    CoreError::Conflict {
        code: ErrorCode::ImageExists,
        message: format!(
            "an image named {name:?} already exists; remove it first or pick another name"
        ),
    }
}

fn bad_archive_io(e: io::Error) -> CoreError {
    CoreError::invalid(ErrorCode::BadArchive, format!("reading the archive: {e}"))
}

fn layout_error(e: LayoutError) -> CoreError {
    match e {
        LayoutError::Io { context, source } => CoreError::Io { context, source },
        other => CoreError::invalid(ErrorCode::BadArchive, other.to_string()),
    }
}

/// Maps a store error onto the API's codes.
pub fn store_error(e: StoreError) -> CoreError {
    match e {
        StoreError::NoImage(name) => CoreError::ImageNotFound(name),
        StoreError::Exists(name) => exists(&name),
        StoreError::Unpack { digest, source } => {
            let code = if source.rule() == "too_large" {
                ErrorCode::TooLarge
            } else {
                ErrorCode::BadArchive
            };
            CoreError::invalid(
                code,
                format!("layer {digest} refused ({}): {source}", source.rule()),
            )
        }
        e @ (StoreError::DigestMismatch { .. }
        | StoreError::DiffIdMismatch { .. }
        | StoreError::BadLayer { .. }
        | StoreError::BadDigest(_)) => CoreError::invalid(ErrorCode::BadArchive, e.to_string()),
        StoreError::Io { context, source } => CoreError::Io { context, source },
        e @ StoreError::Corrupt { .. } => CoreError::Store(e.to_string()),
    }
}

/// Pulls land in the layer store through this sink: each layer streams
/// through a bounded channel into the store's unpacker on a thread of its
/// own, so a layer is unpacked while it downloads and is never held whole.
pub(crate) struct StoreSink {
    pub(crate) store: Arc<Store>,
}

impl runbox_image::pull::LayerSink for StoreSink {
    fn has_layer(&self, layer: &runbox_image::pull::LayerInfo) -> bool {
        self.store.has_layer(&layer.digest)
            || layer
                .diff_id
                .as_deref()
                .is_some_and(|id| self.store.has_layer(id))
    }

    fn begin(
        &self,
        layer: &runbox_image::pull::LayerInfo,
    ) -> io::Result<Box<dyn runbox_image::pull::LayerWriter>> {
        let store = self.store.clone();
        let digest = layer.digest.clone();
        let diff_id = layer.diff_id.clone();
        Ok(Box::new(unpacker(move |reader| {
            store
                .add_layer_checked(&digest, diff_id.as_deref(), reader)
                .map(|_| ())
        })?))
    }
}

/// A writer whose bytes `unpack` reads on a thread of its own, through a
/// bounded channel (a blob is unpacked while it downloads, never held
/// whole); `unpack`'s error is the writer's.
pub(crate) fn unpacker(
    unpack: impl FnOnce(&mut dyn Read) -> Result<(), StoreError> + Send + 'static,
) -> io::Result<StoreWriter> {
    let (tx, rx) = std::sync::mpsc::sync_channel::<io::Result<Vec<u8>>>(8);
    let thread = std::thread::Builder::new()
        .name("runbox-unpack".into())
        .spawn(move || {
            let mut reader = ChannelReader {
                rx,
                current: Vec::new(),
                at: 0,
            };
            unpack(&mut reader)
        })?;
    Ok(StoreWriter {
        tx: Some(tx),
        thread: Some(thread),
    })
}

pub(crate) struct StoreWriter {
    tx: Option<std::sync::mpsc::SyncSender<io::Result<Vec<u8>>>>,
    thread: Option<std::thread::JoinHandle<Result<(), StoreError>>>,
}

impl StoreWriter {
    fn join(&mut self) -> io::Result<()> {
        self.tx = None;
        match self.thread.take().map(|t| t.join()) {
            Some(Ok(Ok(()))) | None => Ok(()),
            Some(Ok(Err(e))) => Err(io::Error::other(runbox_image_error_text(&e))),
            Some(Err(_)) => Err(io::Error::other("the unpack thread panicked")),
        }
    }
}

fn runbox_image_error_text(e: &StoreError) -> String {
    match e {
        StoreError::Unpack { digest, source } => {
            format!("layer {digest} refused ({}): {source}", source.rule())
        }
        other => other.to_string(),
    }
}

impl runbox_image::pull::LayerWriter for StoreWriter {
    fn write(&mut self, chunk: &[u8]) -> io::Result<()> {
        let tx = self
            .tx
            .as_ref()
            .ok_or_else(|| io::Error::other("layer already finished"))?;
        let chunk = chunk.to_vec();
        // The send blocks while the unpacker is behind; on the daemon's
        // multi-threaded runtime that must not starve other tasks.
        let sent = match tokio::runtime::Handle::try_current() {
            Ok(h) if h.runtime_flavor() == tokio::runtime::RuntimeFlavor::MultiThread => {
                tokio::task::block_in_place(|| tx.send(Ok(chunk)))
            }
            _ => tx.send(Ok(chunk)),
        };
        if sent.is_err() {
            // The unpacker stopped early: its error says why.
            return Err(self
                .join()
                .err()
                .unwrap_or_else(|| io::Error::other("the unpacker stopped early")));
        }
        Ok(())
    }

    fn finish(mut self: Box<Self>) -> io::Result<()> {
        self.join()
    }

    fn abort(mut self: Box<Self>) {
        if let Some(tx) = &self.tx {
            let _ = tx.send(Err(io::Error::other("layer download aborted")));
        }
        let _ = self.join();
    }
}

/// A `Read` over the chunks a pull sends; an `Err` chunk aborts the read.
struct ChannelReader {
    rx: std::sync::mpsc::Receiver<io::Result<Vec<u8>>>,
    current: Vec<u8>,
    at: usize,
}

impl Read for ChannelReader {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        while self.at >= self.current.len() {
            match self.rx.recv() {
                Ok(Ok(chunk)) => {
                    self.current = chunk;
                    self.at = 0;
                }
                Ok(Err(e)) => return Err(e),
                // The sender is gone: the blob is complete.
                Err(_) => return Ok(0),
            }
        }
        let n = buf.len().min(self.current.len() - self.at);
        buf[..n].copy_from_slice(&self.current[self.at..self.at + n]);
        self.at += n;
        Ok(n)
    }
}

/// Whether an image's `source` is image reference `reference` (as a pull
/// records it, normalised: `busybox` and `docker.io/library/busybox:latest`
/// are one).
pub fn same_reference(source: &str, reference: &str) -> bool {
    runbox_image::pull::normalise(reference).is_ok_and(|n| n == source)
}

/// The default local name for a pulled reference: the repository's last
/// component, plus the tag unless it is `latest`, made to fit the naming rules.
pub fn default_name(reference: &str) -> String {
    let without_digest = reference.split('@').next().unwrap_or(reference);
    let last = without_digest.rsplit('/').next().unwrap_or(without_digest);
    let (repo, tag) = match last.split_once(':') {
        Some((r, t)) => (r, Some(t)),
        None => (last, None),
    };
    let raw = match tag {
        Some(t) if t != "latest" => format!("{repo}-{t}"),
        _ => repo.to_owned(),
    };
    let mut name: String = raw
        .to_ascii_lowercase()
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-') {
                c
            } else {
                '-'
            }
        })
        .collect();
    name = name
        .trim_start_matches(['.', '_', '-'])
        .chars()
        .take(64)
        .collect();
    if name.is_empty() || name == "pull" {
        name = format!("image-{name}");
    }
    name
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn config_fields_are_read_and_bad_env_is_dropped() {
        let doc = serde_json::json!({"config": {
            "Env": ["PATH=/opt/bin:/usr/bin", "LANG=C.UTF-8", "novalue"],
            "WorkingDir": "/srv", "User": "app", "Entrypoint": ["/entry"], "Cmd": ["serve", "--port", "80"]
        }});
        let c = ImageConfig::from_oci(&doc);
        assert_eq!(c.env.0.get("LANG").map(String::as_str), Some("C.UTF-8"));
        assert_eq!(c.working_dir.as_deref(), Some("/srv"));
        assert_eq!(c.user.as_deref(), Some("app"));
        assert_eq!(c.entrypoint, vec!["/entry"]);
        assert_eq!(c.cmd, vec!["serve", "--port", "80"]);
        let bad = serde_json::json!({"config": {"Env": ["BAD-NAME=x"]}});
        assert!(ImageConfig::from_oci(&bad).env.0.is_empty());
        assert_eq!(
            ImageConfig::from_oci(&serde_json::json!({})),
            ImageConfig::default()
        );
    }

    #[test]
    fn default_names_fit_the_rules() {
        for (reference, name) in [
            ("busybox", "busybox"),
            ("library/busybox:latest", "busybox"),
            ("ghcr.io/org/Tool:1.2", "tool-1.2"),
            ("127.0.0.1:5000/a/b@sha256:abcd", "b"),
            ("x/pull", "image-pull"),
        ] {
            assert_eq!(default_name(reference), name, "{reference}");
            assert!(validate::image_name(&default_name(reference)).is_ok());
        }
    }
}
