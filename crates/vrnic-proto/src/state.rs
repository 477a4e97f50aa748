//! The QP state machine: which transitions `ibv_modify_qp` may request, and which attribute
//! mask bits each requires and allows for RC, UC, UD and both halves of XRC (IB spec 11.2.4.2, as the Linux
//! kernel's `ib_modify_qp_is_ok` table encodes it).

use vrnic_wire::QpState::{self, *};
use vrnic_wire::QpType;
use vrnic_wire::qp_attr::*;

/// `(required, optional)` mask bits for `cur -> next` on an RC QP, or `None` if the transition
/// is illegal. `STATE` itself is implied and not listed.
pub fn rc_masks(cur: QpState, next: QpState) -> Option<(u32, u32)> {
    Some(match (cur, next) {
        (_, Reset) => (0, 0),
        (_, Err) => (0, 0),
        (Reset, Init) => (PKEY_INDEX | PORT | ACCESS_FLAGS, 0),
        (Init, Init) => (0, PKEY_INDEX | PORT | ACCESS_FLAGS),
        (Init, Rtr) => (
            AV | PATH_MTU | DEST_QPN | RQ_PSN | MAX_DEST_RD_ATOMIC | MIN_RNR_TIMER,
            ALT_PATH | ACCESS_FLAGS | PKEY_INDEX,
        ),
        (Rtr, Rts) => (
            SQ_PSN | TIMEOUT | RETRY_CNT | RNR_RETRY | MAX_QP_RD_ATOMIC,
            CUR_STATE | ACCESS_FLAGS | MIN_RNR_TIMER | ALT_PATH | PATH_MIG_STATE,
        ),
        (Rts, Rts) => (
            0,
            CUR_STATE | ACCESS_FLAGS | MIN_RNR_TIMER | ALT_PATH | PATH_MIG_STATE,
        ),
        (Rts, Sqd) => (0, EN_SQD_ASYNC_NOTIFY),
        (Sqd, Sqd) => (
            0,
            ACCESS_FLAGS
                | MIN_RNR_TIMER
                | MAX_QP_RD_ATOMIC
                | MAX_DEST_RD_ATOMIC
                | TIMEOUT
                | RETRY_CNT
                | RNR_RETRY
                | ALT_PATH
                | PATH_MIG_STATE
                | AV
                | PKEY_INDEX
                | PORT,
        ),
        (Sqd, Rts) => (
            0,
            CUR_STATE | ACCESS_FLAGS | MIN_RNR_TIMER | ALT_PATH | PATH_MIG_STATE,
        ),
        (Sqe, Rts) => (0, CUR_STATE | ACCESS_FLAGS | MIN_RNR_TIMER),
        _ => return None,
    })
}

/// `(required, optional)` mask bits for `cur -> next` on a UC QP: no RNR timer, no RDMA
/// read/atomic resources, no transport timeouts.
pub fn uc_masks(cur: QpState, next: QpState) -> Option<(u32, u32)> {
    Some(match (cur, next) {
        (Init, Rtr) => (
            AV | PATH_MTU | DEST_QPN | RQ_PSN,
            ALT_PATH | ACCESS_FLAGS | PKEY_INDEX,
        ),
        (Rtr, Rts) => (SQ_PSN, CUR_STATE | ACCESS_FLAGS | ALT_PATH | PATH_MIG_STATE),
        (Rts, Rts) | (Sqd, Rts) => (0, CUR_STATE | ACCESS_FLAGS | ALT_PATH | PATH_MIG_STATE),
        (Sqd, Sqd) => (
            0,
            ACCESS_FLAGS | ALT_PATH | PATH_MIG_STATE | AV | PKEY_INDEX | PORT,
        ),
        (Sqe, Rts) => (0, CUR_STATE | ACCESS_FLAGS),
        _ => return rc_masks(cur, next),
    })
}

/// `(required, optional)` mask bits for `cur -> next` on a UD QP: a Q_Key instead of a path,
/// no access flags, nothing reliable.
pub fn ud_masks(cur: QpState, next: QpState) -> Option<(u32, u32)> {
    Some(match (cur, next) {
        (_, Reset) | (_, Err) => (0, 0),
        (Reset, Init) => (PKEY_INDEX | PORT | QKEY, 0),
        (Init, Init) => (0, PKEY_INDEX | PORT | QKEY),
        (Init, Rtr) => (0, PKEY_INDEX | QKEY),
        (Rtr, Rts) => (SQ_PSN, CUR_STATE | QKEY),
        (Rts, Rts) | (Sqd, Rts) | (Sqe, Rts) => (0, CUR_STATE | QKEY),
        (Rts, Sqd) => (0, EN_SQD_ASYNC_NOTIFY),
        (Sqd, Sqd) => (0, PKEY_INDEX | QKEY),
        _ => return None,
    })
}

/// `(required, optional)` mask bits for `cur -> next` on an XRC send QP (the initiator): RC's,
/// but it has no receive side, so RTR takes no RNR timer and no responder resources.
pub fn xrc_send_masks(cur: QpState, next: QpState) -> Option<(u32, u32)> {
    Some(match (cur, next) {
        (Init, Rtr) => (
            AV | PATH_MTU | DEST_QPN | RQ_PSN,
            ALT_PATH | ACCESS_FLAGS | PKEY_INDEX,
        ),
        _ => return rc_masks(cur, next),
    })
}

/// `(required, optional)` mask bits for `cur -> next` on an XRC receive QP (the target): RC's,
/// but it sends nothing of its own, so RTS takes no retry counts or initiator resources.
pub fn xrc_recv_masks(cur: QpState, next: QpState) -> Option<(u32, u32)> {
    Some(match (cur, next) {
        (Rtr, Rts) => (
            SQ_PSN | TIMEOUT,
            CUR_STATE | ACCESS_FLAGS | MIN_RNR_TIMER | ALT_PATH | PATH_MIG_STATE,
        ),
        _ => return rc_masks(cur, next),
    })
}

/// Checks `mask` for `cur -> next` on a QP of type `ty`: every required bit present, nothing
/// outside required, optional and `STATE`.
pub fn check(ty: QpType, cur: QpState, next: QpState, mask: u32) -> bool {
    let masks = match ty {
        QpType::Rc => rc_masks(cur, next),
        QpType::Uc => uc_masks(cur, next),
        QpType::Ud => ud_masks(cur, next),
        QpType::XrcSend => xrc_send_masks(cur, next),
        QpType::XrcRecv => xrc_recv_masks(cur, next),
    };
    let Some((req, opt)) = masks else {
        return false;
    };
    let mask = mask & !STATE;
    mask & req == req && mask & !(req | opt) == 0
}

/// RNR NAK timer codes (IB spec table 45) in microseconds.
pub fn rnr_timer_us(code: u8) -> u64 {
    const T: [u64; 32] = [
        655_360, 10, 20, 30, 40, 60, 80, 120, 160, 240, 320, 480, 640, 960, 1280, 1920, 2560, 3840,
        5120, 7680, 10_240, 15_360, 20_480, 30_720, 40_960, 61_440, 81_920, 122_880, 163_840,
        245_760, 327_680, 491_520,
    ];
    T[usize::from(code & 31)]
}

/// Local ACK timeout: 4.096 us * 2^code; 0 means infinite, which we cap at one second so a dead
/// peer still fails a QP.
pub fn ack_timeout_us(code: u8) -> u64 {
    if code == 0 {
        1_000_000
    } else {
        (4096u64 << u32::from(code.min(31))) / 1000
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reset_to_init_requires_pkey_port_access() {
        assert!(check(
            QpType::Rc,
            Reset,
            Init,
            STATE | PKEY_INDEX | PORT | ACCESS_FLAGS
        ));
        assert!(!check(QpType::Rc, Reset, Init, STATE | PKEY_INDEX | PORT));
        assert!(!check(
            QpType::Rc,
            Reset,
            Init,
            STATE | PKEY_INDEX | PORT | ACCESS_FLAGS | AV
        ));
    }

    #[test]
    fn init_to_rtr_requires_the_path() {
        let req = STATE | AV | PATH_MTU | DEST_QPN | RQ_PSN | MAX_DEST_RD_ATOMIC | MIN_RNR_TIMER;
        assert!(check(QpType::Rc, Init, Rtr, req));
        assert!(!check(QpType::Rc, Init, Rtr, req & !DEST_QPN));
        assert!(!check(QpType::Rc, Init, Rtr, req | SQ_PSN));
    }

    #[test]
    fn illegal_transitions_are_refused() {
        assert!(!check(QpType::Rc, Reset, Rts, STATE));
        assert!(!check(
            QpType::Rc,
            Init,
            Rts,
            STATE | SQ_PSN | TIMEOUT | RETRY_CNT | RNR_RETRY | MAX_QP_RD_ATOMIC
        ));
        assert!(check(QpType::Rc, Rts, Err, STATE));
        assert!(check(QpType::Rc, Err, Reset, STATE));
    }

    #[test]
    fn uc_needs_no_rnr_or_timeout_attributes() {
        assert!(check(
            QpType::Uc,
            Init,
            Rtr,
            STATE | AV | PATH_MTU | DEST_QPN | RQ_PSN
        ));
        assert!(!check(
            QpType::Uc,
            Init,
            Rtr,
            STATE | AV | PATH_MTU | DEST_QPN | RQ_PSN | MIN_RNR_TIMER
        ));
        assert!(check(QpType::Uc, Rtr, Rts, STATE | SQ_PSN));
        assert!(!check(QpType::Uc, Rtr, Rts, STATE | SQ_PSN | TIMEOUT));
    }

    #[test]
    fn ud_needs_a_qkey_and_no_path() {
        assert!(check(
            QpType::Ud,
            Reset,
            Init,
            STATE | PKEY_INDEX | PORT | QKEY
        ));
        assert!(!check(
            QpType::Ud,
            Reset,
            Init,
            STATE | PKEY_INDEX | PORT | ACCESS_FLAGS
        ));
        assert!(check(QpType::Ud, Init, Rtr, STATE));
        assert!(!check(QpType::Ud, Init, Rtr, STATE | AV | DEST_QPN));
        assert!(check(QpType::Ud, Rtr, Rts, STATE | SQ_PSN));
        assert!(!check(QpType::Ud, Rtr, Rts, STATE | SQ_PSN | TIMEOUT));
    }

    #[test]
    fn xrc_halves_take_the_masks_ibv_xsrq_pingpong_gives() {
        let init = STATE | PKEY_INDEX | PORT | ACCESS_FLAGS;
        for ty in [QpType::XrcSend, QpType::XrcRecv] {
            assert!(check(ty, Reset, Init, init));
            assert!(!check(ty, Reset, Init, init & !ACCESS_FLAGS));
        }
        let send_rtr = STATE | AV | PATH_MTU | DEST_QPN | RQ_PSN;
        assert!(check(QpType::XrcSend, Init, Rtr, send_rtr));
        assert!(!check(QpType::XrcSend, Init, Rtr, send_rtr | MIN_RNR_TIMER));
        let recv_rtr = send_rtr | MAX_DEST_RD_ATOMIC | MIN_RNR_TIMER;
        assert!(check(QpType::XrcRecv, Init, Rtr, recv_rtr));
        assert!(!check(QpType::XrcRecv, Init, Rtr, send_rtr));
        let send_rts = STATE | TIMEOUT | SQ_PSN | RETRY_CNT | RNR_RETRY | MAX_QP_RD_ATOMIC;
        assert!(check(QpType::XrcSend, Rtr, Rts, send_rts));
        assert!(!check(QpType::XrcSend, Rtr, Rts, STATE | TIMEOUT | SQ_PSN));
        assert!(check(QpType::XrcRecv, Rtr, Rts, STATE | TIMEOUT | SQ_PSN));
        assert!(!check(QpType::XrcRecv, Rtr, Rts, send_rts));
        assert!(!check(QpType::XrcRecv, Rtr, Rts, STATE | SQ_PSN));
    }

    #[test]
    fn timers_follow_the_spec_tables() {
        assert_eq!(rnr_timer_us(12), 640);
        assert_eq!(rnr_timer_us(0), 655_360);
        assert_eq!(ack_timeout_us(14), 67_108);
    }
}
