//! Terminals and background processes, against the real agent binary: a
//! PTY's size and resize seen by `stty`, ^C reaching the foreground
//! process, background commands outliving their call, listed, attached
//! with replay, fed input, signalled, waited for, and kept after they ended.

mod common;

use std::time::Duration;

use common::*;
use runbox_agent_proto::pb::{
    exec_input, AttachTarget, ExecInput, ExecSignal, ListProcessesRequest, ProcessInfo, ProcessRef,
    PtySize, SendInputRequest, SignalProcessRequest, WaitProcessRequest,
};
use runbox_agent_proto::AgentClient;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::Streaming;

fn by_tag(tag: &str) -> Option<ProcessRef> {
    Some(ProcessRef {
        pid: 0,
        tag: tag.into(),
    })
}

fn by_pid(pid: u32) -> Option<ProcessRef> {
    Some(ProcessRef {
        pid,
        tag: String::new(),
    })
}

fn input(kind: exec_input::Kind) -> ExecInput {
    ExecInput { kind: Some(kind) }
}

/// Starts a call whose input stays open; returns the input side and the
/// output stream.
async fn open_exec(
    client: &mut AgentClient,
    start: runbox_agent_proto::pb::ExecStart,
) -> (
    mpsc::Sender<ExecInput>,
    Streaming<runbox_agent_proto::pb::ExecOutput>,
) {
    let (tx, rx) = mpsc::channel(16);
    tx.send(start_msg(start)).await.unwrap();
    let stream = client
        .exec(ReceiverStream::new(rx))
        .await
        .expect("exec call")
        .into_inner();
    (tx, stream)
}

/// Reads output until `needle` appeared in stdout; returns all stdout.
async fn read_until(
    stream: &mut Streaming<runbox_agent_proto::pb::ExecOutput>,
    needle: &str,
) -> String {
    let mut seen = Vec::new();
    loop {
        let message = tokio::time::timeout(PATIENCE, stream.message())
            .await
            .unwrap_or_else(|_| panic!("no {needle:?} in {:?}", String::from_utf8_lossy(&seen)))
            .expect("stream failed")
            .unwrap_or_else(|| {
                panic!(
                    "stream ended before {needle:?}: {:?}",
                    String::from_utf8_lossy(&seen)
                )
            });
        if let Some(runbox_agent_proto::pb::exec_output::Kind::Stdout(data)) = message.kind {
            seen.extend(data);
            let text = String::from_utf8_lossy(&seen).into_owned();
            if text.contains(needle) {
                return text;
            }
        }
    }
}

/// Starts a background command and returns its pid.
async fn start_background(
    client: &mut AgentClient,
    mut start: runbox_agent_proto::pb::ExecStart,
) -> u32 {
    start.detach = true;
    let out = {
        let stream = client
            .exec(tokio_stream::iter(vec![start_msg(start)]))
            .await
            .expect("exec call")
            .into_inner();
        collect_started(stream).await
    };
    out
}

/// A detached start answers `started` and ends.
async fn collect_started(mut stream: Streaming<runbox_agent_proto::pb::ExecOutput>) -> u32 {
    let first = tokio::time::timeout(PATIENCE, stream.message())
        .await
        .expect("no started")
        .expect("stream failed")
        .expect("stream ended");
    let pid = match first.kind {
        Some(runbox_agent_proto::pb::exec_output::Kind::Started(s)) => s.pid,
        other => panic!("expected started, got {other:?}"),
    };
    let rest = tokio::time::timeout(PATIENCE, stream.message())
        .await
        .expect("detached call did not end")
        .expect("stream failed");
    assert!(rest.is_none(), "detached call sent more: {rest:?}");
    pid
}

async fn list(client: &mut AgentClient) -> Vec<ProcessInfo> {
    client
        .list_processes(ListProcessesRequest {})
        .await
        .unwrap()
        .into_inner()
        .processes
}

async fn attach(
    client: &mut AgentClient,
    process: Option<ProcessRef>,
    replay: bool,
) -> (
    mpsc::Sender<ExecInput>,
    Streaming<runbox_agent_proto::pb::ExecOutput>,
) {
    let (tx, rx) = mpsc::channel(16);
    tx.send(input(exec_input::Kind::Attach(AttachTarget {
        process,
        replay,
    })))
    .await
    .unwrap();
    let stream = client
        .attach(ReceiverStream::new(rx))
        .await
        .expect("attach call")
        .into_inner();
    (tx, stream)
}

#[tokio::test]
async fn a_terminal_has_its_size_and_sees_resizes() {
    let mut agent = TestAgent::start().await;
    let mut request = sh("stty size; echo tty=$(tty); read line; stty size; echo got=$line");
    request.pty = Some(PtySize { rows: 31, cols: 97 });
    let (tx, mut stream) = open_exec(&mut agent.client, request).await;
    let text = read_until(&mut stream, "tty=").await;
    assert!(text.contains("31 97"), "{text:?}");
    assert!(text.contains("tty=/dev/pts/"), "{text:?}");
    tx.send(input(exec_input::Kind::Resize(PtySize {
        rows: 50,
        cols: 132,
    })))
    .await
    .unwrap();
    tx.send(input(exec_input::Kind::Stdin(b"hello\r".to_vec())))
        .await
        .unwrap();
    let out = collect_rest(stream).await;
    assert!(
        out.stdout_str().contains("50 132"),
        "{:?}",
        out.stdout_str()
    );
    // The terminal echoes what was typed, and turns \r into a line.
    assert!(
        out.stdout_str().contains("got=hello"),
        "{:?}",
        out.stdout_str()
    );
    assert_eq!(out.exit().exit_code, 0);
    assert!(out.stderr.is_empty(), "a terminal has one output stream");
}

#[tokio::test]
async fn send_input_resizes_a_background_terminal() {
    let mut agent = TestAgent::start().await;
    let mut request = sh("stty size; read line; stty size; echo got=$line");
    request.pty = Some(PtySize { rows: 24, cols: 80 });
    request.tag = "term".into();
    request.stdin = true;
    start_background(&mut agent.client, request).await;
    let (_atx, mut stream) = attach(&mut agent.client, by_tag("term"), true).await;
    assert!(read_until(&mut stream, "24 80").await.contains("24 80"));
    // One call: the size first, then the line that lets the script go on.
    agent
        .client
        .send_input(SendInputRequest {
            process: by_tag("term"),
            resize: Some(PtySize {
                rows: 40,
                cols: 120,
            }),
            data: b"go\r".to_vec(),
            close: false,
        })
        .await
        .unwrap();
    let out = collect_rest(stream).await;
    assert!(
        out.stdout_str().contains("40 120"),
        "{:?}",
        out.stdout_str()
    );
    assert!(
        out.stdout_str().contains("got=go"),
        "{:?}",
        out.stdout_str()
    );
}

/// The rest of a stream whose `started` was already read.
async fn collect_rest(stream: Streaming<runbox_agent_proto::pb::ExecOutput>) -> Outcome {
    let mut out = Outcome {
        started: Some(0),
        ..Default::default()
    };
    let mut stream = stream;
    while let Some(message) = tokio::time::timeout(PATIENCE, stream.message())
        .await
        .expect("output stalled")
        .expect("stream failed")
    {
        match message.kind.expect("empty message") {
            runbox_agent_proto::pb::exec_output::Kind::Stdout(d) => out.stdout.extend(d),
            runbox_agent_proto::pb::exec_output::Kind::Stderr(d) => out.stderr.extend(d),
            runbox_agent_proto::pb::exec_output::Kind::Exit(e) => out.exit = Some(e),
            runbox_agent_proto::pb::exec_output::Kind::Lost(l) => out.lost += l.chunks,
            other => panic!("unexpected {other:?}"),
        }
    }
    out
}

#[tokio::test]
async fn ctrl_c_reaches_the_foreground_process() {
    let mut agent = TestAgent::start().await;
    // The shell survives ^C (it traps it); its foreground `sleep` does not.
    let mut request = sh("trap 'echo trapped' INT; echo ready; sleep 30; echo after=$?");
    request.pty = Some(PtySize { rows: 24, cols: 80 });
    let (tx, mut stream) = open_exec(&mut agent.client, request).await;
    read_until(&mut stream, "ready").await;
    // ^C until the command ends: one that arrives before `sleep` started
    // is only trapped by the shell.
    let keys = tokio::spawn(async move {
        while tx
            .send(input(exec_input::Kind::Stdin(vec![0x03])))
            .await
            .is_ok()
        {
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
    });
    let out = collect_rest(stream).await;
    keys.abort();
    assert!(
        out.stdout_str().contains("after=130"),
        "{:?}",
        out.stdout_str()
    );
    assert_eq!(out.exit().exit_code, 0);
}

#[tokio::test]
async fn closing_a_terminal_input_sends_end_of_file() {
    let mut agent = TestAgent::start().await;
    let mut request = start(&["cat"]);
    request.pty = Some(PtySize { rows: 24, cols: 80 });
    let (tx, stream) = open_exec(&mut agent.client, request).await;
    tx.send(input(exec_input::Kind::Stdin(b"abc\n".to_vec())))
        .await
        .unwrap();
    tx.send(input(exec_input::Kind::CloseStdin(Default::default())))
        .await
        .unwrap();
    let out = collect(stream).await;
    assert_eq!(out.exit().exit_code, 0);
    assert!(out.stdout_str().contains("abc"), "{:?}", out.stdout_str());
}

#[tokio::test]
async fn a_background_process_outlives_its_call_and_is_kept_after_it_ended() {
    let mut agent = TestAgent::start().await;
    let mut request = sh("echo one; read x; echo got=$x; exit 7");
    request.tag = "job".into();
    request.stdin = true;
    let pid = start_background(&mut agent.client, request).await;

    let procs = list(&mut agent.client).await;
    let me = procs.iter().find(|p| p.pid == pid).expect("listed");
    assert!(me.running && me.detached && me.stdin_open, "{me:?}");
    assert_eq!(me.tag, "job");
    assert_eq!(me.argv[0], "sh");

    // A second process cannot take the tag while this one runs.
    let mut clash = sh("true");
    clash.tag = "job".into();
    clash.detach = true;
    let out = exec(&mut agent.client, clash).await;
    assert_eq!(
        out.error().kind,
        runbox_agent_proto::pb::ErrorKind::TagInUse as i32
    );

    // Attach by tag with replay: the earlier output comes first.
    let (_atx, mut stream) = attach(&mut agent.client, by_tag("job"), true).await;
    read_until(&mut stream, "one").await;
    agent
        .client
        .send_input(SendInputRequest {
            process: by_tag("job"),
            data: b"hi\n".to_vec(),
            close: true,
            ..Default::default()
        })
        .await
        .unwrap();
    let out = collect_rest(stream).await;
    assert!(
        out.stdout_str().contains("got=hi"),
        "{:?}",
        out.stdout_str()
    );
    assert_eq!(out.exit().exit_code, 7);

    // Waiting and listing after the end: the status is kept.
    let info = agent
        .client
        .wait_process(WaitProcessRequest {
            process: by_pid(pid),
            timeout_ms: 10_000,
        })
        .await
        .unwrap()
        .into_inner();
    assert!(!info.running);
    assert_eq!(info.exit.unwrap().exit_code, 7);
    assert!(info.ended_unix_ms >= info.started_unix_ms);
    let procs = list(&mut agent.client).await;
    assert!(procs.iter().any(|p| p.pid == pid && !p.running));

    // Attaching after the end replays the output and the exit.
    let (_atx, stream) = attach(&mut agent.client, by_pid(pid), true).await;
    let out = collect(stream).await;
    assert_eq!(out.stdout_str(), "one\ngot=hi\n");
    assert_eq!(out.exit().exit_code, 7);

    // The tag is free again.
    let mut again = sh("true");
    again.tag = "job".into();
    start_background(&mut agent.client, again).await;
}

#[tokio::test]
async fn signals_and_input_errors() {
    let mut agent = TestAgent::start().await;
    let mut request = start(&["sleep", "30"]);
    request.tag = "sleeper".into();
    let pid = start_background(&mut agent.client, request).await;
    // No stdin was asked for.
    let err = agent
        .client
        .send_input(SendInputRequest {
            process: by_pid(pid),
            data: b"x".to_vec(),
            close: false,
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(kind(&err), "stdin_closed");
    for bad in [0, -1, 65] {
        let err = agent
            .client
            .signal_process(SignalProcessRequest {
                process: by_pid(pid),
                signal: bad,
            })
            .await
            .unwrap_err();
        assert_eq!(kind(&err), "invalid", "{bad}");
    }
    agent
        .client
        .signal_process(SignalProcessRequest {
            process: by_tag("sleeper"),
            signal: libc::SIGTERM,
        })
        .await
        .unwrap();
    let info = agent
        .client
        .wait_process(WaitProcessRequest {
            process: by_pid(pid),
            timeout_ms: 10_000,
        })
        .await
        .unwrap()
        .into_inner();
    let exit = info.exit.expect("ended");
    assert_eq!((exit.exit_code, exit.signal), (143, libc::SIGTERM));
    // Signalling an ended process says so.
    let err = agent
        .client
        .signal_process(SignalProcessRequest {
            process: by_pid(pid),
            signal: libc::SIGTERM,
        })
        .await
        .unwrap_err();
    assert_eq!(kind(&err), "not_running");
    // Unknown processes and bad references.
    for process in [by_pid(999_999), by_tag("nobody")] {
        let err = agent
            .client
            .wait_process(WaitProcessRequest {
                process,
                timeout_ms: 0,
            })
            .await
            .unwrap_err();
        assert_eq!(kind(&err), "no_process");
    }
    let err = agent
        .client
        .wait_process(WaitProcessRequest {
            process: None,
            timeout_ms: 0,
        })
        .await
        .unwrap_err();
    assert_eq!(kind(&err), "invalid");
    for tag in ["123", "a b", ""] {
        let mut request = sh("true");
        request.tag = tag.into();
        request.detach = true;
        if tag.is_empty() {
            continue;
        }
        let out = exec(&mut agent.client, request).await;
        assert_eq!(
            out.error().kind,
            runbox_agent_proto::pb::ErrorKind::Invalid as i32,
            "{tag}"
        );
    }
}

#[tokio::test]
async fn a_foreground_process_is_listed_while_it_runs_and_attachable() {
    let mut agent = TestAgent::start().await;
    let (tx, mut stream) =
        open_exec(&mut agent.client, sh("echo first; sleep 1; echo second")).await;
    read_until(&mut stream, "first").await;
    let procs = list(&mut agent.client).await;
    let me = procs
        .iter()
        .find(|p| p.running && !p.detached)
        .expect("listed");
    // A second reader gets the replay, then the rest, while the starting
    // call still gets everything.
    let (_atx, watcher) = attach(&mut agent.client, by_pid(me.pid), true).await;
    let watched = collect(watcher).await;
    assert_eq!(watched.stdout_str(), "first\nsecond\n");
    let rest = collect_rest(stream).await;
    assert_eq!(rest.stdout_str(), "second\n");
    drop(tx);
    // Gone from the table once it ended.
    let procs = list(&mut agent.client).await;
    assert!(procs.iter().all(|p| p.pid != me.pid), "{procs:?}");
}

#[tokio::test]
async fn detaching_from_a_process_leaves_it_running() {
    let mut agent = TestAgent::start().await;
    let mut request = sh("i=0; while [ $i -lt 50 ]; do echo tick $i; i=$((i+1)); sleep 0.05; done");
    request.tag = "ticker".into();
    let pid = start_background(&mut agent.client, request).await;
    {
        let (_atx, mut stream) = attach(&mut agent.client, by_tag("ticker"), false).await;
        read_until(&mut stream, "tick").await;
        // Dropped here: the reader goes away.
    }
    let procs = list(&mut agent.client).await;
    assert!(procs.iter().any(|p| p.pid == pid && p.running));
    // A signal through an attached call's input reaches it.
    let (atx, stream) = attach(&mut agent.client, by_pid(pid), false).await;
    atx.send(input(exec_input::Kind::Signal(ExecSignal {
        signal: libc::SIGKILL,
    })))
    .await
    .unwrap();
    let out = collect(stream).await;
    assert_eq!(out.exit().signal, libc::SIGKILL);
}

#[tokio::test]
async fn a_slow_reader_skips_output_but_never_stalls_the_process() {
    let mut agent = TestAgent::start().await;
    let mut request = sh("head -c 200000000 /dev/zero; echo done >&2");
    request.tag = "flood".into();
    let pid = start_background(&mut agent.client, request).await;
    let (_atx, mut stream) = attach(&mut agent.client, by_pid(pid), false).await;
    // Read nothing for a while: the process must finish regardless.
    let info = agent
        .client
        .wait_process(WaitProcessRequest {
            process: by_pid(pid),
            timeout_ms: 60_000,
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(info.exit.expect("ended").exit_code, 0);
    let mut lost = 0;
    let mut exited = false;
    while let Some(message) = tokio::time::timeout(PATIENCE, stream.message())
        .await
        .expect("stalled")
        .expect("failed")
    {
        match message.kind.unwrap() {
            runbox_agent_proto::pb::exec_output::Kind::Lost(l) => lost += l.chunks,
            runbox_agent_proto::pb::exec_output::Kind::Exit(_) => exited = true,
            _ => {}
        }
    }
    assert!(lost > 0, "a reader that read nothing lost nothing?");
    assert!(exited);
}

#[tokio::test]
async fn cancelling_a_detached_start_does_not_kill_it() {
    let mut agent = TestAgent::start().await;
    let mut request = sh("sleep 0.5; echo survived");
    request.tag = "survivor".into();
    request.detach = true;
    let (tx, stream) = open_exec(&mut agent.client, request).await;
    drop(stream);
    drop(tx);
    tokio::time::sleep(Duration::from_millis(100)).await;
    let info = agent
        .client
        .wait_process(WaitProcessRequest {
            process: by_tag("survivor"),
            timeout_ms: 10_000,
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(info.exit.expect("ended").exit_code, 0);
    let (_atx, stream) = attach(&mut agent.client, by_tag("survivor"), true).await;
    assert_eq!(collect(stream).await.stdout_str(), "survived\n");
}
