"""Artifacts kept from the latest diagnosis of a job, for the buttons under its verdict.

Key `hangdx:stacks:<job>`: the py-spy dumps of the documents, one text with a `==> host/name <==` header per
artifact, capped at MAX_STACKS_BYTES, expiring after STACKS_TTL seconds.
"""

from __future__ import annotations

from typing import Any

import redis

from hangdx.bot.incidents import PREFIX, key_part

STACKS_TTL = 7 * 24 * 3600
MAX_STACKS_BYTES = 4 * 1024 * 1024


def stacks_key(job: str) -> str:
    return f"{PREFIX}stacks:{key_part(job)}"


def stacks_text(docs: list[dict[str, Any]], limit: int = MAX_STACKS_BYTES) -> str:
    """The py-spy artifacts of collector documents as one text, cut with a note past `limit` bytes."""
    parts = []
    for doc in docs:
        host = doc.get("host") or "?"
        for a in doc.get("artifacts") or []:
            if a.get("kind") == "pyspy":
                parts.append(f"==> {host}/{a.get('name') or '?'} <==\n{str(a.get('data') or '').rstrip()}\n")
    text = "\n".join(parts)
    raw = text.encode()
    if len(raw) <= limit:
        return text
    note = f"\n[... cut: {len(raw) - limit} more bytes of stacks not kept (cap {limit} bytes)]\n"
    # Cut on bytes, dropping a character split at the edge, so the note fits within the cap.
    head = raw[: max(0, limit - len(note.encode()))].decode(errors="ignore")
    return head + note


def save_stacks(conn: redis.Redis, job: str, docs: list[dict[str, Any]]) -> bool:
    """Keep the diagnosis's stacks for STACKS_TTL; without any, forget older ones. Whether any were kept."""
    text = stacks_text(docs)
    if not text:
        conn.delete(stacks_key(job))  # a newer diagnosis without stacks: don't show stale ones
        return False
    conn.set(stacks_key(job), text.encode(), ex=STACKS_TTL)
    return True


def load_stacks(conn: redis.Redis, job: str) -> str | None:
    """The kept stacks of the job's latest diagnosis, or None (none kept, or expired)."""
    value = conn.get(stacks_key(job))
    if value is None:
        return None
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)
