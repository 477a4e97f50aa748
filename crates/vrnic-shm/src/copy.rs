//! The engine's copy loop: bytes from one place to another at memory speed whatever the
//! relative alignment of the two.
//!
//! glibc's `memmove` copies large blocks with `rep movsb` on CPUs that advertise fast strings,
//! and on the AMD EPYC machines vrnic is measured on that instruction crawls when the source and
//! destination are not equally aligned: 3.5 GB/s against 57 GB/s at 4-256 KiB when `dst - src`
//! is 1 or 8, about 60% of the aligned speed at 16 KiB when it is 16, and 2-2.5 GB/s when it
//! is 16 on an earlier machine (`docs/performance.md`). An app picks its buffers' offsets, so
//! a WRITE between two of them must not depend on them. Past [`LOOP_MIN`] bytes, this loop
//! writes the destination in aligned vectors (32 bytes with AVX2, else 16), four at a time,
//! from unaligned loads; the first and last vector are stored unaligned, overlapping the loop's.
//! Overlapping ranges, short copies and other architectures go to `ptr::copy`.

#![allow(unsafe_code)]

/// Shorter copies go to `ptr::copy`: its small-size paths are as fast as this loop's head
/// and tail, and the slow `rep movsb` starts at larger sizes.
pub(crate) const LOOP_MIN: usize = 256;

/// Copies `len` bytes from `src` to `dst`; the ranges may overlap.
///
/// # Safety
/// `src` must be valid for reads and `dst` for writes of `len` bytes.
pub(crate) unsafe fn copy(src: *const u8, dst: *mut u8, len: usize) {
    if len < LOOP_MIN || (src as usize).abs_diff(dst as usize) < len {
        // SAFETY: valid for `len` bytes (the caller's contract); `ptr::copy` allows overlap.
        unsafe { std::ptr::copy(src, dst, len) };
        return;
    }
    // SAFETY: valid (the caller's contract), apart (checked), at least LOOP_MIN bytes.
    unsafe { forward(src, dst, len) };
}

/// Copies `src` into `dst`, which must be as long (panics otherwise), with the engine's loop:
/// what `vrnic bench` measures against `memmove`.
pub fn copy_slice(dst: &mut [u8], src: &[u8]) {
    assert_eq!(dst.len(), src.len(), "copy_slice: lengths differ");
    // SAFETY: two slices of the same length; a `&mut` and a `&` cannot overlap.
    unsafe { copy(src.as_ptr(), dst.as_mut_ptr(), src.len()) };
}

/// # Safety
/// Valid for `len >= LOOP_MIN` bytes each, the ranges apart.
#[cfg(target_arch = "x86_64")]
unsafe fn forward(src: *const u8, dst: *mut u8, len: usize) {
    if std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU has AVX2 (checked); ranges as this function's contract.
        unsafe { avx2::forward(src, dst, len) };
    } else {
        // SAFETY: SSE2 is part of x86-64; ranges as this function's contract.
        unsafe { sse2::forward(src, dst, len) };
    }
}

/// # Safety
/// Valid for `len` bytes each, the ranges apart.
#[cfg(not(target_arch = "x86_64"))]
unsafe fn forward(src: *const u8, dst: *mut u8, len: usize) {
    // SAFETY: as this function's contract.
    unsafe { std::ptr::copy_nonoverlapping(src, dst, len) };
}

/// Generates `mod $m` with `forward`: a forward copy with vectors of `$v` (`$w` bytes), loaded
/// by `$load` and stored by `$store` (both unaligned forms; the loop's stores land aligned).
macro_rules! forward_with {
    ($m:ident, $feature:literal, $v:ty, $w:literal, $load:path, $store:path) => {
        #[cfg(target_arch = "x86_64")]
        mod $m {
            const W: usize = $w;

            /// # Safety
            /// The CPU has the feature; `p` valid for reads of `W` bytes.
            #[target_feature(enable = $feature)]
            #[inline]
            unsafe fn ld(p: *const u8) -> $v {
                // SAFETY: as this function's contract (an unaligned load).
                unsafe { $load(p.cast()) }
            }

            /// # Safety
            /// The CPU has the feature; `p` valid for writes of `W` bytes.
            #[target_feature(enable = $feature)]
            #[inline]
            unsafe fn st(p: *mut u8, v: $v) {
                // SAFETY: as this function's contract (an unaligned store).
                unsafe { $store(p.cast(), v) }
            }

            /// # Safety
            /// The CPU has the feature; `src` valid for reads and `dst` for writes of
            /// `len >= 4 * W` bytes, the ranges apart.
            #[target_feature(enable = $feature)]
            pub(super) unsafe fn forward(src: *const u8, dst: *mut u8, len: usize) {
                debug_assert!(len >= 4 * W);
                let (s, d) = (
                    |i: usize| src.wrapping_add(i),
                    |i: usize| dst.wrapping_add(i),
                );
                // The first vector unaligned, then from the first aligned byte of `dst` on.
                // SAFETY: W <= len bytes at the start of `src`.
                let head = unsafe { ld(s(0)) };
                // SAFETY: W <= len bytes at the start of `dst`.
                unsafe { st(d(0), head) };
                let mut i = W - (dst as usize & (W - 1));
                while i + 4 * W <= len {
                    // SAFETY: i + 4W <= len, inside both ranges (for this and the seven below).
                    let a = unsafe { ld(s(i)) };
                    // SAFETY: see above.
                    let b = unsafe { ld(s(i + W)) };
                    // SAFETY: see above.
                    let c = unsafe { ld(s(i + 2 * W)) };
                    // SAFETY: see above.
                    let e = unsafe { ld(s(i + 3 * W)) };
                    // SAFETY: see above.
                    unsafe { st(d(i), a) };
                    // SAFETY: see above.
                    unsafe { st(d(i + W), b) };
                    // SAFETY: see above.
                    unsafe { st(d(i + 2 * W), c) };
                    // SAFETY: see above.
                    unsafe { st(d(i + 3 * W), e) };
                    i += 4 * W;
                }
                while i + W <= len {
                    // SAFETY: i + W <= len, inside `src`.
                    let a = unsafe { ld(s(i)) };
                    // SAFETY: i + W <= len, inside `dst`.
                    unsafe { st(d(i), a) };
                    i += W;
                }
                // The last vector unaligned, ending at the last byte.
                // SAFETY: len >= W: the last W bytes of `src`.
                let tail = unsafe { ld(s(len - W)) };
                // SAFETY: the last W bytes of `dst`.
                unsafe { st(d(len - W), tail) };
            }
        }
    };
}

forward_with!(
    avx2,
    "avx2",
    std::arch::x86_64::__m256i,
    32,
    std::arch::x86_64::_mm256_loadu_si256,
    std::arch::x86_64::_mm256_storeu_si256
);
forward_with!(
    sse2,
    "sse2",
    std::arch::x86_64::__m128i,
    16,
    std::arch::x86_64::_mm_loadu_si128,
    std::arch::x86_64::_mm_storeu_si128
);

#[cfg(test)]
mod tests {
    use super::*;

    fn pattern(n: usize) -> Vec<u8> {
        (0..n).map(|i| (i * 7 + i / 251) as u8).collect()
    }

    #[test]
    fn every_relative_offset_and_length_copies_exactly() {
        let lens = [
            0,
            1,
            31,
            LOOP_MIN - 1,
            LOOP_MIN,
            LOOP_MIN + 1,
            300,
            1000,
            4096 + 17,
            70_000,
        ];
        let src_all = pattern(80_000);
        for len in lens {
            for s_off in [0, 1, 8, 16, 31, 33, 63] {
                for d_off in 0..64 {
                    let src = &src_all[s_off..s_off + len];
                    let mut buf = vec![0xeeu8; len + 128];
                    copy_slice(&mut buf[d_off..d_off + len], src);
                    assert_eq!(
                        &buf[d_off..d_off + len],
                        src,
                        "len {len} s {s_off} d {d_off}"
                    );
                    assert!(buf[..d_off].iter().all(|&b| b == 0xee), "wrote before");
                    assert!(buf[d_off + len..].iter().all(|&b| b == 0xee), "wrote after");
                }
            }
        }
    }

    #[test]
    fn overlapping_ranges_copy_as_memmove_does() {
        for (from, to) in [
            (0usize, 16usize),
            (16, 0),
            (0, 1),
            (1, 0),
            (100, 3000),
            (3000, 100),
        ] {
            let len = 4000;
            let mut buf = pattern(8000);
            let want: Vec<u8> = buf[from..from + len].to_vec();
            let p = buf.as_mut_ptr();
            // SAFETY: both ranges lie inside `buf` (8000 bytes).
            unsafe { copy(p.wrapping_add(from), p.wrapping_add(to), len) };
            assert_eq!(&buf[to..to + len], &want[..], "{from} -> {to}");
        }
    }

    #[test]
    fn the_vector_loops_match_on_this_cpu() {
        // Both loops, whichever `copy` picks here.
        let src = pattern(5000);
        for d_off in [0, 1, 16, 17] {
            for len in [64, 65, 130, 4999 - 17] {
                let mut a = vec![0u8; 5100];
                let (s, d) = (src.as_ptr(), a.as_mut_ptr().wrapping_add(d_off));
                // SAFETY: SSE2 is part of x86-64; src has 5000 >= len bytes, `a` 5100 >= d_off +
                // len; two allocations.
                #[cfg(target_arch = "x86_64")]
                unsafe {
                    sse2::forward(s, d, len)
                };
                assert_eq!(&a[d_off..d_off + len], &src[..len]);
                #[cfg(target_arch = "x86_64")]
                if std::arch::is_x86_feature_detected!("avx2") && len >= 128 {
                    let mut b = vec![0u8; 5100];
                    let d = b.as_mut_ptr().wrapping_add(d_off);
                    // SAFETY: AVX2 present (checked); bounds as above.
                    unsafe { avx2::forward(s, d, len) };
                    assert_eq!(&b[d_off..d_off + len], &src[..len]);
                }
            }
        }
    }
}
