//! The `runbox` binary's command line, checked without a daemon: help works,
//! and mistakes are reported before anything is sent anywhere.

use std::process::{Command, Output};

/// Runs `runbox` with a clean environment: no token, a state directory that
/// does not exist, and a URL where nothing listens.
fn runbox(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_runbox"))
        .args(args)
        .env_remove("RUNBOX_TOKEN")
        .env_remove("RUNBOX_URL")
        .env("RUNBOX_STATE_DIR", "/nonexistent/runbox-cli-test")
        .env_remove("RUST_LOG")
        .output()
        .expect("runbox runs")
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

#[test]
fn top_level_help_lists_every_subcommand() {
    let out = runbox(&["--help"]);
    assert!(out.status.success());
    let help = text(&out.stdout);
    for command in [
        "serve", "run", "exec", "cp", "ls", "rm", "renew", "image", "health",
    ] {
        assert!(
            help.lines()
                .any(|line| line.trim_start().starts_with(command)),
            "{command} missing from:\n{help}"
        );
    }
    assert!(help.contains("RUNBOX_TOKEN"), "{help}");
}

#[test]
fn exec_help_shows_its_options_and_the_connection_options() {
    let out = runbox(&["exec", "--help"]);
    assert!(out.status.success());
    let help = text(&out.stdout);
    for option in [
        "--timeout",
        "--cwd",
        "--env",
        "--url",
        "--token",
        "--state-dir",
    ] {
        assert!(help.contains(option), "{option} missing from:\n{help}");
    }
}

#[test]
fn cp_without_a_remote_side_fails_clearly() {
    let out = runbox(&["cp", "a", "b"]);
    assert_eq!(out.status.code(), Some(1));
    let err = text(&out.stderr);
    assert!(err.starts_with("runbox: "), "{err}");
    assert!(err.contains("ID:/work/PATH"), "{err}");
    // The command line is checked before the token is looked for.
    assert!(!err.contains("token"), "{err}");
}

#[test]
fn cp_refuses_remote_paths_outside_work() {
    let out = runbox(&["cp", "01JABCDEFGHJKMNPQRSTVWXYZ0:/etc/passwd", "x"]);
    assert_eq!(out.status.code(), Some(1));
    assert!(text(&out.stderr).contains("outside /work"));
}

#[test]
fn a_missing_token_says_what_to_do() {
    let out = runbox(&["ls"]);
    assert_eq!(out.status.code(), Some(1));
    let err = text(&out.stderr);
    assert!(err.contains("/nonexistent/runbox-cli-test/token"), "{err}");
    assert!(err.contains("RUNBOX_TOKEN"), "{err}");
}

#[test]
fn an_unreachable_daemon_is_named() {
    // Port 1 on loopback: nothing listens there, the connection is refused.
    let out = runbox(&["health", "--url", "http://127.0.0.1:1"]);
    assert_eq!(out.status.code(), Some(1));
    let err = text(&out.stderr);
    assert!(
        err.contains("cannot reach the runbox daemon at http://127.0.0.1:1"),
        "{err}"
    );
}

#[test]
fn bad_env_arguments_are_usage_errors() {
    let out = runbox(&["exec", "ID", "--env", "NOEQUALS", "--", "true"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(text(&out.stderr).contains("NAME=VALUE"));
}

#[test]
fn an_import_to_an_unreachable_daemon_says_so() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("file"), "x").unwrap();
    let tree = dir.path().to_str().unwrap();
    let out = runbox(&[
        "image",
        "import",
        "img",
        tree,
        "--url",
        "http://127.0.0.1:1",
        "--token",
        "t",
    ]);
    assert!(!out.status.success());
    let err = text(&out.stderr);
    // The archive stops because the upload did; the upload's reason wins.
    assert!(
        err.contains("cannot reach the runbox daemon at http://127.0.0.1:1"),
        "{err}"
    );
    assert!(!err.contains("the upload stopped"), "{err}");
}

#[test]
fn without_a_url_the_daemon_of_the_state_dir_is_asked() {
    let state = tempfile::tempdir().unwrap();
    std::fs::write(state.path().join("token"), "t\n").unwrap();
    std::fs::write(state.path().join("serve.addr"), "127.0.0.1:1\n").unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_runbox"))
        .args(["ls", "--state-dir", state.path().to_str().unwrap()])
        .env_remove("RUNBOX_TOKEN")
        .env_remove("RUNBOX_URL")
        .env_remove("RUST_LOG")
        .output()
        .expect("runbox runs");
    assert!(!out.status.success());
    let err = text(&out.stderr);
    assert!(err.contains("http://127.0.0.1:1"), "{err}");
}
