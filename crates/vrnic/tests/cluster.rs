//! Cluster mode on etcd (`vrnic serve --etcd`): daemons in network namespaces register
//! themselves and their vRNICs in an etcd the test starts (`common/hosts.rs`: [`Hosts::etcd`]),
//! find their peers there, and learn every change through watches. Unmodified
//! `ibv_rc_pingpong` and `ib_write_bw` run between hosts under `vrnic run`.
//!
//! - three daemons: a vRNIC created on one is listed by another within a second (measured);
//!   a killed daemon's vRNICs go when its lease expires and its peers' QPs fail without a
//!   hang; restarted, it rejoins and serves;
//! - 64 vRNICs created at once across three hosts: every LID, GID and IP unique;
//! - etcd stopped mid-run: a running transfer finishes, a new vRNIC is refused with an error
//!   naming etcd, and once etcd is back new connections work;
//! - rdma_cm (`rping -V`) across hosts by a group's virtual IP and by a host address, both
//!   resolved from etcd's records;
//! - malformed records in etcd are ignored and logged; a hello from an address that is not
//!   the one its host index is registered with is refused.

mod common;

use std::collections::HashSet;
use std::time::{Duration, Instant};

use common::hosts::{Etcd, Hosts, PEER_PORT};
use common::{Daemon, Output, Proc, port, require};

const LINKS_UP: Duration = Duration::from_secs(30);
const PAIR: Duration = Duration::from_secs(120);
/// The lease time to live the daemons are started with.
const TTL_S: u64 = 3;
/// The requirement: a change reaches every daemon within a second.
const PROPAGATION: Duration = Duration::from_secs(1);

/// One row of `vrnic ls --all`.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Row {
    host: String,
    name: String,
    lid: String,
    gid: String,
    ip: String,
    group: String,
}

/// `vrnic ls --all` on `d`, parsed.
fn directory(d: &Daemon) -> Vec<Row> {
    let out = d.cli_output(&["ls", "--all"]);
    assert!(out.ok(), "vrnic ls --all\n{}", out.text());
    out.stdout
        .lines()
        .skip(1)
        .map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            assert!(f.len() >= 7, "a row of vrnic ls --all: {l:?}");
            Row {
                host: f[0].into(),
                name: f[1].into(),
                lid: f[2].into(),
                gid: f[3].into(),
                ip: f[4].into(),
                group: f[5].into(),
            }
        })
        .collect()
}

/// Waits (at most `limit`) until `pred` holds of `d`'s directory; returns it and how long
/// that took.
fn wait_directory(
    d: &Daemon,
    limit: Duration,
    what: &str,
    pred: impl Fn(&[Row]) -> bool,
) -> (Vec<Row>, Duration) {
    let start = Instant::now();
    loop {
        let rows = directory(d);
        if pred(&rows) {
            return (rows, start.elapsed());
        }
        assert!(
            start.elapsed() < limit,
            "{what}: not within {limit:?}\n{rows:#?}"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// Three hosts (or `n`) with an etcd and a cluster daemon on each, every link up.
fn cluster(n: usize) -> (Hosts, Etcd, Vec<Daemon>) {
    cluster_with(n, &[])
}

/// [`cluster`] with `extra` options for every daemon.
fn cluster_with(n: usize, extra: &[&str]) -> (Hosts, Etcd, Vec<Daemon>) {
    let hosts = Hosts::new(n);
    let etcd = hosts.etcd();
    let ds: Vec<Daemon> = (0..n)
        .map(|i| hosts.cluster_daemon_with(i, &etcd, TTL_S, extra))
        .collect();
    for d in &ds {
        d.wait_links(n - 1, LINKS_UP);
    }
    (hosts, etcd, ds)
}

/// RC WRITEs and READs (`tests/c/stream_check.c`, one round: 64 MiB written and read back)
/// with its server on a fresh vRNIC of `server` (host at `addr`) and its client on a fresh
/// vRNIC of `client`; both must pass, every byte checked on both ends.
fn rc_pair(server: &Daemon, client: &Daemon, addr: &str) {
    let bin = common::c_program("stream_check", &["-libverbs"]);
    let pair = common::c_check_pair_across(server, client, addr, &bin, &["1"], PAIR);
    assert!(
        pair.client
            .stdout
            .contains("OK client: every byte, both ways, 1 rounds")
            && pair
                .server
                .stdout
                .contains("OK server: every byte, 1 rounds"),
        "{pair}"
    );
}

/// Cluster daemons with three engine threads each: RC pairs between the hosts pass both ways,
/// each byte checked, with the apps' vRNICs on several engine threads (vRNICs made first take
/// shards), the directory from etcd known to every shard.
#[test]
fn a_cluster_with_engine_threads_serves_pairs_both_ways() {
    let (hosts, _etcd, ds) = cluster_with(2, &["--engine-threads", "3"]);
    for (i, d) in ds.iter().enumerate() {
        let out = d.cli_output(&["create", &format!("pad{i}")]);
        assert!(out.ok(), "vrnic create\n{}", out.text());
    }
    let (a0, a1) = (hosts.addr(0), hosts.addr(1));
    for _ in 0..2 {
        rc_pair(&ds[0], &ds[1], &a0);
        rc_pair(&ds[1], &ds[0], &a1);
    }
}

/// A vRNIC created on A is in C's directory within one second (measured from the create
/// command's start) and reachable: an RC pair from C to it passes. B's daemon SIGKILLed under a
/// transfer from C: C's client fails (no hang), and B's vRNICs leave A's and C's directories
/// once its lease expires (measured). B restarted rejoins (links up both ways) and serves.
#[test]
fn three_daemons_reach_each_other_lose_a_dead_one_and_take_it_back() {
    require("ibv_rc_pingpong");
    let (hosts, _etcd, mut ds) = cluster(3);

    let start = Instant::now();
    let out = ds[0].cli_output(&["create", "a1"]);
    assert!(out.ok(), "vrnic create a1\n{}", out.text());
    let (rows, _) = wait_directory(&ds[2], Duration::from_secs(10), "a1 on C", |r| {
        r.iter()
            .any(|r| r.name == "a1" && r.host == hosts.addr(0) + ":7700")
    });
    let took = start.elapsed();
    println!("a vRNIC created on A was listed on C after {took:?} (requirement: {PROPAGATION:?})");
    assert!(
        took < PROPAGATION,
        "a1 took {took:?} to reach C (requirement {PROPAGATION:?})\n{rows:#?}"
    );
    let a1 = rows
        .iter()
        .find(|r| r.name == "a1")
        .expect("just seen")
        .clone();
    let mine = directory(&ds[0]);
    let local = mine.iter().find(|r| r.name == "a1").expect("a1 on A");
    assert_eq!(
        (&local.lid, &local.gid, &local.ip),
        (&a1.lid, &a1.gid, &a1.ip)
    );
    assert_eq!(local.host, "local");

    // Reachable: a pair from C to A's a1.
    let p = port().to_string();
    let s = ["ibv_rc_pingpong", "-p", &p, "-c", "-n", "50"];
    let addr0 = hosts.addr(0);
    let c = ["ibv_rc_pingpong", "-p", &p, "-c", "-n", "50", &addr0];
    let pair = common::pair_of(ds[0].run_on(Some("a1"), &s), || ds[2].run(&c), PAIR);
    pair.assert_ok();

    // B dies under a transfer from C.
    let out = ds[1].cli_output(&["create", "b1"]);
    assert!(out.ok(), "vrnic create b1\n{}", out.text());
    wait_directory(&ds[0], Duration::from_secs(10), "b1 on A", |r| {
        r.iter().any(|r| r.name == "b1")
    });
    let p = port().to_string();
    let addr1 = hosts.addr(1);
    let (server, client) = common::start_transfer(
        ds[1].run(&["ib_write_bw", "-p", &p, "-D", "30"]),
        || ds[2].run(&["ib_write_bw", "-p", &p, "-D", "30", &addr1]),
        Duration::from_millis(1500),
        "ib_write_bw",
    );
    let killed = Instant::now();
    let _ = ds[1].kill();
    let out = client.wait_bounded(Duration::from_secs(30));
    println!(
        "C's client ended {:?} after B's daemon was killed",
        killed.elapsed()
    );
    assert!(!out.timed_out, "C's client hung\n{}", out.text());
    assert!(
        !out.ok(),
        "C's transfer cannot have finished\n{}",
        out.text()
    );
    drop(server);
    let limit = Duration::from_secs(TTL_S) + Duration::from_secs(5);
    for (i, d) in [(0, &ds[0]), (2, &ds[2])] {
        let (_, _) = wait_directory(d, limit, "B's vRNICs gone", |r| {
            !r.iter().any(|r| r.host.starts_with(&addr1))
        });
        println!(
            "B's vRNICs left host {i}'s directory {:?} after its daemon was killed (lease TTL {TTL_S} s)",
            killed.elapsed()
        );
        d.wait_links(1, Duration::from_secs(5));
    }
    assert!(
        killed.elapsed() < limit,
        "B's vRNICs stayed {:?}",
        killed.elapsed()
    );

    // B comes back and serves.
    ds[1].restart();
    for d in &ds {
        d.wait_links(2, LINKS_UP);
    }
    rc_pair(&ds[1], &ds[0], &addr1);
    rc_pair(&ds[2], &ds[1], &hosts.addr(2));
}

/// 64 `vrnic create` at once, spread over three hosts: all succeed, and every host's
/// directory lists all 64 with no LID, GID or virtual IP twice.
#[test]
fn sixty_four_vrnics_created_at_once_have_unique_lids_gids_and_ips() {
    let (_hosts, _etcd, ds) = cluster(3);
    let procs: Vec<(String, Proc)> = (0..64)
        .map(|k| {
            let name = format!("v{k}");
            let mut c = ds[k % 3].cli();
            c.args(["create", &name]);
            let p = Proc::spawn(c, &format!("vrnic create {name}"));
            (name, p)
        })
        .collect();
    for (name, p) in procs {
        let out = p.wait(Duration::from_secs(60));
        assert!(out.ok(), "vrnic create {name}\n{}", out.text());
    }
    for d in &ds {
        let (rows, _) = wait_directory(d, Duration::from_secs(10), "64 vRNICs", |r| r.len() == 64);
        let names: HashSet<&str> = rows.iter().map(|r| r.name.as_str()).collect();
        assert_eq!(names.len(), 64, "{rows:#?}");
        for (what, col) in [
            (
                "LID",
                rows.iter().map(|r| r.lid.as_str()).collect::<Vec<_>>(),
            ),
            ("GID", rows.iter().map(|r| r.gid.as_str()).collect()),
            ("IP", rows.iter().map(|r| r.ip.as_str()).collect()),
        ] {
            let unique: HashSet<&str> = col.iter().copied().collect();
            assert_eq!(unique.len(), 64, "a {what} twice\n{rows:#?}");
        }
        assert!(rows.iter().all(|r| r.group == "default"));
        let local = rows.iter().filter(|r| r.host == "local").count();
        assert!((21..=22).contains(&local), "{local} local of 64");
    }
    println!("64 vRNICs on 3 hosts: 64 distinct LIDs, GIDs and IPs on every host's directory");
}

/// etcd stopped while a transfer runs between two hosts: the transfer finishes; a new
/// `vrnic run` is refused at once with an error naming etcd, and an rdma_cm lookup of the
/// other host from a vRNIC made before the outage fails at once (`rping`), logged; etcd
/// started again, the daemons register again and a new pair passes.
#[test]
fn etcd_stopped_mid_run_keeps_running_pairs_and_refuses_new_ones_until_it_returns() {
    require("ib_write_bw");
    require("ibv_rc_pingpong");
    require("rping");
    let (hosts, mut etcd, mut ds) = cluster(2);
    let addr0 = hosts.addr(0);
    let out = ds[1].cli_output(&["create", "keep"]);
    assert!(out.ok(), "{}", out.text());
    let p = port().to_string();
    let (server, mut client) = common::start_transfer(
        ds[0].run(&["ib_write_bw", "-p", &p, "-D", "6"]),
        || ds[1].run(&["ib_write_bw", "-p", &p, "-D", "6", &addr0]),
        Duration::from_millis(1000),
        "ib_write_bw",
    );
    etcd.stop();
    let stopped = Instant::now();
    // The outage began under the transfer: etcd is gone (its process reaped), the client runs.
    if client.exited() {
        panic!(
            "the transfer ended before etcd stopped (make it longer)\n{}",
            client.wait_bounded(PAIR).text()
        );
    }

    // A new connection needs a new vRNIC, which needs etcd: refused with a clear error.
    let refused =
        |o: &Output| !o.ok() && o.stderr.contains("etcd") && o.stderr.contains("unreachable");
    let out = loop {
        let out = ds[1].cli_output(&["run", "--", "true"]);
        if refused(&out) || stopped.elapsed() > Duration::from_secs(15) {
            break out;
        }
        assert!(out.ok() || out.stderr.contains("etcd"), "{}", out.text());
        std::thread::sleep(Duration::from_millis(100));
    };
    assert!(refused(&out), "no clear error without etcd\n{}", out.text());
    println!(
        "without etcd a new connection was refused {:?} after it stopped: {}",
        stopped.elapsed(),
        out.stderr.trim()
    );
    let p2 = port().to_string();
    let t = Instant::now();
    let out = common::output(
        ds[1].run(&["ibv_rc_pingpong", "-p", &p2, &addr0]),
        "client ibv_rc_pingpong",
        Duration::from_secs(10),
    );
    assert!(refused(&out), "{}", out.text());
    assert!(
        t.elapsed() < Duration::from_secs(5),
        "refused only after {:?}",
        t.elapsed()
    );
    // A vRNIC that exists needs no etcd, but its lookup of another host does.
    let t = Instant::now();
    let out = common::output(
        ds[1].run_on(
            Some("keep"),
            &["rping", "-c", "-a", &addr0, "-p", &p2, "-C", "1"],
        ),
        "rping client",
        Duration::from_secs(10),
    );
    assert!(
        !out.ok() && out.stderr.contains("rdma_resolve_addr"),
        "a lookup without etcd\n{}",
        out.text()
    );
    println!(
        "without etcd, rping's lookup of host 0 failed: {}",
        out.text().trim()
    );
    assert!(
        t.elapsed() < Duration::from_secs(5),
        "failed only after {:?}",
        t.elapsed()
    );

    // The transfer under way finishes.
    let c = client.wait_bounded(PAIR);
    let s = server.wait_bounded(Duration::from_secs(20));
    assert!(
        c.ok() && s.ok(),
        "the running pair did not finish\n--- client\n{}\n--- server\n{}",
        c.text(),
        s.text()
    );
    assert!(c.stdout.contains("MB/sec"), "{}", c.text());

    // etcd back: the daemons register again and serve new pairs.
    etcd.start();
    let back = Instant::now();
    loop {
        let out = ds[1].cli_output(&["create", "probe"]);
        if out.ok() {
            break;
        }
        assert!(
            back.elapsed() < Duration::from_secs(30),
            "no vRNIC after etcd came back\n{}",
            out.text()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    println!(
        "after etcd came back a vRNIC was registered within {:?}",
        back.elapsed()
    );
    wait_directory(&ds[0], Duration::from_secs(10), "probe on host 0", |r| {
        r.iter().any(|r| r.name == "probe")
    });
    rc_pair(&ds[0], &ds[1], &addr0);
    let log = ds[1].stop().text();
    assert!(
        log.contains("address lookup refused: the cluster directory (etcd at"),
        "the refused lookup is not logged\n{log}"
    );
}

/// Records no daemon could have written, put into etcd by another writer: a vRNIC record that
/// is not JSON, one with a name no vRNIC can have, one under another LID's key, a host whose
/// peer-link address is 0.0.0.0. Every daemon ignores them (nothing listed, no link), logs
/// them, and goes on: a vRNIC made afterwards reaches the other host.
#[test]
fn malformed_records_in_etcd_are_ignored_and_logged() {
    let (hosts, etcd, mut ds) = cluster(2);
    etcd.put("/vrnic/v1/vnics/77", b"{not json");
    let bad_name = format!(
        "{{\"host\":0,\"name\":\"a b\",\"lid\":78,\"gid\":\"{}\",\"ip\":\"100.64.9.9\",\"group\":\"default\"}}",
        "fe80000000000000025652c00000004e"
    );
    etcd.put("/vrnic/v1/vnics/78", bad_name.as_bytes());
    etcd.put(
        "/vrnic/v1/vnics/79",
        bad_name.replace("a b", "ab").as_bytes(),
    );
    etcd.put(
        "/vrnic/v1/hosts/9",
        b"{\"addr\":\"0.0.0.0:7700\",\"addrs\":[]}",
    );
    let out = ds[0].cli_output(&["create", "after"]);
    assert!(out.ok(), "{}", out.text());
    let (rows, _) = wait_directory(&ds[1], Duration::from_secs(10), "after on host 1", |r| {
        r.iter().any(|r| r.name == "after")
    });
    assert!(
        !rows
            .iter()
            .any(|r| ["77", "78", "79"].contains(&r.lid.as_str())),
        "{rows:#?}"
    );
    for d in &ds {
        d.wait_links(1, Duration::from_secs(5));
    }
    rc_pair(&ds[0], &ds[1], &hosts.addr(0));
    for d in &mut ds {
        let log = d.stop().text();
        for line in [
            "a malformed vRNIC record in etcd, ignored",
            "a malformed host record in etcd, ignored",
            "LID 78 under the key of LID 79",
        ] {
            assert!(log.contains(line), "the log lacks {line:?}\n{log}");
        }
    }
}

/// A third namespace with no daemon connects to both daemons' peer ports and sends a
/// well-formed cluster hello claiming host index 0 from its own address: neither takes it (a
/// hello without the handshake that proves host 0's key; the index is also registered with
/// another address, or not lower than its own), both log the refusal with the intruder's
/// address, and their link stays up and serves.
#[test]
fn a_hello_from_an_address_its_index_is_not_registered_with_is_refused() {
    require("ibv_rc_pingpong");
    let hosts = Hosts::new(3);
    let etcd = hosts.etcd();
    let mut ds: Vec<Daemon> = (0..2)
        .map(|i| hosts.cluster_daemon(i, &etcd, TTL_S))
        .collect();
    for d in &ds {
        d.wait_links(1, LINKS_UP);
    }
    // Magic "vR", version 2, kind 2 (hello), length 14; protocol 3, no flags, index 0, 0
    // hosts (a cluster host): a hello without the handshake that proves a host's key.
    let hello = r"vR\x02\x02\x00\x00\x00\x0e\x03\x00\x00\x00\x00\x00";
    for i in 0..2 {
        let script = format!(
            "exec 3<>/dev/tcp/{}/{PEER_PORT} && printf '{hello}' >&3 && sleep 0.3",
            hosts.addr(i)
        );
        let mut c = std::process::Command::new("nsenter");
        c.arg(format!("--net=/run/netns/{}", hosts.names[2]))
            .args(["bash", "-c", &script]);
        let out = Proc::spawn(c, "intruder").wait(Duration::from_secs(20));
        assert!(out.ok(), "{}", out.text());
    }
    for d in &ds {
        d.wait_links(1, Duration::from_secs(5));
    }
    rc_pair(&ds[0], &ds[1], &hosts.addr(0));
    let intruder = hosts.addr(2);
    for d in &mut ds {
        let log = d.stop().text();
        assert!(
            log.lines().any(
                |l| l.contains("peer connections refused: an unauthenticated hello")
                    && l.contains(&intruder)
            ),
            "the log lacks the refused hello from {intruder}\n{log}"
        );
    }
}

/// rdma_cm across cluster hosts: what it resolves comes from etcd. `rping -V` between a vRNIC
/// of group red on host 0 (virtual IP 10.9.0.1, given at `vrnic create`) and one of red on
/// host 1, through the virtual IP; then through host 0's own address (in its host record),
/// each side printing exactly its pings.
#[test]
fn rping_across_cluster_hosts_by_virtual_ip_and_host_address() {
    require("rping");
    let (hosts, _etcd, ds) = cluster(2);
    for (d, name, ip) in [(&ds[0], "r1", "10.9.0.1"), (&ds[1], "r2", "10.9.0.2")] {
        let out = d.cli_output(&["create", name, "--group", "red", "--ip", ip]);
        assert!(out.ok(), "vrnic create {name}\n{}", out.text());
    }
    wait_directory(&ds[1], Duration::from_secs(10), "r1 on host 1", |r| {
        r.iter()
            .any(|r| r.name == "r1" && r.ip == "10.9.0.1" && r.group == "red")
    });
    let addr0 = hosts.addr(0);
    for (server_on, client_on, addr) in [
        (Some("r1"), Some("r2"), "10.9.0.1"),
        (None, None, addr0.as_str()),
    ] {
        let p = port().to_string();
        let r = common::Rping::new(addr, &p, &["-v", "-V", "-C", "5"]);
        let pair = common::pair_of(
            ds[0].run_on(server_on, &r.server),
            || ds[1].run_on(client_on, &r.client),
            PAIR,
        );
        pair.assert_ok();
        r.assert_counted(&pair);
    }
}
