//! Checkpoints: a run's disk and settings in the checkpoint store (a
//! directory, or a real S3 server on loopback), and runs started from them,
//! on the real runtime and run store.

use std::time::Duration;

use runbox_client::ClientError;
use runbox_e2e::{S3Server, TestDaemon};
use runbox_types::{CheckpointRequest, CreateRunRequest, ErrorCode};

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

/// What a run's files look like: owners, modes, link targets, contents,
/// an xattr and what the image had that the run deleted.
const LISTING: &str = "cd /work && for f in a.txt bin.dat dir/deep link hard fifo; do \
     stat -c '%n %u:%g %a %F %h %s' $f; done; stat -c '%n %u:%g %a %F' dir; readlink link; cat a.txt dir/deep; \
     md5sum bin.dat; ls /etc/group 2>&1; cat /etc/motd-run; echo env=$CK_VAR";

/// Writes the files [`LISTING`] shows into run `id`, and an xattr from the
/// host into its writable layer (busybox has no setfattr).
async fn write_files(daemon: &TestDaemon, id: &str) {
    let out = daemon
        .sh(
            id,
            "set -e; cd /work; echo one > a.txt; chmod 751 a.txt; chown 1234:5678 a.txt; \
             head -c 3000000 /dev/urandom > bin.dat; mkdir -p dir; echo deep > dir/deep; \
             chmod 1777 dir; ln -s a.txt link; ln a.txt hard; mkfifo fifo; rm /etc/group; \
             echo motd > /etc/motd-run",
        )
        .await;
    assert_eq!(out.exit.exit_code, 0, "{}", text(&out.stderr));
    let path = daemon
        .state
        .path()
        .join("runs")
        .join(id)
        .join("disk/upper/work/a.txt");
    runbox_e2e::set_xattr(&path, "user.runbox", b"kept");
}

/// The xattr [`write_files`] set, read from run `id`'s image layers or
/// writable layer, whichever holds `work/a.txt`.
fn xattr_of(daemon: &TestDaemon, id: &str) -> Option<Vec<u8>> {
    let mut candidates = vec![daemon
        .state
        .path()
        .join("runs")
        .join(id)
        .join("disk/upper/work/a.txt")];
    for entry in std::fs::read_dir(daemon.state.path().join("images/layers"))
        .unwrap()
        .flatten()
    {
        candidates.push(entry.path().join("work/a.txt"));
    }
    candidates
        .iter()
        .filter(|path| path.exists())
        .find_map(|path| runbox_e2e::xattr(path, "user.runbox"))
}

async fn listing(daemon: &TestDaemon, id: &str) -> String {
    let out = daemon.sh(id, LISTING).await;
    text(&out.stdout)
}

fn code_of(e: &ClientError) -> Option<ErrorCode> {
    e.code()
}

async fn from_checkpoint(
    daemon: &TestDaemon,
    checkpoint: ulid::Ulid,
) -> Result<runbox_types::Run, ClientError> {
    daemon
        .client
        .create_run(&CreateRunRequest {
            checkpoint: Some(checkpoint),
            ..Default::default()
        })
        .await
}

/// A checkpoint brings a run back in any number of new runs: every file,
/// owner, mode, link, xattr and deletion, and the run's settings; the
/// checkpointed run goes on meanwhile, and deleting the checkpoint leaves
/// the runs started from it alone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_checkpoint_brings_a_run_back_any_number_of_times() {
    let daemon = TestDaemon::start(None).await;
    let parent = daemon
        .create_with(CreateRunRequest {
            image: "base".into(),
            env: Some(runbox_types::Env(
                [("CK_VAR".to_owned(), "carried".to_owned())].into(),
            )),
            labels: Some([("team".to_owned(), "a".to_owned())].into()),
            ttl_sec: Some(900),
            ..Default::default()
        })
        .await
        .id
        .to_string();
    write_files(&daemon, &parent).await;
    let before = listing(&daemon, &parent).await;
    assert!(before.contains("1234:5678 751"), "{before}");
    assert!(before.contains("No such file"), "{before}");

    let checkpoint = daemon
        .client
        .checkpoint_run(
            &parent,
            &CheckpointRequest {
                labels: Some([("why".to_owned(), "test".to_owned())].into()),
            },
        )
        .await
        .unwrap();
    assert_eq!(checkpoint.run.to_string(), parent);
    assert_eq!(checkpoint.image, "base");
    assert!(checkpoint.disk_bytes > 3_000_000, "{checkpoint:?}");
    assert!(checkpoint.stored_bytes > 3_000_000, "{checkpoint:?}");
    assert_eq!(
        checkpoint.labels.get("why").map(String::as_str),
        Some("test")
    );
    // The run went on, and writes after the checkpoint are its own.
    let out = daemon.sh(&parent, "echo later > /work/later").await;
    assert_eq!(out.exit.exit_code, 0);
    let listed = daemon.client.list_checkpoints().await.unwrap();
    assert_eq!(listed.checkpoints, vec![checkpoint.clone()]);
    assert_eq!(
        daemon
            .client
            .get_checkpoint(&checkpoint.id.to_string())
            .await
            .unwrap(),
        checkpoint
    );

    let mut children = Vec::new();
    for _ in 0..2 {
        let run = from_checkpoint(&daemon, checkpoint.id).await.unwrap();
        assert_eq!(run.labels.get("team").map(String::as_str), Some("a"));
        let ttl = (run.expires_at - run.created_at).whole_seconds();
        assert!((899..=901).contains(&ttl), "{ttl}");
        children.push(run.id.to_string());
    }
    for child in &children {
        assert_eq!(listing(&daemon, child).await, before, "run {child}");
        let out = daemon.sh(child, "test -e /work/later").await;
        assert_ne!(
            out.exit.exit_code, 0,
            "a write after the checkpoint came along"
        );
        assert_eq!(xattr_of(&daemon, child).as_deref(), Some(&b"kept"[..]));
    }
    // Branches are independent.
    daemon.sh(&children[0], "echo mine > /work/a.txt").await;
    let out = daemon.sh(&children[1], "cat /work/a.txt").await;
    assert_eq!(text(&out.stdout), "one\n");
    // A create may override what the checkpoint carried.
    let run = daemon
        .client
        .create_run(&CreateRunRequest {
            checkpoint: Some(checkpoint.id),
            env: Some(runbox_types::Env(
                [("CK_VAR".to_owned(), "mine".to_owned())].into(),
            )),
            ..Default::default()
        })
        .await
        .unwrap();
    let out = daemon.sh(&run.id.to_string(), "echo $CK_VAR").await;
    assert_eq!(text(&out.stdout), "mine\n");
    // Image and checkpoint together are refused.
    let e = daemon
        .client
        .create_run(&CreateRunRequest {
            image: "base".into(),
            checkpoint: Some(checkpoint.id),
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(code_of(&e), Some(ErrorCode::BadRequest), "{e}");

    daemon
        .client
        .delete_checkpoint(&checkpoint.id.to_string())
        .await
        .unwrap();
    assert!(daemon
        .client
        .list_checkpoints()
        .await
        .unwrap()
        .checkpoints
        .is_empty());
    let e = from_checkpoint(&daemon, checkpoint.id).await.unwrap_err();
    assert_eq!(code_of(&e), Some(ErrorCode::CheckpointNotFound), "{e}");
    let e = daemon
        .client
        .delete_checkpoint(&checkpoint.id.to_string())
        .await
        .unwrap_err();
    assert_eq!(code_of(&e), Some(ErrorCode::CheckpointNotFound), "{e}");
    // Runs started from it go on.
    let out = daemon.sh(&children[1], "cat /work/dir/deep").await;
    assert_eq!(text(&out.stdout), "deep\n");
    assert!(!daemon
        .state
        .path()
        .join("checkpoints/data")
        .join(checkpoint.id.to_string())
        .exists());
}

/// The checkpoint's generation directory in a directory store.
fn generation_dir(daemon: &TestDaemon, id: ulid::Ulid) -> std::path::PathBuf {
    let dir = daemon
        .state
        .path()
        .join("checkpoints/data")
        .join(id.to_string());
    std::fs::read_dir(&dir)
        .unwrap()
        .flatten()
        .next()
        .expect("a generation")
        .path()
}

/// A changed byte, a truncation, or a changed record: refused with
/// `checkpoint_corrupt`, no run made, no image left.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_damaged_checkpoint_is_refused_and_never_booted() {
    let daemon = TestDaemon::start(None).await;
    let parent = daemon.create().await.id.to_string();
    let out = daemon
        .sh(&parent, "head -c 200000 /dev/urandom > /work/data")
        .await;
    assert_eq!(out.exit.exit_code, 0);
    let checkpoint = daemon
        .client
        .checkpoint_run(&parent, &CheckpointRequest::default())
        .await
        .unwrap();
    let generation = generation_dir(&daemon, checkpoint.id);
    // The base image was imported, so it travels too, as a layer the
    // store's checkpoints share: the generation holds the run's disk.
    let tars = |dir: &std::path::Path| -> Vec<std::path::PathBuf> {
        std::fs::read_dir(dir)
            .unwrap()
            .flatten()
            .map(|e| e.path())
            .filter(|p| p.to_string_lossy().ends_with(".tar.zst"))
            .collect()
    };
    let layers = tars(&generation);
    assert_eq!(layers.len(), 1, "{layers:?}");
    let shared = tars(&daemon.state.path().join("checkpoints/layers"));
    assert_eq!(shared.len(), 1, "{shared:?}");
    let disk = layers[0].clone();
    let original = std::fs::read(&disk).unwrap();
    let runs_before = daemon.client.list_runs().await.unwrap().runs.len();

    let mut flipped = original.clone();
    let at = flipped.len() / 2;
    flipped[at] ^= 0x40;
    let record = generation.join("record.json");
    let record_bytes = std::fs::read(&record).unwrap();
    let mut changed_record = String::from_utf8(record_bytes.clone()).unwrap();
    changed_record = changed_record.replace("\"base\"", "\"bass\"");
    for (file, bytes) in [
        (&disk, flipped),
        (&disk, original[..original.len() - 100].to_vec()),
        (&record, changed_record.into_bytes()),
    ] {
        let keep = std::fs::read(file).unwrap();
        std::fs::write(file, &bytes).unwrap();
        let e = from_checkpoint(&daemon, checkpoint.id).await.unwrap_err();
        assert_eq!(code_of(&e), Some(ErrorCode::CheckpointCorrupt), "{e}");
        assert!(e.to_string().contains("damaged"), "{e}");
        std::fs::write(file, keep).unwrap();
    }
    assert_eq!(
        daemon.client.list_runs().await.unwrap().runs.len(),
        runs_before
    );
    let images = daemon.client.list_images().await.unwrap();
    assert!(
        images.images.iter().all(|i| !i.name.starts_with("ckpt-")),
        "{images:?}"
    );
    // Put back, it is whole again.
    let run = from_checkpoint(&daemon, checkpoint.id).await.unwrap();
    let out = daemon
        .sh(&run.id.to_string(), "stat -c %s /work/data")
        .await;
    assert_eq!(text(&out.stdout), "200000\n");
}

/// Sets every file's times under `dir` two hours back.
fn age(dir: &std::path::Path) {
    let status = std::process::Command::new("find")
        .arg(dir)
        .args(["-exec", "touch", "-h", "-d", "2 hours ago", "{}", "+"])
        .status()
        .unwrap();
    assert!(status.success());
}

/// A daemon killed mid-upload leaves nothing a listing shows; the sweep at
/// the next start removes the leftovers once they are an hour old, and
/// checkpoints past `--checkpoint-ttl-hours`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill_9_mid_upload_leaves_no_checkpoint_and_the_sweep_cleans_up() {
    let mut daemon = TestDaemon::start_with(None, &["--checkpoint-ttl-hours", "1"], &[]).await;
    let parent = daemon.create().await.id.to_string();
    let out = daemon
        .sh(&parent, "head -c 300000000 /dev/urandom > /work/big")
        .await;
    assert_eq!(out.exit.exit_code, 0, "{}", text(&out.stderr));
    let kept = daemon
        .client
        .checkpoint_run(&parent, &CheckpointRequest::default())
        .await
        .unwrap();
    assert!(kept.expires_at.is_some());

    let client = daemon.client.clone();
    let id = parent.clone();
    let upload = tokio::spawn(async move {
        client
            .checkpoint_run(&id, &CheckpointRequest::default())
            .await
    });
    let data = daemon.state.path().join("checkpoints/data");
    let started = runbox_e2e::eventually(Duration::from_secs(60), || {
        std::fs::read_dir(&data).map(|d| d.count()).unwrap_or(0) >= 2
    })
    .await;
    assert!(started, "the second upload never started");
    daemon.kill9();
    let _ = upload.await;
    daemon.spawn().await;
    let listed = daemon.client.list_checkpoints().await.unwrap().checkpoints;
    assert_eq!(listed.len(), 1, "{listed:?}");
    assert_eq!(listed[0].id, kept.id);
    // The leftover is young: kept. Aged, the next start sweeps it, and the
    // committed one too once its TTL is past.
    assert_eq!(std::fs::read_dir(&data).unwrap().count(), 2);
    age(&data);
    let commit = std::fs::read_dir(
        daemon
            .state
            .path()
            .join("checkpoints/commits")
            .join(kept.id.to_string()),
    )
    .unwrap()
    .flatten()
    .next()
    .unwrap()
    .path();
    let mut doc: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&commit).unwrap()).unwrap();
    let old = (time::OffsetDateTime::now_utc() - time::Duration::hours(2))
        .format(&time::format_description::well_known::Rfc3339)
        .unwrap();
    doc["checkpoint"]["createdAt"] = old.into();
    std::fs::write(&commit, serde_json::to_vec(&doc).unwrap()).unwrap();
    daemon.kill9();
    daemon.spawn().await;
    let swept = runbox_e2e::eventually(Duration::from_secs(30), || {
        std::fs::read_dir(&data).map(|d| d.count()).unwrap_or(0) == 0
    })
    .await;
    assert!(
        swept,
        "left: {:?}; log:\n{}",
        std::fs::read_dir(&data)
            .unwrap()
            .flatten()
            .map(|e| e.path())
            .collect::<Vec<_>>(),
        daemon.log()
    );
    assert!(daemon
        .client
        .list_checkpoints()
        .await
        .unwrap()
        .checkpoints
        .is_empty());
    // The run itself was never touched.
    let out = daemon.sh(&parent, "stat -c %s /work/big").await;
    assert_eq!(text(&out.stdout), "300000000\n");
}

/// The same round trip through a real S3 server that checks signatures; a
/// server that is down, or credentials it refuses, are a 503 with
/// Retry-After that changes nothing, and work resumes once it is back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn checkpoints_in_an_s3_bucket() {
    let mut s3 = S3Server::start().await;
    let location = format!("s3://{}/node-a/checkpoints", s3.bucket);
    let env = s3.env();
    let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (*k, v.as_str())).collect();
    let daemon = TestDaemon::start_with(None, &["--checkpoint-store", &location], &env).await;
    let parent = daemon.create().await.id.to_string();
    write_files(&daemon, &parent).await;
    let before = listing(&daemon, &parent).await;
    let checkpoint = daemon
        .client
        .checkpoint_run(&parent, &CheckpointRequest::default())
        .await
        .unwrap();
    let run = from_checkpoint(&daemon, checkpoint.id).await.unwrap();
    assert_eq!(listing(&daemon, &run.id.to_string()).await, before);
    assert_eq!(
        xattr_of(&daemon, &run.id.to_string()).as_deref(),
        Some(&b"kept"[..])
    );

    // Down: refused with a retry hint; the run is untouched.
    s3.stop();
    let resp = reqwest::Client::new()
        .post(format!("{}/v1/runs/{parent}/checkpoint", daemon.url))
        .bearer_auth(&daemon.token)
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status().as_u16(), 503);
    assert_eq!(resp.headers()["retry-after"], "10");
    let body: serde_json::Value = resp.json().await.unwrap();
    assert_eq!(body["error"]["code"], "checkpoint_store_unavailable");
    assert!(
        body["error"]["message"]
            .as_str()
            .unwrap()
            .contains(&location),
        "{body}"
    );
    let e = daemon.client.list_checkpoints().await.unwrap_err();
    assert_eq!(
        code_of(&e),
        Some(ErrorCode::CheckpointStoreUnavailable),
        "{e}"
    );
    let out = daemon.sh(&parent, "cat /work/a.txt").await;
    assert_eq!(text(&out.stdout), "one\n");
    s3.spawn().await;
    let again = daemon
        .client
        .checkpoint_run(&parent, &CheckpointRequest::default())
        .await
        .unwrap();
    let ids: Vec<_> = daemon
        .client
        .list_checkpoints()
        .await
        .unwrap()
        .checkpoints
        .into_iter()
        .map(|c| c.id)
        .collect();
    assert_eq!(ids, vec![checkpoint.id, again.id]);

    // Credentials the server refuses: signatures are checked.
    let mut wrong = s3.env();
    for (k, v) in wrong.iter_mut() {
        if *k == "AWS_SECRET_ACCESS_KEY" {
            *v = "not-the-secret".into();
        }
    }
    let wrong: Vec<(&str, &str)> = wrong.iter().map(|(k, v)| (*k, v.as_str())).collect();
    let other = TestDaemon::start_with(None, &["--checkpoint-store", &location], &wrong).await;
    let e = other.client.list_checkpoints().await.unwrap_err();
    assert_eq!(
        code_of(&e),
        Some(ErrorCode::CheckpointStoreUnavailable),
        "{e}"
    );
}

async fn status_of(daemon: &TestDaemon, id: &str) -> runbox_types::RunStatus {
    daemon.client.get_run(id).await.unwrap().status
}

/// Archive: the run's disk goes to the store and nothing stays on the node
/// but its record; the next call restores it with every file, under the
/// same id, with a fresh TTL; a daemon restart keeps it archived; a delete
/// takes its archive with it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_archived_run_holds_nothing_here_and_comes_back_on_the_next_call() {
    use runbox_types::RunStatus;
    let mut daemon = TestDaemon::start(None).await;
    let id = daemon
        .create_with(CreateRunRequest {
            image: "base".into(),
            ttl_sec: Some(900),
            ..Default::default()
        })
        .await
        .id
        .to_string();
    write_files(&daemon, &id).await;
    let before = listing(&daemon, &id).await;
    let run = daemon.client.archive_run(&id).await.unwrap();
    assert_eq!(run.status, RunStatus::Archived);
    assert!(run.archived_at.is_some());
    assert!(!daemon.state.path().join("runs").join(&id).exists());
    let listed = daemon.client.list_checkpoints().await.unwrap().checkpoints;
    assert_eq!(listed.len(), 1);
    assert_eq!(listed[0].id.to_string(), id);
    assert_eq!(
        listed[0].labels.get("runbox.archive").map(String::as_str),
        Some("true")
    );
    // Its archive is not deleted from under it.
    let e = daemon.client.delete_checkpoint(&id).await.unwrap_err();
    assert_eq!(code_of(&e), Some(ErrorCode::CheckpointInUse), "{e}");
    // A user's label may not claim to be an archive.
    let other = daemon.create().await.id.to_string();
    let e = daemon
        .client
        .checkpoint_run(
            &other,
            &CheckpointRequest {
                labels: Some([("runbox.archive".to_owned(), "true".to_owned())].into()),
            },
        )
        .await
        .unwrap_err();
    assert_eq!(code_of(&e), Some(ErrorCode::BadLabels), "{e}");

    // Still archived after a daemon restart.
    daemon.kill9();
    daemon.spawn().await;
    assert_eq!(status_of(&daemon, &id).await, RunStatus::Archived);
    // The next call restores it.
    assert_eq!(listing(&daemon, &id).await, before);
    let run = daemon.client.get_run(&id).await.unwrap();
    assert_eq!(run.status, RunStatus::Running);
    assert!(run.archived_at.is_none());
    let ttl = (run.expires_at - time::OffsetDateTime::now_utc()).whole_seconds();
    assert!((880..=900).contains(&ttl), "{ttl}");
    assert_eq!(xattr_of(&daemon, &id).as_deref(), Some(&b"kept"[..]));
    // The restored run's archive is gone; it writes as before.
    assert!(daemon
        .client
        .list_checkpoints()
        .await
        .unwrap()
        .checkpoints
        .is_empty());
    let out = daemon.sh(&id, "echo after > /work/after").await;
    assert_eq!(out.exit.exit_code, 0);
    // Archived again and woken explicitly; then deleted while archived.
    daemon.client.archive_run(&id).await.unwrap();
    let run = daemon.client.wake_run(&id).await.unwrap();
    assert_eq!(run.status, RunStatus::Running);
    let out = daemon.sh(&id, "cat /work/after /work/a.txt").await;
    assert_eq!(text(&out.stdout), "after\none\n");
    // Archived again and again without a change in between: no empty
    // layer piles up (the same layer twice would not mount).
    for _ in 0..3 {
        daemon.client.archive_run(&id).await.unwrap();
        daemon.client.wake_run(&id).await.unwrap();
    }
    let out = daemon.sh(&id, "cat /work/after").await;
    assert_eq!(text(&out.stdout), "after\n");
    daemon.client.archive_run(&id).await.unwrap();
    daemon.client.delete_run(&id).await.unwrap();
    assert!(daemon
        .client
        .list_checkpoints()
        .await
        .unwrap()
        .checkpoints
        .is_empty());
}

/// The store down during an archive: the run stays hibernated with the
/// error on it; during a restore: 503 with Retry-After, the run stays
/// archived. Back up, both work. A daemon killed mid-archive leaves the run
/// hibernated with its disk.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_archive_survives_the_store_going_down_and_a_kill_9() {
    use runbox_types::RunStatus;
    let mut s3 = S3Server::start().await;
    let location = format!("s3://{}/archive", s3.bucket);
    let env = s3.env();
    let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (*k, v.as_str())).collect();
    let mut daemon = TestDaemon::start_with(None, &["--checkpoint-store", &location], &env).await;
    let id = daemon.create().await.id.to_string();
    let out = daemon.sh(&id, "echo kept > /work/kept").await;
    assert_eq!(out.exit.exit_code, 0);
    write_files(&daemon, &id).await;
    let before = listing(&daemon, &id).await;

    s3.stop();
    let e = daemon.client.archive_run(&id).await.unwrap_err();
    assert_eq!(
        code_of(&e),
        Some(ErrorCode::CheckpointStoreUnavailable),
        "{e}"
    );
    let run = daemon.client.get_run(&id).await.unwrap();
    assert_eq!(run.status, RunStatus::Hibernated);
    assert!(run.archive_error.is_some(), "{run:?}");
    s3.spawn().await;
    daemon.client.archive_run(&id).await.unwrap();
    assert!(daemon
        .client
        .get_run(&id)
        .await
        .unwrap()
        .archive_error
        .is_none());

    s3.stop();
    let resp = reqwest::Client::new()
        .post(format!("{}/v1/runs/{id}/exec", daemon.url))
        .bearer_auth(&daemon.token)
        .json(&serde_json::json!({"cmd": ["cat", "/work/kept"]}))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status().as_u16(), 503);
    assert_eq!(resp.headers()["retry-after"], "10");
    assert_eq!(status_of(&daemon, &id).await, RunStatus::Archived);
    s3.spawn().await;
    let out = daemon.sh(&id, "cat /work/kept").await;
    assert_eq!(text(&out.stdout), "kept\n");
    // Every file, owner, mode, link, FIFO, deletion and xattr came back.
    assert_eq!(listing(&daemon, &id).await, before);
    assert_eq!(xattr_of(&daemon, &id).as_deref(), Some(&b"kept"[..]));

    // Killed mid-upload: hibernated with its disk, whole.
    let out = daemon
        .sh(
            &id,
            "head -c 200000000 /dev/urandom > /work/big; md5sum /work/big",
        )
        .await;
    let sum = text(&out.stdout);
    let client = daemon.client.clone();
    let run = id.clone();
    let archiving = tokio::spawn(async move { client.archive_run(&run).await });
    let hibernated = runbox_e2e::eventually(Duration::from_secs(60), || {
        std::fs::read_to_string(daemon.state.path().join("daemon.log"))
            .unwrap_or_default()
            .contains("run hibernated")
    })
    .await;
    assert!(hibernated);
    tokio::time::sleep(Duration::from_millis(500)).await;
    daemon.kill9();
    let _ = archiving.await;
    daemon.spawn().await;
    let status = status_of(&daemon, &id).await;
    assert!(
        matches!(status, RunStatus::Hibernated | RunStatus::Archived),
        "{status:?}"
    );
    let out = daemon.sh(&id, "md5sum /work/big").await;
    assert_eq!(text(&out.stdout), sum);
}

/// `--archive-after-sec` archives a run hibernated that long, and
/// `onExpire: archive` archives a run at its TTL and keeps it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn runs_are_archived_after_sleeping_and_at_their_ttl() {
    use runbox_types::RunStatus;
    let daemon = TestDaemon::start_with(None, &["--archive-after-sec", "2"], &[]).await;
    let asleep = daemon.create().await.id.to_string();
    daemon.client.hibernate_run(&asleep).await.unwrap();
    let expiring = daemon
        .create_with(CreateRunRequest {
            image: "base".into(),
            ttl_sec: Some(3),
            on_expire: Some(runbox_types::OnExpire::Archive),
            ..Default::default()
        })
        .await
        .id
        .to_string();
    for id in [&asleep, &expiring] {
        let mut archived = false;
        for _ in 0..200 {
            if status_of(&daemon, id).await == RunStatus::Archived {
                archived = true;
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        assert!(archived, "run {id}; log:\n{}", daemon.log());
    }
    // Kept for the archive retention, not deleted at its TTL.
    let run = daemon.client.get_run(&expiring).await.unwrap();
    assert!(run.expires_at - time::OffsetDateTime::now_utc() > time::Duration::days(29));
    let out = daemon.sh(&expiring, "echo back").await;
    assert_eq!(text(&out.stdout), "back\n");
}

/// A warm volume's files go into the archive; a restored run snapshots and
/// forks like any run (archive → restore → snapshot → fork); a daemon
/// killed mid-restore leaves the run archived, and the next call restores
/// it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn archives_chain_with_warm_volumes_snapshots_forks_and_a_kill_9() {
    use runbox_types::RunStatus;
    let mut daemon = TestDaemon::start(None).await;
    let id = daemon
        .create_with(CreateRunRequest {
            image: "base".into(),
            warm: Some(runbox_types::WarmRequest {
                repo: "acme/web".into(),
                path: None,
            }),
            ..Default::default()
        })
        .await
        .id
        .to_string();
    let out = daemon
        .sh(
            &id,
            "set -e; mkdir -p /work/app; echo deps > /work/app/Cargo.lock; chmod 600 /work/app/Cargo.lock; \
             ln -s Cargo.lock /work/app/lock; echo root > /etc/rootfile",
        )
        .await;
    assert_eq!(out.exit.exit_code, 0, "{}", text(&out.stderr));
    let check = "stat -c '%a %s' /work/app/Cargo.lock; readlink /work/app/lock; cat /etc/rootfile";
    let before = text(&daemon.sh(&id, check).await.stdout);
    daemon.client.archive_run(&id).await.unwrap();
    assert_eq!(text(&daemon.sh(&id, check).await.stdout), before);

    // The restored run snapshots and forks.
    let snap = daemon
        .client
        .snapshot_run(&id, Some("after-restore"))
        .await
        .unwrap();
    let child = daemon
        .create_with(CreateRunRequest {
            image: snap.image.clone(),
            ..Default::default()
        })
        .await
        .id
        .to_string();
    assert_eq!(text(&daemon.sh(&child, check).await.stdout), before);
    let forked = daemon
        .client
        .fork_run(
            &id,
            &runbox_types::ForkRequest {
                count: 2,
                ttl_sec: None,
                point: None,
            },
        )
        .await
        .unwrap();
    for run in &forked.runs {
        assert_eq!(
            text(&daemon.sh(&run.id.to_string(), check).await.stdout),
            before
        );
    }

    // Killed while a restore downloads: archived still, restored next.
    let out = daemon
        .sh(
            &id,
            "head -c 300000000 /dev/urandom > /work/big; md5sum /work/big",
        )
        .await;
    let sum = text(&out.stdout);
    daemon.client.archive_run(&id).await.unwrap();
    let client = daemon.client.clone();
    let run = id.clone();
    let restoring = tokio::spawn(async move { client.wake_run(&run).await });
    tokio::time::sleep(Duration::from_millis(300)).await;
    daemon.kill9();
    let _ = restoring.await;
    daemon.spawn().await;
    let status = status_of(&daemon, &id).await;
    assert!(
        matches!(status, RunStatus::Archived | RunStatus::Running),
        "{status:?}"
    );
    assert_eq!(text(&daemon.sh(&id, "md5sum /work/big").await.stdout), sum);
}
