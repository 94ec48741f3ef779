//! File transfer: confinement to /work (syntax and symlinks, including
//! symlinks the run plants itself), errors, and streaming without buffering.

use runbox_e2e::{raw_request, TestDaemon};
use runbox_types::ErrorCode;

fn code_of(body: &str) -> String {
    let v: serde_json::Value =
        serde_json::from_str(body).unwrap_or_else(|_| panic!("not JSON: {body}"));
    v["error"]["code"].as_str().unwrap_or_default().to_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn traversal_and_symlink_escapes_are_refused() {
    let daemon = TestDaemon::start(None).await;
    let id = daemon.create().await.id.to_string();
    // The run plants escapes of its own.
    let out = daemon
        .sh(
            &id,
            "mkdir -p /work/inside && echo ok > /work/inside/f && \
             ln -s /etc /work/etc-link && ln -s ../ /work/up && ln -s /etc/passwd /work/pw && \
             ln -s inside/f /work/good-link && echo secret > /root/secret",
        )
        .await;
    assert_eq!(
        out.exit.exit_code,
        0,
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );

    let base = format!("/v1/runs/{id}/files");
    // Syntax: refused before anything reaches the run.
    for path in [
        "../root/secret",
        "%2e%2e/root/secret",
        "a/../../root/secret",
        "/etc/passwd",
        "a%00b",
        "%2Fetc%2Fpasswd",
    ] {
        for method in ["GET", "PUT"] {
            let (status, body) = raw_request(
                &daemon.url,
                method,
                &format!("{base}/{path}"),
                &daemon.token,
                b"x",
            )
            .await;
            assert_eq!(status, 400, "{method} {path}: {body}");
            assert_eq!(code_of(&body), "bad_path", "{method} {path}");
        }
    }
    // Symlinks that lead outside /work: refused for reads and writes.
    for path in [
        "etc-link/passwd",
        "up/root/secret",
        "pw",
        "etc-link/new-file",
        "up/etc/new-file",
    ] {
        let (status, body) = raw_request(
            &daemon.url,
            "GET",
            &format!("{base}/{path}"),
            &daemon.token,
            b"",
        )
        .await;
        assert!(
            status == 403 || status == 404,
            "GET {path}: {status} {body}"
        );
        if status == 403 {
            assert_eq!(code_of(&body), "path_escape");
        }
        // A symlink as the last component is replaced by an upload (tested
        // below); through a symlinked parent, writes must be refused.
        if path.contains('/') {
            let (status, body) = raw_request(
                &daemon.url,
                "PUT",
                &format!("{base}/{path}"),
                &daemon.token,
                b"pwned",
            )
            .await;
            assert_eq!(status, 403, "PUT {path}: {body}");
            assert_eq!(code_of(&body), "path_escape");
        }
    }
    for path in ["etc-link/passwd", "up/root/secret", "pw"] {
        let err = daemon.client.get_file(&id, path).await.unwrap_err();
        assert_eq!(err.code(), Some(ErrorCode::PathEscape), "{path}: {err}");
    }
    // An upload the agent refuses while its body is still arriving: the
    // refusal is the answer, never the closed stream it leaves behind
    // (which side the daemon notices first varies, so many times over).
    for _ in 0..20 {
        let err = daemon
            .client
            .put_file(&id, "etc-link/big", runbox_e2e::body(vec![7u8; 2 << 20]))
            .await
            .unwrap_err();
        assert_eq!(err.code(), Some(ErrorCode::PathEscape), "{err}");
    }
    // Nothing was written outside /work.
    let out = daemon
        .sh(
            &id,
            "ls /etc/new-file /new-file 2>&1; cat /etc/passwd | grep -c pwned",
        )
        .await;
    assert!(!String::from_utf8_lossy(&out.stdout).contains("pwned"));
    assert_eq!(
        String::from_utf8_lossy(&out.stdout).lines().last(),
        Some("0")
    );
    // A symlink that stays inside /work is fine.
    let back = daemon
        .client
        .get_file(&id, "good-link")
        .await
        .expect("inside link");
    assert_eq!(back.bytes().await.unwrap().as_ref(), b"ok\n");
    // Errors that are not escapes.
    let err = daemon
        .client
        .get_file(&id, "no/such/file")
        .await
        .unwrap_err();
    assert_eq!(err.code(), Some(ErrorCode::FileNotFound));
    let err = daemon.client.get_file(&id, "inside").await.unwrap_err();
    assert_eq!(err.code(), Some(ErrorCode::NotAFile));
    let err = daemon
        .client
        .put_file(&id, "inside", runbox_e2e::body(b"x".to_vec()))
        .await
        .unwrap_err();
    assert_eq!(err.code(), Some(ErrorCode::NotAFile));
    // Replacing a symlink by upload replaces the link, not its target.
    daemon
        .client
        .put_file(&id, "pw", runbox_e2e::body(b"new".to_vec()))
        .await
        .expect("replace link");
    let out = daemon.sh(&id, "cat /work/pw; head -c 5 /etc/passwd").await;
    assert_eq!(String::from_utf8_lossy(&out.stdout), "newroot:");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_one_gib_upload_streams_without_growing_the_daemon() {
    const SIZE: u64 = 1 << 30;
    const CHUNK: usize = 1 << 20;
    let daemon = TestDaemon::start(None).await;
    let id = daemon.create().await.id.to_string();
    let before = runbox_e2e::peak_rss_kib(daemon.pid());
    let chunks = futures::stream::iter((0..SIZE / CHUNK as u64).map(|i| {
        let mut chunk = vec![0u8; CHUNK];
        chunk[0] = (i % 251) as u8;
        Ok::<_, std::io::Error>(bytes::Bytes::from(chunk))
    }));
    daemon
        .client
        .put_file(
            &id,
            "big.bin",
            runbox_client::UploadBody::from_stream(chunks, Some(SIZE)),
        )
        .await
        .expect("1 GiB upload");
    let after_upload = runbox_e2e::peak_rss_kib(daemon.pid());
    let out = daemon.sh(&id, "wc -c < /work/big.bin").await;
    assert_eq!(
        String::from_utf8_lossy(&out.stdout).trim(),
        SIZE.to_string()
    );
    // And back out, streamed to nowhere.
    let download = daemon
        .client
        .get_file(&id, "big.bin")
        .await
        .expect("download");
    assert_eq!(download.content_length(), Some(SIZE));
    let mut sink = tokio::io::sink();
    let copied = download.copy_to(&mut sink).await.expect("stream");
    assert_eq!(copied, SIZE);
    let after_download = runbox_e2e::peak_rss_kib(daemon.pid());
    // Peak resident memory may grow by buffers, never by the file.
    let grown_mib = (after_download.max(after_upload) - before) / 1024;
    assert!(
        grown_mib < 64,
        "daemon peak RSS grew by {grown_mib} MiB moving 1 GiB"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_interrupted_upload_leaves_the_old_file_intact() {
    let daemon = TestDaemon::start(None).await;
    let id = daemon.create().await.id.to_string();
    daemon
        .client
        .put_file(&id, "keep.txt", runbox_e2e::body(b"original".to_vec()))
        .await
        .unwrap();
    // A body that breaks off half-way.
    let chunks = futures::stream::iter(vec![
        Ok(bytes::Bytes::from_static(b"partial data")),
        Err(std::io::Error::other("client went away")),
    ]);
    let result = daemon
        .client
        .put_file(
            &id,
            "keep.txt",
            runbox_client::UploadBody::from_stream(chunks, None),
        )
        .await;
    assert!(result.is_err());
    let out = daemon
        .sh(
            &id,
            "cat /work/keep.txt; ls -a /work | grep -c runbox-upload",
        )
        .await;
    assert_eq!(String::from_utf8_lossy(&out.stdout), "original0\n");
    // A body longer than the declared length is refused too.
    let (status, _) = raw_request(
        &daemon.url,
        "PUT",
        &format!("/v1/runs/{id}/files/keep.txt"),
        &daemon.token,
        b"",
    )
    .await;
    assert_eq!(status, 204, "an empty upload is a valid empty file");
}
