//! Metering (`vrnic stats [NAME] [--json]`): unmodified perftest and ibverbs-utils pairs
//! between two vRNICs of one daemon, and each side's counters exact afterwards: work requests
//! and bytes sent by the requester and received by the responder for WRITE, READ, atomics and
//! SEND, completions by status; a vRNIC made again under the same name starts from zero; a name
//! that is not there is an error.

mod common;

use std::time::Duration;

use common::{Daemon, pair_on as pair, port, require};
use serde_json::Value;

const LIMIT: Duration = Duration::from_secs(60);

/// `vrnic stats NAME --json` of `d`: the vRNIC's object.
fn stats(d: &Daemon, name: &str) -> Value {
    let out = d.cli_output(&["stats", name, "--json"]);
    assert!(out.ok(), "vrnic stats {name}\n{}", out.text());
    let v: Value = serde_json::from_str(&out.stdout).expect("vrnic stats --json is JSON");
    let list = v.as_array().expect("an array");
    assert_eq!(list.len(), 1, "{v}");
    assert_eq!(list[0]["name"], name);
    list[0].clone()
}

/// (wrs, bytes) of `dir` (`sent`, `received`) and `class` in `s`.
fn flow(s: &Value, dir: &str, class: &str) -> (u64, u64) {
    let f = &s[dir][class];
    (
        f["wrs"].as_u64().expect("wrs"),
        f["bytes"].as_u64().expect("bytes"),
    )
}

/// Runs `args` (a perftest or ibverbs-utils program) with its server on vRNIC `s` and its
/// client on `c`, both of `d`; both must pass.
fn run_pair(d: &Daemon, s: &str, c: &str, args: &[&str]) {
    let p = port().to_string();
    let mut server = args.to_vec();
    server.extend(["-p", &p]);
    let mut client = server.clone();
    client.push("127.0.0.1");
    pair((d, s), &server, (d, c), &client, LIMIT).assert_ok();
}

#[test]
fn stats_count_every_work_request_and_byte_on_both_sides() {
    for tool in [
        "ib_write_bw",
        "ib_read_bw",
        "ib_atomic_bw",
        "ibv_rc_pingpong",
    ] {
        require(tool);
    }
    let d = Daemon::start();
    for (s, c) in [("w0", "w1"), ("r0", "r1"), ("a0", "a1"), ("p0", "p1")] {
        d.create(s);
        d.create(c);
    }
    // The client writes into the server: 1000 x 4 KiB.
    run_pair(&d, "w0", "w1", &["ib_write_bw", "-s", "4096", "-n", "1000"]);
    let (srv, cli) = (stats(&d, "w0"), stats(&d, "w1"));
    assert_eq!(flow(&cli, "sent", "write"), (1000, 4_096_000), "{cli}");
    assert_eq!(flow(&srv, "received", "write"), (1000, 4_096_000), "{srv}");
    assert_eq!(flow(&srv, "sent", "write"), (0, 0), "{srv}");
    let ok = cli["completions"]["success"].as_u64().unwrap_or(0);
    assert!((1..=1000).contains(&ok), "{cli}");
    assert!(
        cli["completions"].as_object().is_some_and(|m| m.len() == 1),
        "only successes: {cli}"
    );

    // The client reads from the server: 500 x 8 KiB.
    run_pair(&d, "r0", "r1", &["ib_read_bw", "-s", "8192", "-n", "500"]);
    let (srv, cli) = (stats(&d, "r0"), stats(&d, "r1"));
    assert_eq!(flow(&cli, "sent", "read"), (500, 4_096_000), "{cli}");
    assert_eq!(flow(&srv, "received", "read"), (500, 4_096_000), "{srv}");

    // Atomics: 8 bytes each.
    run_pair(&d, "a0", "a1", &["ib_atomic_bw", "-n", "500"]);
    let (srv, cli) = (stats(&d, "a0"), stats(&d, "a1"));
    assert_eq!(flow(&cli, "sent", "atomic"), (500, 4000), "{cli}");
    assert_eq!(flow(&srv, "received", "atomic"), (500, 4000), "{srv}");

    // SENDs both ways, each received into a receive: what one side sent, the other received.
    run_pair(
        &d,
        "p0",
        "p1",
        &["ibv_rc_pingpong", "-s", "1024", "-n", "100"],
    );
    let (srv, cli) = (stats(&d, "p0"), stats(&d, "p1"));
    for (a, b) in [(&srv, &cli), (&cli, &srv)] {
        let sent = flow(a, "sent", "send");
        assert!(sent.0 >= 100 && sent.1 == sent.0 * 1024, "{a}");
        assert_eq!(flow(b, "received", "send"), sent, "{a}\n{b}");
    }
    for s in [&srv, &cli] {
        assert_eq!(s["rnr_naks"], 0, "{s}");
        assert_eq!(s["naks"], 0, "{s}");
    }

    // The table names every vRNIC; a missing one is an error; a vRNIC made again starts anew.
    let out = d.cli_output(&["stats"]);
    assert!(out.ok(), "{}", out.text());
    for n in ["w0", "w1", "r0", "r1", "a0", "a1", "p0", "p1"] {
        assert!(
            out.stdout.lines().any(|l| l.starts_with(&format!("{n} "))),
            "{n} not in\n{}",
            out.text()
        );
    }
    assert!(
        out.stdout.contains("write 1000 / 4096000 B"),
        "{}",
        out.text()
    );
    let out = d.cli_output(&["stats", "nosuch"]);
    assert!(
        !out.ok() && out.stderr.contains("no vRNIC nosuch"),
        "{}",
        out.text()
    );
    let out = d.cli_output(&["rm", "w1"]);
    assert!(out.ok(), "{}", out.text());
    d.create("w1");
    assert_eq!(flow(&stats(&d, "w1"), "sent", "write"), (0, 0));
}
