"""`/diagnose status`, `/diagnose handoff`, their Block Kit builders and the daily hand-off scheduler.

The Slack side is the real Bolt app over signed HTTP on 127.0.0.1, with request shapes and signatures made as
in tests/bot/test_slack_app.py (Slack's slash command form fields and event_callback envelope; signatures by
slack_sdk's SignatureVerifier). The Slack Web API and response_url are tests/slack_standin.py. Incidents are
`Incident.to_dict()` holding a real verdict: the engine on the recorded torch log of tests/bot/test_blocks.py.
"""

from __future__ import annotations

import copy
import json
import sys
import threading
import time
from collections.abc import Iterator
from datetime import datetime, timedelta, timezone
from pathlib import Path
from urllib.parse import urlencode

import pytest
import requests
from slack_sdk.signature import SignatureVerifier
from werkzeug.serving import make_server

from hangdx.bot.config import BotConfig, ConfigError
from hangdx.bot.incidents import Incident
from hangdx.bot.schedule import HandoffScheduler, next_run
from hangdx.bot.server import post_handoff
from hangdx.bot.slack.app import build_app
from hangdx.bot.slack.blocks import BLOCKS_MAX, HEADER_MAX, SECTION_MAX, handoff_blocks, status_blocks
from hangdx.playbooks import engine
from hangdx.probes.bundle import evidence_from_paths

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from slack_standin import BOT_USER_ID, SlackStandin  # noqa: E402

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "torch_log" / "ddp_unused_info.log"
SECRET = "8f742231b10e8888abcd99yyyzzz85a5"
LEAKED = "xoxb-999988887777-leakedtokenvalue"
ONCALL = "U0ONCALL01"
INTRUDER = "U0INTRUDER"
CHANNEL = "C0ONCALL01"
NOW = 1_700_000_000.0
RESPONSE_URL_PATH = "respond/T0HANGDX1/5678/efgh"


@pytest.fixture(scope="module")
def incidents() -> list[dict]:
    """Two open incidents: 12345 diagnosed (a secret leaked into its summary), 777 still investigating."""
    ev = evidence_from_paths([str(FIXTURE)])
    ev.job_id = "12345"
    verdict = engine.run(ev).to_dict()
    verdict["root_cause"]["summary"] += f" SLACK_BOT_TOKEN={LEAKED}"
    verdict["findings"][0]["summary"] = verdict["root_cause"]["summary"]
    diagnosed = Incident(
        job_id="12345",
        status="acknowledged",
        created=NOW - 2 * 3600 - 5 * 60,
        updated=NOW,
        channel="C0ALERTS01",
        thread_ts="1700000000.000100",
        owner=ONCALL,
        verdicts=[verdict],
    )
    fresh = Incident(job_id="777", status="investigating", created=NOW - 90, updated=NOW)
    return [diagnosed.to_dict(), fresh.to_dict()]


def _text(blocks: list[dict]) -> str:
    return json.dumps(blocks, ensure_ascii=False)


# -- the builders ---------------------------------------------------------------------------------


def test_status_blocks_list_each_open_incident(incidents: list[dict]) -> None:
    blocks = status_blocks(incidents, now=NOW)
    assert blocks[0]["text"]["text"] == "hangdx status: 2 open incidents"
    first, second = blocks[1]["text"]["text"], blocks[2]["text"]["text"]
    assert "*Job 12345*: acknowledged, open 2h 5m" in first
    assert "<https://slack.com/app_redirect?channel=C0ALERTS01&message_ts=1700000000.000100|thread>" in first
    assert f"Owner: <@{ONCALL}>" in first
    assert "Root cause: `ddp_unused_parameters`, culprit rank 1" in first
    assert "*Job 777*: investigating, open 1m" in second
    assert "Owner: nobody yet" in second and "no verdict yet" in second and "thread" not in second


def test_handoff_blocks_carry_summary_and_next_steps(incidents: list[dict]) -> None:
    text = _text(handoff_blocks(incidents, now=NOW))
    assert "On-call hand-off: 2 open incidents" in text
    assert "DDP is waiting for gradients that rank 1 never produced" in text
    assert "Next steps:" in text and "TORCH_DISTRIBUTED_DEBUG=DETAIL" in text
    assert "run `/diagnose 777`" in text


@pytest.mark.parametrize("build", [status_blocks, handoff_blocks])
def test_secrets_are_redacted_and_mrkdwn_escaped(incidents: list[dict], build) -> None:
    nasty = copy.deepcopy(incidents)
    nasty[1]["job_id"] = "<!channel>"
    nasty[1]["owner"] = "<!here> eve"
    text = _text(build(nasty, now=NOW))
    assert LEAKED not in text
    assert "<!channel>" not in text and "<!here>" not in text
    if build is handoff_blocks:
        assert "SLACK_BOT_TOKEN=[REDACTED]" in text


@pytest.mark.parametrize("build", [status_blocks, handoff_blocks])
def test_no_open_incidents(build) -> None:
    blocks = build([], now=NOW)
    assert [b["type"] for b in blocks] == ["header", "section"]
    assert blocks[1]["text"]["text"] == "No open incidents."


@pytest.mark.parametrize("build", [status_blocks, handoff_blocks])
def test_many_long_incidents_stay_within_slack_limits(incidents: list[dict], build) -> None:
    many = []
    for i in range(120):
        inc = copy.deepcopy(incidents[0])
        inc["job_id"] = f"job-{i}-" + "x" * 400
        inc["verdicts"][0]["root_cause"]["summary"] = "y" * 5000
        inc["verdicts"][0]["findings"][0]["next_steps"] = ["z" * 2000] * 20
        many.append(inc)
    blocks = build(many, now=NOW)
    assert len(blocks) <= BLOCKS_MAX
    assert len(blocks[0]["text"]["text"]) <= HEADER_MAX
    assert all(len(b["text"]["text"]) <= SECTION_MAX for b in blocks if b["type"] == "section")
    assert "80 more open incidents not shown" in blocks[-1]["elements"][0]["text"]


# -- the slash command and mentions over signed HTTP ------------------------------------------------


class Bot:
    def __init__(self, url: str, slack: SlackStandin, asked: list[str]) -> None:
        self.url, self.slack, self.asked = url, slack, asked

    def signed(self, body: str, content_type: str) -> requests.Response:
        stamp = str(int(time.time()))
        sig = SignatureVerifier(SECRET).generate_signature(timestamp=stamp, body=body)
        headers = {"Content-Type": content_type, "X-Slack-Request-Timestamp": stamp, "X-Slack-Signature": sig}
        return requests.post(self.url + "/slack/events", data=body.encode(), headers=headers, timeout=10)

    def command(self, text: str, user: str = ONCALL) -> requests.Response:
        form = {
            "token": "gIkuvaNzQIHg97ATvDxqgjtO",
            "team_id": "T0HANGDX1",
            "team_domain": "hangdx-test",
            "channel_id": CHANNEL,
            "channel_name": "oncall-training",
            "user_id": user,
            "user_name": "oncall",
            "command": "/diagnose",
            "text": text,
            "api_app_id": "A0HANGDX01",
            "is_enterprise_install": "false",
            "response_url": self.slack.root + RESPONSE_URL_PATH,
            "trigger_id": "13345224609.738474920.8088930838d88f008e0",
        }
        return self.signed(urlencode(form), "application/x-www-form-urlencoded")

    def mention(self, text: str, user: str = ONCALL) -> requests.Response:
        envelope = {
            "token": "gIkuvaNzQIHg97ATvDxqgjtO",
            "team_id": "T0HANGDX1",
            "api_app_id": "A0HANGDX01",
            "event": {
                "type": "app_mention",
                "user": user,
                "text": text,
                "ts": "1700000123.000200",
                "channel": CHANNEL,
                "event_ts": "1700000123.000200",
            },
            "type": "event_callback",
            "event_id": f"Ev{time.monotonic_ns()}",
            "event_time": 1700000123,
            "authorizations": [
                {"enterprise_id": None, "team_id": "T0HANGDX1", "user_id": BOT_USER_ID, "is_bot": True}
            ],
        }
        return self.signed(json.dumps(envelope), "application/json")

    def responses(self, start: int) -> list[dict]:
        return [c.body for c in self.slack.calls_to(RESPONSE_URL_PATH)[start:]]

    def wait(self, cond, timeout: float = 5.0):
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            got = cond()
            if got:
                return got
            time.sleep(0.02)
        raise AssertionError("timed out")


@pytest.fixture(scope="module")
def bot(incidents: list[dict]) -> Iterator[Bot]:
    asked: list[str] = []

    # What the lead's Service.report does, with a fixed list instead of store.list_open().
    def report(kind: str) -> tuple[str, list[dict]]:
        asked.append(kind)
        build = status_blocks if kind == "status" else handoff_blocks
        return f"hangdx {kind}: {len(incidents)} open incidents", build(incidents, now=NOW)

    with SlackStandin() as slack:
        env = {
            "SLACK_BOT_TOKEN": "xoxb-1111-2222-hangdxtest",
            "SLACK_SIGNING_SECRET": SECRET,
            "SLACK_API_URL": slack.url,
            "HANGDX_ALLOWED_USERS": ONCALL,
        }
        _, flask_app = build_app(BotConfig.from_env(env), lambda req: "q", None, report)
        server = make_server("127.0.0.1", 0, flask_app, threaded=True)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        try:
            yield Bot(f"http://127.0.0.1:{server.server_port}", slack, asked)
        finally:
            server.shutdown()
            server.server_close()


def test_slash_status_answers_ephemerally_with_the_open_incidents(bot: Bot) -> None:
    start = len(bot.slack.calls_to(RESPONSE_URL_PATH))
    assert bot.command("status").status_code == 200
    said = bot.wait(lambda: bot.responses(start))[0]
    assert said["response_type"] == "ephemeral"
    text = _text(said["blocks"])
    assert "*Job 12345*" in text and "*Job 777*" in text and "culprit rank 1" in text
    assert LEAKED not in json.dumps(said)


def test_slash_handoff_posts_in_channel_with_next_steps(bot: Bot) -> None:
    start = len(bot.slack.calls_to(RESPONSE_URL_PATH))
    assert bot.command("HANDOFF").status_code == 200
    said = bot.wait(lambda: bot.responses(start))[0]
    assert said["response_type"] == "in_channel"
    text = _text(said["blocks"])
    assert "12345" in text and "rank 1" in text and "TORCH_DISTRIBUTED_DEBUG=DETAIL" in text
    assert LEAKED not in json.dumps(said) and "[REDACTED]" in text


def test_user_outside_allowlist_gets_no_report(bot: Bot) -> None:
    before, start = len(bot.asked), len(bot.slack.calls_to(RESPONSE_URL_PATH))
    r = bot.command("status", user=INTRUDER)
    assert r.status_code == 200 and "HANGDX_ALLOWED_USERS" in r.json()["text"]
    bot.mention(f"<@{BOT_USER_ID}> handoff", user=INTRUDER)
    bot.wait(
        lambda: any(
            c.body.get("user") == INTRUDER and "HANGDX_ALLOWED_USERS" in c.body.get("text", "")
            for c in bot.slack.calls_to("chat.postEphemeral")
        )
    )
    time.sleep(0.2)
    assert len(bot.asked) == before and bot.responses(start) == []


def test_mention_status_is_ephemeral_and_handoff_is_posted(bot: Bot) -> None:
    bot.mention(f"<@{BOT_USER_ID}> status")
    eph = bot.wait(
        lambda: [
            c.body
            for c in bot.slack.calls_to("chat.postEphemeral")
            if "Job 12345" in str(c.body.get("blocks"))
        ]
    )[0]
    assert eph["user"] == ONCALL and eph["channel"] == CHANNEL
    bot.mention(f"<@{BOT_USER_ID}> handoff")
    post = bot.wait(
        lambda: [
            c.body for c in bot.slack.calls_to("chat.postMessage") if "hand-off" in str(c.body.get("blocks"))
        ]
    )[0]
    assert post["channel"] == CHANNEL and "TORCH_DISTRIBUTED_DEBUG=DETAIL" in str(post["blocks"])


def test_scheduled_post_goes_to_the_handoff_channel(incidents: list[dict]) -> None:
    from slack_sdk import WebClient

    with SlackStandin() as slack:
        client = WebClient(token="xoxb-1111-2222-hangdxtest", base_url=slack.url)
        post_handoff(client, "C0HANDOFF1", lambda kind: ("hand-off", handoff_blocks(incidents, now=NOW)))
        body = slack.calls_to("chat.postMessage")[0].body
    assert body["channel"] == "C0HANDOFF1" and "12345" in str(body["blocks"])


# -- configuration and the scheduler ------------------------------------------------------------------


def test_handoff_settings() -> None:
    cfg = BotConfig.from_env({"HANGDX_ALERT_CHANNEL": "C0ALERTS01", "HANGDX_HANDOFF_TIME": "08:30"})
    assert (cfg.handoff_time, cfg.handoff_channel) == ("08:30", "C0ALERTS01")
    cfg = BotConfig.from_env({"HANGDX_ALERT_CHANNEL": "C0ALERTS01", "HANGDX_HANDOFF_CHANNEL": "C0HANDOFF1"})
    assert (cfg.handoff_time, cfg.handoff_channel) == (None, "C0HANDOFF1")
    for bad in ("8:30", "24:00", "12:60", "noon", "08:30:00"):
        with pytest.raises(ConfigError, match="HANGDX_HANDOFF_TIME"):
            BotConfig.from_env({"HANGDX_ALERT_CHANNEL": "C0ALERTS01", "HANGDX_HANDOFF_TIME": bad})
    with pytest.raises(ConfigError, match="HANGDX_HANDOFF_CHANNEL"):
        BotConfig.from_env({"HANGDX_HANDOFF_CHANNEL": "#oncall"})
    with pytest.raises(ConfigError, match="HANGDX_HANDOFF_TIME is set but"):
        BotConfig.from_env({"HANGDX_HANDOFF_TIME": "08:30"})


UTC = timezone.utc


@pytest.mark.parametrize(
    ("now", "hhmm", "expected"),
    [
        (datetime(2024, 5, 1, 7, 0, tzinfo=UTC), "08:30", datetime(2024, 5, 1, 8, 30, tzinfo=UTC)),
        (datetime(2024, 5, 1, 9, 0, tzinfo=UTC), "08:30", datetime(2024, 5, 2, 8, 30, tzinfo=UTC)),
        # Exactly at HH:MM: strictly after, so a post is never made twice.
        (datetime(2024, 5, 1, 8, 30, tzinfo=UTC), "08:30", datetime(2024, 5, 2, 8, 30, tzinfo=UTC)),
        (
            datetime(2024, 5, 1, 8, 29, 59, 999999, tzinfo=UTC),
            "08:30",
            datetime(2024, 5, 1, 8, 30, tzinfo=UTC),
        ),
        # Month, leap-day and year ends.
        (datetime(2024, 2, 28, 23, 59, tzinfo=UTC), "00:00", datetime(2024, 2, 29, 0, 0, tzinfo=UTC)),
        (datetime(2023, 12, 31, 23, 59, tzinfo=UTC), "23:59", datetime(2024, 1, 1, 23, 59, tzinfo=UTC)),
        # A naive time is UTC; another zone is converted (09:00 at UTC+2 is 07:00 UTC).
        (datetime(2024, 5, 1, 7, 0), "08:30", datetime(2024, 5, 1, 8, 30, tzinfo=UTC)),
        (
            datetime(2024, 5, 1, 9, 0, tzinfo=timezone(timedelta(hours=2))),
            "08:30",
            datetime(2024, 5, 1, 8, 30, tzinfo=UTC),
        ),
    ],
)
def test_next_run(now: datetime, hhmm: str, expected: datetime) -> None:
    assert next_run(now, hhmm) == expected


@pytest.mark.parametrize("bad", ["8:30", "25:00", "", "08:30pm"])
def test_next_run_rejects_bad_times(bad: str) -> None:
    with pytest.raises(ValueError):
        next_run(datetime(2024, 5, 1, tzinfo=UTC), bad)


class FakeClock:
    def __init__(self, start: datetime) -> None:
        self.now, self.lock = start, threading.Lock()

    def __call__(self) -> datetime:
        with self.lock:
            return self.now

    def set(self, t: datetime) -> None:
        with self.lock:
            self.now = t


def _wait(cond, timeout: float = 5.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.01)
    return False


def test_scheduler_posts_once_when_the_time_comes_and_again_next_day() -> None:
    clock = FakeClock(datetime(2024, 5, 1, 8, 0, tzinfo=UTC))
    posts: list[datetime] = []
    cfg = BotConfig(handoff_time="08:30", handoff_channel="C0HANDOFF1")
    sched = HandoffScheduler(cfg, lambda: posts.append(clock()), clock=clock, tick=0.01).start()
    try:
        assert _wait(lambda: sched.next_at == datetime(2024, 5, 1, 8, 30, tzinfo=UTC))
        clock.set(datetime(2024, 5, 1, 8, 29, 59, tzinfo=UTC))
        time.sleep(0.1)
        assert posts == []
        clock.set(datetime(2024, 5, 1, 8, 30, tzinfo=UTC))
        assert _wait(lambda: len(posts) == 1)
        time.sleep(0.1)
        assert len(posts) == 1 and sched.next_at == datetime(2024, 5, 2, 8, 30, tzinfo=UTC)
        # Three days asleep: one post on waking, not one per missed day.
        clock.set(datetime(2024, 5, 4, 12, 0, tzinfo=UTC))
        assert _wait(lambda: len(posts) == 2)
        time.sleep(0.1)
        assert len(posts) == 2 and sched.next_at == datetime(2024, 5, 5, 8, 30, tzinfo=UTC)
    finally:
        sched.stop()


def test_a_failing_post_does_not_stop_the_scheduler() -> None:
    clock = FakeClock(datetime(2024, 5, 1, 8, 0, tzinfo=UTC))
    calls: list[int] = []

    def post() -> None:
        calls.append(1)
        raise ConnectionError("redis down")

    sched = HandoffScheduler(BotConfig(handoff_time="08:30"), post, clock=clock, tick=0.01).start()
    try:
        clock.set(datetime(2024, 5, 1, 8, 31, tzinfo=UTC))
        assert _wait(lambda: len(calls) == 1)
        clock.set(datetime(2024, 5, 2, 8, 31, tzinfo=UTC))
        assert _wait(lambda: len(calls) == 2)
    finally:
        sched.stop()


def test_stop_wakes_a_sleeping_scheduler_at_once() -> None:
    # Real clock and the default one-minute tick: stop() must not wait for either.
    sched = HandoffScheduler(BotConfig(handoff_time="00:00"), lambda: None).start()
    time.sleep(0.05)
    t0 = time.monotonic()
    sched.stop()
    assert time.monotonic() - t0 < 1.0
    assert sched._thread is None


def test_slack_app_manifest_points_everything_at_slack_events() -> None:
    yaml = pytest.importorskip("yaml")
    m = yaml.safe_load(
        (Path(__file__).resolve().parents[2] / "deploy" / "slack-app-manifest.yaml").read_text()
    )
    url = "https://hangdx.example.com/slack/events"
    (cmd,) = m["features"]["slash_commands"]
    assert (cmd["command"], cmd["url"], cmd["usage_hint"]) == (
        "/diagnose",
        url,
        "<jobid> | status | handoff | history <host|job> | help",
    )
    assert m["settings"]["event_subscriptions"] == {"request_url": url, "bot_events": ["app_mention"]}
    assert m["settings"]["interactivity"] == {"is_enabled": True, "request_url": url}
    assert m["settings"]["socket_mode_enabled"] is False
    assert set(m["oauth_config"]["scopes"]["bot"]) == {
        "commands",
        "chat:write",
        "chat:write.public",
        "app_mentions:read",
        "files:write",
        "files:read",
        "channels:history",
        "groups:history",
        "users:read",
        "usergroups:read",
    }
    from hangdx.bot.slack.shortcuts import ANALYZE

    (shortcut,) = m["features"]["shortcuts"]
    assert (shortcut["type"], shortcut["callback_id"]) == ("message", ANALYZE)
