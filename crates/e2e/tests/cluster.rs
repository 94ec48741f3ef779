//! The fleet's membership on a real PostgreSQL server (Debian's, started
//! by the harness in a temporary directory): several daemons on this
//! machine, each with its own state directory, address and node id, join
//! through `--cluster-db`, list each other in `GET /v1/cluster` with where
//! each stands by the database's clock, survive the database going away,
//! and are refused with a reason when they cannot join.

use std::process::{Command, Stdio};
use std::time::Duration;

use runbox_e2e::{
    agent_bin, eventually_async, free_port, runbox_bin, runtimes, PgServer, TestDaemon,
};
use runbox_types::NodeState;

/// The cluster key of the tests' fleets.
const KEY: &str = "a-cluster-key-of-more-than-32-bytes-for-the-tests";

/// Starts node `id` of the fleet in `pg`, listening on (and advertising)
/// a loopback port of its own; `extra` are more `serve` arguments.
async fn node(pg: &PgServer, id: &str, extra: &[&str]) -> TestDaemon {
    node_with(pg, id, extra, &[]).await
}

/// [`node`] with more environment variables.
async fn node_with(pg: &PgServer, id: &str, extra: &[&str], env: &[(&str, &str)]) -> TestDaemon {
    let listen = format!("127.0.0.1:{}", free_port());
    let url = pg.url();
    let mut args = vec![
        "--cluster-db",
        &url,
        "--node-id",
        id,
        "--advertise",
        &listen,
        "--cluster-suspect-sec",
        "2",
        "--cluster-gone-sec",
        "5",
    ];
    args.extend_from_slice(extra);
    let runtime = runtimes().into_iter().next();
    TestDaemon::start_listening(
        runtime.as_deref(),
        &listen,
        &args,
        &[
            &[
                ("RUNBOX_CLUSTER_KEY", KEY),
                ("RUNBOX_CLUSTER_DB_PASSWORD", pg.password.as_str()),
            ],
            env,
        ]
        .concat(),
    )
    .await
}

/// `daemon`'s metrics document.
async fn metrics(daemon: &TestDaemon) -> String {
    reqwest::Client::new()
        .get(format!("{}/metrics", daemon.url))
        .bearer_auth(&daemon.token)
        .send()
        .await
        .expect("GET /metrics")
        .text()
        .await
        .expect("the metrics")
}

/// `(id, state)` of each node `daemon` lists, by id.
async fn states(daemon: &TestDaemon) -> Vec<(String, NodeState)> {
    let status = daemon.client.cluster().await.expect("GET /v1/cluster");
    status.nodes.into_iter().map(|n| (n.id, n.state)).collect()
}

/// Waits up to `limit` for `daemon` to list node `id` as `state`.
async fn sees(daemon: &TestDaemon, id: &str, state: NodeState, limit: Duration) -> bool {
    eventually_async(limit, || async {
        states(daemon)
            .await
            .iter()
            .any(|(n, s)| n == id && *s == state)
    })
    .await
}

/// `runbox serve` with `args` and `env` that must fail: its stderr.
fn serve_fails(args: &[&str], env: &[(&str, &str)]) -> String {
    let state = tempfile::tempdir().expect("state dir");
    serve_fails_in(state.path(), args, env)
}

/// [`serve_fails`] on state directory `state`.
fn serve_fails_in(state: &std::path::Path, args: &[&str], env: &[(&str, &str)]) -> String {
    let out = Command::new(runbox_bin())
        .arg("serve")
        .arg("--state-dir")
        .arg(state)
        .arg("--listen")
        .arg("127.0.0.1:0")
        .arg("--agent")
        .arg(agent_bin())
        .args(args)
        .env_remove("RUNBOX_CLUSTER_KEY")
        .env_remove("RUNBOX_CLUSTER_DB_PASSWORD")
        .envs(env.iter().copied())
        .stdin(Stdio::null())
        .output()
        .expect("running runbox serve");
    assert!(!out.status.success(), "serve {args:?} should have failed");
    String::from_utf8_lossy(&out.stderr).into_owned()
}

#[tokio::test(flavor = "multi_thread")]
async fn nodes_starting_at_once_on_an_empty_database_join_and_list_each_other() {
    let pg = PgServer::start();
    // Both migrate and join at the same moment: the schema is made once.
    let (a, b) = tokio::join!(node(&pg, "n1", &[]), node(&pg, "n2", &[]));
    let shipped = std::fs::read_dir(runbox_e2e::workspace_root().join("crates/fleet/migrations"))
        .expect("the migrations")
        .count();
    assert_eq!(
        pg.psql("SELECT count(*) FROM _sqlx_migrations WHERE success"),
        shipped.to_string()
    );
    for (daemon, me) in [(&a, "n1"), (&b, "n2")] {
        let status = daemon.client.cluster().await.expect("GET /v1/cluster");
        let ids: Vec<&str> = status.nodes.iter().map(|n| n.id.as_str()).collect();
        assert_eq!(ids, ["n1", "n2"]);
        for n in &status.nodes {
            assert_eq!(n.state, NodeState::Active, "{n:?}");
            assert_eq!(n.local, n.id == me, "{n:?}");
            assert_eq!(n.capacity, 256);
            assert!(n.last_seen_sec < 2.0, "{n:?}");
            assert_eq!(n.version, env!("CARGO_PKG_VERSION"));
        }
        let own = status.nodes.iter().find(|n| n.local).expect("itself");
        assert_eq!(
            own.advertise.as_deref(),
            Some(daemon.url.trim_start_matches("http://"))
        );
    }
    // The root token is the fleet's (derived from the cluster key): one
    // token opens every node. The interception CA is the fleet's too (made
    // by the first node, stored sealed), so a run trusts every node's proxy.
    assert_eq!(a.token, b.token);
    let ca =
        |d: &TestDaemon| std::fs::read_to_string(d.state.path().join("ca/ca.pem")).expect("ca.pem");
    assert_eq!(ca(&a), ca(&b));
    assert_eq!(pg.psql("SELECT count(*) FROM runbox_shared"), "1");
    assert!(
        !pg.psql("SELECT sealed FROM runbox_shared")
            .contains("BEGIN"),
        "stored sealed"
    );
    assert!(a.client.info().await.is_ok() && b.client.info().await.is_ok());
    // The node id is the server id on answers, and heartbeats carry load.
    let run = b.create().await;
    assert_eq!(run.server, "n2");
    let loaded = eventually_async(Duration::from_secs(10), || async {
        let status = a.client.cluster().await.expect("GET /v1/cluster");
        status.nodes.iter().any(|n| n.id == "n2" && n.runs == 1)
    })
    .await;
    assert!(loaded, "n1 never saw n2's run in its heartbeat");
    // Each row says what its node's lane can do, as the node says itself.
    let own = b.client.cluster().await.expect("GET /v1/cluster");
    let own = own.nodes.iter().find(|n| n.local).expect("itself");
    assert!(own.capabilities.iter().any(|c| c == "allowlist"), "{own:?}");
    let seen = a.client.cluster().await.expect("GET /v1/cluster");
    let seen = seen.nodes.iter().find(|n| n.id == "n2").expect("n2");
    assert_eq!(seen.capabilities, own.capabilities);
    // The CLI shows the fleet.
    let out = Command::new(runbox_bin())
        .args(["cluster", "status"])
        .env("RUNBOX_URL", &a.url)
        .env("RUNBOX_TOKEN", &a.token)
        .output()
        .expect("runbox cluster status");
    let table = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{table}");
    assert!(table.contains("n1 *") && table.contains("n2"), "{table}");
    assert!(table.contains("active"), "{table}");
    b.client
        .delete_run(&run.id.to_string())
        .await
        .expect("delete");
    // The database password is in no log.
    for daemon in [&a, &b] {
        assert!(!daemon.log().contains(&pg.password), "{}", daemon.log());
        assert!(
            daemon.log().contains("joined the cluster"),
            "{}",
            daemon.log()
        );
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn a_killed_node_is_suspect_then_gone_and_a_stopped_one_gone_at_once() {
    let pg = PgServer::start();
    let a = node(&pg, "n1", &[]).await;
    let mut b = node(&pg, "n2", &[]).await;
    let mut c = node(&pg, "n3", &[]).await;
    assert!(sees(&a, "n2", NodeState::Active, Duration::from_secs(5)).await);
    b.kill9();
    assert!(
        sees(&a, "n2", NodeState::Suspect, Duration::from_secs(10)).await,
        "{:?}",
        states(&a).await
    );
    assert!(
        sees(&a, "n2", NodeState::Gone, Duration::from_secs(15)).await,
        "{:?}",
        states(&a).await
    );
    // A clean stop says so in the database: gone without waiting.
    c.terminate();
    assert!(
        sees(&a, "n3", NodeState::Gone, Duration::from_secs(2)).await,
        "{:?}",
        states(&a).await
    );
    // A node that comes back at its address takes its row over at once.
    b.spawn().await;
    assert!(sees(&a, "n2", NodeState::Active, Duration::from_secs(5)).await);
    // A cordoned node is listed as draining.
    b.client.set_draining(true).await.expect("drain");
    assert!(sees(&a, "n2", NodeState::Draining, Duration::from_secs(5)).await);
}

#[tokio::test(flavor = "multi_thread")]
async fn without_its_database_a_node_serves_its_runs_and_says_503_for_the_fleet() {
    let pg = PgServer::start();
    let a = node(&pg, "n1", &[]).await;
    let run = a.create().await;
    let id = run.id.to_string();
    pg.stop();
    let err = a.client.cluster().await.expect_err("the database is down");
    let message = err.to_string();
    assert!(message.contains("cluster_unavailable"), "{message}");
    let answer = reqwest::Client::new()
        .get(format!("{}/v1/cluster", a.url))
        .bearer_auth(&a.token)
        .send()
        .await
        .expect("GET /v1/cluster");
    assert_eq!(answer.status().as_u16(), 503);
    assert_eq!(
        answer.headers().get("retry-after").map(|v| v.as_bytes()),
        Some(&b"2"[..])
    );
    let text = answer.text().await.expect("body");
    assert!(text.contains("cluster_unavailable"), "{text}");
    assert!(!text.contains(&pg.password), "{text}");
    // Its metrics say so.
    let down = metrics(&a).await;
    assert!(down.contains("runbox_fleet_database_up 0"), "{down}");
    assert!(!down.contains("runbox_fleet_nodes{"), "{down}");
    // Its own runs go on.
    let out = a.sh(&id, "echo still here").await;
    assert_eq!(out.stdout, b"still here\n");
    // A create takes its idempotency key (every client sends one) and its
    // tenant's count from the fleet's ledger: refused meanwhile, with
    // Retry-After; one without a key or tenant is this node's alone.
    let base = runbox_types::CreateRunRequest {
        image: "base".into(),
        ..Default::default()
    };
    let err = a
        .client
        .create_run_with_key(&base, "while-down")
        .await
        .expect_err("the database is down");
    assert!(err.to_string().contains("cluster_unavailable"), "{err}");
    let unkeyed = reqwest::Client::new()
        .post(format!("{}/v1/runs", a.url))
        .bearer_auth(&a.token)
        .json(&base)
        .send()
        .await
        .expect("POST /v1/runs");
    assert_eq!(unkeyed.status().as_u16(), 201, "{}", a.log());
    let unkeyed: runbox_types::Run = unkeyed.json().await.expect("a run");
    // Back: the fleet answers again, the heartbeat resumes, and keyed
    // creates are served.
    pg.start_again();
    let more = eventually_async(Duration::from_secs(15), || async {
        a.client
            .create_run_with_key(&base, "while-down")
            .await
            .is_ok()
    })
    .await;
    assert!(more, "creates never came back: {}", a.log());
    let more = a
        .client
        .create_run_with_key(&base, "while-down")
        .await
        .expect("the repeat answers with the run");
    let back = eventually_async(Duration::from_secs(15), || async {
        a.client.cluster().await.is_ok_and(|s| {
            s.nodes
                .iter()
                .any(|n| n.id == "n1" && n.state == NodeState::Active && n.runs == 3)
        })
    })
    .await;
    assert!(back, "the fleet never answered again: {}", a.log());
    let up = metrics(&a).await;
    assert!(up.contains("runbox_fleet_database_up 1"), "{up}");
    assert!(
        up.contains(r#"runbox_fleet_nodes{state="active"} 1"#),
        "{up}"
    );
    assert!(a.log().contains("answers again"), "{}", a.log());
    for id in [id, more.id.to_string(), unkeyed.id.to_string()] {
        a.client.delete_run(&id).await.expect("delete");
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn a_node_that_cannot_join_says_why_and_exits() {
    let pg = PgServer::start();
    let url = pg.url();
    let auth = [
        ("RUNBOX_CLUSTER_KEY", KEY),
        ("RUNBOX_CLUSTER_DB_PASSWORD", pg.password.as_str()),
    ];
    let cluster = |node: &'static str, advertise: &'static str| {
        vec![
            "--cluster-db",
            url.as_str(),
            "--node-id",
            node,
            "--advertise",
            advertise,
        ]
    };
    // Nothing listens on the database's address.
    let closed = format!("postgres://runbox@127.0.0.1:{}/postgres", free_port());
    let stderr = serve_fails(
        &[
            "--cluster-db",
            &closed,
            "--node-id",
            "n1",
            "--advertise",
            "127.0.0.1:9",
        ],
        &auth,
    );
    assert!(
        stderr.contains("cannot reach the cluster database at 127.0.0.1:"),
        "{stderr}"
    );
    assert!(!stderr.contains(&pg.password), "{stderr}");
    // A wrong password is refused by the database, and not shown.
    let stderr = serve_fails(
        &cluster("n1", "127.0.0.1:9"),
        &[
            ("RUNBOX_CLUSTER_KEY", KEY),
            ("RUNBOX_CLUSTER_DB_PASSWORD", "not-the-password"),
        ],
    );
    assert!(
        stderr.contains("cannot reach the cluster database"),
        "{stderr}"
    );
    assert!(!stderr.contains("not-the-password"), "{stderr}");
    // Flags checked before anything is reached.
    for (args, env, says) in [
        (cluster("N_1", "127.0.0.1:9"), &auth[..], "--node-id"),
        (cluster("n1", "nowhere"), &auth[..], "--advertise"),
        (cluster("n1", "127.0.0.1:9"), &auth[1..], "cluster key"),
    ] {
        let stderr = serve_fails(&args, env);
        assert!(stderr.contains(says), "{args:?}: {stderr}");
    }
    let stderr = serve_fails(&["--cluster-db", url.as_str(), "--node-id", "n1"], &auth);
    assert!(stderr.contains("--advertise"), "{stderr}");
    // A fleet made with one key refuses a node with another.
    let a = node(&pg, "n1", &[]).await;
    let stderr = serve_fails(
        &cluster("n2", "127.0.0.1:9"),
        &[
            (
                "RUNBOX_CLUSTER_KEY",
                "another-key-of-more-than-32-bytes-long!!",
            ),
            ("RUNBOX_CLUSTER_DB_PASSWORD", pg.password.as_str()),
        ],
    );
    assert!(
        stderr.contains("cluster key is not the fleet's"),
        "{stderr}"
    );
    // A live node's id is its own.
    let stderr = serve_fails(&cluster("n1", "127.0.0.1:9"), &auth);
    assert!(stderr.contains("belongs to a live node at"), "{stderr}");
    assert_eq!(states(&a).await, [("n1".to_owned(), NodeState::Active)]);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_tenant_made_on_one_node_is_every_nodes() {
    use runbox_types::{CreateTenantRequest, UpdateTenantRequest};
    let pg = PgServer::start();
    let (a, b) = tokio::join!(node(&pg, "n1", &[]), node(&pg, "n2", &[]));
    let made = a
        .client
        .create_tenant(&CreateTenantRequest {
            name: "acme".into(),
            max_runs: 3,
            ..Default::default()
        })
        .await
        .expect("tenant made on n1");
    // Its token opens n2, whose copy hears of the change within moments.
    let on_b = runbox_client::Client::new(&b.url, made.token.clone()).expect("client");
    let known = eventually_async(Duration::from_secs(10), || async {
        on_b.list_runs().await.is_ok()
    })
    .await;
    assert!(known, "n2 never knew acme: {}", b.log());
    let run = on_b
        .create_run(&runbox_types::CreateRunRequest {
            image: "base".into(),
            ..Default::default()
        })
        .await
        .expect("acme's run on n2");
    assert_eq!(run.tenant.as_deref(), Some("acme"));
    assert_eq!(run.server, "n2");
    // A name is the fleet's once.
    let err = b
        .client
        .create_tenant(&CreateTenantRequest {
            name: "acme".into(),
            ..Default::default()
        })
        .await
        .expect_err("acme exists");
    assert!(err.to_string().contains("tenant_exists"), "{err}");
    // Rotated on n2: the old token stops opening n1, the new one opens it.
    let rotated = b.client.rotate_tenant("acme").await.expect("rotate");
    let on_a_old = runbox_client::Client::new(&a.url, made.token.clone()).expect("client");
    let on_a_new = runbox_client::Client::new(&a.url, rotated.token.clone()).expect("client");
    let switched = eventually_async(Duration::from_secs(10), || async {
        on_a_old.list_runs().await.is_err() && on_a_new.list_runs().await.is_ok()
    })
    .await;
    assert!(switched, "n1 kept the old token: {}", a.log());
    // Settings changed on n1 are n2's.
    a.client
        .update_tenant(
            "acme",
            &UpdateTenantRequest {
                max_runs: Some(7),
                ..Default::default()
            },
        )
        .await
        .expect("update");
    let updated = eventually_async(Duration::from_secs(10), || async {
        b.client
            .get_tenant("acme")
            .await
            .is_ok_and(|t| t.policy.max_runs == 7)
    })
    .await;
    assert!(updated);
    // While the database is down, changes are refused and tokens still
    // open the node (from its copy).
    pg.stop();
    let err = a
        .client
        .create_tenant(&CreateTenantRequest {
            name: "later".into(),
            ..Default::default()
        })
        .await
        .expect_err("the database is down");
    assert!(err.to_string().contains("cluster_unavailable"), "{err}");
    // (Run lists are the fleet's and wait for the database; images are the
    // node's.)
    assert!(on_a_new.list_images().await.is_ok());
    pg.start_again();
    // Deleted on n1 (its run first): gone on n2 as well.
    let on_b_new = runbox_client::Client::new(&b.url, rotated.token.clone()).expect("client");
    on_b_new
        .delete_run(&run.id.to_string())
        .await
        .expect("delete the run");
    let deleted = eventually_async(Duration::from_secs(15), || async {
        a.client.delete_tenant("acme").await.is_ok()
    })
    .await;
    assert!(deleted, "{}", a.log());
    let gone = eventually_async(Duration::from_secs(10), || async {
        b.client.get_tenant("acme").await.is_err() && on_b_new.list_runs().await.is_err()
    })
    .await;
    assert!(gone, "n2 kept acme");
    assert_eq!(pg.psql("SELECT count(*) FROM runbox_tenants"), "0");
}

#[tokio::test(flavor = "multi_thread")]
async fn quotas_keys_and_tenant_deletes_hold_across_the_fleet() {
    use runbox_types::{CreateRunRequest, CreateTenantRequest, ErrorCode};
    let pg = PgServer::start();
    let (a, b) = tokio::join!(node(&pg, "n1", &[]), node(&pg, "n2", &[]));
    let made = a
        .client
        .create_tenant(&CreateTenantRequest {
            name: "acme".into(),
            max_runs: 2,
            ..Default::default()
        })
        .await
        .expect("tenant made on n1");
    let on_a = runbox_client::Client::new(&a.url, made.token.clone()).expect("client");
    let on_b = runbox_client::Client::new(&b.url, made.token.clone()).expect("client");
    let known = eventually_async(Duration::from_secs(10), || async {
        on_b.list_runs().await.is_ok()
    })
    .await;
    assert!(known, "n2 never knew acme: {}", b.log());
    let base = CreateRunRequest {
        image: "base".into(),
        ..Default::default()
    };
    // maxRuns is the fleet's: one run on each node fills it, and a third
    // is refused by either node.
    let first = on_a.create_run(&base).await.expect("acme's run on n1");
    let second = on_b.create_run(&base).await.expect("acme's run on n2");
    assert_eq!(
        (first.server.as_str(), second.server.as_str()),
        ("n1", "n2")
    );
    for (node, client) in [("n1", &on_a), ("n2", &on_b)] {
        let err = client
            .create_run(&base)
            .await
            .expect_err("the quota is full");
        assert_eq!(err.code(), Some(ErrorCode::TenantQuota), "{node}: {err}");
    }
    // A run ended on n1 frees a place on n2 (the count falls behind); n1
    // holds none of acme's runs now, but the tenant cannot be deleted
    // there while n2 holds one.
    on_a.delete_run(&first.id.to_string())
        .await
        .expect("delete on n1");
    let err = a
        .client
        .delete_tenant("acme")
        .await
        .expect_err("n2 has a run");
    assert_eq!(err.code(), Some(ErrorCode::TenantHasRuns), "{err}");
    assert!(err.to_string().contains("node n2"), "{err}");
    let again = eventually_async(Duration::from_secs(10), || async {
        on_b.create_run(&base).await.is_ok()
    })
    .await;
    assert!(again, "n2 never saw the place n1 freed: {}", b.log());
    // An idempotency key is the fleet's: the repeat sent to the other node
    // answers with the first run, another request with it is refused.
    let key = "fleet-wide-key";
    let made_on_a = a
        .client
        .create_run_with_key(&base, key)
        .await
        .expect("keyed create through n1");
    let other_node = if made_on_a.server == "n1" { &b } else { &a };
    let repeat = other_node
        .client
        .create_run_with_key(&base, key)
        .await
        .expect("the repeat through the other node");
    assert_eq!(
        (repeat.id, repeat.server.as_str()),
        (made_on_a.id, made_on_a.server.as_str())
    );
    let other = CreateRunRequest {
        image: "base".into(),
        labels: Some([("other".to_string(), "request".to_string())].into()),
        ..Default::default()
    };
    let err = b
        .client
        .create_run_with_key(&other, key)
        .await
        .expect_err("another request with the key");
    assert_eq!(err.code(), Some(ErrorCode::IdempotencyKeyReused), "{err}");
    // Once its run is deleted, the key makes a new run anywhere.
    a.client
        .delete_run(&made_on_a.id.to_string())
        .await
        .expect("delete the keyed run");
    let fresh = eventually_async(Duration::from_secs(10), || async {
        b.client
            .create_run_with_key(&base, key)
            .await
            .is_ok_and(|run| run.id != made_on_a.id)
    })
    .await;
    assert!(fresh, "{}", b.log());
    // With acme's runs gone from every node, the delete goes through.
    for run in on_b.list_runs().await.expect("acme's runs").runs {
        on_b.delete_run(&run.id.to_string()).await.expect("delete");
    }
    let deleted = eventually_async(Duration::from_secs(15), || async {
        a.client.delete_tenant("acme").await.is_ok()
    })
    .await;
    assert!(deleted, "{}", a.log());
    assert_eq!(
        pg.psql("SELECT count(*) FROM runbox_tenant_runs WHERE tenant = 'acme'"),
        "0"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn creates_go_where_the_image_and_room_are_and_429_only_when_the_fleet_is_full() {
    use runbox_types::{CreateRunRequest, ErrorCode};
    let pg = PgServer::start();
    let (a, b) = tokio::join!(
        node(&pg, "n1", &["--max-runs", "1"]),
        node(
            &pg,
            "n2",
            &[
                "--max-runs",
                "2",
                "--client-advertise",
                "https://n2.example.com"
            ]
        )
    );
    b.import("only2", runbox_e2e::busybox_tar()).await;
    let listed = eventually_async(Duration::from_secs(10), || async {
        pg.psql("SELECT 'only2' = ANY(images) FROM runbox_nodes WHERE id = 'n2'") == "t"
    })
    .await;
    assert!(listed, "n2's heartbeat never named its image");
    let create = |image: &str| CreateRunRequest {
        image: image.into(),
        ..Default::default()
    };
    // An image only n2 stores: made there, whichever node is asked.
    let first = a
        .client
        .create_run(&create("only2"))
        .await
        .expect("create via n1");
    assert_eq!(first.server, "n2");
    // Room on both: it stays on the node asked.
    let second = a
        .client
        .create_run(&create("base"))
        .await
        .expect("create via n1");
    assert_eq!(second.server, "n1");
    // The catalog has a run before its caller has the id: the other node
    // finds it at once.
    let found = b
        .client
        .get_run(&second.id.to_string())
        .await
        .expect("at once through n2");
    assert_eq!(found.server, "n1");
    // n1 is full: sent to n2 instead of a 429.
    let third = a
        .client
        .create_run(&create("base"))
        .await
        .expect("n1 full, n2 not");
    assert_eq!(third.server, "n2");
    // Its answer is the run's, with a token that works through any node.
    // Each answer names where its node may be reached directly, when the
    // node says.
    assert_eq!(
        third.server_origin.as_deref(),
        Some("https://n2.example.com")
    );
    assert_eq!(second.server_origin, None);
    let token = third.token.clone().expect("the run's token");
    let as_run = runbox_client::Client::new(&a.url, token).expect("client");
    assert_eq!(
        as_run
            .get_run(&third.id.to_string())
            .await
            .expect("get")
            .server,
        "n2"
    );
    // A create that mounts a volume goes where the volume is.
    b.client
        .create_volume(&runbox_types::CreateVolumeRequest {
            name: "data".into(),
            ..Default::default()
        })
        .await
        .expect("a volume on n2");
    let listed = eventually_async(Duration::from_secs(10), || async {
        pg.psql("SELECT '/data' = ANY(volumes) FROM runbox_nodes WHERE id = 'n2'") == "t"
    })
    .await;
    assert!(listed, "n2's heartbeat never named its volume");
    // Any node answers for it: listed by n1 with its node, read and
    // written through n1.
    let volumes = a.client.list_volumes().await.expect("n1's list");
    let named: Vec<(&str, &str)> = volumes
        .volumes
        .iter()
        .map(|v| (v.name.as_str(), v.server.as_str()))
        .collect();
    assert_eq!(named, [("data", "n2")]);
    assert_eq!(
        a.client
            .get_volume("data")
            .await
            .expect("through n1")
            .server,
        "n2"
    );
    a.client
        .put_volume_file(
            "data",
            "note.txt",
            &Default::default(),
            runbox_e2e::body(b"through n1".to_vec()),
        )
        .await
        .expect("a file written into n2's volume through n1");
    b.client
        .delete_run(&first.id.to_string())
        .await
        .expect("room on n2");
    // (Placement reads the other nodes' load from their heartbeats.)
    let room = eventually_async(Duration::from_secs(10), || async {
        pg.psql("SELECT runs FROM runbox_nodes WHERE id = 'n2'") == "1"
    })
    .await;
    assert!(room, "n2's heartbeat never showed the room");
    let mounting = a
        .client
        .create_run(&CreateRunRequest {
            image: "base".into(),
            volumes: Some(vec![runbox_types::VolumeMountRequest {
                name: "data".into(),
                path: None,
                mode: None,
            }]),
            ..Default::default()
        })
        .await
        .expect("a run mounting n2's volume, through n1");
    assert_eq!(mounting.server, "n2");
    let read = a
        .sh(&mounting.id.to_string(), "cat /volumes/data/note.txt")
        .await;
    assert_eq!(read.stdout, b"through n1");
    let first = mounting;
    // The fleet is full: 429 from either node.
    for daemon in [&a, &b] {
        let err = daemon
            .client
            .create_run(&create("base"))
            .await
            .expect_err("no room anywhere");
        assert_eq!(err.code(), Some(ErrorCode::Capacity), "{err}");
    }
    for run in [first, second, third] {
        a.client
            .delete_run(&run.id.to_string())
            .await
            .expect("delete");
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn every_node_lists_the_fleets_runs_from_the_catalog() {
    use runbox_types::{CreateRunRequest, CreateTenantRequest};
    let pg = PgServer::start();
    let (a, mut b) = tokio::join!(node(&pg, "n1", &[]), node(&pg, "n2", &[]));
    let mine = a.create().await;
    let theirs = b
        .create_with(CreateRunRequest {
            image: "base".into(),
            labels: Some([("team".to_owned(), "blue".to_owned())].into()),
            ..Default::default()
        })
        .await;
    // Each node lists both, each with the node that holds it.
    let expected = [(mine.id, "n1"), (theirs.id, "n2")];
    for daemon in [&a, &b] {
        let listed = eventually_async(Duration::from_secs(10), || async {
            daemon.client.list_runs().await.is_ok_and(|list| {
                let got: Vec<_> = list
                    .runs
                    .iter()
                    .map(|r| (r.id, r.server.as_str()))
                    .collect();
                got == expected
            })
        })
        .await;
        assert!(listed, "{:?}", daemon.client.list_runs().await);
    }
    // Snapshots are the fleet's too: one taken of n2's run through n1 is
    // listed by n1 (its `server` says n2), and deleted through n1.
    let snap = a
        .client
        .snapshot_run(&theirs.id.to_string(), Some("fleet-snap"))
        .await
        .expect("a snapshot of n2's run through n1");
    let names = |list: runbox_types::SnapshotList| -> Vec<(String, String)> {
        list.snapshots
            .into_iter()
            .map(|i| (i.name, i.server))
            .collect()
    };
    let listed = names(a.client.list_snapshots().await.expect("n1's list"));
    assert_eq!(
        listed,
        [("fleet-snap".to_owned(), "n2".to_owned())],
        "{snap:?}"
    );
    a.client
        .delete_snapshot("fleet-snap")
        .await
        .expect("deleted through n1");
    assert!(names(b.client.list_snapshots().await.expect("n2's list")).is_empty());
    // The label selector and a tenant's view hold over the fleet's list.
    let blue = a
        .client
        .list_runs_labelled(&["team=blue"])
        .await
        .expect("selector");
    assert_eq!(
        blue.runs.iter().map(|r| r.id).collect::<Vec<_>>(),
        [theirs.id]
    );
    let acme = a
        .client
        .create_tenant(&CreateTenantRequest {
            name: "acme".into(),
            ..Default::default()
        })
        .await
        .expect("tenant");
    let acme_on_b = runbox_client::Client::new(&b.url, acme.token.clone()).expect("client");
    let acme_run = eventually_async(Duration::from_secs(10), || async {
        acme_on_b.list_runs().await.is_ok()
    })
    .await;
    assert!(acme_run);
    let owned = acme_on_b
        .create_run(&CreateRunRequest {
            image: "base".into(),
            ..Default::default()
        })
        .await
        .expect("acme's run");
    let acme_on_a = runbox_client::Client::new(&a.url, acme.token.clone()).expect("client");
    let sees_own = eventually_async(Duration::from_secs(10), || async {
        acme_on_a
            .list_runs()
            .await
            .is_ok_and(|l| l.runs.iter().map(|r| r.id).collect::<Vec<_>>() == [owned.id])
    })
    .await;
    assert!(sees_own, "{:?}", acme_on_a.list_runs().await);
    // Deleted on n2: gone from n1's list.
    acme_on_b
        .delete_run(&owned.id.to_string())
        .await
        .expect("delete");
    let gone = eventually_async(Duration::from_secs(10), || async {
        a.client
            .list_runs()
            .await
            .is_ok_and(|l| l.runs.iter().all(|r| r.id != owned.id))
    })
    .await;
    assert!(gone);
    // A node killed: its runs are still its (on its disk), and listed so.
    b.kill9();
    let list = a.client.list_runs().await.expect("list");
    assert!(list
        .runs
        .iter()
        .any(|r| r.id == theirs.id && r.server == "n2"));
    // Without the database the fleet's list cannot be made: 503.
    pg.stop();
    let err = a
        .client
        .list_runs()
        .await
        .expect_err("the database is down");
    assert!(err.to_string().contains("cluster_unavailable"), "{err}");
    pg.start_again();
    // n2 back: it tells the catalog what it holds.
    b.spawn().await;
    b.client
        .delete_run(&theirs.id.to_string())
        .await
        .expect("delete");
    a.client
        .delete_run(&mine.id.to_string())
        .await
        .expect("delete");
    let empty = eventually_async(Duration::from_secs(10), || async {
        a.client.list_runs().await.is_ok_and(|l| l.runs.is_empty())
    })
    .await;
    assert!(empty, "{:?}", a.client.list_runs().await);
}

#[tokio::test(flavor = "multi_thread")]
async fn any_node_answers_for_a_run_another_node_holds() {
    let pg = PgServer::start();
    let preview = ["--preview-listen", "127.0.0.1:0"];
    let (a, mut b, c) = tokio::join!(
        node(&pg, "n1", &[]),
        node(&pg, "n2", &preview),
        node(&pg, "n3", &preview)
    );
    let run = b.create().await;
    let id = run.id.to_string();
    // Known to the catalog (written behind) within moments.
    let found = eventually_async(Duration::from_secs(10), || async {
        a.client.get_run(&id).await.is_ok()
    })
    .await;
    assert!(found, "n1 never answered for n2's run");
    let got = a.client.get_run(&id).await.expect("get through n1");
    assert_eq!(got.server, "n2");
    // Exec (an event stream), files both ways and a port tunnel (an
    // upgraded connection), all through n1.
    let out = a.sh(&id, "echo via-n1; hostname > /work/h").await;
    assert_eq!(out.stdout, b"via-n1\n");
    a.client
        .put_file(&id, "up.txt", runbox_e2e::body(b"carried".to_vec()))
        .await
        .expect("upload through n1");
    let back = b.sh(&id, "cat /work/up.txt").await;
    assert_eq!(back.stdout, b"carried");
    let down = a.client.get_file(&id, "up.txt").await.expect("download");
    let bytes: Vec<u8> = {
        use futures::TryStreamExt;
        down.into_stream()
            .try_fold(Vec::new(), |mut all, chunk| async move {
                all.extend_from_slice(&chunk);
                Ok(all)
            })
            .await
            .expect("download body")
    };
    assert_eq!(bytes, b"carried");
    let _tunnel = a.echo_tunnel(&id, 7001).await;
    // n1's metrics count what it sent on to n2, and say which node they
    // are from; a node alone in nothing of this.
    let counted = metrics(&a).await;
    assert!(
        counted.contains(r#"runbox_node_info{node="n1",version=""#),
        "{counted}"
    );
    assert!(
        counted.contains(r#"runbox_fleet_nodes{state="active"} 3"#),
        "{counted}"
    );
    let relayed: u64 = counted
        .lines()
        .find(|l| l.starts_with(r#"runbox_fleet_relayed_total{node="n2",outcome="answered"}"#))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|n| n.parse().ok())
        .unwrap_or(0);
    assert!(relayed >= 5, "{counted}");
    // Through a third node: an exec, and a preview URL minted there (the
    // preview key is the fleet's) and opened on its preview listener.
    let out = c
        .sh(
            &id,
            "mkdir -p /tmp/www && echo via-n3 > /tmp/www/index.html && httpd -p 8080 -h /tmp/www",
        )
        .await;
    assert_eq!(
        out.exit.exit_code,
        0,
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // A WebSocket shell with a terminal, through n3: input in, output
    // and the exit out.
    let session = c
        .client
        .exec_session(
            &id,
            &runbox_types::ExecRequest {
                cmd: vec!["sh".into()],
                pty: Some(runbox_types::PtySpec {
                    rows: 24,
                    cols: 80,
                    term: None,
                }),
                ..Default::default()
            },
        )
        .await
        .expect("a shell through n3");
    session
        .writer
        .stdin(&b"echo via-ws-$((6*7)); exit 5\r"[..])
        .await
        .expect("input through n3");
    let shell = tokio::time::timeout(Duration::from_secs(20), session.events.collect_output())
        .await
        .expect("the shell ends")
        .expect("the shell's stream");
    assert!(
        String::from_utf8_lossy(&shell.stdout).contains("via-ws-42"),
        "{:?}",
        String::from_utf8_lossy(&shell.stdout)
    );
    assert_eq!(shell.exit.exit_code, 5);
    drop(session.writer);
    // A client that hangs up on an exec through n1 stops the command on
    // n2, as it would on n2 itself.
    let mut hung_up = reqwest::Client::new()
        .post(format!("{}/v1/runs/{id}/exec", a.url))
        .bearer_auth(&a.token)
        .header("accept", "text/event-stream")
        .json(&serde_json::json!({"cmd": ["sh", "-c", "echo begun; exec sleep 987"]}))
        .send()
        .await
        .expect("an exec through n1");
    let first = tokio::time::timeout(Duration::from_secs(10), hung_up.chunk())
        .await
        .expect("the exec's output in time")
        .expect("the stream");
    assert!(first.is_some());
    let sleeping = "ps -o args | grep -c '^sleep 987'";
    let started = eventually_async(Duration::from_secs(10), || async {
        b.sh(&id, sleeping).await.stdout == b"1\n"
    })
    .await;
    assert!(started, "the command never ran on n2");
    drop(hung_up);
    let stopped = eventually_async(Duration::from_secs(10), || async {
        b.sh(&id, sleeping).await.stdout == b"0\n"
    })
    .await;
    assert!(stopped, "the command outlived its client's hang-up");
    let minted = c
        .client
        .mint_preview(&id, 8080, Some(600))
        .await
        .expect("a preview minted through n3");
    let listener = std::fs::read_to_string(c.state.path().join("preview.addr"))
        .expect("n3's preview listener");
    let opened = eventually_async(Duration::from_secs(10), || async {
        let page = reqwest::get(format!(
            "http://{}/p/{}/index.html",
            listener.trim(),
            minted.token
        ))
        .await;
        match page {
            Ok(page) => page.text().await.is_ok_and(|t| t == "via-n3\n"),
            Err(_) => false,
        }
    })
    .await;
    assert!(
        opened,
        "n3's preview listener never served n2's run: {}",
        c.log()
    );
    // A forged node proof is refused, whatever the token.
    let forged = reqwest::Client::new()
        .get(format!("{}/v1/runs/{id}", b.url))
        .bearer_auth(&b.token)
        .header("runbox-node-proof", "n1 0 00")
        .send()
        .await
        .expect("request");
    assert_eq!(forged.status().as_u16(), 401);
    // The route previews come to from other nodes takes no client token:
    // without a node proof that holds, nothing reaches the run.
    for proof in [None, Some("n3 0 00")] {
        let mut relayed = reqwest::Client::new()
            .get(format!(
                "{}/v1/fleet/preview/p/{}/index.html",
                b.url, minted.token
            ))
            .bearer_auth(&b.token);
        if let Some(proof) = proof {
            relayed = relayed.header("runbox-node-proof", proof);
        }
        let refused = relayed.send().await.expect("request");
        assert_eq!(refused.status().as_u16(), 401, "{proof:?}");
    }
    // A tenant reaches its run through any node; another tenant does not.
    // (The operator's run here: a tenant token is refused as for a run
    // that does not exist.)
    let acme = a
        .client
        .create_tenant(&runbox_types::CreateTenantRequest {
            name: "acme".into(),
            ..Default::default()
        })
        .await
        .expect("tenant");
    let acme_on_a = runbox_client::Client::new(&a.url, acme.token.clone()).expect("client");
    let refused = eventually_async(Duration::from_secs(10), || async {
        acme_on_a
            .get_run(&id)
            .await
            .is_err_and(|e| e.to_string().contains("run_not_found"))
    })
    .await;
    assert!(refused);
    // Deleted through n1.
    let doomed = b.create().await;
    let doomed_id = doomed.id.to_string();
    let reached = eventually_async(Duration::from_secs(10), || async {
        a.client.get_run(&doomed_id).await.is_ok()
    })
    .await;
    assert!(reached);
    a.client
        .delete_run(&doomed_id)
        .await
        .expect("delete through n1");
    assert!(b.client.get_run(&doomed_id).await.is_err());
    // An exec streaming through n1 when n2 dies: the client's stream
    // breaks (the relay resets it) instead of ending as if it were whole.
    let mut stream = reqwest::Client::new()
        .post(format!("{}/v1/runs/{id}/exec", a.url))
        .bearer_auth(&a.token)
        .header("accept", "text/event-stream")
        .json(&serde_json::json!({"cmd": ["sh", "-c", "echo started; sleep 60"]}))
        .send()
        .await
        .expect("an exec through n1");
    assert!(stream.status().is_success(), "{}", stream.status());
    let mut seen = Vec::new();
    while !String::from_utf8_lossy(&seen).contains("started") {
        let chunk = tokio::time::timeout(Duration::from_secs(10), stream.chunk())
            .await
            .expect("the exec's first output in time")
            .expect("the stream")
            .expect("more of the stream");
        seen.extend_from_slice(&chunk);
    }
    // Its node killed: the stream breaks, and once the node is gone its
    // run answers a clear 503.
    b.kill9();
    let ended = tokio::time::timeout(Duration::from_secs(20), async {
        loop {
            match stream.chunk().await {
                Ok(Some(chunk)) => seen.extend_from_slice(&chunk),
                Ok(None) => return Ok(()),
                Err(e) => return Err(e),
            }
        }
    })
    .await
    .expect("the stream ends once n2 is killed");
    // A reset, as a client connected to n2 itself would have seen (not a
    // close: a half-read chunked body is an error either way, but the
    // SDKs tell a vanished peer by the reset).
    let broken = ended.expect_err("the stream through n1 ended cleanly after n2 died");
    let reset = {
        let mut source: Option<&(dyn std::error::Error + 'static)> = Some(&broken);
        let mut found = false;
        while let Some(e) = source {
            found |= e
                .downcast_ref::<std::io::Error>()
                .is_some_and(|io| io.kind() == std::io::ErrorKind::ConnectionReset);
            source = e.source();
        }
        found
    };
    assert!(reset, "not a reset: {broken:?}");
    assert!(!String::from_utf8_lossy(&seen).contains("event: exit"));
    let said = eventually_async(Duration::from_secs(15), || async {
        a.client
            .get_run(&id)
            .await
            .is_err_and(|e| e.to_string().contains("node_unavailable"))
    })
    .await;
    assert!(said, "{:?}", a.client.get_run(&id).await);
    let err = a.client.get_run(&id).await.expect_err("n2 is gone");
    assert!(err.to_string().contains("n2"), "{err}");
    b.spawn().await;
    b.client.delete_run(&id).await.expect("delete");
}

/// The unmodified E2B Python SDK (pinned in compat/e2b), in the virtual
/// environment `scripts/test-e2b` makes: made here when it is not there yet,
/// once per test process (two tests of this file use it, and a venv half
/// made by one has its `python` before its `pip`).
fn e2b_python() -> std::path::PathBuf {
    static PYTHON: std::sync::OnceLock<std::path::PathBuf> = std::sync::OnceLock::new();
    PYTHON.get_or_init(make_e2b_python).clone()
}

fn make_e2b_python() -> std::path::PathBuf {
    let root = runbox_e2e::workspace_root();
    let venv = root.join("target/e2benv");
    let python = venv.join("bin/python");
    let run = |cmd: &mut Command| {
        let status = cmd.status().expect("running a setup command");
        assert!(status.success(), "{cmd:?} failed");
    };
    if !python.exists() {
        run(Command::new("python3").arg("-m").arg("venv").arg(&venv));
    }
    let has_sdk = Command::new(&python)
        .args(["-c", "import e2b"])
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    if !has_sdk {
        run(Command::new(venv.join("bin/pip"))
            .args(["install", "-q", "--disable-pip-version-check", "-r"])
            .arg(root.join("compat/e2b/python/requirements.txt")));
    }
    python
}

/// Runs `script` with the E2B SDK against the node at `url`: its stdout.
fn e2b_script(python: &std::path::Path, url: &str, token: &str, script: &str) -> String {
    let out = Command::new(python)
        .args(["-c", script])
        .env("E2B_API_KEY", token)
        .env("E2B_API_URL", url)
        .env("E2B_SANDBOX_URL", url)
        .stdin(Stdio::null())
        .output()
        .expect("running the E2B SDK");
    assert!(
        out.status.success(),
        "the E2B SDK failed: {}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).trim().to_owned()
}

/// Runs ES module `script` with the E2B JavaScript SDK (compat/e2b/js's,
/// installed as `scripts/test-e2b` installs it) against the node at `url`,
/// with `SANDBOX_ID` set to `id`: its stdout.
fn e2b_js(url: &str, token: &str, id: &str, script: &str) -> String {
    let dir = runbox_e2e::workspace_root().join("compat/e2b/js");
    if !dir.join("node_modules/e2b").exists() {
        let status = Command::new("npm")
            .args(["ci", "--no-audit", "--no-fund", "--loglevel=error"])
            .current_dir(&dir)
            .status()
            .expect("running npm ci");
        assert!(status.success(), "npm ci failed");
    }
    let out = Command::new("node")
        .args(["--input-type=module", "-e", script])
        .current_dir(&dir)
        .env("E2B_API_KEY", token)
        .env("E2B_API_URL", url)
        .env("E2B_SANDBOX_URL", url)
        .env("SANDBOX_ID", id)
        .stdin(Stdio::null())
        .output()
        .expect("running node");
    assert!(
        out.status.success(),
        "the E2B JavaScript SDK failed: {}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).trim().to_owned()
}

#[tokio::test(flavor = "multi_thread")]
async fn the_e2b_sdk_reaches_a_sandbox_through_a_node_that_does_not_hold_it() {
    let python = e2b_python();
    let pg = PgServer::start();
    let (a, b) = tokio::join!(node(&pg, "n1", &["--max-runs", "1"]), node(&pg, "n2", &[]));
    // Made through n1 (and kept there: room on both is a tie).
    let id = e2b_script(
        &python,
        &a.url,
        &a.token,
        "from e2b import Sandbox\nprint(Sandbox.create(timeout=300, secure=True).sandbox_id)",
    );
    let run = a
        .client
        .get_run(&id)
        .await
        .expect("the sandbox is n1's run");
    assert_eq!(run.server, "n1");
    // Everything else through n2, with both SDKs: connect (control
    // plane), commands and files (envd, by the E2b-Sandbox-Id header), a
    // server in it by host name, then kill.
    let script = format!(
        r#"
from e2b import Sandbox
s = Sandbox.connect("{id}")
r = s.commands.run("echo hello from the sandbox")
assert r.stdout == "hello from the sandbox\n", r
s.files.write("/tmp/through.txt", "written through n2")
assert s.files.read("/tmp/through.txt") == "written through n2"
# A signed URL names no sandbox: n2 finds the one whose token signed it
# (n1's) and sends it there.
import urllib.request
url = s.download_url("/tmp/through.txt")
assert "signature=" in url, url
assert urllib.request.urlopen(url).read() == b"written through n2", url
forged = url.replace("signature=v1_", "signature=v1_x")
try:
    urllib.request.urlopen(forged)
    raise AssertionError("a forged signature was accepted")
except urllib.error.HTTPError as e:
    assert e.code == 401, e.code
s.commands.run("mkdir -p /tmp/www && echo served > /tmp/www/index.html")
s.commands.run("httpd -f -p 8080 -h /tmp/www", background=True)
assert s.is_running()
# A snapshot is taken on n1; n2 lists it with the fleet's and deletes it.
snap = s.create_snapshot()
listed = lambda: [x.snapshot_id for x in Sandbox.list_snapshots(sandbox_id="{id}").next_items()]
assert snap.snapshot_id in listed(), listed()
Sandbox.delete_snapshot(snap.snapshot_id)
assert snap.snapshot_id not in listed(), listed()
print("ok")
"#
    );
    assert_eq!(e2b_script(&python, &b.url, &b.token, &script), "ok");
    // The JavaScript SDK likewise.
    let js = r#"
import { Sandbox } from "e2b";
const s = await Sandbox.connect(process.env.SANDBOX_ID);
const r = await s.commands.run("echo from javascript");
if (r.stdout !== "from javascript\n") throw new Error(JSON.stringify(r));
await s.files.write("/tmp/js.txt", "javascript through n2");
if ((await s.files.read("/tmp/js.txt")) !== "javascript through n2") throw new Error("read");
console.log("ok");
"#;
    assert_eq!(e2b_js(&b.url, &b.token, &id, js), "ok");
    let by_host = eventually_async(Duration::from_secs(10), || async {
        let answer = reqwest::Client::new()
            .get(format!("{}/index.html", b.url))
            .header("host", format!("8080-{id}.e2b.test"))
            .send()
            .await;
        match answer {
            Ok(answer) => answer.text().await.is_ok_and(|t| t == "served\n"),
            Err(_) => false,
        }
    })
    .await;
    assert!(
        by_host,
        "the sandbox's port never answered through n2: {}",
        b.log()
    );
    // A create through n1, which is full, lands on n2.
    let second = e2b_script(
        &python,
        &a.url,
        &a.token,
        "from e2b import Sandbox\nprint(Sandbox.create(timeout=300).sandbox_id)",
    );
    let placed = a.client.get_run(&second).await.expect("the second sandbox");
    assert_eq!(placed.server, "n2");
    let kill = format!(
        "from e2b import Sandbox\nfor i in ['{id}', '{second}']:\n    assert Sandbox.connect(i).kill()\nprint('killed')"
    );
    assert_eq!(e2b_script(&python, &b.url, &b.token, &kill), "killed");
    assert_eq!(
        b.client.get_run(&second).await.map(|r| r.server).ok(),
        None,
        "the second sandbox is gone"
    );
    let gone = a.client.get_run(&id).await.expect_err("killed through n2");
    assert!(gone.to_string().contains("not_found"), "{gone}");
}

/// Node `node` of `pg`'s fleet joined from this process (no daemon).
async fn probe(pg: &PgServer, node: &str) -> std::sync::Arc<runbox_fleet::Cluster> {
    pg.probe(node, KEY.as_bytes(), 1)
        .await
        .unwrap_or_else(|e| panic!("{node} could not join: {e}"))
}

#[tokio::test(flavor = "multi_thread")]
async fn singleton_work_has_one_holder_at_a_time_and_a_growing_fence() {
    use runbox_fleet::Fleet;
    let pg = PgServer::start();
    let join = |node: &'static str| probe(&pg, node);
    let (p1, p2) = tokio::join!(join("p1"), join("p2"));
    let hold = Duration::from_secs(1);
    let take = |node: &std::sync::Arc<runbox_fleet::Cluster>| {
        let node = node.clone();
        async move { node.singleton("a sweep", hold).await.expect("the database") }
    };
    assert_eq!(take(&p1).await, Some(1));
    assert_eq!(take(&p2).await, None, "p1 holds it");
    assert_eq!(
        take(&p1).await,
        Some(1),
        "the holder keeps it and its number"
    );
    // Once p1 stops taking it, it runs out and p2 takes it, fenced anew.
    tokio::time::sleep(Duration::from_millis(1300)).await;
    assert_eq!(take(&p2).await, Some(2));
    assert_eq!(take(&p1).await, None, "p2 holds it now");
    // Each node's catalog sweep took its own lease at start: one holder.
    assert_eq!(
        pg.psql("SELECT count(*) FROM runbox_singletons WHERE name = 'catalog sweep'"),
        "1"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn a_cells_pool_set_is_every_node_of_the_cells() {
    use runbox_types::{PoolSet, PoolSpec};
    let pg = PgServer::start();
    let (a, b, c) = tokio::join!(
        node(&pg, "n1", &["--cell", "blue"]),
        node(&pg, "n2", &["--cell", "blue"]),
        node(&pg, "n3", &[])
    );
    let set = PoolSet {
        pools: vec![PoolSpec {
            image: "base".into(),
            network: None,
            size: None,
            warm: Some(1),
            warm_max: None,
            warmup: None,
        }],
    };
    a.client.set_pools(&set).await.expect("PUT /v1/pools on n1");
    // n2, of the same cell, takes it; n3, of none, keeps its own (none).
    let images = |list: runbox_types::PoolList| -> Vec<String> {
        list.pools.into_iter().map(|p| p.image).collect()
    };
    let taken = eventually_async(Duration::from_secs(15), || async {
        b.client.pools().await.is_ok_and(|l| images(l) == ["base"])
    })
    .await;
    assert!(taken, "n2 never took its cell's pools: {}", b.log());
    assert!(images(c.client.pools().await.expect("n3's pools")).is_empty());
    // Emptied on n2: n1 follows.
    b.client
        .set_pools(&PoolSet { pools: Vec::new() })
        .await
        .expect("PUT /v1/pools on n2");
    let emptied = eventually_async(Duration::from_secs(15), || async {
        a.client.pools().await.is_ok_and(|l| l.pools.is_empty())
    })
    .await;
    assert!(emptied, "n1 kept its pools: {}", a.log());
    assert_eq!(
        pg.psql("SELECT generation FROM runbox_pool_sets WHERE cell = 'blue'"),
        "2"
    );
    // A bad cell name stops the start before anything is reached.
    let err = serve_fails(
        &[
            "--cluster-db",
            &pg.url(),
            "--node-id",
            "n9",
            "--advertise",
            "127.0.0.1:9",
            "--cell",
            "Blue!",
        ],
        &[("RUNBOX_CLUSTER_KEY", KEY)],
    );
    assert!(err.contains("--cell"), "{err}");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_checkpoint_in_a_shared_bucket_is_made_into_a_run_by_any_node() {
    use runbox_types::{CheckpointRequest, CreateRunRequest};
    let pg = PgServer::start();
    let s3 = runbox_e2e::S3Server::start().await;
    let location = format!("s3://{}/fleet/checkpoints", s3.bucket);
    let env = s3.env();
    let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (*k, v.as_str())).collect();
    let store = ["--checkpoint-store", location.as_str()];
    let small = [&store[..], &["--max-runs", "1"]].concat();
    let (a, b) = tokio::join!(
        node_with(&pg, "n1", &store, &env),
        node_with(&pg, "n2", &small, &env)
    );
    let parent = a.create().await.id.to_string();
    let wrote = a.sh(&parent, "echo kept-in-s3 > /work/blob.txt").await;
    assert_eq!(wrote.exit.exit_code, 0);
    let checkpoint = a
        .client
        .checkpoint_run(&parent, &CheckpointRequest::default())
        .await
        .expect("a checkpoint on n1");
    // Through n2: the bucket is the fleet's, so n2 makes the run itself.
    let run = b
        .client
        .create_run(&CreateRunRequest {
            checkpoint: Some(checkpoint.id),
            ..Default::default()
        })
        .await
        .expect("a run from n1's checkpoint, through n2");
    assert_eq!(run.server, "n2");
    let out = b.sh(&run.id.to_string(), "cat /work/blob.txt").await;
    assert_eq!(out.stdout, b"kept-in-s3\n");
    // Each node's row names the bucket, and the two list the checkpoint
    // once each.
    let named = eventually_async(Duration::from_secs(10), || async {
        pg.psql(&format!(
            "SELECT count(*) FROM runbox_nodes WHERE checkpoint_store = '{location}'"
        )) == "2"
    })
    .await;
    assert!(named, "the nodes' rows never named their bucket");
    for daemon in [&a, &b] {
        let listed = daemon.client.list_checkpoints().await.expect("list");
        let ids: Vec<_> = listed.checkpoints.iter().map(|c| c.id).collect();
        assert_eq!(ids, [checkpoint.id]);
    }
    // n2 is full now: a second run from the checkpoint, asked of n2, is
    // made on n1, which shares the bucket.
    let second = b
        .client
        .create_run(&CreateRunRequest {
            checkpoint: Some(checkpoint.id),
            ..Default::default()
        })
        .await
        .expect("a run from the checkpoint, n2 full");
    assert_eq!(second.server, "n1");
    let out = b.sh(&second.id.to_string(), "cat /work/blob.txt").await;
    assert_eq!(out.stdout, b"kept-in-s3\n");
    a.client
        .delete_run(&second.id.to_string())
        .await
        .expect("delete");
    // One node at a time sweeps the shared bucket.
    let swept = eventually_async(Duration::from_secs(10), || async {
        pg.psql("SELECT count(*) FROM runbox_singletons WHERE name LIKE 'checkpoint sweep%'") == "1"
    })
    .await;
    assert!(swept);
    for (daemon, id) in [(&a, parent), (&b, run.id.to_string())] {
        daemon.client.delete_run(&id).await.expect("delete");
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn checkpoints_usage_and_e2b_volumes_of_one_node_are_answered_by_any() {
    use runbox_types::{CheckpointRequest, CreateRunRequest, ErrorCode};
    let pg = PgServer::start();
    // Each node's checkpoint store is a directory of its own.
    let (a, b) = tokio::join!(node(&pg, "n1", &[]), node(&pg, "n2", &[]));
    let parent = a.create().await.id.to_string();
    let other = b.create().await.id.to_string();
    // Usage sums every node's journal, through either node.
    for daemon in [&a, &b] {
        let report = daemon.client.usage(Some("1h"), None).await.expect("usage");
        assert_eq!(report.nodes, ["n1", "n2"]);
        let operator = report.tenants.get("").expect("the operator's usage");
        assert_eq!(operator.events.get("create"), Some(&2), "{report:?}");
        let none = daemon
            .client
            .usage(None, Some("nobody"))
            .await
            .expect("usage of a tenant without runs");
        assert!(
            none.tenants.values().all(|t| t.events.is_empty()),
            "{none:?}"
        );
    }
    // A checkpoint in n1's store: listed, read, made into a run and
    // deleted through n2.
    let wrote = a.sh(&parent, "echo on-n1 > /work/blob.txt").await;
    assert_eq!(wrote.exit.exit_code, 0);
    let checkpoint = a
        .client
        .checkpoint_run(&parent, &CheckpointRequest::default())
        .await
        .expect("a checkpoint on n1");
    let listed = b.client.list_checkpoints().await.expect("n2's list");
    let named: Vec<_> = listed
        .checkpoints
        .iter()
        .map(|c| (c.id, c.server.as_str()))
        .collect();
    assert_eq!(named, [(checkpoint.id, "n1")]);
    let id = checkpoint.id.to_string();
    assert_eq!(
        b.client
            .get_checkpoint(&id)
            .await
            .expect("through n2")
            .server,
        "n1"
    );
    let run = b
        .client
        .create_run(&CreateRunRequest {
            checkpoint: Some(checkpoint.id),
            ..Default::default()
        })
        .await
        .expect("a run from n1's checkpoint, asked of n2");
    assert_eq!(run.server, "n1");
    let out = b.sh(&run.id.to_string(), "cat /work/blob.txt").await;
    assert_eq!(out.stdout, b"on-n1\n");
    b.client.delete_checkpoint(&id).await.expect("through n2");
    let gone = a.client.get_checkpoint(&id).await.expect_err("deleted");
    assert_eq!(gone.code(), Some(ErrorCode::CheckpointNotFound), "{gone}");
    let gone = b.client.get_checkpoint(&id).await.expect_err("deleted");
    assert_eq!(gone.code(), Some(ErrorCode::CheckpointNotFound), "{gone}");
    // E2B's volumes: made on n1, listed, read, written and destroyed
    // through n2, with the volume's own token for its content.
    use reqwest::Method;
    let http = reqwest::Client::new();
    // E2B's control plane, with the API key; the content API, with a token.
    let control = |d: &TestDaemon, method: Method, path: &str| {
        http.request(method, format!("{}{path}", d.url))
            .header("X-API-Key", &d.token)
    };
    let json = |request: reqwest::RequestBuilder| async move {
        let answer = request.send().await.expect("an answer");
        answer.json::<serde_json::Value>().await.expect("json")
    };
    let made =
        json(control(&a, Method::POST, "/volumes").json(&serde_json::json!({"name": "shared"})))
            .await;
    let volume = made["volumeID"].as_str().expect("an id").to_owned();
    let token = made["token"].as_str().expect("a token").to_owned();
    let file = |d: &TestDaemon, method: Method, token: &str| {
        http.request(
            method,
            format!("{}/volumecontent/{volume}/file?path=/hello.txt", d.url),
        )
        .bearer_auth(token)
    };
    let listed = json(control(&b, Method::GET, "/volumes")).await;
    assert_eq!(
        listed,
        serde_json::json!([{"volumeID": volume, "name": "shared"}])
    );
    let info = json(control(&b, Method::GET, &format!("/volumes/{volume}"))).await;
    assert_eq!(info["token"].as_str(), Some(token.as_str()));
    let put = file(&b, Method::PUT, &token)
        .body("written through n2")
        .send()
        .await
        .expect("write");
    assert!(put.status().is_success(), "{}", put.status());
    let wrong = file(&b, Method::GET, "not-the-token")
        .send()
        .await
        .expect("read");
    assert_eq!(wrong.status(), reqwest::StatusCode::UNAUTHORIZED);
    let read = file(&a, Method::GET, &token).send().await.expect("read");
    assert_eq!(read.text().await.expect("body"), "written through n2");
    let destroyed = control(&b, Method::DELETE, &format!("/volumes/{volume}"))
        .send()
        .await
        .expect("destroy");
    assert_eq!(destroyed.status(), reqwest::StatusCode::NO_CONTENT);
    let missing = control(&a, Method::GET, &format!("/volumes/{volume}"))
        .send()
        .await
        .expect("info");
    assert_eq!(missing.status(), reqwest::StatusCode::NOT_FOUND);
    // Lease generations: taken and given up through n1 on n2's run, the
    // catalog keeps the highest ever issued, and n1 answers with it.
    let first = a
        .client
        .acquire_lease(&other, "alice", None)
        .await
        .expect("a lease through n1");
    a.client
        .release_lease(&other, &(&first).into())
        .await
        .expect("released through n1");
    let second = a
        .client
        .acquire_lease(&other, "bob", None)
        .await
        .expect("a lease through n1");
    assert_eq!(second.generation, first.generation + 1);
    a.client
        .release_lease(&other, &(&second).into())
        .await
        .expect("released through n1");
    let kept = eventually_async(Duration::from_secs(10), || async {
        pg.psql(&format!(
            "SELECT lease_generation FROM runbox_runs WHERE id = '{other}'"
        )) == second.generation.to_string()
    })
    .await;
    assert!(kept, "the catalog never kept the lease generation");
    let listed = a.client.list_runs().await.expect("n1's list");
    let seen = listed
        .runs
        .iter()
        .find(|r| r.id.to_string() == other)
        .expect("listed");
    assert_eq!(seen.lease_generation, Some(second.generation));
    assert_eq!(seen.lease, None);
    for (daemon, id) in [(&a, parent), (&b, other), (&a, run.id.to_string())] {
        daemon.client.delete_run(&id).await.expect("delete");
    }
}

/// Three nodes sharing a SeaweedFS bucket as their checkpoint store;
/// `extra[i]` are node `n{i+1}`'s own arguments.
async fn bucket_fleet(
    pg: &PgServer,
    s3: &runbox_e2e::S3Server,
    extra: [&[&str]; 3],
) -> (TestDaemon, TestDaemon, TestDaemon) {
    let location = format!("s3://{}/fleet/checkpoints", s3.bucket);
    let env = s3.env();
    let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (*k, v.as_str())).collect();
    let args = |i: usize| [&["--checkpoint-store", location.as_str()][..], extra[i]].concat();
    let (a0, a1, a2) = (args(0), args(1), args(2));
    tokio::join!(
        node_with(pg, "n1", &a0, &env),
        node_with(pg, "n2", &a1, &env),
        node_with(pg, "n3", &a2, &env)
    )
}

/// The node the catalog names as run `id`'s owner.
fn owner(pg: &PgServer, id: &str) -> String {
    pg.psql(&format!("SELECT node FROM runbox_runs WHERE id = '{id}'"))
}

#[tokio::test(flavor = "multi_thread")]
async fn a_run_moves_to_another_node_with_its_files_token_lease_and_ttl() {
    use runbox_types::CreateRunRequest;
    let pg = PgServer::start();
    let s3 = runbox_e2e::S3Server::start().await;
    let (a, b, c) = bucket_fleet(&pg, &s3, [&[], &[], &[]]).await;
    let made = a
        .create_with(CreateRunRequest {
            image: "base".into(),
            labels: Some([("team".to_owned(), "infra".to_owned())].into()),
            ..Default::default()
        })
        .await;
    assert_eq!(made.server, "n1");
    let id = made.id.to_string();
    let wrote = a
        .sh(
            &id,
            "mkdir -p /work/tree/sub && echo one > /work/tree/a && echo two > /work/tree/sub/b \
             && chown 1000:1000 /work/tree/sub/b && chmod 640 /work/tree/sub/b \
             && ln -s sub/b /work/tree/link && echo changed > /etc/motd",
        )
        .await;
    assert_eq!(
        wrote.exit.exit_code,
        0,
        "{}",
        String::from_utf8_lossy(&wrote.stderr)
    );
    let lease = a
        .client
        .acquire_lease(&id, "alice", Some(600))
        .await
        .expect("a lease");
    let before = a.client.get_run(&id).await.expect("get");
    // Asked of n3, which does not hold it: sent to n1, moved to n2.
    let moved = c
        .client
        .move_run(&id, Some("n2".into()))
        .await
        .expect("a move to n2");
    assert_eq!(moved.server, "n2");
    assert_eq!(moved.status, runbox_types::RunStatus::Running);
    assert_eq!(owner(&pg, &id), "n2");
    assert_eq!(
        pg.psql(&format!(
            "SELECT from_node || '>' || to_node || ':' || reason FROM runbox_moves WHERE run = '{id}'"
        )),
        "n1>n2:move"
    );
    let after = b.client.get_run(&id).await.expect("get on n2");
    assert_eq!(after.labels, before.labels);
    assert_eq!(after.expires_at, before.expires_at);
    assert_eq!(after.lease.as_ref().map(|l| &l.holder), Some(&lease.holder));
    assert_eq!(after.lease_generation, before.lease_generation);
    // Its lease, labels and TTL came along; the lease's holder renews it
    // on the new node.
    let credential = (&lease).into();
    b.client
        .renew_lease(&id, &credential, Some(600))
        .await
        .expect("the lease, renewed on the new node");
    b.client
        .release_lease(&id, &credential)
        .await
        .expect("the lease, released");
    // Its files, owners, modes and links too.
    let out = b
        .sh(
            &id,
            "cat /work/tree/a /work/tree/link /etc/motd && stat -c '%u:%g %a' /work/tree/sub/b \
             && readlink /work/tree/link",
        )
        .await;
    assert_eq!(
        String::from_utf8_lossy(&out.stdout),
        "one\ntwo\nchanged\n1000:1000 640\nsub/b\n"
    );
    // The run's own token drives it through any node, n1 included.
    let token = made.token.clone().expect("a run token");
    let by_token = runbox_client::Client::new(&a.url, token).expect("client");
    let got = by_token
        .get_run(&id)
        .await
        .expect("the run, by its token, via n1");
    assert_eq!(got.server, "n2");
    // n1 kept nothing of it: its list (the catalog's) names n2 once.
    let listed = a.client.list_runs().await.expect("list");
    let found: Vec<_> = listed.runs.iter().filter(|r| r.id == made.id).collect();
    assert_eq!(found.len(), 1);
    assert_eq!(found[0].server, "n2");
    assert!(a
        .log()
        .contains("this node's copy of a run that moved is gone"));
    // Each node's usage journal has its part, named by node.
    for (daemon, event, node) in [(&a, "archive", "n1"), (&b, "restore", "n2")] {
        let journal = eventually_async(Duration::from_secs(5), || async {
            std::fs::read_to_string(daemon.state.path().join("usage.jsonl"))
                .unwrap_or_default()
                .lines()
                .any(|l| {
                    l.contains(&id)
                        && l.contains(&format!("\"event\":\"{event}\""))
                        && l.contains(&format!("\"node\":\"{node}\""))
                })
        })
        .await;
        assert!(journal, "no {event} event of {node} in its usage journal");
    }
    // Bad moves say why.
    let to_self = b.client.move_run(&id, Some("n2".into())).await.unwrap_err();
    assert_eq!(
        to_self.code(),
        Some(runbox_types::ErrorCode::BadRequest),
        "{to_self}"
    );
    let nowhere = b.client.move_run(&id, Some("n9".into())).await.unwrap_err();
    assert_eq!(
        nowhere.code(),
        Some(runbox_types::ErrorCode::NotMovable),
        "{nowhere}"
    );
    let tenantless = runbox_client::Client::new(&b.url, made.token.clone().unwrap()).unwrap();
    let refused = tenantless.move_run(&id, None).await.unwrap_err();
    assert_eq!(
        refused.code(),
        Some(runbox_types::ErrorCode::Forbidden),
        "{refused}"
    );
    // And back, to whichever node placement picks (n2 is not a choice).
    let back = c.client.move_run(&id, None).await.expect("a move anywhere");
    assert_ne!(back.server, "n2");
    let out = c.sh(&id, "cat /work/tree/sub/b").await;
    assert_eq!(out.stdout, b"two\n");
    c.client.delete_run(&id).await.expect("delete");
    let gone = eventually_async(Duration::from_secs(10), || async {
        pg.psql(&format!("SELECT status FROM runbox_runs WHERE id = '{id}'")) == "gone"
    })
    .await;
    assert!(gone, "the moved run's delete never reached the catalog");
}

/// Lets a stopped process go on when dropped (a failed test included).
struct Continue(String);

impl Drop for Continue {
    fn drop(&mut self) {
        let _ = Command::new("kill").args(["-CONT", &self.0]).status();
    }
}

/// Creates a run on `node`, leaves `kept` (owned by uid 1000, with xattr
/// `user.kept`) in /work, and archives it: its id.
async fn archived_run(node: &TestDaemon, kept: &str) -> String {
    let made = node.create().await;
    let id = made.id.to_string();
    let wrote = node
        .sh(
            &id,
            &format!("echo {kept} > /work/kept && chown 1000:1000 /work/kept"),
        )
        .await;
    assert_eq!(wrote.exit.exit_code, 0);
    let upper = node.state.path().join("runs").join(&id).join("disk/upper");
    runbox_e2e::set_xattr(&upper.join("work/kept"), "user.kept", kept.as_bytes());
    let archived = node.client.archive_run(&id).await.expect("archive");
    assert_eq!(archived.status, runbox_types::RunStatus::Archived);
    id
}

#[tokio::test(flavor = "multi_thread")]
async fn an_archived_run_of_a_dead_node_wakes_on_the_best_node_and_its_old_node_ends_its_copy() {
    let pg = PgServer::start();
    let s3 = runbox_e2e::S3Server::start().await;
    let (mut a, b, c) = bucket_fleet(&pg, &s3, [&[], &[], &["--max-runs", "0"]]).await;
    let id = archived_run(&a, "from-n1").await;
    assert_eq!(owner(&pg, &id), "n1");
    assert_eq!(
        pg.psql(&format!(
            "SELECT record IS NOT NULL AND record NOT LIKE '%from-n1%' FROM runbox_runs WHERE id = '{id}'"
        )),
        "t",
        "the catalog carries the run's record, sealed"
    );
    a.kill9();
    assert!(sees(&b, "n1", NodeState::Gone, Duration::from_secs(20)).await);
    // Asked of n3, which has no room: restored on n2, the best node that
    // shares the bucket; nothing waits for n1.
    let out = c.sh(&id, "cat /work/kept && stat -c %u /work/kept").await;
    assert_eq!(String::from_utf8_lossy(&out.stdout), "from-n1\n1000\n");
    assert_eq!(owner(&pg, &id), "n2");
    // Its xattr came with it: in the restored run's layers on n2.
    let layers = std::fs::read_dir(b.state.path().join("images/layers"))
        .expect("n2's layers")
        .flatten()
        .map(|e| e.path().join("work/kept"));
    let upper = b
        .state
        .path()
        .join("runs")
        .join(&id)
        .join("disk/upper/work/kept");
    let xattr = std::iter::once(upper)
        .chain(layers)
        .filter(|p| p.exists())
        .find_map(|p| runbox_e2e::xattr(&p, "user.kept"));
    assert_eq!(xattr.as_deref(), Some(&b"from-n1"[..]));
    assert_eq!(
        pg.psql(&format!(
            "SELECT from_node || '>' || to_node || ':' || reason FROM runbox_moves WHERE run = '{id}'"
        )),
        "n1>n2:node gone"
    );
    // n1 comes back: before it serves, it finds the run is n2's and ends
    // its own copy; asked for the run, it sends the call to n2.
    a.spawn().await;
    assert!(
        a.log()
            .contains("ended this node's copies of runs other nodes hold now"),
        "{}",
        a.log()
    );
    let got = a.client.get_run(&id).await.expect("the run, via n1");
    assert_eq!(got.server, "n2");
    assert_eq!(got.status, runbox_types::RunStatus::Running);
    let listed = a.client.list_runs().await.expect("list");
    assert_eq!(
        listed
            .runs
            .iter()
            .filter(|r| r.id.to_string() == id)
            .count(),
        1
    );
    a.client.delete_run(&id).await.expect("delete, via n1");
    drop(c);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_node_that_was_away_does_not_restore_an_archived_run_another_node_took_over() {
    let pg = PgServer::start();
    let s3 = runbox_e2e::S3Server::start().await;
    let (a, b, c) = bucket_fleet(&pg, &s3, [&[], &[], &["--max-runs", "0"]]).await;
    let id = archived_run(&a, "still-here").await;
    // n1 stops answering without dying (a pause, a partition): once it is
    // gone to the others, n2 takes the run over.
    let pid = a.pid().to_string();
    let stopped = Command::new("kill").args(["-STOP", &pid]).status();
    assert!(stopped.is_ok_and(|s| s.success()));
    let resume = Continue(pid);
    assert!(sees(&b, "n1", NodeState::Gone, Duration::from_secs(20)).await);
    let out = c.sh(&id, "cat /work/kept").await;
    assert_eq!(out.stdout, b"still-here\n");
    assert_eq!(owner(&pg, &id), "n2");
    drop(resume);
    // n1 still lists its copy until it looks; a wake sent to it directly
    // finds the run another node's (a retryable 503, the copy ended) or is
    // sent on to n2. Never restored on n1.
    match a.client.wake_run(&id).await {
        Ok(run) => assert_eq!(run.server, "n2"),
        Err(e) => assert_eq!(e.code(), Some(runbox_types::ErrorCode::RunMoved), "{e}"),
    }
    let settled = eventually_async(Duration::from_secs(20), || async {
        a.client
            .get_run(&id)
            .await
            .is_ok_and(|run| run.server == "n2")
    })
    .await;
    assert!(settled, "n1 never sent the run's calls on to n2");
    assert!(!a.log().contains("run restored"), "{}", a.log());
    let out = a.sh(&id, "cat /work/kept").await;
    assert_eq!(out.stdout, b"still-here\n");
    b.client.delete_run(&id).await.expect("delete");
}

#[tokio::test(flavor = "multi_thread")]
async fn drain_with_migrate_moves_every_run_off_the_node() {
    use runbox_types::{CreateRunRequest, CreateVolumeRequest, VolumeMountRequest};
    let pg = PgServer::start();
    let s3 = runbox_e2e::S3Server::start().await;
    let (a, b, c) = bucket_fleet(&pg, &s3, [&[], &[], &[]]).await;
    // Ten runs on n1, each with a file of its own; one of them asleep.
    let mut ids = Vec::new();
    for i in 0..10 {
        let id = a.create().await.id.to_string();
        let wrote = a.sh(&id, &format!("echo run-{i} > /work/own")).await;
        assert_eq!(wrote.exit.exit_code, 0);
        ids.push(id);
    }
    a.client.hibernate_run(&ids[9]).await.expect("hibernate");
    // And one that mounts a volume of n1's, which stays.
    a.client
        .create_volume(&CreateVolumeRequest {
            name: "local".into(),
            size_mb: None,
            labels: None,
        })
        .await
        .expect("a volume");
    let pinned = a
        .create_with(CreateRunRequest {
            image: "base".into(),
            volumes: Some(vec![VolumeMountRequest {
                name: "local".into(),
                path: None,
                mode: None,
            }]),
            ..Default::default()
        })
        .await
        .id;
    let drained = a.client.drain_migrate().await.expect("drain --migrate");
    assert!(drained.draining);
    let report = drained.migrated.expect("what the drain moved");
    assert_eq!(report.moved.len(), 10, "{report:?}");
    assert!(report
        .moved
        .iter()
        .all(|m| m.node == "n2" || m.node == "n3"));
    assert_eq!(report.failed.len(), 1, "{report:?}");
    assert_eq!(report.failed[0].id, pinned);
    assert_eq!(report.failed[0].error.code, "not_movable");
    assert!(report.failed[0].error.message.contains("local"));
    // Every moved run answers with its own file through any node, n1
    // included, and n1 holds only the pinned one.
    for (i, id) in ids.iter().enumerate() {
        let out = a.sh(id, "cat /work/own").await;
        assert_eq!(out.stdout, format!("run-{i}\n").as_bytes());
    }
    let run = c.client.get_run(&ids[0]).await.expect("get");
    assert_ne!(run.server, "n1");
    assert_eq!(
        pg.psql("SELECT count(*) FROM runbox_runs WHERE node = 'n1' AND status <> 'gone'"),
        "1"
    );
    // n1 takes no new runs: a create asked of it is made elsewhere.
    let made = a.create().await;
    assert_ne!(made.server, "n1");
    for id in ids.iter().chain([&made.id.to_string()]) {
        b.client.delete_run(id).await.expect("delete");
    }
    a.client
        .delete_run(&pinned.to_string())
        .await
        .expect("delete");
}

/// Whether an API error says "send the same call again": the run moved,
/// its node or the database is away for a moment, or it is being woken.
fn retryable(e: &runbox_client::ClientError) -> bool {
    use runbox_types::ErrorCode as C;
    matches!(
        e.code(),
        Some(C::RunMoved | C::NodeUnavailable | C::ClusterUnavailable | C::RunNotRunning)
    )
}

#[tokio::test(flavor = "multi_thread")]
async fn a_move_under_a_stream_of_execs_loses_none_and_runs_none_twice() {
    let pg = PgServer::start();
    let s3 = runbox_e2e::S3Server::start().await;
    let (a, b, c) = bucket_fleet(&pg, &s3, [&[], &[], &[]]).await;
    let id = a.create().await.id.to_string();
    const EXECS: usize = 40;
    // One client appends numbered lines through n3, one exec at a time,
    // sending an exec again only when the answer says to.
    let client = c.client.clone();
    let run = id.clone();
    let writer = tokio::spawn(async move {
        let mut retried = 0;
        for i in 0..EXECS {
            loop {
                let req = runbox_types::ExecRequest {
                    cmd: vec!["sh".into(), "-c".into(), format!("echo {i} >> /work/log")],
                    ..Default::default()
                };
                let answer = match client.exec(&run, &req).await {
                    Ok(stream) => stream.collect_output().await,
                    Err(e) => Err(e),
                };
                match answer {
                    Ok(out) => {
                        assert_eq!(out.exit.exit_code, 0, "exec {i}: {:?}", out.exit);
                        break;
                    }
                    Err(e) if retryable(&e) => {
                        retried += 1;
                        tokio::time::sleep(Duration::from_millis(100)).await;
                    }
                    Err(e) => panic!("exec {i}: {e}"),
                }
            }
        }
        retried
    });
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(
        !writer.is_finished(),
        "the execs ended before the move began"
    );
    let moved = b
        .client
        .move_run(&id, Some("n2".into()))
        .await
        .expect("move");
    assert_eq!(moved.server, "n2");
    let retried = writer.await.expect("the writer");
    let out = b.sh(&id, "cat /work/log").await;
    let expected: String = (0..EXECS).map(|i| format!("{i}\n")).collect();
    assert_eq!(
        String::from_utf8_lossy(&out.stdout),
        expected,
        "{retried} execs were sent again"
    );
    a.client.delete_run(&id).await.expect("delete");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_move_without_its_bucket_or_its_database_leaves_the_run_where_it_was() {
    let pg = PgServer::start();
    let mut s3 = runbox_e2e::S3Server::start().await;
    let (a, b, _c) = bucket_fleet(&pg, &s3, [&[], &[], &[]]).await;
    let id = a.create().await.id.to_string();
    let wrote = a.sh(&id, "echo stays > /work/kept").await;
    assert_eq!(wrote.exit.exit_code, 0);
    // The bucket cannot be reached: the archive fails, the run stays on
    // n1 (asleep, its disk there) and answers there.
    s3.stop();
    let err = b.client.move_run(&id, Some("n2".into())).await.unwrap_err();
    assert_eq!(
        err.code(),
        Some(runbox_types::ErrorCode::CheckpointStoreUnavailable),
        "{err}"
    );
    assert_eq!(owner(&pg, &id), "n1");
    let out = b.sh(&id, "cat /work/kept").await;
    assert_eq!(out.stdout, b"stays\n");
    assert_eq!(b.client.get_run(&id).await.expect("get").server, "n1");
    s3.spawn().await;
    // The database is away: nothing moves, nothing is archived.
    pg.stop();
    let err = a.client.move_run(&id, None).await.unwrap_err();
    assert_eq!(
        err.code(),
        Some(runbox_types::ErrorCode::ClusterUnavailable),
        "{err}"
    );
    let out = a.sh(&id, "cat /work/kept").await;
    assert_eq!(out.stdout, b"stays\n");
    assert_eq!(
        a.client.get_run(&id).await.expect("get").status,
        runbox_types::RunStatus::Running
    );
    pg.start_again();
    // And once both are back, the move goes through.
    let moved = eventually_async(Duration::from_secs(20), || async {
        a.client
            .move_run(&id, Some("n2".into()))
            .await
            .is_ok_and(|run| run.server == "n2")
    })
    .await;
    assert!(
        moved,
        "the move never went through once the database was back"
    );
    let out = a.sh(&id, "cat /work/kept").await;
    assert_eq!(out.stdout, b"stays\n");
    b.client.delete_run(&id).await.expect("delete");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_dead_nodes_runs_end_as_their_policy_says_and_none_comes_back_twice() {
    use runbox_types::{CheckpointRequest, CreateRunRequest, ErrorCode, OnNodeLoss, RunStatus};
    let pg = PgServer::start();
    let s3 = runbox_e2e::S3Server::start().await;
    let (mut a, b, _c) = bucket_fleet(&pg, &s3, [&[], &[], &[]]).await;
    // n1 holds an archived run; a running one with a checkpoint; a running
    // one whose policy is `lost`; a hibernated one with no checkpoint.
    let archived = archived_run(&a, "archived").await;
    let saved = a.create().await.id.to_string();
    assert_eq!(
        a.sh(&saved, "echo before > /work/f").await.exit.exit_code,
        0
    );
    let checkpoint = a
        .client
        .checkpoint_run(&saved, &CheckpointRequest::default())
        .await
        .expect("a checkpoint");
    assert_eq!(a.sh(&saved, "echo after > /work/g").await.exit.exit_code, 0);
    let doomed = a
        .create_with(CreateRunRequest {
            image: "base".into(),
            on_node_loss: Some(OnNodeLoss::Lost),
            ..Default::default()
        })
        .await
        .id
        .to_string();
    let sleeper = a.create().await.id.to_string();
    a.client.hibernate_run(&sleeper).await.expect("hibernate");
    a.kill9();
    let status = |id: &str| pg.psql(&format!("SELECT status FROM runbox_runs WHERE id = '{id}'"));
    let decided = eventually_async(Duration::from_secs(40), || async {
        status(&saved) == "archived" && status(&doomed) == "lost" && status(&sleeper) == "lost"
    })
    .await;
    assert!(
        decided,
        "saved {}, doomed {}, sleeper {}",
        status(&saved),
        status(&doomed),
        status(&sleeper)
    );
    assert_eq!(status(&archived), "archived");
    // The lost read so, with the reason; only a delete works.
    let lost = b.client.get_run(&doomed).await.expect("a lost run");
    assert_eq!(lost.status, RunStatus::Lost);
    assert!(
        lost.failure
            .as_deref()
            .unwrap_or("")
            .contains("onNodeLoss is lost"),
        "{lost:?}"
    );
    let asleep = b.client.get_run(&sleeper).await.expect("a lost run");
    assert_eq!(asleep.status, RunStatus::Lost);
    assert!(
        asleep
            .failure
            .as_deref()
            .unwrap_or("")
            .contains("no checkpoint"),
        "{asleep:?}"
    );
    let refused = b.client.wake_run(&doomed).await.unwrap_err();
    assert_eq!(refused.code(), Some(ErrorCode::RunLost), "{refused}");
    let listed = b.client.list_runs().await.expect("list");
    assert!(listed
        .runs
        .iter()
        .any(|r| r.id.to_string() == doomed && r.status == RunStatus::Lost));
    // The checkpointed run came back from its checkpoint, elsewhere: what
    // it wrote after that is gone, and it says so.
    let out = b
        .sh(&saved, "cat /work/f; test -e /work/g && echo g-too")
        .await;
    assert_eq!(String::from_utf8_lossy(&out.stdout), "before\n");
    let back = b.client.get_run(&saved).await.expect("the run");
    assert_ne!(back.server, "n1");
    let recovered = back.recovered.expect("how it came back");
    assert_eq!(recovered.checkpoint, checkpoint.id);
    assert_eq!(recovered.node, "n1");
    // The archived one wakes anywhere, as always.
    let out = b.sh(&archived, "cat /work/kept").await;
    assert_eq!(out.stdout, b"archived\n");
    // A lost run is deleted through any node.
    b.client
        .delete_run(&doomed)
        .await
        .expect("delete a lost run");
    assert_eq!(status(&doomed), "gone");
    // n1 comes back with copies of all of them: those that came back
    // elsewhere or were deleted end on it before it serves; the lost one
    // it still has comes back as it was, once.
    a.spawn().await;
    let log = a.log();
    for id in [&saved, &doomed] {
        assert!(
            log.lines()
                .any(|l| l.contains(id.as_str()) && l.contains("ending this node's copy")),
            "n1 kept its copy of {id}:\n{log}"
        );
    }
    let got = a.client.get_run(&saved).await.expect("via n1");
    assert_ne!(got.server, "n1");
    let gone = a.client.get_run(&doomed).await.unwrap_err();
    assert_eq!(gone.code(), Some(ErrorCode::RunNotFound), "{gone}");
    let revived = eventually_async(Duration::from_secs(10), || async {
        status(&sleeper) == "hibernated"
    })
    .await;
    assert!(
        revived,
        "the hibernated run n1 kept is {}",
        status(&sleeper)
    );
    let kept = a.client.get_run(&sleeper).await.expect("the run n1 kept");
    assert_eq!(
        (kept.server.as_str(), kept.status),
        ("n1", RunStatus::Hibernated)
    );
    for id in [&saved, &archived] {
        b.client.delete_run(id).await.expect("delete");
    }
    a.client.delete_run(&sleeper).await.expect("delete");
}

#[tokio::test(flavor = "multi_thread")]
async fn the_e2b_sdk_resumes_a_paused_sandbox_on_another_node_when_its_node_is_gone() {
    let python = e2b_python();
    let pg = PgServer::start();
    let s3 = runbox_e2e::S3Server::start().await;
    let (mut a, b, c) = bucket_fleet(&pg, &s3, [&[], &[], &["--max-runs", "0"]]).await;
    // Made and paused through n1, whose disk then goes to the bucket (as
    // `--archive-after-sec` would send it).
    let id = e2b_script(
        &python,
        &a.url,
        &a.token,
        "from e2b import Sandbox\ns = Sandbox.create(timeout=300)\n\
         s.files.write('/tmp/kept.txt', 'kept across nodes')\ns.pause()\nprint(s.sandbox_id)",
    );
    let archived = a.client.archive_run(&id).await.expect("archive");
    assert_eq!(archived.status, runbox_types::RunStatus::Archived);
    a.kill9();
    assert!(sees(&b, "n1", NodeState::Gone, Duration::from_secs(20)).await);
    // Resumed with the SDK through n3, which has no room: n2 restores it.
    let script = format!(
        "from e2b import Sandbox\ns = Sandbox.connect('{id}')\n\
         assert s.files.read('/tmp/kept.txt') == 'kept across nodes'\n\
         print(s.commands.run('echo resumed').stdout.strip())"
    );
    assert_eq!(e2b_script(&python, &c.url, &c.token, &script), "resumed");
    let run = b.client.get_run(&id).await.expect("the sandbox");
    assert_eq!(run.server, "n2");
    // The JavaScript SDK: paused through n3, archived on n2, and resumed
    // through n3 again, answered by n2.
    let pause = r#"
import { Sandbox } from "e2b";
const s = await Sandbox.connect(process.env.SANDBOX_ID);
await s.files.write("/tmp/js.txt", "javascript across nodes");
if ((await s.pause()) !== true) throw new Error("not paused");
console.log("paused");
"#;
    assert_eq!(e2b_js(&c.url, &c.token, &id, pause), "paused");
    let archived = b.client.archive_run(&id).await.expect("archive on n2");
    assert_eq!(archived.status, runbox_types::RunStatus::Archived);
    let resume = r#"
import { Sandbox } from "e2b";
const s = await Sandbox.connect(process.env.SANDBOX_ID);
if ((await s.files.read("/tmp/js.txt")) !== "javascript across nodes") throw new Error("read");
if ((await s.files.read("/tmp/kept.txt")) !== "kept across nodes") throw new Error("read");
const r = await s.commands.run("echo resumed");
console.log(r.stdout.trim());
"#;
    assert_eq!(e2b_js(&c.url, &c.token, &id, resume), "resumed");
    assert_eq!(
        b.client.get_run(&id).await.expect("the sandbox").status,
        runbox_types::RunStatus::Running
    );
    let kill = format!("from e2b import Sandbox\nassert Sandbox.kill('{id}')\nprint('killed')");
    assert_eq!(e2b_script(&python, &c.url, &c.token, &kill), "killed");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_state_directory_started_under_another_node_id_is_refused() {
    let pg = PgServer::start();
    let mut a = node(&pg, "n1", &[]).await;
    let id = a.create().await.id.to_string();
    let listed = eventually_async(Duration::from_secs(10), || async {
        owner(&pg, &id) == "n1"
    })
    .await;
    assert!(listed);
    a.terminate();
    let url = pg.url();
    let advertise = format!("127.0.0.1:{}", free_port());
    let stderr = serve_fails_in(
        a.state.path(),
        &[
            "--cluster-db",
            &url,
            "--node-id",
            "n9",
            "--advertise",
            &advertise,
        ],
        &[
            ("RUNBOX_CLUSTER_KEY", KEY),
            ("RUNBOX_CLUSTER_DB_PASSWORD", pg.password.as_str()),
        ],
    );
    assert!(
        stderr.contains("start this node with --node-id n1"),
        "{stderr}"
    );
    // Under its own id it serves its run again.
    a.spawn().await;
    let out = a.sh(&id, "echo back").await;
    assert_eq!(out.stdout, b"back\n");
    a.client.delete_run(&id).await.expect("delete");
}

/// Where `daemon` keeps volume `id`'s files.
fn volume_dir(daemon: &TestDaemon, id: &ulid::Ulid) -> std::path::PathBuf {
    daemon
        .state
        .path()
        .join("runs/.volumes")
        .join(id.to_string())
}

/// A mount of volume `name` at /volumes/`name`.
fn mount(name: &str) -> Vec<runbox_types::VolumeMountRequest> {
    vec![runbox_types::VolumeMountRequest {
        name: name.into(),
        path: None,
        mode: None,
    }]
}

/// Volume `name` of `size_mb` made on `node`, and a run there that mounts
/// it (to write into it).
async fn volume_and_writer(
    node: &TestDaemon,
    name: &str,
    size_mb: u64,
) -> (runbox_types::Volume, runbox_types::Run) {
    let volume = node
        .client
        .create_volume(&runbox_types::CreateVolumeRequest {
            name: name.into(),
            size_mb: Some(size_mb),
            ..Default::default()
        })
        .await
        .expect("a volume");
    let writer = node
        .create_with(runbox_types::CreateRunRequest {
            image: "base".into(),
            volumes: Some(mount(name)),
            ..Default::default()
        })
        .await;
    (volume, writer)
}

/// How volume `id`'s latest move ended, as the database has it.
fn volume_move(pg: &PgServer, id: &ulid::Ulid) -> String {
    pg.psql(&format!(
        "SELECT from_node || '>' || to_node || ':' || state FROM runbox_volume_moves \
         WHERE volume = '{id}' ORDER BY started_at DESC, move_id DESC LIMIT 1"
    ))
}

#[tokio::test(flavor = "multi_thread")]
async fn a_volume_moves_to_another_node_with_its_files_and_creates_follow_it() {
    use runbox_types::{CreateRunRequest, CreateVolumeRequest, ErrorCode};
    let pg = PgServer::start();
    let s3 = runbox_e2e::S3Server::start().await;
    let (a, b, c) = bucket_fleet(&pg, &s3, [&[], &[], &["--max-runs", "0"]]).await;
    let (volume, writer) = volume_and_writer(&a, "data", 64).await;
    let wid = writer.id.to_string();
    let wrote = a
        .sh(
            &wid,
            "set -e; cd /volumes/data; echo kept > a.txt; chown 1000:1000 a.txt; chmod 640 a.txt; \
             mkdir -p deep/er; echo deep > deep/er/f; ln -s a.txt link; ln a.txt hard; \
             head -c 3000000 /dev/urandom > bin.dat; md5sum bin.dat > sum",
        )
        .await;
    assert_eq!(wrote.exit.exit_code, 0, "{:?}", wrote.stderr);
    runbox_e2e::set_xattr(
        &volume_dir(&a, &volume.id).join("a.txt"),
        "user.runbox",
        b"kept",
    );
    // Mounted: it stays.
    let err = c
        .client
        .move_volume("data", Some("n2".into()))
        .await
        .unwrap_err();
    assert_eq!(err.code(), Some(ErrorCode::VolumeBusy), "{err}");
    a.client.delete_run(&wid).await.expect("delete the writer");
    // Nowhere it cannot go.
    for (node, code, says) in [
        ("n1", ErrorCode::BadRequest, "on node n1 already"),
        ("n9", ErrorCode::NotMovable, "no node \"n9\""),
        ("n3", ErrorCode::NotMovable, "node n3 is full"),
    ] {
        let err = a
            .client
            .move_volume("data", Some(node.into()))
            .await
            .unwrap_err();
        assert_eq!(err.code(), Some(code), "{node}: {err}");
        assert!(err.to_string().contains(says), "{node}: {err}");
    }
    // Asked of n3, which does not hold it (sent on to n1), to n2.
    let moved = c
        .client
        .move_volume("data", Some("n2".into()))
        .await
        .expect("move");
    assert_eq!((moved.server.as_str(), moved.id), ("n2", volume.id));
    assert_eq!(volume_move(&pg, &volume.id), "n1>n2:arrived");
    assert!(!volume_dir(&a, &volume.id).exists(), "n1 kept its copy");
    assert_eq!(
        runbox_e2e::xattr(&volume_dir(&b, &volume.id).join("a.txt"), "user.runbox").as_deref(),
        Some(&b"kept"[..])
    );
    let listed = a.client.list_volumes().await.expect("list");
    let named: Vec<(&str, &str)> = listed
        .volumes
        .iter()
        .map(|v| (v.name.as_str(), v.server.as_str()))
        .collect();
    assert_eq!(named, [("data", "n2")]);
    // A create through n1 that mounts it goes to n2, and finds every file
    // as it was.
    let listed = eventually_async(Duration::from_secs(10), || async {
        pg.psql("SELECT '/data' = ANY(volumes) FROM runbox_nodes WHERE id = 'n2'") == "t"
    })
    .await;
    assert!(listed, "n2's heartbeat never named the volume");
    let reader = a
        .client
        .create_run(&CreateRunRequest {
            image: "base".into(),
            volumes: Some(mount("data")),
            ..Default::default()
        })
        .await
        .expect("a create mounting the moved volume");
    assert_eq!(reader.server, "n2");
    let out = a
        .sh(
            &reader.id.to_string(),
            "cd /volumes/data && stat -c '%n %u:%g %a %h' a.txt hard && readlink link && \
             cat a.txt deep/er/f && md5sum -c sum",
        )
        .await;
    assert_eq!(
        String::from_utf8_lossy(&out.stdout),
        "a.txt 1000:1000 640 2\nhard 1000:1000 640 2\na.txt\nkept\ndeep\nbin.dat: OK\n"
    );
    a.client
        .delete_run(&reader.id.to_string())
        .await
        .expect("delete");
    // A node that has a volume of that name already does not take it; it
    // stays where it is, whole.
    a.client
        .create_volume(&CreateVolumeRequest {
            name: "data".into(),
            size_mb: Some(8),
            ..Default::default()
        })
        .await
        .expect("another volume named data, on n1");
    let err = b
        .client
        .move_volume("data", Some("n1".into()))
        .await
        .unwrap_err();
    assert_eq!(err.code(), Some(ErrorCode::NotMovable), "{err}");
    assert!(err.to_string().contains("has a volume named"), "{err}");
    assert_eq!(volume_move(&pg, &volume.id), "n2>n1:back");
    assert!(volume_dir(&b, &volume.id).join("bin.dat").exists());
    assert_eq!(
        b.client.get_volume("data").await.expect("still n2's").id,
        volume.id
    );
    // A create mounting a volume whose node cannot take it says which
    // node and why.
    c.client
        .create_volume(&CreateVolumeRequest {
            name: "full".into(),
            ..Default::default()
        })
        .await
        .expect("a volume on n3");
    let listed = eventually_async(Duration::from_secs(10), || async {
        pg.psql("SELECT '/full' = ANY(volumes) FROM runbox_nodes WHERE id = 'n3'") == "t"
    })
    .await;
    assert!(listed, "n3's heartbeat never named its volume");
    let err = a
        .client
        .create_run(&CreateRunRequest {
            image: "base".into(),
            volumes: Some(mount("full")),
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), Some(ErrorCode::Capacity), "{err}");
    assert!(
        err.to_string().contains("on node n3, and it is full"),
        "{err}"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn a_volume_move_broken_off_by_either_node_leaves_the_volume_on_one() {
    use runbox_types::{CreateRunRequest, ErrorCode};
    let pg = PgServer::start();
    let s3 = runbox_e2e::S3Server::start().await;
    let (mut a, mut b, _c) = bucket_fleet(&pg, &s3, [&[], &[], &[]]).await;
    let (volume, writer) = volume_and_writer(&a, "big", 1024).await;
    let wrote = a
        .sh(
            &writer.id.to_string(),
            "head -c 300000000 /dev/urandom > /volumes/big/blob && md5sum /volumes/big/blob > /volumes/big/sum",
        )
        .await;
    assert_eq!(wrote.exit.exit_code, 0, "{:?}", wrote.stderr);
    a.client
        .delete_run(&writer.id.to_string())
        .await
        .expect("delete");
    // The node it goes to dies while it unpacks the volume: the move is
    // called off, the volume is n1's, and what n2 made is gone when it
    // is back.
    let arriving = volume_dir(&b, &volume.id);
    let (moved, killed) = tokio::join!(a.client.move_volume("big", Some("n2".into())), async {
        let seen = runbox_e2e::eventually(Duration::from_secs(60), || arriving.exists()).await;
        b.kill9();
        seen
    });
    assert!(killed, "n2 never began to make the volume");
    let err = moved.unwrap_err();
    assert_eq!(err.code(), Some(ErrorCode::NotMovable), "{err}");
    assert_eq!(volume_move(&pg, &volume.id), "n1>n2:back");
    b.spawn().await;
    assert!(!arriving.exists(), "n2 kept a half-made volume");
    let check = |d: &TestDaemon| {
        let d = d.client.clone();
        async move {
            let run = d
                .create_run(&CreateRunRequest {
                    image: "base".into(),
                    volumes: Some(mount("big")),
                    ..Default::default()
                })
                .await
                .expect("a run mounting the volume");
            (run.server.clone(), run.id.to_string())
        }
    };
    let (server, id) = check(&a).await;
    assert_eq!(server, "n1");
    let out = a.sh(&id, "md5sum -c /volumes/big/sum").await;
    assert_eq!(out.stdout, b"/volumes/big/blob: OK\n");
    a.client.delete_run(&id).await.expect("delete");
    // The node it leaves dies once the other node holds it, before it
    // hears so: the move ended as arrived, and n1 ends its copy when it
    // is back.
    let leaving = volume_dir(&a, &volume.id);
    let arriving = volume_dir(&b, &volume.id);
    let client = a.client.clone();
    let (moved, stopped) = tokio::join!(client.move_volume("big", Some("n2".into())), async {
        let seen = runbox_e2e::eventually(Duration::from_secs(60), || arriving.exists()).await;
        let pid = a.pid().to_string();
        let _ = Command::new("kill").args(["-STOP", &pid]).status();
        let arrived = eventually_async(Duration::from_secs(60), || async {
            volume_move(&pg, &volume.id) == "n1>n2:arrived"
        })
        .await;
        a.kill9();
        seen && arrived
    });
    assert!(stopped, "the move never arrived on n2 while n1 was stopped");
    assert!(moved.is_err(), "n1 answered while stopped: {moved:?}");
    assert!(leaving.exists(), "n1's copy went before it was back");
    a.spawn().await;
    assert!(!leaving.exists(), "n1 kept its copy of a volume that moved");
    let (server, id) = check(&a).await;
    assert_eq!(server, "n2");
    let out = a.sh(&id, "md5sum -c /volumes/big/sum").await;
    assert_eq!(out.stdout, b"/volumes/big/blob: OK\n");
    a.client.delete_run(&id).await.expect("delete");
}

#[tokio::test(flavor = "multi_thread")]
async fn an_archived_run_whose_node_has_no_room_wakes_on_a_node_that_has() {
    let pg = PgServer::start();
    let s3 = runbox_e2e::S3Server::start().await;
    let (a, b, _c) =
        bucket_fleet(&pg, &s3, [&["--max-runs", "1"], &[], &["--max-runs", "0"]]).await;
    let asleep = archived_run(&a, "roomless").await;
    let third = archived_run(&a, "stays").await;
    // (Placement reads n1's load from its heartbeat, as the others do.)
    let room = eventually_async(Duration::from_secs(10), || async {
        pg.psql("SELECT runs FROM runbox_nodes WHERE id = 'n1'") == "0"
    })
    .await;
    assert!(room, "n1's heartbeat never showed its room");
    let awake = a.create().await.id.to_string();
    // n1 is full: the exec sent to n1 wakes the run on n2.
    assert_eq!(a.client.get_run(&awake).await.expect("get").server, "n1");
    let out = a.sh(&asleep, "cat /work/kept").await;
    assert_eq!(out.stdout, b"roomless\n");
    assert_eq!(owner(&pg, &asleep), "n2");
    assert_eq!(
        pg.psql(&format!(
            "SELECT from_node || '>' || to_node || ':' || reason FROM runbox_moves WHERE run = '{asleep}'"
        )),
        "n1>n2:move"
    );
    // Cordoned, with room: the same.
    a.client.delete_run(&awake).await.expect("delete");
    let room = eventually_async(Duration::from_secs(10), || async {
        pg.psql("SELECT runs FROM runbox_nodes WHERE id = 'n1'") == "0"
    })
    .await;
    assert!(room, "n1's heartbeat never showed its room");
    let second = archived_run(&a, "cordoned").await;
    a.client.set_draining(true).await.expect("drain");
    let out = a.sh(&second, "cat /work/kept").await;
    assert_eq!(out.stdout, b"cordoned\n");
    assert_eq!(owner(&pg, &second), "n2");
    // A read or a delete does not move an archived run.
    let got = a.client.get_run(&third).await.expect("get");
    assert_eq!(
        (got.server.as_str(), got.status),
        ("n1", runbox_types::RunStatus::Archived)
    );
    a.client.delete_run(&third).await.expect("delete");
    for id in [&asleep, &second] {
        b.client.delete_run(id).await.expect("delete");
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn each_volume_move_is_decided_once_and_later_moves_never_undo_it() {
    use runbox_fleet::{Fleet, VolumeMove};
    let pg = PgServer::start();
    let join = |node: &'static str| probe(&pg, node);
    let (n1, n2) = tokio::join!(join("n1"), join("n2"));
    let volume = ulid::Ulid::new();
    let (a, b) = (ulid::Ulid::new(), ulid::Ulid::new());
    assert!(n1.begin_volume_move(volume, a, "n2").await.unwrap());
    assert!(
        !n2.begin_volume_move(volume, b, "n1").await.unwrap(),
        "one move of a volume at a time"
    );
    let ends = |node: &std::sync::Arc<runbox_fleet::Cluster>, id: ulid::Ulid, end: VolumeMove| {
        let node = node.clone();
        async move { node.end_volume_move(volume, id, end).await.unwrap() }
    };
    // Only the node it goes to ends it as arrived; then nothing changes it.
    assert_eq!(ends(&n1, a, VolumeMove::Arrived).await, VolumeMove::Moving);
    assert_eq!(ends(&n2, a, VolumeMove::Arrived).await, VolumeMove::Arrived);
    assert_eq!(ends(&n1, a, VolumeMove::Back).await, VolumeMove::Arrived);
    // A later move of it (from n2) leaves how the first ended as it was,
    // for a node that settles it late.
    assert!(n2.begin_volume_move(volume, b, "n1").await.unwrap());
    assert_eq!(ends(&n1, a, VolumeMove::Back).await, VolumeMove::Arrived);
    assert_eq!(ends(&n2, b, VolumeMove::Back).await, VolumeMove::Back);
    // A move the database never heard of did not happen.
    assert_eq!(
        ends(&n1, ulid::Ulid::new(), VolumeMove::Back).await,
        VolumeMove::Back
    );
    // Both nodes ending one move at once read the same end.
    for _ in 0..10 {
        let id = ulid::Ulid::new();
        assert!(n2.begin_volume_move(volume, id, "n1").await.unwrap());
        let (x, y) = tokio::join!(
            ends(&n1, id, VolumeMove::Arrived),
            ends(&n2, id, VolumeMove::Back)
        );
        assert_eq!(x, y);
        assert_ne!(x, VolumeMove::Moving);
    }
    // A move its node gave up before telling anyone is ended by its next.
    let stale = ulid::Ulid::new();
    assert!(n1.begin_volume_move(volume, stale, "n2").await.unwrap());
    assert!(n1
        .begin_volume_move(volume, ulid::Ulid::new(), "n2")
        .await
        .unwrap());
    assert_eq!(
        ends(&n2, stale, VolumeMove::Arrived).await,
        VolumeMove::Back
    );
}
