//! Warm pools, size tiers, capacity answers and drain, on the real runtime:
//! members made ahead, handed out once with the create's settings, refilled,
//! replaced, drained and cleaned up across restarts.

use std::collections::BTreeMap;
use std::time::Duration;

use runbox_e2e::{eventually, eventually_async, raw_request, TestDaemon};
use runbox_types::{CreateRunRequest, Env, ErrorCode, PoolList, PoolSet, PoolSpec, Run, SizeTier};

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

fn pool(image: &str, warm: u32) -> PoolSpec {
    PoolSpec {
        image: image.into(),
        network: None,
        size: None,
        warm: Some(warm),
        warm_max: None,
        warmup: None,
    }
}

async fn set(daemon: &TestDaemon, pools: Vec<PoolSpec>) -> PoolList {
    daemon
        .client
        .set_pools(&PoolSet { pools })
        .await
        .expect("PUT /v1/pools")
}

/// Waits until every pool has at least `ready` ready members.
async fn ready(daemon: &TestDaemon, ready: u32) -> PoolList {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    loop {
        let list = daemon.client.pools().await.unwrap();
        if list.pools.iter().all(|p| p.ready >= ready) {
            return list;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "pools never reached {ready} ready: {list:?}\n{}",
            daemon.log()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

fn small(image: &str) -> CreateRunRequest {
    CreateRunRequest {
        image: image.into(),
        size: Some(SizeTier::Small),
        ..Default::default()
    }
}

/// Run directories in the run store: every sandbox, pooled or not.
fn sandboxes(daemon: &TestDaemon) -> usize {
    std::fs::read_dir(daemon.state.path().join("runs"))
        .unwrap()
        .flatten()
        .filter(|e| ulid::Ulid::from_string(&e.file_name().to_string_lossy()).is_ok())
        .count()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_is_a_fresh_member_with_the_creates_settings() {
    let daemon = TestDaemon::start(None).await;
    set(&daemon, vec![pool("base", 2)]).await;
    ready(&daemon, 2).await;
    // Idle members are not runs anyone can see.
    assert!(daemon.client.list_runs().await.unwrap().runs.is_empty());
    assert_eq!(daemon.client.info().await.unwrap().capacity.pooled, 2);

    let mut req = small("base");
    req.env = Some(Env(BTreeMap::from([("GREETING".into(), "hi".into())])));
    req.ttl_sec = Some(120);
    req.labels = Some(BTreeMap::from([("team".into(), "search".into())]));
    let escalation = daemon.client.info().await.unwrap().userns == "private";
    req.allow_privilege_escalation = Some(escalation);
    let before = time::OffsetDateTime::now_utc();
    let first = daemon.create_with(req.clone()).await;
    assert!(first.pooled, "{first:?}");
    assert_eq!(first.allow_privilege_escalation, escalation);
    assert_eq!(first.size, Some(SizeTier::Small));
    assert_eq!(first.limits.memory_mb, 512);
    assert_eq!(first.labels["team"], "search");
    let ttl = (first.expires_at - before).whole_seconds();
    assert!((115..=125).contains(&ttl), "ttl {ttl}");
    assert!(first.created_at >= before);
    let id = first.id.to_string();
    let out = daemon
        .sh(&id, "echo $GREETING; grep NoNewPrivs /proc/self/status; echo mine > /work/claim; cat /sys/fs/cgroup/memory/memory.limit_in_bytes 2>/dev/null || true")
        .await;
    let expected = format!("hi\nNoNewPrivs:\t{}\n", u8::from(!escalation));
    assert!(
        text(&out.stdout).starts_with(&expected),
        "{}",
        text(&out.stdout)
    );
    let listed = daemon.client.list_runs().await.unwrap().runs;
    assert_eq!(listed.len(), 1);
    assert_eq!(listed[0].id, first.id);

    // The second claim is another member: nothing of the first is there.
    let second = daemon.create_with(small("base")).await;
    assert!(second.pooled);
    assert_ne!(second.id, first.id);
    let out = daemon
        .sh(
            &second.id.to_string(),
            "[ -e /work/claim ] || echo clean; echo ${GREETING:-unset}; grep NoNewPrivs /proc/self/status",
        )
        .await;
    assert_eq!(text(&out.stdout), "clean\nunset\nNoNewPrivs:\t1\n");

    // An empty pool falls back to a cold create; no pool at all, too.
    let status = &daemon.client.pools().await.unwrap().pools[0];
    assert_eq!(status.claims, 2);
    let medium = daemon
        .create_with(CreateRunRequest {
            size: Some(SizeTier::Medium),
            ..small("base")
        })
        .await;
    assert!(!medium.pooled);
    assert_eq!((medium.limits.cpus, medium.limits.memory_mb), (2.0, 1024));
    let plain = daemon.create().await;
    assert!(!plain.pooled && plain.size.is_none());
    // The pool refills.
    ready(&daemon, 2).await;

    // A retried create (same Idempotency-Key) gets the same pooled run.
    let key = "claim-retry-1";
    let a = daemon
        .client
        .create_run_with_key(&small("base"), key)
        .await
        .unwrap();
    let b = daemon
        .client
        .create_run_with_key(&small("base"), key)
        .await
        .unwrap();
    assert!(a.pooled);
    assert_eq!(a.id, b.id);

    // Size with limits, bad labels: refused, nothing taken from the pool.
    let mut both = small("base");
    both.limits = Some(runbox_types::LimitsRequest {
        cpus: Some(1.0),
        ..Default::default()
    });
    let err = daemon.client.create_run(&both).await.unwrap_err();
    assert_eq!(err.code(), Some(ErrorCode::BadLimits));
    let mut labels = small("base");
    labels.labels = Some(BTreeMap::from([("bad key!".into(), "x".into())]));
    let err = daemon.client.create_run(&labels).await.unwrap_err();
    assert_eq!(err.code(), Some(ErrorCode::BadLabels));
    for run in daemon.client.list_runs().await.unwrap().runs {
        daemon.client.delete_run(&run.id.to_string()).await.unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn put_replaces_and_drains_and_a_restart_keeps_claims_and_cleans_members() {
    let pools_dir = tempfile::tempdir().unwrap();
    let seed = pools_dir.path().join("pools.json");
    std::fs::write(
        &seed,
        r#"{"pools": [{"image": "base", "size": "small", "warm": 2}]}"#,
    )
    .unwrap();
    let seed_arg = seed.to_string_lossy().into_owned();
    let mut daemon = TestDaemon::start_with(None, &["--pools", &seed_arg], &[]).await;
    // The seed pool names an image imported after the start: it fills once
    // the image is there.
    ready(&daemon, 2).await;
    let claimed = daemon.create_with(small("base")).await;
    assert!(claimed.pooled);
    ready(&daemon, 2).await;
    assert_eq!(sandboxes(&daemon), 3);

    // PUT replaces the set: the small pool drains, a medium one fills.
    let mut medium = pool("base", 1);
    medium.size = Some(SizeTier::Medium);
    let list = set(&daemon, vec![medium]).await;
    assert_eq!(list.pools.len(), 1);
    assert_eq!(list.pools[0].size, SizeTier::Medium);
    ready(&daemon, 1).await;
    assert!(
        eventually(Duration::from_secs(20), || sandboxes(&daemon) == 2).await,
        "{} sandboxes",
        sandboxes(&daemon)
    );
    let persisted: PoolSet =
        serde_json::from_slice(&std::fs::read(daemon.state.path().join("pools.json")).unwrap())
            .unwrap();
    assert_eq!(persisted.pools.len(), 1);
    assert_eq!(persisted.pools[0].size, Some(SizeTier::Medium));
    // A bad set changes nothing.
    let err = daemon
        .client
        .set_pools(&PoolSet {
            pools: vec![pool("base", 1), pool("base", 2)],
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), Some(ErrorCode::BadPools));
    let err = daemon
        .client
        .set_pools(&PoolSet {
            pools: vec![pool("Not An Image", 1)],
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), Some(ErrorCode::BadPools));
    assert_eq!(
        daemon.client.pools().await.unwrap().pools[0].size,
        SizeTier::Medium
    );

    // A crash: the claimed run is re-adopted, the idle member is destroyed
    // (its claim might not have reached the disk), and the persisted set
    // wins over --pools.
    daemon.kill9();
    daemon.spawn().await;
    let runs = daemon.client.list_runs().await.unwrap().runs;
    assert_eq!(runs.len(), 1, "{runs:?}\n{}", daemon.log());
    assert_eq!(runs[0].id, claimed.id);
    assert!(runs[0].pooled);
    let out = daemon.sh(&claimed.id.to_string(), "echo alive").await;
    assert_eq!(text(&out.stdout), "alive\n");
    assert!(daemon
        .log()
        .contains("using the pools set by PUT /v1/pools"));
    let list = ready(&daemon, 1).await;
    assert_eq!(list.pools[0].size, SizeTier::Medium);
    assert!(
        eventually(Duration::from_secs(20), || sandboxes(&daemon) == 2).await,
        "{} sandboxes",
        sandboxes(&daemon)
    );
    daemon
        .client
        .delete_run(&claimed.id.to_string())
        .await
        .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_target_rises_under_a_burst_and_decays() {
    let daemon = TestDaemon::start_with(None, &["--pool-decay-sec", "3"], &[]).await;
    let mut spec = pool("base", 1);
    spec.warm_max = Some(5);
    set(&daemon, vec![spec]).await;
    ready(&daemon, 1).await;
    // Eight claims at once: far faster than a member is made.
    let req = small("base");
    let claims = (0..8).map(|_| daemon.client.create_run(&req));
    let runs: Vec<Run> = futures::future::join_all(claims)
        .await
        .into_iter()
        .map(|r| r.unwrap())
        .collect();
    assert!(runs.iter().any(|r| r.pooled));
    let risen = daemon.client.pools().await.unwrap().pools[0].target;
    assert!(risen > 1, "target {risen}");
    // It fills toward the raised target ...
    ready(&daemon, 2).await;
    // ... and after quiet periods returns to warm, members and all.
    let decayed = eventually_async(Duration::from_secs(30), || async {
        let list = daemon.client.pools().await.unwrap();
        list.pools[0].target == 1 && list.pools[0].ready == 1
    })
    .await;
    assert!(decayed, "{:?}", daemon.client.pools().await.unwrap());
    for run in runs {
        daemon.client.delete_run(&run.id.to_string()).await.unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn capacity_is_429_with_retry_after_and_the_pool_unharmed_and_drain_cordons() {
    let daemon = TestDaemon::start_with(None, &["--max-runs", "1"], &[]).await;
    set(&daemon, vec![pool("base", 2)]).await;
    ready(&daemon, 2).await;
    let one = daemon.create_with(small("base")).await;
    assert!(one.pooled);
    ready(&daemon, 2).await;
    // Idle members do not count; a second run does not fit.
    let (status, body) = raw_request(
        &daemon.url,
        "POST",
        "/v1/runs",
        &daemon.token,
        br#"{"image": "base", "size": "small"}"#,
    )
    .await;
    assert_eq!(status, 429, "{body}");
    assert!(body.contains("\"capacity\""), "{body}");
    let err = daemon.client.create_run(&small("base")).await.unwrap_err();
    assert_eq!(err.code(), Some(ErrorCode::Capacity));
    let list = daemon.client.pools().await.unwrap();
    assert_eq!(list.pools[0].ready, 2, "the pool is unharmed: {list:?}");
    let info = daemon.client.info().await.unwrap();
    assert_eq!((info.capacity.max, info.capacity.live), (1, 1));
    assert!(info.storage.is_some_and(|s| s.total_bytes > 0));
    daemon.client.delete_run(&one.id.to_string()).await.unwrap();

    // Cordoned: creates are 503 draining, the pool empties.
    assert!(daemon.client.set_draining(true).await.unwrap().draining);
    let err = daemon.client.create_run(&small("base")).await.unwrap_err();
    assert_eq!(err.code(), Some(ErrorCode::Draining));
    assert!(
        eventually(Duration::from_secs(20), || sandboxes(&daemon) == 0).await,
        "{} sandboxes",
        sandboxes(&daemon)
    );
    assert!(daemon.client.info().await.unwrap().draining);
    // Uncordoned: it serves and refills.
    assert!(!daemon.client.set_draining(false).await.unwrap().draining);
    ready(&daemon, 2).await;
    let again = daemon.create_with(small("base")).await;
    assert!(again.pooled);
    daemon
        .client
        .delete_run(&again.id.to_string())
        .await
        .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn warmups_run_before_joining_and_a_failing_one_is_reported() {
    let daemon = TestDaemon::start(None).await;
    let mut warmed = pool("base", 1);
    warmed.warmup = Some(vec![
        "sh".into(),
        "-c".into(),
        "echo warmed > /tmp/warmup".into(),
    ]);
    let mut broken = pool("base", 1);
    broken.size = Some(SizeTier::Medium);
    broken.warmup = Some(vec!["sh".into(), "-c".into(), "echo no >&2; exit 3".into()]);
    set(&daemon, vec![warmed, broken]).await;
    let reported = eventually_async(Duration::from_secs(30), || async {
        let list = daemon.client.pools().await.unwrap();
        list.pools.iter().any(|p| {
            p.size == SizeTier::Medium
                && p.last_error
                    .as_deref()
                    .is_some_and(|e| e.contains("exited with 3") && e.contains("no"))
        })
    })
    .await;
    assert!(reported, "{:?}", daemon.client.pools().await.unwrap());
    let list = daemon.client.pools().await.unwrap();
    let broken = list
        .pools
        .iter()
        .find(|p| p.size == SizeTier::Medium)
        .unwrap();
    assert_eq!(broken.ready, 0);
    // The small pool fills; its member ran the warmup.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    while daemon
        .client
        .pools()
        .await
        .unwrap()
        .pools
        .iter()
        .find(|p| p.size == SizeTier::Small)
        .unwrap()
        .ready
        < 1
    {
        assert!(tokio::time::Instant::now() < deadline);
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let run = daemon.create_with(small("base")).await;
    assert!(run.pooled);
    let out = daemon.sh(&run.id.to_string(), "cat /tmp/warmup").await;
    assert_eq!(text(&out.stdout), "warmed\n");
    daemon.client.delete_run(&run.id.to_string()).await.unwrap();
    // Failed warmups leave no member behind.
    set(&daemon, Vec::new()).await;
    assert!(
        eventually(Duration::from_secs(20), || sandboxes(&daemon) == 0).await,
        "{} sandboxes",
        sandboxes(&daemon)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reimported_image_replaces_the_pools_members() {
    let daemon = TestDaemon::start(None).await;
    daemon
        .import("app", runbox_e2e::curl_tar(&[("/version", b"1\n")]))
        .await;
    set(&daemon, vec![pool("app", 1)]).await;
    ready(&daemon, 1).await;
    // Idle members do not hold the image: it can be replaced.
    daemon.client.delete_image("app").await.unwrap();
    daemon
        .import("app", runbox_e2e::curl_tar(&[("/version", b"2\n")]))
        .await;
    // Within the controller's freshness check, the member is remade.
    let replaced = eventually_async(Duration::from_secs(30), || async {
        let run = daemon.client.create_run(&small("app")).await.unwrap();
        let out = daemon.sh(&run.id.to_string(), "cat /version").await;
        let _ = daemon.client.delete_run(&run.id.to_string()).await;
        run.pooled && text(&out.stdout) == "2\n"
    })
    .await;
    assert!(replaced, "{}", daemon.log());
}

/// Processes whose root filesystem is a run of the state directory `dir`.
fn processes_rooted_in(dir: &std::path::Path) -> Vec<u32> {
    let marker = dir.to_string_lossy().into_owned();
    std::fs::read_dir("/proc")
        .unwrap()
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .filter(|pid| {
            std::fs::read_to_string(format!("/proc/{pid}/mountinfo"))
                .ok()
                .and_then(|m| m.lines().next().map(|l| l.contains(&marker)))
                .unwrap_or(false)
        })
        .collect()
}

/// A `<runtime> ... run` command of the state directory `dir` in flight.
fn runtime_run_in_flight(dir: &std::path::Path) -> Option<i32> {
    let marker = dir.join("oci").to_string_lossy().into_owned();
    std::fs::read_dir("/proc").ok()?.flatten().find_map(|e| {
        let pid: i32 = e.file_name().to_str()?.parse().ok()?;
        let cmdline = std::fs::read(e.path().join("cmdline")).ok()?;
        let args: Vec<String> = cmdline
            .split(|b| *b == 0)
            .map(|a| String::from_utf8_lossy(a).into_owned())
            .collect();
        (args.iter().any(|a| a.starts_with(&marker)) && args.iter().any(|a| a == "run"))
            .then_some(pid)
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_daemon_killed_while_refilling_leaves_nothing_after_teardown() {
    let mut daemon = TestDaemon::start(None).await;
    set(&daemon, vec![pool("base", 8)]).await;
    // Catch a member's `run` command in flight and hold it there, so it
    // outlives the daemon killed now and finishes only after teardown
    // started: what a loaded host does to a daemon killed mid-refill.
    let mut held = None;
    for _ in 0..2000 {
        if let Some(pid) = runtime_run_in_flight(daemon.state.path()) {
            // SAFETY: kill(2) on a pid just read from /proc; no memory involved.
            if unsafe { libc::kill(pid, libc::SIGSTOP) } == 0 {
                held = Some(pid);
                break;
            }
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    let held = held.expect("no runtime command caught in flight");
    daemon.kill9();
    let mut teardown = std::process::Command::new(runbox_e2e::runbox_bin())
        .args(["serve", "--teardown", "--state-dir"])
        .arg(daemon.state.path())
        .stdout(std::process::Stdio::null())
        .spawn()
        .unwrap();
    std::thread::sleep(Duration::from_millis(1500));
    // SAFETY: as above, on the process stopped there.
    unsafe { libc::kill(held, libc::SIGCONT) };
    assert!(teardown.wait().unwrap().success());
    // Give a command that outlived the teardown time to make its container.
    std::thread::sleep(Duration::from_millis(500));
    let left = processes_rooted_in(daemon.state.path());
    assert!(left.is_empty(), "processes left in its runs: {left:?}");
}
