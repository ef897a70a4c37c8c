"""What the failure tests run and count: a real redis-server they can kill and restart (append-only file, so
that its data survives), `hangdx worker` and `hangdx serve` processes, sleeping fake ranks, the Slack stand-in
(tests/slack_standin.py) noting which calls it failed on purpose, and `tally()`, the counts a user would check.

tally() -> {"incidents", "threads", "verdict_posts", "verdicts", "lost", "doubled", "stuck"}; every failure
test hands them to pytest's record_property (record()), where bench/hardening.py reads them from JUnit XML.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import redis
import requests
from rq import Worker
from rq.registry import StartedJobRegistry

from hangdx.bot.incidents import IncidentStore, connect
from hangdx.bot.queue import queue

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from slack_standin import SlackStandin  # noqa: E402

REDIS = shutil.which("redis-server")
TOKEN = "xoxb-1111-2222-hangdxtest"
SECRET = "8f742231b10e8888abcd99yyyzzz85a5"
ALERT_TOKEN = "alert-token-0123456789abcdef"
CHANNEL = "C0ALERTS01"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(what: str, cond: Callable[[], Any], timeout: float = 30.0, every: float = 0.05) -> Any:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        got = cond()
        if got:
            return got
        time.sleep(every)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")


class RedisServer:
    """redis-server on a free loopback port with an append-only file in `root`; kill() and start() again keep
    the port and the data, as a restarted production Redis does."""

    def __init__(self, root: Path) -> None:
        self.root, self.port = root, free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc: subprocess.Popen | None = None

    def start(self) -> RedisServer:
        cmd = [REDIS, "--port", str(self.port), "--bind", "127.0.0.1", "--appendonly", "yes", "--save", ""]
        self.proc = subprocess.Popen(
            [*cmd, "--dir", str(self.root)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        probe = connect(self.url, timeout=0.5)
        for _ in range(200):
            try:
                probe.ping()
                return self
            except redis.exceptions.RedisError:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"redis-server exited with {self.proc.returncode}") from None
                time.sleep(0.05)
        self.kill()
        raise RuntimeError("redis-server did not answer within 10 s")

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
        if self.proc is not None:
            self.proc.wait(timeout=10)


@dataclass
class Failure:
    """What the stand-in answers instead (its own _Failure's fields)."""

    status: int
    retry_after: int | None = None
    error: str | None = None


class Slack(SlackStandin):
    """The stand-in, noting which recorded calls it answered with a failure (429, 500, ok=false), and able to
    fail verdict posts (chat.postMessage with blocks, in a thread) alone."""

    def __post_init__(self) -> None:
        super().__post_init__()
        self.failed: set[int] = set()
        self.verdict_failures: list[Failure] = []

    def fail_verdicts(self, status: int, retry_after: int | None = None, times: int = 1) -> None:
        with self._lock:
            self.verdict_failures += [Failure(status, retry_after) for _ in range(times)]

    def _take_failure(self, method: str):  # noqa: ANN202 - the stand-in's own
        call = self.calls[-1]  # called under the lock, right after the call is recorded
        is_verdict = method == "chat.postMessage" and call.body.get("blocks") and call.body.get("thread_ts")
        if is_verdict and self.verdict_failures:
            failure = self.verdict_failures.pop(0)
        else:
            failure = super()._take_failure(method)
        if failure is not None:
            self.failed.add(id(call))
        return failure

    def delivered(self, method: str) -> list:
        """Calls to `method` that Slack accepted: what people in the channel see."""
        return [c for c in self.calls_to(method) if id(c) not in self.failed]


def _children(pid: int) -> list[int]:
    """Direct children of `pid`, from /proc."""
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            out.append(int(stat.parent.name))
    return out


def kill_pid(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


class Processes:
    """`hangdx worker` and `hangdx serve` processes with one environment; stop() ends them and their work
    horses, by PID."""

    def __init__(self, env: dict[str, str], log: Path) -> None:
        self.env, self.log = env, open(log, "ab")
        self.procs: list[subprocess.Popen] = []
        self.extra_pids: list[int] = []  # horses left behind by a killed worker

    def worker(self) -> subprocess.Popen:
        return self._start([sys.executable, "-m", "hangdx", "worker"])

    def serve(self, port: int) -> subprocess.Popen:
        return self._start([sys.executable, "-m", "hangdx", "serve", "--port", str(port)])

    def _start(self, cmd: list[str]) -> subprocess.Popen:
        p = subprocess.Popen(cmd, env=self.env, stdout=self.log, stderr=self.log)
        self.procs.append(p)
        return p

    def stop(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                for child in _children(p.pid):  # a diagnosis still running: no need to wait for it
                    kill_pid(child)
                p.send_signal(signal.SIGTERM)
        for p in self.procs:
            try:
                p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                for child in _children(p.pid):
                    kill_pid(child)
                kill_pid(p.pid)
                p.wait(timeout=10)
        for pid in self.extra_pids:
            kill_pid(pid)
        self.log.close()


def bot_env(redis_url: str, slack: SlackStandin, **extra: str) -> dict[str, str]:
    env = {
        **os.environ,
        "SLACK_BOT_TOKEN": TOKEN,
        "SLACK_SIGNING_SECRET": SECRET,
        "SLACK_API_URL": slack.url,
        "REDIS_URL": redis_url,
        "HANGDX_ALERT_TOKEN": ALERT_TOKEN,
        "HANGDX_ALERT_CHANNEL": CHANNEL,
        "HANGDX_RESOLVER": "local",
        # Quick enough for tests: a dead worker's lock lapses in 2 s, reapers look twice a second.
        "HANGDX_LOCK_TTL": "2",
        "HANGDX_REAP_INTERVAL": "0.5",
        "HANGDX_DIAGNOSIS_TRIES": "2",
    }
    env.pop("SLACK_APP_TOKEN", None)
    env.pop("HANGDX_CONFIG", None)
    env.pop("HANGDX_NOTIFIER", None)
    return {**env, **extra}


class FakeRanks:
    """Sleeping processes that say they are ranks of jobs (HANGDX_JOB_ID, RANK, WORLD_SIZE), killed by PID."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen] = []

    def job(self, job_id: str, ranks: tuple[int, ...] = (0,), world: int = 2) -> str:
        for rank in ranks:
            env = {**os.environ, "HANGDX_JOB_ID": job_id, "RANK": str(rank), "WORLD_SIZE": str(world)}
            env["LOCAL_RANK"] = str(rank)
            code = "import time\ndef train_step():\n    time.sleep(600)\ntrain_step()\n"
            self.procs.append(subprocess.Popen([sys.executable, "-c", code], env=env))
        return job_id

    def stop(self) -> None:
        for p in self.procs:
            kill_pid(p.pid)
            p.wait(timeout=10)


def alert(url: str, job: str, timeout: float = 30) -> requests.Response:
    body = {"job_id": job, "summary": "no training step for 10 minutes"}
    headers = {"Authorization": f"Bearer {ALERT_TOKEN}"}
    return requests.post(url + "/alerts", json=body, headers=headers, timeout=timeout)


def healthy(url: str) -> bool:
    try:
        return requests.get(url + "/healthz", timeout=1).status_code == 200
    except requests.RequestException:
        return False


# -- the counts ----------------------------------------------------------------------------------------


def parents_of(slack: Slack, job: str) -> list:
    """The top-level messages that opened a thread for `job` (accepted by Slack)."""
    return [
        c
        for c in slack.delivered("chat.postMessage")
        if not c.body.get("thread_ts") and f"Diagnosing job {job}…" in c.body.get("text", "")
    ]


def thread_of(slack: Slack, ts: str | None) -> list:
    """The replies Slack accepted in the thread `ts`."""
    return [c for c in slack.delivered("chat.postMessage") if ts and c.body.get("thread_ts") == ts]


def verdict_posts(slack: Slack, ts: str | None) -> list:
    return [c for c in thread_of(slack, ts) if c.body.get("blocks")]


def stuck_rq_jobs(conn: redis.Redis) -> int:
    """RQ jobs still waiting or marked running (the started registry cleaned of expired entries first)."""
    q = queue(conn)
    return q.count + StartedJobRegistry(queue=q).count


def tally(conn: redis.Redis, slack: Slack, jobs: list[str], expect_verdict: bool = True) -> dict[str, int]:
    """What a user would count for the jobs alerted on: incidents, threads, verdict posts in them, verdicts
    kept; `lost` = jobs missing an incident, a thread or (expect_verdict) a verdict kept and posted;
    `doubled` = jobs with more than one of any of those; `stuck` = RQ jobs left queued or running."""
    store = IncidentStore(conn)
    counts = {"incidents": 0, "threads": 0, "verdict_posts": 0, "verdicts": 0, "lost": 0, "doubled": 0}
    for job in jobs:
        inc = store.get(job)
        archived = len(conn.keys(f"hangdx:archive:{job}:*[0-9]"))  # a second incident for the job
        parents = len(parents_of(slack, job))
        posts = len(verdict_posts(slack, inc.thread_ts if inc else None))
        kept = len(inc.verdicts) if inc else 0
        counts["incidents"] += (inc is not None) + archived
        counts["threads"] += parents
        counts["verdict_posts"] += posts
        counts["verdicts"] += kept
        want = 1 if expect_verdict else 0
        counts["lost"] += inc is None or parents == 0 or (expect_verdict and (kept == 0 or posts == 0))
        counts["doubled"] += archived > 0 or parents > 1 or kept > want or posts > want
    counts["stuck"] = stuck_rq_jobs(conn)
    return counts


def record(record_property: Callable[[str, Any], None], counts: dict[str, int]) -> None:
    for key, value in counts.items():
        record_property(key, value)


def wait_verdicts(slack: Slack, conn: redis.Redis, jobs: list[str], timeout: float = 60) -> bool:
    """Until every job's thread has a verdict post, or `timeout`; whether they all have. (It does not raise,
    so that the test counts, records and then asserts what it found.)"""
    store = IncidentStore(conn)

    def done() -> bool:
        for job in jobs:
            inc = store.get(job)
            if inc is None or not verdict_posts(slack, inc.thread_ts):
                return False
        return True

    return wait_until(done, timeout)


def wait_until(cond: Callable[[], Any], timeout: float) -> bool:
    try:
        wait_for("", cond, timeout=timeout, every=0.1)
        return True
    except AssertionError:
        return False


def run_record(conn: redis.Redis, job: str) -> dict[str, str]:
    return {k.decode(): v.decode() for k, v in conn.hgetall(f"hangdx:run:{job}").items()}


def settle(seconds: float) -> None:
    """Give late (doubled) messages the time to show up before counting."""
    time.sleep(seconds)


def worker_count(conn: redis.Redis) -> int:
    return len(Worker.all(connection=conn))
