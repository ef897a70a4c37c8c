"""`nvidia-smi topo -m`: the GPU pairs' paths are read, and a job whose GPUs reach each other only over PCIe and
that never completed a collective points at GPU peer-to-peer through PCIe (ACS, IOMMU), NCCL's documented cause."""

from __future__ import annotations

import io

from hangdx.playbooks import engine
from hangdx.probes.model import Evidence, Source
from hangdx.probes.reader import read_any

# NVIDIA/nccl #2079, as the reporter pasted it (two GPUs on one NUMA node's host bridges).
PCIE = """\
        GPU0    GPU1    CPU Affinity    NUMA Affinity
GPU0     X      NODE    0-63            0
GPU1    NODE     X      0-63            0
"""
# The same tool's layout on a machine whose GPUs are joined by NVLink (nvidia-smi's own column and legend names).
NVLINK = """\
        GPU0    GPU1    GPU2    GPU3    NIC0    CPU Affinity    NUMA Affinity   GPU NUMA ID
GPU0     X      NV12    NV12    NV12    PXB     0-47    0               N/A
GPU1    NV12     X      NV12    NV12    PXB     0-47    0               N/A
GPU2    NV12    NV12     X      NV12    SYS     48-95   1               N/A
GPU3    NV12    NV12    NV12     X      SYS     48-95   1               N/A
"""
FIRST_TIMEOUT = (
    "[E ProcessGroupNCCL.cpp:828] [Rank 1] Watchdog caught collective operation timeout: WorkNCCL(SeqNum={seq}, "
    "OpType=ALLREDUCE, Timeout(ms)=1800000) ran for 1802710 milliseconds before timing out.\n"
)


def read(text: str) -> tuple[Evidence, object]:
    ev = Evidence()
    read_any(io.BytesIO(text.encode()), Source("paste.log"), ev)
    return ev, engine.run(ev)


def test_the_matrix_is_read_pair_by_pair_and_nic_columns_are_not_gpus():
    ev, _ = read(NVLINK)
    (topo,) = ev.events_of("gpu_topology")
    assert topo.fields["gpus"] == 4
    assert topo.fields["nvlink"] is True
    assert "0-1:NV12" in topo.fields["paths"] and len(topo.fields["paths"]) == 6  # 4 GPUs: 6 pairs, no NIC


def test_pcie_only_gpus_alone_are_a_low_suspicion_of_peer_to_peer_not_a_refusal():
    _, v = read(PCIE)
    rc = v.root_cause
    assert rc.category == "gpu_fault"
    assert rc.confidence <= 0.3
    assert "GPU0-GPU1 NODE" in rc.summary
    assert "NCCL_P2P_DISABLE=1" in rc.fix


def test_pcie_only_gpus_and_a_first_collective_that_never_completed_raise_it():
    _, v = read(PCIE + FIRST_TIMEOUT.format(seq=1))
    assert v.root_cause.category == "gpu_fault"
    assert 0.3 < v.root_cause.confidence < 0.6


def test_a_job_past_its_first_collectives_or_on_nvlink_is_not_blamed_on_the_peer_path():
    for text in (PCIE + FIRST_TIMEOUT.format(seq=4181), NVLINK + FIRST_TIMEOUT.format(seq=1)):
        _, v = read(text)
        assert "pcie_peer_path" not in {f.playbook for f in v.findings}
