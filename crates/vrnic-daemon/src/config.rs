//! Where the daemon keeps its state, and the names of the files in it. Shared with the CLI so
//! both agree without a config file (the embedded default).

use std::path::{Path, PathBuf};

/// The admin socket, relative to the state dir.
pub const ADMIN_SOCKET: &str = "vrnic.sock";
/// The lock that keeps a second daemon off a state dir.
pub const LOCK_FILE: &str = "daemon.lock";
/// A vRNIC's region file, inside its directory.
pub const REGION_FILE: &str = "region";
/// A vRNIC's socket, inside its directory.
pub const VNIC_SOCKET: &str = "sock";
/// The environment variable naming the state dir.
pub const STATE_DIR_ENV: &str = "VRNIC_STATE_DIR";
/// The environment variable that points the driver library at a vRNIC directory.
pub const DEVICE_ENV: &str = "VRNIC_DEVICE";

/// The state dir when none is given: `$VRNIC_STATE_DIR`, else `/run/vrnic` as root, else
/// `$XDG_RUNTIME_DIR/vrnic`, else `/tmp/vrnic-<uid>`.
pub fn default_state_dir() -> PathBuf {
    if let Some(d) = std::env::var_os(STATE_DIR_ENV).filter(|d| !d.is_empty()) {
        return PathBuf::from(d);
    }
    let uid = current_euid();
    if uid == 0 {
        return PathBuf::from("/run/vrnic");
    }
    if let Some(x) = std::env::var_os("XDG_RUNTIME_DIR").filter(|d| !d.is_empty()) {
        return Path::new(&x).join("vrnic");
    }
    PathBuf::from(format!("/tmp/vrnic-{uid}"))
}

/// The effective uid of this process.
pub fn current_euid() -> u32 {
    // Read from /proc to keep this module free of unsafe code; falls back to "not root".
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("Uid:"))
                .and_then(|l| l.split_whitespace().nth(2).and_then(|u| u.parse().ok()))
        })
        .unwrap_or(u32::MAX)
}

/// Checks a vRNIC name: what a device name may be (`ibv_get_device_name`) and a safe directory
/// name.
pub fn valid_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 63
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
        && !name.starts_with('-')
}
