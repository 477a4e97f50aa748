//! Authenticated peer links, attacked: daemons in network namespaces (`common/hosts.rs`), each
//! with its own key and the others' public keys, and an attacker in a third namespace on the
//! same bridge that knows every public key but no private one. It floods the daemons' peer
//! ports with plain hellos naming a configured host, Noise handshakes made with a key of its
//! own (claiming a configured host's index), garbage, half-open connections and handshakes
//! left half done, while a pair runs across the two daemons: the pair passes, the link is
//! never replaced (its drop counter stays), the daemons' memory stays bounded, and the
//! refusals are logged. Also: a daemon with the wrong key never links, either way round;
//! encrypted links carry pairs with every byte checked; `vrnic serve` refuses a listen
//! address other than loopback without keys.

mod common;

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::os::fd::AsRawFd;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use common::hosts::{Hosts, PEER_PORT, keygen};
use common::{CLI, Daemon, Proc, c_program, port, require, run_pair_on, vrnic_bin};
use vrnic_wire::frame::{
    ControlKind, HandshakeRepr, HelloRepr, LINK_HEADER_LEN, NOISE_PARAMS, peek_len,
};

const LINKS_UP: Duration = Duration::from_secs(20);
const PAIR: Duration = Duration::from_secs(120);
/// How long the attack lasts.
const ATTACK: Duration = Duration::from_secs(12);
/// The most a daemon's resident memory may grow under the attack.
const RSS_GROWTH_MAX: u64 = 64 << 20;
/// The prologue the daemons bind into their handshakes.
const PROLOGUE: &[u8] = b"vrnic peer link 4";

/// A control frame of `kind` with `body`.
fn control(kind: ControlKind, body: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    vrnic_wire::frame::emit_control(&mut out, kind, body);
    out
}

/// A handshake frame of `step` carrying `message`.
fn handshake(step: u8, message: &[u8]) -> Vec<u8> {
    let h = HandshakeRepr { step, message };
    let mut body = vec![0u8; h.buffer_len()];
    h.emit(&mut body);
    control(ControlKind::Handshake, &body)
}

/// Runs `f` on a thread of its own inside network namespace `netns` (a thread's sockets are
/// made in its namespace; the test's other threads stay where they are).
fn in_netns<T: Send + 'static>(
    netns: &str,
    f: impl FnOnce() -> T + Send + 'static,
) -> std::thread::JoinHandle<T> {
    let path = format!("/run/netns/{netns}");
    std::thread::spawn(move || {
        let ns = std::fs::File::open(&path).expect("the namespace's file");
        // SAFETY: setns with an open namespace fd and its type; it changes only this thread's
        // network namespace.
        let r = unsafe { libc::setns(ns.as_raw_fd(), libc::CLONE_NEWNET) };
        assert_eq!(r, 0, "setns {path}: {}", std::io::Error::last_os_error());
        f()
    })
}

/// The daemon's resident memory, in bytes.
fn rss(pid: i32) -> u64 {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("the daemon's status");
    let kb: u64 = s
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .expect("VmRSS");
    kb << 10
}

/// Reads one whole frame from `s` (at most 2 s).
fn read_frame(s: &mut TcpStream) -> Option<Vec<u8>> {
    s.set_read_timeout(Some(Duration::from_secs(2))).ok()?;
    let mut buf = Vec::new();
    let mut chunk = [0u8; 512];
    loop {
        if let Ok(Some(len)) = peek_len(&buf)
            && buf.len() >= len
        {
            buf.truncate(len);
            return Some(buf);
        }
        match s.read(&mut chunk) {
            Ok(0) | Err(_) => return None,
            Ok(n) => buf.extend_from_slice(&chunk[..n]),
        }
    }
}

/// What one attacker connection did.
#[derive(Default)]
struct Tally {
    hellos: AtomicU64,
    handshakes: AtomicU64,
    /// Handshakes the daemon answered (step 2) before refusing step 3.
    answered: AtomicU64,
    garbage: AtomicU64,
    half_open: AtomicU64,
}

/// One attacker connection of `kind` (0 hello, 1 handshake, 2 garbage, 3 half open) to
/// `target`, claiming host `index` of `hosts`.
fn attack_once(target: SocketAddr, index: u16, hosts: u16, kind: u8, round: u64, t: &Tally) {
    let Ok(mut s) = TcpStream::connect_timeout(&target, Duration::from_secs(1)) else {
        return;
    };
    let _ = s.set_write_timeout(Some(Duration::from_millis(500)));
    let hello = HelloRepr {
        index,
        hosts,
        encrypt: false,
    };
    match kind {
        0 => {
            // A plain hello naming a configured host.
            let _ = s.write_all(&control(ControlKind::Hello, &hello.emit()));
            t.hellos.fetch_add(1, Ordering::Relaxed);
        }
        1 => {
            // A whole handshake with a key of the attacker's own.
            let params = NOISE_PARAMS.parse().expect("Noise parameters");
            let b = snow::Builder::new(params);
            let kp = b.generate_keypair().expect("a key pair");
            let mut hs = snow::Builder::new(NOISE_PARAMS.parse().expect("Noise parameters"))
                .local_private_key(&kp.private)
                .and_then(|b| b.prologue(PROLOGUE))
                .and_then(|b| b.build_initiator())
                .expect("a handshake");
            let mut msg = [0u8; 256];
            let n = hs.write_message(&[], &mut msg).expect("step 1");
            if s.write_all(&handshake(1, &msg[..n])).is_err() {
                return;
            }
            t.handshakes.fetch_add(1, Ordering::Relaxed);
            let Some(f) = read_frame(&mut s) else { return };
            let Ok(h) = HandshakeRepr::parse(&f[LINK_HEADER_LEN..]) else {
                return;
            };
            let mut payload = [0u8; 64];
            if hs.read_message(h.message, &mut payload).is_err() {
                return;
            }
            t.answered.fetch_add(1, Ordering::Relaxed);
            let n = hs.write_message(&hello.emit(), &mut msg).expect("step 3");
            let _ = s.write_all(&handshake(3, &msg[..n]));
            // The daemon closes it: read until then.
            let mut sink = [0u8; 256];
            while matches!(s.read(&mut sink), Ok(n) if n > 0) {}
        }
        2 => {
            // Garbage, then a frame header announcing far more than a handshake.
            let mut g: Vec<u8> = (0..64u64)
                .map(|i| (round.wrapping_mul(31).wrapping_add(i * 7)) as u8)
                .collect();
            if round.is_multiple_of(2) {
                g = b"vR\x02\x06\x00\x00\xff\xff".to_vec();
            }
            let _ = s.write_all(&g);
            t.garbage.fetch_add(1, Ordering::Relaxed);
        }
        _ => {
            // Half open: step 1, then nothing, held a while (another half: nothing at all).
            if round.is_multiple_of(2) {
                let params = NOISE_PARAMS.parse().expect("Noise parameters");
                let mut hs = snow::Builder::new(params)
                    .local_private_key(&[7u8; 32])
                    .and_then(|b| b.prologue(PROLOGUE))
                    .and_then(|b| b.build_initiator())
                    .expect("a handshake");
                let mut msg = [0u8; 64];
                let n = hs.write_message(&[], &mut msg).expect("step 1");
                let _ = s.write_all(&handshake(1, &msg[..n]));
            }
            t.half_open.fetch_add(1, Ordering::Relaxed);
            std::thread::sleep(Duration::from_millis(300));
        }
    }
}

/// Attacks `targets` from namespace `netns` until `stop`: two threads of hellos, two of
/// handshakes, one of garbage, one of half-open connections, one holding 100 connections open.
fn attack(
    netns: &str,
    targets: Vec<(SocketAddr, u16)>,
    hosts: u16,
    stop: Arc<AtomicBool>,
    tally: Arc<Tally>,
) -> Vec<std::thread::JoinHandle<()>> {
    [0u8, 0, 1, 1, 2, 3, 4]
        .into_iter()
        .map(|kind| {
            let (stop, tally, targets) = (stop.clone(), tally.clone(), targets.clone());
            in_netns(netns, move || {
                let mut round = 0u64;
                // Half-open connections held open at the same time, past the pending bound.
                let mut held = Vec::new();
                while !stop.load(Ordering::Relaxed) {
                    let (target, index) = targets[round as usize % targets.len()];
                    if kind == 4 {
                        if let Ok(s) = TcpStream::connect_timeout(&target, Duration::from_secs(1)) {
                            held.push(s);
                            tally.half_open.fetch_add(1, Ordering::Relaxed);
                        }
                        if held.len() > 100 {
                            held.remove(0);
                        }
                        std::thread::sleep(Duration::from_millis(5));
                    } else {
                        attack_once(target, index, hosts, kind, round, &tally);
                        std::thread::sleep(Duration::from_millis(1));
                    }
                    round += 1;
                }
            })
        })
        .collect()
}

/// `DROPS` of `d`'s first link (to host 1 on host 0, to host 0 on host 1: the live one; the
/// link to host 2, whose daemon does not run, drops at every dial).
fn drops(d: &Daemon) -> u64 {
    d.peer_column("DROPS")[0]
}

/// A pair across hosts 0 and 1 keeps passing, and their link is never replaced, while an
/// attacker on host 2 (a configured host whose daemon is not running: the attacker has its
/// address but not its key) floods both daemons' peer ports with plain hellos naming hosts 0
/// and 2, handshakes made with its own key claiming those hosts, garbage, and connections that
/// never finish (more at once than the daemons keep pending). Each daemon's RSS grows by less
/// than 64 MiB, both log the refusals, and at least some handshakes were answered and then
/// refused (the rate limit lets some through).
#[test]
fn a_live_link_survives_floods_of_hellos_and_failed_handshakes() {
    require("ibv_rc_pingpong");
    let hosts = Hosts::new(3);
    let mut ds: Vec<Daemon> = (0..2).map(|i| hosts.daemon(i)).collect();
    wait_host_up(&ds[0], &hosts.addr(1), LINKS_UP);
    wait_host_up(&ds[1], &hosts.addr(0), LINKS_UP);
    let before: Vec<u64> = ds.iter().map(drops).collect();
    let rss0: Vec<u64> = ds.iter().map(|d| rss(d.pid())).collect();
    let stop = Arc::new(AtomicBool::new(false));
    let tally = Arc::new(Tally::default());
    let target = |i: usize| -> SocketAddr {
        format!("{}:{PEER_PORT}", hosts.addr(i))
            .parse()
            .expect("an address")
    };
    // Host 1 takes links from host 0 only; host 0 from nobody (it dials). Claim both.
    let targets = vec![
        (target(1), 0),
        (target(0), 0),
        (target(1), 2),
        (target(0), 2),
    ];
    let threads = attack(hosts.netns(2), targets, 3, stop.clone(), tally.clone());
    let start = Instant::now();
    let mut pairs = 0;
    let mut peak = rss0.clone();
    while start.elapsed() < ATTACK {
        let p = port().to_string();
        let server = [
            "ibv_rc_pingpong",
            "-p",
            &p,
            "-c",
            "-n",
            "2000",
            "-s",
            "4096",
        ];
        let mut client = server.to_vec();
        let a0 = hosts.addr(0);
        client.push(&a0);
        run_pair_on(&ds[0], &ds[1], &server, &client, PAIR).assert_ok();
        pairs += 1;
        for (i, d) in ds.iter().enumerate() {
            peak[i] = peak[i].max(rss(d.pid()));
        }
    }
    stop.store(true, Ordering::Relaxed);
    for t in threads {
        t.join().expect("an attacker thread");
    }
    let t = &*tally;
    let (hellos, handshakes, answered, garbage, half_open) = (
        t.hellos.load(Ordering::Relaxed),
        t.handshakes.load(Ordering::Relaxed),
        t.answered.load(Ordering::Relaxed),
        t.garbage.load(Ordering::Relaxed),
        t.half_open.load(Ordering::Relaxed),
    );
    println!(
        "{pairs} pairs passed under {hellos} hellos, {handshakes} handshakes ({answered} \
         answered), {garbage} garbage, {half_open} half-open connections"
    );
    assert!(pairs >= 2 && hellos > 100 && handshakes > 100 && garbage > 100 && half_open > 100);
    assert!(
        answered > 0,
        "no handshake was ever answered: the attack was not tried"
    );
    for (i, d) in ds.iter().enumerate() {
        let growth = peak[i].saturating_sub(rss0[i]);
        println!("daemon {i}: RSS grew by {} KiB", growth >> 10);
        assert!(growth < RSS_GROWTH_MAX, "daemon {i} grew by {growth} bytes");
        assert_eq!(
            drops(d),
            before[i],
            "daemon {i}'s link was replaced or dropped"
        );
        assert!(d.cli_output(&["peers"]).stdout.contains("authenticated"));
    }
    for d in &mut ds {
        assert!(d.alive(), "a daemon died");
        let log = d.stop().text();
        assert!(
            log.contains("peer connections refused") && log.contains(&hosts.addr(2)),
            "no refusal logged\n{log}"
        );
        assert!(
            log.lines()
                .filter(|l| l.contains("peer connections refused"))
                .count()
                < 60,
            "refusals are logged at most once a second\n{log}"
        );
    }
}

/// Daemons on hosts 0 and 1 of `hosts` with `--insecure-links` (no keys), linked; and host 1's
/// peer-link address, which a hello from host 2's namespace can take over.
fn insecure_daemons(hosts: &Hosts) -> (Vec<Daemon>, SocketAddr) {
    let ds: Vec<Daemon> = (0..2)
        .map(|i| hosts.daemon_keyed(i, false, &["--insecure-links"]))
        .collect();
    wait_host_up(&ds[0], &hosts.addr(1), LINKS_UP);
    wait_host_up(&ds[1], &hosts.addr(0), LINKS_UP);
    let target = format!("{}:{PEER_PORT}", hosts.addr(1))
        .parse()
        .expect("an address");
    (ds, target)
}

/// A plain hello that says it is host 0 of 3.
fn forged_hello() -> Vec<u8> {
    let h = HelloRepr {
        index: 0,
        hosts: 3,
        encrypt: false,
    };
    control(ControlKind::Hello, &h.emit())
}

/// The control for the flood above: with `--insecure-links` (no keys), one plain hello from
/// host 2's namespace naming host 0 takes host 1's link to host 0 over (its drop counter moves,
/// and the forged connection is the link until it goes silent): what authentication stops.
#[test]
fn without_keys_one_forged_hello_takes_a_link_over() {
    let hosts = Hosts::new(3);
    let (ds, target) = insecure_daemons(&hosts);
    let before = drops(&ds[1]);
    let forged = in_netns(hosts.netns(2), move || {
        let mut s = TcpStream::connect_timeout(&target, Duration::from_secs(5)).expect("connect");
        s.write_all(&forged_hello()).expect("send the hello");
        // Host 1 answers with its own hello: it took the connection for host 0's link.
        read_frame(&mut s).is_some_and(|f| f[3] == ControlKind::Hello as u8)
    });
    assert!(forged.join().expect("the forger"), "no hello back");
    let start = Instant::now();
    while drops(&ds[1]) == before {
        assert!(
            start.elapsed() < Duration::from_secs(5),
            "the forged hello did not replace the link"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Waits until `d`'s link to the host at `addr` is up.
fn wait_host_up(d: &Daemon, addr: &str, limit: Duration) {
    let start = Instant::now();
    let want = format!("{addr}:{PEER_PORT}");
    loop {
        let out = d.cli_output(&["peers"]);
        if out
            .stdout
            .lines()
            .any(|l| l.starts_with(&want) && l.contains(" up "))
        {
            return;
        }
        assert!(
            start.elapsed() < limit,
            "the link to {addr} is not up\n{}",
            out.text()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Whether `d`'s link to the host at `addr` is up now.
fn host_up(d: &Daemon, addr: &str) -> bool {
    let want = format!("{addr}:{PEER_PORT}");
    d.cli_output(&["peers"])
        .stdout
        .lines()
        .any(|l| l.starts_with(&want) && l.contains(" up "))
}

/// A daemon whose key is not the one its peers were given never links, whichever end of the
/// link it is: host 1 with a stranger's key is refused by host 0 (which dials it and checks
/// the listener's key), and host 0 with a stranger's key is refused by host 1 (which checks
/// the dialer's key after its last step). Each refusal is logged; with the right keys the same
/// hosts link.
#[test]
fn a_daemon_with_the_wrong_key_never_links() {
    let hosts = Hosts::new(2);
    let dir = std::env::temp_dir().join(format!("vrnic-wrong-key-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("a directory");
    let stranger = dir.join("stranger.key");
    keygen(&stranger);
    let stranger = stranger.display().to_string();
    for wrong in [1usize, 0] {
        let right = 1 - wrong;
        let mut good = hosts.daemon(right);
        let mut extra = vec!["--key".to_string(), stranger.clone()];
        extra.extend(hosts.peer_key_args(wrong));
        let extra: Vec<&str> = extra.iter().map(String::as_str).collect();
        let mut bad = hosts.daemon_keyed(wrong, false, &extra);
        let start = Instant::now();
        while start.elapsed() < Duration::from_secs(5) {
            assert!(
                !host_up(&good, &hosts.addr(wrong)) && !host_up(&bad, &hosts.addr(right)),
                "a daemon with the wrong key linked"
            );
            std::thread::sleep(Duration::from_millis(100));
        }
        let (good_log, bad_log) = (good.stop().text(), bad.stop().text());
        // The end that checks the stranger's key: the dialer (host 0) checks the listener's,
        // the listener (host 1) the dialer's.
        let why = if wrong == 1 {
            "is not the one configured for it"
        } else {
            "is not the one of host 0"
        };
        assert!(
            good_log.contains(why),
            "host {right} did not log why it refused host {wrong}\n{good_log}\n--- \
             host {wrong}:\n{bad_log}"
        );
    }
    let ds = hosts.daemons(LINKS_UP);
    assert!(
        ds[0]
            .cli_output(&["peers"])
            .stdout
            .contains("authenticated")
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// Links are encrypted when either end asks (`--encrypt-links` on host 1 only): `vrnic peers`
/// says so on both ends, nothing is read into place (payloads come through records), bulk
/// WRITEs and READs across the hosts arrive with every byte checked (`tests/c/stream_check.c`),
/// and an `ibv_rc_pingpong -c` passes.
#[test]
fn encrypted_links_carry_bulk_transfers_with_every_byte_checked() {
    require("ibv_rc_pingpong");
    let bin = c_program("stream_check", &["-libverbs"]);
    let bin = bin.to_str().expect("utf-8 path");
    let hosts = Hosts::new(2);
    let ds = vec![hosts.daemon(0), hosts.daemon_with(1, &["--encrypt-links"])];
    for d in &ds {
        d.wait_peers_up(LINKS_UP);
        let out = d.cli_output(&["peers"]).stdout;
        assert!(out.contains("encrypted"), "{out}");
    }
    let p = port().to_string();
    let addr = hosts.addr(0);
    run_pair_on(
        &ds[0],
        &ds[1],
        &[bin, "server", &p],
        &[bin, "client", &addr, &p],
        PAIR,
    )
    .assert_ok();
    let p = port().to_string();
    let server = [
        "ibv_rc_pingpong",
        "-p",
        &p,
        "-c",
        "-n",
        "200",
        "-s",
        "65536",
    ];
    let mut client = server.to_vec();
    client.push(&addr);
    run_pair_on(&ds[0], &ds[1], &server, &client, PAIR).assert_ok();
    for d in &ds {
        assert_eq!(
            d.peer_column("PLACED_IN"),
            vec![0],
            "nothing read into place"
        );
        assert!(d.peer_column("BYTES_IN")[0] > 32 << 20, "the bulk crossed");
    }
}

/// `vrnic serve` with a `--listen` address other than loopback and no key stops at start with
/// an error that says how to make keys; with `--insecure-links` it runs and warns loudly; on a
/// loopback address it runs without keys.
#[test]
fn serve_refuses_unauthenticated_links_off_loopback() {
    let hosts = Hosts::new(2);
    let dir = std::env::temp_dir().join(format!("vrnic-nokey-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("a state dir");
    let listen = format!("{}:{PEER_PORT}", hosts.addr(0));
    let peer = format!("{}:{PEER_PORT}", hosts.addr(1));
    let mut c = std::process::Command::new("nsenter");
    c.arg(format!("--net=/run/netns/{}", hosts.netns(0)))
        .arg(vrnic_bin())
        .arg("serve")
        .arg("--state-dir")
        .arg(&dir)
        .args(["--listen", &listen, "--peer", &peer]);
    let out = Proc::spawn(c, "vrnic serve").wait_bounded(CLI);
    assert!(!out.timed_out && !out.ok(), "it ran\n{}", out.text());
    assert!(
        out.stderr.contains("vrnic keygen") && out.stderr.contains("--insecure-links"),
        "{}",
        out.text()
    );
    let mut d = hosts.daemon_keyed(0, false, &["--insecure-links"]);
    assert!(d.alive());
    let log = d.stop().text();
    assert!(log.contains("PEER LINKS ARE NOT AUTHENTICATED"), "{log}");
    let a = format!("127.0.0.2:{}", port());
    let b = format!("127.0.0.3:{}", port());
    let mut d = Daemon::start_with(&["--listen", &a, "--peer", &b]);
    assert!(d.alive(), "a loopback daemon without keys runs");
    let _ = d.stop();
    let _ = std::fs::remove_dir_all(&dir);
}

/// Issue 29 item 2's other half: a link replaced mid-transfer (here by a forged hello every
/// 20 ms on `--insecure-links`, a stand-in for a link that keeps dropping) resumes every
/// message where it stood, and a QP whose peer's announcement was lost with a link finds its
/// route when the next link announces it (it used to wait out its retry budget and fail with
/// `RETRY_EXC_ERR`). RC pingpongs of 256 KiB messages (four segments each, so most drops fall
/// inside a message) run back to back until host 1's link to host 0 has dropped 100 times (each
/// forged hello takes the link, then closes it): every run passes (no receive overrun,
/// `LOC_LEN_ERR`; no QP failed; the data checks of `-c`), and most drops fell inside a run.
#[test]
fn a_link_replaced_again_and_again_mid_message_resumes_every_message() {
    const REPLACEMENTS: u64 = 100;
    // The real peer dials again 100 ms after its link is taken: a hello every GAP leaves the
    // link up most of the time, well within the pingpong's retry budget (8 x 67 ms).
    const GAP: Duration = Duration::from_millis(250);
    let hosts = Hosts::new(3);
    let (ds, target) = insecure_daemons(&hosts);
    let stop = Arc::new(AtomicBool::new(false));
    let st = stop.clone();
    let forger = in_netns(hosts.netns(2), move || {
        let mut n = 0u64;
        while !st.load(Ordering::Relaxed) {
            if let Ok(mut s) = TcpStream::connect_timeout(&target, Duration::from_secs(5))
                && s.write_all(&forged_hello()).is_ok()
            {
                n += 1;
            }
            std::thread::sleep(GAP);
        }
        n
    });
    let before = drops(&ds[1]);
    let addr = hosts.addr(0);
    let (mut runs, mut during) = (0u64, 0u64);
    let start = Instant::now();
    while drops(&ds[1]) < before + REPLACEMENTS && start.elapsed() < Duration::from_secs(150) {
        let p = port().to_string();
        let server = [
            "ibv_rc_pingpong",
            "-c",
            "-s",
            "262144",
            "-n",
            "2000",
            "-p",
            &p,
        ];
        let mut client = server.to_vec();
        client.push(&addr);
        let at = drops(&ds[1]);
        let pair = run_pair_on(&ds[0], &ds[1], &server, &client, PAIR);
        during += drops(&ds[1]) - at;
        runs += 1;
        if !pair.server.ok() || !pair.client.ok() {
            stop.store(true, Ordering::Relaxed);
            let hellos = forger.join().expect("the forger");
            panic!(
                "run {runs} failed after {during} replacements inside runs ({hellos} hellos)\n\
                 server:\n{}\nclient:\n{}\nhost 0's peers:\n{}\nhost 1's peers:\n{}",
                pair.server.text(),
                pair.client.text(),
                ds[0].cli_output(&["peers"]).text(),
                ds[1].cli_output(&["peers"]).text()
            );
        }
    }
    stop.store(true, Ordering::Relaxed);
    let hellos = forger.join().expect("the forger");
    let replaced = drops(&ds[1]) - before;
    eprintln!("{replaced} replacements ({during} inside runs) in {runs} runs, {hellos} hellos");
    assert!(
        replaced >= REPLACEMENTS,
        "only {replaced} replacements in {runs} runs ({hellos} hellos)"
    );
    assert!(
        during * 2 >= replaced,
        "only {during} of {replaced} replacements fell inside the {runs} runs: make them longer"
    );
}
