"""py-spy dump parsing. Fixtures in fixtures/pyspy/ are real py-spy 0.4.3 output, recorded from a
hung 2-rank gloo job (torch 2.13, CPython 3.11): `py-spy dump`, `--json`, `--native`, `--locals`."""

from __future__ import annotations

from pathlib import Path

import pytest

from hangdx.probes import pyspy
from hangdx.probes.model import Evidence, Source
from hangdx.probes.registry import detect

FIX = Path(__file__).parent.parent / "fixtures" / "pyspy"


def parse(name: str) -> Evidence:
    ev = Evidence()
    pyspy.parse((FIX / name).read_bytes(), Source(name, host="node1", rank=0), ev)
    return ev


@pytest.mark.parametrize(
    "name", ["text_rank0.txt", "json_rank0.json", "native_rank0.txt", "locals_rank0.txt"]
)
def test_every_format_shows_the_rank_waiting_in_all_reduce(name):
    ev = parse(name)
    assert len(ev.stacks) == 1
    dump = ev.stacks[0]
    assert dump.pid == 7685 and dump.rank == 0 and dump.host == "node1"
    main = dump.main_thread()
    assert main.name == "MainThread" and main.state == "idle"
    py = [f for f in main.frames if not f.native]
    assert py[0].function == "all_reduce"
    assert py[0].file.endswith("torch/distributed/distributed_c10d.py") and py[0].line == 3252
    assert py[-1].function == "<module>" and py[-1].line == 7


def test_native_frames_are_marked_native():
    main = parse("native_rank0.txt").stacks[0].main_thread()
    native = [f.function for f in main.frames if f.native]
    assert "pthread_cond_wait" in native and "c10d::Work::wait" in native


def test_locals_are_attached_to_their_frame():
    main = parse("locals_rank0.txt").stacks[0].main_thread()
    assert main.frames[0].locals["async_op"] == "False"
    assert "kwargs" in main.frames[1].locals


def test_frame_quotes_are_verbatim_dump_lines():
    ev = parse("text_rank0.txt")
    f = ev.stacks[0].main_thread().frames[0]
    lines = (FIX / "text_rank0.txt").read_text().splitlines()
    assert (
        lines[f.quote.line - 1].strip()
        == f.quote.text
        == "all_reduce (torch/distributed/distributed_c10d.py:3252)"
    )


def test_old_hex_thread_ids_and_gil_state():
    text = (
        "Process 42: python train.py\nPython v3.8.10 (/usr/bin/python3.8)\n\n"
        'Thread 0x7F3C9FEAA740 (active+gil): "MainThread"\n    forward (model.py:10)\n'
        "Thread 0x7F3C8FEAA700 (idle)\n    run (threading.py:870)\n"
    )
    ev = Evidence()
    pyspy.parse(text.encode(), Source("x"), ev)
    t0, t1 = ev.stacks[0].threads
    assert t0.tid == 0x7F3C9FEAA740 and t0.state == "gil" and t0.frames[0].line == 10
    assert t1.name == "" and t1.state == "idle"


def test_collector_markers_give_rank_host_time_and_role():
    text = (
        "# hangdx stack-sample time=100.5 host=gpu-node-03 rank=17 pid=9 role=worker\n"
        'Process 9: python\nPython v3.11.7 (x)\n\nThread 9 (idle): "MainThread"\n    f (a.py:1)\n'
        "# hangdx stack-sample time=101.5 host=gpu-node-03 rank=17 pid=9 role=worker\n"
        'Process 9: python\nPython v3.11.7 (x)\n\nThread 9 (idle): "MainThread"\n    g (a.py:2)\n'
    )
    ev = Evidence()
    pyspy.parse(text.encode(), Source("s"), ev)
    assert [(d.rank, d.host, d.taken_at, d.role) for d in ev.stacks] == [
        (17, "gpu-node-03", 100.5, "worker"),
        (17, "gpu-node-03", 101.5, "worker"),
    ]


def test_detected_by_content_whatever_the_name():
    for name in ["text_rank0.txt", "json_rank0.json", "native_rank0.txt"]:
        assert detect((FIX / name).read_bytes()).KIND == "pyspy"


@pytest.mark.parametrize(
    "data",
    [
        b"",
        b"\x00\x01\x02garbage\xff" * 100,
        b'Process 1: python\nThread 1 (idle): "Main',
        b'[1, 2, {"frames": 3}]',
    ],
)
def test_bad_input_never_raises(data):
    ev = Evidence()
    pyspy.parse(data, Source("bad"), ev)
    assert pyspy.sniff(b"\x00\x01\x02garbage") == 0


def test_pyspy_error_output_becomes_a_gap():
    ev = Evidence()
    pyspy.parse(
        b"Error: Failed to get process executable name. Check that the process is running.\n", Source("e"), ev
    )
    assert ev.gaps and "Failed to get process executable name" in ev.gaps[0].message
