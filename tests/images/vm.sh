#!/usr/bin/env bash
# Builds the VM the guest tests boot, from Debian packages only: Debian's cloud kernel and an
# initramfs holding busybox (static), the virtio-net modules, an /init, and the given files.
#
#   tests/images/vm.sh OUT_DIR [FILE | SRC=DEST]...
#
# writes OUT_DIR/vmlinuz and OUT_DIR/initrd.img. Each FILE (an executable or library, by
# absolute path) goes into the initramfs at the same path with every library `ldd` lists for it;
# SRC=DEST puts SRC at DEST. The .debs are fetched with `apt-get download` into
# $VRNIC_VM_CACHE (default OUT_DIR/cache) once; the initramfs is rebuilt every time.
#
# The guest's /init mounts /proc, /sys, /dev, brings up eth0 for QEMU's user network
# (10.0.2.15, host at 10.0.2.2), runs the shell script passed base64-encoded as the kernel
# parameter vrnic.run=, prints VRNIC-GUEST-EXIT=<status> and powers off.
set -euo pipefail
out=${1:?usage: vm.sh OUT_DIR [FILE | SRC=DEST]...}
shift
cache=${VRNIC_VM_CACHE:-$out/cache}
mkdir -p "$out" "$cache"

need=()
command -v qemu-system-x86_64 >/dev/null || need+=(qemu-system-x86)
command -v cpio >/dev/null || need+=(cpio)
if [ ${#need[@]} -gt 0 ]; then
    apt-get install -y -qq "${need[@]}" >/dev/null 2>&1 ||
        { apt-get update -qq && apt-get install -y -qq "${need[@]}" >/dev/null; }
fi

# The kernel package the cloud metapackage points at, and busybox; fetched and unpacked once.
if [ ! -d "$cache/root/boot" ] || [ ! -x "$cache/root/bin/busybox" ]; then
    kpkg=$(apt-cache depends linux-image-cloud-amd64 | awk '/Depends: linux-image-/ {print $2; exit}')
    if [ -z "$kpkg" ]; then
        apt-get update -qq
        kpkg=$(apt-cache depends linux-image-cloud-amd64 | awk '/Depends: linux-image-/ {print $2; exit}')
    fi
    rm -rf "$cache/root" "$cache"/*.deb
    # A stale package index names files the mirror no longer has: refresh it once and retry.
    (cd "$cache" && apt-get download -qq "$kpkg" busybox-static 2>/dev/null) ||
        { apt-get update -qq && (cd "$cache" && apt-get download -qq "$kpkg" busybox-static 2>/dev/null); }
    for deb in "$cache"/*.deb; do dpkg-deb -x "$deb" "$cache/root"; done
fi
kroot=$cache/root
kver=$(basename "$(ls -d "$kroot"/lib/modules/*)")
cp "$kroot/boot/vmlinuz-$kver" "$out/vmlinuz"

stage=$(mktemp -d)
trap 'rm -rf "$stage"' EXIT
mkdir -p "$stage"/{bin,dev,proc,sys,tmp,run,etc,lib/modules,usr/lib/vrnic}
cp "$kroot/bin/busybox" "$stage/bin/busybox"
for a in $("$stage/bin/busybox" --list); do
    [ "$a" = busybox ] || ln -sf busybox "$stage/bin/$a"
done

# virtio-net and what it depends on, dependencies first (read from each module's .modinfo:
# the package ships no modules.dep), uncompressed in this kernel.
mods=()
add_mod() {
    local m=$1 path dep x
    path=$(find "$kroot/lib/modules/$kver/kernel" -name "$m.ko" -o -name "${m//_/-}.ko" | head -1)
    [ -n "$path" ] || { echo "module $m not found" >&2; exit 1; }
    for x in "${mods[@]}"; do [ "$x" = "$path" ] && return; done
    for dep in $(objcopy -O binary --only-section=.modinfo "$path" /dev/stdout |
        tr '\0' '\n' | sed -n 's/^depends=//p' | tr ',' ' '); do
        add_mod "$dep"
    done
    mods+=("$path")
}
add_mod virtio_pci
add_mod virtio_net
for m in "${mods[@]}"; do
    cp "$m" "$stage/lib/modules/"
    basename "$m" >>"$stage/lib/modules/order"
done

put() { # put SRC DEST: a file and the libraries it loads
    local src=$1 dest=$2 lib
    mkdir -p "$stage$(dirname "$dest")"
    cp -L "$src" "$stage$dest"
    while read -r lib; do
        [ -e "$stage$lib" ] && continue
        mkdir -p "$stage$(dirname "$lib")"
        cp -L "$lib" "$stage$lib"
    done < <(ldd "$src" 2>/dev/null | grep -o '/[^ ]*' || true)
}
for f in "$@"; do
    case "$f" in *=*) put "${f%%=*}" "${f#*=}" ;; *) put "$f" "$f" ;; esac
done
# Merged /usr: programs find their loader at /lib64 and libraries under /lib.
for d in lib lib64; do
    if [ -d "$stage/usr/$d" ] && [ ! -e "$stage/$d/x" ]; then
        mkdir -p "$stage/$d"
        cp -a "$stage/usr/$d/." "$stage/$d/"
    fi
done
echo 'root:x:0:0:root:/root:/bin/sh' >"$stage/etc/passwd"
printf '127.0.0.1 localhost\n' >"$stage/etc/hosts"

cat >"$stage/init" <<'INIT'
#!/bin/sh
mount -t proc proc /proc
mount -t sysfs sysfs /sys
mount -t devtmpfs devtmpfs /dev
mount -t tmpfs tmpfs /tmp
mount -t tmpfs tmpfs /run
for m in $(cat /lib/modules/order); do insmod /lib/modules/$m; done
ip link set lo up
ip link set eth0 up
ip addr add 10.0.2.15/24 dev eth0
ip route add default via 10.0.2.2
job=
for p in $(cat /proc/cmdline); do
    case "$p" in vrnic.run=*) job=${p#vrnic.run=} ;; esac
done
if [ -n "$job" ]; then
    echo "$job" | base64 -d >/run/job.sh
    echo "VRNIC-GUEST-START"
    sh /run/job.sh
    echo "VRNIC-GUEST-EXIT=$?"
else
    echo "VRNIC-GUEST-EXIT=none"
fi
poweroff -f
INIT
chmod +x "$stage/init"
(cd "$stage" && find . | cpio -o -H newc --quiet | gzip -1) >"$out/initrd.img"
echo "vm image: $out/vmlinuz ($kver), $out/initrd.img ($(du -h "$out/initrd.img" | cut -f1), modules: ${mods[*]##*/})"
