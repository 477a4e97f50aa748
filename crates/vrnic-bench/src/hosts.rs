//! Across hosts (root): two network namespaces the bench makes (`vrbench<PID>a`, `...b`)
//! joined by one veth pair, 10.78.0.1 and 10.78.0.2, a daemon in each joined by `--listen` /
//! `--peer`, each with a key of its own (`vrnic keygen`) and the other's public key, and
//! `--encrypt-links` or neither key with `--links`; perftest with its server on host a and its
//! client on host b, against limits
//! measured on the same veth in the same run: one TCP stream (the faster of `tcp_stream` and
//! `iperf3`) for bandwidth, half a TCP ping-pong's round trip for latency. The namespaces,
//! and every address in them, are removed when the bench ends; no other address is used.

use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};

use super::limits::{self, IPERF3, Net, TCP_HALF_RTT, TCP_STREAM};
use super::perftest::{MIB_PER_MB, Side, pair, rows};
use super::procs::{self, Daemon, Launch, NETNS_PREFIX, Netns, ip};
use super::report::{Better, Limit, Report};
use super::{Ctx, Links};

/// The two hosts' addresses, and the daemons' peer port.
const ADDRS: [&str; 2] = ["10.78.0.1", "10.78.0.2"];
const PEER_PORT: u16 = 7700;

/// What `vrnic bench` keeps while the across-host runs go on: the hosts, then their daemons
/// (dropped first: fields drop in order).
pub struct Hosts {
    daemons: Vec<Daemon>,
    _netns: Vec<Netns>,
}

const BW_SIZES: [u64; 2] = [65536, 1 << 20];
const LAT: [&str; 2] = ["ib_write_lat", "ib_send_lat"];
const VETH: &str = "veth";

impl Hosts {
    /// Makes the namespaces, the veth and the daemons (with `threads` engine threads, else the
    /// daemon's default), and waits until their link is up.
    pub fn new(ctx: &Ctx, links: Links, threads: Option<u32>) -> Result<Hosts> {
        procs::remove_stale_netns();
        let tag = format!("{NETNS_PREFIX}{}", std::process::id());
        let names = [format!("{tag}a"), format!("{tag}b")];
        let mut netns = Vec::new();
        for n in &names {
            netns.push(Netns::new(n)?);
        }
        ip(&[
            "-n", &names[0], "link", "add", "eth0", "type", "veth", "peer", "name", "eth0",
            "netns", &names[1],
        ])?;
        for (n, a) in names.iter().zip(ADDRS) {
            ip(&["-n", n, "addr", "add", &format!("{a}/24"), "dev", "eth0"])?;
            ip(&["-n", n, "link", "set", "eth0", "up"])?;
        }
        // Each host's key, and its public key for the other.
        let mut keys = Vec::new();
        for i in 0..2 {
            let file = ctx.scratch.path(&format!("host{i}.key"));
            let mut c = std::process::Command::new(&ctx.vrnic);
            c.arg("keygen").arg(&file);
            let public = ctx
                .scratch
                .output(c, "vrnic keygen", Duration::from_secs(10))?
                .trim()
                .to_string();
            keys.push((file, public));
        }
        let mut daemons = Vec::new();
        for i in 0..2 {
            let launch = Launch {
                netns: Some(names[i].clone()),
                cpus: ctx.engine(i),
            };
            let mut extra = vec![
                "--listen".to_string(),
                format!("{}:{PEER_PORT}", ADDRS[i]),
                "--peer".into(),
                format!("{}:{PEER_PORT}", ADDRS[1 - i]),
            ];
            if let Some(t) = threads {
                extra.extend(["--engine-threads".to_string(), t.to_string()]);
            }
            match links {
                Links::Insecure => extra.push("--insecure-links".into()),
                Links::Authenticated | Links::Encrypted => {
                    extra.push("--key".into());
                    extra.push(keys[i].0.display().to_string());
                    extra.push("--peer-key".into());
                    extra.push(format!("{}:{PEER_PORT}={}", ADDRS[1 - i], keys[1 - i].1));
                    if links == Links::Encrypted {
                        extra.push("--encrypt-links".into());
                    }
                }
            }
            daemons.push(Daemon::start(&ctx.scratch, &ctx.vrnic, launch, &extra)?);
        }
        let h = Hosts {
            daemons,
            _netns: netns,
        };
        for d in &h.daemons {
            wait_up(ctx, d)?;
        }
        Ok(h)
    }

    /// One run of the across-host rows and their limits into `report`.
    pub fn measure(&self, ctx: &Ctx, report: &mut Report) {
        let [a, b] = [&self.daemons[0], &self.daemons[1]];
        let net = Net {
            server: a.launch.on(ctx.app(0)),
            client: b.launch.on(ctx.app(1)),
            addr: ADDRS[0].into(),
        };
        limits::tcp(ctx, &net, "hosts", VETH, report);
        let limit = Duration::from_secs(120);
        let secs = if ctx.quick { "1" } else { "2" };
        let side = |d, i| Side {
            daemon: d,
            cpus: ctx.app(i),
            vnic: None,
        };
        for size in BW_SIZES {
            let args: Vec<String> = ["ib_write_bw", "-s", &size.to_string(), "-D", secs]
                .map(String::from)
                .to_vec();
            match pair(ctx, side(a, 0), side(b, 1), ADDRS[0], &args, limit) {
                Ok(out) => match rows(&out).last() {
                    Some(r) => {
                        report
                            .sample(
                                "hosts",
                                "ib_write_bw",
                                Some(size),
                                "MB/s",
                                Better::Higher,
                                r[3] * MIB_PER_MB,
                            )
                            .shown = true;
                    }
                    None => report.error("ib_write_bw across hosts", anyhow::anyhow!("no row")),
                },
                Err(e) => report.error("ib_write_bw across hosts", e),
            }
        }
        let iters = if ctx.quick { "2000" } else { "10000" };
        for prog in LAT {
            let args: Vec<String> = [prog, "-s", "2", "-n", iters].map(String::from).to_vec();
            match pair(ctx, side(a, 0), side(b, 1), ADDRS[0], &args, limit) {
                Ok(out) => match rows(&out).last() {
                    Some(r) => {
                        report
                            .sample("hosts", prog, Some(2), "us", Better::Lower, r[4])
                            .shown = true;
                    }
                    None => report.error(prog, anyhow::anyhow!("no result row")),
                },
                Err(e) => report.error(&format!("{prog} across hosts"), e),
            }
        }
    }
}

/// Waits (at most 20 s) until `vrnic peers` of `d` shows its link up.
fn wait_up(ctx: &Ctx, d: &Daemon) -> Result<()> {
    let start = Instant::now();
    loop {
        let out = ctx
            .scratch
            .output(d.cli(&["peers"]), "vrnic peers", Duration::from_secs(10))
            .context("vrnic peers")?;
        if out
            .lines()
            .skip(1)
            .any(|l| l.split_whitespace().nth(1) == Some("up"))
        {
            return Ok(());
        }
        if start.elapsed() > Duration::from_secs(20) {
            bail!("the peer link did not come up in 20 s:\n{out}");
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// Sets the across-host figures' limits: the faster TCP stream, the ping-pong's half RTT.
pub fn set_limits(report: &mut Report) {
    let stream = [TCP_STREAM, IPERF3]
        .iter()
        .filter_map(|n| report.median("hosts", &format!("{n}, {VETH}"), None))
        .fold(None, |m: Option<f64>, v| Some(m.map_or(v, |m| m.max(v))));
    if let Some(v) = stream {
        for size in BW_SIZES {
            let l = Limit {
                what: "one TCP stream on the veth".into(),
                value: v,
                measured: true,
            };
            report.limit("hosts", "ib_write_bw", Some(size), l);
        }
    }
    if let Some(v) = report.median("hosts", &format!("{TCP_HALF_RTT}, {VETH}"), None) {
        for prog in LAT {
            let l = Limit {
                what: "TCP half RTT on the veth".into(),
                value: v,
                measured: true,
            };
            report.limit("hosts", prog, Some(2), l);
        }
    }
}
