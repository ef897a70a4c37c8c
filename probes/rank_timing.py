"""Timings per rank that a program or a log-analysis tool printed: one line per rank, or a table with a rank column.

    Rank 0 has data tensor(4., device='cuda:0') time cost 23.34592056274414 bandwidth 17.133614368513168
    Rank 3 has data tensor(4., device='cuda:3') time cost 2.7865920066833496 bandwidth 143.54451568103326

    [step 173] step_time=381.06s  dt_med=0.0028s  dt_max=332.46s
         rank   data_time   step_time
          144     332.459      48.455
          160       0.053     381.009

One `rank_timing` event per rank and line (or table row): `rank`, `metrics` (name -> number, as printed: the
units are those of the line), `group` (which lines compare with each other: one table, or lines of one metric),
and `collective` (the line times a collective: it names one, or a bandwidth, so its time is mostly waiting).
"""

from __future__ import annotations

import re

from hangdx.probes.model import Evidence, LogEvent, Quote, Source
from hangdx.probes.rx import lazy
from hangdx.probes.text import looks_binary, parse_by_lines

KIND = "rank_timing"
QUIET_WHEN_EMPTY = True

# `\b[Rr]ank...`, written so that `re` looks for the letter R first (a pattern that begins with \b is tried at
# every position of the line).
_RANK = lazy(r"[Rr](?<!\w[Rr])ank\s{0,3}[#:=]?\s{0,3}(\d{1,7})\b")
_METRIC_NAMES = (
    r"time[ _]cost|elapsed(?:[ _]time)?|took|duration|latency|(?:step|iter(?:ation)?|data|comm(?:unication)?"
    r"|forward|backward|fwd|bwd|compute|wait(?:ing)?|allreduce|all_reduce|sync)[ _]time|time"
)
_METRIC = lazy(
    rf"\b({_METRIC_NAMES})\b\s{{0,3}}(?:[:=]|is|of)?\s{{0,3}}(\d{{1,12}}(?:\.\d{{1,20}})?)(?![\d:])\s?(ms|us|s|sec|seconds)?\b",
    re.I,
)
_COLLECTIVE_WORDS = lazy(
    r"all_?reduce|all_?gather|reduce_?scatter|broadcast|all_?to_?all|barrier|collective|nccl|bandwidth|\bbw\b"
    r"|\bcomm",
    re.I,
)
# pytorch/examples' AverageMeter, which most training scripts copy: `Time 0.783 (2.771)  Data 0.006 (1.204)`, the
# last value and, in parentheses, the running average. A line with a rank and two such timings (the rank may sit
# in a bracketed label, `[GPU rank 1] Epoch: [1][30786/34406]`) compares by the averages.
_METER = lazy(
    r"\b(Time|Data|[Bb]atch[ _]time|[Dd]ata[ _]time)\s{1,8}(\d{1,12}(?:\.\d{1,12})?)\s{1,8}\((\d{1,12}(?:\.\d{1,12})?)\)"
)


def _meters(text: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for m in _METER.finditer(text):
        name = m.group(1).lower().replace(" ", "_")
        name = {"batch_time": "time", "data_time": "data"}.get(name, name)
        avg = _number(m.group(3))
        if avg is not None:
            out.setdefault(name, avg)
    return out if len(out) >= 2 else {}


# A table header: a rank column and at least one timing column (`rank data_time step_time`).
_HEADER_WORD = lazy(r"^(?:global_)?rank$|^(?:\w+[_ ])?time(?:\(\w+\))?$|^\w+_time(?:\(\w+\))?$", re.I)


def _header(text: str) -> list[str] | None:
    low_text = text.lower()
    if "rank" not in low_text or "time" not in low_text:  # cheap words first: this runs on every line read
        return None
    cols = [c for c in re.split(r"[\s|,]+", text.strip()) if c]
    if len(cols) < 2 or len(cols) > 16:
        return None
    low = [c.lower() for c in cols]
    if not any(c in ("rank", "global_rank") for c in low):
        return None
    if not all(_HEADER_WORD.match(c) for c in cols):
        return None
    if not any("time" in c for c in low):
        return None
    return low


def sniff(head: bytes) -> int:
    if not head or looks_binary(head):
        return 0
    text = head[:32768].decode("utf-8", errors="replace")
    n = sum(1 for ln in text.splitlines() if claims(ln))
    return 40 if n >= 2 else 0


# claims()'s needles (see probes/registry.py): every line it claims holds one of these words or patterns.
CLAIM_WORDS = ()
CLAIM_PATTERNS: tuple[str, ...] = (r"(?i)time", r"\b[Rr]ank")


def claims(line: str) -> int:
    """How surely one line is a per-rank timing (see probes/reader.py)."""
    if len(line) > 600:
        return 0
    if _header(line):
        return 7
    if "ank" not in line or not _RANK.search(line):
        return 0
    if len(_METER.findall(line)) >= 2:
        return 5
    if _METRIC.search(line) and not line.lstrip().startswith(("[", "#")):
        return 5
    return 0


def parse(data: bytes, src: Source, ev: Evidence) -> None:
    parse_by_lines(data, src, ev, parse_lines)


def parse_lines(numbered: list[tuple[int, str]], src: Source, ev: Evidence) -> None:
    """A region of clean lines (see probes/reader.py)."""
    table: list[str] | None = None
    table_group = ""
    context = ""  # the line above a table (`[step 173] step_time=381.06s`): which step it shows
    last_text = ""
    for item in numbered:
        no, raw = item[0], item[1]
        text = raw.strip()
        if not text:
            continue
        q = Quote(src.name, no, raw)
        cols = _header(text)
        if cols is not None:
            table, table_group, context = cols, f"{src.name}:{no}", last_text
            last_text = text
            continue
        if table is not None:
            cells = [c for c in re.split(r"[\s|,]+", text) if c]
            if len(cells) == len(table) and all(_number(c) is not None for c in cells):
                rank_col = next(i for i, c in enumerate(table) if c in ("rank", "global_rank"))
                rank_val = cells[rank_col]
                if rank_val.isdigit() and len(rank_val) <= 7:
                    metrics = {
                        c: _number(v) for c, v in zip(table, cells, strict=True) if c != table[rank_col]
                    }
                    _add(
                        ev,
                        src,
                        q,
                        int(rank_val),
                        metrics,
                        table_group,
                        any(_COLLECTIVE_WORDS.search(c) for c in table),
                        context,
                    )
                    continue
            table = None
        last_text = text
        rm = _RANK.search(text)
        meters = _meters(text) if rm is not None else {}
        if rm is not None and meters:
            _add(ev, src, q, int(rm.group(1)), meters, "meters:" + ",".join(sorted(meters)), False, "")
            continue
        if rm is None or text.startswith(("[", "#")):
            continue
        metrics = {}
        for m in _METRIC.finditer(text, rm.end()):
            val = _number(m.group(2))
            if val is not None:
                metrics.setdefault(m.group(1).lower().replace(" ", "_"), val)
        if not metrics:
            continue
        group = "lines:" + ",".join(sorted(metrics))
        _add(ev, src, q, int(rm.group(1)), metrics, group, bool(_COLLECTIVE_WORDS.search(text)), "")


def _number(s: str) -> float | None:
    s = s.rstrip("s") if re.fullmatch(r"[\d.]+s", s) else s
    try:
        v = float(s)
    except ValueError:
        return None
    return v if v == v and v not in (float("inf"), float("-inf")) else None


def _add(
    ev: Evidence, src: Source, q: Quote, rank: int, metrics: dict, group: str, collective: bool, context: str
) -> None:
    ev.events.append(
        LogEvent(
            "rank_timing",
            q,
            host=src.host,
            rank=rank,
            fields={"metrics": metrics, "group": group, "collective": collective, "context": context},
        )
    )
