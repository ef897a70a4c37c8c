"""Issue 10.7: a Flight Recorder pickle is bounded in memory and time while it is unpickled, not after.

The attack: a small pickle of many nested containers (an 8 MB one unpacked to 416 MB, a 60 MB one to 3.1 GB in
20 s). Big pickles are unpickled in a child process whose memory and CPU time are capped by the pickle's size;
hangdx's own process stays small, and the answer is a one-line refusal."""

from __future__ import annotations

import json
import pickle
import subprocess
import sys
import time

import pytest

from hangdx.probes import flight_recorder as fr

PROBE = """
import json, resource, sys, time
from hangdx.probes import flight_recorder as fr
data = sys.stdin.buffer.read()
t = time.monotonic()
obj, why = fr.load(data)
# VmHWM, not ru_maxrss: Linux keeps ru_maxrss across execve, so it would count the test runner that forked us.
hwm = next(int(x.split()[1]) for x in open("/proc/self/status") if x.startswith("VmHWM:"))
print(json.dumps({"why": why, "ok": obj is not None, "secs": time.monotonic() - t,
                  "self_mb": hwm >> 10,
                  "child_mb": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss >> 10}))
"""


def _load_in_a_fresh_process(data: bytes) -> dict:
    r = subprocess.run([sys.executable, "-c", PROBE], input=data, capture_output=True, timeout=120)
    assert r.returncode == 0, r.stderr.decode()[-500:]
    return json.loads(r.stdout)


@pytest.mark.parametrize("mb", [8, 60])
def test_a_pickle_of_nested_lists_is_refused_in_bounded_memory_and_time(mb):
    n = mb * 1_000_000 // 2
    data = b"\x80\x02]" + b"]a" * n + b"."  # one list holding n new empty lists: ~64 bytes each per 2 bytes
    got = _load_in_a_fresh_process(data)
    assert not got["ok"] and got["why"].startswith("refused pickle: its "), got
    # hangdx itself: the pickle's bytes (read, passed on) and no more (it was 416 MB for 8 MB, 3.1 GB for 60).
    assert got["self_mb"] < 3 * mb + 160, got
    assert got["child_mb"] < min(16 * mb + 64, 768) + 120, got  # the child: its cap (plus Python itself)
    assert got["secs"] < 60, got


def test_a_real_sized_dump_still_loads():
    entries = [
        {"profiling_name": "nccl:all_reduce", "collective_seq_id": i, "state": "completed",
         "frames": [{"name": f"fn{j}", "filename": f"/w/train{j}.py", "line": j} for j in range(20)]}
        for i in range(3000)
    ]  # fmt: skip
    data = pickle.dumps({"version": "2.4", "pg_config": {}, "entries": entries}, protocol=2)
    assert len(data) > fr.IN_PROCESS  # taken by the child
    t = time.monotonic()
    obj, why = fr.load(data)
    assert why is None and len(obj["entries"]) == 3000 and obj["entries"][5]["collective_seq_id"] == 5
    assert time.monotonic() - t < 10


def test_a_json_dump_of_millions_of_entries_keeps_only_the_newest_in_bounded_memory():
    # Hardening 21.3: `{"version":"2.4",...,"entries":[{},{},...]}` of 8 MiB took 1.5 GB and 30-60 s; a job's own
    # user can plant it as TORCH_FR_DUMP_TEMP_FILE.
    n = 8 * 1024 * 1024 // 3
    data = b'{"version":"2.4","pg_config":{},"pg_status":{},"entries":[' + b",".join([b"{}"] * n) + b"]}"
    got = _load_in_a_fresh_process(data)
    assert got["ok"] and got["why"] is None, got
    assert got["self_mb"] < 3 * 8 + 160 and got["child_mb"] < 16 * 8 + 64 + 120, got
    obj, why = fr.load(data)
    assert why is None and len(obj["entries"]) == fr.MAX_ENTRIES and obj[fr.LEFT_OUT] == n - fr.MAX_ENTRIES


def test_the_newest_entries_of_a_long_json_dump_are_the_ones_read():
    from hangdx.probes.model import Evidence, Source

    entries = [{"profiling_name": "gloo:all_reduce", "collective_seq_id": i, "state": "completed"}
               for i in range(fr.MAX_ENTRIES + 500)]  # fmt: skip
    entries[-1]["state"] = "scheduled"
    data = json.dumps(
        {"version": "2.4", "rank": 3, "pg_config": {}, "pg_status": {}, "entries": entries}
    ).encode()
    ev = Evidence()
    fr.parse(data, Source("dump.json"), ev)
    seqs = [c.seq for c in ev.collectives]
    assert len(seqs) == fr.MAX_ENTRIES and seqs[0] == 500 and seqs[-1] == fr.MAX_ENTRIES + 499
    assert any("500 older Flight Recorder entries left out" in g.message for g in ev.gaps)
    assert ev.collectives[-1].state == "scheduled" and ev.collectives[-1].rank == 3


def test_malformed_json_dumps_are_still_refused_as_json_loads_would():
    for bad in (b'{"entries":[{},]}', b'{"a":1,}', b'{"entries":[1,2', b'{"entries":[]} x', b'{"a" 1}'):
        obj, why = fr.load(bad)
        assert obj is None and why.startswith("JSON that does not parse"), (bad, why)
