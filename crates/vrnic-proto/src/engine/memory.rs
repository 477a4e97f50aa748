//! Registered memory as region runs: SGE and MR checks, translation of an address range
//! into runs of region pages, and the copies between runs.

use super::*;

impl Engine {
    /// Checks local SGEs: each nonempty one names an MR of `vnic` by lkey, in `pd`, with
    /// `LOCAL_WRITE` if `write`, and lies inside it.
    pub(super) fn check_sges(&self, vnic: VnicId, pd: PdId, sges: &[Sge], write: bool) -> bool {
        let Some(v) = self.vnics.get(&vnic) else {
            return false;
        };
        sges.iter().all(|s| {
            s.length == 0
                || v.keys
                    .get(&s.lkey)
                    .and_then(|mr| self.mrs.get(mr))
                    .is_some_and(|m| {
                        m.pd == pd
                            && (!write || m.access & access::LOCAL_WRITE != 0)
                            && inside(m, s.addr, u64::from(s.length))
                    })
        })
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
        let v = self.vnics.get(&vnic)?;
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
            let m = self.mrs.get(v.keys.get(&s.lkey)?)?;
            translate(m, s.addr.checked_add(skip)?, n, runs)?;
            skip = 0;
            take -= n;
        }
        Some(())
    }

    /// The responder's MR for `[addr, addr+len)` under `rkey`, if the responder QP allows
    /// `need`, the MR is in its PD, allows `need` and holds the whole range.
    pub(super) fn remote_mr(
        &self,
        peer: QpId,
        addr: u64,
        len: u64,
        rkey: u32,
        need: u32,
    ) -> Option<&Mr> {
        let p = self.qps.get(&peer)?;
        if p.attr.qp_access_flags & need == 0 {
            return None;
        }
        let v = self.vnics.get(&p.vnic)?;
        let Some(mr) = v.keys.get(&rkey) else {
            // Not an MR's key: perhaps a memory window's.
            return self.window_mr(peer, addr, len, rkey, need);
        };
        let m = self.mrs.get(mr)?;
        (m.pd == p.pd && m.access & need != 0 && inside(m, addr, len)).then_some(m)
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
/// contiguous pages; `None` if the range leaves the MR.
pub(super) fn translate(m: &Mr, addr: u64, len: u64, runs: &mut Vec<(Loc, u64)>) -> Option<()> {
    if !inside(m, addr, len) {
        return None;
    }
    let start = addr - m.iova;
    let mut app = m.addr.checked_add(start)?;
    let app_end = app.checked_add(len)?;
    let first_page = m.addr / PAGE;
    while app < app_end {
        let page = usize::try_from(app / PAGE - first_page).ok()?;
        let in_page = app % PAGE;
        let n = (PAGE - in_page).min(app_end - app);
        let off = m.pages.get(page)?.checked_add(in_page)?;
        match runs.last_mut() {
            Some((loc, l)) if loc.vnic == m.vnic && loc.off.checked_add(*l) == Some(off) => *l += n,
            _ => runs.push((Loc { vnic: m.vnic, off }, n)),
        }
        app += n;
    }
    Some(())
}

/// Copies `len` bytes from the `src` runs into the `dst` runs, one [`Memory::copy`] per
/// stretch that is contiguous on both sides.
pub(super) fn copy_runs(mem: &mut dyn Memory, src: &[(Loc, u64)], dst: &[(Loc, u64)], len: u64) {
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
        );
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
}

/// Writes `data` across the `dst` runs.
pub(super) fn scatter_bytes(mem: &mut dyn Memory, data: &[u8], dst: &[(Loc, u64)]) {
    let mut at = 0usize;
    for &(d, l) in dst {
        if at >= data.len() {
            break;
        }
        let n = usize::try_from(l)
            .unwrap_or(usize::MAX)
            .min(data.len() - at);
        mem.write(d, &data[at..at + n]);
        at += n;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn mr(addr: u64, len: u64, iova: u64, pages: Vec<u64>) -> Mr {
        Mr {
            vnic: VnicId(1),
            ctx: CtxId(1),
            pd: PdId(1),
            addr,
            len,
            iova,
            access: 0,
            key: 1,
            pages,
            windows: 0,
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
    fn copy_runs_uses_one_copy_per_stretch_contiguous_on_both_sides() {
        struct Log(Vec<(u64, u64, usize)>);
        impl Memory for Log {
            fn copy(&mut self, src: Loc, dst: Loc, len: usize) {
                self.0.push((src.off, dst.off, len));
            }
            fn write(&mut self, _: Loc, _: &[u8]) {}
            fn read(&mut self, _: Loc, _: &mut [u8]) {}
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
        );
        assert_eq!(log.0, vec![(0, 1000, 10), (100, 1010, 5), (105, 2000, 5)]);
    }
}
