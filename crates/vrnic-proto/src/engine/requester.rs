//! The requester: the head send WQE of a QP executed against its responder, chunk by
//! chunk, with RNR and retry waits.

use super::*;

impl Engine {
    /// Finds the responder of an RC QP: the QP its address and `dest_qp_num` name, if it is
    /// ready to receive and connected back to us.
    pub(super) fn responder(&self, qp: QpId) -> Option<QpId> {
        let q = self.qps.get(&qp)?;
        let ah = &q.attr.ah_attr;
        let (&vid, _) = self.vnics.iter().find(|(_, v)| {
            if ah.is_global {
                v.gid == ah.grh.dgid
            } else {
                v.lid == ah.dlid
            }
        })?;
        let &peer = self.by_qpn.get(&q.attr.dest_qp_num)?;
        let p = self.qps.get(&peer)?;
        let me = self.vnics.get(&q.vnic)?;
        let back = if p.attr.ah_attr.is_global {
            p.attr.ah_attr.grh.dgid == me.gid
        } else {
            p.attr.ah_attr.dlid == me.lid
        };
        (p.vnic == vid
            && p.ty == q.ty
            && matches!(p.attr.qp_state, QpState::Rtr | QpState::Rts | QpState::Sqd)
            && p.attr.dest_qp_num == q.qpn
            && back)
            .then_some(peer)
    }

    /// Retires the head send WQE, with a completion if it is signaled.
    pub(super) fn complete_head(&mut self, qp: QpId, byte_len: u32) {
        let Some(q) = self.qps.get_mut(&qp) else {
            return;
        };
        q.wait = Wait::None;
        q.progress = None;
        let Some(Ok(w)) = q.sq.pop_front() else {
            return;
        };
        q.sq_retired = q.sq_retired.wrapping_add(1);
        touch(&mut self.touched, qp, q);
        if q.sq_sig_all || w.flags.contains(SendFlags::SIGNALED) {
            let mut c = cqe(w.wr_id, WcStatus::Success, w.opcode.wc_opcode(), q.qpn);
            c.byte_len = byte_len;
            self.completions.push_back((q.send_cq, c, false));
        }
    }

    /// Records that the head WQE moved its first `done` bytes to `peer` and continues later.
    pub(super) fn partial(&mut self, qp: QpId, peer: QpId, done: u64, n: u64) -> Step {
        let peer_rq = self.recv_retired(peer);
        if let Some(q) = self.qps.get_mut(&qp) {
            q.wait = Wait::None;
            q.progress = Some(Progress {
                done,
                peer,
                peer_rq,
            });
        }
        Step::Partial(n)
    }

    pub(super) fn step(&mut self, now: Instant, qp: QpId, mem: &mut dyn Memory) -> Step {
        let Some(q) = self.qps.get(&qp) else {
            return Step::Blocked;
        };
        // A waiting head costs nothing until its timer fires or its responder changes.
        match q.wait {
            Wait::Rnr { until, .. }
                if now < until && self.responder(qp).is_some_and(|p| self.recv_empty(p)) =>
            {
                return Step::Blocked;
            }
            Wait::Retry { until } if now < until && self.responder(qp).is_none() => {
                return Step::Blocked;
            }
            _ => {}
        }
        let wqe = match q.sq.front() {
            Some(Ok(w)) => w.clone(),
            Some(Err(_)) => {
                self.fail_qp(qp, Some(WcStatus::LocQpOpErr));
                return Step::Done(0);
            }
            None => return Step::Blocked,
        };
        let (vnic, pd, ty) = (q.vnic, q.pd, q.ty);
        let uc = ty == QpType::Uc;
        let len = wqe.payload.len();
        if len > u64::from(MAX_MSG_SIZE) {
            self.fail_qp(qp, Some(WcStatus::LocLenErr));
            return Step::Done(0);
        }
        // Local side: where the payload comes from (or, for READ/atomics, goes to).
        let needs_write = matches!(
            wqe.opcode,
            SendOpcode::RdmaRead | SendOpcode::AtomicCmpAndSwp | SendOpcode::AtomicFetchAndAdd
        );
        if uc && needs_write {
            // UC has no responses: READ and atomics are invalid on it.
            self.fail_qp(qp, Some(WcStatus::LocQpOpErr));
            return Step::Done(0);
        }
        match &wqe.payload {
            SendPayload::Sges(sges) => {
                if !self.check_sges(vnic, pd, sges, needs_write) {
                    self.fail_qp(qp, Some(WcStatus::LocProtErr));
                    return Step::Done(0);
                }
            }
            SendPayload::Inline(_) if needs_write => {
                self.fail_qp(qp, Some(WcStatus::LocQpOpErr));
                return Step::Done(0);
            }
            SendPayload::Inline(_) => {}
        }
        if ty == QpType::Ud {
            return self.exec_ud(qp, &wqe, mem);
        }
        // Remote side.
        let Some(peer) = self.responder(qp) else {
            if uc {
                // Nobody acknowledges UC: the message is simply lost.
                self.complete_head(qp, len as u32);
                return Step::Done(len);
            }
            let Some(q) = self.qps.get_mut(&qp) else {
                return Step::Blocked;
            };
            match q.wait {
                Wait::Retry { until } if now >= until => {
                    self.fail_qp(qp, Some(WcStatus::RetryExcErr));
                    return Step::Done(0);
                }
                Wait::Retry { .. } => {}
                _ => {
                    let us = state::ack_timeout_us(q.attr.timeout)
                        .saturating_mul(u64::from(q.attr.retry_cnt) + 1);
                    let until = now + Duration::from_micros(us);
                    q.wait = Wait::Retry { until };
                    self.arm(qp, until);
                }
            }
            return Step::Blocked;
        };
        // Continue a message in progress if it still goes to the same receive; otherwise
        // start over, as a retransmission would.
        let peer_rq = self.recv_retired(peer);
        let done = match self.qps.get_mut(&qp).and_then(|q| q.progress.take()) {
            Some(p) if p.peer == peer && p.peer_rq == peer_rq && p.done < len => p.done,
            _ => 0,
        };
        match wqe.opcode {
            SendOpcode::Send | SendOpcode::SendWithImm => {
                self.exec_send(now, qp, peer, &wqe, done, mem)
            }
            SendOpcode::RdmaWrite | SendOpcode::RdmaWriteWithImm => {
                self.exec_write(now, qp, peer, &wqe, done, mem)
            }
            SendOpcode::RdmaRead => self.exec_read(qp, peer, &wqe, done, mem),
            SendOpcode::AtomicCmpAndSwp | SendOpcode::AtomicFetchAndAdd => {
                self.exec_atomic(qp, peer, &wqe, mem)
            }
        }
    }

    /// Handles "no receive posted" at the responder: RNR wait and retry accounting.
    pub(super) fn rnr(&mut self, now: Instant, qp: QpId, peer: QpId) -> Step {
        let timer = self
            .qps
            .get(&peer)
            .map(|p| p.attr.min_rnr_timer)
            .unwrap_or(0);
        let Some(q) = self.qps.get_mut(&qp) else {
            return Step::Blocked;
        };
        let limit = q.attr.rnr_retry;
        let rearm = now + Duration::from_micros(state::rnr_timer_us(timer));
        match q.wait {
            Wait::Rnr { until, retries } if now >= until => {
                let retries = retries.saturating_add(1);
                if limit != 7 && retries > limit {
                    self.fail_qp(qp, Some(WcStatus::RnrRetryExcErr));
                    return Step::Done(0);
                }
                q.wait = Wait::Rnr {
                    until: rearm,
                    retries,
                };
                self.arm(qp, rearm);
            }
            Wait::Rnr { .. } => {}
            _ => {
                q.wait = Wait::Rnr {
                    until: rearm,
                    retries: 0,
                };
                self.arm(qp, rearm);
            }
        }
        Step::Blocked
    }

    /// Both QPs to ERR after a responder-detected error.
    pub(super) fn fail_both(&mut self, qp: QpId, requester: WcStatus, peer: QpId) {
        self.fail_qp(qp, Some(requester));
        self.fail_qp(peer, None);
    }

    /// The region runs of the requester's payload bytes `[done, done + n)`.
    pub(super) fn local_runs(&self, qp: QpId, wqe: &SendWqe, done: u64, n: u64) -> Vec<(Loc, u64)> {
        let mut runs = Vec::new();
        if let (SendPayload::Sges(sges), Some(q)) = (&wqe.payload, self.qps.get(&qp)) {
            // Checked by `check_sges` in this same step, so it cannot fail.
            let _ = self.sge_runs(q.vnic, sges, done, n, &mut runs);
        }
        runs
    }

    /// Moves payload bytes `[done, done + n)` of `wqe` into `dst`.
    pub(super) fn gather(
        &self,
        qp: QpId,
        wqe: &SendWqe,
        done: u64,
        n: u64,
        dst: &[(Loc, u64)],
        mem: &mut dyn Memory,
    ) {
        match &wqe.payload {
            SendPayload::Inline(data) => {
                let (a, b) = (done as usize, done.saturating_add(n) as usize);
                if let Some(part) = data.get(a..b) {
                    scatter_bytes(mem, part, dst);
                }
            }
            SendPayload::Sges(_) => {
                let src = self.local_runs(qp, wqe, done, n);
                copy_runs(mem, &src, dst, n);
            }
        }
    }

    pub(super) fn exec_send(
        &mut self,
        now: Instant,
        qp: QpId,
        peer: QpId,
        wqe: &SendWqe,
        done: u64,
        mem: &mut dyn Memory,
    ) -> Step {
        let len = wqe.payload.len();
        let Some(p) = self.qps.get(&peer) else {
            return Step::Blocked;
        };
        let uc = p.ty == QpType::Uc;
        let Some(recv) = self.recv_head(peer) else {
            if uc {
                // No receive posted: a UC responder drops the message; the sender never knows.
                self.complete_head(qp, len as u32);
                return Step::Done(len);
            }
            return self.rnr(now, qp, peer);
        };
        let capacity: u64 = recv.sges.iter().map(|s| u64::from(s.length)).sum();
        let prot_ok = self.check_sges(p.vnic, p.pd, &recv.sges, true);
        let n = len.saturating_sub(done).min(CHUNK);
        let mut dst = Vec::new();
        if prot_ok && len <= capacity {
            // Checked just above, so it cannot fail.
            let _ = self.sge_runs(p.vnic, &recv.sges, done, n, &mut dst);
        }
        if uc && (!prot_ok || len > capacity) {
            // A UC responder that cannot take the message fails its receive and its QP; the
            // sender is not told.
            let status = if prot_ok {
                WcStatus::LocLenErr
            } else {
                WcStatus::LocProtErr
            };
            self.take_recv(peer, status, 0, None);
            self.fail_qp(peer, None);
            self.complete_head(qp, len as u32);
            return Step::Done(len);
        }
        if !prot_ok {
            // The responder's own receive buffer is bad: its receive fails, the requester
            // learns a remote operational error.
            self.take_recv(peer, WcStatus::LocProtErr, 0, None);
            self.fail_both(qp, WcStatus::RemOpErr, peer);
            return Step::Done(0);
        }
        if len > capacity {
            self.take_recv(peer, WcStatus::LocLenErr, 0, None);
            self.fail_both(qp, WcStatus::RemInvReqErr, peer);
            return Step::Done(0);
        }
        self.gather(qp, wqe, done, n, &dst, mem);
        if done + n < len {
            return self.partial(qp, peer, done + n, n);
        }
        let imm = (wqe.opcode == SendOpcode::SendWithImm).then_some(wqe.imm_data);
        let (slid, qpn) = (
            self.lid_of(qp),
            self.qps.get(&qp).map(|q| q.qpn).unwrap_or(0),
        );
        self.take_recv_ok(
            peer,
            WcOpcode::Recv,
            len as u32,
            imm,
            qpn,
            slid,
            wqe.flags.contains(SendFlags::SOLICITED),
            0,
        );
        self.complete_head(qp, len as u32);
        Step::Done(n)
    }

    pub(super) fn exec_write(
        &mut self,
        now: Instant,
        qp: QpId,
        peer: QpId,
        wqe: &SendWqe,
        done: u64,
        mem: &mut dyn Memory,
    ) -> Step {
        let len = wqe.payload.len();
        let with_imm = wqe.opcode == SendOpcode::RdmaWriteWithImm;
        let uc = self.qps.get(&peer).is_some_and(|p| p.ty == QpType::Uc);
        if with_imm && self.recv_empty(peer) {
            if uc {
                self.complete_head(qp, len as u32);
                return Step::Done(len);
            }
            return self.rnr(now, qp, peer);
        }
        let n = len.saturating_sub(done).min(CHUNK);
        // A zero-length write names no memory, so its rkey is not checked (IB C9-88, as rxe).
        let dst = if len == 0 {
            Some(Vec::new())
        } else {
            self.remote_mr(peer, wqe.remote_addr, len, wqe.rkey, access::REMOTE_WRITE)
                .and_then(|m| {
                    let mut runs = Vec::new();
                    translate(m, wqe.remote_addr.checked_add(done)?, n, &mut runs)?;
                    Some(runs)
                })
        };
        let Some(dst) = dst else {
            if uc {
                // A UC responder drops a write it may not perform; the sender is not told.
                self.complete_head(qp, len as u32);
                return Step::Done(len);
            }
            self.fail_both(qp, WcStatus::RemAccessErr, peer);
            return Step::Done(0);
        };
        self.gather(qp, wqe, done, n, &dst, mem);
        if done + n < len {
            return self.partial(qp, peer, done + n, n);
        }
        if with_imm {
            let (slid, qpn) = (
                self.lid_of(qp),
                self.qps.get(&qp).map(|q| q.qpn).unwrap_or(0),
            );
            self.take_recv_ok(
                peer,
                WcOpcode::RecvRdmaWithImm,
                len as u32,
                Some(wqe.imm_data),
                qpn,
                slid,
                wqe.flags.contains(SendFlags::SOLICITED),
                0,
            );
        }
        self.complete_head(qp, len as u32);
        Step::Done(n)
    }

    pub(super) fn exec_read(
        &mut self,
        qp: QpId,
        peer: QpId,
        wqe: &SendWqe,
        done: u64,
        mem: &mut dyn Memory,
    ) -> Step {
        let len = wqe.payload.len();
        let n = len.saturating_sub(done).min(CHUNK);
        let src = if len == 0 {
            Some(Vec::new())
        } else {
            self.remote_mr(peer, wqe.remote_addr, len, wqe.rkey, access::REMOTE_READ)
                .and_then(|m| {
                    let mut runs = Vec::new();
                    translate(m, wqe.remote_addr.checked_add(done)?, n, &mut runs)?;
                    Some(runs)
                })
        };
        let Some(src) = src else {
            self.fail_both(qp, WcStatus::RemAccessErr, peer);
            return Step::Done(0);
        };
        let local = self.local_runs(qp, wqe, done, n);
        copy_runs(mem, &src, &local, n);
        if done + n < len {
            return self.partial(qp, peer, done + n, n);
        }
        self.complete_head(qp, len as u32);
        Step::Done(n)
    }

    /// A UD send: to the QP the address handle and QP number name, if its Q_Key matches;
    /// otherwise (or with no receive posted) the datagram is dropped and the sender never
    /// knows. The receive gets a GRH in its first [`GRH_LEN`] bytes and the payload after it.
    pub(super) fn exec_ud(&mut self, qp: QpId, wqe: &SendWqe, mem: &mut dyn Memory) -> Step {
        let len = wqe.payload.len();
        let Some(q) = self.qps.get(&qp) else {
            return Step::Blocked;
        };
        let (pd, qpn, own_qkey, vnic) = (q.pd, q.qpn, q.attr.qkey, q.vnic);
        if !matches!(wqe.opcode, SendOpcode::Send | SendOpcode::SendWithImm) {
            self.fail_qp(qp, Some(WcStatus::LocQpOpErr));
            return Step::Done(0);
        }
        let ah = match self.ahs.get(&AhId(wqe.ud.ah)) {
            Some(a) if a.pd == pd => a.attr,
            _ => {
                self.fail_qp(qp, Some(WcStatus::LocQpOpErr));
                return Step::Done(0);
            }
        };
        if len > UD_MTU {
            self.fail_qp(qp, Some(WcStatus::LocLenErr));
            return Step::Done(0);
        }
        // A Q_Key with the high bit set means the sender's own (IB spec 10.2.4).
        let qkey = if wqe.ud.remote_qkey & 0x8000_0000 != 0 {
            own_qkey
        } else {
            wqe.ud.remote_qkey
        };
        let dest = self
            .vnics
            .iter()
            .find(|(_, v)| {
                if ah.is_global {
                    v.gid == ah.grh.dgid
                } else {
                    v.lid == ah.dlid
                }
            })
            .map(|(&id, _)| id)
            .and_then(|vid| {
                let &d = self.by_qpn.get(&wqe.ud.remote_qpn)?;
                let p = self.qps.get(&d)?;
                (p.vnic == vid
                    && p.ty == QpType::Ud
                    && matches!(p.attr.qp_state, QpState::Rtr | QpState::Rts | QpState::Sqd)
                    && p.attr.qkey == qkey)
                    .then_some(d)
            });
        let Some(peer) = dest else {
            tracing::trace!(
                qpn,
                dqpn = wqe.ud.remote_qpn,
                "UD datagram dropped: no such QP"
            );
            self.complete_head(qp, len as u32);
            return Step::Done(len);
        };
        let Some(recv) = self.recv_head(peer) else {
            self.complete_head(qp, len as u32);
            return Step::Done(len);
        };
        let Some(p) = self.qps.get(&peer) else {
            return Step::Blocked;
        };
        let (pvnic, ppd) = (p.vnic, p.pd);
        let capacity: u64 = recv.sges.iter().map(|s| u64::from(s.length)).sum();
        if !self.check_sges(pvnic, ppd, &recv.sges, true) {
            self.take_recv(peer, WcStatus::LocProtErr, 0, None);
            self.fail_qp(peer, None);
            self.complete_head(qp, len as u32);
            return Step::Done(len);
        }
        if len + GRH_LEN > capacity {
            self.take_recv(peer, WcStatus::LocLenErr, 0, None);
            self.complete_head(qp, len as u32);
            return Step::Done(len);
        }
        let (mut grh_runs, mut data_runs) = (Vec::new(), Vec::new());
        // Checked just above, so neither can fail.
        let _ = self.sge_runs(pvnic, &recv.sges, 0, GRH_LEN, &mut grh_runs);
        let _ = self.sge_runs(pvnic, &recv.sges, GRH_LEN, len, &mut data_runs);
        let mut flags = 0;
        if ah.is_global {
            let sgid = self.vnics.get(&vnic).map(|v| v.gid).unwrap_or_default();
            scatter_bytes(mem, &grh(&ah, sgid, len), &grh_runs);
            flags = WC_GRH;
        }
        self.gather(qp, wqe, 0, len, &data_runs, mem);
        let imm = (wqe.opcode == SendOpcode::SendWithImm).then_some(wqe.imm_data);
        let slid = self.lid_of(qp);
        self.take_recv_ok(
            peer,
            WcOpcode::Recv,
            (len + GRH_LEN) as u32,
            imm,
            qpn,
            slid,
            wqe.flags.contains(SendFlags::SOLICITED),
            flags,
        );
        self.complete_head(qp, len as u32);
        Step::Done(len)
    }

    pub(super) fn exec_atomic(
        &mut self,
        qp: QpId,
        peer: QpId,
        wqe: &SendWqe,
        mem: &mut dyn Memory,
    ) -> Step {
        if wqe.payload.len() != 8 {
            // The local buffer must hold exactly the 8-byte original value.
            self.fail_qp(qp, Some(WcStatus::LocLenErr));
            return Step::Done(0);
        }
        if !wqe.remote_addr.is_multiple_of(8) {
            self.fail_both(qp, WcStatus::RemInvReqErr, peer);
            return Step::Done(0);
        }
        let dst = self
            .remote_mr(peer, wqe.remote_addr, 8, wqe.rkey, access::REMOTE_ATOMIC)
            .and_then(|m| {
                let mut runs = Vec::new();
                translate(m, wqe.remote_addr, 8, &mut runs)?;
                Some(runs)
            });
        // An aligned 8-byte word never crosses a page, so it is one run.
        let Some(&(at, _)) = dst.as_ref().and_then(|d| d.first()) else {
            self.fail_both(qp, WcStatus::RemAccessErr, peer);
            return Step::Done(0);
        };
        let mut old = [0u8; 8];
        mem.read(at, &mut old);
        let cur = u64::from_le_bytes(old);
        let new = match wqe.opcode {
            SendOpcode::AtomicCmpAndSwp if cur == wqe.compare_add => Some(wqe.swap),
            SendOpcode::AtomicCmpAndSwp => None,
            _ => Some(cur.wrapping_add(wqe.compare_add)),
        };
        if let Some(v) = new {
            mem.write(at, &v.to_le_bytes());
        }
        let local = self.local_runs(qp, wqe, 0, 8);
        scatter_bytes(mem, &old, &local);
        self.complete_head(qp, 8);
        Step::Done(8)
    }
}
