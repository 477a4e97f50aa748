//! The trust boundary, attacked as a hostile tenant or local user would (docs/security.md):
//! a squatted state dir, escapes from `vrnic run --container`, a tenant that shrinks or
//! overfills its own region, absurd registrations. Each attack must fail (or harm only the
//! attacker's own vRNIC), the daemon must live on, and an unrelated pair of unmodified
//! programs must still pass `ibv_rc_pingpong -c` afterwards.

mod common;

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use common::{CLI, Daemon, output, port, require, run_pair, unrelated_pair_passes, vrnic_bin};

const LIMIT: Duration = Duration::from_secs(60);
/// An unprivileged user for the local-user attacks (`nobody`).
const NOBODY: u32 = 65534;

/// A fresh directory under the system temp dir (removed on drop).
struct TempDir(PathBuf);

impl TempDir {
    fn new(tag: &str) -> TempDir {
        let p = std::env::temp_dir().join(format!("vrnic-trust-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&p);
        TempDir(p)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A copy of the `vrnic` binary that any user can run (the build tree may not be reachable
/// by `nobody`).
fn public_vrnic(dir: &Path) -> PathBuf {
    std::fs::create_dir_all(dir).unwrap();
    std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o755)).unwrap();
    let bin = dir.join("vrnic");
    std::fs::copy(vrnic_bin(), &bin).expect("copy the vrnic binary");
    std::fs::set_permissions(&bin, std::fs::Permissions::from_mode(0o755)).unwrap();
    bin
}

/// `cmd` as `nobody`, with no state-dir hints in its environment.
fn as_nobody(bin: &Path, args: &[&str]) -> Command {
    let mut c = Command::new(require("setpriv"));
    c.args([
        &format!("--reuid={NOBODY}"),
        &format!("--regid={NOBODY}"),
        "--clear-groups",
        "--",
    ])
    .arg(bin)
    .args(args)
    .env_remove("XDG_RUNTIME_DIR")
    .env_remove("VRNIC_STATE_DIR");
    c
}

// ---- a squatted state dir -------------------------------------------------------------------

#[test]
fn daemon_refuses_a_state_dir_another_user_made() {
    common::require_root("this test plays another user");
    let t = TempDir::new("squat");
    std::fs::create_dir_all(&t.0).unwrap();
    std::os::unix::fs::chown(&t.0, Some(NOBODY), Some(NOBODY)).unwrap();
    std::fs::set_permissions(&t.0, std::fs::Permissions::from_mode(0o777)).unwrap();
    let mut c = Command::new(vrnic_bin());
    c.arg("serve").arg("--state-dir").arg(&t.0);
    let out = output(c, "vrnic serve", CLI);
    assert!(!out.ok(), "served a squatted dir\n{}", out.text());
    assert!(out.stderr.contains("refusing state dir"), "{}", out.text());
    assert!(!t.0.join("vrnic.sock").exists());
    // Ours, but writable by everyone: refused too.
    std::os::unix::fs::chown(&t.0, Some(0), Some(0)).unwrap();
    let mut c = Command::new(vrnic_bin());
    c.arg("serve").arg("--state-dir").arg(&t.0);
    let out = output(c, "vrnic serve", CLI);
    assert!(
        !out.ok() && out.stderr.contains("mode 0777"),
        "{}",
        out.text()
    );
}

#[test]
fn unprivileged_daemon_refuses_a_squatted_tmp_fallback() {
    common::require_root("this test plays two users");
    let t = TempDir::new("bin");
    let bin = public_vrnic(&t.0);
    let fallback = PathBuf::from(format!("/tmp/vrnic-{NOBODY}"));
    let _ = std::fs::remove_dir_all(&fallback);
    let _cleanup = TempDir(fallback.clone());
    // Another user (root here) makes the victim's fallback dir first, open to all, with the
    // victim's admin socket name pointing at her own daemon's.
    std::fs::create_dir_all(&fallback).unwrap();
    std::fs::set_permissions(&fallback, std::fs::Permissions::from_mode(0o777)).unwrap();
    std::os::unix::fs::symlink("/tmp/attacker.sock", fallback.join("vrnic.sock")).unwrap();
    let out = output(as_nobody(&bin, &["serve"]), "vrnic serve as nobody", CLI);
    assert!(!out.ok(), "served a squatted dir\n{}", out.text());
    assert!(
        out.stderr.contains("refusing state dir")
            && out.stderr.contains(&fallback.display().to_string()),
        "{}",
        out.text()
    );
    // The victim's CLI does not talk to whatever answers there either.
    let out = output(as_nobody(&bin, &["ls"]), "vrnic ls as nobody", CLI);
    assert!(
        !out.ok() && out.stderr.contains("refusing state dir"),
        "{}",
        out.text()
    );
    // Without the squatter, the fallback is made private and served.
    std::fs::remove_dir_all(&fallback).unwrap();
    let mut daemon = common::Proc::spawn(as_nobody(&bin, &["serve"]), "vrnic serve as nobody");
    let sock = fallback.join("vrnic.sock");
    let start = std::time::Instant::now();
    while !sock.exists() && start.elapsed() < CLI && !daemon.exited() {
        std::thread::sleep(Duration::from_millis(20));
    }
    let served = sock.exists();
    let meta = std::fs::symlink_metadata(&fallback);
    daemon.signal(libc::SIGTERM);
    let out = daemon.wait(CLI);
    assert!(served && out.ok(), "{}", out.text());
    let meta = meta.unwrap();
    use std::os::unix::fs::MetadataExt;
    assert_eq!(meta.uid(), NOBODY);
    assert_eq!(meta.mode() & 0o777, 0o700, "fallback dir mode");
}

// ---- escapes from `vrnic run --container` ---------------------------------------------------

#[test]
fn container_cannot_escape_to_other_vrnics_or_the_daemon() {
    require("ibv_devinfo");
    common::require_root("this test makes namespaces");
    let mut d = Daemon::start();
    d.create("mine");
    d.create("victim");
    let victim = d.dir.join("victim");
    // Each line is an attack that worked before: it must fail now (its exit code says which
    // one did not).
    let script = format!(
        "set -x; \
         grep -q '^CapEff:.0000000000000000$' /proc/self/status || exit 10; \
         grep -q '^CapBnd:.0000000000000000$' /proc/self/status || exit 11; \
         grep -q '^NoNewPrivs:.1$' /proc/self/status || exit 12; \
         umount -l /run 2>/dev/null && exit 13; \
         umount -l /run/vrnic-device 2>/dev/null && exit 14; \
         mount -t tmpfs none /tmp 2>/dev/null && exit 15; \
         test -e {sd} && exit 16; \
         cat {v}/region >/dev/null 2>&1 && exit 17; \
         VRNIC_DEVICE={v} ibv_devinfo >/dev/null 2>&1 && exit 18; \
         for f in /proc/$$/fd/*; do readlink $f; done | grep socket && exit 19; \
         unshare -Urm sh -c 'umount -l /run/vrnic-device; umount -l /run; test -e {sd}' \
             2>/dev/null && exit 20; \
         echo 1 2>/dev/null >/proc/sys/vm/drop_caches && exit 21; \
         ibv_devinfo | grep -q 'hca_id:.mine' || exit 22; \
         exit 0",
        sd = d.dir.display(),
        v = victim.display()
    );
    let mut c = d.cli();
    c.args([
        "run",
        "--vrnic",
        "mine",
        "--container",
        "--",
        "sh",
        "-c",
        &script,
    ]);
    let out = output(c, "container attacks", LIMIT);
    assert!(
        out.ok(),
        "an attack from the container worked\n{}",
        out.text()
    );
    // The victim and the daemon are untouched.
    assert!(victim.join("region").exists());
    assert!(d.ls().contains("victim"));
    unrelated_pair_passes(&mut d);
}

// ---- a tenant that shrinks or overfills its own region --------------------------------------

/// Waits until `vrnic ls` no longer lists `name`.
fn wait_gone(d: &Daemon, name: &str) {
    d.wait_ls(Duration::from_secs(10), &format!("{name} removed"), |ls| {
        !ls.lines()
            .any(|l| l.split_whitespace().next() == Some(name))
    });
}

#[test]
fn a_tenant_that_truncates_its_region_loses_only_its_vrnic() {
    truncated_region_loses_only_its_vrnic(&["--region-gib", "1"]);
}

/// The same with two engine threads: the tenant's vRNIC and its peer's on different ones, so
/// the fault may come on either engine thread (a request executes on the thread that took it).
#[test]
fn a_tenant_that_truncates_its_region_under_an_engine_thread_loses_only_its_vrnic() {
    truncated_region_loses_only_its_vrnic(&["--region-gib", "1", "--engine-threads", "2"]);
}

fn truncated_region_loses_only_its_vrnic(args: &[&str]) {
    require("ibv_rc_pingpong");
    let mut d = Daemon::start_with(args);
    // The tenant is in traffic with a peer on another vRNIC when it shrinks its region.
    d.create("evil");
    let p = port().to_string();
    let server = ["ibv_rc_pingpong", "-p", &p, "-n", "100000000", "-s", "4096"];
    let mut client = server.to_vec();
    client.push("localhost");
    let (srv, peer) = common::start_pair(
        d.run_on(Some("evil"), &server),
        d.run(&client),
        p.parse().expect("port"),
        LIMIT,
        "evil's",
    );
    std::thread::sleep(Duration::from_millis(500));
    let region = d.dir.join("evil").join("region");
    std::fs::OpenOptions::new()
        .write(true)
        .open(&region)
        .expect("the tenant opens its own region")
        .set_len(0)
        .expect("and shrinks it");
    wait_gone(&d, "evil");
    assert!(d.alive(), "SIGBUS killed the daemon");
    // The peer's QP fails (its responder is gone); it does not hang.
    let out = peer.wait(LIMIT);
    assert!(!out.ok(), "the peer did not notice\n{}", out.text());
    drop(srv);
    // Shrunk to its header while idle, then used: the daemon's first touch of a mailbox
    // faults, and only that vRNIC goes.
    d.create("evil2");
    let r2 = d.dir.join("evil2").join("region");
    std::fs::OpenOptions::new()
        .write(true)
        .open(&r2)
        .unwrap()
        .set_len(4096)
        .unwrap();
    // (The driver library refuses so small a region; a hostile client just connects.)
    let _attach = std::os::unix::net::UnixStream::connect(d.dir.join("evil2").join("sock"));
    wait_gone(&d, "evil2");
    unrelated_pair_passes(&mut d);
    // The names are free again.
    d.create("evil");
}

/// The mount points strictly under `dir`, from `/proc/self/mountinfo`.
fn mounts_under(dir: &Path) -> Vec<String> {
    let prefix = format!("{}/", dir.display());
    std::fs::read_to_string("/proc/self/mountinfo")
        .expect("read mountinfo")
        .lines()
        .filter_map(|l| l.split_whitespace().nth(4))
        .filter(|m| m.starts_with(&prefix))
        .map(str::to_string)
        .collect()
}

#[test]
fn a_tenant_fills_only_its_own_quota() {
    require("ibv_rc_pingpong");
    common::require_root("this test makes per-vRNIC quotas (tmpfs mounts)");
    let mut d = Daemon::start_with(&["--region-gib", "1"]);
    d.create("evil");
    let dir = d.dir.join("evil");
    let stat = |p: &Path| {
        // SAFETY: an all-zero statvfs is a valid out-parameter.
        let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
        let c = std::ffi::CString::new(p.as_os_str().as_encoded_bytes()).unwrap();
        // SAFETY: c is NUL-terminated, st a valid out-pointer.
        assert_eq!(unsafe { libc::statvfs(c.as_ptr(), &mut st) }, 0);
        st.f_bavail * st.f_frsize
    };
    let state_free = stat(&d.dir);
    // Grow the region far past its quota and write everywhere; and a file beside it. Both run
    // out at the quota (1 GiB + slack), and the process holding the files stays alive.
    let fill = format!(
        "truncate -s 64G {d}/region; \
         dd if=/dev/zero of={d}/region bs=1M seek=4096 count=2048 conv=notrunc 2>&1; \
         dd if=/dev/zero of={d}/fill bs=1M count=2048 2>&1; \
         exec 3<{d}/fill; sleep 60",
        d = dir.display()
    );
    let holder = common::Proc::spawn(d.run_on(Some("evil"), &["sh", "-c", &fill]), "filler");
    let deadline = std::time::Instant::now() + LIMIT;
    while stat(&dir) > 0 && std::time::Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(100));
    }
    assert_eq!(stat(&dir), 0, "the quota never filled");
    std::thread::sleep(Duration::from_millis(200));
    let used: u64 = ["region", "fill"]
        .iter()
        .map(|f| {
            use std::os::unix::fs::MetadataExt;
            std::fs::metadata(dir.join(f))
                .map(|m| m.blocks() * 512)
                .unwrap_or(0)
        })
        .sum();
    assert!(
        used <= (1 << 30) + (1 << 20),
        "the tenant holds {used} bytes"
    );
    // Nothing of it landed on the state dir's file system.
    let now_free = stat(&d.dir);
    assert!(
        now_free + (64 << 20) >= state_free,
        "state dir fs: {state_free} free before, {now_free} after"
    );
    // The tenant now uses its full vRNIC: the daemon writes rings into pages there is no room
    // for, survives the SIGBUS, and removes that vRNIC only.
    let p = port().to_string();
    let server = ["ibv_rc_pingpong", "-p", &p, "-c"];
    let mut client = server.to_vec();
    client.push("localhost");
    let evil = common::Proc::spawn(d.run_on(Some("evil"), &server), "evil server");
    let other = common::Proc::spawn(d.run(&client), "client of evil");
    let _ = evil.wait_bounded(Duration::from_secs(20));
    let _ = other.wait_bounded(Duration::from_secs(20));
    assert!(d.alive(), "the daemon died");
    wait_gone(&d, "evil");
    unrelated_pair_passes(&mut d);
    // A daemon killed while the tenant still holds its files, and a new one on the same state
    // dir: the old quota is detached (the tenant's vRNIC, made again, has a fresh one), the new
    // daemon serves.
    let log = d.kill().text();
    assert!(
        log.lines()
            .any(|l| l.contains("evil") && l.contains("removing the vRNIC")),
        "the daemon never said it removed the tenant's vRNIC\n{log}"
    );
    let mut c = Command::new(vrnic_bin());
    c.arg("serve").arg("--state-dir").arg(&d.dir);
    let restarted = common::Proc::spawn(c, "restarted daemon");
    let start = std::time::Instant::now();
    while !d.cli_output(&["ls"]).ok() && start.elapsed() < CLI {
        std::thread::sleep(Duration::from_millis(50));
    }
    // `vrnic create` made it persistent: the new daemon makes it again, on a fresh quota (one
    // mount, nearly all free), not on the old full one.
    d.wait_ls(CLI, "evil made again", |ls| {
        ls.lines()
            .any(|l| l.split_whitespace().next() == Some("evil"))
    });
    let mounts = mounts_under(&d.dir);
    assert_eq!(mounts, [dir.display().to_string()], "quota mounts");
    let free = stat(&dir);
    assert!(free >= 1 << 30, "the new quota has {free} bytes free");
    let p = port().to_string();
    let server = ["ibv_rc_pingpong", "-p", &p, "-c", "-n", "100"];
    let mut client = server.to_vec();
    client.push("localhost");
    run_pair(&d, &server, &client, LIMIT).assert_ok();
    drop(holder);
    drop(restarted);
}

// ---- control requests that stall the loop ---------------------------------------------------

#[test]
fn an_admin_client_that_never_reads_stalls_nobody() {
    use std::io::Write;
    require("ibv_rc_pingpong");
    let mut d = Daemon::start();
    for i in 0..16 {
        d.create(&format!("pad{i}"));
    }
    // Thousands of `ls` requests whose replies (a few KiB each) are never read: before, the
    // loop waited up to a second on each reply that did not fit the socket.
    let mut slow = std::os::unix::net::UnixStream::connect(d.dir.join("vrnic.sock")).unwrap();
    slow.set_nonblocking(true).unwrap();
    let mut line = serde_json::to_vec(&vrnic_api::AdminRequest::List).unwrap();
    line.push(b'\n');
    let burst: Vec<u8> = line
        .iter()
        .copied()
        .cycle()
        .take(line.len() * 8000)
        .collect();
    let mut sent = 0;
    let start = std::time::Instant::now();
    while sent < burst.len() && start.elapsed() < Duration::from_secs(5) {
        match slow.write(&burst[sent..]) {
            Ok(n) => sent += n,
            Err(_) => std::thread::sleep(Duration::from_millis(5)),
        }
    }
    assert!(sent > 4096, "the daemon took only {sent} bytes of requests");
    unrelated_pair_passes(&mut d);
    assert!(d.ls().contains("pad15"));
    drop(slow);
}

// ---- too many vRNICs ------------------------------------------------------------------------

#[test]
fn the_vrnic_count_is_capped_with_a_clear_refusal() {
    require("ibv_rc_pingpong");
    // A limit past what the daemon can map at once is refused at start.
    let mut c = Command::new(vrnic_bin());
    c.args(["serve", "--max-vrnics", "70000"])
        .arg("--state-dir")
        .arg(std::env::temp_dir().join(format!("vrnic-trust-cap-{}", std::process::id())));
    let out = output(c, "vrnic serve", CLI);
    assert!(
        !out.ok() && out.stderr.contains("--max-vrnics 70000"),
        "{}",
        out.text()
    );
    let mut d = Daemon::start_with(&["--max-vrnics", "4", "--region-gib", "1"]);
    for i in 0..4 {
        d.create(&format!("v{i}"));
    }
    let out = d.cli_output(&["create", "v4"]);
    assert!(
        !out.ok() && out.stderr.contains("limit of 4 vRNICs"),
        "{}",
        out.text()
    );
    let out = output(d.run(&["true"]), "vrnic run past the cap", CLI);
    assert!(
        !out.ok() && out.stderr.contains("limit of 4 vRNICs"),
        "{}",
        out.text()
    );
    // Room again once two go: an unrelated pair passes.
    assert!(d.cli_output(&["rm", "v0"]).ok());
    assert!(d.cli_output(&["rm", "v1"]).ok());
    unrelated_pair_passes(&mut d);
}

/// The daemon maps each region only as far as its vRNIC uses it: 300 vRNICs with 1 TiB regions
/// (300 TiB of ceilings: more than a process's whole address space, so before, the daemon
/// refused to start with them, and without that check the 128th vRNIC failed) are all created,
/// cost the daemon a few GiB of address space in all, and pairs on such vRNICs move 1 MiB
/// messages (their registrations extend the mappings).
#[test]
fn vrnics_cost_the_daemon_the_address_space_they_use_not_their_ceiling() {
    require("ibv_rc_pingpong");
    let mut d = Daemon::start_with(&["--max-vrnics", "310", "--region-gib", "1024"]);
    for i in 0..300 {
        d.create(&format!("big{i}"));
    }
    let vm_kib = |d: &Daemon| -> u64 {
        let pid = d.pid();
        std::fs::read_to_string(format!("/proc/{pid}/status"))
            .expect("status")
            .lines()
            .find_map(|l| l.strip_prefix("VmSize:"))
            .and_then(|v| v.split_whitespace().next()?.parse().ok())
            .expect("VmSize")
    };
    let vm = vm_kib(&d);
    assert!(vm < 64 << 20, "300 vRNICs: VmSize {vm} KiB");
    let p = port().to_string();
    let server = [
        "ibv_rc_pingpong",
        "-p",
        &p,
        "-c",
        "-n",
        "50",
        "-s",
        "1048576",
    ];
    let mut client = server.to_vec();
    client.push("localhost");
    run_pair(&d, &server, &client, LIMIT).assert_ok();
    eprintln!(
        "300 vRNICs of 1 TiB: daemon VmSize {vm} KiB, after a pair {} KiB",
        vm_kib(&d)
    );
    unrelated_pair_passes(&mut d);
}

// ---- fairness between tenants ---------------------------------------------------------------

/// The median round trip (µs) of three unmodified 64 B `ibv_rc_pingpong` runs on fresh vRNICs.
fn pingpong_rtt(d: &Daemon) -> f64 {
    let mut rtts: Vec<f64> = (0..3)
        .map(|_| {
            let p = port().to_string();
            let server = ["ibv_rc_pingpong", "-p", &p, "-s", "64", "-n", "2000"];
            let mut client = server.to_vec();
            client.push("localhost");
            let pair = run_pair(d, &server, &client, LIMIT);
            pair.assert_ok();
            pair.client
                .stdout
                .lines()
                .find(|l| l.contains("iters in"))
                .and_then(|l| l.split_whitespace().rev().nth(1)?.parse().ok())
                .expect("usec/iter in the output")
        })
        .collect();
    rtts.sort_by(f64::total_cmp);
    rtts[1]
}

/// Another tenant's idle QPs and flooding traffic leave an unrelated pair's round trip close to
/// its idle figure. Once, 4096 idle QPs made it ~250x slower and flooders ~1000x; with the
/// engine running vRNICs in turns but looking for newcomers only between passes, the flood
/// still made it 30x (100x on CI's machine). The bounds here are loose (the machine is shared
/// and noisy) but fail either: `vrnic bench --sections fairness` (`bash scripts/bench-fairness`)
/// measures the figures (docs/performance.md: about 1.2x for both on the 2-core machine).
#[test]
fn other_tenants_idle_qps_and_floods_leave_a_pair_its_round_trip() {
    require("ib_read_bw");
    let holdqp = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("holdqp");
    let src = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../bench/holdqp.c");
    let cc = Command::new("cc")
        .args(["-O2", "-Wall", "-Werror", "-o"])
        .arg(&holdqp)
        .arg(&src)
        .arg("-libverbs")
        .output()
        .expect("cc");
    assert!(
        cc.status.success(),
        "{}",
        String::from_utf8_lossy(&cc.stderr)
    );
    let mut d = Daemon::start();
    let idle = pingpong_rtt(&d);

    // 4000 QPs on another vRNIC that never post.
    // holdqp holds its QPs until its stdin ends: a pipe from a long sleep.
    let script = format!("sleep 600 | {} 4000", holdqp.display());
    let hold = d.run_on(Some("idle"), &["sh", "-c", &script]);
    let mut held = common::Proc::spawn(hold, "holdqp");
    d.wait_ls(LIMIT, "4000 idle QPs", |ls| {
        ls.lines()
            .any(|l| l.starts_with("idle") && l.split_whitespace().nth(3) == Some("4000"))
    });
    let with_idle = pingpong_rtt(&d);
    held.signal(libc::SIGTERM);
    drop(held);

    // A flooding pair of unmodified ib_read_bw in event mode on two other vRNICs.
    let p = port().to_string();
    let flood = [
        "ib_read_bw",
        "-e",
        "-q",
        "16",
        "-s",
        "1048576",
        "-n",
        "1000000",
        "-p",
        &p,
    ];
    let mut fc = flood.to_vec();
    fc.push("localhost");
    let (srv, cli) = common::start_pair(
        d.run(&flood),
        d.run(&fc),
        p.parse().expect("port"),
        LIMIT,
        "flood",
    );
    d.wait_ls(LIMIT, "flooders connected", |ls| {
        ls.lines()
            .skip(1)
            .filter(|l| l.split_whitespace().nth(3) == Some("16"))
            .count()
            >= 2
    });
    std::thread::sleep(Duration::from_secs(1));
    let flooded = pingpong_rtt(&d);
    drop((srv, cli));
    eprintln!("rc_pingpong RTT: idle {idle} us, 4000 idle QPs {with_idle} us, flood {flooded} us");
    assert!(
        with_idle < 4.0 * idle,
        "idle QPs: {with_idle} us vs {idle} us"
    );
    assert!(flooded < 10.0 * idle, "flooders: {flooded} us vs {idle} us");
    assert!(d.alive());
}
