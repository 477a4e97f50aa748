//! Doorbell bits: how the daemon finds the rings with new work without looking at the others.
//!
//! Every QP and SRQ of a vRNIC has a doorbell index (given by the daemon at creation). After
//! it publishes a producer index, the driver sets that index's bit in the region's bitmap,
//! then the bit of that bitmap word in a summary, then the bit of that summary word in one
//! top word. The daemon, once per pass, reads the top word, and at each level clears the bit
//! it follows before it takes what is below: a bit set below after the daemon took it has its
//! upper bits set after the clear, so the next pass sees it (nothing is lost); at worst a pass
//! finds a word already taken. An idle vRNIC costs the daemon one load per pass, whatever its
//! number of queues; a tenant that sets bits it has no queue for, or all of them, only makes
//! the daemon look at its own queues.
//!
//! Setting is read-mostly: a bit (or summary bit) that is already set is not written again, so
//! a stream of posts between two passes costs loads, not contended writes. That is sound only
//! with a full fence between the producer-index store and those loads, and sequentially
//! consistent swaps on the daemon's side: a driver that finds a bit still set is then ordered
//! before the daemon's swap of it, which therefore sees the new producer index (without the
//! fence, the store could still sit in the store buffer while the load saw the old bit, and
//! the work would wait for the next post: the lost wake-up of brief §9).

use std::sync::atomic::{Ordering, fence};

use crate::Region;
use crate::layout::hdr;

/// Doorbell indices a region has room for.
pub const BELLS: u32 = hdr::BELL_WORDS * 32;

/// Rings doorbell `index` (after the producer index it announces was published).
pub fn ring(region: &Region, index: u32) {
    if index >= BELLS {
        return;
    }
    let word = index / 32;
    let (bit, sbit) = (1u32 << (index % 32), 1u32 << (word % 32));
    // Orders the caller's producer-index store before the loads below (see the module docs).
    fence(Ordering::SeqCst);
    if let Ok(w) = region.atomic_u32(hdr::BELLS + u64::from(word) * 4)
        && w.load(Ordering::SeqCst) & bit == 0
    {
        w.fetch_or(bit, Ordering::SeqCst);
    }
    if let Ok(s) = region.atomic_u32(hdr::BELL_SUMMARY + u64::from(word / 32) * 4)
        && s.load(Ordering::SeqCst) & sbit == 0
    {
        s.fetch_or(sbit, Ordering::SeqCst);
    }
    let abit = 1u32 << (word / 32);
    if let Ok(a) = region.atomic_u32(hdr::BELL_ANY)
        && a.load(Ordering::SeqCst) & abit == 0
    {
        a.fetch_or(abit, Ordering::SeqCst);
    }
}

/// Whether a doorbell of the region is rung and not yet taken ([`drain`]): one load, for an
/// engine that looks between the steps of a turn whether a light tenant has posted.
pub fn pending(region: &Region) -> bool {
    region
        .atomic_u32(hdr::BELL_ANY)
        .is_ok_and(|a| a.load(Ordering::Relaxed) != 0)
}

/// Takes every rung doorbell of the region, calling `f` with each index (any order). The
/// work is bounded by the bitmap's size however the tenant set it.
pub fn drain(region: &Region, mut f: impl FnMut(u32)) {
    let Ok(a) = region.atomic_u32(hdr::BELL_ANY) else {
        return;
    };
    if a.load(Ordering::Relaxed) == 0 {
        return;
    }
    let mut summaries = a.swap(0, Ordering::SeqCst);
    while summaries != 0 {
        let sw = summaries.trailing_zeros();
        summaries &= summaries - 1;
        if sw >= hdr::BELL_SUMMARY_WORDS {
            continue;
        }
        let Ok(s) = region.atomic_u32(hdr::BELL_SUMMARY + u64::from(sw) * 4) else {
            return;
        };
        let mut words = s.swap(0, Ordering::SeqCst);
        while words != 0 {
            let word = sw * 32 + words.trailing_zeros();
            words &= words - 1;
            if word >= hdr::BELL_WORDS {
                continue;
            }
            let Ok(w) = region.atomic_u32(hdr::BELLS + u64::from(word) * 4) else {
                continue;
            };
            let mut bits = w.swap(0, Ordering::SeqCst);
            while bits != 0 {
                f(word * 32 + bits.trailing_zeros());
                bits &= bits - 1;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rung_bells_are_drained_once_each() {
        let p = std::env::temp_dir().join(format!("vrnic-bell-{}", std::process::id()));
        let _ = std::fs::remove_file(&p);
        let r = Region::create(&p, 0, "b", 1, [0; 16], 1).unwrap();
        for i in [0, 1, 31, 32, 1000, BELLS - 1, BELLS, u32::MAX] {
            ring(&r, i);
        }
        ring(&r, 1000);
        let mut got = Vec::new();
        drain(&r, |i| got.push(i));
        got.sort();
        assert_eq!(got, vec![0, 1, 31, 32, 1000, BELLS - 1]);
        let mut again = Vec::new();
        drain(&r, |i| again.push(i));
        assert!(again.is_empty());
        std::fs::remove_file(p).unwrap();
    }
}
