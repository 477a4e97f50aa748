//! Memory windows: `ibv_alloc_mw`/`ibv_dealloc_mw` (the `alloc_mw`/`dealloc_mw` ops behind
//! the verbs.h inlines, remoted to the daemon), `ibv_bind_mw` (the `bind_mw` op: a type 1
//! bind posted as an `IBV_WR_BIND_MW` work request, as rxe's provider does), and the fields a
//! bind work request carries in its WQE, for `ibv_post_send` and `ibv_wr_bind_mw` alike.
//!
//! The engine executes the bind when the work request reaches the head of the send queue and
//! checks everything again (the window's owner, its MR, the range, the access, the key): what
//! the driver checks here only gives the app the errno rdma-core's inlines and providers give
//! at the call.
#![allow(unsafe_code)]

use std::ffi::{c_int, c_uint};

use vrnic_api::{Reply, Request};
use vrnic_wire::access;

use super::objects::{context, guard, null_err};
use crate::abi::*;

/// The device capability bits that memory windows earn in `ibv_query_device`.
pub const CAP_FLAGS: c_uint = IBV_DEVICE_MEM_WINDOW | IBV_DEVICE_MEM_WINDOW_TYPE_2B;

/// `max_mw`: windows per vRNIC (the engine's `MAX_MW`).
pub const MAX_MW: c_int = 65536;

/// `ibv_inc_rkey`: the next consumer key of a window (the low 8 bits), as verbs.h computes it.
fn inc_rkey(rkey: u32) -> u32 {
    (rkey & 0xffff_ff00) | (rkey.wrapping_add(1) & 0xff)
}

/// The WQE fields of a bind of `mw` under the new key `rkey` to `info`: `(remote_addr,
/// rkey, imm_data = access, compare_add = length, swap = window handle << 32 | MR lkey)`
/// (see `vrnic_wire::SendOpcode::BindMw`). `EINVAL` for no window or binding, a range
/// without an MR, or a zero-based window (rxe's provider refuses those at the call).
pub(crate) fn bind_fields(
    mw: *const ibv_mw,
    rkey: u32,
    info: *const ibv_mw_bind_info,
) -> Result<(u64, u32, u32, u64, u64), c_int> {
    if mw.is_null() || info.is_null() {
        return Err(libc::EINVAL);
    }
    // SAFETY: a non-NULL window in a work request is one of ours, live (verbs contract).
    let handle = unsafe { (*mw).handle };
    // SAFETY: info points to the app's binding, readable for this call.
    let b = unsafe { info.read() };
    if b.mw_access_flags & access::ZERO_BASED != 0 {
        return Err(libc::EINVAL);
    }
    let lkey = if b.mr.is_null() {
        if b.addr != 0 || b.length != 0 {
            return Err(libc::EINVAL);
        }
        0
    } else {
        // SAFETY: a non-NULL MR in a binding is one of ours, live.
        unsafe { (*b.mr).lkey }
    };
    Ok((
        b.addr,
        rkey,
        b.mw_access_flags,
        b.length,
        u64::from(handle) << 32 | u64::from(lkey),
    ))
}

/// `ibv_context_ops.alloc_mw`: a window of `ty` (`IBV_MW_TYPE_1` or `_2`) in `pd`.
pub extern "C" fn vrnic_alloc_mw(pd: *mut ibv_pd, ty: c_uint) -> *mut ibv_mw {
    guard(null_err(libc::EIO), || {
        if pd.is_null() {
            return null_err(libc::EINVAL);
        }
        if ty != IBV_MW_TYPE_1 && ty != IBV_MW_TYPE_2 {
            return null_err(libc::EINVAL);
        }
        // SAFETY: pd is ours and live.
        let p = unsafe { &*pd };
        let (ctx, pdh) = (p.context, p.handle);
        // SAFETY: the PD's context outlives it.
        let c = unsafe { context(ctx) };
        match c.conn.call(&Request::AllocMw { pd: pdh, ty }) {
            Ok(Reply::Mw { mw, rkey }) => Box::into_raw(Box::new(ibv_mw {
                context: ctx,
                pd,
                rkey,
                handle: mw,
                type_: ty,
            })),
            Ok(_) => null_err(libc::EPROTO),
            Err(e) => null_err(e),
        }
    })
}

/// `ibv_context_ops.dealloc_mw`: the window goes, bound or not.
pub extern "C" fn vrnic_dealloc_mw(mw: *mut ibv_mw) -> c_int {
    guard(libc::EIO, || {
        if mw.is_null() {
            return libc::EINVAL;
        }
        // SAFETY: mw is ours and live.
        let w = unsafe { &*mw };
        let (ctx, h) = (w.context, w.handle);
        // SAFETY: the window's context outlives it.
        let c = unsafe { context(ctx) };
        if let Err(e) = c.conn.call(&Request::DeallocMw { mw: h }) {
            return e;
        }
        // SAFETY: boxed by alloc_mw; the app gives it up now.
        drop(unsafe { Box::from_raw(mw) });
        0
    })
}

/// `ibv_context_ops.bind_mw` (behind the `ibv_bind_mw` inline, which has checked the type and
/// the MR's PD): posts a bind work request with the window's next key and, once posted, gives
/// the window that key (the app undoes it if the completion reports an error, as with rxe).
pub extern "C" fn vrnic_bind_mw(qp: *mut ibv_qp, mw: *mut ibv_mw, bind: *mut ibv_mw_bind) -> c_int {
    guard(libc::EIO, || {
        if qp.is_null() || mw.is_null() || bind.is_null() {
            return libc::EINVAL;
        }
        // SAFETY: mw is ours and live.
        let w = unsafe { &*mw };
        let (ty, rkey) = (w.type_, w.rkey);
        if ty != IBV_MW_TYPE_1 {
            return libc::EINVAL;
        }
        // SAFETY: bind is the app's, readable for this call.
        let b = unsafe { bind.read() };
        // SAFETY: plain C data; zero is valid (NULL pointers, zero numbers).
        let mut wr: ibv_send_wr = unsafe { std::mem::zeroed() };
        wr.wr_id = b.wr_id;
        wr.opcode = IBV_WR_BIND_MW;
        wr.send_flags = b.send_flags;
        let key = inc_rkey(rkey);
        wr.bind_mw_or_tso.bind_mw = ibv_send_wr_bind_mw {
            mw,
            rkey: key,
            bind_info: b.bind_info,
        };
        let mut bad = std::ptr::null_mut();
        let rc = super::post::vrnic_post_send(qp, &raw mut wr, &raw mut bad);
        if rc == 0 {
            // SAFETY: mw is ours and live; the app reads rkey only between verbs calls.
            unsafe { (*mw).rkey = key };
        }
        rc
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn inc_rkey_steps_the_consumer_byte_only() {
        assert_eq!(inc_rkey(0x1234_56fe), 0x1234_56ff);
        assert_eq!(inc_rkey(0x1234_56ff), 0x1234_5600);
    }
}
