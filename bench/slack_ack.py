"""How fast hangdx acknowledges Slack when Slack itself is slow or rate-limiting (issue 10.5).

    python bench/slack_ack.py [--requests 200] [--seconds 10]

The real Bolt app and Service (`hangdx serve`'s path: signed HTTP, a real redis-server, the incident, its thread
and the RQ queue) behind werkzeug's threaded server, in front of the Slack Web API stand-in
(tests/slack_standin.py) answering every call after 1 s, or answering 429 with `Retry-After: 1` to the first try
of each message. `/diagnose` requests for 50 jobs from 3 people (so most of them join an incident, and a person's join is
said once) arrive evenly over
`--seconds`. Slack gives up on an answer after 3 s and shows the user an error: every one must be acked before.
Two more rows (issue 21.6): `/diagnose status` whose answer goes to a response_url taking 5 s, and 10 slash commands
while 40 alerts arrive with chat.postMessage answering 429.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from urllib.parse import urlencode

import requests
from slack_sdk.signature import SignatureVerifier
from werkzeug.serving import make_server

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "tests" / "bot"))
from slack_standin import SlackStandin  # noqa: E402
from test_incidents import start_redis, stop_redis  # noqa: E402

from hangdx.bot.config import BotConfig  # noqa: E402
from hangdx.bot.incidents import connect  # noqa: E402
from hangdx.bot.service import Service, slack_client  # noqa: E402
from hangdx.bot.slack.app import build_app  # noqa: E402

SECRET = "8f742231b10e8888abcd99yyyzzz85a5"
SLACK_LIMIT = 3.0


def _slash(url: str, job: str, user: str, respond: str = "http://127.0.0.1:9/respond") -> float:
    body = urlencode(
        {"command": "/diagnose", "text": job, "user_id": user, "channel_id": "C0ONCALL01", "team_id": "T0HANGDX1",
         "response_url": respond, "trigger_id": f"{time.time_ns()}.1.2"}
    )  # fmt: skip
    stamp = str(int(time.time()))
    sig = SignatureVerifier(SECRET).generate_signature(timestamp=stamp, body=body)
    headers = {"Content-Type": "application/x-www-form-urlencoded", "X-Slack-Request-Timestamp": stamp,
               "X-Slack-Signature": sig}  # fmt: skip
    t0 = time.monotonic()
    try:
        r = requests.post(url + "/slack/events", data=body, headers=headers, timeout=30)
        ok = r.status_code == 200
    except requests.RequestException:
        ok = False
    took = time.monotonic() - t0
    return took if ok else float("inf")


ALERT_TOKEN = "alert-token-0123456789abcdef"


def _alerts(url: str, n: int) -> None:
    """n alerts for n jobs, one after another, as Alertmanager sends them."""
    for i in range(n):
        requests.post(url + "/alerts", json={"job_id": f"storm-{i}", "summary": "stalled"}, timeout=60,
                      headers={"Authorization": f"Bearer {ALERT_TOKEN}"})  # fmt: skip


def scenario(
    name: str, redis_url: str, n: int, seconds: float, setup, text=None, respond=None, alerts: int = 0
) -> dict:
    connect(redis_url).flushdb()
    with SlackStandin() as slack:
        setup(slack)
        cfg = BotConfig(bot_token="xoxb-1111-2222-hangdxtest", signing_secret=SECRET, api_url=slack.url,
                        redis_url=redis_url, alert_channel="C0ONCALL01", alert_token=ALERT_TOKEN)  # fmt: skip
        service = Service(cfg, client=slack_client(cfg))
        _, flask_app = build_app(cfg, service.submit, service.on_action, service.report, store=service.store)
        server = make_server("127.0.0.1", 0, flask_app, threaded=True)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        url = f"http://127.0.0.1:{server.server_port}"
        times: list[float] = []
        storm = threading.Thread(target=_alerts, args=(url, alerts), daemon=True)
        try:
            if alerts:
                storm.start()
                time.sleep(0.5)
            with ThreadPoolExecutor(max_workers=64) as pool:
                futures = []
                for i in range(n):
                    what = text or f"bench-{i % 50}"
                    where = respond(slack) if respond else "http://127.0.0.1:9/respond"
                    futures.append(pool.submit(_slash, url, what, f"U0USER{i % 3:04d}", where))
                    time.sleep(seconds / n)
                times = [f.result() for f in futures]
        finally:
            service.settle()  # the "joined" lines are said after the requests were taken
            server.shutdown()
            server.server_close()
        joins = sum(
            "joined this incident" in c.body.get("text", "") for c in slack.calls_to("chat.postMessage")
        )
    done = sorted(t for t in times if t != float("inf"))
    p99 = done[int(0.99 * (len(done) - 1))] if done else float("nan")
    return {
        "scenario": name,
        "requests": n,
        "acked in 3 s": sum(t < SLACK_LIMIT for t in times),
        "p50 s": statistics.median(done) if done else float("nan"),
        "p99 s": p99,
        "max s": max(done) if done else float("nan"),
        "join posts tried": joins,
    }


def main() -> int:
    import logging

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--seconds", type=float, default=10.0)
    args = ap.parse_args()

    def slow(slack: SlackStandin) -> None:
        slack.delay = 1.0

    def slow5(slack: SlackStandin) -> None:
        slack.respond_delay = 5.0

    def limited_2(slack: SlackStandin) -> None:
        slack.fail("chat.postMessage", status=429, retry_after=2, times=1000)

    def limited(slack: SlackStandin) -> None:
        for method in ("chat.postMessage", "chat.postEphemeral", "chat.update"):
            slack.fail(method, status=429, retry_after=1, times=args.requests)

    with tempfile.TemporaryDirectory() as tmp:
        proc, url = start_redis(tmp)
        try:
            rows = [
                scenario("Slack answers at once", url, args.requests, args.seconds, lambda s: None),
                scenario("Slack answers in 1 s", url, args.requests, args.seconds, slow),
                scenario("Slack 429, Retry-After: 1", url, args.requests, args.seconds, limited),
                # Issue 21.6: `status` whose answer goes to a response_url that takes 5 s; slash commands while 40
                # alerts arrive and chat.postMessage answers 429 (their threads' parents wait on Slack).
                scenario("status, response_url 5 s", url, args.requests, args.seconds, slow5, text="status",
                         respond=lambda s: s.root + "respond/T0HANGDX1/1/x"),
                scenario("40 alerts, Slack 429", url, 10, 10.0, limited_2, alerts=40),
            ]  # fmt: skip
        finally:
            stop_redis(proc)
    cols = list(rows[0])
    print(" | ".join(f"{c:>26}" if i == 0 else f"{c:>12}" for i, c in enumerate(cols)))
    print("-" * (29 + 15 * (len(cols) - 1)))
    for r in rows:
        cells = [f"{r[c]:>26}" if i == 0 else (f"{r[c]:>12.2f}" if isinstance(r[c], float) else f"{r[c]:>12}")
                 for i, c in enumerate(cols)]  # fmt: skip
        print(" | ".join(cells))
    return 0 if all(r["acked in 3 s"] == r["requests"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
