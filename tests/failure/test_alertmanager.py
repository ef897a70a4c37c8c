"""Issue 11: alerts as Prometheus really sends them, through Debian's real prometheus-alertmanager.

Alertmanager (a webhook receiver with bearer credentials, as the README configures it) in front of `hangdx serve`
and `hangdx worker` processes, HANGDX_RESOLVER=inventory with its own SSH settings, a real sshd as the node, and
ranks of a job on it (rank 2 of 3 gone). The alert is labelled as an exporter labels it: Prometheus's `job` is the
scrape job, `instance` the exporter's host:port, `hangdx_job_id` the training job."""

from __future__ import annotations

import json
import shutil
import subprocess
import textwrap
import uuid
from datetime import datetime, timedelta, timezone

import pytest
import requests

from hangdx.bot.incidents import IncidentStore

from .harness import ALERT_TOKEN, free_port, parents_of, settle, tally, wait_for, wait_verdicts
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
    said = json.dumps([c.body for c in bot.slack.delivered("chat.postMessage")])
    assert "Notes: alert fired on node-a" in said  # the note as written (row 22: no .capitalize())
