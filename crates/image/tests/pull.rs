//! Registry pulls against a real registry (Debian's `docker-registry`) on
//! loopback, with images built here and pushed by skopeo. Needs
//! `scripts/test-registry` to have run; fails, naming it, otherwise.

mod support;

use std::future::Future as _;

use runbox_image::pull::{
    pull, BlobKind, Platform, ProgressEvent, PullError, PullOptions, RegistryAuth,
};
use support::image::{gzip, tar, tar_names, Blob, Entry, Image, Layout, OCI_TAR, OCI_TAR_GZIP};
use support::registry::{Auth, Push, Registry};
use support::sink::{DirSink, Progress};
use support::token::{TokenService, ISSUER, SERVICE};

/// A three-layer image: a base, a layer deleting a file and making a
/// directory opaque (whiteouts), and an uncompressed layer.
fn layered_image(layout: &mut Layout, arch: &str) -> Image {
    let base = gzip(&tar(&[
        Entry::Dir("etc/"),
        Entry::File("etc/os-release", b"NAME=runbox-test\n"),
        Entry::Dir("data/"),
        Entry::File("data/keep", b"keep"),
        Entry::File("data/gone", b"gone"),
        Entry::File("arch", arch.as_bytes()),
    ]));
    let whiteouts = gzip(&tar(&[
        Entry::Dir("data/"),
        Entry::File("data/.wh.gone", b""),
        Entry::Dir("etc/"),
        Entry::File("etc/.wh..wh..opq", b""),
        Entry::File("etc/hostname", b"sandbox\n"),
    ]));
    let plain = tar(&[Entry::File("hello.txt", b"hello, world\n")]);
    layout.add_image(
        arch,
        vec![
            Blob::new(OCI_TAR_GZIP, base),
            Blob::new(OCI_TAR_GZIP, whiteouts),
            Blob::new(OCI_TAR, plain),
        ],
    )
}

fn opts() -> PullOptions {
    PullOptions::default()
}

/// Pushes `img` (tagged `tag` in a fresh layout) as `name:tag`.
fn push_image(
    reg: &Registry,
    dir: &std::path::Path,
    name: &str,
    build: impl FnOnce(&mut Layout) -> Image,
) -> Image {
    let mut layout = Layout::new(dir);
    let img = build(&mut layout);
    layout.tag("t", &img.manifest);
    reg.push(&layout.dir, "t", name, Push::default());
    img
}

fn layer_events(events: &[ProgressEvent]) -> Vec<String> {
    events
        .iter()
        .filter_map(|e| match e {
            ProgressEvent::LayerStarted { digest, .. } => Some(format!("start {digest}")),
            ProgressEvent::LayerDone { digest } => Some(format!("done {digest}")),
            ProgressEvent::LayerSkipped { digest } => Some(format!("skip {digest}")),
            _ => None,
        })
        .collect()
}

#[tokio::test]
async fn multi_layer_image_with_whiteouts_arrives_byte_exact_and_in_order() {
    let reg = Registry::start();
    let tmp = tempfile::tempdir().unwrap();
    let img = push_image(&reg, &tmp.path().join("layout"), "test/layered:v1", |l| {
        layered_image(l, "amd64")
    });
    let sink = DirSink::new(&tmp.path().join("sink"));
    let progress = Progress::default();
    let reference = format!("{}/test/layered:v1", reg.addr);
    let got = pull(&reference, &opts(), &sink, &progress.callback())
        .await
        .unwrap();

    assert_eq!(got.reference, reference);
    assert_eq!(got.manifest_digest, img.manifest.digest);
    assert_eq!(got.index_digest, None);
    assert_eq!(got.manifest, img.manifest.bytes);
    assert_eq!(got.config, img.config.bytes);
    let want: Vec<(String, String, u64)> = img
        .layers
        .iter()
        .map(|l| (l.digest.clone(), l.media_type.clone(), l.bytes.len() as u64))
        .collect();
    let have: Vec<(String, String, u64)> = got
        .layers
        .iter()
        .map(|l| (l.digest.clone(), l.media_type.clone(), l.size))
        .collect();
    assert_eq!(have, want);

    // Byte-exact, committed in manifest order, nothing left half-written.
    for l in &img.layers {
        assert_eq!(
            sink.layer(&l.digest).as_deref(),
            Some(&l.bytes[..]),
            "{}",
            l.digest
        );
    }
    let order: Vec<String> = img.layers.iter().map(|l| l.digest.clone()).collect();
    assert_eq!(sink.counts().begun, order);
    assert_eq!(sink.counts().finished, order);
    assert!(sink.counts().aborted.is_empty());
    assert!(
        sink.files().iter().all(|f| f.starts_with("layers/")),
        "{:?}",
        sink.files()
    );

    // The whiteouts came through as entries of the second layer.
    let names = tar_names(&sink.layer(&img.layers[1].digest).unwrap());
    assert!(names.contains(&"data/.wh.gone".to_string()), "{names:?}");
    assert!(names.contains(&"etc/.wh..wh..opq".to_string()), "{names:?}");

    // Progress: resolved first, then each layer started and done in order,
    // with its byte count reaching its size.
    let events = progress.events();
    assert_eq!(
        events[0],
        ProgressEvent::Resolved {
            digest: img.manifest.digest.clone(),
            layers: 3
        }
    );
    let expected: Vec<String> = order
        .iter()
        .flat_map(|d| [format!("start {d}"), format!("done {d}")])
        .collect();
    assert_eq!(layer_events(&events), expected);
    for l in &img.layers {
        let size = l.bytes.len() as u64;
        assert!(events.contains(&ProgressEvent::LayerProgress {
            digest: l.digest.clone(),
            done: size,
            size
        }));
    }
}

#[tokio::test]
async fn pull_by_digest_and_by_tag_agree_and_unknown_ones_are_not_found() {
    let reg = Registry::start();
    let tmp = tempfile::tempdir().unwrap();
    let img = push_image(&reg, &tmp.path().join("layout"), "test/app:1.0", |l| {
        layered_image(l, "amd64")
    });

    let by_digest = format!("{}/test/app@{}", reg.addr, img.manifest.digest);
    let sink = DirSink::new(&tmp.path().join("sink-digest"));
    let got = pull(&by_digest, &opts(), &sink, &|_| {}).await.unwrap();
    assert_eq!(got.reference, by_digest);
    assert_eq!(got.manifest_digest, img.manifest.digest);
    assert_eq!(got.manifest, img.manifest.bytes);
    assert_eq!(sink.counts().finished.len(), 3);

    // Tag and digest together: the digest is what is fetched and checked.
    let both = format!("{}/test/app:1.0@{}", reg.addr, img.manifest.digest);
    let sink = DirSink::new(&tmp.path().join("sink-both"));
    let got = pull(&both, &opts(), &sink, &|_| {}).await.unwrap();
    assert_eq!(got.manifest_digest, img.manifest.digest);

    let sink = DirSink::new(&tmp.path().join("sink-missing"));
    let missing_digest = format!("{}/test/app@sha256:{}", reg.addr, "0".repeat(64));
    let missing_tag = format!("{}/test/app:nope", reg.addr);
    let missing_repo = format!("{}/test/nothing:1.0", reg.addr);
    for reference in [missing_digest, missing_tag, missing_repo] {
        let err = pull(&reference, &opts(), &sink, &|_| {}).await.unwrap_err();
        assert!(
            matches!(
                err,
                PullError::NotFound {
                    what: BlobKind::Manifest,
                    ..
                }
            ),
            "{reference}: {err}"
        );
    }
    assert!(sink.files().is_empty());
}

#[tokio::test]
async fn second_pull_into_the_same_sink_fetches_no_layer() {
    let reg = Registry::start();
    let tmp = tempfile::tempdir().unwrap();
    let img = push_image(&reg, &tmp.path().join("layout"), "test/again:v1", |l| {
        layered_image(l, "amd64")
    });
    let sink = DirSink::new(&tmp.path().join("sink"));
    let reference = format!("{}/test/again:v1", reg.addr);

    pull(&reference, &opts(), &sink, &|_| {}).await.unwrap();
    let bytes_first = sink.counts().bytes;
    let total: u64 = img.layers.iter().map(|l| l.bytes.len() as u64).sum();
    assert_eq!(bytes_first, total);
    for l in &img.layers {
        assert_eq!(reg.blob_gets(&l.digest), 1, "{}", l.digest);
    }

    let progress = Progress::default();
    let again = pull(&reference, &opts(), &sink, &progress.callback())
        .await
        .unwrap();
    assert_eq!(again.manifest_digest, img.manifest.digest);
    // Not a byte handed to the sink, not a request for a layer made.
    assert_eq!(sink.counts().bytes, bytes_first);
    assert_eq!(sink.counts().begun.len(), 3);
    for l in &img.layers {
        assert_eq!(reg.blob_gets(&l.digest), 1, "{} fetched again", l.digest);
    }
    let skipped: Vec<String> = img
        .layers
        .iter()
        .map(|l| format!("skip {}", l.digest))
        .collect();
    assert_eq!(layer_events(&progress.events()), skipped);
}

/// Index entries: amd64 and arm64 images, each with a marker file saying
/// which it is.
fn multi_arch(layout: &mut Layout) -> (Image, Image, Blob) {
    let amd64 = layered_image(layout, "amd64");
    let arm64 = layered_image(layout, "arm64");
    let index = layout.add_index(&[(&amd64, "linux", "amd64"), (&arm64, "linux", "arm64")]);
    (amd64, arm64, index)
}

#[tokio::test]
async fn multi_arch_index_resolves_to_the_platform() {
    let reg = Registry::start();
    let tmp = tempfile::tempdir().unwrap();
    let mut layout = Layout::new(&tmp.path().join("layout"));
    let (amd64, arm64, index) = multi_arch(&mut layout);
    layout.tag("multi", &index);
    reg.push(
        &layout.dir,
        "multi",
        "test/multi:v1",
        Push {
            all: true,
            ..Push::default()
        },
    );
    let reference = format!("{}/test/multi:v1", reg.addr);

    // The host's platform, by default.
    let host = Platform::host().architecture;
    let sink = DirSink::new(&tmp.path().join("sink-host"));
    let got = pull(&reference, &opts(), &sink, &|_| {}).await.unwrap();
    let expect = if host == "arm64" { &arm64 } else { &amd64 };
    if host == "amd64" || host == "arm64" {
        assert_eq!(got.manifest_digest, expect.manifest.digest);
        assert_eq!(got.index_digest.as_deref(), Some(index.digest.as_str()));
        assert_eq!(got.manifest, expect.manifest.bytes);
        let base = tar_names(&sink.layer(&expect.layers[0].digest).unwrap());
        assert!(base.contains(&"arch".to_string()));
    }

    // Each platform explicitly, by tag and by the index's digest.
    for (arch, img) in [("amd64", &amd64), ("arm64", &arm64)] {
        let o = PullOptions {
            platform: Platform::new("linux", arch, None),
            ..opts()
        };
        for r in [
            reference.clone(),
            format!("{}/test/multi@{}", reg.addr, index.digest),
        ] {
            let sink = DirSink::new(&tmp.path().join(format!("sink-{arch}-{}", r.len())));
            let got = pull(&r, &o, &sink, &|_| {}).await.unwrap();
            assert_eq!(got.manifest_digest, img.manifest.digest, "{arch} via {r}");
            assert_eq!(got.config, img.config.bytes);
            assert_eq!(sink.counts().finished.len(), 3);
        }
    }

    // Nothing for s390x: the error lists what there is, and nothing is
    // fetched.
    let o = PullOptions {
        platform: Platform::new("linux", "s390x", None),
        ..opts()
    };
    let sink = DirSink::new(&tmp.path().join("sink-none"));
    let progress = Progress::default();
    let err = pull(&reference, &o, &sink, &progress.callback())
        .await
        .unwrap_err();
    match &err {
        PullError::NoMatchingPlatform {
            wanted, available, ..
        } => {
            assert_eq!(wanted.to_string(), "linux/s390x");
            let names: Vec<String> = available.iter().map(|p| p.to_string()).collect();
            assert_eq!(names, ["linux/amd64", "linux/arm64"]);
        }
        other => panic!("unexpected error: {other}"),
    }
    assert!(
        err.to_string().contains("linux/amd64, linux/arm64"),
        "{err}"
    );
    assert!(progress.events().is_empty());
    assert!(sink.files().is_empty());
}

#[tokio::test]
async fn docker_schema2_manifests_and_manifest_lists() {
    let reg = Registry::start();
    let tmp = tempfile::tempdir().unwrap();
    let mut layout = Layout::new(&tmp.path().join("layout"));
    // Docker's format has no uncompressed OCI layer type to convert to, so
    // these images are gzip only.
    let gz = |l: &mut Layout, arch: &str| {
        let base = gzip(&tar(&[Entry::File("arch", arch.as_bytes())]));
        let top = gzip(&tar(&[Entry::File(".wh.arch", b"")]));
        l.add_image(
            arch,
            vec![Blob::new(OCI_TAR_GZIP, base), Blob::new(OCI_TAR_GZIP, top)],
        )
    };
    let amd64 = gz(&mut layout, "amd64");
    let arm64 = gz(&mut layout, "arm64");
    let index = layout.add_index(&[(&amd64, "linux", "amd64"), (&arm64, "linux", "arm64")]);
    layout.tag("single", &amd64.manifest);
    layout.tag("list", &index);
    let v2s2 = Push {
        format: Some("v2s2"),
        ..Push::default()
    };
    reg.push(&layout.dir, "single", "test/docker:single", v2s2);
    reg.push(
        &layout.dir,
        "list",
        "test/docker:list",
        Push { all: true, ..v2s2 },
    );

    let sink = DirSink::new(&tmp.path().join("sink"));
    let got = pull(
        &format!("{}/test/docker:single", reg.addr),
        &opts(),
        &sink,
        &|_| {},
    )
    .await
    .unwrap();
    let manifest: serde_json::Value = serde_json::from_slice(&got.manifest).unwrap();
    assert_eq!(
        manifest["mediaType"],
        "application/vnd.docker.distribution.manifest.v2+json"
    );
    for (l, built) in got.layers.iter().zip(&amd64.layers) {
        assert_eq!(
            l.media_type,
            "application/vnd.docker.image.rootfs.diff.tar.gzip"
        );
        // Converting the manifest leaves the blobs alone.
        assert_eq!(l.digest, built.digest);
        assert_eq!(sink.layer(&l.digest).as_deref(), Some(&built.bytes[..]));
    }

    let o = PullOptions {
        platform: Platform::new("linux", "arm64", None),
        ..opts()
    };
    let sink = DirSink::new(&tmp.path().join("sink-list"));
    let got = pull(
        &format!("{}/test/docker:list", reg.addr),
        &o,
        &sink,
        &|_| {},
    )
    .await
    .unwrap();
    let manifest: serde_json::Value = serde_json::from_slice(&got.manifest).unwrap();
    assert_eq!(
        manifest["mediaType"],
        "application/vnd.docker.distribution.manifest.v2+json"
    );
    // What was pushed really is a Docker manifest list.
    let list_digest = got.index_digest.clone().unwrap();
    let list: serde_json::Value =
        serde_json::from_slice(&std::fs::read(reg.blob_path(&list_digest)).unwrap()).unwrap();
    assert_eq!(
        list["mediaType"],
        "application/vnd.docker.distribution.manifest.list.v2+json"
    );
    assert_eq!(got.layers[0].digest, arm64.layers[0].digest);
    assert_eq!(
        sink.layer(&arm64.layers[0].digest).as_deref(),
        Some(&arm64.layers[0].bytes[..])
    );
}

#[tokio::test]
async fn basic_auth_registry_needs_the_right_credentials() {
    let reg = Registry::start_with(Auth::Htpasswd {
        user: "alice".into(),
        password: "s3cret".into(),
    });
    let tmp = tempfile::tempdir().unwrap();
    let img = push_image(&reg, &tmp.path().join("layout"), "private/app:v1", |l| {
        layered_image(l, "amd64")
    });
    let reference = format!("{}/private/app:v1", reg.addr);

    let with = |user: &str, password: &str| PullOptions {
        auth: RegistryAuth::Basic {
            username: user.into(),
            password: password.into(),
        },
        ..opts()
    };
    let sink = DirSink::new(&tmp.path().join("sink"));
    let got = pull(&reference, &with("alice", "s3cret"), &sink, &|_| {})
        .await
        .unwrap();
    assert_eq!(got.manifest_digest, img.manifest.digest);
    assert_eq!(sink.counts().finished.len(), 3);

    let sink = DirSink::new(&tmp.path().join("sink-denied"));
    let err = pull(&reference, &opts(), &sink, &|_| {}).await.unwrap_err();
    match &err {
        PullError::AuthFailed { registry, detail } => {
            assert_eq!(registry, &reg.addr);
            assert!(detail.contains("requires credentials"), "{detail}");
        }
        other => panic!("unexpected error: {other}"),
    }
    let err = pull(&reference, &with("alice", "wrong"), &sink, &|_| {})
        .await
        .unwrap_err();
    match &err {
        PullError::AuthFailed { detail, .. } => assert!(detail.contains("refused"), "{detail}"),
        other => panic!("unexpected error: {other}"),
    }
    assert!(sink.files().is_empty());
}

#[tokio::test]
async fn bearer_token_registry_works_through_the_token_service() {
    let tokens = TokenService::start("bob", "hunter2");
    let mut reg = Registry::start_with(Auth::Token {
        realm: tokens.realm.clone(),
        service: SERVICE.into(),
        issuer: ISSUER.into(),
        root_cert_pem: tokens.cert_pem.clone(),
    });
    reg.set_push_creds("bob:hunter2");
    let tmp = tempfile::tempdir().unwrap();
    let img = push_image(&reg, &tmp.path().join("layout"), "team/tool:v1", |l| {
        layered_image(l, "amd64")
    });
    let reference = format!("{}/team/tool:v1", reg.addr);
    tokens.requests.lock().unwrap().clear();

    let o = PullOptions {
        auth: RegistryAuth::Basic {
            username: "bob".into(),
            password: "hunter2".into(),
        },
        ..opts()
    };
    let sink = DirSink::new(&tmp.path().join("sink"));
    let got = pull(&reference, &o, &sink, &|_| {}).await.unwrap();
    assert_eq!(got.manifest_digest, img.manifest.digest);
    for l in &img.layers {
        assert_eq!(sink.layer(&l.digest).as_deref(), Some(&l.bytes[..]));
    }
    // The credentials went to the token service, for pull access only.
    let seen = tokens.requests.lock().unwrap().clone();
    assert!(!seen.is_empty());
    for r in &seen {
        assert_eq!(r.user.as_deref(), Some("bob"));
        assert_eq!(r.scopes, ["repository:team/tool:pull"]);
    }

    // Anonymous: the token service hands out a token that grants nothing.
    let sink = DirSink::new(&tmp.path().join("sink-anon"));
    let err = pull(&reference, &opts(), &sink, &|_| {}).await.unwrap_err();
    match &err {
        PullError::AuthFailed { detail, .. } => assert!(detail.contains("requires credentials")),
        other => panic!("unexpected error: {other}"),
    }
    // Wrong password: the token service refuses.
    let o = PullOptions {
        auth: RegistryAuth::Basic {
            username: "bob".into(),
            password: "nope".into(),
        },
        ..opts()
    };
    let err = pull(&reference, &o, &sink, &|_| {}).await.unwrap_err();
    match &err {
        PullError::AuthFailed { detail, .. } => assert!(detail.contains("refused"), "{detail}"),
        other => panic!("unexpected error: {other}"),
    }
    assert!(sink.files().is_empty());
}

#[tokio::test]
async fn plain_http_to_a_remote_registry_is_refused_before_connecting() {
    let tmp = tempfile::tempdir().unwrap();
    let sink = DirSink::new(tmp.path());
    let progress = Progress::default();
    // registry.example is never resolved nor connected to: the refusal
    // comes from the reference and the options alone.
    let err = pull(
        "http://registry.example:5000/x:1",
        &opts(),
        &sink,
        &progress.callback(),
    )
    .await
    .unwrap_err();
    match &err {
        PullError::InsecureRegistry { registry } => assert_eq!(registry, "registry.example:5000"),
        other => panic!("unexpected error: {other}"),
    }
    assert!(
        err.to_string()
            .contains("--insecure-registry registry.example:5000"),
        "{err}"
    );
    assert!(progress.events().is_empty());
    // Listing a different port does not help.
    let o = PullOptions {
        insecure_registries: vec!["registry.example:5001".into()],
        ..opts()
    };
    let err = pull("http://registry.example:5000/x:1", &o, &sink, &|_| {})
        .await
        .unwrap_err();
    assert!(matches!(err, PullError::InsecureRegistry { .. }), "{err}");
}

#[tokio::test]
async fn corrupted_layer_is_refused_and_nothing_is_committed() {
    let reg = Registry::start();
    let tmp = tempfile::tempdir().unwrap();
    let img = push_image(&reg, &tmp.path().join("layout"), "test/bad:v1", |l| {
        layered_image(l, "amd64")
    });
    // Flip bytes in the middle of the base layer as the registry stores it;
    // the size stays the same, so only the digest can catch it.
    let victim = &img.layers[0];
    let path = reg.blob_path(&victim.digest);
    let mut bytes = std::fs::read(&path).unwrap();
    assert_eq!(bytes, victim.bytes);
    let mid = bytes.len() / 2;
    bytes[mid] ^= 0xff;
    std::fs::write(&path, &bytes).unwrap();

    let sink = DirSink::new(&tmp.path().join("sink"));
    let progress = Progress::default();
    let err = pull(
        &format!("{}/test/bad:v1", reg.addr),
        &opts(),
        &sink,
        &progress.callback(),
    )
    .await
    .unwrap_err();
    match &err {
        PullError::DigestMismatch {
            what,
            expected,
            actual,
        } => {
            assert_eq!(*what, BlobKind::Layer);
            assert_eq!(expected, &victim.digest);
            assert_eq!(actual, &support::image::sha256(&bytes));
        }
        other => panic!("unexpected error: {other}"),
    }
    // The sink saw the bytes stream in, but nothing was committed and the
    // partial file is gone.
    assert_eq!(sink.counts().begun, std::slice::from_ref(&victim.digest));
    assert!(sink.counts().finished.is_empty());
    assert_eq!(sink.counts().aborted, std::slice::from_ref(&victim.digest));
    assert!(sink.files().is_empty(), "{:?}", sink.files());
    assert!(!sink.final_path(&victim.digest).exists());
    assert!(!progress
        .events()
        .iter()
        .any(|e| matches!(e, ProgressEvent::LayerDone { .. })));
}

#[tokio::test]
async fn corrupted_config_is_refused() {
    let reg = Registry::start();
    let tmp = tempfile::tempdir().unwrap();
    let img = push_image(&reg, &tmp.path().join("layout"), "test/badcfg:v1", |l| {
        layered_image(l, "amd64")
    });
    let path = reg.blob_path(&img.config.digest);
    let mut bytes = std::fs::read(&path).unwrap();
    // Still valid JSON, still the same size: only the digest tells.
    let at = bytes.windows(5).position(|w| w == b"amd64").unwrap();
    bytes[at..at + 5].copy_from_slice(b"arm64");
    std::fs::write(&path, &bytes).unwrap();

    let sink = DirSink::new(&tmp.path().join("sink"));
    let err = pull(
        &format!("{}/test/badcfg:v1", reg.addr),
        &opts(),
        &sink,
        &|_| {},
    )
    .await
    .unwrap_err();
    assert!(
        matches!(&err, PullError::DigestMismatch { what: BlobKind::Config, expected, .. } if *expected == img.config.digest),
        "{err}"
    );
    // The config is checked before any layer is fetched.
    assert!(sink.counts().begun.is_empty());
}

#[tokio::test]
async fn bounds_on_manifest_and_config() {
    let reg = Registry::start();
    let tmp = tempfile::tempdir().unwrap();
    let img = push_image(&reg, &tmp.path().join("layout"), "test/big:v1", |l| {
        layered_image(l, "amd64")
    });
    let reference = format!("{}/test/big:v1", reg.addr);
    let sink = DirSink::new(&tmp.path().join("sink"));

    let o = PullOptions {
        max_manifest_bytes: 100,
        ..opts()
    };
    let err = pull(&reference, &o, &sink, &|_| {}).await.unwrap_err();
    match err {
        PullError::TooLarge {
            what: BlobKind::Manifest,
            size,
            limit: 100,
        } => {
            assert_eq!(size, img.manifest.bytes.len() as u64)
        }
        other => panic!("unexpected error: {other}"),
    }

    let o = PullOptions {
        max_config_bytes: 10,
        ..opts()
    };
    let err = pull(&reference, &o, &sink, &|_| {}).await.unwrap_err();
    match err {
        PullError::TooLarge {
            what: BlobKind::Config,
            size,
            limit: 10,
        } => {
            assert_eq!(size, img.config.bytes.len() as u64)
        }
        other => panic!("unexpected error: {other}"),
    }
    assert!(sink.files().is_empty());
}

#[tokio::test]
async fn foreign_layers_are_refused_before_any_fetch() {
    let reg = Registry::start();
    let tmp = tempfile::tempdir().unwrap();
    push_image(&reg, &tmp.path().join("layout"), "test/foreign:v1", |l| {
        let base = gzip(&tar(&[Entry::File("a", b"a")]));
        let foreign = gzip(&tar(&[Entry::File("licensed", b"not for redistribution")]));
        l.add_image(
            "amd64",
            vec![
                Blob::new(OCI_TAR_GZIP, base),
                Blob::new(
                    "application/vnd.oci.image.layer.nondistributable.v1.tar+gzip",
                    foreign,
                ),
            ],
        )
    });
    let sink = DirSink::new(&tmp.path().join("sink"));
    let err = pull(
        &format!("{}/test/foreign:v1", reg.addr),
        &opts(),
        &sink,
        &|_| {},
    )
    .await
    .unwrap_err();
    match &err {
        PullError::ForeignLayer { media_type, .. } => {
            assert!(media_type.contains("nondistributable"))
        }
        other => panic!("unexpected error: {other}"),
    }
    assert!(err.to_string().contains("non-distributable"), "{err}");
    assert!(sink.counts().begun.is_empty());
}

#[tokio::test]
async fn references_that_cannot_be_parsed_are_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let sink = DirSink::new(tmp.path());
    for bad in ["", "UPPER/case", "ftp://h.example/x", "x@sha256:123"] {
        let err = pull(bad, &opts(), &sink, &|_| {}).await.unwrap_err();
        assert!(
            matches!(err, PullError::BadReference { .. }),
            "{bad:?}: {err}"
        );
    }
}

#[tokio::test]
async fn a_layer_missing_from_the_registry_is_not_found() {
    let reg = Registry::start();
    let tmp = tempfile::tempdir().unwrap();
    let img = push_image(&reg, &tmp.path().join("layout"), "test/gap:v1", |l| {
        layered_image(l, "amd64")
    });
    let missing = &img.layers[1];
    std::fs::remove_file(reg.blob_path(&missing.digest)).unwrap();

    let sink = DirSink::new(&tmp.path().join("sink"));
    let err = pull(
        &format!("{}/test/gap:v1", reg.addr),
        &opts(),
        &sink,
        &|_| {},
    )
    .await
    .unwrap_err();
    match &err {
        PullError::NotFound {
            what: BlobKind::Layer,
            reference,
        } => {
            assert!(reference.ends_with(&missing.digest), "{reference}")
        }
        other => panic!("unexpected error: {other} ({other:?})"),
    }
    // The layer before it is verified and stays; the missing one was
    // aborted and left nothing.
    assert_eq!(
        sink.counts().finished,
        std::slice::from_ref(&img.layers[0].digest)
    );
    assert_eq!(sink.counts().aborted, std::slice::from_ref(&missing.digest));
    assert_eq!(sink.files().len(), 1);
}

/// Bytes that do not compress, from a fixed seed.
fn noise(len: usize) -> Vec<u8> {
    let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

#[tokio::test]
async fn dropping_a_pull_mid_layer_aborts_that_layer() {
    let reg = Registry::start();
    let tmp = tempfile::tempdir().unwrap();
    // Large enough that it cannot arrive in one poll (socket buffers are a
    // few MiB at most), so the pull is caught mid-layer.
    let img = push_image(&reg, &tmp.path().join("layout"), "test/big:v1", |l| {
        l.add_image("amd64", vec![Blob::new(OCI_TAR, noise(16 << 20))])
    });
    let sink = DirSink::new(&tmp.path().join("sink"));
    let started = std::sync::atomic::AtomicBool::new(false);
    let progress = |e: ProgressEvent| {
        if matches!(e, ProgressEvent::LayerProgress { .. }) {
            started.store(true, std::sync::atomic::Ordering::SeqCst);
        }
    };
    {
        let reference = format!("{}/test/big:v1", reg.addr);
        let o = opts();
        let fut = pull(&reference, &o, &sink, &progress);
        tokio::pin!(fut);
        let finished = std::future::poll_fn(|cx| match fut.as_mut().poll(cx) {
            std::task::Poll::Ready(r) => std::task::Poll::Ready(Some(r)),
            std::task::Poll::Pending if started.load(std::sync::atomic::Ordering::SeqCst) => {
                std::task::Poll::Ready(None)
            }
            std::task::Poll::Pending => std::task::Poll::Pending,
        })
        .await;
        assert!(
            finished.is_none(),
            "the pull finished before it could be dropped"
        );
        // `fut` is dropped here, mid-layer.
    }
    let c = sink.counts();
    assert_eq!(c.begun, std::slice::from_ref(&img.layers[0].digest));
    assert!(
        c.bytes > 0 && c.bytes < img.layers[0].bytes.len() as u64,
        "{}",
        c.bytes
    );
    assert!(c.finished.is_empty());
    assert_eq!(c.aborted, std::slice::from_ref(&img.layers[0].digest));
    drop(c);
    assert!(sink.files().is_empty(), "{:?}", sink.files());
}
