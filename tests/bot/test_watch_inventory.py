"""`hangdx watch --inventory FILE --once --raise`: an inventory names no output files, so each job is probed at once;
a real process asleep in its "allreduce" (its rank 1 missing) is stalled and opens an incident in a real
redis-server through Service.submit; a real process computing is moving and opens none."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from hangdx.bot.incidents import IncidentStore, connect

from .test_incidents import needs_redis, redis_url  # noqa: F401  (the session's redis-server)

SLEEPER = "import time\ndef wait_for_allreduce():\n    time.sleep(120)\nwait_for_allreduce()\n"
WORKER = (
    "import os, time\nos.nice(19)\nend = time.monotonic() + 60\nx = 0\n"
    "while time.monotonic() < end:\n    x += 1\n"
)


@needs_redis
def test_inventory_jobs_are_probed_and_only_the_hung_one_opens_an_incident(redis_url, tmp_path):  # noqa: F811
    connect(redis_url).flushdb()
    stamp = str(os.getpid())
    hung, busy = f"inv-hung-{stamp}", f"inv-busy-{stamp}"
    inventory = tmp_path / "inventory.yaml"
    inventory.write_text(f"jobs:\n  {hung}: [localhost]\n  {busy}: [localhost]\n")
    procs = []
    try:
        for job, code, size in ((hung, SLEEPER, "2"), (busy, WORKER, "1")):
            env = {**os.environ, "HANGDX_JOB_ID": job, "RANK": "0", "WORLD_SIZE": size, "LOCAL_RANK": "0"}
            procs.append(subprocess.Popen([sys.executable, "-c", code], env=env))
        time.sleep(1.0)
        env = {k: v for k, v in os.environ.items() if not k.startswith(("SLACK_", "HANGDX_"))}
        env["REDIS_URL"] = redis_url
        argv = ["watch", "--inventory", str(inventory), "--once", "--raise", "--probe", "local"]
        out = subprocess.run(
            [sys.executable, "-m", "hangdx", *argv], env=env, capture_output=True, text=True, timeout=120
        )
    finally:
        for p in procs:
            p.kill()
            p.wait()
    assert out.returncode == 0, out.stderr
    lines = {ln.split("\t")[0]: ln.split("\t")[1:] for ln in out.stdout.splitlines()}
    assert lines[hung][0] == "stalled", lines
    assert "every rank waiting with its stack unchanged across 2 samples" in lines[hung][1]
    assert "rank(s) 1 gone" in lines[hung][1]
    assert lines[busy][0] == "moving", lines
    store = IncidentStore(connect(redis_url))
    inc = store.get(hung)
    assert inc is not None and inc.timeline[0]["actor"] == "hangdx watch"
    assert store.get(busy) is None


def test_a_bad_inventory_is_a_one_line_error(tmp_path):
    bad = tmp_path / "inventory.yaml"
    bad.write_text("jobs: [1, 2]\n")
    env = {**os.environ, "REDIS_URL": "redis://127.0.0.1:9/0"}
    out = subprocess.run(
        [sys.executable, "-m", "hangdx", "watch", "--inventory", str(bad), "--once", "--probe", "local"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2
    assert out.stderr.startswith("hangdx: inventory ") and out.stderr.count("\n") == 1, out.stderr


def test_a_job_that_just_started_is_not_probed_before_it_has_run_a_stall_window():
    """A job whose output file is not written yet, minutes into a watch, has no process to find yet: probing it
    at first sight said "no process of job N found" for a healthy job (seen on a loaded two-core machine)."""
    from hangdx.bot.watch import Confirmation, RunningJob, Watcher, WatchSettings, parse_scontrol_jobs

    now = time.time()
    started = time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(now - 2))
    line = (f"JobId=77 JobName=fresh UserId=alice(1000) JobState=RUNNING StartTime={started} Partition=debug "
            "StdOut=/nonexistent/job-77.out")  # fmt: skip
    (job,) = parse_scontrol_jobs(line)
    assert job.started is not None and abs(job.started - (now - 2)) < 2
    probed: list[str] = []
    old = RunningJob("78", outputs=["/nonexistent/job-78.out"], started=now - 3600)  # a watch restarted late

    def confirm(job_id: str) -> Confirmation:
        probed.append(job_id)
        return Confirmation(None, f"no process of job {job_id!r} found")

    w = Watcher(WatchSettings("slurm", stall=60), lambda r: "q", lambda: [job, old], confirm)
    decisions = {d.job_id: d.outcome for d in w.check()}
    assert decisions == {"77": "quiet", "78": "unconfirmed"} and probed == ["78"]
