//! The librdmacm C ABI (`rdma_*`) over the vRNIC: connection management without
//! `/dev/infiniband/rdma_cm`.
//!
//! Ids, binding, listening and the connection handshake are remoted to the daemon's broker
//! (`CmCreateId`, `CmConnect`, ...) through the control mailbox of one context this module
//! opens on the process's vRNIC (the `verbs` of every id). The broker announces each event on
//! that context's event ring; the notifier thread hands it to [`deliver`], which wakes the
//! id's event channel (a real pollable eventfd); `rdma_get_cm_event` fetches the event and does
//! what librdmacm does on the way: it fills the id's addresses, creates the new id of a
//! connection request, and, on the active side of a connection with a QP, moves the QP to RTR
//! and RTS and answers with `rdma_establish` before reporting `ESTABLISHED`.
//!
//! Ids created without a channel are synchronous (as in librdmacm): each call waits for its
//! own event on a private channel and returns its outcome.
#![allow(unsafe_code)]
#![allow(clippy::not_unsafe_ptr_arg_deref)]
#![allow(clippy::missing_safety_doc)]

use std::collections::{HashMap, HashSet, VecDeque};
use std::ffi::{CStr, c_char, c_int, c_void};
use std::net::{Ipv4Addr, Ipv6Addr, SocketAddr, SocketAddrV4, SocketAddrV6};
use std::ptr::null_mut;
use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};

use vrnic_api::{CmEvent, CmParam, Reply, Request, cm_event};

use crate::abi::*;
use crate::cm_abi::*;
use crate::ffi::{context, guard, minus_one, null_err};
use crate::sys::{self, EventFd, set_errno};

/// An event channel: the fd the app polls, and the ids with an event announced.
#[repr(C)]
struct VChannel {
    ch: rdma_event_channel,
    efd: EventFd,
    queue: Mutex<VecDeque<u32>>,
}

/// What the id knows of its peer (from `CONNECT_REQUEST` or `CONNECT_RESPONSE`).
#[derive(Default, Clone)]
struct Peer {
    lid: u16,
    gid: [u8; 16],
    param: CmParam,
}

/// The fields librdmacm's private `struct cma_id_private` has right after its `rdma_cm_id`
/// (rdma-core `librdmacm/cma.c`). Code inside the real librdmacm that the preload does not
/// replace, rsocket's above all, reaches them from an id by `container_of`: `ucma_max_qpsize`
/// reads `cma_dev->max_qpsize`, `ucma_complete` reads `sync` and then takes the id's next event
/// through `rdma_get_cm_event` (ours) into `id.event`. The rest is never read from outside
/// librdmacm's own ids.
#[repr(C)]
struct CmaIdShadow {
    cma_dev: *mut CmaDeviceShadow,
    connect: *mut c_void,
    connect_len: usize,
    events_completed: c_int,
    connect_error: c_int,
    /// 1 for a synchronous id (created without a channel), as librdmacm.
    sync: c_int,
}

/// librdmacm's private `struct cma_device`, as far as `max_qpsize`.
#[repr(C)]
struct CmaDeviceShadow {
    dev: *mut c_void,
    entry: [usize; 2],
    verbs: *mut ibv_context,
    pd: *mut c_void,
    xrcd: *mut c_void,
    port: *mut c_void,
    guid: u64,
    port_cnt: c_int,
    refcnt: c_int,
    max_qpsize: c_int,
    max_initiator_depth: u8,
    max_responder_resources: u8,
    ibv_idx: c_int,
    is_device_dead: u8,
}

const _: () = assert!(std::mem::offset_of!(CmaDeviceShadow, max_qpsize) == 72);
const _: () = assert!(std::mem::offset_of!(VId, shadow) == std::mem::size_of::<rdma_cm_id>());
const _: () = assert!(std::mem::offset_of!(CmaIdShadow, sync) == 32);

/// The one `cma_device` shadow every id names (the one device the connection manager uses).
fn cma_device() -> *mut CmaDeviceShadow {
    static DEV: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *DEV.get_or_init(|| {
        let verbs = device().unwrap_or(null_mut());
        let max_qpsize = if verbs.is_null() {
            0
        } else {
            // SAFETY: device() hands out the connection manager's live context.
            unsafe { crate::ffi::device::max_qp_wr(verbs) }
        };
        Box::into_raw(Box::new(CmaDeviceShadow {
            dev: null_mut(),
            entry: [0; 2],
            verbs,
            pd: null_mut(),
            xrcd: null_mut(),
            port: null_mut(),
            guid: 0,
            port_cnt: 1,
            refcnt: 1,
            max_qpsize,
            max_initiator_depth: 16,
            max_responder_resources: 16,
            ibv_idx: 0,
            is_device_dead: 0,
        })) as usize
    }) as *mut CmaDeviceShadow
}

/// An id: `rdma_cm_id` first (container_of), then what librdmacm's own code may read after it.
#[repr(C)]
struct VId {
    id: rdma_cm_id,
    shadow: CmaIdShadow,
    handle: u32,
    /// `*mut VChannel` the id's events go to.
    chan: AtomicUsize,
    /// The private channel of a synchronous id (freed with it).
    own_chan: usize,
    peer: Mutex<Peer>,
    /// Our own parameters of the last connect/accept (the QP transitions use them).
    mine: Mutex<CmParam>,
    /// `rdma_create_ep` on a passive endpoint: what `rdma_get_request` builds for each new id.
    ep_qp: Option<(usize, ibv_qp_init_attr)>,
    /// CQs and channels the library created for the id's QP (destroyed with it).
    made_cqs: bool,
    made_pd: bool,
}

/// A delivered event with the bytes its private data points to.
#[repr(C)]
struct VEvent {
    ev: rdma_cm_event,
    data: Vec<u8>,
}

/// The one context the connection manager uses (opened on first need, never closed).
static DEVICE: Mutex<usize> = Mutex::new(0);
/// Id handle -> `*mut VId`.
static IDS: Mutex<Option<HashMap<u32, usize>>> = Mutex::new(None);
/// Ids named by an announcement before the app knew them (a request's new id).
static EARLY: Mutex<Option<HashSet<u32>>> = Mutex::new(None);

fn device() -> Result<*mut ibv_context, i32> {
    let mut d = DEVICE.lock().unwrap_or_else(|e| e.into_inner());
    if *d != 0 {
        return Ok(*d as *mut ibv_context);
    }
    let mut n = 0;
    let list = crate::ffi::device::vrnic_ibv_get_device_list(&mut n);
    if list.is_null() || n < 1 {
        return Err(libc::ENODEV);
    }
    // SAFETY: the list holds n >= 1 devices.
    let dev = unsafe { *list };
    let ctx = crate::ffi::table::vrnic_ibv_open_device(dev);
    crate::ffi::device::vrnic_ibv_free_device_list(list);
    if ctx.is_null() {
        return Err(sys::errno());
    }
    *d = ctx as usize;
    crate::client::set_cm_sink(deliver);
    Ok(ctx)
}

fn call(req: &Request) -> Result<Reply, i32> {
    let ctx = device()?;
    // SAFETY: the CM context stays open for the life of the process.
    unsafe { context(ctx) }.conn.call(req)
}

fn register(handle: u32, v: *mut VId) {
    let mut ids = IDS.lock().unwrap_or_else(|e| e.into_inner());
    ids.get_or_insert_with(HashMap::new)
        .insert(handle, v as usize);
    // Announcements that came before the id was known (checked under the table's lock, as
    // `deliver` records them).
    let early = EARLY
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .as_mut()
        .is_some_and(|s| s.remove(&handle));
    drop(ids);
    if early {
        deliver(handle);
    }
}

fn lookup(handle: u32) -> Option<*mut VId> {
    IDS.lock()
        .unwrap_or_else(|e| e.into_inner())
        .as_ref()
        .and_then(|m| m.get(&handle).copied())
        .map(|p| p as *mut VId)
}

/// Called by the notifier thread: an event is queued on `handle`.
pub fn deliver(handle: u32) {
    // The id table stays locked while the id is used: `rdma_destroy_id` unregisters an id
    // (under this lock) before it frees it.
    let ids = IDS.lock().unwrap_or_else(|e| e.into_inner());
    let Some(&v) = ids.as_ref().and_then(|m| m.get(&handle)) else {
        // Still under the id table's lock, so `register` cannot miss it.
        EARLY
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get_or_insert_with(HashSet::new)
            .insert(handle);
        return;
    };
    // SAFETY: registered ids are live while the table is locked (see above).
    let chan = unsafe { &*(v as *const VId) }.chan.load(Ordering::Acquire) as *const VChannel;
    if chan.is_null() {
        return;
    }
    // SAFETY: an id's channel outlives it (the app destroys its ids before their channel).
    let c = unsafe { &*chan };
    if let Ok(mut q) = c.queue.lock() {
        q.push_back(handle);
    }
    c.efd.signal();
}

// ---- addresses -------------------------------------------------------------------------------

/// Reads a `sockaddr` (IPv4 or IPv6).
unsafe fn sockaddr_in(sa: *const libc::sockaddr) -> Result<SocketAddr, i32> {
    if sa.is_null() {
        return Err(libc::EINVAL);
    }
    // SAFETY: the caller passes a sockaddr of its family's size.
    match c_int::from(unsafe { (*sa).sa_family }) {
        libc::AF_INET => {
            // SAFETY: AF_INET: a sockaddr_in.
            let s = unsafe { &*sa.cast::<libc::sockaddr_in>() };
            let ip = Ipv4Addr::from(u32::from_be(s.sin_addr.s_addr));
            Ok(SocketAddr::V4(SocketAddrV4::new(
                ip,
                u16::from_be(s.sin_port),
            )))
        }
        libc::AF_INET6 => {
            // SAFETY: AF_INET6: a sockaddr_in6.
            let s = unsafe { &*sa.cast::<libc::sockaddr_in6>() };
            let ip = Ipv6Addr::from(s.sin6_addr.s6_addr);
            Ok(SocketAddr::V6(SocketAddrV6::new(
                ip,
                u16::from_be(s.sin6_port),
                s.sin6_flowinfo,
                s.sin6_scope_id,
            )))
        }
        _ => Err(libc::EAFNOSUPPORT),
    }
}

/// Writes `a` into a `sockaddr_storage`; returns its length.
fn store(a: &SocketAddr, out: &mut libc::sockaddr_storage) -> libc::socklen_t {
    // SAFETY: sockaddr_storage is plain data; zero is valid.
    *out = unsafe { std::mem::zeroed() };
    match a {
        SocketAddr::V4(v) => {
            let p = (out as *mut libc::sockaddr_storage).cast::<libc::sockaddr_in>();
            // SAFETY: sockaddr_storage is large and aligned enough for a sockaddr_in.
            let s = unsafe { &mut *p };
            s.sin_family = libc::AF_INET as libc::sa_family_t;
            s.sin_port = v.port().to_be();
            s.sin_addr.s_addr = u32::from(*v.ip()).to_be();
            std::mem::size_of::<libc::sockaddr_in>() as libc::socklen_t
        }
        SocketAddr::V6(v) => {
            let p = (out as *mut libc::sockaddr_storage).cast::<libc::sockaddr_in6>();
            // SAFETY: sockaddr_storage is large and aligned enough for a sockaddr_in6.
            let s = unsafe { &mut *p };
            s.sin6_family = libc::AF_INET6 as libc::sa_family_t;
            s.sin6_port = v.port().to_be();
            s.sin6_addr.s6_addr = v.ip().octets();
            s.sin6_flowinfo = v.flowinfo();
            s.sin6_scope_id = v.scope_id();
            std::mem::size_of::<libc::sockaddr_in6>() as libc::socklen_t
        }
    }
}

fn set_local(v: &mut VId, a: &str) {
    if let Ok(a) = a.parse::<SocketAddr>() {
        store(&a, &mut v.id.route.addr.src_storage);
    }
}

fn set_remote(v: &mut VId, a: &str) {
    if let Ok(a) = a.parse::<SocketAddr>() {
        store(&a, &mut v.id.route.addr.dst_storage);
    }
}

/// Attaches the id to the device: `verbs`, port and the source GID.
fn attach(v: &mut VId) -> Result<(), i32> {
    let ctx = device()?;
    v.id.verbs = ctx;
    v.id.port_num = 1;
    // SAFETY: the CM context is open.
    let gid = unsafe { context(ctx) }.conn.info.gid;
    v.id.route.addr.ibaddr.sgid.raw = gid;
    v.id.route.addr.ibaddr.pkey = 0xffff;
    Ok(())
}

// ---- channels --------------------------------------------------------------------------------

/// The lowest fd number an event channel gets: three quarters of the way to the process's fd
/// limit (at most `FD_SETSIZE`, 1024), above the fds an app opens itself.
///
/// librdmacm's rsocket names each socket by its id's event-channel fd, and Debian 12's
/// `librspreload` (rdma-core v44) maps `select` results back to the app's fds by walking fd
/// numbers upward until one maps to that channel fd. An fd it does not track maps to itself, so
/// when the channel fd is lower than the app's fd for the socket, the walk stops at the channel
/// fd and sets that bit instead: the app never sees the socket ready (rdma-core fixed the walk
/// in v63, commit 7ea19e1). An accepted rsocket's channel is made before the app's `accept`
/// opens its fd, so without this floor every accepted socket is lost to `select` (iperf3's
/// server saw no data). A kernel-backed librdmacm has the same bug; high fds keep it away.
fn channel_fd_floor() -> c_int {
    // SAFETY: getrlimit writes one rlimit into our local.
    let mut r: libc::rlimit = unsafe { std::mem::zeroed() };
    // SAFETY: as above.
    let soft = if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut r) } == 0 {
        r.rlim_cur.min(1024) as c_int
    } else {
        1024
    };
    soft * 3 / 4
}

fn new_channel() -> Result<*mut VChannel, i32> {
    let efd = EventFd::new_above(channel_fd_floor())
        .map_err(|e| e.raw_os_error().unwrap_or(libc::EMFILE))?;
    let fd = efd.fd();
    Ok(Box::into_raw(Box::new(VChannel {
        ch: rdma_event_channel { fd },
        efd,
        queue: Mutex::new(VecDeque::new()),
    })))
}

#[unsafe(no_mangle)]
pub extern "C" fn vrnic_rdma_create_event_channel() -> *mut rdma_event_channel {
    guard(null_err(libc::EIO), || match new_channel() {
        Ok(c) => c.cast(),
        Err(e) => null_err(e),
    })
}

/// The channel is not freed and its fd stays open until the process exits: a thread may still
/// be on its way into `rdma_get_cm_event` on it (Debian 12's `rping` does this at exit: its CM
/// thread loops back while the main thread destroys the channel, and with a closed fd it would
/// fail with `EBADF` and `exit(-1)`). Such a thread now waits, as one already blocked in the
/// kernel's read would, until the process ends. The cost is one fd and a few bytes per
/// destroyed channel; programs make few.
#[unsafe(no_mangle)]
pub extern "C" fn vrnic_rdma_destroy_event_channel(ch: *mut rdma_event_channel) {
    guard((), || {
        if !ch.is_null() {
            // SAFETY: made by create_event_channel; the app gives it up now.
            let c = unsafe { &*ch.cast::<VChannel>() };
            if let Ok(mut q) = c.queue.lock() {
                q.clear();
            }
        }
    })
}

// ---- ids -------------------------------------------------------------------------------------

fn new_id(
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
unsafe fn vid<'a>(id: *mut rdma_cm_id) -> &'a mut VId {
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

fn ok_or_minus_one(r: Result<Reply, i32>) -> c_int {
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
fn complete(v: &mut VId, want: u32) -> Result<(), i32> {
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

// ---- QPs on ids --------------------------------------------------------------------------------

fn modify(qp: *mut ibv_qp, a: &mut ibv_qp_attr, mask: c_int) -> Result<(), i32> {
    match crate::ffi::qp::vrnic_ibv_modify_qp(qp, a, mask) {
        0 => Ok(()),
        e => Err(e),
    }
}

/// INIT for a new QP on an id, as librdmacm's `ucma_init_conn_qp`/`ucma_init_ud_qp` do; a UD
/// QP goes on to RTS (it needs no peer).
fn init_qp(qp: *mut ibv_qp, ud: bool) -> Result<(), i32> {
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
fn connect_qp(v: &VId) -> Result<(), i32> {
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

fn create_qp_on(v: &mut VId, pd: *mut ibv_pd, attr: &mut ibv_qp_init_attr) -> Result<(), i32> {
    if v.id.verbs.is_null() {
        return Err(libc::EINVAL);
    }
    let pd = if !pd.is_null() {
        pd
    } else if !v.id.pd.is_null() {
        v.id.pd
    } else {
        let p = crate::ffi::mr::vrnic_ibv_alloc_pd(v.id.verbs);
        if p.is_null() {
            return Err(sys::errno());
        }
        v.made_pd = true;
        p
    };
    v.id.pd = pd;
    if attr.send_cq.is_null() && attr.recv_cq.is_null() {
        // As librdmacm: a completion channel and a CQ for each direction.
        let ctx = v.id.verbs;
        let sc = crate::ffi::cq::vrnic_ibv_create_comp_channel(ctx);
        let rc = crate::ffi::cq::vrnic_ibv_create_comp_channel(ctx);
        let scq = crate::ffi::cq::vrnic_ibv_create_cq(
            ctx,
            attr.cap.max_send_wr.max(1) as c_int,
            null_mut(),
            sc,
            0,
        );
        let rcq = crate::ffi::cq::vrnic_ibv_create_cq(
            ctx,
            attr.cap.max_recv_wr.max(1) as c_int,
            null_mut(),
            rc,
            0,
        );
        if sc.is_null() || rc.is_null() || scq.is_null() || rcq.is_null() {
            return Err(libc::ENOMEM);
        }
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
    let qp = crate::ffi::qp::vrnic_ibv_create_qp(pd, attr);
    if qp.is_null() {
        return Err(sys::errno());
    }
    // SAFETY: qp is the QP just made.
    let ud = unsafe { (*qp).qp_type } == IBV_QPT_UD;
    if let Err(e) = init_qp(qp, ud) {
        crate::ffi::qp::vrnic_ibv_destroy_qp(qp);
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
            crate::ffi::qp::vrnic_ibv_destroy_qp(v.id.qp);
            v.id.qp = null_mut();
        }
        if v.made_cqs {
            for cq in [v.id.send_cq, v.id.recv_cq] {
                crate::ffi::cq::vrnic_ibv_destroy_cq(cq);
            }
            for ch in [v.id.send_cq_channel, v.id.recv_cq_channel] {
                crate::ffi::cq::vrnic_ibv_destroy_comp_channel(ch);
            }
            v.id.send_cq = null_mut();
            v.id.recv_cq = null_mut();
            v.id.send_cq_channel = null_mut();
            v.id.recv_cq_channel = null_mut();
            v.made_cqs = false;
        }
    })
}

// ---- connecting ------------------------------------------------------------------------------

fn param_from(p: *const rdma_conn_param, v: &VId) -> CmParam {
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

// ---- events ----------------------------------------------------------------------------------

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
fn build_event(v: &mut VId, e: CmEvent) -> Option<*mut VEvent> {
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

// ---- the synchronous endpoint API --------------------------------------------------------------

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
            crate::ffi::srq::vrnic_ibv_destroy_srq(v.id.srq);
            v.id.srq = null_mut();
        }
        if v.made_pd && !v.id.pd.is_null() {
            crate::ffi::mr::vrnic_ibv_dealloc_pd(v.id.pd);
        }
        vrnic_rdma_destroy_id(id);
    })
}

// ---- addresses and devices -------------------------------------------------------------------

#[unsafe(no_mangle)]
pub extern "C" fn vrnic_rdma_get_src_port(id: *mut rdma_cm_id) -> u16 {
    port_of(id, true)
}

#[unsafe(no_mangle)]
pub extern "C" fn vrnic_rdma_get_dst_port(id: *mut rdma_cm_id) -> u16 {
    port_of(id, false)
}

/// The port of the id's local or peer address, in network order (as librdmacm returns it).
fn port_of(id: *mut rdma_cm_id, local: bool) -> u16 {
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

// ---- rdma_getaddrinfo ------------------------------------------------------------------------

/// `getaddrinfo` hints for an `rdma_addrinfo`'s, as librdmacm's `ucma_convert_to_ai`: the
/// passive and numeric-host flags, the family (but `AF_IB`), the socket type of the QP type and
/// the protocol of the port space.
fn gai_hints(h: &rdma_addrinfo) -> libc::addrinfo {
    // SAFETY: plain C data; zero is valid.
    let mut gh: libc::addrinfo = unsafe { std::mem::zeroed() };
    if h.ai_flags & RAI_PASSIVE != 0 {
        gh.ai_flags |= libc::AI_PASSIVE;
    }
    if h.ai_flags & RAI_NUMERICHOST != 0 {
        gh.ai_flags |= libc::AI_NUMERICHOST;
    }
    // AF_IB names no family the resolver knows: it looks up any, as librdmacm has it.
    if h.ai_family != libc::AF_IB {
        gh.ai_family = h.ai_family;
    }
    gh.ai_socktype = match h.ai_qp_type as u32 {
        IBV_QPT_RC | IBV_QPT_UC | IBV_QPT_XRC_SEND | IBV_QPT_XRC_RECV => libc::SOCK_STREAM,
        IBV_QPT_UD => libc::SOCK_DGRAM,
        _ => 0,
    };
    gh.ai_protocol = match h.ai_port_space as u32 {
        RDMA_PS_TCP => libc::IPPROTO_TCP,
        RDMA_PS_UDP | RDMA_PS_IPOIB => libc::IPPROTO_UDP,
        RDMA_PS_IB if gh.ai_socktype == libc::SOCK_STREAM => libc::IPPROTO_TCP,
        RDMA_PS_IB if gh.ai_socktype == libc::SOCK_DGRAM => libc::IPPROTO_UDP,
        _ => 0,
    };
    gh
}

/// A `malloc`ed copy of the `n`-byte address `a` (freed by `rdma_freeaddrinfo`); NULL if out of
/// memory.
///
/// # Safety
/// `a` must hold `n` readable bytes.
unsafe fn copy_addr(a: *const libc::sockaddr, n: libc::socklen_t) -> *mut libc::sockaddr {
    // SAFETY: malloc has no preconditions.
    let p = unsafe { libc::malloc(n as usize) }.cast::<libc::sockaddr>();
    if !p.is_null() {
        // SAFETY: p holds n bytes; the caller vouches for n bytes at a.
        unsafe { std::ptr::copy_nonoverlapping(a.cast::<u8>(), p.cast::<u8>(), n as usize) };
    }
    p
}

/// `rdma_getaddrinfo` with librdmacm's semantics (`librdmacm/addrinfo.c`): with a node or a
/// service, the first address `getaddrinfo` finds under the hints (the source address of a
/// passive lookup, else the destination), the QP type and port space from the hints or else
/// from the socket type and protocol found; with neither, the hints themselves (flags, family,
/// QP type, port space and their destination address) — libfabric's verbs provider asks this
/// way with the address already in `ai_dst_addr`, or in `ai_src_addr` with `RAI_PASSIVE`.
/// Either way a source address in the hints is kept when the lookup gave none. No node,
/// service or hints: `EINVAL`. A failed lookup returns its `getaddrinfo` code (negative)
/// with errno `ENODEV`.
#[unsafe(no_mangle)]
pub extern "C" fn vrnic_rdma_getaddrinfo(
    node: *const c_char,
    service: *const c_char,
    hints: *const rdma_addrinfo,
    res: *mut *mut rdma_addrinfo,
) -> c_int {
    guard(-1, || {
        if res.is_null() || (node.is_null() && service.is_null() && hints.is_null()) {
            return minus_one(libc::EINVAL);
        }
        // SAFETY: plain C data; zero is valid (librdmacm's `nohints`).
        let none: rdma_addrinfo = unsafe { std::mem::zeroed() };
        let h = if hints.is_null() {
            &none
        } else {
            // SAFETY: hints is the app's, readable for this call.
            unsafe { &*hints }
        };
        // SAFETY: calloc of one zeroed rdma_addrinfo; freed by rdma_freeaddrinfo.
        let r = unsafe { libc::calloc(1, std::mem::size_of::<rdma_addrinfo>()) }
            .cast::<rdma_addrinfo>();
        if r.is_null() {
            return minus_one(libc::ENOMEM);
        }
        // SAFETY: r is a zeroed rdma_addrinfo of ours.
        let o = unsafe { &mut *r };
        let mut oom = false;
        if !node.is_null() || !service.is_null() {
            let gh = gai_hints(h);
            let mut gai: *mut libc::addrinfo = null_mut();
            let gh_ptr: *const libc::addrinfo = if hints.is_null() { null_mut() } else { &gh };
            // SAFETY: node/service are NULL or C strings; gai is our out-pointer.
            let rc = unsafe { libc::getaddrinfo(node, service, gh_ptr, &mut gai) };
            if rc != 0 || gai.is_null() {
                vrnic_rdma_freeaddrinfo(r);
                set_errno(libc::ENODEV);
                return rc.min(-1);
            }
            // SAFETY: gai is getaddrinfo's list; its first entry has an address.
            let g = unsafe { &*gai };
            o.ai_qp_type = if h.ai_qp_type != 0 {
                h.ai_qp_type
            } else {
                match g.ai_socktype {
                    libc::SOCK_STREAM => IBV_QPT_RC as c_int,
                    libc::SOCK_DGRAM => IBV_QPT_UD as c_int,
                    _ => 0,
                }
            };
            o.ai_port_space = if h.ai_port_space != 0 {
                h.ai_port_space
            } else {
                match g.ai_protocol {
                    libc::IPPROTO_TCP => RDMA_PS_TCP as c_int,
                    libc::IPPROTO_UDP => RDMA_PS_UDP as c_int,
                    _ => 0,
                }
            };
            o.ai_family = g.ai_family;
            // SAFETY: the entry's address holds ai_addrlen bytes.
            let a = unsafe { copy_addr(g.ai_addr, g.ai_addrlen) };
            oom |= a.is_null();
            if g.ai_flags & libc::AI_PASSIVE != 0 {
                o.ai_flags = RAI_PASSIVE;
                o.ai_src_addr = a;
                o.ai_src_len = if a.is_null() { 0 } else { g.ai_addrlen };
            } else {
                o.ai_dst_addr = a;
                o.ai_dst_len = if a.is_null() { 0 } else { g.ai_addrlen };
            }
            // SAFETY: gai came from getaddrinfo.
            unsafe { libc::freeaddrinfo(gai) };
        } else {
            o.ai_flags = h.ai_flags;
            o.ai_family = h.ai_family;
            o.ai_qp_type = h.ai_qp_type;
            o.ai_port_space = h.ai_port_space;
            if h.ai_dst_len != 0 && !h.ai_dst_addr.is_null() {
                // SAFETY: the hints' destination holds ai_dst_len bytes.
                o.ai_dst_addr = unsafe { copy_addr(h.ai_dst_addr, h.ai_dst_len) };
                o.ai_dst_len = h.ai_dst_len;
                oom |= o.ai_dst_addr.is_null();
            }
        }
        if !oom && o.ai_src_len == 0 && h.ai_src_len != 0 && !h.ai_src_addr.is_null() {
            // SAFETY: the hints' source holds ai_src_len bytes.
            o.ai_src_addr = unsafe { copy_addr(h.ai_src_addr, h.ai_src_len) };
            o.ai_src_len = h.ai_src_len;
            oom |= o.ai_src_addr.is_null();
        }
        if oom {
            vrnic_rdma_freeaddrinfo(r);
            return minus_one(libc::ENOMEM);
        }
        // SAFETY: res is the app's out-pointer.
        unsafe { *res = r };
        0
    })
}

#[unsafe(no_mangle)]
pub extern "C" fn vrnic_rdma_freeaddrinfo(res: *mut rdma_addrinfo) {
    let mut p = res;
    while !p.is_null() {
        // SAFETY: made by rdma_getaddrinfo with calloc.
        let r = unsafe { &*p };
        let next = r.ai_next;
        for a in [
            r.ai_src_addr.cast::<c_void>(),
            r.ai_dst_addr.cast(),
            r.ai_src_canonname.cast(),
            r.ai_dst_canonname.cast(),
            r.ai_route,
            r.ai_connect,
        ] {
            // SAFETY: NULL or malloc'ed by rdma_getaddrinfo.
            unsafe { libc::free(a) };
        }
        // SAFETY: calloc'ed by rdma_getaddrinfo; not used after this.
        unsafe { libc::free(p.cast()) };
        p = next;
    }
}

// ---- SRQs on ids, and what is not supported ---------------------------------------------------

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
        let s = crate::ffi::srq::vrnic_ibv_create_srq(pd, attr);
        if s.is_null() {
            return -1;
        }
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
        let s = crate::ffi::srq::vrnic_create_srq_ex(v.id.verbs, attr);
        if s.is_null() {
            return -1;
        }
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
            crate::ffi::srq::vrnic_ibv_destroy_srq(v.id.srq);
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sockaddrs_round_trip() {
        for s in ["127.0.0.1:7174", "[::1]:18515", "0.0.0.0:0"] {
            let a: SocketAddr = s.parse().unwrap();
            // SAFETY: plain data.
            let mut st: libc::sockaddr_storage = unsafe { std::mem::zeroed() };
            store(&a, &mut st);
            // SAFETY: st holds the sockaddr just written.
            let b = unsafe { sockaddr_in((&st as *const libc::sockaddr_storage).cast()) }.unwrap();
            assert_eq!(a, b);
        }
    }
}
