//! Test harness: runs the real agent binary on a socket in a temporary
//! directory and talks to it with the real client.
//!
//! Each test gets its own agent, work directory and socket; the agent is
//! killed when the [`TestAgent`] is dropped, even if the test panics.

#![allow(dead_code)] // Each test file uses a different subset.

use std::os::fd::AsRawFd;
use std::os::unix::net::UnixListener;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use runbox_agent_proto::pb::{
    exec_input, exec_output, read_file_chunk, write_file_chunk, AgentError, EnvVar, ExecExit,
    ExecInput, ExecOutput, ExecStart, ReadFileHeader, ReadFileRequest, WriteFileChunk,
    WriteFileCommit, WriteFileHeader,
};
use runbox_agent_proto::{connect_unix, AgentClient, CHUNK_SIZE};
use tempfile::TempDir;
use tonic::{Status, Streaming};

/// Generous bound for anything a test waits for; only a hang exceeds it.
pub const PATIENCE: Duration = Duration::from_secs(30);

/// A running agent and its directories.
pub struct TestAgent {
    child: Child,
    /// Holds `a.sock` and `work/`, and room for things outside the work dir.
    pub dir: TempDir,
    /// The agent's work directory.
    pub work: PathBuf,
    /// A connected client.
    pub client: AgentClient,
}

impl TestAgent {
    /// Whether the agent holds a file open for writing in `dir`: an upload
    /// under way (its file has no name until it is committed).
    pub fn writing_into(&self, dir: &Path) -> bool {
        let pid = self.child.id();
        let Ok(fds) = std::fs::read_dir(format!("/proc/{pid}/fd")) else {
            return false;
        };
        fds.flatten().any(|fd| {
            let name = fd.file_name().to_string_lossy().into_owned();
            let flags = std::fs::read_to_string(format!("/proc/{pid}/fdinfo/{name}"))
                .ok()
                .and_then(|info| {
                    info.lines()
                        .find_map(|l| l.strip_prefix("flags:"))
                        .and_then(|f| u32::from_str_radix(f.trim(), 8).ok())
                });
            std::fs::read_link(fd.path()).is_ok_and(|target| target.starts_with(dir))
                && flags.is_some_and(|flags| flags & 0o3 != 0)
        })
    }

    /// Starts an agent that binds its own socket (`--socket`) and waits
    /// until it answers `Hello`.
    pub async fn start() -> Self {
        let dir = tempfile::tempdir().expect("create temp dir");
        let socket = dir.path().join("a.sock");
        let work = dir.path().join("work");
        let mut command = Command::new(env!("CARGO_BIN_EXE_runbox-agent"));
        command.arg("--socket").arg(&socket);
        Self::launch(command, dir, socket, work).await
    }

    /// Starts an agent the way the daemon does: on a listening socket
    /// created here and inherited as fd 3 (`--listen-fd 3`).
    pub async fn start_on_inherited_fd() -> Self {
        let dir = tempfile::tempdir().expect("create temp dir");
        let socket = dir.path().join("a.sock");
        let work = dir.path().join("work");
        // Created close-on-exec, so commands started concurrently by other
        // tests do not inherit it; only the dup2 below passes it on.
        let listener = UnixListener::bind(&socket).expect("bind socket");
        let raw = listener.as_raw_fd();
        let mut command = Command::new(env!("CARGO_BIN_EXE_runbox-agent"));
        command.args(["--listen-fd", "3"]);
        // SAFETY: runs in the child between fork and exec and only makes
        // async-signal-safe system calls (dup2, fcntl) on descriptor
        // numbers; `listener` stays open in the parent until spawn returns.
        unsafe {
            command.pre_exec(move || {
                if libc::dup2(raw, 3) < 0 {
                    return Err(std::io::Error::last_os_error());
                }
                // dup2 onto itself keeps FD_CLOEXEC; clear it either way.
                if libc::fcntl(3, libc::F_SETFD, 0) < 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        let agent = Self::launch(command, dir, socket, work).await;
        drop(listener);
        agent
    }

    async fn launch(mut command: Command, dir: TempDir, socket: PathBuf, work: PathBuf) -> Self {
        let child = command
            .arg("--work-dir")
            .arg(&work)
            .stdin(Stdio::null())
            .spawn()
            .expect("spawn runbox-agent");
        let mut agent = Self {
            child,
            dir,
            work,
            client: connect_unix(socket),
        };
        let deadline = tokio::time::Instant::now() + PATIENCE;
        loop {
            match agent
                .client
                .hello(runbox_agent_proto::pb::HelloRequest {})
                .await
            {
                Ok(_) => break,
                Err(err) if tokio::time::Instant::now() > deadline => {
                    panic!("agent never answered hello: {err}")
                }
                Err(_) => tokio::time::sleep(Duration::from_millis(20)).await,
            }
        }
        agent
    }

    /// Path of `rel` inside the work directory.
    pub fn path(&self, rel: &str) -> PathBuf {
        self.work.join(rel)
    }
}

impl Drop for TestAgent {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Everything one Exec call produced.
#[derive(Debug, Default)]
pub struct Outcome {
    pub started: Option<u32>,
    pub stdout: Vec<u8>,
    pub stderr: Vec<u8>,
    pub exit: Option<ExecExit>,
    pub error: Option<AgentError>,
    /// Largest single output chunk seen.
    pub max_chunk: usize,
    /// Output chunks skipped for a reader that fell behind.
    pub lost: u64,
}

impl Outcome {
    pub fn stdout_str(&self) -> String {
        String::from_utf8_lossy(&self.stdout).into_owned()
    }

    pub fn exit(&self) -> &ExecExit {
        self.exit
            .as_ref()
            .unwrap_or_else(|| panic!("no exit in {self:?}"))
    }

    pub fn error(&self) -> &AgentError {
        self.error
            .as_ref()
            .unwrap_or_else(|| panic!("no error in {self:?}"))
    }
}

/// An `ExecStart` with just argv set.
pub fn start(argv: &[&str]) -> ExecStart {
    ExecStart {
        argv: argv.iter().map(|s| s.to_string()).collect(),
        ..Default::default()
    }
}

/// `sh -c script`.
pub fn sh(script: &str) -> ExecStart {
    start(&["sh", "-c", script])
}

pub fn env_var(name: &str, value: &str) -> EnvVar {
    EnvVar {
        name: name.into(),
        value: value.into(),
    }
}

pub fn start_msg(start: ExecStart) -> ExecInput {
    ExecInput {
        kind: Some(exec_input::Kind::Start(start)),
    }
}

/// Runs a command whose input is just `start`, and collects its output.
pub async fn exec(client: &mut AgentClient, start: ExecStart) -> Outcome {
    let input = tokio_stream::iter(vec![start_msg(start)]);
    let stream = client.exec(input).await.expect("exec call").into_inner();
    collect(stream).await
}

/// Reads an output stream to its end, checking the protocol's ordering.
pub async fn collect(mut stream: Streaming<ExecOutput>) -> Outcome {
    let mut outcome = Outcome::default();
    loop {
        let message = tokio::time::timeout(PATIENCE, stream.message())
            .await
            .expect("exec output stalled")
            .expect("exec stream failed");
        let Some(message) = message else { break };
        assert!(
            outcome.exit.is_none() && outcome.error.is_none(),
            "output after the final message: {message:?}"
        );
        match message.kind.expect("empty output message") {
            exec_output::Kind::Started(started) => {
                assert!(outcome.started.is_none(), "two started messages");
                outcome.started = Some(started.pid);
            }
            exec_output::Kind::Stdout(data) => {
                assert!(outcome.started.is_some(), "stdout before started");
                outcome.max_chunk = outcome.max_chunk.max(data.len());
                outcome.stdout.extend(data);
            }
            exec_output::Kind::Stderr(data) => {
                assert!(outcome.started.is_some(), "stderr before started");
                outcome.max_chunk = outcome.max_chunk.max(data.len());
                outcome.stderr.extend(data);
            }
            exec_output::Kind::Lost(lost) => outcome.lost += lost.chunks,
            exec_output::Kind::Exit(exit) => outcome.exit = Some(exit),
            exec_output::Kind::Error(error) => {
                assert!(outcome.started.is_none(), "error after started");
                outcome.error = Some(error);
            }
        }
    }
    assert!(
        outcome.exit.is_some() != outcome.error.is_some(),
        "exactly one of exit and error expected: {outcome:?}"
    );
    outcome
}

/// The `runbox-kind` of a file error.
pub fn kind(status: &Status) -> &str {
    status
        .metadata()
        .get("runbox-kind")
        .and_then(|v| v.to_str().ok())
        .unwrap_or("<none>")
}

/// The messages of a complete write: header, data in chunks, commit.
pub fn write_messages(path: &str, mode: u32, data: &[u8], commit: bool) -> Vec<WriteFileChunk> {
    let mut messages = vec![WriteFileChunk {
        kind: Some(write_file_chunk::Kind::Header(WriteFileHeader {
            path: path.into(),
            mode,
            ..Default::default()
        })),
    }];
    for chunk in data.chunks(CHUNK_SIZE) {
        messages.push(WriteFileChunk {
            kind: Some(write_file_chunk::Kind::Data(chunk.to_vec())),
        });
    }
    if commit {
        messages.push(WriteFileChunk {
            kind: Some(write_file_chunk::Kind::Commit(WriteFileCommit {})),
        });
    }
    messages
}

/// Writes `data` to `path` and commits.
pub async fn write(
    client: &mut AgentClient,
    path: &str,
    mode: u32,
    data: &[u8],
) -> Result<u64, Status> {
    let messages = write_messages(path, mode, data, true);
    tokio::time::timeout(PATIENCE, client.write_file(tokio_stream::iter(messages)))
        .await
        .expect("write stalled")
        .map(|reply| reply.into_inner().bytes_written)
}

/// Reads `path` whole, checking the stream's shape.
pub async fn read(
    client: &mut AgentClient,
    path: &str,
) -> Result<(ReadFileHeader, Vec<u8>), Status> {
    let request = ReadFileRequest {
        path: path.into(),
        ..Default::default()
    };
    let mut stream = tokio::time::timeout(PATIENCE, client.read_file(request))
        .await
        .expect("read stalled")?
        .into_inner();
    let mut header = None;
    let mut data = Vec::new();
    while let Some(message) = tokio::time::timeout(PATIENCE, stream.message())
        .await
        .expect("read stalled")?
    {
        match message.kind.expect("empty read message") {
            read_file_chunk::Kind::Header(h) => {
                assert!(header.is_none(), "two headers");
                header = Some(h);
            }
            read_file_chunk::Kind::Data(chunk) => {
                assert!(header.is_some(), "data before header");
                assert!(chunk.len() <= CHUNK_SIZE, "chunk of {} bytes", chunk.len());
                data.extend(chunk);
            }
        }
    }
    let header = header.expect("no header");
    assert_eq!(header.size, data.len() as u64, "size and data disagree");
    Ok((header, data))
}

/// Whether a process exists and is not a zombie.
pub fn alive(pid: u32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        // The state follows the parenthesised command name.
        Ok(stat) => stat
            .rsplit_once(')')
            .map(|(_, rest)| !rest.trim_start().starts_with('Z'))
            .unwrap_or(false),
        Err(_) => false,
    }
}

/// Waits until `pid` is gone from /proc: killed and reaped (a zombie still
/// has an entry). Panics after [`PATIENCE`].
pub async fn wait_reaped(pid: u32) {
    let deadline = tokio::time::Instant::now() + PATIENCE;
    while Path::new(&format!("/proc/{pid}")).exists() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "process {pid} is still there (alive: {})",
            alive(pid)
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Names in `dir` that look like temporary upload files.
pub fn temp_files(dir: &Path) -> Vec<String> {
    std::fs::read_dir(dir)
        .expect("list dir")
        .map(|e| {
            e.expect("dir entry")
                .file_name()
                .to_string_lossy()
                .into_owned()
        })
        .filter(|name| name.starts_with(".runbox-upload-"))
        .collect()
}
