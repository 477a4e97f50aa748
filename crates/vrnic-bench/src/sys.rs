//! The bench's system calls that std does not wrap: blocking the signals that end it and
//! waiting for one on a thread of its own, `kill(2)` on a process or a process group,
//! whether it runs as root, and pinning a thread to a core (the copy measurement). This is the bench's only unsafe code, one call per block.
//!
//! Children spawned through `std::process::Command` start with an empty signal mask (std
//! resets it before `exec`), so blocking signals here does not leak into the programs the
//! bench runs.

use std::io;
use std::mem::MaybeUninit;

/// The signals that end a bench run early: Ctrl-C, `kill`, a closed terminal.
const EXIT_SIGNALS: [i32; 3] = [libc::SIGINT, libc::SIGTERM, libc::SIGHUP];

/// A set of signals blocked in every thread of this process.
pub struct Blocked(libc::sigset_t);

/// Blocks SIGINT, SIGTERM and SIGHUP in the calling thread and in the threads it creates from
/// now on (call it before any other thread exists), so that only [`Blocked::wait`] takes them.
pub fn block_exit_signals() -> io::Result<Blocked> {
    let mut set = MaybeUninit::<libc::sigset_t>::uninit();
    // SAFETY: sigemptyset initialises the set it is given.
    if unsafe { libc::sigemptyset(set.as_mut_ptr()) } != 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: sigemptyset succeeded, so the set is initialised.
    let mut set = unsafe { set.assume_init() };
    for sig in EXIT_SIGNALS {
        // SAFETY: `set` is an initialised signal set and `sig` a valid signal number.
        if unsafe { libc::sigaddset(&mut set, sig) } != 0 {
            return Err(io::Error::last_os_error());
        }
    }
    // SAFETY: `set` is initialised; the old mask is not asked for (null).
    let r = unsafe { libc::pthread_sigmask(libc::SIG_BLOCK, &set, std::ptr::null_mut()) };
    if r != 0 {
        return Err(io::Error::from_raw_os_error(r));
    }
    Ok(Blocked(set))
}

impl Blocked {
    /// Waits until one of the blocked signals arrives and returns its number.
    pub fn wait(&self) -> i32 {
        loop {
            let mut sig = 0;
            // SAFETY: the set is initialised and `sig` is a valid place for the result.
            if unsafe { libc::sigwait(&self.0, &mut sig) } == 0 {
                return sig;
            }
        }
    }
}

/// Sends `sig` to the process `pid` (a positive pid; 0 and below are ignored).
pub fn kill(pid: i32, sig: i32) {
    if pid > 0 {
        // SAFETY: kill(2) has no memory preconditions.
        unsafe { libc::kill(pid, sig) };
    }
}

/// Sends `sig` to the process group `pgid` (a positive id; 0 and below are ignored).
pub fn kill_group(pgid: i32, sig: i32) {
    if pgid > 0 {
        // SAFETY: kill(2) on a negated id signals that process group; no memory is involved.
        unsafe { libc::kill(-pgid, sig) };
    }
}

/// Whether this process runs as root (network namespaces, the across-host rows).
pub fn is_root() -> bool {
    // SAFETY: geteuid has no preconditions.
    unsafe { libc::geteuid() == 0 }
}

/// Pins the calling thread to `core` (best effort: a core outside this process's set is
/// refused by the kernel and the thread stays where it was).
pub fn pin_thread(core: usize) {
    // SAFETY: an all-zero cpu_set_t is an empty set.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    if core < libc::CPU_SETSIZE as usize {
        // SAFETY: `core` is below CPU_SETSIZE, inside the set.
        unsafe { libc::CPU_SET(core, &mut set) };
    }
    // SAFETY: pid 0 is the calling thread; `set` is a valid cpu_set_t of the size given.
    unsafe { libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set) };
}
