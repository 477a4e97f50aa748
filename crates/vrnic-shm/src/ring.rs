//! Single-producer single-consumer rings of fixed-size slots in a region.
//!
//! Indices are free-running `u32`s; a slot is `index & (depth - 1)`. The producer writes a slot,
//! then publishes `prod` with Release; the consumer reads `prod` with Acquire, copies the slot out,
//! then publishes `cons`. Both indices live in the region and so can be garbage: the reading side
//! always validates `prod - cons <= depth` with its own private copy of the index it owns.

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};

use crate::layout::{self, ring};
use crate::map::{Region, RegionError};

/// A ring at `off` in a region, with `depth` slots of `slot` bytes. `depth` is a power of two
/// and is the creator's private knowledge (never read back from the region).
#[derive(Debug, Clone, Copy)]
pub struct Ring {
    off: u64,
    depth: u32,
    slot: usize,
}

impl Ring {
    /// Describes a ring. Fails if it does not fit the region or `depth` is not a power of two.
    pub fn new(region: &Region, off: u64, depth: u32, slot: usize) -> Result<Ring, RegionError> {
        let bytes = layout::ring_bytes(depth, slot);
        if !depth.is_power_of_two()
            || !off.is_multiple_of(layout::PAGE)
            || off.checked_add(bytes).is_none_or(|e| e > region.size())
        {
            return Err(RegionError::Bounds {
                off,
                len: bytes,
                size: region.size(),
            });
        }
        Ok(Ring { off, depth, slot })
    }

    /// Offset of the ring in its region.
    pub fn offset(&self) -> u64 {
        self.off
    }

    /// Number of slots.
    pub fn depth(&self) -> u32 {
        self.depth
    }

    fn word<'r>(&self, region: &'r Region, at: u64) -> &'r AtomicU32 {
        // Invariant: `new` checked the ring lies in the region; `at` is a 4-aligned header field.
        region
            .atomic_u32(self.off + at)
            .expect("ring header inside the region")
    }

    /// The producer index word.
    pub fn prod<'r>(&self, region: &'r Region) -> &'r AtomicU32 {
        self.word(region, ring::PROD)
    }

    /// The consumer index word.
    pub fn cons<'r>(&self, region: &'r Region) -> &'r AtomicU32 {
        self.word(region, ring::CONS)
    }

    /// The consumer-side auxiliary word (a CQ's arm word).
    pub fn arm<'r>(&self, region: &'r Region) -> &'r AtomicU32 {
        self.word(region, ring::ARM)
    }

    /// The daemon-side auxiliary word (a CQ's notification count, a QP's state mirror).
    pub fn notify<'r>(&self, region: &'r Region) -> &'r AtomicU32 {
        self.word(region, ring::NOTIFY)
    }

    /// The daemon's word saying it looks at this ring every pass (see [`ring::POLLED`]).
    pub fn polled<'r>(&self, region: &'r Region) -> &'r AtomicU32 {
        self.word(region, ring::POLLED)
    }

    fn slot_off(&self, index: u32) -> u64 {
        self.off + ring::SLOTS + u64::from(index & (self.depth - 1)) * self.slot as u64
    }

    /// Copies slot `index` (masked) out of the ring.
    pub fn read_slot(&self, region: &Region, index: u32, out: &mut [u8]) {
        debug_assert_eq!(out.len(), self.slot);
        // Invariant: the slot lies inside the ring, which `new` checked against the region.
        region
            .read_bytes(self.slot_off(index), &mut out[..self.slot])
            .expect("slot inside the region");
    }

    /// Copies `out.len()` bytes of slot `index` (masked) from byte `at` of the slot on: the
    /// part of a slot its entry uses. Panics if that runs past the slot (a caller's bug).
    pub fn read_slot_at(&self, region: &Region, index: u32, at: usize, out: &mut [u8]) {
        assert!(at + out.len() <= self.slot, "inside one slot");
        // Invariant: as in read_slot (and the range lies inside that slot).
        region
            .read_bytes(self.slot_off(index) + at as u64, out)
            .expect("slot inside the region");
    }

    /// Starts loading the first `lines` cache lines of slot `index` (masked): see
    /// [`Region::prefetch`].
    pub fn prefetch_slot(&self, region: &Region, index: u32, lines: usize) {
        let off = self.slot_off(index);
        for l in 0..lines.min(self.slot.div_ceil(64)) {
            region.prefetch(off + 64 * l as u64);
        }
    }

    /// Copies `data` into slot `index` (masked).
    pub fn write_slot(&self, region: &Region, index: u32, data: &[u8]) {
        debug_assert_eq!(data.len(), self.slot);
        // Invariant: as in read_slot.
        region
            .write_bytes(self.slot_off(index), &data[..self.slot])
            .expect("slot inside the region");
    }

    /// Copies `data` to the start of slot `index` (masked): an entry that uses only the first
    /// part of its slot. Panics if `data` is longer than a slot (a caller's bug).
    pub fn write_slot_head(&self, region: &Region, index: u32, data: &[u8]) {
        assert!(data.len() <= self.slot, "inside one slot");
        // Invariant: as in read_slot (and the range lies inside that slot).
        region
            .write_bytes(self.slot_off(index), data)
            .expect("slot inside the region");
    }

    /// The 8-byte word at byte `at` of slot `index` (masked): a word the producer stores on
    /// its own after the rest of the slot (a completion's sequence word). Panics if `at` is
    /// not an 8-aligned offset inside a slot (a caller's bug).
    pub fn slot_word<'r>(&self, region: &'r Region, index: u32, at: usize) -> &'r AtomicU64 {
        assert!(
            at.is_multiple_of(8) && at + 8 <= self.slot,
            "a word inside one slot"
        );
        // Invariant: as in read_slot (the slots start page aligned and the slot size is a
        // multiple of 8, so the word is aligned).
        region
            .atomic_u64(self.slot_off(index) + at as u64)
            .expect("slot inside the region")
    }

    /// Zeroes the header words (done by the daemon when it creates the ring).
    pub fn reset(&self, region: &Region) {
        for at in [
            ring::PROD,
            ring::CONS,
            ring::ARM,
            ring::NOTIFY,
            ring::POLLED,
        ] {
            self.word(region, at).store(0, Ordering::Release);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slots_wrap_and_indices_publish() {
        let p = std::env::temp_dir().join(format!("vrnic-ring-{}", std::process::id()));
        let _ = std::fs::remove_file(&p);
        let r = Region::create(&p, 0, "r", 1, [0; 16], 1).unwrap();
        assert!(Ring::new(&r, layout::HEAP_OFF, 3, 64).is_err());
        assert!(Ring::new(&r, r.size() - 4096, 128, 64).is_err());
        let ring = Ring::new(&r, layout::HEAP_OFF, 4, 64).unwrap();
        ring.reset(&r);
        for i in 0..10u32 {
            ring.write_slot(&r, i, &[i as u8; 64]);
            ring.prod(&r).store(i + 1, Ordering::Release);
            let mut out = [0u8; 64];
            ring.read_slot(&r, i, &mut out);
            assert_eq!(out, [i as u8; 64]);
        }
        std::fs::remove_file(p).unwrap();
    }

    /// A full ring is written before any of it is read, lap after lap, from indices that
    /// cross the end of the ring and the end of the `u32` index space: every slot reads back
    /// what was written to it (none overwrote another), the header words and the bytes after
    /// the last slot are untouched.
    #[test]
    fn a_full_ring_wraps_around_its_slots_and_the_index_space() {
        let p = std::env::temp_dir().join(format!("vrnic-ring-wrap-{}", std::process::id()));
        let _ = std::fs::remove_file(&p);
        let r = Region::create(&p, 0, "r", 1, [0; 16], 1).unwrap();
        const DEPTH: u32 = 4;
        const SLOT: usize = 64;
        let ring = Ring::new(&r, layout::HEAP_OFF, DEPTH, SLOT).unwrap();
        ring.reset(&r);
        ring.prod(&r).store(0x1234, Ordering::Release);
        ring.cons(&r).store(0x5678, Ordering::Release);
        let after = layout::HEAP_OFF + ring::SLOTS + u64::from(DEPTH) * SLOT as u64;
        r.write_bytes(after, &[0xaa; SLOT]).unwrap();
        let tag = |i: u32| [(i as u8) ^ 0x5a; SLOT];
        for start in [0u32, 3, u32::MAX - 5] {
            for lap in 0..3u32 {
                let base = start.wrapping_add(lap * DEPTH);
                for k in 0..DEPTH {
                    ring.write_slot(&r, base.wrapping_add(k), &tag(base.wrapping_add(k)));
                }
                for k in 0..DEPTH {
                    let i = base.wrapping_add(k);
                    let mut out = [0u8; SLOT];
                    ring.read_slot(&r, i, &mut out);
                    assert_eq!(out, tag(i), "slot {i} (start {start}, lap {lap})");
                }
            }
        }
        let mut out = [0u8; SLOT];
        r.read_bytes(after, &mut out).unwrap();
        assert_eq!(out, [0xaa; SLOT], "a write went past the ring's last slot");
        assert_eq!(ring.prod(&r).load(Ordering::Acquire), 0x1234);
        assert_eq!(ring.cons(&r).load(Ordering::Acquire), 0x5678);
        std::fs::remove_file(p).unwrap();
    }
}
