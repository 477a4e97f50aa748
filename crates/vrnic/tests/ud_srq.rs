//! Unmodified Debian `ibverbs-utils` over UD queue pairs, shared receive queues and XRC (`ibv_xsrq_pingpong`): server and
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

/// Unmodified `ibv_xsrq_pingpong`: both sides open an XRC domain by `/tmp/xrc_domain`, create
/// an XRC SRQ, an XRC receive QP and an XRC send QP, exchange their SRQ numbers and send each
/// other `-n` messages that land in the peer's SRQ and complete on its CQ; both print
/// `success` only after polling every receive and the last send's completion.
fn xsrq(extra: &[&str]) {
    let pair = common::server_client("ibv_xsrq_pingpong", extra, Duration::from_secs(60));
    for side in [&pair.server, &pair.client] {
        assert!(
            side.stdout.contains("SRQN") && side.stdout.lines().any(|l| l == "success"),
            "no SRQ numbers or no success:\n{pair}"
        );
    }
}

#[test]
fn xsrq_pingpong_xrc_between_two_processes() {
    xsrq(&["-n", "100"]);
}

#[test]
fn xsrq_pingpong_xrc_with_events() {
    xsrq(&["-n", "50", "-e"]);
}

/// `ibv_xsrq_pingpong -c 2`: the server sends each client's messages alternately through both
/// clients' connections, so a message for client 1's SRQ arrives on client 2's XRC receive QP
/// half of the time. That works only if the two client processes, on one vRNIC, share the
/// XRC domain by opening the same file, and the receive QP of one delivers into the other's
/// SRQ and CQ. Every side must print `success`.
#[test]
fn xsrq_pingpong_two_clients_of_one_vrnic_share_their_domain() {
    common::require("ibv_xsrq_pingpong");
    let d = common::Daemon::start();
    d.create("shared");
    let port = common::port();
    let p = port.to_string();
    let server = common::Proc::spawn(
        d.run(&["ibv_xsrq_pingpong", "-p", &p, "-c", "2", "-n", "20"]),
        "server",
    );
    let server = common::wait_listening(server, port, Duration::from_secs(10));
    let client = |n: &str| {
        common::Proc::spawn(
            d.run_on(
                Some("shared"),
                &["ibv_xsrq_pingpong", "-p", &p, "-n", "20", "localhost"],
            ),
            n,
        )
    };
    let (c1, c2) = (client("client 1"), client("client 2"));
    let limit = Duration::from_secs(60);
    let outs = [
        ("client 1", c1.wait_bounded(limit)),
        ("client 2", c2.wait_bounded(limit)),
        ("server", server.wait_bounded(limit)),
    ];
    for (name, o) in &outs {
        assert!(
            o.ok() && o.stdout.lines().any(|l| l == "success"),
            "{name} failed:\n{}",
            o.text()
        );
    }
}
