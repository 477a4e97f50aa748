//! Holding a range of this process's memory still while the driver moves it between private
//! pages and region pages. Registering memory copies the app's bytes into region pages and maps
//! those over the buffer; a write another thread makes to those pages between the copy and the
//! remap would be lost, and a buffer's first and last pages are shared with whatever else lies
//! there (heap metadata, another object, a counter). [`Freeze`] write-protects the range with
//! userfaultfd for that moment: a writer in any thread waits in the kernel and, once the guard
//! drops, retries its write, which then lands on the new pages.
//!
//! Where userfaultfd is unavailable (a seccomp profile refuses it, as Docker's default does
//! without `CAP_SYS_PTRACE`, or an older kernel lacks write protection) the guard holds
//! nothing and the move is as narrow as the copy and one `mmap`; the driver's own threads keep
//! out of it by a lock of their own.
#![allow(unsafe_code)]

use std::sync::atomic::{AtomicU64, Ordering};

/// Mirrors of `<linux/userfaultfd.h>`, layout-tested against the installed header (the driver
/// library's `tests/layout.rs`).
#[allow(non_camel_case_types)]
pub mod uffd {
    /// `struct uffdio_api`.
    #[repr(C)]
    #[derive(Debug, Default, Clone, Copy)]
    pub struct uffdio_api {
        /// `UFFD_API`.
        pub api: u64,
        /// Features asked for; the kernel answers with those it has.
        pub features: u64,
        /// The ioctls the kernel offers.
        pub ioctls: u64,
    }

    /// `struct uffdio_range`.
    #[repr(C)]
    #[derive(Debug, Default, Clone, Copy)]
    pub struct uffdio_range {
        /// Start address.
        pub start: u64,
        /// Length in bytes.
        pub len: u64,
    }

    /// `struct uffdio_register`.
    #[repr(C)]
    #[derive(Debug, Default, Clone, Copy)]
    pub struct uffdio_register {
        /// The range.
        pub range: uffdio_range,
        /// `UFFDIO_REGISTER_MODE_*`.
        pub mode: u64,
        /// The ioctls offered for the range (the kernel's answer).
        pub ioctls: u64,
    }

    /// `struct uffdio_writeprotect`.
    #[repr(C)]
    #[derive(Debug, Default, Clone, Copy)]
    pub struct uffdio_writeprotect {
        /// The range.
        pub range: uffdio_range,
        /// `UFFDIO_WRITEPROTECT_MODE_*`.
        pub mode: u64,
    }

    /// `UFFD_API`.
    pub const UFFD_API: u64 = 0xAA;
    /// `UFFD_USER_MODE_ONLY`: a flag of `userfaultfd(2)` that needs no privilege.
    pub const UFFD_USER_MODE_ONLY: i32 = 1;
    /// `UFFD_FEATURE_WP_HUGETLBFS_SHMEM`: write protection of shared memory (a region page).
    pub const UFFD_FEATURE_WP_HUGETLBFS_SHMEM: u64 = 1 << 12;
    /// `UFFDIO_REGISTER_MODE_WP`.
    pub const UFFDIO_REGISTER_MODE_WP: u64 = 1 << 1;
    /// `UFFDIO_WRITEPROTECT_MODE_WP`.
    pub const UFFDIO_WRITEPROTECT_MODE_WP: u64 = 1 << 0;

    const fn iowr(nr: u64, size: usize) -> u64 {
        (3 << 30) | ((size as u64) << 16) | (0xAA << 8) | nr
    }
    /// `UFFDIO_API`.
    pub const UFFDIO_API: u64 = iowr(0x3F, size_of::<uffdio_api>());
    /// `UFFDIO_REGISTER`.
    pub const UFFDIO_REGISTER: u64 = iowr(0x00, size_of::<uffdio_register>());
    /// `UFFDIO_WRITEPROTECT`.
    pub const UFFDIO_WRITEPROTECT: u64 = iowr(0x06, size_of::<uffdio_writeprotect>());
}

use uffd::*;

/// The optional features this kernel offers that a freeze asks for, learnt once; `u64::MAX`
/// until then.
static FEATURES: AtomicU64 = AtomicU64::new(u64::MAX);
/// Features a freeze would like: shared region pages. Not `UFFD_FEATURE_WP_UNPOPULATED`
/// (Linux 6.4): protecting pages never touched costs a page-table entry each, 700 ms for a
/// fresh 1 GiB registration against 2.5 ms; such a page is not protected, so a caller reads
/// the pages that must be (which maps the zero page, protected like any other).
const WANTED: u64 = UFFD_FEATURE_WP_HUGETLBFS_SHMEM;

/// A write-protected range of this process's memory, as long as it lives (see the module
/// docs). Signals are blocked in the freezing thread meanwhile, so that no handler of it
/// writes into the range and waits on itself.
#[derive(Debug)]
pub struct Freeze {
    fd: i32,
    start: u64,
    len: u64,
    mask: libc::sigset_t,
}

impl Freeze {
    /// Write-protects `addr..addr+len` (page aligned) against every thread of the process; a
    /// guard that holds nothing where the kernel does not allow it (see [`Freeze::holds`]).
    /// Pages never touched (no page-table entry) are not protected.
    ///
    /// # Safety
    /// Until the guard drops, the calling thread must not write into the range, directly or
    /// through the allocator (it would wait for ever on itself): no heap allocation or free
    /// that may touch it. A range near the caller's stack is refused for that reason.
    pub unsafe fn new(addr: usize, len: usize) -> Freeze {
        let mask = block_signals();
        let mut f = Freeze {
            fd: -1,
            start: addr as u64,
            len: len as u64,
            mask,
        };
        let here = &f as *const Freeze as usize;
        // Our stack lies below `here` and (for the frames calling us) a little above it.
        if len == 0 || addr.abs_diff(here) < 16 << 20 || (addr + len).abs_diff(here) < 16 << 20 {
            return f;
        }
        let Some(fd) = open() else { return f };
        f.fd = fd;
        let mut reg = uffdio_register {
            range: uffdio_range {
                start: f.start,
                len: f.len,
            },
            mode: UFFDIO_REGISTER_MODE_WP,
            ioctls: 0,
        };
        let mut wp = uffdio_writeprotect {
            range: reg.range,
            mode: UFFDIO_WRITEPROTECT_MODE_WP,
        };
        // SAFETY: ioctl on our own userfaultfd with a struct of the kernel's layout.
        let registered = unsafe { libc::ioctl(fd, UFFDIO_REGISTER as _, &raw mut reg) } == 0;
        // SAFETY: as above.
        if !registered || unsafe { libc::ioctl(fd, UFFDIO_WRITEPROTECT as _, &raw mut wp) } != 0 {
            // SAFETY: our fd; closing it unregisters whatever was registered.
            unsafe { libc::close(fd) };
            f.fd = -1;
        }
        f
    }

    /// Whether writes to the range wait: false where userfaultfd is unavailable.
    pub fn holds(&self) -> bool {
        self.fd >= 0
    }
}

impl Drop for Freeze {
    fn drop(&mut self) {
        if self.fd >= 0 {
            let mut wp = uffdio_writeprotect {
                range: uffdio_range {
                    start: self.start,
                    len: self.len,
                },
                mode: 0,
            };
            // SAFETY: our userfaultfd. Lifting the protection wakes the writers that wait; where
            // the range was mapped over meanwhile it is no longer registered (ENOENT, ignored)
            // and closing the fd wakes them, to retry on the new pages.
            unsafe { libc::ioctl(self.fd, UFFDIO_WRITEPROTECT as _, &raw mut wp) };
            // SAFETY: our fd, closed once.
            unsafe { libc::close(self.fd) };
        }
        // SAFETY: restores the mask saved in `new`.
        unsafe { libc::pthread_sigmask(libc::SIG_SETMASK, &self.mask, std::ptr::null_mut()) };
    }
}

/// Blocks every signal in this thread; returns the mask to restore.
fn block_signals() -> libc::sigset_t {
    let mut all = std::mem::MaybeUninit::<libc::sigset_t>::zeroed();
    let mut old = std::mem::MaybeUninit::<libc::sigset_t>::zeroed();
    // SAFETY: fills a set of ours.
    unsafe { libc::sigfillset(all.as_mut_ptr()) };
    // SAFETY: both sets are ours and initialised (zeroed, then filled); the old mask is written.
    unsafe { libc::pthread_sigmask(libc::SIG_BLOCK, all.as_ptr(), old.as_mut_ptr()) };
    // SAFETY: zeroed is a valid (empty) set, overwritten by pthread_sigmask.
    unsafe { old.assume_init() }
}

/// A userfaultfd with its API agreed, or `None`. Privileged callers (root, `CAP_SYS_PTRACE`)
/// get one that also holds the kernel's own writes (a `read(2)` into the range waits);
/// others one for user-mode faults only (such a kernel write fails with `EFAULT` meanwhile).
fn open() -> Option<i32> {
    let mut features = FEATURES.load(Ordering::Relaxed);
    if features == u64::MAX {
        let fd = raw_userfaultfd()?;
        let mut api = uffdio_api {
            api: UFFD_API,
            ..Default::default()
        };
        // SAFETY: UFFDIO_API on a fresh userfaultfd of ours, with the kernel's struct layout.
        let r = unsafe { libc::ioctl(fd, UFFDIO_API as _, &raw mut api) };
        // SAFETY: our fd.
        unsafe { libc::close(fd) };
        if r != 0 {
            return None;
        }
        features = api.features & WANTED;
        FEATURES.store(features, Ordering::Relaxed);
    }
    let fd = raw_userfaultfd()?;
    let mut api = uffdio_api {
        api: UFFD_API,
        features,
        ioctls: 0,
    };
    // SAFETY: as above.
    if unsafe { libc::ioctl(fd, UFFDIO_API as _, &raw mut api) } != 0 {
        // SAFETY: our fd.
        unsafe { libc::close(fd) };
        return None;
    }
    Some(fd)
}

fn raw_userfaultfd() -> Option<i32> {
    let flags = libc::O_CLOEXEC | libc::O_NONBLOCK;
    for extra in [0, UFFD_USER_MODE_ONLY] {
        // SAFETY: userfaultfd(2) takes only flags and returns a new fd or -1.
        let fd = unsafe { libc::syscall(libc::SYS_userfaultfd, flags | extra) };
        if fd >= 0 {
            return Some(fd as i32);
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicBool;
    use std::sync::atomic::AtomicU64 as Counter;

    /// A write another thread makes to a frozen page waits for the guard and then lands.
    #[test]
    fn a_writer_waits_while_frozen_and_lands_after() {
        let len = 4096usize;
        // SAFETY: a fresh private anonymous mapping of our own.
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
        let word = p as usize;
        // SAFETY: the page is ours; the word is aligned.
        let counter = unsafe { &*(word as *const Counter) };
        counter.store(1, Ordering::SeqCst);
        // SAFETY: this thread writes nothing into the page while frozen.
        let guard = unsafe { Freeze::new(word, len) };
        if !guard.holds() {
            eprintln!("userfaultfd unavailable here: nothing to check");
            return;
        }
        let done = std::sync::Arc::new(AtomicBool::new(false));
        let d = done.clone();
        let writer = std::thread::spawn(move || {
            // SAFETY: as above.
            let c = unsafe { &*(word as *const Counter) };
            c.store(2, Ordering::SeqCst);
            d.store(true, Ordering::SeqCst);
        });
        std::thread::sleep(std::time::Duration::from_millis(100));
        assert!(
            !done.load(Ordering::SeqCst),
            "the write went through a frozen page"
        );
        assert_eq!(counter.load(Ordering::SeqCst), 1);
        drop(guard);
        writer.join().expect("writer");
        assert_eq!(counter.load(Ordering::SeqCst), 2);
        // SAFETY: our mapping.
        unsafe { libc::munmap(p, len) };
    }
}
