//! Hibernate, wake and the restart policy: a hibernated run keeps only its
//! disk (its cgroup, namespace, mounts, agent and capacity slot go); the
//! next call that reaches it boots it again on that disk under the same id;
//! a run whose init dies is booted again (`cold`) within a budget, or marked
//! failed (`none`); idle runs go to sleep on their own.

use std::path::{Path, PathBuf};
use std::time::Duration;

use runbox_e2e::{eventually, eventually_async, TestDaemon};
use runbox_types::{CreateRunRequest, ExecRequest, IdlePolicy, RunStatus};

fn run_dir(daemon: &TestDaemon, id: &str) -> PathBuf {
    daemon.state.path().join("runs").join(id)
}

/// Whether `path` is a mount point in this (the host's) mount namespace.
fn mounted(path: &Path) -> bool {
    let wanted = path.to_string_lossy().into_owned();
    std::fs::read_to_string("/proc/self/mountinfo")
        .unwrap_or_default()
        .lines()
        .any(|l| l.split(' ').nth(4) == Some(wanted.as_str()))
}

/// What run `id` holds on the host besides its disk.
struct Held {
    cgroup: bool,
    netns: bool,
    root: bool,
}

fn held(daemon: &TestDaemon, id: &str) -> Held {
    let cgroups = ["memory", "pids", "cpu", "freezer", "unified", ""]
        .iter()
        .map(|c| Path::new("/sys/fs/cgroup").join(c).join("runbox").join(id))
        .any(|d| d.is_dir());
    Held {
        cgroup: cgroups,
        netns: Path::new("/run/netns")
            .join(format!("runbox-{id}"))
            .exists(),
        root: mounted(&run_dir(daemon, id).join("rootfs")),
    }
}

/// Kills run `id`'s init from the host, as a crash or an OOM would.
fn kill_init(daemon: &TestDaemon, id: &str) {
    let pid = daemon.init_pid(id);
    // SAFETY: kill(2) on the pid the run's runtime recorded for its init.
    assert_eq!(unsafe { libc::kill(pid, libc::SIGKILL) }, 0, "kill {pid}");
}

async fn status(daemon: &TestDaemon, id: &str) -> Option<RunStatus> {
    daemon.client.get_run(id).await.ok().map(|r| r.status)
}

async fn becomes(daemon: &TestDaemon, id: &str, wanted: RunStatus, within: Duration) -> bool {
    eventually_async(within, || async {
        status(daemon, id).await == Some(wanted)
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hibernated_run_keeps_only_its_disk_and_the_next_call_boots_it_again() {
    for runtime in runbox_e2e::runtimes() {
        let daemon = TestDaemon::start(Some(&runtime)).await;
        let run = daemon.create().await;
        let id = run.id.to_string();
        // Writes in /work and elsewhere in the root, and a process.
        daemon
            .sh(
                &id,
                "echo work > /work/kept; echo root > /etc/kept; \
                 sleep 1000 > /dev/null 2>&1 & echo $! > /work/pid",
            )
            .await;
        let before = held(&daemon, &id);
        assert!(before.cgroup && before.netns && before.root, "{runtime}");

        let asleep = daemon.client.hibernate_run(&id).await.expect("hibernate");
        assert_eq!(asleep.status, RunStatus::Hibernated, "{runtime}");
        let after = held(&daemon, &id);
        assert!(
            !after.cgroup && !after.netns && !after.root,
            "{runtime}: a hibernated run still holds cgroup {} netns {} root {}",
            after.cgroup,
            after.netns,
            after.root
        );
        // Listed as hibernated; a second hibernate changes nothing.
        let listed = daemon.client.list_runs().await.unwrap();
        assert!(listed
            .runs
            .iter()
            .any(|r| r.id == run.id && r.status == RunStatus::Hibernated));
        let again = daemon.client.hibernate_run(&id).await.unwrap();
        assert_eq!(again.status, RunStatus::Hibernated);

        // An exec wakes it: same id and files, its processes gone.
        let out = daemon
            .sh(
                &id,
                // A pid may be reused in the new sandbox: look for the command.
                "cat /work/kept /etc/kept; cat /proc/[0-9]*/comm 2>/dev/null | grep -q '^sleep$' && echo alive || echo gone",
            )
            .await;
        assert_eq!(
            String::from_utf8_lossy(&out.stdout),
            "work\nroot\ngone\n",
            "{runtime}: {}",
            daemon.log()
        );
        let woken = daemon.client.get_run(&id).await.unwrap();
        assert_eq!(woken.status, RunStatus::Running);
        assert_eq!(woken.limits, run.limits);
        assert_eq!(woken.created_at, run.created_at);
        assert!(held(&daemon, &id).root);
        // And it is whole: writes, and a delete leaves nothing.
        daemon.sh(&id, "echo more >> /work/kept").await;
        daemon.client.delete_run(&id).await.unwrap();
        assert!(!run_dir(&daemon, &id).exists(), "{runtime}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_kind_of_call_wakes_a_hibernated_run_and_calls_together_share_one_wake() {
    let daemon = TestDaemon::start(None).await;
    let id = daemon.create().await.id.to_string();
    daemon
        .client
        .put_file(&id, "note", runbox_e2e::body(b"hello".to_vec()))
        .await
        .unwrap();

    // A file read.
    daemon.client.hibernate_run(&id).await.unwrap();
    let file = daemon.client.get_file(&id, "note").await.expect("read");
    assert_eq!(&file.bytes().await.unwrap()[..], b"hello");
    assert_eq!(status(&daemon, &id).await, Some(RunStatus::Running));

    // A WebSocket session.
    daemon.client.hibernate_run(&id).await.unwrap();
    let req = ExecRequest {
        cmd: vec!["sh".into(), "-c".into(), "echo ws".into()],
        ..Default::default()
    };
    let session = daemon
        .client
        .exec_session(&id, &req)
        .await
        .expect("session");
    let out = session
        .events
        .collect_output()
        .await
        .expect("session output");
    assert_eq!(out.stdout, b"ws\n");

    // A port connection (a server started by a background process, which
    // the hibernation ends: it is started again after the wake).
    daemon.client.hibernate_run(&id).await.unwrap();
    let err = daemon.client.connect_port(&id, 9000, None).await;
    assert!(err.is_err(), "nothing listens on 9000 after a wake");
    assert_eq!(status(&daemon, &id).await, Some(RunStatus::Running));
    drop(daemon.echo_tunnel(&id, 9000).await);

    // Eight execs at once: one wake.
    daemon.client.hibernate_run(&id).await.unwrap();
    let calls = (0..8).map(|i| {
        let daemon = &daemon;
        let id = id.clone();
        async move { daemon.sh(&id, &format!("echo {i}")).await }
    });
    let outs = futures::future::join_all(calls).await;
    for (i, out) in outs.iter().enumerate() {
        assert_eq!(String::from_utf8_lossy(&out.stdout), format!("{i}\n"));
    }
    let log = daemon.log();
    let wakes = log
        .lines()
        .filter(|l| l.contains("run woken") && l.contains(&id))
        .count();
    assert_eq!(
        wakes, 4,
        "file read, session, port, and one for the eight execs:\n{log}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hibernated_runs_free_their_capacity_slot_and_a_wake_without_one_is_refused() {
    let daemon = TestDaemon::start_with(None, &["--max-runs", "1"], &[]).await;
    let first = daemon.create().await.id.to_string();
    daemon.client.hibernate_run(&first).await.unwrap();
    // Its slot is free: another run fits.
    let second = daemon.create().await.id.to_string();
    // Waking the first would exceed --max-runs: 429, still hibernated.
    let err = daemon.client.wake_run(&first).await.unwrap_err();
    assert_eq!(err.status(), Some(429), "{err}");
    let err = daemon
        .exec_refusal(&first, "an exec woke a run past capacity")
        .await;
    assert_eq!(err.status(), Some(429), "{err}");
    assert_eq!(status(&daemon, &first).await, Some(RunStatus::Hibernated));
    // Once the slot is free, it wakes.
    daemon.client.delete_run(&second).await.unwrap();
    let woken = daemon.client.wake_run(&first).await.expect("wake");
    assert_eq!(woken.status, RunStatus::Running);
    assert_eq!(daemon.sh(&first, "echo up").await.stdout, b"up\n");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lease_fences_across_hibernate_and_wake() {
    let daemon = TestDaemon::start(None).await;
    let id = daemon.create().await.id.to_string();
    let lease = daemon
        .client
        .acquire_lease(&id, "alice", Some(300))
        .await
        .unwrap();
    daemon.client.hibernate_run(&id).await.unwrap();
    // A write without the lease is refused, and does not wake the run.
    let err = daemon
        .client
        .put_file(&id, "x", runbox_e2e::body(b"x".to_vec()))
        .await
        .unwrap_err();
    assert_eq!(err.status(), Some(409), "{err}");
    assert_eq!(status(&daemon, &id).await, Some(RunStatus::Hibernated));
    // The holder's write wakes it; the lease is the same one.
    daemon
        .client
        .put_file_as(
            &id,
            "x",
            Some(&runbox_client::LeaseCredential {
                owner: "alice".into(),
                generation: lease.generation,
            }),
            runbox_e2e::body(b"x".to_vec()),
        )
        .await
        .expect("the holder writes");
    let run = daemon.client.get_run(&id).await.unwrap();
    assert_eq!(run.status, RunStatus::Running);
    assert_eq!(run.lease.map(|l| l.generation), Some(lease.generation));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_daemon_killed_around_a_hibernation_finds_the_run_as_recorded() {
    let mut daemon = TestDaemon::start(None).await;
    let asleep = daemon.create().await.id.to_string();
    let awake = daemon.create().await.id.to_string();
    daemon.sh(&asleep, "echo kept > /work/kept").await;
    daemon.client.hibernate_run(&asleep).await.unwrap();
    daemon.kill9();
    daemon.spawn().await;
    assert_eq!(status(&daemon, &asleep).await, Some(RunStatus::Hibernated));
    assert_eq!(status(&daemon, &awake).await, Some(RunStatus::Running));
    assert!(!held(&daemon, &asleep).root);
    assert_eq!(daemon.sh(&asleep, "cat /work/kept").await.stdout, b"kept\n");

    // A run whose sandbox died while the daemon was down is booted again
    // by the restart policy (default cold) on its own disk.
    daemon.sh(&awake, "echo mine > /work/mine").await;
    let pid = daemon.init_pid(&awake);
    daemon.kill9();
    // SAFETY: kill(2) on the run's init, recorded by its runtime.
    assert_eq!(unsafe { libc::kill(pid, libc::SIGKILL) }, 0);
    daemon.spawn().await;
    let run = daemon.client.get_run(&awake).await.expect("kept");
    assert_eq!(run.status, RunStatus::Running, "{}", daemon.log());
    assert_eq!(run.restarts, 1);
    assert_eq!(daemon.sh(&awake, "cat /work/mine").await.stdout, b"mine\n");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_run_whose_init_dies_is_booted_again_until_its_budget_is_spent() {
    let daemon = TestDaemon::start(None).await;
    let id = daemon.create().await.id.to_string();
    daemon.sh(&id, "echo kept > /work/kept").await;
    for n in 1..=3u32 {
        let pid = daemon.init_pid(&id);
        kill_init(&daemon, &id);
        let restarted = eventually_async(Duration::from_secs(20), || async {
            daemon
                .client
                .get_run(&id)
                .await
                .is_ok_and(|r| r.restarts == n && r.status == RunStatus::Running)
        })
        .await;
        assert!(restarted, "restart {n}: {}", daemon.log());
        let run = daemon.client.get_run(&id).await.unwrap();
        assert!(run.restarted_at.is_some());
        assert_ne!(daemon.init_pid(&id), pid, "a new init");
        assert_eq!(daemon.sh(&id, "cat /work/kept").await.stdout, b"kept\n");
    }
    // A fourth death within ten minutes: failed, with the reason.
    kill_init(&daemon, &id);
    assert!(
        becomes(&daemon, &id, RunStatus::Failed, Duration::from_secs(20)).await,
        "{}",
        daemon.log()
    );
    let run = daemon.client.get_run(&id).await.unwrap();
    let failure = run.failure.unwrap_or_default();
    assert!(failure.contains("restarted 3 times"), "{failure}");
    let err = daemon
        .exec_refusal(&id, "an exec reached a failed run")
        .await;
    assert_eq!(err.status(), Some(409));
    assert!(err.to_string().contains("run_failed"), "{err}");
    // An explicit wake boots it again, files kept.
    let woken = daemon.client.wake_run(&id).await.expect("wake");
    assert_eq!(woken.status, RunStatus::Running);
    assert!(woken.failure.is_none());
    assert_eq!(daemon.sh(&id, "cat /work/kept").await.stdout, b"kept\n");
    // With a fresh budget: the next death is restarted.
    kill_init(&daemon, &id);
    let restarted = eventually_async(Duration::from_secs(20), || async {
        daemon
            .client
            .get_run(&id)
            .await
            .is_ok_and(|r| r.restarts == 4 && r.status == RunStatus::Running)
    })
    .await;
    assert!(restarted, "{}", daemon.log());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_restart_policy_none_a_dead_run_is_failed_until_woken() {
    let daemon = TestDaemon::start_with(None, &["--restart-policy", "none"], &[]).await;
    let id = daemon.create().await.id.to_string();
    daemon.sh(&id, "echo kept > /work/kept").await;
    kill_init(&daemon, &id);
    assert!(
        becomes(&daemon, &id, RunStatus::Failed, Duration::from_secs(10)).await,
        "{}",
        daemon.log()
    );
    let run = daemon.client.get_run(&id).await.unwrap();
    assert_eq!(run.restarts, 0);
    assert!(run.failure.is_some());
    let woken = daemon.client.wake_run(&id).await.expect("wake");
    assert_eq!(woken.status, RunStatus::Running);
    assert_eq!(daemon.sh(&id, "cat /work/kept").await.stdout, b"kept\n");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_run_sleeps_but_an_open_stream_keeps_it_awake() {
    let daemon = TestDaemon::start(None).await;
    let create = |idle| CreateRunRequest {
        image: "base".into(),
        idle: Some(idle),
        ..Default::default()
    };
    let pausing = daemon
        .create_with(create(IdlePolicy {
            pause_after_sec: Some(2),
            hibernate_after_sec: Some(4),
        }))
        .await;
    assert_eq!(pausing.idle.pause_after_sec, Some(2));
    let id = pausing.id.to_string();
    // A command that streams for longer than the idle time keeps it up.
    let started = std::time::Instant::now();
    let out = daemon
        .sh(&id, "for i in 1 2 3 4 5; do echo $i; sleep 1; done")
        .await;
    assert_eq!(out.stdout, b"1\n2\n3\n4\n5\n");
    assert!(started.elapsed() >= Duration::from_secs(5));
    assert!(!daemon
        .log()
        .lines()
        .any(|l| l.contains("put to sleep") && l.contains(&id)));
    // Closed: it pauses, then hibernates.
    assert!(
        becomes(&daemon, &id, RunStatus::Paused, Duration::from_secs(10)).await,
        "{}",
        daemon.log()
    );
    assert!(
        becomes(&daemon, &id, RunStatus::Hibernated, Duration::from_secs(10)).await,
        "{}",
        daemon.log()
    );
    // The next call wakes it, and the clock starts again.
    assert_eq!(daemon.sh(&id, "echo up").await.stdout, b"up\n");
    assert_eq!(status(&daemon, &id).await, Some(RunStatus::Running));

    // An open attach (a background process followed) keeps a run awake too.
    let daemon2 = &daemon;
    let other = daemon2
        .create_with(create(IdlePolicy {
            pause_after_sec: None,
            hibernate_after_sec: Some(2),
        }))
        .await
        .id
        .to_string();
    let process = daemon
        .client
        .start_process(
            &other,
            &ExecRequest {
                cmd: vec![
                    "sh".into(),
                    "-c".into(),
                    "for i in 1 2 3 4 5; do echo $i; sleep 1; done".into(),
                ],
                ..Default::default()
            },
        )
        .await
        .unwrap();
    let output = daemon
        .client
        .process_output(&other, &process.pid.to_string(), true)
        .await
        .expect("output stream");
    let out = output.collect_output().await.expect("output");
    assert_eq!(out.stdout, b"1\n2\n3\n4\n5\n");
    assert_eq!(status(&daemon, &other).await, Some(RunStatus::Running));
    assert!(
        becomes(
            &daemon,
            &other,
            RunStatus::Hibernated,
            Duration::from_secs(10)
        )
        .await,
        "{}",
        daemon.log()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_expire_hibernate_keeps_the_run_until_its_retention_and_a_wake_renews_it() {
    let daemon = TestDaemon::start_with(None, &["--hibernated-retention-sec", "4"], &[]).await;
    let run = daemon
        .create_with(CreateRunRequest {
            image: "base".into(),
            ttl_sec: Some(2),
            on_expire: Some(runbox_types::OnExpire::Hibernate),
            ..Default::default()
        })
        .await;
    let id = run.id.to_string();
    assert_eq!(run.on_expire, runbox_types::OnExpire::Hibernate);
    daemon.sh(&id, "echo yes > /work/kept").await;
    assert!(
        becomes(&daemon, &id, RunStatus::Hibernated, Duration::from_secs(15)).await,
        "not hibernated at its TTL: {}",
        daemon.log()
    );
    // A call wakes it with a fresh TTL of the length it was made with.
    assert_eq!(daemon.sh(&id, "cat /work/kept").await.stdout, b"yes\n");
    let woken = daemon.client.get_run(&id).await.unwrap();
    assert_eq!(woken.status, RunStatus::Running);
    let left = woken.expires_at - time::OffsetDateTime::now_utc();
    assert!(left <= time::Duration::seconds(3), "{left}");
    // Its TTL passes again: hibernated again, then gone at the retention's end.
    let gone = eventually_async(Duration::from_secs(30), || async {
        daemon.client.get_run(&id).await.is_err()
    })
    .await;
    assert!(gone, "kept past its retention: {}", daemon.log());
    assert!(eventually(Duration::from_secs(5), || !run_dir(&daemon, &id).exists()).await);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pool_members_are_not_put_to_sleep_by_the_idle_policy() {
    let pools_dir = tempfile::tempdir().unwrap();
    let seed = pools_dir.path().join("pools.json");
    std::fs::write(
        &seed,
        r#"{"pools": [{"image": "base", "size": "small", "warm": 1}]}"#,
    )
    .unwrap();
    let seed = seed.to_string_lossy().into_owned();
    let daemon =
        TestDaemon::start_with(None, &["--pools", &seed, "--idle-hibernate-sec", "1"], &[]).await;
    let filled = eventually_async(Duration::from_secs(30), || async {
        daemon
            .client
            .pools()
            .await
            .is_ok_and(|p| p.pools.iter().any(|p| p.ready >= 1))
    })
    .await;
    assert!(filled, "{}", daemon.log());
    // Idle members are left as they are.
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert!(!daemon.log().contains("put to sleep"), "{}", daemon.log());
    // A run served from the pool follows the server's idle policy.
    let run = daemon
        .create_with(CreateRunRequest {
            image: "base".into(),
            size: Some(runbox_types::SizeTier::Small),
            ..Default::default()
        })
        .await;
    assert!(run.pooled);
    assert_eq!(run.idle.hibernate_after_sec, Some(1));
    let id = run.id.to_string();
    assert!(
        becomes(&daemon, &id, RunStatus::Hibernated, Duration::from_secs(10)).await,
        "{}",
        daemon.log()
    );
    assert_eq!(daemon.sh(&id, "echo up").await.stdout, b"up\n");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_daemon_killed_in_the_middle_of_a_hibernate_or_a_wake_leaves_a_whole_run() {
    // The daemon is killed a few milliseconds into each transition, at a
    // different point each round: the next daemon finds the run hibernated
    // or running, never half-made, and the next call works.
    let mut daemon = TestDaemon::start(None).await;
    let id = daemon.create().await.id.to_string();
    daemon.sh(&id, "echo kept > /work/kept").await;
    for round in 0..6u64 {
        let hibernating = round % 2 == 0;
        if !hibernating {
            daemon.client.hibernate_run(&id).await.unwrap();
        }
        let client = daemon.client.clone();
        let target = id.clone();
        let call = tokio::spawn(async move {
            if hibernating {
                client.hibernate_run(&target).await.map(|_| ())
            } else {
                client.wake_run(&target).await.map(|_| ())
            }
        });
        tokio::time::sleep(Duration::from_millis(2 + round * 7)).await;
        daemon.kill9();
        let _ = call.await;
        daemon.spawn().await;
        let run = daemon.client.get_run(&id).await.expect("the run is kept");
        let held = held(&daemon, &id);
        match run.status {
            RunStatus::Hibernated => assert!(
                !held.root && !held.netns && !held.cgroup,
                "round {round}: hibernated but holding its sandbox"
            ),
            RunStatus::Running => assert!(held.root && held.netns, "round {round}"),
            other => panic!("round {round}: {other:?}\n{}", daemon.log()),
        }
        assert_eq!(
            daemon.sh(&id, "cat /work/kept").await.stdout,
            b"kept\n",
            "round {round}"
        );
    }
}

/// Captures (snapshots, checkpoints) admitted while the run runs, racing a
/// pause, a hibernate or an archive of the same run: each succeeds, or says
/// the run went to sleep under it (409), never a 500.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn captures_racing_sleep_succeed_or_are_409s() {
    let daemon = TestDaemon::start(None).await;
    let id = daemon.create().await.id.to_string();
    daemon.sh(&id, "seq 1 20000 > /work/data").await;
    let allowed =
        |what: &str, round: u64, result| done_or_not_running(&daemon, what, round, result);
    for round in 0..12u64 {
        let name = format!("race-{round}");
        let sleep = async {
            tokio::time::sleep(Duration::from_millis(3 * (round % 4))).await;
            match round % 3 {
                0 => daemon.client.pause_run(&id).await.map(drop),
                1 => daemon.client.hibernate_run(&id).await.map(drop),
                _ => daemon.client.archive_run(&id).await.map(drop),
            }
        };
        let no_labels = runbox_types::CheckpointRequest::default();
        let (snapshot, checkpoint, slept) = tokio::join!(
            daemon.client.snapshot_run(&id, Some(&name)),
            daemon.client.checkpoint_run(&id, &no_labels),
            sleep
        );
        slept.unwrap_or_else(|e| panic!("round {round}: {e}; log:\n{}", daemon.log()));
        let took = snapshot.is_ok();
        allowed("snapshot", round, snapshot.map(drop));
        allowed("checkpoint", round, checkpoint.map(drop));
        if took {
            daemon.client.delete_snapshot(&name).await.unwrap();
        }
        let status = daemon.client.get_run(&id).await.unwrap().status;
        if status == RunStatus::Paused {
            // Paused (a capture admitted after the pause resumes it first:
            // autoResume), and a capture that ran meanwhile left it frozen.
            let v1 = format!("/sys/fs/cgroup/freezer/runbox/{id}/freezer.state");
            let v2 = format!("/sys/fs/cgroup/runbox/{id}/cgroup.events");
            let frozen = match std::fs::read_to_string(&v1) {
                Ok(state) => state.trim() == "FROZEN",
                Err(_) => std::fs::read_to_string(&v2)
                    .unwrap()
                    .lines()
                    .any(|l| l.trim() == "frozen 1"),
            };
            assert!(frozen, "round {round}: a paused run is frozen");
        }
        wake_for_next_round(&daemon, &id, status, round).await;
    }
    daemon.client.delete_run(&id).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn file_calls_racing_sleep_succeed_or_are_409s() {
    // A file call the run's hibernate or archive cuts off is the 409 a
    // call a moment later would get, never the agent's 502.
    let daemon = TestDaemon::start(None).await;
    let id = daemon.create().await.id.to_string();
    daemon.sh(&id, "seq 1 200000 > /work/data").await;
    let allowed =
        |what: &str, round: u64, result| done_or_not_running(&daemon, what, round, result);
    for round in 0..12u64 {
        let name = format!("up-{round}");
        let sleep = async {
            tokio::time::sleep(Duration::from_millis(2 * (round % 5))).await;
            // Not pause: a call in flight when its run freezes waits for
            // the thaw (the agent is frozen with the call).
            match round % 2 {
                0 => daemon.client.hibernate_run(&id).await.map(drop),
                _ => daemon.client.archive_run(&id).await.map(drop),
            }
        };
        let upload = daemon
            .client
            .put_file(&id, &name, vec![7u8; 4 << 20].into());
        let download = async {
            let got = daemon.client.get_file(&id, "data").await?;
            got.bytes().await.map(drop)
        };
        let stat = daemon.client.stat(&id, "data");
        let list = daemon.client.list_dir(&id, "", 1);
        let (upload, download, stat, list, slept) =
            tokio::join!(upload, download, stat, list, sleep);
        slept.unwrap_or_else(|e| panic!("round {round}: {e}; log:\n{}", daemon.log()));
        allowed("upload", round, upload);
        // A download cut off after its headers breaks its body instead.
        if let Err(runbox_client::ClientError::Api { .. }) = download {
            allowed("download", round, download);
        }
        allowed("stat", round, stat.map(drop));
        allowed("list", round, list.map(drop));
        let status = daemon.client.get_run(&id).await.unwrap().status;
        wake_for_next_round(&daemon, &id, status, round).await;
    }
    daemon.client.delete_run(&id).await.unwrap();
}

/// A call racing its run's sleep: done, or `409 run_not_running`.
fn done_or_not_running(
    daemon: &TestDaemon,
    what: &str,
    round: u64,
    result: Result<(), runbox_client::ClientError>,
) {
    match result {
        Ok(()) => {}
        Err(runbox_client::ClientError::Api { status, code, .. })
            if status == 409 && code == "run_not_running" => {}
        Err(e) => panic!("{what}, round {round}: {e}; log:\n{}", daemon.log()),
    }
}

/// Resumes (paused or running) or wakes (asleep on disk) the run a race
/// put to sleep in `status`, for the next round.
async fn wake_for_next_round(daemon: &TestDaemon, id: &str, status: RunStatus, round: u64) {
    let woken = match status {
        RunStatus::Paused | RunStatus::Running => daemon.client.resume_run(id).await,
        _ => daemon.client.wake_run(id).await,
    };
    woken.unwrap_or_else(|e| panic!("round {round}: {e}; log:\n{}", daemon.log()));
}
