#!/usr/bin/env bash
# Builds the Docker image the container tests run (default tag vrnic-test:latest) from the
# host's own files: no image registry is reachable here, so nothing is pulled. The image holds
# /bin/sh, a few coreutils, the programs of the Debian packages ibverbs-utils, perftest,
# rdmacm-utils and ucx-utils (with UCX's transport modules, which it loads by dlopen), and
# every shared library they load; not the vrnic driver library, which
# `vrnic docker-args` bind-mounts at run time. An unchanged rebuild is skipped (the image
# carries a hash of its inputs as a label).
set -euo pipefail
tag=${1:-vrnic-test:latest}

pkgs=(ibverbs-utils perftest rdmacm-utils ucx-utils)
missing=()
for p in "${pkgs[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
    apt-get install -y -qq "${missing[@]}" >/dev/null 2>&1 ||
        { apt-get update -qq && apt-get install -y -qq "${missing[@]}" >/dev/null; }
fi

progs=(/bin/sh)
for t in cat ls env echo test sleep true false id mkdir rm timeout grep head; do
    progs+=("$(type -P "$t")")
done
for p in "${pkgs[@]}"; do
    while read -r f; do
        [ -f "$f" ] && [ -x "$f" ] && progs+=("$f")
    done < <(dpkg -L "$p" | grep '^/usr/bin/')
done
# UCX's transport modules (dlopened from .../ucx/ beside libuct, so ldd does not list them).
while read -r f; do progs+=("$f"); done < <(dpkg -L libucx0 | grep '/ucx/libuct_.*\.so\.0$')
# Libraries a preloaded Rust cdylib needs besides what the programs load.
extra=(libgcc_s.so.1 libm.so.6 libpthread.so.0 libdl.so.2 librt.so.1)

files=()
for f in "${progs[@]}"; do
    files+=("$f")
    while read -r lib; do files+=("$lib"); done < <(ldd "$f" 2>/dev/null | grep -o '/[^ ]*')
done
for l in "${extra[@]}"; do
    files+=("$(ldconfig -p | awk -v l="$l" '$1 == l && /x86-64/ && !n++ {print $NF}')")
done
mapfile -t files < <(printf '%s\n' "${files[@]}" | grep -v '^$' | sort -u)

hash=$(for f in "${files[@]}"; do stat -L -c '%n %s %Y' "$f"; done | sha256sum | cut -c1-16)
if [ "$(docker image inspect -f '{{index .Config.Labels "vrnic.inputs"}}' "$tag" 2>/dev/null)" = "$hash" ]; then
    echo "image $tag up to date ($hash)"
    exit 0
fi

root=$(mktemp -d)
trap 'rm -rf "$root"' EXIT
mkdir -p "$root"/{usr/bin,usr/lib,usr/lib64,etc/libibverbs.d,tmp,run/vrnic-device,proc,sys,dev,usr/lib/vrnic}
chmod 1777 "$root/tmp"
# The usrmerge layout of the host: /bin, /lib and /lib64 are links into /usr.
for d in bin lib lib64 sbin; do ln -s "usr/$d" "$root/$d"; done
mkdir -p "$root/usr/sbin"
for f in "${files[@]}"; do
    real=$(readlink -f "$f")
    dest="$root/usr${f#/usr}"
    case "$f" in /usr/*) dest="$root$f" ;; *) dest="$root/usr$f" ;; esac
    mkdir -p "$(dirname "$dest")"
    cp -L "$real" "$dest"
done
echo 'root:x:0:0:root:/root:/bin/sh' >"$root/etc/passwd"
echo 'root:x:0:' >"$root/etc/group"
printf '127.0.0.1 localhost\n::1 localhost\n' >"$root/etc/hosts"

tar -C "$root" -c . | docker import \
    -c "LABEL vrnic.inputs=$hash" -c 'ENV PATH=/usr/bin:/bin' - "$tag" >/dev/null
echo "image $tag built: ${#files[@]} files, $(du -sh "$root" | cut -f1), inputs $hash"
