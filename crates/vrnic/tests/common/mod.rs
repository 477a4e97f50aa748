//! Test harness: a daemon on a private state dir, commands under `vrnic run`, server/client
//! pairs of unmodified programs, all with deadlines and cleanup on drop (no test can hang or
//! leave a process behind).
#![allow(dead_code)]

use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicU16, Ordering};
use std::time::{Duration, Instant};

/// The `vrnic` binary: `$VRNIC_BIN` (the release build, as `scripts/test` sets it) or the one
/// cargo built for this test.
pub fn vrnic_bin() -> PathBuf {
    std::env::var_os("VRNIC_BIN")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_BIN_EXE_vrnic")))
}

/// A TCP port for a pingpong pair, unique within this test process and unlikely to collide
/// with other test processes.
pub fn port() -> u16 {
    static NEXT: AtomicU16 = AtomicU16::new(0);
    let base = 20000 + (std::process::id() % 2000) as u16 * 10;
    base + NEXT.fetch_add(1, Ordering::Relaxed) % 10
}

/// Whether a Debian tool is installed (the suite's script installs them; a missing one fails).
pub fn require(tool: &str) -> PathBuf {
    for dir in ["/usr/bin", "/usr/local/bin", "/bin"] {
        let p = Path::new(dir).join(tool);
        if p.exists() {
            return p;
        }
    }
    panic!(
        "{tool} is not installed: run `bash scripts/test`, which installs ibverbs-utils and friends"
    );
}

/// A child killed (with its process group) on drop.
pub struct Proc {
    pub child: Child,
    pub name: String,
}

impl Proc {
    pub fn spawn(mut cmd: Command, name: &str) -> Proc {
        use std::os::unix::process::CommandExt;
        cmd.stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .stdin(Stdio::null())
            .process_group(0);
        let child = cmd.spawn().unwrap_or_else(|e| panic!("spawn {name}: {e}"));
        Proc {
            child,
            name: name.to_string(),
        }
    }

    pub fn pid(&self) -> i32 {
        self.child.id() as i32
    }

    /// Waits up to `limit`; on timeout kills the group and panics with what it printed.
    pub fn wait(mut self, limit: Duration) -> Output {
        let start = Instant::now();
        loop {
            if let Some(status) = self.child.try_wait().expect("try_wait") {
                return self.collect(status);
            }
            if start.elapsed() > limit {
                kill_group(self.pid(), libc::SIGKILL);
                let status = self.child.wait().expect("wait");
                let out = self.collect(status);
                panic!(
                    "{} did not finish in {limit:?}\nstdout:\n{}\nstderr:\n{}",
                    self.name, out.stdout, out.stderr
                );
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// Waits up to `limit` without panicking; `None` on timeout (the group is killed).
    pub fn wait_timeout(mut self, limit: Duration) -> Option<Output> {
        let start = Instant::now();
        loop {
            if let Some(status) = self.child.try_wait().expect("try_wait") {
                return Some(self.collect(status));
            }
            if start.elapsed() > limit {
                kill_group(self.pid(), libc::SIGKILL);
                let _ = self.child.wait();
                return None;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    fn collect(&mut self, status: ExitStatus) -> Output {
        let mut stdout = String::new();
        let mut stderr = String::new();
        if let Some(mut o) = self.child.stdout.take() {
            let _ = o.read_to_string(&mut stdout);
        }
        if let Some(mut e) = self.child.stderr.take() {
            let _ = e.read_to_string(&mut stderr);
        }
        Output {
            status,
            stdout,
            stderr,
        }
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            kill_group(self.pid(), libc::SIGKILL);
            let _ = self.child.wait();
        }
    }
}

pub fn kill_group(pgid: i32, sig: i32) {
    // SAFETY: kill(2) with a negative pid signals a process group we created; no memory involved.
    unsafe { libc::kill(-pgid, sig) };
}

/// What a finished process printed.
#[derive(Debug)]
pub struct Output {
    pub status: ExitStatus,
    pub stdout: String,
    pub stderr: String,
}

impl Output {
    pub fn ok(&self) -> bool {
        self.status.success()
    }
}

/// A daemon on a fresh state dir, stopped (SIGTERM) and cleaned up on drop.
pub struct Daemon {
    pub dir: PathBuf,
    proc: Option<Proc>,
}

static SEQ: AtomicU16 = AtomicU16::new(0);

impl Daemon {
    pub fn start() -> Daemon {
        let dir = std::env::temp_dir().join(format!(
            "vrnic-test-{}-{}",
            std::process::id(),
            SEQ.fetch_add(1, Ordering::Relaxed)
        ));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("state dir");
        let mut cmd = Command::new(vrnic_bin());
        cmd.arg("serve")
            .arg("--state-dir")
            .arg(&dir)
            .env("RUST_LOG", "info");
        let mut proc = Proc::spawn(cmd, "vrnic serve");
        let sock = dir.join("vrnic.sock");
        let start = Instant::now();
        while !sock.exists() {
            if let Ok(Some(status)) = proc.child.try_wait() {
                let out = proc.collect(status);
                panic!("daemon exited at start: {}", out.stderr);
            }
            assert!(
                start.elapsed() < Duration::from_secs(10),
                "daemon did not create {}",
                sock.display()
            );
            std::thread::sleep(Duration::from_millis(10));
        }
        Daemon {
            dir,
            proc: Some(proc),
        }
    }

    /// A `vrnic` command on this daemon's state dir.
    pub fn cli(&self) -> Command {
        let mut c = Command::new(vrnic_bin());
        c.arg("--state-dir").arg(&self.dir);
        c
    }

    /// `vrnic run [--vrnic NAME] -- args`.
    pub fn run(&self, vnic: Option<&str>, args: &[&str]) -> Command {
        let mut c = self.cli();
        c.arg("run");
        if let Some(n) = vnic {
            c.arg("--vrnic").arg(n);
        }
        c.arg("--").args(args);
        c
    }

    pub fn pid(&self) -> i32 {
        self.proc.as_ref().map(|p| p.pid()).unwrap_or(0)
    }

    pub fn alive(&mut self) -> bool {
        self.proc
            .as_mut()
            .is_some_and(|p| matches!(p.child.try_wait(), Ok(None)))
    }

    /// `vrnic ls` output.
    pub fn ls(&self) -> String {
        let out = self.cli().arg("ls").output().expect("vrnic ls");
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    /// Stops the daemon with SIGTERM and returns its output.
    pub fn stop(&mut self) -> Output {
        let p = self.proc.take().expect("running");
        // SAFETY: signals our own child.
        unsafe { libc::kill(p.pid(), libc::SIGTERM) };
        p.wait(Duration::from_secs(10))
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        if let Some(p) = self.proc.take() {
            // SAFETY: signals our own child.
            unsafe { libc::kill(p.pid(), libc::SIGTERM) };
            let _ = p.wait_timeout(Duration::from_secs(10));
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Both sides of a client/server pair.
#[derive(Debug)]
pub struct Pair {
    pub server: Output,
    pub client: Output,
}

impl Pair {
    pub fn assert_ok(&self) {
        assert!(
            self.server.ok() && self.client.ok(),
            "pair failed\n--- server ({:?}) stdout:\n{}\nstderr:\n{}\n--- client ({:?}) stdout:\n{}\nstderr:\n{}",
            self.server.status,
            self.server.stdout,
            self.server.stderr,
            self.client.status,
            self.client.stdout,
            self.client.stderr
        );
    }
}

/// Runs `server_args` under `vrnic run`, then `client_args` (retried while the server is not yet
/// listening), each on its own vRNIC; both must finish within `limit`.
pub fn run_pair(d: &Daemon, server_args: &[&str], client_args: &[&str], limit: Duration) -> Pair {
    let start = Instant::now();
    let server = Proc::spawn(d.run(None, server_args), server_args[0]);
    let client = loop {
        let c = Proc::spawn(d.run(None, client_args), client_args[0]);
        let out = c.wait(limit);
        let refused = !out.ok()
            && (out.stderr.contains("Couldn't connect") || out.stdout.contains("Couldn't connect"));
        if refused && start.elapsed() < Duration::from_secs(10) {
            std::thread::sleep(Duration::from_millis(100));
            continue;
        }
        break out;
    };
    let left = limit
        .saturating_sub(start.elapsed())
        .max(Duration::from_secs(5));
    let server = server.wait(left);
    Pair { server, client }
}

/// Runs `prog extra... -p PORT` as a server and `prog extra... -p PORT localhost` as its client,
/// each on a fresh vRNIC of a fresh daemon, and checks both exit 0.
pub fn server_client(prog: &str, extra: &[&str], limit: Duration) -> Pair {
    require(prog);
    let d = Daemon::start();
    let p = port().to_string();
    let mut server = vec![prog, "-p", &p];
    server.extend_from_slice(extra);
    let mut client = server.clone();
    client.push("localhost");
    let pair = run_pair(&d, &server, &client, limit);
    pair.assert_ok();
    pair
}
