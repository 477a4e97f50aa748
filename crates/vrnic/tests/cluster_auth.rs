//! etcd as a trust boundary (`vrnic serve --etcd ... --etcd-user NAME --etcd-password-file
//! PATH`): the test's etcd (`common/hosts.rs`) runs with v3 authentication on, a root user
//! and a `vrnic` user whose role grants readwrite on `/vrnic/`, and the daemons log in as
//! `vrnic` (host 0's daemon reads etcd's URL from its config file, host 1's from `--etcd`).
//!
//! - a write without credentials (a put, a delete) is refused by etcd, and no daemon's
//!   directory changes;
//! - a write with the daemons' own credentials (stolen) that rewrites a blue vRNIC's record to
//!   group red, and a red vRNIC's to blue, is undone by each owning daemon within a bounded
//!   time (measured), as is a delete; the owner logs the key; a red tenant then cannot reach
//!   the blue vRNIC (unmodified `ibv_rc_pingpong` fails as across groups), while a blue pair
//!   across the hosts passes;
//! - a daemon with a wrong password, without credentials, or with a password file others can
//!   read stops at start with a one-line error naming etcd and the user.

mod common;

use std::path::PathBuf;
use std::process::Command;
use std::time::{Duration, Instant};

use common::hosts::{Etcd, Hosts, PEER_PORT};
use common::{
    Daemon, Proc, create_in as create, pair_on as pair, port, remove_state_dir, require, vrnic_bin,
};

const LINKS_UP: Duration = Duration::from_secs(30);
const PAIR: Duration = Duration::from_secs(60);
/// How long a pair whose peer is in another group gets before it is reported as stuck.
const CROSS: Duration = Duration::from_secs(10);
const TTL_S: u64 = 3;
const ROOT_PASSWORD: &str = "root-pw-of-the-operator";
const USER: &str = "vrnic";
const PASSWORD: &str = "pw-of-the-daemons";
/// The bound on the owner putting back a record another writer changed.
const RESTORE: Duration = Duration::from_secs(1);

/// A password file of mode `mode` holding `password`, unique to this test.
fn password_file(tag: &str, password: &str, mode: u32) -> PathBuf {
    use std::os::unix::fs::PermissionsExt;
    let f = std::env::temp_dir().join(format!("vrnic-etcd-{}-{tag}", std::process::id()));
    std::fs::write(&f, format!("{password}\n")).expect("write the password file");
    std::fs::set_permissions(&f, std::fs::Permissions::from_mode(mode)).expect("chmod");
    f
}

/// Two hosts, an etcd with authentication, and a daemon on each logged in as `vrnic`.
fn auth_cluster(tag: &str) -> (Hosts, Etcd, Vec<Daemon>, PathBuf) {
    let hosts = Hosts::new(2);
    let etcd = hosts.etcd();
    etcd.enable_auth(ROOT_PASSWORD, USER, PASSWORD);
    let pw = password_file(tag, PASSWORD, 0o600);
    let file = pw.display().to_string();
    let creds = ["--etcd-user", USER, "--etcd-password-file", &file];
    let ds: Vec<Daemon> = (0..2)
        .map(|i| hosts.cluster_daemon_with(i, &etcd, TTL_S, &creds))
        .collect();
    for d in &ds {
        d.wait_links(1, LINKS_UP);
    }
    (hosts, etcd, ds, pw)
}

/// `vrnic ls --all` rows of `d` as (name, lid, ip, group).
fn directory(d: &Daemon) -> Vec<(String, String, String, String)> {
    let out = d.cli_output(&["ls", "--all"]);
    assert!(out.ok(), "vrnic ls --all\n{}", out.text());
    out.stdout
        .lines()
        .skip(1)
        .map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            assert!(f.len() >= 7, "a row of vrnic ls --all: {l:?}");
            (f[1].into(), f[2].into(), f[4].into(), f[5].into())
        })
        .collect()
}

/// Waits until `d` lists vRNIC `name` in `group`; returns its LID.
fn wait_listed(d: &Daemon, name: &str, group: &str) -> String {
    let start = Instant::now();
    loop {
        let rows = directory(d);
        if let Some(r) = rows.iter().find(|r| r.0 == name && r.3 == group) {
            return r.1.clone();
        }
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "{name} in group {group} not listed\n{rows:#?}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Polls `key` (as `token`'s user) until it holds `value` bound to a lease; returns how long
/// that took.
fn wait_restored(etcd: &Etcd, token: &str, key: &str, value: &[u8]) -> Duration {
    let start = Instant::now();
    loop {
        let now = etcd.get_as(Some(token), key);
        if now
            .as_ref()
            .is_some_and(|(v, lease)| v == value && *lease != 0)
        {
            return start.elapsed();
        }
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "{key} not put back as written\nnow: {:?}\nwritten: {}",
            now.map(|(v, l)| (String::from_utf8_lossy(&v).into_owned(), l)),
            String::from_utf8_lossy(value)
        );
        std::thread::sleep(Duration::from_millis(2));
    }
}

/// With authentication on, a put and a delete without credentials are refused by etcd
/// (`user name is empty`), the record stays as its owner wrote it, and the other host's
/// directory still lists the vRNIC in its own group, with no forged vRNIC.
#[test]
fn a_write_without_credentials_is_refused() {
    let (_hosts, etcd, ds, pw) = auth_cluster("anon");
    create(&ds[0], "b1", "blue", "10.9.0.1");
    let lid = wait_listed(&ds[1], "b1", "blue");
    let token = etcd.token(USER, PASSWORD);
    let key = format!("/vrnic/v1/vnics/{lid}");
    let (written, _) = etcd.get_as(Some(&token), &key).expect("b1's record");
    let forged = String::from_utf8(written.clone())
        .expect("JSON")
        .replace("\"group\":\"blue\"", "\"group\":\"red\"");
    let (ok, text) = etcd.put_as(None, &key, forged.as_bytes());
    assert!(!ok && text.contains("user name is empty"), "{text}");
    let (ok, text) = etcd.delete_as(None, &key);
    assert!(!ok && text.contains("user name is empty"), "{text}");
    let fake = forged.replace(&format!("\"lid\":{lid}"), "\"lid\":4242");
    let (ok, text) = etcd.put_as(None, "/vrnic/v1/vnics/4242", fake.as_bytes());
    assert!(!ok, "{text}");
    println!("etcd refused writes without credentials: {}", text.trim());
    std::thread::sleep(Duration::from_millis(500));
    let (now, lease) = etcd.get_as(Some(&token), &key).expect("b1's record");
    assert_eq!(now, written);
    assert_ne!(lease, 0);
    let rows = directory(&ds[1]);
    assert!(
        rows.iter().any(|r| r.0 == "b1" && r.3 == "blue") && !rows.iter().any(|r| r.1 == "4242"),
        "{rows:#?}"
    );
    let _ = std::fs::remove_file(pw);
}

/// The daemons' own credentials, stolen: a blue vRNIC's record (host 0's) rewritten to group
/// red and a red vRNIC's (host 1's) to blue, which together would let each side's daemon take
/// the other as of its own group. Each owner puts its record back within [`RESTORE`]
/// (measured), and again after a delete; the other host lists both in their own groups; the
/// owner's log names the key. Then a red tenant's `ibv_rc_pingpong` to the blue vRNIC fails
/// as across groups, and a blue pair across the hosts passes.
#[test]
fn a_write_with_stolen_credentials_is_undone_by_the_owner() {
    require("ibv_rc_pingpong");
    let (hosts, etcd, mut ds, pw) = auth_cluster("stolen");
    create(&ds[0], "b1", "blue", "10.9.0.1");
    create(&ds[1], "r2", "red", "10.9.0.2");
    create(&ds[1], "b2", "blue", "10.9.0.2");
    let b1 = wait_listed(&ds[1], "b1", "blue");
    let r2 = wait_listed(&ds[0], "r2", "red");
    let token = etcd.token(USER, PASSWORD);
    let mut restored = Vec::new();
    for (lid, from, to) in [(&b1, "blue", "red"), (&r2, "red", "blue")] {
        let key = format!("/vrnic/v1/vnics/{lid}");
        let (written, _) = etcd.get_as(Some(&token), &key).expect("the record");
        let forged = String::from_utf8(written.clone()).expect("JSON").replace(
            &format!("\"group\":\"{from}\""),
            &format!("\"group\":\"{to}\""),
        );
        assert_ne!(forged.as_bytes(), written.as_slice());
        let (ok, text) = etcd.put_as(Some(&token), &key, forged.as_bytes());
        assert!(ok, "a put with the daemons' credentials\n{text}");
        let took = wait_restored(&etcd, &token, &key, &written);
        println!("{key} rewritten to group {to}: put back by its owner after {took:?}");
        assert!(took < RESTORE, "{key} put back only after {took:?}");
        let (ok, text) = etcd.delete_as(Some(&token), &key);
        assert!(ok, "a delete with the daemons' credentials\n{text}");
        let took = wait_restored(&etcd, &token, &key, &written);
        println!("{key} deleted: put back by its owner after {took:?}");
        assert!(took < RESTORE, "{key} put back only after {took:?}");
        restored.push(key);
    }
    assert_eq!(wait_listed(&ds[1], "b1", "blue"), b1);
    assert_eq!(wait_listed(&ds[0], "r2", "red"), r2);
    std::thread::sleep(Duration::from_millis(200));
    for (d, name, group) in [(&ds[1], "b1", "blue"), (&ds[0], "r2", "red")] {
        let rows = directory(d);
        assert!(
            rows.iter().any(|r| r.0 == name && r.3 == group)
                && !rows.iter().any(|r| r.0 == name && r.3 != group),
            "{rows:#?}"
        );
    }

    // Red cannot reach blue; blue reaches blue.
    let addr = hosts.addr(0);
    let p = port().to_string();
    let s = ["ibv_rc_pingpong", "-p", &p, "-n", "5"];
    let c = ["ibv_rc_pingpong", "-p", &p, "-n", "5", &addr];
    let cross = pair((&ds[0], "b1"), &s, (&ds[1], "r2"), &c, CROSS);
    assert!(
        !cross.client.ok()
            && cross
                .client
                .text()
                .contains("transport retry counter exceeded"),
        "red reached blue\n{cross}"
    );
    let p = port().to_string();
    let s = ["ibv_rc_pingpong", "-p", &p, "-c", "-n", "50"];
    let c = ["ibv_rc_pingpong", "-p", &p, "-c", "-n", "50", &addr];
    let within = pair((&ds[0], "b1"), &s, (&ds[1], "b2"), &c, PAIR);
    within.assert_ok();

    for (d, key) in ds.iter_mut().zip(&restored) {
        let log = d.stop().text();
        for line in [
            "another writer changed this daemon's record in etcd: putting it back as written",
            "another writer deleted this daemon's record in etcd: putting it back as written",
        ] {
            assert!(
                log.lines()
                    .any(|l| l.contains(line) && l.contains(key.as_str())),
                "the owner's log lacks {line:?} for {key}\n{log}"
            );
        }
    }
    let _ = std::fs::remove_file(pw);
}

/// `vrnic serve` on host 0 of `hosts` with `args` after the cluster options; waits for it to
/// exit (it must) and returns its exit status and stderr.
fn serve_fails(hosts: &Hosts, etcd: &Etcd, args: &[&str]) -> (bool, String) {
    let dir = std::env::temp_dir().join(format!("vrnic-etcd-fail-{}", std::process::id()));
    remove_state_dir(&dir);
    std::fs::create_dir_all(&dir).expect("a state dir");
    let listen = format!("{}:{PEER_PORT}", hosts.addr(0));
    let mut c = Command::new("nsenter");
    c.arg(format!("--net=/run/netns/{}", hosts.netns(0)))
        .arg(vrnic_bin())
        .arg("serve")
        .arg("--state-dir")
        .arg(&dir)
        .args(["--listen", &listen, "--etcd", &etcd.url])
        .args(["--key", &hosts.key_file(0)])
        .args(args)
        .env("RUST_LOG", "info");
    let out = Proc::spawn(c, "vrnic serve").wait_bounded(Duration::from_secs(20));
    remove_state_dir(&dir);
    assert!(!out.timed_out, "the daemon kept running\n{}", out.text());
    (out.ok(), out.stderr)
}

/// A daemon with a wrong password, one without credentials, and one whose password file its
/// group can read each stop at start (exit status 1) with one line naming etcd and the user.
#[test]
fn a_daemon_with_a_wrong_password_fails_to_start_with_a_clear_error() {
    let hosts = Hosts::new(1);
    let etcd = hosts.etcd();
    etcd.enable_auth(ROOT_PASSWORD, USER, PASSWORD);
    let wrong = password_file("wrong", "not-the-password", 0o600);
    let readable = password_file("readable", PASSWORD, 0o640);
    let w = wrong.display().to_string();
    let r = readable.display().to_string();
    let cases: [(&[&str], String); 3] = [
        (
            &["--etcd-user", USER, "--etcd-password-file", &w],
            format!(
                "vrnic: etcd at {} refused user \"{USER}\": wrong user name or password",
                etcd.url
            ),
        ),
        (
            &[],
            format!(
                "vrnic: etcd at {} requires authentication: give --etcd-user and \
                 --etcd-password-file",
                etcd.url
            ),
        ),
        (
            &["--etcd-user", USER, "--etcd-password-file", &r],
            format!(
                "vrnic: etcd password file {r} has mode 640: it must not be readable or \
                 writable by group or others (chmod 600 {r})"
            ),
        ),
    ];
    for (args, line) in cases {
        let (ok, stderr) = serve_fails(&hosts, &etcd, args);
        assert!(!ok, "the daemon succeeded with {args:?}\n{stderr}");
        let last = stderr.lines().last().unwrap_or_default();
        assert_eq!(last, line, "with {args:?}\n{stderr}");
        println!("{args:?}: {last}");
    }
    let _ = std::fs::remove_file(wrong);
    let _ = std::fs::remove_file(readable);
}
