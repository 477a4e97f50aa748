//! What the app asks of ids and the device: an id's ports, `rdma_get_devices`,
//! `rdma_set_option`, `rdma_migrate_id`, `rdma_init_qp_attr`.
#![allow(unsafe_code)]
#![allow(clippy::not_unsafe_ptr_arg_deref)]

use super::*;

#[unsafe(no_mangle)]
pub extern "C" fn vrnic_rdma_get_src_port(id: *mut rdma_cm_id) -> u16 {
    port_of(id, true)
}

#[unsafe(no_mangle)]
pub extern "C" fn vrnic_rdma_get_dst_port(id: *mut rdma_cm_id) -> u16 {
    port_of(id, false)
}

/// The port of the id's local or peer address, in network order (as librdmacm returns it).
pub(super) fn port_of(id: *mut rdma_cm_id, local: bool) -> u16 {
    guard(0, || {
        if id.is_null() {
            return 0;
        }
        // SAFETY: id is ours and live.
        let a = &unsafe { &*id }.route.addr;
        let st = if local {
            &a.src_storage
        } else {
            &a.dst_storage
        };
        // SAFETY: the storage holds a sockaddr we wrote (or zeroes).
        match unsafe { sockaddr_in((st as *const libc::sockaddr_storage).cast()) } {
            Ok(s) => s.port().to_be(),
            Err(_) => 0,
        }
    })
}

#[unsafe(no_mangle)]
pub extern "C" fn vrnic_rdma_get_devices(num: *mut c_int) -> *mut *mut ibv_context {
    guard(null_mut(), || {
        let ctx = match device() {
            Ok(c) => c,
            Err(e) => return null_err(e),
        };
        // SAFETY: malloc of two pointers; freed by rdma_free_devices (free).
        let list =
            unsafe { libc::calloc(2, std::mem::size_of::<usize>()) }.cast::<*mut ibv_context>();
        if list.is_null() {
            return null_err(libc::ENOMEM);
        }
        // SAFETY: list holds two entries.
        unsafe { *list = ctx };
        if !num.is_null() {
            // SAFETY: the app's out-pointer.
            unsafe { *num = 1 };
        }
        list
    })
}

#[unsafe(no_mangle)]
pub extern "C" fn vrnic_rdma_free_devices(list: *mut *mut ibv_context) {
    // SAFETY: made by calloc in rdma_get_devices.
    unsafe { libc::free(list.cast()) };
}

#[unsafe(no_mangle)]
pub extern "C" fn vrnic_rdma_set_option(
    id: *mut rdma_cm_id,
    level: c_int,
    name: c_int,
    val: *mut c_void,
    _len: usize,
) -> c_int {
    if id.is_null() || val.is_null() {
        return minus_one(libc::EINVAL);
    }
    match (level, name) {
        (RDMA_OPTION_ID, RDMA_OPTION_ID_TOS)
        | (RDMA_OPTION_ID, RDMA_OPTION_ID_REUSEADDR)
        | (RDMA_OPTION_ID, RDMA_OPTION_ID_AFONLY)
        | (RDMA_OPTION_ID, RDMA_OPTION_ID_ACK_TIMEOUT) => 0,
        (RDMA_OPTION_IB, RDMA_OPTION_IB_PATH) => 0,
        _ => minus_one(libc::ENOSYS),
    }
}

/// `rdma_migrate_id` as librdmacm's: the id's events go to `chan` from now on, with those
/// announced on its old channel and not yet taken. Given a channel, a synchronous id (made
/// without one) becomes asynchronous: its calls no longer wait for their own events, which
/// the app takes from `chan` (libfabric's verbs provider resolves an endpoint's address on an
/// id made without a channel, then moves it onto its event queue's channel and resolves the
/// route by events), and its private channel goes with the event it held. Given none, an asynchronous id becomes
/// synchronous on a new private channel; a synchronous one: `EINVAL`.
#[unsafe(no_mangle)]
pub extern "C" fn vrnic_rdma_migrate_id(
    id: *mut rdma_cm_id,
    chan: *mut rdma_event_channel,
) -> c_int {
    guard(-1, || {
        if id.is_null() {
            return minus_one(libc::EINVAL);
        }
        // SAFETY: id is ours and live.
        let v = unsafe { vid(id) };
        let sync = chan.is_null();
        if sync && v.own_chan != 0 {
            return minus_one(libc::EINVAL);
        }
        let target = if sync {
            match new_channel() {
                Ok(c) => c,
                Err(e) => return minus_one(e),
            }
        } else {
            chan.cast::<VChannel>()
        };
        // Swapped under the id table's lock: a `deliver` that read the old channel has
        // finished with it once the lock is ours, and every later one reads the new channel.
        let ids = IDS.lock().unwrap_or_else(|e| e.into_inner());
        let old = v.chan.swap(target as usize, Ordering::AcqRel) as *mut VChannel;
        drop(ids);
        // SAFETY: target is live.
        v.id.channel = unsafe { &raw mut (*target).ch };
        // Events already announced on the old channel move with the id.
        if !old.is_null() && old != target {
            // SAFETY: the old channel is still live (the app destroys it after migrating; a
            // private one is freed below).
            let moved = unsafe { &*old }
                .queue
                .lock()
                .map(|mut q| {
                    let n = q.iter().filter(|&&h| h == v.handle).count();
                    q.retain(|&h| h != v.handle);
                    n
                })
                .unwrap_or(0);
            for _ in 0..moved {
                deliver(v.handle);
            }
        }
        if !sync && v.own_chan != 0 {
            // Asynchronous from now on: the event its last call kept is acked and its private
            // channel freed, as librdmacm destroys it.
            if !v.id.event.is_null() {
                vrnic_rdma_ack_cm_event(v.id.event);
                v.id.event = null_mut();
            }
            // SAFETY: our private channel, made with the id; no `deliver` reaches it any more
            // (see above) and the id's calls no longer wait on it.
            drop(unsafe { Box::from_raw(v.own_chan as *mut VChannel) });
            v.own_chan = 0;
        } else if sync {
            v.own_chan = target as usize;
        }
        v.shadow.sync = c_int::from(v.own_chan != 0);
        0
    })
}

#[unsafe(no_mangle)]
pub extern "C" fn vrnic_rdma_init_qp_attr(
    id: *mut rdma_cm_id,
    attr: *mut ibv_qp_attr,
    mask: *mut c_int,
) -> c_int {
    guard(-1, || {
        if id.is_null() || attr.is_null() || mask.is_null() {
            return minus_one(libc::EINVAL);
        }
        // SAFETY: id is ours and live.
        let v = unsafe { vid(id) };
        // The caller names the state it wants attributes for, as with librdmacm.
        // SAFETY: attr is the app's; qp_state is the one field it set.
        let state = unsafe { (*attr).qp_state };
        // SAFETY: plain C data; zero is valid.
        let mut a: ibv_qp_attr = unsafe { std::mem::zeroed() };
        let peer = v.peer.lock().map(|p| p.clone()).unwrap_or_default();
        let m = match state {
            IBV_QPS_INIT => {
                a.qp_state = IBV_QPS_INIT;
                a.port_num = 1;
                a.qp_access_flags =
                    IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ | IBV_ACCESS_REMOTE_ATOMIC;
                IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS
            }
            IBV_QPS_RTR => {
                a.qp_state = IBV_QPS_RTR;
                a.path_mtu = IBV_MTU_4096;
                a.dest_qp_num = peer.param.qp_num;
                a.max_dest_rd_atomic = peer.param.initiator_depth.clamp(1, 16);
                a.min_rnr_timer = 12;
                a.ah_attr.dlid = peer.lid;
                a.ah_attr.port_num = 1;
                IBV_QP_STATE
                    | IBV_QP_AV
                    | IBV_QP_PATH_MTU
                    | IBV_QP_DEST_QPN
                    | IBV_QP_RQ_PSN
                    | IBV_QP_MAX_DEST_RD_ATOMIC
                    | IBV_QP_MIN_RNR_TIMER
            }
            IBV_QPS_RTS => {
                a.qp_state = IBV_QPS_RTS;
                a.timeout = 14;
                a.retry_cnt = 7;
                a.rnr_retry = 7;
                a.max_rd_atomic = peer.param.responder_resources.clamp(1, 16);
                IBV_QP_STATE
                    | IBV_QP_SQ_PSN
                    | IBV_QP_TIMEOUT
                    | IBV_QP_RETRY_CNT
                    | IBV_QP_RNR_RETRY
                    | IBV_QP_MAX_QP_RD_ATOMIC
            }
            _ => return minus_one(libc::EINVAL),
        };
        // SAFETY: the app's out-pointer.
        unsafe { *attr = a };
        // SAFETY: the app's out-pointer.
        unsafe { *mask = m };
        0
    })
}
