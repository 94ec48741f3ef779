//! Running a build: the base resolved, the plan made against its
//! configuration, the cached prefix skipped, the rest run step by step in
//! one build run, each file-changing step captured as a cache image, and
//! the image recorded last.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::StreamExt;
use runbox_build::{Located, Plan, PlanError, Step};
use runbox_types::{
    BuildFailure, BuildRequest, BuildStatus, BuildStepStatus, CreateRunRequest, Env, ErrorCode,
    ExecRequest, PullPolicy,
};
use sha2::{Digest, Sha256};
use ulid::Ulid;

use super::{Builds, Live, BUILD_LABEL, BUILD_SOURCE_PREFIX, CACHE_SOURCE_PREFIX};
use crate::error::CoreError;
use crate::images::ImageConfig;
use crate::runs::{ExecEvent, Manager};
use crate::tenants::Owner;
use crate::validate;

/// The longest a build may take when the request does not say.
const DEFAULT_TIMEOUT: Duration = Duration::from_secs(3600);
/// The shell a step list's `RUN` commands are given to.
const LIST_SHELL: [&str; 2] = ["/bin/sh", "-c"];

/// A checked build request.
pub(crate) struct Job {
    pub(crate) name: String,
    pub(crate) from: String,
    pub(crate) warnings: Vec<String>,
    source: Source,
    /// The build's own context (a checked plain tar), if it has one.
    context: Option<PathBuf>,
    no_cache: bool,
    timeout: Duration,
    limits: Option<runbox_types::LimitsRequest>,
    labels: std::collections::BTreeMap<String, String>,
    /// The shell a step list's `RUN` is given to.
    shell: Vec<String>,
    /// How a step list's `COPY` names its files.
    files: super::ContextKind,
    /// More names the image is recorded under.
    also: Vec<String>,
}

enum Source {
    Dockerfile {
        text: String,
        options: runbox_build::dockerfile::Options,
    },
    List(Vec<runbox_build::list::ListStep>),
}

/// Why a build failed, as its record says.
struct Failure {
    code: String,
    message: String,
    step: Option<usize>,
    exit_code: Option<i32>,
    output: Vec<String>,
}

impl Failure {
    fn of(e: CoreError, step: Option<usize>) -> Failure {
        Failure {
            code: e.code().as_str().to_owned(),
            message: e.to_string(),
            step,
            exit_code: None,
            output: Vec::new(),
        }
    }
}

fn plan_error(e: PlanError) -> CoreError {
    let message = match e.line {
        Some(line) => format!("line {line}: {}", e.message),
        None => e.message,
    };
    CoreError::invalid(ErrorCode::BadDockerfile, message)
}

impl Job {
    /// Checks `req` before anything runs: what can be known wrong without
    /// the base image is refused here.
    pub(crate) fn check(
        manager: &Manager,
        builds: &Builds,
        req: BuildRequest,
        owner: &Owner,
        options: &super::BuildOptions,
    ) -> Result<Job, CoreError> {
        validate::new_image_name(&req.name)?;
        let labels = req.labels.unwrap_or_default();
        validate::labels(&labels)?;
        let max_ttl = manager.config().max_ttl;
        let timeout = match req.timeout_sec {
            None => DEFAULT_TIMEOUT.min(max_ttl),
            Some(0) => {
                return Err(CoreError::invalid(
                    ErrorCode::BadRequest,
                    "timeoutSec must be at least 1",
                ))
            }
            Some(secs) if Duration::from_secs(secs) > max_ttl => {
                return Err(CoreError::invalid(
                    ErrorCode::BadRequest,
                    format!(
                        "timeoutSec may be at most {} (the server's maximum run TTL)",
                        max_ttl.as_secs()
                    ),
                ))
            }
            Some(secs) => Duration::from_secs(secs),
        };
        let context = req
            .context
            .as_deref()
            .map(|digest| builds.context_file(owner, digest))
            .transpose()?;
        let build_args = req.build_args.unwrap_or_default();
        let (source, from, warnings) = match (req.dockerfile, req.steps) {
            (Some(text), None) => {
                if req.from.is_some() {
                    return Err(CoreError::invalid(
                        ErrorCode::BadRequest,
                        "from goes with steps; a Dockerfile names its base in FROM",
                    ));
                }
                let options = runbox_build::dockerfile::Options {
                    build_args,
                    target: req.target,
                };
                let from = runbox_build::dockerfile::base(&text, &options).map_err(plan_error)?;
                // Planned once without the base's configuration: every
                // error that does not depend on it is found now.
                let plan = runbox_build::dockerfile::plan(
                    &text,
                    &options,
                    &runbox_build::dockerfile::BaseConfig::default(),
                )
                .map_err(plan_error)?;
                if context.is_none() && plan.steps.iter().any(|s| copies_context(&s.step)) {
                    return Err(CoreError::invalid(
                        ErrorCode::BadBuildContext,
                        "the Dockerfile copies files but the build has no context; upload one and name it in context",
                    ));
                }
                (Source::Dockerfile { text, options }, from, plan.warnings)
            }
            (None, Some(steps)) => {
                if req.target.is_some() || !build_args.is_empty() {
                    return Err(CoreError::invalid(
                        ErrorCode::BadRequest,
                        "target and buildArgs go with a Dockerfile, not with steps",
                    ));
                }
                let Some(from) = req.from.filter(|f| !f.trim().is_empty()) else {
                    return Err(CoreError::invalid(
                        ErrorCode::BadRequest,
                        "a build of steps names its base image in from",
                    ));
                };
                let steps: Vec<runbox_build::list::ListStep> = steps
                    .into_iter()
                    .map(|s| runbox_build::list::ListStep {
                        kind: s.kind,
                        args: s.args,
                        files: s
                            .files
                            .or_else(|| req.context.clone())
                            .map(|f| f.strip_prefix("sha256:").unwrap_or(&f).to_owned()),
                    })
                    .collect();
                let plan = runbox_build::list::plan(&from, &steps, &Default::default())
                    .map_err(plan_error)?;
                for step in &plan.steps {
                    if let Step::Copy {
                        context: Some(files),
                        ..
                    } = &step.step
                    {
                        builds.context_file_in(owner, options.files, files)?;
                    }
                }
                (Source::List(steps), from, plan.warnings)
            }
            _ => {
                return Err(CoreError::invalid(
                    ErrorCode::BadRequest,
                    "a build takes either dockerfile or steps",
                ))
            }
        };
        for name in std::iter::once(&req.name).chain(&options.also) {
            validate::new_image_name(name)?;
            if let Ok(existing) = manager.images.store().image(name) {
                let theirs = match owner.tenant() {
                    None => false,
                    Some(tenant) => existing.tenant.as_deref() != Some(tenant),
                };
                if theirs || existing.source.starts_with(CACHE_SOURCE_PREFIX) {
                    return Err(CoreError::Conflict {
                        code: ErrorCode::ImageExists,
                        message: format!(
                            "an image named {name:?} exists and is not yours to replace; pick another name"
                        ),
                    });
                }
            }
        }
        Ok(Job {
            name: req.name,
            from,
            warnings,
            source,
            context,
            no_cache: req.no_cache,
            timeout,
            limits: req.limits,
            labels,
            shell: options
                .shell
                .clone()
                .unwrap_or_else(|| LIST_SHELL.iter().map(|s| (*s).to_owned()).collect()),
            files: options.files,
            also: options.also.clone(),
        })
    }

    /// The plan, given the base image's configuration.
    fn plan(&self, base: &ImageConfig) -> Result<Plan, CoreError> {
        let env: Vec<(String, String)> = base
            .env
            .0
            .iter()
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        match &self.source {
            Source::Dockerfile { text, options } => runbox_build::dockerfile::plan(
                text,
                options,
                &runbox_build::dockerfile::BaseConfig {
                    env,
                    working_dir: base.working_dir.clone(),
                },
            ),
            Source::List(steps) => runbox_build::list::plan(
                &self.from,
                steps,
                &runbox_build::list::ListOptions {
                    shell: self.shell.clone(),
                    workdir: base.working_dir.clone().unwrap_or_else(|| "/".to_owned()),
                    env,
                },
            ),
        }
        .map_err(plan_error)
    }
}

/// Whether `step` reads the build's own context.
fn copies_context(step: &Step) -> bool {
    matches!(step, Step::Copy { context: None, .. })
}

/// The image configuration as the steps change it.
#[derive(Clone)]
struct Config {
    doc: serde_json::Value,
    env: Vec<(String, String)>,
    workdir: Option<String>,
    user: Option<String>,
    /// Whether the build set `CMD` (an `ENTRYPOINT` then keeps it).
    cmd_set: bool,
}

impl Config {
    fn new(doc: serde_json::Value, base: &ImageConfig) -> Config {
        Config {
            doc,
            env: base
                .env
                .0
                .iter()
                .map(|(k, v)| (k.clone(), v.clone()))
                .collect(),
            workdir: base.working_dir.clone(),
            user: base.user.clone(),
            cmd_set: false,
        }
    }

    fn set_env(&mut self, pairs: &[(String, String)]) {
        for (name, value) in pairs {
            match self.env.iter_mut().find(|(k, _)| k == name) {
                Some(slot) => slot.1 = value.clone(),
                None => self.env.push((name.clone(), value.clone())),
            }
        }
    }

    /// Applies a step's change of configuration.
    fn apply(&mut self, step: &Step) {
        let config = &mut self.doc["config"];
        if !config.is_object() {
            *config = serde_json::json!({});
        }
        match step {
            Step::Env(pairs) => self.set_env(pairs),
            Step::Workdir(dir) => self.workdir = Some(dir.clone()),
            Step::User(user) => self.user = Some(user.clone()),
            Step::Cmd(argv) => {
                config["Cmd"] = argv.clone().into();
                self.cmd_set = true;
            }
            Step::Entrypoint(argv) => {
                config["Entrypoint"] = argv.clone().into();
                // An entrypoint set here drops the base's command, not
                // one this build set.
                if !self.cmd_set {
                    if let Some(c) = config.as_object_mut() {
                        c.remove("Cmd");
                    }
                }
            }
            Step::Expose(ports) => {
                let exposed = &mut config["ExposedPorts"];
                if !exposed.is_object() {
                    *exposed = serde_json::json!({});
                }
                for port in ports {
                    let port = if port.contains('/') {
                        port.clone()
                    } else {
                        format!("{port}/tcp")
                    };
                    exposed[port] = serde_json::json!({});
                }
            }
            Step::Label(labels) => {
                let all = &mut config["Labels"];
                if !all.is_object() {
                    *all = serde_json::json!({});
                }
                for (k, v) in labels {
                    all[k] = v.clone().into();
                }
            }
            Step::Run { .. } | Step::Copy { .. } => {}
        }
    }

    /// The OCI config document.
    fn document(&self) -> serde_json::Value {
        let mut doc = self.doc.clone();
        let config = &mut doc["config"];
        if !config.is_object() {
            *config = serde_json::json!({});
        }
        config["Env"] = self
            .env
            .iter()
            .map(|(k, v)| format!("{k}={v}"))
            .collect::<Vec<_>>()
            .into();
        if let Some(c) = config.as_object_mut() {
            match &self.workdir {
                Some(dir) => c.insert("WorkingDir".into(), dir.clone().into()),
                None => c.remove("WorkingDir"),
            };
            match &self.user {
                Some(user) => c.insert("User".into(), user.clone().into()),
                None => c.remove("User"),
            };
        }
        doc
    }
}

/// What a build's steps left: the image to record.
struct Finished {
    layers: Vec<String>,
    doc: serde_json::Value,
}

/// Where the build stands while its steps run.
struct Progress {
    /// The image the build run starts from.
    image: String,
    /// The layers of every step so far (what the image is made of).
    layers: Vec<String>,
    /// The layers the build run was made from.
    start: Vec<String>,
    /// The build run, once made.
    run: Option<Ulid>,
}

impl Manager {
    /// Runs build `job` to its end and records how it ended.
    pub(super) async fn drive(
        self: Arc<Self>,
        builds: Arc<Builds>,
        live: Arc<Live>,
        job: Job,
        owner: Owner,
    ) {
        let id = live.build().id;
        let started = Instant::now();
        let outcome = tokio::select! {
            outcome = self.execute(&builds, &live, &job, &owner) => outcome,
            _ = live.cancel.cancelled() => Err(Failure {
                code: "cancelled".into(),
                message: "the build was cancelled".into(),
                step: None, exit_code: None, output: Vec::new(),
            }),
            _ = tokio::time::sleep(job.timeout) => Err(Failure {
                code: "build_timeout".into(),
                message: format!("the build took longer than its {} s timeout", job.timeout.as_secs()),
                step: None, exit_code: None, output: live.tail(),
            }),
        };
        let outcome = match outcome {
            Ok(finished) if !live.cancel.is_cancelled() => {
                let recorded = self.record_image(id, &job, &owner, finished).await;
                if recorded.is_ok() {
                    live.line(0, "build", &format!("recorded image {}", job.name));
                }
                recorded
            }
            Ok(_) => Err(Failure {
                code: "cancelled".into(),
                message: "the build was cancelled".into(),
                step: None,
                exit_code: None,
                output: Vec::new(),
            }),
            Err(failure) => Err(failure),
        };
        // The run goes whatever happened: it holds nothing the image needs.
        if let Some(run) = live.build().run {
            if let Err(e) = self.delete(run).await {
                if !matches!(e, CoreError::RunNotFound(_)) {
                    tracing::warn!(build = %id, %run, error = %e, "could not delete the build's run");
                }
            }
        }
        let finished = {
            let mut state = live.lock();
            let build = &mut state.build;
            build.run = None;
            build.finished_at = Some(time::OffsetDateTime::now_utc());
            match outcome {
                Ok(()) => build.status = BuildStatus::Ready,
                Err(failure) => {
                    let running = build
                        .steps
                        .iter()
                        .find(|s| s.status == BuildStepStatus::Running)
                        .map(|s| s.index);
                    for step in &mut build.steps {
                        if step.status == BuildStepStatus::Running {
                            step.status = BuildStepStatus::Failed;
                        }
                    }
                    build.status = if failure.code == "cancelled" {
                        BuildStatus::Cancelled
                    } else {
                        BuildStatus::Failed
                    };
                    build.error = Some(BuildFailure {
                        code: failure.code,
                        message: failure.message,
                        step: failure.step.or(running),
                        exit_code: failure.exit_code,
                        output: failure.output,
                    });
                }
            }
            if let Some(log) = state.log.as_mut() {
                use std::io::Write;
                let _ = log.flush();
            }
            state.log = None;
            state.build.clone()
        };
        builds.persist(&finished);
        tracing::info!(build = %id, image = %finished.name, status = ?finished.status, elapsed_ms = started.elapsed().as_millis() as u64, "build ended");
        {
            let mut state = live.lock();
            live.push(&mut state, super::BuildEvent::Done(Box::new(finished)));
        }
        builds.lock().remove(&id);
        let sweeping = builds.clone();
        let _ = tokio::task::spawn_blocking(move || sweeping.sweep()).await;
        if let Err(e) = self.sweep_build_cache().await {
            tracing::warn!(error = %e, "could not sweep the build cache");
        }
    }

    /// The steps of `job`, up to the recorded image.
    async fn execute(
        self: &Arc<Self>,
        builds: &Arc<Builds>,
        live: &Arc<Live>,
        job: &Job,
        owner: &Owner,
    ) -> Result<Finished, Failure> {
        let id = live.build().id;
        let deadline = Instant::now() + job.timeout;
        let server = self.config().server_id.clone();
        live.line(0, "build", &format!("FROM {}", job.from));
        self.check_image_for(owner, &job.from)
            .await
            .map_err(|e| Failure::of(e, None))?;
        let base = self
            .image_for_run(&job.from, PullPolicy::IfNotPresent)
            .await
            .map_err(|e| Failure::of(e, None))?;
        let base_image = {
            let images = self.images.clone();
            let (base, server) = (base.clone(), server.clone());
            tokio::task::spawn_blocking(move || images.get(&base, &server, true))
                .await
                .map_err(|e| Failure::of(CoreError::Store(e.to_string()), None))?
                .map_err(|e| Failure::of(e, None))?
        };
        let doc = base_image
            .config
            .clone()
            .unwrap_or_else(|| serde_json::json!({"config": {}}));
        let base_config = ImageConfig::from_oci(&doc);
        let plan = job.plan(&base_config).map_err(|e| Failure::of(e, None))?;
        {
            let mut state = live.lock();
            state.build.steps = plan
                .steps
                .iter()
                .enumerate()
                .map(|(i, s)| runbox_types::BuildStep {
                    index: i + 1,
                    line: s.line,
                    text: s.text.clone(),
                    status: BuildStepStatus::Pending,
                    elapsed_ms: None,
                })
                .collect();
            state.build.warnings = plan.warnings.clone();
            let steps = state.build.steps.clone();
            for step in steps {
                live.push(&mut state, super::BuildEvent::Step(step));
            }
        }
        builds.persist(&live.build());
        for warning in &plan.warnings {
            live.line(0, "build", &format!("warning: {warning}"));
        }

        // The cache keys: each state's from the one before it. A COPY's
        // key reads its selection's digest here, and the step reads the
        // context again to write the archive: whether the destination is
        // a directory is known only in the run, and reading twice keeps
        // no scratch file per COPY alive for the whole build.
        let ignore = match &job.source {
            Source::Dockerfile { .. } => self.context_ignore(job.context.clone()).await?,
            Source::List(_) => None,
        };
        let mut keys = Vec::with_capacity(plan.steps.len());
        let mut parent = {
            let mut root = Sha256::new();
            root.update(b"runbox-build-root-1\0");
            root.update(owner.tenant().unwrap_or("").as_bytes());
            root.update(b"\0");
            root.update(base_image.layers.join("\n").as_bytes());
            root.update(b"\0");
            // RUN reads the base's Env, User and WorkingDir: images of
            // equal layers and other configurations are other states.
            root.update(doc["config"].to_string().as_bytes());
            format!("{:x}", root.finalize())
        };
        for (index, located) in plan.steps.iter().enumerate() {
            let inputs = match &located.step {
                Step::Copy {
                    context,
                    sources,
                    dest,
                    ..
                } => {
                    let path = self
                        .copy_context(builds, job, owner, context.as_deref())
                        .map_err(|e| Failure::of(e, Some(index + 1)))?;
                    let selection = self
                        .select(
                            builds,
                            path,
                            ignore.clone(),
                            sources.clone(),
                            dest.clone(),
                            true,
                            false,
                        )
                        .await
                        .map_err(|e| Failure::of(e, Some(index + 1)))?;
                    vec![selection.0.digest]
                }
                _ => Vec::new(),
            };
            parent = runbox_build::cache_key(&parent, &located.step, &inputs);
            keys.push(parent.clone());
        }
        // The deepest cached state a file-changing step left.
        let mut progress = Progress {
            image: base.clone(),
            layers: base_image.layers.clone(),
            start: Vec::new(),
            run: None,
        };
        let mut first = 0;
        if !job.no_cache {
            for index in (0..plan.steps.len()).rev() {
                if !plan.steps[index].step.changes_files() {
                    continue;
                }
                let name = cache_name(&keys[index]);
                if let Ok(record) = self.images.store().image(&name) {
                    if record.source.starts_with(CACHE_SOURCE_PREFIX)
                        && record.tenant.as_deref() == owner.tenant()
                    {
                        progress.image = name;
                        progress.layers = record.layers;
                        first = index + 1;
                        // Configuration steps right after it change no
                        // file: the cache stands for them too.
                        while first < plan.steps.len() && !plan.steps[first].step.changes_files() {
                            first += 1;
                        }
                        break;
                    }
                }
            }
        }
        let mut config = Config::new(doc, &base_config);
        for (index, located) in plan.steps.iter().enumerate() {
            config.apply(&located.step);
            if index < first {
                live.step(index + 1, |s| s.status = BuildStepStatus::Cached);
                live.line(index + 1, "build", &format!("CACHED {}", located.text));
                // The state before a step: its configuration so far.
                continue;
            }
            live.step(index + 1, |s| s.status = BuildStepStatus::Running);
            live.line(index + 1, "build", &located.text);
            let started = Instant::now();
            if located.step.changes_files() {
                let run = match progress.run {
                    Some(run) => run,
                    None => {
                        let run = self
                            .build_run(live, job, owner, &progress.image, deadline)
                            .await
                            .map_err(|e| Failure::of(e, Some(index + 1)))?;
                        progress.run = Some(run);
                        // Every capture of this run is all it changed,
                        // on what it was made from.
                        progress.start = self
                            .admit(run, crate::runs::actor::Access::Open)
                            .await
                            .map_err(|e| Failure::of(e, Some(index + 1)))?
                            .record
                            .layers
                            .clone();
                        run
                    }
                };
                // Configuration steps change nothing a file step reads but
                // WORKDIR's own directory, which is made as the user so far.
                self.run_step(
                    builds,
                    live,
                    job,
                    owner,
                    run,
                    index + 1,
                    located,
                    &config,
                    ignore.clone(),
                    deadline,
                )
                .await?;
                let name = cache_name(&keys[index]);
                if job.no_cache {
                    // Run again on purpose: the fresh capture is the entry.
                    self.forget_cache_entry(&name, owner).await;
                }
                let base = crate::images::SnapshotBase {
                    parent: progress.image.clone(),
                    layers: progress.start.clone(),
                    config: config.document(),
                    run,
                    tenant: owner.tenant().map(str::to_owned),
                    labels: Default::default(),
                    source: Some(format!("{CACHE_SOURCE_PREFIX}{id}:{}", keys[index])),
                };
                let kept = self.capture_image(run, None, &name, base).await;
                let layers = match kept {
                    Ok((image, ..)) => image.layers,
                    // Another build of the tenant's kept the same state
                    // meanwhile: its entry stands for this step.
                    Err(CoreError::Conflict {
                        code: ErrorCode::ImageExists,
                        ..
                    }) => match self.images.store().image(&name) {
                        Ok(r)
                            if r.source.starts_with(CACHE_SOURCE_PREFIX)
                                && r.tenant.as_deref() == owner.tenant() =>
                        {
                            r.layers
                        }
                        _ => return Err(Failure::of(taken(&name), Some(index + 1))),
                    },
                    Err(e) => return Err(Failure::of(e, Some(index + 1))),
                };
                // The layers of the last capture stand for every step so
                // far; the run's own mount is unchanged.
                progress.layers = layers;
            }
            let elapsed = started.elapsed().as_secs_f64() * 1000.0;
            live.step(index + 1, |s| {
                s.status = BuildStepStatus::Done;
                s.elapsed_ms = Some(elapsed);
            });
            builds.persist(&live.build());
        }
        Ok(Finished {
            layers: progress.layers,
            doc: config.document(),
        })
    }

    /// Records the image a build finished: every layer of its steps, with
    /// the configuration they set. One write, which a cancel does not cut
    /// (it is the build's last act); whatever failed before it left no
    /// image.
    async fn record_image(
        &self,
        id: Ulid,
        job: &Job,
        owner: &Owner,
        finished: Finished,
    ) -> Result<(), Failure> {
        let images = self.images.clone();
        let names: Vec<String> = std::iter::once(&job.name)
            .chain(&job.also)
            .cloned()
            .collect();
        let (source, tenant, labels) = (
            format!("{BUILD_SOURCE_PREFIX}{id}"),
            owner.tenant().map(str::to_owned),
            job.labels.clone(),
        );
        tokio::task::spawn_blocking(move || {
            // The build's name first: a build whose record is there is
            // ready (see `Builds::settle_unfinished`).
            for name in names.iter().rev() {
                images.record_built(
                    name,
                    source.clone(),
                    finished.layers.clone(),
                    &finished.doc,
                    tenant.clone(),
                    labels.clone(),
                )?;
            }
            Ok(())
        })
        .await
        .map_err(|e| Failure::of(CoreError::Store(e.to_string()), None))?
        .map_err(|e| Failure::of(e, None))
    }

    /// Makes the build run from `image`.
    async fn build_run(
        self: &Arc<Self>,
        live: &Arc<Live>,
        job: &Job,
        owner: &Owner,
        image: &str,
        deadline: Instant,
    ) -> Result<Ulid, CoreError> {
        let id = live.build().id;
        let ttl = deadline
            .saturating_duration_since(Instant::now())
            .as_secs()
            .saturating_add(120)
            .min(self.config().max_ttl.as_secs());
        let req = CreateRunRequest {
            image: image.to_owned(),
            pull: Some(PullPolicy::Never),
            ttl_sec: Some(ttl.max(1)),
            network: Some(self.config().build_network),
            limits: job.limits,
            labels: Some([(BUILD_LABEL.to_owned(), id.to_string())].into()),
            // Builds install packages: setuid helpers (sudo, su) work as in
            // any image build, inside the run's own user namespace.
            allow_privilege_escalation: self
                .lane
                .capabilities()
                .user_namespaces
                .yes()
                .then_some(true),
            ..Default::default()
        };
        let run = self.create(req, None, owner.clone()).await?;
        live.lock().build.run = Some(run.id);
        Ok(run.id)
    }

    /// Runs one file-changing step in `run`.
    #[allow(clippy::too_many_arguments)]
    async fn run_step(
        self: &Arc<Self>,
        builds: &Arc<Builds>,
        live: &Arc<Live>,
        job: &Job,
        owner: &Owner,
        run: Ulid,
        index: usize,
        located: &Located,
        config: &Config,
        ignore: Option<Arc<runbox_build::context::Ignore>>,
        deadline: Instant,
    ) -> Result<(), Failure> {
        let fail = |e: CoreError| Failure::of(e, Some(index));
        match &located.step {
            Step::Run { argv, env, user } => {
                let mut all = config.env.clone();
                all.extend(env.iter().cloned());
                let left = deadline
                    .saturating_duration_since(Instant::now())
                    .as_secs()
                    .max(1);
                let req = ExecRequest {
                    cmd: argv.clone(),
                    cwd: Some(config.workdir.clone().unwrap_or_else(|| "/".to_owned())),
                    env: Some(Env(all.into_iter().collect())),
                    user: Some(
                        user.clone()
                            .or_else(|| config.user.clone())
                            .unwrap_or_else(|| "0".to_owned()),
                    ),
                    timeout_sec: Some(left),
                    ..Default::default()
                };
                let mut events = Box::pin(self.exec(run, req).await.map_err(fail)?);
                let mut lines = Lines::default();
                while let Some(event) = events.next().await {
                    match event {
                        ExecEvent::Stdout(bytes) => lines.feed(live, index, "stdout", &bytes),
                        ExecEvent::Stderr(bytes) => lines.feed(live, index, "stderr", &bytes),
                        ExecEvent::Lost(n) => {
                            live.line(index, "build", &format!("({n} bytes of output were lost)"))
                        }
                        ExecEvent::Started(_) => {}
                        ExecEvent::Exit(exit) => {
                            lines.finish(live, index);
                            if exit.exit_code == 0 {
                                return Ok(());
                            }
                            let message = if exit.timed_out {
                                format!(
                                    "step {index} ({}) ran past the build's timeout",
                                    located.text
                                )
                            } else {
                                format!(
                                    "step {index} ({}) exited with code {}",
                                    located.text, exit.exit_code
                                )
                            };
                            return Err(Failure {
                                code: if exit.timed_out {
                                    "build_timeout"
                                } else {
                                    "step_failed"
                                }
                                .into(),
                                message,
                                step: Some(index),
                                exit_code: Some(exit.exit_code),
                                output: live.tail(),
                            });
                        }
                    }
                }
                Err(fail(CoreError::Agent(
                    "the step's command ended without an exit status".into(),
                )))
            }
            Step::Workdir(dir) => {
                self.make_dir(
                    run,
                    crate::runs::Scope::Root,
                    runbox_types::MakeDirRequest {
                        path: dir.clone(),
                        ..Default::default()
                    },
                    config.user.clone(),
                )
                .await
                .map_err(fail)?;
                Ok(())
            }
            Step::Copy {
                context,
                sources,
                dest,
                chown,
                chmod,
                unpack_archives,
            } => {
                if *unpack_archives && sources.iter().any(|s| is_archive_name(s)) {
                    return Err(fail(CoreError::invalid(
                        ErrorCode::BadDockerfile,
                        format!(
                            "line {}: ADD of a local archive is not built yet; COPY it and unpack it in a RUN step",
                            located.line
                        ),
                    )));
                }
                let path = self
                    .copy_context(builds, job, owner, context.as_deref())
                    .map_err(fail)?;
                let dest_is_dir = dest.ends_with('/')
                    || matches!(
                        self.stat_path(run, crate::runs::Scope::Root, Some(dest.as_str())).await,
                        Ok(info) if info.kind == runbox_types::FileKind::Directory
                    );
                let (selection, archive) = self
                    .select(
                        builds,
                        path,
                        ignore,
                        sources.clone(),
                        dest.clone(),
                        dest_is_dir,
                        true,
                    )
                    .await
                    .map_err(fail)?;
                let archive = archive.expect("kept when asked");
                let file = tokio::fs::File::open(archive.path())
                    .await
                    .map_err(|e| fail(CoreError::io("reading a copy's archive")(e)))?;
                let body = tokio_util::io::ReaderStream::new(file);
                let stats = self
                    .unpack(run, &selection.dir, chown.clone(), chmod.unwrap_or(0), body)
                    .await
                    .map_err(fail)?;
                live.line(
                    index,
                    "build",
                    &format!(
                        "copied {} entries ({} bytes) to {}",
                        stats.entries, stats.bytes, selection.dir
                    ),
                );
                Ok(())
            }
            _ => Ok(()),
        }
    }

    /// The context a `COPY` reads: its own upload, or the build's.
    fn copy_context(
        &self,
        builds: &Builds,
        job: &Job,
        owner: &Owner,
        context: Option<&str>,
    ) -> Result<PathBuf, CoreError> {
        match context {
            Some(digest) => builds.context_file_in(owner, job.files, digest),
            None => job.context.clone().ok_or_else(|| {
                CoreError::invalid(
                    ErrorCode::BadBuildContext,
                    "this build has no context to copy from",
                )
            }),
        }
    }

    /// The context's `.dockerignore`, if it has one.
    async fn context_ignore(
        &self,
        context: Option<PathBuf>,
    ) -> Result<Option<Arc<runbox_build::context::Ignore>>, Failure> {
        let Some(path) = context else {
            return Ok(None);
        };
        tokio::task::spawn_blocking(move || -> Result<_, CoreError> {
            let file =
                std::fs::File::open(&path).map_err(CoreError::io("reading the build context"))?;
            let mut archive = tar::Archive::new(std::io::BufReader::new(file));
            for entry in archive
                .entries()
                .map_err(CoreError::io("reading the build context"))?
            {
                let mut entry = entry.map_err(CoreError::io("reading the build context"))?;
                let name = entry
                    .path()
                    .map_err(CoreError::io("reading the build context"))?;
                let name = name.to_string_lossy();
                if name.trim_start_matches("./") != ".dockerignore" {
                    continue;
                }
                let mut text = String::new();
                use std::io::Read;
                entry
                    .by_ref()
                    .take(runbox_build::context::MAX_IGNORE_BYTES as u64)
                    .read_to_string(&mut text)
                    .map_err(|e| {
                        CoreError::invalid(
                            ErrorCode::BadBuildContext,
                            format!(".dockerignore is not text: {e}"),
                        )
                    })?;
                let ignore = runbox_build::context::Ignore::parse(&text).map_err(|e| {
                    CoreError::invalid(
                        ErrorCode::BadBuildContext,
                        format!(".dockerignore: {}", e.message),
                    )
                })?;
                return Ok(Some(Arc::new(ignore)));
            }
            Ok(None)
        })
        .await
        .map_err(|e| Failure::of(CoreError::Store(e.to_string()), None))?
        .map_err(|e| Failure::of(e, None))
    }

    /// What a `COPY` puts where: the selection from the context at `path`
    /// and, when `keep`, the archive of it (a scratch file).
    #[allow(clippy::too_many_arguments)]
    async fn select(
        &self,
        builds: &Arc<Builds>,
        path: PathBuf,
        ignore: Option<Arc<runbox_build::context::Ignore>>,
        sources: Vec<String>,
        dest: String,
        dest_is_dir: bool,
        keep: bool,
    ) -> Result<
        (
            runbox_build::copy::Selection,
            Option<tempfile::NamedTempFile>,
        ),
        CoreError,
    > {
        let builds = builds.clone();
        tokio::task::spawn_blocking(move || {
            let context =
                std::fs::File::open(&path).map_err(CoreError::io("reading the build context"))?;
            let user = |e: runbox_build::copy::CopyError| match e {
                runbox_build::copy::CopyError::Io(e) => CoreError::io("selecting files to copy")(e),
                other => CoreError::invalid(ErrorCode::BadDockerfile, other.to_string()),
            };
            let scratch = keep.then(|| builds.scratch()).transpose()?;
            let out: Box<dyn std::io::Write> = match &scratch {
                Some(scratch) => Box::new(std::io::BufWriter::new(scratch.as_file())),
                None => Box::new(std::io::sink()),
            };
            let selection = runbox_build::copy::select(
                std::io::BufReader::new(context),
                ignore.as_deref(),
                &sources,
                &dest,
                dest_is_dir,
                out,
            )
            .map_err(user)?;
            Ok((selection, scratch))
        })
        .await
        .map_err(|e| CoreError::Store(format!("copy selection task failed: {e}")))?
    }

    /// Forgets cache entry `name` when it is `owner`'s (its layers stay
    /// while a run or an image uses them).
    async fn forget_cache_entry(&self, name: &str, owner: &Owner) {
        let _guard = self.image_lock.lock().await;
        let ours = self.images.store().image(name).is_ok_and(|r| {
            r.source.starts_with(CACHE_SOURCE_PREFIX) && r.tenant.as_deref() == owner.tenant()
        });
        if ours {
            let _ = self.images.forget(name);
        }
    }

    /// Drops the oldest cached steps past the configured count (those no
    /// run uses), then the layers only they held. Nothing is dropped
    /// while a build runs: it may be about to start from an entry, or
    /// record on one.
    pub(crate) async fn sweep_build_cache(self: &Arc<Self>) -> Result<(), CoreError> {
        if self.builds.get().is_some_and(|b| !b.lock().is_empty()) {
            return Ok(());
        }
        let keep = self.config().build_cache_entries;
        let mut cached: Vec<runbox_image::store::ImageRecord> = {
            let images = self.images.clone();
            tokio::task::spawn_blocking(move || images.store().images())
                .await
                .map_err(|e| CoreError::Store(e.to_string()))?
                .map_err(crate::images::store_error)?
                .into_iter()
                .filter(|r| r.source.starts_with(CACHE_SOURCE_PREFIX))
                .collect()
        };
        if cached.len() <= keep {
            return Ok(());
        }
        cached.sort_by_key(|r| r.created_unix);
        let excess = cached.len() - keep;
        let mut dropped = 0;
        {
            let _guard = self.image_lock.lock().await;
            for record in cached.iter().take(excess) {
                if self.image_in_use(&record.name) {
                    continue;
                }
                if self.images.forget(&record.name).is_ok() {
                    dropped += 1;
                }
            }
        }
        if dropped > 0 {
            tracing::info!(entries = dropped, "dropped the oldest cached build steps");
            self.collect_garbage().await?;
        }
        Ok(())
    }
}

/// Why a cache entry could not be recorded: its name is another's.
fn taken(name: &str) -> CoreError {
    CoreError::Store(format!(
        "the cache entry {name} could not be recorded: the name is taken"
    ))
}

/// The image name of a cached state.
fn cache_name(key: &str) -> String {
    format!("{}{}", validate::BUILD_CACHE_PREFIX, &key[..40])
}

/// Whether `source` names what `ADD` would unpack.
fn is_archive_name(source: &str) -> bool {
    [
        ".tar", ".tar.gz", ".tgz", ".tar.xz", ".txz", ".tar.bz2", ".tbz2", ".tar.zst",
    ]
    .iter()
    .any(|ext| source.to_ascii_lowercase().ends_with(ext))
}

/// A command's output cut into lines, per stream.
#[derive(Default)]
struct Lines {
    stdout: Vec<u8>,
    stderr: Vec<u8>,
}

impl Lines {
    fn feed(&mut self, live: &Live, step: usize, stream: &str, bytes: &[u8]) {
        let buf = if stream == "stdout" {
            &mut self.stdout
        } else {
            &mut self.stderr
        };
        buf.extend_from_slice(bytes);
        while let Some(at) = buf.iter().position(|&b| b == b'\n') {
            let line: Vec<u8> = buf.drain(..=at).collect();
            live.line(
                step,
                stream,
                &String::from_utf8_lossy(&line[..line.len() - 1]),
            );
        }
        // A line that never ends is cut where the log would cut it.
        if buf.len() > super::MAX_LINE_BYTES {
            let line: Vec<u8> = std::mem::take(buf);
            live.line(step, stream, &String::from_utf8_lossy(&line));
        }
    }

    fn finish(&mut self, live: &Live, step: usize) {
        for (stream, buf) in [("stdout", &mut self.stdout), ("stderr", &mut self.stderr)] {
            if !buf.is_empty() {
                let line = std::mem::take(buf);
                live.line(step, stream, &String::from_utf8_lossy(&line));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn config_steps_change_the_document() {
        let base = ImageConfig {
            env: Env([("PATH".to_owned(), "/bin".to_owned())].into()),
            working_dir: None,
            entrypoint: Vec::new(),
            cmd: vec!["sh".into()],
            user: None,
        };
        let mut config = Config::new(
            serde_json::json!({"config": {"Cmd": ["sh"]}, "architecture": "amd64"}),
            &base,
        );
        config.apply(&Step::Env(vec![
            ("A".into(), "1".into()),
            ("PATH".into(), "/usr/bin".into()),
        ]));
        config.apply(&Step::Workdir("/app".into()));
        config.apply(&Step::User("app".into()));
        config.apply(&Step::Entrypoint(vec!["/app/run".into()]));
        config.apply(&Step::Expose(vec!["80".into(), "53/udp".into()]));
        config.apply(&Step::Label(vec![("k".into(), "v".into())]));
        let doc = config.document();
        assert_eq!(doc["architecture"], "amd64");
        let c = &doc["config"];
        assert_eq!(c["Env"], serde_json::json!(["PATH=/usr/bin", "A=1"]));
        assert_eq!(c["WorkingDir"], "/app");
        assert_eq!(c["User"], "app");
        assert_eq!(c["Entrypoint"], serde_json::json!(["/app/run"]));
        assert!(
            c.get("Cmd").is_none(),
            "an entrypoint drops the inherited command"
        );
        let mut again = config.clone();
        again.apply(&Step::Cmd(vec!["--port".into(), "80".into()]));
        again.apply(&Step::Entrypoint(vec!["/srv".into()]));
        assert_eq!(
            again.document()["config"]["Cmd"],
            serde_json::json!(["--port", "80"]),
            "a command this build set stays"
        );
        assert_eq!(
            c["ExposedPorts"],
            serde_json::json!({"80/tcp": {}, "53/udp": {}})
        );
        assert_eq!(c["Labels"], serde_json::json!({"k": "v"}));
        let read = ImageConfig::from_oci(&doc);
        assert_eq!(read.working_dir.as_deref(), Some("/app"));
        assert_eq!(read.user.as_deref(), Some("app"));
    }

    #[test]
    fn archive_names_are_known_by_their_ending() {
        assert!(is_archive_name("x.tar.gz") && is_archive_name("A.TGZ"));
        assert!(!is_archive_name("x.txt") && !is_archive_name("tar"));
    }

    #[test]
    fn cache_names_are_image_names() {
        let name = cache_name(&"a".repeat(64));
        validate::image_name(&name).unwrap();
    }
}
