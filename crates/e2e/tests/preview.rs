//! Preview URLs and port forwarding, on the real runtime: a busybox httpd in
//! a `none` run reached through its preview URL (and only through it),
//! cookies for root-relative links, a page opened by headless Chromium,
//! an upgrade passing through, tampered and expired tokens refused, a gone
//! run, the audit log; a port-forward carrying bytes both ways, through
//! the client and the CLI.

use std::io::{Read as _, Write as _};
use std::time::Duration;

use runbox_e2e::{eventually_async, TestDaemon};
use runbox_types::{ErrorCode, ExecRequest};
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};

const PATIENCE: Duration = Duration::from_secs(30);

/// A port unlikely to be in use on the host, so "not reachable from the
/// host" means what it says.
const WEB_PORT: u16 = 18473;

const INDEX: &str =
    r#"<html><body><div id="out">static</div><script src="/app.js"></script></body></html>"#;
const APP: &str = "document.getElementById('out').textContent = 'script ran';";

/// The guest's upgrade echo: answers 101 to any request, then echoes.
const UPGRADE_SH: &str = "#!/bin/sh\n\
while read -r line; do line=$(printf '%s' \"$line\" | tr -d '\\r'); [ -z \"$line\" ] && break; done\n\
printf 'HTTP/1.1 101 Switching Protocols\\r\\nUpgrade: echo\\r\\nConnection: Upgrade\\r\\n\\r\\n'\n\
exec cat\n";

fn sh(script: &str) -> ExecRequest {
    ExecRequest {
        cmd: vec!["sh".into(), "-c".into(), script.into()],
        ..Default::default()
    }
}

async fn start_preview_daemon() -> TestDaemon {
    TestDaemon::start_with(None, &["--preview-listen", "127.0.0.1:0"], &[]).await
}

/// Starts the guest's servers: httpd on [`WEB_PORT`], the upgrade echo on
/// 9000, a plain echo on 9001.
async fn start_servers(daemon: &TestDaemon, id: &str) {
    let c = &daemon.client;
    c.put_file(id, "www/index.html", runbox_e2e::body(INDEX.into()))
        .await
        .unwrap();
    c.put_file(id, "www/app.js", runbox_e2e::body(APP.into()))
        .await
        .unwrap();
    c.put_file(id, "upgrade.sh", runbox_e2e::body(UPGRADE_SH.into()))
        .await
        .unwrap();
    daemon.sh(id, "chmod +x /work/upgrade.sh").await;
    for script in [
        format!("exec httpd -f -p {WEB_PORT} -h /work/www"),
        "exec nc -ll -p 9000 -e /work/upgrade.sh".to_owned(),
        "exec nc -ll -p 9001 -e /bin/cat".to_owned(),
    ] {
        c.start_process(id, &sh(&script)).await.unwrap();
    }
    let listening = eventually_async(PATIENCE, || async {
        let out = daemon.sh(id, "netstat -ltn 2>/dev/null").await;
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        [WEB_PORT, 9000, 9001]
            .iter()
            .all(|p| text.contains(&format!(":{p} ")))
    })
    .await;
    assert!(listening, "the guest servers did not start");
}

fn http() -> reqwest::Client {
    reqwest::Client::builder()
        .redirect(reqwest::redirect::Policy::none())
        .build()
        .unwrap()
}

fn error_code(body: &str) -> String {
    let value: serde_json::Value = serde_json::from_str(body).unwrap_or_default();
    value["error"]["code"].as_str().unwrap_or("").to_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_in_a_none_run_is_reachable_through_its_preview_url_only() {
    let daemon = start_preview_daemon().await;
    let run = daemon.create().await;
    let id = run.id.to_string();
    assert_eq!(run.network, runbox_types::NetworkTier::None);
    start_servers(&daemon, &id).await;
    let c = &daemon.client;
    let preview = c.mint_preview(&id, WEB_PORT, Some(600)).await.unwrap();
    assert!(
        preview.url.ends_with(&format!("/p/{}/", preview.token)),
        "{}",
        preview.url
    );
    let base = preview.url.split("/p/").next().unwrap().to_owned();

    // The page, and the cookie that carries the token for root-relative
    // links.
    let response = http().get(&preview.url).send().await.unwrap();
    assert_eq!(response.status(), 200);
    let cookie = response
        .headers()
        .get("set-cookie")
        .expect("a cookie")
        .to_str()
        .unwrap()
        .to_owned();
    assert!(
        cookie.starts_with(&format!("runbox_preview={}", preview.token)),
        "{cookie}"
    );
    assert!(cookie.contains("HttpOnly"), "{cookie}");
    assert_eq!(response.text().await.unwrap(), INDEX);
    let script = http()
        .get(format!("{base}/app.js"))
        .header("cookie", format!("runbox_preview={}", preview.token))
        .send()
        .await
        .unwrap();
    assert_eq!(script.status(), 200);
    assert_eq!(script.text().await.unwrap(), APP);
    // Through the path too, and `/p/{token}` alone redirects to the slash.
    let script = http()
        .get(format!("{}app.js", preview.url))
        .send()
        .await
        .unwrap();
    assert_eq!(script.text().await.unwrap(), APP);
    let bare = http()
        .get(preview.url.trim_end_matches('/'))
        .send()
        .await
        .unwrap();
    assert_eq!(bare.status(), 308);
    assert!(bare.headers()["location"]
        .to_str()
        .unwrap()
        .ends_with(&format!("/p/{}/", preview.token)));

    // Not reachable any other way: the host has no route to the run, and
    // the port is not published.
    assert!(std::net::TcpStream::connect(("127.0.0.1", WEB_PORT)).is_err());

    // Refusals: no token, a tampered one, an expired one, a closed port.
    let response = http().get(format!("{base}/app.js")).send().await.unwrap();
    assert_eq!(response.status(), 403);
    assert_eq!(
        error_code(&response.text().await.unwrap()),
        "preview_denied"
    );
    let mut tampered = preview.token.clone().into_bytes();
    tampered[10] = if tampered[10] == b'A' { b'B' } else { b'A' };
    let tampered = String::from_utf8(tampered).unwrap();
    for token in [tampered.as_str(), "garbage", &"A".repeat(58)] {
        let response = http()
            .get(format!("{base}/p/{token}/"))
            .send()
            .await
            .unwrap();
        assert_eq!(response.status(), 403, "{token}");
        assert_eq!(
            error_code(&response.text().await.unwrap()),
            "preview_denied"
        );
    }
    let short = c.mint_preview(&id, WEB_PORT, Some(1)).await.unwrap();
    tokio::time::sleep(Duration::from_millis(2100)).await;
    let response = http().get(&short.url).send().await.unwrap();
    assert_eq!(response.status(), 403);
    assert_eq!(
        error_code(&response.text().await.unwrap()),
        "preview_expired"
    );
    let closed = c.mint_preview(&id, 9999, None).await.unwrap();
    let response = http().get(&closed.url).send().await.unwrap();
    assert_eq!(response.status(), 502);
    let text = response.text().await.unwrap();
    assert_eq!(error_code(&text), "port_unreachable");
    // Said as it is: the caller's situation, not the server's fault.
    assert!(
        text.contains(&format!(
            "nothing accepts connections on port 9999 in run {id}"
        )),
        "{text}"
    );
    let logged: Vec<String> = daemon
        .log()
        .lines()
        .filter(|l| l.contains("port_unreachable") && l.contains("ERROR"))
        .map(str::to_owned)
        .collect();
    assert!(
        logged.is_empty(),
        "logged as the server's error: {logged:?}"
    );
    for (port, ttl, code) in [
        (0u16, None, ErrorCode::BadPort),
        (80, Some(0), ErrorCode::BadTtl),
        (80, Some(10_000_000), ErrorCode::BadTtl),
    ] {
        let err = c.mint_preview(&id, port, ttl).await.unwrap_err();
        assert_eq!(err.code(), Some(code), "{port} {ttl:?}");
    }

    // An upgrade passes through: after the run's 101, bytes flow both ways.
    let upgrade = c.mint_preview(&id, 9000, None).await.unwrap();
    let addr = base.trim_start_matches("http://").to_owned();
    let token = upgrade.token.clone();
    let echoed = tokio::task::spawn_blocking(move || {
        let mut socket = std::net::TcpStream::connect(&addr).unwrap();
        socket.set_read_timeout(Some(PATIENCE)).unwrap();
        write!(
            socket,
            "GET /p/{token}/chat HTTP/1.1\r\nHost: {addr}\r\nConnection: Upgrade\r\nUpgrade: echo\r\n\r\n"
        )
        .unwrap();
        let mut head = Vec::new();
        let mut byte = [0u8; 1];
        while !head.ends_with(b"\r\n\r\n") {
            socket.read_exact(&mut byte).unwrap();
            head.push(byte[0]);
        }
        socket.write_all(b"ping through the preview\n").unwrap();
        let mut echo = [0u8; 25];
        socket.read_exact(&mut echo).unwrap();
        (String::from_utf8_lossy(&head).into_owned(), echo.to_vec())
    })
    .await
    .unwrap();
    assert!(echoed.0.starts_with("HTTP/1.1 101"), "{}", echoed.0);
    assert_eq!(echoed.1, b"ping through the preview\n");

    // Every access is audited, without the token. Records are appended
    // off the request path (the upgraded connection's once it closes), so
    // the last ones may land a moment after the answers.
    let path = daemon.state.path().join("audit.jsonl");
    let audited = |audit: &str| {
        let previews: Vec<&str> = audit
            .lines()
            .filter(|l| l.contains("\"preview\""))
            .collect();
        previews.len() >= 6 && previews.iter().any(|l| l.contains("\"status\":101"))
    };
    runbox_e2e::eventually(Duration::from_secs(5), || {
        audited(&std::fs::read_to_string(&path).unwrap_or_default())
    })
    .await;
    let audit = std::fs::read_to_string(&path).unwrap();
    let previews: Vec<&str> = audit
        .lines()
        .filter(|l| l.contains("\"preview\""))
        .collect();
    assert!(previews.len() >= 6, "{audit}");
    assert!(
        !audit.contains(&preview.token),
        "the token reached the audit log"
    );
    assert!(
        previews.iter().any(|l| l.contains("\"status\":101")),
        "{audit}"
    );
    assert!(previews
        .iter()
        .any(|l| l.contains(&format!("\"port\":{WEB_PORT}"))));

    // A run that is gone is 404.
    c.delete_run(&id).await.unwrap();
    let response = http().get(&preview.url).send().await.unwrap();
    assert_eq!(response.status(), 404);
    assert_eq!(error_code(&response.text().await.unwrap()), "run_not_found");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn headless_chromium_runs_a_page_through_a_preview_url() {
    let daemon = start_preview_daemon().await;
    let id = daemon.create().await.id.to_string();
    start_servers(&daemon, &id).await;
    let preview = daemon
        .client
        .mint_preview(&id, WEB_PORT, None)
        .await
        .unwrap();
    let profile = tempfile::tempdir().unwrap();
    let url = preview.url.clone();
    let out = tokio::task::spawn_blocking(move || {
        std::process::Command::new("chromium")
            .args([
                "--headless",
                "--no-sandbox",
                "--disable-gpu",
                "--no-first-run",
                "--disable-dev-shm-usage",
                &format!("--user-data-dir={}", profile.path().display()),
                "--virtual-time-budget=5000",
                "--dump-dom",
                &url,
            ])
            .output()
            .expect("chromium (scripts/deps --test installs it)")
    })
    .await
    .unwrap();
    let dom = String::from_utf8_lossy(&out.stdout);
    // The root-relative /app.js came through the cookie and ran.
    assert!(
        dom.contains("script ran"),
        "dom: {dom}\nstderr: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn port_forward_carries_bytes_both_ways() {
    let daemon = start_preview_daemon().await;
    let id = daemon.create().await.id.to_string();
    start_servers(&daemon, &id).await;
    let c = &daemon.client;

    // Through the client: 4 MiB out, the same 4 MiB back.
    let tunnel = c.connect_port(&id, 9001, None).await.unwrap();
    let (mut read, mut write) = tokio::io::split(tunnel);
    let payload: Vec<u8> = (0..4u32 << 20).map(|i| (i % 253) as u8).collect();
    let sent = payload.clone();
    let writer = tokio::spawn(async move {
        write.write_all(&sent).await.unwrap();
        write.flush().await.unwrap();
        write
    });
    let mut back = vec![0u8; payload.len()];
    tokio::time::timeout(PATIENCE, read.read_exact(&mut back))
        .await
        .expect("echo stalled")
        .unwrap();
    assert!(back == payload, "the echo differs");
    drop(writer.await.unwrap());

    // Refusals before the upgrade.
    let err = c.connect_port(&id, 9999, None).await.unwrap_err();
    assert_eq!(err.code(), Some(ErrorCode::PortUnreachable));
    assert!(err.to_string().contains("port 9999"), "{err}");
    let err = c
        .connect_port(&ulid::Ulid::new().to_string(), 9001, None)
        .await
        .unwrap_err();
    assert_eq!(err.code(), Some(ErrorCode::RunNotFound));
    let lease = c.acquire_lease(&id, "alice", Some(60)).await.unwrap();
    let err = c.connect_port(&id, 9001, None).await.unwrap_err();
    assert_eq!(err.code(), Some(ErrorCode::Leased));
    let credential = runbox_client::LeaseCredential::from(&lease);
    drop(c.connect_port(&id, 9001, Some(&credential)).await.unwrap());
    c.release_lease(&id, &credential).await.unwrap();

    // Through the CLI: a local port that reaches the guest's echo.
    let mut child = std::process::Command::new(runbox_e2e::runbox_bin())
        .args(["port-forward", &id, "127.0.0.1:0:9001"])
        .env("RUNBOX_URL", &daemon.url)
        .env("RUNBOX_TOKEN", &daemon.token)
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut stderr = std::io::BufReader::new(child.stderr.take().unwrap());
    let mut line = String::new();
    while !line.starts_with("forwarding") {
        line.clear();
        let n = std::io::BufRead::read_line(&mut stderr, &mut line).unwrap();
        assert!(n > 0, "port-forward ended before it listened");
        eprintln!("port-forward: {line}");
    }
    let local = line
        .split_whitespace()
        .nth(1)
        .unwrap_or_else(|| panic!("no address in {line:?}"))
        .to_owned();
    let result = tokio::task::spawn_blocking(move || {
        let mut socket = std::net::TcpStream::connect(&local).unwrap();
        socket.set_read_timeout(Some(PATIENCE)).unwrap();
        socket.write_all(b"hello through the forward\n").unwrap();
        let mut echo = [0u8; 26];
        socket.read_exact(&mut echo).map(|()| echo.to_vec())
    })
    .await
    .unwrap();
    let _ = child.kill();
    let _ = child.wait();
    assert_eq!(result.unwrap(), b"hello through the forward\n");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_preview_request_wakes_a_hibernated_run_and_its_url_stays_valid() {
    let daemon = start_preview_daemon().await;
    let id = daemon.create().await.id.to_string();
    start_servers(&daemon, &id).await;
    let c = &daemon.client;
    let preview = c.mint_preview(&id, WEB_PORT, Some(600)).await.unwrap();
    assert_eq!(http().get(&preview.url).send().await.unwrap().status(), 200);
    c.hibernate_run(&id).await.unwrap();
    // The request wakes the run; its servers were processes, which the
    // hibernation ended, so nothing listens yet.
    let response = http().get(&preview.url).send().await.unwrap();
    assert_eq!(
        c.get_run(&id).await.unwrap().status,
        runbox_types::RunStatus::Running
    );
    assert_eq!(response.status(), 502, "{:?}", response.text().await);
    // Started again, they answer through the same URL.
    start_servers(&daemon, &id).await;
    let response = http().get(&preview.url).send().await.unwrap();
    assert_eq!(response.status(), 200);
    assert_eq!(response.text().await.unwrap(), INDEX);
}
