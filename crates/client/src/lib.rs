//! Rust SDK for runbox's HTTP API.
//!
//! [`Client`] wraps one daemon's base URL and bearer token and exposes one
//! async method per route of the API (see `docs/api.md`). The
//! wire types are `runbox-types`' own, re-exported here as [`types`], so a
//! caller needs no second dependency.
//!
//! What this crate owns: URL building and percent-encoding, the bearer
//! header, turning error bodies into [`ClientError::Api`], decoding the exec
//! event stream, and streaming uploads and downloads without buffering them.
//! What it does not: retries (uploads are streams and cannot be replayed),
//! validation the server does anyway, TLS (the daemon speaks plain HTTP).
//!
//! ```no_run
//! # async fn demo() -> Result<(), runbox_client::ClientError> {
//! use runbox_client::{types::{CreateRunRequest, ExecRequest}, Client};
//!
//! let client = Client::new("http://127.0.0.1:7439", "token")?;
//! let run = client
//!     .create_run(&CreateRunRequest { image: "base".into(), ..Default::default() })
//!     .await?;
//! let id = run.id.to_string();
//! let req = ExecRequest { cmd: vec!["echo".into(), "hi".into()], ..Default::default() };
//! let output = client.exec(&id, &req).await?.collect_output().await?;
//! assert_eq!(output.stdout, b"hi\n");
//! client.delete_run(&id).await?;
//! # Ok(())
//! # }
//! ```

mod body;
mod build;
mod error;
mod exec;
mod paths;
mod pull;
mod session;
mod sse;

use std::time::Duration;

use bytes::Bytes;
use futures::TryStreamExt as _;
use reqwest::header::{HeaderValue, ACCEPT, CONTENT_LENGTH, CONTENT_TYPE};
use reqwest::{Method, RequestBuilder, Response};
use serde::de::DeserializeOwned;

pub use runbox_types as types;
use runbox_types::{
    CreateRunRequest, ExecRequest, Health, Image, ImageList, Lease, LeaseReleaseRequest,
    LeaseRenewRequest, LeaseRequest, LeaseResponse, RenewRequest, Run, RunList,
};

/// A writable lease's credential: who holds it and the generation the grant
/// returned. Execs carry it in their body (`ExecRequest::owner`/`generation`),
/// file writes in their query string.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LeaseCredential {
    /// The holder's name.
    pub owner: String,
    /// The generation of its grant.
    pub generation: u64,
}

impl From<&Lease> for LeaseCredential {
    fn from(lease: &Lease) -> LeaseCredential {
        LeaseCredential {
            owner: lease.holder.clone(),
            generation: lease.generation,
        }
    }
}

pub use body::{FileDownload, UploadBody};
pub use build::{decode_build_events, BuildStream, BuildUpdate};
pub use error::{BoxError, ClientError};
pub use exec::{decode_event, decode_exec_events, ExecEvent, ExecOutput, ExecStream};
pub use pull::{decode_pull_events, PullStream, PullUpdate};
pub use session::{Session, SessionWriter};

/// How long to wait for a TCP connection. There is deliberately no overall
/// request timeout: exec streams and file transfers last as long as they last.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

/// Largest error body read; error bodies are a few hundred bytes.
const MAX_ERROR_BODY: usize = 64 * 1024;

/// A connection to one runbox daemon.
///
/// Cheap to clone (the connection pool is shared). Every method is
/// cancel-safe in the sense that dropping its future drops the request; an
/// operation the server had already begun (a create, a delete) may still
/// complete on the server.
#[derive(Clone)]
pub struct Client {
    http: reqwest::Client,
    base: String,
    token: Option<String>,
}

impl std::fmt::Debug for Client {
    // By hand so that the token never reaches a log line.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Client")
            .field("base", &self.base)
            .field("token", &self.token.as_ref().map(|_| "<redacted>"))
            .finish_non_exhaustive()
    }
}

impl Client {
    /// A client for the daemon at `base_url` (e.g. `http://127.0.0.1:7439`,
    /// optionally with a path prefix) that authenticates with `token`.
    pub fn new(base_url: &str, token: impl Into<String>) -> Result<Client, ClientError> {
        Self::with_http_client(default_http()?, base_url, Some(token.into()))
    }

    /// A client without a token; only [`Client::health`] works with it.
    pub fn anonymous(base_url: &str) -> Result<Client, ClientError> {
        Self::with_http_client(default_http()?, base_url, None)
    }

    /// A client on a caller-built `reqwest::Client` (for custom timeouts or
    /// connection pooling). Redirects should stay disabled on it: streamed
    /// bodies cannot be replayed.
    pub fn with_http_client(
        http: reqwest::Client,
        base_url: &str,
        token: Option<String>,
    ) -> Result<Client, ClientError> {
        Ok(Client {
            http,
            base: paths::parse_base(base_url)?,
            token,
        })
    }

    /// The base URL requests go to, without a trailing slash.
    pub fn base_url(&self) -> &str {
        &self.base
    }

    /// `GET /health`: whether the daemon serves requests, and its version.
    pub async fn health(&self) -> Result<Health, ClientError> {
        let resp = self.send(self.request(Method::GET, "/health")).await?;
        json(resp).await
    }

    /// `POST /v1/runs`: creates a run and waits until it is usable.
    ///
    /// Safe on a flaky network: the request carries a fresh
    /// `Idempotency-Key`, and when it cannot be sent or its answer is lost it
    /// is sent again (up to three times in all, 0.2 s then 0.4 s apart)
    /// with the same key, so the server answers with the run the first
    /// attempt made instead of making a second.
    pub async fn create_run(&self, req: &CreateRunRequest) -> Result<Run, ClientError> {
        let key = ulid::Ulid::new().to_string();
        let mut delay = std::time::Duration::from_millis(200);
        let mut attempts = CREATE_ATTEMPTS;
        loop {
            attempts -= 1;
            match self.create_run_with_key(req, &key).await {
                Err(ClientError::Http(e)) if attempts > 0 && retryable(&e) => {
                    tokio::time::sleep(delay).await;
                    delay *= 2;
                }
                other => return other,
            }
        }
    }

    /// `POST /v1/runs` with the given `Idempotency-Key`, once: a repeat with
    /// the same key and request answers with the run the first one made.
    pub async fn create_run_with_key(
        &self,
        req: &CreateRunRequest,
        idempotency_key: &str,
    ) -> Result<Run, ClientError> {
        let resp = self
            .send(
                self.request(Method::POST, "/v1/runs")
                    .header("idempotency-key", idempotency_key)
                    .json(req),
            )
            .await?;
        json(resp).await
    }

    /// `GET /v1/runs`: every run on the node.
    pub async fn list_runs(&self) -> Result<RunList, ClientError> {
        self.list_runs_labelled(&[]).await
    }

    /// `GET /v1/runs?label=...`: the runs whose labels match every term of
    /// `selector`, each `KEY=VALUE` (the label has that value) or `KEY`
    /// (the label is set).
    pub async fn list_runs_labelled(&self, selector: &[&str]) -> Result<RunList, ClientError> {
        let path = format!("/v1/runs{}", paths::label_query(selector));
        let resp = self.send(self.request(Method::GET, &path)).await?;
        json(resp).await
    }

    /// `GET /v1/runs/{id}`.
    pub async fn get_run(&self, id: &str) -> Result<Run, ClientError> {
        let resp = self.send(self.request(Method::GET, &run_path(id)?)).await?;
        json(resp).await
    }

    /// `DELETE /v1/runs/{id}`: destroys the run and everything in it.
    pub async fn delete_run(&self, id: &str) -> Result<(), ClientError> {
        self.send(self.request(Method::DELETE, &run_path(id)?))
            .await?;
        Ok(())
    }

    /// `POST /v1/runs/{id}/renew`: the run now expires `ttl_sec` seconds from
    /// now (capped by the server).
    pub async fn renew_run(&self, id: &str, ttl_sec: u64) -> Result<Run, ClientError> {
        let path = format!("{}/renew", run_path(id)?);
        let resp = self
            .send(
                self.request(Method::POST, &path)
                    .json(&RenewRequest { ttl_sec }),
            )
            .await?;
        json(resp).await
    }

    /// `PATCH /v1/runs/{id}/egress`: replaces the run's egress entries,
    /// secrets and tier (`none` or `allowlist`) while it lives.
    pub async fn update_run_egress(
        &self,
        id: &str,
        req: &runbox_types::UpdateEgressRequest,
    ) -> Result<Run, ClientError> {
        let path = format!("{}/egress", run_path(id)?);
        let resp = self
            .send(self.request(Method::PATCH, &path).json(req))
            .await?;
        json(resp).await
    }

    /// `POST /v1/runs/{id}/pause`: freezes the run's processes where they
    /// are, memory kept; the next call that reaches the run resumes it.
    pub async fn pause_run(&self, id: &str) -> Result<Run, ClientError> {
        let path = format!("{}/pause", run_path(id)?);
        json(self.send(self.request(Method::POST, &path)).await?).await
    }

    /// `POST /v1/runs/{id}/resume`: lets a paused run's processes go on.
    pub async fn resume_run(&self, id: &str) -> Result<Run, ClientError> {
        let path = format!("{}/resume", run_path(id)?);
        json(self.send(self.request(Method::POST, &path)).await?).await
    }

    /// `POST /v1/runs/{id}/hibernate`: stops the run down to its disk
    /// (its processes and memory are lost; the next call wakes it).
    pub async fn hibernate_run(&self, id: &str) -> Result<Run, ClientError> {
        let path = format!("{}/hibernate", run_path(id)?);
        json(self.send(self.request(Method::POST, &path)).await?).await
    }

    /// `POST /v1/runs/{id}/archive`: sends the run's disk to the server's
    /// checkpoint store and drops it on the node (the next call restores
    /// it).
    pub async fn archive_run(&self, id: &str) -> Result<Run, ClientError> {
        let path = format!("{}/archive", run_path(id)?);
        json(self.send(self.request(Method::POST, &path)).await?).await
    }

    /// `POST /v1/runs/{id}/move`: moves the run to node `node` of the
    /// fleet (the best node that can take it when None); the run as its
    /// new node answers for it.
    pub async fn move_run(&self, id: &str, node: Option<String>) -> Result<Run, ClientError> {
        let path = format!("{}/move", run_path(id)?);
        let req = runbox_types::RunMoveRequest { node };
        json(
            self.send(self.request(Method::POST, &path).json(&req))
                .await?,
        )
        .await
    }

    /// `POST /v1/runs/{id}/wake`: boots a hibernated or failed run again
    /// on its disk (resumes a paused one).
    pub async fn wake_run(&self, id: &str) -> Result<Run, ClientError> {
        let path = format!("{}/wake", run_path(id)?);
        json(self.send(self.request(Method::POST, &path)).await?).await
    }

    /// `POST /v1/runs/{id}/snapshot`: records the run's filesystem as an
    /// image (named `name`, or a generated `snap-…`).
    pub async fn snapshot_run(
        &self,
        id: &str,
        name: Option<&str>,
    ) -> Result<runbox_types::Snapshot, ClientError> {
        let req = runbox_types::SnapshotRequest {
            name: name.map(str::to_owned),
            labels: None,
            point: None,
        };
        self.snapshot_run_with(id, &req).await
    }

    /// `POST /v1/runs/{id}/snapshot` with the whole request (labels too).
    pub async fn snapshot_run_with(
        &self,
        id: &str,
        req: &runbox_types::SnapshotRequest,
    ) -> Result<runbox_types::Snapshot, ClientError> {
        let path = format!("{}/snapshot", run_path(id)?);
        let resp = self
            .send(self.request(Method::POST, &path).json(&req))
            .await?;
        json(resp).await
    }

    /// `POST /v1/runs/{id}/checkpoint`: sends the run's disk and settings
    /// to the server's checkpoint store; the run keeps running.
    pub async fn checkpoint_run(
        &self,
        id: &str,
        req: &runbox_types::CheckpointRequest,
    ) -> Result<runbox_types::Checkpoint, ClientError> {
        let path = format!("{}/checkpoint", run_path(id)?);
        let resp = self
            .send(self.request(Method::POST, &path).json(req))
            .await?;
        json(resp).await
    }

    /// `GET /v1/checkpoints`.
    pub async fn list_checkpoints(&self) -> Result<runbox_types::CheckpointList, ClientError> {
        self.list_checkpoints_labelled(&[]).await
    }

    /// `GET /v1/checkpoints?label=...`, filtered as
    /// [`Client::list_runs_labelled`] is.
    pub async fn list_checkpoints_labelled(
        &self,
        selector: &[&str],
    ) -> Result<runbox_types::CheckpointList, ClientError> {
        let path = format!("/v1/checkpoints{}", paths::label_query(selector));
        json(self.send(self.request(Method::GET, &path)).await?).await
    }

    /// `GET /v1/checkpoints/{id}`.
    pub async fn get_checkpoint(&self, id: &str) -> Result<runbox_types::Checkpoint, ClientError> {
        let path = format!("/v1/checkpoints/{}", paths::segment("checkpoint id", id)?);
        json(self.send(self.request(Method::GET, &path)).await?).await
    }

    /// `DELETE /v1/checkpoints/{id}`.
    pub async fn delete_checkpoint(&self, id: &str) -> Result<(), ClientError> {
        let path = format!("/v1/checkpoints/{}", paths::segment("checkpoint id", id)?);
        self.send(self.request(Method::DELETE, &path)).await?;
        Ok(())
    }

    /// `POST /v1/runs/{id}/fork`: `count` new runs starting from the run's
    /// filesystem as it is now.
    pub async fn fork_run(
        &self,
        id: &str,
        req: &runbox_types::ForkRequest,
    ) -> Result<runbox_types::ForkResponse, ClientError> {
        let path = format!("{}/fork", run_path(id)?);
        let resp = self
            .send(self.request(Method::POST, &path).json(req))
            .await?;
        json(resp).await
    }

    /// `GET /v1/runs/{id}/history`: the run's history points, newest first.
    pub async fn history(&self, id: &str) -> Result<runbox_types::HistoryList, ClientError> {
        let path = format!("{}/history", run_path(id)?);
        json(self.send(self.request(Method::GET, &path)).await?).await
    }

    /// `GET /v1/runs/{id}/history/{point}/diff`: what `point` changed
    /// (against its parent, or `query.against`).
    pub async fn history_diff(
        &self,
        id: &str,
        point: &str,
        query: &runbox_types::HistoryDiffQuery,
    ) -> Result<runbox_types::HistoryDiff, ClientError> {
        let mut route = format!(
            "{}/history/{}/diff?limit={}",
            run_path(id)?,
            paths::segment("history point", point)?,
            query.limit.unwrap_or(1000)
        );
        if let Some(against) = query.against {
            route.push_str(&format!("&against={against}"));
        }
        if query.patch == Some(true) {
            route.push_str("&patch=true");
        }
        json(self.send(self.request(Method::GET, &route)).await?).await
    }

    /// `POST /v1/runs/{id}/rollback`: returns the run's files to `point`.
    pub async fn rollback(
        &self,
        id: &str,
        req: &runbox_types::RollbackRequest,
    ) -> Result<Run, ClientError> {
        let path = format!("{}/rollback", run_path(id)?);
        json(
            self.send(self.request(Method::POST, &path).json(req))
                .await?,
        )
        .await
    }

    /// `POST /v1/runs/{id}/warm-commit`: publishes the run's warm volume
    /// as the template of `repo` (default: the run's own repository).
    pub async fn warm_commit(
        &self,
        id: &str,
        repo: Option<&str>,
    ) -> Result<runbox_types::WarmCommit, ClientError> {
        let path = format!("{}/warm-commit", run_path(id)?);
        let req = runbox_types::WarmCommitRequest {
            repo: repo.map(str::to_owned),
        };
        let resp = self
            .send(self.request(Method::POST, &path).json(&req))
            .await?;
        json(resp).await
    }

    /// `GET /v1/runs/{id}/warm`: the warm volume's lockfile hash now.
    pub async fn warm_status(&self, id: &str) -> Result<runbox_types::WarmStatus, ClientError> {
        let path = format!("{}/warm", run_path(id)?);
        let resp = self.send(self.request(Method::GET, &path)).await?;
        json(resp).await
    }

    /// `GET /v1/warmcache`: every warm template.
    pub async fn warm_templates(&self) -> Result<runbox_types::WarmTemplateList, ClientError> {
        let resp = self
            .send(self.request(Method::GET, "/v1/warmcache"))
            .await?;
        json(resp).await
    }

    /// `GET /v1/warmcache/{owner}/{name}`: the repository's template.
    pub async fn warm_template(
        &self,
        repo: &str,
    ) -> Result<runbox_types::WarmTemplate, ClientError> {
        let resp = self
            .send(self.request(Method::GET, &warm_path(repo)?))
            .await?;
        json(resp).await
    }

    /// `DELETE /v1/warmcache/{owner}/{name}`: drops the template.
    pub async fn warm_invalidate(&self, repo: &str) -> Result<(), ClientError> {
        self.send(self.request(Method::DELETE, &warm_path(repo)?))
            .await?;
        Ok(())
    }

    /// `GET /v1/runs/{id}/fs/stat`: what `path` (relative to `/work`;
    /// empty for `/work`) is, without following a symlink.
    pub async fn stat(&self, id: &str, path: &str) -> Result<runbox_types::FileInfo, ClientError> {
        let route = format!(
            "{}/fs/stat?path={}",
            run_path(id)?,
            paths::query_value(path)
        );
        let resp = self.send(self.request(Method::GET, &route)).await?;
        json(resp).await
    }

    /// `GET /v1/runs/{id}/fs/list`: `path`'s entries, `depth` levels down.
    pub async fn list_dir(
        &self,
        id: &str,
        path: &str,
        depth: u32,
    ) -> Result<runbox_types::FileList, ClientError> {
        let route = format!(
            "{}/fs/list?path={}&depth={depth}",
            run_path(id)?,
            paths::query_value(path)
        );
        let resp = self.send(self.request(Method::GET, &route)).await?;
        json(resp).await
    }

    /// `POST /v1/runs/{id}/fs/mkdir`: a directory and its parents.
    pub async fn make_dir(
        &self,
        id: &str,
        req: &runbox_types::MakeDirRequest,
    ) -> Result<runbox_types::FileInfo, ClientError> {
        let route = format!("{}/fs/mkdir", run_path(id)?);
        let resp = self
            .send(self.request(Method::POST, &route).json(req))
            .await?;
        json(resp).await
    }

    /// `POST /v1/runs/{id}/fs/move`.
    pub async fn move_path(
        &self,
        id: &str,
        req: &runbox_types::MoveRequest,
    ) -> Result<runbox_types::FileInfo, ClientError> {
        let route = format!("{}/fs/move", run_path(id)?);
        let resp = self
            .send(self.request(Method::POST, &route).json(req))
            .await?;
        json(resp).await
    }

    /// `POST /v1/runs/{id}/fs/remove`.
    pub async fn remove_path(
        &self,
        id: &str,
        req: &runbox_types::RemoveRequest,
    ) -> Result<runbox_types::RemoveReply, ClientError> {
        let route = format!("{}/fs/remove", run_path(id)?);
        let resp = self
            .send(self.request(Method::POST, &route).json(req))
            .await?;
        json(resp).await
    }

    /// `GET /v1/pools`.
    pub async fn pools(&self) -> Result<runbox_types::PoolList, ClientError> {
        let resp = self.send(self.request(Method::GET, "/v1/pools")).await?;
        json(resp).await
    }

    /// `PUT /v1/pools`: replaces the pool set; pools left out drain.
    pub async fn set_pools(
        &self,
        set: &runbox_types::PoolSet,
    ) -> Result<runbox_types::PoolList, ClientError> {
        let resp = self
            .send(self.request(Method::PUT, "/v1/pools").json(set))
            .await?;
        json(resp).await
    }

    /// `POST /v1/drain` (`true`) or `DELETE /v1/drain` (`false`).
    pub async fn set_draining(
        &self,
        draining: bool,
    ) -> Result<runbox_types::PoolList, ClientError> {
        let method = if draining {
            Method::POST
        } else {
            Method::DELETE
        };
        let resp = self.send(self.request(method, "/v1/drain")).await?;
        json(resp).await
    }

    /// `POST /v1/drain {"migrate": true}`: cordons the node and moves its
    /// runs to other nodes of the fleet; what became of each is in the
    /// answer's `migrated`.
    pub async fn drain_migrate(&self) -> Result<runbox_types::PoolList, ClientError> {
        let req = runbox_types::DrainRequest { migrate: true };
        let resp = self
            .send(self.request(Method::POST, "/v1/drain").json(&req))
            .await?;
        json(resp).await
    }

    /// `GET /v1/info`.
    pub async fn info(&self) -> Result<runbox_types::Info, ClientError> {
        let resp = self.send(self.request(Method::GET, "/v1/info")).await?;
        json(resp).await
    }

    /// `GET /v1/cluster`: the fleet's nodes (the node alone without a
    /// cluster).
    pub async fn cluster(&self) -> Result<runbox_types::ClusterStatus, ClientError> {
        let resp = self.send(self.request(Method::GET, "/v1/cluster")).await?;
        json(resp).await
    }

    /// `POST /v1/tenants`: the tenant and its token (shown this once).
    pub async fn create_tenant(
        &self,
        req: &runbox_types::CreateTenantRequest,
    ) -> Result<runbox_types::TenantToken, ClientError> {
        let resp = self
            .send(self.request(Method::POST, "/v1/tenants").json(req))
            .await?;
        json(resp).await
    }

    /// `GET /v1/tenants`.
    pub async fn list_tenants(&self) -> Result<runbox_types::TenantList, ClientError> {
        json(self.send(self.request(Method::GET, "/v1/tenants")).await?).await
    }

    /// `GET /v1/tenants/{name}`.
    pub async fn get_tenant(&self, name: &str) -> Result<runbox_types::Tenant, ClientError> {
        let path = tenant_path(name)?;
        json(self.send(self.request(Method::GET, &path)).await?).await
    }

    /// `PATCH /v1/tenants/{name}`: replaces the settings given.
    pub async fn update_tenant(
        &self,
        name: &str,
        req: &runbox_types::UpdateTenantRequest,
    ) -> Result<runbox_types::Tenant, ClientError> {
        let path = tenant_path(name)?;
        let resp = self
            .send(self.request(Method::PATCH, &path).json(req))
            .await?;
        json(resp).await
    }

    /// `POST /v1/tenants/{name}/rotate`: a new token; the old one stops
    /// working at once.
    pub async fn rotate_tenant(
        &self,
        name: &str,
    ) -> Result<runbox_types::TenantToken, ClientError> {
        let path = format!("{}/rotate", tenant_path(name)?);
        json(self.send(self.request(Method::POST, &path)).await?).await
    }

    /// `DELETE /v1/tenants/{name}`.
    pub async fn delete_tenant(&self, name: &str) -> Result<(), ClientError> {
        let path = tenant_path(name)?;
        self.send(self.request(Method::DELETE, &path)).await?;
        Ok(())
    }

    /// `POST /v1/volumes`.
    pub async fn create_volume(
        &self,
        req: &runbox_types::CreateVolumeRequest,
    ) -> Result<runbox_types::Volume, ClientError> {
        let resp = self
            .send(self.request(Method::POST, "/v1/volumes").json(req))
            .await?;
        json(resp).await
    }

    /// `GET /v1/volumes`.
    pub async fn list_volumes(&self) -> Result<runbox_types::VolumeList, ClientError> {
        self.list_volumes_labelled(&[]).await
    }

    /// `GET /v1/volumes?label=...`, filtered as
    /// [`Client::list_runs_labelled`] is.
    pub async fn list_volumes_labelled(
        &self,
        selector: &[&str],
    ) -> Result<runbox_types::VolumeList, ClientError> {
        let path = format!("/v1/volumes{}", paths::label_query(selector));
        json(self.send(self.request(Method::GET, &path)).await?).await
    }

    /// `GET /v1/volumes/{name}`.
    pub async fn get_volume(&self, name: &str) -> Result<runbox_types::Volume, ClientError> {
        let path = volume_path(name)?;
        json(self.send(self.request(Method::GET, &path)).await?).await
    }

    /// `POST /v1/volumes/{name}/clone`.
    pub async fn clone_volume(
        &self,
        name: &str,
        req: &runbox_types::CloneVolumeRequest,
    ) -> Result<runbox_types::Volume, ClientError> {
        let path = format!("{}/clone", volume_path(name)?);
        let resp = self
            .send(self.request(Method::POST, &path).json(req))
            .await?;
        json(resp).await
    }

    /// `POST /v1/volumes/{name}/move`: moves the volume (no run may mount
    /// it) to node `node` of the fleet (the best one when None): the
    /// volume on its new node.
    pub async fn move_volume(
        &self,
        name: &str,
        node: Option<String>,
    ) -> Result<runbox_types::Volume, ClientError> {
        let path = format!("{}/move", volume_path(name)?);
        let req = runbox_types::VolumeNodeMoveRequest { node };
        json(
            self.send(self.request(Method::POST, &path).json(&req))
                .await?,
        )
        .await
    }

    /// `DELETE /v1/volumes/{name}`.
    pub async fn delete_volume(&self, name: &str) -> Result<(), ClientError> {
        let path = volume_path(name)?;
        self.send(self.request(Method::DELETE, &path)).await?;
        Ok(())
    }

    /// `PUT /v1/volumes/{name}/files/{path}`: writes `body` to `path` (from
    /// the volume's top) of a volume no run mounts, replacing any file
    /// there unless `query.overwrite` is false.
    pub async fn put_volume_file(
        &self,
        name: &str,
        path: &str,
        query: &runbox_types::VolumeWriteQuery,
        body: UploadBody,
    ) -> Result<runbox_types::FileInfo, ClientError> {
        let mut route = format!(
            "{}/files/{}",
            volume_path(name)?,
            paths::file_path(path.trim_start_matches('/'))?
        );
        let pairs: Vec<String> = [
            query.mode.map(|m| format!("mode={m}")),
            query.uid.map(|u| format!("uid={u}")),
            query.gid.map(|g| format!("gid={g}")),
            query.overwrite.map(|o| format!("overwrite={o}")),
        ]
        .into_iter()
        .flatten()
        .collect();
        if !pairs.is_empty() {
            route.push('?');
            route.push_str(&pairs.join("&"));
        }
        let request = self.request(Method::PUT, &route);
        let resp = self
            .send(with_body(request, body, "application/octet-stream"))
            .await?;
        json(resp).await
    }

    /// `GET /v1/volumes/{name}/files/{path}`: starts downloading a file of
    /// a volume.
    pub async fn get_volume_file(
        &self,
        name: &str,
        path: &str,
    ) -> Result<FileDownload, ClientError> {
        let route = format!(
            "{}/files/{}",
            volume_path(name)?,
            paths::file_path(path.trim_start_matches('/'))?
        );
        let resp = self.send(self.request(Method::GET, &route)).await?;
        Ok(FileDownload::new(resp))
    }

    /// `GET /v1/volumes/{name}/fs/stat`: what `path` (from the volume's
    /// top; empty or `/` for the top) is.
    pub async fn volume_stat(
        &self,
        name: &str,
        path: &str,
    ) -> Result<runbox_types::FileInfo, ClientError> {
        let route = format!(
            "{}/fs/stat?path={}",
            volume_path(name)?,
            paths::query_value(path)
        );
        json(self.send(self.request(Method::GET, &route)).await?).await
    }

    /// `GET /v1/volumes/{name}/fs/list`: `path`'s entries, `depth` levels
    /// down.
    pub async fn volume_list(
        &self,
        name: &str,
        path: &str,
        depth: u32,
    ) -> Result<runbox_types::FileList, ClientError> {
        let route = format!(
            "{}/fs/list?path={}&depth={depth}",
            volume_path(name)?,
            paths::query_value(path)
        );
        json(self.send(self.request(Method::GET, &route)).await?).await
    }

    /// `POST /v1/volumes/{name}/fs/mkdir`.
    pub async fn volume_make_dir(
        &self,
        name: &str,
        req: &runbox_types::VolumeMakeDirRequest,
    ) -> Result<runbox_types::FileInfo, ClientError> {
        let route = format!("{}/fs/mkdir", volume_path(name)?);
        json(
            self.send(self.request(Method::POST, &route).json(req))
                .await?,
        )
        .await
    }

    /// `POST /v1/volumes/{name}/fs/move`.
    pub async fn volume_move(
        &self,
        name: &str,
        req: &runbox_types::VolumeMoveRequest,
    ) -> Result<runbox_types::FileInfo, ClientError> {
        let route = format!("{}/fs/move", volume_path(name)?);
        json(
            self.send(self.request(Method::POST, &route).json(req))
                .await?,
        )
        .await
    }

    /// `POST /v1/volumes/{name}/fs/remove`.
    pub async fn volume_remove(
        &self,
        name: &str,
        req: &runbox_types::VolumeRemoveRequest,
    ) -> Result<runbox_types::RemoveReply, ClientError> {
        let route = format!("{}/fs/remove", volume_path(name)?);
        json(
            self.send(self.request(Method::POST, &route).json(req))
                .await?,
        )
        .await
    }

    /// `GET /v1/usage`: usage per tenant since `since` (RFC 3339 or a span
    /// such as `24h`), for `tenant` only when given.
    pub async fn usage(
        &self,
        since: Option<&str>,
        tenant: Option<&str>,
    ) -> Result<runbox_types::UsageReport, ClientError> {
        let path = paths::with_query("/v1/usage", &[("since", since), ("tenant", tenant)]);
        let resp = self.send(self.request(Method::GET, &path)).await?;
        json(resp).await
    }

    /// `GET /v1/audit`: the audit log's records that match (root token),
    /// oldest first, each a JSON object. `since` is an RFC 3339 time or a
    /// span back from now (`90m`, `24h`, `7d`); `limit` keeps the latest.
    pub async fn audit(
        &self,
        run: Option<&str>,
        tenant: Option<&str>,
        since: Option<&str>,
        limit: Option<usize>,
    ) -> Result<Vec<serde_json::Value>, ClientError> {
        let limit = limit.map(|n| n.to_string());
        let path = paths::with_query(
            "/v1/audit",
            &[
                ("run", run),
                ("tenant", tenant),
                ("since", since),
                ("limit", limit.as_deref()),
            ],
        );
        let resp = self.send(self.request(Method::GET, &path)).await?;
        let text = resp.text().await?;
        // One JSON object a line; a line that does not parse is not one.
        Ok(text
            .lines()
            .filter_map(|line| serde_json::from_str(line).ok())
            .collect())
    }

    /// `GET /v1/snapshots`.
    pub async fn list_snapshots(&self) -> Result<runbox_types::SnapshotList, ClientError> {
        self.list_snapshots_labelled(&[]).await
    }

    /// `GET /v1/snapshots?label=...`, filtered as
    /// [`Client::list_runs_labelled`] is.
    pub async fn list_snapshots_labelled(
        &self,
        selector: &[&str],
    ) -> Result<runbox_types::SnapshotList, ClientError> {
        let path = format!("/v1/snapshots{}", paths::label_query(selector));
        json(self.send(self.request(Method::GET, &path)).await?).await
    }

    /// `DELETE /v1/snapshots/{name}`: only snapshot images; 409 while a
    /// run boots from it.
    pub async fn delete_snapshot(&self, name: &str) -> Result<(), ClientError> {
        let path = format!("/v1/snapshots/{}", paths::segment("snapshot name", name)?);
        self.send(self.request(Method::DELETE, &path)).await?;
        Ok(())
    }

    /// `POST /v1/runs/{id}/lease`: takes the run's writable lease for
    /// `ttl_sec` seconds (server default when `None`).
    pub async fn acquire_lease(
        &self,
        id: &str,
        owner: &str,
        ttl_sec: Option<u64>,
    ) -> Result<Lease, ClientError> {
        let path = format!("{}/lease", run_path(id)?);
        let req = LeaseRequest {
            owner: owner.to_owned(),
            ttl_sec,
        };
        let resp = self
            .send(self.request(Method::POST, &path).json(&req))
            .await?;
        Ok(json::<LeaseResponse>(resp).await?.lease)
    }

    /// `POST /v1/runs/{id}/lease/renew`: extends the lease `lease` names.
    pub async fn renew_lease(
        &self,
        id: &str,
        lease: &LeaseCredential,
        ttl_sec: Option<u64>,
    ) -> Result<Lease, ClientError> {
        let path = format!("{}/lease/renew", run_path(id)?);
        let req = LeaseRenewRequest {
            owner: lease.owner.clone(),
            generation: lease.generation,
            ttl_sec,
        };
        let resp = self
            .send(self.request(Method::POST, &path).json(&req))
            .await?;
        Ok(json::<LeaseResponse>(resp).await?.lease)
    }

    /// `POST /v1/runs/{id}/lease/release`: gives the lease up.
    pub async fn release_lease(
        &self,
        id: &str,
        lease: &LeaseCredential,
    ) -> Result<(), ClientError> {
        let path = format!("{}/lease/release", run_path(id)?);
        let req = LeaseReleaseRequest {
            owner: lease.owner.clone(),
            generation: lease.generation,
        };
        self.send(self.request(Method::POST, &path).json(&req))
            .await?;
        Ok(())
    }

    /// `POST /v1/runs/{id}/exec`: starts a command and returns its events.
    ///
    /// A command that cannot start (not found, not executable, bad working
    /// directory) is an `Err` here, with the API's code; once the stream is
    /// returned the command runs, and its stream ends with
    /// [`ExecEvent::Exit`] or an error.
    pub async fn exec(&self, id: &str, req: &ExecRequest) -> Result<ExecStream, ClientError> {
        let path = format!("{}/exec", run_path(id)?);
        let request = self
            .request(Method::POST, &path)
            .header(ACCEPT, HeaderValue::from_static("text/event-stream"))
            .json(req);
        let resp = self.send(request).await?;
        Ok(decode_exec_events(
            resp.bytes_stream().map_err(ClientError::Http),
        ))
    }

    /// `GET /v1/runs/{id}/exec/ws`: starts a command with its input open
    /// (give `req.pty` for a terminal) and returns the session once it runs.
    /// Dropping the session's events and writers ends it and kills the
    /// command.
    pub async fn exec_session(&self, id: &str, req: &ExecRequest) -> Result<Session, ClientError> {
        let path = format!("{}/exec/ws", run_path(id)?);
        let socket = session::connect(&self.base, self.token.as_deref(), &path).await?;
        session::open(socket, Some(req)).await
    }

    /// `GET /v1/runs/{id}/processes/{process}/ws`: attaches to a process
    /// (pid or tag) to read its output (`replay` first sends what it kept)
    /// and send it input. Ending the session leaves the process running.
    pub async fn attach(
        &self,
        id: &str,
        process: &str,
        replay: bool,
        lease: Option<&LeaseCredential>,
    ) -> Result<Session, ClientError> {
        let mut path = format!("{}/ws?replay={replay}", process_path(id, process)?);
        if let Some(lease) = lease {
            path.push('&');
            path.push_str(&paths::lease_query(&lease.owner, lease.generation)[1..]);
        }
        let socket = session::connect(&self.base, self.token.as_deref(), &path).await?;
        session::open(socket, None).await
    }

    /// `POST /v1/runs/{id}/preview`: a signed URL that reaches `port`
    /// inside the run through the preview listener, for `ttl_sec` seconds
    /// (default one hour).
    pub async fn mint_preview(
        &self,
        id: &str,
        port: u16,
        ttl_sec: Option<u64>,
    ) -> Result<runbox_types::Preview, ClientError> {
        let route = format!("{}/preview", run_path(id)?);
        let req = runbox_types::PreviewRequest {
            port: u32::from(port),
            ttl_sec,
        };
        let resp = self
            .send(self.request(Method::POST, &route).json(&req))
            .await?;
        json(resp).await
    }

    /// `GET /v1/runs/{id}/ports/{port}/connect`: one TCP connection to
    /// `port` on the run's loopback, tunnelled through the API connection
    /// (an HTTP upgrade). Read and write it like a socket.
    pub async fn connect_port(
        &self,
        id: &str,
        port: u16,
        lease: Option<&LeaseCredential>,
    ) -> Result<reqwest::Upgraded, ClientError> {
        let mut route = format!("{}/ports/{port}/connect", run_path(id)?);
        if let Some(lease) = lease {
            route.push_str(&paths::lease_query(&lease.owner, lease.generation));
        }
        let request = self
            .request(Method::GET, &route)
            .header(
                reqwest::header::CONNECTION,
                HeaderValue::from_static("upgrade"),
            )
            .header(
                reqwest::header::UPGRADE,
                HeaderValue::from_static("runbox-tcp"),
            );
        let resp = request.send().await?;
        if resp.status() != reqwest::StatusCode::SWITCHING_PROTOCOLS {
            if resp.status().is_success() {
                return Err(ClientError::WebSocket(format!(
                    "the server answered {} instead of upgrading the connection",
                    resp.status()
                )));
            }
            return Err(read_error(resp).await);
        }
        Ok(resp.upgrade().await?)
    }

    /// `POST /v1/runs/{id}/processes`: starts a background process.
    pub async fn start_process(
        &self,
        id: &str,
        req: &ExecRequest,
    ) -> Result<runbox_types::Process, ClientError> {
        let route = format!("{}/processes", run_path(id)?);
        let resp = self
            .send(self.request(Method::POST, &route).json(req))
            .await?;
        json(resp).await
    }

    /// `GET /v1/runs/{id}/processes`.
    pub async fn processes(&self, id: &str) -> Result<runbox_types::ProcessList, ClientError> {
        let route = format!("{}/processes", run_path(id)?);
        let resp = self.send(self.request(Method::GET, &route)).await?;
        json(resp).await
    }

    /// `GET /v1/runs/{id}/processes/{process}`: one process, by pid or tag.
    pub async fn process(
        &self,
        id: &str,
        process: &str,
    ) -> Result<runbox_types::Process, ClientError> {
        let resp = self
            .send(self.request(Method::GET, &process_path(id, process)?))
            .await?;
        json(resp).await
    }

    /// `GET /v1/runs/{id}/processes/{process}/wait`: waits up to
    /// `timeout_sec` for the process to end; describes it either way
    /// (`running` says which).
    pub async fn wait_process(
        &self,
        id: &str,
        process: &str,
        timeout_sec: u64,
    ) -> Result<runbox_types::Process, ClientError> {
        let route = format!(
            "{}/wait?timeoutSec={timeout_sec}",
            process_path(id, process)?
        );
        let resp = self.send(self.request(Method::GET, &route)).await?;
        json(resp).await
    }

    /// `POST /v1/runs/{id}/processes/{process}/signal`.
    pub async fn signal_process(
        &self,
        id: &str,
        process: &str,
        req: &runbox_types::SignalRequest,
    ) -> Result<runbox_types::Process, ClientError> {
        let route = format!("{}/signal", process_path(id, process)?);
        let resp = self
            .send(self.request(Method::POST, &route).json(req))
            .await?;
        json(resp).await
    }

    /// `POST /v1/runs/{id}/processes/{process}/stdin`: writes `data` to
    /// the process's stdin, then closes it when `close`.
    pub async fn send_stdin(
        &self,
        id: &str,
        process: &str,
        data: impl Into<Bytes>,
        close: bool,
        lease: Option<&LeaseCredential>,
    ) -> Result<runbox_types::Process, ClientError> {
        let mut route = format!("{}/stdin?close={close}", process_path(id, process)?);
        if let Some(lease) = lease {
            route.push('&');
            route.push_str(&paths::lease_query(&lease.owner, lease.generation)[1..]);
        }
        let request = self
            .request(Method::POST, &route)
            .header(
                CONTENT_TYPE,
                HeaderValue::from_static("application/octet-stream"),
            )
            .body(data.into());
        let resp = self.send(request).await?;
        json(resp).await
    }

    /// `GET /v1/runs/{id}/processes/{process}/output`: the process's output
    /// as events (replayed first when `replay`), ending with its exit.
    /// Dropping the stream leaves the process running.
    pub async fn process_output(
        &self,
        id: &str,
        process: &str,
        replay: bool,
    ) -> Result<ExecStream, ClientError> {
        let route = format!("{}/output?replay={replay}", process_path(id, process)?);
        let request = self
            .request(Method::GET, &route)
            .header(ACCEPT, HeaderValue::from_static("text/event-stream"));
        let resp = self.send(request).await?;
        Ok(decode_exec_events(
            resp.bytes_stream().map_err(ClientError::Http),
        ))
    }

    /// `PUT /v1/runs/{id}/files/{path}`: writes `body` to `/work/<path>` in
    /// the run, replacing any file there. `path` is relative to `/work`.
    pub async fn put_file(
        &self,
        id: &str,
        path: &str,
        body: UploadBody,
    ) -> Result<(), ClientError> {
        self.put_file_as(id, path, None, body).await
    }

    /// [`Client::put_file`] under a writable lease: `lease` is the holder's
    /// credential, needed while a lease is active on the run.
    pub async fn put_file_as(
        &self,
        id: &str,
        path: &str,
        lease: Option<&LeaseCredential>,
        body: UploadBody,
    ) -> Result<(), ClientError> {
        let mut url_path = format!("{}/files/{}", run_path(id)?, paths::file_path(path)?);
        if let Some(lease) = lease {
            url_path.push_str(&paths::lease_query(&lease.owner, lease.generation));
        }
        let request = self.request(Method::PUT, &url_path);
        self.send(with_body(request, body, "application/octet-stream"))
            .await?;
        Ok(())
    }

    /// `GET /v1/runs/{id}/files/{path}`: starts downloading `/work/<path>`.
    /// `path` is relative to `/work`.
    pub async fn get_file(&self, id: &str, path: &str) -> Result<FileDownload, ClientError> {
        let url_path = format!("{}/files/{}", run_path(id)?, paths::file_path(path)?);
        let resp = self.send(self.request(Method::GET, &url_path)).await?;
        Ok(FileDownload::new(resp))
    }

    /// `POST /v1/images/{name}`: imports a tar archive (plain, gzip or zstd)
    /// of an OCI image layout, a `docker save` tarball, or a root file
    /// system; the server tells them apart.
    pub async fn import_image(&self, name: &str, tar: UploadBody) -> Result<Image, ClientError> {
        let path = format!("/v1/images/{}", paths::segment("image name", name)?);
        let request = self.request(Method::POST, &path);
        let resp = self
            .send(with_body(request, tar, "application/x-tar"))
            .await?;
        json(resp).await
    }

    /// `GET /v1/images`: every image on the node.
    pub async fn list_images(&self) -> Result<ImageList, ClientError> {
        let resp = self.send(self.request(Method::GET, "/v1/images")).await?;
        json(resp).await
    }

    /// `POST /v1/images/pull`: pulls an image from a registry, streaming
    /// progress; the stream ends with [`PullUpdate::Done`] or an error.
    pub async fn pull_image(
        &self,
        req: &runbox_types::PullRequest,
    ) -> Result<PullStream, ClientError> {
        let request = self
            .request(Method::POST, "/v1/images/pull")
            .header(ACCEPT, HeaderValue::from_static("text/event-stream"))
            .json(req);
        let resp = self.send(request).await?;
        Ok(decode_pull_events(
            resp.bytes_stream().map_err(ClientError::Http),
        ))
    }

    /// `GET /v1/images/{name}`: one image, with its config document.
    pub async fn get_image(&self, name: &str) -> Result<Image, ClientError> {
        let path = format!("/v1/images/{}", paths::segment("image name", name)?);
        json(self.send(self.request(Method::GET, &path)).await?).await
    }

    /// `DELETE /v1/images/{name}`; refused with `image_in_use` while a run
    /// uses the image.
    pub async fn delete_image(&self, name: &str) -> Result<(), ClientError> {
        let path = format!("/v1/images/{}", paths::segment("image name", name)?);
        self.send(self.request(Method::DELETE, &path)).await?;
        Ok(())
    }

    /// `PUT /v1/build-contexts/{digest}`: uploads a build context (a tar,
    /// plain or gzip) whose bytes hash to `digest` (`sha256:<hex>`).
    pub async fn put_build_context(
        &self,
        digest: &str,
        tar: UploadBody,
    ) -> Result<runbox_types::BuildContext, ClientError> {
        let path = format!(
            "/v1/build-contexts/{}",
            paths::segment("context digest", digest)?
        );
        let request = self.request(Method::PUT, &path);
        json(
            self.send(with_body(request, tar, "application/x-tar"))
                .await?,
        )
        .await
    }

    /// `POST /v1/builds`: starts a build; it goes on in the background.
    pub async fn start_build(
        &self,
        req: &runbox_types::BuildRequest,
    ) -> Result<runbox_types::Build, ClientError> {
        let request = self.request(Method::POST, "/v1/builds").json(req);
        json(self.send(request).await?).await
    }

    /// `GET /v1/builds`: the caller's builds, newest first.
    pub async fn list_builds(&self) -> Result<runbox_types::BuildList, ClientError> {
        json(self.send(self.request(Method::GET, "/v1/builds")).await?).await
    }

    /// `GET /v1/builds/{id}`.
    pub async fn get_build(&self, id: &str) -> Result<runbox_types::Build, ClientError> {
        let path = format!("/v1/builds/{}", paths::segment("build id", id)?);
        json(self.send(self.request(Method::GET, &path)).await?).await
    }

    /// `GET /v1/builds/{id}/events`: the build's steps and log (from log
    /// line `offset`) as they happen; ends with [`BuildUpdate::Done`].
    pub async fn build_events(&self, id: &str, offset: u64) -> Result<BuildStream, ClientError> {
        let path = format!(
            "/v1/builds/{}/events?offset={offset}",
            paths::segment("build id", id)?
        );
        let request = self
            .request(Method::GET, &path)
            .header(ACCEPT, HeaderValue::from_static("text/event-stream"));
        let resp = self.send(request).await?;
        Ok(decode_build_events(
            resp.bytes_stream().map_err(ClientError::Http),
        ))
    }

    /// `POST /v1/builds/{id}/cancel`: answers once the build has ended.
    pub async fn cancel_build(&self, id: &str) -> Result<runbox_types::Build, ClientError> {
        let path = format!("/v1/builds/{}/cancel", paths::segment("build id", id)?);
        json(self.send(self.request(Method::POST, &path)).await?).await
    }

    /// A request to `path` (already encoded), with the bearer token if any.
    fn request(&self, method: Method, path: &str) -> RequestBuilder {
        let request = self.http.request(method, format!("{}{path}", self.base));
        match &self.token {
            Some(token) => request.bearer_auth(token),
            None => request,
        }
    }

    /// Sends a request; a non-2xx answer becomes [`ClientError::Api`].
    async fn send(&self, request: RequestBuilder) -> Result<Response, ClientError> {
        let resp = request.send().await?;
        if resp.status().is_success() {
            return Ok(resp);
        }
        Err(read_error(resp).await)
    }
}

/// How many times [`Client::create_run`] sends its request at most.
const CREATE_ATTEMPTS: u32 = 3;

/// Whether a failed request may be sent again: it did not reach the server
/// or its answer was lost (never an answer the server gave).
fn retryable(e: &reqwest::Error) -> bool {
    e.is_connect() || e.is_request() || e.is_timeout() || e.is_body()
}

fn default_http() -> Result<reqwest::Client, ClientError> {
    let http = reqwest::Client::builder()
        .connect_timeout(CONNECT_TIMEOUT)
        // An API does not redirect, and a streamed upload could not follow
        // one anyway; a redirect is more likely a misconfigured proxy.
        .redirect(reqwest::redirect::Policy::none())
        .user_agent(concat!("runbox-client/", env!("CARGO_PKG_VERSION")))
        .build()?;
    Ok(http)
}

/// `/v1/warmcache/{owner}/{name}` for `owner/name`, each part encoded.
fn warm_path(repo: &str) -> Result<String, ClientError> {
    let (owner, name) = repo.split_once('/').unwrap_or((repo, ""));
    Ok(format!(
        "/v1/warmcache/{}/{}",
        paths::segment("repository owner", owner)?,
        paths::segment("repository name", name)?
    ))
}

fn process_path(id: &str, process: &str) -> Result<String, ClientError> {
    Ok(format!(
        "{}/processes/{}",
        run_path(id)?,
        paths::segment("process", process)?
    ))
}

fn tenant_path(name: &str) -> Result<String, ClientError> {
    Ok(format!(
        "/v1/tenants/{}",
        paths::segment("tenant name", name)?
    ))
}

fn volume_path(name: &str) -> Result<String, ClientError> {
    Ok(format!(
        "/v1/volumes/{}",
        paths::segment("volume name", name)?
    ))
}

fn run_path(id: &str) -> Result<String, ClientError> {
    Ok(format!("/v1/runs/{}", paths::segment("run id", id)?))
}

fn with_body(
    request: RequestBuilder,
    body: UploadBody,
    content_type: &'static str,
) -> RequestBuilder {
    let request = request.header(CONTENT_TYPE, HeaderValue::from_static(content_type));
    // A streamed body has no size of its own; an explicit Content-Length
    // makes the HTTP layer send it unchunked and check the count.
    let request = match body.len {
        Some(len) => request.header(CONTENT_LENGTH, len),
        None => request,
    };
    request.body(body.body)
}

async fn json<T: DeserializeOwned>(resp: Response) -> Result<T, ClientError> {
    let bytes = resp.bytes().await?;
    serde_json::from_slice(&bytes).map_err(ClientError::Decode)
}

/// Reads (a bounded prefix of) an error response's body and parses it.
async fn read_error(mut resp: Response) -> ClientError {
    let status = resp.status();
    let mut body = Vec::new();
    while body.len() < MAX_ERROR_BODY {
        match resp.chunk().await {
            Ok(Some(chunk)) => body.extend_from_slice(&chunk),
            // A body cut short still says something; use what arrived.
            Ok(None) | Err(_) => break,
        }
    }
    body.truncate(MAX_ERROR_BODY);
    error::api_error(status.as_u16(), status.canonical_reason(), &body)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requests_go_to_encoded_urls() {
        let client = Client::new("http://127.0.0.1:7439/", "t").unwrap();
        let url = |rb: RequestBuilder| rb.build().unwrap().url().to_string();
        assert_eq!(
            url(client.request(Method::GET, &run_path("01J A").unwrap())),
            "http://127.0.0.1:7439/v1/runs/01J%20A"
        );
        let path = format!(
            "{}/files/{}",
            run_path("01J").unwrap(),
            paths::file_path("dir/ä?.txt").unwrap()
        );
        assert_eq!(
            url(client.request(Method::PUT, &path)),
            "http://127.0.0.1:7439/v1/runs/01J/files/dir/%C3%A4%3F.txt"
        );
    }

    #[test]
    fn a_path_prefix_is_kept() {
        let client = Client::anonymous("http://host/runbox/").unwrap();
        let request = client.request(Method::GET, "/health").build().unwrap();
        assert_eq!(request.url().as_str(), "http://host/runbox/health");
        assert!(request.headers().get("authorization").is_none());
    }

    #[test]
    fn the_token_goes_in_a_bearer_header_and_never_in_debug() {
        let client = Client::new("http://host", "s3cret").unwrap();
        let request = client.request(Method::GET, "/v1/runs").build().unwrap();
        assert_eq!(request.headers()["authorization"], "Bearer s3cret");
        assert!(!format!("{client:?}").contains("s3cret"));
    }

    #[test]
    fn known_lengths_are_sent_as_content_length() {
        let client = Client::new("http://host", "t").unwrap();
        let request = with_body(
            client.request(Method::PUT, "/x"),
            UploadBody::from_reader(&b"hello"[..], Some(5)),
            "application/octet-stream",
        )
        .build()
        .unwrap();
        assert_eq!(request.headers()[CONTENT_LENGTH], "5");
        let request = with_body(
            client.request(Method::PUT, "/x"),
            UploadBody::from_reader(&b"hello"[..], None),
            "application/octet-stream",
        )
        .build()
        .unwrap();
        assert!(request.headers().get(CONTENT_LENGTH).is_none());
    }
}
