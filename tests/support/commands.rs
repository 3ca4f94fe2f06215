//! Commands a test runs and reads: kubectl on the shared plane, `kubectl auth can-i`,
//! `scripts/ops-check`, and any command fed on its stdin. The test fails with what the command
//! printed.

use std::io::Write;
use std::process::{Command, Output, Stdio};

use serde_json::Value;

use super::plane::{Plane, kubectl, root};

/// Runs `command` with `input` on its stdin (piped, then closed) and its stdout and stderr
/// captured.
pub fn output_with_stdin(command: &mut Command, input: &[u8]) -> std::io::Result<Output> {
    let mut child = command
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()?;
    child
        .stdin
        .take()
        .expect("stdin is piped")
        .write_all(input)?;
    child.wait_with_output()
}

/// `kubectl ARGS` on the shared plane; its stdout, the test failing with both its outputs.
pub fn kubectl_ok(args: &[&str]) -> String {
    let out = kubectl().args(args).output().expect("kubectl runs");
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "kubectl {}\nstdout:\n{stdout}\nstderr:\n{}",
        args.join(" "),
        String::from_utf8_lossy(&out.stderr)
    );
    stdout
}

/// `kubectl ARGS` on the shared plane with `stdin` (if any) on its stdin: (succeeded, stdout,
/// stderr).
pub fn kubectl_try(args: &[&str], stdin: Option<&str>) -> (bool, String, String) {
    let out = Plane::shared()
        .kubectl_stdin(args, stdin.unwrap_or_default())
        .unwrap_or_else(|e| panic!("{e:#}"));
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// `kubectl auth can-i ARGS` on the shared plane (`ARGS` with the verb, the resource and
/// `--as=...`): whether it answers `yes`.
pub fn can_i(args: &[&str]) -> bool {
    let out = kubectl()
        .args(["auth", "can-i"])
        .args(args)
        .output()
        .expect("kubectl runs");
    String::from_utf8_lossy(&out.stdout).trim() == "yes"
}

/// Runs `scripts/ops-check ARGS` (built on first use, see the script) with `input` on stdin;
/// what it prints, as JSON.
pub fn ops_check(args: &[&str], input: &str) -> Value {
    let out = output_with_stdin(
        Command::new(root().join("scripts/ops-check")).args(args),
        input.as_bytes(),
    )
    .expect("scripts/ops-check runs");
    assert!(
        out.status.success(),
        "scripts/ops-check {args:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("ops-check prints JSON")
}
