//! What the daemons of a cluster keep in etcd: the key layout and the records' encoding.
//!
//! Every key lives under [`PREFIX`] and is bound to the lease of the daemon that wrote it, so a
//! daemon that dies takes its keys with it when the lease expires:
//!
//! | key | value | what it claims |
//! |---|---|---|
//! | `/vrnic/v1/hosts/<index>` | [`HostRecord`] (JSON) | a host index: the daemon's [`vrnic_proto::HostId`] |
//! | `/vrnic/v1/vnics/<lid>` | [`VnicRecord`] (JSON) | a LID, cluster-wide, and the vRNIC holding it |
//! | `/vrnic/v1/gids/<gid as 32 hex digits>` | the LID | a GID, cluster-wide |
//! | `/vrnic/v1/ips/<group>/<IPv4>` | the LID | a virtual IP within its group |
//!
//! Numbers in keys are decimal without leading zeros. etcd is trusted infrastructure, but what
//! it holds was written by other daemons, so decoding is strict all the same: an unknown
//! field, a key that does not match its record, a name outside `[A-Za-z0-9_-]{1,63}`, an
//! address no vRNIC or host can have is refused, and the caller ignores and logs the record.

use std::net::{IpAddr, Ipv4Addr, SocketAddr};

use serde::{Deserialize, Serialize};

use crate::server::peers::MAX_HOSTS;

/// The prefix of every key.
pub(in crate::server) const PREFIX: &str = "/vrnic/v1/";
/// Host records.
pub(in crate::server) const HOSTS: &str = "/vrnic/v1/hosts/";
/// vRNIC records, by LID.
pub(in crate::server) const VNICS: &str = "/vrnic/v1/vnics/";
/// GID claims.
pub(in crate::server) const GIDS: &str = "/vrnic/v1/gids/";
/// Virtual-IP claims, by group.
pub(in crate::server) const IPS: &str = "/vrnic/v1/ips/";
/// Most addresses a host record lists.
const MAX_ADDRS: usize = 64;
/// The unicast LIDs (`0xc000` and up are multicast).
pub(in crate::server) const LIDS: std::ops::Range<u16> = 1..0xc000;

/// A host: where its daemon takes peer links, and its IP addresses (what rdma_cm resolves to
/// it).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub(in crate::server) struct HostRecord {
    /// Its `--listen` address.
    pub(in crate::server) addr: SocketAddr,
    /// Its IP addresses.
    pub(in crate::server) addrs: Vec<IpAddr>,
}

/// A vRNIC: its host and its addresses.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub(in crate::server) struct VnicRecord {
    /// Its host's index.
    pub(in crate::server) host: u32,
    /// Its name (unique on its host).
    pub(in crate::server) name: String,
    /// Its LID (the key's).
    pub(in crate::server) lid: u16,
    /// Its GID, 32 hex digits.
    pub(in crate::server) gid: String,
    /// Its virtual IP in its group.
    pub(in crate::server) ip: Ipv4Addr,
    /// Its tenants' group.
    pub(in crate::server) group: String,
}

/// A key under [`PREFIX`], decoded.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(in crate::server) enum Key {
    Host(u32),
    Vnic(u16),
    /// A claim key (GID or IP): its record's key says all.
    Claim,
}

impl Key {
    /// Decodes a key; `None` for one this version does not know (or a malformed one).
    pub(in crate::server) fn parse(key: &[u8]) -> Option<Key> {
        let key = std::str::from_utf8(key).ok()?;
        if let Some(n) = key.strip_prefix(HOSTS) {
            let i = number(n)?;
            return (i < u64::from(MAX_HOSTS)).then_some(Key::Host(i as u32));
        }
        if let Some(n) = key.strip_prefix(VNICS) {
            let lid = u16::try_from(number(n)?).ok()?;
            return LIDS.contains(&lid).then_some(Key::Vnic(lid));
        }
        (key.starts_with(GIDS) || key.starts_with(IPS)).then_some(Key::Claim)
    }
}

/// A decimal number without leading zeros (so each number has one key).
fn number(s: &str) -> Option<u64> {
    if s.is_empty() || s.len() > 10 || !s.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    if s.len() > 1 && s.starts_with('0') {
        return None;
    }
    s.parse().ok()
}

/// Host `index`'s key.
pub(in crate::server) fn host_key(index: u32) -> String {
    format!("{HOSTS}{index}")
}

/// The key of the vRNIC with LID `lid`.
pub(in crate::server) fn vnic_key(lid: u16) -> String {
    format!("{VNICS}{lid}")
}

/// The claim key of GID `gid`.
pub(in crate::server) fn gid_key(gid: &[u8; 16]) -> String {
    format!("{GIDS}{}", hex(gid))
}

/// The claim key of virtual IP `ip` in `group`.
pub(in crate::server) fn ip_key(group: &str, ip: Ipv4Addr) -> String {
    format!("{IPS}{group}/{ip}")
}

/// The prefix of `group`'s virtual-IP claims.
pub(in crate::server) fn ip_prefix(group: &str) -> String {
    format!("{IPS}{group}/")
}

/// The address of an IP claim key of `group`'s, if it is one.
pub(in crate::server) fn ip_of_key(group: &str, key: &[u8]) -> Option<Ipv4Addr> {
    std::str::from_utf8(key)
        .ok()?
        .strip_prefix(&ip_prefix(group))?
        .parse()
        .ok()
}

/// 32 lowercase hex digits.
pub(in crate::server) fn hex(gid: &[u8; 16]) -> String {
    gid.iter().map(|b| format!("{b:02x}")).collect()
}

/// The GID written as [`hex`] writes it.
pub(in crate::server) fn parse_hex(s: &str) -> Option<[u8; 16]> {
    if s.len() != 32 || !s.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f')) {
        return None;
    }
    let mut gid = [0u8; 16];
    for (i, g) in gid.iter_mut().enumerate() {
        *g = u8::from_str_radix(&s[2 * i..2 * i + 2], 16).ok()?;
    }
    Some(gid)
}

/// Whether a vRNIC may have virtual IP `ip`.
pub(in crate::server) fn unicast_vip(ip: Ipv4Addr) -> bool {
    !(ip.is_unspecified()
        || ip.is_loopback()
        || ip.is_multicast()
        || ip.is_broadcast()
        || ip.octets()[0] == 0)
}

impl HostRecord {
    /// JSON, as stored.
    pub(in crate::server) fn encode(&self) -> Vec<u8> {
        // Invariant: a struct of addresses always serialises.
        serde_json::to_vec(self).unwrap_or_default()
    }

    /// Decodes and checks a stored host record.
    pub(in crate::server) fn decode(value: &[u8]) -> Result<HostRecord, String> {
        let r: HostRecord = serde_json::from_slice(value).map_err(|e| e.to_string())?;
        let bad = |ip: IpAddr| ip.is_unspecified() || ip.is_multicast();
        if bad(r.addr.ip()) || r.addr.port() == 0 {
            return Err(format!("{} is not a peer-link address", r.addr));
        }
        if r.addrs.len() > MAX_ADDRS {
            return Err(format!("{} addresses (at most {MAX_ADDRS})", r.addrs.len()));
        }
        if let Some(ip) = r.addrs.iter().find(|ip| bad(**ip) || ip.is_loopback()) {
            return Err(format!("{ip} is not a host address"));
        }
        Ok(r)
    }
}

impl VnicRecord {
    /// JSON, as stored.
    pub(in crate::server) fn encode(&self) -> Vec<u8> {
        // Invariant: strings and numbers always serialise.
        serde_json::to_vec(self).unwrap_or_default()
    }

    /// Decodes and checks the record stored under the key of LID `lid`.
    pub(in crate::server) fn decode(lid: u16, value: &[u8]) -> Result<VnicRecord, String> {
        let r: VnicRecord = serde_json::from_slice(value).map_err(|e| e.to_string())?;
        if r.lid != lid {
            return Err(format!("LID {} under the key of LID {lid}", r.lid));
        }
        if r.host >= MAX_HOSTS {
            return Err(format!("host index {} (at most {MAX_HOSTS})", r.host));
        }
        for (what, s) in [("name", &r.name), ("group", &r.group)] {
            if !crate::config::valid_name(s) {
                return Err(format!("invalid {what} {s:?}"));
            }
        }
        if r.gid_bytes().is_none() {
            return Err(format!("GID {:?} is not 32 hex digits", r.gid));
        }
        if !unicast_vip(r.ip) {
            return Err(format!("{} is not a unicast address", r.ip));
        }
        Ok(r)
    }

    /// Its GID.
    pub(in crate::server) fn gid_bytes(&self) -> Option<[u8; 16]> {
        parse_hex(&self.gid)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn vnic() -> VnicRecord {
        VnicRecord {
            host: 2,
            name: "a1".into(),
            lid: 77,
            gid: hex(&[0xfe, 0x80, 0, 0, 0, 0, 0, 0, 2, 0x56, 0x52, 0, 0, 0, 0, 77]),
            ip: Ipv4Addr::new(100, 64, 0, 1),
            group: "red".into(),
        }
    }

    #[test]
    fn keys_round_trip_and_odd_keys_are_unknown() {
        assert_eq!(Key::parse(host_key(3).as_bytes()), Some(Key::Host(3)));
        assert_eq!(Key::parse(vnic_key(77).as_bytes()), Some(Key::Vnic(77)));
        assert_eq!(Key::parse(gid_key(&[1; 16]).as_bytes()), Some(Key::Claim));
        let ip = Ipv4Addr::new(10, 9, 0, 1);
        assert_eq!(Key::parse(ip_key("red", ip).as_bytes()), Some(Key::Claim));
        assert_eq!(ip_of_key("red", ip_key("red", ip).as_bytes()), Some(ip));
        assert_eq!(ip_of_key("blue", ip_key("red", ip).as_bytes()), None);
        for bad in [
            "/vrnic/v1/hosts/",
            "/vrnic/v1/hosts/03",
            "/vrnic/v1/hosts/-1",
            "/vrnic/v1/hosts/1024",
            "/vrnic/v1/vnics/0",
            "/vrnic/v1/vnics/49152",
            "/vrnic/v1/vnics/65536",
            "/vrnic/v1/vnics/7x",
            "/vrnic/v1/other",
        ] {
            assert_eq!(Key::parse(bad.as_bytes()), None, "{bad}");
        }
        assert_eq!(Key::parse(&[0xff, 0xfe]), None, "not UTF-8");
    }

    #[test]
    fn a_vnic_record_round_trips() {
        let r = vnic();
        assert_eq!(VnicRecord::decode(77, &r.encode()).unwrap(), r);
        assert_eq!(r.gid_bytes().unwrap()[15], 77);
    }

    #[test]
    fn malformed_vnic_records_are_refused() {
        let ok = vnic();
        assert!(VnicRecord::decode(78, &ok.encode()).is_err(), "another key");
        let mut r = ok.clone();
        r.name = "a b".into();
        assert!(VnicRecord::decode(77, &r.encode()).is_err(), "name");
        let mut r = ok.clone();
        r.group = String::new();
        assert!(VnicRecord::decode(77, &r.encode()).is_err(), "group");
        let mut r = ok.clone();
        r.gid = "fe80".into();
        assert!(VnicRecord::decode(77, &r.encode()).is_err(), "gid");
        let mut r = ok.clone();
        r.gid = "FE".repeat(16);
        assert!(VnicRecord::decode(77, &r.encode()).is_err(), "one spelling");
        let mut r = ok.clone();
        r.ip = Ipv4Addr::LOCALHOST;
        assert!(VnicRecord::decode(77, &r.encode()).is_err(), "ip");
        let mut r = ok.clone();
        r.host = MAX_HOSTS;
        assert!(VnicRecord::decode(77, &r.encode()).is_err(), "host");
        let extra = String::from_utf8(ok.encode())
            .unwrap()
            .replace('}', ",\"x\":1}");
        assert!(
            VnicRecord::decode(77, extra.as_bytes()).is_err(),
            "unknown field"
        );
        assert!(VnicRecord::decode(77, b"{").is_err());
        assert!(VnicRecord::decode(77, &[0xff; 40]).is_err());
    }

    #[test]
    fn host_records_round_trip_and_bad_addresses_are_refused() {
        let r = HostRecord {
            addr: "10.77.0.1:7700".parse().unwrap(),
            addrs: vec!["10.77.0.1".parse().unwrap()],
        };
        assert_eq!(HostRecord::decode(&r.encode()).unwrap(), r);
        let mut bad = r.clone();
        bad.addr = "0.0.0.0:7700".parse().unwrap();
        assert!(HostRecord::decode(&bad.encode()).is_err());
        let mut bad = r.clone();
        bad.addrs.push("127.0.0.1".parse().unwrap());
        assert!(HostRecord::decode(&bad.encode()).is_err());
        let mut bad = r.clone();
        bad.addrs = vec!["10.0.0.1".parse().unwrap(); MAX_ADDRS + 1];
        assert!(HostRecord::decode(&bad.encode()).is_err());
        assert!(HostRecord::decode(b"{\"addr\":\"10.0.0.1:1\"}").is_err());
    }
}
