//! Queue pairs' control path: `ibv_create_qp` (and the two XRC QP types, for
//! `ibv_create_qp_ex`), `ibv_modify_qp`, `ibv_query_qp`, `ibv_destroy_qp`, and the QP
//! attributes between their C and wire forms.
#![allow(unsafe_code)]
#![allow(clippy::not_unsafe_ptr_arg_deref)]

use std::ffi::{c_int, c_uint};
use std::ptr::null_mut;
use std::sync::atomic::Ordering;

use vrnic_api::{Reply, Request};
use vrnic_wire::{QpAttr, QpCap, QpState, QpType};

use super::objects::{
    QP_EVENTS, VCq, VQp, ah_from_c, ah_to_c, context, guard, make_qp, null_err, xrcd_handle,
};
use crate::abi::*;
use crate::client::{Conn, vlog};
use crate::limits;

#[unsafe(no_mangle)]
pub extern "C" fn vrnic_ibv_create_qp(pd: *mut ibv_pd, init: *mut ibv_qp_init_attr) -> *mut ibv_qp {
    guard(null_err(libc::EIO), || {
        create_qp(pd, init).unwrap_or_else(null_err)
    })
}

/// `ibv_create_qp`, for the driver's own callers (`ibv_create_qp_ex`, the connection manager).
pub(crate) fn create_qp(
    pd: *mut ibv_pd,
    init: *mut ibv_qp_init_attr,
) -> Result<*mut ibv_qp, c_int> {
    if pd.is_null() || init.is_null() {
        return Err(libc::EINVAL);
    }
    // SAFETY: init is a caller-owned ibv_qp_init_attr.
    let ia = unsafe { &mut *init };
    if ia.qp_type == IBV_QPT_XRC_SEND {
        // `ibv_create_qp_ex` with a PD alone comes here (verbs.h): the XRC path.
        // SAFETY: plain C data; zero is valid.
        let mut x: ibv_qp_init_attr_ex = unsafe { std::mem::zeroed() };
        x.qp_context = ia.qp_context;
        x.send_cq = ia.send_cq;
        x.cap = ia.cap;
        x.qp_type = ia.qp_type;
        x.sq_sig_all = ia.sq_sig_all;
        x.comp_mask = IBV_QP_INIT_ATTR_PD;
        x.pd = pd;
        // SAFETY: pd is ours and live.
        let qp = create_xrc_qp(unsafe { &*pd }.context, &mut x);
        ia.cap = x.cap;
        return qp;
    }
    if ia.send_cq.is_null() || ia.recv_cq.is_null() {
        return Err(libc::EINVAL);
    }
    // SAFETY: a non-NULL SRQ in the app's init attributes is one of ours, live.
    let srq = (!ia.srq.is_null()).then(|| unsafe { (*ia.srq).handle });
    let qp_type = match ia.qp_type {
        IBV_QPT_RC => QpType::Rc,
        IBV_QPT_UC => QpType::Uc,
        IBV_QPT_UD => QpType::Ud,
        _ => return Err(libc::EOPNOTSUPP),
    };
    let cap = QpCap {
        max_send_wr: ia.cap.max_send_wr,
        max_recv_wr: ia.cap.max_recv_wr,
        max_send_sge: ia.cap.max_send_sge,
        max_recv_sge: ia.cap.max_recv_sge,
        max_inline_data: ia.cap.max_inline_data,
    };
    // SAFETY: pd is ours and live.
    let pdr = unsafe { &*pd };
    // SAFETY: the PD's context outlives it.
    limits::check_qp_cap(&unsafe { context(pdr.context) }.conn.info, &cap)?;
    // SAFETY: the CQs named in the app's init attributes are ours and live.
    let scq = unsafe { &*ia.send_cq }.handle;
    // SAFETY: as above.
    let rcq = unsafe { &*ia.recv_cq }.handle;
    let (ctx, pdh) = (pdr.context, pdr.handle);
    let req = Request::CreateQp {
        pd: pdh,
        send_cq: scq,
        recv_cq: rcq,
        qp_type,
        cap,
        sq_sig_all: ia.sq_sig_all != 0,
        srq,
        xrcd: None,
    };
    make_qp(ctx, pd, ia, &req)
}

fn state_from_c(s: c_uint) -> Option<QpState> {
    QpState::from_u32(s)
}

fn attr_from_c(a: &ibv_qp_attr) -> Option<QpAttr> {
    Some(QpAttr {
        qp_state: state_from_c(a.qp_state)?,
        cur_qp_state: state_from_c(a.cur_qp_state).unwrap_or_default(),
        path_mtu: a.path_mtu as u8,
        path_mig_state: a.path_mig_state as u8,
        qkey: a.qkey,
        rq_psn: a.rq_psn,
        sq_psn: a.sq_psn,
        dest_qp_num: a.dest_qp_num,
        qp_access_flags: a.qp_access_flags,
        cap: QpCap {
            max_send_wr: a.cap.max_send_wr,
            max_recv_wr: a.cap.max_recv_wr,
            max_send_sge: a.cap.max_send_sge,
            max_recv_sge: a.cap.max_recv_sge,
            max_inline_data: a.cap.max_inline_data,
        },
        ah_attr: ah_from_c(&a.ah_attr),
        alt_ah_attr: ah_from_c(&a.alt_ah_attr),
        pkey_index: a.pkey_index,
        alt_pkey_index: a.alt_pkey_index,
        en_sqd_async_notify: a.en_sqd_async_notify,
        sq_draining: a.sq_draining,
        max_rd_atomic: a.max_rd_atomic,
        max_dest_rd_atomic: a.max_dest_rd_atomic,
        min_rnr_timer: a.min_rnr_timer,
        port_num: a.port_num,
        timeout: a.timeout,
        retry_cnt: a.retry_cnt,
        rnr_retry: a.rnr_retry,
        alt_port_num: a.alt_port_num,
        alt_timeout: a.alt_timeout,
    })
}

fn attr_to_c(a: &QpAttr) -> ibv_qp_attr {
    // SAFETY: plain C data; zero is valid.
    let mut c: ibv_qp_attr = unsafe { std::mem::zeroed() };
    c.qp_state = a.qp_state as c_uint;
    c.cur_qp_state = a.qp_state as c_uint;
    c.path_mtu = c_uint::from(a.path_mtu);
    c.path_mig_state = c_uint::from(a.path_mig_state);
    c.qkey = a.qkey;
    c.rq_psn = a.rq_psn;
    c.sq_psn = a.sq_psn;
    c.dest_qp_num = a.dest_qp_num;
    c.qp_access_flags = a.qp_access_flags as _;
    c.cap.max_send_wr = a.cap.max_send_wr;
    c.cap.max_recv_wr = a.cap.max_recv_wr;
    c.cap.max_send_sge = a.cap.max_send_sge;
    c.cap.max_recv_sge = a.cap.max_recv_sge;
    c.cap.max_inline_data = a.cap.max_inline_data;
    c.ah_attr = ah_to_c(&a.ah_attr);
    c.alt_ah_attr = ah_to_c(&a.alt_ah_attr);
    c.pkey_index = a.pkey_index;
    c.alt_pkey_index = a.alt_pkey_index;
    c.en_sqd_async_notify = a.en_sqd_async_notify;
    c.sq_draining = a.sq_draining;
    c.max_rd_atomic = a.max_rd_atomic;
    c.max_dest_rd_atomic = a.max_dest_rd_atomic;
    c.min_rnr_timer = a.min_rnr_timer;
    c.port_num = a.port_num;
    c.timeout = a.timeout;
    c.retry_cnt = a.retry_cnt;
    c.rnr_retry = a.rnr_retry;
    c.alt_port_num = a.alt_port_num;
    c.alt_timeout = a.alt_timeout;
    c
}

#[unsafe(no_mangle)]
pub extern "C" fn vrnic_ibv_modify_qp(
    qp: *mut ibv_qp,
    attr: *mut ibv_qp_attr,
    mask: c_int,
) -> c_int {
    guard(libc::EIO, || modify_qp(qp, attr, mask).err().unwrap_or(0))
}

/// `ibv_modify_qp`, for the driver's own callers.
pub(crate) fn modify_qp(qp: *mut ibv_qp, attr: *mut ibv_qp_attr, mask: c_int) -> Result<(), c_int> {
    if qp.is_null() || attr.is_null() {
        return Err(libc::EINVAL);
    }
    // SAFETY: qp is ours and live.
    let v = unsafe { &*qp.cast::<VQp>() };
    // SAFETY: attr is caller-owned.
    let a = unsafe { &*attr };
    let mask = mask as u32;
    let mut qa = match attr_from_c(a) {
        Some(q) => q,
        None if mask & vrnic_wire::qp_attr::STATE == 0 => {
            let mut a2 = *a;
            a2.qp_state = IBV_QPS_RESET;
            match attr_from_c(&a2) {
                Some(q) => q,
                None => return Err(libc::EINVAL),
            }
        }
        None => return Err(libc::EINVAL),
    };
    if mask & vrnic_wire::qp_attr::STATE == 0 {
        qa.qp_state = state_from_c(v.state.load(Ordering::Acquire)).unwrap_or_default();
    }
    limits::check_qp_attr(mask, &qa)?;
    // SAFETY: the QP's context outlives it.
    let conn = &unsafe { context(v.qp.qp_base.context) }.conn;
    match conn.call(&Request::ModifyQp {
        qp: v.qp.qp_base.handle,
        mask,
        attr: Box::new(qa),
    }) {
        Ok(_) => {
            if mask & vrnic_wire::qp_attr::STATE != 0 {
                v.state.store(a.qp_state, Ordering::Release);
                // SAFETY: `state` is a plain field apps read; we own the QP struct.
                unsafe { (*qp).state = a.qp_state };
                if a.qp_state == IBV_QPS_RESET {
                    // The daemon dropped what the rings held and published their consumer
                    // indices before it answered: start the rings afresh from there.
                    if let (Ok(mut sq), Ok(mut rq)) = (v.sq.lock(), v.rq.lock()) {
                        sq.restart(&conn.region);
                        rq.restart(&conn.region);
                    }
                    // SAFETY: qp is ours and live.
                    clean_cqs(unsafe { &*qp }, conn);
                }
            }
            Ok(())
        }
        Err(e) => Err(e),
    }
}

/// Removes `qp`'s completions from its CQs, once the daemon has answered its move to RESET
/// or its destruction (by then every completion the QP will ever have is in the rings). A real
/// device's provider does the same (mlx5: `mlx5_cq_clean` on RESET and on destroy), so a QP
/// reused after RESET never shows completions of its previous life.
fn clean_cqs(qp: &ibv_qp, conn: &Conn) {
    let cqs = if qp.recv_cq == qp.send_cq {
        [qp.send_cq, null_mut()]
    } else {
        [qp.send_cq, qp.recv_cq]
    };
    for cq in cqs.into_iter().filter(|c| !c.is_null()) {
        // SAFETY: a QP's CQs are ours and outlive it (destroy_cq refuses while a QP uses one).
        let v = unsafe { &*cq.cast::<VCq>() };
        if let Ok(mut q) = v.q.lock() {
            let n = q.clean(&conn.region, qp.qp_num);
            if n > 0 {
                vlog!("QP {}: {n} completions removed from its CQ", qp.qp_num);
            }
        }
    }
}

#[unsafe(no_mangle)]
pub extern "C" fn vrnic_ibv_query_qp(
    qp: *mut ibv_qp,
    attr: *mut ibv_qp_attr,
    _mask: c_int,
    init: *mut ibv_qp_init_attr,
) -> c_int {
    guard(libc::EIO, || {
        if qp.is_null() || attr.is_null() {
            return libc::EINVAL;
        }
        // SAFETY: qp is ours and live.
        let v = unsafe { &*qp.cast::<VQp>() };
        // SAFETY: the QP's context outlives it.
        let conn = &unsafe { context(v.qp.qp_base.context) }.conn;
        let qa = match conn.call(&Request::QueryQp {
            qp: v.qp.qp_base.handle,
        }) {
            Ok(Reply::QpAttr(a)) => a,
            Ok(_) => return libc::EPROTO,
            Err(e) => return e,
        };
        let mut c = attr_to_c(&qa);
        c.cap.max_send_wr = v.cap.max_send_wr;
        c.cap.max_recv_wr = v.cap.max_recv_wr;
        c.cap.max_send_sge = v.cap.max_send_sge;
        c.cap.max_recv_sge = v.cap.max_recv_sge;
        c.cap.max_inline_data = v.cap.max_inline_data;
        // SAFETY: attr is caller-owned.
        unsafe { *attr = c };
        v.state.store(qa.qp_state as u32, Ordering::Release);
        if !init.is_null() {
            // SAFETY: plain C data; zero is valid.
            let mut i: ibv_qp_init_attr = unsafe { std::mem::zeroed() };
            i.qp_context = v.qp.qp_base.qp_context;
            i.send_cq = v.qp.qp_base.send_cq;
            i.recv_cq = v.qp.qp_base.recv_cq;
            i.srq = v.qp.qp_base.srq;
            i.cap = c.cap;
            i.qp_type = v.qp.qp_base.qp_type;
            i.sq_sig_all = c_int::from(v.sq_sig_all);
            // SAFETY: init is caller-owned.
            unsafe { *init = i };
        }
        0
    })
}

#[unsafe(no_mangle)]
pub extern "C" fn vrnic_ibv_destroy_qp(qp: *mut ibv_qp) -> c_int {
    guard(libc::EIO, || destroy_qp(qp).err().unwrap_or(0))
}

/// `ibv_destroy_qp`, for the driver's own callers.
pub(crate) fn destroy_qp(qp: *mut ibv_qp) -> Result<(), c_int> {
    if qp.is_null() {
        return Err(libc::EINVAL);
    }
    // SAFETY: qp is ours and live.
    let qpr = unsafe { &*qp };
    let (ctx, h) = (qpr.context, qpr.handle);
    // SAFETY: the QP's context outlives it.
    let c = unsafe { context(ctx) };
    c.conn.call(&Request::DestroyQp { qp: h })?;
    clean_cqs(qpr, &c.conn);
    if let Ok(mut m) = c.qps.lock() {
        m.remove(&h);
    }
    c.conn.withdraw_events(QP_EVENTS, h);
    // SAFETY: boxed by create_qp; the app gives it up now.
    drop(unsafe { Box::from_raw(qp.cast::<VQp>()) });
    Ok(())
}

/// `ibv_create_qp_ex` for `IBV_QPT_XRC_SEND` (a PD and a send CQ, no receive side) and
/// `IBV_QPT_XRC_RECV` (an XRC domain, no PD, CQs or queues).
pub(crate) fn create_xrc_qp(
    ctx: *mut ibv_context,
    x: &mut ibv_qp_init_attr_ex,
) -> Result<*mut ibv_qp, c_int> {
    // SAFETY: plain C data; zero is valid.
    let mut ia: ibv_qp_init_attr = unsafe { std::mem::zeroed() };
    ia.qp_context = x.qp_context;
    ia.qp_type = x.qp_type;
    ia.sq_sig_all = x.sq_sig_all;
    // SAFETY: ctx is ours.
    let c = unsafe { context(ctx) };
    if x.qp_type == IBV_QPT_XRC_RECV {
        if x.comp_mask & IBV_QP_INIT_ATTR_XRCD == 0 || x.xrcd.is_null() {
            return Err(libc::EINVAL);
        }
        // SAFETY: a non-NULL XRC domain in the app's attributes is ours, open.
        let xrcd = unsafe { xrcd_handle(x.xrcd) };
        let req = Request::CreateQp {
            pd: 0,
            send_cq: 0,
            recv_cq: 0,
            qp_type: QpType::XrcRecv,
            cap: Default::default(),
            sq_sig_all: false,
            srq: None,
            xrcd: Some(xrcd),
        };
        let qp = make_qp(ctx, std::ptr::null_mut(), &mut ia, &req);
        x.cap = ia.cap;
        return qp;
    }
    if x.comp_mask & IBV_QP_INIT_ATTR_PD == 0 || x.pd.is_null() || x.send_cq.is_null() {
        return Err(libc::EINVAL);
    }
    let cap = vrnic_wire::QpCap {
        max_send_wr: x.cap.max_send_wr,
        max_recv_wr: 0,
        max_send_sge: x.cap.max_send_sge,
        max_recv_sge: 0,
        max_inline_data: x.cap.max_inline_data,
    };
    crate::limits::check_qp_cap(&c.conn.info, &cap)?;
    ia.send_cq = x.send_cq;
    ia.cap = x.cap;
    // SAFETY: the PD named in the app's attributes is ours and live.
    let pdh = unsafe { (*x.pd).handle };
    // SAFETY: so is its send CQ.
    let scq = unsafe { (*x.send_cq).handle };
    let req = Request::CreateQp {
        pd: pdh,
        send_cq: scq,
        recv_cq: scq,
        qp_type: QpType::XrcSend,
        cap,
        sq_sig_all: x.sq_sig_all != 0,
        srq: None,
        xrcd: None,
    };
    let qp = make_qp(ctx, x.pd, &mut ia, &req);
    x.cap = ia.cap;
    qp
}
