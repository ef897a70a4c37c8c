"""gdb backtraces: `bt`, `thread apply all bt` and libpython's `py-bt`, as gdb prints them.

    Thread 2 (Thread 0x7f4d8bfff640 (LWP 30391) "python"):
    #0  __lll_lock_wait (futex=futex@entry=0x7f76f1ed2598, private=0x0) at lowlevellock.c:52
    #1  0x00007f799c183c42 in __GI___pthread_mutex_lock (mutex=0x7f76f1ed2598) at ../nptl/pthread_mutex_lock.c:80
    #3  0x00007f4d91788155 in groupLaunch(ncclAsyncJob*) () from /usr/lib/libtorch_cuda.so
    #7  0x00007f4d8f6572be in c10d::ProcessGroupNCCL::endCoalescing(c10d::OpType) ()
       from /usr/lib/libtorch_cuda.so
    #9  Frame 0x7f..., for file /x/train.py, line 12, in step (...)

    Traceback (most recent call first):
      Waiting for the GIL
      <built-in method _invoke_rpc_python_udf of PyCapsule object at remote 0x7f910957bea0>
      File "/opt/lib/python3.9/site-packages/torch/distributed/rpc/api.py", line 719, in _invoke_rpc
        fut = _invoke_rpc_python_udf(

A bare `bt` has no thread header: its frames are one thread's. gdb numbers the threads of a process it attaches
to from the initial one, so `Thread 1` is the main thread. Frames become native `Frame`s (innermost first), the
Python frames of `py-bt` Python ones, so that the stack classification (playbooks/facts.py) reads them as it
reads py-spy's.
"""

from __future__ import annotations

import re

from hangdx.probes.model import Evidence, Frame, Quote, Source, StackDump, ThreadStack
from hangdx.probes.rx import lazy
from hangdx.probes.text import lines

KIND = "gdb"

_THREAD = lazy(
    r"^\*?\s?Thread (\d{1,7}) \((?:Thread (0x[0-9a-fA-F]{1,16}) )?\(?LWP (\d{1,10})\)?\)?(?: \"([^\"]{0,64})\")?\)?:?\s*$"
)
_SWITCH = lazy(
    r"^\[(?:Switching to|Current) thread (?:is )?(\d{1,7}) \((?:Thread (0x[0-9a-fA-F]{1,16}) )?\(?LWP (\d{1,10})\)"
)
_FRAME_NO = lazy(r"^#(\d{1,5})\s+")
_ADDR_IN = lazy(r"^(0x[0-9a-fA-F]{1,16}) in ")
_WHERE_TAIL = lazy(r"(at|from) (\S{1,1000}?)(?::(\d{1,9}))?")
_PY_FRAME_GDB = lazy(r"^Frame 0x[0-9a-fA-F]{1,16}, for file (.{1,1000}?), line (\d{1,9}), in (\S{1,200})")
_PY_HEAD = "Traceback (most recent call first):"
_PY_FILE = lazy(r'^\s{1,8}File "([^"]{1,1000})", line (\d{1,9}), in (\S.{0,200}?)\s*$')
_PY_SPECIAL = lazy(
    r"^\s{1,8}(Waiting for the GIL|Garbage-collecting|<built-in (?:method|function) .{1,300}>)\s*$"
)
_CONT = lazy(r"^\s{2,}(?:at|from) \S")
_FRAME_SHAPE = lazy(
    r"^#\d{1,5}\s+(?:0x[0-9a-fA-F]{1,16} in \S|[\w:~<>.@$]{1,300}.{0,2000} \(.{0,2000}\)(?: (?:at|from) \S+)?\s*$|Frame 0x)"
)


def sniff(head: bytes) -> int:
    text = head[:16384].decode("utf-8", errors="replace")
    n = sum(1 for ln in text.splitlines()[:400] if claims(ln) >= 7)
    return min(30 + 10 * n, 90) if n >= 2 else 0


# claims()'s needles (see probes/registry.py): every line it claims holds one of these words or patterns.
CLAIM_WORDS = ("LWP", _PY_HEAD, "Waiting for the GIL", " at remote 0x")
CLAIM_PATTERNS: tuple[str, ...] = (r"^#",)


def claims(line: str) -> int:
    """How surely one line is gdb's own (see probes/reader.py)."""
    if line.startswith("#"):
        # A frame with an address, a source line or a library: a markdown `#1 Fix (see below)` has none of them.
        if (
            len(line) < 4000
            and _FRAME_SHAPE.match(line)
            and (_ADDR_IN.match(line[_FRAME_NO.match(line).end() :]) or _where(line) or "Frame 0x" in line)
        ):
            return 8
        return 0
    if line.startswith(("Thread ", "* Thread ")) and "LWP" in line and _THREAD.match(line):
        return 9
    if line.startswith(_PY_HEAD):
        return 8
    s = line.strip()
    if s == "Waiting for the GIL" or (s.startswith("<built-in ") and " at remote 0x" in s):
        return 8
    return 0


def parse(data: bytes, src: Source, ev: Evidence) -> None:
    parse_lines(list(enumerate(lines(data), 1)), src, ev)


class _Where:
    """` at file.c:52` or ` from /lib/libc.so.6` at the end of a frame: found from the end, in linear time."""

    def __init__(self, start: int, m: re.Match) -> None:
        self.start_at, self.m = start, m

    def start(self) -> int:
        return self.start_at

    def group(self, i: int) -> str | None:
        return self.m.group(i)


def _where(text: str) -> _Where | None:
    s = text.rstrip()
    i = max(s.rfind(" at "), s.rfind(" from "))
    if i < 0 and s.startswith(("at ", "from ")):
        i = -1
    elif i < 0:
        return None
    m = _WHERE_TAIL.fullmatch(s[i + 1 :])
    return _Where(max(i, 0), m) if m else None


def _function(rest: str) -> tuple[str, str]:
    """`std::mutex::lock (this=0x1) at f.h:100` -> (`std::mutex::lock`, `(this=0x1) at f.h:100`).

    The name ends at the first ` (` outside template brackets; a C++ signature (`groupLaunch(ncclAsyncJob*)`)
    stays part of the name.
    """
    depth = 0
    for i, c in enumerate(rest[:2000]):
        if c == "<":
            depth += 1
        elif c == ">" and depth:
            depth -= 1
        elif c == " " and depth == 0 and rest[i + 1 : i + 2] == "(":
            return rest[:i], rest[i + 1 :]
    m = _where(rest)
    return (rest[: m.start()], rest[m.start() :]) if m else (rest, "")


def _native(body: str) -> tuple[str, str, int | None]:
    """A frame's text after `#N  `: (function, file or library, line)."""
    m = _ADDR_IN.match(body)
    rest = body[m.end() :] if m else body
    func, tail = _function(rest.strip())
    w = _where(tail)
    where = w.group(2) if w else ""
    line = int(w.group(3)) if w and w.group(3) else None
    return func.strip() or "??", where, line


def parse_lines(numbered: list[tuple[int, str]], src: Source, ev: Evidence) -> None:
    """A region of clean lines (see probes/reader.py)."""
    dump: StackDump | None = None
    thread: ThreadStack | None = None
    py_pending = False  # a `Traceback (most recent call first):` opened Python frames for the thread

    def new_dump() -> StackDump:
        d = StackDump(pid=src.pid, rank=src.rank, host=src.host, threads=[], source=src.name)
        ev.stacks.append(d)
        return d

    def new_thread(no: int, text: str, number: int | None = None, lwp: int | None = None,
                   name: str | None = None) -> ThreadStack:  # fmt: skip
        nonlocal dump
        if dump is None:
            dump = new_dump()
        main = number == 1 or (lwp is not None and lwp == dump.pid)
        t = ThreadStack(lwp, "MainThread" if main else (name or ""), "unknown", [], Quote(src.name, no, text))
        dump.threads.append(t)
        return t

    for no, raw in numbered:
        text = raw.rstrip()
        m = (_THREAD.match(text.lstrip("* ")) or _SWITCH.match(text)) if "LWP" in text else None
        if m:
            thread = new_thread(
                no, text, int(m.group(1)), int(m.group(3)), m.group(4) if m.re is _THREAD.compiled() else None
            )
            py_pending = False
            continue
        if text.startswith(_PY_HEAD):
            if thread is None or (
                thread.frames and not py_pending and any(not f.native for f in thread.frames)
            ):
                thread = new_thread(no, text)
            py_pending = True
            continue
        f = _FRAME_NO.match(text)
        if f:
            body = text[f.end() :]
            if thread is None:
                thread = new_thread(no, text)
            elif f.group(1) == "0" and thread.frames and not py_pending:
                if (
                    len(thread.frames) == 1
                    and thread.frames[0].quote
                    and thread.frames[0].quote.text == text.strip()
                ):
                    thread.frames.clear()  # gdb showed the current frame, then `bt` began with it again
                else:
                    thread = new_thread(no, text)  # a second `bt` with no header: another thread
            q = Quote(src.name, no, text.strip())
            p = _PY_FRAME_GDB.match(body)
            if p:
                thread.frames.append(Frame(p.group(3), p.group(1), int(p.group(2)), False, quote=q))
                continue
            func, where, line = _native(body)
            thread.frames.append(Frame(func, where, line, True, quote=q))
            continue
        if _CONT.match(text) and thread is not None and thread.frames and thread.frames[-1].native:
            last = thread.frames[-1]
            w = _where(text.strip())
            if w and not last.file:
                last.file, last.line = w.group(2), int(w.group(3)) if w.group(3) else last.line
            continue
        if thread is not None and py_pending:
            p = _PY_FILE.match(text)
            if p:
                q = Quote(src.name, no, text.strip())
                thread.frames.append(Frame(p.group(3), p.group(1), int(p.group(2)), False, quote=q))
                continue
            s = _PY_SPECIAL.match(text)
            if s:
                q = Quote(src.name, no, text.strip())
                thread.frames.append(Frame(s.group(1), "python", None, True, quote=q))
                continue
        elif thread is None:
            s = _PY_SPECIAL.match(text)
            if s and s.group(1) == "Waiting for the GIL":
                # py-bt pasted without its `Traceback (most recent call first):` line
                thread = new_thread(no, text)
                py_pending = True
                thread.frames.append(
                    Frame(s.group(1), "python", None, True, quote=Quote(src.name, no, text.strip()))
                )
    if dump is not None:
        dump.threads = [t for t in dump.threads if t.frames] or dump.threads
        if not any(t.name == "MainThread" for t in dump.threads):
            _name_main(dump)


def _name_main(dump: StackDump) -> None:
    """No thread named the main one: the thread whose outermost Python frame is a module's is."""
    for t in dump.threads:
        py = [f for f in t.frames if not f.native]
        if py and py[-1].function == "<module>":
            t.name = "MainThread"
            return
