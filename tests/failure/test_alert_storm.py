"""Many alerts at once: 10 for the same job within a second make one incident, one thread, one diagnosis and
one verdict message; 50 for 50 jobs at once, on three workers, make 50 of each, none lost, none doubled."""

from __future__ import annotations

import threading
import uuid

from rq.registry import FailedJobRegistry, FinishedJobRegistry

from hangdx.bot.diagnosis import DiagnoseOptions
from hangdx.bot.incidents import IncidentStore
from hangdx.bot.queue import queue
from hangdx.bot.request import DiagnoseRequest

from .harness import (
    CHANNEL,
    alert,
    record,
    settle,
    stuck_rq_jobs,
    tally,
    thread_of,
    wait_until,
    wait_verdicts,
)


def _at_once(n: int, fn) -> list:  # noqa: ANN001
    """fn(i) for i in range(n), from n threads released together; the results in order."""
    barrier = threading.Barrier(n)
    out: list = [None] * n

    def one(i: int) -> None:
        barrier.wait()
        out[i] = fn(i)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    return out


def test_ten_alerts_for_one_job_within_a_second_make_one_incident_and_one_verdict(
    bot, ranks, record_property
):
    job = ranks.job(f"storm-{uuid.uuid4().hex[:6]}")
    bot.serve().workers(2)
    answers = _at_once(10, lambda i: alert(bot.url, job))
    assert [a.status_code for a in answers] == [202] * 10
    ids = {a.json()["accepted"][0]["id"] for a in answers}
    wait_verdicts(bot.slack, bot.conn, [job])
    wait_until(lambda: stuck_rq_jobs(bot.conn) == 0, 30)
    settle(1.5)
    counts = tally(bot.conn, bot.slack, [job])
    record(record_property, counts)
    assert counts == {**counts, "incidents": 1, "threads": 1, "verdict_posts": 1, "verdicts": 1}
    assert counts["lost"] == 0 and counts["doubled"] == 0 and counts["stuck"] == 0
    assert len(ids) == 1, "every alert joined the one diagnosis"

    inc = IncidentStore(bot.conn).get(job)
    events = [e["event"] for e in inc.timeline]
    assert events.count("opened") == 1 and events.count("request") == 9
    assert events.count("diagnosis_started") == 1 and events.count("verdict") == 1
    assert "diagnosis_skipped" not in events
    # The thread holds the verdict and nothing else: repeated alerts are on the timeline, not in Slack.
    assert len(thread_of(bot.slack, inc.thread_ts)) == 1
    q = queue(bot.conn)
    assert FinishedJobRegistry(queue=q).get_job_ids() == list(ids) and FailedJobRegistry(queue=q).count == 0


def test_a_repeated_alert_after_the_verdict_is_on_the_timeline_not_a_second_diagnosis(bot, ranks):
    # Alertmanager resends a firing group every repeat_interval (4 h by default) while the job stays hung.
    job = ranks.job(f"repeat-{uuid.uuid4().hex[:6]}")
    bot.serve().workers(1)
    first = alert(bot.url, job)
    assert first.status_code == 202 and first.json()["accepted"][0]["id"]
    wait_verdicts(bot.slack, bot.conn, [job])
    wait_until(lambda: stuck_rq_jobs(bot.conn) == 0, 30)
    again = alert(bot.url, job)
    assert again.status_code == 202 and again.json()["accepted"][0]["id"] == ""
    settle(1.5)
    inc = IncidentStore(bot.conn).get(job)
    events = [e["event"] for e in inc.timeline]
    assert events.count("request") == 1 and events.count("diagnosis_started") == 1
    assert len(inc.verdicts) == 1 and len(thread_of(bot.slack, inc.thread_ts)) == 1
    assert FinishedJobRegistry(queue=queue(bot.conn)).count == 1


def test_fifty_incidents_at_once_on_three_workers(bot, ranks, record_property):
    tag = uuid.uuid4().hex[:6]
    jobs = [ranks.job(f"many-{tag}-{i:02d}") for i in range(50)]
    bot.workers(3)
    # What `serve` does for each alert, from 50 threads at once; one quick sample per diagnosis.
    service = bot.service(DiagnoseOptions(samples=1, interval=0))

    def submit(i: int) -> str:
        req = DiagnoseRequest(job_id=jobs[i], source="alert", requested_by="alertmanager", channel=CHANNEL)
        return service.submit(req)

    ids = _at_once(50, submit)
    assert len(set(ids)) == 50
    wait_verdicts(bot.slack, bot.conn, jobs, timeout=120)
    wait_until(lambda: stuck_rq_jobs(bot.conn) == 0, 30)
    settle(1.0)
    counts = tally(bot.conn, bot.slack, jobs)
    record(record_property, counts)
    assert counts == {**counts, "incidents": 50, "threads": 50, "verdict_posts": 50, "verdicts": 50}
    assert counts["lost"] == 0 and counts["doubled"] == 0 and counts["stuck"] == 0
    store = IncidentStore(bot.conn)
    for job in jobs:
        v = store.get(job).latest_verdict
        assert v["job_id"] == job and v["root_cause"]["culprit"]["ranks"] == [1]
    # The work was shared, and every RQ job ran exactly once.
    q = queue(bot.conn)
    finished = FinishedJobRegistry(queue=q).get_job_ids()
    assert sorted(finished) == sorted(ids) and FailedJobRegistry(queue=q).count == 0
    workers = {q.fetch_job(i).worker_name for i in finished}
    assert len(workers) >= 2
