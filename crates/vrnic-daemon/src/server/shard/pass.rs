//! A shard's engine pass: new work requests taken from the rings whose doorbells rang (or
//! that are watched), copied out once, parsed and handed to the engine; engine turns, each
//! followed by its frames for other hosts ([`Frames`]) and what it produced
//! (`publish.rs`); the doorbells looked at again between turns; the engine-sleeping word.

use crate::server::*;

use super::{Bell, Lane, Mem, QpSlot, Shard, SiblingShards};
use vrnic_proto::{HostId, NoSiblings, PASS_BYTES, PASS_WRS, Sender};
use vrnic_wire::frame::FrameRepr;

/// Where a pass puts the frames its engine made for other hosts: the peer links (the loop's
/// pass of the one shard), or the channel to the loop (an engine thread's pass, a control
/// call's).
pub(in crate::server) trait Frames {
    /// Takes every frame `engine` has to send (`mem` reads their payloads). Returns whether
    /// anything was sent.
    fn send(&mut self, engine: &mut Engine, mem: &mut Mem<'_>) -> bool;
}

/// No links: a frame (a route to another host cannot exist) is dropped.
pub(in crate::server) struct NoFrames;

impl Frames for NoFrames {
    fn send(&mut self, engine: &mut Engine, _: &mut Mem<'_>) -> bool {
        while engine.poll_transmit().is_some() {}
        false
    }
}

/// How many new work requests to take from a send or receive ring now. The producer index
/// comes from the region (hostile): more outstanding entries than the ring holds is an error.
pub(in crate::server) fn pending(
    ring: &Ring,
    region: &Region,
    fetched: u32,
    retired: u32,
    room: u32,
) -> Result<u32, vrnic_wire::ParseError> {
    let prod = ring.prod(region).load(Ordering::Acquire);
    if prod.wrapping_sub(retired) > ring.depth() || prod.wrapping_sub(fetched) > ring.depth() {
        return Err(vrnic_wire::ParseError::ProducerIndex(prod));
    }
    Ok(prod.wrapping_sub(fetched).min(room).min(RING_BATCH))
}

/// Which queues a look at the doorbells takes new work from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Look {
    /// Every vRNIC's, and the rings carried over with more than one look takes.
    Full,
    /// Only vRNICs with no turn waiting in the engine.
    Newcomers,
}

/// Ring slots whose first lines are asked for ahead of the one being parsed: the app's core
/// wrote them, so each is a miss; asked for together, their misses overlap.
const PREFETCH: u32 = 8;

/// Before taking slot `next`, the `i`th of `n` to take now: asks for the first `lines` lines
/// of the slot [`PREFETCH`] ahead (at the first, of every slot up to there).
fn prefetch_ahead(ring: &Ring, region: &Region, next: u32, i: u32, n: u32, lines: usize) {
    let from = if i == 0 { 1 } else { PREFETCH };
    for k in from..=PREFETCH.min(n - 1 - i) {
        ring.prefetch_slot(region, next.wrapping_add(k), lines);
    }
}

/// Work requests taken from one ring per look.
pub(in crate::server) const RING_BATCH: u32 = 64;

/// Most QPs the engine watches at once: looks at their rings every pass, having told their
/// drivers (the rings' `POLLED` words) that no doorbell is needed. A doorbell costs a driver
/// three words the engine took back after its last pass, each a cache line to fetch from the
/// engine's core, on every post; a watched ring costs the engine one load per look. Bounded
/// so that a tenant with many busy QPs cannot make every look long: past the bound, QPs ring.
pub(in crate::server) const WATCH_MAX: usize = 256;
/// A watched QP without new work for this long goes back to doorbells.
pub(in crate::server) const WATCH_IDLE: Duration = Duration::from_micros(200);

/// Among busy tenants only, looks at the doorbells take about this fraction (1/16) of the pass
/// (each look is a header page per vRNIC to walk to after the copies have gone through the
/// TLB, and a cache line to take back from every app that posts): 32 bulk pairs lost a fifth
/// of their bandwidth to looks spaced by eight looks' time. A newcomer then waits a few turns;
/// from its first turn on, it is a light tenant and looks come after every turn.
pub(in crate::server) const LOOK_SHARE: u32 = 16;
/// What a turn is taken to last, to count dear looks' spacing in turns (a 64 KiB turn copies
/// in about 2 us here).
pub(in crate::server) const TURN_NOMINAL: Duration = Duration::from_micros(2);
/// A look at the rings is timed once in this many passes with turns; the others take that
/// time (it changes with the vRNICs and their apps' posting, over many passes).
pub(in crate::server) const LOOK_RETIME: u32 = 16;

impl Shard {
    /// A segment frame (decoded) that came from `host`, its payload `body`, to the engine.
    pub(in crate::server) fn take_segment(
        &mut self,
        now: Instant,
        host: HostId,
        repr: FrameRepr,
        body: &[u8],
    ) {
        let FrameRepr::Segment { addr, grh, segment } = repr else {
            return;
        };
        if segment.opcode.op().takes_receive() {
            self.fetch_receives(now, segment.dest_qpn);
        }
        let from = Sender {
            addr,
            grh: grh.as_ref(),
        };
        let mem = &mut Mem::new(&self.lanes);
        self.engine
            .handle_segment(now, host, from, &segment, body, mem);
    }

    /// Before a segment that takes a receive reaches QP `qpn` from another host, or a request
    /// of another engine thread's pass does (`siblings.rs`): if the engine has no receive of it
    /// taken in, the receives the app posted are taken from their ring now. The app may have
    /// posted them, then told its peer to send, while this engine was not running: they must
    /// be there for the message, as on a device, which the engine would otherwise drop (UD,
    /// UC) or answer with RNR (RC).
    pub(in crate::server) fn fetch_receives(&mut self, now: Instant, qpn: u32) {
        match self.engine.receives_wanted(qpn) {
            Some((_, Some(srq))) => {
                self.fetch_srq(srq);
            }
            Some((qp, None)) => {
                let mut work = false;
                if self.fetch_qp(now, qp, &mut work) {
                    self.carry_on(Bell::Qp(qp));
                }
            }
            None => {}
        }
    }

    pub(in crate::server) fn set_sleeping(&mut self, on: bool) {
        self.sleeping = on;
        // A slice's engine-sleeping word is its home's: the home takes its doorbells.
        for v in self.lanes.values().filter(|v| v.inbox.is_none()) {
            if let Ok(w) = v.region.atomic_u32(hdr::ENGINE_SLEEPING) {
                w.store(u32::from(on), Ordering::SeqCst);
            }
        }
        fence(Ordering::SeqCst);
    }

    /// One engine pass: new work requests into the engine (from the queues whose doorbells
    /// rang, and those that had more than one fetch takes: no other ring is looked at), then
    /// engine turns, each followed by its completions and retired indices, up to
    /// [`PASS_WRS`]/[`PASS_BYTES`]. Between turns the doorbells of vRNICs without work are
    /// looked at again (after every turn while a light tenant competes, see
    /// [`LOOK_SHARE`]), so a vRNIC whose work arrives while another floods goes next: it waits
    /// for the turn under way, not for the rest of the pass. Frames the engine made for other
    /// hosts (or shards) go to `frames` after the turn that made them, not at the end of the
    /// pass: the link carries a steady stream, not bursts. Returns whether anything happened.
    pub(in crate::server) fn engine_pass(
        &mut self,
        now: Instant,
        frames: &mut dyn Frames,
        mut sibs: Option<&mut SiblingShards<'_>>,
    ) -> bool {
        // What a look costs grows with the vRNICs (a header page each, and a cache line to
        // take back from every app that posts). Timed from `now`, which the caller has just
        // read, and only when turns follow: an idle pass reads no clock of its own (a clock
        // read is a good part of an idle pass, which is what a new request waits for).
        let mut work = self.take_new_work(now, Look::Full);
        self.engine.handle_timeout(now);
        let look = if work || self.engine.has_turns() {
            if self.look_age == 0 {
                self.look_cost = now.elapsed();
            }
            self.look_age = (self.look_age + 1) % LOOK_RETIME;
            self.look_cost
        } else {
            Duration::ZERO
        };
        // Turns between looks (counted in turns of nominal length, so that no turn reads the
        // clock): while a light tenant competes, after every turn unless a look costs more
        // than a turn; among busy tenants only, few enough that looking takes at most about
        // 1/LOOK_SHARE of the pass.
        let share = if self.engine.light_tenant_competes() {
            1
        } else {
            LOOK_SHARE
        };
        let every = (look * share)
            .div_duration_f64(TURN_NOMINAL)
            .ceil()
            .max(1.0) as u32;
        self.list_light();
        let (mut wrs, mut bytes, mut since) = (0usize, 0u64, 0u32);
        while wrs < PASS_WRS && bytes < PASS_BYTES {
            let mem = &mut Mem::new(&self.lanes);
            let mut peek = Peek {
                lanes: &self.lanes,
                qps: &self.qps,
                light_lanes: &self.light_lanes,
                light_qps: &self.light_qps,
            };
            let turn = match sibs.as_deref_mut() {
                Some(s) => self
                    .engine
                    .turn_with(now, mem, &mut s.reach(&self.lanes), &mut peek),
                None => self.engine.turn_with(now, mem, &mut NoSiblings, &mut peek),
            };
            let Some(t) = turn else {
                break;
            };
            work |= t.did;
            wrs += t.wrs;
            bytes = bytes.saturating_add(t.bytes);
            // Frames before completions: a UD or UC send completes when its frame is made,
            // and its buffer is the app's again once the completion is seen, so the frame
            // must have read it by then.
            if self.engine.has_transmit() {
                work |= frames.send(&mut self.engine, &mut Mem::new(&self.lanes));
            }
            work |= self.publish();
            if let Some(s) = sibs.as_deref_mut() {
                work |= s.publish();
            }
            since += 1;
            if since >= every {
                since = 0;
                work |= self.take_new_work(now, Look::Newcomers);
            }
        }
        self.wrs += wrs as u64;
        work | self.publish()
    }

    /// Lists the light tenants' home lanes and watched QPs for [`Peek`], if a light tenant
    /// competes (else none: turns are long and nothing is asked between their steps).
    fn list_light(&mut self) {
        self.light_lanes.clear();
        self.light_qps.clear();
        if !self.engine.light_tenant_competes() {
            return;
        }
        let lanes = &self.lanes;
        self.light_lanes.extend(
            self.engine
                .light_vnics()
                .filter(|id| lanes.get(id).is_some_and(|v| v.inbox.is_none())),
        );
        if self.light_lanes.is_empty() {
            return;
        }
        let (qps, light) = (&self.qps, &self.light_lanes);
        self.light_qps
            .extend(self.watched.iter().copied().filter(|qp| {
                qps.get(qp)
                    .is_some_and(|s| !s.broken && light.contains(&s.vnic))
            }));
    }

    /// New work requests into the engine, at most [`RING_BATCH`] per ring: from the queues
    /// whose doorbells rang and those carried over from the last look ([`Look::Full`]), or
    /// only from vRNICs with no turn waiting ([`Look::Newcomers`]: between turns, to let a
    /// newcomer go next; the others' rings, whose lines their apps keep writing, wait for the
    /// next pass). Returns whether anything was taken.
    fn take_new_work(&mut self, now: Instant, look: Look) -> bool {
        let mut work = false;
        let mut dirty = std::mem::take(&mut self.dirty);
        dirty.clear();
        if look == Look::Full {
            dirty.append(&mut self.carry);
        }
        self.look_watched(now, look, &mut dirty);
        for (&id, v) in &self.lanes {
            if look == Look::Newcomers && self.engine.has_turn_waiting(id) {
                continue;
            }
            if let Some(inbox) = &v.inbox {
                // A slice: its doorbells come from the vRNIC's home shard.
                inbox.drain(|i| {
                    if let Some(Some(b)) = v.bells.get(i as usize) {
                        dirty.push(*b);
                    }
                });
                continue;
            }
            // Shards with a slice of this vRNIC to wake (bits by shard index; at most 64).
            let mut woken = 0u64;
            vrnic_shm::bell::drain(&v.region, |i| match v.bells.get(i as usize) {
                Some(Some(Bell::Elsewhere(k))) => {
                    if let Some(sl) = v.slices.iter().find(|sl| sl.shard == *k) {
                        sl.inbox.put(i);
                        woken |= 1 << (k % 64);
                    }
                }
                Some(Some(b)) => dirty.push(*b),
                _ => {}
            });
            if woken != 0 {
                for sl in &v.slices {
                    if woken & (1 << (sl.shard % 64)) != 0
                        && let Some(cell) = sl.cell.upgrade()
                    {
                        cell.wake();
                    }
                }
            }
        }
        for &b in &dirty {
            let more = match b {
                Bell::Qp(qp) => self.fetch_qp(now, qp, &mut work),
                Bell::Srq(srq) => {
                    work |= self.fetch_srq(srq);
                    self.srq_has_more(srq)
                }
                Bell::Pending | Bell::Elsewhere(_) => false,
            };
            if more {
                self.carry_on(b);
            }
        }
        self.dirty = dirty;
        work
    }

    /// Adds the watched QPs with new work in their rings to `dirty` (for [`Look::Newcomers`],
    /// only those of vRNICs with no turn waiting). A watched QP idle for [`WATCH_IDLE`] goes
    /// back to doorbells: its `POLLED` words cleared, a fence, then its producer indices read
    /// once more (pairing with the driver's store, fence, read of `POLLED`), so work posted
    /// meanwhile is taken now. A QP gone or broken leaves the list.
    fn look_watched(&mut self, now: Instant, look: Look, dirty: &mut Vec<Bell>) {
        let (qps, vnics, engine) = (&mut self.qps, &self.lanes, &self.engine);
        self.watched.retain(|&qp| {
            let Some(slot) = qps.get_mut(&qp) else {
                return false;
            };
            let Some(v) = vnics.get(&slot.vnic) else {
                slot.watched = None;
                return false;
            };
            if look == Look::Newcomers && engine.has_turn_waiting(slot.vnic) {
                return true;
            }
            let region = &v.region;
            let fresh = |s: &QpSlot| {
                s.sq.prod(region).load(Ordering::Acquire) != s.sq_fetched
                    || s.rq.prod(region).load(Ordering::Acquire) != s.rq_fetched
            };
            if !slot.broken {
                if fresh(slot) {
                    dirty.push(Bell::Qp(qp));
                    return true;
                }
                if slot
                    .watched
                    .is_some_and(|t| now.saturating_duration_since(t) < WATCH_IDLE)
                {
                    return true;
                }
            }
            slot.watched = None;
            slot.sq.polled(region).store(0, Ordering::SeqCst);
            slot.rq.polled(region).store(0, Ordering::SeqCst);
            fence(Ordering::SeqCst);
            if fresh(slot) {
                dirty.push(Bell::Qp(qp));
            }
            false
        });
    }

    /// Takes new work requests from a QP's send and receive rings into the engine (copied out
    /// once, parsed, handed over; at most [`RING_BATCH`] per ring). Returns whether a ring still
    /// holds more.
    fn fetch_qp(&mut self, now: Instant, qp: QpId, work: &mut bool) -> bool {
        let Some(slot) = self.qps.get_mut(&qp) else {
            return false;
        };
        slot.carried = false;
        if slot.broken {
            return false;
        }
        let Some(v) = self.lanes.get(&slot.vnic) else {
            return false;
        };
        let region = &v.region;
        let mut sq_slot = [0u8; SQ_SLOT];
        let mut rq_slot = [0u8; RQ_SLOT];
        let taken = (slot.sq_fetched, slot.rq_fetched);
        let room = self.engine.sq_room(qp);
        match pending(
            &slot.sq,
            region,
            slot.sq_fetched,
            self.engine.sq_retired(qp),
            room,
        ) {
            Ok(n) => {
                for i in 0..n {
                    prefetch_ahead(&slot.sq, region, slot.sq_fetched, i, n, 2);
                    // Only the bytes the WQE uses: its header, then what the header names.
                    let (head, body) = sq_slot.split_at_mut(SQ_HEADER);
                    slot.sq.read_slot_at(region, slot.sq_fetched, 0, head);
                    let used = SendWqe::used((&*head).try_into().expect("a header"));
                    let body = &mut body[..used - SQ_HEADER];
                    slot.sq
                        .read_slot_at(region, slot.sq_fetched, SQ_HEADER, body);
                    slot.sq_fetched = slot.sq_fetched.wrapping_add(1);
                    self.engine
                        .handle_send_wqe(now, qp, SendWqe::parse(&sq_slot));
                    *work = true;
                }
            }
            Err(e) => {
                warn!(qp = qp.0, "send ring: {e}; failing the QP");
                slot.broken = true;
                self.engine.handle_send_wqe(now, qp, Err(e));
                *work = true;
                return false;
            }
        }
        let room = self.engine.rq_room(qp);
        match pending(
            &slot.rq,
            region,
            slot.rq_fetched,
            self.engine.rq_retired(qp),
            room,
        ) {
            Ok(n) => {
                for i in 0..n {
                    prefetch_ahead(&slot.rq, region, slot.rq_fetched, i, n, 1);
                    let (head, body) = rq_slot.split_at_mut(RQ_HEADER);
                    slot.rq.read_slot_at(region, slot.rq_fetched, 0, head);
                    let used = RecvWqe::used((&*head).try_into().expect("a header"));
                    let body = &mut body[..used - RQ_HEADER];
                    slot.rq
                        .read_slot_at(region, slot.rq_fetched, RQ_HEADER, body);
                    slot.rq_fetched = slot.rq_fetched.wrapping_add(1);
                    self.engine
                        .handle_recv_wqe(now, qp, RecvWqe::parse(&rq_slot));
                    *work = true;
                }
            }
            Err(e) => {
                warn!(qp = qp.0, "receive ring: {e}; failing the QP");
                slot.broken = true;
                self.engine.handle_recv_wqe(now, qp, Err(e));
                *work = true;
                return false;
            }
        }
        if taken != (slot.sq_fetched, slot.rq_fetched) {
            // Busy: watched from now on (if there is room), its drivers told to skip the
            // doorbell.
            if slot.watched.is_some() {
                slot.watched = Some(now);
            } else if self.watched.len() < WATCH_MAX {
                slot.sq.polled(region).store(1, Ordering::SeqCst);
                slot.rq.polled(region).store(1, Ordering::SeqCst);
                slot.watched = Some(now);
                self.watched.push(qp);
            }
        }
        slot.sq.prod(region).load(Ordering::Acquire) != slot.sq_fetched
            || slot.rq.prod(region).load(Ordering::Acquire) != slot.rq_fetched
    }

    /// Whether an SRQ's ring holds receives not taken yet.
    fn srq_has_more(&mut self, srq: SrqId) -> bool {
        let Some(slot) = self.srqs.get_mut(&srq) else {
            return false;
        };
        slot.carried = false;
        let Some(v) = self.lanes.get(&slot.vnic) else {
            return false;
        };
        !slot.broken && slot.ring.prod(&v.region).load(Ordering::Acquire) != slot.fetched
    }

    /// Looks at a queue again next pass (once, however often it is found with more).
    fn carry_on(&mut self, b: Bell) {
        let carried = match b {
            Bell::Qp(qp) => self.qps.get_mut(&qp).map(|s| &mut s.carried),
            Bell::Srq(srq) => self.srqs.get_mut(&srq).map(|s| &mut s.carried),
            Bell::Pending | Bell::Elsewhere(_) => None,
        };
        if let Some(c) = carried
            && !*c
        {
            *c = true;
            self.carry.push(b);
        }
    }

    /// Takes new receive WQEs from an SRQ's ring into the engine. Returns whether any came.
    /// Called by every engine pass, and before the SRQ's limit is armed or queried, so that
    /// what the app posted counts, as on a device.
    pub(in crate::server) fn fetch_srq(&mut self, srq: SrqId) -> bool {
        let Some(slot) = self.srqs.get_mut(&srq) else {
            return false;
        };
        if slot.broken {
            return false;
        }
        let Some(v) = self.lanes.get(&slot.vnic) else {
            return false;
        };
        let mut raw = [0u8; RQ_SLOT];
        let room = self.engine.srq_room(srq);
        match pending(
            &slot.ring,
            &v.region,
            slot.fetched,
            self.engine.srq_retired(srq),
            room,
        ) {
            Ok(n) => {
                for _ in 0..n {
                    let (head, body) = raw.split_at_mut(RQ_HEADER);
                    slot.ring.read_slot_at(&v.region, slot.fetched, 0, head);
                    let used = RecvWqe::used((&*head).try_into().expect("a header"));
                    let body = &mut body[..used - RQ_HEADER];
                    slot.ring
                        .read_slot_at(&v.region, slot.fetched, RQ_HEADER, body);
                    slot.fetched = slot.fetched.wrapping_add(1);
                    self.engine.handle_srq_wqe(srq, RecvWqe::parse(&raw));
                }
                n > 0
            }
            Err(e) => {
                warn!(srq = srq.0, "SRQ ring: {e}; SRQ in error");
                slot.broken = true;
                self.engine.handle_srq_wqe(srq, Err(e));
                true
            }
        }
    }
}

/// What the engine asks between the steps of a turn while a light tenant competes
/// ([`vrnic_proto::Newcomers`]): whether a light tenant has posted work not yet taken. A few
/// loads: each light lane's doorbell word (rung by QPs not watched) and the send queue's
/// producer index of each of the light tenants' watched QPs, against what was taken (a posted
/// receive needs no turn: the look after the turn takes it, and a request that would consume
/// it takes the ring's receives first). The work itself is taken by the look that follows the
/// turn ([`Look::Newcomers`]).
pub(in crate::server) struct Peek<'a> {
    lanes: &'a FxHashMap<VnicId, Lane>,
    qps: &'a FxHashMap<QpId, QpSlot>,
    light_lanes: &'a [VnicId],
    light_qps: &'a [QpId],
}

impl vrnic_proto::Newcomers for Peek<'_> {
    fn arrived(&mut self) -> bool {
        let rung = self
            .light_lanes
            .iter()
            .filter_map(|id| self.lanes.get(id))
            .any(|v| vrnic_shm::bell::pending(&v.region));
        rung || self.light_qps.iter().any(|qp| {
            let Some(s) = self.qps.get(qp) else {
                return false;
            };
            let Some(v) = self.lanes.get(&s.vnic) else {
                return false;
            };
            s.sq.prod(&v.region).load(Ordering::Acquire) != s.sq_fetched
        })
    }
}
