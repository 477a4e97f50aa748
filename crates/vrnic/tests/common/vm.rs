//! QEMU guests for the tests: the image (Debian's cloud kernel and an initramfs with the
//! driver library and the programs a test names, built by `tests/images/vm.sh` from Debian
//! packages), and a boot that runs one shell script inside and powers off.
//!
//! The guest gets its vRNIC exactly as a user's VM would: the options `vrnic vm-args NAME`
//! prints (the region as an `ivshmem-plain` device). Its network is QEMU's user network: the
//! host is 10.0.2.2 from inside, so guest programs connect out to servers on the host's
//! loopback. QEMU runs under TCG (no KVM here), one vCPU, in its own process group: killed with
//! it on any failure. The console is kept (returned, and written next to the test's binary) for
//! diagnosis.

use std::path::PathBuf;
use std::process::Command;
use std::time::Duration;

use super::{Daemon, Output, Proc, output, vrnic_bin};

/// Where the driver library sits inside the guest.
pub const GUEST_DRIVER: &str = "/usr/lib/vrnic/libvrnic_shim.so";

/// A built guest image.
pub struct Image {
    pub kernel: PathBuf,
    pub initrd: PathBuf,
}

fn tmp() -> PathBuf {
    PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
}

/// Builds an image for test `name` holding `programs` (host paths, with their libraries) and
/// the driver library. The Debian packages are fetched once into a cache shared by all tests
/// (`flock` serializes the builds).
pub fn image(name: &str, programs: &[&str]) -> Image {
    let out = tmp().join(format!("vm-{name}"));
    let driver = vrnic_bin().with_file_name("libvrnic_shim.so");
    let mut c = Command::new("flock");
    c.arg(tmp().join("vm-image.lock"))
        .arg("bash")
        .arg(PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/images/vm.sh"))
        .arg(&out)
        .args(programs)
        .arg(format!("{}={GUEST_DRIVER}", driver.display()))
        .env("VRNIC_VM_CACHE", tmp().join("vm-cache"));
    let o = output(c, "tests/images/vm.sh", Duration::from_secs(600));
    assert!(o.ok(), "building the VM image failed\n{}", o.text());
    Image {
        kernel: out.join("vmlinuz"),
        initrd: out.join("initrd.img"),
    }
}

/// What a guest run showed.
pub struct Guest {
    /// Everything the console printed (kernel, init, the script).
    pub console: String,
    /// The script's exit status, if the guest got to report it.
    pub status: Option<i32>,
    pub timed_out: bool,
}

impl Guest {
    pub fn ok(&self) -> bool {
        self.status == Some(0) && !self.timed_out
    }
}

/// QEMU booting `img` with `vnic`'s region attached (`vrnic vm-args`), running `script`.
pub fn qemu(d: &Daemon, img: &Image, vnic: &str, script: &str) -> Command {
    let args = d.cli_output(&["vm-args", vnic]);
    assert!(args.ok(), "vrnic vm-args {vnic}\n{}", args.text());
    let mut b64 = String::new();
    base64(script.as_bytes(), &mut b64);
    let mut c = Command::new("qemu-system-x86_64");
    c.args([
        "-accel",
        "tcg",
        "-m",
        "512",
        "-smp",
        "1",
        "-nographic",
        "-no-reboot",
    ])
    .arg("-kernel")
    .arg(&img.kernel)
    .arg("-initrd")
    .arg(&img.initrd)
    .arg("-append")
    .arg(format!("console=ttyS0 quiet panic=-1 vrnic.run={b64}"))
    .args([
        "-netdev",
        "user,id=n0",
        "-device",
        "virtio-net-pci,netdev=n0",
    ])
    .args(args.stdout.split_whitespace());
    c
}

/// Boots, runs `script` inside and waits (at most `limit`) for the guest to power off.
pub fn boot(d: &Daemon, img: &Image, vnic: &str, script: &str, limit: Duration) -> Guest {
    let out = Proc::spawn(qemu(d, img, vnic, script), "qemu").wait_bounded(limit);
    guest(out, vnic)
}

/// Reads a finished QEMU's console; keeps it in a file for diagnosis.
pub fn guest(out: Output, tag: &str) -> Guest {
    let console = format!("{}{}", out.stdout, out.stderr);
    let log = tmp().join(format!("vm-{tag}-{}.console.log", std::process::id()));
    let _ = std::fs::write(&log, &console);
    let status = console
        .lines()
        .rev()
        .find_map(|l| l.trim().strip_prefix("VRNIC-GUEST-EXIT="))
        .and_then(|s| s.trim().parse().ok());
    Guest {
        console,
        status,
        timed_out: out.timed_out,
    }
}

/// Waits for `peer` (the program the guest talked to; long if the guest succeeded, briefly if
/// not) and asserts that both ended well, showing the console and the peer's output if not.
pub fn finish_with(g: &Guest, peer: Proc, what: &str) -> Output {
    let p = peer.wait_bounded(if g.ok() {
        Duration::from_secs(60)
    } else {
        Duration::from_secs(5)
    });
    assert!(
        g.ok() && p.ok(),
        "guest {:?}{}:\n{}\n--- {what}:\n{}",
        g.status,
        if g.timed_out { " (timed out)" } else { "" },
        g.console,
        p.text()
    );
    p
}

/// Standard base64 (the kernel command line carries the script).
fn base64(data: &[u8], out: &mut String) {
    const T: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    for chunk in data.chunks(3) {
        let b = [
            chunk[0],
            chunk.get(1).copied().unwrap_or(0),
            chunk.get(2).copied().unwrap_or(0),
        ];
        let n = (u32::from(b[0]) << 16) | (u32::from(b[1]) << 8) | u32::from(b[2]);
        for i in 0..4 {
            if i <= chunk.len() {
                out.push(T[((n >> (18 - 6 * i)) & 63) as usize] as char);
            } else {
                out.push('=');
            }
        }
    }
}
