//! `vrnic bench` as a smoke test: `--quick` runs to its end on private daemons of its own,
//! prints its table, writes JSON whose structure is checked here (every figure a positive
//! number, every limit and ratio too) and two SVG plots; interrupted, it leaves nothing behind.
//! No threshold on any figure: speed is reported, never asserted.

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use common::{Proc, vrnic_bin};
use serde_json::Value;

/// A fresh dir for the outputs, removed at the end.
struct OutDir(PathBuf);

impl OutDir {
    fn new(tag: &str) -> OutDir {
        let d = std::env::temp_dir().join(format!("vrnic-bench-test-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).expect("create the output dir");
        OutDir(d)
    }
}

impl Drop for OutDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// The bench's scratch dir for the bench process `pid`.
fn scratch(pid: i32) -> PathBuf {
    std::env::temp_dir().join(format!("vrnic-bench-{pid}"))
}

/// Processes whose command line names `dir` (what a bench there started).
fn processes_under(dir: &Path) -> Vec<String> {
    let needle = dir.to_string_lossy().into_owned();
    let mut found = Vec::new();
    for e in std::fs::read_dir("/proc").expect("read /proc").flatten() {
        if let Ok(cmd) = std::fs::read(e.path().join("cmdline")) {
            let cmd = String::from_utf8_lossy(&cmd).replace('\0', " ");
            if cmd.contains(&needle) {
                found.push(format!("{}: {cmd}", e.file_name().to_string_lossy()));
            }
        }
    }
    found
}

fn positive(v: &Value, what: &str) -> f64 {
    let x = v
        .as_f64()
        .unwrap_or_else(|| panic!("{what} is not a number: {v}"));
    assert!(x.is_finite() && x > 0.0, "{what} is not positive: {x}");
    x
}

/// The figures of `section` named `name`, from the JSON.
fn figures<'a>(json: &'a Value, section: &str, name: &str) -> Vec<&'a Value> {
    json["figures"]
        .as_array()
        .expect("figures")
        .iter()
        .filter(|f| f["section"] == section && f["name"] == name)
        .collect()
}

/// `vrnic bench --quick --sections SECTIONS EXTRA... --json` into `out_dir`: it must exit 0
/// and write valid JSON with no error. Returns its output, the JSON and its pid.
fn quick_sections(
    out_dir: &OutDir,
    sections: &str,
    extra: &[&str],
) -> (common::Output, Value, i32) {
    let json_path = out_dir.0.join("bench.json");
    let mut cmd = Command::new(vrnic_bin());
    cmd.args(["bench", "--quick", "--sections", sections])
        .args(extra)
        .arg("--json")
        .arg(&json_path);
    let what = format!("vrnic bench --quick --sections {sections}");
    let p = Proc::spawn(cmd, &what);
    let pid = p.pid();
    let out = p.wait(Duration::from_secs(300));
    assert!(out.ok(), "{what} failed\n{}", out.text());
    let json: Value =
        serde_json::from_str(&std::fs::read_to_string(&json_path).expect("the JSON file"))
            .expect("valid JSON");
    assert_eq!(
        json["errors"].as_array().map(Vec::len),
        Some(0),
        "{}",
        json["errors"]
    );
    (out, json, pid)
}

#[test]
fn quick_bench_prints_a_table_and_writes_json_and_plots() {
    common::require("ib_write_bw");
    let out_dir = OutDir::new("quick");
    let json_path = out_dir.0.join("bench.json");
    let svg_dir = out_dir.0.join("svg");
    let mut cmd = Command::new(vrnic_bin());
    cmd.arg("bench")
        .arg("--quick")
        .arg("--json")
        .arg(&json_path)
        .arg("--svg")
        .arg(&svg_dir);
    let p = Proc::spawn(cmd, "vrnic bench --quick");
    let pid = p.pid();
    let out = p.wait(Duration::from_secs(300));
    assert!(out.ok(), "vrnic bench --quick failed\n{}", out.text());

    // The table: a header, the sections, a ratio column.
    for s in [
        "measurement",
        "limit (same run)",
        "[limits]",
        "[bandwidth]",
        "[rate]",
        "[latency]",
        "[control]",
        "ib_write_bw 64 KiB",
        "ib_write_lat 2 B",
    ] {
        assert!(
            out.stdout.contains(s),
            "no {s:?} in the table\n{}",
            out.text()
        );
    }
    assert!(
        out.stdout.contains('%') && out.stdout.contains('x'),
        "no ratios\n{}",
        out.text()
    );

    // The JSON: its structure, and every figure a positive number.
    let text = std::fs::read_to_string(&json_path).expect("the JSON file");
    let json: Value = serde_json::from_str(&text).expect("valid JSON");
    assert_eq!(json["vrnic_bench"], 1);
    assert_eq!(json["options"]["quick"], true);
    assert_eq!(json["options"]["runs"], 1);
    positive(&json["duration_s"], "duration_s");
    positive(&json["machine"]["cpus"], "machine.cpus");
    assert!(json["started"].as_str().is_some_and(|s| s.ends_with('Z')));
    assert_eq!(
        json["errors"].as_array().map(Vec::len),
        Some(0),
        "{}",
        json["errors"]
    );
    let all = json["figures"].as_array().expect("figures");
    assert!(!all.is_empty());
    for f in all {
        let what = format!("{} / {} / {}", f["section"], f["name"], f["size"]);
        let samples = f["samples"].as_array().expect("samples");
        assert_eq!(samples.len(), 1, "{what}: one sample per run");
        for s in samples {
            positive(s, &what);
        }
        for k in ["median", "min", "max"] {
            positive(&f[k], &format!("{what} {k}"));
        }
        assert!(["higher", "lower"].contains(&f["better"].as_str().unwrap_or("")));
        assert!(f["unit"].as_str().is_some_and(|u| !u.is_empty()));
        if !f["limit"].is_null() {
            positive(&f["limit"]["value"], &format!("{what} limit"));
            positive(&f["ratio"], &format!("{what} ratio"));
        }
    }
    // The limits, and each sweep from 2 B to 8 MiB against them.
    assert_eq!(
        figures(&json, "limits", "cache-line round trip, two processes").len(),
        1
    );
    assert!(figures(&json, "limits", "memcpy, one thread").len() >= 23);
    for (section, prog) in [
        ("bandwidth", "ib_write_bw"),
        ("bandwidth", "ib_read_bw"),
        ("bandwidth", "ib_send_bw"),
        ("latency", "ib_write_lat"),
    ] {
        let fs = figures(&json, section, prog);
        let sizes: Vec<u64> = fs.iter().filter_map(|f| f["size"].as_u64()).collect();
        assert!(
            sizes.contains(&2) && sizes.contains(&(8 << 20)),
            "{prog}: sizes {sizes:?}"
        );
        assert!(
            fs.iter().all(|f| !f["limit"].is_null()),
            "{prog}: a size without its limit"
        );
    }
    // With --quick the other latency programs measure 2 B (atomics 8 B).
    for prog in ["ib_send_lat", "ib_read_lat"] {
        let fs = figures(&json, "latency", prog);
        assert!(fs.iter().any(|f| f["size"] == 2), "{prog}: no 2 B figure");
    }
    assert_eq!(figures(&json, "latency", "ib_atomic_lat").len(), 1);
    assert_eq!(
        figures(&json, "rate", "ib_write_bw -s 2 message rate").len(),
        1
    );
    let control = all.iter().filter(|f| f["section"] == "control").count();
    assert_eq!(control, 6, "the six control-path steps");

    // The plots.
    for name in ["bandwidth.svg", "latency.svg"] {
        let svg = std::fs::read_to_string(svg_dir.join(name)).expect("an SVG file");
        assert!(
            svg.starts_with("<svg") && svg.trim_end().ends_with("</svg>"),
            "{name}"
        );
        assert!(svg.contains("<polyline"), "{name} has no lines");
    }

    // Nothing left behind.
    assert!(
        !scratch(pid).exists(),
        "{} is still there",
        scratch(pid).display()
    );
    assert_eq!(processes_under(&scratch(pid)), Vec::<String>::new());
}

#[test]
fn interrupted_bench_stops_what_it_started_and_removes_its_files() {
    common::require("ib_write_bw");
    let mut cmd = Command::new(vrnic_bin());
    cmd.args(["bench", "--quick", "--sections", "ctrl"]);
    let mut p = Proc::spawn(cmd, "vrnic bench --quick --sections ctrl");
    let dir = scratch(p.pid());
    // Interrupt it once its daemon runs and an app is attached (the control-path program).
    let start = Instant::now();
    // The program itself (after `vrnic run` exec'd it), not `cc` building it.
    let ctrl = format!(": {}/tools/ctrl ", dir.display());
    while !processes_under(&dir).iter().any(|c| c.contains(&ctrl)) {
        assert!(
            !p.exited() && start.elapsed() < Duration::from_secs(60),
            "the bench ended or did not start its daemon and app in time"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    p.signal(libc::SIGINT);
    let out = p.wait(Duration::from_secs(30));
    assert_eq!(
        out.status.code(),
        Some(128 + libc::SIGINT),
        "{}",
        out.text()
    );
    assert!(!dir.exists(), "{} is still there", dir.display());
    // Its children may take a moment to be reaped by init once killed.
    let start = Instant::now();
    while !processes_under(&dir).is_empty() && start.elapsed() < Duration::from_secs(5) {
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_eq!(processes_under(&dir), Vec::<String>::new());
    let mounts = std::fs::read_to_string("/proc/self/mounts").expect("read /proc/self/mounts");
    assert!(
        !mounts.contains(&*dir.to_string_lossy()),
        "a mount under {} is left:\n{mounts}",
        dir.display()
    );
}

/// The scale runs start their pairs behind a barrier (each client stopped at perftest's result
/// header, then all continued at once): a quick run of two pairs, on a daemon with one engine
/// thread and on one with two (`--engine-threads 1,2`), gets through it and reports each
/// aggregate beside its limit, and the second against the first, with no error and nothing
/// of it left running.
#[test]
fn quick_scale_run_passes_its_start_barrier() {
    common::require("ib_write_bw");
    common::require("stdbuf");
    let out_dir = OutDir::new("scale");
    let extra = ["--pairs", "2", "--engine-threads", "1,2"];
    let (out, json, pid) = quick_sections(&out_dir, "scale", &extra);
    for threads in ["1 engine thread", "2 engine threads"] {
        let name = format!("2 pairs ib_write_bw 128 KiB, {threads}, aggregate by wall clock");
        let f = figures(&json, "scale", &name);
        assert_eq!(f.len(), 1, "{name}\n{}", out.text());
        positive(&f[0]["median"], "the 2-pair aggregate");
        positive(&f[0]["limit"]["value"], "its memcpy limit");
    }
    assert!(
        out.stdout
            .contains("scale: best aggregate, 2 engine threads"),
        "no comparison of the engine-thread counts\n{}",
        out.text()
    );
    let left = processes_under(&scratch(pid));
    assert!(left.is_empty(), "left running: {left:?}");
}

/// The many-vRNICs and fairness runs with tiny counts: their rows in the table and the JSON,
/// the counts held as asked (every vRNIC holding its QP in `vrnic ls`, the idle QPs counted
/// there), each round trip beside the idle one of the same run, no error, and nothing of it
/// left running or mounted.
#[test]
fn quick_vnics_and_fairness_hold_their_counts_and_leave_nothing_behind() {
    common::require("ib_read_bw");
    common::require("ibv_rc_pingpong");
    common::require("stdbuf");
    let out_dir = OutDir::new("fairness");
    let extra = ["--vnics", "3", "--idle-qps", "50", "--flood-pairs", "1"];
    let (out, json, pid) = quick_sections(&out_dir, "vnics,fairness", &extra);
    let idle = "ibv_rc_pingpong 64 B round trip, idle daemon";
    let beside_idle = "ibv_rc_pingpong 64 B round trip, 50 idle QPs on another vRNIC";
    let beside_flood = "ibv_rc_pingpong 64 B round trip, 1 ib_read_bw -e -q 16 1 MiB pair flooding";
    for s in [
        "[vnics]",
        "3 vRNICs: vrnic create, each",
        "3 vRNICs: attach + PD + CQ + QP, each",
        "3 vRNICs: holding a QP (vrnic ls)",
        "[fairness]",
        idle,
        beside_idle,
        beside_flood,
    ] {
        assert!(
            out.stdout.contains(s),
            "no {s:?} in the table\n{}",
            out.text()
        );
    }

    let o = &json["options"];
    assert_eq!(
        (&o["vnics"], &o["idle_qps"], &o["flood_pairs"]),
        (&Value::from(3), &Value::from(50), &Value::from(1))
    );
    assert_eq!(o["sections"], serde_json::json!(["vnics", "fairness"]));
    let one = |section: &str, name: &str| -> Value {
        let f = figures(&json, section, name);
        assert_eq!(f.len(), 1, "{section} / {name}\n{}", out.text());
        f[0].clone()
    };

    // Every vRNIC made held its QP, beside the count made.
    let held = one("vnics", "3 vRNICs: holding a QP (vrnic ls)");
    assert_eq!(held["median"], 3.0, "{held}");
    assert_eq!(held["limit"]["value"], 3.0, "{held}");
    assert_eq!(held["ratio"], 1.0, "{held}");
    for name in [
        "3 vRNICs: vrnic create, each",
        "3 vRNICs: attach + PD + CQ + QP, each (all at once)",
        "3 vRNICs: region pages, each",
    ] {
        positive(&one("vnics", name)["median"], name);
    }
    let rss = one("vnics", "3 vRNICs: daemon memory (RSS), each");
    assert!(rss["median"].as_f64().is_some_and(f64::is_finite), "{rss}");

    // The idle QPs were all there while the round trip beside them was measured.
    let qps = one(
        "fairness",
        "50 idle QPs on another vRNIC: QPs held (vrnic ls)",
    );
    assert_eq!(qps["median"], 50.0, "{qps}");
    // Each round trip, the last two beside the idle one of the same run.
    let idle_us = positive(&one("fairness", idle)["median"], idle);
    for name in [beside_idle, beside_flood] {
        let f = one("fairness", name);
        let us = positive(&f["median"], name);
        assert_eq!(f["limit"]["value"], idle_us, "{name}: {f}");
        let ratio = positive(&f["ratio"], name);
        assert!((ratio - us / idle_us).abs() < 1e-9, "{name}: {f}");
    }

    // Nothing left behind.
    let dir = scratch(pid);
    assert!(!dir.exists(), "{} is still there", dir.display());
    let left = processes_under(&dir);
    assert!(left.is_empty(), "left running: {left:?}");
    let mounts = std::fs::read_to_string("/proc/self/mounts").expect("read /proc/self/mounts");
    assert!(
        !mounts.contains(&*dir.to_string_lossy()),
        "a mount under {} is left:\n{mounts}",
        dir.display()
    );
}

/// The UCX section: unmodified `ucx_perftest` over vrnic's `rc_verbs`, UCX's shared memory
/// and its TCP, each row in the table and the JSON, vrnic's and TCP's beside shared memory of
/// the same run, no error, and nothing of it left running.
#[test]
fn quick_ucx_section_sets_vrnic_beside_ucx_s_own_transports() {
    common::require("ucx_perftest");
    let out_dir = OutDir::new("ucx");
    let (out, json, pid) = quick_sections(&out_dir, "ucx", &[]);
    for (test, size) in [("tag_lat", 8u64), ("tag_bw", 1 << 20)] {
        let sm = figures(&json, "ucx", &format!("{test}, UCX shared memory (sm)"));
        assert_eq!(sm.len(), 1, "{test} over sm\n{}", out.text());
        let sm = positive(&sm[0]["median"], "sm");
        for t in ["UCX over vrnic (rc_verbs)", "UCX TCP (tcp)"] {
            let name = format!("{test}, {t}");
            let f = figures(&json, "ucx", &name);
            assert_eq!(f.len(), 1, "{name}\n{}", out.text());
            assert_eq!(f[0]["size"], size, "{name}");
            let v = positive(&f[0]["median"], &name);
            assert_eq!(f[0]["limit"]["value"].as_f64(), Some(sm), "{name}");
            let ratio = f[0]["ratio"].as_f64().expect("a ratio");
            assert!(
                (ratio - v / sm).abs() < 1e-9 * ratio.max(1.0),
                "{name}: {ratio}"
            );
            assert!(
                out.stdout.contains(&name),
                "no {name:?} in the table\n{}",
                out.text()
            );
        }
    }
    assert!(
        processes_under(&scratch(pid)).is_empty(),
        "left running: {:?}",
        processes_under(&scratch(pid))
    );
}
