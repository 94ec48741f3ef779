//! Volumes that move between the nodes of a fleet, through the checkpoint
//! bucket both nodes use.
//!
//! A volume lives on one node. Moving it, while no run mounts it:
//!
//! 1. The node it leaves marks it moving in its record (durably, in one
//!    step of the ledger with the check that nothing holds it: from then
//!    on no run mounts it and nothing writes or deletes it), starts the
//!    move in the fleet's database, and writes its files to the bucket as
//!    one layer with a note of what the volume is (an uncommitted
//!    checkpoint generation under the move's id: no listing shows it, and
//!    the sweep removes what a crash leaves).
//! 2. The node it goes to, told of the move, makes the volume under the
//!    same id from the bucket (checked against the digests), records it as
//!    arriving (nothing finds it yet), and ends the move as `arrived` in
//!    the database; then it is that node's.
//! 3. The node it left ends the move as `back` unless it ended already,
//!    and acts on how it ended: arrived, it deletes its copy; back, the
//!    volume is its own again and the other node drops what it made.
//!
//! The database's compare-and-set decides, so a broken connection or a
//! crash of either node at any step leaves the volume on exactly one node:
//! each node settles the moves its records still show when it starts and
//! every [`SETTLE_EVERY`] after, until the database answers.

use std::sync::Arc;
use std::time::Duration;

use runbox_types::ErrorCode;
use serde::{Deserialize, Serialize};
use ulid::Ulid;

use super::moves::Destination;
use super::{error_chain, lock, Manager};
use crate::checkpoints::{CheckpointStore, StoredLayer};
use crate::error::CoreError;
use crate::fleet::{Located, VolumeMove};
use crate::volumes::{VolumeMoving, VolumeRecord};

/// How often a node looks again at moves its records show unsettled.
const SETTLE_EVERY: Duration = Duration::from_secs(10);

/// The checkpoint generation a move's objects are under (the move's id is
/// the checkpoint id; it is never committed).
const PARCEL: u64 = 1;

/// The note that says what the volume is.
const NOTE: &str = "volume.json";

/// The version of [`Parcel`] this daemon writes.
const PARCEL_VERSION: u32 = 1;

/// What a volume on its way to another node is, beside its files.
#[derive(Debug, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
struct Parcel {
    version: u32,
    /// Its record as the node it left had it.
    volume: VolumeRecord,
    /// The node it left.
    from: String,
    /// The node it goes to.
    to: String,
    /// Its files, as one layer.
    files: StoredLayer,
}

/// A volume that left this node's hands for another node (see
/// [`Manager::leave_volume`]): the move is not over until
/// [`Manager::finish_volume_move`].
#[derive(Clone, Debug)]
pub struct VolumeDeparture {
    /// The volume.
    pub volume: Ulid,
    /// The move.
    pub id: Ulid,
    /// What the node it goes to is told: `<volume>/<move>`.
    pub key: String,
    /// The bytes of its files in the bucket (compressed).
    pub bytes: u64,
    /// That node.
    pub target: Located,
    /// The volume as this node shows it, for the answer when the node it
    /// went to gave none.
    pub view: runbox_types::Volume,
}

/// Volume `name` cannot move, for `why`.
fn not_movable(name: &str, why: &str) -> CoreError {
    CoreError::Conflict {
        code: ErrorCode::NotMovable,
        message: format!("volume {name:?} cannot move: {why}"),
    }
}

/// Marks volume moves under way in this daemon (so the settling leaves
/// them alone) until dropped.
struct Underway<'a> {
    manager: &'a Manager,
    volume: Ulid,
}

impl<'a> Underway<'a> {
    /// None when a call of this daemon is moving `volume` already.
    fn new(manager: &'a Manager, volume: Ulid) -> Option<Underway<'a>> {
        lock(&manager.volume_moves)
            .insert(volume)
            .then_some(Underway { manager, volume })
    }
}

/// A second move of a volume while one is under way.
fn in_motion(name: &str) -> CoreError {
    CoreError::invalid(
        ErrorCode::VolumeBusy,
        format!("volume {name:?} is moving already; retry when that move ends"),
    )
}

impl Drop for Underway<'_> {
    fn drop(&mut self) {
        lock(&self.manager.volume_moves).remove(&self.volume);
    }
}

impl Manager {
    /// Starts moving `tenant`'s volume `name` to node `to` (None: the node
    /// placement picks), while no run mounts it: marked moving here, its
    /// files in the bucket. The caller tells the node it goes to, then
    /// calls [`Manager::finish_volume_move`], whatever that node answered.
    pub async fn leave_volume(
        self: &Arc<Self>,
        name: &str,
        tenant: Option<&str>,
        to: Option<String>,
    ) -> Result<VolumeDeparture, CoreError> {
        let refuse = |why: &str| not_movable(name, why);
        let Some(fleet) = self.fleet().cloned() else {
            return Err(refuse("this node is not part of a fleet"));
        };
        let Some(record) = self.volumes.find(tenant, name) else {
            if self.dataset(name, tenant).is_some() {
                return Err(refuse(
                    "it is a dataset of the operator's catalog, which each node serves from its own copy",
                ));
            }
            return Err(super::volumes::not_found(name));
        };
        let Some(bucket) = self.shared_bucket() else {
            return Err(refuse(
                "its node's checkpoint store is not a bucket other nodes can share \
                 (--checkpoint-store s3://...)",
            ));
        };
        let dir = self
            .lane
            .volume_dir(record.id)
            .ok_or_else(|| refuse("this node's lane keeps no volume files"))?;
        let store = self.checkpoint_store()?;
        let target = self
            .destination(
                &fleet,
                Destination {
                    to,
                    bucket,
                    needs: vec!["diskLimit".to_owned()],
                    images: Vec::new(),
                    tenant: record.tenant.clone(),
                    what: &format!("volume {name:?}"),
                    refuse: &refuse,
                },
            )
            .await?;
        let moving = VolumeMoving {
            id: Ulid::new(),
            to: target.node.clone(),
            arriving: false,
        };
        let underway = Underway::new(self, record.id).ok_or_else(|| in_motion(name))?;
        {
            let _one = self.volume_lock.lock().await;
            let (volumes, id, marked) = (self.volumes.clone(), record.id, moving.clone());
            self.context
                .ledger
                .retire_volume(id, name, &mut || {
                    volumes.set_moving(id, Some(marked.clone()))
                })
                .await?;
        }
        let here = self.config().server_id.clone();
        let sent = async {
            if !fleet
                .begin_volume_move(record.id, moving.id, &target.node)
                .await?
            {
                return Err(refuse("another move of it is under way"));
            }
            let mut upload = store.begin(moving.id, PARCEL);
            let files = upload
                .put_layer(move |out| {
                    runbox_image::capture::upper_to_tar(&dir, &[], out).map(|_| ())
                })
                .await?;
            let parcel = Parcel {
                version: PARCEL_VERSION,
                volume: VolumeRecord {
                    moving: None,
                    ..record.clone()
                },
                from: here.clone(),
                to: target.node.clone(),
                files,
            };
            let note = serde_json::to_vec_pretty(&parcel)
                .map_err(|e| CoreError::Store(format!("encoding a volume's move: {e}")))?;
            store.put_note(moving.id, PARCEL, NOTE, note).await?;
            Ok(parcel.files)
        }
        .await;
        let files = match sent {
            Ok(files) => files,
            Err(e) => {
                // The node it goes to was not told: nothing can have
                // arrived, so the volume is this node's again whatever the
                // database says (a new move of it from here ends a row
                // left `moving` first).
                let _ = fleet
                    .end_volume_move(record.id, moving.id, VolumeMove::Back)
                    .await;
                self.volumes.set_moving(record.id, None)?;
                let _ = store.discard(moving.id, PARCEL).await;
                return Err(e);
            }
        };
        // Still under way: finish_volume_move ends the mark.
        std::mem::forget(underway);
        let holders = self.holders_of(record.id);
        Ok(VolumeDeparture {
            volume: record.id,
            id: moving.id,
            key: format!("{}/{}", record.id, moving.id),
            bytes: files.size,
            target,
            view: self.volume_view(&record, holders),
        })
    }

    /// Ends the move [`Manager::leave_volume`] started (`departure`),
    /// after the node it goes to answered (or did not): as that node ended
    /// it, or as `back` if it did not. Arrived, this node's copy is
    /// deleted; back, the volume is this node's again. A database that
    /// does not answer leaves it to the settling.
    pub async fn finish_volume_move(
        &self,
        departure: &VolumeDeparture,
    ) -> Result<VolumeMove, CoreError> {
        let volume = departure.volume;
        let _underway = Underway {
            manager: self,
            volume,
        };
        let record = self
            .volumes
            .get(volume)
            .filter(|r| {
                r.moving
                    .as_ref()
                    .is_some_and(|m| !m.arriving && m.id == departure.id)
            })
            .ok_or_else(|| CoreError::Store(format!("volume {volume} is not leaving")))?;
        self.settle(&record, VolumeMove::Back).await
    }

    /// Makes the volume that move `key` (`<volume>/<move>`) brings from
    /// another node of the fleet this node's, for `tenant` (whose volume it
    /// must be): its files from the bucket, checked; then the move ends as
    /// arrived, unless the node it left ended it first.
    pub async fn arrive_volume(
        self: &Arc<Self>,
        key: &str,
        tenant: Option<&str>,
    ) -> Result<runbox_types::Volume, CoreError> {
        let bad = || {
            CoreError::invalid(
                ErrorCode::BadRequest,
                format!("{key:?} is not a volume move (<volume>/<move>)"),
            )
        };
        let (volume, id) = key.split_once('/').ok_or_else(bad)?;
        let (volume, id) = (
            volume.parse::<Ulid>().map_err(|_| bad())?,
            id.parse::<Ulid>().map_err(|_| bad())?,
        );
        if self.fleet().is_none() {
            return Err(bad());
        }
        let store = self.checkpoint_store()?;
        let here = self.config().server_id.clone();
        let gone = || {
            CoreError::invalid(
                ErrorCode::VolumeNotFound,
                format!("no volume is on its way to node {here} under {key}"),
            )
        };
        let note = store.read_note(id, PARCEL, NOTE).await?.ok_or_else(gone)?;
        let parcel: Parcel = serde_json::from_slice(&note).map_err(|e| {
            CoreError::invalid(
                ErrorCode::CheckpointCorrupt,
                format!("the note of volume move {key} is damaged: {e}"),
            )
        })?;
        if parcel.version != PARCEL_VERSION
            || parcel.volume.id != volume
            || parcel.to != here
            || parcel.volume.tenant.as_deref() != tenant
        {
            return Err(gone());
        }
        let _underway =
            Underway::new(self, volume).ok_or_else(|| in_motion(&parcel.volume.name))?;
        let record = VolumeRecord {
            moving: Some(VolumeMoving {
                id,
                to: here.clone(),
                arriving: true,
            }),
            ..parcel.volume.clone()
        };
        {
            let _one = self.volume_lock.lock().await;
            let name = &record.name;
            if self.volumes.exists(volume) || self.volumes.find(tenant, name).is_some() {
                return Err(CoreError::invalid(
                    ErrorCode::VolumeExists,
                    format!("node {here} has a volume named {name:?} already"),
                ));
            }
            self.lane
                .create_volume(volume, record.size_mb << 20)
                .await
                .map_err(|e| match e {
                    crate::lane::LaneError::Unsupported(why) => {
                        not_movable(name, &format!("node {here} cannot make volumes: {why}"))
                    }
                    e => CoreError::Lane(e),
                })?;
            let unpacked = self.unpack_volume(&store, id, &parcel).await;
            let added = match unpacked {
                Ok(()) => {
                    let (volumes, kept) = (self.volumes.clone(), record.clone());
                    tokio::task::spawn_blocking(move || volumes.add(kept))
                        .await
                        .map_err(|e| CoreError::Store(format!("volume store task failed: {e}")))
                        .and_then(|added| added)
                        .and_then(|added| {
                            added.map_err(|_| {
                                CoreError::invalid(
                                    ErrorCode::VolumeExists,
                                    format!("node {here} has a volume named {name:?} already"),
                                )
                            })
                        })
                }
                Err(e) => Err(e),
            };
            if let Err(e) = added {
                if let Err(e) = self.lane.delete_volume(volume).await {
                    tracing::warn!(volume = %volume, error = %e, "could not delete a volume that did not arrive");
                }
                return Err(e);
            }
        }
        // On disk before the node it left deletes its copy.
        if let Some(dir) = self.lane.volume_dir(volume) {
            tokio::task::spawn_blocking(move || {
                let dir = std::fs::File::open(&dir)?;
                rustix::fs::syncfs(&dir).map_err(std::io::Error::from)
            })
            .await
            .map_err(|e| CoreError::Store(format!("volume sync task failed: {e}")))?
            .map_err(CoreError::io("flushing an arrived volume to disk"))?;
        }
        match self.settle(&record, VolumeMove::Arrived).await? {
            VolumeMove::Arrived => {
                tracing::info!(volume = %volume, name = %record.name, from = %parcel.from, "volume arrived from another node");
                let holders = self.holders_of(volume);
                Ok(self.volume_view(&record, holders))
            }
            _ => Err(CoreError::Conflict {
                code: ErrorCode::NotMovable,
                message: format!(
                    "volume {:?} stays on node {}: that node called the move off",
                    record.name, parcel.from
                ),
            }),
        }
    }

    /// Writes the files of the volume `parcel` brings (move `id`) into its
    /// new, empty volume here, checked against the parcel's digests.
    async fn unpack_volume(
        &self,
        store: &CheckpointStore,
        id: Ulid,
        parcel: &Parcel,
    ) -> Result<(), CoreError> {
        let dir = self
            .lane
            .volume_dir(parcel.volume.id)
            .ok_or_else(|| not_movable(&parcel.volume.name, "this node keeps no volume files"))?;
        let damaged = |why: String| {
            CoreError::invalid(
                ErrorCode::CheckpointCorrupt,
                format!(
                    "volume {:?} did not arrive whole and was not kept: {why}",
                    parcel.volume.name
                ),
            )
        };
        runbox_image::store::digest_hex(&parcel.files.digest)
            .and_then(|_| runbox_image::store::digest_hex(&parcel.files.diff_id))
            .map_err(|e| damaged(e.to_string()))?;
        let (digest, diff_id) = (parcel.files.digest.clone(), parcel.files.diff_id.clone());
        let limits = runbox_image::unpack::UnpackLimits {
            max_bytes: parcel.volume.size_mb << 20,
            max_entries: 10_000_000,
            ..Default::default()
        };
        let mut writer = Some(
            crate::images::unpacker(move |reader| {
                runbox_image::store::unpack_checked(&digest, Some(&diff_id), reader, &dir, &limits)
                    .map(|_| ())
            })
            .map_err(CoreError::io("unpacking a volume"))?,
        );
        use runbox_image::pull::LayerWriter;
        let read = store
            .read_stored(id, PARCEL, &parcel.files, |chunk| match writer.as_mut() {
                Some(w) => w.write(chunk),
                None => Err(std::io::Error::other("the unpacker stopped")),
            })
            .await;
        let writer = Box::new(writer.take().expect("taken only here"));
        match read {
            Ok(()) => writer.finish().map_err(|e| damaged(e.to_string())),
            Err(e) => {
                writer.abort();
                Err(e)
            }
        }
    }

    /// Ends volume `record`'s move as `end` (arrived, by the node it goes
    /// to; back, by either) unless it ended already, and acts on how it
    /// ended: the volume is kept, or what is here of it deleted. A
    /// database that does not answer leaves it to the settling.
    async fn settle(
        &self,
        record: &VolumeRecord,
        end: VolumeMove,
    ) -> Result<VolumeMove, CoreError> {
        let fleet = self
            .fleet()
            .cloned()
            .ok_or_else(|| CoreError::Store("a volume move without a fleet".to_owned()))?;
        let moving = record
            .moving
            .as_ref()
            .ok_or_else(|| CoreError::Store(format!("volume {} is not moving", record.id)))?;
        let end = fleet.end_volume_move(record.id, moving.id, end).await?;
        self.act_on(record, end).await?;
        Ok(end)
    }

    /// Does what move end `end` means for `record` on this node: the
    /// volume is kept (its move cleared) or deleted.
    async fn act_on(&self, record: &VolumeRecord, end: VolumeMove) -> Result<(), CoreError> {
        let Some(moving) = record.moving.clone() else {
            return Ok(());
        };
        let keep = match end {
            VolumeMove::Moving => {
                return Err(CoreError::Store(format!(
                    "volume {}'s move is still under way",
                    record.id
                )))
            }
            VolumeMove::Arrived => moving.arriving,
            VolumeMove::Back => !moving.arriving,
        };
        let volumes = self.volumes.clone();
        let id = record.id;
        if keep {
            tokio::task::spawn_blocking(move || volumes.set_moving(id, None))
                .await
                .map_err(|e| CoreError::Store(format!("volume store task failed: {e}")))??;
        } else {
            tokio::task::spawn_blocking(move || volumes.remove(id))
                .await
                .map_err(|e| CoreError::Store(format!("volume store task failed: {e}")))??;
            self.lane.delete_volume(id).await?;
        }
        if !moving.arriving {
            // The node it left cleans the bucket; what it cannot, the sweep.
            if let Ok(store) = self.checkpoint_store() {
                let _ = store.discard(moving.id, PARCEL).await;
            }
        }
        tracing::info!(volume = %id, name = %record.name, to = %moving.to, ?end, kept = keep, "volume move settled");
        Ok(())
    }

    /// Settles the moves this node's records show unsettled that no call
    /// of this daemon is making: how many are left (the database did not
    /// answer).
    pub async fn settle_volume_moves(&self) -> usize {
        let mut left = 0;
        for record in self.volumes.in_motion() {
            if lock(&self.volume_moves).contains(&record.id) {
                continue;
            }
            let end = match record.moving.as_ref().is_some_and(|m| m.arriving) {
                true => VolumeMove::Arrived,
                false => VolumeMove::Back,
            };
            let settled = self.settle(&record, end).await;
            if let Err(e) = settled {
                tracing::warn!(volume = %record.id, error = %error_chain(&e), "a volume move is not settled yet");
                left += 1;
            }
        }
        left
    }

    /// Settles unsettled volume moves now and every [`SETTLE_EVERY`].
    pub fn spawn_volume_settle(self: &Arc<Self>) {
        let manager = Arc::downgrade(self);
        tokio::spawn(async move {
            loop {
                let Some(m) = manager.upgrade() else { return };
                if !m.volumes.in_motion().is_empty() {
                    m.settle_volume_moves().await;
                }
                drop(m);
                tokio::time::sleep(SETTLE_EVERY).await;
            }
        });
    }
}
