//! Named volumes: data that outlives runs, a daemon restart and `kill -9`;
//! one writer or many readers; the volume's own size limit; hostile names
//! and mounts refused — with the real runtimes, user namespaces (the
//! default) and the btrfs run store.

use std::os::unix::fs::MetadataExt;

use runbox_client::ClientError;
use runbox_e2e::TestDaemon;
use runbox_types::{CreateRunRequest, CreateVolumeRequest, VolumeMode, VolumeMountRequest};

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

async fn volume(daemon: &TestDaemon, name: &str, size_mb: Option<u64>) -> runbox_types::Volume {
    daemon
        .client
        .create_volume(&CreateVolumeRequest {
            name: name.into(),
            size_mb,
            labels: None,
        })
        .await
        .unwrap_or_else(|e| panic!("making volume {name}: {e}; log:\n{}", daemon.log()))
}

fn mount(name: &str, path: Option<&str>, mode: Option<VolumeMode>) -> VolumeMountRequest {
    VolumeMountRequest {
        name: name.into(),
        path: path.map(str::to_owned),
        mode,
    }
}

fn with(mounts: Vec<VolumeMountRequest>) -> CreateRunRequest {
    CreateRunRequest {
        image: "base".into(),
        volumes: Some(mounts),
        ..Default::default()
    }
}

async fn refused(daemon: &TestDaemon, req: CreateRunRequest) -> (u16, String, String) {
    match daemon.client.create_run(&req).await {
        Err(ClientError::Api {
            status,
            code,
            message,
            ..
        }) => (status, code, message),
        other => panic!("expected a refusal, got {other:?}"),
    }
}

async fn ok(daemon: &TestDaemon, id: &str, script: &str) -> String {
    let out = daemon.sh(id, script).await;
    assert_eq!(
        out.exit.exit_code,
        0,
        "{script}: {}{}",
        text(&out.stdout),
        text(&out.stderr)
    );
    text(&out.stdout)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn volume_data_outlives_its_runs_a_restart_and_a_kill_9() {
    for runtime in runbox_e2e::runtimes() {
        let mut daemon = TestDaemon::start(Some(&runtime)).await;
        let made = volume(&daemon, "data", Some(64)).await;
        assert_eq!((made.size_mb, made.holders.len()), (64, 0));
        // A writer: root's files and uid 1000's.
        let writer = daemon
            .create_with(with(vec![mount("data", None, None)]))
            .await;
        assert_eq!(writer.volumes.len(), 1);
        assert_eq!(
            (writer.volumes[0].path.as_str(), writer.volumes[0].mode),
            ("/volumes/data", VolumeMode::Rw)
        );
        let w = writer.id.to_string();
        ok(
            &daemon,
            &w,
            "echo kept > /volumes/data/f; mkdir /volumes/data/bob; chown 1000:1000 /volumes/data/bob; \
             echo b > /volumes/data/bob/b; chown 1000:1000 /volumes/data/bob/b",
        )
        .await;
        // On the host the files keep the ids the run saw: a volume moves
        // between runs of any range.
        let stored = daemon
            .state
            .path()
            .join("runs/.volumes")
            .join(made.id.to_string());
        assert_eq!(std::fs::metadata(stored.join("f")).unwrap().uid(), 0);
        assert_eq!(std::fs::metadata(stored.join("bob/b")).unwrap().uid(), 1000);
        // Not the run's: a snapshot carries none of it.
        daemon.client.delete_run(&w).await.unwrap();

        // A reader elsewhere, after a kill -9.
        daemon.kill9();
        daemon.spawn().await;
        let reader = daemon
            .create_with(with(vec![mount(
                "data",
                Some("/mnt/data"),
                Some(VolumeMode::Ro),
            )]))
            .await
            .id
            .to_string();
        assert_eq!(
            ok(
                &daemon,
                &reader,
                "cat /mnt/data/f; stat -c %u /mnt/data/f /mnt/data/bob/b"
            )
            .await,
            "kept\n0\n1000\n"
        );
        let write = daemon.sh(&reader, "touch /mnt/data/new").await;
        assert_ne!(write.exit.exit_code, 0, "{runtime}: a read-only mount");
        assert!(
            text(&write.stderr).contains("Read-only"),
            "{}",
            text(&write.stderr)
        );
        let listed = daemon.client.get_volume("data").await.unwrap();
        assert_eq!(listed.holders.len(), 1);
        assert_eq!(listed.holders[0].mode, VolumeMode::Ro);
        assert_eq!(listed.holders[0].run.to_string(), reader);

        // Hibernated, the run still holds it; woken, it mounts it again.
        daemon.client.hibernate_run(&reader).await.unwrap();
        let busy = daemon.client.delete_volume("data").await.unwrap_err();
        assert!(
            matches!(&busy, ClientError::Api { status: 409, code, message, .. }
                if code == "volume_busy" && message.contains(&reader)),
            "{busy}"
        );
        assert_eq!(ok(&daemon, &reader, "cat /mnt/data/f").await, "kept\n");
        // A fork or a snapshot takes the run's files, never its volumes,
        // and says so.
        let forked = daemon
            .client
            .fork_run(
                &reader,
                &runbox_types::ForkRequest {
                    count: 1,
                    ..Default::default()
                },
            )
            .await
            .unwrap();
        assert_eq!(forked.volumes_excluded, ["data"]);
        let fork = &forked.runs[0];
        assert!(fork.volumes.is_empty());
        let fork = fork.id.to_string();
        let snapshot = daemon.client.snapshot_run(&reader, None).await.unwrap();
        assert_eq!(snapshot.volumes_excluded, ["data"]);
        daemon.client.delete_image(&snapshot.image).await.unwrap();
        assert_eq!(
            ok(
                &daemon,
                &fork,
                "[ -e /mnt/data/f ] && echo there || echo gone"
            )
            .await,
            "gone\n"
        );

        for id in [&reader, &fork] {
            daemon.client.delete_run(id).await.unwrap();
        }
        daemon.client.delete_volume("data").await.unwrap();
        assert!(!stored.exists(), "the volume's subvolume is gone");
        let gone = daemon.client.get_volume("data").await.unwrap_err();
        assert!(
            matches!(&gone, ClientError::Api { status: 404, code, .. } if code == "volume_not_found"),
            "{gone}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_writer_or_many_readers_also_after_a_restart() {
    let mut daemon = TestDaemon::start(None).await;
    volume(&daemon, "shared", Some(32)).await;
    let writer = daemon
        .create_with(with(vec![mount("shared", None, None)]))
        .await
        .id
        .to_string();
    for mode in [None, Some(VolumeMode::Ro)] {
        let (status, code, message) =
            refused(&daemon, with(vec![mount("shared", None, mode)])).await;
        assert_eq!((status, code.as_str()), (409, "volume_busy"));
        assert!(message.contains(&writer), "{message}");
    }
    daemon.client.delete_run(&writer).await.unwrap();
    let readers: Vec<String> = {
        let mut out = Vec::new();
        for _ in 0..2 {
            let run = daemon
                .create_with(with(vec![mount("shared", None, Some(VolumeMode::Ro))]))
                .await;
            out.push(run.id.to_string());
        }
        out
    };
    daemon.kill9();
    daemon.spawn().await;
    let (status, code, _) = refused(&daemon, with(vec![mount("shared", None, None)])).await;
    assert_eq!(
        (status, code.as_str()),
        (409, "volume_busy"),
        "after a restart"
    );
    assert_eq!(
        daemon
            .client
            .get_volume("shared")
            .await
            .unwrap()
            .holders
            .len(),
        2
    );
    for id in &readers {
        daemon.client.delete_run(id).await.unwrap();
    }
    let writer = daemon
        .create_with(with(vec![mount("shared", None, None)]))
        .await
        .id
        .to_string();
    daemon.client.delete_run(&writer).await.unwrap();
    daemon.client.delete_volume("shared").await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_volume_fails_the_writer_not_the_host_or_the_run() {
    let daemon = TestDaemon::start(None).await;
    volume(&daemon, "small", Some(8)).await;
    let run = daemon
        .create_with(with(vec![mount("small", None, None)]))
        .await
        .id
        .to_string();
    let full = daemon
        .sh(
            &run,
            "dd if=/dev/zero of=/volumes/small/big bs=1M count=64 2>&1; sync; echo rc=$?",
        )
        .await;
    let said = text(&full.stdout);
    assert!(said.contains("Disk quota exceeded"), "{said}");
    // The run's own disk is not the volume's.
    assert_eq!(
        ok(
            &daemon,
            &run,
            "dd if=/dev/zero of=/work/x bs=1M count=16 2>/dev/null && echo fine"
        )
        .await,
        "fine\n"
    );
    daemon.client.delete_run(&run).await.unwrap();
    daemon.client.delete_volume("small").await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hostile_names_sizes_and_mounts_are_refused() {
    let daemon = TestDaemon::start(None).await;
    for name in [
        "",
        "../x",
        "a/b",
        ".hidden",
        "-x",
        "a b",
        "é",
        &"x".repeat(64),
    ] {
        let err = daemon
            .client
            .create_volume(&CreateVolumeRequest {
                name: name.into(),
                size_mb: None,
                labels: None,
            })
            .await
            .unwrap_err();
        assert!(
            matches!(&err, ClientError::Api { status: 400, code, .. } if code == "bad_volume"),
            "{name:?}: {err}"
        );
    }
    for size in [0, 1 << 40] {
        let err = daemon
            .client
            .create_volume(&CreateVolumeRequest {
                name: "sized".into(),
                size_mb: Some(size),
                labels: None,
            })
            .await
            .unwrap_err();
        assert!(
            matches!(&err, ClientError::Api { status: 400, code, .. } if code == "bad_volume"),
            "{size}: {err}"
        );
    }
    volume(&daemon, "v", Some(16)).await;
    volume(&daemon, "w", Some(16)).await;
    let again = daemon
        .client
        .create_volume(&CreateVolumeRequest {
            name: "v".into(),
            size_mb: None,
            labels: None,
        })
        .await
        .unwrap_err();
    assert!(
        matches!(&again, ClientError::Api { status: 409, code, .. } if code == "volume_exists"),
        "{again}"
    );
    for path in [
        "/etc", "/etc/x", "/usr/lib", "/proc/x", "/", "relative", "/a/../b", "/.runbox",
    ] {
        let (status, code, _) = refused(&daemon, with(vec![mount("v", Some(path), None)])).await;
        assert_eq!((status, code.as_str()), (400, "bad_path"), "{path}");
    }
    // Nested, the same path twice, the same volume twice, too many, one
    // that does not exist.
    let many = (0..9)
        .map(|i| mount("v", Some(&format!("/m{i}")), None))
        .collect();
    let cases = [
        (
            vec![
                mount("v", Some("/data"), None),
                mount("w", Some("/data/inner"), None),
            ],
            (400, "bad_path"),
        ),
        (
            vec![
                mount("v", Some("/data"), None),
                mount("w", Some("/data"), None),
            ],
            (400, "bad_path"),
        ),
        (
            vec![mount("v", None, None), mount("v", Some("/x"), None)],
            (400, "bad_volume"),
        ),
        (many, (400, "bad_volume")),
        (vec![mount("nope", None, None)], (404, "volume_not_found")),
    ];
    for (mounts, want) in cases {
        let (status, code, message) = refused(&daemon, with(mounts)).await;
        assert_eq!((status, code.as_str()), want, "{message}");
    }
    // An unknown field in a mount is refused, not ignored.
    let raw = reqwest::Client::new()
        .post(format!("{}/v1/runs", daemon.client.base_url()))
        .bearer_auth(&daemon.token)
        .json(&serde_json::json!({"image": "base", "volumes": [{"name": "v", "readOnly": true}]}))
        .send()
        .await
        .unwrap();
    assert_eq!(raw.status(), 400);
    // Nothing was made by any of it.
    assert!(daemon.client.list_runs().await.unwrap().runs.is_empty());
    assert_eq!(daemon.client.list_volumes().await.unwrap().volumes.len(), 2);
    for name in ["v", "w"] {
        daemon.client.delete_volume(name).await.unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_tenant_sees_and_mounts_only_its_own_volumes() {
    let daemon = TestDaemon::start(None).await;
    let mut tenants = Vec::new();
    for name in ["acme", "globex"] {
        let made = daemon
            .client
            .create_tenant(&runbox_types::CreateTenantRequest {
                name: name.into(),
                ..Default::default()
            })
            .await
            .unwrap();
        tenants.push(runbox_client::Client::new(daemon.client.base_url(), made.token).unwrap());
    }
    let (acme, globex) = (&tenants[0], &tenants[1]);
    let req = |name: &str| CreateVolumeRequest {
        name: name.into(),
        size_mb: Some(16),
        labels: None,
    };
    let mine = acme.create_volume(&req("data")).await.unwrap();
    assert_eq!(mine.tenant.as_deref(), Some("acme"));
    // Another tenant neither sees nor mounts it, and may have its own.
    let err = globex.get_volume("data").await.unwrap_err();
    assert!(
        matches!(&err, ClientError::Api { status: 404, .. }),
        "{err}"
    );
    let err = globex
        .create_run(&with(vec![mount("data", None, None)]))
        .await
        .unwrap_err();
    assert!(
        matches!(&err, ClientError::Api { status: 404, code, .. } if code == "volume_not_found"),
        "{err}"
    );
    globex.create_volume(&req("data")).await.unwrap();
    assert_eq!(globex.list_volumes().await.unwrap().volumes.len(), 1);
    // The operator sees both, stamped.
    let all = daemon.client.list_volumes().await.unwrap().volumes;
    let mut owners: Vec<Option<String>> = all.iter().map(|v| v.tenant.clone()).collect();
    owners.sort();
    assert_eq!(owners, [Some("acme".into()), Some("globex".into())]);
    // Each tenant's run mounts its own.
    let run = acme
        .create_run(&with(vec![mount("data", None, None)]))
        .await
        .unwrap()
        .id
        .to_string();
    assert_eq!(
        acme.get_volume("data").await.unwrap().holders[0]
            .run
            .to_string(),
        run
    );
    assert!(globex.get_volume("data").await.unwrap().holders.is_empty());
    acme.delete_run(&run).await.unwrap();
    for tenant in [acme, globex] {
        tenant.delete_volume("data").await.unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_clone_is_a_copy_of_now_that_goes_its_own_way() {
    let daemon = TestDaemon::start(None).await;
    volume(&daemon, "src", Some(64)).await;
    let writer = daemon
        .create_with(with(vec![mount("src", None, None)]))
        .await
        .id
        .to_string();
    ok(
        &daemon,
        &writer,
        "echo before > /volumes/src/f; mkdir /volumes/src/d; chown 1000 /volumes/src/d",
    )
    .await;
    // Cloned while a run writes to the source: what it held at that moment.
    let copy = daemon
        .client
        .clone_volume(
            "src",
            &runbox_types::CloneVolumeRequest {
                name: "copy".into(),
                size_mb: None,
                labels: None,
            },
        )
        .await
        .unwrap();
    assert_eq!((copy.name.as_str(), copy.size_mb), ("copy", 64));
    assert!(copy.holders.is_empty());
    ok(&daemon, &writer, "echo after > /volumes/src/f").await;
    let reader = daemon
        .create_with(with(vec![mount("copy", Some("/copy"), None)]))
        .await
        .id
        .to_string();
    assert_eq!(
        ok(
            &daemon,
            &reader,
            "cat /copy/f; stat -c %u /copy/d; echo mine > /copy/g"
        )
        .await,
        "before\n1000\n"
    );
    assert_eq!(
        ok(
            &daemon,
            &writer,
            "cat /volumes/src/f; [ -e /volumes/src/g ] || echo no-g"
        )
        .await,
        "after\nno-g\n"
    );
    // Names are checked as for a create; an unknown source is a 404.
    let clone = |from: &'static str, name: &'static str| {
        let client = daemon.client.clone();
        async move {
            client
                .clone_volume(
                    from,
                    &runbox_types::CloneVolumeRequest {
                        name: name.into(),
                        size_mb: None,
                        labels: None,
                    },
                )
                .await
        }
    };
    for (from, name, status, code) in [
        ("src", "copy", 409, "volume_exists"),
        ("nope", "other", 404, "volume_not_found"),
        ("src", "../x", 400, "bad_volume"),
    ] {
        let err = clone(from, name).await.unwrap_err();
        assert!(
            matches!(&err, ClientError::Api { status: s, code: c, .. } if *s == status && c == code),
            "{from} -> {name}: {err}"
        );
    }
    for id in [&writer, &reader] {
        daemon.client.delete_run(id).await.unwrap();
    }
    for name in ["src", "copy"] {
        daemon.client.delete_volume(name).await.unwrap();
    }
}

/// How long a release (an unmount, a marker's removal) may take after the
/// call that causes it answered.
const SETTLE: std::time::Duration = std::time::Duration::from_secs(10);

/// The code and message of an API refusal.
fn api_error<T: std::fmt::Debug>(result: Result<T, ClientError>) -> (u16, String, String) {
    match result {
        Err(ClientError::Api {
            status,
            code,
            message,
            ..
        }) => (status, code, message),
        other => panic!("expected a refusal, got {other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn files_without_a_run_seed_and_collect_a_volume() {
    use runbox_types::{
        FileKind, VolumeMakeDirRequest, VolumeMoveRequest, VolumeRemoveRequest, VolumeWriteQuery,
    };
    let daemon = TestDaemon::start(None).await;
    let c = &daemon.client;
    volume(&daemon, "seed", Some(16)).await;

    // Seeding: a file owned by the run user it is for, parents made.
    let owned = VolumeWriteQuery {
        mode: Some(0o640),
        uid: Some(1000),
        gid: Some(1000),
        overwrite: None,
    };
    let put = c
        .put_volume_file("seed", "/data/a.csv", &owned, b"x,y\n1,2\n".to_vec().into())
        .await
        .unwrap();
    assert_eq!(
        (put.path.as_str(), put.kind, put.size, put.mode, put.uid),
        ("/data/a.csv", FileKind::File, 8, 0o640, 1000)
    );
    let made = c
        .volume_make_dir(
            "seed",
            &VolumeMakeDirRequest {
                path: "logs/today".into(),
                ..Default::default()
            },
        )
        .await
        .unwrap();
    assert_eq!(
        (made.path.as_str(), made.kind),
        ("/logs/today", FileKind::Directory)
    );
    let top = c.volume_stat("seed", "/").await.unwrap();
    assert_eq!(
        (top.path.as_str(), top.mode),
        ("/", 0o777),
        "the top is everyone's"
    );
    let listed: Vec<String> = c
        .volume_list("seed", "", 2)
        .await
        .unwrap()
        .entries
        .into_iter()
        .map(|e| e.path)
        .collect();
    assert_eq!(listed, ["/data", "/data/a.csv", "/logs", "/logs/today"]);

    // A run sees what was seeded, with its owner, and leaves a result.
    let run = daemon
        .create_with(with(vec![mount("seed", Some("/mnt/seed"), None)]))
        .await
        .id
        .to_string();
    assert_eq!(
        ok(
            &daemon,
            &run,
            "stat -c %u:%a /mnt/seed/data/a.csv; cat /mnt/seed/data/a.csv"
        )
        .await,
        "1000:640\nx,y\n1,2\n"
    );
    ok(
        &daemon,
        &run,
        "echo done > /mnt/seed/out.txt; ln -s /etc /mnt/seed/esc; ln -s ../../../../.. /mnt/seed/up",
    )
    .await;
    // Reads go on while a run holds the volume; writes wait for it to go.
    let read = c.get_volume_file("seed", "out.txt").await.unwrap();
    assert_eq!(read.bytes().await.unwrap().as_ref(), b"done\n");
    let (status, code, message) = api_error(
        c.put_volume_file("seed", "late", &Default::default(), b"x".to_vec().into())
            .await,
    );
    assert_eq!((status, code.as_str()), (409, "volume_busy"), "{message}");
    assert!(message.contains(&run), "{message}");
    daemon.client.delete_run(&run).await.unwrap();

    // The links the run planted lead nowhere outside the volume.
    for path in ["esc/passwd", "up/etc/passwd"] {
        let (status, code, _) = api_error(c.get_volume_file("seed", path).await);
        assert_eq!((status, code.as_str()), (403, "path_escape"), "{path}");
    }
    let esc = c.volume_stat("seed", "esc").await.unwrap();
    assert_eq!(
        (esc.kind, esc.target.as_deref()),
        (FileKind::Symlink, Some("/etc"))
    );
    let gone = c
        .volume_remove(
            "seed",
            &VolumeRemoveRequest {
                path: "esc".into(),
                recursive: None,
            },
        )
        .await
        .unwrap();
    assert_eq!(gone.removed, 1);
    assert!(
        std::path::Path::new("/etc/passwd").exists(),
        "the link, not its target"
    );

    // Collecting: move, replace only when asked, remove recursively.
    let moved = c
        .volume_move(
            "seed",
            &VolumeMoveRequest {
                from: "out.txt".into(),
                to: "/logs/today/out.txt".into(),
                overwrite: None,
            },
        )
        .await
        .unwrap();
    assert_eq!(moved.path, "/logs/today/out.txt");
    let keep = VolumeWriteQuery {
        overwrite: Some(false),
        ..Default::default()
    };
    let (status, code, _) = api_error(
        c.put_volume_file("seed", "logs/today/out.txt", &keep, b"new".to_vec().into())
            .await,
    );
    assert_eq!((status, code.as_str()), (409, "file_exists"));
    let (status, code, _) = api_error(
        c.volume_remove(
            "seed",
            &VolumeRemoveRequest {
                path: "logs".into(),
                recursive: None,
            },
        )
        .await,
    );
    assert_eq!((status, code.as_str()), (409, "dir_not_empty"));
    let gone = c
        .volume_remove(
            "seed",
            &VolumeRemoveRequest {
                path: "/logs".into(),
                recursive: Some(true),
            },
        )
        .await
        .unwrap();
    assert_eq!(gone.removed, 3);

    // A full volume refuses the write and keeps nothing of it.
    let big = vec![7u8; 24 << 20];
    let (status, code, message) = api_error(
        c.put_volume_file("seed", "big", &Default::default(), big.into())
            .await,
    );
    assert_eq!((status, code.as_str()), (507, "volume_full"), "{message}");
    let names: Vec<String> = c
        .volume_list("seed", "/", 1)
        .await
        .unwrap()
        .entries
        .into_iter()
        .map(|e| e.path)
        .collect();
    assert_eq!(names, ["/data", "/up"], "no temporary file is left");

    // Hostile requests.
    let bad_owner = |uid, gid| VolumeWriteQuery {
        uid,
        gid,
        ..Default::default()
    };
    for (query, what) in [
        (bad_owner(Some(1000), None), "uid without gid"),
        (bad_owner(Some(70000), Some(0)), "uid past 65535"),
        (
            VolumeWriteQuery {
                mode: Some(0o4755),
                ..Default::default()
            },
            "setuid mode",
        ),
    ] {
        let (status, code, _) = api_error(
            c.put_volume_file("seed", "x", &query, b"x".to_vec().into())
                .await,
        );
        assert_eq!((status, code.as_str()), (400, "bad_request"), "{what}");
    }
    for path in ["a/../../b", "data/a.csv/x"] {
        let (status, _, message) = api_error(c.volume_stat("seed", path).await);
        assert!(status == 400 || status == 404, "{path}: {status} {message}");
    }
    let (status, code, _) = api_error(c.volume_stat("seed", "../x").await);
    assert_eq!((status, code.as_str()), (400, "bad_path"));
    let (status, code, _) = api_error(c.volume_stat("seed", "nope").await);
    assert_eq!((status, code.as_str()), (404, "file_not_found"));
    let (status, code, _) = api_error(c.volume_stat("nothere", "/").await);
    assert_eq!((status, code.as_str()), (404, "volume_not_found"));
    let (status, code, _) = api_error(
        c.volume_remove(
            "seed",
            &VolumeRemoveRequest {
                path: "/".into(),
                recursive: Some(true),
            },
        )
        .await,
    );
    assert_eq!((status, code.as_str()), (400, "bad_path"), "the top stays");
    let raw = reqwest::Client::new()
        .put(format!("{}/v1/volumes/seed/files/x?sticky=1", daemon.url))
        .bearer_auth(&daemon.token)
        .body("x")
        .send()
        .await
        .unwrap();
    assert_eq!(raw.status().as_u16(), 400, "an unknown query parameter");

    // The CLI copies in and out of a volume too.
    let local = daemon.state.path().join("cli-upload.txt");
    std::fs::write(&local, b"through the cli").unwrap();
    let cli = |args: &[&str]| {
        std::process::Command::new(runbox_e2e::runbox_bin())
            .args(args)
            .env("RUNBOX_URL", &daemon.url)
            .env("RUNBOX_TOKEN", &daemon.token)
            .output()
            .expect("runbox")
    };
    let out = cli(&["cp", local.to_str().unwrap(), "volume:seed:/data/"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let out = cli(&["cp", "volume:seed:data/cli-upload.txt", "-"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert_eq!(text(&out.stdout), "through the cli");
    let out = cli(&["cp", "volume:seed:nope", "-"]);
    assert!(!out.status.success());
    assert!(
        text(&out.stderr).contains("volume:seed:/nope"),
        "{}",
        text(&out.stderr)
    );

    // A write under way holds off a run that would mount the volume.
    let (tx, upload) = slow_write(c, "seed", "slow", bytes::Bytes::from_static(b"part")).await;
    // Under way once the daemon holds its (unnamed) file in the volume.
    let stored = daemon
        .state
        .path()
        .join("runs/.volumes")
        .join(c.get_volume("seed").await.unwrap().id.to_string());
    let began = runbox_e2e::eventually(std::time::Duration::from_secs(20), || {
        upload.is_finished() || writing_into(daemon.pid(), &stored)
    })
    .await;
    assert!(
        began && !upload.is_finished(),
        "the upload began and is under way"
    );
    let (status, code, message) = refused(
        &daemon,
        with(vec![mount("seed", None, Some(VolumeMode::Ro))]),
    )
    .await;
    assert_eq!((status, code.as_str()), (409, "volume_busy"));
    assert!(message.contains("being written"), "{message}");
    tx.send(Ok(bytes::Bytes::from_static(b"-end")))
        .await
        .unwrap();
    drop(tx);
    let slow = upload.await.unwrap().unwrap();
    assert_eq!(slow.size, 8);
    let run = daemon
        .create_with(with(vec![mount("seed", None, Some(VolumeMode::Ro))]))
        .await
        .id
        .to_string();
    assert_eq!(
        ok(&daemon, &run, "cat /volumes/seed/slow").await,
        "part-end"
    );
    daemon.client.delete_run(&run).await.unwrap();
    daemon.client.delete_volume("seed").await.unwrap();
}

/// An ext4 image of `size_mb` holding `files` (name, contents).
fn ext4_image(path: &std::path::Path, size_mb: u32, files: &[(&str, &str)]) {
    let tree = tempfile::tempdir().unwrap();
    for (name, text) in files {
        std::fs::write(tree.path().join(name), text).unwrap();
    }
    let out = std::process::Command::new("mkfs.ext4")
        .args(["-q", "-F", "-d"])
        .arg(tree.path())
        .arg(path)
        .arg(format!("{size_mb}M"))
        .output()
        .expect("running mkfs.ext4");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Loop devices backed by `image`, as `losetup -j` lists them.
fn loops_of(image: &std::path::Path) -> String {
    let out = std::process::Command::new("losetup")
        .arg("-j")
        .arg(image)
        .output()
        .expect("running losetup");
    String::from_utf8_lossy(&out.stdout).into_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn catalog_datasets_mount_ro_shared_and_rw_with_a_marker() {
    let images = tempfile::tempdir().unwrap();
    let ro_img = images.path().join("corpus.img");
    let rw_img = images.path().join("scratch.img");
    ext4_image(&ro_img, 16, &[("hello.txt", "from the catalog\n")]);
    ext4_image(&rw_img, 16, &[]);
    let rw_marker = images.path().join("scratch.img.dirty");
    let ro_spec = format!("corpus={}", ro_img.display());
    let rw_spec = format!(
        r#"{{"name": "scratch", "path": "{}", "writable": true}}"#,
        rw_img.display()
    );
    let acme_spec = format!(
        r#"{{"name": "acme-only", "path": "{}", "tenants": ["acme"]}}"#,
        ro_img.display()
    );
    let gone_spec = format!("gone={}", images.path().join("absent.img").display());
    let args = [
        "--dataset",
        &ro_spec,
        "--dataset",
        &rw_spec,
        "--dataset",
        &acme_spec,
        "--dataset",
        &gone_spec,
    ];
    for runtime in runbox_e2e::runtimes() {
        let mut daemon = TestDaemon::start_with(Some(&runtime), &args, &[]).await;
        let c = daemon.client.clone();

        // Listed with their state, never their paths.
        let listed = c.list_volumes().await.unwrap().volumes;
        let state = |name: &str| {
            listed
                .iter()
                .find(|v| v.name == name)
                .and_then(|v| v.dataset.clone())
                .unwrap_or_else(|| panic!("{name} is listed as a dataset"))
        };
        assert!(state("corpus").available && !state("corpus").writable);
        assert!(state("scratch").writable);
        assert_eq!(state("gone").unavailable.as_deref(), Some("missing"));
        let text = serde_json::to_string(&listed).unwrap();
        assert!(!text.contains(images.path().to_str().unwrap()), "{text}");

        // Read-only by default, shared by two runs at once.
        let a = daemon
            .create_with(with(vec![mount("corpus", None, None)]))
            .await;
        let b = daemon
            .create_with(with(vec![mount("corpus", Some("/data"), None)]))
            .await;
        assert_eq!(a.volumes[0].mode, VolumeMode::Ro);
        let (a, b) = (a.id.to_string(), b.id.to_string());
        assert_eq!(
            ok(&daemon, &a, "cat /volumes/corpus/hello.txt").await,
            "from the catalog\n"
        );
        assert_eq!(
            ok(&daemon, &b, "cat /data/hello.txt").await,
            "from the catalog\n"
        );
        let write = daemon.sh(&b, "touch /data/new").await;
        assert_ne!(write.exit.exit_code, 0, "{runtime}: a dataset is read-only");
        assert_eq!(c.get_volume("corpus").await.unwrap().holders.len(), 2);
        assert!(!loops_of(&ro_img).is_empty(), "one loop device while held");
        daemon.client.delete_run(&a).await.unwrap();
        daemon.client.delete_run(&b).await.unwrap();
        assert!(
            runbox_e2e::eventually(SETTLE, || loops_of(&ro_img).is_empty()).await,
            "released with the last holder"
        );

        // The catalog's tenant list: acme sees and mounts acme-only,
        // another tenant neither; both see the open entries.
        let mut tenants = Vec::new();
        for name in ["acme", "beta"] {
            let made = c
                .create_tenant(&runbox_types::CreateTenantRequest {
                    name: name.into(),
                    ..Default::default()
                })
                .await
                .unwrap();
            tenants.push(runbox_client::Client::new(c.base_url(), made.token).unwrap());
        }
        let seen = |client: &runbox_client::Client| {
            let client = client.clone();
            async move {
                let mut names: Vec<String> = client
                    .list_volumes()
                    .await
                    .unwrap()
                    .volumes
                    .into_iter()
                    .map(|v| v.name)
                    .collect();
                names.sort();
                names
            }
        };
        assert_eq!(
            seen(&tenants[0]).await,
            ["acme-only", "corpus", "gone", "scratch"]
        );
        assert_eq!(seen(&tenants[1]).await, ["corpus", "gone", "scratch"]);
        let err = tenants[1]
            .create_run(&with(vec![mount("acme-only", None, None)]))
            .await
            .unwrap_err();
        assert!(
            matches!(&err, ClientError::Api { status: 404, code, .. } if code == "volume_not_found"),
            "{err}"
        );
        let acme = tenants[0]
            .create_run(&with(vec![mount("acme-only", None, None)]))
            .await
            .unwrap()
            .id
            .to_string();
        c.delete_run(&acme).await.unwrap();
        for name in ["acme", "beta"] {
            c.delete_tenant(name).await.unwrap();
        }

        // Refusals.
        let (status, code, _) = refused(
            &daemon,
            with(vec![mount("corpus", None, Some(VolumeMode::Rw))]),
        )
        .await;
        assert_eq!(
            (status, code.as_str()),
            (400, "bad_volume"),
            "rw of a read-only entry"
        );
        let (status, code, message) = refused(&daemon, with(vec![mount("gone", None, None)])).await;
        assert_eq!(
            (status, code.as_str()),
            (409, "volume_unavailable"),
            "{message}"
        );
        let (status, code, _) = api_error(
            c.create_volume(&CreateVolumeRequest {
                name: "corpus".into(),
                size_mb: Some(8),
                labels: None,
            })
            .await,
        );
        assert_eq!(
            (status, code.as_str()),
            (409, "volume_exists"),
            "a catalog name"
        );

        // Read-write: the marker is on disk before the mount and stays
        // while the writer holds it, a daemon kill -9 included.
        let writer = daemon
            .create_with(with(vec![mount("scratch", None, Some(VolumeMode::Rw))]))
            .await
            .id
            .to_string();
        assert!(rw_marker.exists(), "{runtime}: the marker goes first");
        ok(&daemon, &writer, "echo kept > /volumes/scratch/out; sync").await;
        let (status, code, _) = refused(&daemon, with(vec![mount("scratch", None, None)])).await;
        assert_eq!(
            (status, code.as_str()),
            (409, "volume_busy"),
            "one writer, no readers"
        );
        daemon.kill9();
        assert!(rw_marker.exists(), "a killed daemon leaves the marker");
        daemon.spawn().await;
        assert_eq!(
            ok(&daemon, &writer, "cat /volumes/scratch/out").await,
            "kept\n"
        );
        daemon.client.delete_run(&writer).await.unwrap();
        assert!(
            runbox_e2e::eventually(SETTLE, || !rw_marker.exists()).await,
            "a clean release removes the marker"
        );
        let reader = daemon
            .create_with(with(vec![mount("scratch", None, None)]))
            .await
            .id
            .to_string();
        assert_eq!(
            ok(&daemon, &reader, "cat /volumes/scratch/out").await,
            "kept\n"
        );
        daemon.client.delete_run(&reader).await.unwrap();

        // A dirty image (a writer that was not released cleanly) refuses
        // readers until one rw mount is released cleanly.
        std::fs::write(&rw_marker, b"left by a writer that died\n").unwrap();
        let (status, code, message) =
            refused(&daemon, with(vec![mount("scratch", None, None)])).await;
        assert_eq!((status, code.as_str()), (409, "volume_unavailable"));
        assert!(message.contains("dirty"), "{message}");
        let healer = daemon
            .create_with(with(vec![mount("scratch", None, Some(VolumeMode::Rw))]))
            .await
            .id
            .to_string();
        daemon.client.delete_run(&healer).await.unwrap();
        assert!(
            runbox_e2e::eventually(SETTLE, || !rw_marker.exists()).await,
            "healed by a clean rw release"
        );
        let reader = daemon
            .create_with(with(vec![mount("scratch", None, None)]))
            .await
            .id
            .to_string();
        daemon.client.delete_run(&reader).await.unwrap();
        drop(daemon);
        assert!(
            runbox_e2e::eventually(SETTLE, || loops_of(&ro_img).is_empty()
                && loops_of(&rw_img).is_empty())
            .await,
            "no loop device is left"
        );
    }
    assert!(
        ro_img.exists() && rw_img.exists(),
        "images are never deleted"
    );
}

/// Waits until every pool has at least `n` ready members.
async fn pool_ready(daemon: &TestDaemon, n: u32) {
    let ready = runbox_e2e::eventually_async(std::time::Duration::from_secs(60), || async {
        let list = daemon.client.pools().await.unwrap();
        list.pools.iter().all(|p| p.ready >= n)
    })
    .await;
    assert!(ready, "pools never reached {n} ready members");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_create_with_volumes_takes_a_pool_member_and_mounts_into_it() {
    use runbox_types::{PoolSet, PoolSpec, SizeTier};
    let images = tempfile::tempdir().unwrap();
    let image = images.path().join("corpus.img");
    ext4_image(&image, 16, &[("hello.txt", "pooled\n")]);
    let spec = format!("corpus={}", image.display());
    for runtime in runbox_e2e::runtimes() {
        let daemon = TestDaemon::start_with(Some(&runtime), &["--dataset", &spec], &[]).await;
        let c = &daemon.client;
        let made = volume(&daemon, "data", Some(32)).await;
        c.set_pools(&PoolSet {
            pools: vec![PoolSpec {
                image: "base".into(),
                network: None,
                size: Some(SizeTier::Small),
                warm: Some(2),
                warm_max: None,
                warmup: None,
            }],
        })
        .await
        .unwrap();
        pool_ready(&daemon, 2).await;
        let pooled = |mounts: Vec<VolumeMountRequest>| CreateRunRequest {
            image: "base".into(),
            size: Some(SizeTier::Small),
            volumes: Some(mounts),
            ..Default::default()
        };

        // A named volume rw at its default path, a dataset ro elsewhere.
        let run = c
            .create_run(&pooled(vec![
                mount("data", None, None),
                mount("corpus", Some("/mnt/corpus"), None),
            ]))
            .await
            .unwrap();
        assert!(run.pooled, "{runtime}: served from the pool");
        assert_eq!(run.volumes.len(), 2);
        let id = run.id.to_string();
        assert_eq!(
            ok(
                &daemon,
                &id,
                "echo hi > /volumes/data/f; stat -c %u /volumes/data/f; cat /mnt/corpus/hello.txt"
            )
            .await,
            "0\npooled\n"
        );
        let write = daemon.sh(&id, "touch /mnt/corpus/x").await;
        assert_ne!(
            write.exit.exit_code, 0,
            "{runtime}: the dataset is read-only"
        );
        let stored = daemon
            .state
            .path()
            .join("runs/.volumes")
            .join(made.id.to_string())
            .join("f");
        assert_eq!(
            std::fs::metadata(&stored).unwrap().uid(),
            0,
            "stored as the run saw it"
        );
        let holders = c.get_volume("data").await.unwrap().holders;
        assert_eq!((holders.len(), holders[0].run), (1, run.id));

        // The one-writer rule holds for claims too; readers of the dataset
        // share it.
        pool_ready(&daemon, 1).await;
        let (status, code, _) =
            api_error(c.create_run(&pooled(vec![mount("data", None, None)])).await);
        assert_eq!((status, code.as_str()), (409, "volume_busy"));
        let reader = c
            .create_run(&pooled(vec![mount("corpus", None, None)]))
            .await
            .unwrap();
        assert!(reader.pooled);
        assert_eq!(
            ok(
                &daemon,
                &reader.id.to_string(),
                "cat /volumes/corpus/hello.txt"
            )
            .await,
            "pooled\n"
        );
        c.delete_run(&id).await.unwrap();
        c.delete_run(&reader.id.to_string()).await.unwrap();

        // What the first run wrote is there for the next claim.
        pool_ready(&daemon, 1).await;
        let next = c
            .create_run(&pooled(vec![mount(
                "data",
                Some("/in"),
                Some(VolumeMode::Ro),
            )]))
            .await
            .unwrap();
        assert!(next.pooled);
        assert_eq!(ok(&daemon, &next.id.to_string(), "cat /in/f").await, "hi\n");
        c.delete_run(&next.id.to_string()).await.unwrap();
        c.set_pools(&PoolSet { pools: vec![] }).await.unwrap();
        c.delete_volume("data").await.unwrap();
        drop(daemon);
        assert!(
            runbox_e2e::eventually(SETTLE, || loops_of(&image).is_empty()).await,
            "no loop device is left"
        );
    }
}

/// The chunks still to come of a [`slow_write`].
type Chunks = tokio::sync::mpsc::Sender<Result<bytes::Bytes, std::io::Error>>;

/// A write of `path` to volume `name` that has sent `first` and waits for
/// the rest on the sender it answers (dropping it ends the body).
async fn slow_write(
    c: &runbox_client::Client,
    name: &str,
    path: &str,
    first: bytes::Bytes,
) -> (
    Chunks,
    tokio::task::JoinHandle<Result<runbox_types::FileInfo, runbox_client::ClientError>>,
) {
    let (tx, rx) = tokio::sync::mpsc::channel(1);
    tx.send(Ok(first)).await.unwrap();
    let chunks = futures::stream::unfold(rx, |mut rx| async move {
        rx.recv().await.map(|chunk| (chunk, rx))
    });
    let body = runbox_client::UploadBody::from_stream(chunks, None);
    let (client, name, path) = (c.clone(), name.to_owned(), path.to_owned());
    let upload = tokio::spawn(async move {
        client
            .put_volume_file(&name, &path, &Default::default(), body)
            .await
    });
    (tx, upload)
}

/// Whether process `pid` holds a file open for writing in `dir` (an upload
/// under way: its file has no name there until it is committed).
fn writing_into(pid: u32, dir: &std::path::Path) -> bool {
    let Ok(fds) = std::fs::read_dir(format!("/proc/{pid}/fd")) else {
        return false;
    };
    fds.flatten().any(|fd| {
        std::fs::read_link(fd.path()).is_ok_and(|target| target.starts_with(dir))
            && std::fs::read_to_string(format!(
                "/proc/{pid}/fdinfo/{}",
                fd.file_name().to_string_lossy()
            ))
            .is_ok_and(|info| {
                info.lines()
                    .find_map(|l| l.strip_prefix("flags:"))
                    .and_then(|f| u32::from_str_radix(f.trim(), 8).ok())
                    .is_some_and(|flags| flags & 0o3 != 0)
            })
    })
}

/// A volume write cut by a daemon crash leaves no name behind: nothing
/// listed, nothing for a run or a clone to see; the file written before is
/// whole.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_write_cut_by_a_crash_leaves_nothing_behind() {
    let mut daemon = TestDaemon::start(None).await;
    let v = volume(&daemon, "crash", None).await;
    let c = daemon.client.clone();
    c.put_volume_file(
        "crash",
        "kept.txt",
        &Default::default(),
        b"before".to_vec().into(),
    )
    .await
    .unwrap();
    // Over the file already there.
    let (tx, upload) = slow_write(
        &c,
        "crash",
        "kept.txt",
        bytes::Bytes::from(vec![7u8; 1 << 20]),
    )
    .await;
    let stored = daemon
        .state
        .path()
        .join("runs/.volumes")
        .join(v.id.to_string());
    let began = runbox_e2e::eventually(std::time::Duration::from_secs(20), || {
        writing_into(daemon.pid(), &stored)
    })
    .await;
    assert!(began && !upload.is_finished(), "the upload is under way");
    daemon.kill9();
    drop(tx);
    let _ = upload.await;
    daemon.spawn().await;
    let on_disk: Vec<String> = std::fs::read_dir(&stored)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert_eq!(on_disk, ["kept.txt"], "in the volume on the host");
    let listed: Vec<String> = daemon
        .client
        .volume_list("crash", "", 1)
        .await
        .unwrap()
        .entries
        .into_iter()
        .map(|e| e.path)
        .collect();
    assert_eq!(listed, ["/kept.txt"]);
    let kept = daemon
        .client
        .get_volume_file("crash", "kept.txt")
        .await
        .unwrap();
    assert_eq!(kept.bytes().await.unwrap().as_ref(), b"before");
    daemon.client.delete_volume("crash").await.unwrap();
}
