"""Issue 11: alerts as Prometheus really sends them, through Debian's real prometheus-alertmanager.

Alertmanager (a webhook receiver with bearer credentials, as the README configures it) in front of `hangdx serve`
and `hangdx worker` processes, HANGDX_RESOLVER=inventory with its own SSH settings, a real sshd as the node, and
ranks of a job on it (rank 2 of 3 gone). The alert is labelled as an exporter labels it: Prometheus's `job` is the
scrape job, `instance` the exporter's host:port, `hangdx_job_id` the training job."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import textwrap
import uuid
from datetime import datetime, timedelta, timezone

import pytest
import requests

from hangdx.bot.incidents import IncidentStore

from .harness import (
    ALERT_TOKEN,
    CHANNEL,
    free_port,
    parents_of,
    settle,
    tally,
    verdict_posts,
    wait_for,
    wait_verdicts,
)
from .test_silent_node import sshd  # noqa: F401  (a real sshd on 127.0.0.1)

ALERTMANAGER = shutil.which("prometheus-alertmanager") or shutil.which("alertmanager")
pytestmark = pytest.mark.skipif(ALERTMANAGER is None, reason="apt-get install prometheus-alertmanager")


@pytest.fixture
def start_alertmanager(tmp_path):
    procs = []

    def start(webhook: str) -> str:
        port = free_port()
        conf = tmp_path / "alertmanager.yml"
        conf.write_text(
            textwrap.dedent(
                f"""\
                route:
                  receiver: hangdx
                  group_by: [hangdx_job_id]
                  group_wait: 1s
                  group_interval: 1s
                  repeat_interval: 1h
                receivers:
                  - name: hangdx
                    webhook_configs:
                      - url: {webhook}
                        send_resolved: true
                        http_config:
                          authorization:
                            type: Bearer
                            credentials: {ALERT_TOKEN}
                """
            )
        )
        log = open(tmp_path / "alertmanager.log", "wb")
        procs.append(
            subprocess.Popen(
                [ALERTMANAGER, f"--config.file={conf}", f"--storage.path={tmp_path / 'am-data'}",
                 f"--web.listen-address=127.0.0.1:{port}", "--cluster.listen-address="],
                stdout=log, stderr=log,
            )
        )  # fmt: skip
        url = f"http://127.0.0.1:{port}"
        wait_for("alertmanager ready", lambda: _ready(url), timeout=30)
        return url

    yield start
    for p in procs:
        p.terminate()
        p.wait(timeout=10)


def _ready(url: str) -> bool:
    try:
        return requests.get(url + "/-/ready", timeout=1).status_code == 200
    except requests.RequestException:
        return False


def fire(am: str, job: str, instance: str, ends: datetime | None = None) -> None:
    now = datetime.now(timezone.utc)
    alert = {
        "labels": {"alertname": "TrainingStalled", "job": "node-exporter", "instance": instance,
                   "hangdx_job_id": job, "severity": "page"},
        "annotations": {"summary": f"job {job}: no training step for 10 minutes"},
        "startsAt": (now - timedelta(minutes=10)).isoformat(),
        "endsAt": (ends or now + timedelta(hours=1)).isoformat(),
    }  # fmt: skip
    r = requests.post(am + "/api/v2/alerts", json=[alert], timeout=10)
    assert r.status_code == 200, r.text


def test_an_exporter_alert_through_alertmanager_diagnoses_the_job_with_the_inventory_settings(
    bot,
    ranks,
    sshd,  # noqa: F811
    start_alertmanager,
):
    root = sshd["root"]
    job = ranks.job(f"am-{uuid.uuid4().hex[:6]}", ranks=(0, 1), world=3)
    inventory = root / "inventory.yaml"
    inventory.write_text(
        textwrap.dedent(
            f"""\
            ssh: {{user: root, key_file: {root / "client_key"}, known_hosts: {root / "known_hosts"},
                  use_agent: false}}
            hosts:
              node-a: {{address: 127.0.0.1, port: {sshd["port"]}}}
            jobs:
              "{job}": [node-a]
            """
        )
    )
    bot.procs.env["HANGDX_RESOLVER"] = f"inventory:{inventory}"
    bot.serve().workers(1)
    am = start_alertmanager(bot.url + "/alerts")

    fire(am, job, "node-a:9100")  # node exporter's host:port: a hint, not an SSH target
    wait_verdicts(bot.slack, bot.conn, [job], timeout=90)
    inc = IncidentStore(bot.conn).get(job)
    v = inc.latest_verdict
    rc = v["root_cause"]
    assert rc["category"] == "rank_crashed" and rc["culprit"]["ranks"] == [2], rc["summary"]
    assert v["notes"][0] == "alert fired on node-a"
    assert not any(
        "node-a:9100" in g for g in v["gaps"]
    )  # reached through the inventory, not as "node-a:9100"

    # A second alert of the same job (another node's exporter) joins the incident; a resolved one changes nothing.
    fire(am, job, "node-b:9400")
    fire(am, job, "node-a:9100", ends=datetime.now(timezone.utc) - timedelta(seconds=1))
    settle(4)
    assert len(parents_of(bot.slack, job)) == 1  # one thread
    counts = tally(bot.conn, bot.slack, [job])
    assert counts["incidents"] == 1 and counts["lost"] == 0, counts
    events = [e["event"] for e in IncidentStore(bot.conn).get(job).timeline]
    assert events.count("opened") == 1 and "request" in events, events
    said = json.dumps([c.body for c in bot.slack.delivered("chat.postMessage")], ensure_ascii=False)
    assert "alert fired on node-a" in said, said[-3000:]  # the note as written (row 22: no .capitalize())


def _slash(url: str, text: str, response_url: str) -> requests.Response:
    """`/diagnose TEXT` as Slack signs and sends it."""
    import time
    from urllib.parse import urlencode

    from slack_sdk.signature import SignatureVerifier

    from .harness import SECRET

    body = urlencode(
        {"command": "/diagnose", "text": text, "user_id": "U0ONCALL01", "channel_id": CHANNEL,
         "team_id": "T0HANGDX1", "response_url": response_url, "trigger_id": "1.2.3"}
    )  # fmt: skip
    stamp = str(int(time.time()))
    sig = SignatureVerifier(SECRET).generate_signature(timestamp=stamp, body=body)
    headers = {"Content-Type": "application/x-www-form-urlencoded", "X-Slack-Request-Timestamp": stamp,
               "X-Slack-Signature": sig}  # fmt: skip
    return requests.post(url + "/slack/events", data=body, headers=headers, timeout=5)


def test_a_localhost_alert_with_the_local_resolver_probes_this_machine_and_names_the_culprit(
    bot, start_alertmanager
):
    """Issue 22 item 6: HANGDX_RESOLVER=local (the bot on the job's machine) and an alert labelled
    `instance="localhost:9100"`: the job's ranks here are probed, not an SSH session to "localhost"."""
    pytest.importorskip("torch")
    from hangdx.zoo.launch import ZooJob

    assert bot.procs.env["HANGDX_RESOLVER"] == "local"
    bot.serve().workers(1)
    am = start_alertmanager(bot.url + "/alerts")
    with ZooJob("skip_collective") as job:
        job.wait_until_stuck()
        fire(am, job.job_id, "localhost:9100")
        assert wait_verdicts(bot.slack, bot.conn, [job.job_id], timeout=120), bot.log_text()[-3000:]
        inc = IncidentStore(bot.conn).get(job.job_id)
    v = inc.latest_verdict
    rc = v["root_cause"]
    assert rc["category"] == "conditional_collective" and rc["culprit"]["ranks"] == [1], rc["summary"]
    assert v["notes"][0] == "alert fired on localhost"
    assert not any("known_hosts" in g or "ssh" in g.lower() for g in v["gaps"]), v["gaps"]
    parents = parents_of(bot.slack, job.job_id)
    assert len(parents) == 1 and parents[0].body["channel"] == CHANNEL
    assert f"job {job.job_id}: no training step for 10 minutes" in parents[0].body["text"]
    posts = verdict_posts(bot.slack, inc.thread_ts)
    assert len(posts) == 1 and posts[0].body["channel"] == CHANNEL
    said = json.dumps(posts[0].body["blocks"])
    assert "conditional_collective" in said and "Rank 1 skipped the allreduce" in said, said[:2000]


def test_a_failed_diagnosis_shows_as_failed_in_diagnose_status(bot, start_alertmanager):
    """Issue 22 item 6: a diagnosis that failed (no process of the job on this machine) is not shown as
    "investigating" in `/diagnose status`: it says failed, and why."""
    bot.serve().workers(1)
    am = start_alertmanager(bot.url + "/alerts")
    job = f"gone-{uuid.uuid4().hex[:6]}"
    fire(am, job, "localhost:9100")
    store = IncidentStore(bot.conn)
    wait_for(
        "the failed diagnosis", lambda: (store.get(job) or None) and store.get(job).diagnosis == "failed", 90
    )
    inc = store.get(job)
    assert inc.status == "investigating" and "no process of job" in (inc.diagnosis_error or "")
    events = [e["event"] for e in inc.timeline]
    assert "diagnosis_failed" in events, events
    r = _slash(bot.url, "status", bot.slack.root + "respond/status")
    assert r.status_code == 200, r.text
    answer = wait_for("the status answer", lambda: bot.slack.calls_to("respond/status"), 30)[0].body
    said = json.dumps(answer.get("blocks"))
    assert f"*Job {job}*: diagnosis failed (investigating)" in said, said
    assert f"Why: no process of job '{job}' found on" in said, said
    # ... and so does the thread's parent, whose last edit is no longer the diagnosis's progress.
    edits = wait_for(
        "the parent's last edit",
        lambda: [
            c.body["text"] for c in bot.slack.calls_to("chat.update") if c.body.get("ts") == inc.thread_ts
        ],
        30,
    )
    assert edits[-1].startswith(f"hangdx: job {job}: diagnosis failed: no process of job"), edits
    # ... and the postmortem export says so too.
    md = subprocess.run(
        [sys.executable, "-m", "hangdx", "incident", job],
        env=bot.procs.env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert md.returncode == 0, md.stderr
    assert f"- **Latest diagnosis:** failed: no process of job '{job}' found on" in md.stdout, md.stdout
