//! The engine's copy loop (`vrnic_shm::copy_slice`, what every engine copy between region
//! runs goes through) against glibc's `memmove`, with the destination 0, 16 and 1 bytes past
//! the source modulo 4 KiB: the slow path (`dst - src ≡ 16`) and the worse one this
//! machine's `rep movsb` may have (an odd distance). Measured in this process, on a thread
//! pinned to the first engine core, page-aligned buffers, best of a few passes per sample.
//! Each skewed figure's limit is the same copy's aligned speed in the same run.

use std::hint::black_box;
use std::time::Instant;

use super::Ctx;
use super::report::{Better, Limit, Report};
use super::sys;

/// Copy sizes: cache-resident (where the slow path shows), and past L2.
pub const SIZES: [u64; 3] = [16 << 10, 64 << 10, 256 << 10];
/// `dst - src` modulo 4 KiB.
pub const SKEWS: [usize; 3] = [0, 16, 1];

/// The two copies measured.
#[derive(Clone, Copy)]
enum Copier {
    Engine,
    Memmove,
}

fn name(c: Copier, skew: usize) -> String {
    let who = match c {
        Copier::Engine => "engine copy",
        Copier::Memmove => "memmove (glibc)",
    };
    format!("{who}, dst - src = {skew} (mod 4 KiB)")
}

/// One sample of every copy, size and skew into `report`.
pub fn measure(ctx: &Ctx, report: &mut Report) {
    let core = ctx.engine(0).and_then(|c| c.parse::<usize>().ok());
    let budget: u64 = if ctx.quick { 100 << 20 } else { 1 << 30 };
    let samples = std::thread::spawn(move || {
        if let Some(core) = core {
            sys::pin_thread(core);
        }
        let mut out = Vec::new();
        // Source at the start, destinations 2 MiB on: room for the largest size and skew.
        let mut buf = vec![7u8; (4 << 20) + 4096];
        let base = buf.as_ptr().align_offset(4096);
        for size in SIZES {
            for skew in SKEWS {
                for c in [Copier::Engine, Copier::Memmove] {
                    let (head, tail) = buf[base..].split_at_mut(2 << 20);
                    let src = &head[..size as usize];
                    let dst = &mut tail[skew..skew + size as usize];
                    out.push((c, size, skew, rate(c, src, dst, budget)));
                }
            }
        }
        out
    })
    .join();
    match samples {
        Ok(list) => {
            for (c, size, skew, mbps) in list {
                report
                    .sample(
                        "copy",
                        &name(c, skew),
                        Some(size),
                        "MB/s",
                        Better::Higher,
                        mbps,
                    )
                    .shown = true;
            }
        }
        Err(_) => report.error("copy", anyhow::anyhow!("the copy measurement panicked")),
    }
}

/// MB/s of `c` from `src` to `dst`: the best of 5 passes of `budget / 5` bytes each.
fn rate(c: Copier, src: &[u8], dst: &mut [u8], budget: u64) -> f64 {
    let n = src.len() as u64;
    let iters = (budget / 5 / n).max(4);
    let mut best = 0.0f64;
    for _ in 0..5 {
        let t = Instant::now();
        for _ in 0..iters {
            match c {
                Copier::Engine => vrnic_shm::copy_slice(dst, black_box(src)),
                Copier::Memmove => dst.copy_from_slice(black_box(src)),
            }
            black_box(&mut *dst);
        }
        let s = t.elapsed().as_secs_f64();
        best = best.max((iters * n) as f64 / s / 1e6);
    }
    best
}

/// Each skewed copy against the same copy aligned, at the same size.
pub fn set_limits(report: &mut Report) {
    for c in [Copier::Engine, Copier::Memmove] {
        for size in SIZES {
            let Some(aligned) = report.median("copy", &name(c, 0), Some(size)) else {
                continue;
            };
            for skew in &SKEWS[1..] {
                let l = Limit {
                    what: name(c, 0),
                    value: aligned,
                    measured: true,
                };
                report.limit("copy", &name(c, *skew), Some(size), l);
            }
        }
    }
}
