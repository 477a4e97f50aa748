//! The driver library's system calls: event fds, `poll`, `mincore`. Unsafe code lives here and
//! in `ffi`/`objects` (the C boundary), nowhere else.
#![allow(unsafe_code)]

use std::os::fd::RawFd;

/// An `eventfd` in semaphore mode: each `read` takes one event, `poll` says readable while any
/// is pending. Used for completion channels and the async event fd, which apps poll and read.
#[derive(Debug)]
pub struct EventFd {
    fd: RawFd,
    /// How many [`EventFd::take_nowait`] calls have set `O_NONBLOCK` on an fd the app left
    /// blocking (a [`EventFd::wait`] that meets it then polls instead of failing).
    lent: std::sync::atomic::AtomicU32,
    /// Serializes [`EventFd::take_nowait`]: two lenders would restore each other's flags.
    lending: std::sync::Mutex<()>,
}

impl EventFd {
    /// A new event fd (close-on-exec).
    pub fn new() -> std::io::Result<EventFd> {
        // SAFETY: eventfd has no memory preconditions.
        let fd = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC | libc::EFD_SEMAPHORE) };
        if fd < 0 {
            return Err(std::io::Error::last_os_error());
        }
        Ok(EventFd {
            fd,
            lent: std::sync::atomic::AtomicU32::new(0),
            lending: std::sync::Mutex::new(()),
        })
    }

    /// A new event fd numbered `min_fd` or above where the process's fd limit allows (else
    /// numbered as [`EventFd::new`] numbers it).
    pub fn new_above(min_fd: RawFd) -> std::io::Result<EventFd> {
        let mut e = EventFd::new()?;
        if e.fd < min_fd {
            // SAFETY: F_DUPFD_CLOEXEC on our own open fd has no memory preconditions.
            let high = unsafe { libc::fcntl(e.fd, libc::F_DUPFD_CLOEXEC, min_fd) };
            if high >= 0 {
                // SAFETY: we own the low fd and nothing else refers to it yet.
                unsafe { libc::close(e.fd) };
                e.fd = high;
            }
        }
        Ok(e)
    }

    /// The fd handed to the app.
    pub fn fd(&self) -> RawFd {
        self.fd
    }

    /// Adds one event.
    pub fn signal(&self) {
        let one: u64 = 1;
        // SAFETY: writes 8 bytes from a valid u64 to our fd.
        unsafe { libc::write(self.fd, (&one as *const u64).cast(), 8) };
    }

    /// Takes one event, blocking unless the app set `O_NONBLOCK` on the fd. Returns the errno on
    /// failure (`EAGAIN` when non-blocking and empty).
    pub fn wait(&self) -> Result<(), i32> {
        let mut v: u64 = 0;
        loop {
            // SAFETY: reads 8 bytes into a valid u64 from our fd.
            let r = unsafe { libc::read(self.fd, (&mut v as *mut u64).cast(), 8) };
            if r == 8 {
                return Ok(());
            }
            let e = errno();
            if e == libc::EAGAIN && self.lent.load(std::sync::atomic::Ordering::Acquire) > 0 {
                // The app's fd is blocking; `O_NONBLOCK` is only lent to `take_nowait`.
                poll_in(self.fd, 1);
                continue;
            }
            if e != libc::EINTR {
                return Err(e);
            }
        }
    }

    /// Takes up to `n` pending events without blocking: events withdrawn before the app read
    /// them (their object was destroyed), so that `poll` no longer reports them. If the app left
    /// the fd blocking, `O_NONBLOCK` is set for these reads only.
    pub fn take_nowait(&self, n: usize) {
        if n == 0 {
            return;
        }
        let _one_lender = self.lending.lock();
        // SAFETY: F_GETFL on our own fd has no memory preconditions.
        let flags = unsafe { libc::fcntl(self.fd, libc::F_GETFL) };
        if flags < 0 {
            return;
        }
        let lend = flags & libc::O_NONBLOCK == 0;
        if lend {
            self.lent.fetch_add(1, std::sync::atomic::Ordering::AcqRel);
            // SAFETY: F_SETFL on our own fd has no memory preconditions.
            unsafe { libc::fcntl(self.fd, libc::F_SETFL, flags | libc::O_NONBLOCK) };
        }
        let mut v: u64 = 0;
        for _ in 0..n {
            // SAFETY: reads 8 bytes into a valid u64 from our (now non-blocking) fd.
            let r = unsafe { libc::read(self.fd, (&mut v as *mut u64).cast(), 8) };
            if r != 8 {
                break;
            }
        }
        if lend {
            // SAFETY: as above; restores the app's flags.
            unsafe { libc::fcntl(self.fd, libc::F_SETFL, flags) };
            self.lent.fetch_sub(1, std::sync::atomic::Ordering::AcqRel);
        }
    }
}

impl EventFd {
    /// Whether the app set `O_NONBLOCK` on the fd (then [`wait`](Self::wait) never blocks).
    pub fn nonblocking(&self) -> bool {
        // SAFETY: F_GETFL on our own fd has no memory preconditions.
        let flags = unsafe { libc::fcntl(self.fd, libc::F_GETFL) };
        flags >= 0 && flags & libc::O_NONBLOCK != 0
    }
}

impl Drop for EventFd {
    fn drop(&mut self) {
        // SAFETY: we own the fd.
        unsafe { libc::close(self.fd) };
    }
}

/// Whether `fd` is an open file descriptor of this process (`fstat` takes it).
pub fn fd_is_open(fd: RawFd) -> bool {
    // SAFETY: all-zero is a valid stat.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: fstat writes only into st, and fails cleanly on a bad fd.
    unsafe { libc::fstat(fd, &mut st) == 0 }
}

/// The calling thread's errno.
pub fn errno() -> i32 {
    std::io::Error::last_os_error()
        .raw_os_error()
        .unwrap_or(libc::EIO)
}

/// Sets the calling thread's errno.
pub fn set_errno(e: i32) {
    // SAFETY: __errno_location has no preconditions.
    let slot = unsafe { libc::__errno_location() };
    // SAFETY: it returns this thread's errno slot, always valid and aligned.
    unsafe { slot.write(e) };
}

/// Waits until `fd` is readable or hung up, for at most `timeout_ms`. Returns `(readable, hup)`.
pub fn poll_in(fd: RawFd, timeout_ms: i32) -> (bool, bool) {
    let mut p = libc::pollfd {
        fd,
        events: libc::POLLIN,
        revents: 0,
    };
    // SAFETY: one valid pollfd.
    let r = unsafe { libc::poll(&mut p, 1, timeout_ms) };
    if r <= 0 {
        return (false, false);
    }
    (
        p.revents & libc::POLLIN != 0,
        p.revents & (libc::POLLHUP | libc::POLLERR | libc::POLLNVAL) != 0,
    )
}

/// For each page of a page-aligned range: whether it was never touched, so it reads as zeros
/// and a registration need not copy it. Only private anonymous memory has such pages: there is
/// no answer (copy everything) unless `/proc/self/maps` shows the whole range private,
/// anonymous and not file backed. A page counts as untouched when `/proc/self/pagemap` says it
/// is neither present nor swapped out.
///
/// Made in two steps: [`Untouched::open`] allocates what the answer needs, and
/// [`Untouched::page`] reads the page map into the value itself (which lives on the caller's
/// stack), so that it can run while the range is frozen (`vrnic_shm::freeze`): no allocation
/// may happen then, nor any write into the heap, whose pages may be the frozen ones.
#[derive(Debug)]
pub struct Untouched {
    addr: usize,
    pages: usize,
    pagemap: std::fs::File,
    /// Page map entries of pages `first..first + UNTOUCHED_CHUNK`, when `valid`.
    buf: [u64; UNTOUCHED_CHUNK],
    first: usize,
    valid: bool,
}

/// Page map entries read at a time.
const UNTOUCHED_CHUNK: usize = 256;

impl Untouched {
    /// Ready to answer for `addr..addr+len`, or `None` where the range is not all private
    /// anonymous memory (or `/proc` is unreadable).
    pub fn open(addr: usize, len: usize) -> Option<Untouched> {
        let page = 4096usize;
        let end = addr.checked_add(len)?;
        let maps = std::fs::read_to_string("/proc/self/maps").ok()?;
        // Private anonymous areas, merged where they touch, must cover the range.
        let mut covered = addr;
        for line in maps.lines() {
            let mut f = line.split_whitespace();
            let range = f.next()?;
            let perms = f.next()?;
            let (_offset, _dev, inode) = (f.next()?, f.next()?, f.next()?);
            let path = f.next().unwrap_or("");
            let (lo, hi) = range.split_once('-')?;
            let (lo, hi) = (
                usize::from_str_radix(lo, 16).ok()?,
                usize::from_str_radix(hi, 16).ok()?,
            );
            if hi <= covered || lo > covered {
                continue;
            }
            let anonymous = perms.ends_with('p')
                && inode == "0"
                && (path.is_empty() || path == "[heap]" || path == "[stack]");
            if !anonymous {
                return None;
            }
            covered = hi;
            if covered >= end {
                break;
            }
        }
        if covered < end {
            return None;
        }
        Some(Untouched {
            addr,
            pages: len / page,
            pagemap: std::fs::File::open("/proc/self/pagemap").ok()?,
            buf: [0; UNTOUCHED_CHUNK],
            first: 0,
            valid: false,
        })
    }

    /// Whether page `i` of the range is untouched now (false where the page map cannot be
    /// read). Reads the page map a chunk at a time into `self`; allocates nothing.
    pub fn page(&mut self, i: usize) -> bool {
        if i >= self.pages {
            return false;
        }
        if !self.valid || i < self.first || i >= self.first + UNTOUCHED_CHUNK {
            use std::os::unix::fs::FileExt;
            let n = (self.pages - i).min(UNTOUCHED_CHUNK);
            let bytes: &mut [u8] = bytemuck_u64(&mut self.buf[..n]);
            self.valid = self
                .pagemap
                .read_exact_at(bytes, ((self.addr / 4096 + i) * 8) as u64)
                .is_ok();
            self.first = i;
            if !self.valid {
                return false;
            }
        }
        // Bit 63: present; bit 62: swapped.
        self.buf[i - self.first] & (3 << 62) == 0
    }
}

/// `words` as their bytes (native order: the page map is in the machine's order).
fn bytemuck_u64(words: &mut [u64]) -> &mut [u8] {
    let len = std::mem::size_of_val(words);
    // SAFETY: u64 has no padding and every byte pattern is a valid u64; the slice covers
    // exactly the words' memory and borrows them mutably for its life.
    unsafe { std::slice::from_raw_parts_mut(words.as_mut_ptr().cast::<u8>(), len) }
}

/// Whether every page of `addr..addr+len` is mapped in this process (`mincore` fails with
/// `ENOMEM` on a hole), so a registration of unmapped memory fails with `EFAULT` instead of a
/// fault inside the driver.
pub fn range_mapped(addr: usize, len: usize) -> bool {
    let page = 4096usize;
    let start = addr / page * page;
    let Some(end) = addr.checked_add(len).map(|e| e.next_multiple_of(page)) else {
        return false;
    };
    let pages = (end - start) / page;
    let mut vec = vec![0u8; pages.min(1 << 20)];
    let mut at = start;
    while at < end {
        let n = ((end - at) / page).min(vec.len());
        // SAFETY: vec has room for n entries; mincore only reads the page tables.
        let r = unsafe { libc::mincore(at as *mut libc::c_void, n * page, vec.as_mut_ptr()) };
        if r != 0 {
            return false;
        }
        at += n * page;
    }
    true
}

/// `CLOCK_MONOTONIC` in nanoseconds: the clock the daemon stamps completions with.
pub fn monotonic_ns() -> u64 {
    let mut t = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes one timespec to a valid pointer.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut t) };
    (t.tv_sec as u64)
        .wrapping_mul(1_000_000_000)
        .wrapping_add(t.tv_nsec as u64)
}

/// Yields the CPU (to the engine thread, on a small machine).
pub fn yield_cpu() {
    // SAFETY: sched_yield has no preconditions.
    unsafe { libc::sched_yield() };
}
