"""End to end, as a team runs it: `hangdx serve` and `hangdx worker` as processes, a real redis-server,
the local Slack Web API stand-in, and a real hung torch.distributed job. An alert for the job must end
in one thread whose verdict names the rank that skipped a collective; a repeated alert joins it."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import requests

from hangdx.bot.incidents import IncidentStore, connect

from .test_incidents import redis_url  # noqa: F401  (the session's redis-server)

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from slack_standin import SlackStandin  # noqa: E402

pytest.importorskip("torch")
from hangdx.zoo.launch import ZooJob  # noqa: E402

pytestmark = pytest.mark.zoo

ALERT_TOKEN = "alert-token-0123456789abcdef"
CHANNEL = "C0ALERTS01"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(what, cond, timeout: float = 60.0):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        got = cond()
        if got:
            return got
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


@contextmanager
def running_bot(env: dict[str, str], log_path: Path) -> Iterator[str]:
    """`hangdx serve` and one `hangdx worker` with `env`, as processes; their URL once /healthz answers. Both
    are ended by PID (SIGTERM, then SIGKILL)."""
    port = free_port()
    log = open(log_path, "wb")
    serve = [sys.executable, "-m", "hangdx", "serve", "--port", str(port)]
    worker = [sys.executable, "-m", "hangdx", "worker"]
    procs = [subprocess.Popen(cmd, env=env, stdout=log, stderr=log) for cmd in (serve, worker)]
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for("the bot's /healthz", lambda: _healthy(url), timeout=30)
        yield url
    finally:
        for p in procs:
            if p.poll() is None:
                os.kill(p.pid, signal.SIGTERM)
        for p in procs:
            try:
                p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.kill(p.pid, signal.SIGKILL)
                p.wait()
        log.close()


def bot_env(slack: SlackStandin, redis: str, **extra: str) -> dict[str, str]:
    env = {
        **os.environ,
        "SLACK_BOT_TOKEN": "xoxb-1111-2222-hangdxtest",
        "SLACK_SIGNING_SECRET": "8f742231b10e8888abcd99yyyzzz85a5",
        "SLACK_API_URL": slack.url,
        "REDIS_URL": redis,
        "HANGDX_RESOLVER": "local",
        **extra,
    }
    env.pop("SLACK_APP_TOKEN", None)
    return env


@pytest.fixture
def bot(redis_url, tmp_path):  # noqa: F811
    connect(redis_url).flushdb()
    with SlackStandin() as slack:
        env = bot_env(slack, redis_url, HANGDX_ALERT_TOKEN=ALERT_TOKEN, HANGDX_ALERT_CHANNEL=CHANNEL)
        with running_bot(env, tmp_path / "bot.log") as url:
            yield url, slack, redis_url


def _healthy(url: str) -> bool:
    try:
        return requests.get(url + "/healthz", timeout=1).status_code == 200
    except requests.RequestException:
        return False


def alert(url: str, job_id: str, token: str = ALERT_TOKEN) -> requests.Response:
    body = {"job_id": job_id, "summary": "no training step for 10 minutes"}
    return requests.post(url + "/alerts", json=body, headers={"Authorization": f"Bearer {token}"}, timeout=10)


def test_alert_for_a_hung_job_ends_in_a_thread_naming_the_culprit(bot):
    url, slack, rurl = bot
    with ZooJob("skip_collective") as job:
        job.wait_until_stuck()
        assert alert(url, job.job_id, token="wrong-token-0123456789").status_code == 401
        r = alert(url, job.job_id)
        assert r.status_code == 202, r.text
        verdicts = wait_for(
            "the verdict in the thread",
            lambda: [
                c
                for c in slack.calls_to("chat.postMessage")
                if c.body.get("blocks") and c.body.get("thread_ts")
            ],
            timeout=90,
        )
        assert alert(url, job.job_id).status_code == 202  # the same alert again, while the incident is open
        wait_for(
            "the repeated alert on the timeline",
            lambda: len(IncidentStore(connect(rurl)).get(job.job_id).timeline) >= 3,
        )
        # A diagnosis the repeated alert started ends while the job still hangs, not racing its end (/alerts
        # answered 202 once the run was claimed: none in flight means none is coming).
        wait_for(
            "no diagnosis of the job in flight",
            lambda: job.job_id not in dict(IncidentStore(connect(rurl)).runs()),
            timeout=120,
        )
    parents = [c for c in slack.calls_to("chat.postMessage") if not c.body.get("thread_ts")]
    assert len(parents) == 1, "one thread per incident, not one per alert"
    assert parents[0].body["channel"] == CHANNEL and job.job_id in parents[0].body["text"]
    post = verdicts[0].body
    assert post["channel"] == CHANNEL
    thread_ts = post["thread_ts"]

    def updates() -> list:
        return [u for u in slack.calls_to("chat.update") if u.body["ts"] == thread_ts]

    assert any("evidence from 1/1 hosts" in u.body["text"] for u in updates()), "progress edited in place"
    # The parent's last edit names the verdict (it may land just after the verdict's reply; it must stay last).
    wait_for(
        "the parent edited to the verdict, last",
        lambda: (
            updates()
            and (
                "conditional_collective" in updates()[-1].body["text"]
                or "Rank 1" in updates()[-1].body["text"]
            )
        ),
    )
    blocks = post["blocks"] if isinstance(post["blocks"], list) else json.loads(post["blocks"])
    text = json.dumps(blocks)
    assert "conditional_collective" in text
    assert "Rank 1 skipped the allreduce" in text
    inc = IncidentStore(connect(rurl)).get(job.job_id)
    assert inc.status == "diagnosed" and inc.thread_ts == thread_ts
    assert inc.latest_verdict["root_cause"]["culprit"]["ranks"] == [1]


def _slash(url: str, text: str) -> requests.Response:
    from urllib.parse import urlencode

    from slack_sdk.signature import SignatureVerifier

    body = urlencode(
        {"command": "/diagnose", "text": text, "user_id": "U0ONCALL01", "channel_id": CHANNEL,
         "team_id": "T0HANGDX1", "response_url": "http://127.0.0.1:9/respond", "trigger_id": "1.2.3"}
    )  # fmt: skip
    stamp = str(int(time.time()))
    sig = SignatureVerifier("8f742231b10e8888abcd99yyyzzz85a5").generate_signature(timestamp=stamp, body=body)
    headers = {"Content-Type": "application/x-www-form-urlencoded", "X-Slack-Request-Timestamp": stamp,
               "X-Slack-Signature": sig}  # fmt: skip
    # Slack gives up on an answer after 3 seconds: the bot must ack within that even when busy.
    return requests.post(url + "/slack/events", data=body, headers=headers, timeout=3)


def test_the_bot_keeps_answering_while_ten_diagnoses_run(bot):
    import uuid

    url, slack, rurl = bot
    jobs = [f"busy-{uuid.uuid4().hex[:6]}-{i}" for i in range(10)]
    procs = []
    try:
        for job in jobs:  # ranks 0 and 1 of three, asleep: rank 2 is missing
            for rank in (0, 1):
                env = {
                    **os.environ,
                    "HANGDX_JOB_ID": job,
                    "RANK": str(rank),
                    "WORLD_SIZE": "3",
                    "LOCAL_RANK": str(rank),
                }
                procs.append(
                    subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"], env=env)
                )
        time.sleep(1.0)
        for job in jobs:
            assert alert(url, job).status_code == 202
        for job in jobs[:3]:
            r = _slash(url, job)  # asked again in Slack while the worker is busy: answered at once
            assert r.status_code == 200 and "Diagnosing job" in r.json()["text"]
            assert requests.get(url + "/healthz", timeout=3).status_code == 200
        posts = wait_for(
            "ten verdicts",
            lambda: (lambda ps: ps if len({p.body["thread_ts"] for p in ps}) == 10 else None)(
                [
                    c
                    for c in slack.calls_to("chat.postMessage")
                    if c.body.get("blocks") and c.body.get("thread_ts")
                ]
            ),
            timeout=120,
        )
        for p in posts:
            text = json.dumps(
                p.body["blocks"] if isinstance(p.body["blocks"], list) else json.loads(p.body["blocks"])
            )
            assert "rank_crashed" in text and "Rank 2" in text
        parents = [c for c in slack.calls_to("chat.postMessage") if not c.body.get("thread_ts")]
        assert len(parents) == 10, "one thread per job, whatever the number of requests"
    finally:
        for p in procs:
            p.kill()
            p.wait()
