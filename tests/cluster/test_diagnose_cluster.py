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


def test_hosts_flag_reaches_nodes_and_unknown_host_keys_are_refused(tmp_path):
    from .sim import Cluster

    with Cluster(2, 2, fault="uneven_data") as cluster:
        cluster.wait_until_stuck()
        hosts = ",".join(f"root@{cluster.addresses[h]}:{cluster.port}" for h in cluster.hosts)
        common = ["--hosts", hosts, "--ssh-key", cluster.key_file, "--json"]
        good = diagnose(cluster.job_id, *common, "--known-hosts", cluster.known_hosts)
        empty = tmp_path / "known_hosts"
        empty.write_text("")
        refused = diagnose(cluster.job_id, *common, "--known-hosts", str(empty))
        missing = diagnose(cluster.job_id, *common, "--known-hosts", str(tmp_path / "nope"))
    assert good.returncode == 0, good.stderr
    rc = json.loads(good.stdout)["root_cause"]
    assert (rc["category"], rc["culprit"]["ranks"]) == ("conditional_collective", [3]), rc["summary"]
    assert rc["culprit"]["hosts"] == [cluster.addresses[cluster.hosts[1]]]

    assert refused.returncode == 0, refused.stderr
    v = json.loads(refused.stdout)
    assert v["root_cause"]["category"] == "unknown"
    assert sorted(v["root_cause"]["culprit"]["hosts"]) == sorted(cluster.addresses.values())
    assert "ssh-keyscan" in v["root_cause"]["summary"] + v["root_cause"]["fix"]
    assert not any(f["category"] == "rank_crashed" for f in v["findings"]), (
        "unseen ranks are not crashed ranks"
    )

    assert missing.returncode == 2 and missing.stderr.count("\n") == 1 and "known_hosts" in missing.stderr
