//! One channel for processes, containers and VMs (brief §3): unmodified programs on vRNICs of
//! one daemon, attached in every way the design has.
//!
//! - Region-only contexts (what a VM guest is: no socket, a mailbox claimed in the region,
//!   polling, a heartbeat) exercised from host processes with `VRNIC_REGION_ONLY=1`: they talk
//!   to socket contexts, and a killed one is reclaimed when its heartbeat stops.
//! - `vrnic run --container` (mount, PID, UTS and network namespaces without an engine):
//!   `rping` and `ibv_rc_pingpong` against a host process, and only its own vRNIC visible.
//! - `vrnic docker-args` / `vrnic vm-args`: the options they print, and, for a vRNIC that is
//!   not there, a failure that reaches the command they stand in (unmodified `docker run` and
//!   `qemu-system-x86_64` refuse to start).
//!
//! Docker containers and QEMU guests have their own binaries (`docker.rs`, `vm.rs`).

mod common;

use std::time::{Duration, Instant};

use common::{Daemon, Proc, output, pair_of, port, require};
use vrnic_shm::{Mailbox, MailboxState, Region};

const LIMIT: Duration = Duration::from_secs(60);

/// `vrnic run --vrnic NAME [run_args...] -- args` on `d`, with `env` set.
fn run_cmd(
    d: &Daemon,
    name: &str,
    run_args: &[&str],
    env: &[(&str, &str)],
    args: &[&str],
) -> std::process::Command {
    let mut c = d.cli();
    c.arg("run").arg("--vrnic").arg(name).args(run_args);
    c.arg("--").args(args);
    for (k, v) in env {
        c.env(k, v);
    }
    c
}

/// What the `run --container` tests need root for (they fail without it, rather than pass
/// having run nothing).
const ROOT: &str = "this test makes namespaces, mounts and pivot_root";

#[test]
fn region_only_context_talks_to_a_socket_context() {
    region_only_talks_to_a_socket_context(&Daemon::start());
}

/// The same on a daemon with two engine threads, the guest's vRNIC and the host's on different
/// ones: the guest rings no doorbell, so its thread must keep looking at its rings (it never
/// sleeps long while a guest is attached).
#[test]
fn region_only_context_talks_to_a_socket_context_on_another_engine_thread() {
    region_only_talks_to_a_socket_context(&Daemon::start_with(&["--engine-threads", "2"]));
}

fn region_only_talks_to_a_socket_context(d: &Daemon) {
    require("ibv_rc_pingpong");
    for extra in [&[][..], &["-e"][..]] {
        let p = port().to_string();
        let mut args = vec!["ibv_rc_pingpong", "-p", &p, "-s", "4096", "-n", "500"];
        args.extend_from_slice(extra);
        let srv = run_cmd(d, "guest", &[], &[("VRNIC_REGION_ONLY", "1")], &args);
        let mut cargs = args.clone();
        cargs.push("localhost");
        let r = pair_of(srv, || run_cmd(d, "host", &[], &[], &cargs), LIMIT);
        r.assert_ok();
        assert!(r.server.stdout.contains("500 iters"), "{r}");
    }
    // Both left cleanly: their vRNICs (made for the runs) are gone with them.
    d.wait_ls(Duration::from_secs(10), "vRNICs removed", |ls| {
        !ls.contains("guest") && !ls.contains("host")
    });
}

#[test]
fn a_killed_region_only_context_is_reclaimed_when_its_heartbeat_stops() {
    require("ibv_rc_pingpong");
    let d = Daemon::start();
    d.create("g");
    let p = port().to_string();
    // The server creates its QP, then waits for a client that never comes.
    let srv = Proc::spawn(
        run_cmd(
            &d,
            "g",
            &[],
            &[("VRNIC_REGION_ONLY", "1")],
            &["ibv_rc_pingpong", "-p", &p],
        ),
        "region-only server",
    );
    let qps = |ls: &str, n: &str| {
        ls.lines().any(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            f.first() == Some(&"g") && f.get(3) == Some(&n)
        })
    };
    d.wait_ls(Duration::from_secs(10), "the guest's QP", |ls| qps(ls, "1"));
    common::kill_group(srv.pid(), libc::SIGKILL);
    let killed = Instant::now();
    // The server is dead (by our SIGKILL, not of its own accord) before the lease is timed.
    let out = srv.wait(Duration::from_secs(5));
    assert_eq!(
        std::os::unix::process::ExitStatusExt::signal(&out.status),
        Some(libc::SIGKILL),
        "the region-only server was not killed\n{}",
        out.text()
    );
    // Nothing closes for the daemon to see: the heartbeat lease (5 s) tells it.
    let ls = d.wait_ls(Duration::from_secs(15), "the QP reclaimed", |ls| {
        qps(ls, "0")
            && ls
                .lines()
                .any(|l| l.starts_with("g ") && l.split_whitespace().nth(4) == Some("0"))
    });
    assert!(
        killed.elapsed() >= Duration::from_secs(4),
        "reclaimed before the lease ran out ({:?}):\n{ls}",
        killed.elapsed()
    );
    // The mailbox is free again: a new region-only context attaches and works.
    let out = output(
        run_cmd(
            &d,
            "g",
            &[],
            &[("VRNIC_REGION_ONLY", "1")],
            &["ibv_devinfo", "-v"],
        ),
        "ibv_devinfo",
        LIMIT,
    );
    assert!(
        out.ok() && out.stdout.contains("PORT_ACTIVE"),
        "{}",
        out.text()
    );
}

#[test]
fn region_only_attach_to_an_unserved_region_fails_cleanly() {
    require("ibv_devinfo");
    // A region that no daemon serves (as a guest sees a vRNIC whose daemon is gone): the attach
    // gives up after its timeout with ENODEV, and withdraws its claim on the mailbox.
    let path = std::env::temp_dir().join(format!("vrnic-unserved-{}", std::process::id()));
    let _ = std::fs::remove_file(&path);
    let region = Region::create(&path, 0, "orphan", 9, [0; 16], 9).expect("region");
    let driver = common::vrnic_bin().with_file_name("libvrnic_shim.so");
    let mut c = std::process::Command::new("ibv_devinfo");
    c.env("LD_PRELOAD", &driver)
        .env("VRNIC_DEVICE", &path)
        .env("VRNIC_LOG", "1");
    let start = Instant::now();
    let out = output(c, "ibv_devinfo", LIMIT);
    let _ = std::fs::remove_file(&path);
    assert!(!out.ok(), "{}", out.text());
    assert!(
        out.stderr.contains("no vrnic daemon accepted"),
        "{}",
        out.text()
    );
    assert!(
        start.elapsed() >= Duration::from_secs(9),
        "{:?}",
        start.elapsed()
    );
    let m = Mailbox::new(0).unwrap();
    assert_eq!(m.load_state(&region), Some(MailboxState::Free));
}

#[test]
fn unshare_container_rping_with_a_host_process() {
    require("rping");
    common::require_root(ROOT);
    let d = Daemon::start();
    let p = port().to_string();
    let rping = common::Rping::new("127.0.0.1", &p, &["-C", "200", "-S", "4096", "-V", "-v"]);
    // The server in its own network namespace: rdma_cm addressing goes through the daemon's
    // broker, not the kernel's network.
    let srv = run_cmd(&d, "ctr", &["--container"], &[], &rping.server);
    let r = pair_of(srv, || run_cmd(&d, "host", &[], &[], &rping.client), LIMIT);
    r.assert_ok();
    rping.assert_counted(&r);
}

#[test]
fn unshare_container_rc_pingpong_with_a_host_process() {
    require("ibv_rc_pingpong");
    common::require_root(ROOT);
    let d = Daemon::start();
    let p = port().to_string();
    let args = [
        "ibv_rc_pingpong",
        "-p",
        &p,
        "-c",
        "-s",
        "65536",
        "-n",
        "200",
    ];
    // ibv_rc_pingpong exchanges QP numbers over TCP: the container keeps the host's network.
    let srv = run_cmd(&d, "ctr", &["--container", "--host-net"], &[], &args);
    let mut cargs = args.to_vec();
    cargs.push("localhost");
    let r = pair_of(srv, || run_cmd(&d, "host", &[], &[], &cargs), LIMIT);
    r.assert_ok();
    assert!(r.client.stdout.contains("200 iters"), "{r}");
}

#[test]
fn unshare_container_sees_only_its_own_vrnic() {
    require("ibv_devinfo");
    common::require_root(ROOT);
    let d = Daemon::start();
    d.create("mine");
    d.create("other");
    let other = d.dir.join("other");
    let script = format!(
        "set -x; hostname; ls -A {sd}; ls -A /run; test \"$(ls -A {sd})\" = '' || exit 10; \
         cat {o}/region >/dev/null && exit 11; \
         VRNIC_DEVICE={o} ibv_devinfo && exit 12; \
         ibv_devinfo | grep -q 'hca_id:.mine' || exit 13; \
         test \"$(cat /proc/1/comm)\" = vrnic || exit 14; exit 0",
        sd = d.dir.display(),
        o = other.display()
    );
    let out = output(
        run_cmd(&d, "mine", &["--container"], &[], &["sh", "-c", &script]),
        "container",
        LIMIT,
    );
    assert!(out.ok(), "{}", out.text());
    assert!(out.stdout.contains("vrnic-mine"), "{}", out.text());
    // The host's view is untouched: the other vRNIC is still there.
    assert!(other.join("region").exists());
}

#[test]
fn docker_args_and_vm_args_print_the_options() {
    let d = Daemon::start_with(&["--region-gib", "1"]);
    d.create("v1");
    let dir = d.dir.join("v1");
    let out = d.cli_output(&["docker-args", "v1"]);
    assert!(out.ok(), "{}", out.text());
    let want = format!(
        "--mount type=bind,source={},target=/run/vrnic-device",
        dir.display()
    );
    assert!(out.stdout.contains(&want), "{}", out.text());
    assert!(
        out.stdout
            .contains("--env LD_PRELOAD=/usr/lib/vrnic/libvrnic_shim.so"),
        "{}",
        out.text()
    );
    let out = d.cli_output(&["vm-args", "v1"]);
    assert!(out.ok(), "{}", out.text());
    let want = format!(
        "-object memory-backend-file,id=vrnic-v1,share=on,mem-path={},size=1073741824 \
         -device ivshmem-plain,memdev=vrnic-v1",
        dir.join("region").display()
    );
    assert_eq!(out.stdout.trim(), want);
    let out = d.cli_output(&["docker-args", "nope"]);
    assert!(
        !out.ok() && out.stderr.contains("no vRNIC nope"),
        "{}",
        out.text()
    );
    // What it leaves on stdout makes the outer command fail, not start without the vRNIC.
    assert_eq!(
        out.stdout.trim(),
        "--vrnic-docker-args-failed",
        "{}",
        out.text()
    );
    let out = d.cli_output(&["vm-args", "nope"]);
    assert!(
        !out.ok() && out.stdout.trim() == "-vrnic-vm-args-failed",
        "{}",
        out.text()
    );
}

/// `$(vrnic vm-args NAME)` and `$(vrnic docker-args NAME)` for a vRNIC that does not exist:
/// unmodified QEMU and `docker run` stop at once with an error naming the option, instead of
/// starting a guest or a container without the device (they used to: an empty substitution).
/// And the daemon's log, written to a pipe, carries no terminal colour codes.
#[test]
fn a_wrong_name_in_vm_args_or_docker_args_fails_the_outer_command() {
    let qemu = require("qemu-system-x86_64");
    let mut d = Daemon::start();
    let sub = |what: &str| {
        format!(
            "$({} --state-dir {} {what} nope)",
            common::vrnic_bin().display(),
            d.dir.display()
        )
    };
    let mut c = std::process::Command::new("bash");
    c.args([
        "-c",
        &format!(
            "exec timeout 20 {} {} -machine none -nodefaults -display none -serial none",
            qemu.display(),
            sub("vm-args")
        ),
    ]);
    let out = output(c, "qemu with vm-args of a missing vRNIC", LIMIT);
    assert!(
        !out.ok() && out.status.code() != Some(124),
        "QEMU ran\n{}",
        out.text()
    );
    assert!(
        out.stderr.contains("-vrnic-vm-args-failed: invalid option")
            && out.stderr.contains("no vRNIC nope"),
        "{}",
        out.text()
    );
    println!("QEMU: {}", out.stderr.trim());
    if let Ok(docker) = which("docker") {
        let mut c = std::process::Command::new("bash");
        c.args([
            "-c",
            &format!(
                "exec timeout 30 {} run --rm {} vrnic-no-such-image true",
                docker.display(),
                sub("docker-args")
            ),
        ]);
        let out = output(c, "docker run with docker-args of a missing vRNIC", LIMIT);
        assert!(
            !out.ok()
                && out
                    .stderr
                    .contains("unknown flag: --vrnic-docker-args-failed"),
            "{}",
            out.text()
        );
        println!("docker: {}", out.stderr.trim());
    }
    let log = d.stop().text();
    assert!(log.contains("vrnic daemon serving"), "{log}");
    assert!(
        !log.contains('\u{1b}'),
        "colour codes in a log that is not a terminal\n{log}"
    );
}

/// `tool` on `PATH`.
fn which(tool: &str) -> Result<std::path::PathBuf, ()> {
    std::env::var_os("PATH")
        .and_then(|p| {
            std::env::split_paths(&p)
                .map(|d| d.join(tool))
                .find(|f| f.is_file())
        })
        .ok_or(())
}
