"""Incidents in a real redis-server (started here on a free loopback port, killed by PID)."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import pytest

from hangdx.bot.incidents import IncidentStore, InvalidTransition, StoreUnavailable, connect
from hangdx.bot.request import DiagnoseRequest

REDIS = shutil.which("redis-server")
needs_redis = pytest.mark.skipif(
    REDIS is None, reason="redis-server is not installed (apt-get install redis-server)"
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_redis(tmp: str) -> tuple[subprocess.Popen, str]:
    """A throwaway redis-server in `tmp`; returns it and its URL once it answers."""
    port = _free_port()
    cmd = [REDIS, *f"--port {port} --bind 127.0.0.1 --appendonly no".split(), "--save", "", "--dir", tmp]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"redis://127.0.0.1:{port}/0"
    client = connect(url, timeout=0.5)
    for _ in range(100):
        try:
            client.ping()
            return proc, url
        except Exception:
            if proc.poll() is not None:
                raise RuntimeError(f"redis-server exited with {proc.returncode}") from None
            time.sleep(0.05)
    stop_redis(proc)
    raise RuntimeError("redis-server did not answer within 5 s")


def stop_redis(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=10)


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    if REDIS is None:
        pytest.skip("redis-server is not installed (apt-get install redis-server)")
    proc, url = start_redis(str(tmp_path_factory.mktemp("redis")))
    yield url
    stop_redis(proc)


@pytest.fixture
def store(redis_url: str) -> IncidentStore:
    client = connect(redis_url)
    client.flushdb()
    return IncidentStore(client)


def req(job: str = "job-1", who: str = "U1", source: str = "slash", **kw) -> DiagnoseRequest:
    return DiagnoseRequest(job_id=job, source=source, requested_by=who, **kw)


VERDICT = {
    "job_id": "job-1",
    "status": "hung",
    "root_cause": {
        "category": "rank_crashed",
        "summary": "Rank 2 is gone (no process found of WORLD_SIZE=3) while ranks 0, 1 are sleeping.",
        "confidence": 0.88,
        "culprit": {"ranks": [2], "hosts": ["node-b"], "gpus": [], "links": []},
        "fix": "Find why rank 2 died, then restart from the last checkpoint.",
    },
    "findings": [
        {
            "playbook": "rank_crashed",
            "category": "rank_crashed",
            "confidence": 0.88,
            "summary": "Rank 2 is gone (no process found of WORLD_SIZE=3) while ranks 0, 1 are sleeping.",
            "culprit": {"ranks": [2], "hosts": ["node-b"], "gpus": [], "links": []},
            "evidence": [{"source": "node-b/torchrun.log", "line": 7, "text": "exitcode: -9 (pid: 4242)"}],
            "fix": "Find why rank 2 died, then restart from the last checkpoint.",
            "next_steps": ["Check dmesg on node-b for an OOM kill."],
        },
        {
            "playbook": "straggler",
            "category": "straggler",
            "confidence": 0.3,
            "summary": "Rank 1 lags.",
            "culprit": {"ranks": [1], "hosts": [], "gpus": [], "links": []},
            "evidence": [],
            "fix": "",
            "next_steps": [],
        },
    ],
    "gaps": [],
}


@needs_redis
def test_ten_concurrent_requests_make_one_incident(store: IncidentStore) -> None:
    barrier = threading.Barrier(10)
    results: list[bool] = []

    def ask(i: int) -> None:
        barrier.wait()
        _, is_new = store.open_or_join(req(who=f"U{i}", source="alert", summary=f"alert {i}"))
        results.append(is_new)

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(10)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(results) == [False] * 9 + [True]
    inc = store.get("job-1")
    assert inc is not None and inc.status == "investigating"
    assert len(inc.timeline) == 10
    assert [e["event"] for e in inc.timeline].count("opened") == 1
    assert {e["actor"] for e in inc.timeline} == {f"U{i}" for i in range(10)}
    assert [i.job_id for i in store.list_open()] == ["job-1"]


@needs_redis
def test_ten_concurrent_claims_make_one_diagnosis_run(store: IncidentStore) -> None:
    barrier = threading.Barrier(10)
    results: list[tuple[str, bool]] = []

    def claim(i: int) -> None:
        barrier.wait()
        results.append(store.claim_run("job-1", f"rq-{i}", {"job_id": "job-1"}, {}))

    threads = [threading.Thread(target=claim, args=(i,)) for i in range(10)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    [winner] = [rq for rq, claimed in results if claimed]
    assert sorted(results) == sorted([(winner, True)] + [(winner, False)] * 9)
    assert [(job, rec["rq_job"], rec["state"]) for job, rec in store.runs()] == [("job-1", winner, "queued")]
    # Only the claimed RQ job may start it; once it ended, a new request claims a new run.
    store.open_or_join(req())
    assert store.start_run("job-1", "rq-x", "t", 5, request={}, options={}, worker="w", detail="") == -1
    assert store.start_run("job-1", winner, "t", 5, request={}, options={}, worker="w", detail="") == 1
    assert store.locked("job-1") and store.claim_run("job-1", "rq-y", {}, {}) == (winner, False)
    assert store.finish_run("job-1", "t", winner, None, "no such job") is True
    assert not store.locked("job-1") and store.runs() == []
    assert store.get("job-1").diagnosis == "failed"
    assert store.claim_run("job-1", "rq-z", {}, {}) == ("rq-z", True)


@needs_redis
def test_join_keeps_thread_and_a_resolved_incident_is_archived(store: IncidentStore) -> None:
    inc, is_new = store.open_or_join(req(channel="C1", thread_ts="1.5"))
    assert is_new and (inc.channel, inc.thread_ts) == ("C1", "1.5")
    inc, is_new = store.open_or_join(req(who="U2", channel="C9"))
    assert not is_new and inc.channel == "C1" and inc.last_request["requested_by"] == "U2"
    store.set_status("job-1", "resolved", "U1")
    assert store.list_open() == []
    inc, is_new = store.open_or_join(req(who="U3"))
    assert is_new and inc.status == "investigating" and len(inc.timeline) == 1 and inc.channel is None
    archived = [k.decode() for k in store.r.keys("hangdx:archive:job-1:*")]
    assert len(archived) == 2  # the old hash and its timeline (no verdicts were kept)


@needs_redis
def test_status_transitions_owner_and_actors(store: IncidentStore) -> None:
    store.open_or_join(req(who="alertmanager", source="alert"))
    store.set_thread("job-1", "C42", "1700000000.000100")
    store.add_verdict("job-1", VERDICT)
    assert store.get("job-1").status == "diagnosed"
    assert store.set_status("job-1", "acknowledged", "U_ALICE") == "diagnosed"
    store.hand_off("job-1", "U_BOB", actor="U_ALICE")
    store.add_verdict("job-1", VERDICT)  # a re-diagnosis keeps the human status
    inc = store.get("job-1")
    assert inc.status == "acknowledged" and inc.owner == "U_BOB"
    assert (inc.channel, inc.thread_ts) == ("C42", "1700000000.000100")
    assert store.set_status("job-1", "resolved", "U_BOB") == "acknowledged"
    with pytest.raises(InvalidTransition):
        store.set_status("job-1", "investigating", "U_BOB")
    with pytest.raises(InvalidTransition):
        store.set_status("job-1", "closed", "U_BOB")
    with pytest.raises(InvalidTransition):
        store.set_status("nope", "resolved", "U_BOB")
    with pytest.raises(KeyError):
        store.add_event("nope", "U1", "note")
    tl = store.get("job-1").timeline
    assert [(e["actor"], e["event"]) for e in tl] == [
        ("alertmanager", "opened"),
        ("hangdx", "verdict"),
        ("U_ALICE", "acknowledged"),
        ("U_ALICE", "handed_off"),
        ("hangdx", "verdict"),
        ("U_BOB", "resolved"),
    ]
    assert tl[1]["detail"] == "hung: rank_crashed (rank 2; host node-b)"
    assert all(tl[i]["time"] <= tl[i + 1]["time"] for i in range(len(tl) - 1))


@needs_redis
def test_verdicts_are_capped_newest_last(store: IncidentStore) -> None:
    store.open_or_join(req())
    for i in range(25):
        store.add_verdict("job-1", {**VERDICT, "n": i})
    inc = store.get("job-1")
    assert [v["n"] for v in inc.verdicts] == list(range(5, 25))
    assert inc.latest_verdict["n"] == 24


@needs_redis
def test_markdown_export(store: IncidentStore) -> None:
    store.open_or_join(req(who="U_ALICE", channel="C42", thread_ts="17.1", summary="NCCL watchdog fired"))
    store.add_verdict("job-1", VERDICT)
    store.set_status("job-1", "acknowledged", "U_ALICE")
    md = store.markdown("job-1")
    assert md.startswith("# Incident: job job-1\n")
    assert "- **Status:** acknowledged" in md
    assert "- **Owner:** U_ALICE" in md
    assert "**Root cause:** `rank_crashed` (confidence 0.88)" in md
    assert "**Culprit:** rank 2; host node-b" in md
    assert "node-b/torchrun.log:7  exitcode: -9 (pid: 4242)" in md
    assert "- `straggler` (0.30): Rank 1 lags." in md
    assert "| U_ALICE | opened | slash: NCCL watchdog fired |" in md
    with pytest.raises(KeyError):
        store.markdown("nope")


@needs_redis
def test_lock_exclusive_owner_release_and_ttl(store: IncidentStore) -> None:
    token = store.acquire("job-1", ttl=30)
    assert token and store.locked("job-1")
    assert store.acquire("job-1", ttl=30) is None
    with store.lock("job-1", 30) as got:
        assert got is False
    assert store.locked("job-1")  # the failed context manager did not release someone else's lock
    assert store.release("job-1", "not-the-token") is False and store.locked("job-1")
    assert store.release("job-1", token) is True and not store.locked("job-1")
    with store.lock("job-1", 30) as got:
        assert got is True and store.acquire("job-1", 30) is None
    assert not store.locked("job-1")
    # An expired lock is free again, and its first owner cannot release the new owner's lock.
    old = store.acquire("job-1", ttl=0.2)
    time.sleep(0.35)
    new = store.acquire("job-1", ttl=30)
    assert new is not None
    assert store.release("job-1", old) is False and store.locked("job-1")
    assert store.release("job-1", new) is True


CRASH = """
import os, sys
from hangdx.bot.incidents import IncidentStore, connect
from hangdx.bot.request import DiagnoseRequest
store = IncidentStore(connect(sys.argv[1]))
store.open_or_join(DiagnoseRequest(job_id=sys.argv[2], source="slash", requested_by="U1"))
assert store.acquire(sys.argv[2], 1.0)
store.add_event(sys.argv[2], "hangdx", "diagnosis_started", "crashing worker", diagnosis="running")
os._exit(137)
"""


@needs_redis
def test_in_flight_after_a_crash(store: IncidentStore, redis_url: str) -> None:
    store.open_or_join(req("done-job"))
    store.add_event("done-job", "hangdx", "diagnosis_started", diagnosis="running")
    store.add_verdict("done-job", VERDICT)
    proc = subprocess.run([sys.executable, "-c", CRASH, redis_url, "crashed-job"], timeout=30)
    assert proc.returncode == 137
    restarted = IncidentStore(connect(redis_url))
    assert [i.job_id for i in restarted.in_flight()] == ["crashed-job"]
    restarted.mark_interrupted("crashed-job")
    assert restarted.in_flight() == []
    inc = restarted.get("crashed-job")
    assert inc.diagnosis == "interrupted" and inc.timeline[-1]["event"] == "diagnosis_interrupted"
    time.sleep(1.1)  # the dead worker's lock runs out by itself
    assert not restarted.locked("crashed-job")


@needs_redis
def test_redis_down_raises_store_unavailable(tmp_path) -> None:
    proc, url = start_redis(str(tmp_path))
    try:
        store = IncidentStore(connect(url, timeout=1.0))
        store.open_or_join(req())
    finally:
        stop_redis(proc)
    started = time.monotonic()
    for call in (
        lambda: store.get("job-1"),
        lambda: store.open_or_join(req()),
        lambda: store.acquire("job-1", 5),
    ):
        with pytest.raises(StoreUnavailable, match=r"redis at 127\.0\.0\.1:\d+ is unavailable"):
            call()
    assert time.monotonic() - started < 10


def test_an_alert_storm_does_not_grow_the_timeline_without_bound(store: IncidentStore) -> None:
    """Issue 10.9: 200,000 requests on one incident made each lookup read 200,000 timeline entries."""
    from hangdx.bot.incidents import TIMELINE_MAX

    for i in range(TIMELINE_MAX + 300):
        store.open_or_join(req("storm", who=f"U{i % 5}", source="alert"))
    store.add_event("storm", "U1", "button_ack")
    inc = store.get("storm")
    assert len(inc.timeline) == TIMELINE_MAX
    assert inc.timeline[-1]["event"] == "button_ack"  # the latest are the ones kept
    assert store.r.llen("hangdx:incident:storm:timeline") == TIMELINE_MAX


def test_status_reads_one_line_per_incident_not_its_timeline(store: IncidentStore) -> None:
    from hangdx.bot.incidents import _key

    # Hardening 21.6: `/diagnose status` with 2,000 open incidents of 1,000 events each read every timeline (39 s).
    for n in range(30):
        job = f"job-{n}"
        store.open_or_join(req(job))
        pipe = store.r.pipeline()
        for i in range(1000):
            pipe.rpush(_key(job) + ":timeline", f'{{"time": {i}, "actor": "x", "event": "note"}}')
        pipe.execute()
        for cat in ("io_stall", "gpu_fault"):
            rc = {"category": cat, "summary": f"{cat} on {job}", "confidence": 0.9, "fix": "f",
                  "culprit": {"ranks": [n], "hosts": [], "gpus": [], "links": []}}  # fmt: skip
            store.add_verdict(job, {"job_id": job, "status": "hung", "root_cause": rc, "findings": []})
    store.set_status("job-7", "resolved", "U1")
    incs = store.open_summaries()
    assert [i.job_id for i in incs] == [f"job-{n}" for n in range(30) if n != 7]
    assert all(i.timeline == [] and len(i.verdicts) == 1 for i in incs)
    assert incs[3].latest_verdict["root_cause"]["summary"] == "gpu_fault on job-3"  # the newest verdict
    full = store.get("job-3")
    assert len(full.timeline) >= 1000 and full.latest_verdict == incs[3].latest_verdict
