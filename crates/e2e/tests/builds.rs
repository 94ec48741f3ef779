//! Image builds: Dockerfiles run step by step in a real build run on the
//! real runtime, COPY through the agent, each step captured in the btrfs
//! run store, the step cache, and every way a build can be refused, fail,
//! be cancelled or be cut short by a killed daemon.

use std::time::Duration;

use futures::StreamExt;
use runbox_client::{BuildUpdate, Client};
use runbox_e2e::{eventually_async, TestDaemon};
use runbox_types::{
    Build, BuildRequest, BuildStatus, BuildStepStatus, CreateRunRequest, ErrorCode, ExecRequest,
};

/// A context archive of `files` (`path`, mode, contents; a path ending `/`
/// is a directory) and its digest.
fn context(files: &[(&str, u32, &[u8])]) -> (Vec<u8>, String) {
    let mut builder = tar::Builder::new(Vec::new());
    for (path, mode, data) in files {
        let mut header = tar::Header::new_gnu();
        header.set_mode(*mode);
        header.set_mtime(1_700_000_000);
        if path.ends_with('/') {
            header.set_entry_type(tar::EntryType::Directory);
            header.set_size(0);
            builder
                .append_data(&mut header, path.trim_end_matches('/'), &[][..])
                .unwrap();
        } else {
            header.set_entry_type(tar::EntryType::Regular);
            header.set_size(data.len() as u64);
            builder.append_data(&mut header, path, *data).unwrap();
        }
    }
    let bytes = builder.into_inner().unwrap();
    let digest = runbox_e2e::sha256(&bytes);
    (bytes, digest)
}

async fn upload(client: &Client, files: &[(&str, u32, &[u8])]) -> String {
    let (bytes, digest) = context(files);
    client
        .put_build_context(&digest, runbox_e2e::body(bytes))
        .await
        .expect("uploading the context");
    digest
}

fn dockerfile(name: &str, text: &str, context: Option<&str>) -> BuildRequest {
    BuildRequest {
        name: name.into(),
        dockerfile: Some(text.into()),
        context: context.map(str::to_owned),
        ..Default::default()
    }
}

/// Starts a build and follows its events to the end; returns the build as
/// it ended and every log line.
async fn build(daemon: &TestDaemon, req: &BuildRequest) -> (Build, Vec<String>) {
    let started = match daemon.client.start_build(req).await {
        Ok(b) => b,
        Err(e) => panic!("starting the build failed: {e}; log:\n{}", daemon.log()),
    };
    assert_eq!(started.status, BuildStatus::Building);
    follow(&daemon.client, &started.id.to_string()).await
}

async fn follow(client: &Client, id: &str) -> (Build, Vec<String>) {
    let mut events = client.build_events(id, 0).await.expect("events");
    let mut lines = Vec::new();
    while let Some(update) = events.next().await {
        match update.expect("an event") {
            BuildUpdate::Log(line) => lines.push(line.text),
            BuildUpdate::Step(_) => {}
            BuildUpdate::Done(build) => return (*build, lines),
        }
    }
    panic!("the events ended without done");
}

async fn run_of(daemon: &TestDaemon, image: &str, script: &str) -> String {
    let run = daemon
        .create_with(CreateRunRequest {
            image: image.into(),
            ..Default::default()
        })
        .await
        .id
        .to_string();
    let out = daemon
        .exec(
            &run,
            ExecRequest {
                cmd: vec!["sh".into(), "-c".into(), script.into()],
                // Runs from the image as its USER; the checks read as root.
                user: Some("0".into()),
                ..Default::default()
            },
        )
        .await;
    daemon.client.delete_run(&run).await.unwrap();
    assert_eq!(
        out.exit.exit_code,
        0,
        "{script}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Runs a build left: none once every build has ended.
async fn build_runs(client: &Client) -> usize {
    client
        .list_runs()
        .await
        .unwrap()
        .runs
        .iter()
        .filter(|r| r.labels.contains_key("runbox.build"))
        .count()
}

const APP: &str = "\
FROM base
ARG GREETING=hello
ENV APP=/app
WORKDIR /app
COPY app/ ./
COPY --chmod=700 run.sh /usr/local/bin/run
RUN echo \"$GREETING from $APP in $(pwd)\" > greeting && ls /app
USER 1000
CMD [\"cat\", \"/app/greeting\"]
";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dockerfile_builds_an_image_step_by_step_and_caches_its_steps() {
    let daemon = TestDaemon::start(None).await;
    let client = &daemon.client;
    let ctx = upload(
        client,
        &[
            (".dockerignore", 0o644, b"secret.txt\n"),
            ("app/", 0o755, b""),
            ("app/a.txt", 0o640, b"alpha\n"),
            ("app/lib/", 0o755, b""),
            ("app/lib/b.txt", 0o644, b"beta\n"),
            ("secret.txt", 0o600, b"do not ship\n"),
            (
                "app/secret.txt",
                0o600,
                b"kept: only the root's is ignored\n",
            ),
            ("run.sh", 0o644, b"#!/bin/sh\necho ran\n"),
        ],
    )
    .await;
    let (done, lines) = build(&daemon, &dockerfile("app", APP, Some(&ctx))).await;
    assert_eq!(
        done.status,
        BuildStatus::Ready,
        "{done:?}\n{lines:#?}\n{}",
        daemon.log()
    );
    assert_eq!(done.steps.len(), 7, "ARG is no step: {:?}", done.steps);
    assert!(done.steps.iter().all(|s| s.status == BuildStepStatus::Done));
    assert!(
        lines.iter().any(|l| l == "a.txt"),
        "the RUN's output is logged: {lines:#?}"
    );
    assert_eq!(build_runs(client).await, 0, "the build run is gone");

    let image = client.get_image("app").await.unwrap();
    assert!(image.source.starts_with("build:"), "{}", image.source);
    let config = &image.config.as_ref().unwrap()["config"];
    assert_eq!(config["User"], "1000");
    assert_eq!(config["WorkingDir"], "/app");
    assert_eq!(config["Cmd"], serde_json::json!(["cat", "/app/greeting"]));
    assert!(config["Env"]
        .as_array()
        .unwrap()
        .iter()
        .any(|e| e == "APP=/app"));
    let listed = client.list_images().await.unwrap().images;
    assert!(
        listed.iter().all(|i| !i.name.starts_with("build-cache-")),
        "the step cache is not listed: {listed:?}"
    );
    let out = run_of(
        &daemon,
        "app",
        "cat /app/greeting /app/a.txt /app/lib/b.txt /app/secret.txt; \
         stat -c '%a %u' /usr/local/bin/run /app/a.txt; /usr/local/bin/run; \
         test -e /secret.txt || echo no-secret",
    )
    .await;
    assert_eq!(
        out,
        "hello from /app in /app\nalpha\nbeta\nkept: only the root's is ignored\n\
         700 0\n640 0\nran\nno-secret\n"
    );

    // The same build again: every file step is a cached layer.
    let (again, _) = build(&daemon, &dockerfile("app", APP, Some(&ctx))).await;
    assert_eq!(again.status, BuildStatus::Ready, "{again:?}");
    assert!(
        again
            .steps
            .iter()
            .all(|s| s.status == BuildStepStatus::Cached),
        "{:?}",
        again.steps
    );
    // A changed last file step: the steps before it are cached.
    let changed = APP.replace("&& ls /app", "&& echo changed > /app/mark");
    let (third, _) = build(&daemon, &dockerfile("app", &changed, Some(&ctx))).await;
    assert_eq!(third.status, BuildStatus::Ready, "{third:?}");
    let statuses: Vec<BuildStepStatus> = third.steps.iter().map(|s| s.status).collect();
    assert_eq!(&statuses[..4], &[BuildStepStatus::Cached; 4]);
    assert_eq!(&statuses[4..], &[BuildStepStatus::Done; 3]);
    assert_eq!(run_of(&daemon, "app", "cat /app/mark").await, "changed\n");
    // --no-cache runs everything again.
    let mut fresh = dockerfile("app", &changed, Some(&ctx));
    fresh.no_cache = true;
    let (fourth, _) = build(&daemon, &fresh).await;
    assert!(fourth
        .steps
        .iter()
        .all(|s| s.status == BuildStepStatus::Done));
    // A build argument changes the RUN that reads it.
    let mut arg = dockerfile("app-hi", &changed, Some(&ctx));
    arg.build_args = Some([("GREETING".to_owned(), "hi".to_owned())].into());
    let (fifth, _) = build(&daemon, &arg).await;
    assert_eq!(fifth.status, BuildStatus::Ready, "{fifth:?}");
    assert_eq!(
        run_of(&daemon, "app-hi", "cat /app/greeting").await,
        "hi from /app in /app\n"
    );
    // Listed, newest first.
    let builds = client.list_builds().await.unwrap().builds;
    assert_eq!(builds.len(), 5);
    assert_eq!(builds[0].id, fifth.id);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_step_fails_the_build_with_its_output_and_records_nothing() {
    let daemon = TestDaemon::start(None).await;
    let client = &daemon.client;
    let text = "FROM base\nRUN echo one > /one\nRUN echo oops >&2; exit 3\nRUN echo never\n";
    let (done, _) = build(&daemon, &dockerfile("broken", text, None)).await;
    assert_eq!(done.status, BuildStatus::Failed);
    let error = done.error.expect("a failure");
    assert_eq!(error.code, "step_failed");
    assert_eq!(error.step, Some(2));
    assert_eq!(error.exit_code, Some(3));
    assert_eq!(error.output, ["oops"]);
    assert!(
        error.message.contains("exited with code 3"),
        "{}",
        error.message
    );
    assert_eq!(done.steps[1].status, BuildStepStatus::Failed);
    assert_eq!(done.steps[2].status, BuildStepStatus::Pending);
    let missing = client.get_image("broken").await.unwrap_err();
    assert_eq!(missing.code(), Some(ErrorCode::ImageNotFound));
    assert_eq!(build_runs(client).await, 0);
    // Its record stays: GET and the events of an ended build.
    let id = done.id.to_string();
    assert_eq!(
        client.get_build(&id).await.unwrap().status,
        BuildStatus::Failed
    );
    let (replayed, lines) = follow(client, &id).await;
    assert_eq!(replayed.status, BuildStatus::Failed);
    assert!(lines.iter().any(|l| l == "oops"), "{lines:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_builds_are_refused_with_what_to_fix() {
    let daemon = TestDaemon::start(None).await;
    let client = &daemon.client;
    let refused = |e: runbox_client::ClientError| (e.code(), e.to_string());

    let (code, message) = refused(
        client
            .start_build(&dockerfile("x", "FROM base\nFROBNICATE now\n", None))
            .await
            .unwrap_err(),
    );
    assert_eq!(code, Some(ErrorCode::BadDockerfile));
    assert!(message.contains("line 2"), "{message}");
    let (code, _) = refused(
        client
            .start_build(&dockerfile("x", "RUN true\n", None))
            .await
            .unwrap_err(),
    );
    assert_eq!(code, Some(ErrorCode::BadDockerfile));
    // COPY with no context; a context never uploaded.
    let (code, message) = refused(
        client
            .start_build(&dockerfile("x", "FROM base\nCOPY a /a\n", None))
            .await
            .unwrap_err(),
    );
    assert_eq!(code, Some(ErrorCode::BadBuildContext), "{message}");
    let never = format!("sha256:{}", "0".repeat(64));
    let (code, _) = refused(
        client
            .start_build(&dockerfile("x", "FROM base\nCOPY a /a\n", Some(&never)))
            .await
            .unwrap_err(),
    );
    assert_eq!(code, Some(ErrorCode::BadBuildContext));
    // Bad image names, both or neither of dockerfile and steps.
    let (code, _) = refused(
        client
            .start_build(&dockerfile("Bad:Name", "FROM base\n", None))
            .await
            .unwrap_err(),
    );
    assert_eq!(code, Some(ErrorCode::BadImageName));
    let (code, _) = refused(
        client
            .start_build(&BuildRequest {
                name: "x".into(),
                ..Default::default()
            })
            .await
            .unwrap_err(),
    );
    assert_eq!(code, Some(ErrorCode::BadRequest));

    // Contexts: bytes that do not match the digest; entries out of the
    // context; a device node; not a tar.
    let (bytes, _) = context(&[("a", 0o644, b"a")]);
    let wrong = format!("sha256:{}", "1".repeat(64));
    let (code, message) = refused(
        client
            .put_build_context(&wrong, runbox_e2e::body(bytes))
            .await
            .unwrap_err(),
    );
    assert_eq!(code, Some(ErrorCode::BadBuildContext));
    assert!(message.contains("hash to"), "{message}");
    for (what, archive) in [
        (
            "a path up and out",
            raw_tar("../escape", tar::EntryType::Regular),
        ),
        (
            "an absolute path",
            raw_tar("/etc/passwd", tar::EntryType::Regular),
        ),
        ("a device node", raw_tar("dev", tar::EntryType::Char)),
        (
            "not a tar",
            b"hello, this is not an archive at all".repeat(20),
        ),
    ] {
        let digest = runbox_e2e::sha256(&archive);
        let (code, message) = refused(
            client
                .put_build_context(&digest, runbox_e2e::body(archive))
                .await
                .unwrap_err(),
        );
        assert_eq!(code, Some(ErrorCode::BadBuildContext), "{what}: {message}");
    }
    // A COPY source the context does not have fails the build at its step.
    let ctx = upload(client, &[("a", 0o644, b"a")]).await;
    let (done, _) = build(
        &daemon,
        &dockerfile("x", "FROM base\nCOPY missing /m\n", Some(&ctx)),
    )
    .await;
    assert_eq!(done.status, BuildStatus::Failed);
    let error = done.error.unwrap();
    assert_eq!(error.code, "bad_dockerfile", "{error:?}");
    assert!(error.message.contains("missing"), "{}", error.message);
    // A base image that does not exist.
    let (done, _) = build(
        &daemon,
        &dockerfile("x", "FROM nothing-here\nRUN true\n", None),
    )
    .await;
    assert_eq!(done.error.unwrap().code, "image_not_found");
    // Ids: malformed and unknown builds are 404.
    for id in ["nope", "01HZZZZZZZZZZZZZZZZZZZZZZZ"] {
        let e = client.get_build(id).await.unwrap_err();
        assert_eq!(e.code(), Some(ErrorCode::BuildNotFound), "{id}");
    }
    assert_eq!(build_runs(client).await, 0);
}

/// A one-entry tar whose header is written by hand (the tar crate refuses
/// to write some of these names itself).
fn raw_tar(name: &str, kind: tar::EntryType) -> Vec<u8> {
    let mut header = tar::Header::new_old();
    header.as_old_mut().name[..name.len()].copy_from_slice(name.as_bytes());
    header.set_mode(0o644);
    header.set_size(if kind == tar::EntryType::Regular {
        1
    } else {
        0
    });
    header.set_entry_type(kind);
    header.set_cksum();
    let mut out = header.as_bytes().to_vec();
    if kind == tar::EntryType::Regular {
        let mut block = [0u8; 512];
        block[0] = b'x';
        out.extend_from_slice(&block);
    }
    out.extend_from_slice(&[0u8; 1024]);
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn builds_are_cancelled_timed_out_and_one_per_name() {
    let daemon = TestDaemon::start(None).await;
    let client = &daemon.client;
    let slow = "FROM base\nRUN echo started; sleep 300\n";
    let first = client
        .start_build(&dockerfile("slow", slow, None))
        .await
        .unwrap();
    // A second build of the same name waits its turn.
    let second = client
        .start_build(&dockerfile("slow", slow, None))
        .await
        .unwrap_err();
    assert_eq!(second.code(), Some(ErrorCode::BuildInProgress), "{second}");
    let id = first.id.to_string();
    let running = eventually_async(Duration::from_secs(60), || async {
        client
            .get_build(&id)
            .await
            .unwrap()
            .steps
            .first()
            .map(|s| s.status)
            == Some(BuildStepStatus::Running)
    })
    .await;
    assert!(running, "{}", daemon.log());
    let cancelled = client.cancel_build(&id).await.unwrap();
    assert_eq!(cancelled.status, BuildStatus::Cancelled);
    assert_eq!(cancelled.error.unwrap().code, "cancelled");
    assert!(client.get_image("slow").await.is_err());
    assert!(
        eventually_async(Duration::from_secs(30), || async {
            build_runs(client).await == 0
        })
        .await,
        "the build run is deleted"
    );
    // Cancelling an ended build answers with it.
    assert_eq!(
        client.cancel_build(&id).await.unwrap().status,
        BuildStatus::Cancelled
    );

    let mut timed = dockerfile("slow", slow, None);
    timed.timeout_sec = Some(3);
    let (done, _) = build(&daemon, &timed).await;
    assert_eq!(done.status, BuildStatus::Failed);
    assert_eq!(done.error.unwrap().code, "build_timeout");
    assert_eq!(build_runs(client).await, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_daemon_killed_mid_build_leaves_no_image_and_no_run() {
    let mut daemon = TestDaemon::start(None).await;
    let client = daemon.client.clone();
    let text = "FROM base\nRUN echo one > /one\nRUN sleep 300\n";
    let started = client
        .start_build(&dockerfile("cut", text, None))
        .await
        .unwrap();
    let id = started.id.to_string();
    let second_running = eventually_async(Duration::from_secs(60), || async {
        client
            .get_build(&id)
            .await
            .unwrap()
            .steps
            .get(1)
            .map(|s| s.status)
            == Some(BuildStepStatus::Running)
    })
    .await;
    assert!(second_running, "{}", daemon.log());
    daemon.kill9();
    daemon.spawn().await;
    let client = daemon.client.clone();
    let after = client.get_build(&id).await.unwrap();
    assert_eq!(after.status, BuildStatus::Failed);
    assert_eq!(after.error.unwrap().code, "daemon_restarted");
    assert!(client.get_image("cut").await.is_err());
    assert!(
        eventually_async(Duration::from_secs(30), || async {
            build_runs(&client).await == 0
        })
        .await,
        "the build run is deleted at start: {}",
        daemon.log()
    );
    // The first step's cache entry is whole: the build again starts there.
    let (again, _) = build(
        &daemon,
        &dockerfile("cut", "FROM base\nRUN echo one > /one\nRUN true\n", None),
    )
    .await;
    assert_eq!(again.status, BuildStatus::Ready, "{again:?}");
    assert_eq!(again.steps[0].status, BuildStepStatus::Cached);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tenants_build_only_from_their_images_and_see_only_their_builds() {
    let daemon = TestDaemon::start(None).await;
    let root = &daemon.client;
    let token = root
        .create_tenant(&runbox_types::CreateTenantRequest {
            name: "acme".into(),
            images: vec!["base".into()],
            ..Default::default()
        })
        .await
        .unwrap()
        .token;
    let acme = Client::new(&daemon.url, token).unwrap();
    daemon.import("other", runbox_e2e::busybox_tar()).await;
    let (done, _) = build_as(&acme, &dockerfile("mine", "FROM other\nRUN true\n", None)).await;
    assert_eq!(done.error.unwrap().code, "tenant_policy");
    let (done, _) = build_as(
        &acme,
        &dockerfile("mine", "FROM base\nRUN echo acme > /who\n", None),
    )
    .await;
    assert_eq!(done.status, BuildStatus::Ready, "{done:?}");
    let image = acme.get_image("mine").await.unwrap();
    assert_eq!(image.tenant.as_deref(), Some("acme"));
    // The root sees it; a build of the root's is not the tenant's to see.
    root.get_build(&done.id.to_string()).await.unwrap();
    let (theirs, _) = build(&daemon, &dockerfile("roots", "FROM base\n", None)).await;
    let hidden = acme.get_build(&theirs.id.to_string()).await.unwrap_err();
    assert_eq!(hidden.code(), Some(ErrorCode::BuildNotFound));
    assert_eq!(acme.list_builds().await.unwrap().builds.len(), 2);
    // A tenant cannot replace the operator's image by building its name.
    let e = acme
        .start_build(&dockerfile("base", "FROM base\n", None))
        .await
        .unwrap_err();
    assert_eq!(e.code(), Some(ErrorCode::ImageExists));
}

async fn build_as(client: &Client, req: &BuildRequest) -> (Build, Vec<String>) {
    let started = client.start_build(req).await.expect("start");
    follow(client, &started.id.to_string()).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_cli_builds_a_directory_with_its_dockerignore() {
    let daemon = TestDaemon::start(None).await;
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(
        dir.path().join("Dockerfile"),
        "FROM base\nCOPY . /src/\nRUN ls /src > /listing\n",
    )
    .unwrap();
    std::fs::write(dir.path().join(".dockerignore"), "*.log\n").unwrap();
    std::fs::write(dir.path().join("keep.txt"), "k").unwrap();
    std::fs::write(dir.path().join("drop.log"), "d").unwrap();
    let out = tokio::process::Command::new(runbox_e2e::runbox_bin())
        .args([
            "image",
            "build",
            "-t",
            "from-cli",
            "--url",
            &daemon.url,
            "--token",
            &daemon.token,
        ])
        .arg(dir.path())
        .output()
        .await
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}\n{}", daemon.log());
    assert_eq!(String::from_utf8_lossy(&out.stdout), "from-cli\n");
    assert!(stderr.contains("RUN ls /src"), "{stderr}");
    assert_eq!(
        run_of(&daemon, "from-cli", "cat /listing").await,
        "Dockerfile\nkeep.txt\n"
    );
    // A failing build exits non-zero with the step and its exit code.
    std::fs::write(dir.path().join("Dockerfile"), "FROM base\nRUN exit 7\n").unwrap();
    let out = tokio::process::Command::new(runbox_e2e::runbox_bin())
        .args([
            "image",
            "build",
            "-q",
            "-t",
            "bad",
            "--url",
            &daemon.url,
            "--token",
            &daemon.token,
        ])
        .arg(dir.path())
        .output()
        .await
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(stderr.contains("exited with code 7"), "{stderr}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn what_a_later_step_removes_stays_removed_and_no_cache_makes_fresh_layers() {
    let daemon = TestDaemon::start(None).await;
    let client = &daemon.client;
    let text = "FROM base\nRUN echo s3cret > /key && mkdir /d && echo old > /d/old\n\
                RUN rm /key && rm -rf /d && mkdir /d && echo new > /d/new\n\
                RUN cat /proc/sys/kernel/random/uuid > /u\n";
    let (done, _) = build(&daemon, &dockerfile("clean", text, None)).await;
    assert_eq!(done.status, BuildStatus::Ready, "{done:?}");
    let base_layers = client.get_image("base").await.unwrap().layers.len();
    let image = client.get_image("clean").await.unwrap();
    assert_eq!(
        image.layers.len(),
        base_layers + 1,
        "one build run, one layer of all it changed: {:?}",
        image.layers
    );
    let out = run_of(
        &daemon,
        "clean",
        "ls /d; test -e /key && echo key-back; cat /u",
    )
    .await;
    let mut lines = out.lines();
    assert_eq!(lines.next(), Some("new"), "{out}");
    let first_u = lines.next().unwrap().to_owned();
    assert!(!out.contains("key-back"), "{out}");

    // Cached: the same layers; --no-cache: fresh ones, which the next
    // cached build then uses.
    let (cached, _) = build(&daemon, &dockerfile("clean", text, None)).await;
    assert!(cached
        .steps
        .iter()
        .all(|s| s.status == BuildStepStatus::Cached));
    assert_eq!(run_of(&daemon, "clean", "cat /u").await.trim(), first_u);
    let mut fresh = dockerfile("clean", text, None);
    fresh.no_cache = true;
    let (rebuilt, _) = build(&daemon, &fresh).await;
    assert!(rebuilt
        .steps
        .iter()
        .all(|s| s.status == BuildStepStatus::Done));
    let second_u = run_of(&daemon, "clean", "cat /u").await.trim().to_owned();
    assert_ne!(second_u, first_u, "--no-cache ran the step again");
    let (after, _) = build(&daemon, &dockerfile("clean", text, None)).await;
    assert!(after
        .steps
        .iter()
        .all(|s| s.status == BuildStepStatus::Cached));
    assert_eq!(run_of(&daemon, "clean", "cat /u").await.trim(), second_u);

    // The cache's names are the builder's alone.
    let e = client
        .start_build(&dockerfile("build-cache-mine", "FROM base\n", None))
        .await
        .unwrap_err();
    assert_eq!(e.code(), Some(ErrorCode::BadImageName), "{e}");
    let run = daemon.create().await.id.to_string();
    let e = client
        .snapshot_run(&run, Some("build-cache-0123"))
        .await
        .unwrap_err();
    assert_eq!(e.code(), Some(ErrorCode::BadImageName), "{e}");
    client.delete_run(&run).await.unwrap();
}
