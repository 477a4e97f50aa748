//! `vrnic top`: a live table of this host's vRNICs, refreshed every interval from the daemon's
//! exact counters (`vrnic stats`): QPs, users, work requests and bytes per second sent and
//! received, completions in error per second, the share of the interval its QoS limit held it
//! back, and its limits. On a terminal it takes the screen (crossterm's alternate screen, raw
//! mode) and quits cleanly on `q`, Esc or Ctrl-C; elsewhere, or with `--batch N`, it prints N
//! plain tables, one per interval.

use std::collections::HashMap;
use std::io::{IsTerminal, Write};
use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::{Result, bail};
use crossterm::event::{self, Event, KeyCode, KeyEvent, KeyModifiers};
use crossterm::{cursor, execute, terminal};
use vrnic_api::{VnicStats, VnicSummary};
use vrnic_daemon::admin::AdminClient;

/// What one row is computed from: a vRNIC's counters at one instant.
#[derive(Debug, Clone, Copy, Default)]
struct Sample {
    tx_wrs: u64,
    tx_bytes: u64,
    rx_msgs: u64,
    rx_bytes: u64,
    errors: u64,
    qos_us: u64,
}

impl Sample {
    fn of(s: &VnicStats) -> Sample {
        let sum = |c: &vrnic_api::ClassStats| {
            [c.send, c.write, c.read, c.atomic]
                .iter()
                .fold((0u64, 0u64), |(w, b), f| (w + f.wrs, b + f.bytes))
        };
        let (tx_wrs, tx_bytes) = sum(&s.sent);
        let (rx_msgs, rx_bytes) = sum(&s.received);
        Sample {
            tx_wrs,
            tx_bytes,
            rx_msgs,
            rx_bytes,
            errors: s
                .completions
                .iter()
                .filter(|(k, _)| k.as_str() != "success")
                .map(|(_, n)| n)
                .sum(),
            qos_us: s.qos_waited_us,
        }
    }
}

/// Runs `vrnic top` against the daemon of `state_dir`.
pub fn run(state_dir: &Path, interval: Duration, batch: Option<u32>) -> Result<()> {
    if interval < Duration::from_millis(100) {
        bail!("--interval must be at least 0.1 s");
    }
    let mut c = AdminClient::connect(state_dir)?;
    let interactive = batch.is_none() && std::io::stdout().is_terminal();
    if !interactive {
        let n = batch.unwrap_or(1).max(1);
        let mut last = read(&mut c)?;
        for _ in 0..n {
            std::thread::sleep(interval);
            let now = read(&mut c)?;
            println!("{}", table(&last, &now, None));
            last = now;
        }
        return Ok(());
    }
    terminal::enable_raw_mode()?;
    let mut out = std::io::stdout();
    execute!(out, terminal::EnterAlternateScreen, cursor::Hide)?;
    let r = live(&mut c, interval, &mut out);
    // Restored whatever happened, so that a failure leaves a usable terminal.
    let _ = execute!(out, cursor::Show, terminal::LeaveAlternateScreen);
    let _ = terminal::disable_raw_mode();
    r
}

/// The interactive loop: a table each interval until `q`, Esc or Ctrl-C.
fn live(c: &mut AdminClient, interval: Duration, out: &mut std::io::Stdout) -> Result<()> {
    let mut last = read(c)?;
    let mut next = Instant::now() + interval;
    loop {
        let wait = next.saturating_duration_since(Instant::now());
        if event::poll(wait)? {
            if let Event::Key(KeyEvent {
                code, modifiers, ..
            }) = event::read()?
                && (matches!(code, KeyCode::Char('q') | KeyCode::Esc)
                    || (code == KeyCode::Char('c') && modifiers.contains(KeyModifiers::CONTROL)))
            {
                return Ok(());
            }
            continue;
        }
        next += interval;
        let now = read(c)?;
        let text = table(&last, &now, Some("q: quit"));
        last = now;
        execute!(
            out,
            cursor::MoveTo(0, 0),
            terminal::Clear(terminal::ClearType::All)
        )?;
        // Raw mode: lines end with CR LF.
        for line in text.lines() {
            write!(out, "{line}\r\n")?;
        }
        out.flush()?;
    }
}

/// One reading: when, each vRNIC's summary and counters.
struct Reading {
    at: Instant,
    list: Vec<VnicSummary>,
    stats: HashMap<String, Sample>,
}

fn read(c: &mut AdminClient) -> Result<Reading> {
    let (stats, list) = c.stats_and_list()?;
    Ok(Reading {
        at: Instant::now(),
        list,
        stats: stats
            .iter()
            .map(|s| (s.name.clone(), Sample::of(s)))
            .collect(),
    })
}

/// `n` per second as `12.3K`, `4.56M`.
fn rate(n: f64) -> String {
    for (m, u) in [(1e9, "G"), (1e6, "M"), (1e3, "K")] {
        if n >= m {
            return format!("{:.2}{u}", n / m);
        }
    }
    format!("{n:.0}")
}

/// The table between two readings (rates over the time between them).
fn table(last: &Reading, now: &Reading, footer: Option<&str>) -> String {
    let dt = now.at.duration_since(last.at).as_secs_f64().max(1e-3);
    let mut s = format!(
        "{:<16} {:<12} {:>4} {:>5} {:>9} {:>10} {:>9} {:>10} {:>8} {:>5} {:>7} {:>7}\n",
        "NAME",
        "GROUP",
        "QPS",
        "USERS",
        "TX WR/s",
        "TX B/s",
        "RX MSG/s",
        "RX B/s",
        "ERR/s",
        "QOS%",
        "MAX_BW",
        "MAX_RATE"
    );
    let mut list = now.list.clone();
    list.sort_by(|a, b| a.name.cmp(&b.name));
    for v in &list {
        let a = last.stats.get(&v.name).copied().unwrap_or_default();
        let b = now.stats.get(&v.name).copied().unwrap_or_default();
        let d = |x: u64, y: u64| y.saturating_sub(x) as f64 / dt;
        s.push_str(&format!(
            "{:<16} {:<12} {:>4} {:>5} {:>9} {:>10} {:>9} {:>10} {:>8} {:>5.0} {:>7} {:>7}\n",
            v.name,
            v.group,
            v.qps,
            v.users,
            rate(d(a.tx_wrs, b.tx_wrs)),
            rate(d(a.tx_bytes, b.tx_bytes)),
            rate(d(a.rx_msgs, b.rx_msgs)),
            rate(d(a.rx_bytes, b.rx_bytes)),
            rate(d(a.errors, b.errors)),
            (d(a.qos_us, b.qos_us) / 1e4).min(100.0),
            crate::rate_string(v.max_bw),
            crate::rate_string(v.max_rate)
        ));
    }
    if list.is_empty() {
        s.push_str("(no vRNICs)\n");
    }
    if let Some(f) = footer {
        s.push_str(&format!("\n{} vRNICs, every {dt:.1} s   {f}\n", list.len()));
    }
    s
}
