"""`hangdx demo` as a new user runs it: it names the culprit, and leaves nothing behind, even on Ctrl-C."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

pytest.importorskip("torch")

pytestmark = pytest.mark.zoo


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] != "Z"


def test_demo_names_the_rank_that_skipped_a_collective():
    r = subprocess.run([sys.executable, "-m", "hangdx", "demo", "--json"], capture_output=True, timeout=180)
    assert r.returncode == 0, r.stderr.decode()[-2000:]
    v = json.loads(r.stdout)
    assert v["status"] == "hung"
    assert v["root_cause"]["category"] == "conditional_collective"
    assert v["root_cause"]["culprit"]["ranks"] == [1]
    pids = [int(p) for p in re.findall(r"=pid (\d+)", r.stderr.decode())]
    assert len(pids) == 4 and not any(alive(p) for p in pids)


def test_demo_list_names_every_fault():
    r = subprocess.run([sys.executable, "-m", "hangdx", "demo", "--list"], capture_output=True, timeout=60)
    assert r.returncode == 0
    names = [line.split()[0] for line in r.stdout.decode().splitlines()]
    assert "skip_collective" in names and "straggler" in names and len(names) >= 10


def test_ctrl_c_during_the_demo_ends_every_process_it_started():
    proc = subprocess.Popen(
        [sys.executable, "-m", "hangdx", "demo", "--fault", "straggler"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    out = b""
    deadline = time.monotonic() + 60
    while b"=pid" not in out and time.monotonic() < deadline:
        out += proc.stdout.readline()
    pids = [int(p) for p in re.findall(rb"=pid (\d+)", out)]
    assert len(pids) == 4, out
    proc.send_signal(signal.SIGINT)
    rest, _ = proc.communicate(timeout=60)
    assert b"stopped every process" in out + rest
    assert not any(alive(p) for p in pids)
