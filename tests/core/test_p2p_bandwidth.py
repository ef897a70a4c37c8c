"""CUDA samples' p2pBandwidthLatencyTest: one GPU (or one pair) far slower than the others is a degraded GPU or link.

Fixtures in fixtures/p2p_bandwidth are copied verbatim from public reports (see its README).
"""

from __future__ import annotations

from pathlib import Path

from hangdx.playbooks import engine
from hangdx.probes.bundle import evidence_from_paths
from hangdx.probes.model import Evidence

FIX = Path(__file__).resolve().parent.parent / "fixtures" / "p2p_bandwidth"


def read(text: bytes) -> Evidence:
    return evidence_from_paths(["-"], stdin=text)


def p2p_findings(ev: Evidence):
    return [f for f in engine.run(ev).findings if f.playbook == "p2p_bandwidth"]


def test_the_matrices_are_read():
    ev = read((FIX / "nccl_814_uniform_pcie.txt").read_bytes())
    mats = ev.events_of("p2p_matrix")
    assert [(m.fields["direction"], m.fields["p2p"], m.fields["method"]) for m in mats] == [
        ("unidirectional", False, None), ("unidirectional", True, "writes"), ("unidirectional", True, "reads"),
    ]  # fmt: skip
    assert mats[1].fields["columns"] == [0, 1, 2, 3, 4, 5]
    assert mats[1].fields["rows"][2] == [10.01, 10.01, 922.24, 10.01, 10.01, 10.01]
    head = read((FIX / "tinygrad_44_two_gpus.txt").read_bytes()).events_of("p2p_matrix")[0]
    assert head.fields["devices"][1] == {"name": "NVIDIA GeForce RTX 4090", "pci_bus_id": "17"}


def test_one_gpu_whose_links_are_all_slow_is_a_gpu_fault():
    # tinygrad/open-gpu-kernel-modules#6: GPU 6 at ~3.9 GB/s, every other pair at ~50 GB/s
    rc = engine.run(read((FIX / "tinygrad_6_one_gpu_slow.txt").read_bytes())).root_cause
    assert rc.category == "gpu_fault"
    assert rc.culprit.gpus == ["GPU 6"]
    assert any(q.text.startswith("6   3.92") for q in rc.evidence)
    assert "GPU 6" in rc.summary and "network" in rc.summary


def test_uniform_healthy_and_two_gpu_matrices_name_nothing():
    for name in ("nccl_814_uniform_pcie.txt", "nccl_1264_h100_healthy.txt", "tinygrad_44_two_gpus.txt",
                 "ginkgo_164_v100_header.txt"):  # fmt: skip
        assert not p2p_findings(read((FIX / name).read_bytes())), name


def test_one_slow_pair_names_both_gpus():
    # The H100 matrix of NVIDIA/nccl#1264 with the 2<->5 link made slow (as a link down to one lane would be).
    lines = (FIX / "nccl_1264_h100_healthy.txt").read_text().splitlines()
    rows = {int(ln.split()[0]): ln.split() for ln in lines[2:]}
    rows[2][1 + 5] = "41.20"
    rows[5][1 + 2] = "40.87"
    text = "\n".join(lines[:2] + ["     " + " ".join(rows[i]) for i in range(8)]) + "\n"
    [f] = p2p_findings(read(text.encode()))
    assert f.category == "gpu_fault"
    assert f.culprit.gpus == ["GPU 2", "GPU 5"]
    assert f.culprit.links == ["GPU 2 <-> GPU 5"]


def test_a_machine_built_with_slow_pairs_is_not_a_fault():
    # Two sockets: pairs across them slow, no one GPU in common -> how the machine is built, no finding.
    text = "Unidirectional P2P=Enabled Bandwidth (P2P Writes) Matrix (GB/s)\n   D\\D     0      1      2      3\n"
    vals = [[900, 50, 5, 5], [50, 900, 5, 5], [5, 5, 900, 50], [5, 5, 50, 900]]
    text += "".join(f"     {i} " + " ".join(f"{v:6.2f}" for v in row) + "\n" for i, row in enumerate(vals))
    assert not p2p_findings(read(text.encode()))


def test_with_a_host_prefix_the_gpu_is_named_on_its_host():
    text = "".join(
        f"gpu-node-07: {ln}\n" for ln in (FIX / "tinygrad_6_one_gpu_slow.txt").read_text().splitlines()
    )
    [f] = p2p_findings(read(text.encode()))
    assert f.culprit.gpus == ["gpu-node-07:GPU 6"] and f.culprit.hosts == ["gpu-node-07"]


REAL = Path(__file__).resolve().parent.parent / "fixtures" / "real"


def test_direct_copies_far_slower_than_copies_through_the_host_are_a_broken_p2p_path():
    # stas00/ml-engineering #1: P2P=Enabled 1.6-2.6 GB/s against 13-22 GB/s disabled (the IOMMU, the thread found).
    ev = read((REAL / "gpu_fault__stas00-ml-engineering-1.log").read_bytes())
    v = engine.run(ev)
    rc = v.root_cause
    assert rc.category == "gpu_fault" and rc.culprit.gpus == ["GPU 0", "GPU 1", "GPU 2"]
    assert "NCCL_P2P_DISABLE=1" in rc.fix and "IOMMU" in rc.fix


def test_p2p_as_fast_as_through_the_host_is_a_working_path():
    for name in sorted(p.name for p in FIX.glob("*.txt")):
        v = engine.run(read((FIX / name).read_bytes()))
        assert "p2p_slower_than_host" not in {f.playbook for f in v.findings}, name
