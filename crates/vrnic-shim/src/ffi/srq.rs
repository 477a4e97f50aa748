//! Shared receive queues: `ibv_create_srq`/`_ex`, `ibv_modify_srq`, `ibv_query_srq`,
//! `ibv_destroy_srq` (control path, remoted to the daemon) and `post_srq_recv` (data path: a
//! receive ring in the region that the engine reads for every QP attached to the SRQ).
//!
//! Basic and XRC SRQs exist (an XRC SRQ names its domain and the CQ its receives complete on,
//! and has a number, `ibv_get_srq_num`, that XRC senders name); tag-matching SRQs fail with
//! `EOPNOTSUPP`. Resizing
//! (`IBV_SRQ_MAX_WR`, the device reports `IBV_DEVICE_SRQ_RESIZE`) grows or shrinks the SRQ
//! keeping its posted receives: the daemon takes every receive published into the engine and
//! moves the SRQ to a ring of the new depth whose indices carry on from the old one.
#![allow(unsafe_code)]
#![allow(clippy::not_unsafe_ptr_arg_deref)]

use std::ffi::{c_int, c_void};
use std::sync::Mutex;

use vrnic_api::{Reply, Request};
use vrnic_shm::Ring;
use vrnic_wire::RQ_SLOT;

use super::objects::{context, fail_at, guard, null_err, post_recv_list, xrcd_handle};
use crate::abi::*;
use crate::client::WorkQueue;

/// An SRQ: `ibv_srq` first (container_of), then its ring.
#[repr(C)]
struct VSrq {
    srq: ibv_srq,
    rq: Mutex<WorkQueue>,
    max_sge: u32,
    /// Its SRQ number.
    srqn: u32,
}

fn create(
    ctx: *mut ibv_context,
    pd: *mut ibv_pd,
    srq_context: *mut c_void,
    attr: &mut ibv_srq_attr,
    xrc: Option<(u32, u32)>,
) -> Result<*mut ibv_srq, c_int> {
    // SAFETY: ctx is ours (the PD's context).
    let c = unsafe { context(ctx) };
    crate::limits::check_srq(&c.conn.info, attr.max_wr, attr.max_sge, attr.srq_limit)?;
    // SAFETY: pd is ours and live.
    let pdh = unsafe { (*pd).handle };
    let req = Request::CreateSrq {
        pd: pdh,
        max_wr: attr.max_wr,
        max_sge: attr.max_sge,
        limit: attr.srq_limit,
        xrc,
    };
    let (h, ring, depth, bell, srqn) = match c.conn.call(&req) {
        Ok(Reply::Srq {
            srq,
            ring,
            depth,
            bell,
            srqn,
        }) => (srq, ring, depth, bell, srqn),
        Ok(_) => return Err(libc::EPROTO),
        Err(e) => return Err(e),
    };
    let Ok(ring) = Ring::new(&c.conn.region, ring, depth, RQ_SLOT) else {
        let _ = c.conn.call(&Request::DestroySrq { srq: h });
        return Err(libc::EPROTO);
    };
    attr.max_sge = attr.max_sge.max(1);
    // SAFETY: plain C data plus pthread objects (all-zero is their initializer in glibc).
    let mut s: ibv_srq = unsafe { std::mem::zeroed() };
    s.context = ctx;
    s.srq_context = srq_context;
    s.pd = pd;
    s.handle = h;
    let p = Box::into_raw(Box::new(VSrq {
        srq: s,
        rq: Mutex::new(WorkQueue::new(ring, bell, attr.max_wr)),
        max_sge: attr.max_sge,
        srqn,
    }));
    if let Ok(mut m) = c.srqs.lock() {
        m.insert(h, p as usize);
    }
    Ok(p.cast())
}

#[unsafe(no_mangle)]
pub extern "C" fn vrnic_ibv_create_srq(
    pd: *mut ibv_pd,
    init: *mut ibv_srq_init_attr,
) -> *mut ibv_srq {
    guard(null_err(libc::EIO), || {
        create_srq(pd, init).unwrap_or_else(null_err)
    })
}

/// `ibv_create_srq`, for the driver's own callers.
pub(crate) fn create_srq(
    pd: *mut ibv_pd,
    init: *mut ibv_srq_init_attr,
) -> Result<*mut ibv_srq, c_int> {
    if pd.is_null() || init.is_null() {
        return Err(libc::EINVAL);
    }
    // SAFETY: init is caller-owned.
    let ia = unsafe { &mut *init };
    // SAFETY: pd is ours and live.
    let ctx = unsafe { &*pd }.context;
    create(ctx, pd, ia.srq_context, &mut ia.attr, None)
}

/// `verbs_context.create_srq_ex` (the `ibv_create_srq_ex` inline).
pub extern "C" fn vrnic_create_srq_ex(
    ctx: *mut ibv_context,
    init: *mut ibv_srq_init_attr_ex,
) -> *mut ibv_srq {
    guard(null_err(libc::EIO), || {
        create_srq_ex(ctx, init).unwrap_or_else(null_err)
    })
}

/// `ibv_create_srq_ex`, for the driver's own callers.
pub(crate) fn create_srq_ex(
    ctx: *mut ibv_context,
    init: *mut ibv_srq_init_attr_ex,
) -> Result<*mut ibv_srq, c_int> {
    if ctx.is_null() || init.is_null() {
        return Err(libc::EINVAL);
    }
    // SAFETY: init is caller-owned.
    let ia = unsafe { &mut *init };
    let known = IBV_SRQ_INIT_ATTR_TYPE
        | IBV_SRQ_INIT_ATTR_PD
        | IBV_SRQ_INIT_ATTR_XRCD
        | IBV_SRQ_INIT_ATTR_CQ
        | IBV_SRQ_INIT_ATTR_TM;
    if ia.comp_mask & !known != 0 || ia.comp_mask & IBV_SRQ_INIT_ATTR_PD == 0 || ia.pd.is_null() {
        return Err(libc::EINVAL);
    }
    let ty = if ia.comp_mask & IBV_SRQ_INIT_ATTR_TYPE != 0 {
        ia.srq_type
    } else {
        IBV_SRQT_BASIC
    };
    let xrc = match ty {
        IBV_SRQT_BASIC => None,
        IBV_SRQT_XRC => {
            // An XRC SRQ names its domain and its CQ (rdma-core's `ibv_cmd_create_srq_ex`).
            let need = IBV_SRQ_INIT_ATTR_XRCD | IBV_SRQ_INIT_ATTR_CQ;
            if ia.comp_mask & need != need || ia.xrcd.is_null() || ia.cq.is_null() {
                return Err(libc::EINVAL);
            }
            // SAFETY: a non-NULL XRC domain and CQ in the app's attributes are ours, live.
            let x = unsafe { xrcd_handle(ia.xrcd) };
            // SAFETY: as above.
            Some((x, unsafe { (*ia.cq).handle }))
        }
        _ => return Err(libc::EOPNOTSUPP),
    };
    if ia.comp_mask & IBV_SRQ_INIT_ATTR_TM != 0 {
        return Err(libc::EOPNOTSUPP);
    }
    create(ctx, ia.pd, ia.srq_context, &mut ia.attr, xrc)
}

#[unsafe(no_mangle)]
pub extern "C" fn vrnic_ibv_modify_srq(
    srq: *mut ibv_srq,
    attr: *mut ibv_srq_attr,
    mask: c_int,
) -> c_int {
    guard(libc::EIO, || {
        if srq.is_null() || attr.is_null() {
            return libc::EINVAL;
        }
        if mask & !(IBV_SRQ_MAX_WR | IBV_SRQ_LIMIT) != 0 {
            return libc::EINVAL;
        }
        // SAFETY: srq is ours and live (every SRQ we hand out is a VSrq).
        let v = unsafe { &*srq.cast::<VSrq>() };
        // SAFETY: attr is caller-owned.
        let a = unsafe { &*attr };
        // SAFETY: the SRQ's context outlives it.
        let c = unsafe { context(v.srq.context) };
        let resize = mask & IBV_SRQ_MAX_WR != 0;
        if resize && (a.max_wr == 0 || a.max_wr > c.conn.info.max_qp_wr) {
            return libc::EINVAL;
        }
        let req = Request::ModifySrq {
            srq: v.srq.handle,
            resize: resize.then_some(a.max_wr),
            limit: (mask & IBV_SRQ_LIMIT != 0).then_some(a.srq_limit),
        };
        if !resize {
            return match c.conn.call(&req) {
                Ok(_) => 0,
                Err(e) => e,
            };
        }
        // No post while the ring moves: the daemon takes what was published, then answers
        // with the ring the SRQ uses from now on.
        let Ok(mut rq) = v.rq.lock() else {
            return libc::EIO;
        };
        match c.conn.call(&req) {
            Ok(Reply::Srq { ring, depth, .. }) => {
                let Ok(ring) = Ring::new(&c.conn.region, ring, depth, RQ_SLOT) else {
                    return libc::EPROTO;
                };
                rq.resize(ring, a.max_wr);
                0
            }
            Ok(_) => libc::EPROTO,
            Err(e) => e,
        }
    })
}

#[unsafe(no_mangle)]
pub extern "C" fn vrnic_ibv_query_srq(srq: *mut ibv_srq, attr: *mut ibv_srq_attr) -> c_int {
    guard(libc::EIO, || {
        if srq.is_null() || attr.is_null() {
            return libc::EINVAL;
        }
        // SAFETY: srq is ours and live.
        let s = unsafe { &*srq };
        // SAFETY: the SRQ's context outlives it.
        let c = unsafe { context(s.context) };
        match c.conn.call(&Request::QuerySrq { srq: s.handle }) {
            Ok(Reply::SrqAttr {
                max_wr,
                max_sge,
                limit,
            }) => {
                // SAFETY: attr is caller-owned.
                unsafe {
                    attr.write(ibv_srq_attr {
                        max_wr,
                        max_sge,
                        srq_limit: limit,
                    })
                };
                0
            }
            Ok(_) => libc::EPROTO,
            Err(e) => e,
        }
    })
}

#[unsafe(no_mangle)]
pub extern "C" fn vrnic_ibv_destroy_srq(srq: *mut ibv_srq) -> c_int {
    guard(libc::EIO, || destroy_srq(srq).err().unwrap_or(0))
}

/// `ibv_destroy_srq`, for the driver's own callers.
pub(crate) fn destroy_srq(srq: *mut ibv_srq) -> Result<(), c_int> {
    if srq.is_null() {
        return Err(libc::EINVAL);
    }
    // SAFETY: srq is ours and live.
    let s = unsafe { &*srq };
    let (ctx, h) = (s.context, s.handle);
    // SAFETY: the SRQ's context outlives it.
    let c = unsafe { context(ctx) };
    c.conn.call(&Request::DestroySrq { srq: h })?;
    if let Ok(mut m) = c.srqs.lock() {
        m.remove(&h);
    }
    c.conn.withdraw_events(super::objects::SRQ_EVENTS, h);
    // SAFETY: boxed by create; the app gives it up now.
    drop(unsafe { Box::from_raw(srq.cast::<VSrq>()) });
    Ok(())
}

/// `ibv_context_ops.post_srq_recv`: receive WQEs into the SRQ's ring, as `post_recv` does
/// for a QP's own queue.
pub extern "C" fn vrnic_post_srq_recv(
    srq: *mut ibv_srq,
    wr: *mut ibv_recv_wr,
    bad: *mut *mut ibv_recv_wr,
) -> c_int {
    guard(libc::EIO, || {
        if srq.is_null() {
            return fail_at(bad, wr, libc::EINVAL);
        }
        // SAFETY: srq is ours and live.
        let v = unsafe { &*srq.cast::<VSrq>() };
        // SAFETY: the SRQ's context outlives it.
        let conn = &unsafe { context(v.srq.context) }.conn;
        post_recv_list(&v.rq, conn, wr, bad, v.max_sge)
    })
}

/// `verbs_context.get_srq_num` (the `ibv_get_srq_num` inline): the number XRC senders name.
pub extern "C" fn vrnic_get_srq_num(srq: *mut ibv_srq, srq_num: *mut u32) -> c_int {
    guard(libc::EIO, || {
        if srq.is_null() || srq_num.is_null() {
            return libc::EINVAL;
        }
        // SAFETY: srq is one of ours (VSrq starts with ibv_srq).
        let n = unsafe { &*srq.cast::<VSrq>() }.srqn;
        // SAFETY: srq_num is the caller's.
        unsafe { srq_num.write(n) };
        0
    })
}
