"""Hardening 21.11: 40 jobs stalling at once (a shared file system hangs) opened 40 incidents, 40 threads and 40
diagnoses. Jobs that go quiet together are one incident naming what they share; a pass probes a bounded few."""

from __future__ import annotations

import os
import time

from hangdx.bot.watch import PROBES_PER_PASS, STORM_PROBES, Confirmation, RunningJob, Watcher, WatchSettings


def _jobs(tmp_path, n: int, quiet_for: float) -> list[RunningJob]:
    jobs = []
    for i in range(n):
        out = tmp_path / f"job{i}.out"
        out.write_text("step 10\n")
        old = time.time() - quiet_for - i  # went quiet within a minute of each other
        os.utime(out, (old, old))
        jobs.append(RunningJob(job_id=str(5000 + i), user="alice", partition="gpu", outputs=[str(out)]))
    return jobs


def test_forty_jobs_stalling_together_open_one_incident_naming_what_they_share(tmp_path):
    jobs = _jobs(tmp_path, 40, quiet_for=900)
    probed: list[str] = []
    opened = []

    def confirm(job_id: str) -> Confirmation:
        probed.append(job_id)
        return Confirmation(True, "every rank waits, no stack moved", 1.0)

    w = Watcher(WatchSettings("slurm", stall=600), opened.append, lambda: jobs, confirm)
    decisions = w.check()
    assert len(opened) == 1 and len(probed) <= STORM_PROBES
    summary = opened[0].summary
    assert "40 jobs went quiet" in summary and "one shared cause is likelier than 40 hangs" in summary
    assert "partition gpu" in summary and "the file system at " in summary
    outcomes = sorted(d.outcome for d in decisions)
    assert outcomes.count("stalled") == 1 and outcomes.count("grouped") == 39
    # The next pass: nothing new opened, nothing probed again, while they stay quiet.
    assert w.check() and len(opened) == 1 and len(probed) <= STORM_PROBES


def test_a_pass_probes_a_bounded_few_of_the_jobs_due_and_leaves_the_rest_for_later(tmp_path):
    # Quiet at times far apart (no storm): each is its own hang, but one pass probes only PROBES_PER_PASS.
    jobs = _jobs(tmp_path, 12, quiet_for=900)
    for i, j in enumerate(jobs):
        old = time.time() - 900 - 400 * i
        os.utime(j.outputs[0], (old, old))
    probed: list[str] = []
    opened = []
    w = Watcher(WatchSettings("slurm", stall=600), opened.append, lambda: jobs,
                lambda job_id: (probed.append(job_id), Confirmation(True, "stuck", 1.0))[1])  # fmt: skip
    first = w.check()
    assert len(probed) == PROBES_PER_PASS == len(opened)
    assert sum(d.outcome == "deferred" for d in first) == 12 - PROBES_PER_PASS
    w.check()
    assert len(opened) == min(12, 2 * PROBES_PER_PASS)
