"""Hostile Slack requests against the live bot (tests/abuse/harness.py): replays, Slack's own retries, hostile
job ids at every entry point, buttons pressed by the wrong people, in the wrong channel or for another job, and
payloads Slack would never send. Each is refused with one line (or a 4xx), nothing is queued or changed in
Redis, nothing is posted in a thread, and nothing lands in the log at ERROR or as a traceback."""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Iterator
from urllib.parse import urlencode

import pytest
import redis
import requests
from werkzeug.serving import make_server

from hangdx.bot.slack.app import build_app
from hangdx.bot.slack.http import SIGNATURE_MARGIN, SIGNATURE_WINDOW, SeenRequests

from .harness import (
    CHANNEL,
    HOSTILE_JOB_IDS,
    INTRUDER,
    ONCALL,
    OUTSIDE,
    LiveBot,
    assert_no_traceback,
    live_bot,
    one_line,
    signature,
    snapshot,
)

FORM = "application/x-www-form-urlencoded"


@pytest.fixture
def bot(redis_url: str, caplog: pytest.LogCaptureFixture) -> Iterator[LiveBot]:
    caplog.set_level(logging.INFO)
    with live_bot(redis_url) as b:
        yield b


# -- replays ---------------------------------------------------------------------------------------------


def test_a_replayed_slash_command_is_refused_and_acted_on_once(bot: LiveBot, caplog) -> None:
    body, headers = bot.signed_request(bot.command_body("replay-1"), FORM)
    first = bot.send(body, headers)
    assert first.status_code == 200 and first.json()["text"] == "Diagnosing job replay-1…"
    assert bot.wait(lambda: bot.queued() == ["replay-1"])  # queued just after the ack
    again = bot.send(body, headers)  # the same bytes, timestamp and signature, within the 5 minutes
    assert again.status_code == 401
    assert "replayed" in one_line(again)
    time.sleep(0.3)
    assert bot.queued() == ["replay-1"]
    inc = bot.service.store.get("replay-1")
    assert [e["event"] for e in inc.timeline] == ["opened"]
    bot.service.settle()
    assert len([c for c in bot.slack.calls_to("chat.postMessage") if not c.body.get("thread_ts")]) == 1
    # Remembered in Redis until the timestamp can no longer pass Slack's 5-minute check.
    ttl = bot.conn.ttl("hangdx:seen:slack-sig:" + headers["X-Slack-Signature"])
    assert SIGNATURE_WINDOW < ttl <= SIGNATURE_WINDOW + SIGNATURE_MARGIN
    assert_no_traceback(caplog.records)


def test_a_replayed_button_press_is_acted_on_once(bot: LiveBot) -> None:
    bot.incident_with_verdict("replay-2", "1700000100.000100")
    body, headers = bot.signed_request(bot.press_body("ack", "replay-2", thread_ts="1700000100.000100"), FORM)
    assert bot.send(body, headers).status_code == 200
    assert bot.wait(lambda: bot.service.store.get("replay-2").status == "acknowledged")
    before = snapshot(bot.conn)
    again = bot.send(body, headers)
    assert again.status_code == 401 and "replayed" in one_line(again)
    time.sleep(0.3)
    assert snapshot(bot.conn) == before
    acks = [e for e in bot.service.store.get("replay-2").timeline if e["event"] == "acknowledged"]
    assert len(acks) == 1
    assert len([p for p in bot.thread_posts() if "ack" in p.get("text", "")]) == 1


def test_a_replay_to_another_bot_process_is_refused_too(bot: LiveBot) -> None:
    """Two `hangdx serve` behind one load balancer share the memory of what they acted on (Redis)."""
    _, other = build_app(bot.service.cfg, bot.service.submit, bot.service.on_action, store=bot.service.store)
    server = make_server("127.0.0.1", 0, other, threaded=True)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        body, headers = bot.signed_request(bot.command_body("replay-3"), FORM)
        assert bot.send(body, headers).status_code == 200
        assert bot.wait(lambda: bot.queued() == ["replay-3"])
        url = f"http://127.0.0.1:{server.server_port}/slack/events"
        r = requests.post(url, data=body, headers=headers, timeout=10)
        assert r.status_code == 401 and "replayed" in one_line(r)
    finally:
        server.shutdown()
        server.server_close()
    assert bot.queued() == ["replay-3"]


def test_slacks_own_retries_of_an_event_get_200_and_no_effect(bot: LiveBot, caplog, hostile_inputs) -> None:
    """Slack retries an event delivery (X-Slack-Retry-Num) as a new request, newly stamped and signed, with
    the same event_id; an exact copy of the first delivery may come too. Both: 200, acted on once."""
    body = bot.mention_body("diagnose retry-4", event_id="Ev0RETRY0004")
    stamp = int(time.time()) - 2
    raw, headers = bot.signed_request(body, "application/json", ts=stamp)
    assert bot.send(raw, headers).status_code == 200
    assert bot.wait(lambda: bot.queued() == ["retry-4"])
    retried = dict(headers, **{"X-Slack-Retry-Num": "1", "X-Slack-Retry-Reason": "http_timeout"})
    retried["X-Slack-Request-Timestamp"] = str(stamp + 1)
    retried["X-Slack-Signature"] = signature(body, str(stamp + 1))
    r = bot.send(raw, retried)
    assert r.status_code == 200 and r.text == ""
    copy = dict(headers, **{"X-Slack-Retry-Num": "2", "X-Slack-Retry-Reason": "http_error"})
    assert bot.send(raw, copy).status_code == 200
    time.sleep(0.5)
    assert bot.queued() == ["retry-4"]
    assert len([t for t in bot.ephemerals_to(ONCALL) if "Diagnosing job retry-4" in t]) == 1
    assert [e["event"] for e in bot.service.store.get("retry-4").timeline] == ["opened"]
    hostile_inputs.tried(3)  # a re-signed retry, an exact copy with a retry header, a forged retry
    # A retry header does not excuse a bad signature.
    forged = dict(retried, **{"X-Slack-Signature": signature(body, str(stamp + 1), secret="not-the-secret")})
    assert bot.send(raw, forged).status_code == 401
    assert_no_traceback(caplog.records)


def test_the_replay_memory_works_without_redis() -> None:
    down = redis.Redis(host="127.0.0.1", port=9, socket_connect_timeout=0.2)  # nothing listens on port 9
    seen = SeenRequests(down)
    assert seen.first("slack-sig:v0=abc", 330) is True
    assert seen.first("slack-sig:v0=abc", 330) is False
    assert seen.first("slack-sig:v0=def", 330) is True


# -- hostile job ids at every entry point ----------------------------------------------------------------


@pytest.mark.parametrize("job", HOSTILE_JOB_IDS)
def test_a_hostile_job_id_is_refused_at_every_entry_point(
    bot: LiveBot, caplog, hostile_inputs, job: str
) -> None:
    hostile_inputs.tried(9)  # slash, mention, five buttons, two alert forms
    bot.incident_with_verdict("good-1", "1700000100.000100")
    before = snapshot(bot.conn)

    r = bot.command(job)  # /diagnose <job>
    assert r.status_code == 200 and r.json()["response_type"] == "ephemeral"
    assert "is not a job id" in one_line(r)

    assert bot.mention(f"diagnose {job}").status_code == 200  # @hangdx diagnose <job>
    for action in ("rerun", "ack", "resolve", "stacks", "handoff"):  # a forged button value
        assert bot.press(action, job, thread_ts="1700000100.000100").status_code == 200

    assert bot.wait(lambda: len([t for t in bot.ephemerals_to(ONCALL) if "is not a job id" in t]) == 6)
    refusals = [t for t in bot.ephemerals_to(ONCALL) if "is not a job id" in t]
    assert all(
        "\n" not in t and "<!" not in t for t in refusals
    )  # one line; a quoted <!channel> pings nobody

    r = bot.alert(json.dumps({"job_id": job, "summary": "stuck"}))
    assert r.status_code == 400 and "is not a job id" in one_line(r)
    alertmanager = {"alerts": [{"status": "firing", "labels": {"alertname": "Stuck", "slurm_job_id": job}}]}
    r = bot.alert(json.dumps(alertmanager))
    assert r.status_code == 400 and "is not a job id" in one_line(r)

    time.sleep(0.2)
    assert bot.queued() == [] and bot.incidents() == ["good-1"]
    assert snapshot(bot.conn) == before
    assert bot.thread_posts() == []
    assert_no_traceback(caplog.records)


def test_a_button_naming_another_job_than_its_thread_is_refused(bot: LiveBot, hostile_inputs) -> None:
    hostile_inputs.tried(10)
    bot.incident_with_verdict("job-a", "1700000100.000100")
    bot.incident_with_verdict("job-b", "1700000999.000900")
    before = snapshot(bot.conn)
    for action in ("rerun", "ack", "resolve", "stacks", "handoff"):
        # A press under job-a's verdict whose value says job-b; and one for a job with no incident at all.
        assert bot.press(action, "job-b", thread_ts="1700000100.000100").status_code == 200
        assert bot.press(action, "job-nowhere", thread_ts="1700000100.000100").status_code == 200
    said = bot.wait(lambda: len(bot.ephemerals_to(ONCALL)) == 10 and bot.ephemerals_to(ONCALL))
    assert len([t for t in said if "not in the thread of job job-b's incident" in t]) == 5
    assert len([t for t in said if "no incident for job job-nowhere" in t]) == 5
    time.sleep(0.2)
    assert snapshot(bot.conn) == before
    assert bot.queued() == [] and bot.thread_posts() == []
    # The same button in its own thread works.
    assert bot.press("ack", "job-b", thread_ts="1700000999.000900").status_code == 200
    assert bot.wait(lambda: bot.service.store.get("job-b").status == "acknowledged")


# -- who may press ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("action", ["rerun", "stacks", "ack", "resolve", "handoff"])
@pytest.mark.parametrize(
    "who, where, why",
    [(INTRUDER, CHANNEL, "HANGDX_ALLOWED_USERS"), (ONCALL, OUTSIDE, "HANGDX_ALLOWED_CHANNELS")],
    ids=["user-outside-allowlist", "channel-outside-allowlist"],
)
def test_a_button_pressed_by_someone_not_allowed_changes_nothing(
    bot: LiveBot, caplog, action, who, where, why
):
    from hangdx.bot.artifacts import save_stacks

    bot.incident_with_verdict("job-7", "1700000100.000100", channel=where)
    save_stacks(
        bot.conn, "job-7", [{"host": "n1", "artifacts": [{"kind": "pyspy", "name": "s", "data": "x"}]}]
    )
    before = snapshot(bot.conn)
    r = bot.press(action, "job-7", user=who, channel=where, thread_ts="1700000100.000100")
    assert r.status_code == 200
    said = bot.wait(lambda: bot.ephemerals_to(who))
    assert len(said) == 1 and why in said[0] and "\n" not in said[0]
    time.sleep(0.3)
    assert snapshot(bot.conn) == before  # status, owner, timeline, verdicts, stacks: all as they were
    assert bot.queued() == []
    assert bot.thread_posts() == []  # nothing in the thread, no file
    assert_no_traceback(caplog.records)


def test_commands_and_mentions_outside_the_allowlists_change_nothing(bot: LiveBot, hostile_inputs) -> None:
    hostile_inputs.tried(4)
    before = snapshot(bot.conn)
    for who, where in ((INTRUDER, CHANNEL), (ONCALL, OUTSIDE)):
        r = bot.command("job-8", user=who, channel=where)
        assert r.status_code == 200 and "HANGDX_ALLOWED" in one_line(r)
        assert bot.mention("diagnose job-8", user=who, channel=where).status_code == 200
    assert bot.wait(lambda: len(bot.ephemerals_to(INTRUDER)) == 1 and len(bot.ephemerals_to(ONCALL)) == 1)
    time.sleep(0.2)
    assert snapshot(bot.conn) == before and bot.queued() == [] and bot.thread_posts() == []


# -- payloads Slack would never send ---------------------------------------------------------------------


def _payload(d: object) -> str:
    return urlencode({"payload": json.dumps(d)})


MALFORMED = [
    ("broken form encoding", "payload=%7B%22type%22%3A", FORM, 400),
    ("form of garbage", "%%%&&&==;;", FORM, 400),
    ("payload not JSON", urlencode({"payload": "{nope"}), FORM, 400),
    ("payload a JSON list", _payload([1, 2]), FORM, 400),
    ("JSON body a list", "[1, 2]", "application/json", 400),
    ("JSON body broken", "{", "application/json", 400),
    ("JSON nested 50,000 deep", "[" * 50000 + "]" * 50000, "application/json", 400),
    ("body not UTF-8", b"\xff\xfe\x00payload", FORM, 400),
    ("empty body", "", FORM, 400),
    ("block_actions without actions", _payload({"type": "block_actions", "user": {"id": ONCALL}}), FORM, 400),
    ("actions empty", _payload({"type": "block_actions", "user": {"id": ONCALL}, "actions": []}), FORM, 400),
    ("actions a string", _payload({"type": "block_actions", "actions": "hangdx_ack"}), FORM, 400),
    ("action without action_id", _payload({"type": "block_actions", "actions": [{"value": "1"}]}), FORM, 400),
    (
        "user a string",
        _payload({"type": "block_actions", "user": "U1", "actions": [{"action_id": "x"}]}),
        FORM,
        400,
    ),
    (
        "unknown action id",
        _payload({"type": "block_actions", "user": {"id": ONCALL}, "actions": [{"action_id": "rm_rf"}]}),
        FORM,
        400,
    ),
    ("unknown interaction type", _payload({"type": "view_submission", "user": {"id": ONCALL}}), FORM, 400),
    ("unknown command", urlencode({"command": "/rm", "text": "-rf /", "user_id": ONCALL}), FORM, 400),
    ("event_callback without event", json.dumps({"type": "event_callback"}), "application/json", 400),
    ("event a string", json.dumps({"type": "event_callback", "event": "x"}), "application/json", 400),
    # Events the app does not take are acknowledged (a 4xx would make Slack retry them for minutes).
    (
        "unknown event type",
        json.dumps({"type": "event_callback", "event_id": "Ev0X1", "event": {"type": "reaction_added"}}),
        "application/json",
        200,
    ),
]


@pytest.mark.parametrize("name, body, content_type, status", MALFORMED, ids=[m[0] for m in MALFORMED])
def test_a_malformed_signed_payload_gets_a_one_line_4xx(
    bot: LiveBot, caplog, name, body, content_type, status
):
    if isinstance(body, bytes):  # not UTF-8: refused before its signature is read
        stamp = str(int(time.time()))
        r = bot.send(body, {"Content-Type": content_type, "X-Slack-Request-Timestamp": stamp,
                            "X-Slack-Signature": signature("x", stamp)})  # fmt: skip
    else:
        r = bot.signed(body, content_type)
    assert r.status_code == status, r.text
    if status != 200:
        one_line(r)
    time.sleep(0.2)
    assert bot.queued() == [] and bot.incidents() == [] and bot.thread_posts() == []
    assert_no_traceback(caplog.records)


ODD = [
    ("command without user or channel", urlencode({"command": "/diagnose", "text": "job-9"}), FORM),
    (
        "huge command text",
        urlencode({"command": "/diagnose", "text": "9" * 900_000, "user_id": ONCALL, "channel_id": CHANNEL}),
        FORM,
    ),  # fmt: skip
    (
        "button without user",
        _payload({"type": "block_actions", "actions": [{"action_id": "hangdx_ack", "value": "job-9"}]}),
        FORM,
    ),  # fmt: skip
    (
        "button value an object",
        _payload(
            {
                "type": "block_actions",
                "user": {"id": ONCALL},
                "channel": {"id": CHANNEL},
                "actions": [{"action_id": "hangdx_resolve", "value": {"job": 1}}],
            }
        ),
        FORM,
    ),  # fmt: skip
    (
        "button user id a list",
        _payload(
            {
                "type": "block_actions",
                "user": {"id": [ONCALL]},
                "channel": {"id": CHANNEL},
                "actions": [{"action_id": "hangdx_ack", "value": "job-9"}],
            }
        ),
        FORM,
    ),  # fmt: skip
    (
        "mention without user",
        json.dumps(
            {
                "type": "event_callback",
                "event_id": "Ev0X2",
                "event": {"type": "app_mention", "text": "diagnose job-9"},
            }
        ),
        "application/json",
    ),  # fmt: skip
    (
        "mention text a number",
        json.dumps(
            {
                "type": "event_callback",
                "event_id": "Ev0X3",
                "event": {"type": "app_mention", "user": ONCALL, "channel": CHANNEL, "text": 5},
            }
        ),
        "application/json",
    ),  # fmt: skip
]


@pytest.mark.parametrize("name, body, content_type", ODD, ids=[o[0] for o in ODD])
def test_a_signed_payload_missing_what_it_needs_is_answered_without_effect(
    bot, caplog, name, body, content_type
):
    r = bot.signed(body, content_type)
    assert r.status_code == 200
    if r.text:
        one_line(r)
    time.sleep(0.3)
    assert bot.queued() == [] and bot.incidents() == [] and bot.thread_posts() == []
    assert_no_traceback(caplog.records)


def test_an_oversized_slack_request_is_413_in_one_line(bot: LiveBot, caplog) -> None:
    body = urlencode(
        {"command": "/diagnose", "text": "x" * 2_000_000, "user_id": ONCALL, "channel_id": CHANNEL}
    )
    r = bot.signed(body, FORM)
    assert r.status_code == 413 and "request body over" in one_line(r)
    assert bot.queued() == []
    assert_no_traceback(caplog.records)


@pytest.mark.parametrize(
    "stamp", ["", "abc", "1e9", "-1", "99999999999999999999", "1700000000.5", "0x6553F100"]
)
def test_a_bad_timestamp_header_is_401_not_500(bot: LiveBot, caplog, stamp: str) -> None:
    body = bot.command_body("job-10")
    headers = {
        "Content-Type": FORM,
        "X-Slack-Request-Timestamp": stamp,
        "X-Slack-Signature": "v0=" + "0" * 64,
    }
    r = bot.send(body.encode(), headers)
    assert r.status_code == 401 and one_line(r)
    assert bot.queued() == []
    assert_no_traceback(caplog.records)
