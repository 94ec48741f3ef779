//! `runbox preview` (a signed URL for a port inside a run) and
//! `runbox port-forward` (a local port that reaches a port inside a run,
//! one tunnelled API connection per accepted connection).

use std::net::SocketAddr;
use std::process::ExitCode;

use anyhow::Context as _;
use clap::Args;
use runbox_client::LeaseCredential;

use crate::args::LeaseOpts;
use crate::connect::ConnectOpts;

/// `runbox preview`.
#[derive(Debug, Args)]
pub struct PreviewArgs {
    /// The run's id
    pub id: String,
    /// The port inside the run
    pub port: u16,
    /// How long the URL works, in seconds [default: 3600]
    #[arg(long, value_name = "SECS")]
    pub ttl: Option<u64>,
    /// Print the answer as JSON
    #[arg(long)]
    pub json: bool,
    #[command(flatten)]
    pub conn: ConnectOpts,
}

/// `runbox port-forward`.
#[derive(Debug, Args)]
pub struct PortForwardArgs {
    /// The run's id
    pub id: String,
    /// `LOCAL:GUEST`, `ADDR:LOCAL:GUEST` (ADDR defaults to 127.0.0.1), or
    /// `GUEST` alone for the same port locally; LOCAL 0 takes a free port
    #[arg(value_name = "[ADDR:]LOCAL:GUEST")]
    pub ports: String,
    #[command(flatten)]
    pub lease: LeaseOpts,
    #[command(flatten)]
    pub conn: ConnectOpts,
}

/// Runs `runbox preview`.
pub async fn preview(args: PreviewArgs) -> anyhow::Result<ExitCode> {
    let conn = args.conn.connect()?;
    let preview = conn
        .client
        .mint_preview(&args.id, args.port, args.ttl)
        .await
        .map_err(|e| conn.explain(e))?;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&preview)?);
    } else {
        println!("{}", preview.url);
    }
    Ok(ExitCode::SUCCESS)
}

/// Parses `[ADDR:]LOCAL:GUEST` (or `GUEST`).
fn parse_ports(spec: &str) -> anyhow::Result<(SocketAddr, u16)> {
    let port = |s: &str, zero_ok: bool| -> anyhow::Result<u16> {
        s.parse::<u16>()
            .ok()
            .filter(|&p| p != 0 || zero_ok)
            .with_context(|| format!("{s:?} is not a port (1-65535)"))
    };
    let parts: Vec<&str> = spec.rsplitn(3, ':').collect();
    let (addr, local, guest) = match parts.as_slice() {
        [guest] => ("127.0.0.1", *guest, *guest),
        [guest, local] => ("127.0.0.1", *local, *guest),
        [guest, local, addr] => (addr.trim_matches(['[', ']']), *local, *guest),
        _ => anyhow::bail!("give [ADDR:]LOCAL:GUEST, for example 8080:80"),
    };
    let ip: std::net::IpAddr = addr
        .parse()
        .with_context(|| format!("{addr:?} is not an IP address"))?;
    // A local port of 0 takes any free one (the address is printed).
    Ok((SocketAddr::new(ip, port(local, true)?), port(guest, false)?))
}

/// Runs `runbox port-forward` until Ctrl-C.
pub async fn port_forward(args: PortForwardArgs) -> anyhow::Result<ExitCode> {
    let (local, guest) = parse_ports(&args.ports)?;
    let conn = args.conn.connect()?;
    // Fail now when the run is wrong. The port itself is not tried: a
    // server that takes one connection would spend it on the probe.
    conn.client
        .get_run(&args.id)
        .await
        .map_err(|e| conn.explain(e))?;
    let listener = tokio::net::TcpListener::bind(local)
        .await
        .with_context(|| format!("listening on {local}"))?;
    eprintln!(
        "forwarding {} -> run {} port {guest}; Ctrl-C to stop",
        listener.local_addr()?,
        args.id
    );
    let client = conn.client.clone();
    let id = args.id.clone();
    let credential = lease(&args.lease);
    loop {
        let (mut socket, peer) = tokio::select! {
            accepted = listener.accept() => accepted.context("accepting a connection")?,
            _ = tokio::signal::ctrl_c() => return Ok(ExitCode::SUCCESS),
        };
        let _ = socket.set_nodelay(true);
        let client = client.clone();
        let id = id.clone();
        let credential = credential.clone();
        tokio::spawn(async move {
            match client.connect_port(&id, guest, credential.as_ref()).await {
                Ok(mut tunnel) => {
                    // Large buffers: the default 8 KiB holds a forward to a
                    // fraction of what loopback carries.
                    let _ = tokio::io::copy_bidirectional_with_sizes(
                        &mut socket,
                        &mut tunnel,
                        256 * 1024,
                        256 * 1024,
                    )
                    .await;
                }
                Err(e) => eprintln!("runbox: connection from {peer}: {e}"),
            }
        });
    }
}

fn lease(opts: &LeaseOpts) -> Option<LeaseCredential> {
    opts.owner
        .clone()
        .zip(opts.generation)
        .map(|(owner, generation)| LeaseCredential { owner, generation })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn port_specs_parse() {
        assert_eq!(
            parse_ports("8080:80").unwrap(),
            ("127.0.0.1:8080".parse().unwrap(), 80)
        );
        assert_eq!(
            parse_ports("3000").unwrap(),
            ("127.0.0.1:3000".parse().unwrap(), 3000)
        );
        assert_eq!(
            parse_ports("0.0.0.0:9000:90").unwrap(),
            ("0.0.0.0:9000".parse().unwrap(), 90)
        );
        assert_eq!(
            parse_ports("[::1]:9000:90").unwrap(),
            ("[::1]:9000".parse().unwrap(), 90)
        );
        assert_eq!(parse_ports("0:80").unwrap().0.port(), 0);
        for bad in ["", "0", "80:0", "x:80", "80:70000", "host:1:2", "1:2:3:4"] {
            assert!(parse_ports(bad).is_err(), "{bad}");
        }
    }
}
