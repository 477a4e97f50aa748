//! Unmodified Debian `ibverbs-utils` programs under `vrnic run`, two separate processes on one
//! daemon, and the CLI's behaviour around the daemon's lifecycle.

mod common;

use std::time::Duration;

use common::{CLI, Daemon, Proc, output, port, require};

#[test]
fn ibv_devices_lists_the_vrnic() {
    require("ibv_devices");
    let d = Daemon::start();
    let out = output(
        d.run_on(Some("devtest0"), &["ibv_devices"]),
        "ibv_devices",
        CLI,
    );
    let stdout = &out.stdout;
    assert!(out.ok(), "ibv_devices failed\n{}", out.text());
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
    let out = output(d.run(&["ibv_devinfo", "-v"]), "ibv_devinfo", CLI);
    assert!(out.ok(), "ibv_devinfo failed\n{}", out.text());
    let s = &out.stdout;
    assert!(s.contains("PORT_ACTIVE (4)"), "{s}");
    assert!(s.contains("link_layer:\t\tInfiniBand"), "{s}");
    for field in ["port_lid", "sm_lid"] {
        let value = field_value(s, field);
        assert!(
            value.parse::<u32>().is_ok_and(|v| v != 0),
            "{field} is {value:?}, expected a nonzero LID:\n{s}"
        );
    }
    assert!(
        s.contains("GID[  0]:\t\tfe80:0000:0000:0000:0256:5200"),
        "{s}"
    );
    assert!(s.contains("max_qp_wr:\t\t\t16384"), "{s}");
}

/// The value after `field:` on the first line that has it (`ibv_devinfo` prints `name:\t\tvalue`).
fn field_value<'a>(text: &'a str, field: &str) -> &'a str {
    let key = format!("{field}:");
    text.lines()
        .find_map(|l| l.trim_start().strip_prefix(key.as_str()))
        .unwrap_or_else(|| panic!("no {field} line in:\n{text}"))
        .trim()
}

fn pingpong(extra: &[&str]) {
    pingpong_with("ibv_rc_pingpong", extra);
}

/// Both sides exit 0 with their throughput and latency lines; with `-c`, neither printed
/// `invalid data in page` (the programs exit 0 after it: [`common::Output::ok`] fails on it).
/// What `-c` checks is little: the programs fill their buffer with 0x7b, the client writes the
/// same value (0: rdma-core's `i / page_size % sizeof(char)`) into byte 0 of each page before
/// each send, and the server compares byte 0 of each page with 0 once, after the last
/// iteration. So a `-c` run shows that the first byte of every page arrived at least once; it
/// checks neither the iteration nor the other bytes. Every byte of every iteration is the C
/// checks' claim (`verbs_c.rs`, `b2b_c.rs`, `across_hosts.rs` with `tests/c/stream_check.c`).
fn pingpong_with(prog: &str, extra: &[&str]) {
    let pair = common::server_client(prog, extra, Duration::from_secs(120));
    for side in [&pair.server, &pair.client] {
        assert!(
            side.stdout.contains("bytes in"),
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
fn rc_pingpong_c_first_byte_of_every_page_arrives() {
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
fn rc_pingpong_events_odd_size_first_byte_of_every_page_arrives() {
    pingpong(&["-e", "-c", "-s", "4097"]);
}

#[test]
fn rc_pingpong_new_send_api() {
    // -N: ibv_create_qp_ex + ibv_wr_* instead of ibv_post_send.
    pingpong(&["-N"]);
}

#[test]
fn rc_pingpong_extended_cq_with_timestamps() {
    // -t: ibv_create_cq_ex with completion timestamps, polled with start_poll/read_*.
    pingpong(&["-t"]);
}

#[test]
fn rc_pingpong_new_send_extended_cq_first_byte_of_every_page_arrives() {
    pingpong(&["-N", "-t", "-c"]);
}

#[test]
fn rc_pingpong_new_send_extended_cq_events_first_byte_of_every_page_arrives() {
    // With -e -t, rc_pingpong treats ENOENT from ibv_start_poll after a CQ event as fatal, but
    // an event can follow a completion its previous poll loop already took (the CQ was re-armed
    // before that loop; the window is wide here, where a send completes at once): the driver
    // queues an event only while its CQ holds a completion and withdraws it when a poll empties
    // the CQ first (`cq_events.rs`), re-arming. Without that, this test fails every run.
    pingpong(&["-N", "-t", "-e", "-c"]);
}

#[test]
fn uc_pingpong() {
    pingpong_with("ibv_uc_pingpong", &[]);
}

#[test]
fn uc_pingpong_inline_one_byte_arrives() {
    pingpong_with("ibv_uc_pingpong", &["-c", "-s", "1"]);
}

#[test]
fn run_without_a_daemon_says_so() {
    // A state dir that exists but has no daemon in it, and one that does not exist at all.
    let dir = std::env::temp_dir().join(format!("vrnic-nodaemon-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("mkdir");
    for state_dir in [dir.clone(), dir.join("missing")] {
        let mut cmd = std::process::Command::new(common::vrnic_bin());
        cmd.arg("--state-dir")
            .arg(&state_dir)
            .args(["run", "--", "true"]);
        let out = output(cmd, "vrnic run without a daemon", CLI);
        assert!(
            !out.ok(),
            "vrnic run succeeded without a daemon\n{}",
            out.text()
        );
        assert!(out.stderr.contains("no daemon"), "{}", out.text());
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_second_daemon_on_the_same_state_dir_is_refused() {
    let mut d = Daemon::start();
    // Bounded: a second daemon that wrongly starts serving is killed, and the test fails.
    let out = d.cli_output(&["serve"]);
    assert!(!out.ok(), "second daemon exited 0\n{}", out.text());
    assert!(out.stderr.contains("already"), "{}", out.text());
    // The first one is unharmed.
    assert!(d.alive(), "the first daemon died");
    assert!(
        d.dir.join("vrnic.sock").exists(),
        "the refused second daemon took the first one's socket away (did it unmount the state \
         dir's tmpfs?)"
    );
    d.ls();
}

#[test]
fn sigterm_removes_what_the_daemon_created() {
    let mut d = Daemon::start();
    let created = d.cli_output(&["create", "keepme"]);
    assert!(created.ok(), "{}", created.text());
    assert!(d.dir.join("keepme/region").exists());
    assert!(d.ls().contains("keepme"));
    // And one held by a running app.
    let app = Proc::spawn(d.run_on(Some("heldnic"), &["sleep", "30"]), "sleep");
    d.wait_ls(CLI, "the app's vRNIC listed", |ls| ls.contains("heldnic"));
    let out = d.stop();
    assert!(out.ok(), "daemon exit: {:?} {}", out.status, out.stderr);
    let left: Vec<_> = std::fs::read_dir(&d.dir)
        .map(|r| r.flatten().map(|e| e.file_name()).collect())
        .unwrap_or_default();
    assert!(left.is_empty(), "left behind: {left:?}");
    drop(app);
}

#[test]
fn a_stale_state_dir_is_cleaned_up_by_the_next_daemon() {
    let mut d = Daemon::start();
    let dir = d.dir.clone();
    // Held by a `vrnic run`: not recorded, so not made again (`persist.rs` has the vRNICs
    // `vrnic create` makes, which are).
    let _app = Proc::spawn(d.run_on(Some("stale0"), &["sleep", "30"]), "sleep");
    d.wait_ls(CLI, "stale0 listed", |ls| ls.contains("stale0"));
    // Kill without a chance to clean up, as a crash would.
    common::kill_group(d.pid(), libc::SIGKILL);
    let start = std::time::Instant::now();
    while d.alive() {
        assert!(start.elapsed() < CLI, "SIGKILLed daemon still alive");
        std::thread::sleep(Duration::from_millis(10));
    }
    assert!(dir.join("stale0").exists(), "a killed daemon cleaned up?");
    // One it was half-way through removing: its files gone, its (quota) mount point left.
    let half = dir.join("vrnic0");
    std::fs::create_dir(&half).unwrap();
    // A new daemon on the same dir takes over: it serves, and the stale vRNIC is gone.
    let mut cmd = std::process::Command::new(common::vrnic_bin());
    cmd.arg("serve").arg("--state-dir").arg(&dir);
    let mut p = Proc::spawn(cmd, "second serve");
    let start = std::time::Instant::now();
    while dir.join("stale0").exists() || half.exists() || !d.cli_output(&["ls"]).ok() {
        assert!(!p.exited(), "the second daemon exited");
        assert!(
            start.elapsed() < common::DAEMON_START,
            "stale vRNIC not cleaned up, or the second daemon does not serve"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let ls = d.cli_output(&["ls"]);
    assert!(ls.ok(), "{}", ls.text());
    assert!(!ls.stdout.contains("stale0"), "{}", ls.stdout);
    // And it serves new apps.
    let info = output(d.run(&["ibv_devinfo"]), "ibv_devinfo", CLI);
    assert!(
        info.ok() && info.stdout.contains("PORT_ACTIVE"),
        "the restarted daemon does not serve an app\n{}",
        info.text()
    );
    p.signal(libc::SIGTERM);
    let out = p.wait(common::DAEMON_STOP);
    assert!(out.ok(), "second daemon exit\n{}", out.text());
}

#[test]
fn ls_shows_lid_gid_and_qp_counts_of_a_running_app() {
    require("ibv_rc_pingpong");
    let d = Daemon::start();
    let p = port().to_string();
    // A server waiting for its client holds a vRNIC with one QP.
    let server = Proc::spawn(
        d.run_on(Some("lsnic"), &["ibv_rc_pingpong", "-p", &p]),
        "server",
    );
    let ls = d.wait_ls(CLI, "lsnic listed with 1 QP", |ls| {
        ls.lines()
            .any(|l| l.starts_with("lsnic") && l.split_whitespace().nth(3) == Some("1"))
    });
    assert!(ls.contains("fe80:0000:0000:0000:0256:5200"), "{ls}");
    drop(server);
    // Its vRNIC goes away with its last user.
    d.wait_ls(CLI, "the dead app's vRNIC removed", |ls| {
        !ls.contains("lsnic")
    });
}

/// Where the environment names a vRNIC (`$VRNIC_DEVICE`) and attaching fails, the driver says
/// why on stderr, without `VRNIC_LOG`: nothing there (and that a daemon in a mount namespace of
/// its own hides its vRNICs), not a region (or another version's), permission denied (another
/// user's daemon), no daemon answering; without the variable it stays silent.
#[test]
fn a_failed_attach_says_why() {
    require("ibv_devinfo");
    let driver = common::vrnic_bin().with_file_name("libvrnic_shim.so");
    let devinfo = |device: Option<&str>, user: Option<&str>| {
        let mut c = match user {
            Some(u) => {
                let mut c = std::process::Command::new("setpriv");
                c.args([
                    &format!("--reuid={u}"),
                    &format!("--regid={u}"),
                    "--clear-groups",
                    "ibv_devinfo",
                ]);
                c
            }
            None => std::process::Command::new("ibv_devinfo"),
        };
        c.env("LD_PRELOAD", &driver).env_remove("VRNIC_LOG");
        match device {
            Some(d) => c.env("VRNIC_DEVICE", d),
            None => c.env_remove("VRNIC_DEVICE"),
        };
        output(c, "ibv_devinfo", CLI)
    };
    let out = devinfo(Some("/nonexistent-vrnic"), None);
    assert!(
        !out.ok()
            && out
                .stderr
                .contains("no vRNIC at /nonexistent-vrnic (from $VRNIC_DEVICE)")
            && out.stderr.contains("mount namespace"),
        "{}",
        out.text()
    );
    let out = devinfo(Some("/etc/hostname"), None);
    assert!(
        out.stderr.contains("is not a vRNIC region"),
        "{}",
        out.text()
    );
    let out = devinfo(None, None);
    assert!(!out.stderr.contains("vrnic:"), "{}", out.text());

    let d = Daemon::start();
    d.create("p");
    let dir = d.dir.join("p");
    let dir = dir.to_str().expect("utf-8");
    // The state dir's parents must be searchable by nobody for the region's own mode to speak.
    let out = devinfo(Some(dir), Some("65534"));
    assert!(
        out.stderr.contains("permission denied") && out.stderr.contains("daemon"),
        "{}",
        out.text()
    );
    // A vRNIC directory whose daemon was killed: its socket refuses. (A restarted daemon then
    // removes what the dead one left, and makes `p` again: it was recorded.)
    let mut d = d;
    d.kill();
    let out = devinfo(Some(dir), None);
    assert!(
        out.stderr.contains("cannot reach the vrnic daemon") && out.stderr.contains("vrnic serve"),
        "{}",
        out.text()
    );
    d.restart();
    d.stop();
}
