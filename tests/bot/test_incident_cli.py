"""`hangdx incident JOBID`: an incident kept in Redis, as Markdown for the postmortem."""

from __future__ import annotations

import os
import subprocess
import sys

from hangdx.bot.incidents import IncidentStore, connect
from hangdx.bot.request import DiagnoseRequest

from .test_incidents import VERDICT, redis_url  # noqa: F401  (the session's redis-server)


def run(redis: str, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "REDIS_URL": redis}
    return subprocess.run(
        [sys.executable, "-m", "hangdx", "incident", *args], env=env, capture_output=True, text=True
    )


def test_incident_markdown_has_job_status_timeline_and_verdict(redis_url):  # noqa: F811
    store = IncidentStore(connect(redis_url))
    store.r.flushdb()
    store.open_or_join(
        DiagnoseRequest(job_id="job-1", source="alert", requested_by="alertmanager", summary="stalled")
    )
    store.add_verdict("job-1", VERDICT)
    store.set_status("job-1", "acknowledged", "U0ONCALL01")
    r = run(redis_url, "job-1")
    assert r.returncode == 0, r.stderr
    md = r.stdout
    assert "job-1" in md and "acknowledged" in md
    assert VERDICT["root_cause"]["category"] in md and "U0ONCALL01" in md


def test_unknown_incident_and_redis_down_are_one_line_errors(redis_url):  # noqa: F811
    r = run(redis_url, "no-such-job")
    assert r.returncode == 2 and r.stderr.count("\n") <= 1 and "no incident for job 'no-such-job'" in r.stderr
    r = run("redis://127.0.0.1:9/0", "job-1")
    assert r.returncode == 2 and r.stderr.count("\n") <= 1 and "unavailable" in r.stderr
