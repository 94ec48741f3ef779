//! The warm repo cache's half of the API: warm creates, commits, the
//! volume's lockfile status, templates, and the eviction tick (see
//! [`crate::warm`] for the cache itself).

use std::collections::HashSet;
use std::sync::{Arc, Weak};

use runbox_types::{ErrorCode, WarmCommit, WarmCommitRequest, WarmStatus, WarmTemplate};
use ulid::Ulid;

use super::actor::Access;
use super::Manager;
use crate::error::CoreError;
use crate::lane::WarmMount;
use crate::tenants::Owner;
use crate::validate;
use crate::warm::{join_dir, lockfile, scope_key, Pin, WarmCache, WarmVolume};

/// The volume's path when a create names none.
pub const DEFAULT_WARM_PATH: &str = "/work";

impl Manager {
    /// The cache, or why a warm operation is refused.
    fn warm_cache(&self) -> Result<&Arc<WarmCache>, CoreError> {
        cache_or_refusal(self.warm.as_ref())
    }

    /// Checks a create's `warm` and returns the repository and path.
    pub(crate) fn check_warm(
        &self,
        req: &runbox_types::WarmRequest,
    ) -> Result<(String, String), CoreError> {
        self.warm_cache()?;
        let repo = validate::repo(&req.repo)?;
        let path = validate::warm_path(req.path.as_deref().unwrap_or(DEFAULT_WARM_PATH))?;
        if let Err(why) = self.lane.capabilities().warm_volumes.check() {
            return Err(CoreError::invalid(
                ErrorCode::WarmCacheDisabled,
                format!("this server cannot give runs a warm volume: {why}"),
            ));
        }
        Ok((repo, path))
    }

    /// What a warm create by `tenant` mounts: its current template of the
    /// repository, pinned until the run is on the ledger, or an empty
    /// volume.
    pub(crate) fn warm_for_create(
        &self,
        repo: String,
        path: String,
        tenant: Option<&str>,
    ) -> (WarmVolume, WarmMount, Option<Pin>) {
        let pin = self
            .warm
            .as_ref()
            .and_then(|cache| cache.pin(&scope_key(tenant, &repo)));
        let volume = volume_of(repo, path.clone(), pin.as_ref());
        let mount = WarmMount {
            path,
            lower: pin.as_ref().map(|p| p.tree.clone()),
        };
        (volume, mount, pin)
    }

    /// What a fork's children mount: the parent's generation, pinned.
    pub(crate) fn warm_for_fork(
        &self,
        parent: &WarmVolume,
    ) -> Result<(WarmMount, Option<Pin>), CoreError> {
        pinned_mount(self.warm.as_ref(), parent)
    }

    /// Publishes run `id`'s warm volume as the template of `req.repo` (by
    /// default the run's own repository) of the run's tenant (or the
    /// operator's, for the operator's runs): the run is captured (frozen for
    /// a constant-time snapshot of its disk, then thawed), and the volume
    /// as it was then is written to the cache as a new generation.
    ///
    /// Cancellation: the commit runs in a task of its own; a client that
    /// hangs up does not stop it, and the template is published as usual.
    pub async fn warm_commit(
        self: &Arc<Self>,
        id: Ulid,
        req: WarmCommitRequest,
    ) -> Result<WarmCommit, CoreError> {
        let cache = self.warm_cache()?.clone();
        let record = self.admit(id, Access::Open).await?.record;
        let volume = record.warm.clone().ok_or_else(|| not_warm(id))?;
        let repo = match req.repo {
            Some(repo) => validate::repo(&repo)?,
            None => volume.repo.clone(),
        };
        let key = scope_key(record.tenant.as_deref(), &repo);
        let manager = self.clone();
        tokio::spawn(async move {
            let capture = manager.capture(id, "committed").await?;
            let upper = capture.warm_upper.clone().ok_or_else(|| {
                CoreError::Store(format!("the capture of run {id} has no warm volume"))
            })?;
            let base = match volume.generation {
                Some(g) => Some(cache.generation_tree(g).ok_or_else(|| {
                    CoreError::Store(format!("the warm generation {g} is gone from the cache"))
                })?),
                None => None,
            };
            let path = volume.path.clone();
            let template = tokio::task::spawn_blocking(move || {
                let mut layers = vec![upper.as_path()];
                if let Some(base) = &base {
                    layers.push(base.as_path());
                }
                let committed = cache.commit(&key, &layers, &path, id);
                drop(capture);
                committed
            })
            .await
            .map_err(|e| CoreError::Store(format!("warm commit task failed: {e}")))??;
            tracing::info!(
                run = %id,
                repo = %template.repo,
                generation = %template.generation,
                bytes = template.bytes,
                files = template.files,
                "warm template committed"
            );
            Ok(WarmCommit {
                repo: template.repo.clone(),
                lock_hash: template.lock_hash.clone(),
                repo_dir: template.repo_dir.clone(),
                template,
            })
        })
        .await
        .map_err(|e| CoreError::Store(format!("warm commit task failed: {e}")))?
    }

    /// Run `id`'s volume as it is now: its lockfile hash, to compare with
    /// the template's after a fetch or checkout.
    pub async fn warm_status(&self, id: Ulid) -> Result<WarmStatus, CoreError> {
        let record = self.admit(id, Access::Open).await?.record;
        let volume = record.warm.clone().ok_or_else(|| not_warm(id))?;
        let root =
            self.lane.sandbox(id).warm_volume().ok_or_else(|| {
                CoreError::Store(format!("run {id}'s warm volume is not mounted"))
            })?;
        let set = tokio::task::spawn_blocking(move || lockfile::lock_set(&root))
            .await
            .map_err(|e| CoreError::Store(format!("lockfile task failed: {e}")))?
            .map_err(CoreError::io("reading the volume's lockfiles"))?;
        let template = self
            .warm
            .as_ref()
            .and_then(|cache| cache.template(&scope_key(record.tenant.as_deref(), &volume.repo)));
        Ok(WarmStatus {
            repo_dir: join_dir(&volume.path, &set.subdir),
            repo: volume.repo,
            lock_hash: set.hash,
            lockfiles: set.files,
            booted_lock_hash: volume.lock_hash,
            template_lock_hash: template.map(|t| t.lock_hash),
        })
    }

    /// `owner`'s current template of `repo` (the root token's: the
    /// operator's own).
    pub fn warm_template(&self, repo: &str, owner: &Owner) -> Result<WarmTemplate, CoreError> {
        let cache = self.warm_cache()?;
        let repo = validate::repo(repo)?;
        cache
            .template(&scope_key(owner.tenant(), &repo))
            .ok_or_else(|| no_template(&repo))
    }

    /// The templates `owner` sees (root: every tenant's, each stamped), the
    /// bytes they hold (root: the whole cache) and the cache's cap.
    pub fn warm_templates(
        &self,
        owner: &Owner,
    ) -> Result<runbox_types::WarmTemplateList, CoreError> {
        let cache = self.warm_cache()?;
        let (mut templates, mut bytes) = cache.list();
        if owner.tenant().is_some() {
            templates.retain(|t| owner.sees(t.tenant.as_deref()));
            bytes = templates.iter().map(|t| t.bytes).sum();
        }
        Ok(runbox_types::WarmTemplateList {
            templates,
            bytes,
            max_bytes: cache.max_bytes(),
        })
    }

    /// Drops `owner`'s template of `repo` (forced invalidation). Runs using
    /// it keep it; its files are deleted once none does.
    pub async fn warm_invalidate(&self, repo: &str, owner: &Owner) -> Result<(), CoreError> {
        let cache = self.warm_cache()?.clone();
        let repo = validate::repo(repo)?;
        let name = scope_key(owner.tenant(), &repo);
        let dropped = tokio::task::spawn_blocking(move || cache.invalidate(&name))
            .await
            .map_err(|e| CoreError::Store(format!("warm invalidate task failed: {e}")))??;
        if dropped {
            tracing::info!(repo = %repo, "warm template invalidated");
            Ok(())
        } else {
            Err(no_template(&repo))
        }
    }

    /// The generations the runs on the ledger mount, in any phase.
    fn warm_in_use(&self) -> HashSet<Ulid> {
        self.context.ledger.warm_in_use()
    }

    /// Starts the maintenance tick that evicts from the warm cache (when
    /// there is one). It holds the manager weakly and ends with it.
    pub(crate) fn spawn_warm_tick(self: &Arc<Self>) {
        let (Some(_), Some(config)) = (&self.warm, &self.config().warm_cache) else {
            return;
        };
        let every = config.tick;
        let manager: Weak<Manager> = Arc::downgrade(self);
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(every);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tick.tick().await;
                let Some(manager) = manager.upgrade() else {
                    return;
                };
                let Some(cache) = manager.warm.clone() else {
                    return;
                };
                let evicted =
                    tokio::task::spawn_blocking(move || cache.evict(|| manager.warm_in_use()))
                        .await;
                match evicted {
                    Ok(report) if report.generations > 0 => tracing::info!(
                        generations = report.generations,
                        templates = ?report.templates,
                        bytes = report.bytes,
                        "warm cache evicted"
                    ),
                    Ok(_) => {}
                    Err(e) => tracing::error!(error = %e, "the warm cache tick failed"),
                }
            }
        });
    }
}

/// The record of a volume started from `pin` (or empty).
fn volume_of(repo: String, path: String, pin: Option<&Pin>) -> WarmVolume {
    match pin {
        Some(pin) => {
            let t = &pin.template;
            let subdir = t
                .repo_dir
                .strip_prefix(&t.path)
                .unwrap_or("")
                .trim_start_matches('/')
                .to_owned();
            WarmVolume {
                repo,
                path,
                generation: Some(pin.generation),
                lock_hash: Some(t.lock_hash.clone()),
                subdir: Some(subdir),
            }
        }
        None => WarmVolume {
            repo,
            path,
            generation: None,
            lock_hash: None,
            subdir: None,
        },
    }
}

fn not_warm(id: Ulid) -> CoreError {
    CoreError::Conflict {
        code: ErrorCode::RunNotWarm,
        message: format!("run {id} has no warm volume; create it with warm: {{repo}}"),
    }
}

fn no_template(repo: &str) -> CoreError {
    CoreError::invalid(
        ErrorCode::TemplateNotFound,
        format!("no warm template for {repo}; commit one with POST /v1/runs/{{id}}/warm-commit"),
    )
}

/// What a run with warm `volume` mounts (a fork's child, a run booted
/// again): the generation the volume holds, pinned while it is mounted.
pub(crate) fn pinned_mount(
    cache: Option<&Arc<WarmCache>>,
    volume: &WarmVolume,
) -> Result<(WarmMount, Option<Pin>), CoreError> {
    let Some(generation) = volume.generation else {
        return Ok((
            WarmMount {
                path: volume.path.clone(),
                lower: None,
            },
            None,
        ));
    };
    let pin = cache_or_refusal(cache)?
        .pin_generation(generation)
        .ok_or_else(|| {
            CoreError::Store(format!(
                "the warm generation {generation} the run mounts is gone from the cache"
            ))
        })?;
    Ok((
        WarmMount {
            path: volume.path.clone(),
            lower: Some(pin.tree.clone()),
        },
        Some(pin),
    ))
}

/// The warm cache, or why a warm operation is refused.
fn cache_or_refusal(cache: Option<&Arc<WarmCache>>) -> Result<&Arc<WarmCache>, CoreError> {
    cache.ok_or_else(|| {
        CoreError::invalid(
            ErrorCode::WarmCacheDisabled,
            "this server's warm repo cache is off (start it with --cache-root DIR)",
        )
    })
}
