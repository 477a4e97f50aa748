//! The `#[repr(C)]` mirrors in `abi.rs` and `cm_abi.rs` against the installed rdma-core
//! headers: a C probe compiled with the system's `cc` against `<infiniband/verbs.h>` and
//! `<rdma/rdma_cma.h>` (and `<linux/userfaultfd.h>`, for `vrnic_shm::freeze`) prints the size, alignment and field offsets of every mirrored type and
//! the value of every constant, and each must equal
//! Rust's. Also checks that the built driver library exports every symbol with rdma-core's
//! version.
//!
//! A missing `cc` or header is a failure, not a skip: install `gcc`, `libibverbs-dev` and `librdmacm-dev`
//! (`scripts/test` does).

use std::collections::HashMap;
use std::mem::{align_of, offset_of, size_of};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{SystemTime, UNIX_EPOCH};

use libc::{pthread_cond_t, pthread_mutex_t};
use vrnic_shim::abi::*;

/// One number both sides must agree on: a label, Rust's value and the C expression.
struct Probe {
    key: String,
    rust: i128,
    c_expr: String,
}

/// `kind name { field, nested.field, rust.path => "c.path", .. };` for each mirrored type:
/// probes its size, alignment and the listed field offsets. `kind` is `struct`, `union` or
/// `typedef`; `=> "c.path"` names the C member where Rust had to rename it.
macro_rules! layout {
    ($($kind:ident $t:ident { $($($f:ident).+ $(=> $cf:literal)?),* $(,)? })*) => {{
        let mut v: Vec<Probe> = Vec::new();
        $(
            let name = stringify!($t);
            let ctype = match stringify!($kind) {
                "typedef" => name.to_string(),
                kind => format!("{kind} {name}"),
            };
            v.push(Probe {
                key: format!("sizeof({name})"),
                rust: size_of::<$t>() as i128,
                c_expr: format!("sizeof({ctype})"),
            });
            v.push(Probe {
                key: format!("alignof({name})"),
                rust: align_of::<$t>() as i128,
                c_expr: format!("_Alignof({ctype})"),
            });
            $(
                let rust_path = [$(stringify!($f)),+].join(".");
                #[allow(unused_mut, unused_assignments)]
                let mut c_path = rust_path.clone();
                $(c_path = $cf.to_string();)?
                v.push(Probe {
                    key: format!("{name}.{c_path}"),
                    rust: offset_of!($t, $($f).+) as i128,
                    c_expr: format!("offsetof({ctype}, {c_path})"),
                });
            )*
        )*
        v
    }};
}

fn layout_probes() -> Vec<Probe> {
    layout! {
        typedef pthread_mutex_t {}
        typedef pthread_cond_t {}
        union ibv_gid { raw, global, global.subnet_prefix, global.interface_id }
        struct ibv_gid_entry { gid, gid_index, port_num, gid_type, ndev_ifindex }
        struct _ibv_device_ops { _dummy1, _dummy2 }
        struct ibv_device { _ops, node_type, transport_type, name, dev_name, dev_path, ibdev_path }
        struct ibv_context_ops {
            _compat_query_device, _compat_query_port, _compat_alloc_pd, _compat_dealloc_pd,
            _compat_reg_mr, _compat_rereg_mr, _compat_dereg_mr, alloc_mw, bind_mw, dealloc_mw,
            _compat_create_cq, poll_cq, req_notify_cq, _compat_cq_event, _compat_resize_cq,
            _compat_destroy_cq, _compat_create_srq, _compat_modify_srq, _compat_query_srq,
            _compat_destroy_srq, post_srq_recv, _compat_create_qp, _compat_query_qp,
            _compat_modify_qp, _compat_destroy_qp, post_send, post_recv, _compat_create_ah,
            _compat_destroy_ah, _compat_attach_mcast, _compat_detach_mcast, _compat_async_event,
        }
        struct ibv_context {
            device, ops, ops.poll_cq, ops.post_send, cmd_fd, async_fd, num_comp_vectors, mutex,
            abi_compat,
        }
        struct verbs_context {
            query_port, advise_mr, alloc_null_mr, read_counters, attach_counters_point_flow,
            create_counters, destroy_counters, reg_dm_mr, alloc_dm, free_dm,
            modify_flow_action_esp, destroy_flow_action, create_flow_action_esp,
            modify_qp_rate_limit, alloc_parent_domain, dealloc_td, alloc_td, modify_cq,
            post_srq_ops, destroy_rwq_ind_table, create_rwq_ind_table, destroy_wq, modify_wq,
            create_wq, query_rt_values, create_cq_ex, priv_ => "priv", query_device_ex,
            ibv_destroy_flow, ABI_placeholder2, ibv_create_flow, ABI_placeholder1, open_qp,
            create_qp_ex, get_srq_num, create_srq_ex, open_xrcd, close_xrcd, _ABI_placeholder3,
            sz, context, context.abi_compat,
        }
        struct ibv_device_attr {
            fw_ver, node_guid, sys_image_guid, max_mr_size, page_size_cap, vendor_id,
            vendor_part_id, hw_ver, max_qp, max_qp_wr, device_cap_flags, max_sge, max_sge_rd,
            max_cq, max_cqe, max_mr, max_pd, max_qp_rd_atom, max_ee_rd_atom, max_res_rd_atom,
            max_qp_init_rd_atom, max_ee_init_rd_atom, atomic_cap, max_ee, max_rdd, max_mw,
            max_raw_ipv6_qp, max_raw_ethy_qp, max_mcast_grp, max_mcast_qp_attach,
            max_total_mcast_qp_attach, max_ah, max_fmr, max_map_per_fmr, max_srq, max_srq_wr,
            max_srq_sge, max_pkeys, local_ca_ack_delay, phys_port_cnt,
        }
        struct ibv_query_device_ex_input { comp_mask }
        struct ibv_odp_caps {
            general_caps, per_transport_caps, per_transport_caps.rc_odp_caps,
            per_transport_caps.uc_odp_caps, per_transport_caps.ud_odp_caps,
        }
        struct ibv_tso_caps { max_tso, supported_qpts }
        struct ibv_rss_caps {
            supported_qpts, max_rwq_indirection_tables, max_rwq_indirection_table_size,
            rx_hash_fields_mask, rx_hash_function,
        }
        struct ibv_packet_pacing_caps { qp_rate_limit_min, qp_rate_limit_max, supported_qpts }
        struct ibv_tm_caps { max_rndv_hdr_size, max_num_tags, flags, max_ops, max_sge }
        struct ibv_cq_moderation_caps { max_cq_count, max_cq_period }
        struct ibv_pci_atomic_caps { fetch_add, swap, compare_swap }
        struct ibv_device_attr_ex {
            orig_attr, orig_attr.phys_port_cnt, comp_mask, odp_caps, completion_timestamp_mask,
            hca_core_clock, device_cap_flags_ex, tso_caps, rss_caps, max_wq_type_rq,
            packet_pacing_caps, raw_packet_caps, tm_caps, cq_mod_caps, max_dm_size,
            pci_atomic_caps, xrc_odp_caps, phys_port_cnt_ex,
        }
        struct ibv_port_attr {
            state, max_mtu, active_mtu, gid_tbl_len, port_cap_flags, max_msg_sz, bad_pkey_cntr,
            qkey_viol_cntr, pkey_tbl_len, lid, sm_lid, lmc, max_vl_num, sm_sl, subnet_timeout,
            init_type_reply, active_width, active_speed, phys_state, link_layer, flags,
            port_cap_flags2,
        }
        struct ibv_values_ex { comp_mask, raw_clock }
        struct ibv_pd { context, handle }
        struct ibv_mr { context, pd, addr, length, handle, lkey, rkey }
        struct ibv_mw { context, pd, rkey, handle, type_ => "type" }
        struct ibv_mw_bind_info { mr, addr, length, mw_access_flags }
        struct ibv_mw_bind { wr_id, send_flags, bind_info }
        struct ibv_xrcd { context }
        struct ibv_xrcd_init_attr { comp_mask, fd, oflags }
        struct ibv_td { context }
        struct ibv_td_init_attr { comp_mask }
        struct ibv_parent_domain_init_attr { pd, td, comp_mask, alloc, free, pd_context }
        struct ibv_alloc_dm_attr { length, log_align_req, comp_mask }
        struct ibv_dm { context, memcpy_to_dm, memcpy_from_dm, comp_mask, handle }
        struct ibv_counters { context }
        struct ibv_counters_init_attr { comp_mask }
        struct ibv_counter_attach_attr { counter_desc, index, comp_mask }
        struct ibv_flow_attr {
            comp_mask, type_ => "type", size, priority, num_of_specs, port, flags,
        }
        struct ibv_flow { comp_mask, context, handle }
        struct ibv_flow_action { context }
        struct ibv_flow_action_esp_attr {
            esp_attr, keymat_proto, keymat_len, keymat_ptr, replay_proto, replay_len,
            replay_ptr, esp_encap, comp_mask, esn,
        }
        struct ibv_comp_channel { context, fd, refcnt }
        struct ibv_cq {
            context, channel, cq_context, handle, cqe, mutex, cond, comp_events_completed,
            async_events_completed,
        }
        struct ibv_poll_cq_attr { comp_mask }
        struct ibv_wc_tm_info { tag, priv_ => "priv" }
        struct ibv_cq_ex {
            context, channel, cq_context, handle, cqe, mutex, cond, comp_events_completed,
            async_events_completed, comp_mask, status, wr_id, start_poll, next_poll, end_poll,
            read_opcode, read_vendor_err, read_byte_len, read_imm_data, read_qp_num,
            read_src_qp, read_wc_flags, read_slid, read_sl, read_dlid_path_bits,
            read_completion_ts, read_cvlan, read_flow_tag, read_tm_info,
            read_completion_wallclock_ns,
        }
        struct ibv_cq_init_attr_ex {
            cqe, cq_context, channel, comp_vector, wc_flags, comp_mask, flags, parent_domain,
        }
        struct ibv_moderate_cq { cq_count, cq_period }
        struct ibv_modify_cq_attr { attr_mask, moderate }
        struct ibv_srq {
            context, srq_context, pd, handle, mutex, cond, events_completed,
        }
        struct ibv_srq_attr { max_wr, max_sge, srq_limit }
        struct ibv_srq_init_attr { srq_context, attr }
        struct ibv_tm_cap { max_num_tags, max_ops }
        struct ibv_srq_init_attr_ex {
            srq_context, attr, comp_mask, srq_type, pd, xrcd, cq, tm_cap,
        }
        struct ibv_ops_wr {
            wr_id, next, opcode, flags, tm, tm.unexpected_cnt, tm.handle, tm.add,
            tm.add.recv_wr_id, tm.add.sg_list, tm.add.num_sge, tm.add.tag, tm.add.mask,
        }
        struct ibv_wq {
            context, wq_context, pd, cq, wq_num, handle, state, wq_type, post_recv, mutex, cond,
            events_completed, comp_mask,
        }
        struct ibv_wq_init_attr {
            wq_context, wq_type, max_wr, max_sge, pd, cq, comp_mask, create_flags,
        }
        struct ibv_wq_attr { attr_mask, wq_state, curr_wq_state, flags, flags_mask }
        struct ibv_rwq_ind_table { context, ind_tbl_handle, ind_tbl_num, comp_mask }
        struct ibv_rwq_ind_table_init_attr { log_ind_tbl_size, ind_tbl, comp_mask }
        struct ibv_qp {
            context, qp_context, pd, send_cq, recv_cq, srq, handle, qp_num, state, qp_type,
            mutex, cond, events_completed,
        }
        struct ibv_qp_ex {
            qp_base, qp_base.qp_num, comp_mask, wr_id, wr_flags, wr_atomic_cmp_swp,
            wr_atomic_fetch_add, wr_bind_mw, wr_local_inv, wr_rdma_read, wr_rdma_write,
            wr_rdma_write_imm, wr_send, wr_send_imm, wr_send_inv, wr_send_tso, wr_set_ud_addr,
            wr_set_xrc_srqn, wr_set_inline_data, wr_set_inline_data_list, wr_set_sge,
            wr_set_sge_list, wr_start, wr_complete, wr_abort, wr_atomic_write,
        }
        struct ibv_qp_cap {
            max_send_wr, max_recv_wr, max_send_sge, max_recv_sge, max_inline_data,
        }
        struct ibv_qp_init_attr {
            qp_context, send_cq, recv_cq, srq, cap, cap.max_inline_data, qp_type, sq_sig_all,
        }
        struct ibv_rx_hash_conf {
            rx_hash_function, rx_hash_key_len, rx_hash_key, rx_hash_fields_mask,
        }
        struct ibv_qp_init_attr_ex {
            qp_context, send_cq, recv_cq, srq, cap, qp_type, sq_sig_all, comp_mask, pd, xrcd,
            create_flags, max_tso_header, rwq_ind_tbl, rx_hash_conf, source_qpn, send_ops_flags,
        }
        struct ibv_qp_open_attr { comp_mask, qp_num, xrcd, qp_context, qp_type }
        struct ibv_qp_rate_limit_attr { rate_limit, max_burst_sz, typical_pkt_sz, comp_mask }
        struct ibv_global_route { dgid, flow_label, sgid_index, hop_limit, traffic_class }
        struct ibv_grh { version_tclass_flow, paylen, next_hdr, hop_limit, sgid, dgid }
        struct ibv_ah_attr {
            grh, grh.dgid, grh.flow_label, grh.sgid_index, grh.hop_limit, grh.traffic_class,
            dlid, sl, src_path_bits, static_rate, is_global, port_num,
        }
        struct ibv_qp_attr {
            qp_state, cur_qp_state, path_mtu, path_mig_state, qkey, rq_psn, sq_psn,
            dest_qp_num, qp_access_flags, cap, ah_attr, ah_attr.grh.sgid_index, ah_attr.dlid,
            ah_attr.is_global, ah_attr.port_num, alt_ah_attr, pkey_index, alt_pkey_index,
            en_sqd_async_notify, sq_draining, max_rd_atomic, max_dest_rd_atomic, min_rnr_timer,
            port_num, timeout, retry_cnt, rnr_retry, alt_port_num, alt_timeout, rate_limit,
        }
        struct ibv_ece { vendor_id, options, comp_mask }
        struct ibv_ah { context, pd, handle }
        struct ibv_sge { addr, length, lkey }
        struct ibv_data_buf { addr, length }
        struct ibv_send_wr {
            wr_id, next, sg_list, num_sge, opcode, send_flags, imm_data,
            imm_data => "invalidate_rkey", wr, wr.rdma.remote_addr, wr.rdma.rkey,
            wr.atomic.remote_addr, wr.atomic.compare_add, wr.atomic.swap, wr.atomic.rkey,
            wr.ud.ah, wr.ud.remote_qpn, wr.ud.remote_qkey, qp_type, qp_type.xrc.remote_srqn,
            bind_mw_or_tso.bind_mw => "bind_mw", bind_mw_or_tso.bind_mw.mw => "bind_mw.mw",
            bind_mw_or_tso.bind_mw.rkey => "bind_mw.rkey",
            bind_mw_or_tso.bind_mw.bind_info => "bind_mw.bind_info",
            bind_mw_or_tso.bind_mw.bind_info.mw_access_flags => "bind_mw.bind_info.mw_access_flags",
            bind_mw_or_tso.tso => "tso", bind_mw_or_tso.tso.hdr => "tso.hdr",
            bind_mw_or_tso.tso.hdr_sz => "tso.hdr_sz", bind_mw_or_tso.tso.mss => "tso.mss",
        }
        struct ibv_recv_wr { wr_id, next, sg_list, num_sge }
        struct ibv_wc {
            wr_id, status, opcode, vendor_err, byte_len, imm_data,
            imm_data => "invalidated_rkey", qp_num, src_qp, wc_flags, pkey_index, slid, sl,
            dlid_path_bits,
        }
        struct ibv_async_event {
            element, element.cq, element.qp, element.srq, element.wq, element.port_num,
            event_type,
        }
    }
}

/// librdmacm's structs (`cm_abi.rs`) against `<rdma/rdma_cma.h>`.
fn cm_layout_probes() -> Vec<Probe> {
    use vrnic_shim::cm_abi::*;
    layout! {
        struct rdma_event_channel { fd }
        struct rdma_ib_addr { sgid, dgid, pkey }
        struct rdma_addr { src_storage, dst_storage, ibaddr => "addr.ibaddr" }
        struct rdma_route { addr, path_rec, num_paths }
        struct rdma_cm_id {
            verbs, channel, context, qp, route, ps, port_num, event, send_cq_channel, send_cq,
            recv_cq_channel, recv_cq, srq, pd, qp_type,
        }
        struct rdma_conn_param {
            private_data, private_data_len, responder_resources, initiator_depth, flow_control,
            retry_count, rnr_retry_count, srq, qp_num,
        }
        struct rdma_ud_param { private_data, private_data_len, ah_attr, qp_num, qkey }
        struct rdma_cm_event {
            id, listen_id, event, status, param, param.conn, param.ud, param.ud.qkey,
        }
        struct rdma_addrinfo {
            ai_flags, ai_family, ai_qp_type, ai_port_space, ai_src_len, ai_dst_len, ai_src_addr,
            ai_dst_addr, ai_src_canonname, ai_dst_canonname, ai_route_len, ai_route,
            ai_connect_len, ai_connect, ai_next,
        }
    }
}

/// The userfaultfd structs `vrnic_shm::freeze` mirrors, against `<linux/userfaultfd.h>`.
fn uffd_layout_probes() -> Vec<Probe> {
    use vrnic_shm::freeze::uffd::*;
    layout! {
        struct uffdio_api { api, features, ioctls }
        struct uffdio_range { start, len }
        struct uffdio_register { range, mode, ioctls }
        struct uffdio_writeprotect { range, mode }
    }
}

/// The userfaultfd constants `vrnic_shm::freeze` mirrors.
fn uffd_constants() -> Vec<(&'static str, i128)> {
    use vrnic_shm::freeze::uffd::*;
    vec![
        ("UFFD_API", UFFD_API.into()),
        ("UFFD_USER_MODE_ONLY", UFFD_USER_MODE_ONLY.into()),
        (
            "UFFD_FEATURE_WP_HUGETLBFS_SHMEM",
            UFFD_FEATURE_WP_HUGETLBFS_SHMEM.into(),
        ),
        ("UFFDIO_REGISTER_MODE_WP", UFFDIO_REGISTER_MODE_WP.into()),
        (
            "UFFDIO_WRITEPROTECT_MODE_WP",
            UFFDIO_WRITEPROTECT_MODE_WP.into(),
        ),
        ("UFFDIO_API", UFFDIO_API.into()),
        ("UFFDIO_REGISTER", UFFDIO_REGISTER.into()),
        ("UFFDIO_WRITEPROTECT", UFFDIO_WRITEPROTECT.into()),
    ]
}

/// librdmacm constants `cm_abi.rs` mirrors.
fn cm_constants() -> Vec<(&'static str, i128)> {
    use vrnic_shim::cm_abi::*;
    vec![
        ("RDMA_PS_IPOIB", RDMA_PS_IPOIB.into()),
        ("RDMA_PS_TCP", RDMA_PS_TCP.into()),
        ("RDMA_PS_UDP", RDMA_PS_UDP.into()),
        ("RDMA_PS_IB", RDMA_PS_IB.into()),
        ("RDMA_UDP_QKEY", RDMA_UDP_QKEY.into()),
        ("RAI_PASSIVE", RAI_PASSIVE.into()),
        ("RAI_NUMERICHOST", RAI_NUMERICHOST.into()),
        ("RAI_NOROUTE", RAI_NOROUTE.into()),
        ("RAI_FAMILY", RAI_FAMILY.into()),
        ("RDMA_OPTION_ID", RDMA_OPTION_ID.into()),
        ("RDMA_OPTION_IB", RDMA_OPTION_IB.into()),
        ("RDMA_OPTION_ID_TOS", RDMA_OPTION_ID_TOS.into()),
        ("RDMA_OPTION_ID_REUSEADDR", RDMA_OPTION_ID_REUSEADDR.into()),
        ("RDMA_OPTION_ID_AFONLY", RDMA_OPTION_ID_AFONLY.into()),
        (
            "RDMA_OPTION_ID_ACK_TIMEOUT",
            RDMA_OPTION_ID_ACK_TIMEOUT.into(),
        ),
        ("RDMA_OPTION_IB_PATH", RDMA_OPTION_IB_PATH.into()),
        (
            "RDMA_CM_EVENT_ADDR_RESOLVED",
            vrnic_api::cm_event::ADDR_RESOLVED.into(),
        ),
        (
            "RDMA_CM_EVENT_ADDR_ERROR",
            vrnic_api::cm_event::ADDR_ERROR.into(),
        ),
        (
            "RDMA_CM_EVENT_ROUTE_RESOLVED",
            vrnic_api::cm_event::ROUTE_RESOLVED.into(),
        ),
        (
            "RDMA_CM_EVENT_CONNECT_REQUEST",
            vrnic_api::cm_event::CONNECT_REQUEST.into(),
        ),
        (
            "RDMA_CM_EVENT_CONNECT_RESPONSE",
            vrnic_api::cm_event::CONNECT_RESPONSE.into(),
        ),
        (
            "RDMA_CM_EVENT_UNREACHABLE",
            vrnic_api::cm_event::UNREACHABLE.into(),
        ),
        (
            "RDMA_CM_EVENT_REJECTED",
            vrnic_api::cm_event::REJECTED.into(),
        ),
        (
            "RDMA_CM_EVENT_ESTABLISHED",
            vrnic_api::cm_event::ESTABLISHED.into(),
        ),
        (
            "RDMA_CM_EVENT_DISCONNECTED",
            vrnic_api::cm_event::DISCONNECTED.into(),
        ),
        (
            "RDMA_CM_EVENT_DEVICE_REMOVAL",
            vrnic_api::cm_event::DEVICE_REMOVAL.into(),
        ),
    ]
}

/// Constants that `vrnic-wire` (the daemon protocol) mirrors from verbs.h, checked here too.
fn wire_constants() -> Vec<(&'static str, i128)> {
    vec![
        ("IBV_WC_WITH_IMM", i128::from(vrnic_wire::WC_WITH_IMM)),
        ("IBV_WC_GRH", i128::from(vrnic_wire::WC_GRH)),
        (
            "IBV_SEND_SIGNALED",
            i128::from(vrnic_wire::SendFlags::SIGNALED.0),
        ),
        (
            "IBV_SEND_INLINE",
            i128::from(vrnic_wire::SendFlags::INLINE.0),
        ),
        ("IBV_SEND_FENCE", i128::from(vrnic_wire::SendFlags::FENCE.0)),
        (
            "IBV_SEND_SOLICITED",
            i128::from(vrnic_wire::SendFlags::SOLICITED.0),
        ),
        (
            "IBV_WC_RETRY_EXC_ERR",
            vrnic_wire::WcStatus::RetryExcErr as i128,
        ),
        (
            "IBV_WC_GENERAL_ERR",
            vrnic_wire::WcStatus::GeneralErr as i128,
        ),
        (
            "IBV_WC_RECV_RDMA_WITH_IMM",
            vrnic_wire::WcOpcode::RecvRdmaWithImm as i128,
        ),
        (
            "IBV_WR_ATOMIC_FETCH_AND_ADD",
            vrnic_wire::SendOpcode::AtomicFetchAndAdd as i128,
        ),
        (
            "IBV_WR_ATOMIC_WRITE",
            vrnic_wire::SendOpcode::AtomicWrite as i128,
        ),
        (
            "IBV_WC_ATOMIC_WRITE",
            vrnic_wire::WcOpcode::AtomicWrite as i128,
        ),
        ("IBV_QP_DEST_QPN", i128::from(vrnic_wire::qp_attr::DEST_QPN)),
        (
            "IBV_QP_RATE_LIMIT",
            i128::from(vrnic_wire::qp_attr::RATE_LIMIT),
        ),
        (
            "IBV_ACCESS_RELAXED_ORDERING",
            i128::from(vrnic_wire::access::RELAXED_ORDERING),
        ),
    ]
}

const INSTALL_HINT: &str = "install gcc, libibverbs-dev and librdmacm-dev \
    (`apt-get install gcc libibverbs-dev librdmacm-dev`; scripts/test installs them)";

/// A fresh directory under the system temp dir.
fn unique_dir() -> PathBuf {
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or(0);
    let dir =
        std::env::temp_dir().join(format!("vrnic-layout-probe-{}-{nanos}", std::process::id()));
    std::fs::create_dir_all(&dir)
        .unwrap_or_else(|e| panic!("cannot create probe dir {}: {e}", dir.display()));
    dir
}

/// Writes, compiles and runs the C probe; returns `key -> value` as C sees it.
fn run_probe(dir: &Path, lines: &[(String, String)]) -> HashMap<String, i128> {
    let mut c = String::from(
        "#include <stddef.h>\n#include <stdio.h>\n#include <pthread.h>\n\
         #include <infiniband/verbs.h>\n#include <rdma/rdma_cma.h>\n\
         #include <sys/ioctl.h>\n#include <linux/userfaultfd.h>\n\nint main(void)\n{\n",
    );
    for (key, expr) in lines {
        c.push_str(&format!(
            "\tprintf(\"%s %lld\\n\", \"{key}\", (long long)({expr}));\n"
        ));
    }
    c.push_str("\treturn 0;\n}\n");
    let src = dir.join("probe.c");
    let bin = dir.join("probe");
    std::fs::write(&src, c).expect("write probe.c");
    let out = match Command::new("cc")
        .args(["-std=gnu11", "-o"])
        .arg(&bin)
        .arg(&src)
        .output()
    {
        Ok(out) => out,
        Err(e) => panic!("cannot run `cc` ({e}): {INSTALL_HINT}"),
    };
    let stderr = String::from_utf8_lossy(&out.stderr);
    if !out.status.success() {
        if stderr.contains("infiniband/verbs.h") && stderr.contains("No such file") {
            panic!("<infiniband/verbs.h> not found: {INSTALL_HINT}\n{stderr}");
        }
        panic!(
            "the C layout probe {} does not compile against the installed verbs.h \
             (a field or constant mirrored in abi.rs is missing from the header?):\n{stderr}",
            src.display()
        );
    }
    let run = Command::new(&bin)
        .output()
        .unwrap_or_else(|e| panic!("cannot run {}: {e}", bin.display()));
    assert!(run.status.success(), "{} failed: {:?}", bin.display(), run);
    String::from_utf8_lossy(&run.stdout)
        .lines()
        .map(|l| {
            let (k, v) = l
                .rsplit_once(' ')
                .unwrap_or_else(|| panic!("bad probe line {l:?}"));
            let v = v
                .parse()
                .unwrap_or_else(|e| panic!("bad number in probe line {l:?}: {e}"));
            (k.to_string(), v)
        })
        .collect()
}

#[test]
fn abi_matches_the_installed_verbs_header() {
    let mut layout = layout_probes();
    layout.extend(cm_layout_probes());
    layout.extend(uffd_layout_probes());
    let consts: Vec<(String, i128)> = ABI_CONSTANTS
        .iter()
        .map(|&(n, v)| (format!("const {n}"), v))
        .chain(
            wire_constants()
                .into_iter()
                .map(|(n, v)| (format!("vrnic_wire {n}"), v)),
        )
        .chain(
            cm_constants()
                .into_iter()
                .map(|(n, v)| (format!("librdmacm {n}"), v)),
        )
        .chain(
            uffd_constants()
                .into_iter()
                .map(|(n, v)| (format!("userfaultfd {n}"), v)),
        )
        .collect();
    let mut lines: Vec<(String, String)> = layout
        .iter()
        .map(|p| (p.key.clone(), p.c_expr.clone()))
        .collect();
    for (key, _) in &consts {
        let name = key.rsplit(' ').next().unwrap_or(key);
        lines.push((key.clone(), name.to_string()));
    }
    let expected: Vec<(&str, i128)> = layout
        .iter()
        .map(|p| (p.key.as_str(), p.rust))
        .chain(consts.iter().map(|(k, v)| (k.as_str(), *v)))
        .collect();

    let dir = unique_dir();
    let c_side = run_probe(&dir, &lines);

    let mut bad = Vec::new();
    for (key, rust) in &expected {
        match c_side.get(*key) {
            Some(c) if c == rust => {}
            Some(c) => bad.push(format!("  {key}: Rust {rust}, C {c}")),
            None => bad.push(format!(
                "  {key}: Rust {rust}, missing from the probe output"
            )),
        }
    }
    assert!(
        bad.is_empty(),
        "{} of {} ABI checks differ from <infiniband/verbs.h> (probe kept in {}):\n{}",
        bad.len(),
        expected.len(),
        dir.display(),
        bad.join("\n")
    );
    let _ = std::fs::remove_dir_all(&dir);
    // The checks above must cover something: guard against an empty table.
    assert!(expected.len() > 500, "only {} checks", expected.len());
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
