"""A worker SIGKILLed mid-diagnosis (the node under it lost): its lock lapses within the lock TTL, a reaper
queues the diagnosis again, once, and says so once in the thread; another worker answers, once. When every
try dies, the incident is marked interrupted with Re-run advice. RQ's own abandoned-job handling never runs
the diagnosis a second time."""

from __future__ import annotations

import uuid

import pytest
from rq.registry import FailedJobRegistry, FinishedJobRegistry

from hangdx.bot.incidents import IncidentStore
from hangdx.bot.queue import queue

from .harness import (
    alert,
    kill_pid,
    parents_of,
    record,
    run_record,
    settle,
    stuck_rq_jobs,
    tally,
    thread_of,
    verdict_posts,
    wait_for,
    wait_until,
    wait_verdicts,
)

REQUEUED = "stopped answering; the diagnosis is queued again"


def _starts(store: IncidentStore, job: str) -> int:
    inc = store.get(job)
    return [e["event"] for e in inc.timeline].count("diagnosis_started") if inc else 0


def _kill_runner(bot, job: str, nth: int, worker_too: bool = True) -> str:
    """SIGKILL the work horse running the job's diagnosis (and, `worker_too`, the RQ worker above it, as when
    its node dies) as soon as its `nth` start is on the timeline; the RQ job id it was running."""
    store = IncidentStore(bot.conn)
    wait_for(f"start {nth} of the diagnosis", lambda: _starts(store, job) >= nth)
    rec = run_record(bot.conn, job)
    assert rec["state"] == "running"
    horse, worker = int(rec["pid"]), int(rec["ppid"])
    [proc] = [p for p in bot.procs.procs if p.pid == worker]
    kill_pid(horse)
    if worker_too:
        kill_pid(worker)
        proc.wait(timeout=10)
    return rec["rq_job"]


@pytest.mark.parametrize("worker_too", [True, False], ids=["node-lost", "horse-oom-killed"])
def test_a_worker_killed_mid_diagnosis_is_requeued_once_and_answered_once(
    bot, ranks, record_property, worker_too
):
    job = ranks.job(f"kill-{uuid.uuid4().hex[:6]}")
    bot.serve().workers(2)
    assert alert(bot.url, job).status_code == 202
    killed = _kill_runner(bot, job, 1, worker_too)

    wait_verdicts(bot.slack, bot.conn, [job], timeout=60)
    wait_until(lambda: stuck_rq_jobs(bot.conn) == 0, 30)
    settle(1.5)  # time for a doubled post or a second re-queue to show
    counts = tally(bot.conn, bot.slack, [job])
    record(record_property, counts)
    assert counts == {**counts, "incidents": 1, "threads": 1, "verdict_posts": 1, "verdicts": 1}
    assert counts["lost"] == 0 and counts["doubled"] == 0 and counts["stuck"] == 0

    inc = IncidentStore(bot.conn).get(job)
    assert inc.status == "diagnosed" and inc.diagnosis == "done"
    assert inc.latest_verdict["root_cause"]["category"] == "rank_crashed"
    assert inc.latest_verdict["root_cause"]["culprit"]["ranks"] == [1]
    events = [e["event"] for e in inc.timeline if e["event"] != "request"]
    assert events == ["opened", "diagnosis_started", "diagnosis_requeued", "diagnosis_started", "verdict"]
    # One line in the thread says what happened, then the one verdict.
    replies = thread_of(bot.slack, inc.thread_ts)
    assert [REQUEUED in c.body["text"] for c in replies] == [True, False]
    assert (
        replies[0].body["text"].endswith("(try 2 of 2).")
        and replies[1] is verdict_posts(bot.slack, inc.thread_ts)[0]
    )
    # RQ: the dead worker's job is failed (abandoned), the re-queued one finished, nothing else ran.
    q = queue(bot.conn)
    assert FailedJobRegistry(queue=q).get_job_ids() == [killed]
    [done] = FinishedJobRegistry(queue=q).get_job_ids()
    assert done != killed
    assert q.fetch_job(done).return_value()["skipped"] is False
    # RQ handing the dead worker's job out again (its abandoned-job retry, or `rq requeue`) runs nothing twice.
    FailedJobRegistry(queue=q).requeue(killed)
    wait_for("the requeued RQ job to end", lambda: q.fetch_job(killed).get_status() == "finished")
    assert q.fetch_job(killed).return_value() == {"job_id": job, "skipped": True}
    settle(1.0)
    assert tally(bot.conn, bot.slack, [job]) == counts
    assert IncidentStore(bot.conn).get(job).timeline[-1]["detail"] == "not the diagnosis queued for this job"


def test_a_diagnosis_whose_every_try_dies_ends_interrupted_with_rerun_advice(bot, ranks, record_property):
    job = ranks.job(f"kill-{uuid.uuid4().hex[:6]}")
    bot.serve().workers(2)  # serve's reaper is the one left to notice the second death
    assert alert(bot.url, job).status_code == 202
    first = _kill_runner(bot, job, 1)
    second = _kill_runner(bot, job, 2)
    store = IncidentStore(bot.conn)
    wait_for("the incident marked interrupted", lambda: store.get(job).diagnosis == "interrupted", timeout=30)
    settle(1.5)
    counts = tally(bot.conn, bot.slack, [job], expect_verdict=False)
    record(record_property, counts)
    assert counts["incidents"] == 1 and counts["threads"] == 1 and counts["verdict_posts"] == 0
    assert counts["lost"] == 0 and counts["doubled"] == 0 and counts["stuck"] == 0

    inc = store.get(job)
    assert inc.verdicts == [] and inc.status == "investigating"
    events = [e["event"] for e in inc.timeline if e["event"] != "request"]
    assert events == [
        "opened",
        "diagnosis_started",
        "diagnosis_requeued",
        "diagnosis_started",
        "diagnosis_interrupted",
    ]
    [parent] = parents_of(bot.slack, job)
    said = [c.body["text"] for c in thread_of(bot.slack, inc.thread_ts)]
    assert len(said) == 2 and REQUEUED in said[0]
    assert said[1] == (
        f"The diagnosis of job {job} was interrupted (its worker stopped answering, 2 tries); "
        f"press Re-run or /diagnose {job}."
    )
    assert sorted(FailedJobRegistry(queue=queue(bot.conn)).get_job_ids()) == sorted([first, second])
    assert IncidentStore(bot.conn).runs() == []  # nothing left for a reaper: no third try, ever
