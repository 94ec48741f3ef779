//! Tenants and tokens against a live daemon: the token matrix of
//! docs/api.md (read from the document, so the two cannot drift), quotas,
//! policies, stamping and filtering, rotation and deletion.

use std::collections::BTreeMap;

use runbox_client::Client;
use runbox_e2e::{raw_request, split_response, TestDaemon};
use runbox_types::{
    CreateRunRequest, CreateTenantRequest, ErrorCode, NetworkTier, SizeTier, TenantPolicy,
    UpdateTenantRequest,
};

/// The rows of docs/api.md's token matrix: the request cell and the six
/// expected statuses.
fn matrix() -> Vec<(String, [u16; 6])> {
    let doc = std::fs::read_to_string(runbox_e2e::workspace_root().join("docs/api.md"))
        .expect("docs/api.md");
    let start = doc
        .find("<!-- token-matrix -->")
        .expect("the matrix's start");
    let end = doc
        .find("<!-- /token-matrix -->")
        .expect("the matrix's end");
    doc[start..end]
        .lines()
        .filter(|l| l.starts_with("| `"))
        .map(|line| {
            let cells: Vec<&str> = line.trim_matches('|').split('|').map(str::trim).collect();
            assert_eq!(cells.len(), 7, "a matrix row has 7 cells: {line}");
            let request = cells[0].to_owned();
            let statuses: Vec<u16> = cells[1..]
                .iter()
                .map(|c| {
                    c.parse()
                        .unwrap_or_else(|_| panic!("status {c:?} in {line}"))
                })
                .collect();
            (request, statuses.try_into().unwrap())
        })
        .collect()
}

/// How a matrix request is sent: method, path, body and which header
/// carries the token.
enum Carrier {
    Bearer,
    ApiKey,
    AccessToken,
}

fn request_of(cell: &str, run: &str, other: &str) -> (String, String, Vec<u8>, Carrier) {
    // `METHOD PATH` in backticks, then a note.
    let inner = cell.split('`').nth(1).expect("a request in backticks");
    let (method, path) = inner.split_once(' ').expect("METHOD PATH");
    let mut path = path.replace("{run}", run).replace("{other}", other);
    let carrier = if cell.contains("X-API-Key") {
        Carrier::ApiKey
    } else if cell.contains("X-Access-Token") {
        path = path.replace("path=matrix.txt", "path=/work/matrix.txt");
        Carrier::AccessToken
    } else {
        Carrier::Bearer
    };
    let body: &[u8] = if path == "/v1/runs" && method == "POST" {
        br#"{"image":"base","ttlSec":0}"#
    } else if path.ends_with("/exec") {
        br#"{"cmd":["true"]}"#
    } else if path.ends_with("/files/matrix.txt") {
        b"matrix"
    } else if path.ends_with("/renew") {
        br#"{"ttlSec":600}"#
    } else if path.ends_with("/lease") || path.ends_with("/fork") {
        br#"{"count":0}"#
    } else if path.ends_with("/warm-commit") {
        b"{}"
    } else {
        b""
    };
    if path.ends_with("/fs/list") {
        path.push_str("?path=.");
    }
    (method.to_owned(), path, body.to_vec(), carrier)
}

async fn send(
    url: &str,
    method: &str,
    path: &str,
    body: &[u8],
    carrier: &Carrier,
    token: Option<&str>,
    run: &str,
) -> (u16, String) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let addr = url.trim_start_matches("http://");
    let auth = match (carrier, token) {
        (_, None) => String::new(),
        (Carrier::Bearer, Some(t)) => format!("Authorization: Bearer {t}\r\n"),
        (Carrier::ApiKey, Some(t)) => format!("X-API-Key: e2b_{t}\r\n"),
        (Carrier::AccessToken, Some(t)) => format!("X-Access-Token: {t}\r\n"),
    };
    let sandbox = match carrier {
        Carrier::AccessToken => format!("E2b-Sandbox-Id: {run}\r\n"),
        _ => String::new(),
    };
    let content_type = if body.is_empty() {
        ""
    } else if path.contains("/files/") {
        "Content-Type: application/octet-stream\r\n"
    } else {
        "Content-Type: application/json\r\n"
    };
    let mut stream = tokio::net::TcpStream::connect(addr).await.expect("connect");
    let head = format!(
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\n{auth}{sandbox}{content_type}Content-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    );
    stream.write_all(head.as_bytes()).await.unwrap();
    stream.write_all(body).await.unwrap();
    let mut response = Vec::new();
    stream.read_to_end(&mut response).await.unwrap();
    split_response(&String::from_utf8_lossy(&response))
}

async fn tenant(root: &Client, name: &str, policy: TenantPolicy) -> String {
    root.create_tenant(&CreateTenantRequest {
        name: name.into(),
        max_runs: policy.max_runs,
        images: policy.images,
        networks: policy.networks,
        sizes: policy.sizes,
        egress_class: policy.egress_class,
    })
    .await
    .expect("create tenant")
    .token
}

fn create(image: &str) -> CreateRunRequest {
    CreateRunRequest {
        image: image.into(),
        ttl_sec: Some(600),
        ..Default::default()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tenants_see_only_their_own_and_keep_to_their_limits() {
    let daemon = TestDaemon::start(None).await;
    let root = &daemon.client;
    let token_a = tenant(
        root,
        "acme",
        TenantPolicy {
            max_runs: 2,
            images: vec!["base".into()],
            networks: vec![NetworkTier::None],
            sizes: vec![],
            egress_class: None,
        },
    )
    .await;
    let token_b = tenant(root, "beta", TenantPolicy::default()).await;
    let (a, b) = (
        Client::new(&daemon.url, &token_a).unwrap(),
        Client::new(&daemon.url, &token_b).unwrap(),
    );
    // Quota: the third live run is 429 tenant_quota with Retry-After.
    let first = a.create_run(&create("base")).await.unwrap();
    let second = a.create_run(&create("base")).await.unwrap();
    let refused = reqwest::Client::new()
        .post(format!("{}/v1/runs", daemon.url))
        .bearer_auth(&token_a)
        .json(&create("base"))
        .send()
        .await
        .unwrap();
    assert_eq!(refused.status(), 429);
    assert!(refused.headers().contains_key("retry-after"));
    let text = refused.text().await.unwrap();
    assert!(text.contains("tenant_quota"), "{text}");
    // A fork counts against the parent's tenant too.
    let forked = a
        .fork_run(
            &first.id.to_string(),
            &runbox_types::ForkRequest {
                count: 1,
                ..Default::default()
            },
        )
        .await
        .unwrap_err();
    assert_eq!(forked.code(), Some(ErrorCode::TenantQuota), "{forked}");
    // Another tenant is not held to A's quota.
    let theirs = b.create_run(&create("base")).await.unwrap();
    // Policies name the rule.
    let mut open = create("base");
    open.network = Some(NetworkTier::Open);
    a.delete_run(&second.id.to_string()).await.unwrap();
    let refused = a.create_run(&open).await.unwrap_err();
    assert_eq!(refused.code(), Some(ErrorCode::TenantPolicy));
    assert!(refused.to_string().contains("networks rule"), "{refused}");
    daemon.import("other", runbox_e2e::busybox_tar()).await;
    let refused = a.create_run(&create("other")).await.unwrap_err();
    assert_eq!(refused.code(), Some(ErrorCode::TenantPolicy));
    assert!(refused.to_string().contains("images rule"), "{refused}");
    // Listings are filtered; another tenant's run is 404.
    let listed: Vec<_> = a
        .list_runs()
        .await
        .unwrap()
        .runs
        .iter()
        .map(|r| r.id)
        .collect();
    assert_eq!(listed, vec![first.id]);
    assert_eq!(root.list_runs().await.unwrap().runs.len(), 2);
    let hidden = a.get_run(&theirs.id.to_string()).await.unwrap_err();
    assert_eq!(hidden.status(), Some(404));
    // Snapshots are stamped; B cannot see or run A's.
    let snap = a
        .snapshot_run(&first.id.to_string(), Some("acme-snap"))
        .await
        .unwrap();
    assert_eq!(snap.image, "acme-snap");
    let images = |list: runbox_types::ImageList| {
        list.images
            .into_iter()
            .map(|i| (i.name, i.tenant))
            .collect::<BTreeMap<_, _>>()
    };
    let seen_by_a = images(a.list_images().await.unwrap());
    assert_eq!(seen_by_a.get("acme-snap"), Some(&Some("acme".to_owned())));
    assert!(!images(b.list_images().await.unwrap()).contains_key("acme-snap"));
    assert_eq!(
        b.list_snapshots().await.unwrap().snapshots.len(),
        0,
        "B sees no snapshots"
    );
    let refused = b.create_run(&create("acme-snap")).await.unwrap_err();
    assert_eq!(refused.code(), Some(ErrorCode::ImageNotFound), "{refused}");
    // A runs its own snapshot although its images rule names only base.
    a.delete_run(&first.id.to_string()).await.unwrap();
    let from_snap = a.create_run(&create("acme-snap")).await.unwrap();
    // The same Idempotency-Key from two tenants makes two runs.
    a.delete_run(&from_snap.id.to_string()).await.unwrap();
    let keyed = |token: &str| {
        let url = daemon.url.clone();
        let token = token.to_owned();
        async move {
            let body = serde_json::to_vec(&create("base")).unwrap();
            let client = reqwest::Client::new();
            let resp = client
                .post(format!("{url}/v1/runs"))
                .bearer_auth(token)
                .header("Idempotency-Key", "same-key")
                .header("Content-Type", "application/json")
                .body(body)
                .send()
                .await
                .unwrap();
            assert_eq!(resp.status(), 201);
            resp.json::<runbox_types::Run>().await.unwrap().id
        }
    };
    let (ka, kb) = (keyed(&token_a).await, keyed(&token_b).await);
    assert_ne!(ka, kb);
    assert_eq!(
        keyed(&token_a).await,
        ka,
        "a repeat finds the tenant's own run"
    );
    // A tenant with runs cannot be deleted; rotation shuts the old token out.
    let busy = root.delete_tenant("acme").await.unwrap_err();
    assert_eq!(busy.code(), Some(ErrorCode::TenantHasRuns));
    let rotated = root.rotate_tenant("acme").await.unwrap();
    assert_eq!(a.list_runs().await.unwrap_err().status(), Some(401));
    let a2 = Client::new(&daemon.url, &rotated.token).unwrap();
    assert_eq!(a2.list_runs().await.unwrap().runs.len(), 1);
    // Update: a lower maxRuns stops new runs only.
    let updated = root
        .update_tenant(
            "acme",
            &UpdateTenantRequest {
                max_runs: Some(1),
                sizes: Some(vec![SizeTier::Small]),
                ..Default::default()
            },
        )
        .await
        .unwrap();
    assert_eq!(updated.runs, 1);
    assert_eq!(updated.policy.max_runs, 1);
    let refused = a2.create_run(&create("base")).await.unwrap_err();
    assert_eq!(refused.code(), Some(ErrorCode::TenantPolicy), "sizes first");
    // Cleanup, then the tenant can go; its token with it.
    for id in [ka, kb, theirs.id] {
        root.delete_run(&id.to_string()).await.unwrap();
    }
    root.delete_tenant("acme").await.unwrap();
    assert_eq!(a2.list_runs().await.unwrap_err().status(), Some(401));
    // Hostile tenant names and settings are 400 with a stable code.
    for body in [
        r#"{"name":"Acme"}"#,
        r#"{"name":"a/b"}"#,
        r#"{"name":""}"#,
        r#"{"name":"ok","images":["a*b"]}"#,
        r#"{"name":"ok","maxRuns":-1}"#,
        r#"{"name":"ok","sneaky":1}"#,
    ] {
        let (status, text) = raw_request(
            &daemon.url,
            "POST",
            "/v1/tenants",
            &daemon.token,
            body.as_bytes(),
        )
        .await;
        assert_eq!(status, 400, "{body}: {text}");
    }
    // The audit trail names tenants, never tokens.
    let audit =
        std::fs::read_to_string(daemon.state.path().join("audit.jsonl")).unwrap_or_default();
    for token in [&token_a, &token_b, &rotated.token] {
        assert!(!audit.contains(token.as_str()));
    }
    let tenants_file = std::fs::read_to_string(daemon.state.path().join("tenants.json")).unwrap();
    assert!(!tenants_file.contains(&token_b));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_scripted_sequence_is_journaled_and_summed() {
    let daemon = TestDaemon::start(None).await;
    let root = &daemon.client;
    let token = tenant(root, "acme", TenantPolicy::default()).await;
    let a = Client::new(&daemon.url, &token).unwrap();
    let mut req = create("base");
    req.size = Some(SizeTier::Small);
    let run = a.create_run(&req).await.unwrap();
    let id = run.id.to_string();
    // Some CPU for the cgroup to count.
    daemon
        .sh(&id, "i=0; while [ $i -lt 20000 ]; do i=$((i+1)); done")
        .await;
    a.pause_run(&id).await.unwrap();
    a.resume_run(&id).await.unwrap();
    a.snapshot_run(&id, Some("acme-usage")).await.unwrap();
    a.checkpoint_run(&id, &Default::default()).await.unwrap();
    let fork = a
        .fork_run(
            &id,
            &runbox_types::ForkRequest {
                count: 1,
                ..Default::default()
            },
        )
        .await
        .unwrap();
    a.hibernate_run(&id).await.unwrap();
    a.wake_run(&id).await.unwrap();
    a.delete_run(&id).await.unwrap();
    let child = fork.runs[0].id.to_string();
    let theirs = root.create_run(&create("base")).await.unwrap();
    let report = a.usage(Some("1h"), None).await.unwrap();
    // A tenant sees its own only.
    assert_eq!(report.tenants.keys().collect::<Vec<_>>(), vec!["acme"]);
    let acme = &report.tenants["acme"];
    for (kind, n) in [
        ("create", 1),
        ("pause", 1),
        ("resume", 1),
        ("snapshot", 1),
        ("checkpoint", 1),
        ("fork", 1),
        ("hibernate", 1),
        ("wake", 1),
        ("delete", 1),
    ] {
        assert_eq!(acme.events.get(kind), Some(&n), "{kind} in {acme:?}");
    }
    assert!(acme.run_seconds["small"] > 0.0, "{acme:?}");
    assert!(acme.cpu_seconds > 0.0, "{acme:?}");
    assert!(acme.peak_memory_bytes > 0, "{acme:?}");
    // Root sees every tenant, the operator's runs under "".
    let all = root.usage(None, None).await.unwrap();
    assert!(all.tenants.contains_key("") && all.tenants.contains_key("acme"));
    assert_eq!(all.tenants[""].events.get("create"), Some(&1));
    let only = root.usage(None, Some("acme")).await.unwrap();
    assert_eq!(only.tenants.len(), 1);
    // A bad window is a 400 that says what to write.
    let bad = root.usage(Some("yesterday"), None).await.unwrap_err();
    assert_eq!(bad.code(), Some(ErrorCode::BadRequest));
    // The journal is JSON lines, owner-only, and survives a kill -9 up to
    // its last batch (the report above flushed it).
    let path = daemon.state.path().join("usage.jsonl");
    use std::os::unix::fs::PermissionsExt;
    assert_eq!(
        std::fs::metadata(&path).unwrap().permissions().mode() & 0o777,
        0o600
    );
    let lines = std::fs::read_to_string(&path).unwrap();
    for line in lines.lines() {
        let event: serde_json::Value = serde_json::from_str(line).unwrap();
        assert!(event["t"].is_string() && event["event"].is_string() && event["run"].is_string());
    }
    let mut daemon = daemon;
    daemon.kill9();
    daemon.spawn().await;
    let after = daemon.client.usage(None, Some("acme")).await.unwrap();
    assert_eq!(after.tenants["acme"].events, acme.events);
    for id in [child, theirs.id.to_string()] {
        daemon.client.delete_run(&id).await.unwrap();
    }
}

/// The spellings of `id` that name it: as written, one character
/// percent-encoded (first, last), every character percent-encoded in upper
/// and in lower hex, lower case.
fn spellings(id: &str) -> Vec<String> {
    let every = |lower: bool| {
        let hex: String = id.bytes().map(|b| format!("%{b:02X}")).collect();
        if lower {
            hex.to_lowercase()
        } else {
            hex
        }
    };
    vec![
        id.to_owned(),
        format!("%{:02X}{}", id.as_bytes()[0], &id[1..]),
        format!("{}%{:02x}", &id[..25], id.as_bytes()[25]),
        every(false),
        every(true),
        id.to_lowercase(),
    ]
}

/// Spellings a lenient decoder folds onto `id` that are not it (docs/api.md:
/// a first character above 7, Crockford's aliases): 404 for everyone.
fn not_spellings(id: &str) -> Vec<String> {
    let first = id.as_bytes()[0] - b'0';
    let mut out = vec![format!("{}{}", (b'8' + first) as char, &id[1..])];
    for (digit, alias) in [('0', "O"), ('1', "I"), ('1', "L")] {
        if id.contains(digit) {
            out.push(id.replacen(digit, alias, 1));
        }
    }
    out
}

/// Every cell of docs/api.md's token matrix holds, and a row that names a
/// run holds with the run's id in every spelling (as the plain id does, for
/// every caller); a caller refused the run learns nothing of it; what is
/// not a spelling of an id is 404 (401 without a valid token).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_cell_of_the_token_matrix_holds_in_every_spelling() {
    let daemon = TestDaemon::start(None).await;
    let root = &daemon.client;
    let token_a = tenant(root, "acme", TenantPolicy::default()).await;
    let token_b = tenant(root, "beta", TenantPolicy::default()).await;
    let a = Client::new(&daemon.url, &token_a).unwrap();
    let run = a.create_run(&create("base")).await.expect("tenant A's run");
    let run_token = run.token.clone().expect("a create answers the run token");
    let other = root.create_run(&create("base")).await.expect("root's run");
    let (run_id, other_id) = (run.id.to_string(), other.id.to_string());
    // The files row reads what the PUT row wrote.
    a.put_file(&run_id, "matrix.txt", runbox_e2e::body(b"matrix".to_vec()))
        .await
        .unwrap();
    let callers: [Option<&str>; 6] = [
        Some(&daemon.token),
        Some(&token_a),
        Some(&token_b),
        Some(&run_token),
        Some("0123456789abcdef"),
        None,
    ];
    let names = ["root", "tenant A", "tenant B", "run token", "wrong", "none"];
    let secrets = [
        run_token.clone(),
        other.token.clone().expect("root's run token"),
    ];
    let mut wrong = Vec::new();
    let mut sent = 0;
    for (cell, expected) in matrix() {
        let envd = cell.contains("X-Access-Token");
        let names_other = cell.contains("{other}");
        let target = if names_other { &other_id } else { &run_id };
        let mut forms: Vec<(String, bool)> = spellings(target)
            .into_iter()
            .map(|s| (s, true))
            .chain(not_spellings(target).into_iter().map(|s| (s, false)))
            .collect();
        if envd {
            // The sandbox is named by a header: nothing decodes it, so
            // only its case may differ.
            forms = vec![(run_id.clone(), true), (run_id.to_lowercase(), true)];
        } else if !cell.contains("{run}") && !names_other {
            // A route that names no run: as written.
            forms = vec![(run_id.clone(), true)];
        }
        for (form, is_id) in forms {
            let (fa, fo) = if names_other {
                (run_id.clone(), form.clone())
            } else {
                (form.clone(), other_id.clone())
            };
            let (method, path, body, carrier) = request_of(&cell, &fa, &fo);
            for (i, caller) in callers.iter().enumerate() {
                let want = match (is_id, expected[i]) {
                    (true, status) => status,
                    (false, 401) => 401,
                    (false, _) => 404,
                };
                let header_id = if envd { form.as_str() } else { &run_id };
                let (status, text) = send(
                    &daemon.url,
                    &method,
                    &path,
                    &body,
                    &carrier,
                    *caller,
                    header_id,
                )
                .await;
                sent += 1;
                if status != want {
                    wrong.push(format!(
                        "{method} {path} as {}: {status}, want {want} ({})",
                        names[i],
                        text.chars().take(160).collect::<String>()
                    ));
                }
                // A refusal carries nothing of the run: no token, no record.
                if status >= 400 && secrets.iter().any(|s| text.contains(s.as_str())) {
                    wrong.push(format!(
                        "{method} {path} as {}: a refusal shows a token",
                        names[i]
                    ));
                }
                if path == "/v1/drain" && status == 200 {
                    root.set_draining(false).await.unwrap();
                }
            }
        }
    }
    assert!(sent > 500, "only {sent} requests");
    assert!(
        wrong.is_empty(),
        "cells that do not hold for every spelling:\n{}",
        wrong.join("\n")
    );
    for id in [run.id, other.id] {
        root.delete_run(&id.to_string()).await.unwrap();
    }
}

/// What the hostile tenant tried: every state-changing request on another
/// tenant's run, through runbox's API with a tenant token and with a run
/// token of its own, and through E2B's control plane with its API key, in
/// every spelling of the run's id. Each is a 404, and afterwards the run is
/// as it was: running, unleased, on its own egress, its files its own.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn another_tenants_run_is_out_of_reach_in_every_spelling() {
    let daemon = TestDaemon::start(None).await;
    let root = &daemon.client;
    let token_a = tenant(root, "acme", TenantPolicy::default()).await;
    let token_b = tenant(root, "beta", TenantPolicy::default()).await;
    let (a, b) = (
        Client::new(&daemon.url, &token_a).unwrap(),
        Client::new(&daemon.url, &token_b).unwrap(),
    );
    let victim = a.create_run(&create("base")).await.unwrap();
    let victim_id = victim.id.to_string();
    a.put_file(&victim_id, "secret.txt", runbox_e2e::body(b"A's".to_vec()))
        .await
        .unwrap();
    let own = b.create_run(&create("base")).await.unwrap();
    let own_token = own.token.clone().unwrap();
    let attempts: &[(&str, &str, &str)] = &[
        ("GET", "/v1/runs/{id}", ""),
        ("GET", "/v1/runs/{id}/files/secret.txt", ""),
        ("PUT", "/v1/runs/{id}/files/secret.txt", "B's"),
        (
            "POST",
            "/v1/runs/{id}/exec",
            r#"{"cmd":["rm","-f","/work/secret.txt"]}"#,
        ),
        (
            "POST",
            "/v1/runs/{id}/fs/remove",
            r#"{"path":"secret.txt"}"#,
        ),
        ("POST", "/v1/runs/{id}/renew", r#"{"ttlSec":5}"#),
        (
            "PATCH",
            "/v1/runs/{id}/egress",
            r#"{"network":"allowlist","egressAllow":["example.com"]}"#,
        ),
        (
            "POST",
            "/v1/runs/{id}/lease",
            r#"{"owner":"beta","ttlSec":600}"#,
        ),
        ("POST", "/v1/runs/{id}/snapshot", r#"{"name":"stolen"}"#),
        ("POST", "/v1/runs/{id}/fork", r#"{"count":1}"#),
        ("POST", "/v1/runs/{id}/preview", r#"{"port":8080}"#),
        ("POST", "/v1/runs/{id}/pause", ""),
        ("POST", "/v1/runs/{id}/hibernate", ""),
        ("DELETE", "/v1/runs/{id}", ""),
    ];
    let e2b: &[(&str, &str, &str)] = &[
        ("GET", "/sandboxes/{id}", ""),
        ("POST", "/v2/sandboxes/{id}/connect", "{}"),
        ("POST", "/sandboxes/{id}/timeout", r#"{"timeout":1}"#),
        (
            "PUT",
            "/sandboxes/{id}/network",
            r#"{"allowOut":["1.1.1.1"]}"#,
        ),
        ("POST", "/sandboxes/{id}/pause", ""),
        ("DELETE", "/sandboxes/{id}", ""),
    ];
    let mut wrong = Vec::new();
    let forms: Vec<String> = spellings(&victim_id)
        .into_iter()
        .chain(not_spellings(&victim_id))
        .collect();
    for form in &forms {
        for (method, route, body) in attempts {
            let path = route.replace("{id}", form);
            let content_type = if path.contains("/files/") {
                "application/octet-stream"
            } else {
                "application/json"
            };
            for token in [&token_b, &own_token] {
                let (status, text) = runbox_e2e::raw_request_typed(
                    &daemon.url,
                    method,
                    &path,
                    token,
                    body.as_bytes(),
                    (!body.is_empty()).then_some(content_type),
                )
                .await;
                if status != 404 || text.contains(&victim_id) && text.contains("token") {
                    wrong.push(format!("{method} {path}: {status} {text}"));
                }
            }
        }
        for (method, route, body) in e2b {
            let path = route.replace("{id}", form);
            let (status, text) = send(
                &daemon.url,
                method,
                &path,
                body.as_bytes(),
                &Carrier::ApiKey,
                Some(&token_b),
                "",
            )
            .await;
            if status != 404 {
                wrong.push(format!("E2B {method} {path}: {status} {text}"));
            }
        }
    }
    assert!(
        wrong.is_empty(),
        "reached another tenant's run:\n{}",
        wrong.join("\n")
    );
    // The run is as A left it.
    let after = a.get_run(&victim_id).await.unwrap();
    assert_eq!(after.status, runbox_types::RunStatus::Running);
    assert!(after.lease.is_none());
    assert_eq!(after.network, victim.network);
    assert!(after.expires_at >= victim.expires_at);
    let kept = daemon.sh(&victim_id, "cat /work/secret.txt").await;
    assert_eq!(String::from_utf8_lossy(&kept.stdout), "A's");
    let images = root.list_images().await.unwrap().images;
    assert!(images.iter().all(|i| i.name != "stolen"));
    // A's own calls, in any spelling, still reach it.
    for form in spellings(&victim_id) {
        let (status, _) = runbox_e2e::raw_request(
            &daemon.url,
            "GET",
            &format!("/v1/runs/{form}/files/secret.txt"),
            &token_a,
            b"",
        )
        .await;
        assert_eq!(status, 200, "{form}");
    }
    // E2B volumes: the control plane keeps a tenant to its own, and the
    // content API holds each spelling of a volume's id to its token.
    let mut volumes = Vec::new();
    for (key, name) in [(&token_a, "avol"), (&token_b, "bvol")] {
        let (status, text) = send(
            &daemon.url,
            "POST",
            "/volumes",
            format!(r#"{{"name":"{name}"}}"#).as_bytes(),
            &Carrier::ApiKey,
            Some(key),
            "",
        )
        .await;
        assert_eq!(status, 201, "{text}");
        let made: serde_json::Value = serde_json::from_str(&text).unwrap();
        volumes.push((
            made["volumeID"].as_str().unwrap().to_owned(),
            made["token"].as_str().unwrap().to_owned(),
        ));
    }
    let (volume, volume_token) = &volumes[0];
    let intruder_token = &volumes[1].1;
    for form in spellings(volume) {
        let content = format!("/volumecontent/{form}/dir?path=/");
        let (status, text) =
            runbox_e2e::raw_request(&daemon.url, "GET", &content, volume_token, b"").await;
        assert_eq!(status, 200, "{content}: {text}");
        let (status, _) =
            runbox_e2e::raw_request(&daemon.url, "GET", &content, intruder_token, b"").await;
        assert_eq!(status, 401, "{content} with another volume's token");
        for (key, want) in [(&token_a, 200), (&token_b, 404)] {
            let info = format!("/volumes/{form}");
            let (status, text) = send(
                &daemon.url,
                "GET",
                &info,
                b"",
                &Carrier::ApiKey,
                Some(key),
                "",
            )
            .await;
            assert_eq!(status, want, "{info}: {text}");
        }
    }
    for form in not_spellings(volume) {
        let content = format!("/volumecontent/{form}/dir?path=/");
        let (status, _) =
            runbox_e2e::raw_request(&daemon.url, "GET", &content, volume_token, b"").await;
        assert_eq!(status, 401, "{content} is not the volume");
    }
    for id in [victim.id, own.id] {
        root.delete_run(&id.to_string()).await.unwrap();
    }
}

/// A label selector on the run list: a client-side manager asks for
/// exactly its own runs (`KEY=VALUE` and `KEY` terms, all required), and a
/// tenant's selector never reaches past its own runs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_label_selector_lists_exactly_the_runs_it_names() {
    let daemon = TestDaemon::start(None).await;
    let root = &daemon.client;
    let token = tenant(root, "acme", TenantPolicy::default()).await;
    let a = Client::new(&daemon.url, &token).unwrap();
    let labelled = |pairs: &[(&str, &str)]| CreateRunRequest {
        labels: Some(
            pairs
                .iter()
                .map(|(k, v)| ((*k).into(), (*v).into()))
                .collect(),
        ),
        ..create("base")
    };
    let mine = a
        .create_run(&labelled(&[("team", "a"), ("job", "x")]))
        .await
        .unwrap();
    let other_job = a.create_run(&labelled(&[("team", "a")])).await.unwrap();
    let other_team = a.create_run(&labelled(&[("team", "b")])).await.unwrap();
    // The operator's run with the same labels: never in the tenant's list.
    let roots = root
        .create_run(&labelled(&[("team", "a"), ("job", "x")]))
        .await
        .unwrap();
    let ids = |list: runbox_types::RunList| {
        let mut ids: Vec<String> = list.runs.iter().map(|r| r.id.to_string()).collect();
        ids.sort();
        ids
    };
    let sorted = |mut v: Vec<String>| {
        v.sort();
        v
    };
    let cases: [(&[&str], Vec<String>); 5] = [
        (
            &["team=a"],
            sorted(vec![mine.id.to_string(), other_job.id.to_string()]),
        ),
        (&["team=a", "job"], vec![mine.id.to_string()]),
        (&["job=x"], vec![mine.id.to_string()]),
        (&["team=c"], vec![]),
        (
            &[],
            sorted(vec![
                mine.id.to_string(),
                other_job.id.to_string(),
                other_team.id.to_string(),
            ]),
        ),
    ];
    for (selector, want) in cases {
        let got = ids(a.list_runs_labelled(selector).await.unwrap());
        assert_eq!(got, want, "{selector:?}");
    }
    // Root sees both tenants' matches.
    assert_eq!(
        ids(root.list_runs_labelled(&["team=a", "job=x"]).await.unwrap()),
        sorted(vec![mine.id.to_string(), roots.id.to_string()])
    );
    // Malformed selectors are refused, not ignored.
    for (query, code) in [
        ("label=bad%20key", "bad_labels"),
        ("label=", "bad_labels"),
        ("team=a", "bad_request"),
        ("labels=team%3Da", "bad_request"),
    ] {
        let (status, text) = raw_request(
            &daemon.url,
            "GET",
            &format!("/v1/runs?{query}"),
            &token,
            b"",
        )
        .await;
        assert_eq!(status, 400, "{query}: {text}");
        assert!(text.contains(code), "{query}: {text}");
    }
    // Snapshots carry the labels they were taken with, and take the same
    // selector.
    let snap = |labels: &[(&str, &str)], name: &str| runbox_types::SnapshotRequest {
        name: Some(name.into()),
        labels: Some(
            labels
                .iter()
                .map(|(k, v)| ((*k).into(), (*v).into()))
                .collect(),
        ),
        point: None,
    };
    let taken = a
        .snapshot_run_with(&mine.id.to_string(), &snap(&[("team", "a")], "snap-a"))
        .await
        .unwrap();
    assert_eq!(taken.image, "snap-a");
    a.snapshot_run_with(
        &other_team.id.to_string(),
        &snap(&[("team", "b")], "snap-b"),
    )
    .await
    .unwrap();
    let images = |list: runbox_types::SnapshotList| {
        list.snapshots
            .into_iter()
            .map(|i| i.name)
            .collect::<Vec<_>>()
    };
    assert_eq!(
        images(a.list_snapshots_labelled(&["team=a"]).await.unwrap()),
        ["snap-a"]
    );
    assert_eq!(
        images(a.list_snapshots_labelled(&["team"]).await.unwrap()),
        ["snap-a", "snap-b"]
    );
    let refused = a
        .snapshot_run_with(&mine.id.to_string(), &snap(&[("bad key", "x")], "snap-c"))
        .await
        .unwrap_err();
    assert_eq!(refused.code(), Some(ErrorCode::BadLabels), "{refused}");
    for run in [mine, other_job, other_team, roots] {
        root.delete_run(&run.id.to_string()).await.unwrap();
    }
    for image in ["snap-a", "snap-b"] {
        a.delete_image(image).await.unwrap();
    }
    // Volumes carry labels too (a clone keeps its source's), and take the
    // same selector.
    let volume = |name: &str, pairs: &[(&str, &str)]| runbox_types::CreateVolumeRequest {
        name: name.into(),
        size_mb: Some(16),
        labels: Some(
            pairs
                .iter()
                .map(|(k, v)| ((*k).into(), (*v).into()))
                .collect(),
        ),
    };
    a.create_volume(&volume("va", &[("team", "a")]))
        .await
        .unwrap();
    a.create_volume(&volume("vb", &[("team", "b")]))
        .await
        .unwrap();
    let cloned = a
        .clone_volume(
            "va",
            &runbox_types::CloneVolumeRequest {
                name: "va2".into(),
                size_mb: None,
                labels: None,
            },
        )
        .await
        .unwrap();
    assert_eq!(cloned.labels.get("team").map(String::as_str), Some("a"));
    let names = |list: runbox_types::VolumeList| {
        let mut names: Vec<String> = list.volumes.into_iter().map(|v| v.name).collect();
        names.sort();
        names
    };
    assert_eq!(
        names(a.list_volumes_labelled(&["team=a"]).await.unwrap()),
        ["va", "va2"]
    );
    assert_eq!(
        names(a.list_volumes_labelled(&["team=b"]).await.unwrap()),
        ["vb"]
    );
    let refused = a
        .create_volume(&volume("vc", &[("bad key", "x")]))
        .await
        .unwrap_err();
    assert_eq!(refused.code(), Some(ErrorCode::BadLabels), "{refused}");
    let (status, _) = raw_request(&daemon.url, "GET", "/v1/volumes?team=a", &token, b"").await;
    assert_eq!(status, 400);
    for name in ["va", "vb", "va2"] {
        a.delete_volume(name).await.unwrap();
    }
}

/// The audit log says what was done, by whom, to which run: a command's
/// argv and cwd, the files written, moved and removed, lifecycle calls,
/// the run a create made; the run's tenant stays on its records after it
/// is deleted; no environment value ever appears. `runbox audit` reads it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_audit_log_says_what_was_done_and_by_whom() {
    let daemon = TestDaemon::start(None).await;
    let root = &daemon.client;
    let token = tenant(root, "acme", TenantPolicy::default()).await;
    let other_token = tenant(root, "beta", TenantPolicy::default()).await;
    let a = Client::new(&daemon.url, &token).unwrap();
    let b = Client::new(&daemon.url, &other_token).unwrap();
    const HIDDEN: &str = "env-value-never-logged-4711";
    let mut req = create("base");
    req.env = Some(runbox_types::Env(
        [("API_KEY".to_owned(), HIDDEN.to_owned())].into(),
    ));
    let run = a.create_run(&req).await.unwrap();
    let id = run.id.to_string();
    let theirs = b.create_run(&create("base")).await.unwrap();
    let exec = runbox_types::ExecRequest {
        cmd: vec!["sh".into(), "-c".into(), "echo $API_KEY > /dev/null".into()],
        cwd: Some("/work".into()),
        ..Default::default()
    };
    a.exec(&id, &exec)
        .await
        .unwrap()
        .collect_output()
        .await
        .unwrap();
    a.put_file(&id, "notes/a.txt", runbox_e2e::body(b"x".to_vec()))
        .await
        .unwrap();
    let (status, _) = raw_request(
        &daemon.url,
        "POST",
        &format!("/v1/runs/{id}/fs/remove"),
        &token,
        br#"{"path":"notes","recursive":true}"#,
    )
    .await;
    assert_eq!(status, 200);
    a.pause_run(&id).await.unwrap();
    a.delete_run(&id).await.unwrap();

    // Written once each call is answered.
    let records = loop {
        let records = root.audit(Some(&id), None, None, None).await.unwrap();
        if records.iter().any(|r| r["method"] == "DELETE") {
            break records;
        }
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    };
    let text = serde_json::to_string(&records).unwrap();
    assert!(
        !text.contains(HIDDEN),
        "an env value in the audit log: {text}"
    );
    let find = |what: &str| {
        records
            .iter()
            .find(|r| r["action"]["what"] == what)
            .unwrap_or_else(|| panic!("no {what} record in {text}"))
            .clone()
    };
    let created = find("create");
    assert_eq!(created["path"], "/v1/runs");
    assert_eq!(created["run"], id.as_str());
    assert_eq!(created["action"]["image"], "base");
    let command = find("command");
    assert_eq!(
        command["action"]["argv"],
        serde_json::json!(["sh", "-c", "echo $API_KEY > /dev/null"])
    );
    assert_eq!(command["action"]["cwd"], "/work");
    assert_eq!(command["action"]["mode"], "exec");
    assert_eq!(find("write")["action"]["path"], "notes/a.txt");
    let removed = find("remove");
    assert_eq!(
        (&removed["action"]["path"], &removed["action"]["recursive"]),
        (&serde_json::json!("notes"), &serde_json::json!(true))
    );
    for record in &records {
        // Every call names who asked and whose run it was, the delete too.
        if record["kind"] == "api" {
            assert_eq!(record["caller"], "tenant:acme", "{record}");
        }
        assert_eq!(record["tenant"], "acme", "{record}");
    }
    let paths: Vec<&str> = records.iter().filter_map(|r| r["path"].as_str()).collect();
    for want in [
        format!("/v1/runs/{id}/pause"),
        format!("/v1/runs/{id}"),
        format!("/v1/runs/{id}/exec"),
    ] {
        assert!(paths.contains(&want.as_str()), "{want} in {paths:?}");
    }
    // What happened to the run, whatever caused it, from the usage journal.
    let transitions: Vec<&str> = records
        .iter()
        .filter(|r| r["kind"] == "lifecycle")
        .filter_map(|r| r["transition"].as_str())
        .collect();
    for want in ["create", "pause", "delete"] {
        assert!(transitions.contains(&want), "{want} in {transitions:?}");
    }
    // A transition nobody asked for: a TTL's end.
    let mut short = create("base");
    short.ttl_sec = Some(1);
    let short = a.create_run(&short).await.unwrap().id.to_string();
    let expired = runbox_e2e::eventually_async(std::time::Duration::from_secs(30), || async {
        root.audit(Some(&short), None, None, None)
            .await
            .unwrap()
            .iter()
            .any(|r| r["transition"] == "expire" && r["tenant"] == "acme")
    })
    .await;
    assert!(expired, "no expire record for {short}");
    // By tenant: acme's calls, never beta's run.
    let acme = root
        .audit(None, Some("acme"), Some("1h"), None)
        .await
        .unwrap();
    assert!(acme.iter().any(|r| r["run"] == id.as_str()));
    assert!(!acme
        .iter()
        .any(|r| r["run"] == theirs.id.to_string().as_str()));
    // The operator's only.
    let refused = a.audit(None, None, None, None).await.unwrap_err();
    assert_eq!(refused.status(), Some(403), "{refused}");
    let (status, text) = raw_request(
        &daemon.url,
        "GET",
        "/v1/audit?since=yesterday",
        &daemon.token,
        b"",
    )
    .await;
    assert_eq!(status, 400, "{text}");
    // The CLI.
    let out = std::process::Command::new(runbox_e2e::runbox_bin())
        .args([
            "audit",
            "--run",
            &id,
            "--url",
            &daemon.url,
            "--token",
            &daemon.token,
        ])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let table = String::from_utf8_lossy(&out.stdout);
    assert!(
        table.contains("exec sh -c echo $API_KEY > /dev/null (cwd /work)"),
        "{table}"
    );
    assert!(table.contains("remove notes"), "{table}");
    root.delete_run(&theirs.id.to_string()).await.unwrap();
}
