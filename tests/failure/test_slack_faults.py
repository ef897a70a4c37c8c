"""Slack answering 429 (rate limited, Retry-After) and 500 while incidents open and verdicts are posted: every
message lands exactly once, none lost, none doubled (the stand-in's record, failed attempts left out)."""

from __future__ import annotations

import threading
import uuid

from hangdx.bot.incidents import IncidentStore

from .harness import (
    alert,
    record,
    settle,
    stuck_rq_jobs,
    tally,
    thread_of,
    wait_until,
    wait_verdicts,
)


def test_429_and_500_from_slack_neither_lose_nor_double_a_message(bot, ranks, record_property):
    tag = uuid.uuid4().hex[:6]
    jobs = [ranks.job(f"slack-{tag}-{i}") for i in range(4)]
    bot.serve().workers(2)
    slack = bot.slack
    # slack_sdk's retry handlers share one attempt count per call (server errors: 2 retries, rate limits: 3),
    # so a run of failures one call could meet alone stays within that budget: a 500 first, then 429s.
    # The threads' first messages: a server error, then rate limited.
    slack.fail("chat.postMessage", status=500, times=1)
    slack.fail("chat.postMessage", status=429, retry_after=1, times=1)
    # The verdicts: a server error and two rate limits, whichever verdict posts meet them.
    slack.fail_verdicts(500, times=1)
    slack.fail_verdicts(429, retry_after=1, times=2)
    # The parent messages edited in place: a server error.
    slack.fail("chat.update", status=500, times=1)

    answers: list = []
    threads = [threading.Thread(target=lambda j=j: answers.append(alert(bot.url, j))) for j in jobs]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert sorted(a.status_code for a in answers) == [202] * 4
    wait_verdicts(slack, bot.conn, jobs, timeout=90)
    wait_until(lambda: stuck_rq_jobs(bot.conn) == 0, 30)
    settle(1.5)

    counts = tally(bot.conn, slack, jobs)
    record(record_property, counts)
    # Every scripted failure was met (and retried): 2 by parents, 3 by verdicts, 1 by an edit.
    failed = [c for c in slack.calls if id(c) in slack.failed]
    assert len(failed) == 6
    assert sum(bool(c.body.get("blocks")) for c in failed if c.method == "chat.postMessage") == 3
    assert counts == {**counts, "incidents": 4, "threads": 4, "verdict_posts": 4, "verdicts": 4}
    assert counts["lost"] == 0 and counts["doubled"] == 0 and counts["stuck"] == 0
    store = IncidentStore(bot.conn)
    for job in jobs:
        inc = store.get(job)
        assert inc.status == "diagnosed" and len(inc.verdicts) == 1
        [reply] = thread_of(slack, inc.thread_ts)  # the verdict, and nothing else (no "could not" line)
        assert job in reply.body["text"] and "rank_crashed" in reply.body["text"]
