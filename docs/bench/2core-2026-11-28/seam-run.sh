#!/bin/bash
# One run of seam.sh: seam-run.sh BIN placement(cross|same|plain) size threads pinned(1|0)

BIN=$1; PL=$2; SZ=$3; TH=$4; PIN=$5
SD=/tmp/seam-$$
mkdir -p $SD
if [ $PIN = 1 ]; then D="taskset -c 0"; A="taskset -c 1"; else D=""; A=""; fi
$D $BIN --state-dir $SD serve --engine-threads $TH $NP >/dev/null 2>&1 &
DP=$!
for i in $(seq 50); do $BIN --state-dir $SD ls >/dev/null 2>&1 && break; sleep 0.1; done
$BIN --state-dir $SD create a >/dev/null
[ $PL = same ] && $BIN --state-dir $SD create x >/dev/null
$BIN --state-dir $SD create b >/dev/null
PORT=$((20000 + RANDOM % 20000))
$A $BIN --state-dir $SD run --vrnic a -- ib_write_bw -s $SZ -D 2 -p $PORT >$SD.server.log 2>&1 &
SP=$!
sleep 0.5
$A $BIN --state-dir $SD run --vrnic b -- ib_write_bw -s $SZ -D 2 -p $PORT localhost >$SD.client.log 2>&1
wait $SP
awk '/^ *'$SZ' /{print $4, $5}' $SD.client.log
kill $DP; wait $DP 2>/dev/null
rm -rf $SD $SD.server.log $SD.client.log
