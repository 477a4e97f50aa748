#!/bin/bash
# One device visit for issue 30 (2026-11-28): every 16-core figure the issue asks for, in order
# of importance, each section time-boxed and its output written to $OUT as it goes (a visit cut
# short still brings back what ran). Made from ../shared/manycore/run.sh and
# docs/bench/16core-2026-11-27/extra.sh; bundle with ../shared/manycore/bundle.sh, add the UCX
# debs (apt-get download ucx-utils libucx0 libnuma1 into .dev/debs) and this file as
# .dev/run16.sh, then on the device: bash .dev/run16.sh.
set -u
D=$(cd "$(dirname "$0")" && pwd); O=${OUT:-/tmp/out}; mkdir -p "$O"
T0=$(date +%s); el() { echo "[$(( $(date +%s) - T0 )) s] $*" | tee -a "$O/progress.txt"; }
mkdir -p /opt/deb; for f in "$D"/debs/*.deb; do dpkg -x "$f" /opt/deb; done
export PATH=$PATH:/opt/deb/usr/bin:/opt/deb/usr/sbin:/opt/deb/sbin:/opt/deb/bin
export LD_LIBRARY_PATH=/opt/deb/usr/lib/x86_64-linux-gnu:/opt/deb/lib/x86_64-linux-gnu
export CPATH=/opt/deb/usr/include LIBRARY_PATH=/opt/deb/usr/lib/x86_64-linux-gnu
export UCX_MODULE_DIR=/opt/deb/usr/lib/x86_64-linux-gnu/ucx
V=$D/bin/vrnic; chmod +x "$V"
{ nproc; grep -m1 "model name" /proc/cpuinfo; uname -r; command -v cc ip taskset ucx_perftest; } 2>&1 | tee "$O/machine.txt"
SECTIONS=${SECTIONS:-"perftest seam threads scale ucx hosts"}
on() { case " $SECTIONS " in *" $1 "*) return 0;; esac; return 1; }
last() { awk '$1 ~ /^[0-9]+$/ {r=$0} END {print r}'; }
P=27000
serve() { # serve CORES OPTS...: a private daemon on $S
  local cores=$1; shift; P=$((P+1)); S=/tmp/vs$P; mkdir -p $S; export VRNIC_STATE_DIR=$S
  taskset -c $cores "$V" serve --state-dir $S "$@" >"$O/serve-$P.log" 2>&1 & DP=$!
  for i in $(seq 50); do [ -S $S/vrnic.sock ] && break; sleep 0.1; done; }
unserve() { kill $DP; wait $DP; umount -R $S 2>/dev/null; }
pair() { # pair SCORE CCORE SVNIC CVNIC PROG ARGS...: the client's last figures line
  local sc=$1 cc=$2 sv=$3 cv=$4; shift 4; local P=$((30000 + RANDOM % 20000))
  local so=(); [ -n "$sv" ] && so=(--vrnic "$sv"); local co=(); [ -n "$cv" ] && co=(--vrnic "$cv")
  timeout 30 taskset -c $sc "$V" run "${so[@]}" -- "$@" -p $P >/dev/null 2>&1 & local sp=$!; sleep 0.5
  timeout 30 taskset -c $cc "$V" run "${co[@]}" -- "$@" -p $P 127.0.0.1 2>&1 | last; wait $sp; }

if on perftest; then el "perftest: vrnic bench --quick --runs 3, engine on 1, apps on 2,3"
  timeout 170 "$V" bench --quick --runs 3 --sections perftest --pin engine=1,apps=2,3 --json "$O/perftest.json" >"$O/perftest.txt" 2>&1
  grep -vE "^vrnic bench:" "$O/perftest.txt" | grep -vE "memmove|engine copy"; fi

if on seam; then el "seam: --engine-threads 2 on cores 1,2; apps on 3 and 4"
  { serve 1,2 --engine-threads 2; "$V" create a; "$V" create b; "$V" create c; "$V" ls
    for r in 1 2 3; do
      echo "same-thread ib_write_bw -s 2: $(pair 3 4 a c ib_write_bw -s 2 -D 2)"
      echo "cross-thread ib_write_bw -s 2: $(pair 3 4 a b ib_write_bw -s 2 -D 2)"
    done
    for r in 1 2; do
      echo "same-thread ib_write_bw -s 65536: $(pair 3 4 a c ib_write_bw -s 65536 -D 2)"
      echo "cross-thread ib_write_bw -s 65536: $(pair 3 4 a b ib_write_bw -s 65536 -D 2)"
    done
    unserve; } 2>&1 | tee "$O/seam.txt"; fi

if on threads; then el "threads: --engine-threads 1 pinned, default unpinned, --engine-threads 4 unpinned"
  for mode in "1|--engine-threads 1" "0-15|" "0-15|--engine-threads 4"; do cores=${mode%%|*}; opt=${mode#*|}
    serve $cores $opt; echo "== daemon on cores $cores, options '$opt'"
    for r in 1 2 3; do echo "ib_write_lat -s 2: $(pair 2 3 '' '' ib_write_lat -s 2 -n 20000)"; done
    for r in 1 2 3; do echo "ib_write_bw -s 2: $(pair 2 3 '' '' ib_write_bw -s 2 -D 2)"; done
    for r in 1 2; do echo "ib_write_bw -s 65536: $(pair 2 3 '' '' ib_write_bw -s 65536 -D 2)"; done
    unserve
  done 2>&1 | tee "$O/threads.txt"; fi

if on scale; then el "scale: pairs 1,16,128 x engine threads 1,2,4,8"
  timeout 200 "$V" bench --quick --sections scale --pairs 1,16,128 --engine-threads 1,2,4,8 --pin engine=1-8,apps=9-15 --json "$O/scale.json" >"$O/scale.txt" 2>&1
  grep -E "pairs ib_write|^scale" "$O/scale.txt"; fi

if on ucx; then el "ucx: tag_lat 8 B and tag_bw 1 MiB, rc_verbs on vrnic (one engine thread on core 1) against sm and tcp"
  { serve 1
    ucx() { tls=$1; pre=$2; shift 2; local P=$((30000 + RANDOM % 20000)); timeout 30 taskset -c 3 $pre env UCX_TLS=$tls ucx_perftest -p $P >/dev/null 2>&1 & local sp=$!; sleep 1
      timeout 30 taskset -c 4 $pre env UCX_TLS=$tls ucx_perftest 127.0.0.1 -p $P "$@" 2>&1 | grep -E "Final|ERROR|rror" | tail -2; wait $sp; }
    for r in 1 2 3; do
      echo "tag_lat 8 rc_verbs: $(ucx rc_verbs,ud_verbs,self "$V run --" -t tag_lat -s 8 -n 100000)"
      echo "tag_lat 8 sm: $(ucx sm,self "" -t tag_lat -s 8 -n 100000)"
      echo "tag_lat 8 tcp: $(ucx tcp,self "" -t tag_lat -s 8 -n 100000)"
    done
    echo "tag_bw 1M rc_verbs: $(ucx rc_verbs,ud_verbs,self "$V run --" -t tag_bw -s 1048576 -n 2000)"
    echo "tag_bw 1M sm: $(ucx sm,self "" -t tag_bw -s 1048576 -n 2000)"
    echo "tag_bw 1M tcp: $(ucx tcp,self "" -t tag_bw -s 1048576 -n 2000)"
    unserve; } 2>&1 | tee "$O/ucx.txt"; fi

if on hosts; then el "hosts, fairness"
  timeout 150 "$V" bench --quick --sections hosts,fairness --pin engine=1,2,apps=3,4 --json "$O/hosts.json" >"$O/hosts.txt" 2>&1
  grep -E "veth|ib_write|ib_send|round trip|fairness" "$O/hosts.txt"; fi
el done
