//! The requester: the head send WQE of a QP, checked against local memory, cut into request
//! segments of at most [`CHUNK`] bytes, each handed along the QP's route to its responder;
//! the answer completes the WQE, continues it, or makes it wait (RNR, a missing responder) or
//! fail.

use super::responder::Admit;
use super::segment::{Nak, Op, Payload, Request, Response, Route, Src, psn_next, psn_prev};
use super::*;
use vrnic_wire::frame::QPN_MASK;

/// What a step needs of its QP, read under the lookup that takes the head WQE (the checks
/// and the segment's making change none of it).
#[derive(Clone, Copy)]
struct Head {
    vnic: VnicId,
    pd: PdId,
    ty: QpType,
    route: Route,
    addr: AddrRepr,
    qpn: u32,
    dst_qpn: u32,
    psn: u32,
    /// Bytes of the head WQE already moved.
    done: u64,
    /// Whether its SGEs were checked and translated at an earlier chunk and memory has not
    /// changed since (then they are not checked again).
    translated: bool,
    /// The head WQE's payload length (summed once per step, not by each part of it).
    len: u64,
}

impl Head {
    fn of(q: &Qp, mem_gen: u64, wqe: &SendWqe) -> Head {
        let done = q.progress.map_or(0, |p| p.done);
        Head {
            vnic: q.vnic,
            pd: q.pd,
            ty: q.ty,
            route: q.route,
            addr: q.addr,
            qpn: q.qpn,
            dst_qpn: q.attr.dest_qp_num,
            psn: q.attr.sq_psn,
            done,
            translated: done > 0 && q.tr.tx_mem.valid_at(mem_gen),
            len: wqe.payload.len(),
        }
    }
}

/// What to do with the head WQE after a step.
///
/// Every payload is 64 bits wide, so that an outcome is a (tag, word) pair returned in two
/// registers, not through memory copied whole right after it was written field by field (a
/// store-forwarding stall per work request; see [`Response`]).
pub(super) enum Outcome {
    /// Retire it with a completion (of the WQE's length; 0 for a memory-window operation);
    /// the step moved this many bytes.
    Complete(u64),
    /// Answered and retired already (with its completion), under the lookup that took the
    /// answer: the step moved this many bytes.
    Retired(u64),
    /// Fail the QP; the head completes with this status.
    Fail(Failed),
    /// Moved this many bytes of a message that continues in a later step.
    Partial(u64),
    /// Cannot progress now (waiting).
    Blocked,
    /// Its destination's engine is busy: the head WQE waits for the next pass, untouched.
    Busy,
}

/// A completion status, 64 bits wide (see [`Outcome`]).
#[derive(Clone, Copy)]
pub(super) struct Failed(u64);

impl Failed {
    /// The status.
    pub(super) fn status(self) -> WcStatus {
        WcStatus::from_u8(self.0 as u8).unwrap_or(WcStatus::GeneralErr)
    }
}

impl Outcome {
    /// Fails the QP with `status`.
    pub(super) fn fail(status: WcStatus) -> Self {
        Outcome::Fail(Failed(status as u64))
    }
}

impl Engine {
    /// The route to a destination address from this daemon: the vRNIC that answers its GID
    /// (global) or LID.
    pub(super) fn resolve(&self, ah: &AhAttr) -> Route {
        let (local, remote) = if ah.is_global {
            (
                self.routes.by_gid.get(&ah.grh.dgid),
                self.routes
                    .remote_gids
                    .get(&ah.grh.dgid)
                    .map(|&(h, _, _)| h),
            )
        } else {
            (
                self.routes.by_lid.get(&ah.dlid),
                self.routes.remote_lids.get(&ah.dlid).map(|&(h, _)| h),
            )
        };
        match (local, remote) {
            (Some(&v), _) => Route::Local(v),
            (None, Some(h)) => Route::Remote(h),
            (None, None) => Route::Nowhere,
        }
    }

    /// The address word of segments from QP `qpn` of vRNIC `from` along `route` to the
    /// address `ah`: the LID of the vRNIC the address resolved to (a GID names one by its LID),
    /// its own vRNIC's LID, its number. All zero but the number where the route leads nowhere.
    pub(super) fn addr_to(&self, from: VnicId, qpn: u32, route: Route, ah: &AhAttr) -> AddrRepr {
        let dlid = match route {
            Route::Nowhere => 0,
            _ if !ah.is_global => ah.dlid,
            _ => self
                .routes
                .by_gid
                .get(&ah.grh.dgid)
                .and_then(|v| self.objs.vnics.get(v))
                .map(|v| v.lid)
                .or_else(|| self.lid_of_remote_gid(&ah.grh.dgid))
                .unwrap_or(0),
        };
        AddrRepr {
            dlid,
            slid: self.objs.vnics.get(&from).map_or(0, |v| v.lid),
            src_qpn: qpn,
        }
    }

    /// `route` to the QP numbered `qpn` there: a vRNIC on this engine whose QP of that number
    /// is on another engine of the daemon (a vRNIC with QPs on several, see
    /// [`Engine::set_siblings`]) is reached through that engine.
    pub(super) fn classed(&self, route: Route, qpn: u32) -> Route {
        match (route, self.sibling_of(qpn)) {
            (Route::Local(_), Some(host)) => Route::Remote(host),
            _ => route,
        }
    }

    /// Retires the head send WQE, with a completion if it is signaled.
    pub(super) fn complete_head(&mut self, qp: QpId, byte_len: u32) {
        let Some(q) = self.objs.qps.get_mut(&qp) else {
            return;
        };
        q.wait = Wait::None;
        q.progress = None;
        let Some(Ok(w)) = q.sq.pop_front() else {
            return;
        };
        self.retire(qp, &w, byte_len);
    }

    /// Retires `w`, the send WQE just taken off the head of `qp`'s queue, with a completion
    /// if it is signaled ([`Engine::complete_head`] for one still at the head).
    fn retire(&mut self, qp: QpId, w: &SendWqe, byte_len: u32) {
        if let Some(q) = self.objs.qps.get_mut(&qp) {
            retire_wqe(q, qp, w, byte_len, &mut self.sched.touched, &mut self.out);
        }
    }

    /// The answer to a segment of the head WQE `wqe` of `qp` accepted it: the QP's next PSN,
    /// and the WQE continues at byte `next` (`Partial(moved)`) or, if `next` is its length,
    /// is retired (`Retired(moved)`), all under one lookup of the QP.
    fn accepted(
        &mut self,
        qp: QpId,
        (wqe, len): (&SendWqe, u64),
        moved: u64,
        next: u64,
    ) -> Outcome {
        let Some(q) = self.objs.qps.get_mut(&qp) else {
            return Outcome::Retired(moved);
        };
        took_psn(q);
        if next < len {
            continue_in(q, next);
            return Outcome::Partial(moved);
        }
        retire_wqe(
            q,
            qp,
            wqe,
            len as u32,
            &mut self.sched.touched,
            &mut self.out,
        );
        Outcome::Retired(moved)
    }

    /// The route of connected QP `qp` if it leads somewhere; if it leads nowhere (its RTR came
    /// before its destination was known here: another host's vRNIC announced after the app
    /// learnt its address), its address looked up again and the route kept, as a fabric
    /// delivers once the port is up. Costs nothing for a QP with a route.
    pub(super) fn reroute(&mut self, qp: QpId) -> Route {
        let Some(q) = self.objs.qps.get(&qp) else {
            return Route::Nowhere;
        };
        if q.route != Route::Nowhere
            || q.ty == QpType::Ud
            || !matches!(q.attr.qp_state, QpState::Rtr | QpState::Rts | QpState::Sqd)
        {
            return q.route;
        }
        let (vnic, qpn, ah, dqpn) = (q.vnic, q.qpn, q.attr.ah_attr, q.attr.dest_qp_num);
        let route = self.route_from(vnic, &ah, false);
        let route = self.classed(route, dqpn);
        let addr = self.addr_to(vnic, qpn, route, &ah);
        if let Some(q) = self.objs.qps.get_mut(&qp) {
            q.route = route;
            q.addr = addr;
            q.resp.admitted = None;
            if route != Route::Nowhere && matches!(q.wait, Wait::Retry { .. }) {
                // It waited for an answer from nowhere; it has somewhere to send now.
                q.wait = Wait::None;
            }
        }
        route
    }

    /// Tries the head send WQE of an RTS QP: one segment.
    pub(super) fn step<S: Siblings>(
        &mut self,
        now: Instant,
        qp: QpId,
        mem: &mut dyn Memory,
        sib: &mut S,
    ) -> Step {
        let Some(mut q) = self.objs.qps.get_mut(&qp) else {
            return Step::Blocked;
        };
        if q.route == Route::Nowhere {
            self.reroute(qp);
            let Some(again) = self.objs.qps.get_mut(&qp) else {
                return Step::Blocked;
            };
            q = again;
        }
        // A sibling engine's QP is reached as one of this engine's: by a call, not frames.
        let sibling = sibling_host(self.siblings, self.qpn_stride, q.route).is_some();
        if let (Route::Remote(host), QpType::Rc | QpType::Uc | QpType::XrcSend, false) =
            (q.route, q.ty, sibling)
        {
            // Memory-window operations are executed here, in order: once all before them are
            // answered. (A SEND with Invalidate crosses the link with its IETH on RC; UC has
            // no such opcode, so there it fails with LOC_QP_OP_ERR.)
            let next = q.sq.get(q.link.sq_sent).and_then(|w| w.as_ref().ok());
            let uc = q.ty == QpType::Uc;
            match next.map(|w| w.opcode) {
                Some(op) if op.is_local() || (uc && op == SendOpcode::SendWithInv) => {
                    if q.link.sq_sent > 0 {
                        // Off the ready lists until those in flight are answered.
                        q.link.stalled = true;
                        return Step::Blocked;
                    }
                }
                _ => return self.step_remote(now, qp, host),
            }
        }
        let wqe = match q.sq.pop_front() {
            Some(Ok(w)) => w,
            Some(Err(e)) => {
                q.sq.push_front(Err(e));
                self.fail_qp(qp, Some(WcStatus::LocQpOpErr));
                return Step::Done(0);
            }
            None => return Step::Blocked,
        };
        let at = Head::of(q, self.mem_gen, &wqe);
        let outcome = self.step_wqe(now, qp, at, &wqe, mem, sib);
        let byte_len = if wqe.opcode.is_local() {
            0
        } else {
            at.len as u32
        };
        match outcome {
            Outcome::Complete(moved) => {
                // Retired as it is, not put back to be taken off again.
                self.retire(qp, &wqe, byte_len);
                Step::Done(moved)
            }
            Outcome::Retired(moved) => Step::Done(moved),
            Outcome::Fail(status) => {
                self.put_back(qp, wqe);
                self.fail_qp(qp, Some(status.status()));
                Step::Done(0)
            }
            Outcome::Partial(n) => {
                self.put_back(qp, wqe);
                Step::Partial(n)
            }
            Outcome::Blocked => {
                self.put_back(qp, wqe);
                Step::Blocked
            }
            Outcome::Busy => {
                self.put_back(qp, wqe);
                Step::Busy
            }
        }
    }

    /// Puts a WQE taken for a step back at the head of `qp`'s queue: failing, or the next
    /// step, takes it from there.
    fn put_back(&mut self, qp: QpId, wqe: SendWqe) {
        if let Some(q) = self.objs.qps.get_mut(&qp) {
            q.sq.push_front(Ok(wqe));
        }
    }

    /// Local checks, then the next segment of `wqe` (taken off the head of `qp`'s queue).
    fn step_wqe<S: Siblings>(
        &mut self,
        now: Instant,
        qp: QpId,
        at: Head,
        wqe: &SendWqe,
        mem: &mut dyn Memory,
        sib: &mut S,
    ) -> Outcome {
        let (ty, route) = (at.ty, at.route);
        let head = Some((at.done, at.translated));
        if let Some(status) = self.refused_for(qp, (at.vnic, at.pd, ty), (wqe, at.len), head) {
            return Outcome::fail(status);
        }
        if ty == QpType::Ud {
            return self.step_ud(qp, wqe, mem, sib);
        }
        if wqe.opcode.is_local() {
            return self.step_local(qp, wqe);
        }
        // Frames carry no IETH for UC (RC sends it): over a peer link UC has no SEND with
        // Invalidate (a sibling engine is reached by a call, as on one engine).
        if wqe.opcode == SendOpcode::SendWithInv
            && ty == QpType::Uc
            && matches!(route, Route::Remote(_))
            && self.sibling_route(route).is_none()
        {
            return Outcome::fail(WcStatus::LocQpOpErr);
        }
        self.step_connected(now, qp, at, wqe, mem, sib)
    }

    /// The requester's checks of send WQE `wqe` of `qp` that hold whatever its route (one
    /// engine, a sibling, a peer link): its length, an operation its QP's type cannot do, the
    /// SGEs' lkeys, PD, access and bounds, an atomic's 8-byte buffer. `Some(status)`: it
    /// fails with that status before anything leaves. `head`: for the head WQE, the bytes of
    /// it already moved (its SGEs are translated as they are checked, and the translation
    /// kept for its later chunks); `None` for a WQE behind the head (a peer link's window),
    /// checked alone.
    pub(super) fn refused_locally(
        &mut self,
        qp: QpId,
        wqe: &SendWqe,
        head: Option<u64>,
    ) -> Option<WcStatus> {
        let q = self.objs.qps.get(&qp)?;
        let facts = (q.vnic, q.pd, q.ty);
        let translated = q.tr.tx_mem.valid_at(self.mem_gen);
        let len = wqe.payload.len();
        self.refused_for(
            qp,
            facts,
            (wqe, len),
            head.map(|d| (d, d > 0 && translated)),
        )
    }

    /// [`Engine::refused_locally`], the QP's vRNIC, PD and type known.
    fn refused_for(
        &mut self,
        qp: QpId,
        (vnic, pd, ty): (VnicId, PdId, QpType),
        (wqe, len): (&SendWqe, u64),
        head: Option<(u64, bool)>,
    ) -> Option<WcStatus> {
        let needs_write = wqe.opcode.reads_back();
        if len > u64::from(MAX_MSG_SIZE) {
            return Some(WcStatus::LocLenErr);
        }
        if ty == QpType::XrcRecv {
            // An XRC receive QP has no send queue (the driver refuses such posts first).
            return Some(WcStatus::LocQpOpErr);
        }
        if ty == QpType::Uc && wqe.opcode.needs_reliable() {
            // UC has no responses: READ, atomics and ATOMIC WRITE are invalid on it.
            return Some(WcStatus::LocQpOpErr);
        }
        if !atomic_write_ok(wqe) {
            return Some(WcStatus::LocQpOpErr);
        }
        match (&wqe.payload, head) {
            // The head: checked at its first chunk, again only if memory changed since.
            (SendPayload::Sges(sges), Some((_, translated)))
                if !translated && !self.check_head_sges(qp, (vnic, pd), sges, needs_write, len) =>
            {
                return Some(WcStatus::LocProtErr);
            }
            (SendPayload::Sges(sges), None) if !self.check_sges(vnic, pd, sges, needs_write) => {
                return Some(WcStatus::LocProtErr);
            }
            (SendPayload::Inline(_), _) if needs_write => return Some(WcStatus::LocQpOpErr),
            _ => {}
        }
        if ty != QpType::Ud && needs_write && wqe.opcode != SendOpcode::RdmaRead && len != 8 {
            // An atomic's local buffer must hold exactly the 8-byte original value.
            return Some(WcStatus::LocLenErr);
        }
        None
    }

    /// A memory-window operation at the head of an RC or UC QP: a bind (`MW_BIND_ERR` if it
    /// is refused) or a local invalidation (`LOC_QP_OP_ERR`, as rxe); nothing is sent.
    fn step_local(&mut self, qp: QpId, wqe: &SendWqe) -> Outcome {
        let result = match wqe.opcode {
            SendOpcode::BindMw => self.bind_mw(qp, wqe),
            _ => {
                let Some(q) = self.objs.qps.get(&qp) else {
                    return Outcome::Blocked;
                };
                let (vnic, pd) = (q.vnic, q.pd);
                self.invalidate_mw(vnic, pd, wqe.imm_data, None)
                    .map_err(|()| WcStatus::LocQpOpErr)
            }
        };
        match result {
            Ok(()) => Outcome::Complete(0),
            Err(status) => Outcome::fail(status),
        }
    }

    /// The next segment of an RC or UC message.
    fn step_connected<S: Siblings>(
        &mut self,
        now: Instant,
        qp: QpId,
        at: Head,
        wqe: &SendWqe,
        mem: &mut dyn Memory,
        sib: &mut S,
    ) -> Outcome {
        let Head {
            vnic,
            route,
            addr,
            qpn,
            dst_qpn,
            psn,
            done,
            ..
        } = at;
        let (uc, xrc) = (at.ty == QpType::Uc, at.ty == QpType::XrcSend);
        let len = at.len;
        let atomic = matches!(
            wqe.opcode,
            SendOpcode::AtomicCmpAndSwp | SendOpcode::AtomicFetchAndAdd
        );
        let n = if atomic {
            0
        } else if wqe.opcode == SendOpcode::AtomicWrite {
            // Its 8 bytes go whole, in one segment.
            len
        } else {
            // A step over a peer link costs the engine no copy: only local ones are short.
            let step = match route {
                Route::Remote(_) => self.sched.turn_bytes,
                _ => self.sched.step_bytes,
            };
            len.saturating_sub(done).min(step)
        };
        let op = match wqe.opcode {
            SendOpcode::Send | SendOpcode::SendWithImm => Op::Send,
            SendOpcode::SendWithInv => Op::SendInv,
            // Executed by `step_local`.
            SendOpcode::LocalInv | SendOpcode::BindMw => return Outcome::Blocked,
            SendOpcode::RdmaWrite | SendOpcode::RdmaWriteWithImm => Op::Write,
            SendOpcode::RdmaRead => Op::Read,
            SendOpcode::AtomicCmpAndSwp => Op::CmpSwap {
                compare: wqe.compare_add,
                swap: wqe.swap,
            },
            SendOpcode::AtomicFetchAndAdd => Op::FetchAdd {
                add: wqe.compare_add,
            },
            SendOpcode::AtomicWrite => Op::AtomicWrite,
        };
        // This segment's payload: the requester's bytes [done, done + n).
        let mut src = std::mem::take(&mut self.scratch.scratch_src);
        src.clear();
        let payload = match (&wqe.payload, op) {
            (SendPayload::Inline(data), Op::Send | Op::SendInv | Op::Write | Op::AtomicWrite) => {
                let (a, b) = (done as usize, done.saturating_add(n) as usize);
                Payload::Bytes(data.get(a..b).unwrap_or_default())
            }
            (SendPayload::Sges(sges), Op::Send | Op::SendInv | Op::Write) => {
                // Checked by `check_sges` at this generation, so it cannot fail.
                let _ = self.local_runs(qp, sges, len, done, n, &mut src);
                Payload::Runs(&src)
            }
            _ => Payload::Empty,
        };
        let last = done + n >= len || atomic;
        let mut req = Request {
            op,
            transport: match (uc, xrc) {
                (true, _) => QpType::Uc,
                (_, true) => QpType::XrcSend,
                _ => QpType::Rc,
            },
            xrc_srqn: if xrc { wqe.xrc_srqn & QPN_MASK } else { 0 },
            first: done == 0,
            last,
            src: Src::Local { vnic, qpn },
            src_qpn: qpn,
            slid: self.objs.vnics.get(&vnic).map_or(0, |v| v.lid),
            dst_qpn,
            psn,
            solicited: wqe.flags.contains(SendFlags::SOLICITED),
            imm: matches!(
                wqe.opcode,
                SendOpcode::SendWithImm | SendOpcode::RdmaWriteWithImm
            )
            .then_some(wqe.imm_data),
            va: wqe.remote_addr.wrapping_add(done),
            // SEND with Invalidate: the IETH's R_Key (the `invalidate_rkey` union member).
            rkey: if op == Op::SendInv {
                wqe.imm_data
            } else {
                wqe.rkey
            },
            len: if atomic { 8 } else { len - done },
            chunk: n,
            qkey: 0,
            grh: None,
            payload,
        };
        let mut back = std::mem::take(&mut self.scratch.scratch_dst);
        back.clear();
        let outcome = match self.sibling_route(route) {
            Some(host) => self
                .via_sibling(
                    sib,
                    host,
                    addr,
                    &mut req,
                    &mut back,
                    |e, answer, back, m| e.answered(now, qp, at, wqe, answer, n, back, m),
                )
                .unwrap_or(Outcome::Busy),
            None => {
                let answer = self.deliver(route, &req, mem, &mut back);
                self.answered(now, qp, at, wqe, answer, n, &back, mem)
            }
        };
        self.scratch.scratch_src = src;
        self.scratch.scratch_dst = back;
        outcome
    }

    /// Acts on the answer to a segment of `wqe` that moved bytes `[at.done, at.done + n)`.
    #[allow(clippy::too_many_arguments)]
    fn answered(
        &mut self,
        now: Instant,
        qp: QpId,
        at: Head,
        wqe: &SendWqe,
        answer: Option<Response>,
        n: u64,
        back: &[(Loc, u64)],
        mem: &mut dyn Memory,
    ) -> Outcome {
        let len = at.len;
        let (vnic, uc, dst_qpn, done) = (at.vnic, at.ty == QpType::Uc, at.dst_qpn, at.done);
        let Some(response) = answer else {
            if uc {
                // Nobody acknowledges UC: the message is simply lost.
                return self.accepted(qp, (wqe, len), len, len);
            }
            return self.lost(now, qp);
        };
        match response {
            Response::Ack | Response::Unacknowledged => self.accepted(qp, (wqe, len), n, done + n),
            Response::ReadData => {
                if let SendPayload::Sges(sges) = &wqe.payload {
                    let mut local = std::mem::take(&mut self.scratch.scratch_local);
                    local.clear();
                    // Checked by `check_sges` at this generation, so it cannot fail.
                    let _ = self.local_runs(qp, sges, len, done, n, &mut local);
                    let copied = copy_runs(mem, back, &local, n);
                    self.scratch.scratch_local = local;
                    if copied.is_err() {
                        self.psn_taken(qp);
                        return Outcome::fail(WcStatus::GeneralErr);
                    }
                }
                self.accepted(qp, (wqe, len), n, done + n)
            }
            Response::AtomicAck(old) => {
                if let SendPayload::Sges(sges) = &wqe.payload {
                    let mut local = std::mem::take(&mut self.scratch.scratch_local);
                    local.clear();
                    let _ = self.sge_runs(vnic, sges, 0, 8, &mut local);
                    let written = scatter_bytes(mem, &old.to_le_bytes(), &local);
                    self.scratch.scratch_local = local;
                    if written.is_err() {
                        self.psn_taken(qp);
                        return Outcome::fail(WcStatus::GeneralErr);
                    }
                }
                self.accepted(qp, (wqe, len), 8, len)
            }
            Response::RnrNak { timer } => {
                // A receive posted to the responder's queue wakes the QP early where that
                // queue is this engine's; a sibling's is not watched here, only the timer
                // wakes it.
                let on = match at.route {
                    Route::Local(_) => self.objs.by_qpn.get(&dst_qpn).map(|&peer| {
                        match self.objs.qps.get(&peer).and_then(|p| p.srq.or(p.xrc_srq)) {
                            Some(s) => RecvQueue::Srq(s),
                            None => RecvQueue::Qp(peer),
                        }
                    }),
                    _ => None,
                };
                self.rnr(now, qp, timer.code(), on)
            }
            Response::Nak(Nak::Sequence) => {
                // Go back to the message's first PSN and try again, as after a lost packet.
                if let Some(q) = self.objs.qps.get_mut(&qp)
                    && let Some(p) = q.progress.take()
                {
                    q.attr.sq_psn = p.psn;
                }
                self.lost(now, qp)
            }
            Response::Nak(Nak::InvalidRequest) => Outcome::fail(WcStatus::RemInvReqErr),
            Response::Nak(Nak::RemoteAccess) => Outcome::fail(WcStatus::RemAccessErr),
            Response::Nak(Nak::RemoteOperational) => Outcome::fail(WcStatus::RemOpErr),
        }
    }

    /// A segment of `qp`'s head WQE took its PSN, and the WQE fails (a copy the daemon could
    /// not make).
    fn psn_taken(&mut self, qp: QpId) {
        if let Some(q) = self.objs.qps.get_mut(&qp) {
            took_psn(q);
        }
    }

    /// No answer (no responder, or it dropped the segment): wait for the transport timer,
    /// then fail with `RETRY_EXC_ERR`. A QP that can answer (one reaching RTR) wakes it.
    fn lost(&mut self, now: Instant, qp: QpId) -> Outcome {
        let Some(q) = self.objs.qps.get_mut(&qp) else {
            return Outcome::Blocked;
        };
        match q.wait {
            Wait::Retry { until } if now >= until => return Outcome::fail(WcStatus::RetryExcErr),
            Wait::Retry { .. } => {}
            _ => {
                let us = state::ack_timeout_us(q.attr.timeout)
                    .saturating_mul(u64::from(q.attr.retry_cnt) + 1);
                let until = now + Duration::from_micros(us);
                tracing::debug!(?qp, route = ?q.route, "no answer: waiting for the transport timer");
                q.wait = Wait::Retry { until };
                self.arm(qp, until);
            }
        }
        Outcome::Blocked
    }

    /// An RNR NAK (no receive posted at the responder, whose timer code is `timer`): wait, and
    /// count one retry each time the timer expires; a receive posted to `on` wakes it early.
    pub(super) fn rnr(
        &mut self,
        now: Instant,
        qp: QpId,
        timer: u8,
        on: Option<RecvQueue>,
    ) -> Outcome {
        let Some(q) = self.objs.qps.get_mut(&qp) else {
            return Outcome::Blocked;
        };
        let limit = q.attr.rnr_retry;
        let rearm = now + Duration::from_micros(state::rnr_timer_us(timer));
        match q.wait {
            Wait::Rnr { until, retries, .. } if now >= until => {
                let retries = retries.saturating_add(1);
                if limit != 7 && retries > limit {
                    return Outcome::fail(WcStatus::RnrRetryExcErr);
                }
                q.wait = Wait::Rnr {
                    until: rearm,
                    retries,
                    on,
                    timer,
                };
                self.arm(qp, rearm);
            }
            Wait::Rnr { .. } => {}
            _ => {
                q.wait = Wait::Rnr {
                    until: rearm,
                    retries: 0,
                    on,
                    timer,
                };
                self.arm(qp, rearm);
            }
        }
        Outcome::Blocked
    }

    /// Hands a segment along a route; `None` if it was lost (no responder took it). A READ
    /// response leaves the responder's runs in `back`.
    pub(super) fn deliver(
        &mut self,
        route: Route,
        req: &Request,
        mem: &mut dyn Memory,
        back: &mut Vec<(Loc, u64)>,
    ) -> Option<Response> {
        let Route::Local(vid) = route else {
            return None;
        };
        let &peer = self.objs.by_qpn.get(&req.dst_qpn)?;
        // Only a QP of the vRNIC the route resolved, not another's reached by its number.
        self.handle_request(peer, Admit::Local(vid), req, mem, back)
    }

    /// A UD send: one segment to the QP the address handle and QP number name; nothing
    /// answers, so it completes once handed on (a datagram nobody takes is dropped).
    fn step_ud<S: Siblings>(
        &mut self,
        qp: QpId,
        wqe: &SendWqe,
        mem: &mut dyn Memory,
        sib: &mut S,
    ) -> Outcome {
        let len = wqe.payload.len();
        let Some(q) = self.objs.qps.get(&qp) else {
            return Outcome::Blocked;
        };
        let (pd, qpn, own_qkey, vnic) = (q.pd, q.qpn, q.attr.qkey, q.vnic);
        if !matches!(wqe.opcode, SendOpcode::Send | SendOpcode::SendWithImm) {
            return Outcome::fail(WcStatus::LocQpOpErr);
        }
        let (attr, mut route) = match self.objs.ahs.get(&AhId(wqe.ud.ah)) {
            Some(a) if a.pd == pd => (a.attr, a.route),
            _ => return Outcome::fail(WcStatus::LocQpOpErr),
        };
        if route == Route::Nowhere {
            // Made before its destination was known here (a vRNIC of another host announced
            // after the app learnt its address): a fabric delivers once the port is up, so
            // the address is looked up again, and kept once it answers.
            route = self.route_from(vnic, &attr, false);
            if let Some(a) = self.objs.ahs.get_mut(&AhId(wqe.ud.ah)) {
                a.route = route;
            }
        }
        let route = self.classed(route, wqe.ud.remote_qpn);
        if len > UD_MTU {
            return Outcome::fail(WcStatus::LocLenErr);
        }
        // A Q_Key with the high bit set means the sender's own (IB spec 10.2.4).
        let qkey = if wqe.ud.remote_qkey & 0x8000_0000 != 0 {
            own_qkey
        } else {
            wqe.ud.remote_qkey
        };
        let grh = attr.is_global.then(|| {
            let sgid = self
                .objs
                .vnics
                .get(&vnic)
                .map(|v| v.gid)
                .unwrap_or_default();
            grh(&attr, sgid, len)
        });
        let mut src = std::mem::take(&mut self.scratch.scratch_src);
        src.clear();
        let payload = match &wqe.payload {
            SendPayload::Inline(data) => Payload::Bytes(data),
            SendPayload::Sges(sges) => {
                let _ = self.sge_runs(vnic, sges, 0, len, &mut src);
                Payload::Runs(&src)
            }
        };
        let mut req = Request {
            op: Op::Send,
            transport: QpType::Ud,
            xrc_srqn: 0,
            first: true,
            last: true,
            src: Src::Local { vnic, qpn },
            src_qpn: qpn,
            slid: self.objs.vnics.get(&vnic).map_or(0, |v| v.lid),
            dst_qpn: wqe.ud.remote_qpn,
            psn: 0,
            solicited: wqe.flags.contains(SendFlags::SOLICITED),
            imm: (wqe.opcode == SendOpcode::SendWithImm).then_some(wqe.imm_data),
            va: 0,
            rkey: 0,
            len,
            chunk: len,
            qkey,
            grh,
            payload,
        };
        if let Some(host) = self.sibling_route(route) {
            let addr = self.addr_to(vnic, qpn, route, &attr);
            let mut back = std::mem::take(&mut self.scratch.scratch_dst);
            let dqpn = req.dst_qpn;
            let ran = self.via_sibling(sib, host, addr, &mut req, &mut back, |_, answer, _, _| {
                if answer.is_none() {
                    tracing::trace!(qpn, dqpn, "UD datagram dropped at a sibling");
                }
            });
            self.scratch.scratch_src = src;
            self.scratch.scratch_dst = back;
            return match ran {
                Some(()) => Outcome::Complete(len),
                None => Outcome::Busy,
            };
        }
        if let Route::Remote(host) = route {
            self.scratch.scratch_src = src;
            self.transmit_datagram(host, qp, wqe, qkey, &attr);
            return Outcome::Complete(len);
        }
        let mut back = std::mem::take(&mut self.scratch.scratch_dst);
        if self.deliver(route, &req, mem, &mut back).is_none() {
            tracing::trace!(qpn, dqpn = req.dst_qpn, "UD datagram dropped: no such QP");
        }
        self.scratch.scratch_src = src;
        self.scratch.scratch_dst = back;
        Outcome::Complete(len)
    }
}

/// Whether `wqe`, if it is an ATOMIC WRITE, carries what one must: exactly 8 inline bytes (what
/// the driver's `ibv_wr_atomic_write` writes; a slot written otherwise fails with
/// `LOC_QP_OP_ERR`, as a malformed work request). Other work requests pass.
pub(super) fn atomic_write_ok(wqe: &SendWqe) -> bool {
    wqe.opcode != SendOpcode::AtomicWrite
        || matches!(&wqe.payload, SendPayload::Inline(d) if d.len() == 8)
}

/// A segment of `q`'s head WQE was answered: it took its PSN, and `q` waits for nothing.
fn took_psn(q: &mut Qp) {
    q.attr.sq_psn = psn_next(q.attr.sq_psn);
    q.wait = Wait::None;
}

/// Records that the head WQE of `q` moved its first `done` bytes and continues later.
fn continue_in(q: &mut Qp, done: u64) {
    let psn = match q.progress {
        Some(p) => p.psn,
        // The PSN of the first segment, taken by the segment just accepted.
        None => psn_prev(q.attr.sq_psn),
    };
    q.progress = Some(Progress { done, psn });
}

/// Retires the head send WQE `w` of `q` (numbered `qp`), taken off its queue, with a completion
/// of `byte_len` if it is signaled.
fn retire_wqe(
    q: &mut Qp,
    qp: QpId,
    w: &SendWqe,
    byte_len: u32,
    touched: &mut Vec<QpId>,
    out: &mut Outputs,
) {
    q.wait = Wait::None;
    q.progress = None;
    q.sq_retired = q.sq_retired.wrapping_add(1);
    touch(touched, qp, q);
    if q.sq_sig_all || w.flags.contains(SendFlags::SIGNALED) {
        let mut c = cqe(w.wr_id, WcStatus::Success, w.opcode.wc_opcode(), q.qpn);
        c.byte_len = byte_len;
        out.completions.push_back((q.send_cq, c, false));
    }
    q.meter.sent(w.opcode, u64::from(byte_len));
}
