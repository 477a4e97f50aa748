//! Control-path messages: what the driver library asks the daemon through a region's control
//! mailbox (API remoting), and what the CLI asks the daemon on its admin socket.
//!
//! Messages are JSON (`serde_json`): the control path is not hot (tens of microseconds are
//! fine), JSON is easy to inspect in logs, and its parser is safe on hostile input with bounded
//! depth. The daemon treats every decoded request as untrusted: handles are checked against
//! the requesting context, sizes against limits.
//!
//! Not here: the data path. Work requests and completions are fixed slots in rings
//! (`vrnic-wire`), never messages.
#![forbid(unsafe_code)]
#![warn(missing_docs)]

use serde::{Deserialize, Serialize};
use vrnic_wire::{AhAttr, QpAttr, QpCap, QpType};

/// Identity and limits of a vRNIC, as the driver reports them through `ibv_query_device`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DeviceInfo {
    /// Device name (`ibv_get_device_name`).
    pub name: String,
    /// Node GUID, network byte order.
    pub guid: u64,
    /// Port LID.
    pub lid: u16,
    /// GID index 0.
    pub gid: [u8; 16],
    /// Most QPs.
    pub max_qp: u32,
    /// Deepest work queue.
    pub max_qp_wr: u32,
    /// Most CQs.
    pub max_cq: u32,
    /// Deepest CQ.
    pub max_cqe: u32,
    /// Most MRs.
    pub max_mr: u32,
    /// Most PDs.
    pub max_pd: u32,
    /// Largest registration in bytes.
    pub max_mr_size: u64,
    /// Most SRQs (0 from a daemon that did not say: the driver reports `max_qp`).
    #[serde(default)]
    pub max_srq: u32,
    /// Most memory windows (0 from a daemon that did not say: the driver reports none).
    #[serde(default)]
    pub max_mw: u32,
}

/// A run of pages backing part of a registration: `pages` app pages from `va` are backed by
/// region pages from `off`. `fresh` runs are new: the driver copies the app's current bytes
/// into them and maps them over the app's range; other runs are already mapped there.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct PageRun {
    /// App virtual address (page aligned).
    pub va: u64,
    /// Region offset (page aligned).
    pub off: u64,
    /// Number of 4 KiB pages.
    pub pages: u32,
    /// Whether the driver must copy and map it.
    pub fresh: bool,
}

/// A request from a driver library context.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[non_exhaustive]
pub enum Request {
    /// Device identity and limits.
    QueryDevice,
    /// `ibv_alloc_pd`.
    AllocPd,
    /// `ibv_dealloc_pd`.
    DeallocPd {
        /// Handle.
        pd: u32,
    },
    /// `ibv_reg_mr_iova2`.
    RegMr {
        /// PD handle.
        pd: u32,
        /// Start address.
        addr: u64,
        /// Length in bytes.
        len: u64,
        /// I/O virtual address the work requests use.
        iova: u64,
        /// `IBV_ACCESS_*`.
        access: u32,
        /// Runs of an earlier registration of this context, deregistered but kept mapped by
        /// the driver (and checked by it to be still mapped at these addresses): their region
        /// pages back these addresses again instead of fresh ones, so no copy and no remap.
        /// Only pages this context holds detached are taken back; others are ignored.
        #[serde(default)]
        reuse: Vec<PageRun>,
    },
    /// `ibv_dereg_mr`: the response lists the runs the driver must detach.
    DeregMr {
        /// MR handle.
        mr: u32,
    },
    /// After a deregistration: the driver detached these runs; the daemon may reuse them.
    ReleasePages {
        /// The runs from the `DeregMr` response.
        runs: Vec<PageRun>,
    },
    /// `ibv_alloc_mw`: answered by [`Reply::Mw`].
    AllocMw {
        /// PD handle.
        pd: u32,
        /// `IBV_MW_TYPE_1` (1) or `IBV_MW_TYPE_2` (2).
        ty: u32,
    },
    /// `ibv_dealloc_mw`.
    DeallocMw {
        /// Handle.
        mw: u32,
    },
    /// `ibv_create_cq`.
    CreateCq {
        /// Requested depth.
        cqe: u32,
    },
    /// `ibv_resize_cq`: answered by [`Reply::Cq`] with the CQ's new ring, which holds the
    /// completions not yet polled at the same indices. The driver publishes its consumer
    /// index first and polls nothing until it has the answer.
    ResizeCq {
        /// Handle.
        cq: u32,
        /// Requested depth.
        cqe: u32,
    },
    /// `ibv_destroy_cq`.
    DestroyCq {
        /// Handle.
        cq: u32,
    },
    /// `ibv_create_qp`.
    CreateQp {
        /// PD handle.
        pd: u32,
        /// Send CQ handle.
        send_cq: u32,
        /// Receive CQ handle.
        recv_cq: u32,
        /// Transport.
        qp_type: QpType,
        /// Requested capacities.
        cap: QpCap,
        /// Signal every send.
        sq_sig_all: bool,
        /// SRQ handle its receives come from, if any.
        #[serde(default)]
        srq: Option<u32>,
        /// XRC domain handle of an XRC receive QP (which has no PD or CQs).
        #[serde(default)]
        xrcd: Option<u32>,
    },
    /// `ibv_modify_qp`.
    ModifyQp {
        /// Handle.
        qp: u32,
        /// `IBV_QP_*` mask.
        mask: u32,
        /// Attributes.
        attr: Box<QpAttr>,
    },
    /// `ibv_query_qp`.
    QueryQp {
        /// Handle.
        qp: u32,
    },
    /// `ibv_destroy_qp`.
    DestroyQp {
        /// Handle.
        qp: u32,
    },
    /// `ibv_create_srq`, or `ibv_create_srq_ex` (basic or XRC).
    CreateSrq {
        /// PD handle.
        pd: u32,
        /// Requested depth.
        max_wr: u32,
        /// SGEs per receive.
        max_sge: u32,
        /// Limit event threshold (0: disarmed).
        limit: u32,
        /// An XRC SRQ: its domain handle and the CQ handle its receives complete on.
        #[serde(default)]
        xrc: Option<(u32, u32)>,
    },
    /// `ibv_open_xrcd`: answered by [`Reply::Handle`].
    OpenXrcd {
        /// The (device, inode) of the file named by the app's fd; `None` for a private
        /// domain (fd -1). Contexts of one vRNIC that name the same file share the domain.
        key: Option<(u64, u64)>,
        /// `O_CREAT`.
        create: bool,
        /// `O_EXCL`.
        excl: bool,
    },
    /// `ibv_close_xrcd`.
    CloseXrcd {
        /// Handle.
        xrcd: u32,
    },
    /// `ibv_modify_srq`.
    ModifySrq {
        /// Handle.
        srq: u32,
        /// The new `max_wr`, if `IBV_SRQ_MAX_WR` was in the mask (a resize: answered by
        /// [`Reply::Srq`] with the SRQ's ring, moved if its depth changed).
        resize: Option<u32>,
        /// The new limit, if `IBV_SRQ_LIMIT` was in the mask.
        limit: Option<u32>,
    },
    /// `ibv_query_srq`.
    QuerySrq {
        /// Handle.
        srq: u32,
    },
    /// `ibv_destroy_srq`.
    DestroySrq {
        /// Handle.
        srq: u32,
    },
    /// `ibv_create_ah`.
    CreateAh {
        /// PD handle.
        pd: u32,
        /// The address.
        attr: AhAttr,
    },
    /// `ibv_destroy_ah`.
    DestroyAh {
        /// Handle.
        ah: u32,
    },
    /// `rdma_create_id`: a connection-manager id of this context.
    CmCreateId {
        /// Port space (`RDMA_PS_TCP` 0x106, `RDMA_PS_UDP` 0x111, `RDMA_PS_IB` 0x13f).
        ps: u16,
    },
    /// `rdma_destroy_id`.
    CmDestroyId {
        /// Id handle.
        id: u32,
    },
    /// `rdma_bind_addr`: answers [`Reply::CmAddr`] with the bound address (port 0 picks one).
    CmBind {
        /// Id handle.
        id: u32,
        /// Local address (`std::net::SocketAddr` text form).
        addr: String,
    },
    /// `rdma_listen`.
    CmListen {
        /// Id handle.
        id: u32,
    },
    /// `rdma_resolve_addr`: answers [`Reply::CmAddr`] with the source address; the
    /// `ADDR_RESOLVED`/`ADDR_ERROR` event follows.
    CmResolveAddr {
        /// Id handle.
        id: u32,
        /// Source address, if the app gave one.
        src: Option<String>,
        /// Destination address.
        dst: String,
    },
    /// `rdma_resolve_route`: the `ROUTE_RESOLVED` event follows.
    CmResolveRoute {
        /// Id handle.
        id: u32,
    },
    /// `rdma_connect`.
    CmConnect {
        /// Id handle.
        id: u32,
        /// Connection parameters (the QP number of the id's QP among them).
        param: CmParam,
    },
    /// `rdma_accept` (after the driver moved the QP to RTR and RTS).
    CmAccept {
        /// The id of the connection request.
        id: u32,
        /// Parameters.
        param: CmParam,
    },
    /// `rdma_reject`.
    CmReject {
        /// The id of the connection request.
        id: u32,
        /// Private data for the requester.
        private_data: Vec<u8>,
    },
    /// `rdma_establish` (the active side's QP is in RTS): the passive side gets `ESTABLISHED`.
    CmEstablish {
        /// Id handle.
        id: u32,
    },
    /// `rdma_disconnect`.
    CmDisconnect {
        /// Id handle.
        id: u32,
    },
    /// The next queued event of an id (after a [`event::CM`] notification named it).
    CmTakeEvent {
        /// Id handle.
        id: u32,
    },
    /// `ibv_rereg_mr` with `IBV_REREG_MR_CHANGE_PD` and/or `_CHANGE_ACCESS`.
    ReregMr {
        /// Handle.
        mr: u32,
        /// New PD handle.
        pd: Option<u32>,
        /// New access flags.
        access: Option<u32>,
    },
}

/// A successful answer; failures are [`Reply::Err`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[non_exhaustive]
pub enum Reply {
    /// Done, nothing to return.
    Ok,
    /// An errno, with a message for logs.
    Err {
        /// Positive errno value.
        errno: i32,
        /// What went wrong.
        msg: String,
    },
    /// For `QueryDevice`.
    Device(DeviceInfo),
    /// A new object's handle.
    Handle(u32),
    /// For `RegMr`.
    Mr {
        /// Handle.
        mr: u32,
        /// Local key.
        lkey: u32,
        /// Remote key.
        rkey: u32,
        /// Backing pages.
        runs: Vec<PageRun>,
    },
    /// For `AllocMw`.
    Mw {
        /// Handle (named by bind work requests).
        mw: u32,
        /// Its R_Key.
        rkey: u32,
    },
    /// For `DeregMr`: runs to detach, then release.
    Detach {
        /// Runs whose last registration went away.
        runs: Vec<PageRun>,
    },
    /// For `CreateCq`.
    Cq {
        /// Handle.
        cq: u32,
        /// Ring offset in the region.
        ring: u64,
        /// Ring depth (power of two, >= requested).
        depth: u32,
    },
    /// For `CreateQp`.
    Qp {
        /// Handle.
        qp: u32,
        /// QP number.
        qpn: u32,
        /// Send ring offset.
        sq: u64,
        /// Send ring depth.
        sq_depth: u32,
        /// Receive ring offset.
        rq: u64,
        /// Receive ring depth.
        rq_depth: u32,
        /// Granted capacities.
        cap: QpCap,
        /// Doorbell index to ring after publishing work on either ring.
        bell: u32,
    },
    /// For `QueryQp`.
    QpAttr(Box<QpAttr>),
    /// For `CreateSrq`.
    Srq {
        /// Handle.
        srq: u32,
        /// Ring offset in the region.
        ring: u64,
        /// Ring depth (power of two, >= `max_wr`).
        depth: u32,
        /// Doorbell index to ring after publishing receives.
        bell: u32,
        /// Its SRQ number (`ibv_get_srq_num`).
        #[serde(default)]
        srqn: u32,
    },
    /// A connection-manager address (`SocketAddr` text form).
    CmAddr(String),
    /// A connection-manager event.
    CmEvent(Box<CmEvent>),
    /// For `QuerySrq`.
    SrqAttr {
        /// Depth granted.
        max_wr: u32,
        /// SGEs per receive.
        max_sge: u32,
        /// Armed limit (0: disarmed).
        limit: u32,
    },
}

/// Connection parameters of `rdma_connect`/`rdma_accept`, as the peer sees them.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct CmParam {
    /// Private data (at most 196 bytes on connect, 148 on accept, as IB CM carries).
    pub private_data: Vec<u8>,
    /// RDMA READ/atomic requests the sender accepts as a responder.
    pub responder_resources: u8,
    /// RDMA READ/atomic requests the sender issues as a requester.
    pub initiator_depth: u8,
    /// Transport retries.
    pub retry_count: u8,
    /// RNR retries.
    pub rnr_retry_count: u8,
    /// The sender's QP number.
    pub qp_num: u32,
    /// The sender's Q_Key (UD).
    pub qkey: u32,
}

/// A connection-manager event for one id.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct CmEvent {
    /// `enum rdma_cm_event_type`.
    pub kind: u32,
    /// `status` (0, or a reject reason / negative errno, as librdmacm reports it).
    pub status: i32,
    /// For `CONNECT_REQUEST`: the new id (the event itself is queued on the listener).
    pub new_id: u32,
    /// The peer's parameters (connect, accept, reject).
    pub param: CmParam,
    /// The peer's LID.
    pub peer_lid: u16,
    /// The peer's GID.
    pub peer_gid: [u8; 16],
    /// The id's local address after the event (`SocketAddr` text, empty if none).
    pub local: String,
    /// The id's peer address.
    pub remote: String,
}

/// `enum rdma_cm_event_type` values the daemon produces, and the driver's own.
pub mod cm_event {
    #![allow(missing_docs)]
    pub const ADDR_RESOLVED: u32 = 0;
    pub const ADDR_ERROR: u32 = 1;
    pub const ROUTE_RESOLVED: u32 = 2;
    pub const CONNECT_REQUEST: u32 = 4;
    pub const CONNECT_RESPONSE: u32 = 5;
    pub const UNREACHABLE: u32 = 7;
    pub const REJECTED: u32 = 8;
    pub const ESTABLISHED: u32 = 9;
    pub const DISCONNECTED: u32 = 10;
    pub const DEVICE_REMOVAL: u32 = 11;
}

/// Async event kinds carried in a mailbox's event ring (`enum ibv_event_type` values).
pub mod event {
    /// `IBV_EVENT_CQ_ERR`
    pub const CQ_ERR: u32 = 0;
    /// `IBV_EVENT_QP_FATAL`
    pub const QP_FATAL: u32 = 1;
    /// `IBV_EVENT_PORT_ACTIVE`
    pub const PORT_ACTIVE: u32 = 9;
    /// `IBV_EVENT_DEVICE_FATAL`
    pub const DEVICE_FATAL: u32 = 8;
    /// `IBV_EVENT_QP_LAST_WQE_REACHED`
    pub const QP_LAST_WQE_REACHED: u32 = 16;
    /// `IBV_EVENT_SRQ_ERR`
    pub const SRQ_ERR: u32 = 14;
    /// `IBV_EVENT_SRQ_LIMIT_REACHED`
    pub const SRQ_LIMIT_REACHED: u32 = 15;
    /// Not an `ibv_event_type`: a connection-manager event is queued on the id named by the
    /// handle (the driver fetches it with `CmTakeEvent`).
    pub const CM: u32 = 0x1000;
}

/// A request on the daemon's admin socket (one JSON line each way).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[non_exhaustive]
pub enum AdminRequest {
    /// List vRNICs.
    List,
    /// Create a vRNIC that stays until removed.
    Create {
        /// Name.
        name: String,
        /// Its tenants' group (`None`: `default`).
        #[serde(default)]
        group: Option<String>,
        /// Its virtual IPv4 address in the group (`None`: one from the group's subnet).
        #[serde(default)]
        ip: Option<std::net::Ipv4Addr>,
        /// Its QoS limits (`vrnic policy` changes them later).
        #[serde(default)]
        policy: PolicyChange,
    },
    /// Change a vRNIC's QoS limits, live.
    Policy {
        /// Name.
        name: String,
        /// The limits to change.
        change: PolicyChange,
    },
    /// Remove a vRNIC: refused while it has users, unless `force` (then each of its users gets
    /// `IBV_EVENT_DEVICE_FATAL` and loses it).
    Remove {
        /// Name.
        name: String,
        /// Detach its users.
        #[serde(default)]
        force: bool,
    },
    /// Move one QP of a vRNIC to the error state (`vrnic qp kill`).
    KillQp {
        /// The vRNIC's name.
        name: String,
        /// The QP's number.
        qpn: u32,
    },
    /// Hold a vRNIC for a `vrnic run`: created if missing (then removed when its last user
    /// leaves), held while this admin connection stays open. `None` picks a fresh name.
    Hold {
        /// Name.
        name: Option<String>,
        /// The group a vRNIC created for it joins (`None`: `default`); an existing vRNIC must
        /// already be in it, if given.
        #[serde(default)]
        group: Option<String>,
        /// The virtual IP a vRNIC created for it gets.
        #[serde(default)]
        ip: Option<std::net::Ipv4Addr>,
    },
    /// List the peer links to other hosts' daemons.
    Peers,
    /// List the whole directory: this host's vRNICs and those other hosts announced.
    ListAll,
    /// The counters of one vRNIC (`Some(name)`) or of every vRNIC of this host.
    Stats {
        /// Its name (`None`: all).
        #[serde(default)]
        name: Option<String>,
        /// Only this QP of the vRNIC (its number): what it moved since it was created.
        #[serde(default)]
        qp: Option<u32>,
    },
}

/// A change of a vRNIC's QoS limits: each `None` keeps what is in force, `Some(0)` lifts the
/// limit, any other value sets it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PolicyChange {
    /// Payload bytes per second it may send.
    #[serde(default)]
    pub max_bw: Option<u64>,
    /// Work requests per second it may have executed.
    #[serde(default)]
    pub max_rate: Option<u64>,
}

/// Work requests (or messages) and their bytes, one opcode class's.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct FlowStats {
    /// Work requests (as requester) or messages (as responder).
    pub wrs: u64,
    /// Their bytes.
    pub bytes: u64,
}

/// Traffic of one direction by opcode class.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ClassStats {
    /// SEND (with or without immediate or invalidate).
    pub send: FlowStats,
    /// RDMA WRITE (with or without immediate).
    pub write: FlowStats,
    /// RDMA READ.
    pub read: FlowStats,
    /// Atomics (8 bytes each).
    pub atomic: FlowStats,
}

/// One vRNIC's counters since it was made (`vrnic stats`), exact, kept by the daemon's engine.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct VnicStats {
    /// Its name.
    pub name: String,
    /// Its tenants' group.
    pub group: String,
    /// The QP these counters are of (`vrnic stats NAME --qp QPN`); `None`: the whole vRNIC.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub qpn: Option<u32>,
    /// As requester: work requests completed successfully, by class.
    pub sent: ClassStats,
    /// As responder: messages received into receives, WRITEs placed, READs served, atomics
    /// executed, by class.
    pub received: ClassStats,
    /// Completions posted to its CQs, by status name (`ibv_wc_status_str`'s words in snake
    /// case: `success`, `rem_access_err`, ...); statuses never seen are left out.
    pub completions: std::collections::BTreeMap<String, u64>,
    /// RNR NAKs it sent as responder.
    pub rnr_naks: u64,
    /// Requests it refused as responder with a NAK.
    pub naks: u64,
    /// UD datagrams dropped at its QPs (wrong Q_Key, no receive).
    pub ud_dropped: u64,
    /// Times its QoS limit held it back (a turn refused until its debt was paid), and how
    /// long, in microseconds, in all.
    #[serde(default)]
    pub qos_waits: u64,
    #[serde(default)]
    /// See `qos_waits`.
    pub qos_waited_us: u64,
    /// Bytes the engine copied into its regions' memory (or read out of them into a frame
    /// for another host), one count per copy: a byte that reaches a vRNIC of this daemon
    /// moves once, whichever engine threads the two ends are on.
    #[serde(default)]
    pub copied: u64,
    /// Its connection manager's traffic (rdma_cm), the whole vRNIC's (a QP's counters leave
    /// it at zero).
    #[serde(default)]
    pub cm: CmStats,
}

/// A vRNIC's rdma_cm connections, counted by the daemon's connection manager.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct CmStats {
    /// `rdma_connect` calls of its ids.
    pub connects: u64,
    /// Connection requests its listeners received.
    pub requests: u64,
    /// Connections of its ids established (either side).
    pub established: u64,
    /// Rejections its ids received: by the peer (`rdma_reject`), for want of a listener, or
    /// across groups.
    pub rejected: u64,
}

/// One peer link in a listing.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PeerSummary {
    /// The peer daemon's address.
    pub addr: String,
    /// `up`, `connecting` or `down`.
    pub state: String,
    /// The last keepalive round trip, in microseconds.
    pub rtt_us: Option<u64>,
    /// Bytes received.
    pub bytes_in: u64,
    /// Of those, payload bytes read from the socket straight into registered memory.
    pub placed_in: u64,
    /// Bytes sent.
    pub bytes_out: u64,
    /// Segments sent again (after a NAK, an RNR NAK or a link that came back).
    pub retransmits: u64,
    /// Times the link went down.
    pub drops: u64,
    /// How the link is protected: `none`, `authenticated` (its peer proved its key) or
    /// `encrypted` (and its frames are encrypted).
    #[serde(default)]
    pub security: String,
}

/// One vRNIC in a listing.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct VnicSummary {
    /// Name.
    pub name: String,
    /// LID.
    pub lid: u16,
    /// GID index 0.
    pub gid: [u8; 16],
    /// QPs now.
    pub qps: usize,
    /// Attached contexts plus holders.
    pub users: usize,
    /// Whether it was created explicitly (not removed with its last user).
    pub persistent: bool,
    /// Whether the daemon records it in its file of persistent vRNICs, to make it again when
    /// it starts again (`vrnic create`'s, unless the daemon runs with `--no-persist`).
    #[serde(default)]
    pub recorded: bool,
    /// Its directory (to bind-mount or preload against).
    pub dir: String,
    /// Its tenants' group.
    #[serde(default)]
    pub group: String,
    /// Its virtual IP in the group (what rdma_cm resolves within the group).
    #[serde(default)]
    pub ip: String,
    /// The engine thread that serves it (its home shard, with `--spread-qps`), from 0.
    #[serde(default)]
    pub engine: usize,
    /// Its bandwidth limit in payload bytes per second (`None`: none).
    #[serde(default)]
    pub max_bw: Option<u64>,
    /// Its message-rate limit in work requests per second (`None`: none).
    #[serde(default)]
    pub max_rate: Option<u64>,
}

/// Most entries a `vrnic ls --all` reply holds (this host's vRNICs first, then other hosts'
/// by host and LID): the reply stays within what an admin client may be sent.
pub const DIRECTORY_LISTING_MAX: usize = 32768;

/// One vRNIC of the whole directory (`vrnic ls --all`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DirectoryEntry {
    /// The host it is on: `local`, or the peer daemon's address.
    pub host: String,
    /// Its name on that host.
    pub name: String,
    /// LID.
    pub lid: u16,
    /// GID index 0.
    pub gid: [u8; 16],
    /// Virtual IP.
    pub ip: String,
    /// Tenants' group.
    pub group: String,
    /// QPs now (known for this host's vRNICs only).
    pub qps: Option<usize>,
}

/// An answer on the admin socket.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[non_exhaustive]
pub enum AdminReply {
    /// Done.
    Ok,
    /// Failed.
    Err(String),
    /// Listing.
    List(Vec<VnicSummary>),
    /// The held or created vRNIC.
    Vnic(VnicSummary),
    /// Peer links.
    Peers(Vec<PeerSummary>),
    /// The whole directory.
    Directory(Vec<DirectoryEntry>),
    /// Counters.
    Stats(Vec<VnicStats>),
}

/// Formats a GID the way `ibv_devinfo` does (`fe80:0000:...`).
pub fn gid_string(gid: &[u8; 16]) -> String {
    gid.chunks(2)
        .map(|c| format!("{:02x}{:02x}", c[0], c[1]))
        .collect::<Vec<_>>()
        .join(":")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requests_round_trip_through_json() {
        let r = Request::ModifyQp {
            qp: 3,
            mask: 1,
            attr: Box::default(),
        };
        let s = serde_json::to_vec(&r).unwrap();
        assert_eq!(serde_json::from_slice::<Request>(&s).unwrap(), r);
    }

    #[test]
    fn hostile_bytes_are_an_error() {
        assert!(serde_json::from_slice::<Request>(b"\xff{[[[").is_err());
        let deep = "[".repeat(10_000);
        assert!(serde_json::from_slice::<Request>(deep.as_bytes()).is_err());
    }

    #[test]
    fn gid_formats_like_devinfo() {
        let mut g = [0u8; 16];
        g[0] = 0xfe;
        g[1] = 0x80;
        g[15] = 1;
        assert_eq!(gid_string(&g), "fe80:0000:0000:0000:0000:0000:0000:0001");
    }
}
