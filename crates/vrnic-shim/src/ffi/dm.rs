//! Device memory: `ibv_alloc_dm`, `ibv_free_dm`, `ibv_memcpy_to_dm`/`_from_dm` (the `ibv_dm`
//! ops behind the verbs.h inlines) and `ibv_reg_dm_mr`.
//!
//! A vRNIC has no memory of its own apart from the host's: its "device memory" is a
//! page-aligned buffer of the process, which the driver copies into and out of, and which
//! `ibv_reg_dm_mr` registers like any buffer (so its pages become region pages the engine
//! reaches directly), zero based as the verbs require: work requests name DM MR bytes by their
//! offset from the registered start. What a device's on-chip memory buys (lower latency for
//! the NIC) means nothing here; what callers rely on (an allocation up to `max_dm_size`, exact
//! copies, bounds, MRs over it, `EBUSY` while they exist) holds. Unlike mlx5, copies need no
//! 4-byte alignment.
#![allow(unsafe_code)]

use std::alloc::Layout;
use std::ffi::{c_int, c_uint, c_void};
use std::sync::atomic::{AtomicU32, Ordering};

use vrnic_wire::access;

use super::objects::{VMr, guard, null_err};
use crate::abi::*;

/// Alignment of every allocation (a page, so registrations map whole pages).
const ALIGN: usize = 4096;

/// A device-memory allocation: `ibv_dm` first (the app's pointer), then its buffer.
#[repr(C)]
struct VDm {
    dm: ibv_dm,
    buf: *mut u8,
    len: usize,
    layout: Layout,
    /// MRs registered over it (`ibv_free_dm` refuses while any is left).
    mrs: AtomicU32,
}

/// `verbs_context.alloc_dm`: `length` in `1..=max_dm_size`, no comp_mask bits, an alignment
/// up to a page: else `EINVAL`.
pub extern "C" fn vrnic_alloc_dm(
    ctx: *mut ibv_context,
    attr: *mut ibv_alloc_dm_attr,
) -> *mut ibv_dm {
    guard(null_err(libc::EIO), || {
        if ctx.is_null() || attr.is_null() {
            return null_err(libc::EINVAL);
        }
        // SAFETY: attr is the app's, readable for this call.
        let a = unsafe { attr.read() };
        if a.comp_mask != 0
            || a.length == 0
            || a.length as u64 > crate::limits::MAX_DM_SIZE
            || a.log_align_req > ALIGN.trailing_zeros()
        {
            return null_err(libc::EINVAL);
        }
        let size = a.length.div_ceil(ALIGN) * ALIGN;
        let Ok(layout) = Layout::from_size_align(size, ALIGN) else {
            return null_err(libc::EINVAL);
        };
        // SAFETY: the layout has a nonzero size.
        let buf = unsafe { std::alloc::alloc_zeroed(layout) };
        if buf.is_null() {
            return null_err(libc::ENOMEM);
        }
        let v = Box::new(VDm {
            dm: ibv_dm {
                context: ctx,
                memcpy_to_dm: Some(memcpy_to_dm),
                memcpy_from_dm: Some(memcpy_from_dm),
                comp_mask: 0,
                handle: 0,
            },
            buf,
            len: a.length,
            layout,
            mrs: AtomicU32::new(0),
        });
        Box::into_raw(v).cast()
    })
}

/// `verbs_context.free_dm`: `EBUSY` while MRs over it exist.
pub extern "C" fn vrnic_free_dm(dm: *mut ibv_dm) -> c_int {
    guard(libc::EIO, || {
        if dm.is_null() {
            return libc::EINVAL;
        }
        // SAFETY: every ibv_dm we hand out is a VDm, live until this call succeeds.
        let v = unsafe { &*dm.cast::<VDm>() };
        if v.mrs.load(Ordering::Acquire) > 0 {
            return libc::EBUSY;
        }
        let (buf, layout) = (v.buf, v.layout);
        // SAFETY: boxed by alloc_dm; the app gives it up now.
        drop(unsafe { Box::from_raw(dm.cast::<VDm>()) });
        // SAFETY: allocated by alloc_dm with this layout; no MR maps it any more.
        unsafe { std::alloc::dealloc(buf, layout) };
        0
    })
}

/// The DM range `[off, off + len)`, or `EFAULT` if it leaves the allocation (as mlx5).
fn range(dm: *mut ibv_dm, off: u64, len: usize) -> Result<*mut u8, c_int> {
    if dm.is_null() {
        return Err(libc::EINVAL);
    }
    // SAFETY: every ibv_dm we hand out is a VDm, live per the API.
    let v = unsafe { &*dm.cast::<VDm>() };
    let end = off.checked_add(len as u64).ok_or(libc::EFAULT)?;
    if end > v.len as u64 {
        return Err(libc::EFAULT);
    }
    // off < len of the buffer (checked above), so the pointer stays inside it.
    Ok(v.buf.wrapping_add(off as usize))
}

unsafe extern "C" fn memcpy_to_dm(
    dm: *mut ibv_dm,
    off: u64,
    src: *const c_void,
    len: usize,
) -> c_int {
    guard(libc::EIO, || match range(dm, off, len) {
        Ok(_) if len == 0 => 0,
        Ok(_) if src.is_null() => libc::EINVAL,
        Ok(at) => {
            // SAFETY: `at` has len bytes inside the DM buffer; the app vouches for len
            // readable bytes at src (verbs contract); they do not overlap our buffer's use.
            unsafe { std::ptr::copy(src.cast::<u8>(), at, len) };
            0
        }
        Err(e) => e,
    })
}

unsafe extern "C" fn memcpy_from_dm(
    dst: *mut c_void,
    dm: *mut ibv_dm,
    off: u64,
    len: usize,
) -> c_int {
    guard(libc::EIO, || match range(dm, off, len) {
        Ok(_) if len == 0 => 0,
        Ok(_) if dst.is_null() => libc::EINVAL,
        Ok(at) => {
            // SAFETY: as in memcpy_to_dm, the other way.
            unsafe { std::ptr::copy(at.cast_const(), dst.cast::<u8>(), len) };
            0
        }
        Err(e) => e,
    })
}

/// `verbs_context.reg_dm_mr`: `[off, off + len)` of the DM, zero based (`IBV_ACCESS_ZERO_BASED`
/// is required, as the kernel's `UVERBS_METHOD_DM_MR_REG` requires it); other access flags
/// than local/remote write, remote read and atomic, or a range outside the DM: `EINVAL`.
pub extern "C" fn vrnic_reg_dm_mr(
    pd: *mut ibv_pd,
    dm: *mut ibv_dm,
    off: u64,
    len: usize,
    acc: c_uint,
) -> *mut ibv_mr {
    guard(null_err(libc::EIO), || {
        let allowed = access::LOCAL_WRITE
            | access::REMOTE_WRITE
            | access::REMOTE_READ
            | access::REMOTE_ATOMIC
            | access::ZERO_BASED;
        if pd.is_null() || acc & access::ZERO_BASED == 0 || acc & !allowed != 0 || len == 0 {
            return null_err(libc::EINVAL);
        }
        let at = match range(dm, off, len) {
            Ok(at) => at,
            Err(_) => return null_err(libc::EINVAL),
        };
        // A registration of the DM's buffer whose addresses start at 0.
        let mr =
            super::mr::vrnic_ibv_reg_mr_iova2(pd, at.cast(), len, 0, acc & !access::ZERO_BASED);
        if mr.is_null() {
            return mr;
        }
        // SAFETY: dm is a live VDm (range checked it is not NULL).
        let counted = unsafe { &*dm.cast::<VDm>() };
        counted.mrs.fetch_add(1, Ordering::AcqRel);
        // As rdma-core's ibv_cmd_reg_dm_mr: the MR's address is its offset in the DM; and the
        // MR counts against the DM until it goes (`ibv_dereg_mr`).
        // SAFETY: mr was just made by us (a VMr); the app has not seen it yet.
        let v = unsafe { &mut *mr.cast::<VMr>() };
        v.mr.addr = off as usize as *mut c_void;
        v.dm_mrs = &raw const counted.mrs;
        mr
    })
}
