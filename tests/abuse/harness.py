"""A live bot for abuse tests: the real Bolt/Flask app over signed HTTP on 127.0.0.1, wired to a real Service
(incidents and the RQ queue in the session's redis-server, tests/bot/test_incidents.py) and to the Slack Web API
stand-in (tests/slack_standin.py). Request shapes are those of tests/bot/test_slack_app.py (Slack's docs: slash
command form fields, block_actions `payload=`, the event_callback envelope); signatures are made with
slack_sdk's SignatureVerifier over "v0:<timestamp>:<body>", as Slack makes them."""

from __future__ import annotations

import itertools
import json
import logging
import sys
import threading
import time
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

import redis
import requests
from slack_sdk.signature import SignatureVerifier
from werkzeug.serving import make_server

from hangdx.bot.config import BotConfig
from hangdx.bot.incidents import connect
from hangdx.bot.queue import queue
from hangdx.bot.request import DiagnoseRequest
from hangdx.bot.service import Service, slack_client
from hangdx.bot.slack.app import build_app

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from slack_standin import BOT_USER_ID, SlackStandin  # noqa: E402

SECRET = "8f742231b10e8888abcd99yyyzzz85a5"
ALERT_TOKEN = "alert-token-0123456789abcdef"
BOT_TOKEN = "xoxb-1111-2222-hangdxtest"
ONCALL = "U0ONCALL01"
ONCALL2 = "U0ONCALL02"
INTRUDER = "U0INTRUDER"
CHANNEL = "C0ONCALL01"
ALERTS = "C0ALERTS01"
OUTSIDE = "C0OUTSIDE1"  # a channel outside HANGDX_ALLOWED_CHANNELS

# Job ids no entry point may accept: shell metacharacters, line breaks, NUL, options, look-alikes, mrkdwn.
HOSTILE_JOB_IDS = [
    "1; rm -rf /",
    "$(reboot)",
    "`id`",
    "a|b",
    "x && y",
    "12\n3",
    "job\r\nX-Injected: 1",
    "12\x003",
    "-oProxyCommand=sh",
    "--help",
    "１２３",  # fullwidth digits
    "12\u200b3",  # a zero-width space
    "gpu\u2011node",  # a non-breaking hyphen
    "../../etc/passwd",
    "<!channel>",
    "a" * 200,
]
_ids = itertools.count(1)


def unique(prefix: str) -> str:
    return f"{prefix}{time.monotonic_ns()}{next(_ids)}"


def signature(body: str, stamp: str, secret: str = SECRET) -> str:
    return SignatureVerifier(secret).generate_signature(timestamp=stamp, body=body)


class LiveBot:
    def __init__(self, url: str, slack: SlackStandin, service: Service) -> None:
        self.url, self.slack, self.service = url, slack, service
        self.conn: redis.Redis = service.conn

    # -- Slack's side ------------------------------------------------------------------------------

    def signed_request(
        self, body: str, content_type: str, ts: int | None = None, secret: str = SECRET
    ) -> tuple[bytes, dict[str, str]]:
        """The bytes and headers of a request as Slack signs it (to send, or to send again)."""
        stamp = str(int(time.time()) if ts is None else ts)
        headers = {
            "Content-Type": content_type,
            "X-Slack-Request-Timestamp": stamp,
            "X-Slack-Signature": signature(body, stamp, secret),
        }
        return body.encode(), headers

    def send(self, body: bytes, headers: dict[str, str]) -> requests.Response:
        return requests.post(self.url + "/slack/events", data=body, headers=headers, timeout=10)

    def signed(self, body: str, content_type: str, **kw: Any) -> requests.Response:
        return self.send(*self.signed_request(body, content_type, **kw))

    def command_body(self, text: str, user: str = ONCALL, channel: str = CHANNEL) -> str:
        return urlencode(
            {
                "token": "gIkuvaNzQIHg97ATvDxqgjtO",
                "team_id": "T0HANGDX1",
                "team_domain": "hangdx-test",
                "channel_id": channel,
                "channel_name": "oncall-training",
                "user_id": user,
                "user_name": "oncall",
                "command": "/diagnose",
                "text": text,
                "api_app_id": "A0HANGDX01",
                "is_enterprise_install": "false",
                "response_url": self.slack.root + "respond/T0HANGDX1/1234/abcd",
                "trigger_id": unique("13345224609.738474920."),  # Slack's differs on every request
            }
        )

    def command(self, text: str, user: str = ONCALL, channel: str = CHANNEL) -> requests.Response:
        return self.signed(self.command_body(text, user, channel), "application/x-www-form-urlencoded")

    def mention_body(
        self,
        text: str,
        user: str = ONCALL,
        channel: str = CHANNEL,
        thread_ts: str = "1700000100.000100",
        event_id: str | None = None,
    ) -> str:
        ts = f"1700000{next(_ids):03d}.000200"
        envelope = {
            "token": "gIkuvaNzQIHg97ATvDxqgjtO",
            "team_id": "T0HANGDX1",
            "api_app_id": "A0HANGDX01",
            "event": {
                "type": "app_mention",
                "user": user,
                "text": f"<@{BOT_USER_ID}> {text}",
                "ts": ts,
                "thread_ts": thread_ts,
                "channel": channel,
                "event_ts": ts,
            },
            "type": "event_callback",
            "event_id": event_id or unique("Ev0HANGDX"),
            "event_time": int(time.time()),
            "authorizations": [
                {"enterprise_id": None, "team_id": "T0HANGDX1", "user_id": BOT_USER_ID, "is_bot": True}
            ],
        }
        return json.dumps(envelope)

    def mention(self, text: str, **kw: Any) -> requests.Response:
        return self.signed(self.mention_body(text, **kw), "application/json")

    def press_body(
        self,
        action: str,
        value: Any,
        user: str = ONCALL,
        channel: str = CHANNEL,
        thread_ts: str | None = None,
    ) -> str:
        """A block_actions payload for a button of a verdict posted in `thread_ts` (the incident's thread)."""
        message = {"type": "message", "ts": "1700000200.000300", "bot_id": "B0HANGDXBOT"}
        if thread_ts:
            message["thread_ts"] = thread_ts
        payload = {
            "type": "block_actions",
            "user": {"id": user, "username": "oncall", "name": "oncall", "team_id": "T0HANGDX1"},
            "api_app_id": "A0HANGDX01",
            "token": "gIkuvaNzQIHg97ATvDxqgjtO",
            "container": {
                "type": "message",
                "message_ts": "1700000200.000300",
                "channel_id": channel,
                "is_ephemeral": False,
            },
            "trigger_id": unique("13345224609.738474920."),
            "team": {"id": "T0HANGDX1", "domain": "hangdx-test"},
            "channel": {"id": channel, "name": "oncall-training"},
            "message": message,
            "response_url": self.slack.root + "respond/T0HANGDX1/5678/efgh",
            "actions": [
                {
                    "action_id": f"hangdx_{action}",
                    "block_id": "hangdx_actions",
                    "text": {"type": "plain_text", "text": action, "emoji": True},
                    "value": value,
                    "type": "button",
                    "action_ts": f"{time.time():.6f}",
                }
            ],
        }
        return urlencode({"payload": json.dumps(payload)})

    def press(self, action: str, value: Any, **kw: Any) -> requests.Response:
        return self.signed(self.press_body(action, value, **kw), "application/x-www-form-urlencoded")

    def alert(self, body: bytes | str, auth: str | None = "Bearer " + ALERT_TOKEN) -> requests.Response:
        headers = {"Content-Type": "application/json"}
        if auth is not None:
            headers["Authorization"] = auth
        return requests.post(self.url + "/alerts", data=body, headers=headers, timeout=30)

    # -- what a user (or the on-call lead) would check ---------------------------------------------

    def queued(self) -> list[str]:
        """Job ids of the diagnoses waiting in the RQ queue."""
        return [j.args[0]["job_id"] for j in queue(self.conn).get_jobs()]

    def incidents(self) -> list[str]:
        """Job ids of every incident kept in Redis."""
        keys = [k for k in self.conn.scan_iter("hangdx:incident:*") if self.conn.type(k) == b"hash"]
        return sorted(self.conn.hget(k, "job_id").decode() for k in keys)

    def thread_posts(self) -> list[dict]:
        """Everything the bot posted for all to see: messages and files."""
        return [
            c.body
            for c in self.slack.calls
            if c.method in ("chat.postMessage", "chat.update") or c.method.startswith(("files.", "upload/"))
        ]

    def ephemerals_to(self, user: str) -> list[str]:
        return [
            c.body.get("text", "")
            for c in self.slack.calls_to("chat.postEphemeral")
            if c.body.get("user") == user
        ]

    def wait(self, cond, timeout: float = 5.0) -> Any:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            got = cond()
            if got:
                return got
            time.sleep(0.02)
        return cond()

    def incident_with_verdict(self, job: str, thread_ts: str, channel: str = CHANNEL) -> None:
        """An incident as a finished diagnosis leaves it: a thread, a verdict with its buttons."""
        store = self.service.store
        store.open_or_join(DiagnoseRequest(job_id=job, source="slash", requested_by=ONCALL, channel=channel))
        store.set_thread(job, channel, thread_ts)
        verdict = {
            "job_id": job,
            "status": "hung",
            "root_cause": {
                "category": "conditional_collective",
                "summary": "Rank 1 skipped the allreduce the others wait in.",
                "confidence": 0.9,
                "culprit": {"ranks": [1], "hosts": ["gpu-node-03"], "gpus": [], "links": []},
                "fix": "Make every rank call the same collectives.",
            },
            "findings": [],
        }
        store.add_verdict(job, verdict)


def snapshot(conn: redis.Redis) -> dict[str, Any]:
    """Every hangdx and RQ key with its value, to show that a refused request changed nothing.
    The replay memory (hangdx:seen:*) is left out: remembering a request is not acting on it."""
    out: dict[str, Any] = {}
    for raw in conn.scan_iter("*"):
        key = raw.decode()
        if key.startswith("hangdx:seen:"):
            continue
        kind = conn.type(raw).decode()
        if kind == "string":
            out[key] = conn.get(raw)
        elif kind == "hash":
            out[key] = conn.hgetall(raw)
        elif kind == "list":
            out[key] = conn.lrange(raw, 0, -1)
        elif kind == "set":
            out[key] = sorted(conn.smembers(raw))
        elif kind == "zset":
            out[key] = conn.zrange(raw, 0, -1)
    return out


def redis_text(conn: redis.Redis) -> str:
    """Every value kept in Redis (incidents, timelines, verdicts, stacks, RQ jobs and results, zlib-compressed
    ones inflated), as one text to search for what must not be there."""
    parts: list[str] = []

    def add(value: Any) -> None:
        if isinstance(value, bytes):
            try:
                value = zlib.decompress(value)  # RQ keeps job data compressed
            except zlib.error:
                pass
            parts.append(value.decode("utf-8", "replace"))
        elif isinstance(value, (list, tuple)):
            for v in value:
                add(v)
        elif isinstance(value, dict):
            for k, v in value.items():
                add(k)
                add(v)

    for raw in conn.scan_iter("*"):
        parts.append(raw.decode("utf-8", "replace"))
        if conn.type(raw) == b"stream":
            add([fields for _, fields in conn.xrange(raw)])
    add(list(snapshot(conn).values()))
    return "\n".join(parts)


def assert_no_traceback(records: list[logging.LogRecord]) -> None:
    """Nothing logged at ERROR and no traceback: hostile input is a warning at most."""
    # Not this test's: a Socket Mode client another test left reconnecting (its thread ends with the process).
    elsewhere = (
        "Failed to check the state of sock",
        "Failed to check the current session",
        "apps.connections",
    )
    bad = [
        r
        for r in records
        if (r.levelno >= logging.ERROR or r.exc_info)
        and not (
            r.name.startswith(("slack_bolt", "slack_sdk")) and any(x in r.getMessage() for x in elsewhere)
        )
    ]
    assert not bad, [f"{r.name}: {r.getMessage()}" for r in bad]


def one_line(r: requests.Response) -> str:
    """The answer to a refused request: a JSON error or a Slack text, one line either way."""
    body = r.json()
    said = body.get("error") or body.get("text") or ""
    assert said and "\n" not in said and len(said) <= 400, said
    return said


@contextmanager
def live_bot(redis_url: str, **env: str) -> Iterator[LiveBot]:
    connect(redis_url).flushdb()
    with SlackStandin() as slack:
        settings = {
            "SLACK_BOT_TOKEN": BOT_TOKEN,
            "SLACK_SIGNING_SECRET": SECRET,
            "SLACK_API_URL": slack.url,
            "REDIS_URL": redis_url,
            "HANGDX_ALERT_TOKEN": ALERT_TOKEN,
            "HANGDX_ALERT_CHANNEL": ALERTS,
            "HANGDX_ALLOWED_USERS": f"{ONCALL},{ONCALL2}",
            "HANGDX_ALLOWED_CHANNELS": f"{CHANNEL},{ALERTS}",
            **env,
        }
        cfg = BotConfig.from_env(settings)
        service = Service(cfg, client=slack_client(cfg))
        _, flask_app = build_app(
            cfg,
            service.submit,
            service.on_action,
            service.report,
            store=service.store,
            resolution=service.resolution,  # as `hangdx serve` wires it: the Resolve dialog
        )
        server = make_server("127.0.0.1", 0, flask_app, threaded=True)
        thread = threading.Thread(target=server.serve_forever, daemon=True)
        thread.start()
        try:
            yield LiveBot(f"http://127.0.0.1:{server.server_port}", slack, service)
        finally:
            server.shutdown()
            server.server_close()
            thread.join(timeout=10)
