//! The daemon as an operator runs it: logs journald understands,
//! readiness and stopping told to systemd, a graceful SIGTERM, and a unit
//! file systemd accepts.

use std::time::Duration;

use runbox_e2e::TestDaemon;

/// Every line of the daemon's log is a JSON object with its priority.
fn json_lines(log: &str) -> Vec<serde_json::Value> {
    log.lines()
        .map(|line| serde_json::from_str(line).unwrap_or_else(|e| panic!("not JSON ({e}): {line}")))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn logs_are_json_lines_with_a_syslog_priority() {
    let daemon = TestDaemon::start(None).await;
    let run = daemon.create().await;
    daemon.client.delete_run(&run.id.to_string()).await.unwrap();
    let lines = json_lines(&daemon.log());
    assert!(!lines.is_empty());
    for line in &lines {
        let priority = line["priority"].as_u64().expect("a priority");
        let level = line["level"].as_str().expect("a level");
        let want = match level {
            "ERROR" => 3,
            "WARN" => 4,
            "INFO" => 6,
            _ => 7,
        };
        assert_eq!(priority, want, "{line}");
        assert!(
            line["t"].is_string() && line["target"].is_string(),
            "{line}"
        );
    }
    let serving = lines
        .iter()
        .find(|l| l["message"] == "runbox is serving")
        .expect("the serving line");
    assert_eq!(serving["priority"], 6);
    assert!(serving["listen"].is_string());
    assert!(lines
        .iter()
        .any(|l| l["message"] == "run created" && l["run"] == run.id.to_string()));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bad_log_level_is_reported_and_the_daemon_serves() {
    let daemon = TestDaemon::start_with(None, &[], &[("RUNBOX_LOG", "info,=[")]).await;
    let log = daemon.log();
    let first = log.lines().next().unwrap_or_default();
    assert!(
        first.contains("RUNBOX_LOG") && first.contains("is not a log level"),
        "{log}"
    );
    // The rest is the default level's JSON lines.
    json_lines(&log.lines().skip(1).collect::<Vec<_>>().join("\n"));
    daemon.client.health().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn systemd_hears_ready_and_stopping_and_runs_outlive_a_sigterm() {
    let dir = tempfile::tempdir().unwrap();
    let socket_path = dir.path().join("notify.sock");
    let socket = std::os::unix::net::UnixDatagram::bind(&socket_path).unwrap();
    socket
        .set_read_timeout(Some(Duration::from_secs(30)))
        .unwrap();
    let path = socket_path.to_str().unwrap().to_owned();
    let mut daemon = TestDaemon::start_with(None, &[], &[("NOTIFY_SOCKET", &path)]).await;
    let mut buf = [0u8; 256];
    let n = socket.recv(&mut buf).expect("READY=1 within 30 s");
    assert_eq!(std::str::from_utf8(&buf[..n]).unwrap().trim(), "READY=1");
    // The runtime never sees the daemon's socket: a run's processes have
    // no NOTIFY_SOCKET, and no notify socket is mounted into it.
    let run = daemon.create().await;
    let id = run.id.to_string();
    let out = daemon
        .sh(
            &id,
            "env | grep -c NOTIFY_SOCKET; ls /run/notify 2>&1 | head -1",
        )
        .await;
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(text.starts_with("0\n"), "{text}");
    // SIGTERM: STOPPING=1, a clean exit, and the run lives on.
    let status = daemon.terminate().expect("the daemon was running");
    assert!(status.success(), "{status:?}; log:\n{}", daemon.log());
    let n = socket.recv(&mut buf).expect("STOPPING=1");
    assert_eq!(std::str::from_utf8(&buf[..n]).unwrap().trim(), "STOPPING=1");
    daemon.spawn().await;
    let out = daemon.sh(&id, "echo still here").await;
    assert_eq!(String::from_utf8_lossy(&out.stdout), "still here\n");
    daemon.client.delete_run(&id).await.unwrap();
}

#[test]
fn the_unit_file_passes_systemd_analyze_verify() {
    let unit =
        std::fs::read_to_string(runbox_e2e::workspace_root().join("packaging/runbox.service"))
            .unwrap();
    for needed in [
        "Type=notify",
        "KillMode=process",
        "Restart=on-failure",
        "ExecReload=/bin/kill -HUP $MAINPID",
    ] {
        assert!(unit.contains(needed), "the unit has {needed}");
    }
    // The config file's log_level governs the level (a reload changes it):
    // an environment variable in the unit would win over it for good.
    assert!(
        !unit
            .lines()
            .any(|l| l.starts_with("Environment=RUNBOX_LOG")
                || l.starts_with("Environment=RUST_LOG")),
        "the unit sets the log level in its environment"
    );
    // Verified against the binary these tests built, where it lies.
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("runbox.service");
    let binary = runbox_e2e::runbox_bin();
    std::fs::write(
        &path,
        unit.replace("/usr/local/bin/runbox", binary.to_str().unwrap()),
    )
    .unwrap();
    let out = std::process::Command::new("systemd-analyze")
        .arg("verify")
        .arg(&path)
        .output()
        .expect("systemd-analyze (scripts/deps --test installs systemd)");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success() && !stderr.contains("runbox.service"),
        "systemd-analyze verify: {stderr}"
    );
}

/// `POST /v1/config/reload` with the root token, expected to succeed.
async fn reload_config(daemon: &TestDaemon) -> runbox_types::ConfigReload {
    let resp = reqwest::Client::new()
        .post(format!("{}/v1/config/reload", daemon.url))
        .bearer_auth(&daemon.token)
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    resp.json().await.unwrap()
}

/// `runbox serve` with `args`, expected to refuse to start: its stderr.
fn refused_start(args: &[&str]) -> String {
    let state = tempfile::tempdir().unwrap();
    let out = std::process::Command::new(runbox_e2e::runbox_bin())
        .arg("serve")
        .arg("--state-dir")
        .arg(state.path())
        .arg("--listen")
        .arg("127.0.0.1:0")
        // No run store of its own: a start refused after making one would
        // leave it mounted under a directory the test then deletes.
        .args(["--storage-gb", "0"])
        .args(args)
        .output()
        .unwrap();
    assert!(!out.status.success(), "it started");
    String::from_utf8_lossy(&out.stderr).into_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_config_file_sets_every_flag_and_reloads_checked() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("config.toml");
    std::fs::write(&path, "max_runs = 1\nusage-max-mb = 8\n").unwrap();
    let config = path.to_str().unwrap().to_owned();
    let daemon = TestDaemon::start_with(None, &["--config", &config], &[]).await;
    let info = daemon.client.info().await.unwrap();
    assert_eq!(info.capacity.max, 1, "max_runs from the file");
    // A reload puts the live settings in force at once and reports the
    // rest as waiting for a restart.
    std::fs::write(
        &path,
        "max_runs = 2\nusage-max-mb = 9\nmax_ttl = 60\nlog_level = \"debug\"\n",
    )
    .unwrap();
    let report = reload_config(&daemon).await;
    assert_eq!(
        report.changed,
        ["log_level", "max_runs", "max_ttl", "usage_max_mb"]
    );
    assert_eq!(report.applied, ["log_level", "max_runs", "max_ttl"]);
    assert_eq!(report.restart_required, ["usage_max_mb"]);
    assert!(report.overridden.is_empty());
    assert_eq!(daemon.client.info().await.unwrap().capacity.max, 2);
    let run = daemon
        .create_with(runbox_types::CreateRunRequest {
            image: "base".into(),
            ttl_sec: Some(3600),
            ..Default::default()
        })
        .await;
    let lifetime = run.expires_at - run.created_at;
    assert!(
        lifetime <= time::Duration::seconds(61),
        "the new max_ttl bounds a create: {lifetime}"
    );
    daemon.client.delete_run(&run.id.to_string()).await.unwrap();
    let debug_lines = || {
        json_lines(&daemon.log())
            .iter()
            .filter(|l| l["level"] == "DEBUG")
            .count()
    };
    assert!(
        runbox_e2e::eventually(Duration::from_secs(5), || debug_lines() > 0).await,
        "log_level = debug is in force: {}",
        daemon.log()
    );
    // The same file again changes nothing, and what waits for a restart
    // is still reported as waiting.
    let again = reload_config(&daemon).await;
    assert_eq!(again.changed, ["usage_max_mb"]);
    assert!(again.applied.is_empty());
    // A bad file stops a start, naming the key and the file.
    for (text, want) in [
        ("max_rnus = 3", "unknown key `max_rnus`"),
        ("max_runs = \"lots\"", "key `max_runs`"),
        ("max_runs = ", "is not valid TOML"),
    ] {
        let bad = dir.path().join("bad.toml");
        std::fs::write(&bad, text).unwrap();
        let stderr = refused_start(&["--config", bad.to_str().unwrap()]);
        assert!(stderr.contains(want), "{text}: {stderr}");
        assert!(stderr.contains("bad.toml"), "{stderr}");
    }
    let missing = refused_start(&["--config", "/nonexistent/runbox.toml"]);
    assert!(missing.contains("/nonexistent/runbox.toml"), "{missing}");
    // A flag wins over the file.
    drop(daemon);
    std::fs::write(&path, "max_runs = 1\nusage-max-mb = 8\n").unwrap();
    let daemon = TestDaemon::start_with(None, &["--config", &config, "--max-runs", "3"], &[]).await;
    assert_eq!(daemon.client.info().await.unwrap().capacity.max, 3);
    // Reload: a bad file changes nothing and says why.
    std::fs::write(&path, "max_runs = \"x\"\n").unwrap();
    let reload = |token: String| {
        let url = daemon.url.clone();
        async move {
            reqwest::Client::new()
                .post(format!("{url}/v1/config/reload"))
                .bearer_auth(token)
                .send()
                .await
                .unwrap()
        }
    };
    let refused = reload(daemon.token.clone()).await;
    assert_eq!(refused.status(), 400);
    let body = refused.text().await.unwrap();
    assert!(
        body.contains("config_invalid") && body.contains("max_runs"),
        "{body}"
    );
    // A good one reports what changed; a key a flag sets stays the flag's.
    std::fs::write(&path, "max_runs = 5\nusage_max_mb = 8\n").unwrap();
    let report: runbox_types::ConfigReload =
        reload(daemon.token.clone()).await.json().await.unwrap();
    assert_eq!(report.changed, vec!["max_runs"]);
    assert_eq!(report.overridden, vec!["max_runs"]);
    assert!(report.applied.is_empty() && report.restart_required.is_empty());
    assert_eq!(daemon.client.info().await.unwrap().capacity.max, 3);
    // SIGHUP does the same, and both are audited.
    std::process::Command::new("kill")
        .args(["-HUP", &daemon.pid().to_string()])
        .status()
        .unwrap();
    let audit = daemon.state.path().join("audit.jsonl");
    let reloads = || {
        std::fs::read_to_string(&audit)
            .unwrap_or_default()
            .lines()
            .filter(|l| l.contains("\"configReload\""))
            .count()
    };
    assert!(
        runbox_e2e::eventually(Duration::from_secs(10), || reloads() >= 2).await,
        "{} reload records; log:\n{}",
        reloads(),
        daemon.log()
    );
    daemon.client.health().await.unwrap();
}

/// A scrape parsed with a Prometheus text parser: the value of `metric`
/// with `labels`, if the document has it.
fn sample(scrape: &prometheus_parse::Scrape, metric: &str, labels: &[(&str, &str)]) -> Option<f64> {
    scrape
        .samples
        .iter()
        .find(|s| s.metric == metric && labels.iter().all(|(k, v)| s.labels.get(k) == Some(*v)))
        .map(|s| match &s.value {
            prometheus_parse::Value::Counter(v)
            | prometheus_parse::Value::Gauge(v)
            | prometheus_parse::Value::Untyped(v) => *v,
            prometheus_parse::Value::Histogram(h) => h.last().map_or(0.0, |b| b.count),
            prometheus_parse::Value::Summary(_) => f64::NAN,
        })
}

async fn scrape(url: &str, token: Option<&str>) -> (u16, Option<prometheus_parse::Scrape>) {
    let mut request = reqwest::Client::new().get(format!("{url}/metrics"));
    if let Some(token) = token {
        request = request.bearer_auth(token);
    }
    let response = request.send().await.unwrap();
    let status = response.status().as_u16();
    let text = response.text().await.unwrap();
    let parsed = (status == 200)
        .then(|| prometheus_parse::Scrape::parse(text.lines().map(|l| Ok(l.to_owned()))).unwrap());
    (status, parsed)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_move_with_the_work_and_parse_as_prometheus_text() {
    let daemon = TestDaemon::start_with(None, &["--metrics-listen", "127.0.0.1:0"], &[]).await;
    let running = |s: &prometheus_parse::Scrape| sample(s, "runbox_runs", &[("phase", "running")]);
    let (_, before) = scrape(&daemon.url, Some(&daemon.token)).await;
    let before = before.unwrap();
    assert_eq!(running(&before), None);
    assert_eq!(
        sample(&before, "runbox_capacity_max_runs", &[]),
        Some(256.0)
    );
    let run = daemon.create().await;
    let (status, after) = scrape(&daemon.url, Some(&daemon.token)).await;
    assert_eq!(status, 200);
    let after = after.unwrap();
    assert_eq!(running(&after), Some(1.0));
    assert_eq!(sample(&after, "runbox_capacity_live_runs", &[]), Some(1.0));
    let creates = [("route", "/v1/runs"), ("method", "POST"), ("status", "201")];
    assert!(sample(&after, "runbox_api_requests_total", &creates).unwrap_or(0.0) >= 1.0);
    assert!(sample(
        &after,
        "runbox_api_request_duration_seconds",
        &[("route", "/v1/runs")]
    )
    .is_some());
    // The core's own timings: the create, an exec's start, a wake.
    let start = [("how", "cold"), ("outcome", "ok")];
    assert_eq!(sample(&after, "runbox_run_starts_total", &start), Some(1.0));
    assert_eq!(
        sample(
            &after,
            "runbox_run_start_duration_seconds",
            &[("how", "cold")]
        ),
        Some(1.0)
    );
    let id = run.id.to_string();
    assert_eq!(daemon.sh(&id, "echo hi").await.stdout, b"hi\n");
    daemon.client.hibernate_run(&id).await.unwrap();
    daemon.client.wake_run(&id).await.unwrap();
    let missing = daemon.client.get_run("01ARZ3NDEKTSV4RRFFQ69G5FAV").await;
    assert_eq!(missing.unwrap_err().status(), Some(404));
    let (_, worked) = scrape(&daemon.url, Some(&daemon.token)).await;
    let worked = worked.unwrap();
    let ok = [("outcome", "ok")];
    assert_eq!(sample(&worked, "runbox_execs_total", &ok), Some(1.0));
    assert_eq!(
        sample(&worked, "runbox_exec_start_duration_seconds", &[]),
        Some(1.0)
    );
    assert_eq!(sample(&worked, "runbox_run_wakes_total", &ok), Some(1.0));
    assert_eq!(
        sample(&worked, "runbox_run_wake_duration_seconds", &[]),
        Some(1.0)
    );
    assert_eq!(sample(&worked, "runbox_run_restarts_total", &[]), Some(0.0));
    // (The text parser does not take braces inside a label value, as
    // route patterns have, so this one is read as text.)
    let text = reqwest::Client::new()
        .get(format!("{}/metrics", daemon.url))
        .bearer_auth(&daemon.token)
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(
        text.lines()
            .any(|l| l
                == "runbox_api_errors_total{route=\"/v1/runs/{id}\",code=\"run_not_found\"} 1"),
        "{text}"
    );
    // Refusals are counted too, under the route they tried.
    let (status, _) = scrape(&daemon.url, Some("wrong")).await;
    assert_eq!(status, 401);
    let (_, later) = scrape(&daemon.url, Some(&daemon.token)).await;
    let refused = [("route", "/metrics"), ("status", "401")];
    assert_eq!(
        sample(&later.unwrap(), "runbox_api_requests_total", &refused),
        Some(1.0)
    );
    // The metrics listener needs no token.
    let addr = std::fs::read_to_string(daemon.state.path().join("metrics.addr")).unwrap();
    let (status, open) = scrape(&format!("http://{}", addr.trim()), None).await;
    assert_eq!(status, 200);
    assert_eq!(running(&open.unwrap()), Some(1.0));
    daemon.client.delete_run(&run.id.to_string()).await.unwrap();
    let (_, gone) = scrape(&daemon.url, Some(&daemon.token)).await;
    assert_eq!(running(&gone.unwrap()), None);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_and_usage_can_be_turned_off() {
    let daemon = TestDaemon::start_with(None, &["--no-metrics", "--no-usage"], &[]).await;
    let run = daemon.create().await;
    daemon.client.delete_run(&run.id.to_string()).await.unwrap();
    let (status, _) = scrape(&daemon.url, Some(&daemon.token)).await;
    assert_eq!(status, 404);
    assert!(!daemon.state.path().join("usage.jsonl").exists());
    // A scraper's listener without metrics is a contradiction.
    let stderr = refused_start(&["--no-metrics", "--metrics-listen", "127.0.0.1:0"]);
    assert!(stderr.contains("--metrics-listen"), "{stderr}");
}
