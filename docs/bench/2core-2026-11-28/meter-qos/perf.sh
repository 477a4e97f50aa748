#!/usr/bin/env bash
# Share of the daemon's cycles in metering code while ib_write_bw -s 2 runs (one daemon, one
# engine thread; apps through vrnic run). perf record -g on the daemon for 5 s mid-run.
set -u
V=${V:-$(realpath "$(dirname "$0")/../../../../target/release/vrnic")}
tag=${1:-1}
S=${TMPDIR:-/tmp}/vrnic-meter-qos/perfstate$tag; rm -rf $S; mkdir -p $S
$V --state-dir $S serve > ${TMPDIR:-/tmp}/vrnic-meter-qos/daemon$tag.log 2>&1 &
D=$!
for i in $(seq 100); do [ -S $S/vrnic.sock ] && break; sleep 0.1; done
P=$((20000 + RANDOM % 10000))
ON_S=""; ON_C=""
if [ -n "${CAP:-}" ]; then
  $V --state-dir $S create cs --max-bw 1T --max-rate 1T >/dev/null
  $V --state-dir $S create cc --max-bw 1T --max-rate 1T >/dev/null
  ON_S="--vrnic cs"; ON_C="--vrnic cc"
fi
$V --state-dir $S run $ON_S -- ib_write_bw -s 2 -D 12 -p $P > ${TMPDIR:-/tmp}/vrnic-meter-qos/srv$tag.log 2>&1 &
SV=$!
sleep 1
$V --state-dir $S run $ON_C -- ib_write_bw -s 2 -D 12 -p $P localhost > ${TMPDIR:-/tmp}/vrnic-meter-qos/cli$tag.log 2>&1 &
CL=$!
sleep 4
perf record -F 2999 -g -p $D -o ${TMPDIR:-/tmp}/vrnic-meter-qos/perf$tag.data -- sleep 5 2>${TMPDIR:-/tmp}/vrnic-meter-qos/perfrec$tag.log
wait $CL; wait $SV
kill $D; wait $D
grep -A2 "BW average" ${TMPDIR:-/tmp}/vrnic-meter-qos/cli$tag.log | tail -1
