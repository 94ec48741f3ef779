//! The gRPC service: glue between the generated `Agent` trait and the
//! modules that do the work.
//!
//! Owns nothing but the shared state every call needs (the reaper, the
//! work directory and the process table); each method delegates to the
//! module that does the work.

use std::path::PathBuf;
use std::sync::Arc;

use runbox_agent_proto::pb::agent_server::Agent;
use runbox_agent_proto::pb::{
    ExecInput, FileInfo, HelloReply, HelloRequest, ListDirReply, ListDirRequest,
    ListProcessesReply, ListProcessesRequest, MakeDirRequest, MoveRequest, ProcessInfo,
    ReadFileRequest, RemoveReply, RemoveRequest, SendInputRequest, SignalProcessRequest,
    StatRequest, UnpackChunk, UnpackReply, WaitProcessRequest, WatchRequest, WriteFileChunk,
    WriteFileReply,
};
use runbox_agent_proto::PROTOCOL;
use tonic::{Request, Response, Status, Streaming};

use crate::confine::WorkDir;
use crate::procs::Table;
use crate::reaper::Reaper;
use crate::{exec, files, fsops, procs, unpack, watch};

/// The agent's implementation of the protocol.
#[derive(Debug, Clone)]
pub struct AgentService {
    reaper: Arc<Reaper>,
    work: Arc<WorkDir>,
    /// The run's root filesystem, for requests with `root` (protocol 4).
    file_system: Arc<WorkDir>,
    table: Arc<Table>,
}

impl AgentService {
    /// Serves commands through `reaper` and files below `work`.
    pub fn new(reaper: Arc<Reaper>, work: WorkDir) -> Self {
        Self {
            reaper,
            work: Arc::new(work),
            file_system: Arc::new(WorkDir::file_system(PathBuf::from("/"))),
            table: Arc::default(),
        }
    }

    /// Where a file request's paths are: the run's root filesystem with
    /// `root`, else the work directory.
    fn base(&self, root: bool) -> Arc<WorkDir> {
        Arc::clone(if root { &self.file_system } else { &self.work })
    }
}

#[tonic::async_trait]
impl Agent for AgentService {
    async fn hello(&self, _: Request<HelloRequest>) -> Result<Response<HelloReply>, Status> {
        Ok(Response::new(HelloReply {
            version: env!("CARGO_PKG_VERSION").to_owned(),
            protocol: PROTOCOL,
        }))
    }

    type ExecStream = exec::OutputStream;

    async fn exec(
        &self,
        request: Request<Streaming<ExecInput>>,
    ) -> Result<Response<Self::ExecStream>, Status> {
        let stream = exec::exec(
            Arc::clone(&self.table),
            Arc::clone(&self.reaper),
            self.work.path().to_owned(),
            request.into_inner(),
        )
        .await?;
        Ok(Response::new(stream))
    }

    async fn write_file(
        &self,
        request: Request<Streaming<WriteFileChunk>>,
    ) -> Result<Response<WriteFileReply>, Status> {
        let bytes_written = files::write_file(
            Arc::clone(&self.work),
            Arc::clone(&self.file_system),
            request.into_inner(),
        )
        .await?;
        Ok(Response::new(WriteFileReply { bytes_written }))
    }

    async fn unpack(
        &self,
        request: Request<Streaming<UnpackChunk>>,
    ) -> Result<Response<UnpackReply>, Status> {
        Ok(Response::new(
            unpack::unpack(Arc::clone(&self.file_system), request.into_inner()).await?,
        ))
    }

    type ReadFileStream = files::ReadStream;

    async fn read_file(
        &self,
        request: Request<ReadFileRequest>,
    ) -> Result<Response<Self::ReadFileStream>, Status> {
        let request = request.into_inner();
        let stream = files::read_file(self.base(request.root), request.path).await?;
        Ok(Response::new(stream))
    }

    async fn stat(&self, request: Request<StatRequest>) -> Result<Response<FileInfo>, Status> {
        Ok(Response::new({
            let request = request.into_inner();
            fsops::stat(self.base(request.root), request).await?
        }))
    }

    async fn list_dir(
        &self,
        request: Request<ListDirRequest>,
    ) -> Result<Response<ListDirReply>, Status> {
        Ok(Response::new({
            let request = request.into_inner();
            fsops::list_dir(self.base(request.root), request).await?
        }))
    }

    async fn make_dir(
        &self,
        request: Request<MakeDirRequest>,
    ) -> Result<Response<FileInfo>, Status> {
        Ok(Response::new({
            let request = request.into_inner();
            fsops::make_dir(self.base(request.root), request).await?
        }))
    }

    async fn r#move(&self, request: Request<MoveRequest>) -> Result<Response<FileInfo>, Status> {
        Ok(Response::new({
            let request = request.into_inner();
            fsops::move_path(self.base(request.root), request).await?
        }))
    }

    type WatchStream = watch::WatchStream;

    async fn watch(
        &self,
        request: Request<WatchRequest>,
    ) -> Result<Response<Self::WatchStream>, Status> {
        Ok(Response::new({
            let request = request.into_inner();
            watch::watch(self.base(request.root), request).await?
        }))
    }

    async fn remove(
        &self,
        request: Request<RemoveRequest>,
    ) -> Result<Response<RemoveReply>, Status> {
        Ok(Response::new({
            let request = request.into_inner();
            fsops::remove(self.base(request.root), request).await?
        }))
    }

    type AttachStream = exec::OutputStream;

    async fn attach(
        &self,
        request: Request<Streaming<ExecInput>>,
    ) -> Result<Response<Self::AttachStream>, Status> {
        Ok(Response::new(
            procs::attach(&self.table, request.into_inner()).await?,
        ))
    }

    async fn list_processes(
        &self,
        _: Request<ListProcessesRequest>,
    ) -> Result<Response<ListProcessesReply>, Status> {
        Ok(Response::new(ListProcessesReply {
            processes: self.table.list(),
        }))
    }

    async fn signal_process(
        &self,
        request: Request<SignalProcessRequest>,
    ) -> Result<Response<ProcessInfo>, Status> {
        Ok(Response::new(
            procs::signal(&self.table, request.into_inner()).await?,
        ))
    }

    async fn send_input(
        &self,
        request: Request<SendInputRequest>,
    ) -> Result<Response<ProcessInfo>, Status> {
        Ok(Response::new(
            procs::send_input(&self.table, request.into_inner()).await?,
        ))
    }

    async fn wait_process(
        &self,
        request: Request<WaitProcessRequest>,
    ) -> Result<Response<ProcessInfo>, Status> {
        Ok(Response::new(
            procs::wait(&self.table, request.into_inner()).await?,
        ))
    }
}
