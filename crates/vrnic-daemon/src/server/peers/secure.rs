//! Authenticated and encrypted peer links: a Noise handshake (`Noise_XX_25519_ChaChaPoly_BLAKE2s`,
//! by the `snow` crate) that proves each end holds the private key of the host it claims to be,
//! and, when either end asks, Noise transport messages carrying the frames.
//!
//! The dialer sends step 1 (its ephemeral key); the listener answers with step 2 (its static key
//! and its hello, encrypted); the dialer checks that key is the one configured for the address it
//! dialed, then sends step 3 (its static key and hello). The listener installs the connection as
//! the link of the host the hello names only if the static key is the one configured for that
//! host (and the hello passes the checks a plain hello does), and says so with a hello frame,
//! upon which the dialer's link is up too: a replayed or forged message fails
//! the handshake's own checks, and a valid key of another host is refused. The hellos are the
//! handshake's payloads, so they are as authentic as the keys. Formats: `vrnic-wire`'s
//! `HandshakeRepr`, `HelloRepr` and records.
//!
//! Without encryption (the default), frames then travel as they do on a plain link: the
//! handshake authenticates who connected, not the bytes that follow, so a host on the network
//! path that can inject into the TCP stream is not kept out (see `docs/security.md`). With
//! encryption (`--encrypt-links` on either end), every byte after step 3 is in records (a
//! 16-bit length, then a Noise transport message of at most 64 KiB): confidential and
//! authenticated, and a record that fails its tag closes the link. Payloads are then copied
//! (sealed from the regions, opened into a buffer), not sent and read in place.
//!
//! What a handshake costs the daemon is bounded (`peers/mod.rs`): at most `MAX_PENDING`
//! connections wait for theirs, each for at most its deadline and with at most a handshake's
//! bytes; the listener's public-key work for strangers (step 2) is rate-limited
//! ([`HandshakeBucket`]); and nothing of a live link is touched until a handshake succeeds.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use vrnic_wire::frame::{
    ControlKind, HandshakeRepr, HelloRepr, KEY_LEN, MAX_RECORD, MAX_RECORD_PLAIN, NOISE_PARAMS,
    RECORD_HEADER_LEN, peek_record,
};

use super::control;
use crate::keys::{KeyPair, PublicKey};
use crate::server::linkbuf::LinkBuf;
use crate::server::outqueue::OutQueue;

/// Bound into every handshake: a handshake of another protocol fails.
const PROLOGUE: &[u8] = b"vrnic peer link 4";
/// Stream bytes sealed into records per write round (the rest waits for the socket).
const SEAL_AHEAD: usize = 256 << 10;
/// Handshakes a listener answers per second, at most (step 2 is the public-key work a
/// stranger can ask for), and how many it may answer at once after a quiet while.
const HANDSHAKE_RATE: f64 = 100.0;
const HANDSHAKE_BURST: f64 = 32.0;

/// A link's keys: this host's pair, the hosts it accepts, whether it asks for encryption.
#[derive(Debug, Clone)]
pub(super) struct Security {
    key: KeyPair,
    peers: Vec<(SocketAddr, PublicKey)>,
    encrypt: bool,
}

impl Security {
    /// Checks the options: `None` without a key (unauthenticated links), an error for keys or
    /// encryption without a key, or a static peer without a key.
    pub(super) fn new(
        key: Option<&KeyPair>,
        peer_keys: &[(SocketAddr, PublicKey)],
        encrypt: bool,
        static_peers: &[SocketAddr],
    ) -> Result<Option<Security>> {
        let Some(key) = key else {
            if encrypt {
                bail!("--encrypt-links needs --key (this host's key file)");
            }
            if !peer_keys.is_empty() {
                bail!("--peer-key needs --key (this host's key file)");
            }
            return Ok(None);
        };
        for p in static_peers {
            if !peer_keys.iter().any(|(a, _)| a == p) {
                bail!(
                    "peer {p} has no key: give --peer-key {p}=PUBLIC (what `vrnic keygen --public` \
                     prints on that host)"
                );
            }
        }
        let mut seen = std::collections::HashSet::new();
        for (a, _) in peer_keys {
            if !seen.insert(a) {
                bail!("--peer-key {a} given twice");
            }
            if !static_peers.is_empty() && !static_peers.contains(a) {
                bail!("--peer-key {a}: not one of the --peer addresses");
            }
        }
        Ok(Some(Security {
            key: key.clone(),
            peers: peer_keys.to_vec(),
            encrypt,
        }))
    }

    /// The key a host at `addr` must prove.
    pub(super) fn key_of(&self, addr: SocketAddr) -> Option<PublicKey> {
        self.peers.iter().find(|(a, _)| *a == addr).map(|(_, k)| *k)
    }

    /// Whether this host asks for encrypted frames.
    pub(super) fn encrypt(&self) -> bool {
        self.encrypt
    }

    fn builder(&self) -> Result<snow::Builder<'_>> {
        let params = NOISE_PARAMS.parse().context("Noise parameters")?;
        snow::Builder::new(params)
            .local_private_key(&self.key.private)
            .and_then(|b| b.prologue(PROLOGUE))
            .context("Noise handshake")
    }

    /// The dialer's side of a handshake, and its first message (a handshake frame) on `out`.
    pub(super) fn dial(&self, out: &mut Vec<u8>) -> Result<Handshake> {
        let mut hs = self.builder()?.build_initiator()?;
        let mut msg = [0u8; 64];
        let n = hs.write_message(&[], &mut msg)?;
        handshake_frame(out, 1, &msg[..n]);
        Ok(Handshake { hs, step: 2 })
    }

    /// The listener's side of a handshake, before step 1 arrives.
    pub(super) fn listen(&self) -> Result<Handshake> {
        let hs = self.builder()?.build_responder()?;
        Ok(Handshake { hs, step: 1 })
    }
}

/// A handshake under way, and the step it waits for.
pub(super) struct Handshake {
    hs: snow::HandshakeState,
    step: u8,
}

/// Why a handshake failed (the connection is closed; nothing else changes).
#[derive(Debug)]
pub(super) struct Refused(pub String);

impl<E: std::fmt::Display> From<E> for Refused {
    fn from(e: E) -> Refused {
        Refused(e.to_string())
    }
}

/// What a finished handshake gives: the peer's hello and key, and the link's cipher if either
/// end asked for encryption.
pub(super) struct Done {
    pub(super) hello: HelloRepr,
    pub(super) key: PublicKey,
    pub(super) cipher: Option<Box<Cipher>>,
}

impl Handshake {
    /// Listener, step 1 in: answers step 2 (carrying `hello`) on `out`.
    pub(super) fn answer(
        &mut self,
        body: &[u8],
        hello: HelloRepr,
        out: &mut Vec<u8>,
    ) -> Result<(), Refused> {
        let m = self.take(body, 1)?;
        let mut payload = [0u8; 64];
        self.hs.read_message(m.message, &mut payload)?;
        let mut msg = [0u8; 256];
        let n = self.hs.write_message(&hello.emit(), &mut msg)?;
        handshake_frame(out, 2, &msg[..n]);
        self.step = 3;
        Ok(())
    }

    /// Dialer, step 2 in: checks the listener's key is `expected`, answers step 3 (carrying
    /// `hello`) on `out`, and finishes.
    pub(super) fn finish_dial(
        mut self,
        body: &[u8],
        expected: PublicKey,
        hello: HelloRepr,
        out: &mut Vec<u8>,
    ) -> Result<Done, Refused> {
        let m = self.take(body, 2)?;
        let mut payload = [0u8; 64];
        let n = self.hs.read_message(m.message, &mut payload)?;
        let key = self.remote_key()?;
        if key != expected {
            return Err(Refused(format!(
                "the listener's key {key} is not the one configured for it"
            )));
        }
        let theirs = HelloRepr::parse(&payload[..n])?;
        let mut msg = [0u8; 256];
        let n = self.hs.write_message(&hello.emit(), &mut msg)?;
        handshake_frame(out, 3, &msg[..n]);
        self.done(theirs, key, hello.encrypt)
    }

    /// Listener, step 3 in: the dialer's hello and key (the caller checks the key is the one
    /// of the host the hello names).
    pub(super) fn finish_listen(mut self, body: &[u8], encrypt: bool) -> Result<Done, Refused> {
        let m = self.take(body, 3)?;
        let mut payload = [0u8; 64];
        let n = self.hs.read_message(m.message, &mut payload)?;
        let key = self.remote_key()?;
        let theirs = HelloRepr::parse(&payload[..n])?;
        self.done(theirs, key, encrypt)
    }

    /// A handshake body of step `step`.
    fn take<'a>(&self, body: &'a [u8], step: u8) -> Result<HandshakeRepr<'a>, Refused> {
        let m = HandshakeRepr::parse(body)?;
        if m.step != step || self.step != step {
            return Err(Refused(format!(
                "handshake step {} where {step} was due",
                m.step
            )));
        }
        Ok(m)
    }

    fn remote_key(&self) -> Result<PublicKey, Refused> {
        let k = self
            .hs
            .get_remote_static()
            .ok_or_else(|| Refused("no static key".into()))?;
        let k: [u8; KEY_LEN] = k.try_into().map_err(|_| Refused("a short key".into()))?;
        Ok(PublicKey(k))
    }

    fn done(self, hello: HelloRepr, key: PublicKey, ours: bool) -> Result<Done, Refused> {
        let cipher = if ours || hello.encrypt {
            Some(Box::new(Cipher::new(self.hs.into_transport_mode()?)))
        } else {
            None
        };
        Ok(Done { hello, key, cipher })
    }
}

/// A handshake control frame of `step` with `message`, appended to `out`.
fn handshake_frame(out: &mut Vec<u8>, step: u8, message: &[u8]) {
    let m = HandshakeRepr { step, message };
    let mut body = vec![0u8; m.buffer_len()];
    m.emit(&mut body);
    control(out, ControlKind::Handshake, &body);
}

/// An encrypted link's records: what is sealed and not yet written, what is read and not yet
/// opened.
pub(super) struct Cipher {
    ts: snow::TransportState,
    /// Records to write (and, first, the handshake's last frame).
    pub(super) wire_out: LinkBuf,
    /// Bytes read that are not yet a whole record.
    pub(super) wire_in: LinkBuf,
    plain: Vec<u8>,
}

impl Cipher {
    fn new(ts: snow::TransportState) -> Cipher {
        Cipher {
            ts,
            wire_out: LinkBuf::default(),
            wire_in: LinkBuf::default(),
            plain: vec![0; MAX_RECORD_PLAIN],
        }
    }

    /// Seals what `out` holds into records, up to [`SEAL_AHEAD`] bytes ahead of the socket.
    pub(super) fn seal(&mut self, out: &mut OutQueue) -> Result<(), snow::Error> {
        while !out.is_empty() && self.wire_out.data().len() < SEAL_AHEAD {
            let n = out.take_into(&mut self.plain);
            if n == 0 {
                break;
            }
            let room = self.wire_out.spare(RECORD_HEADER_LEN + MAX_RECORD);
            let len = self
                .ts
                .write_message(&self.plain[..n], &mut room[RECORD_HEADER_LEN..])?;
            // A record holds at most MAX_RECORD bytes (a Noise message's bound).
            room[..RECORD_HEADER_LEN].copy_from_slice(&(len as u16).to_be_bytes());
            self.wire_out.commit(RECORD_HEADER_LEN + len);
        }
        Ok(())
    }

    /// Opens every whole record read so far into `inbuf`. An error: a malformed record, or
    /// one that fails its tag (the link is closed).
    pub(super) fn open(&mut self, inbuf: &mut LinkBuf) -> Result<(), String> {
        loop {
            let data = self.wire_in.data();
            let len = match peek_record(data) {
                Ok(Some(len)) if data.len() >= len => len,
                Ok(_) => return Ok(()),
                Err(e) => return Err(e.to_string()),
            };
            let room = inbuf.spare(MAX_RECORD);
            let n = self
                .ts
                .read_message(&data[RECORD_HEADER_LEN..len], room)
                .map_err(|e| format!("a record that does not authenticate: {e}"))?;
            inbuf.commit(n);
            self.wire_in.consume(len);
        }
    }

    /// Bytes it holds sealed and not yet written.
    pub(super) fn held(&self) -> usize {
        self.wire_out.data().len()
    }
}

/// A token bucket over the listener's answers to step 1: at most [`HANDSHAKE_RATE`] a second,
/// [`HANDSHAKE_BURST`] at once.
pub(super) struct HandshakeBucket {
    tokens: f64,
    at: Instant,
}

impl HandshakeBucket {
    pub(super) fn new(now: Instant) -> HandshakeBucket {
        HandshakeBucket {
            tokens: HANDSHAKE_BURST,
            at: now,
        }
    }

    /// Takes a token if there is one.
    pub(super) fn take(&mut self, now: Instant) -> bool {
        let dt = now.saturating_duration_since(self.at);
        self.at = now;
        self.tokens = (self.tokens + dt.as_secs_f64() * HANDSHAKE_RATE).min(HANDSHAKE_BURST);
        if self.tokens >= 1.0 {
            self.tokens -= 1.0;
            true
        } else {
            false
        }
    }
}

/// How long an accepted connection may take to authenticate.
pub(super) const HANDSHAKE_DEADLINE: Duration = Duration::from_secs(2);

const _: () = assert!(MAX_RECORD <= u16::MAX as usize);

#[cfg(test)]
mod tests {
    use vrnic_wire::frame::{Frame, FrameRepr};

    use super::*;

    fn sec(key: &KeyPair, peers: &[(SocketAddr, PublicKey)], encrypt: bool) -> Security {
        Security::new(Some(key), peers, encrypt, &[])
            .unwrap()
            .unwrap()
    }

    /// The body of the one control frame in `f`.
    fn body(f: &[u8]) -> &[u8] {
        let frame = Frame::new_checked(f).unwrap();
        let repr = FrameRepr::parse(&frame).unwrap();
        &f[repr.payload_range()]
    }

    const A: &str = "10.0.0.1:7700";
    const B: &str = "10.0.0.2:7700";

    /// A full handshake between `dialer` and `listener`: the listener's view, or where it failed.
    fn run(
        dialer: &Security,
        listener: &Security,
        expect: PublicKey,
    ) -> Result<(Done, Done), Refused> {
        let mut f1 = Vec::new();
        let d = dialer.dial(&mut f1)?;
        let mut l = listener.listen()?;
        let mut f2 = Vec::new();
        let h_listener = HelloRepr {
            index: 1,
            hosts: 2,
            encrypt: listener.encrypt(),
        };
        l.answer(body(&f1), h_listener, &mut f2)?;
        let mut f3 = Vec::new();
        let h_dialer = HelloRepr {
            index: 0,
            hosts: 2,
            encrypt: dialer.encrypt(),
        };
        let dd = d.finish_dial(body(&f2), expect, h_dialer, &mut f3)?;
        let ld = l.finish_listen(body(&f3), listener.encrypt())?;
        Ok((dd, ld))
    }

    #[test]
    fn both_ends_learn_the_others_key_and_hello() {
        let (ka, kb) = (KeyPair::generate().unwrap(), KeyPair::generate().unwrap());
        let a = sec(&ka, &[(B.parse().unwrap(), kb.public)], false);
        let b = sec(&kb, &[(A.parse().unwrap(), ka.public)], false);
        let (d, l) = run(&a, &b, kb.public).unwrap();
        assert_eq!((d.key, d.hello.index), (kb.public, 1));
        assert_eq!((l.key, l.hello.index), (ka.public, 0));
        assert!(d.cipher.is_none() && l.cipher.is_none(), "nobody asked");
        assert_eq!(b.key_of(A.parse().unwrap()), Some(ka.public));
    }

    #[test]
    fn a_listener_with_another_key_is_refused_by_the_dialer() {
        let (ka, kb, kc) = (
            KeyPair::generate().unwrap(),
            KeyPair::generate().unwrap(),
            KeyPair::generate().unwrap(),
        );
        let a = sec(&ka, &[], false);
        let impostor = sec(&kc, &[], false);
        let e = run(&a, &impostor, kb.public).err().expect("refused");
        assert!(e.0.contains("not the one configured"), "{}", e.0);
    }

    #[test]
    fn a_tampered_or_replayed_step_fails() {
        let (ka, kb) = (KeyPair::generate().unwrap(), KeyPair::generate().unwrap());
        let a = sec(&ka, &[], false);
        let b = sec(&kb, &[], false);
        let hello = HelloRepr {
            index: 0,
            hosts: 2,
            encrypt: false,
        };
        let mut f1 = Vec::new();
        let d = a.dial(&mut f1).unwrap();
        let mut l = b.listen().unwrap();
        let mut f2 = Vec::new();
        l.answer(body(&f1), hello, &mut f2).unwrap();
        let mut f3 = Vec::new();
        d.finish_dial(body(&f2), kb.public, hello, &mut f3).unwrap();
        // Step 3 replayed to another listener that answered the same step 1: its fresh
        // ephemeral key makes it fail.
        let mut l2 = b.listen().unwrap();
        l2.answer(body(&f1), hello, &mut Vec::new()).unwrap();
        assert!(l2.finish_listen(body(&f3), false).is_err());
        // A flipped byte in step 3.
        let mut bad = body(&f3).to_vec();
        *bad.last_mut().unwrap() ^= 1;
        assert!(l.finish_listen(&bad, false).is_err());
        // A step out of order.
        let mut l3 = b.listen().unwrap();
        assert!(l3.answer(body(&f3), hello, &mut Vec::new()).is_err());
    }

    #[test]
    fn records_carry_the_stream_sealed_and_a_flipped_bit_is_refused() {
        let (ka, kb) = (KeyPair::generate().unwrap(), KeyPair::generate().unwrap());
        let a = sec(&ka, &[], true);
        let b = sec(&kb, &[], false);
        let (d, l) = run(&a, &b, kb.public).unwrap();
        let (mut tx, mut rx) = (d.cipher.expect("asked"), l.cipher.expect("asked"));
        let stream: Vec<u8> = (0..200_000u32).map(|i| (i % 251) as u8).collect();
        let mut q = OutQueue::default();
        q.extend(&stream);
        while !q.is_empty() {
            tx.seal(&mut q).unwrap();
        }
        let sealed = tx.wire_out.data().to_vec();
        assert!(
            !sealed.windows(64).any(|w| w == &stream[1000..1064]),
            "no plaintext on the wire"
        );
        let mut inbuf = LinkBuf::default();
        for chunk in sealed.chunks(7777) {
            rx.wire_in.extend(chunk);
            rx.open(&mut inbuf).unwrap();
        }
        assert_eq!(inbuf.data(), &stream[..]);
        // A flipped bit in the next record.
        let mut q = OutQueue::default();
        q.extend(b"more");
        tx.wire_out.clear();
        tx.seal(&mut q).unwrap();
        let mut rec = tx.wire_out.data().to_vec();
        rec[RECORD_HEADER_LEN] ^= 1;
        rx.wire_in.extend(&rec);
        assert!(rx.open(&mut inbuf).is_err());
    }

    #[test]
    fn the_bucket_answers_a_burst_then_its_rate() {
        let t0 = Instant::now();
        let mut b = HandshakeBucket::new(t0);
        let burst = (0..1000).filter(|_| b.take(t0)).count();
        assert_eq!(burst, HANDSHAKE_BURST as usize);
        let later = t0 + Duration::from_millis(100);
        let more = (0..1000).filter(|_| b.take(later)).count();
        assert_eq!(more, (HANDSHAKE_RATE / 10.0) as usize);
    }

    #[test]
    fn options_without_keys_for_every_peer_are_refused() {
        let k = KeyPair::generate().unwrap();
        let b: SocketAddr = B.parse().unwrap();
        assert!(Security::new(Some(&k), &[], false, &[b]).is_err());
        assert!(Security::new(None, &[], true, &[]).is_err());
        assert!(Security::new(None, &[(b, k.public)], false, &[]).is_err());
        assert!(
            Security::new(Some(&k), &[(A.parse().unwrap(), k.public)], false, &[b]).is_err(),
            "a key for an address that is not a peer"
        );
        assert!(Security::new(None, &[], false, &[b]).unwrap().is_none());
    }
}
