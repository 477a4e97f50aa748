//! Every `extern "C"` function of the driver library: the exported libibverbs symbols and the
//! functions placed in the ops tables (`ibv_context_ops`, `verbs_context`).
//!
//! Each function has the same shape: inside [`guard`] (which catches panics, so none crosses
//! into C), null checks, pointer to the Rust object behind the C struct (each object starts
//! with its rdma-core struct: container_of), a call into `client`, and the mapping of the
//! outcome to rdma-core's return convention (an errno, or NULL/-1 with `errno` set).
#![allow(unsafe_code)]
#![allow(clippy::missing_safety_doc)]
#![allow(clippy::not_unsafe_ptr_arg_deref)]

use std::collections::HashMap;
use std::ffi::{c_char, c_int, c_uint, c_void};
use std::mem::offset_of;
use std::panic::AssertUnwindSafe;
use std::ptr::null_mut;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};

use vrnic_api::{PageRun, Reply, Request};
use vrnic_shm::Ring;
use vrnic_shm::layout::PAGE;
use vrnic_wire::{
    AhAttr, CQ_SLOT, GlobalRoute, InlineData, MAX_INLINE, MAX_SGE, QpAttr, QpCap, QpState, QpType,
    RQ_SLOT, RecvWqe, SQ_SLOT, SendFlags, SendOpcode, SendPayload, SendWqe, Sge, SgeList, UdAddr,
};

use crate::abi::*;
use crate::client::{self, Channel, CompQueue, Conn, Device, WorkQueue, vlog};
use crate::limits;
use crate::maps;
use crate::parked::{self, Parked};
use crate::sys::{self, set_errno};

mod ah;
mod dm;
pub(crate) mod ex;
mod mw;
mod resize;
pub(crate) mod srq;
mod xrc;

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
    dev: ibv_device,
    verbs_device_pad: [u8; 128],
    info: Device,
}

/// A context: `verbs_context` first (the app gets a pointer to its last member, `context`).
#[repr(C)]
pub struct VContext {
    vctx: verbs_context,
    pub(crate) conn: Arc<Conn>,
    /// QP handle -> `*mut VQp`, for async events.
    qps: Mutex<HashMap<u32, usize>>,
    /// CQ handle -> `*mut VCq`, for async events.
    cqs: Mutex<HashMap<u32, usize>>,
    /// SRQ handle -> `*mut ibv_srq`, for async events.
    pub(crate) srqs: Mutex<HashMap<u32, usize>>,
    /// Live MRs (`*mut VMr`): closing the device deregisters them, so the app's buffers are
    /// back on private memory before the daemon reuses their region pages.
    mrs: Mutex<std::collections::HashSet<usize>>,
    /// Deregistered buffers still on their region pages, for cheap registration again
    /// (`parked`); evicted when the device closes.
    parked: Mutex<Parked>,
}

#[repr(C)]
struct VPd {
    pd: ibv_pd,
}

#[repr(C)]
struct VMr {
    mr: ibv_mr,
    /// `IBV_ACCESS_*` it was registered with (for `ibv_rereg_mr`).
    access: c_uint,
}

#[repr(C)]
struct VChannel {
    ch: ibv_comp_channel,
    chan: Arc<Channel>,
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
    delivered: std::sync::atomic::AtomicU32,
    /// The completion `start_poll`/`next_poll` loaded (still in the ring until `next_poll` or
    /// `end_poll` retires it), for the `read_*` calls.
    pub(crate) cur: Mutex<Option<vrnic_wire::Cqe>>,
}

/// A QP: `ibv_qp_ex` first (its first member is the `ibv_qp`).
#[repr(C)]
pub(crate) struct VQp {
    pub(crate) qp: ibv_qp_ex,
    pub(crate) sq: Mutex<WorkQueue>,
    rq: Mutex<WorkQueue>,
    pub(crate) cap: QpCap,
    pub(crate) sq_sig_all: bool,
    pub(crate) state: std::sync::atomic::AtomicU32,
    /// Made by `create_qp_ex` with `SEND_OPS_FLAGS`: `ibv_qp_to_qp_ex` hands out `qp` with its
    /// `ibv_wr_*` table.
    pub(crate) extended: bool,
    /// The `ibv_wr_start` batch being built, its first error and the thread building it.
    pub(crate) batch: crate::ffi::ex::WrState,
}

fn vctx_of(ctx: *mut ibv_context) -> *mut VContext {
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

fn copy_name(dst: &mut [c_char], name: &str) {
    let n = name.len().min(dst.len() - 1);
    for (d, s) in dst.iter_mut().zip(name.bytes().take(n)) {
        *d = s as c_char;
    }
    dst[n] = 0;
}

// ---- devices ---------------------------------------------------------------------------------

static DEVICES: Mutex<Vec<usize>> = Mutex::new(Vec::new());

fn device_for(d: Device) -> *mut ibv_device {
    let mut list = DEVICES.lock().unwrap_or_else(|e| e.into_inner());
    for &p in list.iter() {
        // SAFETY: entries are VDevices we leaked; they are never freed.
        let v = unsafe { &*(p as *const VDevice) };
        if v.info.dir == d.dir {
            return p as *mut ibv_device;
        }
    }
    // SAFETY: ibv_device is plain C data (pointers, ints, arrays): all-zero is a valid value.
    let mut dev: ibv_device = unsafe { std::mem::zeroed() };
    dev.node_type = IBV_NODE_CA;
    dev.transport_type = IBV_TRANSPORT_IB;
    copy_name(&mut dev.name, &d.name);
    copy_name(&mut dev.dev_name, &format!("uverbs-{}", d.name));
    copy_name(&mut dev.dev_path, &d.dir.display().to_string());
    copy_name(&mut dev.ibdev_path, &d.dir.display().to_string());
    let p = Box::into_raw(Box::new(VDevice {
        dev,
        verbs_device_pad: [0; 128],
        info: d,
    }));
    list.push(p as usize);
    p.cast()
}

#[unsafe(no_mangle)]
pub extern "C" fn vrnic_ibv_get_device_list(num: *mut c_int) -> *mut *mut ibv_device {
    guard(null_mut(), || {
        let devs: Vec<*mut ibv_device> = client::discover().into_iter().map(device_for).collect();
        if !num.is_null() {
            // SAFETY: the caller passes a valid int pointer or NULL.
            unsafe { *num = devs.len() as c_int };
        }
        let mut arr = devs;
        arr.push(null_mut());
        Box::into_raw(arr.into_boxed_slice()).cast()
    })
}

#[unsafe(no_mangle)]
pub extern "C" fn vrnic_ibv_free_device_list(list: *mut *mut ibv_device) {
    guard((), || {
        if list.is_null() {
            return;
        }
        let mut n = 0;
        loop {
            // SAFETY: list is an array we returned, NULL-terminated, so every index up to the
            // terminator is in bounds.
            let slot = unsafe { list.add(n) };
            // SAFETY: slot is in bounds of the array.
            if unsafe { slot.read() }.is_null() {
                break;
            }
            n += 1;
        }
        // SAFETY: it was a boxed slice of n + 1 pointers.
        drop(unsafe { Box::from_raw(std::ptr::slice_from_raw_parts_mut(list, n + 1)) });
    })
}

#[unsafe(no_mangle)]
pub extern "C" fn vrnic_ibv_get_device_name(dev: *mut ibv_device) -> *const c_char {
    if dev.is_null() {
        return std::ptr::null();
    }
    // SAFETY: dev is one of our devices; name is NUL-terminated.
    unsafe { (*dev).name.as_ptr() }
}

#[unsafe(no_mangle)]
pub extern "C" fn vrnic_ibv_get_device_guid(dev: *mut ibv_device) -> u64 {
    if dev.is_null() {
        return 0;
    }
    // SAFETY: dev is one of our devices (VDevice starts with ibv_device).
    unsafe { (*dev.cast::<VDevice>()).info.guid }
}

#[unsafe(no_mangle)]
pub extern "C" fn vrnic_ibv_get_device_index(dev: *mut ibv_device) -> c_int {
    if dev.is_null() {
        return -1;
    }
    0
}

// ---- contexts --------------------------------------------------------------------------------

#[unsafe(no_mangle)]
pub extern "C" fn vrnic_ibv_open_device(dev: *mut ibv_device) -> *mut ibv_context {
    guard(null_err(libc::EIO), || {
        if dev.is_null() {
            return null_err(libc::EINVAL);
        }
        // SAFETY: dev came from our device list (VDevice starts with ibv_device).
        let info = unsafe { &(*dev.cast::<VDevice>()).info };
        let conn = match Conn::open(info) {
            Ok(c) => c,
            Err(e) => return null_err(e),
        };
        // SAFETY: verbs_context is plain C data (fn pointers as Option, ints): zero is valid.
        let mut vctx: verbs_context = unsafe { std::mem::zeroed() };
        vctx.sz = std::mem::size_of::<verbs_context>();
        vctx.query_port = Some(vrnic_query_port);
        vctx.query_device_ex = Some(vrnic_query_device_ex);
        vctx.create_srq_ex = Some(crate::ffi::srq::vrnic_create_srq_ex);
        vctx.create_qp_ex = Some(crate::ffi::ex::vrnic_create_qp_ex);
        vctx.open_xrcd = Some(crate::ffi::xrc::vrnic_open_xrcd);
        vctx.close_xrcd = Some(crate::ffi::xrc::vrnic_close_xrcd);
        vctx.get_srq_num = Some(crate::ffi::srq::vrnic_get_srq_num);
        vctx.create_cq_ex = Some(crate::ffi::ex::vrnic_create_cq_ex);
        vctx.alloc_dm = Some(crate::ffi::dm::vrnic_alloc_dm);
        vctx.free_dm = Some(crate::ffi::dm::vrnic_free_dm);
        vctx.reg_dm_mr = Some(crate::ffi::dm::vrnic_reg_dm_mr);
        vctx.query_rt_values = Some(crate::ffi::ex::vrnic_query_rt_values);
        vctx.context.device = dev;
        vctx.context.cmd_fd = conn.fd();
        vctx.context.async_fd = conn.async_q.efd.fd();
        vctx.context.num_comp_vectors = limits::COMP_VECTORS;
        vctx.context.abi_compat = usize::MAX as *mut c_void;
        let ops = &mut vctx.context.ops;
        ops.poll_cq = Some(vrnic_poll_cq);
        ops.req_notify_cq = Some(vrnic_req_notify_cq);
        ops.post_send = Some(vrnic_post_send);
        ops.post_recv = Some(vrnic_post_recv);
        ops.post_srq_recv = Some(crate::ffi::srq::vrnic_post_srq_recv);
        ops.alloc_mw = Some(crate::ffi::mw::vrnic_alloc_mw);
        ops.dealloc_mw = Some(crate::ffi::mw::vrnic_dealloc_mw);
        ops.bind_mw = Some(crate::ffi::mw::vrnic_bind_mw);
        let b = Box::new(VContext {
            vctx,
            conn,
            qps: Mutex::new(HashMap::new()),
            cqs: Mutex::new(HashMap::new()),
            srqs: Mutex::new(HashMap::new()),
            mrs: Mutex::new(Default::default()),
            parked: Mutex::new(Parked::default()),
        });
        let p = Box::into_raw(b);
        // SAFETY: p is a live VContext we just leaked; `context` is its embedded ibv_context.
        unsafe { &raw mut (*p).vctx.context }
    })
}

#[unsafe(no_mangle)]
pub extern "C" fn vrnic_ibv_close_device(ctx: *mut ibv_context) -> c_int {
    guard(-1, || {
        if ctx.is_null() {
            return minus_one(libc::EINVAL);
        }
        // Registered buffers go back to private memory (with their bytes) first; unless this
        // is a forked child's copy of its parent's context, whose registrations stay the
        // parent's (the child only lets go of its copy, as closing an inherited fd does).
        // SAFETY: ctx is a live context of ours.
        let c = unsafe { context(ctx) };
        let live: Vec<usize> = if c.conn.inherited() {
            Vec::new()
        } else {
            c.mrs
                .lock()
                .map(|m| m.iter().copied().collect())
                .unwrap_or_default()
        };
        for mr in live {
            vrnic_ibv_dereg_mr(mr as *mut ibv_mr);
        }
        if !c.conn.inherited() {
            let parked = c
                .parked
                .lock()
                .map(|mut p| p.take_all())
                .unwrap_or_default();
            evict(&c.conn, &parked);
        }
        // SAFETY: ctx is a live context of ours; after this call the app may not use it.
        let b = unsafe { Box::from_raw(vctx_of(ctx)) };
        b.conn.close();
        drop(b);
        0
    })
}

/// `max_qp_wr` of a context (for the connection manager's view of its device).
///
/// # Safety
/// `ctx` is a live context of ours.
pub(crate) unsafe fn max_qp_wr(ctx: *mut ibv_context) -> c_int {
    // SAFETY: the caller vouches that ctx is a live context of ours.
    let c = unsafe { context(ctx) };
    c_int::try_from(c.conn.info.max_qp_wr).unwrap_or(c_int::MAX)
}

fn device_attr(conn: &Conn) -> ibv_device_attr {
    let i = &conn.info;
    // SAFETY: plain C data; zero is valid.
    let mut a: ibv_device_attr = unsafe { std::mem::zeroed() };
    // Numeric, as devices report it ("16.35.2000"): tools and stacks parse it.
    copy_name(&mut a.fw_ver, env!("CARGO_PKG_VERSION"));
    a.node_guid = i.guid;
    a.sys_image_guid = i.guid;
    a.max_mr_size = i.max_mr_size;
    a.page_size_cap = PAGE;
    a.vendor_id = 0x5652; // "VR"
    a.vendor_part_id = 1;
    a.hw_ver = 1;
    a.max_qp = i.max_qp as c_int;
    a.max_qp_wr = i.max_qp_wr as c_int;
    a.device_cap_flags = limits::DEVICE_CAP_FLAGS;
    // `ibv_modify_srq` with `IBV_SRQ_MAX_WR` (srq.rs); memory windows (mw.rs); XRC (xrc.rs).
    a.device_cap_flags |= IBV_DEVICE_SRQ_RESIZE | IBV_DEVICE_XRC;
    // Not on a vRNIC whose QPs spread over the daemon's engine threads.
    if !i.no_mw {
        a.device_cap_flags |= crate::ffi::mw::CAP_FLAGS;
        a.max_mw = crate::ffi::mw::MAX_MW;
    }
    a.max_sge = MAX_SGE as c_int;
    a.max_sge_rd = MAX_SGE as c_int;
    a.max_cq = i.max_cq as c_int;
    a.max_cqe = i.max_cqe as c_int;
    a.max_mr = i.max_mr as c_int;
    a.max_pd = i.max_pd as c_int;
    a.max_qp_rd_atom = c_int::from(limits::MAX_RD_ATOM);
    a.max_ee_rd_atom = 0;
    a.max_res_rd_atom = (i.max_qp as c_int).saturating_mul(c_int::from(limits::MAX_RD_ATOM));
    a.max_qp_init_rd_atom = c_int::from(limits::MAX_RD_ATOM);
    a.atomic_cap = IBV_ATOMIC_HCA;
    a.max_srq = if i.max_srq > 0 { i.max_srq } else { i.max_qp } as c_int;
    a.max_srq_wr = i.max_qp_wr as c_int;
    a.max_srq_sge = MAX_SGE as c_int;
    a.max_ah = 65536;
    a.max_pkeys = limits::PKEYS;
    a.local_ca_ack_delay = 15;
    a.phys_port_cnt = limits::PORTS;
    a
}

#[unsafe(no_mangle)]
pub extern "C" fn vrnic_ibv_query_device(
    ctx: *mut ibv_context,
    attr: *mut ibv_device_attr,
) -> c_int {
    guard(libc::EIO, || {
        if ctx.is_null() || attr.is_null() {
            return libc::EINVAL;
        }
        // SAFETY: ctx is ours.
        let a = device_attr(&unsafe { context(ctx) }.conn);
        // SAFETY: attr points to a caller-owned ibv_device_attr.
        unsafe { attr.write(a) };
        0
    })
}

pub extern "C" fn vrnic_query_device_ex(
    ctx: *mut ibv_context,
    _input: *const ibv_query_device_ex_input,
    attr: *mut ibv_device_attr_ex,
    attr_size: usize,
) -> c_int {
    guard(libc::EIO, || {
        if ctx.is_null() || attr.is_null() || attr_size < std::mem::size_of::<ibv_device_attr>() {
            return libc::EINVAL;
        }
        // SAFETY: ctx is ours.
        let conn = &unsafe { context(ctx) }.conn;
        // SAFETY: plain C data; zero is valid.
        let mut ex: ibv_device_attr_ex = unsafe { std::mem::zeroed() };
        ex.orig_attr = device_attr(conn);
        // The extended flags repeat the base ones in their low 32 bits, as providers report,
        // and say ATOMIC WRITE is executed (the bit rxe and mlx5 set for it).
        ex.device_cap_flags_ex =
            u64::from(ex.orig_attr.device_cap_flags) | IB_UVERBS_DEVICE_ATOMIC_WRITE;
        ex.max_dm_size = crate::ffi::dm::MAX_DM_SIZE;
        ex.phys_port_cnt_ex = 1;
        // Completion timestamps: CLOCK_MONOTONIC nanoseconds (a 1 GHz clock), 64 bits.
        ex.completion_timestamp_mask = u64::MAX;
        ex.hca_core_clock = 1_000_000;
        let n = attr_size.min(std::mem::size_of::<ibv_device_attr_ex>());
        // SAFETY: the caller's buffer holds attr_size bytes; we write at most that many.
        unsafe {
            std::ptr::copy_nonoverlapping((&raw const ex).cast::<u8>(), attr.cast::<u8>(), n)
        };
        0
    })
}

fn port_attr(conn: &Conn) -> ibv_port_attr {
    // SAFETY: plain C data; zero is valid.
    let mut p: ibv_port_attr = unsafe { std::mem::zeroed() };
    p.state = IBV_PORT_ACTIVE;
    p.max_mtu = IBV_MTU_4096;
    p.active_mtu = IBV_MTU_4096;
    p.gid_tbl_len = c_int::from(limits::GIDS);
    p.port_cap_flags = limits::PORT_CAP_FLAGS;
    p.subnet_timeout = limits::SUBNET_TIMEOUT;
    p.max_msg_sz = vrnic_wire::MAX_MSG_SIZE;
    p.pkey_tbl_len = limits::PKEYS;
    p.lid = conn.info.lid;
    p.sm_lid = conn.info.lid;
    p.max_vl_num = 1;
    p.active_width = 2; // 4X
    p.active_speed = 32; // EDR
    p.phys_state = 5; // LinkUp
    p.link_layer = IBV_LINK_LAYER_INFINIBAND;
    p
}

pub extern "C" fn vrnic_query_port(
    ctx: *mut ibv_context,
    port: u8,
    attr: *mut ibv_port_attr,
    len: usize,
) -> c_int {
    guard(libc::EIO, || {
        if ctx.is_null() || attr.is_null() {
            return libc::EINVAL;
        }
        if port != 1 {
            return libc::EINVAL;
        }
        // SAFETY: ctx is ours.
        let p = port_attr(&unsafe { context(ctx) }.conn);
        let n = len.min(std::mem::size_of::<ibv_port_attr>());
        // SAFETY: the caller's buffer holds `len` bytes; we write at most that many.
        unsafe { std::ptr::copy_nonoverlapping((&raw const p).cast::<u8>(), attr.cast::<u8>(), n) };
        0
    })
}

/// The exported `ibv_query_port` writes the 48-byte compat layout (rdma-core's
/// `struct _compat_ibv_port_attr`).
#[unsafe(no_mangle)]
pub extern "C" fn vrnic_ibv_query_port(
    ctx: *mut ibv_context,
    port: u8,
    attr: *mut ibv_port_attr,
) -> c_int {
    vrnic_query_port(ctx, port, attr, 48)
}

#[unsafe(no_mangle)]
pub extern "C" fn vrnic_ibv_query_gid(
    ctx: *mut ibv_context,
    port: u8,
    index: c_int,
    gid: *mut ibv_gid,
) -> c_int {
    guard(-1, || {
        if ctx.is_null() || gid.is_null() || port != 1 || index != 0 {
            return minus_one(libc::EINVAL);
        }
        // SAFETY: ctx is ours.
        let raw = unsafe { context(ctx) }.conn.info.gid;
        // SAFETY: gid is a caller-owned 16-byte union; any 16 bytes are a valid value.
        unsafe { gid.write(ibv_gid { raw }) };
        0
    })
}

#[unsafe(no_mangle)]
pub extern "C" fn vrnic_ibv_query_pkey(
    ctx: *mut ibv_context,
    port: u8,
    index: c_int,
    pkey: *mut u16,
) -> c_int {
    guard(-1, || {
        if ctx.is_null() || pkey.is_null() || port != 1 || index != 0 {
            return minus_one(libc::EINVAL);
        }
        // SAFETY: pkey is a caller-owned u16.
        unsafe { *pkey = 0xffffu16.to_be() };
        0
    })
}

#[unsafe(no_mangle)]
pub extern "C" fn vrnic_ibv_get_pkey_index(ctx: *mut ibv_context, port: u8, pkey: u16) -> c_int {
    if ctx.is_null() || port != 1 {
        return minus_one(libc::EINVAL);
    }
    if pkey == 0xffffu16.to_be() {
        0
    } else {
        minus_one(libc::ENOENT)
    }
}

/// `ibv_query_gid_type` (private ABI, used by `ibv_devinfo`): GID 0 is an InfiniBand GID.
#[unsafe(no_mangle)]
pub extern "C" fn vrnic_ibv_query_gid_type(
    ctx: *mut ibv_context,
    port: u8,
    index: c_uint,
    ty: *mut c_uint,
) -> c_int {
    if ctx.is_null() || ty.is_null() || port != 1 || index != 0 {
        return minus_one(libc::EINVAL);
    }
    // SAFETY: ty is a caller-owned enum slot.
    unsafe { *ty = 0 };
    0
}

/// The port's one GID table entry. The port is InfiniBand (`ibv_query_port` reports
/// `IBV_LINK_LAYER_INFINIBAND`), its GID the subnet prefix and the vRNIC's GUID, and the GRH
/// the engine writes into UD receive buffers is the IB GRH (IP version 6, next header 0x1b):
/// an `IBV_GID_TYPE_IB` entry with no net device, as the kernel reports for an IB port.
fn gid_entry(conn: &Conn) -> ibv_gid_entry {
    // SAFETY: plain C data; zero is valid.
    let mut e: ibv_gid_entry = unsafe { std::mem::zeroed() };
    e.gid.raw = conn.info.gid;
    e.gid_index = 0;
    e.port_num = 1;
    e.gid_type = IBV_GID_TYPE_IB;
    e.ndev_ifindex = 0;
    e
}

/// Writes `e` into an app's entry of `entry_size` bytes (at least ours; a larger one, from
/// newer headers, gets its tail zeroed, as the kernel's `copy_to_struct_or_zero`).
///
/// # Safety
/// `at` must be valid for writes of `entry_size` bytes.
unsafe fn put_gid_entry(at: *mut u8, entry_size: usize, e: &ibv_gid_entry) {
    let n = std::mem::size_of::<ibv_gid_entry>();
    // SAFETY: per the contract, `at` holds entry_size >= n bytes.
    unsafe { std::ptr::copy_nonoverlapping((&raw const *e).cast::<u8>(), at, n) };
    // SAFETY: n <= entry_size, so the result stays inside (or one past) the entry.
    let tail = unsafe { at.add(n) };
    // SAFETY: the bytes n..entry_size of the same entry, valid per the contract.
    unsafe { std::ptr::write_bytes(tail, 0, entry_size - n) };
}

/// `_ibv_query_gid_ex` (behind the `ibv_query_gid_ex` inline). As the kernel's
/// `UVERBS_METHOD_QUERY_GID_ENTRY`: flags other than 0, a port other than 1 or an index past
/// `gid_tbl_len`: `EINVAL` (`ENODATA` would be an empty entry inside the table; ours has
/// none).
#[unsafe(no_mangle)]
pub extern "C" fn vrnic__ibv_query_gid_ex(
    ctx: *mut ibv_context,
    port: u32,
    index: u32,
    entry: *mut ibv_gid_entry,
    flags: u32,
    entry_size: usize,
) -> c_int {
    guard(libc::EIO, || {
        if ctx.is_null()
            || entry.is_null()
            || flags != 0
            || port != u32::from(limits::PORTS)
            || index >= u32::from(limits::GIDS)
            || entry_size < std::mem::size_of::<ibv_gid_entry>()
        {
            return libc::EINVAL;
        }
        // SAFETY: ctx is ours.
        let e = gid_entry(&unsafe { context(ctx) }.conn);
        // SAFETY: entry holds entry_size bytes (checked to be at least one ibv_gid_entry).
        unsafe { put_gid_entry(entry.cast(), entry_size, &e) };
        0
    })
}

/// `_ibv_query_gid_table` (behind the `ibv_query_gid_table` inline): the valid entries of
/// every port, `entry_size` bytes apart; the count, or `-EINVAL` for flags other than 0, no
/// room (`max` 0) or an entry smaller than ours, as the kernel's `rdma_query_gid_table`.
#[unsafe(no_mangle)]
pub extern "C" fn vrnic__ibv_query_gid_table(
    ctx: *mut ibv_context,
    entries: *mut ibv_gid_entry,
    max: usize,
    flags: u32,
    entry_size: usize,
) -> isize {
    guard(-(libc::EIO as isize), || {
        if ctx.is_null()
            || entries.is_null()
            || flags != 0
            || entry_size < std::mem::size_of::<ibv_gid_entry>()
            || max < usize::from(limits::GIDS)
        {
            return -(libc::EINVAL as isize);
        }
        // SAFETY: ctx is ours.
        let e = gid_entry(&unsafe { context(ctx) }.conn);
        // SAFETY: entries has room for `max` >= 1 entries of entry_size bytes.
        unsafe { put_gid_entry(entries.cast(), entry_size, &e) };
        isize::from(limits::GIDS)
    })
}

// ---- protection domains and memory regions ---------------------------------------------------

#[unsafe(no_mangle)]
pub extern "C" fn vrnic_ibv_alloc_pd(ctx: *mut ibv_context) -> *mut ibv_pd {
    guard(null_err(libc::EIO), || {
        if ctx.is_null() {
            return null_err(libc::EINVAL);
        }
        // SAFETY: ctx is ours.
        let c = unsafe { context(ctx) };
        match c.conn.call(&Request::AllocPd) {
            Ok(Reply::Handle(h)) => {
                let pd = ibv_pd {
                    context: ctx,
                    handle: h,
                };
                Box::into_raw(Box::new(VPd { pd })).cast()
            }
            Ok(_) => null_err(libc::EPROTO),
            Err(e) => null_err(e),
        }
    })
}

#[unsafe(no_mangle)]
pub extern "C" fn vrnic_ibv_dealloc_pd(pd: *mut ibv_pd) -> c_int {
    guard(libc::EIO, || {
        if pd.is_null() {
            return libc::EINVAL;
        }
        // SAFETY: pd is ours and live.
        let pdr = unsafe { &*pd };
        let (ctx, h) = (pdr.context, pdr.handle);
        // SAFETY: the PD's context outlives it.
        match unsafe { context(ctx) }
            .conn
            .call(&Request::DeallocPd { pd: h })
        {
            Ok(_) => {
                // SAFETY: pd was boxed by alloc_pd; the app gives it up now.
                drop(unsafe { Box::from_raw(pd.cast::<VPd>()) });
                0
            }
            Err(e) => e,
        }
    })
}

/// Runs of fresh pages at least this long are prepared (allocated at once) before
/// the app's bytes are copied in; shorter ones are left to faults (one system call would save
/// a few).
const PREPARE_MIN: u64 = 64 << 10;

fn reg_mr(
    pd: *mut ibv_pd,
    addr: *mut c_void,
    len: usize,
    iova: u64,
    access: c_uint,
) -> *mut ibv_mr {
    guard(null_err(libc::EIO), || {
        if pd.is_null() || (addr.is_null() && len > 0) {
            return null_err(libc::EINVAL);
        }
        if access & !vrnic_wire::access::SUPPORTED != 0 {
            return null_err(libc::EOPNOTSUPP);
        }
        // Remote write or atomic access requires local write, as on every device.
        let needs_local = vrnic_wire::access::REMOTE_WRITE | vrnic_wire::access::REMOTE_ATOMIC;
        if access & needs_local != 0 && access & vrnic_wire::access::LOCAL_WRITE == 0 {
            return null_err(libc::EINVAL);
        }
        if len == 0 {
            return null_err(libc::EINVAL);
        }
        if !sys::range_mapped(addr as usize, len) {
            return null_err(libc::EFAULT);
        }
        // SAFETY: pd is ours and live.
        let pdr = unsafe { &*pd };
        let (ctx, pdh) = (pdr.context, pdr.handle);
        // SAFETY: the PD's context outlives it.
        let vctx = unsafe { context(ctx) };
        let conn = &vctx.conn;
        // Held to the end: a registration and a deregistration of the same pages in two
        // threads must not both act on them.
        let Ok(mut parked) = vctx.parked.lock() else {
            return null_err(libc::EIO);
        };
        let first = addr as u64 / PAGE * PAGE;
        let end = (addr as u64 + len as u64).next_multiple_of(PAGE);
        let reuse = unpark(conn, &mut parked, first, end);
        let req = |reuse: Vec<PageRun>| Request::RegMr {
            pd: pdh,
            addr: addr as u64,
            len: len as u64,
            iova,
            access,
            reuse,
        };
        let mut reply = conn.call(&req(reuse.clone()));
        if !matches!(reply, Ok(Reply::Mr { .. })) {
            // The daemon took none of them back: still ours, still detached.
            for r in reuse {
                parked.park(r);
            }
            if reply == Err(libc::ENOMEM) && parked.bytes() > 0 {
                // Parked pages may be what the vRNIC lacks: give them all back, then retry.
                evict(conn, &parked.take_all());
                reply = conn.call(&req(Vec::new()));
            }
        }
        let (mr, lkey, rkey, runs) = match reply {
            Ok(Reply::Mr {
                mr,
                lkey,
                rkey,
                runs,
            }) => (mr, lkey, rkey, runs),
            Ok(_) => return null_err(libc::EPROTO),
            Err(e) => return null_err(e),
        };
        for r in runs.iter().filter(|r| r.fresh) {
            let bytes = u64::from(r.pages) * PAGE;
            // The run's first and last pages may hold other data that other threads write: they
            // are read first, so that a page never touched has an entry (the zero page) and is
            // protected with the rest.
            for p in [r.va, r.va + bytes - PAGE] {
                // SAFETY: inside the app's buffer, which mincore proved mapped (page rounded).
                unsafe { std::ptr::read_volatile(p as *const u8) };
            }
            let mut untouched = sys::Untouched::open(r.va as usize, bytes as usize);
            let moved = {
                // The driver's own threads keep out of the pages while they move, and (where the
                // kernel allows it) every other thread's writes to them wait (`Freeze`): a
                // buffer's first and last pages hold other data too, which the app's threads
                // may be writing, and a write between the copy and the remap would be lost.
                let _ours = client::moving();
                // SAFETY: until the guard drops this thread only reads the range and writes
                // the region and the kernel, and allocates nothing (`move_run`).
                let _still =
                    unsafe { vrnic_shm::freeze::Freeze::new(r.va as usize, bytes as usize) };
                // SAFETY: the run's pages are the app's buffer being registered, mapped (the
                // daemon gave these pages for this range, which mincore proved mapped).
                unsafe { move_run(conn, r, untouched.as_mut()) }
            };
            if let Err(e) = moved {
                vlog!("moving registered memory onto the region failed: {e}");
                let _ = conn.call(&Request::DeregMr { mr });
                return null_err(libc::EFAULT);
            }
        }
        let m = ibv_mr {
            context: ctx,
            pd,
            addr,
            length: len,
            handle: mr,
            lkey,
            rkey,
        };
        let p = Box::into_raw(Box::new(VMr { mr: m, access }));
        if let Ok(mut live) = vctx.mrs.lock() {
            live.insert(p as usize);
        }
        p.cast()
    })
}

/// Puts the bytes of the app's pages of run `r` into its region pages and maps those over the
/// app's, the pages the app never touched skipped (they read as zeros, as fresh region pages
/// do: the daemon punches pages it frees; copying them would only make the file system
/// allocate them now). Allocates nothing: it runs while the pages are frozen.
///
/// # Safety
/// `r.va..` for `r.pages` pages is the app's mapped buffer being registered, whose pages the
/// daemon gave this registration.
unsafe fn move_run(
    conn: &Conn,
    r: &PageRun,
    untouched: Option<&mut sys::Untouched>,
) -> Result<(), vrnic_shm::RegionError> {
    let bytes = u64::from(r.pages) * PAGE;
    let mut untouched = untouched;
    let mut skip = |p: u64| untouched.as_mut().is_some_and(|u| u.page(p as usize));
    let mut page = 0u64;
    while page < u64::from(r.pages) {
        if skip(page) {
            page += 1;
            continue;
        }
        let mut n = 1;
        while page + n < u64::from(r.pages) && !skip(page + n) {
            n += 1;
        }
        let (va, dst) = (r.va + page * PAGE, r.off + page * PAGE);
        // SAFETY: these pages lie inside the caller's mapped range; they are the app's private
        // memory, read here before the remap below.
        let cur = unsafe { std::slice::from_raw_parts(va as *const u8, (n * PAGE) as usize) };
        // A large run through the file: one copy into fresh pages, no zeroing first. Where the
        // file takes no writes (a guest's BAR), through the mapping, its pages allocated in one
        // call rather than a fault per page as the copy goes.
        let large = n * PAGE >= PREPARE_MIN;
        if !(large && conn.region.write_file(dst, cur).is_ok()) {
            if large {
                let _ = conn.region.prepare_write(dst, n * PAGE);
            }
            conn.region.write_bytes(dst, cur)?;
        }
        page += n;
    }
    // SAFETY: the pages are the app's registered buffer; their bytes were copied into the
    // region pages, so the app sees the same contents after the remap.
    unsafe { conn.region.map_over(r.va as usize, r.off, bytes) }
}

/// Takes the parked runs with pages in `first..end` out of `parked` and returns the pages of
/// them inside that range which the app still maps (for the daemon to reuse). Their pages
/// outside the range stay parked; pages the app no longer maps are freed.
fn unpark(conn: &Conn, parked: &mut Parked, first: u64, end: u64) -> Vec<PageRun> {
    let near = parked.take_overlapping(first, end);
    if near.is_empty() {
        return near;
    }
    let split = maps::split(&near, conn.region.file());
    if !split.gone.is_empty() {
        let _ = conn.call(&Request::ReleasePages { runs: split.gone });
    }
    let mut reuse = Vec::new();
    for r in split.mapped {
        let (inside, outside) = parked::clip(r, first, end);
        reuse.extend(inside);
        for o in outside {
            parked.park(o);
        }
    }
    reuse
}

/// Gives detached runs back for good: the pages the app still maps are copied back onto
/// private memory, and every page it no longer maps or got back is freed in the daemon.
fn evict(conn: &Conn, runs: &[PageRun]) {
    if runs.is_empty() {
        return;
    }
    let split = maps::split(runs, conn.region.file());
    if !split.unreadable.is_empty() {
        vlog!("deregistered memory the app made unreadable stays on its region pages");
    }
    let mut released = split.gone;
    for r in split.mapped {
        let bytes = u64::from(r.pages) * PAGE;
        let moved = {
            let _ours = client::moving();
            // SAFETY: /proc/self/maps just showed these addresses mapping the region pages
            // the daemon gave a registration of this context: the app's buffer that we
            // mapped over. (`remap_private` freezes them while they move.)
            unsafe { vrnic_shm::remap_private(r.va as usize, bytes as usize) }
        };
        match moved {
            Ok(()) => released.push(r),
            Err(e) => {
                vlog!("detaching deregistered memory failed: {e}; its pages stay reserved")
            }
        }
    }
    if !released.is_empty() {
        let _ = conn.call(&Request::ReleasePages { runs: released });
    }
}

#[unsafe(no_mangle)]
pub extern "C" fn vrnic_ibv_reg_mr(
    pd: *mut ibv_pd,
    addr: *mut c_void,
    len: usize,
    access: c_int,
) -> *mut ibv_mr {
    reg_mr(pd, addr, len, addr as u64, access as c_uint)
}

#[unsafe(no_mangle)]
pub extern "C" fn vrnic_ibv_reg_mr_iova(
    pd: *mut ibv_pd,
    addr: *mut c_void,
    len: usize,
    iova: u64,
    access: c_int,
) -> *mut ibv_mr {
    reg_mr(pd, addr, len, iova, access as c_uint)
}

#[unsafe(no_mangle)]
pub extern "C" fn vrnic_ibv_reg_mr_iova2(
    pd: *mut ibv_pd,
    addr: *mut c_void,
    len: usize,
    iova: u64,
    access: c_uint,
) -> *mut ibv_mr {
    reg_mr(pd, addr, len, iova, access)
}

#[unsafe(no_mangle)]
pub extern "C" fn vrnic_ibv_dereg_mr(mr: *mut ibv_mr) -> c_int {
    guard(libc::EIO, || {
        if mr.is_null() {
            return libc::EINVAL;
        }
        // SAFETY: mr is ours and live.
        let mrr = unsafe { &*mr };
        let (ctx, h) = (mrr.context, mrr.handle);
        // SAFETY: the MR's context outlives it.
        let vctx = unsafe { context(ctx) };
        let conn = &vctx.conn;
        // Held to the end, as in `reg_mr`.
        let Ok(mut parked) = vctx.parked.lock() else {
            return libc::EIO;
        };
        let runs: Vec<PageRun> = match conn.call(&Request::DeregMr { mr: h }) {
            Ok(Reply::Detach { runs }) => runs,
            Ok(_) => return libc::EPROTO,
            Err(e) => return e,
        };
        // The buffer stays on its region pages, parked for a registration again (`parked`),
        // where the app still maps them; pages it unmapped (or mapped anew) since the
        // registration are left as the app made them and freed at once. Past the cap, the
        // oldest parked buffers go back onto private memory with their bytes.
        let split = maps::split(&runs, conn.region.file());
        if !split.gone.is_empty() {
            let _ = conn.call(&Request::ReleasePages { runs: split.gone });
        }
        if !split.unreadable.is_empty() {
            vlog!("deregistered memory the app made unreadable stays on its region pages");
        }
        for r in split.mapped {
            parked.park(r);
        }
        evict(conn, &parked.take_oldest_over(parked::cap_bytes()));
        drop(parked);
        // SAFETY: the MR's context outlives it.
        if let Ok(mut live) = unsafe { context(ctx) }.mrs.lock() {
            live.remove(&(mr as usize));
        }
        crate::ffi::dm::mr_gone(mr as usize);
        // SAFETY: mr was boxed by reg_mr; the app gives it up now.
        drop(unsafe { Box::from_raw(mr.cast::<VMr>()) });
        0
    })
}

/// `ibv_rereg_mr` flags (verbs.h `enum ibv_rereg_mr_flags`).
const REREG_CHANGE_TRANSLATION: c_int = 1;
const REREG_CHANGE_PD: c_int = 1 << 1;
const REREG_CHANGE_ACCESS: c_int = 1 << 2;
const REREG_KEEP_VALID: c_int = 1 << 3;
/// `enum ibv_rereg_mr_err_code`.
const REREG_ERR_INPUT: c_int = -1;
const REREG_ERR_CMD: c_int = -4;

/// `ibv_rereg_mr`, with rdma-core's input checks and return codes. A new PD or new access
/// flags keep the keys; a new translation is a new registration of the new range (new keys,
/// written back into `mr`) followed by the deregistration of the old one. `KEEP_VALID` is not
/// supported (`EOPNOTSUPP`).
#[unsafe(no_mangle)]
pub extern "C" fn vrnic_ibv_rereg_mr(
    mr: *mut ibv_mr,
    flags: c_int,
    pd: *mut ibv_pd,
    addr: *mut c_void,
    len: usize,
    access: c_int,
) -> c_int {
    guard(REREG_ERR_CMD, || {
        let input = |e| {
            set_errno(e);
            REREG_ERR_INPUT
        };
        if mr.is_null() || flags & !0xf != 0 || flags == 0 {
            return input(libc::EINVAL);
        }
        if flags & REREG_CHANGE_TRANSLATION != 0 && (len == 0 || addr.is_null()) {
            return input(libc::EINVAL);
        }
        if access != 0 && flags & REREG_CHANGE_ACCESS == 0 {
            return input(libc::EINVAL);
        }
        if flags & REREG_CHANGE_PD != 0 && pd.is_null() {
            return input(libc::EINVAL);
        }
        if flags & REREG_KEEP_VALID != 0 {
            set_errno(libc::EOPNOTSUPP);
            return REREG_ERR_CMD;
        }
        // SAFETY: mr is ours and live.
        let v = unsafe { &mut *mr.cast::<VMr>() };
        let new_pd = if flags & REREG_CHANGE_PD != 0 {
            pd
        } else {
            v.mr.pd
        };
        let new_access = if flags & REREG_CHANGE_ACCESS != 0 {
            access as c_uint
        } else {
            v.access
        };
        if flags & REREG_CHANGE_TRANSLATION != 0 {
            let fresh = reg_mr(new_pd, addr, len, addr as u64, new_access);
            if fresh.is_null() {
                return REREG_ERR_CMD;
            }
            // The app keeps its pointer: it now describes the new registration, and the box
            // that reg_mr made holds the old one, which goes.
            // SAFETY: fresh is a live VMr that reg_mr just made; it is not `v`.
            std::mem::swap(v, unsafe { &mut *fresh.cast::<VMr>() });
            return match vrnic_ibv_dereg_mr(fresh) {
                0 => 0,
                e => {
                    // The old registration must stay (memory windows are bound to it): the
                    // app's MR describes it again, and the new one goes.
                    // SAFETY: as above; dereg_mr failed, so fresh is still live.
                    std::mem::swap(v, unsafe { &mut *fresh.cast::<VMr>() });
                    vrnic_ibv_dereg_mr(fresh);
                    set_errno(e);
                    REREG_ERR_CMD
                }
            };
        }
        // SAFETY: the MR's context outlives it.
        let conn = &unsafe { context(v.mr.context) }.conn;
        let req = Request::ReregMr {
            mr: v.mr.handle,
            // SAFETY: new_pd is the MR's PD or the app's new one, ours and live.
            pd: (flags & REREG_CHANGE_PD != 0).then(|| unsafe { (*new_pd).handle }),
            access: (flags & REREG_CHANGE_ACCESS != 0).then_some(new_access),
        };
        match conn.call(&req) {
            Ok(_) => {
                v.mr.pd = new_pd;
                v.access = new_access;
                0
            }
            Err(e) => {
                set_errno(e);
                REREG_ERR_CMD
            }
        }
    })
}

// ---- completion channels and CQs -------------------------------------------------------------

#[unsafe(no_mangle)]
pub extern "C" fn vrnic_ibv_create_comp_channel(ctx: *mut ibv_context) -> *mut ibv_comp_channel {
    guard(null_err(libc::EIO), || {
        if ctx.is_null() {
            return null_err(libc::EINVAL);
        }
        let efd = match sys::EventFd::new() {
            Ok(e) => e,
            Err(e) => return null_err(e.raw_os_error().unwrap_or(libc::EMFILE)),
        };
        let chan = Arc::new(Channel {
            efd,
            queue: Mutex::new(Default::default()),
        });
        let ch = ibv_comp_channel {
            context: ctx,
            fd: chan.efd.fd(),
            refcnt: 0,
        };
        Box::into_raw(Box::new(VChannel { ch, chan })).cast()
    })
}

#[unsafe(no_mangle)]
pub extern "C" fn vrnic_ibv_destroy_comp_channel(ch: *mut ibv_comp_channel) -> c_int {
    guard(libc::EIO, || {
        if ch.is_null() {
            return libc::EINVAL;
        }
        // SAFETY: ch is ours and live.
        if unsafe { (*ch).refcnt } > 0 {
            return libc::EBUSY;
        }
        // SAFETY: boxed by create_comp_channel; the app gives it up now.
        drop(unsafe { Box::from_raw(ch.cast::<VChannel>()) });
        0
    })
}

#[unsafe(no_mangle)]
pub extern "C" fn vrnic_ibv_create_cq(
    ctx: *mut ibv_context,
    cqe: c_int,
    cq_context: *mut c_void,
    channel: *mut ibv_comp_channel,
    comp_vector: c_int,
) -> *mut ibv_cq {
    guard(null_err(libc::EIO), || {
        if ctx.is_null() {
            return null_err(libc::EINVAL);
        }
        // SAFETY: ctx is ours.
        let c = unsafe { context(ctx) };
        if let Err(e) = limits::check_cq(&c.conn.info, cqe.into(), comp_vector.into()) {
            return null_err(e);
        }
        let (h, ring_off, depth) = match c.conn.call(&Request::CreateCq { cqe: cqe as u32 }) {
            Ok(Reply::Cq { cq, ring, depth }) => (cq, ring, depth),
            Ok(_) => return null_err(libc::EPROTO),
            Err(e) => return null_err(e),
        };
        let Ok(ring) = Ring::new(&c.conn.region, ring_off, depth, CQ_SLOT) else {
            let _ = c.conn.call(&Request::DestroyCq { cq: h });
            return null_err(libc::EPROTO);
        };
        // SAFETY: channel is NULL or one of ours.
        let chan =
            (!channel.is_null()).then(|| unsafe { (*channel.cast::<VChannel>()).chan.clone() });
        if !channel.is_null() {
            // SAFETY: channel is live; refcnt is only touched under the verbs calls.
            unsafe { (*channel).refcnt += 1 };
        }
        // SAFETY: plain C data plus pthread objects, whose all-zero value is their static
        // initializer in glibc.
        let mut cq: ibv_cq_ex = unsafe { std::mem::zeroed() };
        cq.context = ctx;
        cq.channel = channel;
        cq.cq_context = cq_context;
        cq.handle = h;
        cq.cqe = depth as c_int;
        let v = Box::new(VCq {
            cq,
            q: Mutex::new(CompQueue {
                ring,
                cons: 0,
                empty: 0,
            }),
            channel: chan.clone(),
            events: Arc::default(),
            delivered: std::sync::atomic::AtomicU32::new(0),
            cur: Mutex::new(None),
        });
        let events = v.events.clone();
        let p = Box::into_raw(v);
        if let Some(chan) = chan {
            c.conn.ensure_notifier();
            c.conn.watch(p as usize, ring, chan, events);
        }
        if let Ok(mut m) = c.cqs.lock() {
            m.insert(h, p as usize);
        }
        p.cast()
    })
}

#[unsafe(no_mangle)]
pub extern "C" fn vrnic_ibv_destroy_cq(cq: *mut ibv_cq) -> c_int {
    guard(libc::EIO, || {
        if cq.is_null() {
            return libc::EINVAL;
        }
        // SAFETY: cq is ours and live.
        let cqr = unsafe { &*cq };
        let (ctx, h, channel) = (cqr.context, cqr.handle, cqr.channel);
        // SAFETY: the CQ's context outlives it.
        let c = unsafe { context(ctx) };
        if let Err(e) = c.conn.call(&Request::DestroyCq { cq: h }) {
            return e;
        }
        c.conn.unwatch(cq as usize);
        if let Ok(mut m) = c.cqs.lock() {
            m.remove(&h);
        }
        c.conn.withdraw_events(CQ_EVENTS, h);
        if !channel.is_null() {
            // SAFETY: the channel outlives the CQs attached to it (destroy refuses otherwise).
            unsafe { (*channel).refcnt -= 1 };
            // SAFETY: as above.
            let chan = unsafe { &(*channel.cast::<VChannel>()).chan };
            let removed = chan.queue.lock().map_or(0, |mut q| {
                let before = q.len();
                q.retain(|&p| p != cq as usize);
                before - q.len()
            });
            // The fd no longer reports them either.
            chan.efd.take_nowait(removed);
        }
        // SAFETY: boxed by create_cq; the app gives it up now.
        drop(unsafe { Box::from_raw(cq.cast::<VCq>()) });
        0
    })
}

#[unsafe(no_mangle)]
pub extern "C" fn vrnic_ibv_get_cq_event(
    ch: *mut ibv_comp_channel,
    cq_out: *mut *mut ibv_cq,
    ctx_out: *mut *mut c_void,
) -> c_int {
    guard(-1, || {
        if ch.is_null() || cq_out.is_null() || ctx_out.is_null() {
            return minus_one(libc::EINVAL);
        }
        // SAFETY: ch is ours and live.
        let chan = unsafe { &(*ch.cast::<VChannel>()).chan };
        // Every queued event has a completion behind it (`cq_events`): return it, as a device
        // does; an app that saw the fd readable must not block here.
        let cq = loop {
            if let Err(e) = chan.efd.wait() {
                return minus_one(e);
            }
            match chan.queue.lock().ok().and_then(|mut q| q.pop_front()) {
                Some(p) => break p as *mut VCq,
                // A poll withdrew the event between the fd's wake-up and here.
                None if chan.efd.nonblocking() => return minus_one(libc::EAGAIN),
                None => continue,
            }
        };
        // SAFETY: queued CQs are live (destroy_cq removes them from the queue).
        unsafe { &*cq }.events.taken();
        // SAFETY: queued CQs are live (destroy_cq removes them from the queue).
        unsafe {
            (*cq).delivered.fetch_add(1, Ordering::Relaxed);
        }
        // SAFETY: out-pointers are valid per the API; cq is live.
        unsafe { *cq_out = cq.cast() };
        // SAFETY: cq is live (see above).
        let user = unsafe { &*cq }.cq.cq_context;
        // SAFETY: the out-pointer is valid per the API.
        unsafe { ctx_out.write(user) };
        0
    })
}

#[unsafe(no_mangle)]
pub extern "C" fn vrnic_ibv_ack_cq_events(cq: *mut ibv_cq, n: c_uint) {
    guard((), || {
        if cq.is_null() {
            return;
        }
        // SAFETY: cq is ours; comp_events_completed is read by the app only under its mutex
        // in rdma-core, and single-threaded apps ack from one thread.
        let c = unsafe { &mut *cq };
        c.comp_events_completed = c.comp_events_completed.wrapping_add(n);
    })
}

pub extern "C" fn vrnic_req_notify_cq(cq: *mut ibv_cq, solicited_only: c_int) -> c_int {
    guard(libc::EIO, || {
        if cq.is_null() {
            return libc::EINVAL;
        }
        // SAFETY: cq is ours and live.
        let v = unsafe { &*cq.cast::<VCq>() };
        // SAFETY: the CQ's context outlives it.
        let conn = &unsafe { context(v.cq.context) }.conn;
        v.events.set_mode(solicited_only != 0);
        if let Ok(q) = v.q.lock() {
            q.arm(&conn.region, solicited_only != 0);
        }
        conn.ensure_notifier();
        0
    })
}

pub extern "C" fn vrnic_poll_cq(cq: *mut ibv_cq, n: c_int, wc: *mut ibv_wc) -> c_int {
    guard(-1, || {
        if cq.is_null() || n < 0 || (wc.is_null() && n > 0) {
            return -1;
        }
        // SAFETY: cq is ours and live.
        let v = unsafe { &*cq.cast::<VCq>() };
        // SAFETY: the CQ's context outlives it.
        let conn = &unsafe { context(v.cq.context) }.conn;
        let Ok(mut q) = v.q.lock() else { return -1 };
        let got = q.poll(&conn.region, n as usize, |i, c| {
            let w = ibv_wc {
                wr_id: c.wr_id,
                status: c.status as c_uint,
                opcode: c.opcode as c_uint,
                vendor_err: c.vendor_err,
                byte_len: c.byte_len,
                imm_data: c.imm_data,
                qp_num: c.qp_num,
                src_qp: c.src_qp,
                wc_flags: c_uint::from(c.wc_flags),
                pkey_index: 0,
                slid: c.slid,
                sl: c.sl,
                dlid_path_bits: 0,
            };
            // SAFETY: the app's array holds n entries and i < n.
            let slot = unsafe { wc.add(i) };
            // SAFETY: as above: slot is in the app's array.
            unsafe { slot.write(w) };
        });
        if let Some(ch) = &v.channel {
            v.events.after_poll(cq as usize, &q.ring, &conn.region, ch);
        }
        got as c_int
    })
}

// ---- queue pairs ----------------------------------------------------------------------------

#[unsafe(no_mangle)]
pub extern "C" fn vrnic_ibv_create_qp(pd: *mut ibv_pd, init: *mut ibv_qp_init_attr) -> *mut ibv_qp {
    guard(null_err(libc::EIO), || {
        if pd.is_null() || init.is_null() {
            return null_err(libc::EINVAL);
        }
        // SAFETY: init is a caller-owned ibv_qp_init_attr.
        let ia = unsafe { &mut *init };
        if ia.qp_type == IBV_QPT_XRC_SEND {
            // `ibv_create_qp_ex` with a PD alone comes here (verbs.h): the XRC path.
            // SAFETY: plain C data; zero is valid.
            let mut x: ibv_qp_init_attr_ex = unsafe { std::mem::zeroed() };
            x.qp_context = ia.qp_context;
            x.send_cq = ia.send_cq;
            x.cap = ia.cap;
            x.qp_type = ia.qp_type;
            x.sq_sig_all = ia.sq_sig_all;
            x.comp_mask = IBV_QP_INIT_ATTR_PD;
            x.pd = pd;
            // SAFETY: pd is ours and live.
            let qp = crate::ffi::xrc::create_qp(unsafe { &*pd }.context, &mut x);
            ia.cap = x.cap;
            return qp;
        }
        if ia.send_cq.is_null() || ia.recv_cq.is_null() {
            return null_err(libc::EINVAL);
        }
        // SAFETY: a non-NULL SRQ in the app's init attributes is one of ours, live.
        let srq = (!ia.srq.is_null()).then(|| unsafe { (*ia.srq).handle });
        let qp_type = match ia.qp_type {
            IBV_QPT_RC => QpType::Rc,
            IBV_QPT_UC => QpType::Uc,
            IBV_QPT_UD => QpType::Ud,
            _ => return null_err(libc::EOPNOTSUPP),
        };
        let cap = QpCap {
            max_send_wr: ia.cap.max_send_wr,
            max_recv_wr: ia.cap.max_recv_wr,
            max_send_sge: ia.cap.max_send_sge,
            max_recv_sge: ia.cap.max_recv_sge,
            max_inline_data: ia.cap.max_inline_data,
        };
        // SAFETY: pd is ours and live.
        let pdr = unsafe { &*pd };
        // SAFETY: the PD's context outlives it.
        if let Err(e) = limits::check_qp_cap(&unsafe { context(pdr.context) }.conn.info, &cap) {
            return null_err(e);
        }
        // SAFETY: the CQs named in the app's init attributes are ours and live.
        let scq = unsafe { &*ia.send_cq }.handle;
        // SAFETY: as above.
        let rcq = unsafe { &*ia.recv_cq }.handle;
        let (ctx, pdh) = (pdr.context, pdr.handle);
        let req = Request::CreateQp {
            pd: pdh,
            send_cq: scq,
            recv_cq: rcq,
            qp_type,
            cap,
            sq_sig_all: ia.sq_sig_all != 0,
            srq,
            xrcd: None,
        };
        make_qp(ctx, pd, ia, &req)
    })
}

/// Makes the QP `req` asks for (`CreateQp`), of the type and with the CQs, SRQ and capacities
/// `ia` names (which gets the capacities granted), in context `ctx` under `pd` (NULL for an
/// XRC receive QP): the daemon's answer, its rings mapped, the `ibv_qp` handed to the app.
pub(crate) fn make_qp(
    ctx: *mut ibv_context,
    pd: *mut ibv_pd,
    ia: &mut ibv_qp_init_attr,
    req: &Request,
) -> *mut ibv_qp {
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
        Ok(_) => return null_err(libc::EPROTO),
        Err(e) => return null_err(e),
    };
    let (Ok(sq), Ok(rq)) = (
        Ring::new(&c.conn.region, sq, sq_depth, SQ_SLOT),
        Ring::new(&c.conn.region, rq, rq_depth, RQ_SLOT),
    ) else {
        let _ = c.conn.call(&Request::DestroyQp { qp: h });
        return null_err(libc::EPROTO);
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
    p.cast()
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

fn state_from_c(s: c_uint) -> Option<QpState> {
    QpState::from_u32(s)
}

fn attr_from_c(a: &ibv_qp_attr) -> Option<QpAttr> {
    Some(QpAttr {
        qp_state: state_from_c(a.qp_state)?,
        cur_qp_state: state_from_c(a.cur_qp_state).unwrap_or_default(),
        path_mtu: a.path_mtu as u8,
        path_mig_state: a.path_mig_state as u8,
        qkey: a.qkey,
        rq_psn: a.rq_psn,
        sq_psn: a.sq_psn,
        dest_qp_num: a.dest_qp_num,
        qp_access_flags: a.qp_access_flags,
        cap: QpCap {
            max_send_wr: a.cap.max_send_wr,
            max_recv_wr: a.cap.max_recv_wr,
            max_send_sge: a.cap.max_send_sge,
            max_recv_sge: a.cap.max_recv_sge,
            max_inline_data: a.cap.max_inline_data,
        },
        ah_attr: ah_from_c(&a.ah_attr),
        alt_ah_attr: ah_from_c(&a.alt_ah_attr),
        pkey_index: a.pkey_index,
        alt_pkey_index: a.alt_pkey_index,
        en_sqd_async_notify: a.en_sqd_async_notify,
        sq_draining: a.sq_draining,
        max_rd_atomic: a.max_rd_atomic,
        max_dest_rd_atomic: a.max_dest_rd_atomic,
        min_rnr_timer: a.min_rnr_timer,
        port_num: a.port_num,
        timeout: a.timeout,
        retry_cnt: a.retry_cnt,
        rnr_retry: a.rnr_retry,
        alt_port_num: a.alt_port_num,
        alt_timeout: a.alt_timeout,
    })
}

fn attr_to_c(a: &QpAttr) -> ibv_qp_attr {
    // SAFETY: plain C data; zero is valid.
    let mut c: ibv_qp_attr = unsafe { std::mem::zeroed() };
    c.qp_state = a.qp_state as c_uint;
    c.cur_qp_state = a.qp_state as c_uint;
    c.path_mtu = c_uint::from(a.path_mtu);
    c.path_mig_state = c_uint::from(a.path_mig_state);
    c.qkey = a.qkey;
    c.rq_psn = a.rq_psn;
    c.sq_psn = a.sq_psn;
    c.dest_qp_num = a.dest_qp_num;
    c.qp_access_flags = a.qp_access_flags as _;
    c.cap.max_send_wr = a.cap.max_send_wr;
    c.cap.max_recv_wr = a.cap.max_recv_wr;
    c.cap.max_send_sge = a.cap.max_send_sge;
    c.cap.max_recv_sge = a.cap.max_recv_sge;
    c.cap.max_inline_data = a.cap.max_inline_data;
    c.ah_attr = ah_to_c(&a.ah_attr);
    c.alt_ah_attr = ah_to_c(&a.alt_ah_attr);
    c.pkey_index = a.pkey_index;
    c.alt_pkey_index = a.alt_pkey_index;
    c.en_sqd_async_notify = a.en_sqd_async_notify;
    c.sq_draining = a.sq_draining;
    c.max_rd_atomic = a.max_rd_atomic;
    c.max_dest_rd_atomic = a.max_dest_rd_atomic;
    c.min_rnr_timer = a.min_rnr_timer;
    c.port_num = a.port_num;
    c.timeout = a.timeout;
    c.retry_cnt = a.retry_cnt;
    c.rnr_retry = a.rnr_retry;
    c.alt_port_num = a.alt_port_num;
    c.alt_timeout = a.alt_timeout;
    c
}

#[unsafe(no_mangle)]
pub extern "C" fn vrnic_ibv_modify_qp(
    qp: *mut ibv_qp,
    attr: *mut ibv_qp_attr,
    mask: c_int,
) -> c_int {
    guard(libc::EIO, || {
        if qp.is_null() || attr.is_null() {
            return libc::EINVAL;
        }
        // SAFETY: qp is ours and live.
        let v = unsafe { &*qp.cast::<VQp>() };
        // SAFETY: attr is caller-owned.
        let a = unsafe { &*attr };
        let mask = mask as u32;
        let mut qa = match attr_from_c(a) {
            Some(q) => q,
            None if mask & vrnic_wire::qp_attr::STATE == 0 => {
                let mut a2 = *a;
                a2.qp_state = IBV_QPS_RESET;
                match attr_from_c(&a2) {
                    Some(q) => q,
                    None => return libc::EINVAL,
                }
            }
            None => return libc::EINVAL,
        };
        if mask & vrnic_wire::qp_attr::STATE == 0 {
            qa.qp_state = state_from_c(v.state.load(Ordering::Acquire)).unwrap_or_default();
        }
        if let Err(e) = limits::check_qp_attr(mask, &qa) {
            return e;
        }
        // SAFETY: the QP's context outlives it.
        let conn = &unsafe { context(v.qp.qp_base.context) }.conn;
        match conn.call(&Request::ModifyQp {
            qp: v.qp.qp_base.handle,
            mask,
            attr: Box::new(qa),
        }) {
            Ok(_) => {
                if mask & vrnic_wire::qp_attr::STATE != 0 {
                    v.state.store(a.qp_state, Ordering::Release);
                    // SAFETY: `state` is a plain field apps read; we own the QP struct.
                    unsafe { (*qp).state = a.qp_state };
                    if a.qp_state == IBV_QPS_RESET {
                        // The daemon dropped what the rings held and published their consumer
                        // indices before it answered: start the rings afresh from there.
                        if let (Ok(mut sq), Ok(mut rq)) = (v.sq.lock(), v.rq.lock()) {
                            sq.prod = sq.ring.cons(&conn.region).load(Ordering::Acquire);
                            rq.prod = rq.ring.cons(&conn.region).load(Ordering::Acquire);
                            sq.publish(&conn.region);
                            rq.publish(&conn.region);
                        }
                        // SAFETY: qp is ours and live.
                        clean_cqs(unsafe { &*qp }, conn);
                    }
                }
                0
            }
            Err(e) => e,
        }
    })
}

/// Removes `qp`'s completions from its CQs, once the daemon has answered its move to RESET
/// or its destruction (by then every completion the QP will ever have is in the rings). A real
/// device's provider does the same (mlx5: `mlx5_cq_clean` on RESET and on destroy), so a QP
/// reused after RESET never shows completions of its previous life.
fn clean_cqs(qp: &ibv_qp, conn: &Conn) {
    let cqs = if qp.recv_cq == qp.send_cq {
        [qp.send_cq, null_mut()]
    } else {
        [qp.send_cq, qp.recv_cq]
    };
    for cq in cqs.into_iter().filter(|c| !c.is_null()) {
        // SAFETY: a QP's CQs are ours and outlive it (destroy_cq refuses while a QP uses one).
        let v = unsafe { &*cq.cast::<VCq>() };
        if let Ok(mut q) = v.q.lock() {
            let n = q.clean(&conn.region, qp.qp_num);
            if n > 0 {
                vlog!("QP {}: {n} completions removed from its CQ", qp.qp_num);
            }
        }
    }
}

#[unsafe(no_mangle)]
pub extern "C" fn vrnic_ibv_query_qp(
    qp: *mut ibv_qp,
    attr: *mut ibv_qp_attr,
    _mask: c_int,
    init: *mut ibv_qp_init_attr,
) -> c_int {
    guard(libc::EIO, || {
        if qp.is_null() || attr.is_null() {
            return libc::EINVAL;
        }
        // SAFETY: qp is ours and live.
        let v = unsafe { &*qp.cast::<VQp>() };
        // SAFETY: the QP's context outlives it.
        let conn = &unsafe { context(v.qp.qp_base.context) }.conn;
        let qa = match conn.call(&Request::QueryQp {
            qp: v.qp.qp_base.handle,
        }) {
            Ok(Reply::QpAttr(a)) => a,
            Ok(_) => return libc::EPROTO,
            Err(e) => return e,
        };
        let mut c = attr_to_c(&qa);
        c.cap.max_send_wr = v.cap.max_send_wr;
        c.cap.max_recv_wr = v.cap.max_recv_wr;
        c.cap.max_send_sge = v.cap.max_send_sge;
        c.cap.max_recv_sge = v.cap.max_recv_sge;
        c.cap.max_inline_data = v.cap.max_inline_data;
        // SAFETY: attr is caller-owned.
        unsafe { *attr = c };
        v.state.store(qa.qp_state as u32, Ordering::Release);
        if !init.is_null() {
            // SAFETY: plain C data; zero is valid.
            let mut i: ibv_qp_init_attr = unsafe { std::mem::zeroed() };
            i.qp_context = v.qp.qp_base.qp_context;
            i.send_cq = v.qp.qp_base.send_cq;
            i.recv_cq = v.qp.qp_base.recv_cq;
            i.srq = v.qp.qp_base.srq;
            i.cap = c.cap;
            i.qp_type = v.qp.qp_base.qp_type;
            i.sq_sig_all = c_int::from(v.sq_sig_all);
            // SAFETY: init is caller-owned.
            unsafe { *init = i };
        }
        0
    })
}

#[unsafe(no_mangle)]
pub extern "C" fn vrnic_ibv_destroy_qp(qp: *mut ibv_qp) -> c_int {
    guard(libc::EIO, || {
        if qp.is_null() {
            return libc::EINVAL;
        }
        // SAFETY: qp is ours and live.
        let qpr = unsafe { &*qp };
        let (ctx, h) = (qpr.context, qpr.handle);
        // SAFETY: the QP's context outlives it.
        let c = unsafe { context(ctx) };
        if let Err(e) = c.conn.call(&Request::DestroyQp { qp: h }) {
            return e;
        }
        clean_cqs(qpr, &c.conn);
        if let Ok(mut m) = c.qps.lock() {
            m.remove(&h);
        }
        c.conn.withdraw_events(QP_EVENTS, h);
        // SAFETY: boxed by create_qp; the app gives it up now.
        drop(unsafe { Box::from_raw(qp.cast::<VQp>()) });
        0
    })
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

pub extern "C" fn vrnic_post_send(
    qp: *mut ibv_qp,
    wr: *mut ibv_send_wr,
    bad: *mut *mut ibv_send_wr,
) -> c_int {
    guard(libc::EIO, || {
        let fail = |w: *mut ibv_send_wr, e: c_int| fail_at(bad, w, e);
        if qp.is_null() {
            return fail(wr, libc::EINVAL);
        }
        // SAFETY: qp is ours and live.
        let v = unsafe { &*qp.cast::<VQp>() };
        let xrc_send = v.qp.qp_base.qp_type == IBV_QPT_XRC_SEND;
        if v.qp.qp_base.qp_type == IBV_QPT_XRC_RECV {
            // An XRC receive QP has no send queue.
            return fail(wr, libc::EINVAL);
        }
        let state = v.state.load(Ordering::Acquire);
        if state != IBV_QPS_RTS
            && state != IBV_QPS_SQD
            && state != IBV_QPS_ERR
            && state != IBV_QPS_SQE
        {
            return fail(wr, libc::EINVAL);
        }
        // SAFETY: the QP's context outlives it.
        let conn = &unsafe { context(v.qp.qp_base.context) }.conn;
        let Ok(mut sq) = v.sq.lock() else {
            return fail(wr, libc::EIO);
        };
        let mut cur = wr;
        let mut posted = false;
        let mut rc = 0;
        while !cur.is_null() {
            // SAFETY: cur is a node of the app's list.
            let w = unsafe { &*cur };
            let opcode = match u8::try_from(w.opcode).map(SendOpcode::from_u8) {
                // `ibv_send_wr` has no member for an ATOMIC WRITE's 8 bytes: only
                // `ibv_wr_atomic_write` posts one.
                Ok(Ok(o)) if o != SendOpcode::AtomicWrite => o,
                _ => {
                    rc = libc::EINVAL;
                    break;
                }
            };
            if w.num_sge < 0 || w.num_sge as u32 > v.cap.max_send_sge.max(1).min(MAX_SGE as u32) {
                rc = libc::EINVAL;
                break;
            }
            if sq.room(&conn.region) == 0 {
                rc = libc::ENOMEM;
                break;
            }
            let mut flags = SendFlags((w.send_flags & u32::from(SendFlags::ALL)) as u8);
            if v.sq_sig_all {
                flags = flags | SendFlags::SIGNALED;
            }
            let list = sges(w.sg_list, w.num_sge);
            let payload = if flags.contains(SendFlags::INLINE) {
                let total: u64 = list.iter().map(|s| u64::from(s.length)).sum();
                if total > MAX_INLINE as u64 {
                    rc = libc::EINVAL;
                    break;
                }
                let mut data = InlineData::with_capacity(total as usize);
                for s in &list {
                    if s.length > 0 {
                        // SAFETY: inline data is read from the app's buffer at post time,
                        // as a device's driver does; the app vouches it is readable.
                        data.extend_from_slice(unsafe {
                            std::slice::from_raw_parts(s.addr as *const u8, s.length as usize)
                        });
                    }
                }
                SendPayload::Inline(data)
            } else {
                SendPayload::Sges(list)
            };
            let (mut remote_addr, mut rkey, mut compare_add, mut swap) = send_wr_remote(w, opcode);
            let mut imm_data = send_wr_imm(w);
            if opcode == SendOpcode::BindMw {
                // SAFETY: for IBV_WR_BIND_MW the app filled the `bind_mw` member (verbs.h).
                let b = unsafe { w.bind_mw_or_tso.bind_mw };
                match crate::ffi::mw::bind_fields(b.mw, b.rkey, &raw const b.bind_info) {
                    Ok(f) => (remote_addr, rkey, imm_data, compare_add, swap) = f,
                    Err(e) => {
                        rc = e;
                        break;
                    }
                }
            }
            let ud = if v.qp.qp_base.qp_type == IBV_QPT_UD {
                // SAFETY: on a UD QP the app filled the `ud` member of the union (verbs.h).
                let u = unsafe { w.wr.ud };
                if u.ah.is_null() {
                    rc = libc::EINVAL;
                    break;
                }
                UdAddr {
                    // SAFETY: a non-NULL AH of a UD work request is one of ours, live.
                    ah: unsafe { (*u.ah).handle },
                    remote_qpn: u.remote_qpn,
                    remote_qkey: u.remote_qkey,
                }
            } else {
                UdAddr::default()
            };
            let wqe = SendWqe {
                wr_id: w.wr_id,
                opcode,
                flags,
                imm_data,
                remote_addr,
                rkey,
                compare_add,
                swap,
                ud,
                xrc_srqn: if xrc_send {
                    // SAFETY: on an XRC send QP the app filled `qp_type.xrc` (verbs.h).
                    unsafe { w.qp_type.xrc.remote_srqn }
                } else {
                    0
                },
                payload,
            };
            sq.push_send(&conn.region, &wqe);
            posted = true;
            cur = w.next;
        }
        if posted {
            sq.publish(&conn.region);
            drop(sq);
            conn.doorbell();
        }
        if rc != 0 { fail(cur, rc) } else { 0 }
    })
}

pub extern "C" fn vrnic_post_recv(
    qp: *mut ibv_qp,
    wr: *mut ibv_recv_wr,
    bad: *mut *mut ibv_recv_wr,
) -> c_int {
    guard(libc::EIO, || {
        let fail = |w: *mut ibv_recv_wr, e: c_int| fail_at(bad, w, e);
        if qp.is_null() {
            return fail(wr, libc::EINVAL);
        }
        // SAFETY: qp is ours and live.
        let v = unsafe { &*qp.cast::<VQp>() };
        // Receives of a QP on an SRQ are posted to the SRQ; XRC QPs have no receive queue.
        if v.state.load(Ordering::Acquire) == IBV_QPS_RESET
            || !v.qp.qp_base.srq.is_null()
            || matches!(v.qp.qp_base.qp_type, IBV_QPT_XRC_SEND | IBV_QPT_XRC_RECV)
        {
            return fail(wr, libc::EINVAL);
        }
        // SAFETY: the QP's context outlives it.
        let conn = &unsafe { context(v.qp.qp_base.context) }.conn;
        post_recv_list(&v.rq, conn, wr, bad, v.cap.max_recv_sge)
    })
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
        if rq.room(&conn.region) == 0 {
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

// ---- async events ----------------------------------------------------------------------------

/// The async events that name a QP, an SRQ, a CQ: withdrawn when the object is destroyed.
pub(crate) const QP_EVENTS: &[u32] = &[
    vrnic_api::event::QP_FATAL,
    vrnic_api::event::QP_LAST_WQE_REACHED,
];
pub(crate) const SRQ_EVENTS: &[u32] = &[
    vrnic_api::event::SRQ_LIMIT_REACHED,
    vrnic_api::event::SRQ_ERR,
];
const CQ_EVENTS: &[u32] = &[vrnic_api::event::CQ_ERR];

/// The object (as its address) an async event names by handle, or 0 if it is gone.
fn object(table: &Mutex<HashMap<u32, usize>>, handle: u32) -> usize {
    table
        .lock()
        .ok()
        .and_then(|m| m.get(&handle).copied())
        .unwrap_or(0)
}

/// `ibv_get_async_event`: the next event, blocking unless the app made `async_fd`
/// non-blocking. Events are withdrawn when the object they name is destroyed
/// (`Conn::withdraw_events`); one that still finds its object gone is skipped, never handed
/// out with a null element.
#[unsafe(no_mangle)]
pub extern "C" fn vrnic_ibv_get_async_event(
    ctx: *mut ibv_context,
    ev: *mut ibv_async_event,
) -> c_int {
    guard(-1, || {
        if ctx.is_null() || ev.is_null() {
            return minus_one(libc::EINVAL);
        }
        // SAFETY: ctx is ours.
        let c = unsafe { context(ctx) };
        loop {
            if let Err(e) = c.conn.async_q.efd.wait() {
                return minus_one(e);
            }
            let Some((kind, handle)) = c
                .conn
                .async_q
                .queue
                .lock()
                .ok()
                .and_then(|mut q| q.pop_front())
            else {
                // Its event was withdrawn between the wake-up and now: wait for the next.
                continue;
            };
            // SAFETY: plain C data; zero is valid.
            let mut out: ibv_async_event = unsafe { std::mem::zeroed() };
            out.event_type = kind;
            let element = match kind {
                k if QP_EVENTS.contains(&k) => {
                    let p = object(&c.qps, handle);
                    out.element.qp = p as *mut ibv_qp;
                    p
                }
                k if SRQ_EVENTS.contains(&k) => {
                    let p = object(&c.srqs, handle);
                    out.element.srq = p as *mut ibv_srq;
                    p
                }
                k if CQ_EVENTS.contains(&k) => {
                    let p = object(&c.cqs, handle);
                    out.element.cq = p as *mut ibv_cq;
                    p
                }
                _ => {
                    out.element.port_num = 1;
                    1
                }
            };
            if element == 0 {
                continue;
            }
            // SAFETY: ev is caller-owned.
            unsafe { *ev = out };
            return 0;
        }
    })
}

#[unsafe(no_mangle)]
pub extern "C" fn vrnic_ibv_ack_async_event(_ev: *mut ibv_async_event) {}

// ---- calls this device does not support ------------------------------------------------------

/// `enum ibv_fork_status`: `IBV_FORK_UNNEEDED`.
const IBV_FORK_UNNEEDED: c_int = 2;

/// `ibv_fork_init`: nothing to set up, as [`vrnic_ibv_is_fork_initialized`] says. rdma-core's
/// `ibv_fork_init` returns 0 at once when fork support is unneeded too.
#[unsafe(no_mangle)]
pub extern "C" fn vrnic_ibv_fork_init() -> c_int {
    0
}

/// `ibv_is_fork_initialized`: `IBV_FORK_UNNEEDED`, always. What `ibv_fork_init` guards against
/// on a real device is copy on write: after a fork the parent's next write to a registered
/// page gives the parent a new page, while the device keeps reading and writing the old one.
/// Here registered memory is region pages mapped `MAP_SHARED` over the app's buffer; a fork
/// neither copies nor moves them, so the parent's registrations keep working with no setup
/// (the engine reaches the very pages the parent uses). The child shares those pages with the
/// parent (not a copy, as on a kernel with copy-on-fork; not a hole, as after `ibv_fork_init`
/// with `MADV_DONTFORK`): docs/verbs.md says so.
#[unsafe(no_mangle)]
pub extern "C" fn vrnic_ibv_is_fork_initialized() -> c_int {
    IBV_FORK_UNNEEDED
}

/// The kernel's `IB_UVERBS_DEVICE_ATOMIC_WRITE` in `device_cap_flags_ex` (rdma/ib_user_verbs.h
/// since Linux 6.2, which libibverbs passes through; rxe and mlx5 set it where ATOMIC WRITE
/// works). Not in `abi.rs`'s checked table: older installed headers lack the name.
pub(crate) const IB_UVERBS_DEVICE_ATOMIC_WRITE: u64 = 1 << 40;

macro_rules! unsupported_ptr {
    ($($name:ident($($arg:ident: $ty:ty),*) -> $ret:ty;)*) => {$(
        #[unsafe(no_mangle)]
        pub extern "C" fn $name($(_: $ty),*) -> *mut $ret {
            null_err(libc::EOPNOTSUPP)
        }
    )*};
}

macro_rules! unsupported_int {
    ($($name:ident($($arg:ident: $ty:ty),*) = $val:expr;)*) => {$(
        #[unsafe(no_mangle)]
        pub extern "C" fn $name($(_: $ty),*) -> c_int {
            $val
        }
    )*};
}

// Importing (`ibv_import_device`, `_pd`, `_mr`, `_dm`) shares a context's objects with another
// process. A vRNIC context is one process's attachment (its socket or claimed mailbox, whose
// close is how the daemon learns it died and tears down what it owns), and every object
// belongs to one context; there is no kernel uverbs file to pass between processes and no
// way for a second attachment to act on another's objects. So the verbs answer as rdma-core
// does for a provider without `import_context` and with the default `import_pd`/`import_mr`/
// `import_dm` ops: NULL with `EOPNOTSUPP` (docs/verbs.md).
unsupported_ptr! {
    vrnic_ibv_reg_dmabuf_mr(pd: *mut ibv_pd, off: u64, len: usize, iova: u64, fd: c_int, access: c_int) -> ibv_mr;
    vrnic_ibv_import_pd(ctx: *mut ibv_context, h: u32) -> ibv_pd;
    vrnic_ibv_import_mr(pd: *mut ibv_pd, h: u32) -> ibv_mr;
    vrnic_ibv_import_dm(ctx: *mut ibv_context, h: u32) -> c_void;
}

/// `ibv_import_device`: rdma-core's checks in order, for a device without `import_context`:
/// an fd that `fstat` refuses is `EINVAL`; any open fd (a context's `cmd_fd`, dup'ed or passed
/// by `SCM_RIGHTS`: here a socket, not a uverbs character device) is `EOPNOTSUPP`.
#[unsafe(no_mangle)]
pub extern "C" fn vrnic_ibv_import_device(fd: c_int) -> *mut ibv_context {
    guard(null_err(libc::EIO), || {
        if !sys::fd_is_open(fd) {
            return null_err(libc::EINVAL);
        }
        null_err(libc::EOPNOTSUPP)
    })
}

unsupported_int! {
    vrnic_ibv_attach_mcast(qp: *mut ibv_qp, gid: *const ibv_gid, lid: u16) = libc::EOPNOTSUPP;
    vrnic_ibv_detach_mcast(qp: *mut ibv_qp, gid: *const ibv_gid, lid: u16) = libc::EOPNOTSUPP;
    vrnic_ibv_resolve_eth_l2_from_gid(ctx: *mut ibv_context, a: *mut ibv_ah_attr, mac: *mut u8, vid: *mut u16) = libc::EOPNOTSUPP;
    vrnic_ibv_query_ece(qp: *mut ibv_qp, ece: *mut c_void) = libc::EOPNOTSUPP;
    vrnic_ibv_set_ece(qp: *mut ibv_qp, ece: *mut c_void) = libc::EOPNOTSUPP;
    vrnic_ibv_query_qp_data_in_order(qp: *mut ibv_qp, op: c_uint, flags: u32) = 0;
}

#[unsafe(no_mangle)]
pub extern "C" fn vrnic_ibv_unimport_pd(_pd: *mut ibv_pd) {}
#[unsafe(no_mangle)]
pub extern "C" fn vrnic_ibv_unimport_mr(_mr: *mut ibv_mr) {}
#[unsafe(no_mangle)]
pub extern "C" fn vrnic_ibv_unimport_dm(_dm: *mut c_void) {}

/// Remote address, rkey and atomic operands of a send work request, from the union that fits
/// its opcode.
fn send_wr_remote(w: &ibv_send_wr, op: SendOpcode) -> (u64, u32, u64, u64) {
    match op {
        // SAFETY: for atomics the app filled the `atomic` member of the union (verbs.h).
        SendOpcode::AtomicCmpAndSwp | SendOpcode::AtomicFetchAndAdd => unsafe {
            let a = w.wr.atomic;
            (a.remote_addr, a.rkey, a.compare_add, a.swap)
        },
        _ => {
            // SAFETY: for RDMA operations the app filled `rdma`; for sends the bytes are unused
            // and any bit pattern of two integers is valid.
            let r = unsafe { w.wr.rdma };
            (r.remote_addr, r.rkey, 0, 0)
        }
    }
}

/// Immediate data, kept in network order as the app wrote it.
fn send_wr_imm(w: &ibv_send_wr) -> u32 {
    w.imm_data
}
