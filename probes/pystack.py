"""pystack output: `pystack remote PID` and `pystack core CORE`, with or without --native, --locals.

As pystack 1.x prints it (one block per Python thread, the newest thread first, the main thread last):

    Traceback for thread 20186 (python) [] (most recent call last):
        (Python) File "/work/train.py", line 173, in should_stop
            dist.broadcast(flag, src=0)
        (Python) File ".../torch/distributed/distributed_c10d.py", line 3151, in broadcast
            work.wait()
        (C) File "???", line 0, in c10d::Work::wait(...) (/.../torch/lib/libtorch_cpu.so)
        (C) File "./nptl/pthread_cond_wait.c", line 618, in pthread_cond_wait@@GLIBC_2.3.2 (/usr/lib/.../libc.so.6)

The header names the thread's OS id, its OS name and its status (`[Has the GIL]`, `[Waiting for the GIL]`,
`[Dropping the GIL]`, `[Garbage collecting]`, `[Thread terminated]`, or `[]`). Frames are printed outermost
first (`most recent call last`); under each Python frame its source line, and with --locals its `Arguments:` and
`Locals:`. `--native` adds `(C)` frames, which become native `Frame`s. `pystack core` first prints what the core
says of its process (`pid: 19132 ppid: 1 ...`, `executable: ... arguments: ...`, how it died).

One process per `pystack` run: a new `StackDump` starts at an echoed `pystack remote|core ...` command, at the
core's `Core file information:`, or when a thread follows the previous process's main thread (pystack prints
the main thread last). The main thread (its outermost frame a module's, or its tid the pid) is named
`MainThread` and put first, as py-spy and gdb dumps have it, so the stack classification (playbooks/facts.py)
reads it as theirs.
"""

from __future__ import annotations

import re

from hangdx.probes.model import Evidence, Frame, Quote, Source, StackDump, ThreadStack
from hangdx.probes.rx import lazy
from hangdx.probes.text import lines

KIND = "pystack"

_THREAD = lazy(
    r"^\s{0,4}Traceback for thread (\d{1,10})(?: \((.{0,200}?)\))? (?:\[([^\[\]]{0,200})\] )?"
    r"\(most recent call last\):\s*$"
)
_FRAME_HEAD = lazy(r'^\s{1,12}\((Python|C)\) File "')
_FRAME_TAIL = lazy(r'", line (-?\d{1,9}), in ')
_INTERP = lazy(
    r"^\s{1,8}(?:In the main interpreter|In interpreter \d{1,6}|Not currently attached to any interpreter)"
    r" \[([^\[\]]{0,200})\]\s*$"
)
_EMPTY = lazy(r"^The frame stack for thread (\d{1,10}) is empty")
_SECTION = lazy(r"^\s{4,8}(Arguments|Locals):\s*$")
_LOCAL = lazy(r"^\s{6,12}([A-Za-z_][\w.]{0,200}): (.*)$")
_COMMAND = lazy(r"(?:^|[\s$#>])pystack\s+(remote|core)\b(.{0,2000})$")
_CORE_INFO = "Core file information:"
_CORE_PID = lazy(r"^pid: (\d{1,10}) ppid: \d{1,10}")
_CORE_EXE = lazy(r"^executable: (\S{1,1000}) arguments: (.{0,4000})$")
_DIED = lazy(r"^The process died due (?:to )?(.{1,500})$")
_ERROR = lazy(r"^(?:\U0001f480 )?((?:Engine error|Invalid|Could not|No Python|Failed)[^\U0001f480]{0,500})")
# What a main thread's outermost frames are: a module run as a script or with -m, or the C start-up code.
_MAIN_PY = ("<module>", "_run_module_as_main")
_MAIN_C = ("Py_BytesMain", "Py_RunMain", "__libc_start_main", "pymain_main")

# The source line of the innermost Python frame takes a lock (`with self._lock:`, `lock.acquire()`): the thread
# is in the lock's C acquire (CPython's PyThread_acquire_lock), which pystack shows only with --native.
_TAKES_LOCK = lazy(
    r"^\s{0,12}(?:with\s+[\w.]{0,200}(?:lock|mutex|cond|condition|sem|semaphore)\w{0,40}(?:\(\))?\s*(?:as\s+\w+\s*)?:"
    r"|[\w.]{0,200}\.acquire\((?:\s*\)|\s*(?:True|block|blocking)))",
    re.I,
)
_SOURCE = lazy(r"^\s{6,12}\S")

_STATES = {
    "Has the GIL": "gil",
    "Garbage collecting": "gil",
    "Dropping the GIL": "active",
    "Waiting for the GIL": "idle",
    "Thread terminated": "unknown",
}


def sniff(head: bytes) -> int:
    text = head[:16384].decode("utf-8", errors="replace")
    n = sum(1 for ln in text.splitlines()[:400] if claims(ln) >= 7)
    return min(40 + 10 * n, 95) if n >= 1 else 0


# claims()'s needles (see probes/registry.py): every line it claims holds one of these words or patterns.
CLAIM_WORDS = (
    "Traceback for thread ",
    '(Python) File "',
    '(C) File "',
    "The frame stack for thread ",
    "* - Unable to merge native stack",
    "Using executable found in the core file:",
    _CORE_INFO,
    "In the main interpreter",
    "In interpreter ",
    "Not currently attached to any interpreter",
    "\U0001f480",
    "pystack",
)
CLAIM_PATTERNS: tuple[str, ...] = ()


def claims(line: str) -> int:
    """How surely one line is pystack's own (see probes/reader.py)."""
    s = line.lstrip()
    if s.startswith("Traceback for thread ") and _THREAD.match(line):
        return 9
    if (
        s.startswith(('(Python) File "', '(C) File "'))
        and _FRAME_HEAD.match(line)
        and _FRAME_TAIL.search(line)
    ):
        return 9
    if line.startswith("The frame stack for thread ") and _EMPTY.match(line):
        return 8
    if line.startswith("* - Unable to merge native stack"):
        return 8
    if line.startswith(("Using executable found in the core file:", _CORE_INFO)):
        return 8
    if _INTERP.match(line):
        return 7
    if "\U0001f480" in line and len(line) < 2000 and _ERROR.match(line.strip()):
        return 7
    if "pystack" in line and _COMMAND.search(line) and len(line) < 2000:
        return 6
    return 0


def parse(data: bytes, src: Source, ev: Evidence) -> None:
    parse_lines(list(enumerate(lines(data), 1)), src, ev)


def _int(value: str | None) -> int | None:
    try:
        return int(value) if value else None
    except ValueError:  # a number of more than 4300 digits
        return None


def _c_frame(rest: str) -> tuple[str, str]:
    """`SYMBOL (inlined) (LIBRARY)` -> (SYMBOL, LIBRARY); a C++ symbol keeps its own parentheses."""
    s = rest.rstrip()
    lib = ""
    if s.endswith(")"):
        i = s.rfind(" (")
        if i > 0 and "(" not in s[i + 2 : -1]:
            s, lib = s[:i], s[i + 2 : -1]
    if s.endswith(" (inlined)"):
        s = s[: -len(" (inlined)")]
    return s.strip() or "??", lib


def _is_main(t: ThreadStack, pid: int | None) -> bool:
    if pid is not None and t.tid == pid:
        return True
    for f in t.frames:
        if (not f.native and f.function in _MAIN_PY) or (f.native and any(w in f.function for w in _MAIN_C)):
            return True
    return False


def parse_lines(numbered: list[tuple[int, str]], src: Source, ev: Evidence) -> None:
    """A region of clean lines (see probes/reader.py)."""
    dumps: list[StackDump] = []
    dump: StackDump | None = None
    thread: ThreadStack | None = None
    outer_first: list[Frame] = []  # the current thread's frames as printed: outermost first
    section = False  # inside a frame's `Arguments:` / `Locals:`
    known_pid: int | None = None  # from an echoed command or a core's header
    command: str | None = None
    errors: list[str] = []
    source: tuple[int, str] | None = None  # the source line under the last Python frame read

    def new_dump() -> StackDump:
        nonlocal dump
        d = StackDump(pid=known_pid if known_pid is not None else src.pid, rank=src.rank, host=src.host,
                      threads=[], source=src.name, command=command)  # fmt: skip
        dumps.append(d)
        ev.stacks.append(d)
        dump = d
        return d

    def close_thread() -> None:
        nonlocal thread, outer_first, source
        if thread is not None:
            last = outer_first[-1] if outer_first else None
            if last is not None and not last.native and source is not None and _TAKES_LOCK.match(source[1]):
                # No --native: the innermost Python line takes a lock, so the thread waits in the lock's acquire.
                q = Quote(src.name, source[0], source[1].strip())
                outer_first.append(Frame("PyThread_acquire_lock", "(the lock taken on this source line)", None,
                                         True, quote=q))  # fmt: skip
            thread.frames = list(reversed(outer_first))  # innermost first, as py-spy prints them
        thread, outer_first, source = None, [], None

    def has_main(d: StackDump) -> bool:
        return any(t.name == "MainThread" for t in d.threads)

    def finish_thread() -> None:
        """Close the thread; a thread that is the process's main one is named so."""
        t = thread
        close_thread()
        if t is not None and dump is not None and not has_main(dump) and _is_main(t, dump.pid):
            t.name = "MainThread"

    for no, raw in numbered:
        line = raw.rstrip()
        m = _THREAD.match(line) if "Traceback for thread " in line else None
        if m:
            finish_thread()
            tid = _int(m.group(1))
            if dump is None or has_main(dump) or any(t.tid == tid for t in dump.threads):
                new_dump()
                known_pid = None
            status = (m.group(3) or "").split(",")[0].strip()
            thread = ThreadStack(
                tid, m.group(2) or "", _STATES.get(status, "idle"), [], Quote(src.name, no, line.strip())
            )
            dump.threads.append(thread)
            section = False
            continue
        if thread is not None and 'File "' in line and _FRAME_HEAD.match(line):
            head = _FRAME_HEAD.match(line)
            tail = _FRAME_TAIL.search(line, head.end())
            if tail:
                file = line[head.end() : tail.start()]
                lineno = _int(tail.group(1))
                rest = line[tail.end() :]
                q = Quote(src.name, no, line.strip())
                if head.group(1) == "C":
                    func, lib = _c_frame(rest)
                    where = file if file and file != "???" else lib
                    f = Frame(func, where or "?", lineno if lineno and file != "???" else None, True, quote=q)
                else:
                    f = Frame(rest.strip() or "?", file, lineno, False, quote=q)
                outer_first.append(f)
                section, source = False, None
                continue
        if thread is not None:
            s = _SECTION.match(line)
            if s:
                section = True
                continue
            if section:
                lm = _LOCAL.match(line)
                if lm and outer_first:
                    outer_first[-1].locals[lm.group(1)] = lm.group(2)
                    continue
                section = False
            if outer_first and not outer_first[-1].native and source is None and _SOURCE.match(line):
                source = (no, line)
                continue
            im = _INTERP.match(line)
            if im:
                status = im.group(1).split(",")[0].strip()
                thread.state = _STATES.get(status, thread.state)
                continue
        if line.startswith(_CORE_INFO):
            finish_thread()
            dump = None
            known_pid = None
            continue
        cm = _CORE_PID.match(line)
        if cm:
            known_pid = _int(cm.group(1))
            if dump is not None and not dump.threads:
                dump.pid = known_pid
            continue
        em = _CORE_EXE.match(line)
        if em:
            command = em.group(2).strip() or em.group(1)
            continue
        dm = _DIED.match(line)
        if dm and thread is None:
            continue  # how the core's process died: a crash shows in the stacks themselves
        if "pystack" in line and len(line) < 2000:
            pm = _COMMAND.search(line)
            if pm:
                finish_thread()
                dump = None
                args = pm.group(2).split()
                numbers = [a for a in args if a.isdigit()]
                known_pid = _int(numbers[-1]) if pm.group(1) == "remote" and numbers else None
                command = None
                continue
        if ("\U0001f480" in line or line.startswith(("Engine error", "Could not"))) and len(line) < 2000:
            er = _ERROR.match(line.strip())
            if er:
                errors.append(er.group(1).strip())
    finish_thread()
    for d in dumps:
        d.threads = [t for t in d.threads if t.frames] or d.threads
        main = next((t for t in d.threads if t.name == "MainThread"), None)
        if main is not None:
            d.threads.remove(main)
            d.threads.insert(0, main)
            if d.pid is None and main.tid:
                d.pid = main.tid  # a process's main thread has the process's id
    for err in errors:
        ev.gap(src.name, f"pystack: {err}")
