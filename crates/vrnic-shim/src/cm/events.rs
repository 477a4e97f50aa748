//! Events: `rdma_get_cm_event` (what librdmacm does on the way: addresses, the new id of a
//! request, the active side's QP moves), `rdma_ack_cm_event`, `rdma_event_str`.
#![allow(unsafe_code)]
#![allow(clippy::not_unsafe_ptr_arg_deref)]

use super::*;

#[unsafe(no_mangle)]
pub extern "C" fn vrnic_rdma_get_cm_event(
    chan: *mut rdma_event_channel,
    out: *mut *mut rdma_cm_event,
) -> c_int {
    guard(-1, || {
        if chan.is_null() || out.is_null() {
            return minus_one(libc::EINVAL);
        }
        // SAFETY: chan is ours and live.
        let c = unsafe { &*chan.cast::<VChannel>() };
        loop {
            if let Err(e) = c.efd.wait() {
                return minus_one(e);
            }
            let Some(h) = c.queue.lock().ok().and_then(|mut q| q.pop_front()) else {
                continue;
            };
            let Some(v) = lookup(h) else { continue };
            let ev = match call(&Request::CmTakeEvent { id: h }) {
                Ok(Reply::CmEvent(e)) => e,
                _ => continue,
            };
            // SAFETY: registered ids are live.
            match build_event(unsafe { &mut *v }, *ev) {
                Some(e) => {
                    // SAFETY: out is the app's out-pointer.
                    unsafe { *out = e.cast() };
                    return 0;
                }
                None => continue,
            }
        }
    })
}

/// Turns a broker event into the app's `rdma_cm_event`, doing librdmacm's work on the way.
/// `None`: the event was consumed internally.
pub(super) fn build_event(v: &mut VId, e: CmEvent) -> Option<*mut VEvent> {
    let mut kind = e.kind;
    let mut target: *mut VId = v;
    match e.kind {
        cm_event::ADDR_RESOLVED => {
            set_local(v, &e.local);
            set_remote(v, &e.remote);
            let _ = attach(v);
        }
        cm_event::ROUTE_RESOLVED => {
            // SAFETY: reading the raw bytes of a 16-byte GID union is always valid.
            let sgid = unsafe { v.id.route.addr.ibaddr.sgid.raw };
            v.id.route.addr.ibaddr.dgid.raw = sgid;
        }
        cm_event::CONNECT_REQUEST => {
            let chan = v.chan.load(Ordering::Acquire) as *mut VChannel;
            // SAFETY: the listener's channel is live.
            let ch = unsafe { &raw mut (*chan).ch };
            let ps = v.id.ps;
            let user = v.id.context;
            // The new id shares the listener's channel, even a synchronous listener's (its
            // rdma_get_request takes the event from there).
            let child = new_id(e.new_id, ch, user, ps).ok()?;
            // SAFETY: just made.
            let c = unsafe { &mut *child };
            if v.own_chan != 0 {
                // A synchronous listener's new ids are synchronous too.
                if let Ok(own) = new_channel() {
                    c.own_chan = own as usize;
                    c.shadow.sync = 1;
                    // SAFETY: own is live.
                    c.id.channel = unsafe { &raw mut (*own).ch };
                    c.chan.store(own as usize, Ordering::Release);
                }
            }
            set_local(c, &e.local);
            set_remote(c, &e.remote);
            let _ = attach(c);
            c.id.route.addr.ibaddr.dgid.raw = e.peer_gid;
            c.id.qp_type = v.id.qp_type;
            if let Ok(mut p) = c.peer.lock() {
                *p = Peer {
                    lid: e.peer_lid,
                    gid: e.peer_gid,
                    param: e.param.clone(),
                };
            }
            target = child;
        }
        cm_event::CONNECT_RESPONSE => {
            if let Ok(mut p) = v.peer.lock() {
                *p = Peer {
                    lid: e.peer_lid,
                    gid: e.peer_gid,
                    param: e.param.clone(),
                };
            }
            if !v.id.qp.is_null() {
                // librdmacm completes the handshake itself when the id has a QP.
                let r = connect_qp(v)
                    .and_then(|()| call(&Request::CmEstablish { id: v.handle }).map(|_| ()));
                kind = if r.is_ok() {
                    cm_event::ESTABLISHED
                } else {
                    6 // RDMA_CM_EVENT_CONNECT_ERROR
                };
            }
        }
        cm_event::ESTABLISHED if v.id.ps == RDMA_PS_UDP => {
            if let Ok(mut p) = v.peer.lock() {
                *p = Peer {
                    lid: e.peer_lid,
                    gid: e.peer_gid,
                    param: e.param.clone(),
                };
            }
        }
        _ => {}
    }
    // SAFETY: plain C data; zero is valid.
    let mut ev: rdma_cm_event = unsafe { std::mem::zeroed() };
    // SAFETY: target is v or the new id, both live.
    let t = unsafe { &mut *target };
    ev.id = &raw mut t.id;
    ev.listen_id = if e.kind == cm_event::CONNECT_REQUEST {
        &raw mut v.id
    } else {
        null_mut()
    };
    ev.event = kind;
    ev.status = e.status;
    let b = Box::into_raw(Box::new(VEvent {
        ev,
        data: e.param.private_data.clone(),
    }));
    // SAFETY: b was just made; its data vector does not move while the event lives.
    let be = unsafe { &mut *b };
    let (ptr, len) = if be.data.is_empty() {
        (std::ptr::null(), 0)
    } else {
        (
            be.data.as_ptr().cast::<c_void>(),
            be.data.len().min(255) as u8,
        )
    };
    if t.id.qp_type == IBV_QPT_UD || t.id.ps == RDMA_PS_UDP {
        // SAFETY: plain C data; zero is valid.
        let mut ah: ibv_ah_attr = unsafe { std::mem::zeroed() };
        ah.dlid = e.peer_lid;
        ah.port_num = 1;
        ah.is_global = 1;
        ah.grh.dgid.raw = e.peer_gid;
        ah.grh.hop_limit = 1;
        be.ev.param.ud = rdma_ud_param {
            private_data: ptr,
            private_data_len: len,
            ah_attr: ah,
            qp_num: e.param.qp_num,
            qkey: if e.param.qkey != 0 {
                e.param.qkey
            } else {
                RDMA_UDP_QKEY
            },
        };
    } else {
        be.ev.param.conn = rdma_conn_param {
            private_data: ptr,
            private_data_len: len,
            responder_resources: e.param.responder_resources,
            initiator_depth: e.param.initiator_depth,
            flow_control: 1,
            retry_count: e.param.retry_count,
            rnr_retry_count: e.param.rnr_retry_count,
            srq: 0,
            qp_num: e.param.qp_num,
        };
    }
    Some(b)
}

#[unsafe(no_mangle)]
pub extern "C" fn vrnic_rdma_ack_cm_event(ev: *mut rdma_cm_event) -> c_int {
    guard(-1, || {
        if ev.is_null() {
            return minus_one(libc::EINVAL);
        }
        // SAFETY: boxed by get_cm_event; the app gives it up now.
        drop(unsafe { Box::from_raw(ev.cast::<VEvent>()) });
        0
    })
}

#[unsafe(no_mangle)]
pub extern "C" fn vrnic_rdma_event_str(kind: c_int) -> *const c_char {
    const NAMES: [&CStr; 16] = [
        c"RDMA_CM_EVENT_ADDR_RESOLVED",
        c"RDMA_CM_EVENT_ADDR_ERROR",
        c"RDMA_CM_EVENT_ROUTE_RESOLVED",
        c"RDMA_CM_EVENT_ROUTE_ERROR",
        c"RDMA_CM_EVENT_CONNECT_REQUEST",
        c"RDMA_CM_EVENT_CONNECT_RESPONSE",
        c"RDMA_CM_EVENT_CONNECT_ERROR",
        c"RDMA_CM_EVENT_UNREACHABLE",
        c"RDMA_CM_EVENT_REJECTED",
        c"RDMA_CM_EVENT_ESTABLISHED",
        c"RDMA_CM_EVENT_DISCONNECTED",
        c"RDMA_CM_EVENT_DEVICE_REMOVAL",
        c"RDMA_CM_EVENT_MULTICAST_JOIN",
        c"RDMA_CM_EVENT_MULTICAST_ERROR",
        c"RDMA_CM_EVENT_ADDR_CHANGE",
        c"RDMA_CM_EVENT_TIMEWAIT_EXIT",
    ];
    usize::try_from(kind)
        .ok()
        .and_then(|k| NAMES.get(k))
        .map(|s| s.as_ptr())
        .unwrap_or(c"UNKNOWN EVENT".as_ptr())
}
