//! The hello that opens every peer link: the link-control protocol's version, the sender's
//! host index, the number of hosts it knows and whether it asks for encryption
//! (`vrnic-wire`'s [`HelloRepr`]), checked before the link carries anything else. On an
//! authenticated link it is the handshake's payload (`secure.rs`), and the listener then sends
//! it again as the first frame after the handshake, its word that it took the dialer's last
//! step (the dialer's link is up only then); on an unauthenticated one (no keys: loopback, or
//! `--insecure-links`) a control frame of its own is all there is.

use vrnic_wire::frame::{ControlKind, Frame, FrameRepr, HelloRepr, peek_len};

use super::control;
use crate::server::Server;

impl Server {
    /// This host's hello; `None` before it has a host index (a cluster host not yet
    /// registered).
    pub(super) fn hello_repr(&self) -> Option<HelloRepr> {
        let p = self.peers.as_ref()?;
        let me = p.me?;
        Some(HelloRepr {
            // Host indices and counts are below MAX_HOSTS, which fits 16 bits.
            index: me as u16,
            hosts: p.hello_count() as u16,
            encrypt: p.security.as_ref().is_some_and(|s| s.encrypt()),
        })
    }

    /// Sends our hello as a frame: first on an unauthenticated connection, first after the
    /// handshake on an authenticated one we accepted.
    pub(super) fn hello(&self, out: &mut Vec<u8>) {
        if let Some(h) = self.hello_repr() {
            control(out, ControlKind::Hello, &h.emit());
        }
    }
}

/// `Ok(Some((hello, bytes used)))` if `buf` starts with a whole hello frame, `Ok(None)` if it
/// may still become one, `Err` if it cannot.
pub(super) fn parse_hello(buf: &[u8]) -> Result<Option<(HelloRepr, usize)>, String> {
    let len = match peek_len(buf) {
        Ok(Some(len)) if buf.len() >= len => len,
        Ok(_) => return Ok(None),
        Err(e) => return Err(e.to_string()),
    };
    let frame = Frame::new_checked(&buf[..len]).map_err(|e| e.to_string())?;
    match FrameRepr::parse(&frame).map_err(|e| e.to_string())? {
        FrameRepr::Control(c) if c.kind == ControlKind::Hello => {
            let h = HelloRepr::parse(&buf[frame_body(len)]).map_err(|e| e.to_string())?;
            Ok(Some((h, len)))
        }
        FrameRepr::Control(c) if c.kind == ControlKind::Handshake => {
            Err("a handshake, but this host has no key (links here are not authenticated)".into())
        }
        _ => Err("a frame other than a hello".into()),
    }
}

/// The body of a control frame of `len` bytes.
fn frame_body(len: usize) -> std::ops::Range<usize> {
    vrnic_wire::frame::LINK_HEADER_LEN..len
}
