//! `runbox lease`: take, extend and give up a run's writable lease.
//!
//! While a lease is active only its holder, presenting the generation the
//! grant returned, may exec or upload files (`--owner`/`--generation` on
//! `exec` and `cp`, or `RUNBOX_LEASE_OWNER`/`RUNBOX_LEASE_GENERATION`).

use std::process::ExitCode;

use clap::{Args, Subcommand};
use runbox_client::types::Lease;
use runbox_client::LeaseCredential;
use time::format_description::well_known::Rfc3339;

use crate::connect::ConnectOpts;

/// `runbox lease ...`.
#[derive(Debug, Subcommand)]
pub enum LeaseCommand {
    /// Take the run's writable lease (prints the generation to act under)
    Acquire(AcquireArgs),
    /// Extend a lease you hold
    Renew(HeldArgs),
    /// Give a lease up
    Release(HeldArgs),
}

/// `runbox lease acquire`.
#[derive(Debug, Args)]
pub struct AcquireArgs {
    /// The run's id
    pub id: String,
    /// Who takes the lease
    #[arg(long, env = "RUNBOX_LEASE_OWNER", value_name = "NAME")]
    pub owner: String,
    /// Lifetime in seconds unless renewed (1-86400) [default: 300]
    #[arg(long, value_name = "SECS")]
    pub ttl: Option<u64>,
    /// Print the lease as JSON
    #[arg(long)]
    pub json: bool,
    #[command(flatten)]
    pub conn: ConnectOpts,
}

/// `runbox lease renew` and `release`.
#[derive(Debug, Args)]
pub struct HeldArgs {
    /// The run's id
    pub id: String,
    /// The holder
    #[arg(long, env = "RUNBOX_LEASE_OWNER", value_name = "NAME")]
    pub owner: String,
    /// The generation `lease acquire` printed
    #[arg(long, env = "RUNBOX_LEASE_GENERATION", value_name = "N")]
    pub generation: u64,
    /// New lifetime in seconds from now (renew only) [default: 300]
    #[arg(long, value_name = "SECS")]
    pub ttl: Option<u64>,
    /// Print the lease as JSON (renew only)
    #[arg(long)]
    pub json: bool,
    #[command(flatten)]
    pub conn: ConnectOpts,
}

/// Runs a `runbox lease ...` subcommand.
pub async fn run(command: LeaseCommand) -> anyhow::Result<ExitCode> {
    match command {
        LeaseCommand::Acquire(args) => {
            let conn = args.conn.connect()?;
            let lease = conn.check(
                conn.client
                    .acquire_lease(&args.id, &args.owner, args.ttl)
                    .await,
            )?;
            print(&args.id, &lease, args.json)?;
            if !args.json {
                // What a shell needs to act under the lease from here on.
                println!(
                    "export RUNBOX_LEASE_OWNER={} RUNBOX_LEASE_GENERATION={}",
                    shell_quote(&lease.holder),
                    lease.generation
                );
            }
        }
        LeaseCommand::Renew(args) => {
            let conn = args.conn.connect()?;
            let credential = LeaseCredential {
                owner: args.owner,
                generation: args.generation,
            };
            let lease = conn.check(
                conn.client
                    .renew_lease(&args.id, &credential, args.ttl)
                    .await,
            )?;
            print(&args.id, &lease, args.json)?;
        }
        LeaseCommand::Release(args) => {
            if args.ttl.is_some() || args.json {
                anyhow::bail!("--ttl and --json apply to renew, not release");
            }
            let conn = args.conn.connect()?;
            let credential = LeaseCredential {
                owner: args.owner,
                generation: args.generation,
            };
            conn.check(conn.client.release_lease(&args.id, &credential).await)?;
            println!("released the lease on {}", args.id);
        }
    }
    Ok(ExitCode::SUCCESS)
}

fn print(id: &str, lease: &Lease, json: bool) -> anyhow::Result<()> {
    if json {
        println!("{}", serde_json::to_string_pretty(lease)?);
    } else {
        println!(
            "{id} leased to {} (generation {}) until {}",
            lease.holder,
            lease.generation,
            lease.expires_at.format(&Rfc3339)?
        );
    }
    Ok(())
}

/// Quotes `s` for a POSIX shell when it holds anything but safe characters.
fn shell_quote(s: &str) -> String {
    let safe = |c: char| c.is_ascii_alphanumeric() || "@%+=:,./-_".contains(c);
    if !s.is_empty() && s.chars().all(safe) {
        s.to_owned()
    } else {
        format!("'{}'", s.replace('\'', r"'\''"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn owners_are_quoted_for_the_shell_only_when_needed() {
        assert_eq!(shell_quote("alice@laptop"), "alice@laptop");
        assert_eq!(shell_quote("Alice Smith"), "'Alice Smith'");
        assert_eq!(shell_quote("o'neil"), r"'o'\''neil'");
        assert_eq!(shell_quote("$(rm -rf /)"), "'$(rm -rf /)'");
    }
}
