"""Horovod's stall check: the warning its coordinator prints when a tensor waits on only some ranks.

Formats, from Horovod's sources (horovod/common/operations.cc before 0.16, stall_inspector.cc since):

    (<= 0.13, one line on stderr, the ops separated by ", ")
    WARNING: One or more tensors were submitted to be reduced, gathered or broadcasted by subset of ranks and
    are waiting for remainder of ranks for more than 60 seconds. This may indicate that different ranks are
    trying to submit different tensors or that only subset of ranks is submitting tensors, which will cause
    deadlock. Stalled ops: HVDAllReduce/x [ready ranks: 2, 6, 7, 3, 4, 1, 5], HVDAllReduce/y [ready ranks: ...]

    (0.13-0.18) ... deadlock. \\nStalled ops:\\nHVDAllReduce/x [missing ranks: 0]\\n   (one op a line)

    (>= 0.19, through Horovod's logger `[2021-02-02 21:19:07.345988: W .../stall_inspector.cc:105] `)
    One or more tensors were submitted ... which will cause deadlock. \\nStalled ranks:   (later: Missing ranks:)
    0: [HorovodAllreduce_grads_0, HorovodAllreduce_grads_1 ...]
    3!: [HorovodAllreduce_grads_0]
    One or more rank (marked by "!") is stalled for longer than 120 seconds. Will shutdown.

`[ready ranks: ...]` names the ranks that did submit the op; `[missing ranks: ...]` and `N: [...]` the ranks that
did not. A pasted warning is often wrapped by a chat window or a terminal: its lines are joined again here.
Lines may carry mpirun's `--tag-output` prefix `[1,0]<stderr>:`.

LogEvents (kind: fields):
    horovod_stall: seconds, ops ([{tensor, ready, missing}], ready/missing None when that form was not printed),
                   missing (ranks the warning names as missing, as printed), ready (ranks named as ready),
                   shutdown (Horovod gave up: `Will shutdown.` or a rank marked `!`), shutdown_ranks, shutdown_line (its
                   Quote), lines
                   (every line of the warning, as Quotes)
    horovod_shutdown: message (`Horovod has been shut down ...`, a HorovodInternalError)
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from hangdx.probes.model import Evidence, LogEvent, Quote, Source
from hangdx.probes.rx import lazy
from hangdx.probes.text import lines as text_lines
from hangdx.probes.text import looks_binary

KIND = "horovod_log"
QUIET_WHEN_EMPTY = True
# The reader hands this parser each line's rank from a launcher prefix (a third item): Horovod's own
# `0: [tensor]` lines look like srun's `0: ` label, which the reader takes off.
READS_RANKED_LINES = True

_HEAD = "One or more tensors were submitted to be"
_HEAD_RE = lazy(r"One or more tensors were submitted to\s+be")
_MPI_TAG = lazy(r"^\[\d{1,9},(\d{1,9})\]<std(?:out|err)>:")
# Horovod's logger: `[2021-02-02 21:19:07.345988: W /path/stall_inspector.cc:105] ` or `[W file.cc:105] `.
_HVD_HEADER = lazy(
    r"^\[(?:\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d{1,9}: )?(?:[TDIWEF]|TRACE|DEBUG|INFO|WARNING|ERROR|FATAL)"
    r"(?: [^\]\s]{1,400}:\d{1,7})?\] "
)
_LIST_HEAD = lazy(r"(?:Stalled ops|Stalled ranks|Missing ranks):")
# `NAME [ready ranks: 1, 2]`: found by its bracket, then the name before it and the list up to its `]` are cut out
# with string searches, so that a long line without the rest never makes a regex scan back and forth.
_OP = lazy(r" \[(ready|missing) ranks:")
_RANK_ENTRY = lazy(r"(?<![\w/\-.])(\d{1,9})(!?): \[")
_RANK_ENTRY_START = lazy(r"^\s{0,8}\d{1,9}!?: \[")
_SECONDS = lazy(r"for more than (\d{1,9}) seconds")
_WILL_SHUTDOWN = lazy(r"is stalled for longer than \d{1,9} seconds\. Will shutdown")
_SHUT_DOWN = lazy(r"Horovod has been shut down|HorovodInternalError")
MAX_BLOCK_LINES = 400


def sniff(head: bytes) -> int:
    if not head or looks_binary(head):
        return 0
    text = head.decode("utf-8", errors="replace")
    if _HEAD_RE.search(text) or "[ready ranks:" in text or "[missing ranks:" in text:
        return 60
    if _SHUT_DOWN.search(text):
        return 15
    return 0


# claims()'s needles (see probes/registry.py): every line it claims holds one of these words or patterns.
CLAIM_WORDS = (
    _HEAD,
    "[ready ranks:",
    "[missing ranks:",
    "Stalled ops:",
    "Will shutdown",
    "Stalled ranks:",
    "Missing ranks:",
    "Horovod has been shut down",
)
CLAIM_PATTERNS: tuple[str, ...] = ()


def claims(line: str) -> int:
    """How surely one line is Horovod's stall check (see probes/reader.py)."""
    if _HEAD in line or "[ready ranks:" in line or "[missing ranks:" in line:
        return 8
    if "Stalled ops:" in line or _WILL_SHUTDOWN.search(line):
        return 8
    if line.startswith(("Stalled ranks:", "Missing ranks:")) or (
        _HVD_HEADER.match(line) and _LIST_HEAD.search(line)
    ):
        return 6
    if "Horovod has been shut down" in line:
        return 8
    return 0


def parse(data: bytes, src: Source, ev: Evidence) -> None:
    if not data or looks_binary(data[:8192]):
        return
    parse_lines(list(enumerate(text_lines(data), 1)), src, ev)


@dataclass
class _Block:
    lines: list[tuple[int, str, str]] = field(default_factory=list)  # (line number, verbatim, body)
    listed: bool = False  # the list head (Stalled ops: / Missing ranks:) was seen
    reporter: int | None = None


def message(text: str) -> str:
    """A Horovod line without mpirun's tag and Horovod's log header, as a summary quotes it."""
    return _body(text)[0].strip()


def _body(text: str) -> tuple[str, int | None]:
    """A line without mpirun's tag and Horovod's log header; the rank the tag named."""
    rank = None
    m = _MPI_TAG.match(text)
    if m:
        rank, text = int(m.group(1)), text[m.end() :]
    m = _HVD_HEADER.match(text)
    if m:
        text = text[m.end() :]
    return text, rank


def parse_lines(lines: list[tuple], src: Source, ev: Evidence) -> None:
    """A region of clean lines (see probes/reader.py): (number, text) or (number, text, rank from a prefix)."""
    block: _Block | None = None
    for item in lines:
        try:
            no, text = int(item[0]), str(item[1])
            prefix_rank = item[2] if len(item) > 2 and isinstance(item[2], int) else None
            body, tag_rank = _body(text)
            if tag_rank is None:
                tag_rank = prefix_rank  # the reader took mpirun's tag off already: the rank it named
            if _HEAD in body or (_HEAD_RE.search(body) and "tensors" in body):
                _close(block, src, ev)
                block = _Block(reporter=tag_rank)
                block.lines.append((no, text, body))
                block.listed = bool(_LIST_HEAD.search(body))
                continue
            if block is None and body.lstrip().startswith(
                ("Stalled ranks:", "Missing ranks:", "Stalled ops:")
            ):
                # The list head is the stall inspector's own: its warning's prose above may be cut or garbled.
                block = _Block(reporter=tag_rank, listed=True)
                block.lines.append((no, text, body))
                continue
            if block is not None and _continues(block, body, prefix_rank):
                if prefix_rank is not None and body.startswith("[") and not _OP.search(body):
                    body = f"{prefix_rank}: {body}"  # `0: [tensor]`, its rank taken off as a launcher's label
                block.lines.append((no, text, body))
                block.listed = block.listed or bool(_LIST_HEAD.search(body))
                continue
            _close(block, src, ev)
            block = None
            if _SHUT_DOWN.search(body):
                ev.events.append(
                    LogEvent(
                        "horovod_shutdown",
                        Quote(src.name, no, text),
                        host=src.host,
                        rank=tag_rank if tag_rank is not None else src.rank,
                        pid=src.pid,
                        fields={"message": " ".join(body.split())[:500]},
                    )
                )
        except (ValueError, IndexError, TypeError):  # an odd line is skipped, never fatal
            continue
    _close(block, src, ev)


def _continues(block: _Block, body: str, prefix_rank: int | None) -> bool:
    """Is this line still part of the warning (its wrapped prose, an op, a rank's entry, the shutdown note)?"""
    if len(block.lines) >= MAX_BLOCK_LINES or not body.strip():
        return False
    if not block.listed:
        return len(block.lines) < 10  # the warning's prose, wrapped
    last = block.lines[-1][2].rstrip()
    if last.endswith((",", ":", "[")) or last.count("[") > last.count("]"):
        return True  # a list cut by a wrap
    if _OP.search(body) or _RANK_ENTRY_START.match(body) or _WILL_SHUTDOWN.search(body):
        return True
    if prefix_rank is not None and _TENSOR_LIST_START.match(body):
        return True  # `8: [name, name, ...` wrapped (or cut with a terminal's `$`) before its `]`
    return prefix_rank is not None and body.startswith("[") and body.rstrip().endswith("]")


_TENSOR_LIST_START = lazy(r"\[[\w/.\-:]{1,400}(?:,|\$?\s*$)")


MAX_RANK = 1 << 20  # a larger number is not a rank (a mangled line): skipped


def _ranks(text: str) -> list[int]:
    return [int(x) for x in re.findall(r"(?<!\d)\d{1,7}(?!\d)", text) if int(x) < MAX_RANK]


def _close(block: _Block | None, src: Source, ev: Evidence) -> None:
    if block is None:
        return
    joined = " ".join(" ".join(b.split()) for _, _, b in block.lines)
    # A word wrapped in two (`submitted to\nbe`) is joined with a space: the phrases are matched loosely.
    ops: list[dict] = []
    quote_at: tuple[int, str] | None = None
    for m in _OP.finditer(joined):
        close = joined.find("]", m.end(), m.end() + 100_000)
        if close < 0:
            continue  # the list was cut off
        before = joined[max(0, m.start() - 1000) : m.start()]
        name = re.split(r"[\s,\]]", before)[-1].removeprefix("ops:")
        ranks = sorted(set(_ranks(joined[m.end() : close])))
        if not name:
            continue
        ops.append(
            {
                "tensor": name,
                "ready": ranks if m.group(1) == "ready" else None,
                "missing": ranks if m.group(1) == "missing" else None,
            }
        )
    missing: set[int] = {r for op in ops for r in op["missing"] or []}
    ready: set[int] = {r for op in ops for r in op["ready"] or []}
    shutdown_ranks: set[int] = set()
    head = re.search(r"(?:Stalled|Missing) ranks:", joined)
    if head:
        by_name = {o["tensor"]: o for o in ops}
        entries = list(_RANK_ENTRY.finditer(joined, head.end()))
        for m, nxt in zip(entries, entries[1:] + [None], strict=False):
            end = nxt.start() if nxt else len(joined)
            close = joined.find("]", m.end(), end)
            r = int(m.group(1))
            if close < 0 and nxt is None and "," in joined[m.end() : end]:
                # The last entry cut off by the paste: its complete names still say what that rank lacks.
                close = joined.rfind(",", m.end(), end)
            if close < 0 or r >= MAX_RANK:
                continue  # a list cut off, or not a rank
            missing.add(r)
            if m.group(2):
                shutdown_ranks.add(r)
            for t in joined[m.end() : close].split(","):
                t = t.strip().removesuffix("...").strip()
                if not t:
                    continue
                op = by_name.get(t)
                if op is None:
                    op = by_name[t] = {"tensor": t, "ready": None, "missing": []}
                    ops.append(op)
                if r not in op["missing"]:
                    op["missing"].append(r)
        for op in ops:
            if op["missing"] is not None:
                op["missing"].sort()
    if not ops and not missing:
        return  # the warning's prose alone, its list cut off: nothing to say who waits
    for no, text, body in block.lines:
        if _OP.search(body) or _RANK_ENTRY.search(body):
            quote_at = (no, text)
            break
    no, text = quote_at or (block.lines[0][0], block.lines[0][1])
    gave_up = next((Quote(src.name, n, t) for n, t, b in block.lines if _WILL_SHUTDOWN.search(b)), None)
    if gave_up is None and shutdown_ranks:
        gave_up = next((Quote(src.name, n, t) for n, t, b in block.lines if re.search(r"\d!: \[", b)), None)
    secs = _SECONDS.search(joined)
    ev.events.append(
        LogEvent(
            "horovod_stall",
            Quote(src.name, no, text),
            host=src.host,
            rank=block.reporter if block.reporter is not None else src.rank,
            pid=src.pid,
            fields={
                "seconds": int(secs.group(1)) if secs else None,
                "ops": ops,
                "missing": sorted(missing),
                "ready": sorted(ready),
                "shutdown": bool(shutdown_ranks) or bool(_WILL_SHUTDOWN.search(joined)),
                "shutdown_ranks": sorted(shutdown_ranks),
                "shutdown_line": gave_up,
                "lines": [Quote(src.name, n, t) for n, t, _ in block.lines],
            },
        )
    )
