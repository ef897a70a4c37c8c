"""Live: `hangdx diagnose --local` on real jobs blocked in one kind of wait (tests/waits/stuck.py).

The DDP shape most hangs take: every rank but one inside loss.backward() (the gradient all-reduce runs from
autograd hooks, so py-spy shows only backward frames), the odd rank elsewhere; and a p2p cycle with ranks backed
up behind it, whose peers the collector's --locals sample names.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

_spec = importlib.util.spec_from_file_location(
    "waits_record", Path(__file__).parents[1] / "waits" / "record.py"
)
record = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(record)

pytestmark = pytest.mark.zoo


@pytest.mark.parametrize(
    ("mode", "world", "category", "culprit"),
    [
        ("queue", 3, "user_deadlock", [1]),
        ("dataloader", 3, "dataloader_stall", [1]),
        ("poll", 3, "user_deadlock", [1]),  # time.sleep in a loop: only the process state's syscall shows it
        ("p2p_cycle", 4, "p2p_deadlock", [0, 1]),
    ],
)
def test_live_wait_names_category_and_culprit(
    mode: str, world: int, category: str, culprit: list[int]
) -> None:
    with record.stuck_job(mode, world) as (job_id, _):
        rc = record.diagnose(job_id)["root_cause"]
    assert (rc["category"], rc["culprit"]["ranks"]) == (category, culprit), rc["summary"]
