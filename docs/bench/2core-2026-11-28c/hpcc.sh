#!/bin/bash
# HPC Challenge (Debian's hpcc, Open MPI 4.1 over UCX, 2 ranks, N=1000, P=1 Q=2) on vrnic
# against Open MPI's TCP transport, alternated in one sitting, as root:
#
#   bash docs/bench/2core-2026-11-28c/hpcc.sh [RUNS] [LAYOUT]
#
# RUNS (default 3) pairs of runs, vrnic then TCP; LAYOUT is `default` (Open MPI's own binding:
# with 2 ranks, rank 0 on core 0 and rank 1 on core 1; the daemon unpinned), `none` (nothing
# bound: `--bind-to none`) or `pinned` (the daemon on core 0, both ranks on core 1). The
# binaries: $VRNIC (default target/release/vrnic, with libvrnic_shim.so beside it). Each run
# prints one row: transport, load average at its start, PingPong bandwidth and latency,
# PTRANS, MPIFFT, and the work directory holding hpccoutf.txt.
set -euo pipefail
runs=${1:-3}
layout=${2:-default}
here=$(cd "$(dirname "$0")/../../.." && pwd)
vrnic=${VRNIC:-$here/target/release/vrnic}
work=$(mktemp -d /tmp/hpcc-sitting.XXXXXX)
state=$work/state
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 VRNIC_STATE_DIR=$state

daemon=
stop() {
    if [ -n "$daemon" ]; then kill "$daemon" 2>/dev/null || true; wait "$daemon" 2>/dev/null || true; fi
    daemon=
}
trap stop EXIT

# hpccinf.txt: the example Debian ships with P=1, Q=2 (2 ranks), N=1000, NB=80.
inf() {
    sed -e 's/^2            Ps/1            Ps/' /usr/share/doc/hpcc/examples/_hpccinf.txt > "$1/hpccinf.txt"
}

case $layout in
default) serve_pin=(); run_pin=(); bind=() ;;
none) serve_pin=(); run_pin=(); bind=(--bind-to none) ;;
pinned) serve_pin=(taskset -c 0); run_pin=(taskset -c 1); bind=(--bind-to none) ;;
*) echo "layout: default, none or pinned" >&2; exit 2 ;;
esac

row() { # transport dir load
    local f=$2/hpccoutf.txt v
    printf '%-6s load %-5s' "$1" "$3"
    for k in AvgPingPongBandwidth_GBytes AvgPingPongLatency_usec PTRANS_GBs MPIFFT_Gflops; do
        v=$(grep -m1 "^$k=" "$f" 2>/dev/null | cut -d= -f2 || true)
        printf '  %s=%s' "${k%%_*}" "${v:-FAILED}"
    done
    # PTRANS_GBs is the slowest of its five timed transposes; the fastest too:
    v=$(awk '/^WALL/ && $9 == "PASSED" {if ($10 > m) m = $10} END {print m}' "$f" 2>/dev/null || true)
    printf '  PTRANS_best=%s  %s\n' "${v:-FAILED}" "$2"
}

mpirun_hpcc=(mpirun --allow-run-as-root --oversubscribe -np 2 "${bind[@]}")
for i in $(seq 1 "$runs"); do
    d=$work/vrnic-$i; mkdir -p "$d"; inf "$d"
    mkdir -p "$state"
    "${serve_pin[@]}" "$vrnic" serve --state-dir "$state" > "$work/serve-$i.log" 2>&1 &
    daemon=$!
    for _ in $(seq 100); do [ -S "$state/vrnic.sock" ] && break; sleep 0.1; done
    load=$(cut -d' ' -f1 /proc/loadavg)
    (cd "$d" && timeout 300 "${run_pin[@]}" "$vrnic" run -- "${mpirun_hpcc[@]}" --mca pml ucx \
        -x UCX_TLS=rc_verbs,ud_verbs,self hpcc > out.txt 2>&1) || true
    stop
    row vrnic "$d" "$load"
    d=$work/tcp-$i; mkdir -p "$d"; inf "$d"
    load=$(cut -d' ' -f1 /proc/loadavg)
    (cd "$d" && timeout 300 "${run_pin[@]}" "${mpirun_hpcc[@]}" --mca pml ob1 --mca btl tcp,self hpcc \
        > out.txt 2>&1) || true
    row tcp "$d" "$load"
done
