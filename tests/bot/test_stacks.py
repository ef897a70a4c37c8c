"""The "Full stacks" button: the latest diagnosis's py-spy dumps kept in a real redis-server
(tests/bot/test_incidents.py) and uploaded into the incident's thread through the Slack stand-in
(tests/slack_standin.py: files.getUploadURLExternal, the raw upload, files.completeUploadExternal, shaped as
Slack's method docs describe). The py-spy text is `py-spy dump` output as the collector keeps it."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from hangdx.bot import queue as hq
from hangdx.bot.artifacts import MAX_STACKS_BYTES, STACKS_TTL, load_stacks, save_stacks, stacks_key
from hangdx.bot.config import BotConfig
from hangdx.bot.incidents import connect
from hangdx.bot.request import DiagnoseRequest
from hangdx.bot.service import Service, slack_client
from hangdx.playbooks.verdict import Verdict

from .test_incidents import redis_url  # noqa: F401  (the session's redis-server)

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from slack_standin import SlackStandin  # noqa: E402

TOKEN = "xoxb-1111-2222-hangdxtest"
CHANNEL = "C0ONCALL01"
USER = "U0ONCALL01"

RANK0 = """Process 4242: /usr/bin/python3 train.py --nnodes 2
Python v3.11.9 (/usr/bin/python3.11)

Thread 4242 (active): "MainThread"
    _wait_for_work (torch/distributed/distributed_c10d.py:2413)
    all_reduce (torch/distributed/distributed_c10d.py:2288)
    train_step (train.py:88)
    <module> (train.py:120)
"""
RANK1 = """Process 4243: /usr/bin/python3 train.py --nnodes 2
Python v3.11.9 (/usr/bin/python3.11)

Thread 4243 (idle): "MainThread"
    load_batch (data.py:41)
    train_step (train.py:80)
    <module> (train.py:120)
"""


def doc(host: str, *artifacts: dict) -> dict:
    return {"host": host, "artifacts": list(artifacts)}


def art(name: str, kind: str, data: str, rank: int | None = None, pid: int | None = None) -> dict:
    return {"name": name, "kind": kind, "rank": rank, "pid": pid, "data": data}


DOCS = [
    doc(
        "node-a",
        art("pyspy-4242.txt", "pyspy", RANK0, 0, 4242),
        art("dmesg.txt", "dmesg", "[ 12.3] NVRM: Xid (PCI:0000:3b:00): 79, pid=4242"),
    ),
    doc("node-b", art("pyspy-4243.txt", "pyspy", RANK1, 1, 4243)),
]


@pytest.fixture
def conn(redis_url: str):  # noqa: F811
    c = connect(redis_url)
    c.flushdb()
    return c


@pytest.fixture
def slack() -> Iterator[SlackStandin]:
    with SlackStandin() as s:
        yield s


@pytest.fixture
def service(conn, redis_url: str, slack: SlackStandin) -> Service:  # noqa: F811
    cfg = BotConfig(bot_token=TOKEN, api_url=slack.url, redis_url=redis_url)
    return Service(cfg, redis_client=conn, client=slack_client(cfg))


def incident(service: Service, job: str) -> str:
    """An incident with a thread (the stand-in's post); its thread_ts."""
    service.store.open_or_join(
        DiagnoseRequest(job_id=job, source="slash", requested_by=USER, channel=CHANNEL)
    )
    service.store.set_thread(job, CHANNEL, "1700000000.000042")
    return "1700000000.000042"


# -- keeping them --------------------------------------------------------------------------------------


def test_save_and_load_keep_only_the_pyspy_artifacts_with_a_header_each(conn):
    assert save_stacks(conn, "job-1", DOCS)
    text = load_stacks(conn, "job-1")
    assert text.startswith("==> node-a/pyspy-4242.txt <==\nProcess 4242: ")
    assert "==> node-b/pyspy-4243.txt <==\nProcess 4243: " in text
    assert "all_reduce (torch/distributed/distributed_c10d.py:2288)" in text
    assert "load_batch (data.py:41)" in text
    assert "Xid" not in text and "dmesg" not in text
    assert 0 < conn.ttl(stacks_key("job-1")) <= STACKS_TTL
    assert STACKS_TTL == 7 * 24 * 3600
    assert load_stacks(conn, "job-other") is None


def test_stacks_past_4_mib_are_cut_with_a_note(conn):
    frame = "    all_reduce (torch/distributed/distributed_c10d.py:2288)\n"
    big = RANK0 + frame * (MAX_STACKS_BYTES // len(frame) + 1000)
    save_stacks(conn, "job-big", [doc("node-a", art("pyspy-4242.txt", "pyspy", big, 0, 4242))])
    text = load_stacks(conn, "job-big")
    assert len(text.encode()) <= MAX_STACKS_BYTES == 4 * 1024 * 1024
    assert text.startswith("==> node-a/pyspy-4242.txt <==\nProcess 4242: ")
    assert text.rstrip().endswith("more bytes of stacks not kept (cap 4194304 bytes)]")
    assert "[... cut: " in text


def test_a_newer_diagnosis_without_stacks_forgets_the_old_ones(conn):
    save_stacks(conn, "job-1", DOCS)
    assert not save_stacks(conn, "job-1", [doc("node-a", art("dmesg.txt", "dmesg", "quiet"))])
    assert load_stacks(conn, "job-1") is None


def test_a_finished_diagnosis_keeps_its_stacks(conn, redis_url, monkeypatch):  # noqa: F811
    monkeypatch.setenv("REDIS_URL", redis_url)
    monkeypatch.setattr(
        hq.diagnosis, "diagnose", lambda job, opts, progress=None: (Verdict(job, "hung", []), DOCS)
    )
    hq.set_notifier(lambda inc, verdict, error: None)
    try:
        req = DiagnoseRequest(job_id="job-run", source="cli", requested_by="cli:alice")
        out = hq.run_diagnosis(req.to_dict(), {"samples": 1, "interval": 0})
    finally:
        hq.set_notifier(None)
    assert out["error"] is None and out["verdict"]["status"] == "hung"
    text = load_stacks(conn, "job-run")
    assert "==> node-a/pyspy-4242.txt <==" in text and "==> node-b/pyspy-4243.txt <==" in text


# -- the button ----------------------------------------------------------------------------------------


def test_stacks_button_uploads_the_file_into_the_incident_thread(service, slack, conn):
    ts = incident(service, "job-7")
    save_stacks(conn, "job-7", DOCS)
    service.on_action("stacks", "job-7", USER)

    [url] = slack.calls_to("files.getUploadURLExternal")
    assert url.body["filename"] == "hangdx-job-7-stacks.txt"
    [upload] = [c for c in slack.calls if c.method.startswith("upload/")]
    content = upload.raw.decode()
    assert "==> node-a/pyspy-4242.txt <==" in content and "load_batch (data.py:41)" in content
    assert int(url.body["length"]) == len(upload.raw)
    [done] = slack.calls_to("files.completeUploadExternal")
    assert done.body["channel_id"] == CHANNEL and done.body["thread_ts"] == ts
    [f] = json.loads(done.body["files"])
    assert f["id"] == upload.method.split("/", 1)[1]
    assert "job-7" in f["title"]
    assert not slack.calls_to("chat.postMessage")  # the file is the answer, no extra chatter
    assert service.store.get("job-7").timeline[-1]["event"] == "button_stacks"


def test_stacks_button_without_stacks_says_so_in_one_line(service, slack):
    ts = incident(service, "job-8")
    service.on_action("stacks", "job-8", USER)
    [said] = slack.calls_to("chat.postMessage")
    assert said.body["channel"] == CHANNEL and said.body["thread_ts"] == ts
    assert said.body["text"] == "No stacks kept for job job-8 yet: run a diagnosis first."
    assert not slack.calls_to("files.getUploadURLExternal")
    assert service.store.get("job-8").timeline[-1]["event"] == "button_stacks"


def test_a_secret_in_the_stacks_does_not_reach_slack(service, slack, conn):
    incident(service, "job-9")
    # Kept as-is (as if a node's redaction missed it): the upload must still blank it.
    leaky = RANK0 + "    connect (db.py:12) password=hunter2hunter2\n"
    save_stacks(conn, "job-9", [doc("node-a", art("pyspy-4242.txt", "pyspy", leaky, 0, 4242))])
    assert "hunter2hunter2" in load_stacks(conn, "job-9")
    service.on_action("stacks", "job-9", USER)
    [upload] = [c for c in slack.calls if c.method.startswith("upload/")]
    assert b"password=[REDACTED]" in upload.raw
    assert all(b"hunter2hunter2" not in c.raw for c in slack.calls)


def test_a_failed_upload_is_told_in_one_line(service, slack, conn):
    ts = incident(service, "job-10")
    save_stacks(conn, "job-10", DOCS)
    slack.fail("files.getUploadURLExternal", error="not_allowed_token_type")
    service.on_action("stacks", "job-10", USER)
    [said] = slack.calls_to("chat.postMessage")
    assert said.body["thread_ts"] == ts
    assert said.body["text"] == "Could not upload the stacks of job job-10: not_allowed_token_type"
