//! Socket addresses: `sockaddr` to and from `SocketAddr`, and an id's local and remote addresses.
#![allow(unsafe_code)]
#![allow(clippy::not_unsafe_ptr_arg_deref)]

use super::*;

/// Reads a `sockaddr` (IPv4 or IPv6).
pub(super) unsafe fn sockaddr_in(sa: *const libc::sockaddr) -> Result<SocketAddr, i32> {
    if sa.is_null() {
        return Err(libc::EINVAL);
    }
    // SAFETY: the caller passes a sockaddr of its family's size.
    match c_int::from(unsafe { (*sa).sa_family }) {
        libc::AF_INET => {
            // SAFETY: AF_INET: a sockaddr_in.
            let s = unsafe { &*sa.cast::<libc::sockaddr_in>() };
            let ip = Ipv4Addr::from(u32::from_be(s.sin_addr.s_addr));
            Ok(SocketAddr::V4(SocketAddrV4::new(
                ip,
                u16::from_be(s.sin_port),
            )))
        }
        libc::AF_INET6 => {
            // SAFETY: AF_INET6: a sockaddr_in6.
            let s = unsafe { &*sa.cast::<libc::sockaddr_in6>() };
            let ip = Ipv6Addr::from(s.sin6_addr.s6_addr);
            Ok(SocketAddr::V6(SocketAddrV6::new(
                ip,
                u16::from_be(s.sin6_port),
                s.sin6_flowinfo,
                s.sin6_scope_id,
            )))
        }
        _ => Err(libc::EAFNOSUPPORT),
    }
}

/// Writes `a` into a `sockaddr_storage`; returns its length.
pub(super) fn store(a: &SocketAddr, out: &mut libc::sockaddr_storage) -> libc::socklen_t {
    // SAFETY: sockaddr_storage is plain data; zero is valid.
    *out = unsafe { std::mem::zeroed() };
    match a {
        SocketAddr::V4(v) => {
            let p = (out as *mut libc::sockaddr_storage).cast::<libc::sockaddr_in>();
            // SAFETY: sockaddr_storage is large and aligned enough for a sockaddr_in.
            let s = unsafe { &mut *p };
            s.sin_family = libc::AF_INET as libc::sa_family_t;
            s.sin_port = v.port().to_be();
            s.sin_addr.s_addr = u32::from(*v.ip()).to_be();
            std::mem::size_of::<libc::sockaddr_in>() as libc::socklen_t
        }
        SocketAddr::V6(v) => {
            let p = (out as *mut libc::sockaddr_storage).cast::<libc::sockaddr_in6>();
            // SAFETY: sockaddr_storage is large and aligned enough for a sockaddr_in6.
            let s = unsafe { &mut *p };
            s.sin6_family = libc::AF_INET6 as libc::sa_family_t;
            s.sin6_port = v.port().to_be();
            s.sin6_addr.s6_addr = v.ip().octets();
            s.sin6_flowinfo = v.flowinfo();
            s.sin6_scope_id = v.scope_id();
            std::mem::size_of::<libc::sockaddr_in6>() as libc::socklen_t
        }
    }
}

pub(super) fn set_local(v: &mut VId, a: &str) {
    if let Ok(a) = a.parse::<SocketAddr>() {
        store(&a, &mut v.id.route.addr.src_storage);
    }
}

pub(super) fn set_remote(v: &mut VId, a: &str) {
    if let Ok(a) = a.parse::<SocketAddr>() {
        store(&a, &mut v.id.route.addr.dst_storage);
    }
}

/// Attaches the id to the device: `verbs`, port and the source GID.
pub(super) fn attach(v: &mut VId) -> Result<(), i32> {
    let ctx = device()?;
    v.id.verbs = ctx;
    v.id.port_num = 1;
    // SAFETY: the CM context is open.
    let gid = unsafe { context(ctx) }.conn.info.gid;
    v.id.route.addr.ibaddr.sgid.raw = gid;
    v.id.route.addr.ibaddr.pkey = 0xffff;
    Ok(())
}
