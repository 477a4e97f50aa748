#!/bin/bash
# QoS on the many-core host: an uncapped pair alone, then beside two capped pairs, each app on
# a core of its own, the daemon (one engine thread) on core 1. After `RUN_SECTIONS=none bash .dev/run.sh`.
set -u
D=$(cd "$(dirname "$0")" && pwd); O=${OUT:-/tmp/out}; mkdir -p "$O"
export PATH=$PATH:/opt/deb/usr/bin:/opt/deb/usr/sbin:/opt/deb/sbin:/opt/deb/bin
export LD_LIBRARY_PATH=/opt/deb/usr/lib/x86_64-linux-gnu:/opt/deb/lib/x86_64-linux-gnu
V=$D/bin/vrnic; S=/tmp/vq; mkdir -p $S
taskset -c 1 "$V" serve --state-dir $S >/tmp/q.log 2>&1 & DP=$!
for i in $(seq 50); do [ -S $S/vrnic.sock ] && break; sleep 0.1; done
export VRNIC_STATE_DIR=$S
for n in s0 c0 s1 c1 s2 c2 s3 c3 s4 c4; do "$V" create $n >/dev/null; done
"$V" policy c1 --max-bw 1G; "$V" policy c2 --max-bw 100M; "$V" policy c3 --max-rate 500K; "$V" policy c4 --max-rate 50K
P=31000
# pair SRV CLI SCORE CCORE DUR SIZE PORT: the client's "BW average MiB/s MsgRate Mpps"
pair() { local P=$7; timeout 30 taskset -c $3 "$V" run --vrnic $1 -- ib_write_bw -s $6 -D $5 -p $P >/dev/null 2>&1 & local sp=$!; sleep 0.5
  timeout 30 taskset -c $4 "$V" run --vrnic $2 -- ib_write_bw -s $6 -D $5 -p $P 127.0.0.1 2>&1 | awk '$1 ~ /^[0-9]+$/ {r=$4" MiB/s "$5" Mpps"} END {print r}'; wait $sp; }
{
for size in 65536 2; do
  if [ $size = 65536 ]; then a=c1; b=c2; sa=s1; sb=s2; else a=c3; b=c4; sa=s3; sb=s4; fi
  for r in 1 2 3; do
    P=$((P+10)); echo "size $size uncapped alone: $(pair s0 c0 2 3 3 $size $P)"
    pair $sa $a 4 5 5 $size $((P+1)) > /tmp/qa & QA=$!
    pair $sb $b 6 7 5 $size $((P+2)) > /tmp/qb & QB=$!
    sleep 1
    echo "size $size uncapped beside: $(pair s0 c0 2 3 3 $size $((P+3)))"
    wait $QA $QB
    echo "size $size capped $a: $(cat /tmp/qa)   capped $b: $(cat /tmp/qb)"
  done
done
"$V" ls; "$V" stats c2 | tail -1
} 2>&1 | tee "$O/qos.txt"
kill $DP; wait $DP
