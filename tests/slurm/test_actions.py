"""Issue 12: drain, requeue and cancel, against the REAL one-node Slurm of test_slurm.py, from Slack (the real Bolt
app over signed HTTP, the real Service and redis-server) and the command line; only for allowed users."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from werkzeug.serving import make_server

from hangdx.bot import slurm_actions
from hangdx.bot.config import BotConfig
from hangdx.bot.incidents import connect
from hangdx.bot.request import DiagnoseRequest
from hangdx.bot.service import Service, slack_client
from hangdx.bot.slack.app import build_app

from .test_slurm import cluster  # noqa: F401  (the module's own one-node Slurm)

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bot.test_incidents import redis_url  # noqa: E402,F401
from bot.test_slack_app import CHANNEL, INTRUDER, ONCALL, SECRET, Bot  # noqa: E402
from slack_standin import SlackStandin  # noqa: E402

pytestmark = pytest.mark.slurm
THREAD = "1700000100.000100"


def _sleeper(cluster) -> str:  # noqa: F811
    job = cluster.sbatch("--job-name=sleeper", "--requeue", "--wrap", "sleep 600")
    cluster.wait_state(job, {"RUNNING"})
    return job


def _node_state(cluster) -> str:  # noqa: F811
    return cluster.run("sinfo", "-h", "-n", cluster.host, "-o", "%T").stdout.strip()


def _nonce(slack, user: str, seen: int) -> str | None:
    """The Confirm button's value in the newest message only `user` saw, past the first `seen` of them."""
    for c in slack.calls_to("chat.postEphemeral")[seen:]:
        if c.body.get("user") != user:
            continue
        blocks = c.body.get("blocks")
        blocks = json.loads(blocks) if isinstance(blocks, str) else blocks or []
        for b in blocks:
            for e in b.get("elements") or []:
                if e.get("action_id") == "hangdx_confirm":
                    return e["value"]
    return None


def _confirmed(bot: Bot, slack, action: str, value: str, user: str) -> str:
    """Press a Slurm button, then the Confirm that hangdx shows the presser alone; the nonce pressed."""
    seen = len(slack.calls_to("chat.postEphemeral"))
    assert _press(bot, action, value, user).status_code == 200
    assert bot.wait(lambda: _nonce(slack, user, seen), timeout=20), slack.calls_to("chat.postEphemeral")[
        seen:
    ]
    nonce = _nonce(slack, user, seen)
    assert _press(bot, "confirm", nonce, user).status_code == 200
    return nonce


def _press(bot: Bot, action: str, value: str, user: str):
    from urllib.parse import urlencode

    payload = {
        "type": "block_actions", "user": {"id": user, "team_id": "T0HANGDX1"}, "api_app_id": "A0HANGDX01",
        "token": "gIkuvaNzQIHg97ATvDxqgjtO", "trigger_id": "1.2.3", "team": {"id": "T0HANGDX1"},
        "container": {"type": "message", "message_ts": "1700000200.000300", "channel_id": CHANNEL},
        "channel": {"id": CHANNEL}, "message": {"type": "message", "ts": "1700000200.000300", "thread_ts": THREAD},
        "actions": [{"action_id": f"hangdx_{action}", "block_id": "hangdx_slurm", "value": value, "type": "button",
                     "action_ts": f"{time.time():.6f}"}],
    }  # fmt: skip
    return bot.signed(urlencode({"payload": json.dumps(payload)}), "application/x-www-form-urlencoded")


def test_drain_and_requeue_from_slack_only_for_allowed_users(cluster, redis_url):  # noqa: F811
    connect(redis_url).flushdb()
    job = _sleeper(cluster)
    with SlackStandin() as slack:
        cfg = BotConfig.from_env({"SLACK_BOT_TOKEN": "xoxb-1111-2222-hangdxtest", "SLACK_SIGNING_SECRET": SECRET,
                                  "SLACK_API_URL": slack.url, "REDIS_URL": redis_url,
                                  "HANGDX_ACTION_USERS": ONCALL})  # fmt: skip
        service = Service(cfg, client=slack_client(cfg))
        service.store.open_or_join(DiagnoseRequest(job, "alert", "alertmanager", channel=CHANNEL))
        service.store.set_thread(job, CHANNEL, THREAD)
        culprit = {"ranks": [0], "hosts": [cluster.host], "gpus": [], "links": []}
        root = {"category": "gpu_fault", "summary": "s", "confidence": 0.9, "culprit": culprit, "fix": "f"}
        service.store.add_verdict(job, {"job_id": job, "status": "hung", "root_cause": root, "findings": []})
        _, flask_app = build_app(cfg, service.submit, service.on_action, store=service.store, act=service.act)
        server = make_server("127.0.0.1", 0, flask_app, threaded=True)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        bot = Bot(f"http://127.0.0.1:{server.server_port}", slack, None)
        try:
            # Someone who may diagnose but not act: refused, and the node stays as it was.
            assert _press(bot, "drain", f"{job}|{cluster.host}", INTRUDER).status_code == 200
            assert bot.wait(
                lambda: any(c.body.get("user") == INTRUDER for c in slack.calls_to("chat.postEphemeral"))
            )
            refusal = next(c for c in slack.calls_to("chat.postEphemeral") if c.body.get("user") == INTRUDER)
            assert "You may not drain nodes" in refusal.body["text"]
            time.sleep(1)
            assert "drain" not in _node_state(cluster)

            said = lambda: [c.body.get("text") for c in slack.calls_to("chat.postMessage")]  # noqa: E731
            # A press alone does nothing: the action waits for its presser's confirmation, kept by hangdx.
            assert _press(bot, "requeue", job, ONCALL).status_code == 200
            assert bot.wait(lambda: _nonce(slack, ONCALL, 0), timeout=20)
            time.sleep(1)
            assert not any("requeue" in (t or "") for t in said())
            assert cluster.run("squeue", "-h", "-j", job, "-o", "%T").stdout.strip() == "RUNNING"
            # A forged confirmation (a guessed nonce), or the real one pressed by someone else: nothing happens.
            assert _press(bot, "confirm", "x" * 24, ONCALL).status_code == 200
            assert _press(bot, "confirm", _nonce(slack, ONCALL, 0), INTRUDER).status_code == 200
            time.sleep(1)
            assert not any("requeue" in (t or "") for t in said())
            nonce = _confirmed(bot, slack, "requeue", job, ONCALL)
            said = lambda: [c.body.get("text") for c in slack.calls_to("chat.postMessage")]  # noqa: E731
            eph = lambda: [c.body.get("text") for c in slack.calls_to("chat.postEphemeral")]  # noqa: E731
            assert bot.wait(lambda: any("requeue" in (t or "") for t in said()), timeout=30), (said(), eph())
            assert "could not" not in said()[-1], said()
            cluster.wait_state(job, {"PENDING", "REQUEUED", "REQUEUE_HOLD"})  # pending again
            # A forged button value: `all` (Slurm's every node) or a node the verdict does not name.
            # A replayed confirmation: used once, gone.
            assert _press(bot, "confirm", nonce, ONCALL).status_code == 200
            time.sleep(1)
            assert sum("requeue" in (t or "") for t in said()) == 1
            for forged in ("all", "ALL", "gpu-node-victim"):
                assert _press(bot, "drain", f"{job}|{forged}", ONCALL).status_code == 200
                assert bot.wait(
                    lambda f=forged: any(f"'{f}' is not a culprit host" in (t or "") for t in said())
                )
            time.sleep(0.5)
            assert "drain" not in _node_state(cluster)
            _confirmed(bot, slack, "drain", f"{job}|{cluster.host}", ONCALL)
            assert bot.wait(lambda: "drain" in _node_state(cluster), timeout=20), _node_state(cluster)
            reason = cluster.run("sinfo", "-h", "-R", "-n", cluster.host, "-o", "%E").stdout
            assert f"hangdx: job {job}, drained by {ONCALL}" in reason
            assert bot.wait(
                lambda: (
                    sum("node" in c.body.get("text", "") and " drained (reason" in c.body.get("text", "")
                        for c in slack.calls_to("chat.postMessage")) == 1
                )
            )  # fmt: skip
            said = next(
                c for c in slack.calls_to("chat.postMessage") if " drained (reason" in c.body.get("text", "")
            )
            assert said.body["thread_ts"] == THREAD and said.body["text"].startswith(
                f"<@{ONCALL}>: drain: node "
            )
            events = [(e["actor"], e["event"]) for e in service.store.get(job).timeline]
            assert (ONCALL, "requeue") in events and (ONCALL, "drain") in events
        finally:
            server.shutdown()
            server.server_close()
            cluster.run("scontrol", "update", f"NodeName={cluster.host}", "State=RESUME", check=False)
            cluster.run("scancel", job, check=False)


def test_the_command_line_cancels_and_refuses_what_is_not_a_job_or_a_node(cluster):  # noqa: F811
    job = _sleeper(cluster)
    env = {**cluster.env}
    r = subprocess.run([sys.executable, "-m", "hangdx", "cancel", job], env=env, capture_output=True, text=True,
                       timeout=60)  # fmt: skip
    assert r.returncode == 0 and r.stdout.strip() == f"job {job} cancelled", r.stderr
    cluster.wait_state(job, {"CANCELLED", "GONE"})
    with pytest.raises(slurm_actions.ActionError, match="is not a node name"):
        slurm_actions.drain("-oops", "x")
    with pytest.raises(slurm_actions.ActionError, match="is not a"):
        slurm_actions.requeue("123; reboot")


def test_the_command_line_never_drains_a_keyword_or_a_node_slurm_does_not_list(cluster):  # noqa: F811
    # `scontrol update NodeName=all State=DRAIN` drains every node: `all` is refused in one line, whatever its case.
    for target in ("all", "ALL", "All", "default", "gpu-node-victim"):
        r = subprocess.run([sys.executable, "-m", "hangdx", "drain", target, "--reason", "x"], env=cluster.env,
                           capture_output=True, text=True, timeout=60)  # fmt: skip
        assert r.returncode == 2 and r.stdout == "", (target, r.stdout, r.stderr)
        assert len(r.stderr.strip().splitlines()) == 1 and target in r.stderr and "Traceback" not in r.stderr
        assert "drain" not in _node_state(cluster)
    job = _sleeper(cluster)
    try:
        r = subprocess.run([sys.executable, "-m", "hangdx", "drain", cluster.host, "--reason", "hangdx test",
                            "--job", job], env=cluster.env, capture_output=True, text=True, timeout=60)  # fmt: skip
        assert r.returncode == 0 and r.stdout.startswith(f"node {cluster.host} drained"), r.stderr
        assert "drain" in _node_state(cluster)
    finally:
        cluster.run("scontrol", "update", f"NodeName={cluster.host}", "State=RESUME", check=False)
        cluster.run("scancel", job, check=False)
