//! Apps killed with SIGKILL at random points, round after round: during start-up and memory
//! registration, while a connection is being set up (verbs over TCP exchange, or rdma_cm), and
//! mid-transfer. The survivor of each pair exits on its own (never a hang or a crash;
//! `ibv_rc_pingpong` with an error; a server whose client died before connecting is the one
//! ended here), and after
//! 100 rounds the daemon holds nothing of them: no vRNIC, no state-dir entry, no extra open
//! file or thread; an unrelated pair then passes `ibv_rc_pingpong -c`.

mod common;

use std::time::{Duration, Instant};

use common::{Daemon, Proc, port, require, run_pair};

/// splitmix64, for reproducible kill times.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
}

fn count(dir: &str) -> usize {
    std::fs::read_dir(dir).map(|d| d.count()).unwrap_or(0)
}

/// The vRNIC `vrnic run` gave process `pid` (it execs the app with `VRNIC_DEVICE` set to the
/// vRNIC's directory, named after it).
fn vrnic_of(pid: i32) -> Option<String> {
    let env = std::fs::read(format!("/proc/{pid}/environ")).ok()?;
    env.split(|&b| b == 0).find_map(|kv| {
        let dir = kv.strip_prefix(b"VRNIC_DEVICE=")?;
        let dir = std::path::Path::new(std::str::from_utf8(dir).ok()?);
        Some(dir.file_name()?.to_str()?.to_string())
    })
}

#[test]
fn a_hundred_apps_killed_at_random_points_leave_nothing_behind() {
    require("ibv_rc_pingpong");
    require("rping");
    let mut d = Daemon::start();
    let pid = d.pid();
    let (fds, tasks) = (format!("/proc/{pid}/fd"), format!("/proc/{pid}/task"));
    // Warm up once so lazily opened files (logs, the admin socket's peers) are counted.
    let p = port().to_string();
    run_pair(
        &d,
        &["ibv_rc_pingpong", "-p", &p],
        &["ibv_rc_pingpong", "-p", &p, "localhost"],
        Duration::from_secs(30),
    )
    .assert_ok();
    d.wait_ls(Duration::from_secs(10), "no vRNIC left", |ls| {
        ls.lines().count() <= 1
    });
    let (fds0, tasks0, dir0) = (count(&fds), count(&tasks), count(d.dir.to_str().unwrap()));

    let mut r = Rng(0xc0ffee);
    for round in 0..100 {
        let p = port().to_string();
        let (server, client): (Vec<&str>, Vec<&str>) = if round % 2 == 0 {
            (
                vec!["ibv_rc_pingpong", "-p", &p, "-n", "1000000", "-s", "65536"],
                vec![
                    "ibv_rc_pingpong",
                    "-p",
                    &p,
                    "-n",
                    "1000000",
                    "-s",
                    "65536",
                    "localhost",
                ],
            )
        } else {
            (
                vec!["rping", "-s", "-a", "127.0.0.1", "-p", &p, "-C", "1000000"],
                vec!["rping", "-c", "-a", "127.0.0.1", "-p", &p, "-C", "1000000"],
            )
        };
        let mut s = Proc::spawn(d.run(&server), "server");
        std::thread::sleep(Duration::from_millis(r.next() % 30));
        let mut c = Proc::spawn(d.run(&client), "client");
        std::thread::sleep(Duration::from_millis(r.next() % 80));
        // Kill the client, the server, or both.
        let victim = r.next() % 3;
        if victim != 1 {
            c.signal(libc::SIGKILL);
        }
        if victim != 0 {
            s.signal(libc::SIGKILL);
        }
        // The survivor must end by itself once it was connected: its peer's death fails its QP
        // or connection. A server whose client died before connecting just keeps waiting for
        // one, as it would on any device: that is told apart (still listening, or no QP on its
        // vRNIC) and ended here.
        let rc = round % 2 == 0;
        let deadline = Instant::now() + Duration::from_secs(20);
        let mut waited = Duration::ZERO;
        let server_vrnic = vrnic_of(s.pid());
        let mut ended_here = false;
        while !s.exited() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(20));
            waited += Duration::from_millis(20);
            if waited >= Duration::from_millis(1500) && victim == 0 && !c.exited() {
                continue;
            }
            if waited >= Duration::from_millis(1500) && victim == 0 {
                // rping's server has no QP before a client connects: its own vRNIC (not
                // any vRNIC) shows none.
                let never_connected = if rc {
                    common::listening(p.parse().unwrap())
                } else {
                    let name = server_vrnic.as_deref().unwrap_or("\0");
                    d.ls().lines().skip(1).any(|l| {
                        let f: Vec<&str> = l.split_whitespace().collect();
                        f.first() == Some(&name) && f.get(3) == Some(&"0")
                    })
                };
                if never_connected && !s.exited() {
                    s.signal(libc::SIGKILL);
                    ended_here = true;
                }
            }
        }
        for (name, proc, victim) in [("server", s, victim != 0), ("client", c, victim != 1)] {
            use std::os::unix::process::ExitStatusExt;
            let out = proc.wait_bounded(Duration::from_secs(20));
            assert!(
                !out.timed_out,
                "round {round}: the {name} hung after its peer was killed\n{}",
                out.text()
            );
            let sig = out.status.signal();
            if victim || (name == "server" && ended_here) {
                // Killed by us (or gone on its own before the kill): never another signal.
                assert!(
                    sig.is_none_or(|s| s == libc::SIGKILL),
                    "round {round}: the {name} died of signal {sig:?}\n{}",
                    out.text()
                );
            } else {
                // The survivor ends by itself: never a crash; and ibv_rc_pingpong with an
                // error (rping exits 0 whenever it ends disconnected, as when its peer died).
                assert!(
                    sig.is_none() && (!rc || out.status.code() != Some(0)),
                    "round {round}: the surviving {name} ended with {:?}\n{}",
                    out.status,
                    out.text()
                );
            }
        }
        assert!(d.alive(), "round {round}: the daemon died");
    }

    // Everything of the dead is reclaimed: vRNICs, their files, the daemon's fds and threads.
    d.wait_ls(Duration::from_secs(20), "every vRNIC reclaimed", |ls| {
        ls.lines().count() <= 1
    });
    let deadline = Instant::now() + Duration::from_secs(10);
    while count(&fds) > fds0 && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(50));
    }
    assert_eq!(
        count(&fds),
        fds0,
        "the daemon keeps open files of dead apps"
    );
    assert_eq!(count(&tasks), tasks0, "the daemon grew threads");
    assert_eq!(
        count(d.dir.to_str().unwrap()),
        dir0,
        "state-dir entries left behind"
    );
    let p = port().to_string();
    run_pair(
        &d,
        &["ibv_rc_pingpong", "-p", &p, "-c"],
        &["ibv_rc_pingpong", "-p", &p, "-c", "localhost"],
        Duration::from_secs(60),
    )
    .assert_ok();
}
