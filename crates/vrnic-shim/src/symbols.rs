//! The exported libibverbs symbols with rdma-core's ELF versions.
//!
//! Each Rust function is named `vrnic_<symbol>`; a `.symver` directive gives it the public name
//! with the version rdma-core 44 uses (`ibv_reg_mr@@IBVERBS_1.1`), and `build.rs` writes the
//! version script that defines the version nodes. The list here and the one in `build.rs`
//! ([`EXPORTS`]) are the same table; a test checks the built library exports exactly them.
#![allow(unsafe_code)] // global_asm! for .symver only

/// `(symbol, version)` of every export.
pub const EXPORTS: &[(&str, &str)] = &include!(concat!(env!("OUT_DIR"), "/exports.in"));

/// For each export, a two-instruction trampoline defined in the same assembly block as its
/// `.symver` (the assembler needs the versioned symbol's definition in that object), jumping to
/// the Rust function. Only control verbs go through it: the data path is called through the ops
/// tables, directly.
macro_rules! symver {
    ($($sym:literal @ $ver:literal),* $(,)?) => {
        $(core::arch::global_asm!(concat!(
            ".text\n",
            ".globl __vrnic_sv_", $sym, "\n",
            ".type __vrnic_sv_", $sym, ", @function\n",
            "__vrnic_sv_", $sym, ":\n",
            "    jmp vrnic_", $sym, "@PLT\n",
            ".size __vrnic_sv_", $sym, ", . - __vrnic_sv_", $sym, "\n",
            ".symver __vrnic_sv_", $sym, ", ", $sym, "@@", $ver, "\n",
        ));)*
    };
}

include!(concat!(env!("OUT_DIR"), "/symver.in"));
