//! The warm repo cache: a run's volume published as its repository's
//! template, later runs starting from it with a read-only lower layer, the
//! lockfile hash, invalidation and eviction — on the real runtime, real
//! overlays and the real btrfs run store.

use std::path::PathBuf;
use std::time::Duration;

use runbox_e2e::{eventually, raw_request, TestDaemon};
use runbox_types::{CreateRunRequest, ErrorCode, Run, WarmRequest};

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

/// A daemon whose eviction tick runs every second.
async fn daemon_with(args: &[&str]) -> TestDaemon {
    let mut all = vec!["--cache-tick-sec", "1"];
    all.extend_from_slice(args);
    TestDaemon::start_with(None, &all, &[]).await
}

async fn warm_run(daemon: &TestDaemon, repo: &str, path: Option<&str>) -> Run {
    daemon
        .create_with(CreateRunRequest {
            image: "base".into(),
            warm: Some(WarmRequest {
                repo: repo.into(),
                path: path.map(str::to_owned),
            }),
            ..Default::default()
        })
        .await
}

async fn sh_ok(daemon: &TestDaemon, id: &str, script: &str) -> String {
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

/// The generation directories of `repo` in the cache.
fn generations(daemon: &TestDaemon, repo: &str) -> Vec<String> {
    let dir: PathBuf = daemon.state.path().join("runs/.warm/repos").join(repo);
    let mut out: Vec<String> = std::fs::read_dir(dir)
        .map(|d| {
            d.flatten()
                .filter(|e| e.path().is_dir())
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .collect()
        })
        .unwrap_or_default();
    out.sort();
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_committed_volume_boots_later_runs_and_its_lockfiles_are_tracked() {
    let mut daemon = daemon_with(&[]).await;
    // The setup run: no template yet, so it starts empty.
    let setup = warm_run(&daemon, "Acme/Web", None).await;
    let warm = setup.warm.clone().expect("warm on the run");
    assert_eq!(
        (warm.repo.as_str(), warm.path.as_str()),
        ("acme/web", "/work")
    );
    assert!(!warm.booted && warm.lock_hash.is_none(), "{warm:?}");
    let id = setup.id.to_string();
    assert_eq!(sh_ok(&daemon, &id, "ls -A /work | wc -l").await.trim(), "0");
    // "Clone and install": a repository in /work/app with a lockfile and
    // dependencies, a symlink, a hard link and a file deleted again.
    sh_ok(
        &daemon,
        &id,
        "set -e; mkdir -p /work/app/node_modules/left-pad /work/app/.git; \
         echo '{\"lockfileVersion\": 3}' > /work/app/package-lock.json; \
         echo 'module.exports = 1' > /work/app/node_modules/left-pad/index.js; \
         ln -s node_modules/left-pad/index.js /work/app/entry.js; \
         ln /work/app/package-lock.json /work/app/lock.hard; \
         echo HEAD > /work/app/.git/HEAD; echo tmp > /work/app/tmp; rm /work/app/tmp; \
         chmod 751 /work/app/node_modules",
    )
    .await;
    let status = daemon.client.warm_status(&id).await.unwrap();
    assert_eq!(status.repo_dir, "/work/app");
    assert_eq!(status.lockfiles, ["package-lock.json"]);
    assert!(status.template_lock_hash.is_none());

    let commit = daemon.client.warm_commit(&id, None).await.unwrap();
    assert_eq!(commit.repo, "acme/web");
    assert_eq!(commit.repo_dir, "/work/app");
    assert_eq!(
        commit.lock_hash, status.lock_hash,
        "the commit hashes what GET warm saw"
    );
    assert_eq!(commit.template.lockfiles, ["package-lock.json"]);
    assert!(commit.template.files >= 3, "{:?}", commit.template);
    let template = daemon.client.warm_template("acme/web").await.unwrap();
    assert_eq!(template, commit.template);
    // No capture is left behind.
    assert_eq!(
        std::fs::read_dir(daemon.state.path().join("runs/.captures"))
            .map(|d| d.count())
            .unwrap_or(0),
        0
    );

    // A warm run starts from it: the files are there, as they were.
    let a = warm_run(&daemon, "acme/web", None).await;
    let warm = a.warm.clone().unwrap();
    assert!(warm.booted);
    assert_eq!(warm.lock_hash.as_deref(), Some(commit.lock_hash.as_str()));
    assert_eq!(warm.repo_dir.as_deref(), Some("/work/app"));
    assert_eq!(
        warm.generation.as_deref(),
        Some(template.generation.as_str())
    );
    let a = a.id.to_string();
    let check = "cat /work/app/node_modules/left-pad/index.js /work/app/.git/HEAD; \
                 readlink /work/app/entry.js; [ /work/app/lock.hard -ef /work/app/package-lock.json ] && echo linked; \
                 [ -e /work/app/tmp ] || echo no-tmp; stat -c %a /work/app/node_modules";
    assert_eq!(
        sh_ok(&daemon, &a, check).await,
        "module.exports = 1\nHEAD\nnode_modules/left-pad/index.js\nlinked\nno-tmp\n751\n"
    );
    // The same at another path, with the repository directory under it.
    let b = warm_run(&daemon, "acme/web", Some("/src")).await;
    assert_eq!(
        b.warm.as_ref().unwrap().repo_dir.as_deref(),
        Some("/src/app")
    );
    let b = b.id.to_string();
    assert_eq!(sh_ok(&daemon, &b, "cat /src/app/.git/HEAD").await, "HEAD\n");

    // Runs write their own layer: the template and the other runs never
    // see it, and the setup run's later writes are not in the template.
    sh_ok(
        &daemon,
        &a,
        "echo mine > /work/app/node_modules/left-pad/index.js; rm /work/app/.git/HEAD",
    )
    .await;
    sh_ok(&daemon, &id, "echo late > /work/app/late").await;
    assert_eq!(
        sh_ok(
            &daemon,
            &b,
            "cat /src/app/node_modules/left-pad/index.js /src/app/.git/HEAD; [ -e /src/app/late ] || echo no-late"
        )
        .await,
        "module.exports = 1\nHEAD\nno-late\n"
    );
    let tree = daemon
        .state
        .path()
        .join("runs/.warm/repos/acme/web")
        .join(&template.generation)
        .join("tree");
    assert_eq!(
        std::fs::read_to_string(tree.join("app/node_modules/left-pad/index.js")).unwrap(),
        "module.exports = 1\n"
    );

    // A lockfile change shows on GET warm; other changes do not.
    let before = daemon.client.warm_status(&a).await.unwrap();
    assert_eq!(before.lock_hash, commit.lock_hash);
    assert_eq!(
        before.booted_lock_hash.as_deref(),
        Some(commit.lock_hash.as_str())
    );
    assert_eq!(
        before.template_lock_hash.as_deref(),
        Some(commit.lock_hash.as_str())
    );
    sh_ok(
        &daemon,
        &a,
        "echo '{\"lockfileVersion\": 4}' > /work/app/package-lock.json",
    )
    .await;
    let after = daemon.client.warm_status(&a).await.unwrap();
    assert_ne!(after.lock_hash, commit.lock_hash);

    // Commit from a booted run: the next generation is the template with
    // that run's changes (a deletion included), a plain tree again.
    let second = daemon.client.warm_commit(&a, None).await.unwrap();
    assert_eq!(second.lock_hash, after.lock_hash);
    assert_ne!(second.template.generation, template.generation);
    let c = warm_run(&daemon, "acme/web", None).await.id.to_string();
    assert_eq!(
        sh_ok(
            &daemon,
            &c,
            "cat /work/app/node_modules/left-pad/index.js; [ -e /work/app/.git/HEAD ] || echo head-gone"
        )
        .await,
        "mine\nhead-gone\n"
    );
    // The first generation stays while runs mount it ...
    assert_eq!(generations(&daemon, "acme/web").len(), 2);
    assert_eq!(sh_ok(&daemon, &b, "cat /src/app/.git/HEAD").await, "HEAD\n");

    // ... and survives a daemon restart with the template and the runs.
    daemon.kill9();
    daemon.spawn().await;
    assert_eq!(
        daemon
            .client
            .warm_template("acme/web")
            .await
            .unwrap()
            .generation,
        second.template.generation
    );
    assert_eq!(sh_ok(&daemon, &b, "cat /src/app/.git/HEAD").await, "HEAD\n");
    let status = daemon.client.warm_status(&c).await.unwrap();
    assert_eq!(status.lock_hash, second.lock_hash);

    // Once no run mounts it, the next tick deletes it.
    for run in [&b, &a] {
        daemon.client.delete_run(run).await.unwrap();
    }
    assert!(
        eventually(Duration::from_secs(10), || generations(&daemon, "acme/web")
            == [second.template.generation.clone()])
        .await,
        "{:?}",
        generations(&daemon, "acme/web")
    );
    for run in [&c, &id] {
        daemon.client.delete_run(run).await.unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn invalidation_concurrent_commits_and_eviction_keep_runs_whole() {
    // A cap of about 1 KiB: any second template is over it.
    let daemon = daemon_with(&["--cache-max-gb", "0.000001"]).await;
    let one = warm_run(&daemon, "acme/one", None).await.id.to_string();
    let two = warm_run(&daemon, "acme/one", None).await.id.to_string();
    sh_ok(
        &daemon,
        &one,
        "head -c 4096 /dev/zero > /work/data; echo one > /work/who",
    )
    .await;
    sh_ok(
        &daemon,
        &two,
        "head -c 4096 /dev/zero > /work/data; echo two > /work/who",
    )
    .await;
    // Two commits of one repository at once: both land, one wins, and the
    // template is wholly one of them.
    let (a, b) = tokio::join!(
        daemon.client.warm_commit(&one, None),
        daemon.client.warm_commit(&two, None)
    );
    let (a, b) = (a.unwrap(), b.unwrap());
    assert_ne!(a.template.generation, b.template.generation);
    let current = daemon.client.warm_template("acme/one").await.unwrap();
    assert!(
        current == a.template || current == b.template,
        "{current:?}"
    );
    let user = warm_run(&daemon, "acme/one", None).await;
    assert_eq!(
        user.warm.as_ref().unwrap().generation.as_deref(),
        Some(current.generation.as_str())
    );
    let user = user.id.to_string();
    let who = sh_ok(&daemon, &user, "cat /work/who").await;
    let winner = if current.generation == a.template.generation {
        "one\n"
    } else {
        "two\n"
    };
    assert_eq!(who, winner);

    // Over the cap, with acme/one in use: eviction drops the other
    // template, never the one a run mounts, and the loser generation.
    let other = warm_run(&daemon, "acme/two", None).await.id.to_string();
    sh_ok(&daemon, &other, "head -c 4096 /dev/zero > /work/data").await;
    daemon.client.warm_commit(&other, None).await.unwrap();
    let gone = eventually(Duration::from_secs(10), || {
        generations(&daemon, "acme/two").is_empty() && generations(&daemon, "acme/one").len() == 1
    })
    .await;
    assert!(gone, "{:?}", daemon.client.warm_templates().await.unwrap());
    let err = daemon.client.warm_template("acme/two").await.unwrap_err();
    assert_eq!(err.code(), Some(ErrorCode::TemplateNotFound));
    assert_eq!(
        daemon
            .client
            .warm_template("acme/one")
            .await
            .unwrap()
            .generation,
        current.generation
    );
    assert_eq!(sh_ok(&daemon, &user, "cat /work/who").await, winner);

    // DELETE invalidates: new runs start empty, the run using it keeps it.
    daemon.client.warm_invalidate("ACME/one").await.unwrap();
    let err = daemon.client.warm_template("acme/one").await.unwrap_err();
    assert_eq!(err.code(), Some(ErrorCode::TemplateNotFound));
    let err = daemon.client.warm_invalidate("acme/one").await.unwrap_err();
    assert_eq!(err.code(), Some(ErrorCode::TemplateNotFound));
    let fresh = warm_run(&daemon, "acme/one", None).await;
    assert!(!fresh.warm.as_ref().unwrap().booted);
    tokio::time::sleep(Duration::from_millis(2500)).await;
    assert_eq!(sh_ok(&daemon, &user, "cat /work/who").await, winner);
    assert_eq!(generations(&daemon, "acme/one").len(), 1, "in use, so kept");
    daemon.client.delete_run(&user).await.unwrap();
    assert!(
        eventually(Duration::from_secs(10), || generations(&daemon, "acme/one")
            .is_empty())
        .await
    );
    for run in [&one, &two, &other, &fresh.id.to_string()] {
        daemon.client.delete_run(run).await.unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hostile_repositories_and_paths_are_refused() {
    let daemon = daemon_with(&[]).await;
    let create = |repo: &str, path: Option<&str>| CreateRunRequest {
        image: "base".into(),
        warm: Some(WarmRequest {
            repo: repo.into(),
            path: path.map(str::to_owned),
        }),
        ..Default::default()
    };
    for repo in [
        "../etc",
        "acme",
        "acme/..",
        "acme/web/x",
        "acme/.git",
        "a b/c",
        "",
    ] {
        let err = daemon
            .client
            .create_run(&create(repo, None))
            .await
            .unwrap_err();
        assert_eq!(err.code(), Some(ErrorCode::BadRepo), "{repo:?}");
    }
    for path in [
        "work",
        "/",
        "/proc/x",
        "/.runbox",
        "/work/../etc",
        "/dev/shm",
    ] {
        let err = daemon
            .client
            .create_run(&create("acme/web", Some(path)))
            .await
            .unwrap_err();
        assert_eq!(err.code(), Some(ErrorCode::BadPath), "{path:?}");
    }
    for target in [
        "/v1/warmcache/..%2F..%2Fetc/passwd",
        "/v1/warmcache/acme/..",
        "/v1/warmcache/acme/%2E%2E",
        "/v1/warmcache/acme/web%00",
    ] {
        let (status, body) = raw_request(&daemon.url, "GET", target, &daemon.token, b"").await;
        assert_eq!(status, 400, "{target}: {body}");
        assert!(body.contains("bad_repo"), "{target}: {body}");
    }
    // Nothing was made for any of them.
    assert!(daemon.client.list_runs().await.unwrap().runs.is_empty());
    assert!(daemon
        .client
        .warm_templates()
        .await
        .unwrap()
        .templates
        .is_empty());

    // A run without a volume has nothing to commit or check.
    let plain = daemon.create().await.id.to_string();
    let err = daemon.client.warm_commit(&plain, None).await.unwrap_err();
    assert_eq!(err.code(), Some(ErrorCode::RunNotWarm));
    let err = daemon.client.warm_status(&plain).await.unwrap_err();
    assert_eq!(err.code(), Some(ErrorCode::RunNotWarm));
    // A commit under a hostile name is refused before anything is captured.
    let warm = warm_run(&daemon, "acme/web", None).await.id.to_string();
    let err = daemon
        .client
        .warm_commit(&warm, Some("../../x"))
        .await
        .unwrap_err();
    assert_eq!(err.code(), Some(ErrorCode::BadRepo));
    // A hostile volume: lockfiles that are symlinks to host files, a FIFO
    // named like one; GET warm reads none of them, and a commit copies the
    // links as links.
    sh_ok(
        &daemon,
        &warm,
        "ln -s /etc/shadow /work/Cargo.lock; mkfifo /work/go.sum; mkdir /work/x; ln -s /etc /work/x/escape",
    )
    .await;
    let status = daemon.client.warm_status(&warm).await.unwrap();
    assert!(status.lockfiles.is_empty(), "{status:?}");
    let commit = daemon.client.warm_commit(&warm, None).await.unwrap();
    let tree = daemon
        .state
        .path()
        .join("runs/.warm/repos/acme/web")
        .join(&commit.template.generation)
        .join("tree");
    assert_eq!(
        std::fs::read_link(tree.join("Cargo.lock")).unwrap(),
        PathBuf::from("/etc/shadow")
    );
    for run in [&plain, &warm] {
        daemon.client.delete_run(run).await.unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_without_the_cache_refuses_warm_runs() {
    let daemon = TestDaemon::start_with(None, &["--cache-root", ""], &[]).await;
    let err = daemon
        .client
        .create_run(&CreateRunRequest {
            image: "base".into(),
            warm: Some(WarmRequest {
                repo: "acme/web".into(),
                path: None,
            }),
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), Some(ErrorCode::WarmCacheDisabled));
    let err = daemon.client.warm_templates().await.unwrap_err();
    assert_eq!(err.code(), Some(ErrorCode::WarmCacheDisabled));
    assert!(daemon.client.list_runs().await.unwrap().runs.is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_warm_run_forks_and_snapshots_with_its_volume() {
    let daemon = daemon_with(&[]).await;
    let setup = warm_run(&daemon, "acme/web", None).await.id.to_string();
    sh_ok(
        &daemon,
        &setup,
        "mkdir -p /work/app && echo dep > /work/app/dep && echo lock > /work/app/Cargo.lock",
    )
    .await;
    daemon.client.warm_commit(&setup, None).await.unwrap();
    let parent = warm_run(&daemon, "acme/web", None).await.id.to_string();
    sh_ok(
        &daemon,
        &parent,
        "echo mine > /work/app/mine; rm /work/app/dep",
    )
    .await;

    // Children see the parent's volume (template + its changes) and write
    // their own layers.
    let forked = daemon
        .client
        .fork_run(
            &parent,
            &runbox_types::ForkRequest {
                count: 2,
                ttl_sec: None,
                point: None,
            },
        )
        .await
        .unwrap();
    let kids: Vec<String> = forked.runs.iter().map(|r| r.id.to_string()).collect();
    for kid in &forked.runs {
        assert_eq!(kid.warm.as_ref().unwrap().repo, "acme/web");
        assert!(kid.warm.as_ref().unwrap().booted);
    }
    let check = "cat /work/app/mine /work/app/Cargo.lock; [ -e /work/app/dep ] || echo no-dep";
    for kid in &kids {
        assert_eq!(sh_ok(&daemon, kid, check).await, "mine\nlock\nno-dep\n");
    }
    sh_ok(&daemon, &kids[0], "echo kid > /work/app/kid").await;
    for other in [&kids[1], &parent] {
        assert_eq!(
            sh_ok(&daemon, other, "[ -e /work/app/kid ] || echo clean").await,
            "clean\n"
        );
    }

    // A snapshot keeps the volume at its path; a plain run from it has it.
    let snap = daemon
        .client
        .snapshot_run(&parent, Some("warm-snap"))
        .await
        .unwrap();
    let plain = daemon
        .create_with(CreateRunRequest {
            image: snap.image.clone(),
            ..Default::default()
        })
        .await
        .id
        .to_string();
    assert_eq!(sh_ok(&daemon, &plain, check).await, "mine\nlock\nno-dep\n");
    for run in kids.iter().chain([&parent, &plain, &setup]) {
        daemon.client.delete_run(run).await.unwrap();
    }
    daemon.client.delete_snapshot("warm-snap").await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hibernated_warm_run_wakes_with_its_volume_and_template() {
    let daemon = daemon_with(&[]).await;
    let setup = warm_run(&daemon, "acme/sleep", None).await.id.to_string();
    sh_ok(
        &daemon,
        &setup,
        "mkdir -p /work/app && echo dep > /work/app/dep && echo lock > /work/app/Cargo.lock",
    )
    .await;
    daemon.client.warm_commit(&setup, None).await.unwrap();
    let run = warm_run(&daemon, "acme/sleep", None).await;
    let id = run.id.to_string();
    let generation = run.warm.as_ref().unwrap().generation.clone();
    assert!(generation.is_some(), "the run started from the template");
    sh_ok(&daemon, &id, "echo mine > /work/app/mine; rm /work/app/dep").await;
    let asleep = daemon.client.hibernate_run(&id).await.unwrap();
    assert_eq!(asleep.status, runbox_types::RunStatus::Hibernated);
    // A newer template meanwhile: the run keeps the generation it mounts.
    sh_ok(&daemon, &setup, "echo newer > /work/app/newer").await;
    daemon.client.warm_commit(&setup, None).await.unwrap();
    // Woken, it has the template it was made with plus its own changes.
    let check = "cat /work/app/mine /work/app/Cargo.lock; [ -e /work/app/dep ] || echo no-dep; \
                 [ -e /work/app/newer ] || echo no-newer";
    assert_eq!(
        sh_ok(&daemon, &id, check).await,
        "mine\nlock\nno-dep\nno-newer\n"
    );
    let woken = daemon.client.get_run(&id).await.unwrap();
    assert_eq!(woken.warm.as_ref().unwrap().generation, generation);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_tenant_starts_from_and_commits_to_its_own_templates() {
    let mut daemon = daemon_with(&[]).await;
    let (mut clients, mut tokens) = (Vec::new(), Vec::new());
    for name in ["alpha", "beta"] {
        let token = daemon
            .client
            .create_tenant(&runbox_types::CreateTenantRequest {
                name: name.into(),
                max_runs: 0,
                images: Vec::new(),
                networks: Vec::new(),
                sizes: Vec::new(),
                egress_class: None,
            })
            .await
            .unwrap()
            .token;
        clients.push(runbox_client::Client::new(&daemon.url, &token).unwrap());
        tokens.push(token);
    }
    let (alpha, beta) = (&clients[0], &clients[1]);
    let warm = || CreateRunRequest {
        image: "base".into(),
        warm: Some(WarmRequest {
            repo: "acme/web".into(),
            path: None,
        }),
        ..Default::default()
    };
    let setup = alpha.create_run(&warm()).await.unwrap().id.to_string();
    sh_ok(&daemon, &setup, "echo alpha > /work/owner").await;
    let commit = alpha.warm_commit(&setup, None).await.unwrap();
    assert_eq!(commit.template.tenant.as_deref(), Some("alpha"));
    assert!(daemon
        .state
        .path()
        .join("runs/.warm/tenants/alpha/acme/web/manifest.json")
        .is_file());

    // Another tenant, and the operator, start empty from the same repository.
    let other = beta.create_run(&warm()).await.unwrap();
    assert!(!other.warm.as_ref().unwrap().booted, "{other:?}");
    let other = other.id.to_string();
    assert_eq!(
        sh_ok(&daemon, &other, "ls -A /work | wc -l").await.trim(),
        "0"
    );
    let operator = warm_run(&daemon, "acme/web", None).await;
    assert!(!operator.warm.as_ref().unwrap().booted);
    // The tenant's own next run starts from its template.
    let again = alpha.create_run(&warm()).await.unwrap();
    assert!(again.warm.as_ref().unwrap().booted, "{again:?}");
    let again = again.id.to_string();
    assert_eq!(sh_ok(&daemon, &again, "cat /work/owner").await, "alpha\n");
    // A commit of beta's run goes to beta's set, never over alpha's.
    sh_ok(&daemon, &other, "echo beta > /work/owner").await;
    beta.warm_commit(&other, None).await.unwrap();
    let third = alpha.create_run(&warm()).await.unwrap().id.to_string();
    assert_eq!(sh_ok(&daemon, &third, "cat /work/owner").await, "alpha\n");

    // Each sees its own; root sees both, stamped.
    let mine = |list: runbox_types::WarmTemplateList| {
        list.templates
            .into_iter()
            .map(|t| t.tenant.unwrap_or_default())
            .collect::<Vec<_>>()
    };
    assert_eq!(mine(alpha.warm_templates().await.unwrap()), ["alpha"]);
    assert_eq!(mine(beta.warm_templates().await.unwrap()), ["beta"]);
    assert_eq!(
        mine(daemon.client.warm_templates().await.unwrap()),
        ["alpha", "beta"]
    );
    // Root addresses the operator's own set by repository: it has none.
    let err = daemon.client.warm_template("acme/web").await.unwrap_err();
    assert_eq!(err.code(), Some(ErrorCode::TemplateNotFound), "{err}");
    // Dropping is per tenant too.
    beta.warm_invalidate("acme/web").await.unwrap();
    let err = beta.warm_template("acme/web").await.unwrap_err();
    assert_eq!(err.code(), Some(ErrorCode::TemplateNotFound), "{err}");
    assert_eq!(
        alpha
            .warm_template("acme/web")
            .await
            .unwrap()
            .tenant
            .as_deref(),
        Some("alpha")
    );
    // A restarted daemon finds each tenant's set where it was.
    daemon.kill9();
    daemon.spawn().await;
    let alpha = runbox_client::Client::new(&daemon.url, &tokens[0]).unwrap();
    assert_eq!(mine(alpha.warm_templates().await.unwrap()), ["alpha"]);
    assert_eq!(
        mine(daemon.client.warm_templates().await.unwrap()),
        ["alpha"]
    );
}
