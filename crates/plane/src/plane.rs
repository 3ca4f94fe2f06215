//! A plane in its directory: `up`, `down`, `env`, `status` and the watchdog, and how etcd
//! and kube-apiserver are launched and probed.

use std::fmt::Write as _;
use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::process::ExitCode;
use std::thread::sleep;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};

use crate::launch::{
    self, Started, has_nodes, read_port, save_extra_args, wait_healthy, write_file,
    write_kubeconfig,
};
use crate::log::{log, set_quiet};
use crate::process::{self, WATCHDOG, alive, free_ports, print_log_tail, read_pid, running};
use crate::settings::{
    ETCD_VERSION, FORWARD, MARKER, NODE_COMPONENTS, REAL_NODE, Settings, VERSION_FILE,
    kubelet_release, var,
};
use crate::{build, nodes, pki, realnode};

/// The logs of a real node's processes (DIR/NAME.log).
const REAL_NODE_LOGS: [&str; 4] = [FORWARD, REAL_NODE, "containerd", "kubelet"];

/// Who the watchdog watches: "PID START-TIME" of the process whose exit takes the plane
/// down. While `up` runs, `up` itself (a Ctrl-C or a kill during startup leaves nothing
/// behind); afterwards the `--owner-pid`, or no file at all (the plane stays until `down`,
/// and the watchdog exits).
const OWNER: &str = "watchdog.owner";

/// `--nodes N`: 1 or more.
pub(crate) fn parse_nodes(value: &str) -> Result<u32> {
    match value.parse::<u32>() {
        Ok(n) if n >= 1 && !value.starts_with(['+', '0']) => Ok(n),
        _ => bail!("--nodes takes the number of nodes to simulate (1 or more), not '{value}'"),
    }
}

fn plane_running(dir: &Path) -> bool {
    running(dir, "kube-apiserver").is_some() || running(dir, "etcd").is_some()
}

/// Starts NAME on new free ports (one per name in `ports`, written to DIR/PORT.port), three
/// times at most when another process takes a port first.
fn start_on_free_ports(
    settings: &Settings,
    dir: &Path,
    name: &str,
    ports: &[&str],
    deadline: Instant,
    timeout: Duration,
) -> Result<()> {
    for attempt in 1..=3 {
        for (port_name, port) in ports.iter().zip(free_ports(ports.len())?) {
            write_file(&dir.join(format!("{port_name}.port")), &format!("{port}\n"))?;
        }
        if name == "etcd" {
            let _ = std::fs::remove_dir_all(dir.join("etcd-data"));
        }
        launch::launch(settings, dir, name)?;
        match wait_healthy(dir, name, deadline, timeout)? {
            Started::Healthy => return Ok(()),
            Started::Failed => bail!("{name} did not start"),
            Started::PortTaken => {
                log(format_args!(
                    "{name}: port taken, retrying (attempt {attempt})"
                ));
                let log_file = dir.join(format!("{name}.log"));
                let _ =
                    std::fs::rename(&log_file, log_file.with_extension(format!("log.{attempt}")));
            }
        }
    }
    bail!("{name} did not start: its ports were taken three times")
}

/// Refuses to start where etcd cannot write. etcd preallocates a 64 MiB WAL segment and
/// panics with "no space left on device" deep in its log when it cannot; say so before
/// anything starts instead.
fn check_free_space(dir: &Path) -> Result<()> {
    let need = var("INITIUM_PLANE_MIN_FREE_MIB").unwrap_or_else(|| "256".to_owned());
    let Some(need_mib) = need
        .bytes()
        .all(|b| b.is_ascii_digit())
        .then(|| need.parse::<u64>().ok())
        .flatten()
    else {
        bail!("INITIUM_PLANE_MIN_FREE_MIB is a number of MiB, not '{need}'");
    };
    // DIR may not exist yet: ask about the closest directory that does.
    let Some(at) = dir.ancestors().find(|at| at.is_dir()) else {
        return Ok(());
    };
    let Ok(stat) = rustix::fs::statvfs(at) else {
        return Ok(());
    };
    let free = stat.f_bavail.saturating_mul(stat.f_frsize) / (1024 * 1024);
    if free < need_mib {
        bail!(
            "only {free} MiB are free on the file system of {}, and a control plane needs at least {need_mib} MiB (etcd preallocates a 64 MiB write-ahead log); free some space there, or choose another --dir",
            dir.display()
        );
    }
    Ok(())
}

/// "PID START-TIME" of a running process, for the watchdog.
fn owner_line(pid: u32) -> Result<String> {
    let start = process::start_time(pid).with_context(|| format!("pid {pid} is not running"))?;
    Ok(format!("{pid} {start}\n"))
}

/// The command `up`.
pub(crate) fn up(
    settings: &Settings,
    dir: &Path,
    owner: Option<&str>,
    nodes: Option<u32>,
    real_node: bool,
) -> Result<()> {
    let start = Instant::now();
    // A real node needs the controller manager and the scheduler (Deployments, scheduling):
    // a plane with nodes, kwok managing none when --nodes is not given.
    let nodes = if real_node {
        Some(nodes.unwrap_or(0))
    } else {
        nodes
    };
    let owner = match owner {
        None => None,
        Some(value) => match value.parse::<u32>() {
            Ok(pid) if alive(pid) => Some(pid),
            _ => bail!("--owner-pid {value} is not a running process"),
        },
    };
    let shown = dir.display();
    if dir.exists() && !dir.is_dir() {
        bail!("{shown} exists and is not a directory; choose another --dir");
    }
    if dir.is_dir() {
        if plane_running(dir) {
            bail!(
                "a control plane is already running in {shown} (stop it with: {} down --dir {shown})",
                settings.command
            );
        }
        if dir.join(MARKER).exists() {
            log(format_args!(
                "removing leftovers of a stopped plane in {shown}"
            ));
            down(settings, dir)?;
        } else if std::fs::read_dir(dir)
            .with_context(|| format!("cannot read {shown}"))?
            .next()
            .is_some()
        {
            bail!("{shown} exists and is not empty; refusing to use it");
        }
    }
    if !build::have_binaries(settings)
        || (nodes.is_some() && !build::have_node_binaries(settings))
        || (real_node && !build::have_real_node_binaries(settings))
    {
        build::build(settings, nodes.is_some(), false, real_node)?;
    }
    let timeout = settings.timeout()?;
    check_free_space(dir)?;
    std::fs::create_dir_all(dir).with_context(|| format!("cannot create {shown}"))?;
    std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700))?;
    write_file(&dir.join(MARKER), "")?;

    // From here on, a failure tears down what was started; so does the watchdog if this
    // process dies first (Ctrl-C, a kill).
    let started = process::write_atomically(&dir.join(OWNER), &owner_line(std::process::id())?)
        .and_then(|()| process::spawn(dir, WATCHDOG, process::watchdog_command(dir)?))
        .and_then(|_| start_plane(settings, dir, nodes, real_node, timeout))
        .and_then(|()| match owner {
            Some(pid) => process::write_atomically(&dir.join(OWNER), &owner_line(pid)?),
            None => Ok(std::fs::remove_file(dir.join(OWNER))?),
        });
    if let Err(error) = started {
        log(format_args!("error: {error:#}"));
        let mut names = vec!["etcd", "kube-apiserver"];
        names.extend(NODE_COMPONENTS);
        names.extend(REAL_NODE_LOGS);
        names.push(WATCHDOG);
        for name in names {
            print_log_tail(dir, name);
        }
        set_quiet(true);
        let _ = down(settings, dir);
        set_quiet(false);
        bail!("starting the control plane in {shown} failed");
    }

    let apiserver = read_port(dir, "kube-apiserver")?;
    let etcd = read_port(dir, "etcd")?;
    log(format_args!(
        "up in {}s: kube-apiserver https://127.0.0.1:{apiserver}, etcd http://127.0.0.1:{etcd}",
        start.elapsed().as_secs()
    ));
    if let Some(n) = nodes {
        log(format_args!(
            "with kube-controller-manager, kube-scheduler and {n} node(s) simulated by kwok"
        ));
    }
    if real_node {
        log(format_args!(
            "with the real node {} (containerd, runc, kubelet {})",
            realnode::NODE_NAME,
            kubelet_release().version
        ));
    }
    if let Some(pid) = owner {
        log(format_args!("it stops by itself when pid {pid} exits"));
    }
    let mut logs = format!(
        "{}/etcd.log {}/kube-apiserver.log",
        dir.display(),
        dir.display()
    );
    if nodes.is_some() {
        for name in NODE_COMPONENTS {
            let _ = write!(logs, " {}/{name}.log", dir.display());
        }
    }
    if real_node {
        for name in REAL_NODE_LOGS {
            let _ = write!(logs, " {}/{name}.log", dir.display());
        }
    }
    let mut with_nodes = nodes
        .filter(|&n| n > 0)
        .map_or_else(String::new, |n| format!(" with {n} simulated node(s)"));
    if real_node {
        with_nodes += if with_nodes.is_empty() {
            " with"
        } else {
            " and"
        };
        with_nodes += &format!(" the real node {}", realnode::NODE_NAME);
    }
    let command = &settings.command;
    print!(
        "Control plane running in {shown}{with_nodes}
  kubeconfig: {shown}/kubeconfig
  logs:       {logs}
Use it with:
  eval \"$({command} env --dir {shown})\"
Stop it with:
  {command} down --dir {shown}
"
    );
    Ok(())
}

/// Certificates, etcd, kube-apiserver, and with `nodes` the rest of a cluster.
fn start_plane(
    settings: &Settings,
    dir: &Path,
    nodes: Option<u32>,
    real_node: bool,
    timeout: Duration,
) -> Result<()> {
    // What `env`, `start-component` and the rest run on this plane.
    write_file(
        &dir.join(VERSION_FILE),
        &format!("{}\n", settings.release.version),
    )?;
    // Before kube-apiserver starts: it reads whether the plane has nodes, and a real one.
    if let Some(n) = nodes {
        write_file(&dir.join("nodes"), &format!("{n}\n"))?;
    }
    if real_node {
        realnode::prepare(dir)?;
    }
    pki::generate(dir, nodes.is_some(), real_node)?;
    let deadline = Instant::now() + timeout;
    log(format_args!("starting etcd {ETCD_VERSION}"));
    start_on_free_ports(
        settings,
        dir,
        "etcd",
        &["etcd", "etcd-peer"],
        deadline,
        timeout,
    )?;
    log(format_args!(
        "starting kube-apiserver {}",
        settings.release.version
    ));
    // start-component starts kube-apiserver again with the same flags.
    save_extra_args(dir, "kube-apiserver")?;
    start_on_free_ports(
        settings,
        dir,
        "kube-apiserver",
        &["kube-apiserver"],
        deadline,
        timeout,
    )?;
    write_kubeconfig(dir, read_port(dir, "kube-apiserver")?, None)?;
    if let Some(n) = nodes {
        nodes::start(settings, dir, n, timeout)?;
    }
    if real_node {
        realnode::write_kubelet_kubeconfig(dir)?;
        realnode::start(settings, dir, timeout)?;
    }
    Ok(())
}

/// The command `down`: stops what `up` started in DIR, in order, and removes DIR.
pub(crate) fn down(settings: &Settings, dir: &Path) -> Result<()> {
    let shown = dir.display();
    if !dir.is_dir() {
        log(format_args!("no control plane in {shown}"));
        return Ok(());
    }
    if !dir.join(MARKER).exists() {
        bail!(
            "{shown} was not created by {} up; not touching it",
            settings.command
        );
    }
    // The watchdog first, so that it does not race with us; then the API server's clients
    // before the API server (the real node first: its Pods' processes), and etcd last.
    process::stop(dir, WATCHDOG);
    let node = realnode::stop(dir);
    for name in [
        "kwok",
        "kube-scheduler",
        "kube-controller-manager",
        "kube-apiserver",
        "etcd",
    ] {
        process::stop(dir, name);
    }
    node?;
    std::fs::remove_dir_all(dir).with_context(|| format!("cannot remove {shown}"))?;
    log(format_args!("stopped; removed {shown}"));
    Ok(())
}

/// `s` as one word for a POSIX shell.
fn shell_quote(s: &str) -> String {
    let safe = |c: char| c.is_ascii_alphanumeric() || "_./:=@%+,-".contains(c);
    if !s.is_empty() && s.chars().all(safe) {
        s.to_owned()
    } else {
        format!("'{}'", s.replace('\'', r"'\''"))
    }
}

/// The command `env`: lines for `eval`.
pub(crate) fn env(settings: &Settings, dir: &Path) -> Result<()> {
    if !plane_running(dir) {
        bail!(
            "no control plane is running in {shown} (start one with: {} up --dir {shown})",
            settings.command,
            shown = dir.display()
        );
    }
    let kubeconfig = dir.join("kubeconfig");
    println!(
        "export KUBECONFIG={}",
        shell_quote(&kubeconfig.display().to_string())
    );
    println!(
        "export PATH={}:\"$PATH\"",
        shell_quote(&settings.bin_dir.display().to_string())
    );
    Ok(())
}

/// The command `status`: which processes run; failure if one of the plane's does not.
pub(crate) fn status(_settings: &Settings, dir: &Path) -> Result<ExitCode> {
    let mut names = vec!["etcd", "kube-apiserver"];
    if has_nodes(dir) {
        names.extend(NODE_COMPONENTS);
    }
    if launch::is_real_node(dir) {
        names.extend([FORWARD, REAL_NODE]);
    }
    names.push(WATCHDOG);
    let mut code = ExitCode::SUCCESS;
    for name in names {
        match running(dir, name) {
            Some(pid) => println!("{name}: running (pid {pid})"),
            None if name != WATCHDOG => {
                println!("{name}: not running");
                code = ExitCode::FAILURE;
            }
            None => {}
        }
    }
    Ok(code)
}

/// The watchdog (`_watchdog --dir DIR`): runs `down` once the process in DIR/watchdog.owner
/// has exited (or another process got its pid); exits when the file goes away or the plane
/// is stopped by someone else.
pub(crate) fn watchdog(settings: &Settings, dir: &Path) -> Result<()> {
    let owner = loop {
        if !dir.join(MARKER).exists() {
            return Ok(()); // stopped by someone else
        }
        let line = std::fs::read_to_string(dir.join(OWNER)).unwrap_or_default();
        let mut fields = line.split_whitespace().map(str::parse::<u64>);
        let (Some(Ok(pid)), Some(Ok(start))) = (fields.next(), fields.next()) else {
            // No owner: the plane runs until `down`.
            if read_pid(dir, WATCHDOG) == Some(std::process::id()) {
                let _ = std::fs::remove_file(dir.join(format!("{WATCHDOG}.pid")));
            }
            return Ok(());
        };
        let Ok(pid) = u32::try_from(pid) else {
            return Ok(());
        };
        if !alive(pid) || process::start_time(pid) != Some(start) {
            // `up` hands the plane over (or lets it go) before it exits: whether it did is in
            // the file now, not in what was read before it exited.
            if std::fs::read_to_string(dir.join(OWNER)).unwrap_or_default() == line {
                break pid;
            }
            continue;
        }
        sleep(Duration::from_secs(1));
    };
    log(format_args!(
        "owner pid {owner} exited; stopping the control plane"
    ));
    down(settings, dir)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn env_lines_quote_what_a_shell_would_split() {
        assert_eq!(shell_quote("/tmp/x-1/kubeconfig"), "/tmp/x-1/kubeconfig");
        assert_eq!(shell_quote("/tmp/a b"), "'/tmp/a b'");
        assert_eq!(shell_quote("/tmp/it's"), r"'/tmp/it'\''s'");
        assert_eq!(shell_quote("/tmp/$x"), "'/tmp/$x'");
    }

    #[test]
    fn nodes_is_a_positive_number() {
        assert_eq!(parse_nodes("3").ok(), Some(3));
        for bad in ["0", "-1", "x", "", "01", "+2"] {
            let error = parse_nodes(bad).err().map(|e| e.to_string());
            assert_eq!(
                error,
                Some(format!(
                    "--nodes takes the number of nodes to simulate (1 or more), not '{bad}'"
                ))
            );
        }
    }
}
