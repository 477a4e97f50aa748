//! The synchronous endpoint API: `rdma_get_request`, `rdma_create_ep`, `rdma_destroy_ep`.
#![allow(unsafe_code)]
#![allow(clippy::not_unsafe_ptr_arg_deref)]

use super::*;

#[unsafe(no_mangle)]
pub extern "C" fn vrnic_rdma_get_request(
    listen: *mut rdma_cm_id,
    out: *mut *mut rdma_cm_id,
) -> c_int {
    guard(-1, || {
        if listen.is_null() || out.is_null() {
            return minus_one(libc::EINVAL);
        }
        // SAFETY: listen is ours and live.
        let l = unsafe { vid(listen) };
        let chan = l.chan.load(Ordering::Acquire) as *mut rdma_event_channel;
        let mut ev: *mut rdma_cm_event = null_mut();
        loop {
            if vrnic_rdma_get_cm_event(chan, &mut ev) != 0 {
                return -1;
            }
            // SAFETY: a live event.
            if unsafe { (*ev).event } == cm_event::CONNECT_REQUEST {
                break;
            }
            vrnic_rdma_ack_cm_event(ev);
        }
        // SAFETY: a live event naming the new id.
        let id = unsafe { (*ev).id };
        // As librdmacm: the request stays in the new id's `event` (its private data is read
        // there) until the id's next synchronous call or its destruction.
        // SAFETY: the new id is live.
        unsafe { (*id).event = ev };
        if let Some((pd, mut attr)) = l.ep_qp {
            // SAFETY: the new id is live.
            if let Err(e) = create_qp_on(unsafe { vid(id) }, pd as *mut ibv_pd, &mut attr) {
                vrnic_rdma_destroy_id(id);
                return minus_one(e);
            }
        }
        // SAFETY: out is the app's.
        unsafe { *out = id };
        0
    })
}

#[unsafe(no_mangle)]
pub extern "C" fn vrnic_rdma_create_ep(
    out: *mut *mut rdma_cm_id,
    res: *mut rdma_addrinfo,
    pd: *mut ibv_pd,
    qp_init: *mut ibv_qp_init_attr,
) -> c_int {
    guard(-1, || {
        if out.is_null() || res.is_null() {
            return minus_one(libc::EINVAL);
        }
        // SAFETY: res is the app's (from rdma_getaddrinfo).
        let r = unsafe { &*res };
        let ps = if r.ai_port_space != 0 {
            r.ai_port_space as u32
        } else {
            RDMA_PS_TCP
        };
        let mut id: *mut rdma_cm_id = null_mut();
        if vrnic_rdma_create_id(null_mut(), &mut id, null_mut(), ps) != 0 {
            return -1;
        }
        // As librdmacm: the QP type comes from the address info.
        let qp_type = if r.ai_qp_type != 0 {
            r.ai_qp_type as u32
        } else {
            IBV_QPT_RC
        };
        // SAFETY: id was just made.
        unsafe { vid(id) }.id.qp_type = qp_type;
        if !qp_init.is_null() {
            // SAFETY: qp_init is the app's.
            unsafe { (*qp_init).qp_type = qp_type };
        }
        let rc = if r.ai_flags & RAI_PASSIVE != 0 {
            let rc = vrnic_rdma_bind_addr(id, r.ai_src_addr);
            if rc == 0 && !qp_init.is_null() {
                // SAFETY: id is live; qp_init is the app's.
                unsafe { vid(id) }.ep_qp = Some((pd as usize, unsafe { *qp_init }));
            }
            rc
        } else {
            let rc = vrnic_rdma_resolve_addr(id, r.ai_src_addr, r.ai_dst_addr, 2000);
            let rc = if rc == 0 {
                vrnic_rdma_resolve_route(id, 2000)
            } else {
                rc
            };
            if rc == 0 && !qp_init.is_null() {
                vrnic_rdma_create_qp(id, pd, qp_init)
            } else {
                rc
            }
        };
        if rc != 0 {
            let e = sys::errno();
            vrnic_rdma_destroy_id(id);
            return minus_one(e);
        }
        // SAFETY: out is the app's.
        unsafe { *out = id };
        0
    })
}

#[unsafe(no_mangle)]
pub extern "C" fn vrnic_rdma_destroy_ep(id: *mut rdma_cm_id) {
    guard((), || {
        if id.is_null() {
            return;
        }
        vrnic_rdma_destroy_qp(id);
        // SAFETY: id is ours and live.
        let v = unsafe { vid(id) };
        if !v.id.srq.is_null() {
            let _ = crate::ffi::srq::destroy_srq(v.id.srq);
            v.id.srq = null_mut();
        }
        if v.made_pd && !v.id.pd.is_null() {
            let _ = crate::ffi::mr::dealloc_pd(v.id.pd);
        }
        vrnic_rdma_destroy_id(id);
    })
}
