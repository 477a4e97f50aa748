//! Devices: the device list, names and GUIDs, and what a context reports of its device and
//! port (`ibv_query_device`/`_ex`, `ibv_query_port`, GIDs and P_Keys).
#![allow(unsafe_code)]
#![allow(clippy::not_unsafe_ptr_arg_deref)]

use std::ffi::{c_char, c_int, c_uint};
use std::ptr::null_mut;
use std::sync::Mutex;

use vrnic_shm::layout::PAGE;
use vrnic_wire::MAX_SGE;

use super::objects::{VDevice, context, copy_name, guard, minus_one};
use crate::abi::*;
use crate::client::{self, Conn, Device};
use crate::limits;

static DEVICES: Mutex<Vec<usize>> = Mutex::new(Vec::new());

pub(crate) fn device_for(d: Device) -> *mut ibv_device {
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
    if i.max_mw > 0 {
        a.device_cap_flags |= limits::MW_CAP_FLAGS;
    }
    a.max_mw = c_int::try_from(i.max_mw).unwrap_or(c_int::MAX);
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
        ex.max_dm_size = limits::MAX_DM_SIZE;
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

/// The kernel's `IB_UVERBS_DEVICE_ATOMIC_WRITE` in `device_cap_flags_ex` (rdma/ib_user_verbs.h
/// since Linux 6.2, which libibverbs passes through; rxe and mlx5 set it where ATOMIC WRITE
/// works). Not in `abi.rs`'s checked table: older installed headers lack the name.
pub(crate) const IB_UVERBS_DEVICE_ATOMIC_WRITE: u64 = 1 << 40;
