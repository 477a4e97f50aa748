//! Completion channels and CQs: `ibv_create_comp_channel`, `ibv_create_cq`/`ibv_destroy_cq`,
//! `ibv_get_cq_event`/`ibv_ack_cq_events`, and the data path's `req_notify_cq` and `poll_cq`
//! (through the ops table).
#![allow(unsafe_code)]
#![allow(clippy::not_unsafe_ptr_arg_deref)]

use std::ffi::{c_int, c_uint, c_void};
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};

use vrnic_api::{Reply, Request};
use vrnic_shm::Ring;
use vrnic_wire::CQ_SLOT;

use super::objects::{CQ_EVENTS, VChannel, VCq, context, guard, minus_one, null_err};
use crate::abi::*;
use crate::client::{Channel, CompQueue};
use crate::limits;
use crate::sys;

#[unsafe(no_mangle)]
pub extern "C" fn vrnic_ibv_create_comp_channel(ctx: *mut ibv_context) -> *mut ibv_comp_channel {
    guard(null_err(libc::EIO), || {
        create_comp_channel(ctx).unwrap_or_else(null_err)
    })
}

/// `ibv_create_comp_channel`, for the driver's own callers.
pub(crate) fn create_comp_channel(ctx: *mut ibv_context) -> Result<*mut ibv_comp_channel, c_int> {
    if ctx.is_null() {
        return Err(libc::EINVAL);
    }
    let efd = match sys::EventFd::new() {
        Ok(e) => e,
        Err(e) => return Err(e.raw_os_error().unwrap_or(libc::EMFILE)),
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
    Ok(Box::into_raw(Box::new(VChannel { ch, chan })).cast())
}

#[unsafe(no_mangle)]
pub extern "C" fn vrnic_ibv_destroy_comp_channel(ch: *mut ibv_comp_channel) -> c_int {
    guard(libc::EIO, || destroy_comp_channel(ch).err().unwrap_or(0))
}

/// `ibv_destroy_comp_channel`, for the driver's own callers.
pub(crate) fn destroy_comp_channel(ch: *mut ibv_comp_channel) -> Result<(), c_int> {
    if ch.is_null() {
        return Err(libc::EINVAL);
    }
    // SAFETY: ch is ours and live.
    if unsafe { (*ch).refcnt } > 0 {
        return Err(libc::EBUSY);
    }
    // SAFETY: boxed by create_comp_channel; the app gives it up now.
    drop(unsafe { Box::from_raw(ch.cast::<VChannel>()) });
    Ok(())
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
        create_cq(ctx, cqe, cq_context, channel, comp_vector).unwrap_or_else(null_err)
    })
}

/// `ibv_create_cq`, for the driver's own callers (`ibv_create_cq_ex`, the connection manager).
pub(crate) fn create_cq(
    ctx: *mut ibv_context,
    cqe: c_int,
    cq_context: *mut c_void,
    channel: *mut ibv_comp_channel,
    comp_vector: c_int,
) -> Result<*mut ibv_cq, c_int> {
    if ctx.is_null() {
        return Err(libc::EINVAL);
    }
    // SAFETY: ctx is ours.
    let c = unsafe { context(ctx) };
    limits::check_cq(&c.conn.info, cqe.into(), comp_vector.into())?;
    let (h, ring_off, depth) = match c.conn.call(&Request::CreateCq { cqe: cqe as u32 }) {
        Ok(Reply::Cq { cq, ring, depth }) => (cq, ring, depth),
        Ok(_) => return Err(libc::EPROTO),
        Err(e) => return Err(e),
    };
    let Ok(ring) = Ring::new(&c.conn.region, ring_off, depth, CQ_SLOT) else {
        let _ = c.conn.call(&Request::DestroyCq { cq: h });
        return Err(libc::EPROTO);
    };
    // SAFETY: channel is NULL or one of ours.
    let chan = (!channel.is_null()).then(|| unsafe { (*channel.cast::<VChannel>()).chan.clone() });
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
        q: Mutex::new(CompQueue::new(ring)),
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
    Ok(p.cast())
}

#[unsafe(no_mangle)]
pub extern "C" fn vrnic_ibv_destroy_cq(cq: *mut ibv_cq) -> c_int {
    guard(libc::EIO, || destroy_cq(cq).err().unwrap_or(0))
}

/// `ibv_destroy_cq`, for the driver's own callers.
pub(crate) fn destroy_cq(cq: *mut ibv_cq) -> Result<(), c_int> {
    if cq.is_null() {
        return Err(libc::EINVAL);
    }
    // SAFETY: cq is ours and live.
    let cqr = unsafe { &*cq };
    let (ctx, h, channel) = (cqr.context, cqr.handle, cqr.channel);
    // SAFETY: the CQ's context outlives it.
    let c = unsafe { context(ctx) };
    c.conn.call(&Request::DestroyCq { cq: h })?;
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
    Ok(())
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
        // Only a poll that took completions can have emptied the CQ: one that found it empty
        // published nothing, and the poll that last did ran this already (a fence per empty
        // poll: a third of an empty poll's cost, and UCX polls four CQs a round).
        if got > 0
            && let Some(ch) = &v.channel
        {
            v.events.after_poll(cq as usize, &q.ring, &conn.region, ch);
        }
        got as c_int
    })
}
