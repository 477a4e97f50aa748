//! The top of the `extern "C"` layer: `ibv_open_device`, which fills a context's ops tables
//! (`ibv_context_ops` and `verbs_context`) and so is the one file that names every verb
//! family, and `ibv_close_device`.
#![allow(unsafe_code)]
#![allow(clippy::not_unsafe_ptr_arg_deref)]

use std::collections::HashMap;
use std::ffi::{c_int, c_void};
use std::sync::Mutex;

use super::cq::{vrnic_poll_cq, vrnic_req_notify_cq};
use super::device::{vrnic_query_device_ex, vrnic_query_port};
use super::mr::{evict, vrnic_ibv_dereg_mr};
use super::objects::{VContext, VDevice, context, guard, minus_one, null_err, vctx_of};
use super::post::{vrnic_post_recv, vrnic_post_send};
use crate::abi::*;
use crate::client::Conn;
use crate::limits;
use crate::parked::Parked;

#[unsafe(no_mangle)]
pub extern "C" fn vrnic_ibv_open_device(dev: *mut ibv_device) -> *mut ibv_context {
    guard(null_err(libc::EIO), || {
        open_device(dev).unwrap_or_else(null_err)
    })
}

/// `ibv_open_device`, for the driver's own callers (the connection manager).
pub(crate) fn open_device(dev: *mut ibv_device) -> Result<*mut ibv_context, c_int> {
    if dev.is_null() {
        return Err(libc::EINVAL);
    }
    // SAFETY: dev came from our device list (VDevice starts with ibv_device).
    let info = unsafe { &(*dev.cast::<VDevice>()).info };
    let conn = Conn::open(info)?;
    // SAFETY: verbs_context is plain C data (fn pointers as Option, ints): zero is valid.
    let mut vctx: verbs_context = unsafe { std::mem::zeroed() };
    vctx.sz = std::mem::size_of::<verbs_context>();
    vctx.query_port = Some(vrnic_query_port);
    vctx.query_device_ex = Some(vrnic_query_device_ex);
    vctx.create_srq_ex = Some(super::srq::vrnic_create_srq_ex);
    vctx.create_qp_ex = Some(super::ex::vrnic_create_qp_ex);
    vctx.open_xrcd = Some(super::xrc::vrnic_open_xrcd);
    vctx.close_xrcd = Some(super::xrc::vrnic_close_xrcd);
    vctx.get_srq_num = Some(super::srq::vrnic_get_srq_num);
    vctx.create_cq_ex = Some(super::ex::vrnic_create_cq_ex);
    vctx.alloc_dm = Some(super::dm::vrnic_alloc_dm);
    vctx.free_dm = Some(super::dm::vrnic_free_dm);
    vctx.reg_dm_mr = Some(super::dm::vrnic_reg_dm_mr);
    vctx.query_rt_values = Some(super::ex::vrnic_query_rt_values);
    vctx.context.device = dev;
    vctx.context.cmd_fd = conn.fd();
    vctx.context.async_fd = conn.async_q.efd.fd();
    vctx.context.num_comp_vectors = limits::COMP_VECTORS;
    vctx.context.abi_compat = usize::MAX as *mut c_void;
    let ops = &mut vctx.context.ops;
    ops.poll_cq = Some(vrnic_poll_cq);
    ops.req_notify_cq = Some(vrnic_req_notify_cq);
    ops.post_send = Some(vrnic_post_send);
    ops.post_recv = Some(vrnic_post_recv);
    ops.post_srq_recv = Some(super::srq::vrnic_post_srq_recv);
    ops.alloc_mw = Some(super::mw::vrnic_alloc_mw);
    ops.dealloc_mw = Some(super::mw::vrnic_dealloc_mw);
    ops.bind_mw = Some(super::mw::vrnic_bind_mw);
    let b = Box::new(VContext {
        vctx,
        conn,
        qps: Mutex::new(HashMap::new()),
        cqs: Mutex::new(HashMap::new()),
        srqs: Mutex::new(HashMap::new()),
        mrs: Mutex::new(Default::default()),
        parked: Mutex::new(Parked::default()),
    });
    let p = Box::into_raw(b);
    // SAFETY: p is a live VContext we just leaked; `context` is its embedded ibv_context.
    Ok(unsafe { &raw mut (*p).vctx.context })
}

#[unsafe(no_mangle)]
pub extern "C" fn vrnic_ibv_close_device(ctx: *mut ibv_context) -> c_int {
    guard(-1, || {
        if ctx.is_null() {
            return minus_one(libc::EINVAL);
        }
        // Registered buffers go back to private memory (with their bytes) first; unless this
        // is a forked child's copy of its parent's context, whose registrations stay the
        // parent's (the child only lets go of its copy, as closing an inherited fd does).
        // SAFETY: ctx is a live context of ours.
        let c = unsafe { context(ctx) };
        let live: Vec<usize> = if c.conn.inherited() {
            Vec::new()
        } else {
            c.mrs
                .lock()
                .map(|m| m.iter().copied().collect())
                .unwrap_or_default()
        };
        for mr in live {
            vrnic_ibv_dereg_mr(mr as *mut ibv_mr);
        }
        if !c.conn.inherited() {
            let parked = c
                .parked
                .lock()
                .map(|mut p| p.take_all())
                .unwrap_or_default();
            evict(&c.conn, &parked);
        }
        // SAFETY: ctx is a live context of ours; after this call the app may not use it.
        let b = unsafe { Box::from_raw(vctx_of(ctx)) };
        b.conn.close();
        drop(b);
        0
    })
}
