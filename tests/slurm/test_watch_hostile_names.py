"""Issue row 10: `hangdx watch --slurm` read `scontrol --oneliner show job`, where a value runs to the next
` Key=`: a job name with spaces (`x UserId=alice(1001) Partition=gpu JobState=RUNNING StdOut=/home/alice/job.log`)
or a newline (a second "record" starting `JobId=`) overrode the fields hangdx reads, and a comment could do the
same. Against the real one-node Slurm of tests/slurm/test_slurm.py: each hostile job is listed as what it is
(root's job in partition debug, with its own output file), and no job that does not exist is listed.

Needs root, slurm-wlm and munge (skipped with the reason otherwise)."""

from __future__ import annotations

import time

import pytest

from hangdx.bot.watch import list_slurm_jobs, parse_scontrol_jobs

from . import test_slurm
from .test_slurm import Cluster

cluster = test_slurm.cluster  # the module's own one-node Slurm (a fixture)

pytestmark = pytest.mark.slurm

FAKE = (
    "UserId=alice(1001) Partition=gpu JobState=RUNNING StdOut=/home/alice/job.log StdErr=/home/alice/job.log"
)
# The one-node Slurm runs two jobs at once: two jobs carry the four attacks.
HOSTILE = {
    "name with keys, comment with a newline": [
        "--job-name=x " + FAKE,
        "--comment=a\nJobId=999998 JobName=z " + FAKE,
    ],
    "name with a newline, comment with keys": [
        "--job-name=y\nJobId=999999 JobName=z " + FAKE,
        "--comment=train " + FAKE + " StartTime=2001-01-01T00:00:00",
    ],
}


def _squeue_state(cluster: Cluster, job: str) -> str:
    """The job's state from squeue's own column (scontrol's text would be fooled by the name itself)."""
    return cluster.run("squeue", "-h", "-j", job, "-o", "%T", check=False).stdout.strip()


def _running(cluster: Cluster, jobs: list[str], timeout: float = 30) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if all(_squeue_state(cluster, j) == "RUNNING" for j in jobs):
            return
        time.sleep(0.2)
    raise AssertionError({j: _squeue_state(cluster, j) for j in jobs})


def _check(listed, jobs: dict[str, str], cluster: Cluster) -> None:
    by_id = {j.job_id: j for j in listed}
    assert not {"999999", "999998"} & set(by_id), sorted(by_id)
    for name, job in jobs.items():
        if job not in by_id:
            continue  # (the text parser may skip an ambiguous record; it never reads it as another's)
        j = by_id[job]
        assert (j.user, j.uid, j.partition) == ("root", 0, "debug"), (name, j)
        assert j.outputs == [cluster.path(f"job-{job}.out")], (name, j)
    for j in listed:  # the comment is the job's own text; every field hangdx acts on is Slurm's
        assert j.user != "alice" and j.uid != 1001 and j.partition != "gpu", j
        assert not [p for p in j.outputs if p.startswith("/home/alice")], j


def test_hostile_job_names_and_comments_shadow_no_field(cluster):
    jobs = {name: cluster.sbatch(*args, "--wrap=sleep 120") for name, args in HOSTILE.items()}
    try:
        _running(cluster, list(jobs.values()))
        listed = list_slurm_jobs()
        _check(listed, jobs, cluster)
        # Every hostile job is listed, and rightly: hangdx still watches it, with its comment as written.
        ids = {j.job_id: j for j in listed}
        assert set(jobs.values()) <= set(ids), sorted(ids)
        assert ids[jobs["name with a newline, comment with keys"]].comment.startswith("train UserId=alice")
        # The text parser (Slurm without --json) holds too.
        text = cluster.run("scontrol", "--oneliner", "show", "job").stdout
        _check(parse_scontrol_jobs(text), jobs, cluster)
    finally:
        cluster.run("scancel", *jobs.values(), check=False)


def test_later_squeue_json_shapes_are_read_too():
    """Slurm 23.02 and later write states as lists and times as {"set", "number"}; fields stay their own."""
    import json

    from hangdx.bot.watch import parse_squeue_json

    job = {
        "job_id": 4242, "name": "x " + FAKE, "user_name": "root", "user_id": 0, "partition": "debug",
        "job_state": ["RUNNING"], "start_time": {"set": True, "infinite": False, "number": 1700000000},
        "standard_output": "/scratch/%u/%x-%j.out", "standard_error": "", "comment": "a\nJobId=1 " + FAKE,
        "current_working_directory": "/scratch/root", "array_task_id": {"set": False, "number": 0},
    }  # fmt: skip
    (listed,) = parse_squeue_json(
        json.dumps({"jobs": [job, {**job, "job_id": 4243, "job_state": ["PENDING"]}]})
    )
    assert (listed.job_id, listed.user, listed.uid, listed.partition) == ("4242", "root", 0, "debug")
    assert listed.outputs == [f"/scratch/root/x {FAKE}-4242.out"] and listed.started == 1700000000.0
