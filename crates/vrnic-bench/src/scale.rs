//! Many pairs at once (the uniRDMA evaluation's figure): N unmodified `ib_write_bw -s 131072
//! -n ITERS` pairs, each side on a vRNIC of its own, for each pair count N.
//!
//! The aggregate is timed by the wall clock behind a start barrier: each client (its output
//! line-buffered by `stdbuf -oL`) is stopped (`SIGSTOP`) as soon as it prints perftest's result
//! header, which it does once connected, just before its first message; when all are stopped
//! they are continued at once, and the aggregate is every byte over the time from then to the
//! last client's end. Summing each client's own average, as `scripts/bench-scale` used to,
//! overstates it: the clients start one after another, so the first ones run alone for a while
//! (that sum is kept in the JSON, not shown). Messages a client sent between its header and its
//! stop count as if sent after the barrier (a few of `-n ITERS`).
//! The limit is memcpy of the pairs' working set (N x 128 KiB, read and written by the
//! engine) by as many threads as the daemon has engine threads, but no more than there are
//! pairs (a QP's requests are executed in order, by one thread at a time), each its share, at
//! once, on the engine cores (one thread for the daemon's default), measured in the same run;
//! past the caches it is memory bandwidth. (One pair against memcpy by 8 threads compared it
//! with 16 KiB copies that stay in each core's L1: a limit no pair can have.) A pair count
//! whose perftest could not calibrate its clock is run again, as the perftest section does.

use std::time::{Duration, Instant};

use anyhow::{Result, bail};

use super::Ctx;
use super::limits;
use super::perftest::{MIB_PER_MB, calibrated, rows, start_pairs};
use super::procs::{Daemon, Proc};
use super::report::{Better, Limit, Report, num};

/// Each pair's message size.
const SIZE: u64 = 128 << 10;

/// How a figure names the engine threads of its daemon (`None`: the daemon's default).
fn threads_part(threads: Option<u32>) -> String {
    threads.map_or(String::new(), |t| {
        format!(", {t} engine thread{}", if t == 1 { "" } else { "s" })
    })
}

/// The copiers of the limit of `n` pairs on `t` engine threads: one per thread, at most one
/// per pair.
fn copiers(n: u32, t: u32) -> u32 {
    t.min(n).max(1)
}

/// The limit's name for `n` pairs and `t` copiers ([`copiers`]).
fn limit_name(n: u32, t: u32) -> String {
    if t == 1 {
        format!("memcpy of {n} x 128 KiB")
    } else {
        format!("memcpy of {n} x 128 KiB by {t} threads")
    }
}

/// The aggregate figure's name for `n` pairs.
fn name(n: u32, threads: Option<u32>) -> String {
    format!(
        "{n} pairs ib_write_bw 128 KiB{}, aggregate by wall clock",
        threads_part(threads)
    )
}

fn sum_name(n: u32, threads: Option<u32>) -> String {
    format!(
        "{n} pairs ib_write_bw 128 KiB{}, sum of the clients' own averages",
        threads_part(threads)
    )
}

/// One run of every pair count into `report`, on daemon `d` with `threads` engine threads.
pub fn measure(ctx: &Ctx, d: &Daemon, counts: &[u32], threads: Option<u32>, report: &mut Report) {
    let t = threads.unwrap_or(1);
    let mut groups: Vec<u32> = counts.iter().map(|&n| copiers(n, t)).collect();
    groups.sort_unstable();
    groups.dedup();
    for c in groups {
        let these: Vec<u32> = counts
            .iter()
            .copied()
            .filter(|&n| copiers(n, t) == c)
            .collect();
        let sizes: Vec<u64> = these.iter().map(|&n| u64::from(n) * SIZE).collect();
        match limits::memcpy_by(ctx, &sizes, c) {
            Ok(list) => {
                for (&n, (_, mbps)) in these.iter().zip(list) {
                    let what = limit_name(n, c);
                    report
                        .sample("limits", &what, None, "MB/s", Better::Higher, mbps)
                        .pairs = Some(n);
                }
            }
            Err(e) => report.error("memcpy for the scale runs", e),
        }
    }
    for &n in counts {
        let result = calibrated(&format!("{n} pairs"), || pairs(ctx, d, n));
        match result {
            Ok((wall, sum)) => {
                let f = report.sample(
                    "scale",
                    &name(n, threads),
                    None,
                    "MB/s",
                    Better::Higher,
                    wall,
                );
                f.pairs = Some(n);
                f.shown = true;
                report
                    .sample(
                        "scale",
                        &sum_name(n, threads),
                        None,
                        "MB/s",
                        Better::Higher,
                        sum,
                    )
                    .pairs = Some(n);
            }
            Err(e) => report.error(&format!("{n} pairs"), e),
        }
    }
}

/// `n` pairs at once: (aggregate by wall clock, sum of the clients' averages), in MB/s.
fn pairs(ctx: &Ctx, d: &Daemon, n: u32) -> Result<(f64, f64)> {
    let budget: u64 = if ctx.quick { 8 << 30 } else { 128 << 30 };
    let iters = (budget / (u64::from(n) * SIZE)).max(1000);
    let args = |p: u16| -> Vec<String> {
        [
            "ib_write_bw",
            "-s",
            "131072",
            "-n",
            &iters.to_string(),
            "-p",
            &p.to_string(),
        ]
        .map(String::from)
        .to_vec()
    };
    let (servers, mut clients) = start_pairs(ctx, d, n, args, "scale")?;
    barrier(&mut clients, Duration::from_secs(120))?;
    let t0 = Instant::now();
    for c in &clients {
        c.pause(false);
    }
    // Every client's end, by polling them all, so the last end is seen when it happens.
    let limit = Duration::from_secs(600);
    let mut ends = vec![None; clients.len()];
    while ends.iter().any(Option::is_none) {
        for (c, end) in clients.iter_mut().zip(&mut ends) {
            if end.is_none() && c.exited() {
                *end = Some(t0.elapsed());
            }
        }
        if t0.elapsed() > limit {
            bail!("{n} pairs did not finish in {limit:?}");
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    let wall = ends.iter().flatten().max().copied().unwrap_or_default();
    let mut sum = 0.0;
    for (i, c) in clients.into_iter().enumerate() {
        let f = c.finish(Duration::ZERO);
        f.check(&format!("client {i} of {n}"))?;
        match rows(&f.stdout).last() {
            Some(r) => sum += r[3] * MIB_PER_MB,
            None => bail!("client {i} of {n} printed no result row\n{}", f.tail()),
        }
    }
    for s in servers {
        s.finish(Duration::from_secs(10)).check("scale server")?;
    }
    let bytes = u64::from(n) as f64 * iters as f64 * SIZE as f64;
    Ok((bytes / wall.as_secs_f64() / 1e6, sum))
}

/// The start barrier: stops each client as soon as it prints perftest's result header (it is
/// connected and about to send), until every one is stopped. A client that exits first, or
/// none within `limit`, is an error (the caller's drop of the clients kills them).
fn barrier(clients: &mut [Proc], limit: Duration) -> Result<()> {
    let start = Instant::now();
    let mut stopped = vec![false; clients.len()];
    while stopped.iter().any(|s| !s) {
        for (i, c) in clients.iter_mut().enumerate() {
            if stopped[i] {
                continue;
            }
            if c.printed("#bytes") {
                c.pause(true);
                stopped[i] = true;
            } else if c.exited() {
                bail!("scale client {i} exited before it began");
            }
        }
        if start.elapsed() > limit {
            bail!("the scale clients did not all connect within {limit:?}");
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    Ok(())
}

/// Sets each count's limit (memcpy of the working set by as many threads as engine threads,
/// at most one per pair), notes, for each daemon, the largest count against its best count's
/// aggregate, and, with several engine-thread counts, each one's best aggregate against the
/// first's and, at each count of at least as many pairs as threads, its aggregate against the
/// first's at that count (the target: 0.8 x the ratio of thread counts).
pub fn set_limits(report: &mut Report, counts: &[u32], threads: &[Option<u32>]) {
    let mut bests: Vec<(Option<u32>, f64)> = Vec::new();
    for &t in threads {
        let mut best: Option<(u32, f64)> = None;
        for &n in counts {
            let what = limit_name(n, copiers(n, t.unwrap_or(1)));
            if let Some(mc) = report.median("limits", &what, None) {
                let l = Limit {
                    what,
                    value: mc,
                    measured: true,
                };
                report.limit("scale", &name(n, t), None, l);
            }
            if let Some(agg) = report.median("scale", &name(n, t), None)
                && best.is_none_or(|(_, b)| agg > b)
            {
                best = Some((n, agg));
            }
        }
        let (Some((bn, b)), Some(&last)) = (best, counts.iter().max()) else {
            continue;
        };
        bests.push((t, b));
        if let Some(agg) = report.median("scale", &name(last, t), None) {
            report.notes.push(format!(
                "scale{}: {last} pairs move {} MB/s ({} per pair), {:.0}% of the best count's \
                 aggregate ({bn} pairs, {} MB/s); the issue's target is >= 90%",
                threads_part(t),
                num(agg),
                num(agg / f64::from(last)),
                100.0 * agg / b,
                num(b)
            ));
        }
    }
    if let [(t0, b0), rest @ ..] = &bests[..]
        && !rest.is_empty()
    {
        for (t, b) in rest {
            report.notes.push(format!(
                "scale: best aggregate{} {} MB/s, {:.2}x that{} ({} MB/s)",
                threads_part(*t),
                num(*b),
                b / b0,
                threads_part(*t0),
                num(*b0)
            ));
        }
        for &(t, _) in rest {
            let (Some(tn), Some(tf)) = (t, t0.or(Some(1))) else {
                continue;
            };
            for &n in counts.iter().filter(|&&n| n >= tn) {
                let (Some(a), Some(a0)) = (
                    report.median("scale", &name(n, t), None),
                    report.median("scale", &name(n, *t0), None),
                ) else {
                    continue;
                };
                report.notes.push(format!(
                    "scale: {n} pairs{} {} MB/s, {:.2}x{} ({} MB/s); the issue's target is >= \
                     {:.1}x",
                    threads_part(t),
                    num(a),
                    a / a0,
                    threads_part(*t0),
                    num(a0),
                    0.8 * f64::from(tn) / f64::from(tf)
                ));
            }
        }
    }
}
