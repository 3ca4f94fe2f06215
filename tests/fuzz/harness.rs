//! The fuzz loop and its supervision.
//!
//! Cases run in a worker process (this test binary, re-executed with `--exact worker`), on a
//! thread with the stack `initium serve` gives its handlers, under a memory limit. The worker
//! announces every case on stdout before running it, so when it dies (a stack overflow aborts
//! the whole process) or stops making progress, the supervisor knows which case did it,
//! regenerates that case from the seed, shrinks it by replaying smaller versions in fresh
//! workers, and writes it to `target/fuzz-failures/`.

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Read, Write};
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::path::{Path, PathBuf};
use std::process::{Command, ExitStatus, Stdio};
use std::sync::mpsc::{self, RecvTimeoutError};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use serde_json::{Value, json};

use super::rng::Rng;
use super::targets::{self, Target, cut};

/// How a campaign runs; every field can be set from the environment (docs/fuzzing.md).
#[derive(Clone, Debug)]
pub struct Settings {
    /// A case that takes longer fails (`INITIUM_FUZZ_CASE_MS`, default 2000).
    pub case_bound: Duration,
    /// A worker that announces nothing for this long is killed: a hang (`INITIUM_FUZZ_HANG_MS`,
    /// default 10000).
    pub hang: Duration,
    /// Address-space limit of a worker (`INITIUM_FUZZ_MEMORY_MB`, default 2048; 0: none).
    pub memory_mb: u64,
    /// Stack of the thread that runs cases (`INITIUM_FUZZ_STACK_KB`, default 2048: tokio's
    /// worker and blocking threads, which run admission in `initium serve`, have 2 MiB).
    pub stack_kb: usize,
    /// Time spent shrinking one failure (`INITIUM_FUZZ_SHRINK_SECONDS`, default 60) and all of
    /// them in one campaign (4 times that).
    pub shrink: Duration,
    /// Reproducers per distinct failure (`INITIUM_FUZZ_REPRODUCERS`, default 2).
    pub reproducers: usize,
    /// Where reproducers go (`INITIUM_FUZZ_OUT`, default target/fuzz-failures).
    pub out_dir: PathBuf,
}

fn env_u64(name: &str, default: u64) -> u64 {
    match std::env::var(name) {
        Ok(v) => v
            .trim()
            .parse()
            .unwrap_or_else(|_| panic!("{name}={v:?} is not a number")),
        Err(_) => default,
    }
}

impl Settings {
    pub fn from_env() -> Settings {
        Settings {
            case_bound: Duration::from_millis(env_u64("INITIUM_FUZZ_CASE_MS", 2000)),
            hang: Duration::from_millis(env_u64("INITIUM_FUZZ_HANG_MS", 10_000)),
            memory_mb: env_u64("INITIUM_FUZZ_MEMORY_MB", 2048),
            stack_kb: env_u64("INITIUM_FUZZ_STACK_KB", 2048) as usize,
            shrink: Duration::from_secs(env_u64("INITIUM_FUZZ_SHRINK_SECONDS", 60)),
            reproducers: env_u64("INITIUM_FUZZ_REPRODUCERS", 2) as usize,
            out_dir: std::env::var_os("INITIUM_FUZZ_OUT").map_or_else(
                || Path::new(env!("CARGO_MANIFEST_DIR")).join("target/fuzz-failures"),
                PathBuf::from,
            ),
        }
    }
}

/// What the worker process holds, from Linux's own accounting (no allocator of our own: the
/// crate forbids unsafe code): the peak resident set is reset before a case
/// (`/proc/self/clear_refs`, "5") and read after it (`VmHWM`). Memory the allocator kept from
/// earlier cases is reused without showing, so this sees what a case adds beyond that: enough
/// for the blow-ups of issue 30 (hundreds of megabytes). Elsewhere than Linux, nothing is
/// measured and the oracle holds.
pub mod memory {
    fn status_kib(field: &str) -> Option<usize> {
        let status = std::fs::read_to_string("/proc/self/status").ok()?;
        let line = status.lines().find(|l| l.starts_with(field))?;
        line.split_whitespace().nth(1)?.parse().ok()
    }

    /// Starts a new peak from what is resident now; returns what is resident now (bytes).
    pub fn reset_peak() -> Option<usize> {
        std::fs::write("/proc/self/clear_refs", "5").ok()?;
        status_kib("VmRSS:").map(|kib| kib * 1024)
    }

    /// The most resident since [`reset_peak`] (bytes).
    pub fn peak() -> Option<usize> {
        status_kib("VmHWM:").map(|kib| kib * 1024)
    }
}

/// The cost oracle: what one case may make the process hold at its peak, beyond what it held
/// before ([`memory`]), is linear in the case's size (its JSON). The base covers what any case may build
/// whatever its size (a rule's regular expressions share 4 MiB, plus their search caches; the
/// output limits are 4 MiB an object); the factor, what parsing and copying an input takes
/// (a JSON value in memory is a few times its text, an object is cloned to be evaluated
/// twice). Before the bounds of issue 30, a 1.4 MB template query took 782 MB to compile and
/// an `in:` set over a 61 KB Pod 415 MB: far over it.
pub const COST_BASE_BYTES: usize = 64 << 20;
pub const COST_BYTES_PER_INPUT_BYTE: usize = 48;

/// A failure: its class (`panic`, `oracle`, `cost`, `slow`, `hang`, `stack-overflow`,
/// `out-of-memory`, `crash`) and message.
#[derive(Clone, Debug)]
pub struct Failure {
    pub class: String,
    pub message: String,
}

impl Failure {
    fn new(class: &str, message: impl Into<String>) -> Failure {
        Failure {
            class: class.to_string(),
            message: message.into(),
        }
    }

    fn is_time(&self) -> bool {
        matches!(self.class.as_str(), "slow" | "hang")
    }

    /// What makes two failures the same bug: the class, and for panics and oracle failures
    /// the first line of the message with numbers blanked out.
    pub fn signature(&self) -> String {
        match self.class.as_str() {
            "panic" | "oracle" => {
                let line = self.message.lines().next().unwrap_or("");
                let mut normal = String::new();
                for c in line.chars().take(120) {
                    if !c.is_ascii_digit() {
                        normal.push(c);
                    } else if !normal.ends_with('#') {
                        normal.push('#');
                    }
                }
                format!("{}: {normal}", self.class)
            }
            "crash" => format!(
                "crash: {}",
                self.message
                    .lines()
                    .next()
                    .unwrap_or("")
                    .chars()
                    .take(60)
                    .collect::<String>()
            ),
            other => other.to_string(),
        }
    }

    fn same_bug(&self, other: &Failure) -> bool {
        (self.is_time() && other.is_time()) || self.signature() == other.signature()
    }
}

/// A failure found by a campaign, with where its reproducer was written.
#[derive(Debug)]
pub struct Found {
    pub failure: Failure,
    pub case: u64,
    pub path: PathBuf,
}

#[derive(Debug)]
pub struct Report {
    pub target: &'static str,
    pub seed: u64,
    pub cases: u64,
    pub elapsed: Duration,
    /// Every failing case, including repeats of a known failure.
    pub failures: u64,
    /// One entry per reproducer written.
    pub found: Vec<Found>,
}

impl Report {
    pub fn summary(&self) -> String {
        let secs = self.elapsed.as_secs_f64();
        let mut s = format!(
            "fuzz {}: seed {} cases {} in {:.1} s ({:.0} cases/s), failures {} ({} distinct)",
            self.target,
            self.seed,
            self.cases,
            secs,
            self.cases as f64 / secs.max(1e-9),
            self.failures,
            self.found
                .iter()
                .map(|f| f.failure.signature())
                .collect::<std::collections::BTreeSet<_>>()
                .len(),
        );
        for f in &self.found {
            s.push_str(&format!(
                "\n  {} case {}: {}\n    reproducer: {}",
                f.failure.class,
                f.case,
                cut(&f.failure.message),
                f.path.display()
            ));
        }
        s
    }
}

// ---------------------------------------------------------------------------------------------
// The worker (inside the child process)

static LAST_PANIC: Mutex<String> = Mutex::new(String::new());

fn emit(line: &str) {
    let mut out = std::io::stdout().lock();
    let _ = out.write_all(line.as_bytes());
    let _ = out.write_all(b"\n");
    let _ = out.flush();
}

/// Runs one case in-process: a panic, an oracle failure or a case over the time bound.
pub fn run_one(target: &Target, input: &Value, bound: Duration) -> Option<Failure> {
    let input_bytes = input.to_string().len();
    let held_before = memory::reset_peak();
    let started = Instant::now();
    let result = catch_unwind(AssertUnwindSafe(|| (target.run)(input)));
    let took = started.elapsed();
    let peak = match (held_before, memory::peak()) {
        (Some(before), Some(peak)) => peak.saturating_sub(before),
        _ => 0,
    };
    let cost_bound =
        COST_BASE_BYTES.saturating_add(COST_BYTES_PER_INPUT_BYTE.saturating_mul(input_bytes));
    if result.is_ok() && peak > cost_bound {
        return Some(Failure::new(
            "cost",
            format!(
                "held {:.1} MiB at its peak for an input of {input_bytes} bytes (bound {:.1} MiB: {} MiB + {COST_BYTES_PER_INPUT_BYTE} × the input)",
                peak as f64 / 1048576.0,
                cost_bound as f64 / 1048576.0,
                COST_BASE_BYTES >> 20
            ),
        ));
    }
    match result {
        Err(_) => Some(Failure::new(
            "panic",
            std::mem::take(&mut *LAST_PANIC.lock().unwrap_or_else(|e| e.into_inner())),
        )),
        Ok(Err(message)) => Some(Failure::new("oracle", message)),
        Ok(Ok(())) if took > bound => Some(Failure::new(
            "slow",
            format!(
                "took {:.2} s (bound {:.2} s)",
                took.as_secs_f64(),
                bound.as_secs_f64()
            ),
        )),
        Ok(Ok(())) => None,
    }
}

/// The body of the `worker` test: a no-op unless the supervisor started it.
pub fn worker_main() {
    let Ok(name) = std::env::var("INITIUM_FUZZ_WORKER") else {
        eprintln!("the fuzz worker runs only when started by scripts/fuzz or the fuzz tests");
        return;
    };
    let target = targets::target(&name).unwrap_or_else(|| panic!("no fuzz target {name:?}"));
    std::panic::set_hook(Box::new(|info| {
        let message = match info.payload().downcast_ref::<&str>() {
            Some(s) => s.to_string(),
            None => info
                .payload()
                .downcast_ref::<String>()
                .cloned()
                .unwrap_or_else(|| "(no message)".into()),
        };
        let at = info
            .location()
            .map(|l| format!("{}:{}", l.file(), l.line()))
            .unwrap_or_default();
        *LAST_PANIC.lock().unwrap_or_else(|e| e.into_inner()) =
            format!("panicked at {at}: {message}");
    }));
    let settings = Settings::from_env();
    let handle = std::thread::Builder::new()
        .name("fuzz-case".into())
        .stack_size(settings.stack_kb * 1024)
        .spawn(move || worker_loop(target, &settings))
        .expect("spawn the case thread");
    let _ = handle.join();
}

fn worker_loop(target: &Target, settings: &Settings) {
    let report = |i: u64, f: &Failure| {
        emit(&format!(
            "@@fuzz fail {i} {} {}",
            f.class,
            Value::String(f.message.clone())
        ))
    };
    if let Ok(path) = std::env::var("INITIUM_FUZZ_REPLAY_FILE") {
        let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{path}: {e}"));
        let input: Value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{path}: {e}"));
        emit("@@fuzz start 0");
        if let Some(f) = run_one(target, &input, settings.case_bound) {
            report(0, &f);
        }
        emit("@@fuzz end 1");
        return;
    }
    let seed = env_u64("INITIUM_FUZZ_SEED", 0);
    let mut index = env_u64("INITIUM_FUZZ_START", 0);
    let until = Instant::now() + Duration::from_millis(env_u64("INITIUM_FUZZ_MS", 1000));
    let max = env_u64("INITIUM_FUZZ_MAX", u64::MAX);
    let mut count = 0;
    while count < max && Instant::now() < until {
        emit(&format!("@@fuzz start {index}"));
        let generate = || (target.generate)(&mut Rng::new(Rng::case_seed(seed, index)));
        match catch_unwind(generate) {
            Ok(input) => {
                if let Some(f) = run_one(target, &input, settings.case_bound) {
                    report(index, &f);
                }
            }
            Err(_) => {
                let message =
                    std::mem::take(&mut *LAST_PANIC.lock().unwrap_or_else(|e| e.into_inner()));
                report(index, &Failure::new("generator", message));
            }
        }
        index += 1;
        count += 1;
    }
    emit(&format!("@@fuzz end {count}"));
}

// ---------------------------------------------------------------------------------------------
// The supervisor

/// What one worker process did.
struct WorkerRun {
    /// The last case it started.
    started: Option<u64>,
    /// Cases it ran to completion (or started, when it died).
    cases: u64,
    /// In-process failures, by case.
    failures: Vec<(u64, Failure)>,
    /// It died or hung on `started`.
    died: Option<Failure>,
    /// It finished its run (time or case count reached).
    ended: bool,
    /// The last 16 KiB of its stderr.
    stderr: String,
}

fn run_worker(
    target: &Target,
    settings: &Settings,
    env: &[(&str, String)],
    hang: Duration,
) -> WorkerRun {
    let exe = std::env::current_exe().expect("the test binary");
    let mut command = if settings.memory_mb > 0 {
        let mut c = Command::new("sh");
        c.arg("-c")
            .arg(r#"ulimit -v "$1" 2>/dev/null; shift; exec "$@""#)
            .arg("sh")
            .arg((settings.memory_mb * 1024).to_string())
            .arg(&exe);
        c
    } else {
        Command::new(&exe)
    };
    command
        .args([
            "worker",
            "--exact",
            "--ignored",
            "--nocapture",
            "--test-threads=1",
        ])
        .env_remove("INITIUM_FUZZ_REPLAY_FILE")
        .env_remove("INITIUM_FUZZ_START")
        .env_remove("INITIUM_FUZZ_MAX")
        .env("INITIUM_FUZZ_WORKER", target.name)
        .env("RUST_BACKTRACE", "0")
        .env(
            "INITIUM_FUZZ_CASE_MS",
            settings.case_bound.as_millis().to_string(),
        )
        .env("INITIUM_FUZZ_STACK_KB", settings.stack_kb.to_string())
        .envs(env.iter().map(|(k, v)| (k, v)))
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let mut child = command.spawn().expect("start a fuzz worker");
    let stdout = child.stdout.take().expect("stdout");
    let mut stderr = child.stderr.take().expect("stderr");
    let (tx, rx) = mpsc::channel::<String>();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines() {
            let Ok(line) = line else { break };
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    let tail = Arc::new(Mutex::new(Vec::<u8>::new()));
    let tail_writer = tail.clone();
    let stderr_thread = std::thread::spawn(move || {
        let mut buf = [0u8; 8192];
        while let Ok(n) = stderr.read(&mut buf) {
            if n == 0 {
                break;
            }
            let mut t = tail_writer.lock().unwrap_or_else(|e| e.into_inner());
            t.extend_from_slice(&buf[..n]);
            let excess = t.len().saturating_sub(16 * 1024);
            t.drain(..excess);
        }
    });

    let mut run = WorkerRun {
        started: None,
        cases: 0,
        failures: Vec::new(),
        died: None,
        ended: false,
        stderr: String::new(),
    };
    let mut first: Option<u64> = None;
    let mut last = Instant::now();
    let mut hung = false;
    loop {
        match rx.recv_timeout(
            hang.saturating_sub(last.elapsed())
                .max(Duration::from_millis(1)),
        ) {
            Ok(line) => {
                last = Instant::now();
                let Some(rest) = line.strip_prefix("@@fuzz ") else {
                    continue;
                };
                let mut parts = rest.splitn(4, ' ');
                match (parts.next(), parts.next()) {
                    (Some("start"), Some(i)) => {
                        let i = i.parse().unwrap_or(0);
                        first.get_or_insert(i);
                        run.started = Some(i);
                    }
                    (Some("fail"), Some(i)) => {
                        let class = parts.next().unwrap_or("oracle");
                        let message: Value = serde_json::from_str(parts.next().unwrap_or("\"\""))
                            .unwrap_or_default();
                        run.failures.push((
                            i.parse().unwrap_or(0),
                            Failure::new(class, message.as_str().unwrap_or_default()),
                        ));
                    }
                    (Some("end"), Some(n)) => {
                        run.cases = n.parse().unwrap_or(0);
                        run.ended = true;
                    }
                    _ => {}
                }
            }
            Err(RecvTimeoutError::Timeout) => {
                if last.elapsed() >= hang {
                    let _ = child.kill();
                    hung = true;
                    break;
                }
            }
            Err(RecvTimeoutError::Disconnected) => break,
        }
    }
    let status = child.wait().expect("wait for the fuzz worker");
    let _ = stderr_thread.join();
    run.stderr =
        String::from_utf8_lossy(&tail.lock().unwrap_or_else(|e| e.into_inner())).to_string();
    if !run.ended {
        run.cases = match (first, run.started) {
            (Some(a), Some(b)) => b - a + 1,
            _ => 0,
        };
        let stderr = run.stderr.clone();
        run.died = Some(if hung {
            Failure::new(
                "hang",
                format!("no progress for {:.1} s", hang.as_secs_f64()),
            )
        } else {
            classify_death(status, &stderr, settings)
        });
    }
    run
}

fn classify_death(status: ExitStatus, stderr: &str, settings: &Settings) -> Failure {
    use std::os::unix::process::ExitStatusExt;
    let lines: Vec<&str> = stderr
        .lines()
        .filter(|l| !l.trim().is_empty() && !l.starts_with("note: "))
        .collect();
    let context = lines[lines.len().saturating_sub(4)..].join("\n");
    if stderr.contains("has overflowed its stack") {
        Failure::new(
            "stack-overflow",
            format!("the process aborted: stack overflow\n{context}"),
        )
    } else if stderr.contains("memory allocation of") {
        Failure::new(
            "out-of-memory",
            format!(
                "the process aborted: out of memory (limit {} MiB address space)\n{context}",
                settings.memory_mb
            ),
        )
    } else if let Some(signal) = status.signal() {
        Failure::new("crash", format!("killed by signal {signal}\n{context}"))
    } else {
        Failure::new(
            "crash",
            format!("the worker exited with {status} before finishing\n{context}"),
        )
    }
}

/// Runs one input in a fresh worker; `None` when it passes.
pub fn replay(
    target: &Target,
    input: &Value,
    settings: &Settings,
    hang: Duration,
) -> Option<Failure> {
    replay_with_stderr(target, input, settings, hang).0
}

/// [`replay`], and what the worker wrote to stderr.
fn replay_with_stderr(
    target: &Target,
    input: &Value,
    settings: &Settings,
    hang: Duration,
) -> (Option<Failure>, String) {
    std::fs::create_dir_all(&settings.out_dir).expect("create the failures directory");
    static N: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let n = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let file = settings
        .out_dir
        .join(format!(".replay-{}-{n}.json", std::process::id()));
    std::fs::write(&file, input.to_string()).expect("write the replay input");
    let run = run_worker(
        target,
        settings,
        &[("INITIUM_FUZZ_REPLAY_FILE", file.display().to_string())],
        hang,
    );
    let _ = std::fs::remove_file(&file);
    let failure = run
        .died
        .or_else(|| run.failures.into_iter().next().map(|(_, f)| f));
    (failure, run.stderr)
}

/// Greedy shrinking: removes array elements and object fields, halves long arrays and strings,
/// and keeps every change after which the input still fails the same way.
fn shrink(
    target: &Target,
    input: Value,
    failure: &Failure,
    settings: &Settings,
    budget: Duration,
) -> (Value, usize) {
    let deadline = Instant::now() + budget;
    // Replays of time failures stop as soon as the bound is clearly passed.
    let hang = if failure.is_time() {
        settings.case_bound + Duration::from_millis(500)
    } else {
        (settings.case_bound * 2).min(settings.hang)
    };
    let mut best = input;
    let mut accepted = 0;
    'outer: loop {
        for edit in edits(&best) {
            if Instant::now() >= deadline {
                break 'outer;
            }
            let Some(candidate) = apply_edit(&best, &edit) else {
                continue;
            };
            if replay(target, &candidate, settings, hang).is_some_and(|f| f.same_bug(failure)) {
                best = candidate;
                accepted += 1;
                continue 'outer;
            }
        }
        break;
    }
    (best, accepted)
}

#[derive(Clone, Debug)]
enum Step {
    Key(String),
    Index(usize),
}

#[derive(Debug)]
enum Edit {
    Remove(Vec<Step>),
    KeepHalf(Vec<Step>, bool),
    Truncate(Vec<Step>),
}

/// Candidate edits, biggest first (breadth-first from the root).
fn edits(v: &Value) -> Vec<Edit> {
    let mut out = Vec::new();
    let mut queue = std::collections::VecDeque::from([(Vec::<Step>::new(), v)]);
    while let Some((path, node)) = queue.pop_front() {
        if out.len() > 4000 {
            break;
        }
        match node {
            Value::Array(items) => {
                if items.len() >= 4 {
                    out.push(Edit::KeepHalf(path.clone(), true));
                    out.push(Edit::KeepHalf(path.clone(), false));
                }
                for (i, item) in items.iter().enumerate() {
                    let mut p = path.clone();
                    p.push(Step::Index(i));
                    out.push(Edit::Remove(p.clone()));
                    queue.push_back((p, item));
                }
            }
            Value::Object(map) => {
                for (k, item) in map {
                    let mut p = path.clone();
                    p.push(Step::Key(k.clone()));
                    out.push(Edit::Remove(p.clone()));
                    queue.push_back((p, item));
                }
            }
            Value::String(s) if s.chars().count() > 16 => out.push(Edit::Truncate(path)),
            _ => {}
        }
    }
    out
}

fn node_mut<'a>(v: &'a mut Value, path: &[Step]) -> Option<&'a mut Value> {
    path.iter().try_fold(v, |cur, step| match step {
        Step::Key(k) => cur.get_mut(k.as_str()),
        Step::Index(i) => cur.get_mut(*i),
    })
}

fn apply_edit(v: &Value, edit: &Edit) -> Option<Value> {
    let mut out = v.clone();
    match edit {
        Edit::Remove(path) => {
            let (last, parent) = path.split_last()?;
            match (node_mut(&mut out, parent)?, last) {
                (Value::Object(map), Step::Key(k)) => {
                    map.remove(k)?;
                }
                (Value::Array(items), Step::Index(i)) if *i < items.len() => {
                    items.remove(*i);
                }
                _ => return None,
            }
        }
        Edit::KeepHalf(path, first) => {
            let Value::Array(items) = node_mut(&mut out, path)? else {
                return None;
            };
            let half = items.len() / 2;
            if *first {
                items.truncate(half);
            } else {
                items.drain(..half);
            }
        }
        Edit::Truncate(path) => {
            let Value::String(s) = node_mut(&mut out, path)? else {
                return None;
            };
            let n = s.chars().count() / 2;
            *s = s.chars().take(n).collect();
        }
    }
    Some(out)
}

fn fnv(s: &str) -> u32 {
    s.bytes().fold(0x811c_9dc5u32, |h, b| {
        (h ^ b as u32).wrapping_mul(0x0100_0193)
    })
}

/// Runs `target` from case 0 of `seed` for `duration` or `max_cases`, restarting the worker
/// after every death; writes a (shrunk) reproducer for each distinct failure.
pub fn campaign(
    target: &'static Target,
    seed: u64,
    duration: Duration,
    max_cases: u64,
    settings: &Settings,
) -> Report {
    let started = Instant::now();
    let mut report = Report {
        target: target.name,
        seed,
        cases: 0,
        elapsed: Duration::ZERO,
        failures: 0,
        found: Vec::new(),
    };
    let mut failing: Vec<(u64, Failure)> = Vec::new();
    let mut next = 0;
    while report.cases < max_cases && started.elapsed() < duration {
        let remaining = duration.saturating_sub(started.elapsed());
        let run = run_worker(
            target,
            settings,
            &[
                ("INITIUM_FUZZ_SEED", seed.to_string()),
                ("INITIUM_FUZZ_START", next.to_string()),
                ("INITIUM_FUZZ_MS", remaining.as_millis().max(1).to_string()),
                ("INITIUM_FUZZ_MAX", (max_cases - report.cases).to_string()),
            ],
            settings.hang,
        );
        report.cases += run.cases;
        failing.extend(run.failures);
        if run.ended {
            break;
        }
        let Some(at) = run.started else {
            failing.push((
                next,
                run.died
                    .unwrap_or_else(|| Failure::new("crash", "the worker did not start")),
            ));
            break;
        };
        if let Some(died) = run.died {
            eprintln!(
                "fuzz {}: case {at} (seed {seed}): {}",
                target.name, died.class
            );
            failing.push((at, died));
        }
        next = at + 1;
    }
    report.elapsed = started.elapsed();
    report.failures = failing.len() as u64;

    let mut per_signature: HashMap<String, usize> = HashMap::new();
    let shrink_deadline = Instant::now() + settings.shrink * 4;
    for (case, failure) in failing {
        let signature = failure.signature();
        let seen = per_signature.entry(signature.clone()).or_default();
        *seen += 1;
        if *seen > settings.reproducers {
            continue;
        }
        let generate = || (target.generate)(&mut Rng::new(Rng::case_seed(seed, case)));
        let input = if failure.class == "generator" {
            Value::Null
        } else {
            catch_unwind(generate).unwrap_or_default()
        };
        let budget = settings
            .shrink
            .min(shrink_deadline.saturating_duration_since(Instant::now()));
        let (small, steps) = shrink(target, input, &failure, settings, budget);
        let name = format!(
            "{}-{}-{:08x}{}.json",
            target.name,
            failure.class,
            fnv(&signature),
            if *seen > 1 {
                format!("-{seen}")
            } else {
                String::new()
            }
        );
        let path = settings.out_dir.join(name);
        let doc = json!({
            "target": target.name,
            "seed": seed,
            "case": case,
            "class": failure.class,
            "message": failure.message,
            "shrinkSteps": steps,
            "replay": format!("scripts/fuzz --replay {}", path.display()),
            "input": small,
        });
        std::fs::create_dir_all(&settings.out_dir).expect("create the failures directory");
        std::fs::write(
            &path,
            serde_json::to_string_pretty(&doc).expect("json") + "\n",
        )
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        eprintln!(
            "FAIL fuzz {} seed {seed} case {case}: {}: {}\n  reproducer: {}",
            target.name,
            failure.class,
            cut(&failure.message),
            path.display()
        );
        report.found.push(Found {
            failure,
            case,
            path,
        });
    }
    report
}

/// `scripts/fuzz --replay FILE`: runs a reproducer again; fails while it still fails.
pub fn replay_main(path: &str) {
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{path}: {e}"));
    let doc: Value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{path}: {e}"));
    let name = doc["target"].as_str().unwrap_or_default();
    let target = targets::target(name).unwrap_or_else(|| panic!("{path}: no fuzz target {name:?}"));
    let settings = Settings::from_env();
    let (failure, stderr) = replay_with_stderr(target, &doc["input"], &settings, settings.hang);
    if std::env::var_os("INITIUM_FUZZ_VERBOSE").is_some() {
        eprint!("{stderr}");
    }
    match failure {
        None => println!("replay {path}: passes"),
        Some(f) => panic!("replay {path}: still fails: {}: {}", f.class, f.message),
    }
}

/// The `campaign` test: `scripts/fuzz` sets the environment.
pub fn campaign_main() {
    if let Ok(path) = std::env::var("INITIUM_FUZZ_REPLAY") {
        return replay_main(&path);
    }
    let Ok(which) = std::env::var("INITIUM_FUZZ_TARGET") else {
        eprintln!("the fuzz campaign runs only from scripts/fuzz (INITIUM_FUZZ_TARGET unset)");
        return;
    };
    let names: Vec<&str> = if which == "all" {
        vec!["reviews", "rules", "cli"]
    } else {
        which.split(',').collect()
    };
    let targets: Vec<&'static Target> = names
        .iter()
        .map(|n| targets::target(n).unwrap_or_else(|| panic!("no fuzz target {n:?}")))
        .collect();
    let seed = std::env::var("INITIUM_FUZZ_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| {
            SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map(|d| d.as_nanos() as u64)
                .unwrap_or(1)
        });
    let seconds = env_u64("INITIUM_FUZZ_SECONDS", 600);
    let max_cases = env_u64("INITIUM_FUZZ_CASES", u64::MAX);
    let settings = Settings::from_env();
    println!(
        "fuzz campaign: targets {} seed {seed}, {seconds} s per target, case bound {} ms, memory {} MiB, stack {} KiB",
        names.join(","),
        settings.case_bound.as_millis(),
        settings.memory_mb,
        settings.stack_kb
    );
    let mut failures = 0;
    let mut lines = Vec::new();
    for target in targets {
        let report = campaign(
            target,
            seed,
            Duration::from_secs(seconds),
            max_cases,
            &settings,
        );
        println!("{}", report.summary());
        failures += report.failures;
        lines.push(report.summary());
    }
    println!("\n{}", lines.join("\n"));
    assert!(
        failures == 0,
        "{failures} failing case(s); reproducers above (seed {seed})"
    );
}

/// A short fixed-seed run, for `cargo test`.
pub fn short(name: &str, seed: u64, max_cases: u64) {
    let target = targets::target(name).expect("target");
    let mut settings = Settings::from_env();
    if std::env::var_os("INITIUM_FUZZ_SHRINK_SECONDS").is_none() {
        settings.shrink = Duration::from_secs(10);
    }
    // `cargo test` builds without optimisation, 10 to 30 times slower than release: the
    // 2 s bound is for release builds (scripts/fuzz).
    if std::env::var_os("INITIUM_FUZZ_CASE_MS").is_none() && cfg!(debug_assertions) {
        settings.case_bound = Duration::from_secs(10);
    }
    // A cap for slow machines; the cases are fixed by the seed and the count.
    let seconds = env_u64("INITIUM_FUZZ_SHORT_SECONDS", 60);
    let report = campaign(
        target,
        seed,
        Duration::from_secs(seconds),
        max_cases,
        &settings,
    );
    eprintln!("{}", report.summary());
    assert!(report.cases > 0, "no case ran");
    assert!(
        report.failures == 0,
        "{}\nre-run one with `scripts/fuzz --replay <reproducer>`, all with `scripts/fuzz --target {name} --seed {seed} --cases {max_cases}`",
        report.summary()
    );
}
