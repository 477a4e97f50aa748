//! A daemon in a mount namespace of its own (`ip netns exec`, the first thing a user with one
//! machine tries for two hosts): the CLI and apps outside it are told so, by pid, with the ways
//! out, and the ways out work; the daemon says so at start. And the systemd unit we ship:
//! `systemd-analyze verify` passes it, and it asks for no mount namespace.

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Instant;

use common::{CLI, DAEMON_START, DAEMON_STOP, Output, Proc, output, require, vrnic_bin};

/// A network namespace of the test's own, deleted on drop.
struct Netns(String);

impl Netns {
    fn add(tag: &str) -> Netns {
        let name = format!("vrmnt{tag}{}", std::process::id());
        let mut c = Command::new(require("ip"));
        c.args(["netns", "add", &name]);
        let out = output(c, "ip netns add", CLI);
        assert!(out.ok(), "ip netns add {name}\n{}", out.text());
        Netns(name)
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        let mut c = Command::new("ip");
        c.args(["netns", "del", &self.0]);
        let _ = Proc::spawn(c, "ip netns del").wait_timeout(CLI);
    }
}

/// `vrnic serve` on `dir` under `ip netns exec`, stopped on drop; `dir` removed then.
struct NsDaemon {
    proc: Option<Proc>,
    dir: PathBuf,
}

impl NsDaemon {
    /// Starts it and waits until its admin socket exists in its own mount namespace (seen
    /// through `/proc/PID/root`: `ip netns exec` execs the daemon, so the pid is its own).
    fn start(ns: &Netns, dir: PathBuf) -> NsDaemon {
        common::remove_state_dir(&dir);
        std::fs::create_dir_all(&dir).expect("create the state dir");
        let mut c = Command::new(require("ip"));
        c.args(["netns", "exec", &ns.0])
            .arg(vrnic_bin())
            .arg("serve")
            .arg("--state-dir")
            .arg(&dir)
            .arg("--no-persist")
            .env("RUST_LOG", "info");
        let mut d = NsDaemon {
            proc: Some(Proc::spawn(c, "ip netns exec vrnic serve")),
            dir,
        };
        let sock = Path::new(&format!("/proc/{}/root", d.pid())).join(
            d.dir
                .join("vrnic.sock")
                .strip_prefix("/")
                .expect("an absolute state dir"),
        );
        let start = Instant::now();
        while !sock.exists() {
            let p = d.proc.as_mut().expect("just spawned");
            if p.exited() {
                let out = d.proc.take().expect("just spawned").wait(DAEMON_STOP);
                panic!(
                    "`vrnic serve` under ip netns exec exited at start\n{}",
                    out.text()
                );
            }
            assert!(
                start.elapsed() < DAEMON_START,
                "the daemon did not create {} within {DAEMON_START:?}",
                sock.display()
            );
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        d
    }

    fn pid(&self) -> i32 {
        self.proc.as_ref().map_or(0, Proc::pid)
    }

    /// `vrnic --state-dir DIR args` from the test's own mount namespace.
    fn cli(&self, args: &[&str]) -> Output {
        let mut c = Command::new(vrnic_bin());
        c.arg("--state-dir").arg(&self.dir).args(args);
        output(c, &format!("vrnic {}", args.join(" ")), CLI)
    }

    /// The same inside the daemon's mount namespace, as the advice says.
    fn cli_inside(&self, args: &[&str]) -> Output {
        let mut c = Command::new(require("nsenter"));
        c.arg(format!("--mount=/proc/{}/ns/mnt", self.pid()))
            .arg(vrnic_bin())
            .arg("--state-dir")
            .arg(&self.dir)
            .args(args);
        output(c, &format!("nsenter --mount vrnic {}", args.join(" ")), CLI)
    }

    /// Stops it with SIGTERM; what it printed.
    fn stop(&mut self) -> Output {
        let mut p = self.proc.take().expect("daemon running");
        p.signal(libc::SIGTERM);
        p.wait(DAEMON_STOP)
    }
}

impl Drop for NsDaemon {
    fn drop(&mut self) {
        if let Some(mut p) = self.proc.take() {
            p.signal(libc::SIGTERM);
            let out = p.wait_bounded(DAEMON_STOP);
            if std::thread::panicking() {
                eprintln!("--- daemon under ip netns exec:\n{}", out.stderr);
            }
        }
        // Its mounts went with its mount namespace: the dir here is a plain one.
        common::remove_state_dir(&self.dir);
    }
}

/// Whether a tmpfs is mounted on `dir` in the mount namespace of process `pid`.
fn tmpfs_on(pid: i32, dir: &Path) -> bool {
    let info = std::fs::read_to_string(format!("/proc/{pid}/mountinfo")).unwrap_or_default();
    let dir = dir.display().to_string();
    info.lines().any(|l| {
        let f: Vec<&str> = l.split(' ').collect();
        f.get(4) == Some(&dir.as_str()) && l.contains(" - tmpfs ")
    })
}

/// The lines every message about a daemon in its own mount namespace carries.
fn assert_names_the_namespace(out: &Output, pid: i32) {
    let err = &out.stderr;
    assert!(!out.ok(), "it succeeded\n{}", out.text());
    for want in [
        format!("(pid {pid})"),
        "mount namespace of its own".to_string(),
        "ip netns exec".to_string(),
        format!("nsenter --mount=/proc/{pid}/ns/mnt vrnic"),
        "nsenter --net=/run/netns/NAME vrnic serve".to_string(),
    ] {
        assert!(err.contains(&want), "no {want:?} in\n{}", out.text());
    }
}

#[test]
fn the_cli_outside_names_a_daemon_under_ip_netns_exec_and_the_advice_works() {
    common::require_root("ip netns exec and the daemon's tmpfs need root");
    let ns = Netns::add("a");
    // On the target dir's disk, not a tmpfs: the daemon mounts one on its state dir, which
    // only its own mount namespace sees.
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("mntns-{}", std::process::id()));
    let mut d = NsDaemon::start(&ns, dir.clone());
    assert!(
        tmpfs_on(d.pid(), &dir) && !tmpfs_on(std::process::id() as i32, &dir),
        "the daemon's tmpfs on {} is not its own alone (is the target dir on a tmpfs?)",
        dir.display()
    );

    // Outside: not "no daemon running", but where it is and what to do.
    let ls = d.cli(&["ls"]);
    assert!(
        ls.stderr.contains(&format!(
            "no daemon running at {} as this process sees it",
            dir.display()
        )),
        "{}",
        ls.text()
    );
    assert_names_the_namespace(&ls, d.pid());
    let marker = dir.with_extension("ran");
    let _ = std::fs::remove_file(&marker);
    let run = d.cli(&["run", "--", "touch", marker.to_str().expect("utf-8 path")]);
    assert_names_the_namespace(&run, d.pid());
    assert!(!marker.exists(), "`vrnic run` ran its command");

    // The advice: in the daemon's mount namespace the CLI and apps find it.
    let inside = d.cli_inside(&["create", "v0"]);
    assert!(inside.ok(), "{}", inside.text());
    let inside = d.cli_inside(&["run", "--vrnic", "v0", "--", "ibv_devinfo", "-d", "v0"]);
    assert!(
        inside.ok() && inside.stdout.contains("PORT_ACTIVE"),
        "{}",
        inside.text()
    );

    // The daemon said so itself, naming its state dir.
    let log = d.stop();
    assert!(
        log.stderr
            .contains("this daemon runs in a mount namespace of its own")
            && log.stderr.contains(&dir.display().to_string()),
        "no warning in the daemon's log\n{}",
        log.text()
    );
}

#[test]
fn run_outside_is_told_its_vrnic_is_a_mount_it_cannot_see() {
    common::require_root("ip netns exec and the vRNICs' quota tmpfs need root");
    let ns = Netns::add("b");
    // On a tmpfs (/dev/shm): the daemon mounts nothing on its state dir, so its admin socket
    // is seen outside, but each vRNIC's directory is a quota tmpfs of its namespace.
    let dir = PathBuf::from(format!("/dev/shm/vrnic-mntns-{}", std::process::id()));
    let d = NsDaemon::start(&ns, dir.clone());
    let before = d.cli(&["ls"]);
    assert!(
        before.ok(),
        "the admin socket is not seen outside\n{}",
        before.text()
    );

    let marker = PathBuf::from(format!("{}.ran", dir.display()));
    let _ = std::fs::remove_file(&marker);
    let run = d.cli(&["run", "--", "touch", marker.to_str().expect("utf-8 path")]);
    let ran = marker.exists();
    let _ = std::fs::remove_file(&marker);
    assert!(
        run.stderr.contains("made the vRNIC at")
            && run.stderr.contains("but this process cannot see it"),
        "{}",
        run.text()
    );
    assert_names_the_namespace(&run, d.pid());
    assert!(!ran, "`vrnic run` ran its command on a vRNIC it cannot see");
    // The vRNIC it held went with the refused run (once the daemon saw the connection close).
    let start = Instant::now();
    loop {
        let ls = d.cli(&["ls"]);
        if ls.ok() && ls.stdout == before.stdout {
            break;
        }
        assert!(
            start.elapsed() < CLI,
            "the refused run's vRNIC stayed\nbefore:\n{}\nnow:\n{}",
            before.stdout,
            ls.text()
        );
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
}

/// Runs `args` (a program and its arguments) to completion within [`CLI`], asserting success.
fn sh(args: &[&str]) {
    let mut c = Command::new(args[0]);
    c.args(&args[1..]);
    let out = output(c, &args.join(" "), CLI);
    assert!(out.ok(), "{}\n{}", args.join(" "), out.text());
}

#[test]
fn a_daemon_in_its_own_mount_namespace_on_a_shared_state_dir_is_seen_outside() {
    // What a container with the host's state dir bound `rshared` is: the daemon's mounts
    // propagate back to the host, apps outside attach, and the daemon does not warn.
    common::require_root("mount namespaces and bind mounts need root");
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("shared-{}", std::process::id()));
    common::remove_state_dir(&dir);
    std::fs::create_dir_all(&dir).expect("create the state dir");
    let d = dir.to_str().expect("utf-8 path");
    sh(&["mount", "--bind", d, d]);
    struct Unbind<'a>(&'a Path);
    impl Drop for Unbind<'_> {
        fn drop(&mut self) {
            let _ = Command::new("umount").arg("-l").arg(self.0).output();
            common::remove_state_dir(self.0);
        }
    }
    let _unbind = Unbind(&dir);
    sh(&["mount", "--make-shared", d]);
    let mut c = Command::new(require("unshare"));
    c.args(["--mount", "--propagation", "unchanged"])
        .arg(vrnic_bin())
        .args(["serve", "--no-persist", "--state-dir", d])
        .env("RUST_LOG", "info");
    let mut daemon = Proc::spawn(c, "unshare vrnic serve");
    let start = Instant::now();
    while !dir.join("vrnic.sock").exists() {
        assert!(
            !daemon.exited() && start.elapsed() < DAEMON_START,
            "the daemon's admin socket did not appear outside its mount namespace"
        );
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    let mut c = Command::new(vrnic_bin());
    c.arg("--state-dir")
        .arg(&dir)
        .args(["run", "--", "ibv_devinfo"]);
    let run = output(c, "vrnic run -- ibv_devinfo", CLI);
    daemon.signal(libc::SIGTERM);
    let log = daemon.wait(DAEMON_STOP);
    assert!(
        run.ok() && run.stdout.contains("PORT_ACTIVE"),
        "{}",
        run.text()
    );
    assert!(
        !log.stderr.contains("mount namespace of its own"),
        "the daemon warned\n{}",
        log.text()
    );
}

/// Settings that give a unit a mount namespace of its own, whose mounts the host never sees.
const MOUNT_NAMESPACE_KEYS: &[&str] = &[
    "PrivateTmp",
    "PrivateDevices",
    "PrivateMounts",
    "ProtectSystem",
    "ProtectHome",
    "ProtectKernelTunables",
    "ProtectKernelModules",
    "ProtectKernelLogs",
    "ProtectControlGroups",
    "ProtectHostname",
    "ProtectProc",
    "ProcSubset",
    "ReadOnlyPaths",
    "ReadWritePaths",
    "InaccessiblePaths",
    "ExecPaths",
    "NoExecPaths",
    "TemporaryFileSystem",
    "BindPaths",
    "BindReadOnlyPaths",
    "RootDirectory",
    "RootImage",
    "MountAPIVFS",
    "DynamicUser",
    "MountFlags",
];

/// The unit we ship, under `contrib/systemd/`.
fn unit_file() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../contrib/systemd/vrnic.service")
}

/// `systemd-analyze verify` on the unit's text `unit`, as `vrnic.service` in a dir of its own.
fn verify(unit: &str) -> Output {
    static SEQ: AtomicU32 = AtomicU32::new(0);
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!(
        "unit-{}-{}",
        std::process::id(),
        SEQ.fetch_add(1, Ordering::Relaxed)
    ));
    std::fs::create_dir_all(&dir).expect("create the unit's dir");
    let file = dir.join("vrnic.service");
    std::fs::write(&file, unit).expect("write the unit");
    let mut c = Command::new(require("systemd-analyze"));
    c.arg("verify").arg(&file);
    let out = output(c, "systemd-analyze verify", CLI);
    let _ = std::fs::remove_dir_all(&dir);
    out
}

#[test]
fn the_systemd_unit_verifies_and_makes_no_mount_namespace() {
    let unit = std::fs::read_to_string(unit_file()).expect("read contrib/systemd/vrnic.service");
    let exec = unit
        .lines()
        .find_map(|l| l.strip_prefix("ExecStart="))
        .expect("the unit has an ExecStart");
    let mut words = exec.split_whitespace();
    let program = words.next().expect("ExecStart names a program");
    assert!(
        program.ends_with("/vrnic") && words.next() == Some("serve"),
        "ExecStart={exec}"
    );
    // Settings, not the comments that name them; `no` and its kin turn one off.
    let settings: Vec<(&str, &str)> = unit
        .lines()
        .map(str::trim)
        .filter(|l| !l.starts_with('#') && !l.starts_with(';'))
        .filter_map(|l| l.split_once('=').map(|(k, v)| (k.trim(), v.trim())))
        .collect();
    let on = |key: &str| {
        settings
            .iter()
            .any(|(k, v)| *k == key && !["no", "false", "off", "0", ""].contains(v))
    };
    let mounts_kept_off = settings
        .iter()
        .any(|(k, v)| *k == "PrivateMounts" && ["no", "false", "off", "0"].contains(v));
    for key in MOUNT_NAMESPACE_KEYS {
        assert!(
            !on(key),
            "the unit sets {key}=, which gives the daemon a mount namespace of its own"
        );
    }
    // A network namespace implies private mounts (systemd 254 and later) unless turned off.
    for key in ["PrivateNetwork", "NetworkNamespacePath"] {
        assert!(
            !on(key) || mounts_kept_off,
            "the unit sets {key}= without PrivateMounts=no"
        );
    }

    // Verified with the binary where the unit expects it, here the one under test.
    let ours = unit.replace(program, &vrnic_bin().display().to_string());
    let out = verify(&ours);
    assert!(
        out.ok() && !out.stderr.contains("vrnic.service"),
        "systemd-analyze verify\n{}",
        out.text()
    );
    // The check itself is no formality: a program that is not there fails it.
    let broken = unit.replace(program, "/nonexistent/vrnic");
    let out = verify(&broken);
    assert!(
        !out.ok(),
        "a missing ExecStart program verified\n{}",
        out.text()
    );
}
