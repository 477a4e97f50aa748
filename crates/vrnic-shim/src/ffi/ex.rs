//! The extended verbs: `ibv_create_qp_ex` with the `ibv_wr_*` work-request builders
//! (`ibv_qp_to_qp_ex`), and `ibv_create_cq_ex` with `start_poll`/`next_poll`/`end_poll` and the
//! `read_*` accessors, completion timestamps included.
//!
//! Both reuse the ordinary objects: an extended QP is a `VQp` whose `ibv_qp_ex` table is
//! filled, an extended CQ a `VCq` whose `ibv_cq_ex` table is filled, so the plain verbs
//! (`ibv_post_send`, `ibv_poll_cq`, completion channels) keep working on them.
//!
//! A `wr_start` ... `wr_complete` batch is built privately and written to the send ring as a
//! whole (all or nothing), with the checks and errnos of `ibv_post_send`. The section is the
//! per-QP critical region `ibv_wr_post(3)` promises: a second thread's `wr_start` waits until
//! the first thread's `wr_complete`/`wr_abort`. Memory-window builders (`wr_bind_mw`,
//! `wr_local_inv`, `wr_send_inv`) build the same WQEs as `ibv_post_send` (`objects::bind_fields`).
//! `wr_atomic_write` copies its 8 bytes at the call into an inline WQE (as mlx5 and rxe copy
//! them into theirs); a data setter after it fails the batch with `EINVAL`. Builders this
//! device does not support (TSO, XRC outside XRC send QPs) poison the batch: `wr_complete`
//! returns `EOPNOTSUPP` and posts nothing of it. As on mlx5, `IBV_SEND_INLINE` in `wr_flags` means
//! nothing to the builders; the inline setters make a WR inline.
//!
//! `start_poll` loads the completion at the head of the ring without retiring it; `next_poll`
//! retires it and loads the next; `end_poll` retires the current one and publishes the consumer
//! index, so the daemon sees the slots free once per poll loop. Completion timestamps are the
//! daemon's `CLOCK_MONOTONIC` nanoseconds at the time it wrote the completion (`hca_core_clock`
//! is 1 GHz; `query_rt_values` reads the same clock); wallclock timestamps are not offered.
#![allow(unsafe_code)]
#![allow(clippy::not_unsafe_ptr_arg_deref)]

use std::ffi::{c_int, c_uint, c_void};
use std::ptr::null_mut;
use std::sync::atomic::Ordering;
use std::sync::{Mutex, MutexGuard};

use vrnic_wire::{
    Cqe, InlineData, MAX_INLINE, MAX_SGE, SendFlags, SendOpcode, SendPayload, SendWqe, Sge,
    SgeList, UdAddr,
};

use super::objects::{Batch, VCq, VQp, bind_fields, context, guard, null_err};
use crate::abi::*;
use crate::client::{CompQueue, Conn};

/// `IBV_QP_EX_WITH_*` this device executes, by QP type (the operations `ibv_wr_post(3)` lists
/// for each).
fn send_ops(qp_type: c_uint) -> u64 {
    let send = IBV_QP_EX_WITH_SEND | IBV_QP_EX_WITH_SEND_WITH_IMM;
    let write = IBV_QP_EX_WITH_RDMA_WRITE | IBV_QP_EX_WITH_RDMA_WRITE_WITH_IMM;
    // Memory-window binds and invalidations (`mw.rs`).
    let mw = IBV_QP_EX_WITH_BIND_MW | IBV_QP_EX_WITH_LOCAL_INV | IBV_QP_EX_WITH_SEND_WITH_INV;
    match qp_type {
        IBV_QPT_RC => {
            send | write
                | mw
                | IBV_QP_EX_WITH_RDMA_READ
                | IBV_QP_EX_WITH_ATOMIC_CMP_AND_SWP
                | IBV_QP_EX_WITH_ATOMIC_FETCH_AND_ADD
                | IBV_QP_EX_WITH_ATOMIC_WRITE
        }
        IBV_QPT_UC => send | write | mw,
        IBV_QPT_UD => send,
        // XRC: what RC does but memory windows (a window's PD would be the target SRQ's).
        IBV_QPT_XRC_SEND => {
            send | write
                | IBV_QP_EX_WITH_RDMA_READ
                | IBV_QP_EX_WITH_ATOMIC_CMP_AND_SWP
                | IBV_QP_EX_WITH_ATOMIC_FETCH_AND_ADD
                | IBV_QP_EX_WITH_ATOMIC_WRITE
        }
        _ => 0,
    }
}

/// `IBV_WC_EX_WITH_*` this device reports.
const WC_FLAGS: u64 = IBV_WC_STANDARD_FLAGS | IBV_WC_EX_WITH_COMPLETION_TIMESTAMP;

// ---- extended QPs ----------------------------------------------------------------------------

/// `verbs_context.create_qp_ex` (the `ibv_create_qp_ex` inline).
pub extern "C" fn vrnic_create_qp_ex(
    ctx: *mut ibv_context,
    attr: *mut ibv_qp_init_attr_ex,
) -> *mut ibv_qp {
    guard(null_err(libc::EIO), || {
        if ctx.is_null() || attr.is_null() {
            return null_err(libc::EINVAL);
        }
        // SAFETY: attr is the app's.
        let x = unsafe { &mut *attr };
        let known = IBV_QP_INIT_ATTR_PD
            | IBV_QP_INIT_ATTR_XRCD
            | IBV_QP_INIT_ATTR_CREATE_FLAGS
            | IBV_QP_INIT_ATTR_SEND_OPS_FLAGS;
        let xrc_recv = x.qp_type == IBV_QPT_XRC_RECV;
        if !xrc_recv && (x.comp_mask & IBV_QP_INIT_ATTR_PD == 0 || x.pd.is_null()) {
            return null_err(libc::EINVAL);
        }
        if x.comp_mask & !known != 0
            || (x.comp_mask & IBV_QP_INIT_ATTR_CREATE_FLAGS != 0 && x.create_flags != 0)
        {
            return null_err(libc::EOPNOTSUPP);
        }
        if !matches!(
            x.qp_type,
            IBV_QPT_RC | IBV_QPT_UC | IBV_QPT_UD | IBV_QPT_XRC_SEND | IBV_QPT_XRC_RECV
        ) {
            // Raw packet, driver QPs.
            return null_err(libc::EOPNOTSUPP);
        }
        let extended = x.comp_mask & IBV_QP_INIT_ATTR_SEND_OPS_FLAGS != 0;
        let ops = if extended { x.send_ops_flags } else { 0 };
        if ops & !send_ops(x.qp_type) != 0 {
            return null_err(libc::EOPNOTSUPP);
        }
        if matches!(x.qp_type, IBV_QPT_XRC_SEND | IBV_QPT_XRC_RECV) {
            let qp = match super::qp::create_xrc_qp(ctx, x) {
                Ok(qp) => qp,
                Err(e) => return null_err(e),
            };
            // SAFETY: qp was just made: a live VQp.
            let v = unsafe { &mut *qp.cast::<VQp>() };
            v.extended = extended && !xrc_recv;
            builders(&mut v.qp);
            return qp;
        }
        // The plain path, from the fields both structs share.
        // SAFETY: plain C data; zero is valid.
        let mut ia: ibv_qp_init_attr = unsafe { std::mem::zeroed() };
        ia.qp_context = x.qp_context;
        ia.send_cq = x.send_cq;
        ia.recv_cq = x.recv_cq;
        ia.srq = x.srq;
        ia.cap = x.cap;
        ia.qp_type = x.qp_type;
        ia.sq_sig_all = x.sq_sig_all;
        let qp = match super::qp::create_qp(x.pd, &mut ia) {
            Ok(qp) => qp,
            Err(e) => return null_err(e),
        };
        x.cap = ia.cap;
        // SAFETY: qp was just made: a live VQp.
        let v = unsafe { &mut *qp.cast::<VQp>() };
        // As mlx5: only a QP asked for with SEND_OPS_FLAGS has the extended view.
        v.extended = extended;
        builders(&mut v.qp);
        qp
    })
}

/// Fills an extended QP's `ibv_wr_*` table.
fn builders(t: &mut ibv_qp_ex) {
    {
        t.comp_mask = 0;
        t.wr_start = Some(wr_start);
        t.wr_complete = Some(wr_complete);
        t.wr_abort = Some(wr_abort);
        t.wr_send = Some(wr_send);
        t.wr_send_imm = Some(wr_send_imm);
        t.wr_rdma_write = Some(wr_rdma_write);
        t.wr_rdma_write_imm = Some(wr_rdma_write_imm);
        t.wr_rdma_read = Some(wr_rdma_read);
        t.wr_atomic_cmp_swp = Some(wr_atomic_cmp_swp);
        t.wr_atomic_fetch_add = Some(wr_atomic_fetch_add);
        t.wr_set_sge = Some(wr_set_sge);
        t.wr_set_sge_list = Some(wr_set_sge_list);
        t.wr_set_inline_data = Some(wr_set_inline_data);
        t.wr_set_inline_data_list = Some(wr_set_inline_data_list);
        t.wr_set_ud_addr = Some(wr_set_ud_addr);
        t.wr_bind_mw = Some(wr_bind_mw);
        t.wr_local_inv = Some(wr_local_inv);
        t.wr_send_inv = Some(wr_send_inv);
        t.wr_send_tso = Some(wr_send_tso);
        t.wr_set_xrc_srqn = Some(wr_set_xrc_srqn);
        t.wr_atomic_write = Some(wr_atomic_write);
    }
}

/// `ibv_qp_to_qp_ex`: the extended view of a QP made by `ibv_create_qp_ex` with
/// `IBV_QP_INIT_ATTR_SEND_OPS_FLAGS`, else NULL with `errno` untouched (rdma-core's answer for a
/// QP without `VERBS_QP_EX`, which mlx5 sets only with that flag).
#[unsafe(no_mangle)]
pub extern "C" fn vrnic_ibv_qp_to_qp_ex(qp: *mut ibv_qp) -> *mut ibv_qp_ex {
    guard(null_mut(), || {
        if qp.is_null() {
            return null_mut();
        }
        let v = qp.cast::<VQp>();
        // SAFETY: qp is ours and live (no reference is made: other threads may post on it).
        if unsafe { (*v).extended } {
            // SAFETY: as above; the address of its first member.
            unsafe { &raw mut (*v).qp }
        } else {
            null_mut()
        }
    })
}

/// The QP behind an `ibv_qp_ex` of ours.
///
/// # Safety
/// `q` must be the `ibv_qp_ex` of a live QP made by `create_qp_ex`.
unsafe fn vqp<'a>(q: *mut ibv_qp_ex) -> &'a VQp {
    // SAFETY: per the contract; VQp starts with its ibv_qp_ex.
    unsafe { &*q.cast::<VQp>() }
}

/// The batch of `q`, locked (`None` for NULL or a poisoned lock).
fn lock_batch<'a>(q: *mut ibv_qp_ex) -> Option<(&'a VQp, MutexGuard<'a, Batch>)> {
    if q.is_null() {
        return None;
    }
    // SAFETY: q is an extended QP of ours (the app got it from ibv_qp_to_qp_ex).
    let v = unsafe { vqp(q) };
    let b = v.batch.batch.lock().ok()?;
    Some((v, b))
}

fn with_batch(q: *mut ibv_qp_ex, f: impl FnOnce(&VQp, &mut Batch)) {
    guard((), || {
        if let Some((v, mut b)) = lock_batch(q) {
            f(v, &mut b);
        }
    })
}

/// Starts a new WQE of `opcode` with the QP's current `wr_id` and `wr_flags`.
fn begin(
    q: *mut ibv_qp_ex,
    opcode: SendOpcode,
    remote_addr: u64,
    rkey: u32,
    imm: u32,
    cmp: u64,
    swap: u64,
) {
    with_batch(q, |v, b| {
        // FENCE, SIGNALED, SOLICITED; INLINE is for the inline setters to say.
        let keep = u32::from(SendFlags::ALL & !SendFlags::INLINE.0);
        let mut flags = SendFlags((v.qp.wr_flags & keep) as u8);
        if v.sq_sig_all {
            flags = flags | SendFlags::SIGNALED;
        }
        b.wqes.push(SendWqe {
            wr_id: v.qp.wr_id,
            opcode,
            flags,
            imm_data: imm,
            remote_addr,
            rkey,
            compare_add: cmp,
            swap,
            ud: UdAddr::default(),
            xrc_srqn: 0,
            payload: SendPayload::Sges(SgeList::new()),
        });
    });
}

/// Applies `f` to the batch's last WQE (a setter with no builder before it poisons the batch).
fn last(q: *mut ibv_qp_ex, f: impl FnOnce(&mut SendWqe) -> Result<(), c_int>) {
    with_batch(q, |_, b| match b.wqes.last_mut() {
        Some(w) => {
            if let Err(e) = f(w)
                && b.err == 0
            {
                b.err = e;
            }
        }
        None if b.err == 0 => b.err = libc::EINVAL,
        None => {}
    });
}

fn poison(q: *mut ibv_qp_ex, e: c_int) {
    with_batch(q, |_, b| {
        if b.err == 0 {
            b.err = e;
        }
    });
}

extern "C" fn wr_start(q: *mut ibv_qp_ex) {
    guard((), || {
        let Some((v, mut b)) = lock_batch(q) else {
            return;
        };
        let me = std::thread::current().id();
        // Another thread's section: wait for its wr_complete/wr_abort. Our own (a wr_start
        // again without an end) starts over.
        while b.owner.is_some_and(|o| o != me) {
            b = match v.batch.ended.wait(b) {
                Ok(b) => b,
                Err(_) => return,
            };
        }
        b.wqes.clear();
        b.err = 0;
        b.owner = Some(me);
    })
}

extern "C" fn wr_abort(q: *mut ibv_qp_ex) {
    with_batch(q, |v, b| b.end(&v.batch.ended));
}

extern "C" fn wr_complete(q: *mut ibv_qp_ex) -> c_int {
    guard(libc::EIO, || {
        let Some((v, mut b)) = lock_batch(q) else {
            return libc::EINVAL;
        };
        let rc = post_batch(v, &b);
        b.end(&v.batch.ended);
        rc
    })
}

/// Writes a batch to the send ring, all or nothing, with `ibv_post_send`'s checks and errnos.
fn post_batch(v: &VQp, b: &Batch) -> c_int {
    if b.err != 0 {
        return b.err;
    }
    let state = v.state.load(Ordering::Acquire);
    if !matches!(state, IBV_QPS_RTS | IBV_QPS_SQD | IBV_QPS_ERR | IBV_QPS_SQE) {
        return libc::EINVAL;
    }
    let max_sge = v.cap.max_send_sge.max(1).min(MAX_SGE as u32) as usize;
    for w in &b.wqes {
        match &w.payload {
            SendPayload::Sges(s) if s.len() > max_sge => return libc::EINVAL,
            SendPayload::Inline(d) if d.len() > MAX_INLINE => return libc::EINVAL,
            _ => {}
        }
        // No wr_set_ud_addr (the daemon never hands out AH handle 0).
        if v.qp.qp_base.qp_type == IBV_QPT_UD && w.ud.ah == 0 {
            return libc::EINVAL;
        }
    }
    if b.wqes.is_empty() {
        return 0;
    }
    // SAFETY: the QP's context outlives it.
    let conn = &unsafe { context(v.qp.qp_base.context) }.conn;
    let Ok(mut sq) = v.sq.lock() else {
        return libc::EIO;
    };
    if !u32::try_from(b.wqes.len()).is_ok_and(|n| sq.has_room(&conn.region, n)) {
        return libc::ENOMEM;
    }
    for w in &b.wqes {
        sq.push_send(&conn.region, w);
    }
    sq.publish(&conn.region);
    drop(sq);
    conn.doorbell();
    0
}

extern "C" fn wr_send(q: *mut ibv_qp_ex) {
    begin(q, SendOpcode::Send, 0, 0, 0, 0, 0);
}

extern "C" fn wr_send_imm(q: *mut ibv_qp_ex, imm: u32) {
    begin(q, SendOpcode::SendWithImm, 0, 0, imm, 0, 0);
}

extern "C" fn wr_rdma_write(q: *mut ibv_qp_ex, rkey: u32, addr: u64) {
    begin(q, SendOpcode::RdmaWrite, addr, rkey, 0, 0, 0);
}

extern "C" fn wr_rdma_write_imm(q: *mut ibv_qp_ex, rkey: u32, addr: u64, imm: u32) {
    begin(q, SendOpcode::RdmaWriteWithImm, addr, rkey, imm, 0, 0);
}

extern "C" fn wr_rdma_read(q: *mut ibv_qp_ex, rkey: u32, addr: u64) {
    begin(q, SendOpcode::RdmaRead, addr, rkey, 0, 0, 0);
}

extern "C" fn wr_atomic_cmp_swp(q: *mut ibv_qp_ex, rkey: u32, addr: u64, cmp: u64, swap: u64) {
    begin(q, SendOpcode::AtomicCmpAndSwp, addr, rkey, 0, cmp, swap);
}

extern "C" fn wr_atomic_fetch_add(q: *mut ibv_qp_ex, rkey: u32, addr: u64, add: u64) {
    begin(q, SendOpcode::AtomicFetchAndAdd, addr, rkey, 0, add, 0);
}

/// An ATOMIC WRITE's data is the 8 bytes its builder copied: no data setter applies to it.
fn takes_data(w: &SendWqe) -> Result<(), c_int> {
    if w.opcode == SendOpcode::AtomicWrite {
        Err(libc::EINVAL)
    } else {
        Ok(())
    }
}

extern "C" fn wr_set_sge(q: *mut ibv_qp_ex, lkey: u32, addr: u64, length: u32) {
    last(q, |w| {
        takes_data(w)?;
        set_sges(
            w,
            SgeList::from_buf_and_len([Sge { addr, length, lkey }, Sge::default()], 1),
        );
        Ok(())
    });
}

extern "C" fn wr_set_sge_list(q: *mut ibv_qp_ex, n: usize, list: *const ibv_sge) {
    last(q, |w| {
        takes_data(w)?;
        if n > MAX_SGE || (n > 0 && list.is_null()) {
            return Err(libc::EINVAL);
        }
        set_sges(w, super::objects::sges(list, n as c_int));
        Ok(())
    });
}

fn set_sges(w: &mut SendWqe, sges: SgeList) {
    w.payload = SendPayload::Sges(sges);
    w.flags = SendFlags(w.flags.0 & !SendFlags::INLINE.0);
}

/// Copies inline data from the app's buffers now, as a device driver does.
fn inline(w: &mut SendWqe, bufs: &[(*const u8, usize)]) -> Result<(), c_int> {
    let total: usize = bufs.iter().map(|b| b.1).sum();
    if total > MAX_INLINE {
        return Err(libc::EINVAL);
    }
    let mut data = InlineData::with_capacity(total);
    for &(p, n) in bufs {
        if n > 0 {
            if p.is_null() {
                return Err(libc::EINVAL);
            }
            // SAFETY: the app vouches for n readable bytes at p (verbs.h contract).
            data.extend_from_slice(unsafe { std::slice::from_raw_parts(p, n) });
        }
    }
    w.payload = SendPayload::Inline(data);
    w.flags = w.flags | SendFlags::INLINE;
    Ok(())
}

extern "C" fn wr_set_inline_data(q: *mut ibv_qp_ex, addr: *mut c_void, length: usize) {
    last(q, |w| {
        takes_data(w)?;
        inline(w, &[(addr.cast::<u8>().cast_const(), length)])
    });
}

extern "C" fn wr_set_inline_data_list(q: *mut ibv_qp_ex, n: usize, list: *const ibv_data_buf) {
    last(q, |w| {
        takes_data(w)?;
        if n > 0 && list.is_null() {
            return Err(libc::EINVAL);
        }
        let bufs: Vec<(*const u8, usize)> = (0..n)
            .map(|i| {
                // SAFETY: the app's list holds n entries; i < n.
                let p = unsafe { list.add(i) };
                // SAFETY: p is one of the app's entries.
                let b = unsafe { p.read() };
                (b.addr.cast::<u8>().cast_const(), b.length)
            })
            .collect();
        inline(w, &bufs)
    });
}

extern "C" fn wr_set_ud_addr(q: *mut ibv_qp_ex, ah: *mut ibv_ah, qpn: u32, qkey: u32) {
    last(q, |w| {
        if ah.is_null() {
            return Err(libc::EINVAL);
        }
        w.ud = UdAddr {
            // SAFETY: a non-NULL AH is one of ours, live.
            ah: unsafe { (*ah).handle },
            remote_qpn: qpn,
            remote_qkey: qkey,
        };
        Ok(())
    });
}

extern "C" fn wr_bind_mw(
    q: *mut ibv_qp_ex,
    mw: *mut ibv_mw,
    rkey: u32,
    b: *const ibv_mw_bind_info,
) {
    match bind_fields(mw, rkey, b) {
        Ok((addr, rkey, acc, len, swap)) => {
            begin(q, SendOpcode::BindMw, addr, rkey, acc, len, swap)
        }
        Err(e) => poison(q, e),
    }
}

extern "C" fn wr_local_inv(q: *mut ibv_qp_ex, rkey: u32) {
    begin(q, SendOpcode::LocalInv, 0, 0, rkey, 0, 0);
}

extern "C" fn wr_send_inv(q: *mut ibv_qp_ex, rkey: u32) {
    begin(q, SendOpcode::SendWithInv, 0, 0, rkey, 0, 0);
}

extern "C" fn wr_send_tso(q: *mut ibv_qp_ex, _hdr: *mut c_void, _sz: u16, _mss: u16) {
    poison(q, libc::EOPNOTSUPP);
}

/// The XRC SRQ at the target of the WQE being built (XRC send QPs only; elsewhere the batch
/// fails with `EOPNOTSUPP`).
extern "C" fn wr_set_xrc_srqn(q: *mut ibv_qp_ex, srqn: u32) {
    with_batch(q, |v, b| {
        let r = match b.wqes.last_mut() {
            _ if v.qp.qp_base.qp_type != IBV_QPT_XRC_SEND => Err(libc::EOPNOTSUPP),
            Some(w) => {
                w.xrc_srqn = srqn;
                Ok(())
            }
            None => Err(libc::EINVAL),
        };
        if let Err(e) = r
            && b.err == 0
        {
            b.err = e;
        }
    });
}

/// `ibv_wr_atomic_write`: the 8 bytes at `data` are copied now (the app may reuse the buffer
/// at once, as with mlx5 and rxe) into the WQE's inline payload; the responder stores them
/// at `addr` as one atomic write. A NULL `data` fails the batch with `EINVAL`.
extern "C" fn wr_atomic_write(q: *mut ibv_qp_ex, rkey: u32, addr: u64, data: *const c_void) {
    if data.is_null() {
        poison(q, libc::EINVAL);
        return;
    }
    begin(q, SendOpcode::AtomicWrite, addr, rkey, 0, 0, 0);
    last(q, |w| inline(w, &[(data.cast::<u8>(), 8)]));
}

// ---- extended CQs ----------------------------------------------------------------------------

/// `verbs_context.create_cq_ex` (the `ibv_create_cq_ex` inline).
pub extern "C" fn vrnic_create_cq_ex(
    ctx: *mut ibv_context,
    attr: *mut ibv_cq_init_attr_ex,
) -> *mut ibv_cq_ex {
    guard(null_err(libc::EIO), || {
        if ctx.is_null() || attr.is_null() {
            return null_err(libc::EINVAL);
        }
        // SAFETY: attr is the app's.
        let a = unsafe { &*attr };
        if a.wc_flags & !WC_FLAGS != 0 {
            return null_err(libc::EOPNOTSUPP);
        }
        if a.comp_mask & !(IBV_CQ_INIT_ATTR_MASK_FLAGS | IBV_CQ_INIT_ATTR_MASK_PD) != 0 {
            return null_err(libc::EINVAL);
        }
        if a.comp_mask & IBV_CQ_INIT_ATTR_MASK_PD != 0 {
            // Parent domains do not exist on this device.
            return null_err(libc::EOPNOTSUPP);
        }
        if a.comp_mask & IBV_CQ_INIT_ATTR_MASK_FLAGS != 0
            && a.flags & !(IBV_CREATE_CQ_ATTR_SINGLE_THREADED | IBV_CREATE_CQ_ATTR_IGNORE_OVERRUN)
                != 0
        {
            return null_err(libc::EOPNOTSUPP);
        }
        // Out of `c_int` range is past `max_cqe` and `num_comp_vectors` too (EINVAL there).
        let cqe = c_int::try_from(a.cqe).unwrap_or(c_int::MAX);
        let vector = c_int::try_from(a.comp_vector).unwrap_or(c_int::MAX);
        let cq = match super::cq::create_cq(ctx, cqe, a.cq_context, a.channel, vector) {
            Ok(cq) => cq,
            Err(e) => return null_err(e),
        };
        // SAFETY: cq was just made: a live VCq.
        let t = unsafe { &mut (*cq.cast::<VCq>()).cq };
        t.start_poll = Some(start_poll);
        t.next_poll = Some(next_poll);
        t.end_poll = Some(end_poll);
        t.read_opcode = Some(read_opcode);
        t.read_vendor_err = Some(read_vendor_err);
        t.read_byte_len = Some(read_byte_len);
        t.read_imm_data = Some(read_imm_data);
        t.read_qp_num = Some(read_qp_num);
        t.read_src_qp = Some(read_src_qp);
        t.read_wc_flags = Some(read_wc_flags);
        t.read_slid = Some(read_slid);
        t.read_sl = Some(read_sl);
        t.read_dlid_path_bits = Some(read_dlid_path_bits);
        t.read_completion_ts = Some(read_completion_ts);
        t.read_cvlan = Some(read_cvlan);
        t.read_flow_tag = Some(read_flow_tag);
        t.read_tm_info = Some(read_tm_info);
        t.read_completion_wallclock_ns = Some(read_completion_wallclock_ns);
        cq.cast()
    })
}

/// The private parts of a CQ of ours: its queue, its current completion, its connection. No
/// reference covers the `ibv_cq_ex` itself, which the app reads while we write `status` and
/// `wr_id` into it.
///
/// # Safety
/// `cq` must be a live CQ of ours.
unsafe fn parts<'a>(
    cq: *mut ibv_cq_ex,
) -> (&'a Mutex<CompQueue>, &'a Mutex<Option<Cqe>>, &'a Conn) {
    let v = cq.cast::<VCq>();
    // SAFETY: per the contract, v is a live VCq (it starts with its ibv_cq_ex).
    let q = unsafe { &(*v).q };
    // SAFETY: as above.
    let cur = unsafe { &(*v).cur };
    // SAFETY: as above; the context is written once at creation.
    let ctx = unsafe { (*cq).context };
    // SAFETY: the CQ's context outlives it.
    let conn = &unsafe { context(ctx) }.conn;
    (q, cur, conn)
}

/// Loads the completion at the head of the ring as the current one (after retiring the current
/// one, for `next_poll`); `ENOENT` if there is none.
fn load(cq: *mut ibv_cq_ex, retire_current: bool) -> c_int {
    guard(libc::EIO, || {
        if cq.is_null() {
            return libc::EINVAL;
        }
        // SAFETY: cq is ours and live (the app got it from create_cq_ex).
        let (q, cur, conn) = unsafe { parts(cq) };
        let (Ok(mut q), Ok(mut cur)) = (q.lock(), cur.lock()) else {
            return libc::EIO;
        };
        if retire_current && cur.is_some() {
            q.consume();
        }
        *cur = q.peek(&conn.region);
        let Some(c) = *cur else {
            // SAFETY: cq is ours and live.
            withdraw_if_empty(unsafe { &*cq.cast::<VCq>() }, cq, &q, conn);
            return libc::ENOENT;
        };
        // SAFETY: cq is live; the app reads these two fields after this call returns.
        unsafe { (*cq).status = c.status as c_uint };
        // SAFETY: as above.
        unsafe { (*cq).wr_id = c.wr_id };
        0
    })
}

extern "C" fn start_poll(cq: *mut ibv_cq_ex, attr: *mut ibv_poll_cq_attr) -> c_int {
    guard(libc::EIO, || {
        // SAFETY: attr is NULL or the app's.
        if !attr.is_null() && unsafe { (*attr).comp_mask } != 0 {
            return libc::EINVAL;
        }
        load(cq, false)
    })
}

extern "C" fn next_poll(cq: *mut ibv_cq_ex) -> c_int {
    load(cq, true)
}

extern "C" fn end_poll(cq: *mut ibv_cq_ex) {
    guard((), || {
        if cq.is_null() {
            return;
        }
        // SAFETY: cq is ours and live.
        let (q, cur, conn) = unsafe { parts(cq) };
        let (Ok(mut q), Ok(mut cur)) = (q.lock(), cur.lock()) else {
            return;
        };
        if cur.take().is_some() {
            q.consume();
        }
        q.publish(&conn.region);
        // SAFETY: cq is ours and live.
        withdraw_if_empty(unsafe { &*cq.cast::<VCq>() }, cq, &q, conn);
    })
}

/// A poll that left the CQ empty withdraws its events still queued (`cq_events`).
fn withdraw_if_empty(v: &VCq, cq: *mut ibv_cq_ex, q: &CompQueue, conn: &Conn) {
    if let Some(ch) = &v.channel {
        v.events.after_poll(cq as usize, &q.ring, &conn.region, ch);
    }
}

/// Reads a field of the current completion (0 when there is none).
fn cur<T: Default>(cq: *mut ibv_cq_ex, f: impl FnOnce(&Cqe) -> T) -> T {
    guard(T::default(), || {
        if cq.is_null() {
            return T::default();
        }
        // SAFETY: cq is ours and live.
        let (_, cur, _) = unsafe { parts(cq) };
        cur.lock()
            .ok()
            .and_then(|c| c.as_ref().map(f))
            .unwrap_or_default()
    })
}

extern "C" fn read_opcode(cq: *mut ibv_cq_ex) -> c_uint {
    cur(cq, |c| c.opcode as c_uint)
}

extern "C" fn read_vendor_err(cq: *mut ibv_cq_ex) -> u32 {
    cur(cq, |c| c.vendor_err)
}

extern "C" fn read_byte_len(cq: *mut ibv_cq_ex) -> u32 {
    cur(cq, |c| c.byte_len)
}

extern "C" fn read_imm_data(cq: *mut ibv_cq_ex) -> u32 {
    cur(cq, |c| c.imm_data)
}

extern "C" fn read_qp_num(cq: *mut ibv_cq_ex) -> u32 {
    cur(cq, |c| c.qp_num)
}

extern "C" fn read_src_qp(cq: *mut ibv_cq_ex) -> u32 {
    cur(cq, |c| c.src_qp)
}

extern "C" fn read_wc_flags(cq: *mut ibv_cq_ex) -> c_uint {
    cur(cq, |c| c_uint::from(c.wc_flags))
}

extern "C" fn read_slid(cq: *mut ibv_cq_ex) -> u32 {
    cur(cq, |c| u32::from(c.slid))
}

extern "C" fn read_sl(cq: *mut ibv_cq_ex) -> u8 {
    cur(cq, |c| c.sl)
}

extern "C" fn read_dlid_path_bits(_cq: *mut ibv_cq_ex) -> u8 {
    // No LMC: no path bits.
    guard(0, || 0)
}

extern "C" fn read_completion_ts(cq: *mut ibv_cq_ex) -> u64 {
    cur(cq, |c| c.timestamp_ns)
}

// The readers of fields a CQ cannot be created with here (creation with their wc_flags fails
// with EOPNOTSUPP): they answer 0, never garbage.

extern "C" fn read_cvlan(_cq: *mut ibv_cq_ex) -> u16 {
    guard(0, || 0)
}

extern "C" fn read_flow_tag(_cq: *mut ibv_cq_ex) -> u32 {
    guard(0, || 0)
}

extern "C" fn read_tm_info(_cq: *mut ibv_cq_ex, info: *mut ibv_wc_tm_info) {
    guard((), || {
        if !info.is_null() {
            // SAFETY: ibv_wc_tm_info is plain data; zero is valid.
            let zero: ibv_wc_tm_info = unsafe { std::mem::zeroed() };
            // SAFETY: info is the app's struct.
            unsafe { info.write(zero) };
        }
    })
}

extern "C" fn read_completion_wallclock_ns(_cq: *mut ibv_cq_ex) -> u64 {
    guard(0, || 0)
}

// ---- device clock ----------------------------------------------------------------------------

/// `verbs_context.query_rt_values` (the `ibv_query_rt_values_ex` inline): the raw clock is the
/// completion-timestamp clock, `CLOCK_MONOTONIC` nanoseconds, reported as mlx5 reports its
/// cycle counter (`tv_sec` 0, the count in `tv_nsec`).
pub extern "C" fn vrnic_query_rt_values(
    ctx: *mut ibv_context,
    values: *mut ibv_values_ex,
) -> c_int {
    guard(libc::EIO, || {
        if ctx.is_null() || values.is_null() {
            return libc::EINVAL;
        }
        // SAFETY: values is the app's struct.
        let want = unsafe { (*values).comp_mask };
        if want & !IBV_VALUES_MASK_RAW_CLOCK != 0 {
            return libc::EINVAL;
        }
        if want & IBV_VALUES_MASK_RAW_CLOCK != 0 {
            let clock = libc::timespec {
                tv_sec: 0,
                tv_nsec: crate::sys::monotonic_ns() as libc::c_long,
            };
            // SAFETY: as above.
            unsafe { (*values).raw_clock = clock };
        }
        // SAFETY: as above.
        unsafe { (*values).comp_mask = want };
        0
    })
}
