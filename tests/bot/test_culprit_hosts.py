"""Hardening, high rows: a name a log or an alert printed is never a culprit host to act on unless it is a host of
the job (the resolver lists it, or a probe found the job's processes there), and never a Slurm keyword."""

from __future__ import annotations

import json

from hangdx.bot.diagnosis import judge
from hangdx.bot.slack.blocks import verdict_blocks
from hangdx.probes.ssh import problem_doc

# A rank's output that holds an interactive shell prompt (someone ran nvidia-smi in the job's terminal) and
# nvidia-smi's real error line: the prompt names a "host".
PROMPT_LOG = (
    "oncall@{host} ~ % nvidia-smi\nUnable to determine the device handle for GPU0000:03:00.0: Unknown Error\n"
)


def _node_doc(host: str, log: str) -> dict:
    state = {"hangdx": "procstate", "host": host, "job_id": "4242", "world_size": 1,
             "samples": [{"pid": 11, "rank": 0, "state": "S", "job_id": "4242", "command": "python train.py"}]}  # fmt: skip
    return {
        "hangdx_collector": 1,
        "host": host,
        "artifacts": [
            {
                "name": "processes.json",
                "kind": "procstate",
                "rank": None,
                "pid": None,
                "data": json.dumps(state),
            },
            {"name": "rank0.log", "kind": "log", "rank": 0, "pid": 11, "data": log},
        ],
    }


def _drain_buttons(verdict: dict, job: str) -> list[str]:
    return [
        e["text"]["text"]
        for b in verdict_blocks(verdict, job, slurm=True)
        if b.get("type") == "actions"
        for e in b["elements"]
        if e.get("action_id") == "hangdx_drain"
    ]


def test_an_alert_host_that_does_not_resolve_is_never_a_culprit_nor_drained():
    # Alertmanager: {hpc_job: "987654", Hostname: "all"} for a job the resolver does not know; the probe of
    # "all" fails DNS. Before: "unknown, culprit host all" with a Drain all button.
    notes: list[str] = []
    doc = problem_doc("all", "dns", "all: cannot resolve 'all' (Name or service not known)")
    v = judge([doc], "987654", set(), notes).to_dict()
    assert v["root_cause"]["culprit"]["hosts"] == []
    assert all(f["culprit"]["hosts"] == [] for f in v["findings"])
    assert any(n.startswith("all: ") and "not a verified host of this job" in n for n in notes)
    assert _drain_buttons(v, "987654") == []


def test_a_host_only_a_log_names_is_not_a_culprit_of_a_live_diagnosis():
    # A printed prompt naming a node the job never ran on: the GPU error stays, the host is not acted on.
    for printed in ("all", "gpu-node-victim"):
        notes: list[str] = []
        v = judge([_node_doc("node-a", PROMPT_LOG.format(host=printed))], "4242", {"node-a"}, notes).to_dict()
        assert v["root_cause"]["category"] == "gpu_fault", v["root_cause"]
        assert printed not in v["root_cause"]["culprit"]["hosts"]
        assert any(printed in n and "not a verified host" in n for n in notes), notes
        assert not any(printed in label for label in _drain_buttons(v, "4242"))


def test_a_job_host_printed_by_its_full_name_is_named_as_the_scheduler_names_it():
    notes: list[str] = []
    log = PROMPT_LOG.format(host="node-a.cluster.example")
    v = judge([_node_doc("node-a", log)], "4242", {"node-a", "node-b"}, notes).to_dict()
    assert v["root_cause"]["category"] == "gpu_fault"
    assert v["root_cause"]["culprit"]["hosts"] == ["node-a"]
    assert _drain_buttons(v, "4242") == ["Drain node-a"]
    assert notes == []


def test_no_drain_button_for_a_slurm_keyword_whatever_the_verdict_says():
    verdict = {
        "status": "hung",
        "root_cause": {"category": "gpu_fault", "summary": "s", "confidence": 0.9, "fix": "f",
                       "culprit": {"ranks": [], "hosts": ["all", "ALL", "Default", "gpu-node-03"], "gpus": [], "links": []}},
        "findings": [],
    }  # fmt: skip
    assert _drain_buttons(verdict, "4242") == ["Drain gpu-node-03"]


def test_a_node_reached_by_address_is_still_named_by_the_name_it_gives_itself():
    # `--hosts 10.0.0.7`: the node calls itself node-a (its collector says so), and its logs print node-a.
    doc = _node_doc("10.0.0.7", PROMPT_LOG.format(host="node-a"))
    doc["node_hostname"] = "node-a"
    notes: list[str] = []
    v = judge([doc], "4242", {"10.0.0.7"}, notes).to_dict()
    assert v["root_cause"]["category"] == "gpu_fault" and v["root_cause"]["culprit"]["hosts"] == ["node-a"]
    assert notes == []
