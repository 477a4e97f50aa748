//! Where things are in a region. Every number here is part of the format shared with the
//! driver library (and later with VM guests), so it changes only with [`VERSION`].

/// Magic at offset 0.
pub const MAGIC: [u8; 8] = *b"VRNICRG1";
/// Format version. 3: a completion slot's sequence word (`vrnic_wire::CQE_SEQ`), which a
/// driver polls instead of the ring's producer index (a driver of version 2 on a daemon of
/// version 3 would work, the other way round it would wait forever: both refuse the other).
pub const VERSION: u32 = 3;
/// Page size of the heap (and of the remapping of registered memory).
pub const PAGE: u64 = 4096;
/// Default region size: sparse, so only touched pages cost memory.
pub const DEFAULT_REGION_SIZE: u64 = 16 << 30;
/// Smallest region accepted.
pub const MIN_REGION_SIZE: u64 = 64 << 20;

/// Header field offsets.
pub mod hdr {
    /// `[u8; 8]` magic.
    pub const MAGIC: u64 = 0;
    /// `u32` format version.
    pub const VERSION: u64 = 8;
    /// `u32` heap page size.
    pub const PAGE_SIZE: u64 = 12;
    /// `u64` total region size in bytes.
    pub const REGION_SIZE: u64 = 16;
    /// `u64` offset of the first control mailbox.
    pub const CTRL_OFF: u64 = 24;
    /// `u32` number of control mailboxes.
    pub const CTRL_SLOTS: u64 = 32;
    /// `u32` size of one mailbox.
    pub const CTRL_SLOT_SIZE: u64 = 36;
    /// `u64` heap offset.
    pub const HEAP_OFF: u64 = 40;
    /// `u64` heap size.
    pub const HEAP_SIZE: u64 = 48;
    /// `u16` port LID.
    pub const LID: u64 = 56;
    /// `[u8; 16]` GID index 0.
    pub const GID: u64 = 64;
    /// `u64` node GUID (network byte order, as `ibv_get_device_guid` returns it).
    pub const GUID: u64 = 80;
    /// `[u8; 64]` vRNIC name, NUL padded.
    pub const NAME: u64 = 88;
    /// `u32` daemon's pid (diagnostics only).
    pub const DAEMON_PID: u64 = 152;
    /// `AtomicU32`, own cache line: nonzero while the engine sleeps and wants a doorbell.
    pub const ENGINE_SLEEPING: u64 = 256;
    /// `AtomicU32`, own cache line: 1 while the daemon serves this region, 2 once it left,
    /// [`STATE_REMOVED`] once the operator removed the vRNIC (`vrnic rm --force`).
    pub const DAEMON_STATE: u64 = 320;
    /// [`DAEMON_STATE`]: the vRNIC was removed by the operator while in use.
    pub const STATE_REMOVED: u32 = 3;
    /// `AtomicU32`, own cache line: the daemon's heartbeat, advanced at least every 200 ms
    /// while it serves the region. A guest, which cannot see the daemon's socket close,
    /// learns from a stalled beat that the daemon is gone.
    pub const DAEMON_BEAT: u64 = 384;
    /// `AtomicU32`, own cache line: advanced by a region-only context after it claims a
    /// mailbox, so the daemon looks through the mailboxes only when something was claimed
    /// (looking touches one page per mailbox, which on tmpfs costs memory).
    pub const CLAIMS: u64 = 448;
    /// `AtomicU32`, own cache line: bit `i` says summary word `i` may have bits set, so an
    /// idle region costs the daemon one load per pass (see `bell`).
    pub const BELL_ANY: u64 = 512;
    /// `[AtomicU32; BELL_SUMMARY_WORDS]`: bit `i` says doorbell word `i` may have bits set.
    pub const BELL_SUMMARY: u64 = 576;
    /// Summary words.
    pub const BELL_SUMMARY_WORDS: u32 = BELL_WORDS.div_ceil(32);
    /// `[AtomicU32; BELL_WORDS]`: one bit per queue (QP or SRQ) with new work posted.
    pub const BELLS: u64 = 1024;
    /// Doorbell words: the rest of the header page.
    pub const BELL_WORDS: u32 = ((4096 - BELLS) / 4) as u32;
    /// Length of the name field.
    pub const NAME_LEN: usize = 64;
}

/// Offset of the first control mailbox.
pub const CTRL_OFF: u64 = 4096;
/// Number of control mailboxes: contexts (device opens) a vRNIC serves at once.
pub const CTRL_SLOTS: u32 = 64;
/// Size of one control mailbox.
pub const CTRL_SLOT_SIZE: u32 = 128 << 10;
/// Offset of the heap: after the mailboxes, rounded to 2 MiB.
pub const HEAP_OFF: u64 =
    (CTRL_OFF + CTRL_SLOTS as u64 * CTRL_SLOT_SIZE as u64).next_multiple_of(2 << 20);

/// Mailbox field offsets (from the mailbox start).
pub mod mbox {
    /// `AtomicU32` state, see `MailboxState`.
    pub const STATE: u64 = 0;
    /// `u32` sequence number of the request being served.
    pub const SEQ: u64 = 4;
    /// `u32` payload length of the request or response.
    pub const LEN: u64 = 8;
    /// `AtomicU32` async-event producer index (daemon writes), own line.
    pub const EV_PROD: u64 = 64;
    /// `AtomicU32` async-event consumer index (driver writes), own line.
    pub const EV_CONS: u64 = 128;
    /// Async event records: [`EV_SLOTS`] x [`EV_SIZE`] bytes.
    pub const EV_RING: u64 = 192;
    /// Number of async event records.
    pub const EV_SLOTS: u32 = 64;
    /// Size of one async event record: `u32` type, `u32` object handle, `u64` reserved.
    pub const EV_SIZE: u64 = 16;
    /// `AtomicU32` a region-only context (a VM guest) advances at least every 100 ms while it
    /// lives; the daemon reclaims the context when it stalls (the guest's process died).
    pub const HEARTBEAT: u64 = 2048;
    /// Payload (request, then response in place).
    pub const PAYLOAD: u64 = 4096;
}

/// Largest control request or response payload.
pub const CTRL_PAYLOAD_MAX: usize = CTRL_SLOT_SIZE as usize - mbox::PAYLOAD as usize;

/// Ring field offsets (from the ring start).
pub mod ring {
    /// `AtomicU32` producer index (free running), own line.
    pub const PROD: u64 = 0;
    /// `AtomicU32` consumer index (free running), own line.
    pub const CONS: u64 = 64;
    /// `AtomicU32` written by the consumer-side party (CQ: the driver's arm word).
    pub const ARM: u64 = 128;
    /// `AtomicU32` written by the daemon (CQ: notification count; QP: state mirror).
    pub const NOTIFY: u64 = 192;
    /// `AtomicU32` written by the daemon, on the [`NOTIFY`] line: nonzero while the engine
    /// looks at this (send or receive) ring every pass, so a producer need not ring its
    /// doorbell (as virtio's `VRING_USED_F_NO_NOTIFY`). A producer stores its index, fences,
    /// then reads this word; the daemon clears it, fences, then reads the index once more: one
    /// of the two sees the other, so no work waits for a doorbell that was never rung.
    pub const POLLED: u64 = 196;
    /// First slot.
    pub const SLOTS: u64 = 256;
}

/// Bytes a ring of `depth` slots of `slot` bytes occupies, rounded to whole pages.
pub fn ring_bytes(depth: u32, slot: usize) -> u64 {
    (ring::SLOTS + u64::from(depth) * slot as u64).next_multiple_of(PAGE)
}

const _: () = assert!(HEAP_OFF >= CTRL_OFF + CTRL_SLOTS as u64 * CTRL_SLOT_SIZE as u64);
const _: () = assert!(mbox::EV_RING + mbox::EV_SLOTS as u64 * mbox::EV_SIZE <= mbox::HEARTBEAT);
const _: () = assert!(mbox::HEARTBEAT + 64 <= mbox::PAYLOAD);
const _: () = assert!(hdr::NAME + hdr::NAME_LEN as u64 <= hdr::DAEMON_PID);
const _: () = assert!(hdr::CLAIMS + 64 <= hdr::BELL_ANY);
const _: () = assert!(hdr::BELL_ANY + 64 <= hdr::BELL_SUMMARY);
const _: () = assert!(hdr::BELL_SUMMARY_WORDS <= 32);
const _: () = assert!(hdr::BELL_SUMMARY + hdr::BELL_SUMMARY_WORDS as u64 * 4 <= hdr::BELLS);
const _: () = assert!(hdr::BELLS + hdr::BELL_WORDS as u64 * 4 <= CTRL_OFF);
