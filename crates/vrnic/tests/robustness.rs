//! An app killed with SIGKILL mid-stream: the daemon lives on, the survivor's QP errors out
//! (it does not hang), the dead app's vRNIC is reclaimed, and an unrelated pair keeps working.

mod common;

use std::time::Duration;

use common::{CLI, Daemon, Proc, kill_group, port, require, run_pair};

/// How long the survivor of a kill may take to notice and exit.
const SURVIVOR: Duration = Duration::from_secs(30);

/// Starts `ibv_rc_pingpong args... -p PORT` as a server on vRNIC `server_nic` and, once it
/// listens, its client on `client_nic` ([`common::start_pair`]); each `vrnic run` leads its
/// own process group.
fn start_pair(
    d: &Daemon,
    (server_nic, client_nic): (Option<&str>, Option<&str>),
    args: &[&str],
) -> (Proc, Proc) {
    let p = port();
    let ps = p.to_string();
    let mut args = args.to_vec();
    args.insert(0, "ibv_rc_pingpong");
    let (server, client) = common::pingpong_sides(&args, &ps, "localhost");
    common::start_pair(
        d.run_on(server_nic, &server),
        d.run_on(client_nic, &client),
        p,
        Duration::from_secs(10),
        "pingpong",
    )
}

#[test]
fn killing_an_app_mid_stream_harms_only_its_own_connection() {
    require("ibv_rc_pingpong");
    let mut d = Daemon::start();
    // Pair A: a long stream of 64 KiB messages (far longer than the test).
    let (server, mut client) = start_pair(
        &d,
        (Some("victim-srv"), Some("victim-cli")),
        &["-s", "65536", "-n", "10000000"],
    );
    // Let traffic flow for about a second, then kill the client's whole group without warning.
    std::thread::sleep(Duration::from_secs(1));
    assert!(
        !client.exited(),
        "client A ended before the kill (did it connect?)"
    );
    let ls = d.ls();
    assert!(ls.contains("victim-cli"), "client's vRNIC missing:\n{ls}");
    kill_group(client.pid(), libc::SIGKILL);
    let killed = client.wait(CLI);
    assert!(!killed.ok(), "client A survived SIGKILL\n{}", killed.text());
    // The survivor sees its QP fail instead of hanging (non-zero exit is what pingpong does).
    let survivor = server.wait_bounded(SURVIVOR);
    assert!(
        !survivor.timed_out,
        "server A hung after its peer was killed (killed after {SURVIVOR:?})\n{}",
        survivor.text()
    );
    assert!(
        !survivor.ok(),
        "server A should report the failed connection\n{}",
        survivor.text()
    );
    // The daemon lives, and the dead app's vRNIC is reclaimed (the survivor's too: it exited).
    assert!(d.alive(), "daemon died");
    d.wait_ls(
        Duration::from_secs(5),
        "vRNICs of dead apps reclaimed",
        |ls| !ls.contains("victim"),
    );
    // An unrelated pair started after the kill works.
    let p2 = port().to_string();
    let pair = run_pair(
        &d,
        &["ibv_rc_pingpong", "-p", &p2, "-c"],
        &["ibv_rc_pingpong", "-p", &p2, "-c", "localhost"],
        Duration::from_secs(60),
    );
    pair.assert_ok();
    assert!(
        pair.client.stdout.contains("bytes in"),
        "{}",
        pair.client.stdout
    );
    assert!(d.alive(), "daemon died");
}

#[test]
fn an_unrelated_pair_keeps_working_while_another_app_is_killed() {
    require("ibv_rc_pingpong");
    let mut d = Daemon::start();
    // Pair B runs a long checked test while pair A's client is killed repeatedly.
    let (b_server, b_client) = start_pair(&d, (None, None), &["-c", "-n", "200000"]);
    for round in 0..3 {
        let (a_server, a_client) = start_pair(&d, (None, None), &["-n", "100000000"]);
        std::thread::sleep(Duration::from_millis(500));
        kill_group(a_client.pid(), libc::SIGKILL);
        let _ = a_client.wait_bounded(CLI);
        let survivor = a_server.wait_bounded(SURVIVOR);
        assert!(
            !survivor.timed_out,
            "round {round}: survivor of a kill hung\n{}",
            survivor.text()
        );
        assert!(d.alive(), "round {round}: daemon died");
    }
    let c = b_client.wait_bounded(Duration::from_secs(120));
    let s = b_server.wait_bounded(SURVIVOR);
    assert!(
        c.ok() && s.ok(),
        "pair B failed\n--- client ({:?}):\n{}\n--- server ({:?}):\n{}",
        c.status,
        c.text(),
        s.status,
        s.text()
    );
    assert!(d.alive(), "daemon died");
}
