//! Resizing queues whose rings live in the region: `ibv_resize_cq` and `ibv_modify_srq` with
//! `IBV_SRQ_MAX_WR`. A ring cannot grow in place (the heap carves it in one piece), so a
//! resize carves a new ring, moves what the old one holds that still matters, and frees the
//! old one. Ring indices are free running and stay as they were: only the mask changes, so
//! neither side's private index needs translating.
//!
//! The driver holds the queue (no poll, no post) from before its request until it has the
//! answer; everything read from the region here is still checked, as a hostile driver may
//! not hold it.

use super::*;

impl Server {
    /// `ibv_resize_cq`: `cqe` in `1..=MAX_CQE`, and at least the completions waiting in the
    /// ring (rxe's `rxe_cq_chk_attr`: `EINVAL` otherwise; a CQ in error cannot be resized
    /// either). The waiting completions are copied to the new ring at the same indices; the
    /// arm word and the notification count go with them, so an armed CQ stays armed and the
    /// driver's notifier sees no spurious event.
    pub(super) fn resize_cq(&mut self, id: CtxId, cq: CqId, cqe: u32) -> Reply {
        if !self.ctxs.get(&id).is_some_and(|c| c.cqs.contains(&cq)) {
            return err(libc::EINVAL, "no such CQ");
        }
        if cqe == 0 || cqe > control::MAX_CQE {
            return err(
                libc::EINVAL,
                format!("cqe {cqe} outside 1..={}", control::MAX_CQE),
            );
        }
        let Some(vnic) = self.ctxs.get(&id).map(|c| c.vnic) else {
            return err(libc::ENODEV, "vRNIC gone");
        };
        // A new ring may grow the region's mapping: every shard reading it is held.
        let cells = self.slices_of(vnic);
        let mut guards = Slices::lock(vnic, &cells);
        let (grow, shards) = guards.split();
        let Some(home) = shards.first_mut() else {
            return err(libc::ENODEV, "vRNIC gone");
        };
        let Some(cell) = home.cqs.get_mut(&cq) else {
            return err(libc::EINVAL, "no such CQ");
        };
        cell.with(|slot| self.resize_cq_slot(grow, cq, cqe, slot))
    }

    /// [`Server::resize_cq`] on the CQ's slot, its shards held (`grow`).
    fn resize_cq_slot(&mut self, grow: Grow<'_>, cq: CqId, cqe: u32, slot: &mut CqSlot) -> Reply {
        let Some(v) = self.vnics.get_mut(&slot.vnic) else {
            return err(libc::ENODEV, "vRNIC gone");
        };
        if slot.broken {
            return err(libc::EINVAL, "the CQ is in error");
        }
        let old = slot.ring;
        let cons = old.cons(&v.region).load(Ordering::Acquire);
        let waiting = slot.prod.wrapping_sub(cons);
        if waiting > old.depth() {
            return err(libc::EINVAL, "the CQ's consumer index is past its producer");
        }
        if cqe < waiting {
            return err(
                libc::EINVAL,
                format!("cqe {cqe} below the {waiting} completions waiting"),
            );
        }
        let depth = cqe.next_power_of_two();
        if depth == old.depth() {
            return Reply::Cq {
                cq: cq.0,
                ring: old.offset(),
                depth,
            };
        }
        let Some(ring) = alloc_ring(grow, slot.vnic, v, depth, CQ_SLOT) else {
            return err(libc::ENOMEM, "no memory for the CQ ring");
        };
        let region = &v.region;
        let mut raw = [0u8; CQ_SLOT];
        for k in 0..waiting {
            let i = cons.wrapping_add(k);
            old.read_slot(region, i, &mut raw);
            ring.write_slot(region, i, &raw);
        }
        ring.cons(region).store(cons, Ordering::Release);
        ring.arm(region)
            .store(old.arm(region).load(Ordering::Acquire), Ordering::Release);
        ring.notify(region).store(
            old.notify(region).load(Ordering::Acquire),
            Ordering::Release,
        );
        ring.prod(region).store(slot.prod, Ordering::Release);
        slot.ring = ring;
        free_ring(v, old.offset(), old.depth(), CQ_SLOT);
        debug!(cq = cq.0, depth, waiting, "CQ resized");
        Reply::Cq {
            cq: cq.0,
            ring: ring.offset(),
            depth,
        }
    }

    /// `ibv_modify_srq`. With a resize, every receive the driver published goes into the
    /// engine first (the engine checks the new size against them); then the ring, now
    /// holding nothing the engine has not taken, is replaced by one of the new depth whose
    /// producer and consumer words carry on from the old ones.
    pub(super) fn modify_srq(
        &mut self,
        id: CtxId,
        srq: SrqId,
        resize: Option<u32>,
        limit: Option<u32>,
    ) -> Reply {
        if !self.ctxs.get(&id).is_some_and(|c| c.srqs.contains(&srq)) {
            return err(libc::EINVAL, "no such SRQ");
        }
        // A new ring may grow the region's mapping: every shard reading it is held (the SRQ
        // is its vRNIC's home shard's, the first).
        let Some(vnic) = self.ctxs.get(&id).map(|c| c.vnic) else {
            return err(libc::ENODEV, "vRNIC gone");
        };
        let cells = self.slices_of(vnic);
        let mut guards = Slices::lock(vnic, &cells);
        let (grow, shards) = guards.split();
        let Some(sh) = shards.first_mut() else {
            return err(libc::ENODEV, "vRNIC gone");
        };
        let sh = &mut **sh;
        // A bounded loop: each round takes up to a batch, and the engine's room is at most the
        // SRQ's depth.
        for _ in 0..=(control::MAX_QP_WR / shard::RING_BATCH) {
            if !sh.fetch_srq(srq) {
                break;
            }
        }
        let Some(slot) = sh.srqs.get(&srq) else {
            return err(libc::EINVAL, "no such SRQ");
        };
        let Some(v) = self.vnics.get(&slot.vnic) else {
            return err(libc::ENODEV, "vRNIC gone");
        };
        let prod = slot.ring.prod(&v.region).load(Ordering::Acquire);
        let retired = sh.engine.srq_retired(srq);
        if let Some(max_wr) = resize {
            // Receives posted and not yet completed, counted as the driver counts them (one
            // being filled by a message in progress included).
            if slot.broken || prod != slot.fetched {
                return err(libc::EINVAL, "the SRQ is in error");
            }
            if slot.fetched.wrapping_sub(retired) > max_wr {
                return err(libc::EINVAL, "max_wr below the receives outstanding");
            }
        }
        let vnic = slot.vnic;
        // A new ring when the depth changes, carved before the engine commits to the size.
        let ring = match resize {
            Some(max_wr) if max_wr > 0 && max_wr <= control::MAX_QP_WR => {
                let depth = max_wr.next_power_of_two();
                if depth == slot.ring.depth() {
                    None
                } else {
                    let Some(v) = self.vnics.get_mut(&vnic) else {
                        return err(libc::ENODEV, "vRNIC gone");
                    };
                    let Some(r) = alloc_ring(grow, vnic, v, depth, RQ_SLOT) else {
                        return err(libc::ENOMEM, "no memory for the SRQ ring");
                    };
                    Some(r)
                }
            }
            _ => None,
        };
        let depth = match sh.engine.modify_srq(id, srq, resize, limit) {
            Ok(d) => d,
            Err(e) => {
                if let (Some(r), Some(v)) = (ring, self.vnics.get_mut(&vnic)) {
                    free_ring(v, r.offset(), r.depth(), RQ_SLOT);
                }
                return err(e, "modify_srq");
            }
        };
        let Some(max_wr) = resize else {
            return Reply::Ok;
        };
        let (Some(slot), Some(v)) = (sh.srqs.get_mut(&srq), self.vnics.get_mut(&vnic)) else {
            return err(libc::EINVAL, "no such SRQ");
        };
        if let Some(ring) = ring {
            debug_assert_eq!(ring.depth(), depth);
            ring.cons(&v.region).store(retired, Ordering::Release);
            ring.prod(&v.region).store(slot.fetched, Ordering::Release);
            let old = slot.ring;
            slot.ring = ring;
            slot.cons = retired;
            free_ring(v, old.offset(), old.depth(), RQ_SLOT);
        }
        debug!(srq = srq.0, max_wr, depth, "SRQ resized");
        Reply::Srq {
            srq: srq.0,
            ring: slot.ring.offset(),
            depth: slot.ring.depth(),
            bell: slot.bell,
            srqn: sh.engine.srq_num(id, srq).unwrap_or(0),
        }
    }
}
