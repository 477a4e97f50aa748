//! BTH opcodes (IB spec vol 1, 9.2.1) and the opcode table: which extension headers
//! follow the BTH, in which order, and whether a payload follows them.

/// The payload (and RETH DMA length) of an ATOMIC WRITE.
pub const ATOMIC_WRITE_LEN: usize = 8;

/// The transport service of an opcode: its top three bits.
///
/// Reliable datagram (`010`) and the other codes are not implemented and do not decode.
/// XRC (`101`) has RC's operations; its requests carry an XRCETH right after the BTH.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum Transport {
    /// Reliable connected (`000`).
    Rc = 0x00,
    /// Unreliable connected (`001`).
    Uc = 0x20,
    /// Unreliable datagram (`011`).
    Ud = 0x60,
    /// Extended reliable connected (`101`).
    Xrc = 0xa0,
}

impl Transport {
    /// Decodes the top three bits of an opcode.
    pub const fn from_opcode(v: u8) -> Option<Self> {
        match v & 0xe0 {
            0x00 => Some(Self::Rc),
            0x20 => Some(Self::Uc),
            0x60 => Some(Self::Ud),
            0xa0 => Some(Self::Xrc),
            _ => None,
        }
    }
}

/// The operation of an opcode: its low five bits, named as in the IB spec.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum Op {
    /// `SEND First`
    SendFirst = 0x00,
    /// `SEND Middle`
    SendMiddle = 0x01,
    /// `SEND Last`
    SendLast = 0x02,
    /// `SEND Last with Immediate`
    SendLastWithImm = 0x03,
    /// `SEND Only`
    SendOnly = 0x04,
    /// `SEND Only with Immediate`
    SendOnlyWithImm = 0x05,
    /// `RDMA WRITE First`
    RdmaWriteFirst = 0x06,
    /// `RDMA WRITE Middle`
    RdmaWriteMiddle = 0x07,
    /// `RDMA WRITE Last`
    RdmaWriteLast = 0x08,
    /// `RDMA WRITE Last with Immediate`
    RdmaWriteLastWithImm = 0x09,
    /// `RDMA WRITE Only`
    RdmaWriteOnly = 0x0a,
    /// `RDMA WRITE Only with Immediate`
    RdmaWriteOnlyWithImm = 0x0b,
    /// `RDMA READ Request`
    RdmaReadRequest = 0x0c,
    /// `RDMA READ response First`
    RdmaReadResponseFirst = 0x0d,
    /// `RDMA READ response Middle`
    RdmaReadResponseMiddle = 0x0e,
    /// `RDMA READ response Last`
    RdmaReadResponseLast = 0x0f,
    /// `RDMA READ response Only`
    RdmaReadResponseOnly = 0x10,
    /// `Acknowledge`
    Acknowledge = 0x11,
    /// `ATOMIC Acknowledge`
    AtomicAcknowledge = 0x12,
    /// `CmpSwap`
    CompareSwap = 0x13,
    /// `FetchAdd`
    FetchAdd = 0x14,
    /// `SEND Last with Invalidate`
    SendLastWithInvalidate = 0x16,
    /// `SEND Only with Invalidate`
    SendOnlyWithInvalidate = 0x17,
    /// `ATOMIC WRITE` (IBA 1.5): 8 bytes of payload stored at the RETH's address as one
    /// atomic write.
    AtomicWrite = 0x1d,
}

/// Where a packet sits in its message, which decides its payload size under a path MTU.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Position {
    /// The first packet of a message of several: exactly one PMTU of payload.
    First,
    /// A middle packet: exactly one PMTU.
    Middle,
    /// The last packet of a message of several: 1 to PMTU bytes.
    Last,
    /// The whole message in one packet: 0 to PMTU bytes (no payload for requests such as
    /// READ or atomics, and for acknowledgements).
    Only,
}

impl Op {
    /// Decodes the low five bits of an opcode; `0x15`, `0x18..=0x1c` (FLUSH among them, not
    /// implemented) and `0x1e..=0x1f` are reserved here.
    pub const fn from_bits(v: u8) -> Option<Self> {
        use Op::*;
        Some(match v & 0x1f {
            0x00 => SendFirst,
            0x01 => SendMiddle,
            0x02 => SendLast,
            0x03 => SendLastWithImm,
            0x04 => SendOnly,
            0x05 => SendOnlyWithImm,
            0x06 => RdmaWriteFirst,
            0x07 => RdmaWriteMiddle,
            0x08 => RdmaWriteLast,
            0x09 => RdmaWriteLastWithImm,
            0x0a => RdmaWriteOnly,
            0x0b => RdmaWriteOnlyWithImm,
            0x0c => RdmaReadRequest,
            0x0d => RdmaReadResponseFirst,
            0x0e => RdmaReadResponseMiddle,
            0x0f => RdmaReadResponseLast,
            0x10 => RdmaReadResponseOnly,
            0x11 => Acknowledge,
            0x12 => AtomicAcknowledge,
            0x13 => CompareSwap,
            0x14 => FetchAdd,
            0x16 => SendLastWithInvalidate,
            0x17 => SendOnlyWithInvalidate,
            0x1d => AtomicWrite,
            _ => return None,
        })
    }

    /// Whether the transport offers this operation: RC and XRC all of them, UC SEND and RDMA
    /// WRITE, UD only `SEND Only` (with or without immediate).
    pub const fn exists_on(self, transport: Transport) -> bool {
        match transport {
            Transport::Rc | Transport::Xrc => true,
            Transport::Uc => (self as u8) <= Op::RdmaWriteOnlyWithImm as u8,
            Transport::Ud => matches!(self, Op::SendOnly | Op::SendOnlyWithImm),
        }
    }

    /// Where a packet of this operation sits in its message.
    pub const fn position(self) -> Position {
        use Op::*;
        match self {
            SendFirst | RdmaWriteFirst | RdmaReadResponseFirst => Position::First,
            SendMiddle | RdmaWriteMiddle | RdmaReadResponseMiddle => Position::Middle,
            SendLast
            | SendLastWithImm
            | SendLastWithInvalidate
            | RdmaWriteLast
            | RdmaWriteLastWithImm
            | RdmaReadResponseLast => Position::Last,
            _ => Position::Only,
        }
    }

    /// Whether a packet of this operation belongs to a message that completes a receive at
    /// the responder: a SEND (any packet), or the last packet of an RDMA WRITE with
    /// immediate data.
    pub const fn takes_receive(self) -> bool {
        use Op::*;
        matches!(
            self,
            SendFirst
                | SendMiddle
                | SendLast
                | SendLastWithImm
                | SendLastWithInvalidate
                | SendOnly
                | SendOnlyWithImm
                | SendOnlyWithInvalidate
                | RdmaWriteLastWithImm
                | RdmaWriteOnlyWithImm
        )
    }

    /// Whether a responder sends it (READ responses and acknowledgements) rather than a
    /// requester.
    pub const fn is_response(self) -> bool {
        matches!(
            self,
            Op::RdmaReadResponseFirst
                | Op::RdmaReadResponseMiddle
                | Op::RdmaReadResponseLast
                | Op::RdmaReadResponseOnly
                | Op::Acknowledge
                | Op::AtomicAcknowledge
        )
    }
}

/// An extension header that may follow the BTH.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ExtHeader {
    /// Datagram extended transport header (UD): Q_Key, source QP.
    Deth,
    /// RDMA extended transport header: virtual address, R_Key, DMA length.
    Reth,
    /// ACK extended transport header: syndrome, MSN.
    Aeth,
    /// Atomic extended transport header: address, R_Key, swap/add and compare data.
    AtomicEth,
    /// Atomic acknowledge extended transport header: the original remote data.
    AtomicAckEth,
    /// Immediate data.
    ImmDt,
    /// Invalidate extended transport header: the R_Key to invalidate.
    Ieth,
    /// XRC extended transport header: the XRC SRQ number at the target (XRC requests).
    XrcEth,
}

impl ExtHeader {
    /// Its size in bytes.
    pub const fn size(self) -> usize {
        match self {
            ExtHeader::Deth => super::DETH_LEN,
            ExtHeader::Reth => super::RETH_LEN,
            ExtHeader::Aeth => super::AETH_LEN,
            ExtHeader::AtomicEth => super::ATOMIC_ETH_LEN,
            ExtHeader::AtomicAckEth => super::ATOMIC_ACK_ETH_LEN,
            ExtHeader::ImmDt => super::IMM_DT_LEN,
            ExtHeader::Ieth => super::IETH_LEN,
            ExtHeader::XrcEth => super::XRCETH_LEN,
        }
    }
}

/// A BTH opcode that exists: a transport and an operation it offers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Opcode {
    transport: Transport,
    op: Op,
}

impl Opcode {
    /// The opcode of `op` on `transport`, if the transport offers it.
    pub const fn new(transport: Transport, op: Op) -> Option<Self> {
        if op.exists_on(transport) {
            Some(Opcode { transport, op })
        } else {
            None
        }
    }

    /// Decodes a BTH opcode byte; reserved and unimplemented codes (RD, CNP, vendor) and
    /// operations their transport lacks (a UC READ, a UD WRITE) are `None`.
    pub const fn from_u8(v: u8) -> Option<Self> {
        match (Transport::from_opcode(v), Op::from_bits(v)) {
            (Some(transport), Some(op)) => Self::new(transport, op),
            _ => None,
        }
    }

    /// The opcode byte.
    pub const fn to_u8(self) -> u8 {
        self.transport as u8 | self.op as u8
    }

    /// The transport service.
    pub const fn transport(self) -> Transport {
        self.transport
    }

    /// The operation.
    pub const fn op(self) -> Op {
        self.op
    }

    /// The opcode table: the extension headers that follow the BTH, in wire order. An XRC
    /// request has the XRCETH first, then what its RC twin has; XRC responses are RC's.
    pub const fn ext_headers(self) -> &'static [ExtHeader] {
        use ExtHeader::*;
        use Op::*;
        match (self.transport, self.op) {
            (Transport::Xrc, SendFirst | SendMiddle | SendLast | SendOnly) => &[XrcEth],
            (Transport::Xrc, SendLastWithImm | SendOnlyWithImm) => &[XrcEth, ImmDt],
            (Transport::Xrc, RdmaWriteFirst | RdmaWriteOnly | RdmaReadRequest) => &[XrcEth, Reth],
            (Transport::Xrc, RdmaWriteMiddle | RdmaWriteLast) => &[XrcEth],
            (Transport::Xrc, RdmaWriteLastWithImm) => &[XrcEth, ImmDt],
            (Transport::Xrc, RdmaWriteOnlyWithImm) => &[XrcEth, Reth, ImmDt],
            (Transport::Xrc, CompareSwap | FetchAdd) => &[XrcEth, AtomicEth],
            (Transport::Xrc, AtomicWrite) => &[XrcEth, Reth],
            (Transport::Xrc, SendLastWithInvalidate | SendOnlyWithInvalidate) => &[XrcEth, Ieth],
            (Transport::Ud, SendOnly) => &[Deth],
            (Transport::Ud, SendOnlyWithImm) => &[Deth, ImmDt],
            (_, SendFirst | SendMiddle | SendLast | SendOnly) => &[],
            (_, SendLastWithImm | SendOnlyWithImm) => &[ImmDt],
            (_, RdmaWriteFirst | RdmaWriteOnly) => &[Reth],
            (_, RdmaWriteMiddle | RdmaWriteLast) => &[],
            (_, RdmaWriteLastWithImm) => &[ImmDt],
            (_, RdmaWriteOnlyWithImm) => &[Reth, ImmDt],
            (_, RdmaReadRequest | AtomicWrite) => &[Reth],
            (_, RdmaReadResponseFirst | RdmaReadResponseLast | RdmaReadResponseOnly) => &[Aeth],
            (_, RdmaReadResponseMiddle) => &[],
            (_, Acknowledge) => &[Aeth],
            (_, AtomicAcknowledge) => &[Aeth, AtomicAckEth],
            (_, CompareSwap | FetchAdd) => &[AtomicEth],
            (_, SendLastWithInvalidate | SendOnlyWithInvalidate) => &[Ieth],
        }
    }

    /// The opcode table: whether a payload follows the extension headers. READ requests,
    /// atomics and acknowledgements carry none.
    pub const fn has_payload(self) -> bool {
        !matches!(
            self.op,
            Op::RdmaReadRequest
                | Op::Acknowledge
                | Op::AtomicAcknowledge
                | Op::CompareSwap
                | Op::FetchAdd
        )
    }

    /// The one payload length the opcode allows, where it allows one only: 8 for ATOMIC
    /// WRITE (whose RETH's DMA length is 8 too).
    pub const fn fixed_payload(self) -> Option<usize> {
        match self.op {
            Op::AtomicWrite => Some(ATOMIC_WRITE_LEN),
            _ => None,
        }
    }

    /// Bytes of the BTH and the extension headers.
    pub const fn header_len(self) -> usize {
        let hs = self.ext_headers();
        let mut len = super::BTH_LEN;
        let mut i = 0;
        while i < hs.len() {
            len += hs[i].size();
            i += 1;
        }
        len
    }

    /// Where extension header `h` starts, counted from the BTH's first byte; `None` if this
    /// opcode has no such header.
    pub fn ext_offset(self, h: ExtHeader) -> Option<usize> {
        let mut off = super::BTH_LEN;
        for &x in self.ext_headers() {
            if x == h {
                return Some(off);
            }
            off += x.size();
        }
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn opcode_numbers_are_the_ib_specs() {
        let named = [
            (0x00, Transport::Rc, Op::SendFirst),
            (0x04, Transport::Rc, Op::SendOnly),
            (0x05, Transport::Rc, Op::SendOnlyWithImm),
            (0x0a, Transport::Rc, Op::RdmaWriteOnly),
            (0x0c, Transport::Rc, Op::RdmaReadRequest),
            (0x10, Transport::Rc, Op::RdmaReadResponseOnly),
            (0x11, Transport::Rc, Op::Acknowledge),
            (0x12, Transport::Rc, Op::AtomicAcknowledge),
            (0x13, Transport::Rc, Op::CompareSwap),
            (0x14, Transport::Rc, Op::FetchAdd),
            (0x16, Transport::Rc, Op::SendLastWithInvalidate),
            (0x17, Transport::Rc, Op::SendOnlyWithInvalidate),
            (0x1d, Transport::Rc, Op::AtomicWrite),
            (0xbd, Transport::Xrc, Op::AtomicWrite),
            (0x20, Transport::Uc, Op::SendFirst),
            (0x2b, Transport::Uc, Op::RdmaWriteOnlyWithImm),
            (0x64, Transport::Ud, Op::SendOnly),
            (0x65, Transport::Ud, Op::SendOnlyWithImm),
        ];
        for (byte, t, op) in named {
            let o = Opcode::from_u8(byte).unwrap();
            assert_eq!((o.transport(), o.op(), o.to_u8()), (t, op, byte));
            assert_eq!(Opcode::new(t, op), Some(o));
        }
    }

    /// A SEND's every packet and a WRITE with immediate's last one complete a receive; no
    /// other request or response does.
    #[test]
    fn sends_and_the_last_packet_of_a_write_with_immediate_take_a_receive() {
        let takes: Vec<u8> = (0..=0x1fu8)
            .filter_map(Op::from_bits)
            .filter(|op| op.takes_receive())
            .map(|op| op as u8)
            .collect();
        assert_eq!(
            takes,
            vec![0x00, 0x01, 0x02, 0x03, 0x04, 0x05, 0x09, 0x0b, 0x16, 0x17]
        );
    }

    #[test]
    fn exactly_the_62_implemented_opcodes_decode_and_round_trip() {
        let valid: Vec<u8> = (0..=255u8)
            .filter(|&v| Opcode::from_u8(v).is_some())
            .collect();
        let expected: Vec<u8> = (0x00..=0x14)
            .chain([0x16, 0x17, 0x1d])
            .chain(0x20..=0x2b)
            .chain([0x64, 0x65])
            .chain(0xa0..=0xb4)
            .chain([0xb6, 0xb7, 0xbd])
            .collect();
        assert_eq!(expected.len(), 62);
        assert_eq!(valid, expected);
        for v in valid {
            assert_eq!(Opcode::from_u8(v).unwrap().to_u8(), v);
        }
    }

    #[test]
    fn reserved_rd_and_missing_combinations_do_not_decode() {
        // Reserved RC code, RD SEND Only, UC READ request, UC ACK, UD SEND First, UD WRITE,
        // CNP (RoCE), vendor-defined, RC FLUSH (not implemented), UC and UD ATOMIC WRITE.
        for v in [
            0x15, 0x18, 0x1f, 0x44, 0x2c, 0x31, 0x60, 0x6a, 0x81, 0xb5, 0xb8, 0xc0, 0xff, 0x1c,
            0x3d, 0x7d,
        ] {
            assert_eq!(Opcode::from_u8(v), None, "{v:#04x}");
        }
        assert_eq!(Opcode::new(Transport::Uc, Op::FetchAdd), None);
        assert_eq!(Opcode::new(Transport::Uc, Op::AtomicWrite), None);
        assert_eq!(Opcode::new(Transport::Ud, Op::SendFirst), None);
    }

    #[test]
    fn the_table_orders_headers_as_the_spec() {
        let o = |v| Opcode::from_u8(v).unwrap();
        use ExtHeader::*;
        assert_eq!(o(0x0b).ext_headers(), &[Reth, ImmDt]);
        assert_eq!(o(0x65).ext_headers(), &[Deth, ImmDt]);
        assert_eq!(o(0x12).ext_headers(), &[Aeth, AtomicAckEth]);
        assert_eq!(o(0x13).ext_headers(), &[AtomicEth]);
        assert_eq!(o(0x17).ext_headers(), &[Ieth]);
        assert_eq!(o(0x07).ext_headers(), &[]);
        assert_eq!(o(0x0b).header_len(), 12 + 16 + 4);
        assert_eq!(o(0x65).ext_offset(ImmDt), Some(12 + 8));
        assert_eq!(o(0x65).ext_offset(Reth), None);
        assert!(!o(0x0c).has_payload() && !o(0x11).has_payload() && !o(0x14).has_payload());
        assert!(o(0x0e).has_payload() && o(0x64).has_payload());
        // ATOMIC WRITE: a RETH and exactly 8 bytes of payload.
        assert_eq!(o(0x1d).ext_headers(), &[Reth]);
        assert!(o(0x1d).has_payload());
        assert_eq!(o(0x1d).fixed_payload(), Some(8));
        assert_eq!(o(0x0a).fixed_payload(), None);
        assert_eq!(o(0x1d).op().position(), Position::Only);
        assert!(!o(0x1d).op().takes_receive() && !o(0x1d).op().is_response());
    }

    #[test]
    fn xrc_requests_carry_the_xrceth_first_and_responses_do_not() {
        let o = |v| Opcode::from_u8(v).unwrap();
        use ExtHeader::*;
        assert_eq!(o(0xa4).transport(), Transport::Xrc);
        assert_eq!(o(0xa4).op(), Op::SendOnly);
        assert_eq!(o(0xa4).ext_headers(), &[XrcEth]);
        assert_eq!(o(0xa5).ext_headers(), &[XrcEth, ImmDt]);
        assert_eq!(o(0xaa).ext_headers(), &[XrcEth, Reth]);
        assert_eq!(o(0xab).ext_headers(), &[XrcEth, Reth, ImmDt]);
        assert_eq!(o(0xac).ext_headers(), &[XrcEth, Reth]);
        assert_eq!(o(0xb3).ext_headers(), &[XrcEth, AtomicEth]);
        assert_eq!(o(0xbd).ext_headers(), &[XrcEth, Reth]);
        assert_eq!(o(0xb7).ext_headers(), &[XrcEth, Ieth]);
        assert_eq!(o(0xb1).ext_headers(), &[Aeth]);
        assert_eq!(o(0xb0).ext_headers(), &[Aeth]);
        assert_eq!(o(0xb2).ext_headers(), &[Aeth, AtomicAckEth]);
        assert_eq!(o(0xb3).header_len(), 12 + 4 + 28);
        assert_eq!(o(0xab).ext_offset(Reth), Some(12 + 4));
    }

    #[test]
    fn positions_and_responses() {
        assert_eq!(Op::SendFirst.position(), Position::First);
        assert_eq!(Op::RdmaReadResponseMiddle.position(), Position::Middle);
        assert_eq!(Op::SendLastWithInvalidate.position(), Position::Last);
        assert_eq!(Op::FetchAdd.position(), Position::Only);
        assert!(Op::AtomicAcknowledge.is_response() && !Op::RdmaReadRequest.is_response());
    }
}
