"""Flight Recorder dumps -> CollectiveRecords.

Fixtures (tests/fixtures/flight_recorder/, see its README.md):
- gloo_rank{0..3}.pkl/.json: real dumps from torch 2.13.0 on this machine (make_gloo_dumps.py), rank 2 skipped
  the default group's all_reduce seq 8 that ranks 0, 1, 3 issued with async_op=True.
- nccl_trace_rank_{0..3} (pickle) / .json: torch 2.13's NCCL dump schema, built by make_nccl_dumps.py from
  pytorch's FlightRecorder source and NCCLTraceTest; rank 3 never issued all_reduce seq 7.
"""

from __future__ import annotations

import json
import os
import pickle
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hangdx.probes import flight_recorder as fr
from hangdx.probes.model import Evidence, Source
from hangdx.probes.registry import detect, parse_artifact

FIX = Path(__file__).resolve().parent.parent / "fixtures" / "flight_recorder"
GLOO = [f"gloo_rank{r}.{ext}" for r in range(4) for ext in ("pkl", "json")]
NCCL = [f"nccl_trace_rank_{r}{ext}" for r in range(4) for ext in ("", ".json")]


def read(name: str, src: Source | None = None) -> Evidence:
    ev = Evidence()
    fr.parse((FIX / name).read_bytes(), src or Source(str(FIX / name)), ev)
    return ev


def default_pg(ev: Evidence):
    return [c for c in ev.collectives if c.pg == "0:default_pg"]


@pytest.mark.parametrize("name", GLOO + NCCL)
def test_detected_as_flight_recorder(name):
    data = (FIX / name).read_bytes()
    assert fr.sniff(data[:65536]) > 0
    assert detect(data).KIND == "flight_recorder"


@pytest.mark.parametrize("ext", ["pkl", "json"])
def test_gloo_rank0_records(ext):
    ev = read(f"gloo_rank0.{ext}")
    assert ev.gaps == []
    ops = [(c.pg, c.seq, c.op, c.state) for c in ev.collectives]
    assert ops == [
        ("0:default_pg", 1, "allreduce", "completed"),
        ("0:default_pg", 2, "allreduce", "completed"),
        ("0:default_pg", 3, "allreduce", "completed"),
        ("0:default_pg", 4, "broadcast", "completed"),
        ("0:default_pg", 5, "allgather", "completed"),
        ("0:default_pg", 6, "alltoall", "completed"),
        ("0:default_pg", 7, "barrier", "completed"),
        ("1:pair01", 1, "allreduce", "completed"),
        ("0:default_pg", 8, "allreduce", "scheduled"),  # never matched by rank 2
    ]
    assert {c.rank for c in ev.collectives} == {0}  # from the file name: gloo dumps hold no rank
    assert {c.origin for c in ev.collectives} == {"flight_recorder"}
    first, bcast, gather, barrier, last = (ev.collectives[i] for i in (0, 3, 4, 6, 8))
    assert (first.numel_in, first.numel_out, first.dtype, first.sizes) == (1000, 1000, "Float", [[1000]])
    assert (bcast.dtype, bcast.numel_in) == ("Long", 64)
    assert (gather.numel_in, gather.numel_out) == (16, 64)  # [[16]] -> [[4, 16]] on 4 ranks
    assert (barrier.numel_in, barrier.dtype) == (0, None)
    raw = pickle.loads((FIX / "gloo_rank0.pkl").read_bytes())["entries"][8]["time_created_ns"]
    assert last.time == pytest.approx(raw / 1e9) and last.time > first.time
    assert last.quote.line == 9
    assert last.quote.text == "#8 pg=0:default_pg seq=8 gloo:all_reduce state=scheduled in=[[1000]] Float"
    assert (
        first.quote.text
        == "#0 pg=0:default_pg seq=1 gloo:all_reduce state=scheduled retired in=[[1000]] Float"
    )


def test_gloo_skipping_rank_is_one_seq_behind():
    last = {}
    for r in range(4):
        for ext in ("pkl", "json"):
            recs = default_pg(read(f"gloo_rank{r}.{ext}"))
            last[r, ext] = (recs[-1].seq, recs[-1].state)
    for ext in ("pkl", "json"):
        assert last[0, ext] == last[1, ext] == last[3, ext] == (8, "scheduled")
        assert last[2, ext] == (7, "completed")


def test_gloo_pickle_and_json_agree():
    for r in range(4):
        a, b = read(f"gloo_rank{r}.pkl"), read(f"gloo_rank{r}.json")

        def key(c):
            return (c.rank, c.op, c.seq, c.pg, c.state, c.numel_in, c.numel_out, c.dtype, c.sizes, c.time)

        assert [key(c) for c in a.collectives] == [key(c) for c in b.collectives]
        assert [c.quote.text for c in a.collectives] == [c.quote.text for c in b.collectives]


def test_gloo_dump_events():
    ev = read("gloo_rank2.pkl")
    (dump,) = ev.events_of("fr_dump")
    f = dump.fields
    assert dump.rank == 2
    assert (f["rank"], f["backend"], f["version"], f["format"], f["entries"]) == (
        2,
        "gloo",
        "2.10",
        "pickle",
        7,
    )
    assert (f["pg"], f["last_completed_seq"], f["last_started_seq"], f["pending_seqs"]) == (
        "0:default_pg",
        7,
        7,
        [],
    )
    assert f["pg_status"] == {"0": {"last_enqueued": 7, "last_started": -1, "last_completed": 7}}
    (st_ev,) = ev.events_of("fr_pg_status")
    assert st_ev.fields["pg"] == "0:default_pg"
    assert (st_ev.fields["last_enqueued"], st_ev.fields["last_started"], st_ev.fields["last_completed"]) == (
        7,
        -1,
        7,
    )

    ev0 = read("gloo_rank0.json")
    f0 = ev0.events_of("fr_dump")[0].fields
    assert (f0["last_completed_seq"], f0["last_started_seq"], f0["pending_seqs"]) == (7, 8, [8])
    assert f0["pgs"]["1:pair01"]["last_completed_seq"] == 1
    # JSON pg_status values are strings; they come out as ints like the pickle's.
    assert f0["pg_status"]["0"] == {"last_enqueued": 9, "last_started": -1, "last_completed": 7}
    assert [e.fields["pg"] for e in ev0.events_of("fr_pg_status")] == ["0:default_pg", "1:pair01"]


def test_rank_from_content_and_caller():
    data = json.loads((FIX / "gloo_rank1.json").read_bytes())
    data["rank"] = 5  # the debug server adds "rank"; content wins over the file name
    ev = Evidence()
    fr.parse(json.dumps(data).encode(), Source("gloo_rank1.json", rank=1), ev)
    assert {c.rank for c in ev.collectives} == {5}
    ev = Evidence()
    fr.parse((FIX / "gloo_rank1.pkl").read_bytes(), Source("node7/dump", host="node7", rank=3), ev)
    assert {(c.rank, c.host) for c in ev.collectives} == {(3, "node7")}
    ev = Evidence()
    fr.parse((FIX / "gloo_rank1.pkl").read_bytes(), Source("/tmp/trace_12"), ev)  # <prefix><rank>
    assert {c.rank for c in ev.collectives} == {12}


@pytest.mark.parametrize("ext", ["", ".json"])
def test_nccl_records(ext):
    ev = read(f"nccl_trace_rank_0{ext}")
    assert ev.gaps == []
    assert ev.world_size == 4  # from pg_config "0": ranks "[0, 1, 2, 3]"
    got = [(c.op, c.seq, c.state) for c in ev.collectives]
    assert got == [
        ("broadcast", 1, "completed"),
        ("barrier", 2, "completed"),  # nccl:all_reduce_barrier
        ("allreduce", 3, "completed"),
        ("allreduce", 4, "completed"),
        ("send", 1, "completed"),  # p2p: seq is p2p_seq_id
        ("allgather", 5, "completed"),  # nccl:_all_gather_base
        ("reducescatter", 6, "completed"),  # nccl:_reduce_scatter_base
        ("allreduce", 7, "started"),
    ]
    ag = ev.collectives[5]
    assert (ag.numel_in, ag.numel_out, ag.dtype) == (1048576, 4194304, "BFloat16")
    assert ev.collectives[4].quote.text.startswith(
        "#4 pg=0:default_pg p2p_seq=1 nccl:send 0->1 state=completed"
    )
    (dump,) = ev.events_of("fr_dump")
    f = dump.fields
    assert (f["backend"], f["version"], f["comm_lib_version"]) == ("nccl", "2.10", "2.27.5")
    assert (f["last_completed_seq"], f["last_started_seq"], f["pending_seqs"]) == (6, 7, [7])
    assert f["pg_ranks"] == {"0": [0, 1, 2, 3]}


def test_nccl_missing_rank_and_recv():
    last = {r: default_pg(read(f"nccl_trace_rank_{r}"))[-1] for r in range(4)}
    assert [(last[r].op, last[r].seq, last[r].state) for r in range(3)] == [("allreduce", 7, "started")] * 3
    assert (last[3].seq, last[3].state) == (6, "completed")
    recv = [c for c in read("nccl_trace_rank_1.json").collectives if c.op == "recv"]
    assert [(c.rank, c.seq, c.numel_in) for c in recv] == [(1, 1, 8192)]


def test_nccl_retired_but_not_completed_is_timed_out():
    d = pickle.loads((FIX / "nccl_trace_rank_0").read_bytes())
    d["entries"][-1]["retired"] = True  # the watchdog retired it without the kernel finishing
    ev = Evidence()
    fr.parse(pickle.dumps(d, protocol=2), Source("nccl_trace_rank_0"), ev)
    assert ev.collectives[-1].state == "timed_out"


def test_old_and_partial_versions():
    # The first format was a bare list of entries; older entries say seq_id; keys may be missing.
    old = [{"profiling_name": "nccl:all_reduce", "seq_id": 41, "state": "completed", "input_sizes": [[2, 3]]}]
    ev = Evidence()
    fr.parse(pickle.dumps(old, protocol=2), Source("dump_rank_6"), ev)
    (c,) = ev.collectives
    assert (c.rank, c.op, c.seq, c.state, c.numel_in, c.pg, c.dtype) == (
        6,
        "allreduce",
        41,
        "completed",
        6,
        None,
        None,
    )
    ev = Evidence()
    fr.parse(
        json.dumps({"version": "2.10", "pg_config": {}, "pg_status": {}}).encode(), Source("x_rank_1"), ev
    )
    assert ev.collectives == [] and ev.gaps == []
    assert ev.events_of("fr_dump")[0].fields["entries"] == 0


def test_op_names():
    n = fr.normalize_op
    assert [n("all_reduce"), n("all_reduce_barrier"), n("_all_gather_base"), n("all_gather_into_tensor")] == [
        "allreduce",
        "barrier",
        "allgather",
        "allgather",
    ]
    assert [n("reduce_scatter_single"), n("all_to_all_single"), n("send 0->1"), n("recv 1<-0")] == [
        "reducescatter",
        "alltoall",
        "send",
        "recv",
    ]
    assert [n("allreduce_coalesced"), n("ALLGATHER_coalesced"), n("coalesced"), n("gather")] == [
        "allreducecoalesced",
        "allgathercoalesced",
        "coalesced",
        "gather",
    ]


class _Evil:
    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_hostile_pickle_is_not_executed(tmp_path):
    marker = tmp_path / "pwned"
    evil = _Evil()
    evil.marker = marker
    payload = pickle.dumps({"version": "2.10", "pg_config": {}, "entries": [evil]}, protocol=2)
    assert fr.sniff(payload) > 0  # it looks like a dump...
    ev = Evidence()
    fr.parse(payload, Source("evil_rank0.pkl"), ev)  # ...but must not run
    assert not marker.exists()
    assert ev.collectives == []
    assert len(ev.gaps) == 1 and "refused" in ev.gaps[0].message and "system" in ev.gaps[0].message


def test_pickle_protocol0_global_is_refused(tmp_path):
    marker = tmp_path / "pwned0"
    payload = f"cos\nsystem\n(Vtouch {marker}\ntR.".encode()
    ev = Evidence()
    fr.parse(b"\x80\x02" + payload, Source("x"), ev)  # GLOBAL os.system behind a protocol 2 header
    fr.parse(payload, Source("y"), ev)  # protocol 0: no header, read as (bad) JSON
    assert not marker.exists()
    assert ev.collectives == [] and len(ev.gaps) == 2


@pytest.mark.parametrize(
    "data",
    [
        b"",
        b"\x80",
        b"\x80\x02",
        (FIX / "gloo_rank0.pkl").read_bytes()[:1200],  # truncated pickle
        (FIX / "gloo_rank0.json").read_bytes()[:1200],  # truncated JSON
        b"[1, 2, 3]",  # JSON list
        b'{"hello": "world"}',
        b'{"entries": 5, "version": "2.10"}',
        b'{"entries": [1, "x", null, {"profiling_name": 7, "input_sizes": "nope"}], "version": 2}',
        b"\x00\x01\x02garbage\xff\xfe" * 50,
        "κόσμε not json".encode(),
        pickle.dumps("a string", protocol=2),
        pickle.dumps([1, 2, 3], protocol=4),
    ],
)
def test_bad_input_never_raises(data):
    ev = Evidence()
    fr.parse(data, Source("bad_rank0"), ev)
    assert all(c.op for c in ev.collectives)
    assert ev.gaps or ev.events_of("fr_dump")


def test_bad_input_details():
    ev = Evidence()
    fr.parse(b"[1, 2, 3]", Source("list.json"), ev)
    assert ev.collectives == [] and "list" in ev.gaps[0].message
    ev = Evidence()
    fr.parse((FIX / "gloo_rank0.pkl").read_bytes()[:1200], Source("cut.pkl"), ev)
    assert ev.collectives == [] and "unreadable pickle" in ev.gaps[0].message
    ev = Evidence()
    assert parse_artifact(b"[1, 2, 3]", Source("list.json"), ev, kind="flight_recorder") == "flight_recorder"
    assert ev.collectives == [] and ev.gaps


@pytest.mark.parametrize(
    "head",
    [
        b"",
        b"\x00\x01\x02garbage\xff" * 20,
        b"hello world\n",
        pickle.dumps({"a": 1, "b": [1, 2]}, protocol=2),
        b'{"traceEvents": [], "version": 1}',
        b"[rank0]: Traceback (most recent call last):\n",
        b"node1:123:456 [0] NCCL INFO Channel 00/02 : 0 1\n",
    ],
)
def test_sniff_rejects_other_content(head):
    assert fr.sniff(head) == 0


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=400))
def test_fuzz_never_raises(blob):
    for data in (blob, b"\x80\x02" + blob, b'{"entries": [' + blob):
        fr.sniff(data)
        fr.parse(data, Source("fuzz"), Evidence())
