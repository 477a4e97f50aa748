//! Our own verbs checks (`tests/c/verbs_check.c`, built against the system's libibverbs-dev),
//! run as two separate processes under `vrnic run`: bytes land exactly where they should for
//! SEND/WRITE/WRITE_WITH_IMM at every awkward size and alignment, protection errors complete
//! with the statuses a real RNIC gives on the right side and change no byte, later work
//! requests flush, and overlapping registrations and deregistration behave. Each mode is its own
//! pair of processes on a fresh daemon, so each error case starts from fresh QPs (a QP in error
//! stays in error).

mod common;

use std::path::PathBuf;
use std::sync::OnceLock;
use std::time::Duration;

use common::Daemon;

fn verbs_check() -> &'static PathBuf {
    static BIN: OnceLock<PathBuf> = OnceLock::new();
    BIN.get_or_init(|| common::c_program("verbs_check", &["-libverbs"]))
}

fn check(mode: &str) {
    let pair = common::c_check_pair(verbs_check(), mode);
    for side in [&pair.server, &pair.client] {
        assert!(
            side.stdout.contains(&format!(" {mode} done")),
            "{}",
            side.stdout
        );
        assert!(!side.stdout.contains("FAIL"), "{}", side.stdout);
    }
}

#[test]
fn send_and_write_land_exact_bytes_at_every_size_and_alignment() {
    check("data");
}

#[test]
fn write_with_a_wrong_rkey_is_a_remote_access_error_and_changes_nothing() {
    check("badrkey");
}

#[test]
fn write_past_the_end_of_an_mr_is_a_remote_access_error_and_changes_nothing() {
    check("pastend");
}

#[test]
fn write_to_an_mr_without_remote_write_is_a_remote_access_error() {
    check("noaccess");
}

#[test]
fn send_with_a_bad_lkey_is_a_local_protection_error() {
    check("badlkey");
}

#[test]
fn after_an_error_every_later_work_request_is_flushed() {
    check("flush");
}

#[test]
fn overlapping_registrations_and_deregistration() {
    check("overlap");
}

#[test]
fn rereg_pd_and_translation_then_a_qp_pair_brought_up_again_carries_exact_bytes() {
    check("rereg");
}

#[test]
fn a_killed_daemon_raises_device_fatal_and_calls_fail_cleanly() {
    let bin = verbs_check().to_str().expect("utf-8 path").to_string();
    let mut d = Daemon::start();
    let app = common::Proc::spawn(d.run(&[&bin, "solo", "devfatal"]), "devfatal");
    // The app has opened its device once the daemon lists a vRNIC for it.
    d.wait_ls(common::CLI, "the app's vRNIC listed", |ls| {
        ls.lines().count() > 1
    });
    // `vrnic run` holds the vRNIC before the app starts: give it time to open the device.
    std::thread::sleep(Duration::from_secs(1));
    common::kill_group(d.pid(), libc::SIGKILL);
    let out = app.wait(Duration::from_secs(20));
    assert!(
        out.ok(),
        "app did not survive the daemon's death cleanly:\n{}\n{}",
        out.stdout,
        out.stderr
    );
    assert!(
        out.stdout.contains("OK device fatal event"),
        "{}",
        out.stdout
    );
    assert!(
        out.stdout.contains("OK calls fail after the daemon died"),
        "{}",
        out.stdout
    );
    assert!(!d.alive());
    // Dropping `d` takes down the tmpfs the killed daemon left mounted on its state dir.
}
