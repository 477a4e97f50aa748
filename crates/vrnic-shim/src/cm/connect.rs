//! Connecting: `rdma_connect`, `rdma_accept`, `rdma_establish`, `rdma_reject`,
//! `rdma_disconnect`.
#![allow(unsafe_code)]
#![allow(clippy::not_unsafe_ptr_arg_deref)]

use super::*;

pub(super) fn param_from(p: *const rdma_conn_param, v: &VId) -> CmParam {
    let mut out = CmParam {
        responder_resources: 1,
        initiator_depth: 1,
        retry_count: 7,
        rnr_retry_count: 7,
        qkey: RDMA_UDP_QKEY,
        ..CmParam::default()
    };
    if !p.is_null() {
        // SAFETY: the app's conn param.
        let p = unsafe { &*p };
        if !p.private_data.is_null() && p.private_data_len > 0 {
            // SAFETY: the app vouches for private_data_len bytes at private_data.
            out.private_data = unsafe {
                std::slice::from_raw_parts(p.private_data.cast::<u8>(), p.private_data_len.into())
            }
            .to_vec();
        }
        out.responder_resources = p.responder_resources;
        out.initiator_depth = p.initiator_depth;
        out.retry_count = p.retry_count;
        out.rnr_retry_count = p.rnr_retry_count;
        out.qp_num = p.qp_num;
    }
    if !v.id.qp.is_null() {
        // SAFETY: the id's QP is live.
        out.qp_num = unsafe { (*v.id.qp).qp_num };
    }
    out
}

#[unsafe(no_mangle)]
pub extern "C" fn vrnic_rdma_connect(id: *mut rdma_cm_id, param: *mut rdma_conn_param) -> c_int {
    guard(-1, || {
        if id.is_null() {
            return minus_one(libc::EINVAL);
        }
        // SAFETY: id is ours and live.
        let v = unsafe { vid(id) };
        let p = param_from(param, v);
        if p.private_data.len() > 196 {
            return minus_one(libc::EINVAL);
        }
        if let Ok(mut m) = v.mine.lock() {
            *m = p.clone();
        }
        if let Err(e) = call(&Request::CmConnect {
            id: v.handle,
            param: p,
        }) {
            return minus_one(e);
        }
        match complete(v, cm_event::ESTABLISHED) {
            Ok(()) => 0,
            Err(e) => minus_one(e),
        }
    })
}

#[unsafe(no_mangle)]
pub extern "C" fn vrnic_rdma_accept(id: *mut rdma_cm_id, param: *mut rdma_conn_param) -> c_int {
    guard(-1, || {
        if id.is_null() {
            return minus_one(libc::EINVAL);
        }
        // SAFETY: id is ours and live.
        let v = unsafe { vid(id) };
        let mut p = param_from(param, v);
        if param.is_null() {
            // Without parameters, librdmacm answers with what the requester asked for.
            let peer = v.peer.lock().map(|x| x.param.clone()).unwrap_or_default();
            p.responder_resources = peer.initiator_depth;
            p.initiator_depth = peer.responder_resources;
        }
        if p.private_data.len() > 148 {
            return minus_one(libc::EINVAL);
        }
        if let Ok(mut m) = v.mine.lock() {
            *m = p.clone();
        }
        if v.id.qp_type != IBV_QPT_UD
            && let Err(e) = connect_qp(v)
        {
            return minus_one(e);
        }
        if let Err(e) = call(&Request::CmAccept {
            id: v.handle,
            param: p,
        }) {
            return minus_one(e);
        }
        if v.id.qp_type == IBV_QPT_UD {
            return 0;
        }
        match complete(v, cm_event::ESTABLISHED) {
            Ok(()) => 0,
            Err(e) => minus_one(e),
        }
    })
}

#[unsafe(no_mangle)]
pub extern "C" fn vrnic_rdma_establish(id: *mut rdma_cm_id) -> c_int {
    guard(-1, || {
        if id.is_null() {
            return minus_one(libc::EINVAL);
        }
        // SAFETY: id is ours and live.
        let v = unsafe { vid(id) };
        if let Err(e) = connect_qp(v) {
            return minus_one(e);
        }
        ok_or_minus_one(call(&Request::CmEstablish { id: v.handle }))
    })
}

#[unsafe(no_mangle)]
pub extern "C" fn vrnic_rdma_reject(id: *mut rdma_cm_id, data: *const c_void, len: u8) -> c_int {
    guard(-1, || {
        if id.is_null() {
            return minus_one(libc::EINVAL);
        }
        // SAFETY: id is ours and live.
        let v = unsafe { vid(id) };
        let private_data = if data.is_null() || len == 0 {
            Vec::new()
        } else {
            // SAFETY: the app vouches for len bytes at data.
            unsafe { std::slice::from_raw_parts(data.cast::<u8>(), len.into()) }.to_vec()
        };
        ok_or_minus_one(call(&Request::CmReject {
            id: v.handle,
            private_data,
        }))
    })
}

#[unsafe(no_mangle)]
pub extern "C" fn vrnic_rdma_reject_ece(
    id: *mut rdma_cm_id,
    data: *const c_void,
    len: u8,
) -> c_int {
    vrnic_rdma_reject(id, data, len)
}

#[unsafe(no_mangle)]
pub extern "C" fn vrnic_rdma_disconnect(id: *mut rdma_cm_id) -> c_int {
    guard(-1, || {
        if id.is_null() {
            return minus_one(libc::EINVAL);
        }
        // SAFETY: id is ours and live.
        let v = unsafe { vid(id) };
        if !v.id.qp.is_null() {
            // As librdmacm: the QP goes to ERR, which flushes what is posted.
            // SAFETY: plain C data; zero is valid.
            let mut a: ibv_qp_attr = unsafe { std::mem::zeroed() };
            a.qp_state = IBV_QPS_ERR;
            let _ = modify(v.id.qp, &mut a, IBV_QP_STATE);
        }
        ok_or_minus_one(call(&Request::CmDisconnect { id: v.handle }))
    })
}
