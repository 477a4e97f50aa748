//! `rdma_getaddrinfo`/`rdma_freeaddrinfo`.
#![allow(unsafe_code)]
#![allow(clippy::not_unsafe_ptr_arg_deref)]

use super::*;

/// `getaddrinfo` hints for an `rdma_addrinfo`'s, as librdmacm's `ucma_convert_to_ai`: the
/// passive and numeric-host flags, the family (but `AF_IB`), the socket type of the QP type and
/// the protocol of the port space.
pub(super) fn gai_hints(h: &rdma_addrinfo) -> libc::addrinfo {
    // SAFETY: plain C data; zero is valid.
    let mut gh: libc::addrinfo = unsafe { std::mem::zeroed() };
    if h.ai_flags & RAI_PASSIVE != 0 {
        gh.ai_flags |= libc::AI_PASSIVE;
    }
    if h.ai_flags & RAI_NUMERICHOST != 0 {
        gh.ai_flags |= libc::AI_NUMERICHOST;
    }
    // AF_IB names no family the resolver knows: it looks up any, as librdmacm has it.
    if h.ai_family != libc::AF_IB {
        gh.ai_family = h.ai_family;
    }
    gh.ai_socktype = match h.ai_qp_type as u32 {
        IBV_QPT_RC | IBV_QPT_UC | IBV_QPT_XRC_SEND | IBV_QPT_XRC_RECV => libc::SOCK_STREAM,
        IBV_QPT_UD => libc::SOCK_DGRAM,
        _ => 0,
    };
    gh.ai_protocol = match h.ai_port_space as u32 {
        RDMA_PS_TCP => libc::IPPROTO_TCP,
        RDMA_PS_UDP | RDMA_PS_IPOIB => libc::IPPROTO_UDP,
        RDMA_PS_IB if gh.ai_socktype == libc::SOCK_STREAM => libc::IPPROTO_TCP,
        RDMA_PS_IB if gh.ai_socktype == libc::SOCK_DGRAM => libc::IPPROTO_UDP,
        _ => 0,
    };
    gh
}

/// A `malloc`ed copy of the `n`-byte address `a` (freed by `rdma_freeaddrinfo`); NULL if out of
/// memory.
///
/// # Safety
/// `a` must hold `n` readable bytes.
pub(super) unsafe fn copy_addr(
    a: *const libc::sockaddr,
    n: libc::socklen_t,
) -> *mut libc::sockaddr {
    // SAFETY: malloc has no preconditions.
    let p = unsafe { libc::malloc(n as usize) }.cast::<libc::sockaddr>();
    if !p.is_null() {
        // SAFETY: p holds n bytes; the caller vouches for n bytes at a.
        unsafe { std::ptr::copy_nonoverlapping(a.cast::<u8>(), p.cast::<u8>(), n as usize) };
    }
    p
}

/// `rdma_getaddrinfo` with librdmacm's semantics (`librdmacm/addrinfo.c`): with a node or a
/// service, the first address `getaddrinfo` finds under the hints (the source address of a
/// passive lookup, else the destination), the QP type and port space from the hints or else
/// from the socket type and protocol found; with neither, the hints themselves (flags, family,
/// QP type, port space and their destination address) — libfabric's verbs provider asks this
/// way with the address already in `ai_dst_addr`, or in `ai_src_addr` with `RAI_PASSIVE`.
/// Either way a source address in the hints is kept when the lookup gave none. No node,
/// service or hints: `EINVAL`. A failed lookup returns its `getaddrinfo` code (negative)
/// with errno `ENODEV`.
#[unsafe(no_mangle)]
pub extern "C" fn vrnic_rdma_getaddrinfo(
    node: *const c_char,
    service: *const c_char,
    hints: *const rdma_addrinfo,
    res: *mut *mut rdma_addrinfo,
) -> c_int {
    guard(-1, || {
        if res.is_null() || (node.is_null() && service.is_null() && hints.is_null()) {
            return minus_one(libc::EINVAL);
        }
        // SAFETY: plain C data; zero is valid (librdmacm's `nohints`).
        let none: rdma_addrinfo = unsafe { std::mem::zeroed() };
        let h = if hints.is_null() {
            &none
        } else {
            // SAFETY: hints is the app's, readable for this call.
            unsafe { &*hints }
        };
        // SAFETY: calloc of one zeroed rdma_addrinfo; freed by rdma_freeaddrinfo.
        let r = unsafe { libc::calloc(1, std::mem::size_of::<rdma_addrinfo>()) }
            .cast::<rdma_addrinfo>();
        if r.is_null() {
            return minus_one(libc::ENOMEM);
        }
        // SAFETY: r is a zeroed rdma_addrinfo of ours.
        let o = unsafe { &mut *r };
        let mut oom = false;
        if !node.is_null() || !service.is_null() {
            let gh = gai_hints(h);
            let mut gai: *mut libc::addrinfo = null_mut();
            let gh_ptr: *const libc::addrinfo = if hints.is_null() { null_mut() } else { &gh };
            // SAFETY: node/service are NULL or C strings; gai is our out-pointer.
            let rc = unsafe { libc::getaddrinfo(node, service, gh_ptr, &mut gai) };
            if rc != 0 || gai.is_null() {
                vrnic_rdma_freeaddrinfo(r);
                set_errno(libc::ENODEV);
                return rc.min(-1);
            }
            // SAFETY: gai is getaddrinfo's list; its first entry has an address.
            let g = unsafe { &*gai };
            o.ai_qp_type = if h.ai_qp_type != 0 {
                h.ai_qp_type
            } else {
                match g.ai_socktype {
                    libc::SOCK_STREAM => IBV_QPT_RC as c_int,
                    libc::SOCK_DGRAM => IBV_QPT_UD as c_int,
                    _ => 0,
                }
            };
            o.ai_port_space = if h.ai_port_space != 0 {
                h.ai_port_space
            } else {
                match g.ai_protocol {
                    libc::IPPROTO_TCP => RDMA_PS_TCP as c_int,
                    libc::IPPROTO_UDP => RDMA_PS_UDP as c_int,
                    _ => 0,
                }
            };
            o.ai_family = g.ai_family;
            // SAFETY: the entry's address holds ai_addrlen bytes.
            let a = unsafe { copy_addr(g.ai_addr, g.ai_addrlen) };
            oom |= a.is_null();
            if g.ai_flags & libc::AI_PASSIVE != 0 {
                o.ai_flags = RAI_PASSIVE;
                o.ai_src_addr = a;
                o.ai_src_len = if a.is_null() { 0 } else { g.ai_addrlen };
            } else {
                o.ai_dst_addr = a;
                o.ai_dst_len = if a.is_null() { 0 } else { g.ai_addrlen };
            }
            // SAFETY: gai came from getaddrinfo.
            unsafe { libc::freeaddrinfo(gai) };
        } else {
            o.ai_flags = h.ai_flags;
            o.ai_family = h.ai_family;
            o.ai_qp_type = h.ai_qp_type;
            o.ai_port_space = h.ai_port_space;
            if h.ai_dst_len != 0 && !h.ai_dst_addr.is_null() {
                // SAFETY: the hints' destination holds ai_dst_len bytes.
                o.ai_dst_addr = unsafe { copy_addr(h.ai_dst_addr, h.ai_dst_len) };
                o.ai_dst_len = h.ai_dst_len;
                oom |= o.ai_dst_addr.is_null();
            }
        }
        if !oom && o.ai_src_len == 0 && h.ai_src_len != 0 && !h.ai_src_addr.is_null() {
            // SAFETY: the hints' source holds ai_src_len bytes.
            o.ai_src_addr = unsafe { copy_addr(h.ai_src_addr, h.ai_src_len) };
            o.ai_src_len = h.ai_src_len;
            oom |= o.ai_src_addr.is_null();
        }
        if oom {
            vrnic_rdma_freeaddrinfo(r);
            return minus_one(libc::ENOMEM);
        }
        // SAFETY: res is the app's out-pointer.
        unsafe { *res = r };
        0
    })
}

#[unsafe(no_mangle)]
pub extern "C" fn vrnic_rdma_freeaddrinfo(res: *mut rdma_addrinfo) {
    let mut p = res;
    while !p.is_null() {
        // SAFETY: made by rdma_getaddrinfo with calloc.
        let r = unsafe { &*p };
        let next = r.ai_next;
        for a in [
            r.ai_src_addr.cast::<c_void>(),
            r.ai_dst_addr.cast(),
            r.ai_src_canonname.cast(),
            r.ai_dst_canonname.cast(),
            r.ai_route,
            r.ai_connect,
        ] {
            // SAFETY: NULL or malloc'ed by rdma_getaddrinfo.
            unsafe { libc::free(a) };
        }
        // SAFETY: calloc'ed by rdma_getaddrinfo; not used after this.
        unsafe { libc::free(p.cast()) };
        p = next;
    }
}
