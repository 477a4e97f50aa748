//! Hosts for across-host tests: network namespaces, each with one address on a bridge that
//! lives in a namespace of its own (the "switch"), a daemon per host with peer links to the
//! others (a static peer list, or, for cluster mode, an etcd of the test's own in a namespace
//! of its own on the same bridge: [`Hosts::etcd`]). Each host has a peer-link key of its own
//! (`vrnic keygen`), and its daemon is given the others' public keys, so links are
//! authenticated as the README's recipe makes them. Everything is created by the test under
//! unique names and removed on drop; no address outside these namespaces is used.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use super::{CLI, Daemon, Pair, Proc, c_check_pair_across, vrnic_bin};

/// The port daemons listen on for peer links (inside their own namespaces).
pub const PEER_PORT: u16 = 7700;

static SEQ: AtomicU32 = AtomicU32::new(0);

/// Hosts joined by a switch; removed (namespaces, links) on drop.
pub struct Hosts {
    /// Each host's network namespace.
    pub names: Vec<String>,
    switch: String,
    /// Namespaces of the test's infrastructure (etcd's).
    extra: std::cell::RefCell<Vec<String>>,
    /// Where the hosts' key files are.
    keys: PathBuf,
    /// Each host's public key.
    publics: Vec<String>,
}

/// A two-process C check across two fresh hosts (their daemons' links up within 20 s):
/// `BIN server PORT args...` on host 0 and its client on host 1, reaching host 0's address,
/// within `limit` ([`c_check_pair_across`]); both must exit 0. Returns the pair, and the
/// hosts and their daemons, to ask them afterwards (bound as `let (pair, _hosts, ds)`, the
/// daemons are dropped before the hosts that run them).
pub fn c_check_across_hosts(
    bin: &Path,
    args: &[&str],
    limit: Duration,
) -> (Pair, Hosts, Vec<Daemon>) {
    let hosts = Hosts::new(2);
    let ds = hosts.daemons(Duration::from_secs(20));
    let pair = c_check_pair_across(&ds[0], &ds[1], &hosts.addr(0), bin, args, limit);
    (pair, hosts, ds)
}

/// Makes a key file at `path` with `vrnic keygen`; returns its public key.
pub fn keygen(path: &std::path::Path) -> String {
    let mut c = Command::new(vrnic_bin());
    c.arg("keygen").arg(path);
    let out = Proc::spawn(c, "vrnic keygen").wait(CLI);
    assert!(out.ok(), "vrnic keygen failed\n{}", out.text());
    let public = out.stdout.trim().to_string();
    assert_eq!(public.len(), 64, "a public key: {public}");
    public
}

/// The etcd client port.
pub const ETCD_PORT: u16 = 2379;
/// How long etcd may take to listen.
const ETCD_START: Duration = Duration::from_secs(20);

/// An etcd server of the test's own (Debian's `etcd-server`), alone in a network namespace on
/// the hosts' bridge, its data in a temp dir; killed and its data removed on drop. Stop and
/// start it again to simulate an outage (its data stays).
pub struct Etcd {
    /// Its client URL (`http://ADDR:2379`, or `https://` with TLS).
    pub url: String,
    addr: String,
    netns: String,
    data: PathBuf,
    proc: Option<Proc>,
    /// With TLS: the dir of its certificates ([`Hosts::etcd_tls`]).
    pub tls: Option<PathBuf>,
}

/// Makes, with the `openssl` command, in `dir`: a CA (`ca.pem`), etcd's server certificate
/// for `addr` (`server.pem`, `server-key.pem`; also for client use, which etcd's own gateway
/// needs to reach its gRPC server when clients must present certificates) and a client certificate (`client.pem`,
/// `client-key.pem`, mode 600), each signed by the CA; and `other-ca.pem`, a CA that signed
/// nothing here.
pub fn make_certs(dir: &std::path::Path, addr: &str) {
    std::fs::create_dir_all(dir).expect("the certificates' dir");
    let script = format!(
        "set -e; cd '{}'; k='-newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes'
         openssl req -x509 $k -keyout ca-key.pem -out ca.pem -days 2 -subj /CN=vrnic-test-ca
         openssl req -x509 $k -keyout other-ca-key.pem -out other-ca.pem -days 2 -subj /CN=other
         openssl req $k -keyout server-key.pem -out server.csr -subj /CN=etcd
         printf 'subjectAltName=IP:{addr}\nextendedKeyUsage=serverAuth,clientAuth\n' > server.ext
         openssl x509 -req -in server.csr -CA ca.pem -CAkey ca-key.pem -CAcreateserial \
             -out server.pem -days 2 -extfile server.ext
         openssl req $k -keyout client-key.pem -out client.csr -subj /CN=vrnic
         printf 'extendedKeyUsage=clientAuth\n' > client.ext
         openssl x509 -req -in client.csr -CA ca.pem -CAkey ca-key.pem -CAcreateserial \
             -out client.pem -days 2 -extfile client.ext
         chmod 600 *-key.pem",
        dir.display()
    );
    let mut c = Command::new("bash");
    c.args(["-c", &script]);
    let out = Proc::spawn(c, "openssl").wait(CLI);
    assert!(
        out.ok(),
        "making the test's certificates failed\n{}",
        out.text()
    );
}

/// Runs `ip args...`, panicking with its output if it fails.
fn ip(args: &[&str]) {
    let mut c = Command::new("ip");
    c.args(args);
    let out = Proc::spawn(c, "ip").wait(CLI);
    assert!(out.ok(), "ip {} failed\n{}", args.join(" "), out.text());
}

/// Removes the namespaces of test processes that died without dropping their [`Hosts`]
/// (`vr<pid>x...` whose pid no longer runs).
fn remove_stale() {
    let Ok(dir) = std::fs::read_dir("/run/netns") else {
        return;
    };
    for e in dir.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        let pid = name
            .strip_prefix("vr")
            .and_then(|r| r.split('x').next())
            .and_then(|p| p.parse::<u32>().ok());
        if let Some(pid) = pid
            && !std::path::Path::new(&format!("/proc/{pid}")).exists()
        {
            let mut c = Command::new("ip");
            c.args(["netns", "del", &name]);
            let _ = Proc::spawn(c, "ip netns del").wait_timeout(CLI);
        }
    }
}

impl Hosts {
    /// `n` hosts, host `i` at 10.77.0.(i+1)/24. Needs root.
    pub fn new(n: usize) -> Hosts {
        super::require_root("across-host tests make network namespaces");
        remove_stale();
        let tag = format!(
            "vr{}x{}",
            std::process::id(),
            SEQ.fetch_add(1, Ordering::Relaxed)
        );
        let switch = format!("{tag}sw");
        let keys = std::env::temp_dir().join(format!("{tag}-keys"));
        let _ = std::fs::remove_dir_all(&keys);
        std::fs::create_dir_all(&keys).expect("a directory for the keys");
        let mut h = Hosts {
            names: Vec::new(),
            switch: switch.clone(),
            extra: Default::default(),
            publics: (0..n)
                .map(|i| keygen(&keys.join(format!("h{i}.key"))))
                .collect(),
            keys,
        };
        ip(&["netns", "add", &switch]);
        ip(&["-n", &switch, "link", "add", "br0", "type", "bridge"]);
        ip(&["-n", &switch, "link", "set", "br0", "up"]);
        for i in 0..n {
            let name = format!("{tag}h{i}");
            ip(&["netns", "add", &name]);
            h.names.push(name.clone());
            let port = format!("p{i}");
            ip(&[
                "-n", &name, "link", "add", "eth0", "type", "veth", "peer", "name", &port, "netns",
                &switch,
            ]);
            ip(&["-n", &switch, "link", "set", &port, "master", "br0", "up"]);
            let addr = format!("{}/24", h.addr(i));
            ip(&["-n", &name, "addr", "add", &addr, "dev", "eth0"]);
            ip(&["-n", &name, "link", "set", "eth0", "up"]);
            ip(&["-n", &name, "link", "set", "lo", "up"]);
        }
        h
    }

    /// An etcd on the hosts' bridge at 10.77.0.200, started and listening.
    pub fn etcd(&self) -> Etcd {
        self.etcd_with(false)
    }

    /// [`Hosts::etcd`] over TLS only (`https://`), authenticating its clients by certificate
    /// (`--client-cert-auth`): its certificates made by [`make_certs`] in [`Etcd::tls`].
    pub fn etcd_tls(&self) -> Etcd {
        self.etcd_with(true)
    }

    fn etcd_with(&self, tls: bool) -> Etcd {
        super::require("etcd");
        super::require("openssl");
        let netns = format!("{}etcd", self.switch.trim_end_matches("sw"));
        ip(&["netns", "add", &netns]);
        self.extra.borrow_mut().push(netns.clone());
        ip(&[
            "-n",
            &netns,
            "link",
            "add",
            "eth0",
            "type",
            "veth",
            "peer",
            "name",
            "pe",
            "netns",
            &self.switch,
        ]);
        ip(&[
            "-n",
            &self.switch,
            "link",
            "set",
            "pe",
            "master",
            "br0",
            "up",
        ]);
        ip(&["-n", &netns, "addr", "add", "10.77.0.200/24", "dev", "eth0"]);
        ip(&["-n", &netns, "link", "set", "eth0", "up"]);
        ip(&["-n", &netns, "link", "set", "lo", "up"]);
        let addr = "10.77.0.200".to_string();
        let data = std::env::temp_dir().join(format!("{netns}-data"));
        let _ = std::fs::remove_dir_all(&data);
        let certs = tls.then(|| {
            let dir = std::env::temp_dir().join(format!("{netns}-certs"));
            let _ = std::fs::remove_dir_all(&dir);
            make_certs(&dir, &addr);
            dir
        });
        let scheme = if tls { "https" } else { "http" };
        let mut e = Etcd {
            url: format!("{scheme}://{addr}:{ETCD_PORT}"),
            addr,
            netns,
            data,
            proc: None,
            tls: certs,
        };
        e.start();
        e
    }

    /// A daemon on host `i` in cluster mode on `etcd` with lease time to live `ttl_s`: host
    /// 0's from a config file (`etcd = [...]`), the others' from `--etcd`.
    pub fn cluster_daemon(&self, i: usize, etcd: &Etcd, ttl_s: u64) -> Daemon {
        self.cluster_daemon_with(i, etcd, ttl_s, &[])
    }

    /// [`Hosts::cluster_daemon`] with `extra` options for `vrnic serve`.
    pub fn cluster_daemon_with(&self, i: usize, etcd: &Etcd, ttl_s: u64, extra: &[&str]) -> Daemon {
        let listen = format!("{}:{PEER_PORT}", self.addr(i));
        let ttl = ttl_s.to_string();
        if i == 0 {
            let file = std::env::temp_dir().join(format!("{}.toml", self.names[i]));
            let text = format!(
                "listen = \"{listen}\"\netcd = [\"{}\"]\netcd_ttl = {ttl}\n{}",
                etcd.url,
                self.key_toml(i)
            );
            std::fs::write(&file, text).expect("write the config file");
            let file = file.display().to_string();
            let mut args = vec!["--config", &file];
            args.extend_from_slice(extra);
            return Daemon::start_in(Some(&self.names[i]), &args);
        }
        let key = self.key_file(i);
        let peer_keys = self.peer_key_args(i);
        let mut args = vec!["--listen", &listen, "--etcd", &etcd.url, "--etcd-ttl", &ttl];
        args.extend(["--key", key.as_str()]);
        args.extend(peer_keys.iter().map(String::as_str));
        args.extend_from_slice(extra);
        Daemon::start_in(Some(&self.names[i]), &args)
    }

    /// `vrnic serve` on host 0 in cluster mode on `etcd` with `args` after the cluster
    /// options; waits for it to exit (it must, within 20 s) and returns whether it exited 0,
    /// and its stderr.
    pub fn serve_fails(&self, etcd: &Etcd, args: &[&str]) -> (bool, String) {
        let dir = std::env::temp_dir().join(format!("vrnic-etcd-fail-{}", std::process::id()));
        super::remove_state_dir(&dir);
        std::fs::create_dir_all(&dir).expect("a state dir");
        let listen = format!("{}:{PEER_PORT}", self.addr(0));
        let mut c = Command::new("nsenter");
        c.arg(format!("--net=/run/netns/{}", self.netns(0)))
            .arg(super::vrnic_bin())
            .arg("serve")
            .arg("--state-dir")
            .arg(&dir)
            .args(["--listen", &listen, "--etcd", &etcd.url])
            .args(["--key", &self.key_file(0)])
            .args(args)
            .env("RUST_LOG", "info");
        let out = Proc::spawn(c, "vrnic serve").wait_bounded(Duration::from_secs(20));
        super::remove_state_dir(&dir);
        assert!(!out.timed_out, "the daemon kept running\n{}", out.text());
        (out.ok(), out.stderr)
    }

    /// Host `i`'s key file.
    pub fn key_file(&self, i: usize) -> String {
        self.keys.join(format!("h{i}.key")).display().to_string()
    }

    /// Host `i`'s public key.
    pub fn public_key(&self, i: usize) -> &str {
        &self.publics[i]
    }

    /// The `--peer-key` options that accept every host but `i` (by its peer-link address).
    pub fn peer_key_args(&self, i: usize) -> Vec<String> {
        (0..self.names.len())
            .filter(|&j| j != i)
            .flat_map(|j| {
                [
                    "--peer-key".to_string(),
                    format!("{}:{PEER_PORT}={}", self.addr(j), self.publics[j]),
                ]
            })
            .collect()
    }

    /// Host `i`'s address.
    pub fn addr(&self, i: usize) -> String {
        format!("10.77.0.{}", i + 1)
    }

    /// Host `i`'s network namespace (`/run/netns/NAME`).
    pub fn netns(&self, i: usize) -> &str {
        &self.names[i]
    }

    /// Host `i`'s link to the switch goes down (`up` false) or comes back.
    pub fn set_link(&self, i: usize, up: bool) {
        ip(&[
            "-n",
            &self.names[i],
            "link",
            "set",
            "eth0",
            if up { "up" } else { "down" },
        ]);
    }

    /// A daemon on host `i` with peer links to every other host: host 0's from a config file
    /// (`--config`), the others' from `--listen`/`--peer`.
    pub fn daemon(&self, i: usize) -> Daemon {
        self.daemon_with(i, &[])
    }

    /// Host `i`'s key file and the others' public keys, as config file lines.
    fn key_toml(&self, i: usize) -> String {
        let mut t = format!("key_file = \"{}\"\n[peer_keys]\n", self.key_file(i));
        for j in (0..self.names.len()).filter(|&j| j != i) {
            t += &format!(
                "\"{}:{PEER_PORT}\" = \"{}\"\n",
                self.addr(j),
                self.publics[j]
            );
        }
        t
    }

    /// [`Hosts::daemon`] with `extra` options for `vrnic serve`.
    pub fn daemon_with(&self, i: usize, extra: &[&str]) -> Daemon {
        self.daemon_keyed(i, true, extra)
    }

    /// [`Hosts::daemon_with`], with this host's key and the others' public keys if `keys`
    /// (without them, `extra` says how the links go: `--insecure-links`, or keys of its own).
    pub fn daemon_keyed(&self, i: usize, keys: bool, extra: &[&str]) -> Daemon {
        let listen = format!("{}:{PEER_PORT}", self.addr(i));
        let peers: Vec<String> = (0..self.names.len())
            .filter(|&j| j != i)
            .map(|j| format!("{}:{PEER_PORT}", self.addr(j)))
            .collect();
        let mut args = Vec::new();
        if i == 0 {
            let file = std::env::temp_dir().join(format!("{}.toml", self.names[i]));
            let quoted: Vec<String> = peers.iter().map(|p| format!("\"{p}\"")).collect();
            let mut text = format!("listen = \"{listen}\"\npeers = [{}]\n", quoted.join(", "));
            if keys {
                text += &self.key_toml(i);
            }
            std::fs::write(&file, text).expect("write the config file");
            args.push("--config".to_string());
            args.push(file.display().to_string());
        } else {
            args.extend(["--listen".to_string(), listen]);
            for p in peers {
                args.extend(["--peer".to_string(), p]);
            }
            if keys {
                args.extend(["--key".to_string(), self.key_file(i)]);
                args.extend(self.peer_key_args(i));
            }
        }
        let mut refs: Vec<&str> = args.iter().map(String::as_str).collect();
        refs.extend_from_slice(extra);
        Daemon::start_in(Some(&self.names[i]), &refs)
    }

    /// Daemons on every host, each waiting (at most `limit`) until `vrnic peers` shows all
    /// its links up.
    pub fn daemons(&self, limit: Duration) -> Vec<Daemon> {
        self.daemons_with(limit, &[])
    }

    /// [`Hosts::daemons`] with `extra` options for every `vrnic serve`.
    pub fn daemons_with(&self, limit: Duration, extra: &[&str]) -> Vec<Daemon> {
        let ds: Vec<Daemon> = (0..self.names.len())
            .map(|i| self.daemon_with(i, extra))
            .collect();
        for d in &ds {
            d.wait_peers_up(limit);
        }
        ds
    }
}

impl Drop for Hosts {
    fn drop(&mut self) {
        if let Some(h0) = self.names.first() {
            let _ = std::fs::remove_file(std::env::temp_dir().join(format!("{h0}.toml")));
        }
        let _ = std::fs::remove_dir_all(&self.keys);
        let extra = self.extra.borrow().clone();
        for n in self
            .names
            .iter()
            .chain(extra.iter())
            .chain(std::iter::once(&self.switch))
        {
            let mut c = Command::new("ip");
            c.args(["netns", "del", n]);
            let _ = Proc::spawn(c, "ip netns del").wait_timeout(CLI);
        }
    }
}

impl Etcd {
    /// Starts it (again) and waits until it listens.
    pub fn start(&mut self) {
        assert!(self.proc.is_none(), "etcd still runs");
        let peer = "http://127.0.0.1:2380";
        let mut c = Command::new("nsenter");
        c.arg(format!("--net=/run/netns/{}", self.netns))
            .arg("etcd")
            .args(["--name", "vrnic-test", "--data-dir"])
            .arg(&self.data)
            .args(["--listen-client-urls", &self.url])
            .args(["--advertise-client-urls", &self.url])
            .args(["--listen-peer-urls", peer])
            .args(["--initial-advertise-peer-urls", peer])
            .args(["--initial-cluster", &format!("vrnic-test={peer}")])
            .args(["--log-level", "warn"]);
        if let Some(dir) = &self.tls {
            c.arg("--cert-file")
                .arg(dir.join("server.pem"))
                .arg("--key-file")
                .arg(dir.join("server-key.pem"))
                .arg("--trusted-ca-file")
                .arg(dir.join("ca.pem"))
                .arg("--client-cert-auth");
        }
        self.proc = Some(Proc::spawn(c, "etcd"));
        let start = Instant::now();
        while !self.listening() {
            let p = self.proc.as_mut().expect("just spawned");
            if p.exited() {
                let out = self.proc.take().expect("just spawned").wait(super::CLI);
                panic!("etcd exited at start\n{}", out.text());
            }
            assert!(start.elapsed() < ETCD_START, "etcd did not listen in time");
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Whether its client port takes connections (tried from its own namespace).
    fn listening(&self) -> bool {
        let mut c = Command::new("nsenter");
        c.arg(format!("--net=/run/netns/{}", self.netns)).args([
            "bash",
            "-c",
            &format!("exec 3<>/dev/tcp/{}/{ETCD_PORT}", self.addr),
        ]);
        Proc::spawn(c, "probe etcd")
            .wait_timeout(super::CLI)
            .is_some_and(|o| o.ok())
    }

    /// Puts `value` under `key` through etcd's JSON gateway (`POST /v3/kv/put`), from its own
    /// namespace, as another writer to etcd would; panics unless etcd answers 200.
    pub fn put(&self, key: &str, value: &[u8]) {
        let (ok, text) = self.put_as(None, key, value);
        assert!(ok, "put {key}\n{text}");
    }

    /// [`Etcd::put`] with `token`'s user (`None`: no credentials); returns whether etcd
    /// answered 200, and its answer.
    pub fn put_as(&self, token: Option<&str>, key: &str, value: &[u8]) -> (bool, String) {
        let body = format!(
            "{{\"key\":\"{}\",\"value\":\"{}\"}}",
            base64(key.as_bytes()),
            base64(value)
        );
        self.post("/v3/kv/put", &body, token)
    }

    /// Deletes `key` (`POST /v3/kv/deleterange`) as `token`'s user.
    pub fn delete_as(&self, token: Option<&str>, key: &str) -> (bool, String) {
        let body = format!("{{\"key\":\"{}\"}}", base64(key.as_bytes()));
        self.post("/v3/kv/deleterange", &body, token)
    }

    /// The value under `key` and the lease it is bound to (0: none), read as `token`'s user;
    /// `None` if there is no such key.
    pub fn get_as(&self, token: Option<&str>, key: &str) -> Option<(Vec<u8>, i64)> {
        let body = format!("{{\"key\":\"{}\"}}", base64(key.as_bytes()));
        let (ok, text) = self.post("/v3/kv/range", &body, token);
        assert!(ok, "range {key}\n{text}");
        let v: serde_json::Value = serde_json::from_str(&text).expect("etcd's answer is JSON");
        let kv = v.get("kvs")?.get(0)?;
        let value = unbase64(kv.get("value").and_then(|v| v.as_str()).unwrap_or(""));
        let lease = kv
            .get("lease")
            .and_then(|l| l.as_str())
            .map_or(0, |l| l.parse().expect("a lease id"));
        Some((value, lease))
    }

    /// Turns on etcd's v3 authentication as a cluster's operator would: user `root` (role
    /// `root`, password `root_password`), user `user` with `password` and a role of the same
    /// name granting readwrite on the prefix `/vrnic/`, then `auth enable`.
    pub fn enable_auth(&self, root_password: &str, user: &str, password: &str) {
        let prefix = base64(b"/vrnic/");
        let end = base64(b"/vrnic0");
        for (path, body) in [
            (
                "/v3/auth/user/add",
                format!("{{\"name\":\"root\",\"password\":\"{root_password}\"}}"),
            ),
            ("/v3/auth/role/add", "{\"name\":\"root\"}".to_string()),
            (
                "/v3/auth/user/grant",
                "{\"user\":\"root\",\"role\":\"root\"}".to_string(),
            ),
            (
                "/v3/auth/user/add",
                format!("{{\"name\":\"{user}\",\"password\":\"{password}\"}}"),
            ),
            ("/v3/auth/role/add", format!("{{\"name\":\"{user}\"}}")),
            (
                "/v3/auth/role/grant",
                format!(
                    "{{\"name\":\"{user}\",\"perm\":{{\"permType\":\"READWRITE\",\
                     \"key\":\"{prefix}\",\"range_end\":\"{end}\"}}}}"
                ),
            ),
            (
                "/v3/auth/user/grant",
                format!("{{\"user\":\"{user}\",\"role\":\"{user}\"}}"),
            ),
            ("/v3/auth/enable", "{}".to_string()),
        ] {
            let (ok, text) = self.post(path, &body, None);
            assert!(ok, "{path} {body}\n{text}");
        }
    }

    /// A token for `user` (`POST /v3/auth/authenticate`): what a client that knows the
    /// password gets.
    pub fn token(&self, user: &str, password: &str) -> String {
        let body = format!("{{\"name\":\"{user}\",\"password\":\"{password}\"}}");
        let (ok, text) = self.post("/v3/auth/authenticate", &body, None);
        assert!(ok, "authenticate {user}\n{text}");
        let v: serde_json::Value = serde_json::from_str(&text).expect("etcd's answer is JSON");
        v["token"].as_str().expect("a token").to_string()
    }

    /// `POST path` with JSON `body` to etcd's gateway from its own namespace, as `token`'s
    /// user (`None`: no credentials). Returns whether etcd answered 200, and the answer's body.
    pub fn post(&self, path: &str, body: &str, token: Option<&str>) -> (bool, String) {
        let auth = token.map_or(String::new(), |t| format!("Authorization: {t}\\r\\n"));
        let script = format!(
            "exec 3<>/dev/tcp/{}/{ETCD_PORT} && printf 'POST {path} HTTP/1.0\\r\\n{auth}Content-Type: \
             application/json\\r\\nContent-Length: {}\\r\\n\\r\\n%s' '{body}' >&3 && cat <&3",
            self.addr,
            body.len()
        );
        let mut c = Command::new("nsenter");
        c.arg(format!("--net=/run/netns/{}", self.netns))
            .args(["bash", "-c", &script]);
        let out = Proc::spawn(c, "etcd gateway").wait(super::CLI);
        assert!(out.ok(), "POST {path}\n{}", out.text());
        let ok = out
            .stdout
            .lines()
            .next()
            .is_some_and(|l| l.contains(" 200 "));
        let answer = out
            .stdout
            .split_once("\r\n\r\n")
            .map_or(out.stdout.as_str(), |(_, b)| b)
            .to_string();
        (ok, answer)
    }

    /// Stops it (SIGTERM, SIGKILL after a while); its data stays.
    pub fn stop(&mut self) {
        if let Some(mut p) = self.proc.take() {
            p.signal(libc::SIGTERM);
            let _ = p.wait_bounded(super::DAEMON_STOP);
        }
    }
}

/// Standard base64 with padding (etcd's JSON gateway takes keys and values so).
fn base64(b: &[u8]) -> String {
    const A: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut s = String::new();
    for c in b.chunks(3) {
        let n = (u32::from(c[0]) << 16)
            | (u32::from(*c.get(1).unwrap_or(&0)) << 8)
            | u32::from(*c.get(2).unwrap_or(&0));
        for i in 0..4 {
            if i <= c.len() {
                s.push(A[(n >> (18 - 6 * i) & 63) as usize] as char);
            } else {
                s.push('=');
            }
        }
    }
    s
}

/// Decodes standard base64 (what etcd's JSON gateway answers with); ignores anything else.
fn unbase64(s: &str) -> Vec<u8> {
    const A: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut out = Vec::new();
    let (mut acc, mut bits) = (0u32, 0);
    for c in s.bytes() {
        let Some(v) = A.iter().position(|&a| a == c) else {
            continue;
        };
        acc = (acc << 6) | u32::try_from(v).expect("below 64");
        bits += 6;
        if bits >= 8 {
            bits -= 8;
            out.push(u8::try_from(acc >> bits).expect("8 bits"));
            acc &= (1 << bits) - 1;
        }
    }
    out
}

impl Drop for Etcd {
    fn drop(&mut self) {
        self.stop();
        let _ = std::fs::remove_dir_all(&self.data);
        if let Some(dir) = &self.tls {
            let _ = std::fs::remove_dir_all(dir);
        }
    }
}

impl Etcd {
    /// Its network namespace's name.
    pub fn netns(&self) -> &str {
        &self.netns
    }

    /// `curl` of `POST path` with JSON `body` to this TLS etcd's gateway from its own
    /// namespace, trusting the test's CA, with the client certificate when `cert`; returns
    /// whether curl got a 200, and its output (curl's error when TLS refused it).
    pub fn curl_post(&self, path: &str, body: &str, cert: bool) -> (bool, String) {
        let dir = self.tls.as_ref().expect("a TLS etcd");
        let mut c = Command::new("nsenter");
        c.arg(format!("--net=/run/netns/{}", self.netns))
            .args(["curl", "-sS", "--fail", "--max-time", "10", "--cacert"])
            .arg(dir.join("ca.pem"));
        if cert {
            c.arg("--cert")
                .arg(dir.join("client.pem"))
                .arg("--key")
                .arg(dir.join("client-key.pem"));
        }
        c.args(["-X", "POST", "-d", body])
            .arg(format!("{}{path}", self.url));
        let out = Proc::spawn(c, "curl").wait(super::CLI);
        (out.ok(), out.text())
    }
}

impl Daemon {
    /// Waits until this daemon has `n` peer links, all up (`vrnic peers`).
    pub fn wait_links(&self, n: usize, limit: Duration) {
        let start = Instant::now();
        loop {
            let out = self.cli_output(&["peers"]);
            let lines: Vec<&str> = out.stdout.lines().skip(1).collect();
            if out.ok() && lines.len() == n && lines.iter().all(|l| l.contains(" up ")) {
                return;
            }
            assert!(
                start.elapsed() < limit,
                "not {n} peer links up within {limit:?}\n{}",
                out.text()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// A column of `vrnic peers` (by its header), one value per link.
    pub fn peer_column(&self, name: &str) -> Vec<u64> {
        let out = self.cli_output(&["peers"]).stdout;
        let mut lines = out.lines();
        let header: Vec<&str> = lines
            .next()
            .unwrap_or_default()
            .split_whitespace()
            .collect();
        let i = header
            .iter()
            .position(|h| *h == name)
            .unwrap_or_else(|| panic!("no {name} column in\n{out}"));
        lines
            .map(|l| {
                let v = l.split_whitespace().nth(i).unwrap_or_default();
                v.parse()
                    .unwrap_or_else(|_| panic!("{name} is not a number in\n{out}"))
            })
            .collect()
    }

    /// Waits until every peer link of this daemon is up (`vrnic peers`).
    pub fn wait_peers_up(&self, limit: Duration) {
        let start = std::time::Instant::now();
        loop {
            let out = self.cli_output(&["peers"]);
            let lines: Vec<&str> = out.stdout.lines().skip(1).collect();
            if out.ok() && !lines.is_empty() && lines.iter().all(|l| l.contains(" up ")) {
                return;
            }
            assert!(
                start.elapsed() < limit,
                "peer links not up within {limit:?}\n{}",
                out.text()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}
