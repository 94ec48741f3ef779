//! Image builds: a Dockerfile (or a step list) run step by step in one
//! build run, each file-changing step captured as an image of its own (the
//! step cache), the last of them recorded under the build's name with the
//! configuration the steps set.
//!
//! The parts:
//! - the plan comes from `runbox-build` (parsing, word rules, `COPY`
//!   selection); this module runs it ([`steps`]);
//! - contexts (what `COPY` reads) are uploaded first, content-addressed
//!   per tenant, checked once on arrival (`contexts/<owner>/<hex>.tar`);
//! - a build's record and log are files (`records/<id>.json`, `.log`),
//!   written as it goes, so a build outlives a restart as a record: one
//!   the daemon was running when it stopped is marked failed at the next
//!   start, and its run (labelled [`BUILD_LABEL`]) is deleted;
//! - the step cache is images whose source starts [`CACHE_SOURCE_PREFIX`]:
//!   hidden from image lists, stamped with the tenant, kept from garbage
//!   collection like any image, and the oldest dropped past
//!   [`crate::config::Config::build_cache_entries`].
//!
//! Crash rule: the image is recorded last, in one write; a build cut short
//! anywhere before leaves no image, only whole cache entries (each also
//! one write after its layer) and a run the next start deletes.

mod steps;

use std::collections::HashMap;
use std::io::{self, BufRead, Read, Write};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use runbox_types::{
    Build, BuildContext, BuildFailure, BuildLog, BuildRequest, BuildStatus, BuildStep, ErrorCode,
};
use time::OffsetDateTime;
use tokio_util::sync::CancellationToken;
use ulid::Ulid;

use crate::error::CoreError;
use crate::runs::Manager;
use crate::tenants::Owner;

/// What the `source` of a cached step's image starts with.
pub const CACHE_SOURCE_PREFIX: &str = "build-cache:";
/// What the `source` of a built image starts with: `build:<id>`.
pub const BUILD_SOURCE_PREFIX: &str = "build:";
/// The label a build run carries: the build's id.
pub const BUILD_LABEL: &str = "runbox.build";

/// Finished builds kept (the newest), and for how long.
const KEEP_FINISHED: usize = 200;
const KEEP_FOR: time::Duration = time::Duration::days(1);
/// Unused contexts are removed after this long.
const CONTEXT_KEEP_FOR: std::time::Duration = std::time::Duration::from_secs(24 * 3600);
/// The most log text a build keeps; past it, one line says so and the
/// rest goes only to the step's tail (shown when it fails).
const MAX_LOG_BYTES: usize = 8 << 20;
/// The longest log line kept, in bytes; longer ones are cut.
const MAX_LINE_BYTES: usize = 16 << 10;
/// How many of a failed step's last lines its failure shows.
const TAIL_LINES: usize = 20;
/// The most entries a context holds.
const MAX_CONTEXT_ENTRIES: u64 = 200_000;

/// What a build's event stream carries.
#[derive(Clone, Debug)]
pub enum BuildEvent {
    /// A step's status changed.
    Step(BuildStep),
    /// A line of output.
    Log(BuildLog),
    /// The build ended; the last event.
    Done(Box<Build>),
}

/// The builds of this node: running ones in memory, all as files.
pub(crate) struct Builds {
    records: PathBuf,
    /// Builds requested but not started yet (E2B's two-call builds).
    requests: PathBuf,
    contexts: PathBuf,
    spool: PathBuf,
    live: Mutex<HashMap<Ulid, Arc<Live>>>,
}

/// A running build: its view, its events so far, and how to stop it.
pub(crate) struct Live {
    state: Mutex<LiveState>,
    /// How many events there are; subscribers wait for it to change.
    count: tokio::sync::watch::Sender<usize>,
    cancel: CancellationToken,
}

struct LiveState {
    build: Build,
    events: Vec<BuildEvent>,
    next_offset: u64,
    log_bytes: usize,
    log: Option<io::BufWriter<std::fs::File>>,
    /// The last lines of the step running now.
    tail: std::collections::VecDeque<String>,
}

impl Builds {
    /// Opens (or creates) the build directory `dir`. Builds a previous
    /// daemon left running are marked failed, or ready when an image of
    /// theirs is recorded (`built`: the sources of the stored images);
    /// returns the ids of those it settled. Blocking.
    pub(crate) fn open(
        dir: &Path,
        built: &std::collections::HashSet<String>,
    ) -> Result<(Builds, Vec<Ulid>), CoreError> {
        let records = dir.join("records");
        let requests = dir.join("requests");
        let contexts = dir.join("contexts");
        let spool = dir.join("spool");
        let _ = std::fs::remove_dir_all(&spool);
        for d in [&records, &requests, &contexts, &spool] {
            std::fs::create_dir_all(d)
                .map_err(CoreError::io(format!("creating {}", d.display())))?;
        }
        let builds = Builds {
            records,
            requests,
            contexts,
            spool,
            live: Mutex::new(HashMap::new()),
        };
        let failed = builds.settle_unfinished(built);
        builds.sweep();
        Ok((builds, failed))
    }

    fn record_path(&self, id: Ulid) -> PathBuf {
        self.records.join(format!("{id}.json"))
    }

    fn request_path(&self, id: Ulid) -> PathBuf {
        self.requests.join(format!("{id}.json"))
    }

    fn log_path(&self, id: Ulid) -> PathBuf {
        self.records.join(format!("{id}.log"))
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<Ulid, Arc<Live>>> {
        self.live.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Every build on file, newest first.
    fn on_file(&self) -> Vec<Build> {
        let mut builds: Vec<Build> = std::fs::read_dir(&self.records)
            .into_iter()
            .flatten()
            .flatten()
            .filter(|e| e.path().extension().is_some_and(|x| x == "json"))
            .filter_map(|e| std::fs::read(e.path()).ok())
            .filter_map(|bytes| serde_json::from_slice::<Build>(&bytes).ok())
            .collect();
        builds.sort_by_key(|b| std::cmp::Reverse(b.id));
        builds
    }

    /// Settles builds that were running when the daemon stopped: ready
    /// when their image was recorded (the stop came after that, before
    /// the record said so), else failed; returns their ids.
    fn settle_unfinished(&self, built: &std::collections::HashSet<String>) -> Vec<Ulid> {
        let mut settled = Vec::new();
        for mut build in self.on_file() {
            if build.status.is_final() {
                continue;
            }
            settled.push(build.id);
            build.run = None;
            build.finished_at = Some(OffsetDateTime::now_utc());
            if built.contains(&format!("{BUILD_SOURCE_PREFIX}{}", build.id)) {
                build.status = BuildStatus::Ready;
                for step in &mut build.steps {
                    step.status = runbox_types::BuildStepStatus::Done;
                }
                self.persist(&build);
                continue;
            }
            build.status = BuildStatus::Failed;
            build.finished_at = Some(OffsetDateTime::now_utc());
            build.error = Some(BuildFailure {
                code: "daemon_restarted".into(),
                message:
                    "the daemon stopped while this build ran; nothing was recorded, build again"
                        .into(),
                step: None,
                exit_code: None,
                output: Vec::new(),
            });
            build.run = None;
            for step in &mut build.steps {
                if step.status == runbox_types::BuildStepStatus::Running {
                    step.status = runbox_types::BuildStepStatus::Failed;
                }
            }
            tracing::warn!(build = %build.id, "a build the daemon was running when it stopped is failed");
            self.persist(&build);
        }
        settled
    }

    /// Removes finished builds past [`KEEP_FINISHED`] or older than
    /// [`KEEP_FOR`], and contexts unused for [`CONTEXT_KEEP_FOR`].
    fn sweep(&self) {
        let now = OffsetDateTime::now_utc();
        let live: Vec<Ulid> = self.lock().keys().copied().collect();
        let finished = self
            .on_file()
            .into_iter()
            .filter(|b| b.status.is_final() && !live.contains(&b.id));
        for (index, build) in finished.enumerate() {
            let old = build.finished_at.is_some_and(|at| now - at > KEEP_FOR);
            if index >= KEEP_FINISHED || old {
                let _ = std::fs::remove_file(self.record_path(build.id));
                let _ = std::fs::remove_file(self.log_path(build.id));
            }
        }
        let owners = std::fs::read_dir(&self.contexts)
            .into_iter()
            .flatten()
            .flatten()
            .map(|e| e.path());
        for dir in owners.chain([self.requests.clone()]) {
            for file in std::fs::read_dir(&dir).into_iter().flatten().flatten() {
                let unused = file
                    .metadata()
                    .and_then(|m| m.modified())
                    .ok()
                    .and_then(|at| at.elapsed().ok())
                    .is_some_and(|age| age > CONTEXT_KEEP_FOR);
                if unused {
                    let _ = std::fs::remove_file(file.path());
                }
            }
        }
    }

    /// Writes `build`'s record (whole, by rename). A failure is logged: the
    /// build goes on, its record is only behind.
    fn persist(&self, build: &Build) {
        if let Err(e) = crate::durable::write_json(&self.record_path(build.id), build) {
            tracing::warn!(build = %build.id, error = %e, "could not write the build's record");
        }
    }

    /// The directory of `owner`'s contexts.
    fn context_dir(&self, owner: &Owner) -> PathBuf {
        match owner.tenant() {
            Some(tenant) => self.contexts.join(format!("t-{tenant}")),
            None => self.contexts.join("root"),
        }
    }

    /// Where `owner`'s context `digest` (`sha256:<hex>` or the bare hex)
    /// is, once checked, when it is there.
    pub(crate) fn context_file(&self, owner: &Owner, digest: &str) -> Result<PathBuf, CoreError> {
        self.context_file_in(owner, ContextKind::Digest, digest)
    }

    /// [`Builds::context_file`] for contexts of `kind`.
    fn context_file_in(
        &self,
        owner: &Owner,
        kind: ContextKind,
        digest: &str,
    ) -> Result<PathBuf, CoreError> {
        let hex = context_hex(digest)?;
        let path = self
            .context_dir(owner)
            .join(format!("{}{hex}.tar", kind.prefix()));
        if !path.is_file() {
            return Err(CoreError::invalid(
                ErrorCode::BadBuildContext,
                match kind {
                    ContextKind::Digest => format!(
                        "no build context sha256:{hex} was uploaded (or it was swept after a day unused); upload it with PUT /v1/build-contexts/sha256:{hex}"
                    ),
                    ContextKind::Keyed => format!(
                        "no files were uploaded for hash {hex} (or they were swept after a day unused); upload them to the link GET /templates/{{templateID}}/files/{hex} gives"
                    ),
                },
            ));
        }
        // Used: kept another day.
        let _ = std::fs::File::options()
            .append(true)
            .open(&path)
            .and_then(|f| f.set_modified(std::time::SystemTime::now()));
        Ok(path)
    }

    /// Stores a context archive: `body` (a tar, plain or gzip) must hash to
    /// `digest`; it is checked entry by entry and kept as a plain tar.
    /// Uploading a stored one again reads the body through and keeps the
    /// first. Blocking.
    /// A [`ContextKind::Keyed`] upload is stored under its key unchecked
    /// against its bytes.
    pub(crate) fn put_context(
        &self,
        owner: &Owner,
        kind: ContextKind,
        digest: &str,
        body: impl Read,
        max_bytes: u64,
    ) -> Result<BuildContext, CoreError> {
        let hex = context_hex(digest)?.to_owned();
        let prefix = kind.prefix();
        let dir = self.context_dir(owner);
        std::fs::create_dir_all(&dir).map_err(CoreError::io("creating the context directory"))?;
        let spooled = tempfile::NamedTempFile::new_in(&self.spool)
            .map_err(CoreError::io("creating the context spool"))?;
        let (_, got) = crate::images::copy_hashed(
            body,
            spooled.as_file(),
            max_bytes,
            "context upload",
            || {
                CoreError::invalid(
                ErrorCode::TooLarge,
                format!("a build context may be at most {max_bytes} bytes (the server's upload maximum); leave out what the build does not need with .dockerignore"),
            )
            },
        )?;
        if kind == ContextKind::Digest && got != hex {
            return Err(CoreError::invalid(
                ErrorCode::BadBuildContext,
                format!(
                    "the uploaded bytes hash to sha256:{got}, not the sha256:{hex} the path names"
                ),
            ));
        }
        let meta_path = dir.join(format!("{prefix}{hex}.json"));
        let final_path = dir.join(format!("{prefix}{hex}.tar"));
        // A keyed upload may replace what its key held (E2B's forced
        // uploads); a digest's content is fixed.
        if kind == ContextKind::Digest && final_path.is_file() {
            if let Ok(known) = std::fs::read(&meta_path)
                .map_err(|e| e.to_string())
                .and_then(|b| serde_json::from_slice::<BuildContext>(&b).map_err(|e| e.to_string()))
            {
                let _ = self.context_file_in(owner, kind, &hex);
                return Ok(known);
            }
        }
        // A gzip body is kept decompressed: COPY reads it once per step.
        let plain = {
            let mut magic = [0u8; 2];
            let mut file = spooled
                .reopen()
                .map_err(CoreError::io("reading the context spool"))?;
            let n = file
                .read(&mut magic)
                .map_err(CoreError::io("reading the context spool"))?;
            if n == 2 && magic == [0x1f, 0x8b] {
                let unzipped = tempfile::NamedTempFile::new_in(&self.spool)
                    .map_err(CoreError::io("creating the context spool"))?;
                let source = spooled
                    .reopen()
                    .map_err(CoreError::io("reading the context spool"))?;
                let mut decoder = flate2::read::GzDecoder::new(io::BufReader::new(source))
                    .take(max_bytes.saturating_add(1 << 20));
                let mut out = io::BufWriter::new(unzipped.as_file());
                io::copy(&mut decoder, &mut out).map_err(|e| {
                    CoreError::invalid(
                        ErrorCode::BadBuildContext,
                        format!("the build context is not a readable gzip stream: {e}"),
                    )
                })?;
                out.flush()
                    .map_err(CoreError::io("writing the context spool"))?;
                drop(out);
                unzipped
            } else {
                spooled
            }
        };
        let limits = runbox_build::context::ContextLimits {
            max_bytes,
            max_entries: MAX_CONTEXT_ENTRIES,
        };
        let reader = io::BufReader::new(
            plain
                .reopen()
                .map_err(CoreError::io("reading the context spool"))?,
        );
        let stats = runbox_build::context::check_archive(reader, &limits)
            .map_err(|e| CoreError::invalid(ErrorCode::BadBuildContext, e.to_string()))?;
        let context = BuildContext {
            digest: format!("sha256:{hex}"),
            entries: stats.entries,
            bytes: stats.bytes,
        };
        crate::durable::write_json(&meta_path, &context)
            .map_err(CoreError::io("writing the context's record"))?;
        plain
            .persist(&final_path)
            .map_err(|e| CoreError::io("storing the context")(e.error))?;
        tracing::info!(digest = %context.digest, entries = stats.entries, bytes = stats.bytes, "build context stored");
        Ok(context)
    }

    /// A scratch file for a build's step (removed when dropped).
    fn scratch(&self) -> Result<tempfile::NamedTempFile, CoreError> {
        tempfile::NamedTempFile::new_in(&self.spool)
            .map_err(CoreError::io("creating a build spool"))
    }
}

/// How a build reads what it is given, beyond its request.
#[derive(Clone, Debug, Default)]
pub struct BuildOptions {
    /// The id the build takes: one [`Manager::reserve_build`] gave, else
    /// a new one.
    pub id: Option<Ulid>,
    /// The shell a step list's `RUN` commands are given to (default
    /// `/bin/sh -c`; E2B's templates use `/bin/bash -l -c`).
    pub shell: Option<Vec<String>>,
    /// How a step list's `COPY` steps name their files.
    pub files: ContextKind,
    /// More names the image is recorded under besides the request's
    /// (E2B's tags), each checked as the name is.
    pub also: Vec<String>,
}

/// How a stored context is named.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum ContextKind {
    #[default]
    /// By the sha256 of its bytes, checked on upload (runbox's own).
    Digest,
    /// By a key the uploader chose (E2B's files hash, computed over the
    /// files' names, modes and contents, not the archive): stored apart
    /// from digests, so a key never stands for another content's digest.
    Keyed,
}

impl ContextKind {
    fn prefix(self) -> &'static str {
        match self {
            ContextKind::Digest => "",
            ContextKind::Keyed => "keyed-",
        }
    }
}

/// The hex of a context digest, `sha256:<64 hex>` or the bare hex.
fn context_hex(digest: &str) -> Result<&str, CoreError> {
    let hex = digest.strip_prefix("sha256:").unwrap_or(digest);
    if hex.len() == 64
        && hex
            .bytes()
            .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
    {
        return Ok(hex);
    }
    Err(CoreError::invalid(
        ErrorCode::BadBuildContext,
        format!("{digest:?} is not a context digest: write sha256: and 64 lowercase hex digits"),
    ))
}

impl Live {
    fn new(build: Build, log: Option<std::fs::File>) -> Arc<Live> {
        let (count, _) = tokio::sync::watch::channel(0);
        Arc::new(Live {
            state: Mutex::new(LiveState {
                build,
                events: Vec::new(),
                next_offset: 0,
                log_bytes: 0,
                log: log.map(io::BufWriter::new),
                tail: Default::default(),
            }),
            count,
            cancel: CancellationToken::new(),
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, LiveState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn push(&self, state: &mut LiveState, event: BuildEvent) {
        state.events.push(event);
        let n = state.events.len();
        self.count.send_replace(n);
    }

    /// The build as it is now.
    pub(crate) fn build(&self) -> Build {
        self.lock().build.clone()
    }

    /// Changes step `index` (1-based) and reports it.
    fn step(&self, index: usize, change: impl FnOnce(&mut BuildStep)) {
        let mut state = self.lock();
        let Some(step) = state.build.steps.get_mut(index.wrapping_sub(1)) else {
            return;
        };
        change(step);
        let step = step.clone();
        if step.status == runbox_types::BuildStepStatus::Running {
            state.tail.clear();
        }
        if let Some(log) = state.log.as_mut() {
            let _ = log.flush();
        }
        self.push(&mut state, BuildEvent::Step(step));
    }

    /// Adds a line of output of step `step` (`stream`: stdout, stderr or
    /// build).
    fn line(&self, step: usize, stream: &str, text: &str) {
        let mut text = text.trim_end_matches('\r').to_owned();
        if text.len() > MAX_LINE_BYTES {
            let mut cut = MAX_LINE_BYTES;
            while !text.is_char_boundary(cut) {
                cut -= 1;
            }
            text.truncate(cut);
            text.push('…');
        }
        let mut state = self.lock();
        if step > 0 && stream != "build" {
            if state.tail.len() == TAIL_LINES {
                state.tail.pop_front();
            }
            state.tail.push_back(text.clone());
        }
        if state.log_bytes > MAX_LOG_BYTES {
            return;
        }
        state.log_bytes += text.len();
        let (stream, text) = if state.log_bytes > MAX_LOG_BYTES {
            (
                "build".to_owned(),
                format!("(the build's log reached {MAX_LOG_BYTES} bytes; the rest of its output is not kept)"),
            )
        } else {
            (stream.to_owned(), text)
        };
        let entry = BuildLog {
            offset: state.next_offset,
            step,
            stream,
            text,
            time: OffsetDateTime::now_utc(),
        };
        state.next_offset += 1;
        if let Some(log) = state.log.as_mut() {
            if let Ok(line) = serde_json::to_string(&entry) {
                let _ = writeln!(log, "{line}");
            }
        }
        self.push(&mut state, BuildEvent::Log(entry));
    }

    /// The running step's last lines.
    fn tail(&self) -> Vec<String> {
        self.lock().tail.iter().cloned().collect()
    }
}

/// Reads a finished build's log from `path`, from `offset` on.
fn read_log(path: &Path, offset: u64) -> Vec<BuildLog> {
    let Ok(file) = std::fs::File::open(path) else {
        return Vec::new();
    };
    io::BufReader::new(file)
        .lines()
        .map_while(Result::ok)
        .filter_map(|line| serde_json::from_str::<BuildLog>(&line).ok())
        .filter(|l| l.offset >= offset)
        .collect()
}

impl Manager {
    fn builds(&self) -> Result<&Arc<Builds>, CoreError> {
        self.builds.get().ok_or_else(|| {
            CoreError::invalid(
                ErrorCode::BadRequest,
                "image builds are not available on this server",
            )
        })
    }

    /// Opens the build directory beside the image store; called once at
    /// start, after the runs are reconciled. A build run a previous daemon
    /// left is deleted.
    pub(crate) async fn open_builds(self: &Arc<Self>) -> Result<(), CoreError> {
        let dir = self.images.builds_dir();
        let images = self.images.clone();
        let (builds, settled) = tokio::task::spawn_blocking(move || {
            let built: std::collections::HashSet<String> = images
                .store()
                .images()
                .map_err(crate::images::store_error)?
                .into_iter()
                .map(|r| r.source)
                .filter(|s| s.starts_with(BUILD_SOURCE_PREFIX))
                .collect();
            Builds::open(&dir, &built)
        })
        .await
        .map_err(|e| CoreError::Store(format!("build directory task failed: {e}")))??;
        let _ = self.builds.set(Arc::new(builds));
        // Only the runs of the builds just settled: the label is the
        // build's id, and a run of any other label value is not ours.
        let leftover: Vec<Ulid> = self
            .list()
            .into_iter()
            .filter(|r| {
                r.labels
                    .get(BUILD_LABEL)
                    .and_then(|v| runbox_types::parse_id(v))
                    .is_some_and(|b| settled.contains(&b))
            })
            .map(|r| r.id)
            .collect();
        for id in leftover {
            tracing::info!(run = %id, "deleting the run of a build the daemon stopped");
            let manager = self.clone();
            tokio::spawn(async move {
                if let Err(e) = manager.delete(id).await {
                    tracing::warn!(run = %id, error = %e, "could not delete a build's run");
                }
            });
        }
        Ok(())
    }

    /// Stores a build context for `owner` (see [`Builds::put_context`]).
    pub async fn put_build_context(
        &self,
        owner: Owner,
        kind: ContextKind,
        digest: String,
        body: impl Read + Send + 'static,
    ) -> Result<BuildContext, CoreError> {
        let builds = self.builds()?.clone();
        let max = self.config().max_upload_bytes;
        tokio::task::spawn_blocking(move || builds.put_context(&owner, kind, &digest, body, max))
            .await
            .map_err(|e| CoreError::Store(format!("context task failed: {e}")))?
    }

    /// Whether `owner` has context `digest` of `kind` stored.
    pub fn has_build_context(
        &self,
        owner: &Owner,
        kind: ContextKind,
        digest: &str,
    ) -> Result<bool, CoreError> {
        match self.builds()?.context_file_in(owner, kind, digest) {
            Ok(_) => Ok(true),
            Err(CoreError::Invalid {
                code: ErrorCode::BadBuildContext,
                ..
            }) if context_hex(digest).is_ok() => Ok(false),
            Err(e) => Err(e),
        }
    }

    /// Reserves a build id for a build that starts later (E2B asks for a
    /// build, uploads its files, then starts it): `request` is the
    /// caller's note of what was asked, given back by
    /// [`Manager::reserved_build`]. A reservation not started is swept
    /// after a day.
    pub fn reserve_build(
        &self,
        owner: &Owner,
        request: serde_json::Value,
    ) -> Result<Ulid, CoreError> {
        let builds = self.builds()?;
        let id = Ulid::new();
        let record = serde_json::json!({ "tenant": owner.tenant(), "request": request });
        crate::durable::write_json(&builds.request_path(id), &record)
            .map_err(CoreError::io("writing a build reservation"))?;
        Ok(id)
    }

    /// The note of reserved build `id`, if it is reserved (not started)
    /// and `owner`'s.
    pub fn reserved_build(
        &self,
        id: Ulid,
        owner: &Owner,
    ) -> Result<Option<serde_json::Value>, CoreError> {
        let builds = self.builds()?;
        let Ok(bytes) = std::fs::read(builds.request_path(id)) else {
            return Ok(None);
        };
        let mut record: serde_json::Value = serde_json::from_slice(&bytes)
            .map_err(|e| CoreError::Store(format!("build reservation {id} is unreadable: {e}")))?;
        if !owner.sees(record["tenant"].as_str()) {
            return Ok(None);
        }
        Ok(Some(record["request"].take()))
    }

    /// Up to `limit` lines of build `id`'s log from line `offset`, as far
    /// as it has been written.
    pub fn build_log(
        &self,
        id: Ulid,
        owner: &Owner,
        offset: u64,
        limit: usize,
    ) -> Result<Vec<BuildLog>, CoreError> {
        let builds = self.builds()?;
        self.get_build(id, owner)?;
        let live = builds.lock().get(&id).cloned();
        let lines = match live {
            Some(live) => live
                .lock()
                .events
                .iter()
                .filter_map(|e| match e {
                    BuildEvent::Log(l) if l.offset >= offset => Some(l.clone()),
                    _ => None,
                })
                .take(limit)
                .collect(),
            None => {
                let mut lines = read_log(&builds.log_path(id), offset);
                lines.truncate(limit);
                lines
            }
        };
        Ok(lines)
    }

    /// Names built image `from` also `to` (a tag: the same layers and
    /// configuration, as one more image record). `to` may replace only a
    /// built image of the same owner; `from` must be one `owner` sees.
    pub async fn tag_built_image(
        &self,
        from: &str,
        to: &str,
        owner: &Owner,
    ) -> Result<runbox_types::Image, CoreError> {
        crate::validate::new_image_name(to)?;
        let _guard = self.image_lock.lock().await;
        let store = self.images.store();
        let source = store
            .image(from)
            .ok()
            .filter(|r| r.source.starts_with(BUILD_SOURCE_PREFIX))
            .filter(|r| r.tenant.is_none() || owner.sees(r.tenant.as_deref()))
            .ok_or_else(|| CoreError::ImageNotFound(from.to_owned()))?;
        if let Ok(existing) = store.image(to) {
            let built = existing.source.starts_with(BUILD_SOURCE_PREFIX);
            if !built || existing.tenant.as_deref() != owner.tenant() {
                return Err(CoreError::Conflict {
                    code: ErrorCode::ImageExists,
                    message: format!(
                        "an image named {to:?} exists and is not a build of yours to replace; pick another tag"
                    ),
                });
            }
        }
        let mut image = self.images.record_built(
            to,
            source.source,
            source.layers,
            &source.config,
            owner.tenant().map(str::to_owned),
            source.labels,
        )?;
        image.server = self.server_id.clone();
        Ok(image)
    }

    /// Starts a build (see [`Manager::start_build_with`]) as runbox's API
    /// asks for it.
    pub async fn start_build(
        self: &Arc<Self>,
        req: BuildRequest,
        owner: Owner,
    ) -> Result<Build, CoreError> {
        self.start_build_with(req, owner, BuildOptions::default())
            .await
    }

    /// Starts a build; answers at once with it (status `building`). The
    /// plan is checked first: a Dockerfile that cannot be built, a missing
    /// context, a name another build is building are refused here.
    pub async fn start_build_with(
        self: &Arc<Self>,
        req: BuildRequest,
        owner: Owner,
        options: BuildOptions,
    ) -> Result<Build, CoreError> {
        let builds = self.builds()?.clone();
        let reserved = options.id;
        if let Some(id) = reserved {
            if self.reserved_build(id, &owner)?.is_none() {
                return Err(no_build(id));
            }
        }
        let job = steps::Job::check(self, &builds, req, &owner, &options)?;
        // Not `unwrap_or_default`: a default Ulid is the nil id.
        let id = match reserved {
            Some(id) => id,
            None => Ulid::new(),
        };
        let build = Build {
            id,
            name: job.name.clone(),
            status: BuildStatus::Building,
            from: job.from.clone(),
            steps: Vec::new(),
            run: None,
            error: None,
            warnings: job.warnings.clone(),
            tenant: owner.tenant().map(str::to_owned),
            created_at: OffsetDateTime::now_utc(),
            finished_at: None,
            server: self.server_id.clone(),
        };
        let log = std::fs::File::create(builds.log_path(id))
            .map_err(CoreError::io("creating the build's log"))?;
        let live = Live::new(build.clone(), Some(log));
        {
            let mut all = builds.lock();
            let other = all.values().map(|l| l.build()).find(|b| b.name == job.name);
            if let Some(other) = other {
                drop(all);
                let _ = std::fs::remove_file(builds.log_path(id));
                // Another tenant's build is not named to this caller.
                let message = if owner.sees(other.tenant.as_deref()) {
                    format!(
                        "build {} is building image {:?} now; wait for it or cancel it (POST /v1/builds/{}/cancel)",
                        other.id, job.name, other.id
                    )
                } else {
                    format!(
                        "another build is building an image named {:?} now; wait for it, or pick another name",
                        job.name
                    )
                };
                return Err(CoreError::Conflict {
                    code: ErrorCode::BuildInProgress,
                    message,
                });
            }
            all.insert(id, live.clone());
        }
        builds.persist(&build);
        if reserved.is_some() {
            let _ = std::fs::remove_file(builds.request_path(id));
        }
        let manager = self.clone();
        tokio::spawn(async move {
            manager.drive(builds, live, job, owner).await;
        });
        Ok(build)
    }

    /// Build `id`, if `owner` may see it.
    pub fn get_build(&self, id: Ulid, owner: &Owner) -> Result<Build, CoreError> {
        let builds = self.builds()?;
        // Taken out of the map first: the file read below is not done
        // under its lock.
        let live = builds.lock().get(&id).cloned();
        let build = match live {
            Some(live) => live.build(),
            None => std::fs::read(builds.record_path(id))
                .ok()
                .and_then(|b| serde_json::from_slice::<Build>(&b).ok())
                .ok_or_else(|| no_build(id))?,
        };
        if !owner.sees(build.tenant.as_deref()) {
            return Err(no_build(id));
        }
        Ok(build)
    }

    /// The builds `owner` may see, newest first.
    pub fn list_builds(&self, owner: &Owner) -> Result<Vec<Build>, CoreError> {
        let builds = self.builds()?;
        let live: HashMap<Ulid, Build> = builds
            .lock()
            .iter()
            .map(|(id, l)| (*id, l.build()))
            .collect();
        let mut all: Vec<Build> = builds
            .on_file()
            .into_iter()
            .map(|b| live.get(&b.id).cloned().unwrap_or(b))
            .filter(|b| owner.sees(b.tenant.as_deref()))
            .collect();
        all.sort_by_key(|b| std::cmp::Reverse(b.id));
        Ok(all)
    }

    /// Build `id`'s events: every step as it is now, the log from
    /// `offset`, then what happens until it ends, then
    /// [`BuildEvent::Done`].
    pub fn build_events(
        &self,
        id: Ulid,
        owner: &Owner,
        offset: u64,
    ) -> Result<futures::stream::BoxStream<'static, BuildEvent>, CoreError> {
        use futures::StreamExt;
        let builds = self.builds()?.clone();
        // Only a build the caller may see.
        self.get_build(id, owner)?;
        let live = builds.lock().get(&id).cloned();
        let Some(live) = live else {
            // Ended: its record as written at the end.
            let build = self.get_build(id, owner)?;
            let mut events: Vec<BuildEvent> =
                build.steps.iter().cloned().map(BuildEvent::Step).collect();
            events.extend(
                read_log(&builds.log_path(id), offset)
                    .into_iter()
                    .map(BuildEvent::Log),
            );
            events.push(BuildEvent::Done(Box::new(build)));
            return Ok(futures::stream::iter(events).boxed());
        };
        let count = live.count.subscribe();
        // Every event since the build started, in order (so a step's
        // status never seems to go back); log lines before `offset` are
        // skipped.
        let stream = futures::stream::unfold(
            (live, count, 0usize, false),
            move |(live, mut count, seen, done)| async move {
                if done {
                    return None;
                }
                loop {
                    let fresh: Vec<BuildEvent> = {
                        let state = live.lock();
                        state.events[seen.min(state.events.len())..].to_vec()
                    };
                    if !fresh.is_empty() {
                        let seen = seen + fresh.len();
                        let done = fresh.iter().any(|e| matches!(e, BuildEvent::Done(_)));
                        let fresh: Vec<BuildEvent> = fresh
                            .into_iter()
                            .filter(|e| !matches!(e, BuildEvent::Log(l) if l.offset < offset))
                            .collect();
                        return Some((fresh, (live, count, seen, done)));
                    }
                    if count.changed().await.is_err() {
                        return None;
                    }
                }
            },
        )
        .flat_map(futures::stream::iter);
        Ok(stream.boxed())
    }

    /// Cancels build `id`: its running step is killed, its run deleted,
    /// nothing recorded. Answers with the build once it has ended.
    pub async fn cancel_build(&self, id: Ulid, owner: &Owner) -> Result<Build, CoreError> {
        let build = self.get_build(id, owner)?;
        let live = self.builds()?.lock().get(&id).cloned();
        let Some(live) = live else {
            // Ended, perhaps a moment ago: as its record says now.
            return if build.status.is_final() {
                Ok(build)
            } else {
                self.get_build(id, owner)
            };
        };
        let mut count = live.count.subscribe();
        live.cancel.cancel();
        loop {
            if let Some(done) = live.lock().events.iter().rev().find_map(|e| match e {
                BuildEvent::Done(b) => Some((**b).clone()),
                _ => None,
            }) {
                return Ok(done);
            }
            if count.changed().await.is_err() {
                return self.get_build(id, owner);
            }
        }
    }
}

fn no_build(id: Ulid) -> CoreError {
    CoreError::invalid(ErrorCode::BuildNotFound, format!("no build {id}"))
}
