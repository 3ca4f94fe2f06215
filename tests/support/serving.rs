//! `initium serve` beside a control plane (the whole cluster of [`super::workloads`] unless
//! told otherwise), with webhook configurations and a Lease of its own name (so a test
//! binary's tests do not meet each other's), and rules applied and waited for until Ready.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use super::cluster::wait_rule_ready;
use super::plane::Plane;
use super::process::{Initium, InitiumOptions};
use super::unique;
use super::workloads::cluster;

/// One `initium serve` process with webhook configurations and a Lease of its own name.
/// Dropping it stops the process and deletes its webhook configurations: a configuration
/// left behind would point at a dead port, and its validating webhook (failure policy Fail)
/// would reject every rule the next test creates.
pub struct Serving {
    pub initium: Initium,
    pub name: String,
    log: PathBuf,
    plane: &'static Plane,
}

impl Serving {
    pub fn start() -> Serving {
        Serving::start_with(&[])
    }

    /// [`Serving::start`] with more `initium serve` flags.
    pub fn start_with(extra: &[&str]) -> Serving {
        Serving::start_on(cluster(), extra)
    }

    /// [`Serving::start_with`] beside `plane` (e.g. the bare API server, [`Plane::shared`]).
    pub fn start_on(plane: &'static Plane, extra: &[&str]) -> Serving {
        let name = unique("initium-cluster");
        let log = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!("{name}.log"));
        let initium = Initium::start(plane, Serving::options(&name, &log, extra))
            .unwrap_or_else(|e| panic!("{e:#}"));
        Serving {
            initium,
            name,
            log,
            plane,
        }
    }

    /// A second replica of the same deployment: the same namespace, webhook configurations
    /// and Lease, its own ports and log.
    pub fn replica(&self, extra: &[&str]) -> Initium {
        let log = self.log.with_extension("replica.log");
        Initium::start(self.plane, Serving::options(&self.name, &log, extra))
            .unwrap_or_else(|e| panic!("{e:#}"))
    }

    fn options(name: &str, log: &std::path::Path, extra: &[&str]) -> InitiumOptions {
        let mut args: Vec<String> = ["--webhook-name", name, "--lease-name", name]
            .map(String::from)
            .to_vec();
        args.extend(extra.iter().map(|s| s.to_string()));
        InitiumOptions {
            namespace: name.to_owned(),
            extra: args,
            cpus: None,
            log: log.to_owned(),
        }
    }

    /// SIGKILL, as a crash would end it: its webhook configurations stay registered.
    pub fn kill(&mut self) {
        self.initium.kill();
    }

    /// Starts it again on the ports it had (so the registered configuration reaches it, with
    /// the CA it keeps in its Secret) and waits until it is ready.
    pub fn restart(&mut self) {
        let (webhook, ops): (SocketAddr, SocketAddr) = (self.initium.webhook, self.initium.ops);
        let options = Serving::options(&self.name, &self.log, &[]);
        self.initium =
            Initium::spawn(self.plane, &options, webhook, ops).unwrap_or_else(|e| panic!("{e:#}"));
        self.initium
            .wait_ready(Duration::from_secs(180))
            .unwrap_or_else(|e| panic!("{e:#}"));
    }
}

impl Drop for Serving {
    fn drop(&mut self) {
        self.initium.kill();
        for kind in [
            "mutatingwebhookconfiguration",
            "validatingwebhookconfiguration",
        ] {
            let _ = self
                .plane
                .kubectl()
                .args(["delete", kind, &self.name, "--ignore-not-found"])
                .output();
        }
    }
}

/// Applies a rule and waits until its status says the current generation is Ready.
pub async fn apply_rule(client: &kube::Client, namespace: &str, name: &str, yaml: &str) {
    cluster().apply(yaml).unwrap_or_else(|e| panic!("{e:#}"));
    wait_rule_ready(
        client,
        "MutationRule",
        Some(namespace),
        name,
        Duration::from_secs(60),
    )
    .await;
}
