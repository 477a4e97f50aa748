//! `vrnic run --container`: a command in its own mount, PID, UTS and (by default) network
//! namespaces, for hosts without a container engine — the same isolation a Docker container
//! gets for its vRNIC (brief §3).
//!
//! Inside, the vRNIC's directory is bind-mounted at the fixed path the driver library looks
//! at (`/run/vrnic-device`); `/run` and the daemon's state dir are covered with empty tmpfs, so
//! no other vRNIC's region or socket can be seen or opened. The first child is PID 1 of the new
//! PID namespace: it sets the mounts up, runs the command as its child, reaps orphans, and
//! exits with the command's status.
//!
//! Everything here runs between `fork` and `exec` of a single-threaded CLI process, so it uses
//! raw system calls only; the unsafe blocks are confined to this module.

use std::ffi::CString;
use std::io;
use std::os::fd::{AsRawFd, OwnedFd};
use std::path::Path;

/// The directory where a container's driver library finds its vRNIC (see the driver's
/// `CONTAINER_DEVICE_DIR`).
pub const DEVICE_MOUNT: &str = "/run/vrnic-device";

/// What to isolate.
#[derive(Debug, Clone, Copy)]
pub struct Isolation {
    /// Give the command its own network namespace (only a loopback interface, up).
    pub own_net: bool,
}

fn cstr(s: &str) -> io::Result<CString> {
    CString::new(s).map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))
}

fn check(r: libc::c_int, what: &str) -> io::Result<()> {
    if r < 0 {
        let e = io::Error::last_os_error();
        return Err(io::Error::new(e.kind(), format!("{what}: {e}")));
    }
    Ok(())
}

fn mount(src: &str, dst: &str, fstype: &str, flags: libc::c_ulong, data: &str) -> io::Result<()> {
    let (s, d, t, o) = (cstr(src)?, cstr(dst)?, cstr(fstype)?, cstr(data)?);
    // SAFETY: all four are valid NUL-terminated strings that outlive the call.
    let r = unsafe { libc::mount(s.as_ptr(), d.as_ptr(), t.as_ptr(), flags, o.as_ptr().cast()) };
    check(r, &format!("mount {src} on {dst}"))
}

/// Runs `argv` (with `env` added) isolated, with `vnic_dir` as its only vRNIC. Returns the
/// command's exit status (128 + signal if it was killed).
pub fn run(
    vnic_dir: &Path,
    state_dir: &Path,
    hostname: &str,
    iso: Isolation,
    argv: &[String],
    env: &[(String, String)],
) -> io::Result<i32> {
    let mut flags = libc::CLONE_NEWNS | libc::CLONE_NEWPID | libc::CLONE_NEWUTS;
    if iso.own_net {
        flags |= libc::CLONE_NEWNET;
    }
    // SAFETY: unshare has no memory preconditions; the CLI is single-threaded here.
    check(unsafe { libc::unshare(flags) }, "unshare (needs root)")?;
    let argv_c: Vec<CString> = argv.iter().map(|a| cstr(a)).collect::<io::Result<_>>()?;
    let env_c: Vec<CString> = std::env::vars()
        .filter(|(k, _)| !env.iter().any(|(ek, _)| ek == k))
        .chain(env.iter().cloned())
        .map(|(k, v)| cstr(&format!("{k}={v}")))
        .collect::<io::Result<_>>()?;
    // SAFETY: fork in a single-threaded process; the child only makes system calls and execs.
    let pid = unsafe { libc::fork() };
    check(pid, "fork")?;
    if pid == 0 {
        let code = match init(vnic_dir, state_dir, hostname, iso, &argv_c, &env_c) {
            Ok(code) => code,
            Err(e) => {
                eprintln!("vrnic: container set-up failed: {e}");
                127
            }
        };
        // SAFETY: leaves the child without running the parent's exit handlers.
        unsafe { libc::_exit(code) };
    }
    wait_for(pid)
}

/// PID 1 of the new namespaces: mounts, hostname, loopback, then the command.
fn init(
    vnic_dir: &Path,
    state_dir: &Path,
    hostname: &str,
    iso: Isolation,
    argv: &[CString],
    env: &[CString],
) -> io::Result<i32> {
    // Nothing mounted here propagates back to the host.
    mount("none", "/", "", libc::MS_REC | libc::MS_PRIVATE, "")?;
    // Held open across the mounts: the source of the bind mount even once `/run` (where the
    // state dir usually lives) is covered. Opened here, in the new mount namespace, since a
    // bind mount takes its source only from the caller's own namespace.
    let dir: OwnedFd = std::fs::File::open(vnic_dir)?.into();
    let fd_path = format!("/proc/self/fd/{}", dir.as_raw_fd());
    // Cover the daemon's state dir (every vRNIC) and /run, then bring back just this one.
    if let Some(sd) = state_dir.to_str()
        && Path::new(sd).is_dir()
    {
        mount(
            "tmpfs",
            sd,
            "tmpfs",
            libc::MS_NOSUID | libc::MS_NODEV,
            "mode=0755",
        )?;
    }
    mount(
        "tmpfs",
        "/run",
        "tmpfs",
        libc::MS_NOSUID | libc::MS_NODEV,
        "mode=0755",
    )?;
    std::fs::create_dir_all(DEVICE_MOUNT)?;
    mount(&fd_path, DEVICE_MOUNT, "", libc::MS_BIND, "")?;
    // A /proc that shows this PID namespace.
    mount(
        "proc",
        "/proc",
        "proc",
        libc::MS_NOSUID | libc::MS_NODEV | libc::MS_NOEXEC,
        "",
    )?;
    // SAFETY: hostname points to `len` valid bytes.
    let r = unsafe { libc::sethostname(hostname.as_ptr().cast(), hostname.len()) };
    check(r, "sethostname")?;
    if iso.own_net {
        loopback_up()?;
    }
    // SAFETY: fork from this (single-threaded) init process.
    let child = unsafe { libc::fork() };
    check(child, "fork")?;
    if child == 0 {
        let mut argv_p: Vec<*const libc::c_char> = argv.iter().map(|a| a.as_ptr()).collect();
        argv_p.push(std::ptr::null());
        let mut env_p: Vec<*const libc::c_char> = env.iter().map(|a| a.as_ptr()).collect();
        env_p.push(std::ptr::null());
        // SAFETY: both arrays are NULL-terminated and point to live CStrings.
        unsafe { libc::execvpe(argv_p[0], argv_p.as_ptr(), env_p.as_ptr()) };
        eprintln!(
            "vrnic: cannot run {}: {}",
            argv[0].to_string_lossy(),
            io::Error::last_os_error()
        );
        // SAFETY: exec failed; leave the child at once.
        unsafe { libc::_exit(127) };
    }
    // As init: reap every orphan until the command itself ends.
    loop {
        let mut status = 0;
        // SAFETY: status is a valid out pointer.
        let p = unsafe { libc::waitpid(-1, &mut status, 0) };
        if p < 0 {
            let e = io::Error::last_os_error();
            if e.raw_os_error() == Some(libc::EINTR) {
                continue;
            }
            return Err(e);
        }
        if p == child {
            return Ok(exit_code(status));
        }
    }
}

/// Brings the new network namespace's loopback interface up.
fn loopback_up() -> io::Result<()> {
    // SAFETY: socket has no memory preconditions.
    let s = unsafe { libc::socket(libc::AF_INET, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0) };
    check(s, "socket")?;
    // SAFETY: ifreq is plain C data; all-zero is valid.
    let mut req: libc::ifreq = unsafe { std::mem::zeroed() };
    for (d, b) in req.ifr_name.iter_mut().zip(b"lo\0") {
        *d = *b as libc::c_char;
    }
    req.ifr_ifru.ifru_flags = (libc::IFF_UP | libc::IFF_RUNNING) as libc::c_short;
    // SAFETY: SIOCSIFFLAGS reads a valid ifreq.
    let r = unsafe { libc::ioctl(s, libc::SIOCSIFFLAGS, &req) };
    // SAFETY: s is our socket.
    unsafe { libc::close(s) };
    check(r, "bring up lo")
}

fn wait_for(pid: libc::pid_t) -> io::Result<i32> {
    loop {
        let mut status = 0;
        // SAFETY: status is a valid out pointer.
        let p = unsafe { libc::waitpid(pid, &mut status, 0) };
        if p == pid {
            return Ok(exit_code(status));
        }
        let e = io::Error::last_os_error();
        if e.raw_os_error() != Some(libc::EINTR) {
            return Err(e);
        }
    }
}

fn exit_code(status: libc::c_int) -> i32 {
    if libc::WIFEXITED(status) {
        libc::WEXITSTATUS(status)
    } else if libc::WIFSIGNALED(status) {
        128 + libc::WTERMSIG(status)
    } else {
        1
    }
}
