//! `runbox image import|ls|rm`.
//!
//! `import` of a directory streams a tar of it built on the fly: a blocking
//! thread walks the tree and writes the archive into a bounded channel that
//! feeds the request body, so memory use stays at a few chunks however large
//! the tree. Symlinks are archived as symlinks (never followed, so nothing
//! outside the directory is read through them), with modes, owners and
//! mtimes. A file (a tarball, plain or gzip) is sent as is.

use std::fs;
use std::io::{self, BufWriter, Write};
use std::os::unix::fs::FileTypeExt as _;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::Context as _;
use bytes::Bytes;
use clap::{Args, Subcommand};
use runbox_client::{ClientError, UploadBody};
use tokio::sync::mpsc;

use crate::connect::ConnectOpts;
use crate::table;

/// Size of the chunks the tar thread hands over, and (times
/// [`CHANNEL_CHUNKS`]) the most of the archive held in memory at once.
const CHUNK: usize = 64 * 1024;
/// Chunks in flight between the tar thread and the connection.
const CHANNEL_CHUNKS: usize = 8;

/// `runbox image ...`.
#[derive(Debug, Subcommand)]
pub enum ImageCommand {
    /// Import an image from a directory or a tar archive: an OCI image
    /// layout, a `docker save` tarball, or a root filesystem
    Import(ImportArgs),
    /// Pull an image from a registry, with a progress bar per layer
    Pull(PullArgs),
    /// Build an image from a Dockerfile, step by step in a run
    Build(crate::image_build::BuildArgs),
    /// Show one image with its config
    Inspect(InspectArgs),
    /// List images
    Ls(ImageLsArgs),
    /// Delete images
    Rm(ImageRmArgs),
}

/// `runbox image import`.
#[derive(Debug, Args)]
pub struct ImportArgs {
    /// Name for the new image
    pub name: String,
    /// A directory holding the root filesystem, or a tar archive of one
    /// (optionally gzip-compressed)
    #[arg(value_name = "DIR|TARBALL")]
    pub source: PathBuf,
    #[command(flatten)]
    pub conn: ConnectOpts,
}

/// `runbox image pull`.
#[derive(Debug, Args)]
pub struct PullArgs {
    /// What to pull, e.g. `busybox:1.36` or `127.0.0.1:5000/team/app@sha256:...`
    pub reference: String,
    /// Name for the image here; default: the repository's last part, plus
    /// the tag unless it is `latest`
    #[arg(long)]
    pub name: Option<String>,
    /// Registry user; the password is read from standard input
    #[arg(long)]
    pub username: Option<String>,
    #[command(flatten)]
    pub conn: ConnectOpts,
}

/// `runbox image inspect`.
#[derive(Debug, Args)]
pub struct InspectArgs {
    /// The image's name
    pub name: String,
    #[command(flatten)]
    pub conn: ConnectOpts,
}

/// `runbox image ls`.
#[derive(Debug, Args)]
pub struct ImageLsArgs {
    /// Print the image list as JSON
    #[arg(long)]
    pub json: bool,
    #[command(flatten)]
    pub conn: ConnectOpts,
}

/// `runbox image rm`.
#[derive(Debug, Args)]
pub struct ImageRmArgs {
    /// Names of the images to delete
    #[arg(required = true, value_name = "NAME")]
    pub names: Vec<String>,
    #[command(flatten)]
    pub conn: ConnectOpts,
}

/// Runs a `runbox image ...` subcommand.
pub async fn run(command: ImageCommand) -> anyhow::Result<ExitCode> {
    match command {
        ImageCommand::Import(args) => import(args).await,
        ImageCommand::Pull(args) => pull(args).await,
        ImageCommand::Build(args) => crate::image_build::build(args).await,
        ImageCommand::Inspect(args) => inspect(args).await,
        ImageCommand::Ls(args) => ls(args).await,
        ImageCommand::Rm(args) => rm(args).await,
    }
}

async fn pull(args: PullArgs) -> anyhow::Result<ExitCode> {
    use indicatif::{MultiProgress, ProgressBar, ProgressStyle};
    use runbox_client::PullUpdate;
    use runbox_types::PullEvent;

    let password = match &args.username {
        Some(_) => {
            // Never on the command line, where other users could read it.
            let mut line = String::new();
            std::io::stdin()
                .read_line(&mut line)
                .context("reading the registry password from standard input")?;
            Some(line.trim_end_matches(['\r', '\n']).to_owned())
        }
        None => None,
    };
    let conn = args.conn.connect()?;
    let req = runbox_types::PullRequest {
        reference: args.reference.clone(),
        name: args.name.clone(),
        username: args.username.clone(),
        password,
    };
    let mut stream = conn
        .client
        .pull_image(&req)
        .await
        .map_err(|e| conn.explain(e))?;
    let bars = MultiProgress::new();
    let style = ProgressStyle::with_template("{prefix} {bar:30} {bytes}/{total_bytes} {msg}")
        .unwrap_or_else(|_| ProgressStyle::default_bar());
    let mut by_digest = std::collections::HashMap::new();
    let short = |d: &str| {
        d.trim_start_matches("sha256:")
            .chars()
            .take(12)
            .collect::<String>()
    };
    while let Some(update) = futures::StreamExt::next(&mut stream).await {
        match update.map_err(|e| conn.explain(e))? {
            PullUpdate::Progress(PullEvent::Resolved { digest, layers }) => {
                let _ = bars.println(format!(
                    "{}: {layers} layers ({})",
                    args.reference,
                    short(&digest)
                ));
            }
            PullUpdate::Progress(PullEvent::LayerStarted { digest, size }) => {
                let bar = bars.add(
                    ProgressBar::new(size)
                        .with_style(style.clone())
                        .with_prefix(short(&digest)),
                );
                by_digest.insert(digest, bar);
            }
            PullUpdate::Progress(PullEvent::LayerProgress { digest, done, .. }) => {
                if let Some(bar) = by_digest.get(&digest) {
                    bar.set_position(done);
                }
            }
            PullUpdate::Progress(PullEvent::LayerSkipped { digest }) => {
                let _ = bars.println(format!("{} already present", short(&digest)));
            }
            PullUpdate::Progress(PullEvent::LayerDone { digest }) => {
                if let Some(bar) = by_digest.get(&digest) {
                    bar.finish_with_message("done");
                }
            }
            PullUpdate::Done(image) => {
                match image.pull {
                    Some(runbox_types::PullOutcome::UpToDate) => {
                        eprintln!("runbox: image {} is up to date", image.name)
                    }
                    Some(runbox_types::PullOutcome::Updated) => eprintln!(
                        "runbox: image {} replaced by a newer pull (runs made from it keep theirs)",
                        image.name
                    ),
                    _ => {}
                }
                println!("{}", image.name);
                return Ok(ExitCode::SUCCESS);
            }
        }
    }
    anyhow::bail!("the pull stream ended without a result")
}

async fn inspect(args: InspectArgs) -> anyhow::Result<ExitCode> {
    let conn = args.conn.connect()?;
    let image = conn
        .client
        .get_image(&args.name)
        .await
        .map_err(|e| conn.explain(e))?;
    println!("{}", serde_json::to_string_pretty(&image)?);
    Ok(ExitCode::SUCCESS)
}

async fn import(args: ImportArgs) -> anyhow::Result<ExitCode> {
    let source = &args.source;
    let meta = tokio::fs::metadata(source)
        .await
        .with_context(|| format!("cannot read {}", source.display()))?;
    let conn = args.conn.connect()?;
    let image = if meta.is_dir() {
        let (body, tar_thread) = stream_tree(source.clone());
        let uploaded = conn.client.import_image(&args.name, body).await;
        let archived = tar_thread.await.context("the tar thread panicked")?;
        match (uploaded, archived) {
            (Ok(image), Ok(())) => image,
            // The server's verdict is the most precise when it gave one; a
            // tar error after it is only the broken pipe it caused.
            (Err(err @ ClientError::Api { .. }), _) => return Err(conn.explain(err)),
            // The archive stopped because the upload did: the upload's own
            // error says why (the daemon unreachable, the connection cut).
            (Err(err), Err(tar)) if tar.kind() == io::ErrorKind::BrokenPipe => {
                return Err(conn.explain(err))
            }
            (_, Err(err)) => {
                return Err(err).with_context(|| format!("cannot archive {}", source.display()))
            }
            (Err(err), Ok(())) => return Err(conn.explain(err)),
        }
    } else {
        let file = tokio::fs::File::open(source)
            .await
            .with_context(|| format!("cannot open {}", source.display()))?;
        let len = file
            .metadata()
            .await
            .ok()
            .filter(|m| m.is_file())
            .map(|m| m.len());
        // Upload progress; the daemon then unpacks and answers when the
        // image is stored.
        let bar = indicatif::ProgressBar::new(len.unwrap_or(0)).with_style(
            indicatif::ProgressStyle::with_template(
                "{prefix} {bar:30} {bytes}/{total_bytes} {msg}",
            )
            .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
        );
        bar.set_prefix(format!("uploading {}", source.display()));
        let body = UploadBody::from_reader(bar.wrap_async_read(file), len);
        let result = conn.client.import_image(&args.name, body).await;
        bar.finish_and_clear();
        conn.check(result)?
    };
    println!("{}", image.name);
    Ok(ExitCode::SUCCESS)
}

/// Starts archiving `root` on a blocking thread; returns the request body
/// that streams the archive and the thread's handle.
fn stream_tree(root: PathBuf) -> (UploadBody, tokio::task::JoinHandle<io::Result<()>>) {
    let (chunks, thread) = spawn_tar(root);
    (UploadBody::from_stream(chunks, None), thread)
}

/// Archives `root` on a blocking thread into a stream of chunks.
///
/// An archiving error is also sent down the stream as its last item, so an
/// upload fed by it fails instead of importing a truncated tree.
fn spawn_tar(
    root: PathBuf,
) -> (
    impl futures::Stream<Item = io::Result<Bytes>> + Send + 'static,
    tokio::task::JoinHandle<io::Result<()>>,
) {
    let (tx, rx) = mpsc::channel::<io::Result<Bytes>>(CHANNEL_CHUNKS);
    let thread = tokio::task::spawn_blocking(move || {
        let out = BufWriter::with_capacity(CHUNK, ChannelWriter { tx: tx.clone() });
        let result = write_tree_tar(&root, out)
            .and_then(|out| out.into_inner().map_err(|err| err.into_error()))
            .map(drop);
        if let Err(err) = &result {
            // The receiver may be gone already (the server answered early);
            // then there is nobody to tell.
            let _ = tx.blocking_send(Err(io::Error::new(err.kind(), err.to_string())));
        }
        result
    });
    let chunks = futures::stream::unfold(rx, |mut rx| async move {
        rx.recv().await.map(|item| (item, rx))
    });
    (chunks, thread)
}

/// A `Write` that hands each write to an async receiver; blocks while the
/// channel is full, which is what bounds memory.
struct ChannelWriter {
    tx: mpsc::Sender<io::Result<Bytes>>,
}

impl Write for ChannelWriter {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.tx
            .blocking_send(Ok(Bytes::copy_from_slice(buf)))
            .map_err(|_| io::Error::new(io::ErrorKind::BrokenPipe, "the upload stopped"))?;
        Ok(buf.len())
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

/// Writes a tar of everything under `root` into `out`, entries named
/// relative to `root` (which itself is not an entry), each directory before
/// its contents, in name order so that the same tree gives the same archive.
fn write_tree_tar<W: Write>(root: &Path, out: W) -> io::Result<W> {
    write_tree_tar_with(root, &|_, _| true, out)
}

/// [`write_tree_tar`] of the entries `keep` (given each entry's relative
/// path and whether it is a directory) says to archive; a directory it
/// leaves out is not entered.
pub(crate) fn write_tree_tar_with<W: Write>(
    root: &Path,
    keep: &dyn Fn(&Path, bool) -> bool,
    out: W,
) -> io::Result<W> {
    let mut builder = tar::Builder::new(out);
    builder.follow_symlinks(false);
    builder.mode(tar::HeaderMode::Complete);
    let mut pending = vec![PathBuf::new()];
    while let Some(rel_dir) = pending.pop() {
        let dir = root.join(&rel_dir);
        let mut entries = fs::read_dir(&dir)
            .and_then(|entries| entries.collect::<io::Result<Vec<_>>>())
            .map_err(|err| at(&dir, err))?;
        entries.sort_by_key(|entry| entry.file_name());
        let mut subdirs = Vec::new();
        for entry in entries {
            let path = entry.path();
            let name = rel_dir.join(entry.file_name());
            let kind = entry.file_type().map_err(|err| at(&path, err))?;
            if !keep(&name, kind.is_dir()) {
                continue;
            }
            if kind.is_socket() {
                // A socket is only meaningful to the process that bound it.
                tracing::warn!(path = %path.display(), "skipping a socket");
                continue;
            }
            if kind.is_char_device() || kind.is_block_device() || kind.is_fifo() {
                // The daemon never creates device nodes or FIFOs from an image
                // (every run gets its own minimal /dev), so sending them is
                // pointless; a rootfs made by debootstrap has a few in /dev.
                tracing::debug!(path = %path.display(), "skipping a device node or fifo");
                continue;
            }
            if kind.is_file() {
                let mut file = fs::File::open(&path).map_err(|err| at(&path, err))?;
                builder
                    .append_file(&name, &mut file)
                    .map_err(|err| at(&path, err))?;
            } else {
                // Directories (the header only) and symlinks (as links).
                builder
                    .append_path_with_name(&path, &name)
                    .map_err(|err| at(&path, err))?;
            }
            if kind.is_dir() {
                subdirs.push(name);
            }
        }
        // Reversed so that popping visits them in name order.
        pending.extend(subdirs.into_iter().rev());
    }
    builder.into_inner()
}

/// Names the file an I/O error is about; `io::Error`s do not.
fn at(path: &Path, err: io::Error) -> io::Error {
    io::Error::new(err.kind(), format!("{}: {err}", path.display()))
}

async fn ls(args: ImageLsArgs) -> anyhow::Result<ExitCode> {
    let conn = args.conn.connect()?;
    let list = conn.check(conn.client.list_images().await)?;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&list)?);
    } else {
        let rows: Vec<Vec<String>> = list
            .images
            .iter()
            .map(|image| {
                vec![
                    image.name.clone(),
                    table::size(image.size_bytes),
                    table::date(image.created_at),
                ]
            })
            .collect();
        print!(
            "{}",
            table::render(&["NAME", "SIZE", "CREATED (UTC)"], &rows)
        );
    }
    Ok(ExitCode::SUCCESS)
}

async fn rm(args: ImageRmArgs) -> anyhow::Result<ExitCode> {
    let conn = args.conn.connect()?;
    let mut failed = false;
    for name in &args.names {
        match conn.check(conn.client.delete_image(name).await) {
            Ok(()) => println!("{name}"),
            Err(err) => {
                eprintln!("runbox: cannot delete image {name}: {err:#}");
                failed = true;
            }
        }
    }
    Ok(if failed {
        ExitCode::FAILURE
    } else {
        ExitCode::SUCCESS
    })
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::{symlink, PermissionsExt as _};

    use futures::StreamExt as _;

    use super::*;

    fn sample_tree() -> tempfile::TempDir {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path();
        fs::create_dir_all(root.join("bin")).unwrap();
        fs::create_dir_all(root.join("etc/conf.d")).unwrap();
        fs::write(root.join("bin/tool"), b"#!/bin/sh\necho hi\n").unwrap();
        fs::set_permissions(root.join("bin/tool"), fs::Permissions::from_mode(0o755)).unwrap();
        fs::write(root.join("etc/conf.d/a"), b"x").unwrap();
        // A symlink that points outside the tree must be stored, not followed.
        symlink("/etc/hostname", root.join("etc/hostname")).unwrap();
        symlink("../bin/tool", root.join("etc/tool")).unwrap();
        dir
    }

    fn entries(archive: &[u8]) -> Vec<(String, tar::EntryType, u32, Option<String>)> {
        let mut archive = tar::Archive::new(archive);
        archive
            .entries()
            .unwrap()
            .map(|entry| {
                let entry = entry.unwrap();
                let header = entry.header();
                (
                    entry.path().unwrap().to_string_lossy().into_owned(),
                    header.entry_type(),
                    header.mode().unwrap() & 0o7777,
                    entry
                        .link_name()
                        .unwrap()
                        .map(|link| link.to_string_lossy().into_owned()),
                )
            })
            .collect()
    }

    #[test]
    fn device_nodes_and_fifos_are_left_out() {
        let tree = sample_tree();
        let status = std::process::Command::new("mkfifo")
            .arg(tree.path().join("etc/pipe"))
            .status()
            .unwrap();
        assert!(status.success());
        let archive = write_tree_tar(tree.path(), Vec::new()).unwrap();
        assert!(entries(&archive).iter().all(|e| e.0 != "etc/pipe"));
        // Making a device node needs root; the suite runs as root.
        if rustix::process::geteuid().is_root() {
            let node = tree.path().join("etc/null");
            let made = std::process::Command::new("mknod")
                .arg(&node)
                .args(["c", "1", "3"])
                .status()
                .unwrap();
            assert!(made.success());
            let archive = write_tree_tar(tree.path(), Vec::new()).unwrap();
            assert!(entries(&archive).iter().all(|e| e.0 != "etc/null"));
        }
    }

    #[test]
    fn trees_are_archived_in_order_with_symlinks_and_modes() {
        let tree = sample_tree();
        let archive = write_tree_tar(tree.path(), Vec::new()).unwrap();
        let entries = entries(&archive);
        let names: Vec<&str> = entries.iter().map(|e| e.0.as_str()).collect();
        assert_eq!(
            names,
            [
                "bin",
                "etc",
                "bin/tool",
                "etc/conf.d",
                "etc/hostname",
                "etc/tool",
                "etc/conf.d/a"
            ]
        );
        let tool = entries.iter().find(|e| e.0 == "bin/tool").unwrap();
        assert_eq!((tool.1, tool.2), (tar::EntryType::Regular, 0o755));
        let link = entries.iter().find(|e| e.0 == "etc/hostname").unwrap();
        assert_eq!(link.1, tar::EntryType::Symlink);
        assert_eq!(link.3.as_deref(), Some("/etc/hostname"));
        assert!(entries
            .iter()
            .all(|e| !e.0.starts_with('/') && !e.0.starts_with("./")));
    }

    #[tokio::test]
    async fn the_streamed_archive_equals_the_direct_one() {
        let tree = sample_tree();
        let direct = write_tree_tar(tree.path(), Vec::new()).unwrap();
        let (chunks, thread) = spawn_tar(tree.path().to_owned());
        let chunks: Vec<io::Result<Bytes>> = chunks.collect().await;
        thread.await.unwrap().unwrap();
        let streamed: Vec<u8> = chunks.into_iter().flat_map(|c| c.unwrap()).collect();
        assert_eq!(streamed, direct);
    }

    #[tokio::test]
    async fn an_archiving_error_ends_the_stream() {
        let (chunks, thread) = spawn_tar(PathBuf::from("/nonexistent/runbox-test"));
        let chunks: Vec<io::Result<Bytes>> = chunks.collect().await;
        let err = chunks.last().unwrap().as_ref().unwrap_err();
        assert!(
            err.to_string().contains("/nonexistent/runbox-test"),
            "{err}"
        );
        assert!(thread.await.unwrap().is_err());
    }

    #[tokio::test]
    async fn a_stopped_upload_stops_the_archiver() {
        let tree = sample_tree();
        let (chunks, thread) = spawn_tar(tree.path().to_owned());
        drop(chunks);
        let err = thread.await.unwrap().unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::BrokenPipe);
    }
}
