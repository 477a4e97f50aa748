//! The machine's limits, measured in the same run as the figures compared with them:
//! single-thread memcpy at every size of the sweeps (`bench/limits.c memcpy`), the
//! cross-process cache-line round trip (`limits rtt`), a shared-memory ring between two
//! processes (`limits ring`: the message-rate limit), and one TCP stream and a TCP ping-pong
//! on loopback (`bench/tcp_stream.c`, `iperf3`, `bench/tcp_pingpong.c`; the same functions
//! measure the veth between the across-host namespaces).

use std::time::Duration;

use anyhow::{Context, Result, bail};

use super::procs::{Launch, Stop, port, wait_listening};
use super::report::{Better, Report};
use super::{Ctx, tools};

/// The sizes of the sweeps: 2 B to 8 MiB, as perftest's `-a`.
pub fn sweep_sizes() -> Vec<u64> {
    (1..=23).map(|i| 1u64 << i).collect()
}

/// The size whose memcpy speed stands for streaming memory (past the caches).
pub const STREAM_SIZE: u64 = 64 << 20;

/// Ring slot sizes: what a work request needs, and the slot vrnic's rings use today.
pub const RING_SLOTS: [u64; 2] = [64, 512];

/// The figure names of the limits.
pub const RTT: &str = "cache-line round trip, two processes";
pub const MEMCPY: &str = "memcpy, one thread";
pub const TCP_STREAM: &str = "TCP one stream (tcp_stream)";
pub const IPERF3: &str = "TCP one stream (iperf3)";
pub const TCP_HALF_RTT: &str = "TCP ping-pong half round trip, 2 B";

/// The name of the ring limit with `slot`-byte slots.
pub fn ring_name(slot: u64) -> String {
    format!("shared-memory ring, {slot} B slots")
}

/// Measures every limit once (one run) into `report`.
pub fn measure(ctx: &Ctx, report: &mut Report) {
    let quick = ctx.quick;
    let iters = if quick { "50000" } else { "200000" };
    match run_limits(ctx, ctx.pair_cpus(), &["rtt", iters]) {
        Ok(out) => {
            if let Some(v) = first_number(&out) {
                report
                    .sample("limits", RTT, None, "ns", Better::Lower, v)
                    .shown = true;
            }
        }
        Err(e) => report.error("cache-line round trip", e),
    }
    let mut sizes = sweep_sizes();
    sizes.push(STREAM_SIZE);
    match memcpy(ctx, &sizes) {
        Ok(list) => {
            for (size, mbps) in list {
                let show = [65536, 1 << 20, STREAM_SIZE].contains(&size);
                report
                    .sample("limits", MEMCPY, Some(size), "MB/s", Better::Higher, mbps)
                    .shown = show;
            }
        }
        Err(e) => report.error("memcpy", e),
    }
    for slot in RING_SLOTS {
        let slots = if quick { "500000" } else { "2000000" };
        let s = slot.to_string();
        match run_limits(ctx, ctx.pair_cpus(), &["ring", "-n", slots, &s]) {
            Ok(out) => {
                if let Some(v) = first_number(&out) {
                    report
                        .sample("limits", &ring_name(slot), None, "M/s", Better::Higher, v)
                        .shown = true;
                }
            }
            Err(e) => report.error("ring", e),
        }
    }
    let lo = Net {
        server: Launch::default().on(ctx.limit_cpu(0)),
        client: Launch::default().on(ctx.limit_cpu(1)),
        addr: "127.0.0.1".into(),
    };
    tcp(ctx, &lo, "limits", "loopback", report);
}

/// The TCP limits over `net` into `section` (figure names end with `where_`): one stream by
/// `tcp_stream` and (if installed) `iperf3`, and the ping-pong's half round trip.
pub fn tcp(ctx: &Ctx, net: &Net, section: &'static str, where_: &str, report: &mut Report) {
    let secs = if ctx.quick { 1 } else { 3 };
    match tcp_stream(ctx, net, secs) {
        Ok(v) => {
            let name = format!("{TCP_STREAM}, {where_}");
            report
                .sample(section, &name, None, "MB/s", Better::Higher, v)
                .shown = true;
        }
        Err(e) => report.error(&format!("tcp_stream on {where_}"), e),
    }
    if tools::have("iperf3") {
        match iperf3(ctx, net, secs) {
            Ok(v) => {
                let name = format!("{IPERF3}, {where_}");
                report
                    .sample(section, &name, None, "MB/s", Better::Higher, v)
                    .shown = true;
            }
            Err(e) => report.error(&format!("iperf3 on {where_}"), e),
        }
    }
    let iters = if ctx.quick { 5000 } else { 20000 };
    match tcp_half_rtt(ctx, net, iters) {
        Ok(v) => {
            let name = format!("{TCP_HALF_RTT}, {where_}");
            report
                .sample(section, &name, None, "us", Better::Lower, v)
                .shown = true;
        }
        Err(e) => report.error(&format!("tcp_pingpong on {where_}"), e),
    }
}

/// memcpy speed (MB/s) at each of `sizes`, on the engine's cores.
pub fn memcpy(ctx: &Ctx, sizes: &[u64]) -> Result<Vec<(u64, f64)>> {
    memcpy_by(ctx, sizes, 1)
}

/// memcpy speed (MB/s) of a working set of each of `sizes` bytes copied by `threads`
/// processes at once, each its share (`limits memcpy -t`): the limit of that many engine
/// threads. One thread runs on the first engine core; several on all the engine cores.
pub fn memcpy_by(ctx: &Ctx, sizes: &[u64], threads: u32) -> Result<Vec<(u64, f64)>> {
    let budget = if ctx.quick { "1e8" } else { "1e9" };
    let mut args = vec!["memcpy".to_string(), "-b".into(), budget.into()];
    if threads > 1 {
        args.extend(["-t".to_string(), threads.to_string()]);
    }
    args.extend(sizes.iter().map(u64::to_string));
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let cpus = if threads > 1 {
        (!ctx.pin.engine.is_empty()).then(|| {
            ctx.pin
                .engine
                .iter()
                .map(u32::to_string)
                .collect::<Vec<_>>()
                .join(",")
        })
    } else {
        ctx.engine(0)
    };
    let out = run_limits(ctx, cpus, &args)?;
    let list: Vec<(u64, f64)> = out
        .lines()
        .filter_map(|l| {
            let mut w = l.split_whitespace();
            Some((w.next()?.parse().ok()?, w.next()?.parse().ok()?))
        })
        .collect();
    if list.len() != sizes.len() {
        bail!(
            "limits memcpy printed {} sizes of {}: {out}",
            list.len(),
            sizes.len()
        );
    }
    Ok(list)
}

fn run_limits(ctx: &Ctx, cpus: Option<String>, args: &[&str]) -> Result<String> {
    let mut cmd = Launch::default().on(cpus).command(&ctx.tools.limits);
    cmd.args(args);
    ctx.scratch.output(
        cmd,
        &format!("limits {}", args[0]),
        Duration::from_secs(300),
    )
}

/// The first number in `text`.
pub fn first_number(text: &str) -> Option<f64> {
    text.split_whitespace().find_map(|w| w.parse().ok())
}

/// Where a TCP limit runs: a server's and a client's launch, the server's address.
pub struct Net {
    pub server: Launch,
    pub client: Launch,
    pub addr: String,
}

/// One stream of `tcp_stream` for `secs`: MB/s received.
pub fn tcp_stream(ctx: &Ctx, net: &Net, secs: u32) -> Result<f64> {
    let p = port()?;
    let mut cmd = net.server.command(&ctx.tools.tcp_stream);
    cmd.args(["server", &p.to_string()]);
    let mut server = ctx.scratch.spawn(cmd, "tcp_stream server", Stop::Kill)?;
    wait_listening(&mut server, p, Duration::from_secs(10))?;
    let mut cmd = net.client.command(&ctx.tools.tcp_stream);
    cmd.args(["client", &net.addr, &p.to_string(), &secs.to_string()]);
    let limit = Duration::from_secs(u64::from(secs) + 30);
    ctx.scratch.output(cmd, "tcp_stream client", limit)?;
    let f = server.finish(Duration::from_secs(10));
    f.check("tcp_stream server")?;
    first_number(&f.stdout).context("tcp_stream printed no figure")
}

/// One `iperf3` stream for `secs`: MB/s received.
pub fn iperf3(ctx: &Ctx, net: &Net, secs: u32) -> Result<f64> {
    let p = port()?;
    let mut cmd = net.server.command("iperf3");
    cmd.args(["-s", "-1", "-p", &p.to_string()]);
    let mut server = ctx.scratch.spawn(cmd, "iperf3 server", Stop::Kill)?;
    wait_listening(&mut server, p, Duration::from_secs(10))?;
    let mut cmd = net.client.command("iperf3");
    cmd.args([
        "-c",
        &net.addr,
        "-p",
        &p.to_string(),
        "-t",
        &secs.to_string(),
        "-J",
    ]);
    let limit = Duration::from_secs(u64::from(secs) + 30);
    let out = ctx.scratch.output(cmd, "iperf3 client", limit)?;
    let _ = server.finish(Duration::from_secs(5));
    let v: serde_json::Value = serde_json::from_str(&out).context("iperf3 -J printed no JSON")?;
    let bps = v["end"]["sum_received"]["bits_per_second"]
        .as_f64()
        .context("no end.sum_received.bits_per_second in iperf3's JSON")?;
    Ok(bps / 8.0 / 1e6)
}

/// The median half round trip (us) of `iters` 2-byte `tcp_pingpong` exchanges.
pub fn tcp_half_rtt(ctx: &Ctx, net: &Net, iters: u32) -> Result<f64> {
    let p = port()?;
    let mut cmd = net.server.command(&ctx.tools.tcp_pingpong);
    cmd.args(["server", &p.to_string()]);
    let server = ctx.scratch.spawn(cmd, "tcp_pingpong server", Stop::Kill)?;
    let mut cmd = net.client.command(&ctx.tools.tcp_pingpong);
    cmd.args(["client", &net.addr, &p.to_string(), "2", &iters.to_string()]);
    let out = ctx
        .scratch
        .output(cmd, "tcp_pingpong client", Duration::from_secs(60))?;
    let _ = server.finish(Duration::from_secs(5));
    first_number(&out).context("tcp_pingpong printed no figure")
}
