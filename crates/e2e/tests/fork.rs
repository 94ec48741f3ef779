//! Forks: children that start from a parent's filesystem at one instant,
//! sharing its blocks (writable snapshots of one capture), and never see
//! each other's later writes.

use runbox_e2e::TestDaemon;
use runbox_types::{ErrorCode, ForkRequest, RunStatus};

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn four_children_start_from_the_parent_and_then_go_their_own_ways() {
    let daemon = TestDaemon::start(None).await;
    let parent = daemon
        .create_limited(runbox_types::LimitsRequest {
            disk_mb: Some(256),
            memory_mb: Some(256),
            ..Default::default()
        })
        .await;
    daemon
        .sh(
            &parent,
            "echo base > /work/shared.txt; rm /etc/group; sleep 1000 > /dev/null 2>&1 &",
        )
        .await;
    let forked = daemon
        .client
        .fork_run(
            &parent,
            &ForkRequest {
                count: 4,
                ttl_sec: Some(600),
                point: None,
            },
        )
        .await
        .unwrap();
    assert_eq!(forked.runs.len(), 4);
    let children: Vec<String> = forked.runs.iter().map(|r| r.id.to_string()).collect();
    for run in &forked.runs {
        assert_eq!(run.status, RunStatus::Running);
        // Inherited: image and limits; own: id, TTL, no lease.
        assert_eq!(run.image, "base");
        assert_eq!(run.limits.disk_mb, Some(256));
        assert_eq!(run.limits.memory_mb, 256);
        assert!(run.lease.is_none());
        assert!(run.expires_at - run.created_at <= time::Duration::seconds(600));
    }
    // Each child sees the parent's files (deletion included), but not its
    // processes: the sleep stayed in the parent.
    for child in &children {
        let out = daemon
            .sh(
                child,
                "cat /work/shared.txt; [ -e /etc/group ] && echo group; \
                 pgrep sleep > /dev/null && echo sleeping; true",
            )
            .await;
        assert_eq!(text(&out.stdout), "base\n", "{}", text(&out.stderr));
    }
    // Later writes stay where they were made.
    daemon
        .sh(
            &children[0],
            "echo mine > /work/shared.txt; echo new > /work/c0",
        )
        .await;
    daemon.sh(&parent, "echo parent > /work/p").await;
    for (i, child) in children.iter().enumerate().skip(1) {
        let out = daemon.sh(child, "cat /work/shared.txt; ls /work").await;
        assert_eq!(text(&out.stdout), "base\nshared.txt\n", "child {i}");
    }
    let out = daemon.sh(&parent, "cat /work/shared.txt; ls /work").await;
    assert_eq!(text(&out.stdout), "base\np\nshared.txt\n");
    // Each child has its own disk, limited like the parent's.
    let out = daemon
        .sh(
            &children[1],
            "dd if=/dev/zero of=/work/big bs=1M count=400 2>&1; true",
        )
        .await;
    assert!(
        text(&out.stdout).contains("Disk quota exceeded"),
        "{}",
        text(&out.stdout)
    );
    // No capture is left once the children exist; deleting the parent
    // leaves the children as they are.
    assert_eq!(
        std::fs::read_dir(daemon.state.path().join("runs/.captures"))
            .map(|d| d.count())
            .unwrap_or(0),
        0
    );
    daemon.client.delete_run(&parent).await.unwrap();
    let out = daemon.sh(&children[2], "cat /work/shared.txt").await;
    assert_eq!(text(&out.stdout), "base\n");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_forks_are_refused_and_make_nothing() {
    let daemon =
        TestDaemon::start_with(None, &["--max-fork-count", "3", "--max-runs", "4"], &[]).await;
    let parent = daemon.create().await.id.to_string();
    for count in [0, 4] {
        let err = daemon
            .client
            .fork_run(
                &parent,
                &ForkRequest {
                    count,
                    ttl_sec: None,
                    point: None,
                },
            )
            .await
            .unwrap_err();
        assert_eq!(err.code(), Some(ErrorCode::BadRequest), "{err}");
    }
    let err = daemon
        .client
        .fork_run(
            &ulid::Ulid::new().to_string(),
            &ForkRequest {
                count: 1,
                ttl_sec: None,
                point: None,
            },
        )
        .await
        .unwrap_err();
    assert_eq!(err.code(), Some(ErrorCode::RunNotFound), "{err}");
    // Beyond capacity (1 run + 3 children fits 4; 2 + 3 does not).
    daemon.create().await;
    let err = daemon
        .client
        .fork_run(
            &parent,
            &ForkRequest {
                count: 3,
                ttl_sec: None,
                point: None,
            },
        )
        .await
        .unwrap_err();
    assert_eq!(err.code(), Some(ErrorCode::Capacity), "{err}");
    assert_eq!(daemon.client.list_runs().await.unwrap().runs.len(), 2);
}
