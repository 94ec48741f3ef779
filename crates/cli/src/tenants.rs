//! `runbox tenants`: the operator's tenants (root token only).

use std::process::ExitCode;

use clap::{Args, Subcommand};

use crate::connect::ConnectOpts;
use crate::runs::{parse_size, NetworkArg};
use crate::table;

/// `runbox tenants …`.
#[derive(Debug, Subcommand)]
pub enum TenantsCommand {
    /// Add a tenant and print its token (shown this once)
    Create(CreateArgs),
    /// List the tenants
    Ls(LsArgs),
    /// Show one tenant as JSON
    Show(NameArgs),
    /// Change a tenant's limits (the options given replace its own)
    Update(UpdateArgs),
    /// Give a tenant a new token and print it; the old one stops working
    Rotate(NameArgs),
    /// Remove tenants that have no runs
    Rm(RmArgs),
}

/// A tenant's limits, as options.
#[derive(Debug, Args)]
pub struct PolicyArgs {
    /// Live runs it may have at once (0: no limit of its own)
    #[arg(long, value_name = "N")]
    pub max_runs: Option<u32>,
    /// An image it may run: a name, or a prefix ending in '*' (repeatable;
    /// none: any)
    #[arg(long = "image", value_name = "RULE")]
    pub images: Vec<String>,
    /// A network tier it may use (repeatable; none: any)
    #[arg(long = "network", value_enum, value_name = "TIER")]
    pub networks: Vec<NetworkArg>,
    /// A size tier it may use (repeatable; none: any)
    #[arg(long = "size", value_name = "TIER", value_parser = parse_size)]
    pub sizes: Vec<runbox_types::SizeTier>,
    /// The operator's egress class its runs are bound to (one the server's
    /// config defines; "" unbinds on update)
    #[arg(long, value_name = "CLASS")]
    pub egress_class: Option<String>,
}

/// `runbox tenants create`.
#[derive(Debug, Args)]
pub struct CreateArgs {
    /// Its name: 1-32 of a-z, 0-9, '-' and '_', starting with a letter
    pub name: String,
    #[command(flatten)]
    pub policy: PolicyArgs,
    /// Print the tenant and token as JSON instead of the token
    #[arg(long)]
    pub json: bool,
    #[command(flatten)]
    pub conn: ConnectOpts,
}

/// `runbox tenants update`.
#[derive(Debug, Args)]
pub struct UpdateArgs {
    /// The tenant
    pub name: String,
    #[command(flatten)]
    pub policy: PolicyArgs,
    /// Allow any image again
    #[arg(long, conflicts_with = "images")]
    pub any_image: bool,
    /// Allow any network tier again
    #[arg(long, conflicts_with = "networks")]
    pub any_network: bool,
    /// Allow any size again
    #[arg(long, conflicts_with = "sizes")]
    pub any_size: bool,
    #[command(flatten)]
    pub conn: ConnectOpts,
}

/// `runbox tenants ls`.
#[derive(Debug, Args)]
pub struct LsArgs {
    /// Print the list as JSON
    #[arg(long)]
    pub json: bool,
    #[command(flatten)]
    pub conn: ConnectOpts,
}

/// One tenant by name.
#[derive(Debug, Args)]
pub struct NameArgs {
    /// The tenant
    pub name: String,
    /// Print JSON (for `rotate`: the tenant and token)
    #[arg(long)]
    pub json: bool,
    #[command(flatten)]
    pub conn: ConnectOpts,
}

/// `runbox tenants rm`.
#[derive(Debug, Args)]
pub struct RmArgs {
    /// The tenants
    #[arg(required = true)]
    pub names: Vec<String>,
    #[command(flatten)]
    pub conn: ConnectOpts,
}

fn networks(args: &[NetworkArg]) -> Vec<runbox_types::NetworkTier> {
    args.iter().map(|n| (*n).into()).collect()
}

/// `runbox tenants …`.
pub async fn run(command: TenantsCommand) -> anyhow::Result<ExitCode> {
    match command {
        TenantsCommand::Create(args) => {
            let conn = args.conn.connect()?;
            let req = runbox_types::CreateTenantRequest {
                name: args.name,
                max_runs: args.policy.max_runs.unwrap_or(0),
                images: args.policy.images,
                networks: networks(&args.policy.networks),
                sizes: args.policy.sizes,
                egress_class: args.policy.egress_class,
            };
            let made = conn.check(conn.client.create_tenant(&req).await)?;
            print_token(&made, args.json)?;
        }
        TenantsCommand::Ls(args) => {
            let conn = args.conn.connect()?;
            let list = conn.check(conn.client.list_tenants().await)?;
            if args.json {
                println!("{}", serde_json::to_string_pretty(&list)?);
            } else {
                print!("{}", render(&list.tenants));
            }
        }
        TenantsCommand::Show(args) => {
            let conn = args.conn.connect()?;
            let tenant = conn.check(conn.client.get_tenant(&args.name).await)?;
            println!("{}", serde_json::to_string_pretty(&tenant)?);
        }
        TenantsCommand::Update(args) => {
            let conn = args.conn.connect()?;
            let policy = args.policy;
            let list = |given: bool, any: bool| (given || any).then_some(());
            let req = runbox_types::UpdateTenantRequest {
                max_runs: policy.max_runs,
                images: list(!policy.images.is_empty(), args.any_image).map(|()| policy.images),
                networks: list(!policy.networks.is_empty(), args.any_network)
                    .map(|()| networks(&policy.networks)),
                sizes: list(!policy.sizes.is_empty(), args.any_size).map(|()| policy.sizes),
                egress_class: policy.egress_class,
            };
            let tenant = conn.check(conn.client.update_tenant(&args.name, &req).await)?;
            println!("{}", serde_json::to_string_pretty(&tenant)?);
        }
        TenantsCommand::Rotate(args) => {
            let conn = args.conn.connect()?;
            let rotated = conn.check(conn.client.rotate_tenant(&args.name).await)?;
            print_token(&rotated, args.json)?;
        }
        TenantsCommand::Rm(args) => {
            let conn = args.conn.connect()?;
            let mut failed = false;
            for name in &args.names {
                match conn.check(conn.client.delete_tenant(name).await) {
                    Ok(()) => println!("{name}"),
                    Err(err) => {
                        eprintln!("runbox: cannot remove tenant {name}: {err:#}");
                        failed = true;
                    }
                }
            }
            if failed {
                return Ok(ExitCode::FAILURE);
            }
        }
    }
    Ok(ExitCode::SUCCESS)
}

fn print_token(made: &runbox_types::TenantToken, json: bool) -> anyhow::Result<()> {
    if json {
        println!("{}", serde_json::to_string_pretty(made)?);
    } else {
        println!("{}", made.token);
        eprintln!(
            "runbox: this is tenant {:?}'s token; it is not shown again (runbox keeps only its hash)",
            made.tenant.name
        );
    }
    Ok(())
}

/// The tenant table.
fn render(tenants: &[runbox_types::Tenant]) -> String {
    let any = |list: Vec<String>| {
        if list.is_empty() {
            "any".to_owned()
        } else {
            list.join(",")
        }
    };
    let rows: Vec<Vec<String>> = tenants
        .iter()
        .map(|t| {
            let p = &t.policy;
            vec![
                t.name.clone(),
                match p.max_runs {
                    0 => format!("{}/-", t.runs),
                    max => format!("{}/{max}", t.runs),
                },
                any(p.images.clone()),
                any(p.networks.iter().map(|n| n.as_str().to_owned()).collect()),
                any(p.sizes.iter().map(|s| s.as_str().to_owned()).collect()),
                table::date(t.created_at),
            ]
        })
        .collect();
    table::render(
        &[
            "NAME",
            "RUNS",
            "IMAGES",
            "NETWORKS",
            "SIZES",
            "CREATED (UTC)",
        ],
        &rows,
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_table_shows_limits_and_any() {
        let tenant = runbox_types::Tenant {
            name: "acme".into(),
            policy: runbox_types::TenantPolicy {
                max_runs: 5,
                images: vec!["python:*".into()],
                networks: vec![],
                sizes: vec![runbox_types::SizeTier::Small],
                egress_class: None,
            },
            runs: 2,
            created_at: time::OffsetDateTime::UNIX_EPOCH,
            updated_at: time::OffsetDateTime::UNIX_EPOCH,
        };
        let out = render(&[tenant]);
        let row = out.lines().nth(1).unwrap();
        assert!(row.starts_with("acme"), "{out}");
        for part in ["2/5", "python:*", "any", "small"] {
            assert!(row.contains(part), "{part} in {out}");
        }
    }
}

/// `runbox usage`.
#[derive(Debug, Args)]
pub struct UsageArgs {
    /// Only this tenant ("" for the operator's own runs); a tenant's token
    /// sees its own whatever this says
    #[arg(long)]
    pub tenant: Option<String>,
    /// From when: an RFC 3339 time, or a span back from now (90m, 24h, 7d)
    #[arg(long, value_name = "TIME|SPAN")]
    pub since: Option<String>,
    /// Print the report as JSON
    #[arg(long)]
    pub json: bool,
    #[command(flatten)]
    pub conn: ConnectOpts,
}

/// `runbox audit`.
#[derive(Debug, Args)]
pub struct AuditArgs {
    /// Only this run's records
    #[arg(long, value_name = "ID")]
    pub run: Option<String>,
    /// Only this tenant's: its calls, calls on its runs, what its runs did
    #[arg(long)]
    pub tenant: Option<String>,
    /// From when: an RFC 3339 time, or a span back from now (90m, 24h, 7d)
    #[arg(long, value_name = "TIME|SPAN")]
    pub since: Option<String>,
    /// The latest this many records (default 1000)
    #[arg(long, value_name = "N")]
    pub limit: Option<usize>,
    /// Print each record as the JSON line the log holds
    #[arg(long)]
    pub json: bool,
    #[command(flatten)]
    pub conn: ConnectOpts,
}

/// `runbox audit`: one line per record, oldest first.
pub async fn audit(args: AuditArgs) -> anyhow::Result<ExitCode> {
    let conn = args.conn.connect()?;
    let records = conn.check(
        conn.client
            .audit(
                args.run.as_deref(),
                args.tenant.as_deref(),
                args.since.as_deref(),
                args.limit,
            )
            .await,
    )?;
    if args.json {
        for record in &records {
            println!("{}", serde_json::to_string(record)?);
        }
    } else {
        print!("{}", render_audit(&records));
    }
    Ok(ExitCode::SUCCESS)
}

/// The audit table: when, which run, who asked, what was done.
fn render_audit(records: &[serde_json::Value]) -> String {
    let text = |v: &serde_json::Value, key: &str| v[key].as_str().unwrap_or("").to_owned();
    let rows: Vec<Vec<String>> = records
        .iter()
        .map(|r| {
            let who = match (text(r, "caller"), text(r, "kind").as_str()) {
                (caller, _) if !caller.is_empty() => caller,
                (_, "egress") | (_, "preview") => "(the run)".to_owned(),
                _ => "-".to_owned(),
            };
            vec![
                text(r, "t"),
                Some(text(r, "run"))
                    .filter(|s| !s.is_empty())
                    .unwrap_or_else(|| "-".into()),
                who,
                describe_record(r),
            ]
        })
        .collect();
    crate::table::render(&["TIME", "RUN", "WHO", "WHAT"], &rows)
}

/// One record in a few words.
fn describe_record(r: &serde_json::Value) -> String {
    let text = |v: &serde_json::Value, key: &str| v[key].as_str().unwrap_or("").to_owned();
    let action = |a: &serde_json::Value| match a["what"].as_str().unwrap_or("") {
        "command" => {
            let argv: Vec<String> = a["argv"]
                .as_array()
                .map(|v| {
                    v.iter()
                        .filter_map(|s| s.as_str())
                        .map(str::to_owned)
                        .collect()
                })
                .unwrap_or_default();
            let mut out = format!("{} {}", text(a, "mode"), argv.join(" "));
            if let Some(user) = a["user"].as_str() {
                out.push_str(&format!(" (user {user})"));
            }
            if let Some(cwd) = a["cwd"].as_str() {
                out.push_str(&format!(" (cwd {cwd})"));
            }
            out
        }
        "write" => format!("write {}", text(a, "path")),
        "remove" => format!("remove {}", text(a, "path")),
        "move" => format!("move {} -> {}", text(a, "from"), text(a, "to")),
        "makeDir" => format!("mkdir {}", text(a, "path")),
        "create" => format!("create from {} ({})", text(a, "image"), text(a, "network")),
        "egress" => format!("egress change {a}"),
        other => other.to_owned(),
    };
    match text(r, "kind").as_str() {
        "api" => {
            let mut out = format!("{} {} {}", text(r, "method"), text(r, "path"), r["status"]);
            if r["action"].is_object() {
                out.push_str(": ");
                out.push_str(&action(&r["action"]));
            }
            out
        }
        "session" => action(&r["action"]),
        "egress" => format!(
            "{} {}:{} {} ({})",
            text(r, "method"),
            text(r, "host"),
            r["port"],
            text(r, "decision"),
            text(r, "rule")
        ),
        "preview" => format!(
            "preview :{} {} {} {}",
            r["port"],
            text(r, "method"),
            text(r, "path"),
            r["status"]
        ),
        "tenants" => format!("tenant {} {}", text(r, "change"), text(r, "tenant")),
        "lifecycle" => format!("run {}", text(r, "transition")),
        "configReload" => "config reload".to_owned(),
        other => other.to_owned(),
    }
}

/// `runbox usage`: one line per tenant.
pub async fn usage(args: UsageArgs) -> anyhow::Result<ExitCode> {
    let conn = args.conn.connect()?;
    let report = conn.check(
        conn.client
            .usage(args.since.as_deref(), args.tenant.as_deref())
            .await,
    )?;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        print!("{}", render_usage(&report));
        // A fleet's report sums the nodes that answered: say which.
        if !report.nodes.is_empty() {
            eprintln!("summed over nodes: {}", report.nodes.join(", "));
        }
    }
    Ok(ExitCode::SUCCESS)
}

/// The usage table: run-hours by size, CPU-seconds, peak memory, egress.
fn render_usage(report: &runbox_types::UsageReport) -> String {
    let rows: Vec<Vec<String>> = report
        .tenants
        .iter()
        .map(|(tenant, t)| {
            let hours: Vec<String> = t
                .run_seconds
                .iter()
                .map(|(size, secs)| format!("{size} {:.2}h", secs / 3600.0))
                .collect();
            vec![
                if tenant.is_empty() {
                    "(operator)".to_owned()
                } else {
                    tenant.clone()
                },
                if hours.is_empty() {
                    "-".to_owned()
                } else {
                    hours.join(", ")
                },
                format!("{:.1}", t.cpu_seconds),
                table::size(t.peak_memory_bytes),
                table::size(t.egress_bytes),
                t.events.values().sum::<u64>().to_string(),
            ]
        })
        .collect();
    table::render(
        &[
            "TENANT",
            "RUN-HOURS",
            "CPU-SEC",
            "PEAK MEM",
            "EGRESS",
            "EVENTS",
        ],
        &rows,
    )
}

#[cfg(test)]
mod usage_tests {
    use super::*;

    #[test]
    fn the_usage_table_sums_per_tenant() {
        let mut totals = runbox_types::UsageTotals::default();
        totals.run_seconds.insert("small".into(), 5400.0);
        totals.cpu_seconds = 12.25;
        totals.events.insert("create".into(), 3);
        totals.events.insert("delete".into(), 2);
        let report = runbox_types::UsageReport {
            since: None,
            until: time::OffsetDateTime::UNIX_EPOCH,
            tenants: [("".to_owned(), totals.clone()), ("acme".to_owned(), totals)].into(),
            nodes: Vec::new(),
        };
        let out = render_usage(&report);
        let lines: Vec<&str> = out.lines().collect();
        assert_eq!(lines.len(), 3, "{out}");
        assert!(lines[1].starts_with("(operator)"), "{out}");
        assert!(lines[2].starts_with("acme"), "{out}");
        for part in ["small 1.50h", "12.2", "5"] {
            assert!(lines[2].contains(part), "{part} in {out}");
        }
    }
}
