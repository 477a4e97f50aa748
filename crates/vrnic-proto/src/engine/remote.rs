//! The two ends of a message across a peer link: segments leave as frames
//! ([`Engine::poll_transmit`]) and arrive as frames ([`Engine::handle_segment`]).
//!
//! A requester whose route is [`Route::Remote`] does not wait for each segment's answer: it
//! sends the segments of its WQEs in order, up to [`WINDOW`] unanswered, and keeps each WQE
//! (and its PSNs, a [`Flight`]) until the answer arrives: an ACK (cumulative, coalesced by the
//! responder: one per QP per transmit round; it answers SENDs, WRITEs and ATOMIC WRITEs), the
//! READ response with its data, or the atomic ACK with the original value. An RNR NAK or a PSN sequence NAK rewinds it to that PSN
//! (go-back-N); another NAK fails the WQE it names; no answer at all for the QP's
//! `timeout × (retry_cnt + 1)` fails it with `RETRY_EXC_ERR`. A link that comes back
//! ([`Engine::handle_link_up`]) makes every QP over it send again from its oldest unanswered
//! segment, and the responder answers what it had already executed as duplicates, so nothing
//! is lost or done twice.
//!
//! Segments carry at most [`SEGMENT`] bytes, so a READ request asks for at most one frame of
//! data and every request takes one PSN. The responder side turns a frame into the same
//! [`Request`] a local requester hands over (the RDMA WRITE's RETH is only on its first
//! segment: the responder keeps the cursor) and runs it through the same checks.

use super::memory::Grant;
use super::responder::Admit;
use std::collections::VecDeque;

use vrnic_wire::GlobalRoute;
use vrnic_wire::frame::{
    AddrRepr, Aeth, AtomicAckEth, AtomicEth, Deth, Frame, FrameRepr, GrhRepr, NakCode,
    Op as WireOp, Opcode, QPN_MASK, Reth, SegmentRepr, Syndrome, Transport,
};

use super::segment::{
    Nak, Op, Payload, Request, Response, Route, Src, psn_after, psn_cmp, psn_next, psn_prev,
};
use super::*;

/// Most payload bytes in one segment over a peer link (one frame).
pub const SEGMENT: u64 = vrnic_wire::frame::MAX_PAYLOAD as u64;
/// Most unanswered segments one QP keeps in flight over a peer link.
pub const WINDOW: u32 = 512;
/// Most unanswered full segments ([`SEGMENT`] bytes) one QP keeps in flight over a peer link:
/// 4 MiB. What is in flight has to cross the link (and, with engine threads, the channels
/// between the threads and the loop) well within the QP's local ACK timeout (67 ms for
/// perftest's default): 512 full segments (32 MiB) did not on a loaded 2-core host, every
/// timeout sent the whole window again behind the first copy, and the QP failed with
/// `RETRY_EXC_ERR` though nothing was lost.
pub const WINDOW_FULL: u32 = 64;

/// A frame to send: to `host`, these headers, this payload.
#[derive(Debug)]
pub struct Transmit {
    /// The peer daemon.
    pub host: HostId,
    /// The destination vRNIC's LID, the sending vRNIC's and the sending QP's number.
    pub addr: AddrRepr,
    /// The GRH (UD segments sent along a global route).
    pub grh: Option<GrhRepr>,
    /// The transport headers.
    pub segment: SegmentRepr,
    /// The payload (`segment.payload_len` bytes).
    pub payload: TxPayload,
}

/// A segment's payload as the engine receives it from a peer link.
#[derive(Debug, Clone, Copy)]
enum Incoming<'a> {
    /// In the frame, to be copied into place.
    Bytes(&'a [u8]),
    /// This many bytes, read by the driver into the runs of a [`Placement`] already.
    Placed(usize),
}

impl Incoming<'_> {
    fn len(&self) -> usize {
        match self {
            Incoming::Bytes(b) => b.len(),
            Incoming::Placed(n) => *n,
        }
    }
}

/// Leave to read a segment's payload from a peer link straight into registered memory: see
/// [`Engine::placement`]. Valid while [`Engine::placement_holds`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[must_use]
pub struct Placement {
    generation: u64,
}

impl Placement {
    /// A placement that never holds (no engine's memory generation is 0): for a driver's own
    /// tests of how it reads payloads into place.
    pub fn stale() -> Self {
        Placement { generation: 0 }
    }
}

/// What a segment's frame says besides its transport headers: the address word (whom it is for
/// and from, as its sender's daemon wrote it) and the GRH, which only UD segments carry.
#[derive(Debug, Clone, Copy, Default)]
pub struct Sender<'a> {
    /// The destination vRNIC's LID, the sending vRNIC's and the sending QP's number.
    pub addr: AddrRepr,
    /// The global route header.
    pub grh: Option<&'a GrhRepr>,
}

impl Transmit {
    fn repr(&self) -> FrameRepr {
        FrameRepr::Segment {
            addr: self.addr,
            grh: self.grh,
            segment: self.segment,
        }
    }

    /// Bytes of the whole frame.
    pub fn frame_len(&self) -> usize {
        self.repr().buffer_len()
    }

    /// The whole frame, appended to `out`: headers, then the payload copied out of registered
    /// memory (the frame's one copy on this side). Returns `false`, appending nothing, if the
    /// headers are inconsistent (a bug: the engine builds them).
    pub fn encode(&self, mem: &mut dyn Memory, out: &mut Vec<u8>) -> bool {
        let start = out.len();
        out.resize(start + self.frame_len(), 0);
        let ok = self.encode_into(mem, &mut out[start..]);
        if !ok {
            out.truncate(start);
        }
        ok
    }

    /// Where the payload sits in the frame.
    pub fn payload_range(&self) -> std::ops::Range<usize> {
        self.repr().payload_range()
    }

    /// The payload's runs of registered memory, if that is where it is (a sender that writes
    /// them to the link itself, without [`encode_into`](Self::encode_into)'s copy, uses
    /// [`encode_headers`](Self::encode_headers) for the rest).
    pub fn runs(&self) -> Option<&[(Loc, u64)]> {
        match &self.payload {
            TxPayload::Runs(r) => Some(r),
            _ => None,
        }
    }

    /// Every byte of the frame but the payload, into the first
    /// [`frame_len`](Self::frame_len) bytes of `out` (the payload's range is left as it was).
    /// `false` if the headers are inconsistent or `out` is too short.
    pub fn encode_headers(&self, out: &mut [u8]) -> bool {
        let repr = self.repr();
        let len = repr.buffer_len();
        if repr.check().is_err() || out.len() < len {
            return false;
        }
        repr.emit(&mut Frame::new_unchecked(&mut out[..len]));
        true
    }

    /// [`encode`](Self::encode) into the first [`frame_len`](Self::frame_len) bytes of `out`,
    /// whatever they held: every byte of the frame is written. `false` if the headers are
    /// inconsistent or `out` is too short.
    pub fn encode_into(&self, mem: &mut dyn Memory, out: &mut [u8]) -> bool {
        let repr = self.repr();
        let len = repr.buffer_len();
        if repr.check().is_err() || out.len() < len {
            return false;
        }
        let out = &mut out[..len];
        repr.emit(&mut Frame::new_unchecked(&mut *out));
        let range = repr.payload_range();
        let body = &mut out[range];
        let filled = match &self.payload {
            TxPayload::Empty => 0,
            TxPayload::Bytes(b) => {
                let n = b.len().min(body.len());
                body[..n].copy_from_slice(&b[..n]);
                n
            }
            TxPayload::Runs(runs) => {
                let mut at = 0usize;
                for &(loc, n) in runs {
                    let n = usize::try_from(n)
                        .unwrap_or(usize::MAX)
                        .min(body.len() - at);
                    if mem.read(loc, &mut body[at..at + n]).is_err() {
                        // Memory its tenant took away (its vRNIC goes): zeros, never stale
                        // bytes of an earlier frame.
                        body[at..at + n].fill(0);
                    }
                    at += n;
                }
                at
            }
        };
        // The payload always fills its range (the engine sizes it so); never send stale bytes.
        body[filled..].fill(0);
        true
    }
}

/// Where a transmitted segment's payload is.
#[derive(Debug)]
pub enum TxPayload {
    /// None.
    Empty,
    /// In registered memory: copy these region runs out when writing the frame.
    Runs(Vec<(Loc, u64)>),
    /// Inline data of the work request.
    Bytes(Vec<u8>),
}

/// A WQE sent, wholly or partly, over a peer link, at the same index of its QP's send queue.
#[derive(Debug, Clone, Copy)]
pub(super) struct Flight {
    /// PSN of its first segment.
    pub(super) first_psn: u32,
    /// PSN after its last segment sent.
    next_psn: u32,
    /// Bytes sent (READ: asked for).
    pub(super) sent: u64,
    /// All of it sent.
    whole: bool,
    /// Answered: ACKed (SEND, WRITE), or its data or value arrived (READ, atomics).
    done: bool,
    /// READ: bytes of response data placed.
    got: u64,
}

impl Engine {
    /// Makes a vRNIC behind a peer link known: routes to its LID and GID go there.
    /// (In the default group; see [`Engine::add_remote_vnic_in_group`].)
    pub fn add_remote_vnic(&mut self, host: HostId, lid: u16, gid: [u8; 16]) {
        self.add_remote_vnic_in_group(host, lid, gid, GroupId(0));
    }

    /// Forgets a remote vRNIC (its daemon said it is gone). QPs already routed to it keep
    /// their route and learn from silence.
    pub fn remove_remote_vnic(&mut self, lid: u16, gid: [u8; 16]) {
        self.routes.generation += 1;
        self.routes.remote_lids.remove(&lid);
        self.routes.remote_gids.remove(&gid);
    }

    /// The peer link to `host` broke (a malformed frame: the peer is broken or hostile): every
    /// QP routed over it moves to ERR, its head WQE completing with `RETRY_EXC_ERR`.
    pub fn fail_host(&mut self, now: Instant, host: HostId) {
        let _ = now;
        let qps: Vec<QpId> = self
            .objs
            .qps
            .iter()
            .filter(|(_, q)| {
                q.route == Route::Remote(host)
                    && matches!(q.attr.qp_state, QpState::Rtr | QpState::Rts | QpState::Sqd)
            })
            .map(|(&id, _)| id)
            .collect();
        for qp in qps {
            self.fail_qp(qp, Some(WcStatus::RetryExcErr));
        }
    }

    /// The next frame to send, if any: segments in the order they were made, then one
    /// coalesced ACK per responder QP that owes one.
    #[must_use]
    pub fn poll_transmit(&mut self) -> Option<Transmit> {
        if let Some(t) = self.out.outbox.pop_front() {
            return Some(t);
        }
        while let Some(qp) = self.out.acks_due.pop() {
            let Some(q) = self.objs.qps.get_mut(&qp) else {
                continue;
            };
            let (Some(psn), Route::Remote(host)) = (q.link.ack_due.take(), q.route) else {
                continue;
            };
            let seg = answer(
                answer_transport(q),
                q.attr.dest_qp_num,
                psn,
                Syndrome::Ack { credits: 31 },
            );
            return Some(Transmit {
                host,
                addr: q.addr,
                grh: None,
                segment: seg,
                payload: TxPayload::Empty,
            });
        }
        None
    }

    /// A peer link (re)connected: every QP routed over it sends again from its oldest
    /// unanswered segment.
    pub fn handle_link_up(&mut self, host: HostId) {
        let qps: Vec<QpId> = self
            .objs
            .qps
            .iter()
            .filter(|(_, q)| q.route == Route::Remote(host) && !q.link.flights.is_empty())
            .map(|(&id, _)| id)
            .collect();
        tracing::debug!(
            ?host,
            qps = qps.len(),
            "link up: sending again what is unanswered"
        );
        for qp in qps {
            let Some(q) = self.objs.qps.get(&qp) else {
                continue;
            };
            if let Some(f) = q.link.flights.iter().find(|f| !f.done) {
                let psn = f.first_psn;
                self.rewind(qp, psn);
            }
        }
    }

    /// The next segment of the WQE after those sent, over a peer link. RC WQEs stay queued
    /// until answered; UC ones complete when sent.
    pub(super) fn step_remote(&mut self, now: Instant, qp: QpId, host: HostId) -> Step {
        let Some(q) = self.objs.qps.get(&qp) else {
            return Step::Blocked;
        };
        let idx = q.link.sq_sent;
        let (vnic, uc, xrc) = (q.vnic, q.ty == QpType::Uc, q.ty == QpType::XrcSend);
        let wqe = match q.sq.get(idx) {
            Some(Ok(w)) => w.clone(),
            Some(Err(_)) if idx == 0 => {
                self.fail_qp(qp, Some(WcStatus::LocQpOpErr));
                return Step::Done(0);
            }
            // Fails in its turn, when those before it are answered.
            Some(Err(_)) => {
                self.stall(qp);
                return Step::Blocked;
            }
            None => return Step::Blocked,
        };
        let sent = q.link.flights.get(idx).map_or(0, |f| f.sent);
        let len = wqe.payload.len();
        if sent == 0 {
            let local = self.refused_locally(qp, &wqe, None);
            if let Some(status) = local {
                if idx > 0 {
                    // In order: it fails when it is the head.
                    self.stall(qp);
                    return Step::Blocked;
                }
                self.fail_qp(qp, Some(status));
                return Step::Done(0);
            }
        }
        let Some(q) = self.objs.qps.get(&qp) else {
            return Step::Blocked;
        };
        let (psn, addr) = (q.attr.sq_psn, q.addr);
        let atomic = matches!(
            wqe.opcode,
            SendOpcode::AtomicCmpAndSwp | SendOpcode::AtomicFetchAndAdd
        );
        let n = if atomic {
            0
        } else {
            len.saturating_sub(sent).min(SEGMENT)
        };
        let (first, last) = (sent == 0, atomic || sent + n >= len);
        let t = match (uc, xrc) {
            (true, _) => Transport::Uc,
            (_, true) => Transport::Xrc,
            _ => Transport::Rc,
        };
        let imm = matches!(
            wqe.opcode,
            SendOpcode::SendWithImm | SendOpcode::RdmaWriteWithImm
        );
        let op = match wqe.opcode {
            SendOpcode::Send | SendOpcode::SendWithImm => match (first, last) {
                (true, true) if imm => WireOp::SendOnlyWithImm,
                (true, true) => WireOp::SendOnly,
                (true, false) => WireOp::SendFirst,
                (false, false) => WireOp::SendMiddle,
                (false, true) if imm => WireOp::SendLastWithImm,
                (false, true) => WireOp::SendLast,
            },
            SendOpcode::RdmaWrite | SendOpcode::RdmaWriteWithImm => match (first, last) {
                (true, true) if imm => WireOp::RdmaWriteOnlyWithImm,
                (true, true) => WireOp::RdmaWriteOnly,
                (true, false) => WireOp::RdmaWriteFirst,
                (false, false) => WireOp::RdmaWriteMiddle,
                (false, true) if imm => WireOp::RdmaWriteLastWithImm,
                (false, true) => WireOp::RdmaWriteLast,
            },
            // RC only (`Engine::step` fails it on UC): the last segment carries the IETH.
            SendOpcode::SendWithInv => match (first, last) {
                (true, true) => WireOp::SendOnlyWithInvalidate,
                (true, false) => WireOp::SendFirst,
                (false, false) => WireOp::SendMiddle,
                (false, true) => WireOp::SendLastWithInvalidate,
            },
            SendOpcode::RdmaRead => WireOp::RdmaReadRequest,
            SendOpcode::AtomicCmpAndSwp => WireOp::CompareSwap,
            SendOpcode::AtomicFetchAndAdd => WireOp::FetchAdd,
            // A RETH (DMA length 8) and its 8 inline bytes as the payload.
            SendOpcode::AtomicWrite => WireOp::AtomicWrite,
            // Never sent over a peer link: `Engine::step` executes them first.
            SendOpcode::LocalInv | SendOpcode::BindMw => {
                return Step::Blocked;
            }
        };
        let Some(opcode) = Opcode::new(t, op) else {
            return Step::Blocked;
        };
        let mut seg = SegmentRepr::new(opcode, q.attr.dest_qp_num, psn);
        seg.ack_req = last;
        seg.solicited = last && wqe.flags.contains(SendFlags::SOLICITED);
        let ext = opcode.ext_headers();
        if ext.contains(&vrnic_wire::frame::ExtHeader::XrcEth) {
            seg.xrc_srqn = Some(wqe.xrc_srqn & QPN_MASK);
        }
        if ext.contains(&vrnic_wire::frame::ExtHeader::Reth) {
            seg.reth = Some(Reth {
                va: wqe.remote_addr.wrapping_add(sent),
                rkey: wqe.rkey,
                dma_len: if op == WireOp::RdmaReadRequest {
                    n as u32
                } else {
                    len as u32
                },
            });
        }
        if ext.contains(&vrnic_wire::frame::ExtHeader::ImmDt) {
            seg.imm = Some(wqe.imm_data);
        }
        if ext.contains(&vrnic_wire::frame::ExtHeader::Ieth) {
            // The R_Key to invalidate (the WR's `invalidate_rkey`, the union with imm_data).
            seg.invalidate_rkey = Some(wqe.imm_data);
        }
        if atomic {
            seg.atomic = Some(AtomicEth {
                va: wqe.remote_addr,
                rkey: wqe.rkey,
                swap_add: if op == WireOp::CompareSwap {
                    wqe.swap
                } else {
                    wqe.compare_add
                },
                compare: if op == WireOp::CompareSwap {
                    wqe.compare_add
                } else {
                    0
                },
            });
        }
        let payload = if opcode.has_payload() {
            seg.payload_len = n as usize;
            match &wqe.payload {
                SendPayload::Inline(data) => TxPayload::Bytes(
                    data.get(sent as usize..(sent + n) as usize)
                        .unwrap_or_default()
                        .to_vec(),
                ),
                SendPayload::Sges(sges) => {
                    let mut runs = Vec::new();
                    // Checked by `check_sges` at the first segment, so it cannot fail.
                    let _ = self.sge_runs(vnic, sges, sent, n, &mut runs);
                    TxPayload::Runs(runs)
                }
            }
        } else {
            TxPayload::Empty
        };
        self.out.outbox.push_back(Transmit {
            host,
            addr,
            grh: None,
            segment: seg,
            payload,
        });
        let Some(q) = self.objs.qps.get_mut(&qp) else {
            return Step::Blocked;
        };
        q.attr.sq_psn = psn_next(psn);
        if q.link.flights.is_empty() {
            q.link.una = psn;
        }
        if uc {
            if last {
                q.link.flights.clear();
                self.complete_head(qp, len as u32);
                return Step::Done(n);
            }
            if let Some(f) = q.link.flights.get_mut(0) {
                f.sent += n;
            } else {
                q.link.flights.push_back(Flight {
                    first_psn: psn,
                    next_psn: psn_next(psn),
                    sent: n,
                    whole: false,
                    done: false,
                    got: 0,
                });
            }
            return Step::Partial(n);
        }
        match q.link.flights.get_mut(idx) {
            Some(f) => {
                f.sent += n;
                f.next_psn = psn_next(psn);
                f.whole = last;
            }
            None => q.link.flights.push_back(Flight {
                first_psn: psn,
                next_psn: psn_next(psn),
                sent: n,
                whole: last,
                done: false,
                got: 0,
            }),
        }
        if q.link.ack_until.is_none() {
            q.link.ack_until = Some(now + ack_budget(q));
            q.link.ack_tries = 0;
            let until = now + ack_budget(q);
            self.arm(qp, until);
        }
        let Some(q) = self.objs.qps.get_mut(&qp) else {
            return Step::Blocked;
        };
        if last {
            q.link.sq_sent += 1;
            return Step::Sent(n);
        }
        Step::Partial(n)
    }

    /// A UD datagram over a peer link: one frame, and the WQE completes.
    pub(super) fn transmit_datagram(
        &mut self,
        host: HostId,
        qp: QpId,
        wqe: &SendWqe,
        qkey: u32,
        attr: &AhAttr,
    ) {
        let Some(q) = self.objs.qps.get(&qp) else {
            return;
        };
        let (vnic, qpn) = (q.vnic, q.qpn);
        let imm = wqe.opcode == SendOpcode::SendWithImm;
        let op = if imm {
            WireOp::SendOnlyWithImm
        } else {
            WireOp::SendOnly
        };
        let Some(opcode) = Opcode::new(Transport::Ud, op) else {
            return;
        };
        let len = wqe.payload.len();
        let mut seg = SegmentRepr::new(opcode, wqe.ud.remote_qpn, 0);
        seg.deth = Some(Deth { qkey, src_qpn: qpn });
        seg.imm = imm.then_some(wqe.imm_data);
        seg.solicited = wqe.flags.contains(SendFlags::SOLICITED);
        seg.payload_len = len as usize;
        let grh = attr.is_global.then(|| GrhRepr {
            traffic_class: attr.grh.traffic_class,
            flow_label: attr.grh.flow_label & 0xf_ffff,
            hop_limit: attr.grh.hop_limit,
            sgid: self
                .objs
                .vnics
                .get(&vnic)
                .map(|v| v.gid)
                .unwrap_or_default(),
            dgid: attr.grh.dgid,
        });
        let payload = match &wqe.payload {
            SendPayload::Inline(d) => TxPayload::Bytes(d.to_vec()),
            SendPayload::Sges(sges) => {
                let mut runs = Vec::new();
                let _ = self.sge_runs(vnic, sges, 0, len, &mut runs);
                TxPayload::Runs(runs)
            }
        };
        let addr = self.addr_to(vnic, qpn, Route::Remote(host), attr);
        self.out.outbox.push_back(Transmit {
            host,
            addr,
            grh,
            segment: seg,
            payload,
        });
    }

    /// A segment that arrived on the peer link of `host` (already decoded, strictly): a
    /// request for one of our QPs as responder, or an answer for one as requester. A segment
    /// for no QP, or for a QP not connected over that link, is dropped. `from`: what its frame
    /// says of its sender (UD).
    pub fn handle_segment(
        &mut self,
        now: Instant,
        host: HostId,
        from: Sender,
        seg: &SegmentRepr,
        payload: &[u8],
        mem: &mut dyn Memory,
    ) {
        tracing::trace!(?host, qpn = seg.dest_qpn, psn = seg.psn, op = ?seg.opcode.op(), "segment");
        self.dispatch(now, host, from, seg, Incoming::Bytes(payload), mem);
    }

    fn dispatch(
        &mut self,
        now: Instant,
        host: HostId,
        from: Sender,
        seg: &SegmentRepr,
        payload: Incoming,
        mem: &mut dyn Memory,
    ) {
        let Some(qp) = self.admitted(host, &from.addr, seg) else {
            return;
        };
        match seg.opcode.op() {
            WireOp::Acknowledge
            | WireOp::AtomicAcknowledge
            | WireOp::RdmaReadResponseFirst
            | WireOp::RdmaReadResponseMiddle
            | WireOp::RdmaReadResponseLast
            | WireOp::RdmaReadResponseOnly => self.handle_answer(now, host, qp, seg, payload, mem),
            _ => self.handle_remote_request(host, qp, from, seg, payload, mem),
        }
    }

    /// The QP a segment that came on `host`'s link is for, if it may reach it: the QP its BTH
    /// names is of the vRNIC its DLID names (a QP number reaches nothing of another vRNIC),
    /// its SLID is a vRNIC that link speaks for (one its host announced, or, from another
    /// engine of this daemon, a vRNIC with a slice here) and of the QP's group, and a
    /// connected QP (RC, UC, XRC) takes it only from its peer: that LID, that QP number, over
    /// that link. A UD segment's DETH names the QP of the address word. Anything else is
    /// dropped, as a port drops a packet that is not for it, and counted
    /// ([`Engine::segments_refused`]).
    fn admitted(&mut self, host: HostId, addr: &AddrRepr, seg: &SegmentRepr) -> Option<QpId> {
        self.admitted_to(host, addr, seg.dest_qpn, seg.deth.map(|d| d.src_qpn))
    }

    /// [`Engine::admitted`] by its parts: the destination QP number, and a UD segment's DETH
    /// source QP number (what a request from a sibling engine carries too).
    pub(super) fn admitted_to(
        &mut self,
        host: HostId,
        addr: &AddrRepr,
        dest_qpn: u32,
        deth_src: Option<u32>,
    ) -> Option<QpId> {
        let qp = self.objs.by_qpn.get(&dest_qpn).copied();
        let ok = qp.is_some_and(|qp| self.admits(host, addr, deth_src, qp));
        if !ok {
            self.refuse_segment(host, addr, dest_qpn, qp);
            return None;
        }
        qp
    }

    /// Counts (and traces) a segment from `host` for QP number `dest_qpn` (QP `qp` here, if
    /// any) that the address-word checks refused.
    pub(super) fn refuse_segment(
        &mut self,
        host: HostId,
        addr: &AddrRepr,
        dest_qpn: u32,
        qp: Option<QpId>,
    ) {
        self.routes.refused_segments += 1;
        let q = qp.and_then(|qp| self.objs.qps.get(&qp));
        tracing::trace!(
            ?host,
            qpn = dest_qpn,
            ?addr,
            vnic = ?q.map(|q| q.vnic),
            dlid_is = ?self.routes.by_lid.get(&addr.dlid),
            slid_is = ?self.routes.remote_lids.get(&addr.slid),
            route = ?q.map(|q| q.route),
            peer = ?q.map(|q| (q.addr, q.attr.dest_qp_num)),
            "segment refused"
        );
    }

    /// Whether connected QP `q` admitted the sender `host` with address word `addr` before,
    /// and no route changed since: then it is admitted again without lookups.
    pub(super) fn admitted_before(&self, q: &Qp, host: HostId, addr: &AddrRepr) -> bool {
        q.resp.admitted == Some((host, *addr, self.routes.generation)) && q.ty != QpType::Ud
    }

    /// Whether QP `qp` takes a segment from `host` with address word `addr` (and a datagram's
    /// source QP number `deth_src`): the QP of the vRNIC its destination LID resolved, a
    /// sender of its group, a connected QP's own peer (remembered for the next segment).
    pub(super) fn admits(
        &mut self,
        host: HostId,
        addr: &AddrRepr,
        deth_src: Option<u32>,
        qp: QpId,
    ) -> bool {
        let Some(q) = self.objs.qps.get(&qp) else {
            return false;
        };
        // A connected QP's peer, admitted before and unchanged since: no lookups.
        let generation = self.routes.generation;
        if self.admitted_before(q, host, addr) {
            return true;
        }
        let vnic = q.vnic;
        if self.routes.by_lid.get(&addr.dlid) != Some(&vnic) {
            return false;
        }
        let Some(group) = self.objs.vnics.get(&vnic).map(|v| v.group) else {
            return false;
        };
        let from_group = match self.routes.remote_lids.get(&addr.slid) {
            Some(&(h, g)) if h == host => Some(g),
            _ if self.is_sibling(host) => self
                .routes
                .by_lid
                .get(&addr.slid)
                .and_then(|v| self.objs.vnics.get(v))
                .map(|v| v.group),
            _ => None,
        };
        if from_group != Some(group) {
            return false;
        }
        if q.ty == QpType::Ud {
            return deth_src == Some(addr.src_qpn);
        }
        // A connected QP whose peer was unknown at RTR looks it up again first.
        let route = self.reroute(qp);
        let Some(q) = self.objs.qps.get_mut(&qp) else {
            return false;
        };
        let peer = route == Route::Remote(host)
            && q.addr.dlid == addr.slid
            && q.attr.dest_qp_num == addr.src_qpn;
        if peer {
            q.resp.admitted = Some((host, *addr, generation));
        }
        peer
    }

    /// Segments from links refused by the address-word checks so far: another vRNIC's
    /// QP named by number, a sender its link cannot speak for, another group, a QP that is not
    /// the destination's peer.
    #[must_use]
    pub fn segments_refused(&self) -> u64 {
        self.routes.refused_segments
    }

    /// Where the payload of `seg`, arriving on `host`'s link, lands if the segment is handled
    /// now, for the segments whose payload a driver may read straight into registered memory:
    /// an RDMA WRITE segment without immediate data, in sequence, for a QP connected over that
    /// link, into memory its R_Key allows (the responder's checks); or an RDMA READ response
    /// for a READ in flight on such a QP, into that READ's local buffers. The runs, which sum
    /// to the payload's length, are appended to `runs`. Changes no state: the driver reads the
    /// payload into the runs, then hands the segment to [`Engine::handle_placed_segment`],
    /// which checks and acts on it as [`Engine::handle_segment`] does. `None`: read the payload
    /// into a buffer and call `handle_segment`.
    pub fn placement(
        &mut self,
        host: HostId,
        addr: &AddrRepr,
        seg: &SegmentRepr,
        runs: &mut Vec<(Loc, u64)>,
    ) -> Option<Placement> {
        let start = runs.len();
        let &qp = self.objs.by_qpn.get(&seg.dest_qpn)?;
        let n = seg.payload_len as u64;
        if n == 0 || !self.admits(host, addr, seg.deth.map(|d| d.src_qpn), qp) {
            return None;
        }
        let q = self.objs.qps.get(&qp)?;
        use WireOp::*;
        let ok = match seg.opcode.op() {
            RdmaWriteFirst | RdmaWriteMiddle | RdmaWriteLast | RdmaWriteOnly => {
                let ty = match seg.opcode.transport() {
                    Transport::Rc => QpType::Rc,
                    Transport::Uc => QpType::Uc,
                    // Where an XRC WRITE lands depends on the SRQ it names, checked when it
                    // is handled: read into a buffer.
                    Transport::Ud | Transport::Xrc => return None,
                };
                if q.ty != ty
                    || !matches!(q.attr.qp_state, QpState::Rtr | QpState::Rts | QpState::Sqd)
                    || seg.psn != q.attr.rq_psn
                {
                    return None;
                }
                let first = seg.reth.is_some();
                let (va, rkey, len) = match seg.reth {
                    Some(r) => (r.va, r.rkey, u64::from(r.dma_len)),
                    None => q.link.write_at?,
                };
                // Only under an MR's key: a window's grant may change in another engine while
                // the payload is read (see `mw`), so that one is read into a buffer and checked
                // when handled (the runs appended are dropped below).
                n <= len
                    && self.remote_runs(qp, va, len, n, first, rkey, access::REMOTE_WRITE, runs)
                        == Some(Grant::Mr)
            }
            RdmaReadResponseOnly => {
                if !q.ty.is_reliable() || !matches!(q.attr.qp_state, QpState::Rts | QpState::Sqd) {
                    return None;
                }
                let i = q.link.flights.iter().position(|f| {
                    psn_cmp(seg.psn, f.first_psn) >= 0 && psn_cmp(seg.psn, f.next_psn) < 0
                })?;
                let (f, w) = (q.link.flights.get(i)?, q.sq.get(i)?.as_ref().ok()?);
                let off = u64::from(psn_after(seg.psn, f.first_psn)) * SEGMENT;
                let want = w.payload.len().saturating_sub(off).min(SEGMENT);
                if off != f.got {
                    // Only the next one the READ waits for (those before it may still be on
                    // their way to this engine: an engine thread's inbox).
                    return None;
                }
                match &w.payload {
                    SendPayload::Sges(sges) if w.opcode == SendOpcode::RdmaRead && want == n => {
                        self.sge_runs(q.vnic, sges, off, n, runs).is_some()
                    }
                    _ => false,
                }
            }
            _ => false,
        };
        if !ok {
            runs.truncate(start);
            return None;
        }
        Some(Placement {
            generation: self.mem_gen,
        })
    }

    /// Whether memory a [`Placement`] names may still be written: nothing was deregistered
    /// or given other access since (a window's grant is never placed). A driver reading a payload into place over several
    /// reads checks it before each, and once it is false reads the rest into a buffer it drops
    /// (then hands the segment over with `whole` false).
    #[must_use]
    pub fn placement_holds(&self, placement: Placement) -> bool {
        placement.generation == self.mem_gen
    }

    /// A segment whose payload the driver read into the runs [`Engine::placement`] named.
    /// `whole`: all of it, while the placement held. Then the segment is checked and acted on
    /// as [`Engine::handle_segment`] does, with nothing left to copy. Otherwise it is taken
    /// as lost on the way, and asked for again at once: a request with a sequence NAK naming
    /// its PSN (on RC; UC just loses it), a READ response by sending the READ again.
    #[allow(clippy::too_many_arguments)]
    pub fn handle_placed_segment(
        &mut self,
        now: Instant,
        host: HostId,
        addr: &AddrRepr,
        seg: &SegmentRepr,
        placement: Placement,
        whole: bool,
        mem: &mut dyn Memory,
    ) {
        let from = Sender {
            addr: *addr,
            grh: None,
        };
        if whole && self.placement_holds(placement) {
            let n = seg.payload_len;
            self.dispatch(now, host, from, seg, Incoming::Placed(n), mem);
            return;
        }
        let Some(qp) = self.admitted(host, addr, seg) else {
            return;
        };
        tracing::debug!(
            ?host,
            qpn = seg.dest_qpn,
            psn = seg.psn,
            "segment read into place lost"
        );
        let Some(q) = self.objs.qps.get_mut(&qp) else {
            return;
        };
        if q.route != Route::Remote(host) || !q.ty.is_reliable() {
            return;
        }
        if seg.opcode.op() == WireOp::RdmaReadResponseOnly {
            self.rewind(qp, seg.psn);
            self.wake(qp);
        } else if seg.psn == q.attr.rq_psn && !q.resp.nak_sent {
            // What follows it in flight is out of sequence until it comes again.
            q.resp.nak_sent = true;
            self.answer_now(qp, seg.psn, Syndrome::Nak(NakCode::PsnSequenceError));
        }
    }

    fn handle_remote_request(
        &mut self,
        host: HostId,
        qp: QpId,
        from: Sender,
        seg: &SegmentRepr,
        payload: Incoming,
        mem: &mut dyn Memory,
    ) {
        let Some(q) = self.objs.qps.get(&qp) else {
            return;
        };
        let transport = match seg.opcode.transport() {
            Transport::Rc => QpType::Rc,
            Transport::Uc => QpType::Uc,
            Transport::Ud => QpType::Ud,
            Transport::Xrc => QpType::XrcSend,
        };
        use WireOp::*;
        let wop = seg.opcode.op();
        let (op, first, last) = match wop {
            SendFirst => (Op::Send, true, false),
            SendMiddle => (Op::Send, false, false),
            SendLast | SendLastWithImm => (Op::Send, false, true),
            SendOnly | SendOnlyWithImm => (Op::Send, true, true),
            RdmaWriteFirst => (Op::Write, true, false),
            RdmaWriteMiddle => (Op::Write, false, false),
            RdmaWriteLast | RdmaWriteLastWithImm => (Op::Write, false, true),
            RdmaWriteOnly | RdmaWriteOnlyWithImm => (Op::Write, true, true),
            RdmaReadRequest => (Op::Read, true, true),
            // Its RETH and 8-byte payload checked by the frame's parse; never read into place.
            AtomicWrite => (Op::AtomicWrite, true, true),
            CompareSwap | FetchAdd => {
                let a = seg.atomic.unwrap_or(AtomicEth {
                    va: 0,
                    rkey: 0,
                    swap_add: 0,
                    compare: 0,
                });
                let op = if wop == CompareSwap {
                    Op::CmpSwap {
                        compare: a.compare,
                        swap: a.swap_add,
                    }
                } else {
                    Op::FetchAdd { add: a.swap_add }
                };
                (op, true, true)
            }
            SendLastWithInvalidate => (Op::SendInv, false, true),
            SendOnlyWithInvalidate => (Op::SendInv, true, true),
            _ => {
                self.answer_now(qp, seg.psn, Syndrome::Nak(NakCode::InvalidRequest));
                return;
            }
        };
        let n = payload.len() as u64;
        // The PSN expected: only a segment taken in sequence moves a WRITE's cursor.
        let epsn = q.attr.rq_psn;
        let in_sequence = psn_cmp(seg.psn, epsn) == 0;
        // Where an RDMA WRITE's bytes go: its RETH on the first segment, the cursor after.
        let (va, rkey, len) = match (op, seg.reth, seg.atomic) {
            // SEND with Invalidate: the IETH's R_Key, as a local requester passes it.
            (Op::SendInv, _, _) => (0, seg.invalidate_rkey.unwrap_or(0), 0),
            (_, Some(r), _) => (r.va, r.rkey, u64::from(r.dma_len)),
            (Op::Write, None, _) => match q.link.write_at {
                Some(at) => at,
                // Out of sequence (a copy sent again, or one that came after a loss): the PSN
                // check answers it and it moves no byte, so no cursor is needed.
                None if !in_sequence => (0, 0, 0),
                None => {
                    if transport.is_reliable() {
                        self.answer_now(qp, seg.psn, Syndrome::Nak(NakCode::InvalidRequest));
                    }
                    return;
                }
            },
            (_, None, Some(a)) => (a.va, a.rkey, 8),
            _ => (0, 0, 0),
        };
        if op == Op::Read && len > SEGMENT {
            self.answer_now(qp, seg.psn, Syndrome::Nak(NakCode::InvalidRequest));
            return;
        }
        let grh = from.grh;
        // The sender, as its address word names it (`Engine::admits` vouched for it).
        let (src_qpn, slid) = (from.addr.src_qpn, from.addr.slid);
        let grh_bytes = grh.map(|g| {
            let ah = AhAttr {
                is_global: true,
                grh: GlobalRoute {
                    dgid: g.dgid,
                    flow_label: g.flow_label,
                    sgid_index: 0,
                    hop_limit: g.hop_limit,
                    traffic_class: g.traffic_class,
                },
                ..Default::default()
            };
            super::grh(&ah, g.sgid, n)
        });
        let req = Request {
            op,
            transport,
            xrc_srqn: seg.xrc_srqn.unwrap_or(0),
            first,
            last,
            src: Src::Remote(host),
            src_qpn,
            slid,
            dst_qpn: seg.dest_qpn,
            psn: seg.psn,
            solicited: seg.solicited,
            imm: seg.imm,
            va,
            rkey,
            len,
            chunk: if op == Op::Read { len } else { n },
            qkey: seg.deth.map_or(0, |d| d.qkey),
            grh: grh_bytes,
            payload: match payload {
                Incoming::Bytes(b) => Payload::Bytes(b),
                Incoming::Placed(n) => Payload::Placed(n as u64),
            },
        };
        let mut back = std::mem::take(&mut self.scratch.scratch_dst);
        back.clear();
        let r = self.handle_request(qp, Admit::Checked, &req, mem, &mut back);
        tracing::trace!(?r, "answer");
        // The cursor moves past a segment the responder took (the PSN expected moved past
        // it), never for a duplicate, one NAKed out of sequence, or one turned back for RNR.
        if op == Op::Write
            && let Some(q) = self.objs.qps.get_mut(&qp)
            && q.attr.rq_psn != epsn
            && q.attr.rq_psn == psn_next(seg.psn)
        {
            q.link.write_at = (!last).then_some((va.wrapping_add(n), rkey, len.saturating_sub(n)));
        }
        match r {
            Some(Response::Ack) => {
                if let Some(q) = self.objs.qps.get_mut(&qp) {
                    if q.link.ack_due.is_none() {
                        self.out.acks_due.push(qp);
                    }
                    q.link.ack_due = Some(req.psn);
                }
            }
            Some(Response::RnrNak { timer }) => {
                let timer = timer.code();
                self.answer_now(qp, req.psn, Syndrome::RnrNak { timer });
            }
            Some(Response::Nak(Nak::Sequence)) => {
                // A sequence NAK names the PSN expected: everything before it arrived.
                let epsn = self.objs.qps.get(&qp).map_or(req.psn, |q| q.attr.rq_psn);
                self.answer_now(qp, epsn, Syndrome::Nak(NakCode::PsnSequenceError));
            }
            Some(Response::Nak(nak)) => {
                let code = match nak {
                    Nak::Sequence => NakCode::PsnSequenceError,
                    Nak::InvalidRequest => NakCode::InvalidRequest,
                    Nak::RemoteAccess => NakCode::RemoteAccessError,
                    Nak::RemoteOperational => NakCode::RemoteOperationalError,
                };
                self.answer_now(qp, req.psn, Syndrome::Nak(code));
            }
            Some(Response::ReadData) => {
                if let Some(q) = self.objs.qps.get_mut(&qp)
                    && let Route::Remote(host) = q.route
                    && let Some(opcode) =
                        Opcode::new(answer_transport(q), WireOp::RdmaReadResponseOnly)
                {
                    q.link.ack_due = None;
                    let mut s = SegmentRepr::new(opcode, q.attr.dest_qp_num, req.psn);
                    s.aeth = Some(Aeth {
                        syndrome: Syndrome::Ack { credits: 31 },
                        msn: 0,
                    });
                    s.payload_len = len as usize;
                    self.out.outbox.push_back(Transmit {
                        host,
                        addr: q.addr,
                        grh: None,
                        segment: s,
                        payload: TxPayload::Runs(back.clone()),
                    });
                }
            }
            Some(Response::AtomicAck(orig)) => {
                if let Some(q) = self.objs.qps.get_mut(&qp)
                    && let Route::Remote(host) = q.route
                    && let Some(opcode) =
                        Opcode::new(answer_transport(q), WireOp::AtomicAcknowledge)
                {
                    q.link.ack_due = None;
                    let mut s = SegmentRepr::new(opcode, q.attr.dest_qp_num, req.psn);
                    s.aeth = Some(Aeth {
                        syndrome: Syndrome::Ack { credits: 31 },
                        msn: 0,
                    });
                    s.atomic_ack = Some(AtomicAckEth { orig });
                    self.out.outbox.push_back(Transmit {
                        host,
                        addr: q.addr,
                        grh: None,
                        segment: s,
                        payload: TxPayload::Empty,
                    });
                }
            }
            Some(Response::Unacknowledged) | None => {}
        }
        self.scratch.scratch_dst = back;
    }

    /// Sends an ACK-opcode answer for `psn` at once (NAKs, RNR NAKs): it supersedes a
    /// coalesced ACK still owed.
    fn answer_now(&mut self, qp: QpId, psn: u32, syndrome: Syndrome) {
        let Some(q) = self.objs.qps.get_mut(&qp) else {
            return;
        };
        let Route::Remote(host) = q.route else { return };
        if !q.ty.is_reliable() {
            return;
        }
        q.link.ack_due = None;
        self.out.outbox.push_back(Transmit {
            host,
            addr: q.addr,
            grh: None,
            segment: answer(answer_transport(q), q.attr.dest_qp_num, psn, syndrome),
            payload: TxPayload::Empty,
        });
    }

    /// An answer for one of our requester QPs.
    fn handle_answer(
        &mut self,
        now: Instant,
        host: HostId,
        qp: QpId,
        seg: &SegmentRepr,
        payload: Incoming,
        mem: &mut dyn Memory,
    ) {
        let Some(q) = self.objs.qps.get(&qp) else {
            return;
        };
        if q.route != Route::Remote(host)
            || !q.ty.is_reliable()
            || !matches!(q.attr.qp_state, QpState::Rts | QpState::Sqd)
        {
            return;
        }
        let psn = seg.psn;
        tracing::trace!(
            ?qp,
            psn,
            syndrome = ?seg.aeth.map(|a| a.syndrome),
            flights = q.link.flights.len(),
            sq_sent = q.link.sq_sent,
            sq_psn = q.attr.sq_psn,
            wait = ?q.wait,
            parked = q.sched.parked,
            "answer"
        );
        let Some(i) = q
            .link
            .flights
            .iter()
            .position(|f| psn_cmp(psn, f.first_psn) >= 0 && psn_cmp(psn, f.next_psn) < 0)
        else {
            // Nothing in flight has this PSN: a stale or duplicate answer. An ACK still
            // acknowledges everything before it.
            if seg.opcode.op() == WireOp::Acknowledge
                && matches!(seg.aeth.map(|a| a.syndrome), Some(Syndrome::Ack { .. }))
            {
                self.acked_through(now, qp, psn);
            }
            return;
        };
        match (seg.opcode.op(), seg.aeth.map(|a| a.syndrome)) {
            (WireOp::Acknowledge, Some(Syndrome::Ack { .. })) => self.acked_through(now, qp, psn),
            (WireOp::Acknowledge, Some(Syndrome::RnrNak { timer })) => {
                self.acked_through(now, qp, psn_prev(psn));
                self.rewind(qp, psn);
                if let Some(q) = self.objs.qps.get_mut(&qp) {
                    q.link.rnr_psn = Some(psn);
                    // An answer: nothing is in flight past the PSN it names (a message sent
                    // in part keeps its flight), so the local ACK timer waits for the segment
                    // sent again when the RNR wait ends, instead of expiring meanwhile.
                    q.link.ack_until = None;
                    q.link.ack_tries = 0;
                }
                // Wait out the responder's timer; nothing here can wake it sooner.
                match self.rnr(now, qp, timer, None) {
                    super::requester::Outcome::Fail(status) => {
                        self.fail_qp(qp, Some(status.status()))
                    }
                    _ => self.park(qp),
                }
            }
            (WireOp::Acknowledge, Some(Syndrome::Nak(NakCode::PsnSequenceError))) => {
                self.acked_through(now, qp, psn_prev(psn));
                self.rewind(qp, psn);
            }
            (WireOp::Acknowledge, Some(Syndrome::Nak(code))) => {
                self.acked_through(now, qp, psn_prev(psn));
                let status = match code {
                    NakCode::RemoteAccessError => WcStatus::RemAccessErr,
                    NakCode::RemoteOperationalError => WcStatus::RemOpErr,
                    _ => WcStatus::RemInvReqErr,
                };
                // The WQE it names is the head now.
                self.fail_qp(qp, Some(status));
            }
            (WireOp::RdmaReadResponseOnly, _) => {
                // Before it, the WQE itself (counted from the head, which may move).
                let first = self
                    .objs
                    .qps
                    .get(&qp)
                    .map_or(0, |q| q.link.flights[i].first_psn);
                self.acked_through(now, qp, psn_prev(psn));
                if let Some(i) = self.flight_of(qp, first) {
                    self.place_read_response(qp, i, psn, payload, mem);
                }
                self.retire_answered(now, qp);
            }
            (WireOp::AtomicAcknowledge, _) => {
                let first = self
                    .objs
                    .qps
                    .get(&qp)
                    .map_or(0, |q| q.link.flights[i].first_psn);
                self.acked_through(now, qp, psn_prev(psn));
                if let (Some(orig), Some(i)) =
                    (seg.atomic_ack.map(|a| a.orig), self.flight_of(qp, first))
                {
                    self.place_atomic_answer(qp, i, orig, mem);
                }
                self.retire_answered(now, qp);
            }
            // Read responses in several frames are never asked for.
            _ => {}
        }
    }

    /// READ response data for the READ at flight `i`, segment `psn`. Taken only in order, as
    /// the responder sends them: the next segment the READ waits for; any other is dropped
    /// (never a READ completed with a hole in it).
    fn place_read_response(
        &mut self,
        qp: QpId,
        i: usize,
        psn: u32,
        payload: Incoming,
        mem: &mut dyn Memory,
    ) {
        let Some(q) = self.objs.qps.get(&qp) else {
            return;
        };
        let (Some(f), Some(Ok(w))) = (q.link.flights.get(i).copied(), q.sq.get(i)) else {
            return;
        };
        let k = u64::from(psn_after(psn, f.first_psn));
        let off = k * SEGMENT;
        let len = w.payload.len();
        let want = len.saturating_sub(off).min(SEGMENT);
        if w.opcode != SendOpcode::RdmaRead || payload.len() as u64 != want {
            return;
        }
        if off != f.got {
            // A duplicate (a READ asked for again gets its answers twice), or one after a
            // gap (an earlier one was dropped: a full inbox, a placement that broke, which
            // asks again itself): dropped; the READ's timer asks again for what is missing.
            tracing::debug!(
                ?qp,
                psn,
                off,
                got = f.got,
                "READ response out of order: dropped"
            );
            return;
        }
        if let (SendPayload::Sges(sges), Incoming::Bytes(b)) = (&w.payload, payload) {
            let mut local = std::mem::take(&mut self.scratch.scratch_local);
            local.clear();
            let _ = self.sge_runs(q.vnic, sges, off, want, &mut local);
            let written = scatter_bytes(mem, b, &local);
            self.scratch.scratch_local = local;
            if written.is_err() {
                // A copy the daemon could not make: the QP fails, never a READ done.
                self.fail_qp(qp, Some(WcStatus::GeneralErr));
                return;
            }
        }
        if let Some(f) = self
            .objs
            .qps
            .get_mut(&qp)
            .and_then(|q| q.link.flights.get_mut(i))
        {
            f.got = f.got.max(off + want);
            f.done = f.whole && f.got >= len;
        }
    }

    /// The atomic at flight `i` answered `orig`.
    fn place_atomic_answer(&mut self, qp: QpId, i: usize, orig: u64, mem: &mut dyn Memory) {
        let Some(q) = self.objs.qps.get(&qp) else {
            return;
        };
        let Some(Ok(w)) = q.sq.get(i) else { return };
        if let SendPayload::Sges(sges) = &w.payload {
            let mut local = std::mem::take(&mut self.scratch.scratch_local);
            local.clear();
            let _ = self.sge_runs(q.vnic, sges, 0, 8, &mut local);
            let written = scatter_bytes(mem, &orig.to_le_bytes(), &local);
            self.scratch.scratch_local = local;
            if written.is_err() {
                self.fail_qp(qp, Some(WcStatus::GeneralErr));
                return;
            }
        }
        if let Some(f) = self
            .objs
            .qps
            .get_mut(&qp)
            .and_then(|q| q.link.flights.get_mut(i))
        {
            f.done = true;
        }
    }

    /// Everything up to `psn` is acknowledged: SENDs and WRITEs sent wholly by then are done.
    fn acked_through(&mut self, now: Instant, qp: QpId, psn: u32) {
        let Some(q) = self.objs.qps.get_mut(&qp) else {
            return;
        };
        let next = psn_next(psn);
        if psn_cmp(next, q.link.una) > 0 && psn_cmp(next, q.attr.sq_psn) <= 0 {
            q.link.una = next;
        }
        if q.link.rnr_psn.is_some_and(|w| psn_cmp(psn, w) >= 0) {
            // What the RNR NAK named got through: the wait is over.
            q.link.rnr_psn = None;
            q.wait = Wait::None;
        }
        for (f, w) in q.link.flights.iter_mut().zip(q.sq.iter()) {
            if psn_cmp(psn_prev(f.next_psn), psn) > 0 {
                break;
            }
            // An ATOMIC WRITE is answered by the ACK, as a WRITE.
            let answered_by_data = matches!(w, Ok(w) if w.opcode.reads_back());
            if f.whole && !answered_by_data {
                f.done = true;
            }
        }
        self.retire_answered(now, qp);
    }

    /// Completes answered WQEs from the head, in order; the ACK timer restarts while some
    /// remain unanswered.
    fn retire_answered(&mut self, now: Instant, qp: QpId) {
        if let Some(q) = self.objs.qps.get_mut(&qp) {
            q.link.stalled = false;
        }
        loop {
            let Some(q) = self.objs.qps.get_mut(&qp) else {
                return;
            };
            match q.link.flights.front() {
                Some(f) if f.done => {}
                _ => break,
            }
            q.link.flights.pop_front();
            q.link.sq_sent = q.link.sq_sent.saturating_sub(1);
            let len = match q.sq.front() {
                Some(Ok(w)) => w.payload.len(),
                _ => 0,
            };
            // A WQE behind it may wait (RNR): retiring this one does not end that.
            let wait = q.wait;
            self.complete_head(qp, len as u32);
            if let Some(q) = self.objs.qps.get_mut(&qp) {
                q.wait = wait;
            }
        }
        let Some(q) = self.objs.qps.get_mut(&qp) else {
            return;
        };
        if let Some(f) = q.link.flights.front()
            && psn_cmp(f.first_psn, q.link.una) > 0
        {
            q.link.una = f.first_psn;
        }
        if q.link.flights.is_empty() {
            q.link.ack_until = None;
        } else {
            let until = now + ack_budget(q);
            q.link.ack_until = Some(until);
            q.link.ack_tries = 0;
            self.arm(qp, until);
        }
        self.wake(qp);
    }

    /// The local ACK timeout of a requester over a peer link expired with nothing answered:
    /// it sends again from the first unanswered message (a responder that was not ready, not
    /// yet at RTR, dropped it, as a fabric loses a packet), or, after `retry_cnt` such tries,
    /// fails with `RETRY_EXC_ERR`. Returns whether the QP is still up.
    pub(super) fn ack_timeout(&mut self, now: Instant, qp: QpId) -> bool {
        let Some(q) = self.objs.qps.get_mut(&qp) else {
            return false;
        };
        // Every timeout that expired by now counts (a driver late to call counts them all),
        // each from the one before, so the whole budget stays `(retry_cnt + 1) * timeout`.
        let step = ack_budget(q);
        let mut until = q.link.ack_until.unwrap_or(now);
        while until <= now {
            if q.link.ack_tries >= q.attr.retry_cnt {
                self.fail_qp(qp, Some(WcStatus::RetryExcErr));
                return false;
            }
            q.link.ack_tries += 1;
            until += step;
        }
        q.link.ack_until = Some(until);
        let first = q.link.flights.iter().find(|f| !f.done).map(|f| f.first_psn);
        tracing::debug!(
            ?qp,
            tries = q.link.ack_tries,
            "local ACK timeout: sending again"
        );
        self.arm(qp, until);
        if let Some(psn) = first {
            self.rewind(qp, psn);
        }
        true
    }

    /// Goes back to `psn`: the WQE it belongs to sends again from that segment on, and those
    /// after it from their start.
    fn rewind(&mut self, qp: QpId, psn: u32) {
        let Some(q) = self.objs.qps.get_mut(&qp) else {
            return;
        };
        let Some(i) = q
            .link
            .flights
            .iter()
            .position(|f| psn_cmp(psn, f.first_psn) >= 0 && psn_cmp(psn, f.next_psn) < 0)
        else {
            return;
        };
        if psn_cmp(q.link.una, psn) > 0 {
            q.link.una = psn;
        }
        q.link.flights.truncate(i + 1);
        let f = &mut q.link.flights[i];
        let k = u64::from(psn_after(psn, f.first_psn));
        f.sent = k * SEGMENT;
        f.got = f.got.min(f.sent);
        f.next_psn = psn;
        f.whole = false;
        f.done = false;
        if f.sent == 0 {
            q.link.flights.truncate(i);
        }
        q.link.sq_sent = i;
        let again = u64::from(psn_after(q.attr.sq_psn, psn));
        if let Route::Remote(h) = q.route {
            *self.out.resent.entry(h).or_default() += again;
        }
        q.attr.sq_psn = psn;
        self.wake(qp);
    }

    /// The index of the flight whose first PSN is `first`.
    fn flight_of(&self, qp: QpId, first: u32) -> Option<usize> {
        self.objs
            .qps
            .get(&qp)?
            .link
            .flights
            .iter()
            .position(|f| f.first_psn == first)
    }

    /// The next WQE cannot go before those in flight are answered: off the ready lists until
    /// an answer comes (or the ACK timer fails the QP).
    fn stall(&mut self, qp: QpId) {
        if let Some(q) = self.objs.qps.get_mut(&qp) {
            q.link.stalled = true;
        }
    }

    /// The LID of a remote vRNIC with this GID, if known.
    pub(super) fn lid_of_remote_gid(&self, gid: &[u8; 16]) -> Option<u16> {
        self.routes.remote_gids.get(gid).map(|&(_, _, lid)| lid)
    }

    /// Segments sent again over the link to `host` so far.
    #[must_use]
    pub fn retransmits(&self, host: HostId) -> u64 {
        self.out.resent.get(&host).copied().unwrap_or(0)
    }

    /// Work to send over a peer link is pending (frames or ACKs).
    #[must_use]
    pub fn has_transmit(&self) -> bool {
        !self.out.outbox.is_empty() || !self.out.acks_due.is_empty()
    }
}

/// How long a requester over a peer link waits for an answer before it sends again (the
/// local ACK timeout; after `retry_cnt` of them, `RETRY_EXC_ERR`).
fn ack_budget(q: &Qp) -> Duration {
    Duration::from_micros(state::ack_timeout_us(q.attr.timeout))
}

/// The RC and XRC ACK opcodes (checked at compile time).
const ACK: Opcode = match Opcode::new(Transport::Rc, WireOp::Acknowledge) {
    Some(o) => o,
    None => panic!("RC has ACKs"),
};
const XRC_ACK: Opcode = match Opcode::new(Transport::Xrc, WireOp::Acknowledge) {
    Some(o) => o,
    None => panic!("XRC has ACKs"),
};

/// The transport of a responder's answers: XRC for an XRC receive QP, RC otherwise.
fn answer_transport(q: &Qp) -> Transport {
    if q.ty == QpType::XrcRecv {
        Transport::Xrc
    } else {
        Transport::Rc
    }
}

/// An ACK-opcode segment (ACK, RNR NAK, NAK) on `transport` for `psn` to `dest_qpn`.
fn answer(transport: Transport, dest_qpn: u32, psn: u32, syndrome: Syndrome) -> SegmentRepr {
    let opcode = if transport == Transport::Xrc {
        XRC_ACK
    } else {
        ACK
    };
    let mut s = SegmentRepr::new(opcode, dest_qpn, psn);
    s.aeth = Some(Aeth { syndrome, msn: 0 });
    s
}

/// `VecDeque` of flights, named for the QP struct.
pub(super) type Flights = VecDeque<Flight>;
