//! Work requests handed in from the rings, the room and retired counters the driver
//! publishes, and the error transitions that flush a QP's queues.

use super::*;

impl Engine {
    // ---- feeding work requests -------------------------------------------------------------

    /// Send WQEs that may be handed in now.
    pub fn sq_room(&self, qp: QpId) -> u32 {
        self.objs
            .qps
            .get(&qp)
            .map(|q| q.sq_depth.saturating_sub(q.sq.len() as u32))
            .unwrap_or(0)
    }

    /// Receive WQEs that may be handed in now.
    pub fn rq_room(&self, qp: QpId) -> u32 {
        self.objs
            .qps
            .get(&qp)
            .map(|q| q.rq_depth.saturating_sub(q.rq.len() as u32))
            .unwrap_or(0)
    }

    /// Send WQEs retired so far (free running).
    pub fn sq_retired(&self, qp: QpId) -> u32 {
        self.objs.qps.get(&qp).map(|q| q.sq_retired).unwrap_or(0)
    }

    /// Receive WQEs retired so far (free running).
    pub fn rq_retired(&self, qp: QpId) -> u32 {
        self.objs.qps.get(&qp).map(|q| q.rq_retired).unwrap_or(0)
    }

    /// A send WQE from the ring (already copied and parsed).
    ///
    /// In RTS and SQD it is queued, even if its slot did not parse: such a WQE fails with
    /// `LOC_QP_OP_ERR` when it reaches the head, after the ones before it ran. A WQE that
    /// arrives in INIT or RTR, beyond the queue depth, or as a broken ring
    /// ([`ParseError::ProducerIndex`]) fails at once: the QP moves to ERR, what was queued
    /// flushes and this WQE completes with `LOC_QP_OP_ERR`, last. In ERR it is flushed; in
    /// RESET it is dropped silently.
    pub fn handle_send_wqe(&mut self, now: Instant, qp: QpId, wqe: Result<SendWqe, ParseError>) {
        let _ = now;
        let Some(q) = self.objs.qps.get_mut(&qp) else {
            return;
        };
        match q.attr.qp_state {
            QpState::Reset => {
                q.sq_retired = q.sq_retired.wrapping_add(1);
                touch(&mut self.sched.touched, qp, q);
            }
            QpState::Err | QpState::Sqe => {
                let c = cqe(
                    wqe.as_ref().map(|w| w.wr_id).unwrap_or(0),
                    WcStatus::WrFlushErr,
                    wqe_wc_opcode(&wqe),
                    q.qpn,
                );
                q.sq_retired = q.sq_retired.wrapping_add(1);
                touch(&mut self.sched.touched, qp, q);
                self.out.completions.push_back((q.send_cq, c, false));
            }
            QpState::Rts | QpState::Sqd
                if (q.sq.len() as u32) < q.sq_depth
                    && !matches!(wqe, Err(ParseError::ProducerIndex(_))) =>
            {
                q.sq.push_back(wqe);
                // One already on its vRNIC's ready list (a burst's second WQE on) stays there.
                if !q.sched.queued {
                    self.wake(qp);
                }
            }
            state => {
                tracing::debug!(qpn = q.qpn, ?state, ok = wqe.is_ok(), "send WQE refused");
                q.sq.push_back(wqe);
                self.fail_qp_with(qp, None, Some(WcStatus::LocQpOpErr), None);
            }
        }
    }

    /// A receive WQE from the ring.
    ///
    /// Queued in INIT, RTR, RTS and SQD. A slot that did not parse or exceeds the queue depth
    /// fails at once: the QP moves to ERR, posted receives flush and this one completes with
    /// `LOC_QP_OP_ERR`, last. In ERR it is flushed; in RESET it is dropped silently.
    pub fn handle_recv_wqe(&mut self, now: Instant, qp: QpId, wqe: Result<RecvWqe, ParseError>) {
        let _ = now;
        let Some(q) = self.objs.qps.get_mut(&qp) else {
            return;
        };
        if matches!(q.ty, QpType::XrcSend | QpType::XrcRecv) {
            // Neither half of XRC has a receive queue (the driver refuses such posts first).
            q.rq_retired = q.rq_retired.wrapping_add(1);
            touch(&mut self.sched.touched, qp, q);
            return;
        }
        match (q.attr.qp_state, wqe) {
            (QpState::Reset, _) => {
                q.rq_retired = q.rq_retired.wrapping_add(1);
                touch(&mut self.sched.touched, qp, q);
            }
            (QpState::Err, w) => {
                let c = cqe(
                    w.map(|w| w.wr_id).unwrap_or(0),
                    WcStatus::WrFlushErr,
                    WcOpcode::Recv,
                    q.qpn,
                );
                q.rq_retired = q.rq_retired.wrapping_add(1);
                touch(&mut self.sched.touched, qp, q);
                self.out.completions.push_back((q.recv_cq, c, false));
            }
            (_, Ok(w)) if (q.rq.len() as u32) < q.rq_depth => {
                q.rq.push_back(w);
                self.wake_rnr(RecvQueue::Qp(qp));
            }
            (state, w) => {
                tracing::debug!(qpn = q.qpn, ?state, ok = w.is_ok(), "receive WQE refused");
                q.rq.push_back(w.unwrap_or(RecvWqe {
                    wr_id: 0,
                    sges: SgeList::new(),
                }));
                self.fail_qp_with(qp, None, None, Some(WcStatus::LocQpOpErr));
            }
        }
    }

    // ---- errors ----------------------------------------------------------------------------

    /// Moves a QP to ERR because of an error: the head send completes with `head` (if given and
    /// present), everything else flushes, and the owner gets `QP_FATAL`.
    pub(super) fn fail_qp(&mut self, qp: QpId, head: Option<WcStatus>) {
        self.fail_qp_with(qp, head, None, None);
    }

    /// [`Engine::fail_qp`], where the last queued send (`sq_last`) or receive (`rq_last`)
    /// completes with the given status instead of `WR_FLUSH_ERR`.
    pub(super) fn fail_qp_with(
        &mut self,
        qp: QpId,
        head: Option<WcStatus>,
        sq_last: Option<WcStatus>,
        rq_last: Option<WcStatus>,
    ) {
        let Some(q) = self.objs.qps.get_mut(&qp) else {
            return;
        };
        if q.attr.qp_state == QpState::Err {
            return;
        }
        tracing::debug!(qpn = q.qpn, ?head, state = ?q.attr.qp_state, "QP to error");
        if let Some(status) = head
            && let Some(w) = q.sq.pop_front()
        {
            let c = cqe(
                w.as_ref().map(|w| w.wr_id).unwrap_or(0),
                status,
                wqe_wc_opcode(&w),
                q.qpn,
            );
            q.sq_retired = q.sq_retired.wrapping_add(1);
            touch(&mut self.sched.touched, qp, q);
            self.out.completions.push_back((q.send_cq, c, false));
        }
        q.attr.qp_state = QpState::Err;
        let (ctx, srq) = (q.ctx, q.srq);
        self.flush_with(qp, sq_last, rq_last);
        self.out.events.push_back((ctx, Event::QpFatal { qp }));
        if srq.is_some() {
            self.out
                .events
                .push_back((ctx, Event::LastWqeReached { qp }));
        }
    }

    /// Completes everything queued on an ERR QP with `WR_FLUSH_ERR`.
    pub(super) fn flush(&mut self, qp: QpId) {
        self.flush_with(qp, None, None);
    }

    /// [`Engine::flush`], with another status for the last send or receive.
    pub(super) fn flush_with(
        &mut self,
        qp: QpId,
        sq_last: Option<WcStatus>,
        rq_last: Option<WcStatus>,
    ) {
        let Some(q) = self.objs.qps.get_mut(&qp) else {
            return;
        };
        q.wait = Wait::None;
        q.progress = None;
        q.clear_flights();
        if let Some(rx) = q.resp.rx.take() {
            // The receive a message was landing in: taken from the queue already.
            let c = cqe(rx.wqe.wr_id, WcStatus::WrFlushErr, WcOpcode::Recv, q.qpn);
            self.out.completions.push_back((rx.cq, c, false));
        }
        while let Some(w) = q.sq.pop_front() {
            let status = match sq_last {
                Some(s) if q.sq.is_empty() => s,
                _ => WcStatus::WrFlushErr,
            };
            let c = cqe(
                w.as_ref().map(|w| w.wr_id).unwrap_or(0),
                status,
                wqe_wc_opcode(&w),
                q.qpn,
            );
            q.sq_retired = q.sq_retired.wrapping_add(1);
            touch(&mut self.sched.touched, qp, q);
            self.out.completions.push_back((q.send_cq, c, false));
        }
        while let Some(w) = q.rq.pop_front() {
            let status = match rq_last {
                Some(s) if q.rq.is_empty() => s,
                _ => WcStatus::WrFlushErr,
            };
            let c = cqe(w.wr_id, status, WcOpcode::Recv, q.qpn);
            q.rq_retired = q.rq_retired.wrapping_add(1);
            touch(&mut self.sched.touched, qp, q);
            self.out.completions.push_back((q.recv_cq, c, false));
        }
    }
}
