//! libfabric's verbs provider on a vRNIC, through libfabric's own `fi_pingpong` (Debian's
//! `libfabric-bin`), unmodified, under `vrnic run`: the `verbs` provider's MSG endpoints
//! (librdmacm ids made with `rdma_create_ep`, moved onto the provider's event channel by
//! `rdma_migrate_id`), `verbs;ofi_rxm` RDM endpoints over them (a 256 Ki-entry CQ among what
//! `ofi_rxm` asks for) and the `verbs` DGRAM endpoints (UD), every size from 64 B up (to 1 MiB;
//! DGRAM up to the 4096-byte MTU) with `-c`, fi_pingpong's data check of every message: on one
//! host, and between two hosts (network namespaces whose daemons are joined by a peer link).
//! Each run must exit 0 on both sides and report every size with as many messages acknowledged
//! as sent. libfabric finds the vRNIC with no setting: `fi_info -p verbs` lists it as a domain.

mod common;

use std::time::Duration;

use common::hosts::Hosts;
use common::{Daemon, Pair, port, require, run_pair_on};

const LIMIT: Duration = Duration::from_secs(120);
const LINKS_UP: Duration = Duration::from_secs(20);
/// Messages per size.
const ITERS: &str = "50";

/// The sizes `fi_pingpong -S all` runs for an endpoint type: up to 1 MiB, or for DGRAM up to
/// the endpoint's largest message (the MTU).
fn sizes(ep: &str) -> &'static [&'static str] {
    if ep == "dgram" {
        &["64", "256", "1k", "4k"]
    } else {
        &["64", "256", "1k", "4k", "64k", "1m"]
    }
}

/// `fi_pingpong -p PROV -e EP -c` as a server on `on_server`'s fresh vRNIC and as its client
/// (of `addr`) on `on_client`'s; both must exit 0 and print a result row for every size, each
/// with as many messages acknowledged as sent.
fn pingpong(on_server: &Daemon, on_client: &Daemon, addr: &str, prov: &str, ep: &str) -> Pair {
    require("fi_pingpong");
    let p = port().to_string();
    let server = [
        "fi_pingpong",
        "-p",
        prov,
        "-e",
        ep,
        "-I",
        ITERS,
        "-S",
        "all",
        "-c",
        "-B",
        &p,
    ];
    // The client names the server's control port with -P where the server binds it with -B.
    let mut client = server.to_vec();
    client[server.len() - 2] = "-P";
    client.push(addr);
    let pair = run_pair_on(on_server, on_client, &server, &client, LIMIT);
    pair.assert_ok();
    for (side, out) in [("server", &pair.server), ("client", &pair.client)] {
        for size in sizes(ep) {
            let row = out.stdout.lines().find(|l| {
                let f: Vec<&str> = l.split_whitespace().collect();
                f.first() == Some(size)
            });
            let Some(row) = row else {
                panic!("{prov} {ep}: the {side} printed no row for {size}\n{pair}");
            };
            let f: Vec<&str> = row.split_whitespace().collect();
            assert!(
                f.get(1) == Some(&ITERS) && f.get(2) == Some(&format!("={ITERS}").as_str()),
                "{prov} {ep}: the {side}'s {size} row is not {ITERS} sent, {ITERS} \
                 acknowledged: {row}\n{pair}"
            );
        }
    }
    pair
}

fn one_host(prov: &str, ep: &str) {
    let d = Daemon::start();
    pingpong(&d, &d, "127.0.0.1", prov, ep);
}

fn across_hosts(prov: &str, ep: &str) {
    let hosts = Hosts::new(2);
    let ds = hosts.daemons(LINKS_UP);
    pingpong(&ds[0], &ds[1], &hosts.addr(0), prov, ep);
}

#[test]
fn fi_pingpong_verbs_msg_checked() {
    one_host("verbs", "msg");
}

#[test]
fn fi_pingpong_verbs_ofi_rxm_rdm_checked() {
    one_host("verbs;ofi_rxm", "rdm");
}

#[test]
fn fi_pingpong_verbs_dgram_checked() {
    one_host("verbs", "dgram");
}

#[test]
fn fi_pingpong_verbs_msg_checked_across_hosts() {
    across_hosts("verbs", "msg");
}

#[test]
fn fi_pingpong_verbs_ofi_rxm_rdm_checked_across_hosts() {
    across_hosts("verbs;ofi_rxm", "rdm");
}

#[test]
fn fi_pingpong_verbs_dgram_checked_across_hosts() {
    across_hosts("verbs", "dgram");
}
