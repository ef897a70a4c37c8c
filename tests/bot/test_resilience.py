"""What the bot does when things break: a restart mid-diagnosis, Slack answering 429/500 or an error, Redis
down and back. A real redis-server (tests/bot/test_incidents.py) and the Slack stand-in (tests/slack_standin.py,
whose 429 is Slack's documented rate-limit answer: HTTP 429, a Retry-After header, {"ok": false,
"error": "ratelimited"})."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests
from werkzeug.serving import make_server

from hangdx.bot.config import BotConfig
from hangdx.bot.incidents import StoreUnavailable, connect
from hangdx.bot.queue import queue
from hangdx.bot.request import DiagnoseRequest
from hangdx.bot.service import Service, SlackNotifier, slack_client
from hangdx.bot.slack.app import build_app

from .test_incidents import REDIS, _free_port, redis_url  # noqa: F401  (the session's redis-server)
from .test_slack_app import SECRET, Bot

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from slack_standin import SlackStandin  # noqa: E402

TOKEN = "xoxb-1111-2222-hangdxtest"
CHANNEL = "C0ONCALL01"
INTERRUPTED = "was interrupted (the bot or its worker restarted)"


@pytest.fixture
def slack() -> Iterator[SlackStandin]:
    with SlackStandin() as s:
        yield s


@pytest.fixture
def service(redis_url: str, slack: SlackStandin) -> Service:  # noqa: F811
    connect(redis_url).flushdb()
    cfg = BotConfig(bot_token=TOKEN, api_url=slack.url, redis_url=redis_url)
    return Service(cfg, client=slack_client(cfg))


def req(job: str, **kw) -> DiagnoseRequest:
    return DiagnoseRequest(job_id=job, source="slash", requested_by="U0ONCALL01", channel=CHANNEL, **kw)


def parents(slack: SlackStandin) -> list:
    """Successful parent posts: the stand-in records failed attempts too, so keep the ones it answered."""
    return [c for c in slack.calls_to("chat.postMessage") if not c.body.get("thread_ts")]


def queued(service: Service) -> list[str]:
    return [j.args[0]["job_id"] for j in queue(service.conn).get_jobs()]


# -- restart safety ------------------------------------------------------------------------------------


def _started(service: Service, job: str) -> str:
    """An incident whose diagnosis began before run records existed (and then, unless it holds the lock, died)."""
    service.store.open_or_join(req(job))
    service.store.set_thread(job, CHANNEL, f"1700000001.{len(job):06d}{job[-1]}")
    service.store.add_event(
        job, "hangdx", "diagnosis_started", "on node:1 for U0ONCALL01", diagnosis="running"
    )
    return service.store.get(job).thread_ts


def test_recover_ends_an_orphaned_diagnosis_and_says_so_once_in_its_thread(service, slack):
    dead_ts = _started(service, "job-dead")
    live_ts = _started(service, "job-live")
    with service.store.lock("job-live", 60) as got:
        assert got
        assert service.recover(watch=False) == ["job-dead"]
        assert service.recover(watch=False) == []  # a second start-up finds nothing left to end
    dead = service.store.get("job-dead")
    assert dead.diagnosis == "interrupted"
    assert dead.timeline[-1]["event"] == "diagnosis_interrupted"
    assert service.store.get("job-live").diagnosis == "running"
    said = [c.body for c in slack.calls_to("chat.postMessage") if INTERRUPTED in c.body.get("text", "")]
    assert len(said) == 1
    assert said[0]["channel"] == CHANNEL and said[0]["thread_ts"] == dead_ts != live_ts
    assert said[0]["text"] == (
        "The diagnosis of job job-dead was interrupted (the bot or its worker restarted); "
        "press Re-run or /diagnose job-dead."
    )


def test_recover_leaves_finished_queued_and_resolved_incidents_alone(service, slack):
    service.submit(req("job-done"))
    service.store.add_event("job-done", "hangdx", "diagnosis_started", diagnosis="running")
    service.store.add_event("job-done", "hangdx", "diagnosis_failed", "no such job", diagnosis="failed")
    service.submit(req("job-gone"))
    service.store.add_event("job-gone", "hangdx", "diagnosis_started", diagnosis="running")
    service.store.set_status("job-gone", "resolved", "U0ONCALL01")
    service.submit(req("job-waits"))  # queued, no worker free yet
    assert service.recover(watch=False) == []
    assert not [c for c in slack.calls_to("chat.postMessage") if "interrupted" in c.body.get("text", "")]
    assert sorted(queued(service)) == ["job-done", "job-gone", "job-waits"]


REQUEUED = "stopped answering; the diagnosis is queued again"


def _run_dies(service: Service, job: str, rq_id: str) -> str:
    """A worker starts the run of RQ job `rq_id` and dies at once: its lock is never renewed."""
    token = "dead-worker-token"
    n = service.store.start_run(
        job, rq_id, token, 0.3, request=req(job).to_dict(), options={}, worker="node:1", detail="dies"
    )
    assert n > 0
    return token


def _thread_of(service, job: str, timeout: float = 10.0) -> str:
    end = time.monotonic() + timeout
    while not getattr(service.store.get(job), "thread_ts", None):
        assert time.monotonic() < end, f"no thread for {job}"
        time.sleep(0.02)
    return service.store.get(job).thread_ts


def test_reapers_requeue_a_dead_workers_diagnosis_once_then_give_up(service, slack, monkeypatch):
    monkeypatch.setenv("HANGDX_LOCK_TTL", "0.3")
    monkeypatch.setenv("HANGDX_DIAGNOSIS_TRIES", "2")
    first = service.submit(req("job-k"))
    thread = _thread_of(service, "job-k")  # made after the request was taken, off its path
    queue(service.conn).remove(first)  # taken by a worker...
    _run_dies(service, "job-k", first)  # ...that dies mid-diagnosis
    assert service.reap() == []  # its lock still holds
    time.sleep(0.4)
    assert service.reap() == []  # lapsed: noted, and confirmed half a TTL later
    time.sleep(0.2)
    # Several reapers at once (every worker and serve run one): exactly one re-queues it.
    results: list = []
    barrier = threading.Barrier(4)

    def one() -> None:
        barrier.wait()
        results.extend(Service(service.cfg, client=service.client).reap())

    threads = [threading.Thread(target=one) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == [("job-k", "requeued")]
    [second] = queue(service.conn).get_jobs()
    assert second.id != first and second.args[0]["job_id"] == "job-k"
    # The first RQ job can never start again (RQ handing an abandoned job out again, say): a second run refused.
    assert (
        service.store.start_run("job-k", first, "t", 5, request={}, options={}, worker="w", detail="again")
        == -1
    )
    said = [c.body for c in slack.calls_to("chat.postMessage") if REQUEUED in c.body.get("text", "")]
    assert [(b["thread_ts"], b["text"]) for b in said] == [
        (thread, f"The worker diagnosing job job-k {REQUEUED} (try 2 of 2).")
    ]
    # The second try dies too: the bound is reached, the incident is interrupted with Re-run advice, once.
    queue(service.conn).remove(second.id)
    _run_dies(service, "job-k", second.id)
    time.sleep(0.4)
    assert service.reap() == []
    time.sleep(0.2)
    assert service.reap() == [("job-k", "interrupted")]
    assert service.reap() == [] and service.store.runs() == [] and queued(service) == []
    inc = service.store.get("job-k")
    assert inc.diagnosis == "interrupted" and inc.verdicts == []
    assert [e["event"] for e in inc.timeline if e["event"].startswith("diagnosis")] == [
        "diagnosis_started",
        "diagnosis_requeued",
        "diagnosis_started",
        "diagnosis_interrupted",
    ]
    gave_up = [c.body["text"] for c in slack.calls_to("chat.postMessage") if "interrupted" in c.body["text"]]
    assert gave_up == [
        "The diagnosis of job job-k was interrupted (its worker stopped answering, 2 tries); "
        "press Re-run or /diagnose job-k."
    ]
    # Re-run starts a fresh diagnosis.
    assert service.submit(req("job-k")) not in (first, second.id)
    assert queued(service) == ["job-k"]


def test_a_live_run_is_never_reaped_and_a_late_verdict_of_a_requeued_run_is_kept_once(service, monkeypatch):
    monkeypatch.setenv("HANGDX_LOCK_TTL", "0.3")
    rq_id = service.submit(req("job-l"))
    queue(service.conn).remove(rq_id)
    token = _run_dies(service, "job-l", rq_id)
    for _ in range(6):  # the heartbeat renews faster than the lock lapses
        time.sleep(0.1)
        assert service.store.renew("job-l", token, rq_id, 0.3) == 1
        assert service.reap() == []
    time.sleep(0.4)  # Redis "down" for longer than the TTL: the lock lapsed...
    assert service.reap() == []  # ...a reaper notes it...
    assert service.store.renew("job-l", token, rq_id, 0.3) == 2  # ...and the heartbeat takes it back
    time.sleep(0.2)
    assert service.reap() == []
    # Lapsed for good: re-queued; the first run then ends after all and keeps its verdict, exactly once.
    time.sleep(0.4)
    service.reap()
    time.sleep(0.2)
    assert service.reap() == [("job-l", "requeued")]
    [requeued] = queue(service.conn).get_jobs()
    verdict = {"job_id": "job-l", "status": "hung", "findings": [], "root_cause": None}
    assert service.store.finish_run("job-l", token, rq_id, verdict) is True
    inc = service.store.get("job-l")
    assert inc.verdicts == [verdict] and inc.diagnosis == "done" and inc.status == "diagnosed"
    assert service.store.runs() == [] and not service.store.locked("job-l")
    # The re-queued RQ job finds the diagnosis done: it is skipped, not run a second time.
    assert (
        service.store.start_run(
            "job-l", requeued.id, "t2", 5, request={}, options={}, worker="w", detail="late"
        )
        == -1
    )


# -- Slack answering 429, 500, errors ------------------------------------------------------------------


def test_a_rate_limited_post_waits_out_retry_after_and_lands_once(service, slack):
    slack.fail("chat.postMessage", status=429, retry_after=1)
    t0 = time.monotonic()
    service.submit(req("job-429"))
    assert time.monotonic() - t0 < 0.9  # the request is answered at once: Slack is waited on off its path
    assert queued(service) == ["job-429"]
    service.settle()
    assert time.monotonic() - t0 >= 1.0  # Retry-After honoured
    calls = slack.calls_to("chat.postMessage")
    assert len(calls) == 2  # the 429, then the retry
    inc = service.store.get("job-429")
    assert inc.thread_ts == "1700000000.000100"  # the one post Slack accepted is the thread
    assert queued(service) == ["job-429"]


def test_a_500_is_retried_and_lands(service, slack):
    slack.fail("chat.postMessage", status=500)
    service.submit(req("job-500"))
    service.settle()
    assert len(slack.calls_to("chat.postMessage")) == 2
    assert service.store.get("job-500").thread_ts == "1700000000.000100"
    assert queued(service) == ["job-500"]


@pytest.mark.parametrize("how", [{"error": "channel_not_found"}, {"status": 500}])
def test_a_persistent_slack_failure_does_not_stop_the_incident_or_the_diagnosis(service, slack, how):
    slack.fail("chat.postMessage", times=10, **how)
    rq_id = service.submit(req("job-x"))
    assert rq_id
    service.settle()
    inc = service.store.get("job-x")
    assert inc is not None and inc.status == "investigating" and inc.thread_ts is None
    assert queued(service) == ["job-x"]


def test_slack_unreachable_does_not_stop_the_diagnosis(redis_url):  # noqa: F811
    connect(redis_url).flushdb()
    cfg = BotConfig(bot_token=TOKEN, api_url=f"http://127.0.0.1:{_free_port()}/api/", redis_url=redis_url)
    service = Service(cfg, client=slack_client(cfg))
    assert service.submit(req("job-offline"))
    service.settle()
    assert service.store.get("job-offline").thread_ts is None
    assert queued(service) == ["job-offline"]


def test_the_notifier_survives_slack_errors(service, slack):
    service.submit(req("job-n"))
    service.settle()
    inc = service.store.get("job-n")
    slack.fail("chat.postMessage", error="channel_not_found", times=5)
    slack.fail("chat.update", error="message_not_found", times=5)
    verdict = {"job_id": "job-n", "status": "hung", "findings": [], "root_cause": None}
    SlackNotifier(service.client)(inc, verdict, None)  # must not raise
    SlackNotifier(service.client)(inc, None, "no such job")
    # The verdict's edit of the parent and the failure's (a failed diagnosis says so there too): both refused.
    assert len(slack.calls_to("chat.update")) == 2


# -- Redis down, and back ------------------------------------------------------------------------------


def test_redis_down_is_told_to_the_user_and_the_app_stays_up(slack):
    port = _free_port()  # nothing listens here
    cfg = BotConfig(
        bot_token=TOKEN, signing_secret=SECRET, api_url=slack.url, redis_url=f"redis://127.0.0.1:{port}/0"
    )
    service = Service(cfg, client=slack_client(cfg))
    with pytest.raises(StoreUnavailable):
        service.submit(req("job-1"))
    _, flask_app = build_app(cfg, service.submit, service.on_action)
    server = make_server("127.0.0.1", 0, flask_app, threaded=True)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        bot = Bot(f"http://127.0.0.1:{server.server_port}", slack, None)
        r = bot.command("job-1")
        assert r.status_code == 200 and "Diagnosing job job-1" in r.text
        respond = "respond/T0HANGDX1/1234/abcd"
        assert bot.wait(lambda: slack.calls_to(respond))
        [said] = slack.calls_to(respond)
        text = said.body["text"]
        assert text.startswith("Could not queue the diagnosis of job job-1: redis at ")
        assert "unavailable" in text and "\n" not in text
        assert requests.get(bot.url + "/healthz", timeout=5).json()["ok"] is True
    finally:
        server.shutdown()
        server.server_close()


def _redis_on(port: int, tmp: Path) -> subprocess.Popen:
    cmd = [REDIS, "--port", str(port), "--bind", "127.0.0.1", "--appendonly", "no", "--save", ""]
    proc = subprocess.Popen([*cmd, "--dir", str(tmp)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    probe = connect(f"redis://127.0.0.1:{port}/0", timeout=0.5)
    for _ in range(100):
        try:
            probe.ping()
            return proc
        except Exception:
            time.sleep(0.05)
    _kill(proc)
    raise RuntimeError("redis-server did not answer within 5 s")


def _kill(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=10)


@pytest.mark.skipif(REDIS is None, reason="redis-server is not installed")
def test_submit_works_again_when_redis_comes_back(slack, tmp_path):
    port = _free_port()
    proc = _redis_on(port, tmp_path)
    try:
        cfg = BotConfig(bot_token=TOKEN, api_url=slack.url, redis_url=f"redis://127.0.0.1:{port}/0")
        service = Service(cfg, client=slack_client(cfg))
        assert service.submit(req("job-a"))
        _kill(proc)
        with pytest.raises(StoreUnavailable):
            service.submit(req("job-b"))
        proc = _redis_on(port, tmp_path)
        assert service.submit(req("job-c"))  # the same Service: redis-py reconnects
        service.settle()
        assert service.store.get("job-c").thread_ts
    finally:
        _kill(proc)


# -- a person asking again -------------------------------------------------------------------------------


def test_a_thread_says_joined_once_per_person_however_often_they_ask(service, slack):
    for _ in range(4):  # the first opens the incident; the others are the same person asking again
        service.submit(req("job-ask"))
    service.submit(DiagnoseRequest("job-ask", "mention", "U0ONCALL02", channel=CHANNEL))
    service.submit(DiagnoseRequest("job-ask", "button", "U0ONCALL02", channel=CHANNEL))
    service.settle()  # said in the thread after the requests were taken
    joins = [
        c.body["text"]
        for c in slack.calls_to("chat.postMessage")
        if "joined this incident" in c.body.get("text", "")
    ]
    assert len(joins) == 1, joins  # who opened it asking again is no news; the second person, once
    assert "<@U0ONCALL02>" in joins[0]


def test_an_ipv6_host_an_alert_names_reaches_the_worker_as_a_host_it_can_read(service):
    """Issue 10.9: `[fe80::1]:9100` passed /alerts, then failed in the worker ("not a host")."""
    from hangdx.bot.alerts import parse_alerts
    from hangdx.probes import resolve

    alert = {
        "status": "firing",
        "labels": {"alertname": "Stalled", "job_id": "77", "instance": "[fe80::1]:9100"},
    }
    (request,), _ = parse_alerts({"alerts": [alert]}, CHANNEL)
    request.hosts.append("gpu-node-03")
    from hangdx.bot.diagnosis import _hosts_how

    opts = service.options(request)
    assert opts.hint_hosts == ["fe80::1", "gpu-node-03"]
    hosts, _ = resolve.resolve_with_settings("77", _hosts_how(opts.hint_hosts))
    assert [h.name for h in hosts] == ["fe80::1", "gpu-node-03"]
