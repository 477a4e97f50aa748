#!/bin/bash
# The visit's third run (2026-11-28): where a cross-thread ib_write_lat's time goes. A daemon
# with --engine-threads 2 on cores 1-3 (three CPUs for two threads: the sibling spin is on) or
# on cores 1,2 (off); apps on 4 and 5. Latency rounds alternated, then a perf profile of the
# daemon's threads (by thread name) during a long cross-thread ib_write_lat.
set -u
D=$(cd "$(dirname "$0")" && pwd); O=${OUT:-/tmp/out}; mkdir -p "$O"
T0=$(date +%s); el() { echo "[$(( $(date +%s) - T0 )) s] $*" | tee -a "$O/progress.txt"; }
mkdir -p /opt/deb; for f in "$D"/debs/*.deb; do dpkg -x "$f" /opt/deb; done
export PATH=$PATH:/opt/deb/usr/bin:/opt/deb/usr/sbin:/opt/deb/sbin:/opt/deb/bin
export LD_LIBRARY_PATH=/opt/deb/usr/lib/x86_64-linux-gnu:/opt/deb/lib/x86_64-linux-gnu
V=$D/bin/vrnic; chmod +x "$V"
PERF() { LD_LIBRARY_PATH=$D/perf/lib:$LD_LIBRARY_PATH "$D/perf/perf" "$@"; }
last() { awk '$1 ~ /^[0-9]+$/ {r=$0} END {print r}'; }
P=27200
serve() { local cores=$1; shift; P=$((P+1)); S=/tmp/vs$P; mkdir -p $S; export VRNIC_STATE_DIR=$S
  taskset -c $cores "$V" serve --state-dir $S "$@" >"$O/serve.log" 2>&1 & DP=$!
  for i in $(seq 50); do [ -S $S/vrnic.sock ] && break; sleep 0.1; done
  "$V" create a >/dev/null; "$V" create b >/dev/null; "$V" create c >/dev/null; }
unserve() { kill $DP; wait $DP; umount -R $S 2>/dev/null; }
pair() { local sv=$1 cv=$2; shift 2; local P=$((30000 + RANDOM % 20000))
  timeout 30 taskset -c 4 "$V" run --vrnic $sv -- "$@" -p $P >/dev/null 2>&1 & local sp=$!; sleep 0.5
  timeout 30 taskset -c 5 "$V" run --vrnic $cv -- "$@" -p $P 127.0.0.1 2>&1 | last; wait $sp; }
el "latency: cores 1-3 (spin) and 1,2 (no spin), same and cross, alternated"
{ for r in 1 2 3; do for cores in 1-3 1,2; do serve $cores --engine-threads 2
    echo "$r cores $cores same ib_write_lat -s 2: $(pair a c ib_write_lat -s 2 -n 20000)"
    echo "$r cores $cores cross ib_write_lat -s 2: $(pair a b ib_write_lat -s 2 -n 20000)"
    unserve; done; done; } > "$O/lat.log" 2>&1; cat "$O/lat.log"
el "profile: cross-thread ib_write_lat, daemon on 1-3"
{ serve 1-3 --engine-threads 2; "$V" ls
  P2=$((30000 + RANDOM % 20000))
  taskset -c 4 "$V" run --vrnic a -- ib_write_lat -s 2 -n 3000000 -p $P2 >/dev/null 2>&1 & SP=$!; sleep 0.5
  taskset -c 5 "$V" run --vrnic b -- ib_write_lat -s 2 -n 3000000 -p $P2 127.0.0.1 >/dev/null 2>&1 & CP=$!
  sleep 1.5
  PERF record -F 4999 -s -p $DP -o "$O/cross-lat.data" -- sleep 2 2>&1 | tail -1
  grep -E "^(voluntary|nonvoluntary)_ctxt_switches" /proc/$DP/task/*/status | head -20
  for t in /proc/$DP/task/*; do echo "$(cat $t/comm) $(awk '{print $14+$15}' $t/stat)"; done
  kill $CP $SP 2>/dev/null; wait $CP $SP 2>/dev/null; unserve; } > "$O/profile.log" 2>&1; cat "$O/profile.log"
PERF report -i "$O/cross-lat.data" --sort comm --stdio 2>/dev/null | grep -E "^ +[0-9]" | head
el done
