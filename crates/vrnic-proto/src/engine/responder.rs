//! The responder's receive side: which receive a message lands in, taking it, and its
//! completion.

use super::*;

impl Engine {
    /// The receive a message to `qp` would land in: the head of its SRQ or of its own queue.
    pub(super) fn recv_head(&self, qp: QpId) -> Option<&RecvWqe> {
        let q = self.qps.get(&qp)?;
        match q.srq {
            Some(s) => self.srqs.get(&s)?.rq.front(),
            None => q.rq.front(),
        }
    }

    pub(super) fn recv_empty(&self, qp: QpId) -> bool {
        self.recv_head(qp).is_none()
    }

    /// Receives retired so far from the queue `qp` receives from (its SRQ's or its own).
    pub(super) fn recv_retired(&self, qp: QpId) -> u32 {
        let Some(q) = self.qps.get(&qp) else { return 0 };
        match q.srq {
            Some(s) => self.srqs.get(&s).map(|s| s.retired).unwrap_or(0),
            None => q.rq_retired,
        }
    }

    /// Takes the receive a message to `qp` lands in. Taking from an SRQ below its armed limit
    /// raises `SRQ_LIMIT_REACHED` (once; the limit disarms).
    pub(super) fn pop_recv(&mut self, qp: QpId) -> Option<RecvWqe> {
        let q = self.qps.get_mut(&qp)?;
        let Some(sid) = q.srq else {
            let r = q.rq.pop_front()?;
            q.rq_retired = q.rq_retired.wrapping_add(1);
            touch(&mut self.touched, qp, q);
            return Some(r);
        };
        let s = self.srqs.get_mut(&sid)?;
        let r = s.rq.pop_front()?;
        s.retired = s.retired.wrapping_add(1);
        touch_srq(&mut self.touched_srqs, sid, s);
        if s.limit > 0 && (s.rq.len() as u32) < s.limit {
            s.limit = 0;
            let ctx = s.ctx;
            self.events.push_back((ctx, Event::SrqLimit { srq: sid }));
        }
        Some(r)
    }

    pub(super) fn lid_of(&self, qp: QpId) -> u16 {
        self.qps
            .get(&qp)
            .and_then(|q| self.vnics.get(&q.vnic))
            .map(|v| v.lid)
            .unwrap_or(0)
    }

    pub(super) fn take_recv(
        &mut self,
        peer: QpId,
        status: WcStatus,
        byte_len: u32,
        imm: Option<u32>,
    ) {
        let Some(r) = self.pop_recv(peer) else { return };
        let Some(p) = self.qps.get(&peer) else {
            return;
        };
        let mut c = cqe(r.wr_id, status, WcOpcode::Recv, p.qpn);
        c.byte_len = byte_len;
        if let Some(i) = imm {
            c.imm_data = i;
            c.wc_flags |= WC_WITH_IMM;
        }
        self.completions.push_back((p.recv_cq, c, false));
    }

    #[allow(clippy::too_many_arguments)]
    pub(super) fn take_recv_ok(
        &mut self,
        peer: QpId,
        opcode: WcOpcode,
        byte_len: u32,
        imm: Option<u32>,
        src_qp: u32,
        slid: u16,
        solicited: bool,
        wc_flags: u8,
    ) {
        let Some(r) = self.pop_recv(peer) else { return };
        let Some(p) = self.qps.get(&peer) else {
            return;
        };
        let mut c = cqe(r.wr_id, WcStatus::Success, opcode, p.qpn);
        c.byte_len = byte_len;
        c.src_qp = src_qp;
        c.slid = slid;
        c.wc_flags |= wc_flags;
        if let Some(i) = imm {
            c.imm_data = i;
            c.wc_flags |= WC_WITH_IMM;
        }
        self.completions.push_back((p.recv_cq, c, solicited));
    }
}
