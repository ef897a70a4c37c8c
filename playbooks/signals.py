"""Findings from the signal catalogue: what the emitters said, weighed as an on-call engineer weighs it.

Every event a catalogue row marked (`fields["signal_row"]`, see probes/signals.py) carries the row's category
and strength. Here they become findings, for whatever kind of event they are (kinds added to the catalogue
later are handled the same way, through their category and strength):

- a `decisive` row settles its category for the rank, host or GPU it names (high confidence);
- a `suggestive` row points at its category with lower confidence, higher when several rows or ranks agree;
- timeouts are victims: a rank that waited names no culprit. With nothing else, the usual cause is a rank
  that never reached (or never finished) the collective, said with low confidence and how to confirm it;
- `context` rows settle nothing.

The engine drops a finding of this playbook that a more specific playbook already made (same category, or
the same lines as evidence): the catalogue is the floor under the flowchart, not a second opinion on it.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

from hangdx.playbooks.engine import Match, playbook
from hangdx.playbooks.facts import Facts
from hangdx.playbooks.verdict import Culprit
from hangdx.probes.model import LogEvent

PLAYBOOK = "signals"
# How sure a decisive line makes an engineer, by what it settles: hardware lines name the part that broke.
DECISIVE = {
    "gpu_fault": 0.86,
    "network_fault": 0.84,
    "collective_mismatch": 0.85,
    "ddp_unused_parameters": 0.85,
    "rank_crashed": 0.8,
    "comm_init_failure": 0.8,
    "dataloader_stall": 0.76,
    "io_stall": 0.74,
}
DECISIVE_DEFAULT = 0.75
SUGGESTIVE = 0.5
AGREE_BONUS = 0.05  # per other row or rank saying the same, up to AGREE_MAX
AGREE_MAX = 0.1
TIMEOUT_ALONE = 0.3
# Kinds of waiting: the line is said by a victim of the hang, not by its cause.
_WAITING = re.compile(r"watchdog|collective_timeout|gloo_timeout|nccl_timeout|monitored_barrier|desync")
_ABSENTEES = re.compile(r"monitored_barrier")  # these name the ranks that did not arrive
_SAFE_NAME = re.compile(r"[A-Za-z0-9…][\w.\-…]{0,62}")


def _kind(e: LogEvent) -> str:
    return str(
        e.fields.get("signal_event") or e.kind
    )  # a kind kept aside for lack of fields (probes/signals.py)


def _waiting(e: LogEvent) -> bool:
    return bool(_WAITING.search(_kind(e)))


def _gpu(e: LogEvent) -> str | None:
    for key in ("bus_id", "gpu", "gpu_uuid"):
        value = e.fields.get(key)
        if value not in (None, ""):
            return f"{e.host}:{value}" if e.host else str(value)
    return None


_PORT = re.compile(r"<\d{1,5}>$|:\d{1,5}$")


def _peer(e: LogEvent) -> str | None:
    """The peer a line blames (`closed by remote peer node2<55555>`, `[10.0.0.7]:35411`), without its port."""
    value = e.fields.get("peer")
    if not value:
        return None
    return _PORT.sub("", str(value).strip("[]")).strip("[]") or None


def _culprit(events: list[LogEvent], category: str = "") -> Culprit:
    # A line that says its peer went away is printed by the survivor: for a crash, the peer is the culprit.
    blamed = [e for e in events if category == "rank_crashed" and _peer(e)]
    if blamed:
        others = [e for e in events if e not in blamed]
        c = _culprit(others) if others else Culprit()
        c.hosts = sorted(set(c.hosts) | {p for e in blamed if (p := _peer(e))})
        return c
    ranks = sorted({e.rank for e in events if e.rank is not None})
    hosts = sorted({e.host for e in events if e.host})
    gpus = list(dict.fromkeys(g for e in events if (g := _gpu(e))))
    procs = []
    if not ranks:
        procs = list(
            dict.fromkeys(f"{e.host} pid {e.pid}" if e.host else f"pid {e.pid}" for e in events if e.pid)
        )
    return Culprit(ranks=ranks, hosts=hosts, gpus=gpus, processes=procs[:8])


def _the_one_aborted(facts: Facts, events: list[LogEvent]) -> list[int]:
    """A launcher's abort table (MPICH's `job aborted:`) naming one process: a line printed without a rank in the
    same output (an MPI error stack) is that process's. Two or more processes named: no telling whose it is."""
    sources = {e.quote.source for e in events}
    ranks = {
        e.rank
        for e in facts.ev.events_of("mpi_abort_entry")
        if e.rank is not None and e.quote.source in sources
    }
    return sorted(ranks) if len(ranks) == 1 else []


def _said(events: list[LogEvent]) -> list[dict[str, Any]]:
    """What each row saw, once per row: for the words of the finding."""
    from hangdx.probes import catalogue

    try:
        rows = catalogue.load().by_id
    except catalogue.CatalogueError:
        rows = {}
    out: dict[str, dict[str, Any]] = {}
    for e in events:
        rid = str(e.fields.get("signal_row"))
        if rid not in out:
            row = rows.get(rid)
            out[rid] = {
                "id": rid,
                "emitter": row.emitter if row else "",
                "meaning": row.meaning if row else "",
                "line": " ".join(e.quote.text.split())[:200],
                "count": 0,
            }
        out[rid]["count"] += 1
    return list(out.values())


def _where(c: Culprit) -> dict[str, Any]:
    """Names safe to put in a suggested command (a log's text is never a command's target as it stands)."""
    hosts = [h for h in c.hosts if _SAFE_NAME.fullmatch(h)]
    return {"host": hosts[0] if len(hosts) == 1 and not hosts[0].startswith("…") else None, "ranks": c.ranks}


def _confidence(base: float, events: list[LogEvent]) -> float:
    rows = {e.fields.get("signal_row") for e in events}
    speakers = {(e.host, e.rank, e.pid) for e in events}
    agree = (len(rows) - 1) + (len(speakers) - 1)
    return round(base + min(AGREE_MAX, AGREE_BONUS * agree), 2)


@playbook(PLAYBOOK, order=97)
def signals(facts: Facts) -> Iterator[Match]:
    """What the lines of the signal catalogue say, when no more specific playbook said it."""
    marked = [e for e in facts.ev.events if e.fields.get("signal_row") and e.fields.get("signal_category")]
    waiting = [e for e in marked if _waiting(e)]
    # An exit, a closed connection, a peer gone: what every rank's end looks like after a timeout too. Beside
    # timeouts, only a decisive line (the OOM killer, a segfault, CUDA out of memory) says a crash came first.
    causes = [
        e
        for e in marked
        if not _waiting(e)
        and not (
            waiting
            and e.fields["signal_category"] == "rank_crashed"
            and e.fields.get("signal_strength") != "decisive"
        )
    ]
    by_cat: dict[str, dict[str, list[LogEvent]]] = {}
    for e in causes:
        strength = e.fields.get("signal_strength")
        by_cat.setdefault(str(e.fields["signal_category"]), {}).setdefault(str(strength), []).append(e)
    for category, by_strength in by_cat.items():
        decisive = by_strength.get("decisive", [])
        events = decisive or by_strength.get("suggestive", [])
        if not events:
            continue
        base = DECISIVE.get(category, DECISIVE_DEFAULT) if decisive else SUGGESTIVE
        culprit = _culprit(events, category)
        if not culprit.ranks:
            culprit.ranks = _the_one_aborted(facts, events)
        victims = sorted({e.rank for e in waiting if e.rank is not None} - set(culprit.ranks))
        yield Match(
            category,
            _confidence(base, events),
            culprit,
            [e.quote for e in events[:6]] + [e.quote for e in waiting[:2]],
            {
                "category": category,
                "strength": "decisive" if decisive else "suggestive",
                "said": _said(events),
                "victims": victims,
                "where": _where(culprit),
                "alone": False,
            },
            status="failed" if category == "rank_crashed" else None,
            template=PLAYBOOK,
        )
    if waiting and not by_cat:
        yield _waiting_alone(facts, waiting)
    if not marked:
        context = [e for e in facts.ev.events if e.fields.get("signal_strength") == "context"]
        if context:
            yield _context_only(context)


CONTEXT_ONLY = 0.12  # above what_next's 0.1: it says what was seen, and still names no cause


def _context_only(events: list[LogEvent]) -> Match:
    """Lines the catalogue knows but that settle nothing (a bare NCCL warning, a version banner): say them."""
    return Match(
        "unknown",
        CONTEXT_ONLY,
        _culprit(events[:1]) if len({(e.host, e.rank) for e in events}) == 1 else Culprit(),
        [e.quote for e in events[:4]],
        {
            "category": "unknown",
            "strength": "context",
            "said": _said(events),
            "victims": [],
            "where": {},
            "alone": False,
            "context_only": True,
        },  # fmt: skip
        template=PLAYBOOK,
    )


def _waiting_alone(facts: Facts, waiting: list[LogEvent]) -> Match:
    """Only timeouts: the ranks that timed out are the victims; the usual cause is one that never arrived."""
    absent = sorted(
        {
            e.fields["rank"]
            for e in waiting
            if _ABSENTEES.search(e.kind) and isinstance(e.fields.get("rank"), int)
        }
    )
    reporters = sorted({e.rank for e in waiting if e.rank is not None})
    silent: list[int] = []
    if facts.world_size and reporters and not absent:
        silent = sorted(set(range(facts.world_size)) - set(reporters))
        silent = silent if len(silent) <= max(1, facts.world_size // 4) else []
    culprit = Culprit(ranks=absent or silent)
    # A timeout names the rank that waited: with no rank named as absent, the cause is not known yet (the words
    # still say what the usual cause is and how to confirm it).
    return Match(
        "conditional_collective" if absent or silent else "unknown",
        TIMEOUT_ALONE + (0.15 if absent or silent else 0.0),
        culprit,
        [e.quote for e in waiting[:4]],
        {
            "category": "conditional_collective" if absent or silent else "unknown",
            "strength": "suggestive",
            "said": _said(waiting),
            "victims": reporters,
            "where": _where(culprit),
            "alone": True,
            "absent": absent,
            "silent": silent,
            "ops": sorted({str(e.fields["op"]) for e in waiting if e.fields.get("op")}),
            "seqs": sorted({int(e.fields["seq"]) for e in waiting if isinstance(e.fields.get("seq"), int)}),
        },
        status="hung",
        template=PLAYBOOK,
    )
