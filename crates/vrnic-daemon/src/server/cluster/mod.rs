//! Cluster mode (`vrnic serve --etcd URL[,URL...]`): the directory and the host set come from
//! etcd instead of a static peer list (brief §6).
//!
//! - `records.rs`: the key layout and the records' strict encoding.
//! - `alloc.rs`: candidates for a host index, a LID, a virtual IP, and a LID's GUID and GID.
//! - `session.rs`: the etcd client on a thread of its own (lease, host claim, transactions,
//!   watch, reconnection); the daemon's loop never waits on etcd.
//! - this file: the loop's side. It feeds what the session reports into the peer links (a
//!   link per registered host, gone with the host) and the directory (other hosts' vRNICs, for
//!   the engine's routes and the CM broker), and finishes the admin requests that needed a
//!   transaction: a vRNIC is made here only once etcd has granted its LID, GID and IP, and
//!   the request's reply waits for that without stalling anything else.
//!
//! etcd is trusted infrastructure: what it reports is taken as the truth about who is where
//! (records are still decoded strictly, and a malformed one is ignored and logged). Peer
//! daemons are not trusted: in cluster mode a link may not announce vRNICs, and an accepted
//! link must come from the address its host index is registered with.
//!
//! If etcd cannot be reached, what is known stays (established QPs and links keep working),
//! and creating a vRNIC, or an rdma_cm lookup of another host, fails at once with an error
//! naming etcd; the session connects again and registers anew when etcd is back. (A verbs
//! app's RTR to a remote LID or GID still resolves from what is known: routes are the
//! engine's.)

mod alloc;
mod records;
mod session;

use std::collections::{BTreeMap, HashMap};
use std::net::{Ipv4Addr, SocketAddr};
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::mpsc::{Receiver, channel};
use std::time::{Duration, Instant};

use anyhow::{Context as _, Result, bail};
use tracing::{error, info, warn};
use vrnic_api::AdminReply;
use vrnic_proto::{HostId, VnicId};

use super::{Server, directory::Identity};
use records::{HostRecord, VnicRecord};
use session::{Command, Event};

/// Cluster mode's options (`vrnic serve --etcd`, `--etcd-ttl`, `--etcd-user`,
/// `--etcd-password-file`, `--etcd-ca`, `--etcd-cert`, `--etcd-key`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClusterOptions {
    /// etcd's client URLs (`http://HOST:PORT`, or `https://HOST:PORT` with `ca`).
    pub endpoints: Vec<String>,
    /// The lease's time to live in seconds: how long a dead daemon's vRNICs stay listed.
    pub ttl_s: u64,
    /// etcd's user the daemon authenticates as (etcd's v3 auth), with the password in
    /// `password_file`; `None`: no authentication (an etcd without auth).
    pub user: Option<String>,
    /// The file holding `user`'s password (its first line), readable by its owner only.
    pub password_file: Option<PathBuf>,
    /// TLS to etcd (`https://` URLs): the CA certificates (PEM) that etcd's server
    /// certificate must chain to.
    pub ca: Option<PathBuf>,
    /// A client certificate (PEM) for an etcd that authenticates its clients by certificate
    /// (`--client-cert-auth`).
    pub cert: Option<PathBuf>,
    /// The client certificate's key (PEM), readable by its owner only.
    pub key: Option<PathBuf>,
}

/// What TLS to etcd needs, read from the files.
#[derive(Clone)]
pub(super) struct TlsFiles {
    pub(super) ca: Vec<u8>,
    pub(super) identity: Option<(Vec<u8>, Vec<u8>)>,
}

impl std::fmt::Debug for TlsFiles {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "TlsFiles {{ client certificate: {} }}",
            self.identity.is_some()
        )
    }
}

/// Reads a PEM file that must hold a block of `kind` (`CERTIFICATE`, `PRIVATE KEY`).
fn read_pem(what: &str, file: &std::path::Path, kind: &str) -> Result<Vec<u8>> {
    let shown = file.display();
    let bytes = std::fs::read(file).with_context(|| format!("{what} {shown}"))?;
    let text = String::from_utf8_lossy(&bytes);
    let has = text
        .lines()
        .any(|l| l.starts_with("-----BEGIN ") && l.trim_end().ends_with(&format!("{kind}-----")));
    if !has {
        bail!("{what} {shown}: no PEM block of a {}", kind.to_lowercase());
    }
    Ok(bytes)
}

/// Checks that a secret's file is a regular file that neither its group nor others can read
/// or write.
fn owner_only(what: &str, file: &std::path::Path) -> Result<()> {
    let shown = file.display();
    let meta = std::fs::metadata(file).with_context(|| format!("{what} {shown}"))?;
    if !meta.is_file() {
        bail!("{what} {shown}: not a regular file");
    }
    let mode = std::os::unix::fs::PermissionsExt::mode(&meta.permissions());
    if mode & 0o077 != 0 {
        bail!(
            "{what} {shown} has mode {:03o}: it must not be readable or writable by group or \
             others (chmod 600 {shown})",
            mode & 0o777
        );
    }
    Ok(())
}

/// Why etcd is not usable before the first registration.
const NOT_YET: &str = "not registered yet";

/// The default lease time to live.
pub const DEFAULT_TTL_S: u64 = 5;

impl ClusterOptions {
    /// Checks the URLs and the time to live.
    pub fn check(&self) -> Result<()> {
        if self.endpoints.is_empty() {
            bail!("--etcd needs at least one URL");
        }
        let tls = self.ca.is_some();
        for u in &self.endpoints {
            let scheme = if tls { "https://" } else { "http://" };
            let Some(rest) = u.strip_prefix(scheme) else {
                if tls {
                    bail!("etcd URL {u:?}: with --etcd-ca, use https://HOST:PORT");
                }
                if u.starts_with("https://") {
                    bail!(
                        "etcd URL {u:?}: TLS needs --etcd-ca (the CA certificate etcd's server \
                         certificate is signed by)"
                    );
                }
                bail!("etcd URL {u:?}: use http://HOST:PORT (or https:// with --etcd-ca)");
            };
            if rest.is_empty() || rest.contains(['/', ' ']) {
                bail!("etcd URL {u:?}: use {scheme}HOST:PORT");
            }
        }
        match (&self.cert, &self.key) {
            (Some(c), None) => bail!("--etcd-cert {}: needs --etcd-key", c.display()),
            (None, Some(k)) => bail!("--etcd-key {}: needs --etcd-cert", k.display()),
            (Some(_), Some(_)) if !tls => bail!("--etcd-cert and --etcd-key need --etcd-ca"),
            _ => {}
        }
        if !(2..=3600).contains(&self.ttl_s) {
            bail!("--etcd-ttl {}: use 2 to 3600 seconds", self.ttl_s);
        }
        match (&self.user, &self.password_file) {
            (Some(u), _) if u.is_empty() || u.contains(char::is_control) => {
                bail!("--etcd-user {u:?}: not a user name")
            }
            (Some(u), None) => bail!("--etcd-user {u} needs --etcd-password-file"),
            (None, Some(f)) => {
                bail!("--etcd-password-file {}: needs --etcd-user", f.display())
            }
            _ => {}
        }
        Ok(())
    }

    /// The user and password to authenticate to etcd with, the password read from its file
    /// (its first line, without the line end). The file must be a regular file that neither
    /// its group nor others can read or write: anyone who reads it can rewrite the directory.
    pub fn credentials(&self) -> Result<Option<(String, String)>> {
        let (Some(user), Some(file)) = (&self.user, &self.password_file) else {
            return Ok(None);
        };
        let shown = file.display();
        std::fs::metadata(file)
            .with_context(|| format!("etcd password file {shown} (for user {user})"))?;
        owner_only("etcd password file", file)?;
        let text = std::fs::read_to_string(file)
            .with_context(|| format!("etcd password file {shown} (for user {user})"))?;
        let password = text.lines().next().unwrap_or_default();
        if password.is_empty() {
            bail!("etcd password file {shown}: its first line is empty");
        }
        Ok(Some((user.clone(), password.to_string())))
    }

    /// What TLS to etcd needs, read from its files (`None`: plain `http://`). The key file,
    /// like the password file, must be readable by its owner only.
    pub(super) fn tls(&self) -> Result<Option<TlsFiles>> {
        let Some(ca) = &self.ca else {
            return Ok(None);
        };
        let ca = read_pem("etcd CA certificate", ca, "CERTIFICATE")?;
        let identity = match (&self.cert, &self.key) {
            (Some(c), Some(k)) => {
                let cert = read_pem("etcd client certificate", c, "CERTIFICATE")?;
                owner_only("etcd client key", k)?;
                let key = read_pem("etcd client key", k, "PRIVATE KEY")?;
                Some((cert, key))
            }
            _ => None,
        };
        Ok(Some(TlsFiles { ca, identity }))
    }
}

/// An admin request waiting for its transaction.
struct Pending {
    conn: u64,
    name: String,
    /// `vrnic create` (kept until removed) rather than `run`'s hold.
    persistent: bool,
    /// Its QoS limits.
    policy: vrnic_api::PolicyChange,
}

/// The loop's side of cluster mode.
pub(super) struct Cluster {
    tx: tokio::sync::mpsc::UnboundedSender<Command>,
    rx: Receiver<Event>,
    thread: Option<std::thread::JoinHandle<()>>,
    endpoints: String,
    me: Option<HostId>,
    /// Why etcd is unreachable (`None`: it answers).
    down: Option<String>,
    hosts: BTreeMap<u32, HostRecord>,
    /// Other hosts' vRNICs.
    vnics: BTreeMap<u16, VnicRecord>,
    next_req: u64,
    pending: HashMap<u64, Pending>,
    /// Lookups of other hosts refused since etcd became unreachable (the first is logged).
    refused: u64,
    /// etcd refused this daemon's credentials at start: the daemon stops with this error.
    fatal: Option<String>,
    /// The session's waker, held as long as the loop may poll for it.
    _waker: Arc<mio::Waker>,
}

impl Cluster {
    /// Starts the session thread; `waker` wakes the loop when it reports.
    pub(super) fn start(
        opts: &ClusterOptions,
        listen: SocketAddr,
        waker: mio::Waker,
        seed: u64,
    ) -> Result<Cluster> {
        opts.check()?;
        let mut addrs = crate::sys::host_addrs();
        if !listen.ip().is_unspecified() && !addrs.contains(&listen.ip()) {
            addrs.push(listen.ip());
        }
        addrs.retain(|ip| !ip.is_loopback() && !ip.is_unspecified() && !ip.is_multicast());
        addrs.truncate(64);
        if listen.ip().is_unspecified() {
            bail!("--listen {listen}: in cluster mode peers dial it, so give this host's address");
        }
        let credentials = opts
            .credentials()?
            .map(|(user, password)| session::Credentials { user, password });
        let tls = opts.tls()?;
        let cfg = session::Config {
            endpoints: opts.endpoints.clone(),
            credentials,
            tls,
            ttl_s: opts.ttl_s as i64,
            me: HostRecord {
                addr: listen,
                addrs,
            },
            seed,
        };
        let (tx, cmds) = tokio::sync::mpsc::unbounded_channel();
        let (etx, rx) = channel();
        // The loop keeps the waker too: a session thread that ends right after its last
        // event (a refusal at start) must not close the waker's fd before the loop saw it.
        let waker = Arc::new(waker);
        let out = session::Out {
            tx: etx,
            waker: waker.clone(),
        };
        let thread = std::thread::Builder::new()
            .name("vrnic-etcd".into())
            .spawn(move || session::run(cfg, cmds, out))
            .context("start the etcd session thread")?;
        info!(etcd = opts.endpoints.join(","), "cluster mode");
        Ok(Cluster {
            tx,
            rx,
            thread: Some(thread),
            endpoints: opts.endpoints.join(","),
            me: None,
            down: Some(NOT_YET.into()),
            hosts: BTreeMap::new(),
            vnics: BTreeMap::new(),
            next_req: 1,
            pending: HashMap::new(),
            refused: 0,
            fatal: None,
            _waker: waker,
        })
    }

    /// Names that vRNICs being created here will have.
    pub(super) fn pending_names(&self) -> impl Iterator<Item = &str> {
        self.pending.values().map(|p| p.name.as_str())
    }

    /// How many vRNICs are being created.
    pub(super) fn pending_count(&self) -> usize {
        self.pending.len()
    }

    /// Whether the daemon is registered in etcd and etcd answers (vRNICs can be made).
    pub(super) fn registered(&self) -> bool {
        self.down.is_none()
    }

    /// Stops the session: its lease is revoked (every key of this daemon goes at once).
    /// Waits a little for it, never long.
    pub(super) fn stop(&mut self) {
        let _ = self.tx.send(Command::Stop);
        if let Some(t) = self.thread.take() {
            let start = Instant::now();
            while !t.is_finished() && start.elapsed() < Duration::from_secs(2) {
                std::thread::sleep(Duration::from_millis(10));
            }
            if t.is_finished() {
                let _ = t.join();
            }
        }
    }
}

impl Server {
    /// Starts creating vRNIC `name` in cluster mode: its addresses are claimed in etcd first,
    /// and the reply to admin connection `conn` waits (`None`) until they are. `Some`: refused
    /// at once.
    pub(super) fn cluster_create(
        &mut self,
        conn: u64,
        name: &str,
        persistent: bool,
        group: Option<&str>,
        ip: Option<Ipv4Addr>,
        policy: vrnic_api::PolicyChange,
    ) -> Option<AdminReply> {
        let group = group.unwrap_or(crate::cm::DEFAULT_GROUP);
        if let Err(e) = self.check_new_vnic(name, group) {
            return Some(AdminReply::Err(format!("{e:#}")));
        }
        let c = self.cluster.as_mut()?;
        if let Some(why) = &c.down {
            return Some(AdminReply::Err(format!(
                "the cluster store (etcd at {}) is unreachable: new vRNICs cannot be registered \
                 until it is back ({why})",
                c.endpoints
            )));
        }
        let req = c.next_req;
        c.next_req += 1;
        if c.tx
            .send(Command::Create {
                req,
                name: name.to_string(),
                group: group.to_string(),
                ip,
            })
            .is_err()
        {
            return Some(AdminReply::Err("the etcd session has stopped".into()));
        }
        c.pending.insert(
            req,
            Pending {
                conn,
                name: name.to_string(),
                persistent,
                policy,
            },
        );
        None
    }

    /// Whether an address lookup (`rdma_resolve_addr`) by vRNIC `vnic` of `dst` must fail: in
    /// cluster mode, while etcd is unreachable, any lookup that would need the directory of
    /// other hosts (an address that is neither this host's nor a virtual IP of this host's
    /// vRNICs in the caller's group). Returns why; the first refusal of an outage is logged.
    pub(super) fn cluster_lookup_refused(
        &mut self,
        vnic: VnicId,
        dst: std::net::IpAddr,
    ) -> Option<String> {
        let c = self.cluster.as_ref()?;
        let why = c.down.as_ref()?;
        if crate::cm::is_local(dst) && !dst.is_unspecified() {
            return None;
        }
        let v = self.vnics.get(&vnic)?;
        if let std::net::IpAddr::V4(ip) = dst
            && self.directory.vip_here(v.group, ip)
        {
            return None;
        }
        let msg = format!(
            "the cluster directory (etcd at {}) is unreachable: lookups of other hosts fail until \
             it is back ({why})",
            c.endpoints
        );
        let name = v.name.clone();
        let c = self.cluster.as_mut()?;
        if c.refused == 0 {
            warn!(vnic = name, %dst, "address lookup refused: {msg}");
        }
        c.refused += 1;
        Some(msg)
    }

    /// Why the daemon must stop: etcd refused its credentials (or their lack) at start.
    pub(super) fn cluster_fatal(&self) -> Option<&str> {
        self.cluster.as_ref()?.fatal.as_deref()
    }

    /// A local vRNIC with LID `lid` is gone: its keys go from etcd.
    pub(super) fn cluster_release(&mut self, lid: u16) {
        if let Some(c) = &self.cluster {
            let _ = c.tx.send(Command::Release { lid });
        }
    }

    /// Takes what the etcd session reported. Returns whether anything changed.
    pub(super) fn cluster_events(&mut self) -> bool {
        let mut any = false;
        loop {
            let Some(e) = self.cluster.as_ref().and_then(|c| c.rx.try_recv().ok()) else {
                return any;
            };
            any = true;
            self.cluster_event(e);
        }
    }

    fn cluster_event(&mut self, e: Event) {
        let Some(c) = self.cluster.as_mut() else {
            return;
        };
        match e {
            Event::Registered { host } => {
                if let Some(why) = c.down.take() {
                    info!(index = host, "registered in etcd (was: {why})");
                    if c.refused > 1 {
                        warn!(
                            "{} more address lookups were refused without etcd",
                            c.refused - 1
                        );
                    }
                    c.refused = 0;
                }
                let me = HostId(host);
                if c.me != Some(me) {
                    c.me = Some(me);
                    // Links under another index are dropped, what other hosts registered is
                    // forgotten; the snapshot that follows adds it all again.
                    let old: Vec<u32> = std::mem::take(&mut c.hosts).into_keys().collect();
                    c.vnics.clear();
                    for h in old {
                        self.directory_forget(HostId(h));
                    }
                    self.cluster_set_me(me);
                }
                // The first registration: the recorded vRNICs are registered as fresh ones.
                self.restore_recorded();
            }
            Event::Snapshot { hosts, vnics } => {
                let old_hosts: Vec<u32> = c.hosts.keys().copied().collect();
                let old_vnics: Vec<u16> = c.vnics.keys().copied().collect();
                for h in old_hosts {
                    if !hosts.contains_key(&h) {
                        self.cluster_host(h, None);
                    }
                }
                for (h, r) in hosts {
                    self.cluster_host(h, Some(r));
                }
                for l in old_vnics {
                    if !vnics.contains_key(&l) {
                        self.cluster_vnic(l, None);
                    }
                }
                for (l, r) in vnics {
                    self.cluster_vnic(l, Some(r));
                }
            }
            Event::Host(h, r) => self.cluster_host(h, r),
            Event::Vnic(l, r) => self.cluster_vnic(l, r),
            Event::Created { req, result } => self.cluster_created(req, result),
            Event::Lost { lid, why } => {
                if let Some((&id, v)) = self.vnics.iter().find(|(_, v)| v.lid == lid) {
                    error!(vnic = v.name, lid, "vRNIC removed: {why}");
                    self.remove_vnic(id);
                }
            }
            Event::Fatal(why) => {
                error!("{why}");
                c.fatal = Some(why);
            }
            Event::Down(why) => {
                // An outage is logged once; so is the first failure before registering.
                if c.down.is_none() || c.me.is_none() && c.down.as_deref() == Some(NOT_YET) {
                    warn!(
                        etcd = c.endpoints,
                        "the cluster store is unreachable: {why}; established QPs go on, new \
                         vRNICs wait for it"
                    );
                }
                c.down = Some(why);
            }
        }
    }

    /// Host `h` registered (or changed) or left.
    fn cluster_host(&mut self, h: u32, r: Option<HostRecord>) {
        let Some(c) = self.cluster.as_mut() else {
            return;
        };
        let host = HostId(h);
        if c.me == Some(host) {
            if let Some(r) = r {
                c.hosts.insert(h, r);
            }
            return;
        }
        match r {
            Some(r) => {
                if c.hosts.get(&h) == Some(&r) {
                    return;
                }
                c.hosts.insert(h, r.clone());
                self.cluster_host_added(host, r.addr);
                self.cm.clear_host_addrs(host);
                for ip in r.addrs {
                    self.record_addr(host, ip);
                }
            }
            None => {
                if c.hosts.remove(&h).is_none() {
                    return;
                }
                self.cluster_host_removed(host);
                self.directory_forget(host);
                // Its vRNICs' records go with its lease; their events may come after.
                if let Some(c) = self.cluster.as_mut() {
                    c.vnics.retain(|_, v| v.host != h);
                }
            }
        }
    }

    /// A vRNIC of another host registered (or changed) or left.
    fn cluster_vnic(&mut self, lid: u16, r: Option<VnicRecord>) {
        let Some(c) = self.cluster.as_mut() else {
            return;
        };
        if let Some(r) = &r
            && c.me == Some(HostId(r.host))
        {
            // Ours: the registry knows it.
            return;
        }
        if c.vnics.get(&lid).is_some_and(|old| Some(old) == r.as_ref()) {
            return;
        }
        if let Some(old) = c.vnics.remove(&lid)
            && let Some(gid) = old.gid_bytes()
        {
            self.directory_vnic(HostId(old.host), lid, gid, None);
        }
        let Some(r) = r else { return };
        let Some(gid) = r.gid_bytes() else { return };
        if !self.directory_vnic(HostId(r.host), lid, gid, Some((&r.name, &r.group, r.ip))) {
            warn!(
                vnic = r.name,
                "a vRNIC in etcd names one group too many: ignored"
            );
            return;
        }
        if let Some(c) = self.cluster.as_mut() {
            c.vnics.insert(lid, r);
        }
    }

    /// The transaction for a pending creation answered: the vRNIC is made with the granted
    /// addresses, and the admin request gets its reply.
    fn cluster_created(&mut self, req: u64, result: Result<VnicRecord, String>) {
        let Some(p) = self.cluster.as_mut().and_then(|c| c.pending.remove(&req)) else {
            return;
        };
        let alive = self.admins.contains_key(&p.conn);
        let mut seq = None;
        let reply = match result {
            Err(why) => AdminReply::Err(format!("cannot register the vRNIC in etcd: {why}")),
            // A `run` whose command already died: nobody would hold it.
            Ok(r) if !alive && !p.persistent => {
                self.cluster_release(r.lid);
                return;
            }
            Ok(r) => match self.cluster_make(&p, &r) {
                Ok(id) => {
                    self.set_policy(id, p.policy);
                    if !p.persistent {
                        if let Err(e) = self.give_to_tenant(p.conn, id) {
                            self.maybe_reap(id);
                            self.admin_reply_later(p.conn, &AdminReply::Err(format!("{e:#}")));
                            return;
                        }
                        if let Some(v) = self.vnics.get_mut(&id) {
                            v.holders += 1;
                        }
                        if let Some(c) = self.admins.get_mut(&p.conn) {
                            c.held = Some(id);
                        }
                    }
                    seq = self.record_vnic(id);
                    self.summary(id)
                        .map(AdminReply::Vnic)
                        .unwrap_or(AdminReply::Ok)
                }
                Err(e) => {
                    self.cluster_release(r.lid);
                    AdminReply::Err(format!("{e:#}"))
                }
            },
        };
        if p.conn == super::admin_socket::NO_CONN {
            // A recorded vRNIC made again at start.
            if let AdminReply::Err(e) = &reply {
                self.restore_refused(&p.name, e);
            } else {
                info!(vnic = p.name, "persistent vRNIC made again");
            }
            return;
        }
        let what = format!("vRNIC {} was made", p.name);
        if let Some(reply) = self.reply_when_written(p.conn, seq, reply, what) {
            self.admin_reply_later(p.conn, &reply);
        }
    }

    /// Makes the vRNIC etcd granted `r` to.
    fn cluster_make(&mut self, p: &Pending, r: &VnicRecord) -> Result<VnicId> {
        self.check_new_vnic(&p.name, &r.group)?;
        let group = self
            .directory
            .group(&r.group)
            .context("the daemon knows its limit of groups")?;
        self.cm.name_group(group, &r.group);
        let gid = r.gid_bytes().context("a granted GID")?;
        let (guid, _) = alloc::guid_gid(r.lid);
        let id = VnicId(self.next_vnic);
        self.next_vnic += 1;
        self.directory.hold_vip(group, r.ip, id);
        let identity = Identity {
            lid: r.lid,
            gid,
            guid,
        };
        let made = self.make_vnic(id, &p.name, p.persistent, group, r.ip, identity);
        if made.is_err() {
            self.directory.release_vip(group, r.ip);
        }
        made
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn opts(urls: &[&str], ttl_s: u64) -> ClusterOptions {
        ClusterOptions {
            endpoints: urls.iter().map(|u| u.to_string()).collect(),
            ttl_s,
            user: None,
            password_file: None,
            ca: None,
            cert: None,
            key: None,
        }
    }

    #[test]
    fn etcd_urls_are_http_host_and_port_https_with_a_ca_and_the_ttl_is_bounded() {
        assert!(
            opts(&["http://10.0.0.1:2379", "http://e2:2379"], 5)
                .check()
                .is_ok()
        );
        for bad in [
            opts(&[], 5),
            opts(&["https://10.0.0.1:2379"], 5),
            opts(&["10.0.0.1:2379"], 5),
            opts(&["http://"], 5),
            opts(&["http://10.0.0.1:2379/v3"], 5),
            opts(&["http://10.0.0.1:2379"], 1),
            opts(&["http://10.0.0.1:2379"], 3601),
        ] {
            assert!(bad.check().is_err(), "{bad:?}");
        }
        let e = opts(&["https://e:2379"], 5)
            .check()
            .unwrap_err()
            .to_string();
        assert!(e.contains("TLS") && e.contains("--etcd-ca"), "{e}");
        let tls = |urls: &[&str]| ClusterOptions {
            ca: Some("/ca.pem".into()),
            ..opts(urls, 5)
        };
        assert!(tls(&["https://10.0.0.1:2379"]).check().is_ok());
        let e = tls(&["http://10.0.0.1:2379"])
            .check()
            .unwrap_err()
            .to_string();
        assert!(e.contains("https://"), "{e}");
        let mut o = tls(&["https://e:2379"]);
        o.cert = Some("/c.pem".into());
        assert!(o.check().is_err(), "a certificate without its key");
        o.key = Some("/k.pem".into());
        assert!(o.check().is_ok());
        o.ca = None;
        o.endpoints = vec!["http://e:2379".into()];
        assert!(o.check().is_err(), "a client certificate without TLS");
    }

    #[test]
    fn tls_files_are_read_as_pem_and_the_key_is_owner_only() {
        use std::os::unix::fs::PermissionsExt;
        let dir = std::env::temp_dir().join(format!("vrnic-etcd-tls-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let pem = |kind: &str| format!("-----BEGIN {kind}-----\nMIIB\n-----END {kind}-----\n");
        let (ca, cert, key) = (dir.join("ca.pem"), dir.join("c.pem"), dir.join("k.pem"));
        std::fs::write(&ca, pem("CERTIFICATE")).unwrap();
        std::fs::write(&cert, pem("CERTIFICATE")).unwrap();
        std::fs::write(&key, pem("PRIVATE KEY")).unwrap();
        std::fs::set_permissions(&key, std::fs::Permissions::from_mode(0o644)).unwrap();
        let mut o = opts(&["https://e:2379"], 5);
        assert!(o.tls().unwrap().is_none(), "no CA: no TLS");
        o.ca = Some(ca.clone());
        let t = o.tls().unwrap().expect("TLS");
        assert!(t.identity.is_none());
        (o.cert, o.key) = (Some(cert.clone()), Some(key.clone()));
        let e = o.tls().unwrap_err().to_string();
        assert!(e.contains("group or others") && e.contains("key"), "{e}");
        std::fs::set_permissions(&key, std::fs::Permissions::from_mode(0o600)).unwrap();
        assert!(o.tls().unwrap().expect("TLS").identity.is_some());
        // A key where the certificate should be.
        o.cert = Some(key.clone());
        let e = o.tls().unwrap_err().to_string();
        assert!(e.contains("no PEM block of a certificate"), "{e}");
        std::fs::write(&ca, "not PEM").unwrap();
        o.cert = Some(cert);
        assert!(o.tls().is_err());
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_password_file_others_can_read_is_refused() {
        use std::os::unix::fs::PermissionsExt;
        let dir = std::env::temp_dir().join(format!("vrnic-etcd-pw-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("password");
        std::fs::write(&file, "s3cret\nignored\n").unwrap();
        let mut o = opts(&["http://e:2379"], 5);
        o.user = Some("vrnic".into());
        assert!(o.check().is_err(), "a user without a password file");
        o.password_file = Some(file.clone());
        for mode in [0o644, 0o640, 0o604, 0o620] {
            std::fs::set_permissions(&file, std::fs::Permissions::from_mode(mode)).unwrap();
            let e = o.credentials().unwrap_err().to_string();
            assert!(
                e.contains("group or others") && e.contains("password"),
                "{e}"
            );
        }
        std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o600)).unwrap();
        assert!(o.check().is_ok());
        assert_eq!(
            o.credentials().unwrap(),
            Some(("vrnic".to_string(), "s3cret".to_string()))
        );
        o.user = None;
        assert!(o.check().is_err(), "a password file without a user");
        assert_eq!(o.credentials().unwrap(), None);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
