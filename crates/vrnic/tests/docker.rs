//! Docker containers on vRNICs (brief §3): a real container engine runs unmodified
//! `ibverbs-utils` and perftest in a small image built locally from the host's own files
//! (`tests/images/container.sh`: no registry here), each container given its vRNIC by the options
//! `vrnic docker-args NAME` prints (the vRNIC's directory bind-mounted at /run/vrnic-device, the
//! driver library mounted and preloaded).
//!
//! Containers use the host's network (`--network host`): the pingpongs exchange QP numbers over
//! TCP with peers outside. Isolation of vRNICs is a mount-namespace matter, checked here.
//! Every container is named and removed (`docker rm -f`) when its guard drops.

mod common;

use std::path::PathBuf;
use std::process::Command;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use common::{Daemon, Output, Pair, Proc, output, port};

const LIMIT: Duration = Duration::from_secs(120);
/// The image the tests run (built by `tests/images/container.sh`).
pub const IMAGE: &str = "vrnic-test:latest";

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// Builds the test image once per machine (the script skips an unchanged rebuild; `flock`
/// keeps parallel test processes from building it twice at once). Docker is part of the
/// test machine: a missing engine is a failure.
pub fn image() -> &'static str {
    let lock = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("container-image.lock");
    let mut c = Command::new("flock");
    c.arg(&lock)
        .arg("bash")
        .arg(repo().join("tests/images/container.sh"))
        .arg(IMAGE);
    let out = output(c, "tests/images/container.sh", Duration::from_secs(600));
    assert!(
        out.ok(),
        "building the container image failed (is the Docker engine running?)\n{}",
        out.text()
    );
    IMAGE
}

/// A named container, removed when dropped.
pub struct Container {
    pub name: String,
}

impl Drop for Container {
    fn drop(&mut self) {
        let mut c = Command::new("docker");
        c.args(["rm", "-f", &self.name]);
        let _ = Proc::spawn(c, "docker rm").wait_timeout(Duration::from_secs(30));
    }
}

/// `docker run --rm --network host $(vrnic docker-args VNIC) IMAGE args...`, named.
pub fn docker_run(d: &Daemon, vnic: &str, args: &[&str]) -> (Command, Container) {
    static SEQ: AtomicU32 = AtomicU32::new(0);
    let name = format!(
        "vrnic-test-{}-{}",
        std::process::id(),
        SEQ.fetch_add(1, Ordering::Relaxed)
    );
    let flags = d.cli_output(&["docker-args", vnic]);
    assert!(flags.ok(), "vrnic docker-args {vnic}\n{}", flags.text());
    let mut c = Command::new("docker");
    c.args(["run", "--rm", "--network", "host", "--name", &name])
        .args(flags.stdout.split_whitespace())
        .arg(IMAGE)
        .args(args);
    (c, Container { name })
}

fn create(d: &Daemon, name: &str) {
    let out = d.cli_output(&["create", name]);
    assert!(out.ok(), "vrnic create {name}\n{}", out.text());
}

/// Runs the server, then the client (retried while the server is not listening yet).
pub fn pair(server: Command, client: impl Fn() -> Command) -> Pair {
    let start = Instant::now();
    let srv = Proc::spawn(server, "server");
    let client = loop {
        let out = Proc::spawn(client(), "client").wait_bounded(LIMIT);
        let said = |s: &str| out.stdout.contains(s) || out.stderr.contains(s);
        if !out.ok() && said("Couldn't connect") && start.elapsed() < Duration::from_secs(30) {
            std::thread::sleep(Duration::from_millis(200));
            continue;
        }
        break out;
    };
    let server = srv.wait_bounded(if client.ok() {
        LIMIT
    } else {
        Duration::from_secs(5)
    });
    Pair { server, client }
}

#[test]
fn rc_pingpong_between_two_docker_containers() {
    image();
    let d = Daemon::start();
    create(&d, "ca");
    create(&d, "cb");
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
    let r = pair(srv, || {
        let (c, g) = docker_run(&d, "cb", &cargs);
        guards.lock().unwrap().push(g);
        c
    });
    r.assert_ok();
    assert!(r.client.stdout.contains("500 iters"), "{r}");
    // Both contexts detached when their containers exited: the vRNICs have no users.
    d.wait_ls(Duration::from_secs(10), "contexts gone", |ls| {
        ls.lines()
            .filter(|l| l.starts_with("ca ") || l.starts_with("cb "))
            .all(|l| l.ends_with(" 0"))
    });
}

#[test]
fn a_container_cannot_open_another_vrnics_region() {
    image();
    let d = Daemon::start();
    create(&d, "mine");
    create(&d, "other");
    let other = d.dir.join("other");
    let sh = format!(
        "echo run:; ls -A /run; echo device:; ls -A /run/vrnic-device; echo state:; \
         ls -A {sd} 2>&1; cat {o}/region >/dev/null && echo OPENED-REGION; \
         VRNIC_DEVICE={o} ibv_devinfo; echo other-rc=$?; ibv_devices; echo own-rc=$?",
        sd = d.dir.display(),
        o = other.display()
    );
    let (c, _g) = docker_run(&d, "mine", &["sh", "-c", &sh]);
    let out: Output = output(c, "docker run", LIMIT);
    let text = out.text();
    assert!(out.ok(), "{text}");
    assert!(!out.stdout.contains("OPENED-REGION"), "{text}");
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
