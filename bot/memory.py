"""Fleet memory: every verdict leaves a fingerprint in Redis, and a new verdict says what it matches.

A fingerprint: the root cause's category, its culprit hosts, GPUs and links, the job, and for a software cause a
stack signature (the user frames of the evidence, `evaluate (train.py)`, without line numbers that shift). A new
verdict gets notes: a host, GPU or link named culprit before ("gpu-node-17 was the culprit in 2 earlier incidents
in 14 days: jobs 812, 907"), a lemon (culprit in HANGDX_LEMON_COUNT incidents within HANGDX_LEMON_DAYS: drain
it), the same hang seen before (same signature) with how it was resolved, the same job diagnosed before.

Keys (all under hangdx:mem:, kept HANGDX_MEMORY_DAYS, default 90):

    hangdx:mem:v:<job>:<ms>        hash: job, time, category, summary, hosts, gpus, links, sig, resolution
    hangdx:mem:<kind>:<name>       sorted set of those ids by time; kind: host, gpu, link, sig, job
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import time
from datetime import datetime, timezone
from typing import Any

import redis

from hangdx.bot.config import int_setting

PREFIX = "hangdx:mem:"
SOFTWARE = {
    "conditional_collective", "collective_mismatch", "dataloader_stall", "io_stall", "user_deadlock",
    "p2p_deadlock", "ddp_unused_parameters",
}  # fmt: skip
# `evaluate (train.py:212)`, `File "train.py", line 212, in evaluate`: a frame as py-spy and tracebacks print it.
_PYSPY_FRAME = re.compile(r"\b([A-Za-z_][\w.<>]*) \(([^():\s]+\.py):\d+\)")
_TRACE_FRAME = re.compile(r'File "([^"]+\.py)", line \d+, in ([\w<>]+)')
_LIBRARY = re.compile(
    r"(?:^|/)(?:site-packages|dist-packages|torch|threading\.py|queue\.py)(?:/|$)|/lib/python\d"
)
MAX_LISTED = 5


def retention_days() -> int:
    return int_setting("HANGDX_MEMORY_DAYS", 90)


def lemon_rule() -> tuple[int, int]:
    """(incidents, days): a culprit this often within that many days is a lemon."""
    return int_setting("HANGDX_LEMON_COUNT", 3), int_setting("HANGDX_LEMON_DAYS", 14)


def _innermost(places: list[str]) -> str:
    """`collective:allreduce < log_metrics (job.py) < main (job.py)` -> `log_metrics (job.py)`."""
    return ", ".join(dict.fromkeys(p.split(" < ")[1] for p in places if " < " in p))


def signature(verdict: dict[str, Any], roles: dict[str, list[str]] | None = None) -> tuple[str | None, str]:
    """(signature, where) of a software root cause; (None, "") for a hardware cause or nothing to go on.

    From the stacks when a live diagnosis has them (`roles`, playbooks/roles.py: per rank role, the wait and the
    user frames under it); else from the user frames its evidence quotes. Never with line numbers, which shift."""
    rc = verdict.get("root_cause") or {}
    if rc.get("category") not in SOFTWARE:
        return None, ""
    if roles:
        text = rc["category"] + "|" + "|".join(f"{k}={'/'.join(v)}" for k, v in sorted(roles.items()))
        apart, crowd = _innermost(roles.get("apart") or []), _innermost(roles.get("crowd") or [])
        where = f"{apart}; the others in {crowd}" if apart and crowd else (apart or crowd)
        return hashlib.sha256(text.encode()).hexdigest()[:16], where[
            :300
        ]  # a stack's names are the job's to pick
    findings = verdict.get("findings") or []
    quotes = (findings[0].get("evidence") or []) if findings else []
    frames: dict[str, None] = {}
    for q in quotes:
        text = str(q.get("text") or "")
        for func, path in _PYSPY_FRAME.findall(text):
            if not _LIBRARY.search(path):
                frames.setdefault(f"{func} ({os.path.basename(path)})")
        for path, func in _TRACE_FRAME.findall(text):
            if not _LIBRARY.search(path):
                frames.setdefault(f"{func} ({os.path.basename(path)})")
    if not frames:
        return None, ""
    where = ", ".join(sorted(frames)[:3])
    digest = hashlib.sha256((rc["category"] + "|" + "|".join(sorted(frames))).encode()).hexdigest()[:16]
    return digest, where


def note_rank(note: str) -> int:
    """Notes by use: a known fix first, then a node to drain, then the rest as they came."""
    if note.startswith("same hang as job ") and ", resolved by: " in note:
        return 0
    return 1 if note.startswith("lemon: ") else 2


def _culprits(verdict: dict[str, Any]) -> dict[str, list[str]]:
    c = (verdict.get("root_cause") or {}).get("culprit") or {}
    return {k: [str(x) for x in (c.get(k + "s") or []) if x][:50] for k in ("host", "gpu", "link")}


def thread_link(channel: str | None, thread_ts: str | None) -> str:
    """A link to an incident's Slack thread, or "" (ids checked: nothing else goes into a URL)."""
    if not channel or not thread_ts or not re.fullmatch(r"[A-Z0-9]{2,30}", channel):
        return ""
    if not re.fullmatch(r"[0-9]{6,12}\.[0-9]{1,9}", thread_ts):
        return ""
    return f"https://slack.com/app_redirect?channel={channel}&message_ts={thread_ts}"


def _job_ref(rec: dict[str, str]) -> str:
    """`job 812`, with its thread's link after it when known: `job 812 (https://...)` (Slack shows it as a link
    named `job 812`: bot/slack/blocks.py)."""
    return f"job {rec['job']} ({rec['link']})" if rec.get("link") else f"job {rec['job']}"


def _by_job(recs: Any) -> list[dict[str, str]]:
    """One record per job (its latest verdict, with the resolution any of its verdicts was given), newest first:
    a re-run diagnoses the same incident again."""
    out: dict[str, dict[str, str]] = {}
    for r in sorted(recs, key=lambda r: float(r["time"])):
        resolution = r.get("resolution") or (out.get(r["job"]) or {}).get("resolution")
        runs = int((out.get(r["job"]) or {}).get("runs") or 0) + 1
        out[r["job"]] = {**r, "runs": str(runs), **({"resolution": resolution} if resolution else {})}
    return sorted(out.values(), key=lambda r: -float(r["time"]))


def _day(t: float) -> str:
    return datetime.fromtimestamp(t, timezone.utc).strftime("%Y-%m-%d")


class Memory:
    def __init__(self, conn: redis.Redis) -> None:
        self.r = conn

    def _get(self, ident: str) -> dict[str, str]:
        h = self.r.hgetall(PREFIX + "v:" + ident)
        return {(k.decode() if isinstance(k, bytes) else k): (v.decode() if isinstance(v, bytes) else v)
                for k, v in h.items()}  # fmt: skip

    def _earlier(self, kind: str, name: str, since: float) -> list[dict[str, str]]:
        ids = self.r.zrangebyscore(f"{PREFIX}{kind}:{name}", since, "+inf")
        out = []
        for ident in ids:
            rec = self._get(ident.decode() if isinstance(ident, bytes) else ident)
            if rec:
                out.append(rec)
        return out

    def recall(
        self,
        job: str,
        verdict: dict[str, Any],
        now: float | None = None,
        roles: dict[str, list[str]] | None = None,
    ) -> list[str]:
        """Notes for a new verdict: what it matches in the memory (before it is remembered itself), the most
        useful first (a known fix, a node to drain)."""
        now = time.time() if now is None else now
        notes: list[str] = []
        count, days = lemon_rule()
        for kind, names in _culprits(verdict).items():
            for name in names:
                # An incident is a job: its re-runs are not earlier incidents, nor is the job itself.
                before = _by_job(r for r in self._earlier(kind, name, now - days * 86400) if r["job"] != job)
                if not before:
                    continue
                jobs = ", ".join(_job_ref(r) for r in before)
                what = {"host": "", "gpu": "GPU ", "link": "link "}[kind]
                plural = "s" if len(before) > 1 else ""
                notes.append(
                    f"{what}{name} was the culprit in {len(before)} earlier incident{plural} in {days} days "
                    f"({jobs})"
                )
                if len(before) + 1 >= count:
                    drain = (
                        f': drain it (scontrol update NodeName={name} State=DRAIN Reason="hangdx: job {job}")'
                        if kind == "host"
                        else ": take it out of service"
                    )
                    notes.append(
                        f"lemon: {what}{name}, culprit in {len(before) + 1} incidents in {days} days{drain}"
                    )
        sig, where = signature(verdict, roles)
        if sig:
            same = _by_job(
                r for r in self._earlier("sig", sig, now - retention_days() * 86400) if r["job"] != job
            )
            if same:
                # The latest incident whose fix is known, else the latest one.
                last = next((r for r in same if r.get("resolution")), same[0])
                resolved = f", resolved by: {last['resolution']}" if last.get("resolution") else ""
                notes.append(
                    f"same hang as {_job_ref(last)} on {_day(float(last['time']))} ({last['category']} in "
                    f"{where}){resolved}"
                )
        before = self._earlier("job", job, now - retention_days() * 86400)
        if before:
            last = max(before, key=lambda r: float(r["time"]))
            notes.append(
                f"job {job} was diagnosed before ({len(before)} time{'s' if len(before) > 1 else ''}; last on "
                f"{_day(float(last['time']))}: {last['category']})"
            )
        return sorted(notes, key=note_rank)

    def remember(
        self,
        job: str,
        verdict: dict[str, Any],
        now: float | None = None,
        channel: str | None = None,
        thread_ts: str | None = None,
        roles: dict[str, list[str]] | None = None,
    ) -> str:
        """Keep the verdict's fingerprint (and where its thread is); its id."""
        now = time.time() if now is None else now
        rc = verdict.get("root_cause") or {}
        ident = f"{job}:{int(now * 1000)}"
        sig, where = signature(verdict, roles)
        culprits = _culprits(verdict)
        keep = retention_days() * 86400
        pipe = self.r.pipeline(transaction=True)
        pipe.hset(
            PREFIX + "v:" + ident,
            mapping={"job": job, "time": repr(now), "category": str(rc.get("category") or "none"),
                     "summary": str(rc.get("summary") or "")[:300], "sig": sig or "", "where": where,
                     "link": thread_link(channel, thread_ts),
                     **{k + "s": json.dumps(v) for k, v in culprits.items()}},
        )  # fmt: skip
        pipe.expire(PREFIX + "v:" + ident, keep)
        keys = [f"{PREFIX}{kind}:{name}" for kind, names in culprits.items() for name in names]
        keys.append(f"{PREFIX}job:{job}")
        if sig:
            keys.append(f"{PREFIX}sig:{sig}")
        for key in keys:
            pipe.zadd(key, {ident: now})
            pipe.zremrangebyscore(key, "-inf", now - keep)
            pipe.expire(key, keep)
        pipe.execute()
        return ident

    def resolve(self, job: str, note: str) -> bool:
        """The one-line resolution of the job's latest remembered verdict (quoted when the same hang recurs)."""
        ids = self.r.zrevrange(f"{PREFIX}job:{job}", 0, 0)
        if not ids:
            return False
        ident = ids[0].decode() if isinstance(ids[0], bytes) else ids[0]
        self.r.hset(PREFIX + "v:" + ident, "resolution", " ".join(note.split())[:300])
        return True

    def history(self, name: str) -> list[dict[str, Any]]:
        """Every remembered incident of a job, host, GPU or link, newest first."""
        since = time.time() - retention_days() * 86400
        seen: dict[str, dict[str, str]] = {}
        for kind in ("job", "host", "gpu", "link"):
            for r in self._earlier(kind, name, since):
                seen.setdefault(f"{r['job']}:{r['time']}", {**r, "as": kind})
        # One row per incident (job), however often it was diagnosed: its latest verdict.
        return [
            {"job": r["job"], "time": float(r["time"]), "day": _day(float(r["time"])), "category": r["category"],
             "summary": r["summary"], "resolution": r.get("resolution") or None, "as": r["as"],
             "diagnoses": int(r["runs"])}
            for r in _by_job(seen.values())
        ]  # fmt: skip

    def note_action(self, job: str, action: str, target: str, user: str, now: float | None = None) -> None:
        """A drain, requeue or cancel done from hangdx, for the hand-off's week."""
        now = time.time() if now is None else now
        rec = json.dumps({"job": job, "action": action, "target": target, "user": user, "time": now})
        key = PREFIX + "actions"
        pipe = self.r.pipeline(transaction=True)
        pipe.zadd(key, {rec: now}).zremrangebyscore(key, "-inf", now - retention_days() * 86400)
        pipe.execute()

    def week(self, now: float | None = None, days: int = 7) -> dict[str, list]:
        """What the hand-off carries from the last `days`: actions done, repeat hangs (one signature, several
        jobs) and what was resolved and how."""
        now = time.time() if now is None else now
        since = now - days * 86400
        actions = [json.loads(x) for x in self.r.zrangebyscore(PREFIX + "actions", since, "+inf")]
        repeats, resolved = [], []
        for key in self.r.scan_iter(match=f"{PREFIX}sig:*", count=500):
            recs = self._earlier(
                "sig", (key.decode() if isinstance(key, bytes) else key)[len(PREFIX + "sig:") :], since
            )
            jobs = list(dict.fromkeys(r["job"] for r in recs))
            if len(jobs) > 1:
                repeats.append(
                    {"category": recs[-1]["category"], "where": recs[-1].get("where", ""), "jobs": jobs}
                )
        for key in self.r.scan_iter(match=f"{PREFIX}job:*", count=500):
            name = (key.decode() if isinstance(key, bytes) else key)[len(PREFIX + "job:") :]
            for r in _by_job(self._earlier("job", name, since)):
                if r.get("resolution"):
                    resolved.append(
                        {"job": r["job"], "category": r["category"], "resolution": r["resolution"]}
                    )
        return {"actions": actions, "repeats": repeats, "resolved": resolved}

    def lemons(self, now: float | None = None) -> list[tuple[str, int, list[str]]]:
        """(host, incidents, the incidents' jobs with their thread links) for every host that is a lemon now."""
        now = time.time() if now is None else now
        count, days = lemon_rule()
        out = []
        for key in self.r.scan_iter(match=f"{PREFIX}host:*", count=500):
            key = key.decode() if isinstance(key, bytes) else key
            host = key[len(PREFIX + "host:") :]
            recs = _by_job(self._earlier("host", host, now - days * 86400))
            if len(recs) >= count:
                out.append((host, len(recs), [_job_ref(r) for r in recs]))
        return sorted(out, key=lambda x: (-x[1], x[0]))
