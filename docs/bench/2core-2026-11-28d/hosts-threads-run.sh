#!/bin/bash
# One run of hosts-threads.sh: hosts-threads-run.sh BIN THREADS PROG SIZE
# Two network namespaces joined by a veth (10.78.9.1, 10.78.9.2), a daemon in each with
# --engine-threads THREADS, PROG's server on host a and its client on host b; prints the
# client's result row (bandwidth MB/s and Mpps, or typical latency us). Root; removes
# everything it made.
BIN=$1; TH=$2; PROG=$3; SZ=$4
T=vrht$$
SD=/tmp/$T
mkdir -p $SD/a $SD/b
ip netns add ${T}a; ip netns add ${T}b
ip -n ${T}a link add eth0 type veth peer name eth0 netns ${T}b
ip -n ${T}a addr add 10.78.9.1/24 dev eth0; ip -n ${T}a link set eth0 up; ip -n ${T}a link set lo up
ip -n ${T}b addr add 10.78.9.2/24 dev eth0; ip -n ${T}b link set eth0 up; ip -n ${T}b link set lo up
on() { local h=$1; shift; exec nsenter --net=/run/netns/$T$h "$@"; }
(on a $BIN --state-dir $SD/a serve --no-persist --engine-threads $TH --insecure-links \
    --listen 10.78.9.1:7700 --peer 10.78.9.2:7700 >$SD/da.log 2>&1) &
DA=$!
(on b $BIN --state-dir $SD/b serve --no-persist --engine-threads $TH --insecure-links \
    --listen 10.78.9.2:7700 --peer 10.78.9.1:7700 >$SD/db.log 2>&1) &
DB=$!
for i in $(seq 200); do
    (on b $BIN --state-dir $SD/b peers 2>/dev/null) | awk 'NR>1 && $2=="up"{f=1} END{exit !f}' && break
    sleep 0.1
done
if [ "$PROG" = ib_write_lat ]; then ARGS="-s $SZ -n 5000"; else ARGS="-s $SZ -D 2"; fi
(on a $BIN --state-dir $SD/a run -- $PROG $ARGS -p 18515 >$SD/server.log 2>&1) &
SP=$!
sleep 0.5
(on b $BIN --state-dir $SD/b run -- $PROG $ARGS -p 18515 10.78.9.1 >$SD/client.log 2>&1)
wait $SP
if [ "$PROG" = ib_write_lat ]; then
    awk '/^ *'$SZ' /{print $5}' $SD/client.log
else
    awk '/^ *'$SZ' /{print $4, $5}' $SD/client.log
fi
kill $DA $DB; wait $DA $DB 2>/dev/null
ip netns del ${T}a; ip netns del ${T}b
umount $SD/a $SD/b 2>/dev/null; rm -rf $SD
