//! What the bench starts and makes, and its removal: child processes (each in a process group
//! of its own, output to files; a [`Hold`] pipe as the stdin of those that run until it
//! ends), private daemons on state dirs under the bench's scratch dir,
//! network namespaces, the scratch dir itself.
//!
//! Everything is registered in one process-wide [`Registry`] as it is made and unregistered as
//! its guard drops, so an early return, a panic (the release profile unwinds) and a signal
//! (the thread of [`super::sys::Blocked::wait`] calls [`teardown_and_exit`]) all leave nothing behind:
//! apps are killed with their groups, daemons get SIGTERM (they unmount their tmpfs) and then
//! SIGKILL, state dirs a killed daemon left mounted are unmounted lazily, namespaces deleted.

use std::ffi::OsStr;
use std::fs::File;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::Mutex;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};

use super::sys;

/// How a child is stopped when it is still running at cleanup.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Stop {
    /// SIGKILL to its process group (apps, tools).
    Kill,
    /// SIGTERM, a grace period, then SIGKILL (daemons, which remove their mounts on SIGTERM).
    Term,
}

/// How long a daemon may take to exit after SIGTERM.
const DAEMON_STOP: Duration = Duration::from_secs(10);

/// What exists now and must be removed if the bench is interrupted.
struct Registry {
    /// A signal arrived: nothing new may start.
    closing: bool,
    procs: Vec<(i32, Stop)>,
    netns: Vec<String>,
    dirs: Vec<PathBuf>,
}

static REGISTRY: Mutex<Registry> = Mutex::new(Registry {
    closing: false,
    procs: Vec::new(),
    netns: Vec::new(),
    dirs: Vec::new(),
});

fn registry() -> std::sync::MutexGuard<'static, Registry> {
    REGISTRY.lock().unwrap_or_else(|e| e.into_inner())
}

/// Removes everything registered (processes, dirs, namespaces) and exits with `code`; for the
/// signal thread. The registry stays locked until the exit, so the main thread, which touches
/// it whenever a guard drops, cannot end the process first (with another status, or while the
/// removal goes on).
pub fn teardown_and_exit(code: i32) -> ! {
    let mut r = registry();
    r.closing = true;
    for &(pid, stop) in &r.procs {
        match stop {
            Stop::Kill => {
                sys::kill_group(pid, libc::SIGKILL);
                sys::kill(pid, libc::SIGKILL);
            }
            Stop::Term => sys::kill(pid, libc::SIGTERM),
        }
    }
    let start = Instant::now();
    for &(pid, _) in &r.procs {
        while running(pid) && start.elapsed() < DAEMON_STOP {
            std::thread::sleep(Duration::from_millis(10));
        }
        if running(pid) {
            sys::kill_group(pid, libc::SIGKILL);
            sys::kill(pid, libc::SIGKILL);
        }
    }
    for d in r.dirs.iter().rev() {
        remove_dir(d);
    }
    for n in &r.netns {
        let _ = Command::new("ip").args(["netns", "del", n]).status();
    }
    std::process::exit(code)
}

/// Whether `pid` is alive and not a zombie (this thread cannot reap another's children).
fn running(pid: i32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        // The state follows the command name in parentheses.
        Ok(s) => s
            .rsplit_once(')')
            .is_some_and(|(_, rest)| !rest.trim_start().starts_with(['Z', 'X'])),
        Err(_) => false,
    }
}

/// Removes a directory tree, unmounting (lazily) what a killed daemon left mounted in it.
fn remove_dir(dir: &Path) {
    if std::fs::remove_dir_all(dir).is_ok() || !dir.exists() {
        return;
    }
    let _ = Command::new("umount")
        .arg("-l")
        .arg(dir)
        .stderr(Stdio::null())
        .status();
    // Mounts below it (a vRNIC's quota tmpfs), if the dir itself was not one.
    if let Ok(mounts) = std::fs::read_to_string("/proc/self/mounts") {
        for m in mounts.lines().filter_map(|l| l.split_whitespace().nth(1)) {
            if Path::new(m).starts_with(dir) {
                let _ = Command::new("umount").args(["-l", m]).status();
            }
        }
    }
    let _ = std::fs::remove_dir_all(dir);
}

/// Where a command runs: in a network namespace (`nsenter --net`), on chosen cores (`taskset
/// -c`), both, or neither. Both tools `exec` the command, so its pid is the child's.
#[derive(Clone, Default)]
pub struct Launch {
    /// `/run/netns/NAME`.
    pub netns: Option<String>,
    /// A `taskset -c` list.
    pub cpus: Option<String>,
}

impl Launch {
    /// On these cores (if any), in this launch's namespace.
    pub fn on(&self, cpus: Option<String>) -> Launch {
        Launch {
            netns: self.netns.clone(),
            cpus,
        }
    }

    /// `program` wrapped as this launch says.
    pub fn command(&self, program: impl AsRef<OsStr>) -> Command {
        let mut argv: Vec<&OsStr> = Vec::new();
        let ns;
        if let Some(n) = &self.netns {
            ns = format!("--net=/run/netns/{n}");
            argv.extend([OsStr::new("nsenter"), OsStr::new(&ns)]);
        }
        if let Some(c) = &self.cpus {
            argv.extend([OsStr::new("taskset"), OsStr::new("-c"), OsStr::new(c)]);
        }
        argv.push(program.as_ref());
        let mut cmd = Command::new(argv[0]);
        cmd.args(&argv[1..]);
        cmd
    }
}

/// The bench's scratch dir: compiled tools, logs, daemons' state dirs. Removed on drop.
pub struct Scratch {
    pub dir: PathBuf,
    seq: AtomicU32,
}

impl Scratch {
    /// A fresh `vrnic-bench-PID` dir under the temp dir, with `logs/` in it.
    pub fn new() -> Result<Scratch> {
        let dir = std::env::temp_dir().join(format!("vrnic-bench-{}", std::process::id()));
        remove_dir(&dir);
        std::fs::create_dir_all(dir.join("logs"))
            .with_context(|| format!("create {}", dir.display()))?;
        registry().dirs.push(dir.clone());
        Ok(Scratch {
            dir,
            seq: AtomicU32::new(0),
        })
    }

    /// A fresh numbered path in the scratch dir (`NNNN-name`).
    pub fn path(&self, name: &str) -> PathBuf {
        let n = self.seq.fetch_add(1, Ordering::Relaxed);
        self.dir.join(format!("{n:04}-{name}"))
    }

    /// Spawns `cmd` (stdin closed, output to files in `logs/`) in a process group of its own.
    pub fn spawn(&self, cmd: Command, name: &str, stop: Stop) -> Result<Proc> {
        self.spawn_with_stdin(cmd, name, stop, Stdio::null())
    }

    /// Spawns `cmd` as [`Scratch::spawn`] does, with `hold`'s pipe as its stdin: a program
    /// that runs until its stdin ends (`bench/holdqp.c`) runs until [`Hold::release`].
    pub fn spawn_held(&self, cmd: Command, name: &str, hold: &Hold) -> Result<Proc> {
        let stdin = hold.reader.try_clone().context("dup the hold pipe")?;
        self.spawn_with_stdin(cmd, name, Stop::Kill, stdin.into())
    }

    fn spawn_with_stdin(
        &self,
        mut cmd: Command,
        name: &str,
        stop: Stop,
        stdin: Stdio,
    ) -> Result<Proc> {
        let base = self.dir.join("logs").join(format!(
            "{:04}-{}",
            self.seq.fetch_add(1, Ordering::Relaxed),
            name.replace(|c: char| !c.is_ascii_alphanumeric(), "_")
        ));
        let out = base.with_extension("out");
        let err = base.with_extension("err");
        cmd.stdin(stdin)
            .stdout(File::create(&out).context("create a log file")?)
            .stderr(File::create(&err).context("create a log file")?);
        std::os::unix::process::CommandExt::process_group(&mut cmd, 0);
        // Spawned under the registry's lock, so a signal cannot fall between the spawn and the
        // registration.
        let mut r = registry();
        if r.closing {
            bail!("interrupted");
        }
        let child = cmd
            .spawn()
            .with_context(|| format!("cannot run {name} ({:?})", cmd.get_program()))?;
        r.procs.push((child.id() as i32, stop));
        drop(r);
        Ok(Proc {
            child,
            name: name.to_string(),
            out,
            err,
            stop,
            status: None,
        })
    }

    /// Runs `cmd` to its end (at most `limit`) and returns what it printed; an error if it
    /// failed or ran out of time.
    pub fn output(&self, cmd: Command, name: &str, limit: Duration) -> Result<String> {
        let f = self.spawn(cmd, name, Stop::Kill)?.finish(limit);
        f.check(name)?;
        Ok(f.stdout)
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        remove_dir(&self.dir);
        registry().dirs.retain(|d| d != &self.dir);
    }
}

/// A pipe whose read end is the stdin of programs that run until their stdin ends
/// ([`Scratch::spawn_held`]): [`Hold::release`] (or the drop) closes the only write end, so
/// all of them see the end at once. Both ends are close-on-exec, so no other child keeps the
/// write end open.
pub struct Hold {
    reader: std::io::PipeReader,
    writer: Option<std::io::PipeWriter>,
}

impl Hold {
    pub fn new() -> Result<Hold> {
        let (reader, writer) = std::io::pipe().context("make a pipe")?;
        Ok(Hold {
            reader,
            writer: Some(writer),
        })
    }

    /// Ends the stdin of every program spawned with this hold.
    pub fn release(&mut self) {
        self.writer = None;
    }
}

/// A running child; stopped (see [`Stop`]) and reaped on drop.
pub struct Proc {
    child: Child,
    pub name: String,
    out: PathBuf,
    err: PathBuf,
    stop: Stop,
    status: Option<ExitStatus>,
}

/// What a finished child printed.
pub struct Finished {
    pub status: Option<ExitStatus>,
    pub stdout: String,
    pub stderr: String,
    /// It was still running at its deadline and was killed.
    pub timed_out: bool,
}

impl Finished {
    /// Exited 0 in time.
    pub fn ok(&self) -> bool {
        !self.timed_out && self.status.is_some_and(|s| s.success())
    }

    /// An error naming `what` with the end of what it printed, unless it exited 0 in time.
    pub fn check(&self, what: &str) -> Result<()> {
        if self.ok() {
            return Ok(());
        }
        bail!(
            "{what} {}\n{}",
            if self.timed_out {
                "ran out of time (killed)".to_string()
            } else {
                format!(
                    "failed ({})",
                    self.status.map_or("?".into(), |s| s.to_string())
                )
            },
            self.tail()
        )
    }

    /// The last lines of its output, for error messages.
    pub fn tail(&self) -> String {
        let tail = |s: &str| {
            let lines: Vec<&str> = s.lines().collect();
            lines[lines.len().saturating_sub(8)..].join("\n")
        };
        format!(
            "  stdout: {}\n  stderr: {}",
            tail(&self.stdout),
            tail(&self.stderr)
        )
    }
}

impl Proc {
    /// Whether what it printed so far holds `needle` (its output is read from its log file,
    /// so a program must flush: run it under `stdbuf -oL`).
    pub fn printed(&self, needle: &str) -> bool {
        std::fs::read_to_string(&self.out).is_ok_and(|o| o.contains(needle))
    }

    /// Stops (`SIGSTOP`) or continues (`SIGCONT`) its process group.
    pub fn pause(&self, on: bool) {
        sys::kill_group(self.pid(), if on { libc::SIGSTOP } else { libc::SIGCONT });
    }

    /// Its pid (also its process group's id).
    pub fn pid(&self) -> i32 {
        self.child.id() as i32
    }

    /// Whether it has exited (it is reaped, and [`Proc::finish`] reports its status).
    pub fn exited(&mut self) -> bool {
        if self.status.is_none() {
            self.status = self.child.try_wait().ok().flatten();
        }
        self.status.is_some()
    }

    /// Waits at most `limit` for it to exit (then stops it), and returns what it printed.
    pub fn finish(mut self, limit: Duration) -> Finished {
        let start = Instant::now();
        while !self.exited() && start.elapsed() < limit {
            std::thread::sleep(Duration::from_millis(5));
        }
        let timed_out = !self.exited();
        if timed_out {
            self.stop_now();
        }
        Finished {
            status: self.status,
            stdout: std::fs::read_to_string(&self.out).unwrap_or_default(),
            stderr: std::fs::read_to_string(&self.err).unwrap_or_default(),
            timed_out,
        }
    }

    /// Stops it as its [`Stop`] says and reaps it.
    fn stop_now(&mut self) {
        if self.exited() {
            return;
        }
        if self.stop == Stop::Term {
            sys::kill(self.pid(), libc::SIGTERM);
            let start = Instant::now();
            while !self.exited() && start.elapsed() < DAEMON_STOP {
                std::thread::sleep(Duration::from_millis(10));
            }
            if self.exited() {
                return;
            }
        }
        // Still unreaped, so the pid (and group id) cannot have been reused.
        sys::kill_group(self.pid(), libc::SIGKILL);
        sys::kill(self.pid(), libc::SIGKILL);
        self.status = self.child.wait().ok();
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        self.stop_now();
        let pid = self.pid();
        registry().procs.retain(|&(p, _)| p != pid);
    }
}

/// A network namespace made with `ip netns add`, deleted on drop.
pub struct Netns {
    pub name: String,
}

impl Netns {
    /// Makes the namespace `name` (root) with its loopback up.
    pub fn new(name: &str) -> Result<Netns> {
        {
            let mut r = registry();
            if r.closing {
                bail!("interrupted");
            }
            r.netns.push(name.to_string());
        }
        let ns = Netns {
            name: name.to_string(),
        };
        ip(&["netns", "add", name])?;
        ip(&["-n", name, "link", "set", "lo", "up"])?;
        Ok(ns)
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        let _ = Command::new("ip")
            .args(["netns", "del", &self.name])
            .stderr(Stdio::null())
            .status();
        registry().netns.retain(|n| n != &self.name);
    }
}

/// Runs `ip args...`, an error with its output if it fails.
pub fn ip(args: &[&str]) -> Result<()> {
    let out = Command::new("ip")
        .args(args)
        .stdin(Stdio::null())
        .output()
        .context("cannot run ip (iproute2)")?;
    if !out.status.success() {
        bail!(
            "ip {} failed: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(())
}

/// Deletes the namespaces `vrbench<PID>...` of bench runs that were killed outright (their pid
/// no longer runs), which no cleanup could remove.
pub fn remove_stale_netns() {
    let Ok(dir) = std::fs::read_dir("/run/netns") else {
        return;
    };
    for e in dir.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        let Some(rest) = name.strip_prefix(NETNS_PREFIX) else {
            continue;
        };
        let pid: String = rest.chars().take_while(char::is_ascii_digit).collect();
        if !pid.is_empty() && !Path::new(&format!("/proc/{pid}")).exists() {
            let _ = Command::new("ip").args(["netns", "del", &name]).status();
        }
    }
}

/// The prefix of the bench's namespace names (`vrbench<PID><host>`).
pub const NETNS_PREFIX: &str = "vrbench";

/// A free TCP port: a counter over a block of 1000 chosen by pid, checked free by binding it.
pub fn port() -> Result<u16> {
    static NEXT: AtomicU32 = AtomicU32::new(0);
    let block = 20000 + (std::process::id() % 30) as u16 * 1000;
    for _ in 0..1000 {
        let p = block + (NEXT.fetch_add(1, Ordering::Relaxed) % 1000) as u16;
        if std::net::TcpListener::bind(("0.0.0.0", p)).is_ok() {
            return Ok(p);
        }
    }
    bail!("no free TCP port in {block}..{}", block + 1000)
}

/// Whether process `pid` has a TCP socket listening on `port`, in its own network namespace
/// (`/proc/PID/net/tcp{,6}`). Unlike a test connection, this takes no client's place.
pub fn listening(pid: i32, port: u16) -> bool {
    let want = format!(":{port:04X}");
    ["tcp", "tcp6"].iter().any(|f| {
        std::fs::read_to_string(format!("/proc/{pid}/net/{f}")).is_ok_and(|t| {
            t.lines().skip(1).any(|l| {
                let mut cols = l.split_whitespace();
                let local = cols.nth(1).unwrap_or("");
                let state = cols.nth(1).unwrap_or("");
                local.ends_with(&want) && state == "0A"
            })
        })
    })
}

/// Waits (at most `limit`) until `p` listens on `port`; an error with its output if it exits
/// first or does not listen in time.
pub fn wait_listening(p: &mut Proc, port: u16, limit: Duration) -> Result<()> {
    let start = Instant::now();
    while !listening(p.pid(), port) {
        if p.exited() || start.elapsed() > limit {
            let what = if p.exited() {
                "exited before listening"
            } else {
                "does not listen"
            };
            let out = std::fs::read_to_string(&p.out).unwrap_or_default();
            let err = std::fs::read_to_string(&p.err).unwrap_or_default();
            bail!(
                "{} {what} on port {port}\n  stdout: {}\n  stderr: {}",
                p.name,
                out.trim_end(),
                err.trim_end()
            );
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    Ok(())
}

/// A private `vrnic serve` on a state dir in the scratch dir; stopped (SIGTERM) and its dir
/// removed on drop.
pub struct Daemon {
    /// Its state dir.
    pub dir: PathBuf,
    /// Where it runs (its apps run in the same namespace).
    pub launch: Launch,
    vrnic: PathBuf,
    proc: Option<Proc>,
}

impl Daemon {
    /// Starts `vrnic serve` with `extra` options as `launch` says, and waits (at most 10 s)
    /// until its admin socket exists.
    pub fn start(
        scratch: &Scratch,
        vrnic: &Path,
        launch: Launch,
        extra: &[String],
    ) -> Result<Daemon> {
        let dir = scratch.path("state");
        std::fs::create_dir_all(&dir).with_context(|| format!("create {}", dir.display()))?;
        registry().dirs.push(dir.clone());
        let mut d = Daemon {
            dir,
            launch,
            vrnic: vrnic.to_path_buf(),
            proc: None,
        };
        let mut cmd = d.launch.command(vrnic);
        cmd.arg("--state-dir").arg(&d.dir).arg("serve").args(extra);
        let mut p = scratch.spawn(cmd, "vrnic-serve", Stop::Term)?;
        let sock = d.dir.join("vrnic.sock");
        let start = Instant::now();
        while !sock.exists() {
            if p.exited() || start.elapsed() > Duration::from_secs(10) {
                let f = p.finish(Duration::ZERO);
                bail!("vrnic serve did not start\n{}", f.tail());
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        d.proc = Some(p);
        Ok(d)
    }

    /// `vrnic --state-dir DIR run -- args...` in the daemon's namespace, on `cpus`.
    pub fn run(&self, cpus: Option<String>, args: &[String]) -> Command {
        let mut c = self.launch.on(cpus).command(&self.vrnic);
        c.arg("--state-dir")
            .arg(&self.dir)
            .arg("run")
            .arg("--")
            .args(args);
        c
    }

    /// `vrnic --state-dir DIR run --vrnic NAME -- args...`: on the vRNIC `name`, made if
    /// missing.
    pub fn run_on(&self, name: &str, cpus: Option<String>, args: &[String]) -> Command {
        let mut c = self.launch.on(cpus).command(&self.vrnic);
        c.arg("--state-dir")
            .arg(&self.dir)
            .args(["run", "--vrnic", name, "--"])
            .args(args);
        c
    }

    /// The daemon's pid, while it runs.
    pub fn pid(&self) -> Option<i32> {
        self.proc.as_ref().map(Proc::pid)
    }

    /// `vrnic --state-dir DIR args...` (a short CLI command).
    pub fn cli(&self, args: &[&str]) -> Command {
        let mut c = Command::new(&self.vrnic);
        c.arg("--state-dir").arg(&self.dir).args(args);
        c
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        drop(self.proc.take());
        remove_dir(&self.dir);
        registry().dirs.retain(|d| d != &self.dir);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Held programs run until the hold is released, then all see the end of their stdin;
    /// another child started meanwhile does not keep the pipe's write end open.
    #[test]
    fn held_programs_end_when_the_hold_is_released() {
        let scratch = Scratch::new().unwrap();
        let mut hold = Hold::new().unwrap();
        let mut held: Vec<Proc> = (0..2)
            .map(|i| {
                let cmd = Command::new("cat");
                scratch.spawn_held(cmd, &format!("cat {i}"), &hold).unwrap()
            })
            .collect();
        let mut other = Command::new("sleep");
        other.arg("60");
        let other = scratch.spawn(other, "sleep", Stop::Kill).unwrap();
        assert!(held.iter_mut().all(|p| !p.exited()));
        hold.release();
        for p in held {
            assert!(p.finish(Duration::from_secs(10)).ok());
        }
        let f = other.finish(Duration::ZERO);
        assert!(f.timed_out, "sleep 60 was still running, and is stopped");
    }
}
