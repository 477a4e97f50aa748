//! Unmodified Debian `ibverbs-utils` programs under `vrnic run`, two separate processes on one
//! daemon, and the CLI's behaviour around the daemon's lifecycle.

mod common;

use std::time::Duration;

use common::{Daemon, Proc, port, require};

#[test]
fn ibv_devices_lists_the_vrnic() {
    require("ibv_devices");
    let d = Daemon::start();
    let out = d
        .run(Some("devtest0"), &["ibv_devices"])
        .output()
        .expect("run");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "ibv_devices failed: {stdout} {}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stdout.contains("devtest0"), "vRNIC missing from:\n{stdout}");
    assert!(
        stdout.contains("0256520000"),
        "GUID missing from:\n{stdout}"
    );
}

#[test]
fn ibv_devinfo_shows_an_active_port_with_a_lid() {
    require("ibv_devinfo");
    let d = Daemon::start();
    let out = d.run(None, &["ibv_devinfo", "-v"]).output().expect("run");
    let s = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "ibv_devinfo failed: {s} {}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(s.contains("PORT_ACTIVE (4)"), "{s}");
    assert!(s.contains("link_layer:\t\tInfiniBand"), "{s}");
    let lid = s
        .lines()
        .find(|l| l.contains("port_lid:"))
        .expect("port_lid line");
    assert!(
        !lid.trim().ends_with(": 0") && !lid.trim().ends_with("\t0"),
        "zero LID: {lid}"
    );
    assert!(
        s.contains("GID[  0]:\t\tfe80:0000:0000:0000:0256:5200"),
        "{s}"
    );
    assert!(s.contains("max_qp_wr:\t\t\t16384"), "{s}");
}

fn pingpong(extra: &[&str]) {
    pingpong_with("ibv_rc_pingpong", extra);
}

fn pingpong_with(prog: &str, extra: &[&str]) {
    let pair = common::server_client(prog, extra, Duration::from_secs(120));
    for side in [&pair.server, &pair.client] {
        assert!(
            side.stdout.contains(" bytes in "),
            "no throughput line: {}",
            side.stdout
        );
        assert!(
            side.stdout.contains(" iters in "),
            "no latency line: {}",
            side.stdout
        );
    }
}

#[test]
fn rc_pingpong_defaults() {
    pingpong(&[]);
}

#[test]
fn rc_pingpong_completion_events() {
    pingpong(&["-e"]);
}

#[test]
fn rc_pingpong_checks_buffer_contents() {
    pingpong(&["-c"]);
}

#[test]
fn rc_pingpong_one_byte_inline() {
    pingpong(&["-s", "1"]);
}

#[test]
fn rc_pingpong_one_mebibyte() {
    pingpong(&["-s", "1048576"]);
}

#[test]
fn rc_pingpong_hundred_thousand_iterations() {
    pingpong(&["-n", "100000"]);
}

#[test]
fn rc_pingpong_by_gid() {
    pingpong(&["-g", "0"]);
}

#[test]
fn rc_pingpong_events_contents_odd_size() {
    pingpong(&["-e", "-c", "-s", "4097", "-n", "2000"]);
}

#[test]
fn uc_pingpong() {
    pingpong_with("ibv_uc_pingpong", &[]);
}

#[test]
fn uc_pingpong_checks_contents_inline() {
    pingpong_with("ibv_uc_pingpong", &["-c", "-s", "1"]);
}

#[test]
fn run_without_a_daemon_says_so() {
    let dir = std::env::temp_dir().join(format!("vrnic-nodaemon-{}", std::process::id()));
    let out = std::process::Command::new(common::vrnic_bin())
        .args(["--state-dir"])
        .arg(&dir)
        .args(["run", "--", "true"])
        .output()
        .expect("run");
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("no daemon running"), "{err}");
}

#[test]
fn a_second_daemon_on_the_same_state_dir_is_refused() {
    let d = Daemon::start();
    let out = d.cli().arg("serve").output().expect("serve");
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("already serves"), "{err}");
}

#[test]
fn sigterm_removes_what_the_daemon_created() {
    let mut d = Daemon::start();
    let created = d.cli().args(["create", "keepme"]).output().expect("create");
    assert!(
        created.status.success(),
        "{}",
        String::from_utf8_lossy(&created.stderr)
    );
    assert!(d.dir.join("keepme/region").exists());
    assert!(d.ls().contains("keepme"));
    let out = d.stop();
    assert!(out.ok(), "daemon exit: {:?} {}", out.status, out.stderr);
    let left: Vec<_> = std::fs::read_dir(&d.dir)
        .map(|r| r.flatten().map(|e| e.file_name()).collect())
        .unwrap_or_default();
    assert!(left.is_empty(), "left behind: {left:?}");
}

#[test]
fn a_stale_state_dir_is_cleaned_up_by_the_next_daemon() {
    let mut d = Daemon::start();
    let dir = d.dir.clone();
    assert!(
        d.cli()
            .args(["create", "stale0"])
            .status()
            .expect("create")
            .success()
    );
    // Kill without a chance to clean up, as a crash would.
    common::kill_group(d.pid(), libc::SIGKILL);
    std::thread::sleep(Duration::from_millis(200));
    let _ = d.alive();
    // A new daemon on the same dir takes over.
    let mut cmd = std::process::Command::new(common::vrnic_bin());
    cmd.arg("serve").arg("--state-dir").arg(&dir);
    let p = Proc::spawn(cmd, "second serve");
    let start = std::time::Instant::now();
    while !dir.join("vrnic.sock").exists() || dir.join("stale0").exists() {
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "stale vRNIC not cleaned up"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let ls = std::process::Command::new(common::vrnic_bin())
        .arg("--state-dir")
        .arg(&dir)
        .arg("ls")
        .output()
        .expect("ls");
    assert!(ls.status.success());
    assert!(!String::from_utf8_lossy(&ls.stdout).contains("stale0"));
    common::kill_group(p.pid(), libc::SIGTERM);
    let _ = p.wait_timeout(Duration::from_secs(10));
}

#[test]
fn ls_shows_lid_gid_and_qp_counts_of_a_running_app() {
    require("ibv_rc_pingpong");
    let d = Daemon::start();
    let p = port().to_string();
    // A server waiting for its client holds a vRNIC with one QP.
    let server = Proc::spawn(
        d.run(Some("lsnic"), &["ibv_rc_pingpong", "-p", &p]),
        "server",
    );
    let start = std::time::Instant::now();
    let ls = loop {
        let ls = d.ls();
        if ls
            .lines()
            .any(|l| l.starts_with("lsnic") && l.split_whitespace().nth(3) == Some("1"))
        {
            break ls;
        }
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "no QP shown:\n{ls}"
        );
        std::thread::sleep(Duration::from_millis(50));
    };
    assert!(ls.contains("fe80:0000:0000:0000:0256:5200"), "{ls}");
    drop(server);
    // Its vRNIC goes away with its last user.
    let start = std::time::Instant::now();
    while d.ls().contains("lsnic") {
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "vRNIC of a dead app not removed"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}
