"""The hang zoo, diagnosed: each real hung gloo job must come out with the right category and culprit.

Runs `hangdx diagnose JOBID --local --json` exactly as a user would, against a real job whose fault
is known, then reads the saved bundle back with `hangdx analyze` and expects the same verdict.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytest.importorskip("torch")

from hangdx.zoo.launch import FAULTS, ZooJob  # noqa: E402

pytestmark = pytest.mark.zoo


def hangdx(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "hangdx", *args], capture_output=True, text=True, timeout=timeout
    )


@pytest.mark.parametrize("fault", list(FAULTS))
def test_zoo_fault_is_diagnosed_with_the_right_category_and_culprit(fault, tmp_path):
    spec = FAULTS[fault]
    with ZooJob(fault) as job:
        job.start()
        job.wait_until_stuck()
        bundle = tmp_path / "bundle"
        live = hangdx("diagnose", job.job_id, "--local", "--json", "--save-bundle", str(bundle))
    assert live.returncode == 0, live.stderr
    verdict = json.loads(live.stdout)
    rc = verdict["root_cause"]
    detail = f"{fault}: {rc['category']} {rc['culprit']} -- {rc['summary']}"
    assert rc["category"] == spec.category, detail
    assert rc["culprit"]["ranks"] == sorted(spec.culprit_ranks), detail
    assert verdict["status"] == ("hung" if spec.hangs else "progressing"), detail
    assert rc["culprit"]["hosts"], detail
    assert verdict["findings"][0]["evidence"], detail

    again = hangdx("analyze", str(bundle), "--json")
    assert again.returncode == 0, again.stderr
    later = json.loads(again.stdout)["root_cause"]
    assert (later["category"], later["culprit"]["ranks"]) == (rc["category"], rc["culprit"]["ranks"])
