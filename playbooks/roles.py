"""What a hang looks like from its stacks, in a form that recurs from job to job: per rank role (the ranks apart
from the crowd, the crowd), where the main thread waits and the user frames under that wait.

The fleet memory keys "the same hang as job X" on this: two jobs of the same program hung the same way give the
same roles, whatever their job ids, rank numbers, line numbers (an edit shifts them) or paths (a new checkout).
"""

from __future__ import annotations

import os

from hangdx.playbooks.facts import Facts, Location, RankView, is_library

# The innermost user frames under the wait: enough to tell call sites apart, not the whole loop.
USER_FRAMES = 3


def _frames(view: RankView) -> list[str]:
    """The innermost user frames of the rank's latest main-thread stack, `function (file.py)`."""
    if not view.stacks:
        return []
    thread = view.stacks[-1].main_thread()
    if thread is None:
        return []
    user = [f for f in thread.frames if not f.native and not is_library(f)]
    return [f"{f.function} ({os.path.basename(f.file)})" for f in user[:USER_FRAMES]]


def _wait(loc: Location) -> str:
    return f"{loc.kind}:{loc.op}" if loc.op else loc.kind


def _role(facts: Facts, ranks: list[int]) -> list[str]:
    """The distinct places these ranks are, each `wait < frame < frame`, sorted (rank numbers left out)."""
    places = set()
    for r in ranks:
        v = facts.ranks.get(r)
        if v is None or not v.locations:
            continue
        frames = _frames(v)
        if frames:
            places.add(" < ".join([_wait(v.location), *frames]))
    return sorted(places)


def stack_roles(facts: Facts) -> dict[str, list[str]]:
    """{"apart": places of the odd ranks, "crowd": the crowd's place}; {} without user frames to go on."""
    roles = {"apart": _role(facts, facts.odd_ranks), "crowd": _role(facts, facts.crowd_ranks)}
    return {k: v for k, v in roles.items() if v}
