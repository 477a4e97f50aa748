//! Mount namespaces: whether the mounts the daemon makes (its state dir's tmpfs, each vRNIC's
//! quota tmpfs) are seen outside its own mount namespace, and, for a CLI that finds no daemon
//! or no vRNIC where it looks, the daemons whose mounts it cannot see.
//!
//! `ip netns exec`, a container and a systemd unit with private mounts each give the daemon a
//! mount namespace of its own whose new mounts do not propagate back: the daemon serves, but
//! outside that namespace its state dir (when it mounted a tmpfs there) and every vRNIC's
//! directory are empty. Nothing here changes that; it says so, with the ways out, instead of
//! "no daemon running". Everything is read from `/proc`; a link this user may not read (another
//! user's process) leaves the answer at "cannot tell".

use std::io::ErrorKind;
use std::path::{Path, PathBuf};

/// The advice shared by the daemon's warning and the CLI's errors: where to run the CLI and
/// apps, or how to start the daemon instead.
fn ways_out(pid: u32) -> String {
    format!(
        "run the CLI and apps in its mount namespace (`nsenter --mount=/proc/{pid}/ns/mnt vrnic \
         ...`), or start the daemon where its mounts are seen: for a network namespace, \
         `nsenter --net=/run/netns/NAME vrnic serve` instead of `ip netns exec NAME vrnic \
         serve` (which makes a mount namespace too); in a container, the host's state dir bound \
         with rshared propagation; in a systemd unit, none of PrivateTmp, ProtectSystem and the \
         other settings that make a mount namespace (docs/operations.md, \"Where the daemon \
         runs\")"
    )
}

/// The mount namespace of process `pid` (`"self"` for this one), as its `/proc/PID/ns/mnt`
/// link reads (`mnt:[4026531841]`).
fn ns_of(pid: &str) -> std::io::Result<String> {
    let link = std::fs::read_link(format!("/proc/{pid}/ns/mnt"))?;
    Ok(link.to_string_lossy().into_owned())
}

/// Undoes mountinfo's octal escapes (`\040` for a space, `\011`, `\012`, `\134`).
fn unescape(field: &str) -> String {
    let b = field.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        let octal = b
            .get(i + 1..i + 4)
            .filter(|d| d.iter().all(|c| (b'0'..=b'7').contains(c)));
        match (b[i], octal) {
            (b'\\', Some(d)) => {
                out.push(
                    d.iter()
                        .fold(0u8, |v, c| v.wrapping_mul(8).wrapping_add(c - b'0')),
                );
                i += 4;
            }
            (c, _) => {
                out.push(c);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// Whether the mount that holds `dir` (the one with the longest mount point above it, in
/// `mountinfo`, the text of `/proc/self/mountinfo`) propagates new mounts to peers in other
/// namespaces (`shared:N` among its optional fields).
fn holder_is_shared(mountinfo: &str, dir: &Path) -> bool {
    let mut best: Option<(usize, bool)> = None;
    for line in mountinfo.lines() {
        let fields: Vec<&str> = line.split(' ').collect();
        let Some(point) = fields.get(4).map(|p| PathBuf::from(unescape(p))) else {
            continue;
        };
        if !dir.starts_with(&point) {
            continue;
        }
        // The optional fields run from the seventh to the `-` separator.
        let shared = fields
            .iter()
            .skip(6)
            .take_while(|f| **f != "-")
            .any(|f| f.starts_with("shared:"));
        let depth = point.components().count();
        // A later line for the same point is mounted over the earlier one: it holds `dir`.
        if best.is_none_or(|(d, _)| depth >= d) {
            best = Some((depth, shared));
        }
    }
    best.is_some_and(|(_, shared)| shared)
}

/// Why the mounts the daemon makes under its state dir `dir` are seen by nobody outside its own
/// mount namespace, as the line the daemon logs at start; `None` when they are seen (its
/// namespace is PID 1's and its parent's, as far as this process may read them, or the mount
/// holding `dir` propagates to peers) or this cannot be told.
pub fn unseen_mounts(dir: &Path) -> Option<String> {
    let own = ns_of("self").ok()?;
    let parent = std::os::unix::process::parent_id().to_string();
    let elsewhere = ["1", parent.as_str()]
        .into_iter()
        .any(|p| ns_of(p).is_ok_and(|ns| ns != own));
    // Not the marks container engines leave (`/.dockerenv`): some machines carry them stray,
    // and a daemon whose CLI and apps share its container is right where it is. A CLI on the
    // host names a containerized daemon all the same (`unseen_daemons`).
    if !elsewhere {
        return None;
    }
    let info = std::fs::read_to_string("/proc/self/mountinfo").ok()?;
    if holder_is_shared(&info, dir) {
        return None;
    }
    Some(format!(
        "this daemon runs in a mount namespace of its own (as under `ip netns exec`, in a \
         container or in a systemd unit with private mounts) and the mounts it makes under its \
         state dir {} do not propagate out of it: outside it the CLI finds no daemon or no \
         vRNIC and apps find no device; {}",
        dir.display(),
        ways_out(std::process::id())
    ))
}

/// A `vrnic serve` this process cannot see through its own mounts.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UnseenDaemon {
    /// Its process id.
    pub pid: u32,
    /// The state dir it serves, when its command line or environment says (or it is root's
    /// default).
    pub state_dir: Option<PathBuf>,
    /// Whether its mount namespace is known to differ from ours (`false`: its namespace link
    /// could not be read, another user's process).
    pub known: bool,
}

/// The state dir a `vrnic serve` with arguments `args` (after `argv[0]`) serves, if they, its
/// `VRNIC_STATE_DIR` (from `environ`, NUL-separated) or its user (`uid`, root's default) say;
/// `cwd` resolves a relative one.
fn served_dir(
    args: &[&str],
    environ: Option<&str>,
    uid: Option<u32>,
    cwd: Option<&Path>,
) -> Option<PathBuf> {
    let mut named = None;
    let mut it = args.iter();
    while let Some(a) = it.next() {
        if *a == "--" {
            break;
        }
        if *a == "--state-dir" {
            named = it.next().map(PathBuf::from);
        } else if let Some(d) = a.strip_prefix("--state-dir=") {
            named = Some(PathBuf::from(d));
        }
    }
    let from_env = || {
        environ?
            .split('\0')
            .find_map(|kv| kv.strip_prefix(&format!("{}=", crate::config::STATE_DIR_ENV)))
            .filter(|d| !d.is_empty())
            .map(PathBuf::from)
    };
    let dir = named
        .or_else(from_env)
        .or_else(|| (uid == Some(0)).then(|| PathBuf::from(crate::config::SYSTEM_STATE_DIR)))?;
    Some(match cwd {
        Some(c) if dir.is_relative() => c.join(dir),
        _ => dir,
    })
}

/// The `vrnic serve` processes whose mount namespace is not ours (or cannot be read) and that
/// serve `state_dir` or a dir they do not name: what a CLI that finds no daemon at `state_dir`
/// is missing.
pub fn unseen_daemons(state_dir: &Path) -> Vec<UnseenDaemon> {
    let Ok(own) = ns_of("self") else {
        return Vec::new();
    };
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    let me = std::process::id();
    let want = state_dir
        .canonicalize()
        .unwrap_or_else(|_| state_dir.to_path_buf());
    let mut found = Vec::new();
    for e in entries.flatten() {
        let Some(pid) = e.file_name().to_str().and_then(|p| p.parse::<u32>().ok()) else {
            continue;
        };
        if pid == me {
            continue;
        }
        let Ok(cmdline) = std::fs::read(format!("/proc/{pid}/cmdline")) else {
            continue;
        };
        let cmdline = String::from_utf8_lossy(&cmdline);
        let argv: Vec<&str> = cmdline.split('\0').filter(|a| !a.is_empty()).collect();
        let is_daemon = argv
            .first()
            .is_some_and(|a0| Path::new(a0).file_name().is_some_and(|n| n == "vrnic"))
            && argv[1..]
                .iter()
                .take_while(|a| **a != "--")
                .any(|a| *a == "serve");
        if !is_daemon {
            continue;
        }
        let known = match ns_of(&pid.to_string()) {
            Ok(ns) if ns == own => continue,
            Ok(_) => true,
            Err(e) if e.kind() == ErrorKind::PermissionDenied => false,
            Err(_) => continue,
        };
        let environ = std::fs::read(format!("/proc/{pid}/environ")).ok();
        let environ = environ.as_deref().map(String::from_utf8_lossy);
        let uid = std::fs::read_to_string(format!("/proc/{pid}/status"))
            .ok()
            .and_then(|s| {
                s.lines()
                    .find(|l| l.starts_with("Uid:"))
                    .and_then(|l| l.split_whitespace().nth(2).and_then(|u| u.parse().ok()))
            });
        // Another user's own daemon admits that user alone: not the one this CLI missed.
        let me_uid = crate::config::current_euid();
        if uid.is_some_and(|u| u != 0 && u != me_uid) && me_uid != 0 {
            continue;
        }
        let cwd = std::fs::read_link(format!("/proc/{pid}/cwd")).ok();
        let served = served_dir(&argv[1..], environ.as_deref(), uid, cwd.as_deref());
        if served
            .as_ref()
            .is_some_and(|d| *d != want && d.as_path() != state_dir)
        {
            continue;
        }
        found.push(UnseenDaemon {
            pid,
            state_dir: served,
            known,
        });
    }
    found.sort_by_key(|d| d.pid);
    found
}

/// What a CLI that finds no daemon at `state_dir` says when `d` is there all the same.
pub fn no_daemon_here(state_dir: &Path, d: &UnseenDaemon) -> String {
    let dir = state_dir.display();
    if d.known {
        format!(
            "no daemon running at {dir} as this process sees it, but `vrnic serve` (pid {}) \
             serves it from a mount namespace of its own (as under `ip netns exec`, in a \
             container or in a systemd unit with private mounts), whose mounts are seen only \
             inside it; {}",
            d.pid,
            ways_out(d.pid)
        )
    } else {
        format!(
            "no daemon running at {dir} as this process sees it; `vrnic serve` (pid {}) runs, \
             but whether in a mount namespace of its own this user cannot tell (ask its owner, \
             or run as root); if it is: {}",
            d.pid,
            ways_out(d.pid)
        )
    }
}

/// What `vrnic run` says when the vRNIC its daemon (`daemon`, its pid, from the admin socket's
/// peer credentials) made at `dir` is not there as this process sees it.
pub fn no_vnic_here(dir: &Path, daemon: Option<u32>) -> String {
    let at = dir.display();
    let differs = daemon.map(|pid| {
        let own = ns_of("self");
        let theirs = ns_of(&pid.to_string());
        (pid, matches!((own, theirs), (Ok(a), Ok(b)) if a != b))
    });
    match differs {
        Some((pid, true)) => format!(
            "the daemon (pid {pid}) made the vRNIC at {at}, but this process cannot see it: the \
             daemon runs in a mount namespace of its own (as under `ip netns exec`, in a \
             container or in a systemd unit with private mounts) and each vRNIC's directory is \
             a tmpfs it mounts there; {}",
            ways_out(pid)
        ),
        Some((pid, false)) => format!(
            "the daemon (pid {pid}) made the vRNIC at {at}, but its region is not there as this \
             process sees it (a daemon in a mount namespace of its own hides its vRNICs; if it \
             is in one: {})",
            ways_out(pid)
        ),
        None => format!(
            "the daemon made the vRNIC at {at}, but its region is not there as this process \
             sees it (a daemon in a mount namespace of its own hides its vRNICs: see \
             docs/operations.md, \"Where the daemon runs\")"
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const INFO: &str = "\
27 1 254:0 / / rw,relatime shared:1 - ext4 /dev/vda rw
30 27 0:27 / /dev/shm rw,relatime master:2 - tmpfs tmpfs rw
31 27 0:28 / /tmp/with\\040space rw,relatime - tmpfs tmpfs rw
32 27 0:29 / /run rw,relatime shared:5 master:3 - tmpfs tmpfs rw
";

    #[test]
    fn the_longest_mount_point_above_the_dir_decides_propagation() {
        assert!(holder_is_shared(INFO, Path::new("/var/lib/vrnic")));
        assert!(holder_is_shared(INFO, Path::new("/run/vrnic")));
        assert!(!holder_is_shared(INFO, Path::new("/dev/shm/vrnic")));
        assert!(!holder_is_shared(INFO, Path::new("/tmp/with space/vrnic")));
        // A component prefix, not a string prefix.
        assert!(holder_is_shared(INFO, Path::new("/dev/shmx/vrnic")));
    }

    #[test]
    fn a_mount_over_another_at_the_same_point_decides() {
        let info = format!("{INFO}40 32 0:40 / /run rw - tmpfs tmpfs rw\n");
        assert!(!holder_is_shared(&info, Path::new("/run/vrnic")));
    }

    #[test]
    fn mountinfo_escapes_are_undone() {
        assert_eq!(unescape("/a\\040b\\134c"), "/a b\\c");
        assert_eq!(unescape("/a\\04"), "/a\\04");
    }

    #[test]
    fn the_served_dir_comes_from_the_options_the_environment_or_roots_default() {
        let cwd = Some(Path::new("/home/u"));
        assert_eq!(
            served_dir(&["--state-dir", "/x", "serve"], None, Some(0), cwd),
            Some(PathBuf::from("/x"))
        );
        assert_eq!(
            served_dir(&["serve", "--state-dir=rel"], None, Some(1000), cwd),
            Some(PathBuf::from("/home/u/rel"))
        );
        assert_eq!(
            served_dir(
                &["serve"],
                Some("A=b\0VRNIC_STATE_DIR=/e\0"),
                Some(1000),
                cwd
            ),
            Some(PathBuf::from("/e"))
        );
        assert_eq!(
            served_dir(&["serve"], None, Some(0), cwd),
            Some(PathBuf::from("/run/vrnic"))
        );
        assert_eq!(served_dir(&["serve"], None, Some(1000), cwd), None);
    }

    #[test]
    fn this_test_process_is_no_unseen_daemon() {
        // Whatever runs here, nothing named `vrnic` is this test binary.
        assert!(
            unseen_daemons(Path::new("/nonexistent-vrnic-state"))
                .iter()
                .all(|d| d.pid != std::process::id())
        );
    }
}
