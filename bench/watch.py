"""`hangdx watch`: time from a hang to the alert thread, against the stall window, and the cost of a check.

    python bench/watch.py [--stalls 5,10,20] [--jobs 20]

Needs root, slurm-wlm and munge (a real one-node Slurm, as tests/slurm starts it) and redis-server. Runs
`hangdx watch --slurm --interval 1` and `hangdx worker` as processes against a throwaway redis-server and the
local Slack Web API stand-in. For each stall window, an sbatch job prints a line and hangs (rank 0 of two asleep
in its allreduce, rank 1 never started); the table gives the seconds from its last output to the incident's
thread (the parent post) and to the verdict in it. Then the cost of one check: a listing pass over N running
jobs (one `scontrol show job` for all of them, an lstat per output file; nothing runs on the nodes), and one
confirmation probe (two samples of every rank with py-spy: wall and CPU seconds on the node).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT))

from slack_standin import SlackStandin  # noqa: E402

from hangdx.bot.diagnosis import DiagnoseOptions  # noqa: E402
from hangdx.bot.watch import Watcher, WatchSettings, probe  # noqa: E402
from tests.bot.test_incidents import start_redis, stop_redis  # noqa: E402
from tests.slurm import test_slurm  # noqa: E402
from tests.slurm.test_watch import HUNG  # noqa: E402

CHANNEL = "C0ALERTS01"


def _until(cond, timeout: float):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        got = cond()
        if got:
            return got
        time.sleep(0.05)
    raise SystemExit("bench/watch.py: timed out")


def _script(cluster, name: str, text: str) -> str:
    path = cluster.path(name)
    Path(path).write_text(text.format(python=sys.executable))
    os.chmod(path, 0o755)
    return path


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.kill(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=15)
    except subprocess.TimeoutExpired:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()


def detection(cluster, env: dict, slack: SlackStandin, stall: float, n: int) -> tuple[float, float, str]:
    """Seconds from the hung job's last output to its thread's parent post, and to its verdict; what it said."""
    job = cluster.sbatch(
        f"--job-name=hung-{n}", "--export=ALL,RANK=0,WORLD_SIZE=2", _script(cluster, "h.py", HUNG)
    )
    out = cluster.path(f"job-{job}.out")
    _until(lambda: "entering allreduce" in (Path(out).read_text() if os.path.exists(out) else ""), 30)
    hung_at = os.stat(out).st_mtime  # the job's last sign of life
    log = open(cluster.path(f"watch-{n}.log"), "wb")
    watch = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "hangdx",
            "watch",
            "--slurm",
            "--interval",
            "1",
            "--stall",
            str(stall),
            "--job",
            job,
        ],
        env=env,
        stderr=log,
    )
    log.close()
    try:

        def posted(in_thread: bool):
            for c in slack.calls_to("chat.postMessage"):
                if bool(c.body.get("thread_ts")) == in_thread and (
                    in_thread and c.body.get("blocks") or not in_thread and job in c.body.get("text", "")
                ):
                    return time.time()
            return None

        parent_at = _until(lambda: posted(False), stall + 120)
        verdict_at = _until(lambda: posted(True), 180)
    finally:
        _stop(watch)
        cluster.run("scancel", job, check=False)
    text = Path(cluster.path(f"watch-{n}.log")).read_text()
    stalled = next((ln for ln in text.splitlines() if f"job {job} stalled" in ln), "")
    if not stalled:
        raise SystemExit(f"bench/watch.py: the watch did not say job {job} stalled: {text}")
    blocks = [c.body.get("blocks") for c in slack.calls_to("chat.postMessage") if c.body.get("thread_ts")]
    said = json.dumps(blocks)
    verdict = "rank_crashed, rank 1" if "rank_crashed" in said and "Rank 1" in said else "OTHER"
    # Slack's list of calls is cumulative: clear it so the next round's parent is its own.
    slack.calls.clear()
    return parent_at - hung_at, verdict_at - hung_at, verdict


def listing_cost(cluster, count: int) -> float:
    """Milliseconds of one Watcher.check() over `count` running jobs, none due a probe (median of 5)."""
    jobs = [cluster.sbatch("--wrap=sleep 600") for _ in range(count)]
    for job in jobs:
        cluster.wait_state(job, {"RUNNING"}, timeout=60)
    watcher = Watcher(WatchSettings(source="slurm", stall=3600), submit=lambda req: "")
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        decisions = watcher.check()
        times.append((time.perf_counter() - t0) * 1000)
    assert len(decisions) >= count
    cluster.run("scancel", *jobs, check=False)
    return sorted(times)[2]


def probe_cost(cluster) -> tuple[float, float, str]:
    """Wall and CPU seconds (this process and its py-spy children) of one confirmation probe of a hung job."""
    job = cluster.sbatch("--export=ALL,RANK=0,WORLD_SIZE=2", _script(cluster, "p.py", HUNG))
    cluster.wait_state(job, {"RUNNING"})
    time.sleep(1.5)
    before = [resource.getrusage(w) for w in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)]
    found = probe(job, DiagnoseOptions(how="local", samples=2, interval=1.0))
    after = [resource.getrusage(w) for w in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)]
    cpu = sum(a.ru_utime + a.ru_stime - b.ru_utime - b.ru_stime for a, b in zip(after, before, strict=True))
    cluster.run("scancel", job, check=False)
    return found.seconds, cpu, "stalled" if found.stalled else f"not stalled: {found.reason}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--stalls", default="5,10,20", help="stall windows to time, in seconds")
    ap.add_argument("--jobs", type=int, default=20, help="running jobs for the listing pass")
    args = ap.parse_args()
    if os.geteuid() != 0:
        raise SystemExit("bench/watch.py: a real Slurm needs root (slurmd, munged)")
    conf = test_slurm.SLURM_CONF
    test_slurm.SLURM_CONF = conf.replace("State=UP\n", "State=UP OverSubscribe=FORCE:64\n")
    cluster = test_slurm.Cluster()
    try:
        cluster.start()
    finally:
        test_slurm.SLURM_CONF = conf
    os.environ["SLURM_CONF"] = cluster.env["SLURM_CONF"]
    tmp = tempfile.mkdtemp(prefix="hangdx-bench-watch-")
    redis_proc, redis_url = start_redis(tmp)
    rows = []
    try:
        with SlackStandin() as slack:
            env = {
                **cluster.env,
                "SLACK_BOT_TOKEN": "xoxb-1111-2222-hangdxbench",
                "SLACK_API_URL": slack.url,
                "REDIS_URL": redis_url,
                "HANGDX_ALERT_CHANNEL": CHANNEL,
                "HANGDX_RESOLVER": "local",
            }
            env.pop("SLACK_APP_TOKEN", None)
            worker = subprocess.Popen(
                [sys.executable, "-m", "hangdx", "worker"],
                env=env,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            try:
                for n, stall in enumerate(float(s) for s in args.stalls.split(",")):
                    rows.append((stall, *detection(cluster, env, slack, stall, n)))
            finally:
                _stop(worker)
        listed_1 = listing_cost(cluster, 1)
        listed_n = listing_cost(cluster, args.jobs)
        probe_wall, probe_cpu, probe_says = probe_cost(cluster)
    finally:
        stop_redis(redis_proc)
        cluster.stop()

    print("hangdx watch --slurm --interval 1 (one-node Slurm, worker probing locally, Slack stand-in)")
    print(
        f"{'stall window':>12}  {'hang -> thread':>14}  {'over window':>11}  {'hang -> verdict':>15}  verdict"
    )
    for stall, thread, verdict, said in rows:
        print(f"{stall:>11.0f}s  {thread:>13.1f}s  {thread - stall:>10.1f}s  {verdict:>14.1f}s  {said}")
    print()
    print(f"{'cost of one check':<58} {'value':>12}")
    print(f"{'listing pass, 1 running job (1 scontrol, lstat outputs)':<58} {listed_1:>10.0f}ms")
    print(f"{f'listing pass, {args.jobs} running jobs (1 scontrol, lstat outputs)':<58} {listed_n:>10.0f}ms")
    print(f"{'on the nodes, per listing pass':<58} {'nothing':>12}")
    print(f"{'confirmation probe (2 samples per rank), wall':<58} {probe_wall:>11.1f}s")
    print(f"{'confirmation probe, CPU on the node (py-spy included)':<58} {probe_cpu:>11.2f}s")
    print(f"{'confirmation probe said':<58} {probe_says:>12}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
