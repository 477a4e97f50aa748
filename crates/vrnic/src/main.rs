//! `vrnic`: the command line. Thin by design: `serve` runs the daemon library, the other
//! subcommands talk to a running daemon over its admin socket, and `run` preloads the driver
//! library into a command.

use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::process::Command;

use anyhow::{Context, Result, bail};
use clap::{Parser, Subcommand};
use vrnic_api::{AdminReply, AdminRequest, gid_string};
use vrnic_daemon::admin::AdminClient;
use vrnic_daemon::config::{self, DEVICE_ENV, STATE_DIR_ENV};

/// The file name of the driver library, next to this binary.
const DRIVER: &str = "libvrnic_shim.so";

#[derive(Parser)]
#[command(
    name = "vrnic",
    version,
    about = "User-space virtual RDMA NICs for processes, containers and VMs"
)]
struct Cli {
    /// The daemon's state dir [default: /run/vrnic as root, else $XDG_RUNTIME_DIR/vrnic].
    #[arg(long, global = true, env = STATE_DIR_ENV)]
    state_dir: Option<PathBuf>,
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Run the virtual layer daemon in the foreground (Ctrl-C or SIGTERM stops it).
    Serve {
        /// Size of each vRNIC's region file in GiB (sparse: only used pages cost memory); also
        /// the most memory one vRNIC can register.
        #[arg(long, default_value_t = 16)]
        region_gib: u64,
        /// Most queue pairs per vRNIC.
        #[arg(long, default_value_t = vrnic_daemon::Limits::default().max_qp)]
        max_qp: u32,
        /// Most completion queues per vRNIC.
        #[arg(long, default_value_t = vrnic_daemon::Limits::default().max_cq)]
        max_cq: u32,
        /// Most memory regions per vRNIC.
        #[arg(long, default_value_t = vrnic_daemon::Limits::default().max_mr)]
        max_mr: u32,
        /// Most protection domains per vRNIC.
        #[arg(long, default_value_t = vrnic_daemon::Limits::default().max_pd)]
        max_pd: u32,
        /// Most shared receive queues per vRNIC.
        #[arg(long, default_value_t = vrnic_daemon::Limits::default().max_srq)]
        max_srq: u32,
    },
    /// Run a command attached to a vRNIC, with the driver library preloaded.
    Run {
        /// The vRNIC to attach to: created if missing and then removed when its last user
        /// exits; without it, a fresh vRNIC is made for this command.
        #[arg(long)]
        vrnic: Option<String>,
        /// The command and its arguments.
        #[arg(trailing_var_arg = true, required = true)]
        cmd: Vec<String>,
    },
    /// List vRNICs.
    Ls,
    /// Create a vRNIC that stays until `vrnic rm`.
    Create {
        /// Its name (also the device name apps see).
        name: String,
    },
    /// Remove a vRNIC.
    Rm {
        /// Its name.
        name: String,
    },
}

fn main() {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()),
        )
        .with_writer(std::io::stderr)
        .init();
    if let Err(e) = real_main() {
        eprintln!("vrnic: {e:#}");
        std::process::exit(1);
    }
}

fn real_main() -> Result<()> {
    let cli = Cli::parse();
    let state_dir = cli.state_dir.unwrap_or_else(config::default_state_dir);
    match cli.cmd {
        Cmd::Serve {
            region_gib,
            max_qp,
            max_cq,
            max_mr,
            max_pd,
            max_srq,
        } => vrnic_daemon::serve(vrnic_daemon::ServeOptions {
            state_dir,
            region_size: region_gib.max(1) << 30,
            limits: vrnic_daemon::Limits {
                max_qp,
                max_cq,
                max_mr,
                max_pd,
                max_srq,
            },
        }),
        Cmd::Run { vrnic, cmd } => run(&state_dir, vrnic, &cmd),
        Cmd::Ls => {
            let mut c = AdminClient::connect(&state_dir)?;
            let AdminReply::List(list) = c.call(&AdminRequest::List)? else {
                bail!("unexpected reply")
            };
            println!(
                "{:<16} {:>6} {:<40} {:>4} {:>5}",
                "NAME", "LID", "GID", "QPS", "USERS"
            );
            for v in list {
                println!(
                    "{:<16} {:>6} {:<40} {:>4} {:>5}",
                    v.name,
                    v.lid,
                    gid_string(&v.gid),
                    v.qps,
                    v.users
                );
            }
            Ok(())
        }
        Cmd::Create { name } => {
            let mut c = AdminClient::connect(&state_dir)?;
            if let AdminReply::Vnic(v) = c.call(&AdminRequest::Create { name })? {
                println!(
                    "{} lid {} gid {} dir {}",
                    v.name,
                    v.lid,
                    gid_string(&v.gid),
                    v.dir
                );
            }
            Ok(())
        }
        Cmd::Rm { name } => {
            AdminClient::connect(&state_dir)?.call(&AdminRequest::Remove { name })?;
            Ok(())
        }
    }
}

/// The driver library: next to this binary (a build tree), or in `../lib/vrnic/` (installed).
fn driver_path() -> Result<PathBuf> {
    let exe = std::env::current_exe().context("locate the vrnic binary")?;
    let dir = exe.parent().context("binary has no directory")?;
    for cand in [dir.join(DRIVER), dir.join("../lib/vrnic").join(DRIVER)] {
        if cand.exists() {
            return Ok(cand.canonicalize().unwrap_or(cand));
        }
    }
    bail!(
        "driver library {DRIVER} not found next to {}; build it with `cargo build --release --workspace`",
        exe.display()
    )
}

fn run(state_dir: &std::path::Path, vrnic: Option<String>, cmd: &[String]) -> Result<()> {
    let driver = driver_path()?;
    let mut admin = AdminClient::connect(state_dir)?;
    let AdminReply::Vnic(v) = admin.call(&AdminRequest::Hold { name: vrnic })? else {
        bail!("unexpected reply")
    };
    // The command inherits the admin connection: the vRNIC is held for as long as the command
    // (or anything it forks) lives, and released by the kernel when it exits or is killed.
    admin.inherit_across_exec()?;
    let preload = match std::env::var("LD_PRELOAD") {
        Ok(p) if !p.is_empty() => format!("{}:{p}", driver.display()),
        _ => driver.display().to_string(),
    };
    let err = Command::new(&cmd[0])
        .args(&cmd[1..])
        .env("LD_PRELOAD", preload)
        .env(DEVICE_ENV, &v.dir)
        .env(STATE_DIR_ENV, state_dir)
        .exec();
    bail!("cannot run {}: {err}", cmd[0])
}
