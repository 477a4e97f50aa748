#!/usr/bin/env bash
# Idle limiter, finer A/B on one daemon: ib_write_bw -s 2 -D 2 between two uncapped vRNICs (A)
# and between two made with --max-bw 1T --max-rate 1T (B), alternated, ROUNDS each.
set -u
V=${V:-$(realpath "$(dirname "$0")/../../../../target/release/vrnic")}
R=${R:-8}
S=${TMPDIR:-/tmp}/vrnic-meter-qos/finestate; rm -rf $S; mkdir -p $S
$V --state-dir $S serve > ${TMPDIR:-/tmp}/vrnic-meter-qos/finedaemon.log 2>&1 &
D=$!
for i in $(seq 100); do [ -S $S/vrnic.sock ] && break; sleep 0.1; done
$V --state-dir $S create a_s >/dev/null; $V --state-dir $S create a_c >/dev/null
$V --state-dir $S create b_s --max-bw 1T --max-rate 1T >/dev/null
$V --state-dir $S create b_c --max-bw 1T --max-rate 1T >/dev/null
one() { # $1: a or b
  local P=$((20000 + RANDOM % 10000))
  $V --state-dir $S run --vrnic ${1}_s -- ib_write_bw -s 2 -D 2 -p $P > ${TMPDIR:-/tmp}/vrnic-meter-qos/fsrv.log 2>&1 &
  local SV=$!
  sleep 0.5
  for t in 1 2 3 4 5; do
    $V --state-dir $S run --vrnic ${1}_c -- ib_write_bw -s 2 -D 2 -p $P localhost > ${TMPDIR:-/tmp}/vrnic-meter-qos/fcli.log 2>&1 && break
    sleep 0.3
  done
  wait $SV
  awk '$1=="2"{print $5}' ${TMPDIR:-/tmp}/vrnic-meter-qos/fcli.log | tail -1
}
for r in $(seq 1 $R); do
  if [ $((r % 2)) -eq 1 ]; then o="a b"; else o="b a"; fi
  for x in $o; do echo "$(date +%T) $x$r $(one $x) load $(cut -d' ' -f1 /proc/loadavg)"; done
done
$V --state-dir $S ls
$V --state-dir $S stats b_c --json | python3 -c "import json,sys; j=json.load(sys.stdin); print('b_c qos_waits', j[0]['qos_waits'])"
kill $D; wait $D
