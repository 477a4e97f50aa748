//! Engine threads (`vrnic serve --engine-threads N`): vRNICs shared out among shards, each served
//! by a thread of its own; a work request for another shard's vRNIC executed by the thread that
//! took it, inside that shard's engine. Each pair below runs
//! with its two vRNICs on different engine threads (a new vRNIC goes to the shard serving the
//! fewest when none is busy, and the daemon's log names it), and asserts real outcomes: exact bytes (our checks,
//! `ibv_rc_pingpong -c`), protection errors, completion events, unmodified perftest.

mod common;

use std::path::PathBuf;
use std::sync::OnceLock;
use std::time::Duration;

use common::hosts::Hosts;
use common::{Daemon, Pair, Proc, kill_group, port, run_pair, run_pair_on};

fn verbs_check() -> &'static PathBuf {
    static BIN: OnceLock<PathBuf> = OnceLock::new();
    BIN.get_or_init(|| common::c_program("verbs_check", &["-libverbs"]))
}

/// A daemon with `n` engine threads.
fn daemon(n: usize) -> Daemon {
    Daemon::start_with(&["--engine-threads", &n.to_string()])
}

/// Stops `d` and returns the engine thread each vRNIC was given, in order of creation.
fn engines_used(mut d: Daemon) -> Vec<u32> {
    let out = d.stop();
    let log = out.text();
    assert!(
        log.contains("engine_threads"),
        "the daemon did not report its engine threads:\n{log}"
    );
    log.lines()
        .map(plain)
        .filter(|l| l.contains("vRNIC created"))
        .filter_map(|l| {
            let at = l.find("engine=")? + "engine=".len();
            let digits: String = l[at..].chars().take_while(char::is_ascii_digit).collect();
            digits.parse().ok()
        })
        .collect()
}

/// A log line without its terminal colour codes.
fn plain(line: &str) -> String {
    let mut out = String::new();
    let mut chars = line.chars();
    while let Some(c) = chars.next() {
        if c == '\u{1b}' {
            for c in chars.by_ref() {
                if c.is_ascii_alphabetic() {
                    break;
                }
            }
        } else {
            out.push(c);
        }
    }
    out
}

/// `verbs_check MODE` as a pair on `d`; both sides must pass.
fn check_pair(d: &Daemon, mode: &str) -> Pair {
    common::c_check_pair_on(d, verbs_check(), &[mode], Duration::from_secs(120))
}

/// Two sides on two engine threads: SEND and WRITE at every size and alignment land exactly,
/// and the sides' vRNICs were on different threads.
#[test]
fn a_pair_on_two_engine_threads_lands_exact_bytes() {
    let d = daemon(2);
    check_pair(&d, "data");
    let used = engines_used(d);
    assert_eq!(used.len(), 2, "two vRNICs expected: {used:?}");
    assert_ne!(
        used[0], used[1],
        "both sides on one engine thread: {used:?}"
    );
}

/// Protection is checked by the responder's thread: a wrong R_Key and a WRITE past an MR's
/// end are remote access errors and change nothing, across threads as within one.
#[test]
fn protection_errors_hold_across_engine_threads() {
    let d = daemon(2);
    check_pair(&d, "badrkey");
    check_pair(&d, "pastend");
}

/// Unmodified `ibv_rc_pingpong` (contents checked, `-c`), busy-polling and in event mode
/// (completion events handed from the engine thread to the loop), and unmodified perftest
/// READ and atomics, on a daemon with three engine threads and two pairs at once.
#[test]
fn unmodified_clients_run_between_engine_threads() {
    let d = daemon(3);
    let limit = Duration::from_secs(120);
    let p = port().to_string();
    let pair = run_pair(
        &d,
        &["ibv_rc_pingpong", "-c", "-n", "200", "-p", &p],
        &["ibv_rc_pingpong", "-c", "-n", "200", "-p", &p, "localhost"],
        limit,
    );
    pair.assert_ok();
    let p = port().to_string();
    let pair = run_pair(
        &d,
        &["ibv_rc_pingpong", "-e", "-c", "-n", "200", "-p", &p],
        &[
            "ibv_rc_pingpong",
            "-e",
            "-c",
            "-n",
            "200",
            "-p",
            &p,
            "localhost",
        ],
        limit,
    );
    pair.assert_ok();
    for prog in ["ib_read_bw", "ib_atomic_bw", "ib_write_bw"] {
        let p = port().to_string();
        let pair = run_pair(
            &d,
            &[prog, "-n", "500", "-p", &p],
            &[prog, "-n", "500", "-p", &p, "localhost"],
            limit,
        );
        pair.assert_ok();
        assert!(
            pair.client.stdout.contains("#bytes"),
            "{prog}: no results table:\n{}",
            pair.client.stdout
        );
    }
    let used = engines_used(d);
    for t in 0..3 {
        assert!(
            used.contains(&t),
            "engine thread {t} served no vRNIC: {used:?}"
        );
    }
}

/// Our two-process checks of the verbs a frame between shards must carry beyond plain RC, each
/// pair on a fresh daemon with two engine threads (so its two vRNICs on different ones): UD
/// without a GRH (`wc.slid` is the sender's LID, from the frame's address word), XRC (the XRCETH
/// names the SRQ; another domain's SRQ refused), memory windows with SEND with Invalidate (the
/// IETH closes the window) and the extended API's completions.
#[test]
fn ud_xrc_and_memory_windows_hold_across_engine_threads() {
    for (prog, mode, done) in [
        ("ex_check", "ud", "ud done"),
        ("ex_check", "rc", "rc done"),
        ("xrc_check", "xrc", "xrc done"),
        ("mw_check", "type2", "type2 done"),
        ("mw_check", "type1", "type1 done"),
    ] {
        let bin = common::c_program(prog, &["-libverbs"]);
        let d = daemon(2);
        let pair = common::c_check_pair_on(&d, &bin, &[mode], Duration::from_secs(120));
        for side in [&pair.server, &pair.client] {
            assert!(side.stdout.contains(done), "{prog} {mode}\n{pair}");
            assert!(!side.stdout.contains("FAIL"), "{prog} {mode}\n{pair}");
        }
        let used = engines_used(d);
        assert_eq!(
            used.len(),
            2,
            "{prog} {mode}: two vRNICs expected: {used:?}"
        );
        assert_ne!(
            used[0], used[1],
            "{prog} {mode}: one engine thread: {used:?}"
        );
    }
}

/// Two requesters, each a process on a vRNIC of its own, run 20,000 FETCH_AND_ADDs each (16 in
/// flight) on one word of a third (`tests/c/atomic_check.c`): the word counts every add and
/// the originals are 0..39,999 each once, on one engine thread and on three, where each
/// requester's thread executes its atomics inside the responder's engine at the same time as
/// the other's (atomic against every requester on the address, whichever thread).
fn two_requesters_hammer_one_word(threads: usize) {
    let bin = common::c_program("atomic_check", &["-libverbs"]);
    let bin = bin.to_str().expect("utf-8 path");
    let d = daemon(threads);
    let p = port().to_string();
    let n = "20000";
    let server = Proc::spawn(d.run(&[bin, "server", &p, "2", n]), "atomic_check server");
    let clients: Vec<Proc> = (0..2)
        .map(|i| {
            Proc::spawn(
                d.run(&[bin, "client", "localhost", &p, n]),
                &format!("atomic_check client {i}"),
            )
        })
        .collect();
    let limit = Duration::from_secs(120);
    for c in clients {
        let out = c.wait_bounded(limit);
        assert!(
            out.ok() && out.stdout.contains("OK CMP_AND_SWP with a stale compare"),
            "client\n{}",
            out.text()
        );
    }
    let out = server.wait_bounded(limit);
    assert!(
        out.ok()
            && out
                .stdout
                .contains("OK the word counts every FETCH_AND_ADD")
            && out
                .stdout
                .contains("OK every original distinct: 0..39999 each once"),
        "server\n{}",
        out.text()
    );
    if threads > 1 {
        let mut used = engines_used(d);
        used.sort_unstable();
        used.dedup();
        assert_eq!(
            used.len(),
            3,
            "the three vRNICs not on three threads: {used:?}"
        );
    }
}

#[test]
fn atomics_of_two_requesters_on_one_word_on_one_engine_thread() {
    two_requesters_hammer_one_word(1);
}

#[test]
fn atomics_of_two_requesters_on_one_word_across_three_engine_threads() {
    two_requesters_hammer_one_word(3);
}

/// An app killed mid-transfer fails its peer on another engine thread at once, as a peer on
/// its own thread fails: an `ib_send_bw` server, whose QP only waits for receives (no timer
/// runs), sees its QP fail and exits instead of waiting for ever.
#[test]
fn a_killed_app_fails_its_peer_on_another_engine_thread() {
    common::require("ib_send_bw");
    let d = daemon(2);
    let p = port();
    let ps = p.to_string();
    let (args, client_args) =
        common::pingpong_sides(&["ib_send_bw", "-n", "100000000"], &ps, "localhost");
    let (server, mut client) = common::start_pair(
        d.run(&args),
        d.run(&client_args),
        p,
        Duration::from_secs(30),
        "ib_send_bw",
    );
    std::thread::sleep(Duration::from_millis(1500));
    assert!(!client.exited(), "the client ended before the kill");
    kill_group(client.pid(), libc::SIGKILL);
    let _ = client.wait_bounded(Duration::from_secs(10));
    let survivor = server.wait_bounded(Duration::from_secs(20));
    assert!(
        !survivor.timed_out,
        "the server hung after its peer was killed\n{}",
        survivor.text()
    );
    assert!(
        !survivor.ok(),
        "the server did not report the failed QP\n{}",
        survivor.text()
    );
    let used = engines_used(d);
    assert!(
        used.len() >= 2 && used[0] != used[1],
        "the two sides on one engine thread: {used:?}"
    );
}

/// Placement by activity: on a daemon with two engine threads, each serving one vRNIC, while
/// the client's vRNIC floods its peer with WRITEs (its thread executes every one, to its end
/// in the other's engine), a new vRNIC goes to the thread that has room, not to the flooding
/// one, which the vRNIC counts and the turn order alone would pick (x on thread 1, y on 0, and
/// the third vRNIC's turn starts at thread 1).
#[test]
fn a_new_vrnic_goes_to_the_engine_thread_with_the_least_work() {
    common::require("ib_write_bw");
    let d = daemon(2);
    for name in ["x", "y"] {
        let out = d.cli_output(&["create", name]);
        assert!(out.ok(), "{}", out.text());
    }
    let p = port();
    let ps = p.to_string();
    let (server, client) = common::start_pair(
        d.run_on(
            Some("y"),
            &["ib_write_bw", "-s", "64", "-D", "4", "-p", &ps],
        ),
        d.run_on(
            Some("x"),
            &["ib_write_bw", "-s", "64", "-D", "4", "-p", &ps, "localhost"],
        ),
        p,
        Duration::from_secs(30),
        "ib_write_bw",
    );
    // The flood under way for a few of the daemon's 200 ms looks.
    std::thread::sleep(Duration::from_millis(2000));
    let out = d.cli_output(&["create", "z"]);
    assert!(out.ok(), "{}", out.text());
    common::finish_pair(server, client, Duration::from_secs(60)).assert_ok();
    let used = engines_used(d);
    assert!(
        used.len() == 3 && used[0] != used[1],
        "x and y on two threads: {used:?}"
    );
    assert_eq!(
        used[2], used[1],
        "the new vRNIC went to the flooding thread (x's), not y's: {used:?}"
    );
}

/// One process with many QPs (`ib_write_bw -q 8`, one vRNIC, so one engine thread) beside
/// a daemon's other engine threads.
#[test]
fn a_process_with_many_qps_runs_with_engine_threads() {
    let d = daemon(2);
    let p = port().to_string();
    let pair = run_pair(
        &d,
        &["ib_write_bw", "-q", "8", "-n", "500", "-p", &p],
        &["ib_write_bw", "-q", "8", "-n", "500", "-p", &p, "localhost"],
        Duration::from_secs(120),
    );
    pair.assert_ok();
}

/// A daemon with `n` engine threads and `--spread-qps`.
fn spread_daemon(n: usize) -> Daemon {
    Daemon::start_with(&["--engine-threads", &n.to_string(), "--spread-qps"])
}

/// Stops `d` and returns the vRNIC and the engine thread of each QP made (`--spread-qps`
/// logs them), in order.
fn qp_engines(mut d: Daemon) -> Vec<(u32, u32)> {
    let log = d.stop().text();
    let field = |l: &str, key: &str| -> Option<u32> {
        let at = l.find(key)? + key.len();
        let digits: String = l[at..].chars().take_while(char::is_ascii_digit).collect();
        digits.parse().ok()
    };
    log.lines()
        .map(plain)
        .filter(|l| l.contains("QP created"))
        .filter_map(|l| Some((field(&l, "vnic=")?, field(&l, "engine=")?)))
        .collect()
}

/// The QP numbers perftest printed for its own QPs (`local address: ... QPN 0x0011 ...`).
fn local_qpns(out: &str) -> Vec<u32> {
    out.lines()
        .filter(|l| l.contains("local address"))
        .filter_map(|l| {
            let at = l.find("QPN 0x")? + "QPN 0x".len();
            let hex: String = l[at..]
                .chars()
                .take_while(char::is_ascii_hexdigit)
                .collect();
            u32::from_str_radix(&hex, 16).ok()
        })
        .collect()
}

/// `--spread-qps`: one process's QPs over every engine thread. Unmodified `ib_write_bw -q 9`
/// and `ib_read_bw -q 6` complete, and each side's QPs are of every thread's class (a QP's
/// number names the thread serving it, and the log says the same); `ibv_rc_pingpong -c`
/// checks its bytes between two such vRNICs.
#[test]
fn one_process_s_qps_spread_over_every_engine_thread() {
    let d = spread_daemon(3);
    let limit = Duration::from_secs(120);
    for (prog, q) in [("ib_write_bw", "9"), ("ib_read_bw", "6")] {
        let p = port().to_string();
        let pair = run_pair(
            &d,
            &[prog, "-q", q, "-n", "500", "-p", &p],
            &[prog, "-q", q, "-n", "500", "-p", &p, "localhost"],
            limit,
        );
        pair.assert_ok();
        assert!(
            pair.client.stdout.contains("#bytes"),
            "{prog}: no results table:\n{}",
            pair.client.stdout
        );
        for (side, out) in [
            ("server", &pair.server.stdout),
            ("client", &pair.client.stdout),
        ] {
            let qpns = local_qpns(out);
            assert_eq!(
                qpns.len(),
                q.parse::<usize>().unwrap(),
                "{prog} {side}:\n{out}"
            );
            for class in 0..3 {
                assert!(
                    qpns.iter().any(|n| n % 3 == class),
                    "{prog} {side}: no QP on engine thread {class}: {qpns:x?}"
                );
            }
        }
    }
    let p = port().to_string();
    let pair = run_pair(
        &d,
        &["ibv_rc_pingpong", "-c", "-n", "200", "-p", &p],
        &["ibv_rc_pingpong", "-c", "-n", "200", "-p", &p, "localhost"],
        limit,
    );
    pair.assert_ok();
    let used = qp_engines(d);
    for t in 0..3 {
        assert!(
            used.iter().any(|&(_, e)| e == t),
            "no QP on engine thread {t}: {used:?}"
        );
    }
}

/// `--spread-qps`, every byte checked: one process with one CQ and two RC QPs (on two engine
/// threads) SENDs, WRITEs and READs 1 MiB with two peers at once, interleaved
/// (`tests/c/fanout_check.c`); and memory windows are offered (`ibv_devinfo -v`: max_mw 65536).
#[test]
fn one_process_s_qps_on_two_engine_threads_land_every_byte() {
    let d = spread_daemon(2);
    let local = (&d, "127.0.0.1");
    common::fanout_check(&d, local, local, Duration::from_secs(120));
    let info = Proc::spawn(d.run(&["ibv_devinfo", "-v"]), "ibv_devinfo")
        .wait_bounded(Duration::from_secs(30));
    assert!(info.ok(), "{}", info.text());
    let max_mw = info
        .stdout
        .lines()
        .find(|l| l.trim_start().starts_with("max_mw:"))
        .map(|l| l.split(':').nth(1).unwrap_or("").trim().to_string());
    assert_eq!(max_mw.as_deref(), Some("65536"), "{}", info.stdout);
    // The client's vRNIC has two QPs, one on each thread.
    let used = qp_engines(d);
    let client = used
        .iter()
        .map(|&(v, _)| v)
        .find(|v| used.iter().filter(|(w, _)| w == v).count() == 2);
    let threads: Vec<u32> = used
        .iter()
        .filter(|(v, _)| Some(*v) == client)
        .map(|&(_, e)| e)
        .collect();
    assert!(
        threads.len() == 2 && threads[0] != threads[1],
        "the client's QPs not on two engine threads: {used:?}"
    );
}

/// `--spread-qps`: memory windows (`tests/c/mw_check.c`, its three modes) where the server's QP
/// is in another slice than its vRNIC's home (a QP made first takes the home): the windows are
/// allocated and deallocated by the home, bound, invalidated and used in the other slice, and
/// the MR they pin is refused deregistration by the home; bytes and statuses as on one thread.
#[test]
fn memory_windows_hold_on_a_slice_other_than_the_home_with_spread_qps() {
    let bin = common::c_program("mw_check", &["-libverbs"]);
    for mode in ["far-type2", "far-type1", "far-rights"] {
        let d = spread_daemon(2);
        let pair = common::c_check_pair_on(&d, &bin, &[mode], Duration::from_secs(120));
        for side in [&pair.server, &pair.client] {
            assert!(side.stdout.contains(&format!(" {mode} done")), "{pair}");
            assert!(!side.stdout.contains("FAIL"), "{pair}");
        }
        // The server's vRNIC has two QPs, one on each thread; the client's one.
        let used = qp_engines(d);
        let server: Vec<u32> = used
            .iter()
            .filter(|(v, _)| used.iter().filter(|(w, _)| w == v).count() == 2)
            .map(|&(_, e)| e)
            .collect();
        assert!(
            server.len() == 2 && server[0] != server[1],
            "{mode}: the server's QPs not on two engine threads: {used:?}"
        );
    }
}

/// Daemons on two hosts, each with three engine threads: unmodified clients and our UD check
/// run between the hosts while the apps' vRNICs are on engine threads other than the first
/// (a vRNIC made beforehand takes a shard), so a frame from the other host reaches the shard
/// its destination QP number names and a frame for it leaves an engine thread for the link.
#[test]
fn engine_threads_serve_pairs_across_hosts() {
    common::require("ib_write_bw");
    let ex = common::c_program("ex_check", &["-libverbs"]);
    let ex = ex.to_str().expect("utf-8 path");
    let hosts = Hosts::new(2);
    let ds = hosts.daemons_with(Duration::from_secs(20), &["--engine-threads", "3"]);
    for d in &ds {
        d.create("pad");
    }
    let addr = hosts.addr(0);
    let runs: [(&[&str], &str); 5] = [
        (&["ibv_rc_pingpong", "-c", "-n", "500"], "iters in"),
        (&["ib_write_bw", "-q", "4", "-n", "500"], "#bytes"),
        (&["ib_read_bw", "-n", "500"], "#bytes"),
        (&["ibv_ud_pingpong", "-n", "200"], "iters in"),
        (&[ex, "ud"], "ud done"),
    ];
    for (args, done) in runs {
        let p = port().to_string();
        let (server, client): (Vec<&str>, Vec<&str>) = if args[0] == ex {
            (
                vec![ex, "server", &p, "ud"],
                vec![ex, "client", &addr, &p, "ud"],
            )
        } else {
            let mut s = args.to_vec();
            s.extend(["-p", &p]);
            let mut c = s.clone();
            c.push(&addr);
            (s, c)
        };
        let pair = run_pair_on(&ds[0], &ds[1], &server, &client, Duration::from_secs(120));
        pair.assert_ok();
        assert!(
            pair.client.stdout.contains(done) || pair.client.stderr.contains(done),
            "{args:?}: {done:?} missing\n{pair}"
        );
        assert!(!pair.client.stdout.contains("FAIL"), "{args:?}\n{pair}");
    }
    for d in ds {
        let used = engines_used(d);
        let apps = &used[1..];
        assert!(
            apps.iter().any(|&e| e != 0) && apps.iter().any(|&e| e != apps[0]),
            "the apps' vRNICs were not spread over engine threads: {used:?}"
        );
    }
}

/// `--engine-threads 0` is refused, with the reason.
#[test]
fn an_engine_thread_count_of_zero_is_refused() {
    let dir = std::env::temp_dir().join(format!("vrnic-engines-{}", std::process::id()));
    let mut c = std::process::Command::new(common::vrnic_bin());
    c.arg("--state-dir")
        .arg(&dir)
        .args(["serve", "--engine-threads", "0"]);
    let out = common::output(c, "vrnic serve", Duration::from_secs(20));
    assert!(
        !out.ok(),
        "--engine-threads 0 was accepted:\n{}",
        out.text()
    );
    assert!(
        out.text().contains("--engine-threads"),
        "--engine-threads 0: no reason given:\n{}",
        out.text()
    );
    common::remove_state_dir(&dir);
}

/// `vrnic stats NAME --json` of `d`: the vRNIC's object.
fn stats(d: &Daemon, name: &str) -> serde_json::Value {
    let out = d.cli_output(&["stats", name, "--json"]);
    assert!(out.ok(), "vrnic stats {name}\n{}", out.text());
    let v: serde_json::Value = serde_json::from_str(&out.stdout).expect("JSON");
    v.as_array()
        .and_then(|l| l.first())
        .cloned()
        .expect("one vRNIC")
}

/// Payload bytes a vRNIC's QPs moved as requesters (SEND, WRITE, READ).
fn sent_bytes(s: &serde_json::Value) -> u64 {
    ["send", "write", "read"]
        .iter()
        .map(|c| s["sent"][c]["bytes"].as_u64().expect("bytes"))
        .sum()
}

/// A pair whose vRNICs are on two engine threads moves each byte once: the thread that takes a
/// work request executes it straight into the other thread's vRNIC (no frame between the
/// threads, which would copy each byte into it and out again). Unmodified perftest WRITE, SEND
/// and READ bandwidth runs; the engine's copies (`vrnic stats`: `copied`, counted per copy on
/// the region written, or read into a frame) equal the bytes the requesters moved.
#[test]
fn a_pair_across_engine_threads_copies_each_byte_once() {
    for t in ["ib_write_bw", "ib_send_bw", "ib_read_bw"] {
        common::require(t);
    }
    let d = daemon(2);
    d.create("s0");
    d.create("c0");
    for tool in ["ib_write_bw", "ib_send_bw", "ib_read_bw"] {
        let p = port().to_string();
        let server = [tool, "-s", "65536", "-n", "300", "-p", &p];
        let mut client = server.to_vec();
        client.push("127.0.0.1");
        common::pair_on(
            (&d, "s0"),
            &server,
            (&d, "c0"),
            &client,
            Duration::from_secs(120),
        )
        .assert_ok();
    }
    let (s, c) = (stats(&d, "s0"), stats(&d, "c0"));
    let moved = sent_bytes(&s) + sent_bytes(&c);
    let copied = s["copied"].as_u64().expect("copied") + c["copied"].as_u64().expect("copied");
    assert!(
        moved >= 3 * 300 * 65536,
        "the runs moved too little: {moved}\n{s}\n{c}"
    );
    assert_eq!(
        copied, moved,
        "bytes copied by the engine against bytes moved (twice would be a frame between threads)"
    );
    let used = engines_used(d);
    assert_ne!(used[0], used[1], "s0 and c0 on one engine thread: {used:?}");
}

/// The CPU time (user and system, in clock ticks, every thread) process `pid` has used.
fn cpu_ticks(pid: i32) -> u64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).expect("the daemon's stat");
    // The fields after the command's closing parenthesis: state is the 3rd, utime the 14th.
    let rest = &stat[stat.rfind(')').expect("a stat line") + 2..];
    let fields: Vec<&str> = rest.split_whitespace().collect();
    fields[11].parse::<u64>().unwrap() + fields[12].parse::<u64>().unwrap()
}

/// Whoever drives the shards (the loop thread with one engine thread, engine threads with
/// two), a daemon whose traffic has stopped sleeps: over a quiet second it uses a small part
/// of one core (a thread that kept spinning would use most of one), and the next pair's first
/// doorbell still wakes it.
#[test]
fn an_idle_daemon_sleeps_whoever_drives_its_shards_and_wakes_for_the_next_pair() {
    let limit = Duration::from_secs(120);
    for n in [1, 2] {
        let d = daemon(n);
        let pingpong = |d: &Daemon| {
            let p = port().to_string();
            run_pair(
                d,
                &["ibv_rc_pingpong", "-c", "-n", "200", "-p", &p],
                &["ibv_rc_pingpong", "-c", "-n", "200", "-p", &p, "localhost"],
                limit,
            )
            .assert_ok();
        };
        pingpong(&d);
        // Quiet for far longer than a driver spins after its last work (2 ms).
        std::thread::sleep(Duration::from_millis(300));
        let ticks_per_s = 100; // USER_HZ on Linux
        let before = cpu_ticks(d.pid());
        std::thread::sleep(Duration::from_secs(1));
        let used = cpu_ticks(d.pid()) - before;
        assert!(
            used * 100 < 15 * ticks_per_s,
            "with {n} engine thread(s), an idle daemon used {used} ticks of CPU in one second"
        );
        pingpong(&d);
    }
}
