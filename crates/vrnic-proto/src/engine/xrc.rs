//! XRC (eXtended Reliable Connected transport): XRC domains, XRC SRQs, XRC send and receive
//! QPs, and the responder's choice of the SRQ an XRC request names.
//!
//! An XRC domain groups XRC SRQs and XRC receive QPs. A context opens it, privately or by a
//! key (the device and inode of a file: every context of the *same vRNIC* that opens the same
//! file gets the same domain, as the kernel keys its XRC domains by inode per device), and
//! gets a handle ([`XrcdId`]); objects created through a handle count against it, so it cannot
//! be closed under them (`EBUSY`). An XRC send QP is an RC requester whose work requests each
//! name an SRQ number; an XRC receive QP is an RC responder without queues, PD or CQ of its
//! own: each request segment names an SRQ (its XRCETH), which must exist on the receive QP's
//! vRNIC and belong to the receive QP's domain, or the request is refused with an Invalid
//! Request NAK (`IBV_WC_REM_INV_REQ_ERR` at the requester, as mlx5 reports it). The message
//! then takes its receive from that SRQ and completes on the SRQ's CQ, with the receive QP's
//! number; its RDMA and atomic accesses are checked against the SRQ's PD (IB spec 9.5.3.3,
//! 10.2.9.6: the XRC SRQ's PD stands for the responder's).

use super::segment::Nak;
use super::*;

/// Most XRC domain handles per vRNIC.
pub const MAX_XRCD: usize = 16384;

/// One context's handle on an XRC domain.
#[derive(Debug)]
pub(super) struct Xrcd {
    pub(super) vnic: VnicId,
    pub(super) ctx: CtxId,
    /// The domain (shared by every handle that opened the same key on this vRNIC).
    pub(super) domain: u32,
    /// The file (device, inode) it was opened by, if not private.
    key: Option<(u64, u64)>,
    /// XRC SRQs and receive QPs created through this handle.
    users: u32,
}

impl Engine {
    /// `ibv_open_xrcd`: a private domain (`key` `None`, as fd -1), or the domain of the file
    /// `key` (device, inode) on `vnic`: joined if some context of `vnic` holds it open
    /// (`EINVAL` with `excl`, as `O_EXCL`), made if `create` (`O_CREAT`), else `EINVAL` (the
    /// kernel's `ib_uverbs_open_xrcd`). The same file on another vRNIC is another domain.
    pub fn open_xrcd(
        &mut self,
        vnic: VnicId,
        ctx: CtxId,
        key: Option<(u64, u64)>,
        create: bool,
        excl: bool,
    ) -> Result<XrcdId, Errno> {
        if !self.objs.vnics.contains_key(&vnic) {
            return Err(ENOENT);
        }
        if self.objs.xrcds.values().filter(|x| x.vnic == vnic).count() >= MAX_XRCD {
            return Err(ENOMEM);
        }
        let existing = key.and_then(|k| {
            self.objs
                .xrcds
                .values()
                .find(|x| x.vnic == vnic && x.key == Some(k))
                .map(|x| x.domain)
        });
        let domain = match existing {
            Some(_) if excl => return Err(EINVAL),
            Some(d) => d,
            None if key.is_some() && !create => return Err(EINVAL),
            None => self.id(),
        };
        let id = XrcdId(self.id());
        self.objs.xrcds.insert(
            id,
            Xrcd {
                vnic,
                ctx,
                domain,
                key,
                users: 0,
            },
        );
        Ok(id)
    }

    /// `ibv_close_xrcd`: `EBUSY` while XRC SRQs or receive QPs created through this handle
    /// exist. The domain lives on while another handle holds it.
    pub fn close_xrcd(&mut self, ctx: CtxId, xrcd: XrcdId) -> Result<(), Errno> {
        match self.objs.xrcds.get(&xrcd) {
            Some(x) if x.ctx == ctx => {
                if x.users > 0 {
                    return Err(EBUSY);
                }
                self.objs.xrcds.remove(&xrcd);
                Ok(())
            }
            _ => Err(EINVAL),
        }
    }

    /// The handle `ctx` holds, with its vRNIC and domain.
    fn own_xrcd(&self, ctx: CtxId, xrcd: XrcdId) -> Result<(VnicId, u32), Errno> {
        match self.objs.xrcds.get(&xrcd) {
            Some(x) if x.ctx == ctx => Ok((x.vnic, x.domain)),
            _ => Err(EINVAL),
        }
    }

    /// `ibv_create_srq_ex` with `IBV_SRQT_XRC`: an SRQ of domain `xrcd` whose receives are
    /// checked against `pd` and complete on `cq`. Returns the SRQ, its ring depth and its
    /// number.
    #[allow(clippy::too_many_arguments)]
    pub fn create_xrc_srq(
        &mut self,
        ctx: CtxId,
        xrcd: XrcdId,
        pd: PdId,
        cq: CqId,
        max_wr: u32,
        max_sge: u32,
        limit: u32,
    ) -> Result<(SrqId, u32, u32), Errno> {
        let (vnic, domain) = self.own_xrcd(ctx, xrcd)?;
        match self.objs.cqs.get(&cq) {
            Some(c) if c.ctx == ctx && c.vnic == vnic => {}
            _ => return Err(EINVAL),
        }
        match self.objs.pds.get(&pd) {
            Some(p) if p.ctx == ctx && p.vnic == vnic => {}
            _ => return Err(EINVAL),
        }
        let (srq, depth) = self.create_srq(ctx, pd, max_wr, max_sge, limit)?;
        let mut srqn = 0;
        if let Some(s) = self.objs.srqs.get_mut(&srq) {
            s.xrc = Some(XrcSrq { xrcd, domain, cq });
            srqn = s.srqn;
        }
        if let Some(x) = self.objs.xrcds.get_mut(&xrcd) {
            x.users += 1;
        }
        if let Some(c) = self.objs.cqs.get_mut(&cq) {
            c.users += 1;
        }
        Ok((srq, depth, srqn))
    }

    /// `ibv_get_srq_num`.
    pub fn srq_num(&self, ctx: CtxId, srq: SrqId) -> Result<u32, Errno> {
        match self.objs.srqs.get(&srq) {
            Some(s) if s.ctx == ctx => Ok(s.srqn),
            _ => Err(EINVAL),
        }
    }

    /// An XRC SRQ goes away: its domain handle and CQ have one user less.
    pub(super) fn release_xrc_srq(&mut self, x: XrcSrq) {
        if let Some(h) = self.objs.xrcds.get_mut(&x.xrcd) {
            h.users = h.users.saturating_sub(1);
        }
        if let Some(c) = self.objs.cqs.get_mut(&x.cq) {
            c.users = c.users.saturating_sub(1);
        }
    }

    /// `ibv_create_qp_ex` with `IBV_QPT_XRC_SEND`: a send queue on `send_cq`, no receive
    /// queue. Returns the QP and its number.
    pub fn create_xrc_send_qp(
        &mut self,
        ctx: CtxId,
        pd: PdId,
        send_cq: CqId,
        mut cap: QpCap,
        sq_sig_all: bool,
    ) -> Result<(QpId, u32), Errno> {
        cap.max_recv_wr = 0;
        cap.max_recv_sge = 0;
        self.create_qp_srq(
            ctx,
            pd,
            send_cq,
            send_cq,
            None,
            QpType::XrcSend,
            cap,
            sq_sig_all,
        )
    }

    /// `ibv_create_qp_ex` with `IBV_QPT_XRC_RECV`: a target of domain `xrcd`, with no queues,
    /// PD or CQ of its own. Returns the QP and its number.
    pub fn create_xrc_recv_qp(&mut self, ctx: CtxId, xrcd: XrcdId) -> Result<(QpId, u32), Errno> {
        let (vnic, domain) = self.own_xrcd(ctx, xrcd)?;
        let (qp, qpn) = self.insert_qp(
            vnic,
            ctx,
            NO_PD,
            NO_CQ,
            NO_CQ,
            None,
            QpType::XrcRecv,
            QpCap::default(),
            false,
        )?;
        if let Some(q) = self.objs.qps.get_mut(&qp) {
            q.xrcd = Some((xrcd, domain));
        }
        if let Some(x) = self.objs.xrcds.get_mut(&xrcd) {
            x.users += 1;
        }
        Ok((qp, qpn))
    }

    /// An XRC receive QP goes away: its domain handle has one user less.
    pub(super) fn release_xrc_qp(&mut self, xrcd: Option<(XrcdId, u32)>) {
        if let Some((h, _)) = xrcd
            && let Some(x) = self.objs.xrcds.get_mut(&h)
        {
            x.users = x.users.saturating_sub(1);
        }
    }

    /// Drops the domain handles `ctx` holds (its objects are gone already).
    pub(super) fn close_ctx_xrcds(&mut self, ctx: CtxId) {
        self.objs.xrcds.retain(|_, x| x.ctx != ctx);
    }

    // ---- the responder's side ----------------------------------------------------------------

    /// For a request to the XRC receive QP `peer`: the SRQ numbered `srqn` becomes the one it
    /// serves, if that SRQ is an XRC SRQ of the same vRNIC and the same domain as `peer`.
    /// Otherwise the request is invalid (an SRQ of another domain, of another vRNIC, a basic
    /// SRQ, or none).
    pub(super) fn xrc_target(&mut self, peer: QpId, srqn: u32) -> Result<(), Nak> {
        let Some(q) = self.objs.qps.get(&peer) else {
            return Err(Nak::InvalidRequest);
        };
        let (vnic, domain) = match q.xrcd {
            Some((_, d)) => (q.vnic, d),
            None => return Err(Nak::InvalidRequest),
        };
        let srq =
            self.objs
                .by_srqn
                .get(&srqn)
                .copied()
                .filter(|s| {
                    self.objs.srqs.get(s).is_some_and(|s| {
                        s.vnic == vnic && s.xrc.is_some_and(|x| x.domain == domain)
                    })
                })
                .ok_or(Nak::InvalidRequest)?;
        if let Some(q) = self.objs.qps.get_mut(&peer)
            && q.xrc_srq != Some(srq)
        {
            // Another SRQ, perhaps another PD: what was translated under the last is stale.
            q.tr.rx_mem = Translated::default();
            q.xrc_srq = Some(srq);
        }
        Ok(())
    }

    /// The PD a responder checks receive buffers, R_Keys and windows against: its own, or for
    /// an XRC receive QP the PD of the XRC SRQ it serves.
    pub(super) fn responder_pd(&self, q: &Qp) -> PdId {
        match (q.ty, q.xrc_srq) {
            (QpType::XrcRecv, Some(s)) => self.objs.srqs.get(&s).map_or(NO_PD, |s| s.pd),
            (QpType::XrcRecv, None) => NO_PD,
            _ => q.pd,
        }
    }

    /// The CQ a responder's receives complete on: its receive CQ, or for an XRC receive QP the
    /// CQ of the XRC SRQ it serves.
    pub(super) fn responder_cq(&self, q: &Qp) -> CqId {
        match q.ty {
            QpType::XrcRecv => q
                .xrc_srq
                .and_then(|s| self.objs.srqs.get(&s))
                .and_then(|s| s.xrc)
                .map_or(NO_CQ, |x| x.cq),
            _ => q.recv_cq,
        }
    }
}

/// The PD of an XRC receive QP, which has none (ids start at 1).
pub(super) const NO_PD: PdId = PdId(0);
/// The CQs of an XRC receive QP, which has none.
pub(super) const NO_CQ: CqId = CqId(0);
