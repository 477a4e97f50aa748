//! What a new user meets in the first hour, each checked by the text they read: `--peer` by
//! host name with the default port, the legend of `vrnic peers`, a failed `serve` that leaves
//! nothing mounted, etcd's refusals named with the endpoint, `vrnic bench`'s legend.

mod common;

use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use common::{CLI, Daemon, Proc, output, port, vrnic_bin};

/// Whether something is mounted on `dir`.
fn mounted(dir: &Path) -> bool {
    let info = std::fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
    let dir = dir.display().to_string();
    info.lines()
        .any(|l| l.split_whitespace().nth(4) == Some(dir.as_str()))
}

#[test]
fn a_serve_that_fails_after_mounting_its_state_dir_unmounts_it() {
    common::require_root("this test checks the tmpfs only root's daemon mounts on its state dir");
    let dir = std::env::temp_dir().join(format!("vrnic-failed-serve-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    // Refused after the mount: a peer-link address off loopback without keys.
    let mut c = Command::new(vrnic_bin());
    c.arg("serve").arg("--state-dir").arg(&dir).args([
        "--listen",
        "192.0.2.1:7700",
        "--peer",
        "192.0.2.2:7700",
    ]);
    let out = Proc::spawn(c, "vrnic serve").wait_bounded(CLI);
    let left = mounted(&dir);
    if left {
        let _ = Command::new("umount").arg("-l").arg(&dir).output();
    }
    let _ = std::fs::remove_dir_all(&dir);
    assert!(!out.timed_out && !out.ok(), "it ran\n{}", out.text());
    assert!(out.stderr.contains("vrnic keygen"), "{}", out.text());
    assert!(!left, "the failed serve left {} mounted", dir.display());
}

#[test]
fn peer_takes_a_host_name_and_the_default_port() {
    // `localhost` without a port: 127.0.0.1 on the default port of --listen, 7700.
    let listen = format!("127.0.0.2:{}", port());
    let mut d = Daemon::start_with(&["--listen", &listen, "--peer", "localhost"]);
    let out = d.cli_output(&["peers"]);
    let _ = d.stop();
    assert!(
        out.ok() && out.stdout.contains("127.0.0.1:7700"),
        "{}",
        out.text()
    );
    let mut c = Command::new(vrnic_bin());
    c.args(["serve", "--peer", "no-such-host.invalid:7700"]);
    let out = output(c, "vrnic serve --peer", CLI);
    assert!(
        !out.ok() && out.stderr.contains("cannot resolve the host name"),
        "{}",
        out.text()
    );
}

#[test]
fn peers_help_explains_every_column() {
    let mut c = Command::new(vrnic_bin());
    c.args(["peers", "--help"]);
    let out = output(c, "vrnic peers --help", CLI);
    assert!(out.ok(), "{}", out.text());
    for col in [
        "PEER",
        "STATE",
        "RTT_US",
        "BYTES_IN",
        "PLACED_IN",
        "BYTES_OUT",
        "RESENT",
        "DROPS",
        "SECURITY",
    ] {
        assert!(
            out.stdout.contains(col),
            "{col} unexplained\n{}",
            out.stdout
        );
    }
    assert!(
        out.stdout.contains("DROPS the times the link went down")
            && out.stdout.contains("straight into registered memory"),
        "{}",
        out.stdout
    );
}

#[test]
fn an_unreachable_etcd_is_named_with_its_cause() {
    // Nothing listens on this port: every connection is refused.
    let closed = port();
    let etcd = format!("http://127.0.0.1:{closed}");
    let listen = format!("127.0.0.1:{}", port());
    let mut d = Daemon::start_with(&["--listen", &listen, "--etcd", &etcd]);
    let start = Instant::now();
    let out = loop {
        let out = d.cli_output(&["run", "--", "true"]);
        if out.stderr.contains("refused") || start.elapsed() > Duration::from_secs(20) {
            break out;
        }
        std::thread::sleep(Duration::from_millis(200));
    };
    let log = d.stop().text();
    assert!(
        !out.ok()
            && out.stderr.contains(&format!("etcd at {etcd}"))
            && out
                .stderr
                .contains("connection refused (nothing listens there"),
        "{}",
        out.text()
    );
    for raw in ["status:", "os error", "tcp connect error", "metadata"] {
        assert!(!out.stderr.contains(raw), "raw {raw:?}\n{}", out.text());
    }
    assert!(
        log.contains("connection refused (nothing listens there"),
        "{log}"
    );
}
