//! `vrnic`: the command line. Thin by design: `serve` runs the daemon library, the other
//! subcommands talk to a running daemon over its admin socket, and `run` preloads the driver
//! library into a command, alone or (`--container`) in its own namespaces; `docker-args` and
//! `vm-args` print what a container engine or QEMU needs to give a container or a VM a vRNIC.
//! `bench` measures vrnic against this machine's limits on private daemons of its own.

mod container;
mod presence;
mod top;

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
    /// The daemon's state dir [default: /run/vrnic as root; else $XDG_RUNTIME_DIR/vrnic (or
    /// /tmp/vrnic-UID), and for commands other than `serve`, /run/vrnic (root's daemon, which
    /// admits members of its access group) when no daemon of this user's runs there].
    #[arg(long, global = true, env = STATE_DIR_ENV)]
    state_dir: Option<PathBuf>,
    #[command(subcommand)]
    cmd: Cmd,
}

/// When `vrnic run` presents the device files (see `presence`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
enum DeviceFiles {
    /// When running as root.
    Auto,
    /// Always; an error without root.
    On,
    /// Never.
    Off,
}

// Parsed once at start: the size of `serve`'s options costs nothing.
#[allow(clippy::large_enum_variant)]
#[derive(Subcommand)]
enum Cmd {
    /// Run the virtual layer daemon in the foreground (Ctrl-C or SIGTERM stops it).
    Serve {
        /// A TOML file with any of the options below (`listen = "ADDR:PORT"`, `peers = [...]`,
        /// `region_gib = 16`, ...); options given here win over it.
        #[arg(long)]
        config: Option<PathBuf>,
        /// Size of each vRNIC's region file in GiB (sparse: only used pages cost memory); also
        /// the most memory one vRNIC can register [default: 16].
        #[arg(long)]
        region_gib: Option<u64>,
        /// Most queue pairs per vRNIC [default: 4096].
        #[arg(long)]
        max_qp: Option<u32>,
        /// Most completion queues per vRNIC [default: 4096].
        #[arg(long)]
        max_cq: Option<u32>,
        /// Most memory regions per vRNIC [default: 65536].
        #[arg(long)]
        max_mr: Option<u32>,
        /// Most protection domains per vRNIC [default: 4096].
        #[arg(long)]
        max_pd: Option<u32>,
        /// Most shared receive queues per vRNIC [default: 4096].
        #[arg(long)]
        max_srq: Option<u32>,
        /// Most vRNICs at once (at most 65536; each region is mapped in the daemon as far as
        /// its vRNIC uses it) [default: 4096].
        #[arg(long)]
        max_vrnics: Option<u32>,
        /// Engine threads: vRNICs are shared out among them, each served by one; a work
        /// request for a vRNIC of another thread is executed by the thread that took it, one
        /// copy per byte (docs/performance.md, "Engine threads"). 1: the daemon's loop thread
        /// runs the engine itself [default: 1]. `vrnic ls` shows each vRNIC's.
        #[arg(long)]
        engine_threads: Option<usize>,
        /// Spread each vRNIC's QPs over the engine threads (a process's QPs then use several
        /// cores).
        #[arg(long)]
        spread_qps: bool,
        /// This host's address for peer links to other hosts' daemons: `ADDR[:PORT]` (a host
        /// name is resolved; the port defaults to 7700).
        #[arg(long, value_name = "ADDR[:PORT]", value_parser = vrnic_daemon::settings::host_port)]
        listen: Option<std::net::SocketAddr>,
        /// Serve the vRNICs' counters and state to Prometheus at http://ADDR:PORT/metrics
        /// (labels: vnic, group, host). Anyone who reaches it reads every tenant's counters:
        /// bind it to an address only the monitoring can reach.
        #[arg(long, value_name = "ADDR:PORT")]
        metrics: Option<std::net::SocketAddr>,
        /// Another host's daemon (its --listen address): `HOST[:PORT]`, a host name (resolved
        /// at start, its first IPv4 address if it has one) or an IP address; the port defaults
        /// to 7700, the default port of --listen. Repeat for each host.
        #[arg(long = "peer", value_name = "HOST[:PORT]", value_parser = vrnic_daemon::settings::host_port)]
        peers: Vec<std::net::SocketAddr>,
        /// This host's peer-link key file (`vrnic keygen FILE`): every link then proves both
        /// ends' keys (Noise XX) before it carries anything.
        #[arg(long, value_name = "FILE")]
        key: Option<PathBuf>,
        /// Another host's public key (what `vrnic keygen --public` prints there), by its
        /// --listen address (`HOST[:PORT]`, as --peer); one for each --peer (in a cluster, for
        /// each host accepted).
        #[arg(long = "peer-key", value_name = "HOST[:PORT]=PUBLIC", value_parser = parse_peer_key)]
        peer_keys: Vec<(std::net::SocketAddr, vrnic_daemon::keys::PublicKey)>,
        /// Encrypt the frames of every link too (a link is encrypted if either end asks);
        /// needs --key. Payloads are then copied rather than sent from and read into place.
        #[arg(long)]
        encrypt_links: bool,
        /// Accept links that are not authenticated on an address other than loopback (anyone
        /// who reaches --listen can then pose as a host): refused without it.
        #[arg(long)]
        insecure_links: bool,
        /// Cluster mode: etcd's client URLs (http://HOST:PORT, or https:// with --etcd-ca;
        /// comma-separated). Hosts and
        /// vRNICs are registered there (LIDs, GIDs and IPs claimed by transactions) and peers
        /// are found there instead of --peer; needs --listen.
        #[arg(long, value_delimiter = ',', value_name = "URL[,URL...]")]
        etcd: Vec<String>,
        /// Cluster mode: the etcd lease's time to live in seconds: how long a dead daemon's
        /// vRNICs stay listed [default: 5].
        #[arg(long)]
        etcd_ttl: Option<u64>,
        /// Cluster mode: the etcd user to authenticate as (etcd's v3 auth; its role needs
        /// readwrite on the prefix /vrnic/); needs --etcd-password-file.
        #[arg(long, value_name = "NAME")]
        etcd_user: Option<String>,
        /// Cluster mode: a file holding the etcd user's password (its first line), readable
        /// by its owner only (mode 600); the password is never given on the command line.
        #[arg(long, value_name = "PATH")]
        etcd_password_file: Option<std::path::PathBuf>,
        /// Cluster mode: TLS to etcd (https:// URLs): the CA certificates (PEM) etcd's server
        /// certificate must chain to.
        #[arg(long, value_name = "PATH")]
        etcd_ca: Option<std::path::PathBuf>,
        /// Cluster mode: a client certificate (PEM) for an etcd that authenticates clients by
        /// certificate (etcd --client-cert-auth); needs --etcd-key and --etcd-ca.
        #[arg(long, value_name = "PATH")]
        etcd_cert: Option<std::path::PathBuf>,
        /// Cluster mode: the client certificate's key (PEM), readable by its owner only.
        #[arg(long, value_name = "PATH")]
        etcd_key: Option<std::path::PathBuf>,
        /// The file that records the vRNICs `vrnic create` makes (name, group, IP, limits), to
        /// make them again when the daemon starts [default: /var/lib/vrnic/vnics.json as root,
        /// else $XDG_STATE_HOME/vrnic/vnics.json, for the default state dir; STATE_DIR.vnics.json
        /// beside any other].
        #[arg(long, value_name = "PATH")]
        persist_file: Option<PathBuf>,
        /// Record nothing: vRNICs made by `vrnic create` last until `vrnic rm` or the daemon's
        /// end.
        #[arg(long, conflicts_with = "persist_file")]
        no_persist: bool,
        /// As root: the Unix group whose members may use this daemon as tenants (`vrnic run`
        /// on vRNICs of their own; creating, changing and removing others' is root's). Its
        /// admin socket is then the group's (mode 660); without such a group, root only.
        /// `none`: root only [default: vrnic].
        #[arg(long, value_name = "GROUP")]
        access_group: Option<String>,
    },
    /// Run a command attached to a vRNIC, with the driver library preloaded.
    Run {
        /// The vRNIC to attach to: created if missing and then removed when its last user
        /// exits; without it, a fresh vRNIC is made for this command.
        #[arg(long)]
        vrnic: Option<String>,
        /// The tenants' group of the vRNIC made for it (an existing one must be in it)
        /// [default: default].
        #[arg(long)]
        group: Option<String>,
        /// The virtual IP of the vRNIC made for it, unique in its group [default: one from
        /// the group's subnet].
        #[arg(long)]
        ip: Option<std::net::Ipv4Addr>,
        /// Run it as a container without a container engine: new mount, PID, UTS and network
        /// namespaces, with only this vRNIC's directory visible (at /run/vrnic-device). Root.
        #[arg(long)]
        container: bool,
        /// With --container: keep the host's network namespace instead of a new one (for apps
        /// that exchange connection details over TCP with peers outside).
        #[arg(long, requires = "container")]
        host_net: bool,
        /// Show the command the vRNIC where RDMA stacks look for a device: a node
        /// /dev/infiniband/uverbs-NAME and /sys/class/infiniband/NAME, in a mount namespace of
        /// its own (UCX, Open MPI and ibstat need them). `auto`: when root; `on`: fail without
        /// root.
        #[arg(long, value_enum, default_value_t = DeviceFiles::Auto)]
        device_files: DeviceFiles,
        /// The command and its arguments.
        #[arg(trailing_var_arg = true, required = true)]
        cmd: Vec<String>,
    },
    /// List vRNICs (name, LID, GID, QPs, users, engine thread, virtual IP, group, limits, and
    /// whether it is recorded to be made again when the daemon starts).
    Ls {
        /// The whole directory: also the vRNICs other hosts announced.
        #[arg(long)]
        all: bool,
    },
    /// Counters of this host's vRNICs since each was made, exact: work requests and bytes sent
    /// and received by opcode class (SEND, WRITE, READ, atomic), completions by status, RNR
    /// NAKs and NAKs sent, UD datagrams dropped.
    Stats {
        /// One vRNIC (default: every vRNIC of this host).
        name: Option<String>,
        /// Only this QP of the vRNIC (decimal, or hexadecimal with 0x): what it moved since it
        /// was created.
        #[arg(long, value_parser = parse_qpn, requires = "name")]
        qp: Option<u32>,
        /// As JSON (one object per vRNIC, in an array).
        #[arg(long)]
        json: bool,
    },
    /// A live table of this host's vRNICs, refreshed every interval: QPs, users, work
    /// requests and bytes per second sent and received, completions in error per second, the
    /// share of the time its QoS limit held it back, its limits. Quits on q, Esc or Ctrl-C.
    Top {
        /// Seconds between refreshes.
        #[arg(long, default_value_t = 1.0)]
        interval: f64,
        /// Print this many plain tables, one per interval, and exit (the default when stdout
        /// is not a terminal: 1).
        #[arg(long)]
        batch: Option<u32>,
    },
    /// Make this host's peer-link key: a new key file (mode 600; an existing one is kept), and
    /// its public key printed, to give the other hosts as --peer-key ADDR:PORT=PUBLIC.
    Keygen {
        /// The key file.
        file: PathBuf,
        /// Print the public key of an existing key file instead.
        #[arg(long)]
        public: bool,
    },
    /// List the peer links to other hosts' daemons (state, keepalive round trip, bytes,
    /// segments sent again, times down).
    ///
    /// Columns: PEER the other daemon's --listen address; STATE up, connecting or down;
    /// RTT_US the last keepalive's round trip in microseconds (- before the first); BYTES_IN
    /// the bytes read from the link; PLACED_IN of those, the payload bytes read from the
    /// socket straight into registered memory (large WRITEs and READ responses: no copy);
    /// BYTES_OUT the bytes written to it; RESENT the segments sent again (after a NAK, an RNR
    /// NAK or a link that came back); DROPS the times the link went down (each time it is
    /// dialled again; lower is better, 0 on a healthy network); SECURITY none, authenticated
    /// (the peer proved its key) or encrypted (its frames too). Counters run from the
    /// daemon's start.
    Peers,
    /// Create a vRNIC that stays until `vrnic rm`, also when the daemon stops and starts again
    /// (the daemon records it: `vrnic serve --persist-file`).
    Create {
        /// Its name (also the device name apps see).
        name: String,
        /// Its tenants' group: connections join vRNICs of one group only [default: default].
        #[arg(long)]
        group: Option<String>,
        /// Its virtual IP (what rdma_cm resolves within the group), unique in the group
        /// [default: one from the group's subnet, 100.64.0.0/10].
        #[arg(long)]
        ip: Option<std::net::Ipv4Addr>,
        #[command(flatten)]
        limits: Limits,
    },
    /// Change a vRNIC's QoS limits, live (no restart, no reconnection): its next turn in the
    /// engine follows them. A limit not given stays as it is; `none` lifts it.
    Policy {
        /// Its name.
        name: String,
        #[command(flatten)]
        limits: Limits,
    },
    /// Remove a vRNIC; refused while apps use it, unless --force.
    Rm {
        /// Its name.
        name: String,
        /// Remove it even while in use: each app using it gets IBV_EVENT_DEVICE_FATAL and
        /// its calls fail from then on (as with a device that went away).
        #[arg(long)]
        force: bool,
    },
    /// Act on one QP of a vRNIC.
    #[command(subcommand)]
    Qp(QpCmd),
    /// Print the `docker run` / `podman run` options that give a container this vRNIC (its
    /// directory bind-mounted at /run/vrnic-device, the driver library mounted and preloaded,
    /// and the device files): `docker run $(vrnic docker-args NAME) IMAGE CMD`.
    DockerArgs {
        /// The vRNIC (made with `vrnic create`).
        name: String,
        /// Also give the container the vRNIC where RDMA stacks look for a device: the node
        /// /dev/infiniband/uverbs-NAME (`--device`) and a view of /sys/class/infiniband/NAME,
        /// written under the state dir and bound read-only over the container's /sys/class
        /// (which then shows only `infiniband`). `auto`: when the view can be written there;
        /// `on`: fail otherwise.
        #[arg(long, value_enum, default_value_t = DeviceFiles::Auto)]
        device_files: DeviceFiles,
    },
    /// Measure vrnic against this machine's limits: unmodified perftest sweeps, the control
    /// path, many pairs, many vRNICs, fairness between vRNICs and (as root) two hosts in
    /// network namespaces, each figure beside a limit or reference measured in the same run
    /// (memcpy, the cache-line round trip, TCP, the idle round trip), on private daemons of its
    /// own (the state dir is not used).
    Bench(vrnic_bench::BenchArgs),
    /// Print the QEMU options that give a VM this vRNIC: its region as an `ivshmem-plain` PCI
    /// device; the driver library inside the guest finds it through sysfs (1af4:1110, BAR2).
    VmArgs {
        /// The vRNIC (made with `vrnic create`).
        name: String,
    },
}

/// `println!` for a reader that may go away (`vrnic ls | head`): Rust ignores `SIGPIPE`, so a
/// plain `println!` would panic on `EPIPE`; this ends the program quietly instead, with status
/// 0, as a tool killed by `SIGPIPE` leaves its pipeline's status to the reader.
macro_rules! say {
    ($($t:tt)*) => {
        say(format_args!($($t)*))
    };
}

fn say(line: std::fmt::Arguments<'_>) {
    use std::io::Write as _;
    if let Err(e) = writeln!(std::io::stdout().lock(), "{line}") {
        if e.kind() != std::io::ErrorKind::BrokenPipe {
            eprintln!("vrnic: write to stdout: {e}");
            std::process::exit(1);
        }
        std::process::exit(0);
    }
}

/// Whether the log may be coloured: only on a terminal, and not when `NO_COLOR` is set to
/// anything but the empty string (no-color.org).
fn log_in_colour(terminal: bool, no_color: Option<&std::ffi::OsStr>) -> bool {
    terminal && no_color.is_none_or(|v| v.is_empty())
}

/// What `$(vrnic docker-args NAME)` and `$(vrnic vm-args NAME)` leave on stdout when they fail,
/// so that the command they stand in fails too (`docker run: unknown flag`, `qemu: invalid
/// option`) instead of starting without the vRNIC; the reason goes to stderr.
const DOCKER_ARGS_FAILED: &str = "--vrnic-docker-args-failed";
const VM_ARGS_FAILED: &str = "-vrnic-vm-args-failed";

fn main() {
    use std::io::IsTerminal as _;
    let colour = log_in_colour(
        std::io::stderr().is_terminal(),
        std::env::var_os("NO_COLOR").as_deref(),
    );
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()),
        )
        .with_writer(std::io::stderr)
        .with_ansi(colour)
        .init();
    if let Err(e) = real_main() {
        eprintln!("vrnic: {e:#}");
        std::process::exit(1);
    }
}

fn real_main() -> Result<()> {
    let cli = Cli::parse();
    // A daemon serves its own user's dir; a client finding no daemon of its user's there
    // talks to root's (`config::client_state_dir`).
    let state_dir = cli.state_dir.unwrap_or_else(|| match cli.cmd {
        Cmd::Serve { .. } => config::default_state_dir(),
        _ => config::client_state_dir(),
    });
    let failed = match &cli.cmd {
        Cmd::DockerArgs { .. } => Some(DOCKER_ARGS_FAILED),
        Cmd::VmArgs { .. } => Some(VM_ARGS_FAILED),
        _ => None,
    };
    let r = command(cli.cmd, state_dir);
    if let (Err(_), Some(token)) = (&r, failed) {
        say!("{token}");
    }
    r
}

fn command(cmd: Cmd, state_dir: std::path::PathBuf) -> Result<()> {
    match cmd {
        Cmd::Serve {
            config,
            region_gib,
            max_qp,
            max_cq,
            max_mr,
            max_pd,
            max_srq,
            max_vrnics,
            engine_threads,
            spread_qps,
            listen,
            metrics,
            peers,
            key,
            peer_keys,
            encrypt_links,
            insecure_links,
            etcd,
            etcd_ttl,
            etcd_user,
            etcd_password_file,
            etcd_ca,
            etcd_cert,
            etcd_key,
            persist_file,
            no_persist,
            access_group,
        } => {
            let file = match &config {
                Some(path) => vrnic_daemon::settings::Settings::load(path)?,
                None => Default::default(),
            };
            let limits = vrnic_daemon::Limits::default();
            vrnic_daemon::serve(vrnic_daemon::ServeOptions {
                state_dir,
                region_size: region_gib.or(file.region_gib).unwrap_or(16).max(1) << 30,
                limits: vrnic_daemon::Limits {
                    max_qp: max_qp.or(file.max_qp).unwrap_or(limits.max_qp),
                    max_cq: max_cq.or(file.max_cq).unwrap_or(limits.max_cq),
                    max_mr: max_mr.or(file.max_mr).unwrap_or(limits.max_mr),
                    max_pd: max_pd.or(file.max_pd).unwrap_or(limits.max_pd),
                    max_srq: max_srq.or(file.max_srq).unwrap_or(limits.max_srq),
                },
                max_vrnics: max_vrnics.or(file.max_vrnics).unwrap_or(4096),
                engine_threads: engine_threads.or(file.engine_threads),
                spread_qps: spread_qps || file.spread_qps.unwrap_or(false),
                metrics: metrics.or(file.metrics),
                persist_file: persist_file.or(file.persist_file.clone()),
                no_persist: no_persist || file.no_persist.unwrap_or(false),
                access_group: Some(
                    access_group
                        .or(file.access_group.clone())
                        .unwrap_or_else(|| config::DEFAULT_ACCESS_GROUP.to_string()),
                )
                .filter(|g| g != "none" && !g.is_empty()),
                peer: vrnic_daemon::PeerOptions {
                    listen: listen.or(file.listen),
                    peers: if peers.is_empty() {
                        file.peers.clone()
                    } else {
                        peers
                    },
                    key: key
                        .or(file.key_file.clone())
                        .map(|k| vrnic_daemon::keys::KeyPair::load(&k))
                        .transpose()?,
                    peer_keys: if peer_keys.is_empty() {
                        file.peer_key_list().map_err(anyhow::Error::msg)?
                    } else {
                        peer_keys
                    },
                    encrypt: encrypt_links || file.encrypt_links.unwrap_or(false),
                    insecure: insecure_links || file.insecure_links.unwrap_or(false),
                },
                cluster: {
                    let endpoints = if etcd.is_empty() { file.etcd } else { etcd };
                    (!endpoints.is_empty()).then(|| vrnic_daemon::ClusterOptions {
                        endpoints,
                        ttl_s: etcd_ttl
                            .or(file.etcd_ttl)
                            .unwrap_or(vrnic_daemon::DEFAULT_TTL_S),
                        user: etcd_user.or(file.etcd_user),
                        password_file: etcd_password_file.or(file.etcd_password_file),
                        ca: etcd_ca.or(file.etcd_ca),
                        cert: etcd_cert.or(file.etcd_cert),
                        key: etcd_key.or(file.etcd_key),
                    })
                },
            })
        }
        Cmd::Run {
            vrnic,
            group,
            ip,
            container,
            host_net,
            device_files,
            cmd,
        } => {
            let iso = container.then_some(container::Isolation { own_net: !host_net });
            run(&state_dir, (vrnic, group, ip), iso, device_files, &cmd)
        }
        Cmd::Bench(args) => vrnic_bench::main(args),
        Cmd::DockerArgs { name, device_files } => {
            let (v, live) = find_among(&state_dir, &name)?;
            let driver = driver_path()?;
            let inside = format!("/usr/lib/vrnic/{DRIVER}");
            let mut args = format!(
                "--mount type=bind,source={},target={} \
                 --mount type=bind,source={},target={inside},readonly \
                 --env LD_PRELOAD={inside}",
                v.dir,
                container::DEVICE_MOUNT,
                driver.display()
            );
            if device_files != DeviceFiles::Off {
                let view = presence::DeviceView {
                    name: v.name.clone(),
                    lid: v.lid,
                    gid: v.gid,
                };
                match presence::container_view(&presence::views_dir(&state_dir), &view, &live) {
                    Ok(dir) => args.push_str(&format!(
                        " --device /dev/null:/dev/infiniband/{} \
                         --mount type=bind,source={},target=/sys/class,readonly",
                        view.dev_name(),
                        dir.display()
                    )),
                    Err(e) if device_files == DeviceFiles::On => {
                        return Err(e).context("writing the vRNIC's sysfs view for the container");
                    }
                    Err(e) => eprintln!(
                        "vrnic docker-args: no /dev/infiniband and /sys/class/infiniband for {} \
                         (cannot write its sysfs view under {}: {e}); verbs work, stacks that \
                         look for them (UCX, Open MPI) will not find the device",
                        v.name,
                        state_dir.display()
                    ),
                }
            }
            say!("{args}");
            Ok(())
        }
        Cmd::VmArgs { name } => {
            let v = find(&state_dir, &name)?;
            let region = std::path::Path::new(&v.dir).join(config::REGION_FILE);
            let size = std::fs::metadata(&region)
                .with_context(|| format!("stat {}", region.display()))?
                .len();
            if !size.is_power_of_two() {
                bail!(
                    "region of {size} bytes: a PCI BAR must be a power of two (serve with \
                     --region-gib 1, 2, 4, 8 or 16)"
                );
            }
            say!(
                "-object memory-backend-file,id=vrnic-{name},share=on,mem-path={},size={size} \
                 -device ivshmem-plain,memdev=vrnic-{name}",
                region.display()
            );
            Ok(())
        }
        Cmd::Ls { all: false } => {
            let mut c = AdminClient::connect(&state_dir)?;
            let AdminReply::List(list) = c.call(&AdminRequest::List)? else {
                bail!("unexpected reply")
            };
            say!(
                "{:<16} {:>6} {:<40} {:>4} {:>5} {:>6}  {:<15} {:<12} {:>7} {:>8} PERSIST",
                "NAME",
                "LID",
                "GID",
                "QPS",
                "USERS",
                "ENGINE",
                "IP",
                "GROUP",
                "MAX_BW",
                "MAX_RATE"
            );
            for v in list {
                say!(
                    "{:<16} {:>6} {:<40} {:>4} {:>5} {:>6}  {:<15} {:<12} {:>7} {:>8} {}",
                    v.name,
                    v.lid,
                    gid_string(&v.gid),
                    v.qps,
                    v.users,
                    v.engine,
                    v.ip,
                    v.group,
                    rate_string(v.max_bw),
                    rate_string(v.max_rate),
                    if v.recorded { "yes" } else { "no" }
                );
            }
            Ok(())
        }
        Cmd::Ls { all: true } => {
            let mut c = AdminClient::connect(&state_dir)?;
            let AdminReply::Directory(list) = c.call(&AdminRequest::ListAll)? else {
                bail!("unexpected reply")
            };
            if list.len() >= vrnic_api::DIRECTORY_LISTING_MAX {
                eprintln!(
                    "vrnic: the first {} entries only (this host's first)",
                    vrnic_api::DIRECTORY_LISTING_MAX
                );
            }
            say!(
                "{:<22} {:<16} {:>6} {:<40} {:<15} {:<12} {:>4}",
                "HOST",
                "NAME",
                "LID",
                "GID",
                "IP",
                "GROUP",
                "QPS"
            );
            for v in list {
                say!(
                    "{:<22} {:<16} {:>6} {:<40} {:<15} {:<12} {:>4}",
                    v.host,
                    v.name,
                    v.lid,
                    gid_string(&v.gid),
                    v.ip,
                    v.group,
                    v.qps.map_or("-".to_string(), |q| q.to_string())
                );
            }
            Ok(())
        }
        Cmd::Stats { name, qp, json } => {
            let mut c = AdminClient::connect(&state_dir)?;
            let list = match c.call(&AdminRequest::Stats { name, qp })? {
                AdminReply::Stats(list) => list,
                AdminReply::Err(e) => bail!("{e}"),
                _ => bail!("unexpected reply"),
            };
            if json {
                say!("{}", serde_json::to_string_pretty(&list)?);
                return Ok(());
            }
            if list.is_empty() {
                // As `vrnic top` says it: an empty answer would read as a broken command.
                say!(
                    "(no vRNICs: one that `vrnic run` made is removed when its command exits; \
                     `vrnic create NAME` makes one that stays)"
                );
            }
            for s in &list {
                match s.qpn {
                    Some(q) => say!("{} QP {q:#x} (group {})", s.name, s.group),
                    None => say!("{} (group {})", s.name, s.group),
                }
                for (dir, c) in [("sent", &s.sent), ("received", &s.received)] {
                    say!(
                        "  {dir:<9} send {} / {} B   write {} / {} B   read {} / {} B   \
                         atomic {} / {} B",
                        c.send.wrs,
                        c.send.bytes,
                        c.write.wrs,
                        c.write.bytes,
                        c.read.wrs,
                        c.read.bytes,
                        c.atomic.wrs,
                        c.atomic.bytes
                    );
                }
                let done: Vec<String> = s
                    .completions
                    .iter()
                    .map(|(k, v)| format!("{k} {v}"))
                    .collect();
                say!(
                    "  completions {}",
                    if done.is_empty() {
                        "none".to_string()
                    } else {
                        done.join(", ")
                    }
                );
                say!(
                    "  rnr_naks {}  naks {}  ud_dropped {}  qos_waits {} ({} us)",
                    s.rnr_naks,
                    s.naks,
                    s.ud_dropped,
                    s.qos_waits,
                    s.qos_waited_us
                );
                if s.qpn.is_none() {
                    say!(
                        "  copied {} bytes (by the engine, into or out of its regions)",
                        s.copied
                    );
                    say!(
                        "  cm connects {}  requests {}  established {}  rejected {}",
                        s.cm.connects,
                        s.cm.requests,
                        s.cm.established,
                        s.cm.rejected
                    );
                }
            }
            Ok(())
        }
        Cmd::Top { interval, batch } => {
            if !(0.1..=3600.0).contains(&interval) {
                bail!("--interval must be between 0.1 and 3600 seconds");
            }
            top::run(
                &state_dir,
                std::time::Duration::from_secs_f64(interval),
                batch,
            )
        }
        Cmd::Keygen { file, public } => {
            let kp = if public {
                vrnic_daemon::keys::KeyPair::load(&file)?
            } else {
                if std::fs::symlink_metadata(&file).is_ok() {
                    bail!(
                        "key file {0} exists: a key file is never overwritten (`vrnic keygen \
                         --public {0}` prints its public key; remove it first to make a new one)",
                        file.display()
                    );
                }
                make_key_dir(&file)?;
                let kp = vrnic_daemon::keys::KeyPair::generate()?;
                kp.write_new(&file)?;
                kp
            };
            say!("{}", kp.public);
            Ok(())
        }
        Cmd::Peers => {
            let mut c = AdminClient::connect(&state_dir)?;
            let AdminReply::Peers(list) = c.call(&AdminRequest::Peers)? else {
                bail!("unexpected reply")
            };
            say!(
                "{:<22} {:<10} {:>9} {:>14} {:>14} {:>14} {:>8} {:>5} {:<13}",
                "PEER",
                "STATE",
                "RTT_US",
                "BYTES_IN",
                "PLACED_IN",
                "BYTES_OUT",
                "RESENT",
                "DROPS",
                "SECURITY"
            );
            for p in list {
                say!(
                    "{:<22} {:<10} {:>9} {:>14} {:>14} {:>14} {:>8} {:>5} {:<13}",
                    p.addr,
                    p.state,
                    p.rtt_us.map_or("-".to_string(), |r| r.to_string()),
                    p.bytes_in,
                    p.placed_in,
                    p.bytes_out,
                    p.retransmits,
                    p.drops,
                    p.security
                );
            }
            Ok(())
        }
        Cmd::Policy { name, limits } => {
            if limits.max_bw.is_none() && limits.max_rate.is_none() {
                bail!("give --max-bw, --max-rate or both (`none` lifts a limit)");
            }
            let mut c = AdminClient::connect(&state_dir)?;
            let reply = c.call(&AdminRequest::Policy {
                name,
                change: limits.change(),
            })?;
            if let AdminReply::Vnic(v) = reply {
                say!(
                    "{} max_bw {} max_rate {}",
                    v.name,
                    rate_string(v.max_bw),
                    rate_string(v.max_rate)
                );
            }
            Ok(())
        }
        Cmd::Create {
            name,
            group,
            ip,
            limits,
        } => {
            let mut c = AdminClient::connect(&state_dir)?;
            let policy = limits.change();
            if let AdminReply::Vnic(v) = c.call(&AdminRequest::Create {
                name,
                group,
                ip,
                policy,
            })? {
                say!(
                    "{} lid {} gid {} group {} ip {} dir {}",
                    v.name,
                    v.lid,
                    gid_string(&v.gid),
                    v.group,
                    v.ip,
                    v.dir
                );
            }
            Ok(())
        }
        Cmd::Rm { name, force } => {
            AdminClient::connect(&state_dir)?.call(&AdminRequest::Remove { name, force })?;
            Ok(())
        }
        Cmd::Qp(QpCmd::Kill { name, qpn }) => {
            AdminClient::connect(&state_dir)?.call(&AdminRequest::KillQp { name, qpn })?;
            Ok(())
        }
    }
}

/// `vrnic qp ...`.
#[derive(Debug, Subcommand)]
enum QpCmd {
    /// Move a QP to the error state from outside: its outstanding work requests complete with
    /// IBV_WC_WR_FLUSH_ERR, its app gets IBV_EVENT_QP_FATAL, its peer (here or on another
    /// host) fails within its retry budget once it sends to it; nothing else of the vRNIC is
    /// touched. Logged with who asked.
    Kill {
        /// The vRNIC.
        name: String,
        /// The QP's number (decimal, or hexadecimal with 0x, as perftest prints it).
        #[arg(value_parser = parse_qpn)]
        qpn: u32,
    },
}

fn parse_qpn(s: &str) -> std::result::Result<u32, String> {
    let r = match s.strip_prefix("0x").or_else(|| s.strip_prefix("0X")) {
        Some(h) => u32::from_str_radix(h, 16),
        None => s.parse(),
    };
    r.ok()
        .filter(|&q| q < 1 << 24)
        .ok_or_else(|| format!("{s:?} is not a QP number (24 bits, decimal or 0x hex)"))
}

/// A vRNIC's QoS limits on what it sends, applied by the engine to every engine thread serving
/// it together, and to what leaves the host over peer links.
#[derive(Debug, clap::Args)]
struct Limits {
    /// Most payload bytes per second it may send (SEND, WRITE, READ it asked for, atomics):
    /// a number with an optional K, M, G or T (powers of 1000) or Ki, Mi, Gi (of 1024), e.g.
    /// `10G`; `none` for no limit.
    #[arg(long, value_parser = parse_rate)]
    max_bw: Option<u64>,
    /// Most work requests per second it may have executed, e.g. `2M`; `none` for no limit.
    #[arg(long, value_parser = parse_rate)]
    max_rate: Option<u64>,
}

impl Limits {
    fn change(&self) -> vrnic_api::PolicyChange {
        vrnic_api::PolicyChange {
            max_bw: self.max_bw,
            max_rate: self.max_rate,
        }
    }
}

/// `10G`, `100M`, `1.5Gi`, `2000`, or `none` (0: no limit).
fn parse_rate(s: &str) -> std::result::Result<u64, String> {
    let t = s.trim();
    if t.eq_ignore_ascii_case("none") {
        return Ok(0);
    }
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let mult: f64 = match unit {
        "" => 1.0,
        "K" | "k" => 1e3,
        "M" => 1e6,
        "G" => 1e9,
        "T" => 1e12,
        "Ki" => 1024.0,
        "Mi" => 1048576.0,
        "Gi" => 1073741824.0,
        _ => {
            return Err(format!(
                "unknown unit {unit:?}: use K, M, G, T, Ki, Mi or Gi"
            ));
        }
    };
    let n: f64 = num
        .parse()
        .map_err(|_| format!("{s:?} is not a number with an optional unit, nor `none`"))?;
    let v = (n * mult).round();
    if !(1.0..1.8e19).contains(&v) {
        return Err(format!("{s:?} is out of range (use `none` for no limit)"));
    }
    Ok(v as u64)
}

/// A limit as `vrnic ls` shows it: `-` for none, else with K, M, G or T.
fn rate_string(v: Option<u64>) -> String {
    let Some(v) = v else { return "-".into() };
    for (m, u) in [(1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "K")] {
        if v as f64 >= m {
            let x = v as f64 / m;
            return if x.fract() == 0.0 {
                format!("{x}{u}")
            } else {
                format!("{x:.2}{u}")
            };
        }
    }
    v.to_string()
}

/// The driver library: next to this binary (a build tree), or in `../lib/vrnic/` (installed).
/// `ADDR:PORT=PUBLIC` (a `--peer-key`).
fn parse_peer_key(
    s: &str,
) -> Result<(std::net::SocketAddr, vrnic_daemon::keys::PublicKey), String> {
    let (addr, key) = s
        .split_once('=')
        .ok_or("expected HOST[:PORT]=PUBLIC (the host's --listen address, its public key)")?;
    let addr = vrnic_daemon::settings::host_port(addr)?;
    let key = key.parse().map_err(|e| format!("{e}"))?;
    Ok((addr, key))
}

/// Makes the directory a new key file goes in when it is missing (`/etc/vrnic` on a fresh
/// machine, as the README's `vrnic keygen /etc/vrnic/link.key`): mode 700, since it holds
/// secrets. An existing directory is left as it is.
fn make_key_dir(file: &std::path::Path) -> Result<()> {
    use std::os::unix::fs::DirBuilderExt as _;
    let Some(dir) = file.parent().filter(|d| !d.as_os_str().is_empty()) else {
        return Ok(());
    };
    if dir.exists() {
        return Ok(());
    }
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir)
        .with_context(|| format!("make the key file's directory {}", dir.display()))?;
    eprintln!("vrnic: made the directory {} (mode 700)", dir.display());
    Ok(())
}

fn driver_path() -> Result<PathBuf> {
    let exe = std::env::current_exe().context("locate the vrnic binary")?;
    let dir = exe.parent().context("binary has no directory")?;
    for cand in [dir.join(DRIVER), dir.join("../lib/vrnic").join(DRIVER)] {
        if cand.exists() {
            return Ok(cand.canonicalize().unwrap_or(cand));
        }
    }
    bail!(
        "driver library {DRIVER} not found next to {} nor in {}; build it with `cargo build \
         --release --workspace`, and install it beside the binary or in lib/vrnic beside its bin",
        exe.display(),
        dir.join("../lib/vrnic").display()
    )
}

/// The vRNIC `name`, which must exist.
fn find(state_dir: &std::path::Path, name: &str) -> Result<vrnic_api::VnicSummary> {
    Ok(find_among(state_dir, name)?.0)
}

/// The vRNIC `name`, which must exist, and the names of all the daemon's vRNICs.
fn find_among(
    state_dir: &std::path::Path,
    name: &str,
) -> Result<(vrnic_api::VnicSummary, Vec<String>)> {
    let mut c = AdminClient::connect(state_dir)?;
    let AdminReply::List(list) = c.call(&AdminRequest::List)? else {
        bail!("unexpected reply")
    };
    let names = list.iter().map(|v| v.name.clone()).collect();
    let v = list
        .into_iter()
        .find(|v| v.name == name)
        .with_context(|| format!("no vRNIC {name} (make it with `vrnic create {name}`)"))?;
    Ok((v, names))
}

fn run(
    state_dir: &std::path::Path,
    (vrnic, group, ip): (Option<String>, Option<String>, Option<std::net::Ipv4Addr>),
    iso: Option<container::Isolation>,
    device_files: DeviceFiles,
    cmd: &[String],
) -> Result<()> {
    let driver = driver_path()?;
    if device_files == DeviceFiles::On && !presence::permitted() {
        bail!(
            "--device-files on: presenting /dev/infiniband and /sys/class/infiniband takes a \
             mount namespace, which needs root"
        );
    }
    let mut admin = AdminClient::connect(state_dir)?;
    let AdminReply::Vnic(v) = admin.call(&AdminRequest::Hold {
        name: vrnic,
        group,
        ip,
    })?
    else {
        bail!("unexpected reply")
    };
    // A daemon in a mount namespace of its own made the vRNIC where this process sees nothing:
    // say so here, not as the app's "no vRNIC".
    let region = std::path::Path::new(&v.dir).join(config::REGION_FILE);
    if std::fs::symlink_metadata(&region).is_err_and(|e| e.kind() == std::io::ErrorKind::NotFound) {
        bail!(
            "{}",
            vrnic_daemon::mntns::no_vnic_here(std::path::Path::new(&v.dir), admin.daemon_pid())
        );
    }
    let view = match device_files {
        DeviceFiles::Off => None,
        DeviceFiles::Auto if !presence::permitted() => None,
        _ => Some(presence::DeviceView {
            name: v.name.clone(),
            lid: v.lid,
            gid: v.gid,
        }),
    };
    if let Some(iso) = iso {
        // The CLI keeps the admin connection (it holds the vRNIC) and waits: a container gets
        // no fd of the daemon's but its vRNIC's, and no host path in its environment.
        let env: Vec<(String, String)> = std::env::vars()
            .filter(|(k, _)| k != "LD_PRELOAD" && k != DEVICE_ENV && k != STATE_DIR_ENV)
            .chain([
                (
                    "LD_PRELOAD".to_string(),
                    container::DRIVER_MOUNT.to_string(),
                ),
                (DEVICE_ENV.to_string(), container::DEVICE_MOUNT.to_string()),
            ])
            .collect();
        let hostname = format!("vrnic-{}", v.name);
        let code = container::run(
            std::path::Path::new(&v.dir),
            &driver,
            &hostname,
            iso,
            view.as_ref(),
            cmd,
            &env,
        )
        .context("vrnic run --container")?;
        drop(admin);
        std::process::exit(code);
    }
    if let Some(view) = &view {
        match presence::enter(view) {
            Ok(()) => {}
            Err(e) if device_files == DeviceFiles::On => {
                return Err(e).context("presenting the vRNIC's device files");
            }
            Err(e) => eprintln!(
                "vrnic run: no /dev/infiniband and /sys/class/infiniband for {} ({e}); verbs \
                 work, stacks that look for them (UCX, Open MPI) will not find the device",
                v.name
            ),
        }
    }
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_log_is_coloured_only_on_a_terminal_without_no_color() {
        use std::ffi::OsStr;
        assert!(log_in_colour(true, None));
        assert!(log_in_colour(true, Some(OsStr::new(""))));
        assert!(!log_in_colour(true, Some(OsStr::new("1"))));
        assert!(!log_in_colour(false, None));
    }
}
