//! Hand-written `#[repr(C)]` mirrors of the rdma-core 44 `infiniband/verbs.h` types (Debian 12,
//! x86_64) that the driver library hands to C or reads from it. No bindgen: these numbers are
//! the ABI, so every struct is pinned here by `const` size/offset asserts (the values measured
//! from the installed headers), and `tests/layout.rs` compiles a C probe against
//! `<infiniband/verbs.h>` and compares every size, alignment, field offset and constant.
//!
//! Conventions:
//! - C names are kept (`ibv_device`, `verbs_context`, ...), fields are named as in C; a Rust
//!   keyword gets a trailing underscore (`type_`, `priv_`).
//! - Anonymous C structs/unions become named types `<parent>_<member>` (`ibv_gid_global`,
//!   `ibv_send_wr_wr`, ...). Anonymous members that C reaches without a name: the `imm_data` /
//!   `invalidate_rkey` union of two `u32`s is the field `imm_data` plus accessors; the
//!   `bind_mw`/`tso` union of `ibv_send_wr` is the field `bind_mw_or_tso`.
//! - Function-pointer slots are `Option<unsafe extern "C" fn(..)>` with the C signature (a NULL
//!   slot is `None`); the legacy `_compat_*` slots keep their C type, `void *(*)(void)`.
//! - Types the driver never looks into (`verbs_ex_private`, the ESP keymat structs) are opaque.
//! - C enums are `c_uint` (or `c_int` where the enum has negative values); each constant has
//!   the type of the field or argument it goes into. Every constant is also listed in
//!   [`ABI_CONSTANTS`], which the layout test checks against the header.
//!
//! Plain-data types (attributes, work requests, completions) derive `Clone`/`Copy`; objects
//! with identity (contexts, CQs, QPs, ... holding a `pthread_mutex_t`) do not.
#![allow(non_camel_case_types, missing_docs)]

use std::marker::{PhantomData, PhantomPinned};
use std::mem::{align_of, offset_of, size_of};

use libc::{c_char, c_int, c_uint, c_void, pthread_cond_t, pthread_mutex_t, timespec};

/// Declares the ABI constants and the [`ABI_CONSTANTS`] table listing them all.
macro_rules! abi_consts {
    ($( $(#[$m:meta])* $name:ident : $ty:ty = $val:expr; )*) => {
        $( $(#[$m])* pub const $name: $ty = $val; )*
        /// Every constant of this module with its value, for the layout test.
        pub const ABI_CONSTANTS: &[(&str, i128)] = &[$((stringify!($name), $name as i128)),*];
    };
}

/// An incomplete C type: only ever behind a pointer.
macro_rules! opaque {
    ($($(#[$m:meta])* $name:ident;)*) => {$(
        $(#[$m])*
        #[repr(C)]
        pub struct $name {
            _data: [u8; 0],
            _marker: PhantomData<(*mut u8, PhantomPinned)>,
        }
    )*};
}

// ---- sizes the driver allocates ---------------------------------------------------------------

/// `sizeof(struct ibv_device)`.
pub const IBV_DEVICE_SIZE: usize = 664;
/// Offset of the `verbs_device` ops word that providers (libmlx5, libefa) read right after the
/// `ibv_device` (rdma-core's private `struct verbs_device`, 712 bytes in v44).
pub const VERBS_DEVICE_OPS_OFFSET: usize = IBV_DEVICE_SIZE;
/// `sizeof(struct verbs_device)` in rdma-core 44 (private `driver.h`).
pub const VERBS_DEVICE_SIZE: usize = 712;
/// Bytes to allocate for a device handed to C: an `ibv_device`, then zeroes covering the whole
/// private `verbs_device` (so its ops word reads NULL), rounded up with headroom.
pub const VRNIC_DEVICE_ALLOC_SIZE: usize = 768;
const _: () = assert!(VRNIC_DEVICE_ALLOC_SIZE >= VERBS_DEVICE_SIZE);
const _: () = assert!(size_of::<ibv_device>() == IBV_DEVICE_SIZE);

// ---- constants ---------------------------------------------------------------------------------

abi_consts! {
    IBV_SYSFS_NAME_MAX: usize = 64;
    IBV_SYSFS_PATH_MAX: usize = 256;

    // enum ibv_gid_type (ibv_gid_entry.gid_type)
    IBV_GID_TYPE_IB: u32 = 0;
    IBV_GID_TYPE_ROCE_V1: u32 = 1;
    IBV_GID_TYPE_ROCE_V2: u32 = 2;

    // enum ibv_node_type
    IBV_NODE_UNKNOWN: c_int = -1;
    IBV_NODE_CA: c_int = 1;
    IBV_NODE_SWITCH: c_int = 2;
    IBV_NODE_ROUTER: c_int = 3;
    IBV_NODE_RNIC: c_int = 4;
    IBV_NODE_USNIC: c_int = 5;
    IBV_NODE_USNIC_UDP: c_int = 6;
    IBV_NODE_UNSPECIFIED: c_int = 7;

    // enum ibv_transport_type
    IBV_TRANSPORT_UNKNOWN: c_int = -1;
    IBV_TRANSPORT_IB: c_int = 0;
    IBV_TRANSPORT_IWARP: c_int = 1;
    IBV_TRANSPORT_USNIC: c_int = 2;
    IBV_TRANSPORT_USNIC_UDP: c_int = 3;
    IBV_TRANSPORT_UNSPECIFIED: c_int = 4;

    // enum ibv_device_cap_flags (ibv_device_attr.device_cap_flags)
    IBV_DEVICE_RESIZE_MAX_WR: c_uint = 1;
    IBV_DEVICE_BAD_PKEY_CNTR: c_uint = 1 << 1;
    IBV_DEVICE_BAD_QKEY_CNTR: c_uint = 1 << 2;
    IBV_DEVICE_RAW_MULTI: c_uint = 1 << 3;
    IBV_DEVICE_AUTO_PATH_MIG: c_uint = 1 << 4;
    IBV_DEVICE_CHANGE_PHY_PORT: c_uint = 1 << 5;
    IBV_DEVICE_UD_AV_PORT_ENFORCE: c_uint = 1 << 6;
    IBV_DEVICE_CURR_QP_STATE_MOD: c_uint = 1 << 7;
    IBV_DEVICE_SHUTDOWN_PORT: c_uint = 1 << 8;
    IBV_DEVICE_INIT_TYPE: c_uint = 1 << 9;
    IBV_DEVICE_PORT_ACTIVE_EVENT: c_uint = 1 << 10;
    IBV_DEVICE_SYS_IMAGE_GUID: c_uint = 1 << 11;
    IBV_DEVICE_RC_RNR_NAK_GEN: c_uint = 1 << 12;
    IBV_DEVICE_SRQ_RESIZE: c_uint = 1 << 13;
    IBV_DEVICE_N_NOTIFY_CQ: c_uint = 1 << 14;
    IBV_DEVICE_MEM_WINDOW: c_uint = 1 << 17;
    IBV_DEVICE_UD_IP_CSUM: c_uint = 1 << 18;
    IBV_DEVICE_XRC: c_uint = 1 << 20;
    IBV_DEVICE_MEM_MGT_EXTENSIONS: c_uint = 1 << 21;
    IBV_DEVICE_MEM_WINDOW_TYPE_2A: c_uint = 1 << 23;
    IBV_DEVICE_MEM_WINDOW_TYPE_2B: c_uint = 1 << 24;
    IBV_DEVICE_RC_IP_CSUM: c_uint = 1 << 25;
    IBV_DEVICE_RAW_IP_CSUM: c_uint = 1 << 26;
    IBV_DEVICE_MANAGED_FLOW_STEERING: c_uint = 1 << 29;
    // (ibv_device_attr_ex.device_cap_flags_ex only)
    IBV_DEVICE_RAW_SCATTER_FCS: u64 = 1 << 34;
    IBV_DEVICE_PCI_WRITE_END_PADDING: u64 = 1 << 36;

    // enum ibv_atomic_cap
    IBV_ATOMIC_NONE: c_uint = 0;
    IBV_ATOMIC_HCA: c_uint = 1;
    IBV_ATOMIC_GLOB: c_uint = 2;

    // enum ibv_odp_general_caps / ibv_odp_transport_cap_bits
    IBV_ODP_SUPPORT: u64 = 1;
    IBV_ODP_SUPPORT_IMPLICIT: u64 = 1 << 1;
    IBV_ODP_SUPPORT_SEND: u32 = 1;
    IBV_ODP_SUPPORT_RECV: u32 = 1 << 1;
    IBV_ODP_SUPPORT_WRITE: u32 = 1 << 2;
    IBV_ODP_SUPPORT_READ: u32 = 1 << 3;
    IBV_ODP_SUPPORT_ATOMIC: u32 = 1 << 4;
    IBV_ODP_SUPPORT_SRQ_RECV: u32 = 1 << 5;

    // enum ibv_pci_atomic_op_size (ibv_pci_atomic_caps)
    IBV_PCI_ATOMIC_OPERATION_4_BYTE_SIZE_SUP: u16 = 1;
    IBV_PCI_ATOMIC_OPERATION_8_BYTE_SIZE_SUP: u16 = 1 << 1;
    IBV_PCI_ATOMIC_OPERATION_16_BYTE_SIZE_SUP: u16 = 1 << 2;

    // enum ibv_mtu
    IBV_MTU_256: c_uint = 1;
    IBV_MTU_512: c_uint = 2;
    IBV_MTU_1024: c_uint = 3;
    IBV_MTU_2048: c_uint = 4;
    IBV_MTU_4096: c_uint = 5;

    // enum ibv_port_state
    IBV_PORT_NOP: c_uint = 0;
    IBV_PORT_DOWN: c_uint = 1;
    IBV_PORT_INIT: c_uint = 2;
    IBV_PORT_ARMED: c_uint = 3;
    IBV_PORT_ACTIVE: c_uint = 4;
    IBV_PORT_ACTIVE_DEFER: c_uint = 5;

    // ibv_port_attr.link_layer
    IBV_LINK_LAYER_UNSPECIFIED: u8 = 0;
    IBV_LINK_LAYER_INFINIBAND: u8 = 1;
    IBV_LINK_LAYER_ETHERNET: u8 = 2;

    // enum ibv_port_cap_flags (ibv_port_attr.port_cap_flags), the ones a CA port reports
    IBV_PORT_SM: u32 = 1 << 1;
    IBV_PORT_SYS_IMAGE_GUID_SUP: u32 = 1 << 11;
    IBV_PORT_CM_SUP: u32 = 1 << 16;
    IBV_PORT_IP_BASED_GIDS: u32 = 1 << 26;

    // enum ibv_event_type
    IBV_EVENT_CQ_ERR: c_uint = 0;
    IBV_EVENT_QP_FATAL: c_uint = 1;
    IBV_EVENT_QP_REQ_ERR: c_uint = 2;
    IBV_EVENT_QP_ACCESS_ERR: c_uint = 3;
    IBV_EVENT_COMM_EST: c_uint = 4;
    IBV_EVENT_SQ_DRAINED: c_uint = 5;
    IBV_EVENT_PATH_MIG: c_uint = 6;
    IBV_EVENT_PATH_MIG_ERR: c_uint = 7;
    IBV_EVENT_DEVICE_FATAL: c_uint = 8;
    IBV_EVENT_PORT_ACTIVE: c_uint = 9;
    IBV_EVENT_PORT_ERR: c_uint = 10;
    IBV_EVENT_LID_CHANGE: c_uint = 11;
    IBV_EVENT_PKEY_CHANGE: c_uint = 12;
    IBV_EVENT_SM_CHANGE: c_uint = 13;
    IBV_EVENT_SRQ_ERR: c_uint = 14;
    IBV_EVENT_SRQ_LIMIT_REACHED: c_uint = 15;
    IBV_EVENT_QP_LAST_WQE_REACHED: c_uint = 16;
    IBV_EVENT_CLIENT_REREGISTER: c_uint = 17;
    IBV_EVENT_GID_CHANGE: c_uint = 18;
    IBV_EVENT_WQ_FATAL: c_uint = 19;

    // enum ibv_wc_status
    IBV_WC_SUCCESS: c_uint = 0;
    IBV_WC_LOC_LEN_ERR: c_uint = 1;
    IBV_WC_LOC_QP_OP_ERR: c_uint = 2;
    IBV_WC_LOC_EEC_OP_ERR: c_uint = 3;
    IBV_WC_LOC_PROT_ERR: c_uint = 4;
    IBV_WC_WR_FLUSH_ERR: c_uint = 5;
    IBV_WC_MW_BIND_ERR: c_uint = 6;
    IBV_WC_BAD_RESP_ERR: c_uint = 7;
    IBV_WC_LOC_ACCESS_ERR: c_uint = 8;
    IBV_WC_REM_INV_REQ_ERR: c_uint = 9;
    IBV_WC_REM_ACCESS_ERR: c_uint = 10;
    IBV_WC_REM_OP_ERR: c_uint = 11;
    IBV_WC_RETRY_EXC_ERR: c_uint = 12;
    IBV_WC_RNR_RETRY_EXC_ERR: c_uint = 13;
    IBV_WC_LOC_RDD_VIOL_ERR: c_uint = 14;
    IBV_WC_REM_INV_RD_REQ_ERR: c_uint = 15;
    IBV_WC_REM_ABORT_ERR: c_uint = 16;
    IBV_WC_INV_EECN_ERR: c_uint = 17;
    IBV_WC_INV_EEC_STATE_ERR: c_uint = 18;
    IBV_WC_FATAL_ERR: c_uint = 19;
    IBV_WC_RESP_TIMEOUT_ERR: c_uint = 20;
    IBV_WC_GENERAL_ERR: c_uint = 21;
    IBV_WC_TM_ERR: c_uint = 22;
    IBV_WC_TM_RNDV_INCOMPLETE: c_uint = 23;

    // enum ibv_wc_opcode
    IBV_WC_SEND: c_uint = 0;
    IBV_WC_RDMA_WRITE: c_uint = 1;
    IBV_WC_RDMA_READ: c_uint = 2;
    IBV_WC_COMP_SWAP: c_uint = 3;
    IBV_WC_FETCH_ADD: c_uint = 4;
    IBV_WC_BIND_MW: c_uint = 5;
    IBV_WC_LOCAL_INV: c_uint = 6;
    IBV_WC_TSO: c_uint = 7;
    IBV_WC_ATOMIC_WRITE: c_uint = 9;
    IBV_WC_RECV: c_uint = 1 << 7;
    IBV_WC_RECV_RDMA_WITH_IMM: c_uint = (1 << 7) + 1;
    IBV_WC_TM_ADD: c_uint = (1 << 7) + 2;
    IBV_WC_TM_DEL: c_uint = (1 << 7) + 3;
    IBV_WC_TM_SYNC: c_uint = (1 << 7) + 4;
    IBV_WC_TM_RECV: c_uint = (1 << 7) + 5;
    IBV_WC_TM_NO_TAG: c_uint = (1 << 7) + 6;
    IBV_WC_DRIVER1: c_uint = (1 << 7) + 7;
    IBV_WC_DRIVER2: c_uint = (1 << 7) + 8;
    IBV_WC_DRIVER3: c_uint = (1 << 7) + 9;

    // enum ibv_wc_flags (ibv_wc.wc_flags)
    IBV_WC_IP_CSUM_OK_SHIFT: c_uint = 2;
    IBV_WC_GRH: c_uint = 1;
    IBV_WC_WITH_IMM: c_uint = 1 << 1;
    IBV_WC_IP_CSUM_OK: c_uint = 1 << 2;
    IBV_WC_WITH_INV: c_uint = 1 << 3;
    IBV_WC_TM_SYNC_REQ: c_uint = 1 << 4;
    IBV_WC_TM_MATCH: c_uint = 1 << 5;
    IBV_WC_TM_DATA_VALID: c_uint = 1 << 6;

    // enum ibv_create_cq_wc_flags (ibv_cq_init_attr_ex.wc_flags)
    IBV_WC_EX_WITH_BYTE_LEN: u64 = 1;
    IBV_WC_EX_WITH_IMM: u64 = 1 << 1;
    IBV_WC_EX_WITH_QP_NUM: u64 = 1 << 2;
    IBV_WC_EX_WITH_SRC_QP: u64 = 1 << 3;
    IBV_WC_EX_WITH_SLID: u64 = 1 << 4;
    IBV_WC_EX_WITH_SL: u64 = 1 << 5;
    IBV_WC_EX_WITH_DLID_PATH_BITS: u64 = 1 << 6;
    IBV_WC_EX_WITH_COMPLETION_TIMESTAMP: u64 = 1 << 7;
    IBV_WC_EX_WITH_CVLAN: u64 = 1 << 8;
    IBV_WC_EX_WITH_FLOW_TAG: u64 = 1 << 9;
    IBV_WC_EX_WITH_TM_INFO: u64 = 1 << 10;
    IBV_WC_EX_WITH_COMPLETION_TIMESTAMP_WALLCLOCK: u64 = 1 << 11;
    IBV_WC_STANDARD_FLAGS: u64 = IBV_WC_EX_WITH_BYTE_LEN
        | IBV_WC_EX_WITH_IMM
        | IBV_WC_EX_WITH_QP_NUM
        | IBV_WC_EX_WITH_SRC_QP
        | IBV_WC_EX_WITH_SLID
        | IBV_WC_EX_WITH_SL
        | IBV_WC_EX_WITH_DLID_PATH_BITS;
    IBV_CREATE_CQ_SUP_WC_FLAGS: u64 = IBV_WC_STANDARD_FLAGS
        | IBV_WC_EX_WITH_COMPLETION_TIMESTAMP
        | IBV_WC_EX_WITH_CVLAN
        | IBV_WC_EX_WITH_FLOW_TAG
        | IBV_WC_EX_WITH_TM_INFO
        | IBV_WC_EX_WITH_COMPLETION_TIMESTAMP_WALLCLOCK;

    // enum ibv_cq_init_attr_mask (ibv_cq_init_attr_ex.comp_mask)
    IBV_CQ_INIT_ATTR_MASK_FLAGS: u32 = 1;
    IBV_CQ_INIT_ATTR_MASK_PD: u32 = 1 << 1;
    // enum ibv_create_cq_attr_flags (ibv_cq_init_attr_ex.flags)
    IBV_CREATE_CQ_ATTR_SINGLE_THREADED: u32 = 1;
    IBV_CREATE_CQ_ATTR_IGNORE_OVERRUN: u32 = 1 << 1;
    // enum ibv_cq_attr_mask (ibv_modify_cq_attr.attr_mask)
    IBV_CQ_ATTR_MODERATE: u32 = 1;

    // enum ibv_access_flags
    IBV_ACCESS_LOCAL_WRITE: c_uint = 1;
    IBV_ACCESS_REMOTE_WRITE: c_uint = 1 << 1;
    IBV_ACCESS_REMOTE_READ: c_uint = 1 << 2;
    IBV_ACCESS_REMOTE_ATOMIC: c_uint = 1 << 3;
    IBV_ACCESS_MW_BIND: c_uint = 1 << 4;
    IBV_ACCESS_ZERO_BASED: c_uint = 1 << 5;
    IBV_ACCESS_ON_DEMAND: c_uint = 1 << 6;
    IBV_ACCESS_HUGETLB: c_uint = 1 << 7;
    IBV_ACCESS_RELAXED_ORDERING: c_uint = 1 << 20;

    // enum ibv_mw_type
    IBV_MW_TYPE_1: c_uint = 1;
    IBV_MW_TYPE_2: c_uint = 2;

    // enum ibv_xrcd_init_attr_mask
    IBV_XRCD_INIT_ATTR_FD: u32 = 1;
    IBV_XRCD_INIT_ATTR_OFLAGS: u32 = 1 << 1;

    // enum ibv_srq_attr_mask (ibv_modify_srq's int attr_mask)
    IBV_SRQ_MAX_WR: c_int = 1;
    IBV_SRQ_LIMIT: c_int = 1 << 1;
    // enum ibv_srq_type
    IBV_SRQT_BASIC: c_uint = 0;
    IBV_SRQT_XRC: c_uint = 1;
    IBV_SRQT_TM: c_uint = 2;
    // enum ibv_srq_init_attr_mask (ibv_srq_init_attr_ex.comp_mask)
    IBV_SRQ_INIT_ATTR_TYPE: u32 = 1;
    IBV_SRQ_INIT_ATTR_PD: u32 = 1 << 1;
    IBV_SRQ_INIT_ATTR_XRCD: u32 = 1 << 2;
    IBV_SRQ_INIT_ATTR_CQ: u32 = 1 << 3;
    IBV_SRQ_INIT_ATTR_TM: u32 = 1 << 4;

    // enum ibv_wq_type / ibv_wq_state
    IBV_WQT_RQ: c_uint = 0;
    IBV_WQS_RESET: c_uint = 0;
    IBV_WQS_RDY: c_uint = 1;
    IBV_WQS_ERR: c_uint = 2;
    IBV_WQS_UNKNOWN: c_uint = 3;

    // enum ibv_qp_type
    IBV_QPT_RC: c_uint = 2;
    IBV_QPT_UC: c_uint = 3;
    IBV_QPT_UD: c_uint = 4;
    IBV_QPT_RAW_PACKET: c_uint = 8;
    IBV_QPT_XRC_SEND: c_uint = 9;
    IBV_QPT_XRC_RECV: c_uint = 10;
    IBV_QPT_DRIVER: c_uint = 0xff;

    // enum ibv_qp_init_attr_mask (ibv_qp_init_attr_ex.comp_mask)
    IBV_QP_INIT_ATTR_PD: u32 = 1;
    IBV_QP_INIT_ATTR_XRCD: u32 = 1 << 1;
    IBV_QP_INIT_ATTR_CREATE_FLAGS: u32 = 1 << 2;
    IBV_QP_INIT_ATTR_MAX_TSO_HEADER: u32 = 1 << 3;
    IBV_QP_INIT_ATTR_IND_TABLE: u32 = 1 << 4;
    IBV_QP_INIT_ATTR_RX_HASH: u32 = 1 << 5;
    IBV_QP_INIT_ATTR_SEND_OPS_FLAGS: u32 = 1 << 6;

    // enum ibv_qp_create_flags (ibv_qp_init_attr_ex.create_flags)
    IBV_QP_CREATE_BLOCK_SELF_MCAST_LB: u32 = 1 << 1;
    IBV_QP_CREATE_SCATTER_FCS: u32 = 1 << 8;
    IBV_QP_CREATE_CVLAN_STRIPPING: u32 = 1 << 9;
    IBV_QP_CREATE_SOURCE_QPN: u32 = 1 << 10;
    IBV_QP_CREATE_PCI_WRITE_END_PADDING: u32 = 1 << 11;

    // enum ibv_qp_create_send_ops_flags (ibv_qp_init_attr_ex.send_ops_flags)
    IBV_QP_EX_WITH_RDMA_WRITE: u64 = 1;
    IBV_QP_EX_WITH_RDMA_WRITE_WITH_IMM: u64 = 1 << 1;
    IBV_QP_EX_WITH_SEND: u64 = 1 << 2;
    IBV_QP_EX_WITH_SEND_WITH_IMM: u64 = 1 << 3;
    IBV_QP_EX_WITH_RDMA_READ: u64 = 1 << 4;
    IBV_QP_EX_WITH_ATOMIC_CMP_AND_SWP: u64 = 1 << 5;
    IBV_QP_EX_WITH_ATOMIC_FETCH_AND_ADD: u64 = 1 << 6;
    IBV_QP_EX_WITH_LOCAL_INV: u64 = 1 << 7;
    IBV_QP_EX_WITH_BIND_MW: u64 = 1 << 8;
    IBV_QP_EX_WITH_SEND_WITH_INV: u64 = 1 << 9;
    IBV_QP_EX_WITH_TSO: u64 = 1 << 10;
    IBV_QP_EX_WITH_ATOMIC_WRITE: u64 = 1 << 12;

    // enum ibv_qp_open_attr_mask
    IBV_QP_OPEN_ATTR_NUM: u32 = 1;
    IBV_QP_OPEN_ATTR_XRCD: u32 = 1 << 1;
    IBV_QP_OPEN_ATTR_CONTEXT: u32 = 1 << 2;
    IBV_QP_OPEN_ATTR_TYPE: u32 = 1 << 3;

    // enum ibv_qp_attr_mask (the int attr_mask of ibv_modify_qp / ibv_query_qp)
    IBV_QP_STATE: c_int = 1;
    IBV_QP_CUR_STATE: c_int = 1 << 1;
    IBV_QP_EN_SQD_ASYNC_NOTIFY: c_int = 1 << 2;
    IBV_QP_ACCESS_FLAGS: c_int = 1 << 3;
    IBV_QP_PKEY_INDEX: c_int = 1 << 4;
    IBV_QP_PORT: c_int = 1 << 5;
    IBV_QP_QKEY: c_int = 1 << 6;
    IBV_QP_AV: c_int = 1 << 7;
    IBV_QP_PATH_MTU: c_int = 1 << 8;
    IBV_QP_TIMEOUT: c_int = 1 << 9;
    IBV_QP_RETRY_CNT: c_int = 1 << 10;
    IBV_QP_RNR_RETRY: c_int = 1 << 11;
    IBV_QP_RQ_PSN: c_int = 1 << 12;
    IBV_QP_MAX_QP_RD_ATOMIC: c_int = 1 << 13;
    IBV_QP_ALT_PATH: c_int = 1 << 14;
    IBV_QP_MIN_RNR_TIMER: c_int = 1 << 15;
    IBV_QP_SQ_PSN: c_int = 1 << 16;
    IBV_QP_MAX_DEST_RD_ATOMIC: c_int = 1 << 17;
    IBV_QP_PATH_MIG_STATE: c_int = 1 << 18;
    IBV_QP_CAP: c_int = 1 << 19;
    IBV_QP_DEST_QPN: c_int = 1 << 20;
    IBV_QP_RATE_LIMIT: c_int = 1 << 25;

    // enum ibv_qp_state
    IBV_QPS_RESET: c_uint = 0;
    IBV_QPS_INIT: c_uint = 1;
    IBV_QPS_RTR: c_uint = 2;
    IBV_QPS_RTS: c_uint = 3;
    IBV_QPS_SQD: c_uint = 4;
    IBV_QPS_SQE: c_uint = 5;
    IBV_QPS_ERR: c_uint = 6;
    IBV_QPS_UNKNOWN: c_uint = 7;

    // enum ibv_mig_state
    IBV_MIG_MIGRATED: c_uint = 0;
    IBV_MIG_REARM: c_uint = 1;
    IBV_MIG_ARMED: c_uint = 2;

    // enum ibv_wr_opcode
    IBV_WR_RDMA_WRITE: c_uint = 0;
    IBV_WR_RDMA_WRITE_WITH_IMM: c_uint = 1;
    IBV_WR_SEND: c_uint = 2;
    IBV_WR_SEND_WITH_IMM: c_uint = 3;
    IBV_WR_RDMA_READ: c_uint = 4;
    IBV_WR_ATOMIC_CMP_AND_SWP: c_uint = 5;
    IBV_WR_ATOMIC_FETCH_AND_ADD: c_uint = 6;
    IBV_WR_LOCAL_INV: c_uint = 7;
    IBV_WR_BIND_MW: c_uint = 8;
    IBV_WR_SEND_WITH_INV: c_uint = 9;
    IBV_WR_TSO: c_uint = 10;
    IBV_WR_DRIVER1: c_uint = 11;
    IBV_WR_ATOMIC_WRITE: c_uint = 15;

    // enum ibv_send_flags (ibv_send_wr.send_flags, ibv_qp_ex.wr_flags)
    IBV_SEND_FENCE: c_uint = 1;
    IBV_SEND_SIGNALED: c_uint = 1 << 1;
    IBV_SEND_SOLICITED: c_uint = 1 << 2;
    IBV_SEND_INLINE: c_uint = 1 << 3;
    IBV_SEND_IP_CSUM: c_uint = 1 << 4;

    // enum ibv_values_mask (ibv_values_ex.comp_mask)
    IBV_VALUES_MASK_RAW_CLOCK: u32 = 1;
}

// ---- GIDs ---------------------------------------------------------------------------------------

/// `union ibv_gid`'s `global` member; both fields are big endian.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct ibv_gid_global {
    pub subnet_prefix: u64,
    pub interface_id: u64,
}

#[repr(C)]
#[derive(Clone, Copy)]
pub union ibv_gid {
    pub raw: [u8; 16],
    pub global: ibv_gid_global,
}

#[repr(C)]
#[derive(Clone, Copy)]
pub struct ibv_gid_entry {
    pub gid: ibv_gid,
    pub gid_index: u32,
    pub port_num: u32,
    /// `enum ibv_gid_type`.
    pub gid_type: u32,
    pub ndev_ifindex: u32,
}

// ---- devices and contexts -----------------------------------------------------------------------

/// Obsolete, never used; NULL.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct _ibv_device_ops {
    pub _dummy1: Option<unsafe extern "C" fn(*mut ibv_device, c_int) -> *mut ibv_context>,
    pub _dummy2: Option<unsafe extern "C" fn(*mut ibv_context)>,
}

#[repr(C)]
#[derive(Clone, Copy)]
pub struct ibv_device {
    pub _ops: _ibv_device_ops,
    /// `enum ibv_node_type`.
    pub node_type: c_int,
    /// `enum ibv_transport_type`.
    pub transport_type: c_int,
    pub name: [c_char; IBV_SYSFS_NAME_MAX],
    pub dev_name: [c_char; IBV_SYSFS_NAME_MAX],
    pub dev_path: [c_char; IBV_SYSFS_PATH_MAX],
    pub ibdev_path: [c_char; IBV_SYSFS_PATH_MAX],
}

opaque! {
    /// The pre-1.1 `ibv_port_attr` of the `_compat_query_port` slot.
    _compat_ibv_port_attr;
    /// libibverbs-private part of the extended context.
    verbs_ex_private;
    ibv_flow_action_esp;
    ibv_flow_action_esp_encap;
}

/// A legacy slot of `ibv_context_ops`, `void *(*)(void)` in C; always NULL.
pub type CompatSlot = Option<unsafe extern "C" fn() -> *mut c_void>;

pub type PollCq = unsafe extern "C" fn(*mut ibv_cq, c_int, *mut ibv_wc) -> c_int;
pub type ReqNotifyCq = unsafe extern "C" fn(*mut ibv_cq, c_int) -> c_int;
pub type PostSend =
    unsafe extern "C" fn(*mut ibv_qp, *mut ibv_send_wr, *mut *mut ibv_send_wr) -> c_int;
pub type PostRecv =
    unsafe extern "C" fn(*mut ibv_qp, *mut ibv_recv_wr, *mut *mut ibv_recv_wr) -> c_int;
pub type PostSrqRecv =
    unsafe extern "C" fn(*mut ibv_srq, *mut ibv_recv_wr, *mut *mut ibv_recv_wr) -> c_int;

/// `struct ibv_context_ops`: the data-path table the `static inline` verbs call through with no
/// NULL check.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct ibv_context_ops {
    pub _compat_query_device:
        Option<unsafe extern "C" fn(*mut ibv_context, *mut ibv_device_attr) -> c_int>,
    pub _compat_query_port:
        Option<unsafe extern "C" fn(*mut ibv_context, u8, *mut _compat_ibv_port_attr) -> c_int>,
    pub _compat_alloc_pd: CompatSlot,
    pub _compat_dealloc_pd: CompatSlot,
    pub _compat_reg_mr: CompatSlot,
    pub _compat_rereg_mr: CompatSlot,
    pub _compat_dereg_mr: CompatSlot,
    /// `type` is `enum ibv_mw_type`.
    pub alloc_mw: Option<unsafe extern "C" fn(*mut ibv_pd, c_uint) -> *mut ibv_mw>,
    pub bind_mw: Option<unsafe extern "C" fn(*mut ibv_qp, *mut ibv_mw, *mut ibv_mw_bind) -> c_int>,
    pub dealloc_mw: Option<unsafe extern "C" fn(*mut ibv_mw) -> c_int>,
    pub _compat_create_cq: CompatSlot,
    pub poll_cq: Option<PollCq>,
    pub req_notify_cq: Option<ReqNotifyCq>,
    pub _compat_cq_event: CompatSlot,
    pub _compat_resize_cq: CompatSlot,
    pub _compat_destroy_cq: CompatSlot,
    pub _compat_create_srq: CompatSlot,
    pub _compat_modify_srq: CompatSlot,
    pub _compat_query_srq: CompatSlot,
    pub _compat_destroy_srq: CompatSlot,
    pub post_srq_recv: Option<PostSrqRecv>,
    pub _compat_create_qp: CompatSlot,
    pub _compat_query_qp: CompatSlot,
    pub _compat_modify_qp: CompatSlot,
    pub _compat_destroy_qp: CompatSlot,
    pub post_send: Option<PostSend>,
    pub post_recv: Option<PostRecv>,
    pub _compat_create_ah: CompatSlot,
    pub _compat_destroy_ah: CompatSlot,
    pub _compat_attach_mcast: CompatSlot,
    pub _compat_detach_mcast: CompatSlot,
    pub _compat_async_event: CompatSlot,
}

#[repr(C)]
pub struct ibv_context {
    pub device: *mut ibv_device,
    pub ops: ibv_context_ops,
    pub cmd_fd: c_int,
    pub async_fd: c_int,
    pub num_comp_vectors: c_int,
    pub mutex: pthread_mutex_t,
    /// `(void *)UINTPTR_MAX` marks the context as the last member of a [`verbs_context`].
    pub abi_compat: *mut c_void,
}

pub type QueryPort = unsafe extern "C" fn(*mut ibv_context, u8, *mut ibv_port_attr, usize) -> c_int;
pub type QueryDeviceEx = unsafe extern "C" fn(
    *mut ibv_context,
    *const ibv_query_device_ex_input,
    *mut ibv_device_attr_ex,
    usize,
) -> c_int;

/// `struct verbs_context`: the extended context; the app's `ibv_context` is its last member.
/// It grows toward lower addresses: an op at offset `o` is used only if
/// `sz >= size_of::<verbs_context>() - o` and the slot is non-NULL.
#[repr(C)]
#[allow(non_snake_case)]
pub struct verbs_context {
    pub query_port: Option<QueryPort>,
    /// `advice` is `enum ibv_advise_mr_advice`.
    pub advise_mr:
        Option<unsafe extern "C" fn(*mut ibv_pd, c_uint, u32, *mut ibv_sge, u32) -> c_int>,
    pub alloc_null_mr: Option<unsafe extern "C" fn(*mut ibv_pd) -> *mut ibv_mr>,
    pub read_counters: Option<unsafe extern "C" fn(*mut ibv_counters, *mut u64, u32, u32) -> c_int>,
    pub attach_counters_point_flow: Option<
        unsafe extern "C" fn(
            *mut ibv_counters,
            *mut ibv_counter_attach_attr,
            *mut ibv_flow,
        ) -> c_int,
    >,
    pub create_counters: Option<
        unsafe extern "C" fn(*mut ibv_context, *mut ibv_counters_init_attr) -> *mut ibv_counters,
    >,
    pub destroy_counters: Option<unsafe extern "C" fn(*mut ibv_counters) -> c_int>,
    /// `access` is `unsigned int`.
    pub reg_dm_mr:
        Option<unsafe extern "C" fn(*mut ibv_pd, *mut ibv_dm, u64, usize, c_uint) -> *mut ibv_mr>,
    pub alloc_dm:
        Option<unsafe extern "C" fn(*mut ibv_context, *mut ibv_alloc_dm_attr) -> *mut ibv_dm>,
    pub free_dm: Option<unsafe extern "C" fn(*mut ibv_dm) -> c_int>,
    pub modify_flow_action_esp:
        Option<unsafe extern "C" fn(*mut ibv_flow_action, *mut ibv_flow_action_esp_attr) -> c_int>,
    pub destroy_flow_action: Option<unsafe extern "C" fn(*mut ibv_flow_action) -> c_int>,
    pub create_flow_action_esp: Option<
        unsafe extern "C" fn(
            *mut ibv_context,
            *mut ibv_flow_action_esp_attr,
        ) -> *mut ibv_flow_action,
    >,
    pub modify_qp_rate_limit:
        Option<unsafe extern "C" fn(*mut ibv_qp, *mut ibv_qp_rate_limit_attr) -> c_int>,
    pub alloc_parent_domain: Option<
        unsafe extern "C" fn(*mut ibv_context, *mut ibv_parent_domain_init_attr) -> *mut ibv_pd,
    >,
    pub dealloc_td: Option<unsafe extern "C" fn(*mut ibv_td) -> c_int>,
    pub alloc_td:
        Option<unsafe extern "C" fn(*mut ibv_context, *mut ibv_td_init_attr) -> *mut ibv_td>,
    pub modify_cq: Option<unsafe extern "C" fn(*mut ibv_cq, *mut ibv_modify_cq_attr) -> c_int>,
    pub post_srq_ops:
        Option<unsafe extern "C" fn(*mut ibv_srq, *mut ibv_ops_wr, *mut *mut ibv_ops_wr) -> c_int>,
    pub destroy_rwq_ind_table: Option<unsafe extern "C" fn(*mut ibv_rwq_ind_table) -> c_int>,
    pub create_rwq_ind_table: Option<
        unsafe extern "C" fn(
            *mut ibv_context,
            *mut ibv_rwq_ind_table_init_attr,
        ) -> *mut ibv_rwq_ind_table,
    >,
    pub destroy_wq: Option<unsafe extern "C" fn(*mut ibv_wq) -> c_int>,
    pub modify_wq: Option<unsafe extern "C" fn(*mut ibv_wq, *mut ibv_wq_attr) -> c_int>,
    pub create_wq:
        Option<unsafe extern "C" fn(*mut ibv_context, *mut ibv_wq_init_attr) -> *mut ibv_wq>,
    pub query_rt_values:
        Option<unsafe extern "C" fn(*mut ibv_context, *mut ibv_values_ex) -> c_int>,
    pub create_cq_ex:
        Option<unsafe extern "C" fn(*mut ibv_context, *mut ibv_cq_init_attr_ex) -> *mut ibv_cq_ex>,
    /// `priv` in C.
    pub priv_: *mut verbs_ex_private,
    pub query_device_ex: Option<QueryDeviceEx>,
    pub ibv_destroy_flow: Option<unsafe extern "C" fn(*mut ibv_flow) -> c_int>,
    pub ABI_placeholder2: Option<unsafe extern "C" fn()>,
    pub ibv_create_flow:
        Option<unsafe extern "C" fn(*mut ibv_qp, *mut ibv_flow_attr) -> *mut ibv_flow>,
    pub ABI_placeholder1: Option<unsafe extern "C" fn()>,
    pub open_qp:
        Option<unsafe extern "C" fn(*mut ibv_context, *mut ibv_qp_open_attr) -> *mut ibv_qp>,
    pub create_qp_ex:
        Option<unsafe extern "C" fn(*mut ibv_context, *mut ibv_qp_init_attr_ex) -> *mut ibv_qp>,
    pub get_srq_num: Option<unsafe extern "C" fn(*mut ibv_srq, *mut u32) -> c_int>,
    pub create_srq_ex:
        Option<unsafe extern "C" fn(*mut ibv_context, *mut ibv_srq_init_attr_ex) -> *mut ibv_srq>,
    pub open_xrcd:
        Option<unsafe extern "C" fn(*mut ibv_context, *mut ibv_xrcd_init_attr) -> *mut ibv_xrcd>,
    /// Called by `ibv_close_xrcd` with no NULL check.
    pub close_xrcd: Option<unsafe extern "C" fn(*mut ibv_xrcd) -> c_int>,
    pub _ABI_placeholder3: u64,
    /// Must be immediately before `context`.
    pub sz: usize,
    /// Must be the last field.
    pub context: ibv_context,
}

// ---- device and port attributes -----------------------------------------------------------------

#[repr(C)]
#[derive(Clone, Copy)]
pub struct ibv_device_attr {
    pub fw_ver: [c_char; 64],
    /// Big endian.
    pub node_guid: u64,
    /// Big endian.
    pub sys_image_guid: u64,
    pub max_mr_size: u64,
    pub page_size_cap: u64,
    pub vendor_id: u32,
    pub vendor_part_id: u32,
    pub hw_ver: u32,
    pub max_qp: c_int,
    pub max_qp_wr: c_int,
    pub device_cap_flags: c_uint,
    pub max_sge: c_int,
    pub max_sge_rd: c_int,
    pub max_cq: c_int,
    pub max_cqe: c_int,
    pub max_mr: c_int,
    pub max_pd: c_int,
    pub max_qp_rd_atom: c_int,
    pub max_ee_rd_atom: c_int,
    pub max_res_rd_atom: c_int,
    pub max_qp_init_rd_atom: c_int,
    pub max_ee_init_rd_atom: c_int,
    /// `enum ibv_atomic_cap`.
    pub atomic_cap: c_uint,
    pub max_ee: c_int,
    pub max_rdd: c_int,
    pub max_mw: c_int,
    pub max_raw_ipv6_qp: c_int,
    pub max_raw_ethy_qp: c_int,
    pub max_mcast_grp: c_int,
    pub max_mcast_qp_attach: c_int,
    pub max_total_mcast_qp_attach: c_int,
    pub max_ah: c_int,
    pub max_fmr: c_int,
    pub max_map_per_fmr: c_int,
    pub max_srq: c_int,
    pub max_srq_wr: c_int,
    pub max_srq_sge: c_int,
    pub max_pkeys: u16,
    pub local_ca_ack_delay: u8,
    pub phys_port_cnt: u8,
}

#[repr(C)]
#[derive(Clone, Copy)]
pub struct ibv_query_device_ex_input {
    pub comp_mask: u32,
}

#[repr(C)]
#[derive(Clone, Copy)]
pub struct ibv_odp_caps_per_transport_caps {
    pub rc_odp_caps: u32,
    pub uc_odp_caps: u32,
    pub ud_odp_caps: u32,
}

#[repr(C)]
#[derive(Clone, Copy)]
pub struct ibv_odp_caps {
    pub general_caps: u64,
    pub per_transport_caps: ibv_odp_caps_per_transport_caps,
}

#[repr(C)]
#[derive(Clone, Copy)]
pub struct ibv_tso_caps {
    pub max_tso: u32,
    pub supported_qpts: u32,
}

#[repr(C)]
#[derive(Clone, Copy)]
pub struct ibv_rss_caps {
    pub supported_qpts: u32,
    pub max_rwq_indirection_tables: u32,
    pub max_rwq_indirection_table_size: u32,
    pub rx_hash_fields_mask: u64,
    pub rx_hash_function: u8,
}

#[repr(C)]
#[derive(Clone, Copy)]
pub struct ibv_packet_pacing_caps {
    pub qp_rate_limit_min: u32,
    pub qp_rate_limit_max: u32,
    pub supported_qpts: u32,
}

#[repr(C)]
#[derive(Clone, Copy)]
pub struct ibv_tm_caps {
    pub max_rndv_hdr_size: u32,
    pub max_num_tags: u32,
    pub flags: u32,
    pub max_ops: u32,
    pub max_sge: u32,
}

#[repr(C)]
#[derive(Clone, Copy)]
pub struct ibv_cq_moderation_caps {
    pub max_cq_count: u16,
    pub max_cq_period: u16,
}

#[repr(C)]
#[derive(Clone, Copy)]
pub struct ibv_pci_atomic_caps {
    pub fetch_add: u16,
    pub swap: u16,
    pub compare_swap: u16,
}

/// `struct ibv_device_attr_ex`; `query_device_ex` copies at most the caller's `attr_size`.
/// Completion timestamps are usable only with non-zero `completion_timestamp_mask` and
/// `hca_core_clock` (kHz).
#[repr(C)]
#[derive(Clone, Copy)]
pub struct ibv_device_attr_ex {
    pub orig_attr: ibv_device_attr,
    pub comp_mask: u32,
    pub odp_caps: ibv_odp_caps,
    pub completion_timestamp_mask: u64,
    pub hca_core_clock: u64,
    pub device_cap_flags_ex: u64,
    pub tso_caps: ibv_tso_caps,
    pub rss_caps: ibv_rss_caps,
    pub max_wq_type_rq: u32,
    pub packet_pacing_caps: ibv_packet_pacing_caps,
    pub raw_packet_caps: u32,
    pub tm_caps: ibv_tm_caps,
    pub cq_mod_caps: ibv_cq_moderation_caps,
    pub max_dm_size: u64,
    pub pci_atomic_caps: ibv_pci_atomic_caps,
    pub xrc_odp_caps: u32,
    pub phys_port_cnt_ex: u32,
}

/// `struct ibv_port_attr` (52 bytes with v44 headers; `vctx->query_port` is given the caller's
/// size, the exported `ibv_query_port` writes the 48-byte compat prefix).
#[repr(C)]
#[derive(Clone, Copy)]
pub struct ibv_port_attr {
    /// `enum ibv_port_state`.
    pub state: c_uint,
    /// `enum ibv_mtu`.
    pub max_mtu: c_uint,
    /// `enum ibv_mtu`.
    pub active_mtu: c_uint,
    pub gid_tbl_len: c_int,
    pub port_cap_flags: u32,
    pub max_msg_sz: u32,
    pub bad_pkey_cntr: u32,
    pub qkey_viol_cntr: u32,
    pub pkey_tbl_len: u16,
    pub lid: u16,
    pub sm_lid: u16,
    pub lmc: u8,
    pub max_vl_num: u8,
    pub sm_sl: u8,
    pub subnet_timeout: u8,
    pub init_type_reply: u8,
    pub active_width: u8,
    pub active_speed: u8,
    pub phys_state: u8,
    pub link_layer: u8,
    pub flags: u8,
    pub port_cap_flags2: u16,
}

/// `struct ibv_values_ex` (`query_rt_values`).
#[repr(C)]
#[derive(Clone, Copy)]
pub struct ibv_values_ex {
    pub comp_mask: u32,
    pub raw_clock: timespec,
}

// ---- PD, MR, MW, XRCD, TD, DM -------------------------------------------------------------------

#[repr(C)]
pub struct ibv_pd {
    pub context: *mut ibv_context,
    pub handle: u32,
}

#[repr(C)]
pub struct ibv_mr {
    pub context: *mut ibv_context,
    pub pd: *mut ibv_pd,
    pub addr: *mut c_void,
    pub length: usize,
    pub handle: u32,
    pub lkey: u32,
    pub rkey: u32,
}

#[repr(C)]
pub struct ibv_mw {
    pub context: *mut ibv_context,
    pub pd: *mut ibv_pd,
    pub rkey: u32,
    pub handle: u32,
    /// `type` in C (`enum ibv_mw_type`).
    pub type_: c_uint,
}

#[repr(C)]
#[derive(Clone, Copy)]
pub struct ibv_mw_bind_info {
    pub mr: *mut ibv_mr,
    pub addr: u64,
    pub length: u64,
    pub mw_access_flags: c_uint,
}

#[repr(C)]
#[derive(Clone, Copy)]
pub struct ibv_mw_bind {
    pub wr_id: u64,
    pub send_flags: c_uint,
    pub bind_info: ibv_mw_bind_info,
}

#[repr(C)]
pub struct ibv_xrcd {
    pub context: *mut ibv_context,
}

#[repr(C)]
#[derive(Clone, Copy)]
pub struct ibv_xrcd_init_attr {
    pub comp_mask: u32,
    pub fd: c_int,
    pub oflags: c_int,
}

#[repr(C)]
pub struct ibv_td {
    pub context: *mut ibv_context,
}

#[repr(C)]
#[derive(Clone, Copy)]
pub struct ibv_td_init_attr {
    pub comp_mask: u32,
}

#[repr(C)]
#[derive(Clone, Copy)]
pub struct ibv_parent_domain_init_attr {
    pub pd: *mut ibv_pd,
    pub td: *mut ibv_td,
    pub comp_mask: u32,
    pub alloc:
        Option<unsafe extern "C" fn(*mut ibv_pd, *mut c_void, usize, usize, u64) -> *mut c_void>,
    pub free: Option<unsafe extern "C" fn(*mut ibv_pd, *mut c_void, *mut c_void, u64)>,
    pub pd_context: *mut c_void,
}

#[repr(C)]
#[derive(Clone, Copy)]
pub struct ibv_alloc_dm_attr {
    pub length: usize,
    pub log_align_req: u32,
    pub comp_mask: u32,
}

#[repr(C)]
pub struct ibv_dm {
    pub context: *mut ibv_context,
    pub memcpy_to_dm: Option<unsafe extern "C" fn(*mut ibv_dm, u64, *const c_void, usize) -> c_int>,
    pub memcpy_from_dm: Option<unsafe extern "C" fn(*mut c_void, *mut ibv_dm, u64, usize) -> c_int>,
    pub comp_mask: u32,
    pub handle: u32,
}

// ---- counters, flows ------------------------------------------------------------------------------

#[repr(C)]
pub struct ibv_counters {
    pub context: *mut ibv_context,
}

#[repr(C)]
#[derive(Clone, Copy)]
pub struct ibv_counters_init_attr {
    pub comp_mask: u32,
}

#[repr(C)]
#[derive(Clone, Copy)]
pub struct ibv_counter_attach_attr {
    /// `enum ibv_counter_description`.
    pub counter_desc: c_uint,
    pub index: u32,
    pub comp_mask: u32,
}

/// `struct ibv_flow_attr`: a header followed in memory by `num_of_specs` flow specs.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct ibv_flow_attr {
    pub comp_mask: u32,
    /// `type` in C (`enum ibv_flow_attr_type`).
    pub type_: c_uint,
    pub size: u16,
    pub priority: u16,
    pub num_of_specs: u8,
    pub port: u8,
    pub flags: u32,
}

#[repr(C)]
pub struct ibv_flow {
    pub comp_mask: u32,
    pub context: *mut ibv_context,
    pub handle: u32,
}

#[repr(C)]
pub struct ibv_flow_action {
    pub context: *mut ibv_context,
}

#[repr(C)]
#[derive(Clone, Copy)]
pub struct ibv_flow_action_esp_attr {
    pub esp_attr: *mut ibv_flow_action_esp,
    /// `enum ibv_flow_action_esp_keymat`.
    pub keymat_proto: c_uint,
    pub keymat_len: u16,
    pub keymat_ptr: *mut c_void,
    /// `enum ibv_flow_action_esp_replay`.
    pub replay_proto: c_uint,
    pub replay_len: u16,
    pub replay_ptr: *mut c_void,
    pub esp_encap: *mut ibv_flow_action_esp_encap,
    pub comp_mask: u32,
    pub esn: u32,
}

// ---- completion channels and CQs ------------------------------------------------------------------

#[repr(C)]
pub struct ibv_comp_channel {
    pub context: *mut ibv_context,
    /// Pollable; apps set `O_NONBLOCK` on it.
    pub fd: c_int,
    pub refcnt: c_int,
}

#[repr(C)]
pub struct ibv_cq {
    pub context: *mut ibv_context,
    pub channel: *mut ibv_comp_channel,
    pub cq_context: *mut c_void,
    pub handle: u32,
    pub cqe: c_int,
    pub mutex: pthread_mutex_t,
    pub cond: pthread_cond_t,
    /// Updated by `ibv_ack_cq_events`.
    pub comp_events_completed: u32,
    pub async_events_completed: u32,
}

#[repr(C)]
#[derive(Clone, Copy)]
pub struct ibv_poll_cq_attr {
    pub comp_mask: u32,
}

#[repr(C)]
#[derive(Clone, Copy)]
pub struct ibv_wc_tm_info {
    pub tag: u64,
    /// `priv` in C.
    pub priv_: u32,
}

/// `struct ibv_cq_ex`: starts with the fields of `ibv_cq` (`ibv_cq_ex_to_cq` is a cast), then
/// the current completion (`status`, `wr_id`) and the polling table.
#[repr(C)]
pub struct ibv_cq_ex {
    pub context: *mut ibv_context,
    pub channel: *mut ibv_comp_channel,
    pub cq_context: *mut c_void,
    pub handle: u32,
    pub cqe: c_int,
    pub mutex: pthread_mutex_t,
    pub cond: pthread_cond_t,
    pub comp_events_completed: u32,
    pub async_events_completed: u32,
    pub comp_mask: u32,
    /// `enum ibv_wc_status` of the current completion.
    pub status: c_uint,
    pub wr_id: u64,
    pub start_poll: Option<unsafe extern "C" fn(*mut ibv_cq_ex, *mut ibv_poll_cq_attr) -> c_int>,
    pub next_poll: Option<unsafe extern "C" fn(*mut ibv_cq_ex) -> c_int>,
    pub end_poll: Option<unsafe extern "C" fn(*mut ibv_cq_ex)>,
    /// Returns `enum ibv_wc_opcode`.
    pub read_opcode: Option<unsafe extern "C" fn(*mut ibv_cq_ex) -> c_uint>,
    pub read_vendor_err: Option<unsafe extern "C" fn(*mut ibv_cq_ex) -> u32>,
    pub read_byte_len: Option<unsafe extern "C" fn(*mut ibv_cq_ex) -> u32>,
    /// Immediate data (big endian), or the invalidated rkey (`ibv_wc_read_invalidated_rkey`).
    pub read_imm_data: Option<unsafe extern "C" fn(*mut ibv_cq_ex) -> u32>,
    pub read_qp_num: Option<unsafe extern "C" fn(*mut ibv_cq_ex) -> u32>,
    pub read_src_qp: Option<unsafe extern "C" fn(*mut ibv_cq_ex) -> u32>,
    pub read_wc_flags: Option<unsafe extern "C" fn(*mut ibv_cq_ex) -> c_uint>,
    pub read_slid: Option<unsafe extern "C" fn(*mut ibv_cq_ex) -> u32>,
    pub read_sl: Option<unsafe extern "C" fn(*mut ibv_cq_ex) -> u8>,
    pub read_dlid_path_bits: Option<unsafe extern "C" fn(*mut ibv_cq_ex) -> u8>,
    pub read_completion_ts: Option<unsafe extern "C" fn(*mut ibv_cq_ex) -> u64>,
    pub read_cvlan: Option<unsafe extern "C" fn(*mut ibv_cq_ex) -> u16>,
    pub read_flow_tag: Option<unsafe extern "C" fn(*mut ibv_cq_ex) -> u32>,
    pub read_tm_info: Option<unsafe extern "C" fn(*mut ibv_cq_ex, *mut ibv_wc_tm_info)>,
    pub read_completion_wallclock_ns: Option<unsafe extern "C" fn(*mut ibv_cq_ex) -> u64>,
}

#[repr(C)]
#[derive(Clone, Copy)]
pub struct ibv_cq_init_attr_ex {
    pub cqe: u32,
    pub cq_context: *mut c_void,
    pub channel: *mut ibv_comp_channel,
    pub comp_vector: u32,
    /// `IBV_WC_EX_WITH_*`.
    pub wc_flags: u64,
    /// `IBV_CQ_INIT_ATTR_MASK_*`.
    pub comp_mask: u32,
    /// `IBV_CREATE_CQ_ATTR_*`.
    pub flags: u32,
    pub parent_domain: *mut ibv_pd,
}

#[repr(C)]
#[derive(Clone, Copy)]
pub struct ibv_moderate_cq {
    pub cq_count: u16,
    pub cq_period: u16,
}

#[repr(C)]
#[derive(Clone, Copy)]
pub struct ibv_modify_cq_attr {
    pub attr_mask: u32,
    pub moderate: ibv_moderate_cq,
}

// ---- SRQs and WQs ----------------------------------------------------------------------------------

#[repr(C)]
pub struct ibv_srq {
    pub context: *mut ibv_context,
    pub srq_context: *mut c_void,
    pub pd: *mut ibv_pd,
    pub handle: u32,
    pub mutex: pthread_mutex_t,
    pub cond: pthread_cond_t,
    pub events_completed: u32,
}

#[repr(C)]
#[derive(Clone, Copy)]
pub struct ibv_srq_attr {
    pub max_wr: u32,
    pub max_sge: u32,
    pub srq_limit: u32,
}

#[repr(C)]
#[derive(Clone, Copy)]
pub struct ibv_srq_init_attr {
    pub srq_context: *mut c_void,
    pub attr: ibv_srq_attr,
}

#[repr(C)]
#[derive(Clone, Copy)]
pub struct ibv_tm_cap {
    pub max_num_tags: u32,
    pub max_ops: u32,
}

#[repr(C)]
#[derive(Clone, Copy)]
pub struct ibv_srq_init_attr_ex {
    pub srq_context: *mut c_void,
    pub attr: ibv_srq_attr,
    /// `IBV_SRQ_INIT_ATTR_*`.
    pub comp_mask: u32,
    /// `enum ibv_srq_type`.
    pub srq_type: c_uint,
    pub pd: *mut ibv_pd,
    pub xrcd: *mut ibv_xrcd,
    pub cq: *mut ibv_cq,
    pub tm_cap: ibv_tm_cap,
}

#[repr(C)]
#[derive(Clone, Copy)]
pub struct ibv_ops_wr_tm_add {
    pub recv_wr_id: u64,
    pub sg_list: *mut ibv_sge,
    pub num_sge: c_int,
    pub tag: u64,
    pub mask: u64,
}

#[repr(C)]
#[derive(Clone, Copy)]
pub struct ibv_ops_wr_tm {
    pub unexpected_cnt: u32,
    pub handle: u32,
    pub add: ibv_ops_wr_tm_add,
}

/// `struct ibv_ops_wr` (tag-matching SRQ operations).
#[repr(C)]
#[derive(Clone, Copy)]
pub struct ibv_ops_wr {
    pub wr_id: u64,
    pub next: *mut ibv_ops_wr,
    /// `enum ibv_ops_wr_opcode`.
    pub opcode: c_uint,
    pub flags: c_int,
    pub tm: ibv_ops_wr_tm,
}

#[repr(C)]
pub struct ibv_wq {
    pub context: *mut ibv_context,
    pub wq_context: *mut c_void,
    pub pd: *mut ibv_pd,
    pub cq: *mut ibv_cq,
    pub wq_num: u32,
    pub handle: u32,
    /// `enum ibv_wq_state`.
    pub state: c_uint,
    /// `enum ibv_wq_type`.
    pub wq_type: c_uint,
    pub post_recv:
        Option<unsafe extern "C" fn(*mut ibv_wq, *mut ibv_recv_wr, *mut *mut ibv_recv_wr) -> c_int>,
    pub mutex: pthread_mutex_t,
    pub cond: pthread_cond_t,
    pub events_completed: u32,
    pub comp_mask: u32,
}

#[repr(C)]
#[derive(Clone, Copy)]
pub struct ibv_wq_init_attr {
    pub wq_context: *mut c_void,
    /// `enum ibv_wq_type`.
    pub wq_type: c_uint,
    pub max_wr: u32,
    pub max_sge: u32,
    pub pd: *mut ibv_pd,
    pub cq: *mut ibv_cq,
    pub comp_mask: u32,
    pub create_flags: u32,
}

#[repr(C)]
#[derive(Clone, Copy)]
pub struct ibv_wq_attr {
    pub attr_mask: u32,
    /// `enum ibv_wq_state`.
    pub wq_state: c_uint,
    /// `enum ibv_wq_state`.
    pub curr_wq_state: c_uint,
    pub flags: u32,
    pub flags_mask: u32,
}

#[repr(C)]
pub struct ibv_rwq_ind_table {
    pub context: *mut ibv_context,
    pub ind_tbl_handle: c_int,
    pub ind_tbl_num: c_int,
    pub comp_mask: u32,
}

#[repr(C)]
#[derive(Clone, Copy)]
pub struct ibv_rwq_ind_table_init_attr {
    pub log_ind_tbl_size: u32,
    pub ind_tbl: *mut *mut ibv_wq,
    pub comp_mask: u32,
}

// ---- QPs ------------------------------------------------------------------------------------------

#[repr(C)]
pub struct ibv_qp {
    pub context: *mut ibv_context,
    pub qp_context: *mut c_void,
    pub pd: *mut ibv_pd,
    pub send_cq: *mut ibv_cq,
    pub recv_cq: *mut ibv_cq,
    pub srq: *mut ibv_srq,
    pub handle: u32,
    pub qp_num: u32,
    /// `enum ibv_qp_state`.
    pub state: c_uint,
    /// `enum ibv_qp_type`.
    pub qp_type: c_uint,
    pub mutex: pthread_mutex_t,
    pub cond: pthread_cond_t,
    pub events_completed: u32,
}

/// `struct ibv_qp_ex`: the `ibv_wr_*` table (`ibv_qp_to_qp_ex` must return it fully filled).
/// The `wr_*` builders return nothing; errors surface from `wr_complete`.
#[repr(C)]
pub struct ibv_qp_ex {
    pub qp_base: ibv_qp,
    pub comp_mask: u64,
    pub wr_id: u64,
    /// `IBV_SEND_*`.
    pub wr_flags: c_uint,
    /// `(qp, rkey, remote_addr, compare, swap)`.
    pub wr_atomic_cmp_swp: Option<unsafe extern "C" fn(*mut ibv_qp_ex, u32, u64, u64, u64)>,
    /// `(qp, rkey, remote_addr, add)`.
    pub wr_atomic_fetch_add: Option<unsafe extern "C" fn(*mut ibv_qp_ex, u32, u64, u64)>,
    /// `(qp, mw, rkey, bind_info)`.
    pub wr_bind_mw:
        Option<unsafe extern "C" fn(*mut ibv_qp_ex, *mut ibv_mw, u32, *const ibv_mw_bind_info)>,
    /// `(qp, invalidate_rkey)`.
    pub wr_local_inv: Option<unsafe extern "C" fn(*mut ibv_qp_ex, u32)>,
    /// `(qp, rkey, remote_addr)`.
    pub wr_rdma_read: Option<unsafe extern "C" fn(*mut ibv_qp_ex, u32, u64)>,
    /// `(qp, rkey, remote_addr)`.
    pub wr_rdma_write: Option<unsafe extern "C" fn(*mut ibv_qp_ex, u32, u64)>,
    /// `(qp, rkey, remote_addr, imm_data)`; `imm_data` big endian.
    pub wr_rdma_write_imm: Option<unsafe extern "C" fn(*mut ibv_qp_ex, u32, u64, u32)>,
    pub wr_send: Option<unsafe extern "C" fn(*mut ibv_qp_ex)>,
    /// `(qp, imm_data)`; big endian.
    pub wr_send_imm: Option<unsafe extern "C" fn(*mut ibv_qp_ex, u32)>,
    /// `(qp, invalidate_rkey)`.
    pub wr_send_inv: Option<unsafe extern "C" fn(*mut ibv_qp_ex, u32)>,
    /// `(qp, hdr, hdr_sz, mss)`.
    pub wr_send_tso: Option<unsafe extern "C" fn(*mut ibv_qp_ex, *mut c_void, u16, u16)>,
    /// `(qp, ah, remote_qpn, remote_qkey)`.
    pub wr_set_ud_addr: Option<unsafe extern "C" fn(*mut ibv_qp_ex, *mut ibv_ah, u32, u32)>,
    /// `(qp, remote_srqn)`.
    pub wr_set_xrc_srqn: Option<unsafe extern "C" fn(*mut ibv_qp_ex, u32)>,
    /// `(qp, addr, length)`.
    pub wr_set_inline_data: Option<unsafe extern "C" fn(*mut ibv_qp_ex, *mut c_void, usize)>,
    /// `(qp, num_buf, buf_list)`.
    pub wr_set_inline_data_list:
        Option<unsafe extern "C" fn(*mut ibv_qp_ex, usize, *const ibv_data_buf)>,
    /// `(qp, lkey, addr, length)`.
    pub wr_set_sge: Option<unsafe extern "C" fn(*mut ibv_qp_ex, u32, u64, u32)>,
    /// `(qp, num_sge, sg_list)`.
    pub wr_set_sge_list: Option<unsafe extern "C" fn(*mut ibv_qp_ex, usize, *const ibv_sge)>,
    pub wr_start: Option<unsafe extern "C" fn(*mut ibv_qp_ex)>,
    pub wr_complete: Option<unsafe extern "C" fn(*mut ibv_qp_ex) -> c_int>,
    pub wr_abort: Option<unsafe extern "C" fn(*mut ibv_qp_ex)>,
    /// `(qp, rkey, remote_addr, atomic_wr)`; `atomic_wr` points to 8 bytes.
    pub wr_atomic_write: Option<unsafe extern "C" fn(*mut ibv_qp_ex, u32, u64, *const c_void)>,
}

#[repr(C)]
#[derive(Clone, Copy)]
pub struct ibv_qp_cap {
    pub max_send_wr: u32,
    pub max_recv_wr: u32,
    pub max_send_sge: u32,
    pub max_recv_sge: u32,
    pub max_inline_data: u32,
}

#[repr(C)]
#[derive(Clone, Copy)]
pub struct ibv_qp_init_attr {
    pub qp_context: *mut c_void,
    pub send_cq: *mut ibv_cq,
    pub recv_cq: *mut ibv_cq,
    pub srq: *mut ibv_srq,
    pub cap: ibv_qp_cap,
    /// `enum ibv_qp_type`.
    pub qp_type: c_uint,
    pub sq_sig_all: c_int,
}

#[repr(C)]
#[derive(Clone, Copy)]
pub struct ibv_rx_hash_conf {
    pub rx_hash_function: u8,
    pub rx_hash_key_len: u8,
    pub rx_hash_key: *mut u8,
    pub rx_hash_fields_mask: u64,
}

/// `struct ibv_qp_init_attr_ex`: the fields of `ibv_qp_init_attr` (inline, not nested), then
/// the extension selected by `comp_mask` (`IBV_QP_INIT_ATTR_*`).
#[repr(C)]
#[derive(Clone, Copy)]
pub struct ibv_qp_init_attr_ex {
    pub qp_context: *mut c_void,
    pub send_cq: *mut ibv_cq,
    pub recv_cq: *mut ibv_cq,
    pub srq: *mut ibv_srq,
    pub cap: ibv_qp_cap,
    /// `enum ibv_qp_type`.
    pub qp_type: c_uint,
    pub sq_sig_all: c_int,
    pub comp_mask: u32,
    pub pd: *mut ibv_pd,
    pub xrcd: *mut ibv_xrcd,
    /// `IBV_QP_CREATE_*`.
    pub create_flags: u32,
    pub max_tso_header: u16,
    pub rwq_ind_tbl: *mut ibv_rwq_ind_table,
    pub rx_hash_conf: ibv_rx_hash_conf,
    pub source_qpn: u32,
    /// `IBV_QP_EX_WITH_*`.
    pub send_ops_flags: u64,
}

#[repr(C)]
#[derive(Clone, Copy)]
pub struct ibv_qp_open_attr {
    pub comp_mask: u32,
    pub qp_num: u32,
    pub xrcd: *mut ibv_xrcd,
    pub qp_context: *mut c_void,
    /// `enum ibv_qp_type`.
    pub qp_type: c_uint,
}

#[repr(C)]
#[derive(Clone, Copy)]
pub struct ibv_qp_rate_limit_attr {
    pub rate_limit: u32,
    pub max_burst_sz: u32,
    pub typical_pkt_sz: u16,
    pub comp_mask: u32,
}

#[repr(C)]
#[derive(Clone, Copy)]
pub struct ibv_global_route {
    pub dgid: ibv_gid,
    pub flow_label: u32,
    pub sgid_index: u8,
    pub hop_limit: u8,
    pub traffic_class: u8,
}

/// `struct ibv_grh`: the 40 bytes a UD receive buffer starts with.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct ibv_grh {
    /// Big endian.
    pub version_tclass_flow: u32,
    /// Big endian.
    pub paylen: u16,
    pub next_hdr: u8,
    pub hop_limit: u8,
    pub sgid: ibv_gid,
    pub dgid: ibv_gid,
}

#[repr(C)]
#[derive(Clone, Copy)]
pub struct ibv_ah_attr {
    pub grh: ibv_global_route,
    pub dlid: u16,
    pub sl: u8,
    pub src_path_bits: u8,
    /// `enum ibv_rate`.
    pub static_rate: u8,
    pub is_global: u8,
    pub port_num: u8,
}

#[repr(C)]
#[derive(Clone, Copy)]
pub struct ibv_qp_attr {
    /// `enum ibv_qp_state`.
    pub qp_state: c_uint,
    /// `enum ibv_qp_state`.
    pub cur_qp_state: c_uint,
    /// `enum ibv_mtu`.
    pub path_mtu: c_uint,
    /// `enum ibv_mig_state`.
    pub path_mig_state: c_uint,
    pub qkey: u32,
    pub rq_psn: u32,
    pub sq_psn: u32,
    pub dest_qp_num: u32,
    pub qp_access_flags: c_uint,
    pub cap: ibv_qp_cap,
    pub ah_attr: ibv_ah_attr,
    pub alt_ah_attr: ibv_ah_attr,
    pub pkey_index: u16,
    pub alt_pkey_index: u16,
    pub en_sqd_async_notify: u8,
    pub sq_draining: u8,
    pub max_rd_atomic: u8,
    pub max_dest_rd_atomic: u8,
    pub min_rnr_timer: u8,
    pub port_num: u8,
    pub timeout: u8,
    pub retry_cnt: u8,
    pub rnr_retry: u8,
    pub alt_port_num: u8,
    pub alt_timeout: u8,
    pub rate_limit: u32,
}

#[repr(C)]
#[derive(Clone, Copy)]
pub struct ibv_ece {
    pub vendor_id: u32,
    pub options: u32,
    pub comp_mask: u32,
}

#[repr(C)]
pub struct ibv_ah {
    pub context: *mut ibv_context,
    pub pd: *mut ibv_pd,
    pub handle: u32,
}

// ---- work requests and completions ------------------------------------------------------------------

#[repr(C)]
#[derive(Clone, Copy)]
pub struct ibv_sge {
    pub addr: u64,
    pub length: u32,
    pub lkey: u32,
}

#[repr(C)]
#[derive(Clone, Copy)]
pub struct ibv_data_buf {
    pub addr: *mut c_void,
    pub length: usize,
}

#[repr(C)]
#[derive(Clone, Copy)]
pub struct ibv_send_wr_rdma {
    pub remote_addr: u64,
    pub rkey: u32,
}

#[repr(C)]
#[derive(Clone, Copy)]
pub struct ibv_send_wr_atomic {
    pub remote_addr: u64,
    pub compare_add: u64,
    pub swap: u64,
    pub rkey: u32,
}

#[repr(C)]
#[derive(Clone, Copy)]
pub struct ibv_send_wr_ud {
    pub ah: *mut ibv_ah,
    pub remote_qpn: u32,
    pub remote_qkey: u32,
}

/// `ibv_send_wr.wr`: which member is meaningful depends on the opcode (and QP type for `ud`).
#[repr(C)]
#[derive(Clone, Copy)]
pub union ibv_send_wr_wr {
    pub rdma: ibv_send_wr_rdma,
    pub atomic: ibv_send_wr_atomic,
    pub ud: ibv_send_wr_ud,
}

#[repr(C)]
#[derive(Clone, Copy)]
pub struct ibv_send_wr_xrc {
    pub remote_srqn: u32,
}

/// `ibv_send_wr.qp_type`.
#[repr(C)]
#[derive(Clone, Copy)]
pub union ibv_send_wr_qp_type {
    pub xrc: ibv_send_wr_xrc,
}

#[repr(C)]
#[derive(Clone, Copy)]
pub struct ibv_send_wr_bind_mw {
    pub mw: *mut ibv_mw,
    pub rkey: u32,
    pub bind_info: ibv_mw_bind_info,
}

#[repr(C)]
#[derive(Clone, Copy)]
pub struct ibv_send_wr_tso {
    pub hdr: *mut c_void,
    pub hdr_sz: u16,
    pub mss: u16,
}

/// The anonymous trailing union of `ibv_send_wr` (`wr->bind_mw`, `wr->tso` in C).
#[repr(C)]
#[derive(Clone, Copy)]
pub union ibv_send_wr_bind_mw_or_tso {
    pub bind_mw: ibv_send_wr_bind_mw,
    pub tso: ibv_send_wr_tso,
}

#[repr(C)]
#[derive(Clone, Copy)]
pub struct ibv_send_wr {
    pub wr_id: u64,
    pub next: *mut ibv_send_wr,
    pub sg_list: *mut ibv_sge,
    pub num_sge: c_int,
    /// `enum ibv_wr_opcode`.
    pub opcode: c_uint,
    /// `IBV_SEND_*`.
    pub send_flags: c_uint,
    /// C's anonymous union `{ __be32 imm_data; uint32_t invalidate_rkey; }`: the immediate
    /// (big endian) for `*_WITH_IMM`, the rkey for `*_INV` (see [`Self::invalidate_rkey`]).
    pub imm_data: u32,
    pub wr: ibv_send_wr_wr,
    pub qp_type: ibv_send_wr_qp_type,
    /// C's anonymous union `{ bind_mw; tso; }`.
    pub bind_mw_or_tso: ibv_send_wr_bind_mw_or_tso,
}

impl ibv_send_wr {
    /// The `invalidate_rkey` member of the `imm_data` union (`IBV_WR_SEND_WITH_INV`,
    /// `IBV_WR_LOCAL_INV`).
    pub fn invalidate_rkey(&self) -> u32 {
        self.imm_data
    }
}

#[repr(C)]
#[derive(Clone, Copy)]
pub struct ibv_recv_wr {
    pub wr_id: u64,
    pub next: *mut ibv_recv_wr,
    pub sg_list: *mut ibv_sge,
    pub num_sge: c_int,
}

#[repr(C)]
#[derive(Clone, Copy)]
pub struct ibv_wc {
    pub wr_id: u64,
    /// `enum ibv_wc_status`.
    pub status: c_uint,
    /// `enum ibv_wc_opcode`.
    pub opcode: c_uint,
    pub vendor_err: u32,
    pub byte_len: u32,
    /// C's anonymous union `{ __be32 imm_data; uint32_t invalidated_rkey; }`: the immediate
    /// (big endian) with `IBV_WC_WITH_IMM`, the rkey with `IBV_WC_WITH_INV`.
    pub imm_data: u32,
    pub qp_num: u32,
    pub src_qp: u32,
    /// `IBV_WC_*` flags.
    pub wc_flags: c_uint,
    pub pkey_index: u16,
    pub slid: u16,
    pub sl: u8,
    pub dlid_path_bits: u8,
}

impl ibv_wc {
    /// The `invalidated_rkey` member of the `imm_data` union (with `IBV_WC_WITH_INV`).
    pub fn invalidated_rkey(&self) -> u32 {
        self.imm_data
    }
}

// ---- async events -------------------------------------------------------------------------------

#[repr(C)]
#[derive(Clone, Copy)]
pub union ibv_async_event_element {
    pub cq: *mut ibv_cq,
    pub qp: *mut ibv_qp,
    pub srq: *mut ibv_srq,
    pub wq: *mut ibv_wq,
    pub port_num: c_int,
}

#[repr(C)]
#[derive(Clone, Copy)]
pub struct ibv_async_event {
    pub element: ibv_async_event_element,
    /// `enum ibv_event_type`.
    pub event_type: c_uint,
}

// ---- pinned layout (x86_64, rdma-core 44; tests/layout.rs checks these against the headers) -----

macro_rules! pin {
    ($t:ty, $size:expr, $align:expr $(, $($field:ident).+ @ $off:expr)* $(,)?) => {
        const _: () = assert!(size_of::<$t>() == $size);
        const _: () = assert!(align_of::<$t>() == $align);
        $(const _: () = assert!(offset_of!($t, $($field).+) == $off);)*
    };
}

pin!(pthread_mutex_t, 40, 8);
pin!(pthread_cond_t, 48, 8);
pin!(ibv_gid, 16, 8, global.interface_id @ 8);
pin!(ibv_gid_entry, 32, 8, gid_index @ 16, port_num @ 20, gid_type @ 24, ndev_ifindex @ 28);
pin!(ibv_device, 664, 8, node_type @ 16, transport_type @ 20, name @ 24, dev_name @ 88,
    dev_path @ 152, ibdev_path @ 408);
pin!(ibv_context_ops, 256, 8, alloc_mw @ 56, bind_mw @ 64, dealloc_mw @ 72, poll_cq @ 88,
    req_notify_cq @ 96, post_srq_recv @ 160, post_send @ 200, post_recv @ 208,
    _compat_async_event @ 248);
pin!(ibv_context, 328, 8, device @ 0, ops @ 8, cmd_fd @ 264, async_fd @ 268,
    num_comp_vectors @ 272, mutex @ 280, abi_compat @ 320);
pin!(verbs_context, 648, 8, query_port @ 0, advise_mr @ 8, alloc_null_mr @ 16, reg_dm_mr @ 56,
    alloc_dm @ 64, free_dm @ 72, alloc_parent_domain @ 112, dealloc_td @ 120, alloc_td @ 128,
    modify_cq @ 136, post_srq_ops @ 144, destroy_rwq_ind_table @ 152, create_rwq_ind_table @ 160,
    destroy_wq @ 168, modify_wq @ 176, create_wq @ 184, query_rt_values @ 192,
    create_cq_ex @ 200, priv_ @ 208, query_device_ex @ 216, ibv_destroy_flow @ 224,
    ibv_create_flow @ 240, open_qp @ 256, create_qp_ex @ 264, get_srq_num @ 272,
    create_srq_ex @ 280, open_xrcd @ 288, close_xrcd @ 296, _ABI_placeholder3 @ 304, sz @ 312,
    context @ 320);
pin!(ibv_device_attr, 232, 8, fw_ver @ 0, node_guid @ 64, max_mr_size @ 80, vendor_id @ 96,
    max_qp @ 108, device_cap_flags @ 116, atomic_cap @ 164, max_srq_sge @ 220, max_pkeys @ 224,
    local_ca_ack_delay @ 226, phys_port_cnt @ 227);
pin!(ibv_query_device_ex_input, 4, 4);
pin!(ibv_odp_caps, 24, 8, per_transport_caps @ 8);
pin!(ibv_tso_caps, 8, 4);
pin!(ibv_rss_caps, 32, 8, rx_hash_fields_mask @ 16, rx_hash_function @ 24);
pin!(ibv_packet_pacing_caps, 12, 4);
pin!(ibv_tm_caps, 20, 4);
pin!(ibv_cq_moderation_caps, 4, 2);
pin!(ibv_pci_atomic_caps, 6, 2);
pin!(ibv_device_attr_ex, 400, 8, comp_mask @ 232, odp_caps @ 240,
    completion_timestamp_mask @ 264, hca_core_clock @ 272, device_cap_flags_ex @ 280,
    tso_caps @ 288, rss_caps @ 296, max_wq_type_rq @ 328, packet_pacing_caps @ 332,
    raw_packet_caps @ 344, tm_caps @ 348, cq_mod_caps @ 368, max_dm_size @ 376,
    pci_atomic_caps @ 384, xrc_odp_caps @ 392, phys_port_cnt_ex @ 396);
pin!(ibv_port_attr, 52, 4, gid_tbl_len @ 12, max_msg_sz @ 20, pkey_tbl_len @ 32, lid @ 34,
    sm_lid @ 36, lmc @ 38, active_width @ 43, active_speed @ 44, phys_state @ 45,
    link_layer @ 46, flags @ 47, port_cap_flags2 @ 48);
pin!(ibv_values_ex, 24, 8, raw_clock @ 8);
pin!(ibv_pd, 16, 8, handle @ 8);
pin!(ibv_mr, 48, 8, addr @ 16, length @ 24, handle @ 32, lkey @ 36, rkey @ 40);
pin!(ibv_mw, 32, 8, rkey @ 16, handle @ 20, type_ @ 24);
pin!(ibv_mw_bind_info, 32, 8, mw_access_flags @ 24);
pin!(ibv_mw_bind, 48, 8, send_flags @ 8, bind_info @ 16);
pin!(ibv_xrcd, 8, 8);
pin!(ibv_xrcd_init_attr, 12, 4);
pin!(ibv_td, 8, 8);
pin!(ibv_parent_domain_init_attr, 48, 8, alloc @ 24, free @ 32, pd_context @ 40);
pin!(ibv_alloc_dm_attr, 16, 8);
pin!(ibv_dm, 32, 8, comp_mask @ 24, handle @ 28);
pin!(ibv_counters, 8, 8);
pin!(ibv_counter_attach_attr, 12, 4);
pin!(ibv_flow_attr, 20, 4, num_of_specs @ 12, flags @ 16);
pin!(ibv_flow, 24, 8, context @ 8, handle @ 16);
pin!(ibv_flow_action_esp_attr, 56, 8, esp_encap @ 40, esn @ 52);
pin!(ibv_comp_channel, 16, 8, fd @ 8, refcnt @ 12);
pin!(ibv_cq, 128, 8, handle @ 24, cqe @ 28, mutex @ 32, cond @ 72, comp_events_completed @ 120,
    async_events_completed @ 124);
pin!(ibv_cq_ex, 288, 8, comp_mask @ 128, status @ 132, wr_id @ 136, start_poll @ 144,
    next_poll @ 152, end_poll @ 160, read_opcode @ 168, read_imm_data @ 192,
    read_wc_flags @ 216, read_completion_ts @ 248, read_tm_info @ 272,
    read_completion_wallclock_ns @ 280);
pin!(ibv_cq_init_attr_ex, 56, 8, cq_context @ 8, channel @ 16, comp_vector @ 24, wc_flags @ 32,
    comp_mask @ 40, flags @ 44, parent_domain @ 48);
pin!(ibv_modify_cq_attr, 8, 4, moderate @ 4);
pin!(ibv_srq, 128, 8, handle @ 24, mutex @ 32, cond @ 72, events_completed @ 120);
pin!(ibv_srq_attr, 12, 4);
pin!(ibv_srq_init_attr, 24, 8, attr @ 8);
pin!(ibv_srq_init_attr_ex, 64, 8, comp_mask @ 20, srq_type @ 24, pd @ 32, xrcd @ 40, cq @ 48,
    tm_cap @ 56);
pin!(ibv_ops_wr, 72, 8, opcode @ 16, tm @ 24, tm.add.tag @ 56);
pin!(ibv_wq, 152, 8, wq_num @ 32, state @ 40, post_recv @ 48, mutex @ 56, cond @ 96,
    events_completed @ 144, comp_mask @ 148);
pin!(ibv_wq_init_attr, 48, 8, pd @ 24, comp_mask @ 40);
pin!(ibv_wq_attr, 20, 4);
pin!(ibv_rwq_ind_table, 24, 8);
pin!(ibv_rwq_ind_table_init_attr, 24, 8, ind_tbl @ 8, comp_mask @ 16);
pin!(ibv_qp, 160, 8, handle @ 48, qp_num @ 52, state @ 56, qp_type @ 60, mutex @ 64, cond @ 104,
    events_completed @ 152);
pin!(ibv_qp_ex, 352, 8, comp_mask @ 160, wr_id @ 168, wr_flags @ 176, wr_atomic_cmp_swp @ 184,
    wr_rdma_write @ 224, wr_send @ 240, wr_set_ud_addr @ 272, wr_set_inline_data @ 288,
    wr_set_sge @ 304, wr_start @ 320, wr_complete @ 328, wr_abort @ 336, wr_atomic_write @ 344);
pin!(ibv_qp_cap, 20, 4);
pin!(ibv_qp_init_attr, 64, 8, cap @ 32, qp_type @ 52, sq_sig_all @ 56);
pin!(ibv_rx_hash_conf, 24, 8, rx_hash_key @ 8, rx_hash_fields_mask @ 16);
pin!(ibv_qp_init_attr_ex, 136, 8, qp_type @ 52, comp_mask @ 60, pd @ 64, xrcd @ 72,
    create_flags @ 80, max_tso_header @ 84, rwq_ind_tbl @ 88, rx_hash_conf @ 96,
    source_qpn @ 120, send_ops_flags @ 128);
pin!(ibv_qp_open_attr, 32, 8, xrcd @ 8, qp_type @ 24);
pin!(ibv_qp_rate_limit_attr, 16, 4, comp_mask @ 12);
pin!(ibv_global_route, 24, 8, flow_label @ 16, sgid_index @ 20, hop_limit @ 21,
    traffic_class @ 22);
pin!(ibv_grh, 40, 8, sgid @ 8, dgid @ 24);
pin!(ibv_ah_attr, 32, 8, dlid @ 24, sl @ 26, static_rate @ 28, is_global @ 29, port_num @ 30);
pin!(ibv_qp_attr, 144, 8, qkey @ 16, dest_qp_num @ 28, qp_access_flags @ 32, cap @ 36,
    ah_attr @ 56, alt_ah_attr @ 88, pkey_index @ 120, max_rd_atomic @ 126,
    max_dest_rd_atomic @ 127, min_rnr_timer @ 128, port_num @ 129, timeout @ 130,
    retry_cnt @ 131, rnr_retry @ 132, rate_limit @ 136);
pin!(ibv_ece, 12, 4);
pin!(ibv_ah, 24, 8, handle @ 16);
pin!(ibv_sge, 16, 8, length @ 8, lkey @ 12);
pin!(ibv_data_buf, 16, 8);
pin!(ibv_send_wr, 128, 8, num_sge @ 24, opcode @ 28, send_flags @ 32, imm_data @ 36, wr @ 40,
    wr.atomic.rkey @ 64, wr.ud.remote_qkey @ 52, qp_type @ 72, bind_mw_or_tso @ 80,
    bind_mw_or_tso.bind_mw.bind_info @ 96, bind_mw_or_tso.tso.mss @ 90);
pin!(ibv_recv_wr, 32, 8, sg_list @ 16, num_sge @ 24);
pin!(ibv_wc, 48, 8, status @ 8, opcode @ 12, byte_len @ 20, imm_data @ 24, qp_num @ 28,
    wc_flags @ 36, pkey_index @ 40, slid @ 42, sl @ 44, dlid_path_bits @ 45);
pin!(ibv_async_event, 16, 8, event_type @ 8);
