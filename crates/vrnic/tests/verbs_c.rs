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
    common::c_check_done(verbs_check(), mode);
}

#[test]
fn send_and_write_land_exact_bytes_at_every_size_and_alignment() {
    check("data");
}

/// Posts after pauses on both sides of the engine's watch timeout: a busy QP's driver skips
/// the doorbell while the engine looks at its rings every pass, an idle one rings again. A post
/// that fell between the two (the engine clearing the ring's `POLLED` word as the driver read it)
/// and was never looked at would leave a round without its completion.
#[test]
fn posts_after_pauses_around_the_watch_timeout_are_all_seen() {
    check("spaced");
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

/// `tests/c/phases_check.c`: a server forking a child per connection runs 50 phases against one
/// client, alternating bandwidth and event-mode latency, each phase making and destroying its
/// own objects and bounded in time (20 s).
fn phases(mode: &str) {
    static BIN: OnceLock<PathBuf> = OnceLock::new();
    let bin = BIN.get_or_init(|| common::c_program("phases_check", &["-libverbs"]));
    let pair = common::c_check_pair_on(
        &Daemon::start(),
        bin,
        &["50", mode],
        Duration::from_secs(300),
    );
    for side in [&pair.server, &pair.client] {
        assert!(side.stdout.contains("OK phases done"), "{pair}");
        assert_eq!(
            side.stdout.matches("latency, event mode").count(),
            25,
            "{pair}"
        );
    }
}

#[test]
fn a_forked_server_runs_fifty_bandwidth_and_event_mode_phases_children_opening_the_device() {
    phases("own");
}

#[test]
fn a_forked_server_runs_fifty_phases_its_children_using_the_parents_context_and_pd() {
    phases("inherit");
}

#[test]
fn a_killed_daemon_raises_device_fatal_and_calls_fail_cleanly() {
    let bin = verbs_check().to_str().expect("utf-8 path").to_string();
    let mut d = Daemon::start();
    let ready = d.dir.with_extension("ready");
    let _ = std::fs::remove_file(&ready);
    let ready_arg = ready.to_str().expect("utf-8 path").to_string();
    let mut app = common::Proc::spawn(d.run(&[&bin, "solo", "devfatal", &ready_arg]), "devfatal");
    // The app has opened its device and allocated a PD once it wrote READY.
    let start = std::time::Instant::now();
    while !std::fs::read_to_string(&ready).is_ok_and(|r| r.contains("READY")) {
        assert!(!app.exited(), "the app ended before it was READY");
        assert!(
            start.elapsed() < Duration::from_secs(20),
            "the app did not open its device within 20 s"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    let _ = std::fs::remove_file(&ready);
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
