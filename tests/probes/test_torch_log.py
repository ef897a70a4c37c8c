"""torch_log: PyTorch / torchrun stderr and rank logs.

Fixtures: tests/fixtures/torch_log/README.md. Most are real output of torch 2.13 gloo jobs recorded by
make_fixtures.py; the NCCL/CUDA ones are written from pytorch sources and logs in GitHub issues. Inline lines
below are quoted from: pytorch/pytorch #118369 (torch 2.1 watchdog line without Numel), hiyouga/LlamaFactory
#7396 (`[PG 1 Rank 0] Exception ... detected by watchdog at work`), vllm-project/vllm #6042 (`Timeout at NCCL
work`), sgl-project/sglang #1693 (`what(): [PG 3 Rank 5] ... _ALLGATHER_BASE`), pytorch TraceUtils.h
(`analyzeMissingRanks`), pytorch/pytorch #59778 (pre-2.1 OOM text).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from hangdx.probes import torch_log
from hangdx.probes.model import Evidence, Source
from hangdx.probes.registry import detect

FIX = Path(__file__).resolve().parent.parent / "fixtures" / "torch_log"
ALL = sorted(p.name for p in FIX.glob("*.log"))


def read(name: str) -> bytes:
    return (FIX / name).read_bytes()


def run(data: bytes, name: str = "stderr.log", **src) -> Evidence:
    ev = Evidence()
    torch_log.parse(data, Source(name, **src), ev)
    return ev


def one(ev: Evidence, kind: str):
    found = ev.events_of(kind)
    assert len(found) == 1, [e.quote.text for e in found]
    return found[0]


def root_cause(ev: Evidence):
    (r,) = [e for e in ev.events_of("torchrun_failure") if e.fields["root_cause"]]
    return r


@pytest.mark.parametrize("name", ALL)
def test_detected_by_content(name):
    assert detect(read(name)).KIND == "torch_log"


def test_collective_mismatch_real():
    ev = run(read("collective_mismatch_detail.log"))
    found = ev.events_of("collective_mismatch")
    assert [e.rank for e in found] == [1, 0]
    for e in found:
        assert e.fields["ranks"] == [0, 1]
        assert e.fields["per_rank"][0]["op"] == "allreduce" and e.fields["per_rank"][1]["op"] == "broadcast"
        assert e.fields["per_rank"][0]["seq"] == 3 == e.fields["per_rank"][1]["seq"]
        assert e.fields["per_rank"][1]["shapes"] == "[4]" and e.fields["per_rank"][1]["dtypes"] == "Float"
        assert "Op type" in e.fields["differences"]
        assert e.quote.text.startswith(f"[rank{e.rank}]: RuntimeError: Detected mismatch")
    exc = ev.events_of("exception")
    assert [(e.rank, e.fields["exc_type"]) for e in exc] == [(1, "RuntimeError"), (0, "RuntimeError")]
    assert any("distributed_c10d.py" in f and "in broadcast" in f for f in exc[0].fields["frames"])


def test_monitored_barrier_real():
    ev = run(read("monitored_barrier.log"))
    e = one(ev, "monitored_barrier_failed")
    assert e.rank == 0 and e.fields["ranks"] == [1, 2] and e.fields["timeout_ms"] == 3000
    assert "Ranks 1, 2 failed to pass monitoredBarrier in 3000 ms" in e.quote.text


def test_gloo_recv_timeout_real():
    ev = run(read("gloo_recv_timeout.log"))
    e = one(ev, "gloo_timeout")
    assert (e.rank, e.fields["op"], e.fields["timeout_ms"]) == (0, "recv", 5000)
    assert root_cause(ev).rank == 0


def test_peer_died_real():
    ev = run(read("gloo_peer_died.log"))
    e = one(ev, "connection_closed")
    assert (
        e.rank == 0 and e.fields["peer"].startswith("127.0.0.1:") and e.fields["reason"] == "closed by peer"
    )
    rc = root_cause(ev)
    assert (rc.rank, rc.fields["exitcode"], rc.fields["signal"]) == (1, 3, None)


def test_size_mismatch_real():
    ev = run(read("gloo_size_mismatch.log"))
    e = one(ev, "gloo_size_mismatch")
    assert (e.fields["received_bytes"], e.fields["expected_bytes"]) == (32, 16)
    reset = one(ev, "connection_closed")
    assert reset.rank == 1 and reset.fields["reason"] == "connection reset by peer"
    rc = root_cause(ev)
    assert (rc.rank, rc.fields["signal"], rc.fields["exitcode"]) == (0, "SIGABRT", -6)


@pytest.mark.parametrize(
    "name,names", [("ddp_unused_default.log", []), ("ddp_unused_info.log", ["fc2.bias", "fc2.weight"])]
)
def test_ddp_unused_parameters_real(name, names):
    ev = run(read(name))
    e = one(ev, "ddp_unused_parameters")
    assert e.rank == 1 and e.fields["param_indices"] == [2, 3] and e.fields["param_names"] == names
    assert "did not receive grad for rank 1" in e.quote.text
    exc = [x for x in ev.events_of("exception") if x.rank == 1][0]
    assert exc.fields["message"].startswith("Expected to have finished reduction in the prior iteration")
    assert "Parameter indices which did not receive grad for rank 1: 2 3" in exc.fields["message"]


def test_torchrun_sigkill_real():
    ev = run(read("torchrun_sigkill.log"), host="fallback-host")
    rc = root_cause(ev)
    assert (rc.rank, rc.fields["local_rank"], rc.fields["exitcode"], rc.fields["signal"]) == (
        1,
        1,
        -9,
        "SIGKILL",
    )
    assert rc.host == "localhost" and rc.pid == int(rc.quote.text.split("pid: ")[1].split(")")[0])
    assert "exitcode" in rc.quote.text
    other = [e for e in ev.events_of("torchrun_failure") if not e.fields["root_cause"]]
    assert [(e.rank, e.fields["signal"]) for e in other] == [(0, "SIGTERM")]
    exits = ev.events_of("process_exit")
    assert [e.fields["action"] for e in exits] == ["closing_signal", "failed"]
    assert exits[1].fields["exitcode"] == -9 and exits[1].fields["local_rank"] == 1
    assert not ev.events_of("exception")  # torchrun's own ChildFailedError is the summary, not a rank's error


def test_rank_exception_real():
    ev = run(read("rank_exception.log"))
    exc = ev.events_of("exception")
    assert [(e.rank, e.fields["exc_type"]) for e in exc] == [(1, "ValueError"), (0, "RuntimeError")]
    assert exc[0].fields["message"] == "corrupt sample in shard 2"
    assert exc[0].quote.text == "[rank1]: ValueError: corrupt sample in shard 2"
    assert exc[0].fields["frames"][-1].endswith(":11 in load_batch")
    assert root_cause(ev).rank == 1


def test_nccl_watchdog_and_desync():
    ev = run(read("nccl_watchdog_desync.log"))
    wd = ev.events_of("watchdog_timeout")
    assert [(e.rank, e.fields["seq"], e.fields["op"]) for e in wd] == [
        (0, 241, "allreduce"),
        (1, 241, "allreduce"),
    ]
    assert wd[0].fields["timeout_ms"] == 600000 and wd[0].fields["ran_ms"] == 600086
    assert wd[0].fields["numel_in"] == 6 and wd[0].fields["pg"] == "0" and wd[0].fields["repeats"] == 2
    recs = [c for c in ev.collectives if c.origin == "torch_log"]
    assert [(c.rank, c.seq, c.op, c.state, c.pg) for c in recs] == [
        (0, 241, "allreduce", "timed_out", "0"),
        (1, 241, "allreduce", "timed_out", "0"),
    ]
    d = one(ev, "desync_report")
    assert d.rank == 0 and d.fields["ranks"] == [7] and d.fields["not_joined"] == [7]
    assert (d.fields["timeout_op"], d.fields["timeout_seq"]) == ("allreduce", 315)
    assert "[7] finished collective #182, but didn't join collective #183" in d.quote.text
    assert {"seq": 317, "state": "started", "ranks": [3, 4, 5, 6], "op": "_ALLGATHER_BASE"} in d.fields[
        "snapshot"
    ]
    wp = ev.events_of("work_progress")
    assert [(e.rank, e.fields["last_enqueued"], e.fields["last_completed"]) for e in wp] == [
        (0, 315, 183),
        (1, 315, 183),
    ]
    rc = root_cause(ev)
    assert (rc.host, rc.rank, rc.fields["signal"]) == ("gpu-node-03", 0, "SIGABRT")


def test_cuda_oom():
    ev = run(read("cuda_oom_rank1.log"))
    e = one(ev, "cuda_oom")
    assert (e.rank, e.fields["gpu"], e.fields["tried_to_allocate"]) == (1, 1, "2.00 GiB")
    assert e.fields["tried_to_allocate_bytes"] == 2 << 30 and e.fields["total_capacity"] == "79.15 GiB"
    exc = one(ev, "exception")
    assert exc.fields["exc_type"] == "torch.OutOfMemoryError" and len(exc.fields["frames"]) == 4
    old = run(
        b"RuntimeError: CUDA out of memory. Tried to allocate 2.26 GiB (GPU 0; 6.00 GiB total capacity; "
        b"781.59 MiB already allocated; 3.03 GiB free; 1.24 GiB reserved in total by PyTorch)\n",
        rank=4,
    )
    e = one(old, "cuda_oom")
    assert (e.rank, e.fields["gpu"], e.fields["total_capacity"], e.fields["free"]) == (
        4,
        0,
        "6.00 GiB",
        "3.03 GiB",
    )


def test_older_and_other_watchdog_forms():
    text = "\n".join(
        [
            "[E ProcessGroupNCCL.cpp:458] [Rank 7] Watchdog caught collective operation timeout: "
            "WorkNCCL(SeqNum=64088, OpType=ALLREDUCE, Timeout(ms)=1800000) ran for 25625251 milliseconds before timing out.",
            "[rank0]:[E321 02:07:08.465150152 ProcessGroupNCCL.cpp:1664] [PG 1 Rank 0] Exception (either an error or "
            "timeout) detected by watchdog at work: 1580, last enqueued NCCL work: 1582, last completed NCCL work: 1579.",
            "(RayWorkerWrapper pid=4009) [rank1]:[E ProcessGroupNCCL.cpp:1537] [PG 1 Rank 1] Timeout at NCCL work: "
            "158046, last enqueued NCCL work: 158046, last completed NCCL work: 158045.",
            "  what():  [PG 3 Rank 5] Process group watchdog thread terminated with exception: [Rank 5] Watchdog caught "
            "collective operation timeout: WorkNCCL(SeqNum=9141, OpType=_ALLGATHER_BASE, NumelIn=19008, "
            "NumelOut=152064, Timeout(ms)=600000) ran for 600020 milliseconds before timing out.",
            "[E ProcessGroupNCCL.cpp:475] [Rank 0] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=4, "
            "OpType=BROADCAST, Timeout(ms)=1800000) ran for 1800859 milliseconds before timing out.",
            "\t - [0] Timeout at collective: BROADCAST, #4",
            "\t - To our best knowledge, ranks [1, 2] are the lagging ranks that caused this timeout. "
            "They never joined any collectives",
        ]
    )
    ev = run(text.encode())
    wd = ev.events_of("watchdog_timeout")
    assert [(e.rank, e.fields["seq"], e.fields["op"], e.fields["pg"]) for e in wd] == [
        (7, 64088, "allreduce", None),
        (5, 9141, "allgather", "3"),
        (0, 4, "broadcast", None),
    ]
    assert wd[0].fields["numel_in"] is None and wd[1].fields["numel_out"] == 152064
    wp = ev.events_of("work_progress")
    assert [
        (e.rank, e.fields["at_work"], e.fields["last_enqueued"], e.fields["last_completed"], e.fields["pg"])
        for e in wp
    ] == [
        (0, 1580, 1582, 1579, "1"),
        # The parser alone does not take Ray's prefix off, so `[rank1]:` is not at the line's start; `[PG 1 Rank 1]`
        # is PG 1's own rank, not the job's. (Through the reader, whose normaliser takes both prefixes off: rank 1.)
        (None, 158046, 158046, 158045, "1"),
    ]
    d = one(ev, "desync_report")
    assert d.fields["never_joined"] == [1, 2] and d.fields["ranks"] == [1, 2] and d.rank == 0


def test_plain_python_traceback_is_a_weak_torch_log():
    tb = (
        b"Traceback (most recent call last):\n"
        b'  File "/app/train.py", line 3, in <module>\n'
        b"    main()\n"
        b'  File "/app/train.py", line 2, in main\n'
        b"    raise KeyError('x')\n"
        b"KeyError: 'x'\n"
    )
    assert torch_log.sniff(tb) == 20
    assert detect(tb).KIND == "torch_log"
    e = one(run(tb, rank=6), "exception")
    assert (e.rank, e.fields["exc_type"], e.fields["message"], e.quote.line) == (6, "KeyError", "'x'", 6)
    assert e.fields["frames"] == ["/app/train.py:3 in <module>", "/app/train.py:2 in main"]


def test_torch_dominant_file_keeps_its_nccl_lines():
    data = read("nccl_watchdog_desync.log") + (
        b"gpu-node-03:88130:88130 [0] NCCL INFO AllReduce: opCount f0 sendbuff 0x1 recvbuff 0x1 count 6 "
        b"datatype 7 op 0 root 0 comm 0x55e290bd32d0 [nranks=8] stream 0x2\n"
    )
    assert detect(data).KIND == "torch_log"
    ev = run(data)
    (nccl,) = [c for c in ev.collectives if c.origin == "nccl_log"]
    assert nccl.seq == 0xF0 and nccl.host == "gpu-node-03"


def test_bad_input_never_raises():
    for data in (
        b"",
        b"\x00\x01\x02" * 500,
        b"garbage \xff\xfe not a log\n" * 20,
        read("ddp_unused_info.log")[:1500],
    ):
        ev = run(data)
        assert isinstance(ev.events, list)
    assert torch_log.sniff(b"") == 0
    assert torch_log.sniff(b"hello world\nthis is not a log\n" * 10) == 0
    assert torch_log.sniff(b"\x00\x01binary" * 100) == 0
    cut = read("rank_exception.log")
    cut = cut[: cut.index(b"ValueError: corrupt") + 15]
    e = [x for x in run(cut).events_of("exception") if x.rank == 1][0]
    assert e.fields["exc_type"] == "ValueError" and e.fields["message"] == "cor"


_FLAT_TABLE = """\
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
train.py FAILED
Failures:
<NO OTHER FAILURES>
Root Cause (first observed failure) :
[0]:
time
host
2024-01-02 03:04:05
node-a17
rank{rank} (local rank: {local})exitcode: -9 (pid: 4711)error file: <N/A>
traceback : signal 9 (SIGKILL) received by PID 4711
"""


@pytest.mark.parametrize("rank,local", [(2, 2), (13, 5), (0, 0)])
def test_a_flattened_failure_table_still_names_rank_host_and_signal(rank, local):
    # torchrun's table as it arrives from a rendered copy: labels alone, values later, fields run together
    r = root_cause(run(_FLAT_TABLE.format(rank=rank, local=local).encode()))
    f = r.fields
    assert (r.rank, f["local_rank"], f["exitcode"], r.pid, r.host) == (rank, local, -9, 4711, "node-a17")
    assert f["signal"] == "SIGKILL"


def test_a_flattened_table_entry_ends_at_an_unrelated_line():
    text = "Root Cause (first observed failure):\n[0]:\nall done, training resumed\nrank 3 says hello\n"
    assert [e for e in run(text.encode()).events_of("torchrun_failure")] == []
