//! Pause and resume: a paused run's processes stop where they are and keep
//! their memory; the next call that reaches the run resumes it, and calls
//! that arrive together share one resume; a daemon killed while a run is
//! paused finds it paused.

use std::path::PathBuf;
use std::time::Duration;

use runbox_e2e::{eventually, TestDaemon};
use runbox_types::RunStatus;

/// Starts a counter in run `id`: a shell loop that keeps its count in
/// memory and writes it to /work/count every 50 ms. Returns its pid.
async fn start_counter(daemon: &TestDaemon, id: &str) -> String {
    let out = daemon
        .sh(
            id,
            "i=0; while true; do i=$((i+1)); echo $i > /work/count.new; mv /work/count.new /work/count; \
             sleep 0.05; done \
             > /dev/null 2>&1 & echo $!",
        )
        .await;
    let pid = String::from_utf8_lossy(&out.stdout).trim().to_owned();
    assert!(!pid.is_empty(), "no pid: {out:?}");
    pid
}

/// The counter's file as the host sees it through the run's root: reading
/// it does not reach the run, so it does not resume it.
fn count_path(daemon: &TestDaemon, id: &str) -> PathBuf {
    daemon
        .state
        .path()
        .join("runs")
        .join(id)
        .join("rootfs/work/count")
}

fn count(path: &PathBuf) -> u64 {
    std::fs::read_to_string(path)
        .ok()
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or(0)
}

/// Waits until the counter passed `above`.
async fn counting_past(path: &PathBuf, above: u64) -> bool {
    eventually(Duration::from_secs(10), || count(path) > above).await
}

/// Whether the counter stands still for half a second.
async fn frozen(path: &PathBuf) -> bool {
    let before = count(path);
    tokio::time::sleep(Duration::from_millis(500)).await;
    count(path) == before
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_paused_run_keeps_its_processes_and_memory_and_the_next_call_resumes_it() {
    let daemon = TestDaemon::start(None).await;
    let id = daemon.create().await.id.to_string();
    let pid = start_counter(&daemon, &id).await;
    let path = count_path(&daemon, &id);
    assert!(counting_past(&path, 3).await, "the counter never ran");

    let paused = daemon.client.pause_run(&id).await.expect("pause");
    assert_eq!(paused.status, RunStatus::Paused);
    assert!(frozen(&path).await, "a paused run's counter went on");
    let at_pause = count(&path);
    // Shown as paused, and a second pause changes nothing.
    assert_eq!(
        daemon.client.get_run(&id).await.unwrap().status,
        RunStatus::Paused
    );
    let listed = daemon.client.list_runs().await.unwrap();
    assert!(listed
        .runs
        .iter()
        .any(|r| r.id.to_string() == id && r.status == RunStatus::Paused));
    let again = daemon.client.pause_run(&id).await.expect("pause again");
    assert_eq!(again.status, RunStatus::Paused);
    assert!(frozen(&path).await);

    // An exec reaches the run: it resumes first, and the counter (the same
    // process, its count in memory) goes on from where it stood.
    let out = daemon
        .sh(
            &id,
            &format!("kill -0 {pid} && echo alive; cat /work/count"),
        )
        .await;
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    let mut lines = text.lines();
    assert_eq!(lines.next(), Some("alive"), "{text}");
    let seen: u64 = lines.next().and_then(|l| l.parse().ok()).unwrap_or(0);
    assert!(seen >= at_pause, "the count went back: {seen} < {at_pause}");
    assert_eq!(
        daemon.client.get_run(&id).await.unwrap().status,
        RunStatus::Running
    );
    assert!(
        counting_past(&path, at_pause + 2).await,
        "not counting after the resume"
    );

    // Explicitly, both ways; resuming a running run changes nothing.
    assert_eq!(
        daemon.client.pause_run(&id).await.unwrap().status,
        RunStatus::Paused
    );
    assert!(frozen(&path).await);
    assert_eq!(
        daemon.client.resume_run(&id).await.unwrap().status,
        RunStatus::Running
    );
    let resumed_at = count(&path);
    assert!(counting_past(&path, resumed_at + 2).await);
    assert_eq!(
        daemon.client.resume_run(&id).await.unwrap().status,
        RunStatus::Running
    );

    // A file read resumes it too.
    daemon.client.pause_run(&id).await.unwrap();
    let file = daemon.client.get_file(&id, "count").await.expect("read");
    assert!(file.content_length().unwrap_or(0) > 0);
    assert_eq!(
        daemon.client.get_run(&id).await.unwrap().status,
        RunStatus::Running
    );

    // Unknown runs are 404, as everywhere.
    let unknown = ulid::Ulid::new().to_string();
    for result in [
        daemon.client.pause_run(&unknown).await,
        daemon.client.resume_run(&unknown).await,
    ] {
        let err = result.expect_err("an unknown run");
        assert_eq!(err.status(), Some(404), "{err}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn calls_that_reach_a_paused_run_together_share_one_resume() {
    let daemon = TestDaemon::start(None).await;
    let id = daemon.create().await.id.to_string();
    daemon.client.pause_run(&id).await.unwrap();
    let calls = (0..8).map(|i| {
        let daemon = &daemon;
        let id = id.clone();
        async move { daemon.sh(&id, &format!("echo {i}")).await }
    });
    let outs = futures::future::join_all(calls).await;
    for (i, out) in outs.iter().enumerate() {
        assert_eq!(String::from_utf8_lossy(&out.stdout), format!("{i}\n"));
    }
    let log = daemon.log();
    let resumes = log
        .lines()
        .filter(|l| l.contains("run resumed") && l.contains(&id))
        .count();
    assert_eq!(resumes, 1, "daemon log:\n{log}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_daemon_killed_while_a_run_is_paused_finds_it_paused() {
    for runtime in runbox_e2e::runtimes() {
        let mut daemon = TestDaemon::start(Some(&runtime)).await;
        let id = daemon.create().await.id.to_string();
        let pid = start_counter(&daemon, &id).await;
        let path = count_path(&daemon, &id);
        assert!(
            counting_past(&path, 3).await,
            "{runtime}: the counter never ran"
        );
        daemon.client.pause_run(&id).await.expect("pause");

        daemon.kill9();
        daemon.spawn().await;
        let run = daemon.client.get_run(&id).await.expect("the run is kept");
        assert_eq!(run.status, RunStatus::Paused, "{runtime}: {}", daemon.log());
        assert!(frozen(&path).await, "{runtime}: the restart thawed the run");

        // The first call resumes it: same process, count kept.
        let at_pause = count(&path);
        let out = daemon
            .sh(&id, &format!("kill -0 {pid} && echo alive"))
            .await;
        assert_eq!(String::from_utf8_lossy(&out.stdout), "alive\n", "{runtime}");
        assert!(counting_past(&path, at_pause + 2).await, "{runtime}");
        assert!(count(&path) > at_pause);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_run_that_does_not_resume_on_traffic_refuses_calls_until_resumed() {
    let daemon = TestDaemon::start(None).await;
    let id = daemon
        .create_with(runbox_types::CreateRunRequest {
            image: "base".into(),
            auto_resume: Some(false),
            ..Default::default()
        })
        .await
        .id
        .to_string();
    assert!(!daemon.client.get_run(&id).await.unwrap().auto_resume);
    daemon.client.pause_run(&id).await.unwrap();
    let err = daemon
        .exec_refusal(
            &id,
            "an exec reached a paused run that does not resume on traffic",
        )
        .await;
    assert_eq!(err.status(), Some(409), "{err}");
    assert!(err.to_string().contains("run_paused"), "{err}");
    assert_eq!(
        daemon.client.get_run(&id).await.unwrap().status,
        RunStatus::Paused
    );
    daemon.client.resume_run(&id).await.unwrap();
    assert_eq!(daemon.sh(&id, "echo up").await.stdout, b"up\n");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_expire_pause_keeps_the_run_until_its_retention_and_a_resume_renews_it() {
    let daemon = TestDaemon::start_with(None, &["--paused-retention-sec", "4"], &[]).await;
    let create = |ttl| runbox_types::CreateRunRequest {
        image: "base".into(),
        ttl_sec: Some(ttl),
        on_expire: Some(runbox_types::OnExpire::Pause),
        ..Default::default()
    };
    let run = daemon.create_with(create(2)).await;
    let id = run.id.to_string();
    assert_eq!(run.on_expire, runbox_types::OnExpire::Pause);
    daemon
        .client
        .put_file(&id, "kept", runbox_e2e::body(b"yes".to_vec()))
        .await
        .unwrap();
    let paused = runbox_e2e::eventually_async(Duration::from_secs(15), || async {
        daemon
            .client
            .get_run(&id)
            .await
            .is_ok_and(|r| r.status == RunStatus::Paused)
    })
    .await;
    assert!(paused, "not paused at its TTL: {}", daemon.log());
    // A call wakes it with a fresh TTL of the length it was made with.
    assert_eq!(daemon.sh(&id, "cat /work/kept").await.stdout, b"yes");
    let woken = daemon.client.get_run(&id).await.unwrap();
    assert_eq!(woken.status, RunStatus::Running);
    let left = woken.expires_at - time::OffsetDateTime::now_utc();
    assert!(left <= time::Duration::seconds(3), "{left}");
    // Its TTL passes again: paused again, then gone at the retention's end.
    let gone = runbox_e2e::eventually_async(Duration::from_secs(30), || async {
        daemon.client.get_run(&id).await.is_err()
    })
    .await;
    assert!(gone, "kept past its retention: {}", daemon.log());
    assert!(daemon.log().contains("asleep and kept"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_open_connection_into_a_paused_run_survives_the_pause() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let daemon = TestDaemon::start(None).await;
    let id = daemon.create().await.id.to_string();
    let mut tunnel = daemon.echo_tunnel(&id, 9000).await;
    daemon.client.pause_run(&id).await.unwrap();
    // Written while the run is frozen: the kernel keeps it for the server.
    tunnel.write_all(b"mid\n").await.unwrap();
    let mut early = [0u8; 4];
    let read = tokio::time::timeout(Duration::from_millis(500), tunnel.read(&mut early)).await;
    assert!(read.is_err(), "a frozen server answered");
    daemon.client.resume_run(&id).await.unwrap();
    let mut back = [0u8; 4];
    tokio::time::timeout(Duration::from_secs(10), tunnel.read_exact(&mut back))
        .await
        .expect("no echo after the resume")
        .unwrap();
    assert_eq!(&back, b"mid\n");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_call_the_lease_refuses_does_not_wake_a_paused_run() {
    let daemon = TestDaemon::start(None).await;
    let id = daemon.create().await.id.to_string();
    let lease = daemon
        .client
        .acquire_lease(&id, "alice@laptop", None)
        .await
        .expect("lease");
    daemon.client.pause_run(&id).await.unwrap();
    let req = runbox_types::ExecRequest {
        cmd: vec!["true".into()],
        ..Default::default()
    };
    let err = match daemon.client.exec(&id, &req).await {
        Ok(_) => panic!("a call without the lease was admitted"),
        Err(e) => e,
    };
    assert!(err.to_string().contains("leased"), "{err}");
    assert_eq!(
        daemon.client.get_run(&id).await.unwrap().status,
        RunStatus::Paused
    );
    // The holder's call wakes it.
    let held = runbox_types::ExecRequest {
        cmd: vec!["echo".into(), "mine".into()],
        owner: Some(lease.holder.clone()),
        generation: Some(lease.generation),
        ..Default::default()
    };
    assert_eq!(daemon.exec(&id, held).await.stdout, b"mine\n");
    assert_eq!(
        daemon.client.get_run(&id).await.unwrap().status,
        RunStatus::Running
    );
}
