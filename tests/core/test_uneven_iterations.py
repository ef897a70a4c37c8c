"""Ranks whose own log lines stop at different iterations of one loop (probes/counters.py, playbooks/uneven_loops.py).

The torchtitan lines are from pytorch/torchtitan#1618 (tests/fixtures/real/conditional_collective__pytorch-
torchtitan-1618.log); the others are written in the same `[rankN]:` + Python logging format, and the watchdog
line in PyTorch's (ProcessGroupNCCL.cpp, as in tests/fixtures/real).
"""

from __future__ import annotations

from hangdx.playbooks import engine
from hangdx.probes import counters, reader, torch_log
from hangdx.probes.model import Evidence, Source

TITAN = b"""```
...
[rank1]:[titan] 2025-08-21 11:19:52,968 - root - INFO - [Validation Debug]  Rank 1 batch 87 Loss 12.241142272949219
[rank1]:[titan] 2025-08-21 11:19:52,972 - root - INFO - [Validation Debug]  Rank 1 batch 88 start
[rank1]:[titan] 2025-08-21 11:19:52,988 - root - INFO - [Validation Debug]  Rank 1 batch 88 Loss 12.209203720092773
[rank1]:[titan] 2025-08-21 11:19:52,993 - root - INFO - [Validation Debug]  Rank 1 batch 89 start
[rank0]:[titan] 2025-08-21 11:19:52,905 - root - INFO - [Validation Debug]  Rank 0 batch 84 Loss 12.281610488891602
[rank0]:[titan] 2025-08-21 11:19:52,931 - root - INFO - [Validation Debug]  Rank 0 batch 86 start
[rank0]:[titan] 2025-08-21 11:19:52,951 - root - INFO - [Validation Debug]  Rank 0 batch 87 start
"""


def steps(last: dict[int, int], at: str = "10:00:0{i}", gap: str | None = None) -> bytes:
    out = []
    for r, n in last.items():
        for i, k in enumerate(range(n - 2, n + 1)):
            t = at.format(i=i)
            out.append(f"[rank{r}]:2025-01-01 {t},000 - train - INFO - step: {k}  loss:  7.41".encode())
    return b"\n".join(out) + b"\n"


def read(text: bytes) -> Evidence:
    ev = Evidence()
    reader.read_text([text], Source("paste.log"), ev)
    return ev


def test_python_logging_lines_under_a_rank_prefix_are_a_rank_log():
    ev = read(TITAN)
    assert ev.reads and "lines" in ev.reads[0]
    got = {e.rank: (e.fields["what"], e.fields["first"], e.fields["n"]) for e in ev.events_of("step_counter")}
    assert got == {1: ("batch", 87, 89), 0: ("batch", 84, 87)}


def test_ranks_stopped_at_different_batches_ran_the_loop_unevenly():
    v = engine.run(read(TITAN))
    rc = v.root_cause
    # Two ranks: which one ran out of batches first is not in the log.
    assert rc.category == "conditional_collective" and rc.culprit.ranks == []
    assert v.status == "hung"
    assert [q.line for q in rc.evidence] == [6, 9]  # each rank's last counter line, verbatim


def test_one_rank_short_of_all_the_others_is_named():
    rc = engine.run(read(steps({0: 120, 1: 120, 2: 118, 3: 120}))).root_cause
    assert (rc.category, rc.culprit.ranks) == ("conditional_collective", [2])


def test_ranks_at_the_same_step_or_one_logged_step_apart_say_nothing():
    # One step apart is a rank stuck before its next log line, for any reason: not by itself uneven iterations.
    for last in ({0: 120, 1: 120}, {0: 120, 1: 119, 2: 120}):
        v = engine.run(read(steps(last)))
        assert all(f.playbook != "uneven_iterations" for f in v.findings), last


def test_a_log_every_ten_steps_counts_its_own_stride():
    text = b"".join(
        f"[rank{r}]:2025-01-01 10:00:0{i},000 - train - INFO - step: {k}  loss:  7.41\n".encode()
        for r, ks in ((0, (100, 110, 120)), (1, (90, 100, 110)), (2, (100, 110, 120)))
        for i, k in enumerate(ks)
    )
    assert all(f.playbook != "uneven_iterations" for f in engine.run(read(text)).findings)
    (e,) = [e for e in read(text).events_of("step_counter") if e.rank == 1]
    assert e.fields["stride"] == 10


def test_a_rank_whose_log_goes_on_long_after_the_others_is_not_uneven_data():
    text = steps({0: 120, 1: 120}) + steps({2: 140}, at="10:4{i}:00")
    v = engine.run(read(text))
    assert all(f.playbook != "uneven_iterations" for f in v.findings)


def test_a_rank_busy_in_other_work_while_the_others_time_out_stays_a_straggler():
    text = (
        steps({0: 118, 1: 120})
        + (
            "[rank0]:Evaluating:  10%|\u2588         | 10/100 [00:10<01:30,  1.00it/s]\n"
            "[rank0]:Evaluating:  50%|\u2588\u2588\u2588\u2588\u2588     | 50/100 [00:50<00:50,  1.00it/s]\n"
            "[rank1]:[E1122 01:48:50.682679688 ProcessGroupNCCL.cpp:616] [Rank 1] Watchdog caught collective "
            "operation timeout: WorkNCCL(SeqNum=5, OpType=ALLREDUCE, NumelIn=1, NumelOut=1, Timeout(ms)=600000) ran "
            "for 600012 milliseconds before timing out.\n"
        ).encode()
    )
    v = engine.run(read(text))
    assert (v.root_cause.category, v.root_cause.culprit.ranks) == ("straggler", [0])
    assert all(f.playbook != "uneven_iterations" for f in v.findings)


def test_counters_as_training_code_prints_them():
    assert counters.find("step: 10  loss:  7.4")[:3] == ("step", 10, None)
    assert counters.find("Iteration 40/500 | lr 1e-4")[:3] == ("iter", 40, 500)
    assert counters.find("Epoch 3 Step [120/1000] loss=2.1")[:3] == ("step", 120, 1000)
    assert counters.find("global_step=300 loss=1.2")[:3] == ("global_step", 300, None)
    for not_a_counter in ("batch_size=32", "max_steps: 1000", "steps 100", "in train_step", "batch size 8",
                          "step 1.5e-3", "Timeout at collective: ALLREDUCE, #12"):  # fmt: skip
        assert counters.find(not_a_counter) is None, not_a_counter


def test_python_logging_formats_are_claimed_as_a_rank_log():
    for line in (
        "[titan] 2025-08-21 11:19:52,993 - root - INFO - [Validation Debug]  Rank 1 batch 89 start",
        "2025-08-21 11:19:52,993 - train - WARNING - slow step",
        "INFO:root:epoch 1 done",
        "2025-08-21 11:19:52.993 | INFO     | train:main:42 - step 3",
    ):
        assert torch_log.claims(line) >= reader.REGION_CLAIM, line
    assert torch_log.claims("2025-08-21 11:19:52 some tool output") == 0
