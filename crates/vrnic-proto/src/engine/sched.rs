//! The scheduler: timers, the run queue of vRNICs and their ready lists of QPs, parking
//! and waking, and the retired counters handed back to the driver.

use super::*;

/// What one [`Engine::turn`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Turn {
    /// Whose turn it was.
    pub vnic: VnicId,
    /// Whether anything happened (a segment moved, a work request retired).
    pub did: bool,
    /// Work requests retired.
    pub wrs: usize,
    /// Payload bytes moved.
    pub bytes: u64,
}

impl Engine {
    /// Fires the timers that are due: each waiting QP whose timer expired is woken, and its
    /// next step tries its segment again: a QP that still gets no answer fails with
    /// `RETRY_EXC_ERR`; one that gets an RNR NAK again counts one retry (and fails with
    /// `RNR_RETRY_EXC_ERR` once they are used up). [`Engine::process`] fires them too, so a
    /// driver may call either or both. Costs the due timers only.
    pub fn handle_timeout(&mut self, now: Instant) {
        self.unthrottle(now);
        for qp in std::mem::take(&mut self.sched.deferred) {
            self.unpark(qp);
        }
        while let Some(&Reverse((t, qp))) = self.sched.timers.peek() {
            if t > now {
                break;
            }
            self.sched.timers.pop();
            let Some(q) = self.objs.qps.get_mut(&qp) else {
                continue;
            };
            if q.sched.armed != Some(t) {
                // Stale: superseded by an earlier entry of the same QP.
                continue;
            }
            q.sched.armed = None;
            match q.deadline() {
                Some(d) if d > now => {
                    // It waits until later now: keep one entry for that.
                    self.arm(qp, d);
                    continue;
                }
                Some(_) => {}
                None => continue,
            }
            // Over a peer link: no answer to what is in flight within the local ACK timeout.
            if q.link.ack_until.is_some_and(|t| t <= now) {
                self.ack_timeout(now, qp);
                continue;
            }
            // Each expiry is one more try: a QP that got no answer at all fails; one that got
            // RNR NAKs counts a retry.
            match q.wait {
                Wait::Retry { .. } => {
                    self.fail_qp(qp, Some(WcStatus::RetryExcErr));
                    continue;
                }
                Wait::Rnr {
                    retries, on, timer, ..
                } => {
                    let retries = retries.saturating_add(1);
                    if q.attr.rnr_retry != 7 && retries > q.attr.rnr_retry {
                        self.fail_qp(qp, Some(WcStatus::RnrRetryExcErr));
                        continue;
                    }
                    let until = now + Duration::from_micros(state::rnr_timer_us(timer));
                    q.wait = Wait::Rnr {
                        until,
                        retries,
                        on,
                        timer,
                    };
                    self.arm(qp, until);
                }
                Wait::None => {}
            }
            // Its next step sends the segment again.
            self.unpark(qp);
        }
    }

    /// The earliest deadline of a waiting QP (possibly one that no longer waits: waking for
    /// it early is harmless).
    #[must_use]
    pub fn poll_timeout(&self) -> Option<Instant> {
        let qps = self.sched.timers.peek().map(|&Reverse((t, _))| t);
        let vnics = self.sched.throttled.peek().map(|&Reverse((t, _))| t);
        qps.into_iter().chain(vnics).min()
    }

    /// Gives vRNIC `vnic` QoS limits: `limit` (shared with its other engines and changed by
    /// the daemon in place: see `qos`), applied from its next turn.
    pub fn set_vnic_limit(&mut self, vnic: VnicId, limit: std::sync::Arc<Limit>) {
        if let Some(v) = self.objs.vnics.get_mut(&vnic) {
            v.limit = Some(limit);
        }
    }

    /// The vRNICs whose QoS debt is paid by `now` go back to the run queue (those with work).
    fn unthrottle(&mut self, now: Instant) {
        while let Some(&Reverse((t, vid))) = self.sched.throttled.peek() {
            if t > now {
                break;
            }
            self.sched.throttled.pop();
            if let Some(v) = self.objs.vnics.get_mut(&vid)
                && v.throttled
            {
                v.throttled = false;
                if !v.ready.is_empty() && !v.queued {
                    v.queued = true;
                    self.sched.runq.push_back(vid);
                }
            }
        }
    }

    /// Takes `vid` off the run queue until `until` (its QoS debt is paid).
    fn throttle(&mut self, vid: VnicId, until: Instant) {
        if let Some(v) = self.objs.vnics.get_mut(&vid) {
            v.queued = false;
            if !v.throttled {
                v.throttled = true;
                self.sched.throttled.push(Reverse((until, vid)));
            }
        }
    }

    /// The next completion: `(cq, cqe, solicited)`.
    #[must_use]
    pub fn poll_completion(&mut self) -> Option<(CqId, Cqe, bool)> {
        let c = self.out.completions.pop_front()?;
        // Counted on its QP, which the vRNIC's count sums ([`Engine::meter`]); on the CQ's
        // vRNIC itself when the QP is gone or of another vRNIC.
        let vnic = self.objs.cqs.get(&c.0).map(|cq| cq.vnic);
        let q = self
            .objs
            .by_qpn
            .get(&c.1.qp_num)
            .and_then(|id| self.objs.qps.get_mut(id));
        match q {
            Some(q) if Some(q.vnic) == vnic => q.meter.completed(c.1.status),
            q => {
                if let Some(q) = q {
                    q.meter.completed(c.1.status);
                }
                if let Some(v) = vnic.and_then(|v| self.objs.vnics.get_mut(&v)) {
                    v.meter.completed(c.1.status);
                }
            }
        }
        Some(c)
    }

    /// What vRNIC `vnic` moved and how its work requests ended, counted by this engine: what
    /// its QPs counted (the data path counts on the QP alone, one lookup per event), those
    /// destroyed included (folded into the vRNIC's own count then), and what was counted on
    /// the vRNIC itself (a completion or drop whose QP was gone). Its QPs are summed on each
    /// call: stats are asked for rarely, events counted millions of times a second.
    pub fn meter(&self, vnic: VnicId) -> Option<Meter> {
        let mut m = self.objs.vnics.get(&vnic)?.meter;
        for q in self.objs.qps.values().filter(|q| q.vnic == vnic) {
            m.add(&q.meter);
        }
        Some(m)
    }

    /// The same for QP number `qpn` of `vnic`, since it was created (`None`: this engine has
    /// no such QP of that vRNIC).
    pub fn qp_meter(&self, vnic: VnicId, qpn: u32) -> Option<Meter> {
        let q = self.objs.qps.get(self.objs.by_qpn.get(&qpn)?)?;
        (q.vnic == vnic).then_some(q.meter)
    }

    /// The next async event for a context.
    #[must_use]
    pub fn poll_event(&mut self) -> Option<(CtxId, Event)> {
        self.out.events.pop_front()
    }

    /// Executes queued work requests, a bounded amount: at most [`PASS_WRS`] work requests and
    /// about [`PASS_BYTES`] bytes per call, as [`Engine::turn`]s, each vRNIC with work at most
    /// once per call. A driver that wants others' new work seen sooner under a flood calls
    /// [`Engine::turn`] itself and looks at its rings between turns. Fires due timers first.
    /// Returns whether anything happened; if not, nothing will until a WQE arrives or
    /// [`Engine::poll_timeout`] passes.
    pub fn process(&mut self, now: Instant, mem: &mut dyn Memory) -> bool {
        self.handle_timeout(now);
        let mut did = false;
        let (mut wrs, mut bytes) = (0usize, 0u64);
        for _ in 0..self.sched.runq.len() {
            if wrs >= PASS_WRS || bytes >= PASS_BYTES {
                break;
            }
            let Some(t) = self.turn(now, mem) else { break };
            did |= t.did;
            wrs += t.wrs;
            bytes = bytes.saturating_add(t.bytes);
        }
        did
    }

    /// One turn of the vRNIC at the front of the run queue: its ready QPs take turns, each
    /// for at most [`QP_WRS`] work requests, the vRNIC for at most [`VNIC_WRS`] work requests
    /// and [`CHUNK`] bytes ([`CHUNK_ALONE`] once no light tenant has had a turn with others
    /// waiting for [`SOLO_TURNS`] turns); then it goes to the back
    /// of the queue if it has more. A vRNIC that was idle is put at the front when its work
    /// arrives, so a tenant with little traffic waits for at most the turn under way, however
    /// many QPs or bytes the others have; idle QPs cost nothing. A large message moves in
    /// chunks over several turns. A vRNIC with QoS limits is charged what its turn moved; in
    /// debt, it leaves the run queue until the debt is paid (`qos`), and a turn that finds it
    /// in debt does nothing. `None` when no vRNIC has work. Fires no timers
    /// ([`Engine::handle_timeout`] does; it also gives vRNICs whose debt is paid their turn
    /// back).
    pub fn turn(&mut self, now: Instant, mem: &mut dyn Memory) -> Option<Turn> {
        self.turn_with(now, mem, &mut NoSiblings, &mut NoNewcomers)
    }

    /// [`Engine::turn`] as a daemon runs it: a work request whose destination is on a sibling
    /// engine (another engine thread) is executed here, through `sib`, with that engine held
    /// (one whose sibling is busy waits for the next pass); and while a light tenant competes,
    /// `news` is asked after each step of at most [`STEP`] bytes whether a light tenant has
    /// new work, which ends the turn. (Not inlined into the driver's pass: inlined, it took the
    /// inliner's budget from the requester's own calls, 31 instructions more per 2-byte WRITE
    /// on one engine, counted by callgrind.)
    #[inline(never)]
    pub fn turn_with<S: Siblings>(
        &mut self,
        now: Instant,
        mem: &mut dyn Memory,
        sib: &mut S,
        news: &mut dyn Newcomers,
    ) -> Option<Turn> {
        let vid = self.sched.runq.pop_front()?;
        // Cloned only when it limits: an unlimited vRNIC's turn costs one relaxed load.
        let limit = self
            .objs
            .vnics
            .get(&vid)
            .and_then(|v| v.limit.as_ref())
            .filter(|l| l.limits())
            .cloned();
        // A vRNIC in debt to its QoS limit waits off the run queue: no turn now.
        if let Some(until) = limit.as_ref().and_then(|l| l.ready_at(now)) {
            self.throttle(vid, until);
            return Some(Turn {
                vnic: vid,
                did: false,
                wrs: 0,
                bytes: 0,
            });
        }
        self.sched.turns += 1;
        let others_wait = !self.sched.runq.is_empty();
        let competes = self.light_tenant_competes();
        (self.sched.turn_bytes, self.sched.step_bytes) = if competes {
            (CHUNK, STEP)
        } else {
            (CHUNK_ALONE, CHUNK_ALONE)
        };
        let mut cut = false;
        let turns = self.objs.vnics.get(&vid).map_or(0, |v| v.ready.len());
        let mut t = Turn {
            vnic: vid,
            did: false,
            wrs: 0,
            bytes: 0,
        };
        for _ in 0..turns {
            if cut || t.wrs >= VNIC_WRS || t.bytes >= self.sched.turn_bytes {
                break;
            }
            let Some(qp) = self
                .objs
                .vnics
                .get_mut(&vid)
                .and_then(|v| v.ready.pop_front())
            else {
                break;
            };
            let Some(q) = self.objs.qps.get_mut(&qp) else {
                continue;
            };
            q.sched.queued = false;
            if q.sched.parked {
                // It began to wait after it was listed (an RNR NAK from a peer link).
                continue;
            }
            let (mut wrs, mut blocked, mut busy) = (0usize, false, false);
            while wrs < QP_WRS && t.wrs < VNIC_WRS && t.bytes < self.sched.turn_bytes {
                let Some(q) = self.objs.qps.get(&qp) else {
                    break;
                };
                if !q.has_unsent() || q.attr.qp_state != QpState::Rts {
                    break;
                }
                let (n, retired) = match self.step(now, qp, mem, sib) {
                    Step::Done(n) | Step::Sent(n) => (n, 1),
                    Step::Partial(n) if n > 0 => (n, 0),
                    Step::Partial(_) | Step::Blocked => {
                        blocked = true;
                        break;
                    }
                    Step::Busy => {
                        busy = true;
                        break;
                    }
                };
                t.did = true;
                wrs += retired;
                t.wrs += retired;
                t.bytes = t.bytes.saturating_add(n);
                // A light tenant with new work goes next: after this step, not the turn.
                if competes && news.arrived() {
                    cut = true;
                    break;
                }
            }
            if busy {
                self.defer(qp);
            } else if blocked {
                self.park(qp);
            } else {
                // More work: back of its vRNIC's list (an empty or stopped QP is dropped
                // by `wake`).
                self.wake(qp);
            }
        }
        let debt = limit
            .filter(|_| t.did)
            .and_then(|l| l.charge(now, t.bytes, t.wrs));
        if let Some(v) = self.objs.vnics.get_mut(&vid) {
            v.queued = !v.ready.is_empty();
            if v.queued
                && let Some(until) = debt
            {
                self.throttle(vid, until);
            } else if v.queued {
                self.sched.runq.push_back(vid);
            } else if others_wait {
                // A light tenant (its work done in one turn) beside busy ones: theirs stay short.
                self.sched.light_at = self.sched.turns;
                self.note_light(vid);
            }
        }
        Some(t)
    }

    /// Whether a light tenant competes with busy ones (one had a turn that did all its work
    /// while others waited, in the last [`SOLO_TURNS`] turns): turns are short then, and a
    /// driver should look for new work between them as often as it can afford.
    #[must_use]
    pub fn light_tenant_competes(&self) -> bool {
        self.sched.turns - self.sched.light_at <= SOLO_TURNS
    }

    /// Notes `vid` as a light tenant as of this turn, and forgets those that have not been
    /// for [`SOLO_TURNS`] turns, and past [`LIGHT_MAX`] the oldest.
    fn note_light(&mut self, vid: VnicId) {
        let now = self.sched.turns;
        let light = &mut self.sched.light;
        light.retain(|&(v, at)| v != vid && now - at <= SOLO_TURNS);
        // Oldest first (noted in turn order): past the bound, the oldest is forgotten.
        if light.len() >= LIGHT_MAX {
            light.remove(0);
        }
        light.push((vid, now));
    }

    /// The light tenants ([`Engine::is_light`]), at most [`LIGHT_MAX`], the latest.
    pub fn light_vnics(&self) -> impl Iterator<Item = VnicId> + '_ {
        let now = self.sched.turns;
        self.sched
            .light
            .iter()
            .filter(move |&&(_, at)| now - at <= SOLO_TURNS)
            .map(|&(v, _)| v)
    }

    /// Whether `vnic` is a light tenant: in the last [`SOLO_TURNS`] turns it had one that did
    /// all its work while others waited (and it is among the [`LIGHT_MAX`] latest such). A
    /// driver's [`Newcomers`] looks at these vRNICs' rings between the steps of others' turns.
    #[must_use]
    pub fn is_light(&self, vnic: VnicId) -> bool {
        self.light_vnics().any(|v| v == vnic)
    }

    /// Whether `vnic` has work waiting for a turn (it is in the run queue, or waits for its QoS
    /// debt to be paid: see `qos`). A driver that
    /// looks for new work between turns need only look at vRNICs without: the others' new
    /// work can wait for their next turn.
    #[must_use]
    pub fn has_turn_waiting(&self, vnic: VnicId) -> bool {
        self.objs
            .vnics
            .get(&vnic)
            .is_some_and(|v| v.queued || v.throttled)
    }

    /// Puts a QP that may have work in its vRNIC's ready list (once), and the vRNIC in the run
    /// queue: at the front if it was idle.
    pub(super) fn wake(&mut self, qp: QpId) {
        let Some(q) = self.objs.qps.get_mut(&qp) else {
            return;
        };
        if q.sched.queued || q.sched.parked || !q.has_unsent() || q.attr.qp_state != QpState::Rts {
            return;
        }
        q.sched.queued = true;
        let vid = q.vnic;
        let Some(v) = self.objs.vnics.get_mut(&vid) else {
            return;
        };
        v.ready.push_back(qp);
        if !v.queued && !v.throttled {
            v.queued = true;
            self.sched.runq.push_front(vid);
        }
    }

    /// Takes a blocked QP off the ready lists: what it waits for wakes it (a receive at its
    /// responder, a responder appearing), and its timer in any case.
    pub(super) fn park(&mut self, qp: QpId) {
        let Some(q) = self.objs.qps.get(&qp) else {
            return;
        };
        let wait = q.wait;
        match wait {
            Wait::Rnr { on, .. } => {
                if let Some(key) = on
                    && let Some(q) = self.objs.qps.get_mut(&qp)
                    && !q.sched.listed
                {
                    q.sched.listed = true;
                    self.sched.rnr_waiters.entry(key).or_default().push(qp);
                }
            }
            Wait::Retry { .. } => {
                if let Some(q) = self.objs.qps.get_mut(&qp)
                    && !q.sched.listed
                {
                    q.sched.listed = true;
                    self.sched.retry_waiters.push(qp);
                }
            }
            // Nothing to wait for: try again next call.
            Wait::None => {
                self.wake(qp);
                return;
            }
        }
        if let Some(q) = self.objs.qps.get_mut(&qp) {
            q.sched.parked = true;
        }
    }

    /// Takes a QP whose sibling was busy off the ready lists until the next pass
    /// ([`Engine::handle_timeout`]).
    fn defer(&mut self, qp: QpId) {
        if let Some(q) = self.objs.qps.get_mut(&qp)
            && !q.sched.parked
        {
            q.sched.parked = true;
            self.sched.deferred.push(qp);
        }
    }

    /// Whether a QP waits for a sibling engine that was busy: the driver should run another
    /// pass soon (calling [`Engine::handle_timeout`] first) rather than sleep.
    #[must_use]
    pub fn has_deferred(&self) -> bool {
        !self.sched.deferred.is_empty()
    }

    /// Whether some vRNIC has a turn waiting (work another thread handed this engine, such
    /// as receives it took on this engine's behalf, may have made one ready).
    #[must_use]
    pub fn has_turns(&self) -> bool {
        !self.sched.runq.is_empty()
    }

    /// Keeps one timer entry for `qp` at or before `until`.
    pub(super) fn arm(&mut self, qp: QpId, until: Instant) {
        let Some(q) = self.objs.qps.get_mut(&qp) else {
            return;
        };
        if q.sched.armed.is_none_or(|a| until < a) {
            q.sched.armed = Some(until);
            self.sched.timers.push(Reverse((until, qp)));
        }
    }

    /// A responder may be reachable now (a QP reached RTR, here or on a sibling engine, or a
    /// remote vRNIC was announced): the QPs that got no answer try again at once instead of
    /// waiting out their budget, as a fabric delivers the next try once the port is up.
    /// Returns whether any was waiting.
    pub(super) fn wake_retry_waiters(&mut self) -> bool {
        let waiting = std::mem::take(&mut self.sched.retry_waiters);
        let any = !waiting.is_empty();
        for w in waiting {
            self.unlist(w);
        }
        any
    }

    /// Takes a QP off the waiter list it was in, and wakes it.
    pub(super) fn unlist(&mut self, qp: QpId) {
        if let Some(q) = self.objs.qps.get_mut(&qp) {
            q.sched.listed = false;
        }
        self.unpark(qp);
    }

    /// Wakes a parked QP (its wait may be over).
    pub(super) fn unpark(&mut self, qp: QpId) {
        if let Some(q) = self.objs.qps.get_mut(&qp) {
            q.sched.parked = false;
        }
        self.wake(qp);
    }

    /// A receive was posted to `rq`: the QPs waiting on RNR for it try again.
    pub(super) fn wake_rnr(&mut self, rq: RecvQueue) {
        if let Some(list) = self.sched.rnr_waiters.remove(&rq) {
            for qp in list {
                self.unlist(qp);
            }
        }
    }

    /// Hands the driver every QP and SRQ whose retired counters moved since the last call:
    /// `qp(id, sq_retired, rq_retired)` and `srq(id, retired)`, so it publishes those and
    /// looks at no other.
    pub fn drain_retired(
        &mut self,
        mut qp: impl FnMut(QpId, u32, u32),
        mut srq: impl FnMut(SrqId, u32),
    ) {
        // Taken and put back, so that their room is kept (no allocation per call).
        let mut touched = std::mem::take(&mut self.sched.touched);
        for id in touched.drain(..) {
            if let Some(q) = self.objs.qps.get_mut(&id) {
                q.sched.touched = false;
                qp(id, q.sq_retired, q.rq_retired);
            }
        }
        self.sched.touched = touched;
        let mut touched = std::mem::take(&mut self.sched.touched_srqs);
        for id in touched.drain(..) {
            if let Some(s) = self.objs.srqs.get_mut(&id) {
                s.touched = false;
                srq(id, s.retired);
            }
        }
        self.sched.touched_srqs = touched;
    }
}
