//! The daemon's config file (`vrnic serve --config FILE`): TOML with the same keys as the
//! `vrnic serve` options, so a host's peer list can live in a file. Options on the command line
//! win over the file. An unknown key, a value of the wrong type or an address that does not
//! parse is an error that names the key and the file.
//!
//! ```toml
//! listen = "10.0.0.1:7700"
//! peers = ["10.0.0.2:7700", "10.0.0.3:7700"]
//! region_gib = 16
//! max_vrnics = 4096
//! ```
//!
//! Peer links are authenticated by key (`vrnic keygen`): this host's key file, and each other
//! host's public key by its peer-link address; `encrypt_links = true` also encrypts them.
//!
//! ```toml
//! key_file = "/etc/vrnic/link.key"
//! encrypt_links = false
//! [peer_keys]
//! "10.0.0.2:7700" = "5f0c...64 hex digits"
//! "10.0.0.3:7700" = "a1b2...64 hex digits"
//! ```
//!
//! The vRNICs `vrnic create` makes are recorded in a file and made again at start
//! ([`crate::persist`]); another file, or none:
//!
//! ```toml
//! persist_file = "/var/lib/vrnic/vnics.json"
//! no_persist = false
//! ```
//!
//! A cluster host names etcd instead of its peers:
//!
//! ```toml
//! listen = "10.0.0.1:7700"
//! etcd = ["http://10.0.0.100:2379"]
//! etcd_ttl = 5
//! etcd_user = "vrnic"
//! etcd_password_file = "/etc/vrnic/etcd-password"
//! ```
//!
//! With TLS to etcd (`https://` URLs), and a client certificate where etcd asks for one:
//!
//! ```toml
//! etcd = ["https://10.0.0.100:2379"]
//! etcd_ca = "/etc/vrnic/etcd-ca.pem"
//! etcd_cert = "/etc/vrnic/etcd-client.pem"
//! etcd_key = "/etc/vrnic/etcd-client-key.pem"
//! ```

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::Path;

use serde::Deserialize;

/// The port of a peer-link address that names none (`--listen`, `--peer`, `listen`,
/// `peers`): the same everywhere, so `--peer HOST` reaches a daemon started with
/// `--listen ADDR`.
pub const DEFAULT_PEER_PORT: u16 = 7700;

/// A peer-link address as `HOST[:PORT]`: an IP address (IPv6 in brackets when a port follows)
/// or a host name, resolved now by the system's resolver (`ToSocketAddrs`; its first IPv4
/// address if it has one), with [`DEFAULT_PEER_PORT`] when no port is given.
pub fn host_port(s: &str) -> Result<SocketAddr, String> {
    use std::net::{IpAddr, ToSocketAddrs};
    let t = s.trim();
    if let Ok(a) = t.parse::<SocketAddr>() {
        return Ok(a);
    }
    let bare = t
        .strip_prefix('[')
        .and_then(|r| r.strip_suffix(']'))
        .unwrap_or(t);
    if let Ok(ip) = bare.parse::<IpAddr>() {
        return Ok(SocketAddr::new(ip, DEFAULT_PEER_PORT));
    }
    let (host, port) = match t.rsplit_once(':') {
        Some((h, p)) if !h.contains(':') => (
            h,
            p.parse::<u16>()
                .map_err(|_| format!("{s:?}: the port {p:?} is not a number (HOST[:PORT])"))?,
        ),
        _ => (t, DEFAULT_PEER_PORT),
    };
    if host.is_empty() || host.contains(char::is_whitespace) {
        return Err(format!("{s:?} is not HOST[:PORT]"));
    }
    let all: Vec<SocketAddr> = (host, port)
        .to_socket_addrs()
        .map_err(|e| format!("{s:?}: cannot resolve the host name {host:?} ({e})"))?
        .collect();
    all.iter()
        .find(|a| a.is_ipv4())
        .or(all.first())
        .copied()
        .ok_or_else(|| format!("{s:?}: the host name {host:?} has no address"))
}

fn de_host_port<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Option<SocketAddr>, D::Error> {
    let s = Option::<String>::deserialize(d)?;
    s.map(|s| host_port(&s).map_err(serde::de::Error::custom))
        .transpose()
}

fn de_host_ports<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Vec<SocketAddr>, D::Error> {
    Vec::<String>::deserialize(d)?
        .iter()
        .map(|s| host_port(s).map_err(serde::de::Error::custom))
        .collect()
}

/// What a config file may set (every key optional).
#[derive(Debug, Default, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Settings {
    /// This host's address for peer links (`--listen`), `HOST[:PORT]` ([`host_port`]).
    #[serde(default, deserialize_with = "de_host_port")]
    pub listen: Option<SocketAddr>,
    /// Where to serve Prometheus metrics (`--metrics`).
    pub metrics: Option<SocketAddr>,
    /// The other hosts' daemons (`--peer`, repeated), each `HOST[:PORT]` ([`host_port`]).
    #[serde(default, deserialize_with = "de_host_ports")]
    pub peers: Vec<SocketAddr>,
    /// etcd's client URLs (`--etcd`): cluster mode.
    #[serde(default)]
    pub etcd: Vec<String>,
    /// The etcd lease's time to live in seconds (`--etcd-ttl`).
    pub etcd_ttl: Option<u64>,
    /// The etcd user to authenticate as (`--etcd-user`).
    pub etcd_user: Option<String>,
    /// The file holding its password (`--etcd-password-file`).
    pub etcd_password_file: Option<std::path::PathBuf>,
    /// TLS to etcd: the CA certificates (`--etcd-ca`).
    pub etcd_ca: Option<std::path::PathBuf>,
    /// TLS to etcd: a client certificate (`--etcd-cert`).
    pub etcd_cert: Option<std::path::PathBuf>,
    /// TLS to etcd: the client certificate's key (`--etcd-key`).
    pub etcd_key: Option<std::path::PathBuf>,
    /// Region size in GiB (`--region-gib`).
    pub region_gib: Option<u64>,
    /// Most vRNICs (`--max-vrnics`).
    pub max_vrnics: Option<u32>,
    /// Per-vRNIC limits (`--max-qp` ...).
    pub max_qp: Option<u32>,
    /// `--max-cq`.
    pub max_cq: Option<u32>,
    /// `--max-mr`.
    pub max_mr: Option<u32>,
    /// `--max-pd`.
    pub max_pd: Option<u32>,
    /// `--max-srq`.
    pub max_srq: Option<u32>,
    /// Engine threads (`--engine-threads`).
    pub engine_threads: Option<usize>,
    /// `--spread-qps`.
    pub spread_qps: Option<bool>,
    /// This host's peer-link key file (`--key`).
    pub key_file: Option<std::path::PathBuf>,
    /// Other hosts' public keys by peer-link address (`--peer-key`).
    #[serde(default)]
    pub peer_keys: BTreeMap<SocketAddr, String>,
    /// `--encrypt-links`.
    pub encrypt_links: Option<bool>,
    /// `--insecure-links`.
    pub insecure_links: Option<bool>,
    /// The file of persistent vRNICs (`--persist-file`).
    pub persist_file: Option<std::path::PathBuf>,
    /// `--no-persist`.
    pub no_persist: Option<bool>,
    /// The Unix group admitted to root's daemon (`--access-group`; `"none"`: root only).
    pub access_group: Option<String>,
}

/// A config file that could not be used.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum SettingsError {
    /// It could not be read.
    #[error("config file {file}: {source}")]
    Read {
        /// The file.
        file: String,
        /// Why.
        source: std::io::Error,
    },
    /// It is not valid TOML for these keys.
    #[error("config file {file}: {message}")]
    Invalid {
        /// The file.
        file: String,
        /// The parser's message: the key and the line.
        message: String,
    },
}

impl Settings {
    /// Reads and checks a config file.
    pub fn load(path: &Path) -> Result<Settings, SettingsError> {
        let file = path.display().to_string();
        let text = std::fs::read_to_string(path).map_err(|source| SettingsError::Read {
            file: file.clone(),
            source,
        })?;
        Settings::parse(&text).map_err(|message| SettingsError::Invalid { file, message })
    }

    /// Parses a config file's text; the error names the key.
    pub fn parse(text: &str) -> Result<Settings, String> {
        let s: Settings = toml::from_str(text).map_err(|e| e.to_string().trim_end().to_string())?;
        s.peer_key_list()?;
        Ok(s)
    }

    /// `peer_keys` decoded; the error names the address whose key is not one.
    pub fn peer_key_list(&self) -> Result<Vec<(SocketAddr, crate::keys::PublicKey)>, String> {
        self.peer_keys
            .iter()
            .map(|(a, k)| {
                k.parse()
                    .map(|k| (*a, k))
                    .map_err(|e| format!("peer_keys.\"{a}\": {e}"))
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_key_parses_and_missing_ones_stay_unset() {
        let s = Settings::parse(
            "listen = \"10.0.0.1:7700\"\npeers = [\"10.0.0.2:7700\"]\nregion_gib = 2\n",
        )
        .unwrap();
        assert_eq!(s.listen, Some("10.0.0.1:7700".parse().unwrap()));
        assert_eq!(s.peers, vec!["10.0.0.2:7700".parse().unwrap()]);
        assert_eq!((s.region_gib, s.max_vrnics), (Some(2), None));
        assert_eq!(Settings::parse("").unwrap(), Settings::default());
        let s = Settings::parse("persist_file = \"/var/lib/v.json\"\nno_persist = true\n").unwrap();
        assert_eq!(s.persist_file, Some("/var/lib/v.json".into()));
        assert_eq!(s.no_persist, Some(true));
        let s = Settings::parse("etcd = [\"http://10.0.0.9:2379\"]\netcd_ttl = 3\n").unwrap();
        assert_eq!(s.etcd, vec!["http://10.0.0.9:2379".to_string()]);
        assert_eq!(s.etcd_ttl, Some(3));
        let s =
            Settings::parse("etcd_user = \"vrnic\"\netcd_password_file = \"/etc/p\"\n").unwrap();
        assert_eq!(s.etcd_user.as_deref(), Some("vrnic"));
        assert_eq!(s.etcd_password_file, Some("/etc/p".into()));
    }

    #[test]
    fn link_keys_parse_and_a_bad_one_names_its_host() {
        let k = "ab".repeat(32);
        let s = Settings::parse(&format!(
            "key_file = \"/etc/k\"\nencrypt_links = true\n[peer_keys]\n\"10.0.0.2:7700\" = \"{k}\"\n"
        ))
        .unwrap();
        assert_eq!(s.key_file, Some("/etc/k".into()));
        assert_eq!(s.encrypt_links, Some(true));
        let list = s.peer_key_list().unwrap();
        assert_eq!(list[0].0, "10.0.0.2:7700".parse().unwrap());
        assert_eq!(list[0].1.to_string(), k);
        let e = Settings::parse("[peer_keys]\n\"10.0.0.2:7700\" = \"nope\"\n").unwrap_err();
        assert!(e.contains("10.0.0.2:7700"), "{e}");
        let e = Settings::parse("[peer_keys]\n\"host\" = \"nope\"\n").unwrap_err();
        assert!(e.contains("\"host\""), "{e}");
    }

    #[test]
    fn peer_addresses_take_host_names_and_the_default_port() {
        let a = |s: &str| host_port(s).unwrap();
        assert_eq!(a("10.0.0.2:7701"), "10.0.0.2:7701".parse().unwrap());
        assert_eq!(a("10.0.0.2"), "10.0.0.2:7700".parse().unwrap());
        assert_eq!(a("[::1]:9"), "[::1]:9".parse().unwrap());
        assert_eq!(a("::1"), "[::1]:7700".parse().unwrap());
        assert_eq!(a("[::1]"), "[::1]:7700".parse().unwrap());
        assert_eq!(a("localhost"), "127.0.0.1:7700".parse().unwrap());
        assert_eq!(a("localhost:7702"), "127.0.0.1:7702".parse().unwrap());
        let e = host_port("localhost:port").unwrap_err();
        assert!(e.contains("not a number"), "{e}");
        let e = host_port("no-such-host.invalid").unwrap_err();
        assert!(e.contains("cannot resolve the host name"), "{e}");
        let s = Settings::parse("listen = \"127.0.0.1\"\npeers = [\"localhost\"]\n").unwrap();
        assert_eq!(s.listen, Some("127.0.0.1:7700".parse().unwrap()));
        assert_eq!(s.peers, vec!["127.0.0.1:7700".parse().unwrap()]);
    }

    #[test]
    fn errors_name_the_key() {
        let e = Settings::parse("lisen = \"10.0.0.1:7700\"\n").unwrap_err();
        assert!(e.contains("lisen"), "{e}");
        let e = Settings::parse("peers = [\"not an address\"]\n").unwrap_err();
        assert!(e.contains("peers"), "{e}");
        let e = Settings::parse("region_gib = \"big\"\n").unwrap_err();
        assert!(e.contains("region_gib"), "{e}");
        let e = Settings::parse("etcd = \"http://10.0.0.9:2379\"\n").unwrap_err();
        assert!(e.contains("etcd"), "{e}");
    }
}
