//! `scripts/control-plane`: a throwaway Kubernetes control plane (etcd + kube-apiserver) for
//! tests and local development, built from Go modules; with `--nodes N`, a whole cluster:
//! also kube-controller-manager, kube-scheduler and kwok simulating N nodes. See
//! docs/control-plane.md. `scripts/control-plane` runs this binary with its arguments.

mod build;
mod component;
mod forward;
mod image;
mod launch;
mod log;
mod nodes;
mod oci;
mod pki;
mod plane;
mod probe;
mod process;
mod realnode;
mod settings;

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};

use crate::log::{log, set_quiet};
use crate::settings::Settings;

const USAGE: &str = "\
A throwaway Kubernetes control plane (etcd + kube-apiserver) for tests and
local development, built from Go modules; with --nodes N, a whole cluster:
also kube-controller-manager, kube-scheduler and kwok simulating N nodes.
See docs/control-plane.md.

  scripts/control-plane build [--nodes] [--helm] [--real-node] [--all]
                                              build (or reuse) the binaries; --nodes also those
                                              of a cluster with nodes, --helm also helm (for the
                                              chart's tests), --real-node also the kubelet,
                                              containerd, runc and the CNI plugins, --all all
  scripts/control-plane up [--dir DIR] [--owner-pid PID] [--nodes N] [--real-node]
                                              --real-node: also one node whose kubelet runs
                                              real containers (root; see docs/control-plane.md)
  scripts/control-plane image [--dir DIR] [--binary PATH] [--out DIR]
                                              build initium:dev and toolbox:dev as OCI archives
                                              (scripts/image); import them into a running real
                                              node
  scripts/control-plane env [--dir DIR]       eval \"$(scripts/control-plane env)\"
  scripts/control-plane status [--dir DIR]
  scripts/control-plane down [--dir DIR]
  scripts/control-plane stop-component [--dir DIR] [--signal TERM|KILL] COMPONENT
  scripts/control-plane start-component [--dir DIR] COMPONENT
                                              stop one process of a running plane, start it again
                                              (same ports, same data): fault tests
  scripts/control-plane restart [--dir DIR] [--signal TERM|KILL] [--down-for SECONDS] COMPONENT
                                              COMPONENT: etcd, kube-apiserver, and with --nodes
                                              kube-controller-manager, kube-scheduler, kwok
  scripts/control-plane bin-dir               print the binary directory
";

#[derive(Parser)]
#[command(
    name = "control-plane",
    override_usage = "scripts/control-plane COMMAND [ARGS]",
    before_help = USAGE,
    disable_help_subcommand = true
)]
struct Cli {
    #[command(subcommand)]
    command: Option<Command>,
}

/// `--dir DIR`: where the plane keeps its processes' pids, logs, certificates and data.
#[derive(clap::Args)]
struct DirArg {
    /// The plane's directory [default: $INITIUM_PLANE_DIR, or $TMPDIR/initium-plane-UID]
    #[arg(long)]
    dir: Option<PathBuf>,
}

#[derive(clap::Args)]
struct ComponentArgs {
    #[command(flatten)]
    dir: DirArg,
    /// etcd, kube-apiserver, and in a plane with nodes kube-controller-manager,
    /// kube-scheduler or kwok
    component: Option<String>,
}

#[derive(Subcommand)]
enum Command {
    /// Build the binaries into the cache, or do nothing if they are there
    Build {
        /// Also kube-controller-manager, kube-scheduler and kwok
        #[arg(long)]
        nodes: bool,
        /// Also helm
        #[arg(long)]
        helm: bool,
        /// Also the real node's kubelet, containerd, runc and CNI plugins
        #[arg(long)]
        real_node: bool,
        /// All of them
        #[arg(long)]
        all: bool,
    },
    /// Start a plane on free 127.0.0.1 ports
    Up {
        #[command(flatten)]
        dir: DirArg,
        /// Stop the plane once this process has exited
        #[arg(long)]
        owner_pid: Option<String>,
        /// A whole cluster with this many nodes simulated by kwok
        #[arg(long)]
        nodes: Option<String>,
        /// Also one node whose kubelet runs real containers
        #[arg(long)]
        real_node: bool,
    },
    /// Build initium's image and the test toolbox as OCI archives; import them into the
    /// real node of the plane in DIR if one runs
    Image {
        #[command(flatten)]
        dir: DirArg,
        /// initium's static binary (scripts/image builds it)
        #[arg(long)]
        binary: PathBuf,
        /// Where the archives go
        #[arg(long)]
        out: PathBuf,
    },
    /// Print `export KUBECONFIG=...` and `export PATH=...` for a running plane
    Env {
        #[command(flatten)]
        dir: DirArg,
    },
    /// Say which processes run (exit status 1 if one of the plane's processes does not)
    Status {
        #[command(flatten)]
        dir: DirArg,
    },
    /// Stop the plane and remove its directory
    Down {
        #[command(flatten)]
        dir: DirArg,
    },
    /// Stop one process of a running plane
    StopComponent {
        #[command(flatten)]
        component: ComponentArgs,
        /// TERM (as down does) or KILL (a crash)
        #[arg(long, default_value = "TERM")]
        signal: String,
    },
    /// Start a stopped process again, on the ports it had, with the same data
    StartComponent {
        #[command(flatten)]
        component: ComponentArgs,
    },
    /// stop-component, then start-component
    Restart {
        #[command(flatten)]
        component: ComponentArgs,
        /// TERM (as down does) or KILL (a crash)
        #[arg(long, default_value = "TERM")]
        signal: String,
        /// Seconds between the stop and the start
        #[arg(long, default_value = "0")]
        down_for: String,
    },
    /// Print the directory holding the binaries, building nothing
    BinDir,
    /// Print the usage (as `--help` does)
    #[command(hide = true)]
    Help,
    /// Run `down` once the owner recorded in DIR has exited (started by `up`)
    #[command(name = "_watchdog", hide = true)]
    Watchdog {
        #[arg(long)]
        dir: PathBuf,
    },
    /// The real node's first process, inside its namespaces (started by `up --real-node`)
    #[command(name = "_node", hide = true)]
    Node {
        #[arg(long)]
        dir: PathBuf,
    },
    /// The API server's Service address inside the real node (started by `up --real-node`)
    #[command(name = "_forward", hide = true)]
    Forward {
        #[arg(long)]
        dir: PathBuf,
    },
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match run(cli) {
        Ok(code) => code,
        Err(error) => {
            set_quiet(false);
            log(format_args!("error: {error:#}"));
            ExitCode::FAILURE
        }
    }
}

fn run(cli: Cli) -> anyhow::Result<ExitCode> {
    let settings = Settings::from_env()?;
    let Some(command) = cli.command.filter(|c| !matches!(c, Command::Help)) else {
        print!("{USAGE}");
        return Ok(ExitCode::SUCCESS);
    };
    let dir = |arg: DirArg| settings.plane_dir(arg.dir);
    match command {
        Command::Build {
            nodes,
            helm,
            real_node,
            all,
        } => {
            build::build(&settings, nodes || all, helm || all, real_node || all)?;
        }
        Command::Up {
            dir: arg,
            owner_pid,
            nodes,
            real_node,
        } => {
            let nodes = nodes.map(|n| plane::parse_nodes(&n)).transpose()?;
            plane::up(
                &settings,
                &dir(arg)?,
                owner_pid.as_deref(),
                nodes,
                real_node,
            )?;
        }
        Command::Image {
            dir: arg,
            binary,
            out,
        } => image::build(&settings, &dir(arg)?, &binary, &out)?,
        Command::Node { dir } => realnode::supervise(&settings, &settings::absolute(dir)?)?,
        Command::Forward { dir } => forward::run(&settings::absolute(dir)?)?,
        Command::Env { dir: arg } => plane::env(&settings, &dir(arg)?)?,
        Command::Status { dir: arg } => return plane::status(&settings, &dir(arg)?),
        Command::Down { dir: arg } => plane::down(&settings, &dir(arg)?)?,
        Command::StopComponent { component, signal } => {
            let (dir, name) =
                component::parse(&settings, dir(component.dir)?, component.component)?;
            let signal = component::parse_signal(&signal)?;
            component::stop(&dir, name, signal);
            log(format_args!("{name} stopped"));
        }
        Command::StartComponent { component } => {
            let (dir, name) =
                component::parse(&settings, dir(component.dir)?, component.component)?;
            let start = std::time::Instant::now();
            component::start(&settings, &dir, name)?;
            log(format_args!(
                "{name} up again in {}s",
                start.elapsed().as_secs()
            ));
        }
        Command::Restart {
            component,
            signal,
            down_for,
        } => {
            let (dir, name) =
                component::parse(&settings, dir(component.dir)?, component.component)?;
            let signal = component::parse_signal(&signal)?;
            let down_for = component::parse_down_for(&down_for)?;
            let start = std::time::Instant::now();
            component::stop(&dir, name, signal);
            std::thread::sleep(down_for);
            component::start(&settings, &dir, name)?;
            log(format_args!(
                "{name} restarted in {}s",
                start.elapsed().as_secs()
            ));
        }
        Command::BinDir => println!("{}", settings.bin_dir.display()),
        Command::Help => print!("{USAGE}"),
        Command::Watchdog { dir } => plane::watchdog(&settings, &settings::absolute(dir)?)?,
    }
    Ok(ExitCode::SUCCESS)
}
