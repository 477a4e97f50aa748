//! The responder: a request segment checked against the connection (state, QPN, route back,
//! PSN) and against the responder's own memory (its receive, its MRs and rkeys), then
//! executed — bytes placed, a receive taken and completed, READ data located, an atomic
//! performed, an ATOMIC WRITE stored — and answered.

use super::segment::{
    Nak, Op, Payload, Request, Response, RnrTimer, Route, Src, psn_cmp, psn_next,
};
use super::*;

/// A SEND in progress at a responder: the receive it lands in (taken at its first segment,
/// completed at its last) and the bytes placed so far.
#[derive(Debug)]
pub(super) struct Rx {
    pub(super) wqe: RecvWqe,
    pub(super) off: u64,
    /// The CQ it completes on: the QP's receive CQ, or an XRC SRQ's.
    pub(super) cq: CqId,
}

/// Where a request segment comes from, as its responder checks it first (the checks every
/// path between two QPs applies, under the lookup that finds the responder QP).
#[derive(Clone, Copy)]
pub(super) enum Admit {
    /// A QP of this engine whose route resolved vRNIC `.0`: only a QP of that vRNIC takes
    /// it, not another's named by its number.
    Local(VnicId),
    /// A segment from a link, admitted by [`Engine::admitted`] already.
    Checked,
    /// Sibling engine `host`, with address word `addr` (and a datagram's source QP number):
    /// admitted as a segment from a link is ([`Engine::admits`]: the QP of the vRNIC the
    /// address resolved, a sender of its group, a connected QP's own peer); a connected peer
    /// admitted before, with no route changed since, without lookups.
    Sibling {
        host: HostId,
        addr: AddrRepr,
        deth: Option<u32>,
    },
}

/// What a WRITE segment needs of its responder QP, read by [`Engine::handle_request`] under
/// the lookup that checks the connection.
#[derive(Clone, Copy)]
struct WriteAt {
    /// The RNR NAK's timer, for a WRITE with immediate that finds no receive.
    timer: RnrTimer,
    /// The responder's WRITE state: the message's RETH length, and whether a UC message lost a
    /// segment.
    write_len: u64,
    lost: bool,
    /// The destination's runs are in `scratch_place` already (translated for an earlier
    /// segment or message, for this R_Key and access, still valid).
    ready: bool,
}

impl Engine {
    /// A request segment for `peer` (on this daemon). `None`: dropped without an answer (the
    /// QP is not connected to the requester, or not ready to receive), as a network drops an
    /// invalid packet. A READ response leaves the runs to read in `back`.
    pub(super) fn handle_request(
        &mut self,
        peer: QpId,
        from: Admit,
        req: &Request,
        mem: &mut dyn Memory,
        back: &mut Vec<(Loc, u64)>,
    ) -> Option<Response> {
        let mut p = self.objs.qps.get(&peer)?;
        match from {
            Admit::Local(vnic) if vnic != p.vnic => return None,
            Admit::Sibling { host, addr, deth } if !self.admitted_before(p, host, &addr) => {
                if !self.admits(host, &addr, deth, peer) {
                    self.refuse_segment(host, &addr, req.dst_qpn, Some(peer));
                    return None;
                }
                p = self.objs.qps.get(&peer)?;
            }
            _ => {}
        }
        // An XRC request lands on an XRC receive QP, and nothing else does.
        let lands = match p.ty {
            QpType::XrcRecv => req.transport == QpType::XrcSend,
            ty => ty == req.transport,
        };
        if !lands || !matches!(p.attr.qp_state, QpState::Rtr | QpState::Rts | QpState::Sqd) {
            return None;
        }
        if req.transport == QpType::Ud {
            return Some(self.handle_datagram(peer, req, mem));
        }
        let p = if p.route == Route::Nowhere {
            self.reroute(peer);
            self.objs.qps.get(&peer)?
        } else {
            p
        };
        let connected = match req.src {
            Src::Local { vnic, qpn } => p.attr.dest_qp_num == qpn && p.route == Route::Local(vnic),
            Src::Remote(host) => p.route == Route::Remote(host),
        };
        if !connected {
            return None;
        }
        let uc = req.transport == QpType::Uc;
        // What a WRITE needs of the QP, read under this lookup; its destination's runs too
        // where an earlier segment or message checked and translated them.
        let write = (req.op == Op::Write).then(|| {
            let ready = req.len != 0 && {
                let dst = &mut self.scratch.scratch_place;
                dst.clear();
                p.tr.rx_mem.slice_cached(
                    self.mem_gen,
                    (req.va, req.len, req.payload.len(), req.first),
                    (req.rkey, access::REMOTE_WRITE),
                    dst,
                )
            };
            WriteAt {
                timer: RnrTimer::new(p.attr.min_rnr_timer),
                write_len: p.resp.write_len,
                lost: p.resp.rx_lost,
                ready,
            }
        });
        match psn_cmp(req.psn, p.attr.rq_psn) {
            0 => {
                if p.resp.nak_sent
                    && let Some(q) = self.objs.qps.get_mut(&peer)
                {
                    q.resp.nak_sent = false;
                }
            }
            _ if uc => {
                // UC: a gap loses the message in progress; a first segment starts anew.
                if !req.first {
                    if let Some(q) = self.objs.qps.get_mut(&peer) {
                        q.attr.rq_psn = psn_next(req.psn);
                        q.resp.rx_lost = true;
                    }
                    return Some(Response::Unacknowledged);
                }
            }
            // Ahead: NAKed once (with the PSN expected), then dropped until that PSN comes
            // (IB spec 9.7.5.1.1), so a burst in flight behind a NAK costs one answer.
            d if d > 0 => {
                let q = self.objs.qps.get_mut(&peer)?;
                if q.resp.nak_sent {
                    return None;
                }
                q.resp.nak_sent = true;
                return Some(Response::Nak(Nak::Sequence));
            }
            _ => return Some(self.duplicate(peer, req, back)),
        }
        if req.transport == QpType::XrcSend
            && let Err(nak) = self.xrc_target(peer, req.xrc_srqn)
        {
            tracing::debug!(
                srqn = req.xrc_srqn,
                "XRC request for no SRQ of the receive QP's domain"
            );
            return Some(self.refuse(peer, nak));
        }
        let r = match req.op {
            Op::Send | Op::SendInv => self.place_send(peer, req, mem),
            Op::Write => match write {
                Some(at) => self.place_write(peer, at, req, mem),
                None => Response::Nak(Nak::InvalidRequest),
            },
            Op::Read => self.locate_read(peer, req, back),
            Op::CmpSwap { .. } | Op::FetchAdd { .. } => self.perform_atomic(peer, req, mem),
            Op::AtomicWrite => self.perform_atomic_write(peer, req, mem),
        };
        // The answer's effects on the responder QP, under one lookup.
        if let Some(q) = self.objs.qps.get_mut(&peer) {
            if let Response::RnrNak { .. } = r {
                // What follows it in flight is out of sequence until it comes again.
                q.resp.nak_sent = true;
            }
            // The vRNIC's count is the sum of its QPs' ([`Engine::meter`]).
            meter_request(&mut q.meter, req, r);
            if uc
                || matches!(
                    r,
                    Response::Ack | Response::ReadData | Response::AtomicAck(_)
                )
            {
                q.attr.rq_psn = psn_next(req.psn);
                if let Response::AtomicAck(old) = r {
                    q.resp.last_atomic = Some((req.psn, old));
                }
            }
        }
        Some(if uc { Response::Unacknowledged } else { r })
    }

    /// A segment whose PSN this responder has passed already (a retransmission): SEND, WRITE
    /// and ATOMIC WRITE are acknowledged again without effect (an ATOMIC WRITE stored again
    /// could undo a later store), READ is read again, an atomic answers the value it answered
    /// (IB spec 9.7.5.1.2).
    fn duplicate(&mut self, peer: QpId, req: &Request, back: &mut Vec<(Loc, u64)>) -> Response {
        match req.op {
            Op::Send | Op::SendInv | Op::Write | Op::AtomicWrite => Response::Ack,
            Op::Read => self.locate_read(peer, req, back),
            Op::CmpSwap { .. } | Op::FetchAdd { .. } => {
                match self.objs.qps.get(&peer).and_then(|p| p.resp.last_atomic) {
                    Some((psn, old)) if psn == req.psn => Response::AtomicAck(old),
                    _ => Response::Nak(Nak::InvalidRequest),
                }
            }
        }
    }

    /// A responder-detected error on an RC (or UC) QP: the QP moves to ERR (the requester
    /// learns `nak`).
    fn refuse(&mut self, peer: QpId, nak: Nak) -> Response {
        self.fail_qp(peer, None);
        Response::Nak(nak)
    }

    /// SEND: the payload into the receive of the message in progress, or, at its first
    /// segment, the receive at the head of the QP's (or its SRQ's) queue.
    fn place_send(&mut self, peer: QpId, req: &Request, mem: &mut dyn Memory) -> Response {
        let Some(p) = self.objs.qps.get(&peer) else {
            return Response::Nak(Nak::InvalidRequest);
        };
        let (pvnic, ppd, timer) = (
            p.vnic,
            self.responder_pd(p),
            RnrTimer::new(p.attr.min_rnr_timer),
        );
        let cq = self.responder_cq(p);
        let uc = p.ty == QpType::Uc;
        if req.first {
            if let Some(q) = self.objs.qps.get_mut(&peer) {
                q.resp.rx_lost = false;
                if let Some(rx) = q.resp.rx.as_mut() {
                    // The message starts over (a retransmission): same receive, from byte 0.
                    rx.off = 0;
                }
            }
            if self
                .objs
                .qps
                .get(&peer)
                .is_some_and(|q| q.resp.rx.is_none())
            {
                let Some(head) = self.recv_head(peer) else {
                    // UC: the message is dropped; RC: try again later.
                    return if uc {
                        Response::Unacknowledged
                    } else {
                        Response::RnrNak { timer }
                    };
                };
                let prot_ok = self.check_sges(pvnic, ppd, &head.sges, true);
                let Some(wqe) = self.pop_recv(peer) else {
                    return Response::Nak(Nak::InvalidRequest);
                };
                if !prot_ok {
                    // Its own receive buffer is bad: that receive fails, and the requester
                    // learns a remote operational error.
                    self.finish_recv(peer, wqe, WcStatus::LocProtErr, None, req);
                    return self.refuse(peer, Nak::RemoteOperational);
                }
                if let Some(q) = self.objs.qps.get_mut(&peer) {
                    q.resp.rx = Some(Rx { wqe, off: 0, cq });
                }
            }
        }
        let Some(q) = self.objs.qps.get_mut(&peer) else {
            return Response::Nak(Nak::InvalidRequest);
        };
        if q.resp.rx_lost {
            return Response::Unacknowledged;
        }
        let Some(rx) = q.resp.rx.take() else {
            // A middle or last segment with no message in progress.
            return self.refuse(peer, Nak::InvalidRequest);
        };
        let capacity: u64 = rx.wqe.sges.iter().map(|s| u64::from(s.length)).sum();
        let n = req.payload.len();
        if rx.off.saturating_add(n) > capacity {
            self.finish_recv(peer, rx.wqe, WcStatus::LocLenErr, None, req);
            return self.refuse(peer, Nak::InvalidRequest);
        }
        let mut dst = std::mem::take(&mut self.scratch.scratch_place);
        dst.clear();
        // Checked when the receive was taken, so it cannot fail.
        let _ = self.sge_runs(pvnic, &rx.wqe.sges, rx.off, n, &mut dst);
        let placed = place(mem, req.payload, &dst);
        self.scratch.scratch_place = dst;
        if placed.is_err() {
            // A copy the daemon could not make: the receive fails, and the requester learns a
            // remote operational error (UC: nothing is answered, the receive still fails).
            self.finish_recv(peer, rx.wqe, WcStatus::GeneralErr, None, req);
            return self.refuse(peer, Nak::RemoteOperational);
        }
        let off = rx.off + n;
        if req.last
            && req.op == Op::SendInv
            && self
                .invalidate_mw(pvnic, ppd, req.rkey, Some(peer))
                .is_err()
        {
            // The R_Key names no type 2 window bound to this QP (IB class J, as rxe): the
            // receive fails and the QP with it.
            self.finish_recv(peer, rx.wqe, WcStatus::RemInvReqErr, None, req);
            return self.refuse(peer, Nak::InvalidRequest);
        }
        if req.last {
            self.finish_recv(peer, rx.wqe, WcStatus::Success, Some(off), req);
        } else if let Some(q) = self.objs.qps.get_mut(&peer) {
            q.resp.rx = Some(Rx {
                wqe: rx.wqe,
                off,
                cq: rx.cq,
            });
        }
        Response::Ack
    }

    /// RDMA WRITE: the payload at `va` under `rkey`; WITH_IMM's last segment also takes a
    /// receive (no receive: RNR).
    fn place_write(
        &mut self,
        peer: QpId,
        at: WriteAt,
        req: &Request,
        mem: &mut dyn Memory,
    ) -> Response {
        let WriteAt {
            timer,
            write_len,
            lost,
            ready,
        } = at;
        // The QP's type is the request's (`handle_request` checked it).
        let uc = req.transport == QpType::Uc;
        if req.last && req.imm.is_some() && self.recv_empty(peer) {
            return if uc {
                Response::Unacknowledged
            } else {
                Response::RnrNak { timer }
            };
        }
        if req.first
            && (write_len != req.len || lost)
            && let Some(q) = self.objs.qps.get_mut(&peer)
        {
            // The RETH's DMA length, which a receive it consumes reports.
            q.resp.write_len = req.len;
            q.resp.rx_lost = false;
        }
        if uc && !req.first && lost {
            // UC: the rest of a WRITE that lost a segment is dropped.
            return Response::Unacknowledged;
        }
        let n = req.payload.len();
        let mut dst = std::mem::take(&mut self.scratch.scratch_place);
        if !ready {
            dst.clear();
        }
        // A zero-length write names no memory, so its rkey is not checked (IB C9-88, as rxe).
        let ok = req.len == 0
            || ready
            || self
                .remote_runs(
                    peer,
                    req.va,
                    req.len,
                    n,
                    req.first,
                    req.rkey,
                    access::REMOTE_WRITE,
                    &mut dst,
                )
                .is_some();
        let placed = if ok {
            place(mem, req.payload, &dst)
        } else {
            Ok(())
        };
        self.scratch.scratch_place = dst;
        if placed.is_err() {
            // A copy the daemon could not make.
            return if uc {
                Response::Unacknowledged
            } else {
                self.refuse(peer, Nak::RemoteOperational)
            };
        }
        if !ok {
            // UC drops a write it may not perform, and stays up; RC fails.
            return if uc {
                Response::Unacknowledged
            } else {
                self.refuse(peer, Nak::RemoteAccess)
            };
        }
        if req.last
            && req.imm.is_some()
            && let Some(wqe) = self.pop_recv(peer)
        {
            let total = self.objs.qps.get(&peer).map_or(0, |q| q.resp.write_len);
            self.finish_recv(peer, wqe, WcStatus::Success, Some(total), req);
        }
        Response::Ack
    }

    /// RDMA READ: the responder's runs of `[va, va + chunk)` into `back`.
    fn locate_read(&mut self, peer: QpId, req: &Request, back: &mut Vec<(Loc, u64)>) -> Response {
        back.clear();
        if req.len == 0 {
            return Response::ReadData;
        }
        let found = self.remote_runs(
            peer,
            req.va,
            req.len,
            req.chunk,
            req.first,
            req.rkey,
            access::REMOTE_READ,
            back,
        );
        if found.is_none() {
            back.clear();
            return self.refuse(peer, Nak::RemoteAccess);
        }
        Response::ReadData
    }

    /// ATOMIC: compare-and-swap or fetch-and-add on the aligned 8 bytes at `va`.
    fn perform_atomic(&mut self, peer: QpId, req: &Request, mem: &mut dyn Memory) -> Response {
        if !req.va.is_multiple_of(8) {
            return self.refuse(peer, Nak::InvalidRequest);
        }
        let mut dst = std::mem::take(&mut self.scratch.scratch_place);
        dst.clear();
        let found = self
            .remote_mr(peer, req.va, 8, req.rkey, access::REMOTE_ATOMIC)
            .and_then(|m| translate(m, req.va, 8, &mut dst));
        // An aligned 8-byte word never crosses a page, so it is one run.
        let at = found.and_then(|()| dst.first().map(|&(at, _)| at));
        self.scratch.scratch_place = dst;
        let Some(at) = at else {
            return self.refuse(peer, Nak::RemoteAccess);
        };
        let mut old = [0u8; 8];
        if mem.read(at, &mut old).is_err() {
            return self.refuse(peer, Nak::RemoteOperational);
        }
        let cur = u64::from_le_bytes(old);
        let new = match req.op {
            Op::CmpSwap { compare, swap } => (cur == compare).then_some(swap),
            Op::FetchAdd { add } => Some(cur.wrapping_add(add)),
            _ => None,
        };
        if let Some(v) = new
            && mem.write(at, &v.to_le_bytes()).is_err()
        {
            return self.refuse(peer, Nak::RemoteOperational);
        }
        Response::AtomicAck(cur)
    }

    /// ATOMIC WRITE (IBA 1.5, as rxe's responder): the R_Key must grant remote write
    /// (`REMOTE_WRITE` on the QP and on the MR or window, not `REMOTE_ATOMIC`) over the 8 bytes
    /// at `va`, else a remote access NAK; then the word must be 8-aligned (the address and the
    /// memory behind it), else an invalid request NAK, as rxe's misaligned atomic. The bytes
    /// go in by one atomic store ([`Memory::store_u64`]), after everything this QP placed
    /// before.
    fn perform_atomic_write(
        &mut self,
        peer: QpId,
        req: &Request,
        mem: &mut dyn Memory,
    ) -> Response {
        let data = match req.payload {
            Payload::Bytes(b) if req.len == 8 => <[u8; 8]>::try_from(b).ok(),
            _ => None,
        };
        let Some(data) = data else {
            return self.refuse(peer, Nak::InvalidRequest);
        };
        let mut dst = std::mem::take(&mut self.scratch.scratch_place);
        dst.clear();
        let found = self
            .remote_mr(peer, req.va, 8, req.rkey, access::REMOTE_WRITE)
            .and_then(|m| translate(m, req.va, 8, &mut dst));
        let at = match (found, dst.as_slice()) {
            (None, _) => Err(Nak::RemoteAccess),
            (Some(()), &[(at, 8)]) if req.va.is_multiple_of(8) && at.off.is_multiple_of(8) => {
                Ok(at)
            }
            // Misaligned (an aligned word never crosses a page, so it is one run).
            (Some(()), _) => Err(Nak::InvalidRequest),
        };
        self.scratch.scratch_place = dst;
        let at = match at {
            Ok(at) => at,
            Err(nak) => return self.refuse(peer, nak),
        };
        if mem.store_u64(at, data).is_err() {
            return self.refuse(peer, Nak::RemoteOperational);
        }
        Response::Ack
    }

    /// A UD datagram: to a receive of this QP if the Q_Key matches; otherwise (or with no
    /// receive posted) it is dropped. The receive gets the GRH (if any) in its first
    /// [`GRH_LEN`] bytes and the payload after it.
    fn handle_datagram(&mut self, peer: QpId, req: &Request, mem: &mut dyn Memory) -> Response {
        let Some(p) = self.objs.qps.get(&peer) else {
            return Response::Unacknowledged;
        };
        let (pvnic, ppd) = (p.vnic, p.pd);
        if p.attr.qkey != req.qkey {
            self.meter_ud_drop(peer, pvnic);
            return Response::Unacknowledged;
        }
        let Some(head) = self.recv_head(peer) else {
            self.meter_ud_drop(peer, pvnic);
            return Response::Unacknowledged;
        };
        let capacity: u64 = head.sges.iter().map(|s| u64::from(s.length)).sum();
        let prot_ok = self.check_sges(pvnic, ppd, &head.sges, true);
        let len = req.payload.len();
        let Some(wqe) = self.pop_recv(peer) else {
            return Response::Unacknowledged;
        };
        if !prot_ok {
            self.finish_recv(peer, wqe, WcStatus::LocProtErr, None, req);
            self.fail_qp(peer, None);
            return Response::Unacknowledged;
        }
        if len + GRH_LEN > capacity {
            self.finish_recv(peer, wqe, WcStatus::LocLenErr, None, req);
            return Response::Unacknowledged;
        }
        let mut dst = std::mem::take(&mut self.scratch.scratch_place);
        dst.clear();
        // Checked just above, so neither can fail.
        let mut placed = Ok(());
        if let Some(g) = &req.grh {
            let _ = self.sge_runs(pvnic, &wqe.sges, 0, GRH_LEN, &mut dst);
            placed = scatter_bytes(mem, g, &dst);
            dst.clear();
        }
        let _ = self.sge_runs(pvnic, &wqe.sges, GRH_LEN, len, &mut dst);
        let placed = placed.and_then(|()| place(mem, req.payload, &dst));
        self.scratch.scratch_place = dst;
        if placed.is_err() {
            // A copy the daemon could not make: the receive fails (a datagram is not answered).
            self.finish_recv(peer, wqe, WcStatus::GeneralErr, None, req);
            return Response::Unacknowledged;
        }
        self.finish_recv(peer, wqe, WcStatus::Success, Some(len + GRH_LEN), req);
        Response::Unacknowledged
    }

    /// A UD datagram dropped at QP `peer` of `vnic` (wrong Q_Key, no receive).
    fn meter_ud_drop(&mut self, peer: QpId, vnic: VnicId) {
        let m = match self.objs.qps.get_mut(&peer) {
            Some(q) => &mut q.meter,
            None => match self.objs.vnics.get_mut(&vnic) {
                Some(v) => &mut v.meter,
                None => return,
            },
        };
        m.ud_dropped = m.ud_dropped.wrapping_add(1);
    }

    /// Completes a receive taken by a message from `req`'s requester: `byte_len` bytes on
    /// success, with the immediate,
    /// source and solicited flag of the message; an error completion otherwise.
    fn finish_recv(
        &mut self,
        peer: QpId,
        wqe: RecvWqe,
        status: WcStatus,
        byte_len: Option<u64>,
        req: &Request,
    ) {
        let Some(p) = self.objs.qps.get(&peer) else {
            return;
        };
        let cq = self.responder_cq(p);
        let opcode = if req.op == Op::Write {
            WcOpcode::RecvRdmaWithImm
        } else {
            WcOpcode::Recv
        };
        let mut c = cqe(wqe.wr_id, status, opcode, p.qpn);
        let mut solicited = false;
        if status == WcStatus::Success && matches!(req.op, Op::Send | Op::SendInv) {
            let grh = if req.transport == QpType::Ud {
                GRH_LEN
            } else {
                0
            };
            let n = byte_len.unwrap_or(0).saturating_sub(grh);
            if let Some(q) = self.objs.qps.get_mut(&peer) {
                q.meter.received(req.op, true, n);
            }
        }
        if let Some(n) = byte_len {
            c.byte_len = n as u32;
            c.src_qp = req.src_qpn;
            c.slid = req.slid;
            if req.grh.is_some() {
                c.wc_flags |= WC_GRH;
            }
            if let Some(i) = req.imm {
                c.imm_data = i;
                c.wc_flags |= WC_WITH_IMM;
            }
            if req.op == Op::SendInv {
                // `invalidated_rkey`, the same union as `imm_data`, in host order.
                c.imm_data = req.rkey;
                c.wc_flags |= WC_WITH_INV;
            }
            solicited = req.solicited;
        }
        self.out.completions.push_back((cq, c, solicited));
    }

    /// The receive a message to `qp` would land in: the head of its SRQ (for an XRC receive
    /// QP, the SRQ it serves) or of its own queue.
    pub(super) fn recv_head(&self, qp: QpId) -> Option<&RecvWqe> {
        let q = self.objs.qps.get(&qp)?;
        match q.srq.or(q.xrc_srq) {
            Some(s) => self.objs.srqs.get(&s)?.rq.front(),
            None => q.rq.front(),
        }
    }

    pub(super) fn recv_empty(&self, qp: QpId) -> bool {
        self.recv_head(qp).is_none()
    }

    /// Takes the receive a message to `qp` lands in. Taking from an SRQ below its armed limit
    /// raises `SRQ_LIMIT_REACHED` (once; the limit disarms).
    pub(super) fn pop_recv(&mut self, qp: QpId) -> Option<RecvWqe> {
        let q = self.objs.qps.get_mut(&qp)?;
        let Some(sid) = q.srq.or(q.xrc_srq) else {
            let r = q.rq.pop_front()?;
            q.rq_retired = q.rq_retired.wrapping_add(1);
            touch(&mut self.sched.touched, qp, q);
            return Some(r);
        };
        let s = self.objs.srqs.get_mut(&sid)?;
        let r = s.rq.pop_front()?;
        s.retired = s.retired.wrapping_add(1);
        touch_srq(&mut self.sched.touched_srqs, sid, s);
        if s.limit > 0 && (s.rq.len() as u32) < s.limit {
            s.limit = 0;
            let ctx = s.ctx;
            self.out
                .events
                .push_back((ctx, Event::SrqLimit { srq: sid }));
        }
        Some(r)
    }
}

/// Copies a segment's payload into the `dst` runs (one copy per byte).
fn place(mem: &mut dyn Memory, payload: Payload, dst: &[(Loc, u64)]) -> Result<(), MemoryRefused> {
    match payload {
        Payload::Empty => Ok(()),
        Payload::Runs(src) => copy_runs(mem, src, dst, payload.len()),
        Payload::Bytes(b) => scatter_bytes(mem, b, dst),
        // Read from the link into `dst` already (only where `Engine::placement` said).
        Payload::Placed(_) => Ok(()),
    }
}

/// Counts what request `req` did at a responder (its answer `r`), on that QP's meter: a WRITE
/// segment placed, a READ served, an atomic executed, an RNR NAK or a NAK sent. (A SEND counts
/// when its receive completes, in [`Engine::finish_recv`].)
fn meter_request(m: &mut Meter, req: &Request, r: Response) {
    match (req.op, r) {
        (Op::Write, Response::Ack) => m.received(req.op, req.last, req.chunk),
        (Op::Read, Response::ReadData) => m.received(req.op, req.chunk >= req.len, req.chunk),
        (Op::CmpSwap { .. } | Op::FetchAdd { .. }, Response::AtomicAck(_))
        | (Op::AtomicWrite, Response::Ack) => m.received(req.op, true, 8),
        (_, Response::RnrNak { .. }) => m.rnr_naks = m.rnr_naks.wrapping_add(1),
        (_, Response::Nak(_)) => m.naks = m.naks.wrapping_add(1),
        _ => {}
    }
}
