"""The taxonomy of waits (probes/waits.yaml): every row classifies its own examples, and the rules of reading hold."""

from __future__ import annotations

import re

import pytest

from hangdx.probes import waits
from hangdx.probes.model import Frame

_LINE = re.compile(r"^(.*) \((.+?)(?::(\d+))?\)$")


def frame(text: str) -> Frame:
    """A frame as py-spy prints it: `func (file:line)` is Python, `symbol (lib.so)` native."""
    m = _LINE.match(text)
    assert m, text
    func, where, line = m.groups()
    return Frame(func, where, int(line) if line else None, native=line is None and not where.startswith("<"))


def frames(*lines: str) -> list[Frame]:
    return [frame(x) for x in lines]


EXAMPLES = [(r.id, e) for r in waits.rows() for e in r.examples]


def test_every_row_is_complete() -> None:
    for r in waits.rows():
        assert r.kind in waits.KINDS, r.id
        assert r.meaning and r.source and r.examples, r.id
        assert r.files or r.native, r.id
    ids = [r.id for r in waits.rows()]
    assert len(ids) == len(set(ids))


@pytest.mark.parametrize(("row_id", "example"), EXAMPLES, ids=[f"{i}:{e[:40]}" for i, e in EXAMPLES])
def test_row_classifies_its_example(row_id: str, example: str) -> None:
    row = next(r for r in waits.rows() if r.id == row_id)
    f = frame(example)
    if f.native:
        assert waits.match_native(f) is row
    w = waits.classify([f], idle=True)
    assert w is not None, example
    assert (w.kind, w.row.id if w.row else None) == (row.kind, row.id)


def test_backward_under_ddp_is_a_collective_when_idle_and_compute_when_active() -> None:
    stack = frames(
        "_engine_run_backward (torch/autograd/graph.py:979)",
        "backward (torch/autograd/__init__.py:395)",
        "Tensor.backward (torch/_tensor.py:623)",
        "train_step (train.py:51)",
    )
    w = waits.classify(stack, idle=True)
    assert (w.kind, w.op, w.frame.function) == ("collective", "backward", "Tensor.backward")
    assert waits.classify(stack, idle=False) is None


def test_native_reducer_confirms_backward() -> None:
    stack = frames(
        "pthread_cond_wait (libc.so.6)",
        "c10d::Reducer::finalize_backward (libtorch_cpu.so)",
        "THPEngine_run_backward (libtorch_python.so)",
        "_engine_run_backward (torch/autograd/graph.py:979)",
        "Tensor.backward (torch/_tensor.py:623)",
        "train_step (train.py:51)",
    )
    w = waits.classify(stack, idle=True)
    assert w.kind == "collective" and "native_collective" in w.via


def test_outermost_library_frame_of_the_leaf_run_wins() -> None:
    w = waits.classify(
        frames("Condition.wait (threading.py:327)", "Queue.get (queue.py:171)", "next_batch (train.py:60)")
    )
    assert (w.kind, w.op, w.frame.function) == ("lock", "get", "Queue.get")


def test_context_makes_the_dataset_code_a_data_wait() -> None:
    w = waits.classify(
        frames(
            "Event.wait (threading.py:629)",
            "__getitem__ (mydata.py:20)",
            "_MapDatasetFetcher.fetch (torch/utils/data/_utils/fetch.py:52)",
            "_SingleProcessDataLoaderIter._next_data (torch/utils/data/dataloader.py:790)",
            "_BaseDataLoaderIter.__next__ (torch/utils/data/dataloader.py:732)",
            "train (train.py:10)",
        )
    )
    assert (w.kind, w.frame.function) == ("data", "_BaseDataLoaderIter.__next__")


def test_user_compute_under_ddp_forward_is_not_a_wait() -> None:
    """DDP's forward runs the program's model: a matmul inside the model is not DDP's collective."""
    w = waits.classify(
        frames(
            "forward (mymodel.py:30)",
            "Module._call_impl (torch/nn/modules/module.py:1784)",
            "DistributedDataParallel._run_ddp_forward (torch/nn/parallel/distributed.py:1700)",
            "DistributedDataParallel.forward (torch/nn/parallel/distributed.py:1884)",
            "train (train.py:10)",
        ),
        idle=False,
    )
    assert w is None


def test_short_native_words_match_whole_names_only() -> None:
    assert waits.match_native(frame("pthread_cond_wait (libc.so.6)")).kind == "lock"
    assert waits.match_native(frame("read (libc.so.6)")).id == "native_read"
    assert waits.match_native(frame("thread_main (libfoo.so)")) is None


def test_gil_wait_is_read_from_the_top_native_frames() -> None:
    stack = frames("take_gil (python3.11)", "PyEval_RestoreThread (python3.11)", "step (train.py:3)")
    assert waits.gil_wait(stack).function == "take_gil"


def test_gloo_buffer_wait_inside_a_collective_is_the_collective() -> None:
    """gloo's allreduce waits on unbound buffers too: the c10d collective frame around it says which."""
    stack = frames(
        "gloo::transport::tcp::UnboundBuffer::waitRecv (libtorch_cpu.so)",
        "gloo::allreduce (libtorch_cpu.so)",
        "c10d::ProcessGroupGloo::AsyncAllreduceWork::run (libtorch_cpu.so)",
    )
    assert waits.classify(stack).kind == "collective"
    recv = frames(
        "gloo::transport::tcp::UnboundBuffer::waitRecv (libtorch_cpu.so)",
        "c10d::ProcessGroupGloo::RecvWork::wait (libtorch_cpu.so)",
    )
    assert waits.classify(recv).kind == "p2p"
