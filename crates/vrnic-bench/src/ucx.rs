//! The path the stacks take: UCX's `ucx_perftest` (unmodified, from `ucx-utils`) over vrnic
//! (`UCX_TLS=rc_verbs,ud_verbs,self` under `vrnic run`: its tag lane is `rc_verbs`, `ud_verbs`
//! only its wire-up) against UCX's own transports on the same cores in the same run: shared
//! memory (`sm,self`), the limit, and TCP (`tcp,self`), a reference. `tag_lat` at 8 B (half a
//! round trip, as UCX reports it) and `tag_bw` at 1 MiB.
//!
//! Pinned (`--pin`), the server runs on the first app core and the client on the second; with
//! one app core the two processes share it, and UCX's shared memory, which spins without
//! yielding, then measures the scheduler's time slice rather than a transport.

use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{Result, bail};

use super::Ctx;
use super::procs::{Daemon, Launch, Stop, port, wait_listening};
use super::report::{Better, Limit, Report};

/// The transports, as `UCX_TLS` names them, and how the table names each.
const VRNIC: (&str, &str) = ("rc_verbs,ud_verbs,self", "UCX over vrnic (rc_verbs)");
const SM: (&str, &str) = ("sm,self", "UCX shared memory (sm)");
const TCP: (&str, &str) = ("tcp,self", "UCX TCP (tcp)");

/// The two tests: `ucx_perftest -t`, message size, the figure's unit and direction.
const LAT: (&str, u64) = ("tag_lat", 8);
const BW: (&str, u64) = ("tag_bw", 1 << 20);

/// The section's figures are named `"<test> <size>, <transport>"`.
fn name(test: &str, transport: &str) -> String {
    format!("{test}, {transport}")
}

/// An error unless `ucx_perftest` is installed.
pub fn require() -> Result<()> {
    super::tools::require(&["ucx_perftest"])
}

/// One run of every UCX figure into `report`.
pub fn measure(ctx: &Ctx, d: &Daemon, report: &mut Report) {
    let iters = |test| match (test, ctx.quick) {
        ("tag_lat", true) => "20000",
        ("tag_lat", false) => "100000",
        (_, true) => "500",
        _ => "2000",
    };
    for (test, size) in [LAT, BW] {
        for (tls, label) in [VRNIC, SM, TCP] {
            let args: Vec<String> = ["-t", test, "-s", &size.to_string(), "-n", iters(test)]
                .map(String::from)
                .to_vec();
            let on_vrnic = tls == VRNIC.0;
            match pair(ctx, on_vrnic.then_some(d), tls, &args) {
                Ok(f) => {
                    let (unit, better, v) = if test == LAT.0 {
                        ("us", Better::Lower, f.latency_us)
                    } else {
                        ("MB/s", Better::Higher, f.bandwidth_mb)
                    };
                    report
                        .sample("ucx", &name(test, label), Some(size), unit, better, v)
                        .shown = true;
                }
                Err(e) => report.error(&format!("ucx_perftest {test} over {tls}"), e),
            }
        }
    }
}

/// What `ucx_perftest`'s "Final:" line says: overall latency (us) and bandwidth (MB/s).
#[derive(Debug, PartialEq)]
struct Final {
    latency_us: f64,
    bandwidth_mb: f64,
}

/// Parses `Final: ITERS LAT50 LAT_AVG LAT_OVERALL BW_AVG BW_OVERALL RATE_AVG RATE_OVERALL`.
fn parse_final(out: &str) -> Option<Final> {
    let line = out
        .lines()
        .rev()
        .find(|l| l.trim_start().starts_with("Final:"))?;
    let v: Vec<f64> = line
        .split_whitespace()
        .skip(1)
        .map(str::parse)
        .collect::<Result<_, _>>()
        .ok()?;
    (v.len() >= 8).then(|| Final {
        latency_us: v[3],
        bandwidth_mb: v[5],
    })
}

/// `env UCX_TLS=tls ucx_perftest ARGS`, under `vrnic run` on `d` or as a plain process.
fn command(ctx: &Ctx, d: Option<&Daemon>, side: usize, tls: &str, args: &[String]) -> Command {
    let mut argv = vec![
        "env".to_string(),
        format!("UCX_TLS={tls}"),
        "ucx_perftest".to_string(),
    ];
    argv.extend(args.iter().cloned());
    match d {
        Some(d) => d.run(ctx.app(side), &argv),
        None => {
            let mut c = Launch::default().on(ctx.app(side)).command(&argv[0]);
            c.args(&argv[1..]);
            c
        }
    }
}

/// A server and its client (`ucx_perftest -p PORT` and `ucx_perftest HOST -p PORT ARGS`).
fn pair(ctx: &Ctx, d: Option<&Daemon>, tls: &str, args: &[String]) -> Result<Final> {
    let limit = Duration::from_secs(120);
    let start = Instant::now();
    let p = port()?;
    let pa = ["-p".to_string(), p.to_string()];
    let mut srv = ctx.scratch.spawn(
        command(ctx, d, 0, tls, &pa),
        "ucx_perftest server",
        Stop::Kill,
    )?;
    wait_listening(&mut srv, p, Duration::from_secs(30))?;
    let mut cargs = vec!["127.0.0.1".to_string()];
    cargs.extend(pa);
    cargs.extend(args.iter().cloned());
    let c = ctx.scratch.spawn(
        command(ctx, d, 1, tls, &cargs),
        "ucx_perftest client",
        Stop::Kill,
    )?;
    let f = c.finish(limit.saturating_sub(start.elapsed()));
    f.check("ucx_perftest client")?;
    let _ = srv.finish(Duration::from_secs(10));
    match parse_final(&f.stdout) {
        Some(r) => Ok(r),
        None => bail!(
            "UCX_TLS={tls}: ucx_perftest printed no Final line:\n{}",
            f.tail()
        ),
    }
}

/// Sets the limits: UCX's shared memory for every row, UCX's TCP beside it as a reference.
pub fn set_limits(report: &mut Report) {
    for (test, size) in [LAT, BW] {
        let Some(sm) = report.median("ucx", &name(test, SM.1), Some(size)) else {
            continue;
        };
        for label in [VRNIC.1, TCP.1] {
            let l = Limit {
                what: "UCX shared memory".into(),
                value: sm,
                measured: true,
            };
            report.limit("ucx", &name(test, label), Some(size), l);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_final_line_gives_overall_latency_and_bandwidth() {
        let out = "+---+\n[thread 0] 1 2 3\nFinal:                 50000      2.560     2.770     2.790        2.75       2.74      361053      361053\n";
        assert_eq!(
            parse_final(out),
            Some(Final {
                latency_us: 2.79,
                bandwidth_mb: 2.74
            })
        );
        assert_eq!(parse_final("Final: 1 2"), None);
        assert_eq!(parse_final("no result"), None);
    }
}
