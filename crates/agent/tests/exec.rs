//! Exec against a real agent: output relay, exit statuses, process-group
//! handling, stdin, and the precise errors for commands that cannot start.

mod common;

use std::os::unix::fs::PermissionsExt;
use std::time::Duration;

use common::*;
use runbox_agent_proto::pb::{
    exec_input, exec_output, CloseStdin, ErrorKind, ExecInput, ExecSignal, ExecStart,
};
use runbox_agent_proto::CHUNK_SIZE;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;

#[tokio::test]
async fn hello_reports_version_and_protocol() {
    let mut agent = TestAgent::start().await;
    let reply = agent
        .client
        .hello(runbox_agent_proto::pb::HelloRequest {})
        .await
        .unwrap()
        .into_inner();
    assert_eq!(reply.version, env!("CARGO_PKG_VERSION"));
    assert_eq!(reply.protocol, runbox_agent_proto::PROTOCOL);
}

#[tokio::test]
async fn stdout_and_stderr_are_separate() {
    let mut agent = TestAgent::start().await;
    let out = exec(&mut agent.client, sh("echo out; echo err >&2")).await;
    assert!(out.started.unwrap() > 1);
    assert_eq!(out.stdout, b"out\n");
    assert_eq!(out.stderr, b"err\n");
    let exit = out.exit();
    assert_eq!((exit.exit_code, exit.signal, exit.timed_out), (0, 0, false));
}

#[tokio::test]
async fn exit_code_is_reported() {
    let mut agent = TestAgent::start().await;
    let out = exec(&mut agent.client, sh("exit 3")).await;
    assert_eq!((out.exit().exit_code, out.exit().signal), (3, 0));
}

#[tokio::test]
async fn signal_death_is_128_plus_signal() {
    let mut agent = TestAgent::start().await;
    let out = exec(&mut agent.client, sh("kill -9 $$")).await;
    let exit = out.exit();
    assert_eq!(
        (exit.exit_code, exit.signal, exit.timed_out),
        (137, 9, false)
    );
}

#[tokio::test]
async fn large_output_arrives_whole_in_bounded_chunks() {
    let mut agent = TestAgent::start().await;
    let out = exec(&mut agent.client, sh("head -c 1000000 /dev/zero")).await;
    assert_eq!(out.exit().exit_code, 0);
    assert_eq!(out.stdout.len(), 1_000_000);
    assert!(out.stdout.iter().all(|b| *b == 0));
    assert!(out.max_chunk <= CHUNK_SIZE);
}

#[tokio::test]
async fn command_runs_in_its_own_process_group() {
    let mut agent = TestAgent::start().await;
    // Field 5 of /proc/self/stat is the process group, field 6 the session.
    let out = exec(
        &mut agent.client,
        sh("echo $$; cut -d' ' -f5,6 /proc/$$/stat"),
    )
    .await;
    let text = out.stdout_str();
    let mut lines = text.lines();
    let pid = lines.next().unwrap();
    assert_eq!(pid, out.started.unwrap().to_string());
    assert_eq!(lines.next().unwrap(), format!("{pid} {pid}"));
}

#[tokio::test]
async fn background_process_does_not_hold_the_call_open() {
    let mut agent = TestAgent::start().await;
    // The background sleep inherits stdout; the call must still end soon
    // after the shell exits, with the shell's output.
    let out = exec(&mut agent.client, sh("sleep 1000 & echo $!")).await;
    assert_eq!(out.exit().exit_code, 0);
    let background: u32 = out.stdout_str().trim().parse().unwrap();
    assert!(alive(background), "the background process should survive");
    // SAFETY: plain kill(2) of a pid this test started; no memory involved.
    unsafe {
        libc::kill(background as i32, libc::SIGKILL);
    }
    wait_reaped(background).await;
}

#[tokio::test]
async fn timeout_kills_the_whole_process_group() {
    let mut agent = TestAgent::start().await;
    let mut request = sh("sleep 1000 & echo $!; sleep 1000");
    request.timeout_ms = 300;
    let out = exec(&mut agent.client, request).await;
    let exit = out.exit();
    assert!(exit.timed_out);
    assert_eq!((exit.exit_code, exit.signal), (137, 9));
    let background: u32 = out.stdout_str().trim().parse().unwrap();
    // Killed with its group, then reaped by the agent as an orphan.
    wait_reaped(background).await;
}

#[tokio::test]
async fn cancelling_the_call_kills_the_process_group() {
    let mut agent = TestAgent::start().await;
    let (tx, rx) = mpsc::channel(4);
    tx.send(start_msg(sh("sleep 1000 & echo $!; sleep 1000")))
        .await
        .unwrap();
    let mut stream = agent
        .client
        .exec(ReceiverStream::new(rx))
        .await
        .unwrap()
        .into_inner();

    let mut leader = None;
    let mut stdout = Vec::new();
    while !stdout.ends_with(b"\n") {
        let message = tokio::time::timeout(PATIENCE, stream.message())
            .await
            .unwrap()
            .unwrap()
            .unwrap();
        match message.kind.unwrap() {
            exec_output::Kind::Started(started) => leader = Some(started.pid),
            exec_output::Kind::Stdout(data) => stdout.extend(data),
            other => panic!("unexpected {other:?}"),
        }
    }
    let leader = leader.unwrap();
    let background: u32 = String::from_utf8(stdout).unwrap().trim().parse().unwrap();
    assert!(alive(leader) && alive(background));

    // Cancel: drop the response stream and the request stream, as dropping
    // the call's future does.
    drop(stream);
    drop(tx);
    wait_reaped(leader).await;
    wait_reaped(background).await;
}

#[tokio::test]
async fn stdin_round_trip() {
    let mut agent = TestAgent::start().await;
    let (tx, rx) = mpsc::channel(4);
    let mut request = start(&["cat"]);
    request.stdin = true;
    tx.send(start_msg(request)).await.unwrap();
    let stream = agent
        .client
        .exec(ReceiverStream::new(rx))
        .await
        .unwrap()
        .into_inner();
    let collector = tokio::spawn(collect(stream));
    for part in [&b"hello "[..], b"world\n"] {
        tx.send(ExecInput {
            kind: Some(exec_input::Kind::Stdin(part.to_vec())),
        })
        .await
        .unwrap();
    }
    tx.send(ExecInput {
        kind: Some(exec_input::Kind::CloseStdin(CloseStdin {})),
    })
    .await
    .unwrap();
    let out = collector.await.unwrap();
    drop(tx);
    assert_eq!(out.stdout, b"hello world\n");
    assert_eq!(out.exit().exit_code, 0);
}

#[tokio::test]
async fn half_close_is_not_cancellation() {
    let mut agent = TestAgent::start().await;
    // The input ends right after start, yet the command finishes normally.
    let out = exec(&mut agent.client, sh("sleep 0.3; echo finished")).await;
    assert_eq!(out.stdout, b"finished\n");
    assert_eq!(out.exit().exit_code, 0);
}

#[tokio::test]
async fn without_stdin_flag_stdin_is_empty() {
    let mut agent = TestAgent::start().await;
    let out = exec(&mut agent.client, start(&["cat"])).await;
    assert_eq!(out.stdout, b"");
    assert_eq!(out.exit().exit_code, 0);
}

#[tokio::test]
async fn signal_input_reaches_the_group() {
    let mut agent = TestAgent::start().await;
    let (tx, rx) = mpsc::channel(4);
    tx.send(start_msg(sh("echo ready; sleep 1000")))
        .await
        .unwrap();
    let mut stream = agent
        .client
        .exec(ReceiverStream::new(rx))
        .await
        .unwrap()
        .into_inner();
    // Wait until the shell runs, then signal its group.
    loop {
        let message = stream.message().await.unwrap().unwrap();
        if let Some(exec_output::Kind::Stdout(_)) = message.kind {
            break;
        }
    }
    tx.send(ExecInput {
        kind: Some(exec_input::Kind::Signal(ExecSignal {
            signal: libc::SIGTERM,
        })),
    })
    .await
    .unwrap();
    let out = collect_rest(stream).await;
    assert_eq!(
        (out.exit_code, out.signal),
        (128 + libc::SIGTERM, libc::SIGTERM)
    );
    drop(tx);
}

async fn collect_rest(
    mut stream: tonic::Streaming<runbox_agent_proto::pb::ExecOutput>,
) -> runbox_agent_proto::pb::ExecExit {
    loop {
        let message = tokio::time::timeout(PATIENCE, stream.message())
            .await
            .unwrap()
            .unwrap()
            .expect("stream ended without exit");
        if let Some(exec_output::Kind::Exit(exit)) = message.kind {
            return exit;
        }
    }
}

#[tokio::test]
async fn env_is_passed_exactly() {
    let mut agent = TestAgent::start().await;
    let mut request = start(&["env"]);
    request.env = vec![
        env_var("A", "1"),
        env_var("B", "two words"),
        env_var("PATH", "/usr/bin:/bin"),
    ];
    let out = exec(&mut agent.client, request).await;
    let mut lines: Vec<String> = out.stdout_str().lines().map(String::from).collect();
    lines.sort();
    assert_eq!(lines, ["A=1", "B=two words", "PATH=/usr/bin:/bin"]);

    // Without PATH the agent adds the default one, and nothing else.
    let mut request = start(&["env"]);
    request.env = vec![env_var("FOO", "bar")];
    let out = exec(&mut agent.client, request).await;
    let mut lines: Vec<String> = out.stdout_str().lines().map(String::from).collect();
    lines.sort();
    assert_eq!(
        lines,
        [
            "FOO=bar",
            "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
        ]
    );
}

#[tokio::test]
async fn cwd_defaults_to_work_dir_and_resolves_relative() {
    let mut agent = TestAgent::start().await;
    std::fs::create_dir(agent.path("sub")).unwrap();
    let out = exec(&mut agent.client, start(&["pwd"])).await;
    assert_eq!(out.stdout_str().trim(), agent.work.to_str().unwrap());

    let mut request = start(&["pwd"]);
    request.cwd = "sub".into();
    let out = exec(&mut agent.client, request).await;
    assert_eq!(out.stdout_str().trim(), agent.path("sub").to_str().unwrap());

    let mut request = start(&["pwd"]);
    request.cwd = "/".into();
    let out = exec(&mut agent.client, request).await;
    assert_eq!(out.stdout_str().trim(), "/");
}

#[tokio::test]
async fn missing_command_is_not_found() {
    let mut agent = TestAgent::start().await;
    let out = exec(&mut agent.client, start(&["no-such-command-runbox"])).await;
    let error = out.error();
    assert_eq!(error.kind(), ErrorKind::NotFound);
    assert_eq!(error.message, "command not found: no-such-command-runbox");

    let out = exec(&mut agent.client, start(&["/no/such/program"])).await;
    assert_eq!(out.error().kind(), ErrorKind::NotFound);
}

#[tokio::test]
async fn non_executable_is_permission_denied() {
    let mut agent = TestAgent::start().await;
    let script = agent.path("script.sh");
    std::fs::write(&script, "#!/bin/sh\necho hi\n").unwrap();
    std::fs::set_permissions(&script, std::fs::Permissions::from_mode(0o644)).unwrap();

    // Found through PATH.
    let mut request = start(&["script.sh"]);
    request.env = vec![env_var("PATH", agent.work.to_str().unwrap())];
    let out = exec(&mut agent.client, request).await;
    let error = out.error();
    assert_eq!(error.kind(), ErrorKind::PermissionDenied);
    assert_eq!(error.message, "not executable: script.sh");

    // Named with a slash: exec itself refuses.
    let out = exec(&mut agent.client, start(&["./script.sh"])).await;
    assert_eq!(out.error().kind(), ErrorKind::PermissionDenied);

    // Once executable it runs.
    std::fs::set_permissions(&script, std::fs::Permissions::from_mode(0o755)).unwrap();
    let out = exec(&mut agent.client, start(&["./script.sh"])).await;
    assert_eq!(out.stdout, b"hi\n");
}

#[tokio::test]
async fn bad_cwd_is_reported() {
    let mut agent = TestAgent::start().await;
    std::fs::write(agent.path("file"), "").unwrap();
    for cwd in ["missing", "file", "/nonexistent-runbox"] {
        let mut request = start(&["pwd"]);
        request.cwd = cwd.into();
        let out = exec(&mut agent.client, request).await;
        assert_eq!(out.error().kind(), ErrorKind::BadCwd, "cwd {cwd}");
    }
}

#[tokio::test]
async fn malformed_requests_are_invalid() {
    let mut agent = TestAgent::start().await;
    let out = exec(&mut agent.client, ExecStart::default()).await;
    assert_eq!(out.error().kind(), ErrorKind::Invalid);
    let out = exec(&mut agent.client, start(&["echo", "a\0b"])).await;
    assert_eq!(out.error().kind(), ErrorKind::Invalid);
}

#[tokio::test]
async fn first_message_must_be_start() {
    let mut agent = TestAgent::start().await;
    let input = tokio_stream::iter(vec![ExecInput {
        kind: Some(exec_input::Kind::Stdin(b"x".to_vec())),
    }]);
    let status = agent.client.exec(input).await.unwrap_err();
    assert_eq!(status.code(), tonic::Code::InvalidArgument);

    // The agent still works afterwards.
    let out = exec(&mut agent.client, start(&["true"])).await;
    assert_eq!(out.exit().exit_code, 0);
}

#[tokio::test]
async fn many_commands_in_parallel_are_each_reaped_once() {
    let agent = TestAgent::start().await;
    let mut tasks = Vec::new();
    for i in 0..20 {
        let mut client = agent.client.clone();
        tasks.push(tokio::spawn(async move {
            exec(&mut client, sh(&format!("exit {i}"))).await
        }));
    }
    for (i, task) in tasks.into_iter().enumerate() {
        let out = task.await.unwrap();
        assert_eq!(out.exit().exit_code, i as i32);
    }
    tokio::time::sleep(Duration::from_millis(1)).await;
}

#[tokio::test]
async fn commands_run_as_the_user_asked_for() {
    let mut agent = TestAgent::start().await;
    // The host's /etc/passwd stands in for the run's here; `nobody` is in
    // every distribution's.
    let mut request = sh("echo $(id -u) $(id -g) $HOME");
    request.user = "nobody".into();
    request.env = vec![env_var("HOME", "/root"), env_var("PATH", "/usr/bin:/bin")];
    let out = exec(&mut agent.client, request).await;
    let stdout = out.stdout_str();
    assert!(stdout.starts_with("65534 "), "{stdout}");
    assert!(
        !stdout.trim_end().ends_with("/root"),
        "HOME follows the user: {stdout}"
    );
    let mut request = sh("echo $(id -u):$(id -g) $(id -G)");
    request.user = "4242:4343".into();
    let out = exec(&mut agent.client, request).await;
    assert_eq!(out.stdout_str(), "4242:4343 4343\n");
    let mut request = start(&["true"]);
    request.user = "no-such-user-here".into();
    let out = exec(&mut agent.client, request).await;
    assert_eq!(out.error().kind(), ErrorKind::BadUser);
    assert!(out.error().message.contains("no-such-user-here"));
}
