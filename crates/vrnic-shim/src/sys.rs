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
        let private = match vmas(addr as u64, end as u64, true) {
            Some(areas) => covered_by_private_anonymous(&areas, addr as u64, end as u64),
            None => private_anonymous_in_text(addr, end)?,
        };
        if !private {
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

/// Whether `areas` (in address order) cover `lo..hi` without a gap, each of them private
/// anonymous memory: not shared, not backed by a file, and plain or the heap or a stack (not
/// `[vdso]` nor a named anonymous area).
fn covered_by_private_anonymous(areas: &[Vma], lo: u64, hi: u64) -> bool {
    let mut covered = lo;
    for a in areas {
        if a.hi <= covered {
            continue;
        }
        if a.lo > covered || a.shared || a.file_backed || !a.plain {
            return false;
        }
        covered = a.hi;
        if covered >= hi {
            return true;
        }
    }
    covered >= hi
}

/// [`covered_by_private_anonymous`] from the text of `/proc/self/maps`, for kernels without
/// `PROCMAP_QUERY`: `None` where it cannot be read.
fn private_anonymous_in_text(addr: usize, end: usize) -> Option<bool> {
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
            return Some(false);
        }
        covered = hi;
        if covered >= end {
            break;
        }
    }
    Some(covered >= end)
}

/// One memory area of this process, as `PROCMAP_QUERY` describes it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Vma {
    /// First address.
    pub lo: u64,
    /// One past the last address.
    pub hi: u64,
    /// File offset mapped at `lo`.
    pub off: u64,
    pub readable: bool,
    pub shared: bool,
    /// Backed by a file (or by shared anonymous memory, which is a file of tmpfs).
    pub file_backed: bool,
    /// The file's device (major, minor) and inode (0 for anonymous memory).
    pub dev: (u32, u32),
    pub ino: u64,
    /// Unnamed, or named `[heap]` or `[stack]`: plain memory, not `[vdso]`, `[vvar]` or an
    /// area named with `PR_SET_VMA_ANON_NAME`.
    pub plain: bool,
}

/// `struct procmap_query` of `<linux/fs.h>` (Linux 6.11).
#[repr(C)]
#[derive(Debug, Default)]
struct ProcmapQuery {
    size: u64,
    query_flags: u64,
    query_addr: u64,
    vma_start: u64,
    vma_end: u64,
    vma_flags: u64,
    vma_page_size: u64,
    vma_offset: u64,
    inode: u64,
    dev_major: u32,
    dev_minor: u32,
    vma_name_size: u32,
    build_id_size: u32,
    vma_name_addr: u64,
    build_id_addr: u64,
}
const _: () = assert!(std::mem::size_of::<ProcmapQuery>() == 104);

/// `_IOWR('f', 17, struct procmap_query)`.
const PROCMAP_QUERY: libc::c_ulong = (3 << 30) | (104 << 16) | ((b'f' as libc::c_ulong) << 8) | 17;
const PROCMAP_QUERY_VMA_READABLE: u64 = 0x01;
const PROCMAP_QUERY_VMA_SHARED: u64 = 0x08;
const PROCMAP_QUERY_COVERING_OR_NEXT_VMA: u64 = 0x10;

/// Longest area name asked for: `[heap]` and `[stack]` are what [`Vma::plain`] needs.
const VMA_NAME_MAX: usize = 16;

/// The kernel has no `PROCMAP_QUERY` (before Linux 6.11): read `/proc/self/maps` as text.
#[derive(Debug)]
struct Unsupported;

/// The area covering `addr`, or else the next one above it (`None`: none), asked of `maps`
/// (this process's `/proc/self/maps`, open) by one `ioctl` (two where `names` is asked and the
/// area's name is a long one): the kernel looks the address up in its tree of areas, where
/// reading the file as text formats every area of the process (some hundreds in an MPI rank,
/// and each registered buffer adds its own). Without `names`, [`Vma::plain`] is false.
fn vma_at(maps: &std::fs::File, addr: u64, names: bool) -> Result<Option<Vma>, Unsupported> {
    use std::os::fd::AsRawFd;
    let mut name = [0u8; VMA_NAME_MAX];
    let mut ask_name = names;
    loop {
        let mut q = ProcmapQuery {
            size: std::mem::size_of::<ProcmapQuery>() as u64,
            query_flags: PROCMAP_QUERY_COVERING_OR_NEXT_VMA,
            query_addr: addr,
            ..ProcmapQuery::default()
        };
        if ask_name {
            q.vma_name_size = VMA_NAME_MAX as u32;
            q.vma_name_addr = name.as_mut_ptr() as u64;
        }
        // SAFETY: PROCMAP_QUERY reads and writes one `procmap_query` through the pointer, which
        // is valid and sized in its `size` field, and writes at most `vma_name_size` bytes to
        // `vma_name_addr`, the local buffer of that size (or nothing when the size is 0).
        let r = unsafe { libc::ioctl(maps.as_raw_fd(), PROCMAP_QUERY, &mut q) };
        if r < 0 {
            match std::io::Error::last_os_error().raw_os_error() {
                Some(libc::ENOENT) => return Ok(None),
                // A longer name than the plain ones: ask again without it.
                Some(libc::ENAMETOOLONG) if ask_name => {
                    ask_name = false;
                    continue;
                }
                _ => return Err(Unsupported),
            }
        }
        let named = if ask_name {
            let n = (q.vma_name_size as usize).min(VMA_NAME_MAX);
            let s = &name[..n];
            let s = s.split(|&b| b == 0).next().unwrap_or(&[]);
            Some(s.to_vec())
        } else {
            None
        };
        let plain = matches!(named.as_deref(), Some(b"" | b"[heap]" | b"[stack]"));
        return Ok(Some(Vma {
            lo: q.vma_start,
            hi: q.vma_end,
            off: q.vma_offset,
            readable: q.vma_flags & PROCMAP_QUERY_VMA_READABLE != 0,
            shared: q.vma_flags & PROCMAP_QUERY_VMA_SHARED != 0,
            file_backed: q.inode != 0 || q.dev_major != 0 || q.dev_minor != 0,
            dev: (q.dev_major, q.dev_minor),
            ino: q.inode,
            plain,
        }));
    }
}

/// The areas of this process that overlap `lo..hi`, in address order, one `PROCMAP_QUERY` each
/// (with their names where `names`: [`Vma::plain`]); `None` where the kernel cannot answer that
/// way (the caller reads `/proc/self/maps` as text).
pub fn vmas(lo: u64, hi: u64, names: bool) -> Option<Vec<Vma>> {
    let maps = std::fs::File::open("/proc/self/maps").ok()?;
    let mut out = Vec::new();
    let mut at = lo;
    while at < hi {
        match vma_at(&maps, at, names) {
            Ok(Some(v)) if v.lo < hi && v.hi > at => {
                at = v.hi;
                out.push(v);
            }
            Ok(_) => break,
            Err(Unsupported) => return None,
        }
    }
    Some(out)
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

#[cfg(test)]
mod tests {
    use super::*;

    fn area(lo: u64, hi: u64) -> Vma {
        Vma {
            lo,
            hi,
            off: 0,
            readable: true,
            shared: false,
            file_backed: false,
            dev: (0, 0),
            ino: 0,
            plain: true,
        }
    }

    #[test]
    fn private_anonymous_cover_needs_touching_plain_private_areas() {
        let two = [area(0x1000, 0x3000), area(0x3000, 0x8000)];
        assert!(covered_by_private_anonymous(&two, 0x2000, 0x7000));
        let gap = [area(0x1000, 0x3000), area(0x4000, 0x8000)];
        assert!(!covered_by_private_anonymous(&gap, 0x2000, 0x7000));
        let short = [area(0x1000, 0x3000)];
        assert!(!covered_by_private_anonymous(&short, 0x2000, 0x7000));
        for odd in [
            Vma {
                shared: true,
                ..area(0x3000, 0x8000)
            },
            Vma {
                file_backed: true,
                ..area(0x3000, 0x8000)
            },
            Vma {
                plain: false,
                ..area(0x3000, 0x8000)
            },
        ] {
            assert!(!covered_by_private_anonymous(
                &[area(0x1000, 0x3000), odd],
                0x2000,
                0x7000
            ));
        }
    }

    #[test]
    fn procmap_query_agrees_with_the_text_of_proc_self_maps() {
        let len = 16 * 4096;
        // SAFETY: a fresh private anonymous mapping of our own, unmapped below.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        assert_ne!(p, libc::MAP_FAILED);
        let (lo, hi) = (p as u64, p as u64 + len as u64);
        // Kernels before 6.11 have no PROCMAP_QUERY: then only the text answers.
        if let Some(areas) = vmas(lo, hi, true) {
            assert!(covered_by_private_anonymous(&areas, lo, hi), "{areas:?}");
            let code = vmas_of_this_function();
            assert!(code.file_backed && !code.plain && !code.shared, "{code:?}");
        }
        assert_eq!(
            private_anonymous_in_text(lo as usize, hi as usize),
            Some(true)
        );
        // SAFETY: the mapping made above, unused from here on.
        unsafe { libc::munmap(p, len) };
    }

    /// The area holding this library's code (a file mapping), where the kernel answers.
    fn vmas_of_this_function() -> Vma {
        let at = vmas_of_this_function as *const () as usize as u64;
        vmas(at, at + 1, true).expect("PROCMAP_QUERY answered a moment ago")[0]
    }
}
