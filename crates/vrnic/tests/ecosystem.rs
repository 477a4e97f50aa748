//! What RDMA stacks (UCX, Open MPI) rely on beyond the verbs themselves, checked by our own C
//! program (`tests/c/eco_check.c`) under `vrnic run`: deregistering memory the app has partly
//! unmapped (their registration caches do so at `MPI_Finalize`), no async event for a
//! destroyed QP (UCX's async thread dereferences the event's QP), registration invisible to
//! memory hooks (the program interposes `mmap`/`munmap`/`mremap` as UCX's ucm does), a
//! buffer registered again and again at a fraction of the first registration's cost, and
//! registration that asks the kernel for the buffer's areas rather than reading all of
//! `/proc/self/maps` (the program interposes `open`/`read`/`close` and counts its bytes).

mod common;

use std::path::PathBuf;
use std::sync::OnceLock;
use std::time::Duration;

use common::{Daemon, output};

fn program() -> &'static PathBuf {
    static BIN: OnceLock<PathBuf> = OnceLock::new();
    BIN.get_or_init(
        || // -rdynamic: its mmap/munmap/mremap preempt libc's for the driver library too.
        common::c_program("eco_check", &["-rdynamic", "-libverbs"]),
    )
}

/// Runs one case of `eco_check` on a fresh daemon started with `serve_args`; it must exit 0
/// having printed every check in `expect`.
fn case_on(serve_args: &[&str], name: &str, expect: &[&str]) {
    let bin = program().to_str().expect("utf-8 path").to_string();
    let d = Daemon::start_with(serve_args);
    let out = output(d.run(&[&bin, name]), name, Duration::from_secs(120));
    assert!(out.ok(), "case {name} failed\n{}", out.text());
    for e in expect.iter().chain(&["done"]) {
        assert!(
            out.stdout
                .lines()
                .any(|l| l.starts_with("OK ") && l.contains(e)),
            "case {name}: no OK line with {e:?}\n{}",
            out.text()
        );
    }
}

#[test]
fn dereg_mr_after_the_app_unmapped_part_of_the_range_succeeds_and_frees_it() {
    case_on(
        &["--region-gib", "1"],
        "dereg_unmapped",
        &[
            "middle unmapped: 0",
            "wholly unmapped: 0",
            "other memory mapped over part: 0",
            "the memory comes back",
        ],
    );
}

#[test]
fn no_async_event_names_a_destroyed_qp() {
    case_on(
        &[],
        "destroy_events",
        &[
            "QP_LAST_WQE_REACHED naming it",
            "no event after destroy, async_fd quiet",
            "still delivered after withdrawals",
        ],
    );
}

#[test]
fn registration_makes_no_mapping_call_a_memory_hook_sees() {
    case_on(
        &[],
        "hooks",
        &["0 mapping calls over the buffer visible to hooks"],
    );
}

#[test]
fn a_buffer_registered_again_and_again_costs_about_one_registration() {
    case_on(
        &[],
        "rereg_loop",
        &[
            "every WRITE seen",
            "a round costs a fraction of the first registration",
        ],
    );
}

/// Registration maps region pages over the buffer; each page the app touched then faulted on
/// its next touch (about a microsecond each, 140 us for 512 KiB here), which an MPI rank pays
/// right after the first send of a fresh buffer. The copied pages are entered in the page
/// tables with the remap (`MADV_POPULATE_WRITE`): touching 256 registered pages costs no fault
/// per page.
#[test]
fn touching_a_registered_buffer_costs_no_fault_per_page() {
    case_on(
        &[],
        "touch_after",
        &["no fault per page after registration"],
    );
}

/// UCX allocates its pools as `MADV_HUGEPAGE` memory and registers them whole. The driver read
/// the first and last page of each run it moved (to give a page it shares with other data an
/// entry, so that the freeze protects it), which mapped the huge zero page over their 2 MiB:
/// 1024 pages then counted as touched, and 4 MiB of zeros were copied into fresh region pages
/// at each such registration (about 2 ms). A page wholly the buffer's is not read now: an
/// untouched 8 MiB registers with no page put in the region (where the host has no
/// transparent huge zero page the case says so and does not count).
#[test]
fn an_untouched_huge_page_buffer_registers_without_copying_zeros() {
    case_on(&[], "huge_zeros", &["0 KiB of zeros copied"]);
}

/// An MPI rank maps hundreds of areas (its libraries, and one more per registered buffer):
/// reading `/proc/self/maps` as text to learn about one buffer's pages formatted all of them,
/// about 0.3 ms in an Open MPI rank, once or twice per registration, and HPC Challenge's
/// PTRANS and MPIFFT time transfers from buffers registered on their first use. Where the
/// kernel answers `PROCMAP_QUERY` (Linux 6.11), registering fresh buffers and registering them
/// again after a deregistration reads no byte of it (on older kernels the case says so and
/// does not count).
#[test]
fn registration_asks_the_kernel_for_the_buffers_areas_instead_of_reading_proc_self_maps() {
    case_on(&[], "maps_reads", &["0 bytes of /proc/self/maps read"]);
}

/// `ibv_devinfo -v` (unmodified) shows what the driver really does: a numeric firmware version,
/// the device capabilities the engine has (RNR NAK generation, the port-active event, a system
/// image GUID) and no others, an active InfiniBand port with a nonzero LID, MTU 4096 and
/// `subnet_timeout` 18, a connection manager, and table sizes and completion
/// vectors equal to what `create_*`/`modify_*` accept (`verbs_semantics dev_limits` checks
/// those limits are enforced).
#[test]
fn ibv_devinfo_shows_honest_attributes() {
    common::require("ibv_devinfo");
    let d = Daemon::start();
    let out = output(
        d.run(&["ibv_devinfo", "-v"]),
        "ibv_devinfo",
        Duration::from_secs(30),
    );
    assert!(out.ok(), "{}", out.text());
    let field = |name: &str| -> String {
        out.stdout
            .lines()
            .find_map(|l| l.trim().strip_prefix(name).map(|v| v.trim().to_string()))
            .unwrap_or_else(|| panic!("no {name} in\n{}", out.stdout))
    };
    let fw = field("fw_ver:");
    assert!(
        fw.split('.').count() == 3 && fw.split('.').all(|p| p.parse::<u32>().is_ok()),
        "fw_ver {fw:?} is not numeric"
    );
    // RC_RNR_NAK_GEN, PORT_ACTIVE_EVENT, SYS_IMAGE_GUID (0x1c00), SRQ_RESIZE (1 << 13),
    // MEM_WINDOW (1 << 17), XRC (1 << 20), MEM_WINDOW_TYPE_2B (1 << 24).
    assert_eq!(field("device_cap_flags:"), "0x01123c00");
    for flag in [
        "PORT_ACTIVE_EVENT",
        "SYS_IMAGE_GUID",
        "RC_RNR_NAK_GEN",
        "SRQ_RESIZE",
        "MEM_WINDOW",
        "MEM_WINDOW_TYPE_2B",
        "XRC",
    ] {
        assert!(
            out.stdout.lines().any(|l| l.trim() == flag),
            "no {flag} listed\n{}",
            out.stdout
        );
    }
    // CM_SUP (1 << 16) | SYS_IMAGE_GUID_SUP (1 << 11).
    assert_eq!(field("port_cap_flags:"), "0x00010800");
    assert_eq!(field("num_comp_vectors:"), "1");
    assert_eq!(field("gid_tbl_len:"), "1");
    assert_eq!(field("pkey_tbl_len:"), "1");
    assert_eq!(field("max_pkeys:"), "1");
    // The daemon's limits (`vrnic serve --max-qp/--max-srq` defaults).
    assert_eq!(field("max_qp:"), "4096");
    assert_eq!(field("max_srq:"), "4096");
    assert_eq!(field("state:"), "PORT_ACTIVE (4)");
    assert_eq!(field("max_mtu:"), "4096 (5)");
    assert_eq!(field("active_mtu:"), "4096 (5)");
    assert_eq!(field("link_layer:"), "InfiniBand");
    assert_eq!(field("subnet_timeout:"), "18");
    let lid = field("port_lid:");
    assert!(
        lid.parse::<u16>().is_ok_and(|l| l != 0),
        "port_lid {lid:?} is not a nonzero LID"
    );
    assert_eq!(field("sys_image_guid:"), field("node_guid:"));
}
