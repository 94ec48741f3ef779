//! The lifecycle under the things real clients and real sandboxes do:
//! clients that hang up half-way through a create or a delete, and runs whose
//! init dies under them.

use std::collections::BTreeSet;
use std::path::Path;
use std::time::Duration;

use runbox_client::ClientError;
use runbox_e2e::{cgroup_exists, eventually, mounts_under, netns_exists, TestDaemon};
use runbox_types::{CreateRunRequest, ExecRequest, RunStatus};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// Sends `method path` with a JSON `body`, waits `after`, then closes the
/// sending side (the server sees the client go away) and reads whatever
/// answer had already been sent. Returns the status (0 for none) and body.
async fn hang_up(
    daemon: &TestDaemon,
    method: &str,
    path: &str,
    body: &str,
    after: Duration,
) -> (u16, String) {
    hang_up_with(daemon, method, path, "", body, after).await
}

/// [`hang_up`] with extra header lines (each ending in CRLF).
async fn hang_up_with(
    daemon: &TestDaemon,
    method: &str,
    path: &str,
    headers: &str,
    body: &str,
    after: Duration,
) -> (u16, String) {
    let addr = daemon.url.trim_start_matches("http://");
    let mut stream = tokio::net::TcpStream::connect(addr).await.expect("connect");
    let head = format!(
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nAuthorization: Bearer {}\r\n{headers}Content-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        daemon.token,
        body.len()
    );
    stream.write_all(head.as_bytes()).await.expect("write");
    tokio::time::sleep(after).await;
    stream.shutdown().await.expect("shutdown");
    let mut answer = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(30), stream.read_to_end(&mut answer)).await;
    runbox_e2e::split_response(&String::from_utf8_lossy(&answer))
}

/// Every run id the daemon's log mentions (the log may be coloured, so ids
/// are picked out as words rather than after `run=`).
fn ids_in_log(log: &str) -> BTreeSet<String> {
    // Drop ANSI colour sequences (ESC [ ... m) first.
    let mut plain = String::with_capacity(log.len());
    let mut in_escape = false;
    for c in log.chars() {
        match (in_escape, c) {
            (false, '\u{1b}') => in_escape = true,
            (false, c) => plain.push(c),
            (true, 'm') => in_escape = false,
            (true, _) => {}
        }
    }
    plain
        .split(|c: char| !c.is_ascii_alphanumeric())
        .filter(|w| w.len() == 26 && ulid::Ulid::from_string(w).is_ok())
        .map(str::to_owned)
        .collect()
}

/// The error of a call that must fail (its success type need not be Debug).
fn refused<T>(result: Result<T, ClientError>) -> ClientError {
    match result {
        Ok(_) => panic!("the call succeeded; expected a refusal"),
        Err(e) => e,
    }
}

/// Entries of the lane's runs directory.
fn run_dirs(state: &Path) -> Vec<String> {
    std::fs::read_dir(state.join("runs"))
        .map(|d| {
            d.flatten()
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .filter(|n| ulid::Ulid::from_string(n).is_ok())
                .collect()
        })
        .unwrap_or_default()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn clients_that_hang_up_during_create_or_delete_leave_nothing_behind() {
    let mut daemon = TestDaemon::start_with(None, &["--max-runs", "4"], &[]).await;
    let state = daemon.state.path().to_owned();
    assert!(daemon.client.list_runs().await.unwrap().runs.is_empty());

    // Creates whose client goes away after 20–100 ms: some before the run
    // is up, some after. A run the client was told about stays; every other
    // one must vanish with everything it held.
    let mut answered = Vec::new();
    for i in 0..9u64 {
        // An abandoned create holds its slot until its teardown is over;
        // wait for that so no create here is refused for capacity.
        let idle = eventually(Duration::from_secs(20), || run_dirs(&state).is_empty()).await;
        assert!(
            idle,
            "runs left behind: {:?}\ndaemon log:\n{}",
            run_dirs(&state),
            daemon.log()
        );
        let after = Duration::from_millis(20 + i * 10);
        let (status, text) =
            hang_up(&daemon, "POST", "/v1/runs", r#"{"image":"base"}"#, after).await;
        match status {
            0 => {}
            201 => {
                let run: runbox_types::Run = serde_json::from_str(&text).expect("run json");
                answered.push(run.id.to_string());
            }
            other => panic!(
                "create answered {other}: {text}\ndaemon log:\n{}",
                daemon.log()
            ),
        }
        for id in answered.drain(..) {
            daemon.client.delete_run(&id).await.unwrap();
        }
    }
    let settled = eventually(Duration::from_secs(20), || run_dirs(&state).is_empty()).await;
    assert!(
        settled,
        "runs left behind: {:?}\ndaemon log:\n{}",
        run_dirs(&state),
        daemon.log()
    );
    assert!(daemon.client.list_runs().await.unwrap().runs.is_empty());

    // Deletes whose client goes away after 0–40 ms: the run goes anyway,
    // once the server took the request. One dropped before the server
    // began to handle it (possible at 0 ms on a loaded host) leaves the run
    // whole: it answers, and a delete then removes it.
    for i in 0..5u64 {
        let run = daemon.create().await;
        let id = run.id.to_string();
        let path = format!("/v1/runs/{id}");
        hang_up(&daemon, "DELETE", &path, "", Duration::from_millis(i * 10)).await;
        let gone = eventually(Duration::from_secs(5), || {
            !state.join("runs").join(&id).exists()
        })
        .await;
        if !gone {
            if let Ok(run) = daemon.client.get_run(&id).await {
                assert_eq!(run.status, RunStatus::Running, "a half-deleted run");
                assert_eq!(daemon.sh(&id, "echo whole").await.stdout, b"whole\n");
                daemon.client.delete_run(&id).await.unwrap();
            }
        }
        let gone = eventually(Duration::from_secs(20), || {
            !state.join("runs").join(&id).exists()
        })
        .await;
        assert!(
            gone,
            "run {id} survived its delete\ndaemon log:\n{}",
            daemon.log()
        );
        let err = daemon.client.get_run(&id).await.unwrap_err();
        assert!(matches!(err, ClientError::Api { status: 404, .. }), "{err}");
    }

    // Nothing any of those runs held is left: mounts, namespaces, cgroups.
    let log = daemon.log();
    let seen = ids_in_log(&log);
    assert!(seen.len() >= 5, "the log names too few runs:\n{log}");
    assert!(
        mounts_under(&state).is_empty(),
        "{:?}",
        mounts_under(&state)
    );
    for id in &seen {
        assert!(!netns_exists(id), "netns of {id} left behind");
        assert!(!cgroup_exists(id), "cgroup of {id} left behind");
    }
    // Every capacity slot came back: the maximum number of runs fits.
    let mut full = Vec::new();
    for _ in 0..4 {
        full.push(daemon.create().await.id.to_string());
    }
    let err = daemon
        .client
        .create_run(&CreateRunRequest {
            image: "base".into(),
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert!(
        matches!(err, ClientError::Api { ref code, .. } if code == "capacity"),
        "{err}"
    );
    for id in &full {
        daemon.client.delete_run(id).await.unwrap();
    }
    // And the store holds nothing either: a restart finds no runs.
    daemon.kill9();
    daemon.spawn().await;
    assert!(daemon.client.list_runs().await.unwrap().runs.is_empty());
    assert!(run_dirs(&state).is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_run_whose_init_dies_is_failed_with_the_reason() {
    // Policy `none`: a dead run stays failed (the default boots it again;
    // see hibernate.rs).
    let mut daemon = TestDaemon::start_with(None, &["--restart-policy", "none"], &[]).await;
    let state = daemon.state.path().to_owned();
    let run = daemon.create().await;
    let id = run.id.to_string();
    let short = daemon
        .create_with(CreateRunRequest {
            image: "base".into(),
            ttl_sec: Some(4),
            ..Default::default()
        })
        .await;
    let short_id = short.id.to_string();
    assert_eq!(daemon.sh(&id, "echo up").await.stdout, b"up\n");

    // Kill each run's PID 1 (the agent) from the host.
    for id in [&id, &short_id] {
        let pid = std::fs::read_to_string(state.join("runs").join(id).join("init.pid"))
            .expect("init.pid");
        let status = std::process::Command::new("kill")
            .args(["-KILL", pid.trim()])
            .status()
            .unwrap();
        assert!(status.success());
    }
    let mut failed = None;
    for _ in 0..100 {
        let run = daemon.client.get_run(&id).await.unwrap();
        if run.status == RunStatus::Failed {
            failed = Some(run);
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let failed =
        failed.unwrap_or_else(|| panic!("the run never failed\ndaemon log:\n{}", daemon.log()));
    let reason = failed.failure.expect("a failed run says why");
    assert!(reason.contains("exited"), "{reason}");

    // Exec, files and leases say the run failed, and why.
    let refusal = |err: ClientError| match err {
        ClientError::Api {
            status,
            code,
            message,
        } => {
            assert_eq!((status, code.as_str()), (409, "run_failed"), "{message}");
            assert!(message.contains("exited"), "{message}");
        }
        other => panic!("expected run_failed, got {other}"),
    };
    let exec = ExecRequest {
        cmd: vec!["true".into()],
        ..Default::default()
    };
    refusal(refused(daemon.client.exec(&id, &exec).await));
    refusal(refused(daemon.client.get_file(&id, "x").await));
    refusal(
        daemon
            .client
            .put_file(&id, "x", runbox_e2e::body(b"x".to_vec()))
            .await
            .unwrap_err(),
    );
    refusal(
        daemon
            .client
            .acquire_lease(&id, "alice", None)
            .await
            .unwrap_err(),
    );
    assert_eq!(
        daemon.client.list_runs().await.unwrap().runs.len(),
        2,
        "a failed run stays listed"
    );

    // It stays failed across a daemon restart.
    daemon.kill9();
    daemon.spawn().await;
    let after = daemon.client.get_run(&id).await.unwrap();
    assert_eq!(after.status, RunStatus::Failed);
    assert_eq!(after.failure.as_deref(), Some(reason.as_str()));

    // The short one is destroyed at its TTL; the other one on delete.
    let reaped = eventually(Duration::from_secs(20), || {
        !state.join("runs").join(&short_id).exists()
    })
    .await;
    assert!(
        reaped,
        "a failed run outlived its TTL\ndaemon log:\n{}",
        daemon.log()
    );
    daemon.client.delete_run(&id).await.unwrap();
    for id in [&id, &short_id] {
        assert!(!state.join("runs").join(id).exists());
        assert!(!netns_exists(id) && !cgroup_exists(id));
    }
    assert!(mounts_under(&state).is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn late_renewals_never_bring_a_deleted_run_back() {
    let mut daemon = TestDaemon::start(None).await;
    let id = daemon.create().await.id.to_string();
    // Renewals race the delete; each either lands before it or is refused.
    let renewals: Vec<_> = (0..16)
        .map(|_| {
            let client = daemon.client.clone();
            let id = id.clone();
            tokio::spawn(async move { client.renew_run(&id, 600).await })
        })
        .collect();
    daemon.client.delete_run(&id).await.unwrap();
    for renewal in renewals {
        if let Err(e) = renewal.await.unwrap() {
            assert!(matches!(e, ClientError::Api { status: 404, .. }), "{e}");
        }
    }
    let err = daemon.client.renew_run(&id, 600).await.unwrap_err();
    assert!(matches!(err, ClientError::Api { status: 404, .. }), "{err}");
    // Not in the store either: a restart does not find it.
    daemon.kill9();
    daemon.spawn().await;
    assert!(daemon.client.list_runs().await.unwrap().runs.is_empty());
    let err = daemon.client.get_run(&id).await.unwrap_err();
    assert!(matches!(err, ClientError::Api { status: 404, .. }), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn thirty_concurrent_creates_all_succeed_and_all_go() {
    let daemon = TestDaemon::start(None).await;
    let state = daemon.state.path().to_owned();
    let creates: Vec<_> = (0..30)
        .map(|_| {
            let client = daemon.client.clone();
            tokio::spawn(async move {
                client
                    .create_run(&CreateRunRequest {
                        image: "base".into(),
                        ..Default::default()
                    })
                    .await
            })
        })
        .collect();
    let mut ids = Vec::new();
    for create in creates {
        match create.await.unwrap() {
            Ok(run) => ids.push(run.id.to_string()),
            Err(e) => panic!(
                "a concurrent create failed: {e}\ndaemon log:\n{}",
                daemon.log()
            ),
        }
    }
    assert_eq!(daemon.client.list_runs().await.unwrap().runs.len(), 30);
    let deletes: Vec<_> = ids
        .iter()
        .map(|id| {
            let client = daemon.client.clone();
            let id = id.clone();
            tokio::spawn(async move { client.delete_run(&id).await })
        })
        .collect();
    for delete in deletes {
        delete.await.unwrap().unwrap();
    }
    assert!(run_dirs(&state).is_empty());
    assert!(mounts_under(&state).is_empty());
    for id in &ids {
        assert!(!netns_exists(id) && !cgroup_exists(id), "{id} left behind");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_create_retried_with_its_idempotency_key_makes_one_run() {
    let daemon = TestDaemon::start(None).await;
    let req = CreateRunRequest {
        image: "base".into(),
        ..Default::default()
    };
    // The answer is lost: the server made the run and wrote its 201, but
    // the client never read it. The retry gets that same run.
    let addr = daemon.url.trim_start_matches("http://").to_owned();
    let body = serde_json::to_string(&req).unwrap();
    {
        let mut stream = tokio::net::TcpStream::connect(&addr).await.unwrap();
        let head = format!(
            "POST /v1/runs HTTP/1.1\r\nHost: {addr}\r\nAuthorization: Bearer {}\r\nIdempotency-Key: lost-answer\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
            daemon.token,
            body.len()
        );
        stream.write_all(head.as_bytes()).await.unwrap();
        assert!(
            eventually(Duration::from_secs(20), || daemon_lists(&daemon) == 1).await,
            "the first attempt made no run"
        );
        // The answer is written (it waits in the socket): a run is listed
        // a moment before its answer goes out, and a client gone before
        // that is one the server destroys the run for.
        tokio::time::timeout(Duration::from_secs(20), stream.readable())
            .await
            .expect("the first attempt was answered")
            .unwrap();
        // Dropped unread.
    }
    let retried = daemon
        .client
        .create_run_with_key(&req, "lost-answer")
        .await
        .unwrap();
    let runs = daemon.client.list_runs().await.unwrap().runs;
    assert_eq!(runs.len(), 1, "{runs:?}");
    assert_eq!(runs[0].id, retried.id);

    // The same key with another request is refused and changes nothing.
    let other = CreateRunRequest {
        image: "base".into(),
        ttl_sec: Some(60),
        ..Default::default()
    };
    let err = refused(
        daemon
            .client
            .create_run_with_key(&other, "lost-answer")
            .await,
    );
    assert_eq!(
        err.code(),
        Some(runbox_types::ErrorCode::IdempotencyKeyReused),
        "{err}"
    );
    assert_eq!(daemon.client.list_runs().await.unwrap().runs.len(), 1);

    // Two attempts at once with one key: one run, both told about it.
    let (a, b) = tokio::join!(
        daemon.client.create_run_with_key(&req, "twice"),
        daemon.client.create_run_with_key(&req, "twice"),
    );
    let (a, b) = (a.unwrap(), b.unwrap());
    assert_eq!(a.id, b.id);
    assert_eq!(daemon.client.list_runs().await.unwrap().runs.len(), 2);

    // A first attempt that hung up early (its run is destroyed): the retry
    // makes the run, and exactly one is left.
    let _ = hang_up_with(
        &daemon,
        "POST",
        "/v1/runs",
        "Idempotency-Key: hung-up\r\n",
        &body,
        Duration::from_millis(15),
    )
    .await;
    let made = daemon
        .client
        .create_run_with_key(&req, "hung-up")
        .await
        .unwrap();
    assert!(
        eventually(Duration::from_secs(20), || daemon_lists(&daemon) == 3).await,
        "a hung-up attempt left a run behind"
    );
    let ids: Vec<_> = daemon
        .client
        .list_runs()
        .await
        .unwrap()
        .runs
        .into_iter()
        .map(|r| r.id)
        .collect();
    assert!(ids.contains(&made.id), "{ids:?}");

    // A key the API cannot carry is a 400.
    let err = refused(daemon.client.create_run_with_key(&req, "two words").await);
    assert_eq!(
        err.code(),
        Some(runbox_types::ErrorCode::BadRequest),
        "{err}"
    );
}

/// How many runs the daemon lists, asked from a blocking context.
fn daemon_lists(daemon: &TestDaemon) -> usize {
    let client = daemon.client.clone();
    std::thread::scope(|s| {
        s.spawn(|| {
            tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap()
                .block_on(client.list_runs())
                .map(|l| l.runs.len())
                .unwrap_or(usize::MAX)
        })
        .join()
        .unwrap()
    })
}
