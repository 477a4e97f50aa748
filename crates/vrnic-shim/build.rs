//! Writes the ELF version script and the `.symver` table from `src/exports.txt`, so the
//! driver library's symbols carry rdma-core's versions (`ibv_reg_mr@@IBVERBS_1.1`,
//! `rdma_connect@@RDMACM_1.0`).

use std::fmt::Write as _;
use std::path::PathBuf;

fn main() {
    let manifest = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR").expect("cargo sets it"));
    let out = PathBuf::from(std::env::var("OUT_DIR").expect("cargo sets it"));
    let list = std::fs::read_to_string(manifest.join("src/exports.txt")).expect("src/exports.txt");
    println!("cargo:rerun-if-changed=src/exports.txt");
    let exports: Vec<(&str, &str)> = list
        .lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| {
            let mut it = l.split_whitespace();
            (it.next().expect("symbol"), it.next().expect("version"))
        })
        .collect();
    // Version nodes in rdma-core's order; each public node inherits the previous one.
    let order = [
        "IBVERBS_1.0",
        "IBVERBS_1.1",
        "IBVERBS_1.5",
        "IBVERBS_1.6",
        "IBVERBS_1.7",
        "IBVERBS_1.8",
        "IBVERBS_1.9",
        "IBVERBS_1.10",
        "IBVERBS_1.11",
        "IBVERBS_1.12",
        "IBVERBS_1.13",
        "IBVERBS_1.14",
    ];
    let mut script = String::new();
    chain(&mut script, &order, &exports);
    // librdmacm's nodes, a chain of their own.
    chain(
        &mut script,
        &["RDMACM_1.0", "RDMACM_1.1", "RDMACM_1.2", "RDMACM_1.3"],
        &exports,
    );
    let private: Vec<&str> = exports
        .iter()
        .filter(|e| e.1.starts_with("IBVERBS_PRIVATE"))
        .map(|e| e.0)
        .collect();
    let _ = writeln!(
        script,
        "IBVERBS_PRIVATE_34 {{ global: {}; }};",
        private.join("; ")
    );
    let script_path = out.join("vrnic.map");
    std::fs::write(&script_path, script).expect("write version script");
    let mut symver = String::from("symver! {\n");
    let mut table = String::from("[\n");
    for (s, v) in &exports {
        let _ = writeln!(symver, "    \"{s}\" @ \"{v}\",");
        let _ = writeln!(table, "    (\"{s}\", \"{v}\"),");
    }
    symver.push_str("}\n");
    table.push_str("]\n");
    std::fs::write(out.join("symver.in"), symver).expect("write symver table");
    std::fs::write(out.join("exports.in"), table).expect("write export table");
    println!(
        "cargo:rustc-cdylib-link-arg=-Wl,--version-script={}",
        script_path.display()
    );
}

/// Writes version nodes in order, each listing its symbols and inheriting the previous node.
fn chain(script: &mut String, nodes: &[&str], exports: &[(&str, &str)]) {
    let mut prev: Option<&str> = None;
    for &v in nodes {
        let syms: Vec<&str> = exports.iter().filter(|e| e.1 == v).map(|e| e.0).collect();
        let _ = write!(script, "{v} {{");
        if !syms.is_empty() {
            let _ = write!(script, " global: {};", syms.join("; "));
        }
        match prev {
            Some(p) => {
                let _ = writeln!(script, " }} {p};");
            }
            None => {
                let _ = writeln!(script, " }};");
            }
        }
        prev = Some(v);
    }
}
