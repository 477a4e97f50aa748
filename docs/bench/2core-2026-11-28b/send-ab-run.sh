#!/bin/bash
# One run of an A/B of two builds: send-ab-run.sh BIN PROG SIZE -> "MB/s Mpps" (a fresh daemon,
# `vrnic run -- PROG -s SIZE -D 2` server and client on localhost). As root; alternate the builds:
#   for r in 1 2 3 4 5; do for b in OLD NEW; do echo "$r $b $(bash send-ab-run.sh $b/vrnic ib_send_bw 2)"; done; done
BIN=$1; PROG=$2; SZ=$3
SD=/tmp/sab-$$; mkdir -p $SD
$BIN --state-dir $SD serve --no-persist >/dev/null 2>&1 &
DP=$!
for i in $(seq 50); do $BIN --state-dir $SD ls >/dev/null 2>&1 && break; sleep 0.1; done
PORT=$((20000 + RANDOM % 20000))
$BIN --state-dir $SD run -- $PROG -s $SZ -D 2 -p $PORT >$SD.s.log 2>&1 &
SP=$!
sleep 0.5
$BIN --state-dir $SD run -- $PROG -s $SZ -D 2 -p $PORT localhost >$SD.c.log 2>&1
wait $SP
awk '/^ *'$SZ' /{print $4, $5}' $SD.c.log
kill $DP; wait $DP 2>/dev/null
umount $SD 2>/dev/null; rm -rf $SD $SD.s.log $SD.c.log
