"""Incidents in Redis: one per job, with its Slack thread, status, timeline, verdicts, owner and a lock.

Keys (all under `hangdx:`; values are strings or JSON, never pickle):

    hangdx:incident:<job>            hash: job_id, status, created, updated, channel, thread_ts, owner,
                                     last_request (JSON), diagnosis (running | done | failed | interrupted)
    hangdx:incident:<job>:timeline   list of JSON {time, actor, event, detail}, append-only
    hangdx:incident:<job>:verdicts   list of JSON Verdict.to_dict(), newest last, capped at MAX_VERDICTS
    hangdx:incidents:open            set of job ids whose incident is not resolved
    hangdx:lock:<job>                the diagnosis lock: a random token, with a TTL
    hangdx:archive:<job>:<ms>[...]   a resolved incident, moved aside when the job gets a new one
"""

from __future__ import annotations

import functools
import json
import secrets
import time
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
MAX_VERDICTS = 20
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
    diagnosis: str | None = None  # running | done | failed | interrupted
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


def _key(job: str) -> str:
    return f"{PREFIX}incident:{job}"


def _event(actor: str, event: str, detail: str = "", now: float | None = None) -> dict[str, Any]:
    return {"time": time.time() if now is None else now, "actor": actor, "event": event, "detail": detail}


# Open a new incident, or join the open one, in one step so that concurrent requests make exactly one.
# KEYS: incident hash, timeline, verdicts, open set, archive hash, archive timeline, archive verdicts
# ARGV: job, now, request JSON, "opened" event JSON, "joined" event JSON, channel, thread_ts
_OPEN_OR_JOIN = """
local status = redis.call('HGET', KEYS[1], 'status')
if status and status ~= 'resolved' then
  redis.call('RPUSH', KEYS[2], ARGV[5])
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
if ARGV[1] == 'resolved' then redis.call('SREM', KEYS[3], ARGV[5]) end
return old
"""


class IncidentStore:
    """Incidents of jobs, kept in Redis (any redis-py client, decode_responses on or off)."""

    def __init__(self, client: redis.Redis) -> None:
        self.r = client
        kw = client.connection_pool.connection_kwargs
        self.where = kw.get("path") or f"{kw.get('host', '?')}:{kw.get('port', '?')}"
        self._open_or_join = client.register_script(_OPEN_OR_JOIN)
        self._release = client.register_script(_RELEASE)
        self._set_status = client.register_script(_SET_STATUS)

    # -- incidents -------------------------------------------------------------------------------

    @_unavailable
    def open_or_join(self, req: DiagnoseRequest) -> tuple[Incident, bool]:
        """The job's open incident with this request on its timeline, and whether it was just opened."""
        job, now = req.job_id, time.time()
        detail = f"{req.source}" + (f": {req.summary}" if req.summary else "")
        opened = _event(req.requested_by, "opened", detail, now)
        joined = _event(req.requested_by, "request", detail, now)
        base, arch = _key(job), f"{PREFIX}archive:{job}:{int(now * 1000)}"
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
            timeline=[json.loads(_s(x)) for x in tl],
            verdicts=[json.loads(_s(x)) for x in vs],
        )

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
        pipe.rpush(base + ":timeline", json.dumps(ev))
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
        pipe.rpush(base + ":timeline", json.dumps(ev))
        pipe.hset(base, mapping=fields)
        pipe.execute()

    @_unavailable
    def add_verdict(self, job: str, verdict: dict[str, Any], actor: str = "hangdx") -> None:
        """Keep a verdict (Verdict.to_dict()); an investigating incident becomes diagnosed."""
        base = self._require(job)
        rc = verdict.get("root_cause") or {}
        detail = f"{verdict.get('status', '?')}: {rc.get('category', 'no finding')}"
        if rc:
            detail += f" ({culprit_text(Culprit(**rc.get('culprit', {})))})"
        ev = _event(actor, "verdict", detail)
        pipe = self.r.pipeline(transaction=True)
        pipe.rpush(base + ":verdicts", json.dumps(verdict))
        pipe.ltrim(base + ":verdicts", -MAX_VERDICTS, -1)
        pipe.rpush(base + ":timeline", json.dumps(ev))
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
        return [i for i in self.list_open() if i.diagnosis == "running"]

    def mark_interrupted(self, job: str, actor: str = "hangdx") -> None:
        self.add_event(
            job, actor, "diagnosis_interrupted", "the worker stopped mid-diagnosis", diagnosis="interrupted"
        )

    # -- the diagnosis lock ----------------------------------------------------------------------

    @_unavailable
    def acquire(self, job: str, ttl: float) -> str | None:
        """A token if the job's lock was free (it expires after `ttl` seconds), else None."""
        token = secrets.token_hex(16)
        ok = self.r.set(f"{PREFIX}lock:{job}", token, nx=True, px=max(1, int(ttl * 1000)))
        return token if ok else None

    @_unavailable
    def release(self, job: str, token: str) -> bool:
        """Release the lock if `token` still holds it; False when it expired or belongs to someone else."""
        return bool(self._release(keys=[f"{PREFIX}lock:{job}"], args=[token]))

    @_unavailable
    def locked(self, job: str) -> bool:
        return bool(self.r.exists(f"{PREFIX}lock:{job}"))

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
    out = [f"## hangdx: job {v.get('job_id') or '?'} is {v.get('status', '?')}", ""]
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
    return "\n".join(out) + "\n"
