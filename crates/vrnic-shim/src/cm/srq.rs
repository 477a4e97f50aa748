//! SRQs on ids (`rdma_create_srq`/`_ex`, `rdma_destroy_srq`), and the calls not supported
//! (`rdma_notify`, multicast, ECE).
#![allow(unsafe_code)]
#![allow(clippy::not_unsafe_ptr_arg_deref)]

use super::*;

#[unsafe(no_mangle)]
pub extern "C" fn vrnic_rdma_create_srq(
    id: *mut rdma_cm_id,
    pd: *mut ibv_pd,
    attr: *mut ibv_srq_init_attr,
) -> c_int {
    guard(-1, || {
        if id.is_null() || attr.is_null() {
            return minus_one(libc::EINVAL);
        }
        // SAFETY: id is ours and live.
        let v = unsafe { vid(id) };
        let pd = if pd.is_null() { v.id.pd } else { pd };
        let s = match crate::ffi::srq::create_srq(pd, attr) {
            Ok(s) => s,
            Err(e) => return minus_one(e),
        };
        v.id.srq = s;
        v.id.pd = pd;
        0
    })
}

#[unsafe(no_mangle)]
pub extern "C" fn vrnic_rdma_create_srq_ex(
    id: *mut rdma_cm_id,
    attr: *mut ibv_srq_init_attr_ex,
) -> c_int {
    guard(-1, || {
        if id.is_null() || attr.is_null() {
            return minus_one(libc::EINVAL);
        }
        // SAFETY: id is ours and live.
        let v = unsafe { vid(id) };
        let s = match crate::ffi::srq::create_srq_ex(v.id.verbs, attr) {
            Ok(s) => s,
            Err(e) => return minus_one(e),
        };
        v.id.srq = s;
        0
    })
}

#[unsafe(no_mangle)]
pub extern "C" fn vrnic_rdma_destroy_srq(id: *mut rdma_cm_id) {
    guard((), || {
        if id.is_null() {
            return;
        }
        // SAFETY: id is ours and live.
        let v = unsafe { vid(id) };
        if !v.id.srq.is_null() {
            let _ = crate::ffi::srq::destroy_srq(v.id.srq);
            v.id.srq = null_mut();
        }
    })
}

#[unsafe(no_mangle)]
pub extern "C" fn vrnic_rdma_notify(_id: *mut rdma_cm_id, _event: c_int) -> c_int {
    0
}

#[unsafe(no_mangle)]
pub extern "C" fn vrnic_rdma_join_multicast(
    _id: *mut rdma_cm_id,
    _addr: *mut libc::sockaddr,
    _ctx: *mut c_void,
) -> c_int {
    minus_one(libc::ENOSYS)
}

#[unsafe(no_mangle)]
pub extern "C" fn vrnic_rdma_join_multicast_ex(
    _id: *mut rdma_cm_id,
    _attr: *mut c_void,
    _ctx: *mut c_void,
) -> c_int {
    minus_one(libc::ENOSYS)
}

#[unsafe(no_mangle)]
pub extern "C" fn vrnic_rdma_leave_multicast(
    _id: *mut rdma_cm_id,
    _addr: *mut libc::sockaddr,
) -> c_int {
    minus_one(libc::ENOSYS)
}

#[unsafe(no_mangle)]
pub extern "C" fn vrnic_rdma_set_local_ece(_id: *mut rdma_cm_id, _ece: *mut c_void) -> c_int {
    minus_one(libc::EOPNOTSUPP)
}

#[unsafe(no_mangle)]
pub extern "C" fn vrnic_rdma_get_remote_ece(_id: *mut rdma_cm_id, _ece: *mut c_void) -> c_int {
    minus_one(libc::EOPNOTSUPP)
}
