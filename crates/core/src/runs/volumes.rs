//! Named volumes through the manager: made and deleted here, mounted by
//! creates. Who holds a volume is the ledger's to say (each run's owner
//! reports its mounts), and a create's reservation and a delete are each
//! one step of the ledger's, so they cannot both pass.

use std::sync::Arc;

use runbox_types::{ErrorCode, VolumeMode, VolumeMountRequest};
use time::OffsetDateTime;
use ulid::Ulid;

use super::Manager;
use crate::error::CoreError;
use crate::lane::VolumeBind;
use crate::volumes::{self, RunVolumeRecord, VolumeRecord};

/// Where a volume is mounted when its mount names no path.
pub const DEFAULT_VOLUME_DIR: &str = "/volumes";

/// A lane's refusal to make a volume, as the API says it.
fn lane_error(e: crate::lane::LaneError) -> CoreError {
    match e {
        crate::lane::LaneError::Unsupported(why) => CoreError::invalid(
            ErrorCode::VolumesUnsupported,
            format!("this server cannot make volumes: {why}"),
        ),
        e => CoreError::Lane(e),
    }
}

pub(crate) fn not_found(name: &str) -> CoreError {
    CoreError::invalid(
        ErrorCode::VolumeNotFound,
        format!("no volume named {name:?}; make it first (POST /v1/volumes)"),
    )
}

impl Manager {
    /// Makes a volume for `tenant` (None: the operator).
    pub async fn create_volume(
        &self,
        req: runbox_types::CreateVolumeRequest,
        tenant: Option<&str>,
    ) -> Result<runbox_types::Volume, CoreError> {
        let size_mb = req.size_mb.unwrap_or(self.config().volume_default_mb);
        let labels = req.labels.unwrap_or_default();
        let lane = self.lane.clone();
        self.make_volume(req.name, tenant, size_mb, labels, |id| async move {
            lane.create_volume(id, size_mb << 20)
                .await
                .map_err(lane_error)
        })
        .await
    }

    /// Makes a new volume of `tenant`'s holding what its volume `name`
    /// holds now (constant time; what a crash at this moment would leave,
    /// if a run writes to it meanwhile).
    pub async fn clone_volume(
        &self,
        name: &str,
        req: runbox_types::CloneVolumeRequest,
        tenant: Option<&str>,
    ) -> Result<runbox_types::Volume, CoreError> {
        let source = self
            .volumes
            .find(tenant, name)
            .ok_or_else(|| not_found(name))?;
        let size_mb = req.size_mb.unwrap_or(source.size_mb);
        if let Some(used) = self.lane.volume_used(source.id) {
            if size_mb << 20 < used {
                return Err(CoreError::invalid(
                    ErrorCode::BadVolume,
                    format!(
                        "sizeMb {size_mb} is less than volume {name:?} holds ({} MiB)",
                        used.div_ceil(1 << 20)
                    ),
                ));
            }
        }
        let (lane, volumes) = (self.lane.clone(), self.volumes.clone());
        let source_name = name.to_owned();
        let labels = req.labels.unwrap_or_else(|| source.labels.clone());
        self.make_volume(req.name, tenant, size_mb, labels, |id| async move {
            // Under the volume lock: a delete that came first is seen here.
            if !volumes.exists(source.id) {
                return Err(not_found(&source_name));
            }
            lane.clone_volume(source.id, id, size_mb << 20)
                .await
                .map_err(lane_error)
        })
        .await
    }

    /// Checks a new volume's name and size, makes it with `make` (given
    /// its id) and records it; one at a time, so a name is checked, made
    /// and recorded with nobody else in between. Nothing is left of a
    /// volume that is not recorded.
    async fn make_volume<F, Fut>(
        &self,
        name: String,
        tenant: Option<&str>,
        size_mb: u64,
        labels: std::collections::BTreeMap<String, String>,
        make: F,
    ) -> Result<runbox_types::Volume, CoreError>
    where
        F: FnOnce(Ulid) -> Fut,
        Fut: std::future::Future<Output = Result<(), CoreError>>,
    {
        volumes::check_name(&name)?;
        crate::validate::labels(&labels)?;
        let max = self.config().volume_max_mb;
        if size_mb == 0 || size_mb > max {
            return Err(CoreError::invalid(
                ErrorCode::BadVolume,
                format!("sizeMb must be 1-{max} (this server's --volume-max-mb), got {size_mb}"),
            ));
        }
        let _made = self.volume_lock.lock().await;
        if self.volumes.find(tenant, &name).is_some() {
            return Err(CoreError::invalid(
                ErrorCode::VolumeExists,
                format!("you have a volume named {name:?} already"),
            ));
        }
        if self.dataset(&name, None).is_some() {
            return Err(CoreError::invalid(
                ErrorCode::VolumeExists,
                format!("{name:?} is a dataset of this server's catalog; pick another name"),
            ));
        }
        let record = VolumeRecord {
            moving: None,
            id: Ulid::new(),
            name,
            tenant: tenant.map(str::to_owned),
            size_mb,
            created_at: OffsetDateTime::now_utc(),
            labels,
        };
        make(record.id).await?;
        let volumes = self.volumes.clone();
        let kept = record.clone();
        let added = tokio::task::spawn_blocking(move || volumes.add(kept))
            .await
            .map_err(|e| CoreError::Store(format!("volume store task failed: {e}")))?;
        // The name check above holds the lock, so neither failure happens
        // but through a failing store; nothing of the volume is kept.
        let failure = match added {
            Ok(Ok(())) => None,
            Ok(Err(_)) => Some(CoreError::invalid(
                ErrorCode::VolumeExists,
                "the volume exists already",
            )),
            Err(e) => Some(e),
        };
        if let Some(e) = failure {
            if let Err(e) = self.lane.delete_volume(record.id).await {
                tracing::warn!(volume = %record.id, error = %e, "could not delete a volume that was not recorded");
            }
            return Err(e);
        }
        tracing::info!(volume = %record.id, name = %record.name, size_mb, "volume made");
        let holders = self.holders_of(record.id);
        Ok(self.volume_view(&record, holders))
    }

    /// The runs that mount volume `id`, and how.
    pub(super) fn holders_of(&self, id: Ulid) -> Vec<runbox_types::VolumeHolder> {
        self.context
            .ledger
            .holders()
            .remove(&id)
            .unwrap_or_default()
    }

    /// The caller's volumes (the operator, `tenant` None, sees every one,
    /// each stamped with its tenant).
    pub fn list_volumes(&self, tenant: Option<&str>) -> runbox_types::VolumeList {
        let mut held = self.context.ledger.holders();
        let mut volumes: Vec<runbox_types::Volume> = self
            .volumes
            .all()
            .iter()
            .filter(|v| tenant.is_none() || v.tenant.as_deref() == tenant)
            .map(|v| self.volume_view(v, held.remove(&v.id).unwrap_or_default()))
            .collect();
        volumes.extend(
            self.config()
                .datasets
                .iter()
                .filter(|d| d.admits(tenant))
                .map(|d| {
                    dataset_view(
                        d,
                        held.remove(&d.id()).unwrap_or_default(),
                        &self.config().server_id,
                    )
                }),
        );
        runbox_types::VolumeList { volumes }
    }

    /// The caller's volume `name`.
    pub fn get_volume(
        &self,
        name: &str,
        tenant: Option<&str>,
    ) -> Result<runbox_types::Volume, CoreError> {
        let Some(record) = self.volumes.find(tenant, name) else {
            let dataset = self.dataset(name, tenant).ok_or_else(|| not_found(name))?;
            let holders = self.holders_of(dataset.id());
            return Ok(dataset_view(&dataset, holders, &self.config().server_id));
        };
        let holders = self.holders_of(record.id);
        Ok(self.volume_view(&record, holders))
    }

    /// Deletes the caller's volume `name` and everything in it; refused
    /// while a run mounts it (hibernated and archived runs too).
    pub async fn delete_volume(&self, name: &str, tenant: Option<&str>) -> Result<(), CoreError> {
        let _deleting = self.volume_lock.lock().await;
        let record = self
            .volumes
            .find(tenant, name)
            .ok_or_else(|| not_found(name))?;
        // The record goes in one step with the holds: a create reserved
        // after this finds it gone.
        let volumes = self.volumes.clone();
        let id = record.id;
        self.context
            .ledger
            .retire_volume(id, name, &mut || volumes.remove(id))
            .await?;
        self.lane.delete_volume(record.id).await?;
        tracing::info!(volume = %record.id, name, "volume deleted");
        Ok(())
    }

    /// The API view of a volume: its record, `holders` and usage.
    pub(super) fn volume_view(
        &self,
        record: &VolumeRecord,
        holders: Vec<runbox_types::VolumeHolder>,
    ) -> runbox_types::Volume {
        runbox_types::Volume {
            id: record.id,
            name: record.name.clone(),
            server: self.config().server_id.clone(),
            size_mb: record.size_mb,
            used_bytes: self.lane.volume_used(record.id),
            holders,
            created_at: record.created_at,
            tenant: record.tenant.clone(),
            labels: record.labels.clone(),
            dataset: None,
        }
    }

    /// The catalog dataset `name` that `tenant` (None: the operator) may
    /// mount, if any.
    pub(crate) fn dataset(
        &self,
        name: &str,
        tenant: Option<&str>,
    ) -> Option<crate::datasets::DatasetEntry> {
        self.config()
            .datasets
            .iter()
            .find(|d| d.name == name && d.admits(tenant))
            .cloned()
    }

    /// Checks a create's `volumes` against the caller's volumes and each
    /// other (and the warm volume's path): what the run will mount.
    pub(super) fn check_volume_mounts(
        &self,
        mounts: Option<&[VolumeMountRequest]>,
        tenant: Option<&str>,
        warm_path: Option<&str>,
    ) -> Result<Vec<RunVolumeRecord>, CoreError> {
        let mounts = mounts.unwrap_or_default();
        if mounts.len() > runbox_types::MAX_RUN_VOLUMES {
            return Err(CoreError::invalid(
                ErrorCode::BadVolume,
                format!(
                    "a run mounts at most {} volumes, not {}",
                    runbox_types::MAX_RUN_VOLUMES,
                    mounts.len()
                ),
            ));
        }
        let mut out: Vec<RunVolumeRecord> = Vec::with_capacity(mounts.len());
        for mount in mounts {
            volumes::check_name(&mount.name)?;
            let path = match &mount.path {
                Some(path) => volumes::mount_path(&mount.name, path)?,
                None => format!("{DEFAULT_VOLUME_DIR}/{}", mount.name),
            };
            if out.iter().any(|v| v.name == mount.name) {
                return Err(CoreError::invalid(
                    ErrorCode::BadVolume,
                    format!("volume {:?} is named twice", mount.name),
                ));
            }
            let clash = out
                .iter()
                .map(|v| v.path.as_str())
                .chain(warm_path)
                .find(|other| volumes::overlaps(other, &path));
            if let Some(other) = clash {
                return Err(CoreError::invalid(
                    ErrorCode::BadPath,
                    format!(
                        "volume {:?}: mount path {path:?} is, holds or lies in {other:?}, another mount of this run",
                        mount.name
                    ),
                ));
            }
            if let Some(record) = self.volumes.find(tenant, &mount.name) {
                out.push(RunVolumeRecord {
                    id: record.id,
                    name: record.name,
                    path,
                    mode: mount.mode.unwrap_or_default(),
                    dataset: false,
                });
                continue;
            }
            let dataset = self
                .dataset(&mount.name, tenant)
                .ok_or_else(|| not_found(&mount.name))?;
            // A dataset is read-only unless asked otherwise, and writable
            // only where the catalog says so.
            let mode = mount.mode.unwrap_or(VolumeMode::Ro);
            if mode == VolumeMode::Rw && !dataset.writable {
                return Err(CoreError::invalid(
                    ErrorCode::BadVolume,
                    format!(
                        "dataset {:?} is read-only in this server's catalog; mount it ro",
                        mount.name
                    ),
                ));
            }
            out.push(RunVolumeRecord {
                id: dataset.id(),
                name: dataset.name,
                path,
                mode,
                dataset: true,
            });
        }
        Ok(out)
    }

    /// Refuses a dataset mount the catalog cannot serve now (its holds,
    /// and named volumes', are the ledger's to check, before this).
    pub(super) fn dataset_ready(&self, mount: &RunVolumeRecord) -> Result<(), CoreError> {
        let entry = self
            .dataset(&mount.name, None)
            .ok_or_else(|| not_found(&mount.name))?;
        match entry.unavailable(mount.mode == VolumeMode::Rw) {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    /// At start: holds each dataset again for the restored runs that hold
    /// it (mounting images a host restart unmounted), and unmounts what a
    /// previous daemon left mounted that no run holds.
    pub(super) fn restore_datasets(&self) {
        let catalog = self.config().datasets.clone();
        let mut held = std::collections::HashSet::new();
        for handle in self.registry().values() {
            let record = handle.snapshot().record;
            for mount in record.volumes.iter().filter(|m| m.dataset) {
                let Some(entry) = catalog.iter().find(|d| d.name == mount.name) else {
                    tracing::warn!(run = %record.id, dataset = %mount.name, "a run holds a dataset the catalog no longer lists; it is not mounted again");
                    continue;
                };
                held.insert(entry.name.clone());
                if let Err(e) =
                    self.lane
                        .hold_dataset(entry, mount.mode == VolumeMode::Rw, record.id)
                {
                    tracing::warn!(run = %record.id, dataset = %entry.name, error = %e, "could not mount a dataset a restored run holds");
                }
            }
        }
        self.lane.sweep_datasets(&catalog, &held);
    }
}

/// What the lane mounts for `mounts` (`catalog`: the datasets').
pub(crate) fn binds(
    mounts: &[RunVolumeRecord],
    catalog: &[crate::datasets::DatasetEntry],
) -> Vec<VolumeBind> {
    mounts
        .iter()
        .map(|m| VolumeBind {
            id: m.id,
            path: m.path.clone(),
            read_only: m.mode == VolumeMode::Ro,
            dataset: m
                .dataset
                .then(|| catalog.iter().find(|d| d.name == m.name).cloned())
                .flatten(),
        })
        .collect()
}

/// Gives back to `lane` the datasets run `id` held (`mounts`, its
/// record's) once it is gone; off the async workers (an unmount may wait
/// on the disk).
pub(crate) fn release_datasets(
    lane: &Arc<dyn crate::lane::Lane>,
    catalog: &[crate::datasets::DatasetEntry],
    id: Ulid,
    mounts: &[RunVolumeRecord],
) {
    for mount in mounts.iter().filter(|m| m.dataset) {
        let Some(entry) = catalog.iter().find(|d| d.name == mount.name).cloned() else {
            continue;
        };
        let lane = lane.clone();
        tokio::task::spawn_blocking(move || lane.release_dataset(&entry, id));
    }
}

/// The API view of catalog dataset `entry`, held by `holders`.
fn dataset_view(
    entry: &crate::datasets::DatasetEntry,
    holders: Vec<runbox_types::VolumeHolder>,
    server: &str,
) -> runbox_types::Volume {
    runbox_types::Volume {
        id: entry.id(),
        name: entry.name.clone(),
        server: server.to_owned(),
        size_mb: entry.size_mb(),
        used_bytes: None,
        holders,
        created_at: OffsetDateTime::UNIX_EPOCH,
        tenant: None,
        labels: Default::default(),
        dataset: Some(entry.state(false)),
    }
}
