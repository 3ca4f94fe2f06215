//! The plane's processes: started detached with their pid in DIR/NAME.pid, and signalled only
//! after `/proc` confirms that a recorded pid still is the program started for DIR (pids are
//! reused).

use std::ffi::OsStr;
use std::fs::{File, OpenOptions};
use std::io::{Read, Seek, SeekFrom};
use std::net::{Ipv4Addr, TcpListener};
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{Command, Stdio};
use std::thread::sleep;
use std::time::Duration;

use anyhow::{Context, Result};
use rustix::process::{Pid, Signal};

use crate::log::log;
use crate::settings::{FORWARD, FORWARD_ARG, REAL_NODE};

/// The name `pid_matches` knows the watchdog by: this binary, run as `_watchdog`.
pub(crate) const WATCHDOG: &str = "watchdog";
const WATCHDOG_ARG: &str = "_watchdog";

/// After `) ` in /proc/PID/stat: the fields from the state on (the command name before it
/// may hold spaces and parentheses).
fn stat_fields(pid: u32) -> Option<Vec<String>> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let (_, rest) = stat.rsplit_once(") ")?;
    Some(rest.split_whitespace().map(str::to_owned).collect())
}

/// The process exists and is not a zombie.
pub(crate) fn alive(pid: u32) -> bool {
    stat_fields(pid)
        .and_then(|fields| fields.first().cloned())
        .is_some_and(|state| state != "Z" && state != "X")
}

/// The start time in clock ticks since boot: it tells a process from a later one that got
/// the same pid.
pub(crate) fn start_time(pid: u32) -> Option<u64> {
    stat_fields(pid)?.get(19)?.parse().ok()
}

/// PID runs the program called NAME with DIR somewhere in its command line: it is the
/// process this plane started.
pub(crate) fn matches(pid: u32, name: &str, dir: &Path) -> bool {
    if !alive(pid) {
        return false;
    }
    let Ok(cmdline) = std::fs::read(format!("/proc/{pid}/cmdline")) else {
        return false;
    };
    let args: Vec<&OsStr> = cmdline
        .split(|&b| b == 0)
        .filter(|arg| !arg.is_empty())
        .map(<OsStr as std::os::unix::ffi::OsStrExt>::from_bytes)
        .collect();
    let Some(program) = args.first().map(|a| Path::new(a).file_name()) else {
        return false;
    };
    let program_is = |expected: &str| program == Some(OsStr::new(expected));
    let this_program_as =
        |arg: &str| program_is(env!("CARGO_PKG_NAME")) && args.get(1) == Some(&OsStr::new(arg));
    let is_program = match name {
        WATCHDOG => this_program_as(WATCHDOG_ARG),
        FORWARD => this_program_as(FORWARD_ARG),
        // util-linux `unshare`, whose child is PID 1 of the node's PID namespace.
        REAL_NODE => program_is("unshare"),
        _ => program_is(name),
    };
    if !is_program {
        return false;
    }
    let dir = dir.as_os_str().as_encoded_bytes();
    let mut inside = dir.to_vec();
    inside.push(b'/');
    args.iter().any(|arg| {
        let arg = arg.as_encoded_bytes();
        arg == dir || arg.windows(inside.len()).any(|w| w == inside.as_slice())
    })
}

/// The pid recorded in DIR/NAME.pid.
pub(crate) fn read_pid(dir: &Path, name: &str) -> Option<u32> {
    std::fs::read_to_string(dir.join(format!("{name}.pid")))
        .ok()?
        .trim()
        .parse()
        .ok()
}

/// The pid in DIR/NAME.pid, if it is the process this plane started.
pub(crate) fn running(dir: &Path, name: &str) -> Option<u32> {
    read_pid(dir, name).filter(|&pid| matches(pid, name, dir))
}

fn signal(pid: u32, signal: Signal) {
    if let Some(pid) = i32::try_from(pid).ok().and_then(Pid::from_raw) {
        let _ = rustix::process::kill_process(pid, signal);
    }
}

/// Waits up to `tries` × 0.1 s for the process to exit.
fn exits_within(pid: u32, tries: u32) -> bool {
    for _ in 0..tries {
        if !alive(pid) {
            return true;
        }
        sleep(Duration::from_millis(100));
    }
    !alive(pid)
}

/// Stops the process recorded as NAME in DIR: TERM, up to 10 s, then KILL.
pub(crate) fn stop(dir: &Path, name: &str) {
    let Some(pid) = read_pid(dir, name) else {
        return;
    };
    if pid == std::process::id() {
        return; // the watchdog running `down` itself
    }
    if !matches(pid, name, dir) {
        log(format_args!("{name} (pid {pid}) is not running any more"));
        return;
    }
    log(format_args!("stopping {name} (pid {pid})"));
    signal(pid, Signal::TERM);
    if exits_within(pid, 100) {
        return;
    }
    log(format_args!(
        "{name} (pid {pid}) did not exit after 10s, killing it"
    ));
    kill(pid, name);
}

/// Kills the process recorded as NAME in DIR at once, like a crash.
pub(crate) fn kill_now(dir: &Path, name: &str) {
    let Some(pid) = running(dir, name) else {
        return;
    };
    log(format_args!("killing {name} (pid {pid})"));
    kill(pid, name);
}

fn kill(pid: u32, name: &str) {
    signal(pid, Signal::KILL);
    if !exits_within(pid, 50) {
        log(format_args!("warning: {name} (pid {pid}) is still running"));
    }
}

/// Starts `command` detached as NAME of the plane in DIR: in a process group of its own (a
/// Ctrl-C in the terminal that started it does not reach it), stdin from /dev/null, output
/// appended to DIR/NAME.log, its pid in DIR/NAME.pid.
pub(crate) fn spawn(dir: &Path, name: &str, mut command: Command) -> Result<u32> {
    let pid_file = dir.join(format!("{name}.pid"));
    let _ = std::fs::remove_file(&pid_file);
    let log_path = dir.join(format!("{name}.log"));
    let log_file = OpenOptions::new()
        .create(true)
        .append(true)
        .open(&log_path)
        .with_context(|| format!("cannot open {}", log_path.display()))?;
    let child = command
        .stdin(Stdio::null())
        .stdout(log_file.try_clone()?)
        .stderr(log_file)
        .process_group(0)
        .spawn()
        .with_context(|| format!("{name} did not start ({:?})", command.get_program()))?;
    let pid = child.id();
    write_atomically(&pid_file, &format!("{pid}\n"))?;
    Ok(pid)
}

/// Writes FILE under a temporary name, then renames it: a reader sees all of it or nothing.
pub(crate) fn write_atomically(file: &Path, contents: &str) -> Result<()> {
    let mut tmp = file.as_os_str().to_owned();
    tmp.push(format!(".tmp.{}", std::process::id()));
    std::fs::write(&tmp, contents)
        .with_context(|| format!("cannot write {}", Path::new(&tmp).display()))?;
    std::fs::rename(&tmp, file).with_context(|| format!("cannot write {}", file.display()))
}

/// N distinct TCP ports on 127.0.0.1 that are free right now.
pub(crate) fn free_ports(n: usize) -> Result<Vec<u16>> {
    // All bound at once, so that they differ.
    let listeners = (0..n)
        .map(|_| TcpListener::bind((Ipv4Addr::LOCALHOST, 0)))
        .collect::<std::io::Result<Vec<_>>>()
        .context("cannot find a free port on 127.0.0.1")?;
    listeners
        .iter()
        .map(|l| Ok(l.local_addr()?.port()))
        .collect()
}

/// The process died with "address already in use" in its log: another process took its port
/// between `free_ports` and its start (try other ports).
pub(crate) fn port_was_taken(log: &Path) -> bool {
    std::fs::read_to_string(log)
        .is_ok_and(|text| text.to_ascii_lowercase().contains("address already in use"))
}

/// The last 30 lines of DIR/NAME.log on stderr, if it has any.
pub(crate) fn print_log_tail(dir: &Path, name: &str) {
    let path = dir.join(format!("{name}.log"));
    let Ok(mut file) = File::open(&path) else {
        return;
    };
    // The end is enough: a log of a long run can be large.
    let len = file.metadata().map_or(0, |m| m.len());
    if len == 0 {
        return;
    }
    let _ = file.seek(SeekFrom::Start(len.saturating_sub(64 * 1024)));
    let mut bytes = Vec::new();
    if file.read_to_end(&mut bytes).is_err() {
        return;
    }
    let text = String::from_utf8_lossy(&bytes);
    let lines: Vec<&str> = text.lines().collect();
    log(format_args!("---- last lines of {} ----", path.display()));
    for line in &lines[lines.len().saturating_sub(30)..] {
        eprintln!("{line}");
    }
    log("----");
}

/// `program` is on PATH.
pub(crate) fn on_path(program: &str) -> bool {
    std::env::var_os("PATH").is_some_and(|path| {
        std::env::split_paths(&path).any(|dir| {
            std::fs::metadata(dir.join(program)).is_ok_and(|m| {
                use std::os::unix::fs::PermissionsExt;
                m.is_file() && m.permissions().mode() & 0o111 != 0
            })
        })
    })
}

/// The arguments of `WATCHDOG_ARG` for the plane in DIR.
pub(crate) fn watchdog_command(dir: &Path) -> Result<Command> {
    let exe = std::env::current_exe().context("cannot find this program to start the watchdog")?;
    let mut command = Command::new(exe);
    command.arg(WATCHDOG_ARG).arg("--dir").arg(dir);
    Ok(command)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn this_process_is_alive_with_a_start_time_and_a_made_up_pid_is_not() {
        let me = std::process::id();
        assert!(alive(me));
        assert!(start_time(me).is_some());
        assert!(!alive(u32::MAX));
        assert_eq!(start_time(u32::MAX), None);
    }

    #[test]
    fn free_ports_differ() {
        let ports = free_ports(3).unwrap();
        assert_eq!(ports.len(), 3);
        assert!(ports[0] != ports[1] && ports[1] != ports[2] && ports[0] != ports[2]);
    }

    #[test]
    fn a_process_matches_only_with_its_name_and_its_directory() {
        let dir = std::env::temp_dir().join(format!("plane-matches-{}", std::process::id()));
        // `cat - DIR/x` waits on its stdin first: a process with DIR in its command line.
        let mut child = Command::new("cat")
            .arg("-")
            .arg(dir.join("x"))
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let pid = child.id();
        // Right after the fork, /proc shows this test's command line until `cat` is exec'd.
        let until = std::time::Instant::now() + std::time::Duration::from_secs(5);
        let mut seen = matches(pid, "cat", &dir);
        while !seen && std::time::Instant::now() < until {
            std::thread::sleep(std::time::Duration::from_millis(10));
            seen = matches(pid, "cat", &dir);
        }
        let wrong_name = matches(pid, "etcd", &dir);
        let wrong_dir = matches(pid, "cat", &dir.with_extension("other"));
        let prefix_only = matches(pid, "cat", Path::new(&format!("{}x", dir.display())));
        let _ = child.kill();
        let _ = child.wait();
        assert!(seen);
        assert!(!wrong_name);
        assert!(!wrong_dir);
        assert!(!prefix_only);
        assert!(
            !matches(pid, "cat", &dir),
            "a reaped process matches nothing"
        );
    }
}
