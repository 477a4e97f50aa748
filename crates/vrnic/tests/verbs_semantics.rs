//! Verbs semantics a user of a real RNIC relies on, checked by our own C program
//! (`tests/c/verbs_semantics.c`, built against the system's libibverbs-dev) run unmodified under
//! `vrnic run`: one process, QPs connected to each other on its vRNIC. Each case asserts real
//! outcomes: READ and atomic results byte for byte, atomics staying atomic under two QPs
//! hammering one word, the errno of every validation rule, RNR and transport-retry failures
//! after the configured retries, SRQs shared by QPs with the limit event, UD with GRH and Q_Key
//! rules, CQ overflow, `ibv_rereg_mr`, unsignaled completions, and the extended API
//! (`ibv_create_qp_ex` with `ibv_wr_*`, `ibv_create_cq_ex` with `start_poll` and `read_*`).

mod common;

use std::path::PathBuf;
use std::sync::OnceLock;
use std::time::Duration;

use common::{Daemon, output};

fn program() -> &'static PathBuf {
    static BIN: OnceLock<PathBuf> = OnceLock::new();
    BIN.get_or_init(|| common::c_program("verbs_semantics", &["-libverbs", "-lpthread"]))
}

/// Runs one case on a fresh daemon; it must exit 0 having printed every check in `expect`.
fn case(name: &str, expect: &[&str]) {
    case_on(&[], name, expect);
}

/// [`case`] on a daemon started with `serve_args`; returns the daemon.
fn case_on(serve_args: &[&str], name: &str, expect: &[&str]) -> Daemon {
    let bin = program().to_str().expect("utf-8 path").to_string();
    let d = Daemon::start_with(serve_args);
    let out = output(d.run(&[&bin, name]), name, Duration::from_secs(90));
    assert!(out.ok(), "case {name} failed\n{}", out.text());
    for e in expect.iter().chain(&["done"]) {
        assert!(
            out.stdout
                .lines()
                .any(|l| l.starts_with("OK ") && l.contains(e)),
            "case {name}: no OK line with {e:?}\n{}",
            out.text()
        );
    }
    d
}

const READ_ATOMICS: &[&str] = &[
    "READ 4097 bytes exact",
    "FETCH_AND_ADD returns the original",
    "CMP_AND_SWP with a matching compare swaps",
    "CMP_AND_SWP with another compare",
    "atomic without REMOTE_ATOMIC: remote access error",
];
const HAMMER: &[&str] = &["every original distinct"];
const RNR: &[&str] = &[
    "no receive, rnr_retry 2: RNR retry counter exceeded",
    "rnr_retry 7 waits",
];
const RETRY: &[&str] = &[
    "send to a destroyed QP: transport retry counter exceeded",
    "requester QP fatal event",
];
const SRQ: &[&str] = &[
    "post_recv on a QP attached to an SRQ: EINVAL",
    "SRQ resize past max_srq_wr: EINVAL",
    "land in SRQ receives, 2 per QP",
    "SRQ limit reached",
    "limit disarmed",
    "destroy_srq in use: EBUSY",
    "last WQE reached",
    "the SRQ still serves r2",
];

#[test]
fn read_and_atomics_byte_for_byte() {
    case("read_atomics", READ_ATOMICS);
}

#[test]
fn atomics_stay_atomic_under_two_qps() {
    case("hammer", HAMMER);
}

/// The cases whose QPs pair up inside the process (READ and atomics byte for byte, two QPs
/// hammering one word, RNR, a gone peer, an SRQ shared by two QPs, CQs and SRQs resized under
/// traffic), on a daemon whose QPs spread over two engine threads (`--spread-qps`: a vRNIC's
/// plain QPs go to the slice with the fewest, so each pair's two QPs are on two threads, an
/// SRQ's QPs at home and their requesters on the other; a new ring grows the region's mapping
/// with both threads' shards held): the same outcomes as on one thread.
#[test]
fn pairs_of_one_process_across_engine_threads_keep_read_atomic_rnr_and_srq_semantics() {
    for (name, expect) in [
        ("read_atomics", READ_ATOMICS),
        ("hammer", HAMMER),
        ("rnr", RNR),
        ("retry", RETRY),
        ("srq", SRQ),
        ("resize", RESIZE),
    ] {
        let mut d = case_on(&["--engine-threads", "2", "--spread-qps"], name, expect);
        let log = d.stop().text();
        for engine in ["engine=0", "engine=1"] {
            assert!(
                log.lines()
                    .any(|l| l.contains("QP created") && l.contains(engine)),
                "{name}: no QP on {engine}\n{log}"
            );
        }
    }
}

#[test]
fn validation_rules_return_a_devices_errno() {
    case(
        "validate",
        &[
            "port 1 up at attach: port active",
            "max_send_wr over max_qp_wr: EINVAL",
            "max_inline_data over the device's: EINVAL",
            "RC RESET->INIT without ACCESS_FLAGS: EINVAL",
            "UD RESET->INIT with ACCESS_FLAGS: EINVAL",
            "post_send in RESET: EINVAL",
            "post_recv in RESET: EINVAL",
            "more SGEs than max_send_sge: EINVAL",
            "inline data over max_inline_data",
            "resize_cq past max_cqe or to 0: EINVAL",
            "dealloc_pd in use: EBUSY",
            "SRQ deeper than max_srq_wr: EINVAL",
        ],
    );
}

#[test]
fn every_create_and_modify_attribute_past_the_reported_limits_is_einval() {
    case(
        "dev_limits",
        &[
            "create_cq comp_vector num_comp_vectors: EINVAL",
            "create_cq comp_vector -1: EINVAL",
            "create_cq_ex cqe max_cqe+1: EINVAL",
            "create_cq_ex comp_vector num_comp_vectors: EINVAL",
            "create_cq at max_cqe",
            "create_qp max_recv_sge max_sge+1 (create_qp_ex): EINVAL",
            "create_qp max_inline_data over the device's (create_qp_ex): EINVAL",
            "create_qp at max_qp_wr",
            "modify_qp port phys_port_cnt+1: EINVAL",
            "modify_qp pkey_index max_pkeys: EINVAL",
            "modify_qp max_dest_rd_atomic max_qp_rd_atom+1: EINVAL",
            "modify_qp path_mtu over the port's: EINVAL",
            "modify_qp sgid_index gid_tbl_len: EINVAL",
            "modify_qp max_rd_atomic max_qp_init_rd_atom+1: EINVAL",
            "modify_qp at max_qp_rd_atom",
            "create_srq max_sge max_srq_sge+1: EINVAL",
            "create_srq srq_limit over max_wr: EINVAL",
            "create_srq_ex max_wr max_srq_wr+1: EINVAL",
            "create_srq at max_srq_wr",
            "modify_srq srq_limit over max_wr: EINVAL",
            "create_ah sgid_index gid_tbl_len: EINVAL",
        ],
    );
}

#[test]
fn a_full_queue_refuses_more_with_enomem_and_posts_none_of_the_excess() {
    case(
        "queue_full",
        &[
            "QP: past 10 receives ENOMEM, bad_wr the first not posted",
            "QP: exactly the 10 receives that fit were posted",
            "extended QP: past 10 receives ENOMEM",
            "extended QP: exactly the 10 receives that fit were posted",
            "SRQ: past 10 receives ENOMEM",
            "SRQ: exactly the 10 receives that fit were posted",
            "send past max_send_wr (10): ENOMEM, bad_wr set",
        ],
    );
}

#[test]
fn fork_support_is_unneeded_and_registrations_work_after_a_fork() {
    case(
        "fork",
        &[
            "ibv_is_fork_initialized: IBV_FORK_UNNEEDED",
            "ibv_fork_init: 0, still IBV_FORK_UNNEEDED",
            "the child shares the registered pages",
            "after fork, a send carries what the parent wrote after the fork",
            "after fork, the parent reads what an RDMA WRITE put in its buffer",
        ],
    );
}

#[test]
fn event_mode_under_two_posting_threads_loses_no_completion_and_leaves_no_wait_hanging() {
    case(
        "event_stress",
        &[
            "100000 completions from two posting threads, each once and in order",
            "no event left pending",
        ],
    );
}

#[test]
fn rnr_retries_exhaust_or_wait_forever() {
    case("rnr", RNR);
}

#[test]
fn a_gone_peer_gives_retry_exceeded_and_qp_fatal() {
    case("retry", RETRY);
}

#[test]
fn srq_shared_by_qps_with_limit_event() {
    case("srq", SRQ);
}

#[test]
fn ud_grh_qkey_and_mtu_rules() {
    case(
        "ud",
        &[
            "40-byte GRH",
            "create_ah_from_wc answer the sender",
            "wrong Q_Key: nothing delivered",
            "high bit uses the sender's Q_Key",
            "LOC_LEN_ERR there, the sender succeeds",
            "4097 bytes over a 4096 MTU: local length error",
        ],
    );
}

#[test]
fn cq_overflow_raises_cq_error() {
    case("cq_overflow", &["CQ error"]);
}

#[test]
fn rereg_mr_changes_access_and_translation() {
    case(
        "rereg",
        &[
            "write after rereg granted REMOTE_WRITE: success",
            "bytes land in the new range",
            "IBV_REREG_MR_ERR_INPUT",
        ],
    );
}

#[test]
fn unsignaled_sends_give_no_completion() {
    case("unsignaled", &["unsignaled writes give no completion"]);
}

/// An app that arms its CQ once and then busy-polls (UCX does) gets one event, as from a
/// device, not a wake-up of the daemon and the driver per completion for ever; armed again,
/// an app that waits gets its event.
#[test]
fn one_arm_raises_one_event_however_many_completions_follow() {
    case(
        "arm_once",
        &[
            "exactly one event, as on a device",
            "the waiting app gets its event",
        ],
    );
}

#[test]
fn extended_qp_and_cq_apis() {
    case(
        "ex",
        &[
            "query_device_ex: timestamp mask",
            "qp_to_qp_ex: the extended QP's table",
            "one batch: write from 3 SGEs, write_imm, send_imm from an inline list",
            "wr_rdma_read, wr_atomic_fetch_add, wr_atomic_cmp_swp",
            "wr_abort posts nothing",
            "ibv_poll_cq works on an extended CQ",
            "unsupported wc flag: EOPNOTSUPP",
        ],
    );
}

#[test]
fn per_vrnic_limits_refuse_with_enomem() {
    case_on(
        &[
            "--max-qp",
            "4",
            "--max-cq",
            "4",
            "--max-mr",
            "8",
            "--max-srq",
            "2",
        ],
        "limits",
        &[
            "query_device reports the daemon's limits",
            "CQ past the limit: ENOMEM",
            "QP past the limit: ENOMEM",
            "MR past the limit: ENOMEM",
            "SRQ past the limit: ENOMEM",
        ],
    );
}

#[test]
fn registering_more_than_the_region_is_refused() {
    case_on(
        &["--region-gib", "1"],
        "reg_limit",
        &[
            "registering more than the vRNIC's region: ENOMEM",
            "the vRNIC still registers what fits",
        ],
    );
}

#[test]
fn no_way_to_reach_memory_without_a_valid_rkey() {
    case(
        "isolation",
        &[
            "200 guessed rkeys",
            "after ibv_dereg_mr its rkey reaches nothing",
            "past the end, before the start, missing access flags",
            "through a responder QP of another PD",
            "the victim's 65536 bytes are unchanged",
        ],
    );
}

#[test]
fn registration_keeps_written_bytes_and_zeroes_untouched_pages() {
    case(
        "reg_contents",
        &[
            "written pages keep their bytes, untouched and read-only pages read zero",
            "a written 1 MiB run keeps every byte",
        ],
    );
}

/// Registration moves a buffer's pages onto the region; a page it shares with other data
/// (a counter another thread increments all the while) loses no write (it did: 5-10% of
/// registrations lost one, and the driver's own notifier thread once corrupted an app's heap
/// that way; a CI run of `ibv_ud_pingpong` aborted in `tcache_thread_shutdown`).
#[test]
fn registration_loses_no_write_another_thread_makes_to_a_shared_page() {
    case(
        "reg_neighbours",
        &["300 registrations and deregistrations lose no write"],
    );
}

#[test]
fn cq_and_srq_resize_keep_what_is_pending_and_refuse_to_drop_it() {
    case("resize", RESIZE);
}

const RESIZE: &[&str] = &[
    "IBV_DEVICE_SRQ_RESIZE reported",
    "resize_cq below the completions waiting: EINVAL, nothing changed",
    "resize_cq grows 4 -> 128",
    "the 3 completions waiting survive the resize, in order, bytes exact",
    "resize_cq to 59 with 60 waiting: EINVAL",
    "resize_cq shrinks 128 -> 64",
    "60 completions in order and exact after growing and shrinking",
    "an armed CQ stays armed across a resize",
    "9 completions into a CQ shrunk to 8: CQ error",
    "SRQ resize below the receives posted: EINVAL",
    "SRQ grown 4 -> 16 takes 12 more receives, then ENOMEM",
    "10 SENDs land in the SRQ's receives in order, bytes exact",
    "SRQ shrunk 16 -> 6 with 6 outstanding, then full",
    "the kept receives, then 6 new ones, take SENDs in order, bytes exact",
    "SRQ resize below the limit set with it: EINVAL",
];

#[test]
fn query_gid_ex_and_table_report_one_ib_gid_with_the_kernels_errnos() {
    case(
        "gid",
        &[
            "query_gid_ex: ibv_query_gid's GID, type IB on an InfiniBand port, no net device",
            "query_gid_ex past gid_tbl_len, on another port, with flags: EINVAL",
            "query_gid_table: 1 entry, the same as query_gid_ex's, nothing past it",
            "query_gid_table with no room or with flags: -EINVAL",
        ],
    );
}

#[test]
fn device_memory_copies_registers_zero_based_and_carries_rdma() {
    case(
        "dm",
        &[
            "max_dm_size reported",
            "alloc_dm past max_dm_size or of 0 bytes: EINVAL",
            "memcpy_to_dm / memcpy_from_dm: exact bytes, odd offsets",
            "copies past the end of the DM: EFAULT",
            "reg_dm_mr without IBV_ACCESS_ZERO_BASED or past the DM's end: EINVAL",
            "reg_dm_mr with IBV_ACCESS_ZERO_BASED alone up to the DM's end",
            "reg_dm_mr: addr = the DM offset; free_dm while it exists: EBUSY",
            "RDMA WRITE at zero-based address 1000 lands at DM offset 1100",
            "RDMA READ from the DM MR: exact; past its end: REM_ACCESS_ERR",
            "SEND from the DM MR's lkey at zero-based 2000",
            "after dereg_mr, free_dm: 0",
        ],
    );
}

#[test]
fn an_rnic_deep_cq_costs_memory_only_for_the_completions_written_to_it() {
    case(
        "big_cq",
        &[
            "an RNIC's depth",
            "create_cq of 262144 entries, as libfabric's ofi_rxm asks: accepted",
            "of memory at creation",
            "20000 completions through it took",
            "destroyed, its memory is given back",
        ],
    );
}

/// Importing a context (`ibv_import_device`, `_pd`, `_mr`, `_dm`) is refused as rdma-core
/// refuses it for a provider without `import_context`: NULL with `EOPNOTSUPP` (an fd that is
/// not open: `EINVAL`), in the process that owns the context and in another that got its
/// `cmd_fd` by `SCM_RIGHTS`; the context keeps working.
#[test]
fn importing_a_context_is_refused_with_eopnotsupp() {
    case(
        "import",
        &[
            "ibv_import_device of an fd that is not open: NULL, EINVAL",
            "ibv_import_device (a dup of cmd_fd), ibv_import_pd, ibv_import_mr, ibv_import_dm: NULL, EOPNOTSUPP",
            "another process given the cmd_fd by SCM_RIGHTS: every import NULL, EOPNOTSUPP",
            "the context works after the refused imports",
        ],
    );
}
