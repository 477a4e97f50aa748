//! XRC domains: `ibv_open_xrcd`/`ibv_close_xrcd` (control path, remoted to the daemon). The
//! two XRC QP types are made in `qp.rs`, XRC SRQs in `srq.rs`, and the XRC SRQ number of a
//! send work request is set in `post.rs` (`ibv_post_send`) and `ex.rs` (`ibv_wr_set_xrc_srqn`).
//!
//! A domain opened with fd -1 is private; one opened with a file's fd is the domain of that
//! file (its device and inode, read here by `fstat`) on this vRNIC: every process of the vRNIC
//! that opens the same file joins it, as the kernel shares XRC domains by inode per device.
//! Naming a file is not a capability beyond the vRNIC: the daemon scopes the key to the
//! vRNIC, so a tenant that names another tenant's file gets a domain of its own.
//! `ibv_open_qp` (sharing one XRC receive QP between processes) is not offered: the
//! verbs_context slot stays NULL and libibverbs answers `EOPNOTSUPP`.
#![allow(unsafe_code)]
#![allow(clippy::not_unsafe_ptr_arg_deref)]

use std::ffi::c_int;

use vrnic_api::{Reply, Request};

use super::objects::{VXrcd, context, guard, null_err, xrcd_handle};
use crate::abi::*;

/// `verbs_context.open_xrcd` (the `ibv_open_xrcd` inline).
pub extern "C" fn vrnic_open_xrcd(
    ctx: *mut ibv_context,
    attr: *mut ibv_xrcd_init_attr,
) -> *mut ibv_xrcd {
    guard(null_err(libc::EIO), || {
        if ctx.is_null() || attr.is_null() {
            return null_err(libc::EINVAL);
        }
        // SAFETY: attr is the app's.
        let a = unsafe { *attr };
        let known = IBV_XRCD_INIT_ATTR_FD | IBV_XRCD_INIT_ATTR_OFLAGS;
        if a.comp_mask & !known != 0 {
            return null_err(libc::EOPNOTSUPP);
        }
        // Both are required (rdma-core's `ibv_cmd_open_xrcd`).
        if a.comp_mask & known != known || a.oflags & !(libc::O_CREAT | libc::O_EXCL) != 0 {
            return null_err(libc::EINVAL);
        }
        let key = if a.fd == -1 {
            None
        } else {
            // SAFETY: all-zero is a valid stat; fstat fills it or fails.
            let mut st: libc::stat = unsafe { std::mem::zeroed() };
            // SAFETY: fstat on the app's fd writes only into st.
            if unsafe { libc::fstat(a.fd, &mut st) } != 0 {
                return null_err(libc::EBADF);
            }
            Some((st.st_dev, st.st_ino))
        };
        // SAFETY: ctx is ours.
        let c = unsafe { context(ctx) };
        let req = Request::OpenXrcd {
            key,
            create: a.oflags & libc::O_CREAT != 0,
            excl: a.oflags & libc::O_EXCL != 0,
        };
        let h = match c.conn.call(&req) {
            Ok(Reply::Handle(h)) => h,
            Ok(_) => return null_err(libc::EPROTO),
            Err(e) => return null_err(e),
        };
        Box::into_raw(Box::new(VXrcd {
            xrcd: ibv_xrcd { context: ctx },
            handle: h,
        }))
        .cast()
    })
}

/// `verbs_context.close_xrcd` (the `ibv_close_xrcd` inline): 0, or `EBUSY` while XRC SRQs or
/// receive QPs of this process use the domain.
pub extern "C" fn vrnic_close_xrcd(xrcd: *mut ibv_xrcd) -> c_int {
    guard(libc::EIO, || {
        if xrcd.is_null() {
            return libc::EINVAL;
        }
        // SAFETY: xrcd is one of ours and open.
        let ctx = unsafe { (*xrcd).context };
        // SAFETY: as above.
        let h = unsafe { xrcd_handle(xrcd) };
        // SAFETY: the domain's context outlives it.
        let c = unsafe { context(ctx) };
        match c.conn.call(&Request::CloseXrcd { xrcd: h }) {
            Ok(_) => {
                // SAFETY: made by Box::into_raw in vrnic_open_xrcd; closed once.
                drop(unsafe { Box::from_raw(xrcd.cast::<VXrcd>()) });
                0
            }
            Err(e) => e,
        }
    })
}
