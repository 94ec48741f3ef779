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
