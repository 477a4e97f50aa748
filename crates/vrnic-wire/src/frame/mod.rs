//! Frames between daemons: the bytes one vrnic daemon sends another over a TCP peer link.
//!
//! A peer link is one TCP stream that many QPs share. It carries frames, each a small
//! link header of vrnic's own followed by a body. The body of a *segment* frame is an
//! InfiniBand transport packet (IB spec vol 1, ch. 9): the BTH, the extension headers its
//! opcode names, the payload and its pad, with the spec's layouts and big-endian byte order,
//! so that a RoCEv2 transport can reuse everything here but the link header. The body of a
//! *control* frame belongs to the link-control protocol: the handshake and hello, keepalives and
//! vRNIC announcements, whose strict codecs are in `link.rs` ([`HelloRepr`], [`HandshakeRepr`],
//! [`KeepaliveRepr`], [`AnnounceEntry`], with the record layer of an encrypted link), and the
//! connection manager's messages, whose strict codec is [`CmMessage`] (`cm.rs`).
//!
//! # Link header
//!
//! ```text
//!  0       1       2       3       4       5       6       7
//! +-------+-------+-------+-------+-------+-------+-------+-------+
//! | 0x76  | 0x52  |version| kind  | flags |  length (24 bits, BE) |
//! +-------+-------+-------+-------+-------+-------+-------+-------+
//! ```
//!
//! - magic: `"vR"` ([`MAGIC`]); version: [`VERSION`] (1).
//! - kind ([`FrameKind`]): 1 segment; 2 hello, 3 keepalive, 4 announce, 5 cm, 6 handshake
//!   (control). Every other value is refused.
//! - flags: bit 0 ([`FLAG_GRH`]): a 40-byte GRH follows the address word (segments of UD
//!   opcodes only). The other bits are reserved and must be zero.
//! - length: bytes in the whole frame, these 8 included, from the smallest body the kind
//!   allows up to [`MAX_FRAME`]. A reader takes 8 bytes, asks [`peek_len`], then reads the
//!   rest of the frame.
//!
//! A segment frame is then `ADDR 8 [GRH 40] BTH 12 | extension headers | payload | pad`:
//!
//! | header | bytes | fields (big-endian) |
//! |---|---|---|
//! | ADDR | 8 | destination LID 16, source LID 16, reserved 8 (zero), source QP 24 |
//! | BTH | 12 | opcode, SE/M/PadCnt/TVer, P_Key, reserved 8 + DestQP 24, AckReq + reserved 7 + PSN 24 |
//! | DETH | 8 | Q_Key 32, reserved 8 + SrcQP 24 |
//! | RETH | 16 | VA 64, R_Key 32, DMA length 32 |
//! | AETH | 4 | syndrome 8 (ACK / RNR NAK + timer / NAK code), MSN 24 |
//! | AtomicETH | 28 | VA 64, R_Key 32, swap or add 64, compare 64 |
//! | AtomicAckETH | 8 | original data 64 |
//! | ImmDt, IETH | 4 | immediate data; R_Key to invalidate |
//! | XRCETH | 4 | reserved 8 (zero), XRC SRQ number 24 |
//!
//! The opcodes are the spec's numbers for RC (`0x00..=0x14`, `0x16`, `0x17`), UC
//! (`0x20..=0x2b`), UD (`0x64`, `0x65`) and XRC (`0xa0..=0xb4`, `0xb6`, `0xb7`: RC's
//! operations, requests with an XRCETH right after the BTH); [`Opcode::ext_headers`] and
//! [`Opcode::has_payload`] are the table of what follows each.
//!
//! Where the IB wire differs:
//! - No LRH, no ICRC or VCRC: the link addresses hosts and TCP checks the bytes. In the LRH's
//!   place every segment carries the address word ([`AddrRepr`]): the LID of the vRNIC the
//!   sender routed it to (DLID), the sending vRNIC's LID (SLID) and the sending QP's number,
//!   which RC, UC and XRC packets otherwise do not name. A receiver takes a segment only for a
//!   QP of the vRNIC its DLID names, from a vRNIC its link may speak for, in the same tenant
//!   group, and on a connected QP only from the QP it is connected to: a QP number alone never
//!   reaches another vRNIC's QP.
//! - The GRH is optional and flagged in the link header, as LRH's next-header field would,
//!   and allowed on UD segments only; its PayLen counts the bytes after it in the frame.
//! - Payload is padded to 4 bytes as IB does, and the pad bytes must be zero. A segment
//!   carries at most [`MAX_PAYLOAD`] bytes (a link's path MTU may exceed IB's 4096 bytes, since
//!   TCP segments anyway), a UD segment at most [`MAX_UD_PAYLOAD`].
//! - BTH byte 4 (FECN/BECN in later specs) must be zero; there is no congestion marking.
//!
//! # Strictness
//!
//! Decoding accepts exactly the frames that [`FrameRepr::emit`] writes: a frame that parses
//! emits back to the same bytes (the `frame` fuzz target asserts it). Anything else is a
//! [`FrameError`]: a short or over-long buffer, a wrong magic or version, an unknown kind or
//! opcode, a set reserved bit, an invalid P_Key, a pad count that does not match, a missing
//! extension header, a payload where the opcode has none, a reserved AETH syndrome. The
//! transport closes the peer link on any of them: a peer that sends a malformed frame is
//! broken or hostile, and nothing after it in the stream can be trusted.
//!
//! Protocol errors inside well-formed frames (an unknown QP, a bad R_Key, a misaligned atomic,
//! a payload that breaks the QP's path MTU, see [`SegmentRepr::check_pmtu`]) are the engine's
//! to answer with a NAK; the link stays up.
//!
//! Nothing here panics on any input, allocates, or copies a payload: [`FrameRepr::parse`]
//! gives the payload's range in the buffer, and the receiver copies it straight into
//! destination memory. Emitting panics only on a representation that fails its `check`.
//!
//! # Example
//!
//! ```
//! use vrnic_wire::frame::{AddrRepr, Frame, FrameRepr, Op, Opcode, SegmentRepr, Transport};
//!
//! let send = Opcode::new(Transport::Rc, Op::SendOnly).unwrap();
//! let mut segment = SegmentRepr::new(send, 0x12, 7);
//! segment.ack_req = true;
//! segment.payload_len = 5;
//! let addr = AddrRepr { dlid: 2, slid: 1, src_qpn: 0x34 };
//! let repr = FrameRepr::Segment { addr, grh: None, segment };
//!
//! let mut buf = vec![0u8; repr.buffer_len()];
//! buf[repr.payload_range()].copy_from_slice(b"hello");
//! repr.emit(&mut Frame::new_unchecked(&mut buf[..]));
//! assert_eq!(buf.len(), 8 + 8 + 12 + 5 + 3);
//!
//! let frame = Frame::new_checked(&buf[..]).unwrap();
//! let parsed = FrameRepr::parse(&frame).unwrap();
//! assert_eq!(parsed, repr);
//! assert_eq!(&buf[parsed.payload_range()], b"hello");
//! ```

use std::ops::Range;

mod cm;
mod header;
mod link;
mod opcode;
mod segment;

pub use cm::{CmMessage, CmParams, MAX_NAME, MAX_PRIVATE_DATA, valid_name};
pub use header::{
    Aeth, AtomicAckEth, AtomicEth, Deth, FLOW_LABEL_MASK, GRH_IPVER, GRH_NEXT_HEADER, GrhRepr,
    NakCode, Reth, Syndrome,
};
pub use link::{
    AnnounceEntry, Entries, HANDSHAKE_LENS, HELLO_ENCRYPT, HELLO_LEN, HandshakeRepr, HelloRepr,
    KEEPALIVE_LEN, KEY_LEN, KeepaliveRepr, LINK_PROTOCOL, LinkError, MAX_HANDSHAKE, MAX_RECORD,
    MAX_RECORD_PLAIN, NOISE_PARAMS, RECORD_HEADER_LEN, TAG_LEN, peek_record,
};
pub use opcode::{ATOMIC_WRITE_LEN, ExtHeader, Op, Opcode, Position, Transport};
pub use segment::{DEFAULT_PKEY, Packet, SegmentRepr, pad_bytes_ok};

/// Bytes of the link header.
pub const LINK_HEADER_LEN: usize = 8;
/// The link header's first two bytes.
pub const MAGIC: [u8; 2] = *b"vR";
/// The link header version this module reads and writes (2: every segment has an address
/// word).
pub const VERSION: u8 = 2;
/// Link flag: a GRH follows the address word.
pub const FLAG_GRH: u8 = 0x01;
/// Bytes of a segment's address word: DLID 16, SLID 16, reserved 8, source QP 24.
pub const ADDR_LEN: usize = 8;

/// Bytes of the global route header.
pub const GRH_LEN: usize = 40;
/// Bytes of the base transport header.
pub const BTH_LEN: usize = 12;
/// Bytes of the RDMA extended transport header.
pub const RETH_LEN: usize = 16;
/// Bytes of the ACK extended transport header.
pub const AETH_LEN: usize = 4;
/// Bytes of the atomic extended transport header.
pub const ATOMIC_ETH_LEN: usize = 28;
/// Bytes of the atomic acknowledge extended transport header.
pub const ATOMIC_ACK_ETH_LEN: usize = 8;
/// Bytes of the immediate data.
pub const IMM_DT_LEN: usize = 4;
/// Bytes of the datagram extended transport header.
pub const DETH_LEN: usize = 8;
/// Bytes of the invalidate extended transport header.
pub const IETH_LEN: usize = 4;
/// XRC extended transport header: reserved 8 bits, XRC SRQ number 24 bits.
pub const XRCETH_LEN: usize = 4;

/// Most payload bytes in one segment (and the largest path MTU a link may use).
pub const MAX_PAYLOAD: usize = 64 * 1024;
/// Most payload bytes in one UD segment: the port's MTU, which bounds a UD message.
pub const MAX_UD_PAYLOAD: usize = 4096;
/// Smallest path MTU (IB's 256 bytes).
pub const MIN_PMTU: usize = 256;
/// QP numbers are 24 bits.
pub const QPN_MASK: u32 = 0xff_ffff;
/// PSNs are 24 bits.
pub const PSN_MASK: u32 = 0xff_ffff;

/// The longest BTH plus extension headers of any opcode (an XRC CmpSwap's 44 bytes).
pub const MAX_SEGMENT_HEADERS: usize = {
    let mut max = 0;
    let mut v = 0;
    while v < 256 {
        if let Some(o) = Opcode::from_u8(v as u8)
            && o.header_len() > max
        {
            max = o.header_len();
        }
        v += 1;
    }
    max
};
/// Most bytes in one frame: link header, address word, the longest headers and
/// [`MAX_PAYLOAD`].
pub const MAX_FRAME: usize = LINK_HEADER_LEN + ADDR_LEN + MAX_SEGMENT_HEADERS + MAX_PAYLOAD;

const _: () = assert!(MAX_SEGMENT_HEADERS == BTH_LEN + XRCETH_LEN + ATOMIC_ETH_LEN);
const _: () = assert!(MAX_FRAME <= 0xff_ffff, "the length field has 24 bits");
const UD_SEGMENT_MAX: usize = BTH_LEN + DETH_LEN + IMM_DT_LEN + MAX_UD_PAYLOAD;
const _: () = assert!(
    UD_SEGMENT_MAX <= u16::MAX as usize,
    "GRH PayLen has 16 bits"
);
const _: () = assert!(LINK_HEADER_LEN + ADDR_LEN + GRH_LEN + UD_SEGMENT_MAX <= MAX_FRAME);
const _: () = assert!(MAX_PAYLOAD.is_multiple_of(4) && MAX_UD_PAYLOAD.is_multiple_of(4));

/// Why bytes are not a frame (or a representation cannot become one).
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum FrameError {
    /// The buffer ends before a part that must be there.
    #[error("truncated: {needed} bytes needed, {got} present")]
    Truncated {
        /// Bytes the part needs.
        needed: usize,
        /// Bytes the buffer has.
        got: usize,
    },
    /// The link header does not start with [`MAGIC`].
    #[error("bad magic {0:02x?}")]
    Magic([u8; 2]),
    /// A link header version other than [`VERSION`].
    #[error("unsupported link version {0}")]
    Version(u8),
    /// A frame kind that is not defined.
    #[error("unknown frame kind {0:#04x}")]
    Kind(u8),
    /// A reserved bit or byte is set in the named header.
    #[error("reserved bits set in {0}")]
    Reserved(&'static str),
    /// The link header's length is below what its kind needs or above [`MAX_FRAME`].
    #[error("frame length {0} out of bounds")]
    Length(usize),
    /// The buffer holds bytes past the frame's length.
    #[error("{0} bytes past the end of the frame")]
    Trailing(usize),
    /// A GRH on a control frame or on a segment that is not UD.
    #[error("a GRH on a frame that is not a UD segment")]
    GrhNotAllowed,
    /// A GRH field other than the constants or the length this module writes.
    #[error("bad GRH {0}")]
    Grh(&'static str),
    /// A BTH opcode that is reserved, unimplemented, or not offered by its transport.
    #[error("unknown opcode {0:#04x}")]
    Opcode(u8),
    /// A BTH transport version other than 0.
    #[error("unsupported transport version {0}")]
    TransportVersion(u8),
    /// An invalid P_Key (0x0000 or 0x8000).
    #[error("invalid P_Key {0:#06x}")]
    PKey(u16),
    /// The packet ends inside the extension headers its opcode names.
    #[error("opcode {opcode:#04x} needs {needed} header bytes, {got} present")]
    Headers {
        /// The opcode byte.
        opcode: u8,
        /// BTH plus extension header bytes.
        needed: usize,
        /// Bytes present.
        got: usize,
    },
    /// Bytes after the headers of an opcode that carries no payload.
    #[error("opcode {opcode:#04x} carries no payload but {len} bytes follow its headers")]
    UnexpectedPayload {
        /// The opcode byte.
        opcode: u8,
        /// Bytes after the headers.
        len: usize,
    },
    /// The pad count does not fit the bytes after the headers (which are a multiple of 4).
    #[error("pad count {pad} does not fit {len} bytes after the headers")]
    Pad {
        /// PadCnt.
        pad: u8,
        /// Bytes after the headers.
        len: usize,
    },
    /// A pad byte is not zero.
    #[error("nonzero pad bytes")]
    PadBytes,
    /// More payload than the transport allows.
    #[error("payload of {len} bytes exceeds {max}")]
    PayloadTooLong {
        /// Payload bytes.
        len: usize,
        /// The bound.
        max: usize,
    },
    /// An opcode of one payload length ([`Opcode::fixed_payload`]: ATOMIC WRITE's 8 bytes)
    /// with another payload, or a RETH whose DMA length says another.
    #[error(
        "opcode {opcode:#04x} carries {want} bytes, not {len} (payload {payload}, DMA length {dma_len})"
    )]
    FixedLength {
        /// The opcode byte.
        opcode: u8,
        /// The length it must have.
        want: usize,
        /// The length found: the payload's, else the RETH's.
        len: usize,
        /// Payload bytes.
        payload: usize,
        /// The RETH's DMA length.
        dma_len: u32,
    },
    /// A reserved AETH syndrome.
    #[error("reserved AETH syndrome {0:#04x}")]
    Syndrome(u8),
    /// A representation whose named part does not match its opcode or its field's range.
    #[error("the {0} does not match the opcode or its range")]
    Inconsistent(&'static str),
    /// A path MTU that is not a power of two from [`MIN_PMTU`] to [`MAX_PAYLOAD`].
    #[error("invalid path MTU {0}")]
    BadPmtu(usize),
    /// A payload size the IB segmentation rules forbid at this path MTU.
    #[error("{len} payload bytes break the path MTU {pmtu} for opcode {opcode:#04x}")]
    Pmtu {
        /// The opcode byte.
        opcode: u8,
        /// Payload bytes.
        len: usize,
        /// The path MTU.
        pmtu: usize,
    },
}

/// The link-control frames. Their bodies are the link-control protocol's.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum ControlKind {
    /// The first frame on a new link, each way.
    Hello = 2,
    /// Liveness while the link is otherwise idle.
    Keepalive = 3,
    /// vRNICs appearing on or leaving the sending host.
    Announce = 4,
    /// A connection-manager message between the hosts' brokers ([`CmMessage`]).
    Cm = 5,
    /// A step of the Noise handshake that authenticates a link ([`HandshakeRepr`]).
    Handshake = 6,
}

/// The link header's kind byte.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum FrameKind {
    /// An IB transport packet (kind 1).
    Segment,
    /// A link-control frame.
    Control(ControlKind),
}

impl FrameKind {
    /// The kind byte of a segment.
    pub const SEGMENT: u8 = 1;

    /// Decodes the kind byte.
    pub const fn from_u8(v: u8) -> Option<Self> {
        Some(match v {
            Self::SEGMENT => FrameKind::Segment,
            2 => FrameKind::Control(ControlKind::Hello),
            3 => FrameKind::Control(ControlKind::Keepalive),
            4 => FrameKind::Control(ControlKind::Announce),
            5 => FrameKind::Control(ControlKind::Cm),
            6 => FrameKind::Control(ControlKind::Handshake),
            _ => return None,
        })
    }

    /// The kind byte.
    pub const fn to_u8(self) -> u8 {
        match self {
            FrameKind::Segment => Self::SEGMENT,
            FrameKind::Control(c) => c as u8,
        }
    }
}

/// Appends to `out` a control frame of `kind` with `body` (its header emitted, the body
/// copied after it): what a daemon sends on a link, and what tests forge.
pub fn emit_control(out: &mut Vec<u8>, kind: ControlKind, body: &[u8]) {
    let repr = FrameRepr::Control(ControlRepr {
        kind,
        body_len: body.len(),
    });
    let start = out.len();
    out.resize(start + repr.buffer_len(), 0);
    repr.emit(&mut Frame::new_unchecked(&mut out[start..]));
    out[start + LINK_HEADER_LEN..].copy_from_slice(body);
}

/// Validates a link header at the start of `buf` and returns the length of its frame:
/// `Ok(None)` until [`LINK_HEADER_LEN`] bytes are there. A reader of the stream calls it on
/// each new frame's first bytes; an error means the link is broken.
pub fn peek_len(buf: &[u8]) -> Result<Option<usize>, FrameError> {
    let Some(h) = buf.first_chunk::<LINK_HEADER_LEN>() else {
        return Ok(None);
    };
    if h[..2] != MAGIC {
        return Err(FrameError::Magic([h[0], h[1]]));
    }
    if h[2] != VERSION {
        return Err(FrameError::Version(h[2]));
    }
    let kind = FrameKind::from_u8(h[3]).ok_or(FrameError::Kind(h[3]))?;
    let flags = h[4];
    if flags & !FLAG_GRH != 0 {
        return Err(FrameError::Reserved("link flags"));
    }
    let grh = flags & FLAG_GRH != 0;
    let min = match kind {
        FrameKind::Segment => LINK_HEADER_LEN + route_len(flags) + BTH_LEN,
        FrameKind::Control(_) if grh => return Err(FrameError::GrhNotAllowed),
        FrameKind::Control(_) => LINK_HEADER_LEN,
    };
    let len = be24(h, 5) as usize;
    if len < min || len > MAX_FRAME {
        return Err(FrameError::Length(len));
    }
    Ok(Some(len))
}

/// Bytes of a segment's address word and the GRH that link flags `flags` announce.
const fn route_len(flags: u8) -> usize {
    ADDR_LEN + if flags & FLAG_GRH != 0 { GRH_LEN } else { 0 }
}

/// A read/write view of one whole frame: link header, then body.
///
/// After [`Frame::new_checked`] the link header is valid and the buffer is exactly the frame.
/// On a view from [`Frame::new_unchecked`], the link header accessors panic on a buffer shorter
/// than [`LINK_HEADER_LEN`]; the slice accessors never panic.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Frame<T: AsRef<[u8]>> {
    buffer: T,
}

impl<T: AsRef<[u8]>> Frame<T> {
    /// Wraps a buffer without checking it.
    pub const fn new_unchecked(buffer: T) -> Self {
        Frame { buffer }
    }

    /// Wraps a buffer after [`Frame::check`].
    pub fn new_checked(buffer: T) -> Result<Self, FrameError> {
        let f = Self::new_unchecked(buffer);
        f.check()?;
        Ok(f)
    }

    /// Checks the link header ([`peek_len`]) and that the buffer holds exactly its frame. The
    /// body is [`FrameRepr::parse`]'s to check.
    pub fn check(&self) -> Result<(), FrameError> {
        let b = self.buffer.as_ref();
        let got = b.len();
        let len = peek_len(b)?.ok_or(FrameError::Truncated {
            needed: LINK_HEADER_LEN,
            got,
        })?;
        if got < len {
            return Err(FrameError::Truncated { needed: len, got });
        }
        if got > len {
            return Err(FrameError::Trailing(got - len));
        }
        Ok(())
    }

    /// The buffer back.
    pub fn into_inner(self) -> T {
        self.buffer
    }

    /// The magic bytes.
    pub fn magic(&self) -> [u8; 2] {
        let b = self.buffer.as_ref();
        [b[0], b[1]]
    }

    /// The version byte.
    pub fn version(&self) -> u8 {
        self.buffer.as_ref()[2]
    }

    /// The kind byte ([`FrameKind::from_u8`] names it).
    pub fn kind(&self) -> u8 {
        self.buffer.as_ref()[3]
    }

    /// The flags byte.
    pub fn flags(&self) -> u8 {
        self.buffer.as_ref()[4]
    }

    /// The length field: bytes in the frame, link header included.
    pub fn frame_len(&self) -> usize {
        be24(self.buffer.as_ref(), 5) as usize
    }

    /// Whether [`FLAG_GRH`] is set.
    pub fn has_grh(&self) -> bool {
        self.buffer
            .as_ref()
            .get(4)
            .is_some_and(|f| f & FLAG_GRH != 0)
    }

    /// Bytes of a segment's address word and the GRH its flags announce.
    fn route_len(&self) -> usize {
        self.buffer.as_ref().get(4).map_or(0, |&f| route_len(f))
    }

    /// Everything after the link header.
    pub fn body(&self) -> &[u8] {
        self.buffer.as_ref().get(LINK_HEADER_LEN..).unwrap_or(&[])
    }

    /// A segment's address word, if present.
    pub fn addr_word(&self) -> Option<&[u8; ADDR_LEN]> {
        self.body().first_chunk()
    }

    /// The GRH's bytes, if flagged and present.
    pub fn grh(&self) -> Option<&[u8; GRH_LEN]> {
        if self.has_grh() {
            self.body().get(ADDR_LEN..)?.first_chunk()
        } else {
            None
        }
    }

    /// The IB transport packet of a segment: the body after the address word and the GRH, if
    /// any.
    pub fn segment(&self) -> &[u8] {
        self.body().get(self.route_len()..).unwrap_or(&[])
    }
}

impl<T: AsRef<[u8]> + AsMut<[u8]>> Frame<T> {
    /// Writes [`MAGIC`].
    pub fn set_magic(&mut self) {
        self.buffer.as_mut()[..2].copy_from_slice(&MAGIC);
    }

    /// Sets the version byte.
    pub fn set_version(&mut self, v: u8) {
        self.buffer.as_mut()[2] = v;
    }

    /// Sets the kind byte.
    pub fn set_kind(&mut self, v: u8) {
        self.buffer.as_mut()[3] = v;
    }

    /// Sets the flags byte.
    pub fn set_flags(&mut self, v: u8) {
        self.buffer.as_mut()[4] = v;
    }

    /// Sets the length field (24 bits; higher bits are cut).
    pub fn set_frame_len(&mut self, len: usize) {
        put24(self.buffer.as_mut(), 5, (len & 0xff_ffff) as u32);
    }

    /// Everything after the link header, writable.
    pub fn body_mut(&mut self) -> &mut [u8] {
        self.buffer
            .as_mut()
            .get_mut(LINK_HEADER_LEN..)
            .unwrap_or(&mut [])
    }

    /// A segment's address word, writable, if present.
    pub fn addr_word_mut(&mut self) -> Option<&mut [u8; ADDR_LEN]> {
        self.body_mut().first_chunk_mut()
    }

    /// The GRH's bytes, writable, if flagged and present.
    pub fn grh_mut(&mut self) -> Option<&mut [u8; GRH_LEN]> {
        if self.has_grh() {
            self.body_mut().get_mut(ADDR_LEN..)?.first_chunk_mut()
        } else {
            None
        }
    }

    /// The IB transport packet of a segment, writable.
    pub fn segment_mut(&mut self) -> &mut [u8] {
        let skip = self.route_len();
        self.body_mut().get_mut(skip..).unwrap_or(&mut [])
    }
}

/// A control frame: its kind and how long its (opaque) body is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct ControlRepr {
    /// Which control frame.
    pub kind: ControlKind,
    /// Bytes of the body.
    pub body_len: usize,
}

/// One frame's header values; its payload (a segment's data, a control frame's body) stays in
/// the buffer at [`FrameRepr::payload_range`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum FrameRepr {
    /// An IB transport packet, with its address word, and a GRH if it is a UD one that carries
    /// one.
    Segment {
        /// Whom it is for and from.
        addr: AddrRepr,
        /// The global route header, if flagged.
        grh: Option<GrhRepr>,
        /// The transport headers.
        segment: SegmentRepr,
    },
    /// A link-control frame.
    Control(ControlRepr),
}

impl FrameRepr {
    /// Decodes a frame, strictly (see the module docs): the link header, then for a segment its
    /// GRH and its packet ([`SegmentRepr::parse`]).
    pub fn parse<T: AsRef<[u8]>>(frame: &Frame<T>) -> Result<Self, FrameError> {
        frame.check()?;
        match FrameKind::from_u8(frame.kind()) {
            None => return Err(FrameError::Kind(frame.kind())),
            Some(FrameKind::Control(kind)) => {
                return Ok(FrameRepr::Control(ControlRepr {
                    kind,
                    body_len: frame.body().len(),
                }));
            }
            Some(FrameKind::Segment) => {}
        }
        // The address word first, in both parses, so a frame refused for it is refused so
        // by the head's parse too (whatever its pad).
        let addr = parse_addr(frame, frame.body().len())?;
        let segment = SegmentRepr::parse(&Packet::new_unchecked(frame.segment()))?;
        let grh = match frame.grh() {
            None if frame.has_grh() => {
                return Err(FrameError::Truncated {
                    needed: LINK_HEADER_LEN + frame.route_len(),
                    got: LINK_HEADER_LEN + frame.body().len(),
                });
            }
            None => None,
            Some(_) if segment.opcode.transport() != Transport::Ud => {
                return Err(FrameError::GrhNotAllowed);
            }
            Some(g) => Some(GrhRepr::parse(g, frame.segment().len())?),
        };
        Ok(FrameRepr::Segment { addr, grh, segment })
    }

    /// [`FrameRepr::parse`] of a frame from its first bytes `head`, for a receiver that reads a
    /// segment's payload somewhere else: `head` must hold the link header and, for a segment,
    /// its GRH and headers (bytes past them, up to the frame's end, are ignored). Everything is
    /// checked but a segment's pad bytes, the frame's last [`Packet::pad_count`] bytes, which
    /// the receiver checks once they arrive ([`pad_bytes_ok`]). A control frame's body is not
    /// looked at (its kind's own parser does that).
    pub fn parse_head(head: &[u8]) -> Result<Self, FrameError> {
        let len = peek_len(head)?.ok_or(FrameError::Truncated {
            needed: LINK_HEADER_LEN,
            got: head.len(),
        })?;
        let frame = Frame::new_unchecked(&head[..head.len().min(len)]);
        match FrameKind::from_u8(frame.kind()) {
            None => return Err(FrameError::Kind(frame.kind())),
            Some(FrameKind::Control(kind)) => {
                return Ok(FrameRepr::Control(ControlRepr {
                    kind,
                    body_len: len - LINK_HEADER_LEN,
                }));
            }
            Some(FrameKind::Segment) => {}
        }
        let addr = parse_addr(&frame, frame.buffer.len() - LINK_HEADER_LEN)?;
        let packet_len = len - LINK_HEADER_LEN - frame.route_len();
        let segment = SegmentRepr::parse_head(frame.segment(), packet_len)?;
        let grh = match frame.grh() {
            None if frame.has_grh() => {
                return Err(FrameError::Truncated {
                    needed: LINK_HEADER_LEN + frame.route_len(),
                    got: frame.buffer.len(),
                });
            }
            None => None,
            Some(_) if segment.opcode.transport() != Transport::Ud => {
                return Err(FrameError::GrhNotAllowed);
            }
            Some(g) => Some(GrhRepr::parse(g, packet_len)?),
        };
        Ok(FrameRepr::Segment { addr, grh, segment })
    }

    /// Whether the value can be emitted: a valid segment ([`SegmentRepr::check`]) with a
    /// 24-bit source QP, and a GRH only if UD, or a control body that fits in [`MAX_FRAME`].
    pub fn check(&self) -> Result<(), FrameError> {
        match self {
            FrameRepr::Segment { addr, grh, segment } => {
                segment.check()?;
                if grh.is_some() && segment.opcode.transport() != Transport::Ud {
                    return Err(FrameError::GrhNotAllowed);
                }
                if addr.src_qpn > QPN_MASK {
                    return Err(FrameError::Inconsistent("source QP"));
                }
                if grh.is_some_and(|g| g.flow_label > FLOW_LABEL_MASK) {
                    return Err(FrameError::Inconsistent("flow label"));
                }
            }
            FrameRepr::Control(c) => {
                if c.body_len > MAX_FRAME - LINK_HEADER_LEN {
                    return Err(FrameError::Length(LINK_HEADER_LEN + c.body_len));
                }
            }
        }
        Ok(())
    }

    /// Bytes before the payload: link header, address word, GRH, BTH and extension headers.
    pub fn header_len(&self) -> usize {
        LINK_HEADER_LEN
            + match self {
                FrameRepr::Segment { segment, .. } => self.route_len() + segment.header_len(),
                FrameRepr::Control(_) => 0,
            }
    }

    /// Bytes of the payload or control body.
    pub fn payload_len(&self) -> usize {
        match self {
            FrameRepr::Segment { segment, .. } => segment.payload_len,
            FrameRepr::Control(c) => c.body_len,
        }
    }

    /// Where the payload or control body lies in the frame.
    pub fn payload_range(&self) -> Range<usize> {
        self.header_len()..self.header_len() + self.payload_len()
    }

    /// Bytes of the whole frame.
    pub fn buffer_len(&self) -> usize {
        match self {
            FrameRepr::Segment { segment, .. } => {
                LINK_HEADER_LEN + self.route_len() + segment.buffer_len()
            }
            FrameRepr::Control(c) => LINK_HEADER_LEN + c.body_len,
        }
    }

    /// The link flags of its GRH.
    fn flags(&self) -> u8 {
        match self {
            FrameRepr::Segment { grh: Some(_), .. } => FLAG_GRH,
            _ => 0,
        }
    }

    /// Bytes of its address word and GRH.
    fn route_len(&self) -> usize {
        route_len(self.flags())
    }

    /// Writes every byte of the frame but the payload (or control body) into a buffer of
    /// exactly [`FrameRepr::buffer_len`] bytes.
    ///
    /// # Panics
    ///
    /// If [`FrameRepr::check`] fails or the buffer has another size: the caller builds both.
    pub fn emit<T: AsRef<[u8]> + AsMut<[u8]>>(&self, frame: &mut Frame<T>) {
        assert_eq!(self.check(), Ok(()), "emit of an inconsistent frame");
        let len = self.buffer_len();
        assert_eq!(
            frame.buffer.as_ref().len(),
            len,
            "the frame buffer is buffer_len() bytes"
        );
        frame.set_magic();
        frame.set_version(VERSION);
        frame.set_frame_len(len);
        match self {
            FrameRepr::Segment { addr, grh, segment } => {
                frame.set_kind(FrameKind::SEGMENT);
                frame.set_flags(self.flags());
                if let Some(dst) = frame.addr_word_mut() {
                    *dst = addr.to_bytes();
                }
                if let (Some(g), Some(dst)) = (grh, frame.grh_mut()) {
                    *dst = g.to_bytes(segment.buffer_len());
                }
                segment.emit(&mut Packet::new_unchecked(frame.segment_mut()));
            }
            FrameRepr::Control(c) => {
                frame.set_kind(FrameKind::Control(c.kind).to_u8());
                frame.set_flags(0);
            }
        }
    }
}

/// The address word of a segment frame whose link header was checked: its reserved byte zero.
/// `body_len`: the body bytes at hand.
fn parse_addr<T: AsRef<[u8]>>(frame: &Frame<T>, body_len: usize) -> Result<AddrRepr, FrameError> {
    let Some(w) = frame.addr_word() else {
        return Err(FrameError::Truncated {
            needed: LINK_HEADER_LEN + ADDR_LEN,
            got: LINK_HEADER_LEN + body_len,
        });
    };
    if w[4] != 0 {
        return Err(FrameError::Reserved("address word"));
    }
    Ok(AddrRepr {
        dlid: be16(w, 0),
        slid: be16(w, 2),
        src_qpn: be24(w, 5),
    })
}

/// A segment's address word, in the LRH's place: which vRNIC it was routed to, and which vRNIC
/// and QP sent it. The receiving daemon believes the source only as far as the link it came on
/// may speak for it (a LID its host announced); the destination is checked against the QP the
/// BTH names.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct AddrRepr {
    /// The destination vRNIC's LID (the LRH's DLID): the one its sender's route resolved.
    pub dlid: u16,
    /// The sending vRNIC's LID (the LRH's SLID).
    pub slid: u16,
    /// The sending QP's number (24 bits; a UD segment's DETH names it too).
    pub src_qpn: u32,
}

impl AddrRepr {
    /// Its 8 bytes: DLID, SLID, a zero byte, the source QP (big-endian).
    pub fn to_bytes(&self) -> [u8; ADDR_LEN] {
        let [d0, d1] = self.dlid.to_be_bytes();
        let [s0, s1] = self.slid.to_be_bytes();
        let [_, q0, q1, q2] = (self.src_qpn & QPN_MASK).to_be_bytes();
        [d0, d1, s0, s1, 0, q0, q1, q2]
    }
}

fn be16(b: &[u8], off: usize) -> u16 {
    u16::from_be_bytes([b[off], b[off + 1]])
}
fn be24(b: &[u8], off: usize) -> u32 {
    u32::from_be_bytes([0, b[off], b[off + 1], b[off + 2]])
}
fn be32(b: &[u8], off: usize) -> u32 {
    u32::from_be_bytes([b[off], b[off + 1], b[off + 2], b[off + 3]])
}
fn be64(b: &[u8], off: usize) -> u64 {
    (u64::from(be32(b, off)) << 32) | u64::from(be32(b, off + 4))
}
fn put24(b: &mut [u8], off: usize, v: u32) {
    b[off..off + 3].copy_from_slice(&v.to_be_bytes()[1..]);
}
fn put32(b: &mut [u8], off: usize, v: u32) {
    b[off..off + 4].copy_from_slice(&v.to_be_bytes());
}
fn put64(b: &mut [u8], off: usize, v: u64) {
    b[off..off + 8].copy_from_slice(&v.to_be_bytes());
}

#[cfg(test)]
mod tests;
