//! Async events: `ibv_get_async_event` (each naming a live object, or skipped) and
//! `ibv_ack_async_event`.
#![allow(unsafe_code)]
#![allow(clippy::not_unsafe_ptr_arg_deref)]

use std::collections::HashMap;
use std::ffi::c_int;
use std::sync::Mutex;

use super::objects::{CQ_EVENTS, QP_EVENTS, SRQ_EVENTS, context, guard, minus_one};
use crate::abi::*;

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
