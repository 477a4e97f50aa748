//! `vrnic run --container`: a command in its own mount, PID, UTS and (by default) network
//! namespaces, for hosts without a container engine — the isolation a Docker container gets
//! for its vRNIC (brief §3), and no way back out of it.
//!
//! The command gets a root of its own: a small tmpfs with the host's `/usr`, `/etc` and the
//! library dirs bound read-only, a minimal `/dev`, a fresh `/proc` of its PID namespace (the
//! kernel knobs in it read-only), empty `/run` and `/tmp`, the vRNIC's directory at the fixed
//! path the driver library looks at (`/run/vrnic-device`) and the driver library itself. The
//! old root is detached after `pivot_root`, so the daemon's state dir (every other vRNIC) is
//! not under a cover that could be lifted: it is not in the command's tree at all. Before the
//! command runs, every capability is dropped (bounding set included), `no_new_privs` is set,
//! and every inherited fd but stdin, stdout and stderr is closed: the command stays uid 0 but
//! can neither mount, nor gain privileges through a setuid binary, nor reach the daemon's
//! admin socket (the CLI keeps that connection to itself, holding the vRNIC while it waits).
//!
//! The first child is PID 1 of the new PID namespace: it builds the root, runs the command as
//! its child, reaps orphans and exits with the command's status; it dies with the CLI
//! (`PR_SET_PDEATHSIG`), which takes the whole namespace with it. Everything here runs between
//! `fork` and `exec` of a single-threaded CLI process, so it uses raw system calls only; the
//! unsafe blocks are confined to this module.

use std::ffi::CString;
use std::io;
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

/// The directory where a container's driver library finds its vRNIC (see the driver's
/// `CONTAINER_DEVICE_DIR`).
pub const DEVICE_MOUNT: &str = "/run/vrnic-device";
/// Where the driver library is inside the container.
pub const DRIVER_MOUNT: &str = "/run/vrnic-lib/libvrnic_shim.so";
/// Host directories bound read-only into the container's root (or recreated as the same
/// symbolic links, on merged-/usr systems), for the programs and their libraries.
const HOST_DIRS: [&str; 9] = [
    "usr", "etc", "bin", "sbin", "lib", "lib32", "lib64", "libx32", "opt",
];
/// Device nodes bound from the host's `/dev`.
const DEV_NODES: [&str; 6] = ["null", "zero", "full", "random", "urandom", "tty"];
/// Parts of `/proc` made read-only (kernel settings, the sysrq trigger), as Docker does.
const PROC_READONLY: [&str; 5] = ["sys", "sysrq-trigger", "irq", "bus", "fs"];
/// Parts of `/proc` hidden behind `/dev/null`.
const PROC_MASKED: [&str; 4] = ["kcore", "keys", "timer_list", "sched_debug"];
/// Where the new root is assembled, in the new mount namespace only (the host's `/tmp` is
/// covered there, never changed).
const STAGING: &str = "/tmp";

/// What to isolate.
#[derive(Debug, Clone, Copy)]
pub struct Isolation {
    /// Give the command its own network namespace (only a loopback interface, up).
    pub own_net: bool,
}

fn cstr(s: &[u8]) -> io::Result<CString> {
    CString::new(s).map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))
}

fn cpath(p: &Path) -> io::Result<CString> {
    cstr(p.as_os_str().as_bytes())
}

fn check(r: libc::c_int, what: &str) -> io::Result<()> {
    if r < 0 {
        let e = io::Error::last_os_error();
        return Err(io::Error::new(e.kind(), format!("{what}: {e}")));
    }
    Ok(())
}

fn mount(src: &str, dst: &Path, fstype: &str, flags: libc::c_ulong, data: &str) -> io::Result<()> {
    let (s, d, t, o) = (
        cstr(src.as_bytes())?,
        cpath(dst)?,
        cstr(fstype.as_bytes())?,
        cstr(data.as_bytes())?,
    );
    // SAFETY: all four are valid NUL-terminated strings that outlive the call.
    let r = unsafe { libc::mount(s.as_ptr(), d.as_ptr(), t.as_ptr(), flags, o.as_ptr().cast()) };
    check(r, &format!("mount {src} on {}", dst.display()))
}

/// Binds `src` (a path, or `/proc/self/fd/N`) on `dst`, read-only if asked. A read-only bind
/// takes a second, remounting call; `nosuid` and `nodev` always.
fn bind(src: &str, dst: &Path, readonly: bool) -> io::Result<()> {
    mount(src, dst, "", libc::MS_BIND | libc::MS_REC, "")?;
    if readonly {
        let flags =
            libc::MS_REMOUNT | libc::MS_BIND | libc::MS_RDONLY | libc::MS_NOSUID | libc::MS_NODEV;
        mount("none", dst, "", flags, "")?;
    }
    Ok(())
}

/// An `O_PATH` fd for `path` (the source of a bind mount that must not depend on what later
/// mounts cover).
fn open_path(path: &Path) -> io::Result<OwnedFd> {
    let f = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_PATH)
        .open(path)
        .map_err(|e| io::Error::new(e.kind(), format!("open {}: {e}", path.display())))?;
    Ok(f.into())
}

fn fd_path(fd: &OwnedFd) -> String {
    format!("/proc/self/fd/{}", fd.as_raw_fd())
}

/// Runs `argv` with the environment `env` isolated, with `vnic_dir` as its only vRNIC and `driver` as
/// its driver library (at [`DRIVER_MOUNT`]). Returns the command's exit status (128 + signal
/// if it was killed).
pub fn run(
    vnic_dir: &Path,
    driver: &Path,
    hostname: &str,
    iso: Isolation,
    view: Option<&crate::presence::DeviceView>,
    argv: &[String],
    env: &[(String, String)],
) -> io::Result<i32> {
    let mut flags = libc::CLONE_NEWNS | libc::CLONE_NEWPID | libc::CLONE_NEWUTS;
    if iso.own_net {
        flags |= libc::CLONE_NEWNET;
    }
    // SAFETY: unshare has no memory preconditions; the CLI is single-threaded here.
    check(unsafe { libc::unshare(flags) }, "unshare (needs root)")?;
    let argv_c: Vec<CString> = argv
        .iter()
        .map(|a| cstr(a.as_bytes()))
        .collect::<io::Result<_>>()?;
    let env_c: Vec<CString> = env
        .iter()
        .map(|(k, v)| cstr(format!("{k}={v}").as_bytes()))
        .collect::<io::Result<_>>()?;
    // The CLI holds the write end for as long as it lives: the child sees it gone by a hang-up
    // (in the new PID namespace getppid() says 0 whoever the parent is).
    let mut life = [0; 2];
    // SAFETY: pipe2 writes two fds into a valid array.
    let r = unsafe { libc::pipe2(life.as_mut_ptr(), libc::O_CLOEXEC) };
    check(r, "pipe")?;
    // SAFETY: fork in a single-threaded process; the child only makes system calls and execs.
    let pid = unsafe { libc::fork() };
    check(pid, "fork")?;
    if pid == 0 {
        let setup = Setup {
            vnic_dir,
            driver,
            hostname,
            iso,
            view,
        };
        // SAFETY: the child's copy of the write end, which it must not hold.
        unsafe { libc::close(life[1]) };
        let code = match init(life[0], &setup, &argv_c, &env_c) {
            Ok(code) => code,
            Err(e) => {
                eprintln!("vrnic: container set-up failed: {e}");
                127
            }
        };
        // SAFETY: leaves the child without running the parent's exit handlers.
        unsafe { libc::_exit(code) };
    }
    // SAFETY: the parent's copy of the read end.
    unsafe { libc::close(life[0]) };
    let r = wait_for(pid);
    // SAFETY: our write end, held until the container ended.
    unsafe { libc::close(life[1]) };
    r
}

struct Setup<'a> {
    vnic_dir: &'a Path,
    driver: &'a Path,
    hostname: &'a str,
    iso: Isolation,
    /// The vRNIC's device node and sysfs view to add (`presence`), if any.
    view: Option<&'a crate::presence::DeviceView>,
}

/// PID 1 of the new namespaces: the new root, hostname, loopback, privileges dropped, then the
/// command.
fn init(life: libc::c_int, s: &Setup<'_>, argv: &[CString], env: &[CString]) -> io::Result<i32> {
    // Die with the CLI (the vRNIC's holder), and with us the whole PID namespace.
    // SAFETY: prctl with integer arguments only.
    let r = unsafe { libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) };
    check(r, "prctl(PDEATHSIG)")?;
    let mut pfd = libc::pollfd {
        fd: life,
        events: libc::POLLIN,
        revents: 0,
    };
    // SAFETY: poll reads and writes one valid pollfd.
    if unsafe { libc::poll(&mut pfd, 1, 0) } != 0 {
        // The CLI died before the death signal was set: nothing holds the vRNIC for us.
        return Ok(137);
    }
    build_root(s, argv)?;
    // SAFETY: hostname points to `len` valid bytes.
    let r = unsafe { libc::sethostname(s.hostname.as_ptr().cast(), s.hostname.len()) };
    check(r, "sethostname")?;
    if s.iso.own_net {
        loopback_up()?;
    }
    drop_privileges()?;
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

/// Assembles the container's root on a tmpfs and pivots into it, detaching the host's tree.
fn build_root(s: &Setup<'_>, argv: &[CString]) -> io::Result<()> {
    // Nothing mounted here propagates back to the host.
    mount(
        "none",
        Path::new("/"),
        "",
        libc::MS_REC | libc::MS_PRIVATE,
        "",
    )?;
    // Sources opened before anything is covered (the state dir or the driver may live under
    // the staging dir), and in this mount namespace (a bind takes its source only from the
    // caller's own).
    let vnic = open_path(s.vnic_dir)?;
    let driver = open_path(s.driver)?;
    let program = program_path(argv)
        .map(|p| open_path(&p).map(|fd| (p, fd)))
        .transpose()?;
    let root = Path::new(STAGING);
    let tmpfs = libc::MS_NOSUID | libc::MS_NODEV;
    mount("tmpfs", root, "tmpfs", tmpfs, "mode=0755,size=4m")?;
    for d in HOST_DIRS {
        let host = Path::new("/").join(d);
        let Ok(meta) = std::fs::symlink_metadata(&host) else {
            continue;
        };
        let inside = root.join(d);
        if meta.file_type().is_symlink() {
            std::os::unix::fs::symlink(std::fs::read_link(&host)?, &inside)?;
        } else if meta.is_dir() {
            std::fs::create_dir(&inside)?;
            bind(&host.to_string_lossy(), &inside, true)?;
        }
    }
    let dev = root.join("dev");
    std::fs::create_dir(&dev)?;
    mount(
        "tmpfs",
        &dev,
        "tmpfs",
        libc::MS_NOSUID,
        "mode=0755,size=64k",
    )?;
    for n in DEV_NODES {
        let host = Path::new("/dev").join(n);
        if host.exists() {
            std::fs::File::create(dev.join(n))?;
            bind(&host.to_string_lossy(), &dev.join(n), false)?;
        }
    }
    for (link, to) in [
        ("fd", "/proc/self/fd"),
        ("stdin", "/proc/self/fd/0"),
        ("stdout", "/proc/self/fd/1"),
        ("stderr", "/proc/self/fd/2"),
    ] {
        std::os::unix::fs::symlink(to, dev.join(link))?;
    }
    if let Some(v) = s.view {
        crate::presence::add_node(&dev, v)?;
        // A /sys of its own holding only the vRNIC's class directory, read-only.
        let sys = root.join("sys");
        std::fs::create_dir(&sys)?;
        let flags = libc::MS_NOSUID | libc::MS_NODEV | libc::MS_NOEXEC;
        mount("sysfs-vrnic", &sys, "tmpfs", flags, "mode=0755,size=256k")?;
        crate::presence::write_sysfs(&sys.join("class"), v)?;
        mount(
            "none",
            &sys,
            "",
            libc::MS_REMOUNT | libc::MS_RDONLY | flags,
            "",
        )?;
    }
    std::fs::create_dir(dev.join("shm"))?;
    mount(
        "tmpfs",
        &dev.join("shm"),
        "tmpfs",
        tmpfs,
        "mode=1777,size=64m",
    )?;
    for d in ["tmp", "run"] {
        std::fs::create_dir(root.join(d))?;
        let mode = if d == "tmp" { "mode=1777" } else { "mode=0755" };
        mount("tmpfs", &root.join(d), "tmpfs", tmpfs, mode)?;
    }
    let device = root.join(DEVICE_MOUNT.trim_start_matches('/'));
    std::fs::create_dir_all(&device)?;
    bind(&fd_path(&vnic), &device, false)?;
    let lib = root.join(DRIVER_MOUNT.trim_start_matches('/'));
    std::fs::create_dir_all(lib.parent().unwrap_or(root))?;
    std::fs::File::create(&lib)?;
    bind(&fd_path(&driver), &lib, true)?;
    if let Some((path, fd)) = &program {
        // A program outside the bound dirs (a build tree, say) is bound at its own path.
        let inside = root.join(path.strip_prefix("/").unwrap_or(path));
        if !inside.exists() {
            std::fs::create_dir_all(inside.parent().unwrap_or(root))?;
            std::fs::File::create(&inside)?;
            bind(&fd_path(fd), &inside, true)?;
        }
    }
    std::fs::create_dir(root.join("proc"))?;
    drop((vnic, driver, program));
    // pivot_root(".", "."): the old root ends up under the new one, and is detached at once.
    std::env::set_current_dir(root)?;
    let dot = cstr(b".")?;
    // SAFETY: pivot_root with two valid NUL-terminated paths; no memory is involved.
    let r = unsafe { libc::syscall(libc::SYS_pivot_root, dot.as_ptr(), dot.as_ptr()) };
    check(r as libc::c_int, "pivot_root")?;
    // SAFETY: umount2 with a valid path.
    let r = unsafe { libc::umount2(dot.as_ptr(), libc::MNT_DETACH) };
    check(r, "detach the host's root")?;
    std::env::set_current_dir("/")?;
    // A /proc that shows this PID namespace, its kernel knobs read-only.
    let proc_flags = libc::MS_NOSUID | libc::MS_NODEV | libc::MS_NOEXEC;
    mount("proc", Path::new("/proc"), "proc", proc_flags, "")?;
    for p in PROC_READONLY {
        let p = Path::new("/proc").join(p);
        if p.exists() {
            bind(&p.to_string_lossy(), &p, true)?;
        }
    }
    for p in PROC_MASKED {
        let p = Path::new("/proc").join(p);
        if p.exists() {
            bind("/dev/null", &p, true)?;
        }
    }
    // The root itself (mount points, links) is read-only from now on.
    let ro = libc::MS_REMOUNT | libc::MS_BIND | libc::MS_RDONLY | tmpfs;
    mount("none", Path::new("/"), "", ro, "")
}

/// The program's file when `argv[0]` names one by path (no `PATH` search).
fn program_path(argv: &[CString]) -> Option<PathBuf> {
    let a = argv.first()?.to_bytes();
    if !a.contains(&b'/') {
        return None;
    }
    let p = Path::new(std::ffi::OsStr::from_bytes(a));
    std::fs::canonicalize(p).ok().filter(|p| p.is_file())
}

/// The Linux capability header and data for `capset(2)` (version 3: two 32-bit words each).
#[repr(C)]
struct CapHeader {
    version: u32,
    pid: libc::c_int,
}

#[repr(C)]
#[derive(Clone, Copy)]
struct CapData {
    effective: u32,
    permitted: u32,
    inheritable: u32,
}

const CAP_VERSION_3: u32 = 0x2008_0522;

/// Closes every inherited fd but 0, 1 and 2; drops every capability (bounding set, ambient,
/// effective, permitted, inheritable); sets `no_new_privs`.
fn drop_privileges() -> io::Result<()> {
    // SAFETY: close_range on fds of this process only; none of them backs a Rust object that
    // is used afterwards (the CLI's files are not touched in this child again).
    let r = unsafe { libc::close_range(3, libc::c_uint::MAX, 0) };
    check(r, "close inherited fds")?;
    for cap in 0..64 {
        // SAFETY: prctl with integer arguments; EINVAL past the last capability is ignored.
        unsafe { libc::prctl(libc::PR_CAPBSET_DROP, cap, 0, 0, 0) };
    }
    // SAFETY: prctl with integer arguments.
    let r = unsafe {
        libc::prctl(
            libc::PR_CAP_AMBIENT,
            libc::PR_CAP_AMBIENT_CLEAR_ALL,
            0,
            0,
            0,
        )
    };
    check(r, "clear ambient capabilities")?;
    // SAFETY: prctl with integer arguments.
    let r = unsafe { libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) };
    check(r, "set no_new_privs")?;
    let mut hdr = CapHeader {
        version: CAP_VERSION_3,
        pid: 0,
    };
    let data = [CapData {
        effective: 0,
        permitted: 0,
        inheritable: 0,
    }; 2];
    // SAFETY: capset reads one header and two data structs of the kernel's v3 layout.
    let r = unsafe { libc::syscall(libc::SYS_capset, &mut hdr, data.as_ptr()) };
    check(r as libc::c_int, "drop capabilities")
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cap_structs_have_the_kernel_layout() {
        // linux/capability.h: __user_cap_header_struct {u32 version; int pid;},
        // __user_cap_data_struct {u32 effective, permitted, inheritable;}.
        assert_eq!(std::mem::size_of::<CapHeader>(), 8);
        assert_eq!(std::mem::size_of::<CapData>(), 12);
    }
}
