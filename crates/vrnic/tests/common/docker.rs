//! Docker containers for the tests: the image (built from the host's files by
//! `tests/images/container.sh`) and containers on vRNICs, removed when their guards drop.

use std::path::PathBuf;
use std::process::Command;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use super::{Daemon, Proc, output};

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
    docker_run_with(d, &[vnic], args)
}

/// [`docker_run`] with `vrnic docker-args DOCKER_ARGS...` (a vRNIC name and options).
pub fn docker_run_with(d: &Daemon, docker_args: &[&str], args: &[&str]) -> (Command, Container) {
    static SEQ: AtomicU32 = AtomicU32::new(0);
    let name = format!(
        "vrnic-test-{}-{}",
        std::process::id(),
        SEQ.fetch_add(1, Ordering::Relaxed)
    );
    let mut cli = vec!["docker-args"];
    cli.extend(docker_args);
    let flags = d.cli_output(&cli);
    assert!(flags.ok(), "vrnic {}\n{}", cli.join(" "), flags.text());
    let mut c = Command::new("docker");
    c.args(["run", "--rm", "--network", "host", "--name", &name])
        .args(flags.stdout.split_whitespace())
        .arg(IMAGE)
        .args(args);
    (c, Container { name })
}
