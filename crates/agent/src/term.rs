//! Pseudo-terminals for commands that asked for one, and the async ends of
//! a command's standard streams (pipes or a terminal's master side).
//!
//! The terminal is opened here rather than through a pty crate because the
//! child must be forked by the reaper (see `reaper`), with the slave side as
//! its stdio and its controlling terminal set between fork and exec; the
//! crates that exist spawn the child themselves. What is needed of them is
//! four calls (openpt, grantpt, unlockpt, ptsname), which rustix provides.

use std::io;
use std::os::fd::{AsFd, OwnedFd};
use std::sync::Arc;

use runbox_agent_proto::pb::PtySize;
use rustix::fs::{Mode, OFlags};
use rustix::pty::OpenptFlags;
use rustix::termios::Winsize;
use tokio::io::unix::AsyncFd;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::unix::pipe;

/// The largest terminal either way; anything bigger is a mistake.
pub const MAX_DIMENSION: u32 = 10_000;

/// A new terminal: the master side the agent keeps, and the slave side the
/// command gets as stdin, stdout and stderr.
pub struct Pty {
    pub master: OwnedFd,
    pub slave: OwnedFd,
}

/// Opens a terminal of `size`, its slave owned by `owner` (uid) when given,
/// as `login` does, so the user can reopen it (`/dev/tty`, `tty`).
pub fn open(size: &PtySize, owner: Option<u32>) -> io::Result<Pty> {
    let master =
        rustix::pty::openpt(OpenptFlags::RDWR | OpenptFlags::NOCTTY | OpenptFlags::CLOEXEC)?;
    rustix::pty::grantpt(&master)?;
    rustix::pty::unlockpt(&master)?;
    let name = rustix::pty::ptsname(&master, Vec::new())?;
    let slave = rustix::fs::open(
        name.as_c_str(),
        OFlags::RDWR | OFlags::NOCTTY | OFlags::CLOEXEC,
        Mode::empty(),
    )?;
    if let Some(uid) = owner {
        rustix::fs::fchown(&slave, Some(rustix::fs::Uid::from_raw(uid)), None)?;
    }
    resize(&master, size)?;
    Ok(Pty { master, slave })
}

/// Sets a terminal's size; the kernel sends SIGWINCH to its foreground
/// process group when it changed.
pub fn resize(fd: impl AsFd, size: &PtySize) -> io::Result<()> {
    let clamp = |v: u32| v.clamp(1, MAX_DIMENSION) as u16;
    rustix::termios::tcsetwinsize(
        fd,
        Winsize {
            ws_row: clamp(size.rows),
            ws_col: clamp(size.cols),
            ws_xpixel: 0,
            ws_ypixel: 0,
        },
    )?;
    Ok(())
}

/// A terminal's master side, registered with the runtime; shared by the
/// reader and the writer of one command.
pub type Master = Arc<AsyncFd<OwnedFd>>;

/// Makes `master` non-blocking and registers it.
pub fn master(fd: OwnedFd) -> io::Result<Master> {
    rustix::io::ioctl_fionbio(&fd, true)?;
    // SAFETY: an `OwnedFd` is a valid, open descriptor that stays open and
    // names the same file until it is dropped, which is when the `AsyncFd`
    // owning it is dropped; its `as_raw_fd` always returns that descriptor.
    let registered = unsafe { AsyncFd::register(fd) };
    Ok(Arc::new(registered.map_err(io::Error::from)?))
}

/// Where a command's output is read from.
pub enum Source {
    Pipe(pipe::Receiver),
    Pty(Master),
}

impl Source {
    /// Reads what is there; 0 at the end. A terminal's master reads EIO
    /// once every slave descriptor is closed: that is its end of file.
    pub async fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        match self {
            Self::Pipe(pipe) => pipe.read(buf).await,
            Self::Pty(fd) => loop {
                let mut guard = fd.readable().await?;
                match guard
                    .try_io(|inner| rustix::io::read(inner, &mut *buf).map_err(io::Error::from))
                {
                    Ok(Err(err)) if err.raw_os_error() == Some(libc::EIO) => return Ok(0),
                    Ok(result) => return result,
                    Err(_would_block) => continue,
                }
            },
        }
    }
}

/// Where a command's input is written to.
pub enum Sink {
    Pipe(pipe::Sender),
    Pty(Master),
}

impl Sink {
    pub async fn write_all(&mut self, mut data: &[u8]) -> io::Result<()> {
        match self {
            Self::Pipe(pipe) => pipe.write_all(data).await,
            Self::Pty(fd) => {
                while !data.is_empty() {
                    let mut guard = fd.writable().await?;
                    match guard
                        .try_io(|inner| rustix::io::write(inner, data).map_err(io::Error::from))
                    {
                        Ok(Ok(n)) => data = &data[n..],
                        Ok(Err(err)) => return Err(err),
                        Err(_would_block) => continue,
                    }
                }
                Ok(())
            }
        }
    }
}
