//! WriteFile and ReadFile against a real agent: round trips, the path
//! grammar, confinement against symlinks planted in the work directory,
//! and the all-or-nothing write.

mod common;

use std::os::unix::fs::{symlink, PermissionsExt};
use std::time::Duration;

use common::*;
use runbox_agent_proto::pb::{write_file_chunk, WriteFileChunk};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::Code;

/// Deterministic, non-repeating-looking bytes (an LCG), so a shifted or
/// duplicated chunk cannot compare equal.
fn pattern(len: usize) -> Vec<u8> {
    let mut state: u32 = 0x1234_5678;
    (0..len)
        .map(|_| {
            state = state.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
            (state >> 24) as u8
        })
        .collect()
}

#[tokio::test]
async fn round_trip_of_a_5_mib_file() {
    let mut agent = TestAgent::start().await;
    let data = pattern(5 << 20);
    let written = write(&mut agent.client, "big.bin", 0, &data).await.unwrap();
    assert_eq!(written, data.len() as u64);
    assert_eq!(std::fs::read(agent.path("big.bin")).unwrap(), data);

    let (header, read_back) = read(&mut agent.client, "big.bin").await.unwrap();
    assert_eq!(header.size, data.len() as u64);
    assert_eq!(header.mode, 0o644);
    assert!(read_back == data, "contents differ");
    assert!(temp_files(&agent.work).is_empty());
}

#[tokio::test]
async fn empty_file_round_trip() {
    let mut agent = TestAgent::start().await;
    assert_eq!(write(&mut agent.client, "empty", 0, b"").await.unwrap(), 0);
    let (header, data) = read(&mut agent.client, "empty").await.unwrap();
    assert_eq!((header.size, data.len()), (0, 0));
}

#[tokio::test]
async fn write_creates_missing_parents() {
    let mut agent = TestAgent::start().await;
    write(&mut agent.client, "a/b//./c/file.txt", 0, b"deep")
        .await
        .unwrap();
    assert_eq!(
        std::fs::read(agent.path("a/b/c/file.txt")).unwrap(),
        b"deep"
    );
    let mode = std::fs::metadata(agent.path("a/b"))
        .unwrap()
        .permissions()
        .mode();
    assert!(std::fs::metadata(agent.path("a/b")).unwrap().is_dir());
    assert_eq!(mode & 0o700, 0o700);
    assert!(temp_files(&agent.path("a/b/c")).is_empty());
}

#[tokio::test]
async fn write_replaces_and_applies_mode() {
    let mut agent = TestAgent::start().await;
    write(&mut agent.client, "f", 0o755, b"one").await.unwrap();
    let (header, _) = read(&mut agent.client, "f").await.unwrap();
    assert_eq!(header.mode, 0o755);

    // Replacing gives the new contents and the new mode; special bits are
    // never set.
    write(&mut agent.client, "f", 0o4777, b"two").await.unwrap();
    let (header, data) = read(&mut agent.client, "f").await.unwrap();
    assert_eq!((header.mode, data.as_slice()), (0o777, &b"two"[..]));
}

#[tokio::test]
async fn invalid_paths_are_refused() {
    let mut agent = TestAgent::start().await;
    for path in ["", "../x", "a/../../x", "/etc/passwd", "a\0b", "."] {
        let status = read(&mut agent.client, path).await.unwrap_err();
        assert_eq!(kind(&status), "invalid_path", "read {path:?}: {status:?}");
        assert_eq!(status.code(), Code::InvalidArgument);

        let status = write(&mut agent.client, path, 0, b"x").await.unwrap_err();
        assert_eq!(kind(&status), "invalid_path", "write {path:?}: {status:?}");
        assert_eq!(status.code(), Code::InvalidArgument);
    }
}

#[tokio::test]
async fn missing_file_is_not_found() {
    let mut agent = TestAgent::start().await;
    let status = read(&mut agent.client, "nope/nothing").await.unwrap_err();
    assert_eq!(kind(&status), "not_found");
    assert_eq!(status.code(), Code::NotFound);
}

#[tokio::test]
async fn directories_and_fifos_are_not_files() {
    let mut agent = TestAgent::start().await;
    std::fs::create_dir(agent.path("dir")).unwrap();
    let status = read(&mut agent.client, "dir").await.unwrap_err();
    assert_eq!(kind(&status), "not_a_file");
    assert_eq!(status.code(), Code::FailedPrecondition);

    // Writing over a directory is refused too, and leaves no temp file.
    let status = write(&mut agent.client, "dir", 0, b"x").await.unwrap_err();
    assert_eq!(kind(&status), "not_a_file");
    assert!(agent.path("dir").is_dir());

    // A FIFO must be refused without waiting for a writer.
    rustix::fs::mknodat(
        rustix::fs::CWD,
        agent.path("fifo").as_path(),
        rustix::fs::FileType::Fifo,
        rustix::fs::Mode::from_raw_mode(0o644),
        0,
    )
    .unwrap();
    let status = read(&mut agent.client, "fifo").await.unwrap_err();
    assert_eq!(kind(&status), "not_a_file");

    // A regular file where a parent directory is needed.
    std::fs::write(agent.path("plain"), "").unwrap();
    let status = write(&mut agent.client, "plain/child", 0, b"x")
        .await
        .unwrap_err();
    assert_eq!(kind(&status), "not_a_file", "{status:?}");
    assert!(temp_files(&agent.work).is_empty());
}

#[tokio::test]
async fn symlinks_leading_outside_are_escapes() {
    let mut agent = TestAgent::start().await;
    let outside = agent.dir.path().join("outside");
    std::fs::create_dir(&outside).unwrap();
    std::fs::write(outside.join("secret"), "secret").unwrap();
    symlink("/etc", agent.path("etc_link")).unwrap();
    symlink("../outside", agent.path("up")).unwrap();
    symlink("/etc/passwd", agent.path("passwd")).unwrap();
    symlink("../outside/secret", agent.path("secret")).unwrap();

    for path in ["etc_link/passwd", "up/secret", "passwd", "secret"] {
        let status = read(&mut agent.client, path).await.unwrap_err();
        assert_eq!(kind(&status), "escape", "read {path}: {status:?}");
        assert_eq!(status.code(), Code::PermissionDenied);
        assert!(!status.message().contains("secret\n"));
    }
    // Symlinked parents, existing or with missing directories below them.
    for path in ["etc_link/new", "up/new", "up/deeper/new"] {
        let status = write(&mut agent.client, path, 0, b"x").await.unwrap_err();
        assert_eq!(kind(&status), "escape", "write {path}: {status:?}");
        assert_eq!(status.code(), Code::PermissionDenied);
    }
    assert!(!outside.join("new").exists());
    assert!(!outside.join("deeper").exists());
    assert!(!std::path::Path::new("/etc/new").exists());
}

#[tokio::test]
async fn symlinks_staying_inside_are_followed() {
    let mut agent = TestAgent::start().await;
    std::fs::create_dir_all(agent.path("real/sub")).unwrap();
    symlink("real", agent.path("alias")).unwrap();
    // `..` inside a symlink is fine while it stays beneath the work dir.
    symlink("..", agent.path("real/sub/back")).unwrap();

    write(&mut agent.client, "alias/f", 0, b"via alias")
        .await
        .unwrap();
    assert_eq!(std::fs::read(agent.path("real/f")).unwrap(), b"via alias");
    let (_, data) = read(&mut agent.client, "real/sub/back/f").await.unwrap();
    assert_eq!(data, b"via alias");
    // Missing directories below an inside symlink are created inside.
    write(&mut agent.client, "alias/new/g", 0, b"g")
        .await
        .unwrap();
    assert!(agent.path("real/new/g").is_file());
}

#[tokio::test]
async fn write_replaces_a_symlink_instead_of_following_it() {
    let mut agent = TestAgent::start().await;
    let outside = agent.dir.path().join("target");
    std::fs::write(&outside, "original").unwrap();
    symlink(&outside, agent.path("victim")).unwrap();

    write(&mut agent.client, "victim", 0, b"new").await.unwrap();
    assert_eq!(std::fs::read(&outside).unwrap(), b"original");
    let meta = std::fs::symlink_metadata(agent.path("victim")).unwrap();
    assert!(meta.file_type().is_file());
    assert_eq!(std::fs::read(agent.path("victim")).unwrap(), b"new");
}

#[tokio::test]
async fn work_dir_replaced_by_a_symlink_is_refused() {
    let mut agent = TestAgent::start().await;
    let moved = agent.dir.path().join("moved");
    std::fs::rename(&agent.work, &moved).unwrap();
    std::fs::write(moved.join("f"), "inside").unwrap();
    symlink(&moved, &agent.work).unwrap();

    let status = read(&mut agent.client, "f").await.unwrap_err();
    assert_eq!(kind(&status), "escape", "{status:?}");
    let status = write(&mut agent.client, "g", 0, b"x").await.unwrap_err();
    assert_eq!(kind(&status), "escape", "{status:?}");
    assert!(!moved.join("g").exists());
}

#[tokio::test]
async fn write_without_commit_leaves_nothing() {
    let mut agent = TestAgent::start().await;
    std::fs::write(agent.path("kept"), "old").unwrap();
    let messages = write_messages("kept", 0, b"partial", false);
    let status = agent
        .client
        .write_file(tokio_stream::iter(messages))
        .await
        .unwrap_err();
    assert_eq!(kind(&status), "invalid_path");
    assert_eq!(std::fs::read(agent.path("kept")).unwrap(), b"old");

    let messages = write_messages("sub/fresh", 0, b"partial", false);
    agent
        .client
        .write_file(tokio_stream::iter(messages))
        .await
        .unwrap_err();
    assert!(!agent.path("sub/fresh").exists());
    assert!(temp_files(&agent.work).is_empty());
    assert!(temp_files(&agent.path("sub")).is_empty());
}

#[tokio::test]
async fn first_write_message_must_be_a_header() {
    let mut agent = TestAgent::start().await;
    let messages = vec![WriteFileChunk {
        kind: Some(write_file_chunk::Kind::Data(b"x".to_vec())),
    }];
    let status = agent
        .client
        .write_file(tokio_stream::iter(messages))
        .await
        .unwrap_err();
    assert_eq!(kind(&status), "invalid_path");
}

#[tokio::test]
async fn cancelled_write_removes_the_temp_file() {
    let agent = TestAgent::start().await;
    let (tx, rx) = mpsc::channel(8);
    for message in write_messages("cancelled", 0, b"some data", false) {
        tx.send(message).await.unwrap();
    }
    // The request stream stays open (tx is kept), so the agent sits in the
    // middle of the upload until the call is cancelled.
    let mut client = agent.client.clone();
    let call = tokio::spawn(async move { client.write_file(ReceiverStream::new(rx)).await });

    let deadline = tokio::time::Instant::now() + PATIENCE;
    while !agent.writing_into(&agent.work) {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the write never began"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    // Mid-write, the file has no name: nothing to see, nothing to leave.
    assert!(temp_files(&agent.work).is_empty());
    call.abort();
    drop(tx);

    let deadline = tokio::time::Instant::now() + PATIENCE;
    while agent.writing_into(&agent.work) {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the write was never dropped"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(temp_files(&agent.work).is_empty());
    assert!(!agent.path("cancelled").exists());
}

/// Opens a read stream and returns it once the header has arrived.
async fn read_header(
    agent: &mut TestAgent,
    path: &str,
) -> (u64, tonic::Streaming<runbox_agent_proto::pb::ReadFileChunk>) {
    use runbox_agent_proto::pb::{read_file_chunk, ReadFileRequest};
    let mut stream = agent
        .client
        .read_file(ReadFileRequest {
            path: path.into(),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    let first = stream.message().await.unwrap().unwrap();
    let Some(read_file_chunk::Kind::Header(header)) = first.kind else {
        panic!("expected a header, got {first:?}");
    };
    (header.size, stream)
}

#[tokio::test]
async fn read_stops_at_the_announced_size_when_the_file_grows() {
    use runbox_agent_proto::pb::read_file_chunk;
    let mut agent = TestAgent::start().await;
    let data = pattern(1 << 20);
    std::fs::write(agent.path("growing"), &data).unwrap();
    let (size, mut stream) = read_header(&mut agent, "growing").await;
    assert_eq!(size, data.len() as u64);

    let mut file = std::fs::OpenOptions::new()
        .append(true)
        .open(agent.path("growing"))
        .unwrap();
    std::io::Write::write_all(&mut file, &pattern(3 << 20)).unwrap();

    let mut received = Vec::new();
    while let Some(message) = stream.message().await.unwrap() {
        let Some(read_file_chunk::Kind::Data(chunk)) = message.kind else {
            panic!("expected data");
        };
        received.extend(chunk);
    }
    assert!(received == data, "got {} bytes", received.len());
}

#[tokio::test]
async fn read_of_a_shrinking_file_ends_with_data_loss() {
    let mut agent = TestAgent::start().await;
    // Far more than the agent reads ahead of a client that is not reading,
    // so the truncation below happens before it reaches the end.
    let data = pattern(8 << 20);
    std::fs::write(agent.path("shrinking"), &data).unwrap();
    let (size, mut stream) = read_header(&mut agent, "shrinking").await;
    assert_eq!(size, data.len() as u64);

    std::fs::File::options()
        .write(true)
        .open(agent.path("shrinking"))
        .unwrap()
        .set_len(0)
        .unwrap();

    let status = loop {
        match stream.message().await {
            Ok(Some(_)) => {}
            Ok(None) => panic!("stream ended without reporting the loss"),
            Err(status) => break status,
        }
    };
    assert_eq!(status.code(), Code::DataLoss);
    assert_eq!(kind(&status), "io");
}

#[tokio::test]
async fn written_files_belong_to_the_user_asked_for() {
    use std::os::unix::fs::MetadataExt;
    let mut agent = TestAgent::start().await;
    // The parents the write makes are the user's too; one that exists
    // keeps its owner.
    std::fs::create_dir(agent.path("kept")).unwrap();
    let mut messages = write_messages("kept/made/owned.txt", 0, b"mine", true);
    if let Some(write_file_chunk::Kind::Header(h)) = &mut messages[0].kind {
        h.user = "4242:4343".into();
    }
    let (tx, rx) = mpsc::channel(8);
    for m in messages {
        tx.send(m).await.unwrap();
    }
    drop(tx);
    agent
        .client
        .write_file(ReceiverStream::new(rx))
        .await
        .unwrap();
    for path in ["kept/made/owned.txt", "kept/made"] {
        let meta = std::fs::metadata(agent.path(path)).unwrap();
        assert_eq!((meta.uid(), meta.gid()), (4242, 4343), "{path}");
    }
    let kept = std::fs::metadata(agent.path("kept")).unwrap();
    assert_eq!((kept.uid(), kept.gid()), (0, 0));
    // An unknown owner writes nothing.
    let mut messages = write_messages("nope.txt", 0, b"x", true);
    if let Some(write_file_chunk::Kind::Header(h)) = &mut messages[0].kind {
        h.user = "no-such-user-here".into();
    }
    let (tx, rx) = mpsc::channel(8);
    for m in messages {
        tx.send(m).await.unwrap();
    }
    drop(tx);
    let err = agent
        .client
        .write_file(ReceiverStream::new(rx))
        .await
        .unwrap_err();
    assert_eq!(kind(&err), "bad_user");
    assert!(!agent.path("nope.txt").exists());
}

#[tokio::test]
async fn writes_carry_extended_attributes_and_reads_return_them() {
    use runbox_agent_proto::pb::{ListDirRequest, MoveRequest, StatRequest};
    let mut agent = TestAgent::start().await;
    let write_with = |path: &str, xattrs: &[(&str, &str)]| {
        let mut messages = write_messages(path, 0, b"data", true);
        if let Some(write_file_chunk::Kind::Header(h)) = &mut messages[0].kind {
            h.xattrs = xattrs
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect();
        }
        messages
    };
    agent
        .client
        .write_file(tokio_stream::iter(write_with(
            "meta.txt",
            &[("user.e2b.author", "mish"), ("user.other", "x")],
        )))
        .await
        .unwrap();
    let stat = |prefix: &str| StatRequest {
        path: "meta.txt".into(),
        xattr_prefix: prefix.into(),
        ..Default::default()
    };
    let info = agent
        .client
        .stat(stat("user.e2b."))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(info.xattrs.len(), 1);
    assert_eq!(info.xattrs["user.e2b.author"], "mish");
    // Without a prefix nothing is read.
    let info = agent.client.stat(stat("")).await.unwrap().into_inner();
    assert!(info.xattrs.is_empty());
    let listed = agent
        .client
        .list_dir(ListDirRequest {
            xattr_prefix: "user.".into(),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    let entry = listed
        .entries
        .iter()
        .find(|e| e.path == "meta.txt")
        .unwrap();
    assert_eq!(entry.xattrs.len(), 2);
    let moved = agent
        .client
        .r#move(MoveRequest {
            from: "meta.txt".into(),
            to: "moved.txt".into(),
            xattr_prefix: "user.e2b.".into(),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(moved.xattrs["user.e2b.author"], "mish");
    // An overwrite is a new file: the old attributes go with the old one.
    write(&mut agent.client, "moved.txt", 0, b"again")
        .await
        .unwrap();
    let info = agent
        .client
        .stat(StatRequest {
            path: "moved.txt".into(),
            xattr_prefix: "user.".into(),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    assert!(info.xattrs.is_empty());
    // Other namespaces are refused, and nothing is written.
    let err = agent
        .client
        .write_file(tokio_stream::iter(write_with(
            "bad.txt",
            &[("trusted.overlay.opaque", "y")],
        )))
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::InvalidArgument);
    assert!(!agent.path("bad.txt").exists());
}

#[tokio::test]
async fn a_file_used_as_a_directory_is_not_a_file_for_every_call() {
    let mut agent = TestAgent::start().await;
    write(&mut agent.client, "hello.txt", 0, b"hi")
        .await
        .unwrap();
    let read_err = read(&mut agent.client, "hello.txt/x").await.unwrap_err();
    assert_eq!(kind(&read_err), "not_a_file", "{read_err:?}");
    let write_err = write(&mut agent.client, "hello.txt/x", 0, b"x")
        .await
        .unwrap_err();
    assert_eq!(kind(&write_err), "not_a_file", "{write_err:?}");
    // Neither names a path as its own parent.
    for status in [&read_err, &write_err] {
        assert!(
            !status.message().contains("cannot hold \"hello.txt/x\"")
                || status.message().starts_with("\"hello.txt\""),
            "{status:?}"
        );
    }
}
