//! vRNIC shared regions: the one file per vRNIC that the daemon and a driver library (in a
//! process, a container or a VM guest) both map, and the structures laid out in it.
//!
//! This is the only crate that touches shared memory. Everything in a region can be written by
//! an untrusted party at any time, so the API never hands out `&[u8]` or `&T` into it (except
//! `&AtomicU32` and `&AtomicU64`, whose every bit pattern is valid and which is made for concurrent access): bytes
//! are copied in and out, once, through bounds-checked calls, and indices read from the region
//! are values the caller must validate.
//!
//! Layout (all offsets from the start of the file; see [`layout`]):
//!
//! ```text
//! 0        header: magic, version, sizes, identity (name, LID, GID), engine-sleeping word,
//!          doorbell bits (one per QP/SRQ, see [`bell`])
//! 4 KiB    control mailboxes: CTRL_SLOTS x CTRL_SLOT_SIZE (request/response + async events)
//! heap     pages carved by the daemon: QP/CQ rings and the pages behind registered memory
//! ```
//!
//! A tenant can shrink its region file under the daemon; the daemon survives that through
//! [`fault`], a `SIGBUS` guard that turns the lost pages into zeros and poisons the region.
//!
//! The crate is deliberately not a protocol: it knows where things are and how to move bytes and
//! indices safely; what the bytes mean belongs to `vrnic-wire` and `vrnic-api`.
#![deny(unsafe_code)]
#![warn(missing_docs)]

pub mod bell;
mod copy;
pub mod fault;
pub mod freeze;
pub mod layout;
mod mailbox;
mod map;
mod ring;
mod spin;

pub use copy::copy_slice;
pub use mailbox::{Mailbox, MailboxState, WaitError};
pub use map::{Region, RegionError, remap_private};
pub use ring::Ring;
pub use spin::Spin;

/// Waits on `word` while it still holds `expected`, for at most `timeout_ms`; wakes early on
/// [`futex_wake`]. Works across processes that map the same file (a shared futex). Returns
/// false when the mapping cannot hold a futex (a guest's PCI BAR); the caller then polls.
pub fn futex_wait(word: &std::sync::atomic::AtomicU32, expected: u32, timeout_ms: u32) -> bool {
    map::futex_wait(word, expected, timeout_ms)
}

/// Wakes every waiter on `word`.
pub fn futex_wake(word: &std::sync::atomic::AtomicU32) {
    map::futex_wake(word)
}
