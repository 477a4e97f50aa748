//! Tenants' groups on the data path: a route (RTR to a LID or GID, an address handle) joins
//! two vRNICs only when they are in the same group. Across groups the destination is treated
//! as absent, so the requester sees what an unreachable peer gives (`RETRY_EXC_ERR` on RC and
//! UC, a datagram dropped on UD), and the refusal is kept for the daemon to log.

use super::segment::Route;
use super::*;

/// Most refusals kept between two [`Engine::take_refusals`] calls; later ones are counted
/// only (a tenant retrying in a loop cannot grow the engine's memory).
pub const MAX_REFUSALS: usize = 256;

/// The far end of a refused route.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refused {
    /// A vRNIC of this daemon.
    Local(VnicId),
    /// A vRNIC behind the peer link to `host`, by its LID.
    Remote {
        /// Its host.
        host: HostId,
        /// Its LID.
        lid: u16,
    },
}

/// A route refused because its two ends are in different groups.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Refusal {
    /// The vRNIC that asked for the route.
    pub from: VnicId,
    /// Its group.
    pub from_group: GroupId,
    /// The destination.
    pub to: Refused,
    /// The destination's group.
    pub to_group: GroupId,
}

impl Engine {
    /// Registers a vRNIC with its address, in `group`.
    pub fn add_vnic_in_group(&mut self, vnic: VnicId, lid: u16, gid: [u8; 16], group: GroupId) {
        self.add_vnic(vnic, lid, gid);
        if let Some(v) = self.objs.vnics.get_mut(&vnic) {
            v.group = group;
        }
        self.routes.generation += 1;
    }

    /// Makes a vRNIC of `group` behind a peer link known: routes to its LID and GID from
    /// vRNICs of the same group go there.
    pub fn add_remote_vnic_in_group(
        &mut self,
        host: HostId,
        lid: u16,
        gid: [u8; 16],
        group: GroupId,
    ) {
        self.routes.generation += 1;
        self.routes.remote_lids.insert(lid, (host, group));
        self.routes.remote_gids.insert(gid, (host, group, lid));
        // The QPs whose address led nowhere (the announcement was not yet here) look again.
        self.wake_retry_waiters();
    }

    /// The route from vRNIC `from` to the address `ah`: [`Route::Nowhere`] when nobody
    /// answers it, or when its vRNIC is in another group (then, if `note`, a [`Refusal`] is
    /// kept: once per address given, not again when a QP moves on with the same one).
    pub(super) fn route_from(&mut self, from: VnicId, ah: &AhAttr, note: bool) -> Route {
        let Some(mine) = self.objs.vnics.get(&from).map(|v| v.group) else {
            return Route::Nowhere;
        };
        let (route, group, to) = match self.resolve(ah) {
            Route::Local(v) => (
                Route::Local(v),
                self.objs.vnics.get(&v).map(|x| x.group),
                Refused::Local(v),
            ),
            Route::Remote(h) => {
                let found = if ah.is_global {
                    self.routes
                        .remote_gids
                        .get(&ah.grh.dgid)
                        .map(|&(_, g, lid)| (g, lid))
                } else {
                    self.routes
                        .remote_lids
                        .get(&ah.dlid)
                        .map(|&(_, g)| (g, ah.dlid))
                };
                let lid = found.map_or(0, |(_, l)| l);
                (
                    Route::Remote(h),
                    found.map(|(g, _)| g),
                    Refused::Remote { host: h, lid },
                )
            }
            Route::Nowhere => return Route::Nowhere,
        };
        match group {
            Some(g) if g == mine => route,
            Some(_) if !note => Route::Nowhere,
            Some(g) => {
                self.routes.refused += 1;
                if self.routes.refusals.len() < MAX_REFUSALS {
                    self.routes.refusals.push(Refusal {
                        from,
                        from_group: mine,
                        to,
                        to_group: g,
                    });
                }
                Route::Nowhere
            }
            None => Route::Nowhere,
        }
    }

    /// The routes refused across groups since the last call (at most `MAX_REFUSALS`, 256), and
    /// how many there were in all.
    pub fn take_refusals(&mut self) -> (Vec<Refusal>, u64) {
        let n = std::mem::take(&mut self.routes.refused);
        (std::mem::take(&mut self.routes.refusals), n)
    }

    /// Whether refusals wait to be taken.
    #[must_use]
    pub fn has_refusals(&self) -> bool {
        self.routes.refused > 0
    }
}
