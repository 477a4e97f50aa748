//! Many vRNICs on one daemon: `vrnic create` N vRNICs one after another, then hold each with a
//! process of its own that opens it and makes a PD, a CQ and an RC QP (`bench/holdqp.c` under
//! `vrnic run --vrnic sI`, all started at once, held until the bench closes their stdin).
//!
//! Per vRNIC: the create time; the attach + PD + CQ + QP time (from the first holder's start
//! to the last one's "ready", over N); the daemon's memory (its `VmRSS` grown) and the
//! regions' memory (the pages allocated to the files under the state dir, the vRNICs' quota
//! tmpfs mounts included). And how many vRNICs `vrnic ls` shows holding their QP, beside the
//! N made (the only figure here with a reference: none of the others has a physical limit to
//! measure).
//!
//! Each run has a fresh daemon (`--max-vrnics` at least N), so each starts from no vRNIC.

use std::collections::HashSet;
use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};

use super::Ctx;
use super::procs::{Daemon, Hold, Proc};
use super::report::{Better, Limit, Report};

/// The figures' names for `n` vRNICs.
fn create_name(n: u32) -> String {
    format!("{n} vRNICs: vrnic create, each")
}

fn attach_name(n: u32) -> String {
    format!("{n} vRNICs: attach + PD + CQ + QP, each (all at once)")
}

fn rss_name(n: u32) -> String {
    format!("{n} vRNICs: daemon memory (RSS), each")
}

fn region_name(n: u32) -> String {
    format!("{n} vRNICs: region pages, each")
}

pub fn held_name(n: u32) -> String {
    format!("{n} vRNICs: holding a QP (vrnic ls)")
}

/// What one run measured.
struct Measured {
    create_ms: f64,
    attach_ms: f64,
    rss_kib: f64,
    region_kib: f64,
    held: u32,
}

/// One run of `n` vRNICs into `report`.
pub fn measure(ctx: &Ctx, n: u32, report: &mut Report) {
    match run(ctx, n) {
        Ok(m) => {
            let nf = f64::from(n);
            for (name, unit, v) in [
                (create_name(n), "ms", m.create_ms / nf),
                (attach_name(n), "ms", m.attach_ms / nf),
                (rss_name(n), "KiB", m.rss_kib / nf),
                (region_name(n), "KiB", m.region_kib / nf),
            ] {
                report
                    .sample("vnics", &name, None, unit, Better::Lower, v)
                    .shown = true;
            }
            report
                .sample(
                    "vnics",
                    &held_name(n),
                    None,
                    "vRNICs",
                    Better::Higher,
                    f64::from(m.held),
                )
                .shown = true;
        }
        Err(e) => report.error(&format!("{n} vRNICs"), e),
    }
}

fn run(ctx: &Ctx, n: u32) -> Result<Measured> {
    let extra = ["--max-vrnics".to_string(), (n + 16).max(4096).to_string()];
    let d = ctx.daemon(&extra)?;
    let pid = d.pid().context("the daemon is not running")?;
    let (rss0, region0) = (rss_kib(pid)?, allocated_kib(&d.dir));
    let names: Vec<String> = (1..=n).map(|i| format!("s{i}")).collect();

    let t0 = Instant::now();
    for name in &names {
        let cmd = d.cli(&["create", name]);
        ctx.scratch
            .output(cmd, "vrnic create", Duration::from_secs(30))
            .with_context(|| format!("vrnic create {name}"))?;
    }
    let create = t0.elapsed();

    let mut hold = Hold::new()?;
    let prog = ctx.tools.holdqp.display().to_string();
    let t1 = Instant::now();
    let mut holders = Vec::new();
    for name in &names {
        let cmd = d.run_on(name, ctx.apps(), std::slice::from_ref(&prog));
        holders.push(
            ctx.scratch
                .spawn_held(cmd, &format!("holdqp {name}"), &hold)?,
        );
    }
    let limit = Duration::from_secs(120) + Duration::from_millis(100) * n;
    wait_ready(&mut holders, limit)?;
    let attach = t1.elapsed();

    let (rss1, region1) = (rss_kib(pid)?, allocated_kib(&d.dir));
    let ours: HashSet<&str> = names.iter().map(String::as_str).collect();
    let held = qps(ctx, &d)?
        .iter()
        .filter(|(name, q)| ours.contains(name.as_str()) && *q == 1)
        .count();

    hold.release();
    for (h, name) in holders.into_iter().zip(&names) {
        h.finish(Duration::from_secs(60))
            .check(&format!("holdqp on {name}"))?;
    }
    Ok(Measured {
        create_ms: create.as_secs_f64() * 1e3,
        attach_ms: attach.as_secs_f64() * 1e3,
        rss_kib: rss1 as f64 - rss0 as f64,
        region_kib: region1 as f64 - region0 as f64,
        held: u32::try_from(held).expect("at most n vRNICs are counted"),
    })
}

/// Waits (at most `limit`) until every holder printed "ready"; an error with the output of
/// the first one that exits before it.
pub fn wait_ready(holders: &mut Vec<Proc>, limit: Duration) -> Result<()> {
    let start = Instant::now();
    let mut ready = vec![false; holders.len()];
    while ready.iter().any(|r| !r) {
        for i in 0..holders.len() {
            if ready[i] {
                continue;
            }
            if holders[i].printed("ready") {
                ready[i] = true;
            } else if holders[i].exited() {
                let h = holders.swap_remove(i);
                let name = h.name.clone();
                bail!(
                    "{name} exited before it was ready\n{}",
                    h.finish(Duration::ZERO).tail()
                );
            }
        }
        if start.elapsed() > limit {
            let late = ready.iter().filter(|r| !**r).count();
            bail!("{late} of {} holders not ready in {limit:?}", holders.len());
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    Ok(())
}

/// Each vRNIC `vrnic ls` lists, with its QP count.
pub fn qps(ctx: &Ctx, d: &Daemon) -> Result<Vec<(String, u32)>> {
    let out = ctx
        .scratch
        .output(d.cli(&["ls"]), "vrnic ls", Duration::from_secs(30))?;
    parse_ls(&out)
}

/// `vrnic ls`'s lines (NAME LID GID QPS USERS IP GROUP, after a header) as names and QP counts.
fn parse_ls(out: &str) -> Result<Vec<(String, u32)>> {
    out.lines()
        .skip(1)
        .map(|l| {
            let cols: Vec<&str> = l.split_whitespace().collect();
            match (cols.first(), cols.get(3).and_then(|q| q.parse().ok())) {
                (Some(name), Some(q)) => Ok((name.to_string(), q)),
                _ => bail!("vrnic ls: unexpected line {l:?}"),
            }
        })
        .collect()
}

/// The resident memory of process `pid` in KiB (`VmRSS` in `/proc/PID/status`).
fn rss_kib(pid: i32) -> Result<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))
        .with_context(|| format!("read /proc/{pid}/status"))?;
    status
        .lines()
        .find_map(|l| {
            l.strip_prefix("VmRSS:")?
                .split_whitespace()
                .next()?
                .parse()
                .ok()
        })
        .context("no VmRSS in /proc/PID/status")
}

/// The KiB allocated to the files under `dir` (their blocks, not their sparse sizes), mounts
/// below it included; links are not followed, and what vanishes during the walk counts 0.
fn allocated_kib(dir: &Path) -> u64 {
    use std::os::unix::fs::MetadataExt;
    let Ok(entries) = std::fs::read_dir(dir) else {
        return 0;
    };
    entries
        .flatten()
        .map(|e| match e.path().symlink_metadata() {
            Ok(m) if m.is_dir() => allocated_kib(&e.path()),
            Ok(m) if m.is_file() => m.blocks() / 2,
            _ => 0,
        })
        .sum()
}

/// Sets the held count's reference: the `n` vRNICs made.
pub fn set_limits(report: &mut Report, n: u32) {
    let l = Limit {
        what: "vRNICs made".into(),
        value: f64::from(n),
        measured: true,
    };
    report.limit("vnics", &held_name(n), None, l);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ls_gives_each_vrnic_its_qp_count() {
        let out = "NAME                LID GID                                       QPS USERS  IP              GROUP\n\
                   s1                    1 fe80:0000:0000:0000:0000:0000:0000:0001    1     1  10.0.0.1        default\n\
                   idle-qps              2 fe80:0000:0000:0000:0000:0000:0000:0002 1000     1  10.0.0.2        default\n";
        let list = parse_ls(out).unwrap();
        assert_eq!(
            list,
            [("s1".to_string(), 1), ("idle-qps".to_string(), 1000)]
        );
        assert!(parse_ls("NAME\ns1 1\n").is_err());
    }

    #[test]
    fn allocated_counts_blocks_not_sparse_sizes() {
        let dir = std::env::temp_dir().join(format!("vrnic-bench-alloc-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(dir.join("sub")).unwrap();
        let sparse = std::fs::File::create(dir.join("sparse")).unwrap();
        sparse.set_len(1 << 30).unwrap();
        std::fs::write(dir.join("sub/full"), vec![1u8; 1 << 20]).unwrap();
        let kib = allocated_kib(&dir);
        std::fs::remove_dir_all(&dir).unwrap();
        // The 1 MiB written (rounded up to blocks), not the 1 GiB hole.
        assert!((1024..2048).contains(&kib), "{kib} KiB");
    }
}
