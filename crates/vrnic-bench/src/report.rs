//! Figures and their limits, the table printed at the end, and the JSON file.
//!
//! A [`Figure`] is one measurement (a program at a size, a control-path step, a limit) with a
//! sample per run; its median is what the table shows, with min..max beside it, and, when it
//! has a [`Limit`], the ratio median / limit: a share (`73%`) where more is better, a multiple
//! (`2.5x`) where less is.

use std::fmt::Write as _;

use serde::Serialize;

/// What the table's last column means, printed under it.
pub const RATIO_LEGEND: &str = "vs limit: the median against its limit. N% where higher is \
better (bandwidth, rates; 100% = the limit, which vrnic cannot pass); Nx where lower is better \
(times; 1x = the limit, 2x = twice as slow). A limit named `target` is a goal vrnic is held \
to, not a figure measured in this run.";

/// Whether a larger figure is better (bandwidth, rates) or a smaller one (times).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Better {
    Higher,
    Lower,
}

/// What a figure is compared against.
#[derive(Clone, Debug, Serialize)]
pub struct Limit {
    /// What the limit is ("memcpy 64 KiB"; "target" for a target).
    pub what: String,
    /// Its value, in the figure's unit.
    pub value: f64,
    /// Measured in this run (true), or a target from the issue tracker (false).
    pub measured: bool,
}

/// One measurement, a sample per run.
#[derive(Clone, Debug, Serialize)]
pub struct Figure {
    /// Its group: `limits`, `bandwidth`, `rate`, `latency`, `control`, `scale`, `vnics`,
    /// `fairness`, `hosts`, `ucx`.
    pub section: &'static str,
    /// What was measured (a program, a step).
    pub name: String,
    /// The message size in bytes, for the sweeps.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub size: Option<u64>,
    /// Concurrent pairs, for the scale runs.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub pairs: Option<u32>,
    pub unit: &'static str,
    pub better: Better,
    /// One per run, in run order.
    pub samples: Vec<f64>,
    pub median: f64,
    pub min: f64,
    pub max: f64,
    pub limit: Option<Limit>,
    /// median / limit.
    pub ratio: Option<f64>,
    /// Shown in the table (every figure is in the JSON).
    #[serde(skip)]
    pub shown: bool,
}

/// Every figure of a bench run, and what went wrong.
#[derive(Default, Serialize)]
pub struct Report {
    pub figures: Vec<Figure>,
    /// Sentences printed under the table (derived figures, targets).
    pub notes: Vec<String>,
    /// Measurements that failed (the rest of the run went on).
    pub errors: Vec<String>,
}

/// The median (the lower one of an even count, as the scripts took it), min and max.
pub fn stats(samples: &[f64]) -> (f64, f64, f64) {
    let mut v: Vec<f64> = samples.iter().copied().filter(|x| x.is_finite()).collect();
    if v.is_empty() {
        return (f64::NAN, f64::NAN, f64::NAN);
    }
    v.sort_by(f64::total_cmp);
    (v[(v.len() - 1) / 2], v[0], v[v.len() - 1])
}

impl Report {
    /// Adds a sample to the figure (`section`, `name`, `size`), made on first use.
    pub fn sample(
        &mut self,
        section: &'static str,
        name: &str,
        size: Option<u64>,
        unit: &'static str,
        better: Better,
        value: f64,
    ) -> &mut Figure {
        let i = match self.position(section, name, size) {
            Some(i) => i,
            None => {
                self.figures.push(Figure {
                    section,
                    name: name.to_string(),
                    size,
                    pairs: None,
                    unit,
                    better,
                    samples: Vec::new(),
                    median: f64::NAN,
                    min: f64::NAN,
                    max: f64::NAN,
                    limit: None,
                    ratio: None,
                    shown: false,
                });
                self.figures.len() - 1
            }
        };
        let f = &mut self.figures[i];
        f.samples.push(value);
        (f.median, f.min, f.max) = stats(&f.samples);
        f
    }

    fn position(&self, section: &str, name: &str, size: Option<u64>) -> Option<usize> {
        self.figures
            .iter()
            .position(|f| f.section == section && f.name == name && f.size == size)
    }

    /// The figure (`section`, `name`, `size`), if it has samples.
    pub fn get(&self, section: &str, name: &str, size: Option<u64>) -> Option<&Figure> {
        self.position(section, name, size)
            .map(|i| &self.figures[i])
            .filter(|f| f.median.is_finite())
    }

    /// The median of (`section`, `name`, `size`), if measured.
    pub fn median(&self, section: &str, name: &str, size: Option<u64>) -> Option<f64> {
        self.get(section, name, size).map(|f| f.median)
    }

    /// Sets a figure's limit (and its ratio), if the figure exists.
    pub fn limit(&mut self, section: &str, name: &str, size: Option<u64>, limit: Limit) {
        if let Some(i) = self.position(section, name, size) {
            let f = &mut self.figures[i];
            f.ratio = (limit.value > 0.0 && f.median.is_finite()).then(|| f.median / limit.value);
            f.limit = Some(limit);
        }
    }

    /// Records a failed measurement and says so on stderr at once.
    pub fn error(&mut self, what: &str, e: anyhow::Error) {
        let msg = format!("{what}: {e:#}");
        eprintln!("vrnic bench: {msg}");
        self.errors.push(msg);
    }

    /// The table: a block per section, a row per shown figure.
    pub fn table(&self) -> String {
        let mut rows: Vec<[String; 5]> = Vec::new();
        let mut section = "";
        for f in self.figures.iter().filter(|f| f.shown) {
            if f.section != section {
                section = f.section;
                rows.push([
                    format!("[{section}]"),
                    "".into(),
                    "".into(),
                    "".into(),
                    "".into(),
                ]);
            }
            let name = match f.size {
                Some(s) => format!("{} {}", f.name, size_text(s)),
                None => f.name.clone(),
            };
            let spread = if f.samples.len() > 1 {
                format!("{}..{}", num(f.min), num(f.max))
            } else {
                String::new()
            };
            let (limit, ratio) = match (&f.limit, f.ratio) {
                (Some(l), Some(r)) => (
                    format!("{} {} {}", l.what, num(l.value), f.unit),
                    match f.better {
                        Better::Higher => format!("{:.0}%", r * 100.0),
                        Better::Lower => format!("{}x", num(r)),
                    },
                ),
                _ => (String::new(), String::new()),
            };
            rows.push([
                format!("  {name}"),
                format!("{} {}", num(f.median), f.unit),
                spread,
                limit,
                ratio,
            ]);
        }
        let heads = [
            "measurement",
            "median",
            "min..max",
            "limit (same run)",
            "vs limit",
        ];
        let mut w = heads.map(str::len);
        for r in &rows {
            if r[1].is_empty() {
                continue; // a section heading spans the columns
            }
            for (i, c) in r.iter().enumerate() {
                w[i] = w[i].max(c.chars().count());
            }
        }
        let mut out = String::new();
        let line = |out: &mut String, r: &[String; 5]| {
            let _ = writeln!(
                out,
                "{:<w0$}  {:>w1$}  {:<w2$}  {:<w3$}  {:>w4$}",
                r[0],
                r[1],
                r[2],
                r[3],
                r[4],
                w0 = w[0],
                w1 = w[1],
                w2 = w[2],
                w3 = w[3],
                w4 = w[4]
            );
        };
        line(&mut out, &heads.map(String::from));
        for r in &rows {
            if r[1].is_empty() {
                let _ = writeln!(out, "{}", r[0]);
            } else {
                line(&mut out, r);
            }
        }
        if rows.iter().any(|r| !r[4].is_empty()) {
            let _ = writeln!(out, "{RATIO_LEGEND}");
        }
        for n in &self.notes {
            let _ = writeln!(out, "{n}");
        }
        if !self.errors.is_empty() {
            let _ = writeln!(out, "{} measurement(s) failed:", self.errors.len());
            for e in &self.errors {
                let _ = writeln!(out, "  {}", e.lines().next().unwrap_or(""));
            }
        }
        out
    }
}

/// A figure as the table prints it: thousands separated from 1,000 up, fewer decimals as it
/// grows.
pub fn num(v: f64) -> String {
    if !v.is_finite() {
        return "-".into();
    }
    let a = v.abs();
    if a >= 1000.0 {
        let digits = format!("{:.0}", a);
        let mut s = String::new();
        for (i, c) in digits.chars().enumerate() {
            if i > 0 && (digits.len() - i).is_multiple_of(3) {
                s.push(',');
            }
            s.push(c);
        }
        if v < 0.0 { format!("-{s}") } else { s }
    } else if a >= 100.0 {
        format!("{v:.0}")
    } else if a >= 10.0 {
        format!("{v:.1}")
    } else if a >= 1.0 {
        format!("{v:.2}")
    } else {
        format!("{v:.3}")
    }
}

/// `2 B`, `64 KiB`, `8 MiB`.
pub fn size_text(bytes: u64) -> String {
    const UNITS: [(u64, &str); 3] = [(1 << 30, "GiB"), (1 << 20, "MiB"), (1 << 10, "KiB")];
    for (u, name) in UNITS {
        if bytes >= u && bytes.is_multiple_of(u) {
            return format!("{} {name}", bytes / u);
        }
    }
    format!("{bytes} B")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stats_take_the_lower_median() {
        assert_eq!(stats(&[3.0, 1.0, 2.0]), (2.0, 1.0, 3.0));
        assert_eq!(stats(&[4.0, 1.0, 2.0, 3.0]), (2.0, 1.0, 4.0));
        assert!(stats(&[]).0.is_nan());
    }

    #[test]
    fn numbers_and_sizes_read_well() {
        assert_eq!(num(41911.4), "41,911");
        assert_eq!(num(1234567.0), "1,234,567");
        assert_eq!(num(116.2), "116");
        assert_eq!(num(2.494), "2.49");
        assert_eq!(num(0.0391), "0.039");
        assert_eq!(size_text(2), "2 B");
        assert_eq!(size_text(65536), "64 KiB");
        assert_eq!(size_text(8 << 20), "8 MiB");
        assert_eq!(size_text(3000), "3000 B");
    }

    #[test]
    fn ratios_follow_the_limit() {
        let mut r = Report::default();
        r.sample(
            "bandwidth",
            "ib_write_bw",
            Some(65536),
            "MB/s",
            Better::Higher,
            30.0,
        );
        r.sample(
            "bandwidth",
            "ib_write_bw",
            Some(65536),
            "MB/s",
            Better::Higher,
            40.0,
        );
        r.sample(
            "bandwidth",
            "ib_write_bw",
            Some(65536),
            "MB/s",
            Better::Higher,
            50.0,
        )
        .shown = true;
        r.limit(
            "bandwidth",
            "ib_write_bw",
            Some(65536),
            Limit {
                what: "memcpy".into(),
                value: 80.0,
                measured: true,
            },
        );
        let f = r.get("bandwidth", "ib_write_bw", Some(65536)).unwrap();
        assert_eq!(
            (f.median, f.min, f.max, f.ratio),
            (40.0, 30.0, 50.0, Some(0.5))
        );
        let t = r.table();
        assert!(t.contains("ib_write_bw 64 KiB") && t.contains("50%"), "{t}");
        assert!(
            t.contains("vs limit") && t.contains("N% where higher is better"),
            "{t}"
        );
        assert!(t.contains("Nx where lower is better"), "{t}");
    }
}
