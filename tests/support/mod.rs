//! What the integration tests and the benchmarks share: a real Kubernetes control plane, the
//! CRDs on it, `initium serve` as a process, waiting, one-at-a-time tests, and the workload.
//!
//! Tests use it with `mod support;`, benchmarks with
//! `#[path = "../tests/support/mod.rs"] mod support;`; each uses a part, hence
//! `allow(dead_code)`. By topic:
//!
//! - [`plane`]: the control plane ([`Plane::shared`] for a test binary, started on first use
//!   and stopped when the binary exits, or `INITIUM_TEST_KUBECONFIG`; [`Plane::up`] for a
//!   plane of one's own), kubectl and a client for it, and helm (no cluster needed);
//! - [`cluster`]: unique names and namespaces, `crds/` installed and Established, rules
//!   applied until Ready, Lease holders, and [`cluster::Cleanup`] of what a test created;
//! - [`commands`]: kubectl on the shared plane, `kubectl auth can-i`, `scripts/ops-check`,
//!   a command fed on its stdin;
//! - [`wait`]: `eventually` and its blocking forms;
//! - [`process`]: `initium serve` as a process, free ports, `/metrics`, `/mutate`;
//! - [`workloads`]: a whole cluster (`up --nodes 3`: controller manager, scheduler, kwok
//!   nodes) for a test binary, and waits for Deployments, Jobs, Pods and endpoints;
//! - [`serving`]: `initium serve` beside the whole cluster, and rules applied until Ready;
//! - [`direct`]: initium's webhook called straight (HTTPS, `Server-Timing`), a process's CPU
//!   time and resident set;
//! - [`https`]: a self-signed certificate for `localhost`, and a TLS client trusting it;
//! - [`serial`]: the one guard that runs a binary's tests one at a time;
//! - [`fixtures`]: the Pod and rules the benchmarks measure;
//! - [`measure`]: memory, latency percentiles, the machine.
//!
//! Tests panic with a message on failure; what the benchmarks call returns errors instead,
//! which they print from `main`.
#![allow(dead_code, unused_imports)]

pub mod cluster;
pub mod commands;
pub mod direct;
pub mod fixtures;
pub mod https;
pub mod measure;
pub mod plane;
pub mod process;
pub mod serial;
pub mod serving;
pub mod wait;
pub mod workloads;

pub use self::cluster::{install_crds, namespace, unique};
pub use self::plane::{Plane, client, control_plane_script, helm, kubeconfig_path, kubectl, root};
pub use self::process::post_review;
pub use self::serial::{serial, serial_blocking};
pub use self::wait::{eventually, eventually_blocking};
