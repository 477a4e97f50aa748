//! Fairness between vRNICs: the round trip of an unrelated pair of unmodified `ibv_rc_pingpong
//! -s 64 -n 5000` (busy polling; server and client each on a vRNIC of its own) on an idle
//! daemon; then while another vRNIC holds IDLE_QPS QPs that never post (`bench/holdqp.c`); then
//! while FLOOD_PAIRS pairs of unmodified `ib_read_bw -e -q 16 -s 1048576` (event mode: the
//! flooders sleep, the engine works) flood on vRNICs of their own.
//!
//! The reference of the last two is the idle round trip measured in the same run: each is
//! shown as a multiple of it (the issue's target: within 2x). The idle QPs are counted in
//! `vrnic ls` before the round trip is measured. The flood is measured once every flooding
//! client has printed perftest's result header (it is connected and about to send; its output
//! is line-buffered by `stdbuf -oL`), and counts only if every one still runs after it.

use std::time::{Duration, Instant};

use anyhow::{Result, bail};

use super::Ctx;
use super::perftest::{Side, pair, start_pairs, usec_per_iter};
use super::procs::{Daemon, Hold, Proc};
use super::report::{Better, Limit, Report, num};
use super::vnics;

/// The idle round trip's figure name (the reference).
pub const IDLE: &str = "ibv_rc_pingpong 64 B round trip, idle daemon";

/// The vRNIC holding the idle QPs.
const IDLE_VNIC: &str = "idle-qps";

/// The round trip's figure name beside `n` idle QPs.
pub fn idle_qps_name(n: u32) -> String {
    format!("ibv_rc_pingpong 64 B round trip, {n} idle QPs on another vRNIC")
}

/// The round trip's figure name beside `p` flooding pairs.
pub fn flood_name(p: u32) -> String {
    let s = if p == 1 { "" } else { "s" };
    format!("ibv_rc_pingpong 64 B round trip, {p} ib_read_bw -e -q 16 1 MiB pair{s} flooding")
}

/// The flood's rate alone (the reference of the next).
pub fn flood_alone_name(p: u32) -> String {
    let s = if p == 1 { "" } else { "s" };
    format!("{p} ib_read_bw -e -q 16 1 MiB pair{s} flooding: READ bytes moved, alone")
}

/// The flood's rate while an unrelated ping-pong runs: what its short turns cost it.
pub fn flood_beside_name(p: u32) -> String {
    let s = if p == 1 { "" } else { "s" };
    format!("{p} ib_read_bw -e -q 16 1 MiB pair{s} flooding: READ bytes moved, beside a ping-pong")
}

/// The count of idle QPs `vrnic ls` showed (in the JSON, not the table).
pub fn held_name(n: u32) -> String {
    format!("{n} idle QPs on another vRNIC: QPs held (vrnic ls)")
}

/// One run of the three round trips into `report`.
pub fn measure(ctx: &Ctx, d: &Daemon, idle_qps: u32, pairs: u32, report: &mut Report) {
    let idle = round_trip(ctx, d);
    sample(report, IDLE, idle);
    let mut held = 0;
    let beside = beside_idle_qps(ctx, d, idle_qps, &mut held);
    if held > 0 {
        report.sample(
            "fairness",
            &held_name(idle_qps),
            None,
            "QPs",
            Better::Higher,
            f64::from(held),
        );
    }
    sample(report, &idle_qps_name(idle_qps), beside);
    match beside_flood(ctx, d, pairs) {
        Ok(f) => {
            sample(report, &flood_name(pairs), Ok(f.us));
            rate(report, &flood_alone_name(pairs), f.alone);
            rate(report, &flood_beside_name(pairs), f.beside);
        }
        Err(e) => sample(report, &flood_name(pairs), Err(e)),
    }
}

/// A rate of the flood into `report` (shown), or its error.
fn rate(report: &mut Report, name: &str, r: Result<f64>) {
    shown(report, name, ("MB/s", Better::Higher), r);
}

/// A round trip into `report` (shown), or its error.
fn sample(report: &mut Report, name: &str, r: Result<f64>) {
    shown(report, name, ("us", Better::Lower), r);
}

/// A figure of the section into `report`, in `unit`, shown in the table; or its error.
fn shown(report: &mut Report, name: &str, (unit, better): (&'static str, Better), r: Result<f64>) {
    match r {
        Ok(v) => report.sample("fairness", name, None, unit, better, v).shown = true,
        Err(e) => report.error(&format!("fairness: {name}"), e),
    }
}

/// The unrelated pair's round trip (us per iteration).
fn round_trip(ctx: &Ctx, d: &Daemon) -> Result<f64> {
    let args: Vec<String> = ["ibv_rc_pingpong", "-s", "64", "-n", "5000"]
        .map(String::from)
        .to_vec();
    let side = |i| Side {
        daemon: d,
        cpus: ctx.app(i),
        vnic: None,
    };
    let out = pair(
        ctx,
        side(0),
        side(1),
        "localhost",
        &args,
        Duration::from_secs(120),
    )?;
    match usec_per_iter(&out) {
        Some(us) => Ok(us),
        None => bail!("ibv_rc_pingpong printed no 'iters in' line:\n{out}"),
    }
}

/// The round trip while another vRNIC holds `n` idle QPs (counted into `held` from `vrnic
/// ls` first).
fn beside_idle_qps(ctx: &Ctx, d: &Daemon, n: u32, held: &mut u32) -> Result<f64> {
    let mut hold = Hold::new()?;
    let args = [ctx.tools.holdqp.display().to_string(), n.to_string()];
    let cmd = d.run_on(IDLE_VNIC, ctx.apps(), &args);
    let mut holders = vec![ctx.scratch.spawn_held(cmd, "holdqp idle QPs", &hold)?];
    vnics::wait_ready(&mut holders, Duration::from_secs(300))?;
    *held = vnics::qps(ctx, d)?
        .into_iter()
        .find(|(name, _)| name == IDLE_VNIC)
        .map_or(0, |(_, q)| q);
    if *held != n {
        bail!("vrnic ls shows {held} QPs on the holder's vRNIC, not {n}");
    }
    let us = round_trip(ctx, d)?;
    hold.release();
    for h in holders {
        h.finish(Duration::from_secs(60)).check("holdqp")?;
    }
    Ok(us)
}

/// The round trip while `pairs` pairs of `ib_read_bw -e -q 16 -s 1048576` flood, and the
/// flood's rate before it (alone) and after it (beside a ping-pong like the measured one).
fn beside_flood(ctx: &Ctx, d: &Daemon, pairs: u32) -> Result<Flooded> {
    // Far more than the measurement lasts: the flooders are killed after it.
    let args = |p: u16| -> Vec<String> {
        [
            "ib_read_bw",
            "-e",
            "-q",
            "16",
            "-s",
            "1048576",
            "-n",
            "1000000",
            "-p",
            &p.to_string(),
        ]
        .map(String::from)
        .to_vec()
    };
    let (_servers, mut clients) = start_pairs(ctx, d, pairs, args, "flood")?;
    wait_flooding(&mut clients, Duration::from_secs(120))?;
    let alone = flood_rate(ctx, d);
    let us = round_trip(ctx, d)?;
    let beside = light_pair(ctx, d).and_then(|_light| flood_rate(ctx, d));
    for (i, c) in clients.iter_mut().enumerate() {
        if c.exited() {
            bail!("flooding client {i} ended before the round trip was measured");
        }
    }
    Ok(Flooded { us, alone, beside })
}

/// A round trip beside the flood, and the flood's own rate alone and beside a ping-pong.
struct Flooded {
    us: f64,
    alone: Result<f64>,
    beside: Result<f64>,
}

/// How long the flood's rate is counted.
const RATE_WINDOW: Duration = Duration::from_secs(1);

/// The bytes READs moved on the daemon's vRNICs per second (MB/s) over [`RATE_WINDOW`]: the
/// daemon's exact counters (`vrnic stats`, READs served as responder) before and after it.
fn flood_rate(ctx: &Ctx, d: &Daemon) -> Result<f64> {
    let before = read_bytes(ctx, d)?;
    let start = Instant::now();
    std::thread::sleep(RATE_WINDOW);
    let after = read_bytes(ctx, d)?;
    let secs = start.elapsed().as_secs_f64();
    Ok(after.saturating_sub(before) as f64 / secs / 1e6)
}

/// The bytes of READs served on every vRNIC of `d`, from `vrnic stats --json`.
fn read_bytes(ctx: &Ctx, d: &Daemon) -> Result<u64> {
    let out = ctx.scratch.output(
        d.cli(&["stats", "--json"]),
        "vrnic stats",
        Duration::from_secs(30),
    )?;
    served_read_bytes(&out)
}

/// The sum of `received.read.bytes` over the vRNICs of `vrnic stats --json`'s output.
fn served_read_bytes(json: &str) -> Result<u64> {
    let v: serde_json::Value = serde_json::from_str(json)?;
    let Some(vnics) = v.as_array() else {
        bail!("vrnic stats --json: not an array");
    };
    vnics
        .iter()
        .map(|s| {
            s.pointer("/received/read/bytes")
                .and_then(serde_json::Value::as_u64)
                .ok_or_else(|| anyhow::anyhow!("vrnic stats --json: no received.read.bytes"))
        })
        .sum()
}

/// An unrelated ping-pong that runs until dropped (the light tenant beside the flood while
/// its rate is counted), once its client has exchanged addresses with its server.
fn light_pair(ctx: &Ctx, d: &Daemon) -> Result<(Vec<Proc>, Vec<Proc>)> {
    let args = |p: u16| -> Vec<String> {
        [
            "ibv_rc_pingpong",
            "-s",
            "64",
            "-n",
            "1000000000",
            "-p",
            &p.to_string(),
        ]
        .map(String::from)
        .to_vec()
    };
    let (servers, mut clients) = start_pairs(ctx, d, 1, args, "light ping-pong")?;
    let start = Instant::now();
    while !clients[0].printed("remote address") {
        if clients[0].exited() {
            bail!("the light ping-pong's client exited before it began");
        }
        if start.elapsed() > Duration::from_secs(60) {
            bail!("the light ping-pong did not connect within 60 s");
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    // Its loop is under way once both sides have their addresses.
    std::thread::sleep(Duration::from_millis(50));
    Ok((servers, clients))
}

/// Waits (at most `limit`) until every flooding client printed perftest's result header; an
/// error if one exits first.
fn wait_flooding(clients: &mut [Proc], limit: Duration) -> Result<()> {
    let start = Instant::now();
    let mut started = vec![false; clients.len()];
    while started.iter().any(|s| !s) {
        for (i, c) in clients.iter_mut().enumerate() {
            if started[i] {
                continue;
            }
            if c.printed("#bytes") {
                started[i] = true;
            } else if c.exited() {
                bail!("flooding client {i} exited before it began");
            }
        }
        if start.elapsed() > limit {
            bail!("the flooding clients did not all connect within {limit:?}");
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    Ok(())
}

/// Sets the idle round trip as the reference of the other two, and notes their multiples.
pub fn set_limits(report: &mut Report, idle_qps: u32, pairs: u32) {
    let Some(idle) = report.median("fairness", IDLE, None) else {
        return;
    };
    let mut said = Vec::new();
    let s = if pairs == 1 { "" } else { "s" };
    for (name, beside) in [
        (
            idle_qps_name(idle_qps),
            format!("{idle_qps} idle QPs of another vRNIC"),
        ),
        (flood_name(pairs), format!("{pairs} flooding pair{s}")),
    ] {
        let l = Limit {
            what: "idle round trip".into(),
            value: idle,
            measured: true,
        };
        report.limit("fairness", &name, None, l);
        if let Some(r) = report.get("fairness", &name, None).and_then(|f| f.ratio) {
            said.push(format!("{}x beside {beside}", num(r)));
        }
    }
    let alone = report.median("fairness", &flood_alone_name(pairs), None);
    let mut kept = None;
    if let Some(alone) = alone {
        let l = Limit {
            what: "the flood alone".into(),
            value: alone,
            measured: true,
        };
        report.limit("fairness", &flood_beside_name(pairs), None, l);
        kept = report
            .get("fairness", &flood_beside_name(pairs), None)
            .and_then(|f| f.ratio);
    }
    if !said.is_empty() {
        let cost = kept.map_or(String::new(), |k| {
            format!(
                "; beside a ping-pong the flood keeps {:.0}% of its rate alone",
                k * 100.0
            )
        });
        report.notes.push(format!(
            "fairness: the unrelated pair's round trip is {} of its idle {} us; the issue's \
             target is within 2x{cost}",
            said.join(", "),
            num(idle)
        ));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips_stand_beside_the_idle_one() {
        let mut r = Report::default();
        for (name, us) in [
            (IDLE.to_string(), 10.0),
            (idle_qps_name(64), 11.0),
            (flood_name(2), 25.0),
        ] {
            r.sample("fairness", &name, None, "us", Better::Lower, us);
        }
        set_limits(&mut r, 64, 2);
        let ratio = |name: &str| r.get("fairness", name, None).and_then(|f| f.ratio);
        assert_eq!(ratio(IDLE), None);
        assert_eq!(ratio(&idle_qps_name(64)), Some(1.1));
        assert_eq!(ratio(&flood_name(2)), Some(2.5));
        assert_eq!(
            r.notes,
            [
                "fairness: the unrelated pair's round trip is 1.10x beside 64 idle QPs of another \
              vRNIC, 2.50x beside 2 flooding pairs of its idle 10.0 us; the issue's target is \
              within 2x"
            ]
        );
    }

    #[test]
    fn the_flood_beside_a_ping_pong_stands_beside_the_flood_alone() {
        let mut r = Report::default();
        r.sample("fairness", IDLE, None, "us", Better::Lower, 10.0);
        r.sample("fairness", &flood_name(4), None, "us", Better::Lower, 20.0);
        for (name, mbs) in [
            (flood_alone_name(4), 8000.0),
            (flood_beside_name(4), 6000.0),
        ] {
            r.sample("fairness", &name, None, "MB/s", Better::Higher, mbs);
        }
        set_limits(&mut r, 64, 4);
        let ratio = |name: &str| r.get("fairness", name, None).and_then(|f| f.ratio);
        assert_eq!(ratio(&flood_alone_name(4)), None);
        assert_eq!(ratio(&flood_beside_name(4)), Some(0.75));
        assert!(
            r.notes[0].ends_with(
                "2.00x beside 4 flooding pairs of its idle 10.0 us; the issue's target is within \
                 2x; beside a ping-pong the flood keeps 75% of its rate alone"
            ),
            "{}",
            r.notes[0]
        );
    }

    #[test]
    fn served_read_bytes_add_up_over_vrnics_and_a_missing_count_is_an_error() {
        let two = r#"[{"received":{"read":{"wrs":1,"bytes":1048576}}},
                      {"received":{"read":{"wrs":0,"bytes":0}}},
                      {"received":{"read":{"wrs":2,"bytes":2097152}}}]"#;
        assert_eq!(served_read_bytes(two).unwrap(), 3 << 20);
        assert!(served_read_bytes(r#"[{"received":{}}]"#).is_err());
        assert!(served_read_bytes("{}").is_err());
    }

    #[test]
    fn no_idle_round_trip_no_ratio() {
        let mut r = Report::default();
        r.sample("fairness", &flood_name(1), None, "us", Better::Lower, 25.0);
        set_limits(&mut r, 64, 1);
        assert!(
            r.get("fairness", &flood_name(1), None)
                .unwrap()
                .ratio
                .is_none()
        );
        assert!(r.notes.is_empty());
        assert!(flood_name(1).ends_with("1 MiB pair flooding"));
    }
}
