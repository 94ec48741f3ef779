//! A user namespace for every run (`runbox serve --userns on`): root in a
//! run is an unprivileged host id, files keep the owners the run gave them,
//! ranges are never shared, and nothing is left behind — on every installed
//! runtime, with real namespaces, idmapped mounts and the btrfs run store.

use std::os::unix::fs::MetadataExt;
use std::path::Path;

use runbox_e2e::{mounts_under, netns_exists, TestDaemon};
use runbox_types::CreateRunRequest;

/// The first host id of the default range pool.
const POOL_START: u64 = 1_879_048_192;

async fn daemon(runtime: &str) -> TestDaemon {
    TestDaemon::start_with(Some(runtime), &["--userns", "on"], &[]).await
}

async fn out(daemon: &TestDaemon, id: &str, script: &str) -> String {
    let out = daemon.sh(id, script).await;
    assert_eq!(
        out.exit.exit_code,
        0,
        "{script}: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// The host id a run's uid 0 is, from its own `/proc/self/uid_map`.
async fn base_of(daemon: &TestDaemon, id: &str) -> u64 {
    let map = out(daemon, id, "cat /proc/self/uid_map").await;
    let fields: Vec<u64> = map
        .split_whitespace()
        .map(|f| f.parse().expect("a number"))
        .collect();
    assert_eq!(fields.len(), 3, "one line: {map}");
    assert_eq!((fields[0], fields[2]), (0, 65536), "{map}");
    fields[1]
}

fn owner(path: &Path) -> (u32, u32) {
    let meta =
        std::fs::symlink_metadata(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    (meta.uid(), meta.gid())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn root_in_a_run_is_an_unprivileged_host_id_and_files_keep_their_owners() {
    for runtime in runbox_e2e::runtimes() {
        let mut daemon = daemon(&runtime).await;
        assert_eq!(daemon.client.info().await.unwrap().userns, "private");
        let run = daemon.create().await.id.to_string();
        let base = base_of(&daemon, &run).await;
        assert!(base >= POOL_START && base % 65536 == 0, "{runtime}: {base}");
        // Inside: root, and the image's files owned as the image says.
        assert_eq!(
            out(&daemon, &run, "id -u; stat -c %u /bin/busybox /").await,
            "0\n0\n0\n"
        );
        // A file root makes, and one uid 1000 makes, on the host.
        out(
            &daemon,
            &run,
            "touch /work/root-made; mkdir /work/bob; chown 1000:1000 /work/bob",
        )
        .await;
        let bob = daemon
            .exec(
                &run,
                runbox_types::ExecRequest {
                    cmd: vec!["touch".into(), "/work/bob/bob-made".into()],
                    user: Some("1000".into()),
                    ..Default::default()
                },
            )
            .await;
        assert_eq!(bob.exit.exit_code, 0, "{bob:?}");
        let upper = daemon
            .state
            .path()
            .join("runs")
            .join(&run)
            .join("disk/upper/work");
        let b = base as u32;
        assert_eq!(owner(&upper.join("root-made")), (b, b));
        // (A bare uid runs with gid 0.)
        assert_eq!(owner(&upper.join("bob/bob-made")), (b + 1000, b));
        // An upload is owned by the run's root too.
        daemon
            .client
            .put_file(&run, "uploaded", b"data".to_vec().into())
            .await
            .unwrap();
        assert_eq!(owner(&upper.join("uploaded")).0, b);
        // Making a user namespace inside stays refused.
        let nested = daemon.sh(&run, "unshare -U true").await;
        assert_ne!(
            nested.exit.exit_code, 0,
            "{runtime}: a nested user namespace"
        );

        // Another run, and a fork, each get a range of their own; the fork
        // sees its parent's files with the same owners.
        let other = daemon.create().await.id.to_string();
        let fork = daemon.fork_one(&run).await.id.to_string();
        let bases = [
            base,
            base_of(&daemon, &other).await,
            base_of(&daemon, &fork).await,
        ];
        assert!(
            bases[0] != bases[1] && bases[1] != bases[2] && bases[0] != bases[2],
            "{bases:?}"
        );
        assert_eq!(
            out(
                &daemon,
                &fork,
                "stat -c %u /work/root-made /work/bob/bob-made"
            )
            .await,
            "0\n1000\n"
        );
        // A snapshot of the run boots in yet another range, owners intact.
        daemon
            .client
            .snapshot_run(&run, Some("userns-snap"))
            .await
            .unwrap();
        let from_snapshot = daemon
            .create_with(CreateRunRequest {
                image: "userns-snap".into(),
                ..Default::default()
            })
            .await
            .id
            .to_string();
        assert!(!bases.contains(&base_of(&daemon, &from_snapshot).await));
        assert_eq!(
            out(
                &daemon,
                &from_snapshot,
                "stat -c %u /work/root-made /work/bob/bob-made"
            )
            .await,
            "0\n1000\n"
        );

        // A restarted daemon keeps every run's range and hands out others.
        daemon.kill9();
        daemon.spawn().await;
        assert_eq!(base_of(&daemon, &run).await, base);
        let after = daemon.create().await.id.to_string();
        let after_base = base_of(&daemon, &after).await;
        assert!(!bases.contains(&after_base), "{after_base} reused");

        // Hibernate and wake: the same range, the same files.
        daemon.client.hibernate_run(&run).await.unwrap();
        daemon.client.wake_run(&run).await.unwrap();
        assert_eq!(base_of(&daemon, &run).await, base);
        assert_eq!(out(&daemon, &run, "cat /work/uploaded").await, "data");

        // Deleted, a run leaves no mount, pin or namespace behind, and its
        // range is free again.
        for id in [&run, &other, &fork, &from_snapshot, &after] {
            daemon.client.delete_run(id).await.unwrap();
            assert!(!netns_exists(id));
            let mounts = mounts_under(daemon.state.path());
            assert!(
                mounts.iter().all(|m| !m.contains(id.as_str())),
                "{mounts:?}"
            );
        }
        let again = daemon.create().await.id.to_string();
        assert_eq!(
            base_of(&daemon, &again).await,
            base,
            "the lowest free range"
        );
        daemon.client.delete_run(&again).await.unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fork_uses_its_parents_layer_as_stored_and_holds_that_range() {
    for runtime in runbox_e2e::runtimes() {
        let mut daemon = daemon(&runtime).await;
        let parent = daemon.create().await.id.to_string();
        let p = base_of(&daemon, &parent).await;
        out(
            &daemon,
            &parent,
            "echo a > /work/a; chown 1000:1000 /work/a; mkdir /work/deep; echo d > /work/deep/d",
        )
        .await;
        let fork = daemon.fork_one(&parent).await.id.to_string();
        let f = base_of(&daemon, &fork).await;
        assert_ne!(f, p);
        // Inside, the fork's own range; its parent's files as they were.
        assert_eq!(
            out(
                &daemon,
                &fork,
                "stat -c %u /work/a /work/deep/d; echo b > /work/b; id -u"
            )
            .await,
            "1000\n0\n0\n"
        );
        // On the disk the layer keeps the ids it was stored with: nothing
        // was walked or chowned, and the fork's writes join them.
        let disk = daemon.state.path().join("runs").join(&fork).join("disk");
        let recorded = std::fs::read_to_string(disk.join("idbase")).unwrap();
        assert_eq!(recorded.trim().parse::<u64>().unwrap(), p, "{runtime}");
        let pu = p as u32;
        assert_eq!(owner(&disk.join("upper/work/a")), (pu + 1000, pu + 1000));
        assert_eq!(owner(&disk.join("upper/work/b")), (pu, pu));

        // The parent's range stays held while the fork's disk uses it,
        // across a restart too.
        daemon.client.delete_run(&parent).await.unwrap();
        let other = daemon.create().await.id.to_string();
        assert_ne!(base_of(&daemon, &other).await, p, "{runtime}");
        daemon.kill9();
        daemon.spawn().await;
        let after = daemon.create().await.id.to_string();
        assert_ne!(
            base_of(&daemon, &after).await,
            p,
            "{runtime}: after a restart"
        );
        // Hibernated and woken, and snapshotted: the same files, owners.
        daemon.client.hibernate_run(&fork).await.unwrap();
        daemon.client.wake_run(&fork).await.unwrap();
        assert_eq!(base_of(&daemon, &fork).await, f);
        daemon
            .client
            .snapshot_run(&fork, Some("fork-snap"))
            .await
            .unwrap();
        let from_snapshot = daemon
            .create_with(CreateRunRequest {
                image: "fork-snap".into(),
                ..Default::default()
            })
            .await
            .id
            .to_string();
        let script = "stat -c %u /work/a /work/b /work/deep/d; cat /work/b";
        assert_eq!(out(&daemon, &fork, script).await, "1000\n0\n0\nb\n");
        assert_eq!(
            out(&daemon, &from_snapshot, script).await,
            "1000\n0\n0\nb\n"
        );
        // A fork of the fork: the same stored ids, a range of its own.
        let grandchild = daemon.fork_one(&fork).await.id.to_string();
        assert_eq!(out(&daemon, &grandchild, script).await, "1000\n0\n0\nb\n");

        // Once its last holder is gone the range is free again.
        for id in [&fork, &grandchild] {
            daemon.client.delete_run(id).await.unwrap();
        }
        let again = daemon.create().await.id.to_string();
        assert_eq!(base_of(&daemon, &again).await, p, "{runtime}");
        for id in [&other, &after, &from_snapshot, &again] {
            daemon.client.delete_run(id).await.unwrap();
        }
        daemon.client.delete_image("fork-snap").await.unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_burst_of_creates_and_forks_gets_disjoint_ranges() {
    let daemon = TestDaemon::start_with(None, &["--userns", "on", "--max-runs", "32"], &[]).await;
    let parent = daemon.create().await.id.to_string();
    out(&daemon, &parent, "echo from-parent > /work/mark").await;
    let fork = || async {
        daemon
            .client
            .fork_run(
                &parent,
                &runbox_types::ForkRequest {
                    count: 3,
                    ..Default::default()
                },
            )
            .await
            .map(|f| f.runs.into_iter().map(|r| r.id.to_string()).collect())
    };
    let create = || async {
        daemon
            .client
            .create_run(&CreateRunRequest {
                image: "base".into(),
                ..Default::default()
            })
            .await
            .map(|r| vec![r.id.to_string()])
    };
    let mut burst: Vec<std::pin::Pin<Box<dyn std::future::Future<Output = _> + Send>>> = Vec::new();
    for i in 0..12 {
        if i % 4 == 0 {
            burst.push(Box::pin(fork()));
        } else {
            burst.push(Box::pin(create()));
        }
    }
    let mut ids = vec![parent.clone()];
    for made in futures::future::join_all(burst).await {
        ids.extend(made.unwrap_or_else(|e| panic!("{e}; daemon log:\n{}", daemon.log())));
    }
    assert_eq!(ids.len(), 1 + 3 * 3 + 9);
    let mut bases = Vec::new();
    for id in &ids {
        bases.push(base_of(&daemon, id).await);
    }
    let mut distinct = bases.clone();
    distinct.sort_unstable();
    distinct.dedup();
    assert_eq!(distinct.len(), bases.len(), "{bases:?}");
    // Each range is the one its run's directory records.
    for (id, base) in ids.iter().zip(&bases) {
        let recorded =
            std::fs::read_to_string(daemon.state.path().join("runs").join(id).join("idbase"))
                .unwrap();
        assert_eq!(recorded.trim().parse::<u64>().unwrap(), *base, "{id}");
    }
    for id in &ids {
        daemon.client.delete_run(id).await.unwrap();
    }
}

/// A setuid program of the tests' own: prints the effective uid it runs
/// with and creates the file its argument names (busybox would drop the
/// set-id bit itself, and the test image has nothing else).
const PROBE_C: &str = r#"
#include <stdio.h>
#include <unistd.h>
int main(int argc, char **argv) {
    printf("%d\n", (int)geteuid());
    if (argc > 1) {
        FILE *f = fopen(argv[1], "w");
        if (!f) { perror(argv[1]); return 2; }
        fclose(f);
    }
    return 0;
}
"#;

fn setuid_probe() -> Vec<u8> {
    let dir = tempfile::tempdir().unwrap();
    let src = dir.path().join("probe.c");
    std::fs::write(&src, PROBE_C).unwrap();
    let bin = dir.path().join("probe");
    let status = std::process::Command::new("cc")
        .args(["-static", "-O1", "-o"])
        .arg(&bin)
        .arg(&src)
        .status()
        .expect("running cc");
    assert!(status.success(), "compiling the setuid probe");
    std::fs::read(&bin).unwrap()
}

/// Runs the probe as uid 1000 in `run`; its output and the host owner of
/// the file it made.
async fn probe_as_user(daemon: &TestDaemon, run: &str, probe: &[u8]) -> (String, u32) {
    daemon
        .client
        .put_file(run, "probe", probe.to_vec().into())
        .await
        .unwrap();
    out(
        daemon,
        run,
        "chown 0:0 /work/probe && chmod 4755 /work/probe && mkdir -m 777 /work/shared",
    )
    .await;
    let probed = daemon
        .exec(
            run,
            runbox_types::ExecRequest {
                cmd: vec!["/work/probe".into(), "/work/shared/made".into()],
                user: Some("1000".into()),
                ..Default::default()
            },
        )
        .await;
    assert_eq!(probed.exit.exit_code, 0, "{probed:?}");
    let made = daemon
        .state
        .path()
        .join("runs")
        .join(run)
        .join("disk/upper/work/shared/made");
    (
        String::from_utf8_lossy(&probed.stdout).into_owned(),
        owner(&made).0,
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn setuid_programs_raise_privileges_only_in_runs_that_allow_it_and_only_inside() {
    let probe = setuid_probe();
    for runtime in runbox_e2e::runtimes() {
        let daemon = daemon(&runtime).await;
        // By default a setuid program runs as its caller.
        let strict = daemon.create().await;
        assert!(!strict.allow_privilege_escalation);
        let strict = strict.id.to_string();
        let strict_base = base_of(&daemon, &strict).await as u32;
        assert_eq!(
            probe_as_user(&daemon, &strict, &probe).await,
            ("1000\n".to_owned(), strict_base + 1000),
            "{runtime}"
        );
        // Allowed, it runs as root in the run: the run's base on the host.
        let loose = daemon
            .create_with(CreateRunRequest {
                image: "base".into(),
                allow_privilege_escalation: Some(true),
                ..Default::default()
            })
            .await;
        assert!(loose.allow_privilege_escalation);
        let loose = loose.id.to_string();
        let loose_base = base_of(&daemon, &loose).await as u32;
        assert_eq!(
            probe_as_user(&daemon, &loose, &probe).await,
            ("0\n".to_owned(), loose_base),
            "{runtime}"
        );
        // A fork keeps its parent's choice.
        let fork = daemon.fork_one(&loose).await;
        assert!(fork.allow_privilege_escalation);
        for id in [strict, loose, fork.id.to_string()] {
            daemon.client.delete_run(&id).await.unwrap();
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bad_range_stops_the_start_and_off_is_reported() {
    let state = tempfile::tempdir().unwrap();
    let out = std::process::Command::new(runbox_e2e::runbox_bin())
        .args([
            "serve",
            "--listen",
            "127.0.0.1:0",
            "--userns",
            "on",
            "--userns-range",
            "0:65536",
        ])
        .arg("--state-dir")
        .arg(state.path())
        .output()
        .unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("--userns-range") && stderr.contains("65536"),
        "{stderr}"
    );
    let daemon = TestDaemon::start_with(None, &["--userns", "off"], &[]).await;
    assert_eq!(daemon.client.info().await.unwrap().userns, "off");
    let run = daemon.create().await.id.to_string();
    assert_eq!(
        daemon.sh(&run, "cat /proc/self/uid_map").await.stdout,
        b"         0          0 4294967295\n"
    );
    // Root in these runs is root on the host: no setuid escalation.
    let err = daemon
        .client
        .create_run(&CreateRunRequest {
            image: "base".into(),
            allow_privilege_escalation: Some(true),
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert!(
        matches!(&err, runbox_client::ClientError::Api { status: 400, code, .. } if code == "escalation_unsupported"),
        "{err}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_state_directory_is_opened_to_runs_only_as_far_as_needed() {
    // The default (auto) on a state directory made private by its maker.
    let daemon = TestDaemon::start(None).await;
    let mode = |p: &Path| std::fs::metadata(p).unwrap().mode() & 0o7777;
    let state = daemon.state.path();
    assert_eq!(daemon.client.info().await.unwrap().userns, "private");
    assert_eq!(mode(state) & 0o001, 0o001, "others may pass through");
    assert_eq!(mode(&state.join("images")), 0o700);
    assert_eq!(mode(&state.join("checkpoints")), 0o700);
    assert_eq!(mode(&state.join("runbox.db")), 0o600);
    assert_eq!(mode(&state.join("token")), 0o600);
    let run = daemon.create().await.id.to_string();
    let dir = state.join("runs").join(&run);
    assert_eq!(mode(&dir), 0o710);
    assert_eq!(owner(&dir).1 as u64, base_of(&daemon, &run).await);

    // A directory above the state directory that lets no one through:
    // `on` refuses to start and says which, `auto` runs without.
    let private = tempfile::tempdir().unwrap();
    std::fs::set_permissions(
        private.path(),
        std::os::unix::fs::PermissionsExt::from_mode(0o700),
    )
    .unwrap();
    let nested = private.path().join("state");
    let out = std::process::Command::new(runbox_e2e::runbox_bin())
        .args([
            "serve",
            "--listen",
            "127.0.0.1:0",
            "--userns",
            "on",
            "--storage-gb",
            "0",
        ])
        .arg("--state-dir")
        .arg(&nested)
        .output()
        .unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains(&private.path().display().to_string()) && stderr.contains("--userns off"),
        "{stderr}"
    );
}
