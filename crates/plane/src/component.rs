//! `stop-component`, `start-component` and `restart`: faults for tests. One process of a
//! running plane stops (TERM as `down` does, or KILL like a crash) and starts again on the
//! ports it had, with the same data.

use std::path::{Path, PathBuf};
use std::thread::sleep;
use std::time::{Duration, Instant};

use anyhow::{Result, bail};

use crate::launch::{self, Started};
use crate::process::{self, print_log_tail, running};
use crate::settings::{MARKER, NODE_COMPONENTS, Settings};

#[derive(Clone, Copy)]
pub(crate) enum Signal {
    Term,
    Kill,
}

pub(crate) fn parse_signal(value: &str) -> Result<Signal> {
    match value {
        "TERM" => Ok(Signal::Term),
        "KILL" => Ok(Signal::Kill),
        _ => bail!("--signal must be TERM or KILL, not {value}"),
    }
}

/// `--down-for`: seconds, whole or not.
pub(crate) fn parse_down_for(value: &str) -> Result<Duration> {
    let (whole, fraction) = value.split_once('.').unwrap_or((value, "0"));
    let digits = |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit());
    match value.parse::<f64>() {
        Ok(secs) if digits(whole) && digits(fraction) => Ok(Duration::from_secs_f64(secs)),
        _ => bail!("--down-for takes seconds, not {value}"),
    }
}

/// The plane directory (made by `up`) and the component's name, checked.
pub(crate) fn parse(
    settings: &Settings,
    dir: PathBuf,
    component: Option<String>,
) -> Result<(PathBuf, &'static str)> {
    if !dir.join(MARKER).exists() {
        bail!(
            "no control plane made by {} up in {}",
            settings.command,
            dir.display()
        );
    }
    let names = "etcd, kube-apiserver, kube-controller-manager, kube-scheduler or kwok";
    let Some(component) = component else {
        bail!("name the component: {names}");
    };
    if let Some(name) = ["etcd", "kube-apiserver"]
        .into_iter()
        .find(|&name| name == component)
    {
        return Ok((dir, name));
    }
    let Some(name) = NODE_COMPONENTS.into_iter().find(|&name| name == component) else {
        bail!("unknown component: {component} ({names})");
    };
    if !launch::has_nodes(&dir) {
        bail!(
            "the plane in {} has no {name}: it runs only in a plane started with up --nodes N",
            dir.display()
        );
    }
    Ok((dir, name))
}

/// Stops one process of the plane.
pub(crate) fn stop(dir: &Path, name: &str, signal: Signal) {
    match signal {
        Signal::Term => process::stop(dir, name),
        Signal::Kill => process::kill_now(dir, name),
    }
}

/// Starts NAME again on the ports it had, with the same data, and waits until it is healthy.
/// A port another process took meanwhile fails it.
pub(crate) fn start(settings: &Settings, dir: &Path, name: &str) -> Result<()> {
    if let Some(pid) = running(dir, name) {
        bail!("{name} is already running in {} (pid {pid})", dir.display());
    }
    let timeout = settings.timeout()?;
    let deadline = Instant::now() + timeout;
    // The old process's sockets may linger for a moment: retry on "address already in use".
    for attempt in 1..=5 {
        crate::log::log(format_args!("starting {name} again"));
        launch::launch(settings, dir, name)?;
        match launch::wait_healthy(dir, name, deadline, timeout)? {
            Started::Healthy => return Ok(()),
            Started::Failed => {
                print_log_tail(dir, name);
                bail!("{name} did not start again");
            }
            Started::PortTaken => {
                crate::log::log(format_args!("{name}: port still taken (attempt {attempt})"));
                sleep(Duration::from_secs(1));
            }
        }
    }
    print_log_tail(dir, name);
    bail!("{name} could not get its ports back")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn down_for_is_seconds_and_the_signal_term_or_kill() {
        assert_eq!(parse_down_for("0").ok(), Some(Duration::ZERO));
        assert_eq!(
            parse_down_for("1.5").ok(),
            Some(Duration::from_millis(1500))
        );
        for bad in ["", "-1", "1.", ".5", "1e3", "x"] {
            assert!(parse_down_for(bad).is_err(), "{bad}");
        }
        assert!(matches!(parse_signal("KILL"), Ok(Signal::Kill)));
        assert_eq!(
            parse_signal("HUP").err().map(|e| e.to_string()),
            Some("--signal must be TERM or KILL, not HUP".to_owned())
        );
    }
}
