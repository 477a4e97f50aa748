//! What a new user meets in the first hour, each checked by the text they read: `--peer` by
//! host name with the default port, the legend of `vrnic peers`, a failed `serve` that leaves
//! nothing mounted, etcd's refusals named with the endpoint, `vrnic bench`'s legend.

mod common;

use common::{CLI, Proc, vrnic_bin};
use std::path::Path;
use std::process::Command;

fn is_root() -> bool {
    // SAFETY: geteuid has no preconditions.
    unsafe { libc::geteuid() == 0 }
}

/// Whether something is mounted on `dir`.
fn mounted(dir: &Path) -> bool {
    let info = std::fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
    let dir = dir.display().to_string();
    info.lines()
        .any(|l| l.split_whitespace().nth(4) == Some(dir.as_str()))
}

#[test]
fn a_serve_that_fails_after_mounting_its_state_dir_unmounts_it() {
    if !is_root() {
        eprintln!("skipped: only root's daemon mounts a tmpfs on its state dir");
        return;
    }
    let dir = std::env::temp_dir().join(format!("vrnic-failed-serve-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    // Refused after the mount: a peer-link address off loopback without keys.
    let mut c = Command::new(vrnic_bin());
    c.arg("serve").arg("--state-dir").arg(&dir).args([
        "--listen",
        "192.0.2.1:7700",
        "--peer",
        "192.0.2.2:7700",
    ]);
    let out = Proc::spawn(c, "vrnic serve").wait_bounded(CLI);
    let left = mounted(&dir);
    if left {
        let _ = Command::new("umount").arg("-l").arg(&dir).output();
    }
    let _ = std::fs::remove_dir_all(&dir);
    assert!(!out.timed_out && !out.ok(), "it ran\n{}", out.text());
    assert!(out.stderr.contains("vrnic keygen"), "{}", out.text());
    assert!(!left, "the failed serve left {} mounted", dir.display());
}
