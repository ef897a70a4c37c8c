"""A live rank's Flight Recorder, fetched from torch's control plane while the job hangs.

The zoo job runs under torch.distributed.elastic.control_plane.worker_main with
TORCH_WORKER_SERVER_SOCKET set, as a user opts in; the collector asks each rank's socket for
`fr_trace_json` and the verdict quotes the culprit's pending collective next to the others'.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytest.importorskip("torch")

from hangdx.probes.bundle import evidence_from_paths  # noqa: E402
from hangdx.zoo.launch import ZooJob  # noqa: E402

pytestmark = pytest.mark.zoo


def test_pending_collectives_of_every_rank_come_from_the_live_flight_recorder(tmp_path):
    with ZooJob("skip_collective", control_plane=True) as job:
        job.wait_until_stuck()
        r = subprocess.run(
            [
                sys.executable,
                "-m",
                "hangdx",
                "diagnose",
                job.job_id,
                "--local",
                "--json",
                "--save-bundle",
                str(tmp_path),
            ],
            capture_output=True,
            text=True,
            timeout=120,
        )
    assert r.returncode == 0, r.stderr
    v = json.loads(r.stdout)
    assert not [g for g in v["gaps"] if "flight recorder" in g]
    ev = evidence_from_paths([str(tmp_path)])
    pending = {}
    for c in ev.collectives:
        if c.origin == "flight_recorder" and c.state != "completed":
            pending[c.rank] = (c.seq, c.op)
    assert sorted(pending) == [0, 1, 2, 3]
    seqs = {seq for seq, _ in pending.values()}
    assert len(seqs) == 1, pending  # the same collective number on every rank ...
    assert pending[1][1] == "broadcast" and {pending[r][1] for r in (0, 2, 3)} == {
        "allreduce"
    }  # ... another op on 1
    rc = v["root_cause"]
    assert (rc["category"], rc["culprit"]["ranks"]) == ("conditional_collective", [1])
    assert "broadcast where the others issued allreduce" in rc["summary"]
    assert any("gloo:broadcast" in e["text"] for e in v["findings"][0]["evidence"])
