//! The operator's hand on a running tenant: `vrnic qp kill NAME QPN` moves one QP to the error
//! state (its app's work requests flush; its peer, on this host or another, fails within its
//! retry budget once it sends to it; another QP of the same vRNIC carries on), and `vrnic rm`
//! refuses a vRNIC in use unless `--force`, which tells each app the truth
//! (`IBV_EVENT_DEVICE_FATAL`, a driver log line naming the removal). Unmodified ibverbs-utils
//! and perftest (`ibv_rc_pingpong`, `ibv_asyncwatch`, `ib_write_bw`) under the driver library.

mod common;

use std::io::BufRead;
use std::process::Stdio;
use std::time::{Duration, Instant};

use common::{Daemon, Proc, port, require};

const LIMIT: Duration = Duration::from_secs(60);

/// Runs `cmd` with stdout piped and sends each line, as it comes, to the returned receiver.
fn spawn_lines(
    mut cmd: std::process::Command,
) -> (std::process::Child, std::sync::mpsc::Receiver<String>) {
    cmd.stdout(Stdio::piped()).stderr(Stdio::piped());
    let mut child = cmd.spawn().expect("spawn");
    let (tx, rx) = std::sync::mpsc::channel();
    for r in [
        Box::new(child.stdout.take().expect("stdout")) as Box<dyn std::io::Read + Send>,
        Box::new(child.stderr.take().expect("stderr")),
    ] {
        let tx = tx.clone();
        std::thread::spawn(move || {
            for l in std::io::BufReader::new(r).lines().map_while(Result::ok) {
                let _ = tx.send(l);
            }
        });
    }
    (child, rx)
}

/// Lines from `rx` until one satisfies `want` (within `limit`); all of them.
fn until(
    rx: &std::sync::mpsc::Receiver<String>,
    limit: Duration,
    want: impl Fn(&str) -> bool,
) -> Vec<String> {
    let end = Instant::now() + limit;
    let mut seen = Vec::new();
    while let Some(left) = end.checked_duration_since(Instant::now()) {
        match rx.recv_timeout(left) {
            Ok(l) => {
                let done = want(&l);
                seen.push(l);
                if done {
                    return seen;
                }
            }
            Err(_) => break,
        }
    }
    panic!("no line as expected within {limit:?}; saw {seen:#?}");
}

/// A client `make` starts, its lines read as they come: started again while it exits at once
/// (its server does not listen yet), for at most 30 s.
fn client_of(
    mut make: impl FnMut() -> std::process::Command,
) -> (std::process::Child, std::sync::mpsc::Receiver<String>) {
    let start = Instant::now();
    loop {
        let (mut child, rx) = spawn_lines(make());
        std::thread::sleep(Duration::from_millis(300));
        match child.try_wait() {
            Ok(Some(_)) if start.elapsed() < Duration::from_secs(30) => {
                std::thread::sleep(Duration::from_millis(200));
            }
            Ok(Some(s)) => panic!("the client exited: {s}"),
            _ => return (child, rx),
        }
    }
}

/// A pingpong that would run for minutes: its server on vRNIC `s` of `ds`, its client on `c`
/// of `dc` (reaching `addr`), the client's lines read as they come. Returns the server, the
/// client, its lines, and the client's QP number as it printed it.
fn long_pingpong(
    (ds, s): (&Daemon, &str),
    (dc, c): (&Daemon, &str),
    addr: &str,
) -> (
    Proc,
    std::process::Child,
    std::sync::mpsc::Receiver<String>,
    String,
) {
    let p = port().to_string();
    let long = ["ibv_rc_pingpong", "-n", "100000000", "-p", &p];
    let server = Proc::spawn(ds.run_on(Some(s), &long), "server");
    let mut client_args = vec!["stdbuf", "-oL"];
    client_args.extend(long);
    client_args.push(addr);
    let (client, rx) = client_of(|| dc.run_on(Some(c), &client_args));
    let seen = until(&rx, LIMIT, |l| l.contains("local address"));
    let qpn = seen
        .last()
        .and_then(|l| l.split("QPN ").nth(1))
        .and_then(|r| r.split(',').next())
        .expect("the client's QPN")
        .to_string();
    (server, client, rx, qpn)
}

/// After `vrnic qp kill` of the client's QP: the client's work flushes, and the server, its
/// peer, gets no more answers, so its retries run out (ibv_rc_pingpong's timeout 14,
/// retry_cnt 7: about half a second of budget) and its QP goes to error: the first failed
/// completion it polls is its send's `RETRY_EXC_ERR`, or its receive's flush when that came
/// first in its batch.
fn assert_killed(
    rx: &std::sync::mpsc::Receiver<String>,
    mut client: std::process::Child,
    server: Proc,
) {
    let seen = until(rx, LIMIT, |l| l.contains("Failed status"));
    assert!(
        seen.last()
            .is_some_and(|l| l.contains("Work Request Flushed Error (5)")),
        "{seen:#?}"
    );
    let _ = client.wait();
    let srv = server.wait_bounded(Duration::from_secs(20));
    assert!(
        !srv.ok()
            && (srv.stderr.contains("transport retry counter exceeded (12)")
                || srv.stderr.contains("Work Request Flushed Error (5)")),
        "{}",
        srv.text()
    );
}

#[test]
fn a_killed_qp_flushes_its_work_its_peer_fails_and_its_vrnics_other_qp_carries_on() {
    require("ibv_rc_pingpong");
    require("stdbuf");
    let mut d = Daemon::start();
    for n in ["s", "c"] {
        d.create(n);
    }
    let (server, client, rx, qpn) = long_pingpong((&d, "s"), (&d, "c"), "127.0.0.1");

    // Another pair on the same two vRNICs, started before the kill and running through it.
    let p2 = port().to_string();
    let other_args = ["ibv_rc_pingpong", "-n", "300000", "-p", &p2];
    let mut other_client = other_args.to_vec();
    other_client.push("127.0.0.1");
    let (other, other_c) = common::start_pair(
        d.run_on(Some("s"), &other_args),
        d.run_on(Some("c"), &other_client),
        p2.parse().expect("port"),
        LIMIT,
        "other",
    );
    std::thread::sleep(Duration::from_millis(300));

    // Refused while in use: nothing happens to the vRNIC.
    let out = d.cli_output(&["rm", "c"]);
    assert!(
        !out.ok() && out.stderr.contains("in use") && out.stderr.contains("--force"),
        "{}",
        out.text()
    );
    let out = d.cli_output(&["qp", "kill", "c", "0xabcdef"]);
    assert!(
        !out.ok() && out.stderr.contains("vRNIC c has no QP number 0xabcdef"),
        "{}",
        out.text()
    );
    let out = d.cli_output(&["qp", "kill", "s", &qpn]);
    assert!(!out.ok(), "the QP is c's, not s's\n{}", out.text());

    let killed = Instant::now();
    let out = d.cli_output(&["qp", "kill", "c", &qpn]);
    assert!(out.ok(), "{}", out.text());
    assert_killed(&rx, client, server);
    assert!(killed.elapsed() < Duration::from_secs(10));
    let (oc, os) = (other_c.wait_bounded(LIMIT), other.wait_bounded(LIMIT));
    assert!(
        oc.ok() && os.ok() && oc.stdout.contains("300000 iters"),
        "the other QP of the same vRNICs\n{}\n{}",
        oc.text(),
        os.text()
    );
    let log = d.stop().stderr;
    assert!(
        log.contains("QP moved to the error state") && log.contains("by=\"pid "),
        "{log}"
    );
}

#[test]
fn rm_force_tells_each_app_its_device_is_gone() {
    require("ibv_asyncwatch");
    require("stdbuf");
    let mut d = Daemon::start();
    d.create("w");
    let mut cmd = d.run_on(Some("w"), &["stdbuf", "-oL", "ibv_asyncwatch"]);
    cmd.env("VRNIC_LOG", "1");
    let (mut watch, rx) = spawn_lines(cmd);
    until(&rx, LIMIT, |l| l.contains("async event FD"));
    let out = d.cli_output(&["rm", "w"]);
    assert!(
        !out.ok()
            && out
                .stderr
                .contains("in use (1 attached context, 1 `vrnic run` holding it)"),
        "{}",
        out.text()
    );
    assert!(d.ls().lines().any(|l| l.starts_with("w ")), "{}", d.ls());
    let out = d.cli_output(&["rm", "--force", "w"]);
    assert!(out.ok(), "{}", out.text());
    // Both, in either order (the driver's log line is on stderr, the event on stdout).
    let mut seen = Vec::new();
    for _ in 0..2 {
        seen.extend(until(&rx, LIMIT, |l| {
            l.contains("IBV_EVENT_DEVICE_FATAL")
                || l.contains("vRNIC w was removed by the operator")
        }));
    }
    assert!(
        seen.iter().any(|l| l.contains("IBV_EVENT_DEVICE_FATAL"))
            && seen
                .iter()
                .any(|l| l.contains("vRNIC w was removed by the operator (vrnic rm --force)")),
        "{seen:#?}"
    );
    let _ = watch.kill();
    let _ = watch.wait();
    assert!(!d.ls().lines().any(|l| l.starts_with("w ")), "{}", d.ls());
    // An idle vRNIC goes without --force.
    d.create("idle");
    assert!(d.cli_output(&["rm", "idle"]).ok());
    let log = d.stop().stderr;
    assert!(log.contains("vRNIC removed by force"), "{log}");
}

/// Across hosts a peer learns nothing of a QP's fate until it sends to it (as with an RNIC):
/// here the killed QP is the responder of an `ib_write_bw`, whose requester, on the other
/// host, keeps writing to it and fails with `RETRY_EXC_ERR` once its retries run out.
#[test]
fn a_qp_killed_on_one_host_fails_its_peer_on_another() {
    require("ib_write_bw");
    require("stdbuf");
    let hosts = common::hosts::Hosts::new(2);
    let ds = hosts.daemons(Duration::from_secs(20));
    ds[0].create("s");
    ds[1].create("c");
    let addr = hosts.addr(0);
    let p = port().to_string();
    let args = ["ib_write_bw", "-s", "65536", "-D", "60", "-p", &p];
    let mut server_args = vec!["stdbuf", "-oL"];
    server_args.extend(args);
    let (mut server, srx) = spawn_lines(ds[0].run_on(Some("s"), &server_args));
    let mut client_args = vec!["stdbuf", "-oL", "-eL"];
    client_args.extend(args);
    client_args.push(&addr);
    let (mut client, crx) = client_of(|| ds[1].run_on(Some("c"), &client_args));
    let seen = until(&srx, LIMIT, |l| l.contains("local address"));
    let qpn = seen
        .last()
        .and_then(|l| l.split("QPN ").nth(1))
        .and_then(|r| r.split_whitespace().next())
        .expect("the server's QPN")
        .to_string();
    until(&crx, LIMIT, |l| l.contains("#bytes"));
    std::thread::sleep(Duration::from_millis(500));
    let killed = Instant::now();
    let out = ds[0].cli_output(&["qp", "kill", "s", &qpn]);
    assert!(out.ok(), "{}", out.text());
    let seen = until(&crx, Duration::from_secs(20), |l| {
        l.contains("Failed status")
    });
    assert!(
        seen.last().is_some_and(|l| l.contains("Failed status 12")),
        "{seen:#?}"
    );
    assert!(
        killed.elapsed() < Duration::from_secs(10),
        "{:?}",
        killed.elapsed()
    );
    let _ = client.wait();
    let _ = server.kill();
    let _ = server.wait();
}
