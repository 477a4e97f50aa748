//! The send and receive data path of a QP: `post_send` (every opcode of `ibv_send_wr`, encoded
//! into a send-ring slot) and `post_recv`, through the ops table.
#![allow(unsafe_code)]
#![allow(clippy::not_unsafe_ptr_arg_deref)]

use std::ffi::c_int;
use std::sync::atomic::Ordering;

use vrnic_wire::{
    InlineData, MAX_INLINE, MAX_SGE, SendFlags, SendOpcode, SendPayload, SendWqe, UdAddr,
};

use super::objects::{VQp, bind_fields, context, fail_at, guard, post_recv_list, sges};
use crate::abi::*;

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
            if !sq.has_room(&conn.region, 1) {
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
                match bind_fields(b.mw, b.rkey, &raw const b.bind_info) {
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
