#!/bin/bash
# The visit's second run (2026-11-28): the seam and engine-thread rows again after the sibling
# spin (SIBLING_WAIT) and the idle pass's fewer clock reads, against the first run's build
# (.dev/old) alternated round by round; the scale rows again (16 pairs on one thread failed in the first), and
# profiles: perf (bundled from Debian 12 as .dev/perf with its libraries) of the engine core
# during `ib_write_lat -s 2` and during 32 pairs of 128 KiB `ib_write_bw` on one engine thread,
# with that core's busy share from /proc/stat. Results in $OUT.
set -u
D=$(cd "$(dirname "$0")" && pwd); O=${OUT:-/tmp/out}; mkdir -p "$O"
T0=$(date +%s); el() { echo "[$(( $(date +%s) - T0 )) s] $*" | tee -a "$O/progress.txt"; }
mkdir -p /opt/deb; for f in "$D"/debs/*.deb; do dpkg -x "$f" /opt/deb; done
export PATH=$PATH:/opt/deb/usr/bin:/opt/deb/usr/sbin:/opt/deb/sbin:/opt/deb/bin
export LD_LIBRARY_PATH=/opt/deb/usr/lib/x86_64-linux-gnu:/opt/deb/lib/x86_64-linux-gnu
export CPATH=/opt/deb/usr/include LIBRARY_PATH=/opt/deb/usr/lib/x86_64-linux-gnu
V=$D/bin/vrnic; chmod +x "$V"
PERF() { LD_LIBRARY_PATH=$D/perf/lib:$LD_LIBRARY_PATH "$D/perf/perf" "$@"; }
SECTIONS=${SECTIONS:-"seam threads profile scale"}
on() { case " $SECTIONS " in *" $1 "*) return 0;; esac; return 1; }
last() { awk '$1 ~ /^[0-9]+$/ {r=$0} END {print r}'; }
P=27100
serve() { local cores=$1; shift; P=$((P+1)); S=/tmp/vs$P; mkdir -p $S; export VRNIC_STATE_DIR=$S
  taskset -c $cores "$V" serve --state-dir $S "$@" >"$O/serve-$P.log" 2>&1 & DP=$!
  for i in $(seq 50); do [ -S $S/vrnic.sock ] && break; sleep 0.1; done; }
unserve() { kill $DP; wait $DP; umount -R $S 2>/dev/null; }
pair() { local sc=$1 cc=$2 sv=$3 cv=$4; shift 4; local P=$((30000 + RANDOM % 20000))
  local so=(); [ -n "$sv" ] && so=(--vrnic "$sv"); local co=(); [ -n "$cv" ] && co=(--vrnic "$cv")
  timeout 30 taskset -c $sc "$V" run "${so[@]}" -- "$@" -p $P >/dev/null 2>&1 & local sp=$!; sleep 0.5
  timeout 30 taskset -c $cc "$V" run "${co[@]}" -- "$@" -p $P 127.0.0.1 2>&1 | last; wait $sp; }
busy() { awk -v c="cpu$1" '$1==c {print $2+$3+$4+$7+$8, $5+$6}' /proc/stat; }

# Two builds alternated round by round: .dev/old (the first run's) and .dev/bin (this one's).
build() { if [ "$1" = old ]; then V=$D/old/vrnic; else V=$D/bin/vrnic; fi; chmod +x "$V"; }
if on seam; then el "seam: --engine-threads 2 on cores 1,2; apps on 3 and 4; old and new builds alternated"
  { for r in 1 2 3; do for b in old new; do build $b
      serve 1,2 --engine-threads 2; "$V" create a >/dev/null; "$V" create b >/dev/null; "$V" create c >/dev/null
      echo "$r $b same-thread ib_write_bw -s 2: $(pair 3 4 a c ib_write_bw -s 2 -D 2)"
      echo "$r $b cross-thread ib_write_bw -s 2: $(pair 3 4 a b ib_write_bw -s 2 -D 2)"
      echo "$r $b same-thread ib_write_lat -s 2: $(pair 3 4 a c ib_write_lat -s 2 -n 20000)"
      echo "$r $b cross-thread ib_write_lat -s 2: $(pair 3 4 a b ib_write_lat -s 2 -n 20000)"
      unserve; done; done; build new; } > "$O/seam.log" 2>&1; cat "$O/seam.log"; fi

if on threads; then el "threads: --engine-threads 1 pinned against 4 unpinned; old and new alternated"
  { for r in 1 2 3; do for b in old new; do build $b
    for mode in "1|--engine-threads 1" "0-15|--engine-threads 4"; do cores=${mode%%|*}; opt=${mode#*|}
      serve $cores $opt
      echo "$r $b cores $cores '$opt' ib_write_lat -s 2: $(pair 2 3 '' '' ib_write_lat -s 2 -n 20000)"
      echo "$r $b cores $cores '$opt' ib_write_bw -s 2: $(pair 2 3 '' '' ib_write_bw -s 2 -D 2)"
      unserve
    done; done; done; build new; } > "$O/threads.log" 2>&1; cat "$O/threads.log"; fi

if on profile; then el "profile: ib_write_lat -s 2 and 32 pairs of 128 KiB, engine (one thread) on core 1"
  { serve 1 --engine-threads 1
    P2=$((30000 + RANDOM % 20000))
    taskset -c 2 "$V" run -- ib_write_lat -s 2 -n 3000000 -p $P2 >/dev/null 2>&1 & SP=$!; sleep 0.5
    taskset -c 3 "$V" run -- ib_write_lat -s 2 -n 3000000 -p $P2 127.0.0.1 > "$O/lat-client.txt" 2>&1 & CP=$!
    sleep 1.5; b0=$(busy 1)
    PERF record -F 4999 -C 1 -o "$O/lat-engine.data" -- sleep 2 2>&1 | tail -2
    b1=$(busy 1); echo "core 1 busy during ib_write_lat: $b0 -> $b1"
    PERF record -F 4999 -C 3 -o "$O/lat-app.data" -- sleep 2 2>&1 | tail -2
    kill $CP $SP 2>/dev/null; wait $CP $SP 2>/dev/null
    PS=(); PC=()
    for i in $(seq 32); do p=$((40000 + i)); c=$((9 + (i % 7)))
      taskset -c $c "$V" run -- ib_write_bw -s 131072 -D 6 -p $p >/dev/null 2>&1 & PS+=($!); done
    sleep 1
    for i in $(seq 32); do p=$((40000 + i)); c=$((9 + (i % 7)))
      taskset -c $c "$V" run -- ib_write_bw -s 131072 -D 6 -p $p 127.0.0.1 > "$O/bw32-$i.txt" 2>&1 & PC+=($!); done
    sleep 4; b0=$(busy 1)
    PERF record -F 4999 -C 1 -o "$O/bw32-engine.data" -- sleep 2 2>&1 | tail -2
    b1=$(busy 1); echo "core 1 busy during 32 pairs: $b0 -> $b1"
    wait "${PC[@]}" "${PS[@]}" 2>/dev/null
    cat "$O"/bw32-*.txt | awk '$1 == "131072" {n++; s+=$4} END {print n " clients, sum of averages " s " MiB/s"}'
    unserve; } > "$O/profile.log" 2>&1; cat "$O/profile.log"
  rm -f "$O"/bw32-*.txt
  PERF report -i "$O/lat-engine.data" --sort dso --stdio 2>/dev/null | grep -E "^ +[0-9]" | head -8; fi

if on scale; then el "scale: pairs 1,16,128 x engine threads 1,2,4,8"
  timeout 150 "$V" bench --quick --sections scale --pairs 1,16,128 --engine-threads 1,2,4,8 --pin engine=1-8,apps=9-15 --json "$O/scale2.json" >"$O/scale2.txt" 2>&1
  grep -E "pairs ib_write|^scale" "$O/scale2.txt"; fi
el done
