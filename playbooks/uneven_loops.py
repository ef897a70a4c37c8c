"""Ranks that stopped at different iterations of the same loop: uneven data, a loop run a different number of times.

A training or evaluation loop with collectives in it (FSDP's all-gathers, DDP's all-reduce, a loss reduced across
ranks) keeps every rank within a step of the others. When the ranks' own log lines show their last counter of
that loop (`batch 87`, `step 120`) two or more logged iterations apart, and every rank's log stops there, the ranks
ran different numbers of iterations: one ran out of data (or left the loop) while the others still issued the loop's collectives, and
each now waits in a collective the others never issue (conditional_collective). Which rank diverged is named only
when the log says it: exactly one rank stopped short of all the others, which agree.

Not this playbook's case: a rank whose log goes on long after the others stopped (it is busy while they wait: a
straggler; busy_elsewhere and straggler read that).
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Iterator
from statistics import median

from hangdx.playbooks.engine import Match, playbook
from hangdx.playbooks.facts import Facts
from hangdx.playbooks.verdict import Culprit
from hangdx.probes.model import LogEvent

# Ranks stopped together when their last lines are this close (seconds), or within a few iterations' time.
_TOGETHER_S = 30.0
_TOGETHER_ITERS = 10
# Progress bars or waits that say a rank was still busy while the others waited: busy_elsewhere's evidence.
_WAIT_KINDS = (
    "watchdog_timeout",
    "gloo_timeout",
    "work_progress",
    "desync_report",
    "monitored_barrier_failed",
)


def _loops(facts: Facts) -> dict[tuple[str, str], dict[int, LogEvent]]:
    """Per loop (counter word, the words before it), each rank's counter event."""
    out: dict[tuple[str, str], dict[int, LogEvent]] = defaultdict(dict)
    for e in facts.ev.events_of("step_counter"):
        if e.rank is None:
            continue
        key = (str(e.fields.get("what")), str(e.fields.get("loop")))
        out[key][e.rank] = e
    return out


def _last_loop_of_each_rank(facts: Facts, per_rank: dict[int, LogEvent]) -> bool:
    """Is this loop the last one each rank logged (its log stops there, not in a later loop)?"""
    for r, e in per_rank.items():
        for other in facts.ev.events_of("step_counter"):
            if (
                other.rank == r
                and other is not e
                and other.quote.source == e.quote.source
                and other.quote.line > e.quote.line
            ):
                return False
    return True


def _stopped_together(per_rank: dict[int, LogEvent]) -> bool:
    """Did the ranks' counters stop at about the same time (none went on while the others sat)?"""
    last = [e.fields.get("last_time") for e in per_rank.values()]
    if any(t is None for t in last):
        return True  # no times: the log's end is where each rank stopped
    spread = max(last) - min(last)  # type: ignore[type-var, operator]
    per_iter = [
        (e.fields["last_time"] - e.fields["first_time"]) / (e.fields["n"] - e.fields["first"])
        for e in per_rank.values()
        if e.fields.get("first_time") is not None and e.fields["n"] > e.fields["first"]
    ]
    limit = max(_TOGETHER_S, _TOGETHER_ITERS * median(per_iter)) if per_iter else _TOGETHER_S
    return spread <= limit


def _busy_while_waiting(facts: Facts) -> bool:
    """A progress bar still moving on a rank while others time out: a straggler, read by busy_elsewhere."""
    waiting = {e.rank for e in facts.ev.events_of(*_WAIT_KINDS) if e.rank is not None}
    return bool(waiting) and any(
        e.rank is not None and e.rank not in waiting and e.fields.get("first") != e.fields.get("n")
        for e in facts.ev.events_of("progress")
    )


@playbook("uneven_iterations", order=63)
def uneven_iterations(facts: Facts) -> Iterator[Match]:
    """Logs: did the ranks stop at different iterations of the same loop (uneven data, a loop run unevenly)?"""
    if facts.have_stacks or _busy_while_waiting(facts):
        return
    candidates = []
    for (what, loop), per_rank in _loops(facts).items():
        if len(per_rank) < 2:
            continue
        lasts = {r: int(e.fields["n"]) for r, e in per_rank.items()}
        # One logged iteration apart is what a rank stuck before its next log line looks like (any stall); two or
        # more cannot happen while every iteration's collectives keep the ranks in step.
        stride = max([int(e.fields.get("stride") or 1) for e in per_rank.values()] + [1])
        if max(lasts.values()) - min(lasts.values()) < 2 * stride:
            continue
        if not _last_loop_of_each_rank(facts, per_rank) or not _stopped_together(per_rank):
            continue
        candidates.append((len(per_rank), what, loop, per_rank, lasts))
    if not candidates:
        return
    _, what, loop, per_rank, lasts = max(candidates, key=lambda c: c[0])
    top = max(lasts.values())
    behind = sorted(r for r, n in lasts.items() if n < top)
    ahead = sorted(r for r in lasts if r not in behind)
    # One rank short of all the others, which agree: that rank left the loop early. Otherwise the log cannot say
    # which rank's data ran out first.
    culprit = behind if len(behind) == 1 and len(ahead) >= 2 else []
    crashed = facts.ev.events_of("torchrun_failure", "cuda_oom", "cuda_error", "segfault", "oom_kill")
    conf = 0.66 if culprit else 0.62
    if crashed:
        conf = 0.45  # a rank that died explains the others' wait better; its own finding speaks
    order = sorted(lasts, key=lambda r: (-lasts[r], r))
    yield Match(
        "conditional_collective",
        conf,
        Culprit(ranks=culprit, hosts=facts.hosts_of(culprit)),
        [per_rank[r].quote for r in order],
        {
            "ranks": culprit,
            "what": what,
            "lasts": {r: lasts[r] for r in order},
            "top": top,
            "behind": behind,
            "ahead": ahead,
        },
        status="hung",
    )


@playbook("uneven_lengths", order=64)
def uneven_lengths(facts: Facts) -> Iterator[Match]:
    """Did the ranks print different lengths for the loop they run (batches, steps or samples of their shard)?

    Each step of data-parallel training holds collectives (the gradient all-reduce), so ranks whose loops differ in
    length cannot all finish: the one with fewer steps leaves the loop and the others wait in a collective it never
    issues. The rank(s) whose length differs from a clear majority's are named; with no majority, none."""
    per: dict[str, dict[int, LogEvent]] = defaultdict(dict)
    for e in facts.ev.events_of("data_length"):
        if e.rank is not None and isinstance(e.fields.get("n"), int):
            per[str(e.fields.get("what"))][e.rank] = e  # each rank's last
    for what, by_rank in sorted(per.items(), key=lambda kv: -len(kv[1])):
        lengths = {r: int(e.fields["n"]) for r, e in sorted(by_rank.items())}
        if len(lengths) < 2 or len(set(lengths.values())) < 2:
            continue
        common, agree = Counter(lengths.values()).most_common(1)[0]
        odd = sorted(r for r, n in lengths.items() if n != common)
        culprit = odd if agree >= 2 and agree > len(odd) else []
        yield Match(
            "conditional_collective",
            0.62 if culprit else 0.55,
            Culprit(ranks=culprit, hosts=facts.hosts_of(culprit)),
            [by_rank[r].quote for r in lengths],
            {"ranks": culprit, "what": what, "lengths": lengths, "common": common if culprit else None},
            status="hung",
        )
        return
