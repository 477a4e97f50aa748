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
//!
//! A vRNIC's windows are one [`Windows`] table, which every engine holding a slice of the
//! vRNIC shares (`--spread-qps`: [`Engine::set_vnic_windows`]), so that a window bound by a
//! work request on one engine thread is seen, and its unbinding too, by a responder QP on
//! any other at its next segment. The table's mutex is a leaf: nothing else is locked while
//! it is held, and it is taken only by window verbs and by requests under a window's R_Key.
//! A translation made through a window is never kept for a later segment, nor is a payload
//! from a peer host read into place through one ([`Engine::placement`]): an engine's memory
//! generation sees only its own changes, so each segment is checked against the window as
//! it is when the segment is handled. Window verbs therefore leave the memory generation
//! alone, and an MR's own translations are unaffected by windows.

use super::*;
use crate::MwId;
use std::sync::{Arc, Mutex, MutexGuard};

/// Most memory windows per vRNIC.
pub const MAX_MW: usize = 65536;

/// `IBV_MW_TYPE_1`.
pub const MW_TYPE_1: u32 = 1;
/// `IBV_MW_TYPE_2`.
pub const MW_TYPE_2: u32 = 2;

/// A vRNIC's memory windows, shared by the engines holding its slices (see the module docs).
#[derive(Debug, Default)]
pub struct Windows(Mutex<Table>);

#[derive(Debug, Default)]
struct Table {
    by_id: FxHashMap<MwId, Mw>,
    /// Key indices (R_Key >> 8) -> window.
    by_index: FxHashMap<u32, MwId>,
    /// Windows per PD (it cannot be deallocated meanwhile).
    in_pd: FxHashMap<PdId, u32>,
    /// Bound windows per MR (it cannot be deregistered or reregistered meanwhile).
    on_mr: FxHashMap<MrId, u32>,
}

#[derive(Debug)]
struct Mw {
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

impl Windows {
    /// A new, empty table (one per vRNIC; its slices' engines share it).
    #[must_use]
    pub fn new() -> Arc<Windows> {
        Arc::default()
    }

    fn lock(&self) -> MutexGuard<'_, Table> {
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Whether a window's key index is `index` (an MR's key must not fall in its range).
    pub(super) fn uses_index(&self, index: u32) -> bool {
        self.lock().by_index.contains_key(&index)
    }

    /// Windows in `pd`.
    pub(super) fn in_pd(&self, pd: PdId) -> u32 {
        self.lock().in_pd.get(&pd).copied().unwrap_or(0)
    }

    /// Windows bound to `mr`.
    pub(super) fn on_mr(&self, mr: MrId) -> u32 {
        self.lock().on_mr.get(&mr).copied().unwrap_or(0)
    }
}

impl Table {
    /// Drops a window's binding (its MR may be deregistered again once none is left).
    fn unbind(&mut self, mw: MwId) {
        let Some(b) = self.by_id.get_mut(&mw).and_then(|w| w.bound.take()) else {
            return;
        };
        if let Some(n) = self.on_mr.get_mut(&b.mr) {
            *n -= 1;
            if *n == 0 {
                self.on_mr.remove(&b.mr);
            }
        }
    }

    /// Takes window `mw` out, bound or not.
    fn remove(&mut self, mw: MwId) {
        self.unbind(mw);
        let Some(w) = self.by_id.remove(&mw) else {
            return;
        };
        self.by_index.remove(&(w.rkey >> 8));
        if let Some(n) = self.in_pd.get_mut(&w.pd) {
            *n -= 1;
            if *n == 0 {
                self.in_pd.remove(&w.pd);
            }
        }
    }
}

impl Engine {
    /// The windows of `vnic`, to share with the engines holding its other slices.
    #[must_use]
    pub fn vnic_windows(&self, vnic: VnicId) -> Option<Arc<Windows>> {
        self.objs.vnics.get(&vnic).map(|v| v.windows.clone())
    }

    /// Gives `vnic` the window table `windows` (its home engine's, [`Engine::vnic_windows`]):
    /// before any window or MR of it is made here.
    pub fn set_vnic_windows(&mut self, vnic: VnicId, windows: Arc<Windows>) {
        if let Some(v) = self.objs.vnics.get_mut(&vnic) {
            v.windows = windows;
        }
    }

    /// `ibv_alloc_mw`: a window of `ty` in `pd`, unbound; returns it and its R_Key.
    pub fn alloc_mw(&mut self, ctx: CtxId, pd: PdId, ty: u32) -> Result<(MwId, u32), Errno> {
        let vnic = match self.objs.pds.get(&pd) {
            Some(p) if p.ctx == ctx => p.vnic,
            _ => return Err(EINVAL),
        };
        if ty != MW_TYPE_1 && ty != MW_TYPE_2 {
            return Err(EINVAL);
        }
        let windows = self.objs.vnics.get(&vnic).ok_or(ENOENT)?.windows.clone();
        if windows.lock().by_id.len() >= MAX_MW {
            return Err(ENOMEM);
        }
        let id = MwId(self.id());
        // An index (upper 24 bits) no memory key of the vRNIC uses, whatever its low byte.
        loop {
            let index = (self.random() >> 8) as u32 & 0x00ff_ffff;
            let low = self.random() as u32 & 0xff;
            let Some(v) = self.objs.vnics.get(&vnic) else {
                return Err(ENOENT);
            };
            if index == 0 || (0..=0xffu32).any(|low| v.keys.contains_key(&(index << 8 | low))) {
                continue;
            }
            let mut t = windows.lock();
            if t.by_index.contains_key(&index) {
                continue;
            }
            let rkey = index << 8 | low;
            t.by_index.insert(index, id);
            *t.in_pd.entry(pd).or_default() += 1;
            t.by_id.insert(
                id,
                Mw {
                    ctx,
                    pd,
                    ty,
                    rkey,
                    bound: None,
                },
            );
            return Ok((id, rkey));
        }
    }

    /// `ibv_dealloc_mw`: the window and its R_Key are gone, bound or not.
    pub fn dealloc_mw(&mut self, ctx: CtxId, mw: MwId) -> Result<(), Errno> {
        let windows = self.windows_of_ctx(ctx).ok_or(EINVAL)?;
        let mut t = windows.lock();
        match t.by_id.get(&mw) {
            Some(w) if w.ctx == ctx => t.remove(mw),
            _ => return Err(EINVAL),
        }
        Ok(())
    }

    /// The R_Key of a window (for tests and the daemon's logs).
    pub fn mw_rkey(&self, mw: MwId) -> Option<u32> {
        self.objs
            .vnics
            .values()
            .find_map(|v| v.windows.lock().by_id.get(&mw).map(|w| w.rkey))
    }

    /// Windows of `vnic` in `pd`.
    pub(super) fn windows_in(&self, vnic: VnicId, pd: PdId) -> u32 {
        self.objs
            .vnics
            .get(&vnic)
            .map_or(0, |v| v.windows.in_pd(pd))
    }

    /// Windows of `vnic` bound to `mr`.
    pub(super) fn windows_on(&self, vnic: VnicId, mr: MrId) -> u32 {
        self.objs
            .vnics
            .get(&vnic)
            .map_or(0, |v| v.windows.on_mr(mr))
    }

    /// The window table of the vRNIC `ctx` belongs to (found through its PDs: a window is
    /// in one of them).
    fn windows_of_ctx(&self, ctx: CtxId) -> Option<Arc<Windows>> {
        let vnic = self.objs.pds.values().find(|p| p.ctx == ctx)?.vnic;
        self.vnic_windows(vnic)
    }

    /// Type 2 windows bound to `qp` of `vnic`, which is being destroyed, become free.
    pub(super) fn unbind_qp_windows(&mut self, vnic: VnicId, qp: QpId) {
        let Some(v) = self.objs.vnics.get(&vnic) else {
            return;
        };
        let mut t = v.windows.lock();
        let ids: Vec<MwId> = t
            .by_id
            .iter()
            .filter(|(_, w)| w.bound.is_some_and(|b| b.qp == Some(qp)))
            .map(|(&id, _)| id)
            .collect();
        for id in ids {
            t.unbind(id);
        }
    }

    /// Deallocates every window of `ctx` (before its MRs go).
    pub(super) fn dealloc_ctx_windows(&mut self, ctx: CtxId) {
        let Some(windows) = self.windows_of_ctx(ctx) else {
            return;
        };
        let mut t = windows.lock();
        let ids: Vec<MwId> = t
            .by_id
            .iter()
            .filter(|(_, w)| w.ctx == ctx)
            .map(|(&id, _)| id)
            .collect();
        for id in ids {
            t.remove(id);
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
        let q = self.objs.qps.get(&qp).ok_or(BAD)?;
        let (ctx, qpd) = (q.ctx, q.pd);
        let v = self.objs.vnics.get(&q.vnic).ok_or(BAD)?;
        let id = MwId((wqe.swap >> 32) as u32);
        let lkey = wqe.swap as u32;
        let (addr, len, acc, rkey) = (wqe.remote_addr, wqe.compare_add, wqe.imm_data, wqe.rkey);
        let mut t = v.windows.lock();
        let w = t.by_id.get(&id).filter(|w| w.ctx == ctx).ok_or(BAD)?;
        if (rkey ^ w.rkey) & !0xff != 0 || acc & !access::MW_SUPPORTED != 0 {
            return Err(BAD);
        }
        if w.ty == MW_TYPE_2 && (w.bound.is_some() || qpd != w.pd || len == 0) {
            return Err(BAD);
        }
        let binding = if len == 0 {
            None
        } else {
            let mr = *v.keys.get(&lkey).ok_or(BAD)?;
            let m = self.objs.mrs.get(&mr).ok_or(BAD)?;
            let writable = acc & (access::REMOTE_WRITE | access::REMOTE_ATOMIC) != 0;
            if m.pd != w.pd
                || m.access & access::MW_BIND == 0
                || (writable && m.access & access::LOCAL_WRITE == 0)
                || !inside(m, addr, len)
            {
                return Err(BAD);
            }
            Some(Binding {
                mr,
                addr,
                len,
                access: acc & access::MW_RIGHTS,
                qp: (w.ty == MW_TYPE_2).then_some(qp),
            })
        };
        t.unbind(id);
        if let Some(b) = binding {
            *t.on_mr.entry(b.mr).or_default() += 1;
        }
        if let Some(w) = t.by_id.get_mut(&id) {
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
        let v = self.objs.vnics.get(&vnic).ok_or(())?;
        let mut t = v.windows.lock();
        let id = *t.by_index.get(&(rkey >> 8)).ok_or(())?;
        let w = t.by_id.get(&id).ok_or(())?;
        let b = w.bound.ok_or(())?;
        if w.rkey != rkey
            || w.ty != MW_TYPE_2
            || w.pd != pd
            || on.is_some_and(|qp| b.qp != Some(qp))
        {
            return Err(());
        }
        t.unbind(id);
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
        let pd = self.responder_pd(p);
        let b = {
            let t = self.objs.vnics.get(&p.vnic)?.windows.lock();
            let w = t.by_id.get(t.by_index.get(&(rkey >> 8))?)?;
            let b = w.bound?;
            (w.rkey == rkey && w.pd == pd && b.qp.is_none_or(|qp| qp == peer)).then_some(b)?
        };
        let end = addr.checked_add(len)?;
        let ok = b.access & need != 0 && addr >= b.addr && end <= b.addr.checked_add(b.len)?;
        let m = self.objs.mrs.get(&b.mr)?;
        // What it grants ends at the window's end (inside its MR, but bounded by both).
        let limit = b
            .addr
            .saturating_add(b.len)
            .min(m.iova.saturating_add(m.len));
        (ok && m.pd == pd && inside(m, addr, len)).then_some((m, limit))
    }
}
