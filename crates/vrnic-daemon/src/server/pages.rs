//! The page table of registered memory: which region pages back which app pages of a context,
//! registration and deregistration (pages are reference-counted and freed only once the app
//! has mapped them back), the rings carved from the same heap, and the doorbell indices that
//! announce them.

use super::*;

pub(super) fn alloc_ring(v: &mut Vnic, depth: u32, slot: usize) -> Option<Ring> {
    let bytes = layout::ring_bytes(depth, slot);
    let off = v.heap.alloc_contiguous(bytes / layout::PAGE)?;
    let ring = Ring::new(&v.region, off, depth, slot).ok()?;
    ring.reset(&v.region);
    Some(ring)
}

/// Reserves a doorbell index of the vRNIC (named by [`set_bell`] once the queue exists).
pub(super) fn alloc_bell(v: &mut Vnic) -> Option<u32> {
    if let Some(i) = v.free_bells.pop() {
        set_bell(v, i, Bell::Pending);
        return Some(i);
    }
    let i = u32::try_from(v.bells.len()).ok()?;
    if i >= vrnic_shm::bell::BELLS {
        return None;
    }
    v.bells.push(Some(Bell::Pending));
    Some(i)
}

/// Names the queue behind doorbell `i`.
pub(super) fn set_bell(v: &mut Vnic, i: u32, b: Bell) {
    if let Some(slot) = v.bells.get_mut(i as usize) {
        *slot = Some(b);
    }
}

/// Frees doorbell `i` (a bit the tenant still rings for it names nothing).
pub(super) fn free_bell(v: &mut Vnic, i: u32) {
    if let Some(slot) = v.bells.get_mut(i as usize)
        && slot.take().is_some()
    {
        v.free_bells.push(i);
    }
}

pub(super) fn free_ring(v: &mut Vnic, off: u64, depth: u32, slot: usize) {
    free_pages(v, off, layout::ring_bytes(depth, slot) / layout::PAGE);
}

/// Gives pages back to the heap, zeroed: punched out of the file (their memory returns to the
/// host), or, where the file system cannot punch, overwritten with zeros. A page handed out
/// again reads as zeros; drivers rely on it (they do not copy untouched pages on
/// registration), and no context sees another's old bytes.
/// The most runs of kept pages one registration may name (the driver sends few: one per
/// earlier registration the new one overlaps).
const MAX_REUSE_RUNS: usize = 256;

/// Puts pages a failed registration took back from detached (see `Request::RegMr::reuse`)
/// back there: the driver still maps them, so they must not be freed.
fn unreuse(ctx: &mut Ctx, reused: &[(u64, u64)]) {
    for &(va, off) in reused {
        if ctx.pages.get(&va) == Some(&(off, 0)) {
            ctx.pages.remove(&va);
            ctx.detaching.insert(off);
        }
    }
}

pub(super) fn free_pages(v: &mut Vnic, off: u64, pages: u64) {
    let len = pages * layout::PAGE;
    if v.region.punch(off, len).is_err() {
        let zeros = [0u8; layout::PAGE as usize];
        for p in 0..pages {
            let _ = v.region.write_bytes(off + p * layout::PAGE, &zeros);
        }
    }
    v.heap.free(off, pages);
}

/// What `Request::RegMr` asks for.
pub(super) struct RegMr<'a> {
    pub pd: PdId,
    pub addr: u64,
    pub len: u64,
    pub iova: u64,
    pub access: u32,
    /// Detached pages to take back (see `Request::RegMr::reuse`).
    pub reuse: &'a [PageRun],
}

impl Server {
    pub(super) fn reg_mr(&mut self, id: CtxId, req: RegMr<'_>) -> Reply {
        let RegMr {
            pd,
            addr,
            len,
            iova,
            access,
            reuse,
        } = req;
        let page = layout::PAGE;
        let Some(vnic) = self.ctxs.get(&id).map(|c| c.vnic) else {
            return err(libc::ENODEV, "no context");
        };
        if self.per_vnic(vnic, |c| c.mrs.len()) >= self.opts.limits.max_mr as usize {
            return err(libc::ENOMEM, "MR limit of the vRNIC reached");
        }
        let Some(ctx) = self.ctxs.get_mut(&id) else {
            return err(libc::ENODEV, "no context");
        };
        let Some(v) = self.vnics.get_mut(&ctx.vnic) else {
            return err(libc::ENODEV, "vRNIC gone");
        };
        // Everything that needs no pages is checked before any work: a bad PD or an absurd
        // range costs nothing.
        if let Err(e) = self.engine.check_reg_mr(id, pd, addr, len, iova, access) {
            return err(e, "reg_mr");
        }
        let first = addr / page * page;
        let Some(end) = (addr + len).checked_next_multiple_of(page) else {
            return err(libc::EINVAL, "wrapping range");
        };
        let npages = (end - first) / page;
        // The quota, before any page is looked at: at most the pages this context already
        // holds plus the heap's free ones can back it.
        if npages > v.heap.free_bytes() / page + ctx.pages.len() as u64 {
            return err(
                libc::ENOMEM,
                format!("registering {len} bytes exceeds the vRNIC's free memory"),
            );
        }
        // Pages of an earlier registration that the driver kept mapped go back into the page
        // table as they are (reference count 0 until the loop below counts this MR). Only
        // pages this context holds detached qualify, at addresses of this range not already
        // backed: a driver cannot claim pages that are not its own.
        let mut reused: Vec<(u64, u64)> = Vec::new();
        for r in reuse.iter().take(MAX_REUSE_RUNS) {
            for i in 0..u64::from(r.pages).min(npages) {
                let (va, off) = (r.va.wrapping_add(i * page), r.off.wrapping_add(i * page));
                if va < first
                    || va >= end
                    || ctx.pages.contains_key(&va)
                    || !ctx.detaching.remove(&off)
                {
                    continue;
                }
                ctx.pages.insert(va, (off, 0));
                reused.push((va, off));
            }
        }
        let missing: Vec<u64> = (0..npages)
            .map(|i| first + i * page)
            .filter(|va| !ctx.pages.contains_key(va))
            .collect();
        let Some(allocated) = v.heap.alloc_runs(missing.len() as u64) else {
            unreuse(ctx, &reused);
            return err(
                libc::ENOMEM,
                format!("registering {len} bytes exceeds the vRNIC's free memory"),
            );
        };
        // Hand out the fresh pages in address order.
        let mut fresh_offs = allocated
            .iter()
            .flat_map(|&(off, n)| (0..n).map(move |i| off + i * page));
        let mut runs: Vec<PageRun> = Vec::new();
        let mut page_list = Vec::with_capacity(npages as usize);
        for i in 0..npages {
            let va = first + i * page;
            let (off, fresh) = match ctx.pages.get_mut(&va) {
                Some(e) => {
                    e.1 += 1;
                    (e.0, false)
                }
                None => {
                    // Invariant: we allocated exactly one page per missing va.
                    let off = fresh_offs.next().expect("one fresh page per missing va");
                    ctx.pages.insert(va, (off, 1));
                    (off, true)
                }
            };
            page_list.push(off);
            match runs.last_mut() {
                Some(r)
                    if r.fresh == fresh
                        && r.va + u64::from(r.pages) * page == va
                        && r.off + u64::from(r.pages) * page == off =>
                {
                    r.pages += 1
                }
                _ => runs.push(PageRun {
                    va,
                    off,
                    pages: 1,
                    fresh,
                }),
            }
        }
        match self
            .engine
            .reg_mr(id, pd, addr, len, iova, access, page_list)
        {
            Ok(keys) => {
                ctx.mrs.insert(keys.mr, (first, npages));
                Reply::Mr {
                    mr: keys.mr.0,
                    lkey: keys.lkey,
                    rkey: keys.rkey,
                    runs,
                }
            }
            Err(e) => {
                // Undo the page references taken above; reused pages go back to detached (the
                // driver still maps them).
                for &(va, _) in &reused {
                    if let Some(entry) = ctx.pages.get_mut(&va) {
                        entry.1 -= 1;
                    }
                }
                unreuse(ctx, &reused);
                for i in 0..npages {
                    let va = first + i * page;
                    if let Some(entry) = ctx.pages.get_mut(&va) {
                        entry.1 -= 1;
                        if entry.1 == 0 {
                            let off = entry.0;
                            ctx.pages.remove(&va);
                            free_pages(v, off, 1);
                        }
                    }
                }
                err(e, "reg_mr")
            }
        }
    }

    pub(super) fn dereg_mr(&mut self, id: CtxId, mr: MrId) -> Reply {
        let page = layout::PAGE;
        let Some(ctx) = self.ctxs.get_mut(&id) else {
            return err(libc::ENODEV, "no context");
        };
        let Some(&(first, npages)) = ctx.mrs.get(&mr) else {
            return err(libc::EINVAL, "no such MR");
        };
        if let Err(e) = self.engine.dereg_mr(id, mr) {
            return err(e, "dereg_mr");
        }
        ctx.mrs.remove(&mr);
        let mut runs: Vec<PageRun> = Vec::new();
        for i in 0..npages {
            let va = first + i * page;
            let Some(entry) = ctx.pages.get_mut(&va) else {
                continue;
            };
            entry.1 -= 1;
            if entry.1 > 0 {
                continue;
            }
            let off = entry.0;
            ctx.pages.remove(&va);
            ctx.detaching.insert(off);
            match runs.last_mut() {
                Some(r)
                    if r.va + u64::from(r.pages) * page == va
                        && r.off + u64::from(r.pages) * page == off =>
                {
                    r.pages += 1
                }
                _ => runs.push(PageRun {
                    va,
                    off,
                    pages: 1,
                    fresh: false,
                }),
            }
        }
        Reply::Detach { runs }
    }

    pub(super) fn release_pages(&mut self, id: CtxId, runs: &[PageRun]) -> Reply {
        let page = layout::PAGE;
        let Some(ctx) = self.ctxs.get_mut(&id) else {
            return err(libc::ENODEV, "no context");
        };
        let Some(v) = self.vnics.get_mut(&ctx.vnic) else {
            return err(libc::ENODEV, "vRNIC gone");
        };
        // Work in proportion to the runs and to the pages really detaching, whatever the runs
        // claim (a run of 2^20 pages that names none costs one lookup).
        for r in runs {
            let end = r.off.saturating_add(u64::from(r.pages) * page);
            let offs: Vec<u64> = ctx.detaching.range(r.off..end).copied().collect();
            for off in offs {
                ctx.detaching.remove(&off);
                free_pages(v, off, 1);
            }
        }
        Reply::Ok
    }
}
