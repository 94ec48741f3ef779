//! `runbox mcp`: a Model Context Protocol server (through `rmcp`, the
//! protocol's official Rust SDK) whose tools drive a runbox daemon through
//! its API, over stdio or streamable HTTP.
//!
//! Every tool is one or two API calls with the Rust client; runbox's
//! refusals come back as tool errors carrying the API's stable code, so
//! the model reads what to fix.

use std::net::SocketAddr;
use std::sync::Arc;

use anyhow::{bail, Context as _};
use bytes::Bytes;
use clap::Args;
use rmcp::handler::server::router::tool::ToolRouter;
use rmcp::handler::server::wrapper::Parameters;
use rmcp::model::{Implementation, ServerCapabilities, ServerConfig};
use rmcp::{tool, tool_handler, tool_router, ServerHandler, ServiceExt};
use runbox_client::{Client, ClientError};
use runbox_types::{
    CreateRunRequest, Env, ErrorCode, ExecRequest, ForkRequest, HistoryDiff, HistoryDiffQuery,
    HistorySettings, NetworkTier, RollbackRequest,
};
use schemars::JsonSchema;
use serde::Deserialize;
use serde_json::{json, Value};

use crate::connect::ConnectOpts;

/// The most output an exec tool answer carries of each stream; the rest is
/// cut (and the answer says so), so one noisy command cannot flood the
/// model's context.
const MAX_OUTPUT: usize = 64 * 1024;

/// The most bytes `read_file` returns.
const MAX_READ: usize = 1024 * 1024;

/// `exec`'s timeout when the call names none, in seconds.
const DEFAULT_EXEC_TIMEOUT: u64 = 120;

/// The most paths `diff` lists when the call names no limit.
const DEFAULT_DIFF_LIMIT: usize = 200;

/// `runbox mcp`.
#[derive(Debug, Args)]
pub struct McpArgs {
    /// Serve streamable HTTP on this address (path /mcp) instead of stdio.
    /// Clients must send the runbox token as `Authorization: Bearer`
    #[arg(long, value_name = "ADDR")]
    pub http: Option<SocketAddr>,
    /// Allow --http on an address other than loopback
    #[arg(long)]
    pub allow_non_loopback: bool,
    #[command(flatten)]
    pub conn: ConnectOpts,
}

/// Runs the server until stdin closes (stdio) or forever (HTTP).
pub async fn run(args: McpArgs) -> anyhow::Result<std::process::ExitCode> {
    let conn = args.conn.connect()?;
    let server = Tools::new(conn.client.clone());
    match args.http {
        None => {
            let running = server
                .serve(rmcp::transport::stdio())
                .await
                .context("the MCP session did not start")?;
            running.waiting().await.context("the MCP session failed")?;
        }
        Some(addr) => {
            if !addr.ip().is_loopback() && !args.allow_non_loopback {
                bail!("--http {addr} is not a loopback address; add --allow-non-loopback to serve it anyway");
            }
            let token = conn.token().to_owned();
            serve_http(server, addr, token).await?;
        }
    }
    Ok(std::process::ExitCode::SUCCESS)
}

async fn serve_http(server: Tools, addr: SocketAddr, token: String) -> anyhow::Result<()> {
    use rmcp::transport::streamable_http_server::session::local::LocalSessionManager;
    use rmcp::transport::streamable_http_server::{
        StreamableHttpServerConfig, StreamableHttpService,
    };

    let service = StreamableHttpService::new(
        move || Ok(server.clone()),
        Arc::new(LocalSessionManager::default()),
        StreamableHttpServerConfig::default(),
    );
    let token = Arc::new(token);
    let app = axum::Router::new()
        .nest_service("/mcp", service)
        .layer(axum::middleware::from_fn(move |req, next| {
            let token = token.clone();
            require_bearer(token, req, next)
        }));
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .with_context(|| format!("cannot listen on {addr}"))?;
    eprintln!(
        "runbox mcp: streamable HTTP on http://{}/mcp",
        listener.local_addr()?
    );
    axum::serve(listener, app)
        .await
        .context("the MCP listener failed")
}

/// The runbox token guards the HTTP transport: whoever reaches it drives
/// the daemon with that token.
async fn require_bearer(
    token: Arc<String>,
    req: axum::extract::Request,
    next: axum::middleware::Next,
) -> axum::response::Response {
    use axum::response::IntoResponse;
    use subtle::ConstantTimeEq;

    let given = req
        .headers()
        .get(axum::http::header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .unwrap_or("");
    if bool::from(given.as_bytes().ct_eq(token.as_bytes())) {
        next.run(req).await
    } else {
        (
            axum::http::StatusCode::UNAUTHORIZED,
            "send the runbox token as Authorization: Bearer <token>\n",
        )
            .into_response()
    }
}

/// The MCP tools.
#[derive(Clone)]
pub struct Tools {
    client: Client,
    tool_router: ToolRouter<Self>,
}

/// A runbox refusal as the tool's error text: the stable code first.
/// Every tool error reads `<code>: <message>`, the code runbox's own
/// (docs/api.md, Errors), whether the daemon or the tool refused.
fn refused(err: ClientError) -> String {
    match err.code() {
        Some(code) => format!("{}: {err}", code.as_str()),
        // No answer from the daemon at all (as the SDKs name it).
        None => format!("unreachable: {err}"),
    }
}

/// A refusal by the tool itself, in the shape of [`refused`].
fn invalid(code: ErrorCode, message: impl std::fmt::Display) -> String {
    format!("{}: {message}", code.as_str())
}

fn to_json<T: serde::Serialize>(value: &T) -> Result<String, String> {
    serde_json::to_string_pretty(value).map_err(|e| invalid(ErrorCode::Internal, e))
}

/// A path in a run as the tools take it, the way `runbox cp` does: under
/// `/work` (`/work/a.txt`) or relative to it (`a.txt`); answers it relative
/// to `/work`.
fn work_path(raw: &str) -> Result<String, String> {
    crate::cp::remote_path(raw)
        .map(|(path, _)| path)
        .map_err(|e| invalid(ErrorCode::BadPath, e))
}

/// A history point's id as a call gave it.
fn point_id(raw: &str) -> Result<ulid::Ulid, String> {
    runbox_types::parse_id(raw).ok_or_else(|| {
        invalid(
            ErrorCode::BadRequest,
            format!("point {raw:?} is not a history point id (the history tool lists them)"),
        )
    })
}

/// Leaves out the patches of `diff` past `budget` bytes in all, marking
/// their files `binary` as the API marks those past its own budget, so one
/// large diff cannot flood the model's context.
fn cap_patches(diff: &mut HistoryDiff, mut budget: usize) {
    for change in &mut diff.changes {
        let len = change.patch.as_ref().map_or(0, String::len);
        if len > budget {
            change.patch = None;
            change.binary = true;
        } else {
            budget -= len;
        }
    }
}

/// A command line as the tools run it: through `sh -c`.
fn shell(command: String) -> Vec<String> {
    vec!["sh".into(), "-c".into(), command]
}

/// Text for the model: valid UTF-8 as is, anything else lossily, cut at
/// `max` bytes.
fn text(bytes: &[u8], max: usize) -> (String, bool) {
    let cut = bytes.len() > max;
    let bytes = &bytes[..bytes.len().min(max)];
    (String::from_utf8_lossy(bytes).into_owned(), cut)
}

#[derive(Debug, Deserialize, JsonSchema)]
pub struct CreateRun {
    /// Image to start from (default `base`)
    pub image: Option<String>,
    /// A checkpoint to start from instead of an image (its files, and its
    /// run's settings for what is not given here)
    pub checkpoint: Option<String>,
    /// Time to live in seconds (default: the server's, 30 minutes)
    pub ttl_sec: Option<u64>,
    /// Network tier: `none` (default), `allowlist` or `open`
    pub network: Option<String>,
    /// Hosts the `allowlist` tier may reach
    pub egress_allow: Option<Vec<String>>,
    /// Environment variables
    pub env: Option<std::collections::BTreeMap<String, String>>,
    /// Size tier: small, medium, large, xlarge, 2xlarge
    pub size: Option<String>,
    /// Labels to tag the run with
    pub labels: Option<std::collections::BTreeMap<String, String>>,
    /// Keep a history point (at most this many, e.g. 20) after every
    /// command and file write that changes a file, so that `history`,
    /// `diff` and `undo` work on the run (default: the server's, usually
    /// none)
    pub history: Option<u32>,
}

#[derive(Debug, Deserialize, JsonSchema)]
pub struct RunRef {
    /// The run's id
    pub run: String,
}

#[derive(Debug, Deserialize, JsonSchema)]
pub struct Exec {
    /// The run's id
    pub run: String,
    /// A shell command line, run with `sh -c`
    pub command: String,
    /// Working directory (default /work)
    pub cwd: Option<String>,
    /// Seconds before the command is killed (default 120)
    pub timeout_sec: Option<u64>,
    /// Text given to the command's standard input
    pub stdin: Option<String>,
}

#[derive(Debug, Deserialize, JsonSchema)]
pub struct FilePath {
    /// The run's id
    pub run: String,
    /// A path under /work: /work/a.txt or a.txt
    pub path: String,
}

#[derive(Debug, Deserialize, JsonSchema)]
pub struct WriteFile {
    /// The run's id
    pub run: String,
    /// A path under /work (/work/a.txt or a.txt); parents are made
    pub path: String,
    /// The file's new content (text)
    pub content: String,
}

#[derive(Debug, Deserialize, JsonSchema)]
pub struct ListFiles {
    /// The run's id
    pub run: String,
    /// A directory under /work (/work/src or src; default: /work itself)
    pub path: Option<String>,
    /// How many levels down (default 1)
    pub depth: Option<u32>,
}

#[derive(Debug, Deserialize, JsonSchema)]
pub struct Snapshot {
    /// The run's id
    pub run: String,
    /// The new image's name (default: generated)
    pub name: Option<String>,
}

#[derive(Debug, Deserialize, JsonSchema)]
pub struct Fork {
    /// The run's id
    pub run: String,
    /// How many runs to start from its files (default 1)
    pub count: Option<usize>,
    /// Their time to live in seconds
    pub ttl_sec: Option<u64>,
    /// Start them from the run's files as they were at this history point
    /// (an id the `history` tool lists) instead of as they are now
    pub point: Option<String>,
}

#[derive(Debug, Deserialize, JsonSchema)]
pub struct Diff {
    /// The run's id
    pub run: String,
    /// The history point to show (default: the newest, the last change)
    pub point: Option<String>,
    /// Compare with this point instead of the one before it (e.g. the
    /// `create` point: everything the run changed since it was made)
    pub against: Option<String>,
    /// Include unified diffs of changed text files (default false)
    pub patch: Option<bool>,
    /// The most paths to list (1-10000, default 200)
    pub limit: Option<usize>,
}

#[derive(Debug, Deserialize, JsonSchema)]
pub struct Undo {
    /// The run's id
    pub run: String,
    /// Return to this history point (an id the `history` tool lists,
    /// earlier or later) instead of the one before the last change
    pub point: Option<String>,
}

#[derive(Debug, Deserialize, JsonSchema)]
pub struct BuildImage {
    /// The image to record (1-64 of a-z, 0-9, '.', '_', '-')
    pub name: String,
    /// The Dockerfile's text (FROM, RUN, COPY, ENV, WORKDIR, USER, CMD, ...)
    pub dockerfile: String,
    /// Files COPY may read, by path relative to the build context: their text
    pub files: Option<std::collections::BTreeMap<String, String>>,
    /// Build arguments (ARG values)
    pub build_args: Option<std::collections::BTreeMap<String, String>>,
    /// Run every step again, even those a cached layer stands for
    pub no_cache: Option<bool>,
}

#[derive(Debug, Deserialize, JsonSchema)]
pub struct StartProcess {
    /// The run's id
    pub run: String,
    /// A shell command line, run with `sh -c` in the background
    pub command: String,
    /// A name to find it by later
    pub tag: Option<String>,
    /// Working directory (default /work)
    pub cwd: Option<String>,
}

#[derive(Debug, Deserialize, JsonSchema)]
pub struct Preview {
    /// The run's id
    pub run: String,
    /// The port a server in the run listens on (on its loopback)
    pub port: u16,
    /// Seconds the URL works for (default one hour)
    pub ttl_sec: Option<u64>,
}

fn parse<T: for<'de> Deserialize<'de>>(
    what: &str,
    raw: Option<String>,
) -> Result<Option<T>, String> {
    raw.map(|v| {
        serde_json::from_value(Value::String(v.clone())).map_err(|_| {
            invalid(
                ErrorCode::BadRequest,
                format!("{what} {v:?} is not one runbox knows"),
            )
        })
    })
    .transpose()
}

#[tool_router(router = tool_router)]
impl Tools {
    pub fn new(client: Client) -> Self {
        Self {
            client,
            tool_router: Self::tool_router(),
        }
    }

    #[tool(
        description = "Create a run: an isolated Linux sandbox. Answers the run, with its id. Give `history` (e.g. 20) to be able to see what each command changed (`diff`) and to undo it (`undo`)."
    )]
    async fn create_run(&self, Parameters(p): Parameters<CreateRun>) -> Result<String, String> {
        let checkpoint = p
            .checkpoint
            .map(|c| {
                c.parse::<ulid::Ulid>().map_err(|_| {
                    invalid(
                        ErrorCode::BadRequest,
                        format!("checkpoint {c:?} is not a checkpoint id"),
                    )
                })
            })
            .transpose()?;
        let image = match (p.image, &checkpoint) {
            (Some(image), _) => image,
            (None, Some(_)) => String::new(),
            (None, None) => "base".to_owned(),
        };
        let req = CreateRunRequest {
            image,
            checkpoint,
            ttl_sec: p.ttl_sec,
            network: parse::<NetworkTier>("network", p.network)?,
            egress_allow: p
                .egress_allow
                .map(|entries| entries.into_iter().map(Into::into).collect()),
            env: p.env.map(Env),
            size: parse("size", p.size)?,
            labels: p.labels,
            history: p.history.map(|keep| HistorySettings { keep }),
            ..Default::default()
        };
        to_json(&self.client.create_run(&req).await.map_err(refused)?)
    }

    #[tool(description = "List the runs on this runbox server.")]
    async fn list_runs(&self) -> Result<String, String> {
        to_json(&self.client.list_runs().await.map_err(refused)?)
    }

    #[tool(
        description = "Pause a run: its processes stop where they are and keep their memory; it uses no CPU. The next call that reaches the run (exec, files, ...) resumes it. Answers the run."
    )]
    async fn pause_run(&self, Parameters(p): Parameters<RunRef>) -> Result<String, String> {
        to_json(&self.client.pause_run(&p.run).await.map_err(refused)?)
    }

    #[tool(description = "Resume a paused run (a hibernated one is woken). Answers the run.")]
    async fn resume_run(&self, Parameters(p): Parameters<RunRef>) -> Result<String, String> {
        to_json(&self.client.resume_run(&p.run).await.map_err(refused)?)
    }

    #[tool(
        description = "Hibernate a run: its processes and memory are lost, its files kept; it holds no CPU, memory or network until the next call that reaches it boots it again. Answers the run."
    )]
    async fn hibernate_run(&self, Parameters(p): Parameters<RunRef>) -> Result<String, String> {
        to_json(&self.client.hibernate_run(&p.run).await.map_err(refused)?)
    }

    #[tool(
        description = "Wake a hibernated or failed run: boot it again on its disk. Answers the run."
    )]
    async fn wake_run(&self, Parameters(p): Parameters<RunRef>) -> Result<String, String> {
        to_json(&self.client.wake_run(&p.run).await.map_err(refused)?)
    }

    #[tool(description = "Delete a run and everything in it.")]
    async fn delete_run(&self, Parameters(p): Parameters<RunRef>) -> Result<String, String> {
        self.client.delete_run(&p.run).await.map_err(refused)?;
        Ok(format!("run {} deleted", p.run))
    }

    #[tool(
        description = "Run a shell command in a run and wait for it: answers its exit code, stdout and stderr (each cut at 64 KiB). State persists between commands. In a run created with `history`, `point` names the history point its file changes were kept as (null when it changed no file): `diff` shows them, `undo` takes them back."
    )]
    async fn exec(&self, Parameters(p): Parameters<Exec>) -> Result<String, String> {
        let req = ExecRequest {
            cmd: shell(p.command),
            cwd: p.cwd,
            timeout_sec: Some(p.timeout_sec.unwrap_or(DEFAULT_EXEC_TIMEOUT)),
            stdin: p.stdin,
            ..Default::default()
        };
        let stream = self.client.exec(&p.run, &req).await.map_err(refused)?;
        let out = stream.collect_output().await.map_err(refused)?;
        let (stdout, stdout_cut) = text(&out.stdout, MAX_OUTPUT);
        let (stderr, stderr_cut) = text(&out.stderr, MAX_OUTPUT);
        to_json(&json!({
            "exitCode": out.exit.exit_code,
            "timedOut": out.exit.timed_out,
            "signal": out.exit.signal,
            "stdout": stdout,
            "stderr": stderr,
            "truncated": stdout_cut || stderr_cut,
            "point": out.exit.point,
        }))
    }

    #[tool(
        description = "Read a text file under /work in a run (at most 1 MiB); the path is /work/... or relative to /work."
    )]
    async fn read_file(&self, Parameters(p): Parameters<FilePath>) -> Result<String, String> {
        let path = work_path(&p.path)?;
        let download = self.client.get_file(&p.run, &path).await.map_err(refused)?;
        let bytes = download.bytes().await.map_err(refused)?;
        let (content, cut) = text(&bytes, MAX_READ);
        if cut {
            return Ok(format!(
                "{content}\n[cut at {MAX_READ} bytes of {}]",
                bytes.len()
            ));
        }
        Ok(content)
    }

    #[tool(
        description = "Write a text file under /work in a run, replacing what is there; the path is /work/... or relative to /work."
    )]
    async fn write_file(&self, Parameters(p): Parameters<WriteFile>) -> Result<String, String> {
        let path = work_path(&p.path)?;
        let len = p.content.len();
        self.client
            .put_file(&p.run, &path, Bytes::from(p.content).into())
            .await
            .map_err(refused)?;
        Ok(format!("wrote {len} bytes to /work/{path}"))
    }

    #[tool(
        description = "List a directory under /work in a run; the path is /work/... or relative to /work (default: /work itself)."
    )]
    async fn list_files(&self, Parameters(p): Parameters<ListFiles>) -> Result<String, String> {
        let path = work_path(p.path.as_deref().unwrap_or(""))?;
        let list = self
            .client
            .list_dir(&p.run, &path, p.depth.unwrap_or(1))
            .await
            .map_err(refused)?;
        to_json(&list)
    }

    #[tool(
        description = "Snapshot a run's filesystem as a new image (the run keeps running); create runs from it by name."
    )]
    async fn snapshot(&self, Parameters(p): Parameters<Snapshot>) -> Result<String, String> {
        to_json(
            &self
                .client
                .snapshot_run(&p.run, p.name.as_deref())
                .await
                .map_err(refused)?,
        )
    }

    #[tool(
        description = "Checkpoint a run: its files and settings go to the server's checkpoint store, where they outlive the run and this server; create_run with the checkpoint's id starts new runs from it. The run keeps running. Answers the checkpoint."
    )]
    async fn checkpoint_run(&self, Parameters(p): Parameters<RunRef>) -> Result<String, String> {
        let req = runbox_types::CheckpointRequest::default();
        to_json(
            &self
                .client
                .checkpoint_run(&p.run, &req)
                .await
                .map_err(refused)?,
        )
    }

    #[tool(
        description = "Fork a run: new runs that start from its files as they are now, or as they were at a history `point` (not its processes). Use a fork to try something risky without touching the run."
    )]
    async fn fork(&self, Parameters(p): Parameters<Fork>) -> Result<String, String> {
        let req = ForkRequest {
            count: p.count.unwrap_or(1),
            ttl_sec: p.ttl_sec,
            point: p.point.as_deref().map(point_id).transpose()?,
        };
        to_json(&self.client.fork_run(&p.run, &req).await.map_err(refused)?)
    }

    #[tool(
        description = "List a run's history points, newest first (runs created with `history`): one after every command or file write that changed a file, each with what made it (`cause`: the command's argv and exit code, or the file call) and what it changed (`changes`: paths added, modified, removed). The oldest, kind `create`, is the run before its first change; `head` is the point the files are at now. Use it to find the point to `diff`, `undo` to, or `fork` from."
    )]
    async fn history(&self, Parameters(p): Parameters<RunRef>) -> Result<String, String> {
        to_json(&self.client.history(&p.run).await.map_err(refused)?)
    }

    #[tool(
        description = "Show what a history point changed in a run's files (default: the newest point, the last command or file write that changed something): each path added, modified or removed, with its kind, mode, owner and size before and after; `patch: true` adds unified diffs of text files (at most 64 KiB of them in all; a file left out is marked `binary`). `against` compares with another point instead of the one before (the `create` point: everything since the run was made). Use it to check what a command really did before keeping or undoing it."
    )]
    async fn diff(&self, Parameters(p): Parameters<Diff>) -> Result<String, String> {
        let point = match p.point {
            Some(raw) => point_id(&raw)?,
            None => {
                let list = self.client.history(&p.run).await.map_err(refused)?;
                match list.points.first() {
                    Some(newest) => newest.id,
                    None => {
                        return Err(invalid(
                            ErrorCode::PointNotFound,
                            format!(
                                "run {} has no history points yet: nothing changed a file",
                                p.run
                            ),
                        ))
                    }
                }
            }
        };
        let query = HistoryDiffQuery {
            against: p.against.as_deref().map(point_id).transpose()?,
            patch: p.patch,
            limit: Some(p.limit.unwrap_or(DEFAULT_DIFF_LIMIT)),
        };
        let mut diff = self
            .client
            .history_diff(&p.run, &point.to_string(), &query)
            .await
            .map_err(refused)?;
        cap_patches(&mut diff, MAX_OUTPUT);
        to_json(&diff)
    }

    #[tool(
        description = "Undo the last change to a run's files (runs created with `history`): return them to the history point before the newest one. After a command went wrong (deleted, overwrote or broke files), call undo to return the files to as they were before it; call it again to go further back. With `point` (from `history`), return to that point instead; the points after it stay until the next change, so an undo can itself be undone. The run's processes end (start servers again); files in volumes are not touched. Answers the point returned to, the change undone and the run."
    )]
    async fn undo(&self, Parameters(p): Parameters<Undo>) -> Result<String, String> {
        let (point, undone) = match p.point {
            Some(raw) => (point_id(&raw)?, None),
            None => {
                let list = self.client.history(&p.run).await.map_err(refused)?;
                let head = list
                    .head
                    .or_else(|| list.points.first().map(|point| point.id));
                let Some(head) = list.points.iter().find(|point| Some(point.id) == head) else {
                    return Err(invalid(
                        ErrorCode::PointNotFound,
                        format!("run {} has no history points yet: nothing to undo", p.run),
                    ));
                };
                let Some(parent) = head
                    .parent
                    .filter(|parent| list.points.iter().any(|point| point.id == *parent))
                else {
                    return Err(invalid(
                        ErrorCode::PointNotFound,
                        format!(
                            "nothing to undo: point {} is the oldest the run keeps",
                            head.id
                        ),
                    ));
                };
                (parent, Some(head.clone()))
            }
        };
        let req = RollbackRequest {
            point,
            owner: None,
            generation: None,
        };
        let run = self.client.rollback(&p.run, &req).await.map_err(refused)?;
        to_json(&json!({
            "point": point,
            "undone": undone,
            "run": run,
        }))
    }

    #[tool(
        description = "Start a background process in a run (a server, a watcher); answers its pid. It outlives this call."
    )]
    async fn start_process(
        &self,
        Parameters(p): Parameters<StartProcess>,
    ) -> Result<String, String> {
        let req = ExecRequest {
            cmd: shell(p.command),
            cwd: p.cwd,
            tag: p.tag,
            ..Default::default()
        };
        to_json(
            &self
                .client
                .start_process(&p.run, &req)
                .await
                .map_err(refused)?,
        )
    }

    #[tool(
        description = "Build an image from a Dockerfile, step by step in a run, and wait for it (each step is cached). Answers the build: its steps, and on failure the failing step, its exit code and last output lines. Runs created with the image name start from it."
    )]
    async fn build_image(&self, Parameters(p): Parameters<BuildImage>) -> Result<String, String> {
        use futures::StreamExt as _;
        let context = match p.files.filter(|f| !f.is_empty()) {
            None => None,
            Some(files) => {
                let tar = context_tar(&files).map_err(|e| format!("bad_request: {e}"))?;
                let digest = format!("sha256:{:x}", <sha2::Sha256 as sha2::Digest>::digest(&tar));
                let body = runbox_client::UploadBody::from_stream(
                    futures::stream::once(async move { Ok::<_, std::io::Error>(tar) }),
                    None,
                );
                self.client
                    .put_build_context(&digest, body)
                    .await
                    .map_err(refused)?;
                Some(digest)
            }
        };
        let req = runbox_types::BuildRequest {
            name: p.name,
            dockerfile: Some(p.dockerfile),
            context,
            build_args: p.build_args,
            no_cache: p.no_cache.unwrap_or(false),
            ..Default::default()
        };
        let build = self.client.start_build(&req).await.map_err(refused)?;
        let mut events = self
            .client
            .build_events(&build.id.to_string(), 0)
            .await
            .map_err(refused)?;
        while let Some(event) = events.next().await {
            if let runbox_client::BuildUpdate::Done(build) = event.map_err(refused)? {
                return to_json(&build);
            }
        }
        Err("unreachable: the build's event stream ended before the build did".to_owned())
    }

    #[tool(description = "Mint a signed, expiring URL that reaches a port inside a run.")]
    async fn preview_url(&self, Parameters(p): Parameters<Preview>) -> Result<String, String> {
        to_json(
            &self
                .client
                .mint_preview(&p.run, p.port, p.ttl_sec)
                .await
                .map_err(refused)?,
        )
    }
}

#[tool_handler(router = self.tool_router)]
impl ServerHandler for Tools {
    fn get_info(&self) -> ServerConfig {
        ServerConfig::new(ServerCapabilities::builder().enable_tools().build())
            .with_server_info(Implementation::new("runbox", env!("CARGO_PKG_VERSION")))
            .with_instructions(
                "runbox runs isolated, ephemeral Linux sandboxes. Create a run, exec commands in it, \
                 move files under /work, and delete it when done (it also ends at its TTL). \
                 Create it with `history` to see what each command changed (`history`, `diff`) \
                 and to `undo` a change that went wrong.",
            )
    }
}

/// A build context of `files` (relative path: text), as a tar.
fn context_tar(files: &std::collections::BTreeMap<String, String>) -> std::io::Result<Vec<u8>> {
    let mut builder = tar::Builder::new(Vec::new());
    for (path, text) in files {
        let clean = path.trim_start_matches("./");
        if clean.is_empty()
            || clean.starts_with('/')
            || clean.split('/').any(|p| p == ".." || p.is_empty())
        {
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidInput,
                format!(
                    "file path {path:?} must be relative, inside the context, without .. parts"
                ),
            ));
        }
        let mut header = tar::Header::new_gnu();
        header.set_mode(0o644);
        header.set_size(text.len() as u64);
        header.set_mtime(0);
        builder.append_data(&mut header, clean, text.as_bytes())?;
    }
    builder.into_inner()
}
