"""Pipeline-parallel schedules as action lists per rank (torch.distributed.pipelining and its look-alikes).

    rank 0:  [... 0SendF1, 2RecvF0, 2F0]
    rank 1:  [0F0, 0SEND_F0, 0RECV_B0, 0B0]

An action is `<stage><type><microbatch>` as torch's `_Action` prints it: F (forward), B, I, W (backward parts),
SEND_F / RECV_F / SEND_B / RECV_B (point-to-point, also written SendF, RecvB, ...), UNSHARD, RESHARD, ...
One `pp_actions` event per list: its rank (from a `rank N:` before it, or the line's prefix), the actions in
order as (stage, type, microbatch, as printed), and whether the list was cut at its start (`[...`).
"""

from __future__ import annotations

import functools

from hangdx.probes.model import Evidence, LogEvent, Quote, Source
from hangdx.probes.rx import lazy
from hangdx.probes.text import looks_binary, parse_by_lines

KIND = "pp_schedule"
QUIET_WHEN_EMPTY = True

_ACTION = lazy(r"(\d{1,4})([A-Za-z][A-Za-z_]{0,20}?)(\d{1,6})?")
_TYPES = {
    "f": "F", "b": "B", "i": "I", "w": "W", "fullbackward": "B", "backwardinput": "I", "backwardweight": "W",
    "sendf": "SEND_F", "recvf": "RECV_F", "sendb": "SEND_B", "recvb": "RECV_B",
    "unshard": "UNSHARD", "reshard": "RESHARD", "reducegrad": "REDUCE_GRAD", "r": "RESHARD",
}  # fmt: skip
_LIST = lazy(r"\[([^\[\]]{1,20000})\]")
_RANK = lazy(r"\b[Rr]ank\s{0,3}(\d{1,7})\s{0,3}[:=]")
_ELLIPSIS = ("...", "…")


_TOKEN = lazy(r"\s*['\"]?(\d{1,4})([A-Za-z][A-Za-z_]{0,20}?)(\d{1,6})?['\"]?\s*")


def _actions(body: str) -> tuple[list[tuple[int, str, int | None, str]], bool] | None:
    """The actions of a list's body, and whether it starts with an elision; None when it is not an action list."""
    items = body.split(",")
    elided = False
    first = items[0].lstrip()
    if first.startswith(_ELLIPSIS):
        elided = True
        items[0] = first.lstrip(".… ")
    out: list[tuple[int, str, int | None, str]] = []
    for t in items:
        m = _TOKEN.fullmatch(t)
        if m is None:
            if not t.strip() or t.strip() in _ELLIPSIS:
                continue
            return None
        kind = _TYPES.get(m.group(2).lower().replace("_", ""))
        if kind is None:
            return None
        out.append((int(m.group(1)), kind, int(m.group(3)) if m.group(3) else None, t.strip().strip("'\"")))
    if len(out) < 2 or not any(k in ("F", "B", "I", "W") or "_" in k for _, k, _, _ in out):
        return None
    return out, elided


@functools.lru_cache(maxsize=1024)
def _parse(text: str) -> tuple[int | None, tuple, bool] | None:
    m = _LIST.search(text)
    if m is None:
        return None
    got = _actions(m.group(1))
    if got is None:
        return None
    r = _RANK.search(text[: m.start()])
    return (int(r.group(1)) if r else None), tuple(got[0]), got[1]


def sniff(head: bytes) -> int:
    if not head or looks_binary(head):
        return 0
    text = head[:32768].decode("utf-8", errors="replace")
    return 70 if any(_parse(ln) for ln in text.splitlines() if len(ln) < 20000) else 0


# claims()'s needles (see probes/registry.py): every line it claims holds one of these words or patterns.
CLAIM_WORDS = ()
CLAIM_PATTERNS: tuple[str, ...] = (r"\[[^\[\]]*,",)


def claims(line: str) -> int:
    """How surely one line is a pipeline action list (see probes/reader.py)."""
    if "[" not in line or len(line) > 20000:
        return 0
    return 7 if _parse(line) else 0


def parse(data: bytes, src: Source, ev: Evidence) -> None:
    parse_by_lines(data, src, ev, parse_lines)


def parse_lines(numbered: list[tuple[int, str]], src: Source, ev: Evidence) -> None:
    """A region of clean lines (see probes/reader.py)."""
    for item in numbered:
        no, raw = item[0], item[1]
        got = _parse(raw) if len(raw) < 20000 else None
        if got is None:
            continue
        rank, actions, elided = got
        rank = rank if rank is not None else src.rank
        if rank is None:
            continue
        ev.events.append(
            LogEvent(
                "pp_actions",
                Quote(src.name, no, raw),
                host=src.host,
                rank=rank,
                fields={"actions": list(actions), "elided": elided},
            )
        )
