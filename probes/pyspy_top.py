"""`py-spy top` (and `py-spy record --format raw`-style summaries) rows: where a process spent its samples.

    %Own   %Total  OwnTime  TotalTime  Function (filename)
    100.00% 100.00%   241.8s    241.8s   _coalescing_manager (torch/distributed/distributed_c10d.py:1978)
      0.00% 100.00%   0.000s    241.8s   <module> (train.py:12)

A function with %Total near 100 was on the stack of every sample: the process never left it. Those rows make
one stack of the process (innermost first: the smallest %Total, then the largest %Own), read by the stack
classification like a py-spy dump of a process that stayed there the whole time.
"""

from __future__ import annotations

import re

from hangdx.probes.model import Evidence, Frame, Quote, Source, StackDump, ThreadStack
from hangdx.probes.rx import lazy
from hangdx.probes.text import lines

KIND = "pyspy_top"

_ROW = lazy(
    r"^\s{0,8}(\d{1,3}(?:\.\d{1,3})?)%\s{1,12}(\d{1,3}(?:\.\d{1,3})?)%\s{1,12}(\d{1,9}(?:\.\d{1,6})?)s"
    r"\s{1,12}(\d{1,9}(?:\.\d{1,6})?)s\s{1,12}(\S.{0,300}?) \(([^()]{1,1000}?)(?::(\d{1,9}))?\)\s*$"
)
_HEADER = lazy(r"^\s{0,8}%Own\s+%Total\s+OwnTime\s+TotalTime\s+Function")
ALWAYS = 90.0  # %Total at or above which a function was on (nearly) every sample's stack


def sniff(head: bytes) -> int:
    text = head[:16384].decode("utf-8", errors="replace")
    if re.search(r"^\s*%Own\s+%Total\s+OwnTime\s+TotalTime", text, re.M):
        return 70
    n = sum(1 for ln in text.splitlines()[:200] if _ROW.match(ln))
    return 40 if n >= 2 else 0


# claims()'s needles (see probes/registry.py): every line it claims holds one of these words or patterns.
CLAIM_WORDS = ("%",)
CLAIM_PATTERNS: tuple[str, ...] = ()


def claims(line: str) -> int:
    """How surely one line is py-spy top's (see probes/reader.py)."""
    if "%Own" in line and _HEADER.match(line):
        return 9
    if "%" in line and line.rstrip().endswith(")") and len(line) < 2000 and _ROW.match(line):
        return 7
    return 0


def parse(data: bytes, src: Source, ev: Evidence) -> None:
    parse_lines(list(enumerate(lines(data), 1)), src, ev)


def parse_lines(numbered: list[tuple[int, str]], src: Source, ev: Evidence) -> None:
    """A region of clean lines (see probes/reader.py)."""
    rows = []
    for no, raw in numbered:
        m = _ROW.match(raw) if raw.rstrip().endswith(")") and len(raw) < 2000 else None
        if not m:
            continue
        try:
            own, total = float(m.group(1)), float(m.group(2))
        except ValueError:
            continue
        line = int(m.group(7)) if m.group(7) else None
        func, file = m.group(5).strip(), m.group(6)
        if "." in func and not func.startswith("<"):
            func = func.rsplit(".", 1)[1]  # py-spy 0.4 prints qualified names: `Thread.join`
        native = not file.endswith((".py", ".pyx")) and not file.startswith("<")
        frame = Frame(func, file, line, native, quote=Quote(src.name, no, raw.strip()))
        rows.append((total, own, frame))
    always = [r for r in rows if r[0] >= ALWAYS]
    if not always:
        return
    always.sort(key=lambda r: (r[0], -r[1]))
    thread = ThreadStack(None, "MainThread", "unknown", [f for _, _, f in always], always[0][2].quote)
    ev.stacks.append(StackDump(pid=src.pid, rank=src.rank, host=src.host, threads=[thread], source=src.name))
