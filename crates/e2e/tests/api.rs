//! The API's contract at its edges: authentication, the error shape, input
//! validation, images, and the daemon's start-up refusals.

use runbox_e2e::{raw_request, TestDaemon};
use runbox_types::{CreateRunRequest, ErrorCode, ExecRequest, LimitsRequest};

fn error_code(body: &str) -> String {
    let v: serde_json::Value =
        serde_json::from_str(body).unwrap_or_else(|_| panic!("not JSON: {body}"));
    assert!(
        v["error"]["message"]
            .as_str()
            .is_some_and(|m| !m.is_empty()),
        "{body}"
    );
    v["error"]["code"].as_str().unwrap_or_default().to_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn authentication_and_error_shape() {
    let daemon = TestDaemon::start(None).await;
    // Health needs no token and names the server.
    let health = runbox_client::Client::anonymous(&daemon.url)
        .unwrap()
        .health()
        .await
        .expect("health");
    assert_eq!(health.status, "ok");
    assert!(!health.server.is_empty());
    // Everything else does.
    for token in ["", "wrong", &format!("{}x", daemon.token)] {
        let (status, body) = raw_request(&daemon.url, "GET", "/v1/runs", token, b"").await;
        assert_eq!(status, 401, "token {token:?}");
        assert_eq!(error_code(&body), "unauthorized");
    }
    let client = runbox_client::Client::new(&daemon.url, "wrong").unwrap();
    assert_eq!(client.list_runs().await.unwrap_err().status(), Some(401));
    // The token file is private.
    use std::os::unix::fs::PermissionsExt;
    let mode = std::fs::metadata(daemon.state.path().join("token"))
        .unwrap()
        .permissions()
        .mode();
    assert_eq!(mode & 0o777, 0o600);

    let cases: &[(&str, &str, &[u8], u16, &str)] = &[
        (
            "GET",
            "/v1/runs/01ARZ3NDEKTSV4RRFFQ69G5FAV",
            b"",
            404,
            "run_not_found",
        ),
        ("GET", "/v1/runs/not-a-ulid", b"", 404, "run_not_found"),
        (
            "DELETE",
            "/v1/runs/01ARZ3NDEKTSV4RRFFQ69G5FAV",
            b"",
            404,
            "run_not_found",
        ),
        ("POST", "/v1/runs", b"{not json", 400, "bad_request"),
        (
            "POST",
            "/v1/runs",
            br#"{"image":"base","imgae":"typo"}"#,
            400,
            "bad_request",
        ),
        (
            "POST",
            "/v1/runs",
            br#"{"image":"base","ttlSec":"soon"}"#,
            400,
            "bad_request",
        ),
        (
            "POST",
            "/v1/runs",
            br#"{"image":"base","ttlSec":0}"#,
            400,
            "bad_ttl",
        ),
        (
            "POST",
            "/v1/runs",
            br#"{"image":"base","limits":{"cpus":0}}"#,
            400,
            "bad_limits",
        ),
        (
            "POST",
            "/v1/runs",
            br#"{"image":"base","limits":{"memoryMb":99999999}}"#,
            400,
            "bad_limits",
        ),
        (
            "POST",
            "/v1/runs",
            br#"{"image":"base","limits":{"pids":1}}"#,
            400,
            "bad_limits",
        ),
        (
            "POST",
            "/v1/runs",
            br#"{"image":"base","network":"satellite"}"#,
            400,
            "bad_request",
        ),
        (
            "POST",
            "/v1/runs",
            br#"{"image":"base","network":"none","egressAllow":["x.org"]}"#,
            400,
            "bad_egress",
        ),
        (
            "POST",
            "/v1/runs",
            br#"{"image":"nope"}"#,
            404,
            "image_not_found",
        ),
        (
            "POST",
            "/v1/runs",
            br#"{"image":"../etc"}"#,
            400,
            "bad_image_name",
        ),
        // Path segments that are not UTF-8 get the JSON error shape on
        // every route that takes a name or a path.
        ("GET", "/v1/images/%FF", b"", 400, "bad_request"),
        ("DELETE", "/v1/images/%FF", b"", 400, "bad_request"),
        ("POST", "/v1/images/%FF%FE", b"", 400, "bad_request"),
        (
            "GET",
            "/v1/runs/01JABCDEFGHJKMNPQRSTVWXYZ0/files/%FF",
            b"",
            400,
            "bad_request",
        ),
        ("GET", "/v1/nowhere", b"", 404, "not_found"),
        ("PATCH", "/v1/runs", b"", 405, "method_not_allowed"),
    ];
    for (method, path, body, status, code) in cases {
        let (got, text) = raw_request(&daemon.url, method, path, &daemon.token, body).await;
        assert_eq!(
            (got, error_code(&text).as_str()),
            (*status, *code),
            "{method} {path} {}",
            String::from_utf8_lossy(body)
        );
    }
    // An oversized JSON body is a 413, not a parse error.
    let big = format!(
        r#"{{"image":"base","env":{{"A":"{}"}}}}"#,
        "x".repeat(2 << 20)
    );
    let (status, text) = raw_request(
        &daemon.url,
        "POST",
        "/v1/runs",
        &daemon.token,
        big.as_bytes(),
    )
    .await;
    assert_eq!((status, error_code(&text).as_str()), (413, "too_large"));
    // The auth scheme name is case-insensitive; the token is not.
    let (status, _) = runbox_e2e::raw_request_auth(
        &daemon.url,
        "GET",
        "/v1/runs",
        &format!("bearer {}", daemon.token),
    )
    .await;
    assert_eq!(status, 200);
    let (status, _) = runbox_e2e::raw_request_auth(
        &daemon.url,
        "GET",
        "/v1/runs",
        &format!("Bearer {}", daemon.token.to_uppercase()),
    )
    .await;
    assert_eq!(status, 401);
    // A JSON body without a content type gets the same shape.
    let (status, text) = runbox_e2e::raw_request_typed(
        &daemon.url,
        "POST",
        "/v1/runs",
        &daemon.token,
        br#"{"image":"base"}"#,
        None,
    )
    .await;
    assert_eq!((status, error_code(&text).as_str()), (400, "bad_request"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn run_and_exec_input_rules() {
    let daemon = TestDaemon::start(None).await;
    // TTLs above the maximum are capped, not refused.
    let run = daemon
        .create_with(CreateRunRequest {
            image: "base".into(),
            ttl_sec: Some(10 * 86400),
            ..Default::default()
        })
        .await;
    let ttl = run.expires_at - run.created_at;
    assert!(
        ttl <= time_24h() && ttl > time_24h() - std::time::Duration::from_secs(60),
        "{ttl:?}"
    );
    let id = run.id.to_string();
    let renewed = daemon.client.renew_run(&id, 10 * 86400).await.unwrap();
    assert!(renewed.expires_at - run.created_at <= time_24h() + std::time::Duration::from_secs(60));
    assert_eq!(
        daemon.client.renew_run(&id, 0).await.unwrap_err().code(),
        Some(ErrorCode::BadTtl)
    );
    // Limits are applied as asked.
    let small = daemon
        .create_with(CreateRunRequest {
            image: "base".into(),
            limits: Some(LimitsRequest {
                cpus: Some(0.5),
                memory_mb: Some(128),
                pids: Some(100),
                disk_mb: Some(64),
            }),
            ..Default::default()
        })
        .await;
    assert_eq!(
        (
            small.limits.cpus,
            small.limits.memory_mb,
            small.limits.pids,
            small.limits.disk_mb
        ),
        (0.5, 128, 100, Some(64))
    );

    let exec_err = |cmd: Vec<&str>, cwd: Option<&str>| {
        let req = ExecRequest {
            cmd: cmd.into_iter().map(str::to_owned).collect(),
            cwd: cwd.map(str::to_owned),
            ..Default::default()
        };
        let client = daemon.client.clone();
        let id = id.clone();
        async move { client.exec(&id, &req).await.unwrap_err().code() }
    };
    assert_eq!(exec_err(vec![], None).await, Some(ErrorCode::BadCommand));
    assert_eq!(
        exec_err(vec!["no-such-program"], None).await,
        Some(ErrorCode::CommandNotFound)
    );
    assert_eq!(
        exec_err(vec!["/etc/passwd"], None).await,
        Some(ErrorCode::CommandNotExecutable)
    );
    assert_eq!(
        exec_err(vec!["true"], Some("/no/such/dir")).await,
        Some(ErrorCode::BadCwd)
    );
    // One argument as long as the kernel takes works; one byte more is a
    // 400 that names the limit, not an agent failure.
    let longest = "x".repeat(runbox_core_limit());
    let req = ExecRequest {
        cmd: vec![
            "sh".into(),
            "-c".into(),
            "echo ${#1}".into(),
            "_".into(),
            longest.clone(),
        ],
        ..Default::default()
    };
    assert_eq!(
        daemon.exec(&id, req).await.stdout,
        format!("{}\n", longest.len()).as_bytes()
    );
    let req = ExecRequest {
        cmd: vec!["echo".into(), format!("{longest}x")],
        ..Default::default()
    };
    let err = daemon.client.exec(&id, &req).await.unwrap_err();
    assert_eq!(err.code(), Some(ErrorCode::BadCommand), "{err}");
    assert!(err.to_string().contains("131071"), "{err}");
    // The agent (PID 1) is not dumpable: commands cannot read its memory,
    // environment or descriptors, though they run as the same uid.
    let out = daemon
        .sh(
            &id,
            "for f in environ mem; do cat /proc/1/$f >/dev/null 2>&1 && echo $f-open || echo $f-denied; done; \
             readlink /proc/1/fd/0 >/dev/null 2>&1 && echo fd-open || echo fd-denied",
        )
        .await;
    assert_eq!(
        String::from_utf8_lossy(&out.stdout),
        "environ-denied\nmem-denied\nfd-denied\n"
    );
    // cwd relative to /work and absolute both work.
    daemon.sh(&id, "mkdir -p /work/sub").await;
    for (cwd, want) in [("sub", "/work/sub\n"), ("/tmp", "/tmp\n")] {
        let req = ExecRequest {
            cmd: vec!["pwd".into()],
            cwd: Some(cwd.into()),
            ..Default::default()
        };
        assert_eq!(daemon.exec(&id, req).await.stdout, want.as_bytes());
    }
    // timeoutSec 0 is refused rather than meaning "no timeout".
    let req = ExecRequest {
        cmd: vec!["true".into()],
        timeout_sec: Some(0),
        ..Default::default()
    };
    assert_eq!(
        daemon.client.exec(&id, &req).await.unwrap_err().code(),
        Some(ErrorCode::BadRequest)
    );
}

/// The longest single exec argument the API accepts (the kernel's
/// `MAX_ARG_STRLEN` less its NUL).
fn runbox_core_limit() -> usize {
    128 * 1024 - 1
}

fn time_24h() -> std::time::Duration {
    std::time::Duration::from_secs(86400)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn images_are_listed_protected_while_used_and_removed() {
    let daemon = TestDaemon::start(None).await;
    let images = daemon.client.list_images().await.unwrap();
    assert_eq!(
        images
            .images
            .iter()
            .map(|i| i.name.as_str())
            .collect::<Vec<_>>(),
        vec!["base"]
    );
    // Same name again: conflict.
    let err = daemon
        .client
        .import_image("base", runbox_e2e::body(runbox_e2e::busybox_tar()))
        .await
        .unwrap_err();
    assert_eq!(err.code(), Some(ErrorCode::ImageExists));
    // That refusal came before the body was read: the answer says the
    // connection ends, so no client reuses it for a request that would
    // then fail with a broken pipe. A refusal after reading the whole
    // body keeps the connection.
    let http = reqwest::Client::new();
    let refused = http
        .post(format!("{}/v1/images/base", daemon.url))
        .bearer_auth(&daemon.token)
        .body(runbox_e2e::busybox_tar())
        .send()
        .await
        .unwrap();
    assert_eq!(refused.status(), 409);
    assert_eq!(
        refused
            .headers()
            .get("connection")
            .map(|v| v.to_str().unwrap()),
        Some("close")
    );
    let read = http
        .post(format!("{}/v1/runs", daemon.url))
        .bearer_auth(&daemon.token)
        .header("content-type", "application/json")
        .body(r#"{"image": 7}"#)
        .send()
        .await
        .unwrap();
    assert_eq!(read.status(), 400);
    assert_eq!(read.headers().get("connection"), None);
    // A second image, a run from it, and the image is protected.
    daemon
        .client
        .import_image("second", runbox_e2e::body(runbox_e2e::busybox_tar()))
        .await
        .unwrap();
    let run = daemon
        .create_with(CreateRunRequest {
            image: "second".into(),
            ..Default::default()
        })
        .await;
    let err = daemon.client.delete_image("second").await.unwrap_err();
    assert_eq!(err.code(), Some(ErrorCode::ImageInUse));
    daemon.client.delete_run(&run.id.to_string()).await.unwrap();
    daemon
        .client
        .delete_image("second")
        .await
        .expect("delete unused image");
    assert_eq!(
        daemon
            .client
            .delete_image("second")
            .await
            .unwrap_err()
            .code(),
        Some(ErrorCode::ImageNotFound)
    );
    // Garbage is a clean 400 and leaves no image.
    let err = daemon
        .client
        .import_image("junk", runbox_e2e::body(vec![7u8; 4096]))
        .await
        .unwrap_err();
    assert_eq!(err.code(), Some(ErrorCode::BadArchive));
    assert_eq!(daemon.client.list_images().await.unwrap().images.len(), 1);
}

#[test]
fn the_daemon_refuses_unsafe_or_impossible_starts() {
    let state = tempfile::tempdir().unwrap();
    let serve = |extra: &[&str]| {
        std::process::Command::new(runbox_e2e::runbox_bin())
            .arg("serve")
            .arg("--state-dir")
            .arg(state.path())
            // No run store of its own, which a refused start would leave
            // mounted under a directory the test then deletes.
            .args(["--storage-gb", "0"])
            .args(extra)
            .output()
            .expect("runbox serve")
    };
    let agent = runbox_e2e::agent_bin();
    let agent = agent.to_str().unwrap();
    let out = serve(&["--listen", "0.0.0.0:0", "--agent", agent]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("--allow-non-loopback"));
    let out = serve(&[
        "--listen",
        "127.0.0.1:0",
        "--agent",
        agent,
        "--runtime",
        "no-such-runtime",
    ]);
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("no-such-runtime") && stderr.contains("apt-get install"),
        "{stderr}"
    );
    let out = serve(&["--listen", "127.0.0.1:0", "--agent", "/bin/sh"]);
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("static"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}
