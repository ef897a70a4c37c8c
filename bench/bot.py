"""The bot's speed and footprint: time from `/diagnose` to the verdict in the thread, and memory.

    python bench/bot.py [--repeat 3]

Runs `hangdx serve` and `hangdx worker` as processes against a throwaway redis-server and the local
Slack Web API stand-in (tests/slack_standin.py), sends signed `/diagnose` commands for a real hung
zoo job (skip_collective, 4 ranks), and prints: seconds from the command to the verdict's post in
the thread (median of --repeat), and the resident memory of the `hangdx serve` process idle and with
ten open incidents.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from urllib.parse import urlencode

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT))

import requests  # noqa: E402
from slack_sdk.signature import SignatureVerifier  # noqa: E402
from slack_standin import SlackStandin  # noqa: E402

from hangdx.zoo.launch import ZooJob  # noqa: E402
from tests.bot.test_incidents import start_redis, stop_redis  # noqa: E402

SECRET = "8f742231b10e8888abcd99yyyzzz85a5"
ALERT_TOKEN = "alert-token-0123456789abcdef"
CHANNEL = "C0ONCALL01"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def slash(url: str, text: str, response_url: str) -> None:
    body = urlencode(
        {"command": "/diagnose", "text": text, "user_id": "U0ONCALL01", "channel_id": CHANNEL,
         "team_id": "T0HANGDX1", "response_url": response_url, "trigger_id": "1.2.3"}
    )  # fmt: skip
    stamp = str(int(time.time()))
    sig = SignatureVerifier(SECRET).generate_signature(timestamp=stamp, body=body)
    headers = {"Content-Type": "application/x-www-form-urlencoded", "X-Slack-Request-Timestamp": stamp,
               "X-Slack-Signature": sig}  # fmt: skip
    requests.post(url + "/slack/events", data=body, headers=headers, timeout=10).raise_for_status()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    tmp = tempfile.mkdtemp(prefix="hangdx-bench-bot-")
    redis_proc, redis_url = start_redis(tmp)
    procs: list[subprocess.Popen] = []
    try:
        with SlackStandin() as slack:
            port = free_port()
            env = {**os.environ, "SLACK_BOT_TOKEN": "xoxb-1111-2222-hangdxbench", "SLACK_SIGNING_SECRET": SECRET,
                   "SLACK_API_URL": slack.url, "REDIS_URL": redis_url, "HANGDX_ALERT_TOKEN": ALERT_TOKEN,
                   "HANGDX_ALERT_CHANNEL": CHANNEL, "HANGDX_RESOLVER": "local"}  # fmt: skip
            env.pop("SLACK_APP_TOKEN", None)
            log = open(Path(tmp) / "bot.log", "wb")
            serve = subprocess.Popen([sys.executable, "-m", "hangdx", "serve", "--port", str(port)], env=env,
                                     stdout=log, stderr=log)  # fmt: skip
            worker = subprocess.Popen(
                [sys.executable, "-m", "hangdx", "worker"], env=env, stdout=log, stderr=log
            )
            procs = [serve, worker]
            url = f"http://127.0.0.1:{port}"
            for _ in range(300):
                try:
                    if requests.get(url + "/healthz", timeout=1).status_code == 200:
                        break
                except requests.RequestException:
                    time.sleep(0.1)
            idle = rss_mb(serve.pid)
            seconds = []
            for i in range(args.repeat):
                with ZooJob("skip_collective") as job:
                    job.wait_until_stuck()
                    before = len(slack.calls_to("chat.postMessage"))
                    t0 = time.monotonic()
                    slash(url, job.job_id, slack.root + f"respond/bench/{i}")
                    while True:
                        posts = slack.calls_to("chat.postMessage")[before:]
                        done = [p for p in posts if p.body.get("thread_ts") and p.body.get("blocks")]
                        if done:
                            break
                        if time.monotonic() - t0 > 120:
                            raise SystemExit("no verdict within 120 s")
                        time.sleep(0.05)
                    seconds.append(time.monotonic() - t0)
                    blocks = done[0].body["blocks"]
                    text = json.dumps(blocks if isinstance(blocks, list) else json.loads(blocks))
                    right = "conditional_collective" in text and "Rank 1" in text
                    print(
                        f"  run {i + 1}: {seconds[-1]:.2f}s, verdict {'right' if right else 'WRONG'}",
                        file=sys.stderr,
                    )
            for i in range(10):
                body = {"job_id": f"bench-incident-{i}", "summary": "no step for 10 minutes"}
                requests.post(url + "/alerts", json=body, headers={"Authorization": f"Bearer {ALERT_TOKEN}"},
                              timeout=10).raise_for_status()  # fmt: skip
            time.sleep(3)
            ten = rss_mb(serve.pid)
    finally:
        for p in procs:
            if p.poll() is None:
                os.kill(p.pid, signal.SIGTERM)
        for p in procs:
            try:
                p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.kill(p.pid, signal.SIGKILL)
        stop_redis(redis_proc)
    print(f"{'measure':44} {'value':>10}")
    print("-" * 56)
    print(f"{'/diagnose to verdict in thread (median s)':44} {statistics.median(seconds):10.2f}")
    print(f"{'hangdx serve RSS idle (MB)':44} {idle:10.1f}")
    print(f"{'hangdx serve RSS, ten open incidents (MB)':44} {ten:10.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
