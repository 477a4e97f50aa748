//! Test harness: a daemon on a private state dir, commands under `vrnic run`, server/client
//! pairs of unmodified programs, all with deadlines and cleanup on drop (no test can hang or
//! leave a process behind).
//!
//! - Every child is spawned in its own process group and is killed with that group when its
//!   [`Proc`] guard drops (a failed assertion or a panic included).
//! - Every wait has a deadline; what a child printed is drained by reader threads as it runs, so
//!   a chatty child never blocks on a full pipe, and what it printed is shown on failure.
//! - A [`Daemon`] lives on a fresh temp dir and is stopped with SIGTERM (then SIGKILL) on drop,
//!   and the dir is removed.
#![allow(dead_code)]

pub mod docker;
pub mod hosts;
pub mod vm;

use std::io::Read;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicU16, Ordering};
use std::sync::mpsc::{Receiver, sync_channel};
use std::time::{Duration, Instant};

/// How long the daemon may take to create its socket.
pub const DAEMON_START: Duration = Duration::from_secs(10);
/// How long the daemon may take to exit after SIGTERM.
pub const DAEMON_STOP: Duration = Duration::from_secs(10);
/// How long a short CLI command (`ls`, `create`, `rm`, a refused `run`) may take.
pub const CLI: Duration = Duration::from_secs(10);

/// The `vrnic` binary: `$VRNIC_BIN` (the release build, as `scripts/test` sets it) or the one
/// cargo built for this test.
pub fn vrnic_bin() -> PathBuf {
    std::env::var_os("VRNIC_BIN")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_BIN_EXE_vrnic")))
}

/// A free TCP port for a server/client pair. Each test process reserves a block of 100 ports of
/// its own for its lifetime (it binds the abstract Unix socket `vrnic-test-ports-BLOCK`, which
/// only one process can hold and which goes with the process: no file is left), below the
/// kernel's ephemeral range (so no connection's local port can take it between the check and
/// the server's `listen`); ports go out of the block in turn and each is checked free by
/// binding it once. Blocks chosen by pid alone collided between two concurrent tests whose pids
/// agreed modulo the block count.
pub fn port() -> u16 {
    static NEXT: AtomicU16 = AtomicU16::new(0);
    let block = port_block();
    for _ in 0..100 {
        let p = block + NEXT.fetch_add(1, Ordering::Relaxed) % 100;
        if std::net::TcpListener::bind(("0.0.0.0", p)).is_ok() {
            return p;
        }
    }
    panic!("no free TCP port in {block}..{}", block + 100);
}

/// The first port of this process's block ([`port`]), reserved on first use.
fn port_block() -> u16 {
    use std::os::linux::net::SocketAddrExt;
    use std::os::unix::net::{SocketAddr, UnixListener};
    static BLOCK: std::sync::OnceLock<(UnixListener, u16)> = std::sync::OnceLock::new();
    const FIRST: u32 = 10_000;
    BLOCK
        .get_or_init(|| {
            // Blocks end below the ephemeral range's first port (32768 by default).
            let ephemeral = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
                .ok()
                .and_then(|s| s.split_whitespace().next()?.parse::<u32>().ok())
                .unwrap_or(32_768);
            let blocks = (ephemeral.saturating_sub(FIRST) / 100).max(1);
            let start = std::process::id() % blocks;
            for i in 0..blocks {
                let n = (start + i) % blocks;
                let name = format!("vrnic-test-ports-{n}");
                let held = SocketAddr::from_abstract_name(name.as_bytes())
                    .and_then(|a| UnixListener::bind_addr(&a));
                if let Ok(l) = held {
                    return (l, (FIRST + n * 100) as u16);
                }
            }
            panic!("every test port block in {FIRST}..{ephemeral} is held by another process");
        })
        .1
}

/// Whether the test runs as root (effective uid 0).
pub fn is_root() -> bool {
    // SAFETY: geteuid has no preconditions.
    unsafe { libc::geteuid() == 0 }
}

/// Fails the test unless it runs as root: `why` says what needs it. Tests that make
/// namespaces, mounts or users, or play other users, fail without root rather than pass having
/// run nothing; `scripts/test` runs the suite as root.
pub fn require_root(why: &str) {
    assert!(is_root(), "{why}: run it as root (sudo bash scripts/test)");
}

/// The path of a Debian tool; panics with how to install it if it is missing (the suite's
/// script installs them: a missing tool is a failure, not a skip).
pub fn require(tool: &str) -> PathBuf {
    for dir in ["/usr/bin", "/usr/local/bin", "/bin", "/usr/sbin", "/sbin"] {
        let p = Path::new(dir).join(tool);
        if p.exists() {
            return p;
        }
    }
    panic!(
        "{tool} is not installed: run `bash scripts/test`, which installs ibverbs-utils, perftest, \
         libibverbs-dev and friends"
    );
}

/// Sends `sig` to the process group `pgid` (every child here leads its own group).
pub fn kill_group(pgid: i32, sig: i32) {
    if pgid > 0 {
        // SAFETY: kill(2) on a process group we created; no memory is involved.
        unsafe { libc::kill(-pgid, sig) };
    }
}

/// Sends `sig` to the single process `pid`.
pub fn kill_pid(pid: i32, sig: i32) {
    if pid > 0 {
        // SAFETY: kill(2) on a child of ours; no memory is involved.
        unsafe { libc::kill(pid, sig) };
    }
}

/// What a finished (or killed) process printed.
#[derive(Debug)]
pub struct Output {
    pub status: ExitStatus,
    pub stdout: String,
    pub stderr: String,
    /// It was still running at its deadline and was killed.
    pub timed_out: bool,
}

/// What `ibv_rc/uc/srq_pingpong -c` print when a page's first byte is wrong; they still exit 0,
/// so a run that printed it is a failure here.
pub const PINGPONG_BAD_DATA: &str = "invalid data in page";

impl Output {
    /// Exited 0 in time, and printed no `-c` data error of the pingpong programs.
    pub fn ok(&self) -> bool {
        self.status.success()
            && !self.timed_out
            && !self.stdout.contains(PINGPONG_BAD_DATA)
            && !self.stderr.contains(PINGPONG_BAD_DATA)
    }

    /// stdout and stderr together, for assertion messages.
    pub fn text(&self) -> String {
        format!("stdout:\n{}\nstderr:\n{}", self.stdout, self.stderr)
    }
}

/// A child in its own process group, killed (with its group) on drop.
pub struct Proc {
    pub child: Child,
    pub name: String,
    stdout: Option<Receiver<String>>,
    stderr: Option<Receiver<String>>,
}

/// Reads a pipe to its end on a thread; the text arrives on the returned channel.
fn drain(pipe: Option<impl Read + Send + 'static>) -> Option<Receiver<String>> {
    let mut pipe = pipe?;
    let (tx, rx) = sync_channel(1);
    std::thread::spawn(move || {
        let mut buf = Vec::new();
        let _ = pipe.read_to_end(&mut buf);
        let _ = tx.send(String::from_utf8_lossy(&buf).into_owned());
    });
    Some(rx)
}

impl Proc {
    /// Spawns `cmd` with stdin closed, stdout and stderr captured, in a new process group.
    pub fn spawn(mut cmd: Command, name: &str) -> Proc {
        cmd.stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .stdin(Stdio::null())
            .process_group(0);
        let mut child = cmd
            .spawn()
            .unwrap_or_else(|e| panic!("spawn {name} ({:?}): {e}", cmd.get_program()));
        let stdout = drain(child.stdout.take());
        let stderr = drain(child.stderr.take());
        Proc {
            child,
            name: name.to_string(),
            stdout,
            stderr,
        }
    }

    pub fn pid(&self) -> i32 {
        self.child.id() as i32
    }

    /// Sends `sig` to the process, unless it has already exited (then its pid may be reused).
    pub fn signal(&mut self, sig: i32) {
        if !self.exited() {
            kill_pid(self.pid(), sig);
        }
    }

    /// Whether it has exited (it stays reapable by the wait methods).
    pub fn exited(&mut self) -> bool {
        !matches!(self.child.try_wait(), Ok(None))
    }

    /// Waits up to `limit`; on timeout kills the group and returns with `timed_out` set. Never
    /// panics on the child's account.
    pub fn wait_bounded(mut self, limit: Duration) -> Output {
        let start = Instant::now();
        loop {
            match self.child.try_wait() {
                Ok(Some(status)) => return self.collect(status, false),
                Ok(None) if start.elapsed() < limit => std::thread::sleep(Duration::from_millis(5)),
                _ => {
                    // Killed while it is still unreaped, so the pid cannot have been reused.
                    kill_group(self.pid(), libc::SIGKILL);
                    kill_pid(self.pid(), libc::SIGKILL);
                    let status = self.child.wait().expect("wait for a killed child");
                    return self.collect(status, true);
                }
            }
        }
    }

    /// Waits up to `limit`; on timeout kills the group and panics with what it printed.
    pub fn wait(self, limit: Duration) -> Output {
        let name = self.name.clone();
        let out = self.wait_bounded(limit);
        assert!(
            !out.timed_out,
            "{name} did not finish in {limit:?} (killed)\n{}",
            out.text()
        );
        out
    }

    /// Waits up to `limit` without panicking; `None` on timeout (the group is killed).
    pub fn wait_timeout(self, limit: Duration) -> Option<Output> {
        let out = self.wait_bounded(limit);
        (!out.timed_out).then_some(out)
    }

    fn collect(&mut self, status: ExitStatus, timed_out: bool) -> Output {
        // A grandchild that kept the pipe open must not hang the test: give up after a while.
        let take = |rx: Option<Receiver<String>>| {
            rx.map(|rx| {
                rx.recv_timeout(Duration::from_secs(5))
                    .unwrap_or_else(|_| "<output still open after exit>".into())
            })
            .unwrap_or_default()
        };
        Output {
            status,
            stdout: take(self.stdout.take()),
            stderr: take(self.stderr.take()),
            timed_out,
        }
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            kill_group(self.pid(), libc::SIGKILL);
            kill_pid(self.pid(), libc::SIGKILL);
            let _ = self.child.wait();
        }
    }
}

/// Runs `cmd` to completion within `limit` (killed and a panic otherwise).
pub fn output(cmd: Command, name: &str, limit: Duration) -> Output {
    Proc::spawn(cmd, name).wait(limit)
}

/// A daemon (`vrnic serve`) on a fresh state dir; stopped (SIGTERM, then SIGKILL) and its dir
/// removed on drop.
pub struct Daemon {
    /// The state dir (`--state-dir`).
    pub dir: PathBuf,
    /// The network namespace it runs in (its commands run there too), if not the test's.
    pub netns: Option<String>,
    /// Its `vrnic serve` options, to start it again.
    serve_args: Vec<String>,
    proc: Option<Proc>,
}

static SEQ: AtomicU16 = AtomicU16::new(0);

impl Daemon {
    /// Starts a daemon and waits (at most [`DAEMON_START`]) until its socket exists.
    pub fn start() -> Daemon {
        Daemon::start_with(&[])
    }

    /// [`Daemon::start`] with more `vrnic serve` options (limits, region size).
    pub fn start_with(serve_args: &[&str]) -> Daemon {
        Daemon::start_in(None, serve_args)
    }

    /// [`Daemon::start_with`] inside network namespace `netns` (`/run/netns/NAME`, entered
    /// with `nsenter --net` only, so mounts stay shared with the test).
    pub fn start_in(netns: Option<&str>, serve_args: &[&str]) -> Daemon {
        let dir = std::env::temp_dir().join(format!(
            "vrnic-test-{}-{}",
            std::process::id(),
            SEQ.fetch_add(1, Ordering::Relaxed)
        ));
        let _ = std::fs::remove_dir_all(&dir);
        remove_persist_file(&dir);
        std::fs::create_dir_all(&dir).expect("create the state dir");
        let mut d = Daemon {
            proc: None,
            dir,
            netns: netns.map(str::to_string),
            serve_args: serve_args.iter().map(|s| s.to_string()).collect(),
        };
        d.restart();
        d
    }

    /// Starts the daemon (again, after a kill) on its state dir, and waits (at most
    /// [`DAEMON_START`]) until its socket exists.
    pub fn restart(&mut self) {
        assert!(self.proc.is_none(), "the daemon still runs");
        let mut cmd = self.command();
        cmd.arg("serve")
            .arg("--state-dir")
            .arg(&self.dir)
            .args(&self.serve_args);
        if std::env::var_os("RUST_LOG").is_none() {
            cmd.env("RUST_LOG", "info");
        }
        // A killed daemon left its socket: wait for the new one's.
        let sock = self.dir.join("vrnic.sock");
        let _ = std::fs::remove_file(&sock);
        // From here on, a panic drops the daemon, which stops it and removes the dir.
        self.proc = Some(Proc::spawn(cmd, "vrnic serve"));
        let d = self;
        let start = Instant::now();
        while !sock.exists() {
            let p = d.proc.as_mut().expect("just spawned");
            if p.exited() {
                let out = d.proc.take().expect("just spawned").wait(DAEMON_STOP);
                panic!(
                    "`vrnic serve` exited at start ({:?}) (VRNIC_BIN={})\n{}",
                    out.status,
                    vrnic_bin().display(),
                    out.text()
                );
            }
            assert!(
                start.elapsed() < DAEMON_START,
                "the daemon did not create {} within {DAEMON_START:?}",
                sock.display()
            );
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// The file where it records its persistent vRNICs: beside its state dir.
    pub fn persist_file(&self) -> PathBuf {
        persist_file(&self.dir)
    }

    /// `vrnic` (in the daemon's network namespace, if it has one).
    fn command(&self) -> Command {
        match &self.netns {
            Some(ns) => {
                let mut c = Command::new("nsenter");
                c.arg(format!("--net=/run/netns/{ns}")).arg(vrnic_bin());
                c
            }
            None => Command::new(vrnic_bin()),
        }
    }

    /// SIGKILLs the daemon (its state dir stays, as a crash leaves it) and returns what it
    /// printed.
    pub fn kill(&mut self) -> Output {
        let mut p = self.proc.take().expect("daemon running");
        p.signal(libc::SIGKILL);
        p.wait(DAEMON_STOP)
    }

    /// A `vrnic --state-dir DIR` command on this daemon.
    pub fn cli(&self) -> Command {
        let mut c = self.command();
        c.arg("--state-dir").arg(&self.dir);
        c
    }

    /// `vrnic run --state-dir DIR -- args` (a fresh vRNIC for the command).
    pub fn run(&self, args: &[&str]) -> Command {
        self.run_on(None, args)
    }

    /// `vrnic run --state-dir DIR [--vrnic NAME] -- args`.
    pub fn run_on(&self, vrnic: Option<&str>, args: &[&str]) -> Command {
        let mut c = self.cli();
        c.arg("run");
        if let Some(n) = vrnic {
            c.arg("--vrnic").arg(n);
        }
        c.arg("--").args(args);
        c
    }

    /// Runs `vrnic --state-dir DIR args...` to completion within [`CLI`].
    pub fn cli_output(&self, args: &[&str]) -> Output {
        let mut c = self.cli();
        c.args(args);
        output(c, &format!("vrnic {}", args.join(" ")), CLI)
    }

    /// The daemon's pid (0 once stopped).
    pub fn pid(&self) -> i32 {
        self.proc.as_ref().map(|p| p.pid()).unwrap_or(0)
    }

    /// Whether the daemon process is still running.
    pub fn alive(&mut self) -> bool {
        self.proc.as_mut().is_some_and(|p| !p.exited())
    }

    /// `vrnic ls` output (bounded by [`CLI`]).
    pub fn ls(&self) -> String {
        let out = self.cli_output(&["ls"]);
        assert!(out.ok(), "vrnic ls failed\n{}", out.text());
        out.stdout
    }

    /// Polls `vrnic ls` until `pred` holds, for at most `limit`; panics with the last listing.
    pub fn wait_ls(&self, limit: Duration, what: &str, pred: impl Fn(&str) -> bool) -> String {
        let start = Instant::now();
        loop {
            let ls = self.ls();
            if pred(&ls) {
                return ls;
            }
            assert!(
                start.elapsed() < limit,
                "{what}: not within {limit:?}; vrnic ls:\n{ls}"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Stops the daemon with SIGTERM and returns its output (panics if it does not exit within
    /// [`DAEMON_STOP`]; it is SIGKILLed then).
    pub fn stop(&mut self) -> Output {
        let mut p = self.proc.take().expect("daemon running");
        p.signal(libc::SIGTERM);
        p.wait(DAEMON_STOP)
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        if let Some(mut p) = self.proc.take() {
            p.signal(libc::SIGTERM);
            let out = p.wait_bounded(DAEMON_STOP);
            if std::thread::panicking() || out.timed_out {
                eprintln!(
                    "--- daemon on {} ({:?}{}):\n{}",
                    self.dir.display(),
                    out.status,
                    if out.timed_out {
                        ", ignored SIGTERM, killed"
                    } else {
                        ""
                    },
                    out.stderr
                );
            }
        }
        remove_state_dir(&self.dir);
    }
}

/// The file where a daemon on state dir `dir` records its persistent vRNICs (`vrnic create`'s),
/// beside the dir: `DIR.vnics.json`.
pub fn persist_file(dir: &Path) -> PathBuf {
    let mut f = dir.as_os_str().to_owned();
    f.push(".vnics.json");
    PathBuf::from(f)
}

/// Removes the file of persistent vRNICs of state dir `dir` (and a temporary one a killed
/// daemon left).
fn remove_persist_file(dir: &Path) {
    let f = persist_file(dir);
    let _ = std::fs::remove_file(&f);
    let mut tmp = f.into_os_string();
    tmp.push(".tmp");
    let _ = std::fs::remove_file(tmp);
}

/// Removes a state dir (and its file of persistent vRNICs beside it), taking down a tmpfs a
/// killed daemon left mounted on it.
pub fn remove_state_dir(dir: &Path) {
    remove_persist_file(dir);
    if std::fs::remove_dir_all(dir).is_ok() || !dir.exists() {
        return;
    }
    let mut umount = Command::new("umount");
    umount.arg("-l").arg(dir);
    let _ = Proc::spawn(umount, "umount").wait_timeout(CLI);
    let _ = std::fs::remove_dir_all(dir);
}

/// Both sides of a client/server pair.
#[derive(Debug)]
pub struct Pair {
    pub server: Output,
    pub client: Output,
}

impl Pair {
    /// Both exited 0 in time; otherwise panics with everything both printed.
    pub fn assert_ok(&self) {
        assert!(self.server.ok() && self.client.ok(), "pair failed\n{self}");
    }
}

impl std::fmt::Display for Pair {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        for (side, o) in [("server", &self.server), ("client", &self.client)] {
            writeln!(
                f,
                "--- {side} ({:?}{}):\n{}",
                o.status,
                if o.timed_out {
                    ", timed out, killed"
                } else {
                    ""
                },
                o.text()
            )?;
        }
        Ok(())
    }
}

/// Asserts that an `rping -v` pair (both sides `-v`, `-C n`) exchanged `n` pings: the client
/// printed `n` lines `ping data: ...` and the server `n` lines `server ping data: ...`. With
/// `-V` the client also compares every byte of each ping it reads back, and fails the run
/// (`data mismatch`) on a difference.
pub fn assert_rping_count(pair: &Pair, n: usize) {
    let count =
        |o: &Output, prefix: &str| o.stdout.lines().filter(|l| l.starts_with(prefix)).count();
    assert_eq!(
        count(&pair.client, "ping data: "),
        n,
        "client pings\n{pair}"
    );
    assert_eq!(
        count(&pair.server, "server ping data: "),
        n,
        "server pings\n{pair}"
    );
}

/// The two sides of a verbose `rping` pair: `rping -s -a ADDR -p PORT extra...` and
/// `rping -c -a ADDR -p PORT extra...`, with `-v` added where `extra` lacks it, so that each
/// side prints a line per ping for [`Rping::assert_counted`] to count. `rping` exits 0 whenever
/// it ends disconnected, even after one ping: only the count shows that the run was whole.
pub struct Rping<'a> {
    pub server: Vec<&'a str>,
    pub client: Vec<&'a str>,
    /// The `-C` count of `extra`.
    pub count: usize,
}

impl<'a> Rping<'a> {
    /// Panics unless `extra` names `-C COUNT` (without it `rping` pings for ever).
    pub fn new(addr: &'a str, port: &'a str, extra: &[&'a str]) -> Rping<'a> {
        let count = extra
            .iter()
            .position(|a| *a == "-C")
            .and_then(|i| extra.get(i + 1))
            .and_then(|c| c.parse().ok())
            .expect("an rping pair names its -C count");
        let side = |flag: &'a str| {
            let mut args = vec!["rping", flag, "-a", addr, "-p", port];
            args.extend_from_slice(extra);
            if !extra.contains(&"-v") {
                args.push("-v");
            }
            args
        };
        Rping {
            server: side("-s"),
            client: side("-c"),
            count,
        }
    }

    /// Both sides exchanged the `-C` count of pings ([`assert_rping_count`]).
    pub fn assert_counted(&self, pair: &Pair) {
        assert_rping_count(pair, self.count);
    }
}

/// Whether a client failed only because its server was not listening yet.
fn refused(out: &Output) -> bool {
    // TCP exchanges say "Couldn't connect"; rdma_cm clients report the IB CM's reject of a
    // port nobody listens on yet (reason 8, after the broker's wait for a listener).
    let said = |s: &str| out.stderr.contains(s) || out.stdout.contains(s);
    !out.ok()
        && !out.timed_out
        && (said("Couldn't connect")
            || (said("REJECTED") && (said("error 8") || said("error: 8")))
            || said("Connection refused"))
}

/// Runs `server_args` under `vrnic run`, then `client_args` under `vrnic run` (each on a fresh
/// vRNIC), retrying the client while it only fails because the server is not listening yet
/// ("Couldn't connect", or an rdma_cm reject for no listener; for at most 10 s). Everything is bounded by `limit`: what still runs then is
/// killed and reported as `timed_out`. Never panics on the programs' account.
pub fn run_pair(d: &Daemon, server_args: &[&str], client_args: &[&str], limit: Duration) -> Pair {
    run_pair_on(d, d, server_args, client_args, limit)
}

/// [`run_pair`] with the server on one daemon's fresh vRNIC and the client on another's (on
/// another host: another network namespace).
pub fn run_pair_on(
    on_server: &Daemon,
    on_client: &Daemon,
    server_args: &[&str],
    client_args: &[&str],
    limit: Duration,
) -> Pair {
    let start = Instant::now();
    let left = || limit.saturating_sub(start.elapsed());
    let connect_window = limit.min(Duration::from_secs(10));
    let mut server = Proc::spawn(
        on_server.run(server_args),
        &format!("server {}", server_args[0]),
    );
    let client = loop {
        let c = Proc::spawn(
            on_client.run(client_args),
            &format!("client {}", client_args[0]),
        );
        let out = c.wait_bounded(left());
        if refused(&out) && start.elapsed() < connect_window && !server.exited() {
            std::thread::sleep(Duration::from_millis(50));
            continue;
        }
        break out;
    };
    // A client that failed leaves a server waiting for it: give it a few seconds, not all.
    let server_limit = if client.ok() {
        left().max(Duration::from_secs(5))
    } else {
        left().min(Duration::from_secs(5))
    };
    let server = server.wait_bounded(server_limit);
    Pair { server, client }
}

/// After an attack or a crash: the daemon is alive and an unrelated pair of unmodified
/// `ibv_rc_pingpong -c` on fresh vRNICs passes.
pub fn unrelated_pair_passes(d: &mut Daemon) {
    assert!(d.alive(), "the daemon died");
    require("ibv_rc_pingpong");
    let p = port().to_string();
    let (server, client) = pingpong_sides(&["ibv_rc_pingpong", "-c", "-n", "100"], &p, "localhost");
    run_pair(d, &server, &client, Duration::from_secs(60)).assert_ok();
    assert!(d.alive(), "the daemon died");
}

/// The sides of a pair of ibverbs-utils or perftest programs: `args... -p PORT` for the
/// server and `args... -p PORT ADDR` for its client (which names its server last).
pub fn pingpong_sides<'a>(
    args: &[&'a str],
    port: &'a str,
    addr: &'a str,
) -> (Vec<&'a str>, Vec<&'a str>) {
    let mut server = args.to_vec();
    server.extend(["-p", port]);
    let mut client = server.clone();
    client.push(addr);
    (server, client)
}

/// Runs a pair ([`run_pair`]) on a fresh daemon, each side on a fresh vRNIC, and checks both
/// exit 0.
pub fn fresh_pair(server: &[&str], client: &[&str], limit: Duration) -> Pair {
    let d = Daemon::start();
    let pair = run_pair(&d, server, client, limit);
    pair.assert_ok();
    pair
}

/// Runs `prog extra... -p PORT` as a server and `prog extra... -p PORT localhost` as its client,
/// each on a fresh vRNIC of a fresh daemon, and checks both exit 0.
pub fn server_client(prog: &str, extra: &[&str], limit: Duration) -> Pair {
    require(prog);
    let p = port().to_string();
    let mut args = vec![prog];
    args.extend_from_slice(extra);
    let (server, client) = pingpong_sides(&args, &p, "localhost");
    fresh_pair(&server, &client, limit)
}

/// Spawns `server`, waits (at most `up`) until it listens on TCP `port` ([`wait_listening`]),
/// then spawns `client`: a pair, both still running, for a test that acts while they run
/// (kills one, reads counters, shrinks a region) or then waits for them ([`finish_pair`]).
/// `what` names them in messages (`WHAT server`, `WHAT client`).
pub fn start_pair(
    server: Command,
    client: Command,
    port: u16,
    up: Duration,
    what: &str,
) -> (Proc, Proc) {
    let server = wait_listening(Proc::spawn(server, &format!("{what} server")), port, up);
    let client = Proc::spawn(client, &format!("{what} client"));
    (server, client)
}

/// Waits for a pair [`start_pair`] started: the client for at most `limit`, then the server
/// ([`pair_of`]'s bounds).
pub fn finish_pair(server: Proc, client: Proc, limit: Duration) -> Pair {
    let client = client.wait_bounded(limit);
    server_after(server, client, limit)
}

/// Waits for the server of a client that ended: at most `limit` after a client that passed,
/// 5 s after one that failed (the server would wait for that client for ever).
fn server_after(server: Proc, client: Output, limit: Duration) -> Pair {
    let server = server.wait_bounded(if client.ok() {
        limit
    } else {
        Duration::from_secs(5)
    });
    Pair { server, client }
}

/// Spawns `server`, then the client that `client` makes, and hands both back once a client
/// has run for `settle` without ending: a transfer under way, for a fault to hit. For servers
/// whose port cannot be watched from here, as [`start_pair`] does (on another host: another
/// network namespace). A client that ends sooner (its server did not listen yet) is started
/// again, for at most 20 s; then it panics with what the last one printed. `what` names them
/// in messages.
pub fn start_transfer(
    server: Command,
    mut client: impl FnMut() -> Command,
    settle: Duration,
    what: &str,
) -> (Proc, Proc) {
    let server = Proc::spawn(server, &format!("{what} server"));
    let start = Instant::now();
    loop {
        let mut c = Proc::spawn(client(), &format!("{what} client"));
        std::thread::sleep(settle);
        if !c.exited() {
            return (server, c);
        }
        if start.elapsed() >= Duration::from_secs(20) {
            let out = c.wait_bounded(Duration::ZERO);
            panic!(
                "the {what} client never started: each ended within {settle:?}, for 20 s\n{}",
                out.text()
            );
        }
    }
}

/// Whether some socket listens on TCP `port` (IPv4 or IPv6), from `/proc/net/tcp{,6}`. Unlike a
/// test connection, this does not take the place of the client a server waits for.
pub fn listening(port: u16) -> bool {
    let want = format!(":{port:04X}");
    ["/proc/net/tcp", "/proc/net/tcp6"].iter().any(|f| {
        std::fs::read_to_string(f).is_ok_and(|t| {
            t.lines().skip(1).any(|l| {
                let mut cols = l.split_whitespace();
                let local = cols.nth(1).unwrap_or("");
                let state = cols.nth(1).unwrap_or("");
                local.ends_with(&want) && state == "0A"
            })
        })
    })
}

/// Waits (at most `limit`) until `server` listens on `port` and hands it back; panics with its
/// output if it exits or does not listen in time.
pub fn wait_listening(mut server: Proc, port: u16, limit: Duration) -> Proc {
    let start = Instant::now();
    while !listening(port) {
        let exited = server.exited();
        if exited || start.elapsed() > limit {
            let name = server.name.clone();
            let out = server.wait_bounded(Duration::ZERO);
            let what = if exited {
                "exited before listening"
            } else {
                "does not listen"
            };
            panic!("{name} {what} on port {port}\n{}", out.text());
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    server
}

/// Builds `tests/c/NAME.c` with the system's `cc` (against the installed rdma-core headers,
/// linking `libs`) into this test target's tmp dir, once per test process, and returns the
/// program's path. nextest runs tests in parallel processes: each builds its own file and
/// renames it into place, which is atomic. A missing compiler or header is a failure.
pub fn c_program(name: &str, libs: &[&str]) -> PathBuf {
    let src = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/c")
        .join(format!("{name}.c"));
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR"));
    let out = dir.join(name);
    let tmp = dir.join(format!("{name}.{}.tmp", std::process::id()));
    let cc = Command::new("cc")
        .args(["-O2", "-Wall", "-Werror", "-o"])
        .arg(&tmp)
        .arg(&src)
        .args(libs)
        .output()
        .unwrap_or_else(|e| {
            panic!("cannot run cc: {e} (bash scripts/test installs gcc and the -dev packages)")
        });
    assert!(
        cc.status.success(),
        "compiling {} failed (libibverbs-dev / librdmacm-dev installed? bash scripts/test \
         installs them):\n{}",
        src.display(),
        String::from_utf8_lossy(&cc.stderr)
    );
    std::fs::rename(&tmp, &out).expect("move the program into place");
    out
}

/// Runs a two-process C check (`BIN server PORT MODE` and `BIN client 127.0.0.1 PORT MODE`) on
/// a fresh daemon, each side on its own vRNIC, and checks both exit 0.
pub fn c_check_pair(bin: &Path, mode: &str) -> Pair {
    c_check_pair_on(&Daemon::start(), bin, &[mode], Duration::from_secs(60))
}

/// [`c_check_pair`], and each side printed ` MODE done` and no `FAIL`.
pub fn c_check_done(bin: &Path, mode: &str) -> Pair {
    let pair = c_check_pair(bin, mode);
    for side in [&pair.server, &pair.client] {
        assert!(
            side.stdout.contains(&format!(" {mode} done")),
            "{}",
            side.stdout
        );
        assert!(!side.stdout.contains("FAIL"), "{}", side.stdout);
    }
    pair
}

/// [`c_check_pair_across`] with both sides on `d` (the client reaches 127.0.0.1).
pub fn c_check_pair_on(d: &Daemon, bin: &Path, args: &[&str], limit: Duration) -> Pair {
    c_check_pair_across(d, d, "127.0.0.1", bin, args, limit)
}

/// Runs a two-process C check, `BIN server PORT args...` on a fresh vRNIC of `on_server` and
/// `BIN client ADDR PORT args...` on one of `on_client` (ADDR: the server's host), within
/// `limit` ([`run_pair_on`]), and checks both exit 0.
pub fn c_check_pair_across(
    on_server: &Daemon,
    on_client: &Daemon,
    addr: &str,
    bin: &Path,
    args: &[&str],
    limit: Duration,
) -> Pair {
    let bin = bin.to_str().expect("utf-8 path");
    let p = port().to_string();
    let mut server = vec![bin, "server", &p];
    server.extend_from_slice(args);
    let mut client = vec![bin, "client", addr, &p];
    client.extend_from_slice(args);
    let pair = run_pair_on(on_server, on_client, &server, &client, limit);
    pair.assert_ok();
    pair
}

/// `tests/c/fanout_check.c`, one app talking to two peers at once: `server PORT 1` on a fresh
/// vRNIC of `s1` and `server PORT 2` on one of `s2`, then one client on `c` reaching them at
/// `a1` and `a2` (it retries its TCP connects until they listen), the client within `limit`,
/// the servers 30 s after it. All three must exit 0, the client having checked every byte
/// with both peers.
pub fn fanout_check(
    c: &Daemon,
    (s1, a1): (&Daemon, &str),
    (s2, a2): (&Daemon, &str),
    limit: Duration,
) {
    let bin = c_program("fanout_check", &["-libverbs"]);
    let bin = bin.to_str().expect("utf-8 path");
    let (p1, p2) = (port().to_string(), port().to_string());
    let s1 = Proc::spawn(s1.run(&[bin, "server", &p1, "1"]), "server 1");
    let s2 = Proc::spawn(s2.run(&[bin, "server", &p2, "2"]), "server 2");
    let c = Proc::spawn(c.run(&[bin, "client", a1, &p1, a2, &p2]), "client").wait_bounded(limit);
    let s1 = s1.wait_bounded(Duration::from_secs(30));
    let s2 = s2.wait_bounded(Duration::from_secs(30));
    assert!(
        c.ok() && s1.ok() && s2.ok(),
        "client:\n{}\nserver 1:\n{}\nserver 2:\n{}",
        c.text(),
        s1.text(),
        s2.text()
    );
    assert!(
        c.stdout.contains("OK client: both peers, every byte"),
        "{}",
        c.text()
    );
}

/// `vrnic create NAME --group GROUP --ip IP` on `d`, checked.
pub fn create_in(d: &Daemon, name: &str, group: &str, ip: &str) {
    let out = d.cli_output(&["create", name, "--group", group, "--ip", ip]);
    assert!(out.ok(), "vrnic create {name}\n{}", out.text());
}

/// `server` on vRNIC `s` of `ds`, `client` on vRNIC `c` of `dc`, within `limit` (the client
/// retried while the server does not listen yet, as [`pair_of`] does).
pub fn pair_on(
    (ds, s): (&Daemon, &str),
    server: &[&str],
    (dc, c): (&Daemon, &str),
    client: &[&str],
    limit: Duration,
) -> Pair {
    pair_of(
        ds.run_on(Some(s), server),
        || dc.run_on(Some(c), client),
        limit,
    )
}

impl Daemon {
    /// `vrnic create NAME` (a vRNIC that stays until removed), checked.
    pub fn create(&self, name: &str) {
        let out = self.cli_output(&["create", name]);
        assert!(out.ok(), "vrnic create {name}\n{}", out.text());
    }
}

/// Runs `server`, then the command `client` makes, retried (for at most 30 s) while it fails
/// only because the server does not listen yet; everything bounded by `limit`. For sides that
/// are not plain `vrnic run` commands (containers, region-only contexts).
pub fn pair_of(server: Command, mut client: impl FnMut() -> Command, limit: Duration) -> Pair {
    let start = Instant::now();
    let srv = Proc::spawn(server, "server");
    let client = loop {
        let out = Proc::spawn(client(), "client").wait_bounded(limit);
        let said = |s: &str| out.stdout.contains(s) || out.stderr.contains(s);
        let early = !out.ok() && !out.timed_out && (said("Couldn't connect") || said("REJECTED"));
        if early && start.elapsed() < Duration::from_secs(30) {
            std::thread::sleep(Duration::from_millis(200));
            continue;
        }
        break out;
    };
    server_after(srv, client, limit)
}
