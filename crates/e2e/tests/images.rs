//! Images in their three import shapes (OCI layout, `docker save`, plain
//! root filesystem), layered with whiteouts, sharing layers, honouring the
//! image config, and refusing hostile archives.

use runbox_e2e::{
    body, busybox_tar, docker_save_tar, layer_tar, oci_layout_tar, LayerEntry, TestDaemon,
};
use runbox_types::{CreateRunRequest, ErrorCode, ExecRequest};

fn config() -> serde_json::Value {
    serde_json::json!({
        "architecture": "amd64", "os": "linux",
        "config": {
            "Env": ["PATH=/usr/local/bin:/usr/bin:/bin", "GREETING=from-the-image"],
            "WorkingDir": "/app",
            "Entrypoint": ["sh", "-c"],
            "Cmd": ["echo entry $GREETING"]
        },
        "rootfs": {"type": "layers", "diff_ids": []}
    })
}

/// busybox: the base layer.
fn lower() -> Vec<u8> {
    busybox_tar()
}

/// Files that the top layer deletes or hides.
fn middle() -> Vec<u8> {
    layer_tar(&[
        LayerEntry::Dir("etc"),
        LayerEntry::File("etc/removed", b"should be gone"),
        LayerEntry::Dir("opaque"),
        LayerEntry::File("opaque/old", b"hidden"),
    ])
}

fn top() -> Vec<u8> {
    layer_tar(&[
        LayerEntry::Dir("app"),
        LayerEntry::File("app/hello.txt", b"hello from the top layer\n"),
        LayerEntry::Whiteout("etc/removed"),
        LayerEntry::Dir("opaque"),
        LayerEntry::Opaque("opaque"),
        LayerEntry::File("opaque/new", b"visible"),
    ])
}

async fn check_image(daemon: &TestDaemon, image: &str) {
    let run = daemon
        .create_with(CreateRunRequest {
            image: image.into(),
            ..Default::default()
        })
        .await;
    let id = run.id.to_string();
    let out = daemon
        .sh(&id, "echo $GREETING; pwd; cat hello.txt; [ -e /etc/removed ] || echo removed-gone; ls /opaque")
        .await;
    assert_eq!(
        String::from_utf8_lossy(&out.stdout),
        "from-the-image\n/app\nhello from the top layer\nremoved-gone\nnew\n",
        "stderr: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    // An exec without a command runs Entrypoint + Cmd.
    let out = daemon.exec(&id, ExecRequest::default()).await;
    assert_eq!(out.stdout, b"entry from-the-image\n");
    // Run and exec env still override the image's.
    let req = ExecRequest {
        cmd: vec!["sh".into(), "-c".into(), "echo $GREETING".into()],
        env: Some(runbox_types::Env(
            [("GREETING".to_owned(), "override".to_owned())].into(),
        )),
        ..Default::default()
    };
    assert_eq!(daemon.exec(&id, req).await.stdout, b"override\n");
    // Nothing the run writes reaches the layers.
    daemon
        .sh(&id, "echo scribble > /app/hello.txt; rm -rf /bin/ls")
        .await;
    daemon.client.delete_run(&id).await.unwrap();
    let again = daemon
        .create_with(CreateRunRequest {
            image: image.into(),
            ..Default::default()
        })
        .await;
    let out = daemon
        .sh(
            &again.id.to_string(),
            "cat hello.txt; ls / >/dev/null && echo ls-ok",
        )
        .await;
    assert_eq!(
        String::from_utf8_lossy(&out.stdout),
        "hello from the top layer\nls-ok\n"
    );
    daemon
        .client
        .delete_run(&again.id.to_string())
        .await
        .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn oci_layout_and_docker_save_imports_share_layers_and_honour_the_config() {
    let daemon = TestDaemon::start(None).await;
    let layers = vec![lower(), middle(), top()];
    let oci = daemon
        .client
        .import_image("from-oci", body(oci_layout_tar(&layers, &config())))
        .await
        .expect("oci layout");
    assert_eq!(oci.source, "oci-layout");
    assert_eq!(oci.layers.len(), 3);
    check_image(&daemon, "from-oci").await;

    let saved = daemon
        .client
        .import_image("from-docker", body(docker_save_tar(&layers, &config())))
        .await
        .expect("docker save");
    assert_eq!(saved.source, "docker-save");
    check_image(&daemon, "from-docker").await;

    // Inspect shows the config document.
    let inspected = daemon.client.get_image("from-oci").await.unwrap();
    assert_eq!(inspected.config.unwrap()["config"]["WorkingDir"], "/app");
    // The busybox layer of `base` (a rootfs import of the same bytes) is
    // the same layer, stored once.
    let base = daemon.client.get_image("base").await.unwrap();
    assert_eq!(base.source, "rootfs");
    assert_eq!(base.layers[0], runbox_e2e::sha256(&busybox_tar()));
    let layer_dirs = || {
        std::fs::read_dir(daemon.state.path().join("images/layers"))
            .unwrap()
            .flatten()
            .filter(|e| e.path().is_dir())
            .count()
    };
    // Layers are keyed by what they unpack to (diff_id): the layout's gzip
    // blobs and the save's plain ones are the same three layers, and the
    // busybox one is `base`'s.
    assert_eq!(layer_dirs(), 3, "layers are not shared");
    assert_eq!(saved.layers, oci.layers);
    assert_eq!(oci.layers[0], base.layers[0]);

    // Removing an image collects only the layers nobody else uses: here
    // none, `from-oci` has them all.
    daemon.client.delete_image("from-docker").await.unwrap();
    assert_eq!(layer_dirs(), 3);
    check_image(&daemon, "from-oci").await;
    daemon.client.delete_image("from-oci").await.unwrap();
    // Its middle and top went; busybox stays for `base`.
    assert_eq!(layer_dirs(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hostile_image_archives_are_refused_and_leave_nothing() {
    let daemon = TestDaemon::start(None).await;
    let layers_before = std::fs::read_dir(daemon.state.path().join("images/layers"))
        .unwrap()
        .count();
    let mut b = tar::Builder::new(Vec::new());
    let mut h = tar::Header::new_gnu();
    h.set_entry_type(tar::EntryType::Symlink);
    h.set_size(0);
    h.set_mode(0o777);
    h.set_uid(0);
    h.set_gid(0);
    b.append_link(&mut h, "etc", "/etc").unwrap();
    let mut h = tar::Header::new_gnu();
    h.set_entry_type(tar::EntryType::Regular);
    h.set_size(5);
    h.set_mode(0o644);
    h.set_uid(0);
    h.set_gid(0);
    b.append_data(&mut h, "etc/pwned", &b"pwned"[..]).unwrap();
    let escape = b.into_inner().unwrap();
    let err = daemon
        .client
        .import_image("evil", body(escape))
        .await
        .unwrap_err();
    assert_eq!(err.code(), Some(ErrorCode::BadArchive), "{err}");
    assert!(err.to_string().contains("symlink"), "{err}");
    assert!(!std::path::Path::new("/etc/pwned").exists());
    // A layout whose layer does not match its digest.
    let mut tampered = oci_layout_tar(&[middle()], &config());
    let n = tampered.len();
    tampered[n / 3] ^= 0xff;
    let err = daemon
        .client
        .import_image("tampered", body(tampered))
        .await
        .unwrap_err();
    assert_eq!(err.code(), Some(ErrorCode::BadArchive), "{err}");
    assert_eq!(
        std::fs::read_dir(daemon.state.path().join("images/layers"))
            .unwrap()
            .count(),
        layers_before
    );
    assert_eq!(daemon.client.list_images().await.unwrap().images.len(), 1);
}

/// What the common tools write imports as `docker save` does: skopeo's
/// `docker-archive:` (layers by digest beside legacy `<id>/layer.tar`
/// symlinks) and `oci-archive:`, made here by the real skopeo from an OCI
/// layout.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn archives_written_by_skopeo_import() {
    let daemon = TestDaemon::start(None).await;
    let scratch = tempfile::tempdir().unwrap();
    let source = scratch.path().join("source.tar");
    let layers = vec![lower(), middle(), top()];
    std::fs::write(&source, oci_layout_tar(&layers, &config())).unwrap();
    let skopeo = |to: &str| {
        let out = std::process::Command::new("skopeo")
            .args([
                "--insecure-policy",
                "copy",
                "--quiet",
                &format!("oci-archive:{}", source.display()),
                to,
            ])
            .output()
            .expect("skopeo (installed by scripts/test-registry)");
        assert!(
            out.status.success(),
            "skopeo copy to {to}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    };
    let docker = scratch.path().join("docker-archive.tar");
    skopeo(&format!("docker-archive:{}:test:latest", docker.display()));
    let oci = scratch.path().join("oci-archive.tar");
    skopeo(&format!("oci-archive:{}", oci.display()));
    for (name, file, source) in [
        ("from-skopeo-docker", &docker, "docker-save"),
        ("from-skopeo-oci", &oci, "oci-layout"),
    ] {
        let image = daemon
            .client
            .import_image(name, body(std::fs::read(file).unwrap()))
            .await
            .unwrap_or_else(|e| panic!("{name}: {e}"));
        assert_eq!(image.source, source, "{name}");
        assert_eq!(image.layers.len(), 3, "{name}");
        check_image(&daemon, name).await;
        daemon.client.delete_image(name).await.unwrap();
    }
}
