//! Root's daemon and normal users, as real users (README, "Who may use root's daemon"): root
//! runs `vrnic serve` on the system state dir; a user whose CLI finds no daemon of its own
//! uses root's when it is a member of the daemon's access group, and is told plainly that
//! permission is missing (and the two ways out) when it is not. A member gets what a tenant
//! gets: vRNICs of its own for its apps, never root's or another's, and no operator commands.
//!
//! The test makes a group and two users (`groupadd`, `useradd`) and removes them at the end;
//! the commands run as those users through `setpriv`.

mod common;

use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use common::{CLI, Output, Proc, output, require, vrnic_bin};

const SYSTEM_DIR: &str = "/run/vrnic";

/// A Unix group and users made for the test, removed when dropped.
struct Accounts {
    group: String,
    users: Vec<String>,
}

impl Accounts {
    fn new(group: &str) -> Accounts {
        let _ = Command::new(require("groupdel")).arg(group).output();
        let out = Command::new(require("groupadd"))
            .arg(group)
            .output()
            .expect("groupadd");
        assert!(out.status.success(), "groupadd {group}: {out:?}");
        Accounts {
            group: group.to_string(),
            users: Vec::new(),
        }
    }

    /// A user of its own primary group, in the test's group too if `member`; its uid and gid.
    fn user(&mut self, name: &str, member: bool) -> (u32, u32) {
        let _ = Command::new(require("userdel")).arg(name).output();
        let mut c = Command::new(require("useradd"));
        c.args([
            "--no-create-home",
            "--shell",
            "/usr/sbin/nologin",
            "--user-group",
        ]);
        if member {
            c.args(["--groups", &self.group]);
        }
        let out = c.arg(name).output().expect("useradd");
        assert!(out.status.success(), "useradd {name}: {out:?}");
        self.users.push(name.to_string());
        let id = |flag: &str| -> u32 {
            let out = Command::new(require("id"))
                .args([flag, name])
                .output()
                .expect("id");
            String::from_utf8_lossy(&out.stdout).trim().parse().unwrap()
        };
        (id("-u"), id("-g"))
    }
}

impl Drop for Accounts {
    fn drop(&mut self) {
        for u in &self.users {
            let _ = Command::new("userdel").arg(u).output();
        }
        let _ = Command::new("groupdel").arg(&self.group).output();
    }
}

/// Root's daemon on the system state dir, stopped (and its tmpfs gone) when dropped.
struct RootDaemon(Option<Proc>);

impl RootDaemon {
    fn start(args: &[&str]) -> RootDaemon {
        let sock = Path::new(SYSTEM_DIR).join("vrnic.sock");
        assert!(
            std::os::unix::net::UnixStream::connect(&sock).is_err(),
            "a daemon already serves {SYSTEM_DIR}: stop it to run this test"
        );
        let mut c = Command::new(vrnic_bin());
        c.arg("serve")
            .args(["--no-persist", "--region-gib", "1"])
            .args(args)
            .env_remove("VRNIC_STATE_DIR");
        let mut p = Proc::spawn(c, "root's vrnic serve");
        let start = Instant::now();
        while std::os::unix::net::UnixStream::connect(&sock).is_err() {
            assert!(
                !p.exited() && start.elapsed() < common::DAEMON_START,
                "root's daemon did not start\n{}",
                p.wait(CLI).text()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        RootDaemon(Some(p))
    }

    fn stop(&mut self) -> Output {
        let mut p = self.0.take().expect("running");
        p.signal(libc::SIGTERM);
        p.wait(common::DAEMON_STOP)
    }
}

impl Drop for RootDaemon {
    fn drop(&mut self) {
        if let Some(mut p) = self.0.take() {
            p.signal(libc::SIGTERM);
            let _ = p.wait_timeout(common::DAEMON_STOP);
        }
        if mounted(Path::new(SYSTEM_DIR)) {
            let _ = Command::new("umount").args(["-l", SYSTEM_DIR]).output();
        }
        let _ = std::fs::remove_dir(SYSTEM_DIR);
    }
}

/// Whether something is mounted on `dir`.
fn mounted(dir: &Path) -> bool {
    let info = std::fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
    let dir = dir.display().to_string();
    info.lines()
        .any(|l| l.split_whitespace().nth(4) == Some(dir.as_str()))
}

/// A copy of `vrnic` and its driver library that any user can run.
fn public_vrnic(dir: &Path) -> PathBuf {
    std::fs::create_dir_all(dir).unwrap();
    std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o755)).unwrap();
    let bin = dir.join("vrnic");
    std::fs::copy(vrnic_bin(), &bin).expect("copy the vrnic binary");
    let shim = vrnic_bin().with_file_name("libvrnic_shim.so");
    std::fs::copy(&shim, dir.join("libvrnic_shim.so")).expect("copy the driver library");
    for f in [bin.clone(), dir.join("libvrnic_shim.so")] {
        std::fs::set_permissions(f, std::fs::Permissions::from_mode(0o755)).unwrap();
    }
    bin
}

/// `vrnic ARGS` as uid/gid, with its supplementary groups (`member`) or none, and no hint of
/// a state dir in its environment: what a user types.
fn as_user(bin: &Path, (uid, gid): (u32, u32), member: bool, args: &[&str]) -> Command {
    let mut c = Command::new(require("setpriv"));
    c.args([&format!("--reuid={uid}"), &format!("--regid={gid}")]);
    c.arg(if member {
        "--init-groups"
    } else {
        "--clear-groups"
    });
    c.arg("--")
        .arg(bin)
        .args(args)
        .current_dir("/")
        .env_remove("XDG_RUNTIME_DIR")
        .env_remove("VRNIC_STATE_DIR")
        .env_remove("VRNIC_LOG");
    c
}

#[test]
fn roots_daemon_admits_its_group_as_tenants_and_tells_others_why_not() {
    common::require_root("this test makes users and runs root's daemon");
    require("ibv_devinfo");
    let tag = std::process::id() % 100_000;
    let group = format!("vrnict{tag}");
    let mut accounts = Accounts::new(&group);
    let member = accounts.user(&format!("vrnicm{tag}"), true);
    let outsider = accounts.user(&format!("vrnico{tag}"), false);
    let bindir = std::env::temp_dir().join(format!("vrnic-access-bin-{}", std::process::id()));
    let bin = public_vrnic(&bindir);
    let _rm_bin = Defer(|| {
        let _ = std::fs::remove_dir_all(&bindir);
    });

    let mut daemon = RootDaemon::start(&["--access-group", &group]);
    let sock = std::fs::metadata(Path::new(SYSTEM_DIR).join("vrnic.sock")).unwrap();
    assert_eq!(
        (sock.uid(), sock.mode() & 0o777),
        (0, 0o660),
        "admin socket"
    );

    // Not a member: told that it is a permission problem, whose daemon it is, whom it admits
    // and the two ways out; never that no daemon runs.
    for args in [&["run", "--", "ibv_devinfo"][..], &["ls"]] {
        let out = output(
            as_user(&bin, outsider, false, args),
            "vrnic as a non-member",
            CLI,
        );
        let want = format!(
            "permission denied: root's daemon at {SYSTEM_DIR} admits members of group {group}; \
             add yourself (usermod -aG {group} $USER"
        );
        assert!(
            !out.ok()
                && out.stderr.contains(&want)
                && out
                    .stderr
                    .contains("run your own daemon with `vrnic serve` as yourself")
                && !out.stderr.contains("no daemon running"),
            "{args:?}\n{}",
            out.text()
        );
    }

    // A member: its app sees a vRNIC of root's daemon.
    let out = output(
        as_user(&bin, member, true, &["run", "--", "ibv_devinfo"]),
        "vrnic run -- ibv_devinfo as a member",
        CLI,
    );
    assert!(
        out.ok() && out.stdout.contains("hca_id:") && out.stdout.contains("PORT_ACTIVE"),
        "{}",
        out.text()
    );

    // ... on a vRNIC that is its own: its region and socket are the member's alone.
    let mut held = Proc::spawn(
        as_user(
            &bin,
            member,
            true,
            &["run", "--vrnic", "mine", "--", "sleep", "30"],
        ),
        "a member's vrnic run",
    );
    let region = Path::new(SYSTEM_DIR).join("mine/region");
    let start = Instant::now();
    while !region.exists() {
        assert!(start.elapsed() < CLI && !held.exited(), "no vRNIC mine");
        std::thread::sleep(Duration::from_millis(20));
    }
    for f in ["region", "sock"] {
        let m = std::fs::symlink_metadata(Path::new(SYSTEM_DIR).join("mine").join(f)).unwrap();
        assert_eq!((m.uid(), m.mode() & 0o077), (member.0, 0), "mine/{f}");
    }
    // Another user's app cannot attach to it, even told where it is.
    let mut c = Command::new(require("setpriv"));
    c.args([
        &format!("--reuid={}", outsider.0),
        &format!("--regid={}", outsider.1),
        "--clear-groups",
        "ibv_devinfo",
    ])
    .env("LD_PRELOAD", bindir.join("libvrnic_shim.so"))
    .env("VRNIC_DEVICE", Path::new(SYSTEM_DIR).join("mine"))
    .env_remove("VRNIC_LOG");
    let out = output(c, "ibv_devinfo on another user's vRNIC", CLI);
    assert!(
        !out.ok()
            && out
                .stderr
                .contains("permission denied (a vRNIC is its daemon's user's"),
        "{}",
        out.text()
    );
    // The member lists only its own; root sees both.
    let root_ls = |args: &[&str]| {
        let mut c = Command::new(vrnic_bin());
        c.args(args).env_remove("VRNIC_STATE_DIR");
        output(c, "root's vrnic", CLI)
    };
    let out = root_ls(&["create", "rootnic"]);
    assert!(out.ok(), "{}", out.text());
    let out = output(as_user(&bin, member, true, &["ls"]), "ls as a member", CLI);
    assert!(
        out.ok() && out.stdout.contains("mine") && !out.stdout.contains("rootnic"),
        "{}",
        out.text()
    );
    let out = root_ls(&["ls"]);
    assert!(
        out.stdout.contains("mine") && out.stdout.contains("rootnic"),
        "{}",
        out.text()
    );
    // Root's vRNIC is not the member's to attach to, nor are the operator's commands.
    let out = output(
        as_user(
            &bin,
            member,
            true,
            &["run", "--vrnic", "rootnic", "--", "ibv_devinfo"],
        ),
        "a member on root's vRNIC",
        CLI,
    );
    assert!(
        !out.ok()
            && out
                .stderr
                .contains("permission denied: vRNIC rootnic is not yours"),
        "{}",
        out.text()
    );
    for args in [
        &["create", "x"][..],
        &["rm", "--force", "rootnic"],
        &["rm", "mine"],
    ] {
        let out = output(as_user(&bin, member, true, args), "operator command", CLI);
        assert!(
            !out.ok() && out.stderr.contains("permission denied") && out.stderr.contains("root"),
            "{args:?}\n{}",
            out.text()
        );
    }
    assert!(root_ls(&["ls"]).stdout.contains("rootnic"));
    held.signal(libc::SIGTERM);
    let _ = held.wait_timeout(CLI);

    let out = daemon.stop();
    assert!(out.ok(), "{}", out.text());
    assert!(
        !mounted(Path::new(SYSTEM_DIR)),
        "the state dir's tmpfs stayed"
    );
}

#[test]
fn roots_daemon_without_its_group_admits_root_only_and_says_so() {
    common::require_root("this test makes users and runs root's daemon");
    let tag = std::process::id() % 100_000;
    let group = format!("vrnicg{tag}");
    let mut accounts = Accounts::new(&group);
    let user = accounts.user(&format!("vrnicu{tag}"), true);
    let bindir = std::env::temp_dir().join(format!("vrnic-access-bin2-{}", std::process::id()));
    let bin = public_vrnic(&bindir);
    let _rm_bin = Defer(|| {
        let _ = std::fs::remove_dir_all(&bindir);
    });
    // The daemon is told of a group that does not exist: root only.
    let missing = format!("vrnicnone{tag}");
    let mut daemon = RootDaemon::start(&["--access-group", &missing]);
    let sock = std::fs::metadata(Path::new(SYSTEM_DIR).join("vrnic.sock")).unwrap();
    assert_eq!((sock.uid(), sock.mode() & 0o777), (0, 0o600));
    let out = output(as_user(&bin, user, true, &["ls"]), "ls as a user", CLI);
    assert!(
        !out.ok()
            && out.stderr.contains(&format!(
                "permission denied: root's daemon at {SYSTEM_DIR} admits root only"
            ))
            && out.stderr.contains("groupadd"),
        "{}",
        out.text()
    );
    let out = daemon.stop();
    assert!(
        out.ok() && out.stderr.contains("no such group"),
        "{}",
        out.text()
    );
}

/// Runs a closure when dropped (clean-up that must happen on a failed assertion too).
struct Defer<F: FnMut()>(F);

impl<F: FnMut()> Drop for Defer<F> {
    fn drop(&mut self) {
        (self.0)()
    }
}
