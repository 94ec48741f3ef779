//! Stat, list, mkdir, move and remove in a run's /work through the API, on
//! the real runtime: what each does, the lease fence on the writes, and
//! that paths leaving /work are refused.

use runbox_e2e::{raw_request, TestDaemon};
use runbox_types::{ErrorCode, FileKind, MakeDirRequest, MoveRequest, RemoveRequest};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn file_system_operations_work_and_stay_in_work() {
    let daemon = TestDaemon::start(None).await;
    let id = daemon.create().await.id.to_string();
    let c = &daemon.client;
    let made = c
        .make_dir(
            &id,
            &MakeDirRequest {
                path: "src/pkg/deep".into(),
                mode: Some(0o750),
                ..Default::default()
            },
        )
        .await
        .unwrap();
    assert_eq!(
        (made.kind, made.mode, made.path.as_str()),
        (FileKind::Directory, 0o750, "src/pkg/deep")
    );
    daemon
        .sh(&id, "echo hi > /work/src/a.txt; ln -s /etc /work/etc-link")
        .await;
    let a = c.stat(&id, "src/a.txt").await.unwrap();
    assert_eq!((a.kind, a.size), (FileKind::File, 3));
    let link = c.stat(&id, "etc-link").await.unwrap();
    assert_eq!(
        (link.kind, link.target.as_deref()),
        (FileKind::Symlink, Some("/etc"))
    );
    assert_eq!(c.stat(&id, "").await.unwrap().kind, FileKind::Directory);
    let listed = c.list_dir(&id, "", 3).await.unwrap();
    let paths: Vec<&str> = listed.entries.iter().map(|e| e.path.as_str()).collect();
    assert_eq!(
        paths,
        ["etc-link", "src", "src/a.txt", "src/pkg", "src/pkg/deep"]
    );
    assert!(!listed.truncated);

    let moved = c
        .move_path(
            &id,
            &MoveRequest {
                from: "src/a.txt".into(),
                to: "src/pkg/b.txt".into(),
                ..Default::default()
            },
        )
        .await
        .unwrap();
    assert_eq!(moved.path, "src/pkg/b.txt");
    daemon.sh(&id, "echo x > /work/src/c.txt").await;
    let err = c
        .move_path(
            &id,
            &MoveRequest {
                from: "src/c.txt".into(),
                to: "src/pkg/b.txt".into(),
                ..Default::default()
            },
        )
        .await
        .unwrap_err();
    assert_eq!(err.code(), Some(ErrorCode::FileExists));
    let err = c
        .remove_path(
            &id,
            &RemoveRequest {
                path: "src".into(),
                ..Default::default()
            },
        )
        .await
        .unwrap_err();
    assert_eq!(err.code(), Some(ErrorCode::DirNotEmpty));
    // Removing the link removes the link, not /etc.
    c.remove_path(
        &id,
        &RemoveRequest {
            path: "etc-link".into(),
            ..Default::default()
        },
    )
    .await
    .unwrap();
    let out = daemon.sh(&id, "ls /etc/passwd && ls /work").await;
    assert_eq!(String::from_utf8_lossy(&out.stdout), "/etc/passwd\nsrc\n");
    let removed = c
        .remove_path(
            &id,
            &RemoveRequest {
                path: "src".into(),
                recursive: Some(true),
                ..Default::default()
            },
        )
        .await
        .unwrap();
    assert_eq!(removed.removed, 5);

    // Escapes: through a symlink planted by the run (403), by `..` or an
    // absolute path (400); nothing outside changes.
    daemon
        .sh(
            &id,
            "mkdir -p /outside && echo s > /outside/secret && ln -s /outside /work/out",
        )
        .await;
    let err = c.stat(&id, "out/secret").await.unwrap_err();
    assert_eq!(err.code(), Some(ErrorCode::PathEscape));
    let err = c
        .remove_path(
            &id,
            &RemoveRequest {
                path: "out/secret".into(),
                recursive: Some(true),
                ..Default::default()
            },
        )
        .await
        .unwrap_err();
    assert_eq!(err.code(), Some(ErrorCode::PathEscape));
    for target in [
        format!("/v1/runs/{id}/fs/stat?path=../etc/passwd"),
        format!("/v1/runs/{id}/fs/list?path=/etc"),
        format!("/v1/runs/{id}/fs/list?path=%2e%2e"),
    ] {
        let (status, body) = raw_request(&daemon.url, "GET", &target, &daemon.token, b"").await;
        assert_eq!(status, 400, "{target}: {body}");
        assert!(body.contains("bad_path"), "{target}: {body}");
    }
    let out = daemon.sh(&id, "cat /outside/secret").await;
    assert_eq!(String::from_utf8_lossy(&out.stdout), "s\n");

    // The writes are fenced by the lease; the reads are not.
    let lease = c.acquire_lease(&id, "alice", None).await.unwrap();
    let err = c
        .make_dir(
            &id,
            &MakeDirRequest {
                path: "fenced".into(),
                ..Default::default()
            },
        )
        .await
        .unwrap_err();
    assert_eq!(err.code(), Some(ErrorCode::Leased));
    c.make_dir(
        &id,
        &MakeDirRequest {
            path: "fenced".into(),
            owner: Some("alice".into()),
            generation: Some(lease.generation),
            ..Default::default()
        },
    )
    .await
    .unwrap();
    assert_eq!(
        c.stat(&id, "fenced").await.unwrap().kind,
        FileKind::Directory
    );
    c.delete_run(&id).await.unwrap();
}

/// Reads server-sent events from `response` until `until` says stop; each
/// as (event name, data JSON).
async fn sse_events(
    mut response: reqwest::Response,
    mut until: impl FnMut(&str, &serde_json::Value) -> bool,
) -> Vec<(String, serde_json::Value)> {
    let mut buffer = String::new();
    let mut out = Vec::new();
    loop {
        let chunk = tokio::time::timeout(std::time::Duration::from_secs(30), response.chunk())
            .await
            .expect("an event within 30 s")
            .expect("the stream")
            .expect("the stream did not end");
        buffer.push_str(&String::from_utf8_lossy(&chunk));
        while let Some(end) = buffer.find("\n\n") {
            let block: String = buffer.drain(..end + 2).collect();
            let mut name = String::new();
            let mut data = String::new();
            for line in block.lines() {
                if let Some(v) = line.strip_prefix("event:") {
                    name = v.trim().to_owned();
                } else if let Some(v) = line.strip_prefix("data:") {
                    data.push_str(v.trim());
                }
            }
            if name.is_empty() {
                continue; // a keep-alive comment
            }
            let value: serde_json::Value = serde_json::from_str(&data).unwrap();
            let stop = until(&name, &value);
            out.push((name, value));
            if stop {
                return out;
            }
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_watch_streams_changes_made_in_the_run() {
    let daemon = TestDaemon::start(None).await;
    let id = daemon.create().await.id.to_string();
    daemon.sh(&id, "mkdir -p /work/src").await;
    let http = reqwest::Client::new();
    let response = http
        .get(format!(
            "{}/v1/runs/{id}/fs/watch?path=src&recursive=true",
            daemon.url
        ))
        .bearer_auth(&daemon.token)
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    assert_eq!(
        response.headers()["content-type"].to_str().unwrap(),
        "text/event-stream"
    );
    // Start the changes once the watch says it is in place.
    let (ready_tx, ready_rx) = tokio::sync::oneshot::channel::<()>();
    let mut ready_tx = Some(ready_tx);
    let collect = sse_events(response, move |name, data| {
        if name == "ready" {
            if let Some(tx) = ready_tx.take() {
                let _ = tx.send(());
            }
        }
        name == "written" && data["path"] == "src/done"
    });
    let changes = async {
        ready_rx.await.unwrap();
        daemon
            .sh(
                &id,
                "cd /work/src && echo a > a.txt && mkdir lib && sleep 0.2 && echo b > lib/b.txt \
                 && mv a.txt c.txt && rm c.txt && echo > done",
            )
            .await;
    };
    let (events, ()) = tokio::join!(collect, changes);
    let lines: Vec<String> = events
        .iter()
        .map(|(name, data)| match name.as_str() {
            "renamed" => format!(
                "renamed {} -> {}",
                data["from"].as_str().unwrap(),
                data["path"].as_str().unwrap()
            ),
            other => format!("{other} {}", data["path"].as_str().unwrap()),
        })
        .collect();
    assert_eq!(
        lines,
        [
            "ready ",
            "created src/a.txt",
            "written src/a.txt",
            "created src/lib",
            "created src/lib/b.txt",
            "written src/lib/b.txt",
            "renamed src/a.txt -> src/c.txt",
            "removed src/c.txt",
            "created src/done",
            "written src/done",
        ]
    );
    // Watching a file, or through `..`, is refused.
    let (status, body) = raw_request(
        &daemon.url,
        "GET",
        &format!("/v1/runs/{id}/fs/watch?path=src/lib/b.txt"),
        &daemon.token,
        b"",
    )
    .await;
    assert_eq!(status, 400, "{body}");
    assert!(body.contains("not_a_file"), "{body}");
    let (status, _) = raw_request(
        &daemon.url,
        "GET",
        &format!("/v1/runs/{id}/fs/watch?path=../etc"),
        &daemon.token,
        b"",
    )
    .await;
    assert_eq!(status, 400);
    daemon.client.delete_run(&id).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_images_user_runs_commands_and_owns_uploads() {
    let daemon = TestDaemon::start(None).await;
    let config = serde_json::json!({
        "architecture": "amd64", "os": "linux",
        "config": {"User": "nobody", "Env": ["PATH=/usr/bin:/bin"]},
        "rootfs": {"type": "layers", "diff_ids": []}
    });
    daemon
        .client
        .import_image(
            "as-nobody",
            runbox_e2e::body(runbox_e2e::oci_layout_tar(
                &[runbox_e2e::busybox_tar()],
                &config,
            )),
        )
        .await
        .unwrap();
    let run = daemon
        .create_with(runbox_types::CreateRunRequest {
            image: "as-nobody".into(),
            ..Default::default()
        })
        .await;
    let id = run.id.to_string();
    let out = daemon.sh(&id, "id -u; echo $HOME").await;
    assert_eq!(
        String::from_utf8_lossy(&out.stdout),
        "65534\n/nonexistent\n"
    );
    // A per-exec user overrides it.
    let as_root = daemon
        .exec(
            &id,
            runbox_types::ExecRequest {
                cmd: vec!["id".into(), "-u".into()],
                user: Some("root".into()),
                ..Default::default()
            },
        )
        .await;
    assert_eq!(String::from_utf8_lossy(&as_root.stdout), "0\n");
    // Uploads belong to the image's user.
    daemon
        .client
        .put_file(&id, "owned.txt", runbox_e2e::body(b"mine".to_vec()))
        .await
        .unwrap();
    let out = daemon.sh(&id, "stat -c %u /work/owned.txt").await;
    assert_eq!(String::from_utf8_lossy(&out.stdout), "65534\n");
    // So do the directories an upload or a mkdir makes, so the user's
    // commands can write in them.
    daemon
        .client
        .put_file(&id, "made/by/upload.txt", runbox_e2e::body(b"x".to_vec()))
        .await
        .unwrap();
    daemon
        .client
        .make_dir(
            &id,
            &runbox_types::MakeDirRequest {
                path: "made/by/mkdir".into(),
                ..Default::default()
            },
        )
        .await
        .unwrap();
    let out = daemon
        .sh(
            &id,
            "stat -c %u /work/made /work/made/by /work/made/by/mkdir",
        )
        .await;
    assert_eq!(
        String::from_utf8_lossy(&out.stdout),
        "65534\n65534\n65534\n"
    );
    // An unknown user is a 400 naming it.
    let (status, body) = raw_request(
        &daemon.url,
        "POST",
        &format!("/v1/runs/{id}/exec"),
        &daemon.token,
        br#"{"cmd": ["true"], "user": "ghost"}"#,
    )
    .await;
    assert_eq!(status, 400, "{body}");
    assert!(
        body.contains("bad_user") && body.contains("ghost"),
        "{body}"
    );
    daemon.client.delete_run(&id).await.unwrap();
}
