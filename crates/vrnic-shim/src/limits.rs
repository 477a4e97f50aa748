//! The device's limits as `ibv_query_device` and `ibv_query_port` report them, and the checks
//! of every `create_*`/`modify_*` attribute against them: past a limit the call fails with
//! `EINVAL` before any request reaches the daemon, as a device's provider and kernel driver
//! answer. The daemon checks the same limits again (it trusts no driver); the driver's checks
//! give the app the device's errno without a round trip.

use vrnic_api::DeviceInfo;
use vrnic_wire::{AhAttr, MAX_INLINE, MAX_SGE, QpAttr, QpCap, qp_attr};

/// `max_qp_rd_atom` and `max_qp_init_rd_atom`: RDMA READs and atomics outstanding per QP, as
/// responder and as requester (the engine refuses more).
pub const MAX_RD_ATOM: u8 = 16;
/// `num_comp_vectors` of every context.
pub const COMP_VECTORS: i32 = 1;
/// `phys_port_cnt`: one port, number 1.
pub const PORTS: u8 = 1;
/// `gid_tbl_len` of the port.
pub const GIDS: u8 = 1;
/// `pkey_tbl_len` of the port and `max_pkeys`.
pub const PKEYS: u16 = 1;
/// Highest `ibv_mtu` value (`IBV_MTU_4096`): the port's `max_mtu`.
pub const MAX_MTU: u32 = 5;
/// `device_cap_flags`: what the engine does, and nothing more. RNR NAKs: a SEND finding no
/// receive waits per `min_rnr_timer`/`rnr_retry`; port-active event: `IBV_EVENT_PORT_ACTIVE`
/// as a context attaches; `sys_image_guid` is set (the node GUID).
pub const DEVICE_CAP_FLAGS: u32 = crate::abi::IBV_DEVICE_RC_RNR_NAK_GEN
    | crate::abi::IBV_DEVICE_PORT_ACTIVE_EVENT
    | crate::abi::IBV_DEVICE_SYS_IMAGE_GUID;
/// `port_cap_flags`: a connection manager serves the port (librdmacm's `rdma_*` over the
/// daemon's broker), and the port reports the system image GUID.
pub const PORT_CAP_FLAGS: u32 =
    crate::abi::IBV_PORT_CM_SUP | crate::abi::IBV_PORT_SYS_IMAGE_GUID_SUP;
/// The device capability bits that memory windows earn in `ibv_query_device`.
pub const MW_CAP_FLAGS: u32 =
    crate::abi::IBV_DEVICE_MEM_WINDOW | crate::abi::IBV_DEVICE_MEM_WINDOW_TYPE_2B;

/// `max_dm_size` reported by `ibv_query_device_ex`: the largest allocation.
pub const MAX_DM_SIZE: u64 = 4 << 20;

/// `subnet_timeout` (4.096 us * 2^18, about 1 s: what subnet managers commonly assign).
pub const SUBNET_TIMEOUT: u8 = 18;

/// `ibv_create_cq`/`ibv_create_cq_ex`: `cqe` in `1..=max_cqe`, `comp_vector` in
/// `0..num_comp_vectors`.
pub fn check_cq(info: &DeviceInfo, cqe: i64, comp_vector: i64) -> Result<(), i32> {
    if cqe <= 0 || cqe > i64::from(info.max_cqe) {
        return Err(libc::EINVAL);
    }
    if comp_vector < 0 || comp_vector >= i64::from(COMP_VECTORS) {
        return Err(libc::EINVAL);
    }
    Ok(())
}

/// A QP's capabilities: work requests up to `max_qp_wr`, SGEs up to `max_sge`, inline data up
/// to what `ibv_create_qp` reports back.
pub fn check_qp_cap(info: &DeviceInfo, cap: &QpCap) -> Result<(), i32> {
    if cap.max_send_wr > info.max_qp_wr
        || cap.max_recv_wr > info.max_qp_wr
        || cap.max_send_sge as usize > MAX_SGE
        || cap.max_recv_sge as usize > MAX_SGE
        || cap.max_inline_data as usize > MAX_INLINE
    {
        return Err(libc::EINVAL);
    }
    Ok(())
}

/// An SRQ's attributes: `max_wr` in `1..=max_srq_wr`, `max_sge` up to `max_srq_sge`, a limit
/// below `max_wr`.
pub fn check_srq(info: &DeviceInfo, max_wr: u32, max_sge: u32, limit: u32) -> Result<(), i32> {
    if max_wr == 0 || max_wr > info.max_qp_wr || max_sge as usize > MAX_SGE || limit >= max_wr {
        return Err(libc::EINVAL);
    }
    Ok(())
}

/// An address handle's attributes: port 1, and with a GRH a source GID index in the port's
/// table.
pub fn check_ah(a: &AhAttr) -> Result<(), i32> {
    if a.port_num == 0 {
        Err(libc::EINVAL)
    } else {
        check_av(a)
    }
}

/// A QP's address vector: as [`check_ah`], but port 0 stands for the QP's port (the engine
/// has always taken it so, and connection managers leave it 0).
fn check_av(a: &AhAttr) -> Result<(), i32> {
    if a.port_num > PORTS || (a.is_global && a.grh.sgid_index >= GIDS) {
        return Err(libc::EINVAL);
    }
    Ok(())
}

/// The attributes `ibv_modify_qp` sets (those named by `mask`) against the device's and the
/// port's limits. The state machine and each QP type's mask rules are the engine's.
pub fn check_qp_attr(mask: u32, a: &QpAttr) -> Result<(), i32> {
    let set = |bit: u32| mask & bit != 0;
    let bad = (set(qp_attr::PORT) && (a.port_num == 0 || a.port_num > PORTS))
        || (set(qp_attr::PKEY_INDEX) && a.pkey_index >= PKEYS)
        || (set(qp_attr::PATH_MTU) && !(1..=MAX_MTU).contains(&u32::from(a.path_mtu)))
        || (set(qp_attr::MAX_QP_RD_ATOMIC) && a.max_rd_atomic > MAX_RD_ATOM)
        || (set(qp_attr::MAX_DEST_RD_ATOMIC) && a.max_dest_rd_atomic > MAX_RD_ATOM)
        || (set(qp_attr::MIN_RNR_TIMER) && a.min_rnr_timer > 31)
        || (set(qp_attr::TIMEOUT) && a.timeout > 31)
        || (set(qp_attr::RETRY_CNT) && a.retry_cnt > 7)
        || (set(qp_attr::RNR_RETRY) && a.rnr_retry > 7)
        || (set(qp_attr::DEST_QPN) && a.dest_qp_num > 0xff_ffff)
        || (set(qp_attr::AV) && check_av(&a.ah_attr).is_err())
        || (set(qp_attr::ALT_PATH)
            && (check_av(&a.alt_ah_attr).is_err()
                || a.alt_pkey_index >= PKEYS
                || a.alt_port_num > PORTS));
    if bad { Err(libc::EINVAL) } else { Ok(()) }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn info() -> DeviceInfo {
        DeviceInfo {
            name: "t".into(),
            guid: 0,
            lid: 1,
            gid: [0; 16],
            max_qp: 4,
            max_qp_wr: 16384,
            max_cq: 4,
            max_cqe: 65536,
            max_mr: 4,
            max_pd: 4,
            max_mr_size: 1 << 30,
            max_srq: 4,
            max_mw: 4,
        }
    }

    #[test]
    fn a_cq_past_max_cqe_or_the_comp_vectors_is_einval() {
        let i = info();
        assert_eq!(check_cq(&i, 65536, 0), Ok(()));
        assert_eq!(check_cq(&i, 65537, 0), Err(libc::EINVAL));
        assert_eq!(check_cq(&i, 0, 0), Err(libc::EINVAL));
        assert_eq!(check_cq(&i, 1, i64::from(COMP_VECTORS)), Err(libc::EINVAL));
        assert_eq!(check_cq(&i, 1, -1), Err(libc::EINVAL));
    }

    #[test]
    fn qp_caps_past_the_device_are_einval() {
        let i = info();
        let ok = QpCap {
            max_send_wr: 16384,
            max_recv_wr: 16384,
            max_send_sge: 16,
            max_recv_sge: 16,
            max_inline_data: 256,
        };
        assert_eq!(check_qp_cap(&i, &ok), Ok(()));
        for f in [
            |c: &mut QpCap| c.max_send_wr += 1,
            |c: &mut QpCap| c.max_recv_wr += 1,
            |c: &mut QpCap| c.max_send_sge += 1,
            |c: &mut QpCap| c.max_recv_sge += 1,
            |c: &mut QpCap| c.max_inline_data += 1,
        ] {
            let mut c = ok;
            f(&mut c);
            assert_eq!(check_qp_cap(&i, &c), Err(libc::EINVAL));
        }
    }

    #[test]
    fn modify_attributes_past_the_device_are_einval() {
        let a = QpAttr {
            max_rd_atomic: MAX_RD_ATOM,
            max_dest_rd_atomic: MAX_RD_ATOM,
            port_num: 1,
            path_mtu: 5,
            ..QpAttr::default()
        };
        let all = qp_attr::MAX_QP_RD_ATOMIC
            | qp_attr::MAX_DEST_RD_ATOMIC
            | qp_attr::PORT
            | qp_attr::PATH_MTU
            | qp_attr::PKEY_INDEX;
        assert_eq!(check_qp_attr(all, &a), Ok(()));
        let over = |f: fn(&mut QpAttr)| {
            let mut b = a;
            f(&mut b);
            check_qp_attr(all, &b)
        };
        assert_eq!(over(|b| b.max_rd_atomic += 1), Err(libc::EINVAL));
        assert_eq!(over(|b| b.max_dest_rd_atomic += 1), Err(libc::EINVAL));
        assert_eq!(over(|b| b.port_num = 2), Err(libc::EINVAL));
        assert_eq!(over(|b| b.path_mtu = 6), Err(libc::EINVAL));
        assert_eq!(over(|b| b.pkey_index = 1), Err(libc::EINVAL));
        // Attributes the mask does not name are not looked at.
        let mut b = a;
        b.max_rd_atomic = 200;
        assert_eq!(check_qp_attr(qp_attr::PORT, &b), Ok(()));
    }
}
