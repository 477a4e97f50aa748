//! QPs on ids: `rdma_create_qp`/`_ex` (with the PD, channels and CQs librdmacm makes when the
//! app gives none), their moves to INIT and, once connected, to RTR and RTS, and
//! `rdma_destroy_qp`.
#![allow(unsafe_code)]
#![allow(clippy::not_unsafe_ptr_arg_deref)]

use super::*;

pub(super) fn modify(qp: *mut ibv_qp, a: &mut ibv_qp_attr, mask: c_int) -> Result<(), i32> {
    crate::ffi::qp::modify_qp(qp, a, mask)
}

/// INIT for a new QP on an id, as librdmacm's `ucma_init_conn_qp`/`ucma_init_ud_qp` do; a UD
/// QP goes on to RTS (it needs no peer).
pub(super) fn init_qp(qp: *mut ibv_qp, ud: bool) -> Result<(), i32> {
    // SAFETY: plain C data; zero is valid.
    let mut a: ibv_qp_attr = unsafe { std::mem::zeroed() };
    a.qp_state = IBV_QPS_INIT;
    a.port_num = 1;
    a.pkey_index = 0;
    if ud {
        a.qkey = RDMA_UDP_QKEY;
        modify(
            qp,
            &mut a,
            IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_QKEY,
        )?;
        a.qp_state = IBV_QPS_RTR;
        modify(qp, &mut a, IBV_QP_STATE)?;
        a.qp_state = IBV_QPS_RTS;
        a.sq_psn = 0;
        return modify(qp, &mut a, IBV_QP_STATE | IBV_QP_SQ_PSN);
    }
    a.qp_access_flags = IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ | IBV_ACCESS_REMOTE_ATOMIC;
    modify(
        qp,
        &mut a,
        IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS,
    )
}

/// RTR then RTS toward the peer the events told us about.
pub(super) fn connect_qp(v: &VId) -> Result<(), i32> {
    let qp = v.id.qp;
    if qp.is_null() {
        return Ok(());
    }
    let peer = v.peer.lock().map(|p| p.clone()).unwrap_or_default();
    let mine = v.mine.lock().map(|p| p.clone()).unwrap_or_default();
    // SAFETY: plain C data; zero is valid.
    let mut a: ibv_qp_attr = unsafe { std::mem::zeroed() };
    a.qp_state = IBV_QPS_RTR;
    a.path_mtu = IBV_MTU_4096;
    a.dest_qp_num = peer.param.qp_num;
    a.rq_psn = 0;
    a.max_dest_rd_atomic = mine.responder_resources.clamp(1, 16);
    a.min_rnr_timer = 12;
    a.ah_attr.dlid = peer.lid;
    a.ah_attr.port_num = 1;
    a.ah_attr.is_global = 1;
    a.ah_attr.grh.dgid.raw = peer.gid;
    a.ah_attr.grh.hop_limit = 1;
    modify(
        qp,
        &mut a,
        IBV_QP_STATE
            | IBV_QP_AV
            | IBV_QP_PATH_MTU
            | IBV_QP_DEST_QPN
            | IBV_QP_RQ_PSN
            | IBV_QP_MAX_DEST_RD_ATOMIC
            | IBV_QP_MIN_RNR_TIMER,
    )?;
    a.qp_state = IBV_QPS_RTS;
    a.sq_psn = 0;
    a.timeout = 14;
    a.retry_cnt = mine.retry_count.min(7);
    a.rnr_retry = mine.rnr_retry_count.min(7);
    a.max_rd_atomic = mine.initiator_depth.clamp(1, 16);
    modify(
        qp,
        &mut a,
        IBV_QP_STATE
            | IBV_QP_SQ_PSN
            | IBV_QP_TIMEOUT
            | IBV_QP_RETRY_CNT
            | IBV_QP_RNR_RETRY
            | IBV_QP_MAX_QP_RD_ATOMIC,
    )
}

pub(super) fn create_qp_on(
    v: &mut VId,
    pd: *mut ibv_pd,
    attr: &mut ibv_qp_init_attr,
) -> Result<(), i32> {
    if v.id.verbs.is_null() {
        return Err(libc::EINVAL);
    }
    let pd = if !pd.is_null() {
        pd
    } else if !v.id.pd.is_null() {
        v.id.pd
    } else {
        let p = crate::ffi::mr::alloc_pd(v.id.verbs)?;
        v.made_pd = true;
        p
    };
    v.id.pd = pd;
    if attr.send_cq.is_null() && attr.recv_cq.is_null() {
        // As librdmacm: a completion channel and a CQ for each direction.
        let ctx = v.id.verbs;
        let made = (|| {
            let sc = crate::ffi::cq::create_comp_channel(ctx)?;
            let rc = crate::ffi::cq::create_comp_channel(ctx)?;
            let n = attr.cap.max_send_wr.max(1) as c_int;
            let scq = crate::ffi::cq::create_cq(ctx, n, null_mut(), sc, 0)?;
            let n = attr.cap.max_recv_wr.max(1) as c_int;
            let rcq = crate::ffi::cq::create_cq(ctx, n, null_mut(), rc, 0)?;
            Ok::<_, c_int>((sc, rc, scq, rcq))
        })();
        let Ok((sc, rc, scq, rcq)) = made else {
            return Err(libc::ENOMEM);
        };
        (v.id.send_cq_channel, v.id.recv_cq_channel) = (sc, rc);
        (v.id.send_cq, v.id.recv_cq) = (scq, rcq);
        attr.send_cq = scq;
        attr.recv_cq = rcq;
        v.made_cqs = true;
    } else {
        if attr.send_cq.is_null() {
            attr.send_cq = attr.recv_cq;
        }
        if attr.recv_cq.is_null() {
            attr.recv_cq = attr.send_cq;
        }
        v.id.send_cq = attr.send_cq;
        v.id.recv_cq = attr.recv_cq;
    }
    if attr.srq.is_null() && !v.id.srq.is_null() {
        attr.srq = v.id.srq;
    }
    let qp = crate::ffi::qp::create_qp(pd, attr)?;
    // SAFETY: qp is the QP just made.
    let ud = unsafe { (*qp).qp_type } == IBV_QPT_UD;
    if let Err(e) = init_qp(qp, ud) {
        let _ = crate::ffi::qp::destroy_qp(qp);
        return Err(e);
    }
    v.id.qp = qp;
    v.id.qp_type = attr.qp_type;
    Ok(())
}

#[unsafe(no_mangle)]
pub extern "C" fn vrnic_rdma_create_qp(
    id: *mut rdma_cm_id,
    pd: *mut ibv_pd,
    attr: *mut ibv_qp_init_attr,
) -> c_int {
    guard(-1, || {
        if id.is_null() || attr.is_null() {
            return minus_one(libc::EINVAL);
        }
        // SAFETY: id is ours and live; attr is the app's.
        let (v, a) = (unsafe { vid(id) }, unsafe { &mut *attr });
        match create_qp_on(v, pd, a) {
            Ok(()) => 0,
            Err(e) => minus_one(e),
        }
    })
}

#[unsafe(no_mangle)]
pub extern "C" fn vrnic_rdma_create_qp_ex(
    id: *mut rdma_cm_id,
    attr: *mut ibv_qp_init_attr_ex,
) -> c_int {
    guard(-1, || {
        if id.is_null() || attr.is_null() {
            return minus_one(libc::EINVAL);
        }
        // SAFETY: attr is the app's.
        let x = unsafe { &mut *attr };
        if x.comp_mask & !IBV_QP_INIT_ATTR_PD != 0 {
            return minus_one(libc::EOPNOTSUPP);
        }
        // SAFETY: plain C data; zero is valid.
        let mut a: ibv_qp_init_attr = unsafe { std::mem::zeroed() };
        a.qp_context = x.qp_context;
        a.send_cq = x.send_cq;
        a.recv_cq = x.recv_cq;
        a.srq = x.srq;
        a.cap = x.cap;
        a.qp_type = x.qp_type;
        a.sq_sig_all = x.sq_sig_all;
        let pd = if x.comp_mask & IBV_QP_INIT_ATTR_PD != 0 {
            x.pd
        } else {
            null_mut()
        };
        // SAFETY: id is ours and live.
        match create_qp_on(unsafe { vid(id) }, pd, &mut a) {
            Ok(()) => {
                x.cap = a.cap;
                0
            }
            Err(e) => minus_one(e),
        }
    })
}

#[unsafe(no_mangle)]
pub extern "C" fn vrnic_rdma_destroy_qp(id: *mut rdma_cm_id) {
    guard((), || {
        if id.is_null() {
            return;
        }
        // SAFETY: id is ours and live.
        let v = unsafe { vid(id) };
        if !v.id.qp.is_null() {
            let _ = crate::ffi::qp::destroy_qp(v.id.qp);
            v.id.qp = null_mut();
        }
        if v.made_cqs {
            for cq in [v.id.send_cq, v.id.recv_cq] {
                let _ = crate::ffi::cq::destroy_cq(cq);
            }
            for ch in [v.id.send_cq_channel, v.id.recv_cq_channel] {
                let _ = crate::ffi::cq::destroy_comp_channel(ch);
            }
            v.id.send_cq = null_mut();
            v.id.recv_cq = null_mut();
            v.id.send_cq_channel = null_mut();
            v.id.recv_cq_channel = null_mut();
            v.made_cqs = false;
        }
    })
}
