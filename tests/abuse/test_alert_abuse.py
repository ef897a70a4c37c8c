"""Hostile calls to POST /alerts of the live bot (tests/abuse/harness.py): credentials that are missing, wrong
or malformed, bodies that are too big, not JSON or the wrong shape, hostile job ids and host names, and an
alert storm of 10,000 alerts in one payload. The Alertmanager body is the webhook_config payload documented at
prometheus.io/docs/alerting/latest/configuration/#webhook_config (version "4")."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterator

import pytest
import requests

from hangdx.bot import alerts
from hangdx.bot.alerts import MAX_ALERT_JOBS, MAX_ALERTS, MAX_SKIPPED

from .harness import (
    ALERT_TOKEN,
    ALERTS,
    OUTSIDE,
    LiveBot,
    assert_no_traceback,
    live_bot,
    one_line,
    redis_text,
)


@pytest.fixture
def bot(redis_url: str, caplog: pytest.LogCaptureFixture) -> Iterator[LiveBot]:
    caplog.set_level(logging.INFO)
    with live_bot(redis_url) as b:
        yield b


def nothing_done(bot: LiveBot) -> None:
    assert bot.queued() == [] and bot.incidents() == [] and bot.thread_posts() == []


GOOD = json.dumps({"job_id": "tok-1", "summary": "stuck"})


@pytest.mark.parametrize(
    "auth",
    [
        None,  # missing
        "",  # empty
        "Bearer",
        "Bearer ",
        "Bearer wrong-token-0123456789",
        f"Bearer {ALERT_TOKEN}x",
        f"Bearer {ALERT_TOKEN[:-1]}",
        f"Basic {ALERT_TOKEN}",  # wrong scheme
        f"Token {ALERT_TOKEN}",
        f"{ALERT_TOKEN}",  # no scheme
        f"Bearer{ALERT_TOKEN}",
        f"Bearer {ALERT_TOKEN} {ALERT_TOKEN}",
        "Bearer " + "é" * 24,  # not ASCII
        "Bearer " + "x" * 2048,  # overlong
        "Bearer " + ALERT_TOKEN + " " * 2000,  # the right token, padded past the limit
        "Bearer " + "x" * 60_000,
    ],
    ids=lambda a: "missing" if a is None else repr(a[:30]) + (f"+{len(a) - 30}" if len(a) > 30 else ""),
)
def test_wrong_missing_or_malformed_credentials_are_401(bot: LiveBot, caplog, auth) -> None:
    r = bot.alert(GOOD, auth=auth)
    assert r.status_code == 401 and one_line(r) == "wrong or missing bearer token"
    nothing_done(bot)
    assert_no_traceback(caplog.records)


def test_the_token_in_the_url_instead_of_the_header_is_401(bot: LiveBot) -> None:
    r = requests.post(f"{bot.url}/alerts?token={ALERT_TOKEN}", data=GOOD, timeout=10)
    assert r.status_code == 401
    nothing_done(bot)


def test_the_token_is_compared_in_constant_time(bot: LiveBot, monkeypatch) -> None:
    compared: list[tuple[bytes, bytes]] = []
    real = alerts.hmac.compare_digest
    monkeypatch.setattr(alerts.hmac, "compare_digest", lambda a, b: compared.append((a, b)) or real(a, b))
    assert bot.alert(GOOD, auth="Bearer wrong-token-0123456789").status_code == 401
    assert bot.alert(GOOD, auth="bearer " + ALERT_TOKEN).status_code == 202  # the scheme is case-blind
    assert compared == [
        (b"wrong-token-0123456789", ALERT_TOKEN.encode()),
        (ALERT_TOKEN.encode(), ALERT_TOKEN.encode()),
    ]


def test_a_body_over_4_mib_that_is_no_alertmanager_group_is_413_in_one_line(
    bot: LiveBot, caplog, hostile_inputs
) -> None:
    hostile_inputs.tried(2)  # with a Content-Length, and chunked
    big = json.dumps({"job_id": "big-1", "summary": "x" * (5 << 20)})
    r = bot.alert(big)
    assert r.status_code == 413 and "request body over 4194304 bytes" == one_line(r)
    # Without a Content-Length (chunked), the body is cut off at the limit all the same.
    chunks = (b"x" * 65536 for _ in range(80))
    headers = {"Authorization": "Bearer " + ALERT_TOKEN, "Content-Type": "application/json"}
    r = requests.post(bot.url + "/alerts", data=chunks, headers=headers, timeout=30)
    assert r.status_code in (400, 413) and one_line(r)
    nothing_done(bot)


def test_an_alertmanager_group_over_the_limit_is_read_up_to_it_and_answered_2xx(bot: LiveBot) -> None:
    """Issue 11: Alertmanager does not retry a 4xx; a group too big to read whole loses nothing it could read."""
    alerts = [
        {"status": "firing", "labels": {"alertname": "GpuIdle", "hangdx_job_id": f"grp-{i % 3}",
                                        "instance": f"gpu-node-{i:04d}:9400", "pad": "p" * 2000}}
        for i in range(3000)
    ]  # fmt: skip
    body = json.dumps({"version": "4", "status": "firing", "receiver": "hangdx", "alerts": alerts,
                       "groupLabels": {}, "commonLabels": {}, "commonAnnotations": {}})  # fmt: skip
    assert len(body) > 4 << 20
    r = bot.alert(body)
    assert r.status_code == 202, r.text
    got = r.json()
    assert sorted(a["job_id"] for a in got["accepted"]) == ["grp-0", "grp-1", "grp-2"]
    assert got["skipped"][0].startswith("the group is over 4 MiB: its first ")


BAD_BODIES = [
    ("form, not JSON", b"job_id=1", "body is not JSON"),
    ("empty", b"", "body is not JSON"),
    ("broken JSON", b'{"job_id": ', "body is not JSON"),
    ("not UTF-8", b"\xff\xfe{}", "body is not JSON"),
    ("nested 100,000 deep", b"[" * 100_000 + b"]" * 100_000, "body is not JSON"),
    ("a list", b"[1, 2]", "expected a JSON object"),
    ("a number", b"5", "expected a JSON object"),
    ("a string", b'"job_id"', "expected a JSON object"),
    ("an empty object", b"{}", "expected an Alertmanager webhook"),
    ("alerts a string", b'{"alerts": "x"}', "expected an Alertmanager webhook"),
    ("an alert a number", b'{"alerts": [5]}', "alerts[0]: expected an object"),
    (
        "labels a string",
        b'{"alerts": [{"labels": "job_id=1"}]}',
        "no job_id, slurm_job_id, hangdx_job_id or hpc_job label",
    ),
    ("job_id null", b'{"job_id": null}', "job_id: expected a string"),
    ("job_id true", b'{"job_id": true}', "job_id: expected a string"),
    ("job_id a float", b'{"job_id": 1.5}', "job_id: expected a string"),
    ("job_id a list", b'{"job_id": ["a"]}', "job_id: expected a string"),
    ("job_id an object", b'{"job_id": {"a": 1}}', "job_id: expected a string"),
    ("job_id a huge number", b'{"job_id": ' + b"9" * 300 + b"}", "is not a job id"),
    ("hosts a string", b'{"job_id": "ok-1", "hosts": "a,b"}', "hosts: expected a list"),
    ("hosts of numbers", b'{"job_id": "ok-1", "hosts": [1]}', "is not a host name"),
    ("hosts of null", b'{"job_id": "ok-1", "hosts": [null]}', "is not a host name"),
    (
        "5,000 hosts",
        json.dumps({"job_id": "ok-1", "hosts": [f"n{i}" for i in range(5000)]}).encode(),
        "at most",
    ),
    ("channel a number", b'{"job_id": "ok-1", "channel": 5}', "is not a channel id"),
    ("channel a mention", b'{"job_id": "ok-1", "channel": "<!channel>"}', "is not a channel id"),
    ("channel with a newline", b'{"job_id": "ok-1", "channel": "C0ALERTS01\\n"}', "is not a channel id"),
    ("channel outside the allowlist", json.dumps({"job_id": "ok-1", "channel": OUTSIDE}).encode(), "ALLOWED"),
    ("summary a list", b'{"job_id": "ok-1", "summary": ["x"]}', "summary: expected a string"),
]


@pytest.mark.parametrize("name, body, error", BAD_BODIES, ids=[b[0] for b in BAD_BODIES])
def test_a_body_of_the_wrong_kind_or_shape_is_400_in_one_line(
    bot: LiveBot, caplog, name, body, error
) -> None:
    r = bot.alert(body)
    assert r.status_code == 400 and error in one_line(r)
    nothing_done(bot)
    assert_no_traceback(caplog.records)


HOSTILE_HOSTS = [
    "-oProxyCommand=sh -c id",
    "-oProxyCommand=id",
    "-F/etc/passwd",
    "--",
    "-",
    "gpu-01; reboot",
    "gpu-01 && id",
    "$(id)",
    "`id`",
    "gpu-01\n",
    "gpu-01\r\nX: 1",
    "gpu\x0001",
    "gpu 01",
    " gpu-01",
    "ｇｐｕ01",  # fullwidth
    "gpu-nоde",  # a Cyrillic o
    "root@gpu-01",
    "gpu-01,gpu-02",
    "[fe80::1%eth0]:22",
    "a" * 300,
]


@pytest.mark.parametrize("host", HOSTILE_HOSTS)
def test_a_hostile_host_name_is_refused(bot: LiveBot, caplog, hostile_inputs, host: str) -> None:
    hostile_inputs.tried(2)  # plain JSON hosts, an Alertmanager instance label
    r = bot.alert(json.dumps({"job_id": "host-1", "hosts": ["gpu-02", host]}))
    assert r.status_code == 400 and "is not a host name" in one_line(r)
    labels = {"alertname": "Stuck", "slurm_job_id": "host-1", "instance": host}
    r = bot.alert(json.dumps({"alerts": [{"status": "firing", "labels": labels}]}))
    assert r.status_code == 400 and "is not a host name" in one_line(r)
    nothing_done(bot)
    assert_no_traceback(caplog.records)


def test_ten_thousand_alerts_in_one_payload_are_bounded(bot: LiveBot, caplog, hostile_inputs) -> None:
    hostile_inputs.tried(10_000)
    alerts = [{"labels": {"alertname": "Stuck", "job_id": f"storm-{i}"}} for i in range(10_000)]
    t0 = time.monotonic()
    r = bot.alert(json.dumps({"version": "4", "status": "firing", "alerts": alerts}))
    assert time.monotonic() - t0 < 60  # a generous bound: it answers, it does not grind
    assert r.status_code == 202
    body = r.json()
    assert [a["job_id"] for a in body["accepted"]] == [f"storm-{i}" for i in range(MAX_ALERT_JOBS)]
    assert body["skipped"] == [
        f"{MAX_ALERTS - MAX_ALERT_JOBS} more jobs not diagnosed (at most {MAX_ALERT_JOBS} per payload)",
        f"{10_000 - MAX_ALERTS} more alerts not read (at most {MAX_ALERTS} per payload)",
    ]
    assert sorted(bot.queued()) == sorted(f"storm-{i}" for i in range(MAX_ALERT_JOBS))
    assert len(bot.incidents()) == MAX_ALERT_JOBS
    bot.service.settle()
    parents = [c for c in bot.slack.calls_to("chat.postMessage") if not c.body.get("thread_ts")]
    assert len(parents) == MAX_ALERT_JOBS
    assert_no_traceback(caplog.records)


def test_a_storm_of_bad_alerts_answers_with_a_bounded_list(bot: LiveBot, hostile_inputs) -> None:
    hostile_inputs.tried(1000)
    alerts = [{"labels": {"alertname": f"Bad{i}", "job_id": f"x; rm -rf /{i}"}} for i in range(1000)]
    alerts.append({"labels": {"alertname": "Good", "job_id": "storm-ok", "instance": "gpu-01:9100"}})
    alerts = alerts[-1:] + alerts[:-1]
    r = bot.alert(json.dumps({"alerts": alerts}))
    assert r.status_code == 202
    skipped = r.json()["skipped"]
    assert len(skipped) == MAX_SKIPPED + 1 and skipped[-1].startswith("... and ")
    assert all("\n" not in s and len(s) < 400 for s in skipped)
    assert bot.queued() == ["storm-ok"]


def test_an_alert_summary_loses_its_secrets_before_redis_and_slack(bot: LiveBot) -> None:
    leak = "postgresql://trainer:Pg-S3cret-Passw0rd@db.internal/runs"
    summary = f"no step for 15m; DATABASE_URL={leak} password=hunter2-alert " + "x" * 5000
    r = bot.alert(json.dumps({"job_id": "sum-1", "summary": summary}))
    assert r.status_code == 202
    # The thread's parent is posted after the 202 (by the queue's side): wait for it rather than race it.
    deadline = time.monotonic() + 20
    while not bot.slack.calls_to("chat.postMessage") and time.monotonic() < deadline:
        time.sleep(0.05)
    stored = redis_text(bot.conn)
    posted = json.dumps([c.body for c in bot.slack.calls])
    for where in (stored, posted):
        assert "Pg-S3cret-Passw0rd" not in where and "hunter2-alert" not in where
        assert "no step for 15m" in where
    assert "x" * 600 not in stored  # kept short


def test_an_alert_summary_cannot_ping_the_channel(bot: LiveBot) -> None:
    r = bot.alert(json.dumps({"job_id": "sum-2", "summary": "<!channel> <!here> wake up <@U0ONCALL01>"}))
    assert r.status_code == 202
    bot.service.settle()  # the thread's parent is posted after the alert was answered
    parent = [c.body["text"] for c in bot.slack.calls_to("chat.postMessage") if not c.body.get("thread_ts")]
    assert parent and all("<!" not in t for t in parent)


def test_an_alert_outside_the_allowed_channels_goes_to_the_alert_channel(bot: LiveBot) -> None:
    r = bot.alert(json.dumps({"job_id": "chan-1"}))
    assert r.status_code == 202
    assert bot.service.store.get("chan-1").channel == ALERTS


def test_alerts_while_slack_rate_limits_leave_slash_commands_answered(bot: LiveBot) -> None:
    # Hardening 21.6: 40 alerts while chat.postMessage answered 429 left 10 of 10 slash commands unanswered for 30 s
    # (the thread's parent was posted inside the alert's HTTP request).
    bot.slack.fail("chat.postMessage", status=429, retry_after=2, times=500)
    slow = []
    for i in range(40):
        t0 = time.monotonic()
        assert bot.alert(json.dumps({"job_id": f"rl-{i}", "summary": "stalled"})).status_code == 202
        if time.monotonic() - t0 > 1.0:
            slow.append(i)
    answered = []
    for _ in range(10):
        t0 = time.monotonic()
        r = bot.command("status")
        answered.append(r.status_code == 200 and time.monotonic() - t0 < 3.0)
    assert slow == [] and all(answered), (slow, answered)
    assert sorted(bot.queued()) == sorted(f"rl-{i}" for i in range(40))  # every alert queued its diagnosis
