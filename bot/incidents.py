"""Incidents in Redis: one per job, with its Slack thread, status, timeline, verdicts, owner and a lock.

Keys (all under `hangdx:`; values are strings or JSON, never pickle):

    hangdx:incident:<job>            hash: job_id, status, created, updated, channel, thread_ts, owner,
                                     last_request (JSON), diagnosis (queued | running | done | failed |
                                     interrupted; queued again after its worker died), diagnosis_error
                                     (why the latest diagnosis failed)
    hangdx:incident:<job>:timeline   list of JSON {time, actor, event, detail}, its last 1000 events
    hangdx:incident:<job>:verdicts   list of JSON Verdict.to_dict(), newest last, capped at MAX_VERDICTS
    hangdx:incidents:open            set of job ids whose incident is not resolved
    hangdx:lock:<job>                the diagnosis lock: a random token, with a short TTL that the running
                                     worker's heartbeat renews (so a dead worker's lock lapses soon)
    hangdx:run:<job>                 hash: the job's diagnosis while it is queued or running: rq_job (the RQ
                                     job that may run it), state (queued | running), tries (RQ jobs issued),
                                     starts, request, options (JSON), queued_at, started_at, worker, pid and
                                     ppid (the process running it and its parent, the RQ worker), lapsed_at
                                     (when a reaper first found its lock gone)
    hangdx:runs                      set of job ids with a run record (what reapers look at)
    hangdx:threadclaim:<job>         held for a moment by the one request that makes the incident's thread
    hangdx:archive:<job>:<ms>[...]   a resolved incident, moved aside when the job gets a new one

<job> is the job id as key_part() writes it: `:` and every character outside letters, digits and `@+._-~`
%-encoded, so that no job id reaches another job's keys (`123456:timeline` used to be job 123456's timeline).
Ids of only those characters (every Slurm id) are written as they are: keys stored before still read.

One diagnosis per job at a time: a request while one is queued or running joins it (claim_run); only the RQ
job a run record names may start it (start_run), holding the lock; it ends by finish_run, which keeps the
verdict only if no newer run took over. Reapers (requeue_run) give a run whose lock lapsed to a new RQ job,
a bounded number of times, then mark the incident interrupted.
"""

from __future__ import annotations

import functools
import json
import os
import secrets
import time
import urllib.parse
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from typing import Any

import redis

from hangdx.bot.render import culprit_text
from hangdx.bot.request import DiagnoseRequest
from hangdx.playbooks.verdict import Culprit

PREFIX = "hangdx:"
STATUSES = ("investigating", "diagnosed", "acknowledged", "resolved")
OPEN_SET = PREFIX + "incidents:open"
RUNS_SET = PREFIX + "runs"
MAX_VERDICTS = 20
ERROR_MAX = 500  # characters of a failed diagnosis's error kept on the incident
# Timeline events that end a diagnosis; "diagnosis_started" begins one.
DIAGNOSIS_END = ("verdict", "diagnosis_failed", "diagnosis_interrupted")


class StoreUnavailable(Exception):
    """Redis cannot be reached (down, refused, timed out): one line naming where."""


class InvalidTransition(ValueError):
    """A status change the incident cannot make (unknown status, or the incident is resolved or missing)."""


@dataclass
class Incident:
    job_id: str
    status: str
    created: float
    updated: float
    channel: str | None = None
    thread_ts: str | None = None
    owner: str | None = None
    last_request: dict[str, Any] | None = None
    diagnosis: str | None = None  # queued (again) | running | done | failed | interrupted
    diagnosis_error: str | None = None  # why the latest diagnosis failed (diagnosis == "failed")
    timeline: list[dict[str, Any]] = field(default_factory=list)
    verdicts: list[dict[str, Any]] = field(default_factory=list)

    @property
    def is_open(self) -> bool:
        return self.status != "resolved"

    @property
    def latest_verdict(self) -> dict[str, Any] | None:
        return self.verdicts[-1] if self.verdicts else None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def connect(url: str, timeout: float = 5.0) -> redis.Redis:
    """A client that fails within `timeout` seconds when Redis is down, instead of retrying for long."""
    return redis.Redis.from_url(
        url,
        socket_connect_timeout=timeout,
        socket_timeout=timeout,
        retry=redis.retry.Retry(redis.backoff.NoBackoff(), 1),
        retry_on_timeout=False,
    )


def _unavailable(fn):
    """Turn redis-py's connection and timeout errors into StoreUnavailable."""

    @functools.wraps(fn)
    def wrapper(self: IncidentStore, *args: Any, **kwargs: Any) -> Any:
        try:
            return fn(self, *args, **kwargs)
        except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError) as e:
            raise StoreUnavailable(f"redis at {self.where} is unavailable: {e}") from e

    return wrapper


def _s(v: Any) -> Any:
    return v.decode() if isinstance(v, bytes) else v


def key_part(job: str) -> str:
    """A job id as one segment of a Redis key: `%`-encoded outside letters, digits and `@+._-~`, so it holds no
    `:` (nor a glob character) and cannot name another job's key."""
    return urllib.parse.quote(job, safe="@+")


def _key(job: str) -> str:
    return f"{PREFIX}incident:{key_part(job)}"


def _event(actor: str, event: str, detail: str = "", now: float | None = None) -> dict[str, Any]:
    return {"time": time.time() if now is None else now, "actor": actor, "event": event, "detail": detail}


def _verdict_event(verdict: dict[str, Any], actor: str, now: float | None = None) -> dict[str, Any]:
    rc = verdict.get("root_cause") or {}
    detail = f"{verdict.get('status', '?')}: {rc.get('category', 'no finding')}"
    if rc:
        detail += f" ({culprit_text(Culprit(**rc.get('culprit', {})))})"
    return _event(actor, "verdict", detail, now)


# Open a new incident, or join the open one, in one step so that concurrent requests make exactly one.
# A timeline keeps its last TIMELINE_MAX events (the Lua scripts below trim to 1000 too): an alert storm of
# 200,000 requests made every lookup read them all.
TIMELINE_MAX = 1000

# KEYS: incident hash, timeline, verdicts, open set, archive hash, archive timeline, archive verdicts
# ARGV: job, now, request JSON, "opened" event JSON, "joined" event JSON, channel, thread_ts
_OPEN_OR_JOIN = """
local status = redis.call('HGET', KEYS[1], 'status')
if status and status ~= 'resolved' then
  redis.call('RPUSH', KEYS[2], ARGV[5])
  redis.call('LTRIM', KEYS[2], -1000, -1)
  redis.call('HSET', KEYS[1], 'updated', ARGV[2], 'last_request', ARGV[3])
  if ARGV[6] ~= '' and not redis.call('HGET', KEYS[1], 'channel') then
    redis.call('HSET', KEYS[1], 'channel', ARGV[6])
    if ARGV[7] ~= '' then redis.call('HSET', KEYS[1], 'thread_ts', ARGV[7]) end
  end
  return 0
end
if status then
  redis.call('RENAME', KEYS[1], KEYS[5])
  if redis.call('EXISTS', KEYS[2]) == 1 then redis.call('RENAME', KEYS[2], KEYS[6]) end
  if redis.call('EXISTS', KEYS[3]) == 1 then redis.call('RENAME', KEYS[3], KEYS[7]) end
end
redis.call('HSET', KEYS[1], 'job_id', ARGV[1], 'status', 'investigating', 'created', ARGV[2],
           'updated', ARGV[2], 'last_request', ARGV[3])
if ARGV[6] ~= '' then redis.call('HSET', KEYS[1], 'channel', ARGV[6]) end
if ARGV[7] ~= '' then redis.call('HSET', KEYS[1], 'thread_ts', ARGV[7]) end
redis.call('RPUSH', KEYS[2], ARGV[4])
redis.call('LTRIM', KEYS[2], -1000, -1)
redis.call('SADD', KEYS[4], ARGV[1])
return 1
"""

# Release the lock only if it still holds our token (a lock that expired and was taken by another stays).
_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""

# Change status unless the incident is missing or resolved; returns the old status or false.
_SET_STATUS = """
local old = redis.call('HGET', KEYS[1], 'status')
if not old or old == 'resolved' then return false end
redis.call('HSET', KEYS[1], 'status', ARGV[1], 'updated', ARGV[2])
if ARGV[3] ~= '' then redis.call('HSET', KEYS[1], 'owner', ARGV[3]) end
redis.call('RPUSH', KEYS[2], ARGV[4])
redis.call('LTRIM', KEYS[2], -1000, -1)
if ARGV[1] == 'resolved' then redis.call('SREM', KEYS[3], ARGV[5]) end
return old
"""


# -- diagnosis runs (see the module's docstring) ---------------------------------------------------------

# Coalesce: join the job's queued or running diagnosis, else claim a new one for RQ job ARGV[2].
# KEYS: run, runs. ARGV: job, rq id, request JSON, options JSON, now. Returns {claimed 0|1, rq id to wait for}.
_CLAIM = """
local cur = redis.call('HGET', KEYS[1], 'rq_job')
if cur then return {0, cur} end
redis.call('HSET', KEYS[1], 'rq_job', ARGV[2], 'state', 'queued', 'tries', 1, 'starts', 0,
           'request', ARGV[3], 'options', ARGV[4], 'queued_at', ARGV[5])
redis.call('SADD', KEYS[2], ARGV[1])
return {1, ARGV[2]}
"""

# Start the run named by the record (or, for a direct call without RQ, a run of its own), taking the lock.
# KEYS: run, runs, lock, incident, timeline. ARGV: job, rq id, token, ttl ms, now, "started" event JSON,
# request JSON, options JSON, worker, pid, ppid, direct (1|0). Returns -1 stale, 0 locked, else the start no.
_START = """
local cur = redis.call('HGET', KEYS[1], 'rq_job')
if cur then
  if cur ~= ARGV[2] or redis.call('HGET', KEYS[1], 'state') ~= 'queued' then return -1 end
elseif ARGV[12] ~= '1' then
  return -1
end
if not redis.call('SET', KEYS[3], ARGV[3], 'NX', 'PX', ARGV[4]) then return 0 end
if not cur then
  redis.call('HSET', KEYS[1], 'tries', 1, 'request', ARGV[7], 'options', ARGV[8], 'queued_at', ARGV[5])
  redis.call('SADD', KEYS[2], ARGV[1])
end
local n = redis.call('HINCRBY', KEYS[1], 'starts', 1)
redis.call('HSET', KEYS[1], 'rq_job', ARGV[2], 'state', 'running', 'started_at', ARGV[5], 'worker', ARGV[9],
           'pid', ARGV[10], 'ppid', ARGV[11])
redis.call('HDEL', KEYS[1], 'lapsed_at')
if redis.call('EXISTS', KEYS[4]) == 1 then
  redis.call('RPUSH', KEYS[5], ARGV[6])
  redis.call('LTRIM', KEYS[5], -1000, -1)
  redis.call('HSET', KEYS[4], 'diagnosis', 'running', 'updated', ARGV[5])
end
return n
"""

# The heartbeat: extend our lock; if it lapsed (Redis was down) and the run is still ours, take it back.
# KEYS: lock, run. ARGV: token, ttl ms, rq id. Returns 1 renewed, 2 taken back, 0 lost to another run.
_RENEW = """
local v = redis.call('GET', KEYS[1])
if v == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
elseif not v and redis.call('HGET', KEYS[2], 'rq_job') == ARGV[3]
       and redis.call('HGET', KEYS[2], 'state') == 'running' then
  redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
  v = false
else
  return 0
end
redis.call('HDEL', KEYS[2], 'lapsed_at')
if v then return 1 end
return 2
"""

# End a run: keep its verdict (or failure) unless another run holds the lock or started after it; drop the
# run record and the lock in the same step. KEYS: run, runs, lock, incident, timeline, verdicts.
# ARGV: job, token, rq id, now, kind (verdict | failed), event JSON, verdict JSON, max verdicts, error (failed:
# kept on the incident, so that `/diagnose status` says why without reading the timeline).
_FINISH = """
local holder = redis.call('GET', KEYS[3])
if holder and holder ~= ARGV[2] then return 0 end
if redis.call('HGET', KEYS[1], 'state') == 'running' and redis.call('HGET', KEYS[1], 'rq_job') ~= ARGV[3] then
  return 0
end
redis.call('DEL', KEYS[1])
redis.call('SREM', KEYS[2], ARGV[1])
if holder then redis.call('DEL', KEYS[3]) end
if redis.call('EXISTS', KEYS[4]) == 0 then return 1 end
redis.call('RPUSH', KEYS[5], ARGV[6])
redis.call('LTRIM', KEYS[5], -1000, -1)
if ARGV[5] == 'verdict' then
  redis.call('RPUSH', KEYS[6], ARGV[7])
  redis.call('LTRIM', KEYS[6], -tonumber(ARGV[8]), -1)
  redis.call('HSET', KEYS[4], 'updated', ARGV[4], 'diagnosis', 'done')
  redis.call('HDEL', KEYS[4], 'diagnosis_error')
  if redis.call('HGET', KEYS[4], 'status') == 'investigating' then redis.call('HSET', KEYS[4], 'status', 'diagnosed') end
else
  redis.call('HSET', KEYS[4], 'updated', ARGV[4], 'diagnosis', 'failed', 'diagnosis_error', ARGV[9])
end
return 1
"""

# A reaper's look at one run whose RQ job is not (or no longer) waiting. KEYS: run, runs, lock, incident,
# timeline. ARGV: job, rq id the reaper saw, new rq id, max tries, now, confirm s, grace s, "requeued" event
# JSON (@TRY@ stands for the try number), "interrupted" event JSON. Returns {what, tries}: gone (another
# reaper or the run itself got there first), alive (its lock is held), wait, requeued, gave_up.
_REQUEUE = """
if redis.call('HGET', KEYS[1], 'rq_job') ~= ARGV[2] then return {'gone', 0} end
if redis.call('EXISTS', KEYS[3]) == 1 then
  redis.call('HDEL', KEYS[1], 'lapsed_at')
  return {'alive', 0}
end
local now = tonumber(ARGV[5])
if redis.call('HGET', KEYS[1], 'state') == 'running' then
  local seen = redis.call('HGET', KEYS[1], 'lapsed_at')
  if not seen then
    redis.call('HSET', KEYS[1], 'lapsed_at', ARGV[5])
    return {'wait', 0}
  end
  if now - tonumber(seen) < tonumber(ARGV[6]) then return {'wait', 0} end
elseif now - tonumber(redis.call('HGET', KEYS[1], 'queued_at') or 0) < tonumber(ARGV[7]) then
  return {'wait', 0}
end
local tries = tonumber(redis.call('HGET', KEYS[1], 'tries') or '1')
local has_incident = redis.call('EXISTS', KEYS[4]) == 1
if tries >= tonumber(ARGV[4]) then
  redis.call('DEL', KEYS[1])
  redis.call('SREM', KEYS[2], ARGV[1])
  if has_incident then
    redis.call('RPUSH', KEYS[5], ARGV[9])
    redis.call('LTRIM', KEYS[5], -1000, -1)
    redis.call('HSET', KEYS[4], 'diagnosis', 'interrupted', 'updated', ARGV[5])
  end
  return {'gave_up', tries}
end
redis.call('HSET', KEYS[1], 'rq_job', ARGV[3], 'state', 'queued', 'queued_at', ARGV[5], 'tries', tries + 1)
redis.call('HDEL', KEYS[1], 'lapsed_at')
if has_incident then
  redis.call('RPUSH', KEYS[5], (string.gsub(ARGV[8], '@TRY@', tostring(tries + 1))))
  redis.call('LTRIM', KEYS[5], -1000, -1)
  redis.call('HSET', KEYS[4], 'diagnosis', 'queued', 'updated', ARGV[5])
end
return {'requeued', tries + 1}
"""

# Mark interrupted a diagnosis left "running" with no run record and no lock (from before run records).
# KEYS: incident, timeline, run, lock. ARGV: event JSON, now.
_ORPHAN = """
if redis.call('HGET', KEYS[1], 'diagnosis') ~= 'running' or redis.call('EXISTS', KEYS[3]) == 1
   or redis.call('EXISTS', KEYS[4]) == 1 then return 0 end
redis.call('RPUSH', KEYS[2], ARGV[1])
redis.call('LTRIM', KEYS[2], -1000, -1)
redis.call('HSET', KEYS[1], 'diagnosis', 'interrupted', 'updated', ARGV[2])
return 1
"""


def _run_key(job: str) -> str:
    return f"{PREFIX}run:{key_part(job)}"


def _lock_key(job: str) -> str:
    return f"{PREFIX}lock:{key_part(job)}"


def _run_keys(job: str) -> list[str]:
    """run, runs, lock, incident, timeline: the keys the run scripts start with."""
    return [_run_key(job), RUNS_SET, _lock_key(job), _key(job), _key(job) + ":timeline"]


def _ms(seconds: float) -> int:
    return max(1, int(seconds * 1000))


class IncidentStore:
    """Incidents of jobs, kept in Redis (any redis-py client, decode_responses on or off)."""

    def __init__(self, client: redis.Redis) -> None:
        self.r = client
        kw = client.connection_pool.connection_kwargs
        self.where = kw.get("path") or f"{kw.get('host', '?')}:{kw.get('port', '?')}"
        self._open_or_join = client.register_script(_OPEN_OR_JOIN)
        self._release = client.register_script(_RELEASE)
        self._set_status = client.register_script(_SET_STATUS)
        self._scripts = {
            name: client.register_script(src)
            for name, src in (
                ("claim", _CLAIM), ("start", _START), ("renew", _RENEW), ("finish", _FINISH),
                ("requeue", _REQUEUE), ("orphan", _ORPHAN),
            )
        }  # fmt: skip

    # -- incidents -------------------------------------------------------------------------------

    @_unavailable
    def open_or_join(self, req: DiagnoseRequest) -> tuple[Incident, bool]:
        """The job's open incident with this request on its timeline, and whether it was just opened."""
        job, now = req.job_id, time.time()
        detail = f"{req.source}" + (f": {req.summary}" if req.summary else "")
        opened = _event(req.requested_by, "opened", detail, now)
        joined = _event(req.requested_by, "request", detail, now)
        base, arch = _key(job), f"{PREFIX}archive:{key_part(job)}:{int(now * 1000)}"
        keys = [base, base + ":timeline", base + ":verdicts", OPEN_SET, arch, arch + ":timeline"]
        keys.append(arch + ":verdicts")
        args = [job, repr(now), json.dumps(req.to_dict()), json.dumps(opened), json.dumps(joined)]
        args += [req.channel or "", req.thread_ts or ""]
        is_new = bool(self._open_or_join(keys=keys, args=args))
        inc = self.get(job)
        assert inc is not None  # just written, in the same call
        return inc, is_new

    @_unavailable
    def get(self, job: str) -> Incident | None:
        base = _key(job)
        pipe = self.r.pipeline(transaction=True)
        pipe.hgetall(base).lrange(base + ":timeline", 0, -1).lrange(base + ":verdicts", 0, -1)
        h, tl, vs = pipe.execute()
        return _incident(h, tl, vs)

    @_unavailable
    def open_summaries(self) -> list[Incident]:
        """Open incidents, oldest first, each with its latest verdict and no timeline: what `/diagnose status`
        and the hand-off show, read in one round trip however long the timelines grew."""
        jobs = sorted(_s(j) for j in self.r.smembers(OPEN_SET))
        pipe = self.r.pipeline(transaction=False)
        for job in jobs:
            pipe.hgetall(_key(job)).lrange(_key(job) + ":verdicts", -1, -1)
        got = pipe.execute()
        found = [_incident(got[i], [], got[i + 1]) for i in range(0, len(got), 2)]
        return sorted((i for i in found if i is not None and i.is_open), key=lambda i: i.created)

    @_unavailable
    def list_open(self) -> list[Incident]:
        """Open incidents, oldest first."""
        jobs = sorted(_s(j) for j in self.r.smembers(OPEN_SET))
        found = [inc for inc in (self.get(j) for j in jobs) if inc is not None and inc.is_open]
        return sorted(found, key=lambda i: i.created)

    @_unavailable
    def set_thread(self, job: str, channel: str, ts: str) -> None:
        base = self._require(job)
        pipe = self.r.pipeline(transaction=True)
        pipe.hset(base, mapping={"channel": channel, "thread_ts": ts, "updated": repr(time.time())})
        pipe.execute()

    @_unavailable
    def set_status(self, job: str, status: str, actor: str, detail: str = "") -> str:
        """Move the incident to `status` (acknowledging makes `actor` the owner); returns the old status."""
        if status not in STATUSES:
            raise InvalidTransition(f"unknown status {status!r}: expected one of {', '.join(STATUSES)}")
        base = _key(job)
        ev = _event(actor, status, detail)
        owner = actor if status == "acknowledged" else ""
        old = self._set_status(
            keys=[base, base + ":timeline", OPEN_SET],
            args=[status, repr(ev["time"]), owner, json.dumps(ev), job],
        )
        if old is None:
            raise InvalidTransition(f"job {job} has no open incident")
        return _s(old)

    def _require(self, job: str) -> str:
        base = _key(job)
        if not self.r.exists(base):
            raise KeyError(f"no incident for job {job}")
        return base

    @_unavailable
    def hand_off(self, job: str, to: str, actor: str) -> None:
        """Make `to` the owner of the incident (a hand-off), on the timeline."""
        base = self._require(job)
        ev = _event(actor, "handed_off", f"to {to}")
        pipe = self.r.pipeline(transaction=True)
        pipe.hset(base, mapping={"owner": to, "updated": repr(ev["time"])})
        pipe.rpush(base + ":timeline", json.dumps(ev)).ltrim(base + ":timeline", -TIMELINE_MAX, -1)
        pipe.execute()

    @_unavailable
    def add_event(self, job: str, actor: str, event: str, detail: str = "", *, diagnosis: str = "") -> None:
        """Append to the timeline (and, given `diagnosis`, set the diagnosis state in the same step)."""
        base = self._require(job)
        ev = _event(actor, event, detail)
        fields = {"updated": repr(ev["time"])}
        if diagnosis:
            fields["diagnosis"] = diagnosis
        pipe = self.r.pipeline(transaction=True)
        pipe.rpush(base + ":timeline", json.dumps(ev)).ltrim(base + ":timeline", -TIMELINE_MAX, -1)
        pipe.hset(base, mapping=fields)
        pipe.execute()

    @_unavailable
    def add_verdict(self, job: str, verdict: dict[str, Any], actor: str = "hangdx") -> None:
        """Keep a verdict (Verdict.to_dict()); an investigating incident becomes diagnosed."""
        base = self._require(job)
        ev = _verdict_event(verdict, actor)
        pipe = self.r.pipeline(transaction=True)
        pipe.rpush(base + ":verdicts", json.dumps(verdict))
        pipe.ltrim(base + ":verdicts", -MAX_VERDICTS, -1)
        pipe.rpush(base + ":timeline", json.dumps(ev)).ltrim(base + ":timeline", -TIMELINE_MAX, -1)
        pipe.hset(base, mapping={"updated": repr(ev["time"]), "diagnosis": "done"})
        pipe.execute()
        # Only a fresh incident moves on by itself; an acknowledged or resolved one keeps its human status.
        self._set_status_if(job, "investigating", "diagnosed")

    def _set_status_if(self, job: str, old: str, new: str) -> None:
        base = _key(job)
        with self.r.pipeline(transaction=True) as pipe:
            while True:
                try:
                    pipe.watch(base)
                    if _s(pipe.hget(base, "status")) != old:
                        return
                    pipe.multi()
                    pipe.hset(base, "status", new)
                    pipe.execute()
                    return
                except redis.WatchError:
                    continue

    # -- restart safety --------------------------------------------------------------------------

    @_unavailable
    def in_flight(self) -> list[Incident]:
        """Open incidents whose diagnosis started and never ended (the worker died, or is still running)."""
        return [i for i in self.open_summaries() if i.diagnosis == "running"]

    def mark_interrupted(self, job: str, actor: str = "hangdx") -> None:
        self.add_event(
            job, actor, "diagnosis_interrupted", "the worker stopped mid-diagnosis", diagnosis="interrupted"
        )

    # -- diagnosis runs: one per job at a time, re-queued when its worker dies -------------------

    @_unavailable
    def claim_run(
        self, job: str, rq_id: str, request: dict[str, Any], options: dict[str, Any]
    ) -> tuple[str, bool]:
        """Claim the job's next diagnosis for RQ job `rq_id`, or join the one queued or running: (the RQ job
        id that will answer, whether this call claimed it and so must enqueue `rq_id`)."""
        claimed, rq = self._scripts["claim"](
            keys=[_run_key(job), RUNS_SET],
            args=[job, rq_id, json.dumps(request), json.dumps(options), repr(time.time())],
        )
        return _s(rq), bool(claimed)

    @_unavailable
    def start_run(
        self,
        job: str,
        rq_id: str,
        token: str,
        ttl: float,
        *,
        request: dict[str, Any],
        options: dict[str, Any],
        worker: str,
        detail: str,
        direct: bool = False,
        actor: str = "hangdx",
    ) -> int:
        """Begin the diagnosis claimed for `rq_id` (or, `direct`, one without RQ), holding the lock with
        `token` for `ttl` s: the start number (1, 2 after a re-queue, ...), 0 when another run holds the lock,
        -1 when `rq_id` is not the run the record waits for (a duplicate, or its diagnosis already ended)."""
        now = time.time()
        ev = _event(actor, "diagnosis_started", detail, now)
        args = [job, rq_id, token, _ms(ttl), repr(now), json.dumps(ev), json.dumps(request)]
        args += [json.dumps(options), worker, os.getpid(), os.getppid(), "1" if direct else "0"]
        return int(self._scripts["start"](keys=_run_keys(job), args=args))

    @_unavailable
    def renew(self, job: str, token: str, rq_id: str, ttl: float) -> int:
        """The running diagnosis's heartbeat: 1 renewed, 2 lapsed and taken back, 0 lost to another run."""
        return int(
            self._scripts["renew"](keys=[_lock_key(job), _run_key(job)], args=[token, _ms(ttl), rq_id])
        )

    @_unavailable
    def finish_run(
        self,
        job: str,
        token: str,
        rq_id: str,
        verdict: dict[str, Any] | None,
        error: str | None = None,
        actor: str = "hangdx",
    ) -> bool:
        """End the run with its verdict (or `error`), release the lock; False, keeping nothing, when another
        run of the job took over (its own verdict will answer)."""
        now = time.time()
        if verdict is not None:
            kind, ev = "verdict", _verdict_event(verdict, actor, now)
        else:
            kind, ev = "failed", _event(actor, "diagnosis_failed", error or "", now)
        keys = [*_run_keys(job), _key(job) + ":verdicts"]
        args = [job, token, rq_id, repr(now), kind, json.dumps(ev), json.dumps(verdict), MAX_VERDICTS]
        args.append(" ".join((error or "").split())[:ERROR_MAX])
        return bool(self._scripts["finish"](keys=keys, args=args))

    @_unavailable
    def runs(self) -> list[tuple[str, dict[str, str]]]:
        """(job, run record) of every diagnosis queued or running."""
        jobs = sorted(_s(j) for j in self.r.smembers(RUNS_SET))
        pipe = self.r.pipeline(transaction=False)
        for job in jobs:
            pipe.hgetall(_run_key(job))
        # (A run that ended between the two reads has no record left: skipped.)
        recs = zip(jobs, pipe.execute(), strict=True)
        return [(job, {_s(k): _s(v) for k, v in rec.items()}) for job, rec in recs if rec]

    @_unavailable
    def requeue_run(
        self, job: str, seen_rq: str, new_rq: str, *, tries: int, confirm: float, grace: float
    ) -> tuple[str, int]:
        """A reaper's step for a run whose RQ job is not waiting: ("requeued", try) when `new_rq` now owns it,
        ("gave_up", tries) after `tries` (the incident is marked interrupted), else ("alive" | "wait" | "gone",
        0). Atomic: of several reapers, one re-queues a lapsed run, once."""
        now = time.time()
        requeued = _event(
            "hangdx", "diagnosis_requeued", f"the worker stopped answering; try @TRY@ of {tries}", now
        )
        gave_up = _event(
            "hangdx", "diagnosis_interrupted", f"the worker stopped answering ({tries} tries)", now
        )
        args = [
            job,
            seen_rq,
            new_rq,
            tries,
            repr(now),
            confirm,
            grace,
            json.dumps(requeued),
            json.dumps(gave_up),
        ]
        what, n = self._scripts["requeue"](keys=_run_keys(job), args=args)
        return _s(what), int(n)

    @_unavailable
    def interrupt_orphan(self, job: str, actor: str = "hangdx") -> bool:
        """Mark interrupted a diagnosis left "running" with neither a run record nor a lock; whether it was."""
        ev = _event(actor, "diagnosis_interrupted", "the worker stopped mid-diagnosis")
        keys = [_key(job), _key(job) + ":timeline", _run_key(job), _lock_key(job)]
        return bool(self._scripts["orphan"](keys=keys, args=[json.dumps(ev), repr(ev["time"])]))

    @_unavailable
    def claim_thread(self, job: str, ttl: float) -> bool:
        """Whether this caller may make the incident's Slack thread now (held `ttl` s, or until released)."""
        return bool(self.r.set(f"{PREFIX}threadclaim:{key_part(job)}", "1", nx=True, px=_ms(ttl)))

    @_unavailable
    def release_thread(self, job: str) -> None:
        self.r.delete(f"{PREFIX}threadclaim:{key_part(job)}")

    # -- the diagnosis lock ----------------------------------------------------------------------

    @_unavailable
    def acquire(self, job: str, ttl: float) -> str | None:
        """A token if the job's lock was free (it expires after `ttl` seconds), else None."""
        token = secrets.token_hex(16)
        ok = self.r.set(_lock_key(job), token, nx=True, px=max(1, int(ttl * 1000)))
        return token if ok else None

    @_unavailable
    def release(self, job: str, token: str) -> bool:
        """Release the lock if `token` still holds it; False when it expired or belongs to someone else."""
        return bool(self._release(keys=[_lock_key(job)], args=[token]))

    @_unavailable
    def locked(self, job: str) -> bool:
        return bool(self.r.exists(_lock_key(job)))

    @contextmanager
    def lock(self, job: str, ttl: float) -> Iterator[bool]:
        """`with store.lock(job, 60) as got:` got is False when another holder has the lock."""
        token = self.acquire(job, ttl)
        try:
            yield token is not None
        finally:
            if token is not None:
                self.release(job, token)

    # -- export ----------------------------------------------------------------------------------

    def markdown(self, job: str) -> str:
        """The incident as Markdown for a postmortem: facts, timeline, latest verdict."""
        inc = self.get(job)
        if inc is None:
            raise KeyError(f"no incident for job {job}")
        return incident_markdown(inc)


def _incident(h: dict, tl: list, vs: list) -> Incident | None:
    """An Incident from its hash, timeline and verdicts as Redis returns them; None when there is no hash."""
    if not h:
        return None
    h = {_s(k): _s(v) for k, v in h.items()}
    return Incident(
        job_id=h["job_id"],
        status=h["status"],
        created=float(h["created"]),
        updated=float(h["updated"]),
        channel=h.get("channel"),
        thread_ts=h.get("thread_ts"),
        owner=h.get("owner"),
        last_request=json.loads(h["last_request"]) if h.get("last_request") else None,
        diagnosis=h.get("diagnosis"),
        diagnosis_error=h.get("diagnosis_error"),
        timeline=[json.loads(_s(x)) for x in tl],
        verdicts=[json.loads(_s(x)) for x in vs],
    )


def _when(t: float) -> str:
    return datetime.fromtimestamp(t, tz=timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")


def incident_markdown(inc: Incident) -> str:
    out = [
        f"# Incident: job {inc.job_id}",
        "",
        f"- **Status:** {inc.status}",
        f"- **Opened:** {_when(inc.created)}",
        f"- **Updated:** {_when(inc.updated)}",
        f"- **Owner:** {inc.owner or 'nobody yet'}",
    ]
    if inc.diagnosis in ("failed", "interrupted"):
        why = f": {inc.diagnosis_error}" if inc.diagnosis == "failed" and inc.diagnosis_error else ""
        out.append(f"- **Latest diagnosis:** {inc.diagnosis}{why}")
    if inc.channel:
        out.append(f"- **Slack thread:** {inc.channel} / {inc.thread_ts or '?'}")
    out += ["", "## Timeline", "", "| time | who | event | detail |", "|---|---|---|---|"]
    for e in inc.timeline:
        detail = str(e.get("detail", "")).replace("|", "\\|").replace("\n", " ")
        out.append(f"| {_when(e['time'])} | {e.get('actor', '')} | {e.get('event', '')} | {detail} |")
    out.append("")
    v = inc.latest_verdict
    out += ["## Latest verdict", ""]
    out.append(verdict_markdown(v) if v else "No verdict yet.\n")
    return "\n".join(out)


def verdict_markdown(v: dict[str, Any]) -> str:
    """render.markdown, from a stored Verdict.to_dict() rather than a Verdict."""
    findings = v.get("findings") or []
    rc = findings[0] if findings else None
    job = f"job {v['job_id']}" if v.get("job_id") else "the evidence"
    out = [f"## hangdx: {job} is {v.get('status') or 'unknown'}", ""]
    if rc:
        quotes = rc.get("evidence") or []
        out += [
            f"**Root cause:** `{rc['category']}` (confidence {rc.get('confidence', 0):.2f})",
            "",
            rc.get("summary", ""),
            "",
            f"**Culprit:** {culprit_text(Culprit(**rc.get('culprit', {})))}",
            "",
            f"**Fix:** {rc.get('fix', '')}",
            "",
            "**Evidence:**",
            "",
            "```",
            *[
                f"{q['source']}:{q['line']}  {q['text']}" if q.get("line") else f"{q['source']}  {q['text']}"
                for q in quotes
            ],
            "```",
            "",
            "**Next steps:**",
            "",
            *[f"- {s}" for s in rc.get("next_steps", [])],
        ]
    if len(findings) > 1:
        out += ["", "**Other findings:**", ""]
        out += [
            f"- `{f['category']}` ({f.get('confidence', 0):.2f}): {f.get('summary', '')}"
            for f in findings[1:]
        ]
    notes = v.get("notes") or []
    if notes:
        from hangdx.bot.memory import note_rank

        # The fleet memory's notes (a known fix, a lemon node) first, as in Slack.
        out += ["", "**Notes:**", "", *[f"- {n}" for n in sorted(map(str, notes), key=note_rank)]]
    return "\n".join(out) + "\n"
