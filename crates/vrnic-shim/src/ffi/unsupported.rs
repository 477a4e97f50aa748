//! Calls this device answers without doing anything: fork support (none needed), importing
//! objects from another process, multicast, ECE.
#![allow(unsafe_code)]
#![allow(clippy::not_unsafe_ptr_arg_deref)]

use std::ffi::{c_int, c_uint, c_void};

use super::objects::{guard, null_err};
use crate::abi::*;
use crate::sys;

/// `enum ibv_fork_status`: `IBV_FORK_UNNEEDED`.
const IBV_FORK_UNNEEDED: c_int = 2;

/// `ibv_fork_init`: nothing to set up, as [`vrnic_ibv_is_fork_initialized`] says. rdma-core's
/// `ibv_fork_init` returns 0 at once when fork support is unneeded too.
#[unsafe(no_mangle)]
pub extern "C" fn vrnic_ibv_fork_init() -> c_int {
    0
}

/// `ibv_is_fork_initialized`: `IBV_FORK_UNNEEDED`, always. What `ibv_fork_init` guards against
/// on a real device is copy on write: after a fork the parent's next write to a registered
/// page gives the parent a new page, while the device keeps reading and writing the old one.
/// Here registered memory is region pages mapped `MAP_SHARED` over the app's buffer; a fork
/// neither copies nor moves them, so the parent's registrations keep working with no setup
/// (the engine reaches the very pages the parent uses). The child shares those pages with the
/// parent (not a copy, as on a kernel with copy-on-fork; not a hole, as after `ibv_fork_init`
/// with `MADV_DONTFORK`): docs/verbs.md says so.
#[unsafe(no_mangle)]
pub extern "C" fn vrnic_ibv_is_fork_initialized() -> c_int {
    IBV_FORK_UNNEEDED
}

macro_rules! unsupported_ptr {
    ($($name:ident($($arg:ident: $ty:ty),*) -> $ret:ty;)*) => {$(
        #[unsafe(no_mangle)]
        pub extern "C" fn $name($(_: $ty),*) -> *mut $ret {
            null_err(libc::EOPNOTSUPP)
        }
    )*};
}

macro_rules! unsupported_int {
    ($($name:ident($($arg:ident: $ty:ty),*) = $val:expr;)*) => {$(
        #[unsafe(no_mangle)]
        pub extern "C" fn $name($(_: $ty),*) -> c_int {
            $val
        }
    )*};
}

// Importing (`ibv_import_device`, `_pd`, `_mr`, `_dm`) shares a context's objects with another
// process. A vRNIC context is one process's attachment (its socket or claimed mailbox, whose
// close is how the daemon learns it died and tears down what it owns), and every object
// belongs to one context; there is no kernel uverbs file to pass between processes and no
// way for a second attachment to act on another's objects. So the verbs answer as rdma-core
// does for a provider without `import_context` and with the default `import_pd`/`import_mr`/
// `import_dm` ops: NULL with `EOPNOTSUPP` (docs/verbs.md).
unsupported_ptr! {
    vrnic_ibv_reg_dmabuf_mr(pd: *mut ibv_pd, off: u64, len: usize, iova: u64, fd: c_int, access: c_int) -> ibv_mr;
    vrnic_ibv_import_pd(ctx: *mut ibv_context, h: u32) -> ibv_pd;
    vrnic_ibv_import_mr(pd: *mut ibv_pd, h: u32) -> ibv_mr;
    vrnic_ibv_import_dm(ctx: *mut ibv_context, h: u32) -> c_void;
}

/// `ibv_import_device`: rdma-core's checks in order, for a device without `import_context`:
/// an fd that `fstat` refuses is `EINVAL`; any open fd (a context's `cmd_fd`, dup'ed or passed
/// by `SCM_RIGHTS`: here a socket, not a uverbs character device) is `EOPNOTSUPP`.
#[unsafe(no_mangle)]
pub extern "C" fn vrnic_ibv_import_device(fd: c_int) -> *mut ibv_context {
    guard(null_err(libc::EIO), || {
        if !sys::fd_is_open(fd) {
            return null_err(libc::EINVAL);
        }
        null_err(libc::EOPNOTSUPP)
    })
}

unsupported_int! {
    vrnic_ibv_attach_mcast(qp: *mut ibv_qp, gid: *const ibv_gid, lid: u16) = libc::EOPNOTSUPP;
    vrnic_ibv_detach_mcast(qp: *mut ibv_qp, gid: *const ibv_gid, lid: u16) = libc::EOPNOTSUPP;
    vrnic_ibv_resolve_eth_l2_from_gid(ctx: *mut ibv_context, a: *mut ibv_ah_attr, mac: *mut u8, vid: *mut u16) = libc::EOPNOTSUPP;
    vrnic_ibv_query_ece(qp: *mut ibv_qp, ece: *mut c_void) = libc::EOPNOTSUPP;
    vrnic_ibv_set_ece(qp: *mut ibv_qp, ece: *mut c_void) = libc::EOPNOTSUPP;
    vrnic_ibv_query_qp_data_in_order(qp: *mut ibv_qp, op: c_uint, flags: u32) = 0;
}

#[unsafe(no_mangle)]
pub extern "C" fn vrnic_ibv_unimport_pd(_pd: *mut ibv_pd) {}
#[unsafe(no_mangle)]
pub extern "C" fn vrnic_ibv_unimport_mr(_mr: *mut ibv_mr) {}
#[unsafe(no_mangle)]
pub extern "C" fn vrnic_ibv_unimport_dm(_dm: *mut c_void) {}
