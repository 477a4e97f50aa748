//! The etcd session: a thread of its own (a tokio current-thread runtime) that holds the
//! daemon's etcd client, so the daemon's loop never waits on etcd.
//!
//! It takes [`Command`]s from the loop and hands back [`Event`]s, waking the loop with a mio
//! `Waker`. Its job, in order, on every connection to etcd:
//!
//! 1. a lease of `ttl` seconds (the old one if it is still alive after an outage), kept alive
//!    every third of it;
//! 2. a host index, claimed by a transaction (`hosts/<index>` must not exist; the old index
//!    preferred), bound to the lease; then this daemon's vRNICs put back if the lease is new;
//! 3. a snapshot of everything under the prefix ([`Event::Registered`], [`Event::Snapshot`]),
//!    then a watch from the snapshot's revision on, each change an [`Event::Host`] or
//!    [`Event::Vnic`] as it comes.
//!
//! A vRNIC is created by one transaction: its record under its LID's key, its GID's and its
//! virtual IP's claim keys, all three required not to exist, all bound to the lease; a
//! candidate another daemon claimed first fails it and the next is tried. Any error (etcd
//! gone, the lease lost, the watch cancelled) reports [`Event::Down`], and the session
//! connects again until etcd answers; meanwhile commands are answered with the error at once.

use std::collections::{BTreeMap, BTreeSet};
use std::net::Ipv4Addr;
use std::sync::Arc;
use std::sync::mpsc::Sender;
use std::time::Duration;

use etcd_client::{
    Certificate, Client, Compare, CompareOp, ConnectOptions, EventType, GetOptions, Identity,
    PutOptions, TlsOptions, Txn, TxnOp, WatchOptions,
};
use tokio::sync::mpsc::UnboundedReceiver;
use tracing::{debug, info, warn};

use super::alloc;
use super::records::{
    self, HOSTS, HostRecord, Key, PREFIX, VNICS, VnicRecord, host_key, ip_key, ip_prefix, vnic_key,
};
use crate::server::peers::MAX_HOSTS;

/// How long etcd gets to answer one request.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(3);
/// How long a connection to etcd may take.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(1);
/// How soon a lost etcd is tried again.
const RETRY: Duration = Duration::from_millis(500);
/// Most transactions one vRNIC's creation tries.
const CREATE_TRIES: u32 = 16;

/// What the loop asks of the session.
#[derive(Debug)]
pub(super) enum Command {
    /// Claim a LID, GID and virtual IP for vRNIC `name` (`ip`: that address, else a free
    /// one) and register it.
    Create {
        req: u64,
        name: String,
        group: String,
        ip: Option<Ipv4Addr>,
    },
    /// The vRNIC with LID `lid` is gone: its keys are deleted.
    Release { lid: u16 },
    /// The daemon stops: the lease is revoked (every key goes at once).
    Stop,
}

/// What the session tells the loop.
#[derive(Debug)]
pub(super) enum Event {
    /// This daemon holds host index `host` (after each connection to etcd).
    Registered { host: u32 },
    /// Everything etcd holds now: replaces what the loop knew.
    Snapshot {
        hosts: BTreeMap<u32, HostRecord>,
        vnics: BTreeMap<u16, VnicRecord>,
    },
    /// A host registered (`Some`) or left.
    Host(u32, Option<HostRecord>),
    /// A vRNIC registered (`Some`) or left.
    Vnic(u16, Option<VnicRecord>),
    /// The answer to [`Command::Create`].
    Created {
        req: u64,
        result: Result<VnicRecord, String>,
    },
    /// One of this daemon's vRNICs could not be registered again after an outage (another
    /// daemon claimed its LID, GID or IP meanwhile).
    Lost { lid: u16, why: String },
    /// etcd cannot be reached (or the lease was lost): why.
    Down(String),
    /// etcd refused this daemon's credentials (or their lack) before it ever registered: the
    /// daemon stops with this error.
    Fatal(String),
}

/// What the session needs to know.
#[derive(Debug, Clone)]
pub(super) struct Config {
    pub(super) endpoints: Vec<String>,
    /// etcd's user and password (`None`: no authentication).
    pub(super) credentials: Option<Credentials>,
    /// TLS to etcd (`None`: plain `http://`).
    pub(super) tls: Option<super::TlsFiles>,
    pub(super) ttl_s: i64,
    pub(super) me: HostRecord,
    pub(super) seed: u64,
}

/// An etcd user and its password (never printed).
#[derive(Clone)]
pub(super) struct Credentials {
    pub(super) user: String,
    pub(super) password: String,
}

impl std::fmt::Debug for Credentials {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Credentials {{ user: {:?}, .. }}", self.user)
    }
}

/// Hands events to the loop and wakes it.
pub(super) struct Out {
    pub(super) tx: Sender<Event>,
    pub(super) waker: Arc<mio::Waker>,
}

impl Out {
    fn send(&self, e: Event) {
        if self.tx.send(e).is_ok() {
            let _ = self.waker.wake();
        }
    }
}

/// What survives a lost connection: the lease (etcd may still hold it), the host index, and
/// this daemon's vRNIC records.
#[derive(Default)]
struct Registration {
    lease: Option<i64>,
    host: Option<u32>,
    mine: BTreeMap<u16, VnicRecord>,
    /// Every key this daemon wrote and holds, with the value it wrote: its host record, its
    /// vRNICs' records and their GID and IP claims. A change by another writer is undone.
    owned: BTreeMap<String, Owned>,
    tries: u64,
}

/// A key this daemon wrote.
struct Owned {
    value: Vec<u8>,
    /// The vRNIC it belongs to (`None`: the host record).
    lid: Option<u16>,
}

impl Registration {
    /// Holds host index `i`, whose record is `value`.
    fn keep_host(&mut self, i: u32, value: Vec<u8>) {
        self.owned.retain(|_, o| o.lid.is_some());
        self.owned.insert(host_key(i), Owned { value, lid: None });
        self.host = Some(i);
    }

    /// Holds vRNIC `rec` and its claims.
    fn keep(&mut self, rec: VnicRecord) {
        for (key, value) in owned_keys(&rec) {
            let lid = Some(rec.lid);
            self.owned.insert(key, Owned { value, lid });
        }
        self.mine.insert(rec.lid, rec);
    }

    /// No longer holds the vRNIC with LID `lid`.
    fn forget(&mut self, lid: u16) -> Option<VnicRecord> {
        let rec = self.mine.remove(&lid)?;
        for (key, _) in owned_keys(&rec) {
            self.owned.remove(&key);
        }
        Some(rec)
    }
}

/// A vRNIC's keys and the values its daemon writes there: its record, its GID's and its IP's
/// claims (each the LID).
fn owned_keys(rec: &VnicRecord) -> Vec<(String, Vec<u8>)> {
    let lid = rec.lid.to_string().into_bytes();
    let mut keys = vec![
        (vnic_key(rec.lid), rec.encode()),
        (ip_key(&rec.group, rec.ip), lid.clone()),
    ];
    if let Some(gid) = rec.gid_bytes() {
        keys.push((records::gid_key(&gid), lid));
    }
    keys
}

/// A live connection.
struct Live {
    client: Client,
    keeper: etcd_client::LeaseKeeper,
    alive: etcd_client::LeaseKeepAliveStream,
    watch: etcd_client::WatchStream,
}

/// Why the session lost etcd.
#[derive(Debug)]
struct Error {
    why: String,
    /// etcd refused the credentials, or their lack.
    refused: Option<Refusal>,
}

/// How etcd refused this daemon.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Refusal {
    /// Wrong user name or password.
    BadPassword,
    /// The user's roles do not grant what the daemon needs.
    PermissionDenied,
    /// etcd requires authentication and none was given.
    Required,
    /// A user was given but etcd has authentication disabled.
    NotEnabled,
    /// etcd's TLS refused this daemon's client certificate (none given, or one its CA did not
    /// sign).
    ClientCertificate,
    /// etcd's server certificate does not chain to `--etcd-ca` (or does not name its address):
    /// not the etcd this daemon was told to trust.
    ServerCertificate,
}

impl From<String> for Error {
    fn from(why: String) -> Error {
        Error { why, refused: None }
    }
}

impl From<&str> for Error {
    fn from(why: &str) -> Error {
        why.to_string().into()
    }
}

impl Refusal {
    /// How etcd refused, if this error is a refusal of the credentials.
    fn of(e: &etcd_client::Error) -> Option<Refusal> {
        // rustls's alerts and verdicts, as the transport error's causes word them.
        let all = format!("{} {e:?}", chain(e));
        if [
            "BadCertificate",
            "CertificateRequired",
            "UnknownCA",
            "bad certificate",
        ]
        .iter()
        .any(|a| all.contains(a))
        {
            return Some(Refusal::ClientCertificate);
        }
        if all.contains("invalid peer certificate") {
            return Some(Refusal::ServerCertificate);
        }
        let etcd_client::Error::GRpcStatus(s) = e else {
            return None;
        };
        let m = s.message();
        if m.contains("invalid user ID or password") {
            Some(Refusal::BadPassword)
        } else if m.contains("permission denied") {
            Some(Refusal::PermissionDenied)
        } else if m.contains("user name is empty") {
            Some(Refusal::Required)
        } else if m.contains("authentication is not enabled") {
            Some(Refusal::NotEnabled)
        } else {
            None
        }
    }
}

fn err(what: &str) -> impl Fn(etcd_client::Error) -> Error + '_ {
    move |e| {
        let refused = Refusal::of(&e);
        // A refusal keeps the whole text (`describe` words it, with the TLS verdict from it);
        // anything else is said plainly, without gRPC's and the transport's wrappings.
        let why = match (&refused, &e) {
            (Some(_), _) => format!("{what}: {}", chain(&e)),
            // The status's message may say no more than "tcp connect error": its causes,
            // in its debug form, say which.
            (None, etcd_client::Error::GRpcStatus(s)) => format!(
                "{what} failed: {}",
                plain_cause(
                    Some(s.code().description()),
                    &format!("{} {{{}}} {e:?}", s.message(), chain(&e))
                )
            ),
            (None, _) => format!(
                "{what} failed: {}",
                plain_cause(None, &format!("{} {{{e:?}}}", chain(&e)))
            ),
        };
        Error { why, refused }
    }
}

/// What went wrong between the daemon and etcd, in a user's words: from a gRPC status's
/// `code` (its description) and message, or from a transport error's text alone.
fn plain_cause(code: Option<&str>, text: &str) -> String {
    let t = text.to_ascii_lowercase();
    if t.contains("connection refused") || t.contains("connectionrefused") {
        "connection refused (nothing listens there: is etcd running, on that address and port?)"
            .into()
    } else if t.contains("dns error") || t.contains("failed to lookup") {
        "its host name does not resolve".into()
    } else if t.contains("timed out") || t.contains("deadline") || t.contains("elapsed") {
        "no answer in time (a firewall, or a host that is down?)".into()
    } else if t.contains("no route to host") || t.contains("network is unreachable") {
        "no route to it (network unreachable)".into()
    } else if t.contains("connection reset") || t.contains("broken pipe") {
        "the connection was cut (etcd restarted or went away)".into()
    } else if t.contains("connect error") {
        "cannot connect to it".into()
    } else if t.contains("invalid http version") || t.contains("http2 error") {
        "something that is not etcd's gRPC answers there (wrong port, or https:// against \
         plain http?)"
            .into()
    } else if t.contains("leader") {
        "etcd has no leader (its cluster lost quorum)".into()
    } else {
        // The message alone, without gRPC's `status:`/`details:`/`metadata:` dump and the
        // causes' debug forms (after ` {`).
        let m = text
            .split(", details:")
            .next()
            .unwrap_or(text)
            .split(" {")
            .next()
            .unwrap_or(text)
            .trim_start_matches("status: ")
            .trim();
        match code {
            Some(c) => format!("etcd answered \"{c}\": {m}"),
            None => m.to_string(),
        }
    }
}

/// rustls's verdict on a server certificate (`UnknownIssuer`, `NotValidForName`, ...), from
/// an error's text.
fn tls_verdict(why: &str) -> &str {
    why.split("invalid peer certificate: ")
        .nth(1)
        .and_then(|r| r.split(['"', ')', ',', ';']).next())
        .unwrap_or("its chain or name did not verify")
}

/// An error with its causes (a transport error says no more than "transport error"; its
/// causes say which: a refused connection, an unknown certificate authority, ...).
fn chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut cause = e.source();
    while let Some(c) = cause {
        let t = c.to_string();
        if !s.contains(&t) {
            s.push_str(": ");
            s.push_str(&t);
        }
        cause = c.source();
    }
    s
}

/// One line that says what happened, naming etcd and, for a refusal, the user.
fn describe(cfg: &Config, e: &Error) -> String {
    let etcd = cfg.endpoints.join(",");
    let user = cfg.credentials.as_ref().map_or("", |c| c.user.as_str());
    match e.refused {
        None => format!("etcd at {etcd}: {}", e.why),
        Some(Refusal::BadPassword) => {
            format!("etcd at {etcd} refused user {user:?}: wrong user name or password")
        }
        Some(Refusal::PermissionDenied) if user.is_empty() => {
            format!("etcd at {etcd} denied access to {PREFIX}: authenticate with --etcd-user")
        }
        Some(Refusal::PermissionDenied) => format!(
            "etcd at {etcd} denied user {user:?} access to {PREFIX}: grant its role readwrite \
             on the prefix /vrnic/"
        ),
        Some(Refusal::Required) => format!(
            "etcd at {etcd} requires authentication: give --etcd-user and --etcd-password-file"
        ),
        Some(Refusal::ClientCertificate) => format!(
            "etcd at {etcd} refused this daemon's TLS client certificate (none given, or not \
             signed by a CA etcd trusts): give --etcd-cert and --etcd-key"
        ),
        Some(Refusal::ServerCertificate) => format!(
            "etcd at {etcd} presented a TLS certificate that --etcd-ca does not vouch for \
             ({}): not the etcd this daemon trusts",
            tls_verdict(&e.why)
        ),
        Some(Refusal::NotEnabled) => format!(
            "etcd at {etcd} has authentication disabled but --etcd-user {user:?} was given: \
             enable it (etcdctl auth enable) or start without --etcd-user"
        ),
    }
}

/// The session's thread body: runs until [`Command::Stop`] or the loop is gone.
pub(super) fn run(cfg: Config, mut cmds: UnboundedReceiver<Command>, out: Out) {
    let rt = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            out.send(Event::Down(format!(
                "cannot start the etcd client's runtime: {e}"
            )));
            return;
        }
    };
    rt.block_on(async move {
        let mut reg = Registration::default();
        let mut releases = Vec::new();
        // Whether the session has registered since the daemon started.
        let mut registered = false;
        loop {
            let r = {
                let establish = establish(&cfg, &mut reg, &out);
                tokio::pin!(establish);
                loop {
                    tokio::select! {
                        r = &mut establish => break r,
                        c = cmds.recv() => match c {
                            None | Some(Command::Stop) => return,
                            Some(Command::Release { lid }) => releases.push(lid),
                            Some(Command::Create { req, .. }) => out.send(Event::Created {
                                req,
                                result: Err("etcd is not reachable yet (connecting)".into()),
                            }),
                        },
                    }
                }
            };
            let why = match r {
                Ok(mut live) => {
                    registered = true;
                    for lid in releases.drain(..) {
                        release(&mut live.client, &mut reg, lid).await;
                    }
                    match serve(&cfg, &mut reg, &mut live, &mut cmds, &out).await {
                        Ok(()) => {
                            if let Some(id) = reg.lease {
                                let _ = tokio::time::timeout(
                                    Duration::from_secs(1),
                                    live.client.lease_revoke(id),
                                )
                                .await;
                            }
                            return;
                        }
                        Err(why) => why,
                    }
                }
                Err(why) => why,
            };
            if why.refused.is_some() && !registered {
                // Credentials etcd refuses will not do better on the next try.
                out.send(Event::Fatal(describe(&cfg, &why)));
                return;
            }
            out.send(Event::Down(describe(&cfg, &why)));
            // Wait a while before connecting again, answering what comes meanwhile.
            let pause = tokio::time::sleep(RETRY);
            tokio::pin!(pause);
            loop {
                tokio::select! {
                    _ = &mut pause => break,
                    c = cmds.recv() => match c {
                        None | Some(Command::Stop) => return,
                        Some(Command::Release { lid }) => releases.push(lid),
                        Some(Command::Create { req, .. }) => out.send(Event::Created {
                            req,
                            result: Err("etcd is not reachable".into()),
                        }),
                    },
                }
            }
        }
    });
}

/// Connects, takes or keeps the lease, claims the host index, puts back this daemon's vRNICs
/// if the lease is new, reports the snapshot and starts the watch after it.
async fn establish(cfg: &Config, reg: &mut Registration, out: &Out) -> Result<Live, Error> {
    let mut opts = ConnectOptions::new()
        .with_connect_timeout(CONNECT_TIMEOUT)
        .with_timeout(REQUEST_TIMEOUT)
        .with_keep_alive(Duration::from_secs(1), Duration::from_secs(1));
    if let Some(c) = &cfg.credentials {
        opts = opts
            .with_user(c.user.clone(), c.password.clone())
            .with_auto_token_refresh(true);
    }
    if let Some(t) = &cfg.tls {
        let mut tls = TlsOptions::new().ca_certificate(Certificate::from_pem(&t.ca));
        if let Some((cert, key)) = &t.identity {
            tls = tls.identity(Identity::from_pem(cert, key));
        }
        opts = opts.with_tls(tls);
    }
    let mut client = Client::connect(&cfg.endpoints, Some(opts))
        .await
        .map_err(err("connect"))?;
    if let Some(id) = reg.lease {
        let ttl = client
            .lease_time_to_live(id, None)
            .await
            .map_err(err("look up the lease"))?
            .ttl();
        if ttl <= 0 {
            reg.lease = None;
        }
    }
    let fresh = reg.lease.is_none();
    let lease = match reg.lease {
        Some(id) => id,
        None => {
            let id = client
                .lease_grant(cfg.ttl_s, None)
                .await
                .map_err(err("grant a lease"))?
                .id();
            reg.lease = Some(id);
            id
        }
    };
    if fresh || reg.host.is_none() {
        let i = claim_host(&mut client, cfg, reg.host, lease).await?;
        reg.keep_host(i, cfg.me.encode());
    }
    let host = reg.host.unwrap_or_default();
    if fresh {
        let mine = std::mem::take(&mut reg.mine);
        reg.owned.retain(|_, o| o.lid.is_none());
        for (lid, mut rec) in mine {
            rec.host = host;
            match claim(&mut client, &rec, lease).await? {
                true => reg.keep(rec),
                false => out.send(Event::Lost {
                    lid,
                    why: "its LID, GID or IP was claimed by another host while etcd was away"
                        .into(),
                }),
            }
        }
    }
    let (keeper, alive) = client
        .lease_keep_alive(lease)
        .await
        .map_err(err("keep the lease alive"))?;
    let snap = client
        .get(PREFIX, Some(GetOptions::new().with_prefix()))
        .await
        .map_err(err("read the directory"))?;
    let rev = snap.header().map_or(0, |h| h.revision());
    let mut hosts = BTreeMap::from([(host, cfg.me.clone())]);
    let mut vnics = BTreeMap::new();
    // This daemon's own keys are checked against what it wrote (another writer may have
    // changed them while the session was away), never taken from etcd.
    let mut foreign = Vec::new();
    let mut seen = BTreeSet::new();
    for kv in snap.kvs() {
        if let Some((key, o)) = owned(reg, kv.key()) {
            seen.insert(key.to_string());
            if kv.value() != o.value || kv.lease() != lease {
                foreign.push((key.to_string(), Foreign::Changed(kv.mod_revision())));
            }
            continue;
        }
        match decode(kv.key(), Some(kv.value())) {
            Some(Event::Host(i, Some(r))) => {
                hosts.insert(i, r);
            }
            Some(Event::Vnic(l, Some(r))) => {
                vnics.insert(l, r);
            }
            _ => {}
        }
    }
    for key in reg.owned.keys() {
        if !seen.contains(key) {
            foreign.push((key.clone(), Foreign::Deleted));
        }
    }
    for (key, how) in foreign {
        restore(&mut client, reg, &key, how, out).await?;
    }
    let watch = client
        .watch(
            PREFIX,
            Some(
                WatchOptions::new()
                    .with_prefix()
                    .with_start_revision(rev + 1),
            ),
        )
        .await
        .map_err(err("watch the directory"))?;
    out.send(Event::Registered { host });
    out.send(Event::Snapshot { hosts, vnics });
    debug!(host, lease, rev, "registered in etcd");
    Ok(Live {
        client,
        keeper,
        alive,
        watch,
    })
}

/// The key `key` and what this daemon wrote there, if it is one of its own.
fn owned<'a>(reg: &'a Registration, key: &[u8]) -> Option<(&'a str, &'a Owned)> {
    let key = std::str::from_utf8(key).ok()?;
    reg.owned.get_key_value(key).map(|(k, o)| (k.as_str(), o))
}

/// How another writer touched a key of this daemon's.
#[derive(Debug, Clone, Copy)]
enum Foreign {
    /// Put another value, or bound it to another lease (or none), at this revision.
    Changed(i64),
    /// Deleted it.
    Deleted,
}

/// Another writer changed or deleted `key`, one of this daemon's: it is put back as this
/// daemon wrote it, bound to its lease, provided nothing touched it since (a changed key: its
/// revision is still that change's; a later change comes as an event of its own and is undone
/// then). A deleted key is put back only if it is still absent: if it was claimed again
/// meanwhile (another daemon may have, honestly, for a key that was free), the claim is lost
/// and this daemon fails safe: a vRNIC's keys are dropped and the loop removes the vRNIC
/// ([`Event::Lost`]); the host record's loss revokes the lease and registers anew. An error
/// (etcd gone, the write refused) ends the connection; the next one checks every key again
/// before it serves.
async fn restore(
    client: &mut Client,
    reg: &mut Registration,
    key: &str,
    how: Foreign,
    out: &Out,
) -> Result<(), Error> {
    let (Some(lease), Some(o)) = (reg.lease, reg.owned.get(key)) else {
        return Ok(());
    };
    let (value, lid) = (o.value.clone(), o.lid);
    let (cmp, what) = match how {
        Foreign::Changed(rev) => (Compare::mod_revision(key, CompareOp::Equal, rev), "changed"),
        Foreign::Deleted => (
            Compare::create_revision(key, CompareOp::Equal, 0),
            "deleted",
        ),
    };
    warn!(
        key,
        "another writer {what} this daemon's record in etcd: putting it back as written"
    );
    let txn = Txn::new().when([cmp]).and_then([TxnOp::put(
        key,
        value,
        Some(PutOptions::new().with_lease(lease)),
    )]);
    let done = client
        .txn(txn)
        .await
        .map_err(err("put back a record another writer changed"))?
        .succeeded();
    match (done, how, lid) {
        (true, ..) => {
            info!(key, "record put back in etcd as this daemon wrote it");
            Ok(())
        }
        // Changed again since: that change's event follows.
        (false, Foreign::Changed(_), _) => Ok(()),
        (false, Foreign::Deleted, Some(lid)) => {
            release(client, reg, lid).await;
            out.send(Event::Lost {
                lid,
                why: format!(
                    "its key {key} was deleted in etcd by another writer and claimed again \
                     before this daemon could put it back"
                ),
            });
            Ok(())
        }
        (false, Foreign::Deleted, None) => {
            let _ = client.lease_revoke(lease).await;
            reg.lease = None;
            Err(format!(
                "this host's record {key} was deleted in etcd by another writer and its index \
                 claimed again: registering anew"
            )
            .into())
        }
    }
}

/// Claims a host index (`prefer` if free) bound to `lease`.
async fn claim_host(
    client: &mut Client,
    cfg: &Config,
    prefer: Option<u32>,
    lease: i64,
) -> Result<u32, Error> {
    for _ in 0..MAX_HOSTS {
        let used: BTreeSet<u32> = client
            .get(
                HOSTS,
                Some(GetOptions::new().with_prefix().with_keys_only()),
            )
            .await
            .map_err(err("read the hosts"))?
            .kvs()
            .iter()
            .filter_map(|kv| match Key::parse(kv.key()) {
                Some(Key::Host(i)) => Some(i),
                _ => None,
            })
            .collect();
        let Some(i) = alloc::pick_host(&used, prefer, MAX_HOSTS) else {
            return Err(format!("the cluster has its limit of {MAX_HOSTS} hosts").into());
        };
        let key = host_key(i);
        let txn = Txn::new()
            .when([Compare::create_revision(key.as_str(), CompareOp::Equal, 0)])
            .and_then([TxnOp::put(
                key.as_str(),
                cfg.me.encode(),
                Some(PutOptions::new().with_lease(lease)),
            )]);
        if client
            .txn(txn)
            .await
            .map_err(err("claim a host index"))?
            .succeeded()
        {
            return Ok(i);
        }
    }
    Err("no host index could be claimed".into())
}

/// One transaction: `rec`'s LID, GID and IP keys must not exist; then all three are put,
/// bound to `lease`. False if one existed.
async fn claim(client: &mut Client, rec: &VnicRecord, lease: i64) -> Result<bool, Error> {
    let Some(gid) = rec.gid_bytes() else {
        return Ok(false);
    };
    let keys = [
        vnic_key(rec.lid),
        records::gid_key(&gid),
        ip_key(&rec.group, rec.ip),
    ];
    let lid = rec.lid.to_string();
    let put = |k: &str, v: Vec<u8>| TxnOp::put(k, v, Some(PutOptions::new().with_lease(lease)));
    let txn = Txn::new()
        .when(
            keys.iter()
                .map(|k| Compare::create_revision(k.as_str(), CompareOp::Equal, 0))
                .collect::<Vec<_>>(),
        )
        .and_then([
            put(&keys[0], rec.encode()),
            put(&keys[1], lid.clone().into_bytes()),
            put(&keys[2], lid.into_bytes()),
        ]);
    Ok(client
        .txn(txn)
        .await
        .map_err(err("claim a LID, GID and IP"))?
        .succeeded())
}

/// Creates a vRNIC's record: candidates from what etcd holds, claimed by transaction.
async fn create(
    client: &mut Client,
    reg: &mut Registration,
    seed: u64,
    (name, group, want): (String, String, Option<Ipv4Addr>),
) -> Result<Result<VnicRecord, String>, Error> {
    let (Some(lease), Some(host)) = (reg.lease, reg.host) else {
        return Ok(Err("not registered in etcd".into()));
    };
    if let Some(ip) = want
        && !records::unicast_vip(ip)
    {
        return Ok(Err(format!(
            "{ip} is not a unicast address a vRNIC can have"
        )));
    }
    for _ in 0..CREATE_TRIES {
        reg.tries += 1;
        let lids: BTreeSet<u16> = client
            .get(
                VNICS,
                Some(GetOptions::new().with_prefix().with_keys_only()),
            )
            .await
            .map_err(err("read the LIDs"))?
            .kvs()
            .iter()
            .filter_map(|kv| match Key::parse(kv.key()) {
                Some(Key::Vnic(l)) => Some(l),
                _ => None,
            })
            .collect();
        let ips: BTreeSet<Ipv4Addr> = client
            .get(
                ip_prefix(&group),
                Some(GetOptions::new().with_prefix().with_keys_only()),
            )
            .await
            .map_err(err("read the group's addresses"))?
            .kvs()
            .iter()
            .filter_map(|kv| records::ip_of_key(&group, kv.key()))
            .collect();
        let ip = match want {
            Some(ip) if ips.contains(&ip) => {
                return Ok(Err(format!("{ip} is already used in group {group}")));
            }
            Some(ip) => ip,
            None => match alloc::pick_vip(&ips, host) {
                Some(ip) => ip,
                None => return Ok(Err(format!("group {group} has no free address left"))),
            },
        };
        let start = alloc::start_lid(seed ^ reg.tries.wrapping_mul(0x1_0000_0001));
        let Some(lid) = alloc::pick_lid(&lids, start) else {
            return Ok(Err("the cluster has no free LID left".into()));
        };
        let (_, gid) = alloc::guid_gid(lid);
        let rec = VnicRecord {
            host,
            name: name.clone(),
            lid,
            gid: records::hex(&gid),
            ip,
            group: group.clone(),
        };
        if claim(client, &rec, lease).await? {
            reg.keep(rec.clone());
            return Ok(Ok(rec));
        }
        debug!(lid, %ip, "a candidate was claimed by another host first; trying another");
    }
    Ok(Err(format!(
        "no LID and address could be claimed in {CREATE_TRIES} tries"
    )))
}

/// Deletes a removed vRNIC's keys (those of its claims that are still ours).
async fn release(client: &mut Client, reg: &mut Registration, lid: u16) {
    let Some(rec) = reg.forget(lid) else {
        return;
    };
    let Some(lease) = reg.lease else { return };
    let mut keys = vec![vnic_key(lid), ip_key(&rec.group, rec.ip)];
    if let Some(gid) = rec.gid_bytes() {
        keys.push(records::gid_key(&gid));
    }
    // Only keys of our lease: never another daemon's claim.
    let ops: Vec<TxnOp> = keys
        .iter()
        .map(|k| {
            TxnOp::txn(
                Txn::new()
                    .when([Compare::lease(k.as_str(), CompareOp::Equal, lease)])
                    .and_then([TxnOp::delete(k.as_str(), None)]),
            )
        })
        .collect();
    if let Err(e) = client.txn(Txn::new().and_then(ops)).await {
        warn!(
            lid,
            "could not delete a removed vRNIC's keys from etcd: {e}"
        );
    }
}

/// Serves a live connection until it fails (`Err`) or the daemon stops (`Ok`).
async fn serve(
    cfg: &Config,
    reg: &mut Registration,
    live: &mut Live,
    cmds: &mut UnboundedReceiver<Command>,
    out: &Out,
) -> Result<(), Error> {
    let period = Duration::from_millis((cfg.ttl_s.max(1) as u64) * 1000 / 3);
    let mut tick = tokio::time::interval(period);
    loop {
        tokio::select! {
            _ = tick.tick() => live.keeper.keep_alive().await.map_err(err("keep the lease alive"))?,
            m = live.alive.message() => match m.map_err(err("keep the lease alive"))? {
                Some(r) if r.ttl() > 0 => {}
                Some(_) => {
                    // Expired: everything of ours is gone from etcd.
                    reg.lease = None;
                    return Err("the lease expired".into());
                }
                None => return Err("the lease's keep-alive stream closed".into()),
            },
            m = live.watch.message() => {
                let Some(resp) = m.map_err(err("watch"))? else {
                    return Err("the watch closed".into());
                };
                if resp.canceled() {
                    return Err(
                        format!("the watch was cancelled: {}", resp.cancel_reason()).into()
                    );
                }
                for ev in resp.events() {
                    let Some(kv) = ev.kv() else { continue };
                    let put = ev.event_type() == EventType::Put;
                    if let Some((key, o)) = owned(reg, kv.key()) {
                        // One of this daemon's keys: its own write, or another writer's undone.
                        if put && kv.value() == o.value && Some(kv.lease()) == reg.lease {
                            continue;
                        }
                        // The event may be older than this daemon's own latest write of the
                        // key (a vRNIC removed and another made with the same address: the
                        // first one's delete arrives after the second one's claim), so what
                        // counts is the key as it is now.
                        let (key, value) = (key.to_string(), o.value.clone());
                        let now = live
                            .client
                            .get(key.as_str(), None)
                            .await
                            .map_err(err("read back a record of this daemon's"))?;
                        let how = match now.kvs().first() {
                            Some(c) if c.value() == value && Some(c.lease()) == reg.lease => {
                                continue;
                            }
                            Some(c) if put => Foreign::Changed(c.mod_revision()),
                            Some(_) | None => Foreign::Deleted,
                        };
                        restore(&mut live.client, reg, &key, how, out).await?;
                        continue;
                    }
                    let value = put.then(|| kv.value());
                    if let Some(e) = decode(kv.key(), value) {
                        out.send(e);
                    }
                }
            }
            c = cmds.recv() => match c {
                None | Some(Command::Stop) => return Ok(()),
                Some(Command::Release { lid }) => release(&mut live.client, reg, lid).await,
                Some(Command::Create { req, name, group, ip }) => {
                    let result = create(&mut live.client, reg, cfg.seed, (name, group, ip)).await;
                    match result {
                        Ok(result) => out.send(Event::Created { req, result }),
                        Err(why) => {
                            out.send(Event::Created { req, result: Err(describe(cfg, &why)) });
                            return Err(why);
                        }
                    }
                }
            },
        }
    }
}

/// A key and its value (`None`: deleted) as an event; a malformed record is logged and
/// dropped.
fn decode(key: &[u8], value: Option<&[u8]>) -> Option<Event> {
    let k = Key::parse(key)?;
    let shown = || String::from_utf8_lossy(key).into_owned();
    match (k, value) {
        (Key::Host(i), None) => Some(Event::Host(i, None)),
        (Key::Vnic(l), None) => Some(Event::Vnic(l, None)),
        (Key::Host(i), Some(v)) => match HostRecord::decode(v) {
            Ok(r) => Some(Event::Host(i, Some(r))),
            Err(e) => {
                warn!(
                    key = shown(),
                    "a malformed host record in etcd, ignored: {e}"
                );
                None
            }
        },
        (Key::Vnic(l), Some(v)) => match VnicRecord::decode(l, v) {
            Ok(r) => Some(Event::Vnic(l, Some(r))),
            Err(e) => {
                warn!(
                    key = shown(),
                    "a malformed vRNIC record in etcd, ignored: {e}"
                );
                None
            }
        },
        (Key::Claim, _) => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn etcd_failures_are_said_plainly_without_grpc_wrappings() {
        let raw = "status: Unavailable, message: \"error trying to connect: tcp connect error: \
                   Connection refused (os error 111)\", details: [], metadata: MetadataMap { \
                   headers: {} }";
        let c = plain_cause(Some("The service is currently unavailable"), raw);
        assert!(
            c.starts_with("connection refused (nothing listens there"),
            "{c}"
        );
        let c = plain_cause(None, "transport error: dns error: failed to lookup address");
        assert_eq!(c, "its host name does not resolve");
        let c = plain_cause(
            Some("Some requested entity was not found"),
            "status: NotFound, message: \"lease not found\", details: [], metadata: x",
        );
        assert!(!c.contains("details") && !c.contains("metadata"), "{c}");
        assert!(
            c.contains("lease not found") && c.contains("not found"),
            "{c}"
        );
        // tonic's status says only "tcp connect error"; its source's debug form says why.
        let c = plain_cause(
            Some("The service is currently unavailable"),
            "tcp connect error {} GRpcStatus(Status { source: Some(ConnectError(\"tcp connect \
             error\", Os { code: 111, kind: ConnectionRefused }))})",
        );
        assert!(c.starts_with("connection refused"), "{c}");
    }

    #[test]
    fn watch_events_decode_and_malformed_records_are_dropped() {
        let rec = HostRecord {
            addr: "10.77.0.2:7700".parse().unwrap(),
            addrs: vec![],
        };
        let k = host_key(4);
        assert!(matches!(
            decode(k.as_bytes(), Some(&rec.encode())),
            Some(Event::Host(4, Some(r))) if r == rec
        ));
        assert!(matches!(
            decode(k.as_bytes(), None),
            Some(Event::Host(4, None))
        ));
        assert!(decode(k.as_bytes(), Some(b"garbage")).is_none());
        assert!(decode(vnic_key(9).as_bytes(), Some(b"{}")).is_none());
        assert!(matches!(
            decode(vnic_key(9).as_bytes(), None),
            Some(Event::Vnic(9, None))
        ));
        let claim = records::ip_key("red", Ipv4Addr::new(10, 0, 0, 1));
        assert!(decode(claim.as_bytes(), Some(b"9")).is_none());
        assert!(decode(b"/vrnic/v1/unknown", Some(b"x")).is_none());
    }
}
