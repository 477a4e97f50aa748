//! Persistent vRNICs: what `vrnic create` makes (name, group, virtual IP, QoS limits and their
//! live changes by `vrnic policy`) is recorded in the daemon's file beside its state dir
//! (`DIR.vnics.json`) and made again when the daemon starts, after SIGTERM and after `kill -9`;
//! unmodified `ibv_rc_pingpong` then runs across them. A `vrnic run` vRNIC is never recorded;
//! `vrnic rm` (and `rm --force`) forgets one. A corrupt file, or one others can write, stops
//! the daemon at start with one line naming it; a record that cannot be made again (its
//! address taken) is logged and kept. In cluster mode the recorded vRNICs register in etcd
//! again, after SIGTERM and after `kill -9` (whose lease holds their addresses a while).

mod common;

use std::os::unix::fs::PermissionsExt;
use std::time::{Duration, Instant};

use common::hosts::Hosts;
use common::{CLI, DAEMON_START, Daemon, Output, Proc, output, pair_on, port, require};

const PAIR: Duration = Duration::from_secs(60);
const LINKS_UP: Duration = Duration::from_secs(30);
/// The lease time to live of the cluster daemons.
const TTL_S: u64 = 3;

/// `vrnic args...` on `d`, which must succeed; its stdout.
fn cli_ok(d: &Daemon, args: &[&str]) -> String {
    let out = d.cli_output(args);
    assert!(out.ok(), "vrnic {}\n{}", args.join(" "), out.text());
    out.stdout
}

/// `vrnic ls`'s row of `name` as NAME, IP, GROUP, MAX_BW, MAX_RATE, PERSIST (columns 0, 6, 7,
/// 8, 9, 10), if listed.
fn row(ls: &str, name: &str) -> Option<Vec<String>> {
    let f: Vec<&str> = ls
        .lines()
        .skip(1)
        .find(|l| l.split_whitespace().next() == Some(name))?
        .split_whitespace()
        .collect();
    assert_eq!(f.len(), 11, "a row of vrnic ls: {f:?}\n{ls}");
    Some(
        [0, 6, 7, 8, 9, 10]
            .iter()
            .map(|&i| f[i].to_string())
            .collect(),
    )
}

/// The names `vrnic ls` lists.
fn names(ls: &str) -> Vec<String> {
    ls.lines()
        .skip(1)
        .filter_map(|l| l.split_whitespace().next().map(str::to_string))
        .collect()
}

/// The names the file of persistent vRNICs records.
fn recorded(d: &Daemon) -> Vec<String> {
    let text = std::fs::read_to_string(d.persist_file()).expect("the file of persistent vRNICs");
    let v: serde_json::Value = serde_json::from_str(&text).expect("JSON");
    v["vnics"]
        .as_array()
        .expect("a list of vRNICs")
        .iter()
        .map(|r| r["name"].as_str().expect("a name").to_string())
        .collect()
}

/// `ibv_rc_pingpong -c` with its server on vRNIC `s` of `ds` and its client on vRNIC `c` of
/// `dc`, reaching the server at `addr`; both must pass (`-c`: the first byte of every page
/// arrived, as `conformance.rs` says; not every byte).
fn pingpong((ds, s): (&Daemon, &str), (dc, c): (&Daemon, &str), addr: &str) {
    let p = port().to_string();
    let (server, client) =
        common::pingpong_sides(&["ibv_rc_pingpong", "-c", "-n", "100"], &p, addr);
    let pair = pair_on((ds, s), &server, (dc, c), &client, PAIR);
    pair.assert_ok();
    assert!(!pair.client.text().contains("invalid data"), "{pair}");
}

/// `vrnic serve` on `d`'s state dir (which must not run) with `args`: it must exit within
/// [`DAEMON_START`]; what it printed.
fn serve_exits(d: &Daemon, args: &[&str]) -> Output {
    let mut c = d.cli();
    c.arg("serve").args(args).env("RUST_LOG", "info");
    output(c, "vrnic serve", DAEMON_START)
}

#[test]
fn created_vrnics_come_back_with_group_ip_and_limits_after_sigterm_and_kill_9() {
    require("ibv_rc_pingpong");
    let mut d = Daemon::start();
    cli_ok(&d, &["create", "pa", "--group", "blue", "--max-bw", "1G"]);
    cli_ok(
        &d,
        &[
            "create",
            "pb",
            "--group",
            "blue",
            "--ip",
            "10.7.0.2",
            "--max-rate",
            "200K",
        ],
    );
    // Live changes are recorded too.
    cli_ok(&d, &["policy", "pa", "--max-rate", "500K"]);
    cli_ok(
        &d,
        &["policy", "pb", "--max-bw", "100M", "--max-rate", "none"],
    );
    // A `vrnic run` vRNIC, held while the daemon stops: never recorded.
    let mut c = d.cli();
    c.args([
        "run", "--vrnic", "eph", "--group", "blue", "--", "sleep", "60",
    ]);
    let eph = Proc::spawn(c, "vrnic run --vrnic eph");
    let ls = d.wait_ls(CLI, "eph held", |ls| row(ls, "eph").is_some());
    let want = |name: &str| row(&ls, name).unwrap_or_else(|| panic!("{name} in\n{ls}"));
    let (pa, pb) = (want("pa"), want("pb"));
    assert_eq!(pa[2..], ["blue", "1G", "500K", "yes"], "{ls}");
    assert_eq!(pb[1..], ["10.7.0.2", "blue", "100M", "-", "yes"], "{ls}");
    assert_eq!(want("eph")[5], "no", "{ls}");
    let file = d.persist_file();
    let mode = std::fs::metadata(&file)
        .expect("the file")
        .permissions()
        .mode();
    assert_eq!(mode & 0o777, 0o600, "{}", file.display());
    assert_eq!(recorded(&d), ["pa", "pb"]);

    for kill in [false, true] {
        let how = if kill { "kill -9" } else { "SIGTERM" };
        let log = if kill { d.kill() } else { d.stop() };
        if !kill {
            assert!(log.ok(), "the daemon's exit\n{}", log.text());
        }
        d.restart();
        let ls = d.ls();
        assert_eq!(row(&ls, "pa").as_ref(), Some(&pa), "after {how}\n{ls}");
        assert_eq!(row(&ls, "pb").as_ref(), Some(&pb), "after {how}\n{ls}");
        assert_eq!(
            names(&ls),
            ["pa", "pb"],
            "after {how}: eph not made again\n{ls}"
        );
        pingpong((&d, "pa"), (&d, "pb"), "localhost");
        assert_eq!(recorded(&d), ["pa", "pb"], "after {how}");
    }
    drop(eph);
    let log = d.stop().text();
    assert!(
        log.contains("persistent vRNICs made again") && log.contains("made=2 failed=0"),
        "{log}"
    );
}

#[test]
fn rm_forgets_a_persistent_vrnic_even_by_force() {
    let mut d = Daemon::start();
    for n in ["ra", "rb", "rc"] {
        d.create(n);
    }
    let mut c = d.cli();
    c.args(["run", "--vrnic", "rb", "--", "sleep", "60"]);
    let holder = Proc::spawn(c, "vrnic run --vrnic rb");
    d.wait_ls(CLI, "rb held", |ls| {
        ls.lines()
            .any(|l| l.starts_with("rb ") && l.split_whitespace().nth(4) == Some("1"))
    });
    cli_ok(&d, &["rm", "ra"]);
    assert!(!d.cli_output(&["rm", "rb"]).ok(), "rb is in use");
    cli_ok(&d, &["rm", "--force", "rb"]);
    assert_eq!(recorded(&d), ["rc"]);
    drop(holder);
    d.stop();
    d.restart();
    assert_eq!(names(&d.ls()), ["rc"]);
    cli_ok(&d, &["rm", "rc"]);
    assert!(recorded(&d).is_empty());
    d.stop();
    d.restart();
    assert!(names(&d.ls()).is_empty(), "{}", d.ls());
}

#[test]
fn a_corrupt_file_or_one_others_can_write_stops_the_daemon_with_one_line_naming_it() {
    let mut d = Daemon::start();
    d.create("ok1");
    d.stop();
    let file = d.persist_file();
    let shown = file.display().to_string();
    let good = std::fs::read_to_string(&file).expect("the file");

    std::fs::write(&file, r#"{"version":1,"vnics":[{"nmae":"x","group":"g"}]}"#).expect("write");
    let out = serve_exits(&d, &[]);
    let lines: Vec<&str> = out.stderr.lines().collect();
    assert!(!out.ok() && lines.len() == 1, "{}", out.text());
    assert!(
        lines[0].starts_with(&format!(
            "vrnic: the file of persistent vRNICs {shown} is invalid: unknown field `nmae`"
        )) && lines[0].contains("fix or remove it")
            && lines[0].contains("--no-persist"),
        "{}",
        out.text()
    );

    std::fs::write(&file, &good).expect("write");
    std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o666)).expect("chmod");
    let out = serve_exits(&d, &[]);
    let lines: Vec<&str> = out.stderr.lines().collect();
    assert!(!out.ok() && lines.len() == 1, "{}", out.text());
    assert!(
        lines[0].starts_with(&format!(
            "vrnic: the file of persistent vRNICs {shown} is owned by"
        )) && lines[0].contains("mode 666")
            && lines[0].contains("that group and others cannot write"),
        "{}",
        out.text()
    );

    // Fixed, it serves again with its vRNIC.
    std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o600)).expect("chmod");
    d.restart();
    assert_eq!(names(&d.ls()), ["ok1"]);
}

#[test]
fn a_record_that_cannot_be_made_again_is_logged_and_kept_and_no_persist_records_nothing() {
    let mut d = Daemon::start();
    d.stop();
    // Written by hand: two vRNICs with one address in one group.
    let text = r#"{"version": 1, "vnics": [
        {"name": "first", "group": "red", "ip": "10.8.0.1", "max_bw": 1000000},
        {"name": "second", "group": "red", "ip": "10.8.0.1"},
        {"name": "third", "group": "red"}
    ]}"#;
    std::fs::write(d.persist_file(), text).expect("write");
    std::fs::set_permissions(d.persist_file(), std::fs::Permissions::from_mode(0o600))
        .expect("chmod");
    d.restart();
    let ls = d.ls();
    assert_eq!(names(&ls), ["first", "third"], "{ls}");
    assert_eq!(
        row(&ls, "first").expect("first")[1..],
        ["10.8.0.1", "red", "1M", "-", "yes"],
        "{ls}"
    );
    // A change rewrites the file: `second` stays, `third` now with the address it was given.
    d.create("fourth");
    assert_eq!(recorded(&d), ["first", "second", "third", "fourth"]);
    let third_ip = row(&ls, "third").expect("third")[1].clone();
    let text = std::fs::read_to_string(d.persist_file()).expect("the file");
    assert!(text.contains(&format!("\"{third_ip}\"")), "{text}");
    // `vrnic rm` forgets it.
    cli_ok(&d, &["rm", "second"]);
    assert_eq!(recorded(&d), ["first", "third", "fourth"]);
    let log = d.stop().text();
    assert!(
        log.lines()
            .any(|l| l.contains("a persistent vRNIC could not be made again")
                && l.contains("second")
                && l.contains("10.8.0.1 is already used in group red")
                && l.contains("it stays recorded")),
        "{log}"
    );
    assert!(log.contains("made=2 failed=1"), "{log}");

    // --no-persist: nothing read, nothing written.
    let np = Daemon::start_with(&["--no-persist"]);
    np.create("np");
    assert_eq!(row(&np.ls(), "np").expect("np")[5], "no");
    assert!(!np.persist_file().exists());
}

/// The directory's rows of `name` on `d` (`vrnic ls --all`): its LIDs.
fn directory_lids(d: &Daemon, name: &str) -> Vec<String> {
    let out = d.cli_output(&["ls", "--all"]);
    assert!(out.ok(), "vrnic ls --all\n{}", out.text());
    out.stdout
        .lines()
        .skip(1)
        .filter_map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            (f.get(1) == Some(&name)).then(|| f[2].to_string())
        })
        .collect()
}

#[test]
fn in_cluster_mode_recorded_vrnics_register_again_after_sigterm_and_kill_9() {
    require("ibv_rc_pingpong");
    let hosts = Hosts::new(2);
    let etcd = hosts.etcd();
    let mut ds: Vec<Daemon> = (0..2)
        .map(|i| hosts.cluster_daemon(i, &etcd, TTL_S))
        .collect();
    for d in &ds {
        d.wait_links(1, LINKS_UP);
    }
    cli_ok(
        &ds[0],
        &[
            "create", "ca", "--group", "red", "--ip", "10.9.0.1", "--max-bw", "1G",
        ],
    );
    cli_ok(
        &ds[1],
        &["create", "cb", "--group", "red", "--ip", "10.9.0.2"],
    );
    let addr = hosts.addr(0);
    for kill in [false, true] {
        let how = if kill { "kill -9" } else { "SIGTERM" };
        let _ = if kill { ds[0].kill() } else { ds[0].stop() };
        let down = Instant::now();
        ds[0].restart();
        // After kill -9 the dead daemon's lease holds 10.9.0.1 until it expires: then tried
        // again.
        let limit = Duration::from_secs(2 * TTL_S + 10);
        let ls = ds[0].wait_ls(limit, &format!("ca made again after {how}"), |ls| {
            row(ls, "ca").is_some()
        });
        assert_eq!(
            row(&ls, "ca").expect("ca")[1..],
            ["10.9.0.1", "red", "1G", "-", "yes"],
            "{ls}"
        );
        let lid = ls
            .lines()
            .find(|l| l.starts_with("ca "))
            .and_then(|l| l.split_whitespace().nth(1))
            .expect("ca's LID")
            .to_string();
        let start = Instant::now();
        while directory_lids(&ds[1], "ca") != [lid.clone()] {
            assert!(
                start.elapsed() < limit,
                "host 1 does not list ca (LID {lid}) alone after {how}: {:?}",
                directory_lids(&ds[1], "ca")
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        println!("ca registered again {:?} after {how}", down.elapsed());
        for d in &ds {
            d.wait_links(1, LINKS_UP);
        }
        pingpong((&ds[0], "ca"), (&ds[1], "cb"), &addr);
    }
    let log = ds[0].stop().text();
    assert!(log.contains("persistent vRNIC made again"), "{log}");
}
