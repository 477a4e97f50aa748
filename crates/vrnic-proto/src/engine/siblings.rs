//! The path between two engines of one daemon (its engine threads). A request segment for a
//! QP of a sibling engine is executed by the engine that took its work request, inside the
//! sibling, which the driver holds for the call ([`Siblings`]): the sibling admits it with the
//! checks a segment from another engine or host meets (`Engine::admitted`: the QP of the
//! vRNIC its route resolved, a sender of the QP's group, a connected QP's own peer), then its
//! responder executes it as it would a request of its own QPs (connection, PSN, receive,
//! R_Key, PD, access, bounds), placing the payload straight from the requester's region into
//! the responder's, once; the answer comes back as the call's value and the requester acts on
//! it at once, as on one engine. No frame, PSN window, ACK or inbox goes between engines.

use super::responder::Admit;
use super::segment::{Op, Request, Response, Src};
use super::*;

impl Engine {
    /// A QP of a sibling engine reached RTR: the QPs here that got no answer (no responder
    /// ready) try again now, as when a QP of this engine reaches RTR, instead of waiting out
    /// their whole retry budget. Returns whether any was waiting.
    pub fn responder_ready_elsewhere(&mut self) -> bool {
        self.wake_retry_waiters()
    }

    /// A request segment that the sibling engine its source names (`Src::Remote`) executes
    /// here for its QP named by `addr`: admitted as a segment from that engine is, then
    /// handled as a request of this engine's own. `None`: dropped (refused, or no QP ready to
    /// take it), as on a fabric.
    fn sibling_request(
        &mut self,
        addr: &AddrRepr,
        req: &Request,
        mem: &mut dyn Memory,
        back: &mut Vec<(Loc, u64)>,
    ) -> Option<Response> {
        let Src::Remote(from) = req.src else {
            return None;
        };
        let Some(&qp) = self.objs.by_qpn.get(&req.dst_qpn) else {
            self.refuse_segment(from, addr, req.dst_qpn, None);
            return None;
        };
        let deth = (req.transport == QpType::Ud).then_some(req.src_qpn);
        let from = Admit::Sibling {
            host: from,
            addr: *addr,
            deth,
        };
        self.handle_request(qp, from, req, mem, back)
    }

    /// Hands request `req`, of the QP whose address word is `addr`, to sibling engine `host`
    /// through `sib` (its source made this engine's, in place: the request is not copied),
    /// then runs `then` on this engine with the answer (and a READ's runs in
    /// `back`) and a memory that reaches both engines' regions, before the sibling is let go.
    /// `None`, having done nothing, if the sibling is busy.
    pub(super) fn via_sibling<S: Siblings, T>(
        &mut self,
        sib: &mut S,
        host: HostId,
        addr: AddrRepr,
        req: &mut Request,
        back: &mut Vec<(Loc, u64)>,
        then: impl FnOnce(&mut Engine, Option<Response>, &[(Loc, u64)], &mut dyn Memory) -> T,
    ) -> Option<T> {
        req.src = Src::Remote(self.me());
        let req = &*req;
        // A SEND's first segment, a WRITE with immediate's last, or a datagram takes a
        // receive at the responder.
        let takes = match req.op {
            Op::Send | Op::SendInv => req.first || req.transport == QpType::Ud,
            Op::Write => req.last && req.imm.is_some(),
            _ => false,
        };
        sib.with(host, takes.then_some(req.dst_qpn), |other, m| {
            back.clear();
            let answer = other.sibling_request(&addr, req, m, back);
            then(self, answer, back, m)
        })
    }
}
