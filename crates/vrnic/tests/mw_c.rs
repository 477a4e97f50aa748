//! Memory windows from two processes (`tests/c/mw_check.c`): the server's MR allows no remote
//! access of its own and the client reaches it only through windows, type 1 (`ibv_bind_mw`) and
//! type 2 (`IBV_WR_BIND_MW`, `ibv_wr_bind_mw`), within their ranges and rights; invalidation
//! (`IBV_WR_LOCAL_INV`, `ibv_wr_send_inv`) closes them; misuse completes with the statuses
//! rxe gives (`IBV_WC_MW_BIND_ERR`, `REM_ACCESS_ERR`, `LOC_QP_OP_ERR`) and changes no byte;
//! and the rights rules (IB spec C10-73/C10-74): a window needs of its MR only `MW_BIND` and,
//! to grant remote write or atomics, local write, so it grants remote rights its MR lacks, and
//! `LOCAL_WRITE` among its flags (as rdma-core's `tests/test_mr.py` binds windows) grants
//! nothing remote.

mod common;

use std::path::PathBuf;
use std::sync::OnceLock;

fn check(mode: &str) {
    static BIN: OnceLock<PathBuf> = OnceLock::new();
    let bin = BIN.get_or_init(|| common::c_program("mw_check", &["-libverbs"]));
    common::c_check_done(bin, mode);
}

#[test]
fn type2_windows_bind_bound_and_invalidate_from_two_processes() {
    check("type2");
}

#[test]
fn type1_windows_bind_rebind_and_pin_their_mr_from_two_processes() {
    check("type1");
}

#[test]
fn windows_grant_remote_rights_their_mr_lacks_and_need_only_mw_bind_and_local_write() {
    check("rights");
}
