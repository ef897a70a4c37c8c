"""Redis restarted mid-incident (killed by PID, started again on its port with its append-only file): the
worker keeps the verdict it was writing (retrying until Redis is back) and goes on working without a
restart; `serve` keeps answering, says Redis is down, refuses alerts with a 503 (Alertmanager sends them
again) and takes them again once Redis is back."""

from __future__ import annotations

import time
import uuid

import requests

from hangdx.bot.diagnosis import DiagnoseOptions
from hangdx.bot.incidents import IncidentStore
from hangdx.bot.request import DiagnoseRequest

from .harness import (
    CHANNEL,
    alert,
    record,
    settle,
    stuck_rq_jobs,
    tally,
    thread_of,
    wait_for,
    wait_until,
    wait_verdicts,
)


def test_redis_restarted_mid_diagnosis_loses_no_verdict_and_no_process(bot, ranks, record_property):
    tag = uuid.uuid4().hex[:6]
    first, second = ranks.job(f"redis-{tag}-a"), ranks.job(f"redis-{tag}-b")
    bot.serve().workers(2)
    store = IncidentStore(bot.conn)
    health = bot.service(DiagnoseOptions()).health
    assert health() == {"ok": True, "redis": "ok"}

    assert alert(bot.url, first).status_code == 202
    # The diagnosis takes three samples 0.7 s apart: Redis goes away while it runs...
    wait_for("the diagnosis to start", lambda: store.get(first).diagnosis == "running", every=0.01)
    bot.rs.kill()
    down_at = time.monotonic()
    # ...and the bot keeps answering meanwhile.
    down = requests.get(bot.url + "/healthz", timeout=5)
    assert down.status_code == 200 and down.json()["redis"].startswith("unavailable")
    state = health()
    assert state["ok"] is False and state["redis"].startswith("unavailable")
    refused = alert(bot.url, second)
    assert refused.status_code == 503 and "unavailable" in refused.json()["error"]
    # Down until the diagnosis has ended and its worker is retrying to keep the verdict, and for longer than
    # the lock's TTL (2 s), so that the lock lapses meanwhile.
    wait_for(
        "the worker to retry keeping the verdict",
        lambda: f"job {first}: keeping the verdict: " in bot.log_text(),
    )
    time.sleep(max(0.0, 3.0 - (time.monotonic() - down_at)))
    bot.rs.start()
    assert health() == {"ok": True, "redis": "ok"}
    assert alert(bot.url, second).status_code == 202  # Alertmanager's retry

    wait_verdicts(bot.slack, bot.conn, [first, second], timeout=90)
    wait_until(lambda: stuck_rq_jobs(bot.conn) == 0, 30)
    settle(2.0)  # a reaper mistaking the lapsed lock for a dead worker would have spoken by now
    counts = tally(bot.conn, bot.slack, [first, second])
    record(record_property, counts)
    assert counts == {**counts, "incidents": 2, "threads": 2, "verdict_posts": 2, "verdicts": 2}
    assert counts["lost"] == 0 and counts["doubled"] == 0 and counts["stuck"] == 0

    # The verdict met the outage and was kept once Redis was back, by the worker that made it.
    inc = store.get(first)
    events = [e["event"] for e in inc.timeline]
    assert events.count("diagnosis_started") == 1 and "diagnosis_requeued" not in events
    assert len(thread_of(bot.slack, inc.thread_ts)) == 1  # the verdict alone: no "queued again"
    # No process died: serve and both workers went on with the same connections' pools, reconnected.
    assert [p.poll() for p in bot.procs.procs] == [None, None, None]


def test_redis_down_longer_than_the_worker_waits_still_loses_no_verdict(bot, ranks, record_property):
    """Past HANGDX_REDIS_WAIT the worker gives the verdict up (to its log) and RQ's loop gives up on Redis;
    the worker process waits for Redis, works again, and the reaper runs the diagnosis once more."""
    job = ranks.job(f"redis-{uuid.uuid4().hex[:6]}-long")
    bot.procs.env["HANGDX_REDIS_WAIT"] = "1"
    bot.workers(1)
    service = bot.service(DiagnoseOptions(samples=3, interval=0.7))
    store = IncidentStore(bot.conn)
    service.submit(DiagnoseRequest(job_id=job, source="alert", requested_by="alertmanager", channel=CHANNEL))
    wait_for("the diagnosis to start", lambda: store.get(job).diagnosis == "running", every=0.01)
    bot.rs.kill()
    wait_for("the worker to give the verdict up", lambda: "the verdict is not kept" in bot.log_text())
    time.sleep(1.0)
    bot.rs.start()

    wait_verdicts(bot.slack, bot.conn, [job], timeout=60)
    wait_until(lambda: stuck_rq_jobs(bot.conn) == 0, 30)
    settle(1.5)
    counts = tally(bot.conn, bot.slack, [job])
    record(record_property, counts)
    assert counts == {**counts, "incidents": 1, "threads": 1, "verdict_posts": 1, "verdicts": 1}
    assert counts["lost"] == 0 and counts["doubled"] == 0 and counts["stuck"] == 0
    events = [e["event"] for e in store.get(job).timeline]
    assert events == ["opened", "diagnosis_started", "diagnosis_requeued", "diagnosis_started", "verdict"]
    log = bot.log_text()
    assert "hangdx worker: lost redis at" in log and "is back; working again" in log
    assert bot.procs.procs[0].poll() is None  # the same worker process, working again
