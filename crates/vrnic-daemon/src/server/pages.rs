//! The page table of registered memory: which region pages back which app pages of a context,
//! registration and deregistration (pages are reference-counted and freed only once the app
//! has mapped them back), the rings carved from the same heap, and the doorbell indices that
//! announce them.

use super::*;

/// Extends the daemon's mapping of `region` (vRNIC `vnic`'s) over its first `end` bytes (the
/// heap handed out pages up to there). `false` if the address space has no room: the caller
/// gives the pages back and the request fails with `ENOMEM`. The mapping may move, so it takes
/// leave from the vRNIC's shards, held ([`Slices::grow`]): their engine threads are then
/// between passes, the only time they hold no address into the region.
pub(super) fn cover(grow: Grow<'_>, vnic: VnicId, region: &Region, end: u64) -> bool {
    assert_eq!(grow.vnic(), vnic, "another vRNIC's shards held");
    sys::grow_region(grow, region, end)
}

/// A ring of `depth` slots carved from the heap of `v` (vRNIC `vnic`), its shards held (see
/// [`cover`]).
pub(super) fn alloc_ring(
    grow: Grow<'_>,
    vnic: VnicId,
    v: &mut Vnic,
    depth: u32,
    slot: usize,
) -> Option<Ring> {
    let bytes = layout::ring_bytes(depth, slot);
    let off = v.heap.alloc_contiguous(bytes / layout::PAGE)?;
    if !cover(grow, vnic, &v.region, off + bytes) {
        v.heap.free(off, bytes / layout::PAGE);
        return None;
    }
    let ring = Ring::new(&v.region, off, depth, slot).ok()?;
    ring.reset(&v.region);
    Some(ring)
}

pub(super) fn free_ring(v: &mut Vnic, off: u64, depth: u32, slot: usize) {
    free_pages(v, off, layout::ring_bytes(depth, slot) / layout::PAGE);
}

/// Gives pages back to the heap, zeroed: punched out of the file (their memory returns to the
/// host), or, where the file system cannot punch, overwritten with zeros. A page handed out
/// again reads as zeros; drivers rely on it (they do not copy untouched pages on
/// registration), and no context sees another's old bytes.
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
        let Some(cell) = self.cell_of(vnic) else {
            return err(libc::ENODEV, "vRNIC gone");
        };
        let cells = self.slices_of(vnic);
        let Some(ctx) = self.ctxs.get_mut(&id) else {
            return err(libc::ENODEV, "no context");
        };
        let Some(v) = self.vnics.get_mut(&ctx.vnic) else {
            return err(libc::ENODEV, "vRNIC gone");
        };
        // Everything that needs no pages is checked before any work: a bad PD or an absurd
        // range costs nothing.
        let checked = cell
            .lock()
            .engine
            .check_reg_mr(id, pd, addr, len, iova, access);
        if let Err(e) = checked {
            return err(e, "reg_mr");
        }
        let first = addr / page * page;
        let Some(end) = (addr + len).checked_next_multiple_of(page) else {
            return err(libc::EINVAL, "wrapping range");
        };
        let npages = (end - first) / page;
        // The quota, before any page is looked at: at most the pages this context already
        // holds plus the heap's free ones can back it.
        if npages > v.heap.free_bytes() / page + ctx.table.mapped() {
            return err(
                libc::ENOMEM,
                format!("registering {len} bytes exceeds the vRNIC's free memory"),
            );
        }
        // Pages already registered are counted again; detached pages of an earlier
        // registration that the driver kept mapped (`reuse`: only this context's, at
        // addresses of this range not backed yet) are taken back; the rest is fresh.
        let (heap, region) = (&mut v.heap, &v.region);
        let Some(got) = ctx.table.register(first, npages, reuse, |n| {
            let runs = heap.alloc_runs(n)?;
            let end = runs
                .iter()
                .map(|&(off, p)| off + p * page)
                .max()
                .unwrap_or(0);
            // Under the shard's lock for the growth only: the pages' contents come through the
            // file, while the engine runs.
            if cover(Slices::lock(vnic, &cells).grow(), vnic, region, end) {
                Some(runs)
            } else {
                for &(off, p) in &runs {
                    heap.free(off, p);
                }
                None
            }
        }) else {
            return err(
                libc::ENOMEM,
                format!("registering {len} bytes exceeds the vRNIC's free memory"),
            );
        };
        let made = cell
            .lock()
            .engine
            .reg_mr(id, pd, addr, len, iova, access, &got.region);
        // The same MR, with its keys, in every other slice of the vRNIC.
        let made = made.and_then(|keys| {
            for (n, c) in cells.iter().enumerate().skip(1) {
                let r = c.lock().engine.mirrored(keys.mr.0, Some(keys.lkey), |e| {
                    e.reg_mr(id, pd, addr, len, iova, access, &got.region)
                });
                if let Err(e) = r {
                    for c in &cells[..n] {
                        let _ = c.lock().engine.dereg_mr(id, keys.mr);
                    }
                    return Err(e);
                }
            }
            Ok(keys)
        });
        match made {
            Ok(keys) => {
                ctx.mrs.insert(keys.mr, (first, npages));
                Reply::Mr {
                    mr: keys.mr.0,
                    lkey: keys.lkey,
                    rkey: keys.rkey,
                    runs: got.runs,
                }
            }
            Err(e) => {
                for (off, pages) in ctx.table.undo(first, npages, got.taken) {
                    free_pages(v, off, pages);
                }
                err(e, "reg_mr")
            }
        }
    }

    pub(super) fn dereg_mr(&mut self, id: CtxId, mr: MrId) -> Reply {
        let Some(cell) = self.ctxs.get(&id).and_then(|c| self.cell_of(c.vnic)) else {
            return err(libc::ENODEV, "no context");
        };
        let Some(ctx) = self.ctxs.get_mut(&id) else {
            return err(libc::ENODEV, "no context");
        };
        let Some(&(first, npages)) = ctx.mrs.get(&mr) else {
            return err(libc::EINVAL, "no such MR");
        };
        let done = cell.lock().engine.dereg_mr(id, mr);
        if let Err(e) = done {
            return err(e, "dereg_mr");
        }
        let vnic = ctx.vnic;
        ctx.mrs.remove(&mr);
        let runs = ctx.table.deregister(first, npages);
        self.on_slices(vnic, |e| {
            let _ = e.dereg_mr(id, mr);
        });
        Reply::Detach { runs }
    }

    pub(super) fn release_pages(&mut self, id: CtxId, runs: &[PageRun]) -> Reply {
        let Some(ctx) = self.ctxs.get_mut(&id) else {
            return err(libc::ENODEV, "no context");
        };
        let Some(v) = self.vnics.get_mut(&ctx.vnic) else {
            return err(libc::ENODEV, "vRNIC gone");
        };
        // Work in proportion to the runs and to the detached runs they really name, whatever
        // they claim (a run of 2^20 pages that names none costs one lookup).
        for r in runs {
            for (off, pages) in ctx.table.release(r.off, u64::from(r.pages)) {
                free_pages(v, off, pages);
            }
        }
        Reply::Ok
    }
}
