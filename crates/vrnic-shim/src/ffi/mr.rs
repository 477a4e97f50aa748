//! Protection domains and memory regions: `ibv_alloc_pd`/`ibv_dealloc_pd`, `ibv_reg_mr` (and
//! its `_iova` forms) with region pages mapped over the app's buffer, `ibv_dereg_mr` with the
//! buffer parked for a registration again, and `ibv_rereg_mr`.
#![allow(unsafe_code)]
#![allow(clippy::not_unsafe_ptr_arg_deref)]

use std::ffi::{c_int, c_uint, c_void};
use std::sync::atomic::Ordering;

use vrnic_api::{PageRun, Reply, Request};
use vrnic_shm::layout::PAGE;

use super::objects::{VMr, VPd, context, guard, null_err};
use crate::abi::*;
use crate::client::{self, Conn, vlog};
use crate::maps;
use crate::parked::{self, Parked};
use crate::sys::{self, set_errno};

#[unsafe(no_mangle)]
pub extern "C" fn vrnic_ibv_alloc_pd(ctx: *mut ibv_context) -> *mut ibv_pd {
    guard(null_err(libc::EIO), || {
        alloc_pd(ctx).unwrap_or_else(null_err)
    })
}

/// `ibv_alloc_pd`, for the driver's own callers: a PD of context `ctx`.
pub(crate) fn alloc_pd(ctx: *mut ibv_context) -> Result<*mut ibv_pd, c_int> {
    if ctx.is_null() {
        return Err(libc::EINVAL);
    }
    // SAFETY: ctx is ours.
    let c = unsafe { context(ctx) };
    match c.conn.call(&Request::AllocPd) {
        Ok(Reply::Handle(h)) => {
            let pd = ibv_pd {
                context: ctx,
                handle: h,
            };
            Ok(Box::into_raw(Box::new(VPd { pd })).cast())
        }
        Ok(_) => Err(libc::EPROTO),
        Err(e) => Err(e),
    }
}

#[unsafe(no_mangle)]
pub extern "C" fn vrnic_ibv_dealloc_pd(pd: *mut ibv_pd) -> c_int {
    guard(libc::EIO, || dealloc_pd(pd).err().unwrap_or(0))
}

/// `ibv_dealloc_pd`, for the driver's own callers.
pub(crate) fn dealloc_pd(pd: *mut ibv_pd) -> Result<(), c_int> {
    if pd.is_null() {
        return Err(libc::EINVAL);
    }
    // SAFETY: pd is ours and live.
    let pdr = unsafe { &*pd };
    let (ctx, h) = (pdr.context, pdr.handle);
    // SAFETY: the PD's context outlives it.
    match unsafe { context(ctx) }
        .conn
        .call(&Request::DeallocPd { pd: h })
    {
        Ok(_) => {
            // SAFETY: pd was boxed by alloc_pd; the app gives it up now.
            drop(unsafe { Box::from_raw(pd.cast::<VPd>()) });
            Ok(())
        }
        Err(e) => Err(e),
    }
}

/// Most copied pieces of one run entered in the page tables after the remap (`move_run`).
const POPULATE_PIECES: usize = 64;

/// Runs of fresh pages at least this long are prepared (allocated at once) before
/// the app's bytes are copied in; shorter ones are left to faults (one system call would save
/// a few).
const PREPARE_MIN: u64 = 64 << 10;

fn reg_mr(
    pd: *mut ibv_pd,
    addr: *mut c_void,
    len: usize,
    iova: u64,
    access: c_uint,
) -> *mut ibv_mr {
    guard(null_err(libc::EIO), || {
        if pd.is_null() || (addr.is_null() && len > 0) {
            return null_err(libc::EINVAL);
        }
        if access & !vrnic_wire::access::SUPPORTED != 0 {
            return null_err(libc::EOPNOTSUPP);
        }
        // Remote write or atomic access requires local write, as on every device.
        let needs_local = vrnic_wire::access::REMOTE_WRITE | vrnic_wire::access::REMOTE_ATOMIC;
        if access & needs_local != 0 && access & vrnic_wire::access::LOCAL_WRITE == 0 {
            return null_err(libc::EINVAL);
        }
        if len == 0 {
            return null_err(libc::EINVAL);
        }
        if !sys::range_mapped(addr as usize, len) {
            return null_err(libc::EFAULT);
        }
        // SAFETY: pd is ours and live.
        let pdr = unsafe { &*pd };
        let (ctx, pdh) = (pdr.context, pdr.handle);
        // SAFETY: the PD's context outlives it.
        let vctx = unsafe { context(ctx) };
        let conn = &vctx.conn;
        // Held to the end: a registration and a deregistration of the same pages in two
        // threads must not both act on them.
        let Ok(mut parked) = vctx.parked.lock() else {
            return null_err(libc::EIO);
        };
        let first = addr as u64 / PAGE * PAGE;
        let end = (addr as u64 + len as u64).next_multiple_of(PAGE);
        let reuse = unpark(conn, &mut parked, first, end);
        let req = |reuse: Vec<PageRun>| Request::RegMr {
            pd: pdh,
            addr: addr as u64,
            len: len as u64,
            iova,
            access,
            reuse,
        };
        let mut reply = conn.call(&req(reuse.clone()));
        if !matches!(reply, Ok(Reply::Mr { .. })) {
            // The daemon took none of them back: still ours, still detached.
            for r in reuse {
                parked.park(r);
            }
            if reply == Err(libc::ENOMEM) && parked.bytes() > 0 {
                // Parked pages may be what the vRNIC lacks: give them all back, then retry.
                evict(conn, &parked.take_all());
                reply = conn.call(&req(Vec::new()));
            }
        }
        let (mr, lkey, rkey, runs) = match reply {
            Ok(Reply::Mr {
                mr,
                lkey,
                rkey,
                runs,
            }) => (mr, lkey, rkey, runs),
            Ok(_) => return null_err(libc::EPROTO),
            Err(e) => return null_err(e),
        };
        for r in runs.iter().filter(|r| r.fresh) {
            let bytes = u64::from(r.pages) * PAGE;
            // A page the buffer shares with other data (its first, where the buffer starts
            // inside it, and its last, where it ends inside it) may be written by other threads:
            // it is read first, so that a page never touched has an entry (the zero page) and is
            // protected with the rest. A page wholly the buffer's is not read: in memory that
            // transparent huge pages may back (UCX's pools are `MADV_HUGEPAGE`), a read maps
            // the huge zero page over its 2 MiB, whose 512 entries then count as touched and
            // were copied, zeros, into fresh region pages.
            let shared_first = r.va == first && !(addr as u64).is_multiple_of(PAGE);
            let shared_last =
                r.va + bytes == end && !(addr as u64 + len as u64).is_multiple_of(PAGE);
            let boundary = [(shared_first, r.va), (shared_last, r.va + bytes - PAGE)];
            for (_, p) in boundary.into_iter().filter(|&(shared, _)| shared) {
                // SAFETY: inside the app's buffer, which mincore proved mapped (page rounded).
                unsafe { std::ptr::read_volatile(p as *const u8) };
            }
            let mut untouched = sys::Untouched::open(r.va as usize, bytes as usize);
            let moved = {
                // The driver's own threads keep out of the pages while they move, and (where the
                // kernel allows it) every other thread's writes to them wait (`Freeze`): a
                // buffer's first and last pages hold other data too, which the app's threads
                // may be writing, and a write between the copy and the remap would be lost.
                let _ours = client::moving();
                // SAFETY: until the guard drops this thread only reads the range and writes
                // the region and the kernel, and allocates nothing (`move_run`).
                let _still =
                    unsafe { vrnic_shm::freeze::Freeze::new(r.va as usize, bytes as usize) };
                // SAFETY: the run's pages are the app's buffer being registered, mapped (the
                // daemon gave these pages for this range, which mincore proved mapped).
                unsafe { move_run(conn, r, untouched.as_mut()) }
            };
            if let Err(e) = moved {
                vlog!("moving registered memory onto the region failed: {e}");
                let _ = conn.call(&Request::DeregMr { mr });
                return null_err(libc::EFAULT);
            }
        }
        let m = ibv_mr {
            context: ctx,
            pd,
            addr,
            length: len,
            handle: mr,
            lkey,
            rkey,
        };
        let p = Box::into_raw(Box::new(VMr {
            mr: m,
            access,
            dm_mrs: std::ptr::null(),
        }));
        if let Ok(mut live) = vctx.mrs.lock() {
            live.insert(p as usize);
        }
        p.cast()
    })
}

/// Puts the bytes of the app's pages of run `r` into its region pages and maps those over the
/// app's, the pages the app never touched skipped (they read as zeros, as fresh region pages
/// do: the daemon punches pages it frees; copying them would only make the file system
/// allocate them now), and enters the copied ones in the page tables, so that the app's next
/// touch of each is not a fault. Allocates nothing: it runs while the pages are frozen.
///
/// # Safety
/// `r.va..` for `r.pages` pages is the app's mapped buffer being registered, whose pages the
/// daemon gave this registration.
unsafe fn move_run(
    conn: &Conn,
    r: &PageRun,
    untouched: Option<&mut sys::Untouched>,
) -> Result<(), vrnic_shm::RegionError> {
    let bytes = u64::from(r.pages) * PAGE;
    let mut untouched = untouched;
    let mut skip = |p: u64| untouched.as_mut().is_some_and(|u| u.page(p as usize));
    // The copied pieces, entered in the page tables once mapped (the first ones, where a run is
    // very fragmented; a fixed array: nothing is allocated while the pages are frozen).
    let mut copied = [(0u64, 0u64); POPULATE_PIECES];
    let mut pieces = 0;
    let mut page = 0u64;
    while page < u64::from(r.pages) {
        if skip(page) {
            page += 1;
            continue;
        }
        let mut n = 1;
        while page + n < u64::from(r.pages) && !skip(page + n) {
            n += 1;
        }
        if let Some(slot) = copied.get_mut(pieces) {
            *slot = (page, n);
            pieces += 1;
        }
        let (va, dst) = (r.va + page * PAGE, r.off + page * PAGE);
        // SAFETY: these pages lie inside the caller's mapped range; they are the app's private
        // memory, read here before the remap below.
        let cur = unsafe { std::slice::from_raw_parts(va as *const u8, (n * PAGE) as usize) };
        // A large run through the file: one copy into fresh pages, no zeroing first. Where the
        // file takes no writes (a guest's BAR), through the mapping, its pages allocated in one
        // call rather than a fault per page as the copy goes.
        let large = n * PAGE >= PREPARE_MIN;
        if !(large && conn.region.write_file(dst, cur).is_ok()) {
            if large {
                let _ = conn.region.prepare_write(dst, n * PAGE);
            }
            conn.region.write_bytes(dst, cur)?;
        }
        page += n;
    }
    // SAFETY: the pages are the app's registered buffer; their bytes were copied into the
    // region pages, so the app sees the same contents after the remap.
    unsafe { conn.region.map_over(r.va as usize, r.off, bytes) }?;
    for &(page, n) in &copied[..pieces] {
        // SAFETY: these pages now map region pages the copy above wrote.
        unsafe {
            conn.region
                .populate_over((r.va + page * PAGE) as usize, (n * PAGE) as usize)
        };
    }
    Ok(())
}

/// Takes the parked runs with pages in `first..end` out of `parked` and returns the pages of
/// them inside that range which the app still maps (for the daemon to reuse). Their pages
/// outside the range stay parked; pages the app no longer maps are freed.
fn unpark(conn: &Conn, parked: &mut Parked, first: u64, end: u64) -> Vec<PageRun> {
    let near = parked.take_overlapping(first, end);
    if near.is_empty() {
        return near;
    }
    let split = maps::split(&near, conn.region.file());
    if !split.gone.is_empty() {
        let _ = conn.call(&Request::ReleasePages { runs: split.gone });
    }
    let mut reuse = Vec::new();
    for r in split.mapped {
        let (inside, outside) = parked::clip(r, first, end);
        reuse.extend(inside);
        for o in outside {
            parked.park(o);
        }
    }
    reuse
}

/// Gives detached runs back for good: the pages the app still maps are copied back onto
/// private memory, and every page it no longer maps or got back is freed in the daemon.
pub(crate) fn evict(conn: &Conn, runs: &[PageRun]) {
    if runs.is_empty() {
        return;
    }
    let split = maps::split(runs, conn.region.file());
    if !split.unreadable.is_empty() {
        vlog!("deregistered memory the app made unreadable stays on its region pages");
    }
    let mut released = split.gone;
    for r in split.mapped {
        let bytes = u64::from(r.pages) * PAGE;
        let moved = {
            let _ours = client::moving();
            // SAFETY: /proc/self/maps just showed these addresses mapping the region pages
            // the daemon gave a registration of this context: the app's buffer that we
            // mapped over. (`remap_private` freezes them while they move.)
            unsafe { vrnic_shm::remap_private(r.va as usize, bytes as usize) }
        };
        match moved {
            Ok(()) => released.push(r),
            Err(e) => {
                vlog!("detaching deregistered memory failed: {e}; its pages stay reserved")
            }
        }
    }
    if !released.is_empty() {
        let _ = conn.call(&Request::ReleasePages { runs: released });
    }
}

#[unsafe(no_mangle)]
pub extern "C" fn vrnic_ibv_reg_mr(
    pd: *mut ibv_pd,
    addr: *mut c_void,
    len: usize,
    access: c_int,
) -> *mut ibv_mr {
    reg_mr(pd, addr, len, addr as u64, access as c_uint)
}

#[unsafe(no_mangle)]
pub extern "C" fn vrnic_ibv_reg_mr_iova(
    pd: *mut ibv_pd,
    addr: *mut c_void,
    len: usize,
    iova: u64,
    access: c_int,
) -> *mut ibv_mr {
    reg_mr(pd, addr, len, iova, access as c_uint)
}

#[unsafe(no_mangle)]
pub extern "C" fn vrnic_ibv_reg_mr_iova2(
    pd: *mut ibv_pd,
    addr: *mut c_void,
    len: usize,
    iova: u64,
    access: c_uint,
) -> *mut ibv_mr {
    reg_mr(pd, addr, len, iova, access)
}

#[unsafe(no_mangle)]
pub extern "C" fn vrnic_ibv_dereg_mr(mr: *mut ibv_mr) -> c_int {
    guard(libc::EIO, || {
        if mr.is_null() {
            return libc::EINVAL;
        }
        // SAFETY: mr is ours and live.
        let mrr = unsafe { &*mr };
        let (ctx, h) = (mrr.context, mrr.handle);
        // SAFETY: the MR's context outlives it.
        let vctx = unsafe { context(ctx) };
        let conn = &vctx.conn;
        // Held to the end, as in `reg_mr`.
        let Ok(mut parked) = vctx.parked.lock() else {
            return libc::EIO;
        };
        let runs: Vec<PageRun> = match conn.call(&Request::DeregMr { mr: h }) {
            Ok(Reply::Detach { runs }) => runs,
            Ok(_) => return libc::EPROTO,
            Err(e) => return e,
        };
        // The buffer stays on its region pages, parked for a registration again (`parked`),
        // where the app still maps them; pages it unmapped (or mapped anew) since the
        // registration are left as the app made them and freed at once. Past the cap, the
        // oldest parked buffers go back onto private memory with their bytes.
        let split = maps::split(&runs, conn.region.file());
        if !split.gone.is_empty() {
            let _ = conn.call(&Request::ReleasePages { runs: split.gone });
        }
        if !split.unreadable.is_empty() {
            vlog!("deregistered memory the app made unreadable stays on its region pages");
        }
        for r in split.mapped {
            parked.park(r);
        }
        evict(conn, &parked.take_oldest_over(parked::cap_bytes()));
        drop(parked);
        // SAFETY: the MR's context outlives it.
        if let Ok(mut live) = unsafe { context(ctx) }.mrs.lock() {
            live.remove(&(mr as usize));
        }
        // SAFETY: mr is ours and live until the drop below.
        let dm_mrs = unsafe { &*mr.cast::<VMr>() }.dm_mrs;
        if !dm_mrs.is_null() {
            // SAFETY: an MR over device memory keeps its DM alive (`ibv_free_dm` refuses while
            // any is left), so the DM's count is live.
            unsafe { &*dm_mrs }.fetch_sub(1, Ordering::AcqRel);
        }
        // SAFETY: mr was boxed by reg_mr; the app gives it up now.
        drop(unsafe { Box::from_raw(mr.cast::<VMr>()) });
        0
    })
}

/// `ibv_rereg_mr` flags (verbs.h `enum ibv_rereg_mr_flags`).
const REREG_CHANGE_TRANSLATION: c_int = 1;
const REREG_CHANGE_PD: c_int = 1 << 1;
const REREG_CHANGE_ACCESS: c_int = 1 << 2;
const REREG_KEEP_VALID: c_int = 1 << 3;
/// `enum ibv_rereg_mr_err_code`.
const REREG_ERR_INPUT: c_int = -1;
const REREG_ERR_CMD: c_int = -4;

/// `ibv_rereg_mr`, with rdma-core's input checks and return codes. A new PD or new access
/// flags keep the keys; a new translation is a new registration of the new range (new keys,
/// written back into `mr`) followed by the deregistration of the old one. `KEEP_VALID` is not
/// supported (`EOPNOTSUPP`).
#[unsafe(no_mangle)]
pub extern "C" fn vrnic_ibv_rereg_mr(
    mr: *mut ibv_mr,
    flags: c_int,
    pd: *mut ibv_pd,
    addr: *mut c_void,
    len: usize,
    access: c_int,
) -> c_int {
    guard(REREG_ERR_CMD, || {
        let input = |e| {
            set_errno(e);
            REREG_ERR_INPUT
        };
        if mr.is_null() || flags & !0xf != 0 || flags == 0 {
            return input(libc::EINVAL);
        }
        if flags & REREG_CHANGE_TRANSLATION != 0 && (len == 0 || addr.is_null()) {
            return input(libc::EINVAL);
        }
        if access != 0 && flags & REREG_CHANGE_ACCESS == 0 {
            return input(libc::EINVAL);
        }
        if flags & REREG_CHANGE_PD != 0 && pd.is_null() {
            return input(libc::EINVAL);
        }
        if flags & REREG_KEEP_VALID != 0 {
            set_errno(libc::EOPNOTSUPP);
            return REREG_ERR_CMD;
        }
        // SAFETY: mr is ours and live.
        let v = unsafe { &mut *mr.cast::<VMr>() };
        let new_pd = if flags & REREG_CHANGE_PD != 0 {
            pd
        } else {
            v.mr.pd
        };
        let new_access = if flags & REREG_CHANGE_ACCESS != 0 {
            access as c_uint
        } else {
            v.access
        };
        if flags & REREG_CHANGE_TRANSLATION != 0 {
            let fresh = reg_mr(new_pd, addr, len, addr as u64, new_access);
            if fresh.is_null() {
                return REREG_ERR_CMD;
            }
            // The app keeps its pointer: it now describes the new registration, and the box
            // that reg_mr made holds the old one, which goes. (A DM MR's link to its DM stays
            // with the app's pointer.)
            // SAFETY: fresh is a live VMr that reg_mr just made; it is not `v`.
            v.swap_registration(unsafe { &mut *fresh.cast::<VMr>() });
            return match vrnic_ibv_dereg_mr(fresh) {
                0 => 0,
                e => {
                    // The old registration must stay (memory windows are bound to it): the
                    // app's MR describes it again, and the new one goes.
                    // SAFETY: as above; dereg_mr failed, so fresh is still live.
                    v.swap_registration(unsafe { &mut *fresh.cast::<VMr>() });
                    vrnic_ibv_dereg_mr(fresh);
                    set_errno(e);
                    REREG_ERR_CMD
                }
            };
        }
        // SAFETY: the MR's context outlives it.
        let conn = &unsafe { context(v.mr.context) }.conn;
        let req = Request::ReregMr {
            mr: v.mr.handle,
            // SAFETY: new_pd is the MR's PD or the app's new one, ours and live.
            pd: (flags & REREG_CHANGE_PD != 0).then(|| unsafe { (*new_pd).handle }),
            access: (flags & REREG_CHANGE_ACCESS != 0).then_some(new_access),
        };
        match conn.call(&req) {
            Ok(_) => {
                v.mr.pd = new_pd;
                v.access = new_access;
                0
            }
            Err(e) => {
                set_errno(e);
                REREG_ERR_CMD
            }
        }
    })
}
