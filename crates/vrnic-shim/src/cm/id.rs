//! Ids: `rdma_create_id`/`rdma_destroy_id`, binding, listening, and address and route
//! resolution (a synchronous id waits for its own event).
#![allow(unsafe_code)]
#![allow(clippy::not_unsafe_ptr_arg_deref)]

use super::*;

pub(super) fn new_id(
    handle: u32,
    chan: *mut rdma_event_channel,
    user: *mut c_void,
    ps: u32,
) -> Result<*mut VId, i32> {
    let (chan_ptr, own) = if chan.is_null() {
        let c = new_channel()?;
        (c, c as usize)
    } else {
        (chan.cast::<VChannel>(), 0)
    };
    // SAFETY: plain C data (pointers, ints, sockaddr storage); zero is valid.
    let mut id: rdma_cm_id = unsafe { std::mem::zeroed() };
    // SAFETY: chan_ptr is a live VChannel (the app's, or ours).
    id.channel = unsafe { &raw mut (*chan_ptr).ch };
    id.context = user;
    id.ps = ps;
    id.qp_type = if ps == RDMA_PS_UDP || ps == RDMA_PS_IPOIB {
        IBV_QPT_UD
    } else {
        IBV_QPT_RC
    };
    let v = Box::into_raw(Box::new(VId {
        id,
        shadow: CmaIdShadow {
            cma_dev: cma_device(),
            connect: null_mut(),
            connect_len: 0,
            events_completed: 0,
            connect_error: 0,
            sync: c_int::from(own != 0),
        },
        handle,
        chan: AtomicUsize::new(chan_ptr as usize),
        own_chan: own,
        peer: Mutex::new(Peer::default()),
        mine: Mutex::new(CmParam::default()),
        ep_qp: None,
        made_cqs: false,
        made_pd: false,
    }));
    register(handle, v);
    Ok(v)
}

#[unsafe(no_mangle)]
pub extern "C" fn vrnic_rdma_create_id(
    chan: *mut rdma_event_channel,
    out: *mut *mut rdma_cm_id,
    user: *mut c_void,
    ps: u32,
) -> c_int {
    guard(-1, || {
        if out.is_null() {
            return minus_one(libc::EINVAL);
        }
        let h = match call(&Request::CmCreateId { ps: ps as u16 }) {
            Ok(Reply::Handle(h)) => h,
            Ok(_) => return minus_one(libc::EPROTO),
            Err(e) => return minus_one(e),
        };
        match new_id(h, chan, user, ps) {
            Ok(v) => {
                // SAFETY: out is the app's out-pointer.
                unsafe { *out = v.cast() };
                0
            }
            Err(e) => {
                let _ = call(&Request::CmDestroyId { id: h });
                minus_one(e)
            }
        }
    })
}

/// The id behind `id`.
///
/// # Safety
/// `id` must be a live id of ours.
pub(super) unsafe fn vid<'a>(id: *mut rdma_cm_id) -> &'a mut VId {
    // SAFETY: per the contract; VId starts with its rdma_cm_id.
    unsafe { &mut *id.cast::<VId>() }
}

#[unsafe(no_mangle)]
pub extern "C" fn vrnic_rdma_destroy_id(id: *mut rdma_cm_id) -> c_int {
    guard(-1, || {
        if id.is_null() {
            return minus_one(libc::EINVAL);
        }
        // SAFETY: id is ours and live.
        let v = unsafe { vid(id) };
        if !v.id.event.is_null() {
            vrnic_rdma_ack_cm_event(v.id.event);
            v.id.event = null_mut();
        }
        let _ = call(&Request::CmDestroyId { id: v.handle });
        if let Some(m) = IDS.lock().unwrap_or_else(|e| e.into_inner()).as_mut() {
            m.remove(&v.handle);
        }
        let chan = v.chan.load(Ordering::Acquire) as *const VChannel;
        if !chan.is_null() {
            // SAFETY: the channel outlives its ids.
            if let Ok(mut q) = unsafe { &*chan }.queue.lock() {
                q.retain(|&h| h != v.handle);
            }
        }
        if v.own_chan != 0 {
            // SAFETY: our private channel, made with the id.
            drop(unsafe { Box::from_raw(v.own_chan as *mut VChannel) });
        }
        // SAFETY: boxed by new_id; the app gives it up now.
        drop(unsafe { Box::from_raw(id.cast::<VId>()) });
        0
    })
}

pub(super) fn ok_or_minus_one(r: Result<Reply, i32>) -> c_int {
    match r {
        Ok(_) => 0,
        Err(e) => minus_one(e),
    }
}

#[unsafe(no_mangle)]
pub extern "C" fn vrnic_rdma_bind_addr(id: *mut rdma_cm_id, addr: *mut libc::sockaddr) -> c_int {
    guard(-1, || {
        if id.is_null() {
            return minus_one(libc::EINVAL);
        }
        // SAFETY: the app passes a sockaddr of its family.
        let a = match unsafe { sockaddr_in(addr) } {
            Ok(a) => a,
            Err(e) => return minus_one(e),
        };
        // SAFETY: id is ours and live.
        let v = unsafe { vid(id) };
        match call(&Request::CmBind {
            id: v.handle,
            addr: a.to_string(),
        }) {
            Ok(Reply::CmAddr(b)) => {
                set_local(v, &b);
                // A loopback address is no device's: the id stays without one (`verbs` NULL)
                // until it listens, resolves or connects, as an id bound where no RDMA device
                // is. libfabric's verbs provider binds its default source, "localhost", and
                // takes a device's own interface address instead only when the bind gives no
                // device; with one, a server listened on 127.0.0.1 and told its clients on
                // other hosts to connect there.
                if a.ip().is_loopback() {
                    return 0;
                }
                match attach(v) {
                    Ok(()) => 0,
                    Err(e) => minus_one(e),
                }
            }
            Ok(_) => minus_one(libc::EPROTO),
            Err(e) => minus_one(e),
        }
    })
}

#[unsafe(no_mangle)]
pub extern "C" fn vrnic_rdma_listen(id: *mut rdma_cm_id, _backlog: c_int) -> c_int {
    guard(-1, || {
        if id.is_null() {
            return minus_one(libc::EINVAL);
        }
        // SAFETY: id is ours and live.
        let v = unsafe { vid(id) };
        if v.id.verbs.is_null() && attach(v).is_err() {
            return minus_one(libc::ENODEV);
        }
        ok_or_minus_one(call(&Request::CmListen { id: v.handle }))
    })
}

/// For a synchronous id: waits for its next event, which must be `want`. As librdmacm's
/// `ucma_complete`, the event stays in `id.event` (the previous one acked first) until the
/// id's next synchronous call or its destruction: callers read the peer's private data there
/// (rsocket does). Errors map as `ucma_complete`'s.
pub(super) fn complete(v: &mut VId, want: u32) -> Result<(), i32> {
    if v.own_chan == 0 {
        return Ok(());
    }
    if !v.id.event.is_null() {
        vrnic_rdma_ack_cm_event(v.id.event);
        v.id.event = null_mut();
    }
    let mut ev: *mut rdma_cm_event = null_mut();
    let chan = v.own_chan as *mut rdma_event_channel;
    if vrnic_rdma_get_cm_event(chan, &mut ev) != 0 {
        return Err(sys::errno());
    }
    v.id.event = ev;
    // SAFETY: get_cm_event returned a live event.
    let e = unsafe { &*ev };
    let (kind, status) = (e.event, e.status);
    if kind == want && status == 0 {
        return Ok(());
    }
    Err(match kind {
        k if k == cm_event::REJECTED => libc::ECONNREFUSED,
        k if k == cm_event::UNREACHABLE => libc::ENETUNREACH,
        k if k == cm_event::ADDR_ERROR => libc::EHOSTUNREACH,
        _ if status < 0 => -status,
        _ => libc::EIO,
    })
}

#[unsafe(no_mangle)]
pub extern "C" fn vrnic_rdma_resolve_addr(
    id: *mut rdma_cm_id,
    src: *mut libc::sockaddr,
    dst: *mut libc::sockaddr,
    _timeout_ms: c_int,
) -> c_int {
    guard(-1, || {
        if id.is_null() {
            return minus_one(libc::EINVAL);
        }
        let src = if src.is_null() {
            None
        } else {
            // SAFETY: the app passes a sockaddr of its family.
            match unsafe { sockaddr_in(src) } {
                Ok(a) => Some(a.to_string()),
                Err(e) => return minus_one(e),
            }
        };
        // SAFETY: as above.
        let dst = match unsafe { sockaddr_in(dst) } {
            Ok(a) => a,
            Err(e) => return minus_one(e),
        };
        // SAFETY: id is ours and live.
        let v = unsafe { vid(id) };
        store(&dst, &mut v.id.route.addr.dst_storage);
        match call(&Request::CmResolveAddr {
            id: v.handle,
            src,
            dst: dst.to_string(),
        }) {
            Ok(Reply::CmAddr(a)) => set_local(v, &a),
            Ok(_) => return minus_one(libc::EPROTO),
            Err(e) => return minus_one(e),
        }
        match complete(v, cm_event::ADDR_RESOLVED) {
            Ok(()) => 0,
            Err(e) => minus_one(e),
        }
    })
}

#[unsafe(no_mangle)]
pub extern "C" fn vrnic_rdma_resolve_route(id: *mut rdma_cm_id, _timeout_ms: c_int) -> c_int {
    guard(-1, || {
        if id.is_null() {
            return minus_one(libc::EINVAL);
        }
        // SAFETY: id is ours and live.
        let v = unsafe { vid(id) };
        if let Err(e) = call(&Request::CmResolveRoute { id: v.handle }) {
            return minus_one(e);
        }
        match complete(v, cm_event::ROUTE_RESOLVED) {
            Ok(()) => 0,
            Err(e) => minus_one(e),
        }
    })
}
