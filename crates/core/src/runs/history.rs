//! Run history: with `history: {keep: N}`, the run's files are kept as a
//! point after every command and file call that changed one, to diff, roll
//! back to, fork or snapshot from.
//!
//! A point is the lane's ([`crate::lane::Sandbox::keep_point`]): on btrfs
//! a read-only snapshot of the run's disk, sharing every block with it, so
//! a point costs only what is overwritten after it. Whether anything
//! changed is decided by the lane from the storage's transaction numbers
//! (no tree walk): a command that wrote nothing leaves no point. What a
//! point changed (its summary, its diff) is found by comparing its
//! writable layer with its parent's, over the run's image layers
//! ([`runbox_image::diff`]).
//!
//! The points form a line: each one's parent is the point the run's files
//! were at before it. A rollback returns the files to a point (the run is
//! hibernated and booted on a copy of it); the points after it stay, so
//! the rollback can be undone, until the next change drops them. Before a
//! rollback, changes made since the last point are kept as a point of
//! their own, so nothing is lost by one.
//!
//! Points are taken under the run's history lock, one at a time; a
//! rollback holds it from start to end, so no point is made of a run being
//! rolled back. Nothing under the lock asks the run's owner for anything
//! but the rollback itself.

use std::sync::Arc;

use runbox_types::{
    ChangeSummary, ErrorCode, FileKind, HistoryDiff, HistoryList, HistoryPoint, PathChange,
    PathChangeKind, PathState, PointCause, PointKind,
};
use serde::{Deserialize, Serialize};
use time::OffsetDateTime;
use ulid::Ulid;

use super::actor::{Command, RunHandle};
use super::Manager;
use crate::error::CoreError;
use crate::lane::{Sandbox, Since};

/// The most paths one diff answer lists.
pub const MAX_DIFF_PATHS: usize = 10_000;

/// The paths a diff lists when its query names no limit.
pub const DEFAULT_DIFF_PATHS: usize = 1_000;

/// The most bytes of patches one diff answer carries; files past it are
/// listed without one (`binary`).
const PATCH_BUDGET: usize = 8 << 20;

/// What the core says of a point (kept beside it by the lane, as JSON).
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
struct PointMeta {
    #[serde(with = "time::serde::rfc3339")]
    created_at: OffsetDateTime,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    parent: Option<Ulid>,
    cause: PointCause,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    changes: Option<ChangeSummary>,
}

/// One kept point, as the core knows it.
#[derive(Clone, Debug)]
struct Point {
    id: Ulid,
    transid: u64,
    meta: PointMeta,
}

/// A run's points, loaded from its lane on first use.
#[derive(Debug, Default)]
struct Book {
    /// Oldest first.
    points: Vec<Point>,
    /// The point the files were returned to while later ones are kept.
    head: Option<Ulid>,
    /// The [`HistoryCell::forget`] count it was loaded at.
    epoch: u64,
}

impl Book {
    fn load(sandbox: &dyn Sandbox) -> Book {
        let history = sandbox.points();
        let points = history
            .points
            .into_iter()
            .filter_map(|kept| {
                let meta = serde_json::from_slice(&kept.meta).ok()?;
                Some(Point {
                    id: kept.id,
                    transid: kept.transid,
                    meta,
                })
            })
            .collect::<Vec<_>>();
        let head = history.head.filter(|h| points.iter().any(|p| p.id == *h));
        Book {
            points,
            head,
            epoch: 0,
        }
    }

    /// The point the files are at (or descend from).
    fn current(&self) -> Option<&Point> {
        match self.head {
            Some(head) => self.points.iter().find(|p| p.id == head),
            None => self.points.last(),
        }
    }

    fn get(&self, id: Ulid) -> Option<&Point> {
        self.points.iter().find(|p| p.id == id)
    }
}

/// A run's history state, on its handle.
#[derive(Default)]
pub(crate) struct HistoryCell {
    book: tokio::sync::Mutex<Option<Book>>,
    /// Where changes are the run's own from, set each time it boots (the
    /// lane's own writes while booting are not).
    booted: std::sync::Mutex<Option<Since>>,
    /// How many times the lane dropped the run's points with its disk.
    epoch: std::sync::atomic::AtomicU64,
    /// How many times the run's disk was replaced (rollbacks): a change
    /// admitted before one is not the replaced disk's to keep.
    disk: std::sync::atomic::AtomicU64,
}

impl HistoryCell {
    /// The run's disk and points were dropped (an archive): the book is
    /// read from the lane again on its next use.
    pub fn forget(&self) {
        self.epoch.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
    }

    /// The run's book, loaded from its lane when it was never read or the
    /// points were dropped since.
    fn open<'a>(&self, book: &'a mut Option<Book>, sandbox: &dyn Sandbox) -> &'a mut Book {
        let epoch = self.epoch.load(std::sync::atomic::Ordering::SeqCst);
        if book.as_ref().is_none_or(|b| b.epoch != epoch) {
            *book = Some(Book {
                epoch,
                ..Book::load(sandbox)
            });
        }
        book.get_or_insert_with(Book::default)
    }

    /// Records that the run booted on its disk: changes are counted from
    /// `since` on.
    pub fn booted(&self, since: Since) {
        *self.booted.lock().unwrap_or_else(|p| p.into_inner()) = Some(since);
    }

    /// Where the changes after `point` start: after the point, or after
    /// the run's last boot when that was later.
    fn since(&self, point: &Point) -> Since {
        let made = Since {
            transid: point.transid,
            at: point.meta.created_at.into(),
            point: Some(point.id),
        };
        match *self.booted.lock().unwrap_or_else(|p| p.into_inner()) {
            // Booted since: the point is not what the files were at the
            // boot (the boot touched them), so reads are told apart by
            // time instead.
            Some(booted) if booted.transid > made.transid => booted,
            _ => made,
        }
    }
}

/// Takes a run's points: made where a change is admitted, used when it
/// ends.
#[derive(Clone)]
pub(crate) struct Recorder {
    handle: Arc<RunHandle>,
    /// The run's disk ([`HistoryCell::disk`]) when the change was
    /// admitted.
    disk: u64,
    sandbox: Arc<dyn Sandbox>,
    keep: u32,
    /// The run's disk limit, which its points count against.
    disk_limit: Option<u64>,
    /// The lane, for how full the run store is.
    lane: Arc<dyn crate::lane::Lane>,
}

impl Recorder {
    /// Keeps the run's files as a point made by `cause`, unless they did
    /// not change since the last one. Never fails the call it follows: a
    /// point that cannot be made is logged and skipped.
    pub async fn record(&self, cause: PointCause) -> Option<Ulid> {
        let mut book = self.handle.history.book.lock().await;
        // A run going away keeps nothing; a change admitted before a
        // rollback (a command the rollback cut short) is not the returned
        // files' change.
        let disk = self
            .handle
            .history
            .disk
            .load(std::sync::atomic::Ordering::SeqCst);
        if self.handle.ended.is_cancelled() || disk != self.disk {
            return None;
        }
        let book = self.handle.history.open(&mut book, &*self.sandbox);
        match self.record_locked(book, cause, false).await {
            Ok(point) => point,
            Err(e) => {
                tracing::warn!(run = %self.handle.id, error = %e, "could not keep a history point");
                None
            }
        }
    }

    /// Keeps a point under the lock. `keep_later`: the points after a
    /// rolled-back-to head stay (the point kept just before another
    /// rollback, which may be to one of them).
    async fn record_locked(
        &self,
        book: &mut Book,
        cause: PointCause,
        keep_later: bool,
    ) -> Result<Option<Ulid>, crate::lane::LaneError> {
        let current = book.current();
        let since = current.map(|p| self.handle.history.since(p));
        let id = Ulid::new();
        let meta = PointMeta {
            created_at: OffsetDateTime::now_utc(),
            parent: current.map(|p| p.id),
            cause,
            changes: None,
        };
        let bytes = serde_json::to_vec(&meta).unwrap_or_default();
        let Some(kept) = self.sandbox.keep_point(id, since, bytes).await? else {
            return Ok(None);
        };
        book.points.push(Point {
            id,
            transid: kept.transid,
            meta,
        });
        // Kept just before a rollback: the files are at this point now,
        // and the points after the old head stay (they may be the
        // rollback's target).
        if keep_later && book.head.is_some() {
            book.head = None;
            self.sandbox.set_history_head(None)?;
        }
        // A change after a rollback: the points after the head go.
        if let (Some(head), false) = (book.head, keep_later) {
            let later: Vec<Ulid> = book
                .points
                .iter()
                .filter(|p| p.id > head && p.id != id)
                .map(|p| p.id)
                .collect();
            for point in later {
                self.sandbox.drop_point(point).await?;
                book.points.retain(|p| p.id != point);
            }
            book.head = None;
            self.sandbox.set_history_head(None)?;
        }
        self.prune(book).await?;
        Ok(Some(id))
    }

    /// Drops the oldest points beyond the run's `keep`, and while the run's
    /// disk and its points together pass its disk limit (the newest point
    /// always stays).
    async fn prune(&self, book: &mut Book) -> Result<(), crate::lane::LaneError> {
        while book.points.len() > self.keep.max(1) as usize {
            self.sandbox.drop_point(book.points[0].id).await?;
            book.points.remove(0);
        }
        // A store running out of room: history is the first thing to give.
        while book.points.len() > 1 && self.store_short() {
            let oldest = book.points[0].id;
            tracing::info!(run = %self.handle.id, point = %oldest, "history point dropped: the run store is nearly full");
            self.sandbox.drop_point_and_reclaim(oldest).await?;
            book.points.remove(0);
        }
        let Some(limit) = self.disk_limit else {
            return Ok(());
        };
        while book.points.len() > 1 {
            let used = self.sandbox.disk_used().unwrap_or(0);
            let held = self.sandbox.history_bytes().unwrap_or(0);
            if used.saturating_add(held) <= limit {
                break;
            }
            let oldest = book.points[0].id;
            tracing::info!(run = %self.handle.id, point = %oldest, used, held, limit, "history point dropped to keep the run within its disk limit");
            // Measured again only once what it held is freed.
            self.sandbox.drop_point_and_reclaim(oldest).await?;
            book.points.remove(0);
        }
        Ok(())
    }
}

impl Recorder {
    /// Whether the run store has less than [`STORE_RESERVE`] of its size
    /// free.
    fn store_short(&self) -> bool {
        self.lane.storage().is_some_and(|s| {
            let free = s.total_bytes.saturating_sub(s.used_bytes);
            free < s.total_bytes / STORE_RESERVE
        })
    }
}

/// History points go, oldest first, while the run store has less than
/// one part in this many of its size free.
const STORE_RESERVE: u64 = 10;

impl Manager {
    /// A recorder for run `handle` (whose record is `record`), if it keeps
    /// history. The first one of a run keeps the run's files as they are
    /// as its first point (kind `create`): what undoing everything returns
    /// to.
    pub(crate) async fn recorder(
        &self,
        handle: &Arc<RunHandle>,
        record: &crate::store::RunRecord,
    ) -> Option<Recorder> {
        let keep = record.history?.keep;
        let mut book = handle.history.book.lock().await;
        // Read under the lock a rollback holds while it replaces the disk.
        let recorder = Recorder {
            disk: handle
                .history
                .disk
                .load(std::sync::atomic::Ordering::SeqCst),
            handle: handle.clone(),
            sandbox: self.lane.sandbox(handle.id),
            keep,
            disk_limit: record.limits.disk_mb.map(|mb| mb << 20),
            lane: self.lane.clone(),
        };
        let book = handle.history.open(&mut book, &*recorder.sandbox);
        if book.points.is_empty() {
            if let Err(e) = recorder.sandbox.history_room(recorder.disk_limit).await {
                tracing::warn!(run = %handle.id, error = %e, "could not make room in the run's disk limit for its history");
            }
            let first = recorder
                .record_locked(book, cause(PointKind::Create), false)
                .await;
            if let Err(e) = first {
                tracing::warn!(run = %handle.id, error = %e, "could not keep a run's first history point");
            }
        }
        Some(recorder)
    }

    /// Run `id`'s history, newest first.
    pub async fn history(&self, id: Ulid) -> Result<HistoryList, CoreError> {
        let (handle, keep) = self.history_handle(id)?;
        let sandbox = self.lane.sandbox(id);
        let mut book = handle.history.book.lock().await;
        let book = handle.history.open(&mut book, &*sandbox);
        // Summaries not found yet (a point is listed before its summary is
        // needed anywhere else) are found now, and kept.
        let missing: Vec<Ulid> = book
            .points
            .iter()
            .filter(|p| p.meta.changes.is_none())
            .map(|p| p.id)
            .collect();
        for point in missing {
            let summary = match self
                .diff_points(id, book, point, None, false, usize::MAX)
                .await
            {
                Ok(diff) => diff.summary,
                // Its parent was dropped before its summary was found.
                Err(CoreError::Invalid {
                    code: ErrorCode::PointNotFound,
                    ..
                }) => ChangeSummary::default(),
                // Shown as nothing this time, asked again next time.
                Err(e) => {
                    tracing::warn!(run = %id, point = %point, error = %e, "could not sum up a point's changes");
                    continue;
                }
            };
            if let Some(p) = book.points.iter_mut().find(|p| p.id == point) {
                p.meta.changes = Some(summary);
                let bytes = serde_json::to_vec(&p.meta).unwrap_or_default();
                if let Err(e) = sandbox.describe_point(point, bytes) {
                    tracing::warn!(run = %id, point = %point, error = %e, "could not keep a point's summary");
                }
            }
        }
        let points = book
            .points
            .iter()
            .rev()
            .map(|p| HistoryPoint {
                id: p.id,
                created_at: p.meta.created_at,
                parent: p.meta.parent,
                cause: p.meta.cause.clone(),
                changes: p.meta.changes.unwrap_or_default(),
            })
            .collect();
        Ok(HistoryList {
            points,
            head: book.current().map(|p| p.id),
            keep,
            bytes: sandbox.history_bytes(),
        })
    }

    /// What point `point` of run `id` changed against `against` (default:
    /// its parent), at most `limit` paths, with text patches when `patch`.
    pub async fn history_diff(
        &self,
        id: Ulid,
        point: Ulid,
        against: Option<Ulid>,
        patch: bool,
        limit: usize,
    ) -> Result<HistoryDiff, CoreError> {
        if limit == 0 || limit > MAX_DIFF_PATHS {
            return Err(CoreError::invalid(
                ErrorCode::BadRequest,
                format!("limit must be 1 to {MAX_DIFF_PATHS}, not {limit}"),
            ));
        }
        let (handle, _) = self.history_handle(id)?;
        let sandbox = self.lane.sandbox(id);
        let mut book = handle.history.book.lock().await;
        let book = handle.history.open(&mut book, &*sandbox);
        self.diff_points(id, book, point, against, patch, limit)
            .await
    }

    async fn diff_points(
        &self,
        id: Ulid,
        book: &Book,
        point: Ulid,
        against: Option<Ulid>,
        patch: bool,
        limit: usize,
    ) -> Result<HistoryDiff, CoreError> {
        let found = book.get(point).ok_or_else(|| not_found(id, point))?;
        let base = match against {
            Some(other) => Some(book.get(other).ok_or_else(|| not_found(id, other))?.id),
            None => match found.meta.parent {
                Some(parent) if book.get(parent).is_none() => {
                    return Err(CoreError::invalid(
                        ErrorCode::PointNotFound,
                        format!(
                            "point {point}'s parent {parent} was dropped (the run keeps its newest \
                             points only); diff it against a point that is kept with ?against="
                        ),
                    ))
                }
                parent => parent,
            },
        };
        let sandbox = self.lane.sandbox(id);
        let after = sandbox.point_capture(point)?;
        let before = base.map(|b| sandbox.point_capture(b)).transpose()?;
        let record = self.handle(id)?.snapshot().record.clone();
        let images = self.images.clone();
        let layers = record.layers.clone();
        let diffed = tokio::task::spawn_blocking(move || {
            let lowers = images.layer_dirs(&layers)?;
            let skip: Vec<&str> = after.injected.iter().map(String::as_str).collect();
            let side = |capture: Option<&crate::lane::Capture>| {
                let upper = capture.map(|c| c.upper.clone());
                let id_base = upper
                    .as_ref()
                    .and_then(|u| u.parent())
                    .and_then(|d| {
                        std::fs::read_to_string(d.join(runbox_image::capture::IDBASE_FILE)).ok()
                    })
                    .and_then(|t| t.trim().parse().ok())
                    .unwrap_or(0);
                (upper, id_base)
            };
            let (old_upper, old_base) = side(before.as_ref());
            let (new_upper, new_base) = side(Some(&after));
            let old = runbox_image::diff::Side {
                upper: old_upper.as_deref(),
                lowers: &lowers,
                id_base: old_base,
            };
            let new = runbox_image::diff::Side {
                upper: new_upper.as_deref(),
                lowers: &lowers,
                id_base: new_base,
            };
            let diff = runbox_image::diff::diff(&old, &new, &skip, limit).map_err(|e| {
                if runbox_image::diff::too_many(&e) {
                    CoreError::invalid(
                        ErrorCode::TooLarge,
                        format!(
                            "point {point} and the point it is diffed against hold more than {} \
                             paths between them; diff it against a nearer point (?against=)",
                            runbox_image::diff::MAX_WALK
                        ),
                    )
                } else {
                    CoreError::Store(format!("diffing point {point}: {e}"))
                }
            })?;
            let summary = runbox_image::diff::Summary::of(&diff.changes);
            let mut budget = PATCH_BUDGET;
            let changes = diff
                .changes
                .iter()
                .map(|c| path_change(c, patch, &mut budget))
                .collect();
            Ok::<_, CoreError>((changes, diff.truncated, summary))
        })
        .await
        .map_err(|e| CoreError::Store(format!("diff task failed: {e}")))??;
        let (changes, truncated, summary) = diffed;
        Ok(HistoryDiff {
            point,
            against: base,
            changes,
            truncated,
            summary: ChangeSummary {
                added: summary.added,
                modified: summary.modified,
                removed: summary.removed,
                bytes: summary.bytes,
            },
        })
    }

    /// Returns run `id`'s files to point `point` (see the module doc): a
    /// running run is hibernated and booted again, so its processes end; a
    /// hibernated one stays so. The run keeps its id, token, egress,
    /// secrets, lease and labels. `credential` is the lease's, as for any
    /// change.
    pub async fn rollback(
        &self,
        id: Ulid,
        point: Ulid,
        credential: Option<(String, u64)>,
    ) -> Result<runbox_types::Run, CoreError> {
        let (handle, keep) = self.history_handle(id)?;
        let record = handle.snapshot().record.clone();
        let recorder = Recorder {
            disk: handle
                .history
                .disk
                .load(std::sync::atomic::Ordering::SeqCst),
            handle: handle.clone(),
            sandbox: self.lane.sandbox(id),
            keep,
            disk_limit: record.limits.disk_mb.map(|mb| mb << 20),
            lane: self.lane.clone(),
        };
        let mut book = handle.history.book.lock().await;
        let book = handle.history.open(&mut book, &*recorder.sandbox);
        if book.get(point).is_none() {
            return Err(not_found(id, point));
        }
        // What changed since the last point is kept first (the points
        // after a rolled-back-to head staying), so the rollback can be
        // undone without losing it.
        if matches!(
            handle.snapshot().phase,
            super::phase::Phase::Running
                | super::phase::Phase::Paused
                | super::phase::Phase::Hibernated
        ) {
            let before = cause(PointKind::Rollback);
            if let Err(e) = recorder.record_locked(book, before, true).await {
                tracing::warn!(run = %id, error = %e, "could not keep the files before a rollback");
            }
            // The point itself may have been dropped to stay within the
            // disk limit.
            if book.get(point).is_none() {
                return Err(not_found(id, point));
            }
        }
        let woken = handle
            .ask(|reply| Command::Rollback {
                point,
                credential,
                reply,
            })
            .await?;
        // The disk is the point's now, whether or not the run came back
        // up: changes admitted before are not its to keep.
        handle
            .history
            .disk
            .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        let newest = book.points.last().map(|p| p.id);
        book.head = (newest != Some(point)).then_some(point);
        recorder.sandbox.set_history_head(book.head)?;
        tracing::info!(run = %id, point = %point, "run rolled back");
        if let Some(failed) = woken {
            return Err(failed);
        }
        self.get(id)
    }

    /// Point `point` of run `id` as a capture (for a fork or a snapshot of
    /// it); the point stays.
    pub(crate) async fn point_capture(
        &self,
        id: Ulid,
        point: Ulid,
    ) -> Result<crate::lane::Capture, CoreError> {
        let (handle, _) = self.history_handle(id)?;
        let sandbox = self.lane.sandbox(id);
        let mut book = handle.history.book.lock().await;
        let book = handle.history.open(&mut book, &*sandbox);
        if book.get(point).is_none() {
            return Err(not_found(id, point));
        }
        Ok(sandbox.point_capture(point)?)
    }

    /// Run `id`'s handle and the points it keeps; 404 when it keeps none.
    fn history_handle(&self, id: Ulid) -> Result<(Arc<RunHandle>, u32), CoreError> {
        let handle = self.handle(id)?;
        let keep = handle.snapshot().record.history.map(|h| h.keep);
        match keep {
            Some(keep) => Ok((handle, keep)),
            None => Err(CoreError::invalid(
                ErrorCode::PointNotFound,
                format!(
                    "run {id} keeps no history; create runs with \"history\": {{\"keep\": N}} to \
                     keep a point after every command"
                ),
            )),
        }
    }
}

/// Keeps a point after a file call that `recorder` (if any) was made for.
pub(crate) async fn after(recorder: Option<Recorder>, cause: PointCause) {
    if let Some(recorder) = recorder {
        recorder.record(cause).await;
    }
}

/// A cause of `kind` with nothing else to say.
pub(crate) fn cause(kind: PointKind) -> PointCause {
    PointCause {
        kind,
        argv: None,
        exit_code: None,
        user: None,
        op: None,
        path: None,
    }
}

/// The cause of a file call `op` on `path`.
pub(crate) fn file_cause(op: &str, path: &str) -> PointCause {
    PointCause {
        op: Some(op.to_owned()),
        path: Some(path.to_owned()),
        ..cause(PointKind::File)
    }
}

fn not_found(id: Ulid, point: Ulid) -> CoreError {
    CoreError::invalid(
        ErrorCode::PointNotFound,
        format!(
            "run {id} has no history point {point} (it keeps its newest points only); list them \
             with GET /v1/runs/{id}/history"
        ),
    )
}

fn path_change(
    change: &runbox_image::diff::Changed,
    patch: bool,
    budget: &mut usize,
) -> PathChange {
    use runbox_image::diff::{Change, Kind};
    let state = |e: &Option<runbox_image::diff::Entry>| {
        e.as_ref().map(|e| PathState {
            kind: match e.kind {
                Kind::File => FileKind::File,
                Kind::Dir => FileKind::Directory,
                Kind::Symlink => FileKind::Symlink,
                _ => FileKind::Other,
            },
            mode: e.mode,
            uid: e.uid,
            gid: e.gid,
            size: e.size,
            target: e.target.clone(),
        })
    };
    let (text, binary) = match patch {
        false => (None, false),
        // Past the budget no file is read.
        true if *budget == 0 => {
            let file = |e: &Option<runbox_image::diff::Entry>| {
                e.as_ref().is_some_and(|e| e.kind == Kind::File)
            };
            (None, file(&change.before) || file(&change.after))
        }
        true => match runbox_image::diff::patch(change, *budget as u64) {
            Ok(Some(runbox_image::diff::Patch::Text(text))) if text.len() <= *budget => {
                *budget -= text.len();
                (Some(text), false)
            }
            Ok(Some(_)) => (None, true),
            Ok(None) => (None, false),
            // Gone under the diff (a point dropped meanwhile): no patch.
            Err(_) => (None, true),
        },
    };
    PathChange {
        path: change.path.clone(),
        change: match change.change {
            Change::Added => PathChangeKind::Added,
            Change::Modified => PathChangeKind::Modified,
            Change::Removed => PathChangeKind::Removed,
        },
        before: state(&change.before),
        after: state(&change.after),
        patch: text,
        binary,
    }
}
