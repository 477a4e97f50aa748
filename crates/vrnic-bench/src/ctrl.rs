//! The control path through the driver library (`bench/ctrl.c` under `vrnic run`): open the
//! device, register 1 MiB and 1 GiB (fresh memory, and memory the app wrote), create a QP and
//! bring it to RTS.
//!
//! Registering memory the app wrote copies it into the vRNIC's region pages, so its limit is
//! one copy of that many bytes at memcpy speed measured in the same run (the 1 GiB one at the
//! streaming speed, past the caches). Opening the device, a QP to RTS and registering fresh
//! memory have no physical limit to measure; they are shown against the targets,
//! marked as targets.

use std::time::Duration;

use anyhow::Result;

use super::Ctx;
use super::limits::{MEMCPY, STREAM_SIZE};
use super::procs::{Daemon, Stop};
use super::report::{Better, Limit, Report};

/// ctrl.c's line names, the figure each becomes, and its unit's scale from microseconds.
const STEPS: [(&str, &str, &str, f64); 6] = [
    ("open_device", "open the device", "us", 1.0),
    (
        "create_qp_to_rts",
        "create a QP and bring it to RTS",
        "us",
        1.0,
    ),
    (
        "reg_mr_1MiB_fresh",
        "register 1 MiB, fresh memory",
        "us",
        1.0,
    ),
    (
        "reg_mr_1MiB_written",
        "register 1 MiB the app wrote",
        "us",
        1.0,
    ),
    (
        "reg_mr_1GiB_fresh",
        "register 1 GiB, fresh memory",
        "ms",
        1e-3,
    ),
    (
        "reg_mr_1GiB_written",
        "register 1 GiB the app wrote",
        "ms",
        1e-3,
    ),
];

/// One run of `ctrl` (which takes the median of its own repetitions) into `report`.
pub fn measure(ctx: &Ctx, d: &Daemon, report: &mut Report) {
    if let Err(e) = run(ctx, d, report) {
        report.error("control path (bench/ctrl.c)", e);
    }
}

fn run(ctx: &Ctx, d: &Daemon, report: &mut Report) -> Result<()> {
    let reps = if ctx.quick { "1" } else { "3" };
    let prog = ctx.tools.ctrl.display().to_string();
    let cmd = d.run(ctx.app(0), &[prog, reps.to_string()]);
    let p = ctx.scratch.spawn(cmd, "ctrl", Stop::Kill)?;
    let f = p.finish(Duration::from_secs(300));
    f.check("ctrl")?;
    for line in f.stdout.lines() {
        let mut w = line.split_whitespace();
        let (Some(key), Some(us)) = (w.next(), w.next().and_then(|v| v.parse::<f64>().ok())) else {
            continue;
        };
        if let Some(&(_, name, unit, scale)) = STEPS.iter().find(|s| s.0 == key) {
            report
                .sample("control", name, None, unit, Better::Lower, us * scale)
                .shown = true;
        }
    }
    Ok(())
}

/// Sets the limits of the control figures.
pub fn set_limits(report: &mut Report) {
    let target = |value| Limit {
        what: "target".into(),
        value,
        measured: false,
    };
    report.limit("control", STEPS[1].1, None, target(100.0));
    report.limit("control", STEPS[4].1, None, target(100.0));
    // 1 MB/s is one byte per microsecond.
    if let Some(mc) = report.median("limits", MEMCPY, Some(1 << 20)) {
        let l = Limit {
            what: "one copy at memcpy speed".into(),
            value: (1u64 << 20) as f64 / mc,
            measured: true,
        };
        report.limit("control", STEPS[3].1, None, l);
    }
    if let Some(mc) = report.median("limits", MEMCPY, Some(STREAM_SIZE)) {
        let l = Limit {
            what: "one copy at 64 MiB memcpy speed".into(),
            value: (1u64 << 30) as f64 / mc / 1000.0,
            measured: true,
        };
        report.limit("control", STEPS[5].1, None, l);
    }
}
