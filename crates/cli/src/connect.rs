//! The connection options every client subcommand takes, finding the API
//! token, and turning client errors into messages that say what to do.

use std::io::ErrorKind;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context as _};
use runbox_client::types::ErrorCode;
use runbox_client::{Client, ClientError};

/// Where the daemon is and how to authenticate to it.
#[derive(Clone, Debug, clap::Args)]
#[command(next_help_heading = "Connection")]
pub struct ConnectOpts {
    /// URL of the runbox daemon [default: the address `runbox serve` wrote
    /// to <state-dir>/serve.addr, else http://127.0.0.1:7439]
    #[arg(long, env = "RUNBOX_URL", value_name = "URL")]
    pub url: Option<String>,

    /// API token [default: read from <state-dir>/token]. Prefer RUNBOX_TOKEN
    /// or the token file: other local users can see command-line arguments
    #[arg(
        long,
        env = "RUNBOX_TOKEN",
        hide_env_values = true,
        value_name = "TOKEN"
    )]
    pub token: Option<String>,

    /// The daemon's state directory, where the token file is looked for when
    /// no token is given
    #[arg(
        long,
        env = "RUNBOX_STATE_DIR",
        default_value = "/var/lib/runbox",
        value_name = "DIR"
    )]
    pub state_dir: PathBuf,
}

/// A client and what is needed to explain its failures.
pub struct Conn {
    /// The API client.
    pub client: Client,
    url: String,
    token: String,
    token_source: String,
}

impl ConnectOpts {
    /// A client with the token from `--token`, `RUNBOX_TOKEN` or the token
    /// file, in that order.
    pub fn connect(&self) -> anyhow::Result<Conn> {
        let (token, token_source) = match &self.token {
            Some(token) => {
                let token = token.trim();
                if token.is_empty() {
                    bail!("the token given by --token or RUNBOX_TOKEN is empty");
                }
                (token.to_owned(), "--token / RUNBOX_TOKEN".to_owned())
            }
            None => {
                let path = self.state_dir.join("token");
                (read_token_file(&path)?, path.display().to_string())
            }
        };
        let url = self.url();
        let client = Client::new(&url, token.clone()).context("bad --url / RUNBOX_URL")?;
        Ok(Conn {
            client,
            url,
            token,
            token_source,
        })
    }

    /// A client without a token, for the routes that need none (`/health`).
    pub fn connect_anonymous(&self) -> anyhow::Result<Conn> {
        let url = self.url();
        let client = Client::anonymous(&url).context("bad --url / RUNBOX_URL")?;
        Ok(Conn {
            client,
            url,
            token: String::new(),
            token_source: "no token".to_owned(),
        })
    }
}

impl ConnectOpts {
    /// `--url` / `RUNBOX_URL`; else the address the daemon of `--state-dir`
    /// is serving on (it writes it to `serve.addr` when it starts, so a
    /// daemon on another port or on `--listen 127.0.0.1:0` is found); else
    /// the default port on loopback.
    fn url(&self) -> String {
        if let Some(url) = &self.url {
            return url.clone();
        }
        std::fs::read_to_string(self.state_dir.join("serve.addr"))
            .ok()
            .map(|addr| addr.trim().to_owned())
            .filter(|addr| !addr.is_empty() && !addr.contains('/'))
            .map_or_else(|| DEFAULT_URL.to_owned(), |addr| format!("http://{addr}"))
    }
}

/// Where a daemon started with the default `--listen` serves.
pub const DEFAULT_URL: &str = "http://127.0.0.1:7439";

impl Conn {
    /// The API token this connection authenticates with (empty for an
    /// anonymous one).
    pub fn token(&self) -> &str {
        &self.token
    }

    /// Adds what to do about an error where the error itself cannot know it.
    pub fn explain(&self, err: ClientError) -> anyhow::Error {
        if err.is_connect() {
            let hint = format!(
                "cannot reach the runbox daemon at {} (is `runbox serve` running? see --url / RUNBOX_URL)",
                self.url
            );
            return anyhow::Error::new(err).context(hint);
        }
        if err.code() == Some(ErrorCode::Unauthorized) {
            let hint = format!(
                "the daemon refused the API token from {}",
                self.token_source
            );
            return anyhow::Error::new(err).context(hint);
        }
        anyhow::Error::new(err)
    }

    /// [`Conn::explain`] for a result.
    pub fn check<T>(&self, result: Result<T, ClientError>) -> anyhow::Result<T> {
        result.map_err(|err| self.explain(err))
    }
}

/// Reads and trims the token `runbox serve` wrote; every way this can fail
/// says how to get a token instead.
fn read_token_file(path: &Path) -> anyhow::Result<String> {
    let shown = path.display();
    match std::fs::read_to_string(path) {
        Ok(text) if !text.trim().is_empty() => Ok(text.trim().to_owned()),
        Ok(_) => bail!(
            "the token file {shown} is empty; restart `runbox serve` to write a new one, \
             or pass --token / set RUNBOX_TOKEN"
        ),
        Err(err) if err.kind() == ErrorKind::NotFound => bail!(
            "no API token: {shown} does not exist; pass --token or set RUNBOX_TOKEN, \
             or point --state-dir / RUNBOX_STATE_DIR at the directory `runbox serve` uses"
        ),
        Err(err) if err.kind() == ErrorKind::PermissionDenied => bail!(
            "cannot read the API token in {shown}: permission denied; run as a user who may \
             read it (root by default), or pass --token / set RUNBOX_TOKEN"
        ),
        Err(err) => Err(err).with_context(|| format!("cannot read the API token in {shown}")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn opts(state_dir: &Path, token: Option<&str>) -> ConnectOpts {
        ConnectOpts {
            url: Some(DEFAULT_URL.to_owned()),
            token: token.map(str::to_owned),
            state_dir: state_dir.to_owned(),
        }
    }

    #[test]
    fn the_token_file_is_read_and_trimmed() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("token"), "  abc\n").unwrap();
        assert_eq!(read_token_file(&dir.path().join("token")).unwrap(), "abc");
        assert!(opts(dir.path(), None).connect().is_ok());
    }

    #[test]
    fn a_missing_or_empty_token_says_what_to_do() {
        let dir = tempfile::tempdir().unwrap();
        let err = format!("{:#}", opts(dir.path(), None).connect().err().unwrap());
        assert!(
            err.contains("does not exist") && err.contains("RUNBOX_TOKEN"),
            "{err}"
        );
        std::fs::write(dir.path().join("token"), "\n").unwrap();
        let err = format!("{:#}", opts(dir.path(), None).connect().err().unwrap());
        assert!(err.contains("is empty"), "{err}");
        assert!(opts(dir.path(), Some(" ")).connect().is_err());
    }

    #[test]
    fn the_url_is_the_flag_else_the_state_dirs_daemon_else_the_default() {
        let dir = tempfile::tempdir().unwrap();
        let mut opts = opts(dir.path(), None);
        opts.url = None;
        assert_eq!(opts.url(), DEFAULT_URL);
        std::fs::write(dir.path().join("serve.addr"), "127.0.0.1:36463\n").unwrap();
        assert_eq!(opts.url(), "http://127.0.0.1:36463");
        std::fs::write(dir.path().join("serve.addr"), "[::1]:7000").unwrap();
        assert_eq!(opts.url(), "http://[::1]:7000");
        // Not an address: ignored.
        std::fs::write(dir.path().join("serve.addr"), "  \n").unwrap();
        assert_eq!(opts.url(), DEFAULT_URL);
        opts.url = Some("http://example.test:1".to_owned());
        assert_eq!(opts.url(), "http://example.test:1");
    }

    #[test]
    fn an_explicit_token_wins_over_the_file() {
        let dir = tempfile::tempdir().unwrap();
        assert!(opts(dir.path(), Some("t")).connect().is_ok());
    }
}
