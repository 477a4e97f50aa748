//! Two plots, written by hand as SVG (no plotting dependency): `bandwidth.svg`, each bandwidth
//! sweep's medians against message size with the memcpy line, and `latency.svg`, each latency
//! sweep against size with the cache-line floor (plus one copy). Both axes are logarithmic.

use std::fmt::Write as _;
use std::path::Path;

use anyhow::{Context, Result};

use super::limits::{MEMCPY, RTT};
use super::perftest::{BW_PROGRAMS, ONE_WAY, ROUND_TRIP};
use super::report::{Report, num, size_text};

/// A line on a plot.
struct Series {
    label: String,
    points: Vec<(f64, f64)>,
    /// A limit (dashed) rather than a measurement.
    dashed: bool,
}

const COLORS: [&str; 6] = [
    "#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b",
];
const W: f64 = 900.0;
const H: f64 = 500.0;
const LEFT: f64 = 80.0;
const RIGHT: f64 = 300.0;
const TOP: f64 = 40.0;
const BOTTOM: f64 = 60.0;

/// Writes `bandwidth.svg` and `latency.svg` into `dir` (made if missing); returns their paths.
pub fn write(report: &Report, dir: &Path) -> Result<Vec<std::path::PathBuf>> {
    std::fs::create_dir_all(dir).with_context(|| format!("create {}", dir.display()))?;
    let sweep = |section: &str, name: &str| -> Vec<(f64, f64)> {
        report
            .figures
            .iter()
            .filter(|f| f.section == section && f.name == name && f.median.is_finite())
            .filter_map(|f| Some((f.size? as f64, f.median)))
            .filter(|&(x, _)| x <= (8 << 20) as f64)
            .collect()
    };
    let mut bw: Vec<Series> = BW_PROGRAMS
        .iter()
        .map(|p| Series {
            label: p.to_string(),
            points: sweep("bandwidth", p),
            dashed: false,
        })
        .collect();
    let memcpy = sweep("limits", MEMCPY);
    bw.push(Series {
        label: "memcpy, one thread (limit)".into(),
        points: memcpy.clone(),
        dashed: true,
    });
    let mut lat: Vec<Series> = ONE_WAY
        .iter()
        .chain(&ROUND_TRIP)
        .map(|p| Series {
            label: p.to_string(),
            points: sweep("latency", p),
            dashed: false,
        })
        .collect();
    if let Some(rtt_ns) = report.median("limits", RTT, None) {
        for (share, label) in [
            (0.5, "floor: half cache-line RTT + copy"),
            (1.0, "floor: cache-line RTT + copy"),
        ] {
            lat.push(Series {
                label: label.into(),
                points: memcpy
                    .iter()
                    .map(|&(s, mc)| (s, rtt_ns * share / 1000.0 + s / mc))
                    .collect(),
                dashed: true,
            });
        }
    }
    let mut paths = Vec::new();
    for (file, title, unit, series) in [
        (
            "bandwidth.svg",
            "Bandwidth against message size",
            "MB/s",
            bw,
        ),
        ("latency.svg", "Latency against message size", "us", lat),
    ] {
        let path = dir.join(file);
        std::fs::write(&path, plot(title, unit, &series))
            .with_context(|| format!("write {}", path.display()))?;
        paths.push(path);
    }
    Ok(paths)
}

/// Escapes text for SVG.
fn esc(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}

/// A log-log plot of `series` (x: bytes, y: `unit`).
fn plot(title: &str, unit: &str, series: &[Series]) -> String {
    let pts = series
        .iter()
        .flat_map(|s| s.points.iter())
        .filter(|p| p.0 > 0.0 && p.1 > 0.0);
    let (mut x0, mut x1, mut y0, mut y1) = (f64::MAX, f64::MIN, f64::MAX, f64::MIN);
    for &(x, y) in pts {
        x0 = x0.min(x);
        x1 = x1.max(x);
        y0 = y0.min(y);
        y1 = y1.max(y);
    }
    let mut s = String::new();
    let _ = writeln!(
        s,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" viewBox="0 0 {W} {H}" font-family="sans-serif" font-size="12">"#
    );
    let _ = writeln!(s, r#"<rect width="{W}" height="{H}" fill="white"/>"#);
    let _ = writeln!(
        s,
        r#"<text x="{}" y="24" font-size="16" text-anchor="middle">{}</text>"#,
        LEFT + (W - LEFT - RIGHT) / 2.0,
        esc(title)
    );
    if x0 > x1 {
        let _ = writeln!(s, r#"<text x="{LEFT}" y="{}">no data</text>"#, H / 2.0);
        s.push_str("</svg>\n");
        return s;
    }
    let (lx0, lx1) = (
        x0.log2().floor(),
        x1.log2().ceil().max(x0.log2().floor() + 1.0),
    );
    let (ly0, ly1) = (
        y0.log10().floor(),
        y1.log10().ceil().max(y0.log10().floor() + 1.0),
    );
    let (pw, ph) = (W - LEFT - RIGHT, H - TOP - BOTTOM);
    let px = |x: f64| LEFT + (x.log2() - lx0) / (lx1 - lx0) * pw;
    let py = |y: f64| TOP + ph - (y.log10() - ly0) / (ly1 - ly0) * ph;
    // Grid and ticks: every power of two on x (labelled every third), every decade on y.
    for e in (lx0 as i64)..=(lx1 as i64) {
        let x = px((e as f64).exp2());
        let _ = writeln!(
            s,
            r##"<line x1="{x:.1}" y1="{TOP}" x2="{x:.1}" y2="{:.1}" stroke="#eee"/>"##,
            TOP + ph
        );
        if e % 3 == 1 {
            let _ = writeln!(
                s,
                r#"<text x="{x:.1}" y="{:.1}" text-anchor="middle">{}</text>"#,
                TOP + ph + 18.0,
                size_text(1u64 << e.clamp(0, 62))
            );
        }
    }
    for e in (ly0 as i64)..=(ly1 as i64) {
        let v = 10f64.powi(e as i32);
        let y = py(v);
        let _ = writeln!(
            s,
            r##"<line x1="{LEFT}" y1="{y:.1}" x2="{:.1}" y2="{y:.1}" stroke="#ddd"/>"##,
            LEFT + pw
        );
        let _ = writeln!(
            s,
            r#"<text x="{:.1}" y="{:.1}" text-anchor="end">{}</text>"#,
            LEFT - 6.0,
            y + 4.0,
            num(v)
        );
    }
    let _ = writeln!(
        s,
        r#"<rect x="{LEFT}" y="{TOP}" width="{pw}" height="{ph}" fill="none" stroke="black"/>"#
    );
    let _ = writeln!(
        s,
        r#"<text x="{:.1}" y="{:.1}" text-anchor="middle">message size</text>"#,
        LEFT + pw / 2.0,
        H - 16.0
    );
    let _ = writeln!(
        s,
        r#"<text x="18" y="{:.1}" text-anchor="middle" transform="rotate(-90 18 {:.1})">{}</text>"#,
        TOP + ph / 2.0,
        TOP + ph / 2.0,
        esc(unit)
    );
    for (i, ser) in series.iter().enumerate() {
        let color = COLORS[i % COLORS.len()];
        let dash = if ser.dashed {
            r#" stroke-dasharray="6 4""#
        } else {
            ""
        };
        let pts: Vec<String> = ser
            .points
            .iter()
            .filter(|p| p.0 > 0.0 && p.1 > 0.0)
            .map(|&(x, y)| format!("{:.1},{:.1}", px(x), py(y)))
            .collect();
        if pts.len() > 1 {
            let _ = writeln!(
                s,
                r#"<polyline points="{}" fill="none" stroke="{color}" stroke-width="2"{dash}/>"#,
                pts.join(" ")
            );
        }
        if !ser.dashed {
            for p in &pts {
                let (cx, cy) = p.split_once(',').unwrap_or(("0", "0"));
                let _ = writeln!(s, r#"<circle cx="{cx}" cy="{cy}" r="3" fill="{color}"/>"#);
            }
        }
        let ly = TOP + 10.0 + i as f64 * 20.0;
        let lx = LEFT + pw + 14.0;
        let _ = writeln!(
            s,
            r#"<line x1="{lx}" y1="{ly}" x2="{}" y2="{ly}" stroke="{color}" stroke-width="2"{dash}/>"#,
            lx + 24.0
        );
        let _ = writeln!(
            s,
            r#"<text x="{}" y="{}">{}</text>"#,
            lx + 30.0,
            ly + 4.0,
            esc(&ser.label)
        );
    }
    s.push_str("</svg>\n");
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_plot_is_one_svg_element_with_its_lines() {
        let s = plot(
            "t",
            "MB/s",
            &[Series {
                label: "a<b".into(),
                points: vec![(2.0, 10.0), (1024.0, 5000.0)],
                dashed: false,
            }],
        );
        assert!(s.starts_with("<svg") && s.trim_end().ends_with("</svg>"));
        assert!(s.contains("<polyline") && s.contains("a&lt;b"));
        assert_eq!(s.matches("<svg").count(), 1);
    }
}
