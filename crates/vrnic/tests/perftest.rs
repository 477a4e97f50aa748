//! Unmodified Debian `perftest` through vrnic, server and client as two processes on their own
//! vRNICs: the eight programs over RC at their default sizes and, where perftest allows it,
//! over all sizes (`-a`, 2 B to 8 MiB; the atomic tests refuse `-a` themselves: "Message size
//! cannot be changed for Atomic tests"); `ib_send_bw`/`ib_send_lat` also over UC and UD (UD
//! sweeps up to the 4096-byte MTU). A sweep must print a result row for each of its sizes.

mod common;

use std::time::Duration;

use common::server_client;

/// Runs `prog extra...` as a pair; both sides print a results table, and the client's has at
/// least one row of figures. Returns the sizes (first column) of the client's rows.
fn perftest(prog: &str, extra: &[&str]) -> Vec<u64> {
    let pair = server_client(prog, extra, Duration::from_secs(180));
    assert!(
        pair.client.stdout.contains("#bytes"),
        "no results table:\n{}",
        pair.client.stdout
    );
    let sizes: Vec<u64> = pair
        .client
        .stdout
        .lines()
        .filter_map(|l| l.split_whitespace().next()?.parse().ok())
        .collect();
    assert!(!sizes.is_empty(), "no result rows:\n{}", pair.client.stdout);
    sizes
}

/// `prog -a extra...`: one result row for each size of the sweep, every power of two from 2 B
/// to `max_bytes`, in order.
fn sweep(prog: &str, extra: &[&str], max_bytes: u64) {
    let mut args = vec!["-a"];
    args.extend_from_slice(extra);
    let sizes = perftest(prog, &args);
    let want: Vec<u64> = (1..64)
        .map(|k| 1u64 << k)
        .take_while(|&s| s <= max_bytes)
        .collect();
    assert_eq!(sizes, want, "{prog} {args:?}: a row for each size");
}

/// The largest size of an RC or UC sweep (perftest's `-a`).
const SWEEP_MAX: u64 = 8 << 20;
/// The largest size of a UD sweep: one message fits the MTU.
const UD_SWEEP_MAX: u64 = 4096;

#[test]
fn ib_write_bw() {
    perftest("ib_write_bw", &[]);
}

#[test]
fn ib_write_lat() {
    perftest("ib_write_lat", &[]);
}

#[test]
fn ib_send_bw() {
    perftest("ib_send_bw", &[]);
}

#[test]
fn ib_send_lat() {
    perftest("ib_send_lat", &[]);
}

#[test]
fn ib_read_bw() {
    perftest("ib_read_bw", &[]);
}

#[test]
fn ib_read_lat() {
    perftest("ib_read_lat", &[]);
}

#[test]
fn ib_atomic_bw() {
    perftest("ib_atomic_bw", &[]);
}

#[test]
fn ib_atomic_lat() {
    perftest("ib_atomic_lat", &[]);
}

#[test]
fn ib_write_bw_all_sizes() {
    sweep("ib_write_bw", &[], SWEEP_MAX);
}

#[test]
fn ib_send_lat_all_sizes() {
    sweep("ib_send_lat", &[], SWEEP_MAX);
}

#[test]
fn ib_send_bw_all_sizes() {
    sweep("ib_send_bw", &[], SWEEP_MAX);
}

#[test]
fn ib_write_lat_all_sizes() {
    sweep("ib_write_lat", &[], SWEEP_MAX);
}

#[test]
fn ib_read_bw_all_sizes() {
    sweep("ib_read_bw", &[], SWEEP_MAX);
}

#[test]
fn ib_read_lat_all_sizes() {
    sweep("ib_read_lat", &[], SWEEP_MAX);
}

#[test]
fn ib_send_bw_ud_all_sizes() {
    sweep("ib_send_bw", &["-c", "UD"], UD_SWEEP_MAX);
}

#[test]
fn ib_send_lat_ud_all_sizes() {
    sweep("ib_send_lat", &["-c", "UD"], UD_SWEEP_MAX);
}

#[test]
fn ib_send_bw_uc_all_sizes() {
    sweep("ib_send_bw", &["-c", "UC"], SWEEP_MAX);
}

#[test]
fn ib_send_lat_uc_all_sizes() {
    sweep("ib_send_lat", &["-c", "UC"], SWEEP_MAX);
}

#[test]
fn ib_send_bw_ud() {
    perftest("ib_send_bw", &["-c", "UD"]);
}

#[test]
fn ib_send_lat_ud() {
    perftest("ib_send_lat", &["-c", "UD"]);
}

#[test]
fn ib_send_bw_uc() {
    perftest("ib_send_bw", &["-c", "UC"]);
}

#[test]
fn ib_send_lat_uc() {
    perftest("ib_send_lat", &["-c", "UC"]);
}

#[test]
fn ib_write_bw_uc() {
    perftest("ib_write_bw", &["-c", "UC"]);
}

#[test]
fn ib_send_bw_four_qps_on_one_srq() {
    perftest("ib_send_bw", &["-q", "4", "--use-srq"]);
}

#[test]
fn ib_send_lat_ud_with_grh() {
    perftest("ib_send_lat", &["-c", "UD", "-x", "0"]);
}
