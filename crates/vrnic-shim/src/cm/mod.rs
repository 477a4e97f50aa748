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
//!
//! This file holds the ids' objects, the module's tables and its one context; the sections of
//! the ABI are files of their own, sharing this module's namespace (`use super::*`).
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

mod addr;
mod channel;
mod connect;
mod device;
mod ep;
mod events;
mod getaddrinfo;
mod id;
mod qp;
mod srq;

use self::{addr::*, channel::*, events::*, id::*, qp::*};

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
            let info = &unsafe { context(verbs) }.conn.info;
            c_int::try_from(info.max_qp_wr).unwrap_or(c_int::MAX)
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
    // The first vRNIC this process reaches, as `ibv_get_device_list` lists it first.
    let dev = crate::client::discover()
        .into_iter()
        .next()
        .ok_or(libc::ENODEV)?;
    let ctx = crate::ffi::table::open_device(crate::ffi::device::device_for(dev))?;
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
