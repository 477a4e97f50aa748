//! Tenants' groups end to end: vRNICs made with `vrnic create --group G --ip IP` reach each
//! other only within their group, with unmodified `ibv_rc_pingpong -c`, `ibv_ud_pingpong` and
//! `rping -V`, on one host and across hosts (network namespaces, `common/hosts.rs`). Across
//! groups an RC connection fails as one to an absent peer (`RETRY_EXC_ERR`), a UD datagram is
//! dropped, and the daemon logs one line naming both vRNICs and both groups. Two groups that
//! use the same virtual IPs each reach their own peer through rdma_cm.

mod common;

use std::time::{Duration, Instant};

use common::hosts::Hosts;
use common::{Daemon, Output, Pair, Proc, create_in as create, pair_on as pair, port, require};

const PAIR: Duration = Duration::from_secs(60);
const LINKS_UP: Duration = Duration::from_secs(20);
/// How long a pair whose peer is in another group gets before it is reported as stuck.
const CROSS: Duration = Duration::from_secs(8);

/// A vRNIC of a daemon.
type On<'a> = (&'a Daemon, &'a str);

/// `rping -V -v -C count` between vRNIC `s` (listening on `addr`) and `c`, for each
/// `(s, c, count)` of `runs` at once: every server starts, then every client; each pair must
/// pass with its pings counted on both sides ([`common::Rping`]).
fn rpings(runs: &[(On, On, &str)], addr: &str, port: &str) {
    let runs: Vec<(On, On, common::Rping)> = runs
        .iter()
        .map(|&(s, c, count)| {
            (
                s,
                c,
                common::Rping::new(addr, port, &["-v", "-V", "-C", count]),
            )
        })
        .collect();
    let servers: Vec<Proc> = runs
        .iter()
        .map(|((d, s), _, r)| Proc::spawn(d.run_on(Some(s), &r.server), "rping server"))
        .collect();
    // The broker holds a request a while for its listener; the servers are up well within it.
    std::thread::sleep(Duration::from_millis(300));
    let clients: Vec<Proc> = runs
        .iter()
        .map(|(_, (d, c), r)| Proc::spawn(d.run_on(Some(c), &r.client), "rping client"))
        .collect();
    let clients: Vec<Output> = clients.into_iter().map(|c| c.wait_bounded(PAIR)).collect();
    for ((s, client), (_, _, r)) in servers.into_iter().zip(clients).zip(&runs) {
        let pair = Pair {
            server: s.wait_bounded(Duration::from_secs(10)),
            client,
        };
        pair.assert_ok();
        r.assert_counted(&pair);
    }
}

/// A connection request across groups: an `rping` server on blue's `b1` (on every address)
/// and, half a second later, a client on red's `r1` aimed at it (`127.0.0.1`). Returns the
/// server (still running: it saw nothing), the client's output and how long the client took.
fn rping_across_groups(d: &Daemon) -> (Proc, Output, Duration) {
    let p = port().to_string();
    let server = Proc::spawn(
        d.run_on(
            Some("b1"),
            &["rping", "-s", "-a", "0.0.0.0", "-p", &p, "-C", "1"],
        ),
        "blue rping server",
    );
    std::thread::sleep(Duration::from_millis(500));
    let start = Instant::now();
    let client = Proc::spawn(
        d.run_on(
            Some("r1"),
            &["rping", "-c", "-a", "127.0.0.1", "-p", &p, "-C", "1", "-v"],
        ),
        "red rping client",
    )
    .wait_bounded(PAIR);
    (server, client, start.elapsed())
}

/// Asserts that a pair's client failed with `RETRY_EXC_ERR` (ibv_rc_pingpong prints status 12).
fn unreachable_rc(p: &Pair) {
    assert!(
        !p.client.ok() && p.client.text().contains("transport retry counter exceeded"),
        "the client must fail as with an absent peer\n{p}"
    );
}

/// Stops the daemon and returns its log, asserting it holds `line`.
fn logged(d: &mut Daemon, line: &str) {
    let out = d.stop();
    assert!(
        out.text().contains(line),
        "the daemon's log lacks {line:?}\n{}",
        out.text()
    );
}

/// Two tenants, red and blue, on one host with the same two virtual IPs. Within each group RC
/// (`ibv_rc_pingpong -c`: each page's first byte arrives), UD and rping over the virtual IP pass; both groups' rping servers
/// listen on the same address and port at once and each client reaches its own. Across
/// groups RC fails with `RETRY_EXC_ERR`, UD gets nothing, rping to a host address only the
/// other group listens on is `REJECTED`; the log names both vRNICs and groups.
#[test]
fn groups_on_one_host() {
    for t in ["ibv_rc_pingpong", "ibv_ud_pingpong", "rping"] {
        require(t);
    }
    let mut d = Daemon::start();
    create(&d, "r1", "red", "10.9.0.1");
    create(&d, "r2", "red", "10.9.0.2");
    create(&d, "b1", "blue", "10.9.0.1");
    create(&d, "b2", "blue", "10.9.0.2");
    let ls = d.ls();
    assert!(
        ls.lines().any(|l| l.starts_with("b1 ")
            && l.contains("10.9.0.1")
            && l.split_whitespace().nth(7) == Some("blue")),
        "{ls}"
    );

    let p = port().to_string();
    let s = ["ibv_rc_pingpong", "-p", &p, "-c", "-n", "50"];
    let c = ["ibv_rc_pingpong", "-p", &p, "-c", "-n", "50", "localhost"];
    let within = pair((&d, "r1"), &s, (&d, "r2"), &c, PAIR);
    within.assert_ok();
    assert!(!within.client.text().contains("invalid data"), "{within}");

    let p = port().to_string();
    let s = ["ibv_ud_pingpong", "-p", &p, "-n", "50"];
    let c = ["ibv_ud_pingpong", "-p", &p, "-n", "50", "localhost"];
    pair((&d, "b1"), &s, (&d, "b2"), &c, PAIR).assert_ok();

    // Both groups' servers on 10.9.0.1, one port, at once; 3 pings in red, 5 in blue.
    let p = port().to_string();
    let runs = [((&d, "r1"), (&d, "r2"), "3"), ((&d, "b1"), (&d, "b2"), "5")];
    rpings(&runs, "10.9.0.1", &p);

    // Across groups.
    let p = port().to_string();
    let s = ["ibv_rc_pingpong", "-p", &p, "-n", "5"];
    let c = ["ibv_rc_pingpong", "-p", &p, "-n", "5", "localhost"];
    unreachable_rc(&pair((&d, "b1"), &s, (&d, "r2"), &c, CROSS));
    let p = port().to_string();
    let s = ["ibv_ud_pingpong", "-p", &p, "-n", "5"];
    let c = ["ibv_ud_pingpong", "-p", &p, "-n", "5", "localhost"];
    let ud = pair((&d, "b1"), &s, (&d, "r2"), &c, CROSS);
    assert!(
        ud.client.timed_out && !ud.server.ok(),
        "datagrams across groups are dropped: nobody completes\n{ud}"
    );
    let (server, client, took) = rping_across_groups(&d);
    assert!(
        !client.ok() && client.text().contains("REJECTED") && took < PAIR,
        "{}",
        client.text()
    );
    let server = server.wait_bounded(Duration::from_millis(200));
    assert!(
        server.timed_out,
        "blue's server saw nothing\n{}",
        server.text()
    );
    logged(
        &mut d,
        "route refused across groups: vRNIC r2 (group red) -> vRNIC b1 (group blue)",
    );
    // (The stopped daemon's log is read once; the CM line was logged before it.)
}

/// With engine threads the refusal is made on the requester's thread and reaches the log
/// through its shard's outbox (the loop no longer locks every shard to ask): a red RC client
/// aimed at a blue vRNIC on another engine thread fails, and the line names both.
#[test]
fn a_route_refused_on_an_engine_thread_is_logged() {
    let mut d = Daemon::start_with(&["--engine-threads", "2"]);
    create(&d, "b1", "blue", "10.9.0.1");
    create(&d, "r1", "red", "10.9.0.2");
    let ls = d.ls();
    let engine = |name: &str| {
        ls.lines()
            .find(|l| l.starts_with(&format!("{name} ")))
            .and_then(|l| l.split_whitespace().nth(5).map(str::to_owned))
    };
    assert_ne!(engine("b1"), engine("r1"), "two engine threads\n{ls}");
    let p = port().to_string();
    let s = ["ibv_rc_pingpong", "-p", &p, "-n", "5"];
    let c = ["ibv_rc_pingpong", "-p", &p, "-n", "5", "localhost"];
    unreachable_rc(&pair((&d, "b1"), &s, (&d, "r1"), &c, CROSS));
    logged(
        &mut d,
        "route refused across groups: vRNIC r1 (group red) -> vRNIC b1 (group blue)",
    );
}

/// The CM's refusal line on one host (a request that only another group's listener serves).
#[test]
fn a_connection_request_across_groups_is_logged() {
    require("rping");
    let mut d = Daemon::start();
    create(&d, "r1", "red", "10.9.0.1");
    create(&d, "b1", "blue", "10.9.0.1");
    let (server, client, _) = rping_across_groups(&d);
    assert!(!client.ok(), "{}", client.text());
    drop(server);
    logged(
        &mut d,
        "connection request refused across groups: vRNIC r1 (group red) -> vRNIC b1 (group blue)",
    );
}

/// The same across two hosts: red and blue each have a vRNIC on both, with the same virtual
/// IPs. Host 1 sees host 0's vRNICs with their groups and addresses (`vrnic ls --all`); RC
/// and rping over the virtual IP pass within each group (both groups at once on one address
/// and port), RC across groups fails with `RETRY_EXC_ERR`, logged on the requester's host.
#[test]
fn groups_across_hosts() {
    for t in ["ibv_rc_pingpong", "rping"] {
        require(t);
    }
    let hosts = Hosts::new(2);
    let mut ds = hosts.daemons(LINKS_UP);
    create(&ds[0], "r1", "red", "10.9.0.1");
    create(&ds[0], "b1", "blue", "10.9.0.1");
    create(&ds[1], "r2", "red", "10.9.0.2");
    create(&ds[1], "b2", "blue", "10.9.0.2");
    let start = Instant::now();
    loop {
        let all = ds[1].cli_output(&["ls", "--all"]).stdout;
        let seen = |n: &str, ip: &str, g: &str| {
            all.lines().any(|l| {
                let f: Vec<&str> = l.split_whitespace().collect();
                f.get(1) == Some(&n) && f.contains(&ip) && f.contains(&g)
            })
        };
        if seen("r1", "10.9.0.1", "red") && seen("b1", "10.9.0.1", "blue") {
            break;
        }
        assert!(
            start.elapsed() < LINKS_UP,
            "host 0's vRNICs never showed\n{all}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }

    let addr = hosts.addr(0);
    let p = port().to_string();
    let s = ["ibv_rc_pingpong", "-p", &p, "-c", "-n", "50"];
    let c = ["ibv_rc_pingpong", "-p", &p, "-c", "-n", "50", &addr];
    let within = pair((&ds[0], "r1"), &s, (&ds[1], "r2"), &c, PAIR);
    within.assert_ok();
    assert!(!within.client.text().contains("invalid data"), "{within}");

    let p = port().to_string();
    let runs = [
        ((&ds[0], "r1"), (&ds[1], "r2"), "3"),
        ((&ds[0], "b1"), (&ds[1], "b2"), "5"),
    ];
    rpings(&runs, "10.9.0.1", &p);

    let p = port().to_string();
    let s = ["ibv_rc_pingpong", "-p", &p, "-n", "5"];
    let c = ["ibv_rc_pingpong", "-p", &p, "-n", "5", &addr];
    unreachable_rc(&pair((&ds[0], "b1"), &s, (&ds[1], "r2"), &c, CROSS));
    logged(
        &mut ds[1],
        &format!(
            "route refused across groups: vRNIC r2 (group red) -> vRNIC b1@{addr} (group blue)"
        ),
    );
}
