//! The mapping of a region file and every raw memory access to it. All unsafe code of the
//! crate lives here and in `fault` (the daemon's `SIGBUS` guard): the rest goes through these
//! bounds-checked calls.
#![allow(unsafe_code)]

use std::ffi::CString;
use std::fs::File;
use std::os::fd::{AsRawFd, FromRawFd};
use std::os::unix::ffi::OsStrExt;
use std::path::Path;
use std::sync::atomic::{AtomicPtr, AtomicU32, AtomicU64, Ordering};

use crate::fault::Guarded;
use crate::layout::{self, PAGE, hdr};

/// Why a region could not be created, opened or accessed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RegionError {
    /// A system call failed.
    #[error("{op} {path}")]
    Io {
        /// What was being done.
        op: &'static str,
        /// On which file.
        path: String,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// The file is no vRNIC region of this version.
    #[error("{0} is not a vrnic region (bad magic or version)")]
    Format(String),
    /// An access outside the mapping.
    #[error("access {off:#x}+{len:#x} outside the region of {size:#x} bytes")]
    Bounds {
        /// Offset.
        off: u64,
        /// Length.
        len: u64,
        /// Region size.
        size: u64,
    },
}

/// A mapped region file. Dropping it unmaps the file and closes it.
///
/// A driver maps the whole file. The daemon maps only what its vRNIC uses
/// ([`Region::create_partial`]) and extends the mapping as the vRNIC's heap grows
/// ([`Region::grow`]), so that thousands of vRNICs with 16 GiB regions cost the daemon's address
/// space what they use, not 16 GiB each.
#[derive(Debug)]
pub struct Region {
    /// Where the mapping starts; moves only in [`Region::grow`].
    base: AtomicPtr<u8>,
    /// The file's size.
    size: u64,
    /// Bytes mapped from the start of the file; accesses beyond are refused.
    mapped: AtomicU64,
    file: File,
    /// Its entry in the daemon's `SIGBUS` guard (none where no guard is installed).
    guard: Option<Guarded>,
}

// SAFETY: the mapping is plain shared memory owned by this value; every access goes through
// methods that copy with raw pointer operations or atomics, which are valid from any thread.
unsafe impl Send for Region {}
// SAFETY: as above: no method hands out non-atomic references, so shared use is sound.
unsafe impl Sync for Region {}

fn io<'a>(op: &'static str, path: &'a Path) -> impl FnOnce(std::io::Error) -> RegionError + 'a {
    move |source| RegionError::Io {
        op,
        path: path.display().to_string(),
        source,
    }
}

fn last_os(op: &'static str, path: &Path) -> RegionError {
    io(op, path)(std::io::Error::last_os_error())
}

impl Region {
    /// Creates a new region file of `size` bytes (sparse) and writes its header. Fails if the
    /// file exists.
    pub fn create(
        path: &Path,
        size: u64,
        name: &str,
        lid: u16,
        gid: [u8; 16],
        guid: u64,
    ) -> Result<Region, RegionError> {
        let full = size.max(layout::MIN_REGION_SIZE).next_multiple_of(2 << 20);
        Self::create_partial(path, size, name, lid, gid, guid, full)
    }

    /// [`Region::create`], with only the first `mapped` bytes mapped in this process (rounded
    /// up to 2 MiB, at least the header and mailboxes, at most the file): what the daemon does,
    /// extending the mapping with [`Region::grow`] as it hands out heap pages.
    pub fn create_partial(
        path: &Path,
        size: u64,
        name: &str,
        lid: u16,
        gid: [u8; 16],
        guid: u64,
        mapped: u64,
    ) -> Result<Region, RegionError> {
        use std::os::unix::fs::OpenOptionsExt;
        let size = size.max(layout::MIN_REGION_SIZE).next_multiple_of(2 << 20);
        let mapped = mapped
            .max(layout::HEAP_OFF)
            .next_multiple_of(2 << 20)
            .min(size);
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(path)
            .map_err(io("create", path))?;
        file.set_len(size).map_err(io("truncate", path))?;
        let region = Self::map(file, size, mapped, path)?;
        region.write_header(name, lid, gid, guid)?;
        Ok(region)
    }

    fn write_header(
        &self,
        name: &str,
        lid: u16,
        gid: [u8; 16],
        guid: u64,
    ) -> Result<(), RegionError> {
        let region = self;
        let size = self.size;
        let mut name_bytes = [0u8; hdr::NAME_LEN];
        let n = name.len().min(hdr::NAME_LEN - 1);
        name_bytes[..n].copy_from_slice(&name.as_bytes()[..n]);
        region.write_bytes(hdr::VERSION, &layout::VERSION.to_le_bytes())?;
        region.write_bytes(hdr::PAGE_SIZE, &(layout::PAGE as u32).to_le_bytes())?;
        region.write_bytes(hdr::REGION_SIZE, &size.to_le_bytes())?;
        region.write_bytes(hdr::CTRL_OFF, &layout::CTRL_OFF.to_le_bytes())?;
        region.write_bytes(hdr::CTRL_SLOTS, &layout::CTRL_SLOTS.to_le_bytes())?;
        region.write_bytes(hdr::CTRL_SLOT_SIZE, &layout::CTRL_SLOT_SIZE.to_le_bytes())?;
        region.write_bytes(hdr::HEAP_OFF, &layout::HEAP_OFF.to_le_bytes())?;
        region.write_bytes(hdr::HEAP_SIZE, &(size - layout::HEAP_OFF).to_le_bytes())?;
        region.write_bytes(hdr::LID, &lid.to_le_bytes())?;
        region.write_bytes(hdr::GID, &gid)?;
        region.write_bytes(hdr::GUID, &guid.to_le_bytes())?;
        region.write_bytes(hdr::NAME, &name_bytes)?;
        region.write_bytes(hdr::DAEMON_PID, &std::process::id().to_le_bytes())?;
        region
            .atomic_u32(hdr::DAEMON_STATE)?
            .store(1, std::sync::atomic::Ordering::Release);
        // The magic goes last: a reader that sees it sees a complete header.
        region.write_bytes(hdr::MAGIC, &layout::MAGIC)?;
        Ok(())
    }

    /// Opens and maps an existing region file (a host file or a VM's PCI BAR `resource2`).
    pub fn open(path: &Path) -> Result<Region, RegionError> {
        let cpath = CString::new(path.as_os_str().as_bytes())
            .map_err(|_| RegionError::Format(path.display().to_string()))?;
        // SAFETY: cpath is a valid NUL-terminated string; open has no memory preconditions.
        let fd = unsafe { libc::open(cpath.as_ptr(), libc::O_RDWR | libc::O_CLOEXEC) };
        if fd < 0 {
            return Err(last_os("open", path));
        }
        // SAFETY: fd was just opened by us and is owned by nothing else.
        let file = unsafe { File::from_raw_fd(fd) };
        let size = file.metadata().map_err(io("stat", path))?.len();
        if size < layout::MIN_REGION_SIZE {
            return Err(RegionError::Format(path.display().to_string()));
        }
        let region = Self::map(file, size, size, path)?;
        let mut magic = [0u8; 8];
        region.read_bytes(hdr::MAGIC, &mut magic)?;
        if magic != layout::MAGIC || region.read_u32(hdr::VERSION)? != layout::VERSION {
            return Err(RegionError::Format(path.display().to_string()));
        }
        Ok(region)
    }

    fn map(file: File, size: u64, mapped: u64, path: &Path) -> Result<Region, RegionError> {
        // SAFETY: a fresh shared mapping chosen by the kernel (no MAP_FIXED), of a file we hold
        // open; it aliases no Rust object.
        let base = unsafe {
            raw_mmap(
                std::ptr::null_mut(),
                mapped as usize,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED | libc::MAP_NORESERVE,
                file.as_raw_fd(),
                0,
            )
        };
        if base == libc::MAP_FAILED {
            return Err(last_os("mmap", path));
        }
        let guard = match Guarded::watch(base as usize, mapped as usize) {
            Ok(g) => g,
            Err(e) => {
                // SAFETY: the mapping just made above, referenced by nothing yet.
                unsafe { raw_munmap(base, mapped as usize) };
                return Err(io("guard", path)(e));
            }
        };
        Ok(Region {
            base: AtomicPtr::new(base.cast()),
            size,
            mapped: AtomicU64::new(mapped),
            file,
            guard,
        })
    }

    /// Bytes of the file this process maps (from its start).
    pub fn mapped(&self) -> u64 {
        self.mapped.load(Ordering::Acquire)
    }

    /// Maps at least the first `len` bytes of the file (a partial mapping grows by doubling,
    /// at most to the file's size). The mapping may move. Fails, changing nothing, if the
    /// address space has no room, or if the region is poisoned.
    ///
    /// # Safety
    /// No address or reference obtained from this region before the call (from
    /// [`Region::atomic_u32`], [`Region::io_range`], [`Region::base_addr`]) may be used after
    /// it: they may point into memory that is no longer mapped.
    pub unsafe fn grow(&self, len: u64) -> Result<(), RegionError> {
        let old = self.mapped();
        if len <= old {
            return Ok(());
        }
        if len > self.size {
            return Err(RegionError::Bounds {
                off: 0,
                len,
                size: self.size,
            });
        }
        if self.poisoned() {
            return Err(RegionError::Format(
                "a poisoned region does not grow".into(),
            ));
        }
        let new = len
            .max(old.saturating_mul(2))
            .next_multiple_of(2 << 20)
            .min(self.size);
        let base = self.base.load(Ordering::Acquire);
        // SAFETY: base..base+old is this region's own mapping; the caller guarantees nothing
        // made from it is used after the call. MREMAP_MAYMOVE returns a new address or fails
        // leaving the old mapping as it was.
        let r = unsafe {
            libc::syscall(
                libc::SYS_mremap,
                base as libc::c_long,
                old as libc::c_long,
                new as libc::c_long,
                libc::c_long::from(libc::MREMAP_MAYMOVE),
            )
        };
        if r == -1 {
            return Err(RegionError::Io {
                op: "mremap",
                path: "region".into(),
                source: std::io::Error::last_os_error(),
            });
        }
        let moved = r as *mut u8;
        // The guard learns the new range before anything touches it.
        if let Some(g) = &self.guard {
            g.moved(moved as usize, new as usize);
        }
        self.base.store(moved, Ordering::Release);
        self.mapped.store(new, Ordering::Release);
        Ok(())
    }

    /// Whether the daemon's `SIGBUS` guard caught an access to this region whose pages were
    /// gone (its tenant shrank the file, or the file system had no room for a page): the
    /// mapping reads zeros from then on, and the vRNIC must be torn down.
    pub fn poisoned(&self) -> bool {
        self.guard.as_ref().is_some_and(Guarded::poisoned)
    }

    /// The region's size in bytes.
    pub fn size(&self) -> u64 {
        self.size
    }

    /// The region file.
    pub fn file(&self) -> &File {
        &self.file
    }

    /// The address where this process maps the region (for address arithmetic only; it moves
    /// when a partial mapping grows).
    pub fn base_addr(&self) -> usize {
        self.base.load(Ordering::Acquire) as usize
    }

    fn check(&self, off: u64, len: u64) -> Result<*mut u8, RegionError> {
        match off.checked_add(len) {
            Some(end) if end <= self.mapped() => {
                Ok(self.base.load(Ordering::Acquire).wrapping_add(off as usize))
            }
            _ => Err(RegionError::Bounds {
                off,
                len,
                size: self.mapped(),
            }),
        }
    }

    /// As [`Region::check`], for a word of `len` bytes, which must also be `len`-aligned (a
    /// misaligned `off` is refused as out of bounds).
    fn check_word(&self, off: u64, len: u64) -> Result<*mut u8, RegionError> {
        let p = self.check(off, len)?;
        if !off.is_multiple_of(len) {
            return Err(RegionError::Bounds {
                off,
                len,
                size: self.mapped(),
            });
        }
        Ok(p)
    }

    /// Where `len` bytes at `off` sit in this process (address, length), for the kernel to
    /// read or fill them by vectored I/O, checked like every access. Nothing here dereferences
    /// it; a caller hands it to a system call while it holds the region, and a range the
    /// tenant has truncated away makes that call fail with `EFAULT` rather than fault.
    pub fn io_range(&self, off: u64, len: u64) -> Result<(usize, usize), RegionError> {
        let p = self.check(off, len)?;
        Ok((p as usize, len as usize))
    }

    /// Copies bytes out of the region.
    pub fn read_bytes(&self, off: u64, out: &mut [u8]) -> Result<(), RegionError> {
        let src = self.check(off, out.len() as u64)?;
        // SAFETY: src..src+len is inside our live mapping (checked); `out` is private memory that
        // cannot overlap a shared mapping we created.
        unsafe { crate::copy::copy(src, out.as_mut_ptr(), out.len()) };
        Ok(())
    }

    /// Reads the byte at `off` for its side effect only: a page of a file its tenant truncated
    /// then trips the `SIGBUS` guard ([`crate::fault`]). A volatile read, so that no optimizer
    /// drops it as a read whose value is unused (a plain copy into a dead buffer was removed
    /// once the build inlined across crates).
    pub fn touch(&self, off: u64) -> Result<(), RegionError> {
        let src = self.check(off, 1)?;
        // SAFETY: src is inside our live mapping (checked); a volatile u8 read has no alignment
        // requirement.
        let _ = unsafe { std::ptr::read_volatile(src) };
        Ok(())
    }

    /// Asks the CPU to start loading the cache line at `off` (a hint: nothing is read, no
    /// fault can follow, an offset out of bounds is ignored). The engine issues it for the
    /// next ring slots while it parses one, so that the lines the app's core wrote come over
    /// together instead of one miss after another.
    pub fn prefetch(&self, off: u64) {
        #[cfg(target_arch = "x86_64")]
        if let Ok(p) = self.check(off, 1) {
            // SAFETY: a prefetch hint reads nothing and cannot fault; `p` lies in our mapping.
            unsafe {
                std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(p.cast())
            };
        }
        #[cfg(not(target_arch = "x86_64"))]
        let _ = off;
    }

    /// Copies bytes into the region.
    pub fn write_bytes(&self, off: u64, data: &[u8]) -> Result<(), RegionError> {
        let dst = self.check(off, data.len() as u64)?;
        // SAFETY: dst..dst+len is inside our live mapping (checked); `data` is private memory.
        unsafe { crate::copy::copy(data.as_ptr(), dst, data.len()) };
        Ok(())
    }

    /// Writes `data` at `off` through the file (`pwrite`) rather than the mapping: for a page
    /// the file does not have yet, a write that covers it whole is the only copy the kernel
    /// makes (tmpfs fills a new page from the writer without zeroing it first, where a fault
    /// or [`Region::prepare_write`] zeroes it and the copy then writes it again). Fails where
    /// the file takes no writes (a guest's PCI BAR through sysfs); the caller then copies
    /// through the mapping. Bytes written before a failure stay written.
    pub fn write_file(&self, off: u64, data: &[u8]) -> Result<(), RegionError> {
        self.check(off, data.len() as u64)?;
        let mut done = 0usize;
        while done < data.len() {
            let rest = &data[done..];
            // SAFETY: pwrite reads `rest` (valid for its length) and writes the file at an
            // offset inside it (checked); no memory of ours is written.
            let r = unsafe {
                libc::syscall(
                    libc::SYS_pwrite64,
                    libc::c_long::from(self.file.as_raw_fd()),
                    rest.as_ptr() as libc::c_long,
                    rest.len() as libc::c_long,
                    (off + done as u64) as libc::c_long,
                )
            };
            match r {
                n if n > 0 => done += n as usize,
                0 => {
                    return Err(RegionError::Io {
                        // No allocation here: the driver writes while other threads' writes
                        // to the source wait (`freeze`), some maybe holding the allocator.
                        op: "pwrite into the region",
                        path: String::new(),
                        source: std::io::Error::from(std::io::ErrorKind::WriteZero),
                    });
                }
                _ => {
                    let e = std::io::Error::last_os_error();
                    if e.kind() == std::io::ErrorKind::Interrupted {
                        continue;
                    }
                    return Err(RegionError::Io {
                        // No allocation here: the driver writes while other threads' writes
                        // to the source wait (`freeze`), some maybe holding the allocator.
                        op: "pwrite into the region",
                        path: String::new(),
                        source: e,
                    });
                }
            }
        }
        Ok(())
    }

    /// Gets `len` bytes at `off` ready to be written: allocates every page of the range the
    /// file does not have yet in one system call (`MADV_POPULATE_WRITE`), instead of one fault
    /// per 4 KiB page during the copy that follows. Best effort: a kernel without it (before
    /// 5.14) leaves the pages to faults, as without the call. Fails only on bounds.
    ///
    /// Huge pages (a tmpfs mounted `huge=advise` and `MADV_HUGEPAGE` here) were tried and left
    /// out: on the VMs this is measured on, free 2 MiB blocks are handed back to the host (the
    /// balloon's free page reporting), so every fresh huge page faults in the hypervisor, and
    /// registering 1 GiB took 0.3 to 1.8 s against 0.7 s on 4 KiB pages (`docs/performance.md`).
    pub fn prepare_write(&self, off: u64, len: u64) -> Result<(), RegionError> {
        let p = self.check(off, len)? as usize;
        let first = p / PAGE as usize * PAGE as usize;
        let end = p + len as usize;
        // SAFETY: advice over pages of our own live mapping (checked): populating for writing
        // allocates pages the file does not have yet (zeroed, as a fault would) and keeps
        // those it has. A truncated file makes it fail with EFAULT, not a signal.
        unsafe { raw_madvise(first, end - first, libc::MADV_POPULATE_WRITE) };
        Ok(())
    }

    /// Reads a little-endian `u32`.
    pub fn read_u32(&self, off: u64) -> Result<u32, RegionError> {
        let mut b = [0u8; 4];
        self.read_bytes(off, &mut b)?;
        Ok(u32::from_le_bytes(b))
    }

    /// Reads a little-endian `u64`.
    pub fn read_u64(&self, off: u64) -> Result<u64, RegionError> {
        let mut b = [0u8; 8];
        self.read_bytes(off, &mut b)?;
        Ok(u64::from_le_bytes(b))
    }

    /// An atomic word in the region. `off` must be 4-byte aligned.
    pub fn atomic_u32(&self, off: u64) -> Result<&AtomicU32, RegionError> {
        let p = self.check_word(off, 4)?;
        // SAFETY: p is in bounds and 4-byte aligned (the mapping is page aligned); AtomicU32 has
        // no invalid bit patterns and tolerates concurrent writers, and the mapping outlives the
        // returned borrow of self (it moves only in `grow`, whose caller must not use such a
        // reference after it).
        Ok(unsafe { AtomicU32::from_ptr(p.cast()) })
    }

    /// A 64-bit atomic word in the region. `off` must be 8-byte aligned.
    pub fn atomic_u64(&self, off: u64) -> Result<&AtomicU64, RegionError> {
        let p = self.check_word(off, 8)?;
        // SAFETY: as in `atomic_u32`, with 8-byte alignment checked: in bounds, aligned (the
        // mapping is page aligned), no invalid bit patterns, concurrent writers tolerated, and
        // the mapping outlives the borrow of self (it moves only in `grow`).
        Ok(unsafe { AtomicU64::from_ptr(p.cast()) })
    }

    /// Stores `value` (its bytes in memory order) at `off`, 8-byte aligned, as one atomic store
    /// with release ordering: a reader of the word (the app's CPU, any thread) sees all of the
    /// old bytes or all of the new, never a mix, and once it sees the new ones it also sees
    /// every write this thread made to the region before (what an ATOMIC WRITE promises). A
    /// misaligned `off` is refused as out of bounds, writing nothing.
    pub fn store_u64(&self, off: u64, value: [u8; 8]) -> Result<(), RegionError> {
        let p = self.check_word(off, 8)?;
        // SAFETY: p is in bounds and 8-byte aligned (the mapping is page aligned, `off` a
        // multiple of 8); AtomicU64 has no invalid bit patterns and tolerates concurrent
        // accesses; the reference lives for this statement only, inside our live mapping.
        unsafe { AtomicU64::from_ptr(p.cast()) }
            .store(u64::from_ne_bytes(value), Ordering::Release);
        Ok(())
    }

    /// Copies `len` bytes from `src_off` in `src` to `dst_off` in `dst` (memmove: the two ranges
    /// may overlap when `src` and `dst` are the same region).
    pub fn copy(
        src: &Region,
        src_off: u64,
        dst: &Region,
        dst_off: u64,
        len: u64,
    ) -> Result<(), RegionError> {
        let s = src.check(src_off, len)?;
        let d = dst.check(dst_off, len)?;
        // SAFETY: both ranges lie inside live mappings (checked); `copy` allows overlap.
        unsafe { crate::copy::copy(s, d, len as usize) };
        Ok(())
    }

    /// Maps `len` bytes of the region at `off` over this process's memory at `addr`, replacing
    /// whatever was mapped there (`MAP_FIXED`). `addr`, `off` and `len` must be page aligned.
    ///
    /// # Safety
    /// The caller owns `addr..addr+len` in the sense that replacing its backing with region pages
    /// (after copying the old contents in, so that the bytes stay the same) breaks no invariant of
    /// any Rust object: it is memory the application handed to `ibv_reg_mr`.
    pub unsafe fn map_over(&self, addr: usize, off: u64, len: u64) -> Result<(), RegionError> {
        self.check(off, len)?;
        // SAFETY: range checked against the file; the caller vouches for the target range.
        let p = unsafe {
            raw_mmap(
                addr as *mut libc::c_void,
                len as usize,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED | libc::MAP_FIXED,
                self.file.as_raw_fd(),
                off as libc::off_t,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(RegionError::Io {
                // No allocation here either (see `write_file`).
                op: "mmap of region pages over",
                path: String::new(),
                source: std::io::Error::last_os_error(),
            });
        }
        Ok(())
    }

    /// Enters the pages at `addr..addr+len`, a mapping [`map_over`](Self::map_over) made, in
    /// the page tables at once (`MADV_POPULATE_WRITE`): the app's next touch of each costs no
    /// fault (a fault per 4 KiB page costs about a microsecond; an MPI rank that registers a
    /// buffer on its first send then reads and writes it). Only for pages the file has (the
    /// copied ones): a hole would be allocated. Best effort, as [`prepare_write`](Self::prepare_write).
    ///
    /// # Safety
    /// `addr..addr+len` maps pages of this region that hold data (`map_over`, after the copy).
    pub unsafe fn populate_over(&self, addr: usize, len: usize) {
        // SAFETY: the caller vouches the range maps region pages the file has: populating for
        // writing maps them as a write fault would, changing no byte and allocating nothing.
        unsafe { raw_madvise(addr, len, libc::MADV_POPULATE_WRITE) };
    }

    /// Gives `len` bytes at `off` back to the file system (their contents become zero).
    pub fn punch(&self, off: u64, len: u64) -> Result<(), RegionError> {
        self.check(off, len)?;
        // SAFETY: fallocate on our own fd with an in-bounds range; no memory is touched.
        let r = unsafe {
            libc::fallocate(
                self.file.as_raw_fd(),
                libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
                off as libc::off_t,
                len as libc::off_t,
            )
        };
        if r != 0 {
            return Err(RegionError::Io {
                op: "punch",
                path: "region".into(),
                source: std::io::Error::last_os_error(),
            });
        }
        Ok(())
    }
}

/// Replaces the pages at `addr..addr+len` of this process with private anonymous memory holding
/// the same bytes (used after deregistration, so region pages can be reused).
///
/// # Safety
/// Same contract as [`Region::map_over`]: the range is application memory given to the driver.
pub unsafe fn remap_private(addr: usize, len: usize) -> std::io::Result<()> {
    // Other threads' writes to these pages wait until the private copy is in place (see
    // `freeze`); nothing below allocates.
    // SAFETY: this thread writes only the fresh `tmp` mapping until the guard drops.
    let _still = unsafe { crate::freeze::Freeze::new(addr, len) };
    // SAFETY: a fresh anonymous mapping chosen by the kernel.
    let tmp = unsafe {
        raw_mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            -1,
            0,
        )
    };
    if tmp == libc::MAP_FAILED {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: both ranges are mapped and `len` long; they are distinct mappings.
    unsafe { std::ptr::copy_nonoverlapping(addr as *const u8, tmp.cast::<u8>(), len) };
    // SAFETY: moves our private mapping over the caller's range, which the caller vouches for.
    let moved = unsafe {
        libc::syscall(
            libc::SYS_mremap,
            tmp as libc::c_long,
            len as libc::c_long,
            len as libc::c_long,
            libc::c_long::from(libc::MREMAP_MAYMOVE | libc::MREMAP_FIXED),
            addr as libc::c_long,
        )
    };
    if moved == -1 {
        let e = std::io::Error::last_os_error();
        // SAFETY: tmp is our own mapping of len bytes.
        unsafe { raw_munmap(tmp, len) };
        return Err(e);
    }
    Ok(())
}

impl Drop for Region {
    fn drop(&mut self) {
        // Unwatched before it is unmapped: the guard never claims an address we gave back.
        drop(self.guard.take());
        // SAFETY: base/mapped are the mapping created in `map` (moved by `grow`); no borrow of
        // it outlives self.
        unsafe {
            raw_munmap(
                self.base.load(Ordering::Acquire).cast(),
                self.mapped() as usize,
            )
        };
    }
}

/// `mmap(2)`, issued as a raw system call rather than through libc's `mmap`. The driver library
/// lives inside programs whose memory hooks (UCX's ucm, Open MPI's patcher) intercept libc's
/// `mmap`/`munmap`/`mremap`, by symbol or by patching their code, and drop every registration
/// their caches hold over a range those calls touch: mapping region pages over a buffer being
/// registered would evict the very registration being made. Returns `MAP_FAILED` with errno
/// set on failure, as `mmap` does.
///
/// # Safety
/// As `mmap(2)`: with `MAP_FIXED`, the caller owns the target range.
unsafe fn raw_mmap(
    addr: *mut libc::c_void,
    len: usize,
    prot: libc::c_int,
    flags: libc::c_int,
    fd: libc::c_int,
    off: libc::off_t,
) -> *mut libc::c_void {
    // SAFETY: the kernel's mmap with the caller's arguments, each widened to a register.
    let r = unsafe {
        libc::syscall(
            libc::SYS_mmap,
            addr as libc::c_long,
            len as libc::c_long,
            libc::c_long::from(prot),
            libc::c_long::from(flags),
            libc::c_long::from(fd),
            off as libc::c_long,
        )
    };
    if r == -1 {
        libc::MAP_FAILED
    } else {
        r as *mut libc::c_void
    }
}

/// `madvise(2)` as a raw system call (see [`raw_mmap`] for why); its result is ignored: every
/// use is advice.
///
/// # Safety
/// As `madvise(2)`: the advice must not change what the range holds.
unsafe fn raw_madvise(addr: usize, len: usize, advice: libc::c_int) {
    // SAFETY: the kernel's madvise with the caller's range and advice.
    unsafe {
        libc::syscall(
            libc::SYS_madvise,
            addr as libc::c_long,
            len as libc::c_long,
            libc::c_long::from(advice),
        )
    };
}

/// `munmap(2)` as a raw system call (see [`raw_mmap`] for why).
///
/// # Safety
/// As `munmap(2)`: nothing may use the range afterwards.
unsafe fn raw_munmap(addr: *mut libc::c_void, len: usize) {
    // SAFETY: the kernel's munmap with the caller's range.
    unsafe { libc::syscall(libc::SYS_munmap, addr as libc::c_long, len as libc::c_long) };
}

/// Waits on `word` while it holds `expected`, for up to `timeout_ms`. Returns false when the
/// word cannot hold a futex (a guest's mapping of a PCI BAR: `EFAULT`), so the caller polls.
pub(crate) fn futex_wait(word: &AtomicU32, expected: u32, timeout_ms: u32) -> bool {
    let ts = libc::timespec {
        tv_sec: (timeout_ms / 1000) as libc::time_t,
        tv_nsec: ((timeout_ms % 1000) * 1_000_000) as libc::c_long,
    };
    // SAFETY: FUTEX_WAIT (shared) on a valid aligned word with a valid timespec; returns at once
    // if the word no longer holds `expected`.
    let r = unsafe {
        libc::syscall(
            libc::SYS_futex,
            word.as_ptr(),
            libc::FUTEX_WAIT,
            expected,
            &ts as *const libc::timespec,
        )
    };
    r == 0
        || matches!(
            std::io::Error::last_os_error().raw_os_error(),
            Some(libc::EAGAIN | libc::ETIMEDOUT | libc::EINTR)
        )
}

pub(crate) fn futex_wake(word: &AtomicU32) {
    // SAFETY: FUTEX_WAKE (shared) on a valid aligned word touches no memory.
    unsafe { libc::syscall(libc::SYS_futex, word.as_ptr(), libc::FUTEX_WAKE, i32::MAX) };
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tmp(name: &str) -> std::path::PathBuf {
        let p = std::env::temp_dir().join(format!("vrnic-shm-{}-{name}", std::process::id()));
        let _ = std::fs::remove_file(&p);
        p
    }

    #[test]
    fn create_then_open_sees_the_header() {
        let p = tmp("hdr");
        let r = Region::create(&p, 0, "vr0", 7, [1; 16], 9).unwrap();
        let o = Region::open(&p).unwrap();
        assert_eq!(o.size(), r.size());
        assert_eq!(o.read_u32(hdr::LID).unwrap() & 0xffff, 7);
        std::fs::remove_file(p).unwrap();
    }

    #[test]
    fn out_of_bounds_access_is_an_error_not_a_fault() {
        let p = tmp("oob");
        let r = Region::create(&p, 0, "vr0", 1, [0; 16], 1).unwrap();
        let size = r.size();
        assert!(r.read_bytes(size - 1, &mut [0u8; 2]).is_err());
        assert!(r.write_bytes(u64::MAX - 1, &[0u8; 4]).is_err());
        assert!(Region::copy(&r, 0, &r, size, 1).is_err());
        assert!(r.atomic_u32(2).is_err());
        std::fs::remove_file(p).unwrap();
    }

    /// `store_u64` writes exactly its 8 bytes at an aligned offset, seen through another
    /// mapping of the file; a misaligned or out-of-bounds one writes nothing.
    #[test]
    fn an_aligned_u64_store_lands_whole_and_alone() {
        let p = tmp("store");
        let r = Region::create(&p, 0, "vr0", 1, [0; 16], 1).unwrap();
        let o = Region::open(&p).unwrap();
        let off = layout::HEAP_OFF + 4096 + 64;
        r.write_bytes(off - 8, &[0xee; 24]).unwrap();
        r.store_u64(off, [1, 2, 3, 4, 5, 6, 7, 8]).unwrap();
        let mut back = [0u8; 24];
        o.read_bytes(off - 8, &mut back).unwrap();
        assert_eq!(&back[..8], &[0xee; 8]);
        assert_eq!(&back[8..16], &[1, 2, 3, 4, 5, 6, 7, 8]);
        assert_eq!(&back[16..], &[0xee; 8]);
        for bad in [off + 4, off + 1, off - 3] {
            assert!(r.store_u64(bad, [9; 8]).is_err(), "{bad}");
        }
        assert!(r.store_u64(r.size() - 8 + 8, [9; 8]).is_err());
        o.read_bytes(off - 8, &mut back).unwrap();
        assert_eq!(&back[8..16], &[1, 2, 3, 4, 5, 6, 7, 8]);
        assert_eq!(&back[..8], &[0xee; 8]);
        std::fs::remove_file(p).unwrap();
    }

    #[test]
    fn bytes_written_through_the_file_are_those_the_mapping_reads() {
        let p = tmp("wfile");
        let r = Region::create(&p, 0, "vr0", 1, [0; 16], 1).unwrap();
        let off = layout::HEAP_OFF + 3 * 4096;
        let data: Vec<u8> = (0..(256u32 << 10))
            .map(|i| (i * 13 + i / 4096) as u8)
            .collect();
        r.write_file(off, &data).unwrap();
        let mut back = vec![0u8; data.len()];
        r.read_bytes(off, &mut back).unwrap();
        assert!(back == data, "the mapping reads what pwrite wrote");
        // The page before and the one after are untouched.
        let mut edge = [1u8; 8];
        r.read_bytes(off - 8, &mut edge).unwrap();
        assert_eq!(edge, [0u8; 8]);
        r.read_bytes(off + data.len() as u64, &mut edge).unwrap();
        assert_eq!(edge, [0u8; 8]);
        // Past the end: refused before any system call, the file keeps its size.
        assert!(r.write_file(r.size() - 4, &[9u8; 8]).is_err());
        assert_eq!(std::fs::metadata(&p).unwrap().len(), r.size());
        std::fs::remove_file(p).unwrap();
    }

    #[test]
    fn a_region_shrunk_under_a_guarded_process_poisons_instead_of_killing() {
        crate::fault::install().unwrap();
        let p = tmp("shrink");
        let r = Region::create(&p, 0, "vr0", 1, [0; 16], 1).unwrap();
        let off = layout::HEAP_OFF + 8192;
        r.write_bytes(off, b"live").unwrap();
        assert!(!r.poisoned());
        let before = crate::fault::epoch();
        std::fs::OpenOptions::new()
            .write(true)
            .open(&p)
            .unwrap()
            .set_len(0)
            .unwrap();
        // Without the guard this read is a SIGBUS; with it, zeros and a poisoned region.
        let mut b = [0xffu8; 4];
        r.read_bytes(off, &mut b).unwrap();
        assert_eq!(b, [0; 4]);
        assert!(r.poisoned());
        assert!(crate::fault::epoch() > before);
        r.write_bytes(0, b"still no fault").unwrap();
        drop(r);
        // A new region in the same slot starts clean.
        std::fs::remove_file(&p).unwrap();
        let r2 = Region::create(&p, 0, "vr1", 1, [0; 16], 1).unwrap();
        assert!(!r2.poisoned());
        std::fs::remove_file(p).unwrap();
    }

    #[test]
    fn a_partial_mapping_refuses_what_it_does_not_map_and_grows_keeping_its_bytes() {
        let p = tmp("grow");
        let r = Region::create_partial(&p, 1 << 30, "vr0", 3, [0; 16], 1, 0).unwrap();
        assert_eq!(r.size(), 1 << 30);
        let first = r.mapped();
        assert!((layout::HEAP_OFF..1 << 30).contains(&first), "{first}");
        r.write_bytes(first - 4, b"edge").unwrap();
        assert!(
            r.read_bytes(first, &mut [0u8; 1]).is_err(),
            "past the mapping"
        );
        assert!(Region::copy(&r, first - 4, &r, first, 4).is_err());
        // SAFETY: nothing made from `r` is used across the calls (accesses take offsets).
        unsafe { r.grow(first + (100 << 20)) }.unwrap();
        assert!(r.mapped() >= first + (100 << 20));
        let mut b = [0u8; 4];
        r.read_bytes(first - 4, &mut b).unwrap();
        assert_eq!(&b, b"edge", "the bytes before the growth stay");
        r.write_bytes(first + (99 << 20), b"far").unwrap();
        // The file's own bytes are what any other mapping of it sees.
        let o = Region::open(&p).unwrap();
        let mut c = [0u8; 3];
        o.read_bytes(first + (99 << 20), &mut c).unwrap();
        assert_eq!(&c, b"far");
        assert_eq!(o.read_u32(hdr::LID).unwrap() & 0xffff, 3);
        // SAFETY: as above.
        assert!(unsafe { r.grow((1 << 30) + 1) }.is_err(), "past the file");
        // SAFETY: as above.
        unsafe { r.grow(1 << 30) }.unwrap();
        assert_eq!(r.mapped(), 1 << 30);
        drop((r, o));
        std::fs::remove_file(p).unwrap();
    }

    #[test]
    fn the_guard_follows_a_mapping_that_grew() {
        crate::fault::install().unwrap();
        let p = tmp("grow-guard");
        let r = Region::create_partial(&p, 1 << 30, "vr0", 1, [0; 16], 1, 0).unwrap();
        let off = r.mapped() + (300 << 20);
        // SAFETY: nothing made from `r` is used across the call.
        unsafe { r.grow(off + 4096) }.unwrap();
        r.write_bytes(off, b"live").unwrap();
        std::fs::OpenOptions::new()
            .write(true)
            .open(&p)
            .unwrap()
            .set_len(0)
            .unwrap();
        // In the grown part, at its new address: caught, not fatal.
        let mut b = [0xffu8; 4];
        r.read_bytes(off, &mut b).unwrap();
        assert_eq!(b, [0; 4]);
        assert!(r.poisoned());
        assert!(
            // SAFETY: as above.
            unsafe { r.grow(off + (8 << 20)) }.is_err(),
            "a poisoned region does not grow"
        );
        drop(r);
        std::fs::remove_file(p).unwrap();
    }

    #[test]
    fn prepare_write_allocates_the_pages_and_keeps_them_zero() {
        use std::os::unix::fs::MetadataExt;
        let p = tmp("prep");
        let r = Region::create(&p, 0, "vr0", 1, [0; 16], 1).unwrap();
        let before = std::fs::metadata(&p).unwrap().blocks() * 512;
        let (off, len) = (layout::HEAP_OFF, 4u64 << 20);
        r.prepare_write(off, len).unwrap();
        let after = std::fs::metadata(&p).unwrap().blocks() * 512;
        assert!(
            after >= before + len,
            "the pages are allocated at once: {before} -> {after} bytes"
        );
        let mut b = vec![1u8; 4096];
        r.read_bytes(off + len - 4096, &mut b).unwrap();
        assert!(b.iter().all(|&x| x == 0), "prepared pages read as zeros");
        r.write_bytes(off + 7, b"abc").unwrap();
        r.prepare_write(off, 4096).unwrap();
        let mut c = [0u8; 3];
        r.read_bytes(off + 7, &mut c).unwrap();
        assert_eq!(&c, b"abc", "preparing again keeps what the pages hold");
        assert!(r.prepare_write(r.mapped() - 4096, 8192).is_err());
        std::fs::remove_file(p).unwrap();
    }

    #[test]
    fn map_over_makes_app_memory_region_memory() {
        let p = tmp("map");
        let r = Region::create(&p, 0, "vr0", 1, [0; 16], 1).unwrap();
        let mut buf = vec![0u8; 3 * 4096];
        let addr = (buf.as_mut_ptr() as usize).next_multiple_of(4096);
        let off = layout::HEAP_OFF;
        // SAFETY: addr..addr+4096 lies inside `buf`, which we own and whose bytes we do not keep
        // references to across the remap.
        unsafe { r.map_over(addr, off, 4096).unwrap() };
        r.write_bytes(off + 5, b"hello").unwrap();
        // SAFETY: addr+5..addr+10 is inside buf and now maps region bytes we just wrote.
        let seen = unsafe { std::slice::from_raw_parts((addr + 5) as *const u8, 5) }.to_vec();
        assert_eq!(seen, b"hello");
        // SAFETY: same range as above, application-owned.
        unsafe { remap_private(addr, 4096).unwrap() };
        r.write_bytes(off + 5, b"world").unwrap();
        // SAFETY: as above.
        let after = unsafe { std::slice::from_raw_parts((addr + 5) as *const u8, 5) }.to_vec();
        assert_eq!(
            after, b"hello",
            "after remap_private the app keeps its bytes, detached"
        );
        drop(buf);
        std::fs::remove_file(p).unwrap();
    }
}
