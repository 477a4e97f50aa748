//! The operator's hand on a running tenant: `vrnic qp kill NAME QPN` moves one QP to the error
//! state (its app's work requests flush, its peer, on this host or another, fails within its
//! retry budget, another QP of the same vRNIC carries on), and `vrnic rm` refuses a vRNIC in use unless `--force`, which
//! tells each app the truth (`IBV_EVENT_DEVICE_FATAL`, a driver log line naming the removal).
//! Unmodified ibverbs-utils (`ibv_rc_pingpong`, `ibv_asyncwatch`) under the driver library.

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

#[test]
fn a_killed_qp_flushes_its_work_its_peer_fails_and_its_vrnics_other_qp_carries_on() {
    require("ibv_rc_pingpong");
    require("stdbuf");
    let mut d = Daemon::start();
    for n in ["s", "c"] {
        d.create(n);
    }
    // A pingpong that would run for minutes, the client's addresses printed as they come.
    let p = port().to_string();
    let long = ["ibv_rc_pingpong", "-n", "100000000", "-p", &p];
    let server = Proc::spawn(d.run_on(Some("s"), &long), "server");
    let mut client_args = vec!["stdbuf", "-oL"];
    client_args.extend(long);
    client_args.push("127.0.0.1");
    let start = Instant::now();
    let (mut client, rx) = loop {
        let (mut child, rx) = spawn_lines(d.run_on(Some("c"), &client_args));
        std::thread::sleep(Duration::from_millis(300));
        match child.try_wait() {
            Ok(Some(_)) if start.elapsed() < Duration::from_secs(30) => continue,
            Ok(Some(s)) => panic!("the client exited: {s}"),
            _ => break (child, rx),
        }
    };
    let seen = until(&rx, LIMIT, |l| l.contains("local address"));
    let qpn = seen
        .last()
        .and_then(|l| l.split("QPN ").nth(1))
        .and_then(|r| r.split(',').next())
        .expect("the client's QPN")
        .to_string();

    // Another pair on the same two vRNICs, started before the kill and running through it.
    let p2 = port().to_string();
    let other_args = ["ibv_rc_pingpong", "-n", "300000", "-p", &p2];
    let mut other_client = other_args.to_vec();
    other_client.push("127.0.0.1");
    let other = Proc::spawn(d.run_on(Some("s"), &other_args), "other server");
    let other = common::wait_listening(other, p2.parse().expect("port"), LIMIT);
    let other_c = Proc::spawn(d.run_on(Some("c"), &other_client), "other client");
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
        !out.ok() && out.stderr.contains("no QP number"),
        "{}",
        out.text()
    );
    let out = d.cli_output(&["qp", "kill", "s", &qpn]);
    assert!(!out.ok(), "the QP is c's, not s's\n{}", out.text());

    let killed = Instant::now();
    let out = d.cli_output(&["qp", "kill", "c", &qpn]);
    assert!(out.ok(), "{}", out.text());
    let seen = until(&rx, LIMIT, |l| l.contains("Failed status"));
    assert!(
        seen.last()
            .is_some_and(|l| l.contains("Work Request Flushed Error (5)")),
        "{seen:#?}"
    );
    let _ = client.wait();
    // The peer: no answers any more, so its retries run out (ibv_rc_pingpong's timeout 14,
    // retry_cnt 7: about half a second of budget) and its QP goes to error: the first failed
    // completion it polls is its send's `RETRY_EXC_ERR`, or its receive's flush when that
    // came first in its batch.
    let srv = server.wait_bounded(Duration::from_secs(20));
    assert!(
        !srv.ok()
            && (srv.stderr.contains("transport retry counter exceeded (12)")
                || srv.stderr.contains("Work Request Flushed Error (5)")),
        "{}",
        srv.text()
    );
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
    assert!(!out.ok() && out.stderr.contains("in use"), "{}", out.text());
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

#[test]
fn a_qp_killed_on_one_host_fails_its_peer_on_another() {
    require("ibv_rc_pingpong");
    require("stdbuf");
    let hosts = common::hosts::Hosts::new(2);
    let ds = hosts.daemons(Duration::from_secs(20));
    ds[0].create("s");
    ds[1].create("c");
    let p = port().to_string();
    let long = ["ibv_rc_pingpong", "-n", "100000000", "-p", &p];
    let server = Proc::spawn(ds[0].run_on(Some("s"), &long), "server");
    let addr = hosts.addr(0);
    let mut client_args = vec!["stdbuf", "-oL"];
    client_args.extend(long);
    client_args.push(&addr);
    let start = Instant::now();
    let (mut client, rx) = loop {
        let (mut child, rx) = spawn_lines(ds[1].run_on(Some("c"), &client_args));
        std::thread::sleep(Duration::from_millis(300));
        match child.try_wait() {
            Ok(Some(_)) if start.elapsed() < Duration::from_secs(30) => continue,
            Ok(Some(s)) => panic!("the client exited: {s}"),
            _ => break (child, rx),
        }
    };
    let seen = until(&rx, LIMIT, |l| l.contains("local address"));
    let qpn = seen
        .last()
        .and_then(|l| l.split("QPN ").nth(1))
        .and_then(|r| r.split(',').next())
        .expect("the client's QPN")
        .to_string();
    std::thread::sleep(Duration::from_millis(300));
    let out = ds[1].cli_output(&["qp", "kill", "c", &qpn]);
    assert!(out.ok(), "{}", out.text());
    let seen = until(&rx, LIMIT, |l| l.contains("Failed status"));
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
