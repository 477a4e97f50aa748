//! The bottom of the `extern "C"` layer: the objects behind the C structs (each starts with
//! its rdma-core struct, container_of), the way from an app's pointer to them ([`context`]),
//! the C boundary's helpers ([`guard`], [`null_err`], [`minus_one`], [`fail_at`]) and what
//! several verb families share: a work request's SGEs, the receive-list writer of QPs and SRQs,
//! a QP made from the daemon's answer, the address vector's C form, and the async events that
//! name an object. It names no verb family.
#![allow(unsafe_code)]
#![allow(clippy::not_unsafe_ptr_arg_deref)]

use std::collections::HashMap;
use std::ffi::{c_char, c_int, c_uint};
use std::mem::offset_of;
use std::panic::AssertUnwindSafe;
use std::ptr::null_mut;
use std::sync::atomic::AtomicU32;
use std::sync::{Arc, Condvar, Mutex};
use std::thread::ThreadId;

use vrnic_api::{Reply, Request};
use vrnic_shm::Ring;
use vrnic_wire::{
    AhAttr, GlobalRoute, MAX_SGE, QpCap, RQ_SLOT, RecvWqe, SQ_SLOT, SendWqe, Sge, SgeList, access,
};

use crate::abi::*;
use crate::client::{Channel, CompQueue, Conn, Device, WorkQueue, vlog};
use crate::parked::Parked;
use crate::sys::set_errno;

/// Runs `f`, turning a panic into `fail` (a panic must never unwind into C).
pub(crate) fn guard<R>(fail: R, f: impl FnOnce() -> R) -> R {
    match std::panic::catch_unwind(AssertUnwindSafe(f)) {
        Ok(r) => r,
        Err(_) => {
            vlog!("internal error (panic) caught at the C boundary");
            fail
        }
    }
}

/// Returns NULL with `errno` set.
pub(crate) fn null_err<T>(e: i32) -> *mut T {
    set_errno(e);
    null_mut()
}

/// Returns -1 with `errno` set.
pub(crate) fn minus_one(e: i32) -> c_int {
    set_errno(e);
    -1
}

// ---- the objects behind the C structs ------------------------------------------------------

/// A device: `ibv_device` first, then room for the provider's `verbs_device` word (left NULL so
/// provider-specific calls fail cleanly), then ours.
#[repr(C)]
pub struct VDevice {
    pub(crate) dev: ibv_device,
    pub(crate) verbs_device_pad: [u8; 128],
    pub(crate) info: Device,
}

/// A context: `verbs_context` first (the app gets a pointer to its last member, `context`).
#[repr(C)]
pub struct VContext {
    pub(crate) vctx: verbs_context,
    pub(crate) conn: Arc<Conn>,
    /// QP handle -> `*mut VQp`, for async events.
    pub(crate) qps: Mutex<HashMap<u32, usize>>,
    /// CQ handle -> `*mut VCq`, for async events.
    pub(crate) cqs: Mutex<HashMap<u32, usize>>,
    /// SRQ handle -> `*mut ibv_srq`, for async events.
    pub(crate) srqs: Mutex<HashMap<u32, usize>>,
    /// Live MRs (`*mut VMr`): closing the device deregisters them, so the app's buffers are
    /// back on private memory before the daemon reuses their region pages.
    pub(crate) mrs: Mutex<std::collections::HashSet<usize>>,
    /// Deregistered buffers still on their region pages, for cheap registration again
    /// (`parked`); evicted when the device closes.
    pub(crate) parked: Mutex<Parked>,
}

#[repr(C)]
pub(crate) struct VPd {
    pub(crate) pd: ibv_pd,
}

#[repr(C)]
pub(crate) struct VMr {
    pub(crate) mr: ibv_mr,
    /// `IBV_ACCESS_*` it was registered with (for `ibv_rereg_mr`).
    pub(crate) access: c_uint,
    /// For an MR over device memory (`ibv_reg_dm_mr`), its DM's count of MRs, which
    /// `ibv_dereg_mr` takes this one off; else NULL.
    pub(crate) dm_mrs: *const AtomicU32,
}

#[repr(C)]
pub(crate) struct VChannel {
    pub(crate) ch: ibv_comp_channel,
    pub(crate) chan: Arc<Channel>,
}

impl VMr {
    /// Trades registrations with `other` (the MR and its access flags), each keeping its link
    /// to device memory, as `ibv_rereg_mr` needs for a new translation.
    pub(crate) fn swap_registration(&mut self, other: &mut VMr) {
        std::mem::swap(&mut self.mr, &mut other.mr);
        std::mem::swap(&mut self.access, &mut other.access);
    }
}

/// A CQ: `ibv_cq_ex` first (its first part is the `ibv_cq` layout, so every CQ works with
/// both APIs; `create_cq_ex` fills the poll/read table).
#[repr(C)]
pub(crate) struct VCq {
    pub(crate) cq: ibv_cq_ex,
    pub(crate) q: Mutex<CompQueue>,
    pub(crate) channel: Option<Arc<Channel>>,
    /// Its events on their way to `channel` (shared with the notifier's watch).
    pub(crate) events: Arc<crate::cq_events::CqEvents>,
    pub(crate) delivered: std::sync::atomic::AtomicU32,
    /// The completion `start_poll`/`next_poll` loaded (still in the ring until `next_poll` or
    /// `end_poll` retires it), for the `read_*` calls.
    pub(crate) cur: Mutex<Option<vrnic_wire::Cqe>>,
}

/// A QP: `ibv_qp_ex` first (its first member is the `ibv_qp`).
#[repr(C)]
pub(crate) struct VQp {
    pub(crate) qp: ibv_qp_ex,
    pub(crate) sq: Mutex<WorkQueue>,
    pub(crate) rq: Mutex<WorkQueue>,
    pub(crate) cap: QpCap,
    pub(crate) sq_sig_all: bool,
    pub(crate) state: std::sync::atomic::AtomicU32,
    /// Made by `create_qp_ex` with `SEND_OPS_FLAGS`: `ibv_qp_to_qp_ex` hands out `qp` with its
    /// `ibv_wr_*` table.
    pub(crate) extended: bool,
    /// The `ibv_wr_start` batch being built, its first error and the thread building it.
    pub(crate) batch: WrState,
}

pub(crate) fn vctx_of(ctx: *mut ibv_context) -> *mut VContext {
    ctx.cast::<u8>()
        .wrapping_sub(offset_of!(verbs_context, context))
        .cast()
}

/// The context behind `ctx`.
///
/// # Safety
/// `ctx` must be a context returned by our `ibv_open_device` and not yet closed.
pub(crate) unsafe fn context<'a>(ctx: *mut ibv_context) -> &'a VContext {
    // SAFETY: per the contract, ctx is the `context` member of a live VContext.
    unsafe { &*vctx_of(ctx) }
}

pub(crate) fn copy_name(dst: &mut [c_char], name: &str) {
    let n = name.len().min(dst.len() - 1);
    for (d, s) in dst.iter_mut().zip(name.bytes().take(n)) {
        *d = s as c_char;
    }
    dst[n] = 0;
}

/// Makes the QP `req` asks for (`CreateQp`), of the type and with the CQs, SRQ and capacities
/// `ia` names (which gets the capacities granted), in context `ctx` under `pd` (NULL for an
/// XRC receive QP): the daemon's answer, its rings mapped, the `ibv_qp` handed to the app.
pub(crate) fn make_qp(
    ctx: *mut ibv_context,
    pd: *mut ibv_pd,
    ia: &mut ibv_qp_init_attr,
    req: &Request,
) -> Result<*mut ibv_qp, c_int> {
    // SAFETY: ctx is ours (the caller's PD's or the XRC domain's).
    let c = unsafe { context(ctx) };
    let (h, qpn, sq, sq_depth, rq, rq_depth, cap, bell) = match c.conn.call(req) {
        Ok(Reply::Qp {
            qp,
            qpn,
            sq,
            sq_depth,
            rq,
            rq_depth,
            cap,
            bell,
        }) => (qp, qpn, sq, sq_depth, rq, rq_depth, cap, bell),
        Ok(_) => return Err(libc::EPROTO),
        Err(e) => return Err(e),
    };
    let (Ok(sq), Ok(rq)) = (
        Ring::new(&c.conn.region, sq, sq_depth, SQ_SLOT),
        Ring::new(&c.conn.region, rq, rq_depth, RQ_SLOT),
    ) else {
        let _ = c.conn.call(&Request::DestroyQp { qp: h });
        return Err(libc::EPROTO);
    };
    ia.cap.max_send_wr = cap.max_send_wr;
    ia.cap.max_recv_wr = cap.max_recv_wr;
    ia.cap.max_send_sge = cap.max_send_sge;
    ia.cap.max_recv_sge = cap.max_recv_sge;
    ia.cap.max_inline_data = cap.max_inline_data;
    // SAFETY: plain C data plus pthread objects (all-zero is their initializer in glibc).
    let mut qp: ibv_qp = unsafe { std::mem::zeroed() };
    qp.context = ctx;
    qp.qp_context = ia.qp_context;
    qp.pd = pd;
    qp.send_cq = ia.send_cq;
    qp.recv_cq = ia.recv_cq;
    qp.srq = ia.srq;
    qp.handle = h;
    qp.qp_num = qpn;
    qp.state = IBV_QPS_RESET;
    qp.qp_type = ia.qp_type;
    // SAFETY: plain C data (the QP, fn pointers as Option, ints): zero is valid.
    let mut qpx: ibv_qp_ex = unsafe { std::mem::zeroed() };
    qpx.qp_base = qp;
    let v = Box::new(VQp {
        qp: qpx,
        sq: Mutex::new(WorkQueue::new(sq, bell, cap.max_send_wr)),
        rq: Mutex::new(WorkQueue::new(rq, bell, cap.max_recv_wr)),
        cap,
        sq_sig_all: ia.sq_sig_all != 0,
        state: std::sync::atomic::AtomicU32::new(IBV_QPS_RESET),
        extended: false,
        batch: Default::default(),
    });
    let p = Box::into_raw(v);
    if let Ok(mut m) = c.qps.lock() {
        m.insert(h, p as usize);
    }
    Ok(p.cast())
}

pub(crate) fn ah_from_c(a: &ibv_ah_attr) -> AhAttr {
    AhAttr {
        grh: GlobalRoute {
            // SAFETY: reading the raw bytes of a 16-byte union is always valid.
            dgid: unsafe { a.grh.dgid.raw },
            flow_label: a.grh.flow_label,
            sgid_index: a.grh.sgid_index,
            hop_limit: a.grh.hop_limit,
            traffic_class: a.grh.traffic_class,
        },
        dlid: a.dlid,
        sl: a.sl,
        src_path_bits: a.src_path_bits,
        static_rate: a.static_rate,
        is_global: a.is_global != 0,
        port_num: a.port_num,
    }
}

pub(crate) fn ah_to_c(a: &AhAttr) -> ibv_ah_attr {
    // SAFETY: plain C data; zero is valid.
    let mut c: ibv_ah_attr = unsafe { std::mem::zeroed() };
    c.grh.dgid.raw = a.grh.dgid;
    c.grh.flow_label = a.grh.flow_label;
    c.grh.sgid_index = a.grh.sgid_index;
    c.grh.hop_limit = a.grh.hop_limit;
    c.grh.traffic_class = a.grh.traffic_class;
    c.dlid = a.dlid;
    c.sl = a.sl;
    c.src_path_bits = a.src_path_bits;
    c.static_rate = a.static_rate;
    c.is_global = u8::from(a.is_global);
    c.port_num = a.port_num;
    c
}

pub(crate) fn sges(list: *const ibv_sge, n: c_int) -> SgeList {
    (0..n.max(0) as usize)
        .map(|i| {
            // SAFETY: the app's list holds num_sge entries (checked against the limit first).
            let p = unsafe { list.add(i) };
            // SAFETY: p is one of the app's num_sge entries.
            let s = unsafe { p.read() };
            Sge {
                addr: s.addr,
                length: s.length,
                lkey: s.lkey,
            }
        })
        .collect()
}

/// Reports the first work request that was not posted through the app's `bad_wr` pointer.
pub(crate) fn fail_at<T>(bad: *mut *mut T, w: *mut T, e: c_int) -> c_int {
    if !bad.is_null() {
        // SAFETY: bad is the app's out-pointer (NULL checked).
        unsafe { bad.write(w) };
    }
    e
}

/// Writes the app's receive list into a receive ring (a QP's or an SRQ's), publishes it and
/// rings the doorbell once. Stops at the first WR with more SGEs than `max_sge` (`EINVAL`) or
/// with no room (`ENOMEM`), reporting it through `bad`, as `ibv_post_recv` does.
pub(crate) fn post_recv_list(
    rq: &Mutex<WorkQueue>,
    conn: &Conn,
    wr: *mut ibv_recv_wr,
    bad: *mut *mut ibv_recv_wr,
    max_sge: u32,
) -> c_int {
    let Ok(mut rq) = rq.lock() else {
        return fail_at(bad, wr, libc::EIO);
    };
    let max_sge = max_sge.max(1).min(MAX_SGE as u32);
    let mut cur = wr;
    let mut posted = false;
    let mut rc = 0;
    while !cur.is_null() {
        // SAFETY: cur is a node of the app's list.
        let w = unsafe { &*cur };
        if w.num_sge < 0 || w.num_sge as u32 > max_sge {
            rc = libc::EINVAL;
            break;
        }
        if !rq.has_room(&conn.region, 1) {
            rc = libc::ENOMEM;
            break;
        }
        rq.push_recv(
            &conn.region,
            &RecvWqe {
                wr_id: w.wr_id,
                sges: sges(w.sg_list, w.num_sge),
            },
        );
        posted = true;
        cur = w.next;
    }
    if posted {
        rq.publish(&conn.region);
        drop(rq);
        conn.doorbell();
    }
    if rc != 0 { fail_at(bad, cur, rc) } else { 0 }
}

/// The async events that name a QP, an SRQ, a CQ: withdrawn when the object is destroyed.
pub(crate) const QP_EVENTS: &[u32] = &[
    vrnic_api::event::QP_FATAL,
    vrnic_api::event::QP_LAST_WQE_REACHED,
];
pub(crate) const SRQ_EVENTS: &[u32] = &[
    vrnic_api::event::SRQ_LIMIT_REACHED,
    vrnic_api::event::SRQ_ERR,
];
pub(crate) const CQ_EVENTS: &[u32] = &[vrnic_api::event::CQ_ERR];

/// The `ibv_wr_*` state of a QP: the batch being built and who builds it.
#[derive(Debug, Default)]
pub struct WrState {
    pub(crate) batch: Mutex<Batch>,
    /// Signalled when a `wr_start` section ends.
    pub(crate) ended: Condvar,
}

/// The work requests of one `wr_start` batch.
#[derive(Debug, Default)]
pub(crate) struct Batch {
    pub(crate) wqes: Vec<SendWqe>,
    /// The first error a builder met (`wr_complete` returns it).
    pub(crate) err: c_int,
    /// The thread between `wr_start` and `wr_complete`/`wr_abort`.
    pub(crate) owner: Option<ThreadId>,
}

impl Batch {
    /// Ends the section: drops what was built and lets a waiting `wr_start` in.
    pub(crate) fn end(&mut self, ended: &Condvar) {
        self.wqes.clear();
        self.err = 0;
        self.owner = None;
        ended.notify_one();
    }
}

/// The WQE fields of a bind of `mw` under the new key `rkey` to `info`: `(remote_addr,
/// rkey, imm_data = access, compare_add = length, swap = window handle << 32 | MR lkey)`
/// (see `vrnic_wire::SendOpcode::BindMw`). `EINVAL` for no window or binding, a range
/// without an MR, or a zero-based window (rxe's provider refuses those at the call).
pub(crate) fn bind_fields(
    mw: *const ibv_mw,
    rkey: u32,
    info: *const ibv_mw_bind_info,
) -> Result<(u64, u32, u32, u64, u64), c_int> {
    if mw.is_null() || info.is_null() {
        return Err(libc::EINVAL);
    }
    // SAFETY: a non-NULL window in a work request is one of ours, live (verbs contract).
    let handle = unsafe { (*mw).handle };
    // SAFETY: info points to the app's binding, readable for this call.
    let b = unsafe { info.read() };
    if b.mw_access_flags & access::ZERO_BASED != 0 {
        return Err(libc::EINVAL);
    }
    let lkey = if b.mr.is_null() {
        if b.addr != 0 || b.length != 0 {
            return Err(libc::EINVAL);
        }
        0
    } else {
        // SAFETY: a non-NULL MR in a binding is one of ours, live.
        unsafe { (*b.mr).lkey }
    };
    Ok((
        b.addr,
        rkey,
        b.mw_access_flags,
        b.length,
        u64::from(handle) << 32 | u64::from(lkey),
    ))
}

/// An XRC domain handle: `ibv_xrcd` first (container_of), then the daemon's handle.
#[repr(C)]
pub(crate) struct VXrcd {
    pub(crate) xrcd: ibv_xrcd,
    pub(crate) handle: u32,
}

/// The daemon's handle of one of our XRC domains (`ibv_srq_init_attr_ex.xrcd`).
///
/// # Safety
///
/// `x` must be an `ibv_xrcd` this library handed out and that is still open.
pub(crate) unsafe fn xrcd_handle(x: *mut ibv_xrcd) -> u32 {
    // SAFETY: the caller's contract: x is the start of a live VXrcd.
    unsafe { (*x.cast::<VXrcd>()).handle }
}
