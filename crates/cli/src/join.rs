//! `runbox serve --cluster-db ...`: the flags that make a node of a fleet,
//! checked, into what `runbox_fleet` joins with.

use std::time::Duration;

use anyhow::{bail, Context};

use crate::serve::ServeArgs;

/// The shortest cluster key taken, in bytes.
const MIN_KEY: usize = 32;

/// The fleet options of `args`, or None when it names no cluster database.
pub fn options(args: &ServeArgs) -> anyhow::Result<Option<runbox_fleet::Options>> {
    let Some(url) = args.cluster_db.clone() else {
        return Ok(None);
    };
    let (Some(node), Some(advertise)) = (args.node_id.clone(), args.advertise.clone()) else {
        bail!("--cluster-db needs --node-id and --advertise");
    };
    check_node_id(&node)?;
    if let Some(cell) = &args.cell {
        check_node_id(cell).map_err(|_| {
            anyhow::anyhow!(
                "--cell {cell:?}: use 1-32 of a-z, 0-9 and -, starting with a letter or a digit"
            )
        })?;
    }
    check_advertise(&advertise)?;
    if let Some(origin) = &args.client_advertise {
        check_origin(origin)?;
    }
    let password = match &args.cluster_db_password_file {
        Some(path) => Some(read_secret(path).context("--cluster-db-password-file")?),
        None => std::env::var("RUNBOX_CLUSTER_DB_PASSWORD").ok(),
    };
    let key = match &args.cluster_key_file {
        Some(path) => read_secret(path).context("--cluster-key-file")?,
        None => std::env::var("RUNBOX_CLUSTER_KEY").map_err(|_| {
            anyhow::anyhow!(
                "--cluster-db needs the cluster key, the same on every node: set RUNBOX_CLUSTER_KEY \
                 or give --cluster-key-file (at least {MIN_KEY} bytes; `openssl rand -hex 32` makes one)"
            )
        })?,
    };
    if key.len() < MIN_KEY {
        bail!(
            "the cluster key is {} bytes; it must be at least {MIN_KEY} (`openssl rand -hex 32` makes one)",
            key.len()
        );
    }
    if args.cluster_suspect_sec == 0 || args.cluster_gone_sec <= args.cluster_suspect_sec {
        bail!(
            "--cluster-suspect-sec ({}) must be at least 1 and below --cluster-gone-sec ({})",
            args.cluster_suspect_sec,
            args.cluster_gone_sec
        );
    }
    let suspect_after = Duration::from_secs(args.cluster_suspect_sec);
    Ok(Some(runbox_fleet::Options {
        url,
        password,
        node,
        advertise,
        client_advertise: args.client_advertise.clone(),
        key: key.into_bytes(),
        // Several beats within the suspect time, so one lost write does
        // not make a node suspect.
        heartbeat: (suspect_after / 4).clamp(Duration::from_millis(250), Duration::from_secs(2)),
        suspect_after,
        gone_after: Duration::from_secs(args.cluster_gone_sec),
    }))
}

/// A secret read from a file, without its trailing newline.
fn read_secret(path: &std::path::Path) -> anyhow::Result<String> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    Ok(text.trim_end_matches(['\n', '\r']).to_owned())
}

/// A node id: 1-32 of `a-z`, `0-9` and `-`, starting with a letter or a
/// digit (it names the node in answers, logs and host-wide names).
fn check_node_id(id: &str) -> anyhow::Result<()> {
    let mut chars = id.chars();
    let first_ok = chars
        .next()
        .is_some_and(|c| c.is_ascii_lowercase() || c.is_ascii_digit());
    let rest_ok = chars.all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-');
    if !first_ok || !rest_ok || id.len() > 32 {
        bail!("--node-id {id:?}: use 1-32 of a-z, 0-9 and -, starting with a letter or a digit");
    }
    Ok(())
}

/// `host:port`, the port a number above 0.
fn check_advertise(advertise: &str) -> anyhow::Result<()> {
    let bad = || {
        anyhow::anyhow!(
            "--advertise {advertise:?}: give host:port where the other nodes reach this one's API (10.0.0.5:8080, [fd00::5]:8080, node1.internal:8080)"
        )
    };
    if advertise.parse::<std::net::SocketAddr>().is_ok() {
        return Ok(());
    }
    let (host, port) = advertise.rsplit_once(':').ok_or_else(bad)?;
    let port: u16 = port.parse().map_err(|_| bad())?;
    let host_ok = !host.is_empty()
        && host.len() <= 253
        && host
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '.');
    if port == 0 || !host_ok {
        return Err(bad());
    }
    Ok(())
}

/// An http or https origin: a scheme and a host, no path.
fn check_origin(origin: &str) -> anyhow::Result<()> {
    let parsed = url::Url::parse(origin)
        .map_err(|e| anyhow::anyhow!("--client-advertise {origin:?}: {e}"))?;
    if !matches!(parsed.scheme(), "http" | "https")
        || parsed.host_str().is_none()
        || parsed.path() != "/"
        || parsed.query().is_some()
        || !parsed.username().is_empty()
    {
        bail!(
            "--client-advertise {origin:?}: give an origin such as https://node1.example.com (a scheme and a host, no path)"
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn node_ids_are_short_plain_names() {
        for good in ["1", "n1", "node-2", &"a".repeat(32)] {
            assert!(check_node_id(good).is_ok(), "{good}");
        }
        for bad in ["", "-n", "N1", "n_1", "n.1", "n 1", &"a".repeat(33), "é"] {
            assert!(check_node_id(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn advertise_is_host_and_port() {
        for good in [
            "10.0.0.5:8080",
            "[::1]:80",
            "node1.internal:8080",
            "localhost:1",
        ] {
            assert!(check_advertise(good).is_ok(), "{good}");
        }
        for bad in [
            "10.0.0.5",
            ":8080",
            "host:0",
            "host:99999",
            "ho st:80",
            "http://h:80",
        ] {
            assert!(check_advertise(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn a_client_origin_is_a_scheme_and_a_host() {
        assert!(check_origin("https://node1.example.com").is_ok());
        assert!(check_origin("http://127.0.0.1:8080").is_ok());
        for bad in [
            "ftp://h",
            "https://h/path",
            "https://u:p@h",
            "h:80",
            "https://h?x=1",
        ] {
            assert!(check_origin(bad).is_err(), "{bad:?}");
        }
    }
}
