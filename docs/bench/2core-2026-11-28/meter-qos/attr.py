#!/usr/bin/env python3
"""Attribute perf samples (leaf IP) to metering code and to the QoS limiter via the inline chain
of each IP (addr2line -i on the release build's line tables). The line ranges are those of
commit 1d8a7db's crates/vrnic-proto/src/engine/ (the metering calls, `meter_request`,
`meter_ud_drop`, the meter lookups of `poll_completion`; the limit's lines of `Engine::turn`).
usage: attr.py perf.data binary"""
import subprocess, sys, re, collections
data, binary = sys.argv[1], sys.argv[2]
out = subprocess.run(["perf", "script", "-i", data, "-G", "-F", "comm,tid,ip,sym,symoff,dso",
                      "--no-demangle"], capture_output=True, text=True).stdout
# symbol addresses in the binary
nm = subprocess.run(["nm", "--defined-only", binary], capture_output=True, text=True).stdout
syms = {}
for l in nm.splitlines():
    p = l.split()
    if len(p) >= 3:
        syms.setdefault(p[2], int(p[0], 16))
samples = []  # (comm, key)
for l in out.splitlines():
    m = re.match(r"\s*(\S+)\s+(\d+)\s+([0-9a-f]+)\s+(\S+)\+0x([0-9a-f]+)\s+\((.*)\)", l)
    if not m:
        m2 = re.match(r"\s*(\S+)\s+(\d+)\s+([0-9a-f]+)\s+(.*)\((.*)\)", l)
        if m2:
            samples.append((m2.group(1), None, m2.group(5).strip()))
        continue
    comm, tid, ip, sym, off, dso = m.groups()
    if dso.endswith("/vrnic") and sym in syms:
        samples.append((comm+"/"+tid, syms[sym] + int(off, 16), dso))
    else:
        samples.append((comm+"/"+tid, None, dso))
addrs = sorted({a for _, a, _ in samples if a is not None})
chains = {}
if addrs:
    r = subprocess.run(["addr2line", "-i", "-f", "-C", "-e", binary, "-a"] + [hex(a) for a in addrs],
                       capture_output=True, text=True).stdout
    cur = None
    for l in r.splitlines():
        if l.startswith("0x"):
            cur = int(l, 16); chains[cur] = []
        else:
            chains[cur].append(l)
METER = {
    "engine/meter.rs": None,
    "engine/requester.rs": [(98, 102)],
    "engine/responder.rs": [(104, 104), (470, 498), (529, 535)],
    "engine/sched.rs": [(140, 155)],
}
QOS = {"engine/qos.rs": None, "engine/sched.rs": [(229, 240), (311, 313)]}
def is_in(chain, table):
    for l in chain:
        m = re.search(r"(engine/[a-z_]+\.rs):(\d+)", l)
        if not m: continue
        f, n = m.group(1), int(m.group(2))
        if f in table:
            rs = table[f]
            if rs is None or any(a <= n <= b for a, b in rs):
                return True
    return False
def is_meter(chain):
    for l in chain:
        m = re.search(r"(engine/[a-z_]+\.rs):(\d+)", l)
        if not m: continue
        f, n = m.group(1), int(m.group(2))
        if f in METER:
            rs = METER[f]
            if rs is None or any(a <= n <= b for a, b in rs):
                return True
    return False
by_comm = collections.Counter(); meter_by_comm = collections.Counter()
lines = collections.Counter()
for comm, a, dso in samples:
    by_comm[comm] += 1
    if a is not None and is_meter(chains.get(a, [])):
        meter_by_comm[comm] += 1
        lines[" <- ".join(re.sub(r".*/(src/.*)", r"\1", x) for x in chains[a] if "engine/" in x)[:160]] += 1
qos = sum(1 for c, a, d in samples if a is not None and is_in(chains.get(a, []), QOS))
tot = sum(by_comm.values())
print(f"qos limiter (engine/qos.rs, the limit's lines in Engine::turn): {qos} of {tot} = {100*qos/max(tot,1):.2f}%")
print(f"samples {tot}")
for c, n in by_comm.most_common():
    print(f"  thread {c}: {n} samples, metering {meter_by_comm[c]} ({100*meter_by_comm[c]/n:.2f}%)")
m = sum(meter_by_comm.values())
print(f"metering: {m} of {tot} = {100*m/max(tot,1):.2f}%")
for k, n in lines.most_common(12):
    print(f"  {n:5d} {k}")
