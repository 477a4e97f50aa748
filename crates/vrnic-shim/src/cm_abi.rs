//! `#[repr(C)]` mirrors of librdmacm's public structs (`<rdma/rdma_cma.h>`, rdma-core 44) and
//! the constants the connection manager uses. `tests/layout_cm.rs` checks every size and
//! offset against the system header.
#![allow(non_camel_case_types)]
#![allow(missing_docs)]

use std::ffi::{c_char, c_int, c_uint, c_void};

use crate::abi::{
    ibv_ah_attr, ibv_comp_channel, ibv_context, ibv_cq, ibv_gid, ibv_pd, ibv_qp, ibv_srq,
};

pub const RDMA_PS_IPOIB: c_uint = 0x0002;
pub const RDMA_PS_TCP: c_uint = 0x0106;
pub const RDMA_PS_UDP: c_uint = 0x0111;
pub const RDMA_PS_IB: c_uint = 0x013F;
pub const RDMA_UDP_QKEY: u32 = 0x0123_4567;

pub const RAI_PASSIVE: c_int = 1;
pub const RAI_NUMERICHOST: c_int = 2;
pub const RAI_NOROUTE: c_int = 4;
pub const RAI_FAMILY: c_int = 8;

pub const RDMA_OPTION_ID: c_int = 0;
pub const RDMA_OPTION_IB: c_int = 1;
pub const RDMA_OPTION_ID_TOS: c_int = 0;
pub const RDMA_OPTION_ID_REUSEADDR: c_int = 1;
pub const RDMA_OPTION_ID_AFONLY: c_int = 2;
pub const RDMA_OPTION_ID_ACK_TIMEOUT: c_int = 3;
pub const RDMA_OPTION_IB_PATH: c_int = 1;

#[repr(C)]
pub struct rdma_event_channel {
    pub fd: c_int,
}

#[repr(C)]
#[derive(Clone, Copy)]
pub struct rdma_ib_addr {
    pub sgid: ibv_gid,
    pub dgid: ibv_gid,
    /// Big endian.
    pub pkey: u16,
}

/// `struct rdma_addr`: the anonymous `src`/`dst` unions are `sockaddr_storage`-sized.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct rdma_addr {
    pub src_storage: libc::sockaddr_storage,
    pub dst_storage: libc::sockaddr_storage,
    /// The `addr` union (`ibaddr` is its only member).
    pub ibaddr: rdma_ib_addr,
}

#[repr(C)]
#[derive(Clone, Copy)]
pub struct rdma_route {
    pub addr: rdma_addr,
    pub path_rec: *mut c_void,
    pub num_paths: c_int,
}

#[repr(C)]
pub struct rdma_cm_id {
    pub verbs: *mut ibv_context,
    pub channel: *mut rdma_event_channel,
    pub context: *mut c_void,
    pub qp: *mut ibv_qp,
    pub route: rdma_route,
    /// `enum rdma_port_space`.
    pub ps: c_uint,
    pub port_num: u8,
    pub event: *mut rdma_cm_event,
    pub send_cq_channel: *mut ibv_comp_channel,
    pub send_cq: *mut ibv_cq,
    pub recv_cq_channel: *mut ibv_comp_channel,
    pub recv_cq: *mut ibv_cq,
    pub srq: *mut ibv_srq,
    pub pd: *mut ibv_pd,
    /// `enum ibv_qp_type`.
    pub qp_type: c_uint,
}

#[repr(C)]
#[derive(Clone, Copy)]
pub struct rdma_conn_param {
    pub private_data: *const c_void,
    pub private_data_len: u8,
    pub responder_resources: u8,
    pub initiator_depth: u8,
    pub flow_control: u8,
    pub retry_count: u8,
    pub rnr_retry_count: u8,
    pub srq: u8,
    pub qp_num: u32,
}

#[repr(C)]
#[derive(Clone, Copy)]
pub struct rdma_ud_param {
    pub private_data: *const c_void,
    pub private_data_len: u8,
    pub ah_attr: ibv_ah_attr,
    pub qp_num: u32,
    pub qkey: u32,
}

#[repr(C)]
#[derive(Clone, Copy)]
pub union rdma_cm_event_param {
    pub conn: rdma_conn_param,
    pub ud: rdma_ud_param,
}

#[repr(C)]
pub struct rdma_cm_event {
    pub id: *mut rdma_cm_id,
    pub listen_id: *mut rdma_cm_id,
    /// `enum rdma_cm_event_type`.
    pub event: c_uint,
    pub status: c_int,
    pub param: rdma_cm_event_param,
}

#[repr(C)]
pub struct rdma_addrinfo {
    pub ai_flags: c_int,
    pub ai_family: c_int,
    pub ai_qp_type: c_int,
    pub ai_port_space: c_int,
    pub ai_src_len: libc::socklen_t,
    pub ai_dst_len: libc::socklen_t,
    pub ai_src_addr: *mut libc::sockaddr,
    pub ai_dst_addr: *mut libc::sockaddr,
    pub ai_src_canonname: *mut c_char,
    pub ai_dst_canonname: *mut c_char,
    pub ai_route_len: usize,
    pub ai_route: *mut c_void,
    pub ai_connect_len: usize,
    pub ai_connect: *mut c_void,
    pub ai_next: *mut rdma_addrinfo,
}
