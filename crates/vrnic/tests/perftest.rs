//! Unmodified Debian `perftest` through vrnic, server and client as two processes on their own
//! vRNICs: the eight programs over RC at their default sizes and, where perftest allows it,
//! over all sizes (`-a`, 2 B to 8 MiB; the atomic tests refuse `-a` themselves: "Message size
//! cannot be changed for Atomic tests"); `ib_send_bw`/`ib_send_lat` also over UC and UD (UD
//! sweeps up to the 4096-byte MTU).

mod common;

use std::time::Duration;

use common::server_client;

fn perftest(prog: &str, extra: &[&str]) {
    let pair = server_client(prog, extra, Duration::from_secs(180));
    // Both sides print a results table: a header and at least one row of figures.
    assert!(
        pair.client.stdout.contains("#bytes"),
        "no results table:\n{}",
        pair.client.stdout
    );
    let rows = pair
        .client
        .stdout
        .lines()
        .filter(|l| {
            l.trim_start()
                .chars()
                .next()
                .is_some_and(|c| c.is_ascii_digit())
        })
        .count();
    assert!(rows >= 1, "no result rows:\n{}", pair.client.stdout);
}

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
    perftest("ib_write_bw", &["-a"]);
}

#[test]
fn ib_send_lat_all_sizes() {
    perftest("ib_send_lat", &["-a"]);
}

#[test]
fn ib_send_bw_all_sizes() {
    perftest("ib_send_bw", &["-a"]);
}

#[test]
fn ib_write_lat_all_sizes() {
    perftest("ib_write_lat", &["-a"]);
}

#[test]
fn ib_read_bw_all_sizes() {
    perftest("ib_read_bw", &["-a"]);
}

#[test]
fn ib_read_lat_all_sizes() {
    perftest("ib_read_lat", &["-a"]);
}

#[test]
fn ib_send_bw_ud_all_sizes() {
    perftest("ib_send_bw", &["-c", "UD", "-a"]);
}

#[test]
fn ib_send_lat_ud_all_sizes() {
    perftest("ib_send_lat", &["-c", "UD", "-a"]);
}

#[test]
fn ib_send_bw_uc_all_sizes() {
    perftest("ib_send_bw", &["-c", "UC", "-a"]);
}

#[test]
fn ib_send_lat_uc_all_sizes() {
    perftest("ib_send_lat", &["-c", "UC", "-a"]);
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
