//! The warm repo cache: per-repository templates of a volume (a clone with
//! its dependencies installed), so a run pays clone + install once per
//! repository and lockfile set instead of once per run.
//!
//! On disk, under the cache root:
//!
//! ```text
//! repos/<owner>/<name>/manifest.json   the current template (a WarmTemplate)
//! repos/<owner>/<name>/<generation>/   one immutable generation:
//!     tree/                            the volume's files
//!     meta.json                        its WarmTemplate as committed
//! tenants/<tenant>/<owner>/<name>/     a tenant's templates, laid out alike
//! tmp/<generation>/                    a commit being written
//! trash/                               generations being deleted
//! ```
//!
//! Templates are kept apart per tenant: the operator's and each tenant's
//! are separate sets under one byte cap, named inside the cache by
//! [`scope_key`]. Generation ids are unique across all of them, so a run
//! that mounts a generation finds it by its id alone.
//!
//! Rules:
//! * A generation is written whole in `tmp/`, flushed to disk, moved into
//!   its repository directory, and only then named by the manifest, which
//!   is replaced atomically (written aside, renamed over). A crash at any
//!   point leaves the old template or the new one, never a half-written
//!   one; leftovers in `tmp/` are removed at start-up.
//! * Generations are never written once published. A run mounts its
//!   generation read-only as the lower layer of its volume (its writes go
//!   to its own layer), so starting warm copies nothing, and two runs of
//!   one repository cannot see or break each other.
//! * A generation a run mounts (or a create is about to mount: a [`Pin`])
//!   is never deleted. Superseded, invalidated and least recently used
//!   generations are deleted by [`WarmCache::evict`] only, which the
//!   daemon calls on its maintenance tick, never on a run's start path.
//! * Two commits of one repository at once each write their own
//!   generation; the manifest swaps are serialised, and the later one wins.

pub mod lockfile;

use std::collections::{HashMap, HashSet};
use std::fs;
use std::io;
use std::os::unix::fs::DirBuilderExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use runbox_types::{ErrorCode, WarmTemplate};
use serde::{Deserialize, Serialize};
use time::OffsetDateTime;
use ulid::Ulid;

use crate::durable::sync_dir;
use crate::error::CoreError;

/// The cache's name for `tenant`'s template of `repo` (a canonical
/// repository): the repository itself for the operator's, `<tenant>:<repo>`
/// for a tenant's. Neither a tenant name nor a repository holds `:`, so
/// the two kinds never meet.
pub fn scope_key(tenant: Option<&str>, repo: &str) -> String {
    match tenant {
        None => repo.to_owned(),
        Some(tenant) => format!("{tenant}:{repo}"),
    }
}

/// The tenant and repository of a [`scope_key`].
fn split_key(key: &str) -> (Option<&str>, &str) {
    match key.split_once(':') {
        Some((tenant, repo)) => (Some(tenant), repo),
        None => (None, key),
    }
}

/// The [`scope_key`] of a template.
fn key_of(template: &WarmTemplate) -> String {
    scope_key(template.tenant.as_deref(), &template.repo)
}

/// A run's warm volume as its record keeps it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct WarmVolume {
    /// The repository (canonical).
    pub repo: String,
    /// Where the volume is mounted in the run.
    pub path: String,
    /// The generation mounted as its lower layer; None: it started empty.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub generation: Option<Ulid>,
    /// That generation's lockfile hash.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lock_hash: Option<String>,
    /// That generation's repository directory, relative to the volume.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub subdir: Option<String>,
}

impl WarmVolume {
    /// The API view.
    pub fn to_api(&self) -> runbox_types::RunWarm {
        runbox_types::RunWarm {
            repo: self.repo.clone(),
            path: self.path.clone(),
            booted: self.generation.is_some(),
            generation: self.generation.map(|g| g.to_string()),
            lock_hash: self.lock_hash.clone(),
            repo_dir: self.subdir.as_deref().map(|s| join_dir(&self.path, s)),
        }
    }
}

/// `path` inside the run joined with a subdirectory name (or none).
pub fn join_dir(path: &str, subdir: &str) -> String {
    if subdir.is_empty() {
        path.to_owned()
    } else {
        format!("{}/{subdir}", path.trim_end_matches('/'))
    }
}

/// A generation held for a create until its run is on the ledger (from
/// then on the run's entry holds it). Dropping it lets go.
pub struct Pin {
    /// The template pinned.
    pub template: WarmTemplate,
    /// Its generation.
    pub generation: Ulid,
    /// The directory to mount read-only.
    pub tree: PathBuf,
    inner: Arc<Mutex<Inner>>,
}

impl Drop for Pin {
    fn drop(&mut self) {
        let mut inner = lock(&self.inner);
        if let Some(n) = inner.pins.get_mut(&self.generation) {
            *n -= 1;
            if *n == 0 {
                inner.pins.remove(&self.generation);
            }
        }
    }
}

/// What [`WarmCache::evict`] removed.
#[derive(Debug, Default)]
pub struct Eviction {
    /// Generations deleted (superseded, invalidated or least recently used).
    pub generations: usize,
    /// Templates dropped to get under the size cap.
    pub templates: Vec<String>,
    /// Bytes the cache holds afterwards.
    pub bytes: u64,
}

/// The cache. Cheap to share (`Arc`).
pub struct WarmCache {
    root: PathBuf,
    max_bytes: u64,
    inner: Arc<Mutex<Inner>>,
}

#[derive(Default)]
struct Inner {
    /// The current template of each repository.
    templates: HashMap<String, Template>,
    /// Every generation on disk: repository and bytes.
    generations: HashMap<Ulid, (String, u64)>,
    /// Creates holding a generation, and how many.
    pins: HashMap<Ulid, usize>,
}

struct Template {
    manifest: WarmTemplate,
    /// Used since the manifest was last written: `lastUsedAt` is written
    /// back on the next tick rather than on a run's start path.
    dirty: bool,
}

fn lock(m: &Mutex<Inner>) -> std::sync::MutexGuard<'_, Inner> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl WarmCache {
    /// Opens (or makes) the cache at `root`, keeping at most `max_bytes`.
    /// Removes what a crash left in `tmp/` and `trash/`. Blocking.
    pub fn open(root: &Path, max_bytes: u64) -> Result<WarmCache, CoreError> {
        for dir in ["repos", "tmp", "trash"] {
            let path = root.join(dir);
            fs::DirBuilder::new()
                .recursive(true)
                .mode(0o700)
                .create(&path)
                .map_err(CoreError::io(format!("creating {}", path.display())))?;
        }
        for dir in ["tmp", "trash"] {
            empty_dir(&root.join(dir));
        }
        let mut inner = Inner::default();
        scan(&root.join("repos"), None, &mut inner)?;
        let tenants = root.join("tenants");
        if tenants.is_dir() {
            for dir in read_dir(&tenants)? {
                let name = dir.file_name().unwrap_or_default().to_string_lossy();
                if crate::tenants::check_name(&name).is_err() {
                    tracing::warn!(path = %dir.display(), "ignoring a stray entry in the warm cache");
                    continue;
                }
                let tenant = name.into_owned();
                scan(&dir, Some(&tenant), &mut inner)?;
            }
        }
        tracing::info!(
            root = %root.display(),
            templates = inner.templates.len(),
            generations = inner.generations.len(),
            "warm cache opened"
        );
        Ok(WarmCache {
            root: root.to_owned(),
            max_bytes,
            inner: Arc::new(Mutex::new(inner)),
        })
    }
}

/// Reads the templates and generations under `repos` (`<owner>/<name>/`),
/// `tenant`'s or the operator's, into `inner`.
fn scan(repos: &Path, tenant: Option<&str>, inner: &mut Inner) -> Result<(), CoreError> {
    {
        for owner in read_dir(repos)? {
            for name in read_dir(&owner)? {
                let repo = format!(
                    "{}/{}",
                    owner.file_name().unwrap_or_default().to_string_lossy(),
                    name.file_name().unwrap_or_default().to_string_lossy()
                );
                if crate::validate::repo(&repo).ok().as_deref() != Some(repo.as_str()) {
                    tracing::warn!(path = %name.display(), "ignoring a stray entry in the warm cache");
                    continue;
                }
                let plain = repo;
                let repo = scope_key(tenant, &plain);
                for generation in read_dir(&name)? {
                    let Some(id) = generation
                        .file_name()
                        .and_then(|n| n.to_str())
                        .and_then(|n| Ulid::from_string(n).ok())
                    else {
                        continue;
                    };
                    let bytes = read_json::<WarmTemplate>(&generation.join("meta.json"))
                        .map(|m| m.bytes)
                        .unwrap_or(0);
                    inner.generations.insert(id, (repo.clone(), bytes));
                }
                match read_json::<WarmTemplate>(&name.join("manifest.json")) {
                    Some(manifest) => {
                        let valid = Ulid::from_string(&manifest.generation)
                            .ok()
                            .is_some_and(|g| inner.generations.contains_key(&g));
                        if valid && manifest.repo == plain && manifest.tenant.as_deref() == tenant {
                            inner.templates.insert(
                                repo,
                                Template {
                                    manifest,
                                    dirty: false,
                                },
                            );
                        } else {
                            tracing::warn!(repo = %repo, "ignoring a warm manifest naming no generation");
                        }
                    }
                    None if name.join("manifest.json").exists() => {
                        tracing::warn!(repo = %repo, "ignoring an unreadable warm manifest");
                    }
                    None => {}
                }
            }
        }
    }
    Ok(())
}

impl WarmCache {
    /// The most the cache keeps, in bytes.
    pub fn max_bytes(&self) -> u64 {
        self.max_bytes
    }

    /// The directory of template `key` (a [`scope_key`]).
    fn repo_dir(&self, key: &str) -> PathBuf {
        match split_key(key) {
            (None, repo) => self.root.join("repos").join(repo),
            (Some(tenant), repo) => self.root.join("tenants").join(tenant).join(repo),
        }
    }

    /// The files of `generation`, whichever template it belongs to; None
    /// when the cache no longer has it.
    pub fn generation_tree(&self, generation: Ulid) -> Option<PathBuf> {
        let key = lock(&self.inner).generations.get(&generation)?.0.clone();
        Some(self.tree(&key, generation))
    }

    /// The files of `generation` of template `key` (a [`scope_key`]).
    pub fn tree(&self, key: &str, generation: Ulid) -> PathBuf {
        self.repo_dir(key).join(generation.to_string()).join("tree")
    }

    /// The current template of `repo`, if any.
    pub fn template(&self, repo: &str) -> Option<WarmTemplate> {
        lock(&self.inner)
            .templates
            .get(repo)
            .map(|t| t.manifest.clone())
    }

    /// Every current template (all tenants'), by repository, and the bytes
    /// held.
    pub fn list(&self) -> (Vec<WarmTemplate>, u64) {
        let inner = lock(&self.inner);
        let mut all: Vec<WarmTemplate> = inner
            .templates
            .values()
            .map(|t| t.manifest.clone())
            .collect();
        all.sort_by(|a, b| (&a.repo, &a.tenant).cmp(&(&b.repo, &b.tenant)));
        (all, inner.generations.values().map(|(_, b)| b).sum())
    }

    /// Pins `repo`'s current template for a create and marks it used; None
    /// when the repository has none.
    pub fn pin(&self, repo: &str) -> Option<Pin> {
        let mut inner = lock(&self.inner);
        let template = inner.templates.get_mut(repo)?;
        template.manifest.last_used_at = OffsetDateTime::now_utc();
        template.dirty = true;
        let manifest = template.manifest.clone();
        let generation = Ulid::from_string(&manifest.generation).ok()?;
        *inner.pins.entry(generation).or_default() += 1;
        drop(inner);
        Some(Pin {
            tree: self.tree(repo, generation),
            template: manifest,
            generation,
            inner: self.inner.clone(),
        })
    }

    /// Pins a generation a live run mounts (a fork's parent), whether or
    /// not it is still the current one; None when it is gone.
    pub fn pin_generation(&self, generation: Ulid) -> Option<Pin> {
        let mut inner = lock(&self.inner);
        let repo = inner.generations.get(&generation)?.0.clone();
        *inner.pins.entry(generation).or_default() += 1;
        drop(inner);
        let repo = repo.as_str();
        let template = read_json::<WarmTemplate>(
            &self
                .repo_dir(repo)
                .join(generation.to_string())
                .join("meta.json"),
        )?;
        Some(Pin {
            tree: self.tree(repo, generation),
            template,
            generation,
            inner: self.inner.clone(),
        })
    }

    /// Publishes the merge of `layers` (topmost first, as
    /// [`runbox_image::tree::flatten`] reads them: the run's captured upper
    /// over the generation it started from) as the new template `repo` (a
    /// [`scope_key`]). `path` is the volume's path in run `run`. Blocking.
    pub fn commit(
        &self,
        repo: &str,
        layers: &[&Path],
        path: &str,
        run: Ulid,
    ) -> Result<WarmTemplate, CoreError> {
        let generation = Ulid::new();
        let tmp = self.root.join("tmp").join(generation.to_string());
        let written = self.write_generation(&tmp, repo, layers, path, run, generation);
        let manifest = match written {
            Ok(manifest) => manifest,
            Err(e) => {
                if let Err(cleanup) = runbox_image::tree::remove_tree(&tmp) {
                    tracing::warn!(error = %cleanup, "could not remove a failed warm commit");
                }
                return Err(e);
            }
        };
        // Into the repository's directory, then named by the manifest, both
        // under the lock: concurrent commits of one repository swap the
        // manifest one at a time, and eviction cannot remove the directory
        // in between. A generation whose swap failed is unreferenced and
        // goes on the next tick.
        let dir = self.repo_dir(repo);
        let mut inner = lock(&self.inner);
        let published = (|| {
            fs::DirBuilder::new()
                .recursive(true)
                .mode(0o700)
                .create(&dir)?;
            fs::rename(&tmp, dir.join(generation.to_string()))?;
            sync_dir(&dir)
        })();
        if let Err(e) = published {
            drop(inner);
            let _ = runbox_image::tree::remove_tree(&tmp);
            return Err(storage_error("publishing the warm template")(e));
        }
        inner
            .generations
            .insert(generation, (repo.to_owned(), manifest.bytes));
        write_manifest(&dir, &manifest).map_err(storage_error("writing the warm manifest"))?;
        inner.templates.insert(
            repo.to_owned(),
            Template {
                manifest: manifest.clone(),
                dirty: false,
            },
        );
        Ok(manifest)
    }

    fn write_generation(
        &self,
        tmp: &Path,
        repo: &str,
        layers: &[&Path],
        path: &str,
        run: Ulid,
        generation: Ulid,
    ) -> Result<WarmTemplate, CoreError> {
        fs::DirBuilder::new()
            .mode(0o700)
            .create(tmp)
            .map_err(storage_error("creating the warm commit directory"))?;
        let tree = tmp.join("tree");
        let stats = runbox_image::tree::flatten(layers, &tree)
            .map_err(storage_error("copying the volume into the warm cache"))?;
        // Templates hold the ids the run saw, whatever its range.
        unshift(layers[0], &tree)?;
        let set =
            lockfile::lock_set(&tree).map_err(CoreError::io("hashing the committed lockfiles"))?;
        let now = OffsetDateTime::now_utc();
        let (tenant, repo) = split_key(repo);
        let manifest = WarmTemplate {
            repo: repo.to_owned(),
            tenant: tenant.map(str::to_owned),
            generation: generation.to_string(),
            lock_hash: set.hash,
            lockfiles: set.files,
            repo_dir: join_dir(path, &set.subdir),
            path: path.to_owned(),
            bytes: stats.bytes,
            files: stats.files,
            run,
            committed_at: now,
            last_used_at: now,
        };
        let meta = serde_json::to_vec_pretty(&manifest)
            .map_err(|e| CoreError::Store(format!("encoding the warm manifest: {e}")))?;
        fs::write(tmp.join("meta.json"), meta)
            .map_err(storage_error("writing the generation's metadata"))?;
        // Everything written reaches the disk before anything names it.
        let fd = fs::File::open(tmp).map_err(CoreError::io("opening the warm commit"))?;
        rustix::fs::syncfs(&fd).map_err(|e| storage_error("flushing the warm commit")(e.into()))?;
        Ok(manifest)
    }

    /// The run volume `volume` as a plain tree, from its captured upper
    /// `upper` over its generation, in a scratch directory of the cache
    /// (removed when dropped, or at the next start after a crash): what a
    /// snapshot of the run writes at the volume's path. Blocking.
    pub fn flatten_volume(
        &self,
        volume: &WarmVolume,
        upper: &Path,
    ) -> Result<(tempfile::TempDir, PathBuf), CoreError> {
        let scratch = tempfile::Builder::new()
            .prefix("volume-")
            .tempdir_in(self.root.join("tmp"))
            .map_err(storage_error(
                "making a scratch directory in the warm cache",
            ))?;
        let tree = scratch.path().join("tree");
        let base = match volume.generation {
            Some(g) => Some(self.generation_tree(g).ok_or_else(|| {
                CoreError::Store(format!("the warm generation {g} is gone from the cache"))
            })?),
            None => None,
        };
        let mut layers = vec![upper];
        if let Some(base) = &base {
            layers.push(base.as_path());
        }
        runbox_image::tree::flatten(&layers, &tree)
            .map_err(storage_error("copying the run's warm volume"))?;
        unshift(upper, &tree)?;
        Ok((scratch, tree))
    }

    /// Drops `repo`'s template (forced invalidation); false when it had
    /// none. Runs using it keep it; its files go on a later tick.
    pub fn invalidate(&self, repo: &str) -> Result<bool, CoreError> {
        let mut inner = lock(&self.inner);
        if inner.templates.remove(repo).is_none() {
            return Ok(false);
        }
        let dir = self.repo_dir(repo);
        match fs::remove_file(dir.join("manifest.json")) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) => return Err(CoreError::io("removing the warm manifest")(e)),
        }
        sync_dir(&dir).map_err(CoreError::io("removing the warm manifest"))?;
        Ok(true)
    }

    /// The maintenance pass, called on the daemon's tick (blocking):
    /// deletes every generation that is not a current template and that no
    /// run or create holds, then drops least recently used templates
    /// nothing holds until the cache is within its cap, and writes back
    /// when templates were last used. `in_use` lists the generations live
    /// runs mount; it is read after the pins, under the cache's lock, so a
    /// create that pinned a generation is seen either way.
    pub fn evict(&self, in_use: impl FnOnce() -> HashSet<Ulid>) -> Eviction {
        let mut report = Eviction::default();
        let mut doomed = Vec::new();
        {
            let mut inner = lock(&self.inner);
            let mut held: HashSet<Ulid> = inner.pins.keys().copied().collect();
            held.extend(in_use());
            let current: HashSet<Ulid> = inner
                .templates
                .values()
                .filter_map(|t| Ulid::from_string(&t.manifest.generation).ok())
                .collect();
            let stale: Vec<Ulid> = inner
                .generations
                .keys()
                .filter(|g| !current.contains(g) && !held.contains(g))
                .copied()
                .collect();
            for g in stale {
                if let Some((repo, _)) = inner.generations.remove(&g) {
                    doomed.push((repo, g));
                }
            }
            let mut total: u64 = inner.generations.values().map(|(_, b)| b).sum();
            if total > self.max_bytes {
                let mut lru: Vec<(OffsetDateTime, String, Ulid)> = inner
                    .templates
                    .values()
                    .filter_map(|t| {
                        let g = Ulid::from_string(&t.manifest.generation).ok()?;
                        (!held.contains(&g))
                            .then(|| (t.manifest.last_used_at, key_of(&t.manifest), g))
                    })
                    .collect();
                lru.sort();
                for (_, repo, g) in lru {
                    if total <= self.max_bytes {
                        break;
                    }
                    let dir = self.repo_dir(&repo);
                    if let Err(e) = fs::remove_file(dir.join("manifest.json")) {
                        if e.kind() != io::ErrorKind::NotFound {
                            tracing::warn!(repo = %repo, error = %e, "could not drop a warm template");
                            continue;
                        }
                    }
                    let _ = sync_dir(&dir);
                    inner.templates.remove(&repo);
                    if let Some((_, bytes)) = inner.generations.remove(&g) {
                        total -= bytes;
                    }
                    doomed.push((repo.clone(), g));
                    report.templates.push(repo);
                }
                if total > self.max_bytes {
                    tracing::warn!(
                        bytes = total,
                        max = self.max_bytes,
                        "the warm cache is over its cap, and runs use everything left"
                    );
                }
            }
            report.bytes = total;
            // Move the doomed aside under the lock, so no pin can name them.
            let trash = self.root.join("trash");
            for (repo, g) in doomed {
                let from = self.repo_dir(&repo).join(g.to_string());
                match fs::rename(&from, trash.join(g.to_string())) {
                    Ok(()) => report.generations += 1,
                    Err(e) if e.kind() == io::ErrorKind::NotFound => {}
                    Err(e) => {
                        tracing::warn!(generation = %g, error = %e, "could not remove a warm generation")
                    }
                }
            }
            // Repositories left with neither template nor generation.
            let mut sets = vec![self.root.join("repos")];
            sets.extend(read_dir(&self.root.join("tenants")).unwrap_or_default());
            for set in sets {
                for owner in read_dir(&set).unwrap_or_default() {
                    for name in read_dir(&owner).unwrap_or_default() {
                        let _ = fs::remove_dir(&name);
                    }
                    let _ = fs::remove_dir(&owner);
                }
            }
            for template in inner.templates.values_mut().filter(|t| t.dirty) {
                let dir = self.repo_dir(&key_of(&template.manifest));
                match write_manifest(&dir, &template.manifest) {
                    Ok(()) => template.dirty = false,
                    Err(e) => {
                        tracing::warn!(repo = %template.manifest.repo, error = %e, "could not write a warm manifest")
                    }
                }
            }
        }
        // The deletions themselves, outside the lock: a big tree takes time.
        empty_dir(&self.root.join("trash"));
        report
    }
}

/// Gives `tree` (a copy of `upper` over a template) back the owners the
/// run saw, when `upper` was written in a user namespace range: its
/// parent's `idbase` names the range (see `runbox_image::capture`).
fn unshift(upper: &Path, tree: &Path) -> Result<(), CoreError> {
    let Some(recorded) = upper
        .parent()
        .map(|p| p.join(runbox_image::capture::IDBASE_FILE))
    else {
        return Ok(());
    };
    let base = match fs::read_to_string(&recorded) {
        Ok(text) => text
            .trim()
            .parse::<u32>()
            .map_err(|_| CoreError::Store(format!("{} is not a host id", recorded.display())))?,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(CoreError::io(format!("reading {}", recorded.display()))(e)),
    };
    runbox_image::tree::shift_owners(tree, base, 0)
        .map_err(storage_error("giving the warm volume its owners back"))
}

/// ENOSPC and EDQUOT are the storage being full, which the caller can do
/// something about; other errors are the server's.
fn storage_error(context: &'static str) -> impl FnOnce(io::Error) -> CoreError {
    move |e| {
        match e.raw_os_error() {
        Some(code) if code == rustix::io::Errno::NOSPC.raw_os_error()
            || code == rustix::io::Errno::DQUOT.raw_os_error() =>
        {
            CoreError::invalid(
                ErrorCode::StorageFull,
                format!("{context}: the storage is full ({e}); delete runs, snapshots or templates, or give the server more"),
            )
        }
        _ => CoreError::io(context)(e),
    }
    }
}

/// Writes `manifest.json` in `dir` atomically (see [`crate::durable`]).
fn write_manifest(dir: &Path, manifest: &WarmTemplate) -> io::Result<()> {
    crate::durable::write_json(&dir.join("manifest.json"), manifest)
}

fn read_json<T: serde::de::DeserializeOwned>(path: &Path) -> Option<T> {
    let bytes = fs::read(path).ok()?;
    serde_json::from_slice(&bytes).ok()
}

/// The directories in `dir`.
fn read_dir(dir: &Path) -> Result<Vec<PathBuf>, CoreError> {
    let mut out = Vec::new();
    for entry in fs::read_dir(dir).map_err(CoreError::io(format!("reading {}", dir.display())))? {
        let entry = entry.map_err(CoreError::io(format!("reading {}", dir.display())))?;
        if entry.file_type().is_ok_and(|t| t.is_dir()) {
            out.push(entry.path());
        }
    }
    Ok(out)
}

/// Deletes everything in `dir`, logging what it cannot.
fn empty_dir(dir: &Path) {
    let Ok(entries) = fs::read_dir(dir) else {
        return;
    };
    for entry in entries.flatten() {
        if let Err(e) = runbox_image::tree::remove_tree(&entry.path()) {
            tracing::warn!(path = %entry.path().display(), error = %e, "could not remove a warm cache leftover");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn volume(dir: &Path, marker: &str, bytes: usize) -> PathBuf {
        let upper = dir.join(format!("upper-{marker}"));
        fs::create_dir_all(upper.join("app")).unwrap();
        fs::write(upper.join("app/Cargo.lock"), marker).unwrap();
        fs::write(upper.join("app/data"), vec![b'x'; bytes]).unwrap();
        upper
    }

    fn generation_dirs(root: &Path, repo: &str) -> usize {
        fs::read_dir(root.join("repos").join(repo))
            .map(|d| d.flatten().filter(|e| e.path().is_dir()).count())
            .unwrap_or(0)
    }

    #[test]
    fn tenant_sets_are_apart_survive_a_reopen_and_share_the_cap() {
        let tmp = tempfile::tempdir().unwrap();
        let root = tmp.path().join("cache");
        let cache = WarmCache::open(&root, 1 << 30).unwrap();
        let alpha = scope_key(Some("alpha"), "acme/web");
        let mine = cache
            .commit(
                &alpha,
                &[&volume(tmp.path(), "a", 10)],
                "/work",
                Ulid::new(),
            )
            .unwrap();
        assert_eq!(
            (mine.repo.as_str(), mine.tenant.as_deref()),
            ("acme/web", Some("alpha"))
        );
        assert!(cache.template("acme/web").is_none(), "not the operator's");
        assert!(cache.pin("acme/web").is_none());
        let ours = cache
            .commit(
                "acme/web",
                &[&volume(tmp.path(), "o", 10)],
                "/work",
                Ulid::new(),
            )
            .unwrap();
        assert_eq!(ours.tenant, None);
        let g = Ulid::from_string(&mine.generation).unwrap();
        assert_eq!(
            cache.generation_tree(g).unwrap(),
            root.join("tenants/alpha/acme/web")
                .join(g.to_string())
                .join("tree")
        );
        assert!(cache.pin_generation(g).is_some());
        drop(cache);
        let reopened = WarmCache::open(&root, 1 << 30).unwrap();
        assert_eq!(reopened.template(&alpha).unwrap(), mine);
        assert_eq!(reopened.template("acme/web").unwrap(), ours);
        assert_eq!(reopened.list().0.len(), 2);
        // One cap for all: a cap of one byte drops both (nothing pins them).
        let tight = WarmCache::open(&root, 1).unwrap();
        let report = tight.evict(HashSet::new);
        assert_eq!(report.templates.len(), 2, "{report:?}");
        assert!(!root.join("tenants/alpha/acme/web/manifest.json").exists());
    }

    #[test]
    fn a_commit_publishes_a_generation_that_later_commits_build_on() {
        let tmp = tempfile::tempdir().unwrap();
        let cache = WarmCache::open(&tmp.path().join("cache"), 1 << 30).unwrap();
        let first = cache
            .commit(
                "acme/web",
                &[&volume(tmp.path(), "one", 10)],
                "/work",
                Ulid::new(),
            )
            .unwrap();
        assert_eq!(first.repo_dir, "/work/app");
        assert_eq!(first.lockfiles, ["Cargo.lock"]);
        assert_eq!(first.files, 2);
        assert_eq!(cache.template("acme/web").unwrap(), first);
        // The next commit: an upper over the first generation.
        let g1 = Ulid::from_string(&first.generation).unwrap();
        let upper = tmp.path().join("upper-next");
        fs::create_dir_all(upper.join("app")).unwrap();
        fs::write(upper.join("app/new"), "n").unwrap();
        let second = cache
            .commit(
                "acme/web",
                &[&upper, &cache.tree("acme/web", g1)],
                "/work",
                Ulid::new(),
            )
            .unwrap();
        assert_eq!(second.lock_hash, first.lock_hash, "same lockfiles");
        let g2 = Ulid::from_string(&second.generation).unwrap();
        let tree = cache.tree("acme/web", g2);
        assert!(tree.join("app/new").is_file() && tree.join("app/data").is_file());
        // Reopened, the cache finds the same template.
        drop(cache);
        let cache = WarmCache::open(&tmp.path().join("cache"), 1 << 30).unwrap();
        assert_eq!(
            cache.template("acme/web").unwrap().generation,
            second.generation
        );
        // The superseded generation goes on the next pass.
        assert_eq!(generation_dirs(&tmp.path().join("cache"), "acme/web"), 2);
        let report = cache.evict(HashSet::new);
        assert_eq!(report.generations, 1);
        assert_eq!(generation_dirs(&tmp.path().join("cache"), "acme/web"), 1);
    }

    #[test]
    fn eviction_spares_pinned_and_mounted_generations() {
        let tmp = tempfile::tempdir().unwrap();
        let root = tmp.path().join("cache");
        let cache = WarmCache::open(&root, 1000).unwrap();
        let a = cache
            .commit(
                "acme/a",
                &[&volume(tmp.path(), "a", 800)],
                "/work",
                Ulid::new(),
            )
            .unwrap();
        let b = cache
            .commit(
                "acme/b",
                &[&volume(tmp.path(), "b", 800)],
                "/work",
                Ulid::new(),
            )
            .unwrap();
        let (ga, gb) = (
            Ulid::from_string(&a.generation).unwrap(),
            Ulid::from_string(&b.generation).unwrap(),
        );
        // acme/a is older, but pinned by a create: acme/b goes instead.
        let pin = cache.pin("acme/a").unwrap();
        let report = cache.evict(HashSet::new);
        assert_eq!(report.templates, ["acme/b"]);
        assert!(cache.template("acme/b").is_none());
        assert!(cache.tree("acme/a", ga).is_dir());
        assert!(!cache.tree("acme/b", gb).exists());
        drop(pin);
        // Mounted by a run (the ledger says so), it stays too ...
        let c = cache
            .commit(
                "acme/c",
                &[&volume(tmp.path(), "c", 800)],
                "/work",
                Ulid::new(),
            )
            .unwrap();
        let report = cache.evict(|| HashSet::from([ga]));
        assert_eq!(report.templates, ["acme/c"]);
        assert!(cache.template("acme/a").is_some());
        // ... and invalidated while mounted, it stays until it is not.
        assert!(cache.invalidate("acme/a").unwrap());
        assert!(!cache.invalidate("acme/a").unwrap());
        cache.evict(|| HashSet::from([ga]));
        assert!(cache.tree("acme/a", ga).is_dir());
        cache.evict(HashSet::new);
        assert!(!cache.tree("acme/a", ga).exists());
        assert!(cache.template("acme/c").is_none(), "{c:?} was evicted");
        assert!(
            !root.join("repos/acme").exists(),
            "empty directories go too"
        );
    }

    #[test]
    fn a_crash_leaves_nothing_that_looks_published() {
        let tmp = tempfile::tempdir().unwrap();
        let root = tmp.path().join("cache");
        let cache = WarmCache::open(&root, 1 << 30).unwrap();
        let t = cache
            .commit(
                "acme/web",
                &[&volume(tmp.path(), "one", 10)],
                "/work",
                Ulid::new(),
            )
            .unwrap();
        drop(cache);
        // A commit cut short, a generation moved in but never named, and a
        // manifest that is garbage in another repository.
        fs::create_dir_all(root.join("tmp").join(Ulid::new().to_string()).join("tree")).unwrap();
        let orphan = root.join("repos/acme/web").join(Ulid::new().to_string());
        fs::create_dir_all(orphan.join("tree")).unwrap();
        fs::create_dir_all(root.join("repos/acme/broken")).unwrap();
        fs::write(root.join("repos/acme/broken/manifest.json"), "{not json").unwrap();
        let cache = WarmCache::open(&root, 1 << 30).unwrap();
        assert_eq!(fs::read_dir(root.join("tmp")).unwrap().count(), 0);
        assert_eq!(cache.template("acme/web").unwrap().generation, t.generation);
        assert!(cache.template("acme/broken").is_none());
        cache.evict(HashSet::new);
        assert!(!orphan.exists());
        assert!(cache
            .tree("acme/web", Ulid::from_string(&t.generation).unwrap())
            .is_dir());
    }

    #[test]
    fn concurrent_commits_of_one_repository_each_land_whole() {
        let tmp = tempfile::tempdir().unwrap();
        let cache = Arc::new(WarmCache::open(&tmp.path().join("cache"), 1 << 30).unwrap());
        let uppers: Vec<PathBuf> = (0..6)
            .map(|i| volume(tmp.path(), &format!("v{i}"), 64 << 10))
            .collect();
        let done: Vec<WarmTemplate> = std::thread::scope(|s| {
            let handles: Vec<_> = uppers
                .iter()
                .map(|upper| {
                    let cache = cache.clone();
                    s.spawn(move || {
                        cache
                            .commit("acme/web", &[upper.as_path()], "/work", Ulid::new())
                            .unwrap()
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        let current = cache.template("acme/web").unwrap();
        let winner = done
            .iter()
            .find(|t| t.generation == current.generation)
            .unwrap();
        let tree = cache.tree("acme/web", Ulid::from_string(&winner.generation).unwrap());
        let lock = fs::read_to_string(tree.join("app/Cargo.lock")).unwrap();
        assert_eq!(fs::metadata(tree.join("app/data")).unwrap().len(), 64 << 10);
        assert!(lock.starts_with('v'));
        cache.evict(HashSet::new);
        assert_eq!(generation_dirs(&tmp.path().join("cache"), "acme/web"), 1);
    }
}
