//! The page allocator of a vRNIC's heap: which region pages are free. Pure bookkeeping, no
//! memory access; the daemon punches freed pages back to the file system itself.

use std::collections::BTreeMap;

/// Free page runs of one region heap, keyed by first page offset.
#[derive(Debug)]
pub struct Heap {
    free: BTreeMap<u64, u64>,
    page: u64,
    free_bytes: u64,
}

impl Heap {
    /// A heap of `size` bytes at region offset `off` (both page aligned).
    pub fn new(off: u64, size: u64, page: u64) -> Heap {
        let mut free = BTreeMap::new();
        if size >= page {
            free.insert(off, size / page * page);
        }
        Heap {
            free,
            page,
            free_bytes: size / page * page,
        }
    }

    /// Bytes still free.
    pub fn free_bytes(&self) -> u64 {
        self.free_bytes
    }

    /// Allocates `pages` contiguous pages (first fit).
    pub fn alloc_contiguous(&mut self, pages: u64) -> Option<u64> {
        let want = pages.checked_mul(self.page)?;
        if want == 0 {
            return None;
        }
        let (&start, &len) = self.free.iter().find(|&(_, &len)| len >= want)?;
        self.free.remove(&start);
        if len > want {
            self.free.insert(start + want, len - want);
        }
        self.free_bytes -= want;
        Some(start)
    }

    /// Allocates `pages` pages as few runs as the free list allows, largest runs first.
    /// All or nothing.
    pub fn alloc_runs(&mut self, pages: u64) -> Option<Vec<(u64, u64)>> {
        let want = pages.checked_mul(self.page)?;
        if want > self.free_bytes {
            return None;
        }
        if let Some(off) = self.alloc_contiguous(pages) {
            return Some(vec![(off, pages)]);
        }
        let mut runs: Vec<(u64, u64)> = self.free.iter().map(|(&s, &l)| (s, l)).collect();
        runs.sort_by_key(|r| std::cmp::Reverse(r.1));
        let mut out = Vec::new();
        let mut left = want;
        for (start, len) in runs {
            if left == 0 {
                break;
            }
            let take = len.min(left);
            self.free.remove(&start);
            if len > take {
                self.free.insert(start + take, len - take);
            }
            out.push((start, take / self.page));
            left -= take;
        }
        self.free_bytes -= want;
        Some(out)
    }

    /// Returns `pages` pages at `off` to the free list, merging with neighbours.
    pub fn free(&mut self, off: u64, pages: u64) {
        let mut start = off;
        let mut len = pages * self.page;
        debug_assert!(
            self.free
                .range(..start + len)
                .next_back()
                .is_none_or(|(&s, &l)| s + l <= start)
        );
        self.free_bytes += len;
        if let Some((&ps, &pl)) = self.free.range(..start).next_back()
            && ps + pl == start
        {
            self.free.remove(&ps);
            start = ps;
            len += pl;
        }
        if let Some(&nl) = self.free.get(&(start + len)) {
            self.free.remove(&(start + len));
            len += nl;
        }
        self.free.insert(start, len);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn alloc_free_merges_back_to_one_run() {
        let mut h = Heap::new(1 << 20, 64 * 4096, 4096);
        let a = h.alloc_contiguous(10).unwrap();
        let b = h.alloc_contiguous(10).unwrap();
        let c = h.alloc_contiguous(44).unwrap();
        assert!(h.alloc_contiguous(1).is_none());
        h.free(b, 10);
        h.free(a, 10);
        h.free(c, 44);
        assert_eq!(h.free.len(), 1);
        assert_eq!(h.free_bytes(), 64 * 4096);
    }

    #[test]
    fn runs_fill_fragmented_space_all_or_nothing() {
        let mut h = Heap::new(0, 8 * 4096, 4096);
        let a = h.alloc_contiguous(2).unwrap();
        let _b = h.alloc_contiguous(2).unwrap();
        let c = h.alloc_contiguous(2).unwrap();
        let _d = h.alloc_contiguous(2).unwrap();
        h.free(a, 2);
        h.free(c, 2);
        assert!(h.alloc_contiguous(4).is_none());
        assert!(h.alloc_runs(5).is_none());
        let runs = h.alloc_runs(4).unwrap();
        assert_eq!(runs.iter().map(|r| r.1).sum::<u64>(), 4);
        assert_eq!(h.free_bytes(), 0);
    }
}
