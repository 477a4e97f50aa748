//! Connection-manager messages between daemons: the body of a [`ControlKind::Cm`] frame.
//!
//! Each daemon runs the rdma_cm broker for its own ids; when the two ends of a connection are
//! on different hosts, the brokers exchange what the IB CM's MADs carry (REQ, REP, REJ, RTU,
//! DREQ), one message per frame:
//!
//! ```text
//! type 1 | from 4 | to 4 | body by type
//! ```
//!
//! - `from` is the sender's id, `to` the receiver's (0 while the sender does not know it: a
//!   REQ, or a DREQ from a requester that never got an answer). Ids are the brokers' own
//!   handles; the receiver checks that the id it finds is connected to `from` on the sending
//!   host before it acts.
//! - REQ: port space 2, source address 19, destination address 19, LID 2, GID 16, the
//!   requester's group (length 1, then 1 to [`MAX_NAME`] bytes of `[A-Za-z0-9_-]`: a listener
//!   takes requests of its own group only), parameters.
//! - REP: LID 2, GID 16, parameters. REJ: status 4, parameters. RTU: parameters. DREQ: none.
//! - An address is a family byte (4 or 6), 16 address bytes (an IPv4 address in the last four,
//!   the rest zero) and a port.
//! - Parameters: responder resources, initiator depth, retry count, RNR retry count (a byte
//!   each), QP number 4 (below 2^24), Q_Key 4, private-data length 1, private data (at most
//!   [`MAX_PRIVATE_DATA`] bytes).
//!
//! All integers are big-endian. Decoding is strict, as the rest of this module is: a message
//! that parses re-emits to exactly its bytes, and anything else is a [`FrameError`].
//!
//! [`ControlKind::Cm`]: super::ControlKind::Cm

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};

use super::FrameError;

/// The most private data a CM message carries (an IB CM REQ's 92 bytes plus the rdma_cm
/// header would fit; 196 is what `rdma_connect` accepts on the largest MAD).
pub const MAX_PRIVATE_DATA: usize = 196;

/// The longest vRNIC or group name (as `vrnic create` allows).
pub const MAX_NAME: usize = 63;

/// Whether `b` is a vRNIC or group name: 1 to [`MAX_NAME`] letters, digits, `-` or `_`.
pub fn valid_name(b: &[u8]) -> bool {
    (1..=MAX_NAME).contains(&b.len())
        && b.iter()
            .all(|c| c.is_ascii_alphanumeric() || *c == b'-' || *c == b'_')
}

const ADDR_LEN: usize = 19;
const PARAM_FIXED: usize = 13;

/// What the CM carries besides addresses: the `rdma_conn_param` values and the QP's numbers.
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash)]
pub struct CmParams {
    /// RDMA READ/atomic requests the sender accepts as a responder.
    pub responder_resources: u8,
    /// RDMA READ/atomic requests the sender issues.
    pub initiator_depth: u8,
    /// Transport retries.
    pub retry_count: u8,
    /// RNR retries.
    pub rnr_retry_count: u8,
    /// The sender's QP number (24 bits).
    pub qp_num: u32,
    /// The sender's Q_Key (UD).
    pub qkey: u32,
    /// Private data, at most [`MAX_PRIVATE_DATA`] bytes.
    pub private_data: Vec<u8>,
}

/// One CM message between brokers. See the module documentation.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum CmMessage {
    /// A connection request to whatever listens on `dst` there.
    Req {
        /// The requesting id.
        from: u32,
        /// Its port space (`RDMA_PS_*`).
        ps: u16,
        /// The requester's address.
        src: SocketAddr,
        /// The address it connects to.
        dst: SocketAddr,
        /// The requester's LID.
        lid: u16,
        /// The requester's GID.
        gid: [u8; 16],
        /// The requester's group ([`valid_name`]).
        group: String,
        /// Its parameters.
        param: CmParams,
    },
    /// The passive side accepted.
    Rep {
        /// The passive side's new id.
        from: u32,
        /// The requesting id.
        to: u32,
        /// The passive side's LID.
        lid: u16,
        /// The passive side's GID.
        gid: [u8; 16],
        /// Its parameters.
        param: CmParams,
    },
    /// The request is refused (`status` is the IB CM reject reason).
    Rej {
        /// The refusing id (0 if no id was made: no listener).
        from: u32,
        /// The requesting id.
        to: u32,
        /// The reject reason.
        status: i32,
        /// Private data only.
        param: CmParams,
    },
    /// The requester established the connection.
    Rtu {
        /// The requesting id.
        from: u32,
        /// The passive id.
        to: u32,
        /// The requester's parameters (as the passive side's `ESTABLISHED` reports them).
        param: CmParams,
    },
    /// The sender's end is gone or disconnected.
    Dreq {
        /// The sending id.
        from: u32,
        /// Its peer, or 0 if the sender never learned it.
        to: u32,
    },
}

impl CmMessage {
    fn code(&self) -> u8 {
        match self {
            CmMessage::Req { .. } => 1,
            CmMessage::Rep { .. } => 2,
            CmMessage::Rej { .. } => 3,
            CmMessage::Rtu { .. } => 4,
            CmMessage::Dreq { .. } => 5,
        }
    }

    /// The sending id.
    pub fn from(&self) -> u32 {
        match self {
            CmMessage::Req { from, .. }
            | CmMessage::Rep { from, .. }
            | CmMessage::Rej { from, .. }
            | CmMessage::Rtu { from, .. }
            | CmMessage::Dreq { from, .. } => *from,
        }
    }

    /// The receiving id (0 if unknown to the sender).
    pub fn to(&self) -> u32 {
        match self {
            CmMessage::Req { .. } => 0,
            CmMessage::Rep { to, .. }
            | CmMessage::Rej { to, .. }
            | CmMessage::Rtu { to, .. }
            | CmMessage::Dreq { to, .. } => *to,
        }
    }

    /// Whether it can be emitted: a QP number below 2^24 and private data that fits.
    pub fn check(&self) -> Result<(), FrameError> {
        let param = match self {
            CmMessage::Req { param, .. }
            | CmMessage::Rep { param, .. }
            | CmMessage::Rej { param, .. }
            | CmMessage::Rtu { param, .. } => param,
            CmMessage::Dreq { .. } => return Ok(()),
        };
        if param.qp_num > 0xff_ffff {
            return Err(FrameError::Inconsistent("CM QP number"));
        }
        if param.private_data.len() > MAX_PRIVATE_DATA {
            return Err(FrameError::Inconsistent("CM private data"));
        }
        if let CmMessage::Req { group, .. } = self
            && !valid_name(group.as_bytes())
        {
            return Err(FrameError::Inconsistent("CM group name"));
        }
        Ok(())
    }

    /// Appends the message's bytes to `out`.
    ///
    /// # Panics
    /// If [`check`](Self::check) fails.
    pub fn emit(&self, out: &mut Vec<u8>) {
        self.check().expect("a valid CM message");
        out.push(self.code());
        out.extend_from_slice(&self.from().to_be_bytes());
        out.extend_from_slice(&self.to().to_be_bytes());
        match self {
            CmMessage::Req {
                ps,
                src,
                dst,
                lid,
                gid,
                group,
                param,
                ..
            } => {
                out.extend_from_slice(&ps.to_be_bytes());
                emit_addr(out, src);
                emit_addr(out, dst);
                out.extend_from_slice(&lid.to_be_bytes());
                out.extend_from_slice(gid);
                out.push(group.len() as u8);
                out.extend_from_slice(group.as_bytes());
                emit_param(out, param);
            }
            CmMessage::Rep {
                lid, gid, param, ..
            } => {
                out.extend_from_slice(&lid.to_be_bytes());
                out.extend_from_slice(gid);
                emit_param(out, param);
            }
            CmMessage::Rej { status, param, .. } => {
                out.extend_from_slice(&status.to_be_bytes());
                emit_param(out, param);
            }
            CmMessage::Rtu { param, .. } => emit_param(out, param),
            CmMessage::Dreq { .. } => {}
        }
    }

    /// Decodes a message, strictly: every byte accounted for.
    pub fn parse(b: &[u8]) -> Result<CmMessage, FrameError> {
        let mut r = Reader { b, at: 0 };
        let code = r.u8()?;
        let from = r.u32()?;
        let to = r.u32()?;
        let m = match code {
            1 => {
                if to != 0 {
                    return Err(FrameError::Reserved("CM REQ"));
                }
                CmMessage::Req {
                    from,
                    ps: r.u16()?,
                    src: r.addr()?,
                    dst: r.addr()?,
                    lid: r.u16()?,
                    gid: r.gid()?,
                    group: r.name()?,
                    param: r.param()?,
                }
            }
            2 => CmMessage::Rep {
                from,
                to,
                lid: r.u16()?,
                gid: r.gid()?,
                param: r.param()?,
            },
            3 => CmMessage::Rej {
                from,
                to,
                status: r.u32()? as i32,
                param: r.param()?,
            },
            4 => CmMessage::Rtu {
                from,
                to,
                param: r.param()?,
            },
            5 => CmMessage::Dreq { from, to },
            _ => return Err(FrameError::Inconsistent("CM message type")),
        };
        if r.at != b.len() {
            return Err(FrameError::Trailing(b.len() - r.at));
        }
        Ok(m)
    }
}

fn emit_addr(out: &mut Vec<u8>, a: &SocketAddr) {
    match a.ip() {
        IpAddr::V4(v4) => {
            out.push(4);
            out.extend_from_slice(&[0; 12]);
            out.extend_from_slice(&v4.octets());
        }
        IpAddr::V6(v6) => {
            out.push(6);
            out.extend_from_slice(&v6.octets());
        }
    }
    out.extend_from_slice(&a.port().to_be_bytes());
}

fn emit_param(out: &mut Vec<u8>, p: &CmParams) {
    out.extend_from_slice(&[
        p.responder_resources,
        p.initiator_depth,
        p.retry_count,
        p.rnr_retry_count,
    ]);
    out.extend_from_slice(&p.qp_num.to_be_bytes());
    out.extend_from_slice(&p.qkey.to_be_bytes());
    out.push(p.private_data.len() as u8);
    out.extend_from_slice(&p.private_data);
}

struct Reader<'a> {
    b: &'a [u8],
    at: usize,
}

impl Reader<'_> {
    fn take(&mut self, n: usize) -> Result<&[u8], FrameError> {
        let end = self.at + n;
        let s = self.b.get(self.at..end).ok_or(FrameError::Truncated {
            needed: end,
            got: self.b.len(),
        })?;
        self.at = end;
        Ok(s)
    }

    fn u8(&mut self) -> Result<u8, FrameError> {
        Ok(self.take(1)?[0])
    }

    fn u16(&mut self) -> Result<u16, FrameError> {
        let s = self.take(2)?;
        Ok(u16::from_be_bytes([s[0], s[1]]))
    }

    fn u32(&mut self) -> Result<u32, FrameError> {
        let s = self.take(4)?;
        Ok(u32::from_be_bytes([s[0], s[1], s[2], s[3]]))
    }

    fn name(&mut self) -> Result<String, FrameError> {
        let n = self.u8()? as usize;
        let b = self.take(n)?;
        if !valid_name(b) {
            return Err(FrameError::Inconsistent("CM group name"));
        }
        // Checked ASCII above.
        Ok(b.iter().map(|&c| char::from(c)).collect())
    }

    fn gid(&mut self) -> Result<[u8; 16], FrameError> {
        let mut g = [0u8; 16];
        g.copy_from_slice(self.take(16)?);
        Ok(g)
    }

    fn addr(&mut self) -> Result<SocketAddr, FrameError> {
        let s = self.take(ADDR_LEN)?;
        let mut o = [0u8; 16];
        o.copy_from_slice(&s[1..17]);
        let port = u16::from_be_bytes([s[17], s[18]]);
        let ip = match s[0] {
            4 if o[..12].iter().all(|&x| x == 0) => {
                IpAddr::V4(Ipv4Addr::new(o[12], o[13], o[14], o[15]))
            }
            4 => return Err(FrameError::Reserved("CM IPv4 address")),
            6 => IpAddr::V6(Ipv6Addr::from(o)),
            _ => return Err(FrameError::Inconsistent("CM address family")),
        };
        Ok(SocketAddr::new(ip, port))
    }

    fn param(&mut self) -> Result<CmParams, FrameError> {
        let s = self.take(PARAM_FIXED)?;
        let qp_num = u32::from_be_bytes([s[4], s[5], s[6], s[7]]);
        if qp_num > 0xff_ffff {
            return Err(FrameError::Reserved("CM QP number"));
        }
        let qkey = u32::from_be_bytes([s[8], s[9], s[10], s[11]]);
        let (rr, id, rc, rnr, len) = (s[0], s[1], s[2], s[3], s[12] as usize);
        if len > MAX_PRIVATE_DATA {
            return Err(FrameError::Inconsistent("CM private data"));
        }
        Ok(CmParams {
            responder_resources: rr,
            initiator_depth: id,
            retry_count: rc,
            rnr_retry_count: rnr,
            qp_num,
            qkey,
            private_data: self.take(len)?.to_vec(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn param() -> CmParams {
        CmParams {
            responder_resources: 4,
            initiator_depth: 2,
            retry_count: 7,
            rnr_retry_count: 6,
            qp_num: 0x12_3456,
            qkey: 0x1111_1111,
            private_data: b"private".to_vec(),
        }
    }

    fn all() -> Vec<CmMessage> {
        vec![
            CmMessage::Req {
                from: 7,
                ps: 0x106,
                src: "10.77.0.1:49152".parse().unwrap(),
                dst: "[fe80::1]:7471".parse().unwrap(),
                lid: 0x1234,
                gid: [9; 16],
                group: "red".into(),
                param: param(),
            },
            CmMessage::Rep {
                from: 3,
                to: 7,
                lid: 2,
                gid: [1; 16],
                param: CmParams::default(),
            },
            CmMessage::Rej {
                from: 0,
                to: 7,
                status: 28,
                param: param(),
            },
            CmMessage::Rtu {
                from: 7,
                to: 3,
                param: param(),
            },
            CmMessage::Dreq { from: 7, to: 0 },
        ]
    }

    #[test]
    fn every_message_round_trips_and_every_prefix_is_refused() {
        for m in all() {
            let mut b = Vec::new();
            m.emit(&mut b);
            assert_eq!(CmMessage::parse(&b), Ok(m.clone()));
            for n in 0..b.len() {
                assert!(CmMessage::parse(&b[..n]).is_err(), "{m:?} cut at {n}");
            }
            b.push(0);
            assert_eq!(CmMessage::parse(&b), Err(FrameError::Trailing(1)));
        }
    }

    #[test]
    fn values_outside_their_fields_are_refused() {
        let mut b = Vec::new();
        all()[0].emit(&mut b);
        // Type, a REQ naming a receiver, the address family, IPv4 padding, QP number, length.
        for (at, v) in [(0, 9u8), (8, 1), (11, 5), (12, 1), (21, 9)] {
            let mut x = b.clone();
            x[at] = v;
            assert!(CmMessage::parse(&x).is_err(), "byte {at} = {v}");
        }
        let g = 9 + 2 + 19 + 19 + 2 + 16;
        for (at, v) in [(g, 0u8), (g, 64), (g + 1, b' '), (g + 2, 0xff)] {
            let mut x = b.clone();
            x[at] = v;
            assert!(CmMessage::parse(&x).is_err(), "group byte {at} = {v}");
        }
        let p = g + 1 + 3;
        let mut x = b.clone();
        x[p + 4] = 1;
        assert!(CmMessage::parse(&x).is_err(), "QP number past 24 bits");
        let mut x = b.clone();
        x[p + 12] = (MAX_PRIVATE_DATA + 1) as u8;
        assert!(CmMessage::parse(&x).is_err(), "private data too long");
        let too_long = CmMessage::Rtu {
            from: 1,
            to: 2,
            param: CmParams {
                private_data: vec![0; MAX_PRIVATE_DATA + 1],
                ..CmParams::default()
            },
        };
        assert!(too_long.check().is_err());
        for bad in ["", "a b", &"x".repeat(MAX_NAME + 1)] {
            let mut m = all()[0].clone();
            if let CmMessage::Req { group, .. } = &mut m {
                *group = bad.to_string();
            }
            assert!(m.check().is_err(), "group {bad:?}");
        }
    }
}
