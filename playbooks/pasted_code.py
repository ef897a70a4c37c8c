"""The training script pasted beside the logs: a collective that only some ranks call, or that some ranks call
with a tensor of another size or dtype (probes/pycode.py reads it).

Every rank of a group must issue the same collectives in the same order; the code shows where they cannot. That is
what an engineer concludes on reading `if rank == 0: dist.barrier()` in a report of a hang: the ranks diverge
there (conditional_collective); on reading `if rank == 0: numel *= 2` before every rank's `all_reduce` of a tensor
of `numel` elements, that the ranks meet in the same collective with different sizes (collective_mismatch). The code shows that they can, not that they did, so the confidence stays modest
and rises a little when the text also shows the job waiting in a collective; any stronger evidence (the ranks'
stacks, a crash, a decisive log line) outranks it.
"""

from __future__ import annotations

from collections.abc import Iterator

from hangdx.playbooks.engine import Match, playbook
from hangdx.playbooks.facts import Facts
from hangdx.playbooks.verdict import Culprit
from hangdx.probes.pycode import EVENT

# Lines that say the job is waiting in a collective (the victims' side of a divergence).
_WAITING = (
    "watchdog_timeout",
    "gloo_timeout",
    "monitored_barrier_timeout",
    "monitored_barrier_failed",
    "nccl_timeout",
)


@playbook("pasted_code", order=92)
def pasted_code(facts: Facts) -> Iterator[Match]:
    """Does the pasted code call a collective on some ranks only (or let some ranks leave before one)?"""
    found = facts.ev.events_of(EVENT)
    if not found:
        return
    e = found[0]
    waiting = facts.ev.events_of(*_WAITING)
    ranks = [r for r in e.fields.get("ranks") or [] if isinstance(r, int)]
    yield Match(
        "collective_mismatch" if e.fields.get("how") == "size" else "conditional_collective",
        0.6 if waiting else 0.5,
        Culprit(ranks=ranks),
        [e.quote] + [w.quote for w in waiting[:2]],
        {
            "collective": e.fields.get("collective"),
            "condition": e.fields.get("condition"),
            "how": e.fields.get("how"),
            "ranks": ranks,
            "more": len(found) - 1,
            "waiting": bool(waiting),
        },
        template="pasted_code",
    )
