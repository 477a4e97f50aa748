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
    let (server, client) = common::pingpong_sides(args, &p, "127.0.0.1");
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

/// `curl -s URL`: the body, or `None` where curl fails.
fn curl(url: &str) -> Option<String> {
    let out = std::process::Command::new("curl")
        .args(["-s", "-f", "--max-time", "5", url])
        .output()
        .ok()?;
    out.status
        .success()
        .then(|| String::from_utf8_lossy(&out.stdout).into_owned())
}

/// `vrnic serve --metrics`: the counters in Prometheus' format, exact, labelled by vRNIC,
/// group and host; scraped by a real Prometheus server, whose query API then returns them; a
/// metrics address in use stops the daemon at start with a clear error.
#[test]
fn prometheus_scrapes_the_counters() {
    require("ib_write_bw");
    require("curl");
    let prometheus = require("prometheus");
    let mport = port();
    let maddr = format!("127.0.0.1:{mport}");
    let mut d = Daemon::start_with(&["--metrics", &maddr]);
    d.create("m0");
    let out = d.cli_output(&["create", "m1", "--max-bw", "10G"]);
    assert!(out.ok(), "{}", out.text());
    run_pair(&d, "m0", "m1", &["ib_write_bw", "-s", "4096", "-n", "1000"]);
    let url = format!("http://{maddr}/metrics");
    let body = curl(&url).expect("GET /metrics");
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .expect("hostname")
        .trim()
        .to_string();
    let labels = |v: &str| format!("vnic=\"{v}\",group=\"default\",host=\"{host}\"");
    for want in [
        format!(
            "vrnic_sent_work_requests_total{{{},class=\"write\"}} 1000",
            labels("m1")
        ),
        format!(
            "vrnic_sent_bytes_total{{{},class=\"write\"}} 4096000",
            labels("m1")
        ),
        format!(
            "vrnic_received_bytes_total{{{},class=\"write\"}} 4096000",
            labels("m0")
        ),
        format!(
            "vrnic_sent_bytes_total{{{},class=\"write\"}} 0",
            labels("m0")
        ),
        format!(
            "vrnic_max_bw_bytes_per_second{{{}}} 10000000000",
            labels("m1")
        ),
        format!("vrnic_qos_waits_total{{{}}} 0", labels("m0")),
        "# TYPE vrnic_completions counter".to_string(),
        "# EOF".to_string(),
    ] {
        assert!(
            body.lines().any(|l| l == want),
            "no line {want:?} in\n{body}"
        );
    }
    assert!(
        !body.contains("vrnic_max_bw_bytes_per_second{vnic=\"m0\""),
        "an unlimited vRNIC has no limit gauge\n{body}"
    );

    // A real Prometheus scrapes it every second; its query API returns the counter.
    let dir = d.dir.join("prometheus");
    std::fs::create_dir_all(&dir).expect("prometheus dir");
    let config = dir.join("prometheus.yml");
    std::fs::write(
        &config,
        format!(
            "global:\n  scrape_interval: 1s\nscrape_configs:\n  - job_name: vrnic\n    \
             static_configs:\n      - targets: ['{maddr}']\n"
        ),
    )
    .expect("write prometheus.yml");
    let pport = port();
    let mut prom = std::process::Command::new(prometheus);
    prom.arg(format!("--config.file={}", config.display()))
        .arg(format!(
            "--storage.tsdb.path={}",
            dir.join("data").display()
        ))
        .arg(format!("--web.listen-address=127.0.0.1:{pport}"));
    let mut prom = common::Proc::spawn(prom, "prometheus");
    let query = format!(
        "http://127.0.0.1:{pport}/api/v1/query?query=vrnic_sent_bytes_total%7Bvnic%3D%22m1%22%2Cclass%3D%22write%22%7D"
    );
    let start = std::time::Instant::now();
    let answer = loop {
        if let Some(a) = curl(&query).filter(|a| a.contains("\"4096000\"")) {
            break a;
        }
        assert!(
            start.elapsed() < Duration::from_secs(60) && !prom.exited(),
            "Prometheus never got the counter (last answer {:?})",
            curl(&query)
        );
        std::thread::sleep(Duration::from_millis(500));
    };
    for label in [
        "\"group\":\"default\"".to_string(),
        format!("\"host\":\"{host}\""),
        "\"job\":\"vrnic\"".to_string(),
    ] {
        assert!(answer.contains(&label), "{label} in {answer}");
    }
    prom.signal(libc::SIGTERM);
    let _ = prom.wait_bounded(Duration::from_secs(10));

    // The address in use: a second daemon stops at start and says why.
    let other = d.dir.with_extension("second");
    let out = common::output(
        {
            let mut c = std::process::Command::new(common::vrnic_bin());
            c.args(["serve", "--state-dir"])
                .arg(&other)
                .args(["--metrics", &maddr]);
            c
        },
        "a second daemon on the same metrics address",
        Duration::from_secs(20),
    );
    let _ = std::fs::remove_dir_all(&other);
    assert!(
        !out.ok() && out.stderr.contains("bind the metrics address"),
        "{}",
        out.text()
    );
    d.stop();
}

/// `vrnic top`: plain tables with `--batch` (the client's send rate and the server's receive
/// rate of a running `ib_write_bw`, the cap shown), and on a terminal (a pty from `script`) a
/// live screen that quits cleanly on `q`, giving the terminal back.
#[test]
fn top_shows_the_rates_and_quits_on_q() {
    require("ib_write_bw");
    let script = require("script");
    let d = Daemon::start();
    d.create("t0");
    let out = d.cli_output(&["create", "t1", "--max-bw", "2G"]);
    assert!(out.ok(), "{}", out.text());
    let p = port().to_string();
    let args = ["ib_write_bw", "-s", "65536", "-D", "4", "-p", &p];
    let mut client_args = args.to_vec();
    client_args.push("127.0.0.1");
    let (server, client) = common::start_pair(
        d.run_on(Some("t0"), &args),
        d.run_on(Some("t1"), &client_args),
        p.parse().expect("port"),
        LIMIT,
        "ib_write_bw",
    );
    std::thread::sleep(Duration::from_millis(1500));
    let out = d.cli_output(&["top", "--batch", "1", "--interval", "1"]);
    assert!(out.ok(), "{}", out.text());
    let row = |name: &str| -> Vec<String> {
        out.stdout
            .lines()
            .find(|l| l.split_whitespace().next() == Some(name))
            .unwrap_or_else(|| panic!("{name} in\n{}", out.stdout))
            .split_whitespace()
            .map(str::to_string)
            .collect()
    };
    // NAME GROUP QPS USERS TX_WR/s TX_B/s RX_MSG/s RX_B/s ERR/s QOS% MAX_BW MAX_RATE
    let (t0, t1) = (row("t0"), row("t1"));
    assert!(t1[5].ends_with('G') || t1[5].ends_with('M'), "{t1:?}");
    assert_eq!(t1[10], "2G", "{t1:?}");
    assert_eq!(t0[5], "0", "{t0:?}");
    assert!(t0[7].ends_with('G') || t0[7].ends_with('M'), "{t0:?}");
    assert!(
        !out.stdout.contains('\x1b'),
        "no escape codes in a batch table"
    );
    let _ = client.wait_bounded(LIMIT);
    let _ = server.wait_bounded(LIMIT);

    // On a terminal: the live screen, then `q`.
    let cmd = format!(
        "{} --state-dir {} top --interval 0.2",
        common::vrnic_bin().display(),
        d.dir.display()
    );
    let mut tty = std::process::Command::new(script);
    tty.args(["-qfec", &cmd, "/dev/null"])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped());
    let mut child = tty.spawn().expect("script");
    std::thread::sleep(Duration::from_millis(1500));
    use std::io::Write as _;
    let mut stdin = child.stdin.take().expect("stdin");
    stdin.write_all(b"q").expect("send q");
    let start = std::time::Instant::now();
    let status = loop {
        if let Some(s) = child.try_wait().expect("wait") {
            break s;
        }
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "top did not quit on q"
        );
        std::thread::sleep(Duration::from_millis(50));
    };
    drop(stdin);
    let out = child.wait_with_output().expect("output");
    let screen = String::from_utf8_lossy(&out.stdout);
    assert!(status.success(), "{screen}");
    assert!(
        screen.contains("q: quit") && screen.contains("t1"),
        "{screen}"
    );
    // The alternate screen was left and the cursor shown again.
    assert!(
        screen.contains("\x1b[?1049l") && screen.contains("\x1b[?25h"),
        "{screen:?}"
    );
}

/// `vrnic stats NAME --qp QPN`: one QP's counters while it runs, exact per message size; a
/// QP number the vRNIC does not have (or another vRNIC's) is an error.
#[test]
fn a_qps_counters_while_it_runs() {
    require("ib_write_bw");
    require("stdbuf");
    let d = Daemon::start();
    d.create("q0");
    d.create("q1");
    let p = port().to_string();
    let args = ["ib_write_bw", "-s", "65536", "-D", "3", "-p", &p];
    let server = common::Proc::spawn(d.run_on(Some("q0"), &args), "server");
    let server = common::wait_listening(server, p.parse().expect("port"), LIMIT);
    let mut client_args = vec!["stdbuf", "-oL"];
    client_args.extend(args);
    client_args.push("127.0.0.1");
    let mut cmd = d.run_on(Some("q1"), &client_args);
    cmd.stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null());
    let mut client = cmd.spawn().expect("client");
    let mut lines = std::io::BufRead::lines(std::io::BufReader::new(
        client.stdout.take().expect("stdout"),
    ));
    // "local address: LID 0x02 QPN 0x0013 PSN ..." then "remote address: ... QPN 0x0012 ...".
    let qpn_of = |l: &str| {
        l.split("QPN ")
            .nth(1)
            .and_then(|r| r.split_whitespace().next())
            .map(str::to_string)
    };
    let mut local = None;
    let mut remote = None;
    for l in lines.by_ref().map_while(Result::ok) {
        if l.contains("local address") {
            local = qpn_of(&l);
        }
        if l.contains("remote address") {
            remote = qpn_of(&l);
            break;
        }
    }
    let (local, remote) = (local.expect("client QPN"), remote.expect("server QPN"));
    std::thread::sleep(Duration::from_millis(1500));
    let qp_stats = |name: &str, qpn: &str| -> Value {
        let out = d.cli_output(&["stats", name, "--qp", qpn, "--json"]);
        assert!(out.ok(), "{}", out.text());
        let v: Value = serde_json::from_str(&out.stdout).expect("JSON");
        v[0].clone()
    };
    let c = qp_stats("q1", &local);
    let (wrs, bytes) = flow(&c, "sent", "write");
    assert!(wrs > 0 && bytes == wrs * 65536, "{c}");
    assert!(c["qpn"].as_u64().is_some(), "{c}");
    let s = qp_stats("q0", &remote);
    let (msgs, rbytes) = flow(&s, "received", "write");
    assert!(msgs > 0 && rbytes == msgs * 65536, "{s}");
    assert_eq!(flow(&s, "sent", "write"), (0, 0), "{s}");
    for (name, qpn) in [("q0", local.as_str()), ("q1", "0xabcdef")] {
        let out = d.cli_output(&["stats", name, "--qp", qpn]);
        assert!(
            !out.ok() && out.stderr.contains("has no QP number"),
            "{}",
            out.text()
        );
    }
    for _ in lines.by_ref() {}
    let _ = client.wait();
    let _ = server.wait_bounded(LIMIT);
}

/// The connection manager's steps are counted per vRNIC (`vrnic stats`, `cm`): an unmodified
/// `rping` pair's client made one connect and got its connection, its server's listener one
/// request and one connection; a client whose destination has no listener is rejected, and
/// that rejection is counted once, on its own vRNIC only.
#[test]
fn connection_manager_steps_are_counted_per_vrnic() {
    require("rping");
    let d = Daemon::start();
    for v in ["s", "c", "lone"] {
        d.create(v);
    }
    let p = port().to_string();
    pair(
        (&d, "s"),
        &["rping", "-s", "-a", "0.0.0.0", "-p", &p, "-C", "3"],
        (&d, "c"),
        &["rping", "-c", "-a", "127.0.0.1", "-p", &p, "-C", "3"],
        LIMIT,
    )
    .assert_ok();
    let cm = |name: &str| {
        let s = stats(&d, name);
        ["connects", "requests", "established", "rejected"]
            .map(|k| s["cm"][k].as_u64().expect("a cm counter"))
    };
    assert_eq!(cm("c"), [1, 0, 1, 0], "the client's vRNIC");
    assert_eq!(cm("s"), [0, 1, 1, 0], "the server's vRNIC");
    // Nobody listens on this port: the request is rejected once the broker stops waiting.
    let q = port().to_string();
    let lone = common::Proc::spawn(
        d.run_on(
            Some("lone"),
            &["rping", "-c", "-a", "127.0.0.1", "-p", &q, "-C", "1"],
        ),
        "rping with no server",
    )
    .wait_bounded(LIMIT);
    assert!(!lone.ok(), "{}", lone.text());
    assert_eq!(cm("lone"), [1, 0, 0, 1], "the rejected client's vRNIC");
    assert_eq!(cm("s"), [0, 1, 1, 0], "the server's vRNIC is untouched");
    let text = d.cli_output(&["stats", "lone"]);
    assert!(
        text.stdout
            .contains("cm connects 1  requests 0  established 0  rejected 1"),
        "{}",
        text.text()
    );
}
