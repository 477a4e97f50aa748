#!/bin/bash
# pinned.sh BIN PROG SIZE: the daemon (one engine thread) on core 0, both perftest processes on
# core 1, `-D 2`; prints the MB/s and Mpps columns (bandwidth tests) or the typical latency.
BIN=$1; PROG=$2; SZ=$3
SD=/tmp/pin-$$; mkdir -p $SD
taskset -c 0 $BIN --state-dir $SD serve --no-persist >/dev/null 2>&1 & DP=$!
for i in $(seq 50); do $BIN --state-dir $SD ls >/dev/null 2>&1 && break; sleep 0.1; done
PORT=$((20000 + RANDOM % 20000))
case $PROG in *lat) A="-s $SZ -n 5000";; *) A="-s $SZ -D 2";; esac
taskset -c 1 $BIN --state-dir $SD run -- $PROG $A -p $PORT >$SD.s 2>&1 & SP=$!
sleep 0.4
taskset -c 1 $BIN --state-dir $SD run -- $PROG $A -p $PORT localhost >$SD.c 2>&1
wait $SP
case $PROG in *lat) awk '/^ *'$SZ' /{print $5}' $SD.c;; *) awk '/^ *'$SZ' /{print $4, $5}' $SD.c;; esac
kill $DP; wait $DP 2>/dev/null; umount $SD 2>/dev/null; rm -rf $SD $SD.s $SD.c
