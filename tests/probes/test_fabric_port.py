"""A network finding names the fabric port its lines are about, as the ibstat ports are named (`host:ca/port`).

NCCL's IB transport (src/transport/net_ib.cc) names the HCA and port of an async event (`NET/IB : mlx5_2:1 Got
non-fatal async event: port error`); iproute2's `rdma link show` names each port as `link mlx5_1/1 state ...`. The
lines below are in those formats, with made-up hosts and pids.
"""

from __future__ import annotations

from hangdx.playbooks import engine
from hangdx.probes import reader
from hangdx.probes.model import Evidence, Source


def _verdict(text: str):
    ev = Evidence()
    reader.read_text([text.encode()], Source("paste.txt"), ev)
    return engine.run(ev)


def test_an_nccl_port_error_names_its_host_and_port():
    rc = _verdict(
        "node7:1234:1290 [0] NCCL WARN NET/IB : mlx5_2:1 Got non-fatal async event: port error\n"
    ).root_cause
    assert rc.category == "network_fault"
    assert rc.culprit.hosts == ["node7"]
    assert rc.culprit.links == ["node7:mlx5_2/1"]


def test_rdma_link_show_names_the_port_that_is_down_not_those_up():
    text = (
        "link mlx5_0/1 state ACTIVE physical_state LINK_UP netdev ib0\n"
        "link mlx5_1/1 state DOWN physical_state POLLING netdev ib1\n"
    )
    rc = _verdict(text).root_cause
    assert rc.category == "network_fault"
    assert rc.culprit.links == ["mlx5_1/1"]
