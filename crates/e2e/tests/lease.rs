//! Writable leases against the real daemon: races, takeover safety, fencing
//! of stale holders, restarts, input rules and the CLI.

use std::time::Duration;

use runbox_client::types::{ErrorCode, ExecRequest};
use runbox_client::{ClientError, LeaseCredential, UploadBody};
use runbox_e2e::{body, raw_request, TestDaemon};

fn code<T: std::fmt::Debug>(result: Result<T, ClientError>) -> ErrorCode {
    match result {
        Ok(v) => panic!("expected an error, got {v:?}"),
        Err(e) => e
            .code()
            .unwrap_or_else(|| panic!("expected an API error, got {e}")),
    }
}

fn cred(owner: &str, generation: u64) -> LeaseCredential {
    LeaseCredential {
        owner: owner.to_owned(),
        generation,
    }
}

fn sh_as(script: &str, lease: Option<&LeaseCredential>) -> ExecRequest {
    ExecRequest {
        cmd: vec!["sh".into(), "-c".into(), script.into()],
        owner: lease.map(|l| l.owner.clone()),
        generation: lease.map(|l| l.generation),
        ..Default::default()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn racing_clients_get_exactly_one_lease() {
    let daemon = TestDaemon::start(None).await;
    let id = daemon.create().await.id.to_string();
    let attempts = (0..8).map(|i| {
        let client = daemon.client.clone();
        let id = id.clone();
        tokio::spawn(async move {
            client
                .acquire_lease(&id, &format!("owner-{i}"), Some(60))
                .await
        })
    });
    let results = futures::future::join_all(attempts).await;
    let mut granted = Vec::new();
    for result in results {
        match result.expect("task") {
            Ok(lease) => granted.push(lease),
            Err(e) => assert_eq!(e.code(), Some(ErrorCode::Leased), "{e}"),
        }
    }
    assert_eq!(granted.len(), 1, "granted: {granted:?}");
    assert_eq!(granted[0].generation, 1);
    let run = daemon.client.get_run(&id).await.unwrap();
    assert_eq!(run.lease.as_ref(), Some(&granted[0]));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lease_is_not_granted_under_an_exec_or_an_upload() {
    let daemon = TestDaemon::start(None).await;
    let id = daemon.create().await.id.to_string();

    // An exec in flight: the stream is open until the command ends.
    let running = daemon
        .client
        .exec(&id, &sh_as("sleep 2; echo done", None))
        .await
        .unwrap();
    assert_eq!(
        code(daemon.client.acquire_lease(&id, "human", None).await),
        ErrorCode::Busy
    );
    let out = running.collect_output().await.unwrap();
    assert_eq!(String::from_utf8_lossy(&out.stdout), "done\n");

    // An upload in flight: its body is still arriving.
    let (tx, rx) = futures::channel::mpsc::channel::<Result<bytes::Bytes, std::io::Error>>(1);
    let upload = {
        let client = daemon.client.clone();
        let id = id.clone();
        tokio::spawn(async move {
            client
                .put_file(&id, "slow.txt", UploadBody::from_stream(rx, None))
                .await
        })
    };
    let mut tx = tx;
    use futures::SinkExt as _;
    tx.send(Ok(bytes::Bytes::from_static(b"first half ")))
        .await
        .unwrap();
    // The daemon admits the upload before it hands it to the agent, and the
    // agent opens the file it fills (unnamed until it is complete) on the
    // upload's first message: once a process of the run holds such a file
    // open, the upload is in flight. Read from the host, through the run's
    // cgroup.
    let filling = |id: &str| {
        let procs = ["pids/runbox", "runbox"]
            .iter()
            .find_map(|dir| {
                std::fs::read_to_string(format!("/sys/fs/cgroup/{dir}/{id}/cgroup.procs")).ok()
            })
            .unwrap_or_default();
        procs.lines().any(|pid| {
            std::fs::read_dir(format!("/proc/{pid}/fd"))
                .into_iter()
                .flatten()
                .flatten()
                .filter_map(|fd| std::fs::read_link(fd.path()).ok())
                .any(|target| {
                    let target = target.to_string_lossy();
                    target.contains("/#") && target.ends_with("(deleted)")
                })
        })
    };
    let admitted = async {
        for _ in 0..200 {
            if filling(&id) {
                return true;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        false
    };
    assert!(admitted.await, "the upload never reached the agent");
    assert_eq!(
        code(daemon.client.acquire_lease(&id, "human", None).await),
        ErrorCode::Busy
    );
    tx.send(Ok(bytes::Bytes::from_static(b"second half")))
        .await
        .unwrap();
    drop(tx);
    upload.await.unwrap().unwrap();

    // Idle again: the grant goes through.
    let lease = daemon
        .client
        .acquire_lease(&id, "human", None)
        .await
        .unwrap();
    assert_eq!(lease.generation, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_the_holder_writes_and_reads_stay_open() {
    let daemon = TestDaemon::start(None).await;
    let id = daemon.create().await.id.to_string();
    daemon
        .client
        .put_file(&id, "before.txt", body(b"agent wrote this".to_vec()))
        .await
        .unwrap();
    let lease = daemon
        .client
        .acquire_lease(&id, "alice", Some(120))
        .await
        .unwrap();
    let alice = LeaseCredential::from(&lease);

    // Others: refused, whichever way they ask.
    let c = &daemon.client;
    assert_eq!(
        code(c.put_file(&id, "x", body(b"no".to_vec())).await),
        ErrorCode::Leased
    );
    assert_eq!(
        code(
            c.put_file_as(&id, "x", Some(&cred("bob", 1)), body(b"no".to_vec()))
                .await
        ),
        ErrorCode::Leased
    );
    assert_eq!(
        code(c.exec(&id, &sh_as("touch /work/x", None)).await),
        ErrorCode::Leased
    );
    assert_eq!(
        code(
            c.exec(&id, &sh_as("touch /work/x", Some(&cred("bob", 1))))
                .await
        ),
        ErrorCode::Leased
    );
    assert_eq!(
        code(c.acquire_lease(&id, "bob", None).await),
        ErrorCode::Leased
    );

    // The holder: passes.
    c.put_file_as(&id, "mine.txt", Some(&alice), body(b"alice".to_vec()))
        .await
        .unwrap();
    let out = c
        .exec(&id, &sh_as("cat /work/mine.txt; ls /work", Some(&alice)))
        .await
        .unwrap()
        .collect_output()
        .await
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.starts_with("alice"), "{text}");
    assert!(
        !text.lines().any(|l| l == "x"),
        "a refused write landed: {text}"
    );

    // Reads: open to everyone.
    let read = c.get_file(&id, "before.txt").await.unwrap();
    assert_eq!(&read.bytes().await.unwrap()[..], b"agent wrote this");
    let run = c.get_run(&id).await.unwrap();
    assert_eq!(run.lease.as_ref(), Some(&lease));
    let listed = c.list_runs().await.unwrap();
    assert_eq!(listed.runs[0].lease.as_ref(), Some(&lease));

    // Release: writes are open again, and the lease is gone from the run.
    c.release_lease(&id, &alice).await.unwrap();
    c.put_file(&id, "after.txt", body(b"agent again".to_vec()))
        .await
        .unwrap();
    assert_eq!(c.get_run(&id).await.unwrap().lease, None);
    assert_eq!(
        code(c.release_lease(&id, &alice).await),
        ErrorCode::NotLeased
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn expiry_then_regrant_fences_the_old_holder() {
    let daemon = TestDaemon::start(None).await;
    let c = &daemon.client;
    let id = daemon.create().await.id.to_string();
    let old = c.acquire_lease(&id, "alice", Some(1)).await.unwrap();
    let alice = LeaseCredential::from(&old);

    // Lazy expiry: nothing sweeps, but a lapsed lease is no longer shown and
    // no longer fences.
    let lapsed = runbox_e2e::eventually(Duration::from_secs(10), || {
        time::OffsetDateTime::now_utc() > old.expires_at
    })
    .await;
    assert!(lapsed);
    assert_eq!(c.get_run(&id).await.unwrap().lease, None);
    c.put_file(&id, "meanwhile.txt", body(b"anyone".to_vec()))
        .await
        .unwrap();
    // A lapsed lease cannot be revived by its holder.
    assert_eq!(
        code(c.renew_lease(&id, &alice, Some(60)).await),
        ErrorCode::LeaseExpired
    );

    let new = c.acquire_lease(&id, "bob", Some(60)).await.unwrap();
    assert_eq!(new.generation, old.generation + 1);
    assert_eq!(
        code(
            c.put_file_as(&id, "late.txt", Some(&alice), body(b"stale".to_vec()))
                .await
        ),
        ErrorCode::Superseded
    );
    assert_eq!(
        code(c.exec(&id, &sh_as("true", Some(&alice))).await),
        ErrorCode::Superseded
    );
    assert_eq!(
        code(c.renew_lease(&id, &alice, Some(60)).await),
        ErrorCode::Superseded
    );
    assert_eq!(
        code(c.release_lease(&id, &alice).await),
        ErrorCode::Superseded
    );
    // The new holder renews: same generation, later expiry.
    let bob = LeaseCredential::from(&new);
    let renewed = c.renew_lease(&id, &bob, Some(600)).await.unwrap();
    assert_eq!(renewed.generation, new.generation);
    assert!(renewed.expires_at > new.expires_at);
    // Re-acquire by the same holder bumps the generation and fences its own
    // older credential.
    let again = c.acquire_lease(&id, "bob", Some(60)).await.unwrap();
    assert_eq!(again.generation, new.generation + 1);
    assert_eq!(
        code(c.exec(&id, &sh_as("true", Some(&bob))).await),
        ErrorCode::Superseded
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restart_keeps_the_lease_and_its_generation() {
    let mut daemon = TestDaemon::start(None).await;
    let id = daemon.create().await.id.to_string();
    let lease = daemon
        .client
        .acquire_lease(&id, "alice", Some(600))
        .await
        .unwrap();
    daemon.kill9();
    daemon.spawn().await;
    let c = &daemon.client;
    let run = c.get_run(&id).await.unwrap();
    assert_eq!(run.lease.as_ref(), Some(&lease), "log:\n{}", daemon.log());
    assert_eq!(
        code(c.put_file(&id, "x", body(b"no".to_vec())).await),
        ErrorCode::Leased
    );
    let alice = LeaseCredential::from(&lease);
    c.put_file_as(&id, "ok.txt", Some(&alice), body(b"yes".to_vec()))
        .await
        .unwrap();
    c.release_lease(&id, &alice).await.unwrap();
    // Generations keep growing across the restart.
    let next = c.acquire_lease(&id, "bob", None).await.unwrap();
    assert_eq!(next.generation, lease.generation + 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_lease_input_is_a_400_with_a_code() {
    let daemon = TestDaemon::start(None).await;
    let id = daemon.create().await.id.to_string();
    let (url, token) = (&daemon.url, &daemon.token);
    let post = |path: String, body: String| async move {
        raw_request(url, "POST", &path, token, body.as_bytes()).await
    };
    let lease = format!("/v1/runs/{id}/lease");
    let long = "x".repeat(129);
    for (body, expected) in [
        (r#"{"owner":""}"#.to_owned(), "bad_owner"),
        (r#"{"owner":"   "}"#.to_owned(), "bad_owner"),
        (format!(r#"{{"owner":"{long}"}}"#), "bad_owner"),
        (r#"{"owner":"a\u0007b"}"#.to_owned(), "bad_owner"),
        (r#"{"owner":"al","ttlSec":0}"#.to_owned(), "bad_ttl"),
        (r#"{"owner":"al","ttlSec":86401}"#.to_owned(), "bad_ttl"),
        (r#"{"owner":"al","ttlSec":"ten"}"#.to_owned(), "bad_request"),
        (r#"{"ownr":"al"}"#.to_owned(), "bad_request"),
    ] {
        let (status, text) = post(lease.clone(), body.clone()).await;
        assert_eq!(status, 400, "{body}: {text}");
        assert!(text.contains(expected), "{body}: {text}");
    }
    for (path, body) in [
        (
            format!("{lease}/renew"),
            r#"{"owner":"al","generation":"1"}"#,
        ),
        (format!("{lease}/release"), r#"{"owner":"al"}"#),
        (
            format!("{lease}/release"),
            r#"{"owner":"al","generation":-1}"#,
        ),
        (
            format!("/v1/runs/{id}/exec"),
            r#"{"cmd":["true"],"owner":"al","generation":"one"}"#,
        ),
    ] {
        let (status, text) = post(path.clone(), body.to_owned()).await;
        assert_eq!(status, 400, "{path} {body}: {text}");
    }
    // An exec credential must come whole.
    let (status, text) = post(
        format!("/v1/runs/{id}/exec"),
        r#"{"cmd":["true"],"owner":"al"}"#.to_owned(),
    )
    .await;
    assert_eq!(status, 400, "{text}");
    assert!(text.contains("bad_generation"), "{text}");
    // File writes: the credential in the query string.
    for (query, expected) in [
        ("?owner=al&generation=abc", "bad_generation"),
        ("?owner=al&generation=%2B1", "bad_generation"),
        ("?owner=al&generation=-1", "bad_generation"),
        ("?owner=al", "bad_generation"),
        ("?generation=1", "bad_owner"),
        ("?owner=&generation=1", "bad_owner"),
        ("?owner=al&generation=1&generation=2", "bad_request"),
        ("?owner=al&generation=1&gen=2", "bad_request"),
    ] {
        let path = format!("/v1/runs/{id}/files/f.txt{query}");
        let (status, text) = raw_request(url, "PUT", &path, token, b"data").await;
        assert_eq!(status, 400, "{query}: {text}");
        assert!(text.contains(expected), "{query}: {text}");
    }
    // Mismatches are 409s, unknown runs 404s.
    let (status, text) = post(
        format!("{lease}/release"),
        r#"{"owner":"al","generation":1}"#.to_owned(),
    )
    .await;
    assert_eq!(status, 409, "{text}");
    assert!(text.contains("not_leased"), "{text}");
    let (status, _) = post(
        "/v1/runs/01JABCDEFGHJKMNPQRSTVWXYZ0/lease".to_owned(),
        r#"{"owner":"al"}"#.to_owned(),
    )
    .await;
    assert_eq!(status, 404);
    // Nothing above left a lease behind.
    assert_eq!(daemon.client.get_run(&id).await.unwrap().lease, None);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_cli_acquires_acts_under_and_releases_a_lease() {
    let daemon = TestDaemon::start(None).await;
    let id = daemon.create().await.id.to_string();
    let runbox = |args: &[&str], env: &[(&str, &str)]| {
        let mut cmd = std::process::Command::new(runbox_e2e::runbox_bin());
        cmd.args(args)
            .env("RUNBOX_URL", &daemon.url)
            .env("RUNBOX_TOKEN", &daemon.token)
            .env_remove("RUNBOX_LEASE_OWNER")
            .env_remove("RUNBOX_LEASE_GENERATION");
        for (k, v) in env {
            cmd.env(k, v);
        }
        cmd.output().expect("runbox")
    };
    let out = runbox(
        &["lease", "acquire", &id, "--owner", "alice", "--ttl", "300"],
        &[],
    );
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(text.contains("alice (generation 1)"), "{text}");
    assert!(
        text.contains("export RUNBOX_LEASE_OWNER=alice RUNBOX_LEASE_GENERATION=1"),
        "{text}"
    );

    // Without the credential: refused, and the message says why.
    let out = runbox(&["exec", &id, "true"], &[]);
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("leased to \"alice\""),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // With it, by flag and by environment.
    let out = runbox(
        &[
            "exec",
            &id,
            "--owner",
            "alice",
            "--generation",
            "1",
            "echo",
            "hi",
        ],
        &[],
    );
    assert!(out.status.success());
    assert_eq!(String::from_utf8_lossy(&out.stdout), "hi\n");
    let local = daemon.state.path().join("upload.txt");
    std::fs::write(&local, b"from the cli").unwrap();
    let env = [
        ("RUNBOX_LEASE_OWNER", "alice"),
        ("RUNBOX_LEASE_GENERATION", "1"),
    ];
    let dst = format!("{id}:up.txt");
    let out = runbox(&["cp", local.to_str().unwrap(), &dst], &env);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let out = runbox(&["cp", local.to_str().unwrap(), &dst], &[]);
    assert!(!out.status.success());

    let out = runbox(&["ls"], &[]);
    assert!(String::from_utf8_lossy(&out.stdout).contains("alice (gen 1)"));
    let out = runbox(&["lease", "renew", &id, "--ttl", "60"], &env);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let out = runbox(&["lease", "release", &id], &env);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let out = runbox(&["exec", &id, "true"], &[]);
    assert!(out.status.success());
}
