//! The benchmark's results and how they are printed: a Markdown table per
//! phase on stdout, and optionally one JSON document with every sample
//! (`--json FILE`).
//!
//! Owns the layout and the ratios: every row's median divided by the median
//! of each raw runtime's own row in the same phase. It does not measure.

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
    /// The phases, in the order they ran.
    pub phases: Vec<Phase>,
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
    let _ = writeln!(out, "Tools: {}.", tools.join("; "));
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
    out
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
        });
        assert!(table.contains(
            "| case | n | p50 ms | p95 ms | mean ms | p50 ÷ runc exec | p50 ÷ crun exec |"
        ));
        assert!(table.contains("| runbox exec (runc) | 3 | 2.00 | 2.00 | 2.00 | 0.50× | 2.00× |"));
    }
}
