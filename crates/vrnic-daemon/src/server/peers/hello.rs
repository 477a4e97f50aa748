//! The hello that opens every peer link: the link-control protocol's version, the sender's
//! host index and the number of hosts it knows, checked before the link carries anything else.

use vrnic_wire::frame::{ControlKind, Frame, FrameRepr, LINK_HEADER_LEN, peek_len};

use super::{PROTOCOL, control};
use crate::server::Server;

impl Server {
    /// Sends our hello on a fresh connection.
    pub(super) fn hello(&self, out: &mut Vec<u8>) {
        let Some(p) = &self.peers else { return };
        let Some(me) = p.me else { return };
        let mut body = [0u8; 5];
        body[0] = PROTOCOL;
        body[1..3].copy_from_slice(&(me as u16).to_be_bytes());
        body[3..5].copy_from_slice(&(p.hello_count() as u16).to_be_bytes());
        control(out, ControlKind::Hello, &body);
    }
}

/// `Ok(Some((index, hosts, bytes used)))` if `buf` starts with a whole hello frame,
/// `Ok(None)` if it may still become one, `Err` if it cannot.
pub(super) fn parse_hello(buf: &[u8]) -> Result<Option<(u16, u16, usize)>, ()> {
    let len = match peek_len(buf) {
        Ok(Some(len)) if buf.len() >= len => len,
        Ok(_) => return Ok(None),
        Err(_) => return Err(()),
    };
    let frame = Frame::new_checked(&buf[..len]).map_err(|_| ())?;
    match FrameRepr::parse(&frame).map_err(|_| ())? {
        FrameRepr::Control(c) if c.kind == ControlKind::Hello && c.body_len == 5 => {
            let b = &buf[LINK_HEADER_LEN..len];
            if b[0] != PROTOCOL {
                return Err(());
            }
            Ok(Some((
                u16::from_be_bytes([b[1], b[2]]),
                u16::from_be_bytes([b[3], b[4]]),
                len,
            )))
        }
        _ => Err(()),
    }
}
