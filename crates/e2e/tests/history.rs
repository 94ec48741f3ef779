//! Run history: a point after every command and file call that changed a
//! file, diffs of them, rollbacks to them and forward again, forks and
//! snapshots of them; on the real runtime and the real btrfs run store.

use std::collections::BTreeMap;
use std::path::PathBuf;

use runbox_client::ClientError;
use runbox_e2e::TestDaemon;
use runbox_types::{
    CreateRunRequest, ErrorCode, HistoryDiffQuery, HistorySettings, PathChangeKind, PointKind,
    RollbackRequest, RunStatus,
};
use ulid::Ulid;

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

async fn with_history(daemon: &TestDaemon, keep: u32) -> String {
    daemon
        .create_with(CreateRunRequest {
            image: "base".into(),
            history: Some(HistorySettings { keep }),
            ..Default::default()
        })
        .await
        .id
        .to_string()
}

/// Runs `script` and returns its stdout and the point its exit names.
async fn step(daemon: &TestDaemon, id: &str, script: &str) -> (String, Option<Ulid>) {
    let out = daemon.sh(id, script).await;
    assert_eq!(
        out.exit.exit_code,
        0,
        "{script}: {}{}",
        text(&out.stdout),
        text(&out.stderr)
    );
    (text(&out.stdout), out.exit.point)
}

fn code(err: ClientError) -> String {
    match err {
        ClientError::Api { code, .. } => code,
        other => panic!("not an API error: {other}"),
    }
}

/// The run's points directory on the host.
fn history_dir(daemon: &TestDaemon, id: &str) -> PathBuf {
    daemon.state.path().join("runs/.history").join(id)
}

async fn rollback(daemon: &TestDaemon, id: &str, point: Ulid) -> runbox_types::Run {
    let req = RollbackRequest {
        point,
        owner: None,
        generation: None,
    };
    match daemon.client.rollback(id, &req).await {
        Ok(run) => run,
        Err(e) => panic!("rollback to {point} failed: {e}; log:\n{}", daemon.log()),
    }
}

/// What the run's tree looks like: path → `kind mode uid:gid size target`,
/// and the inode shared by the hard links.
const LOOK: &str = "cd /work/app && for f in $(find . | sort); do \
     printf '%s %s\\n' \"$f\" \"$(stat -c '%F %a %u:%g %s %N' \"$f\")\"; done; \
     cat a.txt; [ \"$(stat -c %i a.txt)\" = \"$(stat -c %i hard)\" ] && echo linked";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_session_is_diffed_rolled_back_and_forward_again() {
    // With a user namespace per run: owners are shown and restored as the
    // run sees them.
    let daemon = TestDaemon::start_with(None, &["--userns", "on"], &[]).await;
    let id = with_history(&daemon, 20).await;
    // The tree the agent installs.
    let (_, installed) = step(
        &daemon,
        &id,
        "mkdir -p /work/app/sub && echo one > /work/app/a.txt && \
         head -c 3000 /dev/urandom > /work/app/sub/b.bin && ln -s a.txt /work/app/link && \
         ln /work/app/a.txt /work/app/hard && chmod 640 /work/app/a.txt && \
         chown 1000:1000 /work/app/sub/b.bin",
    )
    .await;
    let installed = installed.expect("the install made a point");
    let (look_installed, _) = step(&daemon, &id, LOOK).await;
    assert!(look_installed.contains("linked"), "{look_installed}");
    // A command that changes nothing (reads only) makes no point.
    let (_, none) = step(&daemon, &id, "cat /work/app/a.txt /etc/passwd > /dev/null").await;
    assert_eq!(none, None, "a read-only command makes no point");
    // An extended attribute set on the file from outside the run, then
    // the breakage: a removal, an overwrite (through the hard link too), a
    // chmod, a symlink swapped.
    let upper = daemon
        .state
        .path()
        .join("runs")
        .join(&id)
        .join("disk/upper/work/app/a.txt");
    runbox_e2e::set_xattr(&upper, "user.note", b"kept");
    let (_, broken) = step(
        &daemon,
        &id,
        "rm -rf /work/app/sub && echo two > /work/app/a.txt && chmod 600 /work/app/a.txt && \
         rm /work/app/link && ln -s /etc/passwd /work/app/link",
    )
    .await;
    let broken = broken.expect("the breakage made a point");

    // The diff names exactly those changes, with before and after.
    let diff = daemon
        .client
        .history_diff(&id, &broken.to_string(), &HistoryDiffQuery::default())
        .await
        .unwrap();
    assert_eq!(diff.against, Some(installed));
    let changes: BTreeMap<&str, PathChangeKind> = diff
        .changes
        .iter()
        .map(|c| (c.path.as_str(), c.change))
        .collect();
    assert_eq!(
        changes,
        BTreeMap::from([
            ("/work/app/a.txt", PathChangeKind::Modified),
            ("/work/app/hard", PathChangeKind::Modified),
            ("/work/app/link", PathChangeKind::Modified),
            ("/work/app/sub", PathChangeKind::Removed),
            ("/work/app/sub/b.bin", PathChangeKind::Removed),
        ]),
        "{diff:#?}"
    );
    let a = diff
        .changes
        .iter()
        .find(|c| c.path == "/work/app/a.txt")
        .unwrap();
    let (before, after) = (a.before.as_ref().unwrap(), a.after.as_ref().unwrap());
    assert_eq!((before.mode, after.mode), (0o640, 0o600));
    assert_eq!((before.size, after.size), (4, 4));
    let link = diff
        .changes
        .iter()
        .find(|c| c.path == "/work/app/link")
        .unwrap();
    assert_eq!(
        link.after.as_ref().unwrap().target.as_deref(),
        Some("/etc/passwd")
    );
    let bin = diff
        .changes
        .iter()
        .find(|c| c.path == "/work/app/sub/b.bin")
        .unwrap();
    let bin = bin.before.as_ref().unwrap();
    assert_eq!((bin.uid, bin.gid, bin.size), (1000, 1000, 3000));
    assert_eq!(diff.summary.removed, 2);
    // With patches: the text file's, and the binary one named as such.
    let patched = daemon
        .client
        .history_diff(
            &id,
            &broken.to_string(),
            &HistoryDiffQuery {
                patch: Some(true),
                ..Default::default()
            },
        )
        .await
        .unwrap();
    let a = patched
        .changes
        .iter()
        .find(|c| c.path == "/work/app/a.txt")
        .unwrap();
    let patch = a.patch.as_deref().expect("a text patch");
    assert!(patch.contains("-one") && patch.contains("+two"), "{patch}");
    let bin = patched
        .changes
        .iter()
        .find(|c| c.path == "/work/app/sub/b.bin")
        .unwrap();
    assert!(bin.binary && bin.patch.is_none(), "{bin:?}");

    // The history: newest first, each saying what made it.
    let history = daemon.client.history(&id).await.unwrap();
    let kinds: Vec<PointKind> = history.points.iter().map(|p| p.cause.kind).collect();
    assert_eq!(kinds, [PointKind::Exec, PointKind::Exec, PointKind::Create]);
    assert_eq!(history.points[0].id, broken);
    assert_eq!(history.points[0].cause.exit_code, Some(0));
    assert_eq!(history.points[0].parent, Some(installed));
    assert_eq!(history.head, Some(broken));
    assert_eq!(
        history.points[1].changes.added, 6,
        "{:?}",
        history.points[1]
    );

    // Rolled back: every byte, mode, owner and link as installed, the
    // attribute gone; the run is running under the same id.
    let run = rollback(&daemon, &id, installed).await;
    assert_eq!(run.status, RunStatus::Running);
    let (look, _) = step(&daemon, &id, LOOK).await;
    assert_eq!(look, look_installed);
    let upper_now = daemon
        .state
        .path()
        .join("runs")
        .join(&id)
        .join("disk/upper/work/app/a.txt");
    assert_eq!(runbox_e2e::xattr(&upper_now, "user.note"), None);
    let history = daemon.client.history(&id).await.unwrap();
    assert_eq!(history.head, Some(installed));
    assert!(history.points.iter().any(|p| p.id == broken), "kept");

    // And forward again.
    rollback(&daemon, &id, broken).await;
    let (now, _) = step(&daemon, &id, "cat /work/app/a.txt; readlink /work/app/link").await;
    assert_eq!(now, "two\n/etc/passwd\n");
    assert_eq!(
        runbox_e2e::xattr(&upper_now, "user.note").as_deref(),
        Some(&b"kept"[..])
    );

    // A command a rollback cuts short leaves no point of the returned
    // files under its name.
    let cut = {
        let client = daemon.client.clone();
        let id = id.clone();
        tokio::spawn(async move {
            let req = runbox_types::ExecRequest {
                cmd: vec![
                    "sh".into(),
                    "-c".into(),
                    "sleep 3; echo late > /work/late".into(),
                ],
                ..Default::default()
            };
            match client.exec(&id, &req).await {
                Ok(stream) => stream.collect_output().await.ok(),
                Err(_) => None,
            }
        })
    };
    tokio::time::sleep(std::time::Duration::from_millis(500)).await;
    rollback(&daemon, &id, installed).await;
    let cut = cut.await.unwrap();
    assert!(
        cut.is_none_or(|out| out.exit.point.is_none()),
        "no point for a cut command"
    );
    let history = daemon.client.history(&id).await.unwrap();
    assert!(
        !history.points.iter().any(|p| p
            .cause
            .argv
            .as_ref()
            .is_some_and(|a| a.join(" ").contains("late"))),
        "{:?}",
        history.points
    );
    assert_eq!(history.head, Some(installed));
    rollback(&daemon, &id, broken).await;

    // Back, then a new change: the points after the one returned to go.
    rollback(&daemon, &id, installed).await;
    let (_, third) = step(&daemon, &id, "echo three > /work/app/c.txt").await;
    let third = third.expect("a new point");
    let history = daemon.client.history(&id).await.unwrap();
    assert!(!history.points.iter().any(|p| p.id == broken), "dropped");
    assert_eq!(history.points[0].id, third);
    assert_eq!(history.points[0].parent, Some(installed));
    assert_eq!(history.head, Some(third));

    // A fork and a snapshot of a point.
    let forked = daemon
        .client
        .fork_run(
            &id,
            &runbox_types::ForkRequest {
                count: 1,
                point: Some(installed),
                ..Default::default()
            },
        )
        .await
        .unwrap();
    let child = forked.runs[0].id.to_string();
    let (look_child, _) = step(&daemon, &child, LOOK).await;
    assert_eq!(look_child, look_installed);
    let snap = daemon
        .client
        .snapshot_run_with(
            &id,
            &runbox_types::SnapshotRequest {
                point: Some(installed),
                ..Default::default()
            },
        )
        .await
        .unwrap();
    let from_snap = daemon
        .create_with(CreateRunRequest {
            image: snap.image.clone(),
            ..Default::default()
        })
        .await
        .id
        .to_string();
    let (look_snap, _) = step(&daemon, &from_snap, "cat /work/app/a.txt; ls /work/app").await;
    assert_eq!(look_snap, "one\na.txt\nhard\nlink\nsub\n");

    // Deleting the run removes its points.
    daemon.client.delete_run(&id).await.unwrap();
    assert!(!history_dir(&daemon, &id).exists());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn file_calls_make_points_and_bad_asks_are_refused() {
    let daemon = TestDaemon::start(None).await;
    let id = with_history(&daemon, 3).await;
    daemon
        .client
        .put_file(&id, "notes.txt", runbox_e2e::body(b"hello\n".to_vec()))
        .await
        .unwrap();
    let history = daemon.client.history(&id).await.unwrap();
    let newest = &history.points[0];
    assert_eq!(newest.cause.kind, PointKind::File);
    assert_eq!(newest.cause.op.as_deref(), Some("write"));
    assert_eq!(newest.cause.path.as_deref(), Some("/work/notes.txt"));
    assert_eq!(history.points[1].cause.kind, PointKind::Create);
    daemon
        .client
        .remove_path(
            &id,
            &runbox_types::RemoveRequest {
                path: "notes.txt".into(),
                ..Default::default()
            },
        )
        .await
        .unwrap();
    // Keep 3: the oldest go.
    for n in 0..3 {
        step(&daemon, &id, &format!("echo {n} > /work/f{n}")).await;
    }
    let history = daemon.client.history(&id).await.unwrap();
    assert_eq!(history.points.len(), 3);
    assert_eq!(history.keep, 3);
    let names: Vec<String> = std::fs::read_dir(history_dir(&daemon, &id))
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| !n.contains('.'))
        .collect();
    assert_eq!(names.len(), 3, "{names:?}");
    // The oldest kept point's parent is gone: its diff says so.
    let oldest = history.points[2].id;
    let err = daemon
        .client
        .history_diff(&id, &oldest.to_string(), &HistoryDiffQuery::default())
        .await
        .unwrap_err();
    assert_eq!(code(err), "point_not_found");
    // Unknown points, a run without history, out-of-range settings.
    let unknown = Ulid::new();
    let err = daemon
        .client
        .history_diff(&id, &unknown.to_string(), &HistoryDiffQuery::default())
        .await
        .unwrap_err();
    assert_eq!(code(err), ErrorCode::PointNotFound.as_str());
    let req = RollbackRequest {
        point: unknown,
        owner: None,
        generation: None,
    };
    let err = daemon.client.rollback(&id, &req).await.unwrap_err();
    assert_eq!(code(err), ErrorCode::PointNotFound.as_str());
    let plain = daemon.create().await.id.to_string();
    let err = daemon.client.history(&plain).await.unwrap_err();
    assert_eq!(code(err), ErrorCode::PointNotFound.as_str());
    let (_, point) = step(&daemon, &plain, "echo x > /work/x").await;
    assert_eq!(point, None, "no history, no point");
    let err = daemon
        .client
        .create_run(&CreateRunRequest {
            image: "base".into(),
            history: Some(HistorySettings { keep: 100_000 }),
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(code(err), ErrorCode::BadHistory.as_str());
    let (status, body) = runbox_e2e::raw_request(
        &daemon.url,
        "GET",
        &format!("/v1/runs/{id}/history/not-a-point/diff"),
        &daemon.token,
        b"",
    )
    .await;
    assert_eq!(status, 404, "{body}");
    let (status, body) = runbox_e2e::raw_request(
        &daemon.url,
        "GET",
        &format!(
            "/v1/runs/{id}/history/{}/diff?limit=0",
            history.points[0].id
        ),
        &daemon.token,
        b"",
    )
    .await;
    assert_eq!(status, 400, "{body}");
    let (status, body) = runbox_e2e::raw_request(
        &daemon.url,
        "GET",
        &format!(
            "/v1/runs/{id}/history/{}/diff?bogus=1",
            history.points[0].id
        ),
        &daemon.token,
        b"",
    )
    .await;
    assert_eq!(status, 400, "{body}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_commands_and_background_processes_each_leave_their_own_point() {
    let daemon = TestDaemon::start(None).await;
    let id = with_history(&daemon, 50).await;
    step(&daemon, &id, "true").await;
    // Two commands at once: each point names its own command and holds
    // the files as they were when it ended.
    let slow = daemon.sh(&id, "sleep 1; echo slow > /work/slow");
    let fast = daemon.sh(&id, "echo fast > /work/fast");
    let (slow, fast) = tokio::join!(slow, fast);
    let (slow_point, fast_point) = (slow.exit.point.unwrap(), fast.exit.point.unwrap());
    assert!(fast_point < slow_point, "the fast one ended first");
    let history = daemon.client.history(&id).await.unwrap();
    let argv = |point: Ulid| {
        history
            .points
            .iter()
            .find(|p| p.id == point)
            .and_then(|p| p.cause.argv.clone())
            .unwrap()
    };
    assert!(argv(slow_point)[2].contains("slow"));
    assert!(argv(fast_point)[2].contains("fast"));
    let diff = daemon
        .client
        .history_diff(&id, &fast_point.to_string(), &HistoryDiffQuery::default())
        .await
        .unwrap();
    let paths: Vec<&str> = diff.changes.iter().map(|c| c.path.as_str()).collect();
    assert_eq!(paths, ["/work/fast"]);
    let diff = daemon
        .client
        .history_diff(&id, &slow_point.to_string(), &HistoryDiffQuery::default())
        .await
        .unwrap();
    let paths: Vec<&str> = diff.changes.iter().map(|c| c.path.as_str()).collect();
    assert_eq!(paths, ["/work/slow"]);
    // A background process's point comes when it ends.
    let started = daemon
        .client
        .start_process(
            &id,
            &runbox_types::ExecRequest {
                cmd: vec![
                    "sh".into(),
                    "-c".into(),
                    "sleep 1; echo bg > /work/bg; exit 3".into(),
                ],
                ..Default::default()
            },
        )
        .await
        .unwrap();
    let found = runbox_e2e::eventually_async(std::time::Duration::from_secs(20), || async {
        let history = daemon.client.history(&id).await.unwrap();
        history.points[0].cause.kind == PointKind::Process
    })
    .await;
    assert!(found, "no point for background process {}", started.pid);
    let history = daemon.client.history(&id).await.unwrap();
    assert_eq!(history.points[0].cause.exit_code, Some(3));
    assert_eq!(history.points[0].changes.added, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn history_stays_within_the_disk_limit_and_survives_a_crash() {
    let mut daemon = TestDaemon::start(None).await;
    let id = daemon
        .create_with(CreateRunRequest {
            image: "base".into(),
            history: Some(HistorySettings { keep: 50 }),
            limits: Some(runbox_types::LimitsRequest {
                disk_mb: Some(64),
                ..Default::default()
            }),
            ..Default::default()
        })
        .await
        .id
        .to_string();
    // Each round replaces 20 MiB: the points hold the old copies, and the
    // oldest go so that the run and its points stay within 64 MiB. The run
    // itself never fails for it.
    for round in 0..6 {
        step(
            &daemon,
            &id,
            &format!(
                "head -c 20971520 /dev/urandom > /work/big.tmp && mv /work/big.tmp /work/big && echo {round}"
            ),
        )
        .await;
    }
    let history = daemon.client.history(&id).await.unwrap();
    assert!(
        history.points.len() < 7,
        "{} points kept",
        history.points.len()
    );
    assert!(
        history.points.len() >= 2,
        "{} points kept",
        history.points.len()
    );
    let run = daemon.client.get_run(&id).await.unwrap();
    // With simple quotas the run's usage counts what its points hold;
    // with full qgroups `bytes` does.
    let held = history.bytes.unwrap_or(0);
    let used = run.disk_used_bytes.expect("the store counts a run's disk");
    assert!(
        used + held <= 64 << 20,
        "disk {used} + history {held} above the 64 MiB limit"
    );

    // A point the daemon made but never described (killed between the
    // snapshot and its description) is swept at the next start, and the
    // history reads as before.
    let newest = history.points[0].id;
    let half = Ulid::new().to_string();
    let made = std::process::Command::new("btrfs")
        .args(["subvolume", "snapshot", "-r"])
        .arg(daemon.state.path().join("runs").join(&id).join("disk"))
        .arg(history_dir(&daemon, &id).join(&half))
        .output()
        .unwrap();
    assert!(made.status.success(), "{}", text(&made.stderr));
    daemon.kill9();
    daemon.spawn().await;
    assert!(!history_dir(&daemon, &id).join(&half).exists(), "swept");
    let after = daemon.client.history(&id).await.unwrap();
    assert_eq!(after.points[0].id, newest);
    assert_eq!(after.points.len(), history.points.len());
    // And rolling back still works after the restart.
    rollback(&daemon, &id, after.points[1].id).await;
    step(&daemon, &id, "test -f /work/big").await;
}
