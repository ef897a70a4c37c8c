"""nccl_log: NCCL_DEBUG output.

Formats: tests/fixtures/nccl_log/README.md says where each fixture's lines come from (NCCL sources and
logs in NVIDIA/nccl issues). The inline lines below are quoted from: NVIDIA/nccl #1814 (2.21-2.28
`status=12 opcode=129 len=65536 vendor err 129` form), #1193 (Ray-prefixed collective line), master's
net_ib/p2p.cc and debug.cc (2.30 `(function)` WARN form and `status=NAME(N)` form).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from hangdx.probes import nccl_log
from hangdx.probes.model import Evidence, Source
from hangdx.probes.registry import detect

FIX = Path(__file__).resolve().parent.parent / "fixtures" / "nccl_log"


def read(name: str) -> bytes:
    return (FIX / name).read_bytes()


def run(data: bytes, name: str = "nccl.log", **src) -> Evidence:
    ev = Evidence()
    nccl_log.parse(data, Source(name, **src), ev)
    return ev


def one(ev: Evidence, kind: str):
    found = ev.events_of(kind)
    assert len(found) == 1, [e.quote.text for e in found]
    return found[0]


@pytest.mark.parametrize(
    "name",
    [
        "ib_completion_error_2.18.log",
        "ib_status_2.29.log",
        "single_node_2.27.log",
        "socket_connect_refused.log",
    ],
)
def test_detected_by_content(name):
    assert detect(read(name)).KIND == "nccl_log"
    assert nccl_log.sniff(read(name)) >= 60


def test_collectives_2_18_multinode():
    ev = run(read("ib_completion_error_2.18.log"))
    colls = ev.collectives
    assert [c.op for c in colls] == [
        "broadcast",
        "allreduce",
        "allreduce",
        "allreduce",
        "allgather",
        "reducescatter",
    ]
    assert [c.seq for c in colls] == [0, 1, 0x139C, 0x139D, 0x139E, 0x139F]
    assert {c.rank for c in colls} == {5}  # from "comm 0x55d4c8a1e2b0 rank 5 nranks 8 ... Init COMPLETE"
    assert {c.pg for c in colls} == {"0x55d4c8a1e2b0"}
    assert {c.host for c in colls} == {"gpu-node-02"}
    assert all(c.origin == "nccl_log" for c in colls)
    assert colls[2].numel_in == 7382228 and colls[2].dtype == "bfloat16"
    assert colls[4].dtype == "float16" and colls[0].dtype == "float32"
    q = colls[3].quote
    assert q.line == 22 and q.source == "nccl.log"
    assert q.text == (FIX / "ib_completion_error_2.18.log").read_text().splitlines()[21]
    assert "gpu-node-02" in ev.hosts


def test_ib_completion_error_old_form():
    ev = run(read("ib_completion_error_2.18.log"))
    e = one(ev, "nccl_ib_completion_error")
    assert e.fields["peer"] == "10.1.2.11<45678>"
    assert e.fields["error"] == 12
    assert e.fields["status"] == "IBV_WC_RETRY_EXC_ERR"
    assert e.fields["status_text"] == "transport retry counter exceeded"
    assert e.fields["opcode"] == 0 and e.fields["vendor_err"] == 129
    assert e.fields["direction"] == "Recv"
    assert (e.host, e.pid, e.rank) == ("gpu-node-02", 41822, 5)
    assert e.quote.line == 26 and "NCCL WARN NET/IB : Got completion" in e.quote.text
    port = one(ev, "nccl_port_error")
    assert port.fields["event"] == "port error" and port.rank == 5
    nets = ev.events_of("nccl_net")
    assert any(n.fields["transport"] == "IB" and "mlx5_0:1/IB" in (n.fields["devices"] or "") for n in nets)
    assert any(
        n.fields.get("setting") == "NCCL_SOCKET_IFNAME" and n.fields["devices"] == "eth0" for n in nets
    )
    init = [e for e in ev.events_of("nccl_init") if e.fields.get("complete")]
    assert init[0].fields["comm"] == "0x55d4c8a1e2b0" and init[0].fields["nranks"] == 8
    assert init[0].fields["cuda_dev"] == 1 and init[0].fields["comm_id"] == "0x9f2c4e1a7d3b5608"
    assert not ev.events_of("nccl_warn")  # both WARN lines were understood


def test_ib_status_form_2_29_with_rank_prefix_and_timestamps():
    ev = run(read("ib_status_2.29.log"))
    e = one(ev, "nccl_ib_completion_error")
    assert e.fields["status"] == "IBV_WC_RETRY_EXC_ERR" and e.fields["error"] == 12
    assert e.fields["opcode"] == 128 and e.fields["opcode_name"] == "IBV_WC_RECV"
    assert e.fields["vendor_err"] == 129 and e.fields["hca"] == "mlx5_4"
    assert e.fields["peer"] == "10.20.0.8<52311>" and e.fields["timestamp"] == "2025-09-14 03:12:44"
    assert (e.rank, e.host) == (12, "gpu-node-07")
    ports = ev.events_of("nccl_port_error")
    assert [(p.fields["hca"], p.fields["port"], p.fields["event"]) for p in ports] == [
        ("mlx5_4", 1, "port error"),
        ("mlx5_4", 1, "port active"),
        ("mlx5_4", 1, "GID table change"),
    ]
    assert ports[0].fields["event_code"] == 10
    closed = one(ev, "nccl_conn_refused")
    assert closed.fields["peer"] == "gpu-node-03<41273>"
    colls = ev.collectives
    assert [(c.op, c.seq) for c in colls] == [
        ("allreduce", 42),
        ("allreduce", 43),
        ("send", 44),
        ("recv", 44),
    ]
    assert {c.rank for c in colls} == {12}
    assert colls[2].sizes["root"] == 13  # the peer of a Send


def test_single_node_2_27_opcount_is_unknown_not_zero():
    ev = run(read("single_node_2.27.log"))
    assert len(ev.collectives) == 5
    assert all(c.seq is None for c in ev.collectives)
    assert [c.rank for c in ev.collectives] == [0, 1, 0, 1, 0]
    inits = [e for e in ev.events_of("nccl_init") if e.fields.get("comm")]
    assert {(e.rank, e.fields["nnodes"], e.fields["version"]) for e in inits} == {
        (0, 1, "2.27.3+cuda12.9"),
        (1, 1, "2.27.3+cuda12.9"),
    }
    nets = ev.events_of("nccl_net")
    assert {n.fields["transport"] for n in nets} == {"Socket"}


def test_all_zero_opcounts_without_version_are_unknown():
    line = (
        "ip-172-31-54-74:30125:30125 [0] NCCL INFO AllReduce: opCount 0 sendbuff 0x7fc9c4000000 recvbuff "
        "0x7fc9bc000000 count 33554432 datatype 7 op 0 root 0 comm 0x5631f0816b40 [nranks=1] stream 0x5631f0021140 "
    )
    ev = run(("\n".join([line] * 4) + "\n").encode())
    assert [c.seq for c in ev.collectives] == [None] * 4
    ev = run((line + "\n").encode())
    assert ev.collectives[0].seq == 0  # one line proves nothing


def test_bare_version_line_and_2_27_multinode_keeps_opcount():
    text = (
        "NCCL version 2.27.3+cuda12.9\n"
        "n1:7:7 [0] NCCL INFO comm 0x5600 rank 0 nRanks 16 nNodes 2 localRanks 8 localRank 0 MNNVL 0\n"
        "n1:7:7 [0] NCCL INFO AllReduce: opCount 5 sendbuff 0x1 recvbuff 0x1 count 8 datatype 7 op 0 root 0 "
        "comm 0x5600 [nranks=16] stream 0x2\n"
    )
    ev = run(text.encode())
    assert ev.collectives[0].seq == 5 and ev.collectives[0].rank == 0


def test_socket_connect_refused():
    ev = run(read("socket_connect_refused.log"), host="worker-1")
    refused = ev.events_of("nccl_conn_refused")
    assert [r.fields["peer"] for r in refused] == [None, None, "10.0.3.20<39117>"]
    assert all(r.fields["error"] == "Connection refused" for r in refused)
    assert refused[0].fields["retrying"] and not refused[2].fields["retrying"]
    t = one(ev, "nccl_timeout")
    assert "exceeded timeouts (20)" in t.fields["message"]
    w = one(ev, "nccl_warn")
    assert w.fields["message"].startswith("Attempt to use communicator") and w.quote.line == 16


def test_other_real_line_forms():
    text = "\n".join(
        [
            # 2.21-2.28 (NVIDIA/nccl #1814, from a net plugin)
            "hostname-test:984:1357 [4] ib_plugin.c:1615 NCCL WARN NET/IB : Got completion from peer "
            "172.36.143.59<44206> with status=12 opcode=129 len=65536 vendor err 129 (Recv) "
            "localGid ::ffff:29.87.88.182 remoteGids::ffff:29.87.4.221",
            # master: "file:line (function)" and named status/opcode
            "gpu7:11:12 [0] transport/net_ib/p2p.cc:688 (ncclIbLogCompletionWithError) NCCL WARN NET/IB: Got "
            "completion from peer 10.0.0.1<1234> with status=IBV_WC_REM_ACCESS_ERR(10) "
            "opcode=IBV_WC_RDMA_WRITE(1) vendor_err=136  localGid ::ffff:10.0.0.2 remoteGids::ffff:10.0.0.1 hca mlx5_0",
            # Ray's prefix (NVIDIA/nccl #1193)
            "(RayTrainWorker pid=615, ip=10.72.7.6) r24-worker-l4-8-fqztx:615:18953 [2] NCCL INFO AllReduce: "
            "opCount 139d sendbuff 0x78d056200000 recvbuff 0x78d056200000 count 7382228 datatype 7 op 0 root 0 "
            "comm 0x78cfda045840 [nranks=128] stream 0x78d07125e5e0",
            "n1:5:6 [0] NCCL INFO NET/IB : mlx5_2:1 Got async event : port error",
            "n1:5:6 [0] NCCL INFO 2 coll channels, 2 p2p channels",
        ]
    )
    ev = run(text.encode(), rank=3)
    a, b = ev.events_of("nccl_ib_completion_error")
    assert (a.fields["error"], a.fields["opcode"], a.fields["len"], a.fields["vendor_err"]) == (
        12,
        129,
        65536,
        129,
    )
    assert a.fields["local_gid"] == "::ffff:29.87.88.182" and a.fields["remote_gid"] == "::ffff:29.87.4.221"
    assert a.rank == 3  # from Source: no init line names it
    assert (b.fields["status"], b.fields["error"], b.fields["status_text"]) == (
        "IBV_WC_REM_ACCESS_ERR",
        10,
        "remote access error",
    )
    assert b.fields["opcode_name"] == "IBV_WC_RDMA_WRITE" and b.fields["hca"] == "mlx5_0"
    (c,) = ev.collectives
    assert (c.host, c.seq, c.numel_in, c.rank) == ("r24-worker-l4-8-fqztx", 0x139D, 7382228, 3)
    assert not ev.events_of("nccl_port_error")  # an INFO line is not NCCL's async-event WARN


def test_mixed_file_goes_to_dominant_content_and_loses_nothing():
    coll = (
        "[rank0]:gpu1:13135:13922 [0] NCCL INFO AllReduce: opCount {n:x} sendbuff 0x1 recvbuff 0x1 count 64 "
        "datatype 7 op 0 root 0 comm 0x7f0c741162f0 [nranks=2] stream 0x7f0c74002f00"
    )
    watchdog = (
        "[rank0]:[E626 06:24:44.903881913 ProcessGroupNCCL.cpp:616] [Rank 0] Watchdog caught collective operation "
        "timeout: WorkNCCL(SeqNum=30, OpType=ALLREDUCE, NumelIn=64, NumelOut=64, Timeout(ms)=600000) ran for "
        "600020 milliseconds before timing out."
    )
    data = ("\n".join([coll.format(n=n) for n in range(30)] + [watchdog]) + "\n").encode()
    assert detect(data).KIND == "nccl_log"
    ev = run(data)
    assert len(ev.collectives) == 31  # 30 from NCCL, 1 timed_out from the watchdog line
    assert one(ev, "watchdog_timeout").fields["seq"] == 30


def test_bad_input_never_raises():
    for data in (
        b"",
        b"\x00\x01\x02" * 500,
        b"garbage \xff\xfe not a log\n" * 20,
        read("single_node_2.27.log")[:777],
    ):
        ev = run(data)
        assert isinstance(ev.collectives, list)
    assert nccl_log.sniff(b"") == 0
    assert nccl_log.sniff(b"hello world\nthis is not NCCL\n" * 10) == 0
    assert nccl_log.sniff(b"\x00\x01binary" * 100) == 0
    truncated = read("ib_completion_error_2.18.log")
    cut = truncated[: truncated.index(b"count 7382228") + 5]  # mid-line
    ev = run(cut)
    assert [c.seq for c in ev.collectives] == [0, 1]  # the cut line is not half-read
