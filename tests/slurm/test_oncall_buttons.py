"""Issue 22, item 8, against the REAL one-node Slurm of test_slurm.py, the real Bolt app over signed HTTP, the real
Service and SlackNotifier with the Slack stand-in, and a real redis-server:

- the Slurm buttons come under a verdict only for a job Slurm knows (not for any all-digit id);
- "Cancel job?" reads "Cancel job" / "Go back", not "Cancel" twice; the Confirm goes to the presser alone;
- button replies say what happened in words ("acknowledged job 12: they are on it", not "ack (acknowledged)");
- `hangdx requeue` / `cancel` / `drain --job` from the command line land on the job's incident and in the hand-off.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from werkzeug.serving import make_server

from hangdx.bot.config import BotConfig
from hangdx.bot.incidents import connect
from hangdx.bot.request import DiagnoseRequest
from hangdx.bot.service import Service, SlackNotifier, slack_client
from hangdx.bot.slack.app import build_app

from .test_actions import THREAD, _node_state, _nonce, _press, _sleeper
from .test_slurm import cluster  # noqa: F401  (the module's own one-node Slurm)

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bot.test_incidents import redis_url  # noqa: E402,F401
from bot.test_slack_app import CHANNEL, INTRUDER, ONCALL, SECRET, Bot  # noqa: E402
from slack_standin import SlackStandin  # noqa: E402

pytestmark = pytest.mark.slurm
OTHER = "U0ONCALL02"


def _verdict(job: str, host: str) -> dict:
    culprit = {"ranks": [1], "hosts": [host], "gpus": [], "links": []}
    root = {"category": "gpu_fault", "summary": f"GPU 3 on {host} fell off the bus", "confidence": 0.9,
            "culprit": culprit, "fix": "drain the node"}  # fmt: skip
    return {"job_id": job, "status": "hung", "root_cause": root, "findings": []}


def _posted_blocks(slack, thread: str) -> list[dict]:
    posts = [
        c
        for c in slack.calls_to("chat.postMessage")
        if c.body.get("thread_ts") == thread and c.body.get("blocks")
    ]
    b = posts[-1].body["blocks"]
    return b if isinstance(b, list) else json.loads(b)


def _buttons(blocks: list[dict]) -> dict[str, dict]:
    return {e["text"]["text"]: e for b in blocks if b["type"] == "actions" for e in b["elements"]}


def test_slurm_buttons_only_for_slurm_jobs_and_replies_in_words(cluster, redis_url):  # noqa: F811
    connect(redis_url).flushdb()
    job = _sleeper(cluster)
    unknown = "987654321"  # all digits, and no job of this Slurm (a torchrun run id, a local job)
    with SlackStandin() as slack:
        cfg = BotConfig.from_env({"SLACK_BOT_TOKEN": "xoxb-1111-2222-hangdxtest", "SLACK_SIGNING_SECRET": SECRET,
                                  "SLACK_API_URL": slack.url, "REDIS_URL": redis_url,
                                  "HANGDX_ACTION_USERS": ONCALL})  # fmt: skip
        client = slack_client(cfg)
        service = Service(cfg, client=client)
        notifier = SlackNotifier(client)
        threads = {job: THREAD, unknown: "1700000900.000900"}
        for j, ts in threads.items():
            service.store.open_or_join(DiagnoseRequest(j, "alert", "alertmanager", channel=CHANNEL))
            service.store.set_thread(j, CHANNEL, ts)
            service.store.add_verdict(j, _verdict(j, cluster.host))
            notifier(service.store.get(j), _verdict(j, cluster.host), None)

        slurm_job = _buttons(_posted_blocks(slack, THREAD))
        assert {f"Drain {cluster.host}", "Requeue job", "Cancel job"} <= set(slurm_job)
        cancel = slurm_job["Cancel job"]["confirm"]
        assert (cancel["title"]["text"], cancel["confirm"]["text"], cancel["deny"]["text"]) == (
            "Cancel job?", "Cancel job", "Go back"
        )  # fmt: skip
        # Before: Drain, Requeue job and Cancel job under any all-digit id.
        assert set(_buttons(_posted_blocks(slack, threads[unknown]))) == {
            "Re-run", "Full stacks", "Acknowledge", "Resolve", "Hand off"
        }  # fmt: skip

        _, flask_app = build_app(cfg, service.submit, service.on_action, store=service.store, act=service.act)
        server = make_server("127.0.0.1", 0, flask_app, threaded=True)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        bot = Bot(f"http://127.0.0.1:{server.server_port}", slack, None)
        said = lambda: [c.body.get("text") or "" for c in slack.calls_to("chat.postMessage")]  # noqa: E731
        try:
            assert _press(bot, "ack", job, ONCALL).status_code == 200
            assert bot.wait(lambda: f"<@{ONCALL}> acknowledged job {job}: they are on it." in said()), said()
            assert _press(bot, "handoff", job, OTHER).status_code == 200
            assert bot.wait(lambda: f"<@{OTHER}> took over job {job}: they own it now." in said()), said()
            assert not [t for t in said() if "(acknowledged)" in t]
            # The Confirm of a Slurm button goes to the presser alone; someone who may not act gets no Confirm.
            assert _press(bot, "cancel", job, INTRUDER).status_code == 200
            assert bot.wait(
                lambda: any(c.body.get("user") == INTRUDER for c in slack.calls_to("chat.postEphemeral"))
            )
            assert _nonce(slack, INTRUDER, 0) is None
            assert _press(bot, "cancel", job, ONCALL).status_code == 200
            assert bot.wait(lambda: _nonce(slack, ONCALL, 0), timeout=20)
            confirms = [
                c for c in slack.calls_to("chat.postEphemeral") if "hangdx_confirm" in json.dumps(c.body)
            ]
            assert [c.body["user"] for c in confirms] == [ONCALL]
        finally:
            server.shutdown()
            server.server_close()

        # The command line's actions, recorded as the buttons' are: on the incident, and in the hand-off.
        env = {**cluster.env, "REDIS_URL": redis_url}
        run = lambda *a: subprocess.run([sys.executable, "-m", "hangdx", *a], env=env, capture_output=True,  # noqa: E731
                                        text=True, timeout=60)  # fmt: skip
        try:
            r = run("drain", cluster.host, "--reason", "hangdx: Xid 79", "--job", job)
            assert r.returncode == 0 and f"recorded on the incident of job {job}" in r.stdout, r.stderr
            assert "drain" in _node_state(cluster)
            r = run("requeue", job)
            assert r.returncode == 0 and f"recorded on the incident of job {job}" in r.stdout, r.stderr
        finally:
            cluster.run("scontrol", "update", f"NodeName={cluster.host}", "State=RESUME", check=False)
            cluster.run("scancel", job, check=False)
        events = [(e["actor"], e["event"], e["detail"]) for e in service.store.get(job).timeline]
        assert (
            "root (command line)",
            "drain",
            f"node {cluster.host} drained (reason: hangdx: Xid 79)",
        ) in events
        assert ("root (command line)", "requeue", f"job {job} requeued") in events
        _, blocks = service.report("handoff")
        done = next(
            b["text"]["text"]
            for b in blocks
            if b.get("text", {}).get("text", "").startswith("*Done this week*")
        )
        assert f"drain {cluster.host} (job {job}, by root (command line))" in done
        assert f"requeue {job} (job {job}, by root (command line))" in done
