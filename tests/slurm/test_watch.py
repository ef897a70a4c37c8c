"""`hangdx watch --slurm` against a REAL one-node Slurm (tests/slurm/test_slurm.py's), a real redis-server,
`hangdx worker` and the local Slack Web API stand-in: an sbatch job that hangs ends in one Slack thread with
its verdict; a healthy job, a slow job (silent for longer than the stall window, but computing), a hung job
that opted out in its comment and a hung job given to --exclude are left alone.

Needs root, slurm-wlm and munge (skipped with the reason otherwise), and redis-server."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hangdx.bot.config import BotConfig
from hangdx.bot.incidents import IncidentStore, connect
from hangdx.bot.request import DiagnoseRequest
from hangdx.bot.service import Service
from hangdx.bot.watch import list_slurm_jobs, parse_scontrol_jobs

from . import test_slurm
from .test_slurm import Cluster, _which

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bot.test_incidents import REDIS, start_redis, stop_redis  # noqa: E402
from slack_standin import SlackStandin  # noqa: E402

pytestmark = pytest.mark.slurm

CHANNEL = "C0ALERTS01"
STALL = 6.0

# Rank 0 of two, asleep in its allreduce; rank 1 never started (it crashed): what the verdict must name.
HUNG = """#!{python}
import time
def wait_for_allreduce():
    time.sleep(600)
print("rank 0 entering allreduce", flush=True)
wait_for_allreduce()
"""
# A healthy job: a step line every half second.
HEALTHY = """#!{python}
import time
for step in range(10000):
    print(f"step {{step}} loss 0.{{step % 97:02d}}", flush=True)
    time.sleep(0.5)
"""
# A slow job: one step takes longer than the stall window and prints only when it ends. It computes.
SLOW = """#!{python}
import os, time
os.nice(19)
def forward_backward(seconds):
    end = time.monotonic() + seconds
    x = 0
    while time.monotonic() < end:
        x += 1
    return x
for step in range(10000):
    forward_backward({seconds})
    print(f"step {{step}} done", flush=True)
"""


@pytest.fixture(scope="module")
def cluster():
    """test_slurm's one-node cluster, its partition shared so that five jobs run at once on two CPUs."""
    if os.geteuid() != 0:
        pytest.skip("a real Slurm needs root here (slurmd, munged); run as root in a container")
    missing = [b for b in test_slurm.BINARIES if _which(b) is None]
    if missing:
        pytest.skip(f"Slurm is not installed (missing {', '.join(missing)}): {test_slurm.INSTALL}")
    if REDIS is None:
        pytest.skip("redis-server is not installed (apt-get install redis-server)")
    conf = test_slurm.SLURM_CONF
    test_slurm.SLURM_CONF = conf.replace("State=UP\n", "State=UP OverSubscribe=FORCE:8\n")
    c = Cluster()
    try:
        c.start()
    except (RuntimeError, OSError, subprocess.SubprocessError) as e:
        c.stop()
        pytest.skip(f"could not start a one-node Slurm: {e}")
    finally:
        test_slurm.SLURM_CONF = conf
    try:
        yield c
    finally:
        c.stop()


def _script(cluster: Cluster, name: str, text: str) -> str:
    path = cluster.path(name)
    with open(path, "w") as f:
        f.write(text.format(python=sys.executable, seconds=STALL * 2))
    os.chmod(path, 0o755)
    return path


def _wait(what, cond, timeout: float):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        got = cond()
        if got:
            return got
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


def _read(path: str) -> str:
    try:
        with open(path, errors="replace") as f:
            return f.read()
    except OSError:
        return ""


def _stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            os.kill(p.pid, signal.SIGTERM)
    for p in procs:
        try:
            p.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.kill(p.pid, signal.SIGKILL)
            p.wait()


def test_scontrol_listing_names_the_running_jobs_their_outputs_and_comments(cluster):
    job = cluster.sbatch("--comment=train run 7 hangdx:off", "--wrap=sleep 120")
    cluster.wait_state(job, {"RUNNING"})
    old = os.environ.get("SLURM_CONF")
    os.environ["SLURM_CONF"] = cluster.env["SLURM_CONF"]
    try:
        (listed,) = [j for j in list_slurm_jobs() if j.job_id == job]
    finally:
        os.environ.pop("SLURM_CONF") if old is None else os.environ.__setitem__("SLURM_CONF", old)
    assert listed.user == "root" and listed.uid == 0 and listed.partition == "debug"
    assert listed.comment == "train run 7 hangdx:off"
    assert listed.outputs == [cluster.path(f"job-{job}.out")]
    cluster.run("scancel", job)
    cluster.wait_state(job, {"CANCELLED"})
    # A finished job is not listed; a path with a space stays whole.
    text = cluster.run("scontrol", "--oneliner", "show", "job", job).stdout
    assert parse_scontrol_jobs(text) == []
    running = text.replace("JobState=CANCELLED", "JobState=RUNNING").replace(
        f"StdOut={cluster.path(f'job-{job}.out')}", "StdOut=/scratch/my run/out.log"
    )
    assert parse_scontrol_jobs(running)[0].outputs[0] == "/scratch/my run/out.log"


def test_watch_turns_a_hung_sbatch_job_into_one_thread_and_leaves_the_others_alone(cluster, tmp_path):
    redis_proc, redis_url = start_redis(str(tmp_path))
    procs: list[subprocess.Popen] = []
    try:
        with SlackStandin() as slack:
            env = {
                **cluster.env,
                "SLACK_BOT_TOKEN": "xoxb-1111-2222-hangdxtest",
                "SLACK_SIGNING_SECRET": "8f742231b10e8888abcd99yyyzzz85a5",
                "SLACK_API_URL": slack.url,
                "REDIS_URL": redis_url,
                "HANGDX_ALERT_CHANNEL": CHANNEL,
                "HANGDX_RESOLVER": "local",
            }
            env.pop("SLACK_APP_TOKEN", None)
            rank0 = "--export=ALL,RANK=0,WORLD_SIZE={}"
            hung = cluster.sbatch("--job-name=hung", rank0.format(2), _script(cluster, "hung.py", HUNG))
            healthy = cluster.sbatch(
                "--job-name=healthy", rank0.format(1), _script(cluster, "ok.py", HEALTHY)
            )
            slow = cluster.sbatch("--job-name=slow", rank0.format(1), _script(cluster, "slow.py", SLOW))
            opted = cluster.sbatch("--comment=hangdx:off", rank0.format(2), _script(cluster, "h2.py", HUNG))
            excluded = cluster.sbatch(rank0.format(2), _script(cluster, "h3.py", HUNG))
            for job in (hung, healthy, slow, opted, excluded):
                cluster.wait_state(job, {"RUNNING"})
            _wait("the hung rank", lambda: "entering allreduce" in _read(cluster.path(f"job-{hung}.out")), 20)

            log = open(tmp_path / "bot.log", "wb")
            watch_log = tmp_path / "watch.log"
            procs.append(
                subprocess.Popen([sys.executable, "-m", "hangdx", "worker"], env=env, stdout=log, stderr=log)
            )
            argv = ["watch", "--slurm", "--interval", "1", "--stall", str(STALL), "--exclude", excluded]
            with open(watch_log, "wb") as wl:
                procs.append(subprocess.Popen([sys.executable, "-m", "hangdx", *argv], env=env, stderr=wl))
            log.close()

            def verdicts():
                return [
                    c
                    for c in slack.calls_to("chat.postMessage")
                    if c.body.get("blocks") and c.body.get("thread_ts")
                ]

            posts = _wait("the hung job's verdict in its thread", verdicts, 90)
            # The slow job is silent past the window but computing: its counters say so, and no probe runs.
            time.sleep(STALL * 2)  # more passes: the hung job must not be raised again
            store = IncidentStore(connect(redis_url))
            inc = store.get(hung)
            # Later alerts of the job join its incident, as /alerts does: no second thread.
            Service(BotConfig.from_env(env)).submit(
                DiagnoseRequest(job_id=hung, source="alert", requested_by="alertmanager")
            )
            time.sleep(1)
            parents = [c for c in slack.calls_to("chat.postMessage") if not c.body.get("thread_ts")]
            watch_text = watch_log.read_text()
            joined = store.get(hung)
            others = {job: store.get(job) for job in (healthy, slow, opted, excluded)}
    finally:
        _stop(procs)
        stop_redis(redis_proc)

    assert len(parents) == 1, [p.body for p in parents]
    assert parents[0].body["channel"] == CHANNEL and hung in parents[0].body["text"]
    assert "no output for" in parents[0].body["text"]
    post = posts[0].body
    assert post["thread_ts"] == parents[0].body.get("ts", post["thread_ts"])
    blocks = json.dumps(post["blocks"] if isinstance(post["blocks"], list) else json.loads(post["blocks"]))
    assert "rank_crashed" in blocks and "Rank 1" in blocks, blocks[:2000]

    assert inc is not None and inc.latest_verdict["root_cause"]["culprit"]["ranks"] == [1]
    watch_events = [e for e in inc.timeline if e.get("actor") == "hangdx watch"]
    assert len(watch_events) == 1, inc.timeline
    assert [e for e in joined.timeline if e.get("actor") == "alertmanager"], joined.timeline
    assert others == dict.fromkeys(others), f"jobs made incidents: {others}"
    assert f"job {slow} " not in watch_text, watch_text  # never probed: its CPU time moved every pass
    assert f"job {hung} stalled: no output for" in watch_text and "every counter flat for" in watch_text
    assert "every rank waiting with its stack unchanged across 2 samples" in watch_text
    for job in (healthy, opted, excluded):
        assert f"job {job} " not in watch_text, watch_text


def test_watch_once_says_why_each_job_is_skipped_and_exits(cluster, tmp_path):
    redis_proc, redis_url = start_redis(str(tmp_path))
    try:
        opted = cluster.sbatch("--comment=hangdx:off", "--wrap=sleep 60")
        other = cluster.sbatch("--wrap=sleep 60")
        cluster.wait_state(opted, {"RUNNING"})
        cluster.wait_state(other, {"RUNNING"})
        env = {**cluster.env, "REDIS_URL": redis_url, "HANGDX_RESOLVER": "local"}
        out = subprocess.run(
            [sys.executable, "-m", "hangdx", "watch", "--slurm", "--once", "--user", "nobody"],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
    finally:
        stop_redis(redis_proc)
    assert out.returncode == 0, out.stderr
    lines = dict((ln.split("\t")[0], ln.split("\t", 2)[1:]) for ln in out.stdout.splitlines())
    assert lines[opted] == ["skipped", "opted out (its comment says hangdx:off)"]
    assert lines[other] == ["skipped", "user root not watched"]


def test_watch_without_jobs_to_watch_is_a_one_line_usage_error():
    out = subprocess.run(
        [sys.executable, "-m", "hangdx", "watch", "--interval", "5"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert out.returncode == 2
    assert out.stderr == "hangdx: watch: which jobs? give --slurm or --inventory FILE\n"
