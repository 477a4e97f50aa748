//! The `#[repr(C)]` mirrors in `abi.rs` against the installed rdma-core headers: a C probe
//! compiled with the system's `cc` prints sizes and offsets, and each must equal Rust's.
//! Also checks that the built driver library exports every symbol with rdma-core's version.

use std::collections::HashMap;
use std::mem::{offset_of, size_of};
use std::path::PathBuf;
use std::process::Command;

use vrnic_shim::abi::*;

macro_rules! table {
    ($($t:ident { $($f:ident),* })*) => {{
        let mut v: Vec<(String, usize)> = Vec::new();
        let mut c = String::new();
        $(
            v.push((stringify!($t).to_string(), size_of::<$t>()));
            c.push_str(&format!("P(\"{0}\", sizeof(struct {0}));\n", stringify!($t)));
            $(
                v.push((format!("{}.{}", stringify!($t), stringify!($f)), offset_of!($t, $f)));
                c.push_str(&format!("P(\"{0}.{1}\", offsetof(struct {0}, {1}));\n", stringify!($t), stringify!($f)));
            )*
        )*
        (v, c)
    }};
}

#[test]
fn abi_structs_match_the_system_headers() {
    let (rust, probes) = table! {
        ibv_device { node_type, transport_type, name, dev_name, dev_path, ibdev_path }
        ibv_context_ops { alloc_mw, bind_mw, dealloc_mw, poll_cq, req_notify_cq, post_srq_recv, post_send, post_recv }
        ibv_context { device, ops, cmd_fd, async_fd, num_comp_vectors, mutex, abi_compat }
        verbs_context { query_port, create_cq_ex, query_device_ex, create_qp_ex, create_srq_ex, open_xrcd, close_xrcd, sz, context }
        ibv_device_attr { fw_ver, node_guid, max_mr_size, max_qp, max_qp_wr, device_cap_flags, max_sge, max_cq, max_cqe, atomic_cap, max_srq_sge, max_pkeys, local_ca_ack_delay, phys_port_cnt }
        ibv_device_attr_ex { orig_attr, comp_mask, max_dm_size, pci_atomic_caps, xrc_odp_caps, phys_port_cnt_ex }
        ibv_port_attr { state, max_mtu, active_mtu, gid_tbl_len, max_msg_sz, pkey_tbl_len, lid, sm_lid, lmc, active_width, active_speed, phys_state, link_layer, flags, port_cap_flags2 }
        ibv_gid_entry { gid, gid_index, port_num, gid_type, ndev_ifindex }
        ibv_pd { context, handle }
        ibv_mr { context, pd, addr, length, handle, lkey, rkey }
        ibv_comp_channel { context, fd, refcnt }
        ibv_cq { context, channel, cq_context, handle, cqe, mutex, cond, comp_events_completed, async_events_completed }
        ibv_srq { context, srq_context, pd, handle, mutex, cond, events_completed }
        ibv_qp { context, qp_context, pd, send_cq, recv_cq, srq, handle, qp_num, state, qp_type, mutex, cond, events_completed }
        ibv_qp_cap { max_send_wr, max_recv_wr, max_send_sge, max_recv_sge, max_inline_data }
        ibv_qp_init_attr { qp_context, send_cq, recv_cq, srq, cap, qp_type, sq_sig_all }
        ibv_global_route { dgid, flow_label, sgid_index, hop_limit, traffic_class }
        ibv_ah_attr { grh, dlid, sl, src_path_bits, static_rate, is_global, port_num }
        ibv_qp_attr { qp_state, cur_qp_state, path_mtu, qkey, rq_psn, sq_psn, dest_qp_num, qp_access_flags, cap, ah_attr, alt_ah_attr, pkey_index, max_rd_atomic, max_dest_rd_atomic, min_rnr_timer, port_num, timeout, retry_cnt, rnr_retry, alt_timeout, rate_limit }
        ibv_ah { context, pd, handle }
        ibv_sge { addr, length, lkey }
        ibv_send_wr { wr_id, next, sg_list, num_sge, opcode, send_flags, imm_data, wr }
        ibv_recv_wr { wr_id, next, sg_list, num_sge }
        ibv_wc { wr_id, status, opcode, vendor_err, byte_len, imm_data, qp_num, src_qp, wc_flags, pkey_index, slid, sl, dlid_path_bits }
        ibv_async_event { element, event_type }
        ibv_mw { context, pd, rkey, handle }
        ibv_mw_bind { wr_id, send_flags, bind_info }
    };
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("layout-probe");
    std::fs::create_dir_all(&dir).expect("probe dir");
    let src = dir.join("probe.c");
    let consts = [
        ("IBV_NODE_CA", IBV_NODE_CA as i64),
        ("IBV_TRANSPORT_IB", IBV_TRANSPORT_IB as i64),
        (
            "IBV_LINK_LAYER_INFINIBAND",
            IBV_LINK_LAYER_INFINIBAND as i64,
        ),
        ("IBV_PORT_ACTIVE", IBV_PORT_ACTIVE as i64),
        ("IBV_MTU_4096", IBV_MTU_4096 as i64),
        ("IBV_ATOMIC_HCA", IBV_ATOMIC_HCA as i64),
        (
            "IBV_DEVICE_RC_RNR_NAK_GEN",
            IBV_DEVICE_RC_RNR_NAK_GEN as i64,
        ),
        (
            "IBV_DEVICE_PORT_ACTIVE_EVENT",
            IBV_DEVICE_PORT_ACTIVE_EVENT as i64,
        ),
        ("IBV_GID_TYPE_IB", IBV_GID_TYPE_IB as i64),
        ("IBV_QPT_RC", IBV_QPT_RC as i64),
        ("IBV_QPT_UC", IBV_QPT_UC as i64),
        ("IBV_QPT_UD", IBV_QPT_UD as i64),
        ("IBV_QPS_RESET", IBV_QPS_RESET as i64),
        ("IBV_QPS_RTS", IBV_QPS_RTS as i64),
        ("IBV_QPS_ERR", IBV_QPS_ERR as i64),
        ("IBV_EVENT_CQ_ERR", IBV_EVENT_CQ_ERR as i64),
        ("IBV_EVENT_QP_FATAL", IBV_EVENT_QP_FATAL as i64),
        ("IBV_EVENT_DEVICE_FATAL", IBV_EVENT_DEVICE_FATAL as i64),
        ("IBV_EVENT_PORT_ACTIVE", IBV_EVENT_PORT_ACTIVE as i64),
        ("IBV_WC_WITH_IMM", i64::from(vrnic_wire::WC_WITH_IMM)),
        ("IBV_WC_GRH", i64::from(vrnic_wire::WC_GRH)),
        (
            "IBV_SEND_SIGNALED",
            i64::from(vrnic_wire::SendFlags::SIGNALED.0),
        ),
        (
            "IBV_SEND_INLINE",
            i64::from(vrnic_wire::SendFlags::INLINE.0),
        ),
        ("IBV_SEND_FENCE", i64::from(vrnic_wire::SendFlags::FENCE.0)),
        (
            "IBV_SEND_SOLICITED",
            i64::from(vrnic_wire::SendFlags::SOLICITED.0),
        ),
        (
            "IBV_WC_RETRY_EXC_ERR",
            vrnic_wire::WcStatus::RetryExcErr as i64,
        ),
        (
            "IBV_WC_GENERAL_ERR",
            vrnic_wire::WcStatus::GeneralErr as i64,
        ),
        (
            "IBV_WC_RECV_RDMA_WITH_IMM",
            vrnic_wire::WcOpcode::RecvRdmaWithImm as i64,
        ),
        (
            "IBV_WR_ATOMIC_FETCH_AND_ADD",
            vrnic_wire::SendOpcode::AtomicFetchAndAdd as i64,
        ),
        ("IBV_QP_DEST_QPN", i64::from(vrnic_wire::qp_attr::DEST_QPN)),
        (
            "IBV_QP_RATE_LIMIT",
            i64::from(vrnic_wire::qp_attr::RATE_LIMIT),
        ),
        (
            "IBV_ACCESS_RELAXED_ORDERING",
            i64::from(vrnic_wire::access::RELAXED_ORDERING),
        ),
    ];
    let mut c = String::from(
        "#include <stddef.h>\n#include <stdio.h>\n#include <infiniband/verbs.h>\n\
         #define P(n, v) printf(\"%s %zu\\n\", n, (size_t)(v))\nint main(void) {\n",
    );
    c.push_str(&probes);
    for (name, _) in &consts {
        c.push_str(&format!("printf(\"{name} %lld\\n\", (long long){name});\n"));
    }
    c.push_str("return 0; }\n");
    std::fs::write(&src, c).expect("write probe");
    let bin = dir.join("probe");
    let cc = Command::new("cc")
        .arg("-o")
        .arg(&bin)
        .arg(&src)
        .output()
        .expect("run cc: install gcc and libibverbs-dev (bash scripts/test does)");
    assert!(
        cc.status.success(),
        "probe build failed (is libibverbs-dev installed?):\n{}",
        String::from_utf8_lossy(&cc.stderr)
    );
    let out = Command::new(&bin).output().expect("run probe");
    let text = String::from_utf8_lossy(&out.stdout);
    let c_side: HashMap<&str, i64> = text
        .lines()
        .filter_map(|l| l.split_once(' '))
        .map(|(k, v)| (k, v.parse().expect("number")))
        .collect();
    let mut bad = Vec::new();
    for (name, value) in &rust {
        match c_side.get(name.as_str()) {
            Some(&v) if v == *value as i64 => {}
            other => bad.push(format!("{name}: rust {value}, C {other:?}")),
        }
    }
    for (name, value) in &consts {
        if c_side.get(name) != Some(value) {
            bad.push(format!("{name}: rust {value}, C {:?}", c_side.get(name)));
        }
    }
    assert!(
        bad.is_empty(),
        "ABI mismatches with the system headers:\n{}",
        bad.join("\n")
    );
}

#[test]
fn every_export_carries_rdma_core_version() {
    let lib = std::env::var_os("VRNIC_BIN")
        .map(|b| PathBuf::from(b).with_file_name("libvrnic_shim.so"))
        .unwrap_or_else(|| {
            PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../target/release/libvrnic_shim.so")
        });
    if !lib.exists() {
        panic!(
            "{} not built: run `cargo build --release --workspace` first (scripts/test does)",
            lib.display()
        );
    }
    let out = Command::new("readelf")
        .args(["-W", "--dyn-syms"])
        .arg(&lib)
        .output()
        .expect("readelf (binutils)");
    let syms = String::from_utf8_lossy(&out.stdout);
    for (sym, ver) in vrnic_shim::EXPORTS {
        let want = format!(" {sym}@@{ver}");
        assert!(
            syms.lines().any(|l| l.ends_with(&want)),
            "{sym}@@{ver} not exported by {}",
            lib.display()
        );
    }
}
