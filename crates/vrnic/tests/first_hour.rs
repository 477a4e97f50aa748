//! What a new user meets in the first hour, each checked by the text they read: `--peer` by
//! host name with the default port, the legend of `vrnic peers`, a failed `serve` that leaves
//! nothing mounted, etcd's refusals named with the endpoint, `vrnic bench`'s legend, the
//! README's `vrnic keygen /etc/vrnic/link.key` on a machine without `/etc/vrnic`, and `vrnic
//! stats` after the README's runs (their vRNICs gone).

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

#[test]
fn keygen_makes_the_missing_directory_of_its_key_file_and_never_overwrites() {
    use std::os::unix::fs::PermissionsExt as _;
    // As the README's `vrnic keygen /etc/vrnic/link.key` on a fresh machine: no such directory.
    let top = std::env::temp_dir().join(format!("vrnic-keygen-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&top);
    let file = top.join("etc/vrnic/link.key");
    let keygen = |args: &[&std::ffi::OsStr]| {
        let mut c = Command::new(vrnic_bin());
        c.arg("keygen").args(args);
        output(c, "vrnic keygen", CLI)
    };
    let made = keygen(&[file.as_os_str()]);
    let mode = |p: &Path| std::fs::metadata(p).map(|m| m.permissions().mode() & 0o777);
    let (dir_mode, file_mode) = (mode(&top.join("etc/vrnic")), mode(&file));
    let again = keygen(&[file.as_os_str()]);
    let public = keygen(&["--public".as_ref(), file.as_os_str()]);
    let _ = std::fs::remove_dir_all(&top);
    let key = made.stdout.trim();
    assert!(
        made.ok() && key.len() == 64 && key.bytes().all(|b| b.is_ascii_hexdigit()),
        "{}",
        made.text()
    );
    assert_eq!(dir_mode.ok(), Some(0o700), "the directory it made");
    assert_eq!(file_mode.ok(), Some(0o600), "the key file");
    assert!(
        !again.ok()
            && again.stderr.contains("never overwritten")
            && again.stderr.contains("vrnic keygen --public"),
        "{}",
        again.text()
    );
    assert!(
        public.ok() && public.stdout.trim() == key,
        "{}",
        public.text()
    );
}

#[test]
fn stats_without_vrnics_says_so() {
    // The README's `vrnic stats` comes after its runs, whose vRNICs are gone: an empty
    // answer read as a command that printed nothing.
    let mut d = Daemon::start();
    let out = d.cli_output(&["stats"]);
    let json = d.cli_output(&["stats", "--json"]);
    let _ = d.stop();
    assert!(
        out.ok() && out.stdout.contains("(no vRNICs") && out.stdout.contains("vrnic create"),
        "{}",
        out.text()
    );
    assert!(json.ok() && json.stdout.trim() == "[]", "{}", json.text());
}
