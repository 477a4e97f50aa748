//! Docker containers on vRNICs (brief §3): a real container engine runs unmodified
//! `ibverbs-utils` and perftest in a small image built locally from the host's own files
//! (`tests/images/container.sh`: no registry here), each container given its vRNIC by the options
//! `vrnic docker-args NAME` prints (the vRNIC's directory bind-mounted at /run/vrnic-device, the
//! driver library mounted and preloaded, the device node `/dev/infiniband/uverbs-NAME` and a
//! sysfs view bound over `/sys/class`, which Debian's UCX in the container finds).
//!
//! Containers use the host's network (`--network host`): the pingpongs exchange QP numbers over
//! TCP with peers outside. Isolation of vRNICs is a mount-namespace matter, checked here.
//! Every container is named and removed (`docker rm -f`) when its guard drops.

mod common;

use std::time::Duration;

use common::docker::{docker_run, docker_run_with, image};
use common::{Daemon, Output, output, pair_of, port};

const LIMIT: Duration = Duration::from_secs(120);

#[test]
fn rc_pingpong_between_two_docker_containers() {
    image();
    let d = Daemon::start();
    d.create("ca");
    d.create("cb");
    let p = port().to_string();
    let args = [
        "ibv_rc_pingpong",
        "-p",
        &p,
        "-c",
        "-s",
        "65536",
        "-n",
        "500",
    ];
    let (srv, _a) = docker_run(&d, "ca", &args);
    let mut cargs = args.to_vec();
    cargs.push("127.0.0.1");
    let guards = std::sync::Mutex::new(Vec::new());
    let r = pair_of(
        srv,
        || {
            let (c, g) = docker_run(&d, "cb", &cargs);
            guards.lock().unwrap().push(g);
            c
        },
        LIMIT,
    );
    r.assert_ok();
    assert!(r.client.stdout.contains("500 iters"), "{r}");
    // Both contexts detached when their containers exited: the vRNICs have no users.
    d.wait_ls(Duration::from_secs(10), "contexts gone", |ls| {
        ls.lines()
            .filter(|l| l.starts_with("ca ") || l.starts_with("cb "))
            .all(|l| l.split_whitespace().nth(4) == Some("0"))
    });
}

#[test]
fn a_container_cannot_open_another_vrnics_region() {
    image();
    let d = Daemon::start();
    d.create("mine");
    d.create("other");
    let other = d.dir.join("other");
    let sh = format!(
        "echo run:; ls -A /run; echo device:; ls -A /run/vrnic-device; echo state:; \
         ls -A {sd} >/dev/null 2>&1 && echo SAW-STATE-DIR; cat {o}/region >/dev/null && echo OPENED-REGION; \
         VRNIC_DEVICE={o} ibv_devinfo; echo other-rc=$?; ibv_devices; echo own-rc=$?",
        sd = d.dir.display(),
        o = other.display()
    );
    let (c, _g) = docker_run(&d, "mine", &["sh", "-c", &sh]);
    let out: Output = output(c, "docker run", LIMIT);
    let text = out.text();
    assert!(out.ok(), "{text}");
    assert!(!out.stdout.contains("OPENED-REGION"), "{text}");
    // The daemon's state dir (other vRNICs' directories, the admin socket) is not there at all.
    assert!(!out.stdout.contains("SAW-STATE-DIR"), "{text}");
    assert!(
        out.stdout.contains("other-rc=") && !out.stdout.contains("other-rc=0"),
        "{text}"
    );
    assert!(out.stdout.contains("own-rc=0"), "{text}");
    // Its own vRNIC is the one device it sees; the directory holds its region and socket only.
    assert!(out.stdout.contains("    mine"), "{text}");
    assert!(!out.stdout.contains("other "), "{text}");
    let device = out
        .stdout
        .split("device:\n")
        .nth(1)
        .and_then(|s| s.split("state:").next())
        .unwrap_or("");
    assert_eq!(
        device.split_whitespace().collect::<Vec<_>>(),
        ["region", "sock"],
        "{text}"
    );
}

/// What `docker run $(vrnic docker-args NAME)` gives a container is what `vrnic run` gives a
/// command: the node `/dev/infiniband/uverbs-NAME` (a character device it may open) and
/// `/sys/class/infiniband/NAME` (read-only), so unmodified `ucx_info -d` (Debian's UCX, in the
/// image) lists `rc_verbs` and `ud_verbs` on the vRNIC. With `--device-files off` the container
/// has neither, and UCX finds no verbs device.
#[test]
fn ucx_in_a_docker_container_finds_the_vrnic_through_the_device_files() {
    image();
    let d = Daemon::start();
    d.create("ux");
    let sh = "set -e; n=/dev/infiniband/uverbs-ux; test -c $n -a -r $n -a -w $n; \
              echo node $(ls -l $n | grep -o '1, *3'); \
              echo class $(ls /sys/class); \
              echo state $(cat /sys/class/infiniband/ux/ports/1/state); \
              echo numa $(cat /sys/class/infiniband/ux/device/numa_node); \
              (echo x > /sys/class/infiniband/ux/ports/1/state) 2>/dev/null || echo read-only; \
              ucx_info -d";
    let (c, _g) = docker_run(&d, "ux", &["sh", "-c", sh]);
    let out: Output = output(c, "docker run", LIMIT);
    let text = out.text();
    assert!(out.ok(), "{text}");
    for want in [
        "node 1, 3\n",
        "class infiniband\n",
        "state 4: ACTIVE",
        "numa -1",
        "read-only",
    ] {
        assert!(out.stdout.contains(want), "no {want:?}\n{text}");
    }
    assert_ucx_transports(&out.stdout, "ux", true, &text);

    let (c, _g) = docker_run_with(&d, &["ux", "--device-files", "off"], &["ucx_info", "-d"]);
    let out: Output = output(c, "docker run", LIMIT);
    let text = out.text();
    assert!(out.ok(), "{text}");
    assert_ucx_transports(&out.stdout, "ux", false, &text);
}

/// Whether `ucx_info -d` listed `rc_verbs` and `ud_verbs` with the device `VNIC:1`.
fn assert_ucx_transports(info: &str, vnic: &str, present: bool, text: &str) {
    let lines: Vec<&str> = info.lines().map(str::trim).collect();
    for tl in ["rc_verbs", "ud_verbs"] {
        let found = lines.windows(2).any(|w| {
            w[0] == format!("#      Transport: {tl}").trim()
                && w[1] == format!("#         Device: {vnic}:1").trim()
        });
        assert_eq!(found, present, "{tl} on {vnic}:1 listed: {found}\n{text}");
    }
}
