"""Issue 22, items 1-3: the fleet memory as an on-call engineer meets it, with real parts: `hangdx serve` and
`hangdx worker` as processes, a real redis-server, the Slack stand-in, and real hung torch.distributed jobs of
the hang zoo diagnosed live with py-spy.

1. Re-running a diagnosis is not another incident: no "earlier incident" of the job itself, no lemon, and
   `hangdx history HOST` lists the job once.
2. The same hang in another job is recognised from the stacks (per rank role, the wait and the user frames
   under it), for the commonest software hangs, whose evidence quotes only torch frames.
3. Slack shows it, first among the notes, with the earlier thread as a link named after its job; `hangdx
   incident` prints it too.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from urllib.parse import urlencode

import pytest

from hangdx.bot.incidents import IncidentStore, connect
from hangdx.bot.memory import Memory

from .test_end_to_end import CHANNEL, alert, bot, wait_for  # noqa: F401  (bot: serve + worker)
from .test_incidents import redis_url  # noqa: F401
from .test_slack_app import SECRET, Bot

pytest.importorskip("torch")
from hangdx.bot.diagnosis import DiagnoseOptions, diagnose  # noqa: E402
from hangdx.zoo.launch import ZooJob  # noqa: E402

pytestmark = pytest.mark.zoo
ONCALL = "U0ONCALL01"
FIX = "every rank now all_reduces the NaN flag before skipping log_metrics"
assert SECRET  # the bot fixture's signing secret is test_slack_app's


def _blocks(call) -> list[dict]:
    b = call.body["blocks"]
    return b if isinstance(b, list) else json.loads(b)


def _verdicts(slack, thread_ts: str) -> list[list[dict]]:
    return [
        _blocks(c)
        for c in slack.calls_to("chat.postMessage")
        if c.body.get("blocks") and c.body.get("thread_ts") == thread_ts
    ]


def _notes(blocks: list[dict]) -> str:
    return "\n".join(
        b["text"]["text"]
        for b in blocks
        if b["type"] == "section" and b.get("text", {}).get("text", "").startswith("*Notes*")
    )


def _press(client: Bot, action: str, job: str, thread_ts: str):
    payload = {
        "type": "block_actions", "user": {"id": ONCALL, "username": "oncall", "team_id": "T0HANGDX1"},
        "api_app_id": "A0HANGDX01", "token": "gIkuvaNzQIHg97ATvDxqgjtO",
        "container": {"type": "message", "message_ts": thread_ts, "channel_id": CHANNEL, "is_ephemeral": False},
        "trigger_id": "13345224609.738474920.8088930838d88f008e0", "team": {"id": "T0HANGDX1"},
        "channel": {"id": CHANNEL, "name": "alerts"},
        "message": {"type": "message", "ts": "1700000200.000300", "thread_ts": thread_ts},
        "response_url": client.slack.root + "respond/T0HANGDX1/5678/efgh",
        "actions": [{"action_id": f"hangdx_{action}", "block_id": "hangdx_actions", "value": job,
                     "type": "button", "action_ts": "1700000300.000400"}],
    }  # fmt: skip
    return client.signed(urlencode({"payload": json.dumps(payload)}), "application/x-www-form-urlencoded")


def _resolve(client: Bot, job: str, thread_ts: str, note: str) -> None:
    """Resolve, then answer the dialog as the on-call would."""
    assert _press(client, "resolve", job, thread_ts).status_code == 200
    view = wait_for("the resolution dialog", lambda: client.slack.calls_to("views.open"))[-1].body["view"]
    view = json.loads(view) if isinstance(view, str) else view
    submission = {
        "type": "view_submission", "team": {"id": "T0HANGDX1"}, "user": {"id": ONCALL},
        "api_app_id": "A0HANGDX01", "token": "gIkuvaNzQIHg97ATvDxqgjtO", "trigger_id": "1.2.3",
        "view": {**view, "id": "V0HANGDX01", "state": {"values": {"resolution": {"note": {
            "type": "plain_text_input", "value": note}}}}},
    }  # fmt: skip
    r = client.signed(urlencode({"payload": json.dumps(submission)}), "application/x-www-form-urlencoded")
    assert r.status_code == 200


def _hangdx(rurl: str, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "REDIS_URL": rurl}
    return subprocess.run(
        [sys.executable, "-m", "hangdx", *args], env=env, capture_output=True, text=True, timeout=60
    )


def test_reruns_are_one_incident_and_the_same_hang_in_another_job_shows_its_fix(bot):  # noqa: F811
    url, slack, rurl = bot
    client = Bot(url, slack, None)
    store = IncidentStore(connect(rurl))
    host = socket.gethostname()
    with ZooJob("skip_collective") as first:
        first.wait_until_stuck()
        assert alert(url, first.job_id).status_code == 202
        thread = wait_for(
            "the first verdict",
            lambda: store.get(first.job_id).latest_verdict and store.get(first.job_id).thread_ts,
            timeout=120,
        )
        wait_for("the first verdict in its thread", lambda: _verdicts(slack, thread), timeout=60)
        for n in (2, 3):  # Re-run, twice
            assert _press(client, "rerun", first.job_id, thread).status_code == 200
            wait_for(f"verdict {n}", lambda n=n: len(_verdicts(slack, thread)) >= n, timeout=120)
    third = _notes(_verdicts(slack, thread)[2])
    assert "conditional_collective" in json.dumps(_verdicts(slack, thread)[2])
    # Before: "lemon: HOST, culprit in 3 incidents in 14 days: drain it", the job its own earlier incident.
    assert "earlier incident" not in third and "lemon" not in third, third
    assert f"job {first.job_id} was diagnosed before (2 times" in third
    r = _hangdx(rurl, "history", host, "--json")
    assert r.returncode == 0, r.stderr
    rows = json.loads(r.stdout)
    assert [(x["job"], x["diagnoses"]) for x in rows] == [(first.job_id, 3)]
    assert Memory(connect(rurl)).lemons() == []

    _resolve(client, first.job_id, thread, FIX)
    wait_for("the resolution kept", lambda: Memory(connect(rurl)).history(first.job_id)[0]["resolution"])

    with ZooJob("skip_collective") as second:
        second.wait_until_stuck()
        assert alert(url, second.job_id).status_code == 202
        other = wait_for(
            "the second job's verdict",
            lambda: (store.get(second.job_id).latest_verdict or None) and store.get(second.job_id).thread_ts,
            timeout=120,
        )
        blocks = wait_for("the second verdict in its thread", lambda: _verdicts(slack, other), timeout=60)[0]
    notes = _notes(blocks)
    link = f"<https://slack.com/app_redirect?channel={CHANNEL}&amp;message_ts={thread}|job {first.job_id}>"
    lines = notes.split("\n")[1:]
    # The known fix first, the earlier thread a link named after its job, the place said from the stacks.
    assert lines[0].startswith(f"• same hang as {link} on "), notes
    assert (
        "(conditional_collective in should_stop (job.py); the others in log_metrics (job.py)), "
        f"resolved by: {FIX}" in lines[0]
    ), notes
    assert any(f"{host} was the culprit in 1 earlier incident in 14 days ({link})" in ln for ln in lines), (
        notes
    )
    assert "https://" not in notes.replace(link, "")  # no raw URL left
    r = _hangdx(rurl, "incident", second.job_id)
    assert r.returncode == 0, r.stderr
    assert "**Notes:**" in r.stdout and f"- same hang as job {first.job_id} (https://slack.com/" in r.stdout


@pytest.mark.parametrize(
    "fault, where",
    [
        ("skip_collective", "should_stop (job.py); the others in log_metrics (job.py)"),
        ("uneven_data", "finish_epoch (job.py); the others in sync_gradients (job.py)"),
        ("io_hang", "load_checkpoint (job.py); the others in run_io_hang (job.py)"),
        ("p2p_deadlock", "exchange_boundary (job.py); the others in sync_gradients (job.py)"),
    ],
)
def test_two_live_diagnoses_of_the_same_software_hang_match(fault, where, redis_url):  # noqa: F811
    conn = connect(redis_url)
    conn.flushdb()
    mem = Memory(conn)
    seen = []
    for _ in range(2):
        with ZooJob(fault) as job:
            job.wait_until_stuck()
            v, _docs = diagnose(job.job_id, DiagnoseOptions())
        verdict = v.to_dict()
        # What made the old signature empty: the top finding quotes no user frame of these hangs.
        assert v.stack_roles, verdict
        seen.append((job.job_id, verdict, mem.recall(job.job_id, verdict, roles=v.stack_roles)))
        mem.remember(job.job_id, verdict, roles=v.stack_roles)
    (first, _, before), (_, verdict, notes) = seen
    assert not [n for n in before if n.startswith("same hang")]
    category = verdict["root_cause"]["category"]
    assert [n for n in notes if n.startswith("same hang")] == [
        f"same hang as job {first} on {time.strftime('%Y-%m-%d', time.gmtime())} ({category} in {where})"
    ]
