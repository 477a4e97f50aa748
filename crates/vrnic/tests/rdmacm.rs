//! librdmacm programs through the driver library's `rdma_*` ABI and the daemon's CM broker,
//! server and client as two processes on their own vRNICs: unmodified `rping` (IPv4 and IPv6,
//! data verified), perftest with `-R`, `rdma_server`/`rdma_client` (the synchronous endpoint
//! API), `ucmatose` and `udaddy` (Debian `rdmacm-utils`); and our own `tests/c/cm_check.c` for
//! what a real stack shows: a port nobody listens on, `EADDRINUSE`, reject with private data,
//! disconnect from either side (receives flushed), a peer killed mid-connection,
//! `rdma_getaddrinfo` with the address in the hints, `rdma_migrate_id` of a synchronous id.

mod common;

use std::path::PathBuf;
use std::sync::OnceLock;
use std::time::Duration;

use common::{Daemon, output, port, require, run_pair};

const LIMIT: Duration = Duration::from_secs(120);

/// Runs `server` then `client` (each `prog args...`) and checks both exit 0.
fn pair(server: &[&str], client: &[&str]) -> common::Pair {
    require(server[0]);
    common::fresh_pair(server, client, LIMIT)
}

/// `rping` server and client with `extra` (which holds `-C COUNT`), verbose: `rping` exits 0
/// whenever it ends disconnected, even after one ping, so each side must print exactly COUNT
/// ping lines ([`common::Rping`]).
fn rping(addr: &str, extra: &[&str]) {
    let p = port().to_string();
    let r = common::Rping::new(addr, &p, extra);
    let out = pair(&r.server, &r.client);
    r.assert_counted(&out);
}

#[test]
fn rping_ipv4_verbose() {
    // Both sides use the same size: the server READs the client's buffer into its own.
    rping("127.0.0.1", &["-C", "1000", "-S", "4096", "-v"]);
}

#[test]
fn rping_ipv4_validated() {
    rping("127.0.0.1", &["-C", "1000", "-S", "4096", "-V"]);
}

#[test]
fn rping_ipv6_validated() {
    rping("::1", &["-C", "1000", "-S", "4096", "-V"]);
}

#[test]
fn rping_self_created_qp_with_init_qp_attr() {
    rping("127.0.0.1", &["-C", "100", "-q", "-V"]);
}

fn perftest_r(prog: &str) {
    let p = port().to_string();
    let out = pair(
        &[prog, "-R", "-p", &p],
        &[prog, "-R", "-p", &p, "127.0.0.1"],
    );
    assert!(
        out.client.stdout.contains("#bytes"),
        "no results:\n{}",
        out.client.stdout
    );
}

#[test]
fn ib_send_bw_over_rdma_cm() {
    perftest_r("ib_send_bw");
}

#[test]
fn ib_write_bw_over_rdma_cm() {
    perftest_r("ib_write_bw");
}

#[test]
fn ib_read_lat_over_rdma_cm() {
    perftest_r("ib_read_lat");
}

#[test]
fn rdma_server_and_rdma_client() {
    let p = port().to_string();
    let out = pair(
        &["rdma_server", "-p", &p],
        &["rdma_client", "-s", "127.0.0.1", "-p", &p],
    );
    assert!(out.server.stdout.contains("end 0"), "{}", out.server.stdout);
    assert!(out.client.stdout.contains("end 0"), "{}", out.client.stdout);
}

#[test]
fn ucmatose_four_connections() {
    let p = port().to_string();
    let out = pair(
        &["ucmatose", "-p", &p, "-c", "4", "-C", "100"],
        &[
            "ucmatose",
            "-s",
            "127.0.0.1",
            "-p",
            &p,
            "-c",
            "4",
            "-C",
            "100",
        ],
    );
    for side in [&out.server, &out.client] {
        assert!(
            side.stdout.contains("data transfers complete"),
            "{}",
            side.stdout
        );
    }
}

#[test]
fn udaddy_datagrams() {
    // udaddy has no port option (its port is fixed); each test has its own daemon, whose
    // port spaces are its own.
    let out = pair(&["udaddy"], &["udaddy", "-s", "127.0.0.1"]);
    for side in [&out.server, &out.client] {
        assert!(
            side.stdout.contains("data transfers complete"),
            "{}",
            side.stdout
        );
    }
}

fn cm_check() -> &'static PathBuf {
    static BIN: OnceLock<PathBuf> = OnceLock::new();
    BIN.get_or_init(|| common::c_program("cm_check", &["-lrdmacm", "-libverbs"]))
}

fn has(out: &common::Output, what: &str) {
    assert!(
        out.stdout
            .lines()
            .any(|l| l.starts_with("OK ") && l.contains(what)),
        "no OK line with {what:?}\n{}",
        out.text()
    );
}

fn solo(args: &[&str]) -> common::Output {
    let bin = cm_check().to_str().expect("utf-8 path").to_string();
    let d = Daemon::start();
    let mut a = vec![bin.as_str()];
    a.extend_from_slice(args);
    let out = output(d.run(&a), "cm_check", Duration::from_secs(60));
    assert!(out.ok(), "cm_check {args:?} failed\n{}", out.text());
    out
}

fn two(mode: &str) -> common::Pair {
    let bin = cm_check().to_str().expect("utf-8 path").to_string();
    let d = Daemon::start();
    let p = port().to_string();
    run_pair(
        &d,
        &[&bin, "server", &p, mode],
        &[&bin, "client", &p, mode],
        Duration::from_secs(60),
    )
}

/// The app gets `REJECTED` (status 8, invalid service ID), and the daemon's log says why
/// (as it does for a refusal across groups), naming the destination.
#[test]
fn connecting_to_a_port_nobody_listens_on_is_rejected() {
    let bin = cm_check().to_str().expect("utf-8 path").to_string();
    let mut d = Daemon::start();
    let p = port().to_string();
    let out = output(
        d.run(&[&bin, "solo", "noport", &p]),
        "cm_check",
        Duration::from_secs(60),
    );
    assert!(out.ok(), "cm_check noport failed\n{}", out.text());
    has(&out, "reject status 8");
    let log = d.stop().text();
    assert!(
        log.lines().any(
            |l| l.contains("rdma_cm connect refused: nothing listens there")
                && l.contains(&format!(":{p}"))
        ),
        "no log line for the refusal\n{log}"
    );
}

#[test]
fn ports_bind_like_tcp() {
    let out = solo(&["solo", "addrinuse"]);
    has(&out, "bind to port 0 picks port");
    has(&out, "EADDRINUSE");
    has(&out, "the port is free again");
    has(&out, "bound to a loopback address has no device");
}

/// `rdma_getaddrinfo` as librdmacm's `addrinfo.c`: with no node and no service the hints'
/// addresses (libfabric's verbs provider asks so), a source in the hints kept.
#[test]
fn getaddrinfo_takes_the_address_from_the_hints() {
    let out = solo(&["solo", "getaddrinfo", &port().to_string()]);
    has(&out, "no node, service or hints: EINVAL");
    has(&out, "hints with ai_dst_addr): the hints' destination");
    has(
        &out,
        "RAI_PASSIVE hints with ai_src_addr): the hints' source; an endpoint on it listens",
    );
    has(&out, "the node's address, the hints' source kept");
    has(&out, "AF_IB in the hints: the resolver's family");
}

/// `rdma_migrate_id` as librdmacm's: a synchronous id moved onto a channel is asynchronous
/// (libfabric's verbs provider resolves the route and connects so).
#[test]
fn migrate_id_onto_a_channel_makes_a_synchronous_id_asynchronous() {
    let out = solo(&["solo", "migrate", &port().to_string()]);
    has(&out, "synchronous id to no channel: EINVAL");
    has(&out, "rdma_resolve_route returns, its event comes there");
    has(
        &out,
        "the migrated id connects by events on its new channel",
    );
    has(&out, "asynchronous id to no channel: 0");
}

#[test]
fn reject_carries_private_data() {
    let p = two("reject");
    p.assert_ok();
    has(&p.client, "reject status 28 with the server's private data");
    has(&p.server, "request carries the client's private data");
}

#[test]
fn server_disconnect_flushes_and_both_sides_see_it() {
    let p = two("disc_server");
    p.assert_ok();
    has(
        &p.server,
        "server after its own disconnect: 4 posted receives flushed",
    );
    has(&p.client, "client sees the server's disconnect");
    has(
        &p.client,
        "client after answering the disconnect: 4 posted receives flushed",
    );
}

#[test]
fn client_disconnect_flushes_and_both_sides_see_it() {
    let p = two("disc_client");
    p.assert_ok();
    has(
        &p.client,
        "client after its own disconnect: 4 posted receives flushed",
    );
    has(&p.server, "server sees the client's disconnect");
}

#[test]
fn a_killed_peer_disconnects_the_survivor() {
    let p = two("killed");
    assert!(
        p.server.ok(),
        "server did not survive its peer's death\n{}",
        p.server.text()
    );
    has(&p.server, "server sees the killed client go");
    has(&p.client, "client QP in RTS");
    assert!(!p.client.ok(), "the client was to kill itself");
}
