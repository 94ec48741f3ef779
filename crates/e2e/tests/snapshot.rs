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

/// The directory of snapshot layer `key` (`local:<id>`): the capture kept
/// in the run store, its `upper` what the image mounts.
fn local_layer(daemon: &TestDaemon, key: &str) -> std::path::PathBuf {
    let id = key
        .strip_prefix("local:")
        .unwrap_or_else(|| panic!("not a kept layer: {key}"));
    daemon.state.path().join("runs/.layers").join(id)
}

/// Kept layers in the run store.
fn local_layers(daemon: &TestDaemon) -> Vec<String> {
    let mut ids: Vec<String> = std::fs::read_dir(daemon.state.path().join("runs/.layers"))
        .map(|d| {
            d.flatten()
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .collect()
        })
        .unwrap_or_default();
    ids.sort();
    ids
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
    // The layer is the capture itself, kept in the run store (no tar was
    // written): a read-only subvolume of its own, holding what the run
    // changed and nothing runbox put in the run.
    assert_eq!(image.layers.last(), Some(&snap.layer));
    let kept = local_layer(&daemon, &snap.layer);
    let layer = kept.join("upper");
    assert!(layer.join("work/a.txt").is_file());
    assert!(!layer.join(".runbox").exists());
    assert!(!kept.join("ovl-work").exists());
    {
        use std::os::unix::fs::MetadataExt;
        // A btrfs subvolume's root directory is inode 256.
        assert_eq!(std::fs::metadata(&kept).unwrap().ino(), 256);
    }
    let write = std::fs::write(layer.join("work/new"), b"x").unwrap_err();
    assert_eq!(write.raw_os_error(), Some(libc::EROFS), "{write}");
    assert!(std::fs::read_dir(daemon.state.path().join("images/spool"))
        .map(|d| d.count() == 0)
        .unwrap_or(true));

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
    assert!(
        local_layers(&daemon).is_empty(),
        "{:?}",
        local_layers(&daemon)
    );
    let out = daemon.sh(&id, "cat /work/k").await;
    assert_eq!(text(&out.stdout), "kept\n");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_large_change_is_kept_in_constant_time_and_a_killed_daemon_leaks_nothing() {
    let mut daemon = TestDaemon::start(None).await;
    let id = daemon.create().await.id.to_string();
    daemon
        .sh(
            &id,
            "dd if=/dev/urandom of=/work/big bs=1M count=400 2>/dev/null; sync",
        )
        .await;
    let stored = |daemon: &TestDaemon| {
        std::fs::read_dir(daemon.state.path().join("images/layers"))
            .unwrap()
            .flatten()
            .filter(|e| e.path().is_dir())
            .count()
    };
    let before = stored(&daemon);
    // 400 MiB changed: the layer is a snapshot of the run's disk. Nothing
    // is written to the image store, and the layer shares the run's blocks
    // (the run store's usage does not grow by the file's size).
    let snap = daemon.client.snapshot_run(&id, Some("big")).await.unwrap();
    assert_eq!(stored(&daemon), before);
    assert_eq!(snap.layer_bytes, 400 << 20, "{snap:?}");
    let big = local_layer(&daemon, &snap.layer).join("upper/work/big");
    assert_eq!(std::fs::metadata(&big).unwrap().len(), 400 << 20);
    let child = run_from(&daemon, "big").await;
    let out = daemon.sh(&child, "wc -c < /work/big").await;
    assert_eq!(text(&out.stdout).trim(), (400u64 << 20).to_string());

    // The daemon killed a few milliseconds into a snapshot, at a different
    // point each round: a snapshot is recorded whole or not at all, and no
    // capture or unrecorded layer is left after the restart.
    for round in 0..5u64 {
        let name = format!("round-{round}");
        let client = daemon.client.clone();
        let target = id.clone();
        let pending = {
            let name = name.clone();
            tokio::spawn(async move { client.snapshot_run(&target, Some(&name)).await })
        };
        tokio::time::sleep(std::time::Duration::from_millis(round * 4)).await;
        daemon.kill9();
        let _ = pending.await;
        daemon.spawn().await;
        assert_eq!(captures_left(&daemon), 0, "round {round}");
        let images = daemon.client.list_images().await.unwrap().images;
        // Every kept layer belongs to a recorded image.
        let recorded: Vec<String> = images
            .iter()
            .flat_map(|i| i.layers.clone())
            .filter_map(|l| l.strip_prefix("local:").map(str::to_owned))
            .collect();
        for layer in local_layers(&daemon) {
            assert!(
                recorded.contains(&layer),
                "round {round}: unrecorded layer {layer}"
            );
        }
        if images.iter().any(|i| i.name == name) {
            let copy = run_from(&daemon, &name).await;
            let out = daemon.sh(&copy, "wc -c < /work/big").await;
            assert_eq!(text(&out.stdout).trim(), (400u64 << 20).to_string());
            daemon.client.delete_run(&copy).await.unwrap();
        }
        assert_eq!(stored(&daemon), before, "round {round}");
    }
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
