//! Disk limits: every run writes into its own btrfs subvolume with a qgroup
//! limit, in the daemon's run store (`--storage-gb`). Past the limit the run
//! gets "Disk quota exceeded" while the host, the daemon and other runs carry
//! on; storage that cannot enforce a limit refuses the run instead.

use std::os::unix::fs::MetadataExt;
use std::path::Path;

use runbox_e2e::TestDaemon;
use runbox_types::{CreateRunRequest, ErrorCode, LimitsRequest};

/// Host bytes the run store's image takes (its allocated blocks).
fn store_allocated(state: &Path) -> u64 {
    std::fs::metadata(state.join("storage.img"))
        .expect("the run store image")
        .blocks()
        * 512
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_run_writing_past_its_limit_is_stopped_and_nothing_else_is() {
    let daemon = TestDaemon::start(None).await;
    // The default, shown on the run.
    let plain = daemon.create().await;
    assert_eq!(plain.limits.disk_mb, Some(10 * 1024));
    let id = daemon
        .create_limited(LimitsRequest {
            disk_mb: Some(64),
            ..Default::default()
        })
        .await;
    let before = store_allocated(daemon.state.path());

    let out = daemon
        .sh(
            &id,
            "dd if=/dev/zero of=/work/big bs=1M count=256; echo rc=$?; sync; \
             ls -l /work/big",
        )
        .await;
    let (stdout, stderr) = (text(&out.stdout), text(&out.stderr));
    assert!(stderr.contains("Disk quota exceeded"), "{stderr}");
    assert!(stdout.contains("rc=1"), "{stdout}");
    let size: u64 = stdout
        .lines()
        .last()
        .and_then(|l| l.split_whitespace().nth(4))
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no size in {stdout:?}"));
    assert!((32 << 20..=64 << 20).contains(&size), "wrote {size} bytes");

    // The host paid for what the run wrote and no more (plus the
    // filesystem's own metadata).
    let grown = store_allocated(daemon.state.path()).saturating_sub(before);
    assert!(grown <= (64 + 48) << 20, "the store grew by {grown} bytes");

    // The run's JSON shows what it used against its limit.
    let run = daemon.client.get_run(&id).await.unwrap();
    assert_eq!(run.limits.disk_mb, Some(64));
    let used = run.disk_used_bytes.expect("disk use is counted");
    assert!((32 << 20..=64 << 20).contains(&used), "used {used}");

    // Another run writes as usual, and the full one recovers once it
    // deletes what it wrote.
    let other = plain.id.to_string();
    let out = daemon
        .sh(
            &other,
            "dd if=/dev/zero of=/work/f bs=1M count=16 2>&1 && echo ok",
        )
        .await;
    assert!(text(&out.stdout).contains("ok"), "{}", text(&out.stdout));
    let out = daemon
        .sh(
            &id,
            "rm /work/big && sync && echo again > /work/small && cat /work/small",
        )
        .await;
    assert_eq!(text(&out.stdout), "again\n", "{}", text(&out.stderr));

    // Deleting the run deletes its subvolume.
    daemon.client.delete_run(&id).await.unwrap();
    assert!(!daemon.state.path().join("runs").join(&id).exists());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_run_making_millions_of_empty_files_is_stopped_too() {
    let daemon = TestDaemon::start(None).await;
    let id = daemon
        .create_limited(LimitsRequest {
            disk_mb: Some(16),
            ..Default::default()
        })
        .await;
    // xargs stops at the first batch that fails (exit 255), so the run
    // tries a million files but stops where the limit bites.
    let out = daemon
        .sh(
            &id,
            "mkdir /work/many && cd /work/many && \
             seq 1 1000000 | xargs sh -c 'touch \"$@\" || exit 255' touch; \
             echo files=$(ls | wc -l)",
        )
        .await;
    let (stdout, stderr) = (text(&out.stdout), text(&out.stderr));
    assert!(stderr.contains("Disk quota exceeded"), "{stderr}");
    let files: u64 = stdout
        .trim()
        .strip_prefix("files=")
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("{stdout}"));
    assert!(files > 1000 && files < 1_000_000, "{files} files");
    // The daemon still serves the run.
    let out = daemon.sh(&id, "echo alive").await;
    assert_eq!(text(&out.stdout), "alive\n");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn disk_limits_are_checked_against_the_servers_bounds() {
    let daemon = TestDaemon::start_with(None, &["--max-disk-mb", "2048"], &[]).await;
    // The default never exceeds the maximum.
    assert_eq!(daemon.create().await.limits.disk_mb, Some(2048));
    for (disk, says) in [(4096, "maximum of 2048"), (1, "at least 16")] {
        let err = daemon
            .client
            .create_run(&CreateRunRequest {
                image: "base".into(),
                limits: Some(LimitsRequest {
                    disk_mb: Some(disk),
                    ..Default::default()
                }),
                ..Default::default()
            })
            .await
            .unwrap_err();
        assert_eq!(err.code(), Some(ErrorCode::BadLimits));
        assert!(err.to_string().contains(says), "{err}");
    }
    // The CLI takes units.
    let out = std::process::Command::new(runbox_e2e::runbox_bin())
        .args(["run", "create", "--image", "base", "--disk", "1G", "--json"])
        .env("RUNBOX_URL", &daemon.url)
        .env("RUNBOX_TOKEN", &daemon.token)
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", text(&out.stderr));
    let run: runbox_types::Run = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(run.limits.disk_mb, Some(1024));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bare_daemon_makes_a_store_of_its_own_and_keeps_it() {
    let mut daemon = TestDaemon::start_bare(&[]).await;
    let image = daemon.state.path().join("storage.img");
    let size = std::fs::metadata(&image).expect("a store of its own").len();
    assert!((2 << 30..=100 << 30).contains(&size), "{size}");
    let run = daemon.create().await;
    assert!(run.limits.disk_mb.is_some(), "runs get disk limits");
    assert!(daemon.log().contains("making a run store of its own"));
    // The next start keeps the store it made.
    daemon.kill9();
    daemon.spawn().await;
    assert_eq!(std::fs::metadata(&image).unwrap().len(), size);
    let out = daemon.sh(&run.id.to_string(), "echo kept").await;
    assert_eq!(String::from_utf8_lossy(&out.stdout), "kept\n");
    daemon.client.delete_run(&run.id.to_string()).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn storage_that_cannot_limit_refuses_runs_and_says_what_to_do() {
    let daemon = TestDaemon::start_without_store(&[]).await;
    let err = daemon
        .client
        .create_run(&CreateRunRequest {
            image: "base".into(),
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), Some(ErrorCode::DiskLimitUnsupported));
    let message = err.to_string();
    assert!(
        message.contains("--storage-gb") && message.contains("--no-disk-limits"),
        "{message}"
    );
    assert!(daemon.client.list_runs().await.unwrap().runs.is_empty());
    assert!(daemon.log().contains("creates are refused"));

    // An operator who turns limits off gets runs without one, said so.
    let daemon = TestDaemon::start_without_store(&["--no-disk-limits"]).await;
    let run = daemon.create().await;
    assert_eq!(run.limits.disk_mb, None);
    assert_eq!(run.disk_used_bytes, None);
    let err = daemon
        .client
        .create_run(&CreateRunRequest {
            image: "base".into(),
            limits: Some(LimitsRequest {
                disk_mb: Some(100),
                ..Default::default()
            }),
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), Some(ErrorCode::BadLimits));
    assert!(err.to_string().contains("--no-disk-limits"), "{err}");
}
