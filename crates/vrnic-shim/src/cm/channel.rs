//! Event channels: `rdma_create_event_channel`/`rdma_destroy_event_channel`.
#![allow(unsafe_code)]
#![allow(clippy::not_unsafe_ptr_arg_deref)]

use super::*;

/// The lowest fd number an event channel gets: three quarters of the way to the process's fd
/// limit (at most `FD_SETSIZE`, 1024), above the fds an app opens itself.
///
/// librdmacm's rsocket names each socket by its id's event-channel fd, and Debian 12's
/// `librspreload` (rdma-core v44) maps `select` results back to the app's fds by walking fd
/// numbers upward until one maps to that channel fd. An fd it does not track maps to itself, so
/// when the channel fd is lower than the app's fd for the socket, the walk stops at the channel
/// fd and sets that bit instead: the app never sees the socket ready (rdma-core fixed the walk
/// in v63, commit 7ea19e1). An accepted rsocket's channel is made before the app's `accept`
/// opens its fd, so without this floor every accepted socket is lost to `select` (iperf3's
/// server saw no data). A kernel-backed librdmacm has the same bug; high fds keep it away.
pub(super) fn channel_fd_floor() -> c_int {
    // SAFETY: getrlimit writes one rlimit into our local.
    let mut r: libc::rlimit = unsafe { std::mem::zeroed() };
    // SAFETY: as above.
    let soft = if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut r) } == 0 {
        r.rlim_cur.min(1024) as c_int
    } else {
        1024
    };
    soft * 3 / 4
}

pub(super) fn new_channel() -> Result<*mut VChannel, i32> {
    let efd = EventFd::new_above(channel_fd_floor())
        .map_err(|e| e.raw_os_error().unwrap_or(libc::EMFILE))?;
    let fd = efd.fd();
    Ok(Box::into_raw(Box::new(VChannel {
        ch: rdma_event_channel { fd },
        efd,
        queue: Mutex::new(VecDeque::new()),
    })))
}

#[unsafe(no_mangle)]
pub extern "C" fn vrnic_rdma_create_event_channel() -> *mut rdma_event_channel {
    guard(null_err(libc::EIO), || match new_channel() {
        Ok(c) => c.cast(),
        Err(e) => null_err(e),
    })
}

/// The channel is not freed and its fd stays open until the process exits: a thread may still
/// be on its way into `rdma_get_cm_event` on it (Debian 12's `rping` does this at exit: its CM
/// thread loops back while the main thread destroys the channel, and with a closed fd it would
/// fail with `EBADF` and `exit(-1)`). Such a thread now waits, as one already blocked in the
/// kernel's read would, until the process ends. The cost is one fd and a few bytes per
/// destroyed channel; programs make few.
#[unsafe(no_mangle)]
pub extern "C" fn vrnic_rdma_destroy_event_channel(ch: *mut rdma_event_channel) {
    guard((), || {
        if !ch.is_null() {
            // SAFETY: made by create_event_channel; the app gives it up now.
            let c = unsafe { &*ch.cast::<VChannel>() };
            if let Ok(mut q) = c.queue.lock() {
                q.clear();
            }
        }
    })
}
