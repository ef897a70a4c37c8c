"""The work queue with real RQ worker processes, a real redis-server and a real (fake-job) target:
two sleeping processes that say they are ranks 0 and 1 of WORLD_SIZE=3, so rank 2 is missing."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from rq import Worker

from hangdx.bot import queue as hq
from hangdx.bot.diagnosis import DiagnoseOptions, DiagnosisError
from hangdx.bot.incidents import IncidentStore, StoreUnavailable, connect
from hangdx.bot.request import AnalyzeRequest, Busy, DiagnoseRequest

from .test_incidents import needs_redis, redis_url  # noqa: F401  (the session's redis-server)

# Loaded by the worker processes through HANGDX_NOTIFIER: records each call where the test can see it.
NOTIFIER = """
import json, os
import redis

def notify(incident, verdict, error):
    rc = (verdict or {}).get("root_cause") or {}
    redis.Redis.from_url(os.environ["REDIS_URL"]).rpush("test:notified", json.dumps(
        {"job": incident.job_id, "status": incident.status, "category": rc.get("category"),
         "ranks": rc.get("culprit", {}).get("ranks"), "error": error, "pid": os.getpid()}))
"""


def wait_for(what: str, cond: Callable[[], Any], timeout: float = 20.0) -> Any:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        got = cond()
        if got:
            return got
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.fixture
def conn(redis_url: str) -> redis.Redis:  # noqa: F811
    c = redis.Redis.from_url(redis_url, socket_connect_timeout=2)
    c.flushdb()
    return c


@pytest.fixture
def fake_job() -> Iterator[str]:
    """Ranks 0 and 1 of a 3-rank job, sleeping; rank 2 never started."""
    job = f"hdx-test-{uuid.uuid4().hex[:10]}"
    procs = []
    for rank in (0, 1):
        env = {
            **os.environ,
            "HANGDX_JOB_ID": job,
            "RANK": str(rank),
            "WORLD_SIZE": "3",
            "LOCAL_RANK": str(rank),
        }
        code = "import time; print('ready', flush=True); time.sleep(120)"
        procs.append(subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE))
    for p in procs:  # past start-up, so that every sample sees the same sleeping stack
        assert p.stdout.readline() == b"ready\n"
    yield job
    for p in procs:
        os.kill(p.pid, signal.SIGKILL)
        p.wait(timeout=10)
        p.stdout.close()


@pytest.fixture
def workers(redis_url: str, conn: redis.Redis, tmp_path: Path) -> Iterator[list[subprocess.Popen]]:  # noqa: F811
    """Two `python -m hangdx.bot.worker` processes on the session's Redis."""
    (tmp_path / "hdx_test_notifier.py").write_text(NOTIFIER)
    env = {
        **os.environ,
        "REDIS_URL": redis_url,
        "HANGDX_NOTIFIER": "hdx_test_notifier:notify",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")])),
    }
    log = open(tmp_path / "workers.log", "wb")
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "hangdx.bot.worker", redis_url], env=env, stdout=log, stderr=log
        )
        for _ in range(2)
    ]
    try:
        wait_for("two RQ workers", lambda: len(Worker.all(connection=conn)) == 2)
        yield procs
    finally:
        for p in procs:
            if p.poll() is None:
                os.kill(p.pid, signal.SIGTERM)  # RQ's warm shutdown: ends after the current job
        for p in procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.kill(p.pid, signal.SIGKILL)
                p.wait(timeout=10)
        log.close()


def events(store: IncidentStore, job: str) -> list[str]:
    inc = store.get(job)
    return [e["event"] for e in inc.timeline] if inc else []


@needs_redis
def test_workers_diagnose_a_missing_rank_a_repeat_joins_and_a_duplicate_is_skipped(
    conn: redis.Redis, workers: list[subprocess.Popen], fake_job: str
) -> None:
    store = IncidentStore(conn)
    req = DiagnoseRequest(
        job_id=fake_job, source="slash", requested_by="U_ALICE", channel="C1", thread_ts="1.2"
    )
    inc, is_new = store.open_or_join(req)
    assert is_new
    # Three samples a second apart: the first diagnosis is still running when the repeat arrives.
    opts = DiagnoseOptions(samples=3, interval=1.0)
    first = hq.enqueue_diagnosis(conn, req, opts)
    wait_for("the first diagnosis to start", lambda: "diagnosis_started" in events(store, fake_job))
    assert store.locked(fake_job)
    again = DiagnoseRequest(job_id=fake_job, source="mention", requested_by="U_BOB")
    _, is_new = store.open_or_join(again)
    assert not is_new
    # The repeat joins the diagnosis under way: the same RQ job answers both.
    assert hq.queue_diagnosis(conn, again, DiagnoseOptions(samples=1, interval=0)) == (first, True)
    # An RQ job queued around the coalescing (a script, an operator) is not the job's run: skipped.
    dup = (
        hq.queue(conn)
        .enqueue("hangdx.bot.queue.run_diagnosis", again.to_dict(), {"samples": 1, "interval": 0})
        .id
    )
    wait_for("the duplicate to be skipped", lambda: "diagnosis_skipped" in events(store, fake_job))
    wait_for("the verdict", lambda: store.get(fake_job).verdicts)

    inc = store.get(fake_job)
    assert inc.status == "diagnosed" and inc.diagnosis == "done"
    v = inc.latest_verdict
    assert v["job_id"] == fake_job and v["status"] == "hung"
    assert v["root_cause"]["category"] == "rank_crashed"
    assert v["root_cause"]["culprit"]["ranks"] == [2]
    assert [e for e in events(store, fake_job) if e != "request"] == [
        "opened",
        "diagnosis_started",
        "diagnosis_skipped",
        "verdict",
    ]
    skipped = next(e for e in inc.timeline if e["event"] == "diagnosis_skipped")
    assert skipped["detail"] == "not the diagnosis queued for this job"
    wait_for("the lock's release by its owner", lambda: not store.locked(fake_job))
    assert store.runs() == []  # no run left queued or running
    assert hq.queue(conn).fetch_job(dup).return_value() == {"job_id": fake_job, "skipped": True}

    notified = wait_for("the notifier", lambda: conn.lrange("test:notified", 0, -1))
    assert len(notified) == 1  # the joined repeat and the skipped duplicate notify nobody more
    call = json.loads(notified[0])
    assert call == {**call, "job": fake_job, "status": "diagnosed", "category": "rank_crashed", "ranks": [2]}
    assert call["error"] is None and call["pid"] not in (os.getpid(),)
    assert "Rank 2 is gone" in store.markdown(fake_job)


@needs_redis
def test_a_diagnosis_error_is_on_the_timeline_and_notified(
    conn: redis.Redis,
    redis_url: str,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls: list[tuple] = []
    monkeypatch.setenv("REDIS_URL", redis_url)
    hq.set_notifier(lambda inc, verdict, error: calls.append((inc.job_id, inc.status, verdict, error)))
    try:
        req = DiagnoseRequest(job_id="no-such-job-4711", source="cli", requested_by="cli:alice")
        out = hq.run_diagnosis(req.to_dict(), {"samples": 1, "interval": 0, "unknown_option": 1})
    finally:
        hq.set_notifier(None)
    assert out["skipped"] is False and out["verdict"] is None and "no-such-job-4711" in out["error"]
    store = IncidentStore(conn)
    inc = store.get("no-such-job-4711")  # opened by the worker: nobody had opened it
    assert inc.status == "investigating" and inc.diagnosis == "failed"
    assert [e["event"] for e in inc.timeline] == ["opened", "diagnosis_started", "diagnosis_failed"]
    assert inc.timeline[-1]["detail"] == out["error"]
    assert calls == [("no-such-job-4711", "investigating", None, out["error"])]
    assert not store.locked("no-such-job-4711") and store.in_flight() == [] and store.runs() == []


@needs_redis
def test_enqueue_rejects_a_bad_job_id_and_uses_json(conn: redis.Redis) -> None:
    with pytest.raises(DiagnosisError):
        hq.enqueue_diagnosis(
            conn, DiagnoseRequest(job_id="x; rm -rf /", source="cli", requested_by="me"), DiagnoseOptions()
        )
    jid = hq.enqueue_diagnosis(
        conn, DiagnoseRequest(job_id="j1", source="cli", requested_by="me"), DiagnoseOptions()
    )
    raw = conn.hget(f"rq:job:{jid}", "data")
    assert json.loads(zlib.decompress(raw))[0] == "hangdx.bot.queue.run_diagnosis"  # JSON, not pickle
    assert hq.queue(conn).count == 1
    # Asked again before a worker took it: the same queued diagnosis, not a second one.
    again = DiagnoseRequest(job_id="j1", source="alert", requested_by="alertmanager")
    assert hq.enqueue_diagnosis(conn, again, DiagnoseOptions()) == jid and hq.queue(conn).count == 1


def test_worker_and_enqueue_fail_fast_without_redis() -> None:
    from hangdx.bot.worker import main

    started = time.monotonic()
    assert main("redis://127.0.0.1:1/0") == 1
    dead = connect("redis://127.0.0.1:1/0", timeout=1.0)
    with pytest.raises(StoreUnavailable, match="work queue is unavailable"):
        hq.enqueue_diagnosis(
            dead, DiagnoseRequest(job_id="j1", source="cli", requested_by="me"), DiagnoseOptions()
        )
    assert time.monotonic() - started < 10


def _paste(user: str, thread: str) -> AnalyzeRequest:
    return AnalyzeRequest(channel="C0HANGDX01", thread_ts=thread, requested_by=user, source="mention")


@needs_redis
def test_pastes_wait_behind_hang_diagnoses_and_are_limited_per_person_and_thread(conn: redis.Redis) -> None:
    # Hardening 21.9: 20 `@hangdx analyze` from one user delayed an alert's diagnosis from 1 s to 294 s.
    conn.flushdb()
    ids = [hq.queue_analysis(conn, _paste("U1", f"1700000000.00000{i}")) for i in range(3)]
    with pytest.raises(Busy, match="3 analyses waiting"):
        hq.queue_analysis(conn, _paste("U1", "1700000000.000009"))
    hq.queue_analysis(conn, _paste("U2", "1700000000.000000"))  # another person, a thread with one waiting
    with pytest.raises(Busy, match="this thread has 2"):
        hq.queue_analysis(conn, _paste("U3", "1700000000.000000"))
    alert = hq.enqueue_diagnosis(
        conn, DiagnoseRequest(job_id="j9", source="alert", requested_by="alertmanager"), DiagnoseOptions()
    )
    # The order a worker takes them in: the diagnosis queued last is taken first.
    taken = []
    for q in hq.worker_queues(conn):
        taken += q.get_job_ids()
    assert taken[0] == alert and set(taken[1:]) >= set(ids), taken
    worker = Worker(hq.worker_queues(conn), connection=conn, serializer=hq.JSONSerializer)
    job, q = worker.dequeue_job_and_maintain_ttl(timeout=1)
    assert job.id == alert and q.name == hq.QUEUE
