#!/bin/bash
# ucxlat.sh ucx|send PIN: one run, on a fresh daemon, of UCX's `ucx_perftest -t tag_lat -s 8`
# over `rc_verbs` (ucx) or perftest's `ib_send_lat -s 8` (send) between vRNICs a and b;
# PIN 1: the daemon on core 0, both apps on core 1; PIN 0: nothing pinned. Prints ucx_perftest's
# "Final:" line (its third field is the median half round trip, us) or ib_send_lat's row (its
# fifth field is the typical half round trip, us). N iterations (default 100000); the binaries:
# $V (default target/release/vrnic, with libvrnic_shim.so beside it). As root.
set -u
here=$(cd "$(dirname "$0")/../../.." && pwd)
V=${V:-$here/target/release/vrnic}
N=${N:-100000}
MODE=$1; PIN=$2
S=$(mktemp -d /tmp/ucxlat.XXXXXX)
if [ "$PIN" = 1 ]; then DP=(taskset -c 0); AP=(taskset -c 1); else DP=(); AP=(); fi
"${DP[@]}" "$V" serve --state-dir "$S" --no-persist >"$S.daemon.log" 2>&1 &
DPID=$!
for _ in $(seq 100); do "$V" --state-dir "$S" ls >/dev/null 2>&1 && break; sleep 0.1; done
"$V" --state-dir "$S" create a >/dev/null; "$V" --state-dir "$S" create b >/dev/null
PORT=$((20000 + RANDOM % 20000))
if [ "$MODE" = ucx ]; then
    "${AP[@]}" "$V" --state-dir "$S" run --vrnic a -- env UCX_TLS=rc_verbs,ud_verbs,self \
        ucx_perftest -p $PORT >"$S.server.log" 2>&1 &
    SPID=$!
    sleep 1
    "${AP[@]}" "$V" --state-dir "$S" run --vrnic b -- env UCX_TLS=rc_verbs,ud_verbs,self \
        ucx_perftest 127.0.0.1 -p $PORT -t tag_lat -s 8 -n "$N" 2>&1 | grep "^Final:"
else
    "${AP[@]}" "$V" --state-dir "$S" run --vrnic a -- ib_send_lat -s 8 -n "$N" -p $PORT \
        >"$S.server.log" 2>&1 &
    SPID=$!
    sleep 1
    "${AP[@]}" "$V" --state-dir "$S" run --vrnic b -- ib_send_lat -s 8 -n "$N" -p $PORT \
        127.0.0.1 2>&1 | grep -E "^ *8 "
fi
wait $SPID
kill $DPID; wait $DPID 2>/dev/null
rm -rf "$S" "$S.daemon.log" "$S.server.log"
