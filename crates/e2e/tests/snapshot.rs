//! Snapshots: a run's filesystem recorded as an image (its image's layers
//! plus one layer of what it changed), captured while the run is frozen, on
//! the real runtime and the real btrfs run store.

use runbox_e2e::TestDaemon;
use runbox_types::{CreateRunRequest, ErrorCode};

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

async fn run_from(daemon: &TestDaemon, image: &str) -> String {
    daemon
        .create_with(CreateRunRequest {
            image: image.into(),
            ..Default::default()
        })
        .await
        .id
        .to_string()
}

/// Every capture is gone once its snapshot is recorded.
fn captures_left(daemon: &TestDaemon) -> usize {
    std::fs::read_dir(daemon.state.path().join("runs/.captures"))
        .map(|d| d.count())
        .unwrap_or(0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_snapshot_boots_with_every_change_and_nothing_injected() {
    let mut daemon = TestDaemon::start(None).await;
    let parent = daemon.create().await.id.to_string();
    // Writes, a deletion of an image file, a file replaced by a directory,
    // a directory of the image replaced wholesale (opaque), a hard link.
    let out = daemon
        .sh(
            &parent,
            "set -e; echo one > /work/a.txt; mkdir -p /work/src; echo fn > /work/src/main.rs; \
             ln /work/a.txt /work/a.link; rm /etc/group; rm /etc/hostname; mkdir /etc/hostname; \
             echo inside > /etc/hostname/f; rm -rf /usr/sbin; mkdir /usr/sbin; touch /usr/sbin/only",
        )
        .await;
    assert_eq!(out.exit.exit_code, 0, "{}", text(&out.stderr));

    let snap = daemon
        .client
        .snapshot_run(&parent, Some("snap-a"))
        .await
        .unwrap();
    assert_eq!(snap.image, "snap-a");
    assert_eq!(snap.parent, "base");
    assert!(snap.layer_bytes > 0 && snap.frozen_ms >= 0.0, "{snap:?}");
    assert_eq!(captures_left(&daemon), 0);
    let image = daemon.client.get_image("snap-a").await.unwrap();
    let base = daemon.client.get_image("base").await.unwrap();
    assert_eq!(image.layers.len(), base.layers.len() + 1);
    assert_eq!(image.layers[..base.layers.len()], base.layers[..]);
    // Nothing runbox put in the run is in the layer.
    let hex = snap.layer.trim_start_matches("sha256:");
    let layer = daemon.state.path().join("images/layers").join(hex);
    assert!(layer.join("work/a.txt").is_file());
    assert!(!layer.join(".runbox").exists());

    // The parent goes on; what it writes now is not in the snapshot.
    daemon.sh(&parent, "echo later > /work/later.txt").await;
    let child = run_from(&daemon, "snap-a").await;
    let check = "cat /work/a.txt /work/src/main.rs; \
                 [ -e /etc/group ] && echo group-back; \
                 [ -d /etc/hostname ] && cat /etc/hostname/f; \
                 ls /usr/sbin; [ -e /work/later.txt ] && echo later-leaked; \
                 [ /work/a.txt -ef /work/a.link ] && echo linked; \
                 [ -x /.runbox/agent ] && echo agent-mounted";
    let out = daemon.sh(&child, check).await;
    assert_eq!(
        text(&out.stdout),
        "one\nfn\ninside\nonly\nlinked\nagent-mounted\n",
        "{}",
        text(&out.stderr)
    );

    // A snapshot of the snapshot's run keeps both generations.
    daemon.sh(&child, "echo two > /work/b.txt").await;
    let again = daemon.client.snapshot_run(&child, None).await.unwrap();
    assert!(again.image.starts_with("snap-"), "{again:?}");
    assert_eq!(again.parent, "snap-a");
    let grandchild = run_from(&daemon, &again.image).await;
    let out = daemon.sh(&grandchild, "cat /work/a.txt /work/b.txt").await;
    assert_eq!(text(&out.stdout), "one\ntwo\n");

    // An image a run boots from cannot be deleted.
    let err = daemon.client.delete_image("snap-a").await.unwrap_err();
    assert_eq!(err.code(), Some(ErrorCode::ImageInUse), "{err}");

    // Snapshots outlive the daemon: after a kill -9 they boot as before.
    daemon.kill9();
    daemon.spawn().await;
    let after = run_from(&daemon, "snap-a").await;
    let out = daemon.sh(&after, "cat /work/a.txt").await;
    assert_eq!(text(&out.stdout), "one\n");
    assert_eq!(captures_left(&daemon), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_capture_while_a_command_writes_is_consistent() {
    let daemon = TestDaemon::start(None).await;
    let id = daemon.create().await.id.to_string();
    // Two files grown in lockstep: a consistent copy has them differ by at
    // most the one line being written when the run froze.
    daemon
        .sh(
            &id,
            "(while :; do echo x >> /work/a; echo x >> /work/b; done) > /dev/null 2>&1 &",
        )
        .await;
    tokio::time::sleep(std::time::Duration::from_millis(300)).await;
    let snap = daemon.client.snapshot_run(&id, None).await.unwrap();
    let copy = run_from(&daemon, &snap.image).await;
    let out = daemon
        .sh(&copy, "echo $(wc -l < /work/a) $(wc -l < /work/b)")
        .await;
    let counts: Vec<u64> = text(&out.stdout)
        .split_whitespace()
        .map(|n| n.parse().unwrap())
        .collect();
    assert!(counts[0] > 0, "{counts:?}");
    assert!(counts[0] - counts[1] <= 1, "{counts:?}");
    // The writer went on in the parent after the thaw.
    let out = daemon.sh(&id, "wc -l < /work/a").await;
    let now: u64 = text(&out.stdout).trim().parse().unwrap();
    assert!(now > counts[0], "{now} after {counts:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_snapshot_requests_are_refused() {
    let daemon = TestDaemon::start(None).await;
    let id = daemon.create().await.id.to_string();
    let err = daemon
        .client
        .snapshot_run(&id, Some("Bad/Name"))
        .await
        .unwrap_err();
    assert_eq!(err.code(), Some(ErrorCode::BadImageName), "{err}");
    let err = daemon
        .client
        .snapshot_run(&id, Some("base"))
        .await
        .unwrap_err();
    assert_eq!(err.code(), Some(ErrorCode::ImageExists), "{err}");
    let err = daemon
        .client
        .snapshot_run(&ulid::Ulid::new().to_string(), None)
        .await
        .unwrap_err();
    assert_eq!(err.code(), Some(ErrorCode::RunNotFound), "{err}");
    let (status, body) = runbox_e2e::raw_request(
        &daemon.url,
        "POST",
        &format!("/v1/runs/{id}/snapshot"),
        &daemon.token,
        br#"{"label":"x"}"#,
    )
    .await;
    assert_eq!(status, 400, "{body}");
    assert_eq!(captures_left(&daemon), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn snapshots_are_listed_and_deleted_apart_from_other_images() {
    let daemon = TestDaemon::start(None).await;
    let id = daemon.create().await.id.to_string();
    daemon.sh(&id, "echo kept > /work/k").await;
    let first = daemon
        .client
        .snapshot_run(&id, Some("keep-me"))
        .await
        .unwrap();
    let second = daemon.client.snapshot_run(&id, None).await.unwrap();
    let listed: Vec<String> = daemon
        .client
        .list_snapshots()
        .await
        .unwrap()
        .snapshots
        .into_iter()
        .map(|i| i.name)
        .collect();
    assert_eq!(listed.len(), 2, "{listed:?}");
    assert!(listed.contains(&first.image) && listed.contains(&second.image));
    // They are images too, and show as such.
    let images = daemon.client.list_images().await.unwrap().images;
    assert!(images
        .iter()
        .any(|i| i.name == "keep-me" && i.is_snapshot()));

    // In use: 409. Not a snapshot: 404, and the image stays.
    let user = run_from(&daemon, "keep-me").await;
    let err = daemon.client.delete_snapshot("keep-me").await.unwrap_err();
    assert_eq!(err.code(), Some(ErrorCode::ImageInUse), "{err}");
    let err = daemon.client.delete_snapshot("base").await.unwrap_err();
    assert_eq!(err.code(), Some(ErrorCode::ImageNotFound), "{err}");
    assert!(daemon.client.get_image("base").await.is_ok());

    // The seed's query form, and the path form once nothing uses it.
    let (status, body) = runbox_e2e::raw_request(
        &daemon.url,
        "DELETE",
        &format!("/v1/snapshots?image={}", second.image),
        &daemon.token,
        b"",
    )
    .await;
    assert_eq!(status, 204, "{body}");
    daemon.client.delete_run(&user).await.unwrap();
    daemon.client.delete_snapshot("keep-me").await.unwrap();
    assert!(daemon
        .client
        .list_snapshots()
        .await
        .unwrap()
        .snapshots
        .is_empty());
    // Their layers went with them; the run they came from is untouched.
    let out = daemon.sh(&id, "cat /work/k").await;
    assert_eq!(text(&out.stdout), "kept\n");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_daemon_killed_mid_capture_leaves_no_snapshot_and_no_leak() {
    let mut daemon = TestDaemon::start(None).await;
    let id = daemon.create().await.id.to_string();
    daemon
        .sh(
            &id,
            "dd if=/dev/urandom of=/work/big bs=1M count=400 2>/dev/null; sync",
        )
        .await;
    let layers = |daemon: &TestDaemon| {
        std::fs::read_dir(daemon.state.path().join("images/layers"))
            .unwrap()
            .flatten()
            .filter(|e| e.path().is_dir())
            .count()
    };
    let before = layers(&daemon);
    // The snapshot takes seconds (400 MiB to write as a layer); kill the
    // daemon in the middle of it.
    let client = daemon.client.clone();
    let target = id.clone();
    let pending =
        tokio::spawn(async move { client.snapshot_run(&target, Some("half-made")).await });
    let spool = daemon.state.path().join("images/spool");
    let started = runbox_e2e::eventually(std::time::Duration::from_secs(10), || {
        std::fs::read_dir(&spool)
            .map(|d| d.count() > 0)
            .unwrap_or(false)
    })
    .await;
    assert!(started, "the capture never started writing");
    tokio::time::sleep(std::time::Duration::from_millis(300)).await;
    daemon.kill9();
    assert!(
        pending.await.unwrap().is_err(),
        "the snapshot finished first"
    );
    daemon.spawn().await;
    // No snapshot that looks valid, no capture, no half-made or orphan layer.
    let err = daemon.client.get_image("half-made").await.unwrap_err();
    assert_eq!(err.code(), Some(ErrorCode::ImageNotFound), "{err}");
    assert!(daemon
        .client
        .list_snapshots()
        .await
        .unwrap()
        .snapshots
        .is_empty());
    assert_eq!(captures_left(&daemon), 0);
    assert_eq!(layers(&daemon), before);
    // The run itself is untouched.
    let out = daemon.sh(&id, "wc -c < /work/big").await;
    assert_eq!(text(&out.stdout).trim(), (400u64 << 20).to_string());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_run_left_frozen_by_a_dead_daemon_is_thawed_and_kept() {
    let mut daemon = TestDaemon::start(None).await;
    let id = daemon.create().await.id.to_string();
    daemon.sh(&id, "echo still-here > /work/f").await;
    // What a daemon killed inside a capture's frozen window leaves.
    daemon.kill9();
    let state = std::path::Path::new("/sys/fs/cgroup/freezer/runbox")
        .join(&id)
        .join("freezer.state");
    let v2 = std::path::Path::new("/sys/fs/cgroup/runbox")
        .join(&id)
        .join("cgroup.freeze");
    if state.exists() {
        std::fs::write(&state, "FROZEN").unwrap();
    } else {
        std::fs::write(&v2, "1").unwrap();
    }
    daemon.spawn().await;
    let run = daemon.client.get_run(&id).await.unwrap();
    assert_eq!(run.status, runbox_types::RunStatus::Running);
    let out = daemon.sh(&id, "cat /work/f").await;
    assert_eq!(text(&out.stdout), "still-here\n");
}
