//! Pulling from a real registry (Debian's `docker-registry`, the
//! distribution registry) on loopback, pushed to with `skopeo`.

use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use futures::StreamExt;
use runbox_client::PullUpdate;
use runbox_e2e::{
    busybox_tar, docker_save_tar, layer_tar, oci_layout_tar, sha256, LayerEntry, TestDaemon,
};
use runbox_types::{CreateRunRequest, ErrorCode, PullEvent, PullRequest};

/// A registry on 127.0.0.1, killed and cleaned up on drop.
struct Registry {
    child: Child,
    port: u16,
    _dir: tempfile::TempDir,
}

impl Registry {
    fn start() -> Registry {
        for tool in ["docker-registry", "skopeo"] {
            assert!(
                Command::new("sh")
                    .arg("-c")
                    .arg(format!("command -v {tool}"))
                    .status()
                    .is_ok_and(|s| s.success()),
                "{tool} is missing: run scripts/test-registry"
            );
        }
        let dir = tempfile::tempdir().unwrap();
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let config = dir.path().join("config.yml");
        std::fs::write(
            &config,
            format!(
                "version: 0.1\nlog:\n  level: warn\nstorage:\n  filesystem:\n    rootdirectory: {}\nhttp:\n  addr: 127.0.0.1:{port}\n",
                dir.path().join("data").display()
            ),
        )
        .unwrap();
        let child = Command::new("docker-registry")
            .arg("serve")
            .arg(&config)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("starting docker-registry");
        let registry = Registry {
            child,
            port,
            _dir: dir,
        };
        for _ in 0..100 {
            if std::net::TcpStream::connect(("127.0.0.1", port)).is_ok() {
                return registry;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        panic!("docker-registry did not start");
    }

    /// Pushes an OCI layout (as a tarball) to `repo:tag`.
    fn push(&self, layout_tar: &[u8], repo_tag: &str) {
        let dir = tempfile::tempdir().unwrap();
        tar::Archive::new(layout_tar).unpack(dir.path()).unwrap();
        let status = Command::new("skopeo")
            .args(["copy", "--quiet", "--dest-tls-verify=false"])
            .arg(format!("oci:{}", dir.path().display()))
            .arg(format!("docker://127.0.0.1:{}/{repo_tag}", self.port))
            .status()
            .expect("skopeo");
        assert!(status.success(), "skopeo copy failed");
    }
}

impl Drop for Registry {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn image_layout() -> Vec<u8> {
    image_layout_with(b"pulled\n")
}

/// The test image with `data` in /srv/data.txt.
fn image_layout_with(data: &[u8]) -> Vec<u8> {
    let config = serde_json::json!({
        "architecture": "amd64", "os": "linux",
        "config": {"Env": ["PATH=/bin:/usr/bin", "FROM_REGISTRY=yes"], "WorkingDir": "/srv"},
        "rootfs": {"type": "layers", "diff_ids": []}
    });
    let top = layer_tar(&[
        LayerEntry::Dir("srv"),
        LayerEntry::File("srv/data.txt", data),
    ]);
    oci_layout_tar(&[busybox_tar(), top], &config)
}

async fn pull(
    daemon: &TestDaemon,
    reference: &str,
    name: &str,
) -> Result<(runbox_types::Image, Vec<PullEvent>), runbox_client::ClientError> {
    let req = PullRequest {
        reference: reference.into(),
        name: Some(name.into()),
        ..Default::default()
    };
    let mut stream = daemon.client.pull_image(&req).await?;
    let mut events = Vec::new();
    while let Some(item) = stream.next().await {
        match item? {
            PullUpdate::Progress(e) => events.push(e),
            PullUpdate::Done(image) => return Ok((image, events)),
        }
    }
    panic!("pull stream ended without a result")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pull_run_and_pull_again_without_transferring_layers() {
    let registry = Registry::start();
    registry.push(&image_layout(), "team/app:1");
    let daemon = TestDaemon::start(None).await;
    let reference = format!("127.0.0.1:{}/team/app:1", registry.port);

    let (image, events) = pull(&daemon, &reference, "app").await.expect("pull");
    assert_eq!(image.pull, Some(runbox_types::PullOutcome::New));
    assert_eq!(image.layers.len(), 2);
    assert!(image.source.contains("team/app:1"), "{}", image.source);
    assert!(
        matches!(events.first(), Some(PullEvent::Resolved { layers: 2, .. })),
        "{events:?}"
    );
    assert_eq!(
        events
            .iter()
            .filter(|e| matches!(e, PullEvent::LayerDone { .. }))
            .count(),
        2
    );

    // A run from the pulled image sees its files and its config.
    let run = daemon
        .create_with(CreateRunRequest {
            image: "app".into(),
            ..Default::default()
        })
        .await;
    let out = daemon
        .sh(
            &run.id.to_string(),
            "echo $FROM_REGISTRY; pwd; cat data.txt",
        )
        .await;
    assert_eq!(String::from_utf8_lossy(&out.stdout), "yes\n/srv\npulled\n");

    // The same image under another name: every layer is already stored.
    let (again, events) = pull(&daemon, &reference, "app-again")
        .await
        .expect("second pull");
    assert_eq!(again.layers, image.layers);
    assert!(
        events.iter().all(|e| !matches!(
            e,
            PullEvent::LayerStarted { .. } | PullEvent::LayerProgress { .. }
        )),
        "{events:?}"
    );
    assert_eq!(
        events
            .iter()
            .filter(|e| matches!(e, PullEvent::LayerSkipped { .. }))
            .count(),
        2
    );

    // Errors: a missing tag, a taken name, a bad reference, a plain-HTTP
    // registry that is not on loopback (refused before any connection).
    let missing = format!("127.0.0.1:{}/team/app:nope", registry.port);
    assert_eq!(
        pull(&daemon, &missing, "x").await.unwrap_err().code(),
        Some(ErrorCode::RemoteNotFound)
    );
    // The same reference again under its name is a refresh, as with
    // `docker pull`: up to date here, nothing fetched.
    let (same, events) = pull(&daemon, &reference, "app").await.expect("pull again");
    assert_eq!(same.pull, Some(runbox_types::PullOutcome::UpToDate));
    assert_eq!(same.layers, image.layers);
    assert!(
        events
            .iter()
            .all(|e| !matches!(e, PullEvent::LayerStarted { .. })),
        "{events:?}"
    );
    // Another reference under a taken name is refused, naming both.
    let other = format!("127.0.0.1:{}/team/other:1", registry.port);
    let taken = pull(&daemon, &other, "app").await.unwrap_err();
    assert_eq!(taken.code(), Some(ErrorCode::ImageExists));
    assert!(taken.to_string().contains("came from"), "{taken}");
    assert_eq!(
        pull(&daemon, "UPPER/case!", "y").await.unwrap_err().code(),
        Some(ErrorCode::BadReference)
    );
    let err = pull(&daemon, "http://registry.invalid:5000/x:1", "z")
        .await
        .unwrap_err();
    assert_eq!(err.code(), Some(ErrorCode::InsecureRegistry), "{err}");
    assert!(err.to_string().contains("--insecure-registry"), "{err}");
    assert!(!Path::new(&daemon.state.path().join("images/images/x.json")).exists());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_create_by_reference_pulls_once_and_then_finds_the_image() {
    let registry = Registry::start();
    registry.push(&image_layout(), "team/app:1");
    let daemon = TestDaemon::start(None).await;
    let reference = format!("127.0.0.1:{}/team/app:1", registry.port);
    let create = |image: &str, pull: Option<runbox_types::PullPolicy>| CreateRunRequest {
        image: image.into(),
        pull,
        ..Default::default()
    };

    // `never` does not pull: not stored is 404.
    let err = daemon
        .client
        .create_run(&create(&reference, Some(runbox_types::PullPolicy::Never)))
        .await
        .unwrap_err();
    assert_eq!(err.code(), Some(ErrorCode::ImageNotFound), "{err}");
    // `always` needs a reference: a local name is a 400 saying so.
    let err = daemon
        .client
        .create_run(&create("base", Some(runbox_types::PullPolicy::Always)))
        .await
        .unwrap_err();
    assert_eq!(err.code(), Some(ErrorCode::BadRequest), "{err}");
    assert!(err.to_string().contains("registry reference"), "{err}");

    // The default pulls it, and the run is made from it.
    let run = daemon.create_with(create(&reference, None)).await;
    assert_eq!(run.image, "app-1");
    let out = daemon.sh(&run.id.to_string(), "cat data.txt").await;
    assert_eq!(out.stdout, b"pulled\n");
    let images = daemon.client.list_images().await.unwrap().images;
    assert_eq!(images.iter().filter(|i| i.name == "app-1").count(), 1);

    // Stop the registry: the same reference (and `never`) now finds the
    // stored image without any pull.
    drop(registry);
    for pull in [None, Some(runbox_types::PullPolicy::Never)] {
        let again = daemon.create_with(create(&reference, pull)).await;
        assert_eq!(again.image, "app-1");
    }
    // A reference that cannot parse is a 400 saying why; a bare word is a local name and is never pulled.
    let err = daemon
        .client
        .create_run(&create("127.0.0.1:1/Team/App:1", None))
        .await
        .unwrap_err();
    assert_eq!(err.code(), Some(ErrorCode::BadImageName), "{err}");
    assert!(
        err.to_string().contains("nor is it an image reference"),
        "{err}"
    );
    let err = daemon
        .client
        .create_run(&create("nosuchimage", None))
        .await
        .unwrap_err();
    assert_eq!(err.code(), Some(ErrorCode::ImageNotFound), "{err}");
    // A registry that is not there: the pull's error, not a generic one.
    let gone = format!("127.0.0.1:{}/team/other:1", free_port());
    let err = daemon
        .client
        .create_run(&create(&gone, None))
        .await
        .unwrap_err();
    assert_eq!(err.code(), Some(ErrorCode::RegistryError), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pull_always_follows_a_moved_tag_and_live_runs_keep_theirs() {
    let registry = Registry::start();
    registry.push(&image_layout_with(b"v1\n"), "team/app:1");
    let daemon = TestDaemon::start(None).await;
    let reference = format!("127.0.0.1:{}/team/app:1", registry.port);
    let create = |pull: Option<runbox_types::PullPolicy>| CreateRunRequest {
        image: reference.clone(),
        pull,
        ..Default::default()
    };
    let layers = || {
        std::fs::read_dir(daemon.state.path().join("images/layers"))
            .unwrap()
            .filter(|e| e.as_ref().unwrap().path().is_dir())
            .count()
    };
    let data = |id: String| {
        let daemon = &daemon;
        async move { daemon.sh(&id, "cat data.txt").await.stdout }
    };
    let old = daemon.create_with(create(None)).await;
    assert_eq!(data(old.id.to_string()).await, b"v1\n");
    let before = layers();

    // The tag moves. Without `always` the stored image is used.
    registry.push(&image_layout_with(b"v2\n"), "team/app:1");
    let cached = daemon.create_with(create(None)).await;
    assert_eq!(data(cached.id.to_string()).await, b"v1\n");
    // An explicit pull of the same reference sees the tag moved; the runs
    // keep v1 (checked below), the image holds v2.
    let (updated, _) = pull(&daemon, &reference, &old.image).await.expect("pull");
    assert_eq!(updated.pull, Some(runbox_types::PullOutcome::Updated));
    registry.push(&image_layout_with(b"v1\n"), "team/app:1");
    let (back, _) = pull(&daemon, &reference, &old.image).await.expect("pull");
    assert_eq!(back.pull, Some(runbox_types::PullOutcome::Updated));
    registry.push(&image_layout_with(b"v2\n"), "team/app:1");
    // With `always` the image is replaced, under the same name.
    let fresh = daemon
        .create_with(create(Some(runbox_types::PullPolicy::Always)))
        .await;
    assert_eq!(fresh.image, old.image);
    assert_eq!(data(fresh.id.to_string()).await, b"v2\n");
    let image = daemon.client.get_image(&old.image).await.unwrap();
    assert_eq!(image.layers.len(), 2);
    assert_eq!(layers(), before + 1, "one new top layer, the base shared");
    // Runs made before keep what they mount, after the collection the
    // replacement ran.
    assert_eq!(data(old.id.to_string()).await, b"v1\n");
    assert_eq!(data(cached.id.to_string()).await, b"v1\n");
    // Later default creates get the new content.
    let later = daemon.create_with(create(None)).await;
    assert_eq!(data(later.id.to_string()).await, b"v2\n");
    // `always` again with nothing changed: same image, nothing new stored.
    let again = daemon
        .create_with(create(Some(runbox_types::PullPolicy::Always)))
        .await;
    assert_eq!(data(again.id.to_string()).await, b"v2\n");
    assert_eq!(layers(), before + 1);
    assert_eq!(
        daemon.client.get_image(&old.image).await.unwrap().layers,
        image.layers
    );

    // Once the last run of the old content is gone, a collection frees it.
    for run in [&old, &cached] {
        daemon.client.delete_run(&run.id.to_string()).await.unwrap();
    }
    let base = daemon.create().await;
    daemon
        .client
        .delete_run(&base.id.to_string())
        .await
        .unwrap();
    daemon.import("spare", busybox_tar()).await;
    daemon.client.delete_image("spare").await.unwrap();
    assert_eq!(layers(), before, "the old top layer is collected");

    // A registry that is gone: `always` fails with the pull's error, never
    // a stale image.
    drop(registry);
    let err = daemon
        .client
        .create_run(&create(Some(runbox_types::PullPolicy::Always)))
        .await
        .unwrap_err();
    assert_eq!(err.code(), Some(ErrorCode::RegistryError), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn layers_are_shared_across_compressions_and_checked_against_the_config() {
    let registry = Registry::start();
    let top = layer_tar(&[
        LayerEntry::Dir("srv"),
        LayerEntry::File("srv/data.txt", b"shared\n"),
    ]);
    let layers = vec![busybox_tar(), top.clone()];
    let config = |diff_ids: Vec<String>| {
        serde_json::json!({
            "architecture": "amd64", "os": "linux",
            "config": {"Env": ["PATH=/bin:/usr/bin"], "WorkingDir": "/srv"},
            "rootfs": {"type": "layers", "diff_ids": diff_ids}
        })
    };
    let right = config(layers.iter().map(|l| sha256(l)).collect());
    // The registry serves the layers gzip-compressed (an OCI layout).
    registry.push(&oci_layout_tar(&layers, &right), "team/shared:1");
    let daemon = TestDaemon::start(None).await;
    let layer_dirs = || {
        std::fs::read_dir(daemon.state.path().join("images/layers"))
            .unwrap()
            .flatten()
            .filter(|e| e.path().is_dir())
            .count()
    };
    // The same content arrives first uncompressed (`docker save`).
    daemon
        .client
        .import_image("local", runbox_e2e::body(docker_save_tar(&layers, &right)))
        .await
        .unwrap();
    let before = layer_dirs();
    // The pull finds both layers by diff_id and fetches no layer blob.
    let reference = format!("127.0.0.1:{}/team/shared:1", registry.port);
    let (image, events) = pull(&daemon, &reference, "pulled").await.unwrap();
    let skipped = events
        .iter()
        .filter(|e| matches!(e, PullEvent::LayerSkipped { .. }))
        .count();
    assert_eq!(skipped, 2, "{events:?}");
    assert!(
        !events
            .iter()
            .any(|e| matches!(e, PullEvent::LayerStarted { .. })),
        "{events:?}"
    );
    assert_eq!(layer_dirs(), before);
    let local = daemon.client.get_image("local").await.unwrap();
    assert_eq!(image.layers, local.layers);
    let run = daemon
        .create_with(CreateRunRequest {
            image: "pulled".into(),
            ..Default::default()
        })
        .await;
    let out = daemon.sh(&run.id.to_string(), "cat data.txt").await;
    assert_eq!(out.stdout, b"shared\n");

    // A config whose diff_id does not match what the blob unpacks to is
    // refused, on a pull and on an import, and stores nothing.
    let lying = config(vec![sha256(&busybox_tar()), sha256(b"not this layer")]);
    let other_top = layer_tar(&[LayerEntry::File("srv/other.txt", b"x\n")]);
    let lying_layers = vec![busybox_tar(), other_top];
    registry.push(&oci_layout_tar(&lying_layers, &lying), "team/lying:1");
    let before = layer_dirs();
    let lied = format!("127.0.0.1:{}/team/lying:1", registry.port);
    let err = pull(&daemon, &lied, "lying").await.unwrap_err();
    assert!(err.to_string().contains("the image config says"), "{err}");
    let err = daemon
        .client
        .import_image(
            "lying2",
            runbox_e2e::body(docker_save_tar(&lying_layers, &lying)),
        )
        .await
        .unwrap_err();
    assert_eq!(err.code(), Some(ErrorCode::BadArchive), "{err}");
    assert_eq!(layer_dirs(), before);
    let names: Vec<String> = daemon
        .client
        .list_images()
        .await
        .unwrap()
        .images
        .into_iter()
        .map(|i| i.name)
        .collect();
    assert!(!names.iter().any(|n| n.starts_with("lying")), "{names:?}");
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}
