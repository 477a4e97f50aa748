//! Memory windows (IB spec 10.6.7, as rxe's `rxe_mw.c` implements it): a window gives remote
//! access, under its own R_Key, to a range of a memory region registered with
//! `IBV_ACCESS_MW_BIND`, with access rights of its own.
//!
//! * Type 1: bound (and rebound, or unbound with length 0) by a bind work request that
//!   `ibv_bind_mw` posts; any QP of the window's PD may use its R_Key. It cannot be
//!   invalidated.
//! * Type 2 (2B): bound by a bind work request on a QP of its PD, only while free; its R_Key
//!   is then usable by the peer of that QP only, until a local invalidation on one of the
//!   owner's QPs or a SEND with Invalidate arriving on that QP frees it, or the QP is
//!   destroyed.
//!
//! A window's R_Key keeps the upper 24 bits it got at allocation (unique among the vRNIC's
//! memory keys); a bind sets its low 8 bits to the consumer's key. Access through a window
//! never leaves the window's range, which never leaves its MR: an MR cannot be deregistered
//! or reregistered while windows are bound to it (`EINVAL`, as rxe), and a window is checked
//! against the responder QP's PD like an MR.

use super::*;
use crate::MwId;

/// Most memory windows per vRNIC.
pub const MAX_MW: usize = 65536;

/// `IBV_MW_TYPE_1`.
pub const MW_TYPE_1: u32 = 1;
/// `IBV_MW_TYPE_2`.
pub const MW_TYPE_2: u32 = 2;

#[derive(Debug)]
pub(super) struct Mw {
    vnic: VnicId,
    ctx: CtxId,
    pd: PdId,
    /// `IBV_MW_TYPE_1` or `IBV_MW_TYPE_2`.
    ty: u32,
    /// Current R_Key.
    rkey: u32,
    bound: Option<Binding>,
}

/// What a bound window gives access to.
#[derive(Debug, Clone, Copy)]
struct Binding {
    mr: MrId,
    /// Range in the MR's iova space.
    addr: u64,
    len: u64,
    access: u32,
    /// Type 2: the QP it is bound to (the only one whose peer may use it).
    qp: Option<QpId>,
}

impl Engine {
    /// `ibv_alloc_mw`: a window of `ty` in `pd`, unbound; returns it and its R_Key.
    pub fn alloc_mw(&mut self, ctx: CtxId, pd: PdId, ty: u32) -> Result<(MwId, u32), Errno> {
        let vnic = match self.objs.pds.get(&pd) {
            Some(p) if p.ctx == ctx => p.vnic,
            _ => return Err(EINVAL),
        };
        if ty != MW_TYPE_1 && ty != MW_TYPE_2 {
            return Err(EINVAL);
        }
        if self.objs.vnics.get(&vnic).ok_or(ENOENT)?.mws.len() >= MAX_MW {
            return Err(ENOMEM);
        }
        // An index (upper 24 bits) no memory key of the vRNIC uses, whatever its low byte.
        let index = loop {
            let r = self.random();
            let index = (r >> 8) as u32 & 0x00ff_ffff;
            let Some(v) = self.objs.vnics.get(&vnic) else {
                return Err(ENOENT);
            };
            if index != 0
                && !v.mws.contains_key(&index)
                && !(0..=0xffu32).any(|low| v.keys.contains_key(&(index << 8 | low)))
            {
                break index;
            }
        };
        let rkey = index << 8 | (self.random() as u32 & 0xff);
        let id = MwId(self.id());
        if let Some(v) = self.objs.vnics.get_mut(&vnic) {
            v.mws.insert(index, id);
        }
        self.objs.mws.insert(
            id,
            Mw {
                vnic,
                ctx,
                pd,
                ty,
                rkey,
                bound: None,
            },
        );
        if let Some(p) = self.objs.pds.get_mut(&pd) {
            p.users += 1;
        }
        Ok((id, rkey))
    }

    /// `ibv_dealloc_mw`: the window and its R_Key are gone, bound or not.
    pub fn dealloc_mw(&mut self, ctx: CtxId, mw: MwId) -> Result<(), Errno> {
        match self.objs.mws.get(&mw) {
            Some(w) if w.ctx == ctx => {}
            _ => return Err(EINVAL),
        }
        self.unbind(mw);
        self.memory_changed();
        let w = self.objs.mws.remove(&mw).ok_or(EINVAL)?;
        if let Some(v) = self.objs.vnics.get_mut(&w.vnic) {
            v.mws.remove(&(w.rkey >> 8));
        }
        if let Some(p) = self.objs.pds.get_mut(&w.pd) {
            p.users = p.users.saturating_sub(1);
        }
        Ok(())
    }

    /// The R_Key of a window (for tests and the daemon's logs).
    pub fn mw_rkey(&self, mw: MwId) -> Option<u32> {
        self.objs.mws.get(&mw).map(|w| w.rkey)
    }

    /// Drops a window's binding (its MR may be deregistered again once none is left).
    fn unbind(&mut self, mw: MwId) {
        let Some(b) = self.objs.mws.get_mut(&mw).and_then(|w| w.bound.take()) else {
            return;
        };
        self.memory_changed();
        if let Some(m) = self.objs.mrs.get_mut(&b.mr) {
            m.windows = m.windows.saturating_sub(1);
        }
    }

    /// Type 2 windows bound to a QP being destroyed become free.
    pub(super) fn unbind_qp_windows(&mut self, qp: QpId) {
        let ids: Vec<MwId> = self
            .objs
            .mws
            .iter()
            .filter(|(_, w)| w.bound.is_some_and(|b| b.qp == Some(qp)))
            .map(|(&id, _)| id)
            .collect();
        for id in ids {
            self.unbind(id);
        }
    }

    /// Deallocates every window of `ctx` (before its MRs go).
    pub(super) fn dealloc_ctx_windows(&mut self, ctx: CtxId) {
        let ids: Vec<MwId> = self
            .objs
            .mws
            .iter()
            .filter(|(_, w)| w.ctx == ctx)
            .map(|(&id, _)| id)
            .collect();
        for id in ids {
            let _ = self.dealloc_mw(ctx, id);
        }
    }

    /// A bind work request at the head of `qp` (`IBV_WR_BIND_MW`): the window named by the
    /// WQE, checked as rxe's `rxe_bind_mw` and `rxe_check_bind_mw` do (IB spec 10.6.7.2);
    /// `MW_BIND_ERR` if any check fails. What the MR must allow is `MW_BIND` (C10-73) and, for
    /// a window granting remote write or atomics, local write (C10-74), nothing more: a window
    /// grants remote rights its MR lacks. Its access flags may hold any a registration takes
    /// (`LOCAL_WRITE` among them, as rdma-core's tests bind windows); it grants the remote ones
    /// only.
    pub(super) fn bind_mw(&mut self, qp: QpId, wqe: &SendWqe) -> Result<(), WcStatus> {
        const BAD: WcStatus = WcStatus::MwBindErr;
        // A window's range and rights may change: translations through it are stale.
        self.memory_changed();
        let q = self.objs.qps.get(&qp).ok_or(BAD)?;
        let (vnic, ctx, qpd) = (q.vnic, q.ctx, q.pd);
        let id = MwId((wqe.swap >> 32) as u32);
        let lkey = wqe.swap as u32;
        let (addr, len, acc, rkey) = (wqe.remote_addr, wqe.compare_add, wqe.imm_data, wqe.rkey);
        let w = self.objs.mws.get(&id).filter(|w| w.ctx == ctx).ok_or(BAD)?;
        if (rkey ^ w.rkey) & !0xff != 0 || acc & !access::MW_SUPPORTED != 0 {
            return Err(BAD);
        }
        if w.ty == MW_TYPE_2 && (w.bound.is_some() || qpd != w.pd || len == 0) {
            return Err(BAD);
        }
        let mr = if len == 0 {
            None
        } else {
            let mr = *self
                .objs
                .vnics
                .get(&vnic)
                .ok_or(BAD)?
                .keys
                .get(&lkey)
                .ok_or(BAD)?;
            let m = self.objs.mrs.get(&mr).ok_or(BAD)?;
            let writable = acc & (access::REMOTE_WRITE | access::REMOTE_ATOMIC) != 0;
            if m.pd != w.pd
                || m.access & access::MW_BIND == 0
                || (writable && m.access & access::LOCAL_WRITE == 0)
                || !inside(m, addr, len)
            {
                return Err(BAD);
            }
            Some(mr)
        };
        let ty = w.ty;
        self.unbind(id);
        let binding = mr.map(|mr| Binding {
            mr,
            addr,
            len,
            access: acc & access::MW_RIGHTS,
            qp: (ty == MW_TYPE_2).then_some(qp),
        });
        if let Some(b) = binding
            && let Some(m) = self.objs.mrs.get_mut(&b.mr)
        {
            m.windows += 1;
        }
        if let Some(w) = self.objs.mws.get_mut(&id) {
            w.rkey = rkey;
            w.bound = binding;
        }
        Ok(())
    }

    /// Invalidates the type 2 window of `vnic` whose R_Key is `rkey`: it must be bound, in
    /// `pd`, and (for a SEND with Invalidate, `on` = the receiving QP) bound to that QP.
    pub(super) fn invalidate_mw(
        &mut self,
        vnic: VnicId,
        pd: PdId,
        rkey: u32,
        on: Option<QpId>,
    ) -> Result<(), ()> {
        let id = *self
            .objs
            .vnics
            .get(&vnic)
            .and_then(|v| v.mws.get(&(rkey >> 8)))
            .ok_or(())?;
        let w = self.objs.mws.get(&id).ok_or(())?;
        let b = w.bound.ok_or(())?;
        if w.rkey != rkey
            || w.ty != MW_TYPE_2
            || w.pd != pd
            || on.is_some_and(|qp| b.qp != Some(qp))
        {
            return Err(());
        }
        self.unbind(id);
        Ok(())
    }

    /// The responder's MR behind window R_Key `rkey` for `[addr, addr+len)`, if the window is
    /// bound, in the responder QP's PD, bound to that QP (type 2), allows `need` and holds the
    /// whole range (its MR holds it too, checked again); with the end of what it grants.
    pub(super) fn window_mr(
        &self,
        peer: QpId,
        addr: u64,
        len: u64,
        rkey: u32,
        need: u32,
    ) -> Option<(&Mr, u64)> {
        let p = self.objs.qps.get(&peer)?;
        let (vnic, pd) = (p.vnic, self.responder_pd(p));
        let id = self.objs.vnics.get(&vnic)?.mws.get(&(rkey >> 8))?;
        let w = self.objs.mws.get(id)?;
        let b = w.bound?;
        let end = addr.checked_add(len)?;
        let ok = w.rkey == rkey
            && w.pd == pd
            && b.qp.is_none_or(|qp| qp == peer)
            && b.access & need != 0
            && addr >= b.addr
            && end <= b.addr.checked_add(b.len)?;
        let m = self.objs.mrs.get(&b.mr)?;
        // What it grants ends at the window's end (inside its MR, but bounded by both).
        let limit = b
            .addr
            .saturating_add(b.len)
            .min(m.iova.saturating_add(m.len));
        (ok && m.pd == pd && inside(m, addr, len)).then_some((m, limit))
    }
}
