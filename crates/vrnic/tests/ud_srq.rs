//! Unmodified Debian `ibverbs-utils` over UD queue pairs and shared receive queues: server and
//! client as two processes on their own vRNICs, both sides must exit 0 and report their
//! throughput and latency lines, and print no `invalid data in page` (`-c`; the harness fails a
//! run that printed it, since the programs still exit 0). Exact bytes are `verbs_c.rs`'s claim.

mod common;

use std::time::Duration;

fn pingpong(prog: &str, extra: &[&str]) {
    let pair = common::server_client(prog, extra, Duration::from_secs(120));
    for side in [&pair.server, &pair.client] {
        assert!(
            side.stdout.contains("bytes in") && side.stdout.contains(" iters in "),
            "no throughput/latency lines:\n{}",
            side.stdout
        );
    }
}

#[test]
fn ud_pingpong_by_lid() {
    pingpong("ibv_ud_pingpong", &[]);
}

#[test]
fn ud_pingpong_by_gid_with_grh() {
    pingpong("ibv_ud_pingpong", &["-g", "0"]);
}

#[test]
fn ud_pingpong_2048_bytes() {
    pingpong("ibv_ud_pingpong", &["-s", "2048"]);
}

#[test]
fn ud_pingpong_mtu_sized_with_events() {
    pingpong("ibv_ud_pingpong", &["-s", "4096", "-e"]);
}

#[test]
fn srq_pingpong_sixteen_qps_on_one_srq() {
    // The default is 16 QPs sharing one SRQ. `-c` is passed as users pass it, but its check
    // cannot fail in srq_pingpong (the buffer is zeroed before it is compared): this test
    // claims the SRQ traffic, not its bytes.
    pingpong("ibv_srq_pingpong", &["-q", "16", "-c"]);
}

#[test]
fn srq_pingpong_with_events() {
    pingpong("ibv_srq_pingpong", &["-e"]);
}
