//! vRNIC and address announcements between daemons: announce control frames built from
//! entries, as many frames as they need. The body's format and its strict decoder are
//! `vrnic-wire`'s ([`AnnounceEntry`]); what a decoded entry may claim (its host's share of LIDs,
//! GIDs and addresses) and how many a host may announce is checked by `peers/share.rs` before
//! anything is recorded.

use vrnic_wire::frame::{AnnounceEntry, ControlKind, LinkError, MAX_PAYLOAD};

/// One announcement.
pub(super) type Entry<'a> = AnnounceEntry<'a>;

/// Appends announce frames carrying `entries` (as many frames as they need).
pub(super) fn announce(out: &mut Vec<u8>, entries: &[Entry]) {
    let mut body = Vec::new();
    for e in entries {
        if e.check().is_err() {
            // Local names and addresses are checked where they are made: nothing to send.
            continue;
        }
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

/// Decodes a body whole: every entry, or the first error.
pub(super) fn parse(body: &[u8]) -> Result<Vec<Entry<'_>>, LinkError> {
    AnnounceEntry::check_body(body)?;
    AnnounceEntry::iter(body).collect()
}

#[cfg(test)]
mod tests {
    use std::net::Ipv4Addr;

    use super::*;

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
