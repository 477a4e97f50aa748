#!/bin/bash
# The visit's fourth run (2026-11-28): siblings let go after each turn (not at the end of the
# pass) and threads spin before sleeping on a shard lock, against the build of runs 2 and 3
# (.dev/old), alternated: same- and cross-thread ib_write_lat / ib_write_bw -s 2 on
# --engine-threads 2 (cores 1-3), then the scale rows at 16 pairs for each build.
set -u
D=$(cd "$(dirname "$0")" && pwd); O=${OUT:-/tmp/out}; mkdir -p "$O"
T0=$(date +%s); el() { echo "[$(( $(date +%s) - T0 )) s] $*" | tee -a "$O/progress.txt"; }
mkdir -p /opt/deb; for f in "$D"/debs/*.deb; do dpkg -x "$f" /opt/deb; done
export PATH=$PATH:/opt/deb/usr/bin:/opt/deb/usr/sbin:/opt/deb/sbin:/opt/deb/bin
export LD_LIBRARY_PATH=/opt/deb/usr/lib/x86_64-linux-gnu:/opt/deb/lib/x86_64-linux-gnu
export CPATH=/opt/deb/usr/include LIBRARY_PATH=/opt/deb/usr/lib/x86_64-linux-gnu
build() { if [ "$1" = old ]; then V=$D/old/vrnic; else V=$D/bin/vrnic; fi; chmod +x "$V"; }
last() { awk '$1 ~ /^[0-9]+$/ {r=$0} END {print r}'; }
P=27300
serve() { local cores=$1; shift; P=$((P+1)); S=/tmp/vs$P; mkdir -p $S; export VRNIC_STATE_DIR=$S
  taskset -c $cores "$V" serve --state-dir $S "$@" >"$O/serve.log" 2>&1 & DP=$!
  for i in $(seq 50); do [ -S $S/vrnic.sock ] && break; sleep 0.1; done
  "$V" create a >/dev/null; "$V" create b >/dev/null; "$V" create c >/dev/null; }
unserve() { kill $DP; wait $DP; umount -R $S 2>/dev/null; }
pair() { local sv=$1 cv=$2; shift 2; local P=$((30000 + RANDOM % 20000))
  timeout 30 taskset -c 4 "$V" run --vrnic $sv -- "$@" -p $P >/dev/null 2>&1 & local sp=$!; sleep 0.5
  timeout 30 taskset -c 5 "$V" run --vrnic $cv -- "$@" -p $P 127.0.0.1 2>&1 | last; wait $sp; }
el "seam, --engine-threads 2 on cores 1-3, old and new alternated"
{ for r in 1 2 3; do for b in old new; do build $b; serve 1-3 --engine-threads 2
    echo "$r $b same ib_write_lat -s 2: $(pair a c ib_write_lat -s 2 -n 20000)"
    echo "$r $b cross ib_write_lat -s 2: $(pair a b ib_write_lat -s 2 -n 20000)"
    echo "$r $b same ib_write_bw -s 2: $(pair a c ib_write_bw -s 2 -D 2)"
    echo "$r $b cross ib_write_bw -s 2: $(pair a b ib_write_bw -s 2 -D 2)"
    unserve; done; done; } > "$O/seam4.log" 2>&1; cat "$O/seam4.log"
for b in old new; do build $b; el "scale 16 pairs, $b"
  timeout 60 "$V" bench --quick --sections scale --pairs 16 --engine-threads 1,2,4,8 --pin engine=1-8,apps=9-15 >"$O/scale-$b.txt" 2>&1
  grep -E "pairs ib_write|^scale" "$O/scale-$b.txt"; done
el done
