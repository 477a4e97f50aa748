//! What a pass hands back to the apps: retired ring indices, completions written into CQ
//! rings (a CQ's slot, its ring full or broken, its arm word and the wake-up it calls for),
//! async events for the loop to hand on.

use crate::server::*;

use super::Shard;

impl Shard {
    /// Hands back what the engine produced: retired indices, completions, async events and
    /// the wake-ups they call for. Returns whether there was anything.
    pub(in crate::server) fn publish(&mut self) -> bool {
        let mut work = false;
        // Retired indices first, completions second: an app that sees a completion must also
        // see the ring slot it frees (perftest posts again as soon as it polls one).
        // Only the queues whose counters moved: idle ones cost nothing here.
        let (qps, srqs, vnics) = (&mut self.qps, &mut self.srqs, &self.lanes);
        self.engine.drain_retired(
            |qp, sq, rq| {
                let Some(slot) = qps.get_mut(&qp) else { return };
                let Some(v) = vnics.get(&slot.vnic) else {
                    return;
                };
                if sq != slot.sq_cons {
                    slot.sq_cons = sq;
                    slot.sq.cons(&v.region).store(sq, Ordering::Release);
                }
                if rq != slot.rq_cons {
                    slot.rq_cons = rq;
                    slot.rq.cons(&v.region).store(rq, Ordering::Release);
                }
            },
            |srq, r| {
                let Some(slot) = srqs.get_mut(&srq) else {
                    return;
                };
                let Some(v) = vnics.get(&slot.vnic) else {
                    return;
                };
                if r != slot.cons {
                    slot.cons = r;
                    slot.ring.cons(&v.region).store(r, Ordering::Release);
                }
            },
        );
        while let Some((cq, cqe, solicited)) = self.engine.poll_completion() {
            work = true;
            self.post_cqe(cq, &cqe, solicited);
        }
        while let Some((ctx, ev)) = self.engine.poll_event() {
            work = true;
            // An event the engine queued for an object destroyed since (a QP moved to ERR and
            // destroyed at once, as UCX does) is dropped: after `ibv_destroy_*` returns, no
            // event names the object, as the kernel guarantees.
            let (kind, handle, live) = match ev {
                vrnic_proto::Event::QpFatal { qp } => {
                    (vrnic_api::event::QP_FATAL, qp.0, self.qps.contains_key(&qp))
                }
                vrnic_proto::Event::CqError { cq } => {
                    (vrnic_api::event::CQ_ERR, cq.0, self.cqs.contains_key(&cq))
                }
                vrnic_proto::Event::SrqLimit { srq } => (
                    vrnic_api::event::SRQ_LIMIT_REACHED,
                    srq.0,
                    self.srqs.contains_key(&srq),
                ),
                vrnic_proto::Event::SrqError { srq } => (
                    vrnic_api::event::SRQ_ERR,
                    srq.0,
                    self.srqs.contains_key(&srq),
                ),
                vrnic_proto::Event::LastWqeReached { qp } => (
                    vrnic_api::event::QP_LAST_WQE_REACHED,
                    qp.0,
                    self.qps.contains_key(&qp),
                ),
            };
            if live {
                self.out.events.push((ctx, kind, handle));
            }
        }
        if self.engine.has_refusals() {
            // Bounded as the engine bounds its own list, whenever the loop drains it.
            let (list, n) = self.engine.take_refusals();
            let room = vrnic_proto::MAX_REFUSALS.saturating_sub(self.out.refused.len());
            self.out.refused.extend(list.into_iter().take(room));
            self.out.refused_n += n;
        }
        work
    }

    pub(in crate::server) fn post_cqe(&mut self, cq: CqId, cqe: &Cqe, solicited: bool) {
        let Some(cell) = self.cqs.get_mut(&cq) else {
            return;
        };
        let (lanes, out) = (&self.lanes, &mut self.out);
        cell.with(|slot| {
            let Some(v) = lanes.get(&slot.vnic) else {
                return;
            };
            if slot.broken {
                return;
            }
            let region = &v.region;
            let depth = slot.ring.depth();
            if slot.prod.wrapping_sub(slot.cons_seen) >= depth {
                slot.cons_seen = slot.ring.cons(region).load(Ordering::Acquire);
                if slot.prod.wrapping_sub(slot.cons_seen) >= depth {
                    // Overflow (or a garbage consumer index): the CQ is in error, as on a
                    // device.
                    warn!(cq = cq.0, "completion queue overrun; CQ in error");
                    slot.broken = true;
                    out.events.push((slot.ctx, vrnic_api::event::CQ_ERR, cq.0));
                    return;
                }
            }
            let mut raw = [0u8; CQ_SLOT];
            let stamped = Cqe {
                timestamp_ns: sys::monotonic_ns(),
                ..*cqe
            };
            stamped.encode(&mut raw);
            // The slot, then its sequence word (what the driver polls), then the index.
            slot.ring
                .write_slot_head(region, slot.prod, &raw[..CQE_SEQ]);
            slot.ring
                .slot_word(region, slot.prod, CQE_SEQ)
                .store(vrnic_wire::cqe_seq(slot.prod), Ordering::Release);
            slot.prod = slot.prod.wrapping_add(1);
            slot.ring.prod(region).store(slot.prod, Ordering::Release);
            // Store-then-load against the driver's arm-then-poll: without a full fence both
            // sides could miss each other (the CQE unseen by the poll, the arm unseen here).
            fence(Ordering::SeqCst);
            // Arm word: 1 = next completion, 2 = next solicited completion.
            let arm = slot.ring.arm(region);
            let a = arm.load(Ordering::Acquire);
            if (a == 1 || (a == 2 && solicited))
                && arm
                    .compare_exchange(a, 0, Ordering::AcqRel, Ordering::Acquire)
                    .is_ok()
            {
                let n = slot.ring.notify(region).fetch_add(1, Ordering::AcqRel);
                tracing::trace!(cq = cq.0, notify = n + 1, "CQ event");
                out.wakes.push(slot.ctx);
            }
        });
    }
}
