//! XRC from two processes, each on its own vRNIC (`tests/c/xrc_check.c`): the extended API's
//! `ibv_wr_set_xrc_srqn` sends and writes into the SRQ it names (bytes checked, the receive
//! completing on that SRQ's CQ with the receive QP's number), `ibv_get_srq_num`, an SRQ of
//! another XRC domain refused with `IBV_WC_REM_INV_REQ_ERR` (nothing lands), the state
//! machine's XRC masks, `ibv_open_xrcd`'s errnos and `ibv_close_xrcd` `EBUSY` while in use.

mod common;

#[test]
fn xrc_srq_numbers_domains_and_close_from_two_processes() {
    let bin = common::c_program("xrc_check", &["-libverbs"]);
    let pair = common::c_check_pair(&bin, "xrc");
    for (side, want) in [
        (
            &pair.server,
            &[
                "IBV_DEVICE_XRC reported",
                "open_xrcd: EINVAL without OFLAGS",
                "XRC SRQs in two domains",
                "close_xrcd EBUSY while used",
                "receive QP: RTR, RTS",
                "send to SRQ 1: 1000 exact bytes",
                "RDMA WRITE over XRC: 500 exact bytes",
                "send to SRQ 2 of another domain: nothing landed",
                "close_xrcd: EBUSY with an SRQ left, 0 once empty",
            ][..],
        ),
        (
            &pair.client,
            &[
                "send QP: RTR with the path only",
                "wr_send and wr_rdma_write with wr_set_xrc_srqn: both complete",
                "an SRQ of another domain: IBV_WC_REM_INV_REQ_ERR",
            ][..],
        ),
    ] {
        for w in want {
            assert!(
                side.stdout
                    .lines()
                    .any(|l| l.starts_with("OK ") && l.contains(w)),
                "missing {w:?}\n{pair}"
            );
        }
        assert!(side.stdout.contains("xrc done"), "{pair}");
        assert!(!side.stdout.contains("FAIL"), "{pair}");
    }
}
