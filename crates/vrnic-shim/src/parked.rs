//! Deregistered memory kept on its region pages, so that registering it again is cheap.
//!
//! Registration copies the app's bytes into region pages and maps them over its buffer;
//! deregistration copies them back onto private memory and frees the pages. A buffer
//! registered, used, deregistered and registered again (a message library without a
//! registration cache, or one whose cache dropped the entry) would pay both copies and both
//! remaps every round. Instead, a deregistration *parks* the buffer's pages: they stay mapped
//! over it and reserved for this context in the daemon (detached: no MR reaches them), and a
//! later registration of those addresses names them to the daemon, which puts them back in the
//! page table, with no copy and no remap.
//!
//! Parked pages are checked against `/proc/self/maps` before reuse (the app may have unmapped
//! the buffer, or mapped other memory there, since): only addresses still mapping the same
//! region pages are reused; the rest are freed. They are given back for good (*evicted*:
//! copied back onto private memory, then freed) when more than [`cap_bytes`] are parked, when
//! the vRNIC runs out of memory for a registration, and when the device is closed.
//!
//! Safe code only: this is the bookkeeping; `ffi` does the copies and remaps.

use std::collections::BTreeMap;

use vrnic_api::PageRun;

const PAGE: u64 = vrnic_shm::layout::PAGE;

/// Most bytes a context keeps parked unless `$VRNIC_PARK_MIB` says otherwise; past it the
/// oldest runs are evicted. Parked pages the app has unmapped since still hold memory in the
/// region file until then, so the cap is modest.
pub const DEFAULT_CAP_MIB: u64 = 256;

/// The cap on parked bytes: `$VRNIC_PARK_MIB` MiB (0 turns parking off: every
/// deregistration copies the buffer back at once), else [`DEFAULT_CAP_MIB`].
pub fn cap_bytes() -> u64 {
    static CAP: std::sync::OnceLock<u64> = std::sync::OnceLock::new();
    *CAP.get_or_init(|| {
        std::env::var("VRNIC_PARK_MIB")
            .ok()
            .and_then(|v| v.trim().parse::<u64>().ok())
            .unwrap_or(DEFAULT_CAP_MIB)
            .saturating_mul(1 << 20)
    })
}

/// The parked runs of one context, by address.
#[derive(Debug, Default)]
pub struct Parked {
    runs: BTreeMap<u64, Entry>,
    bytes: u64,
    clock: u64,
}

#[derive(Debug, Clone, Copy)]
struct Entry {
    run: PageRun,
    /// When it was parked (for eviction, oldest first).
    at: u64,
}

fn end(r: &PageRun) -> u64 {
    r.va + u64::from(r.pages) * PAGE
}

impl Parked {
    /// Parks `run` (pages whose last registration just went away).
    pub fn park(&mut self, run: PageRun) {
        self.clock += 1;
        self.bytes += u64::from(run.pages) * PAGE;
        self.runs.insert(
            run.va,
            Entry {
                run,
                at: self.clock,
            },
        );
    }

    /// Bytes parked.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    /// Takes out every parked run with a page in `lo..hi` (whole runs).
    pub fn take_overlapping(&mut self, lo: u64, hi: u64) -> Vec<PageRun> {
        let keys: Vec<u64> = self
            .runs
            .range(..hi)
            .rev()
            .take_while(|(_, e)| end(&e.run) > lo)
            .map(|(&va, _)| va)
            .collect();
        // Runs never overlap each other, so those ending after `lo` among the ones starting
        // before `hi` are contiguous in address order: the walk above stops at the first miss.
        let mut out: Vec<PageRun> = keys.iter().filter_map(|va| self.take(*va)).collect();
        out.sort_by_key(|r| r.va);
        out
    }

    /// Takes out the oldest runs until at most `keep` bytes stay parked.
    pub fn take_oldest_over(&mut self, keep: u64) -> Vec<PageRun> {
        let mut out = Vec::new();
        while self.bytes > keep {
            let Some(va) = self
                .runs
                .iter()
                .min_by_key(|(_, e)| e.at)
                .map(|(&va, _)| va)
            else {
                break;
            };
            out.extend(self.take(va));
        }
        out
    }

    /// Takes out every parked run.
    pub fn take_all(&mut self) -> Vec<PageRun> {
        self.bytes = 0;
        std::mem::take(&mut self.runs)
            .into_values()
            .map(|e| e.run)
            .collect()
    }

    fn take(&mut self, va: u64) -> Option<PageRun> {
        let e = self.runs.remove(&va)?;
        self.bytes -= u64::from(e.run.pages) * PAGE;
        Some(e.run)
    }
}

/// Splits `run` into its pages inside `lo..hi` (page aligned) and the pages outside, before
/// and after.
pub fn clip(run: PageRun, lo: u64, hi: u64) -> (Option<PageRun>, Vec<PageRun>) {
    let piece = |from: u64, to: u64| {
        (to > from).then(|| PageRun {
            va: from,
            off: run.off + (from - run.va),
            pages: ((to - from) / PAGE) as u32,
            fresh: false,
        })
    };
    let (a, b) = (run.va, end(&run));
    let inside = piece(a.max(lo), b.min(hi));
    let outside = [piece(a, b.min(lo)), piece(a.max(hi), b)]
        .into_iter()
        .flatten()
        .collect();
    (inside, outside)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(va: u64, off: u64, pages: u32) -> PageRun {
        PageRun {
            va: va * PAGE,
            off: off * PAGE,
            pages,
            fresh: false,
        }
    }

    #[test]
    fn overlapping_runs_are_taken_whole_and_others_stay() {
        let mut p = Parked::default();
        p.park(run(0, 100, 4));
        p.park(run(10, 200, 4));
        p.park(run(20, 300, 4));
        assert_eq!(p.bytes(), 12 * PAGE);
        // Pages 3..11 touch the first two runs.
        let got = p.take_overlapping(3 * PAGE, 11 * PAGE);
        assert_eq!(got, vec![run(0, 100, 4), run(10, 200, 4)]);
        assert_eq!(p.bytes(), 4 * PAGE);
        // A range that ends where a run begins does not touch it.
        assert!(p.take_overlapping(0, 20 * PAGE).is_empty());
        assert_eq!(p.take_all(), vec![run(20, 300, 4)]);
        assert_eq!(p.bytes(), 0);
    }

    #[test]
    fn eviction_takes_the_oldest_first() {
        let mut p = Parked::default();
        p.park(run(50, 1, 2));
        p.park(run(0, 9, 2));
        p.park(run(90, 5, 2));
        assert_eq!(p.take_oldest_over(4 * PAGE), vec![run(50, 1, 2)]);
        assert_eq!(p.take_oldest_over(0), vec![run(0, 9, 2), run(90, 5, 2)]);
    }

    #[test]
    fn clip_keeps_region_offsets_in_step_with_addresses() {
        let (inside, outside) = clip(run(10, 100, 10), 12 * PAGE, 15 * PAGE);
        assert_eq!(inside, Some(run(12, 102, 3)));
        assert_eq!(outside, vec![run(10, 100, 2), run(15, 105, 5)]);
        let (inside, outside) = clip(run(10, 100, 2), 0, 100 * PAGE);
        assert_eq!(inside, Some(run(10, 100, 2)));
        assert!(outside.is_empty());
    }
}
