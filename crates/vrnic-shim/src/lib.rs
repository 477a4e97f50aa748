//! The vrnic driver library: a shared object that `LD_PRELOAD` loads into an unmodified RDMA
//! program, exporting the libibverbs and librdmacm C ABIs over a vRNIC.
//!
//! Control verbs (open, PD, MR, CQ, QP create/modify/destroy, connection management) become
//! requests to the daemon through the vRNIC region's control mailbox (API remoting); the data
//! path (`post_send`, `post_recv`, `poll_cq`, `req_notify_cq`) writes and reads rings in the
//! same shared region, with no system call per operation. Registered memory is made zero-copy by mapping region
//! pages over the application's buffer. The real libibverbs stays loaded underneath for the
//! context-free helpers (`ibv_wc_status_str`, ...), which this library does not replace.
//!
//! What it deliberately is not: a provider plugin for rdma-core. Programs that `dlopen` the real
//! libibverbs and resolve verbs through that handle bypass the preload (brief §9).
//!
//! Contract with its host program: it prints nothing unless `VRNIC_LOG` is set, never lets a
//! panic cross the C boundary, installs no signal handlers, and starts one thread per opened
//! device (the notifier), not at load time.
//!
//! Layout: [`abi`] and [`cm_abi`] mirror the C structs of libibverbs and librdmacm; `ffi`
//! holds every `extern "C"` verb, by family (devices, PD/MR, CQ, QP, post, events, SRQ, AH,
//! extended verbs, memory windows, device memory, XRC), over its objects and under the
//! ops-table fill; `cm` the `rdma_*` connection manager; `symbols` gives them rdma-core's
//! symbol versions; [`client`] is the safe core over `vrnic-shm`.
#![deny(unsafe_code)]

pub mod abi;
pub mod client;
mod cm;
pub mod cm_abi;
mod cq_events;
mod ffi;
mod limits;
mod maps;
mod parked;
mod symbols;
mod sys;

pub use symbols::EXPORTS;
