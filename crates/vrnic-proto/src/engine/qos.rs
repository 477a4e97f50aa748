//! QoS: a vRNIC's limits on what it sends, bytes per second and work requests per second,
//! applied where the scheduler takes turns between vRNICs. Each limit is a token bucket that
//! may run into debt: a turn runs while the vRNIC has credit, what it moved is charged after,
//! and a vRNIC in debt leaves the run queue until its debt is paid ([`Engine::turn`] and
//! [`Engine::handle_timeout`]), so a limited tenant's excess waits in its own queue, costs the
//! engine nothing meanwhile (the engine sleeps until then if nothing else runs) and never delays
//! another tenant. The average holds exactly; a burst is at most [`BURST`] of the rate plus one
//! turn.
//!
//! A [`Limit`] is shared (`Arc`) by every engine serving the vRNIC (its slices on other engine
//! threads too) and by the daemon, which changes it live: the limit is the vRNIC's, not each
//! thread's. An unlimited vRNIC costs one relaxed load per turn.

use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

/// How much credit an idle vRNIC gathers, in time at its rate: what it may send at once after
/// a pause before the rate applies.
pub const BURST: Duration = Duration::from_millis(10);

/// A vRNIC's limits; `None` is no limit.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Policy {
    /// Payload bytes per second it may send (as requester: SEND, WRITE, READ responses it asked
    /// for, atomics).
    pub max_bw: Option<u64>,
    /// Work requests per second it may have executed.
    pub max_rate: Option<u64>,
}

impl Policy {
    /// Whether it limits anything.
    #[must_use]
    pub fn limits(&self) -> bool {
        self.max_bw.is_some() || self.max_rate.is_some()
    }
}

/// A vRNIC's limits and their buckets (see the module docs).
#[derive(Debug, Default)]
pub struct Limit {
    active: AtomicBool,
    state: Mutex<Buckets>,
}

#[derive(Debug, Default)]
struct Buckets {
    policy: Policy,
    /// Credit in bytes and in work requests; negative is debt.
    bytes: f64,
    wrs: f64,
    /// When the credit was last brought up to date.
    at: Option<Instant>,
    /// Turns refused for debt, and the time it waited, for the meter.
    waits: u64,
    waited: Duration,
}

/// One bucket's credit at `now` (from `credit` at `at`, `rate` per second, capped at
/// [`BURST`] of the rate).
fn refill(credit: f64, rate: u64, dt: Duration) -> f64 {
    let rate = rate as f64;
    (credit + rate * dt.as_secs_f64()).min(rate * BURST.as_secs_f64())
}

/// How long a debt of `credit` (negative) takes to pay at `rate` per second.
fn pay(credit: f64, rate: u64) -> Duration {
    if credit >= 0.0 || rate == 0 {
        return Duration::ZERO;
    }
    Duration::from_secs_f64((-credit / rate as f64).min(3600.0))
}

impl Limit {
    /// A limit with `policy`, its buckets full.
    #[must_use]
    pub fn new(policy: Policy) -> Limit {
        let l = Limit::default();
        l.set(policy);
        l
    }

    /// Changes the policy now (the daemon's `vrnic policy`): the next turn of the vRNIC
    /// follows it. Credit and debt carry over, capped by the new burst; a limit lifted
    /// forgives the debt.
    pub fn set(&self, policy: Policy) {
        let mut b = self.lock();
        if b.policy.max_bw.is_none() || policy.max_bw.is_none() {
            b.bytes = policy
                .max_bw
                .map_or(0.0, |r| r as f64 * BURST.as_secs_f64());
        }
        if b.policy.max_rate.is_none() || policy.max_rate.is_none() {
            b.wrs = policy
                .max_rate
                .map_or(0.0, |r| r as f64 * BURST.as_secs_f64());
        }
        b.policy = policy;
        self.active.store(policy.limits(), Ordering::Relaxed);
    }

    /// The policy in force.
    #[must_use]
    pub fn policy(&self) -> Policy {
        self.lock().policy
    }

    /// Turns refused for debt, and the time they waited.
    #[must_use]
    pub fn waited(&self) -> (u64, Duration) {
        let b = self.lock();
        (b.waits, b.waited)
    }

    /// Whether it limits anything (a relaxed load: the scheduler asks every turn).
    #[must_use]
    pub fn limits(&self) -> bool {
        self.active.load(Ordering::Relaxed)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Buckets> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// When the vRNIC may have its next turn: `None` if now (it has credit in every bucket).
    pub(super) fn ready_at(&self, now: Instant) -> Option<Instant> {
        let mut b = self.lock();
        b.refresh(now);
        let wait = b.wait();
        (wait > Duration::ZERO).then(|| now + wait)
    }

    /// Charges a turn that moved `bytes` and retired `wrs`; returns when the vRNIC may have
    /// its next turn (`None`: now).
    pub(super) fn charge(&self, now: Instant, bytes: u64, wrs: usize) -> Option<Instant> {
        let mut b = self.lock();
        b.refresh(now);
        if b.policy.max_bw.is_some() {
            b.bytes -= bytes as f64;
        }
        if b.policy.max_rate.is_some() {
            b.wrs -= wrs as f64;
        }
        let wait = b.wait();
        if wait > Duration::ZERO {
            b.waits += 1;
            b.waited += wait;
            Some(now + wait)
        } else {
            None
        }
    }
}

impl Buckets {
    fn refresh(&mut self, now: Instant) {
        let dt = self
            .at
            .map_or(Duration::ZERO, |at| now.saturating_duration_since(at));
        self.at = Some(now);
        if let Some(r) = self.policy.max_bw {
            self.bytes = refill(self.bytes, r, dt);
        }
        if let Some(r) = self.policy.max_rate {
            self.wrs = refill(self.wrs, r, dt);
        }
    }

    fn wait(&self) -> Duration {
        let bw = self
            .policy
            .max_bw
            .map_or(Duration::ZERO, |r| pay(self.bytes, r));
        let rate = self
            .policy
            .max_rate
            .map_or(Duration::ZERO, |r| pay(self.wrs, r));
        bw.max(rate)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Charged turn by turn as a busy vRNIC would be, the bytes moved over a simulated second
    /// are the rate (plus the burst it started with), whatever the turn size.
    #[test]
    fn a_busy_vrnic_moves_its_rate_and_no_more() {
        for turn in [4096u64, 65536, 1 << 20] {
            let l = Limit::new(Policy {
                max_bw: Some(100_000_000),
                max_rate: None,
            });
            let t0 = Instant::now();
            let (mut now, mut moved) = (t0, 0u64);
            while now < t0 + Duration::from_secs(1) {
                if let Some(at) = l.ready_at(now) {
                    now = at;
                    continue;
                }
                moved += turn;
                if let Some(at) = l.charge(now, turn, 1) {
                    now = at;
                }
            }
            let burst = 100_000_000.0 * BURST.as_secs_f64();
            let expect = 100_000_000.0 + burst;
            let got = moved as f64;
            assert!(
                (got - expect).abs() <= turn as f64 + 1.0,
                "turn {turn}: moved {got}, expected {expect}"
            );
        }
    }

    #[test]
    fn message_rate_and_live_changes() {
        let l = Limit::new(Policy {
            max_bw: None,
            max_rate: Some(1000),
        });
        let t0 = Instant::now();
        // The burst: 10 work requests, then 1 ms of debt per request.
        assert_eq!(l.charge(t0, 0, 10), None);
        assert_eq!(l.charge(t0, 0, 1), Some(t0 + Duration::from_millis(1)));
        // Lifted: no debt, no wait.
        l.set(Policy::default());
        assert!(!l.limits());
        assert_eq!(l.ready_at(t0), None);
        assert_eq!(l.charge(t0, 1 << 30, 1 << 20), None);
        // Set again: full burst.
        l.set(Policy {
            max_bw: Some(1_000_000),
            max_rate: None,
        });
        assert!(l.limits());
        assert_eq!(l.charge(t0, 10_000, 1), None);
        assert_eq!(l.charge(t0, 1_000, 1), Some(t0 + Duration::from_millis(1)));
    }
}
