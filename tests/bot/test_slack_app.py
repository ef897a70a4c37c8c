"""The Slack edge over real HTTP on 127.0.0.1: signed Slack requests, /alerts, /healthz.

Request shapes come from Slack's docs (slash command form fields, block_actions `payload=`, the
event_callback envelope of app_mention) and signatures are made the way bolt-python's own tests make them
(slack_sdk.signature.SignatureVerifier.generate_signature over "v0:<timestamp>:<body>"). The Alertmanager body
is the webhook_config payload documented at prometheus.io/docs/alerting/latest/configuration/#webhook_config
(version "4"). The Slack Web API is tests/slack_standin.py.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlencode

import pytest
import requests
from slack_sdk.signature import SignatureVerifier
from werkzeug.serving import make_server

from hangdx.bot.alerts import AlertError, parse_alerts
from hangdx.bot.config import BotConfig, ConfigError
from hangdx.bot.request import DiagnoseRequest
from hangdx.bot.slack.app import build_app

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from slack_standin import BOT_USER_ID, SlackStandin  # noqa: E402

SECRET = "8f742231b10e8888abcd99yyyzzz85a5"
ALERT_TOKEN = "alert-token-0123456789abcdef"
ONCALL = "U0ONCALL01"
INTRUDER = "U0INTRUDER"
CHANNEL = "C0ONCALL01"


class Recorder:
    def __init__(self) -> None:
        self.requests: list[DiagnoseRequest] = []
        self.actions: list[tuple[str, str, str]] = []
        self.lock = threading.Lock()

    def submit(self, req: DiagnoseRequest) -> str:
        if req.job_id == "queue-down":
            raise ConnectionError("Error 111 connecting to localhost:6379. Connection refused.")
        with self.lock:
            self.requests.append(req)
        return f"q-{req.job_id}"

    def on_action(self, action: str, job_id: str, user: str) -> None:
        with self.lock:
            self.actions.append((action, job_id, user))


class Bot:
    def __init__(self, url: str, slack: SlackStandin, rec: Recorder) -> None:
        self.url, self.slack, self.rec = url, slack, rec

    def signed(self, body: str, content_type: str, ts: int | None = None, secret: str = SECRET):
        stamp = str(int(time.time()) if ts is None else ts)
        sig = SignatureVerifier(secret).generate_signature(timestamp=stamp, body=body)
        headers = {
            "Content-Type": content_type,
            "X-Slack-Request-Timestamp": stamp,
            "X-Slack-Signature": sig,
        }
        return requests.post(self.url + "/slack/events", data=body.encode(), headers=headers, timeout=10)

    def command(self, text: str, user: str = ONCALL, channel: str = CHANNEL, **kw):
        form = {
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
            "trigger_id": "13345224609.738474920.8088930838d88f008e0",
        }
        return self.signed(urlencode(form), "application/x-www-form-urlencoded", **kw)

    def wait(self, cond, timeout: float = 5.0) -> bool:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if cond():
                return True
            time.sleep(0.02)
        return False


@pytest.fixture(scope="module")
def bot() -> Iterator[Bot]:
    with SlackStandin() as slack:
        env = {
            "SLACK_BOT_TOKEN": "xoxb-1111-2222-hangdxtest",
            "SLACK_SIGNING_SECRET": SECRET,
            "SLACK_API_URL": slack.url,
            "HANGDX_ALERT_TOKEN": ALERT_TOKEN,
            "HANGDX_ALERT_CHANNEL": "C0ALERTS01",
            "HANGDX_ALLOWED_USERS": f"{ONCALL},U0ONCALL02",
        }
        rec = Recorder()
        _, flask_app = build_app(BotConfig.from_env(env), rec.submit, rec.on_action)
        server = make_server("127.0.0.1", 0, flask_app, threaded=True)
        thread = threading.Thread(target=server.serve_forever, daemon=True)
        thread.start()
        try:
            yield Bot(f"http://127.0.0.1:{server.server_port}", slack, rec)
        finally:
            server.shutdown()
            server.server_close()


def test_app_checks_its_token_against_slack_api_url(bot: Bot) -> None:
    assert bot.wait(
        lambda: bot.slack.calls_to("auth.test")
    )  # asked in the background, never holding start-up
    calls = bot.slack.calls_to("auth.test")
    assert calls and calls[0].headers["authorization"] == "Bearer xoxb-1111-2222-hangdxtest"


def test_signed_diagnose_command_acks_ephemerally_and_submits(bot: Bot) -> None:
    r = bot.command("12345")
    assert r.status_code == 200
    assert r.json()["response_type"] == "ephemeral"
    assert r.json()["text"] == "Diagnosing job 12345…"
    assert bot.wait(lambda: any(q.job_id == "12345" for q in bot.rec.requests))
    req = next(q for q in bot.rec.requests if q.job_id == "12345")
    assert (req.source, req.requested_by, req.channel, req.thread_ts) == ("slash", ONCALL, CHANNEL, None)


def test_forged_signature_is_401_and_nothing_submitted(bot: Bot) -> None:
    r = bot.command("forged-1", secret="not-the-signing-secret")
    assert r.status_code == 401
    time.sleep(0.2)
    assert not any(q.job_id == "forged-1" for q in bot.rec.requests)


def test_stale_timestamp_is_401(bot: Bot) -> None:
    r = bot.command("stale-1", ts=int(time.time()) - 6 * 60)
    assert r.status_code == 401
    time.sleep(0.2)
    assert not any(q.job_id == "stale-1" for q in bot.rec.requests)


def test_shell_metacharacters_are_refused(bot: Bot) -> None:
    before = len(bot.rec.requests)
    r = bot.command("1; rm -rf /")
    assert r.status_code == 200
    assert r.json()["response_type"] == "ephemeral"
    assert "is not a job id" in r.json()["text"]
    time.sleep(0.2)
    assert len(bot.rec.requests) == before


def test_user_outside_allowlist_is_refused(bot: Bot) -> None:
    r = bot.command("777", user=INTRUDER)
    assert r.status_code == 200
    assert "HANGDX_ALLOWED_USERS" in r.json()["text"]
    time.sleep(0.2)
    assert not any(q.job_id == "777" for q in bot.rec.requests)


def test_diagnose_help(bot: Bot) -> None:
    r = bot.command("help")
    assert r.status_code == 200
    body = r.json()
    assert body["response_type"] == "ephemeral"
    assert "/diagnose <jobid>" in json.dumps(body["blocks"])


def test_queue_down_is_reported_to_the_asker(bot: Bot) -> None:
    r = bot.command("queue-down")
    assert r.status_code == 200
    assert bot.wait(lambda: bot.slack.calls_to("respond/T0HANGDX1/1234/abcd"))
    said = bot.slack.calls_to("respond/T0HANGDX1/1234/abcd")[0].body
    assert "Could not queue the diagnosis of job queue-down" in said["text"]


def _mention(bot: Bot, text: str, user: str = ONCALL) -> requests.Response:
    envelope = {
        "token": "gIkuvaNzQIHg97ATvDxqgjtO",
        "team_id": "T0HANGDX1",
        "api_app_id": "A0HANGDX01",
        "event": {
            "type": "app_mention",
            "user": user,
            "text": text,
            "ts": "1700000123.000200",
            "thread_ts": "1700000100.000100",
            "channel": CHANNEL,
            "event_ts": "1700000123.000200",
        },
        "type": "event_callback",
        "event_id": "Ev0HANGDX01",
        "event_time": 1700000123,
        "authorizations": [
            {"enterprise_id": None, "team_id": "T0HANGDX1", "user_id": BOT_USER_ID, "is_bot": True}
        ],
    }
    return bot.signed(json.dumps(envelope), "application/json")


def test_mention_in_thread_submits_with_thread_ts(bot: Bot) -> None:
    r = _mention(bot, f"<@{BOT_USER_ID}> diagnose 4242")
    assert r.status_code == 200
    assert bot.wait(lambda: any(q.job_id == "4242" for q in bot.rec.requests))
    req = next(q for q in bot.rec.requests if q.job_id == "4242")
    assert (req.source, req.requested_by, req.channel, req.thread_ts) == (
        "mention",
        ONCALL,
        CHANNEL,
        "1700000100.000100",
    )
    told = [c.body for c in bot.slack.calls_to("chat.postEphemeral") if "4242" in c.body.get("text", "")]
    assert told and told[0]["user"] == ONCALL and told[0]["thread_ts"] == "1700000100.000100"


def test_mention_with_bad_job_id_is_refused_in_thread(bot: Bot) -> None:
    before = len(bot.rec.requests)
    _mention(bot, f"<@{BOT_USER_ID}> diagnose $(reboot)")
    assert bot.wait(
        lambda: any(
            "is not a job id" in c.body.get("text", "") for c in bot.slack.calls_to("chat.postEphemeral")
        )
    )
    assert len(bot.rec.requests) == before


def _press(bot: Bot, action_id: str, job_id: str, user: str = ONCALL) -> requests.Response:
    payload = {
        "type": "block_actions",
        "user": {"id": user, "username": "oncall", "name": "oncall", "team_id": "T0HANGDX1"},
        "api_app_id": "A0HANGDX01",
        "token": "gIkuvaNzQIHg97ATvDxqgjtO",
        "container": {
            "type": "message",
            "message_ts": "1700000200.000300",
            "channel_id": CHANNEL,
            "is_ephemeral": False,
        },
        "trigger_id": "13345224609.738474920.8088930838d88f008e0",
        "team": {"id": "T0HANGDX1", "domain": "hangdx-test"},
        "channel": {"id": CHANNEL, "name": "oncall-training"},
        "message": {"type": "message", "ts": "1700000200.000300", "thread_ts": "1700000100.000100"},
        "response_url": bot.slack.root + "respond/T0HANGDX1/5678/efgh",
        "actions": [
            {
                "action_id": action_id,
                "block_id": "hangdx_actions",
                "text": {"type": "plain_text", "text": "Acknowledge", "emoji": True},
                "value": job_id,
                "type": "button",
                "action_ts": "1700000300.000400",
            }
        ],
    }
    return bot.signed(urlencode({"payload": json.dumps(payload)}), "application/x-www-form-urlencoded")


def test_button_press_calls_on_action(bot: Bot) -> None:
    r = _press(bot, "hangdx_ack", "12345")
    assert r.status_code == 200
    assert bot.wait(lambda: ("ack", "12345", ONCALL) in bot.rec.actions)


def test_rerun_button_submits_into_the_verdict_thread(bot: Bot) -> None:
    _press(bot, "hangdx_rerun", "rerun-7")
    assert bot.wait(lambda: ("rerun", "rerun-7", ONCALL) in bot.rec.actions)
    req = next(q for q in bot.rec.requests if q.job_id == "rerun-7")
    assert (req.source, req.channel, req.thread_ts) == ("button", CHANNEL, "1700000100.000100")


def test_button_press_outside_allowlist_is_refused(bot: Bot) -> None:
    _press(bot, "hangdx_resolve", "999", user=INTRUDER)
    assert bot.wait(
        lambda: any(c.body.get("user") == INTRUDER for c in bot.slack.calls_to("chat.postEphemeral"))
    )
    assert not any(a[1] == "999" for a in bot.rec.actions)


ALERTMANAGER = {
    "version": "4",
    "groupKey": '{}:{alertname="NCCLWatchdogStalled"}',
    "truncatedAlerts": 0,
    "status": "firing",
    "receiver": "hangdx",
    "groupLabels": {"alertname": "NCCLWatchdogStalled"},
    "commonLabels": {"alertname": "NCCLWatchdogStalled", "severity": "page", "slurm_job_id": "88123"},
    "commonAnnotations": {"summary": "Training step counter flat for 15m"},
    "externalURL": "http://alertmanager.example:9093",
    "alerts": [
        {
            "status": "firing",
            "labels": {
                "alertname": "NCCLWatchdogStalled",
                "severity": "page",
                "slurm_job_id": "88123",
                "instance": "gpu-node-03:9100",
            },
            "annotations": {"summary": "Job 88123: no training step for 15m on gpu-node-03"},
            "startsAt": "2026-11-22T02:40:00.000Z",
            "endsAt": "0001-01-01T00:00:00Z",
            "generatorURL": "http://prometheus.example:9090/graph?g0.expr=...",
            "fingerprint": "c3a1f0e9d2b4a5c6",
        },
        {
            "status": "firing",
            "labels": {
                "alertname": "NCCLWatchdogStalled",
                "severity": "page",
                "slurm_job_id": "88123",
                "instance": "gpu-node-07:9100",
            },
            "annotations": {"summary": "Job 88123: no training step for 15m on gpu-node-07"},
            "startsAt": "2026-11-22T02:40:00.000Z",
            "endsAt": "0001-01-01T00:00:00Z",
            "generatorURL": "http://prometheus.example:9090/graph?g0.expr=...",
            "fingerprint": "d4b2a1f0e9c3b5a6",
        },
    ],
}


def _alert(bot: Bot, body: bytes | str, token: str | None = ALERT_TOKEN) -> requests.Response:
    headers = {"Content-Type": "application/json"}
    if token is not None:
        headers["Authorization"] = f"Bearer {token}"
    return requests.post(bot.url + "/alerts", data=body, headers=headers, timeout=10)


def test_alertmanager_webhook_submits_one_diagnosis_per_job(bot: Bot) -> None:
    r = _alert(bot, json.dumps(ALERTMANAGER))
    assert r.status_code == 202
    assert r.json()["accepted"] == [{"job_id": "88123", "id": "q-88123"}]
    req = next(q for q in bot.rec.requests if q.job_id == "88123")
    assert req.source == "alert"
    assert req.hosts == ["gpu-node-03", "gpu-node-07"]
    assert req.channel == "C0ALERTS01"
    assert req.summary == "Job 88123: no training step for 15m on gpu-node-03"


def test_plain_json_alert(bot: Bot) -> None:
    body = {"job_id": "plain-5", "hosts": ["gpu-a", "gpu-b"], "channel": "C0OTHER01", "summary": "stuck"}
    r = _alert(bot, json.dumps(body))
    assert r.status_code == 202
    req = next(q for q in bot.rec.requests if q.job_id == "plain-5")
    assert (req.hosts, req.channel, req.summary) == (["gpu-a", "gpu-b"], "C0OTHER01", "stuck")


@pytest.mark.parametrize("token", [None, "wrong-token-0123456789", ALERT_TOKEN + "x"])
def test_alert_with_wrong_or_missing_token_is_401(bot: Bot, token: str | None) -> None:
    r = _alert(bot, json.dumps({"job_id": "tok-1"}), token=token)
    assert r.status_code == 401
    assert not any(q.job_id == "tok-1" for q in bot.rec.requests)


@pytest.mark.parametrize(
    "body",
    [
        b"{not json",
        b"[1, 2]",
        b'{"hello": 1}',
        b'{"job_id": "1; rm -rf /"}',
        b'{"job_id": "x", "hosts": ["-oProxyCommand=sh"]}',
    ],
)
def test_malformed_alert_is_400_with_one_line_error(bot: Bot, body: bytes) -> None:
    r = _alert(bot, body)
    assert r.status_code == 400
    err = r.json()["error"]
    assert err and "\n" not in err


def test_healthz(bot: Bot) -> None:
    r = requests.get(bot.url + "/healthz", timeout=5)
    assert r.status_code == 200 and r.json()["ok"] is True
    # The stand-in takes the bot token: the background auth.test finds Slack there.
    deadline = time.monotonic() + 10
    while requests.get(bot.url + "/healthz", timeout=5).json() != {"ok": True, "slack": "ok"}:
        assert time.monotonic() < deadline, requests.get(bot.url + "/healthz", timeout=5).json()
        time.sleep(0.1)


def test_alertmanager_resolved_and_unlabelled_alerts_are_not_diagnosed() -> None:
    payload = json.loads(json.dumps(ALERTMANAGER))
    payload["alerts"][0]["status"] = "resolved"
    del payload["alerts"][1]["labels"]["slurm_job_id"]
    reqs, skipped = parse_alerts(payload, None)
    assert reqs == []
    assert skipped == ["NCCLWatchdogStalled: no job_id, slurm_job_id, hangdx_job_id or hpc_job label"]
    with pytest.raises(AlertError):
        parse_alerts({"alerts": ["nope"]}, None)


def test_prometheus_job_label_is_the_scrape_job_not_the_training_job() -> None:
    # Labels as Prometheus and DCGM exporter put them on every alert: `job` is the scrape job, `instance` the
    # exporter's host:port, `Hostname` DCGM's node name, `hpc_job` its HPC job mapping.
    alert = {
        "status": "firing",
        "labels": {
            "alertname": "GpuIdleInBusyJob",
            "job": "dcgm-exporter",
            "instance": "gpu-node-03:9400",
            "Hostname": "gpu-node-03",
        },
    }
    reqs, skipped = parse_alerts({"alerts": [alert]}, None)
    assert reqs == [] and skipped == [
        "GpuIdleInBusyJob: no job_id, slurm_job_id, hangdx_job_id or hpc_job label"
    ]
    alert["labels"]["hpc_job"] = "88124"
    (req,), _ = parse_alerts({"alerts": [alert]}, None)
    assert (req.job_id, req.hosts) == ("88124", ["gpu-node-03"])
    alert["labels"]["train_job"] = "99"
    (req,), _ = parse_alerts({"alerts": [alert]}, None, job_labels=("train_job",))
    assert req.job_id == "99"
    cfg = BotConfig.from_env({"HANGDX_ALERT_JOB_LABELS": "train_job, job"})
    assert cfg.alert_job_labels == ("train_job", "job")
    with pytest.raises(ConfigError, match="^HANGDX_ALERT_JOB_LABELS: 'a-b' is not a Prometheus label name"):
        BotConfig.from_env({"HANGDX_ALERT_JOB_LABELS": "a-b"})


def test_config_errors_are_one_line() -> None:
    with pytest.raises(ConfigError, match="^SLACK_BOT_TOKEN: expected a bot token"):
        BotConfig.from_env({"SLACK_BOT_TOKEN": "xoxp-user-token"})
    with pytest.raises(ConfigError, match="^HANGDX_ALLOWED_USERS: 'bob' is not a Slack id"):
        BotConfig.from_env({"HANGDX_ALLOWED_USERS": "U0ONCALL01, bob"})
    with pytest.raises(ConfigError, match="^HANGDX_RESOLVER"):
        BotConfig.from_env({"HANGDX_RESOLVER": "magic"})
    with pytest.raises(ConfigError, match="^SLACK_SIGNING_SECRET is not set"):
        BotConfig.from_env({"SLACK_BOT_TOKEN": "xoxb-1-2-3"}).require_slack()
    cfg = BotConfig.from_env({"SLACK_API_URL": "http://127.0.0.1:9/api", "HANGDX_ALLOWED_CHANNELS": ""})
    assert cfg.api_url == "http://127.0.0.1:9/api/" and cfg.allowed_channels == frozenset()
    assert cfg.refusal("U0ANYONE1", "C0ANY0001") is None


def test_standin_answers_like_slack_and_scripts_failures() -> None:
    from slack_sdk import WebClient
    from slack_sdk.errors import SlackApiError
    from slack_sdk.http_retry.builtin_handlers import RateLimitErrorRetryHandler

    with SlackStandin() as slack:
        client = WebClient(token="xoxb-1-2-standin", base_url=slack.url)
        client.retry_handlers.append(RateLimitErrorRetryHandler(max_retry_count=1))
        slack.fail("chat.postMessage", status=429, retry_after=1)
        posted = client.chat_postMessage(channel=CHANNEL, text="hello", thread_ts="1700000000.000001")
        assert posted["ok"] and posted["channel"] == CHANNEL and posted["ts"].startswith("1700000000.")
        assert len(slack.calls_to("chat.postMessage")) == 2  # the 429, then the retry
        assert slack.calls_to("chat.postMessage")[1].body["thread_ts"] == "1700000000.000001"

        updated = client.chat_update(channel=CHANNEL, ts=posted["ts"], text="done")
        assert updated["ts"] == posted["ts"] and updated["text"] == "done"

        slack.fail("chat.update", status=500)
        with pytest.raises(SlackApiError) as err:
            client.chat_update(channel=CHANNEL, ts=posted["ts"], text="again")
        assert err.value.response.status_code == 500

        slack.fail("chat.postMessage", error="channel_not_found")
        with pytest.raises(SlackApiError, match="channel_not_found"):
            client.chat_postMessage(channel="C0GONE0001", text="x")

        up = client.files_upload_v2(
            channel=CHANNEL, thread_ts=posted["ts"], content="Thread 1 (idle)\n", filename="stacks.txt"
        )
        assert up["ok"] and up["file"]["id"].startswith("F0HANGDX")
        assert [c.method for c in slack.calls if c.method.startswith(("files.", "upload/"))][:3] == [
            "files.getUploadURLExternal",
            f"upload/{up['file']['id']}",
            "files.completeUploadExternal",
        ]
        assert slack.calls_to(f"upload/{up['file']['id']}")[0].raw == b"Thread 1 (idle)\n"
        assert client.users_info(user=ONCALL)["user"]["id"] == ONCALL


def test_url_verification_challenge_is_answered(bot: Bot) -> None:
    body = {
        "token": "gIkuvaNzQIHg97ATvDxqgjtO",
        "challenge": "3eZbrw1aBm2rZgRNFdxV2595E9CY3gmdALWMmHkvFXO7tYXAYM8P",
        "type": "url_verification",
    }
    r = bot.signed(json.dumps(body), "application/json")
    assert r.status_code == 200 and r.json()["challenge"] == body["challenge"]
