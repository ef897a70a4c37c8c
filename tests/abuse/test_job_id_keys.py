"""Issue row 13: a job id that names another job's Redis keys.

Job ids may hold `:` (bot/diagnosis.py JOB_ID), and keys were `hangdx:incident:<job>` with the timeline at
`hangdx:incident:<job>:timeline`: `/diagnose 123456:timeline` made job 123456's timeline key a hash, and every
later alert or `/diagnose 123456` failed with WRONGTYPE. Job ids are now encoded in keys; an id of letters,
digits and `@+._-` (every Slurm id) keeps the key it always had, so incidents stored before still read."""

from __future__ import annotations

import json

import pytest

from hangdx.bot.artifacts import stacks_key
from hangdx.bot.incidents import IncidentStore, connect
from hangdx.bot.request import DiagnoseRequest

from .harness import ONCALL, live_bot

VICTIM = "123456"
# Every suffix or layout piece a key of job 123456 has, or an archive of it would have.
SUFFIXES = [":timeline", ":verdicts", ":timeline:x", ":1700000000000", ":1700000000000:timeline"]
VERDICT = {
    "job_id": VICTIM,
    "status": "hung",
    "root_cause": {
        "category": "rank_crashed",
        "summary": "Rank 2 is gone.",
        "confidence": 0.9,
        "culprit": {"ranks": [2], "hosts": ["gpu-node-03"], "gpus": [], "links": []},
        "fix": "Restart from the last checkpoint.",
    },
    "findings": [],
}


@pytest.fixture
def store(redis_url: str) -> IncidentStore:
    client = connect(redis_url)
    client.flushdb()
    return IncidentStore(client)


def _ask(store: IncidentStore, job: str, who: str = "U1") -> None:
    store.open_or_join(DiagnoseRequest(job_id=job, source="slash", requested_by=who))


def _victim_works(store: IncidentStore, requests: int) -> None:
    """What the on-call would see of job 123456: its incident, every request on its timeline, its verdict."""
    _ask(store, VICTIM, "U9")
    store.add_verdict(VICTIM, VERDICT)
    store.set_status(VICTIM, "acknowledged", "U9")
    inc = store.get(VICTIM)
    assert inc is not None and inc.job_id == VICTIM and inc.status == "acknowledged"
    assert [e["event"] for e in inc.timeline].count("request") + 1 == requests + 1
    assert inc.latest_verdict["root_cause"]["summary"] == "Rank 2 is gone."


@pytest.mark.parametrize("suffix", SUFFIXES)
@pytest.mark.parametrize("first", ["hostile", "victim"])
def test_a_job_id_cannot_reach_another_jobs_keys(store: IncidentStore, suffix, first, hostile_inputs) -> None:
    hostile = VICTIM + suffix
    if first == "victim":
        _ask(store, VICTIM)
    _ask(store, hostile)
    store.add_verdict(hostile, {**VERDICT, "job_id": hostile})
    store.set_status(hostile, "resolved", "U2")
    _ask(store, hostile)  # archives the resolved one
    _victim_works(store, requests=1 if first == "victim" else 0)
    assert store.get(hostile).job_id == hostile
    assert (
        stacks_key(hostile) != stacks_key(VICTIM) and ":" not in stacks_key(hostile)[len("hangdx:stacks:") :]
    )


def test_incidents_stored_under_the_old_layout_still_read(store: IncidentStore) -> None:
    """Keys written before the encoding (a plain Slurm id, a het job `123+0`, an array task) are the same keys."""
    for job in ("4242", "123+0", "4242_7", "run-a.b@c"):
        store.r.hset(
            f"hangdx:incident:{job}",
            mapping={"job_id": job, "status": "investigating", "created": "1.0", "updated": "1.0"},
        )
        store.r.rpush(
            f"hangdx:incident:{job}:timeline", json.dumps({"time": 1.0, "actor": "U1", "event": "opened"})
        )
        inc = store.get(job)
        assert inc is not None and inc.job_id == job and inc.timeline[0]["event"] == "opened"


def test_diagnose_of_a_colon_id_leaves_the_other_job_answering(redis_url: str) -> None:
    """The story of the issue, through the live bot: /diagnose 123456:timeline, then an alert and a /diagnose
    for 123456 both work (before, both failed with WRONGTYPE)."""
    with live_bot(redis_url) as bot:
        assert bot.command(VICTIM + ":timeline").status_code == 200
        bot.wait(lambda: VICTIM + ":timeline" in bot.incidents())
        r = bot.alert(json.dumps({"job_id": VICTIM, "summary": "no step for 15m"}))
        assert r.status_code == 202, r.text
        assert bot.command(VICTIM, user=ONCALL).status_code == 200
        assert bot.wait(lambda: VICTIM in bot.incidents())
        inc = bot.service.store.get(VICTIM)
        assert inc is not None and len(inc.timeline) >= 2, inc
        assert "WRONGTYPE" not in json.dumps([c.body for c in bot.slack.calls])
