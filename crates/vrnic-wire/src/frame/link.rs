//! The link-control protocol: the bodies of the control frames that open, authenticate and keep
//! a peer link, and of its vRNIC announcements; and the record layer of an encrypted link.
//!
//! Every body is decoded strictly, as frames are: one encoding per value, every length, count
//! and reserved bit checked; what parses emits back to the same bytes (the `link_control` fuzz
//! target asserts it). Integers are big-endian.
//!
//! # Hello (kind 2), [`HelloRepr`]
//!
//! ```text
//! | protocol 8 | flags 8 | host index 16 | host count 16 |
//! ```
//!
//! protocol: [`LINK_PROTOCOL`]; flags: bit 0 [`HELLO_ENCRYPT`] (the sender asks for encrypted
//! frames), the others reserved (zero); host count: the static host list's length, 0 for a
//! cluster host. On an authenticated link the hello travels inside the handshake (below),
//! never as a frame of its own.
//!
//! # Handshake (kind 6), [`HandshakeRepr`]
//!
//! ```text
//! | step 8 | Noise message (the step's exact length) |
//! ```
//!
//! The three messages of `Noise_XX_25519_ChaChaPoly_BLAKE2s`: step 1 (dialer: its ephemeral
//! key, no payload), step 2 (listener: ephemeral key, encrypted static key, its hello as
//! payload), step 3 (dialer: encrypted static key, its hello as payload). Each step has one
//! length ([`HANDSHAKE_LENS`]); any other step or length is refused before any cryptography.
//!
//! # Keepalive (kind 3), [`KeepaliveRepr`]
//!
//! ```text
//! | 0 ping / 1 pong | timestamp 64 |
//! ```
//!
//! # Announce (kind 4), [`AnnounceEntry`]
//!
//! A body is a run of entries, each an op byte and its fields:
//!
//! | op | entry | fields |
//! |---|---|---|
//! | 1 | a vRNIC added | LID 16, GID 128, virtual IPv4 32, name (length 8, bytes), group (length 8, bytes) |
//! | 2 | a vRNIC removed | LID 16, GID 128 |
//! | 3 | an address of the host | zero 16, IP 128 (an IPv4 one mapped; not unspecified nor multicast) |
//!
//! Names are [`valid_name`]s. A body of no entries is refused (an announce frame announces
//! something). Whether a host may claim what an entry says is the daemon's to check.
//!
//! # Records (an encrypted link, after the handshake)
//!
//! ```text
//! | length 16 | ciphertext (length bytes: at least the 16-byte tag) |
//! ```
//!
//! The frames' byte stream, cut anywhere, is carried in Noise transport messages
//! ([`peek_record`]); each holds at most [`MAX_RECORD_PLAIN`] bytes of it.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use super::valid_name;

/// The link-control protocol's version, first byte of a hello (3: hellos carry flags, and
/// travel inside a Noise handshake on an authenticated link).
pub const LINK_PROTOCOL: u8 = 3;
/// Bytes of a hello's body.
pub const HELLO_LEN: usize = 6;
/// Hello flag: the sender asks for encrypted frames.
pub const HELLO_ENCRYPT: u8 = 0x01;
/// Bytes of a keepalive's body.
pub const KEEPALIVE_LEN: usize = 9;
/// The Noise protocol a link's handshake speaks.
pub const NOISE_PARAMS: &str = "Noise_XX_25519_ChaChaPoly_BLAKE2s";
/// Bytes of a Curve25519 key.
pub const KEY_LEN: usize = 32;
/// Bytes of an AEAD tag.
pub const TAG_LEN: usize = 16;
/// The Noise message of each handshake step, by step (1, 2, 3): `e`; `e, ee, s, es` and a
/// hello; `s, se` and a hello.
pub const HANDSHAKE_LENS: [usize; 3] = [
    KEY_LEN,
    KEY_LEN + KEY_LEN + TAG_LEN + HELLO_LEN + TAG_LEN,
    KEY_LEN + TAG_LEN + HELLO_LEN + TAG_LEN,
];
/// Most bytes of a handshake body (step byte and the longest message).
pub const MAX_HANDSHAKE: usize = 1 + HANDSHAKE_LENS[1];
/// Bytes of a record's length field.
pub const RECORD_HEADER_LEN: usize = 2;
/// Most ciphertext bytes in one record (a Noise message's bound).
pub const MAX_RECORD: usize = 65535;
/// Most stream bytes one record carries.
pub const MAX_RECORD_PLAIN: usize = MAX_RECORD - TAG_LEN;

const ENTRY_ADDED: u8 = 1;
const ENTRY_REMOVED: u8 = 2;
const ENTRY_ADDR: u8 = 3;
const ENTRY_COMPLETE: u8 = 4;
/// Bytes of an announce entry before its names (op, LID, GID).
const ENTRY_HEAD: usize = 1 + 2 + 16;

const _: () = assert!(MAX_HANDSHAKE <= 256);
const _: () = assert!(MAX_RECORD <= u16::MAX as usize);

/// Why a link-control body (or a record) is refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum LinkError {
    /// A body of the wrong length for its kind (or step).
    #[error("{what}: {len} bytes")]
    Length {
        /// What was being decoded.
        what: &'static str,
        /// Its length.
        len: usize,
    },
    /// A hello of another protocol version.
    #[error("link protocol {0}, expected {LINK_PROTOCOL}")]
    Protocol(u8),
    /// A reserved bit or field is set.
    #[error("reserved bits set in {0}")]
    Reserved(&'static str),
    /// An unknown keepalive kind, announce op or handshake step.
    #[error("unknown {what} {value}")]
    Unknown {
        /// What was being decoded.
        what: &'static str,
        /// The value found.
        value: u8,
    },
    /// An announce entry that ends early.
    #[error("an announce entry cut short")]
    Truncated,
    /// A name that is not 1 to 63 bytes of `[A-Za-z0-9_-]`.
    #[error("an invalid name")]
    Name,
    /// An announced address no host can have (unspecified, multicast).
    #[error("an address no host can have: {0}")]
    Address(IpAddr),
}

/// A hello: who the sender is in the host list, and what it asks of the link.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct HelloRepr {
    /// The sender's host index.
    pub index: u16,
    /// The number of hosts it knows (0: a cluster host).
    pub hosts: u16,
    /// Whether it asks for encrypted frames.
    pub encrypt: bool,
}

impl HelloRepr {
    /// Decodes a hello's body.
    pub fn parse(body: &[u8]) -> Result<HelloRepr, LinkError> {
        let b: &[u8; HELLO_LEN] = body.try_into().map_err(|_| LinkError::Length {
            what: "hello",
            len: body.len(),
        })?;
        if b[0] != LINK_PROTOCOL {
            return Err(LinkError::Protocol(b[0]));
        }
        if b[1] & !HELLO_ENCRYPT != 0 {
            return Err(LinkError::Reserved("hello flags"));
        }
        Ok(HelloRepr {
            index: u16::from_be_bytes([b[2], b[3]]),
            hosts: u16::from_be_bytes([b[4], b[5]]),
            encrypt: b[1] & HELLO_ENCRYPT != 0,
        })
    }

    /// Its body.
    pub fn emit(&self) -> [u8; HELLO_LEN] {
        let mut b = [0u8; HELLO_LEN];
        b[0] = LINK_PROTOCOL;
        b[1] = if self.encrypt { HELLO_ENCRYPT } else { 0 };
        b[2..4].copy_from_slice(&self.index.to_be_bytes());
        b[4..6].copy_from_slice(&self.hosts.to_be_bytes());
        b
    }
}

/// A handshake body: the step and its Noise message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HandshakeRepr<'a> {
    /// 1, 2 or 3.
    pub step: u8,
    /// The Noise message ([`HANDSHAKE_LENS`] long for its step).
    pub message: &'a [u8],
}

impl<'a> HandshakeRepr<'a> {
    /// Decodes a handshake body: a known step, and a message of exactly that step's length.
    pub fn parse(body: &'a [u8]) -> Result<HandshakeRepr<'a>, LinkError> {
        let (&step, message) = body.split_first().ok_or(LinkError::Length {
            what: "handshake",
            len: 0,
        })?;
        let want = Self::message_len(step).ok_or(LinkError::Unknown {
            what: "handshake step",
            value: step,
        })?;
        if message.len() != want {
            return Err(LinkError::Length {
                what: "handshake message",
                len: message.len(),
            });
        }
        Ok(HandshakeRepr { step, message })
    }

    /// The length of step `step`'s message; `None` for a step that does not exist.
    pub fn message_len(step: u8) -> Option<usize> {
        HANDSHAKE_LENS
            .get(usize::from(step).checked_sub(1)?)
            .copied()
    }

    /// Bytes of its body.
    pub fn buffer_len(&self) -> usize {
        1 + self.message.len()
    }

    /// Writes its body into `out` ([`buffer_len`](Self::buffer_len) bytes).
    ///
    /// # Panics
    ///
    /// If `out` is not that long.
    pub fn emit(&self, out: &mut [u8]) {
        assert_eq!(out.len(), self.buffer_len(), "a handshake body's room");
        out[0] = self.step;
        out[1..].copy_from_slice(self.message);
    }
}

/// A keepalive: a ping, or the pong that answers it, with the ping's timestamp.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum KeepaliveRepr {
    /// Answer me (a timestamp of the sender's own clock).
    Ping(u64),
    /// The answer, carrying the ping's timestamp.
    Pong(u64),
}

impl KeepaliveRepr {
    /// Decodes a keepalive's body.
    pub fn parse(body: &[u8]) -> Result<KeepaliveRepr, LinkError> {
        let b: &[u8; KEEPALIVE_LEN] = body.try_into().map_err(|_| LinkError::Length {
            what: "keepalive",
            len: body.len(),
        })?;
        let mut t = [0u8; 8];
        t.copy_from_slice(&b[1..]);
        let t = u64::from_be_bytes(t);
        match b[0] {
            0 => Ok(KeepaliveRepr::Ping(t)),
            1 => Ok(KeepaliveRepr::Pong(t)),
            v => Err(LinkError::Unknown {
                what: "keepalive kind",
                value: v,
            }),
        }
    }

    /// Its body.
    pub fn emit(&self) -> [u8; KEEPALIVE_LEN] {
        let (kind, t) = match *self {
            KeepaliveRepr::Ping(t) => (0, t),
            KeepaliveRepr::Pong(t) => (1, t),
        };
        let mut b = [0u8; KEEPALIVE_LEN];
        b[0] = kind;
        b[1..].copy_from_slice(&t.to_be_bytes());
        b
    }
}

/// One announcement.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum AnnounceEntry<'a> {
    /// A vRNIC on the sending host.
    Added {
        /// Its LID.
        lid: u16,
        /// Its GID.
        gid: [u8; 16],
        /// Its virtual IPv4 address.
        vip: Ipv4Addr,
        /// Its name.
        name: &'a str,
        /// Its tenant group's name.
        group: &'a str,
    },
    /// A vRNIC gone from the sending host.
    Removed {
        /// Its LID.
        lid: u16,
        /// Its GID.
        gid: [u8; 16],
    },
    /// An address of the sending host (for rdma_cm).
    Addr(IpAddr),
    /// The end of the full set a host announces when its link comes up: what it announced
    /// over an earlier link and not again since is gone.
    Complete,
}

impl<'a> AnnounceEntry<'a> {
    /// Checks what emitting needs: names that are [`valid_name`]s, an address a host can have.
    pub fn check(&self) -> Result<(), LinkError> {
        match self {
            AnnounceEntry::Added { name, group, .. } => {
                if valid_name(name.as_bytes()) && valid_name(group.as_bytes()) {
                    Ok(())
                } else {
                    Err(LinkError::Name)
                }
            }
            AnnounceEntry::Removed { .. } | AnnounceEntry::Complete => Ok(()),
            AnnounceEntry::Addr(ip) => check_addr(ip.to_canonical()),
        }
    }

    /// Bytes of its encoding.
    pub fn buffer_len(&self) -> usize {
        match self {
            AnnounceEntry::Added { name, group, .. } => {
                ENTRY_HEAD + 4 + 2 + name.len() + group.len()
            }
            AnnounceEntry::Removed { .. } | AnnounceEntry::Addr(_) | AnnounceEntry::Complete => {
                ENTRY_HEAD
            }
        }
    }

    /// Appends its encoding to `out`.
    ///
    /// # Panics
    ///
    /// If it fails its [`check`](Self::check).
    pub fn emit(&self, out: &mut Vec<u8>) {
        assert_eq!(self.check(), Ok(()), "an announce entry to emit");
        match self {
            AnnounceEntry::Added {
                lid,
                gid,
                vip,
                name,
                group,
            } => {
                out.push(ENTRY_ADDED);
                out.extend_from_slice(&lid.to_be_bytes());
                out.extend_from_slice(gid);
                out.extend_from_slice(&vip.octets());
                for s in [name, group] {
                    // A valid name is at most 63 bytes.
                    out.push(s.len() as u8);
                    out.extend_from_slice(s.as_bytes());
                }
            }
            AnnounceEntry::Removed { lid, gid } => {
                out.push(ENTRY_REMOVED);
                out.extend_from_slice(&lid.to_be_bytes());
                out.extend_from_slice(gid);
            }
            AnnounceEntry::Addr(ip) => {
                let v6 = match ip {
                    IpAddr::V4(v4) => v4.to_ipv6_mapped(),
                    IpAddr::V6(v6) => *v6,
                };
                out.push(ENTRY_ADDR);
                out.extend_from_slice(&[0, 0]);
                out.extend_from_slice(&v6.octets());
            }
            AnnounceEntry::Complete => {
                out.push(ENTRY_COMPLETE);
                out.extend_from_slice(&[0; 2 + 16]);
            }
        }
    }

    /// The entries of an announce body, in order; each item is an entry or the error that
    /// ends the body. [`AnnounceEntry::check_body`] checks a whole body first.
    pub fn iter(body: &'a [u8]) -> Entries<'a> {
        Entries { rest: body }
    }

    /// Checks a whole announce body: at least one entry, every entry well formed. Returns how
    /// many entries it holds.
    pub fn check_body(body: &[u8]) -> Result<usize, LinkError> {
        if body.is_empty() {
            return Err(LinkError::Length {
                what: "announce body",
                len: 0,
            });
        }
        let mut n = 0;
        for e in AnnounceEntry::iter(body) {
            e?;
            n += 1;
        }
        Ok(n)
    }

    /// One entry at the start of `b`, and what follows it.
    fn parse_one(b: &'a [u8]) -> Result<(AnnounceEntry<'a>, &'a [u8]), LinkError> {
        let (&op, rest) = b.split_first().ok_or(LinkError::Truncated)?;
        let (lid, rest) = rest.split_first_chunk::<2>().ok_or(LinkError::Truncated)?;
        let (gid, rest) = rest.split_first_chunk::<16>().ok_or(LinkError::Truncated)?;
        let lid = u16::from_be_bytes(*lid);
        match op {
            ENTRY_ADDED => {
                let (vip, rest) = rest.split_first_chunk::<4>().ok_or(LinkError::Truncated)?;
                let (name, rest) = take_name(rest)?;
                let (group, rest) = take_name(rest)?;
                let e = AnnounceEntry::Added {
                    lid,
                    gid: *gid,
                    vip: Ipv4Addr::from(*vip),
                    name,
                    group,
                };
                Ok((e, rest))
            }
            ENTRY_REMOVED => Ok((AnnounceEntry::Removed { lid, gid: *gid }, rest)),
            ENTRY_ADDR => {
                if lid != 0 {
                    return Err(LinkError::Reserved("address entry"));
                }
                let v6 = Ipv6Addr::from(*gid);
                let ip = match v6.to_ipv4_mapped() {
                    Some(v4) => IpAddr::V4(v4),
                    None => IpAddr::V6(v6),
                };
                check_addr(ip)?;
                Ok((AnnounceEntry::Addr(ip), rest))
            }
            ENTRY_COMPLETE => {
                if lid != 0 || *gid != [0; 16] {
                    return Err(LinkError::Reserved("end-of-set entry"));
                }
                Ok((AnnounceEntry::Complete, rest))
            }
            v => Err(LinkError::Unknown {
                what: "announce op",
                value: v,
            }),
        }
    }
}

/// An address a host can announce: not unspecified, not multicast. (A loopback address is a
/// host's own only as its peer-link address, which is the daemon's to say.)
fn check_addr(ip: IpAddr) -> Result<(), LinkError> {
    if ip.is_unspecified() || ip.is_multicast() {
        return Err(LinkError::Address(ip));
    }
    Ok(())
}

/// A length-prefixed name and what follows it.
fn take_name(b: &[u8]) -> Result<(&str, &[u8]), LinkError> {
    let (&n, rest) = b.split_first().ok_or(LinkError::Truncated)?;
    let (s, rest) = rest
        .split_at_checked(usize::from(n))
        .ok_or(LinkError::Truncated)?;
    if !valid_name(s) {
        return Err(LinkError::Name);
    }
    // Valid names are ASCII.
    let s = std::str::from_utf8(s).map_err(|_| LinkError::Name)?;
    Ok((s, rest))
}

/// The entries of an announce body ([`AnnounceEntry::iter`]); ends after the first error.
#[derive(Debug, Clone)]
pub struct Entries<'a> {
    rest: &'a [u8],
}

impl<'a> Iterator for Entries<'a> {
    type Item = Result<AnnounceEntry<'a>, LinkError>;

    fn next(&mut self) -> Option<Self::Item> {
        if self.rest.is_empty() {
            return None;
        }
        match AnnounceEntry::parse_one(self.rest) {
            Ok((e, rest)) => {
                self.rest = rest;
                Some(Ok(e))
            }
            Err(e) => {
                self.rest = &[];
                Some(Err(e))
            }
        }
    }
}

/// The length of the record at the start of `buf`, its length field included: `Ok(None)`
/// until the field is there. A record shorter than a tag cannot be a Noise message.
pub fn peek_record(buf: &[u8]) -> Result<Option<usize>, LinkError> {
    let Some(h) = buf.first_chunk::<RECORD_HEADER_LEN>() else {
        return Ok(None);
    };
    let len = usize::from(u16::from_be_bytes(*h));
    if len < TAG_LEN {
        return Err(LinkError::Length {
            what: "record",
            len,
        });
    }
    Ok(Some(RECORD_HEADER_LEN + len))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_hello_round_trips_and_reserved_flags_or_another_protocol_are_refused() {
        let h = HelloRepr {
            index: 0x0102,
            hosts: 3,
            encrypt: true,
        };
        let b = h.emit();
        assert_eq!(b, [LINK_PROTOCOL, 1, 1, 2, 0, 3]);
        assert_eq!(HelloRepr::parse(&b), Ok(h));
        let mut bad = b;
        bad[1] = 2;
        assert_eq!(
            HelloRepr::parse(&bad),
            Err(LinkError::Reserved("hello flags"))
        );
        bad = b;
        bad[0] = 2;
        assert_eq!(HelloRepr::parse(&bad), Err(LinkError::Protocol(2)));
        assert!(HelloRepr::parse(&b[..5]).is_err());
        assert!(HelloRepr::parse(&[b.as_slice(), &[0]].concat()).is_err());
    }

    #[test]
    fn a_keepalive_round_trips_and_an_unknown_kind_is_refused() {
        for k in [KeepaliveRepr::Ping(7), KeepaliveRepr::Pong(u64::MAX)] {
            assert_eq!(KeepaliveRepr::parse(&k.emit()), Ok(k));
        }
        let mut b = KeepaliveRepr::Ping(1).emit();
        b[0] = 2;
        assert!(matches!(
            KeepaliveRepr::parse(&b),
            Err(LinkError::Unknown { value: 2, .. })
        ));
        assert!(KeepaliveRepr::parse(&b[..8]).is_err());
    }

    #[test]
    fn a_handshake_body_has_a_known_step_and_exactly_its_length() {
        for step in 1..=3u8 {
            let len = HandshakeRepr::message_len(step).unwrap();
            let msg = vec![9u8; len];
            let h = HandshakeRepr {
                step,
                message: &msg,
            };
            let mut b = vec![0; h.buffer_len()];
            h.emit(&mut b);
            assert_eq!(HandshakeRepr::parse(&b), Ok(h));
            assert!(HandshakeRepr::parse(&b[..b.len() - 1]).is_err());
            b.push(0);
            assert!(HandshakeRepr::parse(&b).is_err());
        }
        for step in [0u8, 4, 255] {
            let mut b = vec![step];
            b.extend([0; KEY_LEN]);
            assert!(HandshakeRepr::parse(&b).is_err(), "step {step}");
        }
        assert!(HandshakeRepr::parse(&[]).is_err());
    }

    #[test]
    fn announce_entries_round_trip_and_malformed_bodies_are_refused() {
        let entries = [
            AnnounceEntry::Added {
                lid: 7,
                gid: [3; 16],
                vip: Ipv4Addr::new(10, 9, 0, 1),
                name: "a1",
                group: "red",
            },
            AnnounceEntry::Removed {
                lid: 8,
                gid: [4; 16],
            },
            AnnounceEntry::Addr("10.77.0.2".parse().unwrap()),
            AnnounceEntry::Addr("fd00::1".parse().unwrap()),
            AnnounceEntry::Complete,
        ];
        let mut body = Vec::new();
        for e in &entries {
            let before = body.len();
            e.emit(&mut body);
            assert_eq!(body.len() - before, e.buffer_len());
        }
        let got: Vec<_> = AnnounceEntry::iter(&body).map(Result::unwrap).collect();
        assert_eq!(got, entries);
        assert_eq!(AnnounceEntry::check_body(&body), Ok(5));
        let whole = [
            entries[0].buffer_len(),
            entries[0].buffer_len() + ENTRY_HEAD,
            entries[0].buffer_len() + 2 * ENTRY_HEAD,
            entries[0].buffer_len() + 3 * ENTRY_HEAD,
        ];
        for n in 1..body.len() {
            if whole.contains(&n) {
                continue;
            }
            assert!(AnnounceEntry::check_body(&body[..n]).is_err(), "cut at {n}");
        }
        let name_at = ENTRY_HEAD + 4;
        let mut bad = body.clone();
        bad[name_at + 1] = b' ';
        assert_eq!(AnnounceEntry::check_body(&bad), Err(LinkError::Name));
        let mut bad = body.clone();
        bad[name_at] = 0;
        assert!(AnnounceEntry::check_body(&bad).is_err(), "an empty name");
        let mut bad = body.clone();
        let addr_at = entries[0].buffer_len() + ENTRY_HEAD;
        bad[addr_at + 2] = 1;
        assert_eq!(
            AnnounceEntry::check_body(&bad),
            Err(LinkError::Reserved("address entry"))
        );
        for at in [1, 3, 18] {
            let mut bad = body.clone();
            bad[body.len() - ENTRY_HEAD + at] = 1;
            assert_eq!(
                AnnounceEntry::check_body(&bad),
                Err(LinkError::Reserved("end-of-set entry")),
                "byte {at} of the end-of-set entry"
            );
        }
        for ip in ["0.0.0.0", "224.0.0.1", "::"] {
            let mut b = vec![ENTRY_ADDR, 0, 0];
            let v6 = match ip.parse::<IpAddr>().unwrap() {
                IpAddr::V4(v4) => v4.to_ipv6_mapped(),
                IpAddr::V6(v6) => v6,
            };
            b.extend(v6.octets());
            assert!(
                matches!(AnnounceEntry::check_body(&b), Err(LinkError::Address(_))),
                "{ip}"
            );
        }
        let mut loopback = Vec::new();
        AnnounceEntry::Addr("127.0.0.2".parse().unwrap()).emit(&mut loopback);
        assert_eq!(
            AnnounceEntry::check_body(&loopback),
            Ok(1),
            "the daemon decides"
        );
        assert!(AnnounceEntry::check_body(&[9; 19]).is_err(), "unknown op");
        assert!(AnnounceEntry::check_body(&[]).is_err(), "no entry");
    }

    #[test]
    fn a_record_is_at_least_a_tag() {
        assert_eq!(peek_record(&[0]), Ok(None));
        assert_eq!(peek_record(&[0, 16]), Ok(Some(18)));
        assert_eq!(peek_record(&[0xff, 0xff, 1]), Ok(Some(2 + MAX_RECORD)));
        assert!(peek_record(&[0, 15]).is_err());
    }
}
