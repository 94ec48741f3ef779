//! A private PostgreSQL server for tests and benchmarks of a fleet
//! (behind the `testing` feature): Debian's `postgresql` binaries,
//! `initdb` as the `postgres` user into a temporary directory, a loopback
//! port and a password login.

use std::path::PathBuf;
use std::process::Command;

/// A private PostgreSQL server for the fleet's tests: initialised in a
/// temporary directory owned by the `postgres` user, serving on a loopback
/// port with a password login (user `runbox`, database `postgres`). A test
/// stops and starts it as an outage would ([`PgServer::stop`],
/// [`PgServer::start_again`]). Stopped, and its directory removed, when
/// dropped.
pub struct PgServer {
    /// The loopback port it serves on.
    pub port: u16,
    /// The password of user `runbox`.
    pub password: String,
    dir: tempfile::TempDir,
    bin: PathBuf,
}

/// Where Debian's PostgreSQL binaries are (the newest major version).
fn pg_bin() -> PathBuf {
    let mut found: Vec<PathBuf> = std::fs::read_dir("/usr/lib/postgresql")
        .map(|entries| {
            entries
                .flatten()
                .map(|e| e.path().join("bin"))
                .filter(|bin| bin.join("initdb").exists())
                .collect()
        })
        .unwrap_or_default();
    found.sort();
    found
        .pop()
        .expect("PostgreSQL is not installed (scripts/deps --test installs it)")
}

impl PgServer {
    /// Joins this server's fleet as node `node` from this process (no
    /// daemon, no heartbeat), with cluster key `key` and capacity
    /// `capacity`: for tests and benchmarks of the fleet's queries.
    pub async fn probe(
        &self,
        node: &str,
        key: &[u8],
        capacity: u32,
    ) -> Result<std::sync::Arc<crate::Cluster>, crate::JoinError> {
        let options = crate::Options {
            url: self.url(),
            password: Some(self.password.clone()),
            node: node.into(),
            advertise: "127.0.0.1:9".into(),
            client_advertise: None,
            key: key.to_vec(),
            heartbeat: std::time::Duration::from_secs(2),
            suspect_after: std::time::Duration::from_secs(10),
            gone_after: std::time::Duration::from_secs(60),
        };
        let facts = crate::Facts {
            version: "probe".into(),
            lane: "probe".into(),
            capacity,
        };
        crate::Cluster::join(options, facts).await
    }

    /// Initialises and starts a server; about a second.
    pub fn start() -> PgServer {
        let dir = tempfile::Builder::new()
            .prefix("runbox-pg-")
            .tempdir_in("/tmp")
            .expect("PostgreSQL dir");
        let uid = pg_id("-u");
        let gid = pg_id("-g");
        std::os::unix::fs::chown(dir.path(), Some(uid), Some(gid)).expect("chown");
        let password = format!(
            "pw-{}-{}",
            std::process::id(),
            dir.path().display().to_string().len()
        );
        let pwfile = dir.path().join("pw");
        std::fs::write(&pwfile, &password).expect("password file");
        std::os::unix::fs::chown(&pwfile, Some(uid), Some(gid)).expect("chown");
        let bin = pg_bin();
        let out = Command::new("runuser")
            .args(["-u", "postgres", "--"])
            .arg(bin.join("initdb"))
            .arg("-D")
            .arg(dir.path().join("data"))
            .args([
                "-U",
                "runbox",
                "-A",
                "scram-sha-256",
                "--no-sync",
                "--no-instructions",
            ])
            .arg(format!("--pwfile={}", pwfile.display()))
            .output()
            .expect("running initdb");
        assert!(
            out.status.success(),
            "initdb failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let port = {
            let l = std::net::TcpListener::bind("127.0.0.1:0").expect("probe port");
            l.local_addr().expect("probe address").port()
        };
        let server = PgServer {
            port,
            password,
            dir,
            bin,
        };
        server.start_again();
        server
    }

    /// `postgres://runbox@127.0.0.1:<port>/postgres` (no password).
    pub fn url(&self) -> String {
        format!("postgres://runbox@127.0.0.1:{}/postgres", self.port)
    }

    fn pg_ctl(&self, args: &[&str]) -> std::process::Output {
        Command::new("runuser")
            .args(["-u", "postgres", "--"])
            .arg(self.bin.join("pg_ctl"))
            .arg("-D")
            .arg(self.dir.path().join("data"))
            .args(args)
            .output()
            .expect("running pg_ctl")
    }

    /// Starts the server (again) and waits until it takes connections.
    pub fn start_again(&self) {
        let options = format!(
            "-p {} -k {} -c listen_addresses=127.0.0.1 -c fsync=off -c full_page_writes=off",
            self.port,
            self.dir.path().display()
        );
        let log = self.dir.path().join("server.log");
        let out = self.pg_ctl(&[
            "-w",
            "-t",
            "60",
            "-o",
            &options,
            "-l",
            &log.to_string_lossy(),
            "start",
        ]);
        assert!(
            out.status.success(),
            "pg_ctl start failed: {}{}",
            String::from_utf8_lossy(&out.stderr),
            std::fs::read_to_string(&log).unwrap_or_default()
        );
    }

    /// Stops the server at once (connections are cut), as an outage would.
    pub fn stop(&self) {
        let out = self.pg_ctl(&["-w", "-m", "immediate", "stop"]);
        assert!(
            out.status.success(),
            "pg_ctl stop failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }

    /// Runs `sql` with psql; its output, unaligned, tuples only.
    pub fn psql(&self, sql: &str) -> String {
        let out = Command::new("runuser")
            .args(["-u", "postgres", "--"])
            .arg(self.bin.join("psql"))
            .args([
                "-h",
                "127.0.0.1",
                "-p",
                &self.port.to_string(),
                "-U",
                "runbox",
            ])
            .args(["-d", "postgres", "-At", "-c", sql])
            .env("PGPASSWORD", &self.password)
            .output()
            .expect("running psql");
        assert!(
            out.status.success(),
            "psql {sql:?} failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).trim().to_owned()
    }
}

/// The `postgres` user's uid (`-u`) or gid (`-g`).
fn pg_id(which: &str) -> u32 {
    let out = Command::new("id")
        .arg(which)
        .arg("postgres")
        .output()
        .expect("running id");
    String::from_utf8_lossy(&out.stdout)
        .trim()
        .parse()
        .expect("the postgres user exists (the postgresql package makes it)")
}

impl Drop for PgServer {
    fn drop(&mut self) {
        let _ = self.pg_ctl(&["-w", "-m", "immediate", "stop"]);
    }
}
