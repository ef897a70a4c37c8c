"""Issue 22 item 6: with HANGDX_RESOLVER=local the job's hosts are this machine, whatever node an alert names
(CONTRACTS: "the job's hosts still come from HANGDX_RESOLVER"). Real sleeping ranks, the real collector."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import uuid

import pytest

from hangdx.bot.diagnosis import DiagnoseOptions, DiagnosisError, collect, diagnose, is_this_machine


@pytest.mark.parametrize(
    "name",
    ["localhost", "LOCALHOST", "127.0.0.1", "127.0.0.5", "::1", socket.gethostname(), socket.getfqdn()],
)
def test_names_of_this_machine_are_this_machine(name):
    assert is_this_machine(name)


@pytest.mark.parametrize("name", ["gpu-node-03", "10.1.2.3", "fe80::1", "localhost.example.com"])
def test_other_names_are_not(name):
    assert not is_this_machine(name)


@pytest.fixture
def ranks():
    job = f"local-{uuid.uuid4().hex[:6]}"
    procs = []
    for rank in (0, 1):
        env = {
            **os.environ,
            "HANGDX_JOB_ID": job,
            "RANK": str(rank),
            "WORLD_SIZE": "3",
            "LOCAL_RANK": str(rank),
        }
        code = "import time\ndef train_step():\n    time.sleep(600)\ntrain_step()\n"
        procs.append(subprocess.Popen([sys.executable, "-c", code], env=env))
    yield job
    for p in procs:
        p.kill()
        p.wait(timeout=10)


def test_an_alert_naming_another_node_still_probes_this_machine_when_the_job_runs_here(ranks):
    opts = DiagnoseOptions(how="local", samples=1, interval=0.0, hint_hosts=["gpu-node-03"])
    verdict, docs = diagnose(ranks, opts)
    assert [d["host"] for d in docs] == [socket.gethostname()]
    rc = verdict.root_cause
    assert rc is not None and rc.category == "rank_crashed" and rc.culprit.ranks == [2], rc
    assert verdict.notes[0] == "alert fired on gpu-node-03"


def test_a_job_with_no_process_here_is_probed_on_the_alerts_other_nodes_over_ssh(tmp_path, monkeypatch):
    # No known_hosts: the SSH path says so in one line (nothing is ever added); the local probe came first.
    monkeypatch.setenv("HOME", str(tmp_path))
    opts = DiagnoseOptions(how="local", samples=1, interval=0.0, hint_hosts=["gpu-node-03"])
    notes: list[str] = []
    with pytest.raises(DiagnosisError, match="no known_hosts file"):
        collect(f"gone-{uuid.uuid4().hex[:6]}", opts, notes=notes)
    assert notes and "no process of job" in notes[0] and "probed only the nodes the alert named" in notes[0]
