//! `scripts/matrix`: the tests that run against a real API server, on every supported
//! Kubernetes minor (or the ones named), and a table of version × test binary → passed or
//! failed, with the time each took. Each test binary runs as `cargo test --test NAME` with
//! `INITIUM_KUBERNETES_VERSION` set, so the planes it starts (`scripts/control-plane up`) run
//! that release; its whole output goes to `target/matrix/<version>/<name>.log`.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Instant;

use anyhow::{Context, Result, bail};

use crate::build;
use crate::settings::{RELEASES, Release, Settings, VERSION_VAR, parse_release};

/// A test binary (tests/NAME.rs) that needs a real API server, and what its planes need
/// beyond etcd and kube-apiserver (built before it runs, so that its time is its own).
pub(crate) struct Suite {
    pub(crate) name: &'static str,
    nodes: bool,
    helm: bool,
    real_node: bool,
    /// In the smoke set CI runs on the oldest release: the API surface initium depends on
    /// (CRDs with their validation and printer columns, the rule status, the webhook
    /// configuration and the Lease, RBAC, `initium serve` admitting Pods end to end), in
    /// about two and a half minutes.
    smoke: bool,
}

const fn suite(name: &'static str) -> Suite {
    Suite {
        name,
        nodes: false,
        helm: false,
        real_node: false,
        smoke: false,
    }
}

/// Every test binary that runs against a real API server.
pub(crate) const SUITES: [Suite; 16] = [
    Suite {
        smoke: true,
        ..suite("apiserver_crds")
    },
    Suite {
        nodes: true,
        ..suite("cluster")
    },
    // Rules compiled to MutatingAdmissionPolicies: on 1.34 and 1.35 (no v1 there) the tests
    // check that every rule stays on the webhook and says why.
    suite("compiled"),
    Suite {
        nodes: true,
        ..suite("control_plane_script")
    },
    Suite {
        smoke: true,
        ..suite("controller")
    },
    Suite {
        smoke: true,
        ..suite("deploy")
    },
    Suite {
        nodes: true,
        ..suite("faults")
    },
    Suite {
        nodes: true,
        ..suite("gates")
    },
    suite("gitops"),
    Suite {
        helm: true,
        ..suite("helm")
    },
    suite("lookups"),
    suite("monitoring"),
    Suite {
        nodes: true,
        helm: true,
        real_node: true,
        ..suite("real_node")
    },
    Suite {
        smoke: true,
        ..suite("serve")
    },
    suite("served_by_api_server"),
    suite("tenants"),
];

/// The test binaries that need no API server (the matrix leaves them out: they do not
/// depend on the release). A test binary in neither list fails a unit test.
pub(crate) const OFFLINE: [&str; 9] = [
    "admission",
    "autogen",
    "cli",
    "crds",
    "engine",
    "fuzz",
    "gate_admission",
    "http_limits",
    "limits",
];

pub(crate) const USAGE: &str = "\
The tests that run against a real API server, on every supported Kubernetes minor (or the
ones named), and a table of version x test binary -> passed/failed and time.

  scripts/matrix [--versions 1.34,1.37] [--smoke | --tests NAME,NAME] [--table FILE]
  scripts/matrix --list                     the test binaries, and which are the smoke set

--versions: minors (default: all supported, oldest first). --smoke: the smoke set CI runs
on the oldest release. --tests: test binaries by name (tests/NAME.rs). --table: also write
the table (Markdown) to FILE. Every log: target/matrix/<version>/<test>.log. Exits 1 if a
test binary failed. See docs/control-plane.md.
";

pub(crate) struct Options {
    pub(crate) versions: Option<String>,
    pub(crate) tests: Option<String>,
    pub(crate) smoke: bool,
    pub(crate) table: Option<PathBuf>,
    pub(crate) list: bool,
}

/// One test binary on one release.
struct Outcome {
    passed: bool,
    /// "9 passed, 1 ignored", or why there is no count.
    summary: String,
    seconds: u64,
}

fn selected_versions(value: Option<&str>) -> Result<Vec<&'static Release>> {
    let Some(value) = value else {
        return Ok(RELEASES.iter().collect());
    };
    let mut versions = Vec::new();
    for part in value.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        let release = parse_release(part)?;
        if !versions.contains(&release) {
            versions.push(release);
        }
    }
    if versions.is_empty() {
        bail!("--versions names no release; give minors such as 1.34,1.37");
    }
    versions.sort_by_key(|r| r.minor);
    Ok(versions)
}

fn selected_suites(tests: Option<&str>, smoke: bool) -> Result<Vec<&'static Suite>> {
    match (tests, smoke) {
        (Some(_), true) => bail!("give --smoke or --tests, not both"),
        (None, true) => Ok(SUITES.iter().filter(|s| s.smoke).collect()),
        (None, false) => Ok(SUITES.iter().collect()),
        (Some(names), false) => {
            let mut chosen = Vec::new();
            for name in names.split(',').map(str::trim).filter(|n| !n.is_empty()) {
                let name = name.trim_end_matches(".rs").trim_start_matches("tests/");
                let Some(suite) = SUITES.iter().find(|s| s.name == name) else {
                    let hint = if OFFLINE.contains(&name) {
                        " (it needs no API server: run it with cargo test --test NAME)"
                    } else {
                        ""
                    };
                    bail!(
                        "{name} is not a test binary that runs against an API server{hint}; scripts/matrix --list names them"
                    );
                };
                if !chosen.iter().any(|s: &&Suite| s.name == suite.name) {
                    chosen.push(suite);
                }
            }
            if chosen.is_empty() {
                bail!("--tests names no test binary; scripts/matrix --list names them");
            }
            Ok(chosen)
        }
    }
}

/// The `test result:` line's counts: "9 passed, 1 ignored" (failed when it says so).
fn counts(output: &str) -> Option<(u64, u64, u64)> {
    let (mut passed, mut failed, mut ignored, mut seen) = (0, 0, 0, false);
    for line in output.lines() {
        let Some(rest) = line.trim().strip_prefix("test result: ") else {
            continue;
        };
        seen = true;
        for part in rest.split(';') {
            let mut words = part.split_whitespace().rev();
            let (Some(what), Some(number)) = (words.next(), words.next()) else {
                continue;
            };
            let Ok(number) = number.parse::<u64>() else {
                continue;
            };
            match what {
                "passed" => passed += number,
                "failed" => failed += number,
                "ignored" => ignored += number,
                _ => {}
            }
        }
    }
    seen.then_some((passed, failed, ignored))
}

fn summary_of(passed: u64, failed: u64, ignored: u64) -> String {
    let mut text = format!("{passed} passed");
    if failed > 0 {
        let _ = write!(text, ", {failed} failed");
    }
    if ignored > 0 {
        let _ = write!(text, ", {ignored} ignored");
    }
    text
}

fn root() -> PathBuf {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    root.canonicalize().unwrap_or(root)
}

/// `cargo` as the user runs it, without what `cargo run` set for this binary.
fn cargo() -> Command {
    let mut command = Command::new(std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into()));
    for (name, _) in std::env::vars_os() {
        let name = name.to_string_lossy();
        if [
            "CARGO_PKG_",
            "CARGO_MANIFEST_",
            "CARGO_CRATE_",
            "CARGO_BIN_",
            "CARGO_PRIMARY_",
        ]
        .iter()
        .any(|p| name.starts_with(p))
        {
            command.env_remove(name.as_ref());
        }
    }
    command.current_dir(root());
    command
}

fn target_dir() -> PathBuf {
    crate::settings::var("CARGO_TARGET_DIR").map_or_else(|| root().join("target"), PathBuf::from)
}

/// What machine the figures are from: cores, the CPU's name, memory, the kernel.
fn machine() -> String {
    let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let model = cpuinfo
        .lines()
        .find_map(|l| l.strip_prefix("model name"))
        .and_then(|l| l.split_once(':'))
        .map_or("unknown CPU", |(_, m)| m.trim())
        .to_owned();
    let cores = std::thread::available_parallelism().map_or(0, std::num::NonZero::get);
    let memory = std::fs::read_to_string("/proc/meminfo")
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix("MemTotal:"))
        .and_then(|v| v.split_whitespace().next()?.parse::<u64>().ok())
        .map_or_else(String::new, |kib| {
            format!(", {} GiB", (kib + 512 * 1024) / (1024 * 1024))
        });
    let kernel = std::fs::read_to_string("/proc/sys/kernel/osrelease")
        .map(|k| format!(", Linux {}", k.trim()))
        .unwrap_or_default();
    format!("{cores} cores ({model}){memory}{kernel}")
}

fn today() -> String {
    Command::new("date")
        .args(["-u", "+%Y-%m-%d %H:%M UTC"])
        .output()
        .ok()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_owned())
        .unwrap_or_default()
}

/// The command `matrix`.
pub(crate) fn run(settings: Settings, options: Options) -> Result<bool> {
    if options.list {
        for suite in &SUITES {
            println!(
                "{}{}",
                suite.name,
                if suite.smoke { "  (smoke)" } else { "" }
            );
        }
        return Ok(true);
    }
    let versions = selected_versions(options.versions.as_deref())?;
    let suites = selected_suites(options.tests.as_deref(), options.smoke)?;
    let started = Instant::now();
    let say = |text: &str| eprintln!("matrix: [+{}s] {text}", started.elapsed().as_secs());

    // The binaries first, so that no test's time includes a build.
    let nodes = suites.iter().any(|s| s.nodes || s.real_node);
    let helm = suites.iter().any(|s| s.helm);
    let real_node = suites.iter().any(|s| s.real_node);
    let mut settings = settings;
    for release in &versions {
        settings = settings.with_release(release);
        say(&format!("binaries of Kubernetes {}", release.version));
        build::build(&settings, nodes, helm, real_node)?;
    }
    say("building the test binaries (cargo test --no-run)");
    let mut no_run = cargo();
    // --workspace, as scripts/test builds them: the same features, so nothing is rebuilt.
    no_run.args(["test", "--workspace", "--locked", "--no-run"]);
    for suite in &suites {
        no_run.args(["--test", suite.name]);
    }
    let status = no_run
        .stdout(Stdio::null())
        .status()
        .context("cannot run cargo")?;
    if !status.success() {
        bail!("building the test binaries failed (cargo test --no-run, above)");
    }

    if real_node {
        // initium's image, which the real node's tests install: built here, so that the
        // first of them does not pay for it ($INITIUM_IMAGE_PROFILE as scripts/image reads it).
        say("initium's image (scripts/image)");
        let status = Command::new(root().join("scripts/image"))
            .current_dir(root())
            .stdout(Stdio::null())
            .status()
            .context("cannot run scripts/image")?;
        if !status.success() {
            bail!("scripts/image failed (above)");
        }
    }

    let logs = target_dir().join("matrix");
    let mut results: Vec<Vec<Outcome>> = Vec::new();
    for release in &versions {
        let dir = logs.join(release.version);
        std::fs::create_dir_all(&dir)
            .with_context(|| format!("cannot create {}", dir.display()))?;
        let mut row = Vec::new();
        for suite in &suites {
            let log_path = dir.join(format!("{}.log", suite.name));
            let log = std::fs::File::create(&log_path)
                .with_context(|| format!("cannot create {}", log_path.display()))?;
            say(&format!(
                "{} on {} (log: {})",
                suite.name,
                release.version,
                log_path.display()
            ));
            let begin = Instant::now();
            let status = cargo()
                .args([
                    "test",
                    "--workspace",
                    "--locked",
                    "--test",
                    suite.name,
                    "--no-fail-fast",
                ])
                .env(VERSION_VAR, release.name())
                .stdin(Stdio::null())
                .stdout(log.try_clone()?)
                .stderr(log)
                .status()
                .context("cannot run cargo test")?;
            let seconds = begin.elapsed().as_secs();
            let output = std::fs::read_to_string(&log_path).unwrap_or_default();
            let outcome = match counts(&output) {
                Some((passed, failed, ignored)) => Outcome {
                    passed: status.success() && failed == 0 && passed > 0,
                    summary: summary_of(passed, failed, ignored),
                    seconds,
                },
                None => Outcome {
                    passed: false,
                    summary: format!("no test ran ({status})"),
                    seconds,
                },
            };
            say(&format!(
                "{} on {}: {} ({}, {seconds}s)",
                suite.name,
                release.version,
                if outcome.passed { "passed" } else { "FAILED" },
                outcome.summary
            ));
            row.push(outcome);
        }
        results.push(row);
    }

    let table = table(&versions, &suites, &results);
    println!("\n{table}");
    if let Some(path) = &options.table {
        std::fs::write(path, &table).with_context(|| format!("cannot write {}", path.display()))?;
    }
    let failed = results.iter().flatten().filter(|o| !o.passed).count();
    let passed = results.iter().flatten().count() - failed;
    // The plain closing line: test binaries, not tests.
    println!("matrix: {passed} passed, {failed} failed");
    Ok(failed == 0)
}

/// The table: a row per test binary, a column per release, and the machine and date.
fn table(versions: &[&Release], suites: &[&Suite], results: &[Vec<Outcome>]) -> String {
    let mut text = format!(
        "`scripts/matrix`, {} on {}; each cell: the test binary's outcome, its tests, its time\n\n| test binary |",
        today(),
        machine()
    );
    for release in versions {
        let _ = write!(text, " {} |", release.version);
    }
    text.push_str("\n|---|");
    for _ in versions {
        text.push_str("---|");
    }
    text.push('\n');
    for (i, suite) in suites.iter().enumerate() {
        let _ = write!(
            text,
            "| `{}`{} |",
            suite.name,
            if suite.smoke { " (smoke)" } else { "" }
        );
        for row in results {
            if let Some(outcome) = row.get(i) {
                let _ = write!(
                    text,
                    " {} ({}) {}s |",
                    if outcome.passed { "ok" } else { "**FAILED**" },
                    outcome.summary,
                    outcome.seconds
                );
            }
        }
        text.push('\n');
    }
    text.push_str("| total |");
    for row in results {
        let seconds: u64 = row.iter().map(|o| o.seconds).sum();
        let failed = row.iter().filter(|o| !o.passed).count();
        let _ = write!(
            text,
            " {} of {} passed, {}m{:02}s |",
            row.len() - failed,
            row.len(),
            seconds / 60,
            seconds % 60
        );
    }
    text.push('\n');
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_add_up_every_test_result_line() {
        let output = "running 3 tests\ntest result: ok. 9 passed; 0 failed; 1 ignored; 0 measured; 0 filtered out; finished in 30.45s\n\ntest result: FAILED. 2 passed; 1 failed; 0 ignored; 0 measured; 0 filtered out\n";
        assert_eq!(counts(output), Some((11, 1, 1)));
        assert_eq!(counts("error: could not compile"), None);
        assert_eq!(summary_of(11, 1, 1), "11 passed, 1 failed, 1 ignored");
        assert_eq!(summary_of(4, 0, 0), "4 passed");
    }

    /// Every tests/*.rs is either a suite of the matrix or offline: a new test binary must
    /// be put in one of the two lists.
    #[test]
    fn every_test_binary_is_in_the_matrix_or_offline() {
        let tests = root().join("tests");
        let mut names: Vec<String> = std::fs::read_dir(&tests)
            .map(|entries| {
                entries
                    .flatten()
                    .filter_map(|e| {
                        let name = e.file_name().to_string_lossy().into_owned();
                        name.strip_suffix(".rs").map(str::to_owned)
                    })
                    .collect()
            })
            .unwrap_or_default();
        names.sort();
        assert!(names.len() > 10, "no test binaries in {}", tests.display());
        for name in &names {
            let in_matrix = SUITES.iter().any(|s| s.name == name);
            let offline = OFFLINE.contains(&name.as_str());
            assert!(
                in_matrix != offline,
                "tests/{name}.rs must be in exactly one of matrix::SUITES (it needs an API server) and matrix::OFFLINE"
            );
        }
        for suite in &SUITES {
            assert!(
                names.iter().any(|n| n == suite.name),
                "no tests/{}.rs",
                suite.name
            );
        }
    }

    #[test]
    fn the_table_has_a_cell_per_release_and_test_binary() {
        let versions = [&RELEASES[0], &RELEASES[3]];
        let suites = [&SUITES[0], &SUITES[1]];
        let outcome = |passed, summary: &str, seconds| Outcome {
            passed,
            summary: summary.to_owned(),
            seconds,
        };
        let results = vec![
            vec![outcome(true, "9 passed", 31), outcome(true, "4 passed", 90)],
            vec![
                outcome(true, "9 passed", 30),
                outcome(false, "3 passed, 1 failed", 95),
            ],
        ];
        let text = table(&versions, &suites, &results);
        let rows: Vec<&str> = text.lines().skip(2).collect();
        assert_eq!(
            rows,
            [
                "| test binary | v1.34.4 | v1.37.2 |",
                "|---|---|---|",
                "| `apiserver_crds` (smoke) | ok (9 passed) 31s | ok (9 passed) 30s |",
                "| `cluster` | ok (4 passed) 90s | **FAILED** (3 passed, 1 failed) 95s |",
                "| total | 2 of 2 passed, 2m01s | 1 of 2 passed, 2m05s |",
            ]
        );
    }

    #[test]
    fn selections_name_what_they_take() {
        let smoke: Vec<&str> = selected_suites(None, true)
            .unwrap_or_default()
            .iter()
            .map(|s| s.name)
            .collect();
        assert_eq!(smoke, ["apiserver_crds", "controller", "deploy", "serve"]);
        let chosen: Vec<&str> = selected_suites(Some("tests/serve.rs, gates,serve"), false)
            .unwrap_or_default()
            .iter()
            .map(|s| s.name)
            .collect();
        assert_eq!(chosen, ["serve", "gates"]);
        let error = selected_suites(Some("cli"), false)
            .err()
            .map(|e| e.to_string());
        assert_eq!(
            error.as_deref(),
            Some(
                "cli is not a test binary that runs against an API server (it needs no API server: run it with cargo test --test NAME); scripts/matrix --list names them"
            )
        );
        let versions: Vec<u32> = selected_versions(Some("1.37,1.34,v1.37"))
            .unwrap_or_default()
            .iter()
            .map(|r| r.minor)
            .collect();
        assert_eq!(versions, [34, 37]);
        assert!(selected_versions(Some(",")).is_err());
        assert!(selected_versions(Some("1.33")).is_err());
    }
}
