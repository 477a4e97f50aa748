//! RDMA stacks found the usual way (issue 17): under `vrnic run` the command sees its vRNIC as
//! a device node `/dev/infiniband/uverbs-NAME` and a sysfs view `/sys/class/infiniband/NAME`
//! (in a mount namespace of its own: the host's view stays as it was), and Debian's UCX 1.13
//! (`ucx-utils`) uses it unmodified: `ucx_info -d` lists `rc_verbs` and `ud_verbs`, and
//! `ucx_perftest` runs `tag_lat`, `tag_bw` and `put_bw` between two `vrnic run` processes
//! with `UCX_TLS=rc_verbs,ud_verbs,self`, its own log naming the verbs transport it used.
//! Open MPI, the diagnostic tools and librdmacm's rsocket (`rstream`, `riostream`, and
//! `librspreload` under a plain TCP ping-pong and under `iperf3`) run over it too.

mod common;

use std::path::Path;
use std::time::Duration;

use common::hosts::Hosts;
use common::{Daemon, output, port, require, run_pair};

/// What `sh -c SCRIPT` prints under `vrnic run ARGS` on a fresh vRNIC (asserting exit 0).
fn shell(d: &Daemon, run_args: &[&str], script: &str) -> String {
    let mut c = d.cli();
    c.arg("run").args(run_args).args(["--", "sh", "-c", script]);
    let out = output(c, "sh", Duration::from_secs(30));
    assert!(out.ok(), "{}", out.text());
    out.stdout
}

const LOOK: &str = "set -e; for n in /dev/infiniband/*; do stat -c '%n %F %t:%T %a' $n; done; \
    d=$(ls -d /sys/class/infiniband/*); echo dir $d; \
    for f in node_guid ports/1/state ports/1/rate ports/1/lid ports/1/gids/0 \
    ports/1/gid_attrs/types/0 ports/1/link_layer device/numa_node device/local_cpus; do \
    echo \"$f=$(cat $d/$f)\"; done";

fn assert_device_files(out: &str) {
    let node = out
        .lines()
        .find(|l| l.starts_with("/dev/infiniband/uverbs-"))
        .unwrap_or_else(|| panic!("no device node\n{out}"));
    assert!(
        node.ends_with(" character special file 1:3 666"),
        "the node is no character device anyone may read and write: {node}"
    );
    let name = node
        .split_whitespace()
        .next()
        .and_then(|n| n.strip_prefix("/dev/infiniband/uverbs-"))
        .expect("node name");
    assert!(
        out.contains(&format!("dir /sys/class/infiniband/{name}\n")),
        "sysfs dir of another name\n{out}"
    );
    for want in [
        "ports/1/state=4: ACTIVE",
        "ports/1/rate=100 Gb/sec (4X EDR)",
        "ports/1/gid_attrs/types/0=IB/RoCE v1",
        "ports/1/link_layer=InfiniBand",
        "device/numa_node=-1",
        "ports/1/gids/0=fe80:0000:0000:0000:",
    ] {
        assert!(out.contains(want), "no {want:?}\n{out}");
    }
    let guid = out
        .lines()
        .find_map(|l| l.strip_prefix("node_guid="))
        .expect("node_guid");
    assert!(
        out.contains(&format!("ports/1/gids/0=fe80:0000:0000:0000:{guid}")),
        "GID 0 is not the subnet prefix and the node GUID\n{out}"
    );
}

fn assert_host_unchanged() {
    assert!(
        !Path::new("/dev/infiniband").exists() && !Path::new("/sys/class/infiniband").exists(),
        "the host shows /dev/infiniband or /sys/class/infiniband (this machine has no RDMA \
         device: vrnic must not have made them on the host)"
    );
}

#[test]
fn vrnic_run_presents_a_device_node_and_sysfs_only_to_its_command() {
    assert_host_unchanged();
    let d = Daemon::start();
    let out = shell(&d, &[], LOOK);
    assert_device_files(&out);
    // The command still sees the host's /dev and /sys/class (its mounts included) and /tmp.
    let out = shell(
        &d,
        &[],
        "test -c /dev/null && test -d /dev/pts && test -d /dev/shm && test -e /sys/class/net/lo \
         && touch /tmp/vrnic-stacks-$$ && rm /tmp/vrnic-stacks-$$ && echo host-view-kept",
    );
    assert!(out.contains("host-view-kept"), "{out}");
    assert_host_unchanged();
    // Off when asked.
    let out = shell(
        &d,
        &["--device-files", "off"],
        "test -e /dev/infiniband || echo none",
    );
    assert!(out.contains("none"), "{out}");
}

#[test]
fn vrnic_run_container_presents_them_too() {
    let d = Daemon::start();
    let out = shell(&d, &["--container"], LOOK);
    assert_device_files(&out);
    assert_host_unchanged();
    // UCX inside the container finds the vRNIC.
    require("ucx_info");
    let out = shell(&d, &["--vrnic", "ctr0", "--container"], "ucx_info -d");
    assert!(
        out.contains("Transport: rc_verbs\n#         Device: ctr0:1"),
        "no rc_verbs on the vRNIC in the container\n{out}"
    );
}

#[test]
fn device_files_on_without_root_fails_saying_why() {
    require("setpriv");
    let d = Daemon::start();
    let mut c = std::process::Command::new(require("setpriv"));
    c.args(["--reuid=65534", "--regid=65534", "--clear-groups", "--"])
        .arg(common::vrnic_bin())
        .arg("--state-dir")
        .arg(&d.dir)
        .args(["run", "--device-files", "on", "--", "true"]);
    let out = output(c, "vrnic run as nobody", Duration::from_secs(30));
    assert!(!out.ok(), "succeeded without root\n{}", out.text());
    assert!(
        out.stderr.contains("--device-files on") && out.stderr.contains("needs root"),
        "no clear reason\n{}",
        out.text()
    );
}

#[test]
fn ucx_info_lists_rc_verbs_and_ud_verbs_on_the_vrnic() {
    require("ucx_info");
    let d = Daemon::start();
    let out = output(
        d.run_on(Some("ucx0"), &["ucx_info", "-d"]),
        "ucx_info",
        Duration::from_secs(60),
    );
    assert!(out.ok(), "{}", out.text());
    for tl in ["rc_verbs", "ud_verbs"] {
        // Each transport line is followed by the device it runs on.
        let mut lines = out.stdout.lines().map(str::trim);
        let found = lines
            .by_ref()
            .skip_while(|l| *l != format!("#      Transport: {tl}"))
            .nth(1);
        assert_eq!(
            found,
            Some("#         Device: ucx0:1"),
            "no {tl} on the vRNIC\n{}",
            out.stdout
        );
    }
}

/// `ucx_perftest` server and client, each under `vrnic run` (on vRNIC `vrnic`, or fresh ones),
/// with UCX restricted to the verbs transports; returns the client's output.
fn perftest(d: &Daemon, vrnic: Option<&str>, test: &[&str]) -> String {
    require("ucx_perftest");
    let p = port().to_string();
    let env = [
        "env",
        "UCX_TLS=rc_verbs,ud_verbs,self",
        "UCX_LOG_LEVEL=info",
    ];
    let mut server: Vec<&str> = env.to_vec();
    server.extend(["ucx_perftest", "-p", &p]);
    let mut client: Vec<&str> = env.to_vec();
    client.extend(["ucx_perftest", "127.0.0.1", "-p", &p]);
    client.extend(test);
    let pair = if let Some(v) = vrnic {
        let limit = Duration::from_secs(120);
        let (server, client) = common::start_pair(
            d.run_on(Some(v), &server),
            d.run_on(Some(v), &client),
            p.parse().expect("port"),
            limit,
            "ucx_perftest",
        );
        common::finish_pair(server, client, limit)
    } else {
        run_pair(d, &server, &client, Duration::from_secs(120))
    };
    pair.assert_ok();
    let out = pair.client.stdout.clone() + &pair.client.stderr;
    assert!(
        out.lines().any(|l| l.starts_with("Final:")),
        "no result line\n{pair}"
    );
    out
}

#[test]
fn ucx_perftest_tag_lat_and_tag_bw_run_over_rc_verbs() {
    let d = Daemon::start();
    for test in [
        &["-t", "tag_lat", "-n", "2000"][..],
        &["-t", "tag_bw", "-s", "1048576", "-n", "200"][..],
    ] {
        let out = perftest(&d, None, test);
        assert!(
            out.contains("tag(rc_verbs/"),
            "{test:?}: UCX's endpoint did not use rc_verbs\n{out}"
        );
    }
}

#[test]
fn ucx_perftest_put_bw_runs_over_rc_verbs() {
    // A UCT test names the device on both sides: both processes attach to the same vRNIC.
    let d = Daemon::start();
    for test in [
        &[
            "-t", "put_bw", "-x", "rc_verbs", "-d", "ucxput:1", "-n", "2000",
        ][..],
        &[
            "-t", "put_bw", "-x", "rc_verbs", "-d", "ucxput:1", "-D", "zcopy", "-s", "65536", "-n",
            "1000",
        ][..],
    ] {
        perftest(&d, Some("ucxput"), test);
    }
}

/// Builds `tests/c/mpi_check.c` with Open MPI's `mpicc` (once per test process).
fn mpi_program() -> &'static std::path::PathBuf {
    static BIN: std::sync::OnceLock<std::path::PathBuf> = std::sync::OnceLock::new();
    BIN.get_or_init(|| {
        require("mpicc");
        let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/c/mpi_check.c");
        let dir = Path::new(env!("CARGO_TARGET_TMPDIR"));
        let out = dir.join("mpi_check");
        let tmp = dir.join(format!("mpi_check.{}.tmp", std::process::id()));
        let cc = std::process::Command::new("mpicc")
            .args(["-O2", "-Wall", "-Werror", "-o"])
            .arg(&tmp)
            .arg(&src)
            .output()
            .expect("run mpicc");
        assert!(
            cc.status.success(),
            "mpicc failed (libopenmpi-dev installed? bash scripts/test installs it):\n{}",
            String::from_utf8_lossy(&cc.stderr)
        );
        std::fs::rename(&tmp, &out).expect("move mpi_check into place");
        out
    })
}

/// Open MPI over UCX restricted to the verbs transports, logging the transport each endpoint
/// uses.
const PML_UCX: &[&str] = &[
    "--mca",
    "pml",
    "ucx",
    "-x",
    "UCX_TLS=rc_verbs,ud_verbs,self",
    "-x",
    "UCX_LOG_LEVEL=info",
];

/// `vrnic run -- mpirun -np RANKS MCA... mpi_check CASE` on one vRNIC (each rank a context of
/// its own). Asserts exit 0, every check in `expect`, every rank's finalize and no crash.
fn mpi(ranks: u32, mca: &[&str], case: &str, expect: &[&str]) -> String {
    require("mpirun");
    let bin = mpi_program().to_str().expect("utf-8 path").to_string();
    let d = Daemon::start();
    let np = ranks.to_string();
    let mut args = vec![
        "mpirun",
        "--allow-run-as-root",
        "--oversubscribe",
        "-np",
        &np,
    ];
    args.extend(mca);
    args.extend([bin.as_str(), case]);
    let mut cmd = d.run(&args);
    cmd.env("OMPI_ALLOW_RUN_AS_ROOT", "1")
        .env("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1");
    let out = output(cmd, "mpirun", Duration::from_secs(180));
    let text = out.text();
    assert!(out.ok(), "mpirun failed\n{text}");
    for e in expect.iter().chain(&["done, finalized"]) {
        assert!(
            out.stdout
                .lines()
                .any(|l| l.starts_with("OK ") && l.contains(e)),
            "no OK line with {e:?}\n{text}"
        );
    }
    for bad in ["Segmentation fault", "signal 11", "Abort", "FAIL"] {
        assert!(!text.contains(bad), "{bad:?} in the output\n{text}");
    }
    text
}

/// UCX's log shows every rank's endpoints to the others over `rc_verbs` on the vRNIC.
fn assert_rc_verbs(ranks: u32, text: &str) {
    let eps = text
        .lines()
        .filter(|l| l.contains("ep_cfg[") && l.contains("tag(rc_verbs/"))
        .count();
    assert!(
        eps >= ranks as usize,
        "UCX's log shows {eps} endpoints over rc_verbs for {ranks} ranks\n{text}"
    );
}

/// Open MPI over UCX with one rank per host: two network-namespace hosts, each with its daemon,
/// joined by their peer link. `mpirun` runs on host 0 under `vrnic run`; it starts host 1's
/// `orted` through an rsh agent that enters host 1's namespace under that host's `vrnic run`
/// (a vRNIC made with `vrnic create`, since `orted` outlives the command that started it). The
/// ranks' RC QPs connect across the hosts: the ping-pong checks every byte, and the peer link
/// carried the 4 MiB messages.
#[test]
fn open_mpi_over_ucx_ping_pong_with_one_rank_per_host() {
    require("mpirun");
    let bin = mpi_program().to_str().expect("utf-8 path").to_string();
    let hosts = Hosts::new(2);
    let ds = hosts.daemons(Duration::from_secs(20));
    ds[1].create("mpi1");
    let dir =
        Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("mpi-agent-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let agent = dir.join("agent.sh");
    std::fs::write(
        &agent,
        format!(
            "#!/bin/sh\n# Open MPI's rsh agent: HOST COMMAND... runs COMMAND on host 1.\nshift\n\
             exec nsenter --net=/run/netns/{} {} --state-dir {} run --vrnic mpi1 -- sh -c \"$*\"\n",
            hosts.netns(1),
            common::vrnic_bin().display(),
            ds[1].dir.display()
        ),
    )
    .unwrap();
    std::fs::set_permissions(&agent, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    let hostlist = format!("{}:1,{}:1", hosts.addr(0), hosts.addr(1));
    let subnet = "10.77.0.0/24";
    let agent_s = agent.display().to_string();
    let mut args = vec![
        "mpirun",
        "--allow-run-as-root",
        "--host",
        &hostlist,
        "-np",
        "2",
        "--mca",
        "plm_rsh_agent",
        &agent_s,
        "--mca",
        "plm_rsh_no_tree_spawn",
        "1",
        "--mca",
        "oob_tcp_if_include",
        subnet,
    ];
    args.extend(PML_UCX);
    args.extend([bin.as_str(), "pingpong"]);
    let mut cmd = ds[0].run(&args);
    cmd.env("OMPI_ALLOW_RUN_AS_ROOT", "1")
        .env("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1");
    let out = output(cmd, "mpirun across hosts", Duration::from_secs(180));
    let text = out.text();
    let _ = std::fs::remove_dir_all(&dir);
    assert!(out.ok(), "mpirun failed\n{text}");
    for e in [
        "ping-pong 8 B .. 4 MiB, every byte checked",
        "done, finalized",
    ] {
        assert!(
            out.stdout
                .lines()
                .any(|l| l.starts_with("OK ") && l.contains(e)),
            "no OK line with {e:?}\n{text}"
        );
    }
    assert_rc_verbs(2, &text);
    // Both vRNICs took part, one per host, and the messages crossed the peer link.
    assert!(
        text.contains("on mpi1"),
        "host 1's rank did not use its vRNIC\n{text}"
    );
    let peers = ds[1].cli_output(&["peers"]).stdout;
    let bytes_in: u64 = peers
        .lines()
        .nth(1)
        .and_then(|l| l.split_whitespace().nth(3))
        .and_then(|b| b.parse().ok())
        .unwrap_or(0);
    assert!(
        bytes_in > 8 << 20,
        "the peer link carried {bytes_in} bytes\n{peers}"
    );
}

#[test]
fn open_mpi_over_ucx_ping_pong_8_bytes_to_4_mib_exits_cleanly() {
    let text = mpi(
        2,
        PML_UCX,
        "pingpong",
        &["ping-pong 8 B .. 4 MiB, every byte checked"],
    );
    assert_rc_verbs(2, &text);
    for size in ["8", "1048576", "4194304"] {
        assert!(
            text.contains(&format!("size {size} half round trip")),
            "no timing for {size} bytes\n{text}"
        );
    }
}

#[test]
fn open_mpi_over_ucx_allreduce_on_four_ranks() {
    let text = mpi(4, PML_UCX, "allreduce", &["allreduce over 4 ranks"]);
    assert_rc_verbs(4, &text);
}

/// Open MPI's own verbs transport (`btl openib`, still in Debian's 4.1), the only one allowed
/// between the ranks: the ping-pong passes over it.
#[test]
fn open_mpi_btl_openib_ping_pong_exits_cleanly() {
    mpi(
        2,
        &[
            "--mca",
            "pml",
            "ob1",
            "--mca",
            "btl",
            "openib,self",
            "--mca",
            "btl_openib_allow_ib",
            "1",
        ],
        "pingpong",
        &["ping-pong 8 B .. 4 MiB, every byte checked"],
    );
}

/// The diagnostic tools (`infiniband-diags`), which read sysfs only, show the vRNIC with the
/// attributes the verbs report.
#[test]
fn ibstat_and_ibstatus_show_the_vrnic() {
    require("ibstat");
    require("ibstatus");
    let d = Daemon::start();
    let out = shell(&d, &["--vrnic", "diag0"], "ibstat; ibstatus");
    for want in [
        "CA 'diag0'",
        "Number of ports: 1",
        "State: Active",
        "Physical state: LinkUp",
        "Rate: 100",
        "Base lid: 1",
        "Capability mask: 0x00010800",
        "Link layer: InfiniBand",
        "Infiniband device 'diag0' port 1 status:",
        "state:\t\t 4: ACTIVE",
        "rate:\t\t 100 Gb/sec (4X EDR)",
    ] {
        assert!(out.contains(want), "no {want:?}\n{out}");
    }
    let fw = out
        .lines()
        .find_map(|l| l.trim().strip_prefix("Firmware version: "))
        .expect("firmware version");
    assert!(fw.split('.').all(|p| p.parse::<u32>().is_ok()), "{fw}");
}

/// librdmacm's own rsocket code (unmodified `rstream`/`riostream` from rdmacm-utils) over the
/// driver library's connection manager: the ids it makes carry what rsocket reads inside
/// librdmacm (`cma_id_private`'s device and `sync` flag, the kept event of a synchronous id).
fn rsocket_pair(prog: &str, extra: &[&str]) -> common::Pair {
    require(prog);
    let p = port().to_string();
    let mut server = vec![prog, "-p", &p];
    server.extend(extra);
    let mut client = vec![prog, "-s", "127.0.0.1", "-p", &p];
    client.extend(extra);
    common::fresh_pair(&server, &client, Duration::from_secs(120))
}

#[test]
fn rstream_runs_every_size() {
    let pair = rsocket_pair("rstream", &[]);
    for test in [
        "64_lat", "4k_lat", "64k_lat", "1m_lat", "64_bw", "4k_bw", "64k_bw", "1m_bw",
    ] {
        assert!(
            pair.client.stdout.lines().any(|l| l.starts_with(test)),
            "no {test} result\n{pair}"
        );
    }
}

#[test]
fn riostream_writes_into_mapped_buffers() {
    // Bandwidth: 2000 RDMA writes of 64 KiB into the peer's riomap'd buffer.
    let pair = rsocket_pair("riostream", &["-S", "65536", "-C", "2000"]);
    assert!(pair.client.stdout.contains("custom"), "{pair}");
    // Latency: each side spins on its buffer's last byte until the peer's write lands (a
    // round is slow on two cores with both sides spinning, so a few).
    let pair = rsocket_pair("riostream", &["-S", "4096", "-C", "1", "-I", "20"]);
    assert!(pair.client.stdout.contains("custom"), "{pair}");
}

/// librdmacm's `librspreload` under an ordinary TCP program (`bench/tcp_pingpong.c`: TCP
/// sockets, `TCP_NODELAY`, non-blocking reads): its sockets become rsockets over the vRNICs.
/// No kernel TCP connection exists on the port while it runs, and the ping-pong completes.
#[test]
fn librspreload_carries_a_plain_tcp_program_over_the_vrnic() {
    let preload = Path::new("/usr/lib/x86_64-linux-gnu/rsocket/librspreload.so");
    assert!(
        preload.exists(),
        "librspreload is missing (librdmacm1, installed with rdmacm-utils)"
    );
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../bench/tcp_pingpong.c");
    let bin = Path::new(env!("CARGO_TARGET_TMPDIR")).join("tcp_pingpong_rsp");
    let cc = std::process::Command::new("cc")
        .args(["-O2", "-Wall", "-Werror", "-o"])
        .arg(&bin)
        .arg(&src)
        .output()
        .expect("run cc");
    assert!(
        cc.status.success(),
        "{}",
        String::from_utf8_lossy(&cc.stderr)
    );
    let bin = bin.to_str().expect("utf-8 path");
    let d = Daemon::start();
    let p = port().to_string();
    let with_preload = |args: &[&str]| {
        let mut c = d.run(args);
        c.env("LD_PRELOAD", preload);
        c
    };
    let srv = common::Proc::spawn(with_preload(&[bin, "server", &p]), "rspreload server");
    // The server listens through rsocket (rdma_cm), so there is no kernel port to wait for:
    // retry the client while it is refused.
    let start = std::time::Instant::now();
    let client = loop {
        let c = common::Proc::spawn(
            with_preload(&[bin, "client", "127.0.0.1", &p, "64", "200000"]),
            "rspreload client",
        );
        // While it runs, no kernel TCP connection carries it.
        std::thread::sleep(Duration::from_millis(500));
        let ss = std::process::Command::new(require("ss"))
            .args(["-Htn", "state", "established"])
            .output()
            .expect("run ss");
        let ss = String::from_utf8_lossy(&ss.stdout).to_string();
        let out = c.wait_bounded(Duration::from_secs(60));
        if !out.ok() && start.elapsed() < Duration::from_secs(10) {
            continue;
        }
        assert!(
            !ss.contains(&format!(":{p} ")),
            "a kernel TCP connection on port {p}: librspreload fell back to TCP\n{ss}"
        );
        break out;
    };
    let server = srv.wait_bounded(Duration::from_secs(10));
    let pair = common::Pair { server, client };
    pair.assert_ok();
    let half: f64 = pair
        .client
        .stdout
        .trim()
        .parse()
        .unwrap_or_else(|_| panic!("no half round trip printed\n{pair}"));
    assert!(half > 0.0, "{pair}");
}

/// Debian's `librspreload` (librdmacm's socket preload).
const RSPRELOAD: &str = "/usr/lib/x86_64-linux-gnu/rsocket/librspreload.so";

/// The kernel's TCP sockets (any state, listeners too) of `prog`'s processes with `port` at
/// either end, as `ss` lists them. (Only `prog`'s: another test's connection may have drawn
/// `port` as its ephemeral port.)
fn kernel_tcp_of(prog: &str, port: u16) -> Vec<String> {
    let ss = std::process::Command::new(require("ss"))
        .args(["-Htanp"])
        .output()
        .expect("run ss");
    String::from_utf8_lossy(&ss.stdout)
        .lines()
        .filter(|l| l.contains(&format!(":{port} ")) && l.contains(&format!("((\"{prog}\"")))
        .map(str::to_string)
        .collect()
}

/// Unmodified `iperf3 -s -1` and `iperf3 -c 127.0.0.1 -J CLIENT_ARGS`, both under
/// `librspreload` through `vrnic run`: iperf3's control and data connections become rsockets
/// over the two processes' vRNICs. Asserts both exit 0 and no kernel TCP socket of iperf3 (not
/// even a listener) exists on the port while the client runs; returns the client's JSON report.
fn iperf3_over_librspreload(client_args: &[&str]) -> serde_json::Value {
    let iperf3 = require("iperf3");
    assert!(
        Path::new(RSPRELOAD).exists(),
        "librspreload is missing (librdmacm1, installed with rdmacm-utils)"
    );
    let iperf3 = iperf3.to_str().expect("utf-8 path");
    let d = Daemon::start();
    let port = port();
    let p = port.to_string();
    let with_preload = |args: &[&str]| {
        let mut c = d.run(args);
        c.env("LD_PRELOAD", RSPRELOAD);
        c
    };
    let srv = common::Proc::spawn(
        with_preload(&[iperf3, "-s", "-1", "-p", &p]),
        "iperf3 server",
    );
    // The server listens through rsocket, so there is no kernel port to wait for: retry the
    // client while the server is not up yet. While the client runs, look for kernel sockets.
    let start = std::time::Instant::now();
    let mut seen = Vec::new();
    let client = loop {
        let mut args = vec![iperf3, "-c", "127.0.0.1", "-p", &p, "-J"];
        args.extend(client_args);
        let mut c = common::Proc::spawn(with_preload(&args), "iperf3 client");
        while !c.exited() && start.elapsed() < Duration::from_secs(60) {
            seen.extend(kernel_tcp_of("iperf3", port));
            std::thread::sleep(Duration::from_millis(100));
        }
        let out = c.wait_bounded(Duration::from_secs(5));
        let refused = out.stdout.contains("unable to connect to server");
        if !out.ok() && refused && start.elapsed() < Duration::from_secs(10) {
            std::thread::sleep(Duration::from_millis(200));
            continue;
        }
        break out;
    };
    let server = srv.wait_bounded(Duration::from_secs(20));
    let pair = common::Pair { server, client };
    pair.assert_ok();
    assert!(
        seen.is_empty(),
        "kernel TCP sockets on port {p}: librspreload fell back to TCP\n{}\n{pair}",
        seen.join("\n")
    );
    serde_json::from_str(&pair.client.stdout)
        .unwrap_or_else(|e| panic!("iperf3 -J printed no JSON ({e})\n{pair}"))
}

/// The bytes iperf3's JSON report counts in `end.KEY` (`sum_sent`: written by the sender,
/// `sum_received`: read by the receiver).
fn iperf3_bytes(report: &serde_json::Value, key: &str) -> u64 {
    report["end"][key]["bytes"]
        .as_u64()
        .unwrap_or_else(|| panic!("no end.{key}.bytes in\n{report:#}"))
}

/// What the receiver read is what the sender wrote, but for what was still in flight when the
/// test ended (iperf3 stops counting when the end message arrives on the control connection,
/// which can overtake the last write on the data connection): rsocket's flow control keeps
/// that below its receive buffer (128 KiB by default; 1 MiB allowed here).
fn assert_iperf3_received_what_was_sent(report: &serde_json::Value) {
    let (sent, received) = (
        iperf3_bytes(report, "sum_sent"),
        iperf3_bytes(report, "sum_received"),
    );
    assert!(
        0 < received && received <= sent && sent - received <= 1 << 20,
        "sent {sent}, received {received}\n{report:#}"
    );
}

/// iperf3 (control connection, data connection, `select` on both, non-blocking sockets) over
/// `librspreload`: 256 MiB from client to server.
#[test]
fn librspreload_carries_iperf3_over_the_vrnic() {
    let report = iperf3_over_librspreload(&["-n", "256M"]);
    // iperf3 checks `-n` between writes, so a write under way when the count is reached goes
    // out whole: at most one block (128 KiB) more (seen: 131,035 bytes).
    let sent = iperf3_bytes(&report, "sum_sent");
    assert!(
        (256 << 20..=(256 << 20) + (128 << 10)).contains(&sent),
        "sent {sent}, asked for 256 MiB\n{report:#}"
    );
    assert_iperf3_received_what_was_sent(&report);
}

/// The same with the server sending (`-R`) for two seconds: the accepted socket writes, the
/// client reads.
#[test]
fn librspreload_carries_iperf3_reversed_for_two_seconds() {
    let report = iperf3_over_librspreload(&["-R", "-t", "2"]);
    assert_iperf3_received_what_was_sent(&report);
}
