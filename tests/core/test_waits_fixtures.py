"""Real py-spy dumps of ranks blocked in each kind of wait (tests/fixtures/pyspy/waits, recorded by
tests/waits/record.py): `hangdx analyze` names the category and the culprit rank.

In each job the other ranks sit in loss.backward() under DDP (the gradient all-reduce runs from autograd hooks),
so the crowd waits in a collective and the odd rank's own wait names the cause.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

WAITS = Path(__file__).resolve().parents[1] / "fixtures" / "pyspy" / "waits"

CASES = [
    ("queue", "user_deadlock", [1]),  # a queue whose producer thread died
    ("queue_native", "user_deadlock", [1]),  # the same, read with --native (c10d::Reducer under backward)
    ("dataloader", "dataloader_stall", [1]),  # a DataLoader whose worker is stuck in __getitem__
    ("storage", "io_stall", [1]),  # torch.load of a file that never opens
    ("child", "user_deadlock", [1]),  # subprocess.run of a child that never exits
    ("barrier", "conditional_collective", [1]),  # a barrier only rank 1 calls
    ("eval_process", "user_deadlock", [1]),  # a multiprocessing queue fed by a side process that died
    ("compute", "straggler", [1]),  # an endless step in the program's own code (active in the sample)
    ("lock_native", "user_deadlock", [1]),  # a lock a dead thread held: --native shows PyThread_acquire_lock
    ("p2p_cycle_locals", "p2p_deadlock", [0, 1]),  # 0 and 1 recv from each other; 2 and 3 are backed up
    ("fsdp_queue", "user_deadlock", [1]),  # the queue job under FSDP2: the others wait in its all-gather
    ("pipeline", "user_deadlock", [0]),  # stage 0 on a dead loader's queue; stages 1-3 backed up in recv
    ("pipeline_locals", "user_deadlock", [0]),  # the same with --locals: a chain, not a cycle
]


def analyze(folder: Path) -> dict:
    out = subprocess.run(
        [sys.executable, "-m", "hangdx", "analyze", str(folder), "--json"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


@pytest.mark.parametrize(("folder", "category", "culprit"), CASES, ids=[c[0] for c in CASES])
def test_real_dump_names_category_and_culprit(folder: str, category: str, culprit: list[int]) -> None:
    verdict = analyze(WAITS / folder)
    rc = verdict["root_cause"]
    assert (rc["category"], rc["culprit"]["ranks"]) == (category, culprit), rc["summary"]


def test_the_crowd_in_backward_is_named_as_such() -> None:
    rc = analyze(WAITS / "queue")["root_cause"]
    assert "loss.backward()" in rc["summary"] and "Queue.get" in rc["summary"]


def test_a_c_level_lock_without_native_frames_still_names_the_rank() -> None:
    """threading.Lock.acquire is C: plain py-spy shows only the program's line, idle. The rank is still the odd
    one; what it waits on takes --native (lock_native) or the process state (a live diagnosis)."""
    rc = analyze(WAITS / "lock")["root_cause"]
    assert rc["culprit"]["ranks"] == [1] and "idle in its own code at next_batch" in rc["summary"]
