//! The extension headers that follow a BTH (IB spec vol 1, 9.3) and the GRH that may precede
//! it (8.3), each as an owned value that decodes from and encodes to its exact bytes.
//!
//! Immediate data (ImmDt) and the IETH are a single 32-bit word each and are carried as `u32`
//! in [`SegmentRepr`](super::SegmentRepr).

use super::{
    AETH_LEN, ATOMIC_ACK_ETH_LEN, ATOMIC_ETH_LEN, DETH_LEN, FrameError, GRH_LEN, QPN_MASK,
    RETH_LEN, be24, be32, be64, put24, put32, put64,
};

/// RDMA extended transport header: where a WRITE or READ lands.
///
/// Bytes: virtual address (64) | R_Key (32) | DMA length (32).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Hash)]
pub struct Reth {
    /// Virtual address in the responder's memory region.
    pub va: u64,
    /// Remote key of that region.
    pub rkey: u32,
    /// Length of the whole message in bytes (not only this packet's).
    pub dma_len: u32,
}

impl Reth {
    /// Decodes the header.
    pub fn parse(b: &[u8; RETH_LEN]) -> Self {
        Reth {
            va: be64(b, 0),
            rkey: be32(b, 8),
            dma_len: be32(b, 12),
        }
    }

    /// Encodes the header.
    pub fn to_bytes(&self) -> [u8; RETH_LEN] {
        let mut b = [0; RETH_LEN];
        put64(&mut b, 0, self.va);
        put32(&mut b, 8, self.rkey);
        put32(&mut b, 12, self.dma_len);
        b
    }
}

/// A NAK code: the low five bits of a NAK syndrome.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum NakCode {
    /// The request's PSN was not the expected one (the requester resends from the expected).
    PsnSequenceError = 0,
    /// The request is malformed or not supported by the responder QP.
    InvalidRequest = 1,
    /// R_Key, bounds or access rights failed.
    RemoteAccessError = 2,
    /// The responder failed to carry out a valid request.
    RemoteOperationalError = 3,
    /// Invalid RD request (a reliable-datagram code, decoded for completeness).
    InvalidRdRequest = 4,
}

/// The AETH syndrome: an ACK with its credit count, an RNR NAK with its timer, or a NAK.
///
/// Byte: reserved (1, zero) | kind (2: `00` ACK, `01` RNR NAK, `11` NAK; `10` is reserved) |
/// value (5).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Syndrome {
    /// Positive acknowledgement; `credits` (0..=31) is the end-to-end credit code, 31 meaning
    /// none is advertised.
    Ack {
        /// Credit code, 5 bits.
        credits: u8,
    },
    /// Receiver not ready: no receive WQE; retry after the `timer` code's delay (0..=31, the
    /// IB spec's RNR NAK timer table, as `min_rnr_timer`).
    RnrNak {
        /// RNR NAK timer code, 5 bits.
        timer: u8,
    },
    /// Negative acknowledgement.
    Nak(NakCode),
}

impl Default for Syndrome {
    fn default() -> Self {
        Syndrome::Ack { credits: 0 }
    }
}

impl Syndrome {
    /// Decodes the syndrome byte: a set reserved bit, the reserved kind `10` and NAK codes
    /// above 4 are errors.
    pub fn from_u8(v: u8) -> Result<Self, FrameError> {
        let value = v & 0x1f;
        match v >> 5 {
            0b000 => Ok(Syndrome::Ack { credits: value }),
            0b001 => Ok(Syndrome::RnrNak { timer: value }),
            0b011 => Ok(Syndrome::Nak(match value {
                0 => NakCode::PsnSequenceError,
                1 => NakCode::InvalidRequest,
                2 => NakCode::RemoteAccessError,
                3 => NakCode::RemoteOperationalError,
                4 => NakCode::InvalidRdRequest,
                _ => return Err(FrameError::Syndrome(v)),
            })),
            _ => Err(FrameError::Syndrome(v)),
        }
    }

    /// Encodes the syndrome byte (values above five bits are cut; `SegmentRepr::check`
    /// refuses them first).
    pub fn to_u8(self) -> u8 {
        match self {
            Syndrome::Ack { credits } => credits & 0x1f,
            Syndrome::RnrNak { timer } => 0x20 | (timer & 0x1f),
            Syndrome::Nak(code) => 0x60 | code as u8,
        }
    }

    /// Whether its 5-bit value fits.
    pub fn is_valid(self) -> bool {
        match self {
            Syndrome::Ack { credits: v } | Syndrome::RnrNak { timer: v } => v <= 0x1f,
            Syndrome::Nak(_) => true,
        }
    }
}

/// ACK extended transport header.
///
/// Bytes: syndrome (8) | MSN (24).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Hash)]
pub struct Aeth {
    /// ACK, RNR NAK or NAK.
    pub syndrome: Syndrome,
    /// Message sequence number: how many messages the responder completed (24 bits).
    pub msn: u32,
}

impl Aeth {
    /// Decodes the header; a reserved syndrome is an error.
    pub fn parse(b: &[u8; AETH_LEN]) -> Result<Self, FrameError> {
        Ok(Aeth {
            syndrome: Syndrome::from_u8(b[0])?,
            msn: be24(b, 1),
        })
    }

    /// Encodes the header.
    pub fn to_bytes(&self) -> [u8; AETH_LEN] {
        let mut b = [0; AETH_LEN];
        b[0] = self.syndrome.to_u8();
        put24(&mut b, 1, self.msn);
        b
    }
}

/// Atomic extended transport header of a CmpSwap or FetchAdd.
///
/// Bytes: virtual address (64) | R_Key (32) | swap or add data (64) | compare data (64).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Hash)]
pub struct AtomicEth {
    /// Address of the 8-byte target (its alignment is the responder's check, not a framing
    /// rule: a misaligned one gets a NAK, not a closed link).
    pub va: u64,
    /// Remote key.
    pub rkey: u32,
    /// The value to swap in (CmpSwap) or to add (FetchAdd).
    pub swap_add: u64,
    /// The value to compare with (CmpSwap; zero and ignored for FetchAdd).
    pub compare: u64,
}

impl AtomicEth {
    /// Decodes the header.
    pub fn parse(b: &[u8; ATOMIC_ETH_LEN]) -> Self {
        AtomicEth {
            va: be64(b, 0),
            rkey: be32(b, 8),
            swap_add: be64(b, 12),
            compare: be64(b, 20),
        }
    }

    /// Encodes the header.
    pub fn to_bytes(&self) -> [u8; ATOMIC_ETH_LEN] {
        let mut b = [0; ATOMIC_ETH_LEN];
        put64(&mut b, 0, self.va);
        put32(&mut b, 8, self.rkey);
        put64(&mut b, 12, self.swap_add);
        put64(&mut b, 20, self.compare);
        b
    }
}

/// Atomic acknowledge extended transport header: the target's value before the operation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Hash)]
pub struct AtomicAckEth {
    /// Original remote data (64).
    pub orig: u64,
}

impl AtomicAckEth {
    /// Decodes the header.
    pub fn parse(b: &[u8; ATOMIC_ACK_ETH_LEN]) -> Self {
        AtomicAckEth { orig: be64(b, 0) }
    }

    /// Encodes the header.
    pub fn to_bytes(&self) -> [u8; ATOMIC_ACK_ETH_LEN] {
        self.orig.to_be_bytes()
    }
}

/// Datagram extended transport header of a UD packet.
///
/// Bytes: Q_Key (32) | reserved (8, zero) | source QP (24).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Hash)]
pub struct Deth {
    /// Queue key the destination QP must hold.
    pub qkey: u32,
    /// The sending QP's number on the sending host (24 bits).
    pub src_qpn: u32,
}

impl Deth {
    /// Decodes the header; a nonzero reserved byte is an error.
    pub fn parse(b: &[u8; DETH_LEN]) -> Result<Self, FrameError> {
        if b[4] != 0 {
            return Err(FrameError::Reserved("DETH"));
        }
        Ok(Deth {
            qkey: be32(b, 0),
            src_qpn: be24(b, 5),
        })
    }

    /// Encodes the header.
    pub fn to_bytes(&self) -> [u8; DETH_LEN] {
        let mut b = [0; DETH_LEN];
        put32(&mut b, 0, self.qkey);
        put24(&mut b, 5, self.src_qpn & QPN_MASK);
        b
    }
}

/// The GRH's IP version field.
pub const GRH_IPVER: u8 = 6;
/// The GRH's next-header value for an IBA transport header.
pub const GRH_NEXT_HEADER: u8 = 0x1b;

/// Global route header of a UD segment: what the destination writes into the first 40 bytes
/// of the receive buffer (`IBV_WC_GRH`).
///
/// Bytes as IB spec 8.3: IPVer (4, = 6) | TClass (8) | FlowLabel (20) | PayLen (16) |
/// NxtHdr (8, = 0x1b) | HopLmt (8) | SGID (128) | DGID (128). PayLen counts the bytes of the
/// frame after the GRH (BTH to pad; there is no ICRC) and is checked against them; version
/// and next header must be the constants.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Hash)]
pub struct GrhRepr {
    /// Traffic class, from the sender's address handle.
    pub traffic_class: u8,
    /// Flow label (20 bits).
    pub flow_label: u32,
    /// Hop limit.
    pub hop_limit: u8,
    /// Source GID: the sending vRNIC's.
    pub sgid: [u8; 16],
    /// Destination GID, as the sender's address handle names it.
    pub dgid: [u8; 16],
}

/// Largest flow label (20 bits).
pub const FLOW_LABEL_MASK: u32 = 0xf_ffff;

impl GrhRepr {
    /// Decodes the header of a frame in which `following` bytes come after it.
    pub fn parse(b: &[u8; GRH_LEN], following: usize) -> Result<Self, FrameError> {
        let word = be32(b, 0);
        if (word >> 28) as u8 != GRH_IPVER {
            return Err(FrameError::Grh("IP version"));
        }
        if b[6] != GRH_NEXT_HEADER {
            return Err(FrameError::Grh("next header"));
        }
        if usize::from(u16::from_be_bytes([b[4], b[5]])) != following {
            return Err(FrameError::Grh("payload length"));
        }
        let mut sgid = [0; 16];
        sgid.copy_from_slice(&b[8..24]);
        let mut dgid = [0; 16];
        dgid.copy_from_slice(&b[24..40]);
        Ok(GrhRepr {
            traffic_class: (word >> 20) as u8,
            flow_label: word & FLOW_LABEL_MASK,
            hop_limit: b[7],
            sgid,
            dgid,
        })
    }

    /// Encodes the header for a frame in which `following` bytes come after it (a UD segment
    /// is far below 64 KiB; `FrameRepr::check` makes sure).
    pub fn to_bytes(&self, following: usize) -> [u8; GRH_LEN] {
        let mut b = [0; GRH_LEN];
        let word = (u32::from(GRH_IPVER) << 28)
            | (u32::from(self.traffic_class) << 20)
            | (self.flow_label & FLOW_LABEL_MASK);
        put32(&mut b, 0, word);
        b[4..6].copy_from_slice(&u16::try_from(following).unwrap_or(u16::MAX).to_be_bytes());
        b[6] = GRH_NEXT_HEADER;
        b[7] = self.hop_limit;
        b[8..24].copy_from_slice(&self.sgid);
        b[24..40].copy_from_slice(&self.dgid);
        b
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reth_bytes_are_va_rkey_length_big_endian() {
        let r = Reth {
            va: 0x0102_0304_0506_0708,
            rkey: 0x0a0b_0c0d,
            dma_len: 0x0000_1000,
        };
        let b = [
            1, 2, 3, 4, 5, 6, 7, 8, 0x0a, 0x0b, 0x0c, 0x0d, 0, 0, 0x10, 0,
        ];
        assert_eq!(r.to_bytes(), b);
        assert_eq!(Reth::parse(&b), r);
    }

    #[test]
    fn aeth_bytes_are_syndrome_then_msn() {
        let cases = [
            (Syndrome::Ack { credits: 31 }, 0x1f),
            (Syndrome::RnrNak { timer: 14 }, 0x2e),
            (Syndrome::Nak(NakCode::PsnSequenceError), 0x60),
            (Syndrome::Nak(NakCode::InvalidRequest), 0x61),
            (Syndrome::Nak(NakCode::RemoteAccessError), 0x62),
            (Syndrome::Nak(NakCode::RemoteOperationalError), 0x63),
            (Syndrome::Nak(NakCode::InvalidRdRequest), 0x64),
        ];
        for (syndrome, byte) in cases {
            let a = Aeth {
                syndrome,
                msn: 0x12_3456,
            };
            assert_eq!(a.to_bytes(), [byte, 0x12, 0x34, 0x56]);
            assert_eq!(Aeth::parse(&a.to_bytes()), Ok(a));
        }
    }

    #[test]
    fn reserved_syndromes_are_refused() {
        // Reserved top bit, reserved kind 10, NAK codes 5..=31.
        for v in [0x80, 0x9f, 0x40, 0x5f, 0x65, 0x7f] {
            assert_eq!(Syndrome::from_u8(v), Err(FrameError::Syndrome(v)));
        }
        let valid = (0..=255u8)
            .filter(|&v| Syndrome::from_u8(v).is_ok())
            .count();
        assert_eq!(valid, 32 + 32 + 5);
        for v in 0..=255u8 {
            if let Ok(s) = Syndrome::from_u8(v) {
                assert_eq!(s.to_u8(), v);
            }
        }
    }

    #[test]
    fn atomic_eth_bytes_are_va_rkey_swap_compare() {
        let a = AtomicEth {
            va: 0x1000,
            rkey: 0x1234_5678,
            swap_add: 0x0102_0304_0506_0708,
            compare: 0x1112_1314_1516_1718,
        };
        let b = [
            0, 0, 0, 0, 0, 0, 0x10, 0, 0x12, 0x34, 0x56, 0x78, 1, 2, 3, 4, 5, 6, 7, 8, 0x11, 0x12,
            0x13, 0x14, 0x15, 0x16, 0x17, 0x18,
        ];
        assert_eq!(a.to_bytes(), b);
        assert_eq!(AtomicEth::parse(&b), a);
        let ack = AtomicAckEth { orig: 0xfedc_ba98 };
        assert_eq!(ack.to_bytes(), [0, 0, 0, 0, 0xfe, 0xdc, 0xba, 0x98]);
        assert_eq!(AtomicAckEth::parse(&ack.to_bytes()), ack);
    }

    #[test]
    fn deth_bytes_are_qkey_reserved_src_qp() {
        let d = Deth {
            qkey: 0x1111_1111,
            src_qpn: 0xab_cdef,
        };
        let b = [0x11, 0x11, 0x11, 0x11, 0, 0xab, 0xcd, 0xef];
        assert_eq!(d.to_bytes(), b);
        assert_eq!(Deth::parse(&b), Ok(d));
        let mut bad = b;
        bad[4] = 1;
        assert_eq!(Deth::parse(&bad), Err(FrameError::Reserved("DETH")));
    }

    #[test]
    fn grh_bytes_follow_ib_8_3() {
        let g = GrhRepr {
            traffic_class: 0xab,
            flow_label: 0xc_def0,
            hop_limit: 64,
            sgid: [1; 16],
            dgid: [2; 16],
        };
        let b = g.to_bytes(0x0123);
        assert_eq!(&b[..8], &[0x6a, 0xbc, 0xde, 0xf0, 0x01, 0x23, 0x1b, 64]);
        assert_eq!(&b[8..24], &[1; 16]);
        assert_eq!(&b[24..], &[2; 16]);
        assert_eq!(GrhRepr::parse(&b, 0x123), Ok(g));
        assert_eq!(
            GrhRepr::parse(&b, 0x124),
            Err(FrameError::Grh("payload length"))
        );
        let mut v4 = b;
        v4[0] = 0x4a;
        assert_eq!(
            GrhRepr::parse(&v4, 0x123),
            Err(FrameError::Grh("IP version"))
        );
        let mut udp = b;
        udp[6] = 17;
        assert_eq!(
            GrhRepr::parse(&udp, 0x123),
            Err(FrameError::Grh("next header"))
        );
    }
}
