"""The held-out set: realistic hung training programs, diagnosed live, category and culprit checked.

Each program (hangdx/zoo/realistic/) is a small real training script (model, optimizer, Dataset and
DataLoader with workers, DDP or a pipeline, evaluation, checkpoints, logging) with one fault seen in
the field. The expected verdict is what an experienced engineer would name, not what hangdx's rules
were written for: these tests measure whether the rules generalise, and some fail until they do.

Run one at a time on a small machine:  pytest -m zoo tests/zoo/test_realistic.py -k real_early_stopping
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import pytest

pytest.importorskip("torch")

from hangdx.playbooks import verdict  # noqa: E402
from hangdx.zoo.launch import FAULTS, REALISTIC, ZooJob  # noqa: E402
from hangdx.zoo.realistic import PREPARE  # noqa: E402


def hangdx(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "hangdx", *args], capture_output=True, text=True, timeout=timeout
    )


def test_realistic_table_is_well_formed() -> None:
    assert len(REALISTIC) >= 6 and not set(REALISTIC) & set(FAULTS)
    assert set(PREPARE) == set(REALISTIC)
    for name, spec in REALISTIC.items():
        assert spec.name == name and name.startswith("real_")
        assert spec.category in verdict.CATEGORIES
        assert spec.culprit_ranks and all(0 <= r < 4 for r in spec.culprit_ranks)
        assert importlib.util.find_spec(f"hangdx.zoo.realistic.{spec.program}") is not None, spec.program


@pytest.mark.zoo
@pytest.mark.parametrize("name", list(REALISTIC))
def test_realistic_program_is_diagnosed_with_the_right_category_and_culprit(name):
    spec = REALISTIC[name]
    with ZooJob(name) as job:
        job.wait_until_stuck(timeout=120)
        live = hangdx("diagnose", job.job_id, "--local", "--json")
    assert live.returncode == 0, live.stderr
    verdict = json.loads(live.stdout)
    rc = verdict["root_cause"]
    detail = f"{name}: expected {spec.category} {list(spec.culprit_ranks)}, got {rc['category']} {rc['culprit']['ranks']} -- {rc['summary']}"
    assert rc["category"] == spec.category, detail
    assert rc["culprit"]["ranks"] == sorted(spec.culprit_ranks), detail
    assert verdict["status"] == ("hung" if spec.hangs else "progressing"), detail
