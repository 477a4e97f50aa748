//! QoS limits of the virtual layer (`vrnic create NAME --max-bw B --max-rate R`, `vrnic policy`),
//! measured with unmodified perftest: a vRNIC capped at 1 GB/s and one at 100 MB/s send
//! `ib_write_bw -s 65536` within 10% of their caps, one host and across two namespace hosts
//! (the limit holds for what leaves over the peer link); a message-rate cap on
//! `ib_write_bw -s 2` likewise; a cap changed mid-run takes effect within a second; `vrnic ls`
//! shows the limits and `vrnic stats` the time a vRNIC waited on them. An uncapped vRNIC beside
//! two capped ones (1 GB/s and 100 MB/s, or 100K and 10K work requests/s; 20 MB/s and 10 MB/s
//! across hosts, where the peer link carries 0.5 to 1.3 GB/s on 2 cores) keeps at least 90% of
//! what it moves alone, measured in the same test, alone and beside alternated, while the capped
//! ones hold their caps. Those tests take every test thread (`.config/nextest.toml`): nothing
//! else of the suite runs beside them.
//!
//! perftest's "MB/sec" is MiB/s (2^20 bytes); the caps are in bytes per second.

mod common;

use std::io::BufRead;
use std::process::Stdio;
use std::time::{Duration, Instant};

use common::hosts::Hosts;
use common::{Daemon, pair_on, port, require};

const LIMIT: Duration = Duration::from_secs(90);
const MIB: f64 = 1048576.0;

/// (average MiB/s, Mpps) of a perftest bandwidth report.
fn report(out: &str) -> (f64, f64) {
    let mut lines = out.lines();
    lines
        .by_ref()
        .find(|l| l.contains("BW average[MB/sec]"))
        .unwrap_or_else(|| panic!("no report\n{out}"));
    let row: Vec<f64> = lines
        .next()
        .unwrap_or_default()
        .split_whitespace()
        .filter_map(|f| f.parse().ok())
        .collect();
    assert!(row.len() >= 5, "a report row\n{out}");
    (row[3], row[4])
}

/// `ib_write_bw -s SIZE -D 3` from vRNIC `c` of `dc` to `s` of `ds`: the client's report.
fn write_bw(ds: &Daemon, s: &str, dc: &Daemon, c: &str, addr: &str, size: &str) -> (f64, f64) {
    let p = port().to_string();
    let server = ["ib_write_bw", "-s", size, "-D", "3", "-p", &p];
    let mut client = server.to_vec();
    client.push(addr);
    let pair = pair_on((ds, s), &server, (dc, c), &client, LIMIT);
    pair.assert_ok();
    report(&pair.client.stdout)
}

fn within(got: f64, want: f64, what: &str) {
    assert!(
        (got - want).abs() <= 0.1 * want,
        "{what}: {got:.2}, expected {want:.2} within 10%"
    );
}

fn cli_ok(d: &Daemon, args: &[&str]) -> String {
    let out = d.cli_output(args);
    assert!(out.ok(), "vrnic {}\n{}", args.join(" "), out.text());
    out.stdout
}

#[test]
fn capped_vrnics_send_at_their_caps_and_an_uncapped_one_is_not_held() {
    require("ib_write_bw");
    let d = Daemon::start();
    cli_ok(&d, &["create", "srv"]);
    cli_ok(&d, &["create", "gig", "--max-bw", "1G"]);
    cli_ok(&d, &["create", "hundred", "--max-bw", "100M"]);
    cli_ok(&d, &["create", "rate", "--max-rate", "200K"]);
    cli_ok(&d, &["create", "free"]);
    let ls = cli_ok(&d, &["ls"]);
    let row = |name: &str| -> Vec<String> {
        ls.lines()
            .find(|l| l.split_whitespace().next() == Some(name))
            .unwrap_or_else(|| panic!("{name} in\n{ls}"))
            .split_whitespace()
            .map(str::to_string)
            .collect()
    };
    assert_eq!(row("gig")[8..10], ["1G", "-"], "{ls}");
    assert_eq!(row("hundred")[8..10], ["100M", "-"], "{ls}");
    assert_eq!(row("rate")[8..10], ["-", "200K"], "{ls}");
    assert_eq!(row("free")[8..10], ["-", "-"], "{ls}");

    let (bw, _) = write_bw(&d, "srv", &d, "gig", "127.0.0.1", "65536");
    within(bw * MIB, 1e9, "1 GB/s cap, bytes/s");
    let (bw, _) = write_bw(&d, "srv", &d, "hundred", "127.0.0.1", "65536");
    within(bw * MIB, 1e8, "100 MB/s cap, bytes/s");
    let (_, mpps) = write_bw(&d, "srv", &d, "rate", "127.0.0.1", "2");
    within(mpps * 1e6, 2e5, "200 K/s message-rate cap, work requests/s");
    // Uncapped: far above the largest cap (the machine's own rate is in `vrnic bench`).
    let (bw, _) = write_bw(&d, "srv", &d, "free", "127.0.0.1", "65536");
    assert!(bw * MIB > 3e9, "an uncapped vRNIC at {bw:.0} MiB/s");

    // The capped vRNICs waited, and `vrnic stats` says so; the uncapped one never did.
    let waits = |name: &str| -> u64 {
        let s: serde_json::Value =
            serde_json::from_str(&cli_ok(&d, &["stats", name, "--json"])).expect("JSON");
        s[0]["qos_waits"].as_u64().expect("qos_waits")
    };
    assert!(waits("hundred") > 0);
    assert_eq!(waits("free"), 0);

    // Lifting a limit: `none`.
    cli_ok(&d, &["policy", "hundred", "--max-bw", "none"]);
    assert_eq!(
        cli_ok(&d, &["ls"])
            .lines()
            .find(|l| l.starts_with("hundred"))
            .map(|l| l.split_whitespace().skip(8).take(2).collect::<Vec<_>>()),
        Some(vec!["-", "-"])
    );
    // Errors: no such vRNIC, a bad unit, nothing to change.
    for args in [
        &["policy", "nobody", "--max-bw", "1G"][..],
        &["policy", "gig", "--max-bw", "1X"],
        &["policy", "gig"],
        &["create", "bad", "--max-rate", "-5"],
    ] {
        let out = d.cli_output(args);
        assert!(
            !out.ok(),
            "vrnic {} should fail\n{}",
            args.join(" "),
            out.text()
        );
    }
}

#[test]
fn a_cap_changed_mid_run_takes_effect_within_a_second() {
    require("ib_write_bw");
    require("stdbuf");
    let d = Daemon::start();
    cli_ok(&d, &["create", "srv"]);
    cli_ok(&d, &["create", "cli", "--max-bw", "100M"]);
    let p = port().to_string();
    let args = [
        "ib_write_bw",
        "-s",
        "65536",
        "-D",
        "1",
        "--run_infinitely",
        "-p",
        &p,
    ];
    let mut server = common::Proc::spawn(d.run_on(Some("srv"), &args), "server");
    // The client's reports, a line each second, stamped as they come (line-buffered by
    // `stdbuf`: perftest's stdout is a pipe here).
    let mut client_args = vec!["stdbuf", "-oL"];
    client_args.extend(args);
    client_args.push("127.0.0.1");
    let start = Instant::now();
    let (tx, rx) = std::sync::mpsc::channel::<(Instant, f64)>();
    let mut child = loop {
        let mut cmd = d.run_on(Some("cli"), &client_args);
        cmd.stdout(Stdio::piped()).stderr(Stdio::null());
        let mut child = cmd.spawn().expect("spawn the client");
        let out = child.stdout.take().expect("stdout");
        let tx = tx.clone();
        std::thread::spawn(move || {
            for l in std::io::BufReader::new(out).lines().map_while(Result::ok) {
                let f: Vec<f64> = l
                    .split_whitespace()
                    .filter_map(|f| f.parse().ok())
                    .collect();
                if f.len() >= 5 && f[0] == 65536.0 {
                    let _ = tx.send((Instant::now(), f[3]));
                }
            }
        });
        std::thread::sleep(Duration::from_millis(500));
        match child.try_wait() {
            // Exited at once: the server did not listen yet.
            Ok(Some(_)) if start.elapsed() < Duration::from_secs(30) => continue,
            Ok(Some(s)) => panic!("the client exited: {s}"),
            _ => break child,
        }
    };
    let wait_line = |rx: &std::sync::mpsc::Receiver<(Instant, f64)>| {
        rx.recv_timeout(Duration::from_secs(20))
            .expect("a report each second")
    };
    // Two reports at the old cap, then the change.
    let mut seen = Vec::new();
    for _ in 0..2 {
        seen.push(wait_line(&rx));
    }
    let changed = Instant::now();
    cli_ok(&d, &["policy", "cli", "--max-bw", "1G"]);
    // Every report that ends 2 s after the change or later covers a second that began at
    // least a second after it: at the new cap.
    let mut after = Vec::new();
    while after.len() < 2 {
        let (t, bw) = wait_line(&rx);
        seen.push((t, bw));
        if t >= changed + Duration::from_secs(2) {
            after.push(bw);
        }
    }
    common::kill_pid(child.id() as i32, libc::SIGTERM);
    let _ = child.wait();
    server.signal(libc::SIGTERM);
    let _ = server.wait_bounded(Duration::from_secs(10));
    let text: Vec<String> = seen
        .iter()
        .map(|(t, bw)| format!("{:.2}s {bw:.1}", t.duration_since(start).as_secs_f64()))
        .collect();
    within(
        seen[1].1 * MIB,
        1e8,
        &format!("before the change ({text:?})"),
    );
    for bw in after {
        within(bw * MIB, 1e9, &format!("after the change ({text:?})"));
    }
}

#[test]
fn a_cap_holds_for_what_leaves_over_a_peer_link() {
    require("ib_write_bw");
    let hosts = Hosts::new(2);
    let ds = hosts.daemons(Duration::from_secs(20));
    cli_ok(&ds[0], &["create", "srv"]);
    cli_ok(&ds[1], &["create", "gig", "--max-bw", "1G"]);
    cli_ok(&ds[1], &["create", "hundred", "--max-bw", "100M"]);
    let addr = hosts.addr(0);
    let (bw, _) = write_bw(&ds[0], "srv", &ds[1], "hundred", &addr, "65536");
    within(bw * MIB, 1e8, "100 MB/s cap across hosts, bytes/s");
    let (bw, _) = write_bw(&ds[0], "srv", &ds[1], "gig", &addr, "65536");
    within(bw * MIB, 1e9, "1 GB/s cap across hosts, bytes/s");
}

/// How a capped pair runs beside the uncapped one: its apps under `SCHED_IDLE` (`chrt
/// --idle 0`). perftest's event mode (`-e`) would make their waiting cost no CPU, but
/// `ib_write_bw` has none ("Events feature not available on WRITE verb", nor with `-D`); under
/// `SCHED_IDLE` a busy-polling app leaves the cores to the uncapped pair and the engine. The test
/// is about the engine: a capped tenant waiting on its limit must not slow another, and on 2
/// cores three busy-polling pairs at one priority would measure the CPU scheduler instead.
/// `SCHED_IDLE` rather than `nice -n 19`: a niceness is relative to the runner's, and under
/// `nice -n 15 cargo nextest` (as on a shared machine) `nice -n 19` is only 4 steps below the
/// uncapped pair, whose share the capped apps then took (75% kept in one run).
const IDLE: [&str; 3] = ["chrt", "--idle", "0"];

/// The capped pairs' send queue (`ib_write_bw -t`): deep enough that a client that gets a core
/// only now and then still keeps its vRNIC sending at the cap (8192 work requests are 82 ms at
/// 100K/s, 0.5 s of 64 KiB at 1 GB/s), so the cap the test checks is the engine's, not the CPU
/// share of an idle-priority app beside other work on the machine. With perftest's default of
/// 128 a busy machine starved them (in one full run of the suite 69% of a 1G cap, 59% of a 200K
/// one).
const CAPPED_DEPTH: [&str; 2] = ["-t", "8192"];

/// `ib_write_bw -s SIZE -D SECS` and `extra` options from vRNIC `c` of `dc` to `s` of `ds`,
/// each app behind `prefix`, made ready to run on another thread (a [`Daemon`] stays on the
/// test's): run it for the client's report.
fn write_bw_for(
    (ds, s): (&Daemon, &str),
    (dc, c): (&Daemon, &str),
    addr: &str,
    (size, secs, extra): (&str, &str, &[&str]),
    prefix: &[&str],
) -> impl FnOnce() -> (f64, f64) + Send + use<> {
    let p = port().to_string();
    let mut server = prefix.to_vec();
    server.extend(["ib_write_bw", "-s", size, "-D", secs, "-p", &p]);
    server.extend(extra);
    let mut client = server.clone();
    client.push(addr);
    let server = remake(&ds.run_on(Some(s), &server));
    let client = remake(&dc.run_on(Some(c), &client));
    move || {
        let pair = common::pair_of(server(), client, LIMIT);
        pair.assert_ok();
        report(&pair.client.stdout)
    }
}

/// What makes `cmd` again (program, arguments, environment), as often as asked.
fn remake(cmd: &std::process::Command) -> impl Fn() -> std::process::Command + Send + use<> {
    let program = cmd.get_program().to_owned();
    let args: Vec<_> = cmd.get_args().map(ToOwned::to_owned).collect();
    let envs: Vec<_> = cmd
        .get_envs()
        .map(|(k, v)| (k.to_owned(), v.map(ToOwned::to_owned)))
        .collect();
    move || {
        let mut c = std::process::Command::new(&program);
        c.args(&args);
        for (k, v) in &envs {
            match v {
                Some(v) => c.env(k, v),
                None => c.env_remove(k),
            };
        }
        c
    }
}

/// `vrnic stats NAME`'s count of what the vRNIC sent as RDMA WRITE requester: work requests
/// (`wrs`) or bytes.
fn sent_by(d: &Daemon, name: &str, wrs: bool) -> u64 {
    let s: serde_json::Value =
        serde_json::from_str(&cli_ok(d, &["stats", name, "--json"])).expect("JSON");
    let field = if wrs { "wrs" } else { "bytes" };
    s[0]["sent"]["write"][field]
        .as_u64()
        .expect("sent write count")
}

/// `vrnic stats NAME`'s `qos_waits`: turns refused for the limit.
fn qos_waits(d: &Daemon, name: &str) -> u64 {
    let s: serde_json::Value =
        serde_json::from_str(&cli_ok(d, &["stats", name, "--json"])).expect("JSON");
    s[0]["qos_waits"].as_u64().expect("qos_waits")
}

/// A capped tenant for [`beside_capped`]: its client vRNIC (on the clients' daemon, created
/// with `--max-bw` or `--max-rate` by the caller), its server vRNIC, and its cap (bytes/s for
/// `-s 65536`, work requests/s for `-s 2`).
struct Capped<'a> {
    client: &'a str,
    server: &'a str,
    cap: f64,
}

/// The uncapped pair (`free` on `dc` to `srv` on `ds`, `ib_write_bw -s SIZE -D 3`, polling)
/// alone, then while the two `capped` pairs run (under [`IDLE`], with [`CAPPED_DEPTH`]) and wait on
/// their limits, `ROUNDS` times alternated. Checks that the capped pairs held their caps over
/// the uncapped run (what the daemon counts them sending, by `vrnic stats`, over its span):
/// within 10% in the median round, and above it by more than 10% in none (a
/// round short of its cap is the engine thread off its core for longer than the limit's
/// burst (the engine's `qos::BURST`, 10 ms) lets it catch up, which other work on a 2-core machine does; a
/// limiter that held the engine would fall short in every round); returns the uncapped rates
/// (bytes/s or work requests/s) alone and beside.
fn beside_capped(
    ds: &Daemon,
    dc: &Daemon,
    addr: &str,
    size: &str,
    capped: &[Capped; 2],
) -> (Vec<f64>, Vec<f64>) {
    const ROUNDS: usize = 3;
    // Bytes/s (perftest's MiB/s) for large messages, work requests/s (its Mpps) for small ones.
    let rate = |(mib, mpps): (f64, f64)| {
        if size == "2" { mpps * 1e6 } else { mib * MIB }
    };
    let (mut alone, mut beside) = (Vec::new(), Vec::new());
    let mut held: [Vec<f64>; 2] = Default::default();
    for round in 0..ROUNDS {
        alone.push(rate(write_bw_for(
            (ds, "srv"),
            (dc, "free"),
            addr,
            (size, "3", &[]),
            &[],
        )()));
        let waited: Vec<u64> = capped.iter().map(|t| qos_waits(dc, t.client)).collect();
        let got = std::thread::scope(|sc| {
            // Long enough to start, be seen waiting on their limits, and outlast the uncapped
            // run (about 4 s with its connection).
            let runs: Vec<_> = capped
                .iter()
                .map(|t| {
                    sc.spawn(write_bw_for(
                        (ds, t.server),
                        (dc, t.client),
                        addr,
                        (size, "8", &CAPPED_DEPTH),
                        &IDLE,
                    ))
                })
                .collect();
            // Both capped clients are sending and held by their limits before the uncapped
            // run starts.
            let start = Instant::now();
            while capped
                .iter()
                .zip(&waited)
                .any(|(t, &w)| qos_waits(dc, t.client) <= w)
            {
                assert!(
                    start.elapsed() < Duration::from_secs(30),
                    "the capped pairs never waited on their limits (round {round})"
                );
                std::thread::sleep(Duration::from_millis(100));
            }
            // The capped pairs' rates are the engine's, counted by the daemon over the
            // uncapped run's span, not what their perftest reports: an app at idle priority
            // on busy cores polls late, counts completions that piled up before its sample
            // window began as if they came in it, and read 110% of an exact cap so.
            let sent = |t: &Capped| sent_by(dc, t.client, size == "2");
            let before: Vec<(u64, Instant)> =
                capped.iter().map(|t| (sent(t), Instant::now())).collect();
            let free = rate(write_bw_for(
                (ds, "srv"),
                (dc, "free"),
                addr,
                (size, "3", &[]),
                &[],
            )());
            let caps: Vec<f64> = capped
                .iter()
                .zip(&before)
                .map(|(t, &(n, at))| (sent(t) - n) as f64 / at.elapsed().as_secs_f64())
                .collect();
            for r in runs {
                let said = rate(r.join().expect("a capped pair"));
                eprintln!("a capped pair's perftest reported {said:.0} over its whole run");
            }
            (free, caps)
        });
        beside.push(got.0);
        eprintln!(
            "round {round}: uncapped alone {:.0}, beside {:.0}; capped {:.0?}",
            alone[round], got.0, got.1
        );
        for (h, got) in held.iter_mut().zip(got.1) {
            h.push(got);
        }
    }
    eprintln!("uncapped -s {size}: alone {alone:.0?}, beside the capped pairs {beside:.0?}");
    for (t, h) in capped.iter().zip(&held) {
        let what = format!("{} beside the uncapped pair, rounds {h:.0?}", t.client);
        within(median(h), t.cap, &format!("{what}: the median round"));
        let most = h.iter().copied().fold(0.0, f64::max);
        assert!(
            most <= 1.1 * t.cap,
            "{what}: {most:.0} is over its cap {:.0} by more than 10%",
            t.cap
        );
    }
    (alone, beside)
}

/// What the uncapped pair kept beside the capped ones: the better of best against best (what
/// the pair can do, other work on the shared cores stealing least of it) and median against
/// median (a lucky run alone, 25% above the others at times, does not decide it).
fn kept(alone: &[f64], beside: &[f64]) -> f64 {
    let best = |v: &[f64]| v.iter().copied().fold(0.0, f64::max);
    (best(beside) / best(alone)).max(median(beside) / median(alone))
}

/// The median of an odd number of rates.
fn median(v: &[f64]) -> f64 {
    let mut v = v.to_vec();
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// The vRNICs of [`beside_capped`] with caps `a` and `b` (`--max-bw` or `--max-rate`):
/// clients on `dc`, servers on `ds`.
fn tenants(ds: &Daemon, dc: &Daemon, limit: &str, a: &str, b: &str) {
    for s in ["srv", "srv_a", "srv_b"] {
        cli_ok(ds, &["create", s]);
    }
    cli_ok(dc, &["create", "free"]);
    cli_ok(dc, &["create", "cap_a", limit, a]);
    cli_ok(dc, &["create", "cap_b", limit, b]);
}

const BW_CAPS: [Capped; 2] = [
    Capped {
        client: "cap_a",
        server: "srv_a",
        cap: 1e9,
    },
    Capped {
        client: "cap_b",
        server: "srv_b",
        cap: 1e8,
    },
];

#[test]
fn an_uncapped_vrnic_beside_capped_ones_keeps_its_bandwidth() {
    require("ib_write_bw");
    require("chrt");
    let d = Daemon::start();
    tenants(&d, &d, "--max-bw", "1G", "100M");
    let (alone, beside) = beside_capped(&d, &d, "127.0.0.1", "65536", &BW_CAPS);
    let kept = kept(&alone, &beside);
    assert!(
        kept >= 0.9,
        "the uncapped vRNIC kept {:.1}% of its rate beside the capped ones (alone {alone:.0?}, \
         beside {beside:.0?} bytes/s)",
        kept * 100.0
    );
    assert_eq!(qos_waits(&d, "free"), 0, "the uncapped vRNIC never waited");
}

#[test]
fn an_uncapped_vrnic_beside_rate_capped_ones_keeps_its_message_rate() {
    require("ib_write_bw");
    require("chrt");
    let d = Daemon::start();
    // What the capped pairs may send is work the one engine thread does for them: 110K work
    // requests/s is 4-10% of what it does for the uncapped pair alone on 2 cores (1.1 to 2.6
    // Mpps), so the uncapped pair's 90% measures the limiter, not the capped tenants' due.
    // (The 200K cap's accuracy is `capped_vrnics_send_at_their_caps_...`'s.)
    tenants(&d, &d, "--max-rate", "100K", "10K");
    let caps = [
        Capped {
            cap: 1e5,
            ..BW_CAPS[0]
        },
        Capped {
            cap: 1e4,
            ..BW_CAPS[1]
        },
    ];
    let (alone, beside) = beside_capped(&d, &d, "127.0.0.1", "2", &caps);
    let kept = kept(&alone, &beside);
    assert!(
        kept >= 0.9,
        "the uncapped vRNIC kept {:.1}% of its message rate beside the capped ones (alone \
         {alone:.0?}, beside {beside:.0?} work requests/s)",
        kept * 100.0
    );
}

#[test]
fn across_hosts_an_uncapped_vrnic_beside_capped_ones_keeps_its_bandwidth() {
    require("ib_write_bw");
    require("chrt");
    let hosts = Hosts::new(2);
    let ds = hosts.daemons(Duration::from_secs(20));
    // The peer link carries 0.5 to 1.3 GB/s on 2 cores, shared by every pair across it: the
    // capped pairs' 30 MB/s is 2-4% of it (100M and 10M took 11-22%, past the 10% margin
    // the test allows for the limiter). Not below 10M: 2M is 30 messages/s of 64 KiB, which
    // perftest measures coarsely (1.75 to 2.19 MiB/s from round to round).
    tenants(&ds[0], &ds[1], "--max-bw", "20M", "10M");
    let caps = [
        Capped {
            cap: 2e7,
            ..BW_CAPS[0]
        },
        Capped {
            cap: 1e7,
            ..BW_CAPS[1]
        },
    ];
    let (alone, beside) = beside_capped(&ds[0], &ds[1], &hosts.addr(0), "65536", &caps);
    let kept = kept(&alone, &beside);
    assert!(
        kept >= 0.9,
        "across hosts the uncapped vRNIC kept {:.1}% of its rate beside the capped ones (alone \
         {alone:.0?}, beside {beside:.0?} bytes/s)",
        kept * 100.0
    );
}
