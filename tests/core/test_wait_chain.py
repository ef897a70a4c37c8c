"""A rank waiting on a thread of its own is where that thread is: an engineer follows the wait chain."""

from __future__ import annotations

import json

from hangdx.playbooks.facts import classify
from hangdx.probes import procstate
from hangdx.probes.model import Evidence, Frame, ProcessState, Source, StackDump, ThreadStack

# The main thread waits for an async checkpoint's Future; the writer thread is inside the builtin open(), so its
# stack ends in the program's own function (py-spy shows no frame for a builtin).
MAIN = ThreadStack(1000, "MainThread", "idle", [
    Frame("wait", "/usr/lib/python3.11/threading.py", 320),
    Frame("result", "/usr/lib/python3.11/concurrent/futures/_base.py", 451),
    Frame("save", "/work/train.py", 83),
    Frame("main", "/work/train.py", 130),
])  # fmt: skip
WRITER = ThreadStack(1007, "ThreadPoolExecutor-0_0", "idle", [
    Frame("_write", "/work/train.py", 90),
    Frame("run", "/usr/lib/python3.11/concurrent/futures/thread.py", 58),
    Frame("_worker", "/usr/lib/python3.11/concurrent/futures/thread.py", 83),
])  # fmt: skip
DUMP = StackDump(pid=1000, rank=0, host="n1", threads=[MAIN, WRITER], source="s")


def test_a_rank_waiting_on_its_writer_thread_blocked_in_open_is_an_io_stall():
    state = ProcessState(host="n1", pid=1000, rank=0, state="S", syscall="futex",
                         thread_syscalls={"1007": "openat(/mnt/ckpt/step_000040.pt (fifo))"})  # fmt: skip
    loc = classify(DUMP, state)
    assert loc.kind == "io"
    assert "waits for thread ThreadPoolExecutor-0_0, blocked in openat(/mnt/ckpt/step_000040.pt (fifo))" in (
        loc.detail
    )


def test_without_the_threads_syscall_the_wait_stays_a_wait_on_its_own_thread():
    loc = classify(DUMP, ProcessState(host="n1", pid=1000, rank=0, state="S", syscall="futex"))
    assert loc.kind in ("child", "lock")


def test_thread_syscalls_survive_a_saved_procstate_and_odd_values_are_dropped():
    doc = {"hangdx": "procstate", "host": "n1", "samples": [
        {"pid": 1000, "rank": 0, "thread_syscalls": {"1007": "openat(/mnt/x)"}},
        {"pid": 1001, "rank": 1, "thread_syscalls": {"1008": 5}},
    ]}  # fmt: skip
    ev = Evidence()
    procstate.parse(json.dumps(doc).encode(), Source("processes.json"), ev)
    assert ev.processes[0].thread_syscalls == {"1007": "openat(/mnt/x)"}
    assert ev.processes[1].thread_syscalls is None
