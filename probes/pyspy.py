"""py-spy dumps: `py-spy dump` text (also --native and --locals) and `py-spy dump --json`.

Text, as py-spy 0.3/0.4 prints it:

    Process 7685: /usr/bin/python3.11 -u train.py
    Python v3.11.7 (/usr/bin/python3.11)

    Thread 7685 (idle): "MainThread"
        all_reduce (torch/distributed/distributed_c10d.py:3252)
            Arguments:
                tensor: <Tensor at 0x7f6305fb7020>
        <module> (train.py:7)

Older releases print the thread id in hex (`Thread 0x7F3C9FEAA740 (active+gil): "MainThread"`);
--native adds frames without a line (`pthread_cond_wait (libc.so.6)`, `0x7f63250a3f16 (libc.so.6)`).

hangdx's collector writes several dumps to one file, each after a marker line
`# hangdx stack-sample time=<unix> host=<h> rank=<r> pid=<p> role=<rank|worker>`.
"""

from __future__ import annotations

import json
import re

from hangdx.probes.model import Evidence, Frame, Quote, Source, StackDump, ThreadStack
from hangdx.probes.rx import lazy
from hangdx.probes.text import decode, lines

KIND = "pyspy"

_PROCESS = lazy(r"^Process (\d+): (.*)$")
_PYTHON = lazy(r"^Python v(\S+)")
# (A paste may lose the thread id: `Thread (idle): "MainThread"`.)
_THREAD = lazy(r"^Thread (?:(0x[0-9A-Fa-f]+|\d+) )?\(([a-z+]+)\)(?:: \"(.*)\")?\s*$")
# A paste that names the thread where py-spy prints its id: `Thread MainThread (idle):`, `Thread-3 (idle):`.
_NAMED_THREAD = lazy(
    r"^(?:Thread )?([A-Za-z_][\w.\-]{0,80}(?:\([\w.\-]{0,80}\))?) \((idle|active|gil|active\+gil|idle\+gil)\):\s*$"
)
_FRAME = lazy(r"^ {4}(\S.*?) \((.+?)(?::(\d+))?\)\s*$")
_LOCAL = lazy(r"^ {12}([^:]+): (.*)$")
# py-spy's Python frames pasted without their Process and Thread lines (`func (file.py:line)`, indented as py-spy
# prints them or flush left as a summary retypes them): a stack of a process the paste does not name, read when at
# least BARE_MIN of them follow each other.
_BARE_FRAME = lazy(r"^ {0,8}([A-Za-z_<][\w<>.\-]{0,200}) \(([^()\s]{1,300}?\.pyx?):(\d{1,7})\)\s*$")
BARE_MIN = 2
_MARKER = lazy(r"^# hangdx stack-sample (.*)$")
_KV = lazy(r"(?<!\w)(\w+)=(\S+)")
# --native frames with a source line are C/C++/CUDA code (`std::condition_variable::wait (condition_variable.cc:55)`).
_NATIVE_FILE = lazy(r"\.(?:c|cc|cpp|cxx|h|hh|hpp|cu|cuh|S)$")

_STATES = {"idle": "idle", "active": "active", "active+gil": "gil", "gil": "gil", "idle+gil": "gil"}


def sniff(head: bytes) -> int:
    text = head[:16384].decode("utf-8", errors="replace")
    if text.lstrip().startswith("[") and '"thread_name"' in text and '"frames"' in text:
        return 95
    score = 0
    if re.search(r"^Process \d+: ", text, re.M):
        score += 40
    if re.search(r"^Thread (0x[0-9A-Fa-f]+|\d+) \((idle|active|gil|active\+gil)\)", text, re.M):
        score += 50
    if re.search(r"^# hangdx stack-sample ", text, re.M):
        score += 40
    if not score and len(
        re.findall(r"^(?:Thread )?[A-Za-z_][\w.\-]{0,80} \((?:idle|active)\):\s*\n {4}\S", text, re.M)
    ):
        score += 45  # threads pasted by name, each followed by py-spy's indented frames
    return min(score, 95)


def parse(data: bytes, src: Source, ev: Evidence) -> None:
    text = decode(data)
    if text.lstrip().startswith("["):
        try:
            doc = json.loads(text)
        except (ValueError, RecursionError) as e:  # RecursionError: "[[[[..." deeper than Python's stack
            doc, why = None, f"{type(e).__name__}: {' '.join(str(e).split())[:200]}"
        if isinstance(doc, list):
            _parse_json(doc, src, ev)
            return
        if doc is None and '"frames"' in text[:16384]:
            ev.gap(src.name, f"py-spy --json output that is not valid JSON (cut short?): {why}")
            return
    _parse_text(list(enumerate(lines(data), 1)), src, ev)


def parse_lines(lines: list[tuple[int, str]], src: Source, ev: Evidence) -> None:
    """A region of clean lines (see probes/reader.py): py-spy's text form."""
    _parse_text(lines, src, ev)


# claims()'s needles (see probes/registry.py): every line it claims holds one of these words or patterns.
CLAIM_WORDS = (
    "Thread ",
    "Process ",
    "# hangdx stack-sample",
    "Python v",
    " (idle",
    " (active",
    " (gil",
    ".py:",
)
CLAIM_PATTERNS: tuple[str, ...] = ()


def claims(line: str) -> int:
    """How surely one line is py-spy's own (see probes/reader.py)."""
    if line.startswith("Thread ") and _THREAD.match(line):
        return 9
    if line.endswith(":") and _NAMED_THREAD.match(line):
        return 6
    if line.startswith("Process ") and _PROCESS.match(line) and (" " in line[8:] or "/" in line):
        return 7
    if line.startswith("# hangdx stack-sample"):
        return 10
    if line.startswith("Python v") and _PYTHON.match(line):
        return 6
    if line.endswith(")") and _BARE_FRAME.match(line):
        return 5  # a frame line: with its neighbours a stack even without the lines above it
    return 0


def _marker_fields(line: str) -> dict[str, str]:
    m = _MARKER.match(line)
    return dict(_KV.findall(m.group(1))) if m else {}


def _int(value: str | None) -> int | None:
    try:
        return int(value) if value not in (None, "", "None") else None
    except ValueError:  # not a number, or one of more than 4300 digits
        return None


def _float(value: str | None) -> float | None:
    try:
        return float(value) if value is not None else None
    except ValueError:
        return None


def _parse_text(numbered: list[tuple[int, str]], src: Source, ev: Evidence) -> None:
    dump: StackDump | None = None
    thread: ThreadStack | None = None
    meta: dict[str, str] = {}
    errors: list[str] = []

    def start_dump(pid: int | None, command: str | None) -> StackDump:
        d = StackDump(
            pid=pid if pid is not None else _int(meta.get("pid")) or src.pid,
            rank=_int(meta.get("rank")) if "rank" in meta else src.rank,
            host=meta.get("host") or src.host,
            threads=[],
            source=src.name,
            taken_at=_float(meta.get("time")),
            command=command,
            role=meta.get("role", "rank"),
        )
        ev.stacks.append(d)
        return d

    bare: list[Frame] = []  # frames met with no thread above them

    def end_bare() -> None:
        if len(bare) >= BARE_MIN:
            d = start_dump(None, None)
            d.threads.append(
                ThreadStack(tid=None, name="", state="unknown", frames=list(bare), quote=bare[0].quote)
            )
        bare.clear()

    for no, line in numbered:
        if thread is None and line.endswith(")"):
            b = _BARE_FRAME.match(line)
            if b:
                bare.append(
                    Frame(function=b.group(1), file=b.group(2), line=_int(b.group(3)), native=False,
                          quote=Quote(src.name, no, line.strip()))
                )  # fmt: skip
                continue
        if bare and line.strip():
            end_bare()
        if line.startswith("# hangdx stack-sample"):
            meta = _marker_fields(line)
            dump, thread = None, None
            continue
        m = _PROCESS.match(line)
        if m:
            dump, thread = start_dump(_int(m.group(1)), m.group(2).strip()), None
            continue
        m = _PYTHON.match(line)
        if m and dump is not None:
            dump.python = m.group(1)
            continue
        m = _THREAD.match(line)
        named = None if m else _NAMED_THREAD.match(line.rstrip())
        if named:
            if dump is None:
                dump = start_dump(None, None)
            thread = ThreadStack(
                tid=None,
                name=named.group(1),
                state=_STATES.get(named.group(2), "unknown"),
                frames=[],
                quote=Quote(src.name, no, line.rstrip()),
            )
            dump.threads.append(thread)
            continue
        if m:
            if dump is None:
                dump = start_dump(None, None)
            raw_id = m.group(1) or ""
            tid = int(raw_id, 16) if raw_id.startswith("0x") else _int(raw_id or None)
            thread = ThreadStack(
                tid=tid,
                name=m.group(3) or "",
                state=_STATES.get(m.group(2), "unknown"),
                frames=[],
                quote=Quote(src.name, no, line.rstrip()),
            )
            dump.threads.append(thread)
            continue
        # A frame line ends with ")": checked first, since _FRAME is quadratic on a long line that does not.
        m = _FRAME.match(line) if thread is not None and line.rstrip().endswith(")") else None
        if m:
            func, where, lineno = m.group(1), m.group(2), m.group(3)
            thread.frames.append(
                Frame(
                    function=func,
                    file=where,
                    line=_int(lineno),
                    native=lineno is None or bool(_NATIVE_FILE.search(where)),
                    quote=Quote(src.name, no, line.strip()),
                )
            )
            continue
        m = _LOCAL.match(line)
        if m and thread is not None and thread.frames:
            thread.frames[-1].locals[m.group(1).strip()] = m.group(2)
            continue
        if line.startswith("Error:") or line.startswith("Permission Denied"):
            errors.append(line.strip())
    end_bare()
    for err in errors:
        ev.gap(src.name, f"py-spy: {err}")


def _parse_json(doc: list, src: Source, ev: Evidence) -> None:
    by_pid: dict[int | None, StackDump] = {}
    for i, t in enumerate(doc, 1):
        if not isinstance(t, dict):
            continue
        pid = t.get("pid") if isinstance(t.get("pid"), int) else src.pid
        dump = by_pid.get(pid)
        if dump is None:
            dump = StackDump(pid=pid, rank=src.rank, host=src.host, threads=[], source=src.name)
            by_pid[pid] = dump
            ev.stacks.append(dump)
        frames = []
        raw_frames = t.get("frames")
        for f in raw_frames if isinstance(raw_frames, list) else []:
            if not isinstance(f, dict):
                continue
            line = f.get("line")
            frames.append(
                Frame(
                    function=str(f.get("name", "?")),
                    file=str(f.get("short_filename") or f.get("filename") or "?"),
                    line=line if isinstance(line, int) and line > 0 else None,
                    native=not isinstance(line, int) or line <= 0,
                    locals={
                        str(v.get("name")): str(v.get("repr"))
                        for v in (f.get("locals") if isinstance(f.get("locals"), list) else [])
                        if isinstance(v, dict)
                    },
                    quote=Quote(
                        src.name,
                        i,
                        f"{f.get('name')} ({f.get('short_filename') or f.get('filename')}:{line})",
                    ),
                )
            )
        state = "gil" if t.get("owns_gil") else ("active" if t.get("active") else "idle")
        tid = t.get("os_thread_id") or t.get("thread_id")
        name = str(t.get("thread_name") or "")
        dump.threads.append(
            ThreadStack(
                tid=tid if isinstance(tid, int) else None,
                name=name,
                state=state,
                frames=frames,
                quote=Quote(src.name, i, f'Thread {tid} ({state}): "{name}"'),
            )
        )
