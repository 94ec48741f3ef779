//! A `kill -9` of the daemon loses no live run: the restarted daemon
//! re-adopts runs whose sandbox lives and boots the ones that died again
//! on their disks (the restart policy; `none` keeps them failed).

use std::time::Duration;

use runbox_e2e::{cgroup_exists, eventually, mounts_under, netns_exists, TestDaemon};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill9_then_restart_readopts_live_runs_and_boots_dead_ones_again() {
    let mut daemon = TestDaemon::start(None).await;
    let live = daemon.create().await;
    let dead = daemon.create().await;
    let (live_id, dead_id) = (live.id.to_string(), dead.id.to_string());
    daemon
        .client
        .put_file(
            &live_id,
            "state.txt",
            runbox_e2e::body(b"survives".to_vec()),
        )
        .await
        .unwrap();
    daemon.sh(&live_id, "sleep 1000 > /dev/null 2>&1 &").await;
    daemon.sh(&dead_id, "echo kept > /work/kept").await;

    daemon.kill9();
    // While the daemon is down, one sandbox dies (its PID 1 is killed).
    let root = daemon.state.path().join("oci").join(&dead.runtime);
    let status = std::process::Command::new(&dead.runtime)
        .arg("--root")
        .arg(&root)
        .args(["kill", &format!("runbox-{dead_id}"), "KILL"])
        .status()
        .expect("runtime kill");
    assert!(status.success());
    let runtime = dead.runtime.clone();
    let cid = format!("runbox-{dead_id}");
    let stopped = eventually(Duration::from_secs(20), || {
        let out = std::process::Command::new(&runtime)
            .arg("--root")
            .arg(&root)
            .args(["state", &cid])
            .output();
        out.map(|o| !String::from_utf8_lossy(&o.stdout).contains("\"running\""))
            .unwrap_or(true)
    })
    .await;
    assert!(stopped, "the killed sandbox did not stop");

    daemon.spawn().await;
    let runs = daemon.client.list_runs().await.expect("list after restart");
    let mut ids: Vec<String> = runs.runs.iter().map(|r| r.id.to_string()).collect();
    ids.sort();
    let mut want = vec![live_id.clone(), dead_id.clone()];
    want.sort();
    assert_eq!(ids, want, "daemon log:\n{}", daemon.log());
    let adopted = daemon.client.get_run(&live_id).await.unwrap();
    assert_eq!(adopted.expires_at, live.expires_at);
    // The live run kept its files and its processes, and still works.
    let out = daemon
        .sh(
            &live_id,
            "cat /work/state.txt; echo; ps | grep -c '[s]leep 1000'",
        )
        .await;
    assert_eq!(String::from_utf8_lossy(&out.stdout), "survives\n1\n");
    // The dead one was booted again on its disk: its files, not its
    // processes, under the same id and expiry.
    let booted = daemon.client.get_run(&dead_id).await.unwrap();
    assert_eq!(booted.status, runbox_types::RunStatus::Running);
    assert_eq!(booted.restarts, 1);
    assert_eq!(booted.expires_at, dead.expires_at);
    assert_eq!(
        daemon.sh(&dead_id, "cat /work/kept").await.stdout,
        b"kept\n"
    );
    // Deleted, it leaves nothing behind.
    daemon.client.delete_run(&dead_id).await.unwrap();
    assert!(!netns_exists(&dead_id));
    assert!(!cgroup_exists(&dead_id));
    assert!(!daemon.state.path().join("runs").join(&dead_id).exists());
    let mounts = mounts_under(daemon.state.path());
    assert!(mounts.iter().all(|m| !m.contains(&dead_id)), "{mounts:?}");
    let err = daemon.client.get_run(&dead_id).await.unwrap_err();
    assert_eq!(err.status(), Some(404));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_stops_the_daemon_despite_open_streams_and_runs_survive() {
    // The exec stream below never ends on its own, so the daemon stops at
    // the end of its grace period; a short one keeps the test well inside
    // its own deadline.
    let mut daemon = TestDaemon::start_with(None, &["--shutdown-grace-sec", "2"], &[]).await;
    let id = daemon.create().await.id.to_string();
    let req = runbox_types::ExecRequest {
        cmd: vec!["sleep".into(), "1000".into()],
        ..Default::default()
    };
    let stream = daemon.client.exec(&id, &req).await.expect("exec");
    // SAFETY: kill(2) on the daemon's pid, a child this test spawned.
    let rc = unsafe { libc::kill(daemon.pid() as i32, libc::SIGTERM) };
    assert_eq!(rc, 0);
    let pid = daemon.pid();
    let exited = eventually(Duration::from_secs(30), || {
        // A zombie counts as exited: its state letter is Z.
        std::fs::read_to_string(format!("/proc/{pid}/stat"))
            .map(|s| s.split_whitespace().nth(2) == Some("Z"))
            .unwrap_or(true)
    })
    .await;
    assert!(
        exited,
        "the daemon did not stop on SIGTERM with an open exec stream"
    );
    drop(stream);
    daemon.kill9();
    daemon.spawn().await;
    assert_eq!(
        daemon.sh(&id, "echo still here").await.stdout,
        b"still here\n"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_daemon_on_the_same_state_dir_is_refused() {
    let daemon = TestDaemon::start(None).await;
    let out = std::process::Command::new(runbox_e2e::runbox_bin())
        .arg("serve")
        .arg("--listen")
        .arg("127.0.0.1:0")
        .arg("--state-dir")
        .arg(daemon.state.path())
        .output()
        .expect("second daemon");
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("another runbox daemon"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // The first one is unaffected.
    daemon
        .client
        .health()
        .await
        .expect("first daemon still serves");
}
