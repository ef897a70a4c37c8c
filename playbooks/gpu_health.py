"""Playbooks over a GPU's own health report (`nvidia-smi -q`): a GPU whose clocks the hardware holds down.

NVML's clock event reasons say why a GPU runs below its clocks. HW Slowdown (and under it HW Thermal and HW Power
Brake Slowdown) halves the clocks or worse, SW Thermal Slowdown lowers them past the GPU's operating temperature:
a GPU so held runs every kernel slower, and in a synchronous job every step waits for it. SW Power Cap and Idle are
not counted: a busy GPU at its power limit and an idle one are normal. Words in templates/gpu_throttled.j2.
"""

from __future__ import annotations

from collections.abc import Iterator

from hangdx.playbooks.engine import Match, playbook
from hangdx.playbooks.facts import Facts
from hangdx.playbooks.verdict import Culprit

_REASONS = {
    "hw slowdown": "HW Slowdown",
    "hw thermal slowdown": "HW Thermal Slowdown",
    "hw power brake slowdown": "HW Power Brake Slowdown",
    "sw thermal slowdown": "SW Thermal Slowdown",
}


@playbook("gpu_throttled", order=89)
def gpu_throttled(facts: Facts) -> Iterator[Match]:
    """Is a GPU held below its clocks by the hardware (thermal or power brake slowdown), slowing every step?"""
    events = facts.ev.events_of("gpu_throttled")
    if not events:
        return
    slow: dict[tuple[str | None, str | None], list[str]] = {}
    for e in events:
        reasons = [_REASONS.get(r, r) for r in e.fields.get("reasons") or []]
        slow.setdefault((e.host, e.fields.get("bus_id")), []).extend(reasons)
    seen = {(g.host, g.bus_id) for g in facts.ev.gpus if g.bus_id} | set(slow)
    pids = {p for g in facts.ev.gpus if (g.host, g.bus_id) in slow for p in g.pids}
    ranks = sorted(r for r, v in facts.ranks.items() if v.pid is not None and v.pid in pids)
    hosts = sorted({h for h, _ in slow if h})
    names = [f"{h}:{b}" if h and b else b or (f"a GPU on {h}" if h else "a GPU") for h, b in slow]
    fewer = len(slow) < len(seen)  # the others in the same report run at full clocks
    yield Match(
        "straggler",
        0.6 if fewer else 0.5,
        Culprit(ranks=ranks, hosts=hosts, gpus=[n for (_, b), n in zip(slow, names, strict=True) if b]),
        [e.quote for e in events],
        {
            "gpus": names,
            "reasons": {n: list(dict.fromkeys(r)) for n, r in zip(names, slow.values(), strict=True)},
            "others": len(seen) - len(slow),
            "ranks": ranks,
        },
        status="progressing",
    )
