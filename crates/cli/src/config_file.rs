//! `runbox serve --config FILE`: a TOML file whose keys are `runbox serve`'s
//! flags without their dashes (`max_runs = 64` or `max-runs = 64` for
//! `--max-runs 64`; `true` for a switch; an array for a flag that may be
//! repeated). Flags on the command line and their environment variables
//! win over the file.
//!
//! The file is turned into the flags it stands for and parsed by the same
//! clap definitions as the command line, so every flag has a key, a value
//! is checked by the flag's own parser, and the two can never disagree. An
//! unknown key or a bad value is an error naming the key.

use std::ffi::OsString;
use std::path::Path;

use anyhow::{anyhow, bail, Context};
use clap::parser::ValueSource;
use clap::{ArgAction, Args, FromArgMatches};

use crate::serve::ServeArgs;

/// The `serve` command as clap knows it, arguments only (no binary or
/// subcommand name).
fn command() -> clap::Command {
    ServeArgs::augment_args(clap::Command::new("serve").no_binary_name(true))
}

/// The arguments that followed `serve` on this process's command line.
pub fn command_line_args() -> Vec<OsString> {
    let args: Vec<OsString> = std::env::args_os().collect();
    match args.iter().position(|a| a == "serve") {
        Some(at) => args[at + 1..].to_vec(),
        None => Vec::new(),
    }
}

/// A parsed config file: its keys and values, as written.
pub type Table = toml::Table;

/// Reads and parses `path` as TOML.
pub fn read(path: &Path) -> anyhow::Result<Table> {
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("reading the config file {}", path.display()))?;
    toml::from_str(&text).map_err(|e| anyhow!("{} is not valid TOML: {e}", path.display()))
}

/// The serve arguments from `cli` (what followed `serve`) over `table`
/// (read from `path`, named in errors).
pub fn merge(path: &Path, table: &Table, cli: &[OsString]) -> anyhow::Result<ServeArgs> {
    let cmd = command();
    let given = cmd
        .clone()
        .try_get_matches_from(cli)
        .map_err(|e| anyhow!("{}", e.render()))?;
    let mut file_args: Vec<(String, Vec<OsString>)> = Vec::new();
    let mut seen = std::collections::HashSet::new();
    for (key, value) in table {
        let flag = key.replace('_', "-");
        if !seen.insert(flag.clone()) {
            bail!(
                "{}: key `{key}` names a flag another key names too",
                path.display()
            );
        }
        let arg = cmd
            .get_arguments()
            .find(|a| a.get_long() == Some(flag.as_str()) && !a.is_hide_set())
            .ok_or_else(|| {
                anyhow!(
                    "{}: unknown key `{key}`; the keys are runbox serve's flags without the dashes (see runbox serve --help)",
                    path.display()
                )
            })?;
        if flag == "config" {
            bail!(
                "{}: key `config`: a config file cannot name another",
                path.display()
            );
        }
        let args = flag_args(&flag, arg.get_action(), value)
            .map_err(|why| anyhow!("{}: key `{key}`: {why}", path.display()))?;
        // Every value is checked by its flag's parser, also one the
        // command line overrides: a bad file is a bad file.
        if let Err(why) = cmd.clone().try_get_matches_from(&args) {
            bail!(
                "{}: key `{key}`: {}",
                path.display(),
                first_line(&why.render().to_string())
            );
        }
        // The command line and the environment win.
        if matches!(
            given.value_source(arg.get_id().as_str()),
            Some(ValueSource::CommandLine | ValueSource::EnvVariable)
        ) {
            continue;
        }
        file_args.push((key.clone(), args));
    }
    let all: Vec<OsString> = file_args
        .iter()
        .flat_map(|(_, args)| args.iter().cloned())
        .chain(cli.iter().cloned())
        .collect();
    match cmd.clone().try_get_matches_from(&all) {
        Ok(matches) => ServeArgs::from_arg_matches(&matches).map_err(|e| anyhow!("{}", e.render())),
        Err(e) => {
            // Name the key whose value clap refused.
            for (key, args) in &file_args {
                let alone: Vec<OsString> = args.iter().chain(cli.iter()).cloned().collect();
                if let Err(why) = cmd.clone().try_get_matches_from(&alone) {
                    bail!(
                        "{}: key `{key}`: {}",
                        path.display(),
                        first_line(&why.render().to_string())
                    );
                }
            }
            bail!(
                "{}: {}",
                path.display(),
                first_line(&e.render().to_string())
            )
        }
    }
}

/// clap's message without its `error: ` and usage lines.
fn first_line(message: &str) -> String {
    message
        .lines()
        .next()
        .unwrap_or("")
        .trim_start_matches("error: ")
        .to_owned()
}

/// The flags a key's value stands for.
fn flag_args(flag: &str, action: &ArgAction, value: &toml::Value) -> Result<Vec<OsString>, String> {
    let scalar = |value: &toml::Value| -> Result<String, String> {
        match value {
            toml::Value::String(s) => Ok(s.clone()),
            toml::Value::Integer(n) => Ok(n.to_string()),
            toml::Value::Float(f) => Ok(f.to_string()),
            toml::Value::Boolean(b) => Ok(b.to_string()),
            toml::Value::Datetime(d) => Ok(d.to_string()),
            toml::Value::Array(_) => Err("takes one value, not an array".into()),
            // A table stands for the JSON object a flag such as
            // `--dataset` takes.
            toml::Value::Table(t) => serde_json::to_string(t).map_err(|e| e.to_string()),
        }
    };
    let one = |v: String| OsString::from(format!("--{flag}={v}"));
    match action {
        ArgAction::SetTrue | ArgAction::SetFalse => match value {
            toml::Value::Boolean(true) => Ok(vec![OsString::from(format!("--{flag}"))]),
            toml::Value::Boolean(false) => Ok(Vec::new()),
            _ => Err("is a switch: write true or false".into()),
        },
        ArgAction::Append => match value {
            toml::Value::Array(items) => items.iter().map(|v| scalar(v).map(one)).collect(),
            other => Ok(vec![one(scalar(other)?)]),
        },
        _ => Ok(vec![one(scalar(value)?)]),
    }
}

/// `table` with every key spelt with `_` (`max-runs` and `max_runs` are
/// one key; [`merge`] refuses a file with both).
pub fn normalized(table: &Table) -> Table {
    table
        .iter()
        .map(|(k, v)| (k.replace('-', "_"), v.clone()))
        .collect()
}

/// The keys of `table` whose flag `cli` (what followed `serve`) or its
/// environment variable sets, so the file's value is not used.
pub fn overridden_keys(table: &Table, cli: &[OsString]) -> Vec<String> {
    let cmd = command();
    let Ok(given) = cmd.clone().try_get_matches_from(cli) else {
        return Vec::new();
    };
    table
        .keys()
        .filter(|key| {
            let flag = key.replace('_', "-");
            cmd.get_arguments()
                .find(|a| a.get_long() == Some(flag.as_str()))
                .is_some_and(|arg| {
                    matches!(
                        given.value_source(arg.get_id().as_str()),
                        Some(ValueSource::CommandLine | ValueSource::EnvVariable)
                    )
                })
        })
        .map(|key| key.replace('-', "_"))
        .collect()
}

/// The keys whose values differ between two readings of the file
/// (`max-runs` and `max_runs` are one key).
pub fn changed_keys(old: &Table, new: &Table) -> Vec<String> {
    let (old, new) = (normalized(old), normalized(new));
    let mut keys: Vec<String> = old
        .keys()
        .chain(new.keys())
        .filter(|k| old.get(*k) != new.get(*k))
        .cloned()
        .collect();
    keys.sort();
    keys.dedup();
    keys
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(text: &str, cli: &[&str]) -> anyhow::Result<ServeArgs> {
        let table: Table = toml::from_str(text).unwrap();
        let cli: Vec<OsString> = cli.iter().map(OsString::from).collect();
        merge(Path::new("/etc/runbox/config.toml"), &table, &cli)
    }

    #[test]
    fn keys_are_the_flags_and_the_command_line_wins() {
        let args = parse(
            r#"
            max_runs = 7
            state-dir = "/srv/runbox"
            no_disk_limits = true
            shutdown_grace_sec = 5
            "#,
            &["--max-runs", "9"],
        )
        .unwrap();
        // An overridden key is still checked.
        let e = parse("max_runs = \"x\"", &["--max-runs", "9"]).unwrap_err();
        assert!(e.to_string().contains("key `max_runs`"), "{e}");
        assert_eq!(args.max_runs, 9, "the flag wins");
        assert_eq!(args.state_dir, Path::new("/srv/runbox"));
        assert!(args.no_disk_limits);
        assert_eq!(args.shutdown_grace_sec, 5);
        // false is the switch left off.
        let args = parse("no_disk_limits = false", &[]).unwrap();
        assert!(!args.no_disk_limits);
    }

    #[test]
    fn dataset_tables_are_catalog_entries() {
        let args = parse(
            r#"
            [[dataset]]
            name = "corpus"
            path = "/srv/datasets/corpus.img"

            [[dataset]]
            name = "scratch"
            path = "/srv/datasets/scratch.img"
            writable = true
            tenants = ["acme"]
            "#,
            &[],
        )
        .unwrap();
        assert_eq!(args.datasets.len(), 2);
        assert!(!args.datasets[0].writable);
        assert!(args.datasets[1].writable);
        assert_eq!(args.datasets[1].tenants, ["acme"]);
        let e = parse("[[dataset]]\nname = \"x\"\npath = \"relative.img\"\n", &[]).unwrap_err();
        assert!(e.to_string().contains("key `dataset`"), "{e}");
        let e = parse(
            "[[dataset]]\nname = \"x\"\npath = \"/x.img\"\nsize = 3\n",
            &[],
        )
        .unwrap_err();
        assert!(e.to_string().contains("key `dataset`"), "{e}");
    }

    #[test]
    fn unknown_keys_and_bad_values_name_the_key() {
        for (text, want) in [
            ("max_rnus = 3", "unknown key `max_rnus`"),
            ("max_runs = \"many\"", "key `max_runs`"),
            ("max_runs = [1, 2]", "key `max_runs`: takes one value"),
            (
                "no_disk_limits = \"yes\"",
                "key `no_disk_limits`: is a switch",
            ),
            ("listen = \"not an address\"", "key `listen`"),
            ("config = \"/etc/other.toml\"", "key `config`"),
            ("usage_max_mb = 0", "key `usage_max_mb`"),
        ] {
            let e = parse(text, &[]).unwrap_err().to_string();
            assert!(e.contains(want), "{text}: {e}");
            assert!(e.starts_with("/etc/runbox/config.toml"), "{e}");
        }
    }

    #[test]
    fn changed_keys_are_listed_once() {
        let old: Table =
            toml::from_str("max_runs = 1\nlisten = \"127.0.0.1:1\"\nusage-max-mb = 8").unwrap();
        let new: Table =
            toml::from_str("max_runs = 2\nstate_dir = \"/x\"\nusage_max_mb = 8").unwrap();
        assert_eq!(
            changed_keys(&old, &new),
            vec!["listen", "max_runs", "state_dir"]
        );
    }
}
