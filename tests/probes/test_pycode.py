"""Pasted training code: the collectives only some ranks call (probes/pycode.py, playbooks/pasted_code.py)."""

from __future__ import annotations

import ast
import io

from hangdx.playbooks import engine
from hangdx.probes import pycode
from hangdx.probes.model import Evidence, Source
from hangdx.probes.reader import read_any, readable


def found(code: str) -> list[tuple[int, str, list[int], str]]:
    return [(n.lineno, c, r, h) for n, c, r, h in pycode._findings(ast.parse(code))]


def verdict(text: str):
    ev = Evidence()
    read_any(io.BytesIO(text.encode()), Source("paste.md"), ev)
    return ev, engine.run(ev)


BARRIER_ON_RANK_0 = """
def train():
    for batch in loader:
        loss = model(batch).sum()
        loss.backward()
        if dist.get_rank() == 0:
            save(model)
            dist.barrier()
"""


def test_a_barrier_only_rank_0_calls():
    assert found(BARRIER_ON_RANK_0) == [(6, "barrier", [0], "only")]


def test_balanced_barriers_of_the_first_rank_pattern_are_no_divergence():
    # HF's examples: the other ranks wait while rank 0 prepares the data, then rank 0 joins them: one barrier each.
    code = """
if args.local_rank not in [-1, 0]:
    torch.distributed.barrier()
dataset = load_and_cache_examples(args)
if args.local_rank == 0:
    torch.distributed.barrier()
"""
    assert found(code) == []


def test_the_same_collective_on_both_branches_is_no_divergence():
    code = """
if rank == 0:
    objs = [config]
    dist.broadcast_object_list(objs, src=0)
else:
    objs = [None]
    dist.broadcast_object_list(objs, src=0)
"""
    assert found(code) == []


def test_ranks_that_return_before_a_collective_skip_it():
    code = """
def evaluate(model):
    if not accelerator.is_main_process:
        return
    preds = model(x)
    accelerator.wait_for_everyone()
"""
    assert found(code) == [(3, "wait_for_everyone", [], "skip")]


def test_a_tensor_sized_by_rank_before_an_all_reduce_is_a_mismatch():
    code = """
numel = 100
if rank == 0:
    numel *= 2
tensor = torch.ones(numel, device=device)
dist.all_reduce(tensor)
"""
    assert found(code) == [(3, "all_reduce", [0], "size")]


def test_rank_independent_tests_and_common_names_are_not_collectives():
    code = """
for i in range(10):
    if i > 5:
        dist.all_reduce(t)
if rank == 0:
    total = functools.reduce(lambda a, b: a + b, values)
    print(total)
"""
    assert found(code) == []


def test_a_rank_zero_only_function_that_calls_a_collective():
    code = """
@rank_zero_only
def on_fit_start(self):
    dist.barrier()
    print("started")
"""
    assert found(code) == [(3, "barrier", [0], "only")]


def test_pasted_code_with_a_timeout_gives_conditional_collective_and_the_rank():
    text = (
        "```python"
        + BARRIER_ON_RANK_0
        + "```\n"
        + (
            "[rank1]:[E1205 04:35:53.584483882 ProcessGroupNCCL.cpp:607] [Rank 1] Watchdog caught collective operation "
            "timeout: WorkNCCL(SeqNum=3348, OpType=ALLREDUCE, NumelIn=1, NumelOut=1, Timeout(ms)=1800000) ran for "
            "1800098 milliseconds before timing out.\n"
        )
    )
    _, v = verdict(text)
    assert v.root_cause.category == "conditional_collective"
    assert v.root_cause.culprit.ranks == [0]
    assert "barrier" in v.root_cause.summary


def test_a_tracebacks_source_lines_are_not_pasted_code():
    text = """Traceback (most recent call last):
  File "train.py", line 40, in <module>
    if rank == 0:
  File "train.py", line 41, in <module>
    dist.barrier()
  File "train.py", line 42, in <module>
    x = 1
RuntimeError: boom
"""
    ev, _ = verdict(text)
    assert not ev.events_of(pycode.EVENT)


def test_code_with_no_collective_is_read_not_refused():
    ev, v = verdict("import torch\n\ndef f(x):\n    y = x * 2\n    return y\n")
    assert readable(ev)
    assert v.root_cause.category == "unknown"


def test_code_nested_past_any_walk_is_left_unread_not_a_crash():
    deep = "if rank == " + "+".join(["1"] * 1300) + ":\n    dist.barrier()\nx = 1\ny = 2\n"
    ev, v = verdict(deep)
    assert v.root_cause is not None  # read or not, a verdict and no traceback


def test_stack_dumps_are_not_read_as_code():
    gdb = "#0  0x00007f in pthread_cond_wait () from /lib/libc.so.6\n#1  0x00007f in c10d::Work::wait () from libtorch.so\n"
    pyspy = (
        'Thread 12 (idle): "MainThread"\n'
        "    all_reduce (torch/distributed/distributed_c10d.py:3252)\n"
        "    train_step (train.py:41)\n    <module> (train.py:80)\n"
    )
    for text in (gdb * 3, pyspy):
        ev, _ = verdict(text)
        assert not any("Python code" in r for r in ev.reads), ev.reads
