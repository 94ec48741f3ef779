//! `runbox mcp` driven by a real MCP client session (rmcp's client), over
//! stdio and over streamable HTTP, against a real daemon.

use std::process::Stdio;

use rmcp::model::{CallToolRequestParams, CallToolResult};
use rmcp::service::RunningService;
use rmcp::transport::streamable_http_client::StreamableHttpClientTransportConfig;
use rmcp::transport::{StreamableHttpClientTransport, TokioChildProcess};
use rmcp::{RoleClient, ServiceExt};
use runbox_e2e::{runbox_bin, TestDaemon};
use serde_json::{json, Value};
use tokio::io::AsyncBufReadExt;
use tokio::process::Command;

type Session = RunningService<RoleClient, ()>;

async fn call(session: &Session, tool: &str, args: Value) -> CallToolResult {
    let Value::Object(args) = args else {
        panic!("arguments are an object")
    };
    session
        .call_tool(CallToolRequestParams::new(tool.to_owned()).with_arguments(args))
        .await
        .unwrap_or_else(|e| panic!("{tool}: {e}"))
}

fn text(result: &CallToolResult) -> String {
    result
        .content
        .iter()
        .filter_map(|c| c.as_text().map(|t| t.text.clone()))
        .collect()
}

/// A tool that worked, its answer parsed as JSON.
async fn ok(session: &Session, tool: &str, args: Value) -> Value {
    let result = call(session, tool, args).await;
    assert_ne!(result.is_error, Some(true), "{tool}: {}", text(&result));
    let body = text(&result);
    serde_json::from_str(&body).unwrap_or(Value::String(body))
}

/// A tool that refused, its message.
async fn refused(session: &Session, tool: &str, args: Value) -> String {
    let result = call(session, tool, args).await;
    assert_eq!(
        result.is_error,
        Some(true),
        "{tool} should fail: {}",
        text(&result)
    );
    text(&result)
}

fn mcp_command(daemon: &TestDaemon) -> Command {
    let mut cmd = Command::new(runbox_bin());
    cmd.arg("mcp")
        .env("RUNBOX_URL", &daemon.url)
        .env("RUNBOX_TOKEN", &daemon.token)
        .kill_on_drop(true);
    cmd
}

#[tokio::test]
async fn a_stdio_session_drives_runs_end_to_end() {
    let daemon = TestDaemon::start_with(None, &["--preview-listen", "127.0.0.1:0"], &[]).await;
    let transport = TokioChildProcess::new(mcp_command(&daemon)).expect("runbox mcp starts");
    let session = ().serve(transport).await.expect("the MCP session opens");

    let info = session.peer_info().expect("the server introduced itself");
    assert_eq!(
        info.server_info.as_ref().map(|s| s.name.as_str()),
        Some("runbox")
    );
    let mut tools: Vec<String> = session
        .list_all_tools()
        .await
        .unwrap()
        .into_iter()
        .map(|t| t.name.into_owned())
        .collect();
    tools.sort();
    assert_eq!(
        tools,
        [
            "build_image",
            "checkpoint_run",
            "create_run",
            "delete_run",
            "diff",
            "exec",
            "fork",
            "hibernate_run",
            "history",
            "list_files",
            "list_runs",
            "pause_run",
            "preview_url",
            "read_file",
            "resume_run",
            "snapshot",
            "start_process",
            "undo",
            "wake_run",
            "write_file"
        ]
    );
    // docs/mcp.md lists exactly these.
    let doc = std::fs::read_to_string(runbox_e2e::workspace_root().join("docs/mcp.md")).unwrap();
    let mut documented: Vec<String> = doc
        .lines()
        .filter_map(|l| l.strip_prefix("| `"))
        .filter_map(|l| l.split('`').next())
        .map(str::to_owned)
        .collect();
    documented.sort();
    assert_eq!(documented, tools, "docs/mcp.md's tool table");

    let run = ok(
        &session,
        "create_run",
        json!({"image": "base", "ttl_sec": 600}),
    )
    .await;
    let id = run["id"].as_str().expect("the run's id").to_owned();
    let listed = ok(&session, "list_runs", json!({})).await;
    assert!(listed.to_string().contains(&id));

    // exec: output and exit code; state persists; stdin; the timeout.
    let out = ok(
        &session,
        "exec",
        json!({"run": id, "command": "echo hi; echo oops >&2; exit 3"}),
    )
    .await;
    assert_eq!(out["exitCode"], 3);
    assert_eq!(out["stdout"], "hi\n");
    assert_eq!(out["stderr"], "oops\n");
    assert_eq!(out["timedOut"], false);
    let out = ok(
        &session,
        "exec",
        json!({"run": id, "command": "cat", "stdin": "fed"}),
    )
    .await;
    assert_eq!(out["stdout"], "fed");
    let out = ok(
        &session,
        "exec",
        json!({"run": id, "command": "sleep 30", "timeout_sec": 1}),
    )
    .await;
    assert_eq!(out["timedOut"], true);

    // Pause: shown as paused; the next exec resumes it.
    let paused = ok(&session, "pause_run", json!({"run": id})).await;
    assert_eq!(paused["status"], "paused");
    let out = ok(
        &session,
        "exec",
        json!({"run": id, "command": "echo awake"}),
    )
    .await;
    assert_eq!(out["stdout"], "awake\n");
    let resumed = ok(&session, "resume_run", json!({"run": id})).await;
    assert_eq!(resumed["status"], "running");
    // Hibernate and wake.
    let asleep = ok(&session, "hibernate_run", json!({"run": id})).await;
    assert_eq!(asleep["status"], "hibernated");
    let woken = ok(&session, "wake_run", json!({"run": id})).await;
    assert_eq!(woken["status"], "running");

    // Files.
    ok(
        &session,
        "write_file",
        json!({"run": id, "path": "src/a.txt", "content": "alpha\n"}),
    )
    .await;
    let read = call(
        &session,
        "read_file",
        json!({"run": id, "path": "src/a.txt"}),
    )
    .await;
    assert_eq!(text(&read), "alpha\n");
    let listing = ok(&session, "list_files", json!({"run": id, "depth": 2})).await;
    assert!(listing.to_string().contains("src/a.txt"), "{listing}");
    // Paths under /work written as runbox cp takes them: absolute too.
    let wrote = call(
        &session,
        "write_file",
        json!({"run": id, "path": "/work/src/b.txt", "content": "beta\n"}),
    )
    .await;
    assert_eq!(text(&wrote), "wrote 5 bytes to /work/src/b.txt");
    let read = call(
        &session,
        "read_file",
        json!({"run": id, "path": "/work/src/b.txt"}),
    )
    .await;
    assert_eq!(text(&read), "beta\n");
    let listing = ok(
        &session,
        "list_files",
        json!({"run": id, "path": "/work/src"}),
    )
    .await;
    assert!(listing.to_string().contains("src/b.txt"), "{listing}");
    // A checkpoint, and a run started from it.
    let checkpoint = ok(&session, "checkpoint_run", json!({"run": id})).await;
    let from = ok(
        &session,
        "create_run",
        json!({"checkpoint": checkpoint["id"]}),
    )
    .await;
    let out = ok(
        &session,
        "exec",
        json!({"run": from["id"], "command": "cat /work/src/a.txt"}),
    )
    .await;
    assert_eq!(out["stdout"], "alpha\n");
    ok(&session, "delete_run", json!({"run": from["id"]})).await;
    let out = ok(
        &session,
        "exec",
        json!({"run": id, "command": "cat /work/src/a.txt"}),
    )
    .await;
    assert_eq!(out["stdout"], "alpha\n");

    // A background process outlives its call.
    let proc = ok(
        &session,
        "start_process",
        json!({"run": id, "command": "sleep 300", "tag": "sleeper"}),
    )
    .await;
    assert!(proc["pid"].as_u64().is_some(), "{proc}");
    let ps = ok(&session, "exec", json!({"run": id, "command": "ps"})).await;
    assert!(ps["stdout"].as_str().unwrap().contains("sleep 300"), "{ps}");

    let preview = ok(
        &session,
        "preview_url",
        json!({"run": id, "port": 8080, "ttl_sec": 60}),
    )
    .await;
    assert!(preview.to_string().contains("/p/"), "{preview}");

    // Snapshot and fork carry the files.
    let snap = ok(&session, "snapshot", json!({"run": id, "name": "mcp-snap"})).await;
    assert!(snap.to_string().contains("mcp-snap"), "{snap}");
    let from_snap = ok(&session, "create_run", json!({"image": "mcp-snap"})).await;
    let snap_id = from_snap["id"].as_str().unwrap().to_owned();
    let forked = ok(&session, "fork", json!({"run": id, "count": 1})).await;
    let fork_id = forked["runs"][0]["id"].as_str().expect("a fork").to_owned();
    for child in [&snap_id, &fork_id] {
        let out = ok(
            &session,
            "exec",
            json!({"run": child, "command": "cat /work/src/a.txt"}),
        )
        .await;
        assert_eq!(out["stdout"], "alpha\n", "{child}");
    }

    // An image built from a Dockerfile and files given inline.
    let built = ok(
        &session,
        "build_image",
        json!({"name": "mcp-built", "dockerfile": "FROM base\nCOPY app/x.txt /x.txt\nRUN cat /x.txt\n",
               "files": {"app/x.txt": "inline\n"}}),
    )
    .await;
    assert_eq!(built["status"], "ready", "{built}");
    let from_built = ok(&session, "create_run", json!({"image": "mcp-built"})).await;
    let built_id = from_built["id"].as_str().unwrap().to_owned();
    let out = ok(
        &session,
        "exec",
        json!({"run": built_id, "command": "cat /x.txt"}),
    )
    .await;
    assert_eq!(out["stdout"], "inline\n");
    let failed = ok(
        &session,
        "build_image",
        json!({"name": "mcp-broken", "dockerfile": "FROM base\nRUN exit 9\n"}),
    )
    .await;
    assert_eq!(failed["status"], "failed", "{failed}");
    assert_eq!(failed["error"]["exitCode"], 9, "{failed}");
    let msg = refused(
        &session,
        "build_image",
        json!({"name": "mcp-x", "dockerfile": "FROM base\n", "files": {"../up": "x"}}),
    )
    .await;
    assert!(msg.starts_with("bad_request:"), "{msg}");

    // Bad input is a tool error naming runbox's code, never a crash.
    let msg = refused(
        &session,
        "exec",
        json!({"run": "01ARZ3NDEKTSV4RRFFQ69G5FAV", "command": "true"}),
    )
    .await;
    assert!(msg.contains("not_found"), "{msg}");
    // Every refusal reads `<code>: <message>`, the tool's own as the daemon's.
    let msg = refused(
        &session,
        "read_file",
        json!({"run": id, "path": "../etc/passwd"}),
    )
    .await;
    assert!(msg.starts_with("bad_path: "), "{msg}");
    let msg = refused(
        &session,
        "read_file",
        json!({"run": id, "path": "/etc/passwd"}),
    )
    .await;
    assert!(
        msg.starts_with("bad_path: ") && msg.contains("outside /work"),
        "{msg}"
    );
    let msg = refused(
        &session,
        "list_files",
        json!({"run": id, "path": "/workspace"}),
    )
    .await;
    assert!(msg.starts_with("bad_path: "), "{msg}");
    let msg = refused(&session, "create_run", json!({"network": "sideways"})).await;
    assert!(
        msg.starts_with("bad_request: ") && msg.contains("sideways"),
        "{msg}"
    );
    let msg = refused(&session, "create_run", json!({"image": "no-such-image"})).await;
    assert!(msg.starts_with("image_not_found: "), "{msg}");
    let msg = refused(
        &session,
        "read_file",
        json!({"run": id, "path": "nope.txt"}),
    )
    .await;
    assert!(msg.starts_with("file_not_found: "), "{msg}");
    let bad = session
        .call_tool(CallToolRequestParams::new("exec").with_arguments(serde_json::Map::new()))
        .await;
    assert!(
        bad.is_err() || bad.as_ref().unwrap().is_error == Some(true),
        "missing arguments are refused: {bad:?}"
    );

    for run in [&fork_id, &snap_id, &id] {
        ok(&session, "delete_run", json!({"run": run})).await;
    }
    let listed = ok(&session, "list_runs", json!({})).await;
    assert!(!listed.to_string().contains(&id));
    session.cancel().await.unwrap();
}

/// A string an answer holds (an id, a path).
fn string(value: &Value) -> String {
    value
        .as_str()
        .unwrap_or_else(|| panic!("not a string: {value}"))
        .to_owned()
}

/// The paths a `diff` answer lists, with how each changed.
fn changes(diff: &Value) -> Vec<(String, String)> {
    diff["changes"]
        .as_array()
        .unwrap_or_else(|| panic!("no changes: {diff}"))
        .iter()
        .map(|c| (string(&c["path"]), string(&c["change"])))
        .collect()
}

#[tokio::test]
async fn history_diff_and_undo_take_back_what_a_command_did() {
    let daemon = TestDaemon::start(None).await;
    let transport = TokioChildProcess::new(mcp_command(&daemon)).expect("runbox mcp starts");
    let session = ().serve(transport).await.expect("the MCP session opens");

    let run = ok(
        &session,
        "create_run",
        json!({"image": "base", "history": 10}),
    )
    .await;
    assert_eq!(run["history"]["keep"], 10, "{run}");
    let id = string(&run["id"]);
    // Nothing changed yet: nothing to diff or undo.
    let msg = refused(&session, "diff", json!({"run": id})).await;
    assert!(msg.starts_with("point_not_found: "), "{msg}");
    let msg = refused(&session, "undo", json!({"run": id})).await;
    assert!(msg.starts_with("point_not_found: "), "{msg}");

    // Commands that write leave points, named by exec; one that only reads
    // leaves none.
    let wrote = ok(
        &session,
        "exec",
        json!({"run": id, "command": "mkdir -p /work/src && echo one > /work/src/a.txt"}),
    )
    .await;
    let wrote = string(&wrote["point"]);
    let read = ok(
        &session,
        "exec",
        json!({"run": id, "command": "cat /work/src/a.txt"}),
    )
    .await;
    assert_eq!(read["stdout"], "one\n");
    assert_eq!(read["point"], Value::Null, "{read}");
    // The mistake.
    let broke = ok(
        &session,
        "exec",
        json!({"run": id, "command": "rm -rf /work/src"}),
    )
    .await;
    let broke = string(&broke["point"]);

    // history: newest first, each with what made it, down to the run as made.
    let history = ok(&session, "history", json!({"run": id})).await;
    let points = history["points"].as_array().expect("points");
    let kinds: Vec<&str> = points
        .iter()
        .map(|p| p["cause"]["kind"].as_str().unwrap())
        .collect();
    assert_eq!(kinds, ["exec", "exec", "create"], "{history}");
    assert_eq!(string(&points[0]["id"]), broke);
    assert_eq!(
        points[0]["cause"]["argv"],
        json!(["sh", "-c", "rm -rf /work/src"])
    );
    assert_eq!(string(&points[1]["id"]), wrote);
    assert_eq!(string(&history["head"]), broke);
    let created = string(&points[2]["id"]);

    // diff: the newest point by default; patches on request; against
    // another point.
    let diff = ok(&session, "diff", json!({"run": id})).await;
    assert_eq!(string(&diff["point"]), broke);
    assert_eq!(
        changes(&diff),
        [
            ("/work/src".to_owned(), "removed".to_owned()),
            ("/work/src/a.txt".to_owned(), "removed".to_owned())
        ]
    );
    let diff = ok(
        &session,
        "diff",
        json!({"run": id, "point": wrote, "patch": true}),
    )
    .await;
    assert_eq!(
        changes(&diff),
        [
            ("/work/src".to_owned(), "added".to_owned()),
            ("/work/src/a.txt".to_owned(), "added".to_owned())
        ]
    );
    let patch = diff["changes"][1]["patch"].as_str().expect("a text patch");
    assert!(patch.contains("+one"), "{patch}");
    let diff = ok(
        &session,
        "diff",
        json!({"run": id, "point": broke, "against": created}),
    )
    .await;
    assert_eq!(diff["changes"], json!([]), "{diff}");

    // undo: the files as they were before the last change, then before the
    // one before it.
    let undone = ok(&session, "undo", json!({"run": id})).await;
    assert_eq!(string(&undone["point"]), wrote, "{undone}");
    assert_eq!(string(&undone["undone"]["id"]), broke);
    assert_eq!(undone["run"]["status"], "running");
    let out = ok(
        &session,
        "exec",
        json!({"run": id, "command": "cat /work/src/a.txt"}),
    )
    .await;
    assert_eq!(out["stdout"], "one\n");
    let undone = ok(&session, "undo", json!({"run": id})).await;
    assert_eq!(string(&undone["point"]), created, "{undone}");
    assert_eq!(string(&undone["undone"]["id"]), wrote);
    let out = ok(
        &session,
        "exec",
        json!({"run": id, "command": "ls -A /work"}),
    )
    .await;
    assert_eq!(out["stdout"], "");
    let history = ok(&session, "history", json!({"run": id})).await;
    assert_eq!(string(&history["head"]), created);
    // Nothing before the run as made.
    let msg = refused(&session, "undo", json!({"run": id})).await;
    assert!(msg.starts_with("point_not_found: "), "{msg}");
    // The later points stayed: an undo is undone by naming one.
    let redone = ok(&session, "undo", json!({"run": id, "point": wrote})).await;
    assert_eq!(string(&redone["point"]), wrote);
    assert_eq!(redone["undone"], Value::Null);
    let out = ok(
        &session,
        "exec",
        json!({"run": id, "command": "cat /work/src/a.txt"}),
    )
    .await;
    assert_eq!(out["stdout"], "one\n");

    // A fork of a point: the files as they were then.
    let forked = ok(&session, "fork", json!({"run": id, "point": created})).await;
    let fork_id = string(&forked["runs"][0]["id"]);
    let out = ok(
        &session,
        "exec",
        json!({"run": fork_id, "command": "ls -A /work"}),
    )
    .await;
    assert_eq!(out["stdout"], "");

    // Refusals carry the code: a malformed point, an unknown one, a run
    // that keeps no history.
    let msg = refused(&session, "undo", json!({"run": id, "point": "nope"})).await;
    assert!(msg.starts_with("bad_request: "), "{msg}");
    let msg = refused(
        &session,
        "diff",
        json!({"run": id, "point": "01ARZ3NDEKTSV4RRFFQ69G5FAV"}),
    )
    .await;
    assert!(msg.starts_with("point_not_found: "), "{msg}");
    let msg = refused(
        &session,
        "fork",
        json!({"run": id, "point": "01ARZ3NDEKTSV4RRFFQ69G5FAV"}),
    )
    .await;
    assert!(msg.starts_with("point_not_found: "), "{msg}");
    let plain = ok(&session, "create_run", json!({})).await;
    let plain = string(&plain["id"]);
    let msg = refused(&session, "history", json!({"run": plain})).await;
    assert!(msg.starts_with("point_not_found: "), "{msg}");

    for run in [&fork_id, &plain, &id] {
        ok(&session, "delete_run", json!({"run": run})).await;
    }
    session.cancel().await.unwrap();
}

#[tokio::test]
async fn a_streamable_http_session_needs_the_token() {
    let daemon = TestDaemon::start(None).await;
    let mut child = mcp_command(&daemon)
        .args(["--http", "127.0.0.1:0"])
        .stderr(Stdio::piped())
        .spawn()
        .expect("runbox mcp --http starts");
    let mut lines = tokio::io::BufReader::new(child.stderr.take().unwrap()).lines();
    let url = loop {
        let line = lines
            .next_line()
            .await
            .unwrap()
            .expect("runbox mcp says where it listens");
        if let Some(rest) = line.split("streamable HTTP on ").nth(1) {
            break rest.trim().to_owned();
        }
    };

    // Without the token: 401 before any MCP is spoken.
    let anonymous = reqwest::Client::new()
        .post(&url)
        .header("content-type", "application/json")
        .header("accept", "application/json, text/event-stream")
        .body(r#"{"jsonrpc":"2.0","id":1,"method":"initialize","params":{}}"#)
        .send()
        .await
        .unwrap();
    assert_eq!(anonymous.status(), 401);

    let config = StreamableHttpClientTransportConfig::with_uri(url.clone())
        .auth_header(daemon.token.clone());
    let session =
        ().serve(StreamableHttpClientTransport::from_config(config))
            .await
            .expect("the MCP session opens over HTTP");
    let run = ok(&session, "create_run", json!({})).await;
    let id = run["id"].as_str().unwrap().to_owned();
    let out = ok(
        &session,
        "exec",
        json!({"run": id, "command": "echo over http"}),
    )
    .await;
    assert_eq!(out["stdout"], "over http\n");
    assert_eq!(out["exitCode"], 0);
    ok(&session, "delete_run", json!({"run": id})).await;
    session.cancel().await.unwrap();

    // Not on a public address unless asked.
    let out = mcp_command(&daemon)
        .args(["--http", "0.0.0.0:0"])
        .output()
        .await
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("--allow-non-loopback"));
    child.kill().await.ok();
}
