"""The work queue: diagnoses run on RQ workers (queue "hangdx", JSON-serialized jobs, no pickle).

The caller opens or joins the incident (IncidentStore.open_or_join) and then enqueues; the worker takes the
job's lock, diagnoses, keeps the verdict in the incident and calls the notifier (the Slack side plugs in
with set_notifier, or in a separate worker process with HANGDX_NOTIFIER=module:function).
"""

from __future__ import annotations

import importlib
import logging
import os
import socket
import time
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

import redis
from rq import Queue, get_current_job
from rq.job import Job
from rq.serializers import JSONSerializer

from hangdx.bot import diagnosis
from hangdx.bot.artifacts import save_stacks
from hangdx.bot.diagnosis import DiagnoseOptions, DiagnosisError
from hangdx.bot.incidents import Incident, IncidentStore, StoreUnavailable, connect
from hangdx.bot.request import DiagnoseRequest

QUEUE = "hangdx"
DEFAULT_REDIS_URL = "redis://localhost:6379/0"
ACTOR = "hangdx"
log = logging.getLogger("hangdx.queue")

Notifier = Callable[[Incident, "dict[str, Any] | None", "str | None"], None]
_notifier: Notifier | None = None


def _log_notifier(incident: Incident, verdict: dict[str, Any] | None, error: str | None) -> None:
    if error:
        log.info("job %s: diagnosis failed: %s", incident.job_id, error)
    else:
        rc = (verdict or {}).get("root_cause") or {}
        log.info("job %s: %s, %s", incident.job_id, (verdict or {}).get("status"), rc.get("category"))


def set_notifier(fn: Notifier | None) -> None:
    """Who hears of each finished diagnosis: fn(incident, verdict_dict | None, error | None); None resets."""
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


def queue(conn: redis.Redis) -> Queue:
    return Queue(QUEUE, connection=conn, serializer=JSONSerializer)


def lock_ttl(opts: DiagnoseOptions) -> float:
    """Long enough for the slowest diagnosis these options allow, so the lock outlives a live run."""
    return opts.deadline + opts.samples * max(0.0, opts.interval) + 60.0


def enqueue_diagnosis(conn: redis.Redis, req: DiagnoseRequest, opts: DiagnoseOptions) -> str:
    """Queue a diagnosis of req.job_id; returns the RQ job id."""
    diagnosis.check_job_id(req.job_id)
    try:
        job = _enqueue(conn, req, opts)
    except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError) as e:
        raise StoreUnavailable(f"redis for the work queue is unavailable: {e}") from e
    return job.id


def _enqueue(conn: redis.Redis, req: DiagnoseRequest, opts: DiagnoseOptions) -> Job:
    return queue(conn).enqueue(
        "hangdx.bot.queue.run_diagnosis",
        req.to_dict(),
        asdict(opts),
        job_timeout=int(lock_ttl(opts)) + 30,
        result_ttl=24 * 3600,
        failure_ttl=7 * 24 * 3600,
        description=f"diagnose {req.job_id} ({req.source}, {req.requested_by})",
    )


def _connection() -> redis.Redis:
    job = get_current_job()
    if job is not None:
        return job.connection
    return connect(os.environ.get("REDIS_URL", DEFAULT_REDIS_URL))


def run_diagnosis(req_dict: dict[str, Any], opts_dict: dict[str, Any]) -> dict[str, Any]:
    """The worker's task: lock, diagnose, keep the verdict, notify. Returns a JSON-able summary."""
    req = DiagnoseRequest.from_dict(req_dict)
    opts = DiagnoseOptions(
        **{k: v for k, v in opts_dict.items() if k in DiagnoseOptions.__dataclass_fields__}
    )
    job = req.job_id
    conn = _connection()
    store = IncidentStore(conn)
    inc = store.get(job)
    if inc is None or not inc.is_open:
        store.open_or_join(req)  # enqueued without an incident (e.g. from a script): open one
    worker = f"{socket.gethostname()}:{os.getpid()}"
    with store.lock(job, lock_ttl(opts)) as got:
        if not got:
            store.add_event(job, ACTOR, "diagnosis_skipped", "another diagnosis of this job is running")
            return {"job_id": job, "skipped": True}
        store.add_event(
            job, ACTOR, "diagnosis_started", f"on {worker} for {req.requested_by}", diagnosis="running"
        )
        verdict: dict[str, Any] | None = None
        error: str | None = None
        try:
            v, docs = diagnosis.diagnose(job, opts, progress=_progress_reporter(store, job))
            verdict = v.to_dict()
            verdict["elapsed_seconds"] = v.elapsed_seconds
            _keep_stacks(conn, job, docs)
        except DiagnosisError as e:
            error = str(e)
        except Exception as e:
            # A bug, not a bad request: still end the diagnosis on the timeline and tell the thread, then let
            # RQ keep the traceback in its failed registry.
            error = f"internal error: {type(e).__name__}: {e}"
            _finish(store, job, None, error)
            raise
        _finish(store, job, verdict, error)
    return {"job_id": job, "skipped": False, "error": error, "verdict": verdict}


def _keep_stacks(conn: redis.Redis, job: str, docs: list[dict[str, Any]]) -> None:
    try:
        save_stacks(conn, job, docs)
    except redis.exceptions.RedisError as e:
        # Only the "Full stacks" button needs them; the verdict still goes to the incident.
        log.warning("job %s: could not keep the stacks: %s", job, e)


PROGRESS_EVERY = 2.0  # seconds between progress edits of the parent message (Slack allows about 1/s)


def _progress_reporter(store: IncidentStore, job: str) -> Callable[[int, int], None]:
    """progress(done, total) -> the notifier's `progress` (if it has one), at most every PROGRESS_EVERY s."""
    show = getattr(get_notifier(), "progress", None)
    last = [0.0]

    def progress(done: int, total: int) -> None:
        now = time.monotonic()
        if show is None or (now - last[0] < PROGRESS_EVERY and done < total):
            return
        last[0] = now
        inc = store.get(job)
        if inc is not None:
            try:
                show(inc, done, total)
            except Exception:  # noqa: BLE001 - a progress line must never stop a diagnosis
                log.warning("job %s: progress update failed", job, exc_info=True)

    return progress


def _finish(store: IncidentStore, job: str, verdict: dict[str, Any] | None, error: str | None) -> None:
    if verdict is not None:
        store.add_verdict(job, verdict, actor=ACTOR)
    else:
        store.add_event(job, ACTOR, "diagnosis_failed", error or "", diagnosis="failed")
    inc = store.get(job)
    try:
        if inc is not None:
            get_notifier()(inc, verdict, error)
    except Exception:
        # The verdict is already kept; a broken notifier must not turn a diagnosis into a failed job.
        log.exception("job %s: the notifier failed", job)
        store.add_event(job, ACTOR, "notify_failed", "the notifier raised; see the worker log")
