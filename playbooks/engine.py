"""The playbook engine: run every playbook over the facts, render their words, rank the findings.

A playbook is a plain function registered with `@playbook(...)`: it reads `Facts` and yields
`Match`es (category, culprit, confidence, evidence, and a context for its template). What a
finding *says* (summary, fix, next steps) lives in `templates/<playbook>.j2`, as three Jinja2
macros, so that an on-call engineer can change the words without touching Python.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import jinja2

from hangdx.playbooks.facts import Facts, derive
from hangdx.playbooks.roles import stack_roles
from hangdx.playbooks.verdict import Culprit, Finding, Verdict
from hangdx.playbooks.wording import number_set
from hangdx.probes.model import Evidence, Quote

MAX_EVIDENCE = 12


@dataclass
class Match:
    """What a playbook found, before its template turns it into words."""

    category: str
    confidence: float
    culprit: Culprit
    evidence: list[Quote] = field(default_factory=list)
    context: dict[str, Any] = field(default_factory=dict)
    status: str | None = None  # hung | progressing | failed, when the playbook knows better
    template: str | None = None  # templates/<template>.j2; default: the playbook's name


@dataclass(frozen=True)
class Playbook:
    name: str
    order: int
    func: Callable[[Facts], Iterable[Match]]
    description: str


_PLAYBOOKS: list[Playbook] = []


def playbook(
    name: str, order: int
) -> Callable[[Callable[[Facts], Iterable[Match]]], Callable[[Facts], Iterable[Match]]]:
    """Register a playbook; `order` is its place in the debugging flowchart."""

    def register(func: Callable[[Facts], Iterable[Match]]) -> Callable[[Facts], Iterable[Match]]:
        _PLAYBOOKS.append(Playbook(name, order, func, (func.__doc__ or "").strip().splitlines()[0]))
        return func

    return register


def playbooks() -> list[Playbook]:
    from hangdx.playbooks import (  # noqa: F401 - registers the playbooks
        exits,
        flowchart,
        gpu_health,
        horovod,
        measured,
        nccl_logs,
        ncclras,
        p2p_bandwidth,
        partial,
        pasted_code,
        process_reports,
        signals,
        timeline,
        uneven_loops,
    )

    return sorted(_PLAYBOOKS, key=lambda p: p.order)


class _CompiledTemplates(jinja2.FileSystemBytecodeCache):
    """The templates compiled once, kept in the user's cache (compiling the few a verdict needs took most of the
    time of putting it into words); Jinja compiles a template again when its source changed. Only a file this
    user owns that nobody else may write is loaded, and a cache that cannot be written is none: still right."""

    def __init__(self) -> None:
        from hangdx.probes.catalogue import _cache_dir

        super().__init__(str(_cache_dir()), "template-%s.jinja")

    def load_bytecode(self, bucket: jinja2.bccache.Bucket) -> None:
        try:
            st = os.stat(self._get_cache_filename(bucket))
            if st.st_uid != os.getuid() or st.st_mode & 0o022:
                return
            super().load_bytecode(bucket)
        except Exception:  # noqa: BLE001 - a missing or damaged file: compiled again
            bucket.reset()

    def dump_bytecode(self, bucket: jinja2.bccache.Bucket) -> None:
        try:
            os.makedirs(self.directory, mode=0o700, exist_ok=True)
            super().dump_bytecode(bucket)
        except OSError:
            pass


_env = jinja2.Environment(
    loader=jinja2.PackageLoader("hangdx.playbooks", "templates"),
    bytecode_cache=_CompiledTemplates(),
    undefined=jinja2.StrictUndefined,
    trim_blocks=True,
    lstrip_blocks=True,
    autoescape=False,
)
_env.filters["ranks"] = number_set  # `0-776 and 778-1023 (1,023 ranks)`: a summary stays short at any scale
_env.filters["plural"] = lambda n, word, many=None: word if n == 1 else (many or word + "s")


def _words(name: str, ctx: dict[str, Any]) -> tuple[str, str, list[str]]:
    module = _env.get_template(f"{name}.j2").make_module(ctx)
    summary = " ".join(str(module.summary()).split())
    fix = " ".join(str(module.fix()).split())
    steps = [" ".join(s.split()) for s in str(module.next_steps()).splitlines() if s.strip()]
    return summary, fix, [s.lstrip("- ") for s in steps]


def _dedupe(quotes: list[Quote]) -> list[Quote]:
    seen, out = set(), []
    for q in quotes:
        key = (q.source, q.line, q.text)
        if key not in seen:
            seen.add(key)
            out.append(q)
    return out[:MAX_EVIDENCE]


def run(ev: Evidence) -> Verdict:
    """Diagnose: facts from evidence, findings from playbooks, most likely first."""
    started = time.monotonic()
    facts = derive(ev)
    have = _have(ev)
    findings: list[Finding] = []
    statuses: list[str] = []
    for pb in playbooks():
        for m in _matches(pb, facts, ev):
            ctx = {"facts": facts, "culprit": m.culprit, "have": have, **m.context}
            try:
                summary, fix, steps = _words(m.template or pb.name, ctx)
            except jinja2.TemplateError as e:
                # Words that could not be rendered (a template edited out of step with its playbook): a gap
                # in this verdict, never the end of it.
                ev.gap(f"playbook {pb.name}", f"its words failed: {type(e).__name__}: {str(e)[:200]}")
                continue
            findings.append(
                Finding(
                    pb.name, m.category, m.confidence, summary, m.culprit, _dedupe(m.evidence), fix, steps
                )
            )
            if m.status:
                statuses.append(m.status)
    findings = _floor_explained(findings)
    if any(f.playbook != "what_next" for f in findings):
        findings = [f for f in findings if f.playbook != "what_next"]
    _hardware_explains_crash(findings)
    findings.sort(key=lambda f: -f.confidence)
    findings = _distinct(findings)
    _close_call(findings)
    status = _status(facts, findings, statuses)
    return Verdict(
        job_id=ev.job_id,
        status=status,
        findings=findings,
        gaps=[f"{g.source}: {g.message}" for g in ev.gaps],
        elapsed_seconds=time.monotonic() - started,
        read=list(ev.reads),
        notes=_matcher_note(ev),
        stack_roles=stack_roles(facts),
    )


def _matcher_note(ev: Evidence) -> list[str]:
    """Said once: the catalogue was matched without Hyperscan (same hits, slower on big logs)."""
    if not any(e.fields.get("signal_row") for e in ev.events):
        return []
    from hangdx.probes import catalogue

    try:
        engine = catalogue.load().engine
    except catalogue.CatalogueError:
        return []
    if engine == "hyperscan":
        return []
    return [
        "signal catalogue matched by its pure-Python path (hyperscan is not installed): same hits, slower on big logs"
    ]


def _matches(pb: Playbook, facts: Facts, ev: Evidence) -> list[Match]:
    """One playbook's matches; a playbook that fails on evidence it did not expect (an event a catalogue row
    made, short of a field) is a gap, never the end of the verdict."""
    try:
        return list(pb.func(facts))
    except Exception as e:  # noqa: BLE001
        ev.gap(
            f"playbook {pb.name}",
            f"failed on this evidence: {type(e).__name__}: {' '.join(str(e).split())[:200]}",
        )
        return []


def _have(ev: Evidence) -> dict[str, bool]:
    """What the evidence already holds, so that no next step asks for it again."""
    return {
        "flight_recorder": any(c.origin == "flight_recorder" for c in ev.collectives),
        "stacks": bool(ev.stacks),
        "nccl_log": any(c.origin == "nccl_log" for c in ev.collectives),
    }


FLOOR = "signals"  # the catalogue's playbook: the floor under the others (playbooks/signals.py)


def _floor_explained(findings: list[Finding]) -> list[Finding]:
    """A catalogue finding that a more specific playbook already made (its category, or its lead line) goes.

    Only its lead line (the cause it names) counts: the waiting ranks' lines it quotes after it for context are
    the other playbooks' evidence too, and sharing them does not mean the cause was already read (an Xid, a
    runtime's GPU Hang before the timeouts that a sequence playbook read as a divergence)."""
    others = [f for f in findings if f.playbook not in (FLOOR, "what_next")]
    seen = {(q.source, q.line) for f in others for q in f.evidence}
    cats = {f.category for f in others}
    out = []
    for f in findings:
        if f.playbook == FLOOR and (
            f.category in cats or any((q.source, q.line) in seen for q in f.evidence[:1])
        ):
            continue
        out.append(f)
    return out


def _hardware_explains_crash(findings: list[Finding]) -> None:
    """A rank that died on a host whose GPU or link failed died of it: the hardware is the root cause.

    Only a fault of the dead rank's own end: a fault the hardware finding pins on other ranks (a survivor whose
    NCCL reports that its peer closed the connection, the dead rank's departure seen from the other side) does
    not explain the death, even when both ranks share a host."""
    for crash in [f for f in findings if f.category == "rank_crashed"]:
        for hw in findings:
            if (
                hw.culprit.ranks
                and crash.culprit.ranks
                and not set(hw.culprit.ranks) & set(crash.culprit.ranks)
            ):
                continue
            if hw.category in ("gpu_fault", "network_fault") and set(hw.culprit.hosts) & set(
                crash.culprit.hosts
            ):
                hw.confidence = max(hw.confidence, min(0.97, round(crash.confidence + 0.02, 2)))


def _distinct(findings: list[Finding]) -> list[Finding]:
    """Two playbooks reaching the same category and culprit: keep the surer one."""
    kept: dict[tuple, Finding] = {}
    for f in findings:
        key = (f.category, tuple(sorted(set(f.culprit.ranks))))
        first = kept.get(key)
        if first is None:
            kept[key] = f
            continue
        # The surer finding keeps its words; it gains what the other saw (a GPU, a link, a host).
        for attr in ("hosts", "gpus", "links"):
            merged = list(dict.fromkeys(getattr(first.culprit, attr) + getattr(f.culprit, attr)))
            setattr(first.culprit, attr, merged)
        first.evidence = _dedupe(first.evidence + f.evidence)
    return list(kept.values())


CLOSE = 0.05  # two causes this close are a close call: neither is as sure as it would be alone


def _close_call(findings: list[Finding]) -> None:
    """Two different causes nearly as likely as each other: the evidence conflicts, so each is less sure than
    it would be alone, and the most likely one's words name the other."""
    named = [f for f in findings if f.category != "unknown"]
    if len(named) < 2 or findings[0] is not named[0]:
        return
    top, second = named[0], named[1]
    if top.category == second.category or top.confidence - second.confidence > CLOSE:
        return
    if top.playbook == second.playbook == FLOOR:
        return  # the catalogue's floor weighed its own competing lines already (playbooks/signals.py)
    top.confidence = round(top.confidence - CLOSE, 2)
    second.confidence = round(second.confidence - CLOSE, 2)
    other = second.summary.split(": ", 1)[0] if ": " in second.summary[:120] else second.summary[:120]
    top.summary += (
        f" Nearly as likely, from other lines: {second.category.replace('_', ' ')} ({other.rstrip('.')})."
    )


def _status(facts: Facts, findings: list[Finding], statuses: list[str]) -> str:
    top = findings[0] if findings else None
    if top is not None and top.category == "straggler":
        return "progressing"
    if facts.progressing:
        return "progressing"
    if facts.progressing is False:
        return "hung"
    if "failed" in statuses:
        return "failed"
    if "hung" in statuses:
        return "hung"
    return "unknown"
