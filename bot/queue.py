"""The work queue: diagnoses run on RQ workers (queue "hangdx", JSON-serialized jobs, no pickle).

The caller opens or joins the incident (IncidentStore.open_or_join) and then enqueues; a request for a job whose
diagnosis is already queued or running joins it (one diagnosis, one verdict). The worker starts the run the
job's run record names, holds the job's lock with a short TTL that a heartbeat thread renews, diagnoses, keeps
the verdict in the incident (retrying while Redis is down) and calls the notifier (the Slack side plugs in with
set_notifier, or in a separate worker process with HANGDX_NOTIFIER=module:function).

Reapers (reap(), run every few seconds by each worker and by `serve`) find runs whose lock lapsed (their worker
died) and queue them again, a bounded number of times, then mark the incident interrupted. Settings, read from
the environment when used:

    HANGDX_LOCK_TTL          seconds a dead worker's lock outlives it (default 30)
    HANGDX_REAP_INTERVAL     seconds between reaper passes (default half the lock TTL)
    HANGDX_DIAGNOSIS_TRIES   RQ jobs one diagnosis may use before it is given up (default 2)
    HANGDX_REDIS_WAIT        seconds a worker keeps retrying to keep a verdict while Redis is down (default 300)
"""

from __future__ import annotations

import importlib
import json
import logging
import os
import secrets
import socket
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict
from typing import Any, TypeVar

import redis
from rq import Queue, get_current_job
from rq.exceptions import NoSuchJobError
from rq.job import Job, JobStatus
from rq.job_lifecycle import record_job_failure
from rq.serializers import JSONSerializer

from hangdx.bot import diagnosis
from hangdx.bot.artifacts import save_stacks
from hangdx.bot.diagnosis import DiagnoseOptions, DiagnosisError
from hangdx.bot.incidents import Incident, IncidentStore, StoreUnavailable, connect
from hangdx.bot.request import AnalyzeRequest, Busy, DiagnoseRequest

QUEUE = "hangdx"  # hang diagnoses: a worker always takes these first
PASTE_QUEUE = "hangdx-analyze"  # pasted evidence read in Slack: after every queued diagnosis
DEFAULT_REDIS_URL = "redis://localhost:6379/0"
ACTOR = "hangdx"
log = logging.getLogger("hangdx.queue")

Notifier = Callable[[Incident, "dict[str, Any] | None", "str | None"], None]
Say = Callable[[Incident, str], None]  # a line in the incident's thread
_notifier: Notifier | None = None
T = TypeVar("T")


def _log_notifier(incident: Incident, verdict: dict[str, Any] | None, error: str | None) -> None:
    if error:
        log.info("job %s: diagnosis failed: %s", incident.job_id, error)
    else:
        rc = (verdict or {}).get("root_cause") or {}
        log.info("job %s: %s, %s", incident.job_id, (verdict or {}).get("status"), rc.get("category"))


def set_notifier(fn: Notifier | None) -> None:
    """Who hears of each finished diagnosis: fn(incident, verdict_dict | None, error | None); None resets.
    Optional attributes: fn.progress(incident, done, total), fn.say(incident, text) (a line in the thread)."""
    global _notifier
    _notifier = fn


def get_notifier() -> Notifier:
    """The notifier set in this process, else HANGDX_NOTIFIER=module:function, else one that logs."""
    if _notifier is not None:
        return _notifier
    spec = os.environ.get("HANGDX_NOTIFIER", "")
    if spec:
        module, _, attr = spec.partition(":")
        return getattr(importlib.import_module(module), attr or "notify")
    return _log_notifier


def _setting(name: str, default: float, low: float, high: float, what: str = "a number of seconds") -> float:
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if not low <= value <= high:
        raise ValueError(f"{name}: {raw!r} is not {what} ({low:g} to {high:g})")
    return value


def lock_seconds() -> float:
    return _setting("HANGDX_LOCK_TTL", 30.0, 0.1, 3600)


def reap_interval() -> float:
    return _setting("HANGDX_REAP_INTERVAL", lock_seconds() / 2, 0.1, 3600)


def max_tries() -> int:
    return int(_setting("HANGDX_DIAGNOSIS_TRIES", 2, 1, 20, "a number of tries"))


def redis_wait() -> float:
    return _setting("HANGDX_REDIS_WAIT", 300.0, 0, 86400)


def check_settings() -> None:
    """Raise ValueError naming the first malformed setting (for a one-line error at start-up)."""
    lock_seconds(), reap_interval(), max_tries(), redis_wait(), pastes_per_person(), pastes_per_thread()


def queue(conn: redis.Redis) -> Queue:
    return Queue(QUEUE, connection=conn, serializer=JSONSerializer)


def paste_queue(conn: redis.Redis) -> Queue:
    return Queue(PASTE_QUEUE, connection=conn, serializer=JSONSerializer)


def worker_queues(conn: redis.Redis) -> list[Queue]:
    """What a worker takes, in order: RQ empties the first before it looks at the next, so twenty pastes never
    stand before an alert's diagnosis."""
    return [queue(conn), paste_queue(conn)]


def pastes_per_person() -> int:
    return int(_setting("HANGDX_PASTES_PER_USER", 3, 1, 1000, "a number of analyses"))


def pastes_per_thread() -> int:
    return int(_setting("HANGDX_PASTES_PER_THREAD", 2, 1, 1000, "a number of analyses"))


def _waiting_pastes(q: Queue) -> list[dict[str, Any]]:
    """The requests of the analyses queued or running (few: the limits below keep them so)."""
    from rq.registry import StartedJobRegistry

    ids = q.get_job_ids() + StartedJobRegistry(queue=q).get_job_ids()
    jobs = Job.fetch_many(ids, connection=q.connection, serializer=JSONSerializer) if ids else []
    return [j.args[0] for j in jobs if j is not None and j.args and isinstance(j.args[0], dict)]


def run_budget(opts: DiagnoseOptions) -> float:
    """Long enough for the slowest diagnosis these options allow: RQ's job timeout is a little more."""
    # No deadline given: the inventory's may be longer than the default, so the budget allows for 10 minutes.
    deadline = opts.deadline if opts.deadline is not None else 600.0
    return deadline + opts.samples * max(0.0, opts.interval) + 60.0


def enqueue_diagnosis(conn: redis.Redis, req: DiagnoseRequest, opts: DiagnoseOptions) -> str:
    """Queue a diagnosis of req.job_id, or join the one queued or running; returns the RQ job id."""
    return queue_diagnosis(conn, req, opts)[0]


def queue_diagnosis(conn: redis.Redis, req: DiagnoseRequest, opts: DiagnoseOptions) -> tuple[str, bool]:
    """(the RQ job id that will answer, whether the request joined a diagnosis already queued or running)."""
    diagnosis.check_job_id(req.job_id)
    store = IncidentStore(conn)
    try:
        rq_id, claimed = store.claim_run(req.job_id, uuid.uuid4().hex, req.to_dict(), asdict(opts))
        if claimed:
            # Should this fail (Redis gone this instant), the reapers queue the claimed run after a grace.
            _enqueue(conn, req.to_dict(), asdict(opts), rq_id)
    except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError, StoreUnavailable) as e:
        raise StoreUnavailable(f"redis for the work queue is unavailable: {e}") from e
    return rq_id, not claimed


def queue_analysis(conn: redis.Redis, req: AnalyzeRequest) -> str:
    """Queue the reading of pasted evidence in Slack (bot/pasted.py); the RQ job id. Busy when the person already
    has HANGDX_PASTES_PER_USER analyses waiting, or the thread HANGDX_PASTES_PER_THREAD."""
    try:
        q = paste_queue(conn)
        waiting = _waiting_pastes(q)
        mine = sum(1 for w in waiting if w.get("requested_by") == req.requested_by)
        here = sum(
            1 for w in waiting if (w.get("channel"), w.get("thread_ts")) == (req.channel, req.thread_ts)
        )
        if mine >= pastes_per_person():
            raise Busy(
                f"you have {mine} analyses waiting already: hangdx reads yours in turn, try again after them"
            )
        if here >= pastes_per_thread():
            raise Busy(f"this thread has {here} analyses waiting already: its answer is on its way")
        job = q.enqueue(
            "hangdx.bot.pasted.run_analysis",
            req.to_dict(),
            job_timeout=300,
            result_ttl=3600,
            failure_ttl=7 * 24 * 3600,
            description=f"analyze what was pasted ({req.source}, {req.requested_by})",
        )
    except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError) as e:
        raise StoreUnavailable(f"redis for the work queue is unavailable: {e}") from e
    return job.id


def _enqueue(conn: redis.Redis, req: dict[str, Any], opts: dict[str, Any], rq_id: str) -> Job:
    budget = run_budget(DiagnoseOptions(**_known_options(opts)))
    return queue(conn).enqueue(
        "hangdx.bot.queue.run_diagnosis",
        req,
        opts,
        job_id=rq_id,
        job_timeout=int(budget + redis_wait())
        + 30,  # (a worker waits out a Redis outage to keep its verdict)
        result_ttl=24 * 3600,
        failure_ttl=7 * 24 * 3600,
        description=f"diagnose {req.get('job_id')} ({req.get('source')}, {req.get('requested_by')})",
    )


def _known_options(opts: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in opts.items() if k in DiagnoseOptions.__dataclass_fields__}


def _connection() -> redis.Redis:
    job = get_current_job()
    if job is not None:
        return job.connection
    return connect(os.environ.get("REDIS_URL", DEFAULT_REDIS_URL))


def _persist(what: str, job: str, fn: Callable[[], T]) -> T:
    """fn(), retried with backoff while Redis is down, for up to HANGDX_REDIS_WAIT seconds."""
    give_up = time.monotonic() + redis_wait()
    wait = 0.2
    while True:
        try:
            return fn()
        except (StoreUnavailable, redis.exceptions.ConnectionError, redis.exceptions.TimeoutError) as e:
            if time.monotonic() + wait > give_up:
                raise
            log.warning("job %s: %s: %s (trying again in %.1f s)", job, what, e, wait)
            time.sleep(wait)
            wait = min(wait * 2, 5.0)


class Heartbeat:
    """Renews the job's lock every third of its TTL while the diagnosis runs (more often while Redis is down,
    so that the lock is taken back as soon as Redis returns)."""

    def __init__(self, store: IncidentStore, job: str, token: str, rq_id: str, ttl: float) -> None:
        self.store, self.job, self.token, self.rq_id, self.ttl = store, job, token, rq_id, ttl
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"hangdx-heartbeat-{job}", daemon=True)

    def __enter__(self) -> Heartbeat:
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def _run(self) -> None:
        every = self.ttl / 3
        wait = every
        while not self._stop.wait(wait):
            try:
                if self.store.renew(self.job, self.token, self.rq_id, self.ttl) == 0:
                    log.warning(
                        "job %s: another run took over this diagnosis; its verdict will answer", self.job
                    )
                    return
                wait = every
            except StoreUnavailable as e:
                log.warning("job %s: cannot renew the diagnosis lock: %s", self.job, e)
                wait = min(every, 0.5)


def run_diagnosis(req_dict: dict[str, Any], opts_dict: dict[str, Any]) -> dict[str, Any]:
    """The worker's task: start the claimed run, diagnose, keep the verdict, notify. A JSON-able summary."""
    req = DiagnoseRequest.from_dict(req_dict)
    opts = DiagnoseOptions(**_known_options(opts_dict))
    job = req.job_id
    conn = _connection()
    store = IncidentStore(conn)
    inc = store.get(job)
    if inc is None or not inc.is_open:
        store.open_or_join(req)  # enqueued without an incident (e.g. from a script): open one
    current = get_current_job()
    rq_id = current.id if current is not None else f"direct-{uuid.uuid4().hex}"
    worker = f"{socket.gethostname()}:{os.getpid()}"
    token, ttl = secrets.token_hex(16), lock_seconds()
    started = store.start_run(
        job,
        rq_id,
        token,
        ttl,
        request=req.to_dict(),
        options=asdict(opts),
        worker=worker,
        detail=f"on {worker} for {req.requested_by}",
        direct=current is None,
    )
    if started <= 0:
        why = (
            "another diagnosis of this job is running"
            if started == 0
            else "not the diagnosis queued for this job"
        )
        store.add_event(job, ACTOR, "diagnosis_skipped", why)
        return {"job_id": job, "skipped": True}
    verdict: dict[str, Any] | None = None
    error: str | None = None
    docs: list[dict[str, Any]] = []
    with Heartbeat(store, job, token, rq_id, ttl):
        try:
            kept = _watch_bundle(conn, job) if req.source == "watch" else None
            if (
                kept is not None
            ):  # what hangdx watch took when it confirmed the hang: the job may be gone since
                from hangdx.bot.watch import verdict_from_bundle

                v, docs = verdict_from_bundle(job, *kept)
            else:
                v, docs = diagnosis.diagnose(job, opts, progress=_progress_reporter(store, job))
            verdict = v.to_dict()
            verdict["elapsed_seconds"] = v.elapsed_seconds
            # What the memory knows (a known fix, a node to drain) before how the evidence was gathered.
            verdict["notes"] = _recall(conn, job, verdict, v.stack_roles) + list(verdict.get("notes") or [])
        except DiagnosisError as e:
            error = str(e)
        except Exception as e:
            # A bug, not a bad request: still end the diagnosis on the timeline and tell the thread, then let
            # RQ keep the traceback in its failed registry.
            _finish(store, job, token, rq_id, None, f"internal error: {type(e).__name__}: {e}")
            raise
        kept = _finish(store, job, token, rq_id, verdict, error, docs)
    return {"job_id": job, "skipped": not kept, "error": error, "verdict": verdict}


def _watch_bundle(conn: redis.Redis, job: str) -> tuple[float, list[dict[str, Any]]] | None:
    from hangdx.bot.watch import load_bundle

    try:
        return load_bundle(conn, job)
    except redis.exceptions.RedisError as e:
        log.warning("job %s: the bundle hangdx watch kept could not be read: %s", job, e)
        return None


def _recall(
    conn: redis.Redis, job: str, verdict: dict[str, Any], roles: dict[str, list[str]] | None = None
) -> list[str]:
    """What the fleet memory matches (repeat culprits, lemons, the same hang before: `roles`, from the stacks),
    then this verdict remembered; nothing when Redis cannot say (the verdict matters more than the memory)."""
    from hangdx.bot.memory import Memory

    mem = Memory(conn)
    try:
        inc = IncidentStore(conn).get(job)
        notes = mem.recall(job, verdict, roles=roles)
        mem.remember(
            job, verdict, channel=inc.channel if inc else None, thread_ts=inc.thread_ts if inc else None,
            roles=roles,
        )  # fmt: skip
    except (redis.exceptions.RedisError, StoreUnavailable) as e:
        log.warning("job %s: fleet memory unavailable: %s", job, e)
        return []
    return notes


def _keep_stacks(conn: redis.Redis, job: str, docs: list[dict[str, Any]]) -> None:
    try:
        _persist("keeping the stacks", job, lambda: save_stacks(conn, job, docs))
    except (redis.exceptions.RedisError, StoreUnavailable) as e:
        # Only the "Full stacks" button needs them; the verdict is kept already.
        log.warning("job %s: could not keep the stacks: %s", job, e)


PROGRESS_EVERY = 2.0  # seconds between progress edits of the parent message (Slack allows about 1/s)


def _progress_reporter(store: IncidentStore, job: str) -> Callable[[int, int], None]:
    """progress(done, total) -> the notifier's `progress` (if it has one), at most every PROGRESS_EVERY s."""
    notifier = get_notifier()
    show = getattr(notifier, "progress", None)
    last = [0.0]
    begin = getattr(notifier, "begin", None)
    if begin is not None:
        try:
            inc = store.get(job)
            if inc is not None:
                begin(inc)
        except Exception:  # noqa: BLE001 - progress is a courtesy: it never stops a diagnosis
            log.warning("job %s: could not reset the progress of its parent message", job, exc_info=True)

    def progress(done: int, total: int) -> None:
        now = time.monotonic()
        if show is None or (now - last[0] < PROGRESS_EVERY and done < total):
            return
        last[0] = now
        try:
            inc = store.get(job)
            if inc is not None:
                show(inc, done, total)
        except StoreUnavailable as e:
            log.warning("job %s: no progress update: %s", job, e)
        except Exception:  # noqa: BLE001 - a progress line (Slack down, a bug) must never stop a diagnosis
            log.warning("job %s: progress update failed", job, exc_info=True)

    return progress


def _finish(
    store: IncidentStore,
    job: str,
    token: str,
    rq_id: str,
    verdict: dict[str, Any] | None,
    error: str | None,
    docs: list[dict[str, Any]] | None = None,
) -> bool:
    """Keep the verdict and the stacks (retrying while Redis is down), then notify; False when a newer run of the
    job took over."""
    try:
        kept = _persist(
            "keeping the verdict", job, lambda: store.finish_run(job, token, rq_id, verdict, error)
        )
    except StoreUnavailable:
        # Redis stayed down past HANGDX_REDIS_WAIT: the worker's log is the last place the verdict can go.
        log.error("job %s: redis stayed down; the verdict is not kept: %s", job, json.dumps(verdict or error))
        raise
    if not kept:
        log.info("job %s: a newer run of this diagnosis took over; this one's verdict is dropped", job)
        return False
    if verdict is not None:
        _keep_stacks(store.r, job, docs or [])
    inc = _persist("reading the incident", job, lambda: store.get(job))
    try:
        notifier = get_notifier()
        if inc is not None and inc.channel and not inc.thread_ts:
            inc = _thread_for_verdict(store, inc, getattr(notifier, "open_thread", None))
        if inc is not None:
            notifier(inc, verdict, error)
    except Exception:
        # The verdict is already kept; a broken notifier must not turn a diagnosis into a failed job.
        log.exception("job %s: the notifier failed", job)
        store.add_event(job, ACTOR, "notify_failed", "the notifier raised; see the worker log")
    return True


THREAD_WAIT = 30.0  # seconds a verdict waits for its incident's thread being made elsewhere


def _thread_for_verdict(
    store: IncidentStore, inc: Incident, open_thread: Callable[[Incident], str | None] | None
) -> Incident:
    """The incident with its thread: made by serve after the request was taken (waited for while it is being made,
    Slack retrying), or made here when nobody has started it, so the verdict never lands outside its thread."""
    end = time.monotonic() + THREAD_WAIT
    while time.monotonic() < end:
        if store.claim_thread(inc.job_id, THREAD_WAIT):
            try:
                now = store.get(inc.job_id) or inc
                if not now.thread_ts and now.channel and open_thread is not None:
                    ts = open_thread(now)
                    if ts:
                        store.set_thread(inc.job_id, now.channel, ts)
            finally:
                store.release_thread(inc.job_id)
            return store.get(inc.job_id) or inc
        now = store.get(inc.job_id)
        if now is not None and now.thread_ts:
            return now
        time.sleep(0.05)
    return store.get(inc.job_id) or inc


# -- the reaper ------------------------------------------------------------------------------------------

_WAITING = {JobStatus.QUEUED, JobStatus.STARTED, JobStatus.DEFERRED, JobStatus.SCHEDULED}


def _rq_status(conn: redis.Redis, rq_id: str) -> JobStatus | None:
    try:
        return Job.fetch(rq_id, connection=conn, serializer=JSONSerializer).get_status(refresh=False)
    except NoSuchJobError:
        return None


def _abandon(conn: redis.Redis, rq_id: str, why: str) -> None:
    """Move a dead worker's RQ job out of the started registry into the failed one, as RQ itself does with an
    abandoned job once its heartbeat expires (minutes later), so that no job looks stuck meanwhile."""
    try:
        job = Job.fetch(rq_id, connection=conn, serializer=JSONSerializer)
    except NoSuchJobError:
        return
    if job.get_status(refresh=False) != JobStatus.STARTED:
        return
    with conn.pipeline() as pipe:
        job.started_job_registry.remove_executions(job, pipeline=pipe)
        record_job_failure(job, why, pipe)
        pipe.execute()


def reap(conn: redis.Redis, say: Say | None = None) -> list[tuple[str, str]]:
    """One pass: re-queue each diagnosis whose worker died (lock lapsed, seen twice half a TTL apart) or whose
    RQ job is gone, once, up to HANGDX_DIAGNOSIS_TRIES; past that mark the incident interrupted. Safe to run
    in several processes at once. Returns (job, "requeued" | "interrupted") for what this pass did."""
    store = IncidentStore(conn)
    ttl, tries = lock_seconds(), max_tries()
    done: list[tuple[str, str]] = []
    for job, rec in store.runs():
        seen = rec.get("rq_job", "")
        if rec.get("state") == "queued" and _rq_status(conn, seen) in _WAITING:
            continue  # waiting for a free worker
        new_rq = uuid.uuid4().hex
        what, n = store.requeue_run(job, seen, new_rq, tries=tries, confirm=ttl / 2, grace=ttl)
        if what not in ("requeued", "gave_up"):
            continue
        _abandon(conn, seen, f"abandoned: its worker stopped answering; hangdx {what.replace('_', ' ')}")
        inc = store.get(job)
        if what == "requeued":
            _enqueue(conn, json.loads(rec["request"]), json.loads(rec["options"]), new_rq)
            text = (
                f"The worker diagnosing job {job} stopped answering; the diagnosis is queued again "
                f"(try {n} of {tries})."
            )
            done.append((job, "requeued"))
        else:
            text = (
                f"The diagnosis of job {job} was interrupted (its worker stopped answering, {n} tries); "
                f"press Re-run or /diagnose {job}."
            )
            done.append((job, "interrupted"))
        log.warning("%s", text)
        if say is not None and inc is not None:
            try:
                say(inc, text)
            except Exception:  # noqa: BLE001 - the run is already re-queued or ended; only the line is lost
                log.warning("job %s: could not say so in the thread", job, exc_info=True)
    return done


class Reaper:
    """reap() every `interval` seconds in a daemon thread, until stop(); Redis outages are waited out."""

    def __init__(self, conn: redis.Redis, say: Say | None = None, interval: float | None = None) -> None:
        self.conn, self.say = conn, say
        self.interval = interval if interval is not None else reap_interval()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="hangdx-reaper", daemon=True)

    def start(self) -> Reaper:
        self._thread.start()
        return self

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        self._thread.join(timeout)

    def _run(self) -> None:
        down = False
        while not self._stop.wait(self.interval):
            try:
                reap(self.conn, self.say)
                down = False
            except (
                StoreUnavailable,
                redis.exceptions.ConnectionError,
                redis.exceptions.TimeoutError,
                redis.exceptions.OutOfMemoryError,  # full (maxmemory, noeviction): waited out the same way
            ) as e:
                if not down:  # once per outage
                    full = isinstance(e, redis.exceptions.OutOfMemoryError)
                    log.warning(
                        "reaper: redis is %s, waiting for it: %s", "full" if full else "unavailable", e
                    )
                down = True
            except Exception:  # noqa: BLE001 - the next pass may do better; never end the thread
                log.exception("reaper: pass failed")


def notifier_say() -> Say | None:
    """The notifier's `say`, when it has one (the worker's Slack notifier does)."""
    return getattr(get_notifier(), "say", None)
