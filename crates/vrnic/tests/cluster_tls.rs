//! etcd over TLS with client certificates (`vrnic serve --etcd https://... --etcd-ca CA
//! --etcd-cert CERT --etcd-key KEY`): the test's etcd (`common/hosts.rs` `etcd_tls`) serves
//! only TLS and takes only clients whose certificate its CA signed (`--client-cert-auth`);
//! the certificates are made with `openssl` for the test.
//!
//! - two daemons with the client certificate register (host 0 reads etcd's URL from its config
//!   file, host 1 from `--etcd`), link, and an unmodified `ibv_rc_pingpong -c` runs across them;
//! - a client without a certificate (curl, trusting the CA) is refused at the handshake, and
//!   plain HTTP to the same port gets nothing, while the same request with the certificate
//!   passes: whoever lacks the key cannot read or write the directory;
//! - a daemon without a client certificate, and one that trusts another CA (etcd as an
//!   impostor would present itself), never register, and say why in one line naming TLS.

mod common;

use std::process::Command;
use std::time::Duration;

use common::hosts::{Etcd, Hosts};
use common::{Daemon, Proc, create_in as create, pair_on as pair, port, require};

const LINKS_UP: Duration = Duration::from_secs(30);
const PAIR: Duration = Duration::from_secs(60);
const TTL_S: u64 = 3;

/// The TLS options of a daemon with the test's client certificate.
fn tls_args(etcd: &Etcd, cert: bool) -> Vec<String> {
    let dir = etcd.tls.as_ref().expect("a TLS etcd");
    let mut a = vec![
        "--etcd-ca".to_string(),
        dir.join("ca.pem").display().to_string(),
    ];
    if cert {
        a.extend([
            "--etcd-cert".to_string(),
            dir.join("client.pem").display().to_string(),
            "--etcd-key".to_string(),
            dir.join("client-key.pem").display().to_string(),
        ]);
    }
    a
}

#[test]
fn a_cluster_over_tls_with_client_certificates_serves_pairs_and_refuses_the_rest() {
    require("ibv_rc_pingpong");
    require("curl");
    let hosts = Hosts::new(2);
    let etcd = hosts.etcd_tls();
    assert!(etcd.url.starts_with("https://"), "{}", etcd.url);
    let args = tls_args(&etcd, true);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let ds: Vec<Daemon> = (0..2)
        .map(|i| hosts.cluster_daemon_with(i, &etcd, TTL_S, &args))
        .collect();
    for d in &ds {
        d.wait_links(1, LINKS_UP);
    }
    create(&ds[0], "t0", "blue", "10.9.0.1");
    create(&ds[1], "t1", "blue", "10.9.0.2");
    let addr = hosts.addr(0);
    let p = port().to_string();
    let s = ["ibv_rc_pingpong", "-p", &p, "-c", "-n", "50"];
    let c = ["ibv_rc_pingpong", "-p", &p, "-c", "-n", "50", &addr];
    pair((&ds[0], "t0"), &s, (&ds[1], "t1"), &c, PAIR).assert_ok();

    // The directory through etcd's gateway: with the client certificate, without, and in
    // plain HTTP.
    let range = "{\"key\":\"L3ZybmljLw==\",\"range_end\":\"L3ZybmljMA==\",\"count_only\":true}";
    let (ok, text) = etcd.curl_post("/v3/kv/range", range, true);
    assert!(
        ok && text.contains("\"count\""),
        "with the certificate\n{text}"
    );
    let (ok, text) = etcd.curl_post("/v3/kv/range", range, false);
    assert!(!ok, "etcd answered a client without a certificate\n{text}");
    println!("without a client certificate: {}", text.trim());
    let put = "{\"key\":\"L3ZybmljL3YxL3ZuaWNzLzQyNDI=\",\"value\":\"e30=\"}";
    let (ok, text) = etcd.curl_post("/v3/kv/put", put, false);
    assert!(!ok, "a put without a certificate passed\n{text}");
    let plain = etcd.url.replacen("https://", "http://", 1);
    let mut c = Command::new("nsenter");
    c.arg(format!("--net=/run/netns/{}", etcd.netns()))
        .args([
            "curl",
            "-sS",
            "--fail",
            "--max-time",
            "5",
            "-X",
            "POST",
            "-d",
            range,
        ])
        .arg(format!("{plain}/v3/kv/range"));
    let out = Proc::spawn(c, "curl http").wait(Duration::from_secs(20));
    assert!(!out.ok(), "plain HTTP got an answer\n{}", out.text());
    // No forged vRNIC reached the daemons.
    let ls = ds[1].cli_output(&["ls", "--all"]);
    assert!(ls.ok() && !ls.stdout.contains("4242"), "{}", ls.text());
}

/// A daemon without a client certificate, one that trusts another CA (etcd as an impostor
/// would present itself), and one given an https:// URL without a CA each stop at start
/// (exit status 1) with one line saying what is wrong; none registers.
#[test]
fn a_daemon_without_a_client_certificate_or_trusting_another_ca_stops_with_a_clear_error() {
    let hosts = Hosts::new(1);
    let etcd = hosts.etcd_tls();
    let dir = etcd.tls.clone().expect("a TLS etcd");
    let other = vec![
        "--etcd-ca".to_string(),
        dir.join("other-ca.pem").display().to_string(),
        "--etcd-cert".to_string(),
        dir.join("client.pem").display().to_string(),
        "--etcd-key".to_string(),
        dir.join("client-key.pem").display().to_string(),
    ];
    let url = &etcd.url;
    let cases = [
        (
            tls_args(&etcd, false),
            format!(
                "vrnic: etcd at {url} refused this daemon's TLS client certificate (none given, \
                 or not signed by a CA etcd trusts): give --etcd-cert and --etcd-key"
            ),
        ),
        (
            other,
            format!(
                "vrnic: etcd at {url} presented a TLS certificate that --etcd-ca does not vouch \
                 for (UnknownIssuer): not the etcd this daemon trusts"
            ),
        ),
        (
            Vec::new(),
            format!(
                "vrnic: etcd URL \"{url}\": TLS needs --etcd-ca (the CA certificate etcd's \
                 server certificate is signed by)"
            ),
        ),
    ];
    for (args, line) in cases {
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let (ok, stderr) = hosts.serve_fails(&etcd, &args);
        assert!(!ok, "{args:?}: exit status 0\n{stderr}");
        assert!(
            stderr.lines().any(|l| l == line),
            "{args:?}: no line {line:?}\n{stderr}"
        );
        assert!(!stderr.contains("registered in etcd"), "{stderr}");
        println!("{line}");
    }
}
