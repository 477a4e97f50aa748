//! Every `extern "C"` function of the driver library: the exported libibverbs symbols and the
//! functions placed in the ops tables (`ibv_context_ops`, `verbs_context`).
//!
//! Each function has the same shape: inside [`guard`] (which catches panics, so none crosses
//! into C), null checks, pointer to the Rust object behind the C struct (each object starts
//! with its rdma-core struct: container_of), a call into `client`, and the mapping of the
//! outcome to rdma-core's return convention (an errno, or NULL/-1 with `errno` set).
//!
//! Three layers, each importing only from the ones below it:
//! - `objects`: the objects behind the C structs, the way from a C pointer to them, the C
//!   boundary's helpers, and what several families share (SGE lists, the receive-list writer,
//!   a QP made from the daemon's answer, the bind WQE fields, the async event kinds). It names
//!   no family.
//! - the verb families, one file each: `device` (device list, query verbs), `mr` (PDs and
//!   MRs), `cq` (completion channels, CQs, `poll_cq`, `req_notify_cq`), `qp` (the QP control
//!   path), `post` (`post_send`, `post_recv`), `events` (async events), `srq`, `ah`, `mw`,
//!   `xrc`, `resize`, `unsupported`, and, built on the plain verbs they extend, `ex` (on `qp`
//!   and `cq`) and `dm` (on `mr`). No other family names another: where one verb posts
//!   through another (`ibv_bind_mw` posts a work request), it goes through the QP's ops table,
//!   as the C inlines do.
//! - `table`: `ibv_open_device`, which fills a context's ops tables and so names every family,
//!   and `ibv_close_device`.
//!
//! The connection manager (`crate::cm`) sits beside `table`, over the families.
#![allow(unsafe_code)]
#![allow(clippy::missing_safety_doc)]
#![allow(clippy::not_unsafe_ptr_arg_deref)]

mod objects;

mod ah;
pub(crate) mod cq;
pub(crate) mod device;
mod dm;
mod events;
mod ex;
pub(crate) mod mr;
mod mw;
mod post;
pub(crate) mod qp;
mod resize;
pub(crate) mod srq;
mod unsupported;
mod xrc;

pub(crate) mod table;

pub(crate) use objects::{context, guard, minus_one, null_err};
