"""Horovod's stall warning (probes/horovod_log.py, playbooks/horovod.py).

Formats from Horovod's sources: operations.cc of 0.11 (`Stalled ops: NAME [ready ranks: ...]`, one line),
operations.cc of 0.13-0.18 (`Stalled ops:` then `NAME [missing ranks: ...]`, one op a line), stall_inspector.cc
(`Stalled ranks:` / `Missing ranks:` then `N: [tensors]`, `N!:` and `Will shutdown.` past the shutdown time) and
logging.cc (`[2021-02-02 21:19:07.345988: W file.cc:105] `). The wrapped warning is the one quoted in
horovod/horovod#159 (tests/fixtures/real/straggler__horovod-horovod-159.log); the `Missing ranks:` one is from a
public Horovod bug report (DEKHTIARJonathan/HVD_TF_Worker_Desync_BugReport); the rest are written in the formats
the sources print (tests/fixtures/horovod_log/README.md).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from hangdx.playbooks import engine
from hangdx.probes import horovod_log, reader
from hangdx.probes.model import Evidence, Source

FIX = Path(__file__).resolve().parent.parent / "fixtures"
WRAPPED_0_11 = (FIX / "real" / "straggler__horovod-horovod-159.log").read_bytes()
MISSING_RANKS = (
    b"[2021-02-02 21:19:07.345988: W /tmp/pip-install-dxtho7yu/horovod_0bde588442554cf4b80c76441efc4e03/horovod/"
    b"common/stall_inspector.cc:105] One or more tensors were submitted to be reduced, gathered or broadcasted by "
    b"subset of ranks and are waiting for remainder of ranks for more than 10 seconds. This may indicate that "
    b"different ranks are trying to submit different tensors or that only subset of ranks is submitting tensors, "
    b"which will cause deadlock. \nMissing ranks:\n0: [cond_1/then/_10/cond_1/SGD/PartitionedCall/"
    b"DistributedSGD_Allreduce/cond/then/_79/DistributedSGD_Allreduce/cond/HorovodAllreduce_grads_0]\n"
)
SHUTDOWN = (FIX / "horovod_log" / "stall_shutdown_mpirun.log").read_bytes()
PER_OP = (FIX / "horovod_log" / "stall_ops_missing_ranks.log").read_bytes()
SHUT_DOWN_LATER = PER_OP + (
    b"tensorflow.python.framework.errors_impl.UnknownError: Horovod has been shut down. This was caused by an "
    b"exception on one of the ranks or an attempt to allreduce, allgather or broadcast a tensor after one of the "
    b"ranks finished execution.\n"
)


def read(text: bytes) -> Evidence:
    ev = Evidence()
    reader.read_text([text], Source("paste.log"), ev)
    return ev


def stall(ev: Evidence):
    (e,) = ev.events_of("horovod_stall")
    return e


def test_the_oldest_form_wrapped_by_a_chat_window_names_the_ready_ranks():
    e = stall(read(WRAPPED_0_11))
    assert e.fields["ready"] == [1, 2, 3, 4, 5, 6, 7]
    assert e.fields["seconds"] == 60
    assert e.fields["ops"][0]["tensor"] == "HVDAllReduce/HorovodAllreduce_gradients_AddN_69_0"
    assert e.quote.line == 6 and "[ready ranks:" in e.quote.text  # the line naming the ranks, verbatim


def test_ready_ranks_1_to_7_make_rank_0_the_straggler():
    v = engine.run(read(WRAPPED_0_11))
    rc = v.root_cause
    assert (rc.category, rc.culprit.ranks) == ("straggler", [0])
    assert v.status == "progressing"
    assert any("[ready ranks: 2, 6, 7, 3, 4, 1, 5]" in q.text for q in rc.evidence)


def test_missing_ranks_under_horovods_logger_name_the_late_rank():
    ev = read(MISSING_RANKS)
    e = stall(ev)
    assert e.fields["missing"] == [0] and e.fields["seconds"] == 10
    assert e.fields["ops"][0]["tensor"].endswith("HorovodAllreduce_grads_0")
    rc = engine.run(ev).root_cause
    assert (rc.category, rc.culprit.ranks) == ("straggler", [0])


def test_missing_ranks_per_op_lines():
    e = stall(read(PER_OP))
    assert [op["missing"] for op in e.fields["ops"]] == [[5], [5]]
    assert e.fields["missing"] == [5] and not e.fields["shutdown"]


def test_a_stall_horovod_gives_up_on_is_a_collective_the_late_rank_never_issued():
    ev = read(SHUTDOWN)
    e = stall(ev)
    assert e.fields["shutdown"] and e.fields["shutdown_ranks"] == [3] and e.rank == 0  # mpirun's [1,0] tag
    v = engine.run(ev)
    assert (v.root_cause.category, v.root_cause.culprit.ranks) == ("conditional_collective", [3])
    assert v.status == "hung"
    assert any("Will shutdown." in q.text for q in v.root_cause.evidence)


def test_horovod_shut_down_after_the_warning_means_it_never_cleared():
    v = engine.run(read(SHUT_DOWN_LATER))
    assert (v.root_cause.category, v.root_cause.culprit.ranks) == ("conditional_collective", [5])


def test_odd_text_never_raises():
    for text in (
        b"One or more tensors were submitted to be reduced\n",  # the prose cut before its list
        b"Stalled ops: x [ready ranks: ]\n",
        b"Missing ranks:\n99999999999: [\n",
        b"\xff\xfe One or more tensors were submitted to be \x00",
    ):
        ev = Evidence()
        horovod_log.parse(text, Source("x.log"), ev)
        reader.read_text([text], Source("x.log"), ev)
        engine.run(ev)
    assert not read(b"One or more tensors were submitted to be reduced, gathered\n").events


CROSSED = (
    b"[1,0]<stderr>:[2020-07-04 19:23:57.817885: W horovod/common/stall_inspector.cc:105] One or more tensors were "
    b"submitted to be reduced, gathered or broadcasted by subset of ranks and are waiting for remainder of ranks for "
    b"more than 60 seconds. This may indicate that different ranks are trying to submit different tensors or that "
    b"only subset of ranks is submitting tensors, which will cause deadlock. \n"
    b"[1,0]<stderr>:Stalled ranks:\n"
    b"[1,0]<stderr>:0: [HorovodBroadcast_w_0, HorovodBroadcast_b_0]\n"
    b"[1,0]<stderr>:1: [HorovodAllreduce_grad_w_0, HorovodAllreduce_grad_b_0]\n"
)


def test_crossed_waits_are_a_divergence_not_a_late_rank():
    # Rank 0 lacks the broadcasts rank 1 submitted, rank 1 the allreduces rank 0 submitted: neither can go on.
    rc = engine.run(read(CROSSED)).root_cause
    assert rc.category == "conditional_collective", rc.summary
    assert rc.culprit.ranks == []  # the warning cannot say which side took the other path
    assert "crossed waits" in rc.summary and "rank 1 never submitted HorovodAllreduce_grad_w_0" in rc.summary


def test_a_rank_merely_late_on_the_same_tensors_stays_a_straggler():
    late = CROSSED.replace(
        b"[HorovodAllreduce_grad_w_0, HorovodAllreduce_grad_b_0]", b"[HorovodBroadcast_w_0]"
    )
    rc = engine.run(read(late)).root_cause
    assert rc.category == "straggler", rc.summary


def test_missing_ranks_after_training_ended_left_the_loop_early():
    finished = b"INFO:tensorflow:Loss for final step: 3.3031716.\nstart wait for other node.\n"
    rc = engine.run(read(finished + PER_OP)).root_cause
    assert rc.category == "conditional_collective", rc.summary
    assert "left the training loop" in rc.summary
    without = engine.run(read(PER_OP)).root_cause
    assert without.category != "conditional_collective" or "left the training loop" not in without.summary


def _one_against_many(n: int, odd: int, prefix: str = "") -> bytes:
    lines = [f"{prefix}Missing ranks:"]
    for r in range(n):
        tensors = (
            "HorovodAllreduce_grad_w_0, HorovodAllreduce_grad_b_0" if r == odd else "broadcast_object_fn.sz"
        )
        lines.append(f"{prefix}{r}: [{tensors}]")
    return ("\n".join(lines) + "\n").encode()


@pytest.mark.parametrize(
    "n,odd,prefix",
    [(9, 8, "Fri Sep 18 03:11:09 2020[0]<stderr>:"), (4, 0, "[1,2]<stderr>:"), (16, 5, "")],
)
def test_crossed_waits_of_one_rank_against_all_others_name_that_rank(n, odd, prefix):
    # The list head alone (the warning's prose above it lost by the paste), under horovodrun's or mpirun's tag
    rc = engine.run(read(_one_against_many(n, odd, prefix))).root_cause
    assert rc.category == "conditional_collective", rc.summary
    assert rc.culprit.ranks == [odd]


def test_the_last_rank_entry_cut_by_the_paste_still_counts():
    text = _one_against_many(9, 8).rstrip(b"]\n") + b", HorovodAllreduce_grad_c_$\n"
    assert stall(read(text)).fields["missing"] == list(range(9))
    assert engine.run(read(text)).root_cause.culprit.ranks == [8]


_SHUTDOWN = (
    b"RuntimeError: Horovod has been shut down. This was caused by an exception on one of the ranks or an attempt"
    b" to allreduce, allgather or broadcast a tensor after one of the ranks finished execution. If the shutdown"
    b" was caused by an exception, you should see the exception in the log before the first shutdown message.\n"
)


def test_horovod_shut_down_with_no_exception_shown_is_a_rank_that_finished_early():
    rc = engine.run(read(b"[1,0]<stdout>:epoch 3 done\n" + _SHUTDOWN)).root_cause
    assert rc.category == "conditional_collective" and rc.culprit.ranks == [] and rc.confidence <= 0.5


def test_horovod_shut_down_after_a_rank_s_exception_is_not_read_as_an_uneven_split():
    crash = (
        b"[1,3]<stderr>:Traceback (most recent call last):\n"
        b'[1,3]<stderr>:  File "train.py", line 10, in <module>\n'
        b"[1,3]<stderr>:    step()\n"
        b"[1,3]<stderr>:ValueError: bad input\n"
    )
    rc = engine.run(read(crash + b"[1,0]<stderr>:" + _SHUTDOWN)).root_cause
    assert rc.category != "conditional_collective", rc.summary


def test_crossed_waits_with_a_rank_that_submitted_neither_are_still_crossed():
    # Rank 1 submitted one broadcast, ranks 2 and 3 another, rank 0 neither: ranks 1 and 2 each lack what the other
    # submitted, so no rank is merely late (the shape of conditional_collective__horovod-horovod-2662).
    text = CROSSED.split(b"[1,0]<stderr>:Stalled ranks:")[0] + (
        b"[1,0]<stderr>:Missing ranks:\n"
        b"[1,0]<stderr>:0: [broadcast.noname.11, broadcast.noname.12]\n"
        b"[1,0]<stderr>:1: [broadcast.noname.12]\n"
        b"[1,0]<stderr>:2: [broadcast.noname.11]\n"
        b"[1,0]<stderr>:3: [broadcast.noname.11]\n"
    )
    rc = engine.run(read(text)).root_cause
    assert rc.category == "conditional_collective", rc.summary
    assert rc.culprit.ranks == [] and "crossed waits" in rc.summary
    # Every rank missing the same one tensor is still a late subset, not a crossing.
    same = text.replace(b"1: [broadcast.noname.12]", b"1: [broadcast.noname.11]")
    assert engine.run(read(same)).root_cause.category != "conditional_collective" or "crossed" not in (
        engine.run(read(same)).root_cause.summary
    )
