//! The programs the bench runs: its own small C programs (`bench/*.c`, built into this binary
//! and compiled with the system's `cc` at run time, so the bench needs no source tree), and
//! the Debian tools it measures (perftest, ibverbs-utils, iperf3), found on `PATH`.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result, bail};

/// What to install when something is missing.
pub const INSTALL: &str = "apt-get install -y perftest ibverbs-utils iperf3 gcc libibverbs-dev";

/// One of the bench's C programs: its name, source, and the libraries it links.
struct Source {
    name: &'static str,
    text: &'static str,
    libs: &'static [&'static str],
}

const SOURCES: [Source; 5] = [
    Source {
        name: "limits",
        text: include_str!("../../../bench/limits.c"),
        libs: &[],
    },
    Source {
        name: "ctrl",
        text: include_str!("../../../bench/ctrl.c"),
        libs: &["-libverbs"],
    },
    Source {
        name: "tcp_stream",
        text: include_str!("../../../bench/tcp_stream.c"),
        libs: &[],
    },
    Source {
        name: "tcp_pingpong",
        text: include_str!("../../../bench/tcp_pingpong.c"),
        libs: &[],
    },
    Source {
        name: "holdqp",
        text: include_str!("../../../bench/holdqp.c"),
        libs: &["-libverbs"],
    },
];

/// The compiled C programs.
pub struct Tools {
    pub limits: PathBuf,
    pub ctrl: PathBuf,
    pub tcp_stream: PathBuf,
    pub tcp_pingpong: PathBuf,
    pub holdqp: PathBuf,
}

impl Tools {
    /// Compiles every program into `dir` with `cc -O2`.
    pub fn build(dir: &Path) -> Result<Tools> {
        std::fs::create_dir_all(dir).with_context(|| format!("create {}", dir.display()))?;
        let mut out = Vec::new();
        for s in &SOURCES {
            let src = dir.join(format!("{}.c", s.name));
            let bin = dir.join(s.name);
            std::fs::write(&src, s.text).with_context(|| format!("write {}", src.display()))?;
            let cc = Command::new("cc")
                .args(["-O2", "-o"])
                .arg(&bin)
                .arg(&src)
                .args(s.libs)
                .output()
                .with_context(|| format!("cannot run cc ({INSTALL})"))?;
            if !cc.status.success() {
                bail!(
                    "compiling bench/{}.c failed ({INSTALL}):\n{}",
                    s.name,
                    String::from_utf8_lossy(&cc.stderr)
                );
            }
            out.push(bin);
        }
        let [limits, ctrl, tcp_stream, tcp_pingpong, holdqp] =
            <[PathBuf; 5]>::try_from(out).expect("one binary per source");
        Ok(Tools {
            limits,
            ctrl,
            tcp_stream,
            tcp_pingpong,
            holdqp,
        })
    }
}

/// Whether `tool` is on `PATH`.
pub fn have(tool: &str) -> bool {
    std::env::var_os("PATH")
        .is_some_and(|path| std::env::split_paths(&path).any(|d| d.join(tool).is_file()))
}

/// An error naming the missing tools, if any of `tools` is not on `PATH`.
pub fn require(tools: &[&str]) -> Result<()> {
    let missing: Vec<&str> = tools.iter().copied().filter(|t| !have(t)).collect();
    if !missing.is_empty() {
        bail!("{} not found on PATH ({INSTALL})", missing.join(", "));
    }
    Ok(())
}
