//! `vrnic bench`: vrnic's figures against this machine's limits, measured in one run (the
//! command line's `bench` subcommand: [`BenchArgs`] and [`main`]).
//!
//! It starts private daemons on temporary state dirs (no running daemon is needed, and none is
//! touched), and runs, each `--runs` times (figures are medians with min..max):
//!
//! - `limits`: memcpy at each size, the cross-process cache-line round trip, a shared-memory
//!   ring between two processes, TCP on loopback;
//! - `perftest`: unmodified perftest sweeps 2 B to 8 MiB (write/read/send bandwidth;
//!   write/send/read latency, atomic latency) and the message rate;
//! - `ctrl`: the control path (open, QP to RTS, registration);
//! - `scale`: many pairs at once, the aggregate timed by the wall clock;
//! - `vnics`: many vRNICs on one daemon, each held with a QP: time and memory per vRNIC;
//! - `fairness`: an unrelated pair's round trip beside another vRNIC's idle QPs and beside
//!   flooding pairs, against its idle round trip;
//! - `hosts` (root): two daemons in network namespaces the bench makes, joined by a veth,
//!   against TCP on that veth;
//! - `ucx`: UCX's `ucx_perftest` `tag_lat` (8 B) and `tag_bw` (1 MiB) over vrnic's `rc_verbs`
//!   against UCX's own shared memory and TCP.
//!
//! It prints a table (`report`) where each figure stands beside its limit as a ratio, and can
//! write the figures as JSON and plots as SVG (`svg`). `--pin` puts the engine (the daemons)
//! and the apps on chosen cores with `taskset`.
//!
//! Everything it starts or makes is removed when it ends, by an error, a panic or a signal
//! (`procs`; the signal wait is in `sys`, the bench's only unsafe code). Its C programs
//! (`bench/*.c`) are built into the binary and compiled with `cc` at run time (`tools`).
//!
//! It asserts nothing about speed: targets are reported, never enforced.

mod copy;
mod ctrl;
mod fairness;
mod hosts;
mod limits;
mod perftest;
mod procs;
mod report;
mod scale;
mod svg;
mod sys;
mod tools;
mod ucx;
mod vnics;

use std::path::PathBuf;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::{Context, Result, bail};
use serde::Serialize;

use procs::{Daemon, Launch, Scratch};
use report::Report;
use tools::Tools;

/// What `vrnic bench` measures besides the limits.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Section {
    /// perftest sweeps, message rate, latency.
    Perftest,
    /// The control path (`bench/ctrl.c`).
    Ctrl,
    /// Many pairs at once.
    Scale,
    /// Many vRNICs on one daemon, each held with a QP.
    Vnics,
    /// An unrelated pair beside idle QPs and flooders of other vRNICs.
    Fairness,
    /// Two hosts in network namespaces (root).
    Hosts,
    /// UCX over vrnic against UCX's shared memory and TCP (`ucx_perftest`).
    Ucx,
}

/// How the across-host runs' daemons protect their peer link (`--links`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Links {
    /// No keys (`--insecure-links`): frames in clear, payloads sent from and read into place.
    Insecure,
    /// Keys (`--key`, `--peer-key`): the link is authenticated by a Noise handshake, its
    /// frames then travel as on an insecure one (the daemon's default with keys).
    Authenticated,
    /// Keys and `--encrypt-links`: every frame in Noise transport records.
    Encrypted,
}

/// `vrnic bench`'s options.
#[derive(clap::Args, Debug)]
pub struct BenchArgs {
    /// About a minute: fewer iterations and shorter runs, one run, smaller counts, no scale,
    /// many-vRNICs, fairness or across-host runs unless --sections asks for them.
    #[arg(long)]
    quick: bool,
    /// Runs of every measurement; the table shows their median and min..max [default: 3; 1
    /// with --quick].
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..=100))]
    runs: Option<u32>,
    /// The engine and the apps on chosen cores (`taskset`), e.g. `engine=2,apps=4,6`: the
    /// daemon on core 2, a pair's server on core 4 and its client on core 6 (a list of one
    /// core is shared; the scale runs put every app on all the app cores; across hosts each
    /// daemon takes the next engine core).
    #[arg(long, value_parser = Pin::parse)]
    pin: Option<Pin>,
    /// What to run besides the limits [default: all (hosts only as root); with --quick:
    /// perftest,ctrl].
    #[arg(long, value_enum, value_delimiter = ',')]
    sections: Option<Vec<Section>>,
    /// Pair counts of the scale runs [default: 2,4,8,16,32,64,128; with --quick 2,8].
    #[arg(long, value_delimiter = ',', value_parser = clap::value_parser!(u32).range(1..=512))]
    pairs: Option<Vec<u32>>,
    /// Engine threads of the scale runs' daemons (`vrnic serve --engine-threads`), a daemon
    /// for each count, running on all the engine cores [default: the daemon's own default, on
    /// the first engine core]; the across-host daemons take the first count.
    #[arg(long, value_delimiter = ',', value_parser = clap::value_parser!(u32).range(1..=64))]
    engine_threads: Option<Vec<u32>>,
    /// vRNICs of the many-vRNICs runs, each held by a process of its own [default: 1024;
    /// with --quick 16].
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u32).range(1..=16384))]
    vnics: Option<u32>,
    /// Idle QPs another vRNIC holds in the fairness runs [default: 12288; with --quick 1000].
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u32).range(1..=65536))]
    idle_qps: Option<u32>,
    /// Flooding `ib_read_bw -e -q 16 -s 1048576` pairs in the fairness runs [default: 4;
    /// with --quick 1].
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u32).range(1..=64))]
    flood_pairs: Option<u32>,
    /// Write every figure (each run's samples, medians, limits, ratios) to FILE as JSON.
    #[arg(long, value_name = "FILE")]
    json: Option<PathBuf>,
    /// Write bandwidth.svg and latency.svg (against message size, with their limits) into DIR.
    #[arg(long, value_name = "DIR")]
    svg: Option<PathBuf>,
    /// Show every size of the sweeps in the table (the JSON always has them).
    #[arg(long)]
    all_sizes: bool,
    /// The across-host runs' peer link: keys and a handshake only, encrypted too, or neither.
    #[arg(long, value_enum, default_value_t = Links::Authenticated)]
    links: Links,
    /// The perftest pairs on two vRNICs made with this bandwidth limit (`vrnic create
    /// --max-bw LIMIT`, e.g. `1T`), instead of a fresh vRNIC per app: far above what they
    /// reach, it measures what an idle QoS limiter costs (against a run without it).
    #[arg(long, value_name = "LIMIT")]
    max_bw: Option<String>,
    /// The same with a message-rate limit (`vrnic create --max-rate LIMIT`, e.g. `1T`).
    #[arg(long, value_name = "LIMIT")]
    max_rate: Option<String>,
}

/// Cores for the engine and for the apps (`--pin engine=LIST,apps=LIST`).
#[derive(Clone, Debug, Default, Serialize)]
pub struct Pin {
    pub engine: Vec<u32>,
    pub apps: Vec<u32>,
}

impl Pin {
    /// Parses `engine=2,apps=4,6` (either part may be left out; lists also take `a-b`).
    fn parse(s: &str) -> Result<Pin, String> {
        let mut pin = Pin::default();
        let mut cur: Option<&mut Vec<u32>> = None;
        for part in s.split(',') {
            let item = match part.split_once('=') {
                Some(("engine", v)) => {
                    cur = Some(&mut pin.engine);
                    v
                }
                Some(("apps", v)) => {
                    cur = Some(&mut pin.apps);
                    v
                }
                Some((k, _)) => return Err(format!("unknown part {k:?} (engine=..., apps=...)")),
                None => part,
            };
            let list = cur
                .as_deref_mut()
                .ok_or("start with engine= or apps= (e.g. engine=2,apps=4,6)")?;
            let bad = || format!("{item:?} is not a core number or range");
            match item.split_once('-') {
                Some((a, b)) => {
                    let (a, b): (u32, u32) =
                        (a.parse().map_err(|_| bad())?, b.parse().map_err(|_| bad())?);
                    if a > b {
                        return Err(bad());
                    }
                    list.extend(a..=b);
                }
                None => list.push(item.parse().map_err(|_| bad())?),
            }
        }
        Ok(pin)
    }

    /// Checks every core is online (`/sys/devices/system/cpu/online`).
    fn check(&self) -> Result<()> {
        let online = std::fs::read_to_string("/sys/devices/system/cpu/online")
            .context("read /sys/devices/system/cpu/online")?;
        let cpus = Pin::parse(&format!("engine={}", online.trim()))
            .map_err(anyhow::Error::msg)?
            .engine;
        for c in self.engine.iter().chain(&self.apps) {
            if !cpus.contains(c) {
                bail!("--pin: core {c} is not online (online: {})", online.trim());
            }
        }
        Ok(())
    }
}

/// What every part of a bench run shares.
pub struct Ctx {
    /// This `vrnic` binary (daemons and `vrnic run`).
    pub vrnic: PathBuf,
    pub scratch: Scratch,
    pub tools: Tools,
    pub pin: Pin,
    pub quick: bool,
}

/// A `taskset -c` list.
fn cpu_list(cpus: &[u32]) -> String {
    cpus.iter()
        .map(u32::to_string)
        .collect::<Vec<_>>()
        .join(",")
}

impl Ctx {
    /// The cores of daemon `i` (the `i`-th engine core), if pinned.
    pub fn engine(&self, i: usize) -> Option<String> {
        let e = &self.pin.engine;
        (!e.is_empty()).then(|| e[i % e.len()].to_string())
    }

    /// The cores of a pair's app `i` (0: server, 1: client), if pinned.
    pub fn app(&self, i: usize) -> Option<String> {
        let a = &self.pin.apps;
        (!a.is_empty()).then(|| a[i % a.len()].to_string())
    }

    /// All the app cores, if pinned.
    pub fn apps(&self) -> Option<String> {
        (!self.pin.apps.is_empty()).then(|| cpu_list(&self.pin.apps))
    }

    /// A private daemon of the bench on the first engine core (if pinned), with `extra`
    /// options of `vrnic serve`.
    pub fn daemon(&self, extra: &[String]) -> Result<Daemon> {
        Daemon::start(
            &self.scratch,
            &self.vrnic,
            Launch::default().on(self.engine(0)),
            extra,
        )
    }

    /// [`Ctx::daemon`] with `threads` engine threads, on all the engine cores (if pinned).
    pub fn daemon_with_threads(&self, threads: u32, extra: &[String]) -> Result<Daemon> {
        let mut args = extra.to_vec();
        args.extend(["--engine-threads".to_string(), threads.to_string()]);
        let cores = (!self.pin.engine.is_empty()).then(|| cpu_list(&self.pin.engine));
        Daemon::start(
            &self.scratch,
            &self.vrnic,
            Launch::default().on(cores),
            &args,
        )
    }

    /// The core of side `i` (0 or 1) of a two-process TCP limit, if pinned: the first engine
    /// core and the first app core, as for the cache-line round trip. (Both on the app cores
    /// would put them on one core when one app core is given, where two spinning processes
    /// take turns only at the scheduler's tick.)
    pub fn limit_cpu(&self, i: usize) -> Option<String> {
        let (e, a) = (self.pin.engine.first(), self.pin.apps.first());
        let c = if i == 0 { e.or(a) } else { a.or(e) };
        c.map(u32::to_string)
    }

    /// The cores of a two-process limit standing for app and engine (the cache-line round
    /// trip, the ring): the first engine core and the first app core, if pinned.
    pub fn pair_cpus(&self) -> Option<String> {
        let cores: Vec<u32> = self
            .pin
            .engine
            .first()
            .into_iter()
            .chain(self.pin.apps.first())
            .copied()
            .collect();
        (!cores.is_empty()).then(|| cpu_list(&cores))
    }
}

/// What the JSON file holds.
#[derive(Serialize)]
struct JsonOut<'a> {
    /// The format's version.
    vrnic_bench: u32,
    /// When the run started (UTC, RFC 3339).
    started: String,
    duration_s: f64,
    machine: Machine,
    options: JsonOptions<'a>,
    #[serde(flatten)]
    report: &'a Report,
}

#[derive(Serialize)]
struct JsonOptions<'a> {
    quick: bool,
    runs: u32,
    pin: &'a Pin,
    sections: &'a [Section],
    pairs: &'a [u32],
    engine_threads: &'a [Option<u32>],
    vnics: u32,
    idle_qps: u32,
    flood_pairs: u32,
    max_bw: Option<&'a str>,
    max_rate: Option<&'a str>,
}

#[derive(Serialize)]
struct Machine {
    cpus: usize,
    cpu_model: String,
    kernel: String,
    vrnic_version: &'static str,
}

impl Machine {
    fn probe() -> Machine {
        let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
        Machine {
            cpus: std::thread::available_parallelism().map_or(0, |n| n.get()),
            cpu_model: cpuinfo
                .lines()
                .find_map(|l| l.strip_prefix("model name")?.split_once(':'))
                .map(|(_, m)| m.trim().to_string())
                .unwrap_or_default(),
            kernel: std::fs::read_to_string("/proc/sys/kernel/osrelease")
                .unwrap_or_default()
                .trim()
                .to_string(),
            vrnic_version: env!("CARGO_PKG_VERSION"),
        }
    }
}

/// `YYYY-MM-DDTHH:MM:SSZ` for a time since the epoch.
fn rfc3339(t: SystemTime) -> String {
    let secs = t.duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs());
    let (days, rem) = ((secs / 86400) as i64, secs % 86400);
    // Civil date from days since 1970-01-01 (Howard Hinnant's algorithm).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}Z",
        rem / 3600,
        rem / 60 % 60,
        rem % 60
    )
}

/// Says on stderr what the bench does now, and since when it runs.
fn progress(t0: Instant, what: &str) {
    eprintln!("vrnic bench: {:>4.0} s: {what}", t0.elapsed().as_secs_f64());
}

/// Runs `vrnic bench`. Call it before this process has made any thread: it blocks the signals
/// that end it, and a thread of its own takes them and removes what the bench made.
pub fn main(args: BenchArgs) -> Result<()> {
    let signals = sys::block_exit_signals().context("block SIGINT/SIGTERM")?;
    std::thread::spawn(move || {
        let sig = signals.wait();
        eprintln!("\nvrnic bench: signal {sig}: stopping and removing what it started");
        procs::teardown_and_exit(128 + sig);
    });

    let quick = args.quick;
    let runs = args.runs.unwrap_or(if quick { 1 } else { 3 });
    let root = sys::is_root();
    let sections: Vec<Section> = match &args.sections {
        Some(s) => s.clone(),
        None if quick => vec![Section::Perftest, Section::Ctrl],
        None => {
            let mut all = vec![
                Section::Perftest,
                Section::Ctrl,
                Section::Scale,
                Section::Vnics,
                Section::Fairness,
            ];
            if root {
                all.push(Section::Hosts);
            } else {
                eprintln!("vrnic bench: not root: no across-host runs (network namespaces)");
            }
            if ucx::require().is_ok() {
                all.push(Section::Ucx);
            } else {
                eprintln!("vrnic bench: no ucx_perftest (apt-get install ucx-utils): no UCX runs");
            }
            all
        }
    };
    if sections.contains(&Section::Hosts) && !root {
        bail!("--sections hosts: the across-host runs make network namespaces, which needs root");
    }
    // The scale runs' daemons: one with the daemon's default, or one per count asked for.
    let engine_threads: Vec<Option<u32>> = match &args.engine_threads {
        Some(t) => t.iter().copied().map(Some).collect(),
        None => vec![None],
    };
    let pairs: Vec<u32> = match &args.pairs {
        Some(p) => p.clone(),
        None if quick => vec![2, 8],
        None => vec![2, 4, 8, 16, 32, 64, 128],
    };
    let vnics = args.vnics.unwrap_or(if quick { 16 } else { 1024 });
    let idle_qps = args.idle_qps.unwrap_or(if quick { 1000 } else { 12288 });
    let flood_pairs = args.flood_pairs.unwrap_or(if quick { 1 } else { 4 });
    let pin = args.pin.clone().unwrap_or_default();
    pin.check()?;
    // `vrnic create` options of the perftest pairs' vRNICs.
    let limits: Vec<String> = [("--max-bw", &args.max_bw), ("--max-rate", &args.max_rate)]
        .into_iter()
        .filter_map(|(o, v)| Some([o.to_string(), v.clone()?]))
        .flatten()
        .collect();
    if pin.engine.is_empty() != pin.apps.is_empty() {
        eprintln!("vrnic bench: --pin gives cores to only one side; the other runs anywhere");
    }
    perftest::require()?;
    if !pin.engine.is_empty() || !pin.apps.is_empty() {
        tools::require(&["taskset"])?;
    }
    if sections.contains(&Section::Hosts) {
        tools::require(&["ip", "nsenter"])?;
    }
    if sections.contains(&Section::Ucx) {
        ucx::require()?;
    }
    if let Some(p) = &args.json {
        // Fail now, not after the whole run, if the file cannot be written.
        std::fs::write(p, b"").with_context(|| format!("cannot write {}", p.display()))?;
    }

    let exe = std::env::current_exe().context("locate the vrnic binary")?;
    let started = SystemTime::now();
    let t0 = Instant::now();
    let scratch = Scratch::new()?;
    let tools = Tools::build(&scratch.dir.join("tools"))?;
    let ctx = Ctx {
        vrnic: exe,
        scratch,
        tools,
        pin: pin.clone(),
        quick,
    };
    let mut report = Report::default();
    let has = |s| sections.contains(&s);

    for r in 0..runs {
        progress(t0, &format!("run {}/{runs}: limits", r + 1));
        limits::measure(&ctx, &mut report);
        copy::measure(&ctx, &mut report);
    }
    if has(Section::Perftest) || has(Section::Ctrl) {
        let d = ctx.daemon(&[])?;
        let capped = if limits.is_empty() {
            None
        } else {
            // Both sides' vRNICs limited (the client's limit holds what it sends; a READ's
            // responses count against the requester too).
            let names = ["bench-srv".to_string(), "bench-cli".to_string()];
            for n in &names {
                let mut a = vec!["create", n.as_str()];
                a.extend(limits.iter().map(String::as_str));
                ctx.scratch
                    .output(d.cli(&a), "vrnic create", Duration::from_secs(30))
                    .with_context(|| format!("vrnic {}", a.join(" ")))?;
            }
            Some(names)
        };
        for r in 0..runs {
            if has(Section::Perftest) {
                progress(t0, &format!("run {}/{runs}: perftest", r + 1));
                perftest::measure(&ctx, &d, capped.as_ref(), &mut report);
            }
            if has(Section::Ctrl) {
                progress(t0, &format!("run {}/{runs}: control path", r + 1));
                ctrl::measure(&ctx, &d, &mut report);
            }
        }
    }
    if has(Section::Scale) {
        // A fresh daemon: nothing left from the runs before; room for the largest count.
        let most = pairs.iter().max().copied().unwrap_or(0) * 2 + 16;
        let extra = ["--max-vrnics".to_string(), most.max(4096).to_string()];
        for &threads in &engine_threads {
            let d = match threads {
                None => ctx.daemon(&extra)?,
                Some(t) => ctx.daemon_with_threads(t, &extra)?,
            };
            for r in 0..runs {
                let with = threads.map_or(String::new(), |t| format!(", engine threads: {t}"));
                progress(
                    t0,
                    &format!("run {}/{runs}: scale {pairs:?} pairs{with}", r + 1),
                );
                scale::measure(&ctx, &d, &pairs, threads, &mut report);
            }
        }
    }
    if has(Section::Vnics) {
        for r in 0..runs {
            progress(t0, &format!("run {}/{runs}: {vnics} vRNICs", r + 1));
            vnics::measure(&ctx, vnics, &mut report);
        }
    }
    if has(Section::Fairness) {
        // A fresh daemon, with room for the idle QPs on one vRNIC.
        let extra = [
            "--max-qp".to_string(),
            (idle_qps + 16).max(4096).to_string(),
        ];
        let d = ctx.daemon(&extra)?;
        for r in 0..runs {
            progress(
                t0,
                &format!(
                    "run {}/{runs}: fairness ({idle_qps} idle QPs, {flood_pairs} flooding pairs)",
                    r + 1
                ),
            );
            fairness::measure(&ctx, &d, idle_qps, flood_pairs, &mut report);
        }
    }
    if has(Section::Hosts) {
        progress(
            t0,
            &format!(
                "across hosts: namespaces, veth, two daemons (links {:?})",
                args.links
            ),
        );
        let threads = engine_threads.first().copied().flatten();
        if let Some(t) = threads {
            report.notes.push(format!(
                "across hosts: each daemon with --engine-threads {t}"
            ));
        }
        match hosts::Hosts::new(&ctx, args.links, threads) {
            Ok(h) => {
                for r in 0..runs {
                    progress(t0, &format!("run {}/{runs}: across hosts", r + 1));
                    h.measure(&ctx, &mut report);
                }
            }
            Err(e) => report.error("across hosts", e),
        }
    }

    if has(Section::Ucx) {
        let d = ctx.daemon(&[])?;
        for r in 0..runs {
            progress(t0, &format!("run {}/{runs}: UCX", r + 1));
            ucx::measure(&ctx, &d, &mut report);
        }
    }

    perftest::set_limits(&mut report);
    copy::set_limits(&mut report);
    ctrl::set_limits(&mut report);
    scale::set_limits(&mut report, &pairs, &engine_threads);
    vnics::set_limits(&mut report, vnics);
    fairness::set_limits(&mut report, idle_qps, flood_pairs);
    hosts::set_limits(&mut report);
    ucx::set_limits(&mut report);
    report
        .notes
        .extend(oversubscribed(&sections, Machine::probe().cpus));
    if args.all_sizes {
        for f in &mut report.figures {
            if matches!(f.section, "bandwidth" | "latency") {
                f.shown = true;
            }
        }
    }

    println!(
        "vrnic bench{}: medians of {runs} run{} on {} cores{}{}; limits measured in the same run",
        if quick { " --quick" } else { "" },
        if runs == 1 { "" } else { "s" },
        Machine::probe().cpus,
        if pin.engine.is_empty() && pin.apps.is_empty() {
            String::new()
        } else {
            format!(
                " (engine on {}, apps on {})",
                cpu_list(&pin.engine),
                cpu_list(&pin.apps)
            )
        },
        if limits.is_empty() {
            String::new()
        } else {
            format!("; perftest pairs' vRNICs made with {}", limits.join(" "))
        }
    );
    print!("{}", report.table());

    if let Some(p) = &args.json {
        let out = JsonOut {
            vrnic_bench: 1,
            started: rfc3339(started),
            duration_s: t0.elapsed().as_secs_f64(),
            machine: Machine::probe(),
            options: JsonOptions {
                quick,
                runs,
                pin: &pin,
                sections: &sections,
                pairs: &pairs,
                engine_threads: &engine_threads,
                vnics,
                idle_qps,
                flood_pairs,
                max_bw: args.max_bw.as_deref(),
                max_rate: args.max_rate.as_deref(),
            },
            report: &report,
        };
        let text = serde_json::to_string_pretty(&out).context("encode the JSON")?;
        std::fs::write(p, text + "\n").with_context(|| format!("write {}", p.display()))?;
        println!("JSON: {}", p.display());
    }
    if let Some(dir) = &args.svg {
        for p in svg::write(&report, dir)? {
            println!("SVG: {}", p.display());
        }
    }
    if !report.errors.is_empty() {
        bail!("{} measurement(s) failed (above)", report.errors.len());
    }
    Ok(())
}

/// Busy-polling processes of a perftest or fairness run: its server, its client and the
/// daemon's engine.
const BUSY_POLLERS: usize = 3;
/// Busy-polling processes of an across-host run: its server, its client and both daemons'
/// engines.
const BUSY_POLLERS_HOSTS: usize = 4;

/// Warnings for the table when the runs' busy-polling processes outnumber the cores: each
/// then waits for the scheduler to give it a core, and latencies (the 2 B one above all)
/// measure time slices rather than vrnic.
fn oversubscribed(sections: &[Section], cpus: usize) -> Vec<String> {
    let s = if cpus == 1 { "" } else { "s" };
    let mut notes = Vec::new();
    let polls = sections
        .iter()
        .any(|s| matches!(s, Section::Perftest | Section::Fairness | Section::Scale));
    if polls && cpus < BUSY_POLLERS {
        notes.push(format!(
            "WARNING: {BUSY_POLLERS} processes busy-poll in each run (server, client, the \
             daemon's engine) on {cpus} core{s}: they take turns on the cores, so latencies \
             (the 2 B one above all) measure the scheduler's time slices, not vrnic; measure \
             on at least {BUSY_POLLERS} cores"
        ));
    }
    if sections.contains(&Section::Hosts) && cpus < BUSY_POLLERS_HOSTS {
        notes.push(format!(
            "WARNING: across hosts {BUSY_POLLERS_HOSTS} processes busy-poll (server, client, \
             both daemons' engines) on {cpus} core{s}; ib_write_lat's apps wait for the \
             peer's bytes by polling their buffer, never giving the CPU away, so a round trip \
             often waits for a time slice (milliseconds: the typical figure is then bimodal); \
             measure on at least {BUSY_POLLERS_HOSTS} cores"
        ));
    }
    notes
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn busy_pollers_past_the_cores_are_warned_of() {
        let w = oversubscribed(&[Section::Perftest], 2);
        assert!(
            w.len() == 1
                && w[0].starts_with("WARNING: 3 processes busy-poll")
                && w[0].contains("2 cores"),
            "{w:?}"
        );
        assert!(oversubscribed(&[Section::Perftest], 4).is_empty());
        assert!(oversubscribed(&[Section::Ctrl], 2).is_empty());
        let w = oversubscribed(&[Section::Ctrl, Section::Hosts], 3);
        assert!(
            w.len() == 1 && w[0].starts_with("WARNING: across hosts 4 processes busy-poll"),
            "{w:?}"
        );
        assert_eq!(
            oversubscribed(&[Section::Perftest, Section::Hosts], 2).len(),
            2
        );
        assert!(oversubscribed(&[Section::Hosts], 4).is_empty());
    }

    #[test]
    fn pin_takes_lists_and_ranges() {
        let p = Pin::parse("engine=2,apps=4,6").unwrap();
        assert_eq!((p.engine, p.apps), (vec![2], vec![4, 6]));
        let p = Pin::parse("apps=0-2,engine=3").unwrap();
        assert_eq!((p.engine, p.apps), (vec![3], vec![0, 1, 2]));
        assert!(Pin::parse("4,6").is_err());
        assert!(Pin::parse("engine=x").is_err());
        assert!(Pin::parse("cores=1").is_err());
    }

    #[test]
    fn dates_are_utc_rfc3339() {
        assert_eq!(rfc3339(UNIX_EPOCH), "1970-01-01T00:00:00Z");
        let t = UNIX_EPOCH + std::time::Duration::from_secs(1_795_000_000);
        assert_eq!(rfc3339(t), "2026-11-18T11:06:40Z");
    }
}
