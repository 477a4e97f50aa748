//! The IB transport packet a segment frame carries: BTH, the extension headers its opcode
//! names, payload, pad. [`Packet`] is the checked view over those bytes, [`SegmentRepr`] the
//! owned header values.

use std::ops::Range;

use super::header::{Aeth, AtomicAckEth, AtomicEth, Deth, Reth};
use super::opcode::{ExtHeader, Opcode, Position, Transport};
use super::{
    BTH_LEN, FrameError, MAX_PAYLOAD, MAX_UD_PAYLOAD, MIN_PMTU, PSN_MASK, QPN_MASK, be16, be24,
    be32, put24, put32,
};

/// The default partition key (full member of the default partition), as rdma-core uses.
pub const DEFAULT_PKEY: u16 = 0xffff;

/// A read/write view of an IB transport packet: BTH (12 bytes) | extension headers | payload
/// | pad.
///
/// BTH bytes (IB spec 9.2): opcode (8) | SE (1) M (1) PadCnt (2) TVer (4) | P_Key (16) |
/// reserved (8) | DestQP (24) | AckReq (1) reserved (7) | PSN (24).
///
/// After [`Packet::new_checked`] every accessor stays in bounds: the opcode is known, its
/// headers are present and the pad count fits. On a view from [`Packet::new_unchecked`] the
/// BTH field accessors panic if the buffer is shorter than [`BTH_LEN`]; the slice accessors
/// never panic and return nothing instead.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Packet<T: AsRef<[u8]>> {
    buffer: T,
}

impl<T: AsRef<[u8]>> Packet<T> {
    /// Wraps a buffer without checking it.
    pub const fn new_unchecked(buffer: T) -> Self {
        Packet { buffer }
    }

    /// Wraps a buffer after [`Packet::check_len`].
    pub fn new_checked(buffer: T) -> Result<Self, FrameError> {
        let p = Self::new_unchecked(buffer);
        p.check_len()?;
        Ok(p)
    }

    /// Checks what the accessors rely on: a whole BTH, a known opcode, all its extension
    /// headers, and a payload area that the pad count fits (a multiple of 4 bytes, no bytes
    /// at all for opcodes without payload). Field values are [`SegmentRepr::parse`]'s job.
    pub fn check_len(&self) -> Result<(), FrameError> {
        let b = self.buffer.as_ref();
        check_head(b, b.len())
    }

    /// The buffer back.
    pub fn into_inner(self) -> T {
        self.buffer
    }

    /// The opcode byte.
    pub fn opcode(&self) -> u8 {
        self.buffer.as_ref()[0]
    }

    /// SE: the solicited-event bit.
    pub fn solicited(&self) -> bool {
        self.buffer.as_ref()[1] & 0x80 != 0
    }

    /// M: the migration-request bit.
    pub fn migration(&self) -> bool {
        self.buffer.as_ref()[1] & 0x40 != 0
    }

    /// PadCnt: pad bytes after the payload (0..=3).
    pub fn pad_count(&self) -> u8 {
        (self.buffer.as_ref()[1] >> 4) & 0x3
    }

    /// TVer: the transport header version (0).
    pub fn tver(&self) -> u8 {
        self.buffer.as_ref()[1] & 0x0f
    }

    /// P_Key.
    pub fn pkey(&self) -> u16 {
        be16(self.buffer.as_ref(), 2)
    }

    /// DestQP: the destination QP's number on the receiving host.
    pub fn dest_qpn(&self) -> u32 {
        be24(self.buffer.as_ref(), 5)
    }

    /// AckReq: the requester asks for an acknowledgement of this packet.
    pub fn ack_req(&self) -> bool {
        self.buffer.as_ref()[8] & 0x80 != 0
    }

    /// PSN.
    pub fn psn(&self) -> u32 {
        be24(self.buffer.as_ref(), 9)
    }

    /// Bytes of the BTH and the extension headers (just the BTH if the opcode is unknown).
    pub fn header_len(&self) -> usize {
        let b = self.buffer.as_ref();
        b.first()
            .and_then(|&v| Opcode::from_u8(v))
            .map_or(BTH_LEN, Opcode::header_len)
    }

    /// The bytes of extension header `h`, if the opcode has one and the buffer holds it.
    pub fn ext(&self, h: ExtHeader) -> Option<&[u8]> {
        let b = self.buffer.as_ref();
        let off = Opcode::from_u8(*b.first()?)?.ext_offset(h)?;
        b.get(off..off + h.size())
    }

    /// The payload: between the headers and the pad.
    pub fn payload(&self) -> &[u8] {
        let b = self.buffer.as_ref();
        let end = b
            .len()
            .saturating_sub(usize::from(self.pad_count_or_zero()));
        b.get(self.header_len()..end).unwrap_or(&[])
    }

    fn pad_count_or_zero(&self) -> u8 {
        self.buffer.as_ref().get(1).map_or(0, |v| (v >> 4) & 0x3)
    }
}

impl<T: AsRef<[u8]> + AsMut<[u8]>> Packet<T> {
    /// Sets the opcode byte (which moves the extension headers and the payload).
    pub fn set_opcode(&mut self, v: u8) {
        self.buffer.as_mut()[0] = v;
    }

    fn set_bit(&mut self, byte: usize, mask: u8, on: bool) {
        let b = &mut self.buffer.as_mut()[byte];
        *b = if on { *b | mask } else { *b & !mask };
    }

    /// Sets SE.
    pub fn set_solicited(&mut self, v: bool) {
        self.set_bit(1, 0x80, v);
    }

    /// Sets M.
    pub fn set_migration(&mut self, v: bool) {
        self.set_bit(1, 0x40, v);
    }

    /// Sets PadCnt (two bits; higher bits of `v` are ignored).
    pub fn set_pad_count(&mut self, v: u8) {
        let b = &mut self.buffer.as_mut()[1];
        *b = (*b & !0x30) | ((v & 0x3) << 4);
    }

    /// Sets TVer (four bits).
    pub fn set_tver(&mut self, v: u8) {
        let b = &mut self.buffer.as_mut()[1];
        *b = (*b & !0x0f) | (v & 0x0f);
    }

    /// Sets P_Key.
    pub fn set_pkey(&mut self, v: u16) {
        self.buffer.as_mut()[2..4].copy_from_slice(&v.to_be_bytes());
    }

    /// Sets DestQP (24 bits) and clears the reserved byte before it.
    pub fn set_dest_qpn(&mut self, v: u32) {
        let b = self.buffer.as_mut();
        b[4] = 0;
        put24(b, 5, v & QPN_MASK);
    }

    /// Sets AckReq and clears the reserved bits beside it.
    pub fn set_ack_req(&mut self, v: bool) {
        self.buffer.as_mut()[8] = u8::from(v) << 7;
    }

    /// Sets the PSN (24 bits).
    pub fn set_psn(&mut self, v: u32) {
        put24(self.buffer.as_mut(), 9, v & PSN_MASK);
    }

    /// The bytes of extension header `h`, writable.
    pub fn ext_mut(&mut self, h: ExtHeader) -> Option<&mut [u8]> {
        let b = self.buffer.as_mut();
        let off = Opcode::from_u8(*b.first()?)?.ext_offset(h)?;
        b.get_mut(off..off + h.size())
    }

    /// The payload, writable.
    pub fn payload_mut(&mut self) -> &mut [u8] {
        let start = self.header_len();
        let pad = usize::from(self.pad_count_or_zero());
        let b = self.buffer.as_mut();
        let end = b.len().saturating_sub(pad);
        b.get_mut(start..end).unwrap_or(&mut [])
    }
}

/// The header values of one IB transport packet; its payload stays in the buffer
/// ([`SegmentRepr::payload_range`]).
///
/// Each `Option` is `Some` exactly when the opcode's row of the table
/// ([`Opcode::ext_headers`]) names that header: [`SegmentRepr::parse`] produces only such
/// values and [`SegmentRepr::check`] tells whether a hand-built one is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct SegmentRepr {
    /// Transport and operation.
    pub opcode: Opcode,
    /// SE: ask for a completion event at the receiver.
    pub solicited: bool,
    /// M: migration request (APM; vrnic keeps it as sent).
    pub migration: bool,
    /// P_Key; 0x0000 and 0x8000 are invalid.
    pub pkey: u16,
    /// Destination QP number on the receiving host (24 bits).
    pub dest_qpn: u32,
    /// AckReq.
    pub ack_req: bool,
    /// Packet sequence number (24 bits).
    pub psn: u32,
    /// DETH (UD).
    pub deth: Option<Deth>,
    /// RETH (WRITE First/Only, READ request).
    pub reth: Option<Reth>,
    /// AETH (acknowledgements and READ responses but Middle).
    pub aeth: Option<Aeth>,
    /// AtomicETH (CmpSwap, FetchAdd).
    pub atomic: Option<AtomicEth>,
    /// AtomicAckETH (ATOMIC Acknowledge).
    pub atomic_ack: Option<AtomicAckEth>,
    /// ImmDt: immediate data, as the verbs layer holds it; sent as four big-endian bytes.
    pub imm: Option<u32>,
    /// IETH: the R_Key to invalidate (SEND with Invalidate).
    pub invalidate_rkey: Option<u32>,
    /// XRCETH: the XRC SRQ number at the target (XRC requests; 24 bits).
    pub xrc_srqn: Option<u32>,
    /// Payload bytes, pad excluded.
    pub payload_len: usize,
}

/// Whether the last bytes of a packet, its pad (the BTH's pad count of them, at most 3), are
/// zero, as [`SegmentRepr::parse`] requires: for a receiver that parsed the head with
/// [`SegmentRepr::parse_head`] and read the rest elsewhere.
pub fn pad_bytes_ok(pad: &[u8]) -> bool {
    pad.len() <= 3 && pad.iter().all(|&v| v == 0)
}

/// [`Packet::check_len`] for a packet of `got` bytes of which `b` holds the first (at least its
/// headers, or the check fails with `Truncated`).
fn check_head(b: &[u8], got: usize) -> Result<(), FrameError> {
    if b.len() < BTH_LEN {
        return Err(FrameError::Truncated {
            needed: BTH_LEN,
            got: b.len(),
        });
    }
    let opcode = Opcode::from_u8(b[0]).ok_or(FrameError::Opcode(b[0]))?;
    let needed = opcode.header_len();
    if got < needed {
        return Err(FrameError::Headers {
            opcode: b[0],
            needed,
            got,
        });
    }
    if b.len() < needed {
        return Err(FrameError::Truncated {
            needed,
            got: b.len(),
        });
    }
    let rest = got - needed;
    let pad = (b[1] >> 4) & 0x3;
    if !opcode.has_payload() {
        if rest != 0 {
            return Err(FrameError::UnexpectedPayload {
                opcode: b[0],
                len: rest,
            });
        }
        if pad != 0 {
            return Err(FrameError::Pad { pad, len: 0 });
        }
    } else if !rest.is_multiple_of(4) || usize::from(pad) > rest {
        return Err(FrameError::Pad { pad, len: rest });
    }
    Ok(())
}

impl SegmentRepr {
    /// A packet of `opcode` to `dest_qpn` at `psn`, default P_Key, no flags, no headers and no
    /// payload yet: fill in what the opcode needs.
    pub fn new(opcode: Opcode, dest_qpn: u32, psn: u32) -> Self {
        SegmentRepr {
            opcode,
            solicited: false,
            migration: false,
            pkey: DEFAULT_PKEY,
            dest_qpn,
            ack_req: false,
            psn,
            deth: None,
            reth: None,
            aeth: None,
            atomic: None,
            atomic_ack: None,
            imm: None,
            invalidate_rkey: None,
            xrc_srqn: None,
            payload_len: 0,
        }
    }

    /// Decodes a packet, strictly: TVer 0, reserved bits zero, a valid P_Key, pad bytes zero,
    /// valid extension headers, and a payload within [`MAX_PAYLOAD`] ([`MAX_UD_PAYLOAD`] for
    /// UD). Does not copy the payload.
    pub fn parse<T: AsRef<[u8]>>(packet: &Packet<T>) -> Result<Self, FrameError> {
        let b = packet.buffer.as_ref();
        let repr = Self::parse_head(b, b.len())?;
        let pad = usize::from(packet.pad_count());
        if b[b.len() - pad..].iter().any(|&v| v != 0) {
            return Err(FrameError::PadBytes);
        }
        Ok(repr)
    }

    /// [`SegmentRepr::parse`] of a packet of `packet_len` bytes from its first bytes `head`
    /// (at least its headers): everything is checked but the pad bytes, which have not
    /// arrived. A receiver that reads the payload somewhere else checks them once they do
    /// ([`pad_bytes_ok`]).
    pub fn parse_head(head: &[u8], packet_len: usize) -> Result<Self, FrameError> {
        check_head(head, packet_len)?;
        let packet = Packet::new_unchecked(head);
        let b = head;
        let opcode = Opcode::from_u8(b[0]).ok_or(FrameError::Opcode(b[0]))?;
        if packet.tver() != 0 {
            return Err(FrameError::TransportVersion(packet.tver()));
        }
        if b[4] != 0 {
            return Err(FrameError::Reserved("BTH before DestQP"));
        }
        if b[8] & 0x7f != 0 {
            return Err(FrameError::Reserved("BTH after AckReq"));
        }
        let pkey = packet.pkey();
        if pkey & 0x7fff == 0 {
            return Err(FrameError::PKey(pkey));
        }
        let pad = usize::from(packet.pad_count());
        let payload_len = packet_len - opcode.header_len() - pad;
        let max = max_payload(opcode);
        if payload_len > max {
            return Err(FrameError::PayloadTooLong {
                len: payload_len,
                max,
            });
        }
        let mut repr = SegmentRepr {
            solicited: packet.solicited(),
            migration: packet.migration(),
            pkey,
            ack_req: packet.ack_req(),
            payload_len,
            ..SegmentRepr::new(opcode, packet.dest_qpn(), packet.psn())
        };
        let mut off = BTH_LEN;
        for &h in opcode.ext_headers() {
            match h {
                ExtHeader::Deth => repr.deth = Some(Deth::parse(chunk(b, off)?)?),
                ExtHeader::Reth => repr.reth = Some(Reth::parse(chunk(b, off)?)),
                ExtHeader::Aeth => repr.aeth = Some(Aeth::parse(chunk(b, off)?)?),
                ExtHeader::AtomicEth => repr.atomic = Some(AtomicEth::parse(chunk(b, off)?)),
                ExtHeader::AtomicAckEth => {
                    repr.atomic_ack = Some(AtomicAckEth::parse(chunk(b, off)?));
                }
                ExtHeader::ImmDt => repr.imm = Some(be32(chunk::<4>(b, off)?, 0)),
                ExtHeader::Ieth => repr.invalidate_rkey = Some(be32(chunk::<4>(b, off)?, 0)),
                ExtHeader::XrcEth => {
                    let x = chunk::<4>(b, off)?;
                    if x[0] != 0 {
                        return Err(FrameError::Reserved("XRCETH"));
                    }
                    repr.xrc_srqn = Some(be32(x, 0));
                }
            }
            off += h.size();
        }
        repr.fixed_length()?;
        Ok(repr)
    }

    /// An opcode of one payload length ([`Opcode::fixed_payload`]) has that payload, and its
    /// RETH that DMA length.
    fn fixed_length(&self) -> Result<(), FrameError> {
        let Some(want) = self.opcode.fixed_payload() else {
            return Ok(());
        };
        let dma_len = self.reth.map_or(0, |r| r.dma_len);
        if self.payload_len == want && dma_len as usize == want {
            return Ok(());
        }
        Err(FrameError::FixedLength {
            opcode: self.opcode.to_u8(),
            want,
            len: if self.payload_len == want {
                dma_len as usize
            } else {
                self.payload_len
            },
            payload: self.payload_len,
            dma_len,
        })
    }

    /// Whether the value can be emitted: each extension header present exactly when the
    /// opcode names it, no payload where the opcode carries none, every field in its range.
    pub fn check(&self) -> Result<(), FrameError> {
        let hs = self.opcode.ext_headers();
        let present = [
            (ExtHeader::Deth, self.deth.is_some(), "DETH"),
            (ExtHeader::Reth, self.reth.is_some(), "RETH"),
            (ExtHeader::Aeth, self.aeth.is_some(), "AETH"),
            (ExtHeader::AtomicEth, self.atomic.is_some(), "AtomicETH"),
            (
                ExtHeader::AtomicAckEth,
                self.atomic_ack.is_some(),
                "AtomicAckETH",
            ),
            (ExtHeader::ImmDt, self.imm.is_some(), "ImmDt"),
            (ExtHeader::Ieth, self.invalidate_rkey.is_some(), "IETH"),
            (ExtHeader::XrcEth, self.xrc_srqn.is_some(), "XRCETH"),
        ];
        for (h, is, name) in present {
            if hs.contains(&h) != is {
                return Err(FrameError::Inconsistent(name));
            }
        }
        if self.dest_qpn > QPN_MASK {
            return Err(FrameError::Inconsistent("destination QPN"));
        }
        if self.psn > PSN_MASK {
            return Err(FrameError::Inconsistent("PSN"));
        }
        if self.pkey & 0x7fff == 0 {
            return Err(FrameError::PKey(self.pkey));
        }
        if self.xrc_srqn.is_some_and(|n| n > QPN_MASK) {
            return Err(FrameError::Inconsistent("XRC SRQ number"));
        }
        if self.deth.is_some_and(|d| d.src_qpn > QPN_MASK) {
            return Err(FrameError::Inconsistent("source QPN"));
        }
        if self
            .aeth
            .is_some_and(|a| a.msn > QPN_MASK || !a.syndrome.is_valid())
        {
            return Err(FrameError::Inconsistent("AETH"));
        }
        if !self.opcode.has_payload() && self.payload_len != 0 {
            return Err(FrameError::Inconsistent("payload length"));
        }
        let max = max_payload(self.opcode);
        if self.payload_len > max {
            return Err(FrameError::PayloadTooLong {
                len: self.payload_len,
                max,
            });
        }
        self.fixed_length()
    }

    /// Checks the payload size against the IB rules for a path MTU of `pmtu` bytes (a power of
    /// two from [`MIN_PMTU`] to [`MAX_PAYLOAD`]): First and Middle packets carry exactly
    /// `pmtu`, Last ones 1 to `pmtu`, Only ones 0 to `pmtu`. The receiver calls it once it
    /// knows the QP's path MTU; a violation is a protocol error for that QP, not for the link.
    pub fn check_pmtu(&self, pmtu: usize) -> Result<(), FrameError> {
        if !pmtu.is_power_of_two() || !(MIN_PMTU..=MAX_PAYLOAD).contains(&pmtu) {
            return Err(FrameError::BadPmtu(pmtu));
        }
        let len = self.payload_len;
        let ok = match self.opcode.op().position() {
            Position::First | Position::Middle => len == pmtu,
            Position::Last => (1..=pmtu).contains(&len),
            Position::Only => len <= pmtu,
        };
        if ok {
            Ok(())
        } else {
            Err(FrameError::Pmtu {
                opcode: self.opcode.to_u8(),
                len,
                pmtu,
            })
        }
    }

    /// Bytes of the BTH and the extension headers.
    pub fn header_len(&self) -> usize {
        self.opcode.header_len()
    }

    /// Pad bytes after the payload: up to the next multiple of 4.
    pub fn pad_len(&self) -> usize {
        self.payload_len.wrapping_neg() % 4
    }

    /// Bytes of the whole packet.
    pub fn buffer_len(&self) -> usize {
        self.header_len() + self.payload_len + self.pad_len()
    }

    /// Where the payload lies in the packet.
    pub fn payload_range(&self) -> Range<usize> {
        self.header_len()..self.header_len() + self.payload_len
    }

    /// Writes the BTH, the extension headers and zero pad bytes into a packet buffer of
    /// exactly [`SegmentRepr::buffer_len`] bytes; the payload bytes are left as they are.
    ///
    /// # Panics
    ///
    /// If [`SegmentRepr::check`] fails or the buffer has another size: the caller builds
    /// both.
    pub fn emit<T: AsRef<[u8]> + AsMut<[u8]>>(&self, packet: &mut Packet<T>) {
        assert_eq!(self.check(), Ok(()), "emit of an inconsistent segment");
        let len = self.buffer_len();
        let pad = self.pad_len();
        let b = packet.buffer.as_mut();
        assert_eq!(b.len(), len, "the packet buffer is buffer_len() bytes");
        b[0] = self.opcode.to_u8();
        // pad < 4 (a remainder), so the cast keeps it.
        b[1] =
            (u8::from(self.solicited) << 7) | (u8::from(self.migration) << 6) | ((pad as u8) << 4);
        b[2..4].copy_from_slice(&self.pkey.to_be_bytes());
        b[4] = 0;
        put24(b, 5, self.dest_qpn);
        b[8] = u8::from(self.ack_req) << 7;
        put24(b, 9, self.psn);
        let mut off = BTH_LEN;
        for &h in self.opcode.ext_headers() {
            let dst = &mut b[off..off + h.size()];
            // check() made each header the table names `Some`; the defaults are never used.
            match h {
                ExtHeader::Deth => dst.copy_from_slice(&self.deth.unwrap_or_default().to_bytes()),
                ExtHeader::Reth => dst.copy_from_slice(&self.reth.unwrap_or_default().to_bytes()),
                ExtHeader::Aeth => dst.copy_from_slice(&self.aeth.unwrap_or_default().to_bytes()),
                ExtHeader::AtomicEth => {
                    dst.copy_from_slice(&self.atomic.unwrap_or_default().to_bytes());
                }
                ExtHeader::AtomicAckEth => {
                    dst.copy_from_slice(&self.atomic_ack.unwrap_or_default().to_bytes());
                }
                ExtHeader::ImmDt => put32(dst, 0, self.imm.unwrap_or_default()),
                ExtHeader::Ieth => put32(dst, 0, self.invalidate_rkey.unwrap_or_default()),
                ExtHeader::XrcEth => put32(dst, 0, self.xrc_srqn.unwrap_or_default()),
            }
            off += h.size();
        }
        b[len - pad..].fill(0);
    }
}

/// The payload bound of an opcode's transport.
fn max_payload(opcode: Opcode) -> usize {
    if opcode.transport() == Transport::Ud {
        MAX_UD_PAYLOAD
    } else {
        MAX_PAYLOAD
    }
}

/// The `N` bytes at `off`, as an array reference.
fn chunk<const N: usize>(b: &[u8], off: usize) -> Result<&[u8; N], FrameError> {
    b.get(off..)
        .and_then(<[u8]>::first_chunk::<N>)
        .ok_or(FrameError::Truncated {
            needed: off + N,
            got: b.len(),
        })
}

#[cfg(test)]
pub(super) mod tests {
    use super::super::header::{NakCode, Syndrome};
    use super::*;

    /// A segment of `opcode` with every header it names filled with distinct values.
    pub(in super::super) fn sample(opcode: Opcode, payload_len: usize) -> SegmentRepr {
        let hs = opcode.ext_headers();
        let has = |h| hs.contains(&h);
        SegmentRepr {
            solicited: true,
            ack_req: opcode.op().position() != Position::Middle,
            pkey: 0x8001,
            deth: has(ExtHeader::Deth).then_some(Deth {
                qkey: 0x1111_1111,
                src_qpn: 0x00_0042,
            }),
            reth: has(ExtHeader::Reth).then_some(Reth {
                va: 0x7f00_0000_1000,
                rkey: 0x0000_0203,
                dma_len: opcode.fixed_payload().map_or(0x1_0000, |n| n as u32),
            }),
            aeth: has(ExtHeader::Aeth).then_some(Aeth {
                syndrome: Syndrome::Nak(NakCode::RemoteAccessError),
                msn: 0x00_0009,
            }),
            atomic: has(ExtHeader::AtomicEth).then_some(AtomicEth {
                va: 0x8000,
                rkey: 5,
                swap_add: 6,
                compare: 7,
            }),
            atomic_ack: has(ExtHeader::AtomicAckEth).then_some(AtomicAckEth { orig: 99 }),
            imm: has(ExtHeader::ImmDt).then_some(0xdead_beef),
            invalidate_rkey: has(ExtHeader::Ieth).then_some(0x0000_0203),
            xrc_srqn: has(ExtHeader::XrcEth).then_some(0x00_0a0b),
            payload_len: match (opcode.has_payload(), opcode.fixed_payload()) {
                (_, Some(n)) => n,
                (true, None) => payload_len,
                (false, None) => 0,
            },
            ..SegmentRepr::new(opcode, 0xab_cdef, 0xff_fffe)
        }
    }

    /// ATOMIC WRITE (RC 0x1d, XRC 0xbd): a RETH then exactly 8 bytes, the RETH's DMA length 8.
    /// Any other payload or DMA length is refused by the parser and by `check`.
    #[test]
    fn an_atomic_write_carries_exactly_eight_bytes() {
        for byte in [0x1d, 0xbd] {
            let o = Opcode::from_u8(byte).unwrap();
            let r = sample(o, 8);
            assert_eq!(r.check(), Ok(()));
            let mut b = emit(&r);
            let h = o.header_len();
            b[h..h + 8].copy_from_slice(&0x0102_0304_0506_0708u64.to_le_bytes());
            let p = Packet::new_checked(&b[..]).unwrap();
            assert_eq!(SegmentRepr::parse(&p), Ok(r));
            assert_eq!(p.payload(), &0x0102_0304_0506_0708u64.to_le_bytes());
            // Another payload length: emitted by hand (check refuses it), refused by parse.
            for len in [0usize, 4, 12, 16, 4096] {
                let mut bad = r;
                bad.payload_len = len;
                assert!(
                    matches!(bad.check(), Err(FrameError::FixedLength { want: 8, .. })),
                    "{byte:#x} {len}"
                );
                let mut b = emit(&r);
                b.truncate(h);
                b.resize(h + len, 0);
                let got = Packet::new_checked(&b[..]).and_then(|p| SegmentRepr::parse(&p));
                assert_eq!(
                    got,
                    Err(FrameError::FixedLength {
                        opcode: byte,
                        want: 8,
                        len,
                        payload: len,
                        dma_len: 8
                    }),
                    "{byte:#x} {len}"
                );
            }
            // Eight bytes of payload, but a DMA length that says otherwise.
            for dma_len in [0u32, 7, 9, 0x1_0000] {
                let mut bad = r;
                bad.reth = Some(Reth {
                    dma_len,
                    ..r.reth.unwrap()
                });
                assert!(matches!(bad.check(), Err(FrameError::FixedLength { .. })));
                let mut b = emit(&r);
                let at = o.ext_offset(ExtHeader::Reth).unwrap() + 12;
                b[at..at + 4].copy_from_slice(&dma_len.to_be_bytes());
                let p = Packet::new_checked(&b[..]).unwrap();
                assert_eq!(
                    SegmentRepr::parse(&p),
                    Err(FrameError::FixedLength {
                        opcode: byte,
                        want: 8,
                        len: dma_len as usize,
                        payload: 8,
                        dma_len
                    })
                );
            }
        }
    }

    fn emit(repr: &SegmentRepr) -> Vec<u8> {
        let mut b = vec![0x5a; repr.buffer_len()];
        repr.emit(&mut Packet::new_unchecked(&mut b[..]));
        b
    }

    #[test]
    fn bth_bytes_follow_ib_9_2() {
        let op = Opcode::from_u8(0x04).unwrap();
        let mut r = SegmentRepr::new(op, 0x12_3456, 0xab_cdef);
        r.solicited = true;
        r.ack_req = true;
        r.pkey = 0x8001;
        r.payload_len = 5;
        let b = emit(&r);
        // opcode, SE|pad 3, P_Key, resv, DestQP, AckReq, PSN.
        let bth = [
            0x04, 0xb0, 0x80, 0x01, 0, 0x12, 0x34, 0x56, 0x80, 0xab, 0xcd, 0xef,
        ];
        assert_eq!(&b[..12], &bth);
        assert_eq!(&b[17..], &[0, 0, 0], "pad bytes are zero");
        let p = Packet::new_checked(&b[..]).unwrap();
        assert_eq!(
            (p.opcode(), p.pad_count(), p.dest_qpn(), p.psn(), p.pkey()),
            (4, 3, 0x12_3456, 0xab_cdef, 0x8001)
        );
        assert_eq!(p.payload().len(), 5);
        assert_eq!(SegmentRepr::parse(&p), Ok(r));
    }

    #[test]
    fn imm_and_ieth_are_one_big_endian_word_after_their_predecessors() {
        let mut r = sample(Opcode::from_u8(0x65).unwrap(), 0);
        r.imm = Some(0x0102_0304);
        let b = emit(&r);
        assert_eq!(&b[12..20], &[0x11, 0x11, 0x11, 0x11, 0, 0, 0, 0x42]);
        assert_eq!(&b[20..24], &[1, 2, 3, 4]);
        let mut r = sample(Opcode::from_u8(0x17).unwrap(), 4);
        r.invalidate_rkey = Some(0x0a0b_0c0d);
        let b = emit(&r);
        assert_eq!(&b[12..16], &[0x0a, 0x0b, 0x0c, 0x0d]);
        assert_eq!(b.len(), 20);
    }

    #[test]
    fn xrceth_is_a_24_bit_srq_number_after_the_bth_with_its_reserved_byte_zero() {
        let o = Opcode::from_u8(0xa4).unwrap();
        let mut r = SegmentRepr::new(o, 0x12, 3);
        r.xrc_srqn = Some(0x00_abcd);
        r.payload_len = 4;
        let mut b = emit(&r);
        assert_eq!(&b[12..16], &[0, 0x00, 0xab, 0xcd]);
        assert_eq!(
            SegmentRepr::parse(&Packet::new_checked(&b[..]).unwrap()),
            Ok(r)
        );
        b[12] = 1;
        assert_eq!(
            SegmentRepr::parse(&Packet::new_checked(&b[..]).unwrap()),
            Err(FrameError::Reserved("XRCETH"))
        );
        r.xrc_srqn = Some(0x100_0000);
        assert_eq!(r.check(), Err(FrameError::Inconsistent("XRC SRQ number")));
        r.xrc_srqn = None;
        assert_eq!(r.check(), Err(FrameError::Inconsistent("XRCETH")));
    }

    #[test]
    fn setters_and_getters_agree() {
        let r = sample(Opcode::from_u8(0x0a).unwrap(), 8);
        let mut b = emit(&r);
        let mut p = Packet::new_checked(&mut b[..]).unwrap();
        p.set_psn(0x1234);
        p.set_dest_qpn(0x77);
        p.set_ack_req(false);
        p.set_solicited(false);
        p.set_migration(true);
        p.set_pkey(0xffff);
        p.payload_mut().copy_from_slice(&[9; 8]);
        p.ext_mut(ExtHeader::Reth).unwrap()[0] = 0x11;
        assert!(p.ext_mut(ExtHeader::Aeth).is_none());
        let back = SegmentRepr::parse(&p).unwrap();
        assert_eq!(
            (
                back.psn,
                back.dest_qpn,
                back.ack_req,
                back.solicited,
                back.migration
            ),
            (0x1234, 0x77, false, false, true)
        );
        assert_eq!(back.reth.unwrap().va >> 56, 0x11);
        assert_eq!(p.payload(), &[9; 8]);
        p.set_tver(1);
        assert_eq!(SegmentRepr::parse(&p), Err(FrameError::TransportVersion(1)));
    }

    #[test]
    fn check_refuses_headers_the_table_does_not_name() {
        let op = Opcode::from_u8(0x04).unwrap();
        let mut r = SegmentRepr::new(op, 1, 1);
        assert_eq!(r.check(), Ok(()));
        r.reth = Some(Reth::default());
        assert_eq!(r.check(), Err(FrameError::Inconsistent("RETH")));
        let r = SegmentRepr::new(Opcode::from_u8(0x11).unwrap(), 1, 1);
        assert_eq!(r.check(), Err(FrameError::Inconsistent("AETH")));
        let mut r = sample(Opcode::from_u8(0x11).unwrap(), 0);
        r.payload_len = 4;
        assert_eq!(r.check(), Err(FrameError::Inconsistent("payload length")));
        let mut r = sample(Opcode::from_u8(0x04).unwrap(), 0);
        r.dest_qpn = 1 << 24;
        assert_eq!(r.check(), Err(FrameError::Inconsistent("destination QPN")));
        let mut r = sample(Opcode::from_u8(0x64).unwrap(), MAX_UD_PAYLOAD + 1);
        assert!(matches!(
            r.check(),
            Err(FrameError::PayloadTooLong { max: 4096, .. })
        ));
        r.payload_len = MAX_UD_PAYLOAD;
        assert_eq!(r.check(), Ok(()));
    }

    #[test]
    fn payload_sizes_follow_the_path_mtu_rules() {
        let at = |v, len| sample(Opcode::from_u8(v).unwrap(), len);
        assert_eq!(at(0x00, 1024).check_pmtu(1024), Ok(()));
        assert!(at(0x00, 1020).check_pmtu(1024).is_err());
        assert!(at(0x0e, 2048).check_pmtu(1024).is_err());
        assert_eq!(at(0x02, 1).check_pmtu(1024), Ok(()));
        assert_eq!(
            at(0x08, 0).check_pmtu(1024),
            Err(FrameError::Pmtu {
                opcode: 0x08,
                len: 0,
                pmtu: 1024
            })
        );
        assert_eq!(at(0x04, 0).check_pmtu(256), Ok(()));
        assert!(at(0x64, 4096).check_pmtu(2048).is_err());
        assert_eq!(at(0x0c, 0).check_pmtu(4096), Ok(()));
        assert_eq!(at(0x00, 0).check_pmtu(1000), Err(FrameError::BadPmtu(1000)));
        assert_eq!(at(0x00, 0).check_pmtu(128), Err(FrameError::BadPmtu(128)));
        assert_eq!(at(0x00, MAX_PAYLOAD).check_pmtu(MAX_PAYLOAD), Ok(()));
    }

    #[test]
    fn unchecked_views_of_short_buffers_do_not_panic_on_slices() {
        let p = Packet::new_unchecked(&[0x0au8, 0x30][..]);
        assert_eq!(p.payload(), &[] as &[u8]);
        assert_eq!(p.ext(ExtHeader::Reth), None);
        assert_eq!(p.header_len(), 28);
        let e = Packet::new_unchecked(&[][..]);
        assert_eq!(e.payload(), &[] as &[u8]);
        assert_eq!(
            e.check_len(),
            Err(FrameError::Truncated {
                needed: BTH_LEN,
                got: 0
            })
        );
    }
}
