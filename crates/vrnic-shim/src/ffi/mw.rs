//! Memory windows: `ibv_alloc_mw`/`ibv_dealloc_mw` (the `alloc_mw`/`dealloc_mw` ops behind
//! the verbs.h inlines, remoted to the daemon), `ibv_bind_mw` (the `bind_mw` op: a type 1
//! bind posted as an `IBV_WR_BIND_MW` work request, as rxe's provider does, through the QP's
//! ops table as `ibv_post_send` posts). The fields a bind work request carries in its WQE, for
//! `ibv_post_send` and `ibv_wr_bind_mw` alike, are `objects::bind_fields`.
//!
//! The engine executes the bind when the work request reaches the head of the send queue and
//! checks everything again (the window's owner, its MR, the range, the access, the key): what
//! the driver checks here only gives the app the errno rdma-core's inlines and providers give
//! at the call.
#![allow(unsafe_code)]

use std::ffi::{c_int, c_uint};

use vrnic_api::{Reply, Request};

use super::objects::{context, guard, null_err};
use crate::abi::*;

/// `ibv_inc_rkey`: the next consumer key of a window (the low 8 bits), as verbs.h computes it.
fn inc_rkey(rkey: u32) -> u32 {
    (rkey & 0xffff_ff00) | (rkey.wrapping_add(1) & 0xff)
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
        // Posted as `ibv_post_send` posts, through the QP's context's ops table.
        // SAFETY: qp is ours and live.
        let ctx = unsafe { (*qp).context };
        // SAFETY: the QP's context is ours and outlives it.
        let Some(post_send) = (unsafe { (*ctx).ops.post_send }) else {
            return libc::EIO;
        };
        // SAFETY: our own post_send (the table of our contexts names it), with a live QP and a
        // one-entry list on this stack.
        let rc = unsafe { post_send(qp, &raw mut wr, &raw mut bad) };
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
