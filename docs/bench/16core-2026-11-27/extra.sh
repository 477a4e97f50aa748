#!/bin/bash
# Extra device measurements for issue 30: the seam (same-thread vs cross-thread pair on --engine-threads 2)
# and UCX tag_lat/tag_bw over rc_verbs against sm and tcp.
set -u
D=$(cd "$(dirname "$0")" && pwd); O=${OUT:-/tmp/out}; mkdir -p "$O"
export PATH=$PATH:/opt/deb/usr/bin:/opt/deb/usr/sbin:/opt/deb/sbin:/opt/deb/bin
export LD_LIBRARY_PATH=/opt/deb/usr/lib/x86_64-linux-gnu:/opt/deb/lib/x86_64-linux-gnu
export UCX_MODULE_DIR=/opt/deb/usr/lib/x86_64-linux-gnu/ucx
V=$D/bin/vrnic
{
S=/tmp/vx; mkdir -p $S; export VRNIC_STATE_DIR=$S; P=28000
taskset -c 1,2 "$V" serve --state-dir $S --engine-threads 2 >/tmp/serve2.log 2>&1 & DP=$!
for i in $(seq 50); do [ -S $S/vrnic.sock ] && break; sleep 0.1; done
"$V" create a; "$V" create b; "$V" create c; "$V" ls
pairx() { a=$1; b=$2; shift 2; P=$((P+1)); timeout 30 taskset -c 3 "$V" run --vrnic $a -- "$@" -p $P >/dev/null 2>&1 & local sp=$!; sleep 0.5
  timeout 30 taskset -c 4 "$V" run --vrnic $b -- "$@" -p $P 127.0.0.1 2>&1 | awk '$1 ~ /^[0-9]+$/ {r=$0} END {print r}'; wait $sp; }
for r in 1 2 3; do
  echo "same-thread ib_write_bw -s 2: $(pairx a c ib_write_bw -s 2 -D 2)"
  echo "cross-thread ib_write_bw -s 2: $(pairx a b ib_write_bw -s 2 -D 2)"
done
for r in 1 2; do
  echo "same-thread ib_write_bw -s 65536: $(pairx a c ib_write_bw -s 65536 -D 2)"
  echo "cross-thread ib_write_bw -s 65536: $(pairx a b ib_write_bw -s 65536 -D 2)"
done
kill $DP; wait $DP; umount -R $S 2>/dev/null
} 2>&1 | tee "$O/seam.txt"
{
S=/tmp/vu; mkdir -p $S; export VRNIC_STATE_DIR=$S; P=29000
taskset -c 1 "$V" serve --state-dir $S >/tmp/serve3.log 2>&1 & DP=$!
for i in $(seq 50); do [ -S $S/vrnic.sock ] && break; sleep 0.1; done
ucx() { tls=$1; pre=$2; shift 2; P=$((P+1)); timeout 40 taskset -c 3 $pre env UCX_TLS=$tls ucx_perftest -p $P >/dev/null 2>&1 & local sp=$!; sleep 1
  timeout 40 taskset -c 4 $pre env UCX_TLS=$tls ucx_perftest 127.0.0.1 -p $P "$@" 2>&1 | grep -E "Final|ERROR" | tail -2; wait $sp; }
for r in 1 2 3; do
echo "tag_lat 8 rc_verbs: $(ucx rc_verbs,ud_verbs,self "$V run --" -t tag_lat -s 8 -n 100000)"
echo "tag_lat 8 sm: $(ucx sm,self "" -t tag_lat -s 8 -n 100000)"
echo "tag_lat 8 tcp: $(ucx tcp,self "" -t tag_lat -s 8 -n 100000)"
done
echo "tag_bw 1M rc_verbs: $(ucx rc_verbs,ud_verbs,self "$V run --" -t tag_bw -s 1048576 -n 2000)"
echo "tag_bw 1M sm: $(ucx sm,self "" -t tag_bw -s 1048576 -n 2000)"
echo "tag_bw 1M tcp: $(ucx tcp,self "" -t tag_bw -s 1048576 -n 2000)"
kill $DP; wait $DP; umount -R $S 2>/dev/null
} 2>&1 | tee "$O/ucx.txt"
