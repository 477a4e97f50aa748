//! vRNIC and address announcements between daemons: the body of an announce control frame.
//!
//! A body is a run of entries, each an op byte and its fields (integers big-endian):
//!
//! | op | entry | fields |
//! |---|---|---|
//! | 1 | a vRNIC added | LID 2, GID 16, virtual IPv4 4, name (length 1, bytes), group (length 1, bytes) |
//! | 2 | a vRNIC removed | LID 2, GID 16 |
//! | 3 | an address of the host | zero 2, IP 16 (an IPv4 one mapped) |
//!
//! Names are 1 to 63 bytes of `[A-Za-z0-9_-]`. Decoding is strict: a body that does not
//! decode whole closes the link, as any malformed frame does. What a decoded entry may claim
//! (its host's share of LIDs, GIDs and addresses) and how many a host may announce is checked
//! by `peers/share.rs` before anything is recorded.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use vrnic_wire::frame::{ControlKind, MAX_PAYLOAD, valid_name};

/// One announcement.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Entry<'a> {
    Added {
        lid: u16,
        gid: [u8; 16],
        vip: Ipv4Addr,
        name: &'a str,
        group: &'a str,
    },
    Removed {
        lid: u16,
        gid: [u8; 16],
    },
    Addr(IpAddr),
}

impl Entry<'_> {
    fn emit(&self, out: &mut Vec<u8>) {
        match self {
            Entry::Added {
                lid,
                gid,
                vip,
                name,
                group,
            } => {
                out.push(1);
                out.extend_from_slice(&lid.to_be_bytes());
                out.extend_from_slice(gid);
                out.extend_from_slice(&vip.octets());
                for s in [name, group] {
                    out.push(s.len() as u8);
                    out.extend_from_slice(s.as_bytes());
                }
            }
            Entry::Removed { lid, gid } => {
                out.push(2);
                out.extend_from_slice(&lid.to_be_bytes());
                out.extend_from_slice(gid);
            }
            Entry::Addr(ip) => {
                let v6 = match ip {
                    IpAddr::V4(v4) => v4.to_ipv6_mapped(),
                    IpAddr::V6(v6) => *v6,
                };
                out.push(3);
                out.extend_from_slice(&[0, 0]);
                out.extend_from_slice(&v6.octets());
            }
        }
    }
}

/// Appends announce frames carrying `entries` (as many frames as they need).
pub(super) fn announce(out: &mut Vec<u8>, entries: &[Entry]) {
    let mut body = Vec::new();
    for e in entries {
        let mark = body.len();
        e.emit(&mut body);
        if body.len() > MAX_PAYLOAD {
            let rest = body.split_off(mark);
            super::peers::control(out, ControlKind::Announce, &body);
            body = rest;
        }
    }
    if !body.is_empty() {
        super::peers::control(out, ControlKind::Announce, &body);
    }
}

/// Decodes a body whole; `None` if any entry is malformed.
pub(super) fn parse(mut b: &[u8]) -> Option<Vec<Entry<'_>>> {
    let mut out = Vec::new();
    while let Some((&op, rest)) = b.split_first() {
        let (lid, rest) = rest.split_first_chunk::<2>()?;
        let (g, rest) = rest.split_first_chunk::<16>()?;
        let lid = u16::from_be_bytes(*lid);
        b = rest;
        out.push(match op {
            1 => {
                let (vip, rest) = b.split_first_chunk::<4>()?;
                let (name, rest) = take_name(rest)?;
                let (group, rest) = take_name(rest)?;
                b = rest;
                Entry::Added {
                    lid,
                    gid: *g,
                    vip: Ipv4Addr::from(*vip),
                    name,
                    group,
                }
            }
            2 => Entry::Removed { lid, gid: *g },
            3 if lid == 0 => {
                let ip = IpAddr::V6(Ipv6Addr::from(*g)).to_canonical();
                // A loopback address is a host's own only as its peer-link address: whether it
                // is is `peers/share.rs`'s to say, not the codec's.
                if ip.is_unspecified() || ip.is_multicast() {
                    return None;
                }
                Entry::Addr(ip)
            }
            _ => return None,
        });
    }
    Some(out)
}

/// A length-prefixed name and what follows it.
fn take_name(b: &[u8]) -> Option<(&str, &[u8])> {
    let (&n, rest) = b.split_first()?;
    let (s, rest) = rest.split_at_checked(n as usize)?;
    if !valid_name(s) {
        return None;
    }
    Some((std::str::from_utf8(s).ok()?, rest))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn entries_round_trip_and_malformed_bodies_are_refused() {
        let entries = [
            Entry::Added {
                lid: 7,
                gid: [3; 16],
                vip: Ipv4Addr::new(10, 9, 0, 1),
                name: "a1",
                group: "red",
            },
            Entry::Removed {
                lid: 8,
                gid: [4; 16],
            },
            Entry::Addr("10.77.0.2".parse().unwrap()),
        ];
        let mut body = Vec::new();
        for e in &entries {
            e.emit(&mut body);
        }
        assert_eq!(parse(&body).unwrap(), entries);
        for n in 1..body.len() {
            if n == 1 + 2 + 16 + 4 + 3 + 4 || n == 1 + 2 + 16 + 4 + 3 + 4 + 19 {
                continue; // whole entries
            }
            assert!(parse(&body[..n]).is_none(), "cut at {n}");
        }
        let mut bad = body.clone();
        bad[1 + 2 + 16 + 4 + 1] = b' ';
        assert!(parse(&bad).is_none(), "a name with a space");
        let mut bad = body.clone();
        bad[1 + 2 + 16 + 4] = 0;
        assert!(parse(&bad).is_none(), "an empty name");
        let mut loopback = Vec::new();
        Entry::Addr("127.0.0.2".parse().unwrap()).emit(&mut loopback);
        assert_eq!(
            parse(&loopback).unwrap(),
            [Entry::Addr("127.0.0.2".parse().unwrap())],
            "a loopback peer-link address decodes (the share rule decides)"
        );
        let mut unspecified = Vec::new();
        Entry::Addr("0.0.0.0".parse().unwrap()).emit(&mut unspecified);
        assert!(parse(&unspecified).is_none());
        assert!(parse(&[9; 19]).is_none(), "unknown op");
    }

    #[test]
    fn many_entries_split_into_frames_that_fit() {
        let names: Vec<String> = (0..3000).map(|i| format!("vnic-{i:0>58}")).collect();
        let entries: Vec<Entry> = names
            .iter()
            .map(|n| Entry::Added {
                lid: 1,
                gid: [0; 16],
                vip: Ipv4Addr::new(10, 0, 0, 1),
                name: n,
                group: n,
            })
            .collect();
        let mut out = Vec::new();
        announce(&mut out, &entries);
        let mut seen = 0;
        let mut at = 0;
        while at < out.len() {
            let len = u32::from_be_bytes([0, out[at + 5], out[at + 6], out[at + 7]]) as usize;
            let body = &out[at + vrnic_wire::frame::LINK_HEADER_LEN..at + len];
            assert!(body.len() <= MAX_PAYLOAD);
            seen += parse(body).unwrap().len();
            at += len;
        }
        assert_eq!(seen, entries.len());
    }
}
