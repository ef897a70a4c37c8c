"""`dcgmi diag -r N`: DCGM's GPU diagnostic, as the boxed table it prints or as `dcgmi diag -j` JSON.

The table (DCGM 2.x to 4.x; the groups and test names vary, the box does not):

    +---------------------------+------------------------------------------------+
    | Diagnostic                | Result                                         |
    +===========================+================================================+
    |-----  Deployment  --------+------------------------------------------------|
    | Page Retirement/Row Remap | Pass                                           |
    | Error                     | GPU 3 has uncorrectable memory errors and row  |
    |                           |  remappings are pending                        |
    +-----  Hardware  ----------+------------------------------------------------+
    | GPU Memory                | Pass - GPUs: 1, 2, 3, 4, 5, 6, 7               |
    |                           | Fail - GPU: 0                                  |
    | Warning                   | GPU 0 Thermal violations totaling 13.3 second  |
    |                           | s started at 9.7 seconds into the test for GP  |
    | memory                    | Pass                                           |   (4.x: a row per GPU below)
    |                           | GPU0: Fail                                     |

A `Warning`, `Error` or `Info` row's text is cut into 45-character pieces over as many rows; the pieces are
joined again. The JSON (`-j`): `{"DCGM GPU Diagnostic" | "DCGM Diagnostic": {"test_categories": [{"category",
"tests": [{"name", "results": [{"gpu_id" | "gpu_ids" | "entity_id", "status", "warnings": [...]}]}]}]}}`.

Records: a LogEvent "dcgm_diag_fail" per test that failed on a GPU (test, group, gpu_index or None for
`All`, gpu `GPU n`, warnings: the texts DCGM gave for that GPU in that test, severity), quoting the `Fail`
line; a `Warning`/`Error` row becomes a LogEvent "dcgm_diag_warning" (test, group, level, gpu_index, text)
quoting its first line. An `Error` row that names a GPU is a failure of that GPU even with no `Fail` line
(DCGM prints one for a deployment check that stopped the run).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from hangdx.probes.model import Evidence, LogEvent, Quote, Source
from hangdx.probes.rx import lazy
from hangdx.probes.text import decode, lines, looks_binary

KIND = "dcgmi_diag"
QUIET_WHEN_EMPTY = True  # a run where every test passed has nothing to say

_HEADER = lazy(r"^\|\s*Diagnostic\s+\|\s*Result\s+\|$")
_BORDER = lazy(r"^\+[-=]{10,80}\+[-=]{10,80}\+$")
_GROUP = lazy(r"^[|+]-{2,20}\s+([A-Za-z][A-Za-z ]{0,40}?)\s+-{1,40}\+-{10,80}[|+]$")
_ROW = lazy(r"^\|([^|]{1,80})\|(.{0,200}?)\|?\s*$")
_RESULT = lazy(r"^(Pass|Fail|Skip|Warn)\b(?:\s*-\s*(All|GPUs?:\s*([\d,\s]{1,200})))?", re.IGNORECASE)
_RESULT_4X = lazy(r"^GPU\s?(\d{1,4}):\s*(Pass|Fail|Skip|Warn)\b", re.IGNORECASE)
_NAMES_GPU = lazy(r"^GPU\s?(\d{1,4})\b")
_NOTE = ("warning", "error", "info")
_CHUNK = 45  # DCGM cuts a note into pieces of this many characters, one per row
_HARDWARE_GROUPS = ("deployment", "integration", "hardware")
_MAX_WARNINGS = 5


@dataclass
class _Test:
    name: str
    group: str
    failed: list[tuple[int | None, Quote]] = field(default_factory=list)  # (gpu index or None for All)


@dataclass
class _Note:
    level: str
    test: _Test | None
    group: str
    quote: Quote
    pieces: list[str] = field(default_factory=list)


class _Parser:
    def __init__(self, src: Source, ev: Evidence) -> None:
        self.src, self.ev = src, ev
        self.group = ""
        self.tests: list[_Test] = []
        self.test: _Test | None = None
        self.notes: list[_Note] = []
        self.note: _Note | None = None
        self.boxed = False  # DCGM's own header, group or border seen: a bare `Fail` row is one of its tests

    def line(self, no: int, raw: str) -> None:
        s = raw.strip()
        if not s:
            return
        if _BORDER.match(s) or _HEADER.match(s):
            self.boxed = True
            return
        m = _GROUP.match(s)
        if m:
            self.boxed = True
            self.group = m.group(1).strip()
            self.test, self.note = None, None
            return
        m = _ROW.match(s)
        if not m:
            return
        left, right = m.group(1).strip(), m.group(2)
        if not left:  # a continuation row
            if self.note is not None:
                self.note.pieces.append(_piece(right))
            elif self.test is not None:
                self.result(no, raw, right.strip())
            return
        self.note = None
        if left.lower() in _NOTE:
            self.note = _Note(
                left.lower(), self.test, self.group, Quote(self.src.name, no, raw), [_piece(right)]
            )
            self.notes.append(self.note)
            return
        if self.group.lower() == "metadata":
            return
        self.test = _Test(left, self.group)
        self.tests.append(self.test)
        self.result(no, raw, right.strip())

    def result(self, no: int, raw: str, text: str) -> None:
        if self.test is None:
            return
        m4 = _RESULT_4X.match(text)
        if m4:
            if m4.group(2).lower() == "fail":
                self.test.failed.append((int(m4.group(1)), Quote(self.src.name, no, raw)))
            return
        m = _RESULT.match(text)
        if not m or m.group(1).lower() != "fail":
            return
        quote = Quote(self.src.name, no, raw)
        if m.group(3):
            for part in m.group(3).split(","):
                if part.strip().isdigit():
                    self.test.failed.append((int(part.strip()), quote))
        else:
            self.test.failed.append((None, quote))

    def finish(self) -> None:
        by_test: dict[int, list[tuple[int | None, str]]] = {}  # id(test) -> its warnings: (gpu index, text)
        for n in self.notes:
            text = " ".join("".join(n.pieces).split())
            g = _NAMES_GPU.match(text)
            index = int(g.group(1)) if g else None
            if n.level == "info":
                continue
            if n.test is not None:
                by_test.setdefault(id(n.test), []).append((index, text))
            fields = {
                "test": n.test.name if n.test else None,
                "group": n.group or None,
                "level": n.level,
                "gpu_index": index,
                "text": text,
            }
            self.event("dcgm_diag_warning", n.quote, fields)
            # An `Error` row naming a GPU, under no failed test: the check that printed it stopped the run.
            if n.level == "error" and index is not None and not (n.test and n.test.failed):
                self.fail(n.quote, n.test.name if n.test else "", n.group, index, [text])
        for t in self.tests:
            notes = by_test.get(id(t), [])
            for index, quote in _failures(t, notes):
                if index is None and not self.boxed:
                    continue  # `| name | Fail |` alone, outside DCGM's box, could be any table
                warnings = [x for i, x in notes if index is None or i == index][:_MAX_WARNINGS]
                self.fail(quote, t.name, t.group, index, warnings)

    def fail(self, quote: Quote, test: str, group: str, index: int | None, warnings: list[str]) -> None:
        _failed(self.ev, self.src, quote, test, group, index, warnings)

    def event(self, kind: str, quote: Quote, fields: dict[str, Any]) -> None:
        _event(self.ev, self.src, kind, quote, fields)


def _failed(
    ev: Evidence, src: Source, quote: Quote, test: str, group: str, index: int | None, warnings: list[str]
) -> None:
    """One failed test on one GPU (or on all, when DCGM names none), with DCGM's warnings."""
    fields = {
        "test": test or None,
        "group": group or None,
        "gpu_index": index,
        "gpu": f"GPU {index}" if index is not None else None,
        "warnings": warnings,
        "severity": "critical" if group.lower() in _HARDWARE_GROUPS else "error",
    }
    _event(ev, src, "dcgm_diag_fail", quote, fields)


def _event(ev: Evidence, src: Source, kind: str, quote: Quote, fields: dict[str, Any]) -> None:
    fields = {k: v for k, v in fields.items() if v is not None}
    ev.events.append(LogEvent(kind, quote, host=src.host, rank=src.rank, fields=fields))


def _piece(cell: str) -> str:
    """One row's piece of a note: DCGM pads a 45-character piece with a blank before and after it."""
    return cell[1 : 1 + _CHUNK] if cell.startswith(" ") else cell.strip() + " "


def _failures(t: _Test, notes: list[tuple[int | None, str]]) -> list[tuple[int | None, Quote]]:
    """The GPUs a test failed on, each once; `Fail - All` names the GPUs its warnings name, when they name any."""
    out: dict[int | None, Quote] = {}
    named = sorted({i for i, _ in notes if i is not None})
    for index, quote in t.failed:
        for i in [index] if index is not None else named or [None]:
            out.setdefault(i, quote)
    return list(out.items())


# -- sniffing and claiming ---------------------------------------------------------------------------------


def _is_json(text: str) -> bool:
    head = text.lstrip()[:4096]
    return head[:1] == "{" and ('"DCGM GPU Diagnostic"' in head or '"DCGM Diagnostic"' in head)


def sniff(head: bytes) -> int:
    if not head or looks_binary(head):
        return 0
    text = head[:32768].decode("utf-8", errors="replace")
    if _is_json(text):
        return 95
    rows = [ln.strip() for ln in text.splitlines()[:3000]]
    if any(_HEADER.match(r) for r in rows):
        return 95
    if any(_GROUP.match(r) for r in rows):
        return 90
    results = sum(1 for r in rows if (m := _ROW.match(r)) and _RESULT.match(m.group(2).strip()))
    return 70 if results >= 2 else 0


# claims()'s needles (see probes/registry.py): every line it claims holds one of these words or patterns.
CLAIM_WORDS = ("|", "+")
CLAIM_PATTERNS: tuple[str, ...] = ()


def claims(line: str) -> int:
    """How surely one line is `dcgmi diag`'s (see probes/reader.py)."""
    s = line.strip()
    if not s.startswith(("|", "+")) or len(s) > 300:
        return 0
    if _HEADER.match(s):
        return 10
    if _GROUP.match(s):
        return 9
    if _BORDER.match(s):
        return 7  # two cells: nvidia-smi's own borders have one or three
    m = _ROW.match(s)
    if m:
        right = m.group(2).strip()
        if _RESULT.match(right) or _RESULT_4X.match(right):
            return 8
        if m.group(1).strip().lower() in _NOTE and _NAMES_GPU.match(right):
            return 8
    return 0


# -- reading -----------------------------------------------------------------------------------------------


def parse(data: bytes, src: Source, ev: Evidence) -> None:
    if looks_binary(data[:8192]):
        return
    text = decode(data)
    if _is_json(text):
        _parse_json(text, src, ev)
        return
    parse_lines(list(enumerate(lines(data), 1)), src, ev)


def parse_lines(numbered: list[tuple[int, str]], src: Source, ev: Evidence) -> None:
    """A region of clean lines (see probes/reader.py)."""
    p = _Parser(src, ev)
    for no, raw in numbered:
        try:
            p.line(no, raw)
        except ValueError:
            continue
    p.finish()


def _parse_json(text: str, src: Source, ev: Evidence) -> None:
    try:
        doc = json.loads(text)
    except (ValueError, RecursionError):
        ev.gap(src.name, "dcgmi diag JSON that does not parse: skipped")
        return
    root = doc.get("DCGM GPU Diagnostic") or doc.get("DCGM Diagnostic") if isinstance(doc, dict) else None
    cats = root.get("test_categories") if isinstance(root, dict) else None
    raw_lines = text.split("\n")
    for cat in cats if isinstance(cats, list) else []:
        if not isinstance(cat, dict):
            continue
        group = str(cat.get("category") or "")
        for test in cat.get("tests") or []:
            if not isinstance(test, dict):
                continue
            name = str(test.get("name") or "")
            for res in test.get("results") or []:
                if not isinstance(res, dict) or str(res.get("status", "")).lower() != "fail":
                    continue
                index = _json_gpu(res)
                warnings = [_json_warning(w) for w in res.get("warnings") or []]
                warnings = [w for w in warnings if w]
                no = _json_line(raw_lines, name, warnings)
                quote = Quote(src.name, no, raw_lines[no - 1].rstrip("\r"))
                _failed(ev, src, quote, name, group, index, warnings)


def _json_gpu(res: dict[str, Any]) -> int | None:
    for key in ("gpu_id", "gpu_ids", "entity_id"):
        v = res.get(key)
        if isinstance(v, int) or isinstance(v, str) and v.strip().isdigit():
            return int(v)
    return None


def _json_warning(w: Any) -> str:
    if isinstance(w, dict):
        w = w.get("warning") or w.get("message") or ""
    return " ".join(str(w).split())[:1000]


def _json_line(raw_lines: list[str], name: str, warnings: list[str]) -> int:
    """The line to quote for a failed result: its warning's, else its test's name."""
    needles = [json.dumps(w)[1:41] for w in warnings] + [json.dumps(name)]
    for needle in needles:
        for i, ln in enumerate(raw_lines, 1):
            if needle and needle in ln:
                return i
    return 1
