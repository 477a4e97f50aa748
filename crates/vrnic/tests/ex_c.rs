//! The extended verbs API (`ibv_create_qp_ex` with the `ibv_wr_*` builders, `ibv_create_cq_ex`
//! with `start_poll`/`next_poll`/`end_poll` and the `ibv_wc_read_*` accessors) checked from two
//! processes by `tests/c/ex_check.c`, built against the system's libibverbs-dev and run under
//! `vrnic run` on two vRNICs of one daemon, as `verbs_c.rs` runs `verbs_check.c`: bytes land
//! exactly where they should for every builder and setter, every completion field is right,
//! completion timestamps are in order on the host's `CLOCK_MONOTONIC`, and aborted batches or
//! batches with an unsupported builder post nothing. ATOMIC_WRITE (`ibv_wr_atomic_write`, IBA
//! 1.5) is checked on one engine thread, across two, and across two hosts: its 8 bytes land
//! whole and alone, a reader never sees a torn word, and a misaligned word or an MR without
//! remote write completes with rxe's statuses.

mod common;

use std::path::PathBuf;
use std::sync::OnceLock;
use std::time::Duration;

use common::Daemon;

fn ex_check() -> &'static PathBuf {
    static BIN: OnceLock<PathBuf> = OnceLock::new();
    BIN.get_or_init(|| common::c_program("ex_check", &["-libverbs"]))
}

/// Runs one mode on both sides and checks that each side passed every check named in `checks`
/// (an `OK` line starting with it) and finished.
fn check(mode: &str, server_checks: &[&str], client_checks: &[&str]) {
    let pair = common::c_check_pair(ex_check(), mode);
    passed(&pair, mode, server_checks, client_checks);
}

fn passed(pair: &common::Pair, mode: &str, server_checks: &[&str], client_checks: &[&str]) {
    pair.assert_ok();
    for (side, checks, name) in [
        (&pair.server, server_checks, "server"),
        (&pair.client, client_checks, "client"),
    ] {
        assert!(!side.stdout.contains("FAIL"), "{}", side.stdout);
        for c in checks.iter().copied().chain([" done"]) {
            let want = if c == " done" {
                format!("OK {name} {mode} done")
            } else {
                format!("OK {c}")
            };
            assert!(
                side.stdout.lines().any(|l| l.starts_with(&want)),
                "{name} lacks {want:?}:\n{}",
                side.stdout
            );
        }
    }
}

#[test]
fn wr_builders_and_extended_cq_move_exact_bytes_and_report_every_field() {
    check(
        "rc",
        &[
            "creation: wallclock CQ, UC and UD ATOMIC_WRITE, UD LOCAL_INV, UD RDMA_WRITE, XRC_SEND BIND_MW, TSO refused",
            "receive of wr_rdma_write_imm",
            "receive of wr_send_imm from 3 SGEs",
            "receives of inline data, an inline list, and an SGE send with the inline flag",
            "atomics: the remote word is 7",
            "receives of the batch",
            "aborted and failed batches changed nothing here",
            "server wr_send_imm",
            "100 single-byte writes landed",
        ],
        &[
            "creation: wallclock CQ, UC and UD ATOMIC_WRITE, UD LOCAL_INV, UD RDMA_WRITE, XRC_SEND BIND_MW, TSO refused",
            "wr_rdma_write: completion opcode, length, qp_num; stamped between two raw clock reads",
            "wr_rdma_write_imm",
            "wr_send_imm with wr_set_sge_list of 3 SGEs",
            "wr_set_inline_data, wr_set_inline_data_list",
            "wr_rdma_read into two SGEs",
            "wr_atomic_fetch_add, wr_atomic_cmp_swp (hit and miss)",
            "one batch of write, write_imm, unsignaled send, send_imm inline, read",
            "wr_abort: nothing posted",
            "a batch with wr_atomic_write then a data setter",
            "a batch with wr_send_tso",
            "a batch with wr_set_xrc_srqn", // on an RC QP: EOPNOTSUPP
            "the QP works after aborted and failed batches",
            "receive of the server's wr_send_imm",
            "completion event on an extended CQ",
            "100 completions through a 16-entry CQ",
        ],
    );
}

#[test]
fn ud_wr_set_ud_addr_sends_and_a_wr_without_an_address_posts_nothing() {
    check(
        "ud",
        &["UD receives: opcode, imm, length with GRH space, src_qp, slid, bytes"],
        &[
            "a UD WR without wr_set_ud_addr: EINVAL, nothing posted",
            "wr_send_imm and an inline wr_send with wr_set_ud_addr",
        ],
    );
}

const AW_SERVER: &[&str] = &[
    "ATOMIC_WRITEs landed: exactly their 8 bytes each",
    "atomic loads while 1000 ATOMIC_WRITEs landed: never a torn word",
    "misaligned and unwritable ATOMIC_WRITEs stored nothing",
    "the ATOMIC_WRITE after the reset landed",
];

const AW_CLIENT: &[&str] = &[
    "device_cap_flags_ex has IB_UVERBS_DEVICE_ATOMIC_WRITE",
    "three wr_atomic_write in a batch after a WRITE: IBV_WC_SUCCESS, IBV_WC_ATOMIC_WRITE",
    "1000 ATOMIC_WRITEs to one word",
    "ibv_post_send with IBV_WR_ATOMIC_WRITE: EINVAL",
    "a misaligned wr_atomic_write: IBV_WC_REM_INV_REQ_ERR",
    "wr_atomic_write through an MR with remote atomic but no remote write: IBV_WC_REM_ACCESS_ERR",
    "after a reset the QPs carry ATOMIC_WRITEs again",
];

/// ATOMIC_WRITE between two vRNICs of one daemon on one engine thread.
#[test]
fn atomic_write_lands_whole_and_fails_as_rxe_does() {
    check("aw", AW_SERVER, AW_CLIENT);
}

/// The same with the two vRNICs on two engine threads: the client's engine executes each
/// ATOMIC_WRITE inside the server's (`siblings.rs`).
#[test]
fn atomic_write_across_engine_threads() {
    let d = Daemon::start_with(&["--engine-threads", "2"]);
    let pair = common::c_check_pair_on(&d, ex_check(), &["aw"], Duration::from_secs(120));
    passed(&pair, "aw", AW_SERVER, AW_CLIENT);
}

/// The same across two hosts: each ATOMIC_WRITE crosses the peer link as IBA 1.5's opcode.
#[test]
fn atomic_write_across_hosts() {
    let (pair, _hosts, _ds) =
        common::hosts::c_check_across_hosts(ex_check(), &["aw"], Duration::from_secs(120));
    passed(&pair, "aw", AW_SERVER, AW_CLIENT);
}
