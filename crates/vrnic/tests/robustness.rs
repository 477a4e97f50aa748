//! An app killed with SIGKILL mid-stream: the daemon lives on, the survivor's QP errors out
//! (it does not hang), the dead app's vRNIC is reclaimed, and an unrelated pair keeps working.

mod common;

use std::time::{Duration, Instant};

use common::{Daemon, Proc, kill_group, port, require, run_pair};

#[test]
fn killing_an_app_mid_stream_harms_only_its_own_connection() {
    require("ibv_rc_pingpong");
    let mut d = Daemon::start();
    let p = port().to_string();
    // Pair A: a long stream of 64 KiB messages.
    let args = [
        "ibv_rc_pingpong",
        "-p",
        &p,
        "-s",
        "65536",
        "-n",
        "100000000",
    ];
    let server = Proc::spawn(d.run(Some("victim-srv"), &args), "server A");
    let mut client_args = args.to_vec();
    client_args.push("localhost");
    let start = Instant::now();
    let client = loop {
        let c = Proc::spawn(d.run(Some("victim-cli"), &client_args), "client A");
        std::thread::sleep(Duration::from_millis(300));
        let mut c = c;
        match c.child.try_wait() {
            Ok(None) => break c,
            _ => assert!(
                start.elapsed() < Duration::from_secs(10),
                "client A could not connect"
            ),
        }
    };
    // Let traffic flow, then kill the client without warning.
    std::thread::sleep(Duration::from_secs(1));
    assert!(
        d.ls().contains("victim-cli"),
        "client's vRNIC missing:\n{}",
        d.ls()
    );
    kill_group(client.pid(), libc::SIGKILL);
    let killed = client.wait(Duration::from_secs(10));
    assert!(!killed.ok());
    // The survivor sees its QP fail instead of hanging.
    let survivor = server.wait(Duration::from_secs(30));
    assert!(
        !survivor.ok(),
        "server A should report the failed connection"
    );
    assert!(
        survivor.stderr.contains("Failed status") || survivor.stderr.contains("Failed to"),
        "server A stderr: {}",
        survivor.stderr
    );
    // The daemon lives, and the dead app's vRNIC is reclaimed.
    assert!(d.alive(), "daemon died");
    let start = Instant::now();
    while d.ls().contains("victim") {
        assert!(
            start.elapsed() < Duration::from_secs(5),
            "vRNICs of dead apps not reclaimed:\n{}",
            d.ls()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    // An unrelated pair works afterwards.
    let p2 = port().to_string();
    let pair = run_pair(
        &d,
        &["ibv_rc_pingpong", "-p", &p2, "-c"],
        &["ibv_rc_pingpong", "-p", &p2, "-c", "localhost"],
        Duration::from_secs(60),
    );
    pair.assert_ok();
}

#[test]
fn an_unrelated_pair_keeps_working_while_another_app_is_killed() {
    require("ibv_rc_pingpong");
    let mut d = Daemon::start();
    // Pair B runs a long test while pair A's client is killed repeatedly.
    let pb = port().to_string();
    let b_server = Proc::spawn(
        d.run(None, &["ibv_rc_pingpong", "-p", &pb, "-c", "-n", "200000"]),
        "server B",
    );
    std::thread::sleep(Duration::from_millis(300));
    let b_client = Proc::spawn(
        d.run(
            None,
            &[
                "ibv_rc_pingpong",
                "-p",
                &pb,
                "-c",
                "-n",
                "200000",
                "localhost",
            ],
        ),
        "client B",
    );
    for _ in 0..3 {
        let pa = port().to_string();
        let a_server = Proc::spawn(
            d.run(None, &["ibv_rc_pingpong", "-p", &pa, "-n", "100000000"]),
            "server A",
        );
        std::thread::sleep(Duration::from_millis(300));
        let a_client = Proc::spawn(
            d.run(
                None,
                &["ibv_rc_pingpong", "-p", &pa, "-n", "100000000", "localhost"],
            ),
            "client A",
        );
        std::thread::sleep(Duration::from_millis(500));
        kill_group(a_client.pid(), libc::SIGKILL);
        let _ = a_client.wait_timeout(Duration::from_secs(10));
        assert!(
            a_server.wait_timeout(Duration::from_secs(30)).is_some(),
            "survivor of a kill hung"
        );
    }
    let c = b_client.wait(Duration::from_secs(120));
    let s = b_server.wait(Duration::from_secs(30));
    assert!(
        c.ok() && s.ok(),
        "pair B failed:\n{}\n{}\n{}\n{}",
        c.stdout,
        c.stderr,
        s.stdout,
        s.stderr
    );
    assert!(d.alive());
}
