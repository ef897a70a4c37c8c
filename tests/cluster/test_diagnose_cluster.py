"""`hangdx diagnose --inventory` over the simulated cluster: every multi-node scenario names the right culprit.

Each node is a real sshd in its own namespaces with its share of one real hung gloo job; hangdx reaches
them over SSH with verified host keys, exactly as it would reach a real cluster.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from .scenarios import SCENARIOS
from .sim import unavailable_reason

pytestmark = pytest.mark.zoo

_reason = unavailable_reason()
if _reason:
    pytest.skip(_reason, allow_module_level=True)


def diagnose(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "hangdx", "diagnose", *args], capture_output=True, text=True, timeout=240
    )


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_multi_node_scenario_names_category_culprit_rank_and_host(name, tmp_path):
    scenario = SCENARIOS[name]()
    expected = scenario.expected
    with scenario.cluster() as cluster:
        cluster.wait_until_stuck()
        r = diagnose(
            cluster.job_id,
            "--inventory",
            cluster.inventory_file,
            "--json",
            "--save-bundle",
            str(tmp_path / "b"),
        )
    assert r.returncode == 0, r.stderr
    v = json.loads(r.stdout)
    rc = v["root_cause"]
    detail = f"{name}: {rc['category']} {rc['culprit']} -- {rc['summary']}"
    assert rc["category"] == expected["category"], detail
    assert rc["culprit"]["ranks"] == expected["ranks"], detail
    assert rc["culprit"]["hosts"] == expected["hosts"], detail
    for key in ("gpus", "links"):
        for item in expected.get(key, []):
            assert item in rc["culprit"][key], detail
    for host in expected.get("unreachable", []):
        said = [
            f
            for f in v["findings"]
            if host in f["culprit"]["hosts"] and "could not be probed" in f["summary"]
        ]
        assert said, f"{name}: nothing says {host} could not be probed"
    later = subprocess.run(
        [sys.executable, "-m", "hangdx", "analyze", str(tmp_path / "b"), "--json"],
        capture_output=True,
        text=True,
    )
    again = json.loads(later.stdout)["root_cause"]
    assert (again["category"], again["culprit"]["ranks"]) == (rc["category"], rc["culprit"]["ranks"])
