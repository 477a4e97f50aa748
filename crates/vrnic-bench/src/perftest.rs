//! Unmodified perftest (and `ibv_rc_pingpong`) through vrnic: a server and a client, each
//! under `vrnic run` on a vRNIC of its own, and their figures against the limits.
//!
//! - Bandwidth sweeps, 2 B to 8 MiB (`-a`): `ib_write_bw`, `ib_read_bw`, `ib_send_bw`; each
//!   size against memcpy of that size (the engine makes one copy per byte).
//! - Message rate: `ib_write_bw -s 2` for a fixed time, against a shared-memory ring of 64 B
//!   slots between two processes (what an app and an engine exchange per work request).
//! - Latency sweeps (`-a`): `ib_write_lat`, `ib_send_lat` (typical one-way: half a ping-pong),
//!   `ib_read_lat`, and `ib_atomic_lat` (a round trip each; 8 B). With `--quick` only
//!   `ib_write_lat` sweeps, the others measure 2 B. The limit is the cache-line floor
//!   (half the cross-process cache-line round trip for one-way figures, all of it for round
//!   trips) plus one copy of the message at memcpy speed.
//! - Outside `--quick`, `ibv_rc_pingpong` 1 B: the round trip of the first benchmark.
//!
//! perftest reports bandwidth in MiB/s ("MB/sec", 2^20 bytes); the bench converts it to MB/s
//! (1e6 bytes), the unit of its memcpy limit.

use std::time::{Duration, Instant};

use anyhow::{Result, bail};

use super::limits::{self, MEMCPY, RTT};
use super::procs::{Daemon, Proc, Stop, port, wait_listening};
use super::report::{Better, Limit, Report, size_text};
use super::{Ctx, tools};

/// perftest's MB (2^20 bytes) in MB (1e6 bytes).
pub const MIB_PER_MB: f64 = 1.048576;

pub const BW_PROGRAMS: [&str; 3] = ["ib_write_bw", "ib_read_bw", "ib_send_bw"];
/// Latency programs that report half a ping-pong (one-way).
pub const ONE_WAY: [&str; 2] = ["ib_write_lat", "ib_send_lat"];
/// Latency programs that report a round trip.
pub const ROUND_TRIP: [&str; 2] = ["ib_read_lat", "ib_atomic_lat"];
/// The message-rate figure's name.
pub const RATE: &str = "ib_write_bw -s 2 message rate";
/// The `ibv_rc_pingpong` figure's name.
pub const PINGPONG: &str = "ibv_rc_pingpong round trip";

/// The sizes the table shows of each sweep (the JSON and the plots have all).
const SHOWN_BW: [u64; 4] = [2, 65536, 1 << 20, 8 << 20];
const SHOWN_LAT: [u64; 3] = [2, 4096, 65536];

/// Every perftest program the bench runs (checked before it starts).
pub const PROGRAMS: [&str; 8] = [
    "ib_write_bw",
    "ib_read_bw",
    "ib_send_bw",
    "ib_write_lat",
    "ib_send_lat",
    "ib_read_lat",
    "ib_atomic_lat",
    "ibv_rc_pingpong",
];

/// One side of a pair: its daemon, its cores, and its vRNIC (`None`: a fresh one for the
/// app, as `vrnic run` makes).
pub struct Side<'a> {
    pub daemon: &'a Daemon,
    pub cpus: Option<String>,
    pub vnic: Option<&'a str>,
}

impl Side<'_> {
    /// `args` under `vrnic run` on this side.
    fn run(&self, args: &[String]) -> std::process::Command {
        match self.vnic {
            Some(name) => self.daemon.run_on(name, self.cpus.clone(), args),
            None => self.daemon.run(self.cpus.clone(), args),
        }
    }
}

/// What perftest prints when its own clock calibration fails: it times `usleep` steps against
/// the cycle counter and gives up when they do not fit a line (r^2 < 0.9), which a busy
/// 2-core machine causes by running the sampler late. Nothing was measured wrong, so the
/// pair is run again.
const CLOCK_CALIBRATION_FAILED: &str = "Correlation coefficient r^2";

/// How many times a pair is run when perftest's clock calibration fails.
const CALIBRATION_TRIES: u32 = 3;

/// Runs `args -p PORT` under `vrnic run` as a server, waits until it listens, then `args -p
/// PORT HOST` as its client (retried while it only could not connect yet), everything within
/// `limit`; returns the client's output. A pair whose perftest could not calibrate its clock
/// is run again, up to [`CALIBRATION_TRIES`] times in all.
pub fn pair(
    ctx: &Ctx,
    server: Side,
    client: Side,
    host: &str,
    args: &[String],
    limit: Duration,
) -> Result<String> {
    let start = Instant::now();
    calibrated(&args[0], || {
        let left = limit.saturating_sub(start.elapsed());
        pair_once(ctx, &server, &client, host, args, left)
    })
}

/// Runs `run` again while it fails only because perftest could not calibrate its clock, up to
/// [`CALIBRATION_TRIES`] times in all; `what` names it in the note of each retry.
pub(crate) fn calibrated<T>(what: &str, mut run: impl FnMut() -> Result<T>) -> Result<T> {
    let mut tries = 1;
    loop {
        match run() {
            Err(e)
                if tries < CALIBRATION_TRIES
                    && format!("{e:#}").contains(CLOCK_CALIBRATION_FAILED) =>
            {
                eprintln!(
                    "vrnic bench: {what}: perftest's clock calibration failed (try {tries}); again"
                );
                tries += 1;
            }
            r => return r,
        }
    }
}

fn pair_once(
    ctx: &Ctx,
    server: &Side,
    client: &Side,
    host: &str,
    args: &[String],
    limit: Duration,
) -> Result<String> {
    let start = Instant::now();
    let p = port()?;
    let mut sargs = args.to_vec();
    sargs.extend(["-p".into(), p.to_string()]);
    let mut cargs = sargs.clone();
    cargs.push(host.into());
    let name = &args[0];
    let mut srv = ctx
        .scratch
        .spawn(server.run(&sargs), &format!("{name} server"), Stop::Kill)?;
    wait_listening(&mut srv, p, Duration::from_secs(30))?;
    let out = loop {
        let left = limit.saturating_sub(start.elapsed());
        let c = ctx
            .scratch
            .spawn(client.run(&cargs), &format!("{name} client"), Stop::Kill)?;
        let f = c.finish(left);
        let refused = !f.ok()
            && !f.timed_out
            && (f.stderr.contains("Couldn't connect") || f.stdout.contains("Couldn't connect"));
        if refused && start.elapsed() < Duration::from_secs(10) && !srv.exited() {
            std::thread::sleep(Duration::from_millis(100));
            continue;
        }
        if let Err(e) = f.check(&format!("{name} client")) {
            let s = srv.finish(Duration::from_secs(2));
            bail!("{e:#}\n  server:\n{}", s.tail());
        }
        break f.stdout;
    };
    let s = srv.finish(Duration::from_secs(10));
    s.check(&format!("{name} server"))?;
    Ok(out)
}

/// perftest's result rows: lines whose first field is a whole number, as numbers.
/// `n` pairs of the perftest command `args(port)` make on the app cores, each on a port of its
/// own: every server listening first, then every client (line-buffered by `stdbuf -oL`, so
/// its result header shows when it is printed). Returns the servers and the clients, named
/// `what` in errors; dropping them kills them.
pub fn start_pairs(
    ctx: &Ctx,
    d: &Daemon,
    n: u32,
    args: impl Fn(u16) -> Vec<String>,
    what: &str,
) -> Result<(Vec<Proc>, Vec<Proc>)> {
    let mut servers: Vec<(Proc, u16)> = Vec::new();
    for _ in 0..n {
        let p = port()?;
        let cmd = d.run(ctx.apps(), &args(p));
        let s = ctx
            .scratch
            .spawn(cmd, &format!("{what} server"), Stop::Kill)?;
        servers.push((s, p));
    }
    for (s, p) in &mut servers {
        wait_listening(s, *p, Duration::from_secs(120))?;
    }
    let mut clients = Vec::new();
    for (_, p) in &servers {
        let mut a = vec!["stdbuf".to_string(), "-oL".to_string()];
        a.extend(args(*p));
        a.push("localhost".into());
        let cmd = d.run(ctx.apps(), &a);
        clients.push(
            ctx.scratch
                .spawn(cmd, &format!("{what} client"), Stop::Kill)?,
        );
    }
    Ok((servers.into_iter().map(|(s, _)| s).collect(), clients))
}

pub fn rows(out: &str) -> Vec<Vec<f64>> {
    out.lines()
        .filter(|l| {
            l.split_whitespace()
                .next()
                .is_some_and(|w| w.chars().all(|c| c.is_ascii_digit()))
        })
        .map(|l| {
            l.split_whitespace()
                .filter_map(|w| w.parse().ok())
                .collect()
        })
        .filter(|r: &Vec<f64>| r.len() >= 5)
        .collect()
}

/// One run of every program into `report`; the server on vRNIC `vnics[0]` and the client on
/// `vnics[1]` if given (made beforehand, e.g. with QoS limits), else each on a fresh one.
pub fn measure(ctx: &Ctx, d: &Daemon, vnics: Option<&[String; 2]>, report: &mut Report) {
    let limit = Duration::from_secs(if ctx.quick { 120 } else { 300 });
    let side = |i: usize| Side {
        daemon: d,
        cpus: ctx.app(i),
        vnic: vnics.map(|v| v[i].as_str()),
    };
    let run = |args: &[&str]| -> Result<String> {
        let args: Vec<String> = args.iter().map(|s| s.to_string()).collect();
        pair(ctx, side(0), side(1), "localhost", &args, limit)
    };
    let bw_iters = if ctx.quick { "200" } else { "5000" };
    for prog in BW_PROGRAMS {
        match run(&[prog, "-a", "-n", bw_iters]) {
            Ok(out) => {
                for r in rows(&out) {
                    let size = r[0] as u64;
                    report
                        .sample(
                            "bandwidth",
                            prog,
                            Some(size),
                            "MB/s",
                            Better::Higher,
                            r[3] * MIB_PER_MB,
                        )
                        .shown = SHOWN_BW.contains(&size);
                }
            }
            Err(e) => report.error(&format!("{prog} -a"), e),
        }
    }
    let secs = if ctx.quick { "1" } else { "2" };
    match run(&["ib_write_bw", "-s", "2", "-D", secs]) {
        Ok(out) => match rows(&out).last() {
            Some(r) => {
                report
                    .sample("rate", RATE, None, "Mpps", Better::Higher, r[4])
                    .shown = true;
            }
            None => report.error(RATE, anyhow::anyhow!("no result row:\n{out}")),
        },
        Err(e) => report.error(RATE, e),
    }
    // With --quick only ib_write_lat sweeps the sizes (on two busy cores a sweep takes 10-20 s:
    // the apps and the engine spin on them, and a stall is a scheduler tick); the others
    // measure 2 B.
    let lat_iters = if ctx.quick { "200" } else { "1000" };
    for prog in ONE_WAY.iter().chain(&ROUND_TRIP) {
        let args: &[&str] = match *prog {
            "ib_atomic_lat" => &[prog, "-n", lat_iters],
            "ib_write_lat" if ctx.quick => &[prog, "-a", "-n", "100"],
            _ if ctx.quick => &[prog, "-s", "2", "-n", lat_iters],
            _ => &[prog, "-a", "-n", lat_iters],
        };
        match run(args) {
            Ok(out) => {
                for r in rows(&out) {
                    let size = r[0] as u64;
                    report
                        .sample("latency", prog, Some(size), "us", Better::Lower, r[4])
                        .shown = SHOWN_LAT.contains(&size) || *prog == "ib_atomic_lat";
                }
            }
            Err(e) => report.error(&format!("{prog} -a"), e),
        }
    }
    if !ctx.quick {
        match run(&["ibv_rc_pingpong", "-s", "1", "-n", "20000"]) {
            Ok(out) => match usec_per_iter(&out) {
                Some(us) => {
                    report
                        .sample("latency", PINGPONG, Some(1), "us", Better::Lower, us)
                        .shown = true;
                }
                None => report.error(PINGPONG, anyhow::anyhow!("no 'iters in' line:\n{out}")),
            },
            Err(e) => report.error(PINGPONG, e),
        }
    }
}

/// `ibv_rc_pingpong`'s time per iteration (one round trip), from its line "20000 iters in 0.05
/// seconds = 2.6 usec/iter".
pub fn usec_per_iter(out: &str) -> Option<f64> {
    out.lines()
        .find(|l| l.contains("iters in"))
        .and_then(|l| l.split_whitespace().rev().nth(1)?.parse().ok())
}

/// Sets the limits of every figure `measure` made, from the limits in `report`.
pub fn set_limits(report: &mut Report) {
    let sizes: Vec<u64> = report
        .figures
        .iter()
        .filter(|f| matches!(f.section, "bandwidth" | "latency"))
        .filter_map(|f| f.size)
        .collect();
    let rtt_ns = report.median("limits", RTT, None);
    for size in sizes {
        let mc = report.median("limits", MEMCPY, Some(size));
        if let Some(mc) = mc {
            for prog in BW_PROGRAMS {
                let what = format!("memcpy {}", size_text(size));
                report.limit("bandwidth", prog, Some(size), measured(what, mc));
            }
        }
        let Some(rtt_ns) = rtt_ns else { continue };
        // One copy of the message at memcpy speed (1 MB/s is 1 byte/us).
        let copy_us = mc.map_or(0.0, |mc| size as f64 / mc);
        for (progs, share, floor) in [
            (&ONE_WAY[..], 0.5, "half cache-line RTT"),
            (&ROUND_TRIP[..], 1.0, "cache-line RTT"),
            (&[PINGPONG][..], 1.0, "cache-line RTT"),
        ] {
            let what = if size > 64 {
                format!("{floor} + copy")
            } else {
                floor.to_string()
            };
            for prog in progs {
                let v = rtt_ns * share / 1000.0 + copy_us;
                report.limit("latency", prog, Some(size), measured(what.clone(), v));
            }
        }
    }
    if let Some(ring) = report.median("limits", &limits::ring_name(64), None) {
        report.limit(
            "rate",
            RATE,
            None,
            measured("ring, 64 B slots".into(), ring),
        );
    }
}

fn measured(what: String, value: f64) -> Limit {
    Limit {
        what,
        value,
        measured: true,
    }
}

/// An error unless perftest and `ibv_rc_pingpong` are installed.
pub fn require() -> Result<()> {
    tools::require(&PROGRAMS)
}
