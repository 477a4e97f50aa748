//! VMs on vRNICs (brief §3): a QEMU guest (TCG) boots Debian's cloud kernel with the vRNIC's
//! region as an `ivshmem-plain` PCI device (the options `vrnic vm-args` prints); inside, the
//! same driver library finds the device through sysfs (1af4:1110), maps BAR2 through
//! `resource2`, claims a mailbox in it and runs unmodified programs over it, polling where a
//! host process would be woken. Their peers are a host process and Docker containers on the
//! same daemon.
//!
//! Guests connect out to servers on the host (10.0.2.2 from inside, QEMU's user network) to
//! exchange QP numbers; the RDMA traffic itself goes through the region.

mod common;

use std::time::Duration;

use common::docker::docker_run;
use common::vm::{self, GUEST_DRIVER};
use common::{Daemon, Proc, port, require, wait_listening};

/// Boot, run and power off under software emulation.
const LIMIT: Duration = Duration::from_secs(180);

fn script(cmd: &str) -> String {
    format!("export LD_PRELOAD={GUEST_DRIVER}\n{cmd}\n")
}

/// A daemon whose regions fit a PCI BAR (a power of two, small enough for the guest's BIOS).
fn daemon() -> Daemon {
    let d = Daemon::start_with(&["--region-gib", "1"]);
    d.create("vm1");
    d
}

/// Runs `server` (listening on TCP `port`), then the guest's `client` command; checks both.
fn with_guest(d: &Daemon, img: &vm::Image, server: Proc, port: u16, client: &str) -> String {
    let server = wait_listening(server, port, Duration::from_secs(30));
    let g = vm::boot(d, img, "vm1", &script(client), LIMIT);
    vm::finish_with(&g, server, "server");
    // The guest detached when its program closed the device: no context is left on vm1.
    d.wait_ls(Duration::from_secs(10), "guest context gone", |ls| {
        ls.lines()
            .any(|l| l.starts_with("vm1 ") && l.split_whitespace().nth(4) == Some("0"))
    });
    g.console
}

#[test]
fn rc_pingpong_between_a_vm_and_a_host_process() {
    require("ibv_rc_pingpong");
    let img = vm::image(
        "rc-host",
        &["/usr/bin/ibv_rc_pingpong", "/usr/bin/ibv_devinfo"],
    );
    let d = daemon();
    let p = port();
    let ps = p.to_string();
    let args = [
        "ibv_rc_pingpong",
        "-p",
        &ps,
        "-c",
        "-s",
        "65536",
        "-n",
        "200",
    ];
    let server = Proc::spawn(d.run_on(Some("h"), &args), "host ibv_rc_pingpong");
    let console = with_guest(
        &d,
        &img,
        server,
        p,
        &format!(
            "ibv_devinfo | grep -q 'hca_id:.vm1' || exit 9\n\
             ibv_rc_pingpong -p {p} -c -s 65536 -n 200 10.0.2.2"
        ),
    );
    assert!(console.contains("200 iters"), "{console}");
}

/// A Docker container serves `prog args... -p PORT`; the guest runs `prog args... -p PORT` as
/// its client against the host's address. Returns the guest's console.
fn container_server_guest_client(image_name: &str, prog: &str, args: &[&str]) -> String {
    require(prog);
    common::docker::image();
    let img = vm::image(image_name, &[&format!("/usr/bin/{prog}")]);
    let d = daemon();
    d.create("ctr");
    let p = port();
    let ps = p.to_string();
    let mut server_args = vec![prog, "-p", &ps];
    server_args.extend_from_slice(args);
    let (c, _guard) = docker_run(&d, "ctr", &server_args);
    let server = Proc::spawn(c, &format!("container {prog}"));
    let client = format!("{} 10.0.2.2", server_args.join(" "));
    with_guest(&d, &img, server, p, &client)
}

#[test]
fn rc_pingpong_between_a_vm_and_a_docker_container() {
    let console = container_server_guest_client(
        "rc-docker",
        "ibv_rc_pingpong",
        &["-c", "-s", "4096", "-n", "200"],
    );
    assert!(console.contains("200 iters"), "{console}");
}

#[test]
fn ib_write_bw_between_a_vm_and_a_docker_container() {
    let console =
        container_server_guest_client("write-bw", "ib_write_bw", &["-s", "65536", "-n", "2000"]);
    // perftest's result line: size, iterations, peak and average bandwidth, message rate.
    assert!(
        console
            .lines()
            .any(|l| l.trim_start().starts_with("65536      2000")),
        "{console}"
    );
}

#[test]
fn a_killed_vm_releases_its_context_and_the_vrnic_serves_the_next_guest() {
    require("ibv_rc_pingpong");
    let img = vm::image(
        "killed",
        &["/usr/bin/ibv_rc_pingpong", "/usr/bin/ibv_devinfo"],
    );
    let d = daemon();
    let p = port();
    let ps = p.to_string();
    let server = Proc::spawn(
        d.run_on(
            Some("h"),
            &["ibv_rc_pingpong", "-p", &ps, "-n", "100000000"],
        ),
        "host ibv_rc_pingpong",
    );
    let server = wait_listening(server, p, Duration::from_secs(30));
    let mut qemu = Proc::spawn(
        vm::qemu(
            &d,
            &img,
            "vm1",
            &script(&format!("ibv_rc_pingpong -p {p} -n 100000000 10.0.2.2")),
        ),
        "qemu",
    );
    let qps = |ls: &str, n: &str| {
        ls.lines()
            .any(|l| l.starts_with("vm1 ") && l.split_whitespace().nth(3) == Some(n))
    };
    // The guest's QP exists and traffic flows; then the VM dies with no goodbye.
    d.wait_ls(LIMIT, "the guest's QP", |ls| qps(ls, "1"));
    std::thread::sleep(Duration::from_millis(500));
    qemu.signal(libc::SIGKILL);
    let out = qemu.wait_bounded(Duration::from_secs(10));
    vm::guest(out, "killed");
    drop(server);
    // No socket closes for a VM: the daemon reclaims the guest's objects when its heartbeat
    // lease runs out.
    d.wait_ls(Duration::from_secs(20), "the guest's QP reclaimed", |ls| {
        qps(ls, "0")
            && ls
                .lines()
                .any(|l| l.starts_with("vm1 ") && l.split_whitespace().nth(4) == Some("0"))
    });
    let g = vm::boot(
        &d,
        &img,
        "vm1",
        &script("ibv_devinfo -v | grep -q PORT_ACTIVE"),
        LIMIT,
    );
    assert!(g.ok(), "{}", g.console);
}
