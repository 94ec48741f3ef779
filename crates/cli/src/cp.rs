//! `runbox cp`: copies one file between the local machine and a run's
//! `/work`, streaming both ways.
//!
//! One side is remote, written `ID:PATH`: `PATH` is `/work/...` or relative
//! to `/work`, and a path that names a directory (`ID:`, `ID:/work/`,
//! `ID:out/`) takes the local file's name. The other side is a local path, or
//! `-` for stdin / stdout.
//!
//! A download goes to a hidden temporary file next to the destination and is
//! renamed over it only once complete, so a failed or interrupted copy never
//! leaves a truncated file under the real name.

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::{anyhow, bail, Context as _};
use clap::Args;
use runbox_client::{LeaseCredential, UploadBody};

use crate::args::LeaseOpts;
use crate::connect::{Conn, ConnectOpts};

/// `runbox cp`.
#[derive(Debug, Args)]
#[command(after_help = "Examples:\n  \
    runbox cp ./input.csv 01J9Z...:/work/data/\n  \
    runbox cp 01J9Z...:out/report.pdf .\n  \
    tar cz src | runbox cp - 01J9Z...:src.tgz")]
pub struct CpArgs {
    /// Source: a local file, `-` for stdin, or ID:PATH in a run
    pub src: String,
    /// Destination: a local file or directory, `-` for stdout, or ID:PATH in a run
    pub dst: String,
    /// Needed for uploads while a lease is active (downloads are always open)
    #[command(flatten)]
    pub lease: LeaseOpts,
    #[command(flatten)]
    pub conn: ConnectOpts,
}

/// One side of a copy.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Side {
    /// A local path.
    Local(PathBuf),
    /// `-`: stdin as a source, stdout as a destination.
    Stdio,
    /// A path in a run.
    Remote(Remote),
}

/// A path in a run's `/work`.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Remote {
    id: String,
    /// Relative to `/work`, normalised (no empty or `.` segments); empty when
    /// it names `/work` itself.
    path: String,
    /// The path was written as a directory (trailing `/`, `.` or empty).
    dir: bool,
}

/// What `runbox cp SRC DST` does.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Transfer {
    Upload { from: Side, to: Remote },
    Download { from: Remote, to: Side },
}

/// Runs `runbox cp`.
pub async fn run(args: CpArgs) -> anyhow::Result<ExitCode> {
    // Parse before connecting, so that a mistyped command line is reported
    // as such and not as a missing token.
    let transfer = plan(&args.src, &args.dst)?;
    let conn = args.conn.connect()?;
    match transfer {
        Transfer::Upload { from, to } => {
            upload(&conn, from, to, args.lease.credential().as_ref()).await?
        }
        Transfer::Download { from, to } => download(&conn, from, to).await?,
    }
    Ok(ExitCode::SUCCESS)
}

fn plan(src: &str, dst: &str) -> anyhow::Result<Transfer> {
    match (parse_side(src)?, parse_side(dst)?) {
        (Side::Remote(_), Side::Remote(_)) => {
            bail!("both sides of cp are in a run; copy through a local file instead")
        }
        (Side::Remote(from), to) => {
            if from.dir {
                bail!("the source {src:?} names a directory; cp copies single files")
            }
            Ok(Transfer::Download { from, to })
        }
        (from, Side::Remote(to)) => Ok(Transfer::Upload { from, to }),
        _ => bail!(
            "one side of cp must be in a run, written ID:/work/PATH or ID:PATH \
             (got {src:?} and {dst:?}; write a local path containing `:` as ./NAME)"
        ),
    }
}

/// `-` is stdio; `X:Y` is remote when `X` is non-empty and has no `/` (so
/// `./a:b` and `/tmp/a:b` stay local); anything else is a local path.
fn parse_side(arg: &str) -> anyhow::Result<Side> {
    if arg == "-" {
        return Ok(Side::Stdio);
    }
    match arg.split_once(':') {
        Some((id, path)) if !id.is_empty() && !id.contains('/') => {
            let (path, dir) = remote_path(path)?;
            Ok(Side::Remote(Remote {
                id: id.to_owned(),
                path,
                dir,
            }))
        }
        _ if arg.is_empty() => bail!("an empty path is not a file"),
        _ => Ok(Side::Local(PathBuf::from(arg))),
    }
}

/// Confines a remote path to `/work` and normalises it; returns the path
/// relative to `/work` and whether it was written as a directory.
fn remote_path(raw: &str) -> anyhow::Result<(String, bool)> {
    let relative = match raw.strip_prefix('/') {
        None => raw,
        Some(absolute) => match absolute.strip_prefix("work") {
            Some(rest) if rest.is_empty() || rest.starts_with('/') => rest,
            _ => bail!("{raw} is outside /work; runbox copies files in /work only"),
        },
    };
    let mut parts = Vec::new();
    for part in relative.split('/') {
        match part {
            "" | "." => {}
            // The server refuses it too, but a path that climbs out of /work
            // deserves the same clear message as one that starts outside it.
            ".." => bail!("{raw} contains `..`; runbox copies files in /work only"),
            part => parts.push(part),
        }
    }
    let dir =
        parts.is_empty() || relative.ends_with('/') || relative.ends_with("/.") || relative == ".";
    Ok((parts.join("/"), dir))
}

/// The last segment of a path, as a file name.
fn base_name(path: &Path) -> anyhow::Result<&str> {
    path.file_name()
        .and_then(|name| name.to_str())
        .ok_or_else(|| anyhow!("{} has no usable file name", path.display()))
}

async fn upload(
    conn: &Conn,
    from: Side,
    to: Remote,
    lease: Option<&LeaseCredential>,
) -> anyhow::Result<()> {
    let (body, name) = match &from {
        Side::Stdio => (UploadBody::from_reader(tokio::io::stdin(), None), None),
        Side::Local(path) => {
            let file = tokio::fs::File::open(path)
                .await
                .with_context(|| format!("cannot open {}", path.display()))?;
            let meta = file.metadata().await?;
            if meta.is_dir() {
                bail!(
                    "{} is a directory; cp copies single files (pack a directory with tar first)",
                    path.display()
                );
            }
            let body = UploadBody::from_file(file).await?;
            (body, Some(base_name(path)?))
        }
        Side::Remote(_) => unreachable!("plan never uploads from a run"),
    };
    let path = match (to.dir, name) {
        (false, _) => to.path.clone(),
        (true, Some(name)) if to.path.is_empty() => name.to_owned(),
        (true, Some(name)) => format!("{}/{name}", to.path),
        (true, None) => bail!(
            "name the file to write in the run, e.g. {}:/work/input",
            to.id
        ),
    };
    conn.check(conn.client.put_file_as(&to.id, &path, lease, body).await)
        .with_context(|| format!("cannot upload to {}:/work/{path}", to.id))
}

async fn download(conn: &Conn, from: Remote, to: Side) -> anyhow::Result<()> {
    let context = || format!("cannot download {}:/work/{}", from.id, from.path);
    match to {
        Side::Stdio => {
            let download = conn
                .check(conn.client.get_file(&from.id, &from.path).await)
                .with_context(context)?;
            let mut stdout = tokio::io::stdout();
            download.copy_to(&mut stdout).await.with_context(context)?;
        }
        Side::Local(dest) => {
            let dest = match tokio::fs::metadata(&dest).await {
                Ok(meta) if meta.is_dir() => {
                    // `plan` refuses directory sources, so there is a name.
                    let name = from.path.rsplit('/').next().unwrap_or(&from.path);
                    dest.join(name)
                }
                _ => dest,
            };
            let mut partial = PartialFile::create(&dest).await?;
            let copy = async {
                let download = conn
                    .check(conn.client.get_file(&from.id, &from.path).await)
                    .with_context(context)?;
                download
                    .copy_to(&mut partial.file)
                    .await
                    .with_context(context)?;
                anyhow::Ok(())
            };
            // On Ctrl-C, return (and remove the partial file) rather than die
            // with it on disk.
            tokio::select! {
                result = copy => result?,
                _ = tokio::signal::ctrl_c() => bail!("interrupted"),
            }
            partial.commit(&dest).await?;
        }
        Side::Remote(_) => unreachable!("plan never downloads into a run"),
    }
    Ok(())
}

/// A download in progress: a hidden file next to its destination, removed
/// when dropped unless committed.
struct PartialFile {
    path: PathBuf,
    file: tokio::fs::File,
    committed: bool,
}

impl PartialFile {
    async fn create(dest: &Path) -> anyhow::Result<PartialFile> {
        let name = base_name(dest)?;
        let dir = match dest.parent() {
            Some(parent) if !parent.as_os_str().is_empty() => parent,
            _ => Path::new("."),
        };
        // create_new, so that two downloads (or an attacker's symlink in a
        // shared directory) never share a temporary file.
        for attempt in 0u32.. {
            let path = dir.join(format!(
                ".{name}.runbox-{}-{attempt}.part",
                std::process::id()
            ));
            let opened = tokio::fs::OpenOptions::new()
                .write(true)
                .create_new(true)
                .mode(0o666)
                .open(&path)
                .await;
            match opened {
                Ok(file) => {
                    return Ok(PartialFile {
                        path,
                        file,
                        committed: false,
                    })
                }
                Err(err) if err.kind() == std::io::ErrorKind::AlreadyExists && attempt < 100 => {}
                Err(err) => {
                    return Err(err)
                        .with_context(|| format!("cannot create a file in {}", dir.display()))
                }
            }
        }
        unreachable!("the loop returns")
    }

    async fn commit(mut self, dest: &Path) -> anyhow::Result<()> {
        self.file
            .sync_all()
            .await
            .with_context(|| format!("cannot write {}", self.path.display()))?;
        tokio::fs::rename(&self.path, dest).await.with_context(|| {
            format!("cannot move the download into place at {}", dest.display())
        })?;
        self.committed = true;
        Ok(())
    }
}

impl Drop for PartialFile {
    fn drop(&mut self) {
        if !self.committed {
            // Best effort: there is nobody left to report a failure to.
            let _ = std::fs::remove_file(&self.path);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn remote(id: &str, path: &str, dir: bool) -> Remote {
        Remote {
            id: id.to_owned(),
            path: path.to_owned(),
            dir,
        }
    }

    #[test]
    fn remote_paths_are_relative_to_work() {
        let cases = [
            ("ID:/work/a/b.txt", "a/b.txt", false),
            ("ID:a/b.txt", "a/b.txt", false),
            ("ID:/work//a/./b.txt", "a/b.txt", false),
            ("ID:/work/out/", "out", true),
            ("ID:/work", "", true),
            ("ID:/work/", "", true),
            ("ID:", "", true),
            ("ID:.", "", true),
            ("ID:workdir/x", "workdir/x", false),
        ];
        for (arg, path, dir) in cases {
            assert_eq!(
                parse_side(arg).unwrap(),
                Side::Remote(remote("ID", path, dir)),
                "{arg}"
            );
        }
    }

    #[test]
    fn remote_paths_outside_work_are_refused() {
        for arg in [
            "ID:/etc/passwd",
            "ID:/workdir/x",
            "ID:/",
            "ID:../x",
            "ID:/work/a/../../etc",
        ] {
            let err = parse_side(arg).unwrap_err().to_string();
            assert!(err.contains("/work only"), "{arg}: {err}");
        }
    }

    #[test]
    fn local_paths_and_stdio() {
        assert_eq!(parse_side("-").unwrap(), Side::Stdio);
        assert_eq!(parse_side("a.txt").unwrap(), Side::Local("a.txt".into()));
        assert_eq!(parse_side("./a:b").unwrap(), Side::Local("./a:b".into()));
        assert_eq!(
            parse_side("/tmp/a:b").unwrap(),
            Side::Local("/tmp/a:b".into())
        );
        assert!(parse_side("").is_err());
    }

    #[test]
    fn exactly_one_side_is_remote() {
        assert_eq!(
            plan("f", "ID:x").unwrap(),
            Transfer::Upload {
                from: Side::Local("f".into()),
                to: remote("ID", "x", false)
            }
        );
        assert_eq!(
            plan("ID:/work/x", "-").unwrap(),
            Transfer::Download {
                from: remote("ID", "x", false),
                to: Side::Stdio
            }
        );
        let err = plan("a", "b").unwrap_err().to_string();
        assert!(err.contains("ID:/work/PATH"), "{err}");
        assert!(plan("A:x", "B:y")
            .unwrap_err()
            .to_string()
            .contains("both sides"));
        assert!(plan("A:dir/", "here")
            .unwrap_err()
            .to_string()
            .contains("directory"));
    }

    #[tokio::test]
    async fn an_uncommitted_download_leaves_nothing_behind() {
        let dir = tempfile::tempdir().unwrap();
        let dest = dir.path().join("out.bin");
        let partial = PartialFile::create(&dest).await.unwrap();
        assert!(partial.path.exists());
        drop(partial);
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);

        let mut partial = PartialFile::create(&dest).await.unwrap();
        tokio::io::AsyncWriteExt::write_all(&mut partial.file, b"data")
            .await
            .unwrap();
        partial.commit(&dest).await.unwrap();
        assert_eq!(std::fs::read(&dest).unwrap(), b"data");
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 1);
    }
}
