//! Surviving a region that its tenant shrank or starved: the daemon's `SIGBUS` guard.
//!
//! A region is a file that its tenant can open for writing, so the tenant can `ftruncate` it
//! (or punch holes in it on a full file system), and the daemon's next access to the missing
//! pages raises `SIGBUS`. The daemon must not die of it. With the guard installed (the daemon
//! does; the driver library never installs a signal handler), every region the process maps
//! is entered in a fixed table. On `SIGBUS` at an address inside one, the handler maps
//! anonymous zero pages over that whole region mapping (one `mmap`, so the faulting access and
//! every later one complete, reading zeros), marks the region poisoned and bumps an epoch
//! counter; the daemon looks at the counter once per pass and tears the poisoned vRNIC down.
//! A `SIGBUS` anywhere else is a real bug: the handler restores the default action and the
//! access faults again, fatally, as without the guard.
//!
//! The handler only does what is async-signal-safe: atomic loads and stores on static memory
//! and one `mmap` system call. The table has a fixed capacity ([`MAX_GUARDED`]); mapping a
//! region while the guard is installed and the table is full fails.
#![allow(unsafe_code)]

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};

/// How many regions the guard can watch at once (the daemon's `--max-vrnics` is capped by it).
pub const MAX_GUARDED: usize = 65536;

static INSTALLED: AtomicBool = AtomicBool::new(false);
static EPOCH: AtomicU64 = AtomicU64::new(0);
/// One past the highest slot ever used (the handler scans no further).
static HIGH: AtomicUsize = AtomicUsize::new(0);
/// Per slot: the mapping's base (0 = free), its end, and whether it was poisoned.
static BASE: [AtomicUsize; MAX_GUARDED] = [const { AtomicUsize::new(0) }; MAX_GUARDED];
static END: [AtomicUsize; MAX_GUARDED] = [const { AtomicUsize::new(0) }; MAX_GUARDED];
static POISONED: [AtomicBool; MAX_GUARDED] = [const { AtomicBool::new(false) }; MAX_GUARDED];
/// Serialises slot allocation (the handler never takes it).
static ALLOC: std::sync::Mutex<usize> = std::sync::Mutex::new(0);

/// Installs the `SIGBUS` guard for this process (the daemon). Regions mapped from now on are
/// watched. Idempotent.
pub fn install() -> std::io::Result<()> {
    if INSTALLED.load(Ordering::Acquire) {
        return Ok(());
    }
    // SAFETY: an all-zero sigaction is a valid value to fill in.
    let mut sa: libc::sigaction = unsafe { std::mem::zeroed() };
    sa.sa_sigaction = on_sigbus as *const () as libc::sighandler_t;
    sa.sa_flags = libc::SA_SIGINFO | libc::SA_NODEFER;
    // SAFETY: sa_mask is valid storage inside sa.
    unsafe { libc::sigemptyset(&mut sa.sa_mask) };
    // SAFETY: installs a handler that only touches static atomics and calls mmap.
    if unsafe { libc::sigaction(libc::SIGBUS, &sa, std::ptr::null_mut()) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    INSTALLED.store(true, Ordering::Release);
    Ok(())
}

/// A counter that moves whenever a region is poisoned: cheap to poll once per pass.
pub fn epoch() -> u64 {
    EPOCH.load(Ordering::Acquire)
}

/// A watched mapping's slot; unwatches it on drop.
#[derive(Debug)]
pub(crate) struct Guarded(usize);

impl Guarded {
    /// Watches `base..base+len` if the guard is installed. `Ok(None)` without the guard; an
    /// error when the table is full.
    pub(crate) fn watch(base: usize, len: usize) -> std::io::Result<Option<Guarded>> {
        if !INSTALLED.load(Ordering::Acquire) {
            return Ok(None);
        }
        let mut hint = ALLOC.lock().unwrap_or_else(|p| p.into_inner());
        let start = *hint;
        for i in 0..MAX_GUARDED {
            let slot = (start + i) % MAX_GUARDED;
            if BASE[slot].load(Ordering::Acquire) != 0 {
                continue;
            }
            POISONED[slot].store(false, Ordering::Release);
            END[slot].store(base + len, Ordering::Release);
            BASE[slot].store(base, Ordering::Release);
            HIGH.fetch_max(slot + 1, Ordering::AcqRel);
            *hint = slot + 1;
            return Ok(Some(Guarded(slot)));
        }
        Err(std::io::Error::other(format!(
            "more than {MAX_GUARDED} regions mapped at once"
        )))
    }

    /// The mapping moved to (or grew into) `base..base+len` (the old range is gone already).
    pub(crate) fn moved(&self, base: usize, len: usize) {
        // A fault in between cannot happen: the caller touches the mapping only after this.
        BASE[self.0].store(0, Ordering::Release);
        END[self.0].store(base + len, Ordering::Release);
        BASE[self.0].store(base, Ordering::Release);
    }

    /// Whether a `SIGBUS` hit this mapping (its contents are zeros from then on).
    pub(crate) fn poisoned(&self) -> bool {
        POISONED[self.0].load(Ordering::Acquire)
    }
}

impl Drop for Guarded {
    fn drop(&mut self) {
        BASE[self.0].store(0, Ordering::Release);
    }
}

extern "C" fn on_sigbus(_sig: libc::c_int, info: *mut libc::siginfo_t, _ctx: *mut libc::c_void) {
    // SAFETY: the kernel hands a SA_SIGINFO handler a valid siginfo_t.
    let info = unsafe { &*info };
    // SAFETY: for SIGBUS the kernel fills in si_addr, the faulting address.
    let addr = unsafe { info.si_addr() } as usize;
    let high = HIGH.load(Ordering::Acquire).min(MAX_GUARDED);
    for slot in 0..high {
        let base = BASE[slot].load(Ordering::Acquire);
        let end = END[slot].load(Ordering::Acquire);
        if base == 0 || addr < base || addr >= end {
            continue;
        }
        // SAFETY: replaces our own mapping of a region (base..end, recorded when it was
        // mapped and not yet unmapped: the slot is cleared before munmap) with anonymous
        // memory; no Rust object lives in it (region memory is reached only by raw copies).
        let p = unsafe {
            libc::mmap(
                base as *mut libc::c_void,
                end - base,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_FIXED | libc::MAP_NORESERVE,
                -1,
                0,
            )
        };
        if p != libc::MAP_FAILED {
            POISONED[slot].store(true, Ordering::Release);
            EPOCH.fetch_add(1, Ordering::AcqRel);
            return;
        }
        break;
    }
    // Not a region (or the remap failed): fault again with the default action.
    // SAFETY: an all-zero sigaction with SIG_DFL restores the default.
    let mut sa: libc::sigaction = unsafe { std::mem::zeroed() };
    sa.sa_sigaction = libc::SIG_DFL;
    // SAFETY: sigaction is async-signal-safe; sa is a valid struct.
    unsafe { libc::sigaction(libc::SIGBUS, &sa, std::ptr::null_mut()) };
}
