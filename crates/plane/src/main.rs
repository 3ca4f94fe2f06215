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
mod matrix;
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

  scripts/control-plane build [--version MINOR] [--nodes] [--helm] [--real-node] [--all]
                                              build (or reuse) the binaries; --nodes also those
                                              of a cluster with nodes, --helm also helm (for the
                                              chart's tests), --real-node also the kubelet,
                                              containerd, runc and the CNI plugins, --all all
  scripts/control-plane up [--version MINOR] [--dir DIR] [--owner-pid PID] [--nodes N] [--real-node]
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
  scripts/control-plane bin-dir [--version MINOR]
                                              print the binary directory
  scripts/control-plane versions              print the supported Kubernetes minors, newest
                                              (the default) last

--version MINOR: the Kubernetes minor, one of 1.34, 1.35, 1.36, 1.37 (each pinned to a
patch release); without it $INITIUM_KUBERNETES_VERSION, or the newest. Commands on a
running plane use the release it was started with.
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

/// `--version MINOR`.
#[derive(clap::Args)]
struct VersionArg {
    /// The Kubernetes minor (1.34 ... 1.37) [default: $INITIUM_KUBERNETES_VERSION, or the
    /// newest]
    #[arg(long)]
    version: Option<String>,
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
        #[command(flatten)]
        version: VersionArg,
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
        version: VersionArg,
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
    BinDir {
        #[command(flatten)]
        version: VersionArg,
    },
    /// Print the supported Kubernetes minors, oldest first
    Versions,
    /// Print the usage (as `--help` does)
    #[command(hide = true)]
    Help,
    /// `scripts/matrix`: the real-API-server tests on every supported release
    #[command(hide = true, before_help = matrix::USAGE)]
    Matrix {
        /// Minors, comma-separated [default: all supported]
        #[arg(long)]
        versions: Option<String>,
        /// Test binaries by name, comma-separated [default: all that need an API server]
        #[arg(long)]
        tests: Option<String>,
        /// The smoke set CI runs on the oldest release
        #[arg(long)]
        smoke: bool,
        /// Also write the table (Markdown) to this file
        #[arg(long)]
        table: Option<PathBuf>,
        /// Print the test binaries and the smoke set
        #[arg(long)]
        list: bool,
    },
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
    let Some(command) = cli.command.filter(|c| !matches!(c, Command::Help)) else {
        print!("{USAGE}");
        return Ok(ExitCode::SUCCESS);
    };
    // The release: `--version` where the command takes it; for a command on a running plane,
    // the release that plane recorded; else $INITIUM_KUBERNETES_VERSION or the newest.
    let flag = match &command {
        Command::Build { version, .. }
        | Command::Up { version, .. }
        | Command::BinDir { version } => version.version.as_deref(),
        _ => None,
    };
    let mut settings = Settings::from_env(settings::choose_release(flag)?)?;
    let plane = match &command {
        Command::Image { dir, .. }
        | Command::Env { dir }
        | Command::Status { dir }
        | Command::Down { dir } => Some(settings.plane_dir(dir.dir.clone())?),
        Command::StopComponent { component, .. }
        | Command::StartComponent { component }
        | Command::Restart { component, .. } => {
            Some(settings.plane_dir(component.dir.dir.clone())?)
        }
        Command::Node { dir } | Command::Forward { dir } | Command::Watchdog { dir } => {
            Some(settings::absolute(dir.clone())?)
        }
        _ => None,
    };
    if let Some(plane) = plane {
        settings = settings.for_plane(&plane)?;
    }
    let dir = |arg: DirArg| settings.plane_dir(arg.dir);
    match command {
        Command::Build {
            version: _,
            nodes,
            helm,
            real_node,
            all,
        } => {
            build::build(&settings, nodes || all, helm || all, real_node || all)?;
        }
        Command::Up {
            version: _,
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
        Command::BinDir { version: _ } => println!("{}", settings.bin_dir.display()),
        Command::Versions => {
            for release in &settings::RELEASES {
                println!("{} {}", release.name(), release.version);
            }
        }
        Command::Help => print!("{USAGE}"),
        Command::Matrix {
            versions,
            tests,
            smoke,
            table,
            list,
        } => {
            let options = matrix::Options {
                versions,
                tests,
                smoke,
                table,
                list,
            };
            if !matrix::run(settings, options)? {
                return Ok(ExitCode::FAILURE);
            }
        }
        Command::Watchdog { dir } => plane::watchdog(&settings, &settings::absolute(dir)?)?,
    }
    Ok(ExitCode::SUCCESS)
}
