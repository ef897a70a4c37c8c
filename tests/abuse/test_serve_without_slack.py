"""Hardening 21.15: `hangdx serve` starts while Slack's auth.test is refused, rate-limited or failing, keeps
/alerts up, says in /healthz what is degraded, and finds Slack again by itself."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest
import requests

from hangdx.bot.incidents import connect

from .harness import ALERT_TOKEN, ALERTS, BOT_TOKEN, SECRET

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from bot.test_end_to_end import free_port, wait_for  # noqa: E402
from bot.test_incidents import redis_url  # noqa: E402,F401
from slack_standin import SlackStandin  # noqa: E402


def _health(url: str) -> dict | None:
    try:
        r = requests.get(url + "/healthz", timeout=3)
    except requests.RequestException:
        return None
    return r.json() if r.status_code == 200 else None


@pytest.mark.parametrize(
    "failure",
    [{"status": 500}, {"status": 429, "retry_after": 1}, {"error": "invalid_auth"}],
    ids=["500", "429", "refused"],
)
def test_serve_starts_and_takes_alerts_while_slack_refuses_auth_test(redis_url, tmp_path, failure):  # noqa: F811
    connect(redis_url).flushdb()
    with SlackStandin() as slack:
        slack.fail("auth.test", times=3, **failure)
        port = free_port()
        env = {**os.environ, "SLACK_BOT_TOKEN": BOT_TOKEN, "SLACK_SIGNING_SECRET": SECRET,
               "SLACK_API_URL": slack.url, "REDIS_URL": redis_url, "HANGDX_ALERT_TOKEN": ALERT_TOKEN,
               "HANGDX_ALERT_CHANNEL": ALERTS, "HANGDX_RESOLVER": "local"}  # fmt: skip
        env.pop("SLACK_APP_TOKEN", None)
        with open(tmp_path / "serve.log", "wb") as log:
            proc = subprocess.Popen([sys.executable, "-m", "hangdx", "serve", "--port", str(port)], env=env,
                                    stdout=log, stderr=log)  # fmt: skip
        url = f"http://127.0.0.1:{port}"
        try:
            health = wait_for("serve's /healthz", lambda: _health(url), timeout=30)
            assert proc.poll() is None, (tmp_path / "serve.log").read_text()[-2000:]
            assert health["ok"] is True and health["slack"] != "ok", health
            assert health["slack"] == "checking" or health["slack"].startswith("degraded: "), health
            body = {"job_id": "4242", "hosts": [], "channel": ALERTS, "summary": "job 4242 stalled"}
            r = requests.post(url + "/alerts", data=json.dumps(body), timeout=10,
                              headers={"Authorization": f"Bearer {ALERT_TOKEN}", "Content-Type": "application/json"})  # fmt: skip
            assert r.status_code in (200, 202), r.text
            # Slack answers again: serve notices by itself, no restart.
            assert wait_for(
                "Slack found again", lambda: (_health(url) or {}).get("slack") == "ok", timeout=30
            )
            assert len(slack.calls_to("auth.test")) >= 4
        finally:
            if proc.poll() is None:
                os.kill(proc.pid, signal.SIGTERM)
                proc.wait(timeout=15)
