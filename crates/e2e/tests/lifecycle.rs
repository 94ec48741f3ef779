//! Create, exec with streamed output, files, renew, delete — against each
//! OCI runtime the host has.

use std::time::Duration;

use futures::StreamExt;
use runbox_client::ExecEvent;
use runbox_e2e::{cgroup_exists, mounts_under, netns_exists, runtimes, TestDaemon};
use runbox_types::{
    CreateRunRequest, Env, ExecRequest, ExitReason, LimitsRequest, NetworkTier, RunStatus,
};

async fn lifecycle(runtime: &str) {
    let daemon = TestDaemon::start(Some(runtime)).await;
    let run = daemon.create().await;
    assert_eq!(run.runtime, runtime);
    assert_eq!(run.status, RunStatus::Running);
    assert_eq!(run.network, NetworkTier::None);
    assert_eq!(
        (run.limits.cpus, run.limits.memory_mb, run.limits.pids),
        (1.0, 1024, 256)
    );
    assert!(!run.server.is_empty());
    let id = run.id.to_string();

    // Output streams as it happens: the first chunk arrives while the
    // command is still sleeping.
    let req = ExecRequest {
        cmd: vec![
            "sh".into(),
            "-c".into(),
            "echo first; sleep 2; echo second; echo err >&2; exit 3".into(),
        ],
        ..Default::default()
    };
    let mut stream = daemon.client.exec(&id, &req).await.expect("exec");
    let mut events = Vec::new();
    let started = std::time::Instant::now();
    let mut first_chunk_at = None;
    while let Some(event) = stream.next().await {
        let event = event.expect("event");
        if matches!(&event, ExecEvent::Stdout(b) if b.starts_with(b"first")) {
            first_chunk_at = Some(started.elapsed());
        }
        events.push(event);
    }
    assert!(
        matches!(events.first(), Some(ExecEvent::Started(_))),
        "{events:?}"
    );
    let Some(ExecEvent::Exit(exit)) = events.last() else {
        panic!("no exit event: {events:?}")
    };
    assert_eq!(exit.exit_code, 3);
    assert_eq!(exit.reason, ExitReason::Exited);
    assert!(!exit.timed_out);
    let total = started.elapsed();
    // Not a timing assertion on speed: only that "first" came before the
    // two-second sleep ended, which is what streaming means.
    assert!(
        first_chunk_at.expect("first chunk") + Duration::from_millis(1500) < total,
        "output was not streamed"
    );
    let stdout: Vec<u8> = events
        .iter()
        .filter_map(|e| match e {
            ExecEvent::Stdout(b) => Some(b.to_vec()),
            _ => None,
        })
        .flatten()
        .collect();
    let stderr: Vec<u8> = events
        .iter()
        .filter_map(|e| match e {
            ExecEvent::Stderr(b) => Some(b.to_vec()),
            _ => None,
        })
        .flatten()
        .collect();
    assert_eq!(stdout, b"first\nsecond\n");
    assert_eq!(stderr, b"err\n");

    // State persists between execs; /work is the default directory.
    let out = daemon.sh(&id, "pwd; echo kept > note.txt").await;
    assert_eq!(out.stdout, b"/work\n");
    let out = daemon.sh(&id, "cat /work/note.txt").await;
    assert_eq!(out.stdout, b"kept\n");

    // Binary-safe file round trip, with parents created.
    let data: Vec<u8> = (0..300_000u32).map(|i| (i * 7 % 256) as u8).collect();
    daemon
        .client
        .put_file(&id, "deep/dir/blob.bin", runbox_e2e::body(data.clone()))
        .await
        .expect("upload");
    let back = daemon
        .client
        .get_file(&id, "deep/dir/blob.bin")
        .await
        .expect("download");
    assert_eq!(back.content_length(), Some(data.len() as u64));
    assert_eq!(back.bytes().await.expect("body").to_vec(), data);
    let out = daemon.sh(&id, "wc -c < /work/deep/dir/blob.bin").await;
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "300000");

    // Renew moves the expiry.
    let renewed = daemon.client.renew_run(&id, 3600).await.expect("renew");
    assert!(renewed.expires_at > run.expires_at);

    // Listed while alive, gone after delete, nothing left behind.
    let list = daemon.client.list_runs().await.expect("list");
    assert!(list.runs.iter().any(|r| r.id == run.id));
    daemon.client.delete_run(&id).await.expect("delete");
    let err = daemon.client.get_run(&id).await.unwrap_err();
    assert_eq!(err.status(), Some(404));
    assert!(!netns_exists(&id));
    assert!(!cgroup_exists(&id));
    assert!(mounts_under(daemon.state.path()).is_empty());
    assert!(!daemon.state.path().join("runs").join(&id).exists());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lifecycle_on_every_runtime() {
    let runtimes = runtimes();
    assert!(!runtimes.is_empty(), "neither runc nor crun is installed");
    for runtime in runtimes {
        lifecycle(&runtime).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn run_and_exec_env_reach_the_command_but_not_argv() {
    let daemon = TestDaemon::start(None).await;
    let run = daemon
        .create_with(CreateRunRequest {
            image: "base".into(),
            env: Some(Env([
                ("RUN_SECRET".to_owned(), "run-value-42".to_owned()),
                ("SHARED".into(), "run".into()),
            ]
            .into())),
            ..Default::default()
        })
        .await;
    let id = run.id.to_string();
    let req = ExecRequest {
        cmd: vec![
            "sh".into(),
            "-c".into(),
            "echo $RUN_SECRET $SHARED $EXEC_ONLY; cat /proc/*/cmdline | tr '\\0' ' '".into(),
        ],
        env: Some(Env([
            ("SHARED".to_owned(), "exec".to_owned()),
            ("EXEC_ONLY".into(), "e-value-7".into()),
        ]
        .into())),
        ..Default::default()
    };
    let out = daemon.exec(&id, req).await;
    let text = String::from_utf8_lossy(&out.stdout);
    let mut lines = text.lines();
    assert_eq!(lines.next(), Some("run-value-42 exec e-value-7"));
    let argv_dump: String = lines.collect();
    assert!(
        !argv_dump.contains("run-value-42") && !argv_dump.contains("e-value-7"),
        "{argv_dump}"
    );
    // Not in the daemon's log or on any host process's command line either.
    assert!(!daemon.log().contains("run-value-42"));
    for entry in std::fs::read_dir("/proc").unwrap().flatten() {
        if let Ok(cmdline) = std::fs::read(entry.path().join("cmdline")) {
            let cmdline = String::from_utf8_lossy(&cmdline);
            assert!(!cmdline.contains("run-value-42"), "{cmdline}");
        }
    }
    // An invalid variable is a 400 that names it, never its value.
    for env in [
        [("BAD-NAME".to_owned(), "v".to_owned())],
        [("NEWLINE".to_owned(), "a\nb-secret".to_owned())],
        [("NUL".to_owned(), "a\0b".to_owned())],
    ] {
        let req = CreateRunRequest {
            image: "base".into(),
            env: Some(Env(env.clone().into())),
            ..Default::default()
        };
        let err = daemon.client.create_run(&req).await.unwrap_err();
        assert_eq!(err.status(), Some(400), "{err}");
        assert_eq!(err.code(), Some(runbox_types::ErrorCode::BadEnv));
        assert!(err.to_string().contains(&env[0].0), "{err}");
        assert!(!err.to_string().contains("b-secret"));
        let req = ExecRequest {
            cmd: vec!["true".into()],
            env: Some(Env(env.into())),
            ..Default::default()
        };
        let err = daemon.client.exec(&id, &req).await.unwrap_err();
        assert_eq!(err.code(), Some(runbox_types::ErrorCode::BadEnv));
    }
    let too_many = Env((0..65).map(|i| (format!("V{i}"), "x".to_owned())).collect());
    let req = CreateRunRequest {
        image: "base".into(),
        env: Some(too_many),
        ..Default::default()
    };
    assert_eq!(
        daemon.client.create_run(&req).await.unwrap_err().code(),
        Some(runbox_types::ErrorCode::BadEnv)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exec_timeout_kills_the_process_group() {
    let daemon = TestDaemon::start(None).await;
    let id = daemon.create().await.id.to_string();
    let req = ExecRequest {
        cmd: vec![
            "sh".into(),
            "-c".into(),
            "sleep 1000 & echo $! > /work/bg.pid; sleep 1000".into(),
        ],
        timeout_sec: Some(1),
        ..Default::default()
    };
    let out = daemon.exec(&id, req).await;
    assert!(out.exit.timed_out, "{:?}", out.exit);
    assert_eq!(out.exit.reason, ExitReason::Timeout);
    assert_eq!(out.exit.exit_code, 137);
    let check = daemon
        .sh(
            &id,
            "kill -0 $(cat /work/bg.pid) 2>/dev/null && echo alive || echo gone",
        )
        .await;
    assert_eq!(String::from_utf8_lossy(&check.stdout).trim(), "gone");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_disconnected_client_does_not_leave_the_command_running() {
    let daemon = TestDaemon::start(None).await;
    let id = daemon.create().await.id.to_string();
    let req = ExecRequest {
        cmd: vec![
            "sh".into(),
            "-c".into(),
            "echo $$ > /work/sh.pid; echo ready; sleep 1000".into(),
        ],
        ..Default::default()
    };
    let mut stream = daemon.client.exec(&id, &req).await.expect("exec");
    while let Some(event) = stream.next().await {
        if matches!(event.expect("event"), ExecEvent::Stdout(_)) {
            break;
        }
    }
    drop(stream);
    let mut gone = false;
    for _ in 0..100 {
        let out = daemon
            .sh(
                &id,
                "kill -0 $(cat /work/sh.pid) 2>/dev/null && echo alive || echo gone",
            )
            .await;
        if String::from_utf8_lossy(&out.stdout).trim() == "gone" {
            gone = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(gone, "the command outlived its client");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ttl_reaper_destroys_expired_runs_and_ends_their_execs() {
    let daemon = TestDaemon::start(None).await;
    let run = daemon
        .create_with(CreateRunRequest {
            image: "base".into(),
            ttl_sec: Some(3),
            ..Default::default()
        })
        .await;
    let id = run.id.to_string();
    let req = ExecRequest {
        cmd: vec!["sleep".into(), "1000".into()],
        ..Default::default()
    };
    let out = tokio::time::timeout(Duration::from_secs(60), daemon.exec(&id, req))
        .await
        .expect("exec ended");
    assert_eq!(out.exit.reason, ExitReason::RunExpired, "{:?}", out.exit);
    let err = daemon.client.get_run(&id).await.unwrap_err();
    assert_eq!(err.status(), Some(404));
    // The exit event goes out as destruction starts; cleanup follows.
    let state = daemon.state.path().to_path_buf();
    let clean = runbox_e2e::eventually(Duration::from_secs(20), || {
        !netns_exists(&id) && mounts_under(&state).is_empty()
    })
    .await;
    assert!(clean, "expired run left resources behind");
    // A run nobody talks to is reaped too.
    let idle = daemon
        .create_with(CreateRunRequest {
            image: "base".into(),
            ttl_sec: Some(1),
            ..Default::default()
        })
        .await;
    let idle_id = idle.id.to_string();
    let mut reaped = false;
    for _ in 0..100 {
        if daemon.client.get_run(&idle_id).await.is_err() {
            reaped = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(reaped, "idle run was not reaped");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn memory_limit_kills_the_hog_with_137() {
    let daemon = TestDaemon::start(None).await;
    let id = daemon
        .create_limited(LimitsRequest {
            memory_mb: Some(64),
            ..Default::default()
        })
        .await;
    // `tail` keeps everything after the last newline in memory; /dev/zero has none.
    let req = ExecRequest {
        cmd: vec!["tail".into(), "/dev/zero".into()],
        timeout_sec: Some(60),
        ..Default::default()
    };
    let out = daemon.exec(&id, req).await;
    assert_eq!(out.exit.exit_code, 137, "{:?}", out.exit);
    assert!(!out.exit.timed_out);
    // The run itself survives.
    assert_eq!(daemon.sh(&id, "echo alive").await.stdout, b"alive\n");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pids_limit_contains_a_fork_bomb() {
    let daemon = TestDaemon::start(None).await;
    let id = daemon
        .create_limited(LimitsRequest {
            pids: Some(64),
            ..Default::default()
        })
        .await;
    let req = ExecRequest {
        cmd: vec![
            "sh".into(),
            "-c".into(),
            "bomb() { bomb | bomb & }; bomb; sleep 3".into(),
        ],
        timeout_sec: Some(5),
        ..Default::default()
    };
    let _ = daemon.exec(&id, req).await;
    // Once the group is killed the run works again.
    let mut ok = false;
    for _ in 0..50 {
        let stream = daemon
            .client
            .exec(
                &id,
                &ExecRequest {
                    cmd: vec!["echo".into(), "survived".into()],
                    ..Default::default()
                },
            )
            .await;
        if let Ok(stream) = stream {
            if let Ok(out) = stream.collect_output().await {
                if out.stdout == b"survived\n" {
                    ok = true;
                    break;
                }
            }
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert!(ok, "the run did not survive the fork bomb");
    let pids_max = std::fs::read_to_string(format!("/sys/fs/cgroup/pids/runbox/{id}/pids.max"))
        .or_else(|_| std::fs::read_to_string(format!("/sys/fs/cgroup/runbox/{id}/pids.max")))
        .expect("pids cgroup");
    assert_eq!(pids_max.trim(), "64");
}

/// A command that cannot start because the run is at its `pids` limit is
/// the caller's situation, said as such: `429 process_limit` naming the
/// limit, on exec and on background processes alike.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_run_at_its_process_limit_says_so() {
    let daemon = TestDaemon::start(None).await;
    let id = daemon
        .create_limited(LimitsRequest {
            pids: Some(16),
            ..Default::default()
        })
        .await;
    // Background sleepers, one slot each, until a start is refused; then
    // a foreground exec is refused the same way.
    let sleeper = ExecRequest {
        cmd: vec!["sleep".into(), "600".into()],
        ..Default::default()
    };
    let mut refusals = Vec::new();
    for _ in 0..40 {
        if let Err(e) = daemon.client.start_process(&id, &sleeper).await {
            refusals.push(e);
            break;
        }
    }
    let request = ExecRequest {
        cmd: vec!["true".into()],
        ..Default::default()
    };
    match daemon.client.exec(&id, &request).await {
        Ok(_) => panic!("a command started in a run at its process limit"),
        Err(e) => refusals.push(e),
    }
    assert_eq!(refusals.len(), 2, "the sleepers never reached the limit");
    for refused in &refusals {
        assert_eq!(refused.status(), Some(429), "{refused}");
        assert_eq!(
            refused.code(),
            Some(runbox_types::ErrorCode::ProcessLimit),
            "{refused}"
        );
        assert!(refused.to_string().contains("limits.pids 16"), "{refused}");
    }
    daemon.client.delete_run(&id).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn network_none_has_only_loopback() {
    let daemon = TestDaemon::start(None).await;
    let id = daemon.create().await.id.to_string();
    let out = daemon.sh(&id, "ls /sys/class/net").await;
    assert_eq!(
        String::from_utf8_lossy(&out.stdout)
            .split_whitespace()
            .collect::<Vec<_>>(),
        vec!["lo"]
    );
    // Loopback works inside...
    let out = daemon
        .sh(&id, "ip addr show lo | grep -c 'inet 127.0.0.1'")
        .await;
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "1");
    // ...and nothing leaves: no route exists, so a listener on the host's
    // own address (reachable from the host itself) cannot be reached.
    let out = daemon.sh(&id, "ip route; ip -6 route").await;
    assert_eq!(
        String::from_utf8_lossy(&out.stdout).trim(),
        "",
        "a run with network none has routes"
    );
    if let Some(host_ip) = runbox_e2e::host_ipv4() {
        let listener = std::net::TcpListener::bind((host_ip.as_str(), 0)).expect("host listener");
        let port = listener.local_addr().unwrap().port();
        let out = daemon
            .sh(
                &id,
                &format!("nc -w 2 {host_ip} {port} </dev/null; echo rc=$?"),
            )
            .await;
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(
            text.contains("rc=1"),
            "{text} {}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(
            String::from_utf8_lossy(&out.stderr).contains("unreachable"),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    // The alias `egress` is the allowlist tier, shown under its own name.
    let (status, text) = runbox_e2e::raw_request(
        &daemon.url,
        "POST",
        "/v1/runs",
        &daemon.token,
        br#"{"image":"base","network":"egress"}"#,
    )
    .await;
    assert_eq!(status, 201, "{text}");
    let run: runbox_types::Run = serde_json::from_str(&text).unwrap();
    assert_eq!(run.network, NetworkTier::Allowlist);
    daemon.client.delete_run(&run.id.to_string()).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_container_the_runtime_has_no_state_for_is_still_destroyed() {
    // What a daemon killed in the middle of `run` leaves: the container's
    // processes, but no runtime state (yet) naming them.
    let daemon = TestDaemon::start(None).await;
    let id = daemon.create().await.id.to_string();
    let pid = daemon.init_pid(&id);
    let oci = daemon.state.path().join("oci");
    for runtime in std::fs::read_dir(&oci).unwrap().flatten() {
        let _ = std::fs::remove_dir_all(runtime.path().join(format!("runbox-{id}")));
    }
    daemon.client.delete_run(&id).await.unwrap();
    let gone = runbox_e2e::eventually(std::time::Duration::from_secs(10), || {
        !std::path::Path::new(&format!("/proc/{pid}")).exists()
    })
    .await;
    assert!(gone, "the run's agent (pid {pid}) outlived its run");
    assert!(!runbox_e2e::cgroup_exists(&id), "its cgroups are left");
}

/// What docs/threat-model.md says is read-only in a run is: the cgroup
/// tree (on cgroup v1 the runtime mounts a tmpfs at `/sys/fs/cgroup` for
/// the controllers; it too), `/sys`, and the read-only `/proc` paths.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_read_only_paths_are_read_only_on_every_runtime() {
    for runtime in runtimes() {
        let daemon = TestDaemon::start(Some(&runtime)).await;
        let run = daemon.create().await;
        let id = run.id.to_string();
        let script = "for p in /sys/fs/cgroup/runbox-probe /sys/runbox-probe /proc/sys/runbox-probe; do \
                        if mkdir $p 2>/dev/null || touch $p 2>/dev/null; then echo writable $p; fi; \
                      done; \
                      for c in /sys/fs/cgroup/*; do \
                        if [ -d $c ] && touch $c/runbox-probe 2>/dev/null; then echo writable $c; fi; \
                      done; \
                      grep ' /sys/fs/cgroup ' /proc/mounts";
        let out = daemon.sh(&id, script).await;
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(!stdout.contains("writable"), "{runtime}: {stdout}");
        // The last mount on the path is the one in force.
        let mount = stdout
            .lines()
            .rfind(|l| l.contains(" /sys/fs/cgroup "))
            .unwrap_or_else(|| panic!("{runtime}: no /sys/fs/cgroup mount: {stdout}"));
        let options = mount.split_whitespace().nth(3).unwrap_or("");
        assert!(
            options.split(',').any(|o| o == "ro"),
            "{runtime}: /sys/fs/cgroup is mounted {options}"
        );
        daemon.client.delete_run(&id).await.unwrap();
    }
}

/// E2B's kill answers once the sandbox's processes are gone and the API
/// no longer shows it; the rest of the teardown follows, leaving nothing.
/// Meanwhile the killed run takes no slot (`--max-runs 1`: the next create
/// is served at once). A run that mounts a volume is answered for only
/// once the volume is free: the next create mounts it at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_e2b_kill_answers_once_the_processes_are_gone() {
    let daemon = TestDaemon::start_with(None, &["--max-runs", "1"], &[]).await;
    let kill = |id: String| {
        let (url, token) = (daemon.url.clone(), daemon.token.clone());
        async move {
            runbox_e2e::raw_request(&url, "DELETE", &format!("/sandboxes/{id}"), &token, b"").await
        }
    };
    for _ in 0..3 {
        let id = daemon.create().await.id.to_string();
        let pid = daemon.init_pid(&id);
        let (status, body) = kill(id.clone()).await;
        assert_eq!(status, 204, "{body}");
        // Gone, or a zombie its parent has not reaped yet.
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
        let state = stat.rsplit_once(") ").map(|(_, rest)| &rest[..1]);
        assert!(
            matches!(state, None | Some("Z")),
            "the run's init (pid {pid}) outlived the kill's answer: {stat}"
        );
        let err = daemon.client.get_run(&id).await.unwrap_err();
        assert_eq!(err.status(), Some(404));
        let (status, _) = kill(id.clone()).await;
        assert_eq!(status, 404, "a killed sandbox is gone");
        let next = daemon.create().await.id.to_string();
        let gone = runbox_e2e::eventually(Duration::from_secs(20), || {
            !daemon.state.path().join("runs").join(&id).exists()
                && !netns_exists(&id)
                && !cgroup_exists(&id)
        })
        .await;
        assert!(
            gone,
            "the killed run's teardown did not finish\n{}",
            daemon.log()
        );
        daemon.client.delete_run(&next).await.unwrap();
    }
    assert!(mounts_under(daemon.state.path()).is_empty());

    // The image of a killed run can be deleted at once: the delete waits
    // for the teardown that still mounts it, and its layers go with it.
    daemon.import("other", runbox_e2e::busybox_tar()).await;
    let id = daemon
        .create_with(CreateRunRequest {
            image: "other".into(),
            ..Default::default()
        })
        .await
        .id
        .to_string();
    let (status, body) = kill(id.clone()).await;
    assert_eq!(status, 204, "{body}");
    daemon.client.delete_image("other").await.unwrap();

    daemon
        .client
        .create_volume(&runbox_types::CreateVolumeRequest {
            name: "kept".into(),
            size_mb: None,
            labels: None,
        })
        .await
        .unwrap();
    let with_volume = || CreateRunRequest {
        image: "base".into(),
        volumes: Some(vec![runbox_types::VolumeMountRequest {
            name: "kept".into(),
            path: Some("/data".into()),
            mode: None,
        }]),
        ..Default::default()
    };
    let first = daemon.create_with(with_volume()).await.id.to_string();
    daemon.sh(&first, "echo one > /data/f").await;
    let (status, body) = kill(first.clone()).await;
    assert_eq!(status, 204, "{body}");
    let second = daemon.create_with(with_volume()).await.id.to_string();
    assert_eq!(daemon.sh(&second, "cat /data/f").await.stdout, b"one\n");
    daemon.client.delete_run(&second).await.unwrap();
}
