#!/bin/bash
# one.sh BIN PROG SIZE -> figure
BIN=$1; PROG=$2; SZ=$3
SD=/tmp/one-$$; mkdir -p $SD
$BIN --state-dir $SD serve --no-persist >/dev/null 2>&1 & DP=$!
for i in $(seq 50); do $BIN --state-dir $SD ls >/dev/null 2>&1 && break; sleep 0.1; done
PORT=$((20000 + RANDOM % 20000))
case $PROG in *lat) A="-s $SZ -n 5000";; *) A="-s $SZ -D 2";; esac
$BIN --state-dir $SD run -- $PROG $A -p $PORT >$SD.s 2>&1 & SP=$!
sleep 0.4
$BIN --state-dir $SD run -- $PROG $A -p $PORT localhost >$SD.c 2>&1
wait $SP
case $PROG in *lat) awk '/^ *'$SZ' /{print $5}' $SD.c;; *) awk '/^ *'$SZ' /{print $4, $5}' $SD.c;; esac
kill $DP; wait $DP 2>/dev/null; umount $SD 2>/dev/null; rm -rf $SD $SD.s $SD.c
