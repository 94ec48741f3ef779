//! Interactive sessions and background processes through the API, on the
//! real runtime: a terminal's size and resize seen by `stty` inside, ^C
//! reaching the foreground process, stdin streamed to `cat` and `sh`,
//! background processes that outlive their client (and the daemon), listed,
//! attached with replay, fed input, signalled, waited for, their status
//! kept; the lease fence on every write; refusals with stable codes.

use std::time::Duration;

use futures::StreamExt as _;
use runbox_client::{ExecEvent, ExecStream, LeaseCredential};
use runbox_e2e::{eventually_async, raw_request, TestDaemon};
use runbox_types::{ErrorCode, ExecRequest, ExitReason, PtySpec, SignalRequest, SignalSpec};

const PATIENCE: Duration = Duration::from_secs(30);

fn sh(script: &str) -> ExecRequest {
    ExecRequest {
        cmd: vec!["sh".into(), "-c".into(), script.into()],
        ..Default::default()
    }
}

/// Reads stdout until `needle` appears; returns everything read.
async fn read_until(events: &mut ExecStream, needle: &str) -> String {
    let mut seen = Vec::new();
    loop {
        let event = tokio::time::timeout(PATIENCE, events.next())
            .await
            .unwrap_or_else(|_| panic!("no {needle:?} in {:?}", String::from_utf8_lossy(&seen)))
            .expect("stream ended")
            .expect("stream failed");
        match event {
            ExecEvent::Stdout(chunk) | ExecEvent::Stderr(chunk) => {
                seen.extend_from_slice(&chunk);
                if String::from_utf8_lossy(&seen).contains(needle) {
                    return String::from_utf8_lossy(&seen).into_owned();
                }
            }
            ExecEvent::Exit(exit) => panic!(
                "exited ({exit:?}) before {needle:?}: {:?}",
                String::from_utf8_lossy(&seen)
            ),
            _ => {}
        }
    }
}

/// Reads the rest of a stream: all output, and the exit.
async fn finish(events: ExecStream) -> (String, runbox_types::ExitEvent) {
    let out = tokio::time::timeout(PATIENCE, events.collect_output())
        .await
        .expect("stream stalled")
        .expect("stream failed");
    (
        String::from_utf8_lossy(&[out.stdout, out.stderr].concat()).into_owned(),
        out.exit,
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_terminal_session_sees_its_size_resizes_and_ctrl_c() {
    let daemon = TestDaemon::start(None).await;
    let id = daemon.create().await.id.to_string();
    let mut req = sh(
        "stty size; echo term=$TERM; read line; stty size; echo got=$line; \
                      trap 'echo trapped' INT; echo ready; sleep 30; echo after=$?; exit 3",
    );
    req.pty = Some(PtySpec {
        rows: 33,
        cols: 101,
        term: None,
    });
    let session = daemon.client.exec_session(&id, &req).await.unwrap();
    assert!(session.pid > 1);
    let mut events = session.events;
    let text = read_until(&mut events, "term=xterm-256color").await;
    assert!(text.contains("33 101"), "{text:?}");
    session.writer.resize(40, 120).await.unwrap();
    session.writer.stdin(&b"hello\r"[..]).await.unwrap();
    let text = read_until(&mut events, "ready").await;
    assert!(text.contains("40 120"), "{text:?}");
    assert!(text.contains("got=hello"), "{text:?}");
    // ^C as a key: the terminal turns it into SIGINT for the foreground
    // `sleep`; the shell traps it and goes on. Sent until the session
    // ends, as one that arrives before `sleep` started is only trapped.
    let writer = session.writer.clone();
    let keys = tokio::spawn(async move {
        while writer.stdin(&b"\x03"[..]).await.is_ok() {
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
    });
    let (text, exit) = finish(events).await;
    drop(session.writer);
    keys.abort();
    assert!(text.contains("after=130"), "{text:?}");
    assert_eq!((exit.exit_code, exit.reason), (3, ExitReason::Exited));

    // TERM is the default for a terminal, and the request's when given.
    let out = daemon
        .exec(
            &id,
            ExecRequest {
                pty: Some(PtySpec {
                    rows: 5,
                    cols: 20,
                    term: Some("vt100".into()),
                }),
                ..sh("echo $TERM; tty")
            },
        )
        .await;
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains("vt100") && text.contains("/dev/pts/"),
        "{text:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stdin_streams_to_cat_and_sh() {
    let daemon = TestDaemon::start(None).await;
    let id = daemon.create().await.id.to_string();
    // A session without a terminal: bytes in, the same bytes out, then EOF.
    let session = daemon
        .client
        .exec_session(
            &id,
            &ExecRequest {
                cmd: vec!["cat".into()],
                ..Default::default()
            },
        )
        .await
        .unwrap();
    let payload: Vec<u8> = (0..200_000u32).map(|i| (i % 251) as u8).collect();
    for part in payload.chunks(50_000) {
        session.writer.stdin(part.to_vec()).await.unwrap();
    }
    session.writer.eof().await.unwrap();
    let out = tokio::time::timeout(PATIENCE, session.events.collect_output())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(out.stdout.len(), payload.len());
    assert!(out.stdout == payload, "cat changed the bytes");
    assert_eq!(out.exit.exit_code, 0);

    // sh reading its script from stdin.
    let session = daemon
        .client
        .exec_session(
            &id,
            &ExecRequest {
                cmd: vec!["sh".into()],
                ..Default::default()
            },
        )
        .await
        .unwrap();
    session
        .writer
        .stdin(&b"echo one\necho two >&2\nexit 4\n"[..])
        .await
        .unwrap();
    let out = session.events.collect_output().await.unwrap();
    assert_eq!(out.stdout, b"one\n");
    assert_eq!(out.stderr, b"two\n");
    assert_eq!(out.exit.exit_code, 4);

    // The SSE exec takes stdin as text.
    let out = daemon
        .exec(
            &id,
            ExecRequest {
                cmd: vec!["cat".into()],
                stdin: Some("piped text".into()),
                ..Default::default()
            },
        )
        .await;
    assert_eq!(out.stdout, b"piped text");

    // Dropping a session kills its command.
    let session = daemon
        .client
        .exec_session(&id, &sh("echo $$ > /tmp/pid; sleep 30"))
        .await
        .unwrap();
    let pid = session.pid;
    drop(session);
    let gone = eventually_async(PATIENCE, || {
        let daemon = &daemon;
        let id = id.clone();
        async move {
            let out = daemon
                .sh(&id, &format!("kill -0 {pid} 2>/dev/null; echo $?"))
                .await;
            out.stdout == b"1\n"
        }
    })
    .await;
    assert!(gone, "a dropped session left its command running");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn background_processes_outlive_clients_and_the_daemon() {
    let mut daemon = TestDaemon::start(None).await;
    let id = daemon.create().await.id.to_string();
    let c = daemon.client.clone();
    let started = c
        .start_process(
            &id,
            &ExecRequest {
                tag: Some("server".into()),
                open_stdin: true,
                ..sh("echo up; while read line; do echo got=$line; done; echo stdin-closed; sleep 30")
            },
        )
        .await
        .unwrap();
    assert!(started.running && started.background && started.stdin_open);
    assert_eq!(started.tag.as_deref(), Some("server"));
    assert_eq!(started.cmd[0], "sh");

    // Its output, replayed, over server-sent events; the reader goes away
    // and the process stays.
    let mut output = c.process_output(&id, "server", true).await.unwrap();
    read_until(&mut output, "up").await;
    drop(output);

    // The tag is taken while it runs.
    let err = c
        .start_process(
            &id,
            &ExecRequest {
                tag: Some("server".into()),
                ..sh("true")
            },
        )
        .await
        .unwrap_err();
    assert_eq!(err.code(), Some(ErrorCode::TagInUse));

    // A daemon restart does not touch it: the agent keeps the table.
    daemon.kill9();
    daemon.spawn().await;
    let c = daemon.client.clone();
    let listed = c.processes(&id).await.unwrap();
    let me = listed
        .processes
        .iter()
        .find(|p| p.pid == started.pid)
        .expect("listed after a restart");
    assert!(me.running);

    // Input by HTTP, then an interactive attach that sees the replay.
    c.send_stdin(&id, "server", &b"first\n"[..], false, None)
        .await
        .unwrap();
    let session = c.attach(&id, "server", true, None).await.unwrap();
    let mut events = session.events;
    let text = read_until(&mut events, "got=first").await;
    assert!(text.starts_with("up\n"), "replay comes first: {text:?}");
    session.writer.stdin(&b"second\n"[..]).await.unwrap();
    read_until(&mut events, "got=second").await;
    session.writer.eof().await.unwrap();
    read_until(&mut events, "stdin-closed").await;
    drop(events);
    drop(session.writer);
    let err = c
        .send_stdin(&id, "server", &b"late\n"[..], false, None)
        .await
        .unwrap_err();
    assert_eq!(err.code(), Some(ErrorCode::StdinClosed));

    // A signal ends it; the status is kept, and found by tag and pid.
    let signalled = c
        .signal_process(
            &id,
            "server",
            &SignalRequest {
                signal: SignalSpec::Name("TERM".into()),
                owner: None,
                generation: None,
            },
        )
        .await
        .unwrap();
    assert_eq!(signalled.pid, started.pid);
    let ended = c.wait_process(&id, "server", 20).await.unwrap();
    assert!(!ended.running, "{ended:?}");
    let exit = ended.exit.unwrap();
    assert_eq!((exit.exit_code, exit.signal), (143, Some(15)));
    assert!(ended.ended_at.is_some());
    let by_pid = c.process(&id, &started.pid.to_string()).await.unwrap();
    assert_eq!(by_pid.exit, ended.exit);
    let (text, exit) = finish(c.process_output(&id, "server", true).await.unwrap()).await;
    assert!(text.contains("got=second"), "{text:?}");
    assert_eq!(exit.signal, Some(15));
    let err = c
        .signal_process(
            &id,
            "server",
            &SignalRequest {
                signal: SignalSpec::Number(9),
                owner: None,
                generation: None,
            },
        )
        .await
        .unwrap_err();
    assert_eq!(err.code(), Some(ErrorCode::ProcessEnded));

    // A background process with a terminal and a timeout.
    let timed = c
        .start_process(
            &id,
            &ExecRequest {
                pty: Some(PtySpec {
                    rows: 10,
                    cols: 10,
                    term: None,
                }),
                timeout_sec: Some(1),
                ..sh("stty size; sleep 30")
            },
        )
        .await
        .unwrap();
    assert!(timed.pty);
    let ended = c
        .wait_process(&id, &timed.pid.to_string(), 20)
        .await
        .unwrap();
    assert!(ended.exit.unwrap().timed_out);

    // Unknown processes and hostile references.
    for (reference, code) in [
        ("999999", ErrorCode::ProcessNotFound),
        ("nobody-here", ErrorCode::ProcessNotFound),
        ("0", ErrorCode::BadProcess),
        ("123456789012", ErrorCode::BadProcess),
    ] {
        let err = c.process(&id, reference).await.unwrap_err();
        assert_eq!(err.code(), Some(code), "{reference}");
    }
    for uri in [
        format!("/v1/runs/{id}/processes/a%2Fb"),
        format!("/v1/runs/{id}/processes/%2E%2E"),
        format!("/v1/runs/{id}/processes/x%00"),
    ] {
        let (status, body) = raw_request(&daemon.url, "GET", &uri, &daemon.token, b"").await;
        assert!(status == 400 || status == 404, "{uri}: {status} {body}");
        assert!(body.contains("\"code\""), "{uri}: {body}");
    }
    for bad in [
        ExecRequest {
            tag: Some("12".into()),
            ..sh("true")
        },
        ExecRequest {
            pty: Some(PtySpec {
                rows: 0,
                cols: 80,
                term: None,
            }),
            ..sh("true")
        },
    ] {
        let err = c.start_process(&id, &bad).await.unwrap_err();
        assert_eq!(err.code(), Some(ErrorCode::BadProcess));
    }
    let err = c
        .exec(
            &id,
            &ExecRequest {
                tag: Some("fg".into()),
                ..sh("true")
            },
        )
        .await
        .unwrap_err();
    assert_eq!(err.code(), Some(ErrorCode::BadRequest));
    let err = c
        .start_process(
            &id,
            &ExecRequest {
                cmd: vec!["no-such-program".into()],
                ..Default::default()
            },
        )
        .await
        .unwrap_err();
    assert_eq!(err.code(), Some(ErrorCode::CommandNotFound));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn process_writes_are_fenced_by_the_lease() {
    let daemon = TestDaemon::start(None).await;
    let id = daemon.create().await.id.to_string();
    let c = &daemon.client;
    let process = c
        .start_process(
            &id,
            &ExecRequest {
                open_stdin: true,
                ..sh("cat")
            },
        )
        .await
        .unwrap();
    let pid = process.pid.to_string();
    let lease = c.acquire_lease(&id, "alice", Some(60)).await.unwrap();
    let credential = LeaseCredential::from(&lease);
    // Without the credential: refused.
    let err = c.start_process(&id, &sh("true")).await.unwrap_err();
    assert_eq!(err.code(), Some(ErrorCode::Leased));
    let err = c
        .send_stdin(&id, &pid, &b"x"[..], false, None)
        .await
        .unwrap_err();
    assert_eq!(err.code(), Some(ErrorCode::Leased));
    let signal = SignalRequest {
        signal: SignalSpec::Name("TERM".into()),
        owner: None,
        generation: None,
    };
    let err = c.signal_process(&id, &pid, &signal).await.unwrap_err();
    assert_eq!(err.code(), Some(ErrorCode::Leased));
    let err = c.attach(&id, &pid, true, None).await.unwrap_err();
    assert_eq!(err.code(), Some(ErrorCode::Leased));
    let err = c.exec_session(&id, &sh("true")).await.unwrap_err();
    assert_eq!(err.code(), Some(ErrorCode::Leased));
    // Reads are not fenced.
    assert!(c.process(&id, &pid).await.unwrap().running);
    drop(c.process_output(&id, &pid, true).await.unwrap());
    // With it: allowed.
    c.send_stdin(&id, &pid, &b"held\n"[..], true, Some(&credential))
        .await
        .unwrap();
    let session = c.attach(&id, &pid, true, Some(&credential)).await.unwrap();
    let (text, exit) = finish(session.events).await;
    assert_eq!(text, "held\n");
    assert_eq!(exit.exit_code, 0);
}

/// `runbox` with the daemon's address and token.
fn cli(daemon: &TestDaemon) -> std::process::Command {
    let mut cmd = std::process::Command::new(runbox_e2e::runbox_bin());
    cmd.env("RUNBOX_URL", &daemon.url)
        .env("RUNBOX_TOKEN", &daemon.token);
    cmd
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_cli_runs_terminals_and_manages_processes() {
    use std::io::Write as _;
    use std::process::Stdio;

    let daemon = TestDaemon::start(None).await;
    let id = daemon.create().await.id.to_string();
    let run = |args: &[&str]| {
        let out = cli(&daemon).args(args).output().expect("runbox");
        (
            out.status.code(),
            String::from_utf8_lossy(&out.stdout).into_owned(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    let (code, out, err) = run(&[
        "exec",
        "-d",
        "--tag",
        "job",
        &id,
        "--",
        "sh",
        "-c",
        "echo hi; sleep 30",
    ]);
    assert_eq!(code, Some(0), "{err}");
    let pid: u32 = out.trim().parse().expect("exec -d prints the pid");
    let (_, out, _) = run(&["ps", &id]);
    let line = out
        .lines()
        .find(|l| l.contains("job"))
        .unwrap_or_else(|| panic!("{out}"));
    assert!(
        line.contains(&pid.to_string()) && line.contains("running"),
        "{out}"
    );
    let (code, _, err) = run(&["kill", &id, "job", "-s", "INT"]);
    assert_eq!(code, Some(0), "{err}");
    let (code, _, err) = run(&["wait", &id, "job"]);
    assert_eq!(code, Some(130), "wait passes the status through: {err}");
    let (code, _, err) = run(&["kill", &id, "job", "-s", "NOPE"]);
    assert_eq!(code, Some(1));
    assert!(err.contains("not a signal"), "{err}");
    let (code, _, err) = run(&["attach", &id, "nothing-here"]);
    assert_eq!(code, Some(1));
    assert!(
        err.contains("process_not_found") || err.contains("no process"),
        "{err}"
    );

    // -i: the local stdin streams in.
    let mut child = cli(&daemon)
        .args(["exec", "-i", &id, "--", "sh", "-c", "cat; exit 6"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    child
        .stdin
        .take()
        .unwrap()
        .write_all(b"streamed\n")
        .unwrap();
    let out = child.wait_with_output().unwrap();
    assert_eq!(out.status.code(), Some(6));
    assert_eq!(out.stdout, b"streamed\n");

    // -it under a real terminal (script(1) makes one): its size reaches
    // the command, and the status comes back.
    let command = format!(
        "stty rows 21 cols 77; {} exec -it {id} -- sh -c 'stty size; exit 5'",
        runbox_e2e::runbox_bin().display()
    );
    let mut child = std::process::Command::new("script")
        .args(["-qec", &command, "/dev/null"])
        .env("RUNBOX_URL", &daemon.url)
        .env("RUNBOX_TOKEN", &daemon.token)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .expect("script(1), from bsdutils");
    // Keep the terminal's input open until the command is done.
    let input = child.stdin.take();
    let out = tokio::task::spawn_blocking(move || child.wait_with_output())
        .await
        .unwrap()
        .unwrap();
    drop(input);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("21 77"), "{text:?}");
    assert_eq!(out.status.code(), Some(5), "{text:?}");
}

/// Sends a WebSocket upgrade for `path` offering `protocols`; returns the
/// answer's head (status line and headers), lowercased.
async fn upgrade_head(daemon: &TestDaemon, path: &str, protocols: &str) -> String {
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    let addr = daemon.url.trim_start_matches("http://").to_owned();
    let mut tcp = tokio::net::TcpStream::connect(&addr).await.unwrap();
    let request = format!(
        "GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n\
         Sec-WebSocket-Version: 13\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n\
         Sec-WebSocket-Protocol: {protocols}\r\n\r\n"
    );
    tcp.write_all(request.as_bytes()).await.unwrap();
    let mut head = Vec::new();
    let mut byte = [0u8; 1];
    while !head.ends_with(b"\r\n\r\n") {
        let n = tokio::time::timeout(PATIENCE, tcp.read(&mut byte))
            .await
            .expect("no answer to the upgrade")
            .unwrap();
        assert_eq!(
            n,
            1,
            "closed mid-head: {:?}",
            String::from_utf8_lossy(&head)
        );
        head.push(byte[0]);
    }
    String::from_utf8_lossy(&head).to_ascii_lowercase()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn websocket_clients_without_headers_pass_the_token_as_a_subprotocol() {
    let daemon = TestDaemon::start(None).await;
    let run = daemon.create().await;
    let path = format!("/v1/runs/{}/exec/ws", run.id);
    let token = daemon.token.clone();

    // The server selects runbox.v1 and never echoes the token back.
    let head = upgrade_head(&daemon, &path, &format!("runbox.v1, runbox.bearer.{token}")).await;
    assert!(head.starts_with("http/1.1 101"), "{head}");
    assert!(
        head.contains("sec-websocket-protocol: runbox.v1\r\n"),
        "{head}"
    );
    assert!(!head.contains(&token), "{head}");

    // A wrong token is refused like a wrong header.
    let head = upgrade_head(&daemon, &path, "runbox.v1, runbox.bearer.0123").await;
    assert!(head.starts_with("http/1.1 401"), "{head}");

    // Outside an upgrade the subprotocol header carries no token.
    let status = {
        let response = reqwest::Client::new()
            .get(format!("{}/v1/runs", daemon.url))
            .header("Sec-WebSocket-Protocol", format!("runbox.bearer.{token}"))
            .send()
            .await
            .unwrap();
        response.status().as_u16()
    };
    assert_eq!(status, 401);
}
