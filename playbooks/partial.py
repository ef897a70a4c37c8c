"""The flowchart's branches for partial evidence: what an engineer concludes when not every rank was seen.

One process's stack still says where that process waits; a log that never maps its processes to ranks still
shows which process stopped issuing collectives. Each finding says that only part of the job was seen, names
the process as the evidence names it (rank, host, pid, CUDA device), and names the one artifact that would
settle it, as a command to run.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field

from hangdx.playbooks.engine import Match, playbook
from hangdx.playbooks.facts import Facts, Location, classify
from hangdx.playbooks.verdict import Culprit
from hangdx.probes.model import CollectiveRecord, ProcessState, Quote, StackDump

# Where one process waits -> what that says by itself, and how sure one can be from one process.
_ALONE = {
    "dataloader": ("dataloader_stall", 0.62),
    "io": ("io_stall", 0.62),
    "lock": ("user_deadlock", 0.55),
    "child": ("user_deadlock", 0.55),
    "p2p": ("p2p_deadlock", 0.42),
    "init": ("comm_init_failure", 0.5),
}


@dataclass
class Process:
    """A process the evidence shows, named by whatever it gives: rank, host, pid."""

    rank: int | None
    host: str | None
    pid: int | None
    dumps: list[StackDump] = field(default_factory=list)
    location: Location | None = None

    def name(self) -> str:
        parts = []
        if self.rank is not None:
            parts.append(f"rank {self.rank}")
        if self.host:
            parts.append(f"on {self.host}" if parts else self.host)
        if self.pid is not None:
            parts.append(f"pid {self.pid}")
        return " ".join(parts) or "the process"


def _states(facts: Facts) -> dict[tuple[str | None, int], ProcessState]:
    out: dict[tuple[str | None, int], ProcessState] = {}
    for s in facts.ev.processes:
        out[(s.host, s.pid)] = s
    return out


def seen_processes(facts: Facts) -> list[Process]:
    """Every main process with a stack: ranked ones from the facts, and those whose dump names no rank."""
    procs: list[Process] = []
    for r, v in sorted(facts.ranks.items()):
        if v.stacks and v.alive is not False:
            procs.append(Process(r, v.host, v.pid, v.stacks, v.location))
    states = _states(facts)
    unranked: dict[tuple, list[StackDump]] = defaultdict(list)
    for d in facts.ev.stacks:
        if d.rank is None and d.role != "worker":
            unranked[(d.host, d.pid if d.pid is not None else id(d))].append(d)
    for (host, _), dumps in unranked.items():
        d = dumps[-1]
        loc = classify(d, states.get((host, d.pid)) if d.pid is not None else None)
        procs.append(Process(None, host, d.pid, dumps, loc))
    return procs


def _partial(facts: Facts, procs: list[Process]) -> bool:
    """Fewer processes seen than the job has (or than anyone can tell it has)."""
    ws = facts.world_size
    return ws is None or len(procs) < ws


@playbook("one_process", order=56)
def one_process(facts: Facts) -> Iterator[Match]:
    """Only some processes' stacks were seen: where does each wait, and is that a cause by itself?"""
    procs = seen_processes(facts)
    if not procs or not _partial(facts, procs):
        return
    ranked_crowd = len([p for p in procs if p.rank is not None]) >= 2
    if ranked_crowd and not any(p.rank is None for p in procs):
        return  # several ranks seen: the crowd playbooks compare them
    for p in _culprits(procs):
        loc = p.location
        if loc is None or loc.kind not in _ALONE:
            continue
        category, conf = _ALONE[loc.kind]
        others = [q for q in procs if q is not p]
        if others and all(q.location and q.location.kind == "collective" for q in others):
            conf = min(0.8, conf + 0.15)  # the others wait in a collective for it: the classic picture
        evidence: list[Quote] = [loc.quote] if loc.quote else []
        evidence += [q.location.quote for q in others[:2] if q.location and q.location.quote]
        yield Match(
            category,
            conf,
            Culprit(
                ranks=[p.rank] if p.rank is not None else [],
                hosts=[p.host] if p.host else [],
                processes=[p.name()] if p.rank is None and (p.pid is not None or p.host) else [],
            ),
            evidence,
            {
                "who": p.name(),
                "where": loc.describe(),
                "kind": loc.kind,
                "seen": len(procs),
                "world_size": facts.world_size,
                "others": [f"{q.name()} is {q.location.describe()}" for q in others[:3] if q.location],
                "pid": p.pid,
                "host": p.host,
                "rank": p.rank,
            },
            status="hung",
            template="one_process",
        )


def _culprits(procs: list[Process]) -> list[Process]:
    """With one process, that one; with several, those not where most of them are."""
    if len(procs) == 1:
        return procs
    counts = Counter(p.location.kind for p in procs if p.location)
    if not counts:
        return []
    crowd = max(counts.items(), key=lambda kv: (kv[1], kv[0] == "collective"))[0]
    if len(counts) == 1 and crowd in _ALONE:
        # All wait the same way, and not on a collective: each of them is stuck.
        return [p for p in procs if p.location]
    return [p for p in procs if p.location and p.location.kind != crowd]


# -- a log whose processes have no rank ----------------------------------------------------------------------


@dataclass
class _Stream:
    host: str | None
    pid: int
    device: int | None
    last: CollectiveRecord

    def name(self) -> str:
        dev = f" cudaDev {self.device}" if self.device is not None else ""
        return f"{self.host + ' ' if self.host else ''}pid {self.pid}{dev}"


def _unranked_streams(facts: Facts) -> list[_Stream]:
    """Each unranked process's latest collective on its busiest communicator."""
    per: dict[tuple, dict[str | None, list[CollectiveRecord]]] = defaultdict(lambda: defaultdict(list))
    for c in facts.ev.collectives:
        if c.rank is None and c.pid is not None and c.seq is not None and c.op not in ("send", "recv"):
            per[(c.host, c.pid, c.device)][c.pg].append(c)
    out = []
    for (host, pid, dev), comms in per.items():
        busiest = max(comms.values(), key=len)
        out.append(_Stream(host, pid, dev, max(busiest, key=lambda c: c.seq or 0)))
    return out


@playbook("unranked_sequence", order=61)
def unranked_sequence(facts: Facts) -> Iterator[Match]:
    """A log that never says which rank a process is: which process stopped issuing collectives?"""
    if facts.have_stacks or any(c.rank is not None for c in facts.ev.collectives):
        return
    streams = _unranked_streams(facts)
    if len(streams) < 2:
        return
    top = max(s.last.seq or 0 for s in streams)
    behind = [s for s in streams if (s.last.seq or 0) < top]
    if not behind or len(behind) * 2 > len(streams):
        return
    ahead = [s for s in streams if s not in behind]
    evidence = [s.last.quote for s in behind if s.last.quote] + [
        s.last.quote for s in ahead[:2] if s.last.quote
    ]
    hosts = sorted({s.host for s in behind if s.host})
    yield Match(
        "conditional_collective",
        0.72,
        Culprit(
            hosts=hosts,
            gpus=[f"{s.host}:cudaDev {s.device}" for s in behind if s.device is not None],
            processes=[s.name() for s in behind],
        ),
        evidence,
        {
            "behind": [
                {
                    "name": s.name(),
                    "seq": s.last.seq,
                    "gap": top - (s.last.seq or 0),
                    "pid": s.pid,
                    "host": s.host,
                }
                for s in behind
            ],
            "top": top,
            "n": len(streams),
            "op": ahead[0].last.op if ahead else "the collective",
        },
        status="hung",
        template="unranked_sequence",
    )


# -- a rank busy with other work while the others wait -----------------------------------------------------

_OTHER_WORK = ("eval", "valid", "test", "predict", "generat", "sampl", "sav", "checkpoint", "ckpt", "export",
               "preprocess", "tokeniz", "map", "load", "download", "cach")  # fmt: skip
_WRITING = ("sav", "checkpoint", "ckpt", "export", "writ")
_WAIT_KINDS = (
    "store_timeout",  # a store client's wait for a key other ranks set (a store-based barrier, rendezvous)
    "watchdog_timeout",
    "gloo_timeout",
    "work_progress",
    "desync_report",
    "monitored_barrier_failed",
)


@playbook("busy_elsewhere", order=62)
def busy_elsewhere(facts: Facts) -> Iterator[Match]:
    """Logs: is one rank still busy in other work (evaluation, saving, data preparation) while the rest time out?"""
    if facts.have_stacks:
        return
    waiting = {e.rank for e in facts.ev.events_of(*_WAIT_KINDS) if e.rank is not None}
    if not waiting:
        return
    busy = [
        e
        for e in facts.ev.events_of("progress")
        if e.rank is not None and e.rank not in waiting and _other_work_going_on(e)
    ]
    ranks = sorted({e.rank for e in busy if e.rank is not None})
    if not busy:
        # A bar that names no rank, with one rank silent among the ones that time out (ranks count from 0, so
        # rank 0 exists even when only 1-3 report): that silent rank is the one still at that work.
        world = facts.world_size or max(waiting) + 1
        silent = [r for r in range(world) if r not in waiting]
        busy = [e for e in facts.ev.events_of("progress") if e.rank is None and _other_work_going_on(e)]
        if len(silent) != 1 or not busy:
            return
        ranks = silent
    writing = any(any(w in str(e.fields.get("what", "")).lower() for w in _WRITING) for e in busy)
    timeouts = [e for e in facts.ev.events_of(*_WAIT_KINDS) if e.rank in waiting][:2]
    yield Match(
        "io_stall" if writing else "straggler",
        0.66,
        Culprit(ranks=ranks, hosts=facts.hosts_of(ranks)),
        [e.quote for e in busy[:3]] + [e.quote for e in timeouts],
        {
            "ranks": ranks,
            "work": {_rank_or(e, ranks): str(e.fields.get("what")) for e in busy},
            "progress": {_rank_or(e, ranks): _progress(e.fields) for e in busy},
            "waiting": sorted(waiting),
            "writing": writing,
        },
        status="hung",
        template="busy_elsewhere",
    )


def _rank_or(e, ranks: list[int]) -> int:
    return e.rank if e.rank is not None else ranks[0]


# Hugging Face datasets counts its map/filter bars in examples (`unit=" examples"`, before 2.9 in batches `ba`):
# a bar in these units is data preparation, whatever its description says.
_DATA_PREP_UNITS = ("examples/s", "s/examples", "ba/s", "s/ba")


def _other_work_going_on(e) -> bool:
    """A progress bar of work other than training steps, not at its end."""
    done = e.fields.get("total") and e.fields.get("n") == e.fields.get("total")
    other = any(w in str(e.fields.get("what", "")).lower() for w in _OTHER_WORK)
    return (other or str(e.fields.get("unit") or "") in _DATA_PREP_UNITS) and not done


def _progress(fields: dict) -> str:
    """`812/1000`, or `812` when the bar gives no total."""
    n = fields.get("n")
    if isinstance(n, int) and isinstance(fields.get("first"), int):
        n = max(n, fields["first"])  # a bar that went back to 0 is another process's: show the furthest
    return f"{n}/{fields['total']}" if fields.get("total") else str(n)


# -- GPUs that spin in a collective ---------------------------------------------------------------------------

# NCCL's kernels poll memory for their peers' data: while a rank waits in a collective its GPU reads 100%
# utilisation (a kernel is resident the whole sample, which is all `utilization.gpu` measures) yet draws little
# more than idle power, since no arithmetic runs. A GPU that computes at 100% draws most of its power limit.
SPIN_UTIL = 90.0
SPIN_POWER = 0.4  # of the board's power limit
SPINNING = 0.25  # what the picture alone is worth: it says the ranks wait, not for whom


def spinning_gpus(facts: Facts) -> list:
    """The GPUs at full utilisation on little power: their ranks wait in a collective."""
    return [
        g
        for g in facts.ev.gpus
        if g.util_pct is not None
        and g.util_pct >= SPIN_UTIL
        and g.power_w is not None
        and g.power_limit_w
        and g.power_w <= SPIN_POWER * g.power_limit_w
    ]


@playbook("gpus_spinning", order=53)
def gpus_spinning(facts: Facts) -> Iterator[Match]:
    """nvidia-smi only: do the GPUs spin at 100% on little power (NCCL kernels waiting for a peer that never came)?"""
    from hangdx.playbooks.flowchart import _idle_gpus

    if facts.have_stacks or _idle_gpus(facts):
        return  # stacks say where each rank waits; a GPU at 0% among them is gpu_idle_outlier's
    spin = spinning_gpus(facts)
    if not spin:
        return
    gpus = [g for g in facts.ev.gpus if g.util_pct is not None]
    computing = [g for g in gpus if g not in spin and (g.util_pct or 0) >= SPIN_UTIL]
    yield Match(
        "unknown",
        SPINNING,
        Culprit(),
        [g.quote for g in spin[:6] if g.quote],
        {
            "spin": [
                {
                    "gpu": f"{g.host + ':' if g.host else ''}GPU {g.index}"
                    + (f" ({g.bus_id})" if g.bus_id else ""),
                    "util": round(g.util_pct or 0),
                    "power": round(g.power_w or 0),
                    "limit": round(g.power_limit_w or 0),
                    "mem_gib": round((g.mem_used_mib or 0) / 1024, 1),
                }
                for g in spin
            ],
            "seen": len(gpus),
            "computing": len(computing),
            "holding": all((g.mem_used_mib or 0) > 1024 for g in spin),
        },
        status="hung",
        template="gpus_spinning",
    )


# -- unranked processes waiting in different collectives --------------------------------------------------------


@playbook("unranked_elsewhere", order=59)
def unranked_elsewhere(facts: Facts) -> Iterator[Match]:
    """Dumps that name no rank, each of a process waiting in a collective, but not in the same one: who diverged?

    Every rank of a collective calls it from the same line of the program; processes of one job blocked in
    collectives called from different places (one in `all_reduce` under a prefetch check, the others in a
    `broadcast` of the next iteration) have issued different sequences of collectives, and each waits for peers
    that will never call what it called. With ranks this is rank_elsewhere; without them the process is named
    as its dump names it, and only when it stands alone against two or more that agree."""
    procs = seen_processes(facts)
    if len(procs) < 2 or any(p.rank is not None for p in procs) or facts.ranks:
        return
    if not all(p.location and p.location.kind == "collective" and p.location.call_site for p in procs):
        return
    sites: dict[str, list[Process]] = defaultdict(list)
    for p in procs:
        sites[p.location.call_site].append(p)  # type: ignore[union-attr,index]
    if len(sites) < 2:
        return  # one call site: the same collective, waiting for a peer not seen (one_process says so)
    groups = sorted(sites.values(), key=len)
    odd = groups[0] if len(groups) == 2 and len(groups[0]) == 1 and len(groups[1]) >= 2 else []
    named = [p for p in odd if p.pid is not None or p.host]
    yield Match(
        "conditional_collective",
        0.6,
        Culprit(
            hosts=sorted({p.host for p in odd if p.host}),
            processes=[p.name() for p in named],
        ),
        [p.location.quote for p in procs if p.location and p.location.quote][:4],
        {
            "where": [
                {"who": _dump_name(p, i), "what": p.location.describe()}  # type: ignore[union-attr]
                for i, p in enumerate(procs, 1)
            ][:6],
            "odd": [p.name() for p in named],
            "n": len(procs),
            "sites": len(sites),
        },
        status="hung",
        template="unranked_elsewhere",
    )


def _dump_name(p: Process, i: int) -> str:
    """A process as its dump names it, or by the dump's place in the text when it names nothing."""
    return p.name() if p.pid is not None or p.host else f"the process of dump {i}"
