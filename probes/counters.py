"""Progress counters in a training program's own log lines: `step: 120`, `Iteration 40/500`, `batch 87 start`.

A training loop logs where it is. Each rank's last counter says how far that rank got through a loop; when the
ranks' last counters of the same loop differ and every rank's log stops there, the ranks ran that loop a
different number of times. Lines are matched as people's training code prints them, through Python's `logging`
(`2025-08-21 11:19:52,993 - root - INFO - ...`, `INFO:root:...`) or plain `print`.

`find(msg)` reads one line; `Counters` keeps each rank's first and last counter of each loop (a loop is named by
the counter word and the words before it, digits masked, so that `Rank 0 batch 87` and `Rank 1 batch 89` are the
same loop); `events()` turns them into LogEvent fields (kind `step_counter`):
    what (the counter word), loop (the masked words before it), first, n (the last counter), total (the `/N`
    when printed), count (lines read), first_time / last_time (epoch seconds from the line's timestamp, when it
    has one), line (the line number of the last counter line), stride (the smallest step up between successive
    counters: 1 for a line every batch, 10 for a log every 10 steps; None when the counter never rose)
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from hangdx.probes.rx import lazy

# The counter word, then its number: `step 120`, `step: 120`, `step=120`, `Step [120/1000]`, `iter #40`.
# `steps`, `batch_size`, `max_steps` are not counters (word boundaries and no plural).
_COUNTER = lazy(
    r"(?<![\w.\-/])(global[_ ]step|step|iteration|iter|batch(?:[_ ]idx)?)(?![\w\-/])"
    r"[ \t]{0,3}(?:[:=#]|\[|No\.?)?[ \t]{0,3}(\d{1,9})(?![\d.])(?:[ \t]{0,2}/[ \t]{0,2}(\d{1,9}))?",
    re.IGNORECASE,
)
_WORDS = ("step", "iter", "batch")  # a cheap test before the regex
_DIGITS = lazy(r"\d+")
# Python logging's asctime (`2025-08-21 11:19:52,993`), an ISO time (`2025-08-21T11:19:52.993`).
_TIME = lazy(r"(\d{4})-(\d\d)-(\d\d)[ T](\d\d):(\d\d):(\d\d)(?:[.,](\d{1,6}))?")
# A line printed through Python's logging or loguru, as its default and common formats print it.
_PY_LOG = lazy(
    r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}(?!\d).{0,120}?\b(?:DEBUG|INFO|WARNING|WARN|ERROR|CRITICAL)\b"
    r"|^(?:DEBUG|INFO|WARNING|ERROR|CRITICAL):[\w.]{1,80}:"
    r"|\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d{3} \| (?:TRACE|DEBUG|INFO|SUCCESS|WARNING|ERROR|CRITICAL) {0,8}\|"
)


# The length of the loop a rank is about to run, as programs print it per rank before training or evaluation
# (the number of batches of its shard of the data): `Number of batches 4`, `num_batches: 4`, `len(train_loader) =
# 4`, `steps per epoch: 4`, `4 batches per epoch`. With the same collectives in every step, ranks whose loops differ
# in length cannot all finish (DDP's uneven inputs: torch.distributed.algorithms.Join exists for it).
_LENGTH = lazy(
    r"\b(?:[Nn]umber of|[Nn]um_?|[Tt]otal) ?(?P<what>batch(?:es)?|steps?|iter(?:ation)?s?|samples?)\b[ \t]{0,3}[:=]?[ \t]{0,3}"
    r"(?P<n>\d{1,12})(?![\d.])"
    r"|\blen\([\w.]{0,60}(?:loader|dataloader|batches)\)[ \t]{0,3}[:=]?[ \t]{0,3}(?P<n2>\d{1,12})(?![\d.])"
    r"|\b(?P<what3>[Ss]teps|[Bb]atches|[Ii]terations)[ _]per[ _]epoch\b[ \t]{0,3}[:=]?[ \t]{0,3}(?P<n3>\d{1,12})(?![\d.])"
)
LENGTH_WORDS = (
    "umber of",
    "um_",
    "Num",
    "otal",
    "len(",
    "per epoch",
    "per_epoch",
)  # every length line holds one
# A rank named inside the line (`Rank = 2, ...`, `rank 3: ...`, `[rank 1]`), for a length line with no prefix.
_INLINE_RANK = lazy(r"\b[Rr](?:ank|ANK) ?[=:#]? ?(\d{1,6})\b")


def length(msg: str) -> tuple[str, int] | None:
    """The loop length one line prints: (what: batches, steps, iterations or samples; n)."""
    if len(msg) > 2000 or not any(w in msg for w in LENGTH_WORDS):
        return None
    m = _LENGTH.search(msg)
    if not m:
        return None
    if m.group("n") is not None:
        word, n = m.group("what").lower(), m.group("n")
    elif m.group("n2") is not None:
        word, n = "batches", m.group("n2")
    else:
        word, n = m.group("what3").lower(), m.group("n3")
    what = (
        "batches"
        if word.startswith("batch")
        else "steps"
        if word.startswith("step")
        else ("samples" if word.startswith("sample") else "iterations")
    )
    return what, int(n)


def inline_rank(msg: str) -> int | None:
    """A rank the line names in its words (not a prefix): `Rank = 2, Number of batches 8`."""
    m = _INLINE_RANK.search(msg)
    return int(m.group(1)) if m else None


def is_python_log(line: str) -> bool:
    """Is this a line printed through Python's logging (or loguru) in a common format?"""
    if not ("," in line or " | " in line or line[:1] in "DIWEC"):  # what each of the formats needs, cheaply
        return False
    return len(line) < 20000 and bool(_PY_LOG.search(line))


def find(msg: str) -> tuple[str, int, int | None, str] | None:
    """The counter in one log line: (word, number, total or None, the loop's masked words before it)."""
    if len(msg) > 4000:
        return None
    low = msg.lower()
    if not any(w in low for w in _WORDS):
        return None
    m = _COUNTER.search(msg)
    if not m:
        return None
    word = m.group(1).lower().replace(" ", "_")
    word = {"iteration": "iter", "batch_idx": "batch", "batch idx": "batch"}.get(word, word)
    before = _TIME.sub("", msg[: m.start()])
    loop = " ".join(_DIGITS.sub("#", before).split())[-80:]
    total = int(m.group(3)) if m.group(3) else None
    return word, int(m.group(2)), total, loop


def timestamp(msg: str) -> float | None:
    """Seconds (local time, naive) of the first date and time in a line, to compare lines of one log."""
    m = _TIME.search(msg)
    if not m:
        return None
    try:
        frac = m.group(7) or "0"
        t = datetime(*(int(m.group(i)) for i in range(1, 7)))  # type: ignore[misc]
        return t.timestamp() + int(frac) / 10 ** len(frac)
    except (ValueError, OverflowError, OSError):
        return None


@dataclass
class _Entry:
    first: int
    n: int
    total: int | None
    count: int
    first_time: float | None
    last_time: float | None
    line: Any  # the parser's own line object (its quote)
    lineno: int
    stride: int | None = None  # the smallest step up between successive counters (a log every 10 steps: 10)


class Counters:
    """Each rank's first and last counter of each loop, in the order the lines came."""

    def __init__(self) -> None:
        self._by: dict[tuple[int, str, str], _Entry] = {}

    def note(self, rank: int | None, msg: str, lineno: int, line: Any) -> None:
        if rank is None:
            return
        found = find(msg)
        if found is None:
            return
        word, n, total, loop = found
        t = timestamp(msg)
        key = (rank, word, loop)
        e = self._by.get(key)
        if e is None:
            self._by[key] = _Entry(n, n, total, 1, t, t, line, lineno)
            return
        if n > e.n:
            e.stride = min(e.stride or n - e.n, n - e.n)
        e.n, e.total, e.count, e.line, e.lineno = n, total or e.total, e.count + 1, line, lineno
        if t is not None:
            e.first_time = e.first_time if e.first_time is not None else t
            e.last_time = t

    def events(self) -> list[tuple[int, Any, dict[str, Any]]]:
        """(rank, the last counter line, fields) per rank and loop."""
        return [
            (
                rank,
                e.line,
                {
                    "what": word,
                    "loop": loop,
                    "first": e.first,
                    "n": e.n,
                    "total": e.total,
                    "count": e.count,
                    "first_time": e.first_time,
                    "last_time": e.last_time,
                    "line": e.lineno,
                    "stride": e.stride,
                },
            )
            for (rank, word, loop), e in self._by.items()
        ]
