//! A context's page table: which region pages back which of its app pages, kept as runs (app
//! pages contiguous in the address space and in the region, each counted by the registrations
//! over it), and the region pages it deregistered but still maps (detaching, by run). Every
//! operation costs in proportion to the runs it touches, never to the pages: registering the
//! whole of a 16 GiB region is a handful of runs, not four million entries.
//!
//! It only keeps the books: the caller allocates and frees region pages (the heap) and tells
//! the engine. Pages are [`PAGE`] bytes; app and region addresses of a run are page aligned.

use std::collections::BTreeMap;

use vrnic_api::PageRun;
use vrnic_shm::layout::PAGE;

/// The most runs of kept pages one registration may name (the driver sends few: one per
/// earlier registration the new one overlaps).
pub(super) const MAX_REUSE_RUNS: usize = 256;

/// App pages `[va, va + pages * PAGE)` are region pages `[off, off + pages * PAGE)`, each used
/// by `refs` registrations.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Run {
    pages: u64,
    off: u64,
    refs: u32,
}

/// See the module documentation.
#[derive(Debug, Default)]
pub(super) struct PageTable {
    /// First app address -> run; runs never overlap.
    runs: BTreeMap<u64, Run>,
    /// Region pages deregistered but still mapped by the app: first offset -> pages.
    detaching: BTreeMap<u64, u64>,
    /// Pages in `runs`.
    mapped: u64,
}

/// What one registration added to the table, to take back if the engine refuses it.
#[derive(Debug, Default)]
pub(super) struct Taken {
    /// Runs of fresh region pages it was given: `(va, pages)`.
    fresh: Vec<(u64, u64)>,
    /// Runs of detached pages it took back: `(va, pages)`.
    reused: Vec<(u64, u64)>,
}

/// What a registration gets: the runs for the driver (fresh ones to fill), the region runs for
/// the engine (`(offset, pages)` in address order) and what it took.
#[derive(Debug)]
pub(super) struct Registration {
    pub(super) runs: Vec<PageRun>,
    pub(super) region: Vec<(u64, u64)>,
    pub(super) taken: Taken,
}

impl PageTable {
    /// Pages backing registrations now.
    pub(super) fn mapped(&self) -> u64 {
        self.mapped
    }

    /// Makes `va` the start of a run if a run covers it (splits that run in two).
    fn split(&mut self, va: u64) {
        let Some((&start, &run)) = self.runs.range(..va).next_back() else {
            return;
        };
        let end = start + run.pages * PAGE;
        if va >= end {
            return;
        }
        let head = (va - start) / PAGE;
        self.runs.insert(start, Run { pages: head, ..run });
        self.runs.insert(
            va,
            Run {
                pages: run.pages - head,
                off: run.off + head * PAGE,
                refs: run.refs,
            },
        );
    }

    fn insert(&mut self, va: u64, run: Run) {
        self.mapped += run.pages;
        self.runs.insert(va, run);
    }

    fn remove(&mut self, va: u64) -> Option<Run> {
        let run = self.runs.remove(&va)?;
        self.mapped -= run.pages;
        Some(run)
    }

    /// The first app address at or after `va` that is not in a run, and the start of the
    /// next run after that (or `limit`).
    fn gap_at(&self, va: u64, limit: u64) -> (u64, u64) {
        let mut at = va;
        if let Some((&s, r)) = self.runs.range(..=at).next_back() {
            at = at.max(s + r.pages * PAGE);
        }
        let next = self.runs.range(at..).next().map_or(limit, |(&s, _)| s);
        (at, next.min(limit))
    }

    /// Takes `pages` detached pages at `off` out of `detaching` (they must lie in one run of it).
    fn undetach(&mut self, off: u64, pages: u64) {
        let Some((&d, &n)) = self.detaching.range(..=off).next_back() else {
            return;
        };
        let end = d + n * PAGE;
        self.detaching.remove(&d);
        if off > d {
            self.detaching.insert(d, (off - d) / PAGE);
        }
        let after = off + pages * PAGE;
        if after < end {
            self.detaching.insert(after, (end - after) / PAGE);
        }
    }

    /// Adds pages at `off` to `detaching`, merged with runs adjacent to them.
    fn detach(&mut self, off: u64, pages: u64) {
        let (mut start, mut n) = (off, pages);
        if let Some((&d, &m)) = self.detaching.range(..off).next_back()
            && d + m * PAGE == off
        {
            self.detaching.remove(&d);
            (start, n) = (d, m + n);
        }
        let end = off + pages * PAGE;
        if let Some(m) = self.detaching.remove(&end) {
            n += m;
        }
        self.detaching.insert(start, n);
    }

    /// The detached run holding `off`, as `(its offset, pages from off to its end)`; else the
    /// offset of the next detached run after `off`, if any.
    fn detached_at(&self, off: u64) -> Result<u64, Option<u64>> {
        if let Some((&d, &n)) = self.detaching.range(..=off).next_back()
            && off < d + n * PAGE
        {
            return Ok((d + n * PAGE - off) / PAGE);
        }
        Err(self.detaching.range(off..).next().map(|(&d, _)| d))
    }

    /// Registers app pages `[first, first + npages * PAGE)`: pages already in the table are
    /// counted once more, detached pages named by `reuse` (at most [`MAX_REUSE_RUNS`] runs; only
    /// pages this table holds detached, at addresses of the range not backed yet) are taken
    /// back, and what is left is given fresh pages by `alloc(pages)` (runs of region pages, as
    /// many pages as asked in all). `None` if `alloc` has none to give: then nothing changed.
    pub(super) fn register(
        &mut self,
        first: u64,
        npages: u64,
        reuse: &[PageRun],
        alloc: impl FnOnce(u64) -> Option<Vec<(u64, u64)>>,
    ) -> Option<Registration> {
        let end = first + npages * PAGE;
        self.split(first);
        self.split(end);
        let mut taken = Taken::default();
        for r in reuse.iter().take(MAX_REUSE_RUNS) {
            self.take_back(r, first, end, &mut taken.reused);
        }
        let mut gaps: Vec<(u64, u64)> = Vec::new();
        let mut va = first;
        while va < end {
            let (gap, next) = self.gap_at(va, end);
            if gap < next {
                gaps.push((gap, (next - gap) / PAGE));
            }
            va = next.max(gap);
        }
        let missing: u64 = gaps.iter().map(|&(_, n)| n).sum();
        if missing > 0 {
            let Some(fresh) = alloc(missing) else {
                for &(va, pages) in &taken.reused {
                    if let Some(run) = self.remove(va) {
                        self.detach(run.off, pages);
                    }
                }
                return None;
            };
            let mut fresh = fresh.into_iter().filter(|&(_, n)| n > 0);
            let mut piece = fresh.next();
            for (mut va, mut pages) in gaps {
                while pages > 0 {
                    // Invariant: `alloc` gave exactly `missing` pages.
                    let Some((off, n)) = piece.as_mut() else {
                        break;
                    };
                    let k = pages.min(*n);
                    self.insert(
                        va,
                        Run {
                            pages: k,
                            off: *off,
                            refs: 0,
                        },
                    );
                    taken.fresh.push((va, k));
                    (va, pages) = (va + k * PAGE, pages - k);
                    *off += k * PAGE;
                    *n -= k;
                    if *n == 0 {
                        piece = fresh.next();
                    }
                }
            }
        }
        let mut out = Registration {
            runs: Vec::new(),
            region: Vec::new(),
            taken,
        };
        let fresh_at: BTreeMap<u64, u64> = out.taken.fresh.iter().copied().collect();
        for (&va, run) in self.runs.range_mut(first..end) {
            run.refs += 1;
            let fresh = fresh_at.contains_key(&va);
            push_run(&mut out.runs, va, run.off, run.pages, fresh);
            match out.region.last_mut() {
                Some((o, n)) if *o + *n * PAGE == run.off => *n += run.pages,
                _ => out.region.push((run.off, run.pages)),
            }
        }
        Some(out)
    }

    /// Takes back the detached pages of `r` that lie in `[first, end)` at addresses no run
    /// backs, recording them in `reused`.
    fn take_back(&mut self, r: &PageRun, first: u64, end: u64, reused: &mut Vec<(u64, u64)>) {
        if !r.va.is_multiple_of(PAGE) || !r.off.is_multiple_of(PAGE) {
            return;
        }
        let rend = r.va.saturating_add(u64::from(r.pages) * PAGE);
        let (lo, hi) = (r.va.max(first), rend.min(end));
        let mut va = lo;
        while va < hi {
            let (gap, next) = self.gap_at(va, hi);
            if gap >= next {
                va = next.max(gap);
                continue;
            }
            let off = r.off.wrapping_add(gap - r.va);
            match self.detached_at(off) {
                Ok(have) => {
                    let k = have.min((next - gap) / PAGE);
                    self.undetach(off, k);
                    self.insert(
                        gap,
                        Run {
                            pages: k,
                            off,
                            refs: 0,
                        },
                    );
                    reused.push((gap, k));
                    va = gap + k * PAGE;
                }
                // Not detached here: on to where the run's offsets next are, if in this gap.
                Err(Some(d)) if d > off && d - off < next - gap => va = gap + (d - off),
                Err(_) => va = next,
            }
        }
    }

    /// Takes back a registration the engine refused: its references go, the pages it took
    /// back are detached again, and the fresh ones it was given are returned (region runs to
    /// free).
    pub(super) fn undo(&mut self, first: u64, npages: u64, taken: Taken) -> Vec<(u64, u64)> {
        let end = first + npages * PAGE;
        for run in self.runs.range_mut(first..end).map(|(_, r)| r) {
            run.refs -= 1;
        }
        for (va, pages) in taken.reused {
            if let Some(run) = self.remove(va) {
                self.detach(run.off, pages);
            }
        }
        let mut free = Vec::new();
        for (va, _) in taken.fresh {
            if let Some(run) = self.remove(va) {
                free.push((run.off, run.pages));
            }
        }
        free
    }

    /// Deregisters app pages `[first, first + npages * PAGE)` (a registration's): pages no
    /// registration uses any more become detached. Returns those, for the driver.
    pub(super) fn deregister(&mut self, first: u64, npages: u64) -> Vec<PageRun> {
        let end = first + npages * PAGE;
        self.split(first);
        self.split(end);
        let mut gone = Vec::new();
        let mut out = Vec::new();
        for (&va, run) in self.runs.range_mut(first..end) {
            run.refs = run.refs.saturating_sub(1);
            if run.refs == 0 {
                gone.push(va);
            }
        }
        for va in gone {
            if let Some(run) = self.remove(va) {
                self.detach(run.off, run.pages);
                push_run(&mut out, va, run.off, run.pages, false);
            }
        }
        out
    }

    /// The detached pages among `pages` region pages at `off` (their app no longer maps them):
    /// taken out of the table and returned (region runs to free). Costs the detached runs in
    /// that range, whatever its size.
    pub(super) fn release(&mut self, off: u64, pages: u64) -> Vec<(u64, u64)> {
        let end = off.saturating_add(pages.saturating_mul(PAGE));
        let mut free = Vec::new();
        let start = match self.detaching.range(..=off).next_back() {
            Some((&d, &n)) if off < d + n * PAGE => d,
            _ => off,
        };
        let hits: Vec<(u64, u64)> = self
            .detaching
            .range(start..end)
            .map(|(&d, &n)| (d, n))
            .collect();
        for (d, n) in hits {
            let (lo, hi) = (d.max(off), (d + n * PAGE).min(end));
            if lo >= hi {
                continue;
            }
            self.undetach(lo, (hi - lo) / PAGE);
            free.push((lo, (hi - lo) / PAGE));
        }
        free
    }

    /// Everything, taken out: region runs to free (a context that goes).
    pub(super) fn drain(&mut self) -> Vec<(u64, u64)> {
        let mut free: Vec<(u64, u64)> = self.runs.values().map(|r| (r.off, r.pages)).collect();
        free.extend(self.detaching.iter().map(|(&d, &n)| (d, n)));
        *self = PageTable::default();
        free
    }
}

/// Appends a run for the driver, merged with the last one if it continues it (in both spaces,
/// and fresh or not alike); runs stay within `u32` pages.
fn push_run(out: &mut Vec<PageRun>, va: u64, off: u64, pages: u64, fresh: bool) {
    let (mut va, mut off, mut pages) = (va, off, pages);
    while pages > 0 {
        if let Some(r) = out.last_mut()
            && r.fresh == fresh
            && r.va + u64::from(r.pages) * PAGE == va
            && r.off + u64::from(r.pages) * PAGE == off
            && r.pages < u32::MAX
        {
            let k = pages.min(u64::from(u32::MAX - r.pages));
            r.pages += k as u32;
            (va, off, pages) = (va + k * PAGE, off + k * PAGE, pages - k);
            continue;
        }
        let k = pages.min(u64::from(u32::MAX));
        out.push(PageRun {
            va,
            off,
            pages: k as u32,
            fresh,
        });
        (va, off, pages) = (va + k * PAGE, off + k * PAGE, pages - k);
    }
}

#[cfg(test)]
mod tests {
    use std::collections::{BTreeSet, HashMap};

    use super::*;

    /// A registration as the model makes it: `(va, off, fresh)` per page, and the region
    /// offset of each page in order.
    type ModelRegistration = (Vec<(u64, u64, bool)>, Vec<u64>);

    /// The page table as it was, one entry per page: the reference the runs must match.
    #[derive(Default)]
    struct Model {
        pages: HashMap<u64, (u64, u32)>,
        detaching: BTreeSet<u64>,
    }

    impl Model {
        fn register(
            &mut self,
            first: u64,
            npages: u64,
            reuse: &[PageRun],
            fresh: &mut dyn FnMut(u64) -> Option<Vec<u64>>,
        ) -> Option<ModelRegistration> {
            let end = first + npages * PAGE;
            let mut reused = Vec::new();
            for r in reuse.iter().take(MAX_REUSE_RUNS) {
                if !r.va.is_multiple_of(PAGE) || !r.off.is_multiple_of(PAGE) {
                    continue;
                }
                for i in 0..u64::from(r.pages) {
                    let (va, off) = (r.va + i * PAGE, r.off.wrapping_add(i * PAGE));
                    if va < first
                        || va >= end
                        || self.pages.contains_key(&va)
                        || !self.detaching.remove(&off)
                    {
                        continue;
                    }
                    self.pages.insert(va, (off, 0));
                    reused.push(va);
                }
            }
            let missing: Vec<u64> = (0..npages)
                .map(|i| first + i * PAGE)
                .filter(|va| !self.pages.contains_key(va))
                .collect();
            let offs = if missing.is_empty() {
                Vec::new()
            } else {
                match fresh(missing.len() as u64) {
                    Some(o) => o,
                    None => {
                        for va in reused {
                            let (off, _) = self.pages.remove(&va).unwrap();
                            self.detaching.insert(off);
                        }
                        return None;
                    }
                }
            };
            let mut offs = offs.into_iter();
            let (mut out, mut list) = (Vec::new(), Vec::new());
            for i in 0..npages {
                let va = first + i * PAGE;
                let (off, is_fresh) = match self.pages.get_mut(&va) {
                    Some(e) => {
                        e.1 += 1;
                        (e.0, false)
                    }
                    None => {
                        let off = offs.next().unwrap();
                        self.pages.insert(va, (off, 1));
                        (off, true)
                    }
                };
                out.push((va, off, is_fresh));
                list.push(off);
            }
            Some((out, list))
        }

        fn deregister(&mut self, first: u64, npages: u64) -> Vec<(u64, u64)> {
            let mut out = Vec::new();
            for i in 0..npages {
                let va = first + i * PAGE;
                let Some(e) = self.pages.get_mut(&va) else {
                    continue;
                };
                e.1 -= 1;
                if e.1 == 0 {
                    let off = e.0;
                    self.pages.remove(&va);
                    self.detaching.insert(off);
                    out.push((va, off));
                }
            }
            out
        }

        fn release(&mut self, off: u64, pages: u64) -> Vec<u64> {
            let end = off + pages * PAGE;
            let hit: Vec<u64> = self.detaching.range(off..end).copied().collect();
            for o in &hit {
                self.detaching.remove(o);
            }
            hit
        }
    }

    fn pages_of(runs: &[(u64, u64)]) -> Vec<u64> {
        runs.iter()
            .flat_map(|&(o, n)| (0..n).map(move |i| o + i * PAGE))
            .collect()
    }

    fn table_pages(t: &PageTable) -> HashMap<u64, (u64, u32)> {
        let mut m = HashMap::new();
        for (&va, r) in &t.runs {
            for i in 0..r.pages {
                m.insert(va + i * PAGE, (r.off + i * PAGE, r.refs));
            }
        }
        m
    }

    fn table_detaching(t: &PageTable) -> BTreeSet<u64> {
        t.detaching
            .iter()
            .flat_map(|(&d, &n)| (0..n).map(move |i| d + i * PAGE))
            .collect()
    }

    /// A heap of region pages that hands out runs in a scrambled order (so app-contiguous pages
    /// are often not region-contiguous), shared by the table and the model.
    struct Heap {
        free: BTreeSet<u64>,
        rng: u64,
    }

    impl Heap {
        fn take(&mut self, n: u64) -> Option<Vec<(u64, u64)>> {
            if (self.free.len() as u64) < n {
                return None;
            }
            let mut out: Vec<(u64, u64)> = Vec::new();
            let mut left = n;
            while left > 0 {
                self.rng = self.rng.wrapping_mul(6364136223846793005).wrapping_add(1);
                let skip = (self.rng >> 33) as usize % self.free.len().min(4);
                let start = *self.free.iter().nth(skip).unwrap();
                let mut k = 0;
                while k < left && self.free.remove(&(start + k * PAGE)) {
                    k += 1;
                }
                match out.last_mut() {
                    Some((o, m)) if *o + *m * PAGE == start => *m += k,
                    _ => out.push((start, k)),
                }
                left -= k;
            }
            Some(out)
        }
    }

    #[test]
    fn runs_keep_exactly_the_books_one_entry_per_page_kept() {
        let mut seed = 0x2545_f491_4f6c_dd1du64;
        let mut rnd = |n: u64| {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed % n
        };
        // How often each path was taken: registered, took back detached pages, found no
        // memory, detached pages, freed released pages.
        let mut seen = [0u32; 5];
        for round in 0..300 {
            let mut t = PageTable::default();
            let mut m = Model::default();
            let mut heap = Heap {
                free: (0..96).map(|i| (1000 + i) * PAGE).collect(),
                rng: round,
            };
            let mut mrs: Vec<(u64, u64)> = Vec::new();
            for step in 0..60 {
                let what = format!("round {round} step {step}");
                match rnd(10) {
                    0..=3 => {
                        let first = rnd(40) * PAGE;
                        let npages = 1 + rnd(24);
                        // Reuse runs a driver would send (its detached pages), and garbage.
                        let mut reuse: Vec<PageRun> = Vec::new();
                        for _ in 0..rnd(4) {
                            let off = *table_detaching(&t)
                                .iter()
                                .nth(rnd(8) as usize)
                                .unwrap_or(&(2000 * PAGE));
                            reuse.push(PageRun {
                                va: (first + rnd(npages + 4) * PAGE).saturating_sub(2 * PAGE),
                                off: off - rnd(3) * PAGE,
                                pages: rnd(10) as u32,
                                fresh: false,
                            });
                        }
                        let got = t.register(first, npages, &reuse, |n| heap.take(n));
                        let given = got.as_ref().map(|r| pages_of(&r.region));
                        // The model takes the very pages the table was given.
                        let mut fresh_given: Option<Vec<u64>> = got.as_ref().map(|r| {
                            let fresh: BTreeMap<u64, u64> = r.taken.fresh.iter().copied().collect();
                            let mut v: Vec<(u64, u64)> = Vec::new();
                            for pr in &r.runs {
                                for i in 0..u64::from(pr.pages) {
                                    let va = pr.va + i * PAGE;
                                    let in_fresh = fresh
                                        .range(..=va)
                                        .next_back()
                                        .is_some_and(|(&s, &n)| va < s + n * PAGE);
                                    if in_fresh {
                                        v.push((va, pr.off + i * PAGE));
                                    }
                                }
                            }
                            v.sort();
                            v.into_iter().map(|(_, o)| o).collect()
                        });
                        let want = m.register(first, npages, &reuse, &mut |_| fresh_given.take());
                        match (got, want) {
                            (Some(r), Some((pages, list))) => {
                                let runs: Vec<(u64, u64, bool)> = r
                                    .runs
                                    .iter()
                                    .flat_map(|p| {
                                        (0..u64::from(p.pages)).map(move |i| {
                                            (p.va + i * PAGE, p.off + i * PAGE, p.fresh)
                                        })
                                    })
                                    .collect();
                                assert_eq!(runs, pages, "{what}: driver runs");
                                assert_eq!(given.unwrap(), list, "{what}: engine runs");
                                mrs.push((first, npages));
                                seen[0] += 1;
                                seen[1] += u32::from(!r.taken.reused.is_empty());
                            }
                            (None, None) => seen[2] += 1,
                            (g, w) => panic!("{what}: {g:?} vs {w:?}"),
                        }
                    }
                    4 => {
                        // A registration the engine refused.
                        let first = rnd(40) * PAGE;
                        let npages = 1 + rnd(24);
                        let before = (table_pages(&t), table_detaching(&t));
                        if let Some(r) = t.register(first, npages, &[], |n| heap.take(n)) {
                            for (o, n) in t.undo(first, npages, r.taken) {
                                for i in 0..n {
                                    heap.free.insert(o + i * PAGE);
                                }
                            }
                        }
                        assert_eq!((table_pages(&t), table_detaching(&t)), before, "{what}");
                    }
                    5..=7 if !mrs.is_empty() => {
                        let (first, npages) = mrs.swap_remove(rnd(mrs.len() as u64) as usize);
                        let got: Vec<(u64, u64)> = t
                            .deregister(first, npages)
                            .iter()
                            .flat_map(|p| {
                                (0..u64::from(p.pages))
                                    .map(move |i| (p.va + i * PAGE, p.off + i * PAGE))
                            })
                            .collect();
                        let mut want = m.deregister(first, npages);
                        want.sort();
                        assert_eq!(got, want, "{what}: detached");
                        seen[3] += u32::from(!got.is_empty());
                    }
                    8 | 9 => {
                        let off = (1000 + rnd(100)) * PAGE;
                        let pages = rnd(30);
                        let got = pages_of(&t.release(off, pages));
                        let want = m.release(off, pages);
                        let mut g = got.clone();
                        g.sort();
                        assert_eq!(g, want, "{what}: released");
                        seen[4] += u32::from(!got.is_empty());
                        for o in got {
                            heap.free.insert(o);
                        }
                    }
                    _ => {}
                }
                assert_eq!(table_pages(&t), m.pages, "{what}: pages");
                assert_eq!(table_detaching(&t), m.detaching, "{what}: detaching");
                assert_eq!(t.mapped(), m.pages.len() as u64, "{what}: mapped");
            }
            let mut all = pages_of(&t.drain());
            let mut want: Vec<u64> = m.pages.values().map(|&(o, _)| o).collect();
            want.extend(m.detaching.iter());
            all.sort();
            want.sort();
            assert_eq!(all, want, "round {round}: drained");
        }
        assert!(
            seen.iter().all(|&n| n >= 100),
            "every path, often: {seen:?}"
        );
    }

    #[test]
    fn a_whole_region_registration_is_a_few_runs() {
        let mut t = PageTable::default();
        let npages = 4 << 20; // 16 GiB
        let r = t
            .register(0x7f00_0000_0000, npages, &[], |n| Some(vec![(1 << 20, n)]))
            .unwrap();
        assert_eq!((r.runs.len(), r.region.len(), t.runs.len()), (1, 1, 1));
        assert_eq!(t.mapped(), npages);
        // A second registration over the middle splits it into three runs, no more.
        let mid = 0x7f00_0000_0000 + (1 << 20) * PAGE;
        t.register(mid, 1 << 20, &[], |_| None).unwrap();
        assert_eq!(t.runs.len(), 3);
        assert_eq!(t.deregister(0x7f00_0000_0000, npages).len(), 2);
        assert_eq!(t.mapped(), 1 << 20);
    }
}
