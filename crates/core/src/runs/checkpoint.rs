//! Checkpoints: a run's disk and settings sent to the checkpoint store
//! ([`crate::checkpoints`]), and runs started from them.
//!
//! A checkpoint freezes the run only for the constant-time capture (as a
//! snapshot does); the capture is then written as a compressed layer tar and
//! uploaded while the run goes on. Layers below it travel too unless the
//! restoring node can pull them again from the registry the run's image came
//! from. A run started from a checkpoint gets an image made of those layers
//! (`ckpt-<id>-<generation>`, downloaded and verified once per node, shared by
//! every run started from it) and the checkpointed run's settings, each of
//! which its create may override.

use std::sync::Arc;

use runbox_types::{
    Checkpoint, CheckpointRequest, CreateRunRequest, ErrorCode, LimitsRequest, PullPolicy,
};
use time::OffsetDateTime;
use ulid::Ulid;

use super::actor::Access;
use super::Manager;
use crate::checkpoints::{CheckpointRecord, CheckpointStore, FORMAT_VERSION};
use crate::error::CoreError;
use crate::store::RunRecord;
use crate::validate;

/// The media type a restored layer is handed to the layer store as.
const LAYER_MEDIA_TYPE: &str = "application/vnd.oci.image.layer.v1.tar+zstd";

impl Manager {
    /// The checkpoint store.
    pub(crate) fn checkpoint_store(&self) -> Result<Arc<CheckpointStore>, CoreError> {
        self.context.checkpoint_store()
    }

    /// The checkpoint as the API shows it: with its expiry under this
    /// server's TTL.
    fn shown(&self, mut checkpoint: Checkpoint) -> Checkpoint {
        checkpoint.expires_at = self
            .config()
            .checkpoint_ttl
            .map(|ttl| checkpoint.created_at + ttl);
        checkpoint
    }

    /// Checkpoints run `id` into the store (see the module doc). The run
    /// keeps running; it is frozen only for the capture.
    ///
    /// Cancellation: the upload runs in a task of its own; a client that
    /// hangs up does not stop it, and the checkpoint appears as usual.
    pub async fn checkpoint(
        self: &Arc<Self>,
        id: Ulid,
        req: CheckpointRequest,
    ) -> Result<Checkpoint, CoreError> {
        let labels = req.labels.unwrap_or_default();
        validate::labels(&labels)?;
        if let Some(key) = labels.keys().find(|k| k.starts_with("runbox.")) {
            return Err(CoreError::invalid(
                ErrorCode::BadLabels,
                format!("label {key:?}: keys starting with \"runbox.\" are runbox's own"),
            ));
        }
        self.checkpoint_store()?;
        let record = (*self.admit(id, Access::Open).await?.record).clone();
        let manager = self.clone();
        tokio::spawn(async move { manager.checkpoint_run(record, labels).await })
            .await
            .map_err(|e| CoreError::Store(format!("checkpoint task failed: {e}")))?
    }

    async fn checkpoint_run(
        self: Arc<Self>,
        record: RunRecord,
        labels: std::collections::BTreeMap<String, String>,
    ) -> Result<Checkpoint, CoreError> {
        let capture = self.capture(record.id, "checkpointed").await?;
        let checkpoint = self
            .context
            .upload_checkpoint(&record, capture, Ulid::new(), 1, labels)
            .await?;
        self.context
            .usage
            .record(crate::accounting::UsageEvent::now(
                crate::accounting::UsageKind::Checkpoint,
                record.id,
                record.tenant.clone(),
            ));
        Ok(self.shown(checkpoint))
    }

    /// Every checkpoint in the store, oldest first.
    pub async fn list_checkpoints(&self) -> Result<Vec<Checkpoint>, CoreError> {
        Ok(self
            .checkpoint_store()?
            .list()
            .await?
            .into_iter()
            .map(|c| self.shown(c.checkpoint))
            .collect())
    }

    /// Checkpoint `id`.
    pub async fn get_checkpoint(&self, id: Ulid) -> Result<Checkpoint, CoreError> {
        let commit = self.checkpoint_store()?.get(id).await?;
        Ok(self.shown(commit.checkpoint))
    }

    /// Deletes checkpoint `id` from the store. Runs started from it keep
    /// running (their image holds the layers on this node).
    pub async fn delete_checkpoint(&self, id: Ulid) -> Result<(), CoreError> {
        let archived = self
            .get(id)
            .is_ok_and(|run| run.status == runbox_types::RunStatus::Archived);
        if archived {
            return Err(CoreError::Conflict {
                code: ErrorCode::CheckpointInUse,
                message: format!(
                    "checkpoint {id} is the disk of archived run {id}; delete the run (DELETE /v1/runs/{id}) to delete both"
                ),
            });
        }
        self.checkpoint_store()?.delete(id).await?;
        tracing::info!(checkpoint = %id, "checkpoint deleted");
        Ok(())
    }

    /// A create that names a checkpoint, turned into one that names the
    /// image made of its layers, with the checkpointed run's settings for
    /// every field the create left out.
    pub(crate) async fn from_checkpoint(
        self: &Arc<Self>,
        mut req: CreateRunRequest,
        owner: &crate::tenants::Owner,
    ) -> Result<CreateRunRequest, CoreError> {
        let Some(id) = req.checkpoint.take() else {
            return Ok(req);
        };
        if !req.image.is_empty() || req.pull.is_some() || req.warm.is_some() {
            return Err(CoreError::invalid(
                ErrorCode::BadRequest,
                "a create from a checkpoint takes its image and files from the checkpoint; leave out image, pull and warm",
            ));
        }
        let store = self.checkpoint_store()?.clone();
        let commit = store.get(id).await?;
        if !owner.sees(commit.checkpoint.tenant.as_deref()) {
            return Err(crate::checkpoints::not_found(id));
        }
        let record = store.record(&commit).await?;
        if record.version > FORMAT_VERSION {
            return Err(CoreError::invalid(
                ErrorCode::CheckpointCorrupt,
                format!(
                    "checkpoint {id} was written in a newer format ({})",
                    record.version
                ),
            ));
        }
        let manager = self.clone();
        let tenant = commit.checkpoint.tenant.clone();
        req.image = tokio::spawn(async move {
            manager
                .restore_image(&store, &record, tenant)
                .await
                .map(|n| (n, record))
        })
        .await
        .map_err(|e| CoreError::Store(format!("restore task failed: {e}")))?
        .map(|(name, record)| {
            merge_settings(&mut req, record.settings);
            name
        })?;
        Ok(req)
    }

    /// Makes sure image `ckpt-<id>-<generation>` exists on this node: the
    /// base layers (stored, or pulled from the checkpoint's reference) and
    /// the stored layers, downloaded and verified. Returns its name.
    async fn restore_image(
        self: &Arc<Self>,
        store: &CheckpointStore,
        record: &CheckpointRecord,
        tenant: Option<String>,
    ) -> Result<String, CoreError> {
        let name = format!(
            "ckpt-{}-{}",
            record.id.to_string().to_ascii_lowercase(),
            record.generation
        );
        // One restore at a time: two creates from one checkpoint download
        // it once.
        let _restoring = self.context.restore_lock.lock().await;
        if let Ok(existing) = self.images.get(&name, &self.config().server_id, false) {
            if existing.source == format!("checkpoint:{}", record.id) {
                return Ok(name);
            }
        }
        if !self.images.has_layers(&record.base) {
            let missing = || {
                CoreError::invalid(
                    ErrorCode::CheckpointBaseMissing,
                    format!(
                        "checkpoint {} needs the layers of image {:?}, which this server does not have{}",
                        record.id,
                        record.image,
                        match &record.pull {
                            Some(r) => format!(" and could not pull again from {r}"),
                            None => String::new(),
                        }
                    ),
                )
            };
            let Some(reference) = &record.pull else {
                return Err(missing());
            };
            self.image_for_run(reference, PullPolicy::IfNotPresent)
                .await
                .map_err(|e| {
                    tracing::warn!(checkpoint = %record.id, error = %super::error_chain(&e), "pulling a checkpoint's base image failed");
                    missing()
                })?;
            if !self.images.has_layers(&record.base) {
                return Err(missing());
            }
        }
        let layers = self.context.restore_layers(store, record).await?;
        let images = self.images.clone();
        let (config, source) = (record.config.clone(), format!("checkpoint:{}", record.id));
        let restored = name.clone();
        tokio::task::spawn_blocking(move || {
            images.record_restored(&restored, &source, layers, &config, tenant)
        })
        .await
        .map_err(|e| CoreError::Store(format!("restore task failed: {e}")))??;
        tracing::info!(checkpoint = %record.id, image = %name, "checkpoint restored as an image");
        Ok(name)
    }

    /// Runs a sweep of the checkpoint store now; see
    /// [`CheckpointStore::sweep`].
    pub(crate) async fn sweep_checkpoints(&self) {
        let Some(store) = self.config().checkpoints.clone() else {
            return;
        };
        match store
            .sweep(OffsetDateTime::now_utc(), self.config().checkpoint_ttl)
            .await
        {
            Ok(swept) if swept.expired + swept.orphans > 0 => {
                tracing::info!(
                    expired = swept.expired,
                    orphans = swept.orphans,
                    "checkpoint store swept"
                );
            }
            Ok(_) => {}
            Err(e) => {
                tracing::warn!(error = %super::error_chain(&e), "sweeping the checkpoint store failed; the next sweep retries");
            }
        }
    }

    /// Whether this node sweeps the checkpoint store now: always alone,
    /// and on a node of a fleet whose store is a bucket (which the nodes
    /// may share) only while it holds the fleet's lease on that bucket's
    /// sweep, so one node at a time sweeps it.
    async fn sweeps_checkpoints(&self) -> bool {
        let Some(store) = self.config().checkpoints.clone() else {
            return true;
        };
        if !store.location().starts_with("s3://") {
            return true;
        }
        // A node that joins a fleet is handed it a moment after it starts:
        // its first sweep waits for it (bounded), never sweeping alone.
        let mut fleet = self.fleet().cloned();
        for _ in 0..100 {
            if fleet.is_some() || !self.config().joins_fleet {
                break;
            }
            tokio::time::sleep(std::time::Duration::from_millis(100)).await;
            fleet = self.fleet().cloned();
        }
        let Some(fleet) = fleet else {
            return !self.config().joins_fleet;
        };
        let work = format!("checkpoint sweep {}", store.location());
        // Held past the next tick, so the holder keeps it while it lives.
        let hold = crate::checkpoints::ORPHAN_AGE + crate::checkpoints::ORPHAN_AGE / 2;
        match fleet.singleton(&work, hold).await {
            Ok(Some(fence)) => {
                tracing::debug!(fence, store = %store.location(), "this node sweeps the checkpoint store");
                true
            }
            Ok(None) => false,
            Err(e) => {
                tracing::info!(error = %e, "the checkpoint sweep waits for the cluster database");
                false
            }
        }
    }

    /// Sweeps the checkpoint store now and every hour.
    pub(crate) fn spawn_checkpoint_sweep(self: &Arc<Self>) {
        if self.config().checkpoints.is_none() {
            return;
        }
        let weak = Arc::downgrade(self);
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(crate::checkpoints::ORPHAN_AGE);
            loop {
                tick.tick().await;
                let Some(manager) = weak.upgrade() else {
                    return;
                };
                if manager.sweeps_checkpoints().await {
                    manager.sweep_checkpoints().await;
                }
            }
        });
    }
}

impl super::RunContext {
    /// The checkpoint store, or why there is none.
    pub(crate) fn checkpoint_store(&self) -> Result<Arc<CheckpointStore>, CoreError> {
        self.config().checkpoints.clone().ok_or_else(|| {
            CoreError::invalid(
                ErrorCode::BadRequest,
                "this server has no checkpoint store (--checkpoint-store)",
            )
        })
    }

    /// Uploads `capture` of run `record` as generation `generation` of
    /// checkpoint `checkpoint`, and commits it. Layers below the disk that
    /// a registry cannot give back go too. On failure what was uploaded is
    /// removed (or left to the sweep).
    pub(crate) async fn upload_checkpoint(
        &self,
        record: &RunRecord,
        capture: crate::lane::Capture,
        checkpoint: Ulid,
        generation: u64,
        labels: std::collections::BTreeMap<String, String>,
    ) -> Result<Checkpoint, CoreError> {
        let store = self.checkpoint_store()?.clone();
        // The layers a registry can give back stay references; the rest
        // (imported images, snapshots) travel with the checkpoint.
        let config_now = self.images.config_if_layers(&record.image, &record.layers);
        let pull = self
            .images
            .source(&record.image)
            .filter(|s| pullable(s))
            .filter(|_| config_now.is_some());
        let (base, carried) = match &pull {
            Some(_) => (record.layers.clone(), Vec::new()),
            None => (Vec::new(), record.layers.clone()),
        };
        let config = config_now.unwrap_or_else(|| record.image_config.to_oci());
        let warm = match (&record.warm, &capture.warm_upper) {
            (Some(volume), Some(upper)) => {
                let cache = self.warm.clone().ok_or_else(|| {
                    CoreError::invalid(
                        ErrorCode::WarmCacheDisabled,
                        "this run's warm volume cannot be checkpointed while the warm cache is off",
                    )
                })?;
                Some((cache, volume.clone(), upper.clone()))
            }
            _ => None,
        };
        let mut upload = store.begin(checkpoint, generation);
        let uploaded = async {
            // Stored once in the store for every checkpoint that needs them.
            for key in carried {
                let images = self.images.clone();
                let from = key.clone();
                upload
                    .put_shared_layer(&key, move |out| {
                        images
                            .write_layer(&from, out)
                            .map_err(|e| std::io::Error::other(super::error_chain(&e)))
                    })
                    .await?;
            }
            let upper = capture.upper.clone();
            let skip = capture.injected.clone();
            upload
                .put_layer(move |out| {
                    let flat = warm
                        .map(|(cache, volume, upper)| {
                            cache
                                .flatten_volume(&volume, &upper)
                                .map(|(scratch, tree)| (scratch, tree, volume.path))
                        })
                        .transpose()
                        .map_err(|e| std::io::Error::other(super::error_chain(&e)))?;
                    let at = flat
                        .as_ref()
                        .map(|(_, _, path)| std::path::PathBuf::from(path.trim_start_matches('/')));
                    let graft = match (&flat, &at) {
                        (Some((_, tree, _)), Some(at)) => {
                            Some(runbox_image::capture::Graft { at, dir: tree })
                        }
                        _ => None,
                    };
                    let skip: Vec<&str> = skip.iter().map(String::as_str).collect();
                    runbox_image::capture::upper_to_tar_with(&upper, &skip, graft, out)?;
                    Ok(())
                })
                .await
        }
        .await;
        drop(capture);
        let disk = match uploaded {
            Ok(disk) => disk,
            Err(e) => {
                upload.abandon().await;
                return Err(e);
            }
        };
        // A run that changed nothing (say, archived again right after a
        // restore) adds no layer: a tar of nothing but its end marker.
        if disk.tar_bytes <= EMPTY_TAR_BYTES {
            upload.forget_last();
        }
        let stored = CheckpointRecord {
            version: FORMAT_VERSION,
            id: checkpoint,
            generation,
            run: record.id,
            image: record.image.clone(),
            pull,
            base,
            layers: upload.layers().to_vec(),
            config,
            settings: settings_of(record),
        };
        let summary = Checkpoint {
            id: checkpoint,
            run: record.id,
            image: record.image.clone(),
            created_at: OffsetDateTime::now_utc(),
            expires_at: None,
            stored_bytes: 0,
            disk_bytes: disk.tar_bytes,
            labels,
            server: self.config().server_id.clone(),
            tenant: record.tenant.clone(),
            volumes_excluded: record.volumes.iter().map(|v| v.name.clone()).collect(),
            secrets_excluded: record
                .egress
                .brought
                .iter()
                .map(|b| b.name.clone())
                .collect(),
        };
        // A commit that failed may or may not have landed: one that did is
        // whole, one that did not is swept as an orphan.
        let commit = upload.commit(&stored, summary).await?;
        tracing::info!(run = %record.id, checkpoint = %checkpoint, generation, bytes = commit.checkpoint.stored_bytes, "run checkpointed");
        Ok(commit.checkpoint)
    }

    /// The layer keys of checkpoint `record` on this node, base first:
    /// its base layers (which the caller made sure are here), and each
    /// stored layer: the node's own copy when it still has it, else
    /// downloaded, verified and stored. The caller holds `restore_lock`.
    pub(crate) async fn restore_layers(
        &self,
        store: &CheckpointStore,
        record: &CheckpointRecord,
    ) -> Result<Vec<String>, CoreError> {
        let mut keys: Vec<String> = record.base.clone();
        // The layers are unreferenced until an image or a run records them.
        let _importing = self.images.import_guard();
        for layer in &record.layers {
            if let Some(key) = layer
                .key
                .as_ref()
                .filter(|k| self.images.has_layers(std::slice::from_ref(*k)))
            {
                push_layer(&mut keys, key.clone(), record.id)?;
                continue;
            }
            push_layer(&mut keys, layer.diff_id.clone(), record.id)?;
            if self.images.has_layers(std::slice::from_ref(&layer.diff_id)) {
                continue;
            }
            runbox_image::store::digest_hex(&layer.digest)
                .and_then(|_| runbox_image::store::digest_hex(&layer.diff_id))
                .map_err(|e| {
                    CoreError::invalid(
                        ErrorCode::CheckpointCorrupt,
                        format!("checkpoint {} is damaged: {e}", record.id),
                    )
                })?;
            let sink = crate::images::StoreSink {
                store: self.images.store().clone(),
            };
            let info = runbox_image::pull::LayerInfo {
                digest: layer.digest.clone(),
                media_type: LAYER_MEDIA_TYPE.to_owned(),
                size: layer.size,
                diff_id: Some(layer.diff_id.clone()),
            };
            use runbox_image::pull::LayerSink;
            let mut writer = Some(
                sink.begin(&info)
                    .map_err(CoreError::io("storing a checkpoint layer"))?,
            );
            let read = store
                .read_layer(record, layer, |chunk| match writer.as_mut() {
                    Some(w) => w.write(chunk),
                    None => Err(std::io::Error::other("the layer store stopped")),
                })
                .await;
            let writer = writer.take().expect("taken only here");
            match read {
                Ok(()) => writer.finish().map_err(|e| {
                    CoreError::invalid(
                        ErrorCode::CheckpointCorrupt,
                        format!(
                            "checkpoint {} is damaged and was not used: its layer {} was refused: {e}",
                            record.id, layer.object
                        ),
                    )
                })?,
                Err(e) => {
                    writer.abort();
                    return Err(e);
                }
            }
        }
        Ok(keys)
    }
}

/// The size of a layer tar with no entries: its end marker, two zero
/// blocks.
const EMPTY_TAR_BYTES: u64 = 1024;

/// Adds `key` on top of the layer stack `keys`. The same layer twice in a
/// row is the layer once (applying a diff again changes nothing); twice
/// apart, overlayfs cannot mount it, which only a hand-made record can ask
/// for.
fn push_layer(keys: &mut Vec<String>, key: String, checkpoint: Ulid) -> Result<(), CoreError> {
    if keys.last() == Some(&key) {
        return Ok(());
    }
    if keys.contains(&key) {
        return Err(CoreError::invalid(
            ErrorCode::CheckpointCorrupt,
            format!("checkpoint {checkpoint} names layer {key} twice, apart; it cannot be mounted"),
        ));
    }
    keys.push(key);
    Ok(())
}

/// Whether an image source is a registry reference a node can pull again.
fn pullable(source: &str) -> bool {
    !source.starts_with("snapshot:")
        && !source.starts_with("checkpoint:")
        && source.contains('/')
        && runbox_image::pull::normalise(source).is_ok()
}

/// A run's settings as the create that would make it again.
fn settings_of(record: &RunRecord) -> CreateRunRequest {
    let limits = record.limits;
    CreateRunRequest {
        env: Some(record.env.clone()),
        ttl_sec: (record.ttl_sec > 0).then_some(record.ttl_sec),
        network: Some(record.network),
        limits: record.size.is_none().then_some(LimitsRequest {
            cpus: Some(limits.cpus),
            memory_mb: Some(limits.memory_mb),
            pids: Some(limits.pids),
            disk_mb: limits.disk_mb,
        }),
        size: record.size,
        egress_allow: (!record.egress.allow.is_empty()).then(|| record.egress.allow.clone()),
        egress_defaults: record.egress.no_defaults.then_some(false),
        egress_socks5: record.egress.socks5.then_some(true),
        // Declared names only: a checkpoint never holds a brought
        // secret, sealed or not (a run made from it brings its own).
        secrets: (!record.egress.secrets.is_empty()).then(|| {
            record
                .egress
                .secrets
                .iter()
                .map(|name| runbox_types::SecretRequest::from(name.as_str()))
                .collect()
        }),
        labels: (!record.labels.is_empty()).then(|| record.labels.clone()),
        public_ports: Some(record.public_ports),
        auto_resume: Some(record.auto_resume),
        on_expire: Some(record.on_expire),
        idle: Some(record.idle),
        // The settings, never the points: a checkpoint holds the files as
        // they are.
        history: record.history,
        allow_privilege_escalation: record.allow_privilege_escalation.then_some(true),
        ..Default::default()
    }
}

/// Fills what `req` leaves out from a checkpoint's `settings`. The egress
/// entries and secrets go with the network tier: a create that picks its
/// own tier picks its own entries.
fn merge_settings(req: &mut CreateRunRequest, settings: CreateRunRequest) {
    if req.network.is_none() {
        req.network = settings.network;
        req.egress_allow = req.egress_allow.take().or(settings.egress_allow);
        req.egress_defaults = req.egress_defaults.or(settings.egress_defaults);
        req.egress_socks5 = req.egress_socks5.or(settings.egress_socks5);
        req.secrets = req.secrets.take().or(settings.secrets);
    }
    if req.limits.is_none() && req.size.is_none() {
        req.limits = settings.limits;
        req.size = settings.size;
    }
    req.env = req.env.take().or(settings.env);
    req.ttl_sec = req.ttl_sec.or(settings.ttl_sec);
    req.labels = req.labels.take().or(settings.labels);
    req.public_ports = req.public_ports.or(settings.public_ports);
    req.auto_resume = req.auto_resume.or(settings.auto_resume);
    req.on_expire = req.on_expire.or(settings.on_expire);
    req.idle = req.idle.or(settings.idle);
    req.history = req.history.or(settings.history);
    req.allow_privilege_escalation = req
        .allow_privilege_escalation
        .or(settings.allow_privilege_escalation);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn registry_sources_are_pullable_and_local_ones_are_not() {
        assert!(pullable("docker.io/library/alpine:3.20"));
        assert!(pullable("127.0.0.1:5000/team/app:1"));
        for local in [
            "rootfs",
            "oci-layout",
            "docker-save",
            "snapshot:01J:base",
            "checkpoint:01J",
        ] {
            assert!(!pullable(local), "{local}");
        }
    }

    #[test]
    fn a_create_overrides_what_it_names() {
        let settings = CreateRunRequest {
            network: Some(runbox_types::NetworkTier::Allowlist),
            egress_allow: Some(vec!["example.com".into()]),
            ttl_sec: Some(600),
            size: Some(runbox_types::SizeTier::Small),
            labels: Some([("team".to_owned(), "a".to_owned())].into()),
            allow_privilege_escalation: Some(true),
            ..Default::default()
        };
        let mut req = CreateRunRequest {
            ttl_sec: Some(60),
            ..Default::default()
        };
        merge_settings(&mut req, settings.clone());
        assert_eq!(req.ttl_sec, Some(60));
        assert_eq!(req.allow_privilege_escalation, Some(true));
        assert_eq!(req.network, Some(runbox_types::NetworkTier::Allowlist));
        assert_eq!(
            req.egress_allow.as_deref(),
            Some(&[runbox_types::EgressEntry::from("example.com")][..])
        );
        assert_eq!(req.size, Some(runbox_types::SizeTier::Small));
        assert_eq!(req.labels, settings.labels);
        // Another tier: the checkpoint's entries do not come along.
        let mut req = CreateRunRequest {
            network: Some(runbox_types::NetworkTier::None),
            limits: Some(LimitsRequest::default()),
            allow_privilege_escalation: Some(false),
            ..Default::default()
        };
        merge_settings(&mut req, settings);
        assert_eq!(req.allow_privilege_escalation, Some(false));
        assert_eq!(req.egress_allow, None);
        assert_eq!(req.size, None);
    }
}
