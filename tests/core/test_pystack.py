"""pystack output (`pystack remote`/`pystack core`, with and without --native and --locals): parsed into the same
stacks as py-spy's, so the stack classification names where each thread waits.

Fixtures in fixtures/pystack were recorded on this machine with pystack 1.7.2 from real CPython processes and from
hung gloo jobs of the hang zoo (see its README). One test runs pystack itself when it is installed.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hangdx.playbooks import engine
from hangdx.playbooks.facts import classify
from hangdx.probes.bundle import evidence_from_paths
from hangdx.probes.model import Evidence, Source
from hangdx.probes.registry import detect

FIX = Path(__file__).resolve().parent.parent / "fixtures" / "pystack"


def read(*paths: Path) -> Evidence:
    return evidence_from_paths([str(p) for p in paths])


def root(*paths: Path):
    return engine.run(read(*paths)).root_cause


def test_pystack_output_is_detected_by_its_content():
    for f in FIX.glob("*.txt"):
        mod = detect(f.read_bytes())
        assert mod is not None and mod.KIND == "pystack", f.name


def test_threads_frames_and_the_main_thread():
    ev = read(FIX / "lock_two_threads.txt")
    [dump] = ev.stacks
    assert dump.pid == 19131  # the main thread's id is the process's
    main, worker = dump.threads
    assert main.name == "MainThread" and main.tid == 19131 and worker.tid == 19255
    assert [f.function for f in main.frames] == ["_wait_for_tstate_lock", "join", "holder", "<module>"]
    assert main.frames[2].file == "/tmp/ps/lock.py" and main.frames[2].line == 10
    assert not any(f.native for f in main.frames)
    assert main.frames[0].quote.text.startswith('(Python) File "')


def test_native_frames_are_marked_native():
    ev = read(FIX / "lock_two_threads_native.txt")
    [dump] = ev.stacks
    main = dump.threads[0]
    assert main.name == "MainThread"
    assert main.frames[0].native and main.frames[0].function == "__futex_abstimed_wait_common64"
    assert main.frames[0].file == "./nptl/futex-internal.c" and main.frames[0].line == 57
    py = [f for f in main.frames if not f.native]
    assert [f.function for f in py] == ["_wait_for_tstate_lock", "join", "holder", "<module>"]
    cpp = read(FIX / "gloo_skip_collective_rank1_native.txt").stacks[0].threads[0].frames
    wait = next(f for f in cpp if f.function.startswith("c10d::Work::wait"))
    assert wait.native and wait.file.endswith("libtorch_cpu.so") and wait.line is None


def test_locals_and_the_gil():
    t = read(FIX / "queue_get_locals.txt").stacks[0].threads[0]
    # `waiter.acquire()` is the innermost line: the thread is in that lock's acquire (no --native to show it)
    assert t.frames[0].function == "PyThread_acquire_lock" and t.frames[0].quote.text == "waiter.acquire()"
    assert t.frames[1].function == "wait" and t.frames[1].locals["waiter"].startswith("<_thread.lock")
    busy = read(FIX / "busy_has_gil.txt").stacks[0]
    spinner = next(t for t in busy.threads if t.name != "MainThread")
    assert spinner.state == "gil" and busy.threads[0].state == "idle"


def test_a_core_names_its_process():
    [dump] = read(FIX / "core_sleep.txt").stacks
    assert dump.pid == 19132 and dump.threads[0].frames[0].function == "train_step"


@pytest.mark.parametrize(
    "name", ["lock_two_threads", "lock_two_threads_native", "queue_get", "queue_get_native"]
)
def test_a_lock_or_queue_wait_is_a_user_deadlock(name):
    rc = root(FIX / f"{name}.txt")
    assert rc.category == "user_deadlock"


def test_a_with_lock_line_without_native_frames_is_a_lock_wait():
    dump = read(FIX / "gloo_lock_deadlock_rank0.txt").stacks[0]
    loc = classify(dump, None)
    assert loc.kind == "lock"
    assert "with self._file_lock:" in loc.quote.text


@pytest.mark.parametrize("native", ["", "_native"])
def test_a_gloo_rank_in_another_collective_is_named(native):
    rc = root(*[FIX / f"gloo_skip_collective_rank{r}{native}.txt" for r in range(4)])
    assert rc.category == "conditional_collective" and rc.culprit.ranks == [1]


@pytest.mark.parametrize("native", ["", "_native"])
def test_a_gloo_rank_deadlocked_on_its_own_locks_is_named(native):
    rc = root(*[FIX / f"gloo_lock_deadlock_rank{r}{native}.txt" for r in range(4)])
    assert rc.category == "user_deadlock" and rc.culprit.ranks == [0]


def test_two_processes_in_one_paste_are_two_dumps():
    text = (FIX / "lock_two_threads.txt").read_bytes() + (FIX / "queue_get.txt").read_bytes()
    ev = evidence_from_paths(["-"], stdin=text)
    assert [d.pid for d in ev.stacks] == [19131, 19133]
    assert all(d.threads[0].name == "MainThread" for d in ev.stacks)


def test_pystack_errors_are_gaps_and_odd_text_never_raises():
    ev = read(FIX / "error_not_python.txt")
    assert not ev.stacks and any("Could not determine python version" in g.message for g in ev.gaps)
    from hangdx.probes import pystack

    for junk in ["Traceback for thread x", '    (C) File "', '    (Python) File "a", line 9' + "9" * 5000 + ", in f",
                 "Traceback for thread 1 (python) [] (most recent call last):\n      Locals:\n        a: 1"]:  # fmt: skip
        pystack.parse(junk.encode(), Source("junk"), Evidence())


@pytest.mark.skipif(shutil.which("pystack") is None, reason="pystack is not installed (pip install pystack)")
def test_real_pystack_on_a_process_waiting_on_a_lock(tmp_path):
    prog = tmp_path / "locked.py"
    prog.write_text(
        "import threading, sys\nlock = threading.Lock()\nlock.acquire()\nprint('ready', flush=True)\n"
        "def wait_for_lock():\n    with lock:\n        pass\nwait_for_lock()\n"
    )
    proc = subprocess.Popen([sys.executable, str(prog)], stdout=subprocess.PIPE)
    try:
        assert proc.stdout.readline().strip() == b"ready"
        time.sleep(0.3)
        out = subprocess.run(["pystack", "remote", str(proc.pid)], capture_output=True, timeout=60)
        if out.returncode != 0 and b"ptrace" in out.stderr.lower() + out.stdout.lower():
            pytest.skip(f"pystack may not ptrace here: {out.stderr.decode()[:200]}")
        assert out.returncode == 0, out.stderr
        ev = evidence_from_paths(["-"], stdin=out.stdout)
        [dump] = ev.stacks
        assert dump.pid == proc.pid and dump.threads[0].name == "MainThread"
        assert engine.run(ev).root_cause.category == "user_deadlock"
    finally:
        proc.kill()
        proc.wait()
