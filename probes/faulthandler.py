"""Python's faulthandler output: a crash report (`Fatal Python error: Segmentation fault`) or a dump of every
thread (`faulthandler.dump_traceback_later`, `faulthandler.register(SIGUSR1)`), as CPython prints it:

    Fatal Python error: Segmentation fault

    Thread 0x000014844b65d740 (most recent call first):
      File "/x/torch/distributed/distributed_c10d.py", line 3938 in barrier
      File "/x/test.py", line 18 in <module>

    Extension modules: numpy._core._multiarray_umath, torch._C (total: 2)

    Timeout (0:30:00)!
    Current thread 0x00007f1c4e7fc740 (most recent call first):
      File "/x/threading.py", line 320 in wait

A `Fatal Python error:` header makes the dump a crash report: the process died there (a `segfault` event that
names the signal and the frame it died in), not a process that waits. Any other dump is where each thread of a
live process was: a stack like py-spy's (the thread whose outermost frame is `<module>` is the main thread).
"""

from __future__ import annotations

import re

from hangdx.probes.model import Evidence, Frame, LogEvent, Quote, Source, StackDump, ThreadStack
from hangdx.probes.rx import lazy
from hangdx.probes.text import lines

KIND = "faulthandler"

_FATAL = lazy(r"^Fatal Python error: (?:(\w{1,64}): )?(.{1,300}?)\s*$")
_THREAD = lazy(r"^(Current thread|Thread) (0x[0-9a-fA-F]{1,16}) \(most recent call first\):\s*$")
_STACK = lazy(r"^Stack \(most recent call first\):\s*$")
_TIMEOUT = lazy(r"^Timeout \((\d{1,6}:\d\d:\d\d(?:\.\d{1,9})?)\)!\s*$")
_FRAME = lazy(r'^\s{1,8}File "([^"]{1,1000})", line (\d{1,9}) in (\S.{0,200}?)\s*$')
# Stacks a program dumps itself (the widely copied signal-handler recipe over sys._current_frames() and
# traceback.extract_stack: a `# Thread: NAME(ID)` or `# ProcessID=P, ThreadID=T` line, then `File: "x.py", line 3,
# in f` per frame; or traceback.format_stack's `  File "x.py", line 3, in f`), outermost call first, as a traceback.
_DUMP_HEAD = lazy(
    r"^#{1,20} ?(?:ProcessID=(\d{1,10}), ThreadID=(\d{1,24})|Thread: ?(.{0,80}?)\((\d{1,24})\))\s*#*\s*$"
)
_DUMP_FRAME = lazy(r'^\s{0,8}File:? "([^"]{1,1000})", line (\d{1,9}), in (\S.{0,200}?)\s*$')
_TB_FRAMES = lazy(r'^ {1,8}File "[^"\n]{1,1000}", line \d{1,9}, in \S', re.M)  # format_stack's, for sniff
# Signals faulthandler reports as fatal (its own list: SIGSEGV, SIGFPE, SIGABRT, SIGBUS, SIGILL).
_SIGNALS = {
    "Segmentation fault": "SIGSEGV",
    "Aborted": "SIGABRT",
    "Bus error": "SIGBUS",
    "Floating point exception": "SIGFPE",
    "Floating-point exception": "SIGFPE",
    "Illegal instruction": "SIGILL",
}


def sniff(head: bytes) -> int:
    text = head[:16384].decode("utf-8", errors="replace")
    if re.search(r"^(?:Current thread|Thread) 0x[0-9a-fA-F]+ \(most recent call first\):", text, re.M):
        return 60
    if re.search(r"^Fatal Python error: ", text, re.M):
        return 40
    # traceback.format_stack's frames with no `Traceback (most recent call last):` above them (nor an exception
    # below): a stack a program printed of itself, not an exception's traceback.
    if "Traceback (most recent call last)" not in text and len(_TB_FRAMES.findall(text)) >= 2:
        return 30
    return 0


# claims()'s needles (see probes/registry.py): every line it claims holds one of these words or patterns.
CLAIM_WORDS = (
    "Fatal Python error: ",
    "Current thread 0x",
    "Thread 0x",
    "Stack (most recent",
    "Timeout (",
    '", line ',
    "ProcessID=",
    "# Thread: ",
    "#Thread: ",
)
CLAIM_PATTERNS: tuple[str, ...] = ()


def claims(line: str) -> int:
    """How surely one line is faulthandler's (see probes/reader.py)."""
    if line.startswith("Fatal Python error: "):
        return 9
    if line.startswith(("Current thread 0x", "Thread 0x")) and _THREAD.match(line):
        return 9
    if line.startswith("Stack (most recent") and _STACK.match(line):
        return 8
    if line.startswith("Timeout (") and _TIMEOUT.match(line):
        return 7
    # A frame in faulthandler's own form (`File "x.py", line 3 in f`: no comma before "in", which a traceback's
    # `File "x.py", line 3, in f` has), as pasted without the thread's header line.
    if "File" in line and '", line ' in line and _FRAME.match(line):
        return 6
    if line.startswith("#") and _DUMP_HEAD.match(line):
        return 8  # a thread of a stack dump the program printed of itself
    if "File: " in line and _DUMP_FRAME.match(line):
        return 6  # that recipe's own frame form (`File: "x.py", line 3, in f`)
    return 0


def parse(data: bytes, src: Source, ev: Evidence) -> None:
    parse_lines(list(enumerate(lines(data), 1)), src, ev)


def parse_lines(numbered: list[tuple[int, str]], src: Source, ev: Evidence) -> None:
    """A region of clean lines (see probes/reader.py)."""
    fatal: tuple[int, str, str] | None = None  # line, text, what
    dump: StackDump | None = None
    thread: ThreadStack | None = None
    crash_frames: list[Frame] = []
    crash_thread: str | None = None
    outermost_first: set[int] = set()  # threads whose frames came outermost first (a program's own dump)

    def close() -> None:
        nonlocal fatal, dump, thread, crash_frames, crash_thread
        if fatal is not None:
            no, text, what = fatal
            ev.events.append(
                LogEvent(
                    "segfault",
                    Quote(src.name, no, text),
                    host=src.host,
                    rank=src.rank,
                    pid=src.pid,
                    fields={
                        "signal": _SIGNALS.get(what, what),
                        "what": what,
                        "origin": "faulthandler",
                        "function": crash_frames[0].function if crash_frames else None,
                        "frames": [f.where() for f in crash_frames],
                        "thread": crash_thread,
                    },
                )
            )
        elif dump is not None:
            for t in dump.threads:
                if id(t) in outermost_first:
                    t.frames.reverse()  # innermost first, as every stack here
            outermost_first.clear()
            dump.threads = [t for t in dump.threads if t.frames]
            if dump.threads and not any(t.name == "MainThread" for t in dump.threads):
                for t in dump.threads:
                    if t.frames[-1].function == "<module>":
                        t.name = "MainThread"
                        break
            if not dump.threads:
                ev.stacks.remove(dump)
        fatal, dump, thread, crash_frames, crash_thread = None, None, None, [], None

    for no, raw in numbered:
        text = raw.rstrip()
        m = _FATAL.match(text)
        if m:
            close()
            fatal = (no, text, m.group(2).strip())
            continue
        m = _THREAD.match(text) or _STACK.match(text)
        if m:
            if fatal is not None:
                if crash_thread is None or not crash_frames:
                    crash_thread = text
                    crash_frames = []
                    thread = ThreadStack(None, "", "unknown", crash_frames, Quote(src.name, no, text))
                elif text.startswith("Current thread"):
                    # The thread that crashed is the current one: its frames are the crash's.
                    crash_thread, crash_frames = text, []
                    thread = ThreadStack(None, "", "unknown", crash_frames, Quote(src.name, no, text))
                else:
                    thread = None  # another thread of the dying process
                continue
            if dump is None:
                dump = StackDump(pid=src.pid, rank=src.rank, host=src.host, threads=[], source=src.name)
                ev.stacks.append(dump)
            tid = int(m.group(2), 16) if m.re is _THREAD.compiled() else None
            thread = ThreadStack(tid, "", "unknown", [], Quote(src.name, no, text))
            dump.threads.append(thread)
            continue
        if _TIMEOUT.match(text):
            close()
            continue
        h = _DUMP_HEAD.match(text)
        if h and fatal is None:
            if dump is None or (h.group(1) and dump.pid not in (None, int(h.group(1)))):
                close()
                pid = int(h.group(1)) if h.group(1) else src.pid
                dump = StackDump(pid=pid, rank=src.rank, host=src.host, threads=[], source=src.name)
                ev.stacks.append(dump)
            tid = int(h.group(2) or h.group(4))
            thread = ThreadStack(tid, (h.group(3) or "").strip(), "unknown", [], Quote(src.name, no, text))
            outermost_first.add(id(thread))
            dump.threads.append(thread)
            continue
        d = _DUMP_FRAME.match(text) if fatal is None and '", line ' in text else None
        if d:
            if thread is None or id(thread) not in outermost_first:
                if dump is None:
                    dump = StackDump(pid=src.pid, rank=src.rank, host=src.host, threads=[], source=src.name)
                    ev.stacks.append(dump)
                thread = ThreadStack(None, "", "unknown", [], Quote(src.name, no, text.strip()))
                outermost_first.add(id(thread))
                dump.threads.append(thread)
            thread.frames.append(
                Frame(d.group(3), d.group(1), int(d.group(2)), False, quote=Quote(src.name, no, text.strip()))
            )
            continue
        f = _FRAME.match(text)
        if f and thread is None and fatal is None and dump is None:
            # Frames pasted without their `Thread 0x... (most recent call first):` line: one thread, unnamed.
            dump = StackDump(pid=src.pid, rank=src.rank, host=src.host, threads=[], source=src.name)
            ev.stacks.append(dump)
            thread = ThreadStack(None, "", "unknown", [], Quote(src.name, no, text.strip()))
            dump.threads.append(thread)
        if f and thread is not None:
            thread.frames.append(
                Frame(f.group(3), f.group(1), int(f.group(2)), False, quote=Quote(src.name, no, text.strip()))
            )
    close()
