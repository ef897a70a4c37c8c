"""Process-state samples written by hangdx's collector (`processes.json`): /proc state per rank over time."""

from __future__ import annotations

import json
import math
from dataclasses import fields

from hangdx.probes.model import Evidence, ProcessState, Source
from hangdx.probes.text import decode

KIND = "procstate"

_FIELDS = {f.name: str(f.type) for f in fields(ProcessState)}  # name -> "int | None", "str", ...


def _fits(value: object, typ: str) -> bool:
    """True when a JSON value has the field's type (a float is no pid, a bool no count, NaN no time)."""
    if value is None:
        return "None" in typ
    if isinstance(value, bool):
        return False
    if typ.startswith("int"):
        return isinstance(value, int)
    if typ.startswith("float"):
        return isinstance(value, (int, float)) and math.isfinite(value)
    if typ.startswith("dict"):
        return (
            isinstance(value, dict)
            and len(value) <= 256
            and all(isinstance(k, str) and isinstance(v, str) and len(v) <= 4096 for k, v in value.items())
        )
    return typ.startswith("str") and isinstance(value, str)


def sniff(head: bytes) -> int:
    return 95 if b'"hangdx": "procstate"' in head[:4096] or b'"hangdx":"procstate"' in head[:4096] else 0


def parse(data: bytes, src: Source, ev: Evidence) -> None:
    try:
        doc = json.loads(decode(data))
    except (ValueError, RecursionError) as e:
        ev.gap(src.name, f"process-state file is not valid JSON (truncated?): {type(e).__name__}: {e}")
        return
    if not isinstance(doc, dict) or not isinstance(doc.get("samples"), list):
        ev.gap(src.name, "process-state file without samples")
        return
    if isinstance(doc.get("job_id"), (str, int)) and doc["job_id"] != "" and not ev.job_id:
        ev.job_id = str(doc["job_id"])
    if _fits(doc.get("world_size"), "int") and not ev.world_size:
        ev.world_size = doc["world_size"]
    host = doc.get("host") if isinstance(doc.get("host"), str) and doc.get("host") else src.host
    for s in doc["samples"]:
        if not isinstance(s, dict) or not _fits(s.get("pid"), "int"):
            continue
        # A value of the wrong type (a hand-edited or corrupt file) is dropped, not carried into the facts.
        values = {k: v for k, v in s.items() if k in _FIELDS and _fits(v, _FIELDS[k])}
        values.setdefault("host", host)
        values.setdefault("rank", None)  # the one field without a default
        ev.processes.append(ProcessState(**values))
    ev.note_host(host)
