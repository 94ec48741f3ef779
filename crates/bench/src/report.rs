//! The benchmark's results and how they are printed: a Markdown table per
//! phase on stdout, and optionally one JSON document with every sample
//! (`--json FILE`).
//!
//! Owns the layout and the ratios: in the exec and create phases, every
//! row's median divided by the median of each raw runtime's own row in the
//! same phase; in the image and egress tables, a row's median divided by
//! (and, in latency tables, less) the median of the one row it is compared
//! with, and throughput (MB/s, 10^6 bytes per second) at the median. It does
//! not measure.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::time::Duration;

use serde::Serialize;

use crate::stats::{summarize, Summary};

/// What a row stands for, which decides how it is read.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    /// A runbox path, end to end.
    Runbox,
    /// A raw OCI runtime: the baseline the ratios divide by.
    Baseline,
    /// A reference point that is not an OCI runtime (bubblewrap).
    Reference,
    /// One step of a runbox row, timed separately.
    Part,
}

/// One series of samples, before it is summarised.
#[derive(Debug)]
pub struct Series {
    /// What was timed, as shown in the table.
    pub label: String,
    /// How to read it.
    pub role: Role,
    /// The OCI runtime involved, if any.
    pub runtime: Option<String>,
    /// The samples (warm-up excluded).
    pub samples: Vec<Duration>,
}

/// One summarised row.
#[derive(Debug, Serialize)]
pub struct Row {
    /// What was timed.
    pub label: String,
    /// How to read it.
    pub role: Role,
    /// The OCI runtime involved, if any.
    pub runtime: Option<String>,
    /// The figures.
    #[serde(flatten)]
    pub summary: Summary,
    /// This row's median divided by each baseline runtime's median.
    pub p50_ratio: BTreeMap<String, f64>,
    /// Every sample in milliseconds, in the order taken.
    pub samples_ms: Vec<f64>,
}

/// The results of one phase.
#[derive(Debug, Serialize)]
pub struct Phase {
    /// Short name (`exec`, `create`).
    pub name: String,
    /// Heading.
    pub title: String,
    /// What the phase times, one paragraph.
    pub description: String,
    /// Warm-up iterations per case, not counted.
    pub warmup: usize,
    /// Measured iterations per case.
    pub iterations: usize,
    /// The rows, runbox first.
    pub rows: Vec<Row>,
}

impl Phase {
    /// Summarises `series` and computes the ratios against the baselines.
    pub fn new(
        name: &str,
        title: &str,
        description: &str,
        warmup: usize,
        iterations: usize,
        series: Vec<Series>,
    ) -> Phase {
        let baselines: Vec<(String, f64)> = series
            .iter()
            .filter(|s| s.role == Role::Baseline)
            .filter_map(|s| Some((s.runtime.clone()?, summarize(&s.samples)?.p50_ms)))
            .collect();
        let rows = series
            .into_iter()
            .filter_map(|s| {
                let summary = summarize(&s.samples)?;
                let p50_ratio = baselines
                    .iter()
                    .filter(|(_, p50)| *p50 > 0.0)
                    .map(|(rt, p50)| (rt.clone(), summary.p50_ms / p50))
                    .collect();
                Some(Row {
                    samples_ms: s.samples.iter().map(|d| d.as_secs_f64() * 1e3).collect(),
                    label: s.label,
                    role: s.role,
                    runtime: s.runtime,
                    summary,
                    p50_ratio,
                })
            })
            .collect();
        Phase {
            name: name.to_owned(),
            title: title.to_owned(),
            description: description.to_owned(),
            warmup,
            iterations,
            rows,
        }
    }
}

/// The host the numbers come from.
#[derive(Debug, Serialize)]
pub struct Host {
    /// CPU model.
    pub cpu: String,
    /// CPUs this process may use.
    pub cpus: usize,
    /// Kernel release.
    pub kernel: String,
    /// Distribution.
    pub os: String,
    /// cgroup layout (v1, v1 hybrid, v2).
    pub cgroups: String,
    /// `tool → first line of tool --version`.
    pub tools: BTreeMap<String, String>,
}

/// Everything one invocation measured.
#[derive(Debug, Serialize)]
pub struct Report {
    /// The host.
    pub host: Host,
    /// The exec and create phases, in the order they ran.
    pub phases: Vec<Phase>,
    /// The images phase, when it ran.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub images: Option<ImageReport>,
    /// The egress phase, when it ran.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub egress: Option<EgressReport>,
    /// The snapshots phase, when it ran.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub snapshots: Option<crate::snapshots::SnapshotReport>,
    /// The pools phase, when it ran.
    pub pools: Option<crate::pools::PoolReport>,
    /// The interactive phase, when it ran.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub interactive: Option<crate::interactive::InteractiveReport>,
    /// The checkpoints phase, when it ran.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub checkpoints: Option<crate::checkpoints::CheckpointReport>,
    /// The sleep phase, when it ran.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub sleep: Option<crate::sleep::SleepReport>,
    /// The tenants phase, when it ran.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tenants: Option<crate::tenants::TenantsReport>,
    /// The fleet phase, when it ran.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub fleet: Option<crate::fleet::FleetReport>,
    /// The moves phase, when it ran.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub moves: Option<crate::moves::MovesReport>,
    /// The userns phase, when it ran.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub userns: Option<crate::userns::UsernsReport>,
    /// The volumes phase, when it ran.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub volumes: Option<crate::volumes::VolumesReport>,
}

/// What the images phase's generated layer holds.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct LayerShape {
    /// Files of 15 % of the data each.
    pub large_files: u64,
    /// Files of 64 KiB to 1 MiB.
    pub medium_files: u64,
    /// Files of 0 to 8 KiB.
    pub small_files: u64,
    /// Directories.
    pub dirs: u64,
    /// Bytes of file data: what the MB/s figures count.
    pub file_bytes: u64,
    /// Size of the uncompressed tarball.
    pub plain_bytes: u64,
    /// Size of the gzip blob.
    pub gzip_bytes: u64,
}

/// The images phase: the layer it generated and its tables.
#[derive(Debug, Serialize)]
pub struct ImageReport {
    /// The generated layer.
    pub layer: LayerShape,
    /// Unpack throughput, start cost, pulls; those that ran.
    pub tables: Vec<Table>,
}

/// The egress phase's results.
#[derive(Debug, Serialize)]
pub struct EgressReport {
    /// Worker threads of the proxy's runtime.
    pub proxy_workers: usize,
    /// Per table, the DNS queries the proxy sent while it ran (warm-up
    /// included).
    pub dns_queries: Vec<(String, u64)>,
    /// Throughput, HTTP latency, HTTPS latency.
    pub tables: Vec<Table>,
}

/// One row of an image or egress table, before it is summarised.
#[derive(Debug)]
pub struct TableSeries {
    /// The samples and what they are.
    pub series: Series,
    /// Bytes of file data each sample handled, for a MB/s figure.
    pub bytes: Option<u64>,
    /// The row (an index into the same table) whose median this row's
    /// median is divided by.
    pub versus: Option<usize>,
}

/// One summarised row of an image or egress table.
#[derive(Debug, Serialize)]
pub struct TableRow {
    /// What was timed.
    pub label: String,
    /// How to read it.
    pub role: Role,
    /// The figures.
    #[serde(flatten)]
    pub summary: Summary,
    /// Bytes of file data each sample handled.
    pub bytes: Option<u64>,
    /// `bytes` divided by the median time, in 10^6 bytes per second.
    pub mb_per_s_p50: Option<f64>,
    /// The row this one is compared with.
    pub versus: Option<String>,
    /// This row's median divided by that row's.
    pub p50_ratio: Option<f64>,
    /// This row's median minus that row's, in milliseconds.
    pub p50_added_ms: Option<f64>,
    /// Every sample in milliseconds, in the order taken.
    pub samples_ms: Vec<f64>,
}

/// One image or egress table.
#[derive(Debug, Serialize)]
pub struct Table {
    /// Short name (`unpack`, `start`, `pull`, `egress-throughput`, ...).
    pub name: String,
    /// Heading.
    pub title: String,
    /// What the table times, one paragraph.
    pub description: String,
    /// Warm-up iterations per case, not counted.
    pub warmup: usize,
    /// Measured iterations per case.
    pub iterations: usize,
    /// The rows, in the order given.
    pub rows: Vec<TableRow>,
    /// Whether the Markdown shows each row's median minus the median of the
    /// row it is compared with (latency tables).
    #[serde(skip)]
    pub added_column: bool,
}

impl Table {
    /// Summarises `rows`, computing throughput and ratios. A row without
    /// samples is left out (and so is any ratio to it).
    pub fn new(
        name: &str,
        title: &str,
        description: &str,
        warmup: usize,
        iterations: usize,
        rows: Vec<TableSeries>,
    ) -> Table {
        let summaries: Vec<Option<Summary>> =
            rows.iter().map(|r| summarize(&r.series.samples)).collect();
        let labels: Vec<String> = rows.iter().map(|r| r.series.label.clone()).collect();
        let rows = rows
            .into_iter()
            .enumerate()
            .filter_map(|(i, row)| {
                let summary = summaries[i]?;
                let reference = row
                    .versus
                    .and_then(|v| Some((labels.get(v)?.clone(), (*summaries.get(v)?)?)));
                let p50_ratio = reference
                    .as_ref()
                    .filter(|(_, s)| s.p50_ms > 0.0)
                    .map(|(_, s)| summary.p50_ms / s.p50_ms);
                let p50_added_ms = reference.as_ref().map(|(_, s)| summary.p50_ms - s.p50_ms);
                Some(TableRow {
                    mb_per_s_p50: row
                        .bytes
                        .filter(|_| summary.p50_ms > 0.0)
                        .map(|b| b as f64 / 1e6 / (summary.p50_ms / 1e3)),
                    bytes: row.bytes,
                    samples_ms: row
                        .series
                        .samples
                        .iter()
                        .map(|d| d.as_secs_f64() * 1e3)
                        .collect(),
                    label: row.series.label,
                    role: row.series.role,
                    summary,
                    versus: reference.map(|(label, _)| label),
                    p50_ratio,
                    p50_added_ms,
                })
            })
            .collect();
        Table {
            name: name.to_owned(),
            title: title.to_owned(),
            description: description.to_owned(),
            warmup,
            iterations,
            rows,
            added_column: false,
        }
    }

    /// The same table, showing each row's median minus the median of the
    /// row it is compared with.
    pub fn with_added_column(mut self) -> Table {
        self.added_column = true;
        self
    }
}

/// The report as Markdown: a host line, then one table per phase.
pub fn markdown(report: &Report) -> String {
    let mut out = String::new();
    let h = &report.host;
    let _ = writeln!(out, "# runbox-bench\n");
    let _ = writeln!(
        out,
        "Host: {}, {} CPUs, Linux {}, {}, cgroup {}.",
        h.cpu, h.cpus, h.kernel, h.os, h.cgroups
    );
    let tools: Vec<String> = h.tools.iter().map(|(k, v)| format!("{k}: `{v}`")).collect();
    if !tools.is_empty() {
        let _ = writeln!(out, "Tools: {}.", tools.join("; "));
    }
    for phase in &report.phases {
        let _ = writeln!(out, "\n## {}\n", phase.title);
        let _ = writeln!(
            out,
            "{} {} measured iterations per case, after {} warm-up iterations; cases interleaved.\n",
            phase.description, phase.iterations, phase.warmup
        );
        let baselines: Vec<(String, String)> = phase
            .rows
            .iter()
            .filter(|r| r.role == Role::Baseline)
            .filter_map(|r| Some((r.runtime.clone()?, r.label.clone())))
            .collect();
        let mut header = String::from("| case | n | p50 ms | p95 ms | mean ms |");
        let mut rule = String::from("|---|--:|--:|--:|--:|");
        for (_, label) in &baselines {
            let _ = write!(header, " p50 ÷ {label} |");
            rule.push_str("--:|");
        }
        let _ = writeln!(out, "{header}\n{rule}");
        for row in &phase.rows {
            let s = &row.summary;
            let label = match row.role {
                Role::Part => format!("&nbsp;&nbsp;↳ {}", row.label),
                _ => row.label.clone(),
            };
            let _ = write!(
                out,
                "| {label} | {} | {:.2} | {:.2} | {:.2} |",
                s.n, s.p50_ms, s.p95_ms, s.mean_ms
            );
            for (rt, _) in &baselines {
                match row.p50_ratio.get(rt) {
                    Some(ratio) => {
                        let _ = write!(out, " {ratio:.2}× |");
                    }
                    None => out.push_str(" – |"),
                }
            }
            out.push('\n');
        }
    }
    if let Some(images) = &report.images {
        images_markdown(&mut out, images);
    }
    if let Some(egress) = &report.egress {
        egress_markdown(&mut out, egress, h.cpus);
    }
    if let Some(interactive) = &report.interactive {
        out.push_str(&crate::interactive::markdown(interactive));
    }
    if let Some(pools) = &report.pools {
        out.push_str(&crate::pools::markdown(pools));
    }
    if let Some(sleep) = &report.sleep {
        out.push_str(&crate::sleep::markdown(sleep));
    }
    if let Some(snapshots) = &report.snapshots {
        out.push_str(&crate::snapshots::markdown(snapshots));
    }
    if let Some(tenants) = &report.tenants {
        out.push_str(&crate::tenants::markdown(tenants));
    }
    if let Some(fleet) = &report.fleet {
        out.push_str(&crate::fleet::markdown(fleet));
    }
    if let Some(moves) = &report.moves {
        out.push_str(&crate::moves::markdown(moves));
    }
    if let Some(userns) = &report.userns {
        out.push_str(&crate::userns::markdown(userns));
    }
    if let Some(volumes) = &report.volumes {
        out.push_str(&crate::volumes::markdown(volumes));
    }
    if let Some(checkpoints) = &report.checkpoints {
        out.push_str(&crate::checkpoints::markdown(checkpoints));
    }
    out
}

/// The images phase as Markdown: the layer, then one table per part.
fn images_markdown(out: &mut String, images: &ImageReport) {
    let l = &images.layer;
    let mb = |b: u64| b as f64 / 1e6;
    let _ = writeln!(
        out,
        "\n## Images\n\nGenerated layer: {} files ({} large, {} of 64 KiB to 1 MiB, {} of 0 to 8 KiB) \
         in {} directories, {:.1} MB of file data; {:.1} MB as a plain tarball, {:.1} MB gzipped \
         ({:.0} % of the tarball). MB/s is 10^6 bytes of file data per second, at the median.",
        l.large_files + l.medium_files + l.small_files,
        l.large_files,
        l.medium_files,
        l.small_files,
        l.dirs,
        mb(l.file_bytes),
        mb(l.plain_bytes),
        mb(l.gzip_bytes),
        if l.plain_bytes > 0 {
            100.0 * l.gzip_bytes as f64 / l.plain_bytes as f64
        } else {
            0.0
        },
    );
    for table in &images.tables {
        table_markdown(out, table);
    }
}

/// The egress phase as Markdown: where each party ran, then its tables.
fn egress_markdown(out: &mut String, egress: &EgressReport, cpus: usize) {
    let _ = writeln!(
        out,
        "\n## Egress proxy\n\nrunbox's proxy code in this process on a runtime of {} worker \
         threads, the loopback upstreams and their DNS server on one thread of their own, the \
         client on the main thread: all three share the host's {cpus} CPUs.",
        egress.proxy_workers
    );
    for table in &egress.tables {
        table_markdown(out, table);
        if let Some((_, queries)) = egress.dns_queries.iter().find(|(t, _)| *t == table.name) {
            let _ = writeln!(
                out,
                "\nDNS queries the proxy sent during this table, warm-up included: {queries}."
            );
        }
    }
}

/// One table of the images or egress phase. Medians under a millisecond
/// get three decimals instead of two.
fn table_markdown(out: &mut String, table: &Table) {
    let _ = writeln!(out, "\n### {}\n", table.title);
    let _ = writeln!(
        out,
        "{} {} measured iterations per case, after {} warm-up iterations.\n",
        table.description, table.iterations, table.warmup
    );
    let fine = table.rows.iter().any(|r| r.summary.p50_ms < 1.0);
    let digits = if fine { 3 } else { 2 };
    let throughput = table.rows.iter().any(|r| r.mb_per_s_p50.is_some());
    let mut header = String::from("| case | n | p50 ms | p95 ms | mean ms |");
    let mut rule = String::from("|---|--:|--:|--:|--:|");
    if throughput {
        header.push_str(" MB/s |");
        rule.push_str("--:|");
    }
    if table.added_column {
        header.push_str(" p50 added ms |");
        rule.push_str("--:|");
    }
    header.push_str(" p50 ÷ the row compared with |");
    rule.push_str("---|");
    let _ = writeln!(out, "{header}\n{rule}");
    for row in &table.rows {
        let s = &row.summary;
        let label = match row.role {
            Role::Part => format!("&nbsp;&nbsp;↳ {}", row.label),
            _ => row.label.clone(),
        };
        let _ = write!(
            out,
            "| {label} | {} | {:.digits$} | {:.digits$} | {:.digits$} |",
            s.n, s.p50_ms, s.p95_ms, s.mean_ms
        );
        if throughput {
            match row.mb_per_s_p50 {
                Some(v) => {
                    let _ = write!(out, " {v:.1} |");
                }
                None => out.push_str(" – |"),
            }
        }
        if table.added_column {
            match row.p50_added_ms {
                Some(v) => {
                    let _ = write!(out, " {v:+.digits$} |");
                }
                None => out.push_str(" – |"),
            }
        }
        match (row.p50_ratio, &row.versus) {
            (Some(ratio), Some(versus)) => {
                let _ = writeln!(out, " {ratio:.2}× {versus} |");
            }
            _ => out.push_str(" – |\n"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn series(label: &str, role: Role, runtime: Option<&str>, ms: &[u64]) -> Series {
        Series {
            label: label.into(),
            role,
            runtime: runtime.map(str::to_owned),
            samples: ms.iter().map(|&m| Duration::from_millis(m)).collect(),
        }
    }

    #[test]
    fn ratios_divide_by_each_baseline_median() {
        let phase = Phase::new(
            "exec",
            "Exec",
            "x",
            1,
            3,
            vec![
                series("runbox exec (runc)", Role::Runbox, Some("runc"), &[2, 2, 2]),
                series("runc exec", Role::Baseline, Some("runc"), &[4, 4, 4]),
                series("crun exec", Role::Baseline, Some("crun"), &[1, 1, 1]),
                series("empty", Role::Reference, None, &[]),
            ],
        );
        assert_eq!(phase.rows.len(), 3, "a series without samples has no row");
        let runbox = &phase.rows[0];
        assert!((runbox.p50_ratio["runc"] - 0.5).abs() < 1e-9);
        assert!((runbox.p50_ratio["crun"] - 2.0).abs() < 1e-9);
        let table = markdown(&Report {
            host: Host {
                cpu: "cpu".into(),
                cpus: 2,
                kernel: "k".into(),
                os: "os".into(),
                cgroups: "v2".into(),
                tools: BTreeMap::new(),
            },
            phases: vec![phase],
            images: None,
            egress: None,
            snapshots: None,
            pools: None,
            interactive: None,
            sleep: None,
            checkpoints: None,
            tenants: None,
            fleet: None,
            moves: None,
            userns: None,
            volumes: None,
        });
        assert!(table.contains(
            "| case | n | p50 ms | p95 ms | mean ms | p50 ÷ runc exec | p50 ÷ crun exec |"
        ));
        assert!(table.contains("| runbox exec (runc) | 3 | 2.00 | 2.00 | 2.00 | 0.50× | 2.00× |"));
    }

    #[test]
    fn image_tables_compare_with_one_row_and_give_throughput() {
        let row = |label: &str, role, ms: &[u64], bytes, versus| TableSeries {
            series: series(label, role, None, ms),
            bytes,
            versus,
        };
        let table = Table::new(
            "unpack",
            "Unpack",
            "x",
            1,
            2,
            vec![
                row(
                    "add_layer",
                    Role::Runbox,
                    &[500, 500],
                    Some(100_000_000),
                    Some(2),
                ),
                row("nothing", Role::Runbox, &[], None, None),
                row(
                    "tar -xf",
                    Role::Baseline,
                    &[250, 250],
                    Some(100_000_000),
                    None,
                ),
                row("to nothing", Role::Runbox, &[1], None, Some(1)),
            ],
        );
        assert_eq!(table.rows.len(), 3, "a series without samples has no row");
        let add = &table.rows[0];
        assert!((add.mb_per_s_p50.unwrap() - 200.0).abs() < 1e-9);
        assert!((add.p50_ratio.unwrap() - 2.0).abs() < 1e-9);
        assert_eq!(add.versus.as_deref(), Some("tar -xf"));
        assert_eq!(table.rows[2].p50_ratio, None);
        assert_eq!(table.rows[2].versus, None, "no ratio to a missing row");
        let text = markdown(&Report {
            host: Host {
                cpu: "cpu".into(),
                cpus: 2,
                kernel: "k".into(),
                os: "os".into(),
                cgroups: "v2".into(),
                tools: BTreeMap::new(),
            },
            phases: Vec::new(),
            images: Some(ImageReport {
                layer: LayerShape::default(),
                tables: vec![table],
            }),
            egress: None,
            snapshots: None,
            pools: None,
            interactive: None,
            sleep: None,
            checkpoints: None,
            tenants: None,
            fleet: None,
            moves: None,
            userns: None,
            volumes: None,
        });
        assert!(
            text.contains("| add_layer | 2 | 500.00 | 500.00 | 500.00 | 200.0 | 2.00× tar -xf |"),
            "{text}"
        );
        assert!(text.contains("| tar -xf | 2 | 250.00 | 250.00 | 250.00 | 400.0 | – |"));
    }

    #[test]
    fn latency_tables_show_what_a_row_adds_with_finer_digits() {
        let row = |label: &str, us: &[u64], versus| TableSeries {
            series: Series {
                label: label.into(),
                role: Role::Runbox,
                runtime: None,
                samples: us.iter().map(|&u| Duration::from_micros(u)).collect(),
            },
            bytes: None,
            versus,
        };
        let table = Table::new(
            "egress-http",
            "HTTP",
            "x",
            1,
            2,
            vec![
                row("direct", &[200, 300], None),
                row("proxy", &[500, 700], Some(0)),
            ],
        )
        .with_added_column();
        assert!((table.rows[1].p50_added_ms.unwrap() - 0.35).abs() < 1e-9);
        let mut text = String::new();
        table_markdown(&mut text, &table);
        assert!(
            text.contains("| case | n | p50 ms | p95 ms | mean ms | p50 added ms | p50 ÷ the row compared with |"),
            "{text}"
        );
        assert!(
            text.contains("| proxy | 2 | 0.600 | 0.690 | 0.600 | +0.350 | 2.40× direct |"),
            "{text}"
        );
        assert!(text.contains("| direct | 2 | 0.250 | 0.295 | 0.250 | – | – |"));
    }
}
