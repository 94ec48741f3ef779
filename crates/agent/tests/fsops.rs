//! Stat, ListDir, MakeDir, Move and Remove against a real agent: what each
//! does, and that none of them leaves the work directory through a symlink
//! or `..`, or follows a symlink it describes, moves or removes.

mod common;

use std::os::unix::fs::symlink;

use common::*;
use runbox_agent_proto::pb::{
    FileKind, ListDirRequest, MakeDirRequest, MoveRequest, RemoveRequest, StatRequest,
};
use tonic::Code;

fn names(reply: &runbox_agent_proto::pb::ListDirReply) -> Vec<String> {
    reply.entries.iter().map(|e| e.path.clone()).collect()
}

#[tokio::test]
async fn stat_and_list_describe_without_following() {
    let mut agent = TestAgent::start().await;
    std::fs::create_dir_all(agent.path("src/deep/er")).unwrap();
    std::fs::write(agent.path("src/main.rs"), "fn main() {}").unwrap();
    std::fs::write(agent.path("src/deep/er/x"), "x").unwrap();
    symlink("/etc", agent.path("etc-link")).unwrap();

    let info = agent
        .client
        .stat(StatRequest {
            path: "src/main.rs".into(),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(info.kind, FileKind::Regular as i32);
    assert_eq!((info.size, info.path.as_str()), (12, "src/main.rs"));
    let root = agent
        .client
        .stat(StatRequest {
            path: "".into(),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(root.kind, FileKind::Directory as i32);
    let link = agent
        .client
        .stat(StatRequest {
            path: "etc-link".into(),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(link.kind, FileKind::Symlink as i32);
    assert_eq!(link.symlink_target, "/etc");

    let top = agent
        .client
        .list_dir(ListDirRequest {
            path: "".into(),
            depth: 1,
            limit: 0,
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(names(&top), ["etc-link", "src"]);
    let deep = agent
        .client
        .list_dir(ListDirRequest {
            path: "src".into(),
            depth: 3,
            limit: 0,
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(
        names(&deep),
        ["src/deep", "src/deep/er", "src/deep/er/x", "src/main.rs"]
    );
    let capped = agent
        .client
        .list_dir(ListDirRequest {
            path: "src".into(),
            depth: 3,
            limit: 2,
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    assert!(capped.truncated && capped.entries.len() == 2);
    // A listing never enters a symlink, even one to a directory inside.
    symlink("src", agent.path("src-link")).unwrap();
    let all = agent
        .client
        .list_dir(ListDirRequest {
            path: "".into(),
            depth: 4,
            limit: 0,
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    assert!(!names(&all).iter().any(|n| n.starts_with("src-link/")));
    // Listing through a symlink that leaves is an escape; a file is not a
    // directory.
    for (path, kind) in [("etc-link", "escape"), ("src/main.rs", "not_a_file")] {
        let err = agent
            .client
            .list_dir(ListDirRequest {
                path: path.into(),
                depth: 1,
                limit: 0,
                ..Default::default()
            })
            .await
            .unwrap_err();
        assert_eq!(common::kind(&err), kind, "{path}: {err:?}");
    }
}

#[tokio::test]
async fn make_move_and_remove_stay_inside() {
    let mut agent = TestAgent::start().await;
    let made = agent
        .client
        .make_dir(MakeDirRequest {
            path: "a/b/c".into(),
            mode: 0o750,
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!((made.kind, made.mode), (FileKind::Directory as i32, 0o750));
    // Again is fine (mkdir -p); over a file is not.
    agent
        .client
        .make_dir(MakeDirRequest {
            path: "a/b/c".into(),
            mode: 0,
            ..Default::default()
        })
        .await
        .unwrap();
    std::fs::write(agent.path("file"), "f").unwrap();
    let err = agent
        .client
        .make_dir(MakeDirRequest {
            path: "file".into(),
            mode: 0,
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(common::kind(&err), "not_a_file");

    // The directories made belong to the user asked for; those that were
    // there keep their owner; an unknown user makes nothing.
    {
        use std::os::unix::fs::MetadataExt;
        agent
            .client
            .make_dir(MakeDirRequest {
                path: "a/owned/deep".into(),
                user: "4242:4343".into(),
                ..Default::default()
            })
            .await
            .unwrap();
        for (path, ids) in [
            ("a/owned/deep", (4242, 4343)),
            ("a/owned", (4242, 4343)),
            ("a", (0, 0)),
        ] {
            let meta = std::fs::metadata(agent.path(path)).unwrap();
            assert_eq!((meta.uid(), meta.gid()), ids, "{path}");
        }
        let err = agent
            .client
            .make_dir(MakeDirRequest {
                path: "a/nobody".into(),
                user: "no-such-user-here".into(),
                ..Default::default()
            })
            .await
            .unwrap_err();
        assert_eq!(common::kind(&err), "bad_user");
        assert!(!agent.path("a/nobody").exists());
    }

    // Move: no replacing unless asked.
    std::fs::write(agent.path("a/one"), "1").unwrap();
    std::fs::write(agent.path("a/two"), "2").unwrap();
    let mv = |from: &str, to: &str, overwrite: bool| MoveRequest {
        from: from.into(),
        to: to.into(),
        overwrite,
        ..Default::default()
    };
    let err = agent
        .client
        .r#move(mv("a/one", "a/two", false))
        .await
        .unwrap_err();
    assert_eq!(
        (err.code(), common::kind(&err)),
        (Code::AlreadyExists, "exists")
    );
    agent
        .client
        .r#move(mv("a/one", "a/two", true))
        .await
        .unwrap();
    assert_eq!(std::fs::read_to_string(agent.path("a/two")).unwrap(), "1");
    let moved = agent
        .client
        .r#move(mv("a/b", "b", false))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(moved.path, "b");
    assert!(agent.path("b/c").is_dir());

    // Remove: a symlink, not its target; a directory only when recursive.
    symlink("/etc", agent.path("etc-link")).unwrap();
    agent
        .client
        .remove(RemoveRequest {
            path: "etc-link".into(),
            recursive: true,
            ..Default::default()
        })
        .await
        .unwrap();
    assert!(std::path::Path::new("/etc/passwd").exists());
    std::fs::write(agent.path("b/c/f"), "f").unwrap();
    let err = agent
        .client
        .remove(RemoveRequest {
            path: "b".into(),
            recursive: false,
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(common::kind(&err), "not_empty");
    let removed = agent
        .client
        .remove(RemoveRequest {
            path: "b".into(),
            recursive: true,
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(removed.removed, 3);
    assert!(!agent.path("b").exists());
}

#[tokio::test]
async fn nothing_reaches_outside_the_work_directory() {
    let mut agent = TestAgent::start().await;
    let outside = agent.dir.path().join("outside");
    std::fs::create_dir(&outside).unwrap();
    std::fs::write(outside.join("secret"), "s").unwrap();
    symlink(&outside, agent.path("out")).unwrap();
    for path in ["../outside/secret", "/etc/passwd", "out/secret"] {
        let err = agent
            .client
            .stat(StatRequest {
                path: path.into(),
                ..Default::default()
            })
            .await
            .unwrap_err();
        assert!(
            matches!(common::kind(&err), "escape" | "invalid_path"),
            "{path}: {err:?}"
        );
    }
    let err = agent
        .client
        .make_dir(MakeDirRequest {
            path: "out/new".into(),
            mode: 0,
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(common::kind(&err), "escape");
    assert!(!outside.join("new").exists());
    let err = agent
        .client
        .remove(RemoveRequest {
            path: "out/secret".into(),
            recursive: true,
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(common::kind(&err), "escape");
    std::fs::write(agent.path("mine"), "m").unwrap();
    for (from, to) in [
        ("mine", "out/stolen"),
        ("out/secret", "taken"),
        ("mine", "../x"),
    ] {
        let err = agent
            .client
            .r#move(MoveRequest {
                from: from.into(),
                to: to.into(),
                overwrite: true,
                ..Default::default()
            })
            .await
            .unwrap_err();
        assert!(
            matches!(common::kind(&err), "escape" | "invalid_path"),
            "{from} -> {to}: {err:?}"
        );
    }
    assert!(outside.join("secret").exists() && !outside.join("stolen").exists());
    // The work directory itself can be described, never removed or moved.
    for path in ["", ".", "./"] {
        let err = agent
            .client
            .remove(RemoveRequest {
                path: path.into(),
                recursive: true,
                ..Default::default()
            })
            .await
            .unwrap_err();
        assert_eq!(common::kind(&err), "invalid_path", "{path:?}");
    }
}

#[tokio::test]
async fn watch_reports_changes_below_and_only_below() {
    use runbox_agent_proto::pb::{WatchKind, WatchRequest};
    let mut agent = TestAgent::start().await;
    std::fs::create_dir_all(agent.path("src/old")).unwrap();
    let outside = agent.dir.path().join("outside");
    std::fs::create_dir(&outside).unwrap();
    symlink(&outside, agent.path("out")).unwrap();
    let mut events = agent
        .client
        .watch(WatchRequest {
            path: "".into(),
            recursive: true,
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    let first = events.message().await.unwrap().unwrap();
    assert_eq!(first.kind, WatchKind::Ready as i32);
    // Changes inside (a new directory is watched as it appears) ...
    std::fs::write(agent.path("src/a.txt"), "a").unwrap();
    std::fs::create_dir(agent.path("src/new")).unwrap();
    std::thread::sleep(std::time::Duration::from_millis(100));
    std::fs::write(agent.path("src/new/b.txt"), "b").unwrap();
    std::fs::rename(agent.path("src/a.txt"), agent.path("src/c.txt")).unwrap();
    std::fs::remove_file(agent.path("src/c.txt")).unwrap();
    // ... and outside, through the symlink, which is never watched.
    std::fs::write(outside.join("secret"), "s").unwrap();
    std::fs::write(agent.path("done"), "").unwrap();
    let mut seen = Vec::new();
    loop {
        let ev = tokio::time::timeout(PATIENCE, events.message())
            .await
            .unwrap()
            .unwrap()
            .unwrap();
        let kind = WatchKind::try_from(ev.kind).unwrap();
        let line = match kind {
            WatchKind::Renamed => format!("renamed {} -> {}", ev.from, ev.path),
            other => format!("{} {}", other.as_str_name().to_lowercase(), ev.path),
        };
        let done = ev.path == "done" && kind == WatchKind::Written;
        seen.push(line);
        if done {
            break;
        }
    }
    let expected = [
        "created src/a.txt",
        "written src/a.txt",
        "created src/new",
        "created src/new/b.txt",
        "written src/new/b.txt",
        "renamed src/a.txt -> src/c.txt",
        "removed src/c.txt",
        "created done",
        "written done",
    ];
    assert_eq!(seen, expected);
    // A watch through a symlink that leaves is refused.
    let err = agent
        .client
        .watch(WatchRequest {
            path: "out".into(),
            recursive: false,
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(common::kind(&err), "escape");
}
