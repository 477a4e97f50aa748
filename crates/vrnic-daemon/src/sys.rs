//! The daemon's few system calls that std does not wrap: the state-dir lock, the tmpfs mounts,
//! the signal fd, the open-file limit, the host's addresses. All unsafe code of the daemon lives
//! here.
#![allow(unsafe_code)]

use std::ffi::CString;
use std::fs::File;
use std::io::ErrorKind;
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::ffi::OsStrExt;
use std::path::Path;

use tracing::{info, warn};

/// The credentials at the other end of a Unix socket (`SO_PEERCRED`), if the kernel tells them.
fn ucred(fd: RawFd) -> Option<libc::ucred> {
    let mut c = libc::ucred {
        pid: 0,
        uid: 0,
        gid: 0,
    };
    let mut len = std::mem::size_of::<libc::ucred>() as libc::socklen_t;
    // SAFETY: getsockopt writes at most `len` bytes into our `ucred`, and `len` back.
    let r = unsafe {
        libc::getsockopt(
            fd,
            libc::SOL_SOCKET,
            libc::SO_PEERCRED,
            (&raw mut c).cast(),
            &raw mut len,
        )
    };
    (r == 0 && len as usize == std::mem::size_of::<libc::ucred>()).then_some(c)
}

/// The process and user at the other end of a Unix socket (`SO_PEERCRED`), as `pid N uid N`:
/// who asked, for the log of an operator's request.
pub fn peer_cred(fd: RawFd) -> String {
    ucred(fd).map_or_else(
        || "an unknown peer".into(),
        |c| format!("pid {} uid {}", c.pid, c.uid),
    )
}

/// The process id at the other end of a Unix socket (`SO_PEERCRED`), if the kernel tells it:
/// for the CLI, the daemon's.
pub fn peer_pid(fd: RawFd) -> Option<u32> {
    ucred(fd).and_then(|c| u32::try_from(c.pid).ok())
}

/// The user id at the other end of a Unix socket (`SO_PEERCRED`), if the kernel tells it: who
/// may do what on the admin socket.
pub fn peer_uid(fd: RawFd) -> Option<u32> {
    ucred(fd).map(|c| c.uid)
}

/// Sets the file-mode creation mask of the whole process: what the daemon creates (its admin
/// socket, each vRNIC's socket) is then closed to others until it opens it on purpose.
pub fn set_umask(mask: u32) {
    // SAFETY: umask has no preconditions and cannot fail.
    unsafe { libc::umask(mask as libc::mode_t) };
}

/// A group's id by its name (`getgrnam_r`, so through NSS as `id` sees it); `None` if there is
/// no such group.
pub fn group_id(name: &str) -> Option<u32> {
    let c = CString::new(name).ok()?;
    let mut buf = vec![0u8; 16 << 10];
    // SAFETY: an all-zero group is valid storage for getgrnam_r to fill.
    let mut grp: libc::group = unsafe { std::mem::zeroed() };
    let mut out: *mut libc::group = std::ptr::null_mut();
    // SAFETY: c is NUL-terminated; grp, buf (with its length) and out are valid for writes and
    // live for the call.
    let r = unsafe {
        libc::getgrnam_r(
            c.as_ptr(),
            &raw mut grp,
            buf.as_mut_ptr().cast(),
            buf.len(),
            &raw mut out,
        )
    };
    (r == 0 && !out.is_null()).then_some(grp.gr_gid)
}

/// A group's name by its id (`getgrgid_r`); `None` if it has none.
pub fn group_name(gid: u32) -> Option<String> {
    let mut buf = vec![0u8; 16 << 10];
    // SAFETY: an all-zero group is valid storage for getgrgid_r to fill.
    let mut grp: libc::group = unsafe { std::mem::zeroed() };
    let mut out: *mut libc::group = std::ptr::null_mut();
    // SAFETY: grp, buf (with its length) and out are valid for writes and live for the call.
    let r = unsafe {
        libc::getgrgid_r(
            gid,
            &raw mut grp,
            buf.as_mut_ptr().cast(),
            buf.len(),
            &raw mut out,
        )
    };
    if r != 0 || out.is_null() || grp.gr_name.is_null() {
        return None;
    }
    // SAFETY: on success gr_name points at a NUL-terminated string inside `buf`, alive here.
    let name = unsafe { std::ffi::CStr::from_ptr(grp.gr_name) };
    Some(name.to_string_lossy().into_owned())
}

/// Takes an exclusive, non-blocking `flock` on `path` (created if missing). The lock lives as
/// long as the returned file, and the kernel drops it if the daemon dies.
pub fn lock_exclusive(path: &Path) -> std::io::Result<File> {
    let f = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(path)?;
    // SAFETY: flock on a valid fd we own; no memory is involved.
    let r = unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) };
    if r != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(f)
}

const TMPFS_MAGIC: i64 = 0x0102_1994;
/// Marks a tmpfs the daemon mounted itself.
const MOUNT_MARKER: &str = ".vrnic-tmpfs";

/// Makes sure `dir` is on tmpfs, so region pages live in memory: if it is not and we are
/// root, mounts a tmpfs on it. Returns whether we mounted (and so must unmount).
pub fn ensure_tmpfs(dir: &Path) -> bool {
    let Ok(c) = CString::new(dir.as_os_str().as_bytes()) else {
        return false;
    };
    // SAFETY: an all-zero statfs is a valid out-parameter.
    let mut st: libc::statfs = unsafe { std::mem::zeroed() };
    // SAFETY: c is NUL-terminated, st is a valid out-pointer.
    if unsafe { libc::statfs(c.as_ptr(), &mut st) } == 0 && st.f_type as i64 == TMPFS_MAGIC {
        // A tmpfs that a daemon killed before its cleanup mounted: adopt it (and unmount it on
        // exit); any other tmpfs is not ours.
        return dir.join(MOUNT_MARKER).exists();
    }
    // Small: with per-vRNIC quota mounts (root), only directories and sockets live here.
    // Others may reach a vRNIC's directory by its name, never list the names (0711).
    match mount_tmpfs(dir, "mode=0711,size=64m") {
        Ok(()) => {
            info!(dir = %dir.display(), "mounted a tmpfs on the state dir");
            let _ = std::fs::write(dir.join(MOUNT_MARKER), b"mounted by vrnic serve\n");
            true
        }
        Err(e) => {
            warn!(
                dir = %dir.display(),
                "state dir is not on tmpfs and mounting one failed ({e}); regions live on disk"
            );
            false
        }
    }
}

/// Mounts a tmpfs of at most `bytes` (and a few inodes) on a vRNIC's directory: its tenant can
/// fill that and nothing else, so one vRNIC can neither exhaust the host's memory nor leave
/// another without pages (root only).
pub fn mount_quota(dir: &Path, bytes: u64) -> std::io::Result<()> {
    mount_tmpfs(dir, &format!("mode=0755,size={bytes},nr_inodes=64"))
}

fn mount_tmpfs(dir: &Path, opts: &str) -> std::io::Result<()> {
    let c = CString::new(dir.as_os_str().as_bytes()).map_err(|_| ErrorKind::InvalidInput)?;
    let opts = CString::new(opts).map_err(|_| ErrorKind::InvalidInput)?;
    let fstype = c"tmpfs";
    // SAFETY: all strings are NUL-terminated and live for the call.
    let r = unsafe {
        libc::mount(
            fstype.as_ptr(),
            c.as_ptr(),
            fstype.as_ptr(),
            libc::MS_NOSUID | libc::MS_NODEV,
            opts.as_ptr().cast(),
        )
    };
    if r != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// Unmounts the tmpfs mounted by [`ensure_tmpfs`].
pub fn unmount(dir: &Path) {
    if let Err(e) = detach(dir) {
        warn!("unmount {}: {e}", dir.display());
    }
}

/// Detaches whatever is mounted on `dir` (lazily: apps that still map a region keep its pages
/// until they exit).
pub fn detach(dir: &Path) -> std::io::Result<()> {
    let c = CString::new(dir.as_os_str().as_bytes()).map_err(|_| ErrorKind::InvalidInput)?;
    // SAFETY: c is NUL-terminated.
    if unsafe { libc::umount2(c.as_ptr(), libc::MNT_DETACH) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// SIGINT and SIGTERM, blocked and delivered as a readable fd to the event loop.
#[derive(Debug)]
pub struct SignalFd {
    fd: RawFd,
}

impl SignalFd {
    /// Blocks the signals in this thread (threads started later inherit it) and opens the fd.
    pub fn new() -> std::io::Result<SignalFd> {
        // SAFETY: an empty sigset_t is valid storage for sigemptyset.
        let mut set: libc::sigset_t = unsafe { std::mem::zeroed() };
        // SAFETY: set is valid storage.
        unsafe { libc::sigemptyset(&mut set) };
        // SAFETY: set is initialised.
        unsafe { libc::sigaddset(&mut set, libc::SIGINT) };
        // SAFETY: set is initialised.
        unsafe { libc::sigaddset(&mut set, libc::SIGTERM) };
        // SAFETY: set is initialised; a null old-set pointer is allowed.
        if unsafe { libc::pthread_sigmask(libc::SIG_BLOCK, &set, std::ptr::null_mut()) } != 0 {
            return Err(std::io::Error::last_os_error());
        }
        // SAFETY: set is initialised; -1 asks for a new fd.
        let fd = unsafe { libc::signalfd(-1, &set, libc::SFD_NONBLOCK | libc::SFD_CLOEXEC) };
        if fd < 0 {
            return Err(std::io::Error::last_os_error());
        }
        Ok(SignalFd { fd })
    }

    /// The fd to poll.
    pub fn fd(&self) -> RawFd {
        self.fd
    }
}

impl Drop for SignalFd {
    fn drop(&mut self) {
        // SAFETY: we own fd.
        unsafe { libc::close(self.fd) };
    }
}

/// Clears `FD_CLOEXEC` on a socket so an exec'd program inherits it. Returns the fd.
pub fn clear_cloexec(s: &std::os::unix::net::UnixStream) -> std::io::Result<i32> {
    let fd = s.as_raw_fd();
    // SAFETY: fcntl F_GETFD/F_SETFD on a valid fd we own; no memory is involved.
    let flags = unsafe { libc::fcntl(fd, libc::F_GETFD) };
    if flags < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: as above.
    if unsafe { libc::fcntl(fd, libc::F_SETFD, flags & !libc::FD_CLOEXEC) } < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(fd)
}

/// `CLOCK_MONOTONIC` in nanoseconds: the completion timestamp clock (the driver reports it as
/// a 1 GHz `hca_core_clock`, so apps see nanoseconds).
pub fn monotonic_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes one timespec into the valid one we pass.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    (ts.tv_sec as u64)
        .wrapping_mul(1_000_000_000)
        .wrapping_add(ts.tv_nsec as u64)
}

/// Raises the soft limit on open files to the hard limit: the daemon holds two sockets per
/// vRNIC and one per attached context, so a host with a thousand vRNICs needs more than the
/// usual soft limit of 1024. Returns the limit now in force.
pub fn raise_nofile_limit() -> u64 {
    let mut r = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes one rlimit into a valid out pointer.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut r) } != 0 {
        return 0;
    }
    if r.rlim_cur < r.rlim_max {
        let raised = libc::rlimit {
            rlim_cur: r.rlim_max,
            rlim_max: r.rlim_max,
        };
        // SAFETY: setrlimit reads one valid rlimit.
        if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &raised) } == 0 {
            return raised.rlim_cur;
        }
    }
    r.rlim_cur
}

/// This host's IP addresses (every interface's; loopback and link-local ones left out): the
/// addresses by which apps on other hosts reach rdma_cm listeners here.
pub fn host_addrs() -> Vec<std::net::IpAddr> {
    use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
    let mut head: *mut libc::ifaddrs = std::ptr::null_mut();
    // SAFETY: getifaddrs writes a list head to a valid pointer; freed below.
    if unsafe { libc::getifaddrs(&mut head) } != 0 {
        return Vec::new();
    }
    let mut out = Vec::new();
    let mut p = head;
    while !p.is_null() {
        // SAFETY: p is a node of the list getifaddrs made, not yet freed.
        let ifa = unsafe { &*p };
        p = ifa.ifa_next;
        if ifa.ifa_addr.is_null() {
            continue;
        }
        // SAFETY: ifa_addr points to a sockaddr whose family says which struct it is.
        let ip = match i32::from(unsafe { (*ifa.ifa_addr).sa_family }) {
            libc::AF_INET => {
                // SAFETY: AF_INET: a sockaddr_in.
                let a = unsafe { &*(ifa.ifa_addr as *const libc::sockaddr_in) };
                IpAddr::V4(Ipv4Addr::from(u32::from_be(a.sin_addr.s_addr)))
            }
            libc::AF_INET6 => {
                // SAFETY: AF_INET6: a sockaddr_in6.
                let a = unsafe { &*(ifa.ifa_addr as *const libc::sockaddr_in6) };
                IpAddr::V6(Ipv6Addr::from(a.sin6_addr.s6_addr))
            }
            _ => continue,
        };
        let link_local = match ip {
            IpAddr::V4(v) => v.is_link_local(),
            IpAddr::V6(v) => v.is_unicast_link_local(),
        };
        if !ip.is_loopback() && !ip.is_unspecified() && !link_local && !out.contains(&ip) {
            out.push(ip);
        }
    }
    // SAFETY: head came from getifaddrs and is freed once.
    unsafe { libc::freeifaddrs(head) };
    out
}

/// Most pieces one [`writev`] or [`readv`] takes.
pub const WRITEV_MAX: usize = 64;

/// `writev` of `(address, length)` pieces (at most [`WRITEV_MAX`]; more are left out) to
/// `fd`: bytes written, or the error (`EFAULT` when a piece lies in a region its tenant
/// truncated).
///
/// # Safety
/// Every piece must be readable memory of this process for the duration of the call: a live
/// buffer of the caller's, or a range of a region mapping the caller keeps mapped.
pub unsafe fn writev(fd: std::os::fd::RawFd, pieces: &[(usize, usize)]) -> std::io::Result<usize> {
    let (iov, n) = iovecs(pieces);
    // SAFETY: iov holds n valid entries; the kernel only reads the memory they name, which the
    // caller guarantees is mapped (a hole is reported as EFAULT).
    let w = unsafe { libc::writev(fd, iov.as_ptr(), n as libc::c_int) };
    byte_count(w)
}

/// `readv` from `fd` into `(address, length)` pieces (at most [`WRITEV_MAX`]; more are left
/// out), filled in order: bytes read (0 at the end of the stream), or the error (`EFAULT` when a
/// piece lies in a region its tenant truncated; bytes before it may have landed).
///
/// # Safety
/// Every piece must be writable memory of this process for the duration of the call that no
/// reference of the caller's points into: a buffer of the caller's it lends to the call, or a
/// range of a region mapping the caller keeps mapped.
pub unsafe fn readv(fd: std::os::fd::RawFd, pieces: &[(usize, usize)]) -> std::io::Result<usize> {
    let (iov, n) = iovecs(pieces);
    // SAFETY: iov holds n valid entries; the kernel writes only the memory they name, which
    // the caller guarantees is mapped, writable and not referenced (a hole is reported as
    // EFAULT).
    let r = unsafe { libc::readv(fd, iov.as_ptr(), n as libc::c_int) };
    byte_count(r)
}

/// Extends the daemon's mapping of `region` over its first `end` bytes (`Region::grow`; the
/// mapping may move). `false` if the address space has no room. `_grow`: leave that only the
/// locks of every shard serving the region's vRNIC give (`server::pages::cover` checks that
/// it is the region's vRNIC's).
pub(crate) fn grow_region(
    _grow: crate::server::Grow<'_>,
    region: &vrnic_shm::Region,
    end: u64,
) -> bool {
    // SAFETY: the daemon keeps no address or reference from a region across a request: every
    // access computes its address from an offset when it is made (copies, rings, atomics, and
    // the iovecs of a link's readv/writev at the call), and the loop calls this between
    // accesses, from the control path, with `_grow`, which only a lock of every shard that
    // serves the region gives, so no engine thread is in a pass over it either.
    unsafe { region.grow(end) }.is_ok()
}

/// The first [`WRITEV_MAX`] pieces as iovecs, and how many there are.
fn iovecs(pieces: &[(usize, usize)]) -> ([libc::iovec; WRITEV_MAX], usize) {
    let mut iov = [libc::iovec {
        iov_base: std::ptr::null_mut(),
        iov_len: 0,
    }; WRITEV_MAX];
    for (v, &(addr, len)) in iov.iter_mut().zip(pieces) {
        v.iov_base = addr as *mut libc::c_void;
        v.iov_len = len;
    }
    (iov, pieces.len().min(WRITEV_MAX))
}

/// A vectored call's result: bytes, or the error it left in errno.
fn byte_count(r: isize) -> std::io::Result<usize> {
    if r < 0 {
        Err(std::io::Error::last_os_error())
    } else {
        Ok(r as usize)
    }
}
