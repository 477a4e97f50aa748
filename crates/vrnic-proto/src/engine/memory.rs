//! Registered memory as region runs: SGE and MR checks, translation of an address range
//! into runs of region pages, and the copies between runs.

use super::*;

/// At most this much of a message's memory is translated at once (work and room bounded per
/// step, whatever the message's length or its MR's fragmentation).
pub(super) const TRANSLATE_AHEAD: u64 = 1 << 20;
/// A responder translates at least this much of what an R_Key grants past a short message's
/// start (its later messages usually land nearby), bounded so that a fragmented MR costs a
/// few runs at most.
pub(super) const REMOTE_AHEAD: u64 = 64 << 10;

/// What gave a responder access to memory under an R_Key ([`Engine::remote_runs`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Grant {
    /// A memory region's own key.
    Mr,
    /// A memory window's key: its binding may change in another engine (see `mw`).
    Window,
}

/// A stretch of a work request's memory translated into region runs once, for the chunks (and,
/// at a responder, the messages) after the first: valid while the engine's memory generation
/// ([`Engine::memory_changed`]) is the one it was made at, so that any deregistration,
/// re-registration, window change or access change makes the next chunk check and translate
/// anew.
#[derive(Debug, Default)]
pub(super) struct Translated {
    /// The generation it was made at; 0: empty.
    generation: u64,
    /// At a responder: the R_Key and access it was checked for.
    rkey: u32,
    need: u32,
    /// What it covers: payload offsets (requester) or addresses (responder), `[start, end)`.
    start: u64,
    end: u64,
    runs: Vec<(Loc, u64)>,
    /// At a requester: made by [`Engine::check_head_sges`] for the head WQE's first chunk and
    /// not used yet (any other translation at a first chunk is an earlier WQE's).
    fresh: bool,
}

impl Translated {
    /// Whether it is valid at memory generation `generation` (made then, and not empty).
    pub(super) fn valid_at(&self, generation: u64) -> bool {
        self.generation == generation
    }

    fn covers(&self, generation: u64, start: u64, end: u64) -> bool {
        self.generation == generation && self.start <= start && end <= self.end
    }

    /// At a responder: if it was checked for R_Key `rkey` and access `need` and covers the
    /// `take` bytes at `va` of a message of `len` bytes (the whole rest of the message if
    /// `first`: a message is checked whole at its first segment) at generation `generation`,
    /// appends their runs to `out`. `false`: it does not (nothing appended).
    pub(super) fn slice_cached(
        &self,
        generation: u64,
        (va, len, take, first): (u64, u64, u64, bool),
        (rkey, need): (u32, u32),
        out: &mut Vec<(Loc, u64)>,
    ) -> bool {
        let (Some(end), Some(msg_end)) = (va.checked_add(take), va.checked_add(len)) else {
            return false;
        };
        let must_cover = if first { msg_end } else { end };
        if self.rkey == rkey && self.need == need && self.covers(generation, va, must_cover) {
            self.slice(va, take, out);
            return true;
        }
        false
    }

    /// Appends the runs of `[from, from + take)` (inside what it covers) to `out`.
    fn slice(&self, from: u64, mut take: u64, out: &mut Vec<(Loc, u64)>) {
        let mut skip = from - self.start;
        for &(loc, l) in &self.runs {
            if take == 0 {
                break;
            }
            if skip >= l {
                skip -= l;
                continue;
            }
            let n = (l - skip).min(take);
            out.push((
                Loc {
                    vnic: loc.vnic,
                    off: loc.off + skip,
                },
                n,
            ));
            skip = 0;
            take -= n;
        }
    }
}

impl Engine {
    /// Something a translation depends on changed (an MR or window went away or changed, or a
    /// QP's access flags): every [`Translated`] is stale from now on.
    pub(super) fn memory_changed(&mut self) {
        self.mem_gen += 1;
    }

    /// The region runs of bytes `[done, done + n)` of the head send WQE of `qp` (its SGEs
    /// checked by [`Engine::check_sges`] at its first chunk), appended to `out`: from what its
    /// earlier chunks translated while that is valid, else translated anew (up to
    /// [`TRANSLATE_AHEAD`] on). `false` if the SGEs no longer translate.
    pub(super) fn local_runs(
        &mut self,
        qp: QpId,
        sges: &[Sge],
        len: u64,
        done: u64,
        n: u64,
        out: &mut Vec<(Loc, u64)>,
    ) -> bool {
        let mem_gen = self.mem_gen;
        let Some(q) = self.objs.qps.get_mut(&qp) else {
            return false;
        };
        let t = &mut q.tr.tx_mem;
        if (done > 0 || t.fresh) && t.covers(mem_gen, done, done.saturating_add(n)) {
            // What the check or an earlier chunk translated: one lookup of the QP, no more.
            t.fresh = false;
            t.slice(done, n, out);
            return true;
        }
        let vnic = q.vnic;
        let mut t = std::mem::take(&mut q.tr.tx_mem);
        t.fresh = false;
        t.runs.clear();
        t.generation = 0;
        let upto = len.min(done.saturating_add(TRANSLATE_AHEAD.max(n)));
        if self
            .sge_runs(vnic, sges, done, upto - done, &mut t.runs)
            .is_some()
        {
            (t.generation, t.start, t.end) = (self.mem_gen, done, upto);
        }
        let ok = t.generation != 0;
        if ok {
            t.slice(done, n, out);
        }
        if let Some(q) = self.objs.qps.get_mut(&qp) {
            q.tr.tx_mem = t;
        }
        ok
    }

    /// The responder `peer`'s region runs of `[va, va + take)` under `rkey` with access
    /// `need`, for a request segment whose message goes on to `va + len` (`len >= take`),
    /// appended to `out`: from the last translation while it is valid and covers them (the
    /// whole message, for a first segment, so that a message running past its MR fails
    /// before a byte of it lands), else checked ([`Engine::remote_mr`] over the whole rest of
    /// the message) and translated anew. What granted the access, or `None`: no access.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn remote_runs(
        &mut self,
        peer: QpId,
        va: u64,
        len: u64,
        take: u64,
        first: bool,
        rkey: u32,
        need: u32,
        out: &mut Vec<(Loc, u64)>,
    ) -> Option<Grant> {
        va.checked_add(take)?;
        va.checked_add(len)?;
        let mem_gen = self.mem_gen;
        let q = self.objs.qps.get_mut(&peer)?;
        if q.tr
            .rx_mem
            .slice_cached(mem_gen, (va, len, take, first), (rkey, need), out)
        {
            // Checked and translated for an earlier segment or message (an MR's: a window's
            // translation is never kept): one lookup, no more.
            return Some(Grant::Mr);
        }
        let mut t = std::mem::take(&mut q.tr.rx_mem);
        t.runs.clear();
        t.generation = 0;
        // The message (up to TRANSLATE_AHEAD of it), and for a short one what its check
        // grants beyond it, up to REMOTE_AHEAD: the next messages of a requester that
        // walks a buffer (perftest cycles through one) then need no check or translation.
        let ahead = len.min(TRANSLATE_AHEAD.max(take));
        let mut grant = None;
        if let Some((m, limit, g)) = self.remote_access(peer, va, len, rkey, need)
            // Through a window: this segment only, and not kept (see `mw`).
            && let ahead = match g {
                Grant::Window => take,
                Grant::Mr => ahead.max(limit.saturating_sub(va).min(REMOTE_AHEAD)),
            }
            && translate(m, va, ahead, &mut t.runs).is_some()
        {
            (t.generation, t.rkey, t.need) = (self.mem_gen, rkey, need);
            (t.start, t.end) = (va, va + ahead);
            t.slice(va, take, out);
            if g == Grant::Window {
                t.generation = 0;
            }
            grant = Some(g);
        }
        if let Some(q) = self.objs.qps.get_mut(&peer) {
            q.tr.rx_mem = t;
        }
        grant
    }

    /// [`Engine::check_sges`] for the head send WQE of `qp` at its first chunk, translating
    /// the start of its payload (up to [`TRANSLATE_AHEAD`] of `len`) in the same pass, for
    /// [`Engine::local_runs`] to use: each SGE's MR is looked up once, not once to check and
    /// again to translate.
    pub(super) fn check_head_sges(
        &mut self,
        qp: QpId,
        (vnic, pd): (VnicId, PdId),
        sges: &[Sge],
        write: bool,
        len: u64,
    ) -> bool {
        let mem_gen = self.mem_gen;
        let Some(q) = self.objs.qps.get_mut(&qp) else {
            return false;
        };
        let upto = len.min(TRANSLATE_AHEAD);
        let need = u32::from(write);
        let tr = &mut q.tr;
        if let [s] = sges
            && tr.tx_ahead.rkey == s.lkey
            && tr.tx_ahead.need >= need
            && s.addr
                .checked_add(u64::from(s.length))
                .is_some_and(|end| tr.tx_ahead.covers(mem_gen, s.addr, end))
        {
            // One SGE inside what the last one's check granted (same key, same rights, no
            // memory change since): no MR lookup, no translation, one lookup of the QP.
            let t = &mut tr.tx_mem;
            t.runs.clear();
            tr.tx_ahead.slice(s.addr, upto, &mut t.runs);
            (t.generation, t.start, t.end, t.fresh) = (mem_gen, 0, upto, true);
            return true;
        }
        let mut t = std::mem::take(&mut tr.tx_mem);
        t.runs.clear();
        (t.generation, t.fresh) = (0, false);
        let mut ahead = std::mem::take(&mut tr.tx_ahead);
        let ok = self.check_sges_translating(vnic, pd, sges, write, upto, &mut t.runs);
        ahead.generation = 0;
        if ok
            && let [s] = sges
            && u64::from(s.length) < REMOTE_AHEAD
        {
            self.local_ahead(vnic, s, need, &mut ahead);
        }
        if let Some(q) = self.objs.qps.get_mut(&qp) {
            q.tr.tx_ahead = ahead;
        }
        if ok {
            (t.generation, t.start, t.end, t.fresh) = (self.mem_gen, 0, upto, true);
        }
        if let Some(q) = self.objs.qps.get_mut(&qp) {
            q.tr.tx_mem = t;
        }
        ok
    }

    /// Checks each SGE against its MR (key, PD, rights, bounds), translating the first `upto`
    /// bytes of the payload into `runs` in the same pass.
    fn check_sges_translating(
        &self,
        vnic: VnicId,
        pd: PdId,
        sges: &[Sge],
        write: bool,
        upto: u64,
        runs: &mut Vec<(Loc, u64)>,
    ) -> bool {
        self.objs.vnics.get(&vnic).is_some_and(|v| {
            let mut at = 0u64;
            sges.iter().all(|s| {
                if s.length == 0 {
                    return true;
                }
                let l = u64::from(s.length);
                let ok = self.sge_mr(v, pd, s, write).is_some_and(|m| {
                    at >= upto || translate(m, s.addr, l.min(upto - at), runs).is_some()
                });
                at = at.saturating_add(l);
                ok
            })
        })
    }

    /// What the key of `s` (checked) grants around it, translated into `ahead` for the next
    /// work requests of a requester that walks a buffer (perftest cycles through one): the
    /// [`REMOTE_AHEAD`]-aligned stretch of the MR that holds `s.addr`, and the next one, at
    /// most (a short SGE's: a longer one would not fit). Left empty (generation 0) if the
    /// key's MR is not found.
    fn local_ahead(&self, vnic: VnicId, s: &Sge, need: u32, ahead: &mut Translated) {
        ahead.runs.clear();
        let Some(m) = self
            .objs
            .vnics
            .get(&vnic)
            .and_then(|v| v.keys.get(&s.lkey))
            .and_then(|id| self.objs.mrs.get(id))
        else {
            return;
        };
        let mr_end = m.iova.saturating_add(m.len);
        let start = (s.addr & !(REMOTE_AHEAD - 1)).max(m.iova);
        let end = start.saturating_add(2 * REMOTE_AHEAD).min(mr_end);
        if start < end && translate(m, start, end - start, &mut ahead.runs).is_some() {
            (ahead.generation, ahead.rkey, ahead.need) = (self.mem_gen, s.lkey, need);
            (ahead.start, ahead.end) = (start, end);
        }
    }

    /// Checks local SGEs: each nonempty one names an MR of `vnic` by lkey, in `pd`, with
    /// `LOCAL_WRITE` if `write`, and lies inside it.
    pub(super) fn check_sges(&self, vnic: VnicId, pd: PdId, sges: &[Sge], write: bool) -> bool {
        let Some(v) = self.objs.vnics.get(&vnic) else {
            return false;
        };
        sges.iter()
            .all(|s| s.length == 0 || self.sge_mr(v, pd, s, write).is_some())
    }

    /// The MR a nonempty SGE names by lkey on `v`, if it is in `pd`, allows `LOCAL_WRITE`
    /// when `write`, and holds the SGE.
    fn sge_mr(&self, v: &Vnic, pd: PdId, s: &Sge, write: bool) -> Option<&Mr> {
        let m = self.objs.mrs.get(v.keys.get(&s.lkey)?)?;
        (m.pd == pd
            && (!write || m.access & access::LOCAL_WRITE != 0)
            && inside(m, s.addr, u64::from(s.length)))
        .then_some(m)
    }

    /// Appends the region runs of bytes `[skip, skip + take)` of an SGE list (already checked
    /// by [`Engine::check_sges`]) to `runs`.
    pub(super) fn sge_runs(
        &self,
        vnic: VnicId,
        sges: &[Sge],
        mut skip: u64,
        mut take: u64,
        runs: &mut Vec<(Loc, u64)>,
    ) -> Option<()> {
        let v = self.objs.vnics.get(&vnic)?;
        for s in sges {
            if take == 0 {
                break;
            }
            let l = u64::from(s.length);
            if skip >= l {
                skip -= l;
                continue;
            }
            let n = (l - skip).min(take);
            let m = self.objs.mrs.get(v.keys.get(&s.lkey)?)?;
            translate(m, s.addr.checked_add(skip)?, n, runs)?;
            skip = 0;
            take -= n;
        }
        Some(())
    }

    /// The responder's MR for `[addr, addr+len)` under `rkey`, if the responder QP allows
    /// `need`, the MR is in its PD (an XRC receive QP's: its SRQ's), allows `need` and holds the whole range.
    pub(super) fn remote_mr(
        &self,
        peer: QpId,
        addr: u64,
        len: u64,
        rkey: u32,
        need: u32,
    ) -> Option<&Mr> {
        self.remote_access(peer, addr, len, rkey, need)
            .map(|(m, _, _)| m)
    }

    /// As [`Engine::remote_mr`], with the end of what the same check grants from `addr` on:
    /// the MR's end, or the window's (and whether it was a window's). Any range from `addr`
    /// up to it passes the same check.
    fn remote_access(
        &self,
        peer: QpId,
        addr: u64,
        len: u64,
        rkey: u32,
        need: u32,
    ) -> Option<(&Mr, u64, Grant)> {
        let p = self.objs.qps.get(&peer)?;
        if p.attr.qp_access_flags & need == 0 {
            return None;
        }
        let v = self.objs.vnics.get(&p.vnic)?;
        let Some(mr) = v.keys.get(&rkey) else {
            // Not an MR's key: perhaps a memory window's.
            let (m, limit) = self.window_mr(peer, addr, len, rkey, need)?;
            return Some((m, limit, Grant::Window));
        };
        let m = self.objs.mrs.get(mr)?;
        (m.pd == self.responder_pd(p) && m.access & need != 0 && inside(m, addr, len)).then_some((
            m,
            m.iova.saturating_add(m.len),
            Grant::Mr,
        ))
    }
}

/// The Global Route Header of a UD datagram of `len` payload bytes sent from `sgid` along
/// `ah` (IB spec 8.3: version 6, traffic class, flow label, payload length, next header 0x1B
/// (IBA transport), hop limit, source GID, destination GID).
pub(super) fn grh(ah: &AhAttr, sgid: [u8; 16], len: u64) -> [u8; GRH_LEN as usize] {
    let mut g = [0u8; GRH_LEN as usize];
    let word =
        (6u32 << 28) | (u32::from(ah.grh.traffic_class) << 20) | (ah.grh.flow_label & 0xf_ffff);
    g[0..4].copy_from_slice(&word.to_be_bytes());
    g[4..6].copy_from_slice(&(len as u16).to_be_bytes());
    g[6] = 0x1b;
    g[7] = ah.grh.hop_limit;
    g[8..24].copy_from_slice(&sgid);
    g[24..40].copy_from_slice(&ah.grh.dgid);
    g
}

/// Whether `[addr, addr+len)` (in the MR's iova space) lies inside the MR.
pub(super) fn inside(m: &Mr, addr: u64, len: u64) -> bool {
    addr.checked_sub(m.iova)
        .and_then(|start| start.checked_add(len))
        .is_some_and(|end| end <= m.len)
}

/// Appends the region runs of `[addr, addr+len)` (in the MR's iova space) to `runs`, merging
/// contiguous ones (and a first run that continues the last one already there); `None` if the
/// range leaves the MR. Costs a binary search, then one step per span it crosses.
pub(super) fn translate(m: &Mr, addr: u64, len: u64, runs: &mut Vec<(Loc, u64)>) -> Option<()> {
    if !inside(m, addr, len) {
        return None;
    }
    // Byte offsets from the start of the MR's first page.
    let base = m.addr / PAGE * PAGE;
    let mut at = m.addr.checked_add(addr - m.iova)? - base;
    let end = at.checked_add(len)?;
    let mut i = m
        .spans
        .partition_point(|s| (s.first + s.pages) * PAGE <= at);
    while at < end {
        let s = m.spans.get(i)?;
        let (start, stop) = (s.first * PAGE, (s.first + s.pages) * PAGE);
        if at < start {
            return None;
        }
        let n = stop.min(end) - at;
        let off = s.off.checked_add(at - start)?;
        match runs.last_mut() {
            Some((loc, l)) if loc.vnic == m.vnic && loc.off.checked_add(*l) == Some(off) => *l += n,
            _ => runs.push((Loc { vnic: m.vnic, off }, n)),
        }
        at += n;
        i += 1;
    }
    Some(())
}

/// Copies `len` bytes from the `src` runs into the `dst` runs, one [`Memory::copy`] per
/// stretch that is contiguous on both sides.
pub(super) fn copy_runs(
    mem: &mut dyn Memory,
    src: &[(Loc, u64)],
    dst: &[(Loc, u64)],
    len: u64,
) -> Result<(), MemoryRefused> {
    let (mut si, mut so, mut di, mut dof) = (0usize, 0u64, 0usize, 0u64);
    let mut left = len;
    while left > 0
        && let (Some(&(s, sl)), Some(&(d, dl))) = (src.get(si), dst.get(di))
    {
        let n = (sl - so).min(dl - dof).min(left);
        mem.copy(
            Loc {
                vnic: s.vnic,
                off: s.off + so,
            },
            Loc {
                vnic: d.vnic,
                off: d.off + dof,
            },
            n as usize,
        )?;
        so += n;
        dof += n;
        left -= n;
        if so == sl {
            si += 1;
            so = 0;
        }
        if dof == dl {
            di += 1;
            dof = 0;
        }
    }
    Ok(())
}

/// Writes `data` across the `dst` runs.
pub(super) fn scatter_bytes(
    mem: &mut dyn Memory,
    data: &[u8],
    dst: &[(Loc, u64)],
) -> Result<(), MemoryRefused> {
    let mut at = 0usize;
    for &(d, l) in dst {
        if at >= data.len() {
            break;
        }
        let n = usize::try_from(l)
            .unwrap_or(usize::MAX)
            .min(data.len() - at);
        mem.write(d, &data[at..at + n])?;
        at += n;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn mr(addr: u64, len: u64, iova: u64, pages: Vec<u64>) -> Mr {
        let runs: Vec<(u64, u64)> = pages.iter().map(|&p| (p, 1)).collect();
        let spans = super::super::verbs::spans_of(&runs, pages.len() as u64).unwrap();
        Mr {
            vnic: VnicId(1),
            ctx: CtxId(1),
            pd: PdId(1),
            addr,
            len,
            iova,
            access: 0,
            key: 1,
            spans,
        }
    }

    #[test]
    fn translation_merges_contiguous_pages_into_one_run() {
        let m = mr(
            0x1008,
            3 * 4096,
            0x1008,
            vec![0x10_000, 0x11_000, 0x12_000, 0x13_000],
        );
        let mut runs = Vec::new();
        translate(&m, 0x1008, 3 * 4096, &mut runs).unwrap();
        let at = Loc {
            vnic: VnicId(1),
            off: 0x10_008,
        };
        assert_eq!(runs, vec![(at, 3 * 4096)]);
    }

    #[test]
    fn translation_splits_at_discontiguous_pages_and_honours_iova() {
        // App bytes from 0x2ffe; iova 0 names the first of them.
        let m = mr(0x2ffe, 4, 0, vec![0x5000, 0x1000]);
        let mut runs = Vec::new();
        translate(&m, 1, 3, &mut runs).unwrap();
        let l = |off| Loc {
            vnic: VnicId(1),
            off,
        };
        assert_eq!(runs, vec![(l(0x5fff), 1), (l(0x1000), 2)]);
        assert_eq!(translate(&m, 1, 4, &mut runs), None, "past the end");
        assert_eq!(translate(&m, u64::MAX, 2, &mut runs), None, "overflow");
    }

    #[test]
    fn translation_names_exactly_the_bytes_a_page_by_page_walk_names() {
        // Random MRs (any start, length, iova, pages partly contiguous) and random ranges,
        // against the region offset of every single byte.
        let mut seed = 0x9e37_79b9_7f4a_7c15u64;
        let mut rnd = |n: u64| {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed % n
        };
        for _ in 0..2000 {
            let addr = rnd(1 << 20);
            let len = 1 + rnd(6 * 4096);
            let iova = if rnd(2) == 0 { addr } else { rnd(1 << 30) };
            let npages = (addr + len).div_ceil(4096) - addr / 4096;
            let mut next = rnd(64) * 4096;
            let pages: Vec<u64> = (0..npages)
                .map(|_| {
                    let p = next;
                    next = if rnd(3) == 0 {
                        rnd(4096) * 4096
                    } else {
                        p + 4096
                    };
                    p
                })
                .collect();
            let m = mr(addr, len, iova, pages.clone());
            let at = iova + rnd(len + 2);
            let n = rnd(len + 2);
            let mut runs = Vec::new();
            let got = translate(&m, at, n, &mut runs);
            let fits = at >= iova && at - iova + n <= len;
            assert_eq!(
                got.is_some(),
                fits,
                "{addr:#x}+{len} iova {iova:#x}: {at:#x}+{n}"
            );
            if !fits {
                continue;
            }
            let bytes: Vec<u64> = runs
                .iter()
                .flat_map(|&(loc, l)| loc.off..loc.off + l)
                .collect();
            let want: Vec<u64> = (0..n)
                .map(|i| {
                    let app = addr + (at - iova) + i;
                    pages[(app / 4096 - addr / 4096) as usize] + app % 4096
                })
                .collect();
            assert_eq!(bytes, want);
            assert!(
                runs.windows(2).all(|w| w[0].0.off + w[0].1 != w[1].0.off),
                "runs that could be one: {runs:?}"
            );
        }
    }

    #[test]
    fn copy_runs_uses_one_copy_per_stretch_contiguous_on_both_sides() {
        struct Log(Vec<(u64, u64, usize)>);
        impl Memory for Log {
            fn copy(&mut self, src: Loc, dst: Loc, len: usize) -> Result<(), MemoryRefused> {
                self.0.push((src.off, dst.off, len));
                Ok(())
            }
            fn write(&mut self, _: Loc, _: &[u8]) -> Result<(), MemoryRefused> {
                Ok(())
            }
            fn read(&mut self, _: Loc, _: &mut [u8]) -> Result<(), MemoryRefused> {
                Ok(())
            }
            fn store_u64(&mut self, _: Loc, _: [u8; 8]) -> Result<(), MemoryRefused> {
                Ok(())
            }
        }
        let l = |off| Loc {
            vnic: VnicId(1),
            off,
        };
        let mut log = Log(Vec::new());
        copy_runs(
            &mut log,
            &[(l(0), 10), (l(100), 10)],
            &[(l(1000), 15), (l(2000), 5)],
            20,
        )
        .expect("Log refuses nothing");
        assert_eq!(log.0, vec![(0, 1000, 10), (100, 1010, 5), (105, 2000, 5)]);
    }
}
