//! A tenant that names another group's QP by its number (docs/security.md, "A QP number
//! reaches only its own vRNIC"). Red has two vRNICs, r1 and r2; blue's QP V on b2 sits beside
//! r2 (same engine thread, same host) and is connected to (RC, UC) or reachable by (UD) its
//! legitimate peer on b1, beside r1. An attacker on r1 routes its QP to r2, which its group
//! allows, with V's QP number, PSN and Q_Key as the destination (`tests/c/qpn_attack.c`), and
//! sends. V must get only its peer's message; an RC attacker gets what an absent peer gives
//! (`RETRY_EXC_ERR`). Each path between two engines is attacked: one engine thread, two engine
//! threads of one daemon, and two hosts' daemons over a peer link.

mod common;

use std::path::PathBuf;
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use common::hosts::Hosts;
use common::{Daemon, Proc, c_program, port};

const LIMIT: Duration = Duration::from_secs(60);
const LINKS_UP: Duration = Duration::from_secs(20);

fn attack_bin() -> PathBuf {
    static BIN: OnceLock<PathBuf> = OnceLock::new();
    BIN.get_or_init(|| c_program("qpn_attack", &["-libverbs"]))
        .clone()
}

fn create(d: &Daemon, name: &str, group: &str) {
    let out = d.cli_output(&["create", name, "--group", group]);
    assert!(out.ok(), "vrnic create {name}\n{}", out.text());
}

/// The LID `vrnic ls` gives vRNIC `name` of `d`.
fn lid(d: &Daemon, name: &str) -> String {
    let ls = d.ls();
    ls.lines()
        .find_map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            (f.first() == Some(&name)).then(|| f[1].to_string())
        })
        .unwrap_or_else(|| panic!("{name} not in vrnic ls\n{ls}"))
}

/// Where each vRNIC sits: `(daemon, vRNIC)` for the victim b2, its peer b1, the attacker r1
/// and its route r2 (beside b2), and the address the victim listens on.
struct Scene<'a> {
    b2: (&'a Daemon, &'a str),
    b1: (&'a Daemon, &'a str),
    r1: (&'a Daemon, &'a str),
    r2: (&'a Daemon, &'a str),
    victim_addr: &'a str,
}

/// Runs the attack with QPs of `ty` (rc, uc, ud) and checks its outcome.
fn attack(s: &Scene, ty: &str) {
    let bin = attack_bin();
    let bin = bin.to_str().expect("utf-8 path");
    let (p1, p2) = (port().to_string(), port().to_string());
    let dlid = lid(s.r2.0, s.r2.1);
    let victim = Proc::spawn(
        s.b2.0.run_on(Some(s.b2.1), &[bin, "victim", &p1, &p2, ty]),
        "victim",
    );
    let peer = Proc::spawn(
        s.b1.0
            .run_on(Some(s.b1.1), &[bin, "peer", s.victim_addr, &p1, ty]),
        "peer",
    );
    // The attacker's connection is retried while the victim does not listen yet.
    let attacker = s.r1.0.run_on(
        Some(s.r1.1),
        &[bin, "attacker", s.victim_addr, &p2, ty, &dlid],
    );
    let attacker = Proc::spawn(attacker, "attacker").wait_bounded(LIMIT);
    let victim = victim.wait_bounded(LIMIT);
    let peer = peer.wait_bounded(LIMIT);
    let all = format!(
        "attacker:\n{}\nvictim:\n{}\npeer:\n{}",
        attacker.text(),
        victim.text(),
        peer.text()
    );
    assert!(attacker.ok(), "{ty}: the attacker ran\n{all}");
    assert!(
        !victim.text().contains("CROSS-TENANT"),
        "{ty}: red's SENDs reached blue's QP by its number\n{all}"
    );
    assert!(
        victim.ok()
            && victim
                .stdout
                .contains("only the legitimate peer's message arrived"),
        "{ty}: the victim got its peer's message and nothing else\n{all}"
    );
    assert!(peer.ok(), "{ty}: the legitimate peer\n{all}");
    let statuses: Vec<&str> = attacker
        .stdout
        .lines()
        .filter_map(|l| l.strip_prefix("attacker status "))
        .collect();
    if ty == "rc" {
        assert!(
            statuses.len() == 4
                && statuses[0].contains("retry counter exceeded")
                && statuses[1..].iter().all(|s| s.contains("Flushed")),
            "rc: the attacker's first SEND fails as to an absent peer (RETRY_EXC_ERR), the rest \
             are flushed\n{all}"
        );
    }
}

/// The shard each vRNIC named in `names` was given, from the daemon's log (after it stopped).
fn shards(log: &str, names: &[&str]) -> Vec<u32> {
    // The log's terminal colour codes out.
    let mut plain = String::new();
    let mut in_code = false;
    for c in log.chars() {
        match c {
            '\u{1b}' => in_code = true,
            c if in_code => in_code = !c.is_ascii_alphabetic(),
            c => plain.push(c),
        }
    }
    names
        .iter()
        .map(|n| {
            let line = plain
                .lines()
                .find(|l| l.contains("vRNIC created") && l.contains(&format!("vnic=\"{n}\"")))
                .unwrap_or_else(|| panic!("no creation line for {n}\n{plain}"));
            let at = line.find("engine=").expect("engine field") + "engine=".len();
            line[at..]
                .chars()
                .take_while(char::is_ascii_digit)
                .collect::<String>()
                .parse()
                .expect("a shard number")
        })
        .collect()
}

fn make_tenants(d: &Daemon) {
    // In this order the shard picker puts b2 and r2 on one thread, b1 and r1 on the other.
    for (n, g) in [("b2", "blue"), ("b1", "blue"), ("r2", "red"), ("r1", "red")] {
        create(d, n, g);
    }
}

/// Runs the attack with every QP type on one daemon with `threads` engine threads, and hands
/// the daemon back.
fn on_one_daemon(threads: &str) -> Daemon {
    let d = Daemon::start_with(&["--engine-threads", threads]);
    make_tenants(&d);
    let s = Scene {
        b2: (&d, "b2"),
        b1: (&d, "b1"),
        r1: (&d, "r1"),
        r2: (&d, "r2"),
        victim_addr: "127.0.0.1",
    };
    for ty in ["ud", "uc", "rc"] {
        attack(&s, ty);
    }
    d
}

/// One daemon, one engine thread: the local path's checks.
#[test]
fn a_qp_number_of_another_group_is_not_reached_on_one_engine() {
    on_one_daemon("1");
}

/// One daemon, two engine threads: b2 and r2 on one, b1 and r1 on the other, so every
/// segment of the attack and of the legitimate peer crosses between threads.
#[test]
fn a_qp_number_of_another_group_is_not_reached_across_engine_threads() {
    let mut d = on_one_daemon("2");
    let log = d.stop().text();
    let at = shards(&log, &["b2", "b1", "r2", "r1"]);
    assert!(
        at[0] == at[2] && at[1] == at[3] && at[0] != at[1],
        "b2 and r2 on one engine thread, b1 and r1 on the other: {at:?}\n{log}"
    );
}

/// Two hosts: b2 and r2 on host 1, b1 and r1 on host 0, every segment over the peer link.
#[test]
fn a_qp_number_of_another_group_is_not_reached_across_hosts() {
    let hosts = Hosts::new(2);
    let ds = hosts.daemons(LINKS_UP);
    create(&ds[1], "b2", "blue");
    create(&ds[1], "r2", "red");
    create(&ds[0], "b1", "blue");
    create(&ds[0], "r1", "red");
    let start = Instant::now();
    while !["b2", "r2"].iter().all(|n| {
        ds[0]
            .cli_output(&["ls", "--all"])
            .stdout
            .lines()
            .any(|l| l.split_whitespace().nth(1) == Some(n))
    }) {
        assert!(start.elapsed() < LINKS_UP, "host 1's vRNICs never showed");
        std::thread::sleep(Duration::from_millis(50));
    }
    let addr = hosts.addr(1);
    let s = Scene {
        b2: (&ds[1], "b2"),
        b1: (&ds[0], "b1"),
        r1: (&ds[0], "r1"),
        r2: (&ds[1], "r2"),
        victim_addr: &addr,
    };
    for ty in ["ud", "uc", "rc"] {
        attack(&s, ty);
    }
}
