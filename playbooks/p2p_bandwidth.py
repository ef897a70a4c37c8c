"""A GPU-to-GPU bandwidth matrix (CUDA samples' p2pBandwidthLatencyTest) with one GPU, or one pair, far behind.

Within one machine every pair of GPUs on the same kind of path moves data at about the same rate. When every link
of one GPU is several times slower than the links among the other GPUs, that GPU or its own path (its PCIe link
trained down, a riser, its NVLinks) is degraded: a GPU fault, not the network's. When only the two directions of
one pair are slow, the path between those two GPUs is. Many slow pairs with no one GPU in common are how the
machine is built (GPUs on two sockets, a hybrid cube mesh), not a fault: no finding.
The words live in templates/p2p_bandwidth.j2.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterator

from hangdx.playbooks.engine import Match, playbook
from hangdx.playbooks.facts import Facts
from hangdx.playbooks.verdict import Culprit
from hangdx.probes.model import LogEvent, Quote

SLOW = 1 / 3  # a link under a third of the others' median is far behind them


def _cells(e: LogEvent) -> dict[tuple[int, int], float]:
    cols = e.fields.get("columns") or []
    out = {}
    for i, vals in (e.fields.get("rows") or {}).items():
        for k, v in enumerate(vals):
            if k < len(cols) and cols[k] != i and v is not None:
                out[(i, cols[k])] = v
    return out


def _culprit(cells: dict[tuple[int, int], float]) -> tuple[tuple[int, ...], list[float], float] | None:
    """(the GPU or the pair whose links alone are slow, their values, the others' median), or None."""
    devs = sorted({d for c in cells for d in c})
    if len(devs) < 3:
        return None  # two GPUs: nothing to compare their one link with

    def alone_slow(mine: set[tuple[int, int]]) -> tuple[list[float], float] | None:
        others = [v for c, v in cells.items() if c not in mine]
        vals = [cells[c] for c in mine if c in cells]
        if len(others) < 2 or not vals:
            return None
        ref = statistics.median(others)
        if ref <= 0 or any(v >= ref * SLOW for v in vals) or any(v < ref * SLOW for v in others):
            return None
        return vals, ref

    for g in devs:
        got = alone_slow({c for c in cells if g in c})
        if got:
            return (g,), *got
    for i, a in enumerate(devs):
        for b in devs[i + 1 :]:
            got = alone_slow({(a, b), (b, a)})
            if got:
                return (a, b), *got
    return None


def _fmt(v: float) -> str:
    return f"{v:.3g}" if v < 100 else f"{v:.0f}"


def _title(e: LogEvent) -> str:
    return e.quote.text.split(" Matrix")[0]


@playbook("p2p_bandwidth", order=87)
def p2p_bandwidth(facts: Facts) -> Iterator[Match]:
    """p2pBandwidthLatencyTest: is one GPU (or one pair of GPUs) far slower than every other one?"""
    found: dict[tuple[str | None, tuple[int, ...]], list[tuple[LogEvent, list[float], float]]] = {}
    for e in facts.ev.events_of("p2p_matrix"):
        if e.fields.get("measure") != "bandwidth" or e.fields.get("side") != "GPU":
            continue
        got = _culprit(_cells(e))
        if got:
            found.setdefault((e.host, got[0]), []).append((e, got[1], got[2]))
    for (host, gpus), hits in found.items():
        evidence: list[Quote] = []
        for e, _, _ in hits:
            rows, quotes = e.fields.get("row_quotes") or {}, [e.quote]
            if e.fields.get("header_quote"):
                quotes.append(e.fields["header_quote"])
            quotes += [rows[g] for g in gpus if g in rows]
            normal = next((q for i, q in sorted(rows.items()) if i not in gpus), None)
            evidence += quotes + ([normal] if normal else [])
        devices = hits[0][0].fields.get("devices") or {}
        slow = [v for _, vals, _ in hits for v in vals]
        ref = [r for _, _, r in hits]
        names = [f"{host}:GPU {g}" if host else f"GPU {g}" for g in gpus]
        yield Match(
            "gpu_fault",
            (0.72 if len(gpus) == 1 else 0.66) + (0.06 if len(hits) > 1 else 0.0),
            Culprit(
                hosts=[host] if host else [],
                gpus=names,
                links=[f"GPU {gpus[0]} <-> GPU {gpus[1]}"] if len(gpus) == 2 else [],
            ),  # fmt: skip
            evidence,
            {
                "gpus": list(gpus),
                "host": host,
                "bus_ids": {g: devices[g]["pci_bus_id"] for g in gpus if g in devices},
                "slow": (_fmt(min(slow)), _fmt(max(slow))),
                "normal": _fmt(statistics.median(ref)),
                "unit": "GB/s",
                "matrices": [_title(e) for e, _, _ in hits],
            },
        )


# -- the GPU topology: peer-to-peer over PCIe, in a job that never completed a collective -----------------------

# NCCL's troubleshooting guide: with PCI Access Control Services (ACS) on the bridges between GPUs, or an IOMMU in
# their path, peer-to-peer traffic is redirected through the root complex and NCCL's P2P transport can hang or
# crawl; the first collective then never completes. GPUs joined by NVLink do not take that path.
_WAITS = ("watchdog_timeout", "gloo_timeout", "collective_timeout", "nccl_timeout")


@playbook("pcie_peer_path", order=86)
def pcie_peer_path(facts: Facts) -> Iterator[Match]:
    """Does `nvidia-smi topo -m` put the GPUs on PCIe paths only, with no collective seen to complete?"""
    topos = facts.ev.events_of("gpu_topology")
    if not topos or any(e.fields.get("nvlink") for e in topos):
        return  # an NVLink pair: NCCL's peer path is not PCIe alone
    seqs = [int(e.fields["seq"]) for e in facts.ev.events_of(*_WAITS) if isinstance(e.fields.get("seq"), int)]
    if any(s > 1 for s in seqs) or any(
        (c.seq or 0) > 1 or c.state == "completed" for c in facts.ev.collectives
    ):
        return  # collectives completed: the GPUs' peer path carries data
    e = topos[0]
    pairs = [str(p).split(":", 1) for p in e.fields.get("paths") or [] if ":" in str(p)]
    paths = [f"GPU{a.replace('-', '-GPU')} {k}" for a, k in pairs]
    first = bool(seqs)
    yield Match(
        "gpu_fault",
        0.45 if first else 0.3,
        Culprit(hosts=[e.host] if e.host else []),
        [e.quote] + [w.quote for w in facts.ev.events_of(*_WAITS)][:2],
        {
            "paths": paths[:6],
            "npaths": len(paths),
            "gpus": e.fields.get("gpus"),
            "first": first,
        },
        status="hung",
    )


# -- peer-to-peer slower than copying through the host ----------------------------------------------------------

# p2pBandwidthLatencyTest measures every pair with P2P disabled (a copy staged through host memory) and enabled (a
# direct GPU-to-GPU write over NVLink or PCIe). Direct is never much slower than staged on a working path; when
# the P2P=Enabled links run at a fraction of the P2P=Disabled ones, peer-to-peer transfers are being redirected
# or faulted on the way (PCIe ACS, an IOMMU): the path NCCL's P2P transport takes, so NCCL jobs on the machine
# hang or crawl while the GPUs themselves are fine.
P2P_BROKEN = 1 / 3


@playbook("p2p_slower_than_host", order=87)
def p2p_slower_than_host(facts: Facts) -> Iterator[Match]:
    """p2pBandwidthLatencyTest: are the GPU pairs' direct (P2P) copies far slower than copies through the host?"""
    by: dict[tuple, dict[bool, LogEvent]] = {}
    for e in facts.ev.events_of("p2p_matrix"):
        if e.fields.get("measure") != "bandwidth" or e.fields.get("side") != "GPU":
            continue
        key = (e.quote.source, e.host, e.fields.get("direction"))
        by.setdefault(key, {}).setdefault(bool(e.fields.get("p2p")), e)
    for (_, host, direction), pair in by.items():
        if True not in pair or False not in pair:
            continue
        on, off = _cells(pair[True]), _cells(pair[False])
        both = [c for c in on if c in off and c[0] != c[1]]
        if len(both) < 2:
            continue
        slow = [c for c in both if on[c] < P2P_BROKEN * off[c]]
        if len(slow) * 2 <= len(both):
            continue  # most pairs' direct copies are as fast as they should be: not the machine's P2P path
        gpus = sorted({g for c in slow for g in c})
        yield Match(
            "gpu_fault",
            0.7,
            Culprit(hosts=[host] if host else [], gpus=[f"GPU {g}" for g in gpus]),
            [pair[True].quote, pair[False].quote]
            + [q for i, q in sorted((pair[True].fields.get("row_quotes") or {}).items())][:2],
            {
                "direction": direction,
                "on": _fmt(statistics.median(on[c] for c in slow)),
                "off": _fmt(statistics.median(off[c] for c in slow)),
                "pairs": len(slow),
                "of": len(both),
                "gpus": gpus,
            },
            status="hung",
        )
        return
