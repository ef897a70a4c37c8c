"""Issue 22 item 10: what `hangdx serve` prints when it starts, as a person starting it reads it: one line saying
where it listens and what it answers there, and no Bolt warning that reads like a misconfiguration."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import requests

from .test_end_to_end import bot_env, free_port
from .test_incidents import redis_url  # noqa: F401  (the session's redis-server)

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from slack_standin import SlackStandin  # noqa: E402


def _start_and_stop(env: dict[str, str], port: int, tmp_path: Path) -> str:
    """Run `hangdx serve` until /healthz answers, stop it by PID (SIGTERM); everything it printed."""
    out = tmp_path / "serve.out"
    with open(out, "wb") as f:
        p = subprocess.Popen(
            [sys.executable, "-m", "hangdx", "serve", "--port", str(port)], env=env, stdout=f, stderr=f
        )
        try:
            end = time.monotonic() + 60
            while time.monotonic() < end:
                try:
                    if requests.get(f"http://127.0.0.1:{port}/healthz", timeout=1).status_code == 200:
                        break
                except requests.RequestException:
                    time.sleep(0.2)
            else:
                raise AssertionError("serve never answered /healthz: " + out.read_text(errors="replace"))
            time.sleep(1.0)  # Bolt's and SlackLink's start-up lines, if any, come within this
        finally:
            os.kill(p.pid, signal.SIGTERM)
            p.wait(timeout=20)
    return out.read_text(errors="replace")


def test_serve_says_where_it_listens_and_prints_no_bolt_token_warning(redis_url, tmp_path):  # noqa: F811
    port = free_port()
    with SlackStandin() as slack:
        env = bot_env(slack, redis_url, HANGDX_ALERT_TOKEN="alert-token-0123456789abcdef")
        said = _start_and_stop(env, port, tmp_path)
    assert (
        f"hangdx serve: listening on http://127.0.0.1:{port} (Slack at http://127.0.0.1:{port}/slack/events, "
        "alerts at /alerts, health at /healthz)"
    ) in said, said
    assert "will be unused" not in said, said
    assert "token" not in said.replace("HANGDX_ALERT_TOKEN", ""), said


def test_serve_without_an_alert_token_says_alerts_are_off(redis_url, tmp_path):  # noqa: F811
    port = free_port()
    with SlackStandin() as slack:
        env = bot_env(slack, redis_url)
        env.pop("HANGDX_ALERT_TOKEN", None)
        said = _start_and_stop(env, port, tmp_path)
    assert f"listening on http://127.0.0.1:{port}" in said
    assert "alerts off (HANGDX_ALERT_TOKEN unset)" in said, said
