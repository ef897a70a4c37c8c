"""Process-state samples written by hangdx's collector (`processes.json`): /proc state per rank over time."""

from __future__ import annotations

import json
from dataclasses import fields

from hangdx.probes.model import Evidence, ProcessState, Source
from hangdx.probes.text import decode

KIND = "procstate"

_FIELDS = {f.name for f in fields(ProcessState)}


def sniff(head: bytes) -> int:
    return 95 if b'"hangdx": "procstate"' in head[:4096] or b'"hangdx":"procstate"' in head[:4096] else 0


def parse(data: bytes, src: Source, ev: Evidence) -> None:
    try:
        doc = json.loads(decode(data))
    except ValueError as e:
        ev.gap(src.name, f"process-state file is not valid JSON (truncated?): {e}")
        return
    if not isinstance(doc, dict) or not isinstance(doc.get("samples"), list):
        ev.gap(src.name, "process-state file without samples")
        return
    if doc.get("job_id") and not ev.job_id:
        ev.job_id = str(doc["job_id"])
    if isinstance(doc.get("world_size"), int) and not ev.world_size:
        ev.world_size = doc["world_size"]
    host = doc.get("host") or src.host
    for s in doc["samples"]:
        if not isinstance(s, dict) or not isinstance(s.get("pid"), int):
            continue
        values = {k: v for k, v in s.items() if k in _FIELDS}
        values.setdefault("host", host)
        if not isinstance(values.get("rank"), (int, type(None))):
            values["rank"] = None
        ev.processes.append(ProcessState(**values))
    ev.note_host(host)
