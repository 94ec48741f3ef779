//! The image half of the manager's API: import, pull, list, get, delete.
//! The layer store itself is [`crate::images::ImageStore`]; this adds what
//! needs the ledger (an image in use cannot go) and the blocking-thread
//! discipline (unpacking and garbage collection never run on async workers).

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use runbox_types::{ErrorCode, Image, PullEvent, PullPolicy, PullRequest};
use tokio::sync::mpsc;

use crate::error::CoreError;
use crate::runs::Manager;
use crate::validate;

/// How long an image delete waits for the runs being torn down that still
/// use the image (see [`Manager::delete_image`]).
const ENDING_WAIT: Duration = Duration::from_secs(30);

/// At most 64 characters of `s`, for messages.
fn bounded(s: &str) -> String {
    s.chars().take(64).collect()
}

impl Manager {
    /// The local name of the image a create asks for by name or reference,
    /// pulling it first when it is not stored and `policy` allows.
    ///
    /// Cancellation: the pull runs in a task of its own; a client that hangs
    /// up does not stop it, and the next create finds the image stored.
    /// Refuses, for a tenant, an image it may not run: another tenant's
    /// (as if it did not exist) or one its images rule leaves out (its own
    /// snapshots are always allowed).
    pub(crate) async fn check_image_for(
        self: &Arc<Self>,
        owner: &crate::tenants::Owner,
        wanted: &str,
    ) -> Result<(), CoreError> {
        if owner.tenant().is_none() {
            return Ok(());
        }
        let images = self.images.clone();
        let server = self.config().server_id.clone();
        let name = wanted.to_owned();
        let stored = tokio::task::spawn_blocking(move || {
            images
                .resolve(&name)
                .ok()
                .flatten()
                .and_then(|n| images.get(&n, &server, false).ok())
        })
        .await
        .map_err(|e| CoreError::Store(format!("image lookup task failed: {e}")))?;
        match stored {
            Some(image) => match image.tenant.as_deref() {
                Some(stamp) if owner.sees(Some(stamp)) => Ok(()),
                Some(_) => Err(CoreError::ImageNotFound(wanted.to_owned())),
                None => owner.check_image(&[wanted, &image.name]),
            },
            None => owner.check_image(&[wanted]),
        }
    }

    pub(crate) async fn image_for_run(
        self: &Arc<Self>,
        wanted: &str,
        policy: PullPolicy,
    ) -> Result<String, CoreError> {
        let resolve = |wanted: String| {
            let images = self.images.clone();
            async move {
                tokio::task::spawn_blocking(move || images.resolve(&wanted))
                    .await
                    .map_err(|e| CoreError::Store(format!("image lookup task failed: {e}")))?
            }
        };
        // Only what cannot be a local name is pulled on demand: a reference
        // with a registry, a tag or a digest (`alpine:3.20`, `host/x`,
        // `x@sha256:…`). A bare word such as `busybox` stays a local name,
        // so a typo never turns into a request to Docker Hub.
        let reference_like = wanted.contains([':', '/', '@']);
        let stored = resolve(wanted.to_owned()).await?;
        if policy == PullPolicy::Always {
            if !reference_like || runbox_image::pull::normalise(wanted).is_err() {
                return Err(CoreError::invalid(
                    ErrorCode::BadRequest,
                    format!(
                        "pull \"always\" needs a registry reference such as alpine:3.20 or \
                         127.0.0.1:5000/team/app:1; {:?} is a local image name",
                        bounded(wanted)
                    ),
                ));
            }
            let manager = self.clone();
            let reference = wanted.to_owned();
            return tokio::spawn(async move { manager.refresh_for_run(reference, stored).await })
                .await
                .map_err(|e| CoreError::Store(format!("pull task failed: {e}")))?;
        }
        if let Some(name) = stored {
            return Ok(name);
        }
        let missing = || CoreError::ImageNotFound(wanted.to_owned());
        if policy == PullPolicy::Never
            || !reference_like
            || runbox_image::pull::normalise(wanted).is_err()
        {
            return Err(missing());
        }
        let manager = self.clone();
        let reference = wanted.to_owned();
        let pulled = tokio::spawn(async move { manager.pull_for_run(reference).await })
            .await
            .map_err(|e| CoreError::Store(format!("pull task failed: {e}")))?;
        match pulled {
            Ok(name) => Ok(name),
            // A concurrent create pulled it first, under the same name.
            Err(CoreError::Conflict { .. }) => {
                resolve(wanted.to_owned()).await?.ok_or_else(missing)
            }
            Err(e) => Err(e),
        }
    }

    /// Pulls `reference` again for a create with `pull: always`, into the
    /// image that holds it (`stored`) or a new one. When the registry serves
    /// something else than what is stored (a moved tag), the image is
    /// replaced: new runs start from the new layers, live runs keep theirs
    /// (garbage collection spares what runs mount). Fails with the pull's
    /// own error when the registry cannot be reached: never a stale image.
    async fn refresh_for_run(
        self: Arc<Self>,
        reference: String,
        stored: Option<String>,
    ) -> Result<String, CoreError> {
        let name = match stored {
            Some(name) => name,
            None => self.name_for_pull(&reference),
        };
        let (progress, _ignored) = mpsc::unbounded_channel();
        let auth = runbox_image::pull::RegistryAuth::Anonymous;
        let (image, changed) = self
            .pull_into(&reference, &name, auth, progress, true)
            .await?;
        if changed {
            tracing::info!(image = %image.name, reference = %reference, "image replaced by a newer pull");
            self.collect_garbage().await?;
        }
        Ok(image.name)
    }

    /// A free local name for an image pulled from `reference`: its default
    /// name, or that name with a suffix from the reference when another
    /// image holds it.
    fn name_for_pull(&self, reference: &str) -> String {
        let base = crate::images::default_name(reference);
        if self
            .images
            .get(&base, &self.config().server_id, false)
            .is_err()
        {
            return base;
        }
        use sha2::Digest;
        let digest = sha2::Sha256::digest(reference.as_bytes());
        let suffix: String = digest[..4].iter().map(|b| format!("{b:02x}")).collect();
        let room = 64usize.saturating_sub(suffix.len() + 1);
        format!("{}-{suffix}", &base[..base.len().min(room)])
    }

    /// Snapshots run `id` into a new image: its image's layers plus one
    /// layer holding everything the run changed, captured while the run was
    /// frozen (see [`crate::lane::Sandbox::capture`]); the run keeps running.
    ///
    /// Cancellation: the capture and the recording run in a task of their
    /// own; a client that hangs up does not stop them, and the image
    /// appears as usual.
    pub async fn snapshot(
        self: &Arc<Self>,
        id: ulid::Ulid,
        req: runbox_types::SnapshotRequest,
    ) -> Result<runbox_types::Snapshot, CoreError> {
        let started = std::time::Instant::now();
        let labels = req.labels.unwrap_or_default();
        validate::labels(&labels)?;
        let name = match req.name {
            Some(name) => {
                validate::new_image_name(&name)?;
                name
            }
            None => format!(
                "snap-{}",
                ulid::Ulid::new().to_string().to_ascii_lowercase()
            ),
        };
        let record = self
            .admit(id, crate::runs::actor::Access::Open)
            .await?
            .record;
        let tenant = record.tenant.clone();
        if self
            .images
            .get(&name, &self.config().server_id, false)
            .is_ok()
        {
            return Err(CoreError::Conflict {
                code: ErrorCode::ImageExists,
                message: format!("an image named {name:?} already exists; pick another name"),
            });
        }
        let manager = self.clone();
        let base = crate::images::SnapshotBase {
            parent: record.image.clone(),
            config: self
                .images
                .config_if_layers(&record.image, &record.layers)
                .unwrap_or_else(|| record.image_config.to_oci()),
            layers: record.layers.clone(),
            run: id,
            tenant: record.tenant.clone(),
            labels,
            source: None,
        };
        let taken = tokio::spawn(async move {
            let (image, layer, bytes, frozen) =
                manager.capture_image(id, req.point, &name, base).await?;
            Ok(runbox_types::Snapshot {
                image: image.name,
                parent: record.image.clone(),
                run: id,
                layer,
                layer_bytes: bytes,
                frozen_ms: frozen.as_secs_f64() * 1000.0,
                elapsed_ms: started.elapsed().as_secs_f64() * 1000.0,
                volumes_excluded: record.volumes.iter().map(|v| v.name.clone()).collect(),
            })
        })
        .await
        .map_err(|e| CoreError::Store(format!("snapshot task failed: {e}")))?;
        if taken.is_ok() {
            self.context
                .usage
                .record(crate::accounting::UsageEvent::now(
                    crate::accounting::UsageKind::Snapshot,
                    id,
                    tenant,
                ));
        }
        taken
    }

    /// Captures run `id` (frozen for a moment, see
    /// [`crate::lane::Sandbox::capture`]) and records image `name` of
    /// `base` plus one layer with everything the run changed. Returns the
    /// image, the new layer's key and bytes, and how long the run was
    /// frozen. Callers run it in a task of their own when a hang-up must
    /// not cut it short.
    pub(crate) async fn capture_image(
        self: &Arc<Self>,
        id: ulid::Ulid,
        point: Option<ulid::Ulid>,
        name: &str,
        base: crate::images::SnapshotBase,
    ) -> Result<(runbox_types::Image, String, u64, std::time::Duration), CoreError> {
        let capture = match point {
            Some(point) => self.point_capture(id, point).await?,
            None => self.capture(id, "snapshotted").await?,
        };
        let frozen = capture.frozen;
        // Where the storage can, the capture itself becomes the new
        // layer, in constant time: no tar is written or unpacked. A
        // warm volume is grafted at its path by writing a layer.
        if self.lane.capabilities().layers.yes() && capture.warm_upper.is_none() {
            let (image, layer, bytes) = self.keep_snapshot(name, &base, &capture).await?;
            drop(capture);
            return Ok((image, layer, bytes, frozen));
        }
        let warm = match capture.warm_upper.is_some() {
            true => self
                .admit(id, crate::runs::actor::Access::Open)
                .await?
                .record
                .warm
                .clone(),
            false => None,
        };
        // The warm volume was mounted over its path: its files go there.
        let volume = match (&warm, &capture.warm_upper) {
            (Some(volume), Some(upper)) => {
                let cache = self.warm.clone().ok_or_else(|| {
                    CoreError::invalid(
                        ErrorCode::WarmCacheDisabled,
                        "this run's warm volume cannot be snapshotted while the warm cache is off",
                    )
                })?;
                Some((cache, volume.clone(), upper.clone()))
            }
            _ => None,
        };
        let images = self.images.clone();
        let server = self.config().server_id.clone();
        let name = name.to_owned();
        let (image, layer, bytes) = tokio::task::spawn_blocking(move || {
            let flat = volume
                .map(|(cache, volume, upper)| {
                    cache
                        .flatten_volume(&volume, &upper)
                        .map(|(scratch, tree)| (scratch, tree, volume.path))
                })
                .transpose()?;
            let at = flat
                .as_ref()
                .map(|(_, _, path)| PathBuf::from(path.trim_start_matches('/')));
            let graft = match (&flat, &at) {
                (Some((_, tree, _)), Some(at)) => {
                    Some(runbox_image::capture::Graft { at, dir: tree })
                }
                _ => None,
            };
            let recorded = images.record_snapshot(
                &name,
                &base,
                &capture.upper,
                &capture.injected,
                graft,
                &server,
            );
            drop(capture);
            recorded
        })
        .await
        .map_err(|e| CoreError::Store(format!("snapshot task failed: {e}")))??;
        Ok((image, layer, bytes, frozen))
    }

    /// Keeps `capture` as a local layer and records image `name` of `base`
    /// plus that layer. The layer is made first; a failure after that
    /// deletes it again, and a crash in between leaves a layer the next
    /// start sweeps (unrecorded) or collects (recorded, in no image).
    async fn keep_snapshot(
        &self,
        name: &str,
        base: &crate::images::SnapshotBase,
        capture: &crate::lane::Capture,
    ) -> Result<(runbox_types::Image, String, u64), CoreError> {
        let layer = ulid::Ulid::new();
        let size = self.lane.keep_layer(capture, layer).await?;
        let (images, lane) = (self.images.clone(), self.lane.clone());
        let (name, base, server) = (
            name.to_owned(),
            base.clone(),
            self.config().server_id.clone(),
        );
        tokio::task::spawn_blocking(move || {
            let recorded = images.record_local_snapshot(&name, &base, layer, size, &server);
            if recorded.is_err() {
                if let Err(e) = lane.remove_layer(&layer.to_string()) {
                    tracing::warn!(%layer, error = %crate::runs::error_chain(&e), "could not delete the layer of a failed snapshot");
                }
            }
            recorded
        })
        .await
        .map_err(|e| CoreError::Store(format!("snapshot task failed: {e}")))?
    }

    /// Removes the layers no image and no run on the ledger uses. The
    /// runs' layers are read under the image lock: a create holds it from
    /// reading its image's layers until its run is on the ledger.
    pub(crate) async fn collect_garbage(&self) -> Result<(), CoreError> {
        let keep = {
            let _guard = self.image_lock.lock().await;
            self.layers_in_use()
        };
        let (images, lane) = (self.images.clone(), self.lane.clone());
        tokio::task::spawn_blocking(move || {
            images.collect_garbage(&keep, &mut |id| {
                lane.remove_layer(id)
                    .map_err(|e| std::io::Error::other(crate::runs::error_chain(&e)))
            })
        })
        .await
        .map_err(|e| CoreError::Store(format!("garbage collection task failed: {e}")))?
    }

    /// Pulls `reference` for a create, under its default local name, or
    /// that name with a suffix from the reference when another image holds
    /// it.
    async fn pull_for_run(self: Arc<Self>, reference: String) -> Result<String, CoreError> {
        let name = self.name_for_pull(&reference);
        tracing::info!(reference = %reference, image = %name, "pulling an image a create asked for");
        let (progress, _ignored) = mpsc::unbounded_channel();
        let req = PullRequest {
            reference,
            name: Some(name),
            ..Default::default()
        };
        Ok(self.pull_image(req, progress).await?.name)
    }

    /// Imports an image from a tar stream. Blocking work runs on a blocking
    /// thread; `reader` is read there.
    pub async fn import_image(
        &self,
        name: String,
        reader: impl std::io::Read + Send + 'static,
    ) -> Result<Image, CoreError> {
        let images = self.images.clone();
        let max = self.config().max_image_bytes;
        let server = self.config().server_id.clone();
        tokio::task::spawn_blocking(move || images.import(&name, reader, max, &server))
            .await
            .map_err(|e| CoreError::Store(format!("image import task failed: {e}")))?
    }

    /// Pulls an image from a registry into the layer store and records it.
    /// Progress goes to `progress` (a closed receiver is not an error: the
    /// pull goes on). Checks that can fail fast (reference, name, name taken)
    /// are done before anything is fetched.
    ///
    /// Cancellation: dropping the future aborts the layer in flight; layers
    /// already stored stay (and are reused by the next pull).
    pub async fn pull_image(
        &self,
        req: PullRequest,
        progress: mpsc::UnboundedSender<PullEvent>,
    ) -> Result<Image, CoreError> {
        let (reference, name) = self.check_pull(&req)?;
        // A name pulled from this reference before is pulled again, as
        // `docker pull` does: replaced when the reference moved.
        let again = self
            .images
            .get(&name, &self.config().server_id, false)
            .is_ok();
        let auth = match (req.username, req.password) {
            (Some(username), Some(password)) => {
                runbox_image::pull::RegistryAuth::Basic { username, password }
            }
            (None, None) => runbox_image::pull::RegistryAuth::Anonymous,
            _ => {
                return Err(CoreError::invalid(
                    ErrorCode::BadRequest,
                    "give both username and password, or neither",
                ))
            }
        };
        let (mut image, changed) = self
            .pull_into(&reference, &name, auth, progress, again)
            .await?;
        image.pull = Some(match (again, changed) {
            (false, _) => runbox_types::PullOutcome::New,
            (true, true) => runbox_types::PullOutcome::Updated,
            (true, false) => runbox_types::PullOutcome::UpToDate,
        });
        if again && changed {
            self.collect_garbage().await?;
        }
        Ok(image)
    }

    /// Pulls `reference` and records it as image `name` (replacing an image
    /// of that name with `replace`); says whether the record changed.
    async fn pull_into(
        &self,
        reference: &str,
        name: &str,
        auth: runbox_image::pull::RegistryAuth,
        progress: mpsc::UnboundedSender<PullEvent>,
        replace: bool,
    ) -> Result<(Image, bool), CoreError> {
        let opts = runbox_image::pull::PullOptions {
            insecure_registries: self.config().insecure_registries.clone(),
            auth,
            ..Default::default()
        };
        let sink = crate::images::StoreSink {
            store: self.images.store().clone(),
        };
        let report = move |event: runbox_image::pull::ProgressEvent| {
            use runbox_image::pull::ProgressEvent as P;
            let event = match event {
                P::Resolved { digest, layers } => PullEvent::Resolved { digest, layers },
                P::LayerStarted { digest, size } => PullEvent::LayerStarted { digest, size },
                P::LayerProgress { digest, done, size } => {
                    PullEvent::LayerProgress { digest, done, size }
                }
                P::LayerSkipped { digest } => PullEvent::LayerSkipped { digest },
                P::LayerDone { digest } => PullEvent::LayerDone { digest },
            };
            let _ = progress.send(event);
        };
        // Layers a pull has stored are not referenced until it records the
        // image: hold off garbage collection until then.
        let guard = self.images.import_guard();
        let pulled = runbox_image::pull::pull(reference, &opts, &sink, &report)
            .await
            .map_err(crate::images::pull_error)?;
        let recorded = self
            .images
            .record_pulled(name, &pulled, &self.config().server_id, replace);
        drop(guard);
        let (image, changed) = recorded?;
        if changed {
            tracing::info!(image = %name, reference = %pulled.reference, digest = %pulled.manifest_digest, "image pulled");
        }
        Ok((image, changed))
    }

    /// Validates a pull request; returns the reference and the local name.
    pub fn check_pull(&self, req: &PullRequest) -> Result<(String, String), CoreError> {
        let reference = req.reference.trim();
        if reference.is_empty()
            || reference.len() > 512
            || reference
                .chars()
                .any(|c| c.is_whitespace() || c.is_control())
        {
            return Err(CoreError::invalid(
                ErrorCode::BadReference,
                "reference must be 1-512 characters without spaces, e.g. docker.io/library/busybox:1.36",
            ));
        }
        let name = req
            .name
            .clone()
            .unwrap_or_else(|| crate::images::default_name(reference));
        validate::new_image_name(&name)?;
        if let Ok(existing) = self.images.get(&name, &self.config().server_id, false) {
            // The same reference again is a refresh; anything else under
            // that name is another image.
            let same = runbox_image::pull::normalise(reference)
                .is_ok_and(|wanted| wanted == existing.source);
            if !same {
                return Err(CoreError::Conflict {
                    code: ErrorCode::ImageExists,
                    message: format!(
                        "an image named {name:?} already exists and came from {:?}, not {:?}; remove it or pull with another name",
                        existing.source, reference
                    ),
                });
            }
        }
        Ok((reference.to_owned(), name))
    }

    /// Every image.
    pub fn list_images(&self) -> Result<Vec<Image>, CoreError> {
        self.images.list(&self.config().server_id)
    }

    /// One image, with its config document.
    pub fn get_image(&self, name: &str) -> Result<Image, CoreError> {
        self.images.get(name, &self.config().server_id, true)
    }

    /// Removes an image no run uses.
    ///
    /// Cancellation: the removal runs in a task of its own, so a client that
    /// hangs up cannot release the image lock between the in-use check and
    /// the record's removal.
    pub async fn delete_image(self: &Arc<Self>, name: String) -> Result<(), CoreError> {
        validate::image_name(&name)?;
        let manager = self.clone();
        tokio::spawn(async move {
            let images = manager.images.clone();
            // A run being torn down still mounts the image for a moment
            // (E2B's kill answers before its teardown ends): wait for it,
            // so the image's layers go with its record.
            let until = tokio::time::Instant::now() + ENDING_WAIT;
            while manager.context.ledger.image_ending(&name) && tokio::time::Instant::now() < until
            {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            {
                let _guard = manager.image_lock.lock().await;
                if manager.image_in_use(&name) {
                    return Err(CoreError::Conflict {
                        code: ErrorCode::ImageInUse,
                        message: format!("image {name:?} is used by a run; delete the run first"),
                    });
                }
                // The record goes under the lock, so no run can start from
                // the image once the in-use check passed; its layers go off
                // the lock.
                tokio::task::spawn_blocking(move || images.forget(&name))
                    .await
                    .map_err(|e| CoreError::Store(format!("image removal task failed: {e}")))??;
            }
            manager.collect_garbage().await
        })
        .await
        .map_err(|e| CoreError::Store(format!("image removal task failed: {e}")))?
    }
}
