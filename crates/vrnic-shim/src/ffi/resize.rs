//! `ibv_resize_cq`: the CQ's ring moves to one of the new depth, carved by the daemon, with
//! the completions not yet polled in it at the same indices (so the driver's consumer index
//! stays valid). The CQ is held for the whole call: no poll runs while the ring moves, and the
//! consumer index the daemon reads is published first. (SRQ resizing is in `srq`.)
#![allow(unsafe_code)]

use std::ffi::c_int;

use vrnic_api::{Reply, Request};
use vrnic_shm::Ring;
use vrnic_wire::CQ_SLOT;

use super::objects::{VCq, context, guard};
use crate::abi::*;

/// `ibv_resize_cq`: `cqe` in `1..=max_cqe` and not below the completions waiting to be
/// polled, else `EINVAL` (as rxe; the daemon checks both again). On success `cq->cqe` is the
/// new depth (a power of two, at least `cqe`).
#[unsafe(no_mangle)]
pub extern "C" fn vrnic_ibv_resize_cq(cq: *mut ibv_cq, cqe: c_int) -> c_int {
    guard(libc::EIO, || {
        if cq.is_null() {
            return libc::EINVAL;
        }
        // SAFETY: cq is one of ours (every CQ we hand out is a VCq) and live per the API.
        let v = unsafe { &*cq.cast::<VCq>() };
        // SAFETY: the CQ's context outlives it.
        let c = unsafe { context(v.cq.context) };
        if let Err(e) = crate::limits::check_cq(&c.conn.info, cqe.into(), 0) {
            return e;
        }
        let Ok(mut q) = v.q.lock() else {
            return libc::EIO;
        };
        q.publish(&c.conn.region);
        let h = v.cq.handle;
        let req = Request::ResizeCq {
            cq: h,
            cqe: cqe as u32,
        };
        let moved = c.conn.move_watch(cq as usize, || {
            let ring = match c.conn.call(&req) {
                Ok(Reply::Cq { ring, depth, .. }) => {
                    Ring::new(&c.conn.region, ring, depth, CQ_SLOT).map_err(|_| libc::EPROTO)
                }
                Ok(_) => Err(libc::EPROTO),
                Err(e) => Err(e),
            };
            let to_watch = ring.as_ref().ok().copied();
            (ring, to_watch)
        });
        match moved {
            Ok(ring) => {
                q.ring = ring;
                // SAFETY: the app reads `cqe` of its CQ, which is ours to update during a
                // verbs call on it (rdma-core's providers do the same).
                unsafe { (*cq).cqe = ring.depth() as c_int };
                0
            }
            Err(e) => e,
        }
    })
}
