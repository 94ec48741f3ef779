//! `GET /metrics`: the daemon's Prometheus metrics, in the Prometheus text
//! format (prometheus-client's encoder). Root token only on the API
//! listener; `runbox serve --metrics-listen ADDR` serves the same document
//! without a token on a listener of its own (loopback unless the operator
//! says otherwise).
//!
//! API requests are counted as they are answered (by route pattern, never
//! by path, so ids do not make new series), and their errors by stable
//! code; the core reports creates, claims, forks, wakes, exec starts and
//! restarts as they happen ([`runbox_core::telemetry::Telemetry`]), the
//! audit log every egress decision; the node's state (runs by phase,
//! capacity, pools, storage, tenants, and on a node of a fleet the fleet's
//! nodes as the cluster database lists them) is read at each scrape, and
//! requests sent on to another node are counted by that node.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::extract::{MatchedPath, Request, State};
use axum::http::{header, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;
use runbox_core::telemetry::{Outcome, Start, Telemetry};
use runbox_core::RunService;
use runbox_proxy::audit::AuditRecord;
use runbox_types::ErrorCode;

use crate::AppState;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct RequestLabels {
    route: String,
    method: String,
    status: u16,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct RouteLabels {
    route: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ErrorLabels {
    route: String,
    code: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct StartLabels {
    how: String,
    outcome: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct HowLabels {
    how: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct OutcomeLabels {
    outcome: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct EgressLabels {
    decision: String,
    /// What decided: the list an allow came from (`run`, `deployment`,
    /// `default`), `none` for a deny by no rule, `guard` for the guard.
    source: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct PhaseLabels {
    phase: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct PoolLabels {
    image: String,
    network: String,
    size: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct NodeLabels {
    node: String,
    version: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct NodeStateLabels {
    state: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct RelayLabels {
    /// The node the request was sent to.
    node: String,
    /// `answered` (the node answered, whatever it said) or `unreachable`.
    outcome: String,
}

/// A series without labels that is absent until it is first set.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct NoLabels {}

type Latency = Family<RouteLabels, Histogram, fn() -> Histogram>;

fn latency_histogram() -> Histogram {
    // 0.5 ms to about 16 s.
    Histogram::new(exponential_buckets(0.0005, 2.0, 16))
}

/// The metrics and their registry. Cheap to share behind an `Arc`.
pub struct Metrics {
    registry: Registry,
    requests: Family<RequestLabels, Counter>,
    latency: Latency,
    errors: Family<ErrorLabels, Counter>,
    starts: Family<StartLabels, Counter>,
    start_latency: Family<HowLabels, Histogram, fn() -> Histogram>,
    wakes: Family<OutcomeLabels, Counter>,
    wake_latency: Histogram,
    /// `execs` with outcome `ok` and `error`, looked up once: every exec
    /// counts.
    execs: [Counter; 2],
    exec_latency: Histogram,
    restarts: Counter,
    egress: Family<EgressLabels, Counter>,
    runs: Family<PhaseLabels, Gauge>,
    capacity_max: Gauge,
    capacity_live: Gauge,
    capacity_creating: Gauge,
    pooled: Gauge,
    pool_ready: Family<PoolLabels, Gauge>,
    pool_target: Family<PoolLabels, Gauge>,
    pool_claims: Family<PoolLabels, Gauge>,
    storage_used: Gauge,
    node: Family<NodeLabels, Gauge>,
    fleet_nodes: Family<NodeStateLabels, Gauge>,
    /// Without labels, and set only on a node of a fleet (a node alone
    /// shows no value rather than a database that is down).
    fleet_database_up: Family<NoLabels, Gauge>,
    relayed: Family<RelayLabels, Counter>,
    storage_total: Gauge,
    tenants: Gauge,
    draining: Gauge,
    /// Scrapes update the gauges one at a time.
    scrape: Mutex<()>,
    /// False with `--no-metrics`: nothing is counted, scrapes are 404.
    on: bool,
}

impl Default for Metrics {
    fn default() -> Metrics {
        Metrics::new()
    }
}

impl Metrics {
    /// A registry with every metric, all zero.
    pub fn new() -> Metrics {
        let mut registry = Registry::with_prefix("runbox");
        let requests = Family::<RequestLabels, Counter>::default();
        registry.register(
            "api_requests",
            "API requests answered, by route pattern, method and status",
            requests.clone(),
        );
        let latency: Latency = Family::new_with_constructor(latency_histogram);
        registry.register(
            "api_request_duration_seconds",
            "Time from a request to its answer's head (a stream's head, not its end), by route pattern",
            latency.clone(),
        );
        let errors = Family::<ErrorLabels, Counter>::default();
        registry.register(
            "api_errors",
            "API error answers by route pattern and stable error code (agent_unavailable: the run's agent failed a call)",
            errors.clone(),
        );
        let starts = Family::<StartLabels, Counter>::default();
        registry.register(
            "run_starts",
            "Runs asked for, by how they came to be (cold create, pool claim, fork) and outcome",
            starts.clone(),
        );
        let start_latency: Family<HowLabels, Histogram, fn() -> Histogram> =
            Family::new_with_constructor(latency_histogram);
        registry.register(
            "run_start_duration_seconds",
            "Time from a create, claim or fork request to its run (successful ones)",
            start_latency.clone(),
        );
        let wakes = Family::<OutcomeLabels, Counter>::default();
        registry.register(
            "run_wakes",
            "Hibernated or failed runs booted again, by a call or by traffic",
            wakes.clone(),
        );
        let wake_latency = latency_histogram();
        registry.register(
            "run_wake_duration_seconds",
            "Time to wake a run (successful wakes)",
            wake_latency.clone(),
        );
        let execs = Family::<OutcomeLabels, Counter>::default();
        registry.register(
            "execs",
            "Commands started in runs (exec, processes, terminals), by outcome",
            execs.clone(),
        );
        let execs = [Outcome::Ok, Outcome::Error].map(|outcome| {
            execs
                .get_or_create(&OutcomeLabels {
                    outcome: outcome.as_str().to_owned(),
                })
                .clone()
        });
        let exec_latency = latency_histogram();
        registry.register(
            "exec_start_duration_seconds",
            "Time from an exec request to the agent's word that the command runs (successful starts)",
            exec_latency.clone(),
        );
        let restarts = Counter::default();
        registry.register(
            "run_restarts",
            "Runs booted again after their init exited on its own",
            restarts.clone(),
        );
        let egress = Family::<EgressLabels, Counter>::default();
        registry.register(
            "egress_decisions",
            "Egress requests the proxy decided, by decision and what decided",
            egress.clone(),
        );
        let runs = Family::<PhaseLabels, Gauge>::default();
        registry.register("runs", "Runs the API shows, by phase", runs.clone());
        let gauge = |registry: &mut Registry, name: &str, help: &str| {
            let g = Gauge::default();
            registry.register(name, help, g.clone());
            g
        };
        let capacity_max = gauge(&mut registry, "capacity_max_runs", "--max-runs");
        let capacity_live = gauge(
            &mut registry,
            "capacity_live_runs",
            "Runs counted against --max-runs",
        );
        let capacity_creating = gauge(
            &mut registry,
            "capacity_creating_runs",
            "Runs being created",
        );
        let pooled = gauge(
            &mut registry,
            "pooled_runs",
            "Idle warm pool members, ready or being made",
        );
        let pool_ready = Family::<PoolLabels, Gauge>::default();
        registry.register(
            "pool_ready",
            "Ready members of each warm pool",
            pool_ready.clone(),
        );
        let pool_target = Family::<PoolLabels, Gauge>::default();
        registry.register(
            "pool_target",
            "Each warm pool's target",
            pool_target.clone(),
        );
        let pool_claims = Family::<PoolLabels, Gauge>::default();
        registry.register(
            "pool_claims",
            "Creates each warm pool served since the daemon started",
            pool_claims.clone(),
        );
        let storage_used = gauge(
            &mut registry,
            "storage_used_bytes",
            "Bytes in use on the run store's filesystem",
        );
        let storage_total = gauge(
            &mut registry,
            "storage_total_bytes",
            "Size of the run store's filesystem",
        );
        let tenants = gauge(&mut registry, "tenants", "Tenants the node holds");
        let draining = gauge(&mut registry, "draining", "1 while the node is cordoned");
        let node = Family::<NodeLabels, Gauge>::default();
        registry.register(
            "node_info",
            "1, labelled with this node's id (its server id) and version",
            node.clone(),
        );
        let fleet_nodes = Family::<NodeStateLabels, Gauge>::default();
        registry.register(
            "fleet_nodes",
            "On a node of a fleet: the fleet's nodes in each state, as the cluster database lists them",
            fleet_nodes.clone(),
        );
        let fleet_database_up = Family::<NoLabels, Gauge>::default();
        registry.register(
            "fleet_database_up",
            "On a node of a fleet: 1 while the cluster database answers, 0 while it does not",
            fleet_database_up.clone(),
        );
        let relayed = Family::<RelayLabels, Counter>::default();
        registry.register(
            "fleet_relayed",
            "Requests this node answered by sending them on to another node of the fleet",
            relayed.clone(),
        );
        Metrics {
            registry,
            requests,
            latency,
            errors,
            starts,
            start_latency,
            wakes,
            wake_latency,
            execs,
            exec_latency,
            restarts,
            egress,
            runs,
            capacity_max,
            capacity_live,
            capacity_creating,
            pooled,
            pool_ready,
            pool_target,
            pool_claims,
            storage_used,
            storage_total,
            tenants,
            draining,
            node,
            fleet_nodes,
            fleet_database_up,
            relayed,
            scrape: Mutex::new(()),
            on: true,
        }
    }

    /// Metrics that count nothing: `GET /metrics` answers 404.
    pub fn off() -> Metrics {
        Metrics {
            on: false,
            ..Metrics::new()
        }
    }

    /// Counts one answered request.
    pub fn observe(&self, route: &str, method: &str, status: u16, seconds: f64) {
        self.requests
            .get_or_create(&RequestLabels {
                route: route.to_owned(),
                method: method.to_owned(),
                status,
            })
            .inc();
        self.latency
            .get_or_create(&RouteLabels {
                route: route.to_owned(),
            })
            .observe(seconds);
    }

    /// Counts an error answer of `route` by its stable code.
    fn observe_error(&self, route: &str, code: ErrorCode) {
        self.errors
            .get_or_create(&ErrorLabels {
                route: route.to_owned(),
                code: code.as_str().to_owned(),
            })
            .inc();
    }

    /// Counts what the audit log records that the metrics follow: egress
    /// decisions. (`AuditLog::observe` calls it for every record.)
    pub fn count_audit(&self, record: &AuditRecord) {
        if let AuditRecord::Egress { decision, rule, .. } = record {
            let source = rule.split(':').next().unwrap_or_default();
            self.egress
                .get_or_create(&EgressLabels {
                    decision: decision.clone(),
                    source: source.to_owned(),
                })
                .inc();
        }
    }

    /// The document, with the node's state read from `service` now, and
    /// on a node of a fleet what the cluster database says of the fleet
    /// (`fleet`: its nodes, or None while it does not answer).
    pub fn render<S: RunService>(
        &self,
        service: &S,
        fleet: Option<Option<&[runbox_types::ClusterNode]>>,
    ) -> String {
        let _one = self.scrape.lock().unwrap_or_else(|p| p.into_inner());
        let info = service.info();
        self.node
            .get_or_create(&NodeLabels {
                node: service.server_id().to_owned(),
                version: env!("CARGO_PKG_VERSION").to_owned(),
            })
            .set(1);
        self.fleet_nodes.clear();
        match fleet {
            None => {}
            Some(None) => {
                self.fleet_database_up.get_or_create(&NoLabels {}).set(0);
            }
            Some(Some(nodes)) => {
                self.fleet_database_up.get_or_create(&NoLabels {}).set(1);
                for state in [
                    runbox_types::NodeState::Active,
                    runbox_types::NodeState::Draining,
                    runbox_types::NodeState::Suspect,
                    runbox_types::NodeState::Gone,
                ] {
                    let count = nodes.iter().filter(|n| n.state == state).count();
                    self.fleet_nodes
                        .get_or_create(&NodeStateLabels {
                            state: state.as_str().to_owned(),
                        })
                        .set(i64::try_from(count).unwrap_or(i64::MAX));
                }
            }
        }
        self.runs.clear();
        for run in service.list() {
            self.runs
                .get_or_create(&PhaseLabels {
                    phase: serde_json::to_value(run.status)
                        .ok()
                        .and_then(|v| v.as_str().map(str::to_owned))
                        .unwrap_or_default(),
                })
                .inc();
        }
        let set = |g: &Gauge, v: u64| {
            g.set(i64::try_from(v).unwrap_or(i64::MAX));
        };
        set(&self.capacity_max, info.capacity.max as u64);
        set(&self.capacity_live, info.capacity.live as u64);
        set(&self.capacity_creating, info.capacity.creating as u64);
        set(&self.pooled, info.capacity.pooled as u64);
        self.pool_ready.clear();
        self.pool_target.clear();
        self.pool_claims.clear();
        for pool in &info.pools {
            let labels = PoolLabels {
                image: pool.image.clone(),
                network: pool.network.as_str().to_owned(),
                size: pool.size.as_str().to_owned(),
            };
            set(&self.pool_ready.get_or_create(&labels), pool.ready.into());
            set(&self.pool_target.get_or_create(&labels), pool.target.into());
            set(&self.pool_claims.get_or_create(&labels), pool.claims);
        }
        if let Some(storage) = info.storage {
            set(&self.storage_used, storage.used_bytes);
            set(&self.storage_total, storage.total_bytes);
        }
        set(&self.tenants, service.tenants().list().len() as u64);
        set(&self.draining, u64::from(info.draining));
        let mut out = String::new();
        if let Err(e) =
            prometheus_client::encoding::prometheus_text::encode(&mut out, &self.registry)
        {
            tracing::error!(error = %e, "encoding the metrics failed");
        }
        out
    }
}

impl Telemetry for Metrics {
    fn started(&self, how: Start, outcome: Outcome, took: Duration) {
        self.starts
            .get_or_create(&StartLabels {
                how: how.as_str().to_owned(),
                outcome: outcome.as_str().to_owned(),
            })
            .inc();
        if outcome == Outcome::Ok {
            self.start_latency
                .get_or_create(&HowLabels {
                    how: how.as_str().to_owned(),
                })
                .observe(took.as_secs_f64());
        }
    }

    fn woke(&self, outcome: Outcome, took: Duration) {
        self.wakes
            .get_or_create(&OutcomeLabels {
                outcome: outcome.as_str().to_owned(),
            })
            .inc();
        if outcome == Outcome::Ok {
            self.wake_latency.observe(took.as_secs_f64());
        }
    }

    fn exec_started(&self, outcome: Outcome, took: Duration) {
        match outcome {
            Outcome::Ok => {
                self.execs[0].inc();
                self.exec_latency.observe(took.as_secs_f64());
            }
            Outcome::Error => {
                self.execs[1].inc();
            }
        }
    }

    fn restarted(&self) {
        self.restarts.inc();
    }
}

/// The answer to a scrape.
async fn document<S: RunService>(state: &AppState<S>) -> Response {
    if !state.metrics.on {
        return crate::ApiError::new(
            ErrorCode::NotFound,
            "this daemon keeps no metrics (runbox serve --no-metrics)",
        )
        .into_response();
    }
    let nodes = match state.service.in_fleet() {
        true => Some(state.service.cluster().await.ok().map(|c| c.nodes)),
        false => None,
    };
    let fleet = nodes.as_ref().map(|n| n.as_deref());
    let body = state.metrics.render(&state.service, fleet);
    (
        StatusCode::OK,
        [(
            header::CONTENT_TYPE,
            prometheus_client::encoding::prometheus_text::CONTENT_TYPE,
        )],
        body,
    )
        .into_response()
}

/// `GET /metrics` on the API listener (root token: see `auth::rule`).
pub async fn scrape<S: RunService>(State(state): State<AppState<S>>) -> Response {
    document(&state).await
}

/// Counts the requests this node answered by sending them on to another
/// node of the fleet (`forward::send_on` marks the answer with
/// [`crate::forward::Relayed`]). Outside every route, so E2B's envd and
/// host-named requests count too.
pub(crate) async fn count_relayed<S: RunService>(
    State(state): State<AppState<S>>,
    request: Request,
    next: Next,
) -> Response {
    let response = next.run(request).await;
    if state.metrics.on {
        if let Some(relayed) = response.extensions().get::<crate::forward::Relayed>() {
            let outcome = match response.extensions().get::<ErrorCode>() {
                Some(ErrorCode::NodeUnavailable) => "unreachable",
                _ => "answered",
            };
            state
                .metrics
                .relayed
                .get_or_create(&RelayLabels {
                    node: relayed.0.clone(),
                    outcome: outcome.to_owned(),
                })
                .inc();
        }
    }
    response
}

/// Counts every answered API request by its route pattern.
pub(crate) async fn count<S: RunService>(
    State(state): State<AppState<S>>,
    request: Request,
    next: Next,
) -> Response {
    if !state.metrics.on {
        return next.run(request).await;
    }
    let route = request
        .extensions()
        .get::<MatchedPath>()
        .map(|p| p.as_str().to_owned())
        .unwrap_or_else(|| "unmatched".to_owned());
    let method = request.method().as_str().to_owned();
    let started = Instant::now();
    let response = next.run(request).await;
    state.metrics.observe(
        &route,
        &method,
        response.status().as_u16(),
        started.elapsed().as_secs_f64(),
    );
    if let Some(code) = response.extensions().get::<ErrorCode>() {
        state.metrics.observe_error(&route, *code);
    }
    response
}

/// The router of `--metrics-listen`: `GET /metrics` with no token, and
/// nothing else.
pub fn metrics_router<S: RunService>(state: AppState<S>) -> axum::Router {
    let state = Arc::new(state);
    axum::Router::new().route(
        "/metrics",
        axum::routing::get(move || {
            let state = state.clone();
            async move { document(&state).await }
        }),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requests_are_counted_by_route_pattern() {
        let metrics = Metrics::new();
        metrics.observe("/v1/runs/{id}", "GET", 404, 0.002);
        metrics.observe("/v1/runs/{id}", "GET", 404, 0.004);
        let mut out = String::new();
        prometheus_client::encoding::prometheus_text::encode(&mut out, &metrics.registry).unwrap();
        assert!(
            out.contains(
                "runbox_api_requests_total{route=\"/v1/runs/{id}\",method=\"GET\",status=\"404\"} 2"
            ),
            "{out}"
        );
        assert!(
            out.contains("runbox_api_request_duration_seconds_count{route=\"/v1/runs/{id}\"} 2")
        );
        assert!(
            out.contains("# TYPE runbox_capacity_max_runs gauge"),
            "{out}"
        );
    }

    #[test]
    fn the_fleets_database_is_said_only_on_a_node_of_a_fleet() {
        let metrics = Metrics::new();
        let encode = |metrics: &Metrics| {
            let mut out = String::new();
            prometheus_client::encoding::prometheus_text::encode(&mut out, &metrics.registry)
                .unwrap();
            out
        };
        let alone = encode(&metrics);
        assert!(
            !alone
                .lines()
                .any(|l| l.starts_with("runbox_fleet_database_up")),
            "{alone}"
        );
        metrics.fleet_database_up.get_or_create(&NoLabels {}).set(1);
        let fleet = encode(&metrics);
        assert!(
            fleet.lines().any(|l| l == "runbox_fleet_database_up 1"),
            "{fleet}"
        );
    }

    #[test]
    fn core_reports_and_egress_decisions_are_counted() {
        let metrics = Metrics::new();
        metrics.started(Start::Claim, Outcome::Ok, Duration::from_millis(5));
        metrics.started(Start::Cold, Outcome::Error, Duration::from_millis(1));
        metrics.exec_started(Outcome::Ok, Duration::from_millis(2));
        metrics.restarted();
        let egress = |decision: &str, rule: &str| AuditRecord::Egress {
            t: String::new(),
            run: "r".into(),
            method: "GET".into(),
            host: "example.org".into(),
            port: 80,
            decision: decision.into(),
            rule: rule.into(),
            secret: None,
            upstream: None,
        };
        metrics.count_audit(&egress("allow", "run:example.org"));
        metrics.count_audit(&egress("deny", "guard:private"));
        metrics.count_audit(&egress("deny", "guard:loopback"));
        let mut out = String::new();
        prometheus_client::encoding::prometheus_text::encode(&mut out, &metrics.registry).unwrap();
        for line in [
            "runbox_run_starts_total{how=\"claim\",outcome=\"ok\"} 1",
            "runbox_run_starts_total{how=\"cold\",outcome=\"error\"} 1",
            "runbox_run_start_duration_seconds_count{how=\"claim\"} 1",
            "runbox_execs_total{outcome=\"ok\"} 1",
            "runbox_execs_total{outcome=\"error\"} 0",
            "runbox_run_restarts_total 1",
            "runbox_egress_decisions_total{decision=\"allow\",source=\"run\"} 1",
            "runbox_egress_decisions_total{decision=\"deny\",source=\"guard\"} 2",
        ] {
            assert!(out.lines().any(|l| l == line), "{line} in\n{out}");
        }
        // A failed create has no latency sample.
        assert!(!out.contains("runbox_run_start_duration_seconds_count{how=\"cold\"}"));
    }
}
