//! Address handles for UD: `ibv_create_ah`, `ibv_destroy_ah`, and the two helpers that build
//! one from a received completion and its GRH (`ibv_init_ah_from_wc`,
//! `ibv_create_ah_from_wc`), with rdma-core's semantics.
//!
//! An AH is a daemon object (the engine checks that a UD work request names an AH of the
//! sending QP's PD); the app holds its handle in `ibv_ah.handle`, which `post_send` copies into
//! the WQE.
#![allow(unsafe_code)]
#![allow(clippy::not_unsafe_ptr_arg_deref)]

use std::ffi::c_int;

use vrnic_api::{Reply, Request};

use super::objects::{ah_from_c, context, guard, minus_one, null_err};
use crate::abi::*;

#[repr(C)]
struct VAh {
    ah: ibv_ah,
}

#[unsafe(no_mangle)]
pub extern "C" fn vrnic_ibv_create_ah(pd: *mut ibv_pd, attr: *mut ibv_ah_attr) -> *mut ibv_ah {
    guard(null_err(libc::EIO), || {
        if pd.is_null() || attr.is_null() {
            return null_err(libc::EINVAL);
        }
        // SAFETY: pd is ours and live.
        let p = unsafe { &*pd };
        // SAFETY: attr is caller-owned.
        let a = unsafe { &*attr };
        let (ctx, pdh) = (p.context, p.handle);
        // SAFETY: the PD's context outlives it.
        let c = unsafe { context(ctx) };
        let attr = ah_from_c(a);
        if let Err(e) = crate::limits::check_ah(&attr) {
            return null_err(e);
        }
        let req = Request::CreateAh { pd: pdh, attr };
        let h = match c.conn.call(&req) {
            Ok(Reply::Handle(h)) => h,
            Ok(_) => return null_err(libc::EPROTO),
            Err(e) => return null_err(e),
        };
        let p = Box::into_raw(Box::new(VAh {
            ah: ibv_ah {
                context: ctx,
                pd,
                handle: h,
            },
        }));
        p.cast()
    })
}

#[unsafe(no_mangle)]
pub extern "C" fn vrnic_ibv_destroy_ah(ah: *mut ibv_ah) -> c_int {
    guard(libc::EIO, || {
        if ah.is_null() {
            return libc::EINVAL;
        }
        // SAFETY: ah is ours and live.
        let a = unsafe { &*ah };
        let (ctx, h) = (a.context, a.handle);
        // SAFETY: the AH's context outlives it.
        let c = unsafe { context(ctx) };
        if let Err(e) = c.conn.call(&Request::DestroyAh { ah: h }) {
            return e;
        }
        // SAFETY: boxed by create_ah; the app gives it up now.
        drop(unsafe { Box::from_raw(ah.cast::<VAh>()) });
        0
    })
}

/// rdma-core's `ibv_init_ah_from_wc`: the address that answers a received datagram. With a
/// GRH, the reply goes to its source GID from the local GID it was sent to (which must be in
/// this port's GID table, else -1/`ENOENT`).
#[unsafe(no_mangle)]
pub extern "C" fn vrnic_ibv_init_ah_from_wc(
    ctx: *mut ibv_context,
    port: u8,
    wc: *mut ibv_wc,
    grh: *mut ibv_grh,
    out: *mut ibv_ah_attr,
) -> c_int {
    guard(-1, || {
        if ctx.is_null() || wc.is_null() || out.is_null() {
            return minus_one(libc::EINVAL);
        }
        // SAFETY: wc is caller-owned.
        let w = unsafe { &*wc };
        // SAFETY: plain C data; zero is valid.
        let mut a: ibv_ah_attr = unsafe { std::mem::zeroed() };
        a.dlid = w.slid;
        a.sl = w.sl;
        a.src_path_bits = w.dlid_path_bits;
        a.port_num = port;
        if w.wc_flags & IBV_WC_GRH != 0 {
            if grh.is_null() {
                return minus_one(libc::EINVAL);
            }
            // SAFETY: with IBV_WC_GRH the app passes the 40 GRH bytes of its receive buffer.
            let g = unsafe { grh.read_unaligned() };
            // SAFETY: ctx is ours.
            let own = unsafe { context(ctx) }.conn.info.gid;
            // SAFETY: reading the raw bytes of a 16-byte union is always valid.
            if unsafe { g.dgid.raw } != own {
                return minus_one(libc::ENOENT);
            }
            let flow = u32::from_be(g.version_tclass_flow);
            a.is_global = 1;
            a.grh.dgid = g.sgid;
            a.grh.sgid_index = 0;
            a.grh.flow_label = flow & 0xf_ffff;
            a.grh.hop_limit = 0xff;
            a.grh.traffic_class = ((flow >> 20) & 0xff) as u8;
        }
        // SAFETY: out is caller-owned.
        unsafe { out.write(a) };
        0
    })
}

#[unsafe(no_mangle)]
pub extern "C" fn vrnic_ibv_create_ah_from_wc(
    pd: *mut ibv_pd,
    wc: *mut ibv_wc,
    grh: *mut ibv_grh,
    port: u8,
) -> *mut ibv_ah {
    guard(null_err(libc::EIO), || {
        if pd.is_null() {
            return null_err(libc::EINVAL);
        }
        // SAFETY: plain C data; zero is valid.
        let mut a: ibv_ah_attr = unsafe { std::mem::zeroed() };
        // SAFETY: pd is ours and live.
        let ctx = unsafe { (*pd).context };
        if vrnic_ibv_init_ah_from_wc(ctx, port, wc, grh, &mut a) != 0 {
            return std::ptr::null_mut();
        }
        vrnic_ibv_create_ah(pd, &mut a)
    })
}
