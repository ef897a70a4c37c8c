"""Horovod's stall warning, read as an engineer reads it: which ranks the others wait for, and whether it ends.

Horovod's coordinator warns when a tensor was submitted by some ranks and the others have not followed for
HOROVOD_STALL_CHECK_TIME_SECONDS (60 s by default); it names the ranks that are ready (`[ready ranks: ...]`) or
missing (`[missing ranks: ...]`, `Missing ranks:` / `Stalled ranks:` then `N: [tensors]`). A warning is only a
warning: Horovod keeps waiting and the job goes on when the late rank comes back (one rank doing extra work,
evaluation or saving, while the rest wait): a straggler, the late rank(s) the culprit. When Horovod gave up
(`Will shutdown.`, `Horovod has been shut down`), the late ranks never submitted that tensor: they took another
path through the code (conditional_collective). Two more readings say the same without a shutdown: ranks that each
lack a tensor another listed rank already submitted (crossed waits: rank 0 waits in a broadcast rank 1 never
submits while rank 1 waits in an allreduce rank 0 never submits) can never both go on, so they run different
sequences of collectives and nobody is merely late; and ranks missing while the log says a training loop ended
(`training_finished`) are ranks that ran fewer steps and stopped submitting.
"""

from __future__ import annotations

from collections.abc import Iterator

from hangdx.playbooks.engine import Match, playbook
from hangdx.playbooks.facts import Facts
from hangdx.playbooks.verdict import Culprit
from hangdx.probes.horovod_log import message
from hangdx.probes.model import LogEvent, Quote

_MAX_WORLD = 1 << 20  # ranks are listed one by one below this; a larger "world" is a mangled number
_CRASH_KINDS = ("cuda_oom", "cuda_error", "segfault", "oom_kill", "torchrun_failure")


def _late(e: LogEvent, world: int | None) -> tuple[set[int], set[int], int | None, bool]:
    """The ranks a warning says are missing, those it says are ready, the world size used, and whether the
    world had to be inferred from the ready ranks (Horovod's oldest form names only those)."""
    missing: set[int] = set(e.fields.get("missing") or [])
    ready: set[int] = set(e.fields.get("ready") or [])
    inferred = False
    for op in e.fields.get("ops") or []:
        if op.get("missing") is None and op.get("ready") and max(op["ready"]) < _MAX_WORLD:
            # Ready ranks 1-7 name a world of at least 0-7: the ranks of it not named are the late ones.
            w = world if world and world <= _MAX_WORLD else max(op["ready"]) + 1
            inferred = inferred or world is None
            missing |= set(range(w)) - set(op["ready"])
    if world is None and ready:
        world = max(ready | missing) + 1
    return missing, ready, world, inferred


def _gave_up(facts: Facts, first: LogEvent) -> list[Quote]:
    """Horovod's own word that it stopped waiting: a stall shutdown, or `Horovod has been shut down` after it."""
    stalls = [
        e.fields.get("shutdown_line") or e.quote
        for e in facts.ev.events_of("horovod_stall")
        if e.fields.get("shutdown")
    ]
    later = [
        e.quote
        for e in facts.ev.events_of("horovod_shutdown")
        if e.quote.source != first.quote.source or e.quote.line > first.quote.line
    ]
    return stalls + later


def _crossed_ops(e: LogEvent) -> list[dict]:
    """The first tensor of each distinct set of missing ranks (at most three), for the summary."""
    out: dict[frozenset, dict] = {}
    for op in e.fields.get("ops") or []:
        key = frozenset(op.get("missing") or ())
        if key and key not in out:
            out[key] = {"tensor": str(op.get("tensor")), "missing": sorted(key)}
    return list(out.values())[:3]


def _odd_side(e: LogEvent) -> list[int]:
    """Crossed waits between a few ranks and many: the few, who lack what all the others submitted while the others
    lack only what the few submitted, are the ranks whose path differs (the many run the same code); [] when the
    two sides are alike in size (two ranks, one each), which the warning cannot decide."""
    sets = {frozenset(op.get("missing") or ()) for op in e.fields.get("ops") or [] if op.get("missing")}
    if len(sets) != 2:
        return []
    a, b = sorted(sets, key=len)
    return sorted(a) if not (a & b) and 2 * len(a) <= len(b) else []


def _crossed(e: LogEvent) -> bool:
    """Two tensors of one warning, each submitted by a rank that lacks the other: a rank missing only B (it
    submitted A) and a rank missing only A (it submitted B) can never both go on. Disjoint missing sets are the
    plain case; a rank missing both (it is elsewhere, submitting neither) does not undo the crossing of the rest."""
    sets = [frozenset(op.get("missing") or ()) for op in e.fields.get("ops") or [] if op.get("missing")]
    return any(a - b and b - a for i, a in enumerate(sets) for b in sets[i + 1 :])


@playbook("horovod_stall", order=57)
def horovod_stall(facts: Facts) -> Iterator[Match]:
    """Horovod's stall warning: which ranks hold the others, and did Horovod ever stop waiting?"""
    events = facts.ev.events_of("horovod_stall")
    if not events:
        return
    last = events[-1]
    missing, ready, world, inferred = _late(last, facts.world_size)
    if not missing:
        return
    everyone = set(range(world)) if world and world <= _MAX_WORLD else missing | ready
    ready_all = (everyone - missing) | ready
    gave_up = _gave_up(facts, events[0])
    crashed = [e for e in facts.ev.events_of(*_CRASH_KINDS) if e.rank is not None]
    # Ranks named as missing are the late ones, unless the world is known and most of it is missing.
    minority_late = not ready_all or len(missing) <= len(ready_all)
    crossed = _crossed(last) and not gave_up
    finished = [e.quote for e in facts.ev.events_of("training_finished")]
    finished = finished if finished and not gave_up and not crossed and minority_late else []
    if crossed:
        # Each rank waits for a tensor the other never submits: not a late rank, a divergence whose side the
        # warning cannot tell.
        category, status, culprit, conf = "conditional_collective", "hung", _odd_side(last), 0.72
    elif finished:
        # The log says training ended while Horovod still waits for these ranks: they left the loop early.
        category, status, culprit, conf = "conditional_collective", "hung", sorted(missing), 0.72
    elif gave_up:
        category, status = "conditional_collective", "hung"
        # Ranks that never submitted a tensor the others did took another path; if most are missing, the few that
        # submitted it are the ones that went their own way.
        culprit = sorted(missing) if minority_late else sorted(ready_all)
        conf = 0.74
    else:
        category, status = "straggler", "progressing"
        culprit = sorted(missing) if minority_late else []
        conf = 0.7 if minority_late else 0.5
    if crashed:
        conf = min(conf, 0.6)  # a rank that died explains the wait better; its own finding speaks
    tensors = list(
        dict.fromkeys(
            str(op.get("tensor")) for e in events for op in e.fields.get("ops") or [] if op.get("tensor")
        )
    )
    evidence: list[Quote] = []
    for e in (events[0], last) if last is not events[0] else (last,):
        lines = e.fields.get("lines") or []
        evidence += [q for q in lines[:1] if q != e.quote] + [e.quote]
    evidence += gave_up[:2] + finished[:2]
    yield Match(
        category,
        conf,
        Culprit(ranks=culprit, hosts=facts.hosts_of(culprit)),
        evidence,
        {
            "ranks": culprit,
            "missing": sorted(missing),
            "ready": sorted(ready_all),
            "world": world,
            "inferred": inferred,
            "seconds": last.fields.get("seconds"),
            "warnings": len(events),
            "tensors": tensors[:3],
            "more_tensors": max(0, len(tensors) - 1),
            "gave_up": [message(q.text) for q in gave_up[:1]],
            "minority_late": minority_late,
            "crossed": crossed,
            "crossed_ops": _crossed_ops(last) if crossed else [],
            "finished": [message(q.text) for q in finished[:1]],
        },
        status=status,
    )


# Horovod's own words (horovod/common/operations.cc, horovod/torch/mpi_ops.py): "Horovod has been shut down. This
# was caused by an exception on one of the ranks or an attempt to allreduce, allgather or broadcast a tensor after
# one of the ranks finished execution. If the shutdown was caused by an exception, you should see the exception in
# the log before the first shutdown message."
_OTHER_FAILURE = ("cuda_oom", "cuda_error", "segfault", "oom_kill", "torchrun_failure", "mpi_rank_exit",
                  "process_exit", "nccl_error", "horovod_stall")  # fmt: skip


@playbook("horovod_shutdown", order=58)
def horovod_shutdown(facts: Facts) -> Iterator[Match]:
    """Horovod shut down and no rank's exception is in the text: by Horovod's own message, a rank finished early."""
    shutdowns = facts.ev.events_of("horovod_shutdown")
    if not shutdowns or facts.ev.events_of(*_OTHER_FAILURE):
        return
    first = min(shutdowns, key=lambda e: (e.quote.source, e.quote.line))
    raised = [
        e
        for e in facts.ev.events_of("exception")
        if "Horovod has been shut down" not in e.quote.text
        and "HorovodInternalError" not in str(e.fields.get("exc_type"))
        and (e.quote.source != first.quote.source or e.quote.line < first.quote.line)
    ]
    if raised:
        return  # the exception Horovod speaks of is in the log: that rank's crash is the reading
    yield Match(
        "conditional_collective",
        0.5,
        Culprit(),
        [first.quote],
        {"message": message(first.quote.text)},
        status="failed",
    )
