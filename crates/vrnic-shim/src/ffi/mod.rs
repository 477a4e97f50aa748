//! Every `extern "C"` function of the driver library: the exported libibverbs symbols and the
//! functions placed in the ops tables (`ibv_context_ops`, `verbs_context`).
//!
//! Each function has the same shape: inside [`guard`] (which catches panics, so none crosses
//! into C), null checks, pointer to the Rust object behind the C struct (each object starts
//! with its rdma-core struct: container_of), a call into `client`, and the mapping of the
//! outcome to rdma-core's return convention (an errno, or NULL/-1 with `errno` set).
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
