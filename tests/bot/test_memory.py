"""Issue 12: fleet memory in the real Redis: a third hang on the same node names it a repeat culprit (with the
earlier incidents) in the verdict and the hand-off; a repeat software hang quotes the earlier resolution; history
from the command line and Slack; the resolution dialog.

The verdicts here are hangdx's own JSON verdict format (docs/verdict.md), built for the test; no real-world
material is involved."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from urllib.parse import urlencode

import pytest
from werkzeug.serving import make_server

from hangdx.bot.config import BotConfig
from hangdx.bot.incidents import connect
from hangdx.bot.memory import Memory
from hangdx.bot.request import DiagnoseRequest
from hangdx.bot.service import Service, slack_client
from hangdx.bot.slack.app import build_app

from .test_incidents import redis_url  # noqa: F401
from .test_slack_app import ONCALL, SECRET, Bot, _press

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from slack_standin import SlackStandin  # noqa: E402

DAY = 86400.0


def gpu_verdict(job: str, host: str = "gpu-node-17") -> dict:
    return {
        "job_id": job, "status": "hung",
        "root_cause": {"category": "gpu_fault", "summary": f"GPU 3 on {host} fell off the bus (Xid 79)",
                       "confidence": 0.95, "culprit": {"ranks": [27], "hosts": [host], "gpus": [], "links": []},
                       "fix": "drain the node"},
        "findings": [{"playbook": "gpu_fault", "category": "gpu_fault", "evidence": [
            {"source": f"{host}/dmesg", "line": 1, "text": "NVRM: Xid (PCI:0000:b3:00): 79, GPU has fallen off the bus."}]}],
    }  # fmt: skip


def software_verdict(job: str, line: int) -> dict:
    stack = 'Thread 4242 (idle): "MainThread"\n    all_reduce (torch/distributed/distributed_c10d.py:2288)\n'
    stack += f"    log_metrics (train.py:{line})\n    evaluate (train.py:{line + 40})"
    return {
        "job_id": job, "status": "hung",
        "root_cause": {"category": "conditional_collective", "summary": "Rank 1 skipped the allreduce",
                       "confidence": 0.9, "culprit": {"ranks": [1], "hosts": [], "gpus": [], "links": []},
                       "fix": "make every rank call it"},
        "findings": [{"playbook": "sequence", "category": "conditional_collective",
                      "evidence": [{"source": "node1/rank0.pyspy", "line": 3, "text": stack}]}],
    }  # fmt: skip


@pytest.fixture
def mem(redis_url):  # noqa: F811
    conn = connect(redis_url)
    conn.flushdb()
    return Memory(conn)


def test_a_third_hang_on_the_same_node_names_it_a_lemon_with_the_earlier_incidents(mem):
    now = time.time()
    assert mem.recall("812", gpu_verdict("812"), now - 5 * DAY) == []
    mem.remember("812", gpu_verdict("812"), now - 5 * DAY)
    second = mem.recall("907", gpu_verdict("907"), now - 2 * DAY)
    assert second == ["gpu-node-17 was the culprit in 1 earlier incident in 14 days (job 812)"]
    mem.remember(
        "907", gpu_verdict("907"), now - 2 * DAY, channel="C0ALERTS01", thread_ts="1700000100.000100"
    )
    mem.remember("555", gpu_verdict("555", host="gpu-node-02"), now - DAY)  # another node: not counted
    third = mem.recall("1001", gpu_verdict("1001"), now)
    link = "https://slack.com/app_redirect?channel=C0ALERTS01&message_ts=1700000100.000100"
    # The lemon first (what to do), then the earlier incidents.
    assert (
        third[1]
        == f"gpu-node-17 was the culprit in 2 earlier incidents in 14 days (job 907 ({link}), job 812)"
    )
    assert third[0] == (
        "lemon: gpu-node-17, culprit in 3 incidents in 14 days: drain it (scontrol update NodeName=gpu-node-17 "
        'State=DRAIN Reason="hangdx: job 1001")'
    )
    mem.remember("1001", gpu_verdict("1001"), now)
    assert mem.lemons(now) == [("gpu-node-17", 3, ["job 1001", f"job 907 ({link})", "job 812"])]
    # Outside the window, the old incidents no longer count.
    assert mem.recall("2000", gpu_verdict("2000"), now + 20 * DAY) == []


def test_a_repeat_software_hang_quotes_the_earlier_resolution(mem, redis_url):  # noqa: F811
    with SlackStandin() as slack:
        cfg = BotConfig(bot_token="xoxb-1-2-x", api_url=slack.url, redis_url=redis_url)
        service = Service(cfg, client=slack_client(cfg))
        service.store.open_or_join(DiagnoseRequest("41", "alert", "alertmanager"))
        mem.remember("41", software_verdict("41", 88), time.time() - 3 * DAY)
        service.resolution(
            "41", "U0ONCALL01", "  every rank now calls log_metrics; eval no longer skips it  "
        )
    # The same hang in another job, its lines moved by an edit: the same user frames, the same signature.
    notes = mem.recall("77", software_verdict("77", 97))
    (same,) = [n for n in notes if n.startswith("same hang")]
    assert same.startswith("same hang as job 41 on ")
    assert same.endswith(
        "(conditional_collective in evaluate (train.py), log_metrics (train.py)), "
        "resolved by: every rank now calls log_metrics; eval no longer skips it"
    )
    timeline = service.store.get("41").timeline
    assert timeline[-1]["event"] == "resolution"


def test_the_hand_off_lists_the_lemon_nodes(mem, redis_url):  # noqa: F811
    now = time.time()
    for i, job in enumerate(("a1", "a2", "a3")):
        mem.remember(
            job, gpu_verdict(job), now - i * DAY, channel="C0ALERTS01", thread_ts=f"170000010{i}.000100"
        )
    with SlackStandin() as slack:
        cfg = BotConfig(bot_token="xoxb-1-2-x", api_url=slack.url, redis_url=redis_url)
        text, blocks = Service(cfg, client=slack_client(cfg)).report("handoff")
    said = json.dumps(blocks)
    assert (
        "Lemon nodes" in said
        and "gpu-node-17: culprit in 3 incidents (<https://slack.com/app_redirect?channel=C0ALERTS01&amp;message_ts=1700000100.000100|job a1>"
        in said
    )


def test_the_hand_off_carries_the_week(mem, redis_url):  # noqa: F811
    now = time.time()
    mem.remember("41", software_verdict("41", 88), now - 3 * DAY)
    mem.resolve("41", "every rank calls log_metrics now")
    mem.remember("77", software_verdict("77", 97), now - DAY)
    mem.note_action("77", "drain", "gpu-node-17", "U0ONCALL01")
    with SlackStandin() as slack:
        cfg = BotConfig(bot_token="xoxb-1-2-x", api_url=slack.url, redis_url=redis_url)
        _, blocks = Service(cfg, client=slack_client(cfg)).report("handoff")
    said = json.dumps(blocks)
    assert "Done this week" in said and "drain gpu-node-17 (job 77, by <@U0ONCALL01>)" in said
    assert "Repeat hangs" in said and "jobs 41, 77" in said
    assert "Resolved this week, and how" in said and "every rank calls log_metrics now" in said


def test_history_from_the_command_line(mem, redis_url):  # noqa: F811
    mem.remember("812", gpu_verdict("812"), time.time() - DAY)
    mem.remember("907", gpu_verdict("907"), time.time())
    env = {**os.environ, "REDIS_URL": redis_url}
    r = subprocess.run([sys.executable, "-m", "hangdx", "history", "gpu-node-17", "--json"], env=env,
                       capture_output=True, text=True, timeout=60)  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert [x["job"] for x in json.loads(r.stdout)] == ["907", "812"]
    r = subprocess.run([sys.executable, "-m", "hangdx", "history", "a;b"], env=env, capture_output=True,
                       text=True, timeout=60)  # fmt: skip
    assert r.returncode == 2 and "is not a host, GPU, link or job name" in r.stderr


def test_resolve_opens_the_dialog_and_its_answer_is_kept():
    kept: list = []
    with SlackStandin() as slack:
        env = {"SLACK_BOT_TOKEN": "xoxb-1111-2222-hangdxtest", "SLACK_SIGNING_SECRET": SECRET,
               "SLACK_API_URL": slack.url}  # fmt: skip
        _, flask_app = build_app(
            BotConfig.from_env(env), lambda r: "q", lambda *a: None,
            history=lambda name: (f"history of {name}", []), resolution=lambda *a: kept.append(a),
        )  # fmt: skip
        server = make_server("127.0.0.1", 0, flask_app, threaded=True)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        try:
            bot = Bot(f"http://127.0.0.1:{server.server_port}", slack, None)
            assert _press(bot, "hangdx_resolve", "4242").status_code == 200
            assert bot.wait(lambda: slack.calls_to("views.open"))
            view = slack.calls_to("views.open")[0].body["view"]
            view = json.loads(view) if isinstance(view, str) else view
            assert view["callback_id"] == "hangdx_resolution"
            assert json.loads(view["private_metadata"])["job_id"] == "4242"
            submission = {
                "type": "view_submission", "team": {"id": "T0HANGDX1"}, "user": {"id": ONCALL},
                "api_app_id": "A0HANGDX01", "token": "gIkuvaNzQIHg97ATvDxqgjtO", "trigger_id": "1.2.3",
                "view": {**view, "id": "V0HANGDX01", "state": {"values": {"resolution": {"note": {
                    "type": "plain_text_input", "value": "drained gpu-node-17"}}}}},
            }  # fmt: skip
            r = bot.signed(
                urlencode({"payload": json.dumps(submission)}), "application/x-www-form-urlencoded"
            )
            assert r.status_code == 200
            assert bot.wait(lambda: kept)
            assert kept == [("4242", ONCALL, "drained gpu-node-17")]
            # `/diagnose history <host>` answers the person who asked, from the fleet memory.
            assert bot.command("history gpu-node-17").status_code == 200
            assert bot.wait(lambda: any("history of gpu-node-17" in json.dumps(c.body) for c in slack.calls
                                        if c.method.startswith("respond/")))  # fmt: skip
        finally:
            server.shutdown()
            server.server_close()
